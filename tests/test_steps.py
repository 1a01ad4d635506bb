"""Steps 1 and 2 end to end on the embedded tiny default, in one process and on 2 ranks with ZeRO-3."""
import json
import os
import re
import shlex
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from dschat.args import resolve_pad_to_multiple_of
from dschat.models import training_engine
from dschat.models.reward_model import load_reward_model
from dschat.steps import common, dpo, reward, sft
from helpers import (RM_FAST, SFT_FAST, engines_alive, engines_made, fp16_flags, record_applied_steps,
                     saved_tensors, skip_without_fp16)
from launch import REPO, WRITE_SEEN_AND_END, run_as_two_nodes, run_deepspeed


def test_sft_trains_saves_and_reports_metrics(tmp_path, distributed, monkeypatch, capsys):
    from deepspeed import DeepSpeedEngine

    from dschat.models import checkpoint

    given, settled_module = [], checkpoint.settled_module  # the engine, which can release ZeRO-3 prefetches
    monkeypatch.setattr(checkpoint, "settled_module", lambda model: given.append(model) or settled_module(model))
    metrics = sft.main(["--output_dir", str(tmp_path / "sft"), "--data_output_path", str(tmp_path / "data"),
                        "--max_steps", "8", "--num_warmup_steps", "16", "--print_loss", *SFT_FAST])
    assert len(given) == 1 and isinstance(given[0], DeepSpeedEngine)
    # a warmup longer than the run is said: the learning rate never reaches the one asked for (2e-3; 16 > 8 steps);
    # the warmup's step s applies 2e-3 * s / 16 from s = 0, and each step logs the rate it applied
    out = capsys.readouterr().out
    assert "--num_warmup_steps 16 >= this run's 8 optimizer steps: the learning rate rises all run long and never " \
           "reaches 0.002 (at most 0.000875)" in out
    assert "[step1] step 1 loss" in out and "lr 0.000e+00" in out.split("[step1] step 1 loss")[1].splitlines()[0]
    assert "lr 8.750e-04" in out.split("[step1] step 8 loss")[1].splitlines()[0]
    assert "applies a learning rate of 0" in training_engine.warmup_notice(1e-3, "linear", 1, 1)
    assert "8 optimizer steps (the critic): the" in training_engine.warmup_notice(1e-3, "linear", 16, 8, "the critic")
    run = json.loads((tmp_path / "sft" / "training_args.json").read_text())  # the step and its flags as run
    assert run["step"] == "step1" and run["flags"]["max_steps"] == 8 and run["flags"]["learning_rate"] == 2e-3
    saved = json.loads((tmp_path / "sft" / "metrics.json").read_text())
    assert saved["eval_loss"] == pytest.approx(metrics["eval_loss"])
    assert saved["perplexity"] == pytest.approx(torch.tensor(metrics["eval_loss"]).exp().item(), rel=1e-4)
    assert "1200 train / 120 eval records" in out and saved["eval_records"] == 64, "--eval_iters 2 batches of 32"
    assert saved["eval_tokens"] > saved["eval_records"] and "eval_records=64" in out.split("after training:")[1]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "sft")
    assert model.config.pad_token_id != model.config.eos_token_id
    assert (tmp_path / "sft" / "tokenizer.json").exists()


def test_a_step_says_one_eval_record_in_the_singular(tmp_path, distributed, monkeypatch, capsys):
    """The step's opening line said "16 train / 1 eval records": one count helper (report.counted) for every count
    said with its noun."""
    from dschat.steps import resume

    class Stop(Exception):
        pass

    def stop(*_):
        raise Stop

    data = tmp_path / "pairs"
    data.mkdir()
    for name, count in (("train", 16), ("eval", 1)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": f"{name} question {i}?", "chosen": f"Answer {i}."})
                                                    + "\n" for i in range(count)))
    monkeypatch.setattr(resume, "resume_or_start", stop)  # (after the line, before any training)
    with pytest.raises(Stop):
        sft.main(["--output_dir", str(tmp_path / "sft"), "--data_output_path", str(tmp_path / "cache"),
                  "--data_path", str(data), "--data_split", "10,0,0", *SFT_FAST])
    assert "[step1] 16 train / 1 eval record, " in capsys.readouterr().out


def test_steps_count_only_whole_accumulation_steps_and_log_their_mean_loss(tmp_path, distributed, monkeypatch,
                                                                           capsys):
    from dschat.errors import UsageError
    from dschat.steps import common

    assert common.num_update_steps(75, 4, 1) == 18 and common.num_update_steps(75, 4, 2) == 37  # epochs run on
    capsys.readouterr()
    assert common.num_update_steps(75, 4, 1, max_steps=30) == 18  # it stops a run early, never adds epochs: said
    assert "--max_steps 30: --num_train_epochs 1 hold 18 optimizer steps, so the run ends there" in \
        capsys.readouterr().out
    with pytest.raises(UsageError, match=r"3 micro-batches per epoch x 1 epoch\(s\): too few to fill one optimizer"):
        common.num_update_steps(3, 4, 1)
    losses, tokens, logged = [], [], []
    real_run, real_log = common.run_training, common._log_step

    def run_recording(engine, loader, loss_fn, *args, **kwargs):
        def recording(engine, batch):
            loss, count = loss_fn(engine, batch)
            losses.append(loss.item())
            tokens.append(sft.loss_tokens(batch))
            return loss, count
        return real_run(engine, loader, recording, *args, **kwargs)

    def token_mean(start, end):
        return sum(loss * n for loss, n in zip(losses[start:end], tokens[start:end])) / sum(tokens[start:end])

    monkeypatch.setattr(common, "run_training", run_recording)
    monkeypatch.setattr(common, "_log_step", lambda *a: logged.append(a[3]) or real_log(*a))
    flags = ["--data_output_path", str(tmp_path / "data"), "--gradient_accumulation_steps", "4", *SFT_FAST]
    metrics = sft.main(["--output_dir", str(tmp_path / "sft"), *flags])
    # no trailing micro-batch whose gradient is never applied; each step logs its micro-batches' token mean loss
    # (--loss_agg global_token_mean), and the run's train_loss is the mean of the steps' losses
    assert len(losses) == 4 * metrics["steps"] == 4 * len(logged)
    assert logged[0] == pytest.approx(token_mean(0, 4)) and logged[-1] == pytest.approx(token_mean(-4, None))
    assert logged[0] != pytest.approx(sum(losses[:4]) / 4, rel=1e-6)  # (the micro-batches' token counts differ)
    assert metrics["train_loss"] == pytest.approx(sum(logged) / len(logged))
    losses.clear(), logged.clear()
    metrics = sft.main(["--output_dir", str(tmp_path / "sft_token_mean"), *flags, "--loss_agg", "token_mean"])
    assert len(losses) == 4 * metrics["steps"] == 4 * len(logged)  # DeepSpeed-Chat's: the micro-batches' mean
    assert logged[0] == pytest.approx(sum(losses[:4]) / 4) and logged[-1] == pytest.approx(sum(losses[-4:]) / 4)


def test_the_last_micro_batches_of_no_whole_optimizer_step_are_said(capsys):
    """75 micro-batches with --gradient_accumulation_steps 4 make 18 steps, and the last 3 micro-batches (a 25th of
    the data's records with one epoch) were never trained on without a word; said now, as step 3 says its prompts of
    no whole iteration, unless --max_steps ends the run before them."""
    assert common.num_update_steps(75, 4, 2) == 37
    assert "--gradient_accumulation_steps 4: the last 2 of the run's 150 micro-batches on each rank (75 per epoch x 2 " \
           "epoch(s)) fill no whole optimizer step and are not trained on; a --gradient_accumulation_steps that " \
           "divides 150" in capsys.readouterr().out
    assert common.num_update_steps(76, 4, 1) == 19 and common.num_update_steps(75, 4, 1, max_steps=10) == 10
    assert "not trained on" not in capsys.readouterr().out


def test_the_step_count_messages_say_a_count_of_one_in_the_singular(capsys):
    """A count of one read "1 micro-batches per epoch", "the last 1 of the run's 5 micro-batches ... fill ... are not
    trained on" and "hold 1 optimizer steps": the counts of one are said in the singular now."""
    from dschat.errors import UsageError

    with pytest.raises(UsageError, match=r"^1 micro-batch per epoch x 1 epoch\(s\): too few to fill one optimizer "):
        common.num_update_steps(1, 4, 1)
    assert common.num_update_steps(5, 4, 1) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert ("the last of the run's 5 micro-batches on each rank (5 per epoch x 1 epoch(s)) fills no whole optimizer "
            "step and is not trained on") in out, out
    assert common.num_update_steps(4, 4, 1, max_steps=3) == 1
    assert "--num_train_epochs 1 hold 1 optimizer step, so the run ends there" in capsys.readouterr().out


def test_a_steps_rates_leave_out_the_final_evaluation(tmp_path, distributed, monkeypatch):
    """metrics.json's samples_per_s, tokens_per_s and tflops_per_rank were measured up to the end of the evaluation
    after training: a slow held-out set lowered the training's rates (152 samples/s where the last step logged 166)."""
    import types

    calls, evaluate_fn, later = [], sft.SFT.evaluate_fn, [0.0]
    # the steps' clock, moved 1000 s on by the evaluation after training (a real sleep measured the loaded machine)
    monkeypatch.setattr(common, "time", types.SimpleNamespace(time=lambda: time.time() + later[0]))

    def slow_after_training(*args):
        calls.append(1)
        if len(calls) > 1:  # (the first is the evaluation before training, before the clock starts)
            later[0] += 1000
        return evaluate_fn(*args)

    monkeypatch.setattr(sft.SFT, "evaluate_fn", slow_after_training)
    metrics = sft.main(["--output_dir", str(tmp_path / "sft"), "--data_output_path", str(tmp_path / "data"),
                        "--max_steps", "3", *SFT_FAST])
    assert len(calls) == 2
    # 3 steps of 16 records: 0.048 samples/s with the 1000 s in it; within 100 s of training without
    assert metrics["samples_per_s"] > 3 * 16 / 100, metrics


@pytest.mark.parametrize("step", [reward, dpo], ids=["step2", "dpo"])
def test_pair_steps_count_a_pair_as_one_sample(step, tmp_path, distributed, monkeypatch):
    """Steps 2 and DPO counted each batch's chosen and rejected rows as two samples: samples_per_s was twice the
    pairs trained per second, where --per_device_train_batch_size and DeepSpeed's Train/Samples count pairs."""
    made = []

    class Recorded(common.Throughput):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(common, "Throughput", Recorded)
    step.main(["--output_dir", str(tmp_path / "out"), "--data_output_path", str(tmp_path / "data"), "--max_steps", "2",
               *RM_FAST])
    assert made[0].samples == 2 * 16  # 2 steps of 16 pairs


THROUGHPUT_OF_TWO_RANKS = """
from dschat.steps.common import Throughput
from dschat.utils.dist import ensure_distributed
rank, _ = ensure_distributed()
rates = Throughput(num_params=1000)  # (gloo: the counts are summed on the CPU)
rates.update(rows=4, tokens=10 if rank == 0 else 30)  # (as many records, of other lengths)
summary = rates.summary()
seen = [repr(summary["tokens_per_s"] / summary["samples_per_s"]),
        repr(summary["tflops_per_rank"] * 1e12 / summary["tokens_per_s"])]
""" + WRITE_SEEN_AND_END


def test_a_steps_token_rate_counts_every_ranks_tokens(tmp_path):
    """Steps 1, 2 and DPO wrote rank 0's token count times the ranks as tokens_per_s (and its tflops_per_rank from
    rank 0's tokens alone): the ranks' batches hold other numbers of tokens, so it was off by as much as they differ.
    Step 3 sums its ranks' tokens; the steps' rates now do too."""
    nodes = [tmp_path / f"rank{rank}" for rank in range(2)]
    for node in nodes:
        node.mkdir()
    run_as_two_nodes(tmp_path, THROUGHPUT_OF_TWO_RANKS, nodes)
    for node in nodes:
        tokens_per_sample, flops_per_token = map(float, (node / "seen").read_text().splitlines())
        assert tokens_per_sample == pytest.approx((10 + 30) / (4 + 4))  # every rank's tokens over every rank's records
        assert flops_per_token == pytest.approx(6 * 1000 / 2)  # per rank: half of the ranks' tokens


TRAIN_LOSS_CURVE_OF_TWO_RANKS = """
from types import SimpleNamespace
from torch.utils.tensorboard import SummaryWriter
from dschat.steps import common
from dschat.utils.dist import ensure_distributed
rank, _ = ensure_distributed()
args = SimpleNamespace(enable_tensorboard=True, print_loss=False)
skipped = SimpleNamespace(last_step_skipped=lambda: False, total=0)
writer = SummaryWriter("tb") if rank == 0 else None  # (tensorboard_writer's: rank 0's alone)
common._log_step(args, "step1", 1, 1.0 if rank == 0 else 3.0, 1e-3, writer, None, None, skipped)
if writer is not None:
    writer.close()
seen = []
""" + WRITE_SEEN_AND_END


