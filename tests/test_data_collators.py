"""Collators (padding sides, label masks, reward layout) and step 3's unsupervised data."""
import argparse
import json
import os
import re

import pandas as pd
import pytest
import torch
from torch.utils.data import DataLoader

from dschat.args import (resolve_pad_to_multiple_of, step1_parser, step2_dpo_parser, step2_parser,
                         step3_parser)
from dschat.data import (DataCollatorReward, DataCollatorRLHF, DataCollatorSFT, DatasetFormatError,
                         create_prompt_dataset, format_prompt, get_unsupervised_data, pad_sequences)
from helpers import hub_cache_snapshot

PAD = 1
T = torch.tensor




def test_pad_sequences_both_sides():
    seqs = [T([5, 6, 7]), T([8])]
    assert pad_sequences(seqs, 0).tolist() == [[5, 6, 7], [8, 0, 0]]
    assert pad_sequences(seqs, 0, side="left").tolist() == [[5, 6, 7], [0, 0, 8]]
    assert pad_sequences(seqs, 0, side="left", length=4).tolist() == [[0, 5, 6, 7], [0, 0, 0, 8]]
    with pytest.raises(ValueError, match="padding side"):
        pad_sequences(seqs, 0, side="middle")


def test_sft_collator_right_pads_with_ignored_labels():
    items = [{"input_ids": T([10, 11, 12, 13]), "attention_mask": T([1, 1, 1, 1]), "labels": T([-100, -100, 12, 13])},
             {"input_ids": T([20, 21]), "attention_mask": T([1, 1]), "labels": T([-100, 21])}]
    batch = DataCollatorSFT(PAD)(items)
    assert batch["input_ids"].tolist() == [[10, 11, 12, 13], [20, 21, PAD, PAD]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, 12, 13], [-100, 21, -100, -100]]


def test_reward_collator_puts_chosen_rows_first_then_rejected():
    items = [{"chosen_input_ids": T([1, 2, 3]), "chosen_attention_mask": T([1, 1, 1]),
              "rejected_input_ids": T([1, 2]), "rejected_attention_mask": T([1, 1])},
             {"chosen_input_ids": T([4]), "chosen_attention_mask": T([1]),
              "rejected_input_ids": T([4, 5, 6, 7]), "rejected_attention_mask": T([1, 1, 1, 1])}]
    batch = DataCollatorReward(0)(items)
    assert batch["input_ids"].shape == (4, 4)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [4, 0, 0, 0], [1, 2, 0, 0], [4, 5, 6, 7]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]


def test_reward_collator_carries_each_pairs_margin_beside_its_padded_rows():
    """TRL's RewardTrainer's margin: one per pair, in the pairs' order (row i and row B + i), through the padding of
    rows of other lengths; an item without one (DeepSpeed-Chat's, a user's dataset) has 0."""
    items = [{"chosen_input_ids": T([1, 2, 3]), "chosen_attention_mask": T([1, 1, 1]),
              "rejected_input_ids": T([1, 2]), "rejected_attention_mask": T([1, 1]), "margin": 1.5},
             {"chosen_input_ids": T([4]), "chosen_attention_mask": T([1]),
              "rejected_input_ids": T([4, 5, 6, 7, 8]), "rejected_attention_mask": T([1] * 5), "margin": -0.25},
             {"chosen_input_ids": T([9, 9]), "chosen_attention_mask": T([1, 1]),
              "rejected_input_ids": T([9]), "rejected_attention_mask": T([1])}]
    batch = DataCollatorReward(0, pad_to_multiple_of=4)(items)
    assert batch["input_ids"].shape == (6, 8)
    assert batch["margin"].dtype == torch.float32 and batch["margin"].tolist() == [1.5, -0.25, 0.0]
    assert batch["attention_mask"].sum(1).tolist() == [3, 1, 2, 2, 5, 1]  # (the rows the margins go with)


