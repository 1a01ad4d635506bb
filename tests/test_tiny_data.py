"""The bundled tiny dataset: deterministic, well-formed, prompts held out, and separable by the rule scorer."""
import json
import subprocess
import sys

import pytest

from dschat.tiny import EVAL_FILE, TOKENIZER_FILE, TRAIN_FILE
from dschat.tiny.generate_data import NUM_EVAL, NUM_TRAIN, REQUESTS, build_records, generate
from dschat.tiny.scorer import rule_score


def _read(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def shipped():
    return {"train": _read(TRAIN_FILE), "eval": _read(EVAL_FILE)}


def test_generation_is_deterministic_and_matches_the_shipped_files(tmp_path):
    # Run as the documented command, in a fresh process: string hashing differs between processes.
    subprocess.run([sys.executable, "-m", "dschat.tiny.generate_data", "--out-dir", str(tmp_path / "a")],
                   check=True, capture_output=True)
    generate(tmp_path / "b")
    for relative in ("data/train.jsonl", "data/eval.jsonl", "tokenizer.json"):
        first = (tmp_path / "a" / relative).read_bytes()
        assert first == (tmp_path / "b" / relative).read_bytes(), relative
    assert (tmp_path / "a" / "data/train.jsonl").read_bytes() == TRAIN_FILE.read_bytes()
    assert (tmp_path / "a" / "data/eval.jsonl").read_bytes() == EVAL_FILE.read_bytes()
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == TOKENIZER_FILE.read_bytes()


def test_a_different_seed_gives_different_data():
    assert build_records(seed=1, num_train=50, num_eval=10) != build_records(seed=2, num_train=50, num_eval=10)


def test_records_have_the_documented_fields_and_sizes(shipped):
    assert len(shipped["train"]) == NUM_TRAIN
    assert len(shipped["eval"]) == NUM_EVAL
    for record in shipped["train"] + shipped["eval"]:
        assert {"prompt", "chosen", "rejected", "task"} <= set(record)
        assert record["task"] in REQUESTS
        assert record["prompt"] and record["chosen"] and record["rejected"]
        assert record["chosen"] != record["rejected"]
        assert "Human:" not in record["prompt"] and "Assistant:" not in record["prompt"]
    for split in shipped.values():
        tasks = {record["task"] for record in split}
        assert tasks == set(REQUESTS)


def test_eval_prompts_are_disjoint_from_train(shipped):
    train_prompts = {record["prompt"] for record in shipped["train"]}
    assert not train_prompts & {record["prompt"] for record in shipped["eval"]}


def test_rejected_answers_break_the_rule_in_several_ways(shipped):
    for task in REQUESTS:
        kinds = {r["violation"] for r in shipped["train"] if r["task"] == task}
        assert len(kinds) >= 4, (task, kinds)


@pytest.mark.parametrize("split", ["train", "eval"])
def test_scorer_separates_chosen_from_rejected(shipped, split):
    records = shipped[split]
    chosen = [rule_score(r["prompt"], r["chosen"]) for r in records]
    rejected = [rule_score(r["prompt"], r["rejected"]) for r in records]
    assert sum(chosen) / len(chosen) >= 0.95
    assert sum(rejected) / len(rejected) <= 0.3
    assert sum(c > r for c, r in zip(chosen, rejected)) / len(records) >= 0.99
