"""Checkpoints and --resume of steps 1, 2 and DPO (``dschat.steps.resume``): a resumed run ends with the weights and
losses of the uninterrupted one, on one rank and on two with ZeRO-3."""
import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from dschat.errors import UsageError
from dschat.steps import dpo, resume, reward, sft
from helpers import SFT_FAST, fp16_flags, record_applied_steps, skip_without_fp16
from launch import run_deepspeed

# 38 micro-batches an epoch, 2 per step: 19 steps an epoch, and checkpoints every 3 steps fall in the second epoch too
# (its data order must be drawn again on resume); dropout draws from the RNG the checkpoint restores.
SFT_RESUME = [*SFT_FAST, "--max_seq_len", "48", "--data_split", "1,8,1", "--num_train_epochs", "2",
              "--gradient_accumulation_steps", "2", "--dropout", "0.1", "--eval_iters", "1"]
SMALL = [*SFT_FAST, "--max_seq_len", "48", "--data_split", "1,1,8", "--dropout", "0.1", "--eval_iters", "1",
         "--per_device_train_batch_size", "8"]
STEPS = {"sft": (sft.main, SFT_RESUME), "reward": (reward.main, SMALL), "dpo": (dpo.main, SMALL),
         # (the RPO NLL term's token mean over each step's two micro-batches: --loss_agg global_token_mean)
         "dpo_rpo": (dpo.main, [*SMALL, "--rpo_alpha", "1.0", "--gradient_accumulation_steps", "2",
                                "--per_device_train_batch_size", "4"])}


def _interrupt_after(monkeypatch, stop_step):
    """The run stops (as if killed) right after it saved the checkpoint of ``stop_step``."""
    real = resume.save_step_checkpoint

    def save_then_stop(engine, args, position, *rest):
        tag = real(engine, args, position, *rest)
        if position["step"] == stop_step:
            raise KeyboardInterrupt(tag)
        return tag

    monkeypatch.setattr(resume, "save_step_checkpoint", save_then_stop)


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


@pytest.mark.parametrize("step, stop_step", [("sft", 21), ("reward", 3), ("dpo", 3), ("dpo_rpo", 3)])
def test_a_resumed_run_ends_where_the_uninterrupted_run_ends(step, stop_step, tmp_path, distributed, monkeypatch,
                                                             capsys):
    main, flags = STEPS[step]
    common = [*flags, "--data_output_path", str(tmp_path / "data")]
    if step != "reward":
        common = [*common, "--model_name_or_path", "tiny-llama"]
    if step.startswith("dpo"):  # DPO trains a policy against a frozen reference: an SFT-like model
        common = [*common, "--beta", "0.1"]
    full = main([*common, "--output_dir", str(tmp_path / "full")])
    (tmp_path / "split").mkdir()
    (tmp_path / "split" / "metrics.json").write_text("{}")  # an earlier run's, finished
    with monkeypatch.context() as patch:
        _interrupt_after(patch, stop_step)
        with pytest.raises(KeyboardInterrupt):
            main([*common, "--output_dir", str(tmp_path / "split"), "--save_interval", "3"])
    assert json.loads((tmp_path / "split" / "checkpoints" / "latest").read_text())["tag"] == f"step_{stop_step:07d}"
    # an interrupted run leaves no mark of a finished output (train.py --resume would skip the step)
    assert not (tmp_path / "split" / "metrics.json").exists()
    assert f"{tmp_path / 'split'} holds an earlier run's finished output: this run's save replaces its model " \
           "files" in capsys.readouterr().out
    # the step's seconds count every process that ran it: the checkpoint's, made large here, and the resumed one's
    state_file = tmp_path / "split" / "checkpoints" / "trainer" / f"step_{stop_step:07d}" / "state.json"
    state = json.loads(state_file.read_text())
    assert state["seconds"] > 0 and state["total"] == full["steps"]
    state_file.write_text(json.dumps({**state, "seconds": 1000.0}))
    resumed = main([*common, "--output_dir", str(tmp_path / "split"), "--resume"])
    assert 1000.0 < resumed["seconds"] < 1000.0 + full["seconds"] * 5
    printed = capsys.readouterr().out
    assert "this run spans" not in printed  # the same schedule
    assert f"resumed from step {stop_step}" in printed and "before training" not in printed
    assert "checkpointing every 3 steps, as the resumed run did" in printed
    timings = {"samples_per_s", "tokens_per_s", "tflops_per_rank", "seconds"}
    assert "train_loss" in full and full.keys() == resumed.keys()
    for key in full.keys() - timings:  # the train loss over the whole run (the resumed part's too), the evaluation
        assert resumed[key] == pytest.approx(full[key], rel=1e-6, abs=1e-7), key
    expected, got = _weights(tmp_path / "full"), _weights(tmp_path / "split")
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_resumed_runs_deepspeed_curves_hold_each_step_once_as_the_uninterrupted_runs(tmp_path, distributed,
                                                                                        monkeypatch):
    """DeepSpeed's own writer was restarted with a purge at the checkpoint's sample count, where DeepSpeed had logged
    the checkpoint's last step's learning rate (at the count after a step): the resumed run does not log it again,
    and that point was gone from the curve. (One helper restarts it for steps 1, 2, DPO and 3.)"""
    common = [*SMALL, "--data_output_path", str(tmp_path / "data"), "--max_steps", "5", "--enable_tensorboard"]
    reward.main([*common, "--output_dir", str(tmp_path / "full"), "--tensorboard_path", str(tmp_path / "tb_full")])
    split = [*common, "--output_dir", str(tmp_path / "split"), "--tensorboard_path", str(tmp_path / "tb_split"),
             "--save_interval", "2"]
    real = resume.save_step_checkpoint

    def killed_before_saving_step_4(engine, args, position, *rest):  # steps 3 and 4 logged, the checkpoint of 2 kept
        if position["step"] == 4:
            raise KeyboardInterrupt
        return real(engine, args, position, *rest)

    with monkeypatch.context() as patch:
        patch.setattr(resume, "save_step_checkpoint", killed_before_saving_step_4)
        with pytest.raises(KeyboardInterrupt):
            reward.main(split)
    reward.main([*split, "--resume"])
    full, resumed = _deepspeed_curves(tmp_path / "tb_full"), _deepspeed_curves(tmp_path / "tb_split")
    assert full.keys() == resumed.keys() and len(full["Train/Samples/lr"]) == 5, full
    for tag, points in full.items():
        assert [step for step, _ in resumed[tag]] == [step for step, _ in points], tag
        assert [value for _, value in resumed[tag]] == pytest.approx([value for _, value in points]), tag


def test_a_resumed_fp16_runs_skipped_steps_count_the_whole_run_as_the_uninterrupted_runs(tmp_path, distributed,
                                                                                          monkeypatch, capsys):
    """metrics.json's "skipped_steps" counts the whole run's (DeepSpeed's checkpoint keeps the engine's count): a run
    resumed after the overflows of its first steps (a start at a loss scale of 2**18) counts them, as the
    uninterrupted run does, and does not say them again."""
    skip_without_fp16()
    common = [*SFT_FAST, *fp16_flags(tmp_path, initial_scale_power=18), "--max_steps", "6", "--print_loss",
              "--data_output_path", str(tmp_path / "data")]
    applied = record_applied_steps(monkeypatch)
    full = sft.main([*common, "--output_dir", str(tmp_path / "full")])
    skipped = [not step_applied for step_applied in applied]
    assert len(skipped) == 6 and sum(skipped[:3]), f"the premise: steps before the checkpoint overflow ({applied})"
    with monkeypatch.context() as patch:
        _interrupt_after(patch, 3)
        with pytest.raises(KeyboardInterrupt):
            sft.main([*common, "--output_dir", str(tmp_path / "split"), "--save_interval", "3"])
    applied.clear()
    capsys.readouterr()
    resumed = sft.main([*common, "--output_dir", str(tmp_path / "split"), "--resume"])
    assert applied == [not step_skipped for step_skipped in skipped[3:]], "the loss scaler goes on as it was"
    assert resumed["skipped_steps"] == full["skipped_steps"] == sum(skipped)
    said = [line for line in capsys.readouterr().out.splitlines() if "optimizer step skipped by DeepSpeed" in line]
    assert [int(line.split(" step ")[1].split()[0]) for line in said] == \
        [step for step, step_skipped in enumerate(skipped, 1) if step_skipped and step > 3]


