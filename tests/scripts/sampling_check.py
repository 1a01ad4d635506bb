"""Checks of the one-pass Triton sampler (``hybrid_engine.triton_sampling``) on the CPU through Triton's interpreter.

Run as ``TRITON_INTERPRET=1 python sampling_check.py CHECK`` (the interpreter must be chosen before triton decorates
the kernels, hence a separate process); exits non-zero when a check fails.
"""
import itertools
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from hybrid_common import (PAD, answer_logprobs_and_live, hf_generate, left_padded_batch,  # noqa: E402
                           make_ds_engine, tiny_model)

from dschat.hybrid_engine import HybridEngine, HybridEngineConfig, triton_sampling  # noqa: E402

# Chi-square critical values at p = 0.001 (a fixed seed: the check is deterministic, the threshold only says how far
# off an unbiased sampler's counts may land)
CHI2_999 = {2: 13.82, 4: 18.47, 5: 20.52}


def with_splits(multiprocessors, fn):
    """``fn()`` with the sampler's split sized as if the device had this many multiprocessors."""
    saved = triton_sampling.MULTIPROCESSORS_OFF_GPU
    triton_sampling.MULTIPROCESSORS_OFF_GPU = multiprocessors
    try:
        return fn()
    finally:
        triton_sampling.MULTIPROCESSORS_OFF_GPU = saved


def check_greedy_is_first_argmax_and_lse():
    torch.manual_seed(0)
    tile = 4 * triton_sampling.LANES
    for vocab in (7, tile, tile + 1, 3 * tile - 5):
        for dtype in (torch.float32, torch.bfloat16):
            logits = (torch.randn(5, vocab) * 3).to(dtype)
            logits[1, 3] = logits[1].max() + 1
            logits[1, vocab - 1] = logits[1, 3]  # a tie across tiles: the first column wins, as torch.argmax
            logits[2, 2] = logits[2].max() + 1
            logits[2, 1] = logits[2, 2]  # a tie inside a lane vector
            logits[3, :vocab // 2] = float("-inf")  # filtered columns
            for programs in (1, 64):  # 1-2 splits per row, and as many as the row's tiles
                tokens, lse = with_splits(programs, lambda: triton_sampling.select_tokens(
                    logits, do_sample=False, with_lse=True))
                assert tokens.dtype == torch.long and torch.equal(tokens, logits.argmax(-1)), (vocab, dtype, tokens)
                error = (lse - torch.logsumexp(logits.float(), -1)).abs().max()
                assert error < 1e-5, (vocab, dtype, programs, error)
    tokens, lse = triton_sampling.select_tokens(torch.randn(3, 50), do_sample=False)
    assert lse is None
    print("greedy: first argmax, log-sum-exp")


def check_noise_keeps_its_resolution_near_zero():
    """E = -log1p(-v) from 31 random bits, against float64: exact to 1e-6 relative near E = 0, where a token of tiny
    probability wins (``-log u`` of a float32 uniform would floor E at 6e-8), and finite at the top."""
    import triton
    import triton.language as tl

    @triton.jit
    def transform(Bits, E, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(E + i, triton_sampling._exponential(tl.load(Bits + i)))

    small = [0, 1, 2, 5, 100, 2**12, 2**20, 2**26, 2**27 - 1, 2**27, 2**29, 2**30, 2**31 - 2, 7]  # and complements
    bits = torch.tensor(small + [2**32 - 1 - k for k in small] + [2**31 - 1, 2**31, 2**31 + 1, 3 * 2**30],
                        dtype=torch.int64).to(torch.int32)
    got = torch.empty(bits.shape[0])
    transform[(1,)](bits, got, N=bits.shape[0])
    k = torch.where(bits < 0, ~bits, bits).double()
    expected = -torch.log1p(-(k + 0.5) / 2**31)
    finite = expected < 16
    assert ((got.double() - expected).abs() / expected)[finite].max() < 1e-6, (got, expected)
    assert got[0] < 1e-9 and torch.isfinite(got).all() and got.max() < 17, got
    print("noise: E exact near 0, finite at the top")


def counts_of(logits, temperature, rows, seed):
    generator = torch.Generator().manual_seed(seed)
    lanes, triton_sampling.LANES = triton_sampling.LANES, 2  # 8 columns per tile: fast in the interpreter
    try:
        tokens, _ = triton_sampling.select_tokens(logits.expand(rows, -1).contiguous(), temperature, generator)
    finally:
        triton_sampling.LANES = lanes
    return torch.bincount(tokens, minlength=logits.shape[-1]).double()


def chi_square(counts, probs):
    expected = probs.double() * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def check_sampled_distribution():
    """Counts of 400 draws (T=1 and T=0.5) against softmax(logits / T), and far from softmax(logits) when
    T != 1 (each draw is a program of Triton's interpreter, ~0.1 s: the draws are the check's time)."""
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5, 2.5]])
    for temperature, draws in ((1.0, 400), (0.5, 400)):
        counts = counts_of(logits, temperature, draws, seed=11)
        fit = chi_square(counts, torch.softmax(logits[0] / temperature, -1))
        assert fit < CHI2_999[5], (temperature, counts, fit)
        if temperature != 1.0:
            misfit = chi_square(counts, torch.softmax(logits[0], -1))
            assert misfit > 4 * CHI2_999[5], ("the temperature must change the draws", misfit)
            print(f"T={temperature}: chi-square against T=1's distribution {misfit:.1f}")
        print(f"T={temperature}: chi-square {fit:.1f} (5 dof)")
    # a filtered column (-inf) is never drawn
    filtered = logits.clone()
    filtered[0, 5] = float("-inf")
    assert counts_of(filtered, 1.0, 60, seed=3)[5] == 0
    check_filtered_draws()


