"""Step-3 checkpoints: models, optimizers, schedulers, EMA, KL controller, data position and RNG, atomically
(the tag folders, ``latest`` pointer and RNG states of ``dschat.utils.checkpoints``).

A checkpoint resumes on another number of ranks than saved it when a PPO iteration takes as many prompts
(--per_device_generation_batch_size x --generation_batches x ranks); its optimizer steps may take other rows
(--per_device_training_batch_size x --gradient_accumulation_steps x ranks), as on as many ranks, said. ``plan_resume``
decides it from the files before the engines are made: the actor's and critic's ZeRO partitions load through
DeepSpeed's universal checkpoint (``dschat.utils.checkpoints.universal_load``), the place in the prompts and in the
unsupervised stream is converted into this run's batches (what N ranks consumed is a prefix of the epoch's order), each
rank's RNG states and answer sampler are its own where the checkpoint has them. The EMA copy (a full state dict), the
KL controller and the held-out scores before PPO load as saved.
"""
import contextlib
import io
import math
import os
from types import SimpleNamespace

import torch

from dschat.args import CONDITIONAL_FLAGS, recorded_flags_now
from dschat.errors import UsageError
from dschat.models.checkpoint import gathered_state_dict, scale_back_inference_rescaling, settled_module
from dschat.rlhf import algorithms as algo
from dschat.rlhf.config import whole_iterations
from dschat.report import counted
from dschat.run_layout import CHECKPOINTS_DIR
from dschat.steps.common import (STEP_VERSION, TOKENIZER_KEY, check_same_start, check_same_tokenizer, input_runs,
                                 loaded_model_types, recorded_step_version, restart_deepspeed_tensorboard,
                                 step_data_records, tokenizer_record)
from dschat.utils.checkpoints import (ACTOR, CRITIC, MODEL_STATES, RANK_MODEL_STATES, STEP_NAME, TRAINER, ResumePlan,
                                      check_complete, check_engine_files, check_position, check_same_flags,
                                      check_same_products, check_same_step, check_universal_fit, clear_tag,
                                      earlier_advice, latest_tag, load_rank_state, load_rank_state_of_others,
                                      loading_checkpoint, publish, read_trainer_state, reading,
                                      refuse_other_rank_count, rng_said, save_trainer_state,
                                      say_an_older_dschats_checkpoint, tag_of, take_restored_flags, trainer_folder,
                                      universal_load)
from dschat.utils.dist import get_world_size, is_rank_0, print_rank_0, rank_0_decides
from dschat.utils.files import writes_said_on_a_full_disk

# Flags a checkpoint is bound to, stored with it and compared on --resume: the models' and optimizers' saved states
# have the LoRA layout, ZeRO partitioning, precision and optimizer (--offload: DeepSpeed's CPU Adam) these give them
# (otherwise DeepSpeed's loading, or the first step after it, fails with a traceback that names no flag), and its data
# position counts batches of this many prompts, of the prompt set (and unsupervised stream) these data flags make, in
# the order this seed draws (otherwise the resumed run silently skips or repeats prompts, or trains on others, and
# its held-out scores before and after PPO come from two prompt sets). The critic's only where the run trains one.
DATA_RESUME_FLAGS = ("data_path", "data_split", "data_fields", "max_prompt_seq_len", "unsupervised_dataset_name",
                     "unsupervised_dataset_config_name", "eval_prompts", "eval_max_new_tokens")
# The unsupervised stream's blocks are max_prompt_seq_len + max_answer_seq_len tokens: with one, its position counts
# blocks of that length.
UNSUPERVISED_RESUME_FLAGS = ("max_answer_seq_len",)
# (The weight decays too: the optimizers' parameter groups depend on whether it is 0.)
# (--advantage_estimator too: a run continued by another algorithm would be neither's.)
# (--lora_alpha too: the scale of the adapters' saved weights. The training batch size may change: the position counts
# generation batches, and the schedules are moved to where this run's stand at the checkpoint's iteration,
# ppo.realign_schedules.)
ACTOR_RESUME_FLAGS = ("actor_lora_dim", "actor_lora_module_name", "lora_alpha", "only_optimize_lora",
                      "actor_weight_decay", "actor_zero_stage", "dtype", "offload", "per_device_generation_batch_size",
                      "seed", "advantage_estimator") + DATA_RESUME_FLAGS
CRITIC_RESUME_FLAGS = ("critic_lora_dim", "critic_lora_module_name", "critic_weight_decay", "critic_zero_stage")
# Flags whose saved value DeepSpeed restores (the optimizer's and the scheduler's base learning rates, LoRA's
# parameter group's too): another value on --resume is said to change nothing, not refused. (--lr_scheduler_type and
# --num_warmup_steps do apply: the restored scheduler keeps its step and base rates, the schedule's shape comes from
# the flags.)
RESTORED_FLAGS = ("actor_learning_rate", "critic_learning_rate", "actor_lora_learning_rate",
                  "critic_lora_learning_rate")
