"""train.py --resume: finished steps are skipped, the interrupted one resumes, the later ones start afresh."""
import json
import os
import runpy
from argparse import Namespace

import pytest

from dschat import pipeline
from dschat.pipeline_resume import FRESH, RESUME, SKIP, plan_steps
from launch import REPO

TRAIN_PY = runpy.run_path(str(REPO / "train.py"))  # the script's functions (its __main__ block does not run)
FLAGS = Namespace(learning_rate=1e-3, seed=1, save_interval=None, resume=False)
FOLDERS = {1: "step1_sft", 2: "step2_rm", 3: "step3_ppo"}


def finish(out, step, at, **changed):
    """A step's finished output: its flags and metrics, written at time ``at``."""
    folder = out / FOLDERS[step]
    folder.mkdir(parents=True, exist_ok=True)
    flags = {**vars(FLAGS), "save_interval": 0, **changed}  # a run records the save interval it used
    (folder / "training_args.json").write_text(json.dumps({"step": f"step{step}", "flags": flags}))
    (folder / "metrics.json").write_text("{}")
    os.utime(folder / "metrics.json", (at, at))


def checkpoint(out, step, at):
    root = out / FOLDERS[step] / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    (root / "latest").write_text('{"tag": "step_0000001"}')
    os.utime(root / "latest", (at, at))


def plan(out, steps=(1, 2, 3), **flags):
    return plan_steps(list(steps), "ppo", str(out), {s: flags.get(f"step{s}", FLAGS) for s in steps})


def test_finished_steps_are_skipped_and_the_interrupted_one_resumes(tmp_path):
    finish(tmp_path, 1, 100), finish(tmp_path, 2, 200), checkpoint(tmp_path, 3, 300)
    assert plan(tmp_path) == {1: SKIP, 2: SKIP, 3: RESUME}
    finish(tmp_path, 3, 400)
    assert plan(tmp_path) == {1: SKIP, 2: SKIP, 3: SKIP}
    assert plan(tmp_path, steps=(2, 3)) == {2: SKIP, 3: SKIP}  # the first step asked for has no step before it


def test_outputs_older_than_the_step_before_them_are_an_earlier_runs(tmp_path):
    # step 1 ran again (at 500) after a whole run: step 2's output and step 3's checkpoint were made from the old one
    finish(tmp_path, 1, 500), finish(tmp_path, 2, 200), checkpoint(tmp_path, 3, 300), finish(tmp_path, 3, 400)
    assert plan(tmp_path) == {1: SKIP, 2: FRESH, 3: FRESH}
    # step 2 interrupted after its checkpoint (at 600): it resumes; step 3's older checkpoint is not resumed
    checkpoint(tmp_path, 2, 600)
    assert plan(tmp_path) == {1: SKIP, 2: RESUME, 3: FRESH}


def test_a_step_finished_with_other_flags_runs_again_and_so_do_the_later_ones(tmp_path):
    finish(tmp_path, 1, 100, learning_rate=2e-3), finish(tmp_path, 2, 200), finish(tmp_path, 3, 300)
    assert plan(tmp_path) == {1: FRESH, 2: FRESH, 3: FRESH}
    checkpoint(tmp_path, 1, 150)  # its checkpoint resumes: a changed bound flag is the step's own error
    assert plan(tmp_path) == {1: RESUME, 2: FRESH, 3: FRESH}
    # flags that do not change what a step made are not compared: the resume switches and where it logs
    resumed = Namespace(**{**vars(FLAGS), "resume": True, "save_interval": 5})
    finish(tmp_path, 1, 100)
    assert plan(tmp_path, step1=resumed) == {1: SKIP, 2: SKIP, 3: SKIP}


def test_train_py_resume_skips_finished_steps_and_resumes_the_interrupted_one(tmp_path, distributed, monkeypatch,
                                                                              capsys):
    from dschat.steps import ppo

    monkeypatch.setenv("DSCHAT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    small = ["--output-dir", str(out), "--step1-args", "--max_steps 2", "--step2-args", "--max_steps 2"]
    step3 = "--max_steps 2 --save_interval 1 --eval_prompts 8"

    def killed(*args):
        raise KeyboardInterrupt("killed")

    with monkeypatch.context() as patch:  # interrupted after step 3's first iteration and its checkpoint
        patch.setattr(ppo, "save_models", killed)
        with pytest.raises(KeyboardInterrupt):
            pipeline.run_pipeline(TRAIN_PY["parse_args"]([*small, "--step3-args",
                                                          step3 + " --enable_test_mode --test_stop_step 1"]))
    models = {step: out / folder / "model.safetensors" for step, folder in FOLDERS.items() if step < 3}
    written = {step: path.stat().st_mtime_ns for step, path in models.items()}
    capsys.readouterr()
    report = pipeline.run_pipeline(TRAIN_PY["parse_args"]([*small, "--step3-args", step3, "--resume"]))
    printed = capsys.readouterr().out
    assert f"step 1: finished earlier in {out / 'step1_sft'} with the same flags; skipped (--resume)" in printed
    assert "step 2: finished earlier" in printed and "step 3: resumes from its last checkpoint" in printed
    assert "[step3] resumed from iteration 1" in printed
    assert {step: path.stat().st_mtime_ns for step, path in models.items()} == written  # not trained again
    log = [json.loads(line) for line in (out / "step3_ppo" / "step3_log.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in log] == [1, 2]
    assert report["step3_iterations"] == 2 and report["rm_accuracy"] is not None and list(report["timings_s"]) == [
        "step3"]
    # step 1 with another flag: it trains again, and the steps after it start afresh from its new output
    args = TRAIN_PY["parse_args"]([*small[:3], "--max_steps 3", *small[4:], "--step3-args", step3, "--resume"])
    parsed = pipeline.check_step_args([1, 2, 3], args, True, {1: pipeline_parser(1), 2: pipeline_parser(2),
                                                              3: pipeline_parser(3)})
    assert pipeline.resume_plan([1, 2, 3], args, parsed) == {1: FRESH, 2: FRESH, 3: FRESH}


def pipeline_parser(step):
    from dschat import args

    return {1: args.step1_parser, 2: args.step2_parser, 3: args.step3_parser}[step]


def test_each_steps_line_says_why(tmp_path):
    from dschat.pipeline_resume import describe

    finish(tmp_path, 1, 100, learning_rate=2e-3), checkpoint(tmp_path, 3, 300)
    lines = [describe(step, plan(tmp_path), f"out/{FOLDERS[step]}") for step in (1, 3)]
    assert lines == ["step 1: starts afresh: out/step1_sft holds no output finished with these flags, nor a "
                     "checkpoint, written after the step before it",
                     "step 3: starts afresh, from the new output of the step before it"]
