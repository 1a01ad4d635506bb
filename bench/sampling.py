"""The decode step's token choice alone, for B rows of a V-token vocabulary, timed as CUDA graphs:

- ``softmax race``: the race on probabilities (``argmax(softmax(float(logits) / T) / E)``), before the ninth session;
- ``log race``: torch's exponential race in log space (``argmax(logits - T log E)``, ``sampling.exponential_race``);
- ``log race + logp``: that, then the tokens' log-probs from an fp32 ``log_softmax`` (what a PPO decode step did
  before the fifteenth session);
- ``one pass``, ``one pass + logp``: ``triton_sampling.select_tokens`` (tokens; tokens and log-sum-exp, the log-prob
  gathered from it), as ``sampling.choose_tokens`` runs it;
- with ``--top_p P`` and/or ``--top_k K``: ``filtered torch + logp`` (torch's filters, ``sampling.filtered_logits``,
  then torch's race), ``sorted + one pass + logp`` (torch's filters, then the one-pass race: the filtered step before
  the eighteenth session) and ``cut + one pass + logp`` (``triton_filters.row_cuts``, then the one-pass race
  masking by the cut, as it runs now for bf16 logits; top-k since the nineteenth session); the
  log-probs are the unfiltered logits' in each. Every row also reports by how many tokens the cut's kept count
  differs from torch's filters' (0 expected; fp32 sums in another order can move a cut by a token).

Also checks the one-pass draws: a chi-square of 2**20 draws from 16 tokens against softmax(logits / T).

    python bench/sampling.py                       # OPT-1.3B's and Qwen2.5-7B's vocabularies, B = 16, 64, 128
    python bench/sampling.py --top_p 0.9           # also the nucleus-filtered step, torch's race against the kernel's
    python bench/sampling.py --top_k 20 --top_p 0.8  # Qwen2.5-Instruct's generation_config
    python bench/sampling.py --sweep               # the one-pass kernel's LANES x PROGRAMS_PER_SM x NUM_WARPS
    python bench/sampling.py --cut_sweep --top_p 0.9 --batches 1,16,64,128   # top-p alone: one program per row, or split how
    python bench/sampling.py --top_k_sweep --top_k 50 --batches 64  # top-k's TOPK_CHUNK x TOPK_NUM_WARPS x TOPK_NARROW_KEYS

Prints microseconds per sampled token and the seconds 255 decode steps spend in it; writes JSON to $OUT when set.
"""
import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from decode_attention import time_us  # noqa: E402
from results import (batch_error, list_flag, require_cuda, temperature_flag, top_p_flag, unknown_name,  # noqa: E402
                     write_json)