def test_rlhf_collator_left_pads_prompts_and_passes_lists_through():
    items = [{"prompt_input_ids": T([7, 8, 9]), "prompt_text": "a", "messages": [{"role": "user", "content": "a"}],
              "task": "x"},
             {"prompt_input_ids": T([5]), "prompt_text": "b", "messages": [{"role": "user", "content": "b"}]}]
    batch = DataCollatorRLHF(max_prompt_len=4, pad_token_id=PAD)(items)
    assert batch["prompt"].tolist() == [[7, 8, 9], [PAD, PAD, 5]]
    assert batch["prompt_att_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch["prompt_text"] == ["a", "b"] and batch["messages"][1] == [{"role": "user", "content": "b"}]
    assert batch["task"] == ["x", None]
    with pytest.raises(ValueError, match="max_prompt_len"):
        DataCollatorRLHF(max_prompt_len=2, pad_token_id=PAD)(items)


def test_sft_batch_from_the_pipeline_trains_only_on_answer_and_eot(tmp_path, tokenizer):
    rows = [{"prompt": f"Question {i}?" + " more" * i, "chosen": f"Answer {i}.", "rejected": "No."} for i in range(6)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, _ = create_prompt_dataset(0, [f"{path},{path}"], "1,0,0", str(tmp_path / "out"), 1, 1234, tokenizer, 64)
    batch = next(iter(DataLoader(train, batch_size=6, collate_fn=DataCollatorSFT(tokenizer.pad_token_id))))
    for row in range(6):
        trained = batch["labels"][row][batch["labels"][row] != -100]
        decoded = tokenizer.decode(trained)
        assert decoded.startswith(" Answer ") and decoded.endswith(tokenizer.eos_token), decoded
        assert "Question" not in decoded
    padded = batch["attention_mask"] == 0
    assert (batch["input_ids"][padded] == tokenizer.pad_token_id).all() and (batch["labels"][padded] == -100).all()


def test_rlhf_batch_from_the_pipeline_ends_every_row_at_the_generation_point(tmp_path, tokenizer):
    rows = [{"prompt": f"Question {i}?" + " more" * i, "chosen": "A", "rejected": "B"} for i in range(4)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, _ = create_prompt_dataset(0, [f"{path},{path}"], "0,0,1", str(tmp_path / "out"), 3, 1234, tokenizer, 64)
    batch = DataCollatorRLHF(64, pad_token_id=tokenizer.pad_token_id)([train[i] for i in range(4)])
    # left padding: every row's prompt ends in the last column, where generation continues
    assert batch["prompt_att_mask"][:, -1].all() and not batch["prompt_att_mask"][:, 0].all()
    assert (batch["prompt"][:, -1] == train[0]["prompt_input_ids"][-1]).all()
    for row, text in enumerate(batch["prompt_text"]):
        assert text == format_prompt(batch["messages"][row], tokenizer)
        assert tokenizer.decode(batch["prompt"][row][batch["prompt_att_mask"][row].bool()]) == text


# --- --pad_to_multiple_of: batch lengths rounded up, so few shapes reach the models ---

def test_pad_sequences_rounds_the_longest_up_to_a_multiple():
    seqs = [T([1, 2, 3, 4, 5]), T([6, 7, 8, 9, 10, 11, 12])]
    assert pad_sequences(seqs, 0, multiple_of=4).shape == (2, 8)
    assert pad_sequences(seqs, 0, side="left", multiple_of=4)[0].tolist() == [0, 0, 0, 1, 2, 3, 4, 5]
    assert pad_sequences(seqs, 0, multiple_of=7).shape == (2, 7)  # already a multiple
    assert pad_sequences(seqs, 0).shape == (2, 7)  # default 1: the longest, as before
    assert pad_sequences(seqs, 0, length=9, multiple_of=4).shape == (2, 9)  # an explicit length wins
    assert pad_sequences(seqs, 0, multiple_of=4, max_length=7).shape == (2, 7)  # never past the data's limit
    assert pad_sequences(seqs, 0, multiple_of=4, max_length=6).shape == (2, 7)  # nor shorter than the longest
    for bad in (0, -4):
        with pytest.raises(ValueError, match="pad_to_multiple_of must be a positive integer"):
            pad_sequences(seqs, 0, multiple_of=bad)


def test_sft_and_reward_collators_pad_to_a_multiple_with_masked_columns():
    items = [{"input_ids": T([10, 11, 12, 13, 14]), "attention_mask": T([1] * 5), "labels": T([-100, 11, 12, 13, 14])},
             {"input_ids": T([20] * 7), "attention_mask": T([1] * 7), "labels": T([21] * 7)}]
    batch = DataCollatorSFT(PAD, pad_to_multiple_of=4)(items)
    assert {k: v.shape for k, v in batch.items()} == {k: (2, 8) for k in batch}
    assert batch["input_ids"][:, 7:].eq(PAD).all() and batch["attention_mask"][:, 7:].eq(0).all()
    assert batch["labels"][:, 7:].eq(-100).all()
    assert batch["input_ids"][:, :7].tolist() == DataCollatorSFT(PAD)(items)["input_ids"].tolist()
    capped = DataCollatorSFT(PAD, pad_to_multiple_of=4, max_length=7)(items)  # --max_seq_len 7: position tables
    assert {k: v.shape for k, v in capped.items()} == {k: (2, 7) for k in capped}
    pairs = [{"chosen_input_ids": T([1] * 5), "chosen_attention_mask": T([1] * 5),
              "rejected_input_ids": T([2] * 7), "rejected_attention_mask": T([1] * 7)}]
    batch = DataCollatorReward(0, pad_to_multiple_of=4)(pairs)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (2, 8)
    assert batch["attention_mask"].sum(1).tolist() == [5, 7]
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        DataCollatorSFT(PAD, pad_to_multiple_of=0)  # at construction, not at the first batch


def test_rlhf_collator_rounds_prompts_up_but_never_past_max_prompt_len():
    items = [{"prompt_input_ids": T([7, 8, 9, 10, 11])}, {"prompt_input_ids": T([5])}]
    batch = DataCollatorRLHF(max_prompt_len=16, pad_token_id=PAD, pad_to_multiple_of=4)(items)
    assert batch["prompt"].tolist() == [[PAD] * 3 + [7, 8, 9, 10, 11], [PAD] * 7 + [5]]
    assert batch["prompt_att_mask"].tolist() == [[0] * 3 + [1] * 5, [0] * 7 + [1]]
    # DeepSpeed-Chat's (max_size, inference_tp_size): not taken as the pad id, and said so ("takes 2 positional
    # arguments but 3 were given" said neither)
    with pytest.raises(TypeError, match=r"DataCollatorRLHF\(16, 1\): the pad id is the keyword pad_token_id "
                                        r"\(DataCollatorRLHF\(max_prompt_len, pad_token_id=tokenizer.pad_token_id\)\); "
                                        r"DeepSpeed-Chat's DataCollatorRLHF\(max_size, inference_tp_size\) is not taken"):
        DataCollatorRLHF(16, 1)
    for missing in ({}, {"pad_token_id": None}):  # (None failed at the first batch)
        with pytest.raises(TypeError, match=r"DataCollatorRLHF needs pad_token_id=tokenizer.pad_token_id"):
            DataCollatorRLHF(16, **missing)
    # 5 rounds up to 8, but no prompt batch is longer than max_prompt_len
    capped = DataCollatorRLHF(max_prompt_len=6, pad_token_id=PAD, pad_to_multiple_of=4)(items)
    assert capped["prompt"].shape == capped["prompt_att_mask"].shape == (2, 6)
    assert capped["prompt"][:, -1].tolist() == [11, 5]  # still left-padded: every prompt ends in the last column
    unlimited = DataCollatorRLHF(max_prompt_len=None, pad_token_id=PAD, pad_to_multiple_of=4)(items)
    assert unlimited["prompt"].shape == (2, 8)


@pytest.mark.parametrize("parser", [step1_parser, step2_parser, step2_dpo_parser, step3_parser])
def test_every_step_takes_pad_to_multiple_of(parser, capsys):
    assert parser().parse_args([]).pad_to_multiple_of is None  # auto
    assert parser().parse_args(["--pad_to_multiple_of", "auto"]).pad_to_multiple_of is None
    assert parser().parse_args(["--pad_to_multiple_of", "8"]).pad_to_multiple_of == 8
    for bad in ("0", "-8", "x"):
        with pytest.raises(SystemExit):
            parser().parse_args(["--pad_to_multiple_of", bad])
        assert "argument --pad_to_multiple_of: expected a positive integer or 'auto'" in capsys.readouterr().err


def test_pad_to_multiple_of_auto_is_64_on_cuda_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_pad_to_multiple_of(None) == resolve_pad_to_multiple_of("auto") == 64
    assert resolve_pad_to_multiple_of(8) == 8 and resolve_pad_to_multiple_of(1) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_pad_to_multiple_of(None) == 1  # CPU runs keep their shapes and numbers
    assert resolve_pad_to_multiple_of(8) == 8
    for bad in (0, -1, 2.5, True, "8"):
        with pytest.raises(ValueError, match=r"--pad_to_multiple_of must be a positive integer"):
            resolve_pad_to_multiple_of(bad)


# --- unsupervised data ---

def unsupervised_args(name, **overrides):
    return {"unsupervised_dataset_name": name, "unsupervised_dataset_config_name": None,
            "max_prompt_seq_len": 6, "max_answer_seq_len": 4, **overrides}


def test_unsupervised_jsonl_is_grouped_into_blocks(tmp_path, tokenizer):
    path = tmp_path / "text.jsonl"
    docs = [f"Document number {i} says something about topic {i}." for i in range(12)]
    path.write_text("".join(json.dumps({"text": d, "source": "x"}) + "\n" for d in docs))
    data = get_unsupervised_data(unsupervised_args(str(path)), tokenizer)
    lengths = [len(tokenizer(d)["input_ids"]) + 1 for d in docs]  # each document ended by the EOS token
    assert len(data) == sum(lengths) // 10 and len(data) > 3
    item = data[0]
    assert set(item) == {"input_ids", "attention_mask", "labels"}
    assert item["input_ids"].shape == (10,) and item["input_ids"].dtype == torch.long
    assert torch.equal(item["labels"], item["input_ids"]) and item["attention_mask"].all()
    ids = torch.cat([data[i]["input_ids"] for i in range(len(data))])
    ends = (ids == tokenizer.eos_token_id).nonzero().flatten().tolist()
    assert ends == [sum(lengths[:k + 1]) - 1 for k in range(len(ends))] and len(ends) >= len(docs) - 2
    blocks_text = "".join(tokenizer.decode(data[i]["input_ids"], skip_special_tokens=True) for i in range(len(data)))
    assert "".join(docs).startswith(blocks_text) and len(blocks_text) > len(docs[0])  # in order, only the tail cut


def test_unsupervised_text_file_and_namespace_args(tmp_path, tokenizer):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(f"line {i} of plain text here" for i in range(20)) + "\n")
    args = argparse.Namespace(**unsupervised_args(f"text:{path}", preprocessing_num_workers=None))
    data = get_unsupervised_data(args, tokenizer)
    assert len(data) > 5 and all(len(data[i]["input_ids"]) == 10 for i in range(len(data)))


def test_blank_lines_of_an_unsupervised_text_file_are_skipped_and_counted(tmp_path, tokenizer, capsys):
    """A whitespace-only line was a document of its own: its spaces and an EOS were trained on, without a word."""
    lines = [f"line {i} of plain text here" for i in range(20)]
    plain, blanks = tmp_path / "plain.txt", tmp_path / "blanks.txt"
    plain.write_text("\n".join(lines) + "\n")
    blanks.write_text("\n".join(line + "\n   \n\t" if i % 5 == 0 else line for i, line in enumerate(lines)) + "\n\n")
    expected = get_unsupervised_data(unsupervised_args(str(plain)), tokenizer)
    data = get_unsupervised_data(unsupervised_args(str(blanks)), tokenizer)
    assert [data[i]["input_ids"].tolist() for i in range(len(data))] == \
        [expected[i]["input_ids"].tolist() for i in range(len(expected))]
    assert data.skip_report[0]["skipped"] == {"blank text (empty or whitespace only)": 9}
    assert (f"[dschat.data] phase 3 --unsupervised_dataset_name {blanks} train: skipped 9 of 29 records: 9 blank "
            "text (empty or whitespace only)") in capsys.readouterr().out


def test_an_unsupervised_file_of_blank_lines_only_is_an_error_naming_it_before_tokenizing(tmp_path, tokenizer,
                                                                                         monkeypatch):
    """A .txt file of blank lines was read as blank documents, all skipped, and said only after tokenizing as 0
    blocks, fewer than a batch ("give more text"); a JSON Lines file whose texts are all blank likewise."""
    from dschat.data import unsupervised

    monkeypatch.setattr(unsupervised, "with_eos", lambda *a: pytest.fail("tokenized"))
    blanks = tmp_path / "blanks.txt"
    blanks.write_text("\n   \n\t\n\n")
    with pytest.raises(DatasetFormatError, match=rf"--unsupervised_dataset_name {blanks}: {blanks} has only blank "
                                                 "lines: no documents"):
        get_unsupervised_data(unsupervised_args(str(blanks)), tokenizer)
    with pytest.raises(DatasetFormatError, match=rf"{blanks} has only blank lines"):
        unsupervised.check_unsupervised_file(f"text:{blanks}")
    texts = tmp_path / "blank_texts.jsonl"
    texts.write_text("".join(json.dumps({"text": text}) + "\n" for text in ("", "  ", "\n\t")))
    with pytest.raises(DatasetFormatError, match=rf"--unsupervised_dataset_name {texts}: all 3 of its documents are "
                                                 r"blank \(empty or whitespace only\)"):
        get_unsupervised_data(unsupervised_args(str(texts)), tokenizer)


def test_an_unsupervised_file_edited_with_its_time_kept_is_read_again(tmp_path, tokenizer):
    """datasets keys its Arrow cache of a local file by path and time: an edit that kept them read the old text."""
    import os

    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(f"line {i} of plain text here" for i in range(20)) + "\n")
    get_unsupervised_data(unsupervised_args(f"text:{path}"), tokenizer)
    stat = os.stat(path)
    path.write_text(path.read_text().replace("plain", "PLAIN"))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    data = get_unsupervised_data(unsupervised_args(f"text:{path}"), tokenizer)
    text = "".join(tokenizer.decode(data[i]["input_ids"]) for i in range(len(data)))
    assert "PLAIN" in text and "plain" not in text


def test_step3_preprocessing_num_workers_tokenizes_the_unsupervised_data_in_parallel(tmp_path, tokenizer):
    from dschat.args import step3_parser

    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(f"line {i} of plain text here" for i in range(40)) + "\n")
    args = step3_parser().parse_args(["--unsupervised_dataset_name", f"text:{path}", "--max_prompt_seq_len", "6",
                                      "--max_answer_seq_len", "4", "--preprocessing_num_workers", "2"])
    parallel = get_unsupervised_data(args, tokenizer)
    serial = get_unsupervised_data(argparse.Namespace(**{**vars(args), "preprocessing_num_workers": None}), tokenizer)
    assert args.preprocessing_num_workers == 2
    assert [parallel[i]["input_ids"].tolist() for i in range(len(parallel))] == \
        [serial[i]["input_ids"].tolist() for i in range(len(serial))]


