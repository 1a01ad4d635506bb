"""--data_fields given one mapping per dataset of --data_path: files of other column names in one run."""
import json
import re
import sys
from pathlib import Path

import pytest

from dschat.data import create_prompt_dataset
from dschat.data.fields import parse_data_fields, parse_field_map
from dschat.errors import UsageError

REPO = Path(__file__).resolve().parents[1]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return f"jsonl:{path}"


def two_files(tmp_path):
    """A question/answer file and an instruction/output file (Alpaca's names under a --data_fields naming the
    prompt), each with its own numbered records."""
    qa = write_jsonl(tmp_path / "qa.jsonl", [{"question": f"Question {i}?", "answer": f"QA answer {i}."}
                                             for i in range(6)])
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": f"Instruction {i}.",
                                                      "output": f"Alpaca output {i}."} for i in range(6)])
    return qa, alpaca


def build(tmp_path, tokenizer, data_path, data_fields, **kwargs):
    return create_prompt_dataset(0, data_path, "1,0,0", str(tmp_path / "out"), 1, 1234, tokenizer, 128,
                                 data_fields=data_fields, **kwargs)


def texts(dataset, tokenizer):
    return [tokenizer.decode(dataset[i]["input_ids"]) for i in range(len(dataset))]


def test_two_files_of_other_column_names_are_read_in_one_run(tmp_path, tokenizer):
    qa, alpaca = two_files(tmp_path)
    fields = f"{qa}:prompt=question,chosen=answer;{alpaca}:prompt=instruction,chosen=output"
    train, eval_ = build(tmp_path, tokenizer, [qa, alpaca], fields)
    read = texts(train, tokenizer) + texts(eval_, tokenizer)
    assert sum("QA answer" in text for text in read) == 6 and sum("Alpaca output" in text for text in read) == 6
    assert any("Question 3?" in text and "QA answer 3." in text for text in read)
    assert any("Instruction 3." in text and "Alpaca output 3." in text for text in read)


def test_a_mapping_of_no_dataset_is_the_others_and_the_old_form_still_reads(tmp_path, tokenizer):
    qa, alpaca = two_files(tmp_path)
    train, eval_ = build(tmp_path, tokenizer, [qa, alpaca],
                         f"prompt=question,chosen=answer; {alpaca}:prompt=instruction,chosen=output")
    assert len(train) + len(eval_) == 12
    alone, held_out = build(tmp_path, tokenizer, [qa], "prompt=question,chosen=answer")
    assert len(alone) + len(held_out) == 6
    assert parse_field_map("prompt=a;b,chosen=c") == {"prompt": "a;b", "chosen": "c"}  # (a ';' in a column's name)


@pytest.mark.parametrize("fields, mapping", [
    ("prompt=x;y:z", {"prompt": "x;y:z"}),
    ("prompt=a;b:c,chosen=d", {"prompt": "a;b:c", "chosen": "d"}),
    ("prompt=Q;A: text,chosen=d", {"prompt": "Q;A: text", "chosen": "d"}),
])
def test_the_old_form_with_a_column_named_with_a_semicolon_then_a_colon_reads_as_before(fields, mapping):
    """A ';' then a ':' in a column's name, before no field's '=', read as a dataset's mapping: the old form's column
    "x;y:z" was an error ("item 'z' must look like 'prompt=question'"). Only a field's name after the ':' (or a
    ':' that ends the group) makes a dataset."""
    assert parse_data_fields(fields).by_dataset == {}
    assert parse_field_map(fields) == mapping


