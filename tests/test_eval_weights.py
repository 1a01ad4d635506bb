"""Evaluation on several ranks counts each item once: DistributedSampler's padding repeats carry eval_weight 0 and
the SFT, reward-model and DPO evaluations leave them out (the forward still runs, so ranks stay in step)."""
import itertools
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from hybrid_common import tiny_model  # noqa: E402

from dschat.args import step2_dpo_parser  # noqa: E402
from dschat.data import DataCollatorSFT  # noqa: E402
from dschat.data.samplers import EvalWeighted, PaddingMarkedSampler, weighted_collator  # noqa: E402
from dschat.steps import dpo  # noqa: E402
from dschat.steps.reward import evaluate_reward  # noqa: E402
from dschat.steps.sft import evaluate_lm  # noqa: E402


def _sft_item(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 96, (8,), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _rank_loader(items, rank, collator, batch_size=2):
    sampler = PaddingMarkedSampler(items, num_replicas=2, rank=rank, shuffle=False)
    return DataLoader(EvalWeighted(items), batch_size=batch_size, sampler=sampler, collate_fn=weighted_collator(collator))


def test_weighted_collator_puts_the_padding_marks_in_the_batch():
    items = [_sft_item(i) for i in range(3)]  # rank 1 of 2: items 1, then item 0 again as padding
    batches = list(_rank_loader(items, 1, DataCollatorSFT(pad_token_id=0)))
    assert [b["eval_weight"].tolist() for b in batches] == [[1.0, 0.0]]
    assert batches[0]["input_ids"].shape == (2, 8)


def test_sft_eval_loss_ignores_padding_repeats_even_in_an_all_padding_batch():
    model = tiny_model("llama", seed=2).eval()
    collator = DataCollatorSFT(pad_token_id=0)
    one = collator([_sft_item(7)])
    alone = evaluate_lm(model, [one], "cpu")
    repeated = collator([_sft_item(7), _sft_item(9)])
    repeated["eval_weight"] = torch.tensor([1.0, 0.0], dtype=torch.float64)
    only_padding = collator([_sft_item(9)])
    only_padding["eval_weight"] = torch.tensor([0.0], dtype=torch.float64)
    got = evaluate_lm(model, [repeated, only_padding], "cpu")
    assert got["eval_loss"] == pytest.approx(alone["eval_loss"], rel=1e-6)


def test_sft_eval_counts_its_records_once_over_the_ranks_and_its_tokens():
    """Step 1's metrics said no count of what they were taken over (step 2 and DPO say eval_pairs): "eval_records"
    counts each record once (a rank's padding repeat, weight 0, is none of them), "eval_tokens" the labelled tokens
    scored (the answers'; the prompts' too under --include_prompt_in_loss); a loader cut short (--eval_iters') counts
    only the batches it gives."""
    model = tiny_model("llama", seed=2).eval()
    items = [_sft_item(i) for i in range(3)]  # 2 ranks: rank 0 scores items 0 and 2, rank 1 item 1 and item 0 again
    collator = DataCollatorSFT(pad_token_id=0)
    ranks = [evaluate_lm(model, _rank_loader(items, rank, collator, batch_size=1), "cpu") for rank in (0, 1)]
    assert [got["eval_records"] for got in ranks] == [2, 1]  # (summed by all_reduce over the ranks: 3)
    assert [got["eval_tokens"] for got in ranks] == [14, 7]  # (8 tokens each: 7 predicted)
    capped = evaluate_lm(model, itertools.islice(_rank_loader(items, 0, collator, batch_size=1), 1), "cpu")
    assert capped["eval_records"] == 1 and capped["eval_tokens"] == 7


def test_no_eval_records_give_no_score_rather_than_a_perfect_one():
    assert evaluate_lm(tiny_model("llama", seed=2).eval(), [], "cpu") == {
        "eval_loss": None, "perplexity": None, "eval_records": 0, "eval_tokens": 0}
    got = evaluate_reward(_Scores(), [], "cpu")
    assert got["accuracy"] is None and got["eval_pairs"] == 0
    step = dpo.DPOStep(step2_dpo_parser().parse_args([]))
    got = step.evaluate(torch.nn.Identity(), [], "cpu")
    assert got["eval_pairs"] == 0 and got["eval_loss"] is None and got["reward_margin"] is None


class _Scores(torch.nn.Module):
    """A reward engine whose scores are given by the batch (chosen rows first, then rejected)."""

    def forward(self, input_ids, attention_mask):
        scores = input_ids[:, 0].double()
        half = scores.shape[0] // 2
        return {"chosen_mean_scores": scores[:half], "rejected_mean_scores": scores[half:]}


def test_reward_eval_counts_only_weighted_pairs():
    batch = {"input_ids": torch.tensor([[5], [1], [2], [3]]), "attention_mask": torch.ones(4, 1),
             "eval_weight": torch.tensor([1.0, 0.0], dtype=torch.float64)}  # pair 2 (1 vs 3) is a padding repeat
    got = evaluate_reward(_Scores(), [batch], "cpu")
    assert got["accuracy"] == 1.0 and got["eval_pairs"] == 1
    assert got["chosen_mean_score"] == 5.0 and got["rejected_mean_score"] == 2.0


def test_reward_eval_counts_a_tie_half_and_reports_the_ties():
    """Scores alike everywhere (an untrained head) were an accuracy of 0.0, as if the model always preferred the
    rejected answer."""
    batch = {"input_ids": torch.tensor([[5], [4], [3], [2], [4], [4]]), "attention_mask": torch.ones(6, 1)}
    got = evaluate_reward(_Scores(), [batch], "cpu")  # pairs 5 vs 2, 4 vs 4, 3 vs 4
    assert got["accuracy"] == pytest.approx(1.5 / 3) and got["ties"] == 1 and got["eval_pairs"] == 3
    alike = {"input_ids": torch.full((4, 1), 7), "attention_mask": torch.ones(4, 1)}
    got = evaluate_reward(_Scores(), [alike], "cpu")
    assert got["accuracy"] == 0.5 and got["ties"] == 2


def test_dpo_eval_before_training_is_at_chance_with_every_pair_tied(monkeypatch):
    """The policy is the reference: every implicit reward is 0 (within rounding), and reward_accuracy was 0.0."""
    step = dpo.DPOStep(step2_dpo_parser().parse_args(["--beta", "0.5"]))
    chosen, rejected = torch.tensor([-1.0, -9.0, -4.0]), torch.tensor([-3.0, -1.0, -4.0])
    monkeypatch.setattr(step, "pair_log_probs", lambda engine, batch: (chosen, rejected, chosen + 1e-5, rejected))
    mask = torch.ones(6, 3, dtype=torch.long)
    got = step.evaluate(torch.nn.Identity(), [{"response_mask": mask}], "cpu")
    assert got["reward_accuracy"] == 0.5 and got["reward_ties"] == 3
    assert got["logp_accuracy"] == pytest.approx(1.5 / 3) and got["logp_ties"] == 1  # (-4 vs -4)
    assert got["reference_logp_ties"] == 0 and got["eval_pairs"] == 3


def test_dpo_eval_sums_leave_padding_pairs_out(monkeypatch):
    step = dpo.DPOStep(step2_dpo_parser().parse_args(["--beta", "0.5"]))
    logps = (torch.tensor([-1.0, -9.0]), torch.tensor([-3.0, -1.0]), torch.tensor([-2.0, -2.0]),
             torch.tensor([-2.0, -2.0]))
    monkeypatch.setattr(step, "pair_log_probs", lambda engine, batch: logps)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0], [0, 1, 1], [0, 0, 1]])  # (chosen rows first: 2 and 1 answer tokens)
    sums = step.batch_sums(None, {"eval_weight": torch.tensor([1.0, 0.0], dtype=torch.float64), "response_mask": mask})
    pairs = dict(zip(dpo.EVAL_SUMS, sums.tolist()))
    assert pairs["pairs"] == 1.0 and pairs["reward_accuracy"] == 1.0 and pairs["logp_accuracy"] == 1.0
    assert pairs["chosen_logp"] == -1.0 and pairs["chosen_nll"] == 1.0 and pairs["chosen_tokens"] == 2.0
