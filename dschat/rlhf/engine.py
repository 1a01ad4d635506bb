"""DeepSpeedRLHFEngine: the four (or five) models of PPO, each with its own DeepSpeed config.

actor (trainable; wrapped by dschat's hybrid engine when enabled), reference (frozen), critic (trainable,
from the step-2 reward model), reward (frozen), and an optional EMA copy of the actor.
"""
import argparse
import copy
import functools

from dschat.args import (check_repetition_penalty_flag, check_sampling_flags, critic_only_flags, given_flags,
                         hybrid_engine_only_flags, unread_conditional_flags)
from dschat.compat import engine_takes_checkpointing_calls
from dschat.data.raw_datasets import check_data_paths
from dschat.data.splits import check_phase_share
from dschat.errors import MissingInputError, UsageError
from dschat.models.checkpoint import SAVED_DTYPE_ATTRIBUTE
from dschat.models.layers import (check_config_forwards_alike, check_ranks_gather_alike, refuse_hf_generation,
                                  refuse_unpinned_generation)
from dschat.models.loading import (TORCH_DTYPES, check_sequence_fits, config_dropouts, embedding_rows,
                                   generable_token_count, load_causal_lm, load_tokenizer)
from dschat.models.lora import apply_lora, check_only_optimize_lora
from dschat.models.reward_model import VALUE_HEAD_FILES, create_critic_model
from dschat.models.training_engine import (check_schedule_reaches_its_end, collective_may_be_pending,
                                           initialize_engine, initialize_frozen, release_all, released_engines)
from dschat.rlhf.config import (check_accumulation, check_advantage_estimator, check_earlier_step_outputs,
                                check_ema_beta, check_freezing_actor_steps, check_kl_settings,
                                optimizer_steps_per_iteration, step3_args, untrained_reward_model_message)
from dschat.rlhf.overflow import check_align_overflow
from dschat.rlhf.reward_fn import check_reward_sources, load_reward_fn
from dschat.steps.common import setup_run, warn_of_unfinished_inputs
from dschat.utils.checkpoints import with_universal_load
from dschat.utils.dist import get_world_size, print_rank_0
from dschat.utils.ds_config import (apply_user_ds_config, frozen_copy_stage, get_eval_ds_config, get_train_ds_config,
                                    owned_key_flags, user_ds_config_path)

DEFAULT_TOTAL_ITERS = 10_000


class BuiltArgs(argparse.Namespace):
    """A DeepSpeedRLHFEngine's ``args``: the settings it was built with, read-only. Writable, ``engine.args.X = v``
    changed nothing the engine had built, and reached a trainer built on it or not depending on whether that trainer
    had copied them yet (its first change of a setting did); each trainer reads its own args now (``trainer.args``,
    copied from these when it is built, where it is given none)."""

    @classmethod
    def of(cls, args):
        built = cls.__new__(cls)
        built.__dict__.update(unshared_settings(args))  # (not through __setattr__)
        return built

    def __setattr__(self, name, value):
        raise built_args_error(name, f"engine.args.{name} = {value!r}", value)

    def __delattr__(self, name):
        raise built_args_error(name, f"del engine.args.{name}")


def unshared_settings(args):
    """``vars(args)`` with its lists (and dicts, sets) copied: a copy of args that shared them (--data_path,
    --sft_only_data_path) changed with the other, ``trainer.args.data_path.append(...)`` the engine's read-only args.
    Other values stay as they are (``reward_fn`` may be a callable object holding a model)."""
    return {name: copy.deepcopy(value) if isinstance(value, (list, dict, set)) else value
            for name, value in vars(args).items()}


def built_args_error(name, what, value=None):
    """The UsageError of a write to an engine's args, saying where the setting is changed instead."""
    from dschat.rlhf.trainer import ENGINE_BUILT, ENGINE_SETTINGS

    if name in ENGINE_SETTINGS or name in {flag for flag, _, _ in ENGINE_BUILT}:
        instead = f"build a new DeepSpeedRLHFEngine with {name}"
    else:
        instead = (f"set it on the trainer, whose settings are its own args (trainer.args.{name} = {value!r}), or "
                   f"give a new trainer its args: DeepSpeedPPOTrainer(engine, {{**vars(engine.args), {name!r}: "
                   f"{value!r}}})")
    return UsageError(f"{what}: an engine's args are the settings it was built with, read-only (a trainer copies them "
                      f"when it is built, and reads its own after); {instead}")


def uses_cuda_graph(args):
    """``--enable_cuda_graph`` as given, else on when training on CUDA with the parameters pinned: the eager decode
    loop is bound by Python's kernel launches (3-7x slower, docs/benchmarks.md), and unpinned ZeRO-3 parameters are
    gathered inside the forward, which a graph cannot replay. Below ZeRO-3 --unpin_actor_parameters changes nothing
    (the weights are whole on every rank), so the graphs stay on (it turned them off, for an eager loop 3-7x slower)."""
    if args.enable_cuda_graph is not None:
        return bool(args.enable_cuda_graph)
    from deepspeed.accelerator import get_accelerator

    gathers_in_forward = args.unpin_actor_parameters and args.actor_zero_stage == 3
    return get_accelerator().device_name() == "cuda" and not gathers_in_forward