def test_the_train_loss_curve_is_the_mean_over_every_ranks_micro_batches(tmp_path):
    """TensorBoard's step1/train/loss (steps 2's and DPO's too) was rank 0's micro-batches' mean alone, unsaid, while
    metrics.json's train_loss and step 3's curves are means over the ranks (as HF's Trainer logs): on two ranks of
    losses 1 and 3 the curve said 1. It is now the mean over the ranks, 2 (--print_loss still says rank 0's, and says
    so)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    nodes = [tmp_path / f"rank{rank}" for rank in range(2)]
    for node in nodes:
        node.mkdir()
    run_as_two_nodes(tmp_path, TRAIN_LOSS_CURVE_OF_TWO_RANKS, nodes)
    events = EventAccumulator(str(nodes[0] / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("step1/train/loss")] == [(1, 2.0)]
    assert not (nodes[1] / "tb").exists()


def test_the_eval_interval_curve_ends_with_the_final_evaluation(tmp_path, distributed):
    """--eval_interval 2 over 4 steps: the loop leaves the evaluation at step 4 to the final one, which was logged
    only as step1/final/*, so TensorBoard's step1/eval curve stopped at step 2."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = sft.main(["--output_dir", str(tmp_path / "sft"), "--data_output_path", str(tmp_path / "data"),
                        "--max_steps", "4", "--eval_interval", "2", "--enable_tensorboard", "--tensorboard_path",
                        str(tmp_path / "tb"), *SFT_FAST])
    events = EventAccumulator(str(tmp_path / "tb" / "step1"))
    events.Reload()
    curve = events.Scalars("step1/eval/eval_loss")
    assert [e.step for e in curve] == [2, 4]
    assert curve[-1].value == pytest.approx(metrics["eval_loss"])
    assert [e.step for e in events.Scalars("step1/final/eval_loss")] == [4]


def test_the_flags_of_logs_and_evaluation_leave_step1s_weights_bit_for_bit(tmp_path, distributed):
    """``pipeline_resume.LOG_EVAL_FLAGS``: train.py --resume skips a finished step given other values of them alone, as
    they cannot change its weights. Measured here with dropout on (a draw from torch's global RNG, say in an
    evaluation, would move every later dropout mask): evaluations at every step over other batches, and TensorBoard,
    against a single final evaluation. (Step 2 and DPO run the same loop, ``run_supervised_step``.)"""
    flags = ["--data_output_path", str(tmp_path / "data"), "--max_steps", "4", "--dropout", "0.1", *SFT_FAST]
    sft.main(["--output_dir", str(tmp_path / "once"), *flags, "--eval_interval", "0"])
    sft.main(["--output_dir", str(tmp_path / "often"), *flags, "--eval_interval", "1", "--eval_iters", "3",
              "--per_device_eval_batch_size", "7", "--enable_tensorboard", "--tensorboard_path", str(tmp_path / "tb")])
    once, often = saved_tensors(tmp_path / "once"), saved_tensors(tmp_path / "often")
    assert once and once.keys() == often.keys()
    assert [name for name in once if not torch.equal(once[name], often[name])] == []


def test_every_tensorboard_events_file_of_a_run_holds_scalars(tmp_path, distributed):
    """DeepSpeed's monitor opens an events file as the engine is made; dschat reopens it with a purge once the run
    knows where it starts, and the first file stayed behind in ds_tensorboard_logs/, empty."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sft.main(["--output_dir", str(tmp_path / "sft"), "--data_output_path", str(tmp_path / "data"), "--max_steps", "2",
              "--enable_tensorboard", "--tensorboard_path", str(tmp_path / "tb"), *SFT_FAST])
    files = sorted((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert {f.parent.name for f in files} == {"step1", "step1_model_tensorboard"}  # (dschat's and DeepSpeed's)
    for events_file in files:
        events = EventAccumulator(str(events_file))
        events.Reload()
        assert events.Tags()["scalars"], f"{events_file} holds no scalar"


def test_the_progress_bar_counts_the_micro_batches_the_epoch_runs(tmp_path, distributed, monkeypatch):
    """--max_steps 3 of 2 micro-batches: a bar of 6, not of the epoch's whole loader (it ended at 6/75)."""
    from dschat.steps import common

    totals = []
    real = common.progress
    monkeypatch.setattr(common, "progress", lambda it, total, desc: totals.append(total) or real(it, total, desc))
    sft.main(["--output_dir", str(tmp_path / "sft"), "--data_output_path", str(tmp_path / "data"),
              "--gradient_accumulation_steps", "2", "--max_steps", "3", *SFT_FAST])
    assert totals == [6]
    # a step that spans two epochs: the second epoch's bar counts only what it runs (75 batches of 16 a epoch here,
    # steps of 2: step 38 takes the first epoch's last batch and the second epoch's first)
    totals.clear()
    sft.main(["--output_dir", str(tmp_path / "sft2"), "--data_output_path", str(tmp_path / "data"),
              "--gradient_accumulation_steps", "2", "--max_steps", "39", "--num_train_epochs", "2", *SFT_FAST])
    assert totals[1] == 2 * 39 - totals[0], totals


def test_sft_loss_decreases(tmp_path, distributed):
    metrics = sft.main(["--output_dir", str(tmp_path / "sft"), "--data_output_path", str(tmp_path / "data"),
                        "--max_steps", "15", *SFT_FAST])
    assert metrics["eval_loss"] < 6.0  # the untrained model is near ln(vocab) ~ 7.4


def test_sft_with_lora_and_gradient_checkpointing_saves_merged_model(tmp_path, distributed):
    sft.main(["--output_dir", str(tmp_path / "sft"), "--data_output_path", str(tmp_path / "data"),
              "--max_steps", "3", "--lora_dim", "4", "--gradient_checkpointing", "--only_optimize_lora",
              "--lora_learning_rate", "1e-2", *SFT_FAST])
    state = AutoModelForCausalLM.from_pretrained(tmp_path / "sft").state_dict()
    assert not any("lora" in k for k in state)


def test_lora_trains_at_zero3_in_bf16_beside_trainable_base_parameters(tmp_path, distributed):
    """Adapters in the weights' dtype: ZeRO-3 flattens every trainable partition into one buffer of one dtype, and
    with DeepSpeed-Chat's LoRA the biases, norms and embeddings train beside the adapters."""
    metrics = sft.main(["--output_dir", str(tmp_path / "sft"), "--data_output_path", str(tmp_path / "data"),
                        *SFT_FAST, "--max_steps", "2", "--lora_dim", "4", "--zero_stage", "3", "--dtype", "bf16",
                        "--max_seq_len", "48", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4",
                        "--eval_iters", "1"])
    assert metrics["steps"] == 2 and torch.isfinite(torch.tensor(metrics["train_loss"]))


@pytest.mark.parametrize("zero_stage", ["2", "3"])
def test_a_step_run_in_process_leaves_its_engines_free_to_go(zero_stage, tmp_path, distributed, monkeypatch):
    """DeepSpeed kept every engine of a step run in a process that goes on (a notebook, pytest: a worker grew to 40 GB
    of ZeRO buckets): ZeRO's gradient hooks, held by the parameters' C++ autograd data, reach the optimizer; ZeRO-3
    keeps the model in a module-level list and its coordinator in a class-wide cache. A failed run's too."""
    made = engines_made(monkeypatch)
    flags = ["--output_dir", str(tmp_path / "sft"), "--data_output_path", str(tmp_path / "data"), *SFT_FAST,
             "--max_steps", "1", "--eval_iters", "1", "--zero_stage", zero_stage]
    dpo.main([*flags, "--output_dir", str(tmp_path / "dpo")])  # (the policy and its frozen reference)
    assert len(made) == 2 and engines_alive(made) == 0
    monkeypatch.setattr(common, "run_training", lambda *args, **kwargs: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        sft.main(flags)
    assert len(made) == 3 and engines_alive(made) == 0


def test_reward_model_trains_and_loads_back_in_one_call(tmp_path, distributed):
    """From a notebook's dict of settings, as step 3 takes them (steps 1, 2 and DPO failed: 'dict' has no 'dtype')."""
    settings = {flag.lstrip("-"): value for flag, value in zip(RM_FAST[::2], RM_FAST[1::2])}
    metrics = reward.main({"output_dir": str(tmp_path / "rm"), "data_output_path": str(tmp_path / "data"),
                           "max_steps": 8, **settings})
    assert set(metrics) >= {"accuracy", "chosen_mean_score", "rejected_mean_score"}
    assert 0.0 <= metrics["accuracy"] <= 1.0
    saved = json.loads((tmp_path / "rm" / "metrics.json").read_text())
    assert saved["accuracy"] == pytest.approx(metrics["accuracy"])
    model = load_reward_model(str(tmp_path / "rm"))
    assert model.v_head.weight.abs().sum() > 0


def test_step_2_trains_on_the_margins_of_its_data(tmp_path, distributed, monkeypatch, capsys):
    """TRL's RewardTrainer subtracts each record's margin in its loss; step 2 read none. A file's margins now reach
    the loss of each training batch, each with its own pair, and the log counts the records that carry one."""
    from dschat.models import reward_model

    data = tmp_path / "pairs"
    data.mkdir()
    margin = {i: 0.5 + (i % 4) for i in range(32)}  # (0.5 ... 3.5: none 0)
    for name, numbers in (("train", range(32)), ("eval", range(4))):
        (data / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": f"Question {i}?", "chosen": f"Yes, {i}.",
                                                                "rejected": "No.", "margin": margin[i]}) + "\n"
                                                    for i in numbers))
    seen, loss = [], reward_model.pairwise_loss
    monkeypatch.setattr(reward_model, "pairwise_loss",
                        lambda chosen, rejected, margin=None: seen.append(margin) or loss(chosen, rejected, margin))
    reward.main(["--output_dir", str(tmp_path / "rm"), "--data_output_path", str(tmp_path / "cache"),
                 "--data_path", str(data), "--data_split", "0,1,0", "--max_steps", "2", *RM_FAST])
    trained = [given for given in seen if given is not None]  # (the evaluation's forward gives none: no loss)
    assert len(trained) == 2 and all(given.shape == (16,) for given in trained)
    assert sorted(torch.cat(trained).tolist()) == sorted(list(margin.values()))  # (one epoch of 32: each pair once)
    assert "train: kept all 32 records; 32 with a margin, which step 2's loss subtracts" in capsys.readouterr().out
    assert json.loads((tmp_path / "rm" / "metrics.json").read_text())["train_margin_pairs"] == 32


def test_a_step_whose_split_leaves_it_no_data_stops_before_loading_anything(tmp_path, distributed, monkeypatch):
    from dschat.data.splits import check_phase_share
    from dschat.errors import UsageError
    from dschat.models import loading

    monkeypatch.setattr(loading, "load_tokenizer", lambda *a, **k: pytest.fail("loaded before the check"))
    for split, message in (("0,5,5", r"--data_split 0,5,5 gives phase 1 \(the data of step 1\) no share"),
                           ("nan,1,1", "finite, non-negative weights")):
        with pytest.raises(UsageError, match=message):
            sft.main(["--output_dir", str(tmp_path / "sft"), "--data_output_path", str(tmp_path / "data"),
                      "--data_split", split, *SFT_FAST])
    for main, phase in ((sft.main, 1), (reward.main, 2), (dpo.main, 2)):  # a notebook's dict: the same checks
        with pytest.raises(UsageError, match=rf"--data_split 5,0,5 gives phase {phase} .*no share|"
                                             rf"--data_split 0,5,5 gives phase {phase} .*no share"):
            main({"output_dir": str(tmp_path / "out"), "data_split": "0,5,5" if phase == 1 else "5,0,5"})
        with pytest.raises(UsageError, match=r"unknown setting\(s\) \['learning_rat'\]"):
            main({"output_dir": str(tmp_path / "out"), "learning_rat": 1e-3})
    # TRL's train_dataset= habit: a datasets object is an error saying how to pass it; a pathlib.Path is a path
    from pathlib import Path

    from datasets import Dataset

    with pytest.raises(UsageError, match=r"data_path: a Dataset object; .*save_to_disk\(FOLDER\)"):
        sft.main({"output_dir": str(tmp_path / "out"), "data_path": Dataset.from_dict({"prompt": ["a"]})})
    with pytest.raises(UsageError, match=r"--data_split 0,5,5 gives phase 1"):  # (read past the Path)
        sft.main({"output_dir": tmp_path / "out", "data_path": [Path("tiny")], "data_split": "0,5,5"})
    check_phase_share("0,5,5", 1, other_data=True)  # step 1 with --sft_only_data_path has data of its own


def test_a_step_whose_records_are_all_skipped_says_why(tmp_path, distributed):
    """The skip counts are in the error: rank 0 alone printed them, at times after another rank's error."""
    from dschat.errors import UsageError

    rows = [{"prompt": "Tell me a long story " + "please " * 30, "chosen": "No.", "rejected": "Yes."}] * 4
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(UsageError, match=r"step1: no training records: --data_path .*long.jsonl with --data_split "
                                         r"10,0,0: all 4 records of its share were skipped: 4 prompt leaves no room "
                                         r"for an answer in --max_seq_len 16"):
        sft.main(["--output_dir", str(tmp_path / "sft"), "--data_output_path", str(tmp_path / "data"),
                  "--data_path", str(data), "--data_split", "10,0,0", *SFT_FAST, "--max_seq_len", "16"])


def test_a_step_whose_one_record_is_skipped_says_it_in_the_singular():
    """It said "all 1 records of its share were skipped"."""
    from types import SimpleNamespace

    from dschat.errors import UsageError
    from dschat.steps.common import require_training_records

    class Skipped(list):
        skipped = {"no answer": 1}

    args = SimpleNamespace(data_path="one.jsonl", data_split="10,0,0")
    with pytest.raises(UsageError, match="^step1: no training records: --data_path one.jsonl with --data_split "
                                         "10,0,0: the 1 record of its share was skipped: 1 no answer$"):
        require_training_records(Skipped(), args, "step1")
    Skipped.skipped = {"no answer": 2, "chosen==rejected": 1}
    with pytest.raises(UsageError, match="all 3 records of its share were skipped: 2 no answer, 1 chosen==rejected$"):
        require_training_records(Skipped(), args, "step1")


def test_train_py_checks_every_steps_arguments_before_the_first_step_runs(tmp_path, capsys, distributed,
                                                                          monkeypatch):
    import runpy

    from dschat import pipeline
    from dschat.errors import UsageError

    monkeypatch.setenv("DSCHAT_CACHE", str(tmp_path / "cache"))
    args = runpy.run_path(str(REPO / "train.py"))["parse_args"](
        ["--step", "2", "3", "--output-dir", str(tmp_path / "out"), "--step2-args", "--max_steps 2",
         "--step3-args", "--actor_lora_dimm 64"])
    with pytest.raises(SystemExit):
        pipeline.run_pipeline(args)
    assert "train.py --step3-args: error: unrecognized arguments: --actor_lora_dimm 64" in capsys.readouterr().err
    assert not (tmp_path / "out" / "step2_rm").exists(), "step 2 must not have run"
    args = runpy.run_path(str(REPO / "train.py"))["parse_args"](
        ["--step", "1", "3", "--output-dir", str(tmp_path / "out"), "--step3-args", "--data_split 10,0,0"])
    with pytest.raises(UsageError, match="gives phase 3"):
        pipeline.run_pipeline(args)
    assert not (tmp_path / "out" / "step1_sft").exists(), "step 1 must not have run"


@pytest.mark.parametrize("step", ["sft", "dpo", "ppo", "train.py"])
def test_an_output_folder_that_cannot_be_written_is_a_flag_error_before_training(step, tmp_path, distributed,
                                                                                monkeypatch):
    """Steps 1, 2 and DPO found out when they saved the trained model (a PermissionError traceback, the run lost);
    step 3 and train.py failed early, with a traceback."""
    from dschat import pipeline
    from dschat.errors import UsageError
    from dschat.steps import ppo

    monkeypatch.setattr(common, "load_step_data", lambda *a, **k: pytest.fail("the step went on to its data"))
    monkeypatch.setattr(ppo, "prompt_loaders", lambda *a, **k: pytest.fail("the step went on to its data"))
    (tmp_path / "afile").write_text("")
    main = {"sft": sft.main, "dpo": dpo.main, "ppo": ppo.main,
            "train.py": lambda argv: pipeline.run_pipeline(_train_py_args("--output-dir", *argv[1:]))}[step]
    flag = "--output-dir" if step == "train.py" else "--output_dir"
    with pytest.raises(UsageError, match=f"^{flag} {tmp_path}/afile/out: cannot write there \\(Not a directory"):
        main(["--output_dir", str(tmp_path / "afile" / "out")])
    with pytest.raises(UsageError, match=f"^{flag} {tmp_path}/afile: a file, not a folder$"):
        main(["--output_dir", str(tmp_path / "afile")])


def test_a_model_folder_with_a_peft_adapter_beside_it_is_a_flag_error_before_training(tmp_path, distributed,
                                                                                       monkeypatch):
    """A merged model saved into its adapter's folder: transformers loads the adapter onto the model and freezes its
    weights, and the step failed with DeepSpeed's "optimizer got an empty parameter list" (with --lora_dim: a PEFT
    version error), naming neither the folder nor the adapter."""
    import shutil

    from peft import LoraConfig, get_peft_model

    from dschat.errors import MissingInputError
    from dschat.models.loading import resolve_model_path

    monkeypatch.setattr(common, "load_step_data", lambda *a, **k: pytest.fail("the step went on to its data"))
    folder = tmp_path / "merged"
    shutil.copytree(resolve_model_path("tiny-llama"), folder)
    base = AutoModelForCausalLM.from_pretrained(folder)
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(folder)
    for lora in ([], ["--lora_dim", "4"]):
        with pytest.raises(MissingInputError, match=f"--model_name_or_path {folder}: a whole model .* beside a PEFT "
                                                    "adapter .*move the adapter's files"):
            sft.main(["--model_name_or_path", str(folder), "--output_dir", str(tmp_path / "sft"), *lora])
    from dschat.errors import UsageError
    from dschat.tools.common import load_policy

    with pytest.raises(UsageError, match="a whole model .* beside a PEFT adapter"):  # the tools (chat.py, eval.py)
        load_policy(str(folder))  # (transformers applied the adapter on loading: a merged one twice)
    from dschat.models.reward_model import load_reward_model

    with pytest.raises(UsageError, match="a whole model .* beside a PEFT adapter"):  # (rw_eval, eval.py's scoring)
        load_reward_model(str(folder))
    for weights in folder.glob("model*.safetensors"):  # OpenRLHF's LoRA save: the adapter and the base's config.json
        weights.unlink()
    with pytest.raises(MissingInputError, match="a PEFT adapter folder .*not a whole model: merge the adapter"):
        sft.main(["--model_name_or_path", str(folder), "--output_dir", str(tmp_path / "sft")])
    with pytest.raises(UsageError, match="a PEFT adapter folder .*not a whole model"):
        load_policy(str(folder))


def test_the_output_folder_check_makes_nothing_a_failed_step_would_leave(tmp_path, distributed):
    """An empty step folder, left by a step that failed after the check, passed train.py's check of earlier outputs."""
    from dschat.errors import MissingInputError

    out = tmp_path / "new" / "step1_sft"
    with pytest.raises(MissingInputError, match="no such folder"):
        sft.main(["--output_dir", str(out), "--model_name_or_path", str(tmp_path / "nope")])
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("step", ["sft", "reward", "dpo", "ppo"])
def test_a_dtype_the_accelerator_cannot_train_in_is_a_flag_error(step, tmp_path, distributed, monkeypatch):
    from deepspeed.accelerator import get_accelerator

    from dschat.errors import UsageError
    from dschat.steps import ppo

    # (DeepSpeed's CPU accelerator trains in fp16 on CPUs with AVX512-FP16 or AMX-FP16: one that cannot, on any CPU)
    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: False)
    main = {"sft": sft.main, "reward": reward.main, "dpo": dpo.main, "ppo": ppo.main}[step]
    with pytest.raises(UsageError, match="--dtype fp16: DeepSpeed's cpu accelerator cannot train in it; use --dtype"):
        main(["--dtype", "fp16", "--output_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_an_evaluation_tools_held_out_prompts_load_in_a_dtype_the_accelerator_cannot_train_in(tmp_path, distributed,
                                                                                            monkeypatch):
    """eval.py --dtype fp16 on a CPU (or its default bf16 on a GPU without it) stopped with "--dtype fp16: DeepSpeed's
    cpu accelerator cannot train in it", though it trains nothing (chat.py generated in fp16 there): its held-out
    prompts went through step 3's training set-up. A held-out-only loader no longer checks the training precision;
    step 3's own prompts still do."""
    from deepspeed.accelerator import get_accelerator

    from dschat.errors import UsageError
    from dschat.steps.ppo import prompt_loaders
    from dschat.tiny import load_tiny_tokenizer

    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: False)
    args = {"dtype": "fp16", "data_split": "4,4,2", "data_output_path": str(tmp_path / "data")}
    tokenizer = load_tiny_tokenizer()
    tokenizer.padding_side = "left"
    assert len(prompt_loaders(args, tokenizer, held_out_only=True)[1].dataset) > 0
    with pytest.raises(UsageError, match="--dtype fp16: DeepSpeed's cpu accelerator cannot train in it"):
        prompt_loaders(args, tokenizer)


@pytest.mark.parametrize("flags, named", [
    (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size: expected a positive integer, got 0"),
    (["--gradient_accumulation_steps", "-1"], "--gradient_accumulation_steps: expected a positive integer, got -1"),
    (["--num_train_epochs", "0"], "--num_train_epochs: expected a positive integer, got 0"),
    (["--lora_dim", "-4"], "--lora_dim: expected an integer >= 0, got -4"),
    (["--max_steps", "x"], "--max_steps: expected an integer >= 0, got 'x'")])
def test_numeric_flags_out_of_range_are_errors_naming_the_flag(flags, named, capsys):
    with pytest.raises(SystemExit):
        sft.main(flags)
    assert named in capsys.readouterr().err


def test_a_flag_of_another_step_or_a_misspelling_names_the_flags_meant(capsys):
    from dschat.args import step1_parser, step3_parser

    for parser, given, meant in ((step3_parser, "--lora_dim", "--actor_lora_dim or --critic_lora_dim"),
                                 (step3_parser, "--learning_rate", "--actor_learning_rate or --critic_learning_rate"),
                                 (step1_parser, "--actor_lora_dim", "--lora_dim"),
                                 (step1_parser, "--max_seq_lne", "--max_seq_len")):
        with pytest.raises(SystemExit):
            parser().parse_args([given, "8"])
        assert f"unrecognized arguments: {given} 8\n  {given}: did you mean {meant}?\n" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        step3_parser().parse_args(["--zzz", "1"])
    assert capsys.readouterr().err.rstrip().endswith("unrecognized arguments: --zzz 1")


def test_a_flag_only_another_step_takes_names_that_step(capsys):
    """Step 3's --print_answers given to step 1 (or step 1's --include_prompt_in_loss to step 3) was said to be
    unrecognized and no more, as if dschat lacked it."""
    from dschat.args import step1_parser, step3_parser

    for parser, given, steps in ((step1_parser, "--print_answers", "step 3 (training/step3_ppo/main.py)"),
                                 (step3_parser, "--include_prompt_in_loss",
                                  "step 1 (training/step1_sft/main.py) and DPO (training/step2_dpo/main.py)")):
        with pytest.raises(SystemExit):
            parser().parse_args([given])
        assert f"unrecognized arguments: {given}\n  {given}: a flag of {steps}\n" in capsys.readouterr().err
    in_train_py = step1_parser()
    in_train_py.prog = "train.py --step1-args"  # (as train.py names it: there the step's option is what to give)
    with pytest.raises(SystemExit):
        in_train_py.parse_args(["--print_answers"])
    assert "\n  --print_answers: a flag of step 3 (--step3-args)\n" in capsys.readouterr().err


def test_train_py_the_steps_and_the_tools_say_unknown_flags_hints_in_one_layout(capsys):
    """train.py said each hint on a line of its own (a pasted dash's first), the steps and the tools all of them in
    one parenthesis: one layout now, a line each under the error, in the order given."""
    from dschat.args import step1_parser
    from dschat.tools import chat

    typed = "begins with a typographic dash, not '--'; did you mean"
    for parse, given, unknown, said in (
            (lambda argv: _train_py_args(*argv), [], ["--actor_model", "x", "\u2013recipe", "dpo"],
             ["--actor_model: did you mean --actor-model?", f"\u2013recipe: {typed} --recipe?"]),
            (step1_parser().parse_args, [], ["--max_seq_lne", "8", "\u2013lora_dim", "2"],
             ["--max_seq_lne: did you mean --max_seq_len?", f"\u2013lora_dim: {typed} --lora_dim?"]),
            (chat.build_parser().parse_args, ["--path", "x"], ["--max-new-tokens", "5", "--pat", "y"],
             ["--max-new-tokens: did you mean --max_new_tokens?", "--pat: did you mean --path?"])):
        with pytest.raises(SystemExit):
            parse([*given, *unknown])
        assert capsys.readouterr().err.endswith(f"error: unrecognized arguments: {' '.join(unknown)}\n"
                                                + "".join(f"  {line}\n" for line in said))


def test_a_flag_typed_with_one_dash_names_the_flag_meant(capsys):
    """``-learning_rate 1e-4`` (one "-", as a short flag is typed) was said to be unrecognized and no more: it is told
    as a pasted dash is (``misdashed_flag``), the flag it spells with "--" or may have meant, else what that flag is
    (train.py: a step's, and how to pass it), in the one layout. A negative number or a short flag's "-h" is no such
    token."""
    from dschat.args import misdashed_flag, step1_parser

    one = "begins with one '-', not '--'"
    for parse, unknown, said in (
            (step1_parser().parse_args, ["-learning_rate", "1e-4", "-lora_dm=2"],
             [f"-learning_rate: {one}; did you mean --learning_rate?", f"-lora_dm: {one}; did you mean --lora_dim?"]),
            (lambda argv: _train_py_args(*argv), ["-output_dir", "x", "-entropy_coef", "0.1"],
             [f"-output_dir: {one}; did you mean --output-dir?",
              f"-entropy_coef: {one}; --entropy_coef: a flag of step 3; give it to train.py inside --step3-args (one "
              "quoted string each), or run the step's training/.../main.py"])):
        with pytest.raises(SystemExit):
            parse(unknown)
        assert capsys.readouterr().err.endswith(f"error: unrecognized arguments: {' '.join(unknown)}\n"
                                                + "".join(f"  {line}\n" for line in said))
    assert [misdashed_flag(token) for token in ("-1e-3", "-h", "-", "-x=1")] == [None] * 4


def test_a_pasted_dash_flag_after_a_flag_of_several_values_is_told_as_a_flag(capsys):
    """``--data_path a b \u2014learning_rate 1e-3``: argparse took the pasted-dash flag and its value for two more
    datasets (the step said "unknown dataset 'a'", or trained at the default learning rate where the data was found),
    where after any other flag it is left over and hinted. It is the error now, with the same hint, in the step
    scripts and train.py; a value with a pasted dash that names no flag (a dataset, a prompt) is still a value."""
    from dschat.args import step1_parser
    from dschat.tools import prompt_eval

    typed = "begins with a typographic dash, not '--'"
    for parse, argv, said in (
            (step1_parser().parse_args, ["--data_path", "a", "b", "\u2014learning_rate", "1e-3", "--seed", "1"],
             ["argument --data_path: \u2014learning_rate 1e-3 read as its values",
              f"\u2014learning_rate: {typed}; did you mean --learning_rate?"]),
            (step1_parser().parse_args, ["--data_path", "a", "\u2013lora_dim", "2", "--sft_only_data_path", "b",
                                         "\u2013print_answers"],
             ["argument --data_path: \u2013lora_dim 2 read as its values; argument --sft_only_data_path: "
              "\u2013print_answers read as its value", f"\u2013lora_dim: {typed}; did you mean --lora_dim?",
              f"\u2013print_answers: {typed}; --print_answers: a flag of step 3 (training/step3_ppo/main.py)"]),
            (lambda argv: _train_py_args(*argv), ["--data-path", "a", "b", "\u2014lora_dim", "3"],
             ["argument --data-path: \u2014lora_dim 3 read as its values",
              f"\u2014lora_dim: {typed}; --lora_dim: a flag of step 1, 2; give it to train.py inside --step1-args / "
              "--step2-args / --step2-args with --recipe dpo (one quoted string each), or run the step's "
              "training/.../main.py"]),
            (lambda argv: _train_py_args(*argv), ["--step", "1", "2", "\u2013recipe", "dpo"],
             ["argument --step: \u2013recipe dpo read as its values",
              f"\u2013recipe: {typed}; did you mean --recipe?"])):
        assert_refused_saying(parse, argv, said, capsys)
    assert step1_parser().parse_args(["--data_path", "a", "\u2013my_data"]).data_path == ["a", "\u2013my_data"]
    prompts = ["Hi", "\u2014Hello", "\u2014 and you?"]
    assert prompt_eval.build_parser().parse_args(["--model_name_or_path_baseline", "a", "--model_name_or_path_finetune",
                                                  "b", "--prompts", *prompts]).prompts == prompts


def assert_refused_saying(parse, argv, said, capsys):
    """``parse(argv)`` exits 2, its error's lines ``said`` (the hints a line each under it)."""
    with pytest.raises(SystemExit) as stopped:
        parse(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.endswith("error: " + "\n  ".join(said) + "\n"), err


def test_a_pasted_dash_flag_read_as_a_flags_one_value_is_told_as_a_flag(capsys):
    """``--output_dir \u2014learning_rate 1e-3``: argparse read the pasted-dash flag as the folder and said only
    "unrecognized arguments: 1e-3"; chat.py's ``--path \u2014max_new_tokens 5`` the same. It is told as after a flag of
    several values, with the hint; after a switch it is still left over and hinted."""
    from dschat.args import step1_parser
    from dschat.tools import chat

    typed = "begins with a typographic dash, not '--'"
    for parse, argv, said in (
            (step1_parser().parse_args, ["--output_dir", "\u2014learning_rate", "1e-3"],
             ["argument --output_dir: \u2014learning_rate read as its value",
              f"\u2014learning_rate: {typed}; did you mean --learning_rate?"]),
            (chat.build_parser().parse_args, ["--path", "\u2014max_new_tokens", "5"],
             ["argument --path: \u2014max_new_tokens read as its value",
              f"\u2014max_new_tokens: {typed}; did you mean --max_new_tokens?"]),
            (lambda argv: _train_py_args(*argv), ["--output-dir", "\u2013recipe", "dpo"],
             ["argument --output-dir: \u2013recipe read as its value", f"\u2013recipe: {typed}; did you mean --recipe?"]),
            (step1_parser().parse_args, ["--print_loss", "\u2014learning_rate", "1e-3"],
             ["unrecognized arguments: \u2014learning_rate 1e-3",
              f"\u2014learning_rate: {typed}; did you mean --learning_rate?"])):
        assert_refused_saying(parse, argv, said, capsys)


def test_a_pasted_dash_flag_in_a_step_args_string_is_the_steps_to_tell(capsys):
    """``--step3-args "\u2014enable_ema"``: the string is --step3-args' value as meant, yet train.py said
    "\u2014enable_ema read as its value" and to give --enable_ema inside --step3-args, where it was (one with a
    space, "\u2013lora_dim 2", went through). The string is the step's: its parse (``pipeline.check_step_args``)
    tells the pasted dash, with the flag it spells."""
    from dschat.args import step3_parser

    assert _train_py_args("--step3-args", "\u2014enable_ema").step3_args == "\u2014enable_ema"
    assert _train_py_args("--step3-args", "\u2014enable_ema", "--step", "3").step3_args == "\u2014enable_ema"
    with pytest.raises(SystemExit):
        step3_parser().parse_args(["\u2014enable_ema"])
    assert capsys.readouterr().err.endswith("error: unrecognized arguments: \u2014enable_ema\n  \u2014enable_ema: "
                                            "begins with a typographic dash, not '--'; did you mean --enable_ema?\n")
    with pytest.raises(SystemExit):  # (another train.py flag's value is still told)
        _train_py_args("--output-dir", "\u2014step3-args", "x")
    assert "argument --output-dir: \u2014step3-args read as its value" in capsys.readouterr().err


def test_train_py_says_to_quote_a_steps_flags_given_unquoted(capsys):
    """``--step3-args --entropy_coef 0.01`` unquoted (the shell splits it: --step3-args takes --entropy_coef, and
    0.01 is left over) said only "unrecognized arguments: 0.01", as did step 3's flags after its string
    (``--step3-args --print_answers --entropy_coef 0.01``): the error says to give them as one quoted string, and
    which. A flag another step takes, after the string, is still told where it goes."""
    quote = "--step{0}-args takes step {0}'s flags as one string: give them quoted, --step{0}-args {1}"
    for argv, unknown, said in (
            (["--step3-args", "--entropy_coef", "-1e-3"], "-1e-3", quote.format(3, "'--entropy_coef -1e-3'")),
            (["--step3-args", "--entropy_coef", "0.01", "--step", "3"], "0.01",
             quote.format(3, "'--entropy_coef 0.01'")),
            (["--step3-args", "--print_answers", "--entropy_coef", "0.01", "--kl_ctl=0.2", "--step", "3"],
             "--entropy_coef 0.01 --kl_ctl=0.2",
             quote.format(3, "'--print_answers --entropy_coef 0.01 --kl_ctl=0.2'")),
            (["--step1-args=--lora_dim 2", "--print_loss"], "--print_loss",
             quote.format(1, "'--lora_dim 2 --print_loss'")),
            (["--step1-args=", "--lora_dim", "2"], "--lora_dim 2", quote.format(1, "'--lora_dim 2'")),
            (["--step1-args", "", "--lora_dim", "2"], "--lora_dim 2", quote.format(1, "'--lora_dim 2'")),
            # (one train.py takes by another name: told so too, as without the string)
            (["--step3-args", "--enable_ema", "--output_dir", "x"], "--output_dir x",
             quote.format(3, "'--enable_ema --output_dir x'") + "\n  --output_dir: train.py's --output-dir"),
            # (a flag typed with one "-" or a pasted dash is no value of the string: told as such, not put in it)
            (["--step3-args", "--enable_ema", "-recipe", "grpo"], "-recipe grpo",
             "-recipe: begins with one '-', not '--'; did you mean --recipe?"),
            (["--step3-args", "--entropy_coef", "0.1", "\u2013recipe", "grpo"], "0.1 \u2013recipe grpo",
             quote.format(3, "'--entropy_coef 0.1'")
             + "\n  \u2013recipe: begins with a typographic dash, not '--'; did you mean --recipe?"),
            (["--step1-args", "--lora_dim 2", "--entropy_coef", "0.01"], "--entropy_coef 0.01",
             "--entropy_coef: a flag of step 3; give it to train.py inside --step3-args (one quoted string each), or "
             "run the step's training/.../main.py")):
        with pytest.raises(SystemExit):
            _train_py_args(*argv)
        assert capsys.readouterr().err.endswith(f"error: unrecognized arguments: {unknown}\n  {said}\n"), argv


def test_train_py_step_args_options_come_from_one_table(capsys):
    """train.py's --stepN-args options were written down twice more: train.py's own tuple (for joining a lone flag
    after one to it) and args.py's pattern of their dests (for telling their flags given unquoted). ``args.STEP_ARGS``
    is the one table: train.py adds each option it names, joins a lone flag to each, and each is told by its step."""
    from dschat.args import STEP_ARGS

    assert list(STEP_ARGS.items()) == [("--step1-args", 1), ("--step2-args", 2), ("--step3-args", 3)]
    with pytest.raises(SystemExit):
        _train_py_args("--help")
    shown = capsys.readouterr().out
    for option, step in STEP_ARGS.items():
        assert f"{option} {option[2:].upper().replace('-', '_')}" in shown  # (argparse's metavar: STEP1_ARGS)
        assert getattr(_train_py_args(option, "--print_answers"), f"step{step}_args") == "--print_answers"
        with pytest.raises(SystemExit):
            _train_py_args(option, "--lora_dim", "2")
        assert capsys.readouterr().err.endswith(f"error: unrecognized arguments: 2\n  {option} takes step {step}'s "
                                                f"flags as one string: give them quoted, {option} '--lora_dim 2'\n")


def test_train_py_says_to_quote_each_steps_flags_given_unquoted(capsys):
    """Two steps' flags given unquoted (``--step1-args --lora_dim 2 --step3-args --entropy_coef 0.01``) were told of
    step 1's alone: the user quoted them and met a second error for step 3's. The one error gives each quoted form, a
    line each, and the command line they make parses to those strings."""
    for argv, unknown, strings in (
            (["--step1-args", "--lora_dim", "2", "--step3-args", "--entropy_coef", "0.01"], "2 0.01",
             {"step1_args": "--lora_dim 2", "step3_args": "--entropy_coef 0.01"}),
            # (step 2's flags after its string, and step 3's with a flag train.py spells otherwise: its line after)
            (["--step2-args=--lora_dim 2", "--print_loss", "--step3-args", "--enable_ema", "--output_dir", "x"],
             "--print_loss --output_dir x",
             {"step2_args": "--lora_dim 2 --print_loss", "step3_args": "--enable_ema --output_dir x"})):
        with pytest.raises(SystemExit):
            _train_py_args(*argv)
        err = capsys.readouterr().err
        assert f"error: unrecognized arguments: {unknown}\n" in err, argv
        advised = re.findall(r"give them quoted, (.*)", err)
        assert [shlex.split(fix)[0] for fix in advised] == [f"--{dest.replace('_', '-')}" for dest in strings], err
        if "--output_dir" in argv:
            assert err.endswith(f"{advised[-1]}\n  --output_dir: train.py's --output-dir\n"), err
        parsed = _train_py_args(*(token for fix in advised for token in shlex.split(fix)))
        assert {dest: getattr(parsed, dest) for dest in strings} == strings, argv


def _advised_step_args(err):
    """The train.py command lines an unquoted-step-flags error advises, each as its tokens (the shell's split)."""
    return [shlex.split(fix) for fix in re.findall(r"give them quoted, (.*)", err)]


def test_train_py_quotes_each_token_of_the_step_string_it_advises(capsys):
    """``--step3-args --enable_ema --data_path "my file.json"``: the advice joined the tokens after the string with
    spaces, '--enable_ema --data_path my file.json', which, followed, read two datasets, "my" and "file.json". Each
    token is quoted as the shell needs: the advised string gives the step the tokens typed."""
    from dschat.args import step3_parser

    with pytest.raises(SystemExit):
        _train_py_args("--step3-args", "--enable_ema", "--data_path", "my file.json", "b.json")
    [advised] = _advised_step_args(capsys.readouterr().err)
    step3 = step3_parser().parse_args(shlex.split(_train_py_args(*advised).step3_args))
    assert step3.enable_ema and step3.data_path == ["my file.json", "b.json"], advised


def test_train_py_advises_a_step_string_giving_each_flag_once(capsys):
    """``--step1-args "--lora_dim 2" --lora_dim 3`` was advised --step1-args '--lora_dim 2 --lora_dim 3', which the
    step refuses (a flag given twice): the advised string keeps the last of each flag (as argparse would), says so,
    and, followed, parses, with step 2's flags of either script (DPO's --beta)."""
    from dschat.args import step1_parser, step2_dpo_parser

    for argv, parser, kept in (
            (["--step1-args", "--lora_dim 2", "--lora_dim", "3"], step1_parser, {"lora_dim": 3}),
            (["--step1-args", "--lora_dim", "2", "--print_loss", "--lora_dim=3"], step1_parser,
             {"lora_dim": 3, "print_loss": True}),
            (["--step2-args=--beta 0.1 --lora_dim 2", "--beta", "0.2", "--lora_dim", "4"], step2_dpo_parser,
             {"lora_dim": 4, "beta": 0.2})):  # (by script: the reward model's flags, then DPO's)
        with pytest.raises(SystemExit):
            _train_py_args(*argv)
        err = capsys.readouterr().err
        repeated = ", ".join(f"--{dest} (2 times)" for dest in kept if dest != "print_loss")
        assert f"as one string, each flag once (the last of {repeated} kept): give them quoted" in err, err
        [advised] = _advised_step_args(err)
        string = getattr(_train_py_args(*advised), advised[0][2:].replace("-", "_"))
        step = parser()
        step.check_given_once(shlex.split(string))
        parsed = step.parse_args(shlex.split(string))
        assert {dest: getattr(parsed, dest) for dest in kept} == kept, advised


def test_train_py_names_the_step_flags_a_misspelt_one_may_mean(capsys):
    """train.py said nothing more for a misspelt step flag (``--entropy_coeff``) than that it is unrecognized, where
    the step's own parser names the flag meant (``close_names``): now the step flags it may mean and where they go, in
    the one layout; train.py's own close flags first (its --output-dir, not the steps' --output_dir), no hint naming
    the launcher's --local_rank."""
    step3 = "give {} to train.py inside --step3-args"
    for given, said in (
            ("--entropy_coeff", f"did you mean --entropy_coef (a flag of step 3: {step3.format('it')})?"),
            ("--entropy-coeff=1", f"did you mean --entropy_coef (a flag of step 3: {step3.format('it')})?"),
            ("--actor_learnig_rate", "did you mean --actor_learning_rate or --actor_lora_learning_rate (flags of "
                                     f"step 3: {step3.format('them')})?"),
            ("--model_name_or_pth", "did you mean --model_name_or_path (train.py's --actor-model / --reward-model) or "
                                    "--actor_model_name_or_path (train.py's --actor-model)?"),
            ("--ouput_dir", "did you mean --output-dir?")):
        with pytest.raises(SystemExit):
            _train_py_args(given)
        flag = given.split("=")[0]
        assert capsys.readouterr().err.endswith(f"error: unrecognized arguments: {given}\n  {flag}: {said}\n")
    # (nor a pasted dash's or one dash's --local_rank, which told to give it inside each --stepN-args)
    for given in ("--local_rnk", "\u2013local_rank", "-local_rank"):
        with pytest.raises(SystemExit):
            _train_py_args(given, "1")
        assert capsys.readouterr().err.endswith(f"error: unrecognized arguments: {given} 1\n"), given


def test_train_py_names_a_step_option_once_for_its_spellings(capsys):
    """train.py's hint named one step 3 option twice, by both its spellings: ``--generation_batch`` "did you mean
    --generation_batches or --generation_batch_numbers", as a step's own parser does not (``one_spelling_each``)."""
    step3 = "(a flag of step 3: give it to train.py inside --step3-args)?"
    for given, meant in (("--generation_batch", "--generation_batches"),
                         ("--per_device_mini", "--per_device_mini_train_batch_size")):
        with pytest.raises(SystemExit):
            _train_py_args(given)
        assert capsys.readouterr().err.endswith(f"{given}: did you mean {meant} {step3}\n"), given


def test_train_py_says_how_to_pass_a_flag_only_dpo_takes(capsys):
    """train.py's hint for a step's flag read steps 1, 2 and 3's parsers, apart from ``args.steps_taking`` which reads
    DPO's too: DPO's --beta given to train.py was said to be unrecognized and no more. Both read ``scripts_taking``."""
    with pytest.raises(SystemExit):
        _train_py_args("--beta", "0.1", "--print_answers")
    err = capsys.readouterr().err
    assert "--beta: a flag of step 2; give it to train.py inside --step2-args with --recipe dpo (one quoted string " \
           "each)" in err
    assert "--print_answers: a flag of step 3; give it to train.py inside --step3-args (one quoted" in err


def test_train_py_says_how_to_pass_a_steps_flag_typed_in_train_pys_spelling(capsys):
    """train.py --lora-dim 2 (train.py's flags spell with "-", the steps' with "_") got no hint: the step scripts were
    asked for --lora-dim only. It names the steps that take --lora_dim, in their spelling."""
    with pytest.raises(SystemExit):
        _train_py_args("--lora-dim", "2")
    err = capsys.readouterr().err
    assert "--lora-dim: a flag of step 1, 2 (spelled --lora_dim there); give it to train.py inside --step1-args / " \
           "--step2-args" in err, err


# "-1e-5" after a flag is its value (argparse before Python 3.14 took it for another flag: "expected one argument")
@pytest.mark.parametrize("parser, flag, value", [
    ("step1_parser", "--learning_rate", "-1"), ("step1_parser", "--lora_learning_rate", "inf"),
    ("step1_parser", "--learning_rate", "-1e-3"), ("step2_parser", "--learning_rate", "-1E+2"),
    ("step2_parser", "--learning_rate", "-0.1"), ("step2_dpo_parser", "--learning_rate=", "-1e-5"),
    ("step3_parser", "--actor_learning_rate", "x"), ("step3_parser", "--critic_learning_rate", "-1e-5"),
    ("step3_parser", "--actor_lora_learning_rate", "-0.5"), ("step3_parser", "--critic_lora_learning_rate", "-2"),
    ("step3_parser", "--actor_learning_rate", "nan")])
def test_negative_learning_rates_are_errors_naming_the_flag(parser, flag, value, capsys):
    from dschat import args

    argv = [flag + value] if flag.endswith("=") else [flag, value]
    flag = flag.rstrip("=")
    with pytest.raises(SystemExit):
        getattr(args, parser)().parse_args(argv)
    shown = repr(value) if value == "x" else value
    assert f"argument {flag}: expected a number >= 0, got {shown}" in capsys.readouterr().err
    assert getattr(getattr(args, parser)().parse_args([flag, "2e-5"]), flag[2:]) == 2e-5
    assert getattr(getattr(args, parser)().parse_args([flag, "0"]), flag[2:]) == 0.0, "0 freezes, as in torch"


@pytest.mark.parametrize("value, number", [("-1e-3", -0.001), ("-1E+2", -100.0), ("-.5e-1", -0.05), ("-2", -2.0),
                                           ("-0.5", -0.5)])
def test_a_negative_number_in_any_float_spelling_is_a_flags_value(value, number):
    """Step 3's flags that take a negative number (an entropy penalty, a reward source's weight flipped) read it in
    any float spelling: "--entropy_coef -1e-3" said "expected one argument" (argparse took "-1e-3" for a flag)."""
    from dschat.args import step3_parser

    parsed = step3_parser().parse_args(["--entropy_coef", value, "--reward_model_weight", value])
    assert (parsed.entropy_coef, parsed.reward_model_weight) == (number, number)


def test_an_unknown_flag_before_a_negative_number_is_said_with_it(capsys):
    """The number after an unknown flag is its value: the error names both, and no flag for "-1e-3"."""
    from dschat.args import step3_parser

    with pytest.raises(SystemExit):
        step3_parser().parse_args(["--entropy_coeff", "-1e-3"])
    err = capsys.readouterr().err
    assert "error: unrecognized arguments: --entropy_coeff -1e-3" in err and "-1e-3:" not in err, err
    assert "--entropy_coeff: did you mean --entropy_coef?" in err, err
    with pytest.raises(SystemExit):
        _train_py_args("--entropy_coef", "-1e-3")
    err = capsys.readouterr().err
    assert "error: unrecognized arguments: --entropy_coef -1e-3" in err and "-1e-3:" not in err, err
    assert "--entropy_coef: a flag of step 3; give it to train.py inside --step3-args" in err, err


def test_a_negative_learning_rate_in_a_settings_dict_is_refused():
    from dschat import args
    from dschat.errors import UsageError

    with pytest.raises(UsageError, match="actor_learning_rate"):
        args.namespace_with_defaults(args.step3_parser(), {"actor_learning_rate": -1e-5})
    assert args.namespace_with_defaults(args.step3_parser(), {"actor_learning_rate": 0.0}).actor_learning_rate == 0


def test_a_none_in_a_settings_dict_for_a_flag_with_a_default_leaves_the_default():
    """A notebook's ``temperature=None`` (HF's configs' "unset") reached check_sampling_flags as None: a TypeError
    ("'>' not supported")."""
    from dschat import args
    from dschat.rlhf.engine import check_settings

    given = {"temperature": None, "ppo_epochs": None, "lr_scheduler_type": None, "actor_dropout": None}
    settings = args.namespace_with_defaults(args.step3_parser(), given)
    assert (settings.temperature, settings.ppo_epochs, settings.lr_scheduler_type) == (1.0, 1, "cosine")
    assert settings.actor_dropout is None  # (None is its default: the config's dropout)
    check_settings(settings)


def test_train_py_refuses_a_negative_learning_rate_before_the_first_step(tmp_path, capsys, distributed,
                                                                                     monkeypatch):
    from dschat import pipeline
    from dschat.steps import ppo

    for module in (sft, reward, ppo):  # a step that starts is already the failure
        monkeypatch.setattr(module, "main", lambda argv: pytest.fail("a step ran"))
    for step, flag in ((1, "--learning_rate -1"), (2, "--lora_learning_rate -1"), (3, "--critic_learning_rate -1e-5"),
                       (3, "--actor_learning_rate=-1e-5")):
        args = _train_py_args("--output-dir", str(tmp_path / "out"), f"--step{step}-args", flag)
        with pytest.raises(SystemExit):
            pipeline.run_pipeline(args)
        name, value = flag.replace("=", " ").split()
        assert (f"train.py --step{step}-args: error: argument {name}: expected a number >= 0, got {value}"
                in capsys.readouterr().err)
    assert not (tmp_path / "out" / "step1_sft").exists(), "no step may have run"


def test_step3_numeric_flags_and_only_optimize_lora_without_lora_are_errors(tmp_path, capsys, distributed):
    from dschat.steps import ppo

    for flag in ("--ppo_epochs", "--per_device_training_batch_size", "--n_samples_per_prompt"):
        with pytest.raises(SystemExit):
            ppo.main([flag, "0"])
        err = capsys.readouterr().err  # argparse names a flag with all its aliases
        assert f"argument {flag}" in err and "expected a positive integer, got 0" in err
    with pytest.raises(ValueError, match="--only_optimize_lora trains only LoRA adapters, but no model gets any"):
        sft.main(["--only_optimize_lora", "--output_dir", str(tmp_path / "sft"), *SFT_FAST])
    with pytest.raises(ValueError, match="--only_optimize_lora"):
        ppo.main(["--only_optimize_lora", "--actor_model_name_or_path", "tiny-llama"])
    from dschat.rlhf.config import step3_args
    from dschat.rlhf.engine import check_step3_settings

    check_step3_settings(step3_args({"only_optimize_lora": True, "actor_lora_dim": 8}), 1)  # the critic trains whole


@pytest.mark.multirank
def test_steps_1_and_2_with_zero3_on_two_ranks(tmp_path):
    out = tmp_path / "out"
    extra = "--max_steps 4 --max_seq_len 80 --per_device_train_batch_size 8 --eval_iters 2 --dtype fp32"
    proc = run_deepspeed(REPO / "train.py", "--step", "1", "2", "--actor-zero-stage", "3", "--reward-zero-stage",
                         "3", "--output-dir", out, "--step1-args", extra, "--step2-args", extra,
                         env={"DSCHAT_CACHE": str(tmp_path / "cache")})
    assert "RM held-out accuracy" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["rm_accuracy"] is not None and report["sft_eval_loss"] is not None
    # the ZeRO-3-sharded models were gathered into complete folders
    model = AutoModelForCausalLM.from_pretrained(out / "step1_sft")
    assert all(p.numel() > 0 for p in model.parameters())
    assert load_reward_model(str(out / "step2_rm")).v_head.weight.shape[0] == 1


@pytest.mark.multirank
def test_eval_iters_is_a_count_over_all_ranks(tmp_path, distributed, capsys):
    """--eval_iters capped each rank's batches: two ranks scored twice the records one rank scores (48, not 24, for 3
    batches of 8), so the held-out metrics depended on the number of ranks. It now takes the first 3 batches' records
    of the eval split, shared among the ranks: one rank and two score the same 24 records, and the untrained model's
    loss over them is the same."""
    flags = ["--max_steps", "1", *SFT_FAST, "--per_device_eval_batch_size", "8", "--eval_iters", "3"]

    def folders(name):
        return ["--output_dir", str(tmp_path / name / "sft"), "--data_output_path", str(tmp_path / name / "data")]

    def loss_before_training(out):
        said = re.search(r"\[step1\] before training: eval_loss=([0-9.]+), perplexity=[0-9.]+, eval_records=(\d+)",
                         out)
        assert said, out[-3000:]
        return float(said.group(1)), int(said.group(2))

    one = sft.main([*folders("one"), *flags])
    one_before = loss_before_training(capsys.readouterr().out)
    two = run_deepspeed(REPO / "training" / "step1_sft" / "main.py", *folders("two"), *flags, timeout=300)
    saved = json.loads((tmp_path / "two" / "sft" / "metrics.json").read_text())
    assert one["eval_records"] == saved["eval_records"] == 24
    two_before = loss_before_training(two.stdout)
    assert two_before[1] == one_before[1] == 24
    assert two_before[0] == pytest.approx(one_before[0], abs=2e-4)  # (printed to 4 decimals)


def test_malformed_dataset_line_names_file_and_line(tmp_path, distributed):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "broken\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl.*line 2"):
        sft.main(["--data_path", f"jsonl:{bad}", "--output_dir", str(tmp_path / "sft"),
                  "--data_output_path", str(tmp_path / "data"), *SFT_FAST])


def test_a_step_script_ends_a_data_error_with_its_message_not_a_traceback(tmp_path):
    import os
    import sys

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "broken\n')
    # a process of its own, not a rank of this test process's world (whose port is taken)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(REPO / "training" / "step2_rm" / "main.py"), "--data_path",
                           f"jsonl:{bad}", "--output_dir", str(tmp_path / "rm"), "--data_output_path",
                           str(tmp_path / "data")], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"error: {bad} line 2: invalid JSON" in proc.stderr and "Traceback" not in proc.stderr


def test_a_usage_error_leaves_a_process_of_one_its_process_group(monkeypatch):
    """A notebook or a test calling an entry point goes on after its usage error: its group stays (a torn-down one
    failed every later step of the process with "Default process group has not been initialized")."""
    from dschat.errors import UsageError
    from dschat.utils.cli import run_entry_point
    from dschat.utils.dist import ensure_distributed

    ensure_distributed()
    monkeypatch.delenv("DSCHAT_TRACEBACK", raising=False)
    with pytest.raises(SystemExit):
        run_entry_point(lambda: (_ for _ in ()).throw(UsageError("bad flag")))
    assert torch.distributed.is_initialized()


def test_entry_points_end_usage_errors_with_the_message_and_let_bugs_raise(capsys, monkeypatch):
    from dschat.errors import UsageError
    from dschat.utils.cli import run_entry_point
    from dschat.utils.ds_config import load_user_ds_config

    def bad_flag():
        load_user_ds_config(__file__)  # not JSON: the user's --deepspeed_config

    from dschat.utils import cli

    ended = []  # the process group is left before the exit (a gloo group left to the interpreter aborted a rank)
    monkeypatch.setattr(cli, "end_distributed", lambda peers_only=False: ended.append(peers_only))
    monkeypatch.delenv("DSCHAT_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        run_entry_point(bad_flag)
    assert exit_.value.code == 2 and "error: DeepSpeed config" in capsys.readouterr().err and ended == [True]
    with pytest.raises(ValueError, match="a bug"):  # not a usage error: the traceback stays
        run_entry_point(lambda: (_ for _ in ()).throw(ValueError("a bug")))
    # a diverged run: its one line says where (it ended in a 16-line traceback)
    with pytest.raises(SystemExit) as exit_:
        run_entry_point(lambda: (_ for _ in ()).throw(FloatingPointError("sft: the training loss is not finite")))
    assert exit_.value.code == 1 and capsys.readouterr().err == "error: sft: the training loss is not finite\n"
    assert ended == [True, True]
    # a rank whose collective failed because another rank stopped: one line (it was a ~35-line gloo traceback)
    from dschat.utils import dist

    def peer_stopped():
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:35202. This is "
                           "typically caused by a remote worker crashing.")

    with pytest.raises(RuntimeError, match="Connection closed"):  # one rank alone: not another rank's failure
        run_entry_point(peer_stopped)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    with pytest.raises(SystemExit) as exit_:
        run_entry_point(peer_stopped)
    assert exit_.value.code == 1
    assert capsys.readouterr().err == ("error: rank 0 stopped: another rank stopped first (its error, if it printed "
                                       "one, is above)\n")
    assert ended == [True, True], "another rank's failure: a collective may be pending, the teardown could wait on it"
    with pytest.raises(RuntimeError, match="a bug"):
        run_entry_point(lambda: (_ for _ in ()).throw(RuntimeError("a bug")))
    for resumable, said in ((True, "error: interrupted (with --save_interval, --resume continues from the last "
                                   "checkpoint)\n"), (False, "error: interrupted\n")):
        with pytest.raises(SystemExit) as exit_:  # Ctrl-C: one line (on rank 0), not a traceback on every rank
            run_entry_point(lambda: (_ for _ in ()).throw(KeyboardInterrupt()), resumable=resumable)
        assert exit_.value.code == 130 and capsys.readouterr().err == said
    monkeypatch.setenv("DSCHAT_TRACEBACK", "1")
    with pytest.raises(UsageError):
        run_entry_point(bad_flag)
    with pytest.raises(RuntimeError, match="Connection closed"):
        run_entry_point(peer_stopped)


TEARDOWN_SCRIPT = """
import atexit, os, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from dschat.errors import UsageError
from dschat.utils.cli import run_script


class AbortsInTeardown:  # as a gloo rank did now and then: a C++ thread destroyed while running, in the teardown
    def __del__(self, abort=os.abort):  # (bound now: the teardown may have cleared the module os first)
        abort()


kept = AbortsInTeardown()
done = []  # (what the other threads did, said by the atexit handler: two threads printing interleave their lines)
atexit.register(lambda: print("atexit handler ran after:", *sorted(done)))  # (no flush: stdout is a pipe)


def late():
    time.sleep(0.5)
    done.append("thread")


def main():
    print("main returned")
    threading.Thread(target=late).start()
    ThreadPoolExecutor(1).submit(done.append, "pool")  # (its idle worker waits until told the process ends)
    if sys.argv[1] == "usage":
        raise UsageError("bad flag")
    if sys.argv[1] == "bug":
        raise ValueError("a bug")
    if sys.argv[1] == "interrupted":
        raise KeyboardInterrupt
    if sys.argv[1] == "printf":  # (C's stdout buffer: compiled code's output, DeepSpeed's CPU Adam's)
        import ctypes
        ctypes.CDLL(None).printf(b"said by C\\n")
    if sys.argv[1] == "held":  # (its lines still in the buffer when the reader goes)
        sys.stdin.readline()
    if sys.argv[1] == "endless":  # (until the reader goes: `| head`)
        while True:
            print("more", flush=True)


if sys.argv[-1] == "plain":
    main()  # the interpreter's own exit: its teardown runs
else:
    run_script(main)
"""


@pytest.mark.parametrize("case,status,said", [("finished", 0, ""), ("usage", 2, "error: bad flag\n"),
                                              ("bug", 1, "ValueError: a bug"),
                                              ("interrupted", 130, "KeyboardInterrupt")])  # (DSCHAT_TRACEBACK=1)
def test_scripts_end_with_their_status_without_the_interpreters_teardown(tmp_path, case, status, said):
    """A rank that had finished aborted in the interpreter's teardown now and then ("terminate called without an
    active exception" in gloo, after destroy_process_group), and the launcher returned 250: the entry points end the
    process with the run's status once its threads, atexit handlers and output are done, and skip the teardown."""
    script = tmp_path / "script.py"
    script.write_text(TEARDOWN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "DSCHAT_TRACEBACK": "1" if case == "interrupted" else "0"}
    proc = subprocess.run([sys.executable, str(script), case], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == status, proc.stderr[-2000:]
    assert proc.stdout == "main returned\natexit handler ran after: pool thread\n" and said in proc.stderr, \
        proc.stdout + proc.stderr[-2000:]
    plain = subprocess.run([sys.executable, str(script), "finished", "plain"], env=env, capture_output=True,
                           timeout=120)
    assert plain.returncode != 0, "the teardown this test stands in for did not run: the test checks nothing"


def test_scripts_flush_their_output_as_the_interpreters_exit_does(tmp_path):
    """Ending without the teardown (above) must not lose output: C's buffered printf lines were dropped (DeepSpeed's
    CPU Adam's in a redirected log), a full disk exited 0 where Python's exit gives 120, and a run started with its
    stdout closed ended in a traceback."""
    script = tmp_path / "script.py"
    script.write_text(TEARDOWN_SCRIPT)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}  # (C's stdout: buffered)
    env.update(PYTHONPATH=str(REPO), DSCHAT_TRACEBACK="0")
    said = subprocess.run([sys.executable, str(script), "printf"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert said.returncode == 0 and "said by C" in said.stdout, said.stdout + said.stderr[-2000:]
    with open("/dev/full", "w") as full:
        assert subprocess.run([sys.executable, str(script), "finished"], env=env, stdout=full, timeout=120,
                              stderr=subprocess.DEVNULL).returncode == 120
    closed = subprocess.run(f"{sys.executable} {script} finished >&-", shell=True, env=env, capture_output=True,
                            text=True, timeout=120)
    assert closed.returncode == 0 and "Traceback" not in closed.stderr, closed.stderr[-2000:]


def test_scripts_whose_output_fills_the_disk_mid_run_say_so_in_one_line(tmp_path):
    """A tool printing its results to a full disk (here /dev/full) ended in an "OSError: [Errno 28] No space left on
    device" traceback, a bug's; it is said in one line, with status 1 (with DSCHAT_TRACEBACK=1, the traceback)."""
    script = tmp_path / "script.py"
    script.write_text(TEARDOWN_SCRIPT)
    for traceback in ("0", "1"):
        env = {**os.environ, "PYTHONPATH": str(REPO), "DSCHAT_TRACEBACK": traceback}
        with open("/dev/full", "w") as full:
            proc = subprocess.run([sys.executable, str(script), "endless"], env=env, stdout=full,
                                  stderr=subprocess.PIPE, text=True, timeout=120)
        assert proc.returncode == 1, proc.stderr[-2000:]
        if traceback == "0":  # (the one traceback left is the script's atexit handler's, which prints to the disk)
            assert proc.stderr.splitlines()[0] == ("error: No space left on device (a write failed: free some space or "
                                                   "write elsewhere; DSCHAT_TRACEBACK=1 shows where)"), proc.stderr
            assert proc.stderr.count("Traceback") == proc.stderr.count("Exception ignored in atexit callback") == 1
        else:
            assert "Traceback" in proc.stderr and "OSError: [Errno 28]" in proc.stderr, proc.stderr[-2000:]


def test_scripts_end_quietly_when_the_reader_of_their_output_goes(tmp_path):
    """`tool.py | head`: the reader closing the pipe ended a finished tool's printing with a BrokenPipeError
    traceback and status 1; it ends as the pipe's signal ends a C program, 141 (128 + SIGPIPE), without one."""
    script = tmp_path / "script.py"
    script.write_text(TEARDOWN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "DSCHAT_TRACEBACK": "0"}
    proc = subprocess.Popen([sys.executable, str(script), "endless"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "main returned\n"
    proc.stdout.close()  # (as head does once it has its lines)
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in stderr, stderr[-2000:]


def test_scripts_whose_reader_went_before_their_last_lines_do_not_exit_0(tmp_path):
    """The reader of a pipe closing it before the exit's flush lost the buffered lines, and the run exited 0 as if they
    had been read; it exits 141, as when the reader goes mid-run (above)."""
    script = tmp_path / "script.py"
    script.write_text(TEARDOWN_SCRIPT)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}  # (stdout: buffered)
    env.update(PYTHONPATH=str(REPO), DSCHAT_TRACEBACK="0")
    proc = subprocess.Popen([sys.executable, str(script), "held"], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # (before the script's "main returned" left its buffer)
    proc.stdin.write("go\n")
    proc.stdin.close()
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in stderr, stderr[-2000:]


class _Collated(Exception):
    """Stops a step right after its collator made a batch."""


@pytest.mark.parametrize("step", [sft, reward, dpo], ids=["sft", "reward", "dpo"])
@pytest.mark.parametrize("flag", [None, "16"], ids=["auto", "16"])
def test_steps_pad_batches_to_pad_to_multiple_of(tmp_path, monkeypatch, distributed, step, flag):
    batches, collators = [], []

    def collate_and_stop(train, evaluation, collator, *args, **kwargs):
        collators.append(collator)
        batches.append(collator([train[i] for i in range(8)]))
        raise _Collated

    monkeypatch.setattr(common, "build_dataloaders", collate_and_stop)
    argv = ["--output_dir", str(tmp_path / "out"), "--data_output_path", str(tmp_path / "data"), *SFT_FAST]
    with pytest.raises(_Collated):
        step.main(argv + (["--pad_to_multiple_of", flag] if flag else []))
    multiple = int(flag) if flag else resolve_pad_to_multiple_of(None)  # auto: 1 on the CPU, 64 on CUDA
    mask = batches[0]["attention_mask"]
    longest = int(mask.sum(1).max())
    assert mask.shape[1] == -(-longest // multiple) * multiple
    assert multiple == 1 or longest % multiple, "the batch's longest row is already a multiple: nothing was tested"
    assert collators[0].max_length == 80  # SFT_FAST's --max_seq_len: rounding never passes it


def _train_py_args(*argv):
    import runpy

    return runpy.run_path(str(REPO / "train.py"))["parse_args"](list(argv))


def test_train_py_refuses_step_args_that_move_its_folders_and_says_which_flag(tmp_path, distributed):
    # the later steps and the report read the folders train.py chose: a step may not write or read others
    from dschat import pipeline
    from dschat.errors import UsageError

    # (step 3's reward model: the report and the tools named --reward-model's or step 2's, not the one it scored with)
    for step, flag in ((1, "--output_dir elsewhere"), (3, "--actor_model_name_or_path x"),
                       (2, "--model_name_or_path tiny-gpt2"), (3, "--reward_model_name_or_path x")):
        args = _train_py_args("--output-dir", str(tmp_path / "out"), f"--step{step}-args", flag)
        with pytest.raises(UsageError, match=f"--step{step}-args sets --"):
            pipeline.run_pipeline(args)
    assert not (tmp_path / "out").exists(), "no step may have run"


def test_train_py_refuses_a_zero_stage_given_both_to_it_and_in_a_steps_args(tmp_path, distributed):
    """``--actor-zero-stage 3 --step1-args "--zero_stage 2"`` trained step 1 at stage 2 and dropped train.py's flag
    unsaid (step 3's --zero_stage dropped both of train.py's): an error naming both flags, before any step runs. A
    stage the step's args give where train.py's flag is left out replaces the deployment's default, as before."""
    from dschat import pipeline
    from dschat.args import step1_parser, step2_parser, step3_parser
    from dschat.errors import UsageError

    out = str(tmp_path / "out")
    for flags, said in ((["--actor-zero-stage", "3", "--step1-args", "--zero_stage 2"],
                         "--actor-zero-stage 3 and --step1-args --zero_stage 2 both set step 1's ZeRO stage"),
                        (["--reward-zero-stage", "1", "--step2-args", "--zero_stage 2"],
                         "--reward-zero-stage 1 and --step2-args --zero_stage 2"),
                        (["--actor-zero-stage", "1", "--step3-args", "--zero_stage 2"],
                         "--actor-zero-stage 1 and --step3-args --zero_stage 2"),
                        (["--reward-zero-stage", "1", "--step3-args", "--critic_zero_stage=2"],
                         "--reward-zero-stage 1 and --step3-args --critic_zero_stage 2"),
                        (["--recipe", "dpo", "--actor-zero-stage", "1", "--step2-args", "--zero_stage 2"],
                         "--actor-zero-stage 1 and --step2-args --zero_stage 2")):
        with pytest.raises(UsageError, match=re.escape(said)):
            pipeline.run_pipeline(_train_py_args("--output-dir", out, *flags))
    assert not (tmp_path / "out").exists(), "no step may have run"
    parsers = {1: step1_parser, 2: step2_parser, 3: step3_parser}
    for flags in (["--step1-args", "--zero_stage 2"], ["--actor-zero-stage", "2", "--step1-args", "--zero_stage 2"],
                  ["--actor-zero-stage", "2", "--step3-args", "--critic_zero_stage 1"],
                  ["--actor-zero-stage", "2", "--step3-args", "--zero_stage 1 --actor_zero_stage 2"]):
        args = _train_py_args("--output-dir", out, *flags)
        for step in (1, 3):
            parsed = parsers[step]().parse_args(pipeline.step_argv(step, args, True))
            pipeline.check_stage_flags_agree(step, args, parsed, parsers[step]())  # (no error)
    args = _train_py_args("--output-dir", out, "--step1-args", "--zero_stage 2")
    assert step1_parser().parse_args(pipeline.step_argv(1, args, True)).zero_stage == 2, "the step's replaces the default"


def test_train_py_without_an_earlier_steps_output_is_a_usage_error(tmp_path, distributed):
    from dschat import pipeline
    from dschat.errors import MissingInputError

    out = str(tmp_path / "out")
    # the hint keeps the steps asked for and adds every earlier one whose output is missing: `--step 3` in a new
    # folder lacks step 2's reward model too (a hint of `--step 1 3` led to that error next)
    for argv, run in ((["--step", "3"], "steps 1 and 2 too \\(--step 1 2 3\\)"),
                      (["--step", "2", "3"], "step 1 too \\(--step 1 2 3\\)"),
                      (["--recipe", "dpo", "--step", "2"], "step 1 too \\(--step 1 2\\)"),
                      (["--recipe", "grpo", "--step", "3"], "step 1 too \\(--step 1 3\\)")):
        with pytest.raises(MissingInputError, match=f"reads {out}/step1_sft, step 1's output, which does not exist: "
                                                    f"run {run} or first"):
            pipeline.run_pipeline(_train_py_args("--output-dir", out, *argv))
    with pytest.raises(MissingInputError, match="run step 1 too .*the tiny default's reward model starts from the "
                                                "SFT model; --reward-model naming another model than --actor-model "
                                                "starts it from that one"):
        pipeline.run_pipeline(_train_py_args("--output-dir", out, "--step", "2", "--reward-model", "tiny-llama"))
    # another preset named: step 2 trains it (it was silently the SFT model), and needs no step 1
    argv = pipeline.step_argv(2, _train_py_args("--output-dir", out, "--reward-model", "tiny-opt"), True)
    assert argv[argv.index("--model_name_or_path") + 1] == "tiny-opt"
    (tmp_path / "out" / "step1_sft").mkdir(parents=True)  # empty (a step that failed early): no model
    with pytest.raises(MissingInputError, match="step1_sft, step 1's output, which holds no model"):
        pipeline.run_pipeline(_train_py_args("--output-dir", out, "--step", "3"))
    (tmp_path / "out" / "step1_sft" / "config.json").write_text("{}")
    with pytest.raises(MissingInputError, match="step2_rm, step 2's output, which does not exist"):
        pipeline.run_pipeline(_train_py_args("--output-dir", out, "--step", "3"))
    (tmp_path / "out" / "step2_rm").mkdir()
    with pytest.raises(MissingInputError, match="step2_rm, step 2's output, which holds no model"):
        pipeline.run_pipeline(_train_py_args("--output-dir", out, "--step", "3"))
    # a step 1 run again and interrupted (its finished mark gone, an earlier run's flags there): not trained from
    (tmp_path / "out" / "step1_sft" / "training_args.json").write_text("{}")
    with pytest.raises(MissingInputError, match=r"step1_sft, step 1's output, which did not finish: .*step1_sft is an "
                                                r"unfinished step output: its last training run was interrupted, or is "
                                                r"still running .*Run "
                                                r"step 1 again \(--step 1 2 3; with --resume"):
        pipeline.run_pipeline(_train_py_args("--output-dir", out, "--step", "2", "3"))


def test_train_py_step_3_scores_with_a_trained_reward_model_given_as_reward_model(tmp_path, distributed, monkeypatch,
                                                                                    capsys):
    """train.py had no way to give step 3 a reward model trained elsewhere (TRL's, OpenRLHF's, an earlier run's):
    without step 2 it read OUTPUT/step2_rm only. A trained reward model as --reward-model now scores step 3 and starts
    its critic; the report says so and leaves an older step2_rm in the folder out."""
    from dschat import pipeline
    from dschat.errors import MissingInputError, UsageError
    from dschat.tools.common import find_reward_model_path

    monkeypatch.setenv("DSCHAT_CACHE", str(tmp_path / "cache"))
    rm = tmp_path / "trained_rm"
    reward.main(["--output_dir", str(rm), "--data_output_path", str(tmp_path / "data"), "--max_steps", "2", *RM_FAST])
    out = tmp_path / "out"
    (out / "step2_rm").mkdir(parents=True)  # an earlier run's reward model: not the one scored with now
    (out / "step2_rm" / "metrics.json").write_text(json.dumps({"accuracy": 0.5}))
    capsys.readouterr()
    report = pipeline.run_pipeline(_train_py_args(
        "--output-dir", str(out), "--step", "1", "3", "--reward-model", str(rm), "--step1-args", "--max_steps 2",
        "--step3-args", "--max_steps 1 --eval_prompts 8"))
    printed = capsys.readouterr().out
    recorded = json.loads((out / "step3_ppo" / "training_args.json").read_text())["flags"]
    assert recorded["critic_model_name_or_path"] == str(rm)
    assert f"--reward-model {rm} is a trained reward model: step 3 scores with it" in printed
    assert report["reward_model"] == str(rm) and report["rm_accuracy"] is None
    assert report["not_reported"] == ["step2_rm"] and report["held_out"]["ppo_policy"]["reward_mean"] is not None
    assert f"reward model: {rm} (given by --reward-model; no step 2 in this run)" in printed
    assert find_reward_model_path(str(out)) == str(rm), "the tools score a run with the reward model it used"
    # --resume: step 3 was made from step 1's output and the reward model given, not from the older step2_rm
    again = pipeline.run_pipeline(_train_py_args(
        "--output-dir", str(out), "--step", "1", "3", "--reward-model", str(rm), "--step1-args", "--max_steps 2",
        "--step3-args", "--max_steps 1 --eval_prompts 8", "--resume"))
    assert again["skipped"] == ["step1", "step3"], capsys.readouterr().out
    # a --reward-model that is no trained reward model: said, and step 3 scores with step 2's output
    pipeline.check_model_folders([3], _train_py_args("--output-dir", str(out), "--step", "3", "--reward-model",
                                                     str(out / "step1_sft")))
    assert f"--reward-model {out / 'step1_sft'} is step 1's output, an SFT policy, no trained reward model (no value " \
           f"head): step 3 scores with {out / 'step2_rm'}, step 2's output" in capsys.readouterr().out
    with pytest.raises(MissingInputError, match="--reward-model .*typo"):  # a mistyped folder: not step 2's instead
        pipeline.check_model_folders([3], _train_py_args("--output-dir", str(out), "--step", "3", "--reward-model",
                                                         str(tmp_path / "typo")))
    # a reward model to start step 1 from: refused with its flag before any data loads (it was step 1's error)
    with pytest.raises(UsageError, match=f"--actor-model {rm}: a reward model .*not a policy"):
        pipeline.check_model_folders([1, 3], _train_py_args("--output-dir", str(out), "--actor-model", str(rm)))
    (rm / "config.json").unlink()
    with pytest.raises(MissingInputError, match=f"its step 3 scored with the reward model {rm} .*holds no model now"):
        find_reward_model_path(str(out))
    # ... and without step 2's output the error says both ways
    with pytest.raises(MissingInputError, match="step2_rm, step 2's output, which does not exist: run step 2 too "
                                                r"\(--step 2 3\) or first, or give --reward-model a trained reward "
                                                "model folder"):
        import shutil

        shutil.rmtree(out / "step2_rm")
        pipeline.run_pipeline(_train_py_args("--output-dir", str(out), "--step", "3", "--reward-model",
                                             str(out / "step1_sft")))
    # (a hub name not in the hub cache, offline: said before anything runs, not looked up)
    with pytest.raises(MissingInputError, match=r"--reward-model Skywork/Reward-8B: no such folder here, nor a model "
                                                r"of that name in the Hugging Face hub cache, and HF_HUB_OFFLINE"):
        pipeline.run_pipeline(_train_py_args("--output-dir", str(out), "--step", "3", "--reward-model",
                                             "Skywork/Reward-8B"))


def test_train_py_says_what_a_reward_model_given_that_is_a_policy_is(tmp_path, distributed, capsys):
    """train.py --step 1 3 --reward-model <step 1's output> ended in "step 3 reads OUT/step2_rm ..., or give
    --reward-model a trained reward model folder": the user had given one, and was not told it is a policy."""
    import shutil

    from dschat import pipeline
    from dschat.errors import MissingInputError
    from dschat.models.loading import resolve_model_path

    sft_out, step3_out, out = tmp_path / "step1_sft", tmp_path / "step3_ppo", tmp_path / "out"
    shutil.copytree(resolve_model_path("tiny-llama"), sft_out)
    shutil.copytree(resolve_model_path("tiny-llama"), step3_out / "actor")
    for folder, step in ((sft_out, "step1"), (step3_out, "step3")):
        (folder / "training_args.json").write_text(json.dumps({"step": step, "flags": {}}))
        (folder / "metrics.json").write_text("{}")
    with pytest.raises(MissingInputError, match=r"or give --reward-model a trained reward model folder to score with "
                                                rf"\(--reward-model {re.escape(str(sft_out))} is step 1's output, an "
                                                r"SFT policy, no trained reward model \(no value head\)\)$"):
        pipeline.run_pipeline(_train_py_args("--step", "1", "3", "--reward-model", str(sft_out),
                                             "--output-dir", str(out)))
    assert not out.exists(), "no step may have run"
    capsys.readouterr()
    pipeline.check_model_folders([3], _train_py_args("--step", "3", "--reward-model", str(step3_out / "actor"),
                                                     "--output-dir", str(out)))
    assert f"--reward-model {step3_out / 'actor'} is step 3's actor, a policy, no trained reward model (no value " \
           f"head): step 3 scores with {out / 'step2_rm'}" in capsys.readouterr().out


def test_train_py_warns_of_step_3s_critic_given_as_reward_model_in_its_own_flags(tmp_path, distributed, capsys):
    """train.py --reward-model <run>/step3_ppo/critic said "is a trained reward model", then step 3 warned that it is
    a critic, telling the user to "give it with --reward_model_name_or_path, which defaults to
    --critic_model_name_or_path": step flags train.py's user does not type (its --reward-model sets both)."""
    from dschat import pipeline
    from dschat.models.checkpoint import save_reward_model
    from dschat.models.loading import load_tokenizer, resolve_model_path
    from dschat.models.reward_model import create_critic_model
    from dschat.rlhf.config import warn_of_a_critic_as_reward_model

    step3_out, out = tmp_path / "run" / "step3_ppo", tmp_path / "out"
    critic = str(step3_out / "critic")
    save_reward_model(create_critic_model(resolve_model_path("tiny-llama"), None), load_tokenizer("tiny-llama"), critic)
    (step3_out / "training_args.json").write_text(json.dumps({"step": "step3", "flags": {}}))
    args = _train_py_args("--step", "1", "3", "--reward-model", critic, "--output-dir", str(out))
    ready = pipeline.ready_reward_model(args)
    assert ready == critic, "used as given"
    capsys.readouterr()
    pipeline.say_recipe_notes(args, "ppo", [1, 3], False, ready)
    said = capsys.readouterr().out
    assert "is a trained reward model" not in said
    assert said.startswith(f"warning: --reward-model {critic}: step 3's critic (the value model PPO trains beside the "
                           "actor), not a reward model: ")
    assert said.rstrip().endswith("; as given, step 3 scores with it and starts its critic from it (no step 2 in "
                                  "this run)")
    with pipeline.says_train_py_flags(3, args, pipeline.step_argv(3, args, False)):
        warn_of_a_critic_as_reward_model(critic, by_default=True)  # (step 3's, under train.py)
    assert capsys.readouterr().err.rstrip().endswith("; give it with --reward_model_name_or_path, which defaults to "
                                                     "--reward-model")


def _save_tiny_sequence_classifier(folder):
    """A reward model as TRL saves one (a one-label *ForSequenceClassification), with tiny-llama's tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from dschat.models.loading import load_tokenizer, resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path("tiny-llama"))
    config.num_labels, config.pad_token_id = 1, load_tokenizer("tiny-llama").pad_token_id
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    load_tokenizer("tiny-llama").save_pretrained(folder)


def test_train_py_step_3_scores_with_a_hub_reward_model_by_its_name(tmp_path, distributed, hub_cache, capsys):
    """A hub reward model (e.g. Skywork-Reward, a one-label *ForSequenceClassification) as --reward-model had to be
    downloaded to a folder first: by its name, step 3 read step 2's output instead. Now step 3 scores with it and
    starts its critic from it, and the tools score the run with it."""
    from dschat import pipeline
    from dschat.models.loading import resolve_model_path
    from dschat.tools.common import find_reward_model_path

    hub_cache("acme/tiny-reward", _save_tiny_sequence_classifier)
    hub_cache("acme/tiny-lm", lambda folder: __import__("shutil").copytree(resolve_model_path("tiny-llama"), folder))
    out = tmp_path / "out"
    args = ("--output-dir", str(out), "--step", "1", "3", "--step1-args", "--max_steps 1",
            "--step3-args", "--max_steps 1 --eval_prompts 4")
    assert pipeline.ready_reward_model(_train_py_args(*args, "--reward-model", "acme/tiny-lm")) is None, \
        "a hub language model is no reward model"
    capsys.readouterr()
    report = pipeline.run_pipeline(_train_py_args(*args, "--reward-model", "acme/tiny-reward"))
    printed = capsys.readouterr().out
    recorded = json.loads((out / "step3_ppo" / "training_args.json").read_text())["flags"]
    assert recorded["critic_model_name_or_path"] == "acme/tiny-reward"
    assert "--reward-model acme/tiny-reward is a trained reward model: step 3 scores with it" in printed
    assert report["reward_model"] == "acme/tiny-reward" and report["held_out"]["ppo_policy"]["reward_mean"] is not None
    assert find_reward_model_path(str(out)) == "acme/tiny-reward"


def test_train_py_asks_again_whether_a_hub_name_is_a_reward_model_when_a_connection_error_hid_its_file(
        hub_cache, reachable_hub, monkeypatch):
    """A hub reward model saved by dschat is told by its reward_model.json (its config is the backbone's). Online, a
    connection error left that file unfetched (the hub client answers None, as for a file the model has not), and
    train.py kept "no reward model" for the name for the rest of the process: a notebook's run after the network came
    back trained step 2 from it (or GRPO refused it), as no step 3 scorer. Such an answer is not kept now."""
    import shutil

    import transformers.utils.hub
    from transformers import AutoConfig, AutoModel

    from dschat import pipeline
    from dschat.models.checkpoint import save_reward_model
    from dschat.models.loading import load_tokenizer, resolve_model_path
    from dschat.models.reward_model import REWARD_META_FILE, RewardModel

    def save(folder):
        backbone = AutoModel.from_config(AutoConfig.from_pretrained(resolve_model_path("tiny-llama")))
        save_reward_model(RewardModel(backbone), load_tokenizer("tiny-llama"), str(folder))

    name = "acme/dschat-rm-behind-a-flaky-network"
    snapshot = hub_cache(name, save)
    aside = snapshot.parent.parent / REWARD_META_FILE
    shutil.move(snapshot / REWARD_META_FILE, aside)  # (not downloaded yet)
    network_up = [False]

    def fetched(repo, filename, **kwargs):  # (the hub client: a file of the snapshot, downloaded where it is up)
        if filename == REWARD_META_FILE and network_up[0] and aside.exists():
            shutil.move(aside, snapshot / filename)
        return str(snapshot / filename) if (snapshot / filename).exists() else None

    monkeypatch.setattr(transformers.utils.hub, "cached_file", fetched)
    args = _train_py_args("--step", "3", "--reward-model", name)
    assert pipeline.ready_reward_model(args) is None
    network_up[0] = True
    assert pipeline.ready_reward_model(args) == name


def test_train_py_asks_again_whether_a_hub_name_is_a_reward_model_in_another_hub_cache(tmp_path, hub_cache,
                                                                                        monkeypatch):
    """train.py kept whether a hub name is a reward model by the name alone: a notebook that changed HF_HUB_CACHE to
    another download of the name got the first cache's answer. It is kept per hub cache now, as the fetched
    snapshot folders are (``hub_lookup_key``)."""
    import shutil

    from huggingface_hub import constants

    from dschat import pipeline
    from dschat.models.loading import resolve_model_path

    name = "acme/rm-in-one-cache-only"
    rm_cache = tmp_path / "rm_cache"
    hub_cache(name, _save_tiny_sequence_classifier)
    shutil.move(constants.HF_HUB_CACHE, rm_cache)
    hub_cache(name, lambda folder: shutil.copytree(resolve_model_path("tiny-llama"), folder))  # (a language model)
    lm_cache = constants.HF_HUB_CACHE
    args = _train_py_args("--step", "3", "--reward-model", name)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(rm_cache))
    assert pipeline.ready_reward_model(args) == name
    monkeypatch.setattr(constants, "HF_HUB_CACHE", lm_cache)
    assert pipeline.ready_reward_model(args) is None, "the other cache's answer"


def test_train_py_keeps_whether_a_hub_name_is_a_reward_model_when_its_own_probe_turns_offline_mode_on(
        unreachable_hub, monkeypatch):
    """Whether a hub name is a reward model is asked on rank 0 and sent to every rank (``rank_0_decides``, a
    collective) where a rank's memo lacks it. Keyed by HF_HUB_OFFLINE as it is now, the memo missed on a rank whose own
    probe of the hub had turned offline mode on since (rank 0 alone, in train.py's pre-flight of hub data) while the
    others hit it: that rank waited alone in the broadcast. Offline mode counts in the key as the user chose it only."""
    from huggingface_hub import constants

    from dschat import pipeline
    from dschat.models import reward_model
    from dschat.models.loading import HUB_UNREACHABLE_ENV, read_hub_cache_only_if_unreachable

    name = "acme/rm-asked-before-the-hub-went-away"
    asked = []
    monkeypatch.setattr(reward_model, "hub_holds_reward_model", lambda n: asked.append(n) or True)
    args = _train_py_args("--step", "3", "--reward-model", name)
    assert pipeline.ready_reward_model(args) == name
    assert read_hub_cache_only_if_unreachable(say=False)  # (this rank's probe failed: offline mode on, here alone)
    assert pipeline.ready_reward_model(args) == name
    assert asked == [name], "asked again on this rank alone: a collective its peers, whose memo holds it, do not make"
    monkeypatch.setenv(HUB_UNREACHABLE_ENV, "")  # (offline mode as the user sets it, on every rank: asked again)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert pipeline.ready_reward_model(args) == name
    assert asked == [name, name]


def test_train_py_grpo_is_rewarded_by_a_trained_reward_model_and_dpo_refuses_one(tmp_path, distributed, hub_cache,
                                                                                  capsys):
    """--reward-model was silently unused by --recipe grpo and dpo, and, as no tiny preset, it turned the tiny recipe
    off (bf16, default batches) or made the data DeepSpeed-Chat's hub dataset. GRPO is now rewarded by a trained one
    (not the rule scorer); DPO, which scores with none, refuses it; an untrained one is refused for GRPO."""
    from dschat import pipeline
    from dschat.errors import UsageError
    from dschat.models.loading import resolve_model_path

    hub_cache("acme/grpo-reward", _save_tiny_sequence_classifier)
    out = tmp_path / "grpo"
    capsys.readouterr()
    report = pipeline.run_pipeline(_train_py_args(
        "--recipe", "grpo", "--reward-model", "acme/grpo-reward", "--output-dir", str(out),
        "--step1-args", "--max_steps 1", "--step3-args", "--max_steps 1 --eval_prompts 4"))
    printed = capsys.readouterr().out
    flags = json.loads((out / "step3_ppo" / "training_args.json").read_text())["flags"]
    assert flags["reward_model_name_or_path"] == "acme/grpo-reward" and flags["reward_model_weight"] == 1.0
    assert not flags["reward_fn"] and flags["advantage_estimator"] == "grpo"
    assert flags["data_split"] == "4,4,2" and flags["dtype"] == "fp32", "the tiny recipe still applies"
    assert "step 3 scores with it (GRPO: instead of --reward_fn)" in printed
    assert report["reward_model"] == "acme/grpo-reward" and report["held_out"]["ppo_policy"]["reward_mean"] is not None
    assert report["step3_algorithm"] == "GRPO" and "held-out GRPO policy: reward" in printed
    with pytest.raises(UsageError, match="--reward-model acme/grpo-reward: --recipe dpo scores with no reward model"):
        pipeline.run_pipeline(_train_py_args("--recipe", "dpo", "--reward-model", "acme/grpo-reward",
                                             "--output-dir", str(tmp_path / "dpo")))
    with pytest.raises(UsageError, match="is no trained reward model .*--recipe grpo has no step 2 to train one"):
        pipeline.run_pipeline(_train_py_args("--recipe", "grpo", "--reward-model", resolve_model_path("tiny-opt"),
                                             "--output-dir", str(tmp_path / "grpo2")))
    # by hub name: a language model, an encoder's one-label classifier (its head is no "score"), no model at all
    hub_cache("acme/grpo-lm", lambda folder: __import__("shutil").copytree(resolve_model_path("tiny-llama"), folder))

    def save_encoder_classifier(folder):
        from transformers import BertConfig, BertForSequenceClassification

        BertForSequenceClassification(BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1,
                                                 num_attention_heads=2, intermediate_size=64,
                                                 num_labels=1)).save_pretrained(folder)

    hub_cache("acme/bert-rm", save_encoder_classifier)
    for name in ("acme/grpo-lm", "acme/bert-rm"):
        with pytest.raises(UsageError, match=f"--reward-model {name} is no folder here, and no hub reward model by its "
                                             "config.json .*--recipe grpo has no step 2"):
            pipeline.run_pipeline(_train_py_args("--recipe", "grpo", "--reward-model", name,
                                                 "--output-dir", str(tmp_path / "grpo2")))
    with pytest.raises(UsageError, match="--reward-model acme/nothing: no such folder here, nor a model of that name "
                                         "in the Hugging Face hub cache"):  # (offline: not looked up)
        pipeline.run_pipeline(_train_py_args("--recipe", "grpo", "--reward-model", "acme/nothing",
                                             "--output-dir", str(tmp_path / "grpo2")))


def test_train_py_step_args_take_a_single_flag_and_bad_quoting_is_a_usage_error(tmp_path, distributed):
    from dschat import pipeline
    from dschat.errors import UsageError

    args = _train_py_args("--step1-args", "--check_grad_overflow", "--step3-args", "--print_answers")
    assert args.step1_args == "--check_grad_overflow" and args.step3_args == "--print_answers"
    with pytest.raises(UsageError, match="--step1-args .*No closing quotation"):
        pipeline.step_argv(1, _train_py_args("--step1-args", "--data_path 'a b"), tiny=True)


def test_train_py_step_3_says_a_tiny_preset_reward_model_is_not_what_it_scores_with(tmp_path, distributed, capsys):
    """--step 3 --reward-model tiny-opt (an untrained preset, not the actor's) was silently unused: step 3 scored with
    step 2's output, as it says for any other --reward-model that is no trained reward model."""
    from dschat import pipeline

    out = tmp_path / "out"
    pipeline.check_model_folders([3], _train_py_args("--output-dir", str(out), "--step", "3", "--reward-model",
                                                     "tiny-opt"))
    assert f"--reward-model tiny-opt is no trained reward model (no value head): step 3 scores with " \
           f"{out / 'step2_rm'}, step 2's output" in capsys.readouterr().out
    pipeline.check_model_folders([3], _train_py_args("--output-dir", str(out), "--step", "3"))  # the actor's: no note
    assert capsys.readouterr().out == ""


def test_train_py_step_2_without_reward_model_names_actor_model_for_a_model_folder_that_is_none(tmp_path, distributed):
    """--step 2 3 --actor-model FOLDER (no --reward-model): step 2 trains from --actor-model's value, and the error
    for a folder holding no model named --reward-model alone, a flag the user never gave."""
    from dschat import pipeline
    from dschat.errors import MissingInputError

    folder = tmp_path / "notmodel"
    folder.mkdir()
    out = tmp_path / "out"
    defaulted = re.escape(f"--reward-model (default: --actor-model) {folder}: no model")
    with pytest.raises(MissingInputError, match=defaulted):
        pipeline.check_model_folders([2, 3], _train_py_args("--output-dir", str(out), "--step", "2", "3",
                                                            "--actor-model", str(folder)))
    with pytest.raises(MissingInputError, match=re.escape(f"--reward-model {folder}: no model")):  # given: as given
        pipeline.check_model_folders([2, 3], _train_py_args("--output-dir", str(out), "--step", "2", "3",
                                                            "--reward-model", str(folder)))


def test_train_py_says_its_own_flag_error_once_on_a_machine_of_several_ranks(monkeypatch, capsys):
    """`deepspeed --num_gpus 2 train.py --bogus` printed train.py's usage block and error once per rank (the step
    scripts' parsers say theirs once); two parses in one process stand for two ranks of one launch."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    flag = f"--bogus-{os.getpid()}-{time.time_ns()}"  # (a message no earlier run said)
    for _ in range(2):
        with pytest.raises(SystemExit):
            _train_py_args(flag)
    assert capsys.readouterr().err.count(f"error: unrecognized arguments: {flag}") == 1


@pytest.mark.parametrize("recipe", ["ppo", "grpo"])
def test_train_py_step_1_alone_with_a_trained_reward_model_is_the_tiny_run_step_3_makes_it(recipe, tmp_path):
    """--step 1 --reward-model RM (a trained reward model, tiny actor) trained step 1 on DeepSpeed-Chat's hub data with
    the steps' defaults, while --step 1 3 with the same flags trains it with the tiny recipe on the tiny data."""
    from dschat import pipeline

    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "config.json").write_text("{}")
    (rm / "value_head.safetensors").write_bytes(b"")  # (what marks a trained reward model folder)
    for steps in (["1", "3"], ["1"]):
        args = _train_py_args("--recipe", recipe, "--step", *steps, "--reward-model", str(rm))
        assert pipeline.is_tiny_run(args), steps
    assert not pipeline.is_tiny_run(_train_py_args("--step", "1", "--reward-model", str(tmp_path)))  # an untrained one


@pytest.mark.parametrize("flag", ["--actor-model", "--reward-model"])
def test_train_py_refuses_an_empty_model_naming_the_flag(capsys, flag):
    """--actor-model '' (an unset shell variable) got past every check: train.py replaced the output folder's report
    with an unfinished one, then step 1 failed with "error: : no such folder here, and loading it as a Hugging Face
    hub name failed"; --reward-model '' silently became the actor's."""
    with pytest.raises(SystemExit):
        _train_py_args(flag, "")
    assert f"argument {flag}: expected a hub name, local folder or tiny preset, got ''" in capsys.readouterr().err


def test_train_py_refuses_an_empty_output_dir_naming_the_flag(capsys):
    """--output-dir '' (an unset shell variable) put the steps' folders, data cache and report.json in the working
    directory."""
    with pytest.raises(SystemExit):
        _train_py_args("--output-dir", "")
    assert "argument --output-dir: expected a folder, got '' (give . for the working directory)" in capsys.readouterr().err


def test_train_py_reward_model_defaults_to_the_actor_and_another_tokenizer_fails_before_step_1(tmp_path, distributed):
    import json
    import shutil

    from dschat import pipeline
    from dschat.errors import UsageError
    from dschat.models.loading import resolve_model_path

    assert _train_py_args("--actor-model", "facebook/opt-1.3b").reward_model == "facebook/opt-1.3b"
    assert _train_py_args().reward_model == "tiny-llama"
    other = tmp_path / "other"
    shutil.copytree(resolve_model_path("tiny-gpt2"), other)
    spec = json.loads((other / "tokenizer.json").read_text())
    spec["model"]["vocab"]["a"], spec["model"]["vocab"]["b"] = spec["model"]["vocab"]["b"], spec["model"]["vocab"]["a"]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    args = _train_py_args("--actor-model", str(resolve_model_path("tiny-gpt2")), "--reward-model", str(other),
                          "--output-dir", str(tmp_path / "out"))
    with pytest.raises(UsageError, match="train.py: --reward-model .* has another tokenizer than the actor"):
        pipeline.run_pipeline(args)
    assert not (tmp_path / "out" / "step1_sft").exists()
    shutil.rmtree(other)  # the same ids, another format (a chat template): refused before step 1 too
    shutil.copytree(resolve_model_path("tiny-gpt2"), other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ messages[0]['content'] }}"}))
    with pytest.raises(UsageError, match="train.py: --reward-model .* formats a conversation otherwise than the actor"):
        pipeline.run_pipeline(args)
    assert not (tmp_path / "out" / "step1_sft").exists()


def test_a_model_folder_that_is_not_there_is_an_error_naming_the_flag(tmp_path, distributed):
    # a typo in a local model path must not end in transformers' "Repo id must be in the form ..." traceback
    from dschat import pipeline
    from dschat.errors import MissingInputError
    from dschat.models.loading import load_tokenizer, resolve_model_path
    from dschat.rlhf.config import check_earlier_step_outputs, step3_args

    missing = str(tmp_path / "no_such_model")
    args = _train_py_args("--actor-model", missing, "--output-dir", str(tmp_path / "out"))
    with pytest.raises(MissingInputError, match=f"--actor-model {missing}: no such folder"):
        pipeline.run_pipeline(args)
    args = _train_py_args("--actor-model", resolve_model_path("tiny-gpt2"), "--reward-model", missing,
                          "--output-dir", str(tmp_path / "out"))
    with pytest.raises(MissingInputError, match=f"--reward-model {missing}: no such folder"):
        pipeline.run_pipeline(args)
    assert not (tmp_path / "out").exists(), "no step may have run"
    with pytest.raises(MissingInputError, match=f"--model_name_or_path {missing}: no such folder"):
        sft.main(["--model_name_or_path", missing, "--output_dir", str(tmp_path / "sft")])
    # not a minute of hub retries
    with pytest.raises(MissingInputError, match=r"--model_name_or_path tiny-opt2: no such tiny preset \(they are "
                                                r"tiny-llama, tiny-opt, .*\) nor folder"):
        sft.main(["--model_name_or_path", "tiny-opt2", "--output_dir", str(tmp_path / "sft")])
    args = _train_py_args("--actor-model", "tiny-lama", "--output-dir", str(tmp_path / "out"))
    with pytest.raises(MissingInputError, match=r"--actor-model tiny-lama: no such tiny preset"):
        pipeline.run_pipeline(args)
    with pytest.raises(MissingInputError, match=f"--critic_model_name_or_path {missing}: no such folder"):
        check_earlier_step_outputs(step3_args({"actor_model_name_or_path": resolve_model_path("tiny-gpt2"),
                                               "critic_model_name_or_path": missing}))
    # a folder without a model (a PEFT adapter's, an empty one): transformers' "Unrecognized model" traceback, in
    # train.py after step 1 had trained when it was the --reward-model
    adapter, empty = tmp_path / "adapter", tmp_path / "empty"
    adapter.mkdir(), empty.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    args = _train_py_args("--actor-model", resolve_model_path("tiny-gpt2"), "--reward-model", str(adapter),
                          "--output-dir", str(tmp_path / "out"))
    with pytest.raises(MissingInputError, match=f"--reward-model {adapter}: a PEFT adapter folder .*merge_and_unload"):
        pipeline.run_pipeline(args)
    with pytest.raises(MissingInputError, match=rf"--model_name_or_path {empty}: no model in this folder: expected a "
                                                r"model folder \(config.json\)"):
        sft.main(["--model_name_or_path", str(empty), "--output_dir", str(tmp_path / "sft")])
    # a run's output folder given as a model: its models named (the tools take it, train.py's flags do not)
    (empty / "step2_rm").mkdir()
    (empty / "step2_rm" / "config.json").write_text("{}")
    with pytest.raises(MissingInputError, match=rf"no model in this folder: .*\(a run's output folder: its models are "
                                                rf"{empty / 'step2_rm'}\)"):
        pipeline.run_pipeline(_train_py_args("--step", "1", "3", "--reward-model", str(empty),
                                             "--output-dir", str(tmp_path / "out")))
    # a model saved without its tokenizer, or config.json copied without the weights: transformers' tracebacks (a
    # tokenizer's said "You need to have sentencepiece or tiktoken installed"), after step 1 had read the data
    import shutil

    no_tokenizer, no_weights = tmp_path / "no_tokenizer", tmp_path / "no_weights"
    shutil.copytree(resolve_model_path("tiny-gpt2"), no_tokenizer)
    shutil.copytree(resolve_model_path("tiny-gpt2"), no_weights)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tokenizer / name).unlink()
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(MissingInputError, match=f"--actor-model {no_tokenizer}: no tokenizer files"):
        pipeline.run_pipeline(_train_py_args("--actor-model", str(no_tokenizer), "--output-dir", str(tmp_path / "out")))
    with pytest.raises(MissingInputError, match=f"{no_tokenizer}: no tokenizer files"):  # (chat.py, the tools)
        load_tokenizer(str(no_tokenizer))
    with pytest.raises(MissingInputError, match=f"--actor-model {no_weights}: config.json but no weights"):
        pipeline.run_pipeline(_train_py_args("--actor-model", str(no_weights), "--output-dir", str(tmp_path / "out")))
    assert not (tmp_path / "out").exists(), "no step may have run"


def test_a_reward_model_given_as_a_steps_policy_is_an_error_naming_the_flag_before_the_data_loads(
        tmp_path, distributed, monkeypatch):
    """A reward model as step 1's or DPO's --model_name_or_path, or step 3's --actor_model_name_or_path, was refused
    without its flag (as train.py's --actor-model and chat.py's --path name theirs), and step 3 said it only after it
    had loaded its prompts."""
    from dschat.errors import UsageError
    from dschat.models.checkpoint import save_reward_model
    from dschat.models.loading import load_tokenizer, resolve_model_path
    from dschat.models.reward_model import create_critic_model
    from dschat.steps import ppo

    rm = str(tmp_path / "rm")
    save_reward_model(create_critic_model(resolve_model_path("tiny-llama"), None), load_tokenizer("tiny-llama"), rm)
    monkeypatch.setattr(common, "load_step_data", lambda *a, **k: pytest.fail("the data loaded first"))
    monkeypatch.setattr(ppo, "prompt_loaders", lambda *a, **k: pytest.fail("the prompts loaded first"))
    said = f" {re.escape(rm)}: a reward model or critic \\(a value-head model\\), not a policy"
    for step in (sft, dpo):
        with pytest.raises(UsageError, match=f"^--model_name_or_path{said}"):
            step.main(["--model_name_or_path", rm, "--output_dir", str(tmp_path / "out"), *SFT_FAST])
    with pytest.raises(UsageError, match=f"^--actor_model_name_or_path{said}"):
        ppo.main(["--actor_model_name_or_path", rm, "--critic_model_name_or_path", rm,
                  "--output_dir", str(tmp_path / "out")])


def test_a_mistyped_step_folder_of_a_run_here_is_local_and_names_the_folder_meant(tmp_path, monkeypatch):
    """"out/step1_sfft" beside out/step1_sft is a typo of a folder, not the hub model "step1_sfft" of an organisation
    "out": one error at once (it was a hub lookup's retries, then transformers' error, from the notebook engine)."""
    from dschat.errors import MissingInputError
    from dschat.models.loading import check_model_path, load_tokenizer, looks_local

    monkeypatch.chdir(tmp_path)
    (tmp_path / "out" / "step1_sft").mkdir(parents=True)
    (tmp_path / "org").mkdir()
    assert looks_local("out/step1_sfft") and not looks_local("org/model")  # a folder named as an org: still a hub id
    with pytest.raises(MissingInputError, match=r"--actor_model_name_or_path out/step1_sfft: no such folder \(did "
                                                r"you mean out/step1_sft\?\)"):
        check_model_path("out/step1_sfft", "--actor_model_name_or_path")
    with pytest.raises(MissingInputError, match=r"^out/step1_sfft: no such folder \(did you mean out/step1_sft\?\)$"):
        load_tokenizer("out/step1_sfft")


def test_train_py_checks_every_steps_data_paths_before_the_first_step_runs(tmp_path, distributed):
    # a typo in step 3's (or step 1's --sft_only_data_path) data file must not cost the training of steps 1 and 2
    from dschat import pipeline
    from dschat.errors import MissingInputError, UsageError

    out = tmp_path / "out"
    for argv, error, message in (
            (["--step3-args", f"--data_path jsonl:{tmp_path}/typo.jsonl"], MissingInputError,
             f"^--data_path jsonl:{tmp_path}/typo.jsonl: {tmp_path}/typo.jsonl: no such file or folder$"),
            (["--step1-args", f"--sft_only_data_path {tmp_path}/typo.jsonl"], MissingInputError,
             f"^--sft_only_data_path {tmp_path}/typo.jsonl: no such file or folder$"),
            (["--step2-args", "--data_path Dahoas/rm-statc"], UsageError,
             "^--data_path: unknown dataset 'Dahoas/rm-statc'")):
        with pytest.raises(error, match=message):
            pipeline.run_pipeline(_train_py_args("--output-dir", str(out), *argv))
        assert not out.exists(), "no step may have run"


def test_train_py_finds_a_blank_unsupervised_file_before_step_1(tmp_path, distributed):
    """Step 3's --unsupervised_dataset_name file of blank lines only (or missing) was found by step 3, after steps 1
    and 2 had trained."""
    from dschat import pipeline
    from dschat.errors import MissingInputError
    from dschat.data.errors import DatasetFormatError

    blanks = tmp_path / "blanks.txt"
    blanks.write_text("\n \n\n")
    out = tmp_path / "out"
    for name, error, message in ((str(blanks), DatasetFormatError, f"{blanks} has only blank lines"),
                                 (str(tmp_path / "typo.txt"), MissingInputError, "unsupervised data file not found")):
        with pytest.raises(error, match=message):
            pipeline.run_pipeline(_train_py_args("--output-dir", str(out), "--step3-args",
                                                 f"--unsupervised_dataset_name {name}"))
        assert not out.exists(), "no step may have run"


def test_train_py_finds_too_few_step3_prompts_before_step_1(tmp_path, distributed, monkeypatch):
    """Step 3's share of local data that cannot fill one iteration is found before steps 1 and 2 train (a bound:
    the records before any is skipped), not after them; enough prompts pass."""
    from dschat import pipeline
    from dschat.errors import UsageError

    data = tmp_path / "small.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q{i}?", "chosen": "Yes.", "rejected": "No."}) + "\n"
                            for i in range(40)))
    out = tmp_path / "out"
    # 40 records: 36 train (9:1), a third of them (12) step 3's; an iteration takes 8 x 2
    argv = ["--output-dir", str(out), "--data-path", f"jsonl:{data}", "--step3-args",
            "--data_split 1,1,1 --per_device_generation_batch_size 8 --generation_batches 2"]
    with pytest.raises(UsageError, match=r"step3: at most 12 training prompts make no iteration: one takes "
                                         r"--per_device_generation_batch_size 8 x --generation_batches 2 x 1 rank"
                                         r".*found before the first step runs"):
        pipeline.run_pipeline(_train_py_args(*argv))
    assert not out.exists(), "no step may have run"

    class Ran(Exception):
        pass

    monkeypatch.setattr(pipeline, "run_step", lambda *a, **k: (_ for _ in ()).throw(Ran()))
    with pytest.raises(Ran):
        pipeline.run_pipeline(_train_py_args(*argv[:-1], argv[-1].replace("--generation_batches 2", "")))


def test_train_py_finds_step2_data_without_pairs_before_step_1(tmp_path, distributed):
    """SFT or unpaired data for every step: step 1 trained, then step 2 skipped every record ("no rejected answer")."""
    from dschat import pipeline
    from dschat.data import DatasetFormatError
    from dschat.errors import UsageError

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Q{i}?"},
                                                     {"role": "assistant", "content": "Yes."}]}) + "\n"
                            for i in range(40)))
    out = tmp_path / "out"
    for recipe, what, end in (("ppo", "step 2", ", or train without it: --recipe grpo$"), ("dpo", "DPO", "$")):
        with pytest.raises(UsageError, match=rf"{what} trains on preference pairs, and --data-path jsonl:.* has no "
                                             rf"rejected answers.*\.\.\.\"\){end}"):
            pipeline.run_pipeline(_train_py_args("--output-dir", str(out), "--data-path", f"jsonl:{data}",
                                                 "--recipe", recipe))
        assert not out.exists(), "no step may have run"
    # a rejected=... naming a column the file lacks is why: said as such ("no rejected answers" sent one looking)
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("q,a,b\n" + "".join(f"Q{i}?,yes,no\n" for i in range(40)))
    with pytest.raises(DatasetFormatError, match=r"pairs\.csv: no 'c' field, which --data-fields rejected=c names; "
                                                 r"the records have \['q', 'a', 'b'\]"):
        pipeline.run_pipeline(_train_py_args("--output-dir", str(out), "--data-path", f"csv:{pairs}",
                                             "--data-fields", "prompt=q,chosen=a,rejected=c"))
    assert not out.exists(), "no step may have run"


def test_train_py_finds_prompts_only_data_step_1_cannot_train_on_before_step_1(tmp_path, distributed):
    """Step 3's prompts given to every step: train.py's pre-flight passed them, and step 1 refused them only once it
    had loaded its model and read its data."""
    from dschat import pipeline
    from dschat.data import DatasetFormatError

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q{i}?"}) + "\n" for i in range(400)))  # (an iteration of step 3)
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def score(prompts, completions, **columns):\n    return [0.0] * len(completions)\n")
    out = tmp_path / "out"
    for recipe in ("grpo", "ppo"):  # (PPO's step 2 check would say "no rejected answers": step 1 is the first)
        with pytest.raises(DatasetFormatError, match=r"prompts\.jsonl: has prompts but no answers .* not step 1"):
            pipeline.run_pipeline(_train_py_args("--output-dir", str(out), "--data-path", f"jsonl:{data}",
                                                 "--recipe", recipe, "--step3-args", f"--reward_fn {rewards}:score"))
        assert not out.exists(), "no step may have run"


def test_train_py_says_step_args_of_a_step_it_does_not_run_are_ignored(tmp_path, distributed, monkeypatch, capsys):
    from dschat import pipeline

    class Ran(Exception):
        pass

    monkeypatch.setattr(pipeline, "run_step", lambda *a, **k: (_ for _ in ()).throw(Ran()))
    with pytest.raises(Ran):
        pipeline.run_pipeline(_train_py_args("--output-dir", str(tmp_path / "out"), "--recipe", "dpo",
                                             "--step3-args", "--ppo_epochs 2"))
    out = capsys.readouterr().out
    assert "--step3-args '--ppo_epochs 2': ignored, step 3 is not run (--step, --recipe)" in out
    with pytest.raises(Ran):
        pipeline.run_pipeline(_train_py_args("--output-dir", str(tmp_path / "out"), "--step3-args", "--ppo_epochs 2"))
    assert "ignored" not in capsys.readouterr().out


def test_train_py_says_the_tiny_recipe_applies_to_own_data(tmp_path, distributed, monkeypatch, capsys):
    from dschat import pipeline

    class Ran(Exception):
        pass

    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q{i}?", "chosen": "Yes.", "rejected": "No."}) + "\n"
                            for i in range(400)))
    monkeypatch.setattr(pipeline, "run_step", lambda *a, **k: (_ for _ in ()).throw(Ran()))
    with pytest.raises(Ran):
        pipeline.run_pipeline(_train_py_args("--output-dir", str(tmp_path / "out"), "--data-path", f"jsonl:{data}"))
    assert "tiny run: the tiny recipe (TINY_RECIPE in dschat/pipeline.py" in capsys.readouterr().out
    with pytest.raises(Ran):
        pipeline.run_pipeline(_train_py_args("--output-dir", str(tmp_path / "out")))
    assert "tiny recipe" not in capsys.readouterr().out


def test_train_py_trains_real_models_on_deepspeed_chats_data_unless_given_other(tmp_path, distributed, monkeypatch,
                                                                                capsys):
    """A real model without --data-path trained on the embedded toy data, said only as "phase 1 tiny train"."""
    from dschat import pipeline
    from dschat.models.loading import resolve_model_path

    class Ran(Exception):
        pass

    argvs = []
    monkeypatch.setattr(pipeline, "run_step", lambda main, argv, *a: argvs.append(argv) or (_ for _ in ()).throw(Ran()))
    # (Dahoas/rm-static as if in the datasets cache, which train.py reads offline before step 1: the steps do not run)
    monkeypatch.setattr("dschat.data.base.load_hub_dataset", lambda name, flag, *args, **kwargs: {})
    real = resolve_model_path("tiny-opt")  # a folder: no preset name, so the steps' own defaults apply
    with pytest.raises(Ran):
        pipeline.run_pipeline(_train_py_args("--output-dir", str(tmp_path / "out"), "--actor-model", real))
    assert argvs[-1][:2] == ["--data_path", "Dahoas/rm-static"]
    assert "--data-path not given: Dahoas/rm-static, DeepSpeed-Chat's default" in capsys.readouterr().out
    with pytest.raises(Ran):
        pipeline.run_pipeline(_train_py_args("--output-dir", str(tmp_path / "out"), "--actor-model", real,
                                             "--data-path", "tiny"))
    assert argvs[-1][:2] == ["--data_path", "tiny"] and "not given" not in capsys.readouterr().out
    with pytest.raises(Ran):
        pipeline.run_pipeline(_train_py_args("--output-dir", str(tmp_path / "out")))  # the tiny presets: tiny data
    assert "--data_path" not in argvs[-1] and "not given" not in capsys.readouterr().out


def fake_launcher(monkeypatch, launched, status):
    """train.py's launcher process, faked: it records the command and ends with ``status``."""
    from types import SimpleNamespace

    class Launcher(SimpleNamespace):
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(subprocess, "Popen",
                        lambda cmd, **kw: launched.append(cmd) or Launcher(pid=-1, wait=lambda: status))


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_signal_to_train_py_reaches_the_ranks_of_the_launcher_it_started(tmp_path):
    """The local deepspeed launcher passes no signal on to its ranks: a SIGTERM to train.py alone (a container's stop,
    a job's kill PID) ended train.py and the launcher, and the ranks trained on, orphaned. train.py now ends, by the
    signal, once the rank has."""
    import signal
    import sys

    launcher = tmp_path / "launcher.py"  # as deepspeed's: starts a rank, passes nothing on, waits
    launcher.write_text("import subprocess, sys\n"
                        "rank = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
                        f"open({str(tmp_path / 'rank.pid')!r}, 'w').write(str(rank.pid))\n"
                        "rank.wait()\n")
    driver = subprocess.Popen([sys.executable, "-c", "import runpy, sys; run = runpy.run_path(sys.argv[1])"
                               "['run_launcher']; sys.exit(run([sys.executable, sys.argv[2]]))",
                               str(REPO / "train.py"), str(launcher)])
    pid_file = tmp_path / "rank.pid"
    for _ in range(600):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.05)
    rank = int(pid_file.read_text())
    driver.send_signal(signal.SIGTERM)
    try:
        assert driver.wait(timeout=30) == -signal.SIGTERM  # (as the shell sees a process the signal ended)
        assert not _running(rank), "the rank still runs after train.py has ended"  # (a zombie has ended)
    finally:
        try:
            os.kill(rank, signal.SIGKILL)
        except ProcessLookupError:
            pass


FAKE_PDSH = """#!{python}
import json, os, sys
with open(os.environ["SEEN_BY_PDSH"], "w") as f:
    json.dump(sys.argv[1:], f)
"""
FAKE_SSH = "#!/bin/sh\necho 10.0.0.7\n"  # (the launcher's ssh check, and its hostname -I for the master address)
# what the interpreter on a node is given, in place of running the deepspeed launcher there
SAY_WHAT_THE_NODE_RUNS = "import json, os, sys; print(json.dumps([os.getcwd(), os.environ['PYTHONPATH'], sys.argv[1:]]))"


def test_train_py_multi_node_quotes_the_line_each_nodes_shell_reads(tmp_path):
    """pdsh joins its words with spaces and each node's shell reads the line: deepspeed's launcher left the folder
    (cd), the interpreter and the script bare and put an argument with a space in double quotes, so a working folder
    with a space or a $ failed its cd and a --stepN-args "... $HOME/my data" reached the ranks expanded. A fake pdsh
    records the line; a shell runs it as a node's would, with the launcher swapped for a print of what it gets."""
    work = tmp_path / "my run $USER 'a'"
    bin_dir = tmp_path / "bin"
    for folder in (work, bin_dir):
        folder.mkdir()
    for name, text in (("pdsh", FAKE_PDSH.format(python=sys.executable)), ("ssh", FAKE_SSH)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (work / "hosts").write_text("node-a slots=1\nnode-b slots=1\n")
    given = ["--deployment-type", "multi_node", "--hostfile", "hosts", "--output-dir", "out $HOME `x`",
             "--step1-args", "--data_path 'local:$HOME/my data' --max_steps 1", "--step", "1"]
    env = {name: value for name, value in os.environ.items()
           if name not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SEEN_BY_PDSH=str(tmp_path / "pdsh.json"))
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *given], cwd=work, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    words = json.loads((tmp_path / "pdsh.json").read_text())
    folder, python_path, argv = json.loads(_run_as_a_node(words, SAY_WHAT_THE_NODE_RUNS, tmp_path))
    assert folder == str(work) and python_path.split(os.pathsep)[0] == str(work)
    assert argv[-len(given) - 1:] == [str(REPO / "train.py"), *given]


def _run_as_a_node(pdsh_words, say, cwd, shell="sh"):
    """The line pdsh's words give each node, run by a shell as the node's would, with DeepSpeed's launcher swapped for
    ``python -c SAY``: SAY's output."""
    line = " ".join(pdsh_words[pdsh_words.index("-w") + 2:]).replace("%n", "0")  # (pdsh's: %n, the node's rank)
    assert line.count(" -m deepspeed.launcher.launch ") == 1
    line = line.replace(" -m deepspeed.launcher.launch ", f" -c {shlex.quote(say)} ")
    node = subprocess.run([shell, "-c", line], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ["PATH"], "HOME": "/nowhere", "USER": "nobody"})
    assert node.returncode == 0, node.stderr[-3000:]
    return node.stdout


def test_multi_node_launcher_quotes_the_venv_script_each_nodes_shell_sources(tmp_path, monkeypatch):
    """DeepSpeed's launcher --venv_script is sourced on each node by a word of pdsh's line it left bare (``source
    PATH;``): a script in a folder with a space was two words, and the node's shell sourced another file. The line
    of the quoting launcher, run by a shell as a node's would, sources the script and starts the launcher."""
    from deepspeed.launcher import runner

    from dschat.utils.launcher import QuotedPDSHRunner

    venv = tmp_path / "my env $USER" / "activate"
    venv.parent.mkdir()
    venv.write_text("export VENV_ON=yes\n")
    monkeypatch.chdir(tmp_path)
    args = runner.parse_args(["--venv_script", str(venv), "train.py", "--x", "a b"])
    cmd, _, _ = QuotedPDSHRunner(args, "e30=").get_cmd({}, {"node-a": [0]})
    say = "import os, sys; print(os.environ['VENV_ON'], sys.argv[-3:])"
    assert _run_as_a_node(cmd, say, tmp_path, shell="bash").strip() == "yes ['train.py', '--x', 'a b']"


def test_multi_node_launcher_quotes_the_each_rank_log_folder(tmp_path, monkeypatch):
    """DeepSpeed's launcher --enable_each_rank_log FOLDER reached each node's launcher as a bare word of pdsh's line
    (``--enable_each_rank_log=FOLDER``): a folder with a space was two words, and the node's launcher logged into
    another folder (or failed on the word after it). The line, run by a shell as a node's would, gives it whole."""
    from deepspeed.launcher import runner

    from dschat.utils.launcher import QuotedPDSHRunner

    logs = tmp_path / "rank logs $USER"
    monkeypatch.chdir(tmp_path)
    args = runner.parse_args(["--enable_each_rank_log", str(logs), "train.py", "--x", "a b"])
    cmd, _, _ = QuotedPDSHRunner(args, "e30=").get_cmd({}, {"node-a": [0]})
    argv = json.loads(_run_as_a_node(cmd, "import json, sys; print(json.dumps(sys.argv[1:]))", tmp_path))
    assert f"--enable_each_rank_log={logs}" in argv and argv[-3:] == ["train.py", "--x", "a b"]


def test_train_py_multi_node_exports_deepspeed_env_lines_as_shell_text_and_its_own_values_as_they_are(
        tmp_path, monkeypatch):
    """The quoting launcher quoted .deepspeed_env's values too, where DeepSpeed's gave them to the node's shell in
    double quotes: HF_HOME=$HOME/hf (the README's advice: HF_HOME in .deepspeed_env) reached the ranks as the folder
    "$HOME/hf", where it was the node's home before. The file's lines go as DeepSpeed gives them; the launching
    shell's own values (PYTHONPATH of a folder with a $) stay as they are."""
    from deepspeed.launcher import runner

    from dschat.utils.launcher import QuotedPDSHRunner

    (tmp_path / ".deepspeed_env").write_text("HF_HOME=$HOME/hf cache\nNCCL_DEBUG=INFO\n")
    monkeypatch.setattr(runner, "DEEPSPEED_ENVIRONMENT_PATHS", [str(tmp_path)])
    launcher = QuotedPDSHRunner.__new__(QuotedPDSHRunner)
    launcher.exports = {}
    launcher.add_export("PYTHONPATH", "/work/$USER dir")  # (runner.main: the launching shell's, first)
    for line in (tmp_path / ".deepspeed_env").read_text().splitlines(keepends=True):  # (then the file's, as it reads)
        launcher.add_export(*line.split("=", maxsplit=1))
    exports = "".join(f"export {key}={value}; " for key, value in launcher.exports.items())  # (PDSHRunner.get_cmd's)
    node = subprocess.run(["sh", "-c", exports + 'echo "$PYTHONPATH|$HF_HOME|$NCCL_DEBUG"'], capture_output=True,
                          text=True, timeout=60, env={"PATH": os.environ["PATH"], "HOME": "/home/n", "USER": "u"})
    assert node.stdout.strip() == "/work/$USER dir|/home/n/hf cache|INFO", node.stderr


def test_train_py_multi_node_without_its_hostfile_is_an_error_not_a_single_node_run(tmp_path, monkeypatch):
    # the deepspeed launcher falls back to this node alone when the hostfile is missing: a typo must not do that
    import runpy

    from dschat.errors import MissingInputError

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # (restored: multi_node puts the repo on it)
    launched = []
    fake_launcher(monkeypatch, launched, 0)
    main = runpy.run_path(str(REPO / "train.py"))["main"]
    with pytest.raises(MissingInputError, match=f"--hostfile {tmp_path}/hosts: no such file"):
        main(["--deployment-type", "multi_node", "--hostfile", str(tmp_path / "hosts")])
    assert not launched
    (tmp_path / "hosts").write_text("worker-1 slots=8\n")
    with pytest.raises(SystemExit):
        main(["--deployment-type", "multi_node", "--hostfile", str(tmp_path / "hosts")])
    assert launched and launched[0][launched[0].index("--hostfile") + 1] == str(tmp_path / "hosts")
    launched.clear()
    with pytest.raises(SystemExit) as refused:  # one node's GPUs: a hostfile would go unused, silently
        main(["--deployment-type", "single_node", "--hostfile", str(tmp_path / "hosts")])
    assert refused.value.code == 2 and not launched
    with pytest.raises(SystemExit):  # nor the launcher's default one (/job/hostfile on a cluster's node)
        main(["--deployment-type", "single_node"])
    assert launched and launched[0][launched[0].index("--hostfile") + 1] == os.devnull


@pytest.mark.parametrize("launcher", ["mvapich (mpirun_rsh)", "mvapich/mpich (hydra)", "slurm (srun)"])
def test_train_py_on_the_ranks_of_a_launcher_that_sets_no_rank_runs_its_steps_there(launcher, monkeypatch):
    """Under `deepspeed --launcher slurm|mvapich train.py --deployment-type single_node` (no RANK in the ranks'
    environment) every rank started a deepspeed launch of its own, of all the node's GPUs."""
    import runpy

    import dschat.pipeline
    from test_dist import RANKS_OF_LAUNCHERS, launched_as

    launched_as(monkeypatch, RANKS_OF_LAUNCHERS[launcher])
    launched, ran = [], []
    fake_launcher(monkeypatch, launched, 0)
    monkeypatch.setattr(dschat.pipeline, "run_pipeline", ran.append)
    runpy.run_path(str(REPO / "train.py"))["main"](["--deployment-type", "single_node"])
    assert not launched and len(ran) == 1


def test_train_py_refuses_a_reward_zero_stage_dpo_would_not_use(capsys):
    import runpy

    main = runpy.run_path(str(REPO / "train.py"))["main"]
    with pytest.raises(SystemExit) as refused:  # DPO shards its policy and reference as the actor
        main(["--recipe", "dpo", "--reward-zero-stage", "2"])
    assert refused.value.code == 2 and "--recipe dpo has no reward model or critic" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # GRPO rewarded by --reward_fn has no model for it
        main(["--recipe", "grpo", "--reward-zero-stage", "2"])
    assert refused.value.code == 2 and "grpo without --reward-model has no reward model" in capsys.readouterr().err


def test_train_py_gives_grpo_a_critic_stage_only_for_its_reward_model(tmp_path):
    """--recipe grpo's step 3 was given --critic_zero_stage (the deployment's default) with no critic and no reward
    model for it to shard; with a trained --reward-model it shards that model, as --reward-zero-stage says."""
    from dschat import pipeline
    from dschat.args import step3_parser

    assert "--critic_zero_stage" not in pipeline.step_argv(3, _train_py_args("--recipe", "grpo"), True)
    assert "--critic_zero_stage" in pipeline.step_argv(3, _train_py_args(), True)  # (PPO's critic)
    _save_tiny_sequence_classifier(tmp_path / "rm")
    scored = _train_py_args("--recipe", "grpo", "--reward-model", str(tmp_path / "rm"), "--reward-zero-stage", "2")
    assert step3_parser().parse_args(pipeline.step_argv(3, scored, True)).critic_zero_stage == 2


def test_train_py_prints_the_launch_command_as_it_runs_it(monkeypatch, capsys):
    """The "launching:" line joined the arguments with spaces: a --stepN-args string of several flags came out as
    separate words, so the command copied from it failed ("unrecognized arguments")."""
    import runpy
    import shlex

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    launched = []
    fake_launcher(monkeypatch, launched, 0)
    main = runpy.run_path(str(REPO / "train.py"))["main"]
    with pytest.raises(SystemExit):
        main(["--deployment-type", "single_node", "--step1-args", "--max_steps 2 --learning_rate 1e-3"])
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("launching: ")]
    assert shlex.split(printed[0].removeprefix("launching: ")) == launched[0]


def test_train_py_ends_with_the_shells_status_of_a_launcher_killed_by_a_signal(monkeypatch):
    """subprocess.call gives -9 for a launcher killed by SIGKILL (out of memory): sys.exit(-9) ended train.py with
    status 247, not 137."""
    import runpy

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    main = runpy.run_path(str(REPO / "train.py"))["main"]
    for status, said in ((-9, 137), (2, 2), (0, 0)):
        fake_launcher(monkeypatch, [], status)
        with pytest.raises(SystemExit) as ended:
            main(["--deployment-type", "single_node"])
        assert ended.value.code == said


def test_a_rerun_in_the_same_second_purges_the_earlier_runs_points(tmp_path):
    """TensorBoard reads a folder's event files in name order, names starting with their second: a re-run made in the
    same second as an earlier run's file whose name sorts later (in one process "10" sorts before "9") had its purge
    read first, and the earlier run's points stayed drawn (a flaky CI failure)."""
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    earlier = SummaryWriter(str(tmp_path), purge_step=3)
    for step in (3, 4):
        earlier.add_scalar("reward", step, step)
    earlier.close()
    (made,) = tmp_path.iterdir()
    second = made.name.split(".")[3]
    made.rename(tmp_path / f"events.out.tfevents.{second}.~host.1.9")  # sorts after any name of the same second
    start = time.time()
    writer = common.purging_writer(str(tmp_path), purge_step=1)
    for step in (1, 2):
        writer.add_scalar("reward", step, step)
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.step for e in events.Scalars("reward")] == [1, 2]
    assert time.time() - start < 2.5  # it waits for the next second only


def test_restarting_deepspeeds_tensorboard_removes_its_unwritten_events_file_by_name_not_tensorboards_internals(
        tmp_path):
    """The writer DeepSpeed opened as it made the engine is closed unwritten and replaced by a purging one: its
    header-only file was found through tensorboard's private EventFileWriter._file_name, and a tensorboard without it
    left the file behind. A closed file with events, another process's file (a writer maybe still open) and
    another host's are kept."""
    import os
    import socket
    from types import SimpleNamespace

    from torch.utils.tensorboard import SummaryWriter

    def header_only_file(name):
        made = SummaryWriter(str(tmp_path / "made"))
        made.close()
        (only,) = (tmp_path / "made").iterdir()
        return only.rename(tmp_path / name).name

    earlier = SummaryWriter(str(tmp_path))
    earlier.add_scalar("Train/Samples/lr", 0.1, 1)
    earlier.close()
    with_events = {p.name for p in tmp_path.iterdir() if p.is_file()}
    others = {header_only_file(f"events.out.tfevents.0000000001.{socket.gethostname()}.{os.getpid() + 1}.0"),
              header_only_file(f"events.out.tfevents.0000000001.other-{socket.gethostname()}.{os.getpid()}.0")}
    deepspeeds = SummaryWriter(str(tmp_path))
    del deepspeeds.file_writer.event_writer._file_name  # (private: a tensorboard may name it otherwise)
    engine = SimpleNamespace(monitor=SimpleNamespace(tb_monitor=SimpleNamespace(summary_writer=deepspeeds)),
                             global_samples=4)
    common.restart_deepspeed_tensorboard(engine)
    engine.monitor.tb_monitor.summary_writer.close()
    files = {p.name for p in tmp_path.iterdir() if p.is_file()}
    assert len(files) == len(with_events | others) + 1 and with_events | others < files  # (+ the purging writer's)
    (restarted,) = files - with_events - others
    assert not common.holds_only_the_header(str(tmp_path / restarted))  # (its purge at step 5)


def _loop_engine():
    """A stand-in DeepSpeed engine for ``run_training``'s loop alone: every micro-batch ends an applied step."""
    from types import SimpleNamespace

    return SimpleNamespace(train=lambda: None, backward=lambda loss: None, step=lambda: None,
                           is_gradient_accumulation_boundary=lambda: True, was_step_applied=lambda: True,
                           get_global_grad_norm=lambda: 1.0, get_lr=lambda: [0.1])


def _loop_batches(count):
    return torch.utils.data.DataLoader([{"input_ids": torch.ones(2, dtype=torch.long)}] * count)


@pytest.mark.parametrize("max_steps, shown", [(6, "3/3"), (4, "1/1")])  # (4: the last epoch runs 1 of its 3)
def test_the_progress_bar_ends_at_the_micro_batches_trained_on(max_steps, shown, capsys):
    """The loop returns inside the bar's loop at the last step: the bar still counts that step's micro-batch (a
    2-rank run's bar stopped at 6/7 with all 14 steps done)."""
    from types import SimpleNamespace

    engine = _loop_engine()
    loader = _loop_batches(3)
    args = SimpleNamespace(gradient_accumulation_steps=1, num_train_epochs=2, seed=0, save_interval=0,
                           eval_interval=0, print_loss=False)
    common.run_training(engine, loader, lambda engine, batch: (torch.tensor(1.0), 2), None, args,
                        torch.device("cpu"), "step1", max_steps)
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "epoch 2/2" in last and shown in last, last


@pytest.mark.parametrize("two_terms", [False, True], ids=["plain_loss", "dpo_rpo_terms"])
def test_the_training_loop_reads_each_micro_batchs_loss_from_the_device_once(monkeypatch, two_terms):
    """A host read of a GPU tensor waits for the accelerator: d82cd98 read a plain loss's records term (a zero) and its
    tokens term with an item() each, a second wait on every micro-batch of steps 1, 2 and plain DPO. The logged loss
    is still each step's mean of its micro-batches' losses (DPO + RPO's terms summed)."""
    from types import SimpleNamespace

    reads = []
    for read in ("item", "tolist"):
        original = getattr(torch.Tensor, read)
        monkeypatch.setattr(torch.Tensor, read, lambda t, _original=original: (
            t.is_floating_point() and reads.append(t)) or _original(t))  # (not the data order's integer seeds)
    losses = iter([1.0, 3.0, 5.0, 7.0])

    def loss_fn(engine, batch):
        value = torch.tensor(next(losses), requires_grad=True)
        return (common.RecordAndTokenMeans(value / 4, value * 3 / 4) if two_terms else value), 2

    engine = _loop_engine()
    loader = _loop_batches(4)
    args = SimpleNamespace(gradient_accumulation_steps=2, num_train_epochs=1, seed=0, save_interval=0,
                           eval_interval=0, print_loss=False)
    train_loss = common.run_training(engine, loader, loss_fn, None, args, torch.device("cpu"), "step1", 2)
    assert len(reads) == 4  # (one a micro-batch; a step's loss is their sum on the host)
    assert train_loss == pytest.approx(4.0)


def test_a_loss_of_two_terms_logs_what_their_sum_as_one_loss_logs_with_one_micro_batch_a_step():
    """DPO + RPO's two terms (RecordAndTokenMeans) with one micro-batch a step on one rank (the tiny default) log the
    train loss the single loss (DPO mean + rpo_alpha x NLL, one fp32 tensor) logged before d82cd98, to the bit: the
    terms were read apart and summed on the host in float64, so the tiny default's metrics.json train_loss changed in
    its last digits (0.9522139368454615 -> 0.9522139364232619) though the weights were the same."""
    from types import SimpleNamespace

    records, tokens = torch.tensor(0.1), torch.tensor(0.7)  # (fp32 0.1 + 0.7 is not float64's 0.1 + 0.7)
    engine = _loop_engine()
    loader = _loop_batches(2)
    args = SimpleNamespace(gradient_accumulation_steps=1, num_train_epochs=1, seed=0, save_interval=0,
                           eval_interval=0, print_loss=False)

    def train_loss(loss):
        return common.run_training(engine, loader, lambda engine, batch: (loss, 2), None, args,
                                   torch.device("cpu"), "step2_dpo", 2)

    assert train_loss(common.RecordAndTokenMeans(records, tokens)) == train_loss(records + tokens)


@pytest.mark.parametrize("argv, expected", [([], False), (["--multiturn"], True)])
def test_step1_multiturn_flag_reaches_the_data(monkeypatch, tokenizer, argv, expected):
    from dschat.args import step1_parser

    given = {}
    monkeypatch.setattr("dschat.data.create_prompt_dataset", lambda *a, **k: given.update(k) or ((), ()))
    args = step1_parser().parse_args(["--data_path", "tiny", *argv])
    common.load_step_data(args, tokenizer, phase=1)
    assert given["multiturn"] is expected


@pytest.mark.parametrize("step_args, said", [
    (["--step3-args", "--max_answer_seq_len 300"],
     "--step3-args --max_prompt_seq_len + the longer of --max_answer_seq_len and --eval_max_new_tokens (for "),
    (["--step1-args", "--max_seq_len 600"], "--step1-args --max_seq_len (for "),
])
def test_train_py_checks_each_steps_lengths_against_learned_positions_before_step_1(tmp_path, step_args, said):
    """Step 3 refused a prompt + answer longer than GPT-2's position table when its models loaded: after steps 1 and
    2 had trained."""
    from dschat import pipeline
    from dschat.errors import UsageError
    from dschat.models.loading import resolve_model_path

    gpt2 = resolve_model_path("tiny-gpt2")  # (a folder: the tiny recipe's lengths are not applied)
    args = _train_py_args("--actor-model", gpt2, "--output-dir", str(tmp_path / "out"), *step_args)
    with pytest.raises(UsageError, match=re.escape(said) + r".* tokens, but the model has a table of 512 learned"):
        pipeline.run_pipeline(args)
    assert not (tmp_path / "out" / "step1_sft").exists(), "no step may have run"


def test_train_py_data_fields_reach_every_step_and_a_steps_own_wins():
    """Field names were given per step (--stepN-args), and a step without them said "Name yours with --data_fields"."""
    from dschat import pipeline
    from dschat.args import step1_parser, step2_parser, step3_parser

    args = _train_py_args("--actor-model", "tiny-llama", "--data-path", "csv:pairs.csv", "--data-fields",
                          "prompt=question,chosen=good,rejected=bad", "--step3-args", "--data_fields prompt=q")
    parsed = {step: parser().parse_args(pipeline.step_argv(step, args, tiny=True))
              for step, parser in ((1, step1_parser), (2, step2_parser), (3, step3_parser))}
    assert parsed[1].data_fields == parsed[2].data_fields == "prompt=question,chosen=good,rejected=bad"
    assert parsed[3].data_fields == "prompt=q"


def test_train_py_refuses_malformed_data_fields_before_the_first_step(tmp_path, distributed):
    """--step 1 --data-fields bogus failed inside step 1 on reading its data, after train.py had replaced the output
    folder's report with an unfinished one (--step 1 2 found it before: step 2's pairs are read first)."""
    from dschat import pipeline
    from dschat.errors import UsageError

    for given in (["--data-fields", "bogus"], ["--step1-args", "--data_fields prompt=q,answer=a"]):
        with pytest.raises(UsageError, match="--data-fields item 'bogus' must look like|unknown data field"):
            pipeline.run_pipeline(_train_py_args("--step", "1", "--output-dir", str(tmp_path / "out"), *given))
    assert not (tmp_path / "out").exists(), "no step may have run"


def test_train_py_errors_name_data_fields_as_the_user_typed_them(tmp_path, distributed):
    """A step run by train.py named its own --data_fields where the user had typed train.py's --data-fields; flags
    given in --stepN-args keep the step's spelling. Step 1 alone reads its data in the step; before step 2, train.py's
    pre-flight check reads it."""
    from dschat import pipeline
    from dschat.errors import UsageError

    no_field = "no 'question' field, which {} prompt=question names"
    for steps, given, flag in ((["1"], ["--data-fields", "prompt=question"], "--data-fields"),
                               (["1", "2"], ["--data-fields", "prompt=question"], "--data-fields"),
                               (["1"], ["--step1-args", "--data_fields prompt=question"], "--data_fields")):
        args = _train_py_args("--step", *steps, "--output-dir", str(tmp_path / "out"), *given)
        with pytest.raises(UsageError, match=re.escape(no_field.format(flag))):
            pipeline.run_pipeline(args)
    # with no field names given, the step's advice to name them names train.py's flag too
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": f"Q{i}?", "reply": "Yes."}) + "\n" for i in range(40)))
    args = _train_py_args("--step", "1", "--output-dir", str(tmp_path / "out"), "--data-path", f"jsonl:{data}")
    with pytest.raises(UsageError, match=r"records have \['question', 'reply'\]\. Name yours with --data-fields, "):
        pipeline.run_pipeline(args)


def test_train_py_errors_name_its_zero_stage_flags_as_the_user_typed_them(tmp_path, distributed):
    """train.py sets each step's ZeRO stage from --actor-zero-stage / --reward-zero-stage (given, or the deployment's
    default), and a step's error named them in its own spelling (--actor_zero_stage, --zero_stage), flags the user
    never typed; a stage given in --stepN-args keeps the step's spelling."""
    from dschat import pipeline
    from dschat.errors import UsageError

    out = tmp_path / "out"
    for given, says in ((["--step3-args", "--offload"], "the actor trains at ZeRO stage 0 (--actor-zero-stage, else "
                                                        "--zero_stage, else 0), and optimizer offload needs ZeRO stage "
                                                        "1, 2 or 3: give --actor-zero-stage too"),
                        (["--step", "1", "--step1-args", "--offload"],
                         "needs ZeRO stage 1, 2 or 3 (--actor-zero-stage;"),
                        (["--step", "1", "--step1-args", "--offload --zero_stage 0"],
                         "needs ZeRO stage 1, 2 or 3 (--zero_stage;")):
        with pytest.raises(UsageError, match=re.escape(says)):
            pipeline.run_pipeline(_train_py_args("--output-dir", str(out), *given))
    assert not out.exists(), "no step may have run"


def test_train_py_respells_the_flags_it_sets_from_its_own_and_no_others(tmp_path):
    """A step's model flag is train.py's --actor-model / --reward-model only where it holds that option's model
    (step 2's on the tiny default is the SFT model, step 3's critic step 2's folder); its folder is under
    --output-dir; step 3's --zero_stage is no train.py option's; a flag the --stepN-args give keeps the step's
    spelling."""
    from dschat import pipeline

    def said(step, message, *given):
        args = _train_py_args("--output-dir", str(tmp_path / "out"), *given)
        return pipeline.in_train_py_spelling(message, step, args, pipeline.step_argv(step, args, tiny=True))

    assert said(1, "--model_name_or_path tiny-llama: x; --zero_stage 0") == \
        "--actor-model tiny-llama: x; --actor-zero-stage 0"
    sft = str(tmp_path / "out" / "step1_sft")
    assert said(2, f"--model_name_or_path {sft}: x") == f"--model_name_or_path {sft}: x"  # (the tiny default's)
    assert said(2, "--model_name_or_path tiny-gpt2: x", "--reward-model", "tiny-gpt2") == "--reward-model tiny-gpt2: x"
    assert said(2, "--zero_stage 0", "--recipe", "dpo") == "--actor-zero-stage 0"  # (DPO's models: the actor's stage)
    ppo = str(tmp_path / "out" / "step3_ppo")
    assert said(3, f"--critic_model_name_or_path x, --critic_zero_stage 0, --zero_stage 0, --output_dir {ppo}") == \
        f"--critic_model_name_or_path x, --reward-zero-stage 0, --zero_stage 0, --output-dir {ppo}"
    assert said(1, f"--zero_stage 2, --output_dir {sft}", "--step1-args", "--zero_stage 2") == \
        f"--zero_stage 2, --output-dir {sft}"
    assert said(3, "--actor_zero_stage 2", "--step3-args", "--zero_stage 2") == "--actor_zero_stage 2"


def test_train_py_says_its_output_dir_only_where_a_message_names_the_steps_folder(tmp_path, distributed):
    """Step 2 under train.py found step 1's save interrupted: the advice "a step's start with it as its --output_dir"
    (a step script's flag: train.py's --output-dir is the run's folder above the steps') was respelled --output-dir,
    which given that folder writes the steps into its subfolders and finishes nothing. --output_dir is train.py's
    where it names the step's own folder alone."""
    from dschat import pipeline
    from dschat.errors import MissingInputError
    from dschat.tiny.presets import create_tiny_model

    out = tmp_path / "out"
    create_tiny_model("tiny-llama", out / "step1_sft")
    (out / "step1_sft" / ".step1_sft.save-moving").mkdir()  # (a save killed while it moved its files in)
    with pytest.raises(MissingInputError, match="a step's start with it as its --output_dir, or "):
        pipeline.run_pipeline(_train_py_args("--output-dir", str(out), "--step", "2"))
    args = _train_py_args("--output-dir", str(out))
    rm = str(out / "step2_rm")
    assert pipeline.in_train_py_spelling(f"--output_dir {rm}: cannot write there; --output_dir {rm}x", 2, args,
                                         pipeline.step_argv(2, args, tiny=True)) == \
        f"--output-dir {rm}: cannot write there; --output_dir {rm}x"


def test_train_py_names_dpos_sft_start_by_no_model_option(tmp_path):
    """DPO starts from the SFT folder, never from a train.py option's model: with --actor-model naming that folder
    (--step 2 after an earlier step 1), --reward-model defaults to the same value, and DPO's --model_name_or_path
    was respelled --reward-model, an option DPO takes none of."""
    from dschat import pipeline

    sft = str(tmp_path / "out" / "step1_sft")
    args = _train_py_args("--output-dir", str(tmp_path / "out"), "--recipe", "dpo", "--step", "2", "--actor-model", sft)
    message = f"--model_name_or_path {sft}: x; --zero_stage 0"
    assert pipeline.in_train_py_spelling(message, 2, args, pipeline.step_argv(2, args, tiny=False)) == \
        f"--model_name_or_path {sft}: x; --actor-zero-stage 0"


def test_train_py_length_check_reads_the_earlier_steps_output_when_step_1_is_not_run(tmp_path):
    """Step 3 alone loads <output>/step1_sft (and step2_rm), not --actor-model: the check took the flag's model."""
    import shutil

    from dschat import pipeline
    from dschat.args import step3_parser
    from dschat.errors import UsageError
    from dschat.models.loading import resolve_model_path

    out = tmp_path / "out"
    parsed = {3: step3_parser().parse_args(
        ["--actor_model_name_or_path", str(out / "step1_sft"), "--critic_model_name_or_path", str(out / "step2_rm"),
         "--max_answer_seq_len", "300"])}
    args = _train_py_args("--actor-model", "tiny-llama", "--output-dir", str(out), "--step", "3")
    pipeline.check_sequence_lengths(args, parsed)  # no earlier outputs yet: nothing to read, nothing said
    shutil.copytree(resolve_model_path("tiny-gpt2"), out / "step1_sft")  # a table of 512 learned positions
    with pytest.raises(UsageError, match=f"for {re.escape(str(out / 'step1_sft'))}\\) = 556 tokens, but the model "
                                         "has a table of 512 learned"):
        pipeline.check_sequence_lengths(args, parsed)


def test_an_interrupted_train_py_run_leaves_no_earlier_report(tmp_path, distributed, monkeypatch, capsys):
    """An interrupted train.py run left the earlier run's report.json, which still reported that run's results and
    named its policy to the tools, over this run's unfinished folders."""
    from dschat import pipeline
    from dschat.tools.common import find_policy_path, flag_path

    monkeypatch.setenv("DSCHAT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text(json.dumps({"policy": "step3_ppo/actor"}))

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "run_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pipeline.run_pipeline(_train_py_args("--output-dir", str(out), "--step", "1"))
    # its own report's policy, marked unfinished: the tools take this run's model, or warn of an older run's
    assert json.loads((out / "report.json").read_text()) == {"unfinished": True, "policy": "step1_sft"}
    (out / "step3_ppo" / "actor").mkdir(parents=True)  # an earlier run's finished actor
    (out / "step3_ppo" / "actor" / "config.json").write_text("{}")
    assert flag_path("--path", find_policy_path, str(out)) == str(out / "step3_ppo" / "actor")
    assert (f"warning: --path {out}: its last train.py run did not finish (report.json says so): "
            f"{out / 'step3_ppo' / 'actor'} may be from before it") in capsys.readouterr().err
    from dschat.report import write_unfinished_report

    write_unfinished_report(str(out), "grpo", [3], str(tmp_path))  # a trained reward model given: the tools' too
    assert json.loads((out / "report.json").read_text()) == {"unfinished": True, "policy": "step3_ppo/actor",
                                                             "reward_model": str(tmp_path)}


def test_train_py_checks_step_3s_accumulation_before_step_1(tmp_path, distributed, monkeypatch):
    """--step3-args "--gradient_accumulation_steps 3" (micro-batches that fill no whole group) was refused only when
    step 3 started, after steps 1 and 2 had trained."""
    from dschat import pipeline
    from dschat.errors import UsageError

    monkeypatch.setenv("DSCHAT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pipeline, "run_step", lambda *args: pytest.fail("a step ran"))
    with pytest.raises(UsageError, match="PPO micro-batches per PPO epoch .* is not a multiple of "
                                         "--gradient_accumulation_steps 3"):
        pipeline.run_pipeline(_train_py_args("--output-dir", str(tmp_path / "out"), "--step3-args",
                                             "--gradient_accumulation_steps 3"))


def test_train_py_checks_step_3s_critic_from_the_model_step_2_starts_from_before_step_1(tmp_path, distributed,
                                                                                      monkeypatch):
    """Step 3's critic is step 2's output, which train.py's check before step 1 did not read (an earlier run's could
    be there): a DeepSeek-V4 reward model under --step3-args --zero3_fetch module at ZeRO-3 on several ranks (step 2
    at the default --zero3_fetch layer), or a --critic_lora_module_name matching none of its modules, was refused
    only when step 3 loaded the critic, after steps 1 and 2 had trained. The critic's checks read the model step 2
    starts from (--reward-model), whose architecture it keeps."""
    from dschat import pipeline
    from dschat.errors import UsageError
    from dschat.models.loading import load_tokenizer
    from dschat.rlhf import engine
    from dschat.steps import ppo  # noqa: F401 (imported before the patch below: it copies the patched name)
    from helpers import tiny_deepseek_v4_actor

    monkeypatch.setenv("DSCHAT_CACHE", str(tmp_path / "cache"))
    v4 = tmp_path / "v4"
    tiny_deepseek_v4_actor().save_pretrained(v4)
    load_tokenizer("tiny-llama").save_pretrained(v4)  # (the actor's tokenizer: step 3 reads the actor's token ids)
    checked = engine.check_step3_settings
    # (step 3's check on 2 ranks; train.py's other checks, on this one rank, would wait on the other's collectives)
    monkeypatch.setattr(engine, "check_step3_settings",
                        lambda args, world_size, *given, **kwargs: checked(args, 2, *given, **kwargs))

    class Ran(Exception):
        pass

    monkeypatch.setattr(pipeline, "run_step", lambda *a, **k: (_ for _ in ()).throw(Ran()))
    out = tmp_path / "out"
    v4_critic = ["--output-dir", str(out), "--data-path", "tiny", "--reward-model", str(v4), "--reward-zero-stage", "3"]
    with pytest.raises(UsageError, match=r"gathering the critic's \(deepseek_v4\) weights submodule by submodule "
                                         r"\(--zero3_fetch module\)"):
        pipeline.run_pipeline(_train_py_args(*v4_critic, "--step3-args", "--zero3_fetch module"))
    assert not out.exists(), "no step may have run"
    # an actor's (llama's) module name, which step 2's OPT critic has not
    opt_critic = ["--output-dir", str(out), "--reward-model", "tiny-opt", "--step3-args", "--critic_lora_dim 2 "]
    with pytest.raises(UsageError, match=r"--critic_lora_module_name 'gate_proj' matches no Linear module of OPTModel"):
        pipeline.run_pipeline(_train_py_args(*opt_critic[:-1], opt_critic[-1] + "--critic_lora_module_name gate_proj"))
    assert not out.exists(), "no step may have run"
    with pytest.raises(Ran):
        pipeline.run_pipeline(_train_py_args(*v4_critic, "--step3-args", "--zero3_fetch layer"))
    with pytest.raises(Ran):
        pipeline.run_pipeline(_train_py_args(*opt_critic[:-1], opt_critic[-1] + "--critic_lora_module_name q_proj"))


def test_a_first_run_killed_after_its_save_leaves_its_folder_marked_unfinished(tmp_path, distributed, monkeypatch):
    """A first run's training_args.json was written only with its results: killed between its save and them, the
    folder held a model and nothing saying it was unfinished, so train.py started step 2 from it without a word."""
    from dschat.run_layout import unfinished_reason

    out = tmp_path / "rm"

    def killed(*given):
        raise KeyboardInterrupt

    monkeypatch.setattr(common, "write_results", killed)
    with pytest.raises(KeyboardInterrupt):
        reward.main(["--output_dir", str(out), "--data_output_path", str(tmp_path / "data"), "--max_steps", "1",
                     *RM_FAST])
    assert (out / "model.safetensors").is_file() and not (out / "metrics.json").exists()
    assert json.loads((out / "training_args.json").read_text())["step"] == "step2"
    assert "is an unfinished step output" in unfinished_reason(str(out))


def test_a_save_killed_before_it_moved_in_leaves_a_copy_that_readers_skip_and_the_warning_names(tmp_path, distributed,
                                                                                               monkeypatch):
    """Its hidden copy in the model folder held the whole model until the next save, unsaid: the unfinished output's
    warning now names it and its size. Loading the folder still reads the earlier save, not the copy."""
    from dschat.models import checkpoint
    from dschat.run_layout import unfinished_reason

    out = tmp_path / "rm"
    flags = ["--output_dir", str(out), "--data_output_path", str(tmp_path / "data"), "--max_steps", "1", *RM_FAST]
    reward.main(flags)
    before = (out / "value_head.safetensors").read_bytes()

    def killed(*given):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "install_folder", killed)
    with pytest.raises(KeyboardInterrupt):
        reward.main([*flags, "--seed", "7"])
    copies = list(out.glob(".rm.tmp-*"))
    assert len(copies) == 1 and (copies[0] / "model.safetensors").is_file()
    assert re.search(rf"; {re.escape(str(copies[0]))} \(\d+\.\d MiB\) is an unfinished save's copy",
                     unfinished_reason(str(out))), unfinished_reason(str(out))
    assert (out / "value_head.safetensors").read_bytes() == before
    load_reward_model(str(out))


def test_a_diverged_supervised_run_stops_at_its_first_non_finite_loss(tmp_path, distributed, capsys):
    """Steps 1, 2 and DPO trained on through NaN losses (step 3 stops), saved all-NaN weights, exited 0 and wrote NaN
    into metrics.json; a LoRA flag without --lora_dim was also taken without a word."""
    with pytest.raises(FloatingPointError, match=r"step2_dpo: the training loss \(step \d+\) is not finite: 1 NaN"):
        dpo.main(["--model_name_or_path", "tiny-llama", "--dtype", "fp32", "--learning_rate", "1e30", "--max_steps", "6",
                  "--max_seq_len", "64", "--per_device_train_batch_size", "4", "--lora_alpha", "16",
                  "--output_dir", str(tmp_path / "dpo"), "--data_output_path", str(tmp_path / "data")])
    assert not (tmp_path / "dpo" / "metrics.json").exists() and not (tmp_path / "dpo" / "model.safetensors").exists()
    assert "[step2_dpo] --lora_alpha 16.0 (read only with --lora_dim): ignored" in capsys.readouterr().out


def test_a_step_script_starting_from_an_unfinished_output_warns(tmp_path, distributed, capsys):
    """A step script (or a notebook) given a folder that an interrupted run of its step left trained from it without
    a word (train.py refuses it); the warning is said once."""
    sft = tmp_path / "step1_sft"
    reward.main(["--output_dir", str(sft), "--data_output_path", str(tmp_path / "data"), "--max_steps", "1",
                 *RM_FAST])  # (any step's output: a model folder with training_args.json)
    (sft / "metrics.json").unlink()  # its step started again, and was interrupted
    capsys.readouterr()
    reward.main(["--model_name_or_path", str(sft), "--output_dir", str(tmp_path / "rm"), "--data_output_path",
                 str(tmp_path / "data"), "--max_steps", "1", *RM_FAST])
    assert capsys.readouterr().out.count(f"warning: {sft} is an unfinished step output") == 1


SKIPPED_STEP = "(optimizer step skipped by DeepSpeed: inf/NaN gradients)"


def test_fp16_steps_deepspeed_skips_are_said_logged_and_counted(tmp_path, distributed, monkeypatch, capsys):
    """fp16's loss scaler skips an optimizer step whose scaled gradients overflow without a word: a step-1 run started
    at a scale of 2**18 (real overflows on the CPU's fp16) says each skipped step on its loss line, the skips since the
    last evaluation on the evaluation's line, and the run's count on TensorBoard and in metrics.json."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    skip_without_fp16()
    applied = record_applied_steps(monkeypatch)
    metrics = sft.main(["--output_dir", str(tmp_path / "sft"), "--data_output_path", str(tmp_path / "data"),
                        *SFT_FAST, *fp16_flags(tmp_path, initial_scale_power=18), "--max_steps", "6", "--print_loss",
                        "--eval_interval", "2", "--enable_tensorboard", "--tensorboard_path", str(tmp_path / "tb")])
    skipped = [not step_applied for step_applied in applied]
    assert len(skipped) == 6 and 0 < sum(skipped) < 6, f"the premise: some steps overflow, not all ({applied})"
    assert sum(skipped[:2]) and not sum(skipped[2:4]), f"the premise: steps 1-2 overflow, 3-4 not ({applied})"
    out = capsys.readouterr().out
    for step, step_skipped in enumerate(skipped, 1):
        line = out.split(f"[step1] step {step} loss ")[1].splitlines()[0]
        assert (SKIPPED_STEP in line) == step_skipped, line
    # the evaluations of steps 2 and 4: each says the skips since the one before (step 4's: none)
    assert f"({sum(skipped[:2])} of the last 2 optimizer steps skipped by DeepSpeed: inf/NaN gradients)" in \
        out.split("[step1] step 2 eval:")[1].splitlines()[0]
    assert "skipped" not in out.split("[step1] step 4 eval:")[1].splitlines()[0]
    assert metrics["skipped_steps"] == sum(skipped)
    assert json.loads((tmp_path / "sft" / "metrics.json").read_text())["skipped_steps"] == sum(skipped)
    assert f"steps=6, skipped_steps={sum(skipped)}," in out.split("[step1] after training:")[1]
    assert ("warning: [step1] DeepSpeed skipped" in out) == (sum(skipped) * 2 > 6)  # more than half: warned of
    events = EventAccumulator(str(tmp_path / "tb" / "step1"))
    events.Reload()
    counts = [(e.step, e.value) for e in events.Scalars("step1/train/skipped_steps")]
    assert counts == [(step, sum(skipped[:step])) for step in range(1, 7)]


def test_a_run_deepspeed_skipped_every_step_of_ends_with_a_warning_naming_the_loss_scale(tmp_path, distributed,
                                                                                        monkeypatch, capsys):
    """A fixed fp16 loss scale that overflows skips every step of a step-2 run: it trained nothing, said at its end
    with the cause and what to change."""
    skip_without_fp16()
    applied = record_applied_steps(monkeypatch)
    metrics = reward.main(["--output_dir", str(tmp_path / "rm"), "--data_output_path", str(tmp_path / "data"),
                           *RM_FAST, *fp16_flags(tmp_path, loss_scale=2 ** 20), "--max_steps", "2",
                           "--eval_iters", "1"])
    assert applied == [False, False], "the premise: every step overflows"
    assert metrics["skipped_steps"] == 2
    out = capsys.readouterr().out
    assert "warning: [step2] DeepSpeed skipped 2 of the run's 2 optimizer steps on inf/NaN gradients: it applied " \
           "none of them. fp16's loss scale is fixed at 1048576 (fp16.loss_scale in the DeepSpeed config)" in out
    assert "Lower it (0: DeepSpeed's dynamic scale), lower --learning_rate, or train in --dtype bf16" in out


def test_train_py_turns_offline_mode_on_once_for_the_ranks_it_starts(unreachable_hub, monkeypatch, capsys):
    """python train.py --deployment-type single_node --actor-model ORG/NAME with no network: the ranks the launcher
    starts inherit the offline mode train.py turned on, with one probe and one message (none for the tiny default)."""
    import runpy

    main = runpy.run_path(str(REPO / "train.py"))["main"]
    environments = []

    def launcher(cmd):
        environments.append(os.environ.get("HF_HUB_OFFLINE"))
        return 0

    monkeypatch.setitem(main.__globals__, "run_launcher", launcher)
    monkeypatch.setattr("dschat.utils.dist.under_launcher", lambda: False)  # (an earlier test's RANK)
    for actor in ("tiny-llama", "acme/tiny"):
        with pytest.raises(SystemExit):
            main(["--actor-model", actor, "--deployment-type", "single_node", "--step", "1"])
    assert environments == ["0", "1"] and len(unreachable_hub) == 1
    assert capsys.readouterr().out.count("the hub cannot be reached") == 1


def test_train_py_decides_offline_mode_for_the_default_hub_data_of_local_models(unreachable_hub, monkeypatch, tmp_path):
    """Local models and no --data-path train on DeepSpeed-Chat's hub dataset: train.py decided offline mode before the
    launcher from the models alone, so each rank probed the unreachable hub itself."""
    import runpy

    from dschat.tiny.presets import create_tiny_model

    main = runpy.run_path(str(REPO / "train.py"))["main"]
    environments = []
    monkeypatch.setitem(main.__globals__, "run_launcher",
                        lambda cmd: environments.append(os.environ.get("HF_HUB_OFFLINE")) or 0)
    monkeypatch.setattr("dschat.utils.dist.under_launcher", lambda: False)  # (an earlier test's RANK)
    actor = create_tiny_model("tiny-llama", str(tmp_path / "actor"))
    with pytest.raises(SystemExit):
        main(["--actor-model", actor, "--deployment-type", "single_node", "--step", "1"])
    assert environments == ["1"] and len(unreachable_hub) == 1


@pytest.mark.parametrize("value", ["1.5", "-0.1", "1", "nan"])
def test_a_dropout_outside_0_1_is_an_error_naming_the_flag(value, capsys):
    """--dropout 1.5 trained on until torch's "dropout probability has to be between 0 and 1" traceback at the first
    forward (exit 1); the notebook's dict got the same. Step 3's --actor_dropout / --critic_dropout too."""
    from dschat.args import step1_parser, step3_parser, step_settings
    from dschat.errors import UsageError

    for parser, flag in ((step1_parser(), "--dropout"), (step3_parser(), "--actor_dropout"),
                         (step3_parser(), "--critic_dropout")):
        with pytest.raises(SystemExit) as stop:
            parser.parse_args([flag, value])
        assert stop.value.code == 2
        assert f"argument {flag}: expected a dropout probability in [0, 1)" in capsys.readouterr().err
    with pytest.raises(UsageError, match=r"dropout: expected a dropout probability in \[0, 1\)"):
        step_settings(step1_parser(), {"dropout": float(value)})
    assert step_settings(step1_parser(), {"dropout": 0.1}).dropout == 0.1
    assert step_settings(step1_parser(), {"disable_dropout": True}).dropout == 0.0


@pytest.mark.parametrize("value", ["-1", "4294967296"])
def test_a_seed_outside_numpys_range_is_an_error_naming_the_flag(value, capsys):
    """--seed -1 or 2**32 loaded the model, then ended in numpy's "Seed must be between 0 and 2**32 - 1" traceback from
    transformers' set_seed (exit 1); the notebook's dict got the same. Every step's --seed."""
    from dschat.args import step1_parser, step2_dpo_parser, step2_parser, step3_parser, step_settings
    from dschat.errors import UsageError

    for parser in (step1_parser(), step2_parser(), step2_dpo_parser(), step3_parser()):
        with pytest.raises(SystemExit) as stop:
            parser.parse_args(["--seed", value])
        assert stop.value.code == 2
        assert "argument --seed: expected a seed in [0, 4294967295]" in capsys.readouterr().err
    with pytest.raises(UsageError, match=r"seed: expected a seed in \[0, 4294967295\]"):
        step_settings(step1_parser(), {"seed": int(value)})
    assert step_settings(step1_parser(), {"seed": 2 ** 32 - 1}).seed == 2 ** 32 - 1


@pytest.mark.parametrize("flag, value", [("--weight_decay", "-0.1"), ("--weight_decay", "nan"),
                                         ("--weight_decay", "inf"), ("--lora_alpha", "0"), ("--lora_alpha", "nan"),
                                         ("--lora_alpha", "-4")])
def test_a_weight_decay_or_lora_alpha_that_cannot_train_is_an_error_naming_the_flag(flag, value, capsys):
    """--weight_decay nan/inf and --lora_alpha nan trained until "the training loss is not finite" (exit 1, not naming
    the flag); --weight_decay -0.1 (which torch's AdamW refuses) and --lora_alpha 0 (adapters scaled to nothing: with
    --only_optimize_lora nothing trains) ran without a word. Step 3's weight decays too."""
    from dschat.args import step1_parser, step3_parser, step_settings
    from dschat.errors import UsageError

    flags = [(step1_parser(), flag)] + ([(step3_parser(), "--actor_weight_decay"),
                                         (step3_parser(), "--critic_weight_decay")] if flag == "--weight_decay"
                                        else [(step3_parser(), flag)])
    for parser, name in flags:
        with pytest.raises(SystemExit) as stop:
            parser.parse_args([name, value])
        assert stop.value.code == 2
        assert f"argument {name}: expected a number" in capsys.readouterr().err
    with pytest.raises(UsageError, match=f"{flag[2:]}: expected a number"):
        step_settings(step1_parser(), {flag[2:]: float(value), "lora_dim": 4})
    assert step_settings(step1_parser(), {"weight_decay": 0.1, "lora_alpha": 16}).lora_alpha == 16.0


def test_a_zero3_run_failing_inside_a_forward_leaves_its_engine_free_to_go(tmp_path, distributed, monkeypatch):
    """ZeRO-3 pushes each submodule onto parameter_offload.FWD_MODULE_STACK as its forward starts and pops it as it
    ends: a forward that raised (an IndexError in an embedding, a reward function failing mid-rollout) leaves its
    submodules there, holding the released model's parameters."""
    made = engines_made(monkeypatch)

    def forward_failing_in_a_layer(engine, train_loader, *args, **kwargs):
        batch = next(iter(train_loader))
        layer = next(m for m in engine.module.modules() if isinstance(m, torch.nn.Linear))
        layer.register_forward_pre_hook(lambda *_: 1 / 0)
        engine(input_ids=batch["input_ids"].to(engine.device))

    monkeypatch.setattr(common, "run_training", forward_failing_in_a_layer)
    flags = ["--output_dir", str(tmp_path / "sft"), "--data_output_path", str(tmp_path / "data"), *SFT_FAST,
             "--max_steps", "1", "--eval_iters", "1", "--zero_stage", "3"]
    with pytest.raises(ZeroDivisionError):
        sft.main(flags)
    assert len(made) == 1 and engines_alive(made) == 0


def test_an_engine_made_after_an_inner_block_that_made_none_is_released_by_the_outer_block(monkeypatch):
    """The blocks' engine lists were taken out of the open blocks by equality: an inner block ending with none (a
    constructor that made no engine) took out the outer block's empty list; an engine made after it went to the
    inner list, released by no block, and the outer block ended in "ValueError: list.remove(x): x not in list"."""
    released = []
    monkeypatch.setattr(training_engine, "release_engine", released.append)
    engine = object()
    with training_engine.released_engines():
        with training_engine.released_engines(only_on_error=True):
            pass
        training_engine._made(engine)
    assert released == [engine] and training_engine._OPEN_SCOPES == []


def test_an_engine_failing_to_release_after_a_failed_block_leaves_the_blocks_error_and_releases_the_rest(
        monkeypatch):
    """On a GPU, destroy() synchronizes, which raises again a device-side assert the block failed by: that error
    replaced the block's own, and the engines after it were not released. A block that ended well raises it."""
    from dschat.errors import UsageError

    released, first, second = [], object(), object()

    def release(engine):
        if engine is first:
            raise RuntimeError("CUDA error: device-side assert triggered")
        released.append(engine)

    monkeypatch.setattr(training_engine, "release_engine", release)
    with pytest.raises(UsageError, match="the run's own error"):
        with training_engine.released_engines():
            training_engine._made(first)
            training_engine._made(second)
            raise UsageError("the run's own error")
    assert released == [second]
    with pytest.raises(RuntimeError, match="device-side assert"):
        with training_engine.released_engines():
            training_engine._made(first)
            training_engine._made(second)
    assert released == [second, second]


def test_a_deepspeed_config_file_that_is_not_utf8_text_is_a_usage_error_naming_it(tmp_path):
    """A config saved as UTF-16 (Windows' Notepad) or a binary file raised UnicodeDecodeError's traceback, naming no
    file; on one node's copy only, that rank died outside the ranks' comparison of the file
    (check_same_ds_config_file), which catches a UsageError."""
    from dschat.errors import UsageError
    from dschat.utils.ds_config import load_user_ds_config

    path = tmp_path / "ds.json"
    path.write_text('{"gradient_clipping": 1.0}', encoding="utf-16")
    with pytest.raises(UsageError, match=r"DeepSpeed config '.*ds.json': not UTF-8 text"):
        load_user_ds_config(str(path))


def test_engines_are_not_released_after_ctrl_c_or_a_peer_failure_of_several_ranks(monkeypatch):
    """destroy() synchronizes the device: after Ctrl-C, which each rank takes at its own point, or another rank's
    failure, a collective may still be queued on this rank's stream, and the release waited on it until the NCCL
    timeout instead of ending the rank (as end_distributed leaves the group alone then). A process alone still
    releases them (a notebook's Ctrl-C)."""
    from dschat.utils import dist

    released = []
    monkeypatch.setattr(training_engine, "release_engine", released.append)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    for failure in (KeyboardInterrupt(), RuntimeError("[gloo] Connection closed by peer")):
        with pytest.raises(type(failure)):
            with training_engine.released_engines():
                training_engine._made("engine")
                raise failure
    assert released == []
    with pytest.raises(ZeroDivisionError):  # (this rank's own failure: the ranks' collectives are its own)
        with training_engine.released_engines():
            training_engine._made("engine")
            1 / 0
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    with pytest.raises(KeyboardInterrupt):
        with training_engine.released_engines():
            training_engine._made("alone")
            raise KeyboardInterrupt
    assert released == ["engine", "alone"]


def test_release_clears_zero3s_cache_of_released_modules_however_deepspeed_wraps_it(monkeypatch):
    """The class-wide lru_cache of ZeRO-3's __params_to_release was reached through the closure of DeepSpeed 0.19's
    instrument_w_nvtx wrapper only: the bare cache (a DeepSpeed without that wrapper) raised AttributeError at every
    step run's end, after its model was saved."""
    import functools

    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    @functools.lru_cache(maxsize=None)
    def params_to_release(module, step):
        return step

    params_to_release(None, 1)
    monkeypatch.setattr(PartitionedParameterCoordinator, "_PartitionedParameterCoordinator__params_to_release",
                        params_to_release)

    class Engine:
        module = torch.nn.Linear(1, 1)

        def destroy(self):
            pass

    training_engine.release_engine(Engine())
    assert params_to_release.cache_info().currsize == 0


@pytest.mark.parametrize("given, flag", [
    (["--data-path", "Dahoas/rm-static"], "--data-path"),
    (["--step1-args", "--data_path Dahoas/rm-static"], "--step1-args --data_path"),
    (["--actor-model", "LOCAL"], "--data-path (not given: DeepSpeed-Chat's default)")])
def test_train_py_finds_a_hub_dataset_the_offline_cache_lacks_before_step_1(tmp_path, distributed, monkeypatch, given,
                                                                            flag):
    """train.py --data-path Dahoas/rm-static offline (the tests' HF_HUB_OFFLINE=1, an empty datasets cache): the error
    came only once step 1 loaded its data, naming the step's --data_path rather than train.py's --data-path."""
    import runpy

    from dschat import pipeline
    from dschat.errors import MissingInputError
    from dschat.tiny.presets import create_tiny_model

    monkeypatch.setattr(sft, "main", lambda argv: pytest.fail("step 1 ran"))
    if "LOCAL" in given:  # (a model not a tiny preset: DeepSpeed-Chat's hub data by default)
        given = ["--actor-model", create_tiny_model("tiny-llama", str(tmp_path / "actor"))]
    args = runpy.run_path(str(REPO / "train.py"))["parse_args"](["--step", "1", "--output-dir", str(tmp_path / "out"),
                                                                 *given])
    with pytest.raises(MissingInputError, match=rf"^{re.escape(flag)} Dahoas/rm-static: not in the datasets cache, "
                                                r"and HF_HUB_OFFLINE is set"):
        pipeline.run_pipeline(args)


def test_train_py_reads_a_hub_datasets_download_in_the_hub_cache_offline_before_step_1(tmp_path, distributed,
                                                                                       monkeypatch):
    """train.py --data-path Dahoas/rm-static offline, the dataset downloaded into the hub cache (hf download without
    --local-dir), not the datasets cache: the pre-flight loaded it with datasets alone and stopped the run, "not in the
    datasets cache", though step 1 reads that download."""
    import runpy

    import pandas as pd
    from huggingface_hub import constants

    from dschat import pipeline

    class Ran(Exception):
        pass

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "datasets--Dahoas--rm-static"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40) / "data").mkdir(parents=True)
    for split in ("train", "test"):
        pd.DataFrame([{"prompt": "\n\nHuman: Hi?\n\nAssistant:", "response": " Hello.", "chosen": " Hello.",
                       "rejected": " No."}] * 4).to_parquet(repo / "snapshots" / ("0" * 40) / "data" /
                                                             f"{split}-00000-of-00001.parquet")
    monkeypatch.setattr(sft, "main", lambda argv: (_ for _ in ()).throw(Ran()))
    args = runpy.run_path(str(REPO / "train.py"))["parse_args"](["--step", "1", "--output-dir", str(tmp_path / "out"),
                                                                 "--data-path", "Dahoas/rm-static"])
    with pytest.raises(Ran):
        pipeline.run_pipeline(args)


def test_train_py_finds_a_broken_local_copy_under_a_hub_name_before_step_1(tmp_path, distributed, monkeypatch):
    """A download of Dahoas/rm-static at ./Dahoas/rm-static without its test split, given to step 2 alone: the
    pre-flight loaded hub data only, so the copy's error came when step 2 loaded it, after step 1 had trained. It is
    read by its reader (get_raw_dataset, as step 2 reads it) before step 1 runs, its error naming step 2's flag."""
    import runpy

    import pandas as pd

    from dschat import pipeline
    from dschat.data.errors import DatasetFormatError

    class Ran(Exception):
        pass

    def write_split(split):
        pd.DataFrame([{"prompt": "\n\nHuman: Hi?\n\nAssistant:", "response": " Hello.", "chosen": " Hello.",
                       "rejected": " No."}] * 4).to_parquet(tmp_path / "Dahoas" / "rm-static" / "data" /
                                                            f"{split}-00000-of-00001.parquet")

    monkeypatch.chdir(tmp_path)
    (tmp_path / "Dahoas" / "rm-static" / "data").mkdir(parents=True)
    write_split("train")
    monkeypatch.setattr(sft, "main", lambda argv: (_ for _ in ()).throw(Ran()))
    args = runpy.run_path(str(REPO / "train.py"))["parse_args"](["--step", "1", "2", "--output-dir",
                                                                 str(tmp_path / "out"), "--step2-args",
                                                                 "--data_path Dahoas/rm-static"])
    with pytest.raises(DatasetFormatError, match=r"^--step2-args --data_path Dahoas/rm-static: the download here "
                                                 r"holds the split train, not test"):
        pipeline.run_pipeline(args)
    write_split("test")  # (a whole copy passes, and step 1 runs)
    with pytest.raises(Ran):
        pipeline.run_pipeline(args)


def test_train_py_finds_step_3s_hub_unsupervised_data_the_offline_cache_lacks_before_step_1(tmp_path, distributed,
                                                                                             monkeypatch):
    """train.py --step3-args '--unsupervised_dataset_name wikitext' offline (an empty datasets cache): the pre-flight
    loaded the steps' --data_path datasets alone, so the error came once step 3 loaded its PPO-ptx data, after steps
    1 and 2 had trained, naming step 3's own flag."""
    import runpy

    from dschat import pipeline
    from dschat.errors import MissingInputError

    monkeypatch.setattr(sft, "main", lambda argv: pytest.fail("step 1 ran"))
    args = runpy.run_path(str(REPO / "train.py"))["parse_args"]([
        "--output-dir", str(tmp_path / "out"),
        "--step3-args", "--unsupervised_dataset_name wikitext --unsupervised_dataset_config_name wikitext-2-raw-v1"])
    with pytest.raises(MissingInputError, match=r"^--step3-args --unsupervised_dataset_name wikitext: not in the "
                                                r"datasets cache, and HF_HUB_OFFLINE is set"):
        pipeline.run_pipeline(args)


def test_a_hint_names_a_flag_of_two_spellings_once():
    """A flag with two spellings (--local_rank / --local-rank, --deepspeed_config / --deepscale_config) was named
    twice by a hint: "did you mean --local_rank or --local-rank?"."""
    from dschat.args import step1_parser

    parser = step1_parser()
    assert parser.flag_hint("--local") == "--local: did you mean --local_rank?"
    assert parser.flag_hint("--deepspeed-config") == "--deepspeed-config: did you mean --deepspeed_config?"


def test_every_step_refuses_deepseek_v4_under_zero3_module_fetch_on_several_ranks_before_any_weight_loads(
        tmp_path, distributed, monkeypatch):
    """DeepSeek-V4's forwards gather other weights by width under ZeRO-3 fetched submodule by submodule
    (``layers.EVERY_FORWARD_VARIES``: 2 CPU ranks, gloo aborted): steps 1, 2 and DPO refused it only once the engine
    was made, after the model had loaded (minutes for a big one). Now every step refuses it from the config (world
    size 2, faked), its loaders never called; with --zero3_fetch layer the steps get as far as loading."""
    from dschat.errors import UsageError
    from dschat.models import loading
    from dschat.rlhf import engine as engine_module
    from dschat.steps import ppo
    from helpers import PPO_FAST, tiny_deepseek_v4_actor

    class Loaded(Exception):
        pass

    def loaded(*args, **kwargs):
        raise Loaded

    tiny_deepseek_v4_actor().save_pretrained(tmp_path / "v4")
    for module, loader in ((sft, "load_causal_lm"), (dpo, "load_causal_lm"), (reward, "create_critic_model"),
                           (engine_module, "load_causal_lm"), (engine_module, "create_critic_model")):
        monkeypatch.setattr(module, loader, loaded)
    monkeypatch.setattr(common, "get_world_size", lambda: 2)
    monkeypatch.setattr(ppo, "get_world_size", lambda: 2)
    monkeypatch.setattr(loading, "load_tokenizer", loaded)  # (the folder holds a config alone)
    model = str(tmp_path / "v4")
    supervised = ["--model_name_or_path", model, "--zero_stage", "3", "--output_dir", str(tmp_path / "out"), *SFT_FAST]
    refused = r"on 2 ranks, each forward gathering (--model_name_or_path|the actor)'s \(deepseek_v4\) weights " \
              r"submodule by submodule \(--zero3_fetch module\).*Use --zero3_fetch layer"
    for main in (sft.main, reward.main, dpo.main):
        with pytest.raises(UsageError, match=refused):
            main([*supervised, "--zero3_fetch", "module"])
        with pytest.raises(Loaded):  # (layer: checked once its layers are made units, or not)
            main([*supervised, "--zero3_fetch", "layer"])
    step3 = ["--actor_model_name_or_path", model, "--critic_model_name_or_path", model, "--zero3_fetch", "module",
             "--output_dir", str(tmp_path / "ppo"), *PPO_FAST]
    with pytest.raises(UsageError, match=refused):  # (the hybrid engine pinned: its training forwards)
        ppo.main([*step3, "--actor_zero_stage", "3"])
    with pytest.raises(UsageError, match=r"on 2 ranks, each forward gathering the critic's \(deepseek_v4\)"):
        ppo.main([*step3, "--critic_zero_stage", "3"])


def test_train_py_checks_dpo_on_the_model_step1_starts_from_not_an_earlier_runs_step1_output(tmp_path, distributed,
                                                                                              monkeypatch):
    """train.py's check of DPO's step 2 from its config (DeepSeek-V4 under ZeRO-3 --zero3_fetch module on several
    ranks) read <output-dir>/step1_sft before step 1 had run: an earlier run's DeepSeek-V4 there refused a Llama run
    that step 1 would have replaced it with (and an earlier Llama there let a DeepSeek-V4 run through to its load).
    Now it reads the model step 1 starts from, as step 3's checks do; step 2 alone reads the folder."""
    import runpy

    from dschat import pipeline
    from dschat.args import step1_parser
    from dschat.errors import UsageError
    from helpers import tiny_deepseek_v4_actor

    tiny_deepseek_v4_actor().config.save_pretrained(tmp_path / "out" / "step1_sft")  # (the earlier run's)
    monkeypatch.setattr(common, "get_world_size", lambda: 2)  # (steps 1 and 2's check reads it there)
    args = runpy.run_path(str(REPO / "train.py"))["parse_args"](
        ["--recipe", "dpo", "--actor-model", "tiny-llama", "--output-dir", str(tmp_path / "out"),
         "--actor-zero-stage", "3", "--step1-args", "--zero3_fetch module", "--step2-args", "--zero3_fetch module"])
    parsers = {1: step1_parser, 2: pipeline.step_parser(2, "dpo")}
    pipeline.check_step_args([1, 2], args, True, parsers)  # (step 1 writes a Llama there first)
    with pytest.raises(UsageError, match=r"on 2 ranks, each forward gathering --model_name_or_path's "
                                         r"\(deepseek_v4\) weights"):
        pipeline.check_step_args([2], args, True, parsers)