def check_filtered_draws():
    """``choose_tokens`` through the kernels, T = 0.5: under top-k 5 and top-p 0.9 and under top-p 0.85 alone
    (``triton_filters``' row cuts, then the race masking by them), 300 draws land only on the 3 tokens the filters
    keep, in proportion to softmax(filtered logits) (T applied once), and the log-probs are the unfiltered
    distribution's. The 300 rows are one row repeated: its cut is computed once and repeated (the interpreter's
    top-k takes ~1 s per row; the cuts themselves are ``filters``' to check)."""
    from dschat.hybrid_engine.sampling import choose_tokens, filtered_logits

    from dschat.hybrid_engine import triton_filters

    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5, 2.5, 1.5, -2.0, 0.2, 1.2, 0.0, -0.5]])
    rows = logits.expand(300, -1).contiguous().to(torch.bfloat16)  # the row cuts take the model's 16-bit logits
    cut_calls = []
    row_cuts, block, sub = triton_filters.row_cuts, triton_filters.BLOCK, triton_filters.SPLIT_SUB

    def first_row_cut_repeated(logits, *args):
        cut_calls.append(args)
        return tuple(t.expand(logits.shape[0]).contiguous() for t in row_cuts(logits[:1], *args))

    triton_filters.row_cuts = first_row_cut_repeated
    triton_filters.BLOCK = triton_filters.SPLIT_SUB = 16  # a 12-token row: small blocks are fast in the interpreter
    for top_k, top_p in ((5, 0.9), (0, 0.85)):
        lanes, triton_sampling.LANES = triton_sampling.LANES, 2
        cut_calls.clear()
        try:
            tokens, logp = choose_tokens(rows, rows, temperature=0.5, top_k=top_k, top_p=top_p, do_sample=True,
                                         logprobs=True, one_pass=True, generator=torch.Generator().manual_seed(3))
        finally:
            triton_sampling.LANES = lanes
        assert len(cut_calls) == 1, (top_k, "the filters go through the row cuts")
        filtered = filtered_logits(rows[:1].float(), 0.5, top_k, top_p)[0]
        kept = torch.isfinite(filtered)
        counts = torch.bincount(tokens, minlength=logits.shape[-1]).double()
        assert int(kept.sum()) == 3 and counts[~kept].sum() == 0, (top_k, counts)
        fit = chi_square(counts[kept], torch.softmax(filtered[kept], -1))
        assert fit < CHI2_999[2], (top_k, counts, fit)
        misfit = chi_square(counts[kept], torch.softmax(filtered[kept] / 0.5, -1))
        assert misfit > 4 * CHI2_999[2], ("the temperature is applied once", top_k, misfit)
        # the log-probs: the unfiltered distribution at the sampling temperature (step 3 scores answers at it)
        expected = torch.log_softmax(rows.float() / 0.5, -1).gather(-1, tokens[:, None]).squeeze(-1)
        assert (logp - expected).abs().max() < 1e-6, top_k
        print(f"filtered, top-k {top_k}: chi-square {fit:.1f} (2 dof), {misfit:.1f} with T applied twice")
    triton_filters.row_cuts, triton_filters.BLOCK, triton_filters.SPLIT_SUB = row_cuts, block, sub