def step3_train_config(args, world_size, stage, hybrid=False, role="actor", quiet=False):
    """The training config of step 3's actor or critic: built from the flags, with the user's config file (if any)
    merged over it; the file's hybrid engine block is the actor's. ``quiet``: no notes (a check before the step)."""
    a = args
    # (DeepSpeed's check would not say which model: --actor_zero_stage 3 left the critic at 0)
    if a.offload and not stage:
        raise UsageError(f"--offload: the {role} trains at ZeRO stage 0 (--{role}_zero_stage, else --zero_stage, "
                         f"else 0), and optimizer offload needs ZeRO stage 1, 2 or 3: give --{role}_zero_stage too")
    generated = get_train_ds_config(
        offload=a.offload, dtype=a.dtype, stage=stage, micro_batch_size=a.per_device_training_batch_size,
        gradient_accumulation_steps=a.gradient_accumulation_steps, world_size=world_size,
        enable_hybrid_engine=hybrid, inference_tp_size=a.inference_tp_size,
        release_inference_cache=a.release_inference_cache, pin_parameters=not a.unpin_actor_parameters,
        tp_gather_partition_size=a.tp_gather_partition_size,
        max_out_tokens=longest_sequence(a), enable_cuda_graph=uses_cuda_graph(a),
        # a TensorBoard run of each model's own (DeepSpeed-Chat's step3_actor / step3_critic): in one, the two engines'
        # monitors write the same tags (Train/Samples/lr) and their curves interleave
        enable_tensorboard=a.enable_tensorboard, tb_path=a.tensorboard_path, tb_name=f"step3_{role}",
        check_grad_overflow=a.check_grad_overflow,
        enable_mixed_precision_lora=role == "actor" and check_mixed_precision_lora(a))
    flags = owned_key_flags("--per_device_training_batch_size", f"--{role}_zero_stage (or --zero_stage)",
                            "--enable_hybrid_engine")
    config = apply_user_ds_config(generated, user_ds_config_path(a), flags,
                                  ignore=() if role == "actor" else ("hybrid_engine",), quiet=quiet)
    if hybrid:
        check_hybrid_block(config, user_ds_config_path(a))
    if role == "actor" and a.unsupervised_dataset_name:
        # PPO-ptx (DeepSpeed-Chat's): the actor's PPO micro-step and the language-model micro-step that follows it
        # accumulate into one optimizer step, so the actor steps as often as the critic, on one schedule. Doubled
        # after the user's file is merged, which states the flags' accumulation. So one step's gradient is
        # (PPO + unsup_coef x LM) / 2, clipped together (DeepSpeed-Chat takes two steps, each clipped on its own).
        for key in ("gradient_accumulation_steps", "train_batch_size"):
            config[key] *= 2
    return config


def check_hybrid_block(config, source):
    """The actor's merged ``hybrid_engine`` block read as dschat's engine reads it, when the config is built: the block
    never reaches DeepSpeed, so an option of the user's file the engine does not know (a typo) or of another type
    failed only once the actor had loaded, in an error that named no file."""
    from dschat.hybrid_engine.config import HybridEngineConfig

    try:
        HybridEngineConfig.from_ds_config(config)
    except (TypeError, ValueError) as error:
        where = f"DeepSpeed config {source!r}" if isinstance(source, str) else "the DeepSpeed config"
        raise UsageError(f"{where}: {error}") from None


def longest_sequence(args):
    """Prompt + answer of the longest generation step 3 runs: training's, or the held-out evaluation's."""
    return args.max_prompt_seq_len + max(args.max_answer_seq_len, args.eval_max_new_tokens or 0)


LONGEST_SEQUENCE_FLAGS = "--max_prompt_seq_len + the longer of --max_answer_seq_len and --eval_max_new_tokens"


def check_mixed_precision_lora(args):
    """Whether --enable_mixed_precision_lora is on; an error naming the flag when what it needs is not."""
    if not args.enable_mixed_precision_lora:
        return False
    needs = {"--actor_lora_dim > 0": args.actor_lora_dim > 0, "--actor_zero_stage 3": args.actor_zero_stage == 3,
             "--dtype fp16": args.dtype == "fp16"}
    missing = [flag for flag, ok in needs.items() if not ok]
    if missing:
        raise UsageError(f"--enable_mixed_precision_lora quantizes the actor's frozen weights under ZeRO-3; it also "
                         f"needs {', '.join(missing)} (DeepSpeed quantizes fp16 weights only)")
    return True


def check_quantizer_available(args):
    """--enable_mixed_precision_lora stores the frozen weights with DeepSpeed's quantizer op, which some accelerators
    do not build (the CPU's): said before anything loads, not as DeepSpeed's "not implemented" traceback from inside
    the actor's load."""
    if not args.enable_mixed_precision_lora:
        return
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    builder = accelerator.get_op_builder("QuantizerBuilder")
    if builder is None or builder.__name__ == "NotImplementedBuilder":
        raise UsageError(f"--enable_mixed_precision_lora: DeepSpeed's {accelerator.device_name()} accelerator has no "
                         "quantizer op to store the frozen weights in int8 (it needs a GPU); drop the flag")


def quantize_frozen_weights(engine):
    """Mixed Precision ZeRO++: store the frozen (non-LoRA) partitions in int8. DeepSpeed decides what to quantize
    when it partitions the model, before LoRA froze the base weights, hence this second pass (as DeepSpeed-Chat
    does). Returns how many weights are stored quantized."""
    from dschat.compat import zero3_single_rank_dequantizer

    zero3_single_rank_dequantizer()
    engine.optimizer.quantize_nontrainable_params()
    return sum(hasattr(getattr(p, "ds_tensor", None), "ds_quant_scale") for p in engine.module.parameters())


def check_hybrid_engine_flags(args):
    """Flags only the hybrid engine reads, given other than their defaults without --enable_hybrid_engine: an error
    (they would change nothing: HF's generate makes the answers). Defaults given explicitly, as DeepSpeed-Chat's
    scripts do, pass."""
    if args.enable_hybrid_engine:
        return
    given = hybrid_engine_only_flags(args)
    if given:
        raise UsageError(f"{', '.join(given)}: read by the hybrid engine only, which is off (step 3 then generates "
                         f"with HF's generate, which ignores {'it' if len(given) == 1 else 'them'}); add "
                         f"--enable_hybrid_engine, or leave {'it' if len(given) == 1 else 'them'} out")


def model_config_or_none(path, local_only):
    """The HF config of ``path`` (a folder, hub name or tiny preset), or None where it cannot be read (yet: train.py
    checks step 3 before step 1 writes the actor; loading the model says what is wrong). ``local_only``: a hub
    model's config only from the cache (a missing folder would look like a hub name and cost the hub's retries)."""
    from transformers import AutoConfig

    from dschat.models.loading import resolve_model_path

    try:
        return AutoConfig.from_pretrained(resolve_model_path(path), local_files_only=local_only)
    except (OSError, ValueError):
        return None


