"""Next-token selection that stays on the device.

No ``torch.multinomial`` and no ``.item()``: sampling is an argmax over ``probs / Exponential(1)`` noise (the
exponential race, equivalent to Gumbel-max; computed in log space), so a decode step has no host synchronisation and
is captured in a CUDA graph by ``graphs.py``. The noise comes from an explicit ``torch.Generator`` so a fixed seed
reproduces the same tokens (a graph draws from a generator registered with it, seeded from the caller's).

``repetition_penalty`` is HF's ``RepetitionPenaltyLogitsProcessor`` over a (B, V + 1) bool "seen" tensor kept on the
device: filled from the prompts (:func:`prompt_seen_tokens`), marked with every step's tokens (:func:`mark_seen`) and
applied to the step's fp32 logits (:func:`apply_repetition_penalty`) before the EOS suppression and the sampling
filters, as in HF's processor order. Column V catches ids the logits do not cover (HF drops them too).

On a device Triton runs on, :func:`choose_tokens` may take the one-pass kernel of ``triton_sampling.py`` instead (same
race, its own Philox noise seeded from the generator, and the log-sum-exp for the log-probs in the same read).
"""
import functools

import torch

from dschat.hybrid_engine.attention import FAILED, call_kernel, triton_available, triton_runs_on
from dschat.hybrid_engine.generate_args import check_temperature


def nucleus_of_probs(sorted_probs, top_p):
    """A token is dropped when the tokens ranked above it already reach ``top_p``; the top token is never dropped."""
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = mass_before < top_p
    keep[..., 0] = True
    return keep


def ranked(logits, n):
    """Each row's ``n`` largest values, descending, and their columns (a sort when ``n`` covers the row)."""
    if n >= logits.shape[-1]:
        return torch.sort(logits, dim=-1, descending=True)
    return torch.topk(logits, n)


def filter_top_k_top_p(logits, top_k, top_p, ranking=None):
    """Top-k, then top-p over the survivors, as HF's warpers do; with both, without sorting the whole vocabulary.

    ``ranking``: each row's k largest values, descending, and their columns (:func:`ranked`; :func:`filtered_logits`
    ranks the model's own bf16 logits instead, which is cheaper and gives the same values in the same order). The
    survivors of top-k are those k plus any other logits tied with the k-th (bf16 logits tie often); ranked by value,
    those left-out ties come last. The nucleus is cut along that order: the first k by their rank, then as many
    left-out ties as the mass still allows (the first ones by column: among equal logits the order is arbitrary, in
    HF's sort as here)."""
    vocab = logits.shape[-1]
    k = top_k if 0 < top_k < vocab else vocab
    if k == vocab and top_p >= 1.0:
        return logits
    values, indices = ranking if ranking is not None else ranked(logits, k)
    kth = values[..., -1:]
    if top_p >= 1.0:
        return logits.masked_fill(logits < kth, float("-inf"))
    if k == vocab:
        # fp32 sums, as HF's: their rounding (~4e-6 over 30k bf16 logits) moves the cut by a token when the mass there
        # is that close to top_p, in HF's cut as here; fp64 would cost as much as sorting bf16 instead of fp32 saves
        keep = nucleus_of_probs(values.softmax(-1), top_p)
        return logits.masked_fill(~torch.zeros_like(keep).scatter_(-1, indices, keep), float("-inf"))
    in_top_k = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, indices, True)
    left_out_ties = (logits == kth) & ~in_top_k
    ties = left_out_ties.sum(-1, keepdim=True)
    weights = (values - values[..., :1]).exp()  # as softmax computes them: exact halves stay exact at a tie
    mass = weights.sum(-1, keepdim=True) + ties * weights[..., -1:]
    probs = weights / mass
    keep = torch.zeros_like(in_top_k).scatter_(-1, indices, nucleus_of_probs(probs, top_p))
    # the j-th left-out tie (from 0) is kept while the mass ranked above it, top-k's + j of theirs, is below top_p
    # (in unnormalised weights, as triton_filters counts them: at an exact boundary, (0.3 - 1/80) / (1/80) gave
    # 23.000002 in fp32 and kept a 24th tie where HF keeps 23)
    ties_kept = ((top_p * mass - weights.sum(-1, keepdim=True)) / weights[..., -1:]).ceil().clamp(min=0)
    keep |= left_out_ties & (left_out_ties.cumsum(-1, dtype=torch.int32) <= ties_kept)
    return logits.masked_fill(~keep, float("-inf"))


def _scaled(logits, temperature):
    logits = logits.float()
    return logits / temperature if temperature != 1.0 else logits


def filtered_logits(logits, temperature=1.0, top_k=0, top_p=1.0):
    """Temperature, then top-k, then top-p (HF's warper order), in fp32 whatever the model dtype.

    The largest values are ranked on ``logits`` as given and then scaled: a non-decreasing map gives the same values
    in the same order, and sorting (or topk of) bf16 logits is cheaper than of their fp32 copy (``bench/sampling.py``:
    1.5x for the sort)."""
    check_temperature(temperature)
    scaled = _scaled(logits, temperature)
    vocab = logits.shape[-1]
    k = top_k if 0 < top_k < vocab else vocab
    if k == vocab and top_p >= 1.0:
        return scaled
    values, indices = ranked(logits, k)
    return filter_top_k_top_p(scaled, k, top_p, (_scaled(values, temperature), indices))


