"""The decode step's token choice alone, for B rows of a V-token vocabulary, timed as CUDA graphs:

- ``softmax race``: the race on probabilities (``argmax(softmax(float(logits) / T) / E)``), before the ninth session;
- ``log race``: torch's exponential race in log space (``argmax(logits - T log E)``, ``sampling.exponential_race``);
- ``log race + logp``: that, then the tokens' log-probs from an fp32 ``log_softmax`` (what a PPO decode step did
  before the fifteenth session);
- ``one pass``, ``one pass + logp``: ``triton_sampling.select_tokens`` (tokens; tokens and log-sum-exp, the log-prob
  gathered from it), as ``sampling.choose_tokens`` runs it;
- with ``--top_p P`` and/or ``--top_k K``, ``filtered torch + logp`` and ``filtered one pass + logp``: the logits
  filtered by torch's ops (``sampling.filtered_logits``), then torch's race or the one-pass kernel's (the log-probs of
  the unfiltered logits either way); and ``fp32 ranked + logp``: the same filters with the largest values ranked on
  the scaled fp32 copy of the logits (before the seventeenth session; now the bf16 logits are), then the one-pass race.

Also checks the one-pass draws: a chi-square of 2**20 draws from 16 tokens against softmax(logits / T).

    python bench/sampling.py                       # OPT-1.3B's and Qwen2.5-7B's vocabularies, B = 16, 64, 128
    python bench/sampling.py --top_p 0.9           # also the nucleus-filtered step, torch's race against the kernel's
    python bench/sampling.py --top_k 20 --top_p 0.8  # Qwen2.5-Instruct's generation_config
    python bench/sampling.py --sweep               # the one-pass kernel's LANES x PROGRAMS_PER_SM x NUM_WARPS

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

from dschat.hybrid_engine import triton_sampling  # noqa: E402
from dschat.hybrid_engine.sampling import (choose_tokens, filter_top_k_top_p, filtered_logits,  # noqa: E402
                                           sample_next_token, token_log_probs)

VOCABS = {"opt-1.3b": 50272, "qwen2.5-7b": 152064}


def race_on_probabilities(logits, temperature, generator=None):
    """The sampler before the ninth session: softmax, then the race on probabilities."""
    probs = (logits.float() / temperature).softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def torch_race_and_logp(logits, temperature):
    tokens = sample_next_token(logits, temperature, do_sample=True)
    return tokens, token_log_probs(logits, tokens)


def one_pass(logits, temperature, logprobs, top_k=0, top_p=1.0):
    return choose_tokens(logits, logits, temperature=temperature, do_sample=True, logprobs=logprobs, one_pass=True,
                         top_k=top_k, top_p=top_p)


def filtered_torch_race_and_logp(logits, temperature, top_k, top_p):
    return choose_tokens(logits, logits, temperature=temperature, top_k=top_k, top_p=top_p, do_sample=True,
                         logprobs=True)


def fp32_ranked(logits, temperature, top_k, top_p):
    """The filters as before the seventeenth session: the largest values ranked on the scaled fp32 copy."""
    return filter_top_k_top_p(logits.float() / temperature, top_k, top_p)


def fp32_ranked_one_pass(logits, temperature, top_k, top_p):
    """Those filters, then the one-pass race (log-probs of the unfiltered logits)."""
    filtered = fp32_ranked(logits, temperature, top_k, top_p)
    tokens, _ = choose_tokens(filtered, filtered, do_sample=True, one_pass=True)
    return tokens, token_log_probs(logits, tokens)


def one_pass_fit(temperature, draws=2**20, tokens=16):
    """Chi-square (tokens - 1 degrees of freedom) of the one-pass kernel's draws from one row's distribution."""
    logits = torch.linspace(-3, 3, tokens, device="cuda")[None]
    chosen, _ = triton_sampling.select_tokens(logits.expand(draws, -1).contiguous(), temperature,
                                              torch.Generator(device="cuda").manual_seed(0))
    counts = torch.bincount(chosen, minlength=tokens).double()
    expected = torch.softmax(logits[0].double() / temperature, -1) * draws
    return float(((counts - expected) ** 2 / expected).sum())


def wide_fit(vocab=152064, draws=2**22, buckets=64, sampler="one pass", chunk=2**13):
    """Draws from one bf16 row of a real vocabulary (randn x 4, as the timed rows; column 2, an EOS id, raised to 1%),
    each draw a row of a stride-0 batch: chi-square over the ``buckets`` - 1 likeliest tokens plus one bucket for the
    rest (``buckets`` - 1 dof), and column 2's count against its expectation."""
    torch.manual_seed(0)
    logits = torch.randn(1, vocab, device="cuda") * 4
    rest = torch.logsumexp(torch.cat([logits[0, :2], logits[0, 3:]]), 0)
    logits[0, 2] = rest + torch.log(torch.tensor(0.01 / 0.99))
    logits = logits.to(torch.bfloat16)
    probs = torch.softmax(logits[0].double(), -1)
    generator = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.zeros(vocab, dtype=torch.float64, device="cuda")
    for _ in range(draws // chunk):
        batch = logits.expand(chunk, -1)
        if sampler == "one pass":
            chosen, _ = triton_sampling.select_tokens(batch, 1.0, generator)
        else:
            chosen = sample_next_token(batch, 1.0, do_sample=True, generator=generator)
        counts += torch.bincount(chosen, minlength=vocab).double()
    top = torch.topk(probs, buckets - 1).indices
    observed = torch.cat([counts[top], (draws - counts[top].sum())[None]])
    expected = torch.cat([probs[top], (1 - probs[top].sum())[None]]) * draws
    return dict(draws=draws, chi_square=float(((observed - expected) ** 2 / expected).sum()), dof=buckets - 1,
                column2=int(counts[2]), column2_expected=float(probs[2] * draws))


def sweep(args):
    """``one pass + logp`` under each launch setting of ``triton_sampling`` (module constants), per vocab and B."""
    settings = list(itertools.product((128, 256, 512, 1024), (2, 4, 8, 16), (4, 8)))
    cases = list(itertools.product(args.vocabs.split(","), map(int, args.batches.split(","))))
    default = (triton_sampling.LANES, triton_sampling.PROGRAMS_PER_SM, triton_sampling.NUM_WARPS)
    rows = []
    print(f"{'LANES':>6}{'per SM':>7}{'warps':>6}" + "".join(f"{v[:4]}/{b:>3}".rjust(11) for v, b in cases))
    for lanes, per_sm, warps in settings:
        triton_sampling.LANES, triton_sampling.PROGRAMS_PER_SM, triton_sampling.NUM_WARPS = lanes, per_sm, warps
        us = []
        for name, batch in cases:
            logits = torch.randn(batch, VOCABS[name], device="cuda", dtype=torch.bfloat16) * 4
            us.append(time_us(lambda: one_pass(logits, args.temperature, True)))
        rows.append(dict(lanes=lanes, programs_per_sm=per_sm, num_warps=warps, us=us))
        mark = " (default)" if (lanes, per_sm, warps) == default else ""
        print(f"{lanes:>6}{per_sm:>7}{warps:>6}" + "".join(f"{u:>11.1f}" for u in us) + mark)
    triton_sampling.LANES, triton_sampling.PROGRAMS_PER_SM, triton_sampling.NUM_WARPS = default
    write_json("sampling_sweep.json", {"args": vars(args), "cases": cases, "rows": rows})


def main():
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--vocabs", default="opt-1.3b,qwen2.5-7b")
    p.add_argument("--batches", default="16,64,128")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top_p", type=float, default=1.0, help="< 1: also time the nucleus-filtered step")
    p.add_argument("--top_k", type=int, default=0, help="> 0: also time the top-k-filtered step")
    p.add_argument("--steps", type=int, default=255, help="decode steps a generation samples in (for the seconds)")
    p.add_argument("--sweep", action="store_true", help="time the one-pass kernel's launch settings instead")
    args = p.parse_args()
    if args.sweep:
        return sweep(args)
    fits = {t: one_pass_fit(t) for t in (1.0, 0.7)}
    print("one-pass draws, chi-square of 2**20 draws over 16 tokens (15 dof; p=0.001 at 37.7): "
          + ", ".join(f"T={t}: {v:.1f}" for t, v in fits.items()))
    # torch's race writes fp32 noise for every column: fewer draws, in smaller chunks
    wide = {"one pass": wide_fit(), "log race": wide_fit(draws=2**18, sampler="log race", chunk=2**12)}
    for name, fit in wide.items():
        print(f"{name}: {fit['draws']} draws from a 152064-token row, chi-square {fit['chi_square']:.1f} "
              f"({fit['dof']} dof; p=0.001 at 103.4), column 2 drawn {fit['column2']} times, expected "
              f"{fit['column2_expected']:.0f}")
    fits = {"16 tokens": fits, "152064 tokens": wide}
    rows = []
    columns = {"softmax race": lambda x: race_on_probabilities(x, args.temperature),
               "log race": lambda x: sample_next_token(x, args.temperature, do_sample=True),
               "log race + logp": lambda x: torch_race_and_logp(x, args.temperature),
               "one pass": lambda x: one_pass(x, args.temperature, False),
               "one pass + logp": lambda x: one_pass(x, args.temperature, True)}
    filters = dict(top_k=args.top_k, top_p=args.top_p)
    if args.top_k > 0 or args.top_p < 1.0:
        columns["filtered torch + logp"] = lambda x: filtered_torch_race_and_logp(x, args.temperature, **filters)
        columns["filtered one pass + logp"] = lambda x: one_pass(x, args.temperature, True, **filters)
        columns["fp32 ranked + logp"] = lambda x: fp32_ranked_one_pass(x, args.temperature, **filters)
    print(f"{'vocab':<12}{'B':>5}" + "".join(f"{c:>26}" for c in columns) + f"{'saved s / gen':>15}")
    for name, batch in itertools.product(args.vocabs.split(","), map(int, args.batches.split(","))):
        logits = torch.randn(batch, VOCABS[name], device="cuda", dtype=torch.bfloat16) * 4
        us = {c: time_us(lambda: fn(logits)) for c, fn in columns.items()}
        same = None
        if args.top_k > 0 or args.top_p < 1.0:  # both rankings keep as many tokens per row
            same = torch.equal(*(torch.isfinite(f(logits, args.temperature, **filters)).sum(-1)
                                 for f in (filtered_logits, fp32_ranked)))
        saved = (us["log race + logp"] - us["one pass + logp"]) * args.steps / 1e6
        rows.append(dict(vocab=name, batch=batch, us=us, saved_s_per_generation_with_logp=saved,
                         filters_keep_as_many_as_fp32_ranked=same))
        print(f"{name:<12}{batch:>5}" + "".join(f"{v:>26.1f}" for v in us.values()) + f"{saved:>15.4f}"
              + ("" if same is None else f"  kept as fp32 ranked: {same}"))
    write_json("sampling.json", {"args": vars(args), "one_pass_chi_square": fits, "rows": rows})


if __name__ == "__main__":
    main()