def check_row_cuts_keep_what_torchs_filters_keep():
    """``triton_filters.row_cuts`` against ``sampling.filtered_logits`` (torch's sort): per row the same number of
    tokens with the same values, for bf16 and fp16 logits with ties, -inf columns, a row of zeros and -0.0, a flat
    row, top-p 0; top-p alone searched by one program per row over one block and over several (``BLOCK`` shrunk),
    and split over one chunk per row and over several (``SPLIT_CHUNK`` shrunk). (No bf16 denormals: the interpreter
    flushes them when converting, the GPU does not.)"""
    from dschat.hybrid_engine import triton_filters
    from dschat.hybrid_engine.sampling import filtered_logits

    torch.manual_seed(0)
    saved = triton_filters.BLOCK, triton_filters.SPLIT_CHUNK, triton_filters.SPLIT_SUB, triton_filters.SPLIT_TOP_P
    cases = 0
    for split, (dtype, vocab, block) in itertools.product(
            (True, False), ((torch.bfloat16, 7, saved[0]), (torch.bfloat16, 1000, 64), (torch.float16, 301, 32))):
        triton_filters.SPLIT_TOP_P, triton_filters.BLOCK = split, block
        triton_filters.SPLIT_CHUNK, triton_filters.SPLIT_SUB = 2 * block, block // 2
        for temperature, top_p in ((1.0, 0.9), (0.7, 0.5), (1.0, 0.0)):
            logits = (torch.randn(6, vocab) * 3).to(dtype)
            logits[1] = logits[1].round()  # many ties
            logits[2, :vocab // 2] = float("-inf")
            logits[3] = 0.0
            logits[3, 0] = -0.0
            logits[4] *= 0.01  # a flat row: a wide nucleus
            cut, last = triton_filters.row_cuts(logits, temperature, top_p)
            ours = triton_filters.kept(logits, cut, last)
            theirs = torch.isfinite(filtered_logits(logits, temperature, 0, top_p))
            for row in range(logits.shape[0]):
                a = logits[row][ours[row]].float().sort().values
                b = logits[row][theirs[row]].float().sort().values
                assert torch.equal(a, b), (dtype, vocab, temperature, top_p, row, a.numel(), b.numel())
            cases += 1
    triton_filters.BLOCK, triton_filters.SPLIT_CHUNK, triton_filters.SPLIT_SUB, triton_filters.SPLIT_TOP_P = saved
    cases += check_top_k_cuts(filtered_logits)
    for logits, top_k in ((torch.randn(2, 9), 0), (torch.randn(2, 900).bfloat16(), triton_filters.MAX_TOP_K + 1)):
        try:
            triton_filters.row_cuts(logits, 1.0, 0.9, top_k)
            raise AssertionError("fp32 logits and a top-k above MAX_TOP_K are torch's to filter")
        except ValueError:
            pass
    print(f"row cuts: {cases} cases keep what torch's filter keeps")


def check_top_k_cuts(filtered_logits):
    """Top-k's cuts (chunks' candidates, then each row's cut) against torch's filters, as above: rows of ties at the
    k-th (top-k keeps them all; top-p then cuts into them by column), -inf columns, zeros and -0.0, flat rows; one
    chunk padded past the row's end, and several."""
    from dschat.hybrid_engine import triton_filters

    chunk, block = triton_filters.TOPK_CHUNK, triton_filters.BLOCK
    triton_filters.BLOCK = 64
    cases = 0
    for dtype, vocab, triton_filters.TOPK_CHUNK, top_k, temperature, top_p in (
            (torch.bfloat16, 7, chunk, 3, 1.0, 0.9),
            (torch.bfloat16, 300, 128, 20, 0.7, 0.8),
            (torch.float16, 301, 128, 50, 1.0, 0.97),
            (torch.bfloat16, 300, 128, 5, 1.0, 1.0)):
        logits = (torch.randn(6, vocab) * 3).to(dtype)
        logits[1] = logits[1].round()  # the k-th tied with many: some left out of the ranked k
        logits[2, :vocab // 2] = float("-inf")
        logits[3] = 0.0
        logits[3, 0] = -0.0
        logits[4] = (logits[4] * 0.3).round()  # ties across chunks, a nucleus into them
        logits[5] *= 0.01  # flat
        ours = triton_filters.kept(logits, *triton_filters.row_cuts(logits, temperature, top_p, top_k))
        theirs = torch.isfinite(filtered_logits(logits, temperature, top_k, top_p))
        for row in range(logits.shape[0]):
            a = logits[row][ours[row]].float().sort().values
            b = logits[row][theirs[row]].float().sort().values
            assert torch.equal(a, b), (dtype, vocab, top_k, temperature, top_p, row, a.numel(), b.numel())
        cases += 1
    triton_filters.TOPK_CHUNK, triton_filters.BLOCK = chunk, block
    return cases


def check_seed_reproduces_and_splits_do_not_matter():
    torch.manual_seed(1)
    logits = torch.randn(6, 3 * 4 * triton_sampling.LANES + 17)

    def draw(seed, programs):
        generator = torch.Generator().manual_seed(seed)
        return with_splits(programs, lambda: triton_sampling.select_tokens(logits, 1.0, generator)[0])

    a = draw(5, 1)
    assert torch.equal(a, draw(5, 1)), "a seed reproduces"
    assert torch.equal(a, draw(5, 64)), "the split count never changes a draw"
    assert not torch.equal(a, draw(6, 1)), "another seed draws other tokens"
    generator = torch.Generator().manual_seed(5)
    first = triton_sampling.select_tokens(logits, 1.0, generator)[0]
    assert not torch.equal(first, triton_sampling.select_tokens(logits, 1.0, generator)[0]), \
        "the generator moves on: the next call draws new noise"
    triton_sampling.select_tokens(logits, 1.0, None)  # the device's default generator
    print("seeds reproduce; split count irrelevant")


def check_log_probs_are_of_the_shared_tokens():
    """With a tensor-parallel group's ``token_sync`` the tokens change after the kernel chose them: the log-probs must
    be those of the shared tokens, read from this rank's logits and the kernel's log-sum-exp."""
    from dschat.hybrid_engine.sampling import choose_tokens

    torch.manual_seed(2)
    logits = torch.randn(4, 300)
    for do_sample in (True, False):
        tokens, logp = choose_tokens(logits, logits, do_sample=do_sample, generator=torch.Generator().manual_seed(1),
                                     logprobs=True, one_pass=True, token_sync=lambda t: (t + 1) % 300)
        expected = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
        assert (logp - expected).abs().max() < 1e-5, (do_sample, logp, expected)
    print("log-probs of the shared tokens")


def check_engine_logprobs_equal_training_forward():
    """The engine's eager loop and graph step with the one-pass sampler: sampled log-probs equal the training
    forward's, a seed reproduces, and the kernel runs exactly where it applies."""
    from dschat.hybrid_engine import attention
    from dschat.hybrid_engine.graphs import GraphDecoder

    attention.kernel_applies = lambda *args, **kwargs: False  # SDPA's attention: the interpreter's is slow
    calls = []
    kernel = triton_sampling.select_tokens

    def counting(*args):
        calls.append(args[3])  # do_sample
        return kernel(*args)

    triton_sampling.select_tokens = counting
    model = tiny_model("opt", seed=3)
    engine = HybridEngine(make_ds_engine(model), HybridEngineConfig(enabled=True, max_out_tokens=64),
                          pad_token_id=PAD, decode_attention="triton")
    ids, mask = left_padded_batch([7, 3, 5, 1])
    eos = 5
    for path in ("eager", "graph step"):
        if path == "graph step":
            engine.graph_decoder = GraphDecoder(engine.kv_cache, capture_graphs=False)
        engine.eval()
        calls.clear()

        def sample(seed, **kwargs):
            return engine.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=True, eos_token_id=eos,
                                   generator=torch.Generator().manual_seed(seed), return_logprobs=True,
                                   **{"top_k": 0, **kwargs})

        sequences, logprobs = sample(7)
        assert calls and all(calls), (path, "the sampled steps go through the kernel")
        expected, live = answer_logprobs_and_live(model, sequences, mask, eos)
        error = (logprobs - expected)[live].abs().max()
        assert error < 1e-4, (path, error)
        if path == "eager":
            assert torch.equal(sequences, sample(7)[0]) and not torch.equal(sequences, sample(8)[0]), path
        # the race on filtered, penalised or EOS-suppressed logits; the log-probs stay the model's own, at the
        # sampling temperature (the kernel's log-sum-exp of the logits over it)
        for changed in (dict(top_k=6, top_p=0.9), dict(top_p=0.8), dict(repetition_penalty=1.2),
                        dict(min_new_tokens=4), dict(temperature=0.6), dict(temperature=1.5, top_k=6)):
            calls.clear()
            sequences, logprobs = sample(7, **changed)
            assert calls and all(calls), (path, changed, "the sampled steps go through the kernel")
            expected, live = answer_logprobs_and_live(model, sequences, mask, eos,
                                                      temperature=changed.get("temperature", 1.0))
            assert (logprobs - expected)[live].abs().max() < 1e-4, (path, changed)
        calls.clear()
        greedy, greedy_logprobs = engine.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=eos,
                                                  return_logprobs=True)
        assert calls == [False] * len(calls) and calls, (path, "greedy with log-probs: the kernel's argmax")
        assert torch.equal(greedy, hf_generate(model, ids, mask, 10, eos_token_id=eos)), path
    assert engine.graph_decoder.replays > 0
    calls.clear()
    engine.decode_attention = "sdpa"
    engine.graph_decoder = None
    sample(7)
    assert not calls, "decode_attention='sdpa': torch's ops only"
    print("engine: one-pass sampling in the eager loop and the graph step")


