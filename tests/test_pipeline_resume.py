"""train.py --resume: finished steps are skipped, the interrupted one resumes, the later ones start afresh."""
import json
import os
import re
import runpy
import shutil
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from dschat import pipeline
from dschat.errors import UsageError
from dschat.pipeline_resume import FRESH, RESUME, SKIP, plan_steps
from dschat.steps.common import STEP_VERSION, STEP_VERSIONS
from dschat.utils.checkpoints import STEP_NAME, check_same_step, latest_tag, tag_of, trainer_folder
from launch import REPO

TRAIN_PY = runpy.run_path(str(REPO / "train.py"))  # the script's functions (its __main__ block does not run)
FLAGS = Namespace(learning_rate=1e-3, max_steps=0, seed=1, save_interval=None, resume=False)
FOLDERS = {1: "step1_sft", 2: "step2_rm", 3: "step3_ppo"}


def finish(out, step, at, run_ids=None, **changed):
    """A step's finished output: its flags and metrics, written at time ``at``; ``run_ids``: (its run id, those of the
    outputs it started from) as dschat records them (None: a record from before it did, judged by file times)."""
    folder = out / FOLDERS[step]
    folder.mkdir(parents=True, exist_ok=True)
    flags = {**vars(FLAGS), "save_interval": 0, **changed}  # a run records the save interval it used
    record = {"step": f"step{step}", **this_version(step), "flags": flags}
    if run_ids is not None:
        record.update(run_id=run_ids[0], inputs={f"/somewhere/{run}": run for run in run_ids[1]})
    (folder / "training_args.json").write_text(json.dumps(record))
    (folder / "metrics.json").write_text("{}")
    os.utime(folder / "metrics.json", (at, at))


def this_version(step):
    """The step version this dschat records in a step's training_args.json."""
    return {STEP_VERSION: STEP_VERSIONS[f"step{step}"]}


def this_checkpoint(step):
    """The step name and version this dschat records in a step's checkpoint (its trainer state)."""
    return {STEP_NAME: f"step{step}", **this_version(step)}


def checkpoint(out, step, at):
    """A step's last checkpoint, saved at time ``at`` by this dschat (its state: the step's name and version)."""
    root = out / FOLDERS[step] / "checkpoints"
    tag = tag_of("iter" if step == 3 else "step", 1)
    state = Path(trainer_folder(str(root), tag)) / "state.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps(this_checkpoint(step)))
    (root / "latest").write_text(json.dumps({"tag": tag}))
    os.utime(root / "latest", (at, at))


def plan(out, steps=(1, 2, 3), rm_from_sft=True, **flags):
    decisions = plan_steps(list(steps), "ppo", str(out), {s: flags.get(f"step{s}", FLAGS) for s in steps},
                           rm_from_sft)
    return {step: decision.action for step, decision in decisions.items()}


def test_finished_steps_are_skipped_and_the_interrupted_one_resumes(tmp_path):
    finish(tmp_path, 1, 100), finish(tmp_path, 2, 200), checkpoint(tmp_path, 3, 300)
    assert plan(tmp_path) == {1: SKIP, 2: SKIP, 3: RESUME}
    finish(tmp_path, 3, 400)
    assert plan(tmp_path) == {1: SKIP, 2: SKIP, 3: SKIP}


def test_a_step_killed_while_its_save_replaced_its_folder_resumes_from_its_checkpoint(tmp_path):
    """A kill between the two renames of a model save's swap (``checkpoint.install_folder``) leaves the step's folder,
    its checkpoints in it, under a hidden name beside it: the step was planned afresh, its checkpoints unseen. The
    swap is finished first, and the step resumes."""
    finish(tmp_path, 1, 100), checkpoint(tmp_path, 2, 200)
    (tmp_path / FOLDERS[2] / "training_args.json").write_text(json.dumps({"step": "step2", "flags": vars(FLAGS)}))
    os.rename(tmp_path / FOLDERS[2], tmp_path / f".{FOLDERS[2]}.save-new")
    assert plan(tmp_path, steps=(1, 2)) == {1: SKIP, 2: RESUME}
    assert sorted(os.listdir(tmp_path)) == [FOLDERS[1], FOLDERS[2]]


def test_outputs_older_than_the_steps_they_start_from_are_an_earlier_runs(tmp_path):
    # step 1 ran again (at 500) after a whole run: step 2's output and step 3's checkpoint were made from the old one
    finish(tmp_path, 1, 500), finish(tmp_path, 2, 200), checkpoint(tmp_path, 3, 300), finish(tmp_path, 3, 400)
    assert plan(tmp_path) == {1: SKIP, 2: FRESH, 3: FRESH}
    assert plan(tmp_path, steps=(2, 3)) == {2: FRESH, 3: FRESH}  # step 1 not asked for: its output still counts
    # step 2 interrupted after its checkpoint (at 600): it resumes; step 3's older checkpoint is not resumed
    checkpoint(tmp_path, 2, 600)
    assert plan(tmp_path) == {1: SKIP, 2: RESUME, 3: FRESH}
    # a hub reward model starts from --reward-model, not from step 1: a new step 1 leaves step 2's output its own
    finish(tmp_path, 2, 200)
    (tmp_path / FOLDERS[2] / "checkpoints" / "latest").unlink()
    assert plan(tmp_path, rm_from_sft=False) == {1: SKIP, 2: SKIP, 3: FRESH}


def test_what_an_output_was_made_from_is_read_from_the_run_ids_it_recorded_not_file_times(tmp_path):
    # times scrambled (a folder copied without them): the ids still tell which output each was made from
    finish(tmp_path, 1, 500, ("a", [])), finish(tmp_path, 2, 100, ("b", ["a"]))
    finish(tmp_path, 3, 300, ("c", ["a", "b"]))
    assert plan(tmp_path) == {1: SKIP, 2: SKIP, 3: SKIP}
    # step 1 trained again (a new run id): step 2's output and step 3's were made from its old output
    finish(tmp_path, 1, 50, ("a2", []))
    assert plan(tmp_path) == {1: SKIP, 2: FRESH, 3: FRESH}
    assert plan(tmp_path, steps=(2, 3)) == {2: FRESH, 3: FRESH}
    # step 2 trained again from the new step 1 and step 3 interrupted after a checkpoint made from both: it resumes
    finish(tmp_path, 2, 60, ("b2", ["a2"]))
    (tmp_path / FOLDERS[3] / "metrics.json").unlink()
    state = tmp_path / FOLDERS[3] / "checkpoints" / "trainer" / "iter_0000001"
    state.mkdir(parents=True)
    (state / "state.json").write_text(json.dumps({**this_checkpoint(3),
                                                  "inputs": {"/x/step1_sft": "a2", "/x/step2_rm": "b2"}}))
    (tmp_path / FOLDERS[3] / "checkpoints" / "latest").write_text('{"tag": "iter_0000001"}')
    assert plan(tmp_path) == {1: SKIP, 2: SKIP, 3: RESUME}
    (state / "state.json").write_text(json.dumps({**this_checkpoint(3),
                                                  "inputs": {"/x/step1_sft": "a2", "/x/step2_rm": "b"}}))
    assert plan(tmp_path) == {1: SKIP, 2: SKIP, 3: FRESH}  # a checkpoint made from step 2's older output


def test_a_model_that_was_another_runs_output_is_compared_by_its_run_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    other = tmp_path / "other"
    finish(other, 1, 10, ("x", []))  # another run's SFT model, which this run's step 1 started from
    record = {"step": "step1", **this_version(1), "cwd": str(tmp_path / "old"), "run_id": "a",
              "inputs": {str(other / "step1_sft"): "x"},
              "flags": {**vars(FLAGS), "save_interval": 0, "model_name_or_path": str(other / "step1_sft")}}
    finish(tmp_path, 1, 100)
    (tmp_path / "step1_sft" / "training_args.json").write_text(json.dumps(record))
    same = Namespace(**{**vars(FLAGS), "model_name_or_path": "other/step1_sft"})  # (relative, from another cwd)
    assert plan_steps([1], "ppo", str(tmp_path), {1: same})[1].action == SKIP
    hub = Namespace(**{**vars(FLAGS), "model_name_or_path": "tiny-opt"})
    assert plan_steps([1], "ppo", str(tmp_path), {1: hub})[1].why.endswith("had other values of --model_name_or_path")
    finish(other, 1, 20, ("x2", []))  # that model trained again: said as such (the flag's value is the same)
    assert plan_steps([1], "ppo", str(tmp_path), {1: same})[1].why.endswith(
        "had other values of --model_name_or_path (the model in other/step1_sft was trained again since)")


def test_a_model_made_elsewhere_is_compared_by_its_files(tmp_path, monkeypatch):
    """A reward model of TRL's or OpenRLHF's (no dschat run id) replaced in its folder (retrained, downloaded again,
    its config edited) was the same model to --resume, which skipped a step that had scored with the old one."""
    from dschat.steps.common import input_runs, model_identity

    monkeypatch.chdir(tmp_path)
    external = tmp_path / "openrlhf_rm"
    external.mkdir()
    (external / "config.json").write_text('{"normalize_reward": false}')
    (external / "model.safetensors").write_bytes(b"0" * 64)
    (external / "README.md").write_text("notes")
    step = Namespace(**{**vars(FLAGS), "model_name_or_path": str(external)})
    finish(tmp_path, 1, 100)
    record = {"step": "step1", **this_version(1), "cwd": str(tmp_path), "run_id": "a", "inputs": input_runs(step),
              "flags": {**vars(FLAGS), "save_interval": 0, "model_name_or_path": str(external)}}
    assert record["inputs"] == {str(external): model_identity(str(external))}
    (tmp_path / "step1_sft" / "training_args.json").write_text(json.dumps(record))
    assert plan_steps([1], "ppo", str(tmp_path), {1: step})[1].action == SKIP
    (external / "README.md").write_text("other notes")  # not the model's files
    assert plan_steps([1], "ppo", str(tmp_path), {1: step})[1].action == SKIP
    (external / "config.json").write_text('{"normalize_reward": true}')
    assert plan_steps([1], "ppo", str(tmp_path), {1: step})[1].why.endswith(
        f"had other values of --model_name_or_path (the model files in {external} changed since: a model made "
        "outside dschat is recognised by its files' names, sizes and modification times, so a copy that does not keep "
        "the times (plain cp; cp -p keeps them) counts as another)")
    record["inputs"] = input_runs(step)  # made from the model as it is now
    (tmp_path / "step1_sft" / "training_args.json").write_text(json.dumps(record))
    assert plan_steps([1], "ppo", str(tmp_path), {1: step})[1].action == SKIP
    (external / "chat_template.jinja").write_text("{{ messages }}")  # what its data is formatted with: a new one
    assert plan_steps([1], "ppo", str(tmp_path), {1: step})[1].why.endswith(
        f"had other values of --model_name_or_path (the model files in {external} changed since: a model made "
        "outside dschat is recognised by its files' names, sizes and modification times, so a copy that does not keep "
        "the times (plain cp; cp -p keeps them) counts as another)")
    # recorded before the tokenizer files counted (by config and weights): the same model, not a change
    record["inputs"] = {str(external): model_identity(str(external), tokenizer_files=False)}
    (tmp_path / "step1_sft" / "training_args.json").write_text(json.dumps(record))
    assert plan_steps([1], "ppo", str(tmp_path), {1: step})[1].action == SKIP
    assert model_identity(str(tmp_path / "step1_sft")) == "a", "dschat's own output: its run id"


def test_a_relative_output_folder_moved_and_an_input_from_before_run_ids_keep_the_plan(tmp_path, monkeypatch):
    # step 2 recorded its model as ./output/step1_sft from /old; the run folder is now tmp_path
    finish(tmp_path, 1, 100, ("a", []))
    finish(tmp_path, 2, 50, model_name_or_path="./output/step1_sft")
    record = json.loads((tmp_path / "step2_rm" / "training_args.json").read_text())
    record.update(cwd="/old", run_id="b", inputs={"/old/output/step1_sft": "a"})
    (tmp_path / "step2_rm" / "training_args.json").write_text(json.dumps(record))
    step2 = Namespace(**{**vars(FLAGS), "model_name_or_path": str(tmp_path / "step1_sft")})
    assert plan_steps([1, 2], "ppo", str(tmp_path), {1: FLAGS, 2: step2}) == {1: (SKIP, ""), 2: (SKIP, "")}
    # step 1 finished before dschat recorded run ids: step 2 (which recorded none of it) is judged by file times
    finish(tmp_path, 1, 30)
    record.update(inputs={}, cwd=str(tmp_path))  # (not moved)
    record["flags"]["model_name_or_path"] = str(tmp_path / "step1_sft")
    (tmp_path / "step2_rm" / "training_args.json").write_text(json.dumps(record))
    assert plan_steps([1, 2], "ppo", str(tmp_path), {1: FLAGS, 2: step2})[2].action == SKIP
    finish(tmp_path, 1, 60)
    assert plan_steps([1, 2], "ppo", str(tmp_path), {1: FLAGS, 2: step2})[2].action == FRESH
    # a record that is not JSON is an error naming it (not a step trained again)
    (tmp_path / "step2_rm" / "training_args.json").write_text("{cut")
    with pytest.raises(UsageError, match=r"step2_rm/training_args.json is not JSON"):
        plan_steps([2], "ppo", str(tmp_path), {2: step2})


def test_a_step_finished_with_other_flags_runs_again_and_so_do_the_later_ones(tmp_path):
    finish(tmp_path, 1, 100, learning_rate=2e-3), finish(tmp_path, 2, 200), finish(tmp_path, 3, 300)
    assert plan(tmp_path) == {1: FRESH, 2: FRESH, 3: FRESH}
    # the finished run's own checkpoint is not resumed with another learning rate, whatever its time (a folder copied
    # without its files' times)...
    checkpoint(tmp_path, 1, 150)
    assert plan(tmp_path) == {1: FRESH, 2: FRESH, 3: FRESH}
    # ...but is to train on for longer
    finish(tmp_path, 1, 100, max_steps=4)
    longer = Namespace(**{**vars(FLAGS), "max_steps": 8})
    assert plan(tmp_path, step1=longer) == {1: RESUME, 2: FRESH, 3: FRESH}
    assert plan_steps([1], "ppo", str(tmp_path), {1: longer})[1].why == \
        "to train on past its finished output (--max_steps)"
    shutil.rmtree(tmp_path / FOLDERS[1] / "checkpoints")  # none to train on from: said, not only the flag
    assert plan_steps([1], "ppo", str(tmp_path), {1: longer})[1].why.endswith(
        "had other values of --max_steps, and it saved no checkpoint to train on from (--save_interval)")
    shorter = Namespace(**{**vars(FLAGS), "max_steps": 2})  # (no checkpoint would make a shorter run continue)
    assert plan_steps([1], "ppo", str(tmp_path), {1: shorter})[1].why.endswith("had other values of --max_steps")
    checkpoint(tmp_path, 1, 150)
    # a shorter run does not resume the longer run's checkpoint (past its new end: the step refused it)
    assert plan_steps([1], "ppo", str(tmp_path), {1: shorter})[1] == (
        FRESH, f"its finished output in {tmp_path / FOLDERS[1]} had other values of --max_steps")
    # no finished output (a run that trains removes it): a later run of the step, interrupted
    (tmp_path / FOLDERS[1] / "metrics.json").unlink()
    assert plan(tmp_path) == {1: RESUME, 2: FRESH, 3: FRESH}
    # flags that do not change what a step made are not compared: the resume switches and where it logs
    resumed = Namespace(**{**vars(FLAGS), "resume": True, "save_interval": 5})
    finish(tmp_path, 1, 175)
    assert plan(tmp_path, step1=resumed) == {1: SKIP, 2: SKIP, 3: SKIP}


