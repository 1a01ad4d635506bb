"""DPO: the loss and its implicit rewards by hand, answer-only log-probs, the step end to end (also ZeRO-3 on
2 ranks), and ``train.py --recipe dpo``."""
import json
import math
import runpy

import pytest
import torch
from transformers import AutoModelForCausalLM

from dschat import pipeline
from dschat.args import step2_dpo_parser
from dschat.data import DataCollatorDPO, create_prompt_dataset, format_answer, format_prompt
from dschat.models.loading import resolve_model_path
from dschat.rlhf.dpo import answer_nll, dpo_loss, preference_accuracy, preference_ties, response_log_probs
from dschat.steps import dpo
from helpers import SFT_FAST
from launch import REPO, run_deepspeed

T = torch.tensor
TRAIN_PY = runpy.run_path(str(REPO / "train.py"))  # the script's functions (its __main__ block does not run)
METRIC_KEYS = {"eval_loss", "chosen_reward", "rejected_reward", "reward_margin", "reward_accuracy", "chosen_logp",
               "rejected_logp", "logp_accuracy", "reference_logp_accuracy", "chosen_nll", "eval_pairs", "train_loss",
               "steps"}


# --- the loss, by hand ---

# three pairs (beta 0.5): the policy prefers the chosen answer more than the reference does (beta * logits = 1),
# the policy is the reference (0), the policy prefers the rejected answer (-1.5)
POLICY_CHOSEN, POLICY_REJECTED = T([-1.0, -4.0, -5.0]), T([-3.0, -1.0, -2.0])
REF_CHOSEN, REF_REJECTED = T([-2.0, -4.0, -3.0]), T([-2.0, -1.0, -3.0])


def test_dpo_loss_and_rewards_match_hand_computed_values():
    losses, chosen, rejected = dpo_loss(POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5)
    # -logsigmoid(z) = log(1 + exp(-z)) for z = 1, 0, -1.5
    assert losses.tolist() == pytest.approx([0.31326168751822286, math.log(2), 1.7014132779827524])
    assert chosen.tolist() == pytest.approx([0.5, 0.0, -1.0])  # 0.5 * (policy - reference)
    assert rejected.tolist() == pytest.approx([-0.5, 0.0, 0.5])
    assert preference_accuracy(chosen, rejected).tolist() == [1.0, 0.5, 0.0]  # a tie is half a win
    assert preference_accuracy(T([1e-6, 0.5]), T([0.0, 0.0]), tie=1e-4).tolist() == [0.5, 1.0]  # so is a rounding


def test_preference_accuracy_counts_a_tie_half_and_a_nan_as_a_miss():
    """A model that scores every pair alike is at chance (0.5), not at 0.0 as if it always preferred the rejected
    answer (ties counted as misses, TRL's DPO and DeepSpeed-Chat's step 2); preference_ties counts them."""
    chosen, rejected = T([2.0, 1.0, 1.0, float("nan"), 0.0]), T([1.0, 1.0, 2.0, 0.0, 5e-4])
    assert preference_accuracy(chosen, rejected).tolist() == [1.0, 0.5, 0.0, 0.0, 0.0]
    assert preference_ties(chosen, rejected).tolist() == [False, True, False, False, False]
    assert preference_ties(chosen, rejected, tie=1e-3).tolist() == [False, True, False, False, True]
    assert preference_accuracy(chosen, rejected, tie=1e-3).tolist() == [1.0, 0.5, 0.0, 0.0, 0.5]
    alike = torch.zeros(8)
    assert preference_accuracy(alike, alike).mean().item() == 0.5


def test_label_smoothing_is_conservative_dpo():
    # (1 - e) * log(1 + exp(-z)) + e * log(1 + exp(z)) = log(1 + exp(-z)) + e * z
    losses, _, _ = dpo_loss(POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5, label_smoothing=0.2)
    assert losses.tolist() == pytest.approx([0.31326168751822286 + 0.2, math.log(2), 1.7014132779827524 - 0.3])


def test_dpo_gradient_raises_chosen_and_lowers_rejected_log_probs():
    policy_chosen = POLICY_CHOSEN[:1].clone().requires_grad_()
    policy_rejected = POLICY_REJECTED[:1].clone().requires_grad_()
    losses, chosen, _ = dpo_loss(policy_chosen, policy_rejected, REF_CHOSEN[:1], REF_REJECTED[:1], beta=0.5)
    losses.sum().backward()
    # d/d(policy_chosen) = -beta * sigmoid(-z) with z = 1
    assert policy_chosen.grad.item() == pytest.approx(-0.5 * 0.2689414213699951)
    assert policy_rejected.grad.item() == pytest.approx(0.5 * 0.2689414213699951)
    assert not chosen.requires_grad  # rewards are reported, not trained on


@pytest.mark.parametrize("beta, label_smoothing", [(0.0, 0.0), (-0.1, 0.0), (0.1, 0.5), (0.1, -0.1)])
def test_invalid_beta_or_label_smoothing_is_rejected(beta, label_smoothing):
    flag = "--beta must be a finite number > 0" if beta <= 0 else r"--label_smoothing must be in \[0, 0.5\)"  # (named as a flag)
    with pytest.raises(ValueError, match=flag):
        dpo_loss(POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, beta, label_smoothing)


