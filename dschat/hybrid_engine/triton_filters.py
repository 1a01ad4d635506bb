"""Top-k and top-p without sorting the vocabulary (Triton): each row's cut, raced on the model's own logits.

Why: torch's filters (``sampling.filter_top_k_top_p``) sort the whole vocabulary for top-p and run ``torch.topk`` plus
masks for top-k: on an H200 (``bench/sampling.py``, B = 64, with log-probs) top-p 0.9 took 416 us per decode step
over OPT's 50k vocabulary and 1188 us over Qwen2.5's 152k, top-k 20 with top-p 0.8 313 and 826 us, where the
unfiltered token choice takes 24 and 52 us. The kernels here write two numbers per row instead, and the one-pass race
of ``triton_sampling`` keeps ``x > cut or (x == cut and column <= last)`` while it reads the logits: no filtered copy
is written, and its log-sum-exp stays that of the unfiltered logits (the log-probs PPO wants).

Every logit gets a 16-bit integer key in the order of its value (the IEEE bits, negative ones flipped).

- Top-p alone (:func:`_cut_kernel`, 167 and 468 us): one program per row searches the keys for where the nucleus
  cuts. It keeps an interval of keys that holds the cut and splits it at FANOUT candidate keys per pass over the row.
  The cut is the smallest key whose strictly larger logits hold less than ``top_p`` of the ``softmax(logits / T)``
  mass; of the logits tied at it, the first ones by column are kept, as many as the mass still allows. While the
  rows leave half the multiprocessors idle (:func:`split_top_p`), the same search runs split over (row, chunk)
  programs instead (:func:`_split_top_p_cuts`, B = 16: 64 and 109 us against 154 and 430).
- Top-k, and top-p after it (:func:`_top_k_cuts`, 75 and 190 us for top-k 20 with top-p 0.8): each chunk of
  TOPK_CHUNK columns ranks its logits by (value, then the smaller column) with ``tl.topk`` and keeps its best
  next-power-of-two-above-k; one program per row ranks those candidates. Top-k keeps every logit tied with the k-th,
  as HF's does; top-p then cuts the survivors in rank order (the k ranked, then the other ties by column), as
  ``sampling.filter_top_k_top_p`` does. Up to MAX_TOP_K; beyond it torch's filter runs.

Both keep the number of tokens HF's sort keeps (a sort orders ties arbitrarily); the masses are fp32 sums, as HF's
cumulative sum is, in another order (a cut whose mass lies within rounding of top_p may move a token). Every launch
shape depends only on tensor shapes and k (CUDA-graph capturable); ``TRITON_INTERPRET=1`` runs them on the CPU.
"""
import struct

import torch
import triton
import triton.language as tl

from dschat.hybrid_engine import triton_sampling

BLOCK = 4096  # columns per loop step
FANOUT = 2  # candidate keys per pass: each pass shrinks the interval ~3x
NUM_WARPS = 16  # with BLOCK and FANOUT: the best of bench/sampling.py --cut_sweep (eighteenth session)
TOPK_CHUNK = 4096  # columns ranked per program of top-k's first launch
TOPK_NUM_WARPS = 4
TOPK_NARROW_KEYS = True  # rank 32-bit keys in the chunks (TOPK_CHUNK <= 32768): ~1.4x faster than 64-bit ones
MAX_TOP_K = 256  # larger k: torch.topk (each chunk ranks the next power of two above k)
SPLIT_TOP_P = None  # top-p alone: None splits rows over chunks while there are at most half as many rows as
# multiprocessors (split_top_p); True / False always / never
SPLIT_CHUNK = 4096  # columns per program of the split search
SPLIT_SUB = 512  # columns per loop step
SPLIT_FANOUT = 4  # candidate keys per pass: split_passes(4) = 7 passes close any 16-bit interval
SPLIT_NUM_WARPS = 8  # with SPLIT_CHUNK and SPLIT_FANOUT: the best of bench/sampling.py --cut_sweep (25th session)


