"""Prefill + static-cache decode loop over any HF causal LM.

Everything stays on the device: finished flags, positions, the attention mask and the output buffer are tensors updated
in place; the only host synchronisation is the all-finished check every ``early_exit_interval`` steps (only when there
is an EOS to wait for) and one read of the final length.

``graphs.py`` replays the same step from a CUDA graph (``hybrid_engine.enable_cuda_graph``); it shares
``decode_step``, ``prompt_position_ids`` and ``generated_lengths`` with this loop, and both pass a mask as long as the
static cache (0 for the slots not filled yet).
"""
import dataclasses
import functools
import inspect
import os
import traceback

import torch
import torch.distributed as dist

from dschat.hybrid_engine.cache import is_out_of_memory, recurrent_layers
from dschat.hybrid_engine.sampling import (apply_repetition_penalty, choose_tokens, mark_seen, one_pass_applies,
                                           penalty_start, prompt_seen_tokens)
from dschat.models.lora import unwrap_peft


@dataclasses.dataclass(frozen=True)
class ForwardSpec:
    """How this model's forward takes the cache: transformers renamed ``past_key_values`` to ``cache`` and dropped
    ``cache_position`` during 5.x, and the GPU benchmark may run a different 5.x than the one tested here."""

    cache_kwarg: str
    takes_cache_position: bool
    takes_logits_to_keep: bool


@functools.lru_cache(maxsize=None)
def _forward_spec_of_class(model_class):
    params = inspect.signature(model_class.forward).parameters
    cache_kwarg = "cache" if "cache" in params else "past_key_values"
    return ForwardSpec(cache_kwarg=cache_kwarg, takes_cache_position="cache_position" in params,
                       takes_logits_to_keep="logits_to_keep" in params)


def forward_spec(model):
    return _forward_spec_of_class(type(unwrap_peft(model)))


# Causal LMs whose forward takes transformers' KV cache, yet cannot be decoded over it one token at a time, by
# config.model_type, with the reason the refusal quotes. Listed: nothing in their forward's signature tells.
NOT_DECODABLE_PER_TOKEN = {
    "cpmant": "its forward prepends config.prompt_length virtual prompt tokens and wants the whole sequence at every "
              "step (its prepare_inputs_for_generation keeps it whole), reading no attention mask: over the static "
              "cache the prefill overflows it or the decode steps' shapes differ",
    "xlstm": "its forward's cache is its own xLSTMCache of recurrent states, no KV cache: over the static cache its "
             "first forward failed (AttributeError: 'StaticCache' object has no attribute 'rnn_state')",
}


def check_decodable(model):
    """A ``UsageError`` for a causal LM the engine's per-token decode over transformers' KV cache cannot run:
    one whose forward takes no KV cache by transformers' name (``past_key_values``, or ``cache``): GPT-1's (none at
    all), RWKV's (``state``), XLNet's (``mems``), Reformer's (``past_buckets_states``), whose forward took the static
    cache into ``**kwargs`` and dropped it, so each decode step saw its one new token alone (RWKV generated other
    tokens than HF's generate without a word, GPT-1 and XLNet failed on shapes); or one of
    ``NOT_DECODABLE_PER_TOKEN`` (CPMAnt: an IndexError deep in the cache before; xLSTM, whose ``cache`` is no KV
    cache: an AttributeError). The engine checks this when it is built."""
    check_class_decodable(type(unwrap_peft(model)))


def check_class_decodable(model_class):
    """``check_decodable`` for a model class (step 3 checks the actor's, read from its config, before any weight
    loads or any engine is built)."""
    from dschat.errors import UsageError

    way_out = ("Run step 3 without the hybrid engine for this model (--no-enable_hybrid_engine: actor generation then "
               "uses HF generate).")
    params = inspect.signature(model_class.forward).parameters
    if "past_key_values" not in params and "cache" not in params:
        raise UsageError(f"{model_class.__name__}'s forward takes no past_key_values (transformers' KV cache), which "
                         f"the hybrid engine's decode steps read and write. {way_out}")
    model_type = getattr(getattr(model_class, "config_class", None), "model_type", None)
    if model_type in NOT_DECODABLE_PER_TOKEN:
        raise UsageError(f"{model_class.__name__} cannot be decoded one token at a time over the hybrid engine's KV "
                         f"cache: {NOT_DECODABLE_PER_TOKEN[model_type]}. {way_out}")