def test_unsupervised_local_file_needs_a_text_field(tmp_path, tokenizer):
    path = tmp_path / "notext.jsonl"
    path.write_text(json.dumps({"body": "hello"}) + "\n")
    with pytest.raises(DatasetFormatError, match=r"notext.jsonl: unsupervised data needs a 'text' field.*body"):
        get_unsupervised_data(unsupervised_args(str(path)), tokenizer)


def test_a_mistyped_or_empty_unsupervised_file_is_named_not_looked_up_on_the_hub(tmp_path, tokenizer, monkeypatch):
    from datasets import Dataset

    from dschat.errors import MissingInputError

    monkeypatch.setattr("dschat.data.base.load_hub_dataset", lambda *a, **k: pytest.fail("looked up on the hub"))
    with pytest.raises(MissingInputError, match=r"--unsupervised_dataset_name .*unsupp.txt: unsupervised data file "
                                                r"not found"):
        get_unsupervised_data(unsupervised_args(str(tmp_path / "unsupp.txt")), tokenizer)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DatasetFormatError, match=r"--unsupervised_dataset_name .*empty.txt: .*empty.txt is empty"):
        get_unsupervised_data(unsupervised_args(str(tmp_path / "empty.txt")), tokenizer)
    Dataset.from_dict({"text": ["a saved folder named like a file"] * 4}).save_to_disk(str(tmp_path / "corpus.json"))
    assert len(get_unsupervised_data(unsupervised_args(str(tmp_path / "corpus.json")), tokenizer)) >= 1


