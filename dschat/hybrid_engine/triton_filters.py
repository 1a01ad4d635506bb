"""Top-k and top-p without sorting the vocabulary (Triton): each row's cut, found by a search over the logits' values.

Why: torch's filters (``sampling.filter_top_k_top_p``) sort the whole vocabulary for top-p alone and take
``torch.topk`` for top-k; on an H200 that is 416 us per decode step at B = 64 over OPT's 50k vocabulary and 1188 us
over Qwen2.5's 152k (``bench/sampling.py``), where the unfiltered token choice takes 24 and 51 us. Here one program
per row finds where the filters cut with a few passes over the row's logits and writes two numbers:

- Every logit gets an integer key in the same order as the values (the IEEE bits, negative ones flipped; 16 bits for
  bf16/fp16 logits, 32 for fp32). A search keeps an interval of keys that holds the answer and splits it at FANOUT
  candidate keys per pass over the row.
- Top-k: the k-th largest value, i.e. the largest key with at least k logits at or above it. Every logit tied with
  it stays, as in HF's ``TopKLogitsWarper``.
- Top-p over top-k's survivors (HF's warper order): the cut is the smallest key whose strictly larger survivors hold
  less than ``top_p`` of the survivors' ``softmax(logits / T)`` mass. Every survivor above the cut is kept, and of
  the logits tied at the cut, the first ones by column, as many as the mass still allows. That is the same number of
  tokens HF's sort keeps (a sort orders ties arbitrarily); the masses are fp32 sums, as HF's cumulative sum is.

Per row the result is (the cut's value, the last kept column among the ties at it). The one-pass race of
``triton_sampling`` keeps ``x > cut or (x == cut and column <= last)`` while it reads the logits, so no filtered copy
of the logits is written, and its log-sum-exp stays that of the unfiltered logits (the log-probs PPO wants). Every
launch shape depends only on tensor shapes (CUDA-graph capturable); ``TRITON_INTERPRET=1`` runs it on the CPU.
"""
import torch
import triton
import triton.language as tl

BLOCK = 4096  # columns per loop step
FANOUT = 2  # candidate keys per pass: each pass shrinks the interval ~3x
NUM_WARPS = 16  # with BLOCK and FANOUT: the best of bench/sampling.py --cut_sweep (eighteenth session)


@triton.jit
def _keys(raw, BITS: tl.constexpr):
    """Integer keys ordered as the values (-0.0 and 0.0 equal, as the race's comparisons take them)."""
    if BITS == 16:
        bits = raw.to(tl.int16, bitcast=True).to(tl.int32)
        key = bits ^ ((bits >> 15) & 0x7FFF)
    else:
        bits = raw.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(key == -1, 0, key)  # -1 is -0.0's key


@triton.jit
def _value(key, ELEMENT: tl.constexpr, BITS: tl.constexpr):
    """The value (fp32, exact) whose key ``key`` is."""
    if BITS == 16:
        bits = tl.where(key < 0, key ^ 0x7FFF, key).to(tl.int16)
    else:
        bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
    return bits.to(ELEMENT, bitcast=True).to(tl.float32)


@triton.jit
def _sums_above(row_logits, vocab, cands, floor_key, shift, scale, BLOCK: tl.constexpr, BITS: tl.constexpr,
                MASS: tl.constexpr):
    """Per candidate key c: how much of the row lies strictly above c (a count, or with MASS the weights
    ``exp((x - shift) * scale)``), counting only logits with keys >= ``floor_key``; and the total of those. The sums
    stay per thread until the end (no reduction across warps inside the loop) and the next block is loaded before
    this one is summed."""
    offs = tl.arange(0, BLOCK)
    above = tl.zeros([BLOCK, cands.shape[0]], tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    raw = tl.load(row_logits + offs, mask=offs < vocab, other=0)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        ahead = cols + BLOCK
        raw_ahead = tl.load(row_logits + ahead, mask=ahead < vocab, other=0)
        key = _keys(raw, BITS)
        live = (cols < vocab) & (key >= floor_key)
        if MASS:
            weight = tl.where(live, tl.exp((raw.to(tl.float32) - shift) * scale), 0.0)
        else:
            weight = live.to(tl.float32)
        above += tl.where(key[:, None] > cands[None, :], weight[:, None], 0.0)
        total += weight
        raw = raw_ahead
    return tl.sum(above, 0), tl.sum(total, 0)


@triton.jit
def _last_with_enough_above(row_logits, vocab, lo, hi, floor_key, shift, scale, target, share,
                            BLOCK: tl.constexpr, BITS: tl.constexpr, MASS: tl.constexpr, FANOUT: tl.constexpr):
    """The largest key c in [lo, hi] with (what lies above c) >= ``target + share x total`` (see :func:`_sums_above`);
    that holds at ``lo`` and, the sums falling as c grows, for every key up to the answer."""
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64)
    steps = tl.arange(0, FANOUT).to(tl.int64) + 1
    while lo < hi:
        cands = lo + ((hi - lo) * steps + FANOUT) // (FANOUT + 1)  # spread over (lo, hi], ascending
        above, total = _sums_above(row_logits, vocab, cands.to(tl.int32), floor_key, shift, scale, BLOCK, BITS, MASS)
        enough = above >= target + share * total
        lo = tl.max(tl.where(enough, cands, lo), 0)
        hi = tl.min(tl.where(enough, hi, cands - 1), 0)
    return lo.to(tl.int32)


