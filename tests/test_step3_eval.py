"""Step 3's held-out evaluation over several ranks: the sampler's padding repeats are run but not counted."""
import functools
import json
import os
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

from dschat.data import DataCollatorRLHF
from dschat.data.samplers import EvalWeighted, PaddingMarkedSampler, weighted_collator
from dschat.models.reward_model import last_token_index
from dschat.rlhf.evaluation import evaluate_policy

PROMPT_ID = 10  # prompt i is the single token PROMPT_ID + i; its reward is i and its rule score 10 * i


def prompts(n):
    return [{"prompt_input_ids": torch.tensor([PROMPT_ID + i]), "prompt_text": f"p{i}"} for i in range(n)]


def fake_generate(answer_ids):
    def generate(prompt, attention_mask=None, max_new_tokens=None, **kwargs):
        return torch.cat([prompt, torch.tensor(answer_ids).expand(prompt.shape[0], -1)], dim=1)
    return generate


class FakeReward(torch.nn.Module):
    """Scores a row at its last real token (as RewardModel) by its first real token (the prompt's one) less
    PROMPT_ID, over rows left-padded or shifted (no mask: they start at column 0) alike; records the widths it was
    given."""

    def __init__(self):
        super().__init__()
        self.lengths = []

    def forward_value(self, input_ids, attention_mask=None, return_value_only=False):
        self.lengths.append(input_ids.shape[1])
        start = torch.zeros_like(input_ids[:, :1]) if attention_mask is None else attention_mask.long().argmax(1, True)
        values = (input_ids.gather(1, start) - PROMPT_ID).float().expand(-1, input_ids.shape[1])
        if return_value_only:
            return values
        return {"chosen_end_scores": values.gather(1, self.score_index(input_ids, attention_mask)[:, None]).squeeze(1)}

    def score_index(self, input_ids, attention_mask):
        return last_token_index(attention_mask)


def evaluate(loader, tokenizer, **kwargs):
    answer = tokenizer(" ok ok", add_special_tokens=False)["input_ids"][:2]
    assert len(answer) == 2 and tokenizer.eos_token_id not in answer and tokenizer.pad_token_id not in answer
    return evaluate_policy(fake_generate(answer), SimpleNamespace(module=FakeReward()), tokenizer, loader, "cpu",
                           2, lambda p, t: 10.0 * int(p[1:]), **kwargs)


def rank_loader(dataset, rank, tokenizer, batch_size=2):
    held_out = EvalWeighted(dataset)
    sampler = PaddingMarkedSampler(held_out, num_replicas=2, rank=rank, shuffle=False)
    return DataLoader(held_out, batch_size=batch_size, sampler=sampler,
                      collate_fn=weighted_collator(DataCollatorRLHF(8, pad_token_id=tokenizer.pad_token_id)))


@pytest.mark.parametrize("shuffle", [False, True])
def test_padding_marked_sampler_counts_each_index_once_over_the_ranks(shuffle):
    data = list(range(5))
    per_rank = [list(PaddingMarkedSampler(data, num_replicas=2, rank=r, shuffle=shuffle, seed=3)) for r in (0, 1)]
    assert len(per_rank[0]) == len(per_rank[1]) == 3  # same count: the same number of (collective) batches
    real = sorted(i for pairs in per_rank for i, padding in pairs if not padding)
    assert real == data
    assert sum(padding for pairs in per_rank for _, padding in pairs) == 1
    # the indices are DistributedSampler's, in its order
    for r in (0, 1):
        plain = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=r, shuffle=shuffle, seed=3)
        assert [i for i, _ in per_rank[r]] == list(plain)


def test_eval_weight_reaches_the_batch_through_the_collator(tokenizer):
    batches = list(rank_loader(prompts(5), 1, tokenizer))
    assert [b["prompt_text"] for b in batches] == [["p1", "p3"], ["p0"]]
    assert [b["eval_weight"].tolist() for b in batches] == [[1.0, 1.0], [0.0]]