# The KL controller's settings: a checkpoint restores an adaptive controller's coefficient where it had come, and this
# run's flags apply from there (``restore_kl_controller``); the starting coefficient of an adaptive one is not compared.
KL_CONTROLLER_FLAGS = ("adaptive_kl", "kl_ctl", "kl_target", "kl_horizon")
# Stored and compared, but bound to nothing the checkpoint holds: another value is said, and the run trains with it
# (the loss and reward coefficients and the sampling settings too: changed silently, a resumed run trained another
# objective than its log said; so did one with another place of the KL (--kl_in_reward), advantages (whitened, GRPO's
# std), loss aggregation or EMA decay; and one without --enable_ema left the checkpoint's EMA copy behind unsaid. The
# other way, a checkpoint without one is refused, ``check_resumable``). The training batch size and accumulation too
# (``STEP_ROWS``, on as many ranks or another number: a resume with others went on with them unsaid; the rows of an
# optimizer step the ranks make with them, ``step_rows_said``).
FREE_FLAGS = ("actor_dropout", "cliprange", "cliprange_high", "cliprange_value", "gamma", "lam", "entropy_coef",
              "kl_loss_coef", "kl_estimator", "kl_in_reward", "whiten_advantages", "grpo_norm_by_std", "loss_agg",
              "mask_truncated_answers", "enable_ema", "ema_beta", "unsup_coef", "clip_reward_value",
              "reward_model_weight", "reward_fn_weight", "temperature", "top_k", "top_p", "greedy",
              "repetition_penalty", "per_device_training_batch_size",
              "gradient_accumulation_steps") + KL_CONTROLLER_FLAGS
CRITIC_FREE_FLAGS = ("critic_dropout",)
# On another number of ranks, these may change as long as their product with the ranks does not: the prompts of an
# iteration (checkpoints record them, ``iteration_batches``).
# The rows of an optimizer step may change with the ranks as on as many (their flags are free): the position counts
# generation batches, and another number of optimizer steps an iteration moves the schedules (ppo.realign_schedules).
ITERATION_PROMPTS = ("per_device_generation_batch_size", "generation_batches")
STEP_ROWS = ("per_device_training_batch_size", "gradient_accumulation_steps")
# Without a plan made before the engines (``plan_resume``: step 3's entry point makes one), a checkpoint of another
# number of ranks is refused: its engines were made without DeepSpeed's universal loading, its position unconverted.
OTHER_RANKS_WHY = ("on another number of ranks, its actor's and critic's ZeRO partitions load through DeepSpeed's "
                   "universal checkpoint, which their DeepSpeed configs ask for before deepspeed.initialize, and its "
                   "place in the prompts is converted for this run's loaders: step 3's entry point does that "
                   "(dschat.rlhf.checkpointing.plan_resume before DeepSpeedRLHFEngine)")
BOUND_WHY = ("Its algorithm (--advantage_estimator), its model and optimizer states (LoRA layout and scale, weight "
             "decay, ZeRO stage, precision, offload) and its place in the prompts (batches of "
             "--per_device_generation_batch_size of the prompts its data flags make, in --seed's order) hold for its "
             "own")


# The name step 3's checkpoints record (``STEP_NAME``): another step's resume refuses them, and step 3's theirs.
STEP = "step3"
# The optimizer steps the trainer skipped for no token in the loss (``DeepSpeedPPOTrainer.no_token_skips``): DeepSpeed's
# checkpoints keep its skip count, which includes them, so a resumed run's end-of-run warning would take them for skips
# on inf/NaN gradients without them.
NO_TOKEN_SKIPS = "no_token_skips"


def save_checkpoint(trainer, root, position, keep_last=2):
    """Save everything a resumed run needs; ``position`` = {"iteration", "epoch", "batch"} (next to run) and
    "unsup_batches" (unsupervised batches consumed so far, skipped on resume)."""
    tag = tag_of("iter", position["iteration"])
    record_fixed_coefficient(trainer)
    clear_tag(root, tag)
    with writes_said_on_a_full_disk(root):
        for folder, engine in ((ACTOR, trainer.actor_model), (CRITIC, trainer.critic_model)):
            if engine is None:
                continue
            if hasattr(engine, "module"):  # (an actor that only generated since it trained: --freezing_actor_steps)
                scale_back_inference_rescaling(engine.module)
            engine.save_checkpoint(os.path.join(root, folder), tag=tag, save_latest=False)
        ema_state = gathered_state_dict(settled_module(trainer.actor_ema)) if trainer.actor_ema is not None else None
        if is_rank_0() and ema_state is not None:  # before the trainer state, which marks a tag complete
            os.makedirs(trainer_folder(root, tag), exist_ok=True)
            torch.save(ema_state, os.path.join(trainer_folder(root, tag), "ema.pt"))
        version = recorded_step_version(trainer.args, STEP)  # (a resumed older checkpoint's: its own)
        save_trainer_state(root, tag, {**position, STEP_NAME: STEP, STEP_VERSION: version,
                                       "kl_ctl": trainer.kl_ctl.state_dict(), KL_TRACKED: _kl_tracked(trainer.args),
                                       NO_TOKEN_SKIPS: _no_token_skips(trainer),
                                       "flags": resume_flags(trainer), "inputs": input_runs(trainer.args),
                                       "world_size": get_world_size(), "batches": iteration_batches(trainer.args),
                                       **_tokenizer_of(trainer)}, trainer.generator)
    publish(root, tag, keep_last)
    return tag


def _no_token_skips(trainer):
    """The trainer's ``no_token_skips``; {} for a stand-in without (a test's)."""
    return dict(getattr(trainer, "no_token_skips", {}))


def record_fixed_coefficient(trainer):
    """A fixed KL controller's coefficient changed in place (``trainer.kl_ctl.value = 0.05``) is the run's --kl_ctl,
    as one assigned is: its checkpoint recorded args' (0.1), and a resume made that one again, the 0.05 dropped
    unsaid. (An adaptive controller's coefficient is its saved state; where the KL is a loss term it weighs nothing.)"""
    from dschat.rlhf.config import kl_in_loss

    controller, args = trainer.kl_ctl, trainer.args
    if isinstance(controller, algo.FixedKLController) and not args.adaptive_kl and not kl_in_loss(args):
        args.kl_ctl = controller.value