def check_columns_past_the_tokenizer_are_never_chosen():
    """``columns`` (the tokenizer's size, ``sampling.chosen_columns``): the race leaves out the columns from it on,
    which hold the row's largest logits here, while the log-sum-exp stays every column's; greedy is the first argmax
    of the chosen columns; draws land on them alone; top-p cuts are of the chosen columns alone; and the engine's
    steps (eager and graph) never generate such an id, with the training forward's log-probs."""
    from dschat.hybrid_engine import attention, triton_filters
    from dschat.hybrid_engine.graphs import GraphDecoder
    from dschat.hybrid_engine.sampling import choose_tokens, filtered_logits

    torch.manual_seed(4)
    lanes, triton_sampling.LANES = triton_sampling.LANES, 2  # 8 columns per tile: fast in the interpreter
    block, sub = triton_filters.BLOCK, triton_filters.SPLIT_SUB
    triton_filters.BLOCK = triton_filters.SPLIT_SUB = 16
    try:
        logits = torch.randn(5, 21)
        logits[:, 13:] += 30.0  # columns 13.. (past the tokenizer): the most likely
        for programs in (1, 64):
            tokens, lse = with_splits(programs, lambda: triton_sampling.select_tokens(
                logits, 1.0, None, False, True, None, 13))
            assert torch.equal(tokens, logits[:, :13].argmax(-1)), (programs, tokens)
            assert (lse - torch.logsumexp(logits, -1)).abs().max() < 1e-5, programs
        row = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5, 2.5, 9.0, 9.0, 9.0]])
        tokens, _ = triton_sampling.select_tokens(row.expand(40, -1).contiguous(), 1.0,
                                                  torch.Generator().manual_seed(11), True, False, None, 6)
        assert (tokens < 6).all() and len(set(tokens.tolist())) >= 3, tokens  # (the chosen columns still race)
        rows = logits.to(torch.bfloat16)
        for settings in (dict(top_p=0.85), dict(top_k=4, top_p=0.9)):
            tokens, logp = choose_tokens(rows, rows, do_sample=True, logprobs=True, one_pass=True, token_count=13,
                                         generator=torch.Generator().manual_seed(3), **settings)
            kept = torch.isfinite(filtered_logits(rows[:, :13], 1.0, settings.get("top_k", 0), settings["top_p"]))
            assert kept.gather(-1, tokens[:, None]).all(), (settings, tokens)
            expected = torch.log_softmax(rows.float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
            assert (logp - expected).abs().max() < 1e-5, settings
    finally:
        triton_sampling.LANES = lanes
        triton_filters.BLOCK, triton_filters.SPLIT_SUB = block, sub

    attention.kernel_applies = lambda *args, **kwargs: False  # SDPA's attention: the interpreter's is slow
    model = tiny_model("opt", seed=3, vocab_size=40)
    bias = torch.zeros(40)
    bias[32:] = 30.0
    model.lm_head.register_forward_hook(lambda module, inputs, output: output + bias)
    engine = HybridEngine(make_ds_engine(model), HybridEngineConfig(enabled=True, max_out_tokens=64),
                          pad_token_id=PAD, decode_attention="triton", token_count=32)
    ids, mask = left_padded_batch([7, 3], vocab_size=32)
    for path in ("eager", "graph step"):
        if path == "graph step":
            engine.graph_decoder = GraphDecoder(engine.kv_cache, capture_graphs=False)
        engine.eval()
        for do_sample in (True, False):
            sequences, logprobs = engine.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=do_sample,
                                                  top_k=0, generator=torch.Generator().manual_seed(7),
                                                  return_logprobs=True)
            assert (sequences[:, ids.shape[1]:] < 32).all(), (path, do_sample, sequences)
            expected, live = answer_logprobs_and_live(model, sequences, mask, -1)
            assert (logprobs - expected)[live].abs().max() < 1e-4, (path, do_sample)
    assert engine.graph_decoder.replays > 0
    print("columns past the tokenizer: never chosen; log-sum-exp of every column")


CHECKS = {
    "greedy": check_greedy_is_first_argmax_and_lse,
    "distribution": check_sampled_distribution,
    "filters": check_row_cuts_keep_what_torchs_filters_keep,
    "seeds": check_seed_reproduces_and_splits_do_not_matter,
    "noise": check_noise_keeps_its_resolution_near_zero,
    "sync": check_log_probs_are_of_the_shared_tokens,
    "engine": check_engine_logprobs_equal_training_forward,
    "columns": check_columns_past_the_tokenizer_are_never_chosen,
}

if __name__ == "__main__":
    for name in sys.argv[1:] or CHECKS:
        CHECKS[name]()
