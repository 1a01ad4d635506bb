"""DeepSpeedPPOTrainer: experience generation and the PPO update (DeepSpeed-Chat's API, dschat's math)."""
import argparse
import contextlib
import copy
import functools
import inspect
import time
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch.profiler import record_function as phase  # named ranges in a torch.profiler trace (µs each otherwise)

from dschat.args import resolve_pad_to_multiple_of, top_k_flag
from dschat.data.collators import padded_length
from dschat.errors import UsageError
from dschat.hybrid_engine.decode import (forward_spec, keeps_states_in_modules, reset_states_kept_in_modules,
                                         rows_of_each_prompt_length)
from dschat.hybrid_engine.generate_args import (check_left_padded, left_padded_lengths, merged_generation_config,
                                                resolve_max_new_tokens, resolve_min_new_tokens)
from dschat.hybrid_engine.graphs import default_generator, logits_vocab_size
from dschat.hybrid_engine.tensor_parallel import together
from dschat.models.attention import no_empty_query_rows
from dschat.models.left_padding import left_padding_moves, warn_of_padded_generation
from dschat.models.loading import generable_token_count, stop_token_ids, token_id_list
from dschat.models.lora import unwrap_peft
from dschat.models.reward_model import positions_from_mask
from dschat.models.zero3 import holds_zero3_params
from dschat.rlhf import algorithms as algo
from dschat.models.positions import position_limit
from dschat.rlhf.layout import forward_layout, head_reads, reward_scores
from dschat.rlhf.config import check_kl_settings, kl_in_loss, optimizer_steps_per_iteration, step3_args
from dschat.rlhf.engine import LONGEST_SEQUENCE_FLAGS, check_settings, longest_sequence
from dschat.rlhf.overflow import check_align_overflow, steps_skipped_together
from dschat.utils.dist import all_reduce, get_world_size, in_step_with_other_ranks, local_device, print_rank_0
from dschat.utils.optim import optimizer_step, skipped_steps

# the PPO step's diagnostics that train_rollout returns as means over its micro-batches
ACTOR_STEP_STATS = ("pg_clipfrac", "pg_clipfrac_low", "pg_clipfrac_high", "approx_kl")
# (kl_loss: the KL loss term's estimator, per token, where the KL is one; the rollout's "kl" is k1 per token, its
# "kl_per_answer" the reward penalty's estimator: rollout_kl)
PPO_STEP_STATS = ACTOR_STEP_STATS + ("kl_loss", "vf_clipfrac")


# The settings DeepSpeedRLHFEngine built its models, optimizers and generation from. A trainer given args of its own
# with other values of them failed (HF's generate called with the hybrid engine's arguments, GAE's advantages with no
# critic's values) or trained with the engine's silently (its learning rates, precision, LoRA, accumulation, gradient
# checkpointing, offloads, the hybrid engine's CUDA graphs, compilation and tensor parallelism).
ENGINE_SETTINGS = ("enable_hybrid_engine", "actor_zero_stage", "critic_zero_stage", "dtype", "offload", "enable_ema",
                   "gradient_accumulation_steps", "actor_lora_dim", "critic_lora_dim", "only_optimize_lora",
                   "actor_learning_rate", "critic_learning_rate", "actor_weight_decay", "critic_weight_decay",
                   "lr_scheduler_type", "num_warmup_steps", "actor_dropout", "critic_dropout",
                   "actor_gradient_checkpointing", "critic_gradient_checkpointing", "lora_alpha",
                   "actor_lora_module_name", "critic_lora_module_name", "actor_lora_learning_rate",
                   "critic_lora_learning_rate", "enable_mixed_precision_lora", "offload_reference_model",
                   "offload_reward_model", "compute_fp32_loss", "check_grad_overflow", "zero3_fetch",
                   "unpin_actor_parameters", "release_inference_cache", "inference_tp_size", "tp_gather_partition_size",
                   "enable_cuda_graph", "compile_decode_step", "decode_attention", "fuse_projections")


# What the engine built (or not) from a setting: (the flag, what it built, whether ``args`` build it). Within what the
# engine built, the setting may change (GRPO for RLOO: neither has a critic).
ENGINE_BUILT = (("advantage_estimator", "a critic (GAE's)", lambda a: a.advantage_estimator == "gae"),
                ("reward_model_weight", "a reward model", lambda a: bool(a.reward_model_weight)),
                ("unsupervised_dataset_name", "PPO-ptx's language-model step in the actor's accumulation",
                 lambda a: bool(a.unsupervised_dataset_name)))


def check_engine_settings(args, engine_args, restored=None):
    """A trainer's own ``args`` (``DeepSpeedPPOTrainer(engine, args)`` with other settings than the engine's) may
    change what the trainer alone reads (the PPO loss, sampling, KL, epochs) and generate shorter sequences, not what
    the engine was built with (``ENGINE_SETTINGS``, ``ENGINE_BUILT``; ``restored``: the engine's
    ``restored_settings``, which stand for its args'); else a UsageError naming them."""
    differ = engine_settings_differing(args, engine_args, restored)
    if differ:
        raise UsageError(f"DeepSpeedPPOTrainer(rlhf_engine, args): args differ from the settings the engine's models, "
                         f"optimizers and generation were built with: {'; '.join(differ)}. Give the engine's args "
                         "(args=None takes them; a copy changing only the trainer's settings: {**vars(engine.args), "
                         "'ppo_epochs': 2}), or build an engine with these")


def engine_settings_differing(args, engine_args, taken=None):
    """What of ``args`` differs from the settings the engine was built with (``engine_args``), each as "name value
    (the engine's: ...)"; ``taken``: {setting: value} that stand for the engine's (a checkpoint's restored learning
    rates, ``took_restored_flags``)."""
    taken = taken or {}
    built = {name: taken.get(name, getattr(engine_args, name)) for name in ENGINE_SETTINGS}
    differ = [f"{name} {getattr(args, name)!r} (the engine's: {value!r})"
              for name, value in built.items() if getattr(args, name) != value]
    differ += [f"{name} {getattr(args, name)!r} (the engine's: {getattr(engine_args, name)!r}, built "
               f"{_with(builds(engine_args))} {what})" for name, what, builds in ENGINE_BUILT
               if builds(args) != builds(engine_args)]
    if longest_sequence(args) > longest_sequence(engine_args):
        differ.append(f"{LONGEST_SEQUENCE_FLAGS} {longest_sequence(args)} (the engine's: "
                      f"{longest_sequence(engine_args)}, which its models were checked and sized for)")
    return differ


def _with(present):
    return "with" if present else "without"


def answer_mask(answers, eos_token_id):
    """1 on the real tokens of each generated answer: up to and including its first EOS; the generator fills the
    columns after it with padding.

    Works when pad == EOS (the first EOS is real, what follows is padding) and when the answer never ends. A pad token
    the model sampled before its EOS is a real token: the decode step attended to it and the tokens after it were
    sampled given it, so the forwards must see it too. (DeepSpeed-Chat masks every pad id, ``seq.not_equal(pad)``:
    its forwards then see a hole that generation never had, and the sampled pad's own log-prob is never trained.)
    """
    is_eos = torch.zeros_like(answers, dtype=torch.bool)
    for e in token_id_list(eos_token_id):
        is_eos |= answers == e
    ended_before = (is_eos.long().cumsum(1) - is_eos.long()) > 0
    return (~ended_before).long()


def pad_answers(seq, action_mask, pad_token_id, multiple_of, logprobs=None):
    """(seq, action_mask, logprobs) right-padded so the sequence length is a multiple of ``multiple_of``: at most
    ``multiple_of`` - 1 masked columns past prompt + max answer length (the models take positions from the mask, so
    no position is past what the user sized for).

    Generation stops when every row has ended, so the length of the generated sequences differs from batch to batch;
    rounding it up leaves few shapes for the forwards and backwards (cuDNN builds an attention plan per new shape).
    The new columns are padding: pad id, action mask 0, log-prob 0 (``logprobs`` (B, answer length) or None).
    The masks must be computed before: with pad == EOS a pad column after an unended answer would look like its EOS.
    """
    extra = padded_length(seq.shape[1], multiple_of) - seq.shape[1]
    if not extra:
        return seq, action_mask, logprobs
    logprobs = None if logprobs is None else F.pad(logprobs, (0, extra), value=0.0)
    return F.pad(seq, (0, extra), value=pad_token_id), F.pad(action_mask, (0, extra), value=0), logprobs


def answer_token_stats(model, seq, attention_mask, start, layout, chunk_size, entropy=False, temperature=1.0):
    """Log-probs (and entropies) of the answer tokens ``seq[:, start + 1:]``, (B, L - start - 1) each, from one
    forward of ``model`` (an engine: ``model.module`` is the HF model) over the rows as they are (``layout`` None)
    or shifted (a ``LeftAligned``), under ``softmax(logits / temperature)`` (``scoring_temperature``). The LM head
    runs on the answer positions only (``logits_to_keep`` where the model takes it; for shifted rows each row's own
    answer positions, picked before the head), so the prompt's logits are never computed or stored."""
    count = seq.shape[1] - start - 1
    takes_keep = forward_spec(model.module).takes_logits_to_keep
    if layout is None:
        keep = count + 1
        logits = model(input_ids=seq, attention_mask=attention_mask, position_ids=positions_from_mask(attention_mask),
                       use_cache=False, **({"logits_to_keep": keep} if takes_keep else {})).logits[:, -keep:-1]
    else:
        window = layout.answer_window(start)
        with head_reads(unwrap_peft(model.module), layout.answer_columns(start, count), window):
            logits = layout.forward(model, seq, use_cache=False,
                                    **({"logits_to_keep": window} if takes_keep else {})).logits
    labels = seq[:, start + 1:]
    stats = [algo.gather_log_probs(logits, labels, chunk_size, temperature)]
    if entropy:
        stats.append(algo.entropy_from_logits(logits, chunk_size, temperature))
    return stats if entropy else stats[0]


@contextlib.contextmanager
def sampling_from(generator):
    """HF's ``generate`` samples from the device's default generator, which every rank seeds alike (``setup_run``:
    ``set_seed(args.seed)``), so on several ranks each rank's answers drew the same noise (a prompt that two ranks
    got was answered alike, token for token, on both). Within this block the default generator holds ``generator``'s
    state (the trainer's, seeded per rank, which the hybrid engine samples from) and ``generator`` takes the state it
    reached; torch's own state is restored after. (Another accelerator's generator: left as it was.)"""
    device = generator.device
    if device.type not in ("cpu", "cuda"):
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        default = default_generator(device)
        default.set_state(generator.get_state())
        try:
            yield
        finally:
            generator.set_state(default.get_state())


def prompt_batch(prompts, mask=None):
    """``generate_experience``'s prompts as a batch dict with "prompt" and "prompt_att_mask": a tensor with its
    ``mask``, the batch dict of ``DataCollatorRLHF``, or a tokenizer's output (``input_ids``, ``attention_mask``)."""
    if isinstance(prompts, Mapping) and "prompt" not in prompts and "input_ids" in prompts:
        prompts, mask = prompts["input_ids"], prompts.get("attention_mask", mask)
    batch = dict(prompts) if isinstance(prompts, Mapping) else {"prompt": prompts, "prompt_att_mask": mask}
    if is_ids_and_mask_in_one(prompts):  # (tokenized already: "tokenize texts first" misled)
        raise UsageError(f"generate_experience: the prompts are a {type(prompts).__name__} of two tensors; pass the "
                         "token ids and their attention mask as two arguments, generate_experience(prompts, mask), "
                         "or a tokenizer's output")
    if not torch.is_tensor(batch.get("prompt")):  # (before the mask: a list of texts was said to lack its mask)
        raise UsageError(f"generate_experience: the prompts are a {type(batch.get('prompt')).__name__}, not a tensor "
                         "of token ids; tokenize texts first: tokenizer(texts, return_tensors='pt', padding=True) with "
                         "load_tokenizer(path, padding_side='left')")
    if batch.get("prompt_att_mask") is None:
        raise ValueError("generate_experience(prompts, mask): the prompts' attention mask is missing; pass it as "
                         "mask (or a batch with prompt_att_mask, or a tokenizer's output with attention_mask)")
    check_prompt_shapes(batch["prompt"], batch["prompt_att_mask"])
    return batch


def is_ids_and_mask_in_one(prompts):
    """Whether ``prompts`` is a (ids, mask) pair of tensors, as a tuple or a list (a TensorDataset's batch)."""
    return isinstance(prompts, (tuple, list)) and len(prompts) == 2 and all(map(torch.is_tensor, prompts))