def test_two_ranks_score_each_held_out_prompt_once(tokenizer):
    results = [evaluate(rank_loader(prompts(5), r, tokenizer), tokenizer) for r in (0, 1)]
    # what all_reduce would add up: each rank's sums are its mean times its count
    count = sum(r["prompts"] for r in results)
    assert count == 5
    assert sum(r["reward_mean"] * r["prompts"] for r in results) / count == pytest.approx(2.0)  # mean of 0..4
    assert sum(r["rule_score_mean"] * r["prompts"] for r in results) / count == pytest.approx(20.0)
    assert [e["prompt"] for e in results[1]["examples"]] == ["p1", "p3"]  # the repeat of p0 is not an example


def test_weight_zero_rows_are_left_out_and_missing_weights_count_once(tokenizer):
    collate = DataCollatorRLHF(8, pad_token_id=tokenizer.pad_token_id)
    weighted = [{**item, "eval_weight": w} for item, w in zip(prompts(4), (1.0, 0.0, 1.0, 0.0))]
    result = evaluate([collate(weighted[:2]), collate(weighted[2:])], tokenizer)
    assert result["prompts"] == 2
    assert result["reward_mean"] == pytest.approx(1.0)  # prompts 0 and 2
    assert result["rule_score_mean"] == pytest.approx(10.0)
    assert [e["prompt"] for e in result["examples"]] == ["p0", "p2"]
    plain = evaluate([collate(prompts(4))], tokenizer)
    assert plain["prompts"] == 4 and plain["reward_mean"] == pytest.approx(1.5)
    # max_prompts counts rows, padding included, so every rank stops after the same batch
    capped = evaluate([collate(weighted[:2]), collate(weighted[2:])], tokenizer, max_prompts=2)
    assert capped["prompts"] == 1


def test_the_reward_function_is_scored_on_the_held_out_answers_without_padding_rows(tokenizer):
    """Step 3's --reward_fn (e.g. GRPO without a reward model) is reported as reward_fn_mean, unweighted, over the
    counted rows, and called with the answers and the dataset's extra columns."""
    calls = []

    def reward_fn(prompts, answers, level):
        calls.append((list(prompts), list(answers), list(level)))
        return [float(x) for x in level]

    collate = DataCollatorRLHF(8, pad_token_id=tokenizer.pad_token_id)
    weighted = [{**item, "eval_weight": w} for item, w in zip(prompts(4), (1.0, 0.0, 1.0, 1.0))]
    batches = [{**collate(weighted[:2]), "level": [3, 100]}, {**collate(weighted[2:]), "level": [5, 7]}]
    result = evaluate(batches, tokenizer, reward_fn=reward_fn)
    assert result["reward_fn_mean"] == pytest.approx(5.0)  # rows 0, 2, 3; the padding row's 100 stays out
    assert result["reward_mean"] == pytest.approx(5 / 3)  # the reward model's score stays its own
    assert [e["reward_fn"] for e in result["examples"]] == [3.0, 5.0, 7.0]
    assert calls[0][0] == ["p0"] and calls[0][1] == [result["examples"][0]["answer"]], "not called on padding rows"
    assert calls[0][2] == [3] and calls[1][2] == [5, 7]
    assert "reward_fn_mean" not in evaluate(batches, tokenizer)


def test_held_out_sequences_are_padded_to_pad_to_multiple_of_without_changing_scores(tokenizer):
    answer = tokenizer(" ok ok", add_special_tokens=False)["input_ids"][:2]
    collate = DataCollatorRLHF(8, pad_token_id=tokenizer.pad_token_id)
    batches = [collate(prompts(4))]
    results, models = [], []
    for multiple in (1, 8):
        models.append(FakeReward())
        results.append(evaluate_policy(fake_generate(answer), SimpleNamespace(module=models[-1]), tokenizer, batches,
                                       "cpu", 2, lambda p, t: 10.0 * int(p[1:]), pad_to_multiple_of=multiple))
    assert models[0].lengths == [3] and models[1].lengths == [8]  # 1 prompt + 2 answer tokens, then 5 padding
    assert results[0] == results[1]
    assert results[1]["reward_mean"] == pytest.approx(1.5) and results[1]["rule_score_mean"] == pytest.approx(15.0)