@pytest.mark.parametrize("fields, said", [
    ("{qa}:prompt=question;jsonl:elsewhere.jsonl:prompt=instruction", r"'jsonl:elsewhere.jsonl' is not a dataset of"),
    ("{qa}:prompt=question;{qa}:chosen=answer", r"the dataset '.*qa.jsonl' is given two mappings"),
    ("prompt=question;chosen=answer;{qa}:prompt=question", r"two mappings name no dataset"),
    ("Dahoas/rm-static:prompt=question", r"'Dahoas/rm-static' is a hub dataset"),
    ("{qa}:answer=question", r"unknown data field"),
])
def test_unknown_or_ambiguous_datasets_are_refused_naming_the_flag(tmp_path, tokenizer, fields, said):
    qa, alpaca = two_files(tmp_path)
    data_path = [qa, alpaca, "Dahoas/rm-static"] if "Dahoas" in fields else [qa, alpaca]
    with pytest.raises(UsageError, match=said):
        parse_data_fields(fields.format(qa=qa)).check_names(data_path)
    if "Dahoas" not in fields:  # (the pipeline's own check, before any file is read)
        with pytest.raises(UsageError, match="--data_fields.*" + said):
            build(tmp_path, tokenizer, data_path, fields.format(qa=qa))


def test_the_cache_key_follows_each_datasets_mapping(tmp_path, tokenizer):
    qa, alpaca = two_files(tmp_path)
    fields = f"{qa}:prompt=question,chosen=answer;{alpaca}:prompt=instruction,chosen=output"
    first, _ = build(tmp_path, tokenizer, [qa, alpaca], fields)
    reordered, _ = build(tmp_path, tokenizer, [qa, alpaca],
                         f"{alpaca}:prompt=instruction,chosen=output; {qa}:chosen=answer,prompt=question")
    assert first.built and not reordered.built and reordered.cache_path == first.cache_path
    changed, _ = build(tmp_path, tokenizer, [qa, alpaca],
                       f"{qa}:prompt=answer,chosen=question;{alpaca}:prompt=instruction,chosen=output")
    assert changed.built and changed.cache_path != first.cache_path
    assert any(re.search(r"QA answer (\d)\..*Question \1\?", text, re.S) for text in texts(changed, tokenizer))


def test_a_step_given_some_of_the_datasets_gets_their_mappings_alone():
    """train.py's --data-fields go to a step whose --stepN-args give it some of --data-path's datasets; the others'
    mappings would name datasets the step does not read (an error)."""
    import runpy

    from dschat import pipeline
    from dschat.args import step1_parser, step2_parser

    args = runpy.run_path(str(REPO / "train.py"))["parse_args"]([
        "--actor-model", "tiny-llama", "--data-path", "jsonl:qa.jsonl", "jsonl:alpaca.jsonl", "--data-fields",
        "jsonl:qa.jsonl:prompt=question,chosen=answer;jsonl:alpaca.jsonl:prompt=instruction,chosen=output",
        "--step2-args", "--data_path jsonl:alpaca.jsonl"])
    step1 = step1_parser().parse_args(pipeline.step_argv(1, args, tiny=True))
    step2 = step2_parser().parse_args(pipeline.step_argv(2, args, tiny=True))
    assert step1.data_fields == args.data_fields
    assert parse_data_fields(step2.data_fields).by_dataset == {
        "jsonl:alpaca.jsonl": {"prompt": "instruction", "chosen": "output"}}


def test_a_mapping_of_step_1s_own_data_goes_to_step_1_alone():
    """A mapping of step 1's --sft_only_data_path file (or of a step's own --data_path file) in train.py's
    --data-fields: the other steps, which do not read that file, refused it as a dataset not theirs; and a step's own
    files got no mapping of theirs."""
    import runpy

    from dschat import pipeline
    from dschat.args import step1_parser, step2_parser, step3_parser

    args = runpy.run_path(str(REPO / "train.py"))["parse_args"]([
        "--actor-model", "tiny-llama", "--data-path", "jsonl:qa.jsonl", "--data-fields",
        "prompt=q;jsonl:sft.jsonl:prompt=instruction,chosen=output;jsonl:own.jsonl:prompt=question",
        "--step1-args", "--sft_only_data_path jsonl:sft.jsonl", "--step3-args", "--data_path jsonl:own.jsonl"])
    parsers = {1: step1_parser, 2: step2_parser, 3: step3_parser}
    fields = {step: parse_data_fields(parser().parse_args(pipeline.step_argv(step, args, tiny=True)).data_fields)
              for step, parser in parsers.items()}
    assert fields[1].default == fields[2].default == {"prompt": "q"}
    assert fields[1].by_dataset == {"jsonl:sft.jsonl": {"prompt": "instruction", "chosen": "output"}}
    assert fields[2].by_dataset == {}
    # step 3 reads its own file alone: its mapping, not the one of --data-path's columns
    assert fields[3].default == {} and fields[3].by_dataset == {"jsonl:own.jsonl": {"prompt": "question"}}
    flags = [parser().parse_args(pipeline.step_argv(step, args, tiny=True)) for step, parser in parsers.items()]
    pipeline.check_data_fields_name_the_steps_datasets(args, flags)
    for step, parsed in enumerate(flags, 1):  # (each step's own check, as check_step_args makes it)
        parse_data_fields(parsed.data_fields).check_names([*parsed.data_path, *getattr(parsed, "sft_only_data_path",
                                                                                       [])])


