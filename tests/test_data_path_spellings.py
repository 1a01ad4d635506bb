"""One dataset spelt otherwise in two flags (./a.jsonl, jsonl:a.jsonl): train.py's checks see the same files."""
import runpy

from dschat import pipeline
from launch import REPO


def test_steps_that_split_one_file_spelt_otherwise_differently_are_said(tmp_path, monkeypatch, capsys):
    """A step whose --stepN-args give --data-path's file spelt otherwise, with its own --data_split, may train on
    records another step trained on: the note compared the paths as text and said nothing."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.jsonl").write_text('{"prompt": "Why?", "chosen": "Because.", "rejected": "No."}\n')
    args = runpy.run_path(str(REPO / "train.py"))["parse_args"]([
        "--data-path", "jsonl:a.jsonl", "--step1-args", "--data_split 6,2,2 --data_path ./a.jsonl"])
    flags = {step: pipeline.step_parser(step, "ppo")().parse_args(pipeline.step_argv(step, args, True))
             for step in (1, 2, 3)}
    pipeline.say_splits_that_differ(flags)
    out = capsys.readouterr().out
    assert "note: steps 1 and 2 split --data_path ./a.jsonl differently" in out