def test_a_compressed_unsupervised_file_is_read_by_its_inner_extension_not_looked_up_on_the_hub(tmp_path, tokenizer,
                                                                                                 monkeypatch):
    # corpus.txt.gz was taken for a hub name ("not in the datasets cache ..."), though txt:corpus.txt.gz reads it; a
    # compressed JSON Lines file is read decompressed, as --data_path's is (it was refused, "decompress it")
    import gzip

    from dschat.data import unsupervised

    monkeypatch.setattr("dschat.data.base.load_hub_dataset", lambda *a, **k: pytest.fail("looked up on the hub"))
    text = tmp_path / "corpus.txt.gz"
    text.write_bytes(gzip.compress("".join(f"document {i} has some words in it\n" for i in range(40)).encode()))
    train, column = unsupervised.load_unsupervised_train(str(text))
    assert column == "text" and train[0]["text"] == "document 0 has some words in it" and len(train) == 40
    records = tmp_path / "docs.jsonl.gz"
    records.write_bytes(gzip.compress(json.dumps({"text": "hello"}).encode() + b"\n"))
    unsupervised.check_unsupervised_file(str(records))
    train, column = unsupervised.load_unsupervised_train(str(records))
    assert column == "text" and train["text"] == ["hello"]


def test_a_compressed_unsupervised_file_of_a_type_is_said_with_its_flag_by_the_pre_flight_check(tmp_path):
    """csv:docs.csv.gz (or docs.jsonl, gzip inside) passed train.py's pre-flight check, and step 3's load said
    "docs.csv.gz: the file is compressed ..." after steps 1 and 2 had trained, naming no flag. (JSON compressed and
    named so, jsonl:docs.jsonl.gz, is read: ``test_a_compressed_unsupervised_file_is_read_by_its_inner_extension``.)"""
    import gzip

    from dschat.data import unsupervised

    (tmp_path / "docs.jsonl").write_bytes(gzip.compress(json.dumps({"text": "hello"}).encode() + b"\n"))
    (tmp_path / "docs.csv.gz").write_bytes(gzip.compress(b"text\nhello\n"))
    packed_csv = tmp_path / "docs.csv.gz"
    for spec, path, said in ((f"csv:{packed_csv}", packed_csv, "which dschat does not read"),
                             (str(tmp_path / "docs.jsonl"), None, "which its name does not say")):
        said = re.escape(f"--unsupervised_dataset_name {spec}" + (f": {path}" if path else "")) + \
            f": the file is compressed with gzip, {said}"
        for read in (unsupervised.check_unsupervised_file, unsupervised.load_unsupervised_train):
            with pytest.raises(DatasetFormatError, match=f"^{said}"):
                read(spec)


@pytest.mark.parametrize("form", ["parquet", "arrow"])
def test_an_unsupervised_binary_table_named_txt_is_told_its_fix(tmp_path, form):
    """A Parquet (or Arrow) file named docs.txt skipped the bytes check the other kinds get and was read as text: "not
    UTF-8 text" or, for Arrow's NULs, "UTF-16?". It is told what it is now, with the flag, by the pre-flight check and
    the load alike: the command given, run, writes docs.parquet, which is read; given as text:PATH (typed), it is
    told the type to give, parquet:PATH, which reads it."""
    import subprocess

    import pyarrow
    import pyarrow.feather

    from dschat.data import unsupervised

    docs = tmp_path / "docs.txt"
    frame = pd.DataFrame({"text": [f"document {i} of plain text" for i in range(8)]})
    if form == "parquet":
        frame.to_parquet(docs)
    else:
        pyarrow.feather.write_feather(pyarrow.table(frame), str(docs))
    what = "a Parquet file" if form == "parquet" else r"an Arrow IPC \(Feather v2\) file"
    typed = f"text:{docs}"
    if form == "parquet":
        for read in (unsupervised.check_unsupervised_file, unsupervised.load_unsupervised_train):
            with pytest.raises(DatasetFormatError, match="^" + re.escape(f"--unsupervised_dataset_name {typed}: "
                                                                         f"{docs}: ") + f"the file is {what}, not "
                                                         rf"text: give it as parquet:{re.escape(str(docs))}$"):
                read(typed)
        assert unsupervised.load_unsupervised_train(f"parquet:{docs}")[0]["text"] == frame["text"].tolist()
    for read in (unsupervised.check_unsupervised_file, unsupervised.load_unsupervised_train):
        with pytest.raises(DatasetFormatError, match="^" + re.escape(f"--unsupervised_dataset_name {docs}: ") +
                           f"the file is {what}, not text") as error:
            read(str(docs))
    subprocess.run(re.search(r"\(((?:mv ).*)\)", str(error.value)).group(1), shell=True, check=True)
    train, column = unsupervised.load_unsupervised_train(str(tmp_path / "docs.parquet"))
    assert train[column] == frame["text"].tolist()


def test_an_unsupervised_gzipped_parquet_file_named_txt_gz_is_told_its_fix_and_a_text_beginning_par1_is_read(
        tmp_path):
    """A Parquet file gzipped as docs.txt.gz passed the pre-flight check (a .txt's compression is the text reader's to
    undo), and step 3's load said "the text compressed in it (gzip) is not UTF-8 ... save the text as UTF-8". It is
    told what it is now, by its decompressed first and last bytes, with the flag, by the pre-flight check and the
    load alike: the commands given, run, write docs.parquet, which is read. A text that merely begins with "PAR1",
    gzipped, is read as the text it is."""
    import gzip
    import io
    import subprocess

    from dschat.data import unsupervised

    docs = tmp_path / "docs.txt.gz"
    frame = pd.DataFrame({"text": [f"document {i} of plain text" for i in range(8)]})
    parquet = io.BytesIO()
    frame.to_parquet(parquet)
    docs.write_bytes(gzip.compress(parquet.getvalue()))
    for read in (unsupervised.check_unsupervised_file, unsupervised.load_unsupervised_train):
        with pytest.raises(DatasetFormatError, match="^" + re.escape(f"--unsupervised_dataset_name {docs}: the file "
                                                                     "is a Parquet file compressed with gzip, not "
                                                                     "text: decompress it to docs.parquet (") +
                           r"(mv .*)\), and it is read as parquet$") as error:
            read(str(docs))
    subprocess.run(re.search(r"\((mv .*)\)", str(error.value)).group(1), shell=True, check=True)
    train, column = unsupervised.load_unsupervised_train(str(tmp_path / "docs.parquet"))
    assert train[column] == frame["text"].tolist()
    text = tmp_path / "notes.txt.gz"
    text.write_bytes(gzip.compress(b"PAR1 opens the first paragraph\nand a second document follows\n"))
    unsupervised.check_unsupervised_file(str(text))
    train, column = unsupervised.load_unsupervised_train(str(text))
    assert train[column] == ["PAR1 opens the first paragraph", "and a second document follows"]


@pytest.mark.parametrize("magic", ["PAR1", "FEA1"])
def test_an_unsupervised_gzipped_text_that_begins_and_ends_with_a_tables_magic_is_read_as_text(tmp_path, magic):
    """docs.txt.gz is looked inside for a binary table (``packed_binary_table_of``): a text that began and ended with
    "PAR1" (no line end after it) was told to be "a Parquet file compressed with gzip", by its first and last bytes
    alone, where it had been read as the text it is. A table's footer length precedes its last magic; this text's
    four bytes there say more than it holds, and it is read."""
    import gzip

    from dschat.data import unsupervised

    text = tmp_path / "notes.txt.gz"
    text.write_bytes(gzip.compress(f"{magic} opens the first paragraph\nand the second ends with {magic}".encode()))
    unsupervised.check_unsupervised_file(str(text))
    train, column = unsupervised.load_unsupervised_train(str(text))
    assert train[column] == [f"{magic} opens the first paragraph", f"and the second ends with {magic}"]