def test_a_tool_reads_its_files_own_mapping(tmp_path, capsys):
    from dschat.tools.records import load_records

    qa, alpaca = two_files(tmp_path)
    records = load_records(alpaca, f"{alpaca}:prompt=instruction,chosen=output", limit=2)
    assert [record.chosen for record in records] == ["Alpaca output 0.", "Alpaca output 1."]
    with pytest.raises(UsageError, match=r"--data_fields: '.*qa.jsonl' is not a dataset of the file read here"):
        load_records(alpaca, f"{qa}:prompt=question;{alpaca}:prompt=instruction,chosen=output")


def test_ppo_eval_names_the_runs_datasets_as_its_data_path_does(tmp_path):
    """ppo_eval takes a step-3 run's --data_path as paths from where it runs; the run's mappings per dataset named
    them as the run gave them (relative to its folder), and would name no dataset of the anchored --data_path."""
    from dschat.tools import ppo_eval

    actor = tmp_path / "out" / "actor"
    actor.mkdir(parents=True)
    (actor / "config.json").write_text("{}")
    write_jsonl(tmp_path / "q.jsonl", [{"question": "Why?"}])
    write_jsonl(tmp_path / "a.jsonl", [{"instruction": "Say why."}])
    (actor.parent / "training_args.json").write_text(json.dumps(
        {"step": "step3", "world_size": 1, "cwd": str(tmp_path),
         "flags": {"data_path": ["jsonl:q.jsonl", "jsonl:a.jsonl"],
                   "data_fields": "jsonl:q.jsonl:prompt=question;jsonl:a.jsonl:prompt=instruction"}}))
    args = ppo_eval.parse_args(["--policy", str(actor)])
    assert args.data_path == [f"jsonl:{tmp_path / 'q.jsonl'}", f"jsonl:{tmp_path / 'a.jsonl'}"]
    fields = parse_data_fields(args.data_fields)
    fields.check_names(args.data_path)
    assert fields.for_spec(args.data_path[1]) == {"prompt": "instruction"}


def test_rw_eval_reads_the_step_2_files_own_mapping(tmp_path):
    """rw_eval reads a step-2 run's one file with the run's --data_fields: the file's own mapping where they give one
    per dataset (as the file's path anchored to the run's folder, it is no longer the name they give)."""
    import argparse

    from dschat.tools import rw_eval

    model = tmp_path / "rm"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "value_head.safetensors").write_bytes(b"")  # (found by its name: a reward model's folder)
    write_jsonl(tmp_path / "pairs.jsonl", [{"q": "Why?", "good": "Because.", "bad": "No."}])
    (model / "training_args.json").write_text(json.dumps({"step": "step2", "cwd": str(tmp_path), "flags": {
        "data_path": ["jsonl:pairs.jsonl"], "data_fields": "jsonl:pairs.jsonl:prompt=q,chosen=good,rejected=bad"}}))
    defaults, _ = rw_eval.step2_run_defaults(argparse.Namespace(model_name_or_path=str(model), pairs_file=None,
                                                                prompt=None, data_split=None))
    assert defaults["pairs_file"] == f"jsonl:{tmp_path / 'pairs.jsonl'}"
    assert parse_field_map(defaults["data_fields"]) == {"prompt": "q", "chosen": "good", "rejected": "bad"}


