"""Flash-decoding attention for one query token over a static KV cache (Triton).

Why: with a static cache, SDPA reads every slot of the cache (B x heads x max_len) each decode step and relies on the
mask to zero the unfilled tail and the left padding. This kernel first scans each row's mask (bytes) for its visible
span and then loads only the key/value blocks inside it; with grouped-query attention one program serves all query
heads of a key/value head, so each key/value block is read once. A row's span is split into parts (``splits``) when
batch x key/value heads alone would leave the GPU's multiprocessors idle; the partial results are combined with their
log-sum-exp, as in FlashAttention's decoding kernels.

Also here: the one-token KV-cache write (:func:`write_token_kv`), the slot read from a device counter.

Every launch shape depends only on tensor shapes, never on values, so the kernels can be captured in a CUDA graph.
Imported only when the kernel is used (it needs ``triton``); ``TRITON_INTERPRET=1`` runs it on the CPU for tests.
"""
import dataclasses
import functools
import math
import os

import torch
import triton
import triton.language as tl

PROGRAMS_PER_SM = 1  # splitting fills at most this many programs per multiprocessor (see split_count)
MIN_PROGRAMS = 132  # off the GPU (the interpreter): as if one program per multiprocessor of an H200
MASK_SCAN = 1024  # mask bytes read per step of a row's visible-span scan
# A row whose visible slots are one span without holes (left padding, then the filled cache: every row the engine
# decodes) takes them from the span instead of loading the mask's bytes ahead of each tile's keys and values: OPT-1.3B's
# layout at B=64 52.9 against 54.6 us per layer (bench/decode_attention.py --cold --probes, H200).
CONTIGUOUS_FAST_PATH = True
# Each row's visible span, found once per forward (the first layer's call, :func:`row_spans`) instead of by every
# program of every layer: the scan is a dependent load ahead of each program's first key/value tiles. In an
# OPT-1.3B-shaped compiled decode layer at B=64 the kernel without it took ~2.7 us less per layer
# (bench/pdl_chain.py, fourteenth session).
SPANS_PER_FORWARD = True