def test_rpo_term_is_the_chosen_answers_mean_token_nll():
    mask = T([[0, 1, 1, 1, 0], [0, 0, 0, 1, 1]])  # targets at positions 1.. : 3 and 2 answer tokens; pad ignored
    assert answer_nll(T([-6.0, -3.0]), mask).item() == pytest.approx((6 + 3) / 5)  # per token, not per sequence


def test_dpo_step_loss_adds_rpo_alpha_times_chosen_nll(monkeypatch):
    step = dpo.DPOStep(step2_dpo_parser().parse_args(["--beta", "0.5", "--rpo_alpha", "2.0"]))
    logps = (POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED)
    monkeypatch.setattr(step, "pair_log_probs", lambda engine, batch: logps)
    mask = torch.ones(6, 5, dtype=torch.long)  # 3 pairs (chosen rows first), 4 answer targets each
    loss, _ = step.loss(None, {"response_mask": mask, "attention_mask": mask})
    dpo_mean = dpo_loss(*logps, beta=0.5)[0].mean()
    # (two terms: the pairs' mean, and the NLL per token, which --loss_agg global_token_mean reweighs over the step)
    assert loss.records.item() == pytest.approx(dpo_mean.item())
    assert loss.tokens.item() == pytest.approx(2.0 * (1.0 + 4.0 + 5.0) / 4 / 3)
    assert step.recipe().loss_tokens({"response_mask": mask}) == 3 * 4  # (the chosen rows' answer targets)


def test_dpo_eval_reports_the_chosen_nll_that_rpo_alpha_trains_on(monkeypatch):
    # with --rpo_alpha (train.py's DPO recipe: 1.0) train_loss holds the SFT term and eval_loss does not (6.47 against
    # 0.68 on a tiny run), and nothing held out measured that term (TRL logs it as nll_loss)
    step = dpo.DPOStep(step2_dpo_parser().parse_args(["--beta", "0.5", "--rpo_alpha", "2.0"]))
    logps = iter([(POLICY_CHOSEN[:2], POLICY_REJECTED[:2], REF_CHOSEN[:2], REF_REJECTED[:2]),
                  (POLICY_CHOSEN[2:], POLICY_REJECTED[2:], REF_CHOSEN[2:], REF_REJECTED[2:])])
    monkeypatch.setattr(step, "pair_log_probs", lambda engine, batch: next(logps))
    first = {"response_mask": T([[0, 1, 1, 1], [0, 0, 0, 1], [0, 1, 1, 1], [0, 1, 1, 1]])}  # chosen: 3 and 1 tokens
    second = {"response_mask": T([[0, 1, 1, 1], [0, 0, 1, 1]])}  # chosen: 3 tokens
    metrics = step.evaluate(torch.nn.Identity(), [first, second], "cpu")
    assert metrics["chosen_nll"] == pytest.approx((1.0 + 4.0 + 5.0) / (3 + 1 + 3))  # per held-out token
    assert metrics["eval_loss"] == pytest.approx(dpo_loss(POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED,
                                                          beta=0.5)[0].mean().item())  # (the DPO loss alone)
    assert step.evaluate(torch.nn.Identity(), [], "cpu")["chosen_nll"] is None


@pytest.mark.parametrize("argv", [["--beta", "0"], ["--label_smoothing", "0.5"], ["--include_prompt_in_loss"],
                                  ["--multiturn"], ["--rpo_alpha", "-1"], ["--beta", "inf"], ["--rpo_alpha", "nan"],
                                  ["--rpo_alpha", "inf"]])
def test_dpo_step_rejects_bad_flags_before_building_anything(argv):
    with pytest.raises(ValueError):
        dpo.DPOStep(step2_dpo_parser().parse_args(argv))


def test_dpo_help_says_the_step1_flags_it_refuses_are_errors():
    """DPO's --help listed step 1's --include_prompt_in_loss ("Train on prompt tokens too") and --multiturn ("Train on
    every assistant turn") with their step-1 help, while DPO refuses both: its help now says so; step 1's is kept."""
    from dschat.args import step1_parser

    dpo_help = {action.dest: action.help for action in step2_dpo_parser()._actions}
    step1_help = {action.dest: action.help for action in step1_parser()._actions}
    for flag in ("include_prompt_in_loss", "multiturn"):
        assert dpo_help[flag].startswith("Step 1's flag, an error here") and step1_help[flag].startswith("Train on")


# --- answer-only log-probs ---

def test_response_log_probs_sum_answer_tokens_only():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11)
    ids = torch.randint(0, 11, (2, 6))
    mask = T([[0, 0, 0, 1, 1, 0],   # prompt of 3, answer of 2, one pad
              [0, 0, 1, 1, 1, 1]])  # prompt of 2, answer of 4
    logp = torch.log_softmax(logits, -1)
    expected = [sum(logp[b, t - 1, ids[b, t]] for t in range(1, 6) if mask[b, t]) for b in range(2)]
    got = response_log_probs(logits, ids, mask)
    assert got.tolist() == pytest.approx([e.item() for e in expected], abs=1e-6)
    assert response_log_probs(logits, ids, mask, chunk_size=1).tolist() == pytest.approx(got.tolist(), abs=1e-6)
    # logits that predict prompt tokens, padding, or nothing (the last position) do not count
    noise = logits.clone()
    noise[0, [0, 1, 4, 5]] += 5 * torch.randn(4, 11)
    noise[1, [0, 5]] += 5 * torch.randn(2, 11)
    assert response_log_probs(noise, ids, mask).tolist() == pytest.approx(got.tolist(), abs=1e-6)
    # the logits that predict the first answer token do
    noise[0, 2] += 5 * torch.randn(11)
    assert response_log_probs(noise, ids, mask)[0].item() != pytest.approx(got[0].item(), abs=1e-3)