def test_train_py_refuses_a_mapping_of_a_dataset_it_does_not_read_before_the_first_step(tmp_path, distributed):
    import runpy

    from dschat import pipeline

    qa, alpaca = two_files(tmp_path)
    args = runpy.run_path(str(REPO / "train.py"))["parse_args"]([
        "--step", "1", "--output-dir", str(tmp_path / "out"), "--data-path", qa,
        "--data-fields", f"{qa}:prompt=question,chosen=answer;{alpaca}:prompt=instruction,chosen=output"])
    with pytest.raises(UsageError, match=rf"--data-fields: '{re.escape(alpaca)}' is not a dataset of --data-path or "
                                         r"a step's --data_path or --sft_only_data_path"):
        pipeline.run_pipeline(args)
    assert not (tmp_path / "out").exists(), "no step may have run"


def test_the_notebook_api_takes_a_dict_per_dataset(tmp_path, tokenizer):
    qa, alpaca = two_files(tmp_path)
    train, eval_ = build(tmp_path, tokenizer, [qa, alpaca], {qa: {"prompt": "question", "chosen": "answer"},
                                                             alpaca: {"prompt": "instruction", "chosen": "output"}})
    assert len(train) + len(eval_) == 12
    with pytest.raises(UsageError, match="one mapping .* or one per dataset"):
        build(tmp_path, tokenizer, [qa, alpaca], {qa: {"prompt": "question"}, "chosen": "answer"})


def test_rw_eval_data_split_reads_its_files_own_mapping(tmp_path, capsys):
    """rw_eval --data_split (step 2's held-out pairs of --pairs_file) takes --data_fields as rw_eval without it does:
    the file's own mapping where they give one per dataset. It refused that form ("one mapping of this data's fields
    is read here"), which the same rw_eval read without --data_split."""
    from dschat.tools.records import load_phase_held_out

    qa, alpaca = two_files(tmp_path)
    records = load_phase_held_out(alpaca, f"{alpaca}:prompt=instruction,chosen=output", "0,1,0", 1234, 2)
    assert records and all(record.chosen.startswith("Alpaca output ") for record in records)
    assert records == load_phase_held_out(alpaca, "prompt=instruction,chosen=output", "0,1,0", 1234, 2)
    with pytest.raises(UsageError, match=r"--data_fields: '.*qa.jsonl' is not a dataset of the file read here"):
        load_phase_held_out(alpaca, f"{qa}:prompt=question;{alpaca}:prompt=instruction,chosen=output", "0,1,0",
                            1234, 2)


def qa_folder(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"question": f"Question {i}?", "answer": f"QA answer {i}."} for i in range(6)])


@pytest.mark.parametrize("data_path, named", [
    ("jsonl:qa.jsonl", "./qa.jsonl"),
    ("./qa.jsonl", "jsonl:qa.jsonl"),
    ("qa.jsonl", "{tmp}/sub/../qa.jsonl"),
    ("folder/", "folder"),
    ("folder", "jsonl:./folder/"),
])
def test_a_dataset_is_named_by_any_spelling_of_its_path(tmp_path, tokenizer, monkeypatch, data_path, named):
    """--data_fields names a dataset as --data_path resolves it: another spelling of the same files (./, a trailing
    '/', the type written or not) was 'not a dataset of --data_path', and its mapping renamed nothing."""
    monkeypatch.chdir(tmp_path)
    two_files(tmp_path)
    qa_folder(tmp_path)
    (tmp_path / "sub").mkdir()
    fields = f"{named.format(tmp=tmp_path)}:prompt=question,chosen=answer"
    parse_data_fields(fields).check_names([data_path, "jsonl:alpaca.jsonl"])
    assert parse_data_fields(fields).for_spec(data_path) == {"prompt": "question", "chosen": "answer"}
    assert parse_data_fields(fields).of_datasets([data_path]).by_dataset  # (a step given that dataset gets it)
    train, eval_ = build(tmp_path, tokenizer, [data_path], fields)
    assert any("Question 3?" in text and "QA answer 3." in text
               for text in texts(train, tokenizer) + texts(eval_, tokenizer))


