"""Does a hand-fused decode layer with programmatic dependent launch (PDL) close the gap to the floor?

Sessions 8-13 measured the decode step's parts one at a time: cuBLAS reads the 8-34 MB projections of an
OPT-1.3B-shaped model at 30-65% of the copy bandwidth when 64 rows are decoded, and between the ~15 kernels of each
layer (norms, adds, the KV write, ...) the GPU drains one kernel's last wave before the next one starts. PDL (Hopper)
lets the next kernel be launched while the current one finishes: its programs start, read what does not depend on
the previous kernel (here: the next projection's first weight tiles, into the L2), and wait (``gdc_wait``) for the
previous kernel's writes only where they need them.

This bench builds one OPT-1.3B-shaped decode step (24 pre-LayerNorm layers, B rows, a static cache of ``--cache``
slots with ``--filled`` of them visible; distinct weights and caches per layer, so nothing stays in the L2) in
several ways and times each as a CUDA graph:

* ``torch_eager``: ``F.layer_norm``, ``F.linear`` (cuBLAS), the engine's KV write and Triton attention, adds, ReLU:
  the engine's decode layer without compile.
* ``torch_compiled``: the same layer function under ``torch.compile`` (inductor fuses the norms, adds and ReLU; the
  attention and the KV write stay the engine's custom ops), as the engine's ``compile`` option does.
* ``fused``: seven Triton kernels per layer, the element-wise work in the GEMMs' epilogues: LayerNorm; q/k/v GEMM
  whose epilogue writes k and v straight into the cache; attention; out GEMM + bias + residual; LayerNorm; fc1 +
  bias + ReLU; fc2 + bias + residual (split-K, summed by the last program of each slice).
* ``fused_pdl_*``: the same kernels launched with PDL: ``wait`` waits first thing; ``early`` also lets the next
  kernel launch as soon as this one's programs have all started; ``pf<P>`` prefetches the first P K-tiles of each
  GEMM program's weights into the L2 before waiting.

Every variant's output is compared with ``torch_eager``'s (bf16 tolerance: the GEMMs sum in other orders). Writes
JSON to $OUT when set.

    python bench/pdl_chain.py
"""
import argparse
import json
import os
import re
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from decode_attention import time_us  # noqa: E402
from results import check_filled, json_name, list_flag, require_cuda, write_json  # noqa: E402

HIDDEN, FFN, HEADS, HEAD_DIM, LAYERS = 2048, 8192, 32, 64, 24  # OPT-1.3B
EPS = 1e-5
PLAIN, RELU, RESIDUAL, QKV_TO_CACHE = 0, 1, 2, 3  # GEMM epilogues
# (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) per projection. "base": the eighth session's best skinny tilings
# (decode_gemm.py --cold, one kernel at a time); "wide": 128-256 programs per projection, each over a wider slice of
# output features (fewer re-reads of the activations from the L2) and a part of K.
TILINGS = {
    "base": {"qkv": (64, 128, 1, 4, 4), "out": (32, 128, 1, 4, 4), "fc1": (64, 128, 1, 4, 4), "fc2": (32, 128, 4, 4, 4)},
    # the best of each projection's --sweep on the PDL + TMA chain (2026-12-01, B=64)
    "tuned": {"qkv": (64, 128, 1, 4, 6), "out": (16, 128, 1, 4, 6), "fc1": (64, 128, 1, 4, 4),
              "fc2": (64, 128, 4, 4, 4)},
    "wide": {"qkv": (128, 128, 4, 8, 4), "out": (64, 128, 4, 4, 4), "fc1": (128, 128, 2, 8, 4),
             "fc2": (64, 128, 4, 4, 4)},
}