def test_a_corrupt_compressed_unsupervised_file_is_said_with_its_flag_by_the_pre_flight_check(tmp_path):
    """A docs.jsonl.gz that does not decompress (not gzip inside, or cut short) was said by train.py's pre-flight
    check (and step 3's load) by its path alone, "docs.jsonl.gz: not readable as gzip data ...", where the file's other
    errors name --unsupervised_dataset_name. It names the flag now, as they do."""
    import gzip

    from dschat.data import unsupervised

    docs = tmp_path / "docs.jsonl.gz"
    for content, said in ((b"not gzip at all", "though its name says it is: where it is the uncompressed file"),
                          (gzip.compress(json.dumps({"text": "hello"}).encode() * 99 + b"\n")[:-12],
                           "Compressed file ended")):
        docs.write_bytes(content)
        for spec, where in ((str(docs), str(docs)), (f"jsonl:{docs}", f"jsonl:{docs}: {docs}")):
            for read in (unsupervised.check_unsupervised_file, unsupervised.load_unsupervised_train):
                with pytest.raises(DatasetFormatError, match="^" + re.escape(f"--unsupervised_dataset_name {where}: "
                                                                             "not ") + f".*gzip data.*{said}"):
                    read(spec)


def test_unsupervised_json_text_that_reads_as_json_stays_text_and_the_bad_record_is_named(tmp_path, tokenizer):
    """In a "text" column of mixed types datasets decoded the strings that are valid JSON: "null" was said to be
    missing at its record, and the number further on, the bad record, went unnamed."""
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in ("null", "[1, 2]", "a document", 5)))
    with pytest.raises(DatasetFormatError, match=rf"{path} line 4 \(record 3\): field 'text': expected a string, got "
                                                 "int"):
        get_unsupervised_data(unsupervised_args(str(path)), tokenizer)
    path.write_text("".join(json.dumps({"text": text, "n": n}) + "\n" for text, n in (("null", 1), ("[1, 2]", "x"))))
    data = get_unsupervised_data(unsupervised_args(str(path)), tokenizer)
    assert tokenizer.decode(data[0]["input_ids"], skip_special_tokens=True).startswith("null")


def test_unsupervised_csv_and_parquet_files_are_read_as_local_files(tmp_path, tokenizer, monkeypatch):
    """A .csv or .parquet path was looked up on the hub: "not in the datasets cache, and the hub cannot be reached"."""
    monkeypatch.setattr("dschat.data.base.load_hub_dataset", lambda *a, **k: pytest.fail("looked up on the hub"))
    docs = [f"line {i} of plain text here" for i in range(20)]
    (tmp_path / "docs.txt").write_text("\n".join(docs) + "\n")
    expected = get_unsupervised_data(unsupervised_args(str(tmp_path / "docs.txt")), tokenizer)
    frame = pd.DataFrame({"id": range(20), "text": docs})
    frame.to_csv(tmp_path / "docs.csv", index=False)
    frame.to_parquet(tmp_path / "docs.parquet")
    for name in (str(tmp_path / "docs.csv"), f"parquet:{tmp_path / 'docs.parquet'}"):
        data = get_unsupervised_data(unsupervised_args(name), tokenizer)
        assert [data[i]["input_ids"].tolist() for i in range(len(data))] == \
            [expected[i]["input_ids"].tolist() for i in range(len(expected))]
    (tmp_path / "gap.csv").write_text("id,text\n1,first document\n2,\n")
    with pytest.raises(DatasetFormatError, match=r"gap.csv line 3 \(record 1\): field 'text': missing or null"):
        get_unsupervised_data(unsupervised_args(str(tmp_path / "gap.csv")), tokenizer)


def test_an_unsupervised_text_file_that_is_not_utf8_names_its_line(tmp_path, tokenizer):
    """A Latin-1 .txt said only "could not be read as text: An error occurred while generating the dataset"."""
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"first line\ncaf\xe9 au lait\n")
    with pytest.raises(DatasetFormatError, match=rf"{path} line 2: not UTF-8 text \(byte 0xe9 at column 4\); save the "
                                                 "file as UTF-8"):
        get_unsupervised_data(unsupervised_args(str(path)), tokenizer)


def test_an_unsupervised_utf16_text_file_is_told_it_is_not_utf8(tmp_path, tokenizer):
    """A UTF-16 .txt without a byte-order mark decoded as UTF-8: its documents were trained on with a NUL after each
    character. It is told by the NUL bytes among its first bytes, named once."""
    path = tmp_path / "wide.txt"
    path.write_bytes("first document\nsecond document\n".encode("utf-16-le"))
    with pytest.raises(DatasetFormatError, match=rf"^{path}: not UTF-8 text \(a NUL byte among its first 10 bytes: "
                                                 r"UTF-16\?\); save the file as UTF-8$"):
        get_unsupervised_data(unsupervised_args(str(path)), tokenizer)


def test_a_compressed_unsupervised_text_file_that_is_not_utf8_says_so_not_the_compressed_bytes(tmp_path, tokenizer):
    """datasets unpacks a gzip text file; one holding Latin-1 text was "line 1: not UTF-8 text (byte 0x8b at column
    2)", the gzip header's byte, read from the file as it is on disk."""
    import gzip

    path = tmp_path / "docs.txt.gz"
    path.write_bytes(gzip.compress("first line\ncaf\xe9 au lait\n".encode("latin-1")))
    with pytest.raises(DatasetFormatError, match=rf"{path}: the text compressed in it \(gzip\) is not UTF-8: "
                                                 rf"decompress it \(gunzip -k {path}\) and save the text as UTF-8"):
        get_unsupervised_data(unsupervised_args(str(path)), tokenizer)


def test_unsupervised_tiny_and_a_saved_folder(tmp_path, tokenizer):
    from datasets import Dataset, DatasetDict

    from dschat.data.unsupervised import load_unsupervised_train
    from dschat.tiny import TRAIN_FILE

    tiny, column = load_unsupervised_train("tiny")
    first = json.loads(TRAIN_FILE.read_text().splitlines()[0])
    assert column == "text" and tiny[0]["text"] == f"{first['prompt']} {first['chosen']}"
    assert len(get_unsupervised_data(unsupervised_args("tiny"), tokenizer)) > 100
    DatasetDict({"train": Dataset.from_dict({"body": ["saved text one", "saved text two"]})}).save_to_disk(
        str(tmp_path / "saved"))
    saved, column = load_unsupervised_train(str(tmp_path / "saved"))
    assert column == "body" and saved["body"] == ["saved text one", "saved text two"]  # the first column, as the hub's


