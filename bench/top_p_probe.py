"""Probe (session 17): top-p without sorting the vocabulary, against torch.sort. us per call, CUDA graphs."""
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from decode_attention import time_us  # noqa: E402

from dschat.hybrid_engine.sampling import filter_top_p  # noqa: E402


def monotone_keys(x):
    b = x.view(torch.int32).long()
    return torch.where(b >= 0, b + 2**31, 2**31 - 1 - (b & 0x7FFFFFFF))


def select(logits, top_p, digits=(11, 11, 10), double=False):
    logits = logits.float()
    B = logits.shape[0]
    if double:
        w = (logits.double() - logits.amax(-1, keepdim=True).double()).exp()
        mass = (w / w.sum(-1, keepdim=True) * 2.0**48).long()
    else:
        mass = (logits.softmax(-1).double() * 2.0**48).long()
    need = int(top_p * 2**48)
    key = monotone_keys(logits)
    prefix = torch.zeros(B, 1, dtype=torch.long, device=logits.device)
    above = torch.zeros(B, 1, dtype=torch.long, device=logits.device)
    shift = 32
    for bits in digits:
        shift -= bits
        digit = (key >> shift) & ((1 << bits) - 1)
        in_prefix = (key >> (shift + bits)) == prefix
        hist = torch.zeros(B, 1 << bits, dtype=torch.long, device=logits.device)
        hist.scatter_add_(1, digit, torch.where(in_prefix, mass, 0))
        at_or_above = hist.flip(-1).cumsum(-1).flip(-1) + above
        d = ((at_or_above >= need).sum(-1, keepdim=True) - 1).clamp(min=0)
        above = (at_or_above - hist).gather(1, d)
        prefix = (prefix << bits) | d
    tie = key == prefix
    q = mass.gather(1, tie.long().argmax(-1, keepdim=True))
    ties_kept = torch.where(q > 0, (need - above + q - 1) // q.clamp(min=1), tie.sum(-1, keepdim=True)).clamp(min=1)
    keep = (key > prefix) | (tie & (tie.cumsum(-1) <= ties_kept))
    return logits.masked_fill(~keep, float("-inf"))


def main():
    torch.manual_seed(0)
    cols = {
        "sorted (now)": lambda x: filter_top_p(x.float(), 0.9),
        "sort fp32 only": lambda x: torch.sort(x.float(), -1, descending=True),
        "sort bf16 only": lambda x: torch.sort(x, -1, descending=True),
        "select 11/11/10": lambda x: select(x, 0.9),
        "select 8x4": lambda x: select(x, 0.9, (8, 8, 8, 8)),
        "select 16/16": lambda x: select(x, 0.9, (16, 16)),
        "select 11/11/10 f64": lambda x: select(x, 0.9, double=True),
        "softmax only": lambda x: x.float().softmax(-1),
    }
    print(f"{'V':>7}{'B':>5}" + "".join(f"{c:>22}" for c in cols))
    for V, B in itertools.product((50272, 152064), (16, 64, 128)):
        x = torch.randn(B, V, device="cuda", dtype=torch.bfloat16) * 4
        ref = filter_top_p(x.float(), 0.9).isfinite()
        for name in ("select 11/11/10", "select 8x4", "select 16/16", "select 11/11/10 f64"):
            got = cols[name](x).isfinite()
            if not torch.equal(got.sum(-1), ref.sum(-1)):
                print("count mismatch", name, V, B, (got.sum(-1) - ref.sum(-1)).abs().max().item())
        print(f"{V:>7}{B:>5}" + "".join(f"{time_us(lambda: fn(x), calls=10):>22.1f}" for fn in cols.values()),
              flush=True)
    print("nucleus sizes at B=64 V=50272:", filter_top_p(x[:8].float(), 0.9).isfinite().sum(-1).tolist())


if __name__ == "__main__":
    main()