def check_prompt_shapes(prompts, mask):
    """Prompts as (rows, tokens) ids with a mask of that shape, at least one row of one token: else a model's
    reshape or an index error deep in generation."""
    if not (torch.is_tensor(prompts) and torch.is_tensor(mask)):
        raise UsageError(f"generate_experience: prompts and mask must be tensors, not {type(prompts).__name__} and "
                         f"{type(mask).__name__} (a tokenizer's output: return_tensors='pt')")
    if prompts.ndim != 2 or prompts.shape[0] == 0 or prompts.shape[1] == 0 or mask.shape != prompts.shape:
        raise UsageError(f"generate_experience: prompts must be (rows, tokens) ids, at least one of each, with a mask "
                         f"of the same shape; got prompts {tuple(prompts.shape)} and mask {tuple(mask.shape)}")


def check_prompt_length(mask, max_prompt_seq_len):
    """No prompt longer than max_prompt_seq_len: the generation, and the models' positions, are sized for it."""
    longest = int(mask.sum(1).max())
    if longest > max_prompt_seq_len:
        raise UsageError(f"generate_experience: a prompt of {longest} tokens is longer than max_prompt_seq_len "
                         f"{max_prompt_seq_len}; cut the prompts to it (tokenizer(..., truncation=True, max_length="
                         f"{max_prompt_seq_len})) or raise max_prompt_seq_len")


def sampling_kwargs(args, hf_generate=False):
    """The sampling keyword arguments of step 3's generation from --greedy / --temperature / --top_k / --top_p, for
    the hybrid engine and (``hf_generate``) HF's ``generate`` (``top_k_flag``: a non-positive --top_k is off on both).
    Greedy: HF gets no sampling settings, which it would warn about. --repetition_penalty is always given: the actor's
    generation_config's (a chat model's may ask for one) would otherwise change what is sampled, not what is scored."""
    penalty = {"repetition_penalty": args.repetition_penalty}  # (given: else the generation_config's would apply)
    if args.greedy and hf_generate:
        return {"do_sample": False, "temperature": None, "top_k": None, "top_p": None, **penalty}
    return {"do_sample": not args.greedy, "temperature": args.temperature, "top_k": top_k_flag(args.top_k),
            "top_p": args.top_p, **penalty}


def scoring_temperature(args):
    """The temperature step 3 scores its answers at (old, new and reference log-probs, entropy): the one they were
    sampled at, as TRL's, OpenRLHF's and verl's PPO/GRPO do, so that the policy PPO's ratio and KL measure is the one
    that drew the answers (scored at 1 instead, a --temperature 0.7 rollout trained another policy than the one it
    sampled). Greedy answers: 1. (top-k / top-p filters are not taken into the scores, as in those libraries.)"""
    return 1.0 if args.greedy else float(args.temperature)


def answer_stop_ids(actor, tokenizer):
    """The EOS id(s) that end the actor's answers: the tokenizer's, then any other its generation_config lists
    (Llama-3-Instruct's <|end_of_text|> beside <|eot_id|>), as the tools and HF's generate stop on them
    (``stop_token_ids``). An int when there is one, as ``tokenizer.eos_token_id``."""
    ids = stop_token_ids(unwrap_peft(actor.module), tokenizer)
    return ids if len(ids) > 1 else ids[0]


def untokenized_ids(model, tokenizer):
    """The ids of ``model``'s logits that ``tokenizer`` has no token for: embedding rows past ``len(tokenizer)``
    (Qwen2.5's 271; step 3 grows a critic's and reward model's to the actor's). HF's ``generate`` is told to suppress
    them, as the hybrid engine leaves them out (``sampling.chosen_columns``): sampled, such an id decodes to nothing and
    no reward model has scored it."""
    return list(range(generable_token_count(model, tokenizer), logits_vocab_size(model)))


def suppress_untokenized(model, tokenizer):
    """HF ``generate``'s keyword arguments that leave out ``untokenized_ids``: ``{"suppress_tokens": ids}``, or ``{}``
    where the model has no such row."""
    untokenized = untokenized_ids(model, tokenizer)
    return {"suppress_tokens": untokenized} if untokenized else {}


def hf_generate(model, tokenizer):
    """``model``'s HF ``generate`` choosing no id the tokenizer has no token for (``untokenized_ids``, as the hybrid
    engine leaves them out), its arguments built at each call from the tokenizer as it is now: the one path of step 3's
    rollouts without the hybrid engine, its held-out evaluation and the tools' ``evaluate_policy`` (they score as step
    3 does). ``synced_gpus`` unsaid is said to HF as the model needs (``synced_as_the_model_needs``); a batch of no
    row is refused (``check_rows_to_generate``)."""
    suppressed = suppress_untokenized(model, tokenizer)
    generate = functools.partial(model.generate, **suppressed) if suppressed else model.generate
    if keeps_states_in_modules(model):
        generate = functools.partial(from_fresh_module_states, model, generate)
    row_by_row = left_padding_moves(model)
    generate = functools.partial(generate_row_by_row, model, generate) if row_by_row else generate
    return functools.partial(synced_as_the_model_needs, model, generate, ranks_agree_on_calls=row_by_row)


def synced_as_the_model_needs(model, generate, input_ids, synced_gpus=None, ranks_agree_on_calls=False, **kwargs):
    """``generate`` told ``synced_gpus`` outright: as the caller says, else ``syncs_ranks``'s default, which sees a
    ZeRO-3 model by its partitioned parameters. HF's own default (None) sees ZeRO-3 only while an HfDeepSpeedConfig
    is alive, which dschat's loaders let go once the model is built (``model_load_context``): a ZeRO-3 model on
    several ranks generated unsynced, and the ranks hung once one's answers ended first (``evaluate_policy`` called
    without ``synced_gpus``). Said only to a ``generate`` that takes it (``synced_gpus_said``). A batch of no row is
    refused here (``check_rows_to_generate``), except where synced ranks agree on their calls before any
    (``ranks_agree_on_calls``: ``generate_row_by_row``): there every rank is refused together, in that agreement."""
    synced = syncs_ranks(model, synced_gpus)
    if input_ids is None or not (synced and ranks_agree_on_calls):
        check_rows_to_generate(input_ids, model if ranks_agree_on_calls else None)
    return generate(input_ids, **synced_gpus_said(model, synced), **kwargs)


def synced_gpus_said(model, synced):
    """``{"synced_gpus": synced}`` where ``model``'s generate takes it (transformers' does; a remote-code model's own
    generate may not, and failed with a TypeError at every call, from the tools on one rank too); ``{}`` where it
    does not and the ranks need no syncing; a ``UsageError`` naming the model's class where they do: such a
    generate cannot keep ZeRO-3 ranks stepping together (unsynced, they hang once one's answers end first). The
    generate asked is the one the keyword reaches (``generate_owner``: a LoRA actor's base model's)."""
    owner = generate_owner(model)
    if takes_keyword(owner.generate, "synced_gpus"):
        return {"synced_gpus": synced}
    if synced:
        raise UsageError(f"{type(owner).__name__}.generate takes no synced_gpus (nor **kwargs), which ZeRO-3 on "
                         f"several ranks needs: each forward gathers the weights from every rank, so a rank whose "
                         f"answers end first must keep stepping with the others. Generate on one rank, or without "
                         f"ZeRO-3 for this model (step 3: --actor_zero_stage 2, or --enable_hybrid_engine, whose "
                         f"generation is its own)")
    return {}


def generate_owner(model):
    """The model whose ``generate`` receives ``model.generate``'s keyword arguments: a PEFT model's own generate takes
    ``*args, **kwargs`` and hands them to its base model's, which is the one to ask; a generate set on the instance
    (the hybrid engine's route, ``route_module_generate``) takes them itself."""
    base = unwrap_peft(model)
    return base if base is not model and "generate" not in vars(model) else model


def takes_keyword(fn, name):
    """Whether ``fn`` can be called with the keyword argument ``name``: a parameter of that name, or ``**kwargs``.
    Read at each call, not kept: ~0.1 ms on a CPU, where HF's generate reads signatures itself 7 times a call."""
    params = inspect.signature(fn).parameters
    return any(p.kind == p.VAR_KEYWORD or (n == name and p.kind != p.POSITIONAL_ONLY) for n, p in params.items())


def check_rows_to_generate(input_ids, row_by_row_model=None):
    """A ``UsageError`` for a batch of no row: HF generate cannot run on one (the model's forward fails deep inside,
    e.g. Llama's attention reshape), nor could such a rank keep in step with its peers under ``synced_gpus`` (its
    spare calls take its first row). dschat's callers never make one: step 3 refuses it (``check_prompt_shapes``),
    and the held-out loaders on several ranks give every rank as many batches, each of at least one row
    (``distributed_eval_loader``: the ranks' shares padded with repeats). No ``input_ids`` (None) HF generates from
    BOS, except for ``row_by_row_model``, generated row by row (``generate_row_by_row``: RWKV, xLSTM, RecurrentGemma,
    DeepSeek-V4), which reads the prompts' rows: refused by name (it failed with an AttributeError on None's shape)."""
    if input_ids is None and row_by_row_model is not None:
        raise UsageError(f"hf_generate: no input_ids, for {type(row_by_row_model).__name__}, which generates row by "
                         "row from its prompts (its outputs move with left padding): give input_ids, e.g. "
                         "torch.tensor([[tokenizer.bos_token_id]]) to generate from BOS as HF does without them")
    if input_ids is not None and input_ids.shape[0] == 0:  # (None: HF generates from BOS)
        raise no_prompt_error(input_ids.shape)


def no_prompt_error(shape, own=True):
    """The ``UsageError`` for this rank's batch of no row, of ``shape`` (``check_rows_to_generate``), or (not ``own``)
    for a peer's, where the ranks are refused together (``generate_in_step_with_other_ranks``)."""
    which = f"a batch of no prompt (input_ids {tuple(shape)})" if own else \
        "another rank's batch of no prompt (every rank stops: under synced_gpus the ranks generate in step)"
    return UsageError(f"hf_generate: {which}: give each call, on every rank, at least one row (several ranks: share "
                      f"the prompts with dschat.data.samplers.distributed_eval_loader, which pads each rank's share)")


def from_fresh_module_states(model, generate, input_ids, **kwargs):
    """``generate(input_ids, **kwargs)`` with the states a model keeps in its modules set up afresh
    (``decode.reset_states_kept_in_modules``: RecurrentGemma's): HF generate hands the model a cache, so they are never
    reset, and a one-token prompt (its prefill taken for a decode step) went on from the previous call's convolution
    state, log-probs 0.03 off; generating row by row made such calls common."""
    reset_states_kept_in_modules(model, input_ids.shape[0], input_ids.device)
    return generate(input_ids, **kwargs)


def generate_row_by_row(model, generate, input_ids, attention_mask=None, **kwargs):
    """HF ``generate`` of a model whose outputs left padding moves (``LEFT_PADDING_MOVES_SCORES``: the mask does not
    reach its recurrence): each row generates as it would alone, from its prompt without the padding: the rows of one
    prompt length together where the family's batched decode keeps rows apart (``decodes_rows_apart``), else one row
    at a time, each getting the new tokens the batch gets (``with_the_batchs_new_token_counts``: a ``max_length``
    counts the padding). The answers come back after the prompts as the caller gave them, right-padded with the pad
    id, as one batched call returns them. Under ``synced_gpus`` (ZeRO-3 on several ranks) every rank makes as many calls
    (``generate_in_step_with_other_ranks``). Where the padding cannot be left out (a prompt with no token or a hole;
    no pad id) the batch generates as it is, said once, with RWKV's decode and xLSTM's cache mended all the same
    (``decodes_rows_apart``), so that its unpadded rows' answers are each row's own."""
    together = decodes_rows_apart(model)  # (first: its mends serve the batch generated as it is too)
    pad_id = kwargs.get("pad_token_id", getattr(model.generation_config, "pad_token_id", None))
    synced = bool(kwargs.get("synced_gpus"))  # (``synced_as_the_model_needs``'s word: left out, the ranks need none)
    lengths = left_padded_lengths(attention_mask) if pad_id is not None else None
    if lengths is None:
        warn_of_padded_generation(model, attention_mask)
        return generate_in_step_with_other_ranks(generate, [(input_ids, attention_mask)], synced, kwargs,
                                                 input_ids)[0]
    width = input_ids.shape[1]
    kwargs = with_the_batchs_new_token_counts(model, kwargs, width)
    groups = rows_to_generate_together(lengths, together)
    calls = [(input_ids[rows, width - length:], attention_mask[rows, width - length:]) for rows, length in groups]
    outputs = generate_in_step_with_other_ranks(generate, calls, synced, kwargs, input_ids)
    answers = [(rows, out[:, length:]) for (rows, length), out in zip(groups, outputs)]
    seq = input_ids.new_full((input_ids.shape[0], width + max(a.shape[1] for _, a in answers)), pad_id)
    seq[:, :width] = input_ids
    for rows, answer in answers:
        seq[rows, width:width + answer.shape[1]] = answer
    return seq