def test_a_step_finished_by_an_older_dschat_runs_again_and_a_newer_ones_output_is_refused(tmp_path, monkeypatch):
    """A step's finished output was skipped by its flags alone, whichever dschat made it: a step 2 finished before its
    loss subtracted each pair's margin (FORMAT_VERSION 45) was kept as this dschat's. Its training_args.json records
    the step's version now (STEP_VERSIONS): one older, or none, trains the step again, saying why; a newer one is an
    error naming the file."""
    finish(tmp_path, 1, 100), finish(tmp_path, 2, 200, max_steps=4), finish(tmp_path, 3, 300)
    checkpoint(tmp_path, 2, 150)
    longer = Namespace(**{**vars(FLAGS), "max_steps": 8})
    assert plan(tmp_path, step2=Namespace(**{**vars(FLAGS), "max_steps": 4})) == {1: SKIP, 2: SKIP, 3: SKIP}
    record_file = tmp_path / FOLDERS[2] / "training_args.json"
    record = json.loads(record_file.read_text())

    def step_2_with(version, null=False):
        """(None: no version recorded, as before outputs did; ``null``: null, as one resumed from such a checkpoint)"""
        recorded = {STEP_VERSION: version} if version is not None or null else {}
        record_file.write_text(json.dumps({**record, **recorded}))
        return plan_steps([1, 2, 3], "ppo", str(tmp_path), {1: FLAGS, 2: longer, 3: FLAGS})

    then = STEP_VERSIONS["step2"]
    assert {step: decision.action for step, decision in step_2_with(then).items()} == {1: SKIP, 2: RESUME, 3: FRESH}
    del record[STEP_VERSION]  # (written by a dschat from before steps recorded it)
    decisions = step_2_with(None)
    # (not trained on from its checkpoint: of that dschat too)
    assert decisions[2] == (FRESH, f"its finished output in {tmp_path / FOLDERS[2]} is of a dschat from before its "
                                   f"outputs recorded the step's version (no step_version in {record_file}), which may "
                                   "have trained it otherwise")
    assert decisions[3] == (FRESH, "it starts from step 2's new output")
    # (null: an output resumed from such a checkpoint, ``recorded_step_version``, says so, not "no step_version")
    assert step_2_with(None, null=True)[2] == (FRESH, f"its finished output in {tmp_path / FOLDERS[2]} is one resumed "
                                                      "from a checkpoint of a dschat from before checkpoints recorded "
                                                      f"the step's version (step_version null in {record_file}), which "
                                                      "may have trained it otherwise")
    # a change of what step 2 makes (no STEP_VERSION_CHANGES entry: every output), since step 2 finished under ``then``
    monkeypatch.setitem(STEP_VERSIONS, "step2", then + 1)
    assert step_2_with(then)[2] == (FRESH, f"its finished output in {tmp_path / FOLDERS[2]} is an older dschat's "
                                           f"(step_version {then} of step2, {then + 1} now: STEP_VERSIONS in "
                                           "dschat/steps/common.py says what changed), which may have trained it "
                                           "otherwise")
    assert step_2_with(then + 1)[2].action == RESUME
    for newer in (then + 2, str(then + 1)):
        with pytest.raises(UsageError, match=rf"{record_file} records step_version {newer!r} of step2, which this "
                                             rf"dschat does not know \(its latest is {then + 1}\): .* train step 2 "
                                             r"afresh with this one \(--step 2 3 without --resume\)"):
            step_2_with(newer)


def test_an_output_recording_a_null_step_version_is_kept_where_no_change_reaches_its_models(tmp_path, monkeypatch,
                                                                                             capsys):
    """A run resumed from a checkpoint that recorded no step version records "step_version": null where a change of
    some families alone reaches its models, and did whatever its models from d99bfd7 to 50b0eb5: train.py --resume
    trained every such output again, though since 50b0eb5 the same resume records this dschat's version and is kept.
    A null output is judged by that rule, from the families of the models it saved: an OPT one is kept (unsaid, as
    this dschat's), an RWKV one, or one whose families cannot be read, trains again; so does one that a change since
    the version that recorded null reaches."""
    finish(tmp_path, 1, 100), finish(tmp_path, 2, 200), finish(tmp_path, 3, 300)
    folder = tmp_path / FOLDERS[2]
    record_file = folder / "training_args.json"
    record_file.write_text(json.dumps({**json.loads(record_file.read_text()), STEP_VERSION: None}))

    def step_2_of(model_type):
        if model_type is not None:
            (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
        return plan_steps([1, 2, 3], "ppo", str(tmp_path), {1: FLAGS, 2: FLAGS, 3: FLAGS})[2]

    stale = (FRESH, f"its finished output in {folder} is one resumed from a checkpoint of a dschat from before "
                    f"checkpoints recorded the step's version (step_version null in {record_file}), which may have "
                    "trained it otherwise")
    assert step_2_of(None) == stale  # (no config.json: its family unknown)
    assert step_2_of("opt") == (SKIP, "")
    pipeline.say_an_older_dschats_output(3, 2, str(folder), "2 3")  # (train.py --step 3 reads it as this dschat's)
    assert "note:" not in capsys.readouterr().out
    assert step_2_of("rwkv") == stale  # (step 2's version 2 changed how RWKV models train)
    monkeypatch.setitem(STEP_VERSIONS, "step2", STEP_VERSIONS["step2"] + 1)  # (a change of every output since)
    assert step_2_of("opt") == stale


def test_an_interrupted_steps_checkpoint_of_another_dschat_is_said_or_refused_by_the_plan(tmp_path, monkeypatch):
    """train.py --resume planned "resumes from its last checkpoint" whatever dschat saved it: the step said an older
    dschat's, and refused a newer one's (or another step's), only when it started, after the steps before it had run
    (hours). The plan reads the checkpoint's state as the step does: an older dschat's (an older step version, or none)
    resumes, its line saying so; a newer one's is refused before any step runs, with how to train it afresh."""
    finish(tmp_path, 1, 100), finish(tmp_path, 2, 200, max_steps=4), checkpoint(tmp_path, 2, 150)
    checkpoint(tmp_path, 3, 300)
    root = tmp_path / FOLDERS[3] / "checkpoints"
    state_file = Path(trainer_folder(str(root), "iter_0000001")) / "state.json"
    same, longer = (Namespace(**{**vars(FLAGS), "max_steps": steps}) for steps in (4, 8))  # (longer: trained on)

    def step_3_with(version, step2=same, null=False):
        """(None: no version recorded, as before checkpoints did; ``null``: null, as one saved after resuming such)"""
        recorded = {STEP_VERSION: version} if version is not None or null else {}
        state_file.write_text(json.dumps({STEP_NAME: "step3", **recorded}))
        return plan_steps([1, 2, 3], "ppo", str(tmp_path), {1: FLAGS, 2: step2, 3: FLAGS})

    assert step_3_with(STEP_VERSIONS["step3"])[3] == (RESUME, "it was interrupted")
    assert step_3_with(None)[3] == (RESUME, f"it was interrupted; checkpoint iter_0000001 in {root} is of a dschat "
                                            "from before its checkpoints recorded the step's version (no step_version "
                                            f"in {state_file}); resumed all the same, though its step may have trained "
                                            "otherwise until iter_0000001")
    assert step_3_with(None, null=True)[3] == (
        RESUME, f"it was interrupted; checkpoint iter_0000001 in {root} is one resumed from a checkpoint of a dschat "
                f"from before checkpoints recorded the step's version (step_version null in {state_file}); resumed all "
                "the same, though its step may have trained otherwise until iter_0000001")
    monkeypatch.setitem(STEP_VERSIONS, "step3", 2)
    assert "it was interrupted; checkpoint iter_0000001 in " in step_3_with(1)[3].why
    assert "is an older dschat's (step_version 1 of step3, 2 now: STEP_VERSIONS in " in step_3_with(1)[3].why
    with pytest.raises(UsageError, match=rf"^{state_file} records step_version 3 of step3, which this dschat does not "
                                         r"know \(its latest is 2\): a newer dschat's checkpoint, whose step this one "
                                         r"may train otherwise\. Resume it with that dschat, or train step 3 afresh "
                                         r"with this one \(--step 3 without --resume\)$"):
        step_3_with(3)
    # a finished step trained on from its checkpoint, which a newer dschat saved (its output this dschat's)
    step_2_state = Path(trainer_folder(str(tmp_path / FOLDERS[2] / "checkpoints"), "step_0000001")) / "state.json"
    step_2_state.write_text(json.dumps({**this_checkpoint(2), STEP_VERSION: 99}))
    with pytest.raises(UsageError, match=r"step_version 99 of step2, .* \(--step 2 3 without --resume\)$"):
        step_3_with(2, step2=longer)
    # another step's checkpoint in the folder: refused as the step refuses it, with advice train.py's user can follow
    # (a step script's "give step3 its own --output_dir" named a flag train.py sets itself)
    state_file.write_text(json.dumps({**this_checkpoint(1)}))
    with pytest.raises(UsageError, match=r"\(iter_0000001\) was saved by step1, not step3: train.py keeps only step "
                                         r"3's checkpoints there \(another run given that folder, or a copy\?\); to "
                                         rf"keep these, move {re.escape(str(root))} out of train.py's --output-dir "
                                         r"before the next --resume\n\(train.py --resume resumes step 3: .*give --step "
                                         r"3 without --resume, which removes the checkpoints in step 3's folder\)$"):
        plan_steps([3], "ppo", str(tmp_path), {3: FLAGS})
    # (a step script's own --resume keeps its advice: its user gives it its --output_dir)
    with pytest.raises(UsageError, match=r"was saved by step1, not step3: give step3 its own --output_dir, or start "
                                         r"afresh there without --resume \(which removes step1's checkpoints\)$"):
        check_same_step(str(root), "iter_0000001", "step3")
    # the DPO recipe's step 2 records itself as step2_dpo
    dpo_root = tmp_path / "step2_dpo" / "checkpoints"
    (dpo_root / "trainer" / "step_0000001").mkdir(parents=True)
    (dpo_root / "trainer" / "step_0000001" / "state.json").write_text(
        json.dumps({STEP_NAME: "step2_dpo", STEP_VERSION: STEP_VERSIONS["step2_dpo"]}))
    (dpo_root / "latest").write_text('{"tag": "step_0000001"}')
    assert plan_steps([2], "dpo", str(tmp_path), {2: FLAGS})[2] == (RESUME, "it was interrupted")


def test_another_steps_checkpoint_in_a_folder_the_plan_starts_afresh_is_refused_not_removed_unnamed(tmp_path):
    """Another step's checkpoint in a step's folder was refused where the plan resumed the step, but where it started
    the step afresh (the checkpoint not made from the present outputs, or a step before it trained again) the plan
    said only "starts afresh" and the step removed them as "an earlier run's checkpoints". Refused alike before any
    step runs, naming them, why the step starts afresh and how to keep them or let them go; the step's own stale
    checkpoint still starts afresh."""
    finish(tmp_path, 1, 100), finish(tmp_path, 2, 200), checkpoint(tmp_path, 3, 150)  # (saved before step 2 finished)
    root = tmp_path / FOLDERS[3] / "checkpoints"
    state_file = Path(trainer_folder(str(root), "iter_0000001")) / "state.json"
    assert plan(tmp_path) == {1: SKIP, 2: SKIP, 3: FRESH}, "its own stale checkpoint: afresh (the step removes it)"
    state_file.write_text(json.dumps(this_checkpoint(1)))
    refusal = (rf"^--resume: the last checkpoint in {re.escape(str(root))} \(iter_0000001\) was saved by step1, not "
               r"step3: train.py keeps only step 3's checkpoints there \(another run given that folder, or a copy\?\); "
               rf"to keep these, move {re.escape(str(root))} out of train.py's --output-dir before the next --resume, "
               r"or remove it to let them go: train.py --resume starts step 3 afresh \({}\), which removes the "
               r"checkpoints in its folder$")
    with pytest.raises(UsageError, match=refusal.format(re.escape(f"{tmp_path / FOLDERS[3]} holds no finished output "
                                                                  "nor checkpoint made from the present outputs of "
                                                                  "steps 1, 2"))):
        plan(tmp_path)
    with pytest.raises(UsageError, match=refusal.format("it starts from step 2's new output")):
        plan(tmp_path, step2=Namespace(**{**vars(FLAGS), "seed": 2}))
    assert (root / "latest").is_file(), "nothing removed"
    shutil.move(str(root), str(tmp_path / "kept"))
    assert plan(tmp_path) == {1: SKIP, 2: SKIP, 3: FRESH}


def test_a_checkpoint_without_its_latest_pointer_is_said_once_by_the_plan(tmp_path, capsys):
    """A step's folder holding one complete checkpoint and no latest pointer (its save killed before it published):
    the plan starts the step afresh, saying the checkpoint is not resumed from. Its check for another step's
    checkpoint (``another_steps_checkpoint``) looked the pointer up again: the line was printed twice."""
    finish(tmp_path, 1, 100), finish(tmp_path, 2, 200), checkpoint(tmp_path, 3, 300)
    (tmp_path / FOLDERS[3] / "checkpoints" / "latest").unlink()
    capsys.readouterr()
    assert plan(tmp_path) == {1: SKIP, 2: SKIP, 3: FRESH}
    assert capsys.readouterr().out.count("but no latest pointer") == 1


def test_an_older_dschats_checkpoint_trains_afresh_where_a_change_reaches_its_models_families(tmp_path):
    """train.py --resume resumed an older dschat's interrupted checkpoint whatever change since reached it (no folder:
    the families of its models unknown), with a note: an RWKV step 2 resumed from one of version 1 finished as an
    output of version 1 (``recorded_step_version``), which the next --resume trains again (the run wasted), and an OPT
    one, which no change since reaches, got the note too. The families are read from the models the step loads (its
    --model_name_or_path's config.json): a change reaching them trains the step afresh at once, saying why; one that
    reaches none resumes unsaid; unknown families resume with the note, as before."""
    finish(tmp_path, 1, 100), checkpoint(tmp_path, 2, 150)
    state_file = Path(trainer_folder(str(tmp_path / FOLDERS[2] / "checkpoints"), "step_0000001")) / "state.json"
    state_file.write_text(json.dumps({**this_checkpoint(2), STEP_VERSION: STEP_VERSIONS["step2"] - 1}))
    model = tmp_path / "model"
    model.mkdir()

    def step_2_of(model_type):
        if model_type is not None:
            (model / "config.json").write_text(json.dumps({"model_type": model_type}))
        flags = Namespace(**{**vars(FLAGS), "model_name_or_path": str(model)})
        return plan_steps([1, 2, 3], "ppo", str(tmp_path), {1: FLAGS, 2: flags, 3: FLAGS})[2]

    before = STEP_VERSIONS["step2"] - 1
    assert step_2_of(None).why.startswith("it was interrupted; checkpoint step_0000001 in ")  # (no config: unknown)
    assert "is an older dschat's" in step_2_of(None).why
    assert step_2_of("opt") == (RESUME, "it was interrupted")
    assert step_2_of("rwkv") == (FRESH, f"its last checkpoint in {tmp_path / FOLDERS[2] / 'checkpoints'} is an older "
                                        f"dschat's (step_version {before} of step2, {before + 1} now), whose step "
                                        f"version {before + 1} changed how models of rwkv train: resumed, its output "
                                        "would train again at the next --resume")
    # one that recorded no version (before checkpoints did): every change since reached it, the RWKV one too
    state_file.write_text(json.dumps({key: value for key, value in this_checkpoint(2).items() if key != STEP_VERSION}))
    assert step_2_of("opt").action == RESUME  # (with the note: a change of every family's since reached it)
    assert step_2_of("rwkv") == (FRESH, f"its last checkpoint in {tmp_path / FOLDERS[2] / 'checkpoints'} is an older "
                                        f"dschat's (no step_version of step2, {before + 1} now), whose step version "
                                        f"{before + 1} changed how models of rwkv train: resumed, its output would "
                                        "train again at the next --resume")
    state_file.write_text(json.dumps({**this_checkpoint(2), STEP_VERSION: before}))
    # the step's own --resume says the same of it (its run's models: ``loaded_model_types``)
    from dschat.steps.common import loaded_model_types
    from dschat.utils.checkpoints import older_dschats_checkpoint

    root = str(tmp_path / FOLDERS[2] / "checkpoints")
    assert loaded_model_types(Namespace(model_name_or_path=str(model))) == frozenset({"rwkv"})
    assert older_dschats_checkpoint(root, "step_0000001", "step2", families=frozenset({"rwkv"})) is not None
    assert older_dschats_checkpoint(root, "step_0000001", "step2", families=frozenset({"opt"})) is None
    assert older_dschats_checkpoint(root, "step_0000001", "step2") is not None  # (unknown)


def test_a_tiny_presets_family_is_known_so_an_older_checkpoint_no_change_reaches_resumes_unsaid(tmp_path,
                                                                                                 monkeypatch):
    """A tiny preset (dschat's CPU default, "tiny-opt") has no config.json to read where the step names it: the
    families of a step that loads one were unknown, so an older dschat's checkpoint that no change since reaches (step
    2's RWKV-only change, an OPT model) resumed with the note that its step "may have trained otherwise", where the
    same model in a folder resumes unsaid. A preset's family is its config's; a folder of that name wins, as it does
    when the model loads (``resolve_model_path``)."""
    from dschat.steps.common import loaded_model_types
    from dschat.utils.checkpoints import older_dschats_checkpoint

    finish(tmp_path, 1, 100), checkpoint(tmp_path, 2, 150)
    root = str(tmp_path / FOLDERS[2] / "checkpoints")
    state_file = Path(trainer_folder(root, "step_0000001")) / "state.json"
    state_file.write_text(json.dumps({**this_checkpoint(2), STEP_VERSION: STEP_VERSIONS["step2"] - 1}))
    flags = Namespace(**{**vars(FLAGS), "model_name_or_path": "tiny-opt"})

    assert loaded_model_types(flags) == frozenset({"opt"})
    assert loaded_model_types(Namespace(model_name_or_path="dschat/tiny-llama")) == frozenset({"llama"})
    assert plan_steps([1, 2, 3], "ppo", str(tmp_path), {1: FLAGS, 2: flags, 3: FLAGS})[2] == \
        (RESUME, "it was interrupted")
    assert older_dschats_checkpoint(root, "step_0000001", "step2", families=loaded_model_types(flags)) is None
    monkeypatch.chdir(tmp_path)  # (a folder named as a preset is the model the step loads)
    (tmp_path / "tiny-opt").mkdir()
    (tmp_path / "tiny-opt" / "config.json").write_text(json.dumps({"model_type": "rwkv"}))
    assert loaded_model_types(flags) == frozenset({"rwkv"})


def test_an_older_step3_checkpoint_trains_afresh_where_a_change_reaches_one_of_its_models(tmp_path):
    """Step 3 alike: its actor's family, its critic's (with GAE) and its reward model's; a change of flags the
    checkpoint's state cannot tell (version 2's, --enable_ema) still resumes it with the note."""
    finish(tmp_path, 1, 100), finish(tmp_path, 2, 200), checkpoint(tmp_path, 3, 300)
    state_file = Path(trainer_folder(str(tmp_path / FOLDERS[3] / "checkpoints"), "iter_0000001")) / "state.json"
    models = {}
    for part in ("actor", "critic", "rm"):
        models[part] = tmp_path / part
        models[part].mkdir()

    def step_3_of(version, actor, critic, rm):
        state_file.write_text(json.dumps({**this_checkpoint(3), STEP_VERSION: version}))
        for part, model_type in (("actor", actor), ("critic", critic), ("rm", rm)):
            (models[part] / "config.json").write_text(json.dumps({"model_type": model_type}))
        flags = Namespace(**{**vars(FLAGS), "actor_model_name_or_path": str(models["actor"]),
                             "critic_model_name_or_path": str(models["critic"]), "advantage_estimator": "gae",
                             "reward_model_name_or_path": str(models["rm"]), "reward_model_weight": 1.0})
        return plan_steps([1, 2, 3], "ppo", str(tmp_path), {1: FLAGS, 2: FLAGS, 3: flags})[3]

    now = STEP_VERSIONS["step3"]
    assert step_3_of(now - 1, "llama", "llama", "opt") == (RESUME, "it was interrupted")
    for reached in (("xlstm", "llama", "llama"), ("llama", "rwkv", "llama"), ("llama", "llama", "rwkv")):
        assert step_3_of(now - 1, *reached).action == FRESH
    assert "is an older dschat's" in step_3_of(now - 2, "llama", "llama", "llama").why  # (version 2: flags)
    assert step_3_of(now - 2, "rwkv", "llama", "llama").action == FRESH


def test_a_newer_dschats_output_given_other_flags_trains_afresh_instead_of_being_refused(tmp_path):
    """A newer dschat's finished output is refused where --resume would keep it (skip it, or train on from its
    checkpoint); given other flags the step trains afresh anyway, replacing it, as it did before steps recorded their
    version: the refusal ("Resume with that dschat, or train step 2 afresh") stopped a run that keeps nothing of it."""
    finish(tmp_path, 1, 100), finish(tmp_path, 2, 200, max_steps=4), finish(tmp_path, 3, 300)
    checkpoint(tmp_path, 2, 150)
    record_file = tmp_path / FOLDERS[2] / "training_args.json"
    record_file.write_text(json.dumps({**json.loads(record_file.read_text()), STEP_VERSION: 99}))
    other_rate = Namespace(**{**vars(FLAGS), "max_steps": 4, "learning_rate": 5e-4})
    decisions = plan_steps([1, 2, 3], "ppo", str(tmp_path), {1: FLAGS, 2: other_rate, 3: FLAGS})
    assert decisions[2].action == FRESH and "other values of --learning_rate" in decisions[2].why
    for kept in (Namespace(**{**vars(FLAGS), "max_steps": 4}), Namespace(**{**vars(FLAGS), "max_steps": 8})):
        with pytest.raises(UsageError, match="step_version 99 of step2, which this dschat does not know"):
            plan_steps([1, 2, 3], "ppo", str(tmp_path), {1: FLAGS, 2: kept, 3: FLAGS})  # (skipped; trained on)


def test_a_step_asked_to_read_an_older_dschats_output_uses_it_saying_so_and_refuses_a_newer_ones(tmp_path, monkeypatch,
                                                                                                   capsys):
    """train.py --step 2 3 (no --resume) reads step 1's finished output as asked, whichever dschat made it: one of an
    older dschat (an older step version, or none) was used unsaid, though its step may have trained otherwise, and
    one of a newer dschat too, which --resume refuses (``older_step_output``). The first is used with a line saying
    so; the second is the same error, naming the file."""
    finish(tmp_path, 1, 100)
    (tmp_path / FOLDERS[1] / "config.json").write_text("{}")
    record_file = tmp_path / FOLDERS[1] / "training_args.json"
    record = json.loads(record_file.read_text())
    args = Namespace(output_dir=str(tmp_path), recipe="ppo")
    step2 = Namespace(model_name_or_path=str(tmp_path / FOLDERS[1]))

    def step_2_reads(version):
        """(None: no version recorded, as before outputs did)"""
        recorded = {} if version is None else {STEP_VERSION: version}
        record_file.write_text(json.dumps({**record, **recorded}))
        pipeline.check_earlier_outputs(2, [2, 3], args, step2)
        return capsys.readouterr().out

    then = STEP_VERSIONS["step1"]
    assert step_2_reads(then) == ""  # (this dschat's)
    del record[STEP_VERSION]
    assert step_2_reads(None) == (f"note: step 2 reads {tmp_path / FOLDERS[1]}, step 1's output, as asked: it is of a "
                                  f"dschat from before its outputs recorded the step's version (no step_version in "
                                  f"{record_file}), which may have trained it otherwise (--step 1 2 3 trains step 1 "
                                  "again with this dschat)\n")
    monkeypatch.setitem(STEP_VERSIONS, "step1", then + 1)  # (no STEP_VERSION_CHANGES entry: reaches every output)
    assert f"as asked: it is an older dschat's (step_version {then} of step1, {then + 1} now: STEP_VERSIONS in " in \
        step_2_reads(then)
    assert step_2_reads(then + 1) == ""
    with pytest.raises(UsageError, match=rf"{record_file} records step_version {then + 2} of step1, which this dschat "
                                         rf"does not know \(its latest is {then + 1}\): a newer dschat's output, .* Run "
                                         r"step 2 with that dschat, or train step 1 again with this one \(--step 1 2 "
                                         r"3\)"):
        step_2_reads(then + 2)


def test_batch_flags_set_for_another_number_of_ranks_with_the_same_batches_keep_the_plan(tmp_path):
    """A finished step of 2 ranks, planned again on 1 with its batch flags set to keep an optimizer step's samples
    (step 3: an iteration's prompts and an optimizer step's rows), ran again from the start: "had other values of
    --per_device_train_batch_size"; and a longer run of it could not train on from its checkpoint."""
    batches = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "max_steps": 4}
    step3 = {"per_device_generation_batch_size": 4, "generation_batches": 2, "per_device_training_batch_size": 4,
             "gradient_accumulation_steps": 1}
    finish(tmp_path, 1, 100, **batches), finish(tmp_path, 3, 300, **step3)
    for step in (1, 3):
        record = tmp_path / FOLDERS[step] / "training_args.json"
        record.write_text(json.dumps({**json.loads(record.read_text()), "world_size": 2}))

    def decide(step, world_size, **changed):
        flags = Namespace(**{**vars(FLAGS), **(batches if step == 1 else step3), **changed})
        return plan_steps([step], "ppo", str(tmp_path), {step: flags}, world_size=world_size)[step]

    assert decide(1, 1, per_device_train_batch_size=16) == (SKIP, "")
    assert decide(1, 1, gradient_accumulation_steps=2) == (SKIP, "")
    assert decide(1, 4, per_device_train_batch_size=4) == (SKIP, "")
    assert decide(1, 1) == (SKIP, "")  # (the same flags: as before, whatever the ranks)
    for world_size, micro in ((1, 4), (2, 16)):  # other samples a step; or other flags on the run's own ranks
        assert decide(1, world_size, per_device_train_batch_size=micro)[1].endswith(
            "had other values of --per_device_train_batch_size")
    checkpoint(tmp_path, 1, 150)
    assert decide(1, 1, per_device_train_batch_size=16, max_steps=8) == (
        RESUME, "to train on past its finished output (--max_steps)")
    assert decide(3, 1, per_device_generation_batch_size=8, per_device_training_batch_size=8) == (SKIP, "")
    assert decide(3, 1, generation_batches=4, gradient_accumulation_steps=2) == (SKIP, "")
    assert decide(3, 1, per_device_generation_batch_size=8)[1].endswith(  # (an optimizer step's rows halved)
        "had other values of --per_device_generation_batch_size")