@triton.jit
def _keys(raw):
    """16-bit floats' integer keys, ordered as the values (-0.0 and 0.0 equal, as the race's comparisons take them)."""
    bits = raw.to(tl.int16, bitcast=True).to(tl.int32)
    key = bits ^ ((bits >> 15) & 0x7FFF)
    return tl.where(key == -1, 0, key)  # -1 is -0.0's key


@triton.jit
def _value(key, ELEMENT: tl.constexpr):
    """The value (fp32, exact) whose key ``key`` is."""
    return tl.where(key < 0, key ^ 0x7FFF, key).to(tl.int16).to(ELEMENT, bitcast=True).to(tl.float32)


@triton.jit
def _sums_above(row_logits, vocab, cands, shift, scale, BLOCK: tl.constexpr):
    """Per candidate key c: the weights ``exp((x - shift) * scale)`` of the logits with keys strictly above c; and the
    total weight of the row. The sums stay per thread until the end (no reduction across warps inside the loop) and
    the next block is loaded before this one is summed."""
    offs = tl.arange(0, BLOCK)
    above = tl.zeros([BLOCK, cands.shape[0]], tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    raw = tl.load(row_logits + offs, mask=offs < vocab, other=0)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        ahead = cols + BLOCK
        raw_ahead = tl.load(row_logits + ahead, mask=ahead < vocab, other=0)
        key = _keys(raw)
        weight = tl.where(cols < vocab, tl.exp((raw.to(tl.float32) - shift) * scale), 0.0)
        above += tl.where(key[:, None] > cands[None, :], weight[:, None], 0.0)
        total += weight
        raw = raw_ahead
    return tl.sum(above, 0), tl.sum(total, 0)


@triton.jit
def _last_with_enough_above(row_logits, vocab, lo, hi, shift, scale, share, BLOCK: tl.constexpr,
                            FANOUT: tl.constexpr):
    """The largest key c in [lo, hi] with at least ``share`` of the total weight strictly above it (see
    :func:`_sums_above`); that holds at ``lo`` and, the sums falling as c grows, for every key up to the answer."""
    while lo < hi:
        cands = _candidates(lo, hi, FANOUT)
        above, total = _sums_above(row_logits, vocab, cands, shift, scale, BLOCK)
        lo, hi = _narrow(lo, hi, cands, above >= share * total)
    return lo


@triton.jit
def _candidates(lo, hi, FANOUT: tl.constexpr):
    """FANOUT keys spread over (lo, hi], ascending (int32)."""
    steps = tl.arange(0, FANOUT).to(tl.int64) + 1
    lo = lo.to(tl.int64)
    return (lo + ((hi.to(tl.int64) - lo) * steps + FANOUT) // (FANOUT + 1)).to(tl.int32)


@triton.jit
def _narrow(lo, hi, cands, enough):
    """The interval after one pass: the largest candidate with ``enough`` weight above it becomes ``lo``, the smallest
    without, less one, ``hi``."""
    return tl.max(tl.where(enough, cands, lo), 0), tl.min(tl.where(enough, hi, cands - 1), 0)


@triton.jit
def _search_start(top, bottom, vocab, top_p, inv_temperature, ELEMENT: tl.constexpr):
    """The shift of a row's weights (its largest value; 0 for an all -inf row: weights 0, not nan) and the key the
    search starts below. The largest key with at least top_p of the mass strictly above it is searched for (the cut
    is the next key). The logits below t = max + T log((1 - top_p) / V) (in the logits' dtype, rounded down) hold less
    than 1 - top_p of the mass (each weighs under (1 - top_p) / V of the max's), so at least top_p lies at t and
    above: the search starts just below t instead of at the smallest logit."""
    shift = _value(top, ELEMENT)
    shift = tl.where(shift == float("-inf"), 0.0, shift)
    low = shift + tl.log((1.0 - top_p) / vocab) / inv_temperature
    low = (low - tl.abs(low) * 0.0078125 - 0.0078125).to(ELEMENT)
    return shift, tl.maximum(bottom, _keys(low)) - 1


@triton.jit
def _cut_kernel(Logits, Cut, LastTie, stride_lb, vocab, top_p, inv_temperature, BLOCK: tl.constexpr,
                FANOUT: tl.constexpr):
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
        key = _keys(raw)
        key_max = tl.maximum(key_max, tl.where(ok, key, -2147483648))
        key_min = tl.minimum(key_min, tl.where(ok, key, 2147483647))
        raw = raw_ahead
    top = tl.max(key_max, 0)
    bottom = tl.min(key_min, 0)
    element = Logits.dtype.element_ty
    shift, first = _search_start(top, bottom, vocab, top_p, inv_temperature, element)
    cut = _last_with_enough_above(row_logits, vocab, first, top, shift, inv_temperature, top_p, BLOCK, FANOUT) + 1
    cut = tl.minimum(cut, top)  # top_p = 0 keeps the largest value (HF keeps one token at least)
    sums, total = _sums_above(row_logits, vocab, tl.full([1], 0, tl.int32) + cut, shift, inv_temperature, BLOCK)
    wanted = _ties_kept(cut, shift, inv_temperature, top_p, tl.sum(sums, 0), total, element)
    tl.store(Cut + row, _value(cut, element))
    tl.store(LastTie + row, _tie_column(row_logits, 0, vocab, vocab, cut, wanted, BLOCK))


@triton.jit
def _ties_kept(cut, shift, scale, share, above, total, ELEMENT: tl.constexpr):
    """How many of the logits tied at the cut key are kept (the first ones by column): while the weight ranked above
    them (``above``, and the ties kept before) is below ``share`` of ``total``; at least one."""
    tie_weight = tl.exp((_value(cut, ELEMENT) - shift) * scale)
    return tl.maximum(tl.ceil((share * total - above) / tie_weight), 1.0).to(tl.int32)


@triton.jit
def _tie_column(row_logits, first, stop, vocab, key, wanted, BLOCK: tl.constexpr):
    """The column of the ``wanted``-th (from 1) logit with key ``key`` in columns [first, stop), by column; vocab - 1
    when there are fewer (fp32 rounding of the count): all of them."""
    offs = tl.arange(0, BLOCK)
    seen = tl.full([], 0, tl.int32)
    last = tl.full([], 0, tl.int32) + vocab
    for start in range(first, stop, BLOCK):
        cols = start + offs
        ok = cols < stop
        tie = ok & (_keys(tl.load(row_logits + cols, mask=ok, other=0)) == key)
        rank = seen + tl.cumsum(tie.to(tl.int32), 0)
        last = tl.minimum(last, tl.min(tl.where(tie & (rank == wanted), cols, vocab), 0))
        seen += tl.sum(tie.to(tl.int32), 0)
    return tl.where(last == vocab, vocab - 1, last)


@triton.jit
def _count_key(row_logits, vocab, key, BLOCK: tl.constexpr):
    """How many of the row's logits have key ``key``."""
    offs = tl.arange(0, BLOCK)
    count = tl.full([], 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        ok = cols < vocab
        count += tl.sum((ok & (_keys(tl.load(row_logits + cols, mask=ok, other=0)) == key)).to(tl.int32), 0)
    return count


@triton.jit
def _ranked_keys(raw, cols, ok):
    """int64 keys in the order top-k ranks: by value (the 16-bit key above), then the smaller column first; the
    columns past the row's end below every logit."""
    ranked = (_keys(raw).to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)
    return tl.where(ok, ranked, -9223372036854775807 - 1)


@triton.jit
def _chunk_top_kernel(Logits, Keys, stride_lb, vocab, CHUNK: tl.constexpr, KP: tl.constexpr,
                      NARROW: tl.constexpr):
    """Each (row, chunk of CHUNK columns): its KP largest ranked keys, descending. The row's top k (k <= KP) are
    among its chunks' candidates: a chunk holds at most k of them. NARROW ranks 32-bit keys (the value's 16 bits,
    then the column within the chunk) and widens the KP winners."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    local = tl.arange(0, CHUNK)
    cols = chunk * CHUNK + local
    ok = cols < vocab
    raw = tl.load(Logits + row.to(tl.int64) * stride_lb + cols, mask=ok, other=0)
    out = (row * tl.num_programs(1) + chunk) * KP + tl.arange(0, KP)
    if NARROW:
        top = tl.topk(tl.where(ok, (_keys(raw) << 16) | (0xFFFF - local), -2147483648), KP)
        value_key = top >> 16  # -32768 (a NaN's key, never a real one here): past the row's end
        wide = (value_key.to(tl.int64) << 32) | (0x7FFFFFFF - chunk * CHUNK - (0xFFFF - (top & 0xFFFF))).to(tl.int64)
        tl.store(Keys + out, tl.where(value_key == -32768, -9223372036854775807 - 1, wide))
    else:
        tl.store(Keys + out, tl.topk(_ranked_keys(raw, cols, ok), KP))


@triton.jit
def _top_k_cut_kernel(Logits, Keys, Cut, LastTie, stride_lb, vocab, candidates, top_k, top_p, inv_temperature,
                      CANDIDATES: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr, NUCLEUS: tl.constexpr):
    """A row's cut from its chunks' candidates: top-k keeps every logit tied with the k-th (HF's top-k); with
    NUCLEUS, top-p then cuts the survivors in rank order (the k ranked, then the other ties with the k-th by
    column), as ``sampling.filter_top_k_top_p`` does."""
    row = tl.program_id(0)
    row_logits = Logits + row.to(tl.int64) * stride_lb
    offs = tl.arange(0, CANDIDATES)
    keys = tl.load(Keys + row * candidates + offs, mask=offs < candidates, other=-9223372036854775807 - 1)
    top = tl.topk(keys, KP)
    ranks = tl.arange(0, KP)
    value_keys = (top >> 32).to(tl.int32)
    kth_key = tl.sum(tl.where(ranks == top_k - 1, value_keys, 0), 0)
    element = Logits.dtype.element_ty
    if NUCLEUS:
        in_k = ranks < top_k
        values = _value(value_keys, element)
        shift = tl.max(tl.where(in_k, values, float("-inf")), 0)
        shift = tl.where(shift == float("-inf"), 0.0, shift)  # an all -inf row: weights 0, not nan
        weights = tl.where(in_k, tl.exp((values - shift) * inv_temperature), 0.0)
        kth_weight = tl.exp((_value(kth_key, element) - shift) * inv_temperature)
        ties = _count_key(row_logits, vocab, kth_key, BLOCK)
        left_out = ties - tl.sum((in_k & (value_keys == kth_key)).to(tl.int32), 0)
        in_k_mass = tl.sum(weights, 0)
        mass = in_k_mass + left_out.to(tl.float32) * kth_weight
        # a ranked token stays while the mass ranked above it is below top_p (the first always)
        kept = in_k & ((tl.cumsum(weights, 0) - weights < top_p * mass) | (ranks == 0))
        kept_in_k = tl.sum(kept.to(tl.int32), 0)
        # then the left-out ties, the j-th (from 0) while top-k's mass and j of theirs is below top_p
        extra = tl.ceil((top_p * mass - in_k_mass) / kth_weight).to(tl.int32)
        extra = tl.where(kept_in_k == top_k, tl.minimum(tl.maximum(extra, 0), left_out), 0)
        cut_key = tl.sum(tl.where(ranks == kept_in_k - 1, value_keys, 0), 0)
        wanted = kept_in_k + extra - tl.sum((in_k & (value_keys > cut_key)).to(tl.int32), 0)
        if cut_key != kth_key:  # above the k-th: all its ties are ranked, by column
            last = 0x7FFFFFFF - tl.sum(tl.where(ranks == kept_in_k - 1, top & 0x7FFFFFFF, 0), 0).to(tl.int32)
        elif wanted >= ties:
            last = vocab - 1
        else:
            last = _tie_column(row_logits, 0, vocab, vocab, cut_key, wanted, BLOCK)
        tl.store(Cut + row, _value(cut_key, element))
        tl.store(LastTie + row, last)
    else:
        tl.store(Cut + row, _value(kth_key, element))
        tl.store(LastTie + row, vocab - 1)


# ---- top-p alone, each row split over programs -------------------------------------------------------------------
# The single-program search above reads a row ~9 times on one multiprocessor, so at small B most of the GPU idles:
# 154 us per step at B = 16 over OPT's vocabulary, 11x the unfiltered token choice. Here each pass is one launch over
# (row, chunk of SPLIT_CHUNK columns): every program sums its chunk's weights above SPLIT_FANOUT candidate keys, and
# the next pass's programs each narrow their row's interval from those partial sums (the same sums in the same order,
# so the same interval in every program). A fixed number of passes (``split_passes``: enough for any 16-bit interval)
# keeps the launches capturable; a row whose interval has closed skips its sums.


@triton.jit
def _chunk_range_kernel(Logits, Range, stride_lb, vocab, CHUNK: tl.constexpr):
    """Each (row, chunk): its largest and smallest keys."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = cols < vocab
    key = _keys(tl.load(Logits + row.to(tl.int64) * stride_lb + cols, mask=ok, other=0))
    out = Range + (row * tl.num_programs(1) + chunk) * 2
    tl.store(out, tl.max(tl.where(ok, key, -2147483648), 0))
    tl.store(out + 1, tl.min(tl.where(ok, key, 2147483647), 0))


@triton.jit
def _row_start(Range, row, chunks, vocab, top_p, inv_temperature, ELEMENT: tl.constexpr, CHUNKS: tl.constexpr):
    """The row's largest key, the shift of its weights (its largest value) and the key the search starts below (as
    :func:`_cut_kernel`'s)."""
    offs = tl.arange(0, CHUNKS)
    ok = offs < chunks
    at = Range + (row * chunks + offs) * 2
    top = tl.max(tl.load(at, mask=ok, other=-2147483648), 0)
    bottom = tl.min(tl.load(at + 1, mask=ok, other=2147483647), 0)
    shift, first = _search_start(top, bottom, vocab, top_p, inv_temperature, ELEMENT)
    return top, shift, first


@triton.jit
def _narrowed(Above, Total, State, Pass, row, chunks, top_p, CHUNKS: tl.constexpr, FANOUT: tl.constexpr):
    """The row's interval after pass ``Pass``'s sums (:func:`_narrow`, at least ``top_p`` of the weight above)."""
    at = State + (Pass * tl.num_programs(0) + row) * 2
    lo = tl.load(at)
    hi = tl.load(at + 1)
    if lo < hi:
        offs = tl.arange(0, CHUNKS)
        ok = offs < chunks
        base = Pass * tl.num_programs(0) * chunks + row * chunks + offs
        fans = tl.arange(0, FANOUT)
        above = tl.sum(tl.load(Above + base[:, None] * FANOUT + fans[None, :], mask=ok[:, None], other=0.0), 0)
        total = tl.sum(tl.load(Total + base, mask=ok, other=0.0), 0)
        cands = _candidates(lo, hi, FANOUT)
        lo, hi = _narrow(lo, hi, cands, above >= top_p * total)
    return lo, hi


@triton.jit
def _chunk_weights(row_logits, chunk, vocab, cands, shift, scale, CHUNK: tl.constexpr, SUB: tl.constexpr):
    """Over one chunk: per candidate key, the weight of the logits with keys strictly above it; the chunk's total
    weight; and how many of its logits have the first candidate's key."""
    offs = tl.arange(0, SUB)
    above = tl.zeros([SUB, cands.shape[0]], tl.float32)
    total = tl.zeros([SUB], tl.float32)
    ties = tl.zeros([SUB], tl.int32)
    first = tl.min(cands, 0)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, SUB):
        cols = start + offs
        ok = cols < vocab
        raw = tl.load(row_logits + cols, mask=ok, other=0)
        key = _keys(raw)
        weight = tl.where(ok, tl.exp((raw.to(tl.float32) - shift) * scale), 0.0)
        above += tl.where(key[:, None] > cands[None, :], weight[:, None], 0.0)
        total += weight
        ties += (ok & (key == first)).to(tl.int32)
    return tl.sum(above, 0), tl.sum(total, 0), tl.sum(ties, 0)


@triton.jit
def _split_pass_kernel(Logits, Range, Above, Total, State, stride_lb, vocab, chunks, top_p, inv_temperature, PASS,
                       CHUNK: tl.constexpr, CHUNKS: tl.constexpr, SUB: tl.constexpr, FANOUT: tl.constexpr):
    """Pass PASS over (row, chunk): the row's interval (from the previous pass's sums), then this chunk's sums above
    its candidates."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    top, shift, first = _row_start(Range, row, chunks, vocab, top_p, inv_temperature, Logits.dtype.element_ty,
                                   CHUNKS)
    if PASS == 0:
        lo = first
        hi = top
    else:
        lo, hi = _narrowed(Above, Total, State, PASS - 1, row, chunks, top_p, CHUNKS, FANOUT)
    if chunk == 0:
        at = State + (PASS * tl.num_programs(0) + row) * 2
        tl.store(at, lo)
        tl.store(at + 1, hi)
    if lo < hi:
        cands = _candidates(lo, hi, FANOUT)
        above, total, _ = _chunk_weights(Logits + row.to(tl.int64) * stride_lb, chunk, vocab, cands, shift,
                                         inv_temperature, CHUNK, SUB)
        base = (PASS * tl.num_programs(0) + row) * chunks + chunk
        tl.store(Above + base * FANOUT + tl.arange(0, FANOUT), above)
        tl.store(Total + base, total)


@triton.jit
def _split_cut_sums_kernel(Logits, Range, Above, Total, State, CutSums, CutTies, stride_lb, vocab, chunks, top_p,
                           inv_temperature, LAST, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, SUB: tl.constexpr,
                           FANOUT: tl.constexpr):
    """Over (row, chunk), after the last pass: the cut (the key after the interval's), this chunk's weight above it,
    its total and its ties at the cut."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    top, shift, _ = _row_start(Range, row, chunks, vocab, top_p, inv_temperature, Logits.dtype.element_ty, CHUNKS)
    lo, _ = _narrowed(Above, Total, State, LAST, row, chunks, top_p, CHUNKS, FANOUT)
    cut = tl.minimum(lo + 1, top)  # top_p = 0 keeps the largest value (HF keeps one token at least)
    above, total, ties = _chunk_weights(Logits + row.to(tl.int64) * stride_lb, chunk, vocab,
                                        tl.full([1], 0, tl.int32) + cut, shift, inv_temperature, CHUNK, SUB)
    base = row * chunks + chunk
    tl.store(CutSums + base * 2, tl.sum(above, 0))
    tl.store(CutSums + base * 2 + 1, total)
    tl.store(CutTies + base, ties)
    if chunk == 0:
        tl.store(State + ((LAST + 1) * tl.num_programs(0) + row) * 2, cut)


@triton.jit
def _split_cut_kernel(Logits, Range, State, CutSums, CutTies, Cut, LastTie, stride_lb, vocab, chunks, top_p,
                      inv_temperature, LAST, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """Each row: its cut, and of the logits tied at it the column of the last one kept (by column: as many as the
    mass ranked above them still allows below top_p)."""
    row = tl.program_id(0)
    element = Logits.dtype.element_ty
    top, shift, _ = _row_start(Range, row, chunks, vocab, top_p, inv_temperature, element, CHUNKS)
    cut = tl.load(State + ((LAST + 1) * tl.num_programs(0) + row) * 2)
    offs = tl.arange(0, CHUNKS)
    ok = offs < chunks
    base = row * chunks + offs
    above = tl.sum(tl.load(CutSums + base * 2, mask=ok, other=0.0), 0)
    total = tl.sum(tl.load(CutSums + base * 2 + 1, mask=ok, other=0.0), 0)
    ties = tl.load(CutTies + base, mask=ok, other=0)
    wanted = _ties_kept(cut, shift, inv_temperature, top_p, above, total, element)
    # the chunk holding the wanted-th tie, and the ties before it (none: fp32 rounding of the count, keep all; the
    # scan from past the row's end then finds nothing)
    holder = tl.min(tl.where(ok & (tl.cumsum(ties, 0) >= wanted), offs, chunks), 0)
    before = tl.sum(tl.where(offs < holder, ties, 0), 0)
    first = holder * CHUNK
    last = _tie_column(Logits + row.to(tl.int64) * stride_lb, first, tl.minimum(first + CHUNK, vocab), vocab, cut,
                       wanted - before, CHUNK)
    tl.store(Cut + row, _value(cut, element))
    tl.store(LastTie + row, last)


def split_top_p(rows, device):
    """Whether top-p alone splits each row over chunks (SPLIT_TOP_P; None: while there are at most half as many rows as
    multiprocessors). On an H200 (bench/sampling.py --cut_sweep --top_p 0.9, 25th session; us per step with the
    race) the split search took 64 against 154 at B = 16 over OPT's vocabulary, 132 against 165 at B = 64, but 222
    against 180 at B = 128, where one program per row already fills the GPU with less work in all (two candidates per
    pass against four)."""
    if SPLIT_TOP_P is not None:
        return SPLIT_TOP_P
    return 2 * rows <= triton_sampling.multiprocessors(device)


def split_passes(fanout):
    """Passes that close any interval of 16-bit keys (the worst gap between candidates, pass after pass)."""
    length, passes = 65536, 0  # hi - lo: the search starts at most one below the smallest key
    while length > 0:
        offsets = [0, *((length * s + fanout) // (fanout + 1) for s in range(1, fanout + 1)), length + 1]
        length = max(b - a for a, b in zip(offsets, offsets[1:])) - 1
        passes += 1
    return passes


def _split_top_p_cuts(logits, temperature, top_p, cut, last):
    """Top-p alone in ``split_passes`` + 3 launches over (row, chunk): chunk ranges, passes, the cut's sums, the cut."""
    rows, vocab = logits.shape
    chunk = min(SPLIT_CHUNK, max(triton.next_power_of_2(vocab), SPLIT_SUB))
    chunks = -(-vocab // chunk)
    passes = split_passes(SPLIT_FANOUT)
    device = logits.device
    ranges = torch.empty((rows, chunks, 2), dtype=torch.int32, device=device)
    above = torch.empty((passes, rows, chunks, SPLIT_FANOUT), dtype=torch.float32, device=device)
    total = torch.empty((passes, rows, chunks), dtype=torch.float32, device=device)
    state = torch.empty((passes + 1, rows, 2), dtype=torch.int32, device=device)
    cut_sums = torch.empty((rows, chunks, 2), dtype=torch.float32, device=device)
    cut_ties = torch.empty((rows, chunks), dtype=torch.int32, device=device)
    grid = (rows, chunks)
    common = dict(CHUNK=chunk, CHUNKS=triton.next_power_of_2(chunks))
    scale = 1.0 / temperature
    _chunk_range_kernel[grid](logits, ranges, logits.stride(0), vocab, CHUNK=chunk, num_warps=SPLIT_NUM_WARPS)
    for index in range(passes):
        _split_pass_kernel[grid](logits, ranges, above, total, state, logits.stride(0), vocab, chunks, top_p, scale,
                                 index, SUB=SPLIT_SUB, FANOUT=SPLIT_FANOUT, num_warps=SPLIT_NUM_WARPS, **common)
    _split_cut_sums_kernel[grid](logits, ranges, above, total, state, cut_sums, cut_ties, logits.stride(0), vocab,
                                 chunks, top_p, scale, passes - 1, SUB=SPLIT_SUB, FANOUT=SPLIT_FANOUT,
                                 num_warps=SPLIT_NUM_WARPS, **common)
    _split_cut_kernel[(rows,)](logits, ranges, state, cut_sums, cut_ties, cut, last, logits.stride(0), vocab, chunks,
                               top_p, scale, passes - 1, num_warps=SPLIT_NUM_WARPS, **common)


def unsupported(logits, top_k=0):
    """Why :func:`row_cuts` should not take these logits (a string), or None: it searches 16-bit keys (bf16/fp16, as
    models give them); fp32 logits (e.g. after a repetition penalty) would take ~16-20 passes over 32-bit keys, which
    was not measured against the sort they would replace. Top-k ranks at most MAX_TOP_K per chunk."""
    if logits.dtype not in (torch.bfloat16, torch.float16):
        return f"searches 16-bit logits, not {logits.dtype}"
    if top_k > MAX_TOP_K:
        return f"top_k {top_k} > {MAX_TOP_K}"
    return None


def row_cuts(logits, temperature=1.0, top_p=1.0, top_k=0):
    """``logits`` (B, V), rows contiguous -> (cut (B,) fp32, last (B,) int32): top-k (``0 < top_k < V``), then top-p
    of ``softmax(logits / temperature)`` over what top-k keeps, keep the columns with ``x > cut`` or ``x == cut and
    column <= last``."""
    reason = unsupported(logits, top_k)
    if reason is not None:
        raise ValueError(f"row_cuts: {reason}")
    rows, vocab = logits.shape
    cut = torch.empty(rows, dtype=torch.float32, device=logits.device)
    last = torch.empty(rows, dtype=torch.int32, device=logits.device)
    top_p = fp32(min(max(top_p, 0.0), 1.0))  # as the kernels compare it: a top_p that rounds to 1 filters nothing
    if 0 < top_k < vocab:
        _top_k_cuts(logits, temperature, top_p, top_k, cut, last)
        return cut, last
    if split_top_p(rows, logits.device):
        _split_top_p_cuts(logits, temperature, top_p, cut, last)
    else:
        _cut_kernel[(rows,)](logits, cut, last, logits.stride(0), vocab, top_p, 1.0 / temperature, BLOCK=BLOCK,
                             FANOUT=FANOUT, num_warps=NUM_WARPS)
    return cut, last


def _top_k_cuts(logits, temperature, top_p, top_k, cut, last):
    """Top-k's (and top-p's after it) cuts in two launches: every chunk's candidates, then each row's cut."""
    rows, vocab = logits.shape
    ranked = max(triton.next_power_of_2(top_k), 16)  # tl.topk of 1 fails to compile on some Triton versions
    chunk = max(min(TOPK_CHUNK, triton.next_power_of_2(vocab)), ranked)  # tl.topk ranks at most its input
    chunks = -(-vocab // chunk)
    keys = torch.empty((rows, chunks * ranked), dtype=torch.int64, device=logits.device)
    _chunk_top_kernel[(rows, chunks)](logits, keys, logits.stride(0), vocab, CHUNK=chunk, KP=ranked,
                                      NARROW=TOPK_NARROW_KEYS, num_warps=TOPK_NUM_WARPS)
    _top_k_cut_kernel[(rows,)](logits, keys, cut, last, logits.stride(0), vocab, chunks * ranked, top_k, top_p,
                               1.0 / temperature, CANDIDATES=triton.next_power_of_2(chunks * ranked), KP=ranked,
                               BLOCK=BLOCK, NUCLEUS=top_p < 1.0, num_warps=NUM_WARPS)


def fp32(value):
    """A Python float rounded as a kernel's fp32 argument receives it (no tensor: row_cuts runs every eager step)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def kept(logits, cut, last):
    """The (B, V) bool mask of what the race may draw (torch ops; for tests and the benchmark's checks): what the cut
    keeps, less -inf columns (a row with fewer finite logits than top-k's k cuts at -inf)."""
    columns = torch.arange(logits.shape[-1], device=logits.device)
    values = logits.float()
    within = (values > cut[:, None]) | ((values == cut[:, None]) & (columns <= last[:, None].long()))
    return within & (values > float("-inf"))