def test_no_held_out_prompts_is_no_score_not_a_mean_of_zero(tokenizer):
    # a phase-3 share with no eval records: like step 2's accuracy, the means are None, and the report says so
    from dschat.report import summary_lines

    result = evaluate([], tokenizer, reward_fn=lambda prompts, answers: [1.0] * len(answers))
    assert result["prompts"] == 0
    assert result["reward_mean"] is result["rule_score_mean"] is result["reward_fn_mean"] is None
    held = {"sft_policy": result, "ppo_policy": result, "prompts": 0}
    assert "held-out PPO policy: no held-out prompts, so no score" in summary_lines({"timings_s": {}, "held_out": held})


def test_the_summary_names_step_3s_algorithm(tmp_path):
    """A GRPO run's summary said "held-out ppo_policy" and "PPO: 3 iterations"."""
    from dschat.report import build_report, summary_lines
    from dschat.run_layout import FINISHED_MARK, PPO_DIR

    os.makedirs(tmp_path / PPO_DIR)
    result = {"reward_mean": None, "rule_score_mean": 0.5, "reward_fn_mean": 0.25}
    with open(tmp_path / PPO_DIR / FINISHED_MARK, "w") as f:
        json.dump({"iterations": 3, "algorithm": "GRPO", "eval_before": result, "eval_after": result}, f)
    with open(tmp_path / PPO_DIR / "step3_log.jsonl", "w") as f:
        f.write(json.dumps({"reward": 0.5, "kl": 0.001}) + "\n")
    lines = summary_lines(build_report(str(tmp_path), {}, recipe="grpo"))
    assert "held-out SFT policy: rule score 0.5000, reward_fn 0.2500" in lines
    assert "held-out GRPO policy: rule score 0.5000, reward_fn 0.2500" in lines
    assert "GRPO: 3 iterations, final KL 0.0010" in lines
    with open(tmp_path / PPO_DIR / FINISHED_MARK, "w") as f:
        json.dump({"iterations": 1, "algorithm": "GRPO", "eval_before": result, "eval_after": result}, f)
    assert "GRPO: 1 iteration, final KL 0.0010" in summary_lines(build_report(str(tmp_path), {}, recipe="grpo"))
    # a step 3 written before metrics.json named its algorithm: its training_args.json's --advantage_estimator
    from dschat.run_layout import RUN_ARGS_FILE

    with open(tmp_path / PPO_DIR / FINISHED_MARK, "w") as f:
        json.dump({"iterations": 3, "eval_before": result, "eval_after": result}, f)
    with open(tmp_path / PPO_DIR / RUN_ARGS_FILE, "w") as f:
        json.dump({"step": "step3", "flags": {"advantage_estimator": "grpo"}}, f)
    assert build_report(str(tmp_path), {}, recipe="grpo")["step3_algorithm"] == "GRPO"
    os.remove(tmp_path / PPO_DIR / RUN_ARGS_FILE)
    assert build_report(str(tmp_path), {}, recipe="grpo")["step3_algorithm"] == "PPO"  # (nothing says otherwise)