def _deepspeed_curves(tb_path):
    """{tag: [(step, value)]} of step 2's DeepSpeed writer as TensorBoard draws it (an earlier run's purged points
    left out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb_path / "ds_tensorboard_logs" / "step2_model_tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_resuming_with_other_settings_is_an_error_naming_them_before_deepspeed_loads(tmp_path, distributed,
                                                                                      monkeypatch, capsys):
    common = [*SMALL, "--data_output_path", str(tmp_path / "data"), "--output_dir", str(tmp_path / "rm"),
              "--max_steps", "2", "--save_interval", "2"]
    reward.main(common)
    loads = []
    from deepspeed import DeepSpeedEngine

    monkeypatch.setattr(DeepSpeedEngine, "load_checkpoint", lambda self, *a, **k: loads.append(1) or (None, {}))
    with pytest.raises(UsageError, match=r"saved with other settings: --per_device_train_batch_size 8 -> 4; "
                                         r"--seed 1234 -> 7\. .*without --resume"):
        reward.main([*common, "--resume", "--per_device_train_batch_size", "4", "--seed", "7"])
    with pytest.raises(UsageError, match=r"other settings: --model_name_or_path 'tiny-llama' -> 'tiny-opt'"):
        reward.main([*common, "--resume", "--model_name_or_path", "tiny-opt"])  # (its tokenizer made the records)
    with pytest.raises(UsageError, match=r"other settings: --weight_decay 0.0 -> 0.1"):  # (other parameter groups)
        reward.main([*common, "--resume", "--weight_decay", "0.1"])
    assert loads == []
    # DeepSpeed restores the learning rate: another one is said to change nothing, and the run resumes
    capsys.readouterr()
    reward.main([*common, "--resume", "--learning_rate", "1e-4"])
    assert "--learning_rate 0.0001 (the checkpoint's: 0.002): no effect" in capsys.readouterr().out
    # the run records the learning rate it trained with (train.py --resume compares a finished step's flags)
    assert json.loads((tmp_path / "rm" / "training_args.json").read_text())["flags"]["learning_rate"] == 2e-3
    assert loads == [1]
    # the dropout binds nothing the checkpoint holds: another one is said, and the run trains with it
    reward.main([*common, "--resume", "--dropout", "0.0"])
    assert "--resume: --dropout 0.1 -> 0.0: the rest of the run trains with the new value" in capsys.readouterr().out
    assert loads == [1, 1]


def test_a_resume_on_as_many_ranks_may_split_a_steps_samples_otherwise(tmp_path, distributed, capsys):
    """A resume with a smaller micro-batch and more accumulation (one that fits in memory), each optimizer step taking
    as many samples, was refused as a changed flag on as many ranks, though the same split on another number of ranks
    resumes. It resumes, said: the checkpoint's weights, its data position in this run's micro-batches (every record
    of the uninterrupted run's trained on once), its loss sums counted in them. Another product is refused, as
    before."""
    other_ranks = _other_ranks()
    common = [*SMALL, "--data_output_path", str(tmp_path / "data"), "--max_steps", "4", "--save_interval", "2",
              "--gradient_accumulation_steps", "2"]  # 8 x 2 samples a step
    full = other_ranks.run("sft", tmp_path, "full", None, [*common, "--output_dir", str(tmp_path / "full")])
    split = [*common, "--output_dir", str(tmp_path / "split")]
    other_ranks.run("sft", tmp_path, "before", 2, split)
    capsys.readouterr()
    with pytest.raises(UsageError, match=r"other settings: --per_device_train_batch_size 8 -> 4\. "):
        sft.main([*split, "--resume", "--per_device_train_batch_size", "4"])  # (4 x 2: half the samples a step)
    resumed = other_ranks.run("sft", tmp_path, "after", None, [*split, "--resume", "--per_device_train_batch_size",
                                                               "4", "--gradient_accumulation_steps", "4"])
    out = capsys.readouterr().out
    assert ("[step1] --resume: checkpoint step_0000002's optimizer steps took 8 x 2 samples a rank "
            "(--per_device_train_batch_size x --gradient_accumulation_steps), this run's 4 x 4, as many: the data "
            "position: the first 32 of epoch 1's ") in out
    assert "this run skips 8 micro-batches of 4 on each rank; its train-loss sums count its micro-batches as this " \
           "run's" in out and "resumed from step 2 " in out
    after, = _seen(tmp_path, "after", 1)
    assert after["resumed_at"] == 2 and after["loaded_weights_difference"] == 0.0
    assert resumed["steps"] == full["steps"] == 4 and len(after["samples"]) == 2 * 4 * 4
    assert _records(_seen(tmp_path, "before", 1), [after]) == _records(_seen(tmp_path, "full", 1))
    # the mean loss over the run's samples: the checkpoint's micro-batch means count twice, as 4-sample ones
    assert resumed["train_loss"] == pytest.approx(full["train_loss"], rel=1e-3)


def test_a_schedule_changed_by_another_split_of_a_steps_samples_names_it(tmp_path, capsys):
    """On as many ranks, micro-batches of another size group each epoch's last ones into other steps: 100 records a
    rank over 2 epochs are 26 micro-batches of 8 (13 steps of 8 x 2) or 50 of 4 (12 of 4 x 4). The changed schedule, and
    a checkpoint past this run's last step, were said as --max_steps' or --num_train_epochs' doing, neither of which
    changed; the split is named."""
    from types import SimpleNamespace

    from dschat.utils.checkpoints import ResumePlan

    args = SimpleNamespace(resume=True, save_interval=None, per_device_train_batch_size=4,
                           gradient_accumulation_steps=4)
    state = {"step": 4, "epoch": 0, "batch": 8, "total": 13, "world_size": 1, "save_interval": 2,
             "saved_micro_batch": 8, "saved_accumulation": 2}
    plan = ResumePlan("step_0000004", state, 1)
    split = "or each epoch's last micro-batches in steps of 4 x 4 rather than the checkpoint's 8 x 2 " \
            "(--per_device_train_batch_size x --gradient_accumulation_steps)"
    resume.resume_or_afresh(lambda: dict(state), str(tmp_path), args, "step1", 12, plan=plan)
    assert f"[step1] this run spans 12 steps, its checkpoint's run 13 (--max_steps, --num_train_epochs, {split}): " \
           "the learning rates from here follow this run's schedule" in capsys.readouterr().out
    with pytest.raises(UsageError, match=re.escape(f"past this run's 12 steps (--max_steps, --num_train_epochs, "
                                                   f"{split}): give")):
        resume.resume_or_afresh(lambda: {**state, "step": 13}, str(tmp_path), args, "step1", 12, plan=plan)
    resume.resume_or_afresh(lambda: dict(state), str(tmp_path), args, "step1", 12, plan=ResumePlan("t", {}, 1))
    assert "(--max_steps, --num_train_epochs): the learning rates" in capsys.readouterr().out  # (the same split)


def test_step1s_multiturn_binds_a_checkpoint_and_its_include_prompt_in_loss_is_said(tmp_path, distributed, capsys):
    """--multiturn keeps the conversations that end with a user turn, which are skipped without it: a resume that
    dropped it trained on 72 records instead of 108 from the checkpoint's place in them, silently; and
    --include_prompt_in_loss, another loss on the same records, changed silently."""
    conversations = tmp_path / "conversations.jsonl"
    with conversations.open("w") as f:
        for i in range(60):
            turns = [("user", f"hi {i}"), ("assistant", "hello"), ("user", f"count to {i % 7 + 1}")]
            turns += [("assistant", " ".join(str(n) for n in range(i % 7 + 1)))] if i % 3 else []
            f.write(json.dumps({"messages": [{"role": role, "content": text} for role, text in turns]}) + "\n")
    common = [*SFT_FAST, "--model_name_or_path", "tiny-llama", "--data_path", str(conversations), "--data_split",
              "10,0,0", "--max_seq_len", "48", "--per_device_train_batch_size", "4", "--eval_iters", "1",
              "--data_output_path", str(tmp_path / "data"), "--output_dir", str(tmp_path / "sft"), "--max_steps", "4"]
    sft.main([*common, "--multiturn", "--max_steps", "2", "--save_interval", "2"])
    assert "54 train / 6 eval records" in capsys.readouterr().out
    with pytest.raises(UsageError, match=r"saved with other settings: --multiturn True -> False\. .*without --resume"):
        sft.main([*common, "--resume"])
    sft.main([*common, "--multiturn", "--resume", "--include_prompt_in_loss"])
    assert "--resume: --include_prompt_in_loss False -> True: the rest of the run trains with the new value" \
        in capsys.readouterr().out


def test_a_step1_checkpoint_saved_before_its_loss_agg_says_the_rest_of_the_run_takes_the_token_mean(
        tmp_path, distributed, capsys):
    """A step-1 checkpoint of a dschat from before --loss_agg (its flags lack it) trained on each micro-batch's own
    mean, today's token_mean: resumed with the new default, global_token_mean, the rest of the run trained another
    loss without a word, where another value of the flag is said."""
    common = [*SMALL, "--model_name_or_path", "tiny-llama", "--data_output_path", str(tmp_path / "data"),
              "--output_dir", str(tmp_path / "sft"), "--max_steps", "2", "--gradient_accumulation_steps", "2"]
    sft.main([*common, "--max_steps", "1", "--save_interval", "1"])
    state_file = tmp_path / "sft" / "checkpoints" / "trainer" / "step_0000001" / "state.json"
    state = json.loads(state_file.read_text())
    del state["flags"]["loss_agg"]  # (saved before the flag)
    state_file.write_text(json.dumps(state))
    capsys.readouterr()
    sft.main([*common, "--resume"])
    assert "--resume: --loss_agg 'token_mean' -> 'global_token_mean': the rest of the run trains with the new value" \
        in capsys.readouterr().out


def test_a_checkpoint_saved_before_a_data_format_bump_resumes_on_data_built_once_again(tmp_path, distributed,
                                                                                      monkeypatch, capsys):
    """FORMAT_VERSION 45 gave phase 2's rows their margin: a step 2 interrupted under 44 resumes (its checkpoint holds
    no data cache key, the same records come again in the same order), on data built once more under 45, not refused
    nor rebuilt on each later resume."""
    from dschat.data import cache

    common = [*SMALL, "--data_output_path", str(tmp_path / "data"), "--output_dir", str(tmp_path / "rm"),
              "--max_steps", "2", "--save_interval", "1"]
    with monkeypatch.context() as patch:
        patch.setattr(cache, "FORMAT_VERSION", 44)
        _interrupt_after(patch, 1)
        with pytest.raises(KeyboardInterrupt):
            reward.main(common)
    def phase_2_caches():
        return sorted(path for path in (tmp_path / "data" / cache.CACHE_SUBDIR).glob("phase2_*") if path.is_dir())

    built = phase_2_caches()
    assert len(built) == 1
    capsys.readouterr()
    assert reward.main([*common, "--resume"])["steps"] == 2
    assert "resumed from step 1 " in capsys.readouterr().out
    rebuilt = phase_2_caches()
    assert len(rebuilt) == 2 and built[0] in rebuilt
    reward.main([*common, "--resume"])  # the same command again: the data of this version is read, not built
    assert "resumed from step 2 " in capsys.readouterr().out
    assert phase_2_caches() == rebuilt


@pytest.mark.parametrize("saved_before_the_fix", [True, False])
def test_a_zero0_bf16_checkpoint_saved_before_the_setup_step_was_taken_back_counts_the_steps_adam_took(
        saved_before_the_fix, tmp_path, distributed, monkeypatch, capsys):
    """DeepSpeed's ZeRO-0 bf16/fp16 wrapper steps Adam once with zero gradients as it is built; dschat takes that count
    back since 326ae58 (``uncount_state_allocation_step``), but a checkpoint saved before counted one step more than
    Adam took, and a resume kept it: the rest of the run took the bias corrections of one step later. A resume counts
    it back, saying so; a checkpoint saved since keeps its counts."""
    from dschat.models import training_engine
    from dschat.models.loading import load_causal_lm, load_tokenizer
    from dschat.utils.checkpoints import MODEL, ResumePlan, loading_checkpoint
    from dschat.utils.ds_config import get_train_ds_config

    def build():
        ds_config = get_train_ds_config(dtype="bf16", stage=0)
        model = load_causal_lm("tiny-gpt2", load_tokenizer("tiny-gpt2"), ds_config)
        return training_engine.initialize_engine(model, ds_config, 1e-3, 0.0, None, "constant", 0, 10)

    def adam_counts(engine):
        return {float(state["step"]) for state in engine.optimizer.optimizer.state.values()}

    with monkeypatch.context() as patch:
        if saved_before_the_fix:  # (dschat's engine before the fix)
            patch.setattr(training_engine, "uncount_state_allocation_step", lambda engine: None)
        saved = build()
    ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        saved.backward(saved(input_ids=ids, labels=ids).loss)
        saved.step()
    assert adam_counts(saved) == ({3.0} if saved_before_the_fix else {2.0})
    saved.save_checkpoint(str(tmp_path / "model"), tag="step_0000002")
    resumed = build()
    capsys.readouterr()
    with loading_checkpoint(resumed, ResumePlan("step_0000002"), MODEL):
        resumed.load_checkpoint(str(tmp_path / "model"), tag="step_0000002")
    assert adam_counts(resumed) == {2.0}
    said = "the model's Adam state in checkpoint step_0000002 counted 3 steps for the 2 it took"
    assert (said in capsys.readouterr().out) == saved_before_the_fix


def test_a_fresh_run_removes_earlier_checkpoints_and_resume_without_one_starts_over(tmp_path, distributed, capsys):
    common = [*SMALL, "--data_output_path", str(tmp_path / "data"), "--output_dir", str(tmp_path / "rm"),
              "--max_steps", "2"]
    reward.main([*common, "--save_interval", "1"])
    assert sorted(p.name for p in (tmp_path / "rm" / "checkpoints" / "model").iterdir()) == \
        ["step_0000001", "step_0000002"]
    capsys.readouterr()
    finished = (tmp_path / "rm" / "model.safetensors").read_bytes()
    again = reward.main([*common, "--resume"])  # the same command again (a requeued job): nothing more is trained
    assert "resumed from step 2 " in capsys.readouterr().out and again["steps"] == 2
    assert (tmp_path / "rm" / "model.safetensors").read_bytes() == finished
    with pytest.raises(UsageError, match=r"at step 2, past this run's 1 steps"):
        reward.main([*common[:-1], "1", "--resume"])
    longer = reward.main([*common[:-1], "3", "--resume"])  # a finished run extended: its last checkpoint goes on
    assert "resumed from step 2 " in capsys.readouterr().out and longer["steps"] == 3
    reward.main(common)  # no --resume: the earlier run's checkpoints would pass for this run's
    assert "removed an earlier run's checkpoints" in capsys.readouterr().out
    assert not (tmp_path / "rm" / "checkpoints").exists()
    reward.main([*common, "--resume"])
    assert "--resume: no complete checkpoint in" in capsys.readouterr().out


def test_a_checkpoint_another_step_saved_in_the_folder_is_not_resumed(tmp_path, distributed, monkeypatch, capsys):
    """DPO given step 1's --output_dir with --resume (both default to tiny-llama, so their bound flags matched) resumed
    step 1's checkpoint as its own: the SFT run's weights, Adam moments and data position; step 2 was refused for
    "--multiturn False -> None". The refusal comes before any model loads (it came once DPO's policy and reference
    had)."""
    common = [*SMALL, "--data_output_path", str(tmp_path / "data"), "--output_dir", str(tmp_path / "out"),
              "--model_name_or_path", "tiny-llama", "--max_steps", "2"]
    sft.main([*common, "--save_interval", "2"])
    loads, models = [], []
    from deepspeed import DeepSpeedEngine

    monkeypatch.setattr(DeepSpeedEngine, "load_checkpoint", lambda self, *a, **k: loads.append(1) or (None, {}))
    for module, name in ((sft, "load_causal_lm"), (dpo, "load_causal_lm"), (reward, "create_critic_model")):
        load = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _load=load, **k: models.append(1) or _load(*a, **k))
    for main, name in ((dpo.main, "step2_dpo"), (reward.main, "step2")):
        with pytest.raises(UsageError, match=rf"checkpoint in .*out/checkpoints \(step_0000002\) was saved by step1, "
                                             rf"not {name}: give {name} its own --output_dir"):
            main([*common, "--max_steps", "4", "--resume"])
    assert loads == [] and models == []
    sft.main([*common, "--max_steps", "3", "--resume"])  # its own step's still resumes
    assert "resumed from step 2 " in capsys.readouterr().out and loads == [1]


def test_a_step_2_run_with_a_relative_model_path_resumes_in_its_run_folder_moved_whole(tmp_path, distributed,
                                                                                       monkeypatch, capsys):
    """Step 2's own main() (not train.py) given step 1's folder as a relative --model_name_or_path, interrupted past
    its first checkpoint, its run folder moved and resumed with the relative path of the new place: the checkpoint
    stored the folder as the first run's working directory resolved it (``flag_values``), the key of its recorded
    inputs (``input_runs``), so the moved folder is recognised by its run id (``model_path_as_saved``), as train.py's
    absolute paths are; step 1 trained again into it (another run id) is still refused."""
    monkeypatch.chdir(tmp_path)
    common = [*SMALL, "--data_output_path", str(tmp_path / "data")]
    sft.main([*common, "--model_name_or_path", "tiny-llama", "--max_steps", "1", "--output_dir", "out/step1_sft"])

    def step2(run_folder, *more):
        return reward.main([*common, "--model_name_or_path", f"{run_folder}/step1_sft", "--output_dir",
                            f"{run_folder}/step2_rm", "--max_steps", "2", *more])

    with monkeypatch.context() as patch:
        _interrupt_after(patch, 1)
        with pytest.raises(KeyboardInterrupt):
            step2("out", "--save_interval", "1")
    shutil.move("out", "moved")
    run_args = tmp_path / "moved" / "step1_sft" / "training_args.json"
    step1_run = json.loads(run_args.read_text())
    run_args.write_text(json.dumps({**step1_run, "run_id": "step 1 trained again"}))
    with pytest.raises(UsageError, match=r"--model_name_or_path '.*/out/step1_sft' -> '.*/moved/step1_sft'"):
        step2("moved", "--resume")
    run_args.write_text(json.dumps(step1_run))
    capsys.readouterr()
    assert step2("moved", "--resume")["steps"] == 2
    assert "[step2] resumed from step 1 " in capsys.readouterr().out


ADVICE_STEP_1 = r"to resume from checkpoint step_0000001, write \{\"tag\": \"step_0000001\"\} into .*latest"


@pytest.mark.parametrize("damaged", ["model/step_0000002/mp_rank_00_model_states.pt",
                                     "trainer/step_0000002/rng_rank0.pt",
                                     "model/step_0000002/mp_rank_00_model_states.pt:removed",
                                     "trainer/step_0000002/rng_rank0.pt:removed",
                                     "trainer/step_0000002/state.json"])
def test_a_damaged_checkpoint_is_an_error_naming_it_and_the_earlier_one_resumes(damaged, tmp_path, distributed,
                                                                                capsys):
    """A truncated checkpoint file was a zip-reader traceback from inside torch; DeepSpeed's, when a rank's file was
    gone, a bare AssertionError; a truncated state.json's advice (remove it) led to another error. The message's
    advice (the earlier checkpoint kept) works."""
    common = [*SMALL, "--data_output_path", str(tmp_path / "data"), "--output_dir", str(tmp_path / "rm"),
              "--max_steps", "2", "--save_interval", "1"]
    reward.main(common)
    root = tmp_path / "rm" / "checkpoints"
    path, removed = root / damaged.split(":")[0], damaged.endswith(":removed")
    if removed:
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])
    what = (r"has a damaged trainer/step_0000002/state.json" if damaged.endswith("state.json") else
            r"has no trainer/step_0000002/rng_rank0.pt \(the RNG states each of the 1 rank\(s\) that saved it "
            r"writes; removed or copied in part\?\)" if damaged.startswith("trainer/step_0000002/rng_rank0.pt:") else
            r"has no model/step_0000002/mp_rank_00_model_states.pt \(DeepSpeed's states of its model, saved by 1 "
            r"rank\(s\); removed or copied in part\?\)" if damaged.startswith("model/") and removed else
            r"cannot be loaded \(\w+Error: .*damaged or missing")
    with pytest.raises(UsageError, match=rf"checkpoint step_0000002 in .*{what}.*{ADVICE_STEP_1}"):
        reward.main([*common, "--resume"])
    (root / "latest").write_text(json.dumps({"tag": "step_0000001"}))
    capsys.readouterr()
    assert reward.main([*common, "--resume"])["steps"] == 2
    assert "resumed from step 1 " in capsys.readouterr().out


def test_a_missing_or_damaged_latest_pointer_is_an_error_and_keeps_the_checkpoints(tmp_path, distributed, capsys):
    """Without its ``latest`` pointer, --resume said "no complete checkpoint; starting from step 0" and the run's
    first save pruned the checkpoints it could have resumed from."""
    common = [*SMALL, "--data_output_path", str(tmp_path / "data"), "--output_dir", str(tmp_path / "rm"),
              "--max_steps", "3", "--save_interval", "1"]
    reward.main([*common[:-3], "2", *common[-2:]])
    root = tmp_path / "rm" / "checkpoints"
    advice = r"to resume from checkpoint step_0000002, write \{\"tag\": \"step_0000002\"\} into .*latest"
    (root / "latest").unlink()
    with pytest.raises(UsageError,
                       match=rf"holds checkpoints step_0000001, step_0000002 and no latest pointer.*{advice}"):
        reward.main([*common, "--resume"])
    (root / "latest").write_text('{"tag": "step_00')
    with pytest.raises(UsageError, match=rf"and a damaged latest pointer.*{advice}"):
        reward.main([*common, "--resume"])
    assert sorted(p.name for p in (root / "model").iterdir()) == ["step_0000001", "step_0000002"]
    (root / "latest").write_text(json.dumps({"tag": "step_0000002"}))
    capsys.readouterr()
    assert reward.main([*common, "--resume"])["steps"] == 3
    assert "resumed from step 2 " in capsys.readouterr().out
    # one checkpoint and no pointer: a first save killed before it published; said, and the run starts over (a
    # requeued job must not stop there)
    (root / "latest").unlink()
    for part in ("model", "trainer"):
        shutil.rmtree(root / part / "step_0000002")
    assert reward.main([*common, "--resume"])["steps"] == 3
    out = capsys.readouterr().out
    assert "holds checkpoint step_0000003 but no latest pointer: its save did not finish" in out
    assert "--resume: no complete checkpoint in" in out


def test_a_checkpoint_of_another_rank_count_or_missing_its_model_is_an_error(tmp_path):
    from types import SimpleNamespace

    from dschat.utils.checkpoints import LATEST

    args = SimpleNamespace(output_dir=str(tmp_path), resume=True, per_device_train_batch_size=8,
                           gradient_accumulation_steps=1)
    root = tmp_path / "checkpoints"
    (root / "trainer" / "step_0000002").mkdir(parents=True)
    (root / LATEST).write_text(json.dumps({"tag": "step_0000002"}))
    with pytest.raises(UsageError, match=r"no model/step_0000002 folder"):
        resume.plan_resume(args, "step2")
    (root / "model" / "step_0000002").mkdir(parents=True)
    with pytest.raises(UsageError, match=r"no trainer/step_0000002/state.json"):
        resume.plan_resume(args, "step2")
    (root / "trainer" / "step_0000002" / "state.json").write_text("{}")
    for rank in (0, 1):  # (each rank's file holds its RNG states and its train-loss sums)
        (root / "trainer" / "step_0000002" / f"rng_rank{rank}.pt").write_bytes(b"")
    # DeepSpeed's files, named (its load failed with a bare AssertionError where the model states were gone): the
    # model states, and every rank's ZeRO partitions where it has them (ZeRO-3: its model states too)
    model = root / "model" / "step_0000002"
    with pytest.raises(UsageError, match=r"has no model/step_0000002/mp_rank_00_model_states.pt \(DeepSpeed's "
                                         r"states of its model, saved by 2 rank\(s\); removed or copied in part\?\)"):
        resume.plan_resume(args, "step2")
    (model / "mp_rank_00_model_states.pt").write_bytes(b"")
    (model / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"")
    with pytest.raises(UsageError, match=r"has no model/step_0000002/zero_pp_rank_0_mp_rank_00_optim_states.pt "):
        resume.plan_resume(args, "step2")
    (model / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    (root / "trainer" / "step_0000002" / "state.json").write_text(json.dumps({"flags": {"zero_stage": 3}}))
    with pytest.raises(UsageError, match=r"has no model/step_0000002/zero_pp_rank_0_mp_rank_00_model_states.pt, "
                                         r"model/step_0000002/zero_pp_rank_1_mp_rank_00_model_states.pt \("):
        resume.plan_resume(args, "step2")
    (root / "trainer" / "step_0000002" / "state.json").write_text("{}")
    # a checkpoint that does not say how many samples its steps took (its place in the data counts them)
    with pytest.raises(UsageError, match=r"saved by 2 rank\(s\), this run has 1; it does not record its batch sizes.*"
                                         r"resume on 2 rank\(s\)"):
        resume.plan_resume(args, "step2")


def test_a_one_rank_checkpoint_missing_its_zero_partition_is_an_error_naming_it(tmp_path):
    """On 1 rank, a ZeRO-1/2 checkpoint's one optimizer partition gone left no partition of another rank to tell that
    there were any: the files' check passed, and DeepSpeed's load failed with its own FileNotFoundError. The recorded
    ZeRO stage (and --dtype: bf16's files start with "bf16_") names it, for steps 1, 2 and DPO and step 3's parts."""
    from dschat.utils.checkpoints import check_complete

    root = tmp_path / "checkpoints"
    for part, stage_flag in (("model", "zero_stage"), ("actor", "actor_zero_stage"), ("critic", "critic_zero_stage")):
        shutil.rmtree(root, ignore_errors=True)
        folder, trainer = root / part / "step_0000002", root / "trainer" / "step_0000002"
        folder.mkdir(parents=True)
        trainer.mkdir(parents=True)
        (trainer / "rng_rank0.pt").write_bytes(b"")
        (folder / "mp_rank_00_model_states.pt").write_bytes(b"")
        for stage, dtype, missing in ((1, "bf16", "bf16_zero_pp_rank_0"), (2, "fp16", "zero_pp_rank_0"),
                                      (2, "fp32", "zero_pp_rank_0")):
            (trainer / "state.json").write_text(json.dumps({"world_size": 1,
                                                            "flags": {stage_flag: stage, "dtype": dtype}}))
            with pytest.raises(UsageError, match=rf"checkpoint step_0000002 in .* has no {part}/step_0000002/{missing}"
                                                 rf"_mp_rank_00_optim_states.pt \(DeepSpeed's states of its {part}, "
                                                 r"saved by 1 rank\(s\)"):
                check_complete(str(root), "step_0000002", (part,))
            (folder / f"{missing}_mp_rank_00_optim_states.pt").write_bytes(b"")
            assert check_complete(str(root), "step_0000002", (part,)) == 1
            (folder / f"{missing}_mp_rank_00_optim_states.pt").unlink()
        # ZeRO-0 (and a checkpoint that records no stage) has none: its optimizer is in the model states
        for flags in ({stage_flag: 0, "dtype": "bf16"}, {}):
            (trainer / "state.json").write_text(json.dumps({"world_size": 1, "flags": flags}))
            assert check_complete(str(root), "step_0000002", (part,)) == 1


def test_a_checkpoint_missing_a_ranks_rng_file_is_an_error_naming_it_not_another_rank_count(tmp_path):
    """A rank's RNG file gone made the checkpoint one "saved by 1 rank(s)" (0, with rank 0's), and the error asked
    for another batch size or number of ranks; the ranks its state records, else up to its last file, must each have
    one."""
    from types import SimpleNamespace

    from dschat.utils.checkpoints import LATEST

    args = SimpleNamespace(output_dir=str(tmp_path), resume=True, per_device_train_batch_size=8,
                           gradient_accumulation_steps=1)
    root = tmp_path / "checkpoints"
    for part in ("model", "trainer"):
        (root / part / "step_0000002").mkdir(parents=True)
    (root / "model" / "step_0000002" / "mp_rank_00_model_states.pt").write_bytes(b"")
    (root / LATEST).write_text(json.dumps({"tag": "step_0000002"}))
    state = root / "trainer" / "step_0000002" / "state.json"
    for recorded, files, missing in ((2, [0], "rng_rank1.pt"), (2, [1], "rng_rank0.pt"), (None, [1], "rng_rank0.pt"),
                                     (3, [0], r"rng_rank1.pt, trainer/step_0000002/rng_rank2.pt")):
        state.write_text(json.dumps({"step": 2, "epoch": 0, "batch": 2, **({"world_size": recorded} if recorded
                                                                           else {})}))
        for old in (root / "trainer" / "step_0000002").glob("rng_rank*.pt"):
            old.unlink()
        for rank in files:
            (root / "trainer" / "step_0000002" / f"rng_rank{rank}.pt").write_bytes(b"")
        with pytest.raises(UsageError, match=rf"checkpoint step_0000002 in .* has no trainer/step_0000002/{missing} "
                                             r"\(the RNG states each of the \d rank\(s\) that saved it writes"):
            resume.plan_resume(args, "step2")


def test_a_checkpoint_state_without_its_place_is_an_error_naming_the_file_not_a_key_error(tmp_path):
    """A state.json that is a JSON object but holds no step (edited) failed after the checks with a bare KeyError."""
    from types import SimpleNamespace

    from dschat.utils.checkpoints import LATEST

    args = SimpleNamespace(output_dir=str(tmp_path), resume=True, per_device_train_batch_size=8,
                           gradient_accumulation_steps=1, model_name_or_path=None)
    root = tmp_path / "checkpoints"
    for part in ("model", "trainer"):
        (root / part / "step_0000002").mkdir(parents=True)
    (root / "model" / "step_0000002" / "mp_rank_00_model_states.pt").write_bytes(b"")
    (root / "trainer" / "step_0000002" / "rng_rank0.pt").write_bytes(b"")
    (root / "trainer" / "step_0000002" / "state.json").write_text(json.dumps({"epoch": 0}))
    (root / LATEST).write_text(json.dumps({"tag": "step_0000002"}))
    with pytest.raises(UsageError, match=r"checkpoint step_0000002 in .* has a damaged trainer/step_0000002/state.json "
                                         r"\(no 'step', 'batch': its place in the run; edited\?\): restore it; or "
                                         r"start afresh without --resume"):
        resume.plan_resume(args, "step2")


def test_an_output_dir_that_is_a_checkpoints_folder_is_an_error_naming_the_steps_folder(tmp_path, distributed,
                                                                                        capsys):
    """--output_dir out/checkpoints (for out) with --resume found no checkpoint in out/checkpoints/checkpoints,
    started over and saved its model among the checkpoint's folders; without --resume, likewise. Steps 1, 2, DPO
    and 3 refuse it before their models load, naming the step's folder."""
    from dschat.steps import ppo

    root = tmp_path / "out" / "checkpoints"
    (root / "trainer" / "step_0000002").mkdir(parents=True)
    (root / "latest").write_text(json.dumps({"tag": "step_0000002"}))
    before = sorted(str(path) for path in tmp_path.rglob("*"))
    said = rf"--output_dir {root} is a step's checkpoints folder \(it holds checkpoint step_0000002\): give the step's " \
           rf"output folder, {tmp_path / 'out'}, which --resume continues from"
    for main, resumed in ((reward.main, ["--resume"]), (sft.main, []), (ppo.main, ["--resume"])):
        with pytest.raises(UsageError, match=said):
            main(["--output_dir", str(root), *resumed])
    assert sorted(str(path) for path in tmp_path.rglob("*")) == before
    (root / "trainer" / "step_0000002").rmdir()  # (a pointer alone is no checkpoint: not refused here)
    from dschat.steps.common import check_not_a_checkpoints_folder

    check_not_a_checkpoints_folder(str(root))