def exponential_race(logits, temperature=1.0, generator=None):
    """One draw per row from ``softmax(logits / temperature)``: ``argmax(logits - temperature * log E)``, E ~ Exp(1).

    That is the race ``argmax(probs / E)`` in log space (multiplying by ``temperature > 0`` keeps the argmax), so
    neither the softmax nor a scaled or fp32 copy of the logits is made: bf16 logits are promoted inside the
    subtraction. At a 152k vocabulary and 64 rows: 117 against 207 us per token on an H200 (``bench/sampling.py``).
    """
    log_noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    log_noise.exponential_(1.0, generator=generator)
    # exponential_ may return exactly 0; log(0) against a filtered -inf logit would make a nan argmax.
    log_noise.clamp_min_(torch.finfo(log_noise.dtype).tiny).log_()
    return torch.sub(logits, log_noise, alpha=temperature).argmax(dim=-1)


def filters_apply(vocab, top_k, top_p):
    """Whether top-k and/or top-p leave anything out of a ``vocab``-wide row."""
    return 0 < top_k < vocab or top_p < 1.0


def race_input(logits, temperature=1.0, top_k=0, top_p=1.0):
    """(what the race draws from, its temperature): the logits themselves when nothing is filtered (the race applies
    the temperature), else the filtered fp32 logits with the temperature already applied."""
    check_temperature(temperature)
    if not filters_apply(logits.shape[-1], top_k, top_p):
        return logits, temperature
    return filtered_logits(logits, temperature, top_k, top_p), 1.0


def sample_next_token(logits, temperature=1.0, top_k=0, top_p=1.0, do_sample=False, generator=None):
    """``logits`` (B, V) -> token ids (B,), on the logits' device. Greedy is a plain argmax."""
    if not do_sample:
        return logits.argmax(dim=-1)
    return exponential_race(*race_input(logits, temperature, top_k, top_p), generator)