def test_a_step_whose_data_files_were_edited_since_runs_again(tmp_path):
    """train.py --resume skipped a step whose data file was rewritten since (same flags), keeping the model trained on
    the old records."""
    from dschat.steps.common import step_data_files

    data = tmp_path / "mine.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    flags = Namespace(**{**vars(FLAGS), "data_path": [f"jsonl:{data}"]})
    finish(tmp_path, 1, 100, data_path=flags.data_path)
    record = json.loads((tmp_path / FOLDERS[1] / "training_args.json").read_text())
    record["data_files"] = step_data_files(Namespace(data_path=flags.data_path))  # (a run takes them once: a copy)
    (tmp_path / FOLDERS[1] / "training_args.json").write_text(json.dumps(record))
    assert plan(tmp_path, steps=(1,), step1=Namespace(**vars(flags))) == {1: SKIP}
    os.utime(data, (1, 1))  # only its times: the same data
    assert plan(tmp_path, steps=(1,), step1=Namespace(**vars(flags))) == {1: SKIP}
    data.write_text('{"prompt": "a", "chosen": "other", "rejected": "c"}\n')
    decision = plan_steps([1], "ppo", str(tmp_path), {1: Namespace(**vars(flags))})[1]
    assert decision.action == FRESH and decision.why.startswith("the content of its data files changed since its "
                                                                "finished output")
    assert str(data) in decision.why
    other = Namespace(**{**vars(flags), "data_path": [f"jsonl:{tmp_path / 'other.jsonl'}"]})  # another file: a flag
    assert plan_steps([1], "ppo", str(tmp_path), {1: other})[1].why.endswith("had other values of --data_path")


def test_another_sft_only_data_path_retrains_step_1_alone(tmp_path):
    """--sft_only_data_path is read by step 1 alone, yet steps 2, DPO and 3 listed its files among their data and kept
    the flag compared: a resume that changed only it trained step 2 (and 3) again. Their records now list the files of
    the flags they read (DATA_FILES_FLAGS), and the plan leaves the flag aside for them, saying so; step 1 and an older
    dschat's record of step 2 (its files listed) compare it as before."""
    from dschat.steps.common import step_data_records, take_data_files

    def data(name):
        path = tmp_path / f"{name}.jsonl"
        path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
        return [f"jsonl:{path}"]

    flags = Namespace(**{**vars(FLAGS), "data_path": data("pairs"), "sft_only_data_path": data("sft")})
    for step, at in ((1, 100), (2, 200)):
        finish(tmp_path, step, at, data_path=flags.data_path, sft_only_data_path=flags.sft_only_data_path)
        ran = Namespace(**vars(flags))
        take_data_files(ran, step)  # (what the step records, as it read its data)
        record_file = tmp_path / FOLDERS[step] / "training_args.json"
        record_file.write_text(json.dumps({**json.loads(record_file.read_text()), **step_data_records(ran)}))
    other = Namespace(**{**vars(flags), "sft_only_data_path": data("other_sft")})

    def decide(step, now):
        return plan_steps([step], "ppo", str(tmp_path), {step: Namespace(**vars(now))})[step]

    assert decide(2, flags) == (SKIP, "")
    skipped = decide(2, other)
    assert skipped.action == SKIP and "--sft_only_data_path" in skipped.why and \
        skipped.why.endswith("read only with step 1)")
    assert decide(1, other) == (FRESH, f"its finished output in {tmp_path / FOLDERS[1]} had other values of "
                                       "--sft_only_data_path")
    # an older dschat's record of step 2, which listed step 1's files too: compared as before, not taken as edited
    record_file = tmp_path / FOLDERS[2] / "training_args.json"
    record = json.loads(record_file.read_text())
    del record["data_files_flags"]
    record["data_files"] = json.loads((tmp_path / FOLDERS[1] / "training_args.json").read_text())["data_files"]
    record_file.write_text(json.dumps(record))
    assert decide(2, flags) == (SKIP, "")
    assert decide(2, other).why.endswith("had other values of --sft_only_data_path")


def test_an_older_record_that_gave_no_sft_only_data_path_keeps_its_step_skipped_under_one_now(tmp_path):
    """An older dschat's record of step 2 (no DATA_FILES_FLAGS) kept --sft_only_data_path compared, as it listed step
    1's files among its data: one that gave none (its value empty) listed none of them, yet step 2 given one now
    trained again once, for a flag it never reads, its data taken as changed. Such a record is as today's now: the
    flag left aside, saying so; step 1's older record still trains again, and so does step 2's that gave one."""
    from dschat.steps.common import step_data_records, take_data_files

    def data(name):
        path = tmp_path / f"{name}.jsonl"
        path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
        return [f"jsonl:{path}"]

    def older_record(step, **sft_only):
        """The finished output of ``step`` as a dschat from before DATA_FILES_FLAGS records it: every flag's files."""
        finish(tmp_path, step, 100 * step, data_path=then.data_path, **sft_only)
        ran = Namespace(**{**vars(then), **sft_only})
        take_data_files(ran)  # (both flags' files, whatever the step)
        record_file = tmp_path / FOLDERS[step] / "training_args.json"
        record = {**json.loads(record_file.read_text()), **step_data_records(ran)}
        del record["data_files_flags"]
        record_file.write_text(json.dumps(record))

    then = Namespace(**{**vars(FLAGS), "data_path": data("pairs"), "sft_only_data_path": []})
    now = Namespace(**{**vars(then), "sft_only_data_path": data("sft")})

    def decide(step):
        return plan_steps([step], "ppo", str(tmp_path), {step: Namespace(**vars(now))})[step]

    older_record(2, sft_only_data_path=[])
    assert decide(2) == (SKIP, "its output does not depend on flags it read in neither run (--sft_only_data_path [] "
                               f"-> {now.sft_only_data_path}: read only with step 1)")
    older_record(1, sft_only_data_path=[])
    assert decide(1).why.endswith("had other values of --sft_only_data_path")
    older_record(2, sft_only_data_path=data("other_sft"))
    assert decide(2).why.endswith("had other values of --sft_only_data_path")