def _fetched_hub_config(path, checked, flag, before_training):
    """The config of the hub model ``path`` that is not in the hub cache yet, fetched (its config.json alone) for a
    check of step 3's before its weights load; None where ``path`` is no such name (a folder step 1 writes later).
    With the hub not to be asked (offline, unreachable) the model cannot load at all: an error naming ``flag`` now (it
    was a warning that step 3 checks it when it loads the actor, said where step 3 then refused it, or was loading it).
    One that cannot be fetched otherwise (a gated model, a failed request) is said, ``before_training`` (the settings'
    check), to leave ``checked`` unchecked until step 3 loads the actor; when it loads, the load that follows fetches
    the same file and says why it cannot, or the hybrid engine checks the loaded actor."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    from dschat.models.loading import hub_name_not_cached, hub_unavailable, unfetchable_hub_name

    if not hub_name_not_cached(path):
        return None
    if hub_unavailable():
        raise MissingInputError(f"{flag} {unfetchable_hub_name(path)}")
    try:
        hf_hub_download(path, "config.json")  # (the weights come when step 1 or step 3 loads the model)
        return model_config_or_none(path, local_only=True)
    except (OSError, ValueError, EntryNotFoundError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if before_training:
        print_rank_0(f"warning: the config of the actor {path} could not be fetched ({reason}): it was not checked "
                     f"{checked} before training; step 3 checks it when it loads the actor (with train.py, after "
                     "steps 1 and 2). --step3-args --no-enable_hybrid_engine (step 3's --no-enable_hybrid_engine) "
                     "generates with HF's generate, which needs no such check")
    return None


def actor_config_for_checks(args, actor_path, flag="--actor_model_name_or_path", before_training=True):
    """The actor's HF config, read once for the checks of it before its weights load (``check_inference_tp``,
    ``check_local_window``, ``check_actor_decodable``, ``check_lora_module_names``); None where it cannot be read
    yet. A hub actor's from the hub cache alone: one not in it has its config fetched where the hybrid engine's checks
    need it (``_fetched_hub_config``: the hub asked once, not through the hub client's retries; ``flag`` gave the actor,
    ``before_training``: the settings' check, not step 3's load of the actor)."""
    config = model_config_or_none(actor_path, local_only=True)
    if config is None and args.enable_hybrid_engine:
        config = _fetched_hub_config(actor_path, "for a local attention window (GPT-Neo's), which the hybrid engine's "
                                                 "cache cannot go past, nor for the hybrid engine's other needs (a "
                                                 "forward that takes a KV cache, a split over --inference_tp_size)",
                                     flag, before_training)
    return config


def check_inference_tp(args, world_size, hybrid_block, actor_path, config):
    """The hybrid engine's inference tensor parallelism (``hybrid_block``: the actor's merged ``hybrid_engine``
    config) checked before any weight loads: the group size divides the ranks, ZeRO-3 keeps the actor pinned, and
    the actor's family can be split (its ``config``, ``actor_config_for_checks``, with tensor_parallel's own plan
    on a meta-device model; None: checked when the engine builds it)."""
    from dschat.hybrid_engine.tensor_parallel import check_splits

    tp = hybrid_block.get("inference_tp_size", 1)
    if not args.enable_hybrid_engine or tp == 1:
        return
    source = f"--inference_tp_size {tp}" if tp == args.inference_tp_size else \
        f"hybrid_engine.inference_tp_size {tp} (the DeepSpeed config file)"
    if world_size % tp:
        raise UsageError(f"{source}: the run's {world_size} rank(s) do not split into inference groups of {tp}; "
                         f"give a divisor of {world_size} (1: no inference tensor parallelism)")
    if args.actor_zero_stage == 3 and not hybrid_block.get("pin_parameters", True):
        raise UsageError(f"{source} under ZeRO-3 keeps the actor's slices in a persistent inference copy: it cannot "
                         "run with --unpin_actor_parameters (hybrid_engine.pin_parameters false)")
    if config is None:
        return
    try:
        check_splits(config, tp)
    except (NotImplementedError, ValueError) as error:
        raise UsageError(f"{source}: the hybrid engine cannot split the actor {actor_path} (model type "
                         f"{config.model_type!r}) over {tp} ranks: {error}") from None


def check_lora_module_names(args, actor_config, critic_path):
    """--actor_/--critic_lora_module_name against the models' configs (built on the meta device: no weights) before
    anything loads; they were said only as each model loaded (after the actor, and under train.py after steps 1 and 2
    had trained). A model not readable yet (``actor_config`` or ``critic_path`` None: train.py's step 1 or 2 writes
    it later) or of a family transformers' auto classes cannot build is checked when it loads."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    from dschat.models.lora import lora_target_modules

    models = []
    if args.actor_lora_dim and args.actor_lora_module_name:
        models.append(("actor", args.actor_lora_module_name, actor_config, AutoModelForCausalLM))
    if args.advantage_estimator == "gae" and critic_path is not None and args.critic_lora_dim and \
            args.critic_lora_module_name:  # the critic's backbone: a base model
        models.append(("critic", args.critic_lora_module_name, model_config_or_none(critic_path, local_only=True),
                       AutoModel))
    for role, module_name, config, auto_class in models:
        if config is None:
            continue
        try:
            with torch.device("meta"):
                model = auto_class.from_config(config)
        except Exception:  # noqa: BLE001 (a family that will not build from its config here, e.g. DBRX's
            continue        # AttributeError on the meta device: checked when it loads, as before this check)
        lora_target_modules(model, module_name, f"--{role}_lora_module_name")


def check_local_window(args, actor_path, config):
    """A model whose local attention window bounds the hybrid engine's cache (GPT-Neo, ``longest_cache``) against the
    longest sequence step 3 generates: refused before any weight loads, not at the first generation. ``config``: the
    actor's (``actor_config_for_checks``), None where it cannot be read yet."""
    from dschat.hybrid_engine.cache import longest_cache

    if not args.enable_hybrid_engine:
        return
    window = longest_cache(config) if config is not None else None
    if window is not None and longest_sequence(args) > window:
        raise UsageError(f"the actor {actor_path} attends within a local window of {window} tokens, which the hybrid "
                         f"engine's KV cache cannot exceed; {LONGEST_SEQUENCE_FLAGS} is {longest_sequence(args)}: "
                         "generate at most the window, or run without the hybrid engine "
                         "(--no-enable_hybrid_engine: HF's generate)")


