"""An experiment: a skinny GEMM for the decode step's projections (Triton), ``y = x @ w.T (+ b)`` for a few rows.

The question: at decode a projection multiplies B (1-128) rows by a weight matrix read once from memory, and cuBLAS
reads the 8-33 MB matrices of a 1-2B model at only 50-65% of the copy bandwidth. Does a kernel in which each program
streams a narrow slice of the weights (``BLOCK_N`` output features, optionally a part of K) do better? Split-K parts
are summed by the slice's last program to finish (a per-slice arrival counter that this program resets, so one launch
does the whole GEMM and a CUDA graph can replay it).

The answer (``bench/decode_gemm.py --cold``, H200, 2026-11-30): no. Over a grid of tilings the best is within 3% of
cuBLAS for the large projections and slower for the small ones, so the engine keeps cuBLAS; this file stays as the
record (and for a better kernel to be compared against).

Launch shapes depend only on tensor shapes; the workspace and counters are allocated once per shape, before a graph
captures the call.
"""
import dataclasses
import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _skinny_kernel(X, W, Bias, Y, Partial, Counter, M, N, K,
                   stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                   HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_begin = pid_k * k_per_split
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_begin, tl.minimum(k_begin + k_per_split, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(X + m[:, None] * stride_xm + k[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + n[:, None] * stride_wn + k[None, :] * stride_wk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    out_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K > 1:
        # Publish this part; the slice's last program to arrive sums every part (its own from registers).
        part = Partial + pid_k * BLOCK_M * N + m[:, None] * N + n[None, :]
        tl.store(part, acc, mask=out_mask)
        arrived = tl.atomic_add(Counter + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            for s in tl.static_range(SPLIT_K):
                if s != pid_k:
                    acc += tl.load(Partial + s * BLOCK_M * N + m[:, None] * N + n[None, :], mask=out_mask,
                                   other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(Counter + pid_n, 0)  # ready for the next launch (or graph replay)
            if HAS_BIAS:
                acc += tl.load(Bias + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(Y + m[:, None] * stride_ym + n[None, :] * stride_yn, acc.to(Y.dtype.element_ty), mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(Bias + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + m[:, None] * stride_ym + n[None, :] * stride_yn, acc.to(Y.dtype.element_ty), mask=out_mask)


@dataclasses.dataclass(frozen=True)
class Tiling:
    block_n: int = 32  # output features per program
    block_k: int = 128
    split_k: int = 1  # programs per output slice, each over K / split_k
    num_warps: int = 4
    num_stages: int = 4


@functools.lru_cache(maxsize=None)
def _workspace(device, split_k, block_m, n):
    """fp32 partials and zeroed arrival counters for one shape, kept for the process (a captured graph reads them)."""
    partial = torch.empty((split_k, block_m, n), dtype=torch.float32, device=device)
    counter = torch.zeros((n,), dtype=torch.int32, device=device)  # one per output slice: at most n of them
    return partial, counter


def skinny_linear(x, weight, bias=None, tiling=Tiling()):
    """``F.linear(x, weight, bias)`` for x of at most 128 rows (any leading dims), by :func:`_skinny_kernel`."""
    *lead, k = x.shape
    x2 = x.reshape(-1, k)
    rows, n = x2.shape[0], weight.shape[0]
    if rows > 128:
        raise ValueError(f"skinny_linear is for decode steps of at most 128 rows, got {rows}")
    block_m = max(16, triton.next_power_of_2(rows))
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    split = tiling.split_k
    partial, counter = _workspace(x.device, split, block_m, n) if split > 1 else (y, y)
    grid = (triton.cdiv(n, tiling.block_n), split)
    _skinny_kernel[grid](
        x2, weight, bias if bias is not None else weight, y, partial, counter, rows, n, k,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
        BLOCK_M=block_m, BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k, SPLIT_K=split, HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32, num_warps=tiling.num_warps, num_stages=tiling.num_stages)
    return y.view(*lead, n)