from dschat.hybrid_engine import triton_filters, triton_sampling  # noqa: E402
from dschat.hybrid_engine.sampling import (choose_tokens, filtered_logits,  # noqa: E402
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


def sorted_one_pass(logits, temperature, top_k, top_p):
    """torch's filters (a sort for top-p alone, topk otherwise), then the one-pass race on the filtered fp32 copy
    (its log-sum-exp is not the model's: the log-probs from a log_softmax), as before the eighteenth session."""
    filtered = filtered_logits(logits, temperature, top_k, top_p)
    tokens, _ = triton_sampling.select_tokens(filtered, 1.0)
    return tokens, token_log_probs(logits, tokens)


def cut_one_pass(logits, temperature, top_p, top_k=0):
    """The row cuts, then the one-pass race masking by them (log-probs from its unfiltered log-sum-exp): what
    ``sampling.choose_tokens`` runs for bf16 logits."""
    cuts = triton_filters.row_cuts(logits, temperature, top_p, top_k)
    tokens, lse = triton_sampling.select_tokens(logits, temperature, None, True, True, cuts)
    return tokens, logits.gather(-1, tokens[:, None]).squeeze(-1).float() - lse


def cut_count_difference(logits, temperature, top_p, top_k=0):
    """The most tokens by which the row cuts' kept count differs from torch's filter's in any row (0: the same in
    every row; fp32 sums in another order can move a cut whose mass lies within rounding of top_p)."""
    kept = triton_filters.kept(logits, *triton_filters.row_cuts(logits, temperature, top_p, top_k))
    theirs = torch.isfinite(filtered_logits(logits, temperature, top_k, top_p))
    return int((kept.sum(-1) - theirs.sum(-1)).abs().max())


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


def sweep_settings(module, names, settings, step, args, json_name):
    """``step(logits)`` timed per vocab and B under each setting of ``module``'s constants ``names`` (restored after)."""
    cases = list(itertools.product(args.vocabs.split(","), map(int, args.batches.split(","))))
    default = tuple(getattr(module, name) for name in names)
    rows = []
    print("".join(f"{name[:7]:>8}" for name in names) + "".join(f"{v[:4]}/{b:>3}".rjust(11) for v, b in cases))
    for setting in settings:
        for name, value in zip(names, setting):
            setattr(module, name, value)
        us = []
        for vocab, batch in cases:
            logits = torch.randn(batch, VOCABS[vocab], device="cuda", dtype=torch.bfloat16) * 4
            us.append(time_us(lambda: step(logits)))
        rows.append({**dict(zip(names, setting)), "us": us})
        mark = " (default)" if tuple(setting) == default else ""
        print("".join(f"{value:>8}" for value in setting) + "".join(f"{u:>11.1f}" for u in us) + mark)
    for name, value in zip(names, default):
        setattr(module, name, value)
    write_json(json_name, {"args": vars(args), "cases": cases, "rows": rows})


def sweep(args):
    """``one pass + logp`` under each launch setting of ``triton_sampling`` (module constants), per vocab and B."""
    sweep_settings(triton_sampling, ("LANES", "PROGRAMS_PER_SM", "NUM_WARPS"),
                   itertools.product((128, 256, 512, 1024), (2, 4, 8, 16), (4, 8)),
                   lambda logits: one_pass(logits, args.temperature, True), args, "sampling_sweep.json")


def cut_sweep(args):
    """``cut + one pass + logp`` for top-p alone: one program per row (SPLIT_TOP_P False, the eighteenth session's
    search) against the rows split over chunks under each SPLIT_CHUNK x SPLIT_FANOUT x SPLIT_NUM_WARPS x SPLIT_SUB."""
    split = [(True, *setting) for setting in itertools.product((4096, 8192), (4, 8), (8, 16), (512,))]
    sweep_settings(triton_filters, ("SPLIT_TOP_P", "SPLIT_CHUNK", "SPLIT_FANOUT", "SPLIT_NUM_WARPS", "SPLIT_SUB"),
                   [(False, 4096, 8, 8, 512), *split],
                   lambda logits: cut_one_pass(logits, args.temperature, args.top_p), args,
                   "sampling_cut_sweep.json")


def top_k_sweep(args):
    """``cut + one pass + logp`` under each setting of ``triton_filters``' top-k launches (TOPK_CHUNK x
    TOPK_NUM_WARPS x TOPK_NARROW_KEYS; with --top_k, and --top_p if wanted)."""
    sweep_settings(triton_filters, ("TOPK_CHUNK", "TOPK_NUM_WARPS", "TOPK_NARROW_KEYS"),
                   itertools.product((2048, 4096, 8192), (4, 8), (False, True)),
                   lambda logits: cut_one_pass(logits, args.temperature, args.top_p, args.top_k), args,
                   "sampling_top_k_sweep.json")


def main():
    from dschat.args import non_negative_int, positive_int

    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--vocabs", type=list_flag(unknown_name(VOCABS, "vocabulary")), default="opt-1.3b,qwen2.5-7b")
    p.add_argument("--batches", type=list_flag(batch_error), default="16,64,128")
    p.add_argument("--temperature", type=temperature_flag, default=1.0)
    p.add_argument("--top_p", type=top_p_flag, default=1.0, help="< 1: also time the nucleus-filtered step")
    p.add_argument("--top_k", type=non_negative_int, default=0, help="> 0: also time the top-k-filtered step")
    p.add_argument("--steps", type=positive_int, default=255,
                   help="decode steps a generation samples in (for the seconds)")
    p.add_argument("--sweep", action="store_true", help="time the one-pass kernel's launch settings instead")
    p.add_argument("--cut_sweep", action="store_true", help="time the row cuts' search settings instead (with --top_p)")
    p.add_argument("--top_k_sweep", action="store_true", help="time top-k's cut settings instead (with --top_k)")
    args = p.parse_args()
    require_cuda()
    if args.sweep:
        return sweep(args)
    if args.cut_sweep:
        return cut_sweep(args)
    if args.top_k_sweep:
        return top_k_sweep(args)
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
    filters_on = args.top_k > 0 or args.top_p < 1.0
    if filters_on:
        columns["filtered torch + logp"] = lambda x: filtered_torch_race_and_logp(x, args.temperature, **filters)
        columns["sorted + one pass + logp"] = lambda x: sorted_one_pass(x, args.temperature, **filters)
        columns["cut + one pass + logp"] = lambda x: cut_one_pass(x, args.temperature, args.top_p, args.top_k)
    print(f"{'vocab':<12}{'B':>5}" + "".join(f"{c:>26}" for c in columns) + f"{'saved s / gen':>15}")
    for name, batch in itertools.product(args.vocabs.split(","), map(int, args.batches.split(","))):
        logits = torch.randn(batch, VOCABS[name], device="cuda", dtype=torch.bfloat16) * 4
        us = {c: time_us(lambda: fn(logits)) for c, fn in columns.items()}
        differs = cut_count_difference(logits, args.temperature, args.top_p, args.top_k) if filters_on else None
        saved = (us["log race + logp"] - us["one pass + logp"]) * args.steps / 1e6
        rows.append(dict(vocab=name, batch=batch, us=us, saved_s_per_generation_with_logp=saved,
                         cut_count_difference=differs))
        print(f"{name:<12}{batch:>5}" + "".join(f"{v:>26.1f}" for v in us.values()) + f"{saved:>15.4f}"
              + ("" if differs is None else f"  cut's count differs by {differs}"))
    write_json("sampling.json", {"args": vars(args), "one_pass_chi_square": fits, "rows": rows})


if __name__ == "__main__":
    main()