def test_the_summary_says_a_grpo_runs_final_kl_loss_beside_its_k1_kl(tmp_path):
    """A GRPO run's summary said only the final KL, the rollout's k1, and not the kl_loss its loss penalised (k3
    unless --kl_estimator). It now says that too, in the term's estimator where the run's flags name it; a run with
    no KL loss term (PPO's KL in the reward) says the KL alone."""
    from dschat.report import build_report, summary_lines
    from dschat.run_layout import FINISHED_MARK, PPO_DIR, RUN_ARGS_FILE

    os.makedirs(tmp_path / PPO_DIR)
    result = {"reward_mean": None, "rule_score_mean": 0.5, "reward_fn_mean": None}
    with open(tmp_path / PPO_DIR / FINISHED_MARK, "w") as f:
        json.dump({"iterations": 2, "algorithm": "GRPO", "eval_before": result, "eval_after": result}, f)
    log = [{"reward": 0.5, "kl": -0.002, "kl_loss": 0.001}, {"reward": 0.6, "kl": 0.004, "kl_loss": 0.003}]
    (tmp_path / PPO_DIR / "step3_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    said = "GRPO: 2 iterations, final KL 0.0010 (mean of the last 2 iterations), final kl_loss{} 0.0020 (mean of the " \
           "last 2 iterations)"
    assert said.format("") in summary_lines(build_report(str(tmp_path), {}, recipe="grpo"))  # (no flags to name it)
    for estimator, named in ((None, "k3"), ("k2", "k2")):
        with open(tmp_path / PPO_DIR / RUN_ARGS_FILE, "w") as f:
            json.dump({"step": "step3", "flags": {"advantage_estimator": "grpo", "kl_estimator": estimator}}, f)
        report = build_report(str(tmp_path), {}, recipe="grpo")
        assert report["step3_kl_loss_estimator"] == named
        assert said.format(f" ({named})") in summary_lines(report)
    log = [{"reward": 0.5, "kl": 0.012}]  # PPO: the KL in the reward, no kl_loss
    (tmp_path / PPO_DIR / "step3_log.jsonl").write_text(json.dumps(log[0]) + "\n")
    with open(tmp_path / PPO_DIR / FINISHED_MARK, "w") as f:
        json.dump({"iterations": 1, "algorithm": "PPO", "eval_before": result, "eval_after": result}, f)
    assert "PPO: 1 iteration, final KL 0.0120" in summary_lines(build_report(str(tmp_path), {}))


def test_the_report_says_the_final_kl_as_a_mean_of_the_last_iterations():
    """The last iteration's k1 estimate alone fell below 0 on a GRPO run ("final KL -0.0091")."""
    from dschat.report import final_kl_said

    kl = [0.5] * 20 + [0.05, 0.03, 0.01, 0.02, 0.04, 0.06, 0.05, 0.03, 0.02, -0.01]
    assert final_kl_said(kl) == "final KL 0.0300 (mean of the last 10 iterations)"
    assert final_kl_said([0.012]) == "final KL 0.0120"
    assert final_kl_said([None]) == "no KL logged"


def test_the_held_out_line_leaves_out_scores_no_source_gave():
    """A critic-free run printed "reward_mean=None" beside its reward function's mean."""
    from dschat.steps.ppo import _eval_line

    line = _eval_line({"reward_mean": None, "reward_fn_mean": 0.5, "prompts": 4, "examples": [{"answer": "x"}]})
    assert "reward_fn_mean" in line and "prompts" in line and "None" not in line and "reward_mean" not in line


def test_empty_held_out_answers_are_counted_and_said(tokenizer):
    """A policy that ends its answers at once (a short step 1 of a real model: EOS the most likely first token) read
    "rule score 0.0000" in the report and eval.py with nothing to say why; the held-out evaluation now counts its
    empty answers (padding rows left out, as the means leave them), and the report and eval.py say them."""
    from dschat.report import summary_lines
    from dschat.tools.ppo_eval import summary_line

    collate = DataCollatorRLHF(8, pad_token_id=tokenizer.pad_token_id)
    weighted = [{**item, "eval_weight": w} for item, w in zip(prompts(3), (1.0, 1.0, 0.0))]
    empty = evaluate_policy(fake_generate([tokenizer.eos_token_id, tokenizer.pad_token_id]),
                            SimpleNamespace(module=FakeReward()), tokenizer, [collate(weighted)], "cpu", 2,
                            lambda p, t: float(bool(t)))
    assert empty["prompts"] == 2 and empty["empty_answers"] == 2 and empty["rule_score_mean"] == 0.0
    answered = evaluate([collate(weighted)], tokenizer)
    assert answered["empty_answers"] == 0
    held = {"sft_policy": answered, "ppo_policy": empty, "prompts": 2}
    lines = summary_lines({"timings_s": {}, "held_out": held})
    assert "held-out PPO policy: reward 0.5000, rule score 0.0000, 2 of 2 answers empty" in lines
    assert "held-out SFT policy: reward 0.5000, rule score 5.0000" in lines  # (none empty: nothing said)
    assert summary_line("policy", {**empty, "path": "p"}).endswith("over 2 prompts, 2 of 2 answers empty (p)")
    assert summary_line("policy", {**answered, "path": "p"}).endswith("over 2 prompts (p)")


def _tiny_reward_model(family, tokenizer):
    from transformers import AutoModel, LlamaConfig, RwkvConfig

    from dschat.models.reward_model import RewardModel

    torch.manual_seed(0)
    size = dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2)
    config = RwkvConfig(**size, attention_hidden_size=32, intermediate_size=64, context_length=64,
                        bos_token_id=None, eos_token_id=None) if family == "rwkv" else \
        LlamaConfig(**size, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=64)
    model = RewardModel(AutoModel.from_config(config)).eval()
    torch.nn.init.normal_(model.v_head.weight)
    return model