def check_actor_decodable(args, config):
    """An actor the hybrid engine cannot decode (a causal LM whose forward takes no KV cache: GPT-1, RWKV, XLNet,
    Reformer; or one listed, CPMAnt: ``check_decodable``) refused from its ``config`` (``actor_config_for_checks``)
    before any weight loads: the hybrid engine refused it only once built, after the actor's DeepSpeed engine. A
    config not readable yet (None), or that names no built-in causal LM (remote code), is checked when the engine is
    built."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from dschat.hybrid_engine.decode import check_class_decodable

    if not args.enable_hybrid_engine:
        return
    if config is None or getattr(config, "auto_map", None):
        return
    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ValueError, ImportError):  # (no causal LM of this config: loading the actor says so)
        return
    check_class_decodable(model_class)


def say_an_unapplied_repetition_penalty(model, penalty):
    """The actor's generation_config asks for a repetition penalty that step 3 samples without (it samples at
    --repetition_penalty, 1 by default, so that its answers come from the policy PPO scores): said, with the flag."""
    asked = getattr(getattr(model, "generation_config", None), "repetition_penalty", None)
    if isinstance(asked, (int, float)) and asked != penalty:
        print_rank_0(f"[step3] the actor's generation_config asks for repetition_penalty {asked}; the rollouts are "
                     f"sampled at --repetition_penalty {penalty} (the log-probs PPO trains on include no penalty: "
                     f"give --repetition_penalty {asked} to sample with it anyway)")


def say_generation_config_settings(model, args):
    """The actor's generation_config settings that no step-3 flag sets and its generation applies (e.g. a
    no_repeat_ngram_size; the held-out evaluation's greedy answers also take its repetition_penalty, which the
    rollouts replace by --repetition_penalty): said, once, where they apply. The rollouts' temperature, top-k, top-p
    and repetition penalty are the flags' (``trainer.sampling_kwargs``), as TRL's and OpenRLHF's are theirs."""
    from dschat.hybrid_engine.generate_args import generation_config_note
    from dschat.rlhf.trainer import sampling_kwargs

    ids = {"max_new_tokens": args.max_answer_seq_len, "eos_token_id": None, "pad_token_id": None}
    generations = {"rollouts": {**ids, **sampling_kwargs(args, hf_generate=not args.enable_hybrid_engine)}}
    if args.eval_prompts:
        generations["held-out evaluation"] = {**ids, "do_sample": False}  # (rlhf.evaluation.generate_answers)
    for name, call in generations.items():
        note = generation_config_note(model, call, "the actor's", f" to the {name}", "step-3 flag")
        if note:
            print_rank_0(f"[step3] {note}")


def say_a_dropout_in_training(model, dropout_flag, role, flag):
    """The actor or critic trains with its config's dropout (``flag`` not given): said. The rollout's log-probs and
    values come from eval-mode forwards (no dropout), the PPO step's from training-mode ones, so PPO's ratio and
    value clip measure dropout noise on data that is on-policy. DeepSpeed-Chat's step-3 scripts, and train.py here,
    give --actor_dropout 0.0; TRL's PPO turns dropout off in its policy and value models."""
    active = config_dropouts(model.config) if dropout_flag is None else {}
    if active:
        said = ", ".join(f"{field} {value}" for field, value in active.items())
        print_rank_0(f"[step3] the {role} trains with its config's dropout ({said}), which its rollout forwards "
                     f"run without: PPO's {'ratio' if role == 'actor' else 'value clip'} then sees the dropout's "
                     f"noise from the first step on; give {flag} 0.0 to train without it (as DeepSpeed-Chat's "
                     f"scripts do for the actor), or {flag} P to keep P without this note")


def check_settings(args):
    """The checks that read nothing but step 3's settings: run by the entry points and by ``DeepSpeedRLHFEngine``
    and ``DeepSpeedPPOTrainer`` (a notebook's settings, e.g. ``temperature=0``, fail there, not at the first
    generation)."""
    if not args.greedy:  # greedy reads neither temperature nor top_p
        check_sampling_flags(args.temperature, args.top_p)
    check_repetition_penalty_flag(args.repetition_penalty)
    check_hybrid_engine_flags(args)
    check_advantage_estimator(args)
    check_freezing_actor_steps(args)
    check_ema_beta(args)
    check_kl_settings(args)
    if args.reward_fn:
        load_reward_fn(args.reward_fn)  # a missing module, file or function fails now, not after the models load
    check_reward_sources(args)
    check_only_optimize_lora(args.only_optimize_lora, args.actor_lora_dim, args.critic_lora_dim)
    check_align_overflow(args)
    trained = {"--actor_learning_rate": args.actor_learning_rate}
    if args.advantage_estimator == "gae":  # (only GAE trains a critic)
        trained["--critic_learning_rate"] = args.critic_learning_rate
    check_schedule_reaches_its_end(args.lr_scheduler_type, trained)


def check_generation_gathers_alike(args, world_size, actor_ds_config, config):
    """An actor whose layers call other submodules by length (``layers.CALLS_VARY_BY_LENGTH``: RecurrentGemma,
    DeepSeek-V4) generating under ZeRO-3 fetched submodule by submodule (``--zero3_fetch module``) on several ranks,
    every forward a gather (HF generate, or the hybrid engine without pinned parameters), refused from its ``config``
    before any weight loads: the ranks gathered other weights (2 CPU ranks: gloo aborted). The hybrid engine checks
    its actor's own fetch units again when built (``check_ranks_gather_alike``), and so does the engine's
    ``_init_actor`` for HF generate."""
    if config is None or args.zero3_fetch != "module" or actor_ds_config["zero_optimization"]["stage"] != 3:
        return
    if not args.enable_hybrid_engine:
        refuse_hf_generation(config.model_type, world_size)
    elif not actor_ds_config.get("hybrid_engine", {}).get("pin_parameters", True):
        refuse_unpinned_generation(config.model_type, world_size)


def check_step3_forwards_alike(args, world_size, actor_ds_config, actor_config, critic_path, reward_path=None):
    """Every step-3 engine of a family whose every forward gathers other weights by width on several ranks
    (``layers.check_config_forwards_alike``: DeepSeek-V4 under ZeRO-3 with --zero3_fetch module) refused from its
    config before any weight loads: the actor (and the reference and EMA copies sharded like it), the critic and the
    reward model (sharded like the critic). ``critic_path``: None where train.py's step 2 writes it later;
    ``reward_path``: the reward model's where not the flags' (a notebook's ``reward_model_name_or_path=``)."""
    check_config_forwards_alike(lambda: actor_config, actor_ds_config["zero_optimization"]["stage"],
                                args.zero3_fetch, world_size, "the actor's")
    reward_path = reward_path or args.reward_model_name_or_path or critic_path
    for role, path, needed in (("the critic's", critic_path, args.advantage_estimator == "gae"),
                               ("the reward model's", reward_path, bool(args.reward_model_weight))):
        if needed and path is not None:
            # (the reward model's stage on several ranks is the critic's: frozen_twin, frozen_copy_stage)
            check_config_forwards_alike(functools.partial(model_config_or_none, path, local_only=True),
                                        args.critic_zero_stage, args.zero3_fetch, world_size, role)


