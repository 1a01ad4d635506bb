"""Decode attention alone: dschat's Triton kernel (several launch tunings) against SDPA as transformers calls it, for
one decode step's attention of one layer over a static cache (batch B, cache of L slots of which F are filled, the
rest masked, as in the middle of a 256 + 256 generation).

    python bench/decode_attention.py                       # OPT-1.3B and Qwen2.5-7B head layouts, B=64, L=512, F=384
    python bench/decode_attention.py --layouts opt-1.3b --filled 256,384,512     # how each tiling scales with the fill

The autotuned row is the engine's launch: it tunes each shape once, on a 3/4-filled cache, whatever F is.

    python bench/decode_attention.py --cold --splits default,2,4,8,16   # caches from memory; parts per (row, head)

``--cold`` gives each timed call as many layers' caches as overflow the L2 several times (one layer of the 7B shape,
34 MB at B=64, otherwise stays in the L2 between calls, which the model's 28 layers never allow). ``--splits`` times
the engine's tile candidates with each number of parts per (row, key/value head) ("default": the engine's choice).

Prints microseconds per call and the bandwidth the visible keys/values were read at; writes JSON to $OUT when set.
"""
import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from results import write_json  # noqa: E402

LAYOUTS = {"opt-1.3b": (32, 32, 64), "qwen2.5-7b": (28, 4, 128)}  # query heads, key/value heads, head dim


def time_us(fn, calls=50, replays=10):
    """GPU time per call: ``calls`` calls captured in one CUDA graph (as the decode step runs them), replayed, so
    Python's launch overhead is not what is measured."""
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
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


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


def tunings(splits, triton_decode):
    """The launch tunings to time: the tile grid, or (``splits`` given) the engine's candidates x each split count."""
    if not splits:
        return [triton_decode.Tuning(block=block, num_stages=stages, num_warps=warps)
                for block, stages, warps in itertools.product((32, 64, 128), (1, 2, 3), (4, 8))]
    return [triton_decode.Tuning(block=c.kwargs["BLOCK"], num_stages=c.num_stages, num_warps=c.num_warps,
                                 splits=None if s == "default" else int(s))
            for c in triton_decode.CONFIGS for s in splits.split(",")]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layouts", default="opt-1.3b,qwen2.5-7b")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--cache", type=int, default=512)
    p.add_argument("--filled", default="384", help="filled slots, comma-separated")
    p.add_argument("--cold", action="store_true", help="caches from memory, not the L2 (see above)")
    p.add_argument("--splits", default="", help="e.g. default,2,4,8: sweep parts per (row, head) over the engine's "
                                                "tile candidates instead of the tile grid")
    p.add_argument("--json", default="decode_attention.json")
    args = p.parse_args()
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

        def record(label, fn, out=None):
            """``fn(k, v)`` timed per layer: over every copy of the cache in turn."""
            us = time_us(lambda: [fn(*kv) for kv in caches]) / copies
            row = {"layout": name, "filled": filled, "variant": label, "us": us, "visible_TBps": visible_bytes / us / 1e6,
                   "max_abs_error": None if out is None else (out.float() - reference.float()).abs().max().item()}
            rows.append(row)
            print(json.dumps(row), flush=True)

        record("sdpa", lambda k, v: sdpa_as_transformers(q, k, v, mask))
        for tuning in tunings(args.splits, triton_decode):
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
        for r in [x for x in mine if not x["variant"].startswith("triton block")] + mine[:5]:
            print(f"{r['layout']:<12}{filled:>7}  {r['variant']:<48}{r['us']:>8.1f}{r['visible_TBps']:>7.2f}")
    write_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