@triton.jit
def _cut_kernel(Logits, Cut, LastTie, stride_lb, vocab, top_k, top_p, inv_temperature, BLOCK: tl.constexpr,
                BITS: tl.constexpr, FANOUT: tl.constexpr, TOP_K: tl.constexpr, TOP_P: tl.constexpr):
    row = tl.program_id(0)
    row_logits = Logits + row.to(tl.int64) * stride_lb
    offs = tl.arange(0, BLOCK)
    key_max = tl.full([BLOCK], -2147483648, tl.int32)
    key_min = tl.full([BLOCK], 2147483647, tl.int32)
    raw = tl.load(row_logits + offs, mask=offs < vocab, other=0)
    for start in range(0, vocab, BLOCK):
        ok = start + offs < vocab
        ahead = start + BLOCK + offs
        raw_ahead = tl.load(row_logits + ahead, mask=ahead < vocab, other=0)
        key = _keys(raw, BITS)
        key_max = tl.maximum(key_max, tl.where(ok, key, -2147483648))
        key_min = tl.minimum(key_min, tl.where(ok, key, 2147483647))
        raw = raw_ahead
    top = tl.max(key_max, 0)
    floor_key = tl.min(key_min, 0)
    element = Logits.dtype.element_ty
    shift = _value(top, element, BITS)
    shift = tl.where(shift == float("-inf"), 0.0, shift)  # an all -inf row: weights 0, not nan
    if TOP_K:  # the k-th largest key: the largest one with k logits at or above it (strictly above the one below)
        floor_key = _last_with_enough_above(row_logits, vocab, floor_key - 1, top, floor_key, shift, inv_temperature,
                                            top_k, 0.0, BLOCK, BITS, False, FANOUT) + 1
    cut = floor_key
    last = vocab - 1
    if TOP_P:
        # The largest key with at least top_p of the survivors' mass strictly above it; the cut is the next key. The
        # logits below t = max + T log((1 - top_p) / V) (in the logits' dtype, rounded down) hold less than 1 - top_p
        # of the mass (each weighs under (1 - top_p) / V of the max's), so at least top_p lies at t and above: the
        # search starts just below t instead of at the smallest logit.
        low = shift + tl.log((1.0 - top_p) / vocab) / inv_temperature
        low = (low - tl.abs(low) * 0.0078125 - 0.0078125).to(element)
        start = tl.maximum(floor_key, _keys(low, BITS)) - 1
        cut = _last_with_enough_above(row_logits, vocab, start, top, floor_key, shift, inv_temperature, 0.0,
                                      top_p, BLOCK, BITS, True, FANOUT) + 1
        cut = tl.minimum(cut, top)  # top_p = 0 keeps the largest value (HF keeps one token at least)
        sums, total = _sums_above(row_logits, vocab, tl.full([1], 0, tl.int32) + cut, floor_key, shift,
                                  inv_temperature, BLOCK, BITS, True)
        tie_weight = tl.exp((_value(cut, element, BITS) - shift) * inv_temperature)
        # ties at the cut are kept while the mass ranked above them (with the ties kept before) is below top_p
        wanted = tl.maximum(tl.ceil((top_p * total - tl.sum(sums, 0)) / tie_weight), 1.0)
        seen = tl.full([], 0, tl.int32)
        last = tl.full([], 0, tl.int32) + vocab
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            ok = cols < vocab
            tie = ok & (_keys(tl.load(row_logits + cols, mask=ok, other=0), BITS) == cut)
            rank = seen + tl.cumsum(tie.to(tl.int32), 0)
            last = tl.minimum(last, tl.min(tl.where(tie & (rank.to(tl.float32) == wanted), cols, vocab), 0))
            seen += tl.sum(tie.to(tl.int32), 0)
        last = tl.where(last == vocab, vocab - 1, last)  # fewer ties than wanted (fp32 rounding): all of them
    tl.store(Cut + row, _value(cut, element, BITS))
    tl.store(LastTie + row, last)


def applies(vocab, top_k, top_p):
    """Whether top-k and/or top-p filter anything out of a ``vocab``-wide row."""
    return 0 < top_k < vocab or top_p < 1.0


def unsupported(logits):
    """Why :func:`row_cuts` cannot take these logits (a string), or None."""
    if logits.dim() != 2 or logits.shape[0] == 0 or logits.stride(-1) != 1:
        return f"wants (B > 0, V) logits with contiguous rows, got shape {tuple(logits.shape)}"
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"no keys for {logits.dtype} logits"
    return None


def row_cuts(logits, temperature=1.0, top_k=0, top_p=1.0):
    """``logits`` (B, V) -> (cut (B,) fp32, last (B,) int32): top-k, then top-p of ``softmax(logits / temperature)``
    over its survivors, keep the columns with ``x > cut`` or ``x == cut and column <= last``."""
    reason = unsupported(logits)
    if reason is not None:
        raise ValueError(f"row_cuts: {reason}")
    rows, vocab = logits.shape
    top_k = top_k if 0 < top_k < vocab else 0
    cut = torch.empty(rows, dtype=torch.float32, device=logits.device)
    last = torch.empty(rows, dtype=torch.int32, device=logits.device)
    _cut_kernel[(rows,)](logits, cut, last, logits.stride(0), vocab, float(top_k), float(min(max(top_p, 0.0), 1.0)),
                         1.0 / temperature, BLOCK=BLOCK, BITS=logits.element_size() * 8, FANOUT=FANOUT,
                         TOP_K=top_k > 0, TOP_P=top_p < 1.0, num_warps=NUM_WARPS)
    return cut, last


def kept(logits, cut, last):
    """The (B, V) bool mask the race applies (torch ops; for tests and the benchmark's checks)."""
    columns = torch.arange(logits.shape[-1], device=logits.device)
    values = logits.float()
    return (values > cut[:, None]) | ((values == cut[:, None]) & (columns <= last[:, None].long()))