def decode_step(model, spec, input_ids, attention_mask, position_ids, cache_position, cache):
    """One forward over the static cache; returns the logits of the last position, (B, V)."""
    kwargs = {spec.cache_kwarg: cache, "use_cache": True}
    if spec.takes_cache_position:
        kwargs["cache_position"] = cache_position
    if spec.takes_logits_to_keep:
        kwargs["logits_to_keep"] = 1
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
    return out.logits[:, -1, :]


def prefill(model, spec, input_ids, attention_mask, position_ids, cache_position, cache):
    """``decode_step`` over the prompts: the first forward to meet the static cache. A model whose own code refuses it
    (MiniMax keeps a cache of its own: HF's ValueError) or whose cache layout the engine read otherwise than its
    attention writes (MiMo-V2-Flash: index_copy_'s shapes) failed here deep in transformers; a ``UsageError`` now
    says that the engine cannot decode it and names the way out."""
    reset_states_kept_in_modules(model, input_ids.shape[0], input_ids.device)
    try:
        return decode_step(model, spec, input_ids, attention_mask, position_ids, cache_position, cache)
    except (ValueError, RuntimeError) as error:
        if not _failed_on_the_cache(error):
            raise
        from dschat.errors import UsageError

        reason = (str(error).strip().splitlines() or [""])[0]
        raise UsageError(f"{type(unwrap_peft(model)).__name__} failed on the hybrid engine's static KV cache at its "
                         f"first forward ({type(error).__name__}: {reason}): the engine cannot decode this model. Run "
                         "step 3 without the hybrid engine (--no-enable_hybrid_engine: actor generation then uses HF "
                         "generate).") from error


def reset_states_kept_in_modules(model, batch_size, device):
    """RecurrentGemma keeps its convolution and recurrent states in its modules, not in the cache, and sets them up
    only for a forward given no cache (``_setup_cache``); a one-token prompt's prefill is taken for a decode step (its
    length is 1) and went on from the previous generation's convolution state: its log-probs 0.002 off the prompt's
    own after another generation. Set up afresh before each prefill, as that forward would."""
    if keeps_states_in_modules(model):
        hf_model = unwrap_peft(model)
        hf_model._setup_cache(hf_model.config, batch_size, device, hf_model.dtype)


def keeps_states_in_modules(model):
    """Whether ``model`` (PEFT-wrapped or not) keeps recurrent states in its modules, set up by ``_setup_cache``."""
    return hasattr(unwrap_peft(model), "_setup_cache")


def _failed_on_the_cache(error):
    """Whether ``error`` came from the static cache: raised inside transformers' cache code, or a model's refusal
    that names the cache's class; never an out-of-memory error, nor an accelerator's fault (a CUDA error is raised by
    whichever kernel runs next, often the cache's index_copy_, for an earlier kernel's fault). The engine's own cache
    code (TokenWriteLayer.update) is not counted: it fails only through transformers' update, or by a bug of dschat's,
    which turning the engine off would hide."""
    if is_out_of_memory(error) or _is_accelerator_fault(error):
        return False
    if "StaticCache" in str(error):
        return True
    cache_code = os.path.join("transformers", "cache_utils.py")
    return any(frame.filename.endswith(cache_code) for frame in traceback.extract_tb(error.__traceback__))


def _is_accelerator_fault(error):
    accelerator_error = getattr(torch, "AcceleratorError", ())  # torch >= 2.8 raises CUDA errors as this
    return isinstance(error, accelerator_error) or "CUDA error" in str(error)