@triton.jit
def _pdl_enter(PDL: tl.constexpr, EARLY: tl.constexpr):
    """Wait for the previous kernel's writes (a no-op without PDL); with EARLY let the next kernel launch now."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _layer_norm_kernel(X, W, B, Y, stride_x, stride_y, N, eps, BLOCK: tl.constexpr, PDL: tl.constexpr,
                       EARLY: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)  # parameters: safe to read before the wait
    b = tl.load(B + cols, mask=ok, other=0.0).to(tl.float32)
    _pdl_enter(PDL, EARLY)
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    mean = tl.sum(x, 0) / N
    xc = tl.where(ok, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 0) / N + eps)
    tl.store(Y + row * stride_y + cols, (xc * rstd * w + b).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _linear_kernel(X, W, XDesc, WDesc, Bias, Res, Y, KC, VC, Position, Partial, Counter, Dummy,
                   M, N, K, stride_xm, stride_wn, stride_ym, stride_rm, stride_cb, stride_ch, stride_cn,
                   SECTION: tl.constexpr, HEAD_DIM: tl.constexpr, EPILOGUE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                   PDL: tl.constexpr, EARLY: tl.constexpr, PREFETCH: tl.constexpr, TMA: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    w_rows = W + n[:, None].to(tl.int64) * stride_wn
    k_per_split = K // SPLIT_K
    k_begin = pid_k * k_per_split
    if PDL and PREFETCH > 0:
        # The weights do not depend on the previous kernel: start their first tiles towards the L2 while it finishes.
        line = tl.arange(0, PREFETCH * BLOCK_K // 64)  # 64 bf16 per 128-byte line
        r = tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                      [w_rows + k_begin + line[None, :] * 64], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(Dummy + pid_n, tl.sum(tl.sum(r, 1), 0))
    _pdl_enter(PDL, EARLY)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
        if TMA:  # bulk asynchronous copies (Hopper's tensor memory accelerator) into shared memory
            x = XDesc.load([0, k0])
            w = WDesc.load([pid_n * BLOCK_N, k0])
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None], other=0.0)
            w = tl.load(w_rows + k[None, :])
        acc += tl.dot(x, tl.trans(w))
    if SPLIT_K > 1:
        # Publish this part; the slice's last program to arrive sums every part and runs the epilogue.
        part = Partial + pid_k * BLOCK_M * N + m[:, None] * N + n[None, :]
        tl.store(part, acc)
        arrived = tl.atomic_add(Counter + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            for s in tl.static_range(SPLIT_K):
                if s != pid_k:
                    acc += tl.load(Partial + s * BLOCK_M * N + m[:, None] * N + n[None, :], cache_modifier=".cg")
            tl.atomic_xchg(Counter + pid_n, 0)  # ready for the next launch (or graph replay)
            _epilogue(acc, m, n, m_ok, Bias, Res, Y, KC, VC, Position, stride_ym, stride_rm, stride_cb, stride_ch,
                      stride_cn, pid_n, SECTION, HEAD_DIM, EPILOGUE, BLOCK_N)
    else:
        _epilogue(acc, m, n, m_ok, Bias, Res, Y, KC, VC, Position, stride_ym, stride_rm, stride_cb, stride_ch,
                  stride_cn, pid_n, SECTION, HEAD_DIM, EPILOGUE, BLOCK_N)


@triton.jit
def _epilogue(acc, m, n, m_ok, Bias, Res, Y, KC, VC, Position, stride_ym, stride_rm, stride_cb, stride_ch, stride_cn,
              pid_n, SECTION: tl.constexpr, HEAD_DIM: tl.constexpr, EPILOGUE: tl.constexpr, BLOCK_N: tl.constexpr):
    acc += tl.load(Bias + n).to(tl.float32)[None, :]
    if EPILOGUE == 1:  # RELU
        acc = tl.maximum(acc, 0.0)
    if EPILOGUE == 2:  # RESIDUAL
        acc += tl.load(Res + m[:, None] * stride_rm + n[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
    if EPILOGUE == 3:  # QKV_TO_CACHE: q to Y, k and v into the cache's slot `position` (B, H, L, D)
        section = (pid_n * BLOCK_N) // SECTION  # BLOCK_N divides SECTION: one program, one of q / k / v
        if section == 0:
            tl.store(Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty), mask=m_ok[:, None])
        else:
            c = n - section * SECTION
            position = tl.load(Position).to(tl.int64)
            offsets = (m[:, None].to(tl.int64) * stride_cb + (c // HEAD_DIM)[None, :] * stride_ch
                       + position * stride_cn + (c % HEAD_DIM)[None, :])
            if section == 1:
                tl.store(KC + offsets, acc.to(KC.dtype.element_ty), mask=m_ok[:, None])
            else:
                tl.store(VC + offsets, acc.to(VC.dtype.element_ty), mask=m_ok[:, None])
    else:
        tl.store(Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty), mask=m_ok[:, None])


@triton.jit
def _attention_kernel(QKV, KC, VC, O, Position, Lo, stride_qm, stride_cb, stride_ch, stride_cn, stride_om,
                      scale_log2, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr, EARLY: tl.constexpr, HAS_LO: tl.constexpr = False):
    """One (row, head) per program over slots [lo, position]: the engine's unsplit fast path for one query head per
    key/value head (query padded to 16 rows for tl.dot, as the engine's kernel does). ``lo``: the row's first
    visible slot from ``Lo`` (B,) with HAS_LO (left padding given, instead of the engine's scan of the mask), else 0."""
    bh = tl.program_id(0)
    b = bh // HEADS
    h = bh % HEADS
    _pdl_enter(PDL, EARLY)
    length = tl.load(Position) + 1
    lo = tl.load(Lo + b) if HAS_LO else 0
    g = tl.arange(0, 16)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(QKV + b * stride_qm + h * HEAD_DIM + g[:, None] * 0 + d[None, :], mask=(g == 0)[:, None], other=0.0)
    base = b.to(tl.int64) * stride_cb + h.to(tl.int64) * stride_ch
    m_i = tl.full([16], float("-inf"), tl.float32)
    l_i = tl.zeros([16], tl.float32)
    acc = tl.zeros([16, HEAD_DIM], tl.float32)
    for start in range((lo // BLOCK) * BLOCK, length, BLOCK):
        slot = start + tl.arange(0, BLOCK)
        ok = (slot >= lo) & (slot < length)
        offsets = base + slot[:, None] * stride_cn + d[None, :]
        k = tl.load(KC + offsets, mask=ok[:, None], other=0.0)
        v = tl.load(VC + offsets, mask=ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(O + b * stride_om + h * HEAD_DIM + g[:, None] * 0 + d[None, :], out.to(O.dtype.element_ty),
             mask=(g == 0)[:, None])


_WORKSPACES = {}


def _tiling_for(n, k, tilings):
    """The projection whose shape (n, k) is: OPT-1.3B's four have distinct shapes."""
    name = {(3 * HIDDEN, HIDDEN): "qkv", (HIDDEN, HIDDEN): "out", (FFN, HIDDEN): "fc1", (HIDDEN, FFN): "fc2"}[(n, k)]
    return tilings[name]


@torch.library.custom_op("bench::tma_linear", mutates_args=())
def tma_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, pdl: bool) -> torch.Tensor:
    """``F.linear`` for a decode step's rows by the fused chain's GEMM kernel (TMA loads, plain epilogue), as one
    opaque op for torch.compile: what a model-agnostic engine could put in place of cuBLAS."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, k = x.shape
    n = weight.shape[0]
    bn, bk, split, warps, stages = _tiling_for(n, k, TILINGS["base"])
    block_m = max(16, triton.next_power_of_2(rows))
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    key = (n, k, split, block_m)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = (torch.empty(split, block_m, n, dtype=torch.float32, device=x.device),
                            torch.zeros(max(1, n // bn), dtype=torch.int32, device=x.device),
                            torch.zeros(1 << 16, dtype=torch.int32, device=x.device))
    partial, counter, dummy = _WORKSPACES[key]
    _linear_kernel[(n // bn, split)](
        x, weight, TensorDescriptor.from_tensor(x, [block_m, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]),
        bias, y, y, y, y, counter, partial, counter, dummy, rows, n, k, x.stride(0), weight.stride(0), y.stride(0),
        0, 0, 0, 0, SECTION=n, HEAD_DIM=HEAD_DIM, EPILOGUE=PLAIN, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk,
        SPLIT_K=split, PDL=pdl, EARLY=pdl, PREFETCH=2 if pdl else 0, TMA=True, num_warps=warps, num_stages=stages,
        launch_pdl=pdl)
    return y


@tma_linear.register_fake
def _(x, weight, bias, pdl):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("bench::simple_attention", mutates_args=())
def simple_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """The fused chain's attention kernel (no PDL) on q of (B, HIDDEN): for the compiled layer, to separate the
    attention kernel's share of the fused chain's gain from the fusion's and PDL's."""
    return _simple_attention(q, keys, values, position, None)


def _simple_attention(q, keys, values, position, lo):
    o = torch.empty_like(q)
    _attention_kernel[(q.shape[0] * HEADS,)](
        q, keys, values, o, position, lo if lo is not None else position, q.stride(0), keys.stride(0),
        keys.stride(1), keys.stride(2), o.stride(0), HEAD_DIM ** -0.5 * 1.4426950408889634, HEADS=HEADS,
        HEAD_DIM=HEAD_DIM, BLOCK=64, num_warps=4, num_stages=3, PDL=False, EARLY=False, HAS_LO=lo is not None)
    return o


@simple_attention.register_fake
def _(q, keys, values, position):
    return torch.empty_like(q)


@torch.library.custom_op("bench::span_attention", mutates_args=())
def span_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor,
                   lo: torch.Tensor) -> torch.Tensor:
    """The chain's attention over [lo[b], position]: each row's left padding given as a (B,) tensor."""
    return _simple_attention(q, keys, values, position, lo)


@span_attention.register_fake
def _(q, keys, values, position, lo):
    return torch.empty_like(q)


@torch.library.custom_op("bench::engine_attention_tuned", mutates_args=())
def engine_attention_tuned(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The engine's attention kernel with the chain's tile (64 slots, 3 stages, 4 warps) instead of its autotuning."""
    from dschat.hybrid_engine import triton_decode

    batch = q.shape[0]
    query = q.view(batch, 1, HEADS, HEAD_DIM).transpose(1, 2)
    return triton_decode.launch(query, keys, values, mask, HEAD_DIM ** -0.5,
                                triton_decode.Tuning(block=64, num_stages=3, num_warps=4)).reshape(batch, HIDDEN)


@engine_attention_tuned.register_fake
def _(q, keys, values, mask):
    return torch.empty_like(q)


class FusedLayers:
    """The seven-kernel decode layer; ``pdl``: None (plain launches) or (early, prefetch_tiles); ``tma``: the GEMMs
    load through tensor descriptors."""

    def __init__(self, layers, batch, position, pdl, tilings="base", tma=False, attention_block=64, attention_warps=4,
                 attention_stages=3, engine_attention_mask=None):
        self.layers, self.batch, self.position, self.pdl = layers, batch, position, pdl
        self.engine_attention_mask = engine_attention_mask  # not None: the engine's attention kernel (no PDL wait)
        self.tilings, self.tma = TILINGS[tilings], tma
        self.attention = (attention_block, attention_warps, attention_stages)
        dev = position.device
        self.dummy = torch.zeros(1 << 16, dtype=torch.int32, device=dev)
        block_m = max(16, triton.next_power_of_2(batch))
        self.block_m = block_m
        self.workspace = {}
        for name, (bn, _, split, _, _) in self.tilings.items():
            if split > 1:
                n = layers[0][name][0].shape[0]
                self.workspace[name] = (torch.empty(split, block_m, n, dtype=torch.float32, device=dev),
                                        torch.zeros(n // bn, dtype=torch.int32, device=dev))
        dtype = layers[0]["qkv"][0].dtype
        new = lambda n: torch.empty(batch, n, dtype=dtype, device=dev)  # noqa: E731
        self.buffers = [{"ln1": new(HIDDEN), "q": new(HIDDEN), "o": new(HIDDEN), "h1": new(HIDDEN),
                         "ln2": new(HIDDEN), "f": new(FFN), "h2": new(HIDDEN)} for _ in layers]

    def _flags(self):
        if self.pdl is None:
            return dict(PDL=False, EARLY=False), 0, False
        early, prefetch = self.pdl
        return dict(PDL=True, EARLY=early), prefetch, True

    def _norm(self, x, w, b, y):
        flags, _, launch_pdl = self._flags()
        _layer_norm_kernel[(self.batch,)](x, w, b, y, x.stride(0), y.stride(0), HIDDEN, EPS,
                                          BLOCK=triton.next_power_of_2(HIDDEN), num_warps=8, launch_pdl=launch_pdl,
                                          **flags)

    def _linear(self, name, x, layer, y, epilogue, res=None, cache=None):
        weight, bias = layer[name]
        n, k = weight.shape
        bn, bk, split, warps, stages = self.tilings[name]
        assert n % bn == 0 and k % (bk * split) == 0
        if self.tma:
            from triton.tools.tensor_descriptor import TensorDescriptor

            x_desc = TensorDescriptor.from_tensor(x, [self.block_m, bk])
            w_desc = TensorDescriptor.from_tensor(weight, [bn, bk])
        else:
            x_desc, w_desc = x, weight  # placeholders, never read
        partial, counter = self.workspace.get(name, (y, self.dummy))
        kc, vc = cache if cache is not None else (y, y)
        cache_strides = kc.stride()[:3] if cache is not None else (0, 0, 0)
        flags, prefetch, launch_pdl = self._flags()
        _linear_kernel[(n // bn, split)](
            x, weight, x_desc, w_desc, bias, res if res is not None else y, y, kc, vc, self.position, partial, counter, self.dummy,
            self.batch, n, k, x.stride(0), weight.stride(0), y.stride(0), res.stride(0) if res is not None else 0,
            *cache_strides,
            SECTION=HIDDEN, HEAD_DIM=HEAD_DIM, EPILOGUE=epilogue, BLOCK_M=self.block_m, BLOCK_N=bn, BLOCK_K=bk,
            SPLIT_K=split, PREFETCH=prefetch, TMA=self.tma, num_warps=warps, num_stages=stages, launch_pdl=launch_pdl, **flags)

    def _attend(self, q, cache, o):
        kc, vc = cache
        if self.engine_attention_mask is not None:
            from dschat.hybrid_engine import triton_decode

            query = q.view(self.batch, 1, HEADS, HEAD_DIM).transpose(1, 2)
            o.copy_(triton_decode.decode_attention(query, kc, vc, self.engine_attention_mask, HEAD_DIM ** -0.5)
                    .reshape(self.batch, HIDDEN))
            return
        flags, _, launch_pdl = self._flags()
        block, warps, stages = self.attention
        _attention_kernel[(self.batch * HEADS,)](
            q, kc, vc, o, self.position, self.position, q.stride(0), kc.stride(0), kc.stride(1), kc.stride(2),
            o.stride(0),
            HEAD_DIM ** -0.5 * 1.4426950408889634, HEADS=HEADS, HEAD_DIM=HEAD_DIM, BLOCK=block, num_warps=warps,
            num_stages=stages, launch_pdl=launch_pdl, **flags)

    def __call__(self, x):
        h = x
        for layer, buf in zip(self.layers, self.buffers):
            self._norm(h, *layer["ln1"], buf["ln1"])
            self._linear("qkv", buf["ln1"], layer, buf["q"], QKV_TO_CACHE, cache=layer["kv"])
            self._attend(buf["q"], layer["kv"], buf["o"])
            self._linear("out", buf["o"], layer, buf["h1"], RESIDUAL, res=h)
            self._norm(buf["h1"], *layer["ln2"], buf["ln2"])
            self._linear("fc1", buf["ln2"], layer, buf["f"], RELU)
            self._linear("fc2", buf["f"], layer, buf["h2"], RESIDUAL, res=buf["h1"])
            h = buf["h2"]
        return h


def torch_layer(h, ln1_w, ln1_b, qkv_w, qkv_b, out_w, out_b, ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b, keys, values,
                position, mask, linear=F.linear, attention=None):
    """The engine's OPT decode layer in torch ops (the engine's KV write and attention as custom ops)."""
    from dschat.hybrid_engine import triton_decode

    batch = h.shape[0]
    qkv = linear(F.layer_norm(h, (HIDDEN,), ln1_w, ln1_b, EPS), qkv_w, qkv_b)
    q, k, v = (t.view(batch, HEADS, 1, HEAD_DIM) for t in qkv.split(HIDDEN, dim=-1))
    triton_decode.write_token_kv(keys, values, k, v, position)
    if attention is None:
        o = triton_decode.decode_attention(q, keys, values, mask, HEAD_DIM ** -0.5).reshape(batch, HIDDEN)
    else:
        o = attention(q.reshape(batch, HIDDEN), keys, values, position, mask)
    h = h + linear(o, out_w, out_b)
    f = torch.relu(linear(F.layer_norm(h, (HIDDEN,), ln2_w, ln2_b, EPS), fc1_w, fc1_b))
    return h + linear(f, fc2_w, fc2_b)


def torch_step(layer_fn, x, layers, position, mask):
    h = x
    for layer in layers:
        h = layer_fn(h, *layer["ln1"], *layer["qkv"], *layer["out"], *layer["ln2"], *layer["fc1"], *layer["fc2"],
                     *layer["kv"], position, mask)
    return h


def build_layers(batch, cache):
    def w(n, k):
        return torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02

    def vec(n, scale=0.02, mean=0.0):
        return (torch.randn(n, dtype=torch.bfloat16, device="cuda") * scale + mean).to(torch.bfloat16)

    layers = []
    for _ in range(LAYERS):
        kv = [torch.randn(batch, HEADS, cache, HEAD_DIM, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
        layers.append({"ln1": (vec(HIDDEN, 0.1, 1.0), vec(HIDDEN)), "qkv": (w(3 * HIDDEN, HIDDEN), vec(3 * HIDDEN)),
                       "out": (w(HIDDEN, HIDDEN), vec(HIDDEN)), "ln2": (vec(HIDDEN, 0.1, 1.0), vec(HIDDEN)),
                       "fc1": (w(FFN, HIDDEN), vec(FFN)), "fc2": (w(HIDDEN, FFN), vec(HIDDEN)), "kv": kv})
    return layers


def variants(names, layers, batch, position, mask, lo):
    """(name, step function) for each requested variant."""
    for name in names:
        if name == "torch_eager":
            yield name, lambda x: torch_step(torch_layer, x, layers, position, mask)
        elif name.startswith("torch_compiled"):
            # torch_compiled[_pdl][_tmalinear][_simpleattn|_spanattn|_engtuned][_scan]: inductor's kernels with PDL;
            # F.linear -> tma_linear (PDL as inductor's); the engine's attention -> the chain's (lo 0 or given per
            # row) or the engine's kernel with the chain's tile
            import functools

            import torch._inductor.config as inductor_config

            parts = name.split("_")[2:]
            pdl = "pdl" in parts
            if pdl and not hasattr(inductor_config.triton, "enable_pdl"):
                print(f"{name}: this torch's inductor has no triton.enable_pdl; skipped", flush=True)
                continue
            options = {}
            if "tmalinear" in parts:
                options["linear"] = lambda x, w, b, p=pdl: tma_linear(x, w, b, p)
            if "simpleattn" in parts:  # slots [0, position]: ignores left padding (timing only when there is some)
                options["attention"] = lambda q, k, v, p, m: simple_attention(q, k, v, p)
            if "spanattn" in parts:
                options["attention"] = lambda q, k, v, p, m, lo=lo: span_attention(q, k, v, p, lo)
            if "engtuned" in parts:
                options["attention"] = lambda q, k, v, p, m: engine_attention_tuned(q, k, v, m)
            layer = functools.partial(torch_layer, **options)
            from dschat.hybrid_engine import triton_decode

            # _scan: the engine's attention scans each row's mask in every program (as before the fourteenth session)
            triton_decode.SPANS_PER_FORWARD = "scan" not in parts
            torch._dynamo.reset()
            with inductor_config.patch({"triton.enable_pdl": True} if pdl else {}):
                compiled = torch.compile(layer, fullgraph=True, dynamic=False)
                for _ in range(2):  # compile now, under the patched config
                    torch_step(compiled, torch.zeros(batch, HIDDEN, dtype=torch.bfloat16, device="cuda"), layers,
                               position, mask)
            yield name, lambda x, c=compiled: torch_step(c, x, layers, position, mask)
            triton_decode.SPANS_PER_FORWARD = True
        elif name.startswith("sweep:"):
            # sweep:<projection>:<bn>,<bk>,<split>,<warps>,<stages> on the fused PDL + TMA chain
            _, proj, spec = name.split(":")
            TILINGS["sweep"] = dict(TILINGS["base"], **{proj: tuple(int(v) for v in spec.split(","))})
            yield name, FusedLayers(layers, batch, position, (True, 2), "sweep", True)
        elif name.startswith("fused"):
            # fused[_pdl_{wait,early}[_pf<P>]][_wide|_tuned][_tma][_engattn], e.g. fused_pdl_early_pf2_tuned_tma
            parts = name.split("_")[1:]
            tilings = next((t for t in ("wide", "tuned") if t in parts), "base")
            tma = "tma" in parts
            pdl = None
            if parts and parts[0] == "pdl":
                prefetch = next((int(x[2:]) for x in parts if x.startswith("pf")), 0)
                pdl = (parts[1] == "early", prefetch)
            yield name, FusedLayers(layers, batch, position, pdl, tilings, tma,
                                    engine_attention_mask=mask if "engattn" in parts else None)
        else:
            raise SystemExit(f"unknown variant {name}")


VARIANT_FORMS = ("torch_eager, torch_compiled[_pdl][_tmalinear][_simpleattn|_spanattn|_engtuned][_scan] or "
                 "fused[_pdl_wait|_pdl_early][_pf<P>][_wide|_tuned][_tma][_engattn]")
TORCH_COMPILED_OPTIONS = ("pdl", "tmalinear", "simpleattn", "spanattn", "engtuned", "scan")
FUSED_OPTIONS = ("pdl", "wait", "early", "wide", "tuned", "tma", "engattn")  # and pf<P>
DEFAULT_VARIANTS = ("torch_eager,torch_compiled,torch_compiled_pdl,fused,fused_pdl_wait,fused_pdl_early,"
                    "fused_pdl_early_pf2,fused_pdl_early_pf4,fused_pdl_wait_pf2")


def variant_error(name):
    """None for a --variants item that ``variants`` runs as named, else what is wrong with it: ``variants`` reads only
    the options it knows, so a misspelt one ran as another variant under the misspelt name (fused_pld_early: no
    PDL)."""
    words = name.split("_")
    if name == "torch_eager":
        return None
    if name.startswith("sweep:"):  # (split at its tiling's commas by --variants before: never ran from it)
        return "the sweep's variants come from --sweep"
    if words[:2] == ["torch", "compiled"]:
        return options_error(words[2:], TORCH_COMPILED_OPTIONS, ("simpleattn", "spanattn", "engtuned"))
    if words[0] == "fused":
        return fused_error(words[1:])
    return f"no such variant (a variant is {VARIANT_FORMS})"


def options_error(options, known, exclusive=()):
    """What is wrong with a variant's ``options`` (its words after the kind), each of ``known``; None if nothing."""
    if unknown := next((o for o in options if o not in known), None):
        return f"unknown option {unknown!r} (a variant is {VARIANT_FORMS})"
    if len(set(options)) < len(options):
        return "an option given twice"
    if sum(o in exclusive for o in options) > 1:
        return f"at most one of {', '.join('_' + o for o in exclusive)}"
    return None


def fused_error(options):
    """``variants`` reads _pdl only first, and then its next word as early or else wait; _pf<P> only with _pdl."""
    prefetch = [o for o in options if re.fullmatch(r"pf\d+", o)]
    error = options_error([o for o in options if o not in prefetch], FUSED_OPTIONS, ("wide", "tuned"))
    if error:
        return error
    pdl = options[:2] in (["pdl", "wait"], ["pdl", "early"])
    if not pdl and {"pdl", "wait", "early"} & set(options):
        return "_pdl is followed by _wait or _early, right after fused (e.g. fused_pdl_early_pf2)"
    if "wait" in options and "early" in options:
        return "at most one of _wait, _early"
    if prefetch and not pdl:
        return "_pf<P> needs _pdl_wait or _pdl_early (e.g. fused_pdl_early_pf2)"
    if len(prefetch) > 1:
        return "at most one _pf<P>"
    return None


SWEEP = {
    "qkv": ["64,128,1,4,6", "32,128,1,4,4", "32,128,1,4,6", "64,256,1,4,3", "128,128,1,8,4", "64,128,2,4,4"],
    "out": ["32,128,1,4,6", "16,128,1,4,6", "32,256,1,4,3", "32,128,2,4,4", "64,128,2,4,4", "16,128,1,2,8"],
    "fc1": ["64,128,1,4,6", "32,128,1,4,6", "128,128,1,8,4", "64,256,1,4,3", "32,256,1,4,3"],
    "fc2": ["32,128,2,4,4", "32,128,4,4,6", "64,128,4,4,4", "32,256,4,4,3", "32,128,8,4,4", "16,128,4,4,6"],
}


def main():
    from dschat.args import non_negative_int, positive_int

    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--batch", type=positive_int, default=64)
    p.add_argument("--cache", type=positive_int, default=512)
    p.add_argument("--filled", type=positive_int, default=384)
    p.add_argument("--variants", type=list_flag(variant_error), default=DEFAULT_VARIANTS,
                   help=f"Comma-separated; each {VARIANT_FORMS}.")
    p.add_argument("--left_pad", type=non_negative_int, default=0, help="masked slots before every other row's prompt")
    p.add_argument("--calls", type=positive_int, default=5)
    p.add_argument("--replays", type=positive_int, default=20)
    p.add_argument("--json", type=json_name, default="pdl_chain.json")
    p.add_argument("--sweep", action="store_true", help="after the variants: each projection's tiling in turn")
    args = p.parse_args()
    check_filled(p, [args.filled], args.cache)
    if args.left_pad >= args.filled:  # (every visible slot of those rows masked: no attention to time)
        p.error(f"--left_pad {args.left_pad}: at most --filled {args.filled} - 1")
    require_cuda()
    from generation import copy_bandwidth

    torch.manual_seed(0)
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}", flush=True)
    layers = build_layers(args.batch, args.cache)
    position = torch.tensor(args.filled - 1, device="cuda")  # the slot this step writes; it attends to [0, position]
    mask = torch.zeros(args.batch, 1, 1, args.cache, dtype=torch.bool, device="cuda")
    mask[..., :args.filled] = True
    x = torch.randn(args.batch, HIDDEN, dtype=torch.bfloat16, device="cuda")
    weight_bytes = sum(layer[k][0].numel() * 2 for layer in layers for k in ("qkv", "out", "fc1", "fc2"))
    kv_bytes = LAYERS * 2 * args.batch * HEADS * args.filled * HEAD_DIM * 2
    bandwidth = copy_bandwidth()
    floor_us = (weight_bytes + kv_bytes) / bandwidth * 1e6
    reference, rows = None, []
    names = args.variants.split(",")
    if args.sweep:
        names += [f"sweep:{proj}:{spec}" for proj, specs in SWEEP.items() for spec in specs]
    lo = torch.zeros(args.batch, dtype=torch.int32, device="cuda")
    lo[::2] = args.left_pad
    mask[::2, ..., :args.left_pad] = False  # every other row left-padded, as a collator pads prompts
    for name, step in variants(names, layers, args.batch, position, mask, lo):
        out = step(x).clone()
        torch.cuda.synchronize()
        if reference is None:
            reference = out
        err = (out.float() - reference.float()).abs().max().item()
        scale = reference.float().abs().max().item()
        us = time_us(lambda s=step: s(x), args.calls, args.replays, repeats=3)
        row = {"variant": name, "us_per_step": us, "us_per_layer": us / LAYERS, "x_floor": us / floor_us,
               "max_abs_err": err, "ref_max_abs": scale, "close": bool(err <= 0.02 * scale + 1e-2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\ncopy bandwidth {bandwidth / 1e12:.2f} TB/s; B={args.batch}, cache {args.cache} slots, "
          f"{args.filled} visible; floor {floor_us:.1f} us per step ({floor_us / LAYERS:.2f} per layer)")
    print(f"{'variant':>30} {'us/step':>9} {'us/layer':>9} {'x floor':>8} {'max err':>8} close")
    for r in rows:
        print(f"{r['variant']:>30} {r['us_per_step']:9.1f} {r['us_per_layer']:9.2f} {r['x_floor']:8.3f} "
              f"{r['max_abs_err']:8.4f} {r['close']}")
    write_json(args.json, {"batch": args.batch, "cache": args.cache, "filled": args.filled, "left_pad": args.left_pad,
                           "copy_bandwidth": bandwidth, "floor_us": floor_us, "rows": rows,
                           "torch": torch.__version__, "triton": triton.__version__})


if __name__ == "__main__":
    main()