def test_two_spellings_of_one_dataset_and_a_dataset_not_given_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    two_files(tmp_path)
    both = parse_data_fields("jsonl:qa.jsonl:prompt=question;./qa.jsonl:prompt=answer")
    with pytest.raises(UsageError, match=r"'jsonl:qa.jsonl' and './qa.jsonl' are one dataset \(qa.jsonl of "
                                         r"--data_path\), given two mappings"):
        both.check_names(["qa.jsonl", "alpaca.jsonl"])
    other = parse_data_fields("./alpaca.jsonl:prompt=instruction;elsewhere.jsonl:prompt=question")
    with pytest.raises(UsageError, match=r"'elsewhere.jsonl' is not a dataset of --data_path \(qa.jsonl, "
                                         r"alpaca.jsonl\): name each"):
        other.check_names(["qa.jsonl", "alpaca.jsonl"])
    assert other.for_spec("qa.jsonl") == {}  # (a dataset of no mapping of its own gets the default: none)


@pytest.mark.parametrize("fields", ["prompt=question,chosen=answer",
                                    "prompt=question,chosen=answer;jsonl:alpaca.jsonl:"])
def test_a_steps_own_data_path_of_another_spelling_of_data_paths_files_gets_its_fields(tmp_path, monkeypatch, fields):
    """A step whose --stepN-args give it --data-path's file spelt otherwise (./qa.jsonl for jsonl:qa.jsonl) read
    other files, train.py judged, and got none of --data-fields' mapping: its records' fields went unrenamed."""
    import runpy

    from dschat import pipeline
    from dschat.args import step2_parser

    monkeypatch.chdir(tmp_path)
    two_files(tmp_path)
    args = runpy.run_path(str(REPO / "train.py"))["parse_args"]([
        "--actor-model", "tiny-llama", "--data-path", "jsonl:qa.jsonl", "jsonl:alpaca.jsonl", "--data-fields", fields,
        "--step2-args", "--data_path ./qa.jsonl"])
    assert not pipeline.reads_own_data_without_fields(2, args)
    step2 = step2_parser().parse_args(pipeline.step_argv(2, args, tiny=True))
    assert parse_data_fields(step2.data_fields).for_spec("./qa.jsonl") == {"prompt": "question", "chosen": "answer"}


def test_a_dataset_path_with_an_equals_sign_is_named_in_the_per_dataset_form(tmp_path, tokenizer):
    """A Hive-style folder (lang=en/) in a dataset's path: the group was split at its first '=', so the path's head
    read as a field's name ("unknown data field(s) ['jsonl:.../lang']"). The dataset ends at the ':' before the first
    renamable field's name; a misspelt field is still refused by its name."""
    (tmp_path / "lang=en").mkdir()
    qa = write_jsonl(tmp_path / "lang=en" / "qa.jsonl", [{"question": f"Question {i}?", "answer": f"QA answer {i}."}
                                                        for i in range(6)])
    _, alpaca = two_files(tmp_path)
    fields = f"{qa}:prompt=question,chosen=answer;{alpaca}:prompt=instruction,chosen=output"
    assert parse_data_fields(fields).by_dataset == {qa: {"prompt": "question", "chosen": "answer"},
                                                    alpaca: {"prompt": "instruction", "chosen": "output"}}
    train, eval_ = build(tmp_path, tokenizer, [qa, alpaca], fields)
    read = texts(train, tokenizer) + texts(eval_, tokenizer)
    assert sum("QA answer" in text for text in read) == 6 and sum("Alpaca output" in text for text in read) == 6
    with pytest.raises(UsageError, match=r"--data_fields \(of .*qa.jsonl\): unknown data field\(s\) \['promt'\]"):
        parse_data_fields(f"{qa}:promt=question")
    assert parse_data_fields("prompt=x;y:z").default == {"prompt": "x;y:z"}  # (the old form's column, as before)