def test_the_unsupervised_data_record_says_which_content_or_hub_revision_was_read(tmp_path, tokenizer, monkeypatch):
    """What step 3's checkpoints record of --unsupervised_dataset_name, so that a resume notices other data: a local
    file's content, a save_to_disk folder's files (not the cache files the tokenizing itself writes there), a hub
    dataset's train split fingerprint (another revision in the HF cache: another one), nothing for ``tiny``."""
    import os

    from datasets import Dataset

    from dschat.data.unsupervised import changed_unsupervised_data, unsupervised_data_record

    text = tmp_path / "docs.txt"
    text.write_text("one document\nanother document\n")
    data = get_unsupervised_data(unsupervised_args(str(text)), tokenizer)
    assert data.data_record == unsupervised_data_record(str(text)) and list(data.data_record["files"]) == [str(text)]
    text.write_text("one document\nan edited document\n")
    assert changed_unsupervised_data(data.data_record, unsupervised_data_record(str(text))) == [str(text)]

    Dataset.from_dict({"text": ["saved text number %d" % i for i in range(8)]}).save_to_disk(str(tmp_path / "saved"))
    before = unsupervised_data_record(str(tmp_path / "saved"))
    get_unsupervised_data(unsupervised_args(str(tmp_path / "saved")), tokenizer)
    assert any(name.startswith("cache-") for name in os.listdir(tmp_path / "saved")), "datasets' map cache (the case)"
    assert unsupervised_data_record(str(tmp_path / "saved")) == before and before["files"]

    revisions = {"now": Dataset.from_dict({"text": ["revision one"] * 8})}
    monkeypatch.setattr("dschat.data.base.load_hub_dataset", lambda *a, **k: revisions["now"])
    saved = get_unsupervised_data(unsupervised_args("wikitext"), tokenizer).data_record
    assert saved == unsupervised_data_record("wikitext") and saved["files"] == {}
    revisions["now"] = Dataset.from_dict({"text": ["revision two"] * 8})
    assert changed_unsupervised_data(saved, unsupervised_data_record("wikitext")) == [
        "wikitext (another revision in the HF datasets cache)"]
    assert unsupervised_data_record("tiny") == {"files": {}, "hub": {}}


def test_a_saved_folders_record_leaves_out_the_file_another_ranks_map_is_writing(tmp_path):
    """Every rank reads --unsupervised_dataset_name's save_to_disk folder and tokenizes it with datasets' map, which
    writes its cache file there through a temporary file (tempfile's ``tmpXXXXXXXX``) until it is complete. A rank that
    recorded the folder while another rank's map ran listed that file: rank 0's checkpoints then named a file gone by
    the resume (refused: "its unsupervised data changed since: .../tmp..."; train.py --resume ran step 3 afresh), or
    the file was renamed between the listing and its hashing (FileNotFoundError at the start of step 3)."""
    from datasets import Dataset, load_from_disk

    from dschat.data.unsupervised import unsupervised_data_record

    folder = str(tmp_path / "saved")
    Dataset.from_dict({"text": ["saved text number %d" % i for i in range(8)]}).save_to_disk(folder)
    before = unsupervised_data_record(folder)
    during = []

    def tokenize(batch):  # (another rank's map: this rank records the folder meanwhile)
        during.append((sorted(os.listdir(folder)), unsupervised_data_record(folder)))
        return {"n": [len(text) for text in batch["text"]]}

    load_from_disk(folder).map(tokenize, batched=True, batch_size=2)
    assert any(name.startswith("tmp") for names, _ in during for name in names), "datasets' temporary file (the case)"
    assert all(record == before for _, record in during)


@pytest.mark.parametrize("error", [ConnectionError("Couldn't reach 'x' on the Hub"), FileNotFoundError("no such")])
def test_a_hub_dataset_that_cannot_be_loaded_names_its_flag(monkeypatch, error, tokenizer, reachable_hub):
    import datasets

    from dschat.data.raw_datasets import get_raw_dataset
    from dschat.errors import MissingInputError

    def unreachable(*args, **kwargs):
        raise error

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(MissingInputError, match="--unsupervised_dataset_name wikitext: could not be loaded"):
        get_unsupervised_data(unsupervised_args("wikitext"), tokenizer)
    with pytest.raises(MissingInputError, match="--data_path Dahoas/rm-static: could not be loaded"):
        get_raw_dataset("Dahoas/rm-static", "/tmp/unused", 0, 0)


def test_a_hub_dataset_not_in_the_cache_offline_says_so(monkeypatch, tokenizer):
    """Offline (HF_HUB_OFFLINE, or the hub unreachable), a hub dataset the datasets cache lacks was "could not be
    loaded from the hub (ConnectionError: Couldn't reach ... (OfflineModeIsEnabled))"; now it says the cache lacks it
    and why the hub was not asked."""
    import datasets

    from dschat.data.raw_datasets import get_raw_dataset
    from dschat.errors import MissingInputError

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'Dahoas/rm-static' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(MissingInputError, match=r"--data_path Dahoas/rm-static: not in the datasets cache, and "
                                                r"HF_HUB_OFFLINE is set, so the hub is not asked; download it where"):
        get_raw_dataset("Dahoas/rm-static", "/tmp/unused", 0, 0)


def test_unsupervised_hub_data_downloaded_into_the_hub_cache_is_read_offline(tmp_path, monkeypatch, tokenizer, capsys):
    """--unsupervised_dataset_name wikitext --unsupervised_dataset_config_name wikitext-2-raw-v1 offline, downloaded
    with `hf download --repo-type dataset wikitext` (no --local-dir: the hub cache, which datasets does not read
    offline): it was "not in the datasets cache, and HF_HUB_OFFLINE is set", where the prompt data's download there is
    read. The config's folder of the download is read now (its train split, shards as one), and said."""
    import pandas as pd
    from huggingface_hub import constants

    from dschat.data.unsupervised import unsupervised_data_record
    from dschat.errors import MissingInputError

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = hub_cache_snapshot(tmp_path / "hub", "datasets--wikitext")
    config = snapshot / "wikitext-2-raw-v1"
    config.mkdir(parents=True)
    for shard in range(2):
        pd.DataFrame({"text": [f"Document {shard}.{i} of the wiki text." for i in range(6)]}).to_parquet(
            config / f"train-0000{shard}-of-00002.parquet")
    pd.DataFrame({"text": ["A test document."]}).to_parquet(config / "test-00000-of-00001.parquet")
    args = unsupervised_args("wikitext", unsupervised_dataset_config_name="wikitext-2-raw-v1")
    data = get_unsupervised_data(args, tokenizer)
    documents = [f"Document {shard}.{i} of the wiki text." for shard in range(2) for i in range(6)]
    assert len(data) == sum(len(tokenizer(d)["input_ids"]) + 1 for d in documents) // 10
    assert f"--unsupervised_dataset_name wikitext: not in the datasets cache, read from its download in the hub " \
           f"cache, {config}" in capsys.readouterr().out
    assert list(unsupervised_data_record("wikitext", "wikitext-2-raw-v1")["hub"]) == ["wikitext"]
    # a download without a train split says so; one without the config's files is not in the cache, as before
    for path in config.glob("train-*"):
        path.unlink()
    with pytest.raises(DatasetFormatError, match=rf"^--unsupervised_dataset_name wikitext: the download in the hub "
                                                 rf"cache \({re.escape(str(config))}\) holds the split test, not "
                                                 rf"train"):
        get_unsupervised_data(args, tokenizer)
    with pytest.raises(MissingInputError, match=r"^--unsupervised_dataset_name wikitext: not in the datasets cache"):
        get_unsupervised_data(unsupervised_args("wikitext", unsupervised_dataset_config_name="wikitext-103-v1"),
                              tokenizer)