def with_the_batchs_new_token_counts(model, kwargs, width):
    """``kwargs`` for generating rows of a batch of ``width`` columns (padding included) without their padding: the
    new-token counts HF gives the batch as passed, as ``max_new_tokens`` and (where a minimum is set)
    ``min_new_tokens``, in place of HF's totals ``max_length`` and ``min_length`` (the call's, else its
    ``generation_config``'s or the model's), which count the prompt: a row without its padding took the padding's
    place in new tokens (max_length 8, a 4-column batch: a 2-token prompt got 6 new tokens, the batch 4) and the
    answers came back wider than max_length. HF's default (20 new tokens, cut at the position limit) too."""
    config = merged_generation_config(getattr(model, "generation_config", None), kwargs.get("generation_config"))

    def setting(name):  # (the call's, else the generation_config's: HF's order)
        value = kwargs.get(name)
        return value if value is not None else getattr(config, name, None)

    limit = getattr(model.config, "max_position_embeddings", None)
    counts = {"max_new_tokens": resolve_max_new_tokens(setting("max_new_tokens"), setting("max_length"), width, None,
                                                       limit if isinstance(limit, int) else None)}
    if setting("min_new_tokens") is not None or setting("min_length") is not None:
        counts["min_new_tokens"] = resolve_min_new_tokens(setting("min_new_tokens"), setting("min_length"), width,
                                                          None)
    return {**{k: v for k, v in kwargs.items() if k not in ("max_length", "min_length")}, **counts}


def syncs_ranks(model, synced_gpus):
    """Whether HF generate keeps the ranks stepping together (``synced_gpus``: every forward a collective): as the
    caller says, else where ``model``'s forwards are collectives: ZeRO-3 (its parameters partitioned: DeepSpeed
    converts every one, persistent ones too) or FSDP, on several ranks (``synced_as_the_model_needs`` tells HF this
    answer). Not HF's ``is_deepspeed_zero3_enabled()``: it says whether an HfDeepSpeedConfig is alive in this process,
    not whether this model is partitioned, so a plain model (a policy loaded without ZeRO) synced where one outlived a
    load, and on one rank alone (garbage collected later there) that rank waited for peers that never came. Ranks must
    make as many calls exactly where HF syncs them, and agreeing on that count is a collective that a rank generating
    alone (HF not syncing) must not make."""
    if synced_gpus is not None:
        return bool(synced_gpus)
    from transformers.integrations.fsdp import is_fsdp_managed_module

    return (holds_zero3_params(model) or is_fsdp_managed_module(model)) and get_world_size() > 1


def generate_in_step_with_other_ranks(generate, calls, synced, kwargs, batch):
    """``generate``'s output for each of ``calls`` ((input_ids, attention_mask)), in order: parts of the prompts
    ``batch``. Under ``synced`` every rank's forwards are collectives, so every rank makes as many calls
    (``in_step_with_other_ranks``; within one call HF's ``synced_gpus`` keeps the ranks stepping until all have
    finished): a rank with fewer makes the rest on its first call's first row, their answers and random draws
    discarded. A batch of no row makes no call: under ``synced`` every rank is refused together
    (``no_prompt_error``), in the ranks' agreement on their calls."""
    calls = [(ids, mask) for ids, mask in calls if ids.shape[0]]

    def spare():
        input_ids, attention_mask = calls[0]
        mask = None if attention_mask is None else attention_mask[:1]
        with torch.random.fork_rng(devices=[input_ids.device] if input_ids.device.type == "cuda" else []):
            generate(input_ids[:1], attention_mask=mask, **kwargs)

    own = [functools.partial(generate, ids, attention_mask=mask, **kwargs) for ids, mask in calls]
    return in_step_with_other_ranks(own, spare, synced, batch.device, functools.partial(no_prompt_error, batch.shape))


# ``LEFT_PADDING_MOVES_SCORES`` families whose batched decode in transformers keeps unpadded rows apart as it is:
# greedy tokens of rows of one prompt length together equal each row's alone (transformers 5.25, tiny models, prompts
# of 1 to 20 tokens, past the attention windows and DeepSeek-V4's compression, EOS in one row mid-way:
# tests/test_ppo.py::test_rows_of_one_prompt_length_generate_together_where_the_batched_decode_keeps_them_apart).
BATCHED_DECODE_KEEPS_ROWS_APART = frozenset({"recurrent_gemma", "deepseek_v4"})


def decodes_rows_apart(model):
    """Whether HF generate may take rows of one prompt length of ``model`` (a ``LEFT_PADDING_MOVES_SCORES`` family)
    together, as each alone: RecurrentGemma's and DeepSeek-V4's (``BATCHED_DECODE_KEEPS_ROWS_APART``); RWKV's where its
    one-token decode step keeps a batch's rows apart (transformers' mixes them up to 5.25 at least; dschat's fix:
    ``compat.rwkv_decode_keeps_rows_apart``); xLSTM's where its cache fits its layers (transformers' misfits some
    sizes, one row too; dschat's fix: ``compat.xlstm_cache_fits_its_layers``), else one row at a time. Those fixes
    go in here, for the process; their probes read no weights, so any rank may run them, under ZeRO-3 too."""
    from dschat.compat import rwkv_decode_keeps_rows_apart, xlstm_cache_fits_its_layers

    model_type = getattr(model.config, "model_type", None)
    if model_type == "rwkv":
        return rwkv_decode_keeps_rows_apart(model)
    if model_type == "xlstm":
        return xlstm_cache_fits_its_layers(model)
    return model_type in BATCHED_DECODE_KEEPS_ROWS_APART


def rows_to_generate_together(lengths, of_one_length):
    """(rows, prompt length) of each generate call: the rows of each prompt length (``lengths``, (B,)) together where
    ``of_one_length`` (``rows_of_each_prompt_length``: the lengths ascending), else each row alone, in order."""
    if not of_one_length:
        return [(torch.tensor([row], device=lengths.device), length) for row, length in enumerate(lengths.tolist())]
    return rows_of_each_prompt_length(lengths)


def answer_texts(tokenizer, answers, mask):
    """Each answer's text: its tokens where ``mask`` is set, without special tokens, stripped (what a reward function
    and the examples read)."""
    return [tokenizer.decode(row[m.bool()], skip_special_tokens=True).strip() for row, m in zip(answers, mask)]


def prompt_texts(tokenizer, prompts, mask):
    """Left-padded prompt ids as the text a loader batch's ``prompt_text`` holds, so that a reward function gets the
    same prompts whichever way they came: each row's real tokens with their special tokens (a chat template's
    markers), less those the tokenizer puts before any text (BOS), which ``prompt_text`` has not (a chat template
    writes its own, and the prompt is then tokenized without them)."""
    from dschat.data.formatting import uses_chat_template
    from dschat.data.pipeline import leading_special_ids

    lead = [] if uses_chat_template(tokenizer) else leading_special_ids(tokenizer)
    texts = []
    for row, keep in zip(prompts.tolist(), mask.bool().tolist()):
        ids = [token for token, real in zip(row, keep) if real]
        texts.append(tokenizer.decode(ids[len(lead):] if lead and ids[:len(lead)] == lead else ids))
    return texts


def kl_controller_assigned(controller, current, args):
    """What ``trainer.kl_ctl = controller`` sets: a FixedKLController or AdaptiveKLController as it is; a number
    (DeepSpeed-Chat's kl_ctl, a float) as a fixed controller of that coefficient, where the run's controller is a fixed
    one that the reward reads; else a TypeError or UsageError saying what to assign. Another class of controller is
    refused: the checkpoints record the controller as args' settings (``kl_controller_settings``) and a resume makes
    it again from them (``restore_kl_controller``), as one of these two."""
    import math
    import numbers

    if isinstance(controller, (algo.FixedKLController, algo.AdaptiveKLController)):
        if type(controller) not in algo.KL_CONTROLLERS.values():
            raise UsageError(f"trainer.kl_ctl = {type(controller).__name__}(...): a subclass of "
                             f"{type(controller).__mro__[1].__name__}, which a resumed run would make from the "
                             "checkpoint's settings (adaptive_kl, kl_ctl, kl_target, kl_horizon) without its changes; "
                             "assign a FixedKLController or AdaptiveKLController (dschat.rlhf.algorithms)")
        return controller
    if isinstance(controller, bool) or not isinstance(controller, numbers.Real):
        raise TypeError(f"trainer.kl_ctl = {controller!r}: expected the KL coefficient (a float, as DeepSpeed-Chat's "
                        "kl_ctl) or a KL controller (dschat.rlhf.algorithms.FixedKLController / AdaptiveKLController, "
                        f"which the checkpoints record as args' adaptive_kl, kl_ctl, kl_target and kl_horizon), got "
                        f"{type(controller).__name__}")
    if not math.isfinite(controller) or controller < 0:
        raise UsageError(f"trainer.kl_ctl = {controller!r}: the KL coefficient must be a non-negative number")
    if args is not None and kl_in_loss(args):  # (as --kl_ctl is refused there: it would change nothing)
        raise UsageError(f"trainer.kl_ctl = {controller!r}: kl_ctl weighs the per-token reward's KL, which this run "
                         f"(--advantage_estimator {args.advantage_estimator}, --kl_in_reward {int(args.kl_in_reward)})"
                         " does not use: the KL is a loss term weighted by trainer.args.kl_loss_coef")
    if current is not None and not isinstance(current, algo.FixedKLController):
        raise UsageError(f"trainer.kl_ctl = {controller!r}: this run's KL controller is not a fixed one "
                         f"({type(current).__name__}: --adaptive_kl changes its coefficient each iteration); set "
                         f"trainer.kl_ctl.value = {controller!r} to go on adapting from that coefficient, or assign "
                         f"dschat.rlhf.algorithms.FixedKLController({controller!r}) to hold it fixed")
    return algo.FixedKLController(controller)


def kl_controller_of(args):
    """The KL controller step 3's flags make (--adaptive_kl, --kl_ctl, --kl_target, --kl_horizon)."""
    return algo.get_kl_controller("adaptive" if args.adaptive_kl else "fixed", args.kl_ctl, args.kl_target,
                                  args.kl_horizon)


def kl_controller_settings(controller):
    """The step-3 flags that make ``controller`` (``get_kl_controller`` from adaptive_kl, kl_ctl, kl_target,
    kl_horizon): a fixed one's leave the adaptive settings at their defaults, which --kl_target and --kl_horizon must
    be without --adaptive_kl."""
    from dschat.args import step3_parser

    if isinstance(controller, algo.AdaptiveKLController):
        return {"adaptive_kl": True, "kl_ctl": controller.value, "kl_target": controller.target,
                "kl_horizon": controller.horizon}
    parser = step3_parser()
    return {"adaptive_kl": False, "kl_ctl": controller.value, "kl_target": parser.get_default("kl_target"),
            "kl_horizon": parser.get_default("kl_horizon")}


def record_kl_controller(args, controller, where):
    """``args`` set to the settings that make ``controller`` (a trainer's, assigned), checked as the flags are, so
    that the rewards, ``train_rollout``'s adaptive updates (read from args.adaptive_kl), the checkpoints and their
    resume take the controller the run trains with: an AdaptiveKLController assigned to a fixed run was never
    updated, and a controller assigned was recorded as the flags' (a resume made the flags' one again, unsaid)."""
    settings = {name: checked_setting(name, value, where) for name, value in kl_controller_settings(controller).items()
                if value != getattr(args, name)}
    if not settings:
        return
    wanted = copy.copy(args)
    vars(wanted).update(settings)
    try:
        check_kl_settings(wanted)
    except UsageError as error:
        raise UsageError(f"{where}: {error}") from None
    vars(args).update(settings)


class _EngineModel:
    """A trainer's model (``actor_model``, ``ref_model``, ...), read through its DeepSpeedRLHFEngine each time: the
    trainer holds no engine of its own, so the engine's release frees the models while a notebook's trainer lives on,
    and the trainer then fails with the engine's error saying it was released (not DeepSpeed's on destroyed state).
    A model set on the trainer itself (a test's stand-in) is its own."""

    def __init__(self, role):
        self.role = role  # the DeepSpeedRLHFEngine attribute

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, trainer, owner=None):
        if trainer is None:
            return self
        if self.name in trainer.__dict__:
            return trainer.__dict__[self.name]
        if "rlhf_engine" not in trainer.__dict__:  # (a trainer built without __init__, this model not set)
            raise AttributeError(f"{type(trainer).__name__!r} object has no attribute {self.name!r}")
        return getattr(trainer.rlhf_engine, self.role)

    def __set__(self, trainer, model):
        trainer.__dict__[self.name] = model