def test_a_misspelt_field_of_a_typed_dataset_in_a_hive_folder_is_refused_by_its_name():
    """jsonl:lang=en/qa.jsonl:promt=q: no renamable field's name, so the group's dataset ended at its first ':' before
    a name and '=', the type's: the mapping was read as "lang=en/qa.jsonl:promt=q" of a dataset 'jsonl', refused as
    "(of jsonl): unknown data field(s) ['lang']", naming neither the dataset nor the misspelt field."""
    with pytest.raises(UsageError, match=r"--data_fields \(of jsonl:lang=en/qa.jsonl\): unknown data field\(s\) "
                                         r"\['promt'\]"):
        parse_data_fields("jsonl:lang=en/qa.jsonl:promt=question")
    assert parse_data_fields("jsonl:lang=en/qa.jsonl:prompt=question").by_dataset == {
        "jsonl:lang=en/qa.jsonl": {"prompt": "question"}}


def test_a_typed_dataset_in_a_hive_folder_keyed_by_a_field_name_keeps_its_path():
    """jsonl:label=good/qa.jsonl:prompt=q, a folder partitioned by a key that is also a renamable field's name: the
    group's dataset ended at the type's ':' (the first ':' before a renamable name and '='), so the dataset read as
    'jsonl' and the mapping as "label=good/qa.jsonl:prompt=q", the label renamed to a column of that name."""
    assert parse_data_fields("jsonl:label=good/qa.jsonl:prompt=question").by_dataset == {
        "jsonl:label=good/qa.jsonl": {"prompt": "question"}}
    assert parse_data_fields("jsonl:qa.jsonl:label=verdict").by_dataset == {"jsonl:qa.jsonl": {"label": "verdict"}}


def test_a_data_fields_dict_and_its_text_are_the_same_renaming(tmp_path):
    """A notebook's data_fields dict (kept so in a checkpoint's or a run's record) was parsed as text by
    same_data_fields, failed, and was compared with the text as written: a resume from the command line with the same
    renaming was taken as another (a finished step rerun, a checkpoint refused)."""
    from dschat.data.fields import same_data_fields

    qa, alpaca = two_files(tmp_path)
    assert same_data_fields({"prompt": "question", "chosen": "answer"}, "chosen=answer,prompt=question")
    assert same_data_fields("prompt=question,chosen=answer", {"prompt": "question", "chosen": "answer"})
    per_dataset = f"{qa}:prompt=question,chosen=answer;{alpaca}:prompt=instruction,chosen=output"
    as_dict = {alpaca: {"prompt": "instruction", "chosen": "output"}, qa: {"prompt": "question", "chosen": "answer"}}
    assert same_data_fields(as_dict, per_dataset) and same_data_fields(per_dataset, as_dict)
    assert not same_data_fields({"prompt": "question"}, "prompt=instruction")
    assert not same_data_fields({qa: {"prompt": "question"}}, "prompt=question")  # (its dataset's alone, not all)
    assert same_data_fields(None, {}) and same_data_fields("", None)


def test_a_step_given_a_data_fields_dict_from_a_notebook_passes_its_checks(tmp_path):
    """sft.main({..., "data_fields": {...}}) (steps 1, 2 and DPO take a notebook's dict of settings; the data pipeline
    reads a data_fields dict) failed in the step's early checks, which parsed the dict as text ("--data_fields item
    "{'prompt': 'question'" must look like 'prompt=question'"). The dict is read as the mapping it is: checked against
    --data_path as its text would be."""
    from dschat.args import step1_parser, step_settings
    from dschat.steps.common import check_supervised_settings

    qa, alpaca = two_files(tmp_path)
    for data_fields in ({"prompt": "question", "chosen": "answer"}, {qa: {"prompt": "question", "chosen": "answer"}}):
        check_supervised_settings(step_settings(step1_parser(), {"data_path": [qa], "data_fields": data_fields}), 1)
    other = step_settings(step1_parser(), {"data_path": [qa], "data_fields": {alpaca: {"prompt": "instruction"}}})
    with pytest.raises(UsageError, match=rf"--data_fields: '{re.escape(alpaca)}' is not a dataset of --data_path"):
        check_supervised_settings(other, 1)


