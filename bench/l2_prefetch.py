"""Does prefetching the next projection's weights into the L2, on a second stream, speed up the decode step?

At 64 rows the decode GEMMs read their weights from memory at 1.3-2.8 TB/s (30-65% of copy bandwidth, eighth
session's ``decode_gemm.py --cold``) and run 20-40% faster when the weights are already in the L2. This bench builds
an OPT-1.3B-shaped decode step (24 layers of fused q/k/v, the engine's Triton attention over a 3/4-filled cache,
out, fc1 + ReLU, fc2; distinct weights and caches per layer, so nothing stays in the L2 between layers) and times it
as a CUDA graph with and without a side stream that reads the next projection's weights into the L2 while the
current one runs:

* ``none``: the projections and the attention alone (the baseline).
* ``chain``: while out runs, fc1's weights are prefetched; while fc1 runs, fc2's; while fc2 runs, the next layer's
  q/k/v. (Prefetching during the attention is a separate row: the attention streams ~200 MB of cache through the
  50 MB L2 and may evict what was fetched.)
* ``chain+out``: also out's weights while the attention runs.

Two ways to prefetch: ``asm`` (PTX ``prefetch.global.L2::evict_last``, one per 128-byte line: no data comes into the
SM) and ``load`` (a Triton kernel reads the weights with ``evict_last`` and sums them). ``--no_attention`` rows drop
the attention (the GEMM chain alone). Writes JSON to $OUT when set.

    python bench/l2_prefetch.py

The floor ("x floor") is the step's bytes (every weight, the filled cache) at the copy bandwidth that
``bench/generation.py`` measures. (The first run, 2026-12-01, timed a uint8 copy instead, 2.77 TB/s against 4.22, so
its "x floor" column is off; its times are not.)
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from decode_attention import time_us  # noqa: E402
from generation import copy_bandwidth  # noqa: E402
from results import check_filled, json_name, require_cuda, write_json  # noqa: E402

HIDDEN, FFN, HEADS, HEAD_DIM, LAYERS = 2048, 8192, 32, 64, 24  # OPT-1.3B
LINES_PER_PROGRAM = 1024  # 128-byte lines per prefetch program (128 KB)
LOAD_BLOCK = 8192         # elements per program of the load kernel (16 KB)


@triton.jit
def _prefetch_lines(ptr, dummy, LINES: tl.constexpr):
    pid = tl.program_id(0)
    line = pid * LINES + tl.arange(0, LINES)
    ptrs = ptr + line.to(tl.int64) * 64  # bf16: 64 elements per 128-byte line
    r = tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
    tl.store(dummy + pid, tl.sum(r, 0))


@triton.jit
def _touch(ptr, dummy, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    x = tl.load(ptr + pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK), eviction_policy="evict_last")
    tl.store(dummy + pid, tl.sum(x.to(tl.float32), 0))


class Prefetcher:
    def __init__(self, how):
        self.how = how
        self.stream = torch.cuda.Stream()
        self.dummy = torch.zeros(1 << 16, device="cuda")

    def __call__(self, weight):
        """Start reading ``weight`` into the L2 once the main stream's work so far is done; returns at once."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            n = weight.numel()
            if self.how == "asm":
                assert n % (64 * LINES_PER_PROGRAM) == 0
                _prefetch_lines[(n // (64 * LINES_PER_PROGRAM),)](weight, self.dummy, LINES=LINES_PER_PROGRAM)
            else:
                assert n % LOAD_BLOCK == 0
                _touch[(n // LOAD_BLOCK,)](weight, self.dummy, BLOCK=LOAD_BLOCK)

    def join(self):
        torch.cuda.current_stream().wait_stream(self.stream)


def build_layers(batch, cache, filled):
    def w(n, k):
        return torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02

    def b(n):
        return torch.randn(n, dtype=torch.bfloat16, device="cuda") * 0.02

    layers = []
    for _ in range(LAYERS):
        kv = [torch.randn(batch, HEADS, cache, HEAD_DIM, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
        layers.append({"qkv": (w(3 * HIDDEN, HIDDEN), b(3 * HIDDEN)), "out": (w(HIDDEN, HIDDEN), b(HIDDEN)),
                       "fc1": (w(FFN, HIDDEN), b(FFN)), "fc2": (w(HIDDEN, FFN), b(HIDDEN)), "kv": kv})
    mask = torch.zeros(batch, 1, 1, cache, dtype=torch.bool, device="cuda")
    mask[..., :filled] = True
    return layers, mask


def decode_step(x, layers, mask, attention, prefetch, schedule):
    from dschat.hybrid_engine import triton_decode

    batch = x.shape[0]
    h = x
    for i, layer in enumerate(layers):
        qkv = F.linear(h, *layer["qkv"])
        if attention:
            if prefetch and schedule == "chain+out":
                prefetch(layer["out"][0])
            q = qkv[:, :HIDDEN].view(batch, 1, HEADS, HEAD_DIM).transpose(1, 2)
            o = triton_decode.decode_attention(q, *layer["kv"], mask, HEAD_DIM ** -0.5).reshape(batch, HIDDEN)
        else:
            o = qkv[:, :HIDDEN].contiguous()
        if prefetch:
            prefetch(layer["fc1"][0])
        h = F.linear(o, *layer["out"])
        if prefetch:
            prefetch(layer["fc2"][0])
        f = torch.relu(F.linear(h, *layer["fc1"]))
        if prefetch:
            prefetch(layers[(i + 1) % len(layers)]["qkv"][0])
        h = F.linear(f, *layer["fc2"])
    if prefetch:
        prefetch.join()
    return h


def main():
    from dschat.args import positive_int

    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--batch", type=positive_int, default=64)
    p.add_argument("--cache", type=positive_int, default=512)
    p.add_argument("--filled", type=positive_int, default=384)
    p.add_argument("--json", type=json_name, default="l2_prefetch.json")
    args = p.parse_args()
    check_filled(p, [args.filled], args.cache)
    require_cuda()
    torch.manual_seed(0)
    layers, mask = build_layers(args.batch, args.cache, args.filled)
    x = torch.randn(args.batch, HIDDEN, dtype=torch.bfloat16, device="cuda")
    weight_bytes = sum(layer[k][0].numel() * 2 for layer in layers for k in ("qkv", "out", "fc1", "fc2"))
    kv_bytes = LAYERS * 2 * args.batch * HEADS * args.filled * HEAD_DIM * 2
    bandwidth = copy_bandwidth()
    rows = []
    for attention in (True, False):
        floor_us = ((weight_bytes + (kv_bytes if attention else 0)) / bandwidth) * 1e6
        reference = None
        for how, schedule in (("none", "none"), ("asm", "chain"), ("load", "chain"), ("asm", "chain+out"),
                              ("load", "chain+out")):
            if not attention and schedule == "chain+out":
                continue
            prefetch = None if how == "none" else Prefetcher(how)
            out = decode_step(x, layers, mask, attention, prefetch, schedule)
            torch.cuda.synchronize()
            if reference is None:
                reference = out
            same = bool(torch.equal(out, reference))  # a prefetch changes timing, never results
            us = time_us(lambda: decode_step(x, layers, mask, attention, prefetch, schedule), calls=5, replays=20)
            row = {"attention": attention, "prefetch": how, "schedule": schedule, "us_per_step": us,
                   "us_per_layer": us / LAYERS, "x_floor": us / floor_us, "floor_us": floor_us, "same_output": same}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\ncopy bandwidth {bandwidth / 1e12:.2f} TB/s; B={args.batch}, cache {args.cache} slots, {args.filled} filled")
    print(f"{'attention':>9} {'prefetch':>8} {'schedule':>10} {'us/step':>9} {'us/layer':>9} {'x floor':>8} same")
    for r in rows:
        print(f"{str(r['attention']):>9} {r['prefetch']:>8} {r['schedule']:>10} {r['us_per_step']:9.1f} "
              f"{r['us_per_layer']:9.2f} {r['x_floor']:8.3f} {r['same_output']}")
    write_json(args.json, {"batch": args.batch, "cache": args.cache, "filled": args.filled,
                           "copy_bandwidth": bandwidth, "rows": rows})


if __name__ == "__main__":
    main()
