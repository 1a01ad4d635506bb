"""Decode attention alone: dschat's Triton kernel (several launch tunings) against SDPA as transformers calls it, for
one decode step's attention of one layer over a static cache (batch B, cache of L slots of which F are filled, the
rest masked, as in the middle of a 256 + 256 generation).

    python bench/decode_attention.py                       # OPT-1.3B and Qwen2.5-7B head layouts, B=64, L=512, F=384
    python bench/decode_attention.py --layouts opt-1.3b --filled 256,384,512     # how each tiling scales with the fill

The autotuned row is the engine's launch: it tunes each shape once, on a 3/4-filled cache, whatever F is.

    python bench/decode_attention.py --cold --splits default,2,4,8,16   # caches from memory; parts per (row, head)
    python bench/decode_attention.py --cold --stages 1,2,3,4,5 --probes  # deeper pipelines; what the mask and the
                                                                         # softmax cost against plain reads

``--probes`` adds rows that bound the kernel from below: the same kernel on the filled slots without a mask (the scan and
the per-tile mask loads left out), with and without the fast path for a visible span without holes
(``triton_decode.CONTIGUOUS_FAST_PATH``; the tenth session's logs call them "holes=2" and "holes=0"), a Triton
kernel that only reads the same tiles in the same order and sums them (the access pattern's ceiling), and a flat
read of as many bytes (the device's read ceiling).

``--cold`` gives each timed call as many layers' caches as overflow the L2 several times (one layer of the 7B shape,
34 MB at B=64, otherwise stays in the L2 between calls, which the model's 28 layers never allow). ``--splits`` times
the engine's tile candidates with each number of parts per (row, key/value head) ("default": the engine's choice).

Prints microseconds per call and the bandwidth the visible keys/values were read at; writes JSON to $OUT when set.
"""
import argparse
import dataclasses
import functools
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from results import (check_filled, json_name, list_flag, positive_error, require_cuda, unknown_name,  # noqa: E402
                     write_json)

LAYOUTS = {"opt-1.3b": (32, 32, 64), "qwen2.5-7b": (28, 4, 128)}  # query heads, key/value heads, head dim


