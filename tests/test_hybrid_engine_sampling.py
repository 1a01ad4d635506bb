"""Sampling: on-device exponential race matches the filtered model distribution; fixed seeds reproduce."""
import itertools
import math
import sys
from pathlib import Path

import pytest
import torch
from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from hybrid_common import PAD, left_padded_batch, make_ds_engine, tiny_model  # noqa: E402

from dschat.hybrid_engine import HybridEngine, HybridEngineConfig  # noqa: E402
from dschat.hybrid_engine import sampling  # noqa: E402
from dschat.hybrid_engine.sampling import (apply_repetition_penalty, filter_top_k_top_p,  # noqa: E402
                                           filtered_logits, mark_seen,
                                           penalty_start, prompt_seen_tokens, sample_next_token)

SETTINGS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.6, 0, 1.0),  # temperature alone: applied inside the race, not by filtered_logits
    (0.7, 6, 1.0),
    (1.3, 0, 0.8),
    (0.8, 7, 0.9),
]


def _hf_filtered(logits, temperature, top_k, top_p):
    scores = TemperatureLogitsWarper(temperature)(None, logits.float())
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_filters_keep_the_same_tokens_as_hf_warpers(temperature, top_k, top_p):
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 3
    ours = filtered_logits(logits, temperature, top_k, top_p)
    theirs = _hf_filtered(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert torch.allclose(ours.softmax(-1), theirs.softmax(-1), atol=1e-6)


def _sorted_and_scattered(logits, top_k, top_p):
    """Reference: top-k by its k-th value, then top-p along a full sort in fp64, the keep mask scattered back."""
    if 0 < top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[..., -1:], float("-inf"))
    ranked, order = torch.sort(logits, dim=-1, descending=True)
    probs = ranked.double().softmax(-1)
    keep = (probs.cumsum(-1) - probs) < top_p
    keep[..., 0] = True
    return logits.masked_fill(~torch.zeros_like(keep).scatter_(-1, order, keep), float("-inf"))