class _ArgsSetting:
    """A DeepSpeed-Chat trainer attribute its loop may change (its trainer's "Those value can be changed": cliprange,
    gamma, ...; max_answer_seq_len), read from and written to ``trainer.args``, which generation, the losses and the
    checkpoints read. As copies of args made in __init__, ``trainer.max_answer_seq_len = 64`` changed nothing
    (generation read args) and neither did ``trainer.args.cliprange = 0.1`` (the loss read the copy), without a
    word. A value is checked as the flag's (``trainer.gamma = 1.5`` is an error)."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, trainer, owner=None):
        if trainer is None:
            return self
        return getattr(trainer.args, self.name)

    def __set__(self, trainer, value):
        value = checked_setting(self.name, value, f"trainer.{self.name} = {value!r}")
        if self.name == "max_answer_seq_len":
            trainer._check_answers_fit(trainer.args, self.name, value, f"trainer.max_answer_seq_len = {value}")
        setattr(trainer.args, self.name, value)


def checked_setting(name, value, where):
    """``value`` of step 3's flag ``name`` as a notebook's args take it (converted, range-checked), or a UsageError
    saying ``where``."""
    from dschat.args import namespace_with_defaults, step3_parser

    if value is None:  # (args would read it as "the default")
        raise UsageError(f"{where}: give a value (see --{name} in step 3's --help)")
    try:
        return getattr(namespace_with_defaults(step3_parser(), {name: value}), name)
    except UsageError as error:
        raise UsageError(f"{where}: {error}") from None


def engine_setting_error(attribute, value, flag):
    return UsageError(f"trainer.{attribute} = {value!r}: the engine's models were built with {flag} (DeepSpeed-Chat "
                      f"reads it from args too); build a DeepSpeedRLHFEngine with another {flag} instead")


def trainer_args(args, engine_args, restored=None):
    """A trainer's own args, which it reads and its changes go to: those given (as step 3's namespace), else a copy of
    its engine's as they are now. An engine's args are read-only (``BuiltArgs``: what it was built with), so a copy is
    taken of them whether given or not, its lists its own; a trainer's changes then never reach its engine or another
    trainer on it. ``restored``: the settings the engine's optimizers run at in place of its args' (its
    ``restored_settings``), which args holding the engine's built values take, as ``load_checkpoint`` sets them."""
    from dschat.rlhf.engine import BuiltArgs, unshared_settings

    args = step3_args(args if args is not None else engine_args)
    if isinstance(args, BuiltArgs):
        args = argparse.Namespace(**unshared_settings(args))
    for name, value in (restored or {}).items():
        if getattr(args, name) == getattr(engine_args, name, None) != value:
            print_rank_0(f"[step3] DeepSpeedPPOTrainer: {name} {getattr(args, name)!r} -> {value!r}, the rate the "
                         "engine's optimizer runs at since a checkpoint's load restored it")
            setattr(args, name, value)
    return args