def check_engines_gather_alike(args, world_size, actor_path, critic_path, reward_path):
    """``check_generation_gathers_alike`` and ``check_step3_forwards_alike`` for ``DeepSpeedRLHFEngine``'s models
    (the paths it was given), from their configs before anything loads: a notebook's engine, which makes no
    ``check_step3_settings``, met these refusals only once its actor had loaded (the load-time checks, which stay as
    backstops: a hub actor not cached yet has no config to read here)."""
    if args.zero3_fetch != "module" or world_size < 2:
        return  # (no refusal can come: no config is read)
    actor_ds_config = step3_train_config(args, world_size, args.actor_zero_stage, args.enable_hybrid_engine,
                                         quiet=True)
    actor_config = model_config_or_none(actor_path, local_only=True)
    check_generation_gathers_alike(args, world_size, actor_ds_config, actor_config)
    check_step3_forwards_alike(args, world_size, actor_ds_config, actor_config, critic_path, reward_path)


def check_step3_settings(args, world_size, actor_architecture=None, critic_made_later=False,
                         critic_architecture=None):
    """Every check of step 3's flags before any data or model loads: ``check_settings``, the data split and paths,
    gradient accumulation, the actor's config against the lengths and the hybrid engine (tensor parallelism, local
    attention window), and the actor's and critic's training configs built once, quietly, so that a config file that
    contradicts the flags fails now. ``actor_architecture``: where the actor's config is read for the checks that need
    it, when not from --actor_model_name_or_path (train.py, before step 1 writes that folder: the model step 1 starts
    from, whose architecture it keeps); ``critic_made_later``: train.py's step 2 writes the critic's folder, which may
    hold an earlier run's model: the critic's config is then read from ``critic_architecture``, the model step 2
    starts from, whose architecture it keeps (None: not known yet, the critic checked when step 3 loads it)."""
    check_settings(args)
    check_phase_share(args.data_split, 3)
    check_data_paths(args.data_path)
    actor = step3_train_config(args, world_size, args.actor_zero_stage, args.enable_hybrid_engine, quiet=True)
    check_quantizer_available(args)
    longest = longest_sequence(args)
    out_tokens = actor.get("hybrid_engine", {}).get("max_out_tokens", longest)
    if args.enable_hybrid_engine and out_tokens < longest:
        raise UsageError(f"hybrid_engine.max_out_tokens {out_tokens} (the DeepSpeed config file) is shorter than "
                         f"the longest sequence step 3 generates, {longest} (--max_prompt_seq_len + the longer of "
                         "--max_answer_seq_len and --eval_max_new_tokens): prompt + answer must fit")
    actor_path = actor_architecture or args.actor_model_name_or_path
    # (train.py's --actor-model: the model step 1 starts from)
    actor_config = actor_config_for_checks(args, actor_path,
                                           "--actor-model" if actor_architecture else "--actor_model_name_or_path")
    check_inference_tp(args, world_size, actor.get("hybrid_engine", {}), actor_path, actor_config)
    check_local_window(args, actor_path, actor_config)
    check_actor_decodable(args, actor_config)
    check_generation_gathers_alike(args, world_size, actor, actor_config)
    critic_path = critic_architecture if critic_made_later else args.critic_model_name_or_path
    check_step3_forwards_alike(args, world_size, actor, actor_config, critic_path)
    check_lora_module_names(args, actor_config, critic_path)
    check_accumulation(args)
    if args.advantage_estimator == "gae":
        step3_train_config(args, world_size, args.critic_zero_stage, role="critic", quiet=True)


def frozen_twin(args, role):
    """(ZeRO stage, the flag that sets it, why) of a frozen model ("reference", "reward"; the EMA copy is the
    reference's kind): the reference is sharded like the actor; the reward model like the critic, a model of its
    kind, and by --critic_zero_stage alone (train.py's --reward-zero-stage) when the estimator trains no critic."""
    if role != "reward":
        return args.actor_zero_stage, "--actor_zero_stage", "it is sharded like the actor"
    if args.advantage_estimator == "gae":
        return args.critic_zero_stage, "--critic_zero_stage", "it is sharded like the critic"
    return args.critic_zero_stage, "--critic_zero_stage", (f"--advantage_estimator {args.advantage_estimator} trains "
                                                           "no critic; the flag sets the reward model's stage")


def check_same_token_ids(actor_tokenizer, actor_path, other_tokenizer, other_path, role):
    """The critic and the reward model read the actor's token ids: their tokenizer must give every token of the
    actor's the same id, or they score other text than the actor wrote (and nothing would say so)."""
    differ = tokens_with_other_ids(actor_tokenizer, other_tokenizer)
    if differ:
        raise UsageError(f"{role} {other_path} has another tokenizer than the actor {actor_path}: {len(differ)} of "
                         f"the actor's tokens have another id or none there (e.g. {differ[0]!r}); it would score the "
                         "actor's token ids as other text. Train the reward model from a model with the actor's "
                         "tokenizer (the same family)")


def tokens_with_other_ids(reference, other):
    """The tokens of ``reference``'s vocabulary that ``other`` gives another id, or none."""
    theirs = other.get_vocab()
    return [token for token, index in reference.get_vocab().items() if theirs.get(token) != index]


def check_given_tokenizer(tokenizer, actor_path):
    """A notebook's ``tokenizer=`` is the actor's: another one's ids would be read as other text by the actor (and
    ids past its vocabulary would grow it random embedding rows). The given one may add tokens (an EOT token)."""
    from transformers import PreTrainedTokenizerBase

    from dschat.run_layout import python_str

    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise UsageError(f"tokenizer is a {type(tokenizer).__name__}, not a tokenizer: give the actor's, e.g. "
                         f"load_tokenizer({python_str(actor_path)}, padding_side='left') (from "
                         "dschat.models.loading), or none")
    from transformers import AutoTokenizer

    from dschat.models.loading import hub_load, resolve_model_path

    if tokenizer.name_or_path == resolve_model_path(actor_path):  # loaded from the actor (step 3's own): no second load
        return
    try:  # (as saved: dschat's own loading would refuse a tokenizer without EOS that the given one has added)
        own = hub_load(AutoTokenizer.from_pretrained, resolve_model_path(actor_path), use_fast=True)
    except (OSError, ValueError):  # a model folder without tokenizer files: nothing to compare with
        return
    differ = tokens_with_other_ids(own, tokenizer)
    if differ:
        differs = "1 of the actor's tokens has" if len(differ) == 1 else f"{len(differ)} of the actor's tokens have"
        raise UsageError(f"the tokenizer given is not the actor's ({actor_path}): {differs} another id or none in it "
                         f"(e.g. {differ[0]!r}), so the actor would read its ids as other text; give "
                         f"load_tokenizer({python_str(actor_path)}, padding_side='left'), or none")