def prompt_position_ids(attention_mask):
    """Positions of LEFT-padded prompts: count only real tokens, so padding does not shift a row's positions."""
    position_ids = attention_mask.long().cumsum(-1) - 1
    return position_ids.masked_fill(attention_mask == 0, 0)


def as_eos_tensor(eos_token_id, device):
    from dschat.models.loading import token_id_list

    ids = token_id_list(eos_token_id)
    return torch.tensor(ids, dtype=torch.long, device=device) if ids else None


def _all_finished(finished, sync_group):
    """Host check of the stop condition; with a sync group every rank stops only when all ranks are done."""
    done = finished.all()
    if sync_group is not None:
        flag = done.to(torch.int32).reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=sync_group)
        done = flag[0]
    return bool(done)


def _check_same_across_ranks(value, name, sync_group, device):
    """Ranks that step together must agree on the step budget, or one would wait forever for the others."""
    bounds = torch.tensor([value, -value], dtype=torch.long, device=device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=sync_group)
    high, low = int(bounds[0]), -int(bounds[1])
    if high != low:
        raise ValueError(f"{name} differs across ranks ({low}..{high}); ranks that generate in lock-step "
                         f"(ZeRO-3 without pinned parameters) must use the same {name}")


def cache_length(cache):
    """Token slots per row of a static cache (0 when it does not say)."""
    if hasattr(cache, "get_max_length"):
        return int(cache.get_max_length() or 0)
    return int(getattr(cache, "max_cache_len", 0) or 0)


def decode_step_mask(mask, cache):
    """A decode step's mask: the cache-long one, or none where every layer is recurrent and none attends (Mamba-1).
    Such a model hands the 2-D mask to its mixers as it is, which multiply the step's one new token by it: a
    cache-long mask spread that token over every slot (log-probs 0.38 off HF's); HF's generate passes no mask after
    the prefill. (A hybrid model masks its recurrent layers by the mask's last columns, and a step's one token is never
    padding.) A layer that also attends (Falcon-H1's: attention beside Mamba in every layer, each cache layer keeping
    keys and a recurrent state) needs the mask to leave out its prompts' left padding. Called after the prefill, which
    stored the attention layers' keys."""
    layers = getattr(cache, "layers", ())
    recurrent = recurrent_layers(cache)
    attends = any(getattr(layer, "keys", None) is not None for layer in layers)
    return None if recurrent and all(recurrent) and not attends else mask


def prefill_mask(mask, prompt_len, cache):
    """The prefill's mask: as long as the cache (see ``generate_tokens``), or the prompt's own columns where a layer
    keeps a recurrent state: transformers masks such a layer's padded inputs with the mask's LAST columns, one per
    input token (``create_recurrent_attention_mask``), which in a cache-long mask are the empty slots, so the
    prompt's last tokens were zeroed as if they were padding."""
    return mask[:, :prompt_len] if any(recurrent_layers(cache)) else mask


def generated_lengths(finish_step, steps):
    """Tokens each row generated, its EOS included. HF stops at the step where the last row finished; the early-exit
    check may have run a few steps past it, so the result is trimmed to ``lengths.max()``."""
    return torch.minimum(finish_step + 1, torch.full_like(finish_step, steps))


