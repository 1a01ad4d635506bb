"""The decode step's projections alone (one layer, batch B rows of one token): each projection as the model calls it
(cuBLAS through ``F.linear``) against the projections that read the same input fused into one GEMM (q/k/v; gate/up),
to decide whether fusing them is worth it. Timed as CUDA graphs (``decode_attention.time_us``).

    python bench/decode_gemm.py                      # OPT-1.3B and Qwen2.5-7B shapes, B=64
    python bench/decode_gemm.py --batches 16,64,128

Prints microseconds per call and the bandwidth the weights were read at; writes JSON to $OUT when set.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_attention import time_us  # noqa: E402
from results import write_json  # noqa: E402

# name: (input features, [(output features of each projection sharing that input)], bias)
SHAPES = {
    "opt-1.3b": {"qkv": (2048, [2048, 2048, 2048], True), "out": (2048, [2048], True),
                 "fc1": (2048, [8192], True), "fc2": (8192, [2048], True), "lm_head": (2048, [50272], False)},
    "qwen2.5-7b": {"qkv": (3584, [3584, 512, 512], True), "o": (3584, [3584], False),
                   "gate_up": (3584, [18944, 18944], False), "down": (18944, [3584], False),
                   "lm_head": (3584, [152064], False)},
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="opt-1.3b,qwen2.5-7b")
    p.add_argument("--batches", default="64")
    p.add_argument("--json", default="decode_gemm.json")
    args = p.parse_args()
    rows = []
    for model in args.models.split(","):
        for batch in map(int, args.batches.split(",")):
            for name, (fin, outs, bias) in SHAPES[model].items():
                x = torch.randn(batch, fin, dtype=torch.bfloat16, device="cuda")
                ws = [torch.randn(o, fin, dtype=torch.bfloat16, device="cuda") * 0.02 for o in outs]
                bs = [torch.randn(o, dtype=torch.bfloat16, device="cuda") if bias else None for o in outs]
                nbytes = sum(w.numel() for w in ws) * 2
                variants = {"separate": lambda: [F.linear(x, w, b) for w, b in zip(ws, bs)]}
                if len(ws) > 1:
                    w_cat = torch.cat(ws)
                    b_cat = torch.cat(bs) if bias else None
                    variants["fused"] = lambda: F.linear(x, w_cat, b_cat).split(outs, dim=-1)
                for label, fn in variants.items():
                    us = time_us(fn)
                    row = {"model": model, "batch": batch, "projection": name, "variant": label, "us": us,
                           "weight_MB": nbytes / 1e6, "TBps": nbytes / us / 1e6}
                    rows.append(row)
                    print(f"{model:<12}{batch:>5}  {name:<8}{label:<10}{us:>9.1f} us{nbytes / 1e6:>9.1f} MB"
                          f"{row['TBps']:>7.2f} TB/s", flush=True)
    write_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