@pytest.mark.parametrize("family", ["rwkv", "llama"])
def test_held_out_rows_are_scored_shifted_as_step_3s_rollouts(family, tokenizer):
    """Step 3's held-out evaluation scored every row left-padded, while its rollouts score rows shifted to start at
    their first token (``forward_layout``): RWKV's recurrence reads no attention mask, so its reward_mean was another
    number than the rollouts' scores. Now each row scores as it would alone; with --padded_forwards, as the rollouts
    then do, left-padded. A model that masks its padding (Llama) gives the same mean either way."""
    from dschat.rlhf.layout import reward_scores

    model = _tiny_reward_model(family, tokenizer)
    collate = DataCollatorRLHF(8, pad_token_id=tokenizer.pad_token_id)
    ids = [[40, 41, 42, 43, 44], [50], [60, 61, 62]]  # prompts of 3 lengths: 4, 0 and 2 left pads
    batch = collate([{"prompt_input_ids": torch.tensor(row), "prompt_text": f"p{i}"} for i, row in enumerate(ids)])
    answer = [70, 71]
    run = functools.partial(evaluate_policy, fake_generate(answer), SimpleNamespace(module=model), tokenizer, [batch],
                            "cpu", 2)
    with torch.no_grad():
        alone = [model.end_scores(torch.tensor([row + answer]), torch.ones(1, len(row) + 2, dtype=torch.long)).item()
                 for row in ids]
        seq = torch.cat([batch["prompt"], torch.tensor(answer).expand(3, -1)], 1)
        padded = reward_scores(model, seq, torch.cat([batch["prompt_att_mask"], torch.ones(3, 2)], 1).long())
        shifted, masked = run()["reward_mean"], run(padded_forwards=True)["reward_mean"]
    assert shifted == pytest.approx(sum(alone) / 3, abs=1e-5)
    assert masked == pytest.approx(padded.double().mean().item(), abs=1e-5)
    if family == "rwkv":  # (what the shift mends)
        assert abs(shifted - masked) > 1e-2
    else:
        assert shifted == pytest.approx(masked, abs=1e-5)



def test_a_held_out_evaluation_called_without_synced_gpus_leaves_it_to_hfs_default(tokenizer):
    """evaluate_policy's ``synced_gpus`` defaulted to False: a user calling it on a ZeRO-3 model on several ranks hung
    inside HF generate once one rank's answers ended first. Unsaid, it is None now: HF's own default (ZeRO-3 or FSDP
    on several ranks) decides, as a plain ``generate`` call's would."""
    said = []
    answer = fake_generate(tokenizer(" ok ok", add_special_tokens=False)["input_ids"][:2])

    def generate(prompt, synced_gpus="not passed", **kwargs):
        said.append(synced_gpus)
        return answer(prompt, **kwargs)

    evaluate_policy(generate, SimpleNamespace(module=FakeReward()), tokenizer, rank_loader(prompts(2), 0, tokenizer),
                    "cpu", 2)
    assert said == [None]