def test_a_step_whose_hub_dataset_has_another_revision_since_runs_again(tmp_path, monkeypatch):
    """train.py --resume compared a finished step's local data files only: one trained on a hub dataset of which the
    HF cache now holds another revision was skipped, keeping the model trained on the old records."""
    from datasets import Dataset, DatasetDict

    from dschat.data import DahoasRmstaticDataset
    from dschat.data.pipeline import hub_data_fingerprint

    def revision(answer):
        rows = [{"prompt": f"\n\nHuman: Hi {i}.\n\nAssistant:", "response": answer, "chosen": answer,
                 "rejected": " No."} for i in range(4)]
        return DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:2])})

    flags = Namespace(**{**vars(FLAGS), "data_path": ["Dahoas/rm-static"], "data_output_path": str(tmp_path / "data")})
    finish(tmp_path, 1, 100, data_path=flags.data_path, data_output_path=flags.data_output_path)
    record = json.loads((tmp_path / FOLDERS[1] / "training_args.json").read_text())
    record.update(data_files=[], hub_data={"Dahoas/rm-static": hub_data_fingerprint(revision(" Hello."))})
    (tmp_path / FOLDERS[1] / "training_args.json").write_text(json.dumps(record))
    hub = {"now": revision(" Hello.")}
    monkeypatch.setattr(DahoasRmstaticDataset, "load", lambda self: hub["now"])
    assert plan(tmp_path, steps=(1,), step1=Namespace(**vars(flags))) == {1: SKIP}
    hub["now"] = revision(" Hello again.")
    decision = plan_steps([1], "ppo", str(tmp_path), {1: Namespace(**vars(flags))})[1]
    assert decision.action == FRESH and decision.why.endswith(
        "Dahoas/rm-static (another revision in the HF datasets cache)"), decision.why

    def offline(self):
        raise ConnectionError("no network and not in the HF cache")

    monkeypatch.setattr(DahoasRmstaticDataset, "load", offline)  # not readable here: left to the step's own check
    assert plan(tmp_path, steps=(1,), step1=Namespace(**vars(flags))) == {1: SKIP}


def test_a_step3_whose_unsupervised_data_was_edited_since_runs_again(tmp_path):
    """train.py --resume compared step 3's prompt data only: a finished step 3 whose --unsupervised_dataset_name file
    was edited since was skipped, keeping the actor trained on the old text."""
    from dschat.data.unsupervised import unsupervised_data_record

    text = tmp_path / "docs.txt"
    text.write_text("one document\n")
    flags = Namespace(**{**vars(FLAGS), "unsupervised_dataset_name": str(text)})
    finish(tmp_path, 1, 100), finish(tmp_path, 2, 200)
    finish(tmp_path, 3, 300, unsupervised_dataset_name=str(text))
    record = json.loads((tmp_path / FOLDERS[3] / "training_args.json").read_text())
    record.update(data_files=[], unsupervised_data=unsupervised_data_record(str(text)))
    (tmp_path / FOLDERS[3] / "training_args.json").write_text(json.dumps(record))
    assert plan(tmp_path, step3=flags) == {1: SKIP, 2: SKIP, 3: SKIP}
    text.write_text("one edited document\n")
    decision = plan_steps([1, 2, 3], "ppo", str(tmp_path), {1: FLAGS, 2: FLAGS, 3: flags})[3]
    assert decision.action == FRESH and decision.why.endswith(f"finished output in {tmp_path / FOLDERS[3]}: {text}")
    text.unlink()  # not readable here: left to the step's own check (its error names the file)
    assert plan(tmp_path, step3=flags)[3] == SKIP


def test_paths_are_compared_as_the_folders_they_name_and_a_moved_run_folder_keeps_its_plan(tmp_path, monkeypatch):
    (tmp_path / "models" / "base").mkdir(parents=True)
    out = tmp_path / "out"
    finish(out, 1, 100, ("a", []), model_name_or_path="models/base", output_dir="out/step1_sft")
    record = json.loads((out / "step1_sft" / "training_args.json").read_text())
    (out / "step1_sft" / "training_args.json").write_text(json.dumps({**record, "cwd": str(tmp_path)}))
    monkeypatch.chdir(out)  # another working directory: the same folders
    given = Namespace(**{**vars(FLAGS), "model_name_or_path": str(tmp_path / "models" / "base"),
                         "output_dir": str(out / "step1_sft")})
    assert plan_steps([1], "ppo", str(out), {1: given})[1].action == SKIP
    other = Namespace(**{**vars(given), "model_name_or_path": "tiny-opt"})
    assert plan_steps([1], "ppo", str(out), {1: other})[1] == (FRESH, f"its finished output in {out / 'step1_sft'} "
                                                                      "had other values of --model_name_or_path")
    # the run folder moved: step 2 was made from step 1's output (by its run id), wherever that is now
    finish(out, 2, 50, ("b", ["a"]), model_name_or_path="/somewhere/a", output_dir="/old/out/step2_rm")
    step2 = Namespace(**{**vars(FLAGS), "model_name_or_path": str(out / "step1_sft"), "output_dir": "x"})
    assert plan_steps([1, 2], "ppo", str(out), {1: given, 2: step2}) == {1: (SKIP, ""), 2: (SKIP, "")}


def test_a_tensorboard_path_moved_with_the_run_folder_is_no_change(tmp_path, monkeypatch):
    """train.py --resume of a run folder moved whole said in every finished step's line "its output does not depend on
    what it logs and how it evaluates (--tensorboard_path /old/out/tensorboard -> ...)": train.py puts it beside the
    step's folder, and its user gave none. The same place beside the step's --output_dir is no change; another place
    is said as before."""
    out = tmp_path / "moved"
    finish(out, 1, 100, output_dir="/old/out/step1_sft", tensorboard_path="/old/out/tensorboard")
    now = Namespace(**{**vars(FLAGS), "output_dir": str(out / "step1_sft"),
                       "tensorboard_path": str(out / "tensorboard")})
    assert plan_steps([1], "ppo", str(out), {1: now})[1] == (SKIP, "")
    elsewhere = Namespace(**{**vars(now), "tensorboard_path": str(tmp_path / "tb")})
    assert plan_steps([1], "ppo", str(out), {1: elsewhere})[1] == (
        SKIP, "its output does not depend on what it logs and how it evaluates (--tensorboard_path "
              f"/old/out/tensorboard -> {tmp_path / 'tb'}: its metrics.json is the finished run's evaluation)")
    # relative paths, from the working directory each run had (train.py's default --output-dir ./output)
    finish(out, 1, 100, output_dir="output/step1_sft", tensorboard_path="output/tensorboard")
    record = json.loads((out / FOLDERS[1] / "training_args.json").read_text())
    (out / FOLDERS[1] / "training_args.json").write_text(json.dumps({**record, "cwd": "/old"}))
    monkeypatch.chdir(tmp_path)
    relative = Namespace(**{**vars(FLAGS), "output_dir": "moved/step1_sft", "tensorboard_path": "moved/tensorboard"})
    assert plan_steps([1], "ppo", str(out), {1: relative})[1] == (SKIP, "")


def test_a_tensorboard_path_outside_the_run_folder_that_keeps_its_shape_is_still_a_change(tmp_path):
    """A --tensorboard_path a user gave outside the run folder (--step1-args "--tensorboard_path /data/alice/tb",
    the run in /data/alice/run) does not move with it: moved to /data/bob/run and given /data/bob/tb, the finished
    step's curves stay in /data/alice/tb, a change its line says, though both lie "../../tb" from the step's folder."""
    out = tmp_path / "bob" / "run"
    finish(out, 1, 100, output_dir="/data/alice/run/step1_sft", tensorboard_path="/data/alice/tb")
    now = Namespace(**{**vars(FLAGS), "output_dir": str(out / "step1_sft"), "tensorboard_path": str(tmp_path / "bob"
                                                                                                     / "tb")})
    assert plan_steps([1], "ppo", str(out), {1: now})[1] == (
        SKIP, "its output does not depend on what it logs and how it evaluates (--tensorboard_path /data/alice/tb -> "
              f"{tmp_path / 'bob' / 'tb'}: its metrics.json is the finished run's evaluation)")
    # (the run folder itself, beside the step's folder, moves with it)
    finish(out, 1, 100, output_dir="/data/alice/run/step1_sft", tensorboard_path="/data/alice/run")
    assert plan_steps([1], "ppo", str(out), {1: Namespace(**{**vars(now), "tensorboard_path": str(out)})})[1] == \
        (SKIP, "")


def test_a_step3_resumed_after_its_run_folder_moved_and_step_2_trained_again_records_the_critic_it_started_from(
        tmp_path):
    """A step 3 interrupted, its run folder moved (or copied), step 2 trained again there, then step 3 resumed by its own --resume
    (its critic and reward model are not bound to the checkpoint) recorded step 2's folder under both run ids: the
    old one at the old path, the new one at the new path, as a model new to the run. train.py --resume then kept step 3
    as made from the present step 2, which it trains again where the folder did not move (``keep_resumed_inputs``).
    The moved folder is recorded once, at its path now, under the run the checkpoint started from."""
    from dschat.steps.common import input_runs, keep_resumed_inputs

    def resumed_in(run_folder, moved_from=None):
        finish(run_folder, 1, 100, ("a", [])), finish(run_folder, 2, 200, ("b", ["a"]))
        started = {str((moved_from or run_folder) / FOLDERS[step]): run for step, run in ((1, "a"), (2, "b"))}
        finish(run_folder, 2, 300, ("b2", ["a"]))  # trained again, in its folder now
        args = Namespace(**{**vars(FLAGS), "actor_model_name_or_path": str(run_folder / FOLDERS[1]),
                            "critic_model_name_or_path": str(run_folder / FOLDERS[2]),
                            "reward_model_name_or_path": None, "advantage_estimator": "gae",
                            "reward_model_weight": 1.0})
        keep_resumed_inputs(args, {"iteration": 1, "inputs": started})
        inputs = input_runs(args)
        finish(run_folder, 3, 400, ("c", []))
        record = json.loads((run_folder / FOLDERS[3] / "training_args.json").read_text())
        (run_folder / FOLDERS[3] / "training_args.json").write_text(json.dumps({**record, "inputs": inputs}))
        return inputs, plan_steps([1, 2, 3], "ppo", str(run_folder), {1: FLAGS, 2: FLAGS, 3: FLAGS})[3].action

    stayed = tmp_path / "stayed"
    assert resumed_in(stayed) == ({str(stayed / FOLDERS[1]): "a", str(stayed / FOLDERS[2]): "b"}, FRESH)
    moved = tmp_path / "moved"
    assert resumed_in(moved, moved_from=tmp_path / "gone") == (
        {str(moved / FOLDERS[1]): "a", str(moved / FOLDERS[2]): "b"}, FRESH)
    copied = tmp_path / "copied"  # (from the run folder that stayed, whose step 2 is its own)
    assert resumed_in(copied, moved_from=stayed) == ({str(copied / FOLDERS[1]): "a", str(copied / FOLDERS[2]): "b"},
                                                     FRESH)


def test_a_step3_whose_actor_is_outside_its_moved_run_folder_records_step_2_once_under_the_run_it_started_from(
        tmp_path):
    """As above, with step 3's actor given as a folder outside the run folder (--actor_model_name_or_path in
    --step3-args): no other model of the run folder tells where it moved, so step 2's folder was recorded under both
    run ids, the old one at the old path and the new one at the new path, and train.py --resume skipped step 3 as made
    from the present step 2. Step 3's own output folder tells: a step folder loaded beside it now, whose model is
    another than the checkpoint's run loaded from the folder of that name, is recorded once, under the run the
    checkpoint started from."""
    from dschat.steps.common import input_runs, keep_resumed_inputs

    finish(tmp_path / "models", 1, 100, ("a", []))
    actor = tmp_path / "models" / "sft"
    os.rename(tmp_path / "models" / FOLDERS[1], actor)

    def resumed_in(run_folder, moved_from=None):
        finish(run_folder, 2, 200, ("b", ["a"]))
        started = {str(actor): "a", str((moved_from or run_folder) / FOLDERS[2]): "b"}
        finish(run_folder, 2, 300, ("b2", ["a"]))  # trained again, in its folder now
        args = Namespace(**{**vars(FLAGS), "actor_model_name_or_path": str(actor),
                            "critic_model_name_or_path": str(run_folder / FOLDERS[2]),
                            "reward_model_name_or_path": None, "advantage_estimator": "gae",
                            "reward_model_weight": 1.0, "output_dir": str(run_folder / FOLDERS[3])})
        keep_resumed_inputs(args, {"iteration": 1, "inputs": started})
        inputs = input_runs(args)
        finish(run_folder, 3, 400, ("c", []))
        record = json.loads((run_folder / FOLDERS[3] / "training_args.json").read_text())
        (run_folder / FOLDERS[3] / "training_args.json").write_text(json.dumps({**record, "inputs": inputs}))
        return inputs, plan_steps([2, 3], "ppo", str(run_folder), {2: FLAGS, 3: FLAGS})[3].action

    stayed = tmp_path / "stayed"
    assert resumed_in(stayed) == ({str(actor): "a", str(stayed / FOLDERS[2]): "b"}, FRESH)
    moved = tmp_path / "moved"
    assert resumed_in(moved, moved_from=tmp_path / "gone") == ({str(actor): "a", str(moved / FOLDERS[2]): "b"}, FRESH)
    copied = tmp_path / "copied"  # (from the run folder that stayed, whose step 2 is its own)
    assert resumed_in(copied, moved_from=stayed) == ({str(actor): "a", str(copied / FOLDERS[2]): "b"}, FRESH)