def time_us(fn, calls=50, replays=10, repeats=1):
    """GPU time per call: ``calls`` calls captured in one CUDA graph (as the decode step runs them), replayed, so
    Python's launch overhead is not what is measured; the median of ``repeats`` timings of ``replays`` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (calls * replays))
    return sorted(times)[len(times) // 2]


def cold_copies(nbytes, at_least=1):
    """How many copies of ``nbytes`` of data overflow the L2 cache four times: a timed call that walks through them
    reads from memory, as a model's 24-28 layers do, rather than from the L2."""
    return max(at_least, -(-4 * torch.cuda.get_device_properties(0).L2_cache_size // nbytes))


def sdpa_as_transformers(q, k, v, mask):
    """transformers' SDPA path for a one-token query: grouped heads packed onto their key/value head."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        q = q.reshape(q.shape[0], k.shape[1], group, q.shape[-1])
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def tunings(splits, triton_decode, stages=(1, 2, 3)):
    """The launch tunings to time: the tile grid, or (``splits`` given) the engine's candidates x each split count."""
    if not splits:
        return [triton_decode.Tuning(block=block, num_stages=n, num_warps=warps)
                for block, n, warps in itertools.product((32, 64, 128), stages, (4, 8))]
    return [triton_decode.Tuning(block=c.kwargs["BLOCK"], num_stages=c.num_stages, num_warps=c.num_warps,
                                 splits=None if s == "default" else int(s))
            for c in triton_decode.CONFIGS for s in splits.split(",")]


@functools.cache
def _read_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def tiles(K, V, Out, stride_b, stride_h, stride_n, num_heads, filled, HEAD_DIM: tl.constexpr,
              BLOCK: tl.constexpr):
        """Each (row, head) reads its first ``filled`` key and value slots in tiles, as the attention does."""
        bh = tl.program_id(0)
        base = (bh // num_heads).to(tl.int64) * stride_b + (bh % num_heads).to(tl.int64) * stride_h
        d = tl.arange(0, HEAD_DIM)
        acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
        for start in range(0, filled, BLOCK):
            n = start + tl.arange(0, BLOCK)
            ok = (n < filled)[:, None]
            offsets = base + n[:, None] * stride_n + d[None, :]
            acc += tl.load(K + offsets, mask=ok, other=0.0).to(tl.float32)
            acc += tl.load(V + offsets, mask=ok, other=0.0).to(tl.float32)
        tl.store(Out + bh, tl.sum(tl.sum(acc, axis=1), axis=0))

    @triton.jit
    def flat(X, Out, n, BLOCK: tl.constexpr, PER_PROGRAM: tl.constexpr):
        """A contiguous read: each program sums PER_PROGRAM tiles of BLOCK elements."""
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], tl.float32)
        for i in range(PER_PROGRAM):
            offsets = (pid * PER_PROGRAM + i).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(X + offsets, mask=offsets < n, other=0.0).to(tl.float32)
        tl.store(Out + pid, tl.sum(acc, axis=0))

    return tiles, flat


def probe_rows(record, q, caches, mask, filled, dim, triton_decode, stages):
    """The lower bounds of ``--probes`` (see the module's docstring)."""
    tiles, flat = _read_kernels()
    batch, kv_heads = caches[0][0].shape[:2]
    for n in stages:
        tuning = triton_decode.Tuning(block=64, num_stages=n, num_warps=4)
        record(f"probe: no mask, filled slots only, block=64 stages={n}",
               lambda k, v, t=tuning: triton_decode.launch(q, k[:, :, :filled], v[:, :, :filled], None, dim ** -0.5, t))
        for fast in (False, True):
            record(f"probe: mask, {'contiguous fast path' if fast else 'per-tile mask loads'}, block=64 stages={n}",
                   lambda k, v, t=dataclasses.replace(tuning, contiguous_fast_path=fast): triton_decode.launch(
                       q, k, v, mask, dim ** -0.5, t))
    sums = torch.empty(batch * kv_heads, dtype=torch.float32, device="cuda")
    for block, warps, n in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
        record(f"probe: tile reads only, block={block} warps={warps} stages={n}",
               lambda k, v, block=block, warps=warps, n=n: tiles[(batch * kv_heads,)](
                   k, v, sums, k.stride(0), k.stride(1), k.stride(2), kv_heads, filled, HEAD_DIM=dim, BLOCK=block,
                   num_warps=warps, num_stages=n))
    # as many contiguous bytes per call as the visible keys and values: the first `visible` elements of each copy
    visible = 2 * batch * kv_heads * filled * dim
    flats = [torch.cat([k.flatten(), v.flatten()])[:visible] for k, v in caches]
    block, per_program = 4096, 8
    out = torch.empty(-(-visible // (block * per_program)), dtype=torch.float32, device="cuda")
    record("probe: flat contiguous read", lambda x, _: flat[(out.numel(),)](x, out, visible, BLOCK=block,
                                                                          PER_PROGRAM=per_program, num_warps=8),
           caches=[(x, None) for x in flats])


def split_error(item):
    """A --splits item: "default" (the engine's own count) or a positive count of parts."""
    return None if item == "default" else positive_error("a count of parts per (row, head), or default")(item)


def main():
    from dschat.args import positive_int

    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--layouts", type=list_flag(unknown_name(LAYOUTS, "layout")), default="opt-1.3b,qwen2.5-7b")
    p.add_argument("--batch", type=positive_int, default=64)
    p.add_argument("--cache", type=positive_int, default=512)
    p.add_argument("--filled", type=list_flag(positive_error("a count of filled slots")), default="384",
                   help="filled slots, comma-separated")
    p.add_argument("--cold", action="store_true", help="caches from memory, not the L2 (see above)")
    p.add_argument("--splits", type=list_flag(split_error), default=None,
                   help="e.g. default,2,4,8: sweep parts per (row, head) over the engine's tile candidates instead of "
                        "the tile grid")
    p.add_argument("--stages", type=list_flag(positive_error("a pipeline depth")), default="1,2,3",
                   help="pipeline depths of the tile grid, comma-separated")
    p.add_argument("--probes", action="store_true", help="lower bounds: no mask, plain reads (see above)")
    p.add_argument("--json", type=json_name, default="decode_attention.json")
    args = p.parse_args()
    check_filled(p, [int(n) for n in args.filled.split(",")], args.cache)
    require_cuda()
    from dschat.hybrid_engine import triton_decode

    rows = []
    cases = [(name, int(filled)) for name in args.layouts.split(",") for filled in args.filled.split(",")]
    for name, filled in cases:
        heads, kv_heads, dim = LAYOUTS[name]
        torch.manual_seed(0)
        q = torch.randn(args.batch, 1, heads, dim, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
        kv_bytes = 2 * args.batch * kv_heads * args.cache * dim * 2
        copies = cold_copies(kv_bytes) if args.cold else 1
        caches = [[torch.randn(args.batch, kv_heads, args.cache, dim, dtype=torch.bfloat16, device="cuda")
                   for _ in range(2)] for _ in range(copies)]
        k, v = caches[0]
        mask = torch.zeros(args.batch, 1, 1, args.cache, dtype=torch.bool, device="cuda")
        mask[..., :filled] = True
        visible_bytes = 2 * args.batch * kv_heads * filled * dim * 2
        reference = sdpa_as_transformers(q, k, v, mask).reshape(args.batch, heads, 1, dim).transpose(1, 2)

        def record(label, fn, out=None, caches=caches):
            """``fn(k, v)`` timed per layer: over every copy of the cache in turn."""
            us = time_us(lambda: [fn(*kv) for kv in caches]) / len(caches)
            row = {"layout": name, "filled": filled, "variant": label, "us": us, "visible_TBps": visible_bytes / us / 1e6,
                   "max_abs_error": None if out is None else (out.float() - reference.float()).abs().max().item()}
            rows.append(row)
            print(json.dumps(row), flush=True)

        record("sdpa", lambda k, v: sdpa_as_transformers(q, k, v, mask))
        stages = tuple(int(n) for n in args.stages.split(","))
        if args.probes:
            probe_rows(record, q, caches, mask, filled, dim, triton_decode, stages)
        for tuning in tunings(args.splits, triton_decode, stages):
            try:
                out = triton_decode.launch(q, k, v, mask, dim ** -0.5, tuning)
                label = f"triton block={tuning.block} stages={tuning.num_stages} warps={tuning.num_warps}"
                record(label + (f" splits={tuning.splits}" if tuning.splits else ""),
                       lambda k, v, tuning=tuning: triton_decode.launch(q, k, v, mask, dim ** -0.5, tuning), out)
            except Exception as error:  # noqa: BLE001 - e.g. out of shared memory for a large tile
                print(f"{name} {tuning}: {type(error).__name__}: {str(error)[:200]}", flush=True)
        out = triton_decode.decode_attention(q, k, v, mask, dim ** -0.5)
        record("triton autotuned (the engine's)", lambda k, v: triton_decode.decode_attention(q, k, v, mask, dim ** -0.5),
               out)

    print(f"\n{'layout':<12}{'filled':>7}  {'variant':<48}{'us':>8}{'TB/s':>7}")
    for name, filled in cases:
        mine = sorted((r for r in rows if (r["layout"], r["filled"]) == (name, filled)), key=lambda r: r["us"])
        tiled = [x for x in mine if x["variant"].startswith("triton block")]
        for r in [x for x in mine if not x["variant"].startswith(("triton block", "probe: tile"))] + tiled[:5] + \
                [x for x in mine if x["variant"].startswith("probe: tile")][:3]:
            print(f"{r['layout']:<12}{filled:>7}  {r['variant']:<48}{r['us']:>8.1f}{r['visible_TBps']:>7.2f}")
    write_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