def test_a_checkpoint_of_another_rank_count_resumes_only_with_as_many_samples_a_step(tmp_path):
    """On another number of ranks, the batch flags may change as long as a step takes the checkpoint's samples (its
    step count, schedule and data position count those); otherwise the error says which flag to give."""
    from types import SimpleNamespace

    root = tmp_path / "checkpoints"
    for part in ("model", "trainer"):
        (root / part / "step_0000002").mkdir(parents=True)
    (root / "model" / "step_0000002" / "mp_rank_00_model_states.pt").write_bytes(b"")
    (root / "latest").write_text(json.dumps({"tag": "step_0000002"}))
    state = {"step": 2, "epoch": 0, "batch": 2, "flags": {"per_device_train_batch_size": 8,
                                                          "gradient_accumulation_steps": 1}}
    (root / "trainer" / "step_0000002" / "state.json").write_text(json.dumps(state))
    for rank in (0, 1):
        (root / "trainer" / "step_0000002" / f"rng_rank{rank}.pt").write_bytes(b"")

    def plan(micro, accumulation):
        args = SimpleNamespace(output_dir=str(tmp_path), resume=True, per_device_train_batch_size=micro,
                               gradient_accumulation_steps=accumulation)
        return resume.plan_resume(args, "step2", {}, None)

    said = r"saved by 2 rank\(s\), this run has 1: its optimizer steps took 8 x 1 x 2 = 16 samples"
    with pytest.raises(UsageError, match=rf"{said} .*this run's 8 x 1 x 1 = 8; .*resume with "
                                         r"--gradient_accumulation_steps 2$"):
        plan(8, 1)
    with pytest.raises(UsageError, match=r"this run's 5 x 1 x 1 = 5; .*resume with --per_device_train_batch_size 16$"):
        plan(5, 1)
    with pytest.raises(UsageError, match=r"this run's 5 x 3 x 1 = 15; .*resume with --per_device_train_batch_size and "
                                         r"--gradient_accumulation_steps whose product is 16$"):
        plan(5, 3)
    # as many samples a step: on to what the engine needs before it is made (here: missing)
    with pytest.raises(UsageError, match=r"plan_resume\(args, step, ds_config, train_loader\) before the engine"):
        plan(16, 1)


def test_the_data_position_on_another_number_of_ranks_skips_what_was_trained_on(capsys):
    """The checkpoint's ranks consumed a prefix of the epoch's order: this run skips the whole micro-batches of its
    own that it covers, and says how many records it trains on again where they do not divide."""
    from types import SimpleNamespace

    loader = type("Loader", (), {"dataset": range(600), "__len__": lambda self: 19})()
    args = SimpleNamespace(per_device_train_batch_size=16)
    # 2 ranks x 5 micro-batches of 8 = 80 records: 5 of this run's 16
    skipped, said = resume._position_on_these_ranks({"batch": 5, "epoch": 1, "saved_micro_batch": 8}, 2, loader, args)
    assert skipped == 5 and said == ("the data position: the first 80 of epoch 2's 600 records (in its order) were "
                                     "trained on, this run skips 5 micro-batches of 16 on each rank")
    args.per_device_train_batch_size = 32  # 80 = 2 x 32 + 16
    skipped, said = resume._position_on_these_ranks({"batch": 5, "epoch": 1, "saved_micro_batch": 8}, 2, loader, args)
    assert skipped == 2 and said.endswith("skips 2 micro-batches of 32 on each rank, 64 records: the last 16 are "
                                          "trained on again (80 is not a multiple of --per_device_train_batch_size 32 "
                                          "x 1 rank(s))")
    # its epoch was done (300 records a rank: 38 micro-batches of 8, the last short): so is this run's
    skipped, said = resume._position_on_these_ranks({"batch": 38, "epoch": 0, "saved_micro_batch": 8}, 2, loader, args)
    assert skipped == 19 and said == "the data position: epoch 1 was done, training goes on from the next"