def test_dpo_collator_masks_prompt_and_padding():
    items = [{"chosen_input_ids": T([1, 2, 3]), "chosen_attention_mask": T([1, 1, 1]),
              "rejected_input_ids": T([1, 2, 4, 5, 6]), "rejected_attention_mask": T([1, 1, 1, 1, 1]),
              "prompt_length": 2},
             {"chosen_input_ids": T([7, 8]), "chosen_attention_mask": T([1, 1]),
              "rejected_input_ids": T([7, 9, 9]), "rejected_attention_mask": T([1, 1, 1]), "prompt_length": 1}]
    batch = DataCollatorDPO(0)(items)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0, 0], [7, 8, 0, 0, 0], [1, 2, 4, 5, 6], [7, 9, 9, 0, 0]]
    assert batch["response_mask"].tolist() == [[0, 0, 1, 0, 0], [0, 1, 0, 0, 0], [0, 0, 1, 1, 1], [0, 1, 1, 0, 0]]
    assert batch["answer_start"] == 1  # the earliest answer column of any row, an int (no device sync later)
    padded = DataCollatorDPO(0, pad_to_multiple_of=4)(items)  # --pad_to_multiple_of: 3 more padding columns
    assert padded["input_ids"].shape == padded["response_mask"].shape == (4, 8)
    assert padded["response_mask"].tolist() == [row + [0, 0, 0] for row in batch["response_mask"].tolist()]
    assert padded["attention_mask"][:, 5:].eq(0).all() and padded["answer_start"] == 1


def test_dpo_collator_leaves_the_eot_of_a_cut_answer_out_of_the_answer():
    # training the EOT right after a cut answer would teach the policy to stop mid-sentence (step 1 drops it too)
    items = [{"chosen_input_ids": T([1, 2, 3, 4, 9]), "chosen_attention_mask": T([1] * 5),
              "rejected_input_ids": T([1, 2, 5, 9]), "rejected_attention_mask": T([1] * 4), "prompt_length": 2,
              "chosen_truncated": True, "rejected_truncated": False, "eot_length": 1},
             {"chosen_input_ids": T([1, 6, 8, 9]), "chosen_attention_mask": T([1] * 4),
              "rejected_input_ids": T([1, 7, 7, 8, 9]), "rejected_attention_mask": T([1] * 5), "prompt_length": 1,
              "chosen_truncated": False, "rejected_truncated": True, "eot_length": 2}]  # a two-token EOT
    batch = DataCollatorDPO(0, pad_to_multiple_of=8)(items)
    assert batch["input_ids"][:, :5].tolist() == [[1, 2, 3, 4, 9], [1, 6, 8, 9, 0], [1, 2, 5, 9, 0], [1, 7, 7, 8, 9]]
    assert batch["response_mask"].tolist() == [[0, 0, 1, 1, 0, 0, 0, 0], [0, 1, 1, 1, 0, 0, 0, 0],
                                               [0, 0, 1, 1, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]]
    assert batch["attention_mask"][:, :5].tolist() == [[1] * 5, [1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1] * 5]


def test_dpo_trains_no_eot_after_an_answer_cut_by_max_seq_len(tmp_path, tokenizer):
    long_answer = " ".join(["word"] * 60)
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "Count the words.", "chosen": long_answer, "rejected": "No."}) + "\n")
    train_data, _ = create_prompt_dataset(0, [f"{path},{path}"], "0,1,0", str(tmp_path / "out"), 2, 1234, tokenizer,
                                          24)
    item = train_data[0]
    batch = DataCollatorDPO(tokenizer.pad_token_id)([item])
    chosen = batch["input_ids"][0][batch["response_mask"][0].bool()]
    rejected = batch["input_ids"][1][batch["response_mask"][1].bool()]
    assert item["chosen_input_ids"][-1].item() == tokenizer.eos_token_id  # the reward model's input keeps it
    assert len(chosen) == 24 - item["prompt_length"] - 1 and tokenizer.eos_token_id not in chosen.tolist()
    assert tokenizer.decode(rejected) == format_answer("No.", tokenizer)  # a whole answer still ends with EOT