def _tokenizer_of(trainer):
    """{TOKENIZER_KEY: its record} of the trainer's tokenizer (the actor's folder's), compared on --resume; {} for a
    trainer without one."""
    tokenizer = getattr(trainer, "tokenizer", None)
    return {} if tokenizer is None else {TOKENIZER_KEY: tokenizer_record(tokenizer)}


def iteration_batches(args):
    """The batch flags of an iteration's global shape (``ITERATION_PROMPTS``, ``STEP_ROWS``), which a checkpoint
    records: on another number of ranks, the prompts' product with the ranks must stay the same, and the rows' is
    said where it changes."""
    return {name: getattr(args, name) for name in ITERATION_PROMPTS + STEP_ROWS}


def load_checkpoint(trainer, root, plan=None, train_loader=None):
    """Restore the last complete checkpoint under ``root`` (``plan``: ``plan_resume``'s, made before the engines;
    None: rank 0 picks and checks it for every rank now, before DeepSpeed loads anything, and one of another number of
    ranks is refused; a notebook's ``train_loader``, the prompts' loader the run goes on with, has its iteration count
    checked too, as ``plan_resume`` checks step 3's; without it, another --generation_batches than the checkpoint's is
    refused, ``_refuse_unchecked_generation_batches``); returns its position dict (None if none)."""
    if plan is None:
        found = rank_0_decides(lambda: _checked_latest(trainer, root, loaders=(train_loader, None),
                                                       tokenizer=getattr(trainer, "tokenizer", None))
                               or _check_not_an_output_dir(root))
        if found is None:
            return None
        plan = ResumePlan(found[0], found[1], get_world_size())
    if plan.tag is None:
        return None
    tag, state = plan.tag, dict(plan.state)
    for part in (ACTOR, CRITIC):
        state.pop(saved_zero_stage_key(part), None)
    if plan.notice:
        print_rank_0(plan.notice)
    _say_kl_tracked_since(getattr(trainer, "args", None), state.pop(KL_TRACKED, None), tag)
    engines = [engine for engine in (trainer.actor_model, trainer.critic_model) if engine is not None]
    with reading(root, tag):
        for name, engine in zip((ACTOR, CRITIC), engines):
            if plan.load_tag(name) is None:  # (an actor that had not trained: as the engine was made, ``plan_resume``)
                continue
            with loading_checkpoint(engine, plan, name):
                engine.load_checkpoint(os.path.join(root, name), tag=plan.load_tag(name))
        if trainer.actor_ema is not None:
            _load_ema(trainer.actor_ema.module, os.path.join(trainer_folder(root, tag), "ema.pt"))
        if plan.other_ranks:
            load_rank_state_of_others(root, tag, trainer.args.seed, state["iteration"], trainer.generator)
        else:
            load_rank_state(root, tag, trainer.generator)
    for engine in engines:
        restart_deepspeed_tensorboard(engine)  # its events after the checkpoint's sample count are run again
    restore_kl_controller(trainer.kl_ctl, state.pop("kl_ctl"))
    trainer.no_token_skips = dict(state.pop(NO_TOKEN_SKIPS, {}))  # (a checkpoint from before the count: none)
    restored = dict(state.get("restored", {}))
    take_restored_flags(state, getattr(trainer, "args", None))  # (set where the checks had flags to compare)
    if restored and hasattr(trainer, "took_restored_flags"):  # (the trainer's args hold them, not the engine's)
        trainer.took_restored_flags(restored)
    if hasattr(trainer.actor_model, "mark_weights_stale"):
        trainer.actor_model.mark_weights_stale()
    return state


def _check_not_an_output_dir(root):
    """A notebook's ``root`` that holds no checkpoint but is step 3's --output_dir, whose checkpoints are in its
    ``checkpoints`` folder: an error saying so (``load_checkpoint`` returned None, and the notebook trained afresh
    from the SFT model as if none had been saved); else None."""
    inner = os.path.join(root, CHECKPOINTS_DIR)
    if os.path.isdir(inner) and latest_tag(inner) is not None:
        raise UsageError(f"load_checkpoint: {root} holds no checkpoint; its {CHECKPOINTS_DIR} folder does (step 3 "
                         f"saves its --save_interval checkpoints there): give load_checkpoint(trainer, {inner!r})")
    return None


# The KL estimator an --adaptive_kl run's controller was fed (the reward penalty's, per answer: kl_per_answer), which a
# checkpoint records; one saved without it fed the controller k1 whatever the penalty's estimator (before session 55).
KL_TRACKED = "kl_tracked"


def _kl_tracked(args):
    from dschat.rlhf.trainer import reward_kl_estimator

    return reward_kl_estimator(args)


def _say_kl_tracked_since(args, saved, tag):
    """A resumed --adaptive_kl run whose reward penalty is not k1, from a checkpoint whose controller was fed k1
    (saved before it followed the penalty's estimator): said, as its coefficient goes on toward --kl_target measured
    another way (k3 and low_var_kl have k1's mean, k2 and abs do not) and kl_per_answer changes meaning in the log."""
    now = _kl_tracked(args) if args is not None and args.adaptive_kl else "k1"
    if saved is None and now != "k1":
        print_rank_0(f"[step3] note: checkpoint {tag}'s adaptive KL controller was fed the k1 KL per answer (a dschat "
                     f"of before it followed the reward penalty's estimator); from here it is fed --kl_estimator "
                     f"{now}'s, which kl_per_answer logs from this iteration on")


def restore_kl_controller(controller, saved):
    """The checkpoint's KL controller state (``saved``) into ``controller``, made from this run's flags: an adaptive
    controller goes on from the coefficient it had come to, toward this run's --kl_target over its --kl_horizon; a
    fixed one's coefficient is this run's --kl_ctl (a changed flag is said by the resume's check, and applies)."""
    settings = {key: value for key, value in controller.state_dict().items() if key != "value"}
    fixed = controller.value
    controller.load_state_dict(saved)
    if isinstance(controller, algo.FixedKLController):
        controller.value = fixed
    else:
        controller.load_state_dict({"value": controller.value, **settings})