def test_unsupervised_c4_downloaded_into_the_hub_cache_its_gzip_json_shards_are_read(tmp_path, monkeypatch,
                                                                                    tokenizer, capsys):
    """--unsupervised_dataset_name allenai/c4 --unsupervised_dataset_config_name en offline, downloaded into the hub
    cache: c4 ships each config's splits as gzip'd JSON Lines shards, en/c4-train.00000-of-01024.json.gz, which were
    not read ("not in the datasets cache": no split file dschat read). Its train shards are read now, as
    DeepSpeed-Chat's load_dataset("allenai/c4", "en") reads them, datasets' json loader decompressing them; its
    validation shards are not."""
    import gzip

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = hub_cache_snapshot(tmp_path / "hub", "datasets--allenai--c4")
    config = snapshot / "en"
    config.mkdir(parents=True)

    def write_shard(name, texts):
        rows = [{"text": text, "timestamp": "2019-04-25T12:57:54Z", "url": "https://example.com/"} for text in texts]
        (config / name).write_bytes(gzip.compress("".join(json.dumps(row) + "\n" for row in rows).encode()))

    documents = [[f"Document {shard}.{i} of the crawl." for i in range(5)] for shard in range(3)]
    for shard, texts in enumerate(documents):
        write_shard(f"c4-train.{shard:05d}-of-00003.json.gz", texts)
    write_shard("c4-validation.00000-of-00001.json.gz", ["A validation document."])
    (snapshot / "README.md").write_text("---\nconfigs:\n- config_name: en\n---\n")
    args = unsupervised_args("allenai/c4", unsupervised_dataset_config_name="en")
    data = get_unsupervised_data(args, tokenizer)
    texts = [text for shard in documents for text in shard]
    assert len(data) == sum(len(tokenizer(text)["input_ids"]) + 1 for text in texts) // 10
    assert data[0]["input_ids"].tolist() == tokenizer(texts[0])["input_ids"][:10]  # (the first shard's first text)
    assert f"--unsupervised_dataset_name allenai/c4: not in the datasets cache, read from its download in the hub " \
           f"cache, {config}" in capsys.readouterr().out
    # a download of some of the shards (hf download --include) reads those, and says so; an empty one is an error
    (config / "c4-train.00001-of-00003.json.gz").unlink()
    data = get_unsupervised_data(args, tokenizer)
    assert len(data) == sum(len(tokenizer(text)["input_ids"]) + 1 for text in documents[0] + documents[2]) // 10
    assert "allenai/c4: the download holds 2 of the 3 train shards: reading those" in capsys.readouterr().out
    (config / "c4-train.00001-of-00003.json.gz").write_bytes(b"")
    with pytest.raises(DatasetFormatError, match=r"^--unsupervised_dataset_name allenai/c4: .*c4-train\.00001-of-"
                                                 r"00003\.json\.gz is empty \(0 bytes\): a download cut short"):
        get_unsupervised_data(args, tokenizer)


def test_unsupervised_data_in_a_download_folder_is_read_not_a_load_from_disk_traceback(tmp_path, monkeypatch,
                                                                                      tokenizer):
    """--unsupervised_dataset_name allenai/c4 --unsupervised_dataset_config_name en, with allenai/c4's download at
    ./allenai/c4 (hf download --local-dir, DeepSpeed-Chat's offline copy, which its load_dataset reads by that path):
    the folder went to load_from_disk, whose FileNotFoundError ("neither a `Dataset` directory nor a `DatasetDict`
    directory") ended step 3 in a traceback. The config's train shards are read now, as the hub cache's download is,
    and the run records those files (not hf's metadata, nor other configs')."""
    import gzip
    import shutil

    from dschat.data.unsupervised import unsupervised_data_record
    from dschat.errors import MissingInputError

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "allenai" / "c4" / "en"
    config.mkdir(parents=True)
    (tmp_path / "allenai" / "c4" / "realnewslike").mkdir()
    (tmp_path / "allenai" / "c4" / ".cache" / "huggingface").mkdir(parents=True)
    documents = [[f"Document {shard}.{i} of the crawl." for i in range(5)] for shard in range(2)]
    for shard, texts in enumerate(documents):
        (config / f"c4-train.{shard:05d}-of-00002.json.gz").write_bytes(
            gzip.compress("".join(json.dumps({"text": text, "url": "u"}) + "\n" for text in texts).encode()))
    (tmp_path / "allenai" / "c4" / "realnewslike" / "c4-train.00000-of-00001.json.gz").write_bytes(
        gzip.compress(json.dumps({"text": "Another config's document."}).encode() + b"\n"))
    args = unsupervised_args("allenai/c4", unsupervised_dataset_config_name="en")
    data = get_unsupervised_data(args, tokenizer)
    texts = [text for shard in documents for text in shard]
    assert len(data) == sum(len(tokenizer(text)["input_ids"]) + 1 for text in texts) // 10
    assert sorted(unsupervised_data_record("allenai/c4", "en")["files"]) == \
        [str(config / f"c4-train.{shard:05d}-of-00002.json.gz") for shard in range(2)]
    # a config not downloaded is said so, naming the flag
    with pytest.raises(MissingInputError, match=r"^--unsupervised_dataset_name allenai/c4: the download here holds "
                                                 r"no config en\.noblocklist \(its configs: en, realnewslike\)"):
        get_unsupervised_data(unsupervised_args("allenai/c4", unsupervised_dataset_config_name="en.noblocklist"),
                              tokenizer)
    # a folder of neither form is said so, naming the flag
    shutil.rmtree(tmp_path / "allenai" / "c4")
    (tmp_path / "allenai" / "c4" / "notes").mkdir(parents=True)
    with pytest.raises(DatasetFormatError, match=r"^--unsupervised_dataset_name allenai/c4: the download here is "
                                                 r"neither a save_to_disk folder nor a download of a hub dataset's "
                                                 r"repository"):
        get_unsupervised_data(unsupervised_args("allenai/c4"), tokenizer)