def test_a_step_given_one_dataset_as_a_string_from_a_notebook_checks_its_data_fields_against_it(tmp_path):
    """sft.main({"data_path": "jsonl:my.jsonl", ...}) (README's notebook form; the data pipeline reads one name as a
    string) with --data_fields given for that dataset was refused: the check unpacked the string into its characters
    ("is not a dataset of --data_path ... (j, s, o, n, l, :, ...)")."""
    from dschat.args import step1_parser, step_settings
    from dschat.steps.common import check_supervised_settings

    qa, alpaca = two_files(tmp_path)
    check_supervised_settings(step_settings(step1_parser(), {"data_path": qa, "sft_only_data_path": alpaca,
                                                             "data_fields": f"{qa}:prompt=question,chosen=answer;"
                                                                            f"{alpaca}:prompt=instruction"}), 1)
    other = step_settings(step1_parser(), {"data_path": qa, "data_fields": f"{alpaca}:prompt=instruction"})
    with pytest.raises(UsageError, match=rf"is not a dataset of --data_path or --sft_only_data_path \({re.escape(qa)}\)"):
        check_supervised_settings(other, 1)


def test_the_eval_tools_read_a_notebook_runs_data_fields_dict(tmp_path):
    """A step run from a notebook with a data_fields dict (ppo.main({... "data_fields": {...}})) records the dict in
    its training_args.json; ppo_eval and rw_eval, taking the run's --data_fields as their default, parsed it as text
    and refused it ("--data_fields item "{'prompt': 'question'" must look like 'prompt=question'"). They read it as
    the mapping it is, and go on with its text."""
    import argparse

    from dschat.tools import ppo_eval, rw_eval

    actor = tmp_path / "out" / "actor"
    actor.mkdir(parents=True)
    (actor / "config.json").write_text("{}")
    write_jsonl(tmp_path / "q.jsonl", [{"question": "Why?"}])
    write_jsonl(tmp_path / "a.jsonl", [{"instruction": "Say why."}])
    q, a = f"jsonl:{tmp_path / 'q.jsonl'}", f"jsonl:{tmp_path / 'a.jsonl'}"
    for data_fields, expected in (({"prompt": "question"}, {q: {"prompt": "question"}, a: {"prompt": "question"}}),
                                  ({"jsonl:q.jsonl": {"prompt": "question"}, "jsonl:a.jsonl": {"prompt": "instruction"}},
                                   {q: {"prompt": "question"}, a: {"prompt": "instruction"}})):
        (actor.parent / "training_args.json").write_text(json.dumps(
            {"step": "step3", "world_size": 1, "cwd": str(tmp_path),
             "flags": {"data_path": ["jsonl:q.jsonl", "jsonl:a.jsonl"], "data_fields": data_fields}}))
        args = ppo_eval.parse_args(["--policy", str(actor)])
        fields = parse_data_fields(args.data_fields)
        fields.check_names(args.data_path)
        assert {spec: fields.for_spec(spec) for spec in args.data_path} == expected

    model = tmp_path / "rm"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "value_head.safetensors").write_bytes(b"")  # (found by its name: a reward model's folder)
    write_jsonl(tmp_path / "pairs.jsonl", [{"q": "Why?", "good": "Because.", "bad": "No."}])
    for data_fields in ({"prompt": "q", "chosen": "good", "rejected": "bad"},
                        {"jsonl:pairs.jsonl": {"prompt": "q", "chosen": "good", "rejected": "bad"}}):
        (model / "training_args.json").write_text(json.dumps({"step": "step2", "cwd": str(tmp_path), "flags": {
            "data_path": ["jsonl:pairs.jsonl"], "data_fields": data_fields}}))
        defaults, _ = rw_eval.step2_run_defaults(argparse.Namespace(model_name_or_path=str(model), pairs_file=None,
                                                                    prompt=None, data_split=None))
        assert parse_field_map(defaults["data_fields"]) == {"prompt": "q", "chosen": "good", "rejected": "bad"}