def _step3_checkpoint(root, ranks, batches, position):
    """The files of step 3's checkpoint iter_0000002 of ``ranks`` ranks, as the checks read them (engine folders
    without ZeRO partitions, empty model-states and RNG files): its ``batches`` (None: not recorded) and
    ``position``."""
    tag = "iter_0000002"
    for part in ("actor", "critic", "trainer"):
        (root / part / tag).mkdir(parents=True, exist_ok=True)
    for part in ("actor", "critic"):
        (root / part / tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    state = {"iteration": 2, "kl_ctl": {}, **position, **({"batches": batches} if batches else {})}
    (root / "trainer" / tag / "state.json").write_text(json.dumps(state))
    for rank in range(ranks):
        (root / "trainer" / tag / f"rng_rank{rank}.pt").write_bytes(b"")
    (root / "latest").write_text(json.dumps({"tag": tag}))


def _loader(items, batches):
    return type("Loader", (), {"dataset": range(items), "__len__": lambda self: batches})()


def test_a_step3_checkpoint_of_another_rank_count_resumes_only_with_an_iteration_of_its_shape(tmp_path, capsys):
    """On another number of ranks, step 3's batch flags may change as long as an iteration takes the checkpoint's
    prompts (its iteration count, schedules and place in the prompts count those); otherwise the error says which flag
    to give (it was refused whatever the flags: "resume on 2 rank(s)"). An optimizer step may take other rows, as on
    as many ranks (it was refused, naming another --gradient_accumulation_steps), said."""
    from dschat.args import step3_parser
    from dschat.rlhf import checkpointing
    from dschat.rlhf.config import step3_args

    root = tmp_path / "checkpoints"
    saved = {"per_device_generation_batch_size": 4, "generation_batches": 2, "per_device_training_batch_size": 4,
             "gradient_accumulation_steps": 1}
    # 2 ranks: iterations of 4 x 2 x 2 = 16 prompts, optimizer steps of 4 x 1 x 2 = 8 rows; 1 iteration of the second
    # epoch done (iteration 3: 2 an epoch of 40 prompts), and 3 batches of the unsupervised stream's second pass (12 a
    # pass: 100 blocks, 50 a rank)
    _step3_checkpoint(root, 2, saved, {"iteration": 3, "epoch": 1, "batch": 2, "unsup_batches": 15})

    def plan(*flags, unsup=True):  # (this run's loaders, on 1 rank: 40 prompts, 100 blocks)
        args = step3_args(step3_parser().parse_args(["--resume", "--output_dir", str(tmp_path), *flags]))
        batch = args.per_device_generation_batch_size
        return checkpointing.plan_resume(args, str(root), _loader(40, 40 // batch),
                                         _loader(100, 100 // batch) if unsup else None)

    with pytest.raises(UsageError, match=r"saved by 2 rank\(s\), this run has 1: its iterations took 4 x 2 x 2 = 16 "
                                         r"prompts \(--per_device_generation_batch_size x --generation_batches x "
                                         r"ranks\), this run's 4 x 2 x 1 = 8; .* count iterations of 16 prompts: "
                                         r"resume with --generation_batches 4$"):
        plan("--per_device_generation_batch_size", "4", "--generation_batches", "2")
    # an actor that had taken no step (--freezing_actor_steps) starts from its model again, and a LoRA one with the
    # checkpoint's adapters (drawn at random when its run started: it was refused, "resume on 2 rank(s)")
    (root / "actor" / "iter_0000002" / "mp_rank_00_model_states.pt").unlink()
    for rank in (0, 1):  # (ZeRO-3: each rank's model states)
        torch.save({"global_steps": 0},
                   root / "actor" / "iter_0000002" / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
    resumed = plan("--per_device_generation_batch_size", "8", "--generation_batches", "2", "--actor_zero_stage", "3",
                   "--freezing_actor_steps", "3", "--per_device_training_batch_size", "8", "--actor_lora_dim", "8")
    assert resumed.load_tag("actor") is None and resumed.lora_from == {"actor": str(root / "actor" / "iter_0000002")}
    assert ("1: its actor had taken no optimizer step yet (--freezing_actor_steps), so it starts from "
            "--actor_model_name_or_path as the checkpoint's did, with the checkpoint's LoRA adapters;") in resumed.notice
    for rank in (0, 1):
        (root / "actor" / "iter_0000002" / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").unlink()
    (root / "actor" / "iter_0000002" / "mp_rank_00_model_states.pt").write_bytes(b"")
    # the checkpoint's per-rank training batch on half the ranks: optimizer steps of half the rows, said (the
    # schedules' move to this run's steps per iteration is said after the load, ppo.realign_schedules)
    resumed = plan("--per_device_generation_batch_size", "8", "--generation_batches", "2",
                   "--per_device_training_batch_size", "4")
    assert resumed.state["batch"] == 2
    assert ("this run skips 15 batches of 8 on each rank; its optimizer steps took 8 rows (4 x 1 x 2: "
            "--per_device_training_batch_size x --gradient_accumulation_steps x ranks), this run's take 4 (4 x 1 x 1) "
            "from here; rank 0 restores") in resumed.notice
    # as many prompts an iteration, but batches of 16 do not cover the unsupervised stream's 3 x 8 blocks taken
    one_rank = ["--per_device_training_batch_size", "8"]
    with pytest.raises(UsageError, match=r"its place in the unsupervised stream, 3 batches of 4 blocks on 2 rank\(s\) "
                                         r"into pass 2 \(24 blocks\), is not a whole number of this run's batches of "
                                         r"16 on 1, so this run would skip or repeat some: resume with "
                                         r"--per_device_generation_batch_size 8 --generation_batches 2$"):
        plan("--per_device_generation_batch_size", "16", "--generation_batches", "1", *one_rank)
    # without the stream, its place in the prompts (16 of epoch 2's) is one batch of 16
    resumed = plan("--per_device_generation_batch_size", "16", "--generation_batches", "1", *one_rank, unsup=False)
    assert resumed.state["batch"] == 1 and resumed.universal == frozenset()
    # batches of 8 on 1 rank: 2 batches; the stream's pass of 100 blocks is 12 batches of 8 too, 3 into the second
    resumed = plan("--per_device_generation_batch_size", "8", "--generation_batches", "2", *one_rank)
    assert (resumed.state["batch"], resumed.state["unsup_batches"]) == (2, 12 + 3)
    assert resumed.notice == (
        "[step3] --resume: checkpoint iter_0000002 saved by 2 rank(s), this run has 1: its actor's DeepSpeed states "
        "are not partitioned over the ranks (no ZeRO) and load as saved; its critic's DeepSpeed states are not "
        "partitioned over the ranks (no ZeRO) and load as saved; the prompt position: the first 16 of epoch 2's 40 "
        "prompts (in its order) were trained on, this run skips 2 batches of 8 on each rank; the unsupervised stream: "
        "24 of its 100 blocks into pass 2, this run skips 15 batches of 8 on each rank; rank 0 restores its own RNG "
        "states and answer sampler; its held-out scores before PPO load as saved")
    # a checkpoint from before step 3 recorded its batches
    _step3_checkpoint(root, 2, None, {"iteration": 3, "epoch": 1, "batch": 2, "unsup_batches": 15})
    with pytest.raises(UsageError, match=r"saved by 2 rank\(s\), this run has 1; it does not record its batch sizes "
                                         r".*: resume on 2 rank\(s\)$"):
        plan("--per_device_generation_batch_size", "8", "--generation_batches", "2", *one_rank)


OTHER_RANKS = Path(__file__).parent / "scripts" / "other_ranks.py"


def _other_ranks():
    """tests/scripts/other_ranks.py as a module: its ``run`` is the one-rank side of a resume on other ranks."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("other_ranks", OTHER_RANKS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _seen(folder, name, ranks):
    return [json.loads((folder / f"{name}_rank{rank}.json").read_text()) for rank in range(ranks)]


def _records(*seen):
    """The records the ranks of runs trained on, with how many times."""
    from collections import Counter

    return Counter(tuple(sample) for ranks in seen for rank in ranks for sample in rank["samples"])


@pytest.mark.multirank
def test_a_checkpoint_of_two_ranks_resumes_on_one(tmp_path, distributed, capsys):
    """A job rescheduled on fewer GPUs: step 1's ZeRO-2 checkpoint of 2 ranks was refused on 1 ("resume on 2
    rank(s)"). It resumes through DeepSpeed's universal checkpoint, with the checkpoint's weights, the run's last
    steps, and every record of the uninterrupted run's trained on once; a second resume reuses the copy."""
    common = [*SFT_FAST, "--max_seq_len", "48", "--data_split", "1,8,1", "--zero_stage", "2", "--max_steps", "6",
              "--per_device_train_batch_size", "8", "--eval_iters", "1", "--save_interval", "2",
              "--data_output_path", str(tmp_path / "data")]
    run_deepspeed(OTHER_RANKS, "sft", tmp_path, "full:full:0,before:split:4", *common)
    other_ranks, split = _other_ranks(), tmp_path / "split"
    capsys.readouterr()
    # 16 samples a step, as on 2 ranks: 8 x 2 accumulated
    resumed = [*common, "--output_dir", str(split), "--resume", "--gradient_accumulation_steps", "2"]
    metrics = other_ranks.run("sft", tmp_path, "after", None, resumed)
    out = capsys.readouterr().out
    assert ("[step1] --resume: checkpoint step_0000004 saved by 2 rank(s), this run has 1: its ZeRO-2 states load "
            "from DeepSpeed's universal copy model/step_0000004_universal (made now); the data position: the first 64 "
            "of epoch 1's 600 records (in its order) were trained on, this run skips 8 micro-batches of 8 on each "
            "rank; rank 0 restores its own RNG states; the train-loss sums of its ranks are pooled") in out
    assert "resumed from step 4 " in out and "before training" not in out and "this run spans" not in out
    after, = _seen(tmp_path, "after", 1)
    assert after["resumed_at"] == 4 and after["loaded_weights_difference"] == 0.0
    assert metrics["steps"] == 6 and len(after["samples"]) == 2 * 2 * 8  # steps 5 and 6: 2 micro-batches of 8 each
    assert _records(_seen(tmp_path, "before", 2), [after]) == _records(_seen(tmp_path, "full", 2))
    assert sorted(p.name for p in (split / "checkpoints" / "model").iterdir() if p.is_dir()) == \
        ["step_0000004", "step_0000004_universal", "step_0000006"]
    assert json.loads((split / "checkpoints" / "latest").read_text())["tag"] == "step_0000006"
    # again from step 4 (a second interruption before the next save): the copy is reused, the run ends the same
    first = _weights(split)
    (split / "checkpoints" / "latest").write_text(json.dumps({"tag": "step_0000004"}))
    sft.main(resumed)
    assert "model/step_0000004_universal (made by an earlier resume)" in capsys.readouterr().out
    for name, tensor in _weights(split).items():
        torch.testing.assert_close(tensor, first[name], rtol=0, atol=0, msg=name)
    # the finished 2-rank run resumed on 1: nothing to train, and its checkpoint's universal copy is not left behind
    full = tmp_path / "full"
    sft.main([*common, "--output_dir", str(full), "--resume", "--gradient_accumulation_steps", "2"])
    out = capsys.readouterr().out
    assert "resumed from step 6 " in out and "nothing left to train" in out, out[-3000:]
    assert "removed DeepSpeed's universal copy model/step_0000006_universal of checkpoint step_0000006" in out
    assert not [p.name for p in (full / "checkpoints" / "model").iterdir() if "universal" in p.name]


@pytest.mark.multirank
def test_a_zero3_checkpoint_of_one_rank_resumes_on_two(tmp_path, distributed):
    """A job rescheduled on more GPUs: step 2's ZeRO-3 checkpoint of 1 rank resumes on 2, each rank with the
    checkpoint's weights and the parameter groups' own weight decay (DeepSpeed's ZeRO-3 universal load gives every
    group the first one's), and every record of the uninterrupted run's trained on once. Adam counts each step once
    in each group (that load gave the groups one shared step tensor, which torch's AdamW added 1 to per group: steps
    3-5 counted twice, 8 at the end)."""
    common = [*SMALL, "--zero_stage", "3", "--max_steps", "5", "--weight_decay", "0.1", "--dropout", "0.0",
              "--save_interval", "2", "--data_output_path", str(tmp_path / "data")]
    other_ranks = _other_ranks()
    one = [*common, "--per_device_train_batch_size", "16"]
    full = other_ranks.run("reward", tmp_path, "full", None, [*one, "--output_dir", str(tmp_path / "full")])
    other_ranks.run("reward", tmp_path, "before", 2, [*one, "--output_dir", str(tmp_path / "split")])
    proc = run_deepspeed(OTHER_RANKS, "reward", tmp_path, "after:split:0", *common, "--per_device_train_batch_size",
                         "8", "--resume")
    assert ("[step2] --resume: checkpoint step_0000002 saved by 1 rank(s), this run has 2: its ZeRO-3 states load "
            "from DeepSpeed's universal copy model/step_0000002_universal (made now); the data position: the first 32 "
            "of epoch 1's 600 records (in its order) were trained on, this run skips 2 micro-batches of 8 on each "
            "rank; rank 0 restores its own RNG states, rank 1 (none saved) draws its from (--seed, rank, step)") \
        in proc.stdout, proc.stdout[-3000:]
    after = _seen(tmp_path, "after", 2)
    for rank in after:
        assert rank["resumed_at"] == 2 and rank["loaded_weights_difference"] == 0.0
        assert [group["weight_decay"] for group in rank["param_groups"]] == [0.1, 0.0]
        assert len(rank["samples"]) == 3 * 2 * 8  # steps 3-5: 8 pairs (chosen and rejected rows) a step on each rank
        assert rank["adam_steps"] == [5.0, 5.0]  # (the weight-decay group's and the no-decay group's)
    assert after[0]["metrics"]["steps"] == 5
    assert _records(_seen(tmp_path, "before", 1), after) == _records(_seen(tmp_path, "full", 1))
    # the train loss pools the checkpoint's micro-batches of 16 with the ranks' of 8, sample for sample
    assert after[0]["metrics"]["train_loss"] == pytest.approx(full["train_loss"], rel=1e-3)


@pytest.mark.parametrize("saved_stage, stage", [(2, 3), (3, 1)])
def test_a_checkpoint_resumes_at_another_zero_stage_with_its_adam_moments(saved_stage, stage, tmp_path, distributed,
                                                                        capsys):
    """A run that ran out of memory at ZeRO-2, resumed at ZeRO-3 (or one going back to ZeRO-1/2 for speed), was
    refused ("--zero_stage 2 -> 3"). Its states load through DeepSpeed's universal copy, fitted for the new stage
    (ds_to_universal's copy of a ZeRO-1/2 checkpoint lacked what a ZeRO-3 engine reads, and the other way round): the
    checkpoint's weights, each parameter group's own weight decay and Adam step count, and Adam's moments, so the run
    ends with the weights of an uninterrupted run at the new stage (fp32, one rank: the same arithmetic)."""
    common = [*SMALL, "--max_steps", "4", "--save_interval", "2", "--weight_decay", "0.1", "--dropout", "0.0",
              "--data_output_path", str(tmp_path / "data")]
    other_ranks, split = _other_ranks(), tmp_path / "split"
    other_ranks.run("sft", tmp_path, "full", None, [*common, "--zero_stage", str(stage), "--output_dir",
                                                    str(tmp_path / "full")])
    other_ranks.run("sft", tmp_path, "before", 2, [*common, "--zero_stage", str(saved_stage), "--output_dir",
                                                   str(split)])
    capsys.readouterr()
    other_ranks.run("sft", tmp_path, "after", None, [*common, "--zero_stage", str(stage), "--output_dir", str(split),
                                                     "--resume"])
    out = capsys.readouterr().out
    assert (f"[step1] --resume: checkpoint step_0000002 saved at ZeRO-{saved_stage}, this run has ZeRO-{stage} "
            f"(--zero_stage): its ZeRO-{saved_stage} states load into ZeRO-{stage} from DeepSpeed's universal copy "
            "model/step_0000002_universal (made now); its Adam moments and step count, scheduler and place in the "
            "data go on as saved") in out, out[-3000:]
    after, = _seen(tmp_path, "after", 1)
    assert after["resumed_at"] == 2 and after["loaded_weights_difference"] == 0.0
    assert [group["weight_decay"] for group in after["param_groups"]] == [0.1, 0.0]
    assert after["adam_steps"] == [4.0, 4.0]
    # (Adam's moments started again from zero would move every weight of steps 3-4 elsewhere)
    full = _weights(tmp_path / "full")
    for name, tensor in _weights(split).items():
        torch.testing.assert_close(tensor, full[name], rtol=0, atol=1e-6, msg=name)


def test_a_stage_0_checkpoint_at_another_zero_stage_is_an_error_saying_what_to_do(tmp_path, distributed):
    """A checkpoint without ZeRO (the optimizer saved whole) does not convert to another stage, nor the other way:
    the error names the stage to resume with, and how to fit in less memory at it, before DeepSpeed loads."""
    common = [*SMALL, "--max_steps", "2", "--save_interval", "2", "--data_output_path", str(tmp_path / "data"),
              "--output_dir", str(tmp_path / "out")]
    sft.main([*common, "--zero_stage", "0"])
    with pytest.raises(UsageError, match=re.escape(
            "was saved at ZeRO stage 0 (--zero_stage 0), this run has 2; DeepSpeed's universal checkpoint moves the "
            "optimizer states of ZeRO-1, 2 and 3 between stages, not those of stage 0 (saved whole, in another form): "
            "resume with --zero_stage 0 (to fit in less memory: a smaller --per_device_train_batch_size with a "
            "--gradient_accumulation_steps as many times larger, the same samples a step), or start afresh without "
            "--resume")):
        sft.main([*common, "--zero_stage", "2", "--resume"])


@pytest.mark.multirank
def test_a_resumed_zero3_run_on_two_ranks_ends_where_the_uninterrupted_run_ends(tmp_path):
    script = Path(__file__).parent / "scripts" / "supervised_resume.py"
    proc = run_deepspeed(script, str(tmp_path), timeout=900)
    for rank in (0, 1):
        assert f"rank {rank} resumed from step 4" in proc.stdout
    assert "ZeRO-3 resume: weights equal the uninterrupted run's" in proc.stdout


# Step 3 on the tiny presets: 24 prompts, 3 iterations of 8 an epoch, 2 epochs; the bundled scorer as the reward, a
# critic from a new value head, the hybrid engine, the unsupervised stream (PPO-ptx), an EMA copy, the adaptive KL
# controller and weight decay (the parameter groups DeepSpeed's ZeRO-3 universal load mixes up).
PPO_OTHER_RANKS = ["--actor_model_name_or_path", "tiny-llama", "--critic_model_name_or_path", "tiny-llama",
                   "--reward_model_weight", "0", "--reward_fn", "tiny", "--data_split", "1000,1000,8",
                   "--max_prompt_seq_len", "40", "--max_answer_seq_len", "8", "--dtype", "fp32",
                   "--num_warmup_steps", "0", "--eval_prompts", "8", "--num_train_epochs", "2",
                   "--enable_hybrid_engine", "--save_interval", "2", "--unsupervised_dataset_name", "tiny",
                   "--unsup_coef", "0.5", "--gradient_accumulation_steps", "2", "--actor_weight_decay", "0.1",
                   "--critic_weight_decay", "0.1", "--enable_ema", "--adaptive_kl"]
# an iteration's 8 prompts and an optimizer step's 8 rows on 2 ranks and on 1, in other batches (the batch indices of
# the prompts and of the unsupervised stream are converted)
PPO_TWO_RANKS = ["--per_device_generation_batch_size", "2", "--generation_batches", "2",
                 "--per_device_training_batch_size", "2"]
PPO_ONE_RANK = ["--per_device_generation_batch_size", "8", "--per_device_training_batch_size", "4"]


def _prompts(*seen):
    """The prompts the ranks of runs generated from, by epoch (3 iterations each), with how many times."""
    from collections import Counter

    return Counter((iteration // 3, tuple(prompt)) for ranks in seen for rank in ranks
                   for iteration, prompt in rank["prompts"])


def _blocks(*seen):
    from collections import Counter

    return Counter(tuple(block) for ranks in seen for rank in ranks for block in rank["blocks"])


@pytest.mark.multirank
def test_a_step3_checkpoint_resumes_on_another_number_of_ranks(tmp_path, distributed, capsys):
    """A job rescheduled on fewer or more GPUs: step 3's ZeRO-3 checkpoints (actor and critic) were refused on another
    number of ranks ("resume on 2 rank(s)"). Saved by 1 rank and resumed on 2, and saved by 2 and resumed on 1, each
    resumes at its iteration with the checkpoint's weights and the parameter groups' own weight decay, trains the
    run's remaining iterations, and every prompt (and unsupervised block) of the uninterrupted 2-rank run's is trained
    on once, in its epoch."""
    common = [*PPO_OTHER_RANKS, "--zero_stage", "3", "--data_output_path", str(tmp_path / "data")]
    other_ranks = _other_ranks()
    other_ranks.run("ppo", tmp_path, "one_before", 2, [*common, *PPO_ONE_RANK, "--output_dir", str(tmp_path / "one")])
    # the uninterrupted run (--resume: it has no checkpoint, and starts from iteration 0), and the resume on 2 ranks
    proc = run_deepspeed(OTHER_RANKS, "ppo", tmp_path, "full:full:0,two_after:one:0", *common, *PPO_TWO_RANKS,
                         "--resume")
    # the uninterrupted run's checkpoint of iteration 4 (its save is what an interrupted run leaves), on 1 rank
    (tmp_path / "full" / "checkpoints" / "latest").write_text(json.dumps({"tag": "iter_0000004"}))
    capsys.readouterr()
    metrics = other_ranks.run("ppo", tmp_path, "one_after", None,
                              [*common, *PPO_ONE_RANK, "--output_dir", str(tmp_path / "full"), "--resume"])
    out = capsys.readouterr().out
    universal = ("its actor's ZeRO-3 states load from DeepSpeed's universal copy actor/{tag}_universal (made now); its "
                 "critic's ZeRO-3 states load from DeepSpeed's universal copy critic/{tag}_universal (made now)")
    assert ("[step3] --resume: checkpoint iter_0000002 saved by 1 rank(s), this run has 2: "
            + universal.format(tag="iter_0000002") + "; the prompt position: the first 16 of epoch 1's 24 prompts (in "
            "its order) were trained on, this run skips 4 batches of 2 on each rank; the unsupervised stream: 16 of "
            "its 2428 blocks into pass 1, this run skips 4 batches of 2 on each rank; rank 0 restores its own RNG "
            "states and answer sampler, rank 1 (none saved) draws its from (--seed, rank, iteration); its adaptive "
            "KL coefficient, EMA copy and held-out scores before PPO load as saved") in proc.stdout, proc.stdout[-3000:]
    assert ("[step3] --resume: checkpoint iter_0000004 saved by 2 rank(s), this run has 1: "
            + universal.format(tag="iter_0000004") + "; the prompt position: the first 8 of epoch 2's 24 prompts (in "
            "its order) were trained on, this run skips 1 batch of 8 on each rank; the unsupervised stream: 32 of "
            "its 2428 blocks into pass 1, this run skips 4 batches of 8 on each rank; rank 0 restores its own RNG "
            "states and answer sampler; its adaptive KL coefficient, EMA copy and held-out scores before PPO load "
            "as saved") \
        in out, out
    assert "resumed from iteration 4 " in out and "this run spans" not in out
    full, two_after = _seen(tmp_path, "full", 2), _seen(tmp_path, "two_after", 2)
    one_before, one_after = _seen(tmp_path, "one_before", 1), _seen(tmp_path, "one_after", 1)
    for resumed, saved, at, iterations in ((two_after, one_before[0], 2, [2, 3, 4, 5]),
                                           (one_after, full[0], 4, [4, 5])):
        for rank in resumed:
            assert rank["resumed_at"] == at
            assert rank["kl_coef"] == saved["saved_kl_coef"][str(at)] != 0.1  # (adapted from --kl_ctl's 0.1)
            assert rank["loaded_actor_difference"] == rank["loaded_critic_difference"] == 0.0
            assert rank["loaded_ema_difference"] == 0.0
            assert rank["actor_weight_decays"] == rank["critic_weight_decays"] == [0.1, 0.0]
            assert sorted({iteration for iteration, _ in rank["prompts"]}) == iterations
    assert metrics["iterations"] == two_after[0]["metrics"]["iterations"] == 6
    uninterrupted = _prompts(full)
    assert set(uninterrupted.values()) == {1} and len(uninterrupted) == 2 * 24  # every prompt once in each epoch
    assert _prompts(one_before, two_after) == uninterrupted
    # (the first 4 iterations of the uninterrupted run's, on its 2 ranks, and the resumed run's last 2)
    before = [{"prompts": [p for p in rank["prompts"] if p[0] < 4]} for rank in full]
    assert _prompts(before, one_after) == uninterrupted
    assert _blocks(one_before, two_after) == _blocks(full)
    assert _blocks([{"blocks": rank["blocks"][:16]} for rank in full], one_after) == _blocks(full)
    # its save of iteration 6 over the 2-rank run's keeps none of that run's rank 1 files
    from dschat.utils.checkpoints import saved_ranks

    assert saved_ranks(str(tmp_path / "full" / "checkpoints"), "iter_0000006") == 1
    assert not list((tmp_path / "full" / "checkpoints" / "actor" / "iter_0000006").glob("*rank_1_*"))
    # the finished 2-rank resume's last checkpoint on 1 rank: nothing to train, and no universal copy left behind
    # (the actor's and the critic's, each a full copy of its optimizer states)
    other_ranks.run("ppo", tmp_path, "one_end", None,
                    [*common, *PPO_ONE_RANK, "--output_dir", str(tmp_path / "one"), "--resume"])
    out = capsys.readouterr().out
    assert "resumed from iteration 6 " in out and "nothing left to train" in out, out[-3000:]
    assert ("removed DeepSpeed's universal copies actor/iter_0000006_universal, critic/iter_0000006_universal of "
            "checkpoint iter_0000006") in out
    assert not [p for p in (tmp_path / "one" / "checkpoints").glob("*/*") if "universal" in p.name]


@pytest.mark.multirank
def test_a_step3_checkpoint_of_a_frozen_zero3_actor_resumes_on_another_number_of_ranks(tmp_path, distributed, capsys):
    """--freezing_actor_steps: a ZeRO-3 actor checkpointed before its first step was refused on another number of
    ranks (DeepSpeed's universal checkpoint cannot convert an optimizer without Adam's moments: a bare KeyError). Its
    engine is the one a fresh start makes, so it starts from its model again (its weights the checkpoint's), the
    critic loads from its universal copy, and the actor trains from the iteration its freezing ends."""
    common = [*PPO_OTHER_RANKS, "--zero_stage", "3", "--num_train_epochs", "1", "--freezing_actor_steps", "2",
              "--data_output_path", str(tmp_path / "data")]
    run_deepspeed(OTHER_RANKS, "ppo", tmp_path, "before:split:2", *common, *PPO_TWO_RANKS)
    capsys.readouterr()
    metrics = _other_ranks().run("ppo", tmp_path, "after", None,
                                 [*common, *PPO_ONE_RANK, "--output_dir", str(tmp_path / "split"), "--resume"])
    out = capsys.readouterr().out
    assert ("[step3] --resume: checkpoint iter_0000002 saved by 2 rank(s), this run has 1: its actor had taken no "
            "optimizer step yet (--freezing_actor_steps), so it starts from --actor_model_name_or_path as the "
            "checkpoint's did; its critic's ZeRO-3 states load from DeepSpeed's universal copy "
            "critic/iter_0000002_universal (made now);") in out, out[-3000:]
    after, = _seen(tmp_path, "after", 1)
    assert after["resumed_at"] == 2 and metrics["iterations"] == 3
    assert after["loaded_actor_difference"] == after["loaded_critic_difference"] == 0.0
    assert after["actor_weight_decays"] == after["critic_weight_decays"] == [0.1, 0.0]
    assert "[step3] iter 3: reward" in out and "actor_loss=" in out.split("[step3] iter 3:")[1].split("\n")[0]
    assert not (tmp_path / "split" / "checkpoints" / "actor" / "iter_0000002_universal").exists()


@pytest.mark.parametrize("saved, now", [(2, 3), (3, 2)])
def test_a_step3_lora_actor_checkpointed_before_its_first_step_resumes_at_another_stage_with_its_adapters(
        saved, now, tmp_path, distributed, monkeypatch, capsys):
    """--freezing_actor_steps with --actor_lora_dim: an actor checkpointed before its first step (no Adam state to
    convert) was refused at another ZeRO stage (and ZeRO-3's on other ranks): its engine starts as made, but LoRA's
    adapters were drawn at random when the checkpoint's run started, and this run may draw others (here made to:
    another RNG state when they are drawn; on one rank with the same seed the draws happen to agree). The actor now
    takes the checkpoint's adapters before its engine is made (ZeRO-3's from its fp32 partitions): its weights right
    after the load are the checkpoint's, and it trains from the iteration its freezing ends."""
    from dschat.rlhf import engine as engine_module
    common = [*PPO_OTHER_RANKS, *PPO_ONE_RANK, "--num_train_epochs", "1", "--freezing_actor_steps", "2",
              "--actor_lora_dim", "4", "--critic_zero_stage", "2", "--data_output_path", str(tmp_path / "data"),
              "--output_dir", str(tmp_path / "out")]
    other_ranks = _other_ranks()
    other_ranks.run("ppo", tmp_path, "before", 2, [*common, "--actor_zero_stage", str(saved)])
    real_apply_lora = engine_module.apply_lora

    def apply_lora_drawing_others(*args, **kwargs):
        torch.manual_seed(12345)  # (the checkpoint's run drew them from --seed's state; its RNG is restored later)
        return real_apply_lora(*args, **kwargs)

    monkeypatch.setattr(engine_module, "apply_lora", apply_lora_drawing_others)
    capsys.readouterr()
    metrics = other_ranks.run("ppo", tmp_path, "after", None, [*common, "--actor_zero_stage", str(now), "--resume"])
    out = capsys.readouterr().out
    assert (f"[step3] --resume: checkpoint iter_0000002 saved at another ZeRO stage (--actor_zero_stage {saved} -> "
            f"{now}): its actor had taken no optimizer step yet (--freezing_actor_steps), so it starts from "
            "--actor_model_name_or_path as the checkpoint's did, with the checkpoint's LoRA adapters;") in out, \
        out[-3000:]
    after, = _seen(tmp_path, "after", 1)
    assert after["resumed_at"] == 2 and metrics["iterations"] == 3
    assert after["loaded_actor_difference"] == after["loaded_critic_difference"] == 0.0
    assert "[step3] iter 3: reward" in out and "actor_loss=" in out.split("[step3] iter 3:")[1].split("\n")[0]


@pytest.mark.parametrize("saved, now", [((2, 1), (3, 3)), ((3, 3), (1, 1))])
def test_a_step3_checkpoint_resumes_with_its_actor_and_critic_at_other_zero_stages(saved, now, tmp_path, distributed,
                                                                                   capsys):
    """Step 3's --actor_zero_stage and --critic_zero_stage were bound flags: a run that ran out of memory with its
    actor at ZeRO-2 could not resume at ZeRO-3 ("--actor_zero_stage 2 -> 3"). Each part's states load through its
    universal copy fitted for its new stage (the actor's 2 -> 3 and 3 -> 1, the critic's 1 -> 3 and 3 -> 1), Adam's
    moments and all, so the run ends with the weights of a resume at the checkpoint's own stages (fp32, one rank: the
    same arithmetic. Not a run at the new stages from the start: at ZeRO-3 zero.Init draws the critic's new value head
    otherwise)."""
    common = [*PPO_OTHER_RANKS, *PPO_ONE_RANK, "--num_train_epochs", "1", "--data_output_path",
              str(tmp_path / "data")]
    saved_stages = ["--actor_zero_stage", str(saved[0]), "--critic_zero_stage", str(saved[1])]
    other_ranks, split, same = _other_ranks(), tmp_path / "split", tmp_path / "same"
    other_ranks.run("ppo", tmp_path, "before", 2, [*common, *saved_stages, "--output_dir", str(split)])
    shutil.copytree(split, same)
    other_ranks.run("ppo", tmp_path, "same", None, [*common, *saved_stages, "--output_dir", str(same), "--resume"])
    capsys.readouterr()
    metrics = other_ranks.run("ppo", tmp_path, "after", None, [*common, "--actor_zero_stage", str(now[0]),
                                                               "--critic_zero_stage", str(now[1]), "--output_dir",
                                                               str(split), "--resume"])
    out = capsys.readouterr().out
    assert (f"[step3] --resume: checkpoint iter_0000002 saved at another ZeRO stage (--actor_zero_stage {saved[0]} -> "
            f"{now[0]}, --critic_zero_stage {saved[1]} -> {now[1]}): its actor's ZeRO-{saved[0]} states load into "
            f"ZeRO-{now[0]} from DeepSpeed's universal copy actor/iter_0000002_universal (made now); its critic's "
            f"ZeRO-{saved[1]} states load into ZeRO-{now[1]} from DeepSpeed's universal copy "
            "critic/iter_0000002_universal (made now); Adam's moments and step counts, the schedulers and the place "
            "in the prompts go on as saved") in out, out[-3000:]
    after, = _seen(tmp_path, "after", 1)
    assert after["resumed_at"] == 2 and metrics["iterations"] == 3
    assert after["loaded_actor_difference"] == after["loaded_critic_difference"] == 0.0
    assert after["actor_weight_decays"] == after["critic_weight_decays"] == [0.1, 0.0]
    assert after["prompts"] == _seen(tmp_path, "same", 1)[0]["prompts"]
    # (Adam's moments started again from zero would move every weight of iteration 3 elsewhere)
    for part in ("actor", "critic"):
        resumed = _weights(same / part)
        for name, tensor in _weights(split / part).items():
            torch.testing.assert_close(tensor, resumed[name], rtol=0, atol=1e-6, msg=f"{part} {name}")


def test_a_step3_checkpoint_at_another_zero_stage_that_cannot_convert_is_an_error_saying_what_to_do(tmp_path,
                                                                                                    monkeypatch):
    """Stage 0 to or from another (the optimizer saved whole) does not convert: an error naming the stage to resume
    with, and how to fit in less memory at it, before any engine is made. An actor checkpointed before its first step
    (--freezing_actor_steps: no Adam state to convert) starts from its model again, as the checkpoint's did, a LoRA
    one with the checkpoint's adapters (drawn at random when its run started: it was refused)."""
    from dschat.args import step3_parser
    from dschat.rlhf import checkpointing
    from dschat.rlhf.config import step3_args

    root = tmp_path / "checkpoints"
    _step3_checkpoint(root, 1, None, {"epoch": 0, "batch": 2, "unsup_batches": 0})
    state = json.loads((root / "trainer" / "iter_0000002" / "state.json").read_text())
    state["flags"] = {"actor_zero_stage": 0, "critic_zero_stage": 0}
    (root / "trainer" / "iter_0000002" / "state.json").write_text(json.dumps(state))

    def plan(*flags):  # (this run's loader, on 1 rank: 40 prompts)
        args = step3_args(step3_parser().parse_args(["--resume", "--output_dir", str(tmp_path),
                                                     "--per_device_generation_batch_size", "4", *flags]))
        return checkpointing.plan_resume(args, str(root), _loader(40, 10))

    with pytest.raises(UsageError, match=re.escape(
            "was saved at ZeRO stage 0 (--critic_zero_stage 0), this run has 2; DeepSpeed's universal checkpoint "
            "moves the optimizer states of ZeRO-1, 2 and 3 between stages, not those of stage 0 (saved whole, in "
            "another form): resume with --critic_zero_stage 0 (to fit in less memory: a smaller "
            "--per_device_training_batch_size with a --gradient_accumulation_steps as many times larger, the same rows "
            "an optimizer step), or start afresh without --resume")):
        plan("--actor_zero_stage", "0", "--critic_zero_stage", "2")
    # an actor saved at ZeRO-2 before its first step: its optimizer holds no Adam state to convert
    state["flags"] = {"actor_zero_stage": 2, "critic_zero_stage": 0}
    (root / "trainer" / "iter_0000002" / "state.json").write_text(json.dumps(state))
    torch.save({"global_steps": 0}, root / "actor" / "iter_0000002" / "mp_rank_00_model_states.pt")
    (root / "actor" / "iter_0000002" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    lora = ("--actor_zero_stage", "3", "--critic_zero_stage", "0", "--freezing_actor_steps", "3", "--actor_lora_dim",
            "8")
    resumed = plan(*lora)
    assert resumed.load_tag("actor") is None and not resumed.universal  # (its engine as made)
    assert resumed.lora_from == {"actor": str(root / "actor" / "iter_0000002")}
    assert "as the checkpoint's did, with the checkpoint's LoRA adapters; Adam's moments" in resumed.notice
    resumed = plan(*lora[:-2])
    assert resumed.load_tag("actor") is None and not resumed.universal and not resumed.lora_from
    assert resumed.notice.startswith("[step3] --resume: checkpoint iter_0000002 saved at another ZeRO stage "
                                     "(--actor_zero_stage 2 -> 3): its actor had taken no optimizer step yet "
                                     "(--freezing_actor_steps), so it starts from --actor_model_name_or_path as the "
                                     "checkpoint's did; Adam's moments"), resumed.notice
    # only the critic's stage changed: the untrained actor, at its own stage, loads its own states (LoRA's too; the
    # critic's files and their conversion are not this test's)
    monkeypatch.setattr(checkpointing, "check_engine_files", lambda *args: None)
    monkeypatch.setattr(checkpointing, "universal_load", lambda root, part, tag, *rest, **kw: (f"{tag}_universal", "."))
    state["flags"] = {"actor_zero_stage": 3, "critic_zero_stage": 1}
    (root / "trainer" / "iter_0000002" / "state.json").write_text(json.dumps(state))
    zero3_states = root / "actor" / "iter_0000002" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    torch.save({"global_steps": 0}, zero3_states)
    resumed = plan("--actor_zero_stage", "3", "--critic_zero_stage", "2", "--freezing_actor_steps", "3",
                   "--actor_lora_dim", "8")
    assert resumed.load_tag("actor") == "iter_0000002" and resumed.universal == {"critic"}
    assert "(--critic_zero_stage 1 -> 2)" in resumed.notice
    zero3_states.unlink()
    monkeypatch.undo()
    state["flags"] = {"actor_zero_stage": 2, "critic_zero_stage": 0}
    (root / "trainer" / "iter_0000002" / "state.json").write_text(json.dumps(state))
    # without the plan made before the engines (a notebook's load_checkpoint), the stage stays bound
    with pytest.raises(UsageError, match=re.escape("saved with other settings: --actor_zero_stage 2 -> 3")):
        checkpointing.check_resumable(checkpointing.planned_models(step3_args(step3_parser().parse_args(
            ["--output_dir", str(tmp_path), "--per_device_generation_batch_size", "4", *lora[:-2]]))), str(root),
            "iter_0000002")


def test_a_checkpoint_that_cannot_load_on_other_ranks_at_another_stage_says_both_to_give_back_at_once(tmp_path):
    """A resume that changes the number of ranks and the ZeRO stage of states that convert for neither (NVMe-offloaded
    optimizer states) was refused once for each: "resume on 2 rank(s)", then, so resumed, "resume with --zero_stage
    2". One error names both (steps 1, 2 and DPO, and step 3's actor), before the batch flags' products, which a
    change of them would not mend."""
    from types import SimpleNamespace

    from dschat.args import step3_parser
    from dschat.rlhf import checkpointing
    from dschat.rlhf.config import step3_args

    root = tmp_path / "checkpoints"
    for part in ("model", "trainer"):
        (root / part / "step_0000002").mkdir(parents=True)
    model = root / "model" / "step_0000002"
    (model / "mp_rank_00_model_states.pt").write_bytes(b"")
    (model / "offloaded_tensors").mkdir()  # (DeepSpeed's NVMe-offloaded optimizer, one folder per rank)
    (root / "latest").write_text(json.dumps({"tag": "step_0000002"}))
    state = {"step": 2, "epoch": 0, "batch": 2, "step_name": "step1",
             "flags": {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "zero_stage": 2}}
    (root / "trainer" / "step_0000002" / "state.json").write_text(json.dumps(state))
    for rank in (0, 1):
        (model / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
        (root / "trainer" / "step_0000002" / f"rng_rank{rank}.pt").write_bytes(b"")
    args = SimpleNamespace(output_dir=str(tmp_path), resume=True, per_device_train_batch_size=8,
                           gradient_accumulation_steps=1, zero_stage=3)
    with pytest.raises(UsageError, match=re.escape(
            "was saved by 2 rank(s) at ZeRO stage 2 (--zero_stage 2), this run has 1 at 3; its model's optimizer "
            "states were offloaded to NVMe, one folder per rank, which DeepSpeed's universal checkpoint does not "
            "convert: resume on 2 rank(s) with --zero_stage 2 (to fit in less memory: a smaller "
            "--per_device_train_batch_size with a --gradient_accumulation_steps as many times larger, the same samples "
            "a step), or start afresh without --resume")):
        resume.plan_resume(args, "step1", {}, None)
    with pytest.raises(UsageError, match=r"saved by 2 rank\(s\), this run has 1; its model's optimizer states were "
                                         r"offloaded to NVMe.*: resume on 2 rank\(s\)$"):
        resume.plan_resume(SimpleNamespace(**{**vars(args), "zero_stage": 2}), "step1", {}, None)

    root = tmp_path / "step3" / "checkpoints"
    _step3_checkpoint(root, 2, {"per_device_generation_batch_size": 4, "generation_batches": 1,
                                "per_device_training_batch_size": 4, "gradient_accumulation_steps": 1},
                      {"epoch": 0, "batch": 2, "unsup_batches": 0})
    tag = root / "trainer" / "iter_0000002"
    state = json.loads((tag / "state.json").read_text())
    state["flags"] = {"actor_zero_stage": 2, "critic_zero_stage": 0}
    (tag / "state.json").write_text(json.dumps(state))
    actor = root / "actor" / "iter_0000002"
    for rank in (0, 1):
        (actor / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
    (actor / "offloaded_tensors").mkdir()

    def plan(*flags):  # (this run's loader, on 1 rank: 40 prompts)
        args = step3_args(step3_parser().parse_args(["--resume", "--output_dir", str(tmp_path / "step3"),
                                                     "--per_device_generation_batch_size", "8",
                                                     "--critic_zero_stage", "0", *flags]))
        return checkpointing.plan_resume(args, str(root), _loader(40, 5))

    with pytest.raises(UsageError, match=re.escape(
            "was saved by 2 rank(s) at ZeRO stage 2 (--actor_zero_stage 2), this run has 1 at 3; its actor's "
            "optimizer states were offloaded to NVMe, one folder per rank, which DeepSpeed's universal checkpoint "
            "does not convert: resume on 2 rank(s) with --actor_zero_stage 2 (to fit in less memory: a smaller "
            "--per_device_training_batch_size with a --gradient_accumulation_steps as many times larger, the same rows "
            "an optimizer step), or start afresh without --resume")):
        plan("--actor_zero_stage", "3")


def test_a_resumed_run_of_another_length_says_its_learning_rates_follow_the_new_schedule(capsys):
    """DeepSpeed restores the scheduler's position; a lowered --max_steps then decays the rates at once (a user saw
    1.7e-05 where the uninterrupted run had 7.0e-04), silently."""
    from dschat.steps.common import say_a_changed_schedule

    say_a_changed_schedule("step1", {"total": 30}, 12, "steps")
    assert capsys.readouterr().out == ("[step1] this run spans 12 steps, its checkpoint's run 30 (--max_steps, "
                                       "--num_train_epochs): the learning rates from here follow this run's "
                                       "schedule\n")
    for checkpoint in ({"total": 12}, {}, None):  # the same length; a checkpoint from before it was recorded
        say_a_changed_schedule("step1", checkpoint, 12, "steps")
    assert capsys.readouterr().out == ""


def test_print_loss_on_several_ranks_says_its_loss_is_rank_0s(monkeypatch, capsys):
    """--print_loss on several ranks prints rank 0's mean loss (docs/rank_change_resume.md compares those): its line
    said "loss 9.2283" as if it were the step's, over every rank's records. DeepSpeed-Chat prints each rank's with its
    rank; dschat's line now says whose it is. On one rank it is the step's, and the line is as before."""
    from types import SimpleNamespace

    from dschat.steps import common

    skipped = SimpleNamespace(last_step_skipped=lambda: False, total=0)
    args = SimpleNamespace(print_loss=True)
    common._log_step(args, "step1", 4, 9.22834, 1e-4, None, None, None, skipped)
    assert capsys.readouterr().out == "[step1] step 4 loss 9.2283 lr 1.000e-04\n"
    monkeypatch.setattr(common, "get_world_size", lambda: 2)
    common._log_step(args, "step1", 4, 9.22834, 1e-4, None, None, None, skipped)
    assert capsys.readouterr().out == ("[step1] step 4 loss 9.2283 (rank 0's micro-batches, 1 of 2 ranks) lr "
                                       "1.000e-04\n")


def test_a_resumed_run_of_another_length_trains_its_first_step_at_its_own_schedules_rate(tmp_path, distributed,
                                                                                          capsys):
    """DeepSpeed's load restores the optimizer's rates as the checkpoint's run left them, and the scheduler sets this
    run's only after the next step: a 4-step run's checkpoint at its last step, resumed with --max_steps 8, trained
    step 5 at 0.0 (the ended cosine's rate) while saying that its rates follow its own schedule."""
    common = [*SMALL, "--model_name_or_path", "tiny-llama", "--data_output_path", str(tmp_path / "data"),
              "--output_dir", str(tmp_path / "sft"), "--print_loss", "--learning_rate", "1e-3",
              "--per_device_train_batch_size", "4"]
    sft.main([*common, "--max_steps", "4", "--save_interval", "4"])
    capsys.readouterr()
    sft.main([*common, "--max_steps", "8", "--resume"])
    printed = capsys.readouterr().out
    assert "this run spans 8 steps, its checkpoint's run 4" in printed
    rates = {int(line.split()[2]): float(line.split()[-1]) for line in printed.splitlines()
             if line.startswith("[step1] step ") and " lr " in line}
    assert sorted(rates) == [5, 6, 7, 8]
    for step, rate in rates.items():  # an 8-step cosine without warmup, printed to 4 digits
        assert rate == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * (step - 1) / 8)), rel=1e-3), step


@pytest.mark.parametrize("zero_stage", ["1", "2"])
def test_a_resumed_run_clips_its_gradients_at_its_own_configs_value(zero_stage, tmp_path, distributed, monkeypatch,
                                                                     capsys):
    """DeepSpeed's ZeRO-1/2 optimizer saves its gradient clipping with its state and its load puts that back: a
    resume whose DeepSpeed config file gave gradient_clipping 0.01 said so, and clipped at the checkpoint's 1.0."""
    import deepspeed

    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"gradient_clipping": 0.01}))
    common = [*SMALL, "--model_name_or_path", "tiny-llama", "--data_output_path", str(tmp_path / "data"),
              "--output_dir", str(tmp_path / "sft"), "--per_device_train_batch_size", "4", "--zero_stage", zero_stage]
    sft.main([*common, "--max_steps", "2", "--save_interval", "2"])  # (dschat's default: 1.0)
    clipped_at, real_step = [], deepspeed.DeepSpeedEngine.step

    def step(engine, *args, **kwargs):
        clipped_at.append(engine.optimizer.clip_grad)
        return real_step(engine, *args, **kwargs)

    monkeypatch.setattr(deepspeed.DeepSpeedEngine, "step", step)
    capsys.readouterr()
    sft.main([*common, "--max_steps", "4", "--resume", "--deepspeed_config", str(config)])
    assert "gradient_clipping = 0.01 (dschat's flags gave 1.0)" in capsys.readouterr().out
    assert clipped_at == [0.01, 0.01]


@pytest.mark.multirank
def test_a_checkpoint_one_rank_cannot_load_stops_every_rank_before_any_says_it_resumed(tmp_path):
    script = Path(__file__).parent / "scripts" / "resume_damaged_rank.py"
    proc = run_deepspeed(script, str(tmp_path), timeout=900, check=False)
    assert proc.returncode != 0 and "rank 1's optimizer states cut" in proc.stdout, proc.stdout[-3000:]
    assert "error: --resume: checkpoint step_0000002 in" in proc.stderr and "cannot be loaded" in proc.stderr
    assert "error: rank 0 stopped: another rank stopped first (its error, if it printed one, is above)" \
        in proc.stderr, proc.stderr[-3000:]
    assert "resumed from step" not in proc.stdout
    assert (tmp_path / "run" / "metrics.json").exists(), "the finished output lost its finished mark"


def test_a_save_over_a_tag_an_earlier_save_left_keeps_none_of_its_files(tmp_path, distributed, capsys):
    """A run of 2 ranks killed while saving step 4 (or an earlier, longer one) leaves rank 1's files in step_0000004;
    resumed on 1 rank from step 2, the run saved step 4 over them and kept them: the checkpoint then counted 2 RNG
    files ("saved by 2 rank(s)"), so resuming it on 1 rank was refused asking for twice the batch, and DeepSpeed's
    partitions of the other run's rank 1 went into its universal copy, or were loaded by a rank 1 as its own."""
    from dschat.utils.checkpoints import saved_ranks

    common = [*SMALL, "--data_output_path", str(tmp_path / "data"), "--output_dir", str(tmp_path / "rm"),
              "--zero_stage", "2", "--save_interval", "2"]
    reward.main([*common, "--max_steps", "4"])
    root = tmp_path / "rm" / "checkpoints"
    model, trainer = root / "model" / "step_0000004", root / "trainer" / "step_0000004"
    left = [model / "zero_pp_rank_1_mp_rank_00_optim_states.pt", trainer / "rng_rank1.pt"]  # (rank 1's, as saved)
    shutil.copy(model / "zero_pp_rank_0_mp_rank_00_optim_states.pt", left[0])
    shutil.copy(trainer / "rng_rank0.pt", left[1])
    (root / "latest").write_text(json.dumps({"tag": "step_0000002"}))
    reward.main([*common, "--max_steps", "4", "--resume"])
    assert not any(path.exists() for path in left) and saved_ranks(str(root), "step_0000004") == 1
    capsys.readouterr()
    assert reward.main([*common, "--max_steps", "6", "--resume"])["steps"] == 6
    out = capsys.readouterr().out
    assert "resumed from step 4 " in out and "saved by" not in out


# Two ranks whose process group times out after 3 s; rank 0's conversion of a part takes 6 s (a large model's takes
# longer than DeepSpeed's 10-minute default).
SLOW_CONVERSION = """
import datetime, os, sys, time
import torch
torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
from dschat.utils import checkpoints
tag = os.path.join(sys.argv[1], "model", "step_0000002")
os.makedirs(tag, exist_ok=True)
open(os.path.join(tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt"), "w").close()
def converting(root, part, tag, saved):
    time.sleep(6)
    return checkpoints.universal_tag(tag), True
checkpoints.universal_copy = converting
said = checkpoints.universal_load(sys.argv[1], "model", "step_0000002", 1, 3)
assert said == ("step_0000002_universal", "its ZeRO-3 states load from DeepSpeed's universal copy "
                "model/step_0000002_universal (made now)"), said
torch.distributed.barrier()
from dschat.utils.cli import end_script
end_script()  # (a gloo rank aborted in the interpreter's teardown now and then)
"""


@pytest.mark.multirank
def test_the_other_ranks_wait_for_a_conversion_longer_than_the_process_groups_timeout(tmp_path):
    """Rank 0 converts a checkpoint of another number of ranks while the others wait for it: they waited in a
    collective of the process group, which failed once its timeout passed (DeepSpeed's default: 10 minutes, less than
    a large model's conversion takes: "Timed out waiting 600000ms"), and the launcher stopped rank 0's conversion,
    which the next try began again."""
    from launch import run_as_two_nodes

    nodes = [tmp_path / "a", tmp_path / "b"]
    for node in nodes:
        node.mkdir()
    run_as_two_nodes(tmp_path, SLOW_CONVERSION, nodes, timeout=120)


def test_pruning_keeps_the_last_complete_checkpoints_and_removes_partial_and_later_ones(tmp_path):
    """A save killed part-way left its model folder and no trainer state; it was never pruned (a multi-GB leftover)."""
    from dschat.utils import checkpoints

    def tag(n, model=True, state=True):
        name = f"step_{n:07d}"
        if model:
            (tmp_path / "model" / name).mkdir(parents=True)
        (tmp_path / "trainer" / name).mkdir(parents=True)
        if state:
            (tmp_path / "trainer" / name / "state.json").write_text("{}")

    for n in (1, 2, 4, 9):  # 9: an earlier, longer run's
        tag(n)
    tag(3, state=False)  # killed while saving
    (tmp_path / "model" / "zero_to_fp32.py").write_text("# DeepSpeed's script beside the tags")
    checkpoints._prune(str(tmp_path), "step_0000004", keep_last=2)
    for part in ("model", "trainer"):
        assert sorted(p.name for p in (tmp_path / part).iterdir() if p.is_dir()) == ["step_0000002", "step_0000004"]
    assert (tmp_path / "model" / "zero_to_fp32.py").is_file()


def test_a_universal_copy_is_no_checkpoint_and_goes_with_its_own(tmp_path):
    """A resume on another number of ranks leaves DeepSpeed's universal copy of its checkpoint beside it: never a tag
    to resume from, pruned with its checkpoint, and with a new save of the same tag (made from the files it
    replaced); a conversion killed part-way leaves a partial folder, which goes too."""
    from dschat.utils import checkpoints

    for n in (2, 4, 6):
        tag = f"step_{n:07d}"
        (tmp_path / "model" / tag).mkdir(parents=True)
        (tmp_path / "model" / f"{tag}_universal").mkdir()
        (tmp_path / "trainer" / tag).mkdir(parents=True)
        (tmp_path / "trainer" / tag / "state.json").write_text("{}")
    (tmp_path / "model" / "step_0000004_universal.partial").mkdir()
    assert checkpoints.complete_tags(str(tmp_path)) == ["step_0000002", "step_0000004", "step_0000006"]
    (tmp_path / "latest").unlink(missing_ok=True)
    with pytest.raises(UsageError, match=r"holds checkpoints step_0000002, step_0000004, step_0000006 and no latest"):
        checkpoints.latest_tag(str(tmp_path))
    checkpoints._prune(str(tmp_path), "step_0000006", keep_last=2)
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == \
        ["step_0000004", "step_0000004_universal", "step_0000006"]


def test_a_resume_on_other_ranks_that_trains_nothing_leaves_no_universal_copy(tmp_path, capsys):
    """A finished run's checkpoint resumed on another number of ranks ("nothing left to train") left its universal
    copy (a full copy of the optimizer states) beside it, which only a later save prunes: none comes. A resume that
    trains on keeps it (its next save prunes it), as one of as many ranks has none to remove."""
    from types import SimpleNamespace

    from dschat.utils.checkpoints import ResumePlan

    for part in ("actor", "critic"):
        (tmp_path / part / "iter_0000004_universal").mkdir(parents=True)
    plan = ResumePlan("iter_0000004", {}, 2, {"actor": "iter_0000004_universal", "critic": "iter_0000004_universal"})
    args = SimpleNamespace(resume=True, save_interval=None)
    resume.resume_or_afresh(lambda: {"iteration": 4}, str(tmp_path), args, "step3", 6, "iteration", plan)
    assert (tmp_path / "actor" / "iter_0000004_universal").is_dir()  # (training goes on from it)
    assert "removed" not in capsys.readouterr().out
    resume.resume_or_afresh(lambda: {"iteration": 4}, str(tmp_path), args, "step3", 4, "iteration", plan)
    assert not [p for p in tmp_path.glob("*/*") if "universal" in p.name]
    assert ("[step3] --resume: removed DeepSpeed's universal copies actor/iter_0000004_universal, "
            "critic/iter_0000004_universal of checkpoint iter_0000004, loaded on 1 rank(s): nothing is left to train "
            "from it") in capsys.readouterr().out


def test_only_a_checkpoints_own_folders_are_pruned_or_cleared(tmp_path, capsys):
    """Pruning took every folder under checkpoints/ for a part and every folder in it for a tag, and a fresh run removed
    the whole folder: a user's notes kept there were deleted."""
    from dschat.utils import checkpoints

    for tag in ("step_0000001", "step_0000002"):
        (tmp_path / "model" / tag).mkdir(parents=True)
        (tmp_path / "trainer" / tag).mkdir(parents=True)
        (tmp_path / "trainer" / tag / "state.json").write_text("{}")
    (tmp_path / "model" / "best").mkdir()  # a user's copy among the tags
    (tmp_path / "notes" / "step_0000001").mkdir(parents=True)  # a user's folder beside the parts
    (tmp_path / "latest").write_text('{"tag": "step_0000002"}')
    checkpoints._prune(str(tmp_path), "step_0000002", keep_last=1)
    assert (tmp_path / "model" / "best").is_dir() and (tmp_path / "notes" / "step_0000001").is_dir()
    assert not (tmp_path / "model" / "step_0000001").exists()
    assert checkpoints.clear_earlier_run(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]
    assert f"{tmp_path}: kept notes (no checkpoint's)" in capsys.readouterr().out
    assert not checkpoints.clear_earlier_run(str(tmp_path)), "no checkpoint left to remove"
    (tmp_path / "notes" / "step_0000001").rmdir(), (tmp_path / "notes").rmdir()
    (tmp_path / "actor").mkdir()
    assert checkpoints.clear_earlier_run(str(tmp_path)) and not tmp_path.exists(), "an emptied folder goes"


def test_resuming_after_the_data_file_was_edited_is_an_error_naming_it(tmp_path, distributed):
    """A record added to the file redrew its train/eval split and shifted what the checkpoint's position counts,
    and the resumed run went on without a word (held-out records could be trained on)."""
    rows = [json.loads(line) for line in (Path(sft.__file__).parents[1] / "tiny" / "data" / "train.jsonl")
            .read_text().splitlines()[:120]]
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = [*SMALL, "--data_path", f"jsonl:{data}", "--data_split", "1,0,0", "--data_output_path",
              str(tmp_path / "data"), "--output_dir", str(tmp_path / "sft"), "--max_steps", "2", "--save_interval", "1"]
    sft.main(common)
    recorded = json.loads((tmp_path / "sft" / "training_args.json").read_text())["data_files"]
    assert [path for path, _ in recorded] == [str(data)]  # what train.py --resume compares
    os.utime(data, (1, 1))  # new times, the same content (a copy, a checkout): the same data, resumed
    sft.main([*common, "--resume"])
    with data.open("a") as f:
        f.write(json.dumps(rows[0]) + "\n")
    with pytest.raises(UsageError, match=rf"saved with other settings: the content of its data files changed since: "
                                         rf"{data}\. .*without --resume"):
        sft.main([*common, "--resume"])


def test_resuming_after_a_new_revision_of_a_hub_dataset_is_an_error_naming_it(tmp_path, distributed, monkeypatch):
    """Hub data was not recorded with a checkpoint: after a new revision of Dahoas/rm-static came into the HF datasets
    cache, the resumed run trained the rest of its epoch on other records without a word (an edited local file is
    an error). Here the revisions are faked: other rows, so other datasets fingerprints."""
    from datasets import Dataset, DatasetDict

    from dschat.data import DahoasRmstaticDataset

    def revision(answer):
        rows = [{"prompt": f"\n\nHuman: Hi record {i}.\n\nAssistant:", "response": answer, "chosen": answer,
                 "rejected": " Go away."} for i in range(40)]
        return DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:8])})

    loaded = {"version": revision(" Hello.")}
    monkeypatch.setattr(DahoasRmstaticDataset, "load", lambda self: loaded["version"])
    common = [*SMALL, "--data_path", "Dahoas/rm-static", "--data_split", "0,1,0", "--data_output_path",
              str(tmp_path / "data"), "--output_dir", str(tmp_path / "rm"), "--max_steps", "2", "--save_interval", "1"]
    reward.main(common)
    recorded = json.loads((tmp_path / "rm" / "training_args.json").read_text())["hub_data"]
    assert list(recorded) == ["Dahoas/rm-static"] and sorted(recorded["Dahoas/rm-static"]) == ["test", "train"]
    loaded["version"] = revision(" Hello.")  # loaded again, the same data: resumed
    reward.main([*common, "--resume"])
    loaded["version"] = revision(" Hello again.")
    with pytest.raises(UsageError, match=r"saved with other settings: the data of its hub datasets changed since: "
                                         r"Dahoas/rm-static \(another revision in the HF datasets cache\)\. "
                                         r".*without --resume"):
        reward.main([*common, "--resume"])
    # a checkpoint from before dschat recorded hub data: not compared, resumed
    state_file = tmp_path / "rm" / "checkpoints" / "trainer" / "step_0000002" / "state.json"
    state = json.loads(state_file.read_text())
    del state["flags"]["hub_data"]
    state_file.write_text(json.dumps(state))
    reward.main([*common, "--resume"])