def write_pairs(path, count, start=0):
    # the rejected answer is the shorter one, so an untrained model finds it more likely
    rows = [{"prompt": f"Tell me about record {i}.", "chosen": f"Record {i} is fine, thanks.",
             "rejected": f"Record {i} is bad."} for i in range(start, start + count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_phase_2_pairs_carry_the_prompt_length(tmp_path, tokenizer):
    path = write_pairs(tmp_path / "pairs.jsonl", 4)
    train_data, _ = create_prompt_dataset(0, [f"{path},{path}"], "0,1,0", str(tmp_path / "out"), 2, 1234, tokenizer,
                                          128)
    batch = DataCollatorDPO(tokenizer.pad_token_id)([train_data[i] for i in range(len(train_data))])
    half = len(train_data)
    for row, item in enumerate(train_data):
        record = int(tokenizer.decode(item["chosen_input_ids"]).split("record ")[1].split(".")[0])
        prompt = format_prompt([{"role": "user", "content": f"Tell me about record {record}."}], tokenizer)
        assert item["prompt_length"] == len(tokenizer(prompt)["input_ids"])
        for side, offset, answer in (("chosen", 0, f"Record {record} is fine, thanks."),
                                     ("rejected", half, f"Record {record} is bad.")):
            ids, mask = batch["input_ids"][row + offset], batch["response_mask"][row + offset]
            assert tokenizer.decode(ids[:item["prompt_length"]]) == prompt
            assert tokenizer.decode(ids[mask.bool()]) == format_answer(answer, tokenizer)  # answer + EOT


def test_answer_log_probs_ignore_padding_and_batch_neighbours(tokenizer, distributed):
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-llama")).eval()
    items = [{"chosen_input_ids": T([5, 6, 7, 8, 2]), "chosen_attention_mask": T([1] * 5),
              "rejected_input_ids": T([5, 6, 7, 9, 9, 9, 9, 2]), "rejected_attention_mask": T([1] * 8),
              "prompt_length": 3}]
    head_inputs = []
    handle = model.lm_head.register_forward_hook(lambda module, args, out: head_inputs.append(args[0].shape[1]))
    with torch.no_grad():
        batch = DataCollatorDPO(tokenizer.pad_token_id)(items)
        padded = dpo.sequence_log_probs(model, batch)
        handle.remove()
        without_start = {k: v for k, v in batch.items() if k != "answer_start"}  # a batch from elsewhere
        torch.testing.assert_close(dpo.sequence_log_probs(model, without_start), padded)
        # --pad_to_multiple_of's extra columns (8 -> 16) change no answer log-prob
        rounded = DataCollatorDPO(tokenizer.pad_token_id, pad_to_multiple_of=16)(items)
        assert rounded["input_ids"].shape == (2, 16)
        torch.testing.assert_close(dpo.sequence_log_probs(model, rounded), padded)
        alone = model(input_ids=items[0]["chosen_input_ids"][None]).logits
        expected = torch.log_softmax(alone[0, 2:-1], -1).gather(-1, T([8, 2])[:, None]).sum()
        rejected = torch.log_softmax(model(input_ids=items[0]["rejected_input_ids"][None]).logits[0, 2:-1], -1)
        expected_rejected = rejected.gather(-1, T([9, 9, 9, 9, 2])[:, None]).sum()
    assert padded[0].item() == pytest.approx(expected.item(), abs=1e-5)
    assert padded[1].item() == pytest.approx(expected_rejected.item(), abs=1e-5)
    # the LM head ran from the position before the first answer token on (8 - 2), not over the prompt
    assert head_inputs == [6]


# --- the step end to end ---

@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """One tokenized-data cache for the step tests (the tiny data is tokenized once)."""
    return str(tmp_path_factory.mktemp("dpo_data"))


def test_dpo_step_trains_saves_and_reports_metrics(tmp_path, data_dir, distributed, capsys):
    out = tmp_path / "dpo"
    metrics = dpo.main(["--output_dir", str(out), "--data_output_path", data_dir, "--max_steps", "4",
                        "--enable_tensorboard", "--tensorboard_path", str(tmp_path / "tb"), *SFT_FAST])
    assert set(metrics) >= METRIC_KEYS
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["eval_loss"] == pytest.approx(metrics["eval_loss"]) and saved["eval_pairs"] == 64
    # before training the policy is the reference: every implicit reward is 0 and the loss is ln 2
    printed = capsys.readouterr().out
    assert "before training: eval_loss=0.6931, chosen_reward=0.0000, rejected_reward=0.0000, reward_accuracy=0.5000" \
        in printed, printed  # (every pair a tie, half a win each; rounding between the two forwards decided it once)
    assert "reward_ties=64" in printed.split("before training:")[1].splitlines()[0], printed
    assert metrics["reward_margin"] == pytest.approx(metrics["chosen_reward"] - metrics["rejected_reward"])
    model = AutoModelForCausalLM.from_pretrained(out)
    start = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-llama"))
    assert not torch.equal(model.lm_head.weight, start.lm_head.weight)
    assert (out / "tokenizer.json").exists()
    assert list((tmp_path / "tb" / "step2_dpo").glob("events.out.tfevents.*"))
    # a shorter re-run into the same folders: its curves replace the first run's, in dschat's writer and DeepSpeed's
    dpo.main(["--output_dir", str(out), "--data_output_path", data_dir, "--max_steps", "2",
              "--enable_tensorboard", "--tensorboard_path", str(tmp_path / "tb"), *SFT_FAST])
    assert _event_steps(tmp_path / "tb" / "step2_dpo", "step2_dpo/train/loss") == [1, 2]
    deepspeed_lr = _event_steps(tmp_path / "tb" / "ds_tensorboard_logs" / "step2_dpo_model_tensorboard",
                                "Train/Samples/lr")
    assert len(deepspeed_lr) == 2 and deepspeed_lr == sorted(deepspeed_lr), deepspeed_lr


def _event_steps(folder, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


def test_dpo_overfits_a_few_pairs(tmp_path, distributed):
    """Train = eval: the untrained model finds the (shorter) rejected answers more likely; DPO must flip that."""
    path = write_pairs(tmp_path / "pairs.jsonl", 16)
    metrics = dpo.main(["--data_path", f"{path},{path}", "--data_split", "0,1,0", "--output_dir", str(tmp_path / "dpo"),
                        "--data_output_path", str(tmp_path / "data"), "--per_device_train_batch_size", "8",
                        "--num_train_epochs", "10", "--learning_rate", "3e-3", "--num_warmup_steps", "0",
                        "--dtype", "fp32", "--beta", "0.1"])
    assert metrics["eval_loss"] < 0.1 < math.log(2)
    assert metrics["reward_accuracy"] == 1.0 and metrics["reward_margin"] > 3
    assert metrics["reference_logp_accuracy"] == 0.0 and metrics["logp_accuracy"] == 1.0


def test_dpo_is_not_stopped_by_margins_it_does_not_read(tmp_path, distributed, capsys):
    """Step 2's loss subtracts a pair's margin, so a file where some records lack one is an error there; DPO's loss has
    none, and it trains on the same file (as it did before step 2 read margins), saying the margins are not read."""
    path = tmp_path / "pairs.jsonl"
    rows = [json.loads(line) for line in open(write_pairs(path, 16))]
    for i, row in enumerate(rows):
        row.update({"margin": 1.5} if i % 2 else {})  # (half without one; one null)
    rows[2]["margin"] = None
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    metrics = dpo.main(["--data_path", f"{path},{path}", "--data_split", "0,1,0", "--output_dir", str(tmp_path / "dpo"),
                        "--data_output_path", str(tmp_path / "data"), "--max_steps", "1", *SFT_FAST])
    assert metrics["eval_pairs"] == 16
    assert "kept all 16 records; 8 with a margin, which is not read: DPO's loss has none" in capsys.readouterr().out


@pytest.mark.multirank
def test_dpo_with_zero3_policy_and_reference_on_two_ranks(tmp_path):
    out = tmp_path / "dpo"
    # Build the preset here, in the session's cache the ranks inherit: under torch.distributed, transformers writes
    # save_pretrained files on rank 0 only, so a preset first built by rank 1 would have no config or weights.
    resolve_model_path("tiny-llama")
    proc = run_deepspeed(REPO / "training" / "step2_dpo" / "main.py", "--zero_stage", "3", "--max_steps", "3",
                         "--output_dir", out, "--data_output_path", tmp_path / "data", *SFT_FAST,
                         "--per_device_train_batch_size", "8")
    assert "reference model tiny-llama: frozen, ZeRO-3" in proc.stdout
    assert "ZeRO-3, fp32" in proc.stdout  # the policy
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics) >= METRIC_KEYS and metrics["eval_pairs"] == 2 * 32  # --eval_iters 2 batches, over both ranks
    model = AutoModelForCausalLM.from_pretrained(out)  # gathered from the shards
    assert all(p.numel() > 0 for p in model.parameters())


# --- train.py --recipe dpo ---

def test_train_py_dpo_recipe_builds_the_dpo_step_arguments(tmp_path):
    args = TRAIN_PY["parse_args"](["--recipe", "dpo", "--output-dir", str(tmp_path), "--actor-zero-stage", "2",
                             "--step2-args", "--beta 0.2 --max_steps 5"])
    dpo_args = step2_dpo_parser().parse_args(pipeline.step_argv(2, args, tiny=True))
    assert dpo_args.model_name_or_path == str(tmp_path / "step1_sft")
    assert dpo_args.output_dir == str(tmp_path / "step2_dpo") and dpo_args.zero_stage == 2
    assert (dpo_args.beta, dpo_args.max_steps) == (0.2, 5)  # --step2-args win over the tiny recipe
    assert dpo_args.learning_rate == 1e-3 and dpo_args.data_split == "4,4,2" and dpo_args.rpo_alpha == 1.0
    assert dpo_args.label_smoothing == 0.0 and not dpo_args.offload_reference_model


# named, the embedded data lost its rule score; given by its files' paths too
@pytest.mark.parametrize("data", [[], ["--data-path", "tiny"], ["--data-path", "TINY_DIR"]])
def test_train_py_dpo_recipe_runs_step_1_then_dpo_only(tmp_path, monkeypatch, distributed, data, capsys):
    from dschat.report import DPO_REPORT_KEYS
    from dschat.steps import ppo, reward, sft

    calls = []
    monkeypatch.setattr(sft, "main", lambda argv: calls.append("sft"))
    monkeypatch.setattr(reward, "main", lambda argv: calls.append("reward"))
    monkeypatch.setattr(ppo, "main", lambda argv: calls.append("ppo"))

    def fake_dpo(argv):
        calls.append("dpo")
        metrics = {key: 0 if key.endswith("_ties") else 0.5 for key in DPO_REPORT_KEYS}  # (no pair tied)
        (tmp_path / "step2_dpo").mkdir()
        (tmp_path / "step2_dpo" / "metrics.json").write_text(json.dumps(metrics))

    monkeypatch.setattr(dpo, "main", fake_dpo)
    scores = {"sft": {"rule_score": 0.8, "prompts": 120}, "dpo": {"rule_score": 0.9, "prompts": 120}}
    monkeypatch.setattr(pipeline, "held_out_rule_scores", lambda args, dpo_flags: calls.append("rule") or scores)
    from dschat.tiny import DATA_DIR

    data = [str(DATA_DIR) if word == "TINY_DIR" else word for word in data]
    report = pipeline.run_pipeline(TRAIN_PY["parse_args"](["--recipe", "dpo", "--output-dir", str(tmp_path), *data]))
    assert calls == ["sft", "dpo", "rule"]
    assert json.loads((tmp_path / "report.json").read_text())["dpo"] == report["dpo"]
    assert report["dpo"]["logp_accuracy"] == 0.5
    assert report["dpo"]["held_out_rule_score"] == scores
    # kept with the DPO model too, with eval.py's flags for them: a later run's report.json does not take them away
    kept = json.loads((tmp_path / "step2_dpo" / "metrics.json").read_text())
    assert kept["logp_accuracy"] == 0.5 and kept["held_out_rule_score"] == scores
    assert kept["held_out_rule_score_flags"] == pipeline.held_out_rule_score_eval_flags()
    printed = capsys.readouterr().out
    assert "preference accuracy (chosen answer more likely, 0.5 pairs): SFT 0.5000 -> DPO 0.5000" in printed
    assert "held-out rule score of greedy answers (120 prompts): SFT 0.800 -> DPO 0.900" in printed

def _report_stand_ins(monkeypatch, loaded=None):
    """The DPO report's rule scoring with stand-ins for the policies (a tokenizer with an EOS: answers stop at it;
    ``loaded`` gets each load's add_eot_token), the generation and the scoring; its prompt loader stays the test's."""
    from types import SimpleNamespace

    import dschat.tools.ppo_eval  # noqa: F401 (before the patches: it copies the names, and kept the stand-ins)

    monkeypatch.setattr("dschat.tools.common.load_policy", lambda path, device, add_eot_token=False: (
        (loaded if loaded is not None else []).append(add_eot_token) or SimpleNamespace(device=device),
        SimpleNamespace(eos_token_id=2)))
    monkeypatch.setattr("dschat.rlhf.evaluation.hf_generate", lambda model, tokenizer: None)
    monkeypatch.setattr("dschat.rlhf.evaluation.evaluate_policy",
                        lambda *args, **kwargs: {"rule_score_mean": 0.5, "prompts": 1, "empty_answers": 0})



def test_the_dpo_reports_rule_scores_are_on_the_runs_own_data_given_by_its_files(tmp_path):
    """train.py --recipe dpo --data-path of the embedded data's files: the report's held-out rule scores were those of
    the name tiny's prompts (or, the paths not being the name, none), not phase 3 of the files the run read."""
    from types import SimpleNamespace

    from dschat.args import step3_parser
    from dschat.models.loading import load_tokenizer
    from dschat.steps.ppo import prompt_loaders
    from dschat.tiny import EVAL_FILE
    from dschat.tiny.presets import create_tiny_model

    for folder in ("step1_sft", "step2_dpo"):
        create_tiny_model("tiny-llama", tmp_path / folder)
    data = [f"jsonl:{EVAL_FILE}"]  # (the eval file alone: fewer records than the whole embedded data)
    # (train.py --recipe dpo --data-path: the DPO step's --data_path)
    dpo_flags = step2_dpo_parser().parse_args([*pipeline.TINY_DPO_RECIPE, "--data_path", *data])
    scores = pipeline.held_out_rule_scores(SimpleNamespace(output_dir=str(tmp_path), data_path=data), dpo_flags)
    step3 = step3_parser().parse_args(pipeline.TINY_RECIPE[3])
    _, held_out = prompt_loaders({"data_path": data, "data_split": step3.data_split,
                                  "max_prompt_seq_len": step3.max_prompt_seq_len,
                                  "per_device_generation_batch_size": step3.per_device_generation_batch_size,
                                  "actor_model_name_or_path": str(tmp_path / "step1_sft"),
                                  "data_output_path": str(tmp_path / "data_cache")},
                                 load_tokenizer(str(tmp_path / "step1_sft"), padding_side="left"))
    expected = sum(len(batch["prompt"]) for batch in held_out)
    assert 0 < expected != 120  # (the whole embedded data's phase 3 has 120 held-out prompts)
    assert scores["sft"]["prompts"] == scores["dpo"]["prompts"] == expected
    assert scores["dpo"]["rule_score"] is not None


def test_the_dpo_reports_rule_scores_are_on_phase_3_of_the_dpo_steps_own_split(tmp_path, monkeypatch, distributed):
    """train.py --recipe dpo --step2-args '--data_split 2,4,4 --seed 7': the report's held-out rule scores took phase 3
    of the tiny recipe's 4,4,2 split with seed 1234, which holds records DPO trained on (its phase 2 of its own split),
    and eval.py, which scores a DPO policy on phase 3 of its run's split and seed, other prompts than the report's. Now
    phase 3 of the DPO step's own split and seed."""
    from dschat.steps import dpo, sft

    monkeypatch.setattr(sft, "main", lambda argv: None)

    def fake_dpo(argv):
        (tmp_path / "step2_dpo").mkdir()
        (tmp_path / "step2_dpo" / "metrics.json").write_text("{}")

    monkeypatch.setattr(dpo, "main", fake_dpo)
    _report_stand_ins(monkeypatch)
    splits = []

    def loader(args, tokenizer, built):
        splits.append((args["data_split"], args.get("seed")))
        return None, True

    monkeypatch.setattr("dschat.steps.ppo.held_out_loader_once", loader)
    monkeypatch.setattr(pipeline, "final_report", lambda *args: None)
    pipeline.run_pipeline(TRAIN_PY["parse_args"](["--recipe", "dpo", "--output-dir", str(tmp_path),
                                                  "--step2-args", "--data_split 2,4,4 --seed 7"]))
    assert splits == [("2,4,4", 7), ("2,4,4", 7)]


@pytest.mark.parametrize("own_data", ["embedded", "other"])
def test_the_dpo_reports_rule_scores_are_on_the_dpo_steps_own_data_path(tmp_path, monkeypatch, distributed, own_data):
    """train.py --recipe dpo --step2-args '--data_path jsonl:.../eval.jsonl': the report rule-scored phase 3 of
    train.py's data (the whole embedded data: 120 prompts, some of them eval.jsonl records DPO trained on) where
    eval.py scores phase 3 of the DPO run's own --data_path (12 prompts): SFT 0.807 -> DPO 0.669 in the report, 0.8125
    -> 0.6938 from eval.py on the same run. Now the DPO step's --data_path; one the rule scorer does not know (not the
    embedded data) is not rule-scored, as eval.py cannot."""
    from dschat.steps import sft
    from dschat.tiny import EVAL_FILE

    data = f"jsonl:{EVAL_FILE}"
    if own_data == "other":  # (the embedded records with other prompts: data the rule scorer does not know)
        lines = EVAL_FILE.read_text().splitlines()[:100]
        (tmp_path / "other.jsonl").write_text("".join(line.replace('"prompt": "', '"prompt": "Please. ') + "\n"
                                                      for line in lines))
        data = f"jsonl:{tmp_path / 'other.jsonl'}"
    monkeypatch.setattr(sft, "main", lambda argv: None)

    def fake_dpo(argv):
        (tmp_path / "out" / "step2_dpo").mkdir(parents=True)
        (tmp_path / "out" / "step2_dpo" / "metrics.json").write_text("{}")

    monkeypatch.setattr(dpo, "main", fake_dpo)
    _report_stand_ins(monkeypatch)
    read = []
    monkeypatch.setattr("dschat.steps.ppo.held_out_loader_once",
                        lambda args, tokenizer, built: read.append(args["data_path"]) or (None, True))
    monkeypatch.setattr(pipeline, "final_report", lambda *args: None)
    pipeline.run_pipeline(TRAIN_PY["parse_args"](["--recipe", "dpo", "--output-dir", str(tmp_path / "out"),
                                                  "--step2-args", f"--data_path {data}"]))
    assert read == ([[data], [data]] if own_data == "embedded" else [])


def test_the_dpo_reports_rule_scores_read_the_prompts_with_the_dpo_runs_data_flags_as_eval_py(tmp_path, monkeypatch):
    """The report's held-out rule scores ignored the DPO step's --data_fields, --pad_to_multiple_of and
    --add_eot_token, which eval.py takes from the DPO run (DPO_DATA_FLAGS) to score its policy: each flag eval.py takes
    reaches the prompts' loader or the policy's tokenizer."""
    from types import SimpleNamespace

    from dschat.args import step2_dpo_parser
    from dschat.tools.ppo_eval import DPO_DATA_FLAGS

    dpo_flags = step2_dpo_parser().parse_args(["--data_fields", "prompt=question", "--pad_to_multiple_of", "8",
                                               "--add_eot_token", "--data_split", "2,4,4", "--seed", "7"])
    loaded, read = [], []
    _report_stand_ins(monkeypatch, loaded)
    monkeypatch.setattr("dschat.steps.ppo.held_out_loader_once", lambda args, tokenizer, built: (
        read.append(args), None))
    pipeline.held_out_rule_scores(SimpleNamespace(output_dir=str(tmp_path), data_path=["tiny"]), dpo_flags)
    assert loaded == [True, True]
    for args in read:
        assert {name: args[name] for name in DPO_DATA_FLAGS if name != "add_eot_token"} == {
            "data_path": ["tiny"], "data_split": "2,4,4", "data_fields": "prompt=question", "pad_to_multiple_of": 8,
            "seed": 7}


def test_the_dpo_reports_rule_scores_load_the_held_out_prompts_once_and_count_empty_answers(tmp_path, capsys):
    """Step 3's held-out prompts were loaded once per policy (the "phase 3" data lines said twice, for data DPO never
    trains on); and the scores did not count the empty answers step 3's evaluation counts (empty_answers)."""
    from types import SimpleNamespace

    from dschat.tiny import EVAL_FILE
    from dschat.tiny.presets import create_tiny_model

    for folder in ("step1_sft", "step2_dpo"):
        create_tiny_model("tiny-llama", tmp_path / folder)
    data = [f"jsonl:{EVAL_FILE}"]
    dpo_flags = step2_dpo_parser().parse_args([*pipeline.TINY_DPO_RECIPE, "--data_path", *data])
    scores = pipeline.held_out_rule_scores(SimpleNamespace(output_dir=str(tmp_path), data_path=data), dpo_flags)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[dschat.data] phase 3")]
    assert len(said) == 2 and "train" in said[0] and "eval" in said[1], said  # (its train and eval lines, once)
    for name in ("sft", "dpo"):
        assert isinstance(scores[name]["empty_answers"], int)
        assert 0 <= scores[name]["empty_answers"] <= scores[name]["prompts"]


def test_the_dpo_reports_answers_stop_at_the_models_end_tokens_as_eval_pys(tmp_path, monkeypatch):
    """A model whose generation_config lists a second end token (Qwen2.5-Instruct's <|endoftext|> beside <|im_end|>):
    eval.py and step 3 stop its answers there too (stop_token_ids), the report's held-out rule scores only at the
    tokenizer's EOS, so the report scored longer answers than eval.py for the same policy and prompts. Both stop at
    every end token now: the same answers, token for token."""
    from collections import Counter
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from dschat.rlhf import evaluation
    from dschat.tiny import EVAL_FILE
    from dschat.tiny.presets import create_tiny_model
    from dschat.tools import ppo_eval

    run = tmp_path / "run"
    for folder in ("step1_sft", "step2_dpo"):
        create_tiny_model("tiny-llama", run / folder)
    data = f"jsonl:{EVAL_FILE}"
    dpo_flags = step2_dpo_parser().parse_args([*pipeline.TINY_DPO_RECIPE, "--data_path", data])
    answers = {}  # which model's -> its answers' ids, up to and including the first end token
    real = evaluation.generate_answers

    def recorded(generate, prompts, *args, **kwargs):
        seq, mask = real(generate, prompts, *args, **kwargs)
        for row, kept in zip(seq[:, prompts.shape[1]:], mask):
            answers.setdefault(scoring[0], []).append(row[kept.bool()].tolist())
        return seq, mask

    monkeypatch.setattr(evaluation, "generate_answers", recorded)

    def report_answers():
        answers.clear()
        scoring[:] = ["report"]
        pipeline.held_out_rule_scores(SimpleNamespace(output_dir=str(run), data_path=[data]), dpo_flags)
        return answers.pop("report")

    scoring = ["report"]
    # (the second end token: the token the greedy answers hold most, past the first of each)
    eos = AutoModelForCausalLM.from_pretrained(run / "step2_dpo").config.eos_token_id
    second = Counter(token for answer in report_answers() for token in answer[1:] if token != eos).most_common(1)[0][0]
    for folder in ("step1_sft", "step2_dpo"):
        generation = GenerationConfig.from_pretrained(run / folder)
        generation.eos_token_id = [eos, second]
        generation.save_pretrained(run / folder)
    report = report_answers()
    assert any(second in answer for answer in report)  # (the case: it ends answers)
    flags = pipeline.held_out_rule_score_eval_flags()
    scoring[:] = ["eval.py"]
    ppo_eval.main(["--policy", str(run / "step2_dpo"), "--baseline", str(run / "step1_sft"), "--data_path", data,
                   "--data_split", dpo_flags.data_split, "--seed", str(dpo_flags.seed),
                   "--data_output_path", str(run / "data_cache"),
                   *[token for name, value in flags.items() for token in (f"--{name}", str(value))]])
    assert sorted(answers["eval.py"]) == sorted(report)


def test_the_dpo_reports_rule_score_line_says_the_empty_answers():
    from dschat.report import dpo_summary_lines

    dpo = {"reference_logp_accuracy": 1.0, "logp_accuracy": 1.0, "reward_accuracy": 0.5, "chosen_reward": 0.0,
           "rejected_reward": 0.0, "reward_margin": 0.0, "eval_loss": 0.69, "eval_pairs": 4,
           "held_out_rule_score": {"sft": {"rule_score": 0.5, "prompts": 120, "empty_answers": 0},
                                   "dpo": {"rule_score": 0.0, "prompts": 120, "empty_answers": 120}}}
    assert dpo_summary_lines(dpo)[2] == ("held-out rule score of greedy answers (120 prompts): SFT 0.500 -> DPO 0.000 "
                                         "(120 of 120 answers empty)")


def test_train_py_refuses_a_dpo_flag_combination_before_step_1(tmp_path, distributed):
    """--step2-args "--multiturn" with --recipe dpo was refused by the DPO step, after step 1 had trained."""
    from dschat.errors import UsageError

    args = TRAIN_PY["parse_args"](["--recipe", "dpo", "--output-dir", str(tmp_path / "out"),
                                   "--step2-args", "--multiturn"])
    with pytest.raises(UsageError, match="--multiturn is a step-1 flag"):
        pipeline.run_pipeline(args)
    assert not (tmp_path / "out" / "step1_sft").exists()


def test_reference_model_runs_without_dropout(tmp_path, tokenizer, distributed):
    """The frozen reference is in eval mode (as TRL's): a model whose config has dropout gives it the same log-probs
    on every forward, so the implicit rewards do not move with dropout's noise."""
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny-llama"))
    model.config.attention_dropout = 0.5
    model.save_pretrained(tmp_path / "dropout-llama")
    tokenizer.save_pretrained(tmp_path / "dropout-llama")
    args = step2_dpo_parser().parse_args(["--model_name_or_path", str(tmp_path / "dropout-llama"), "--dtype", "fp32"])
    reference = dpo.build_reference_model(args, tokenizer)
    assert not any(module.training for module in reference.module.modules())
    batch = DataCollatorDPO(tokenizer.pad_token_id)([{
        "chosen_input_ids": T([5, 6, 7, 8, 2]), "chosen_attention_mask": T([1] * 5),
        "rejected_input_ids": T([5, 6, 7, 9, 2]), "rejected_attention_mask": T([1] * 5), "prompt_length": 3}])
    with torch.no_grad():
        torch.testing.assert_close(dpo.sequence_log_probs(reference, batch), dpo.sequence_log_probs(reference, batch),
                                   rtol=0, atol=0)