def token_log_probs(logits, tokens, temperature=1.0):
    """``log softmax(logits / temperature)[token]`` per row, in fp32, of the unfiltered distribution (no top-k/p or
    EOS suppression): what step 3's training forward scores the token with, e.g. PPO's old log-probs."""
    return torch.log_softmax(_scaled(logits.float(), temperature), dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


# False: torch's ops choose every token (the benchmarks' ``_torchsample`` rows)
ONE_PASS = True


def one_pass_applies(do_sample, logprobs, modifies_logits):
    """Whether a generation's tokens may come from ``triton_sampling``'s one-pass kernel: whenever it samples (the race
    runs on whatever the step chooses from: the model's logits, or logits penalised, EOS-suppressed or filtered by
    top-k/top-p), and greedy only with log-probs wanted from the model's own logits (``modifies_logits`` False;
    greedy alone is one argmax already). Decided once per generation, so eager and graph steps draw alike."""
    if not ONE_PASS:
        return False
    return do_sample or (logprobs and not modifies_logits)


def chosen_columns(logits, token_count):
    """How many of the logits' columns a token may be chosen from: ``token_count`` (the tokenizer's ids) where the
    logits are wider, else None (all of them). A model's embedding often has rows no token has (Qwen2.5: 151936 rows
    for 151665 ids; step 3 grows a critic's and reward model's to the actor's): an id sampled there decodes to nothing
    and was never scored by a reward model. HF's ``generate`` does the same with ``suppress_tokens`` set to them."""
    if token_count is None or not 0 < int(token_count) < logits.shape[-1]:
        return None
    return int(token_count)


def choose_tokens(logits, model_logits, *, temperature=1.0, top_k=0, top_p=1.0, do_sample=False, generator=None,
                  logprobs=False, one_pass=False, token_sync=None, token_count=None):
    """A decode step's tokens (B,) chosen from ``logits`` and, with ``logprobs``, their fp32 log-probabilities under
    ``model_logits`` (the unmodified distribution; ``logits`` itself when the step changed nothing; else None) at the
    sampling temperature (greedy: 1).
    ``one_pass`` (from :func:`one_pass_applies`): the Triton kernel where it runs, torch's ops otherwise (and after a
    kernel failure, reported once); its log-sum-exp gives the log-probs when it read the model's own logits.
    ``token_sync`` makes the tokens a tensor-parallel group's shared ones before their log-probs are read.
    ``token_count``: the tokenizer's size; no token is chosen from the columns past it (:func:`chosen_columns`),
    as if their logits were -inf before top-k/top-p. The log-probs stay those of every column's softmax (what the
    training forward scores the token with)."""
    if do_sample:
        check_temperature(temperature)
    columns = chosen_columns(logits, token_count)
    chosen = FAILED
    if one_pass and triton_available() and triton_runs_on(logits):
        chosen = _one_pass_tokens(logits, temperature, top_k, top_p, do_sample, generator,
                                  logprobs and logits is model_logits, columns)
    if chosen is FAILED:
        choice = logits if columns is None else logits[:, :columns]
        source, race_temperature = race_input(choice, temperature, top_k, top_p) if do_sample else (choice, 1.0)
        tokens = exponential_race(source, race_temperature, generator) if do_sample else source.argmax(dim=-1)
        lse = None
    else:
        tokens, lse = chosen
    if token_sync is not None:
        tokens = token_sync(tokens)
    if not logprobs:
        return tokens, None
    scale = temperature if do_sample else 1.0
    if lse is None:
        return tokens, token_log_probs(model_logits, tokens, scale)
    return tokens, model_logits.gather(-1, tokens[:, None]).squeeze(-1).float() * (1.0 / scale) - lse


def _one_pass_tokens(logits, temperature, top_k, top_p, do_sample, generator, with_lse, columns=None):
    """``triton_sampling.select_tokens`` on ``logits``; top-k/top-p on bf16/fp16 logits as ``triton_filters``' row
    cuts (no sort, no filtered copy), on fp32 logits (e.g. penalised) or a top-k above its limit as torch's filtered
    copy. ``columns``: only the first ones are chosen from (the cuts are of those alone; the log-sum-exp is of all).
    FAILED for logits the kernels cannot take (torch's path then runs, for this call only) or after a kernel
    failure."""
    from dschat.hybrid_engine import triton_filters, triton_sampling

    if triton_sampling.unsupported(logits, generator if do_sample else None) is not None:
        return FAILED
    choice = logits if columns is None else logits[:, :columns]  # (a view: rows keep their stride)
    cuts = None
    if do_sample and filters_apply(choice.shape[-1], top_k, top_p):
        if triton_filters.unsupported(choice, top_k) is not None:
            filtered = filtered_logits(choice, temperature, top_k, top_p)
            return call_kernel(triton_sampling.select_tokens, filtered, 1.0, generator, True, False)
        cuts = call_kernel(triton_filters.row_cuts, choice, temperature, top_p, top_k)
        if cuts is FAILED:
            return FAILED
    return call_kernel(triton_sampling.select_tokens, logits, temperature if do_sample else 1.0, generator, do_sample,
                       with_lse, cuts, columns)


@functools.lru_cache(maxsize=None)
def hf_penalty_skips_left_padding():
    """Whether HF's ``generate`` leaves a row's left padding out of the repetition penalty: from transformers 5.23 it
    passes each row's first attended position as ``RepetitionPenaltyLogitsProcessor``'s ``prompt_ignore_length``;
    before, every token of ``input_ids`` (pad tokens included) counted as seen. The decode does as the installed
    version does."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release >= (5, 23)


def penalty_start(attention_mask, prompt_start=None):
    """(B,) the first prompt column whose tokens count as seen for the repetition penalty, as HF's ``generate`` on
    each row's own prompt decides it. ``prompt_start`` (B,): where each row's own prompt begins in a batch padded
    further on the left (a tensor-parallel group's; default 0). With transformers >= 5.23 the row's left padding is
    skipped (``(mask != 0).argmax``: the first attended column; a row with no attended column skips nothing)."""
    rows, length = attention_mask.shape
    if prompt_start is None:
        prompt_start = torch.zeros(rows, dtype=torch.long, device=attention_mask.device)
    if not hf_penalty_skips_left_padding():
        return prompt_start
    columns = torch.arange(length, device=attention_mask.device)
    attended = (attention_mask != 0) & (columns >= prompt_start[:, None])
    return torch.where(attended.any(-1), attended.int().argmax(-1), prompt_start)


def prompt_seen_tokens(input_ids, start, vocab_size):
    """(B, vocab_size + 1) bool: True for the ids of each row's prompt from column ``start`` (B,) on. Ids past the
    logits' vocabulary land in the last column, which the penalty ignores (HF clamps them there and drops it)."""
    columns = torch.arange(input_ids.shape[1], device=input_ids.device)
    ids = input_ids.masked_fill(columns < start[:, None], vocab_size).clamp(max=vocab_size)
    seen = torch.zeros((input_ids.shape[0], vocab_size + 1), dtype=torch.bool, device=input_ids.device)
    return seen.scatter_(1, ids, True)


def mark_seen(seen, tokens):
    """Add each row's token (B,) to ``seen``, in place (a static-shape scatter: graph-capturable)."""
    seen.scatter_(1, tokens.clamp(max=seen.shape[1] - 1)[:, None], True)


def apply_repetition_penalty(logits, seen, penalty):
    """HF's ``RepetitionPenaltyLogitsProcessor``: the fp32 logit of every seen token is multiplied by ``penalty`` when
    negative, else divided by it. Returns new fp32 logits."""
    logits = logits.float()
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen[:, :logits.shape[-1]], penalised, logits)