@triton.jit
def _partial_kernel(Q, K, V, Mask, Spans, Out, Lse, Final,
                    stride_qb, stride_qh, stride_qd,
                    stride_kb, stride_kh, stride_kn, stride_kd,
                    stride_vb, stride_vh, stride_vn, stride_vd,
                    stride_mb, stride_mn, stride_sb,
                    batch_bucket, kv_len_bucket, num_kv_heads, kv_len, scale_log2,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                    BLOCK: tl.constexpr, SPLITS: tl.constexpr, HAS_MASK: tl.constexpr, SCAN: tl.constexpr,
                    FAST_CONTIGUOUS: tl.constexpr, IEEE: tl.constexpr, SPANS_GIVEN: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // num_kv_heads
    kv_head = bh % num_kv_heads
    # The row's visible span [lo, hi] from its mask: left padding before it and the unfilled cache after it are
    # never loaded.
    if HAS_MASK and SPANS_GIVEN:  # (lo, hi, unholed) of the row, from row_spans
        lo = tl.load(Spans + b * stride_sb)
        hi = tl.load(Spans + b * stride_sb + 1)
        unholed = tl.load(Spans + b * stride_sb + 2) != 0
    elif HAS_MASK:
        lo, hi, count = _visible_span(Mask + b * stride_mb, stride_mn, kv_len, SCAN)
        unholed = count == hi - lo + 1  # no hole inside [lo, hi]: the span alone says which slots are visible
    else:
        lo = 0 * b
        hi = kv_len - 1 + 0 * b
        unholed = True
    first_block = lo // BLOCK
    num_blocks = tl.where(hi >= lo, hi // BLOCK - first_block + 1, 0)
    per_split = tl.cdiv(num_blocks, SPLITS)
    begin = first_block + split * per_split
    end = tl.minimum(begin + per_split, first_block + num_blocks)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q_heads = kv_head * GROUP + g
    q = tl.load(Q + b * stride_qb + q_heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    # 64-bit offsets into the cache: one layer's keys may hold more than 2**31 elements
    k_base = K + b.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    row_mask = Mask + b * stride_mb
    # Masked slots are never loaded: a padded slot's keys and values may be NaN (left padding's rows are fully masked
    # in the prefill). Loops over whole blocks without per-block branches let the compiler pipeline the loads.
    if FAST_CONTIGUOUS & unholed:  # the visible slots from the span: no mask load ahead of each tile's loads
        for blk in range(begin, end):
            n = blk * BLOCK + tl.arange(0, BLOCK)
            m_i, l_i, acc = _attend_tile(q, k_base, v_base, n, (n >= lo) & (n <= hi), d, d_ok, stride_kn, stride_kd,
                                         stride_vn, stride_vd, scale_log2, m_i, l_i, acc, IEEE)
    else:
        for blk in range(begin, end):
            n = blk * BLOCK + tl.arange(0, BLOCK)
            visible = n < kv_len
            if HAS_MASK:  # holes inside the span (and its ragged ends)
                visible = visible & (tl.load(row_mask + n * stride_mn, mask=visible, other=0) != 0)
            m_i, l_i, acc = _attend_tile(q, k_base, v_base, n, visible, d, d_ok, stride_kn, stride_kd, stride_vn,
                                         stride_vd, scale_log2, m_i, l_i, acc, IEEE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a split that saw nothing: zeros, weight 0 below
    store_mask = g_ok[:, None] & d_ok[None, :]
    if SPLITS == 1:  # write the final output (B, 1, H, D), contiguous, in the query's dtype
        tl.store(Final + (b * GROUP * num_kv_heads + q_heads[:, None]) * HEAD_DIM + d[None, :],
                 out.to(Final.dtype.element_ty), mask=store_mask)
    else:  # partials: Out (B*H, SPLITS, D_PAD) fp32, Lse (B*H, SPLITS) in log2 units
        row = b * GROUP * num_kv_heads + q_heads
        tl.store(Out + (row[:, None] * SPLITS + split) * D_PAD + d[None, :], out, mask=store_mask)
        tl.store(Lse + row * SPLITS + split, m_i + tl.log2(l_i), mask=g_ok)


@triton.jit
def _attend_tile(q, k_base, v_base, n, visible, d, d_ok, stride_kn, stride_kd, stride_vn, stride_vd, scale_log2,
                 m_i, l_i, acc, IEEE: tl.constexpr):
    """One tile of slots ``n`` (those ``visible``) into the online softmax's running max, sum and output."""
    kv_mask = visible[:, None] & d_ok[None, :]
    k = tl.load(k_base + n[:, None] * stride_kn + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    v = tl.load(v_base + n[:, None] * stride_vn + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(visible[None, :], s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with nothing visible yet: no NaN
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _visible_span(row_mask, stride_mn, kv_len, SCAN: tl.constexpr):
    """First and last slot of a row whose mask byte is set ((kv_len, -1) when none is), and how many are set."""
    zero = tl.program_id(0) * 0  # loop-carried values must be tensors, whatever the arguments' specialisation
    lo = kv_len + zero
    hi = zero - 1
    count = zero
    for start in range(0, kv_len, SCAN):
        n = start + tl.arange(0, SCAN)
        seen = (n < kv_len) & (tl.load(row_mask + n * stride_mn, mask=n < kv_len, other=0) != 0)
        lo = tl.minimum(lo, tl.min(tl.where(seen, n, kv_len), axis=0))
        hi = tl.maximum(hi, tl.max(tl.where(seen, n, -1), axis=0))
        count += tl.sum(seen.to(tl.int32), axis=0)
    return lo, hi, count


@triton.jit
def _span_kernel(Mask, Spans, stride_mb, stride_mn, kv_len, SCAN: tl.constexpr):
    """Per row: its first and last visible slot and whether none between them is masked (row_spans)."""
    b = tl.program_id(0)
    lo, hi, count = _visible_span(Mask + b * stride_mb, stride_mn, kv_len, SCAN)
    tl.store(Spans + b * 3, lo)
    tl.store(Spans + b * 3 + 1, hi)
    tl.store(Spans + b * 3 + 2, (count == hi - lo + 1).to(tl.int32))


def row_spans(mask, mask_bytes, kv_len):
    """(rows, 3) int32: each row's (first visible slot, last visible slot, 1 if no slot between them is masked).

    One small kernel at the first call for a ``mask`` object; the other layers of the same forward get the same
    object (transformers builds the mask once per forward) and reuse its spans, kept on the mask itself with its
    version counter, so an in-place change of the mask is scanned again. A captured graph replays that one kernel
    each step. (Inference-mode tensors have no version counter: scanned at every call.)"""
    # Spans found outside a graph capture are not reused inside one: the graph must replay their kernel each step.
    state = (_version_of(mask), _capturing(mask_bytes.device))
    cached = getattr(mask, "_dschat_row_spans", None)
    if cached is not None and state[0] is not None and cached[0] == state:
        return cached[1]
    spans = torch.empty((mask_bytes.shape[0], 3), dtype=torch.int32, device=mask_bytes.device)
    _span_kernel[(mask_bytes.shape[0],)](mask_bytes, spans, mask_bytes.stride(0), mask_bytes.stride(1), kv_len,
                                         SCAN=min(MASK_SCAN, triton.next_power_of_2(kv_len)), num_warps=4)
    if state[0] is not None:
        mask._dschat_row_spans = (state, spans)
    return spans


def _capturing(device):
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _version_of(tensor):
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor
        return None


@triton.jit
def _combine_kernel(Out, Lse, Final, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr,
                    SPLITS_PAD: tl.constexpr):
    row = tl.program_id(0)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    s_ok = s < SPLITS
    lse = tl.load(Lse + row * SPLITS + s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # nothing visible at all: output zeros, not NaN
    w = tl.exp2(lse - top)
    parts = tl.load(Out + (row * SPLITS + s[:, None]) * D_PAD + d[None, :], mask=s_ok[:, None], other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(Final + row * HEAD_DIM + d, out.to(Final.dtype.element_ty), mask=d < HEAD_DIM)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_count(programs, num_blocks, device):
    """Into how many parts each (row, key/value head) splits its visible blocks, from shapes only (a graph bakes
    it in): as many as still fit in one wave of one program per multiprocessor, never more than the cache has
    blocks. Each part costs a partial write and a share of the combine, so more parts than one wave is slower:
    on an H200 (cold caches, ``bench/decode_attention.py --cold --splits``) the 7B layout at B=64 (256 programs) takes
    17.2 us unsplit against 20.7 us in 2 parts, and at B=16 (64 programs) 9.3 us in 2 parts against 11.0 us in 5."""
    target = PROGRAMS_PER_SM * _multiprocessors(device.index or 0) if device.type == "cuda" else MIN_PROGRAMS
    return max(1, min(num_blocks, target // programs))


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Explicit launch parameters (tests, ``bench/decode_attention.py``); on the GPU the default is autotuned."""

    block: int = 64  # cache slots per K/V tile
    num_stages: int = 2  # tiles in flight per program (software pipelining of the block loop)
    num_warps: int = 4
    splits: int | None = None  # parts per (row, key/value head); None: split_count's choice
    contiguous_fast_path: bool | None = None  # None: CONTIGUOUS_FAST_PATH when launched
    spans_per_forward: bool | None = None  # None: SPANS_PER_FORWARD when launched


# On the GPU each new shape (cache length and batch rounded up to powers of two, heads) times these once, at its
# first call (the decode graph's warm-up), each as a CUDA graph of repeated launches so that the timing is the kernel's
# and not Python's.
CONFIGS = [triton.Config({"BLOCK": block}, num_stages=stages, num_warps=warps)
           for block, stages, warps in ((32, 2, 4), (32, 3, 4), (64, 2, 4), (64, 3, 4), (64, 3, 8), (128, 2, 4),
                                        (128, 3, 4), (128, 2, 8))]  # the best of bench/decode_attention.py's sweep
_partial_kernel_autotuned = triton.autotune(
    configs=CONFIGS, key=["batch_bucket", "kv_len_bucket", "num_kv_heads", "GROUP", "HEAD_DIM", "SPLITS", "HAS_MASK",
                          "FAST_CONTIGUOUS", "SPANS_GIVEN"],
    do_bench=lambda fn, quantiles: triton.testing.do_bench_cudagraph(fn, rep=20, quantiles=quantiles),
)(_partial_kernel)


def _autotuned(device):
    return device.type == "cuda" and not os.environ.get("TRITON_INTERPRET") == "1"


# Shapes whose autotuning already ran (see _tune_at_typical_fill).
_TUNED = set()


def launch(query, key, value, mask, scaling, tuning=None):
    """The kernels behind :func:`decode_attention`; ``tuning`` None: autotuned on the GPU, ``Tuning()`` elsewhere."""
    batch, num_heads, _, head_dim = query.shape
    num_kv_heads, kv_len = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))
    programs = batch * num_kv_heads
    # From the smallest tile's block count: with larger tiles some parts may get no block (weight 0 in the combine).
    splits = tuning.splits if tuning is not None and tuning.splits is not None else \
        split_count(programs, triton.cdiv(kv_len, 32), query.device)
    if tuning is None and _autotuned(query.device):
        kernel, launch_options = _partial_kernel_autotuned, {}
        fast_contiguous, spans_given = CONTIGUOUS_FAST_PATH, SPANS_PER_FORWARD
    else:
        tuning = tuning or Tuning()
        kernel = _partial_kernel
        fast_contiguous = CONTIGUOUS_FAST_PATH if tuning.contiguous_fast_path is None else tuning.contiguous_fast_path
        spans_given = SPANS_PER_FORWARD if tuning.spans_per_forward is None else tuning.spans_per_forward
        launch_options = dict(BLOCK=tuning.block, num_warps=tuning.num_warps, num_stages=tuning.num_stages)
    scan = min(MASK_SCAN, triton.next_power_of_2(kv_len))

    def partial(mask_bytes, spans=None):
        """The partial kernel over ``mask_bytes`` (None, or (B or 1, L) uint8) and, with ``spans_given``, its rows'
        ``spans`` (row_spans); returns its final (or partial) outputs."""
        final = torch.empty((batch, 1, num_heads, head_dim), dtype=query.dtype, device=query.device)
        if splits > 1:
            out = torch.empty((batch * num_heads, splits, d_pad), dtype=torch.float32, device=query.device)
            lse = torch.empty((batch * num_heads, splits), dtype=torch.float32, device=query.device)
        else:
            out = lse = final  # unused by the kernel
        has_mask = mask_bytes is not None
        if has_mask:
            stride_mb = mask_bytes.stride(0) if mask_bytes.shape[0] > 1 else 0
            stride_mn = mask_bytes.stride(1)
        else:
            mask_bytes, stride_mb, stride_mn = key, 0, 0  # placeholder pointer, never read
        stride_sb = 3 if spans is not None and spans.shape[0] > 1 else 0
        kernel[(programs, splits)](
            query, key, value, mask_bytes, spans if spans is not None else mask_bytes, out, lse, final,
            query.stride(0), query.stride(1), query.stride(3),
            key.stride(0), key.stride(1), key.stride(2), key.stride(3),
            value.stride(0), value.stride(1), value.stride(2), value.stride(3),
            stride_mb, stride_mn, stride_sb,
            # autotuning keys only: the next powers of two, so that eager decoding with ever new cache lengths or
            # batch sizes does not time the candidates again for each
            triton.next_power_of_2(batch), triton.next_power_of_2(kv_len), num_kv_heads, kv_len,
            scaling * math.log2(math.e),
            GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, D_PAD=d_pad,
            SPLITS=splits, HAS_MASK=has_mask, SCAN=scan, FAST_CONTIGUOUS=fast_contiguous,
            IEEE=query.dtype == torch.float32, SPANS_GIVEN=has_mask and spans is not None, **launch_options)
        return final, out, lse

    mask_bytes = None if mask is None else mask[:, 0, 0, :].view(torch.uint8)  # bool as bytes: one load per slot
    if kernel is _partial_kernel_autotuned and mask is not None:
        _tune_at_typical_fill(partial, (triton.next_power_of_2(batch), triton.next_power_of_2(kv_len), num_kv_heads,
                                        group, head_dim, splits, query.dtype, fast_contiguous, spans_given), kv_len,
                              query.device, spans_given)
    final, out, lse = partial(mask_bytes, row_spans(mask, mask_bytes, kv_len) if spans_given and mask is not None
                              else None)
    if splits > 1:
        _combine_kernel[(batch * num_heads,)](out, lse, final, HEAD_DIM=head_dim, D_PAD=d_pad, SPLITS=splits,
                                              SPLITS_PAD=triton.next_power_of_2(splits), num_warps=4)
    return final


def _tune_at_typical_fill(partial, shape_key, kv_len, device, spans_given):
    """Autotune a new shape on a cache 3/4 filled rather than on the caller's mask. The first call of a shape is the
    decode graph's warm-up, right after the prefill, when the cache holds the prompt only; a generation then fills it
    to the end, so its mean fill is P + N/2 of P + N slots (3/4 when prompt and answer are as long), and tiles timed
    on the prompt alone were picked for a quarter less work than the average step does."""
    if shape_key in _TUNED:
        return
    typical = (torch.arange(kv_len, device=device) < (3 * kv_len) // 4).to(torch.uint8)[None]
    # times the candidates; the autotuner keeps the best for this key (values are not in the key)
    partial(typical, row_spans(typical, typical, kv_len) if spans_given else None)
    _TUNED.add(shape_key)


@torch.library.custom_op("dschat::decode_attention", mutates_args=())
def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float) -> torch.Tensor:
    """softmax(q k^T * scaling + mask) v for q of shape (B, H, 1, D) and k/v of (B, H_kv, L, D); ``mask`` is None or
    a boolean (B or 1, 1, 1, L) (True: attend). Returns (B, 1, H, D) in the query's dtype, contiguous (the layout
    transformers' attention functions return). A torch custom op, so ``torch.compile`` keeps it as one opaque call."""
    return launch(query, key, value, mask, scaling)


@decode_attention.register_fake
def _(query, key, value, mask, scaling):
    batch, num_heads, _, head_dim = query.shape
    return query.new_empty((batch, 1, num_heads, head_dim))


@triton.jit
def _write_kernel(Keys, Values, NewKeys, NewValues, Position,
                  stride_kb, stride_kh, stride_kn, stride_kd,
                  stride_vb, stride_vh, stride_vn, stride_vd,
                  stride_nkb, stride_nkh, stride_nkd,
                  stride_nvb, stride_nvh, stride_nvd,
                  num_heads, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // num_heads
    h = bh % num_heads
    position = tl.load(Position)
    d = tl.arange(0, D_PAD)
    ok = d < HEAD_DIM
    k = tl.load(NewKeys + b * stride_nkb + h * stride_nkh + d * stride_nkd, mask=ok)
    v = tl.load(NewValues + b * stride_nvb + h * stride_nvh + d * stride_nvd, mask=ok)
    b, h = b.to(tl.int64), h.to(tl.int64)  # 64-bit offsets into the cache
    tl.store(Keys + b * stride_kb + h * stride_kh + position * stride_kn + d * stride_kd, k, mask=ok)
    tl.store(Values + b * stride_vb + h * stride_vh + position * stride_vn + d * stride_vd, v, mask=ok)


@torch.library.custom_op("dschat::write_token_kv", mutates_args=("keys", "values"))
def write_token_kv(keys: torch.Tensor, values: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor,
                   position: torch.Tensor) -> None:
    """``keys[:, :, position] = new_keys[:, :, 0]`` (and the same for values) for a static cache (B, H, L, D), the
    slot read from the 0-dim device tensor ``position``: one kernel where ``index_copy_`` takes two slow ones and the
    index tensor two more."""
    batch, num_heads, _, head_dim = new_keys.shape
    _write_kernel[(batch * num_heads,)](
        keys, values, new_keys, new_values, position,
        keys.stride(0), keys.stride(1), keys.stride(2), keys.stride(3),
        values.stride(0), values.stride(1), values.stride(2), values.stride(3),
        new_keys.stride(0), new_keys.stride(1), new_keys.stride(3),
        new_values.stride(0), new_values.stride(1), new_values.stride(3),
        num_heads, HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim), num_warps=1)