class DeepSpeedPPOTrainer:
    """``DeepSpeedPPOTrainer(rlhf_engine, args)`` or ``DeepSpeedPPOTrainer(engine=..., args=...)``.

    DeepSpeed-Chat's attributes ``max_answer_seq_len``, ``clip_reward_value``, ``cliprange``, ``cliprange_value``,
    ``gamma`` and ``lam`` are ``args``' settings (``_ArgsSetting``): assigned, they change what the run reads; so does
    a coefficient or a FixedKLController / AdaptiveKLController assigned to ``kl_ctl`` (args' kl_ctl, adaptive_kl,
    kl_target, kl_horizon: the checkpoints record them).
    ``z3_enabled``, ``compute_fp32_loss`` and ``end_of_conversation_token_id`` read as there, and are not assigned."""

    _said_hand_loop = False  # (class defaults: tests build trainers without __init__)
    _said_unequal_hand_group = False
    _said_schedule_ended = False
    _hand_group_answers = ()  # a hand loop's answers (all ranks) of each micro-batch of its optimizer step so far
    _group_loss_tokens = ()  # this rank's loss tokens of each PPO micro-batch of the optimizer step so far
    no_token_skips = {}  # {"actor", "critic": the optimizer steps this trainer skipped for no token in the loss}
    actor_model, ref_model, critic_model = _EngineModel("actor"), _EngineModel("ref"), _EngineModel("critic")
    reward_model, actor_ema = _EngineModel("reward"), _EngineModel("actor_ema")
    max_answer_seq_len, clip_reward_value = _ArgsSetting(), _ArgsSetting()
    cliprange, cliprange_value, gamma, lam = _ArgsSetting(), _ArgsSetting(), _ArgsSetting(), _ArgsSetting()

    def __init__(self, rlhf_engine=None, args=None, engine=None):
        self.rlhf_engine = rlhf_engine or engine
        if self.rlhf_engine is None:
            raise TypeError("DeepSpeedPPOTrainer needs the DeepSpeedRLHFEngine (rlhf_engine= or engine=)")
        if not hasattr(self.rlhf_engine, "actor"):  # e.g. (args, engine) swapped
            raise TypeError(f"DeepSpeedPPOTrainer(rlhf_engine, args): the engine given is a "
                            f"{type(self.rlhf_engine).__name__}, not a DeepSpeedRLHFEngine")
        engine_args = getattr(self.rlhf_engine, "args", None)
        restored = getattr(self.rlhf_engine, "restored_settings", None)
        self.args = args = trainer_args(args, engine_args, restored)
        if engine_args is None or vars(args) != vars(engine_args):  # settings of its own: checked as the engine's were
            check_settings(args)
            if engine_args is not None:
                check_engine_settings(args, engine_args, restored)
        e = self.rlhf_engine  # (its models are read through it: _EngineModel)
        self.tokenizer = e.tokenizer
        # the longest prompt + answer the engine's models were checked and sized for (``max_answer_seq_len``'s bound)
        self._longest_sized = longest_sequence(getattr(e, "args", None) or args)
        self.pad_token_id = self.tokenizer.pad_token_id
        self.eos_token_id = answer_stop_ids(self.actor_model, self.tokenizer)
        self.kl_ctl = kl_controller_of(args)
        self.hybrid = args.enable_hybrid_engine
        self.align_overflow = check_align_overflow(args)
        self.pad_to_multiple_of = resolve_pad_to_multiple_of(args.pad_to_multiple_of)
        # how far shifted rows may be rounded up (positions.position_limit): every model of the experience
        self.position_limit = position_limit(*(unwrap_peft(m.module) for m in
                                               (self.actor_model, self.ref_model, self.critic_model, self.reward_model)
                                               if m is not None))
        self.device = next(self.actor_model.module.parameters()).device
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(args.seed + 1000 * torch.distributed.get_rank())  # independent per rank
        self.reward_fn = None
        if args.reward_fn:
            from dschat.rlhf.reward_fn import load_reward_fn

            self.reward_fn = load_reward_fn(args.reward_fn)
        if self.reward_model is None and self.reward_fn is None:
            raise UsageError("step 3 needs a reward: a reward model (--reward_model_weight != 0) or --reward_fn")
        self.stats = {}

    def _check_answers_fit(self, args, name, value, where):
        """An answer length of ``args`` (``name``: ``max_answer_seq_len``, ``eval_max_new_tokens``) set to ``value``
        may shorten the answers, not lengthen them past what the engine's models were checked and sized for (as a
        trainer's own args may not: ``check_engine_settings``); else a UsageError saying ``where``."""
        longest = getattr(self, "_longest_sized", None)  # (None: a trainer built without __init__)
        wanted = copy.copy(args)
        setattr(wanted, name, value)
        if longest is not None and longest_sequence(wanted) > longest:
            raise UsageError(f"{where}: {LONGEST_SEQUENCE_FLAGS} would be {longest_sequence(wanted)}, longer than the "
                             f"{longest} the engine's models were checked and sized for; build the engine with the "
                             f"longer {name}")

    def _check_engine_settings_kept(self, call):
        """Before ``call`` generates or trains: ``trainer.args`` still hold the settings the engine built its models,
        optimizers and generation from. Changed after the trainer was built (``trainer.args.actor_learning_rate =
        1e-6``, ``gradient_accumulation_steps``, a longer ``max_answer_seq_len``), the run went on with the engine's,
        its checkpoints recording the new value."""
        engine = self.__dict__.get("rlhf_engine")
        engine_args = getattr(engine, "args", None)
        if engine_args is None:  # (a test's stand-in)
            return
        differ = engine_settings_differing(self.args, engine_args, getattr(engine, "restored_settings", None))
        if differ:
            raise UsageError(f"{call}: trainer.args were changed after the trainer was built in settings the engine's "
                             f"models, optimizers and generation were built with, which the run would go on with: "
                             f"{'; '.join(differ)}. Set them back (trainer.args.<name> = the engine's), or build a "
                             "DeepSpeedRLHFEngine with them and a trainer on it")

    def took_restored_flags(self, restored):
        """``load_checkpoint``'s: the settings DeepSpeed restored from a checkpoint (its learning rates), which
        ``trainer.args`` now hold: the engine's optimizers run at them, so they stand for its args' in every trainer's
        check (``restored_settings``), and a trainer built on it after takes them (a second one given these args was
        refused, their rate not the engine's as built)."""
        engine = self.__dict__.get("rlhf_engine")
        if engine is not None:  # (None: a test's stand-in, which has no engine's settings to keep)
            engine.restored_settings = {**getattr(engine, "restored_settings", {}), **restored}

    # --- experience ---------------------------------------------------------------------------------------
    def _generate_sequence(self, prompts, mask):
        """Answers of the actor, as full sequences (prompt + answer, padded after EOS), and with
        ``--logprobs_from_generation`` the decode step's (B, answer length) log-probs of the answer tokens (else None)."""
        a = self.args
        with torch.no_grad():
            if self.hybrid:
                out = self.actor_model.generate(prompts, attention_mask=mask, max_new_tokens=a.max_answer_seq_len,
                                                eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id,
                                                generator=self.generator, return_logprobs=a.logprobs_from_generation,
                                                **sampling_kwargs(a))
                return out if a.logprobs_from_generation else (out, None)
            check_left_padded(mask)  # HF's generate only warns (the hybrid engine's generate checks it itself)
            with sampling_from(self.generator):  # (hf_generate: the held-out evaluation's too)
                seq = hf_generate(self.actor_model.module, self.tokenizer)(
                    prompts, attention_mask=mask, max_new_tokens=a.max_answer_seq_len, eos_token_id=self.eos_token_id,
                    pad_token_id=self.pad_token_id, synced_gpus=self.z3_enabled and get_world_size() > 1,
                    use_cache=True, **sampling_kwargs(a, hf_generate=True))
            return seq, None

    def generate_experience(self, prompts, mask=None, step=None, advantages=True, print_answer=True):
        """Generate answers and score them: log-probs (actor, reference), values, reward-model scores.

        ``prompts`` is a left-padded tensor with ``mask``, the batch dict of ``DataCollatorRLHF``, or a tokenizer's
        output (``input_ids``, ``attention_mask``; tokenized with ``padding_side="left"``: right padding is an error).
        Empty answers stay in the batch (with no reward tokens) on every rank, so ranks never diverge.
        ``step``: DeepSpeed-Chat's, for --print_answers (``_print_answer``; None: no print); ``print_answer=False``
        for a caller that prints the answers itself (step 3's loop, once per iteration of several generation batches).
        The returned dict also holds the batch's "advantages" and "returns" (``compute_advantages``): a caller that
        changes its "rewards" calls ``compute_advantages([exp])`` again. ``advantages=False`` leaves them out, for a
        caller that computes them over a rollout of several batches (``train_rollout``). Its "value" (the critic's
        values) is there with a critic (GAE) only: every value of the dict is a tensor of the batch's rows, so
        DeepSpeed-Chat's ``MiniDataset`` slices it for any estimator.
        """
        self._check_engine_settings_kept("generate_experience")
        batch, prompts, mask = self._checked_prompts(prompts, mask)
        self.eval()
        t0 = time.time()
        with phase("dschat.generate"):
            seq, decode_logprobs = self._generate_sequence(prompts, mask)
        gen_time = time.time() - t0
        prompt_len = prompts.shape[1]
        action_mask = answer_mask(seq[:, prompt_len:], self.eos_token_id)
        seq, action_mask, decode_logprobs = pad_answers(seq, action_mask, self.pad_token_id, self.pad_to_multiple_of,
                                                        decode_logprobs)
        answers = seq[:, prompt_len:]
        attention_mask = torch.cat([mask.long(), action_mask], dim=1)
        t1 = time.time()
        with torch.no_grad():
            start = prompt_len - 1
            layout = self._layout(attention_mask, start)
            with phase("dschat.experience.actor"):
                logprobs = decode_logprobs if decode_logprobs is not None else \
                    self._logprobs(self.actor_model, seq, attention_mask, start, layout)
            with phase("dschat.experience.ref"):
                ref_logprobs = self._logprobs(self.ref_model, seq, attention_mask, start, layout)
            with phase("dschat.experience.critic"):
                values = self._values(self.critic_model, seq, attention_mask, layout)[:, start:] \
                    if self.critic_model else None
            with phase("dschat.experience.reward"):
                scores = self._scores(batch, seq, attention_mask, answers, action_mask, layout)
        algo.check_finite("reward scores", scores)
        exp_time = time.time() - t1
        empty = (action_mask.sum(1) == 0) | ((action_mask.sum(1) == 1) & self._is_eos(answers[:, 0]))
        self.stats.update(generation_time=gen_time, experience_time=exp_time,
                          answer_length=action_mask.sum(1).float().mean().item(),
                          empty_answers=int(empty.sum().item()), generated_tokens=int(action_mask.sum().item()),
                          truncated_answers=int(self._unended(answers, action_mask).sum().item()))
        exp = {"prompts": prompts, "logprobs": logprobs, "ref_logprobs": ref_logprobs, "value": values,
               "rewards": scores, "input_ids": seq, "attention_mask": attention_mask, "action_mask": action_mask}
        if values is None:  # no critic: no key (DeepSpeed-Chat's MiniDataset slices every value, v[i:j], None too)
            del exp["value"]
        if print_answer:
            self._print_answer(exp, step)
        if advantages:
            self.compute_advantages([exp])  # a rollout of this one generation batch
        return exp

    def _print_answer(self, exp, step):
        """DeepSpeed-Chat's --print_answers in a loop of the caller's: the first prompt and its answer, at each ``step``
        that is a multiple of --print_answers_interval (``step`` None: none). Before, a notebook's print_answers printed
        nothing."""
        if self.args.print_answers and step is not None and step % self.args.print_answers_interval == 0:
            print_rank_0(f"[step3] step {step}:\n{first_answer_text(self.tokenizer, exp)}")

    def _checked_prompts(self, prompts, mask):
        """(batch, prompts, mask) on this rank's device, repeated for the answer groups; prompts that cannot be
        generated from stop every rank together (on several ranks, one stopping alone would leave the others
        waiting in the generation's collectives)."""
        def checked():
            given = prompt_batch(prompts, mask)
            check_left_padded(given["prompt_att_mask"])  # (before the groups' repeat: the rows named are the caller's)
            batch = self._repeat_for_groups(given)
            on_device = batch["prompt"].to(self.device), batch["prompt_att_mask"].to(self.device)
            check_prompt_length(on_device[1], self.args.max_prompt_seq_len)
            return batch, *on_device

        return together(checked, self.device, "generate_experience: another rank refused its prompts",
                        (UsageError, ValueError))

    def _repeat_for_groups(self, batch):
        """Each prompt ``n_samples_per_prompt`` times in a row, so its answers form one group."""
        n = self.args.n_samples_per_prompt
        if n == 1:
            return batch
        return {k: (v.repeat_interleave(n, 0) if torch.is_tensor(v) else [x for x in v for _ in range(n)])
                for k, v in batch.items()}

    def _scores(self, batch, seq, attention_mask, answers, action_mask, layout=None):
        """Weighted sum of the reward model's score and the reward function's, one per answer."""
        a = self.args
        scores = torch.zeros(seq.shape[0], device=seq.device)
        if self.reward_model is not None:
            rm = reward_scores(self.reward_model.module, seq, attention_mask, layout)
            scores = scores + a.reward_model_weight * rm.float()
        if self.reward_fn is not None:
            from dschat.rlhf.reward_fn import batch_extras, call_reward_fn, weighted_scores

            prompts = batch.get("prompt_text") or prompt_texts(self.tokenizer, batch["prompt"],
                                                               batch["prompt_att_mask"])
            texts = answer_texts(self.tokenizer, answers, action_mask)

            def scored():
                fn = call_reward_fn(self.reward_fn, prompts, texts, batch_extras(batch))
                return weighted_scores(self.reward_fn, fn, a.reward_fn_weight, prompts, texts)

            fn = together(scored, self.device, "generate_experience: the reward function failed on another rank",
                          UsageError)
            scores = scores + fn.to(seq.device)
        return scores

    def _is_eos(self, tokens):
        return torch.isin(tokens, torch.tensor(token_id_list(self.eos_token_id), device=tokens.device))

    def _unended(self, answers, action_mask):
        """(B,) bool: the answers cut at --max_answer_seq_len, with no EOS among their tokens (TRL's clipped ratio
        counts them): they are trained on and scored as they stand (--mask_truncated_answers: left out of the loss,
        ``loss_mask``)."""
        return (action_mask.sum(1) > 0) & ~(self._is_eos(answers) & (action_mask != 0)).any(1)

    def loss_mask(self, experience):
        """(B, T) float: the answer tokens every loss term of the PPO step trains on. With --mask_truncated_answers,
        the action mask less the answers cut at --max_answer_seq_len (``_unended``), as TRL's
        mask_truncated_completions zeroes their completion_mask: no gradient from any of their tokens, in the policy,
        entropy and KL terms (as in TRL, whose KL and entropy are terms of the same masked loss) and in GAE's value
        loss too (DAPO's overlong filtering drops the sample from the update: a cut answer's returns end in the score
        of a text the length limit ended, the score the flag distrusts, which the critic's values would pass on to
        the other answers' advantages). Only the loss: the advantages (GRPO/RLOO's group statistics, whitening) and
        the logged KL take every answer, as in TRL; the forwards still attend to the tokens."""
        mask = experience["action_mask"].float()
        if not self.args.mask_truncated_answers:
            return mask
        answers = experience["input_ids"][:, experience["prompts"].shape[1]:]
        return mask * ~self._unended(answers, experience["action_mask"])[:, None]

    def _layout(self, attention_mask, start):
        """How this batch's forwards run: over rows shifted left, with no attention mask (``layout.py``), or, with
        ``--padded_forwards``, for a row with a gap (a prompt mask with a hole) or an empty prompt, as they are."""
        return forward_layout(attention_mask, start, self.pad_to_multiple_of, self.position_limit,
                              self.args.padded_forwards)

    def _logprobs(self, model, seq, attention_mask, start, layout=None):
        """Log-probs of the answer tokens only."""
        return answer_token_stats(model, seq, attention_mask, start, layout, self.args.logprob_chunk_size,
                                  temperature=scoring_temperature(self.args))

    @staticmethod
    def _values(critic, seq, attention_mask, layout=None):
        if layout is None:
            return critic.forward_value(seq, attention_mask, return_value_only=True)[:, :-1]
        return layout.restore(layout.forward(critic.forward_value, seq, return_value_only=True))[:, :-1]

    # --- rewards and advantages ---------------------------------------------------------------------------
    @property
    def kl_ctl(self):
        """The per-token reward's KL controller (``.value``: its coefficient; ``update`` after each iteration)."""
        return self._kl_ctl

    @kl_ctl.setter
    def kl_ctl(self, controller):
        # (DeepSpeed-Chat's kl_ctl is the float coefficient itself: one assigned here failed in compute_rewards with
        # "'float' object has no attribute 'value'")
        assigned = kl_controller_assigned(controller, getattr(self, "_kl_ctl", None), getattr(self, "args", None))
        if getattr(self, "args", None) is not None:
            # the controller assigned is the run's, as the other settings assigned are (_ArgsSetting): args say it, so
            # the adaptive updates, the checkpoints and a resume take it
            record_kl_controller(self.args, assigned, f"trainer.kl_ctl = {controller!r}")
        self._kl_ctl = assigned

    def compute_rewards(self, prompts, log_probs, ref_log_probs, reward_score, action_mask):
        """DeepSpeed-Chat's signature: per-token rewards with the KL penalty and the clipped score."""
        kl_coef = self.kl_ctl.value if self.args.kl_in_reward else 0.0
        return algo.kl_penalized_rewards(log_probs, ref_log_probs, reward_score, action_mask, kl_coef,
                                         self.clip_reward_value, reward_kl_estimator(self.args))

    def get_advantages_and_returns(self, values, rewards, action_mask):
        adv, returns = algo.gae_advantages(rewards, values, action_mask, self.gamma, self.lam)
        if self.args.whiten_advantages:
            adv = algo.masked_whiten(adv, action_mask, process_group=_world_group())
        return adv, returns

    def critic_free_advantages(self, scores, token_rewards, mask):
        """GRPO / RLOO: group-relative scores (KL as a loss term); REINFORCE++: whitened returns of token rewards."""
        a = self.args
        if a.advantage_estimator == "reinforce_pp":
            return algo.reinforce_pp_advantages(token_rewards, mask, a.gamma, process_group=_world_group())
        if a.n_samples_per_prompt > 1:  # groups whose answers all scored alike train nothing: logged, as TRL does
            self.stats["frac_reward_zero_std"] = algo.zero_std_fraction(scores, a.n_samples_per_prompt)
            self.stats["reward_std"] = algo.group_reward_std(scores, a.n_samples_per_prompt)
        if a.advantage_estimator == "grpo":
            # (--grpo_norm_by_std batch: the std of every rank's scores, each rank calling)
            return algo.grpo_advantages(scores.float(), a.n_samples_per_prompt, mask, a.grpo_norm_by_std,
                                        process_group=_world_group())
        return algo.rloo_advantages(scores.float(), a.n_samples_per_prompt, mask)

    @torch.no_grad()
    def compute_advantages(self, experiences):
        """Per-token rewards, advantages and returns of a whole rollout (the generation batches of one PPO update),
        stored in each experience as "advantages" and "returns". They are computed once per rollout, not per training
        micro-batch (as in OpenRLHF and TRL), so whitening (--whiten_advantages, REINFORCE++) takes its statistics
        over the whole rollout of every rank and GRPO/RLOO groups are never split by the training batch size. The
        rollout's answer columns are right-padded to the widest generation batch (masked) and cut back after."""
        with phase("dschat.train.advantages"):
            widths = [e["action_mask"].shape[1] for e in experiences]
            rollout = {key: _cat_right_padded([e[key] for e in experiences], max(widths))
                       for key in ("logprobs", "ref_logprobs", "value", "action_mask")
                       if experiences[0].get(key) is not None}  # ("value": GAE's only)
            mask = rollout["action_mask"].float()
            scores = torch.cat([e["rewards"] for e in experiences])
            rewards = self.compute_rewards(None, rollout["logprobs"], rollout["ref_logprobs"], scores, mask)
            if self.args.advantage_estimator == "gae":
                advantages, returns = self.get_advantages_and_returns(rollout["value"], rewards, mask)
            else:
                advantages, returns = self.critic_free_advantages(scores, rewards, mask)
            rows = [e["action_mask"].shape[0] for e in experiences]
            for exp, width, adv, ret in zip(experiences, widths, advantages.split(rows), returns.split(rows)):
                exp["advantages"], exp["returns"] = adv[:, :width], ret[:, :width]

    # --- training -----------------------------------------------------------------------------------------
    def train_rlhf(self, inputs):
        """One PPO update of actor and critic on a micro-batch of experience; returns (actor_loss, critic_loss).
        DeepSpeed-Chat's call, for a caller's own loop (``train_rollout`` runs step 3's)."""
        if not isinstance(inputs, Mapping):  # (train_rollout's list: "list indices must be integers or slices")
            raise UsageError(f"train_rlhf takes one generate_experience output (a dict), not a "
                             f"{type(inputs).__name__}: train_rlhf(out); a list of them is step 3's PPO iteration, "
                             "train_rollout([out, ...])")
        self._check_engine_settings_kept("train_rlhf")
        self._note_hand_loop(inputs)
        return self._ppo_step(inputs)

    def _ppo_step(self, inputs, train_actor=True):
        mask = self.loss_mask(inputs)
        skip = self._group_without_loss_tokens(mask)
        seq, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        start = inputs["prompts"].shape[1] - 1
        layout = self._layout(attention_mask, start)
        old_logp, ref_logp, old_values = inputs["logprobs"], inputs["ref_logprobs"], inputs.get("value")
        agg = self._loss_agg(inputs)
        if "advantages" not in inputs:  # an experience dict built by the caller: its rows are the whole rollout
            self.compute_advantages([inputs])
        advantages, returns = inputs["advantages"], inputs["returns"]
        self.train()
        # --align_overflow: the actor steps after the critic's backward, both together (DeepSpeed-Chat's order)
        aligned = self.align_overflow and self.critic_model is not None and train_actor
        with self._masked_training(layout):
            actor_loss = self._update_actor(seq, attention_mask, start, layout, old_logp, ref_logp, advantages, mask,
                                            agg, step=not aligned, skip=skip) if train_actor else None
            if self.critic_model is None:
                return actor_loss, torch.zeros((), device=actor_loss.device)
            critic_loss = self._update_critic(seq, attention_mask, start, layout, old_values, returns, mask, agg,
                                              step=not aligned, skip=skip)
            if aligned:
                self._step_actor_and_critic_aligned(skip)
        return actor_loss, critic_loss

    def _group_without_loss_tokens(self, mask):
        """--mask_truncated_answers: whether this PPO micro-batch (``mask``: its loss mask) ends an optimizer step's
        --gradient_accumulation_steps micro-batches none of which, on any rank, has a token in the loss (every answer
        cut at --max_answer_seq_len). Such a step's loss is 0 and its gradients 0, but stepping the optimizer would
        still move the weights (Adam's momentum, weight decay) and advance the lr schedule: the models that end their
        accumulation here skip it (``optimizer_step``'s ``skip``). A PPO-ptx actor is not among them: its step ends
        after the language-model micro-step, whose loss has tokens. One all-reduce per optimizer step, the same on every
        rank (each trains as many micro-batches); without the flag every answer has a token, and none is asked.
        The micro-batch's place in the step is DeepSpeed's (``_ppo_micro_batches_into_step``), not a count of the
        trainer's own: a call stopped before its backward (an interrupt, an error) and made again is the same
        micro-batch to DeepSpeed, and a count of its own would have taken it for the next, off by one from then on."""
        if not self.args.mask_truncated_answers:
            return False
        accum = self.args.gradient_accumulation_steps
        position = self._ppo_micro_batches_into_step()
        if position is None:  # (a test's stand-in engine keeps no count: the trainer's calls are the micro-batches)
            position = len(self._group_loss_tokens) % accum
        self._group_loss_tokens = (*group_tokens_before(self._group_loss_tokens, position), int(mask.sum()))
        if position < accum - 1:
            return False
        return _summed_over_ranks(sum(self._group_loss_tokens), self.device) == 0

    def _ppo_micro_batches_into_step(self):
        """The PPO micro-batches of the optimizer step that trained before this one, as DeepSpeed counts them: the
        critic's micro-steps (one per PPO micro-batch), else the actor's (a PPO-ptx actor's step takes a language-model
        micro-step after each PPO one, two per PPO micro-batch). None for a stand-in engine that keeps no count."""
        engine = self.critic_model if self.critic_model is not None else self.actor_model
        taken = micro_steps_into_step(engine)
        if taken is None:
            return None
        return taken // (engine.gradient_accumulation_steps() // self.args.gradient_accumulation_steps)

    def _update_actor(self, seq, attention_mask, start, layout, old_logp, ref_logp, advantages, mask, agg, step=True,
                      skip=False):
        with phase("dschat.train.actor_loss"):
            loss = self._actor_loss(seq, attention_mask, start, layout, old_logp, ref_logp, advantages, mask, agg)
        self._backward_and_step_actor(loss, step, skip)
        return loss.detach()

    def _update_critic(self, seq, attention_mask, start, layout, old_values, returns, mask, agg, step=True,
                       skip=False):
        with phase("dschat.train.critic_loss"):
            values = self._values(self.critic_model, seq, attention_mask, layout)[:, start:]
            loss, vstats = algo.value_loss_clipped(values, old_values, returns, mask, self.cliprange_value, **agg)
            algo.check_finite("critic loss", loss)
        with phase("dschat.train.critic_backward"):
            self.critic_model.backward(loss)
        if step:
            self._step_critic(skip)
        self.stats.update(returns=vstats["returns_mean"].item(), vf_clipfrac=vstats["vf_clipfrac"].item())
        return loss.detach()

    def _step_critic(self, skip=False):
        """The critic's step; ``skip``: skipped where it ends an accumulation group with no token in the loss
        (``_group_without_loss_tokens``)."""
        with phase("dschat.train.critic_step"):
            boundary = optimizer_step(self.critic_model, "critic", skip)
        self._count_no_token_skip("critic", skip and boundary)
        self._say_if_schedule_ended("critic", self.critic_model)

    def _say_if_schedule_ended(self, name, model):
        """A loop of the caller's (a notebook's) that steps ``model`` past the end of the learning-rate schedule its
        engine was sized with (``num_total_iters`` counts optimizer steps, not PPO iterations) is said, once: past its
        end a cosine schedule rose again to the full rate, and a linear one trained at 0, unsaid."""
        engine = self.__dict__.get("rlhf_engine")  # (None: a trainer built without __init__, a test's stand-in)
        total = getattr(engine, "actor_total_iters" if name == "actor" else "num_total_iters", None)
        if self._said_schedule_ended or total is None:
            return
        taken = steps_past_schedule(getattr(model, "lr_scheduler", None), total, self.args.lr_scheduler_type)
        if taken is None:
            return
        self._said_schedule_ended = True
        # (the actor's schedule is sized by actor_total_iters only where it was given apart: --freezing_actor_steps)
        total_name = "num_total_iters" if total == getattr(engine, "num_total_iters", None) else "actor_total_iters"
        print_rank_0(schedule_ended_notice(name, taken, total, self.args.lr_scheduler_type, total_name,
                                           optimizer_steps_per_iteration(self.args)))

    def _count_no_token_skip(self, name, skipped):
        if skipped:
            self.no_token_skips = {**self.no_token_skips, name: self.no_token_skips.get(name, 0) + 1}

    def _step_actor_and_critic_aligned(self, skip=False):
        """--align_overflow, after both backwards: the actor's step, then the critic's, both skipped when either's
        gradients overflowed (``overflow.py``), or, ``skip``, when their group had no token in the loss."""
        with steps_skipped_together(self.actor_model, self.critic_model):
            self._step_actor(skip)
            self._step_critic(skip)

    def _masked_training(self, layout):
        """Training over the rows as they are (``layout`` None: left pads under a padding mask) runs SDPA with no fully
        masked query row (``models/attention.py``: cuDNN's backward returns NaN gradients for one)."""
        if layout is not None:
            return contextlib.nullcontext()
        return no_empty_query_rows(*(m.module for m in (self.actor_model, self.critic_model) if m is not None))

    def _actor_loss(self, seq, attention_mask, start, layout, old_logp, ref_logp, advantages, mask, agg):
        a = self.args
        stats = answer_token_stats(self.actor_model, seq, attention_mask, start, layout, a.logprob_chunk_size,
                                   entropy=bool(a.entropy_coef), temperature=scoring_temperature(a))
        logp, entropy = stats if a.entropy_coef else (stats, None)
        loss, pstats = algo.policy_loss_clipped(logp, old_logp, advantages, mask, self.cliprange,
                                                clip_range_high=a.cliprange_high, **agg)
        if a.entropy_coef:
            loss = loss - algo.entropy_bonus(entropy, mask, a.entropy_coef, **agg)
        kl_coef, kl_kind = self._kl_loss_settings()
        if kl_coef:
            loss = loss + kl_coef * algo.kl_loss_term(logp, ref_logp, mask, kl_kind, **agg)
            self.stats["kl_loss"] = algo.kl_token_mean(logp, ref_logp, mask, kl_kind)
        algo.check_finite("actor loss", loss)
        self.stats.update({key: pstats[key].item() for key in ACTOR_STEP_STATS})
        return loss

    @property
    def kl_coef(self):
        """The KL weight this run trains with: the loss term's where the KL is one, else the reward penalty's."""
        return self._kl_loss_settings()[0] if kl_in_loss(self.args) else self.kl_ctl.value

    def _kl_loss_settings(self):
        """(coefficient, estimator) of the KL loss term: where the KL is a loss term (``kl_in_loss``: GRPO and RLOO
        always, the others with --kl_in_reward 0), --kl_loss_coef (unset: 0.001, verl's; 0: no term) with
        --kl_estimator (unset: k3; k1's gradient over sampled tokens is 0 in expectation, so as a loss it pulls
        nothing towards the reference); else no term."""
        a = self.args
        if not kl_in_loss(a):
            return 0.0, a.kl_estimator or "k1"
        return (0.001 if a.kl_loss_coef is None else a.kl_loss_coef), a.kl_estimator or "k3"

    def _loss_agg(self, inputs):
        """The keyword arguments of ``algo.agg_loss`` that --loss_agg asks for."""
        mode = self.args.loss_agg
        if mode == "token_mean":
            return {"loss_agg": mode}
        scale = {"accum_steps": self.args.gradient_accumulation_steps, "world_size": get_world_size()}
        if mode == "global_token_mean":
            return {"loss_agg": mode, "num_tokens_global": self._num_tokens_global(inputs), **scale}
        # the answer means: over the optimizer step's answers on all ranks (a caller's own experience: as many as
        # this micro-batch's in each of the step's micro-batches)
        agg = {"loss_agg": mode, "num_seqs_global": self._num_seqs_global(inputs), **scale}
        if mode == "seq_mean_token_sum_norm":  # (Dr. GRPO: a constant divisor, the longest answer step 3 samples)
            agg["max_length"] = self.args.max_answer_seq_len
        return agg

    def _accumulation_group_counts(self, group):
        """What --loss_agg normalises the micro-batches of one optimizer step by, counted over all ranks:
        {"num_tokens_global": their answer tokens} (global_token_mean), {"num_seqs_global": their answers}
        (the answer means), or nothing (token_mean: each micro-batch's own)."""
        mode = self.args.loss_agg
        if mode == "global_token_mean":  # (the tokens the loss keeps: TRL's dapo divides by those too)
            return {"num_tokens_global": global_token_count([self.loss_mask(m) for m in group], self.device)}
        # (an answer --mask_truncated_answers leaves out still counts, as a 0: TRL's grpo and dr_grpo divide by the
        # batch's completions, masked or not, so Dr. GRPO's divisor stays a constant)
        if mode in ("seq_mean_token_mean", "seq_mean_token_sum_norm"):
            return {"num_seqs_global": global_row_count([m["action_mask"] for m in group], self.device)}
        return {}

    def _num_seqs_global(self, inputs):
        """--loss_agg's answer means' divisor: the answers of the optimizer step's micro-batches on all ranks, as step 3
        sets it (``inputs["num_seqs_global"]``). A caller's own experience (``train_rlhf`` per micro-batch) without it:
        this micro-batch's answers on all ranks, gradient_accumulation_steps times, step 3's divisor where each
        micro-batch of the step holds as many answers (ranks holding fewer answers than others weigh each of them as
        step 3 does); where they do not, said once (``_note_unequal_hand_group``)."""
        if "num_seqs_global" in inputs:
            return inputs["num_seqs_global"]
        answers = global_row_count([inputs["action_mask"]], self.device)
        accum = self.args.gradient_accumulation_steps
        group = self._hand_group_answers if len(self._hand_group_answers) < accum else ()
        self._hand_group_answers = (*group, answers)
        if answers != self._hand_group_answers[0]:
            self._note_unequal_hand_group()
        return accum * answers

    def _note_unequal_hand_group(self):
        """A hand loop's optimizer step whose micro-batches hold unequal answer counts: the gradients of its first
        micro-batches went back with their own count before the others were seen, which step 3 never does."""
        if self._said_unequal_hand_group:
            return
        self._said_unequal_hand_group = True
        counts = " + ".join(f"{int(n)}" for n in self._hand_group_answers)
        print_rank_0(f"[step3] train_rlhf: the micro-batches of an optimizer step hold {counts} answers (all ranks): "
                     f"--loss_agg {self.args.loss_agg} then weighs each answer by its own micro-batch's count, "
                     "where step 3 (trainer.train_rollout) weighs every answer of the step alike. Give each "
                     "micro-batch of a step as many rows, or its inputs['num_seqs_global'] = "
                     "dschat.rlhf.trainer.global_row_count(<the step's action masks>, device)")

    def _num_tokens_global(self, inputs):
        """--loss_agg global_token_mean's divisor: the answer tokens of the optimizer step's micro-batches on all
        ranks, as step 3 sets it (``inputs["num_tokens_global"]``); a caller's own experience without it is this
        micro-batch's, all ranks', when each optimizer step takes one micro-batch."""
        if "num_tokens_global" in inputs:
            return inputs["num_tokens_global"]
        if self.args.gradient_accumulation_steps != 1:
            raise UsageError("--loss_agg global_token_mean with --gradient_accumulation_steps "
                             f"{self.args.gradient_accumulation_steps}: train_rlhf needs inputs['num_tokens_global'], "
                             "the answer tokens of the optimizer step's micro-batches on all ranks "
                             "(dschat.rlhf.trainer.global_token_count of their action masks; with "
                             "--mask_truncated_answers, of trainer.loss_mask(micro_batch) for each)")
        return global_token_count([self.loss_mask(inputs)], self.device)

    def _backward_and_step_actor(self, loss, step=True, skip=False):
        """Backward and, unless ``step`` is False (--align_overflow steps later, with the critic), step (``skip``:
        ``_step_actor``'s)."""
        with phase("dschat.train.actor_backward"):
            self.actor_model.backward(loss)
        if step:
            self._step_actor(skip)

    def _step_actor(self, skip=False):
        """The actor's step; ``skip``: skipped where it ends an accumulation group with no token in the loss
        (``_group_without_loss_tokens``). The EMA follows each optimizer step applied (an accumulation boundary), not
        each accumulation micro-step, nor a step skipped (for an fp16 overflow, by --align_overflow with the critic's,
        or for no token in the loss): the weights did not move, and a tick would decay the average towards them once
        more, as if the actor had stepped (DeepSpeed-Chat's loop averages after every PPO step, skipped or not)."""
        with phase("dschat.train.actor_step"):
            boundary = optimizer_step(self.actor_model, "actor", skip)
        self._count_no_token_skip("actor", skip and boundary)
        self._say_if_schedule_ended("actor", self.actor_model)
        if boundary and self.actor_model.was_step_applied():
            self._update_ema()

    @torch.no_grad()
    def _update_ema(self):
        if self.actor_ema is None:
            return
        from dschat.rlhf.ema import moving_average

        moving_average(self.actor_model.module, self.actor_ema.module, beta=self.args.ema_beta)

    # --- one PPO iteration ---------------------------------------------------------------------------------
    def train_rollout(self, experiences, unsup_batches=(), train_actor=True):
        """One PPO iteration on a rollout (``generate_experience`` outputs), as step 3 runs it: advantages over the
        whole rollout; --ppo_epochs passes over micro-batches of --per_device_training_batch_size rows, each optimizer
        step after --gradient_accumulation_steps of them (--loss_agg's global means normalised by their answer tokens
        or answers on all ranks);
        the adaptive KL controller updated with the rollout's KL (--adaptive_kl). As in DeepSpeed-Chat's PPO-ptx, each
        PPO micro-batch is followed by a language-model micro-step on the next training-batch-sized slice of
        ``unsup_batches`` (cycled when there are fewer). ``train_actor`` False: the critic alone trains
        (--freezing_actor_steps; no unsupervised steps either, they train the actor). Returns the mean "actor_loss"
        (None when the actor did not train), "critic_loss" (None without a critic) and "unsup_loss" (None without
        unsupervised data), the mean "pg_clipfrac" (and its "pg_clipfrac_low" and "pg_clipfrac_high" sides) and
        "approx_kl" (None when the actor did not train), "kl_loss" (the KL loss term's estimator per answer token, k3
        unless --kl_estimator; None where there is no such term or the actor did not train) and
        "vf_clipfrac" (None without a critic) over the micro-batches, and the rollout's KL to the reference over all
        ranks: k1 per answer token ("kl") and the reward penalty's estimator per answer ("kl_per_answer", the
        controller's unit), the optimizer steps that DeepSpeed skipped on inf/NaN gradients
        ("actor_skipped_steps", "critic_skipped_steps"; None for a model that did not train), the optimizer steps
        skipped because their accumulation group had no token in the loss on any rank (--mask_truncated_answers, every
        answer of the group cut: "actor_no_token_steps", "critic_no_token_steps"; None for a model that did not train;
        a PPO-ptx actor's steps are never among them: its language-model loss has tokens, so it steps on that alone),
        and the micro-batches (of all epochs) that the step stats are means over ("stats_micro_batches": those with a
        token in the loss)."""
        experiences = checked_rollout(experiences)
        self._check_engine_settings_kept("train_rollout")
        if not train_actor and self.critic_model is None:
            raise UsageError("train_rollout(train_actor=False) trains the critic alone, and this trainer has none")
        if unsup_batches and not hasattr(self, "train_unsupervised"):
            raise UsageError("unsup_batches need DeepSpeedPPOTrainerUnsupervised (step 3's "
                             "--unsupervised_dataset_name)")
        check_ptx_steps_paired(self.args, train_actor, unsup_batches)
        check_no_unfinished_step({"actor": self.actor_model if train_actor else None, "critic": self.critic_model})
        batch, accum = self.args.per_device_training_batch_size, self.args.gradient_accumulation_steps
        check_whole_accumulation_groups(sum(-(-e["input_ids"].shape[0] // batch) for e in experiences), accum, batch)
        if len(experiences) > 1 or "advantages" not in experiences[0]:
            self.compute_advantages(experiences)  # once, over the whole rollout, not each generation batch alone
        micro = [m for exp in experiences for m in split_rows(exp, batch)]
        unsup = [m for unsup_batch in unsup_batches for m in split_rows(unsup_batch, batch)] if train_actor else []
        losses = {"actor_loss": [], "critic_loss": [], "unsup_loss": []}
        ppo_stats = {key: [] for key in PPO_STEP_STATS}
        measured = 0  # the micro-batches whose step stats are kept (any token in the loss)
        skipped_before = self._skipped_steps(train_actor)
        for _ in range(self.args.ppo_epochs):
            for start in range(0, len(micro), accum):
                group = micro[start:start + accum]
                counts = self._accumulation_group_counts(group)
                for micro_index, m in enumerate(group, start):
                    m.update(counts)
                    actor_loss, critic_loss = self._ppo_step(m, train_actor)
                    if train_actor:
                        losses["actor_loss"].append(actor_loss.item())
                    if self.critic_model is not None:
                        losses["critic_loss"].append(critic_loss.item())
                    kept = bool(self.loss_mask(m).any())
                    self._collect_step_stats(ppo_stats, train_actor, kept=kept)
                    measured += kept
                    if unsup:
                        losses["unsup_loss"].append(
                            self.train_unsupervised(unsup[micro_index % len(unsup)], self.args.unsup_coef).item())
        skipped = skipped_since(skipped_before, self._skipped_steps(train_actor))
        kl = self.rollout_kl(experiences)
        if self.args.adaptive_kl:  # in the controller's unit, the same on every rank
            self.update_kl_controller(kl["kl_per_answer"],
                                      sum(e["input_ids"].shape[0] for e in experiences) * get_world_size())
        return {**{name: sum(values) / len(values) if values else None
                   for name, values in {**losses, **ppo_stats}.items()}, **kl, **skipped,
                "stats_micro_batches": measured}

    def _skipped_steps(self, train_actor):
        """{"actor", "critic": (the optimizer steps its DeepSpeed engine has skipped so far: inf/NaN gradients, an fp16
        overflow which its loss scaler answers silently by design, --align_overflow's forced skip, or no token in the
        loss; of them, those skipped for no token in the loss), the same on every rank; None for a model that does not
        train now}."""
        models = {"actor": self.actor_model if train_actor else None, "critic": self.critic_model}
        return {name: None if model is None else (skipped_steps(model), self.no_token_skips.get(name, 0))
                for name, model in models.items()}

    def _collect_step_stats(self, ppo_stats, train_actor, kept=True):
        """The PPO step's clip fractions and KL estimates (``self.stats`` holds the last micro-batch's), kept so that
        the iteration reports their mean over all its micro-batches and epochs. A micro-batch with no token ``kept``
        by the loss mask (every answer cut, --mask_truncated_answers) is left out: the iteration's stats are means of
        the micro-batches' token means, each micro-batch alike, and such a micro-batch has none (masked_mean's 0 of an
        empty mask, counted, pulled the iteration's mean toward 0)."""
        if not kept:
            return
        actor = ACTOR_STEP_STATS + (("kl_loss",) if self._kl_loss_settings()[0] else ()) if train_actor else ()
        trained = actor + (("vf_clipfrac",) if self.critic_model is not None else ())
        for key in trained:
            ppo_stats[key].append(self.stats[key])

    def _note_hand_loop(self, inputs):
        """``train_rlhf`` called by a caller's own loop (a notebook's): the settings only ``train_rollout`` applies,
        said once where they are set."""
        if self._said_hand_loop:
            return
        self._said_hand_loop = True
        args, rows = self.args, inputs["input_ids"].shape[0]
        unused = ([f"ppo_epochs {args.ppo_epochs}"] if args.ppo_epochs != 1 else []) + \
            (["adaptive_kl"] if args.adaptive_kl else []) + \
            ([f"per_device_training_batch_size {args.per_device_training_batch_size} (< the {rows} rows given)"]
             if args.per_device_training_batch_size < rows else [])
        if unused:
            print_rank_0(f"[step3] train_rlhf(out) is one update on the rows it is given (DeepSpeed-Chat's): "
                         f"{', '.join(unused)} act through trainer.train_rollout([out, ...]), step 3's PPO "
                         f"iteration, not here")

    def rollout_kl(self, experiences):
        """The rollout's KL to the reference over all ranks: k1 per answer token ("kl": the mean over all the rollout's
        answer tokens, each weighing alike, not a mean of its generation batches' and ranks' own means, which weighed
        a batch of short answers' tokens more) and the reward penalty's estimator per answer, summed over its tokens
        ("kl_per_answer", what the reward penalises and the adaptive controller tracks; every batch holds as many
        answers)."""
        log_ratio = torch.stack([answer_log_ratios(e).sum() for e in experiences]).sum()
        tokens = sum(e["action_mask"].sum() for e in experiences)
        per_answer = torch.stack([self.answer_kl_to_reference(e) for e in experiences]).mean()
        sums = torch.stack([log_ratio, tokens.double(), per_answer.double()]).to(self.device)
        all_reduce(sums)
        kl = (sums[0] / sums[1]).item() if sums[1] else 0.0  # (no answer token: 0, as masked_mean gives)
        return {"kl": kl, "kl_per_answer": sums[2].item() / get_world_size()}

    def answer_kl_to_reference(self, exp):
        """Mean per-answer KL, the reward penalty's estimator (--kl_estimator, k1 unless set) summed over each
        answer's tokens: the adaptive controller's unit. It tracks what the reward penalises, as verl's and
        OpenRLHF's controllers do and TRL's PPOTrainer logs as objective/kl (TRL's older PPOTrainer, whose controller
        this is, fed it the k1 sum whatever its kl_penalty); the k1 sum of a k3 penalty would steer the coefficient by
        another number (one that can fall below 0)."""
        return answer_kl_sums(exp, reward_kl_estimator(self.args)).mean()

    # --- evaluation ---------------------------------------------------------------------------------------
    def evaluate(self, loader, eval_prompts=None, eval_max_new_tokens=None):
        """Step 3's held-out evaluation of the policy as it is now (``held_out_eval``: what step 3 logs before and
        after PPO): greedy answers to ``loader``'s prompts (``prompt_loaders``' held-out loader), scored by the reward
        model, the reward function and, for the embedded data (``data_path``), the rule scorer. ``eval_prompts``
        (counted over all ranks; 0: all) and ``eval_max_new_tokens`` are the trainer's args' unless given. Returns
        {"reward_mean", "prompts", "examples", "rule_score_mean", "reward_fn_mean", "empty_answers"} (the scores the
        run has). On several ranks, every rank calls it together."""
        from dschat.rlhf.evaluation import held_out_eval, rule_scorer_for  # (which imports this module)

        self._check_engine_settings_kept("trainer.evaluate")
        args = copy.copy(self.args)  # (the given counts are this call's alone)
        for name, value in (("eval_prompts", eval_prompts), ("eval_max_new_tokens", eval_max_new_tokens)):
            if value is not None:
                where = f"trainer.evaluate({name}={value!r})"
                value = checked_setting(name, value, where)
                if name == "eval_max_new_tokens":  # (the answers' length: what the engine was sized for)
                    self._check_answers_fit(args, name, value, where)
                setattr(args, name, value)
        return held_out_eval(self, loader, args, local_device(), rule_scorer_for(args.data_path))

    def update_kl_controller(self, kl, n_steps):
        self.kl_ctl.update(kl, n_steps)

    def train(self):
        self.actor_model.train()
        if self.critic_model is not None:
            self.critic_model.train()

    def eval(self):
        self.actor_model.eval()
        if self.critic_model is not None:
            self.critic_model.eval()
        self.ref_model.eval()
        if self.reward_model is not None:
            self.reward_model.eval()

    # DeepSpeed-Chat's attributes of what the engine was built with, and of its answers' end: read, as there; assigned,
    # an error saying what to do (a plain attribute would have taken the value and changed nothing, or, for
    # z3_enabled, made HF's generate sync the ranks, or not, apart from how the actor is sharded)
    @property
    def z3_enabled(self):
        """Whether the actor is sharded with ZeRO-3 (its HF generation then runs in step on every rank)."""
        return self.args.actor_zero_stage == 3

    @z3_enabled.setter
    def z3_enabled(self, value):
        raise engine_setting_error("z3_enabled", value, "actor_zero_stage")

    @property
    def compute_fp32_loss(self):
        return self.args.compute_fp32_loss

    @compute_fp32_loss.setter
    def compute_fp32_loss(self, value):
        raise engine_setting_error("compute_fp32_loss", value, "compute_fp32_loss")

    @property
    def end_of_conversation_token_id(self):
        """The id the answers end at (DeepSpeed-Chat's from --end_of_conversation_token): the tokenizer's EOS
        (``get_eot_token``); ``eos_token_id`` holds it with any other stop of the actor's generation_config."""
        return token_id_list(self.eos_token_id)[0]

    @end_of_conversation_token_id.setter
    def end_of_conversation_token_id(self, value):
        raise UsageError(f"trainer.end_of_conversation_token_id = {value!r}: the answers end at trainer.eos_token_id "
                         f"({self.eos_token_id!r}: the tokenizer's EOS, and any other stop of the actor's "
                         "generation_config), which generation and the answers' masks read: set that (an id or a list "
                         "of ids)")

    @property
    def generate_time(self):
        """DeepSpeed-Chat's: the seconds the last ``generate_experience`` spent generating its answers (0.0 before
        any), which its loop reads for its throughput line."""
        return self.stats.get("generation_time", 0.0)

    def get_overflow(self):
        """DeepSpeed-Chat's: (actor, critic) whether each model's last optimizer step was skipped on inf/NaN gradients
        (an fp16 overflow), as DeepSpeed reads it from the optimizer; False before any step, for an optimizer that
        keeps no such flag (DeepSpeed's bf16 one) and for the critic where there is none. Its loop counts the steps
        that were not (--test_stop_step)."""
        return tuple(model is not None and bool(getattr(model.optimizer, "overflow", False))
                     for model in (self.actor_model, self.critic_model))


# schedules whose rate past their end is the one they ended at, the full rate: steps past it train as planned
SCHEDULES_FULL_RATE_AT_END = ("constant", "constant_with_warmup")


def steps_past_schedule(scheduler, total, scheduler_type):
    """The optimizer steps a learning-rate ``scheduler`` has taken where they are more than the ``total`` it was
    built to span, else None; None too for a schedule whose rate past its end is its full rate (constant ones)."""
    taken = getattr(scheduler, "last_epoch", None)  # (the steps it has taken: 0 as built)
    if total is None or taken is None or taken <= max(total, 1) or scheduler_type in SCHEDULES_FULL_RATE_AT_END:
        return None
    return taken


def schedule_ended_notice(name, taken, total, scheduler_type, total_name, steps_per_iteration):
    """What to say once model ``name`` has taken ``taken`` optimizer steps, past the ``total`` its learning-rate
    schedule spans (the engine's ``total_name``). Past its end, transformers' cosine schedule rises again (half a
    cosine period on); linear, polynomial and cosine_with_restarts stay at their end rate, ~0."""
    after = ("rises again towards the full rate" if scheduler_type == "cosine"
             else "stays at its end, 0 or near it, so the models barely change")
    return (f"[step3] the {name} has taken {taken} optimizer steps, past the {total} its learning-rate schedule "
            f"({scheduler_type}) spans (the engine's {total_name}): from here the rate {after}. {total_name} counts "
            f"optimizer steps, not PPO iterations: give your loop's PPO iterations x {steps_per_iteration} per "
            "train_rollout here (dschat.rlhf.config.optimizer_steps_per_iteration(trainer.args))")


def first_answer_text(tokenizer, exp):
    """--print_answers' lines: an experience's first prompt and its answer, decoded."""
    prompt_len = exp["prompts"].shape[1]
    answer = exp["input_ids"][0, prompt_len:][exp["action_mask"][0].bool()]
    return (f"  prompt: {tokenizer.decode(exp['prompts'][0], skip_special_tokens=True)!r}\n"
            f"  answer: {tokenizer.decode(answer, skip_special_tokens=True)!r}")


def answer_log_ratios(exp):
    """Each answer's log-ratio to the reference summed over its tokens (k1 KL), in float64: the rollout's per-token
    KL ("kl")."""
    return answer_kl_sums(exp, "k1")


def answer_kl_sums(exp, kind):
    """Each answer's ``kind`` KL estimate to the reference summed over its tokens, in float64."""
    kl = algo.kl_estimate(exp["logprobs"].double(), exp["ref_logprobs"].double(), kind)
    return algo.masked_sum(kl, exp["action_mask"].double(), dim=1)


def reward_kl_estimator(args):
    """The per-token reward's KL estimator: --kl_estimator where the KL is in the reward (k1 unless set,
    DeepSpeed-Chat's); k1 where the KL is a loss term, --kl_estimator being that term's there (the reward then carries
    no KL, and kl_per_answer stays the rollout's k1)."""
    return "k1" if kl_in_loss(args) else (args.kl_estimator or "k1")


class DeepSpeedPPOTrainerUnsupervised(DeepSpeedPPOTrainer):
    """PPO plus a language-modelling loss on unsupervised data (DeepSpeed-Chat's PPO-ptx)."""

    def train_unsupervised(self, inputs, unsup_coef):
        """One actor step on ``unsup_coef`` x the language-modelling loss; returns the loss unscaled (as
        DeepSpeed-Chat's does, so its curves compare across coefficients)."""
        self.train()
        out = self.actor_model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                               labels=inputs["labels"], use_cache=False)
        algo.check_finite("unsupervised loss", out.loss)
        self._backward_and_step_actor(out.loss * unsup_coef)
        return out.loss.detach()

    def _step_actor(self, skip=False):
        if self.args.unsupervised_dataset_name:  # (the flag that doubles the actor's batch: step3_train_config)
            count_ppo_samples_only(self.actor_model)
        super()._step_actor(skip)


def count_ppo_samples_only(actor):
    """Before a PPO-ptx actor's ``step()``: its config doubles train_batch_size (a PPO micro-step and its
    language-model micro-step accumulate into one step), which DeepSpeed adds to its sample count at a boundary: the
    step of its TensorBoard events (Train/Samples/lr), kept in its checkpoints. Half is taken back first, so the count
    is the PPO samples trained on, as the critic's, and the two models' curves share their axis (the actor's ran at
    twice the critic's counts)."""
    engine = getattr(actor, "ds_engine", actor)  # (a HybridEngine forwards reads, not writes)
    if engine.is_gradient_accumulation_boundary():
        engine.global_samples -= engine.train_batch_size() // 2


def skipped_since(before, after):
    """``train_rollout``'s skipped-step counts between two ``_skipped_steps``: "<model>_skipped_steps" (on inf/NaN
    gradients or --align_overflow's partner's overflow) and "<model>_no_token_steps" (no token in the loss)."""
    counts = {}
    for name, then in before.items():
        skipped, no_token = (None, None) if then is None else (after[name][0] - then[0], after[name][1] - then[1])
        counts[f"{name}_skipped_steps"] = None if then is None else skipped - no_token
        counts[f"{name}_no_token_steps"] = no_token
    return counts


def checked_rollout(experiences):
    """``train_rollout``'s experiences as a list; a single one given bare (``train_rlhf``'s way) or none is an error
    saying what it takes."""
    if isinstance(experiences, Mapping):
        raise UsageError("train_rollout takes a list of generate_experience outputs: train_rollout([out]) (or "
                         "train_rlhf(out), DeepSpeed-Chat's single update)")
    experiences = list(experiences)
    if not experiences:
        raise UsageError("train_rollout([]): no experiences to train on (give generate_experience outputs)")
    return experiences


def check_whole_accumulation_groups(micro_batches, accum, batch):
    """Each optimizer step takes ``accum`` of this rollout's micro-batches: a remainder would be stepped with the
    next rollout's (DeepSpeed counts micro-steps across calls), its loss scaled for other token counts."""
    if micro_batches % accum:
        raise UsageError(f"train_rollout: the rollout makes {micro_batches} micro-batches of "
                         f"per_device_training_batch_size {batch} rows, not a multiple of gradient_accumulation_steps "
                         f"{accum}: an optimizer step would span rollouts; give a training batch size or "
                         "gradient_accumulation_steps that fits, or more experiences per rollout (step 3's flags: "
                         "--generation_batches)")


def check_ptx_steps_paired(args, train_actor, unsup_batches):
    """An actor built for PPO-ptx (--unsupervised_dataset_name: ``step3_train_config`` doubles its accumulation, each
    PPO micro-batch's step followed by a language-model one) trains only with ``unsup_batches``: without them each of
    its optimizer steps took two groups of PPO micro-batches, a rollout of one group leaving half a step, which the next
    rollout's ``check_no_unfinished_step`` took for an interrupted call."""
    if train_actor and args.unsupervised_dataset_name and not unsup_batches:
        raise UsageError("train_rollout: the engine's actor was built for PPO-ptx (unsupervised_dataset_name "
                         f"{args.unsupervised_dataset_name!r}), whose optimizer step accumulates each PPO micro-batch "
                         "with a language-model micro-step: give a DeepSpeedPPOTrainerUnsupervised unsup_batches=[...] "
                         "(batches of that data: dschat.steps.ppo.unsupervised_loader(args, tokenizer)), or build the "
                         "engine without unsupervised_dataset_name")


def check_no_unfinished_step(engines):
    """Each of ``engines`` ({name: DeepSpeed engine or None}) starts the rollout at an accumulation boundary. An
    earlier train_rollout stopped within an optimizer step (a notebook's interrupt, an error in a micro-batch) left its
    engine holding the gradients of that step's first micro-batches, which DeepSpeed has no call to drop: the next
    rollout's first step added them to its own, and every later step spanned two rollouts, without a word."""
    for name, engine in engines.items():
        taken = micro_steps_into_step(engine)
        if taken:  # (None: a test's stand-in)
            accum = engine.gradient_accumulation_steps()
            raise UsageError(f"train_rollout: the {name}'s DeepSpeed engine holds the gradients of "
                             f"{taken} of the {accum} micro-batches of an optimizer step that an earlier "
                             "call did not finish (a train_rollout interrupted or stopped by an error, or train_rlhf "
                             "calls short of a whole step); DeepSpeed cannot drop them, and this rollout's first "
                             "optimizer step would add them to its own, every later step spanning two rollouts. Build "
                             "a new DeepSpeedRLHFEngine and trainer (load_checkpoint goes on from a checkpoint)")


def micro_steps_into_step(engine):
    """The micro-batches of an optimizer step that ``engine`` (a DeepSpeed engine) has taken so far: 0 at an
    accumulation boundary; None for no engine or one that keeps no count (a test's stand-in)."""
    micro_steps = getattr(engine, "micro_steps", None)
    return None if micro_steps is None else micro_steps % engine.gradient_accumulation_steps()


def group_tokens_before(tokens, position):
    """The loss tokens of an optimizer step's micro-batches before the one at ``position`` (0: the step's first), from
    ``tokens`` counted for that step so far: those a call stopped before its backward counted past ``position`` are
    dropped; those counted before this trainer saw the step (another trainer on the same engine) are unknown, taken as
    one token each, so that such a step is taken rather than skipped with tokens in its loss."""
    known = tuple(tokens[:position])
    return known + (1,) * (position - len(known))


def _world_group():
    return torch.distributed.group.WORLD if get_world_size() > 1 else None


def _cat_right_padded(tensors, width):
    """(B, T_i) tensors stacked along rows, each right-padded with zeros to ``width`` columns."""
    return torch.cat([F.pad(t, (0, width - t.shape[1])) for t in tensors])


def split_rows(batch, micro_batch):
    """Slices of a batch dict (a generation batch of experience, an unsupervised batch), ``micro_batch`` rows each
    (DeepSpeed-Chat's MiniDataset)."""
    rows = batch["input_ids"].shape[0]
    return [{k: (v[i:i + micro_batch] if torch.is_tensor(v) else v) for k, v in batch.items()}
            for i in range(0, rows, micro_batch)]


def global_token_count(action_masks, device):
    """Response tokens in a global batch: this rank's micro-batches summed, then all ranks."""
    return _summed_over_ranks(sum(int(m.sum()) for m in action_masks), device)


def global_row_count(action_masks, device):
    """Answers (rows, empty ones included) in a global batch: this rank's micro-batches summed, then all ranks."""
    return _summed_over_ranks(sum(m.shape[0] for m in action_masks), device)


def _summed_over_ranks(count, device):
    return all_reduce(torch.tensor(float(count), device=device)).item()
