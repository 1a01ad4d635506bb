"""The decode step's projections alone (one layer, batch B rows of one token): each projection as the model calls it
(cuBLAS through ``F.linear``) against the projections that read the same input fused into one GEMM (q/k/v; gate/up),
to decide whether fusing them is worth it; also the input as the model has it, (B, 1, K) ("3d"), and split-K done
by hand for the single projections ("splitS": S batched GEMMs over K/S each, summed in fp32), to see whether the
skinny GEMMs that read few output tiles (out, fc2, o, down) gain from more parallelism. Timed as CUDA graphs
(``decode_attention.time_us``).

    python bench/decode_gemm.py                      # OPT-1.3B and Qwen2.5-7B shapes, B=64
    python bench/decode_gemm.py --batches 16,64,128

Prints microseconds per call and the bandwidth the weights were read at; writes JSON to $OUT when set.

``--cold``: the weights come from memory, not from the L2 cache, as in the model (a layer's weights are long evicted
by the other layers when the next step reads them): each timed call runs the projection over enough copies of its
weights to overflow the L2 several times (the default mode repeats one matrix, and matrices of up to ~40 MB then
stay in the L2, so it overstates what the model sees). It compares cuBLAS with the skinny Triton GEMM of
``bench/skinny_gemm.py`` over a grid of tilings, and with cuBLAS on the weights stored transposed ("kn").

    python bench/decode_gemm.py --cold
    python bench/decode_gemm.py --cold --no_skinny   # cuBLAS only: both weight layouts
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_attention import cold_copies, time_us  # noqa: E402
from results import batch_error, json_name, list_flag, require_cuda, unknown_name, write_json  # noqa: E402

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


def skinny_tilings():
    from skinny_gemm import Tiling

    grid = [Tiling(block_n=bn, block_k=bk, split_k=split, num_warps=warps, num_stages=4)
            for bn in (32, 64, 128) for bk in (64, 128) for split in (1, 2, 4, 8)
            for warps in ((4, 8) if bn == 128 else (4,))]
    return {f"skinny_n{t.block_n}_k{t.block_k}_s{t.split_k}_w{t.num_warps}": t for t in grid}


def cold_rows(model, batch, name, fin, outs, bias, tilings):
    """cuBLAS against the skinny GEMM (each tiling), the weights read from memory: see the module's docstring."""
    from skinny_gemm import skinny_linear

    n = sum(outs)
    nbytes = n * fin * 2
    copies = cold_copies(nbytes, at_least=2)
    x = torch.randn(batch, fin, dtype=torch.bfloat16, device="cuda")
    ws = [torch.randn(n, fin, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
    b = torch.randn(n, dtype=torch.bfloat16, device="cuda") if bias else None
    reference = F.linear(x, ws[0], b)
    # The same weights stored transposed, (K, N) contiguous: cuBLAS then sees the other layout (NN instead of TN) and
    # its heuristics may pick another kernel (e.g. none with split-K for the 7B shape's down projection).
    wts = [w.t().contiguous() for w in ws]
    variants = {"cublas_cold": lambda: [F.linear(x, w, b) for w in ws],
                "cublas_cold_kn": lambda: [torch.addmm(b, x, wt) if b is not None else x @ wt for wt in wts],
                "cublas_hot": lambda: [F.linear(x, ws[0], b) for _ in ws]}
    for label, tiling in tilings.items():
        variants[label] = lambda tiling=tiling: [skinny_linear(x, w, b, tiling) for w in ws]
    rows = []
    for label, fn in variants.items():
        try:
            err = (fn()[0].float() - reference.float()).abs().max().item()
            us = time_us(fn, calls=4, replays=5) / copies
        except Exception as e:  # noqa: BLE001 - a tiling that does not fit (shared memory) is reported, not fatal
            print(f"{model:<12}{batch:>5}  {name:<8}{label:<26} failed: {type(e).__name__}: {str(e)[:80]}")
            continue
        rows.append({"model": model, "batch": batch, "projection": name, "variant": label, "us": us,
                     "weight_MB": nbytes / 1e6, "TBps": nbytes / us / 1e6, "max_abs_err": err, "copies": copies})
    best = min((r for r in rows if r["variant"].startswith("skinny")), key=lambda r: r["us"], default=None)
    for r in rows:
        if r["variant"].startswith("cublas") or r is best:
            print(f"{model:<12}{batch:>5}  {name:<8}{r['variant']:<26}{r['us']:>8.1f} us{r['weight_MB']:>8.1f} MB"
                  f"{r['TBps']:>7.2f} TB/s  err {r['max_abs_err']:.3g}", flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--models", type=list_flag(unknown_name(SHAPES, "model shape")), default="opt-1.3b,qwen2.5-7b")
    p.add_argument("--batches", type=list_flag(batch_error), default="64")
    p.add_argument("--cold", action="store_true", help="weights from memory: cuBLAS against the skinny Triton GEMM")
    p.add_argument("--no_skinny", action="store_true", help="with --cold: cuBLAS only (no Triton tilings to build)")
    p.add_argument("--json", type=json_name, default="decode_gemm.json")
    args = p.parse_args()
    require_cuda()
    rows = []
    if args.cold:
        tilings = {} if args.no_skinny else skinny_tilings()
        for model in args.models.split(","):
            for batch in map(int, args.batches.split(",")):
                for name, (fin, outs, bias) in SHAPES[model].items():
                    if name != "lm_head":
                        rows += cold_rows(model, batch, name, fin, outs, bias, tilings)
        write_json(args.json, {"args": vars(args), "rows": rows})
        return
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