def test_the_data_files_are_taken_when_the_data_is_read_not_at_each_save(tmp_path):
    """Taken at each save, a file edited while the run trained was recorded as what it trained on."""
    from argparse import Namespace

    from dschat.steps.common import step_data_files, take_data_files

    data = tmp_path / "mine.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b"}\n')
    args = Namespace(data_path=[f"jsonl:{data}"], sft_only_data_path=[])
    take_data_files(args)
    read = step_data_files(args)
    data.write_text('{"prompt": "a", "chosen": "edited"}\n')
    assert step_data_files(args) == read != step_data_files(Namespace(data_path=[f"jsonl:{data}"]))


def test_a_step2_checkpoint_of_an_older_dschat_listing_step1s_files_resumes(tmp_path):
    """Step 2 now records only --data_path's files (step 1 alone reads --sft_only_data_path): its checkpoint from an
    older dschat, which listed the SFT-only files too, is compared with those same files now, not refused as edited."""
    from argparse import Namespace

    from dschat.steps.common import take_data_files
    from dschat.steps.resume import resume_flags
    from dschat.utils.checkpoints import DATA_FILES, DATA_FILES_FLAGS, check_same_flags

    specs = {}
    for name in ("pairs", "sft"):
        (tmp_path / f"{name}.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
        specs[name] = [f"jsonl:{tmp_path / name}.jsonl"]
    args = Namespace(data_path=specs["pairs"], sft_only_data_path=specs["sft"])
    take_data_files(args, 2)
    saved = resume_flags(args)
    assert [path for path, _ in saved[DATA_FILES]] == [str(tmp_path / "pairs.jsonl")]
    assert saved[DATA_FILES_FLAGS] == ["data_path"]
    step1 = Namespace(**vars(args))
    take_data_files(step1, 1)
    older = {**saved, DATA_FILES: resume_flags(step1)[DATA_FILES]}
    del older[DATA_FILES_FLAGS]

    def check(state):
        check_same_flags(state, resume_flags(args, state), (), "step_1", str(tmp_path), "step2", "why")

    check(saved), check(older)
    (tmp_path / "sft.jsonl").write_text('{"prompt": "a", "chosen": "edited"}\n')
    check(saved)  # (a file step 2 does not read)
    with pytest.raises(UsageError, match="sft.jsonl"):  # (the older checkpoint: compared as before)
        check(older)


def _checkpoint_of(args, step, phase):
    """A checkpoint of ``step`` (of data ``phase``), one rank, one step in, that ``args`` saved: its files as the step
    leaves them (empty), its state as the step records it."""
    from dschat.steps.common import STEP_VERSION, STEP_VERSIONS, take_data_files
    from dschat.utils.checkpoints import LATEST, STEP_NAME

    root = Path(args.output_dir) / "checkpoints"
    for part in ("model", "trainer"):
        (root / part / "step_0000001").mkdir(parents=True)
    (root / "model" / "step_0000001" / "mp_rank_00_model_states.pt").write_bytes(b"")
    (root / "trainer" / "step_0000001" / "rng_rank0.pt").write_bytes(b"")
    take_data_files(args, phase)  # (as the step does once it reads its data)
    state = {"step": 1, "epoch": 0, "batch": 1, STEP_NAME: step, STEP_VERSION: STEP_VERSIONS[step],
             "flags": resume.resume_flags(args)}
    (root / "trainer" / "step_0000001" / "state.json").write_text(json.dumps(state))
    (root / LATEST).write_text(json.dumps({"tag": "step_0000001"}))


def test_a_step2_checkpoint_resumes_with_another_sft_only_data_path_which_a_step1_one_refuses(tmp_path):
    """Only step 1 reads --sft_only_data_path, yet steps 2's and DPO's checkpoints were bound to it (RESUME_FLAGS): an
    interrupted step 2 given another one was refused by its own --resume. It binds step 1's checkpoints alone now."""
    from dschat.args import step1_parser, step2_parser
    from dschat.steps.common import take_data_files

    for name in ("pairs", "sft", "other_sft"):
        (tmp_path / f"{name}.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')

    def args(parser, out, sft_only):
        return parser().parse_args(["--output_dir", str(out), "--resume", "--data_path", f"{tmp_path}/pairs.jsonl",
                                    "--sft_only_data_path", f"{tmp_path}/{sft_only}.jsonl"])

    for parser, step, phase in ((step1_parser, "step1", 1), (step2_parser, "step2", 2)):
        _checkpoint_of(args(parser, tmp_path / step, "sft"), step, phase)
    other = args(step2_parser, tmp_path / "step2", "other_sft")
    take_data_files(other, 2)
    assert resume.plan_resume(other, "step2").tag == "step_0000001"
    other = args(step1_parser, tmp_path / "step1", "other_sft")
    take_data_files(other, 1)
    with pytest.raises(UsageError, match=r"saved with other settings: --sft_only_data_path \[.*sft\.jsonl'\] -> "
                                         r"\[.*other_sft\.jsonl'\]\. Its model"):
        resume.plan_resume(other, "step1")
    # an older dschat's step-2 checkpoint, which listed step 1's files too (their flags unsaid): bound as before
    _checkpoint_of(args(step2_parser, tmp_path / "older", "sft"), "step2", 1)
    state_file = tmp_path / "older" / "checkpoints" / "trainer" / "step_0000001" / "state.json"
    state = json.loads(state_file.read_text())
    del state["flags"]["data_files_flags"]
    state_file.write_text(json.dumps(state))
    other = args(step2_parser, tmp_path / "older", "other_sft")
    take_data_files(other, 2)
    with pytest.raises(UsageError, match=r"saved with other settings: --sft_only_data_path "):
        resume.plan_resume(other, "step2")


def test_step3_checkpoints_are_bound_to_their_prompt_files_content(tmp_path):
    from argparse import Namespace
    from types import SimpleNamespace

    from dschat.rlhf import checkpointing
    from dschat.rlhf.config import step3_args

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "a"}\n')
    trainer = SimpleNamespace(args=step3_args(Namespace(data_path=[f"jsonl:{data}"])), critic_model=None)
    assert [path for path, _ in checkpointing.resume_flags(trainer)["data_files"]] == [str(data)]


def test_step3_checkpoints_are_bound_to_the_hub_data_its_prompts_came_from(tmp_path, distributed, monkeypatch):
    from argparse import Namespace
    from types import SimpleNamespace

    from datasets import Dataset, DatasetDict

    from dschat.data import DahoasRmstaticDataset
    from dschat.rlhf import checkpointing
    from dschat.rlhf.config import step3_args
    from dschat.steps.ppo import prompt_loaders
    from dschat.tiny import load_tiny_tokenizer

    rows = [{"prompt": f"\n\nHuman: Hi record {i}.\n\nAssistant:", "response": " Hello.", "chosen": " Hello.",
             "rejected": " Go away."} for i in range(8)]
    monkeypatch.setattr(DahoasRmstaticDataset, "load", lambda self: DatasetDict(
        {"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:4])}))
    args = step3_args(Namespace(data_path=["Dahoas/rm-static"], data_split="0,0,1",
                                data_output_path=str(tmp_path / "data"), output_dir=str(tmp_path / "step3")))
    prompt_loaders(args, load_tiny_tokenizer(), held_out_only=True)
    flags = checkpointing.resume_flags(SimpleNamespace(args=args, critic_model=None))
    assert list(flags["hub_data"]) == ["Dahoas/rm-static"] and flags["data_files"] == []


def test_a_resume_that_trains_nothing_reports_no_rates_rather_than_zero():
    """Resumed from its last step's checkpoint (killed while saving the model), a step trained nothing and wrote
    samples_per_s 0.0 to metrics.json and TensorBoard, as if it had measured a stall."""
    from dschat.steps.common import Throughput

    idle = Throughput(num_params=1000)
    assert idle.summary() == {"samples_per_s": None, "tokens_per_s": None, "tflops_per_rank": None}
    idle.update(rows=4, tokens=64)
    assert all(value > 0 for value in idle.summary().values())


def test_dpo_loss_coefficients_changed_on_resume_are_said(capsys):
    """DPO's --beta, --label_smoothing and --rpo_alpha bind nothing a checkpoint holds, but a resume that changed them
    went unsaid: the run's log claimed one objective and trained another. Said, as another dropout is."""
    from dschat.args import step2_dpo_parser
    from dschat.steps.resume import BOUND_WHY, FREE_FLAGS, RESTORED_FLAGS, resume_flags
    from dschat.utils.checkpoints import check_same_flags

    saved = resume_flags(step2_dpo_parser().parse_args(["--beta", "0.1"]))
    now = resume_flags(step2_dpo_parser().parse_args(["--beta", "0.3", "--rpo_alpha", "1.0"]))
    assert check_same_flags(saved, now, RESTORED_FLAGS, "step_0000001", "out", "step2_dpo", BOUND_WHY,
                            FREE_FLAGS) == {}
    assert "[step2_dpo] --resume: --beta 0.1 -> 0.3, --rpo_alpha 0.0 -> 1.0: the rest of the run trains with the new " \
           "value" in capsys.readouterr().out


def test_a_zero3_optimizer_no_step_has_updated_fails_conversion_saying_why(tmp_path, distributed):
    """DeepSpeed converts a ZeRO-3 optimizer only once a step has made Adam's moments: before, ds_to_universal stops
    on a bare "KeyError: 0", which the refusal passed on without a word of what it means (a critic whose first fp16
    steps all overflowed and were skipped, on 2 CPU ranks). The refusal says it; no partial copy is left."""
    import deepspeed
    from transformers import GPT2Config, GPT2LMHeadModel

    from dschat.utils import checkpoints

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.save_checkpoint(str(tmp_path / "model"), tag="step_0000002")  # (no step taken)
    with pytest.raises(UsageError) as raised:
        checkpoints.universal_copy(str(tmp_path), "model", "step_0000002", 2)
    assert "(ds_to_universal: KeyError" in str(raised.value), str(raised.value)
    assert "DeepSpeed converts an optimizer only once a step has updated it" in str(raised.value)
    assert "resume on 2 rank(s)" in str(raised.value)
    assert not [p.name for p in (tmp_path / "model").iterdir() if "universal" in p.name]


def _zero2_engine_after_one_step():
    """A one-layer GPT-2 under ZeRO-2 after one optimizer step (DeepSpeed converts an optimizer only once a step has
    updated it)."""
    import deepspeed
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    ids = torch.arange(8)[None]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    return engine


def test_a_conversion_is_said_when_it_starts_and_with_its_seconds(tmp_path, distributed, capsys):
    """Rank 0's conversion for another number of ranks took 48 s for an OPT-350m-shaped model's ZeRO-3 states on a
    CPU machine (README), and grows with the states, in silence: nothing was said before the resume's line after
    it. It is said when it starts and when it is made, with its seconds; a copy a later resume reuses says nothing."""
    from dschat.utils import checkpoints

    engine = _zero2_engine_after_one_step()
    engine.save_checkpoint(str(tmp_path / "model"), tag="step_0000002")
    capsys.readouterr()
    assert checkpoints.universal_copy(str(tmp_path), "model", "step_0000002", 2) == ("step_0000002_universal", True)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("--resume:")]
    assert said[0] == ("--resume: converting model/step_0000002 (saved by 2 rank(s)) into DeepSpeed's universal copy "
                       "model/step_0000002_universal for 1 rank(s) (ds_to_universal, once; the other ranks wait)")
    assert re.fullmatch(r"--resume: model/step_0000002_universal made in \d+ s", said[1]), said
    assert len(said) == 2
    assert checkpoints.universal_copy(str(tmp_path), "model", "step_0000002", 2) == ("step_0000002_universal", False)
    assert "--resume:" not in capsys.readouterr().out


def test_a_conversion_that_meets_a_damaged_file_says_the_checkpoint_is_damaged(tmp_path, distributed):
    """A ZeRO partition cut short made the conversion for another number of ranks fail with "OSError: [Errno 22]
    Invalid argument", said as DeepSpeed not converting the states and advising a resume on the checkpoint's own
    ranks, where it failed to load too. It is said as a damaged file, with the earlier checkpoint to resume from."""
    from dschat.utils import checkpoints

    engine = _zero2_engine_after_one_step()
    for tag in ("step_0000001", "step_0000002"):
        engine.save_checkpoint(str(tmp_path / "model"), tag=tag)
        (tmp_path / "trainer" / tag).mkdir(parents=True)
        (tmp_path / "trainer" / tag / "state.json").write_text("{}")
    partition = tmp_path / "model" / "step_0000002" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    partition.write_bytes(partition.read_bytes()[:partition.stat().st_size // 2])
    with pytest.raises(UsageError, match=r"checkpoint step_0000002 in .* cannot be converted for 1 rank\(s\) "
                                         r"\(ds_to_universal on model/step_0000002: \w+Error: .*\); a file of it is "
                                         r"damaged or missing \(copied in part\?\): restore it; to resume from "
                                         r"checkpoint step_0000001, write"):
        checkpoints.universal_copy(str(tmp_path), "model", "step_0000002", 2)
    assert not (tmp_path / "model" / "step_0000002_universal.partial").exists()


def test_a_conversion_refused_its_write_is_not_said_as_a_damaged_checkpoint(tmp_path, distributed, monkeypatch):
    """The conversion writes its copy beside the checkpoint: a write refused there (a checkpoints folder copied
    read-only) was said as a damaged file to restore, though every file of it reads. It is said as DeepSpeed's
    conversion failing, with the error that names the folder."""
    import errno

    from deepspeed.checkpoint import ds_to_universal

    from dschat.utils import checkpoints

    (tmp_path / "model" / "step_0000002").mkdir(parents=True)
    for code in (errno.EACCES, errno.EROFS):
        def refused(options, code=code):
            raise OSError(code, os.strerror(code), options.output_folder)

        monkeypatch.setattr(ds_to_universal, "main", refused)
        with pytest.raises(UsageError) as raised:
            checkpoints.universal_copy(str(tmp_path), "model", "step_0000002", 2)
        assert "damaged" not in str(raised.value), str(raised.value)
        assert f"DeepSpeed could not convert its model states for another number of ranks (ds_to_universal: " \
               f"{type(OSError(code, '')).__name__}: [Errno {code}]" in str(raised.value), str(raised.value)


def test_a_conversion_that_fills_the_disk_says_so_naming_the_folder(tmp_path, distributed, monkeypatch):
    """The conversion's copy is written beside the checkpoint, about twice its optimizer states while it is made: a
    full disk or quota there (an OSError, or torch's writer's RuntimeError that names no cause) was said as DeepSpeed
    failing to convert the states, with advice to resume on the checkpoint's ranks and its error. It says the space
    ran out, where, how much was free, about how much the copy takes; the part written is removed."""
    import errno
    import shutil as shutil_module
    from collections import namedtuple

    from deepspeed.checkpoint import ds_to_universal

    from dschat.utils import checkpoints

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil_module, "disk_usage", lambda path: Usage(2**40, 2**40 - 5 * 2**20, 5 * 2**20))
    (tmp_path / "model" / "step_0000002").mkdir(parents=True)
    (tmp_path / "model" / "step_0000002" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(bytes(3 * 2**20))
    failures = (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "a/file"), OSError(errno.ENOSPC, "no space"),
                RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
                OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)))
    for failure in failures:
        def fills_the_disk(options, failure=failure):
            os.makedirs(options.output_folder)
            raise failure

        monkeypatch.setattr(ds_to_universal, "main", fills_the_disk)
        with pytest.raises(UsageError) as raised:
            checkpoints.universal_copy(str(tmp_path), "model", "step_0000002", 2)
        code = getattr(failure, "errno", None) or errno.ENOSPC
        free = ", 5.0 MiB free" if code == errno.ENOSPC else ""  # (a quota's limit is not the disk's space)
        assert str(raised.value) == (
            f"--resume: checkpoint step_0000002 in {tmp_path} was saved by 2 rank(s), this run has 1, and DeepSpeed's "
            f"conversion of its model states for another number of ranks ran out of space ({os.strerror(code)}{free}) "
            f"in {tmp_path / 'model'}, where it writes the universal copy model/step_0000002_universal (with its "
            "temporary files, up to about twice the 3.0 MiB of model/step_0000002; the part written was removed): "
            "free some space there, or resume on 2 rank(s), which loads the checkpoint without a copy"), raised.value
        assert sorted(os.listdir(tmp_path / "model")) == ["step_0000002"]
    # torch's writer failing with room on the disk: not a full disk's, DeepSpeed's error as before
    monkeypatch.setattr(shutil_module, "disk_usage", lambda path: Usage(2**42, 2**41, 2**41))
    monkeypatch.setattr(ds_to_universal, "main", lambda options, failure=failures[2]: fills_the_disk(options, failure))
    with pytest.raises(UsageError, match=r"DeepSpeed could not convert its model states .*unexpected pos 704"):
        checkpoints.universal_copy(str(tmp_path), "model", "step_0000002", 2)


def test_a_dpo_checkpoint_resumes_only_against_the_reference_model_its_run_started_from(tmp_path, distributed,
                                                                                          monkeypatch, capsys):
    """DPO's --model_name_or_path is also its frozen reference, loaded again from the folder on --resume while the
    policy comes from the checkpoint. Step 1 run again into that folder between the interruption and the resume (same
    path, so every bound flag matched): the resumed run trained the old SFT model's policy against the new SFT model as
    its reference, silently. Refused (compared by the run id it recorded, as step 3's reference is)."""
    data = ["--data_output_path", str(tmp_path / "data")]
    step1 = [*SMALL, *data, "--model_name_or_path", "tiny-llama", "--output_dir", str(tmp_path / "sft"),
             "--max_steps", "1"]
    sft.main(step1)
    common = [*SMALL, *data, "--model_name_or_path", str(tmp_path / "sft"), "--output_dir", str(tmp_path / "dpo"),
              "--max_steps", "2"]
    with monkeypatch.context() as patch:
        _interrupt_after(patch, 1)
        with pytest.raises(KeyboardInterrupt):
            dpo.main([*common, "--save_interval", "1"])
    shutil.copytree(tmp_path / "dpo", tmp_path / "dpo_copy")
    copy = [*common[:-4], "--output_dir", str(tmp_path / "dpo_copy"), "--max_steps", "2"]
    capsys.readouterr()
    dpo.main([*copy, "--resume"])  # its own reference: resumed
    assert "resumed from step 1 " in capsys.readouterr().out
    sft.main([*step1, "--seed", "7"])  # step 1 again, into the same folder
    with pytest.raises(UsageError, match=r"--resume: checkpoint step_0000001 in .*dpo/checkpoints was saved by a run "
                                         r"that started from another model than --model_name_or_path .*sft, which is "
                                         r"DPO's frozen reference"):
        dpo.main([*common, "--resume"])


def test_a_dpo_checkpoint_resumes_with_another_sft_only_data_path_which_dpo_never_reads(tmp_path, distributed,
                                                                                        monkeypatch, capsys):
    """DPO reads --data_path alone (its recipe's data phase, 2), yet its checkpoints were bound to step 1's
    --sft_only_data_path: an interrupted DPO given another one was refused by its own --resume and by train.py
    --resume's plan. Run through DPO itself (the stand-in checkpoints of the step-2 test name their phase), what its
    run records unbinds the flag in both."""
    from dschat.args import step2_dpo_parser
    from dschat.pipeline_resume import RESUME, plan_steps

    for name in ("sft", "other_sft"):
        (tmp_path / f"{name}.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    common = [*SMALL, "--data_output_path", str(tmp_path / "data"), "--model_name_or_path", "tiny-llama", "--beta",
              "0.1", "--output_dir", str(tmp_path / "step2_dpo"), "--max_steps", "2"]
    with monkeypatch.context() as patch:
        _interrupt_after(patch, 1)
        with pytest.raises(KeyboardInterrupt):
            dpo.main([*common, "--save_interval", "1", "--sft_only_data_path", str(tmp_path / "sft.jsonl")])
    other = [*common, "--sft_only_data_path", str(tmp_path / "other_sft.jsonl")]
    assert plan_steps([2], "dpo", str(tmp_path), {2: step2_dpo_parser().parse_args(other)}, world_size=1)[2] == \
        (RESUME, "it was interrupted")
    capsys.readouterr()
    dpo.main([*other, "--resume"])
    assert "resumed from step 1 " in capsys.readouterr().out


def test_a_step_resumed_after_its_input_was_trained_again_records_the_input_it_started_from(tmp_path, distributed,
                                                                                              monkeypatch):
    """A record keeps the last run's view: a step 2 interrupted, step 1 trained again into its folder, then step 2
    resumed by its own --resume (which does not refuse it: the checkpoint holds its weights) recorded the new step-1
    output's run id among its inputs, though its weights grew from the old one; train.py --resume then kept step 2 as
    made from the present step 1 (it plans such a step 2 afresh itself). A resumed run records, for a folder whose
    model changed since, the run its checkpoint started from (``input_runs``), its checkpoints too."""
    from dschat.args import step1_parser, step2_parser
    from dschat.pipeline_resume import FRESH, plan_steps
    from dschat.steps.common import finished_run_id

    data = ["--data_output_path", str(tmp_path / "data")]
    step1 = [*SMALL, *data, "--model_name_or_path", "tiny-llama", "--output_dir", str(tmp_path / "step1_sft"),
             "--max_steps", "1"]
    sft.main(step1)
    first = finished_run_id(str(tmp_path / "step1_sft"))
    step2 = [*SMALL, *data, "--model_name_or_path", str(tmp_path / "step1_sft"), "--output_dir",
             str(tmp_path / "step2_rm"), "--max_steps", "2"]
    with monkeypatch.context() as patch:
        _interrupt_after(patch, 1)
        with pytest.raises(KeyboardInterrupt):
            reward.main([*step2, "--save_interval", "1"])
    sft.main(step1)  # step 1 again, into the same folder: another run
    assert finished_run_id(str(tmp_path / "step1_sft")) != first
    reward.main([*step2, "--resume", "--save_interval", "1"])
    record = json.loads((tmp_path / "step2_rm" / "training_args.json").read_text())
    assert list(record["inputs"].values()) == [first]
    state = json.loads((tmp_path / "step2_rm" / "checkpoints" / "trainer" / "step_0000002" / "state.json").read_text())
    assert list(state["inputs"].values()) == [first]  # (a later resume of it reads the same)
    plan = plan_steps([1, 2], "ppo", str(tmp_path), {1: step1_parser().parse_args(step1),
                                                     2: step2_parser().parse_args(step2)}, world_size=1)
    assert plan[2].action == FRESH


def test_resuming_with_another_data_path_names_as_edited_only_the_files_both_runs_read(tmp_path):
    """A resume given another --data_path was refused with "--data_path ['a.jsonl'] -> ['b.jsonl']; the content of its
    data files changed since: a.jsonl, b.jsonl", as if the checkpoint's file had been edited. The files another
    --data_path reads are that flag's change; only a file both runs read, with other content now, is said edited."""
    from dschat.args import step2_dpo_parser
    from dschat.steps.resume import BOUND_WHY, FREE_FLAGS, RESTORED_FLAGS, resume_flags
    from dschat.utils.checkpoints import check_same_flags

    a, b, c = (tmp_path / f"{name}.jsonl" for name in "abc")
    for path in (a, b, c):
        path.write_text(json.dumps({"prompt": path.name, "chosen": "yes", "rejected": "no"}) + "\n")

    def refusal(*paths):
        now = resume_flags(step2_dpo_parser().parse_args(["--data_path", *map(str, paths)]))
        with pytest.raises(UsageError) as error:
            check_same_flags(saved, now, RESTORED_FLAGS, "step_0000001", "out", "step2_dpo", BOUND_WHY, FREE_FLAGS)
        return str(error.value)

    saved = resume_flags(step2_dpo_parser().parse_args(["--data_path", str(a), str(c)]))
    said = refusal(b, c)
    assert f"other settings: --data_path [{str(a)!r}, {str(c)!r}] -> [{str(b)!r}, {str(c)!r}]. Its model" in said
    c.write_text(c.read_text() * 2)
    assert f"-> [{str(b)!r}, {str(c)!r}]; the content of its data files changed since: {c}. Its" in refusal(b, c)
    assert f"other settings: the content of its data files changed since: {c}. Its" in refusal(a, c)


def test_a_checkpoint_that_fills_the_disk_is_said_in_one_line_naming_its_folder_and_the_space_left(
        tmp_path, distributed, monkeypatch, capsys):
    """torch's writer failing on a full disk (DeepSpeed's checkpoint files) raised a RuntimeError that names no cause
    ("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"), a bug's traceback; ENOSPC from any other
    write was already one line. It is one too, where the disk is found (nearly) full; elsewhere the error stays."""
    import shutil as shutil_module
    from collections import namedtuple

    from dschat.utils.cli import run_entry_point

    Usage = namedtuple("Usage", "total used free")
    free = {"bytes": 5 * 2**20}
    monkeypatch.setattr(shutil_module, "disk_usage", lambda path: Usage(2**40, 2**40 - free["bytes"], free["bytes"]))

    def full_disk(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", full_disk)
    out = tmp_path / "rm"
    flags = [*SMALL, "--data_output_path", str(tmp_path / "data"), "--output_dir", str(out), "--max_steps", "2",
             "--save_interval", "1"]
    with pytest.raises(SystemExit) as stop:
        run_entry_point(lambda: reward.main(flags))
    assert stop.value.code == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (f"error: No space left on device (5.0 MiB free): {out / 'checkpoints'} (a write failed: free some "
                    "space or write elsewhere; DSCHAT_TRACEBACK=1 shows where)"), line
    free["bytes"] = 50 * 2**30  # (the write failed for another reason: its own error)
    with pytest.raises(RuntimeError, match="unexpected pos 704 vs 598"):
        run_entry_point(lambda: reward.main(flags))


def test_a_checkpoint_that_exceeds_the_disk_quota_is_said_in_one_line_naming_its_folder(tmp_path, distributed,
                                                                                         monkeypatch, capsys):
    """torch's writer failing on a used-up quota raised its RuntimeError naming no cause, and the disk's free space
    (terabytes, say) did not show the quota: a bug's traceback. A write probe into the folder now finds the quota
    (EDQUOT, said at the sync as a network file system does), said in one line without the disk's space; a plain
    write's quota error that names no file names the checkpoints folder too. A probe that writes is removed."""
    import errno
    import shutil as shutil_module
    from collections import namedtuple

    from dschat.utils import files
    from dschat.utils.cli import run_entry_point

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil_module, "disk_usage", lambda path: Usage(2**42, 2**41, 2**41))  # (2 TiB free)

    def quota_writer(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")

    real_fsync = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".write-probe"):
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
        real_fsync(fd)

    monkeypatch.setattr(torch, "save", quota_writer)
    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "rm"
    flags = [*SMALL, "--data_output_path", str(tmp_path / "data"), "--output_dir", str(out), "--max_steps", "2",
             "--save_interval", "1"]
    said = (f"error: Disk quota exceeded: {out / 'checkpoints'} (a write failed: free some space or write elsewhere; "
            "DSCHAT_TRACEBACK=1 shows where)")
    with pytest.raises(SystemExit) as stop:
        run_entry_point(lambda: reward.main(flags))
    assert stop.value.code == 1 and capsys.readouterr().err.strip().splitlines()[-1] == said
    assert not [name for _, _, names in os.walk(tmp_path) for name in names if name.endswith(".write-probe")]

    def plain_write(*args, **kwargs):  # (a file object's write: an OSError naming no file)
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(torch, "save", plain_write)
    with pytest.raises(SystemExit):
        run_entry_point(lambda: reward.main(flags))
    assert capsys.readouterr().err.strip().splitlines()[-1] == said
    monkeypatch.setattr(os, "fsync", real_fsync)  # (a probe that writes: the writer's own error)
    monkeypatch.setattr(torch, "save", quota_writer)
    with pytest.raises(RuntimeError, match="PytorchStreamWriter failed writing file data/0"):
        run_entry_point(lambda: reward.main(flags))
    assert files.probe_write_errno(str(out / "not" / "made")) is None and not (out / "not").exists()


def test_a_resume_with_another_tokenizer_than_the_checkpoints_is_an_error_naming_both(tmp_path, distributed):
    """Steps 1 and 2 load their tokenizer from --model_name_or_path again on --resume; the folder's tokenizer replaced
    in between (same path, so the flags matched; a step output's run id is the same too) resumed silently, the data
    tokenized otherwise than the checkpoint's place in it and its embeddings were trained on. Refused, naming both."""
    from dschat.models.loading import load_tokenizer

    data = ["--data_output_path", str(tmp_path / "data")]
    base = tmp_path / "sft"
    sft.main([*SMALL, *data, "--model_name_or_path", "tiny-llama", "--output_dir", str(base), "--max_steps", "1"])
    common = [*SMALL, *data, "--model_name_or_path", str(base), "--output_dir", str(tmp_path / "rm"),
              "--max_steps", "2", "--save_interval", "1"]
    reward.main(common)
    shutil.copytree(tmp_path / "rm", tmp_path / "rm_copy")
    reward.main([*common[:-6], "--output_dir", str(tmp_path / "rm_copy"), "--max_steps", "3", "--save_interval", "1",
                 "--resume"])  # the same tokenizer: resumed
    tokenizer = load_tokenizer(str(base))
    tokenizer.eos_token = "<unk>"  # (as many tokens: the resume went on, its records ending in another token)
    tokenizer.save_pretrained(str(base))
    with pytest.raises(UsageError, match=r"--resume: checkpoint step_0000002 in .*rm/checkpoints was trained with "
                                         r"another tokenizer than --model_name_or_path .*sft holds now: 1008 tokens "
                                         r"\(bos '<\|endoftext\|>', eos '<\|endoftext\|>', .*\) then, 1008 tokens "
                                         r"\(bos '<\|endoftext\|>', eos '<unk>', .*\) now: resume with the tokenizer"):
        reward.main([*common, "--max_steps", "3", "--resume"])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool>"]})  # (DeepSpeed's "size mismatch" traceback)
    tokenizer.save_pretrained(str(base))
    with pytest.raises(UsageError, match=r"1008 tokens \(bos .*\) then, 1009 tokens \(bos .*, extra_special "
                                         r"\['<tool>'\], .*\) now"):
        reward.main([*common, "--max_steps", "3", "--resume"])


def test_fitting_a_universal_copy_on_a_full_disk_leaves_no_half_written_file_a_later_resume_takes_as_made(
        tmp_path, monkeypatch):
    """fit_universal_copy adds the model-states file of the name the new stage reads where it is missing; copied (no
    hard link: another file system) onto its own name, a full disk left it half-written, and the next resume, seeing
    it, loaded a truncated file. Written whole, a failed copy leaves nothing, and the next fitting makes it."""
    import errno

    from deepspeed.checkpoint.constants import DS_VERSION, PARAM

    from dschat.utils import checkpoints

    folder = tmp_path / "step_0000002_universal"
    (folder / "zero" / "w").mkdir(parents=True)
    torch.save({"lr_scheduler": {"step": 2}, DS_VERSION: "0.19.8"}, folder / checkpoints.MODEL_STATES)
    torch.save({DS_VERSION: "0.19.8", "param_groups": [{"lr": 1e-3}]}, folder / "zero" / "optimizer_state.pt")
    torch.save(torch.tensor(2.0), folder / "zero" / "w" / "step.pt")
    torch.save({PARAM: torch.ones(3)}, folder / "zero" / "w" / "fp32.pt")

    def no_link(source, target):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    def full_disk_copy(src, out):
        out.write(src.read(10))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoints.os, "link", no_link)
    monkeypatch.setattr(checkpoints.shutil, "copyfileobj", full_disk_copy)
    with pytest.raises(OSError, match="No space left"):
        checkpoints.fit_universal_copy(str(folder), 3)
    assert sorted(os.listdir(folder)) == [checkpoints.MODEL_STATES, "zero"]

    monkeypatch.undo()
    checkpoints.fit_universal_copy(str(folder), 3)
    fitted = torch.load(folder / checkpoints.UNIVERSAL_MODEL_STATES[3], weights_only=False)
    assert fitted == {"lr_scheduler": {"step": 2}, DS_VERSION: "0.19.8"}
    optimizer = torch.load(folder / "zero" / "optimizer_state.pt", weights_only=False)
    assert optimizer["optimizer_state_dict"]["state"][0]["step"] == 2.0


def test_fitting_into_zero_3_a_universal_copy_without_any_step_file_names_the_copy_and_what_to_do(tmp_path):
    """A ZeRO-1/2 universal copy fitted for ZeRO-3 takes Adam's step count from its parameters' step.pt; where none
    has one (a copy damaged since it was made), it failed with a bare StopIteration. A UsageError names the copy, the
    missing step.pt and how to go on, and the optimizer file is left as it was."""
    from deepspeed.checkpoint.constants import DS_VERSION, PARAM

    from dschat.utils import checkpoints

    folder = tmp_path / "step_0000002_universal"
    (folder / "zero" / "w").mkdir(parents=True)
    torch.save({"lr_scheduler": {"step": 2}, DS_VERSION: "0.19.8"}, folder / checkpoints.MODEL_STATES)
    saved_optimizer = {DS_VERSION: "0.19.8", "param_groups": [{"lr": 1e-3}]}
    torch.save(saved_optimizer, folder / "zero" / "optimizer_state.pt")
    torch.save({PARAM: torch.ones(3)}, folder / "zero" / "w" / "fp32.pt")

    with pytest.raises(UsageError, match=r"universal copy .*step_0000002_universal has no step\.pt .*remove .*"
                                         r"makes it again .*or resume at the ZeRO stage"):
        checkpoints.fit_universal_copy(str(folder), 3)
    assert torch.load(folder / "zero" / "optimizer_state.pt", weights_only=False) == saved_optimizer


@pytest.mark.parametrize("into_stage", [1, 3])
def test_fitting_a_universal_copy_without_its_model_states_names_the_copy_and_what_to_do(tmp_path, into_stage):
    """A universal copy fitted for another stage takes the model-states file it lacks (the name that stage reads) from
    the one there; where none is (a copy damaged since it was made), it failed with a bare ValueError of min()."""
    from deepspeed.checkpoint.constants import DS_VERSION

    from dschat.utils import checkpoints

    folder = tmp_path / "step_0000002_universal"
    (folder / "zero" / "w").mkdir(parents=True)
    torch.save({DS_VERSION: "0.19.8", "param_groups": [{"lr": 1e-3}]}, folder / "zero" / "optimizer_state.pt")
    with pytest.raises(UsageError, match=rf"universal copy .*step_0000002_universal has no \*{checkpoints.MODEL_STATES}"
                                         r" file .*remove .*makes it again"):
        checkpoints.fit_universal_copy(str(folder), into_stage)
    assert sorted(os.listdir(folder)) == ["zero"]


def test_a_checkpoint_is_resumed_under_the_same_data_fields_in_another_order(tmp_path, monkeypatch):
    """--resume compared --data_fields as text: the same mappings in another order (train.py's --data-fields given
    again otherwise) or another spelling of a dataset's path were 'other settings', refused, and so was --data_path
    spelt otherwise (./qa.jsonl for jsonl:qa.jsonl). Another renaming is."""
    from dschat.args import step1_parser
    from dschat.steps.resume import BOUND_WHY, FREE_FLAGS, RESTORED_FLAGS, resume_flags
    from dschat.utils.checkpoints import check_same_flags

    monkeypatch.chdir(tmp_path)
    for name in ("qa", "alpaca"):
        (tmp_path / f"{name}.jsonl").write_text('{"prompt": "Why?", "chosen": "Because."}\n')

    def flags(fields):
        return resume_flags(step1_parser().parse_args(["--data_path", "jsonl:qa.jsonl", "jsonl:alpaca.jsonl",
                                                       "--data_fields", fields]))

    saved = flags("jsonl:qa.jsonl:prompt=question,chosen=answer;jsonl:alpaca.jsonl:prompt=instruction")
    same = flags("./alpaca.jsonl:prompt=instruction; jsonl:qa.jsonl:chosen=answer,prompt=question")
    assert check_same_flags(saved, same, RESTORED_FLAGS, "step_0000001", "out", "step1", BOUND_WHY, FREE_FLAGS) == {}
    respelt = resume_flags(step1_parser().parse_args(["--data_path", "./qa.jsonl", f"{tmp_path}/alpaca.jsonl",
                                                      "--data_fields", "qa.jsonl:prompt=question,chosen=answer;"
                                                      "alpaca.jsonl:prompt=instruction"]))
    assert check_same_flags(saved, respelt, RESTORED_FLAGS, "step_0000001", "out", "step1", BOUND_WHY, FREE_FLAGS) == {}
    other = flags("jsonl:qa.jsonl:prompt=question,chosen=answer;jsonl:alpaca.jsonl:prompt=output")
    with pytest.raises(UsageError, match=r"--data_fields 'jsonl:qa.jsonl:prompt=question,chosen=answer;"
                                         r"jsonl:alpaca.jsonl:prompt=instruction' -> "):
        check_same_flags(saved, other, RESTORED_FLAGS, "step_0000001", "out", "step1", BOUND_WHY, FREE_FLAGS)


def _set_step_version(root, tag, version):
    """The step version checkpoint ``tag`` records (None: none, as a dschat before checkpoints recorded it)."""
    from dschat.steps.common import STEP_VERSION

    state_file = root / "trainer" / tag / "state.json"
    state = {key: value for key, value in json.loads(state_file.read_text()).items() if key != STEP_VERSION}
    state_file.write_text(json.dumps({**state, **({} if version is None else {STEP_VERSION: version})}))
    return state_file


def test_a_checkpoint_of_an_older_dschat_resumes_saying_so_and_a_newer_ones_is_refused(tmp_path, distributed,
                                                                                      monkeypatch, capsys):
    """A step's checkpoint recorded no step version (STEP_VERSIONS): one an older dschat saved, whose step may have
    trained otherwise, resumed unsaid, and the output recorded this dschat's version; one of a newer dschat resumed as
    well. It records the version now; an older one that a change since reaches (by the families of its models: a
    tiny preset's is known), or none, resumes with one line saying so, a newer one is an error naming its state.json,
    before the step's model loads (it came once the model had: minutes on a large one)."""
    from dschat.steps.common import STEP_VERSIONS

    common = [*SMALL, "--data_output_path", str(tmp_path / "data"), "--output_dir", str(tmp_path / "rm"),
              "--max_steps", "2"]
    reward.main([*common, "--save_interval", "2"])
    root = tmp_path / "rm" / "checkpoints"
    assert json.loads((root / "trainer" / "step_0000002" / "state.json").read_text())["step_version"] == \
        STEP_VERSIONS["step2"]
    capsys.readouterr()

    def resumed_with(version):
        _set_step_version(root, "step_0000002", version)
        reward.main([*common, "--resume"])
        out = capsys.readouterr().out
        assert "resumed from step 2 " in out
        return [line for line in out.splitlines() if "older dschat" in line or "step_version" in line]

    assert resumed_with(STEP_VERSIONS["step2"]) == []
    state_file = root / "trainer" / "step_0000002" / "state.json"
    assert resumed_with(None) == [
        f"[step2] --resume: checkpoint step_0000002 in {root} is of a dschat from before its checkpoints recorded the "
        f"step's version (no step_version in {state_file}); resumed all the same, though its step may have trained "
        "otherwise until step_0000002"]
    monkeypatch.setitem(STEP_VERSIONS, "step2", 2)
    # (version 2 changed RWKV models alone: the tiny preset's family, Llama, is known without a folder of its own)
    assert resumed_with(1) == []
    monkeypatch.setitem(STEP_VERSIONS, "step2", 3)  # (a version with no STEP_VERSION_CHANGES entry: every model's)
    assert resumed_with(2) == [
        f"[step2] --resume: checkpoint step_0000002 in {root} is an older dschat's (step_version 2 of step2, 3 now: "
        "STEP_VERSIONS in dschat/steps/common.py says what changed); resumed all the same, though its step may have "
        "trained otherwise until step_0000002"]
    models = []
    load = reward.create_critic_model
    monkeypatch.setattr(reward, "create_critic_model", lambda *a, **k: models.append(1) or load(*a, **k))
    with pytest.raises(UsageError, match=rf"{state_file} records step_version 4 of step2, which this dschat does not "
                                         r"know \(its latest is 3\): a newer dschat's checkpoint, .* train step2 "
                                         r"afresh with this one \(without --resume"):
        resumed_with(4)
    assert models == []


def test_a_step_resumed_from_an_older_dschats_checkpoint_is_skipped_by_the_next_train_py_resume(tmp_path, distributed,
                                                                                              monkeypatch, capsys):
    """train.py --resume resumed an interrupted step from a checkpoint of an older dschat (or one that recorded no step
    version), saying so, and the step's output recorded the checkpoint's version (null where it had none): the next
    train.py --resume took that finished output as an older dschat's and trained the step again, throwing away the run
    it had just resumed. Resumed once, the step is skipped like any finished output of this dschat."""
    from dschat.args import step2_parser
    from dschat.pipeline_resume import RESUME, SKIP, plan_steps
    from dschat.steps.common import STEP_VERSION, STEP_VERSIONS

    out = tmp_path / "out"
    common = [*SMALL, "--data_output_path", str(tmp_path / "data"), "--output_dir", str(out / "step2_rm"),
              "--save_interval", "2"]
    longer = [*common, "--max_steps", "4"]
    root = out / "step2_rm" / "checkpoints"

    def plan():
        flags = step2_parser().parse_args(longer)
        return plan_steps([2], "ppo", str(out), {2: flags}, rm_from_sft=False, world_size=1)[2]

    def resumed_then_planned(version):
        reward.main([*common, "--max_steps", "2"])
        (out / "step2_rm" / "metrics.json").unlink()  # (killed after its checkpoint at step 2)
        _set_step_version(root, "step_0000002", version)
        resumed = plan()
        assert resumed.action == RESUME and "resumed all the same" in resumed.why
        capsys.readouterr()
        reward.main([*longer, "--resume"])
        assert "resumed all the same" in capsys.readouterr().out
        assert json.loads((out / "step2_rm" / "training_args.json").read_text())[STEP_VERSION] == \
            STEP_VERSIONS["step2"]
        return plan()

    assert resumed_then_planned(None) == (SKIP, "")
    # a change since that reaches every output (a version with no STEP_VERSION_CHANGES entry)
    monkeypatch.setitem(STEP_VERSIONS, "step2", STEP_VERSIONS["step2"] + 1)
    assert resumed_then_planned(STEP_VERSIONS["step2"] - 1) == (SKIP, "")


def test_an_output_resumed_from_a_checkpoint_a_change_of_its_models_families_reaches_records_its_version(tmp_path):
    """The one resumed output that records its checkpoint's version (None: none): where a change since of some
    families alone reaches the models its run loads (an RWKV model's saves), which train.py --resume's plan trains
    afresh at once; a step's own --resume resumes it, saying so, and train.py --resume trains its output again."""
    from argparse import Namespace

    from dschat.steps.common import STEP_VERSION, STEP_VERSIONS, keep_resumed_inputs, recorded_step_version

    now = STEP_VERSIONS["step2"]
    model = tmp_path / "model"
    model.mkdir()

    def recorded(model_type, position):
        (model / "config.json").write_text(json.dumps({"model_type": model_type}))
        args = Namespace(model_name_or_path=str(model))
        keep_resumed_inputs(args, position)
        return recorded_step_version(args, "step2")

    assert recorded("rwkv", {STEP_VERSION: now - 1}) == now - 1
    assert recorded("rwkv", {}) is None  # (a checkpoint from before they recorded it)
    assert recorded("rwkv", {STEP_VERSION: now}) == now
    assert recorded("rwkv", None) == now  # (no resume)
    assert recorded("opt", {STEP_VERSION: now - 1}) == now
    assert recorded("opt", {}) == now


def _grpo_trainer_saving_checkpoints(tmp_path):
    """A step-3 trainer stand-in (GRPO with the tiny reward function, output in ``tmp_path``) that
    ``checkpointing.save_checkpoint`` saves: no engine, an empty model-states file, as the checks read it."""
    from types import SimpleNamespace

    from dschat.args import step3_parser
    from dschat.rlhf import algorithms
    from dschat.rlhf.config import step3_args

    args = step3_args(step3_parser().parse_args(["--output_dir", str(tmp_path), "--advantage_estimator", "grpo",
                                                 "--reward_fn", "tiny"]))

    def save_engine(folder, tag, save_latest):
        os.makedirs(os.path.join(folder, tag))
        Path(folder, tag, "mp_rank_00_model_states.pt").write_bytes(b"")

    return SimpleNamespace(args=args, actor_model=SimpleNamespace(save_checkpoint=save_engine), critic_model=None,
                           actor_ema=None, kl_ctl=algorithms.FixedKLController(0.1), generator=None)


def test_a_step3_checkpoint_saved_after_resuming_an_older_dschats_records_that_version(tmp_path):
    """Step 3 alike: a checkpoint its run saves after resuming an older dschat's (``resume_or_afresh`` keeps the
    resumed position's version) that a change of its models' families reaches (an RWKV actor) records that version,
    so a later resume and its output are judged by it; one of a family no change reaches records this dschat's."""
    from dschat.rlhf import checkpointing
    from dschat.steps.common import STEP_VERSION, STEP_VERSIONS, keep_resumed_inputs

    trainer = _grpo_trainer_saving_checkpoints(tmp_path)
    args = trainer.args
    family = tmp_path / "model"
    family.mkdir()
    (family / "config.json").write_text(json.dumps({"model_type": "rwkv"}))
    args.actor_model_name_or_path = args.critic_model_name_or_path = str(family)

    def saved_after_resuming(position, iteration):
        keep_resumed_inputs(args, position)
        checkpointing.save_checkpoint(trainer, str(tmp_path / "checkpoints"),
                                      {"iteration": iteration, "epoch": 0, "batch": iteration})
        state = tmp_path / "checkpoints" / "trainer" / f"iter_{iteration:07d}" / "state.json"
        return json.loads(state.read_text()).get(STEP_VERSION, "absent")

    now = STEP_VERSIONS["step3"]
    assert saved_after_resuming({"iteration": 2, STEP_VERSION: now - 1}, 4) == now - 1
    assert saved_after_resuming({"iteration": 2}, 6) is None  # (a checkpoint from before they recorded it)
    assert saved_after_resuming({"iteration": 2, STEP_VERSION: now}, 8) == now
    assert saved_after_resuming(None, 10) == now  # (no resume)
    (family / "config.json").write_text(json.dumps({"model_type": "opt"}))
    assert saved_after_resuming({"iteration": 2, STEP_VERSION: now - 1}, 12) == now


def test_a_step3_checkpoint_holds_an_rwkv_actors_weights_as_trained_after_it_only_generated(tmp_path):
    """An actor that only generated since it last trained (--freezing_actor_steps) holds an RWKV's weights as its
    eval-mode forwards divided them in place (transformers' ``rescale_every``): DeepSpeed's checkpoint took them so,
    and where it keeps no fp32 master copy (ZeRO-0 in fp32) a resumed run would train from them. Saved as trained."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, RwkvConfig

    from dschat.args import step3_parser
    from dschat.rlhf import algorithms, checkpointing
    from dschat.rlhf.config import step3_args

    args = step3_args(step3_parser().parse_args(["--output_dir", str(tmp_path), "--advantage_estimator", "grpo",
                                                 "--reward_fn", "tiny"]))
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_config(RwkvConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                                                        attention_hidden_size=32, intermediate_size=64,
                                                        rescale_every=1)).train()
    trained = {name: weight.clone() for name, weight in actor.state_dict().items()}
    with torch.no_grad():
        actor.eval()(input_ids=torch.randint(3, 96, (1, 4)))  # (its generation: divides block 1's weights)
    saved = {}

    def save_engine(folder, tag, save_latest):  # (what DeepSpeed's save_checkpoint reads: the module's state)
        saved.update({name: weight.clone() for name, weight in actor.state_dict().items()})
        os.makedirs(os.path.join(folder, tag))
        Path(folder, tag, "mp_rank_00_model_states.pt").write_bytes(b"")

    trainer = SimpleNamespace(args=args, actor_model=SimpleNamespace(save_checkpoint=save_engine, module=actor),
                              critic_model=None, actor_ema=None, kl_ctl=algorithms.FixedKLController(0.1),
                              generator=None)
    checkpointing.save_checkpoint(trainer, str(tmp_path / "checkpoints"), {"iteration": 1, "epoch": 0, "batch": 1})
    assert saved.keys() == trained.keys()
    assert all(torch.equal(saved[name], weight) for name, weight in trained.items())


def test_a_step3_checkpoint_of_an_older_dschat_resumes_saying_so_and_a_newer_ones_is_refused(tmp_path, monkeypatch,
                                                                                            capsys):
    """Step 3's checkpoints, as steps 1 and 2's: the step version recorded, and an older or missing one said on
    --resume (step 3's own, or a notebook's load_checkpoint), a newer one refused."""
    from dschat.rlhf import checkpointing
    from dschat.steps.common import STEP_VERSIONS

    root = tmp_path / "checkpoints"
    trainer = _grpo_trainer_saving_checkpoints(tmp_path)
    args = trainer.args
    checkpointing.save_checkpoint(trainer, str(root), {"iteration": 2, "epoch": 0, "batch": 2})
    state_file = root / "trainer" / "iter_0000002" / "state.json"
    assert json.loads(state_file.read_text())["step_version"] == STEP_VERSIONS["step3"]
    args.resume = True
    capsys.readouterr()

    def planned_with(version):
        _set_step_version(root, "iter_0000002", version)
        plan = checkpointing.plan_resume(args, str(root), _loader(40, 10))
        assert plan.tag == "iter_0000002"
        return capsys.readouterr().out

    assert planned_with(STEP_VERSIONS["step3"]) == ""
    assert planned_with(None) == (
        f"[step3] --resume: checkpoint iter_0000002 in {root} is of a dschat from before its checkpoints recorded the "
        f"step's version (no step_version in {state_file}); resumed all the same, though its step may have trained "
        "otherwise until iter_0000002\n")
    monkeypatch.setitem(STEP_VERSIONS, "step3", 2)
    assert "is an older dschat's (step_version 1 of step3, 2 now: " in planned_with(1)
    with pytest.raises(UsageError, match=rf"{state_file} records step_version 3 of step3, which this dschat does not "
                                         r"know \(its latest is 2\): a newer dschat's checkpoint"):
        planned_with(3)
