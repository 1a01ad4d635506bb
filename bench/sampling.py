"""The decode step's sampling alone: the exponential race as dschat computes it (``argmax(logits - T log E)``, no
softmax, bf16 logits promoted inside the subtraction) against the race on probabilities it replaced
(``argmax(softmax(float(logits) / T) / E)``), for B rows of a V-token vocabulary, timed as CUDA graphs.

    python bench/sampling.py                       # OPT-1.3B's and Qwen2.5-7B's vocabularies, B = 16, 64, 128

Prints microseconds per sampled token and the seconds 255 decode steps spend in it; writes JSON to $OUT when set.
"""
import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from decode_attention import time_us  # noqa: E402
from results import write_json  # noqa: E402

from dschat.hybrid_engine.sampling import sample_next_token  # noqa: E402

VOCABS = {"opt-1.3b": 50272, "qwen2.5-7b": 152064}


def race_on_probabilities(logits, temperature, generator=None):
    """The sampler before the ninth session: softmax, then the race on probabilities."""
    probs = (logits.float() / temperature).softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--vocabs", default="opt-1.3b,qwen2.5-7b")
    p.add_argument("--batches", default="16,64,128")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=255, help="decode steps a generation samples in (for the seconds)")
    args = p.parse_args()
    rows = []
    print(f"{'vocab':<12}{'B':>5}{'softmax race us':>17}{'log race us':>13}{'saved s / generation':>22}")
    for name, batch in itertools.product(args.vocabs.split(","), map(int, args.batches.split(","))):
        logits = torch.randn(batch, VOCABS[name], device="cuda", dtype=torch.bfloat16) * 4
        old = time_us(lambda: race_on_probabilities(logits, args.temperature))
        new = time_us(lambda: sample_next_token(logits, args.temperature, do_sample=True))
        row = dict(vocab=name, batch=batch, softmax_race_us=old, log_race_us=new,
                   saved_s_per_generation=(old - new) * args.steps / 1e6)
        rows.append(row)
        print(f"{name:<12}{batch:>5}{old:>17.1f}{new:>13.1f}{row['saved_s_per_generation']:>22.4f}")
    write_json("sampling.json", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