def test_unsupervised_c4_download_of_configs_without_the_config_named_says_to_name_one(tmp_path, monkeypatch,
                                                                                       tokenizer):
    """allenai/c4 keeps each config's shards in a folder of its own (en/, realnewslike/). Its download in the hub
    cache, offline, without --unsupervised_dataset_config_name, was "not in the datasets cache, and HF_HUB_OFFLINE is
    set ... download it", though it was downloaded; at ./allenai/c4 it was "neither a save_to_disk folder nor a
    download of a hub dataset's repository", and a config not downloaded was said so too. Each now names the configs
    the download holds and the flag that chooses one."""
    import gzip
    import shutil

    from huggingface_hub import constants

    from dschat.errors import MissingInputError, UsageError

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    snapshot = hub_cache_snapshot(tmp_path / "hub", "datasets--allenai--c4")
    for download, copy, command in ((snapshot, rf"not in the datasets cache, and its download in the hub cache "
                                               rf"\({re.escape(str(snapshot))}\)", "allenai/c4"),
                                    (tmp_path / "allenai" / "c4", "the download here", "NAME --local-dir allenai/c4")):
        for config in ("en", "realnewslike"):
            (download / config).mkdir(parents=True)
            (download / config / "c4-train.00000-of-00001.json.gz").write_bytes(
                gzip.compress(json.dumps({"text": f"A document of {config}."}).encode() + b"\n"))
        (download / "README.md").write_text("---\nconfigs:\n- config_name: en\n---\n")
        with pytest.raises(UsageError, match=rf"^--unsupervised_dataset_name allenai/c4: {copy} keeps each config's "
                                             r"data in a folder of its own \(en, realnewslike\): name the one to "
                                             r"read with --unsupervised_dataset_config_name"):
            get_unsupervised_data(unsupervised_args("allenai/c4"), tokenizer)
        with pytest.raises(MissingInputError, match=rf"^--unsupervised_dataset_name allenai/c4: {copy} holds no "
                                                    r"config en\.noblocklist \(its configs: en, realnewslike\): "
                                                    rf"download it \(hf download --repo-type dataset {command} "
                                                    r"--include 'en\.noblocklist/\*'\), or name one of those with "
                                                    r"--unsupervised_dataset_config_name"):
            get_unsupervised_data(unsupervised_args("allenai/c4", unsupervised_dataset_config_name="en.noblocklist"),
                                  tokenizer)
        shutil.rmtree(download)  # (the folder here is read before the hub cache's download: written after it)


def test_a_download_of_some_c4_shards_reads_those_and_says_how_many(tmp_path, monkeypatch, tokenizer, capsys):
    """allenai/c4's en config is 1024 train shards (300+ GB): it is used by downloading some of them,
    `hf download --repo-type dataset allenai/c4 --include 'en/c4-train.0000[0-9]-of-01024.json.gz' --local-dir
    allenai/c4`. Such a download was refused, by the pre-flight check and by step 3 alike ("the train split is in 1024
    shards, and the folder lacks ...: a download cut short?"). The shards there are read, and how many of how many is
    said once; a shard cut short is still an error naming it."""
    import gzip

    from dschat.data import unsupervised

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "allenai" / "c4" / "en"
    config.mkdir(parents=True)
    texts = [f"Document {shard} of the crawl." for shard in range(10)]
    for shard, text in enumerate(texts):
        (config / f"c4-train.{shard:05d}-of-01024.json.gz").write_bytes(
            gzip.compress(json.dumps({"text": text, "url": "u"}).encode() + b"\n"))
    (config / "c4-validation.00000-of-00008.json.gz").write_bytes(gzip.compress(b'{"text": "A validation text."}\n'))
    unsupervised.check_unsupervised_file("allenai/c4", "en")  # (train.py's pre-flight)
    data = get_unsupervised_data(unsupervised_args("allenai/c4", unsupervised_dataset_config_name="en"), tokenizer)
    assert len(data) == sum(len(tokenizer(text)["input_ids"]) + 1 for text in texts) // 10
    out = capsys.readouterr().out
    assert out.count("--unsupervised_dataset_name allenai/c4: the download holds 10 of the 1024 train shards: "
                     "reading those\n") == 1, out
    # a shard cut short (truncated gzip) is its own error, naming it
    whole = (config / "c4-train.00003-of-01024.json.gz").read_bytes()
    (config / "c4-train.00003-of-01024.json.gz").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(DatasetFormatError, match=r"c4-train\.00003-of-01024\.json\.gz: not readable as gzip "
                                                 r"data.*a file cut short\?"):
        get_unsupervised_data(unsupervised_args("allenai/c4", unsupervised_dataset_config_name="en"), tokenizer)


def test_an_unsupervised_download_folder_cut_short_is_said_by_the_pre_flight_check(tmp_path, monkeypatch):
    """./allenai/c4 (hf download --local-dir) with an empty shard, or without the config named, passed train.py's
    pre-flight check (check_unsupervised_file checked local files only) and was said by step 3's load, after steps 1
    and 2 had trained; the same download in the hub cache is loaded by the pre-flight. Its layout is checked before
    step 1 now (its files are not read: step 3 reads them)."""
    import gzip

    from dschat.data import unsupervised
    from dschat.errors import MissingInputError

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "allenai" / "c4" / "en"
    config.mkdir(parents=True)
    for shard in (0, 2):
        (config / f"c4-train.{shard:05d}-of-00003.json.gz").write_bytes(gzip.compress(b'{"text": "A document."}\n'))
    (config / "c4-train.00001-of-00003.json.gz").write_bytes(b"")
    for check in (lambda: unsupervised.check_unsupervised_file("allenai/c4", "en"),
                  lambda: unsupervised.load_unsupervised_train("allenai/c4", "en")):
        with pytest.raises(DatasetFormatError, match=r"^--unsupervised_dataset_name allenai/c4: .*c4-train\.00001-of-"
                                                     r"00003\.json\.gz is empty \(0 bytes\)"):
            check()
    with pytest.raises(MissingInputError, match=r"^--unsupervised_dataset_name allenai/c4: the download here holds "
                                                r"no config realnewslike \(its configs: en\)"):
        unsupervised.check_unsupervised_file("allenai/c4", "realnewslike")
    (config / "c4-train.00001-of-00003.json.gz").write_bytes(gzip.compress(b'{"text": "A document."}\n'))
    unsupervised.check_unsupervised_file("allenai/c4", "en")


def test_an_unsupervised_record_without_text_is_named_not_a_tokenizer_traceback(tmp_path, tokenizer):
    """A null or non-string ``text`` (a JSONL line with "text": null) is its file and line's error, not the fast
    tokenizer's TypeError ("TextEncodeInput must be Union[...]"), which names neither."""
    from datasets import Dataset

    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in ["one doc here", None, "another"]))
    with pytest.raises(DatasetFormatError, match=r"docs.jsonl line 2 \(record 1\): field 'text': missing or null"):
        get_unsupervised_data(unsupervised_args(str(path)), tokenizer)
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in ["one doc here", "two", 7]))
    with pytest.raises(DatasetFormatError, match=r"docs.jsonl line 3 \(record 2\): field 'text': expected a string, "
                                                 r"got int"):
        get_unsupervised_data(unsupervised_args(str(path), preprocessing_num_workers=2), tokenizer)
    Dataset.from_dict({"text": ["a saved document", None]}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DatasetFormatError, match=r"--unsupervised_dataset_name .*saved record 1: field 'text': "
                                                 r"missing or null"):
        get_unsupervised_data(unsupervised_args(str(tmp_path / "saved")), tokenizer)