def check_scores_actor_text(actor_tokenizer, actor_path, other_tokenizer, other_path, role, formats=True):
    """A critic or reward model reads the actor's token ids (``check_same_token_ids``); a reward model also scores
    them in the actor's format (``check_same_format``)."""
    check_same_token_ids(actor_tokenizer, actor_path, other_tokenizer, other_path, role)
    if formats:
        check_same_format(actor_tokenizer, actor_path, other_tokenizer, other_path, role)


def check_same_format(actor_tokenizer, actor_path, reward_tokenizer, reward_path, role):
    """The reward model scores the actor's text as the actor formats it (its chat template, its EOS): a reward
    model whose tokenizer formats a conversation otherwise (one family's base and instruct models) was trained on
    other text in step 2, and would score off the form it learned, with no word said."""
    from dschat.data.formatting import format_answer, format_prompt

    probe = [{"role": "user", "content": "Name a color."}]
    texts = [format_prompt(probe, tokenizer) + format_answer("Blue.", tokenizer, messages=probe)
             for tokenizer in (actor_tokenizer, reward_tokenizer)]
    if texts[0] != texts[1]:
        raise UsageError(f"{role} {reward_path} formats a conversation otherwise than the actor {actor_path} (its "
                         f"chat template or EOS token): it trains (or was trained) on text like {texts[1]!r}, and would score the "
                         f"actor's {texts[0]!r}. Train the reward model from a model with the actor's tokenizer files "
                         "(tokenizer_config.json's chat_template), or give them the same template")


def say_grown_embeddings(model, path, role, actor_rows):
    """A critic or reward model with fewer token embeddings than the actor (one family's sizes, e.g. Qwen2.5-7B's
    152064 and 0.5B's 151936, both past the tokenizer's ids) is grown to the actor's (``RewardModel.from_pretrained``'s
    ``min_embedding_rows``): an id the actor sampled past its own rows failed their forward mid-run (IndexError; a
    device-side assert on a GPU). Said."""
    if actor_rows > model.embedding_rows_loaded:
        print_rank_0(f"[step3] {role} {path} has {model.embedding_rows_loaded} token embeddings, the actor "
                     f"{actor_rows}: grown to {embedding_rows(model.rwtransformer)} (new rows), so that it reads "
                     "every token id the actor can sample")