def test_train_py_resume_skips_finished_steps_and_resumes_the_interrupted_one(tmp_path, distributed, monkeypatch,
                                                                              capsys):
    from dschat.steps import ppo

    monkeypatch.setenv("DSCHAT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    small = ["--output-dir", str(out), "--step1-args", "--max_steps 2", "--step2-args", "--max_steps 2"]
    step3 = "--max_steps 2 --save_interval 1 --eval_prompts 8"

    def killed(*args):
        raise KeyboardInterrupt("killed")

    (out / "step3_ppo").mkdir(parents=True)
    (out / "step3_ppo" / "metrics.json").write_text("{}")  # an earlier run's, finished
    with monkeypatch.context() as patch:  # interrupted after step 3's first iteration and its checkpoint
        patch.setattr(ppo, "save_models", killed)
        with pytest.raises(KeyboardInterrupt):
            pipeline.run_pipeline(TRAIN_PY["parse_args"]([*small, "--step3-args",
                                                          step3 + " --enable_test_mode --test_stop_step 1"]))
    assert not (out / "step3_ppo" / "metrics.json").exists()  # the interrupted run's output is not finished
    records = {step: json.loads((out / folder / "training_args.json").read_text()) for step, folder in FOLDERS.items()
               if step < 3}
    assert records[2]["inputs"] == {str(out / "step1_sft"): records[1]["run_id"]}  # what step 2 was made from
    models = {step: out / folder / "model.safetensors" for step, folder in FOLDERS.items() if step < 3}
    written = {step: path.stat().st_mtime_ns for step, path in models.items()}
    # a bound flag changed for the step being resumed: how to start it afresh and keep the steps before it
    with pytest.raises(UsageError, match=r"(?s)saved with other settings: --seed 1234 -> 7.*\(train.py --resume "
                                         r"resumes step 3: to train it afresh and keep the steps before it, give "
                                         r"--step 3 without --resume, which removes the checkpoints in step 3's "
                                         r"folder\)"):
        pipeline.run_pipeline(TRAIN_PY["parse_args"]([*small, "--step3-args", step3 + " --seed 7", "--resume"]))
    capsys.readouterr()
    report = pipeline.run_pipeline(TRAIN_PY["parse_args"]([*small, "--step3-args", step3, "--resume"]))
    printed = capsys.readouterr().out
    assert f"step 1: finished earlier in {out / 'step1_sft'} with the same flags; skipped (--resume)" in printed
    assert "step 2: finished earlier" in printed and "step 3: resumes from its last checkpoint" in printed
    assert "holds no earlier run" not in printed
    assert "[step3] resumed from iteration 1" in printed
    assert {step: path.stat().st_mtime_ns for step, path in models.items()} == written  # not trained again
    log = [json.loads(line) for line in (out / "step3_ppo" / "step3_log.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in log] == [1, 2]
    assert report["step3_iterations"] == 2 and report["rm_accuracy"] is not None
    assert list(report["timings_s"]) == ["step3"] and report["skipped"] == ["step1", "step2"]
    assert report["resumed"] == ["step3"]  # its seconds: the step's own clock, over the interrupted run too
    assert report["timings_s"]["step3"] == json.loads((out / "step3_ppo" / "metrics.json").read_text())["seconds"]
    assert "step1: finished earlier, skipped (--resume)" in printed
    assert "step3: " in printed and "s (resumed: the earlier run's time up to its checkpoint included)" in printed
    # step 1 with another flag: it trains again, and the steps after it start afresh from its new output
    parsers = {step: pipeline_parser(step) for step in (1, 2, 3)}
    args = TRAIN_PY["parse_args"]([*small[:3], "--max_steps 2 --learning_rate 1e-3", *small[4:], "--step3-args", step3,
                                   "--resume"])
    decisions = pipeline.resume_plan([1, 2, 3], args, pipeline.check_step_args([1, 2, 3], args, True, parsers), True)
    assert {step: decision.action for step, decision in decisions.items()} == {1: FRESH, 2: FRESH, 3: FRESH}
    assert "step 1: starts afresh: its finished output in" in capsys.readouterr().out  # said
    # an output folder with no earlier run in it (a mistyped one?) is said
    args = TRAIN_PY["parse_args"](["--output-dir", str(tmp_path / "typo"), "--resume"])
    pipeline.resume_plan([1, 2, 3], args, pipeline.check_step_args([1, 2, 3], args, True, parsers), True)
    assert f"train.py --resume: {tmp_path / 'typo'} holds no earlier run's steps; every step starts afresh" in \
        capsys.readouterr().out
    # a --resume of a step's own beside train.py's: the plan decides
    args = TRAIN_PY["parse_args"]([*small, "--step3-args", step3 + " --resume", "--resume"])
    with pytest.raises(UsageError, match="train.py --resume decides which step resumes: leave --resume out of "
                                         "--step3-args"):
        pipeline.run_pipeline(args)


def pipeline_parser(step):
    from dschat import args

    return {1: args.step1_parser, 2: args.step2_parser, 3: args.step3_parser}[step]


def test_each_steps_line_says_why(tmp_path):
    from dschat.pipeline_resume import describe

    finish(tmp_path, 1, 100, learning_rate=2e-3), checkpoint(tmp_path, 3, 300)
    decisions = plan_steps([1, 2, 3], "ppo", str(tmp_path), {1: FLAGS, 2: FLAGS, 3: FLAGS})
    lines = [describe(step, decisions[step], f"out/{FOLDERS[step]}") for step in (1, 3)]
    assert lines == [f"step 1: starts afresh: its finished output in {tmp_path / 'step1_sft'} had other values of "
                     "--learning_rate", "step 3: starts afresh: it starts from step 2's new output"]
    assert plan_steps([2], "ppo", str(tmp_path), {2: FLAGS})[2] == (FRESH, f"{tmp_path / 'step2_rm'} does not exist yet")
    (tmp_path / "step2_rm").mkdir()
    assert plan_steps([2], "ppo", str(tmp_path), {2: FLAGS})[2] == (
        FRESH, f"{tmp_path / 'step2_rm'} holds no finished output nor checkpoint made from the present output of "
               "step 1")
    assert plan_steps([1], "ppo", str(tmp_path / "new"), {1: FLAGS})[1] == (
        FRESH, f"{tmp_path / 'new' / 'step1_sft'} does not exist yet")
    assert plan_steps([3], "ppo", str(tmp_path / "new"), {3: FLAGS})[3] == (
        FRESH, f"{tmp_path / 'new' / 'step3_ppo'} does not exist yet"), "not 'holds no ... made from step 1's output'"
    (tmp_path / "new" / "step1_sft").mkdir(parents=True)
    assert plan_steps([1], "ppo", str(tmp_path / "new"), {1: FLAGS})[1] == (
        FRESH, f"{tmp_path / 'new' / 'step1_sft'} holds no finished output nor checkpoint")
    assert describe(3, plan_steps([3], "ppo", str(tmp_path), {3: FLAGS})[3], "out/step3_ppo") == \
        "step 3: resumes from its last checkpoint in out/step3_ppo/checkpoints (--resume): it was interrupted"


def test_a_reward_function_file_edited_since_a_finished_output_reruns_its_step(tmp_path, monkeypatch):
    """--resume skipped step 3 after an edit of its --reward_fn file, and the report kept the old function's scores
    (the flag's value, the file's name, was the same)."""
    from dschat.steps.common import write_results

    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards.py").write_text("def score(prompts, answers):\n    return [0.0 for _ in answers]\n")
    step = Namespace(**{**vars(FLAGS), "reward_fn": "rewards.py:score"})
    write_results(Namespace(**vars(step), output_dir=str(tmp_path / FOLDERS[3])), {}, "step3")
    assert plan_steps([3], "ppo", str(tmp_path), {3: step})[3].action == SKIP
    os.utime(tmp_path / "rewards.py")  # touched, not edited
    assert plan_steps([3], "ppo", str(tmp_path), {3: step})[3].action == SKIP
    (tmp_path / "rewards.py").write_text("def score(prompts, answers):\n    return [0.5 for _ in answers]\n")
    decision = plan_steps([3], "ppo", str(tmp_path), {3: step})[3]
    assert decision.action == FRESH and decision.why.endswith(
        f"had other values of --reward_fn (its file {tmp_path / 'rewards.py'} changed since)")


def test_a_reward_function_module_edited_since_a_finished_output_reruns_its_step(tmp_path, monkeypatch):
    """A --reward_fn given as package.module:function (found on the import path) was not tracked: an edit of its
    module left --resume skipping step 3 with the old function's scores."""
    from dschat.steps.common import write_results

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "myrewards").mkdir()
    (tmp_path / "myrewards" / "__init__.py").write_text("")
    module = tmp_path / "myrewards" / "scoring.py"
    module.write_text("def score(prompts, answers):\n    return [0.0 for _ in answers]\n")
    step = Namespace(**{**vars(FLAGS), "reward_fn": "myrewards.scoring:score"})
    write_results(Namespace(**vars(step), output_dir=str(tmp_path / FOLDERS[3])), {}, "step3")
    assert plan_steps([3], "ppo", str(tmp_path), {3: step})[3].action == SKIP
    module.write_text("def score(prompts, answers):\n    return [0.5 for _ in answers]\n")
    decision = plan_steps([3], "ppo", str(tmp_path), {3: step})[3]
    assert decision.action == FRESH and decision.why.endswith(
        f"had other values of --reward_fn (its file {module} changed since)")


def test_a_step_killed_while_writing_its_results_does_not_look_finished(tmp_path, monkeypatch):
    """metrics.json (the finished mark) was written before training_args.json: a kill between them left the new model
    marked finished under the earlier run's flags and run id, and --resume skipped every step."""
    from dschat.steps import common

    out = tmp_path / FOLDERS[3]
    common.write_results(Namespace(**vars(FLAGS), output_dir=str(out)), {}, "step3")
    common.clear_results(Namespace(output_dir=str(out)), "step3", resumed=False)  # the rerun starts

    write = common.write_json_atomic

    def killed_at_the_flags(path, *args, **kwargs):
        if path.endswith(common.RUN_ARGS_FILE):
            raise KeyboardInterrupt(path)
        return write(path, *args, **kwargs)

    monkeypatch.setattr(common, "write_json_atomic", killed_at_the_flags)
    changed = Namespace(**{**vars(FLAGS), "learning_rate": 1.0})
    with pytest.raises(KeyboardInterrupt):
        common.write_results(Namespace(**vars(changed), output_dir=str(out)), {}, "step3")
    assert not (out / "metrics.json").exists()
    assert plan_steps([3], "ppo", str(tmp_path), {3: changed})[3].action != SKIP


def test_a_step_resume_skipped_leaves_the_later_steps_outputs_reported(tmp_path, distributed, monkeypatch, capsys):
    """train.py --step 1 --resume after a full run skipped step 1, and the report still said the step-2 and step-3
    folders were "made from an older output of a step run now" and named the SFT model as the policy; after step 1
    ran again with other flags, a resume that skips it leaves them not reported (what they were made from decides)."""
    monkeypatch.setenv("DSCHAT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    small = ["--output-dir", str(out), "--step", "1", "--step1-args", "--max_steps 1 --eval_iters 1"]
    pipeline.run_pipeline(TRAIN_PY["parse_args"](small))
    for folder, metrics in (("step2_rm", {"accuracy": 0.9, "chosen_mean_score": 1.0, "rejected_mean_score": -1.0}),
                            ("step3_ppo", {"iterations": 4})):  # a full run's
        (out / folder).mkdir()
        (out / folder / "metrics.json").write_text(json.dumps(metrics))
    (out / "step3_ppo" / "actor").mkdir()
    (out / "step3_ppo" / "actor" / "config.json").write_text("{}")
    report = pipeline.run_pipeline(TRAIN_PY["parse_args"]([*small, "--resume"]))
    assert report["skipped"] == ["step1"] and report["not_reported"] == []
    assert report["rm_accuracy"] == 0.9 and report["policy"] == "step3_ppo/actor"
    assert "not reported" not in capsys.readouterr().out
    # step 1 trained again with other flags, then skipped by a resume: the later folders stay an older output's
    again = ["--output-dir", str(out), "--step", "1", "--step1-args", "--max_steps 2 --eval_iters 1"]
    assert pipeline.run_pipeline(TRAIN_PY["parse_args"](again))["not_reported"] == ["step2_rm", "step3_ppo"]
    report = pipeline.run_pipeline(TRAIN_PY["parse_args"]([*again, "--resume"]))
    assert report["skipped"] == ["step1"] and report["not_reported"] == ["step2_rm", "step3_ppo"]
    assert report["rm_accuracy"] is None and report["policy"] == "step1_sft"
    (out / "step3_ppo" / "metrics.json").unlink()  # an interrupted step 3: nothing of it to report, nor to leave out
    assert pipeline.run_pipeline(TRAIN_PY["parse_args"]([*again, "--resume"]))["not_reported"] == ["step2_rm"]


def test_a_step3_that_recorded_grpo_norm_by_std_as_1_or_0_keeps_its_plan_under_the_named_scopes(tmp_path):
    """--grpo_norm_by_std took 1/0 before its batch scope; a finished step 3 that recorded 1 is today's group (the
    same run), not a changed flag that trains step 3 again from the start; 0 is none, so it differs from group."""
    finish(tmp_path, 3, 300, grpo_norm_by_std=1)

    def decide(scope):
        flags = Namespace(**{**vars(FLAGS), "grpo_norm_by_std": scope})
        return plan_steps([3], "ppo", str(tmp_path), {3: flags})[3]

    assert decide("group") == (SKIP, "")
    assert decide("none")[1].endswith("had other values of --grpo_norm_by_std")
    finish(tmp_path, 3, 300, grpo_norm_by_std=0)
    assert decide("none") == (SKIP, "")
    assert decide("batch")[1].endswith("had other values of --grpo_norm_by_std")


def test_a_step_finished_at_another_zero_stage_is_skipped_and_says_so(tmp_path):
    """train.py --resume with another ZeRO stage (a run that ran out of memory, resumed at a higher stage) trained
    every finished step again from the start: "had other values of --zero_stage", though a stage changes where the
    states live, not the model a step makes. It is skipped now, saying the stages, and a longer run trains on from
    the finished run's checkpoint at the new stage (the step's --resume converts it)."""
    from dschat.pipeline_resume import describe

    finish(tmp_path, 1, 100, zero_stage=2, max_steps=4), finish(tmp_path, 2, 200, zero_stage=2)
    finish(tmp_path, 3, 300, actor_zero_stage=2, critic_zero_stage=2)
    checkpoint(tmp_path, 1, 150)
    staged = {1: Namespace(**{**vars(FLAGS), "zero_stage": 3, "max_steps": 4}),
              2: Namespace(**{**vars(FLAGS), "zero_stage": 3}),
              3: Namespace(**{**vars(FLAGS), "actor_zero_stage": 3, "critic_zero_stage": 2})}
    decisions = plan_steps([1, 2, 3], "ppo", str(tmp_path), staged)
    assert {step: d.action for step, d in decisions.items()} == {1: SKIP, 2: SKIP, 3: SKIP}
    assert describe(3, decisions[3], "out/step3_ppo") == (
        "step 3: finished earlier in out/step3_ppo; skipped (--resume): its output does not depend on the ZeRO stage "
        "(--actor_zero_stage 2 -> 3)")
    assert decisions[1].why == "its output does not depend on the ZeRO stage (--zero_stage 2 -> 3)"
    longer = Namespace(**{**vars(staged[1]), "max_steps": 8})
    assert plan_steps([1], "ppo", str(tmp_path), {1: longer})[1] == (
        RESUME, "to train on past its finished output (--max_steps)")
    # another stage with another flag that does change the model: the step runs again, for that flag only
    other = Namespace(**{**vars(staged[1]), "learning_rate": 2e-3})
    assert plan_steps([1], "ppo", str(tmp_path), {1: other})[1].why.endswith("had other values of --learning_rate")
    # an interrupted step given another stage resumes from its checkpoint (its --resume converts the states)
    (tmp_path / FOLDERS[1] / "metrics.json").unlink()
    assert plan_steps([1], "ppo", str(tmp_path), staged)[1] == (RESUME, "it was interrupted")


def killed_after_the_first_checkpoint(monkeypatch, argv):
    """train.py with ``argv``, killed (KeyboardInterrupt) just after a step saved its first checkpoint."""
    from dschat.steps import resume

    real = resume.save_step_checkpoint

    def killed_after_the_first(engine, args, position, *rest):
        real(engine, args, position, *rest)
        raise KeyboardInterrupt("killed")

    with monkeypatch.context() as patch:
        patch.setattr(resume, "save_step_checkpoint", killed_after_the_first)
        with pytest.raises(KeyboardInterrupt):
            pipeline.run_pipeline(argv)


def test_train_py_resume_of_a_run_folder_moved_whole_resumes_its_interrupted_step_2(tmp_path, distributed,
                                                                                     monkeypatch, capsys):
    """An interrupted step 2 (or DPO) resumed only in its old place: its checkpoint stored --model_name_or_path, step
    1's output, by its path, and train.py --resume of the moved run folder was refused for "--model_name_or_path
    '<old>/step1_sft' -> '<new>/step1_sft' ... resume with the checkpoint's values", a flag train.py sets itself. The
    folder named now is compared by the model it holds, as step 3's actor is: the one the checkpoint's run started
    from (by run id) resumes; another is refused as before."""
    monkeypatch.setenv("DSCHAT_CACHE", str(tmp_path / "cache"))

    def argv(folder, *more):
        return TRAIN_PY["parse_args"](["--output-dir", str(folder), "--step", "1", "2", "--step1-args",
                                       "--max_steps 1 --eval_iters 1", "--step2-args",
                                       "--max_steps 2 --save_interval 1 --eval_iters 1", *more])

    killed_after_the_first_checkpoint(monkeypatch, argv(tmp_path / "out"))
    assert not (tmp_path / "out" / "step2_rm" / "metrics.json").exists()
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "out", moved)
    capsys.readouterr()
    pipeline.run_pipeline(argv(moved, "--resume"))
    printed = capsys.readouterr().out
    assert f"step 1: finished earlier in {moved / 'step1_sft'} with the same flags; skipped (--resume)" in printed
    assert f"step 2: resumes from its last checkpoint in {moved / 'step2_rm' / 'checkpoints'}" in printed
    assert "[step2] resumed from step 1 " in printed and (moved / "step2_rm" / "metrics.json").exists()
    # (a folder holding another model than the checkpoint's run started from stays bound to the stored path)
    from dschat.steps.resume import model_path_as_saved

    old, new = str(tmp_path / "out" / "step1_sft"), str(moved / "step1_sft")
    assert model_path_as_saved({"model_name_or_path": old}, {"model_name_or_path": new}, {old: "another run"}) == \
        {"model_name_or_path": new}


def test_train_py_resume_at_another_zero_stage_skips_the_finished_step_and_converts_the_interrupted_ones(
        tmp_path, distributed, monkeypatch, capsys):
    """The README's "give the new stage to the interrupted step" was read in the plan, not run: train.py --resume
    with --zero_stage 3 for steps 1 and 2 after step 2 (ZeRO-2) was killed past its first checkpoint trained step 1
    again from the start. Step 1 is skipped now, saying the stages; step 2 resumes from its ZeRO-2 checkpoint at
    ZeRO-3."""

    monkeypatch.setenv("DSCHAT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"

    def argv(stage, *more):
        return TRAIN_PY["parse_args"](["--output-dir", str(out), "--step", "1", "2", "--step1-args",
                                       f"--max_steps 1 --eval_iters 1 --zero_stage {stage}", "--step2-args",
                                       f"--max_steps 2 --save_interval 1 --zero_stage {stage}", *more])

    killed_after_the_first_checkpoint(monkeypatch, argv(2))
    assert not (out / "step2_rm" / "metrics.json").exists()
    written = (out / "step1_sft" / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    report = pipeline.run_pipeline(argv(3, "--resume"))
    printed = capsys.readouterr().out
    assert (f"step 1: finished earlier in {out / 'step1_sft'}; skipped (--resume): its output does not depend on the "
            "ZeRO stage (--zero_stage 2 -> 3)") in printed
    assert "step 2: resumes from its last checkpoint" in printed
    assert "checkpoint step_0000001 saved at ZeRO-2, this run has ZeRO-3 (--zero_stage)" in printed, printed[-3000:]
    assert (out / "step1_sft" / "model.safetensors").stat().st_mtime_ns == written  # not trained again
    assert report["skipped"] == ["step1"] and report["resumed"] == ["step2"]
    assert json.loads((out / "step2_rm" / "training_args.json").read_text())["flags"]["zero_stage"] == 3


def test_a_step_finished_with_other_flags_of_memory_and_speed_alone_is_skipped_and_says_so(tmp_path):
    """train.py --resume after finishing steps 1 and 2, given --offload or activation checkpointing (to fit step 3 in
    memory), trained every finished step again from the start: "had other values of --offload", though those flags
    change where the states live and what is recomputed, not the model a step makes. Such a step is skipped now,
    saying the flags; one also given a flag that does change its model runs again, for that flag."""
    from dschat.pipeline_resume import describe

    finish(tmp_path, 1, 100, offload=False, gradient_checkpointing=False, zero_stage=2)
    finish(tmp_path, 2, 200, offload=False, gradient_checkpointing=False, print_loss=False)
    finish(tmp_path, 3, 300, offload=False, offload_reference_model=False, actor_gradient_checkpointing=False,
           critic_gradient_checkpointing=False, enable_cuda_graph=None, release_inference_cache=False)
    lighter = {1: Namespace(**{**vars(FLAGS), "offload": True, "gradient_checkpointing": False, "zero_stage": 2}),
               2: Namespace(**{**vars(FLAGS), "offload": False, "gradient_checkpointing": True, "print_loss": True}),
               3: Namespace(**{**vars(FLAGS), "offload": True, "offload_reference_model": True,
                               "actor_gradient_checkpointing": True, "critic_gradient_checkpointing": True,
                               "enable_cuda_graph": False, "release_inference_cache": True})}
    decisions = plan_steps([1, 2, 3], "ppo", str(tmp_path), lighter)
    assert {step: d.action for step, d in decisions.items()} == {1: SKIP, 2: SKIP, 3: SKIP}
    assert describe(1, decisions[1], "out/step1_sft") == (
        "step 1: finished earlier in out/step1_sft; skipped (--resume): its output does not depend on flags of memory "
        "and speed alone (--offload False -> True)")
    assert decisions[2].why == ("its output does not depend on flags of memory and speed alone "
                                "(--gradient_checkpointing False -> True, --print_loss False -> True)")
    assert decisions[3].why.startswith("its output does not depend on flags of memory and speed alone (")
    for said in ("--offload False -> True", "--offload_reference_model False -> True", "--enable_cuda_graph None -> "
                 "False", "--actor_gradient_checkpointing False -> True", "--release_inference_cache False -> True"):
        assert said in decisions[3].why
    # with another ZeRO stage too: both said
    staged = Namespace(**{**vars(lighter[1]), "zero_stage": 3})
    assert plan_steps([1], "ppo", str(tmp_path), {1: staged})[1] == (
        SKIP, "its output does not depend on the ZeRO stage (--zero_stage 2 -> 3) nor on flags of memory and speed "
              "alone (--offload False -> True)")
    # with a flag that changes the model: it runs again, said for that flag only (and so do the later steps)
    other = Namespace(**{**vars(lighter[1]), "learning_rate": 2e-3})
    decisions = plan_steps([1, 2, 3], "ppo", str(tmp_path), {**lighter, 1: other})
    assert {step: d.action for step, d in decisions.items()} == {1: FRESH, 2: FRESH, 3: FRESH}
    assert decisions[1].why.endswith("had other values of --learning_rate")


@pytest.mark.parametrize("name, then, now", [
    ("check_grad_overflow", False, True),  # (skips the steps with an inf/NaN gradient: another model)
    ("pad_to_multiple_of", None, 8),
    ("padded_forwards", False, True),
    ("enable_hybrid_engine", True, False),  # (HF generate's answers, not the hybrid engine's draws)
    ("inference_tp_size", 1, 2),  # (a tensor-parallel group's ranks take its leader's tokens)
    ("logprobs_from_generation", False, True),  # (other old log-probs train the actor)
    ("preprocessing_num_workers", None, 4),  # (the unsupervised text is cut into blocks per worker's shard)
    ("eval_max_new_tokens", None, 64),  # (sizes the hybrid engine's KV cache, which its rollouts decode in)
    ("dtype", "bf16", "fp32"),
])
def test_flags_that_may_change_what_a_step_makes_still_run_it_again(tmp_path, name, then, now):
    finish(tmp_path, 3, 300, **{name: then})
    decision = plan_steps([3], "ppo", str(tmp_path), {3: Namespace(**{**vars(FLAGS), name: now})})[3]
    assert decision.action == FRESH and decision.why.endswith(f"had other values of --{name}")


def test_the_flags_of_memory_and_speed_alone_are_flags_of_the_steps_and_not_checkpoint_bound_but_offload():
    """Each exempted flag is one a step parses (a typo would exempt nothing, unsaid); of them, only --offload binds a
    step's checkpoint (its optimizer: DeepSpeed's CPU Adam), so an interrupted step given another --offload is the
    step's own refusal (see the train.py test below) while the others resume."""
    from dschat.args import step_flag_dests
    from dschat.pipeline_resume import MEMORY_SPEED_FLAGS
    from dschat.rlhf import checkpointing
    from dschat.steps import resume

    assert set(MEMORY_SPEED_FLAGS) <= step_flag_dests()
    bound = set(resume.RESUME_FLAGS) | set(checkpointing.ACTOR_RESUME_FLAGS) | set(checkpointing.CRITIC_RESUME_FLAGS)
    assert set(MEMORY_SPEED_FLAGS) & bound == {"offload"}


def test_train_py_resume_with_offload_and_activation_checkpointing_skips_the_finished_step(
        tmp_path, distributed, monkeypatch, capsys):
    """train.py --resume given --offload and --gradient_checkpointing (to fit in memory) after step 2 was killed past
    its first checkpoint trained step 1 again from the start. Step 1 is skipped now, saying the flags; step 2 resumes
    with activation checkpointing, and given --offload too (its checkpoint holds another optimizer's states, which
    DeepSpeed does not load into CPU Adam) is a UsageError saying what to do, before anything trains."""

    monkeypatch.setenv("DSCHAT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"

    def argv(step1="", step2="", *more):
        return TRAIN_PY["parse_args"](["--output-dir", str(out), "--step", "1", "2", "--step1-args",
                                       f"--max_steps 1 --eval_iters 1 --zero_stage 2 {step1}", "--step2-args",
                                       f"--max_steps 2 --save_interval 1 --zero_stage 2 {step2}", *more])

    killed_after_the_first_checkpoint(monkeypatch, argv())
    written = (out / "step1_sft" / "model.safetensors").stat().st_mtime_ns
    lighter = "--offload --gradient_checkpointing"
    with pytest.raises(UsageError, match=r"(?s)--offload False -> True\..*resume with the checkpoint's values.*"
                                         r"give --step 2 without --resume") as refused:
        pipeline.run_pipeline(argv(lighter, lighter, "--resume"))
    assert str(refused.value).count("without --resume") == 1  # (train.py's line, not the step's too)
    assert latest_tag(str(out / "step2_rm" / "checkpoints")) is not None  # (kept for a resume as saved)
    capsys.readouterr()
    report = pipeline.run_pipeline(argv(lighter, "--gradient_checkpointing", "--resume"))
    printed = capsys.readouterr().out
    assert (f"step 1: finished earlier in {out / 'step1_sft'}; skipped (--resume): its output does not depend on "
            "flags of memory and speed alone (--gradient_checkpointing False -> True, --offload False -> True)"
            ) in printed
    assert "step 2: resumes from its last checkpoint" in printed
    assert (out / "step1_sft" / "model.safetensors").stat().st_mtime_ns == written  # not trained again
    assert report["skipped"] == ["step1"] and report["resumed"] == ["step2"]
    assert json.loads((out / "step2_rm" / "training_args.json").read_text())["flags"]["gradient_checkpointing"]


def _interrupted_with(out, step, saved_flags):
    """A step interrupted past its first checkpoint, whose state holds ``saved_flags`` (as the step records them)."""
    checkpoint(out, step, 100)
    root = str(out / FOLDERS[step] / "checkpoints")
    state = Path(trainer_folder(root, latest_tag(root))) / "state.json"
    state.write_text(json.dumps({**this_checkpoint(step), "step": 1, "flags": saved_flags}))


def test_train_py_resume_plan_errors_name_the_flags_as_train_py_spells_them(tmp_path, distributed):
    """train.py --resume refuses before any step runs an interrupted step whose checkpoint no conversion moves to this
    run's ZeRO stage, with the step's message: it named the step's --zero_stage, which train.py sets from
    --actor-zero-stage, the flag its user typed. The plan's errors name train.py's flags as its steps' errors do
    (``says_train_py_flags``); a flag given in --stepN-args keeps the step's spelling."""
    from dschat.steps import resume

    out = tmp_path / "out"

    def plan_of(*given):
        args = TRAIN_PY["parse_args"](["--output-dir", str(out), "--step", "1", *given, "--resume"])
        return pipeline.resume_plan([1], args, pipeline.check_step_args([1], args, True, {1: pipeline_parser(1)}),
                                    True)

    step1 = pipeline.check_step_args([1], TRAIN_PY["parse_args"](["--output-dir", str(out), "--step", "1"]), True,
                                     {1: pipeline_parser(1)})[1]
    _interrupted_with(out, 1, resume.flag_values(Namespace(**{**vars(step1), "zero_stage": 2})))
    assert plan_of("--actor-zero-stage", "3")[1].action == RESUME
    with pytest.raises(UsageError, match=r"was saved at ZeRO stage 2 \(--actor-zero-stage 2\), this run has 0; .*: "
                                         r"resume with --actor-zero-stage 2 "):
        plan_of("--actor-zero-stage", "0")
    with pytest.raises(UsageError, match=r"\(--zero_stage 2\), this run has 0; .*: resume with --zero_stage 2 "):
        plan_of("--step1-args", "--zero_stage 0")


def test_train_py_resume_says_each_steps_flags_as_train_py_spells_them(tmp_path, distributed, capsys):
    """The plan's line for a step named its flags in the step's spelling: a finished step 1 given another
    --actor-zero-stage was "skipped (--resume): its output does not depend on the ZeRO stage (--zero_stage 2 -> 3)",
    a flag the user never typed. The lines name train.py's flags as its refusals do."""
    out = tmp_path / "out"

    def step1_flags(*given):
        args = TRAIN_PY["parse_args"](["--output-dir", str(out), "--step", "1", *given, "--resume"])
        return args, pipeline.check_step_args([1], args, True, {1: pipeline_parser(1)})

    _, parsed = step1_flags("--actor-zero-stage", "2")
    (out / FOLDERS[1]).mkdir(parents=True)
    (out / FOLDERS[1] / "training_args.json").write_text(json.dumps(
        {"step": "step1", **this_version(1), "flags": vars(parsed[1])}, default=str))
    (out / FOLDERS[1] / "metrics.json").write_text("{}")
    args, parsed = step1_flags("--actor-zero-stage", "3")
    assert pipeline.resume_plan([1], args, parsed, True)[1].action == SKIP
    assert "skipped (--resume): its output does not depend on the ZeRO stage (--actor-zero-stage 2 -> 3)" in \
        capsys.readouterr().out


def test_an_interrupted_step_whose_checkpoint_is_bound_to_other_flags_is_refused_by_the_plan(tmp_path):
    """train.py --resume planned "resumes from its last checkpoint: it was interrupted" for a step given other values
    of flags its checkpoint is bound to (LoRA, precision, seed, ...), which the step refused only after loading its
    model and data. The plan refuses it now, with the step's own message (its ``bound_flags``) and how to start it
    afresh; what the step takes (learning rates, dropout) or converts (ZeRO stages, batches split otherwise) still
    resumes."""
    from dschat.args import step1_parser, step3_parser
    from dschat.rlhf import checkpointing
    from dschat.rlhf.config import step3_args
    from dschat.steps import resume

    def step1(*argv):
        return step1_parser().parse_args(list(argv))

    _interrupted_with(tmp_path, 1, resume.flag_values(step1("--zero_stage", "2")))  # (3 converts it; 0 would not)
    root = tmp_path / FOLDERS[1] / "checkpoints"
    with pytest.raises(UsageError, match=rf"^--resume: checkpoint step_0000001 in {root} was saved with other "
                                         r"settings: --lora_dim 0 -> 8; --dtype 'bf16' -> 'fp32'\. Its model and "
                                         r"optimizer states .*: resume with the checkpoint's values\n\(train.py "
                                         r"--resume resumes step 1: to train it afresh, "
                                         r"give --step 1 2 without --resume, which removes the checkpoints in step 1's "
                                         r"folder\)$") as refused:
        plan_steps([1, 2], "ppo", str(tmp_path), {1: step1("--lora_dim", "8", "--dtype", "fp32"), 2: FLAGS})
    # (the step's own "or start afresh without --resume" left out for train.py's line: the same advice, said twice)
    assert str(refused.value).count("without --resume") == 1
    taken = step1("--learning_rate", "1e-3", "--dropout", "0.1", "--zero_stage", "3",
                  "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4")
    assert plan_steps([1], "ppo", str(tmp_path), {1: taken})[1] == (RESUME, "it was interrupted")

    def step3(*argv):
        return step3_args(step3_parser().parse_args(list(argv)))

    shutil.rmtree(tmp_path / FOLDERS[1])
    saved3 = step3("--actor_zero_stage", "2", "--critic_zero_stage", "2")  # (stages 3 converts; 0 would not)
    _interrupted_with(tmp_path, 3, checkpointing.flag_values(saved3, with_critic=True))
    with pytest.raises(UsageError, match=r"saved with other settings: --critic_lora_dim 0 -> 4\. Its algorithm "
                                         r"(.|\n)*give --step 3 without --resume"):
        plan_steps([3], "ppo", str(tmp_path), {3: step3("--critic_lora_dim", "4")})
    taken = step3("--actor_learning_rate", "1e-6", "--actor_dropout", "0.1", "--actor_zero_stage", "3",
                  "--critic_zero_stage", "2", "--per_device_training_batch_size", "2", "--gradient_accumulation_steps",
                  "2")
    assert plan_steps([3], "ppo", str(tmp_path), {3: taken})[3].action == RESUME


def test_a_resumed_steps_own_refusal_under_train_py_says_how_to_start_afresh_once(tmp_path):
    """A step train.py --resume resumed that refused its checkpoint once it ran (a damaged state.json) ended with the
    step's "or start afresh without --resume" and then train.py's "give --step 2 3 without --resume": the same advice
    twice. train.py's line, which names the steps to give, is said alone now, and says what the step's said too
    ("which removes them" of a damaged latest pointer; "which removes step1's checkpoints" of another step's): giving
    those flags removes the checkpoints in the step's folder."""
    from dschat.pipeline_resume import Decision
    from dschat.utils.checkpoints import check_position

    root = tmp_path / FOLDERS[2] / "checkpoints"
    args = TRAIN_PY["parse_args"](["--output-dir", str(tmp_path), "--step", "2", "3", "--resume"])

    def step_2(argv):  # (the step's own check of its checkpoint's state, which holds no step)
        check_position(str(root), "step_0000001", {}, ["step"])

    with pytest.raises(UsageError, match=r"no 'step': its place in the run; edited\?\): restore it\n\(train\.py "
                                         r"--resume resumes step 2: to train it afresh and keep the steps before it, "
                                         r"give --step 2 3 without --resume, which removes the checkpoints in step 2's "
                                         r"folder\)$"):
        pipeline.run_step(step_2, pipeline.step_argv(2, args, True), 2, [2, 3],
                          {2: Decision(RESUME, "it was interrupted")}, args)


def test_an_interrupted_step_2_resumes_with_another_sft_only_data_path_which_step_1_refuses(tmp_path):
    """Only step 1 reads --sft_only_data_path, yet step 2's (and DPO's) checkpoints were bound to it: the plan refused
    an interrupted step 2 given another one (``refuse_other_bound_flags``), which the step's own --resume refused too.
    The plan resumes it now; step 1's checkpoint is still bound to it."""
    from dschat.args import step1_parser, step2_parser
    from dschat.steps import resume
    from dschat.steps.common import take_data_files

    for name in ("pairs", "sft", "other_sft"):
        (tmp_path / f"{name}.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')

    def flags(parser, sft_only):
        return parser().parse_args(["--data_path", f"{tmp_path}/pairs.jsonl", "--sft_only_data_path",
                                    f"{tmp_path}/{sft_only}.jsonl"])

    for step, parser in ((2, step2_parser), (1, step1_parser)):
        saved = flags(parser, "sft")
        take_data_files(saved, step)  # (what the step's checkpoint records, as it read its data)
        _interrupted_with(tmp_path, step, resume.resume_flags(saved))
    assert plan_steps([2], "ppo", str(tmp_path), {2: flags(step2_parser, "other_sft")})[2] == \
        (RESUME, "it was interrupted")
    with pytest.raises(UsageError, match=r"saved with other settings: --sft_only_data_path \[.*sft\.jsonl'\] -> "
                                         r"\[.*other_sft\.jsonl'\]\. (.|\n)*give --step 1 without --resume"):
        plan_steps([1], "ppo", str(tmp_path), {1: flags(step1_parser, "other_sft")})


def test_an_interrupted_step_given_a_zero_stage_to_or_from_0_is_refused_by_the_plan(tmp_path):
    """The plan left the ZeRO stages to the step, which converts 1 to 3 into one another but refuses a change to or
    from stage 0 (``check_universal_fit``): planned "resumes", it failed only after loading its model and data. The
    plan refuses it now with the step's message and how to start afresh; 2 -> 3 still resumes."""
    from dschat.args import step1_parser, step3_parser
    from dschat.rlhf import checkpointing
    from dschat.rlhf.config import step3_args
    from dschat.steps import resume

    def step1(*argv):
        return step1_parser().parse_args(["--zero_stage", "2", *argv])

    _interrupted_with(tmp_path, 1, resume.flag_values(step1()))
    with pytest.raises(UsageError, match=r"(?s)was saved at ZeRO stage 2 \(--zero_stage 2\), this run has 0; "
                                         r".*give --step 1 without --resume"):
        plan_steps([1], "ppo", str(tmp_path), {1: step1("--zero_stage", "0")})
    assert plan_steps([1], "ppo", str(tmp_path), {1: step1("--zero_stage", "3")})[1].action == RESUME

    def step3(*argv):
        return step3_args(step3_parser().parse_args(["--actor_zero_stage", "0", "--critic_zero_stage", "2", *argv]))

    shutil.rmtree(tmp_path / FOLDERS[1])
    _interrupted_with(tmp_path, 3, checkpointing.flag_values(step3(), with_critic=True))
    with pytest.raises(UsageError, match=r"(?s)was saved at ZeRO stage 0 \(--actor_zero_stage 0\), this run has 1; "
                                         r".*give --step 3 without --resume"):
        plan_steps([3], "ppo", str(tmp_path), {3: step3("--actor_zero_stage", "1")})
    assert plan_steps([3], "ppo", str(tmp_path), {3: step3("--critic_zero_stage", "3")})[3].action == RESUME

def test_a_finished_step_made_longer_with_another_offload_starts_afresh_not_from_its_checkpoint(tmp_path):
    """A finished step given a larger --max_steps trains on from its checkpoint; given another --offload too, that
    checkpoint holds another optimizer's states (DeepSpeed's CPU Adam or not), which the step refuses to resume: it
    runs afresh, as before --offload alone was skipped, saying --offload. Another --gradient_checkpointing, which a
    checkpoint is not bound to, still trains on from it."""
    finish(tmp_path, 1, 100, max_steps=4, offload=False, gradient_checkpointing=False)
    checkpoint(tmp_path, 1, 150)
    state = Path(trainer_folder(str(tmp_path / FOLDERS[1] / "checkpoints"), "step_0000001")) / "state.json"
    state.write_text(json.dumps({**this_checkpoint(1), "step": 1, "flags": {"offload": False, "learning_rate": 1e-3}}))

    def decide(**changed):
        flags = Namespace(**{**vars(FLAGS), "max_steps": 4, "offload": False, "gradient_checkpointing": False,
                             **changed})
        return plan_steps([1], "ppo", str(tmp_path), {1: flags})[1]

    assert decide(offload=True).action == SKIP
    assert decide(max_steps=8, gradient_checkpointing=True) == (
        RESUME, "to train on past its finished output (--max_steps)")
    assert decide(max_steps=8, offload=True) == (
        FRESH, f"its finished output in {tmp_path / FOLDERS[1]} had other values of --max_steps, --offload")


def test_data_fields_are_compared_by_the_renaming_they_give_not_their_text(tmp_path, monkeypatch):
    """A finished step whose --data_fields are given again with their datasets' mappings in another order, spaces, or
    another spelling of a dataset's path renames the same fields: it was rerun over the text. Another renaming
    reruns."""
    (tmp_path / "qa.jsonl").write_text('{"question": "Why?", "answer": "Because."}\n')
    (tmp_path / "alpaca.jsonl").write_text('{"instruction": "Say.", "output": "Said."}\n')
    out = tmp_path / "out"
    recorded = "jsonl:qa.jsonl:prompt=question,chosen=answer;jsonl:alpaca.jsonl:prompt=instruction,chosen=output"
    finish(out, 1, 100, ("a", []), data_fields=recorded)
    record = json.loads((out / "step1_sft" / "training_args.json").read_text())
    (out / "step1_sft" / "training_args.json").write_text(json.dumps({**record, "cwd": str(tmp_path)}))
    monkeypatch.chdir(out)  # (the record's relative paths are from the folder it ran in)
    same = f"{tmp_path / 'alpaca.jsonl'}:chosen=output, prompt=instruction ; ../qa.jsonl:prompt=question,chosen=answer"
    given = Namespace(**{**vars(FLAGS), "data_fields": same})
    assert plan_steps([1], "ppo", str(out), {1: given})[1] == (SKIP, "")
    other = Namespace(**{**vars(FLAGS), "data_fields": same.replace("chosen=answer", "chosen=question")})
    assert plan_steps([1], "ppo", str(out), {1: other})[1] == (FRESH, f"its finished output in {out / 'step1_sft'} "
                                                                      "had other values of --data_fields")


def test_data_path_is_compared_by_the_files_it_reads_not_its_text(tmp_path, monkeypatch):
    """A finished step's --data_path given again as another spelling of the same files (jsonl:qa.jsonl, then the
    file's path from another folder) was another value, and the step reran: a typed spec was compared as text."""
    (tmp_path / "qa.jsonl").write_text('{"prompt": "Why?", "chosen": "Because."}\n')
    (tmp_path / "other.jsonl").write_text('{"prompt": "Why?", "chosen": "Because."}\n')
    out = tmp_path / "out"
    finish(out, 1, 100, ("a", []), data_path=["jsonl:qa.jsonl"])
    record = json.loads((out / "step1_sft" / "training_args.json").read_text())
    (out / "step1_sft" / "training_args.json").write_text(json.dumps({**record, "cwd": str(tmp_path)}))
    monkeypatch.chdir(out)
    given = Namespace(**{**vars(FLAGS), "data_path": ["../qa.jsonl"]})
    assert plan_steps([1], "ppo", str(out), {1: given})[1] == (SKIP, "")
    other = Namespace(**{**vars(FLAGS), "data_path": ["../other.jsonl"]})
    assert plan_steps([1], "ppo", str(out), {1: other})[1] == (FRESH, f"its finished output in {out / 'step1_sft'} "
                                                                      "had other values of --data_path")


def test_a_record_without_cwd_reads_its_relative_paths_from_where_its_output_dir_led_in_all_three_places(
        tmp_path, monkeypatch):
    """A training_args.json from before dschat recorded "cwd" had its relative paths read from the working folder of
    train.py --resume, wherever that was: resumed from another folder, the step's same data file was another value
    (trained again), its model folder was said as a plain change, and step 3's reward model family was unknown (every
    version change reached it). Its relative --output_dir names the folder it ran in (``record_cwd``): the same in
    the three places that read those paths; the present folder where it cannot be told."""
    from dschat.pipeline_resume import changed_flags, said_change
    from dschat.steps.common import output_model_types, record_cwd

    repo, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    (repo / "data").mkdir(parents=True)
    (repo / "data" / "qa.jsonl").write_text('{"prompt": "Why?", "chosen": "Because."}\n')
    (repo / "models" / "base").mkdir(parents=True)  # (no model in it now)
    (repo / "models" / "rm").mkdir()
    (repo / "models" / "rm" / "config.json").write_text('{"model_type": "gpt2"}')
    elsewhere.mkdir()
    out = repo / "output"
    finish(out, 1, 100, ("a", []), output_dir="output/step1_sft", data_path=["jsonl:data/qa.jsonl"],
           model_name_or_path="models/base")
    record = json.loads((out / FOLDERS[1] / "training_args.json").read_text())
    record["inputs"] = {str(repo / "models" / "base"): "base-run"}  # (made from a step output since removed)
    (out / FOLDERS[1] / "training_args.json").write_text(json.dumps(record))
    assert "cwd" not in record
    monkeypatch.chdir(elsewhere)
    assert record_cwd(record, str(out / FOLDERS[1])) == str(repo)
    now = Namespace(**{**vars(FLAGS), "output_dir": str(out / FOLDERS[1]),
                       "data_path": [str(repo / "data" / "qa.jsonl")],
                       "model_name_or_path": str(repo / "models" / "base")})
    # changed_flags: the same data file; said_change: the same model folder, which holds no model now
    assert changed_flags(record, now, str(out / FOLDERS[1])) == ["model_name_or_path"]
    assert plan_steps([1], "ppo", str(out), {1: now})[1] == (
        FRESH, f"its finished output in {out / FOLDERS[1]} had other values of --model_name_or_path (the folder "
               f"{repo / 'models' / 'base'} holds no finished model now)")
    assert said_change("model_name_or_path", record, now, str(out / FOLDERS[1])).endswith(
        "holds no finished model now)")
    # output_model_types: step 3's reward model (which it does not save) read from the same folder
    step3 = {"step": "step3", "flags": {"output_dir": "./output/step3_ppo/", "reward_model_name_or_path": "models/rm"}}
    assert output_model_types(str(out / FOLDERS[3]), step3) == frozenset({"gpt2"})
    # where the folder it ran in cannot be told, the present one is the guess, in the three places alike
    for cannot in ("/old/output/step3_ppo", "../output/step3_ppo", "renamed/step3_ppo", None):
        assert record_cwd({"flags": {"output_dir": cannot}}, str(out / FOLDERS[3])) == str(elsewhere), cannot
    assert output_model_types(str(out / FOLDERS[3]), {**step3, "flags": {**step3["flags"], "output_dir": "renamed"}}) \
        is None
    assert record_cwd({"flags": {"output_dir": "."}}, str(repo)) == str(repo)
    assert record_cwd({"cwd": "/old", "flags": {"output_dir": "output/step1_sft"}}, str(out / FOLDERS[1])) == "/old"


def test_a_step1_output_recorded_before_its_loss_agg_took_the_micro_batches_mean_and_trains_again(tmp_path):
    """Step 1's --loss_agg (default global_token_mean) came with no step version bump: an output recorded before it
    (no loss_agg among its flags) took each micro-batch's own mean, today's token_mean, and was skipped as the same
    output as the new default's, which weighs a step's micro-batches (gradient accumulation, ranks) otherwise."""
    finish(tmp_path, 1, 100)  # (its flags: no loss_agg)
    now = {mode: Namespace(**{**vars(FLAGS), "loss_agg": mode}) for mode in ("global_token_mean", "token_mean")}
    decision = plan_steps([1], "ppo", str(tmp_path), {1: now["global_token_mean"]})[1]
    assert decision.action == FRESH and "other values of --loss_agg" in decision.why
    assert plan(tmp_path, steps=(1,), step1=now["token_mean"]) == {1: SKIP}
    finish(tmp_path, 1, 100, loss_agg="global_token_mean")  # (recorded since)
    assert plan(tmp_path, steps=(1,), step1=now["global_token_mean"]) == {1: SKIP}


def test_step1s_loss_agg_is_compared_by_how_it_weighs_the_tokens(tmp_path):
    """A step-1 output recorded before --loss_agg took token_mean (FLAGS_BEFORE_RECORDED), and ran again under the new
    default global_token_mean, though where an optimizer step is one micro-batch on one rank the two are the same
    loss (the factor global_token_mean gives it is exactly 1): the tiny default's step 1, whose new output then made
    steps 2 and 3 run again too. It is skipped there, saying so; with more micro-batches a step it still runs again.
    And token_mean, each micro-batch's mean weighed alike, was kept on another number of ranks with the batch flags
    set for the same samples a step, which it weighs otherwise."""
    from dschat.steps.common import step_loss_weights

    tokens = {"labels": torch.tensor([[5, 6, 7]])}
    assert step_loss_weights([(0, 0, None, tokens)], lambda batch: 3, 1, "cpu") == [(1.0, 1.0)]  # (one micro-batch)

    def decide(world_size, then_ranks=1, **now):
        flags = Namespace(**{**vars(FLAGS), "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                             "loss_agg": "global_token_mean", **now})
        record = tmp_path / FOLDERS[1] / "training_args.json"
        record.write_text(json.dumps({**json.loads(record.read_text()), "world_size": then_ranks}))
        return plan_steps([1], "ppo", str(tmp_path), {1: flags}, world_size=world_size)[1]

    finish(tmp_path, 1, 100, per_device_train_batch_size=8, gradient_accumulation_steps=1)  # (no loss_agg: before it)
    assert decide(1) == (SKIP, "its output does not depend on --loss_agg token_mean -> global_token_mean (one "
                               "micro-batch an optimizer step on one rank: its token mean is the step's)")
    assert decide(1, loss_agg="token_mean") == (SKIP, "")
    assert decide(2, per_device_train_batch_size=4).action == SKIP  # (the same samples a step, each token alike)
    assert decide(2, then_ranks=2).why.endswith("had other values of --loss_agg")  # (a step: a micro-batch a rank)
    finish(tmp_path, 1, 100, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    assert decide(1, per_device_train_batch_size=4, gradient_accumulation_steps=2).why.endswith(
        "had other values of --loss_agg")
    # token_mean over 2 ranks, resplit for 4: the same samples a step, each micro-batch's mean weighed alike
    finish(tmp_path, 1, 100, per_device_train_batch_size=8, gradient_accumulation_steps=1, loss_agg="token_mean")
    assert decide(2, then_ranks=2, loss_agg="token_mean") == (SKIP, "")
    assert decide(4, then_ranks=2, loss_agg="token_mean", per_device_train_batch_size=4).why.endswith(
        "had other values of --loss_agg (token_mean weighs each micro-batch's mean alike: a step's micro-batches are "
        "split otherwise now)")
    finish(tmp_path, 1, 100, per_device_train_batch_size=8, gradient_accumulation_steps=1,
           loss_agg="global_token_mean")  # (each token alike, however split)
    assert decide(4, then_ranks=2, per_device_train_batch_size=4) == (SKIP, "")
    assert decide(1, then_ranks=2, loss_agg="token_mean", per_device_train_batch_size=16).action == SKIP


def test_flags_that_a_step_read_in_neither_run_or_that_only_log_and_evaluate_keep_it_skipped_and_are_said(tmp_path):
    """train.py --resume trained a finished step again for any flag that differed, also one that cannot have changed
    its weights: one the step reads only while a setting is on that neither run had on (step 3's --ema_beta without
    --enable_ema, --temperature with --greedy, a critic's flag without a critic; DPO's --loss_agg without --rpo_alpha)
    or one of what it logs and how it evaluates (--eval_prompts, --eval_iters, a TensorBoard path). Such a step is
    skipped now, its line saying each flag and why; where either run reads the flag, it runs again."""
    from dschat.pipeline_resume import describe

    then = dict(enable_ema=False, ema_beta=0.992, greedy=True, temperature=1.0, advantage_estimator="grpo",
                critic_learning_rate=5e-6, eval_prompts=64, tensorboard_path="a")
    finish(tmp_path, 3, 300, **then)

    def step3(**now):
        return plan_steps([3], "ppo", str(tmp_path), {3: Namespace(**{**vars(FLAGS), **then, **now})})[3]

    decision = step3(ema_beta=0.9, temperature=0.7, critic_learning_rate=1e-5, eval_prompts=32, tensorboard_path="b")
    assert describe(3, decision, "out/step3_ppo") == (
        "step 3: finished earlier in out/step3_ppo; skipped (--resume): its output does not depend on what it logs and "
        "how it evaluates (--eval_prompts 64 -> 32, --tensorboard_path a -> b: its metrics.json is the finished run's "
        "evaluation) nor on flags it read in neither run (--critic_learning_rate 5e-06 -> 1e-05: read only with "
        "--advantage_estimator gae; --ema_beta 0.992 -> 0.9: read only with --enable_ema; --temperature 1.0 -> 0.7: "
        "read only with sampled answers, not --greedy)")
    # read by either run: it runs again, for that flag too
    assert step3(ema_beta=0.9, enable_ema=True).why.endswith("had other values of --ema_beta, --enable_ema")
    assert step3(temperature=0.7, greedy=False).why.endswith("had other values of --greedy, --temperature")
    assert step3(critic_learning_rate=1e-5, advantage_estimator="gae").why.endswith(
        "had other values of --advantage_estimator, --critic_learning_rate")
    finish(tmp_path, 3, 300, **{**then, "greedy": False})
    assert step3(temperature=0.7, greedy=False).why.endswith("had other values of --temperature")
    # a record without the setting (a flag added since): taken as read
    del then["enable_ema"]
    finish(tmp_path, 3, 300, **then)
    assert step3(ema_beta=0.9, enable_ema=False).why.endswith("had other values of --ema_beta")
    # a checkpoint bound to an ignored flag: the finished output is skipped, not trained on from it
    checkpoint(tmp_path, 3, 350)
    state = tmp_path / FOLDERS[3] / "checkpoints" / "trainer" / "iter_0000001" / "state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "flags": {"eval_prompts": 64}}))
    assert step3(eval_prompts=32).action == SKIP
    finish(tmp_path, 3, 300, **{**then, "max_steps": 4})
    assert step3(eval_prompts=32, max_steps=8).why.endswith("had other values of --max_steps, --eval_prompts")

    # DPO's --loss_agg weighs only its --rpo_alpha term; steps 1, 2 and DPO's evaluation flags
    dpo = tmp_path / "step2_dpo"
    dpo.mkdir()
    recorded = {**vars(FLAGS), "rpo_alpha": 0.0, "loss_agg": "global_token_mean", "eval_iters": 100}
    (dpo / "training_args.json").write_text(json.dumps({"step": "step2_dpo", STEP_VERSION: STEP_VERSIONS["step2_dpo"],
                                                        "flags": recorded}))
    (dpo / "metrics.json").write_text("{}")

    def step2(**now):
        return plan_steps([2], "dpo", str(tmp_path), {2: Namespace(**{**recorded, **now})})[2]

    assert step2(loss_agg="token_mean", eval_iters=10) == (
        SKIP, "its output does not depend on what it logs and how it evaluates (--eval_iters 100 -> 10: its "
              "metrics.json is the finished run's evaluation) nor on flags it read in neither run (--loss_agg "
              "global_token_mean -> token_mean: read only with --rpo_alpha)")
    assert step2(loss_agg="token_mean", rpo_alpha=1.0).why.endswith("had other values of --loss_agg, --rpo_alpha")


def test_a_warmup_under_the_constant_schedule_is_read_in_neither_run_whatever_its_value(tmp_path):
    """transformers' "constant" schedule takes no warmup, yet the warmup row counted --num_warmup_steps 0 as read
    (its test of the warning's, "nothing asked for"): a finished step of the constant schedule given another warmup,
    0 on either side, trained again to the same weights. Under a schedule with a warmup it runs again."""
    for then, now in ((5, 0), (0, 5), (5, 10)):
        finish(tmp_path, 1, 100, lr_scheduler_type="constant", num_warmup_steps=then)
        decision = plan_steps([1], "ppo", str(tmp_path), {1: Namespace(**{
            **vars(FLAGS), "lr_scheduler_type": "constant", "num_warmup_steps": now})})[1]
        assert decision == (SKIP, f"its output does not depend on flags it read in neither run (--num_warmup_steps "
                                  f"{then} -> {now}: read only with --lr_scheduler_type other than constant)")
    for schedule in ("constant_with_warmup", "cosine"):
        finish(tmp_path, 1, 100, lr_scheduler_type=schedule, num_warmup_steps=5)
        assert plan_steps([1], "ppo", str(tmp_path), {1: Namespace(**{
            **vars(FLAGS), "lr_scheduler_type": schedule, "num_warmup_steps": 0})})[1].why.endswith(
            "had other values of --num_warmup_steps")


def test_an_older_dschats_output_that_no_change_since_reaches_is_skipped_saying_so(tmp_path):
    """A step version bump trained every older output of the step again, also those its change leaves as they were:
    DPO's 2 (--rpo_alpha's NLL term weighed by --loss_agg) an output without --rpo_alpha, or whose --loss_agg weighs
    the term as 1's micro-batch mean did (token_mean; one micro-batch a step on one rank, the tiny default's DPO: the
    same to the bit). The check reads the output's recorded flags now (STEP_VERSION_CHANGES): an output no change
    since reaches is skipped, its line saying so; one a change reaches, or whose record cannot tell, trains again."""
    assert STEP_VERSIONS["step2_dpo"] == 3
    dpo = tmp_path / "step2_dpo"
    dpo.mkdir()
    (dpo / "metrics.json").write_text("{}")
    (dpo / "config.json").write_text('{"model_type": "llama"}')  # (version 3's change reaches RWKV outputs alone)
    base = {**vars(FLAGS), "rpo_alpha": 1.0, "loss_agg": "global_token_mean", "per_device_train_batch_size": 8,
            "gradient_accumulation_steps": 1}

    def dpo_of_version_1(world_size=1, **flags):
        recorded = {**base, **flags}
        record = {"step": "step2_dpo", STEP_VERSION: 1, "flags": recorded}
        if world_size is not None:
            record["world_size"] = world_size
        (dpo / "training_args.json").write_text(json.dumps(record))
        return plan_steps([2], "dpo", str(tmp_path), {2: Namespace(**recorded)}, world_size=world_size or 1)[2]

    spared = (SKIP, "its output is step_version 1 of step2_dpo (3 now), which no change since reaches: version 2 "
                    "(--rpo_alpha's term weighing) leaves a run without --rpo_alpha, or whose --loss_agg weighs it as "
                    "1 did, alike; version 3 (RWKV saves) reaches models of rwkv alone (STEP_VERSION_CHANGES in "
                    "dschat/steps/common.py)")
    older = (FRESH, f"its finished output in {dpo} is an older dschat's (step_version 1 of step2_dpo, 3 now: "
                    "STEP_VERSIONS in dschat/steps/common.py says what changed), which may have trained it otherwise")
    assert dpo_of_version_1(rpo_alpha=0.0) == spared
    assert dpo_of_version_1() == spared  # (one micro-batch a step on one rank: the token mean is the step's)
    assert dpo_of_version_1(loss_agg="token_mean", gradient_accumulation_steps=2) == spared
    # train.py --step 3 reading such an output (say_an_older_dschats_output) and a checkpoint's note read the same rule
    from dschat.steps.common import older_step_version

    assert older_step_version(1, "step2_dpo", "training_args.json", "output", "", {"flags": {"rpo_alpha": 0}},
                              str(dpo)) is None  # (its folder: the family of its model, for version 3)
    assert older_step_version(1, "step2_dpo", "state.json", "checkpoint", "") is not None  # (no record: said)
    assert dpo_of_version_1(gradient_accumulation_steps=2) == older
    assert dpo_of_version_1(world_size=2) == older
    assert dpo_of_version_1(world_size=None) == older  # (its ranks unrecorded)
    del base["loss_agg"]  # (unrecorded: not told)
    assert dpo_of_version_1() == older
    del base["rpo_alpha"]  # (unrecorded: the term taken as trained, weighed as its --loss_agg says)
    assert dpo_of_version_1(loss_agg="global_token_mean", gradient_accumulation_steps=2) == older
    assert dpo_of_version_1(loss_agg="token_mean", gradient_accumulation_steps=2) == spared
    # train.py --step 3 reading such an output (say_an_older_dschats_output) and a checkpoint's note read the same rule
    from dschat.steps.common import older_step_version

    assert older_step_version(1, "step2_dpo", "training_args.json", "output", "", {"flags": {"rpo_alpha": 0}},
                              str(dpo)) is None  # (its folder: the family of its model, for version 3)
    assert older_step_version(1, "step2_dpo", "state.json", "checkpoint", "") is not None  # (no record: said)


def test_a_version_change_of_some_families_alone_trains_their_older_outputs_alone_again(tmp_path):
    """Session 59 fixed RWKV's saves (they kept the weights an eval-mode forward had divided in place) and the value
    head's width probe (it left an RWKV backbone's weights divided), and sessions 59-60 how an actor of a family whose
    outputs left padding moves generates, with no version bump: an older RWKV reward model was skipped as this
    dschat's. Each step's version is bumped now, its change naming the families it reaches (``model_types``), judged
    by the config.json of the models the output saved (and step 3's reward model): an older step-2 output of RWKV
    trains again, an OPT one is skipped, saying so; one whose family cannot be read trains again."""
    def of_the_version_before(step, configs, **flags):
        """``step``'s finished output of the version before this one, its saved models of ``configs``' families."""
        finish(tmp_path, step, 100 * step, **flags)
        folder = tmp_path / FOLDERS[step]
        record_file = folder / "training_args.json"
        record_file.write_text(json.dumps({**json.loads(record_file.read_text()),
                                           STEP_VERSION: STEP_VERSIONS[f"step{step}"] - 1}))
        for sub, model_type in configs.items():
            (folder / sub).mkdir(parents=True, exist_ok=True)
            (folder / sub / "config.json").write_text(json.dumps({"model_type": model_type}))
        now = Namespace(**{**vars(FLAGS), **flags})
        return plan_steps([step], "ppo", str(tmp_path), {step: now}, rm_from_sft=False)[step]

    assert of_the_version_before(2, {".": "opt"}) == (
        SKIP, "its output is step_version 1 of step2 (2 now), which no change since reaches: version 2 (RWKV saves and "
              "width probe) reaches models of rwkv alone (STEP_VERSION_CHANGES in dschat/steps/common.py)")
    older = f"is an older dschat's (step_version 1 of step2, 2 now: STEP_VERSIONS in dschat/steps/common.py says what"
    assert older in of_the_version_before(2, {".": "rwkv"}).why
    (tmp_path / FOLDERS[2] / "config.json").unlink()
    assert older in of_the_version_before(2, {}).why  # (no config: its family unknown)

    # step 3: its actor's family, its critic's, and its reward model's, which it does not save
    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "config.json").write_text('{"model_type": "llama"}')
    scored_by = {"critic_model_name_or_path": str(rm)}
    assert of_the_version_before(3, {"actor": "llama"}, **scored_by).action == SKIP
    assert of_the_version_before(3, {"actor": "xlstm"}, **scored_by).action == FRESH
    assert of_the_version_before(3, {"actor": "llama", "critic": "rwkv"}, **scored_by).action == FRESH
    shutil.rmtree(tmp_path / FOLDERS[3] / "critic")
    (rm / "config.json").write_text('{"model_type": "rwkv"}')
    assert of_the_version_before(3, {"actor": "llama"}, **scored_by).action == FRESH
    assert of_the_version_before(3, {"actor": "llama"}, critic_model_name_or_path="no/such-hub-model").action == FRESH
    assert of_the_version_before(3, {"actor": "llama"}, reward_model_weight=0.0).action == SKIP  # (no reward model)


def test_a_step3_output_of_version_1_trains_again_only_where_it_kept_an_ema_or_masked_truncated_answers(tmp_path):
    """Step 3's --enable_ema average ticked on skipped optimizer steps too (fixed in 1828fe8, with no version bump): an
    older step-3 output with an EMA was skipped as this dschat's. Step 3's version is 2 now, and the change reaches
    an output that kept an EMA, or ran with --mask_truncated_answers, whose steps of no token a version 1 from before
    ba9774c took with zero gradients (Adam's momentum still moved the weights: the actor of such a run, tiny models,
    4 iterations, differs from this dschat's by up to 8.9e-4), or whose record cannot tell: one without either is
    skipped, saying so."""
    from dschat.steps.common import older_step_version

    assert STEP_VERSIONS["step3"] == 3
    # (version 3's change reaches outputs of some families alone: these are of none of them)
    for folder in (tmp_path / FOLDERS[3] / "actor", tmp_path / "rm"):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text('{"model_type": "llama"}')

    def step3_of_version_1(**flags):
        finish(tmp_path, 3, 300, critic_model_name_or_path=str(tmp_path / "rm"), **flags)
        record_file = tmp_path / FOLDERS[3] / "training_args.json"
        record = json.loads(record_file.read_text())
        record_file.write_text(json.dumps({**record, STEP_VERSION: 1}))
        now = {**vars(FLAGS), "critic_model_name_or_path": str(tmp_path / "rm"), **flags}
        return plan_steps([3], "ppo", str(tmp_path), {3: Namespace(**now)})[3]

    assert step3_of_version_1(enable_ema=False, mask_truncated_answers=True).action == FRESH
    assert step3_of_version_1(enable_ema=False, mask_truncated_answers=False) == (
        SKIP, "its output is step_version 1 of step3 (3 now), which no change since reaches: version 2 "
              "(--enable_ema's average, --mask_truncated_answers' empty steps) reaches a run with either alone; "
              "version 3 (RWKV saves and width probe, generation without left padding) reaches models of deepseek_v4, "
              "recurrent_gemma, rwkv, xlstm alone (STEP_VERSION_CHANGES in dschat/steps/common.py)")
    assert step3_of_version_1(enable_ema=False).action == FRESH  # (no --mask_truncated_answers recorded: not told)
    assert step3_of_version_1(enable_ema=True, mask_truncated_answers=False).why.endswith(
        "is an older dschat's (step_version 1 of step3, 3 now: STEP_VERSIONS in dschat/steps/common.py says what "
        "changed), which may have trained it otherwise")
    assert step3_of_version_1().action == FRESH  # (no --enable_ema recorded: not told)
    # without its record (a checkpoint's state keeps some flags only): every change said to reach it; with its record
    # and no output folder, version 3's too (the families of its models unknown)
    spared = {"flags": {"enable_ema": False, "mask_truncated_answers": False,
                        "critic_model_name_or_path": str(tmp_path / "rm")}, "step": "step3"}
    assert older_step_version(1, "step3", "state.json", "checkpoint", "") is not None
    assert older_step_version(1, "step3", "state.json", "checkpoint", "", spared) is not None
    assert older_step_version(1, "step3", "training_args.json", "output", "", spared,
                              str(tmp_path / FOLDERS[3])) is None


def test_train_py_resume_plans_with_no_meeting_of_the_ranks_that_rank_0_makes_alone(tmp_path, monkeypatch):
    """The plan is decided on rank 0 (``rank_0_decides``, a broadcast the other ranks wait in), and its refusals built
    each step's command line there: step 3's asks whether a hub name is a reward model, itself a ``rank_0_decides``
    where no answer is kept (a lookup that failed). Rank 0's inner broadcast then paired with the others' outer one:
    they took its answer for the plan, and rank 0 waited for ever. Every rank builds the command lines first now."""
    import dschat.models.reward_model as reward_model
    from dschat.args import step3_parser

    args = TRAIN_PY["parse_args"](["--output-dir", str(tmp_path), "--step", "3", "--reward-model", "someorg/some-rm",
                                   "--resume"])
    monkeypatch.setattr(reward_model, "hub_holds_reward_model", lambda name: None)  # (failed: not kept)
    depth, nested = [0], []

    def rank_0_decides(decide, patience=None):  # (records a meeting made inside another)
        nested.extend(depth[:1] if depth[0] else [])
        depth[0] += 1
        try:
            return decide()
        finally:
            depth[0] -= 1

    monkeypatch.setattr(pipeline, "rank_0_decides", rank_0_decides)
    flags = step3_parser().parse_args(pipeline.step_argv(3, args, False))
    pipeline.resume_plan([3], args, {3: flags}, False)
    assert nested == []