def _checked_latest(trainer, root, planned=False, loaders=(None, None), tokenizer=None):
    """(tag, saved state less its flags, ranks that saved it, what is said of its position) of the last complete
    checkpoint that this run may continue, else None (``check_resumable``). With this run's ``loaders`` (the
    prompts', the unsupervised stream's or None), its position on another number of ranks (``planned``) is converted
    into their batches (``_convert_position``), and its iteration count checked (``check_iteration_count``); with the
    ``tokenizer`` the actor's folder holds now, that it is the checkpoint's (``check_same_tokenizer``)."""
    tag = latest_tag(root)
    if tag is None:
        return None
    state, saved_ranks = check_resumable(trainer, root, tag, planned)
    if tokenizer is not None:
        check_same_tokenizer(state.get(TOKENIZER_KEY), tokenizer, trainer.args.actor_model_name_or_path, tag, root,
                             "--actor_model_name_or_path")
    train_loader, unsup_loader = loaders
    position_said = []
    if train_loader is not None:
        where = f"checkpoint {tag} in {root}"
        if saved_ranks != get_world_size():
            converted, position_said = _convert_position(state, saved_ranks, train_loader, unsup_loader,
                                                         trainer.args, where)
            state.update(converted)
        check_iteration_count(state, saved_ranks, len(train_loader), trainer.args, where)
    elif getattr(trainer, "args", None) is not None:
        _refuse_unchecked_generation_batches(state, trainer.args, f"checkpoint {tag} in {root}")
    return tag, state, saved_ranks, position_said


def _refuse_unchecked_generation_batches(state, args, where):
    """A notebook's ``load_checkpoint`` without the prompts' loader: its iteration count can be checked only against
    the loader's batches (``check_iteration_count``). On as many ranks with the checkpoint's --generation_batches
    (and the bound flags: as many prompts a batch, of the same data) it is this run's; with another it may not be
    (mostly is not), so that is refused, saying how to have it checked, rather than loaded unchecked."""
    then = (state.get("batches") or {}).get("generation_batches")
    if then is None or then == args.generation_batches:  # (a checkpoint that does not record it: not known)
        return
    # (only a notebook's call comes here, so no --resume was given: the message names load_checkpoint and the setting)
    raise UsageError(f"load_checkpoint: {where} is at iteration {state['iteration']} of iterations of "
                     f"generation_batches {then}, this trainer's take {args.generation_batches}: whether that is "
                     "this run's iteration count at its place in the prompts depends on the prompts' batches an epoch, "
                     "which load_checkpoint was not given (train_loader=None); pass train_loader=<the prompts' "
                     f"loader> to have it checked, or load it into a trainer of generation_batches {then}")


def planned_models(args):
    """What ``check_resumable`` reads of a trainer, from step 3's flags, before its engines are made: a critic where
    the estimator trains one (GAE: ``DeepSpeedRLHFEngine`` builds it then), an EMA copy with --enable_ema."""
    return SimpleNamespace(args=args, critic_model=CRITIC if args.advantage_estimator == "gae" else None,
                           actor_ema="ema" if args.enable_ema else None)


def plan_resume(args, root, train_loader, unsup_loader=None, tokenizer=None):
    """--resume of step 3: the checkpoint to continue (a ``ResumePlan``; its tag None when there is none), picked and
    checked by rank 0 for every rank. Called before ``DeepSpeedRLHFEngine``: on another number of ranks, the actor's
    and critic's ZeRO partitions get their universal copies (rank 0 makes them, every rank waits; the engine's
    configs then need ``checkpoint.load_universal`` for ``plan.universal``), and the position is converted for this
    run's loaders (``train_loader``, ``unsup_loader``: the unsupervised stream's, None without one); at another ZeRO
    stage of the actor or critic (``_check_universal_fits``), that part's universal copy is fitted for it. That is
    said once, when it loads."""
    if not args.resume:
        return ResumePlan()
    found = rank_0_decides(lambda: _checked_latest(planned_models(args), root, planned=True,
                                                   loaders=(train_loader, unsup_loader), tokenizer=tokenizer))
    if found is None:
        return ResumePlan()
    *found, position_said = found
    plan = ResumePlan(*found)
    stages = {ACTOR: args.actor_zero_stage, CRITIC: args.critic_zero_stage}
    saved_stages = {part: plan.state.get(saved_zero_stage_key(part), stage) for part, stage in stages.items()}
    if not plan.other_ranks and saved_stages == stages:
        return plan
    said = []
    if _starts_untrained_actor(root, plan, args, saved_stages[ACTOR]):
        plan.load_tags[ACTOR] = None  # (the engine as made: what the checkpoint's engine was)
        if args.actor_lora_dim:  # (drawn at random when the checkpoint's run started: its own, not this run's draw)
            plan.lora_from[ACTOR] = os.path.join(root, ACTOR, plan.tag)
        said.append("its actor had taken no optimizer step yet (--freezing_actor_steps), so it starts from "
                    "--actor_model_name_or_path as the checkpoint's did"
                    + (", with the checkpoint's LoRA adapters" if args.actor_lora_dim else ""))
    for part, stage in stages.items():
        if part == ACTOR and ACTOR in plan.load_tags:
            continue
        if part == CRITIC and args.advantage_estimator != "gae":
            continue
        if plan.other_ranks or saved_stages[part] != stage:
            plan.load_tags[part], part_said = universal_load(root, part, plan.tag, plan.saved_ranks,
                                                             saved_stages[part], f"its {part}'s", into_stage=stage)
            said.append(part_said)
    if not plan.other_ranks:
        flags = ", ".join(f"--{part}_zero_stage {saved_stages[part]} -> {stage}" for part, stage in stages.items()
                          if saved_stages[part] != stage)
        plan.notice = (f"[step3] --resume: checkpoint {plan.tag} saved at another ZeRO stage ({flags}): "
                       f"{'; '.join(said)}; Adam's moments and step counts, the schedulers and the place in the "
                       "prompts go on as saved")
        return plan
    said += position_said + list(filter(None, [step_rows_said(plan.state["batches"], plan.saved_ranks, args)]))
    kept = (["adaptive KL coefficient"] if args.adaptive_kl else []) + (["EMA copy"] if args.enable_ema else []) \
        + ["held-out scores before PPO"]
    said.append(rng_said(plan.saved_ranks, "RNG states and answer sampler", "iteration") + "; its "
                + (", ".join(kept[:-1]) + " and " if len(kept) > 1 else "") + kept[-1] + " load as saved")
    plan.notice = (f"[step3] --resume: checkpoint {plan.tag} saved by {plan.saved_ranks} rank(s), this run has "
                   f"{get_world_size()}: {'; '.join(said)}")
    return plan