class DeepSpeedRLHFEngine:
    """Builds and holds the PPO models.

    Both DeepSpeed-Chat's positional form ``DeepSpeedRLHFEngine(actor_path, critic_path, tokenizer, args,
    num_total_iters)`` and the keyword form ``DeepSpeedRLHFEngine(actor_model_name_or_path=..., tokenizer=...,
    args=...)`` work; ``args`` may be the step-3 namespace, a dict or any object (missing fields get defaults).
    ``with DeepSpeedRLHFEngine(...) as engine:`` releases it (``release()``) as the block ends, by an error too.
    """

    _released = False  # (a class default: tests build engines without __init__)
    # {setting: value} its optimizers run at in place of args' (the learning rates a checkpoint's DeepSpeed load
    # restored: load_checkpoint); every trainer on it takes them (trainer.trainer_args). Replaced, never changed.
    restored_settings = {}
    MODEL_ROLES = ("actor", "ref", "actor_ema", "critic", "reward")  # the engines it holds (None: a model not built)

    def __init__(self, actor_model_name_or_path=None, critic_model_name_or_path=None, tokenizer=None, args=None,
                 num_total_iters=None, reward_model_name_or_path=None, actor_total_iters=None, load_universal=(),
                 lora_from=None):
        """``num_total_iters``: the optimizer steps the learning-rate schedules span; ``actor_total_iters``: the
        actor's, where it trains fewer (--freezing_actor_steps). ``load_universal``: the trained models ("actor",
        "critic") whose engines load a DeepSpeed universal checkpoint (a resume on another number of ranks,
        ``dschat.rlhf.checkpointing.plan_resume``): their configs say so before ``deepspeed.initialize``.
        ``lora_from``: {"actor": the checkpoint's DeepSpeed folder of an actor saved before its first step} whose
        LoRA adapters the actor takes before ``deepspeed.initialize`` (the plan's ``lora_from``: such a resume on
        other ranks or at another stage makes its engine afresh)."""
        self.load_universal = frozenset(load_universal)
        self.lora_from = dict(lora_from or {})
        self.args = args = BuiltArgs.of(step3_args(args))  # (read-only: BuiltArgs)
        check_settings(args)  # before any model loads
        setup_run(args)
        self.actor_path = actor_model_name_or_path or args.actor_model_name_or_path
        self.critic_path = critic_model_name_or_path or args.critic_model_name_or_path
        self.reward_path = reward_model_name_or_path or args.reward_model_name_or_path or self.critic_path
        check_earlier_step_outputs(args, self.actor_path, self.critic_path, reward_model_name_or_path)
        warn_of_unfinished_inputs([self.actor_path, self.critic_path if args.advantage_estimator == "gae" else None,
                                   self.reward_path])
        self.world_size = get_world_size()
        check_engines_gather_alike(args, self.world_size, self.actor_path, self.critic_path, self.reward_path)
        if tokenizer is not None:
            check_given_tokenizer(tokenizer, self.actor_path)
        # (none given: step 3's, padding on the left as its prompts must; the saved models keep the folder's side)
        self.tokenizer = tokenizer or load_tokenizer(self.actor_path, padding_side="left",
                                                     add_eot_token=args.add_eot_token, eot_token=args.eot_token)
        # max_steps counts PPO iterations, each of optimizer_steps_per_iteration steps (taken as steps, a schedule
        # ran out within the first iterations: a linear one trained the rest at 0, a cosine one rose again)
        self.num_total_iters = (num_total_iters or (args.max_steps or 0) * optimizer_steps_per_iteration(args)
                                or DEFAULT_TOTAL_ITERS)
        if not (num_total_iters or args.max_steps):  # (step 3's entry point sizes it from its data)
            print_rank_0(f"[step3] the learning-rate schedule spans {DEFAULT_TOTAL_ITERS} optimizer steps (no "
                         "num_total_iters nor max_steps given): pass max_steps=your loop's PPO iterations, or "
                         "num_total_iters=those iterations x the optimizer steps of each "
                         "(dschat.rlhf.config.optimizer_steps_per_iteration(args))")
        self.actor_total_iters = actor_total_iters or self.num_total_iters
        with released_engines(only_on_error=True):  # (those made before a model that fails to load)
            self._init_models()

    def _init_models(self):
        args = self.args
        self.actor = self._init_actor()
        self.ref = self._init_frozen_actor_copy(offload=args.offload_reference_model)
        # fp32: in bf16/fp16 each update of (1 - ema_beta) = 0.8% would round back to the old weight. The actor's
        # dropout (only evaluated, it draws none): the saved actor_ema's config is the actor's, as in DeepSpeed-Chat,
        # whose EMA goes to the CPU with the reference (--offload_reference_model; the reference said if it cannot)
        self.actor_ema = self._init_frozen_actor_copy(offload=args.offload_reference_model, dtype="fp32",
                                                      dropout=args.actor_dropout, say=False) \
            if args.enable_ema else None
        if self.actor_ema is not None:  # (save_causal_lm saves it as the actor is, not twice its size in fp32)
            setattr(self.actor_ema.module, SAVED_DTYPE_ATTRIBUTE, TORCH_DTYPES[args.dtype])
        # critic-free estimators need no critic; a reward function alone needs no reward model
        self.critic = self._init_critic() if args.advantage_estimator == "gae" else None
        self.reward = self._init_reward() if args.reward_model_weight else None
        print_rank_0(f"[step3] critic {'built' if self.critic else 'not built'} "
                     f"(advantage estimator {args.advantage_estimator}), reward model "
                     f"{'built' if self.reward else 'not built'}")
        unread = [] if self.critic else critic_only_flags(args)
        if unread:  # (a DeepSpeed-Chat script switched to a critic-free estimator keeps them)
            print_rank_0(f"[step3] {', '.join(unread)}: the critic's only, and no critic is trained; ignored")
        unread = unread_conditional_flags(args)
        if unread:
            print_rank_0(f"[step3] {'; '.join(unread)}: ignored")
        path = [] if self.critic or self.reward else given_flags(args, ("critic_model_name_or_path",))
        if path:  # (the reward model's default path too)
            print_rank_0(f"[step3] {path[0]}: neither a critic nor a reward model is built (--advantage_estimator "
                         f"{args.advantage_estimator}, --reward_model_weight 0); not loaded")

    def release(self):
        """Let Python free the engines and their models, optimizer states and ZeRO buckets (``release_engine``),
        which DeepSpeed keeps for good otherwise: call it when done with this engine in a process that goes on (a
        notebook that builds another), or build it in a ``with`` block, whose end calls it. The models cannot train
        nor run a ZeRO-3 forward afterwards (save them before); this engine lets go of them, and so do the trainers
        built on it (they read the models through it), which refuse to train or generate afterwards. Once: a second
        call does nothing."""
        self._release()

    def _release(self, keep_errors=True):
        if self._released:  # (once: a release() inside a with block, then its end)
            return
        self._released = True
        engines = [self.__dict__.pop(role, None) for role in self.MODEL_ROLES]  # (read afterwards: __getattr__'s error)
        # (each, whatever another's does)
        release_all([engine for engine in engines if engine is not None], keep_errors=keep_errors)

    def __getattr__(self, name):
        """Only for attributes not set: the models of a released engine, which it no longer holds."""
        if name in self.MODEL_ROLES and self._released:
            raise UsageError(f"this DeepSpeedRLHFEngine was released (release(), or the end of its with block): its "
                             f"models are freed, and its {name!r} cannot train, generate nor be saved; build a new "
                             "DeepSpeedRLHFEngine, and a new trainer on it")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, error, traceback):
        """The block's end releases the engines. After an error, that error goes on (a release that fails too does
        not replace it); after Ctrl-C or another rank's failure on several ranks the engines are left as they are,
        as ``released_engines`` leaves them (a release could wait on a collective that never comes)."""
        if error is None or not collective_may_be_pending(error):
            self._release(keep_errors=error is None)
        return False

    # --- configs ------------------------------------------------------------------------------------------
    def _train_config(self, stage, hybrid=False, role="actor"):
        return step3_train_config(self.args, self.world_size, stage, hybrid, role)

    def _trained_config(self, stage, hybrid=False, role="actor"):
        """The DeepSpeed config ``role``'s engine is made with: its training config, loading DeepSpeed's universal
        checkpoint where ``load_universal`` says (a resume on another number of ranks)."""
        config = self._train_config(stage, hybrid, role)
        return with_universal_load(config) if role in self.load_universal else config

    def _eval_config(self, stage, offload, dtype=None, role="reference", say=True):
        """The config of a frozen ``role`` model whose trained twin (``frozen_twin``) trains at ZeRO ``stage``.
        Frozen copies are sharded when their twin is (a full copy would defeat ZeRO-3), on several ranks; parameter
        offload is a ZeRO-3 feature, so it follows the twin's stage too (as in DeepSpeed-Chat)."""
        frozen_stage = frozen_copy_stage(stage, self.world_size, offload)
        if offload and frozen_stage != 3 and say:
            _, stage_flag, why = frozen_twin(self.args, role)
            print_rank_0(f"[step3] --offload_{role}_model: parameter offload is a ZeRO-3 feature, and the {role} "
                         f"model runs at ZeRO-3 only with {stage_flag} 3 ({why}; now {stage}): not offloaded")
        return get_eval_ds_config(offload=offload and frozen_stage == 3, dtype=dtype or self.args.dtype,
                                  stage=frozen_stage,
                                  micro_batch_size=self.args.per_device_training_batch_size,
                                  world_size=self.world_size)

    # --- models -------------------------------------------------------------------------------------------
    def _init_actor(self):
        from dschat.hybrid_engine import HybridEngine, HybridEngineConfig, strip_deepspeed_hybrid_engine

        a = self.args
        ds_config = self._trained_config(a.actor_zero_stage, hybrid=a.enable_hybrid_engine)
        # before its weights load; the checks of it here are the hybrid engine's: without it, no config is read
        config = actor_config_for_checks(a, self.actor_path, before_training=False) if a.enable_hybrid_engine \
            else None
        check_inference_tp(a, self.world_size, ds_config.get("hybrid_engine", {}), self.actor_path, config)
        check_local_window(a, self.actor_path, config)
        check_actor_decodable(a, config)
        model = load_causal_lm(self.actor_path, self.tokenizer, ds_config, dropout=a.actor_dropout)
        self.actor_embedding_rows = embedding_rows(model)
        self._check_sequence_fits(model)
        say_a_dropout_in_training(model, a.actor_dropout, "actor", "--actor_dropout")
        say_an_unapplied_repetition_penalty(model, a.repetition_penalty)
        say_generation_config_settings(model, a)
        model = apply_lora(model, a.actor_lora_dim, a.actor_lora_module_name, a.lora_alpha,
                           only_optimize_lora=a.only_optimize_lora, module_name_flag="--actor_lora_module_name")
        lora_from = getattr(self, "lora_from", {}).get("actor")  # (tests call it on stand-ins of the engine)
        if lora_from is not None:
            from dschat.rlhf.checkpointing import take_untrained_lora

            take_untrained_lora(model, lora_from)
        engine = initialize_engine(model, strip_deepspeed_hybrid_engine(copy.deepcopy(ds_config)),
                                   a.actor_learning_rate, a.actor_weight_decay,
                                   a.actor_lora_learning_rate if a.actor_lora_dim else None,
                                   a.lr_scheduler_type, a.num_warmup_steps, self.actor_total_iters,
                                   a.actor_gradient_checkpointing, a.zero3_fetch, role="the actor")
        if a.enable_mixed_precision_lora:
            print_rank_0(f"[step3] mixed precision LoRA: {quantize_frozen_weights(engine)} frozen weights stored "
                         "in int8")
        print_rank_0(f"[step3] actor {self.actor_path}: ZeRO-{a.actor_zero_stage}, "
                     f"hybrid engine {'on' if a.enable_hybrid_engine else 'off'}")
        if not a.enable_hybrid_engine:
            # check_generation_gathers_alike's backstop: it reads no config of a hub actor not yet cached, and
            # whether --zero3_fetch layer made units is known only now
            if ds_config["zero_optimization"]["stage"] == 3:
                check_ranks_gather_alike(engine.module, self.world_size, refuse_hf_generation, a.zero3_fetch)
            return engine_takes_checkpointing_calls(engine)  # (DeepSpeed-Chat's loop's call, as the hybrid engine's)
        actor = HybridEngine(engine, HybridEngineConfig.from_ds_config(ds_config),
                             pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.tokenizer.eos_token_id,
                             compile_decode_step=a.compile_decode_step, decode_attention=a.decode_attention,
                             fuse_projections=a.fuse_projections,
                             token_count=generable_token_count(engine.module, self.tokenizer))
        actor.check_generation_config()  # e.g. a no_repeat_ngram_size the decode would not apply: say so before PPO
        print_rank_0(f"[step3] hybrid engine generates from {actor.inference_weights.description}"
                     + (f", each rank its slice: inference tensor-parallel groups of {actor.tp.size} ranks"
                        if actor.tp else ""))
        return actor

    def _init_frozen_actor_copy(self, offload, dtype=None, dropout=None, say=True):
        """The reference model (and the EMA copy): the SFT weights, frozen, sharded like the actor."""
        ds_config = self._eval_config(frozen_twin(self.args, "reference")[0], offload, dtype, say=say)
        model = load_causal_lm(self.actor_path, self.tokenizer, ds_config, dropout=dropout)
        return initialize_frozen(model, ds_config, self.args.zero3_fetch)

    def _check_sequence_fits(self, model):
        check_sequence_fits(model, longest_sequence(self.args), LONGEST_SEQUENCE_FLAGS)

    def _check_token_ids(self, path, role):
        a = self.args
        theirs = load_tokenizer(path, add_eot_token=a.add_eot_token, eot_token=a.eot_token)
        # (a critic learns its values on the actor's text in step 3 itself: its format is not checked)
        check_scores_actor_text(self.tokenizer, self.actor_path, theirs, path, f"step3: {role}",
                                formats=role == "the reward model")

    def _init_critic(self):
        a = self.args
        self._check_token_ids(self.critic_path, "the critic")
        ds_config = self._trained_config(a.critic_zero_stage, role="critic")
        actor_rows = getattr(self, "actor_embedding_rows", 0)  # (0: no actor built, as in a test of the critic alone)
        model = create_critic_model(self.critic_path, self.tokenizer, ds_config, a.num_padding_at_beginning,
                                    rlhf_training=True, dropout=a.critic_dropout, zero_stage=a.critic_zero_stage,
                                    compute_fp32_loss=a.compute_fp32_loss, min_embedding_rows=actor_rows)
        model.trained_as_critic = True  # (saved so, wherever a notebook saves it: not taken for a reward model)
        say_grown_embeddings(model, self.critic_path, "the critic", actor_rows)
        self._check_sequence_fits(model)
        say_a_dropout_in_training(model, a.critic_dropout, "critic", "--critic_dropout")
        if not model.value_head_loaded:
            print_rank_0(f"[step3] the critic {self.critic_path} has no trained value head ({VALUE_HEAD_FILES}): it "
                         "starts from a new one")
        model.apply_lora(a.critic_lora_dim, a.critic_lora_module_name, a.lora_alpha, a.only_optimize_lora,
                         module_name_flag="--critic_lora_module_name")
        return initialize_engine(model, ds_config, a.critic_learning_rate, a.critic_weight_decay,
                                 a.critic_lora_learning_rate if a.critic_lora_dim else None,
                                 a.lr_scheduler_type, a.num_warmup_steps, self.num_total_iters,
                                 a.critic_gradient_checkpointing, a.zero3_fetch, role="the critic")

    def _init_reward(self):
        a = self.args
        self._check_token_ids(self.reward_path, "the reward model")
        ds_config = self._eval_config(frozen_twin(a, "reward")[0], a.offload_reward_model, role="reward")
        actor_rows = getattr(self, "actor_embedding_rows", 0)
        model = create_critic_model(self.reward_path, self.tokenizer, ds_config, a.num_padding_at_beginning,
                                    compute_fp32_loss=a.compute_fp32_loss, normalize_scores=True,
                                    min_embedding_rows=actor_rows)
        say_grown_embeddings(model, self.reward_path, "the reward model", actor_rows)
        self._check_sequence_fits(model)
        if not model.value_head_loaded:
            raise UsageError(untrained_reward_model_message(self.reward_path))
        if model.score_normalization:
            print_rank_0("[step3] the reward model {} scores as it was saved (OpenRLHF's normalize_reward): "
                         "(score - {:.4g}) / {:.4g}".format(self.reward_path, *model.score_normalization))
        return initialize_frozen(model, ds_config, a.zero3_fetch)
