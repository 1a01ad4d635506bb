"""The decode step's projections alone (one layer, batch B rows of one token): each projection as the model calls it
(cuBLAS through ``F.linear``) against the projections that read the same input fused into one GEMM (q/k/v; gate/up),
to decide whether fusing them is worth it; also the input as the model has it, (B, 1, K) ("3d"), and split-K done
by hand for the single projections ("splitS": S batched GEMMs over K/S each, summed in fp32), to see whether the
skinny GEMMs that read few output tiles (out, fc2, o, down) gain from more parallelism. Timed as CUDA graphs
(``decode_attention.time_us``).

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


def split_k(x, w, b, parts):
    """x @ w.T (+ b) as ``parts`` GEMMs over slices of K, run as one batched GEMM, summed in fp32."""
    rows, k = x.shape
    xs = x.view(rows, parts, k // parts).transpose(0, 1)  # (S, B, K/S)
    ws = w.view(w.shape[0], parts, k // parts).permute(1, 2, 0)  # (S, K/S, N), a transposed view
    try:
        partial = torch.bmm(xs, ws, out_dtype=torch.float32)
    except (TypeError, NotImplementedError):  # a torch or device without out_dtype
        partial = torch.bmm(xs, ws).float()
    out = partial.sum(0)
    return (out if b is None else out + b).to(x.dtype)


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
                variants = {"separate": lambda: [F.linear(x, w, b) for w, b in zip(ws, bs)],
                            "3d": lambda: [F.linear(x[:, None], w, b) for w, b in zip(ws, bs)]}
                if len(ws) == 1 and name != "lm_head":
                    for parts in (2, 4, 8):
                        if fin % parts == 0:
                            variants[f"split{parts}"] = lambda parts=parts: split_k(x, ws[0], bs[0], parts)
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