@torch.no_grad()
def generate_tokens(model, input_ids, attention_mask, cache, max_new_tokens, *, do_sample=False, temperature=1.0,
                    top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0, min_new_tokens=0, generator=None,
                    early_exit_interval=8, sync_group=None, return_lengths=False, return_logprobs=False,
                    token_sync=None, repetition_penalty=1.0, prompt_start=None, one_pass_sampling=False,
                    token_count=None):
    """Generate up to ``max_new_tokens`` for LEFT-padded prompts; returns (B, P + n) sequences like HF ``generate``.

    ``cache`` is a reset ``StaticCache`` with room for P + max_new_tokens. Rows that emitted an EOS continue with
    ``pad_token_id``. The loop stops once every row has finished (checked every ``early_exit_interval`` steps; with a
    ``sync_group`` once every rank's rows have finished, because each forward is a collective then). The result is
    trimmed to the step where the last row finished, as HF does. ``token_sync`` (inference tensor parallelism) makes
    the sampled tokens of every rank of a group the leader's. With ``return_lengths`` also returns the generated
    length of each row (EOS included), on the device; with ``return_logprobs`` also the (B, n) fp32 log-probability
    of each generated token under the model's unfiltered distribution at the sampling temperature (0 after a row's
    end): see ``Generation``.
    ``repetition_penalty`` != 1.0 applies HF's ``RepetitionPenaltyLogitsProcessor`` to the tokens of the prompts and
    of the answers so far (``sampling.py``); ``prompt_start`` (B,) says where each row's own prompt begins in prompts
    padded further on the left (a tensor-parallel group's), for the columns HF would not see.
    ``one_pass_sampling`` lets ``triton_sampling``'s kernel choose the tokens where it applies (``sampling.py``).
    ``token_count`` (the tokenizer's size): no id from it on is generated where the logits are wider
    (``sampling.chosen_columns``).
    """
    batch_size, prompt_len = input_ids.shape
    device = input_ids.device
    eos = as_eos_tensor(eos_token_id, device)
    if sync_group is not None:
        _check_same_across_ranks(max_new_tokens, "max_new_tokens", sync_group, device)

    sequences = torch.full((batch_size, prompt_len + max_new_tokens), pad_token_id, dtype=input_ids.dtype,
                           device=device)
    sequences[:, :prompt_len] = input_ids
    logprobs = torch.zeros((batch_size, max_new_tokens), dtype=torch.float32, device=device) \
        if return_logprobs else None
    if max_new_tokens == 0:
        lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        return _result(sequences, lengths, logprobs, return_lengths)

    spec = forward_spec(model)
    # One column per cache slot, 1 where a token has been fed, passed whole to every forward: models that build an
    # ALiBi bias from the 2-D mask (Bloom, Falcon) need it as long as the cached keys, which the static cache
    # returns in full at every step.
    mask = torch.zeros((batch_size, max(cache_length(cache), prompt_len + max_new_tokens)), dtype=attention_mask.dtype,
                       device=device)
    mask[:, :prompt_len] = attention_mask
    cache_position = torch.arange(prompt_len, device=device)
    logits = prefill(model, spec, input_ids, prefill_mask(mask, prompt_len, cache),
                     prompt_position_ids(attention_mask), cache_position, cache)

    # Decode-loop state, updated in place.
    position_ids = attention_mask.long().sum(-1, keepdim=True)  # next position of each row
    cache_position = torch.tensor([prompt_len], dtype=torch.long, device=device)
    step_mask = decode_step_mask(mask, cache)  # (``mask`` itself, which each step extends in place, or None)
    finished = torch.zeros(batch_size, dtype=torch.bool, device=device)
    finish_step = torch.full((batch_size,), max_new_tokens, dtype=torch.long, device=device)
    seen = prompt_seen_tokens(input_ids, penalty_start(attention_mask, prompt_start), logits.shape[-1]) \
        if repetition_penalty != 1.0 else None
    one_pass = one_pass_sampling and one_pass_applies(
        do_sample, return_logprobs, repetition_penalty != 1.0 or (eos is not None and min_new_tokens > 0))
    steps = 0
    for step in range(max_new_tokens):
        model_logits = logits
        if seen is not None:
            logits = apply_repetition_penalty(logits, seen, repetition_penalty)
        if eos is not None and step < min_new_tokens:
            logits = logits.index_fill(-1, eos, float("-inf"))
        tokens, logp = choose_tokens(logits, model_logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                     do_sample=do_sample, generator=generator, logprobs=logprobs is not None,
                                     one_pass=one_pass, token_sync=token_sync, token_count=token_count)
        if logprobs is not None:
            logprobs[:, step] = logp.masked_fill(finished, 0.0)
        tokens = torch.where(finished, pad_token_id, tokens)
        sequences[:, prompt_len + step] = tokens
        if seen is not None:  # the group's shared tokens, finished rows' pads included (HF's input_ids hold them)
            mark_seen(seen, tokens)
        if eos is not None:
            newly_finished = torch.isin(tokens, eos) & ~finished
            finish_step.masked_fill_(newly_finished, step)
            finished |= newly_finished
        steps = step + 1
        if steps == max_new_tokens:
            break
        # with a sync_group every rank checks, with or without an EOS of its own: the check is a collective
        if (eos is not None or sync_group is not None) and early_exit_interval \
                and steps % early_exit_interval == 0 and _all_finished(finished, sync_group):
            break
        mask[:, prompt_len + step] = 1
        logits = decode_step(model, spec, tokens[:, None], step_mask, position_ids, cache_position, cache)
        position_ids += 1
        cache_position += 1

    lengths = generated_lengths(finish_step, steps)
    n = int(lengths.max()) if eos is not None else steps
    if n < max_new_tokens:
        sequences = sequences[:, :prompt_len + n].contiguous()  # callers may .view() the result
        logprobs = logprobs[:, :n].contiguous() if logprobs is not None else None
    return _result(sequences, lengths, logprobs, return_lengths)