@pytest.mark.parametrize("top_k", [1, 2, 17, 400, 999, 1000, 0])
def test_top_p_within_the_top_k_equals_a_sort_of_the_top_k_survivors(top_k):
    logits = torch.randn(32, 1000, generator=torch.Generator().manual_seed(top_k)) * 2
    logits[0] = torch.linspace(0, 1e-3, 1000)  # nearly flat: the nucleus is a share of the whole vocabulary
    logits[1, 500:] = float("-inf")  # filtered out before (EOS suppression, a penalty's -inf)
    for top_p in (0.05, 0.5, 0.9, 0.999):
        expected = _sorted_and_scattered(logits, top_k, top_p)
        assert torch.equal(filter_top_k_top_p(logits, top_k, top_p), expected), top_p
        assert torch.equal(torch.isinf(expected), torch.isinf(_hf_filtered(logits, 1.0, top_k, top_p))), top_p


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 0.9), (0.7, 0, 0.5), (1.3, 20, 0.8), (0.6, 3, 1.0)])
def test_bf16_logits_are_ranked_before_the_fp32_scaling_with_the_same_result(temperature, top_k, top_p):
    # filtered_logits sorts (or takes topk of) the model's bf16 logits, then scales the values
    logits = (torch.randn(16, 3000, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    ours = filtered_logits(logits, temperature, top_k, top_p)
    scaled = logits.float() / temperature
    assert torch.equal(torch.isfinite(ours).sum(-1), torch.isfinite(_hf_filtered(scaled, 1.0, top_k, top_p)).sum(-1))
    assert torch.equal(_kept_values(ours), _kept_values(_sorted_and_scattered(scaled, top_k, top_p)))


def _kept_values(filtered):
    """Each row's kept values, ascending, in one tensor (rows padded with inf)."""
    rows = [row[torch.isfinite(row)].sort().values for row in filtered]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=float("inf"))


@pytest.mark.parametrize("top_k,top_p", [(20, 0.8), (50, 0.95), (5, 0.5), (2, 0.99), (0, 0.9), (0, 0.3)])
def test_top_p_within_the_top_k_keeps_what_hf_keeps_with_bf16_ties(top_k, top_p):
    # bf16 logits tie often, at the top-p cut and with the k-th value (ties topk leaves out); which of equal logits
    # survive is arbitrary (HF's sort), how many and their values are not
    logits = (torch.randn(64, 30000, generator=torch.Generator().manual_seed(top_k)) * 3).bfloat16().float()
    small = torch.tensor([[5.0, 4, 4, 4, 0], [5.0, 3, 3, 3, 0], [1.0, 1, 1, 1, 1], [2.0, 1, 1, 0, 0]])
    for x in (logits, small):
        for k, p in ((top_k, top_p), (2, 0.5), (4, 0.6)):
            ours, theirs = filter_top_k_top_p(x, k, p), _hf_filtered(x, 1.0, k, p)
            if k == 0:  # the nucleus sums the vocabulary's probabilities in fp32: see _same_cut_up_to_rounding
                ours, theirs = _same_cut_up_to_rounding(x, ours, theirs, p)
            for row, (a, b) in enumerate(zip(_kept_values(ours), _kept_values(theirs))):
                assert torch.equal(a, b), (k, p, row, a, b)


def _same_cut_up_to_rounding(logits, ours, theirs, top_p, tolerance=1e-5):
    """Top-p alone sums up to a vocabulary of fp32 probabilities, in another order than HF's (descending, HF's
    ascending), so the two cuts may differ by a token where the exact (fp64) mass ranked above it is within rounding
    of top_p. Checks that only such tokens differ; returns both with them dropped."""
    ranked = logits.double().sort(dim=-1, descending=True).values
    probs = ranked.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    counts = [torch.isfinite(f).sum(-1) for f in (ours, theirs)]
    assert (counts[0] - counts[1]).abs().max() <= 1
    for row in (counts[0] != counts[1]).nonzero().flatten().tolist():
        disputed = int(max(counts[0][row], counts[1][row])) - 1  # the one token only one cut keeps
        assert abs(mass_before[row, disputed] - top_p) < tolerance, (row, float(mass_before[row, disputed]))
    fewer = torch.minimum(*counts)[:, None]
    cut = ranked.gather(-1, fewer - 1).float()  # keep each row's `fewer` largest in both (equal values: any of them)
    return [_keep_largest(f, cut, fewer) for f in (ours, theirs)]


def _keep_largest(filtered, nth, count):
    above = filtered > nth
    ties = (filtered == nth) & ((filtered == nth).cumsum(-1) <= count - above.sum(-1, keepdim=True))
    return filtered.masked_fill(~(above | ties), float("-inf"))


def _check_frequencies(tokens, probs, max_tv=0.02):
    """Empirical frequencies vs ``probs``: total variation and a per-token 5-sigma bound; none outside the support."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    n = counts.sum()
    freq = counts / n
    assert counts[probs == 0].sum() == 0, "sampled a filtered-out token"
    tv = 0.5 * (freq - probs).abs().sum()
    assert tv < max_tv, f"total variation {tv:.4f}"
    sigma = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() <= 5 * sigma + 1e-12).all(), (freq, probs)


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_sampled_frequencies_match_filtered_softmax(temperature, top_k, top_p):
    logits = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.5, 0.3, 0.0, -0.5, -1.0, -2.0, -3.0, 0.8])
    probs = filtered_logits(logits[None], temperature, top_k, top_p).softmax(-1)[0].double()
    if top_k or top_p < 1:
        assert (probs == 0).any()  # the settings do filter something
    draws = 40000
    tokens = sample_next_token(logits.expand(draws, -1), temperature, top_k, top_p, do_sample=True,
                               generator=torch.Generator().manual_seed(1234))
    _check_frequencies(tokens, probs)


def test_greedy_is_argmax_and_needs_no_generator():
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(3))
    assert torch.equal(sample_next_token(logits), logits.argmax(-1))
    with pytest.raises(ValueError, match="temperature"):
        sample_next_token(logits, temperature=0.0, do_sample=True)


@pytest.fixture(scope="module")
def sampling_engine():
    model = tiny_model("llama", seed=11, vocab_size=24)
    with torch.no_grad():  # a peakier distribution than random init gives, so the filters bite
        model.lm_head.weight.mul_(40)
    engine = HybridEngine(make_ds_engine(model), HybridEngineConfig(enabled=True, max_out_tokens=24),
                          pad_token_id=PAD)
    engine.eval()
    return model, engine


def test_fixed_seed_reproduces_and_other_seed_differs(sampling_engine):
    _, engine = sampling_engine
    ids, mask = left_padded_batch([5, 2, 4], vocab_size=24, seed=1)

    def sample(seed):
        return engine.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True, temperature=1.0,
                               top_k=10, top_p=0.95, generator=torch.Generator().manual_seed(seed))

    a, b, c = sample(7), sample(7), sample(8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 5, 0.9)])
def test_generated_first_token_follows_the_models_distribution(sampling_engine, temperature, top_k, top_p):
    model, engine = sampling_engine
    ids, mask = left_padded_batch([4], vocab_size=24, seed=2)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[0, -1]
    probs = filtered_logits(logits[None], temperature, top_k, top_p).softmax(-1)[0].double()
    assert probs.max() < 0.9  # not degenerate
    draws = 6000
    out = engine.generate(ids.expand(draws, -1), attention_mask=mask.expand(draws, -1), max_new_tokens=1,
                          do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
                          generator=torch.Generator().manual_seed(99))
    _check_frequencies(out[:, -1], probs, max_tv=0.04)


@pytest.mark.parametrize("skips_left_padding", [True, False])  # transformers >= 5.23 / before
@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_repetition_penalty_equals_hfs_processor_step_by_step(monkeypatch, penalty, skips_left_padding):
    """The seen-token record (prompt, then one token per step, ids past the logits' vocabulary included) and the
    penalty give HF's RepetitionPenaltyLogitsProcessor scores bit for bit, then HF's warpers' filtering."""
    monkeypatch.setattr(sampling, "hf_penalty_skips_left_padding", lambda: skips_left_padding)
    vocab, g = 40, torch.Generator().manual_seed(0)
    ids, mask = left_padded_batch([6, 2, 4, 0], vocab_size=vocab + 3, seed=1)  # a row of padding only; ids >= V
    ids[1, 0] = vocab + 2  # in the left padding of row 1 (counted only where padding is)
    padding = (mask != 0).int().argmax(dim=1)
    hf = RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=padding if skips_left_padding else None)
    seen = prompt_seen_tokens(ids, penalty_start(mask), vocab)
    sequence = ids
    for step in range(5):
        scores = torch.randn(ids.shape[0], vocab, generator=g) * 3
        scores[:, :8] = scores[:, :8].abs() * (-1) ** step  # both signs among the seen tokens
        expected = hf(sequence, scores.clone())
        assert torch.equal(apply_repetition_penalty(scores, seen, penalty), expected), step
        assert torch.equal(filtered_logits(apply_repetition_penalty(scores, seen, penalty), 0.7, 6, 0.9),
                           _hf_filtered(expected, 0.7, 6, 0.9))
        tokens = torch.randint(0, vocab, (ids.shape[0],), generator=g)
        tokens[0] = PAD  # a finished row's pad
        mark_seen(seen, tokens)
        sequence = torch.cat([sequence, tokens[:, None]], dim=1)


def test_penalty_start_of_a_group_batch_is_each_rows_own():
    """A tensor-parallel group pads every rank's prompts to the longest: a row's penalty starts where HF, on its own
    rank's batch, would start it (its first attended column, or its own first column)."""
    _, mask = left_padded_batch([3, 1, 0], seed=2)  # prompt length 3
    group_mask = torch.cat([torch.zeros(3, 2, dtype=mask.dtype), mask], dim=1)  # padded to 5 in the group
    own = penalty_start(mask)
    assert torch.equal(penalty_start(group_mask, torch.full((3,), 2)), own + 2)


# -- the one-pass Triton sampler (hybrid_engine.triton_sampling) ----------------------------------------------------
@pytest.mark.parametrize("check", ["greedy", "distribution", "filters", "seeds", "noise", "sync", "engine",
                                   "columns"])
def test_one_pass_sampler_check(check):
    """Through Triton's interpreter, in a process of its own (``tests/scripts/sampling_check.py``): greedy is the
    first argmax with the log-sum-exp, draws follow softmax(logits / T), a seed reproduces whatever the split count,
    and the engine's eager loop and graph step give the training forward's log-probs with it."""
    from helpers import run_interpreted_check

    run_interpreted_check("sampling_check.py", check)


@pytest.mark.parametrize("sample,lse,filtered", [(True, True, False), (True, False, False), (False, True, False),
                                                 (True, True, True)])
def test_one_pass_sampler_compiles_for_hopper(sample, lse, filtered, tmp_path, monkeypatch):
    """What the interpreter is lenient about (Triton's typing, rand4x on a loaded seed): both kernels compiled to
    sm_90 machine code on the CPU."""
    from helpers import hopper_target

    target = hopper_target()
    if target is None:
        pytest.skip("this Triton cannot compile for CUDA here")
    import triton
    from triton.compiler import ASTSource

    from dschat.hybrid_engine import triton_sampling

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    pointers = {"Logits": "*bf16", "Seed": "*i64", "Cut": "*fp32", "LastTie": "*i32", "PartRace": "*fp32",
                "PartCol": "*i32", "PartMax": "*fp32", "PartSum": "*fp32", "Tokens": "*i64", "Lse": "*fp32"}
    for kernel, constants in ((triton_sampling._partial_kernel,
                               dict(LANES=triton_sampling.LANES, SAMPLE=sample, LSE=lse, FILTER=filtered)),
                              (triton_sampling._combine_kernel, dict(SPLITS_PAD=8, LSE=lse))):
        names = kernel.arg_names
        signature = {n: pointers.get(n, "constexpr" if n in constants else
                                     "fp32" if n == "inv_temperature" else "i32") for n in names}
        compiled = triton.compile(ASTSource(kernel, signature, {(names.index(n),): v for n, v in constants.items()}),
                                  target=target, options=dict(num_warps=4))
        assert compiled.asm["cubin"], kernel


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_row_cut_kernel_compiles_for_hopper(dtype, tmp_path, monkeypatch):
    """``triton_filters``' search (a data-dependent loop, 16-bit bit casts) compiled to sm_90 on the CPU."""
    from helpers import hopper_target

    target = hopper_target()
    if target is None:
        pytest.skip("this Triton cannot compile for CUDA here")
    import triton
    from triton.compiler import ASTSource

    from dschat.hybrid_engine import triton_filters

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    kernel = triton_filters._cut_kernel
    constants = dict(BLOCK=triton_filters.BLOCK, FANOUT=triton_filters.FANOUT)
    types = {"Logits": f"*{dtype}", "Cut": "*fp32", "LastTie": "*i32", "top_p": "fp32", "inv_temperature": "fp32"}
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
    compiled = triton.compile(ASTSource(kernel, signature, {(names.index(n),): v for n, v in constants.items()}),
                              target=target, options=dict(num_warps=triton_filters.NUM_WARPS))
    assert compiled.asm["cubin"]


def test_top_p_splits_rows_over_chunks_only_while_rows_leave_the_gpu_half_idle(monkeypatch):
    """One program per row takes a third of the split search's work, so it is the faster once the rows alone fill
    the multiprocessors (bench/sampling.py --cut_sweep); SPLIT_TOP_P forces either search."""
    from dschat.hybrid_engine import triton_filters, triton_sampling

    monkeypatch.setattr(triton_sampling, "MULTIPROCESSORS_OFF_GPU", 132)
    cpu = torch.device("cpu")
    assert [triton_filters.split_top_p(rows, cpu) for rows in (1, 16, 66, 67, 128)] == [True] * 3 + [False] * 2
    monkeypatch.setattr(triton_filters, "SPLIT_TOP_P", False)
    assert not triton_filters.split_top_p(1, cpu)
    monkeypatch.setattr(triton_filters, "SPLIT_TOP_P", True)
    assert triton_filters.split_top_p(128, cpu)


@pytest.mark.parametrize("fanout", [2, 4, 8, 16])  # 4: SPLIT_FANOUT
def test_split_top_p_passes_close_any_16_bit_interval(fanout):
    """The split search's fixed launch count: narrowing the widest interval (lo one below the smallest 16-bit key,
    hi the largest) as the kernels do (candidates spread as ``_candidates`` spreads them; a candidate at or below
    the answer has enough weight above it) finds every answer within ``split_passes`` passes, and one pass fewer
    misses some."""
    from dschat.hybrid_engine.triton_filters import split_passes

    def passes_to(answer, lo=-32769, hi=32767):
        count = 0
        while lo < hi:
            cands = [lo + ((hi - lo) * s + fanout) // (fanout + 1) for s in range(1, fanout + 1)]
            lo, hi = max([c for c in cands if c <= answer], default=lo), min([c - 1 for c in cands if c > answer],
                                                                              default=hi)
            count += 1
        assert lo == answer
        return count

    answers = [-32769, -32768, -1, 0, 1, 32766, 32767, *range(-32769, 32768, 997)]
    worst = max(passes_to(answer) for answer in answers)
    assert worst <= split_passes(fanout)
    assert split_passes(fanout) - 1 < max(passes_to(a) for a in range(-32769, 32768, 7))


@pytest.mark.parametrize("kernel_name, constants", [
    ("_chunk_range_kernel", dict(CHUNK=4096)),
    ("_split_pass_kernel", dict(CHUNK=4096, CHUNKS=64, SUB=512, FANOUT=4)),  # the shipped settings, 152k columns
    ("_split_cut_sums_kernel", dict(CHUNK=4096, CHUNKS=64, SUB=512, FANOUT=4)),
    ("_split_cut_kernel", dict(CHUNK=4096, CHUNKS=64)),
])
def test_split_top_p_kernels_compile_for_hopper(kernel_name, constants, tmp_path, monkeypatch):
    """Top-p's launches over (row, chunk) (interval narrowing from other programs' sums, 16-bit bit casts) compiled
    to sm_90 on the CPU."""
    from dschat.hybrid_engine import triton_filters

    assert (triton_filters.SPLIT_CHUNK, triton_filters.SPLIT_SUB) == (4096, 512)
    assert constants.get("FANOUT", triton_filters.SPLIT_FANOUT) == triton_filters.SPLIT_FANOUT
    compile_filter_kernel_for_hopper(kernel_name, constants, tmp_path, monkeypatch,
                                     num_warps=triton_filters.SPLIT_NUM_WARPS)


@pytest.mark.parametrize("kernel_name, constants", [
    ("_chunk_top_kernel", dict(CHUNK=4096, KP=64, NARROW=True)),
    ("_top_k_cut_kernel", dict(CANDIDATES=1024, KP=64, BLOCK=4096, NUCLEUS=True)),
])
def test_top_k_cut_kernels_compile_for_hopper(kernel_name, constants, tmp_path, monkeypatch):
    """Top-k's two launches (``tl.topk`` over int64 keys, data-dependent branches) compiled to sm_90 on the CPU."""
    compile_filter_kernel_for_hopper(kernel_name, constants, tmp_path, monkeypatch)


def compile_filter_kernel_for_hopper(kernel_name, constants, tmp_path, monkeypatch, num_warps=None):
    from helpers import hopper_target

    target = hopper_target()
    if target is None:
        pytest.skip("this Triton cannot compile for CUDA here")
    import triton
    from triton.compiler import ASTSource

    from dschat.hybrid_engine import triton_filters

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    kernel = getattr(triton_filters, kernel_name)
    types = {"Logits": "*bf16", "Keys": "*i64", "Cut": "*fp32", "LastTie": "*i32", "top_p": "fp32",
             "inv_temperature": "fp32", "Range": "*i32", "Above": "*fp32", "Total": "*fp32", "State": "*i32",
             "CutSums": "*fp32", "CutTies": "*i32"}
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
    compiled = triton.compile(ASTSource(kernel, signature, {(names.index(n),): v for n, v in constants.items()}),
                              target=target, options=dict(num_warps=num_warps or triton_filters.NUM_WARPS))
    assert compiled.asm["cubin"]


def test_one_pass_applies_to_sampling_and_to_greedy_log_probs_of_the_models_own_logits():
    assert sampling.one_pass_applies(True, False, False)
    assert sampling.one_pass_applies(True, True, True), "the race runs on filtered or penalised logits too"
    assert sampling.one_pass_applies(False, True, False), "greedy with log-probs: one read"
    assert not sampling.one_pass_applies(False, True, True), "greedy log-probs must be of the model's own logits"
    assert not sampling.one_pass_applies(False, False, False), "greedy alone is one argmax already"


def test_choose_tokens_without_one_pass_is_the_torch_path():
    logits = torch.randn(4, 30)
    tokens, logp = sampling.choose_tokens(logits, logits, do_sample=True, generator=torch.Generator().manual_seed(3),
                                          logprobs=True, one_pass=True)  # on the CPU without the interpreter
    assert torch.equal(tokens, sample_next_token(logits, do_sample=True, generator=torch.Generator().manual_seed(3)))
    torch.testing.assert_close(logp, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: run it on the device machine")
def test_one_pass_sampler_on_the_gpu_in_bf16_and_in_a_graph():
    """What the interpreter cannot check: bf16 rows of a real vocabulary, the kernel's draws against softmax(x / T)
    at 2**20 draws, and a CUDA graph with a registered generator drawing new noise on every replay (a seed
    reproducing the replays' sequence)."""
    from dschat.hybrid_engine import triton_sampling

    torch.manual_seed(0)
    logits = (torch.randn(64, 50272, device="cuda") * 4).to(torch.bfloat16)
    logits[3, 17] = logits[3].max() + 1
    logits[3, 40000] = logits[3, 17]
    tokens, lse = triton_sampling.select_tokens(logits, do_sample=False, with_lse=True)
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(lse, torch.logsumexp(logits.float(), -1), atol=1e-4, rtol=0)

    small = torch.linspace(-3, 3, 16, device="cuda")[None]
    for temperature in (1.0, 0.7):
        drawn, _ = triton_sampling.select_tokens(small.expand(2**20, -1).contiguous(), temperature,
                                                 torch.Generator(device="cuda").manual_seed(1))
        counts = torch.bincount(drawn, minlength=16).double()
        expected = torch.softmax(small[0].double() / temperature, -1) * 2**20
        assert float(((counts - expected) ** 2 / expected).sum()) < 37.7, (temperature, counts)  # 15 dof, p=0.001

    # top-k/top-p filtered fp32 logits go through the race too: draws follow the filtered softmax
    wide = small.expand(2**20, -1).contiguous()
    drawn, _ = sampling.choose_tokens(wide, wide, top_k=8, top_p=0.9, do_sample=True, one_pass=True,
                                      generator=torch.Generator(device="cuda").manual_seed(5))
    filtered = sampling.filtered_logits(small, 1.0, 8, 0.9)[0]
    counts = torch.bincount(drawn, minlength=16).double()
    kept = torch.isfinite(filtered)
    assert 1 < int(kept.sum()) < 8 and counts[~kept].sum() == 0, counts
    expected = torch.softmax(filtered.double(), -1)[kept] * 2**20
    assert float(((counts[kept] - expected) ** 2 / expected).sum()) < 37.7, counts

    # the tail: one token at logit 0 and 4095 at relative probability 1e-7 (a float32 uniform's -log u would draw
    # them ~0.57x as often as they should be)
    tail = torch.full((1, 4096), math.log(1e-7), device="cuda")
    tail[0, 0] = 0.0
    hits = 0
    for seed in range(16):
        generator = torch.Generator(device="cuda").manual_seed(seed + 2)
        drawn, _ = triton_sampling.select_tokens(tail.expand(2**18, -1), 1.0, generator)
        hits += int((drawn != 0).sum())
    expected = 2**22 * 4095e-7 / (1 + 4095e-7)
    assert abs(hits - expected) < 5 * expected ** 0.5, (hits, expected)

    def replays(seed, n=3):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        out = torch.empty(64, dtype=torch.long, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            triton_sampling.select_tokens(logits, 1.0, generator)  # compile outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        graph.register_generator_state(generator)
        with torch.cuda.graph(graph):
            out.copy_(triton_sampling.select_tokens(logits, 1.0, generator)[0])
        generator.manual_seed(seed)
        draws = []
        for _ in range(n):
            graph.replay()
            draws.append(out.clone())
        return draws

    first = replays(5)
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2]), "new noise per replay"
    assert all(torch.equal(a, b) for a, b in zip(first, replays(5))), "a seed reproduces the replays"
    generator = torch.Generator(device="cuda").manual_seed(5)
    assert torch.equal(first[0], triton_sampling.select_tokens(logits, 1.0, generator)[0]), "graph == eager"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: run it on the device machine")
def test_row_cuts_on_the_gpu_keep_what_torchs_filters_keep(monkeypatch):
    """The compiled kernels on rows of real vocabularies: per row as many tokens with the same values as torch's
    filters (bf16 and fp16 rows, rounded rows full of ties, flat rows), top-p alone (split over chunks and one
    program per row) and top-k with or without top-p, eager and replayed in a CUDA graph."""
    from dschat.hybrid_engine import triton_filters

    torch.manual_seed(0)
    settings = ((0, 1.0, 0.9), (0, 0.7, 0.8), (0, 1.2, 0.5), (0, 1.0, 0.0),
                (50, 1.0, 1.0), (20, 1.0, 0.8), (256, 0.7, 0.95), (1, 1.0, 1.0))
    for vocab in (50272, 152064):
        base = torch.randn(64, vocab, device="cuda") * 4
        base[1] = base[1].round()
        base[2] *= 0.05  # flat: a nucleus of thousands
        base[3] = (base[3] * 0.5).round()  # the k-th ties with hundreds of others
        for logits in (base.to(torch.bfloat16), base.to(torch.float16)):
            for (top_k, temperature, top_p), split in itertools.product(settings, (True, False)):
                if top_k and not split:
                    continue  # the split is top-p alone's
                case = (vocab, logits.dtype, top_k, temperature, top_p, split)
                with monkeypatch.context() as patch:
                    patch.setattr(triton_filters, "SPLIT_TOP_P", split)
                    ours = triton_filters.kept(logits, *triton_filters.row_cuts(logits, temperature, top_p, top_k))
                theirs = torch.isfinite(filtered_logits(logits, temperature, top_k, top_p))
                assert torch.equal(ours.sum(-1), theirs.sum(-1)), case
                a = torch.where(ours, logits.float(), float("-inf")).sort(-1).values
                b = torch.where(theirs, logits.float(), float("-inf")).sort(-1).values
                assert torch.equal(a, b), case
    logits = base.to(torch.bfloat16)
    for top_k in (0, 20):
        eager = triton_filters.row_cuts(logits, 0.7, 0.8, top_k)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = triton_filters.row_cuts(logits, 0.7, 0.8, top_k)
        logits.copy_(base.flip(0).to(torch.bfloat16))
        graph.replay()
        for got, want in zip(captured, triton_filters.row_cuts(logits, 0.7, 0.8, top_k)):
            assert torch.equal(got, want), top_k
        assert not torch.equal(captured[0], eager[0]), "a replay reads the new logits"
        logits.copy_(base.to(torch.bfloat16))


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (5, 0.8), (12, 1.0)])
def test_fp32_logits_with_filtered_out_columns_and_a_temperature_keep_what_hf_keeps(top_k, top_p):
    # what a step hands the filters after a repetition penalty (fp32) and EOS suppression (-inf columns)
    logits = torch.randn(8, 400, generator=torch.Generator().manual_seed(3)) * 2
    logits[:, :7] = float("-inf")
    logits[0, 50:] = float("-inf")  # fewer finite logits than some top-k: the -inf ones stay out
    ours = filtered_logits(logits, 0.7, top_k, top_p)
    theirs = _hf_filtered(logits, 0.7, top_k, top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert torch.equal(ours[torch.isfinite(ours)], theirs[torch.isfinite(theirs)])


@pytest.mark.parametrize("high_every,temperature,top_k,top_p", [(1.25, 0.7, 1, 0.3), (2, 1.3, 17, 0.5)])
def test_top_p_over_ties_at_an_exact_mass_boundary_keeps_hfs_count(high_every, temperature, top_k, top_p):
    """Rows of two values, the nucleus ending inside the ties with the k-th at a mass of exactly top_p: the count of
    ties kept comes from unnormalised weights (as ``triton_filters`` counts them). From probabilities, (0.3 - 1/80) /
    (1/80) was 23.000002 in fp32 and kept a tie more than HF (found by a review of the Triton cut)."""
    high = torch.arange(100) % high_every < 1  # 80 of 0.0 and 20 of -1.0; 50 of 2.0 and 50 of -1.0
    logits = torch.where(high, 0.0 if high_every == 1.25 else 2.0, -1.0)[None].to(torch.bfloat16)
    ours = torch.isfinite(filtered_logits(logits, temperature, top_k, top_p)).sum()
    assert ours == torch.isfinite(_hf_filtered(logits.float(), temperature, top_k, top_p)).sum()


# -- embedding rows that no token has (sampling.chosen_columns) ------------------------------------------------------
TOKENS = 32  # the tokenizer's ids; the model's embedding has 40 rows (Qwen2.5: 151665 ids, 151936 rows)


def _model_favouring_pad_rows(rows=40):
    """A tiny model with ``rows`` embedding rows whose logits past TOKENS are raised by 30: the most likely ones."""
    model = tiny_model("llama", seed=5, vocab_size=rows)
    bias = torch.zeros(rows)
    bias[TOKENS:] = 30.0
    model.lm_head.register_forward_hook(lambda module, inputs, output: output + bias)
    return model


@pytest.mark.parametrize("path", ["eager", "graph step"])
def test_ids_past_the_tokenizer_are_never_generated_and_log_probs_stay_the_models(path):
    """The engine's ``token_count`` (len(tokenizer)) leaves the rows no token has out of the choice, greedy and
    sampled, filtered or not, in the eager loop and the graph step; greedy equals HF's generate with those ids in
    ``suppress_tokens``, and the log-probs stay the training forward's (the softmax over every row)."""
    from hybrid_common import answer_logprobs_and_live, hf_generate

    from dschat.hybrid_engine.graphs import GraphDecoder

    model = _model_favouring_pad_rows()
    ids, mask = left_padded_batch([5, 2, 4], vocab_size=TOKENS, seed=3)
    engines = {count: HybridEngine(make_ds_engine(model), HybridEngineConfig(enabled=True, max_out_tokens=32),
                                   pad_token_id=PAD, token_count=count) for count in (None, TOKENS, 40)}
    for engine in engines.values():
        if path == "graph step":
            engine.graph_decoder = GraphDecoder(engine.kv_cache, capture_graphs=False)
        engine.eval()
    unmasked = engines[None].generate(ids, attention_mask=mask, max_new_tokens=6)
    assert (unmasked[:, ids.shape[1]:] >= TOKENS).all(), "the premise: the pad rows are the most likely"
    assert torch.equal(engines[40].generate(ids, attention_mask=mask, max_new_tokens=6), unmasked), \
        "as many ids as rows: nothing changes"
    engine = engines[TOKENS]
    greedy = engine.generate(ids, attention_mask=mask, max_new_tokens=6)
    assert (greedy[:, ids.shape[1]:] < TOKENS).all()
    assert torch.equal(greedy, hf_generate(model, ids, mask, 6, suppress_tokens=list(range(TOKENS, 40))))
    for settings in (dict(), dict(top_k=5), dict(top_p=0.9), dict(top_k=6, top_p=0.8, temperature=1.5),
                     dict(repetition_penalty=1.3)):
        sequences, logprobs = engine.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True,
                                              generator=torch.Generator().manual_seed(1), return_logprobs=True,
                                              **{"top_k": 0, **settings})
        assert (sequences[:, ids.shape[1]:] < TOKENS).all(), settings
        expected, live = answer_logprobs_and_live(model, sequences, mask, -1,  # (no EOS)
                                                  temperature=settings.get("temperature", 1.0))
        assert (logprobs - expected)[live].abs().max() < 1e-4, settings
        assert (logprobs[live] < math.log(1e-6)).all(), "scored under every row's softmax, the pad rows' mass too"


def test_chosen_columns_leave_logits_as_wide_as_the_tokenizer_alone():
    logits = torch.zeros(2, 40)
    assert sampling.chosen_columns(logits, None) is None
    assert sampling.chosen_columns(logits, 40) is None and sampling.chosen_columns(logits, 41) is None
    assert sampling.chosen_columns(logits, 32) == 32
    logits[:, 32:] = 5.0
    tokens, _ = sampling.choose_tokens(logits, logits, do_sample=True, generator=torch.Generator().manual_seed(0),
                                       token_count=32)
    assert (tokens < 32).all()
