"""Sampling: on-device exponential race matches the filtered model distribution; fixed seeds reproduce."""
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
from dschat.hybrid_engine.sampling import (apply_repetition_penalty, filtered_logits, mark_seen,  # noqa: E402
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