def _starts_untrained_actor(root, plan, args, saved_stage):
    """Whether the actor of ``plan``'s checkpoint, which this run loads through a universal copy (on other ranks, or at
    another ZeRO stage), had taken no optimizer step (``_untrained``), so its engine starts as made, as the
    checkpoint's did: a ZeRO-3 one on other ranks (which DeepSpeed's universal checkpoint cannot convert), any at
    another stage (nor fit: its optimizer holds no Adam state). A LoRA actor's adapters, drawn at random when the
    checkpoint's run started, are then the checkpoint's (``take_untrained_lora``), not this run's draw, which on other
    ranks or at another stage may differ (it was refused)."""
    converted = saved_stage != args.actor_zero_stage or (plan.other_ranks and saved_stage == 3)
    return converted and rank_0_decides(lambda: _untrained(root, ACTOR, plan.tag))


def _untrained(root, part, tag):
    """Whether ``part``'s DeepSpeed engine had taken no optimizer step when it saved checkpoint ``tag`` (its
    ``global_steps``, which count fp16 steps skipped on overflow too): its weights, optimizer, scheduler and loss
    scaler are then the ones its engine was made with. DeepSpeed's universal checkpoint cannot convert such a ZeRO-3
    optimizer (ds_to_universal reads Adam's moments, made by the first step: a bare KeyError: 0)."""
    folder = os.path.join(root, part, tag)
    names = sorted(name for name in os.listdir(folder) if name.endswith("model_states.pt"))
    if not names:
        return False
    # (ZeRO-3: the module in it is placeholders, the weights are in the optimizer's files)
    state = torch.load(os.path.join(folder, names[0]), map_location="cpu", weights_only=False)
    return state.get("global_steps") == 0


def take_untrained_lora(model, folder):
    """The LoRA adapters of the actor that DeepSpeed saved in ``folder`` (a checkpoint's tag folder) before its first
    optimizer step, set in ``model`` (this run's actor, before ``deepspeed.initialize`` makes its optimizer's master
    weights from them). Drawn at random when that run started, on its ranks and at its ZeRO stage, they need not be
    this run's draw. Under ZeRO-3 rank 0 reads them and each is partitioned again from its copy."""
    from dschat.models.lora import is_lora_param
    from dschat.models.zero3 import gathered, is_zero3_param

    adapters = [(name, param) for name, param in model.named_parameters() if is_lora_param(name)]
    sharded = any(is_zero3_param(param) for _, param in adapters)
    saved = _untrained_weights(folder) if is_rank_0() or not sharded else None
    for name, param in adapters:
        with gathered([param], modifier_rank=0):
            if saved is not None:
                param.data.copy_(saved[name])