@dataclasses.dataclass
class Generation:
    """What a decode path returns to the engine: (B, P + n) sequences, each row's generated length (EOS included)
    and, when asked for, the (B, n) log-probabilities of the generated tokens."""

    sequences: torch.Tensor
    lengths: torch.Tensor
    logprobs: torch.Tensor = None


def _result(sequences, lengths, logprobs, return_lengths):
    if return_lengths:
        return Generation(sequences, lengths, logprobs)
    return sequences if logprobs is None else (sequences, logprobs)


def prompt_length_groups(input_ids, prompt_lengths):
    """(rows, their prompts without the padding) for each prompt length of LEFT-padded ``input_ids``
    (``prompt_lengths``, (B,)), the lengths ascending: the same order on every rank of a group. Each set of rows
    decoded apart, without its padding, answers as each row alone: a model whose recurrence reads no mask
    (``LEFT_PADDING_MOVES_SCORES``) answers a padded prompt otherwise."""
    width = input_ids.shape[1]
    return [(rows, input_ids[rows, width - length:]) for rows, length in rows_of_each_prompt_length(prompt_lengths)]


def rows_of_each_prompt_length(prompt_lengths):
    """(rows, length) for each prompt length of ``prompt_lengths`` ((B,)), the lengths ascending: every rank of a
    group makes its calls in one order. The one grouping of the hybrid engine's decode (``prompt_length_groups``) and
    of HF generate's row by row path (``trainer.rows_to_generate_together``)."""
    return [((prompt_lengths == length).nonzero().flatten(), length) for length in prompt_lengths.unique().tolist()]


def joined_generations(input_ids, groups, generations, pad_token_id):
    """The ``Generation`` of LEFT-padded ``input_ids`` from each of ``prompt_length_groups``' ``generations``, as one
    decode of the batch returns it: (B, P + n) sequences, the prompts as given, then each row's answer, then pad; each
    row's generated length; the (B, n) log-probs (if asked for), 0 after a row's end."""
    width = input_ids.shape[1]
    n = max(part.sequences.shape[1] - ids.shape[1] for (_, ids), part in zip(groups, generations))
    sequences = input_ids.new_full((input_ids.shape[0], width + n), pad_token_id)
    sequences[:, :width] = input_ids
    lengths = torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    with_logprobs = generations[0].logprobs is not None
    logprobs = torch.zeros((input_ids.shape[0], n), dtype=torch.float32, device=input_ids.device) \
        if with_logprobs else None
    for (rows, ids), part in zip(groups, generations):
        answers = part.sequences[:, ids.shape[1]:]
        sequences[rows, width:width + answers.shape[1]] = answers
        lengths[rows] = part.lengths.to(lengths.dtype)
        if with_logprobs:
            logprobs[rows, :part.logprobs.shape[1]] = part.logprobs
    return Generation(sequences, lengths, logprobs)