def _untrained_weights(folder):
    """{name: tensor} of the weights in DeepSpeed's tag ``folder`` of an engine that took no optimizer step: ZeRO-3's
    from its ranks' fp32 partitions (its model states hold placeholders), the module states' otherwise (its master
    weights were made from them, and no step changed either)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if any(RANK_MODEL_STATES.fullmatch(name) for name in os.listdir(folder)):
        with contextlib.redirect_stdout(io.StringIO()):  # (its progress lines, one per file)
            return get_fp32_state_dict_from_zero_checkpoint(os.path.dirname(folder), os.path.basename(folder))
    return torch.load(os.path.join(folder, MODEL_STATES), map_location="cpu", weights_only=False)["module"]


def _convert_position(state, saved_ranks, train_loader, unsup_loader, args, where):
    """The checkpoint's position (``state``: "batch", generation batches of its epoch on each of its ranks, and
    "unsup_batches", the unsupervised stream's batches each rank took) in this run's batches: returns ({"batch",
    "unsup_batches"} of this run's, what is said of them). Each epoch's order of the prompts (and each pass's over the
    unsupervised blocks) is one permutation of (seed, epoch), which the ranks' samplers deal out in turn, so what the
    checkpoint's ranks took is a prefix of it: this run skips the batches of its own that cover that prefix. Where
    they do not cover it exactly (it would skip or repeat some), a UsageError says what to give."""
    saved = state["batches"]
    saved_batch, batch, ranks = saved["per_device_generation_batch_size"], args.per_device_generation_batch_size, \
        get_world_size()
    prompts, epoch = len(train_loader.dataset), state["epoch"]
    consumed = state["batch"] * saved_batch * saved_ranks
    if consumed % (batch * ranks):  # (whole iterations of as many prompts divide; a batch index of an earlier resume
        _refuse_position(where, state, saved_ranks,  # with another --generation_batches may not)
                         f"its place in epoch {epoch + 1}, {_batches(state['batch'])} of "
                         f"{counted(saved_batch, 'prompt')} on {saved_ranks} rank(s) ({counted(consumed, 'prompt')}), "
                         f"is not a whole number of this run's batches of {batch} on {ranks}",
                         saved_batch * saved_ranks)
    converted = {"batch": consumed // (batch * ranks)}
    _, usable = whole_iterations(len(train_loader), args.generation_batches)
    said = [f"the prompt position: epoch {epoch + 1} was done, training goes on from the next"
            if converted["batch"] >= usable else
            f"the prompt position: the first {consumed} of epoch {epoch + 1}'s {counted(prompts, 'prompt')} (in its "
            f"order) were trained on, this run skips {_batches(converted['batch'])} of {batch} on each rank"]
    if unsup_loader is not None:
        blocks = len(unsup_loader.dataset)
        saved_pass = math.ceil(blocks / saved_ranks) // saved_batch  # (the checkpoint's loader: drop_last)
        passes, into = divmod(state["unsup_batches"], saved_pass)
        taken = into * saved_batch * saved_ranks
        if taken % (batch * ranks):
            _refuse_position(where, state, saved_ranks, f"its place in the unsupervised stream, {_batches(into)} of "
                             f"{counted(saved_batch, 'block')} on {saved_ranks} rank(s) into pass {passes + 1} "
                             f"({counted(taken, 'block')}), "
                             f"is not a whole number of this run's batches of {batch} on {ranks}",
                             saved_batch * saved_ranks)
        # (a pass of this run's that ends before ``taken``: the blocks in between are its pass's dropped last ones)
        converted["unsup_batches"] = passes * len(unsup_loader) + min(taken // (batch * ranks), len(unsup_loader))
        said.append(f"the unsupervised stream: {taken} of its {counted(blocks, 'block')} into pass {passes + 1}, "
                    f"this run skips {_batches(converted['unsup_batches'])} of {batch} on each rank")
    return converted, said


def check_iteration_count(state, saved_ranks, batches, args, where):
    """The checkpoint's iteration count (``state``: its position, in this run's generation batches of the epoch,
    ``batches`` of them per epoch) is the one this run has at that place in the prompts: else the resumed run would
    count its iterations, size its learning-rate schedules and stop (--max_steps, the epochs' end) by one count while
    training on the prompts of another. Another --generation_batches on as many ranks made it so (fewer: the schedules
    never reached their end; more: the run stopped before the epoch's last prompts), and so did, on another number of
    ranks, epochs of another number of whole iterations (DistributedSampler pads the prompts to a multiple of the
    ranks). A UsageError naming what to give."""
    per_epoch, usable = whole_iterations(batches, args.generation_batches)
    epoch, batch = state["epoch"], state["batch"]
    here = _iteration_at(epoch, batch, batches, args.generation_batches)
    if here == state["iteration"]:
        return
    saved, ranks = state.get("batches") or {}, get_world_size()
    if saved_ranks == ranks:
        then = saved.get("generation_batches")
        if then is not None:
            why = f"its iterations took --generation_batches {then}, this run's {args.generation_batches}"
            advice = f"resume with --generation_batches {then}"
        else:  # (a checkpoint from before step 3 recorded its batches: the counts that put it where it is)
            fits = [count for count in range(1, batches + 1)
                    if _iteration_at(epoch, batch, batches, count) == state["iteration"]]
            why = (f"its iterations took another --generation_batches than this run's {args.generation_batches} (the "
                   "checkpoint, saved before step 3 recorded its batch sizes, does not say which)")
            advice = (f"resume with --generation_batches {fits[0]}, the one that puts it at iteration "
                      f"{state['iteration']}" if len(fits) == 1 else
                      f"resume with the --generation_batches its run was given ({' or '.join(map(str, fits))} put "
                      f"it at iteration {state['iteration']})" if fits else
                      "resume with the --generation_batches its run was given")
    else:
        why = (f"an epoch of its {saved_ranks} rank(s) made another number of whole iterations than one of this run's "
               f"{ranks} ({per_epoch}; DistributedSampler pads an epoch's prompts to a multiple of the ranks)")
        advice = f"resume on {saved_ranks} rank(s)"
    place = f"epoch {epoch + 1}'s generation batch {batch}" if batch < usable else \
        f"the end of epoch {epoch + 1}"
    raise UsageError(f"--resume: {where} is at iteration {state['iteration']}, and its place in the prompts ({place} "
                     f"on each rank) is {'within an iteration' if here != int(here) else f'iteration {int(here)}'} "
                     f"of this run: {why}. The resumed run would count its iterations, learning-rate schedules and "
                     f"--max_steps by one and train on the prompts of another: {advice}")


def _iteration_at(epoch, batch, batches, generation_batches):
    """The iteration count at generation batch ``batch`` of epoch ``epoch`` (``batches`` of them an epoch) of a run
    whose iterations take ``generation_batches``: a fraction within an iteration."""
    per_epoch, usable = whole_iterations(batches, generation_batches)
    if batch >= usable:  # (the epoch was done)
        return (epoch + 1) * per_epoch
    return epoch * per_epoch + batch / generation_batches


def _batches(count):
    return counted(count, "batch", "batches")


def _refuse_position(where, state, saved_ranks, why, generation_batch):
    """A place of the checkpoint's (``why`` it is not one of this run's) that this run would reach only by skipping or
    repeating some of its prompts or blocks: a UsageError with the flags that make it one (the checkpoint's prompts
    per batch over all ranks, ``generation_batch``)."""
    ranks, saved = get_world_size(), state["batches"]
    advice = (f"resume with --per_device_generation_batch_size {generation_batch // ranks} --generation_batches "
              f"{saved['generation_batches']}" if generation_batch % ranks == 0 else f"resume on {saved_ranks} rank(s)")
    raise UsageError(f"--resume: {where} was saved by {saved_ranks} rank(s), this run has {ranks}: {why}, so this "
                     f"run would skip or repeat some: {advice}")


def check_resumable(trainer, root, tag, planned=False):
    """The checkpoint ``tag`` was saved by a run this one can continue (``checkpoints.check_complete``): also a
    critic when this run trains one, an EMA copy when this run keeps one, and the flags it is bound to. On another
    number of ranks (``planned``: the engines are not made yet, ``plan_resume``; else refused), its DeepSpeed states
    convertible and an iteration of the same global shape (``check_iteration_shape``). Returns (its saved state, less
    the flags; the number of ranks that saved it)."""
    args = getattr(trainer, "args", None)  # (None: no flags to check, as below; no model's family known)
    check_same_step(root, tag, STEP)
    say_an_older_dschats_checkpoint(root, tag, STEP, loaded_model_types(args))
    saved_ranks = check_complete(root, tag, (ACTOR,))
    other_ranks = saved_ranks != get_world_size()
    if other_ranks and not planned:
        refuse_other_rank_count(root, tag, saved_ranks, OTHER_RANKS_WHY)
    state = read_trainer_state(root, tag)
    saved_flags = recorded_flags_now(state.pop("flags", {}))
    if trainer.critic_model is not None and not os.path.isdir(os.path.join(root, CRITIC, tag)):
        _refuse_without_critic(root, tag, saved_flags)
    if trainer.critic_model is not None:
        check_engine_files(root, CRITIC, tag, saved_ranks)
    if trainer.actor_ema is not None and not os.path.isfile(os.path.join(trainer_folder(root, tag), "ema.pt")):
        _refuse_without_ema(root, tag, saved_flags)
    # (without a plan, the engines were made without DeepSpeed's universal loading: another stage is a bound flag,
    # another number of ranks refused above)
    restaged = _check_universal_fits(root, tag, saved_ranks, saved_flags, args, trainer.critic_model is not None) \
        if planned else ()
    if other_ranks:
        check_iteration_shape(root, tag, state.get("batches"), saved_ranks, args)
    if args is not None:
        now = resume_flags(trainer, saved_flags)
        if other_ranks:  # (its product with the ranks: compared)
            now.pop("per_device_generation_batch_size")
        for part in restaged:  # (loaded through the copy fitted for this run's stage, ``plan_resume``)
            state[saved_zero_stage_key(part)] = saved_flags[f"{part}_zero_stage"]
            now.pop(f"{part}_zero_stage")
        state["restored"] = check_same_flags(saved_flags, now, RESTORED_FLAGS, tag, root, STEP, BOUND_WHY,
                                             FREE_FLAGS + CRITIC_FREE_FLAGS)
        if saved_flags.get("enable_ema") and not args.enable_ema:  # (what "trains with the new value" means here)
            print_rank_0(f"[{STEP}] --resume: the EMA copy in {tag} is not loaded, and this run saves no actor_ema")
        check_same_start(state.get("inputs"), args.actor_model_name_or_path, "--actor_model_name_or_path", tag, root,
                         "whose actor started", "the reference model its KL penalty measures against")
    check_position(root, tag, state, ("iteration", "epoch", "batch"))
    return state, saved_ranks


# What a step-3 resume that cannot change a ZeRO stage may do to fit in less memory (``check_universal_fit``): the
# same rows an optimizer step, split otherwise (``STEP_ROWS``: free flags).
LESS_MEMORY = (" (to fit in less memory: a smaller --per_device_training_batch_size with a "
               "--gradient_accumulation_steps as many times larger, the same rows an optimizer step)")


def saved_zero_stage_key(part):
    return f"saved_{part}_zero_stage"


def _check_universal_fits(root, tag, saved_ranks, saved_flags, args, with_critic):
    """The actor's (and a trained critic's) states of checkpoint ``tag`` that load in this run's world: on its ranks
    and at its ``--actor_zero_stage`` / ``--critic_zero_stage`` (another stage after running out of memory at 2:
    through DeepSpeed's universal copy fitted for it, ``plan_resume``). Returns the parts whose stage changes; where
    one cannot load so, a UsageError naming what to resume with (``check_universal_fit``)."""
    restaged = []
    for part in (ACTOR, CRITIC) if with_critic else (ACTOR,):
        flag = f"{part}_zero_stage"
        saved = saved_flags.get(flag)
        if check_universal_fit(root, part, tag, saved_ranks, saved, getattr(args, flag, saved), f"--{flag}",
                               LESS_MEMORY):
            restaged.append(part)
    return restaged


def _refuse_without_critic(root, tag, saved_flags):
    """A checkpoint without its critic folder that a run with a critic resumes: its run had none (a critic-free
    --advantage_estimator), or (its flags say gae) the folder is gone, which was said as the former, asking for
    another --advantage_estimator than the one both runs have."""
    if saved_flags.get("advantage_estimator") == "gae":
        raise UsageError(f"--resume: checkpoint {tag} in {root} has no {CRITIC}/{tag} folder (the critic of its gae "
                         f"run; removed or copied in part?): restore it{earlier_advice(root, tag)}; or start afresh "
                         "without --resume")
    raise UsageError(f"--resume: checkpoint {tag} in {root} has no critic (it was saved by a critic-free run, "
                     f"--advantage_estimator other than gae); resume with that run's --advantage_estimator")


def _refuse_without_ema(root, tag, saved_flags):
    """A checkpoint without its ``ema.pt`` that an --enable_ema run resumes: its run kept none, or (its flags say
    --enable_ema) the file is gone, which was said as the former."""
    if saved_flags.get("enable_ema"):
        raise UsageError(f"--resume: checkpoint {tag} in {root} has no {TRAINER}/{tag}/ema.pt (the EMA copy of its "
                         f"--enable_ema run; removed or copied in part?): restore it{earlier_advice(root, tag)}; or "
                         "start afresh without --resume")
    raise UsageError(f"--resume: checkpoint {tag} in {root} has no EMA copy (the run that saved it had no "
                     f"--enable_ema); resume without --enable_ema, or start afresh without --resume")


def check_iteration_shape(root, tag, saved, saved_ranks, args):
    """A checkpoint of ``saved_ranks`` ranks (``saved``: its ``iteration_batches``) that this run of another number
    continues: an iteration takes as many prompts as the checkpoint's (its iteration count, learning-rate schedules,
    and place in the prompts count those); else a UsageError naming the flag and value to give. An optimizer step's
    rows may differ, as on as many ranks (``step_rows_said``): they were held to the checkpoint's too, so a resume on
    half the ranks needed twice the accumulation, which a resume on the same ranks could drop."""
    check_same_products(root, tag, saved, saved_ranks, args, (
        (ITERATION_PROMPTS, "its iterations took", "prompts",
         "its iteration count, learning-rate schedules and place in the prompts count iterations of"),),
        "it does not record its batch sizes (saved before step 3 resumed on another number of ranks), so the prompts "
        "of its iterations are not known")


def step_rows_said(saved, saved_ranks, args):
    """What a resume on another number of ranks than the checkpoint's does to an optimizer step's rows (``saved``: its
    ``iteration_batches``): "" where they are the checkpoint's. Otherwise the per-rank flags may be as before and the
    step's rows change unsaid with the ranks (the schedules' move, said after the load, names only the step count)."""
    then = saved["per_device_training_batch_size"] * saved["gradient_accumulation_steps"] * saved_ranks
    ranks = get_world_size()
    now = args.per_device_training_batch_size * args.gradient_accumulation_steps * ranks
    if now == then:
        return ""
    return (f"its optimizer steps took {then} rows ({saved['per_device_training_batch_size']} x "
            f"{saved['gradient_accumulation_steps']} x {saved_ranks}: --per_device_training_batch_size x "
            f"--gradient_accumulation_steps x ranks), this run's take {now} ({args.per_device_training_batch_size} x "
            f"{args.gradient_accumulation_steps} x {ranks}) from here")


def resume_flags(trainer, saved=None):
    """{flag: value} of the flags a checkpoint stores and --resume compares (the bound ``ACTOR_RESUME_FLAGS`` and
    ``CRITIC_RESUME_FLAGS``, the ``RESTORED_FLAGS`` and ``FREE_FLAGS`` said when changed), and its data files
    (``saved``: the checkpoint's flags, ``step_data_records``)."""
    flags = flag_values(trainer.args, trainer.critic_model is not None)
    return {**flags, **step_data_records(trainer.args, saved)}  # the same prompt data, unedited: its position counts


def flag_values(args, with_critic):
    """``resume_flags``' flags (its data files' records aside) of a run with ``args`` that trains a critic or not."""
    critic = CRITIC_RESUME_FLAGS + CRITIC_FREE_FLAGS if with_critic else ()
    names = (ACTOR_RESUME_FLAGS + FREE_FLAGS + critic + RESTORED_FLAGS
             + (UNSUPERVISED_RESUME_FLAGS if getattr(args, "unsupervised_dataset_name", None) else ()))
    flags = {name: getattr(args, name) for name in names}
    if args.adaptive_kl:
        del flags["kl_ctl"]  # (an adaptive controller's start: it goes on from the checkpoint's coefficient)
    if not (args.actor_lora_dim or args.critic_lora_dim):
        flags["lora_alpha"] = None  # (read by no model: given, it is said to be ignored, and binds nothing)
    for name in _unread_free_flags(args):  # (another value changes nothing: not compared, not said)
        flags.pop(name, None)
    return flags


def bound_flags(args):
    """{flag: value} of the flags a checkpoint of a run with ``args`` is bound to (``flag_values`` less the restored
    and free ones; the critic's where GAE trains one): step 3's --resume refuses another value than the checkpoint's
    (``check_same_flags``), and so does ``train.py --resume``'s plan, before any step runs
    (``pipeline_resume.refuse_other_bound_flags``)."""
    unbound = RESTORED_FLAGS + FREE_FLAGS + CRITIC_FREE_FLAGS
    return {name: value for name, value in flag_values(args, args.advantage_estimator == "gae").items()
            if name not in unbound}


def _unread_free_flags(args):
    """The ``FREE_FLAGS`` that this run's settings leave unread (``CONDITIONAL_FLAGS``: --ema_beta without
    --enable_ema, GAE's --lam under GRPO, the sampling settings with --greedy): said when changed, they were said to
    train the rest of the run, which they do not."""
    free = FREE_FLAGS + CRITIC_FREE_FLAGS
    return {name for names, read, _ in CONDITIONAL_FLAGS if not read(args) for name in names if name in free}


def _load_ema(module, path):
    """Rank 0 loads into ZeRO-3 gathers (then re-partitioned); unsharded copies load on every rank."""
    from dschat.models.zero3 import gathered, holds_zero3_params

    sharded = holds_zero3_params(module)
    state = torch.load(path, weights_only=True) if is_rank_0() or not sharded else None
    for name, param in module.named_parameters():
        with gathered([param], modifier_rank=0):
            if state is not None:
                param.data.copy_(state[name])
