"""create_prompt_dataset: phase shares, blending, token layout, skips, caching (keys, concurrency)."""
import copy
import json
import multiprocessing
import os
import re
import time

import datasets
import pytest
from datasets import Dataset, DatasetDict

from dschat.data import DahoasRmstaticDataset, DatasetFormatError, create_prompt_dataset, format_answer, format_prompt
from dschat.data import pipeline
from dschat.data.cache import CACHE_SUBDIR
from dschat.data.splits import get_raw_dataset_split_index, parse_data_split
from dschat.errors import UsageError
from dschat.tiny import load_tiny_tokenizer
from launch import WRITE_SEEN_AND_END, run_as_two_nodes

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")




def records(name, count, start=0):
    return [{"prompt": f"Tell me about {name} record {i}.", "chosen": f"Record {i} is fine.",
             "rejected": f"Record {i} is bad.", "task": name} for i in range(start, start + count)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def train_eval_spec(tmp_path, name, train_count, eval_count):
    train = write_jsonl(tmp_path / f"{name}_train.jsonl", records(name, train_count))
    eval_ = write_jsonl(tmp_path / f"{name}_eval.jsonl", records(name, eval_count, start=1000))
    return f"{train},{eval_}"


def build(tmp_path, tokenizer, data_path, phase, **kwargs):
    options = dict(data_split="2,4,4", output_path=str(tmp_path / "out"), seed=1234, max_seq_len=128)
    options.update(kwargs)
    return create_prompt_dataset(0, data_path, options.pop("data_split"), options.pop("output_path"), phase,
                                 options.pop("seed"), tokenizer, options.pop("max_seq_len"), **options)


def record_ids(dataset, tokenizer):
    """The record numbers in a dataset, read back from the tokens (prompts say "... record N.")."""
    key = {1: "input_ids", 2: "chosen_input_ids", 3: "prompt_input_ids"}[dataset.train_phase]
    texts = [tokenizer.decode(dataset[i][key]) for i in range(len(dataset))]
    return [int(re.search(r"record (\d+)\.", text).group(1)) for text in texts]


# --- shares and blending ---

@pytest.mark.parametrize("size", [0, 1, 2, 7, 10, 33])
@pytest.mark.parametrize("data_split", ["2,4,4", "1,1,1", "10,0,0", "0.5,0.3,0.2"])
def test_split_indices_are_disjoint_cover_and_are_cached(tmp_path, size, data_split):
    parts = [get_raw_dataset_split_index(0, str(tmp_path), "ds", 1234, "train", data_split, i, size)
             for i in range(3)]
    assert sorted(parts[0] + parts[1] + parts[2]) == list(range(size))
    fractions = parse_data_split(data_split)
    assert all(abs(len(part) - f * size) <= 1 for part, f in zip(parts, fractions))
    assert get_raw_dataset_split_index(0, str(tmp_path), "ds", 1234, "train", data_split, 1, size) == parts[1]
    if size >= 10:  # another seed gives another assignment
        other = [get_raw_dataset_split_index(0, str(tmp_path), "ds", 99, "train", data_split, i, size)
                 for i in range(3)]
        assert other != parts


def test_the_data_report_counts_one_record_in_the_singular():
    """The report's lines said "kept all 1 records", "skipped 1 of 1 records" and "of the source's 1 records"."""
    line = pipeline.format_skip_line
    one = {"source": "a.json", "split": "train", "total": 1, "skipped": {}}
    assert line(one) == "a.json train: kept the 1 record"
    skipped = {**one, "skipped": {"chosen==rejected": 1}}
    assert line(skipped) == "a.json train: skipped 1 of 1 record: 1 chosen==rejected"
    assert line({**one, "total": 0, "of": 1, "data_split": "2,4,4"}) == (
        "a.json train: no records in this phase's share (this phase's share by --data_split 2,4,4: 0 of the source's "
        "1 record)")
    assert line({**one, "total": 2, "of": 5, "data_split": "2,4,4", "skipped": {"no answer": 1}}) == (
        "a.json train: skipped 1 of 2 records (this phase's share by --data_split 2,4,4: 2 of the source's 5 records): "
        "1 no answer")
    assert line({**one, "total": 2}) == "a.json train: kept all 2 records"


def test_malformed_data_split_is_rejected():
    for bad in ("2,4", "a,b,c", "0,0,0", "-1,1,1"):
        with pytest.raises(ValueError, match="data_split"):
            parse_data_split(bad)


def test_phase_shares_are_disjoint_and_cover_train_and_eval(tmp_path, tokenizer):
    spec = train_eval_spec(tmp_path, "alpha", 40, 20)
    shares = {phase: build(tmp_path, tokenizer, [spec], phase) for phase in (1, 2, 3)}
    for split, index, total, first in (("train", 0, 40, 0), ("eval", 1, 20, 1000)):
        ids = {phase: record_ids(shares[phase][index], tokenizer) for phase in shares}
        assert [len(ids[p]) for p in (1, 2, 3)] == [total // 5, 2 * total // 5, 2 * total // 5], split
        assert sorted(ids[1] + ids[2] + ids[3]) == list(range(first, first + total)), split


def test_blending_concatenates_then_shuffles_with_the_seed(tmp_path, tokenizer):
    specs = [train_eval_spec(tmp_path, "alpha", 12, 2), train_eval_spec(tmp_path, "beta", 8, 2)]
    train, eval_ = build(tmp_path, tokenizer, specs, 3, data_split="0,0,10")
    tasks = [train[i]["task"] for i in range(len(train))]
    assert sorted(tasks) == ["alpha"] * 12 + ["beta"] * 8 and len(eval_) == 4
    assert tasks != sorted(tasks) and tasks != sorted(tasks, reverse=True)  # interleaved, not appended
    again, _ = build(tmp_path, tokenizer, specs, 3, data_split="0,0,10", output_path=str(tmp_path / "out2"))
    assert [again[i]["prompt_text"] for i in range(20)] == [train[i]["prompt_text"] for i in range(20)]
    other, _ = build(tmp_path, tokenizer, specs, 3, data_split="0,0,10", seed=99)
    assert [other[i]["prompt_text"] for i in range(20)] != [train[i]["prompt_text"] for i in range(20)]


def test_sft_only_data_joins_phase_1_whole_and_nothing_else(tmp_path, tokenizer):
    main = train_eval_spec(tmp_path, "alpha", 20, 10)
    sft_rows = [{"messages": [{"role": "user", "content": f"Say sft record {i}."},
                              {"role": "assistant", "content": "Done."}]} for i in range(7)]
    sft = write_jsonl(tmp_path / "sft.jsonl", sft_rows)
    sft_spec = f"{sft},{sft}"
    train, eval_ = build(tmp_path, tokenizer, [main], 1, sft_only_data_path=[sft_spec])
    assert (len(train), len(eval_)) == (4 + 7, 2 + 7)
    assert sum("sft record" in tokenizer.decode(train[i]["input_ids"]) for i in range(len(train))) == 7
    plain, _ = build(tmp_path, tokenizer, [main], 2)
    with_sft, _ = build(tmp_path, tokenizer, [main], 2, sft_only_data_path=[sft_spec])
    assert len(with_sft) == len(plain) == 8 and not with_sft.built  # same data, same cache


def test_hub_adapter_in_the_pipeline_counts_unreadable_records(tmp_path, tokenizer, monkeypatch, capsys):
    good = {"prompt": "\n\nHuman: Hi record 1.\n\nAssistant:", "response": " Hello.", "chosen": " Hello.",
            "rejected": " Go away."}
    rows = [good, dict(good, chosen="  "), dict(good, rejected=" Hello.")]
    monkeypatch.setattr(DahoasRmstaticDataset, "load",
                        lambda self: DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list([good])}))
    train, eval_ = build(tmp_path, tokenizer, ["Dahoas/rm-static"], 2, data_split="0,1,0")
    assert len(train) == 1 and len(eval_) == 1
    assert train.skipped == {"unreadable chosen": 1, "chosen==rejected": 1}
    assert "Dahoas/rm-static train: skipped 2 of 3 records: 1 chosen==rejected, 1 unreadable chosen" in \
        capsys.readouterr().out


def test_hub_name_folder_is_used_as_an_offline_copy(tmp_path, tokenizer, monkeypatch):
    rows = [{"prompt": f"\n\nHuman: Hi record {i}.\n\nAssistant:", "response": " Hello.", "chosen": " Hello.",
             "rejected": " Go away."} for i in range(5)]
    monkeypatch.chdir(tmp_path)
    DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:2])}).save_to_disk("Dahoas/rm-static")
    train, eval_ = build(tmp_path, tokenizer, ["Dahoas/rm-static"], 2, data_split="0,1,0")
    assert (len(train), len(eval_)) == (5, 2)


def test_a_sft_only_source_that_cannot_be_read_names_sft_only_data_path(tmp_path, tokenizer, monkeypatch):
    """create_prompt_dataset's own reads of step 1's --sft_only_data_path (the notebook API's, after a file went
    since train.py's check) named --data_path: "--data_path x.jsonl: no such file or folder", and a hub dataset that
    cannot be loaded "--data_path Dahoas/rm-static: not in the datasets cache"."""
    import datasets

    from dschat.errors import MissingInputError

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'Dahoas/rm-static' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    monkeypatch.chdir(tmp_path)
    for spec, said in (("x.jsonl", "x.jsonl: no such file or folder"),
                       ("Dahoas/rm-static", "Dahoas/rm-static: not in the datasets cache")):
        with pytest.raises(MissingInputError, match=rf"^--sft_only_data_path {said}"):
            build(tmp_path, tokenizer, ["tiny"], 1, sft_only_data_path=[spec])
        with pytest.raises(MissingInputError, match=rf"^--data_path {said}"):
            build(tmp_path, tokenizer, [spec], 1)


def test_tiny_default_builds_every_phase(tmp_path, tokenizer):
    for phase in (1, 2, 3):
        train, eval_ = build(tmp_path, tokenizer, ["tiny"], phase, max_seq_len=96, max_prompt_len=48)
        assert len(train) > 100 and len(eval_) > 10


def test_prompt_only_data_is_for_phase_3_only(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"Prompt record {i}."} for i in range(10)])
    train, _ = build(tmp_path, tokenizer, [path], 3, data_split="0,0,1")
    assert len(train) == 9
    with pytest.raises(DatasetFormatError, match="only be used in step 3"):
        build(tmp_path, tokenizer, [path], 1)


# --- token layout ---

def test_sft_labels_mask_the_prompt_and_train_answer_and_eot(tmp_path, tokenizer):
    spec = train_eval_spec(tmp_path, "alpha", 10, 2)
    train, _ = build(tmp_path, tokenizer, [spec], 1, data_split="1,0,0")
    item = train[0]
    record = records("alpha", 10)[record_ids(train, tokenizer)[0]]
    prompt = format_prompt([{"role": "user", "content": record["prompt"]}], tokenizer)
    prompt_len = len(tokenizer(prompt)["input_ids"])
    assert tokenizer.decode(item["input_ids"]) == prompt + format_answer(record["chosen"], tokenizer)
    assert item["input_ids"][-1].item() == tokenizer.eos_token_id
    assert (item["labels"][:prompt_len] == -100).all()
    assert item["labels"][prompt_len:].tolist() == item["input_ids"][prompt_len:].tolist()
    assert item["attention_mask"].tolist() == [1] * len(item["input_ids"])
    with_prompt, _ = build(tmp_path, tokenizer, [spec], 1, data_split="1,0,0", include_prompt_in_loss=True)
    assert with_prompt[0]["labels"].tolist() == with_prompt[0]["input_ids"].tolist()


def test_a_tokenizer_that_appends_eos_gets_it_only_as_the_eot(tmp_path, tokenizer):
    eos_after = copy.deepcopy(tokenizer)
    eos_after.add_eos_token = True  # as from_pretrained(..., add_eos_token=True): every encode ends with EOS
    assert eos_after("x")["input_ids"][-1] == tokenizer.eos_token_id
    spec = train_eval_spec(tmp_path, "alpha", 10, 2)
    for phase, key in ((1, "input_ids"), (3, "prompt_input_ids")):
        train, _ = build(tmp_path, eos_after, [spec], phase, data_split="1,0,0" if phase == 1 else "0,0,1")
        ids = train[0][key].tolist()
        eos_at = [i for i, t in enumerate(ids) if t == tokenizer.eos_token_id]
        assert eos_at == ([len(ids) - 1] if phase == 1 else []), (phase, tokenizer.decode(ids))  # not after the prompt


def test_truncation_keeps_eot_in_phase_2_and_drops_it_in_phase_1(tmp_path, tokenizer, capsys):
    long_answer = " ".join(["word"] * 60)
    rows = [{"prompt": "Short record 0.", "chosen": long_answer + " good", "rejected": long_answer + " bad"},
            {"prompt": "Short record 1.", "chosen": "Yes.", "rejected": "No."},
            {"prompt": "Long record 2. " + " ".join(["filler"] * 40), "chosen": "A.", "rejected": "B."}]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    spec = f"{path},{path}"
    sft, _ = build(tmp_path, tokenizer, [spec], 1, data_split="1,0,0", max_seq_len=24)
    by_record = {record_ids(sft, tokenizer)[i]: sft[i]["input_ids"] for i in range(len(sft))}
    assert len(by_record[0]) == 24 and by_record[0][-1].item() != tokenizer.eos_token_id  # cut answer: no eot
    assert len(by_record[1]) < 24 and by_record[1][-1].item() == tokenizer.eos_token_id
    room = "prompt leaves no room for an answer in --max_seq_len 24"
    assert sft.skipped == {room: 1}  # record 2's prompt fills the sequence
    assert f"skipped 1 of 3 records: 1 {room}; 1 kept with an answer cut at --max_seq_len" in capsys.readouterr().out

    pairs, _ = build(tmp_path, tokenizer, [spec], 2, data_split="0,1,0", max_seq_len=24)
    assert pairs.skipped == {"chosen==rejected after truncation": 1, room: 1}
    item = pairs[0]
    for side in ("chosen", "rejected"):
        assert item[f"{side}_input_ids"][-1].item() == tokenizer.eos_token_id
    assert "skipped 2 of 3 records" in capsys.readouterr().out


def margin_pairs(count, margin=lambda i: i / 2, column="margin"):
    return [{"prompt": f"Question record {i}.", "chosen": "Yes.", "rejected": "No.", column: margin(i)}
            for i in range(count)]


def margins_by_record(dataset, tokenizer):
    return {record: dataset[i]["margin"] for i, record in enumerate(record_ids(dataset, tokenizer))}


def test_phase_2_rows_carry_each_records_margin(tmp_path, tokenizer, capsys):
    """TRL's RewardTrainer subtracts a record's "margin" from the score difference; step 2 read none (the data report
    said so). Each pair now carries its own, a file without the column 0.0, and the report counts those with one."""
    path = write_jsonl(tmp_path / "pairs.jsonl", margin_pairs(6))
    pairs, _ = build(tmp_path, tokenizer, [f"{path},{path}"], 2, data_split="0,1,0")
    assert margins_by_record(pairs, tokenizer) == {i: i / 2 for i in range(6)}
    assert "kept all 6 records; 6 with a margin, which step 2's loss subtracts: -logsigmoid(chosen - rejected - " \
           "margin)" in capsys.readouterr().out
    plain = write_jsonl(tmp_path / "plain.jsonl", records("plain", 4))
    pairs, _ = build(tmp_path, tokenizer, [f"{plain},{plain}"], 2, data_split="0,1,0")
    assert [pairs[i]["margin"] for i in range(4)] == [0.0] * 4
    assert "with a margin" not in capsys.readouterr().out
    build(tmp_path, tokenizer, [f"{path},{path}"], 1, data_split="1,0,0")  # (step 1 reads no pairs: nothing to say)
    assert "with a margin" not in capsys.readouterr().out
    # another column's name, as --data_fields gives it; CSV cells are text: a number's text is that number
    scored = write_jsonl(tmp_path / "scored.jsonl", margin_pairs(3, column="gap"))
    pairs, _ = build(tmp_path, tokenizer, [f"{scored},{scored}"], 2, data_split="0,1,0", data_fields="margin=gap")
    assert margins_by_record(pairs, tokenizer) == {0: 0.0, 1: 0.5, 2: 1.0}
    csv = tmp_path / "pairs.csv"
    csv.write_text("prompt,chosen,rejected,margin\n" + "".join(f"Question record {i}.,Yes.,No.,{i}.25\n"
                                                                 for i in range(3)))
    pairs, _ = build(tmp_path, tokenizer, [f"csv:{csv},{csv}"], 2, data_split="0,1,0")
    assert margins_by_record(pairs, tokenizer) == {0: 0.25, 1: 1.25, 2: 2.25}


@pytest.mark.parametrize("bad, said", [
    (None, "field 'margin': missing or null, where the data's other records have a margin"),
    ("a lot", "field 'margin': 'a lot' is not a number"),
    (True, "field 'margin': True is not a number"),
    ([1.0], r"field 'margin': \[1.0\] is not a number"),
    (1e39, "field 'margin': 1e\\+39 is past fp32's range"),
])
def test_a_bad_margin_is_an_error_naming_its_file_and_record(tmp_path, tokenizer, bad, said):
    """A margin that is no finite number, or a record without one in a file whose other records have one (TRL's
    RewardTrainer needs one in every record), would train a wrong loss: the error names the file, line and record."""
    rows = margin_pairs(4)
    rows[2]["margin"] = bad
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    with pytest.raises(DatasetFormatError, match=rf"pairs\.jsonl line 3 \(record 2\): {said}"):
        build(tmp_path, tokenizer, [f"{path},{path}"], 2, data_split="0,1,0")
    build(tmp_path, tokenizer, [f"{path},{path}"], 1, data_split="1,0,0")  # (step 1 does not read the margins)


def test_pairs_read_without_margins_are_not_stopped_by_a_bad_one(tmp_path, tokenizer, capsys):
    """DPO reads phase 2's pairs but no margin: a record without one (step 2's error) is kept, its row's margin 0.0,
    and the report counts the margins as not read. The cache of pairs read so is not the one step 2 reads."""
    rows = margin_pairs(4)
    rows[2]["margin"] = None
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    pairs, _ = build(tmp_path, tokenizer, [f"{path},{path}"], 2, data_split="0,1,0", read_margins=False)
    assert margins_by_record(pairs, tokenizer) == {i: 0.0 for i in range(4)}
    assert "kept all 4 records; 3 with a margin, which is not read" in capsys.readouterr().out
    with pytest.raises(DatasetFormatError, match=r"pairs\.jsonl line 3 \(record 2\): field 'margin': missing"):
        build(tmp_path, tokenizer, [f"{path},{path}"], 2, data_split="0,1,0")


def test_a_nan_margin_of_a_parquet_file_is_an_error_naming_its_record(tmp_path, tokenizer):
    """(JSON refuses NaN when it is loaded; parquet holds one. A NaN is not equal to itself: the record is found
    anyway.)"""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = margin_pairs(4)
    rows[1]["margin"] = float("nan")
    path = str(tmp_path / "pairs.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)  # (pandas would write the NaN as a null)
    with pytest.raises(DatasetFormatError, match=r"pairs\.parquet record 1: field 'margin': nan is not a finite"):
        build(tmp_path, tokenizer, [f"{path},{path}"], 2, data_split="0,1,0")


def test_a_hub_datasets_margins_are_read_and_a_bad_one_is_skipped(tmp_path, tokenizer, monkeypatch, capsys):
    """Hub data is not stopped by one bad record (it cannot be mended): its margins train, a bad one is a skip."""
    rows = [{"prompt": f"\n\nHuman: Hi record {i}.\n\nAssistant:", "response": " Hello.", "chosen": " Hello.",
             "rejected": " Go away.", "margin": margin} for i, margin in enumerate([1.5, None, 0.25])]
    monkeypatch.setattr(DahoasRmstaticDataset, "load",
                        lambda self: DatasetDict({"train": Dataset.from_list(rows),
                                                  "test": Dataset.from_list(rows[:1])}))
    train, _ = build(tmp_path, tokenizer, ["Dahoas/rm-static"], 2, data_split="0,1,0")
    assert train.skipped == {"unreadable margin": 1}
    assert margins_by_record(train, tokenizer) == {0: 1.5, 2: 0.25}
    assert "skipped 1 of 3 records: 1 unreadable margin; 2 with a margin" in capsys.readouterr().out


def test_a_renamed_margin_column_the_file_lacks_is_an_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "pairs.jsonl", margin_pairs(3))
    with pytest.raises(DatasetFormatError, match="no 'gap' field, which --data_fields margin=gap names"):
        build(tmp_path, tokenizer, [f"{path},{path}"], 2, data_split="0,1,0", data_fields="margin=gap")


def test_phase_2_rows_record_which_answers_were_cut(tmp_path, tokenizer):
    # DPO must not train the EOT after a cut answer; the reward model's sequences keep it
    long_answer = " ".join(["word"] * 60)
    rows = [{"prompt": "Short record 0.", "chosen": long_answer, "rejected": "No."},
            {"prompt": "Short record 1.", "chosen": "Yes.", "rejected": long_answer},
            {"prompt": "Short record 2.", "chosen": "Yes.", "rejected": "No."}]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    pairs, _ = build(tmp_path, tokenizer, [f"{path},{path}"], 2, data_split="0,1,0", max_seq_len=24)
    flags = {record: (pairs[i]["chosen_truncated"], pairs[i]["rejected_truncated"])
             for i, record in enumerate(record_ids(pairs, tokenizer))}
    assert flags == {0: (True, False), 1: (False, True), 2: (False, False)}
    for item in pairs:
        assert item["eot_length"] == 1
        for side in ("chosen", "rejected"):
            assert item[f"{side}_input_ids"][-1].item() == tokenizer.eos_token_id
            assert (len(item[f"{side}_input_ids"]) == 24) == item[f"{side}_truncated"]


def sentencepiece_like_tokenizer():
    """Llama-2-style normalization: a leading space becomes its own "▁" token at the start of a string."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(special_tokens=["<unk>", "<pad>", "</s>"], vocab_size=400,
                                  initial_alphabet=list("\n:?.▁"))
    tok.train_from_iterator(["\n\nHuman: Tell me about alpha record 1.\n\nAssistant: Record 1 is fine."] * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   name_or_path="sentencepiece-like")


def test_answers_are_tokenized_as_they_appear_after_the_prompt(tmp_path):
    sp = sentencepiece_like_tokenizer()
    prompt = "\n\nHuman: Tell me about alpha record 1.\n\nAssistant:"
    assert sp(" Record 1 is fine.", add_special_tokens=False)["input_ids"][0] == sp.convert_tokens_to_ids("▁")
    spec = train_eval_spec(tmp_path, "alpha", 3, 1)
    train, _ = build(tmp_path, sp, [spec], 1, data_split="1,0,0")
    expected = sp(prompt + " Record 1 is fine.")["input_ids"] + [sp.eos_token_id]
    matches = [train[i] for i in range(len(train)) if train[i]["input_ids"].tolist() == expected]
    assert len(matches) == 1
    item = matches[0]
    first_trained = item["labels"][item["labels"] != -100][0].item()
    assert sp.convert_ids_to_tokens(first_trained) == "▁Record"  # not a lone "▁"


def test_phase_3_items_carry_prompt_text_messages_and_extras(tmp_path, tokenizer):
    rows = records("alpha", 6) + [{"prompt": "Long record 99. " + " ".join(["filler"] * 40), "chosen": "A",
                                   "rejected": "B", "task": "long"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    train, _ = build(tmp_path, tokenizer, [f"{path},{path}"], 3, data_split="0,0,1", max_prompt_len=32)
    assert len(train) == 6 and train.skipped == {"prompt longer than 32 tokens": 1}
    item = train[0]
    assert item["prompt_text"] == format_prompt(item["messages"], tokenizer)
    assert item["prompt_input_ids"].tolist() == tokenizer(item["prompt_text"])["input_ids"]
    assert item["messages"][0]["role"] == "user" and item["task"] == "alpha"


def test_chat_template_tokenizer_formats_with_its_template(tmp_path, tokenizer):
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = CHAT_TEMPLATE
    spec = train_eval_spec(tmp_path, "alpha", 5, 1)
    train, _ = build(tmp_path, chat, [spec], 1, data_split="1,0,0")
    text = chat.decode(train[0]["input_ids"])
    assert re.fullmatch(r"<\|user\|>Tell me about alpha record \d\.\n<\|assistant\|>Record \d is fine\.<\|endoftext\|>",
                        text), text


CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there."},
                {"role": "assistant", "content": "Hello, friend."}, {"role": "user", "content": "How are you?"},
                {"role": "assistant", "content": "Fine, thanks."}, {"role": "user", "content": "Bye."},
                {"role": "assistant", "content": "Goodbye!"}]


def trained_text(item, tokenizer):
    """The labelled tokens' text, with "|" between runs of labelled tokens."""
    runs, previous = [], False
    for token, label in zip(item["input_ids"].tolist(), item["labels"].tolist()):
        if label != -100:
            runs.append(("" if previous or not runs else "|") + tokenizer.decode([token]))
        previous = label != -100
    return "".join(runs)


def chatml(tokenizer, template_body="{{ m['content'] }}"):
    chat = copy.deepcopy(tokenizer)
    chat.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "eos_token": "<|im_end|>"})
    chat.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n" + template_body + "<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return chat


def llama2_style(tokenizer):
    """Llama-2-chat's template in short: a space on either side of an assistant turn, the EOS after it."""
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}<<SYS>>{{ m['content'] }}<</SYS>>"
                          "{% elif m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                          "{% else %} {{ m['content'] }} "
                          "{{ eos_token }}{% endif %}{% endfor %}")
    return chat


def with_leading_bos(tokenizer):
    from tokenizers import processors

    bos = copy.deepcopy(tokenizer)
    bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos.eos_token} $A", special_tokens=[(bos.eos_token, bos.eos_token_id)])
    return bos


@pytest.mark.parametrize("template", ["human_assistant", "human_assistant_bos", "chatml", "llama2"])
def test_multiturn_trains_every_assistant_turn_and_only_them(tmp_path, tokenizer, capsys, template):
    """By default only the last assistant turn has labels; --multiturn labels each earlier one where the prompt
    that ends at it ends, with the template's end token after it (ChatML), and nothing of the user or system turns;
    a BOS the tokenizer puts first shifts nothing. The last turn is trained as the template writes it (Llama-2's
    spaces), so with a template the ids are those of the whole rendered conversation, as the earlier turns'."""
    tok = {"human_assistant": tokenizer, "human_assistant_bos": with_leading_bos(tokenizer),
           "chatml": chatml(tokenizer), "llama2": llama2_style(tokenizer)}[template]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 3)
    last_only, _ = build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0")
    every, _ = build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", multiturn=True)
    expected = {"human_assistant_bos": (" Goodbye!<|endoftext|>",
                                        " Hello, friend.\n\n| Fine, thanks.\n\n| Goodbye!<|endoftext|>"),
                "human_assistant": (" Goodbye!<|endoftext|>",
                                    " Hello, friend.\n\n| Fine, thanks.\n\n| Goodbye!<|endoftext|>"),
                "chatml": ("Goodbye!<|im_end|>", "Hello, friend.<|im_end|>|Fine, thanks.<|im_end|>|Goodbye!<|im_end|>"),
                "llama2": (" Goodbye! <|endoftext|>",
                           " Hello, friend. <|endoftext|>| Fine, thanks. <|endoftext|>| Goodbye! <|endoftext|>")}
    assert trained_text(last_only[0], tok) == expected[template][0]
    assert trained_text(every[0], tok) == expected[template][1]
    if tok.chat_template:
        whole = tok.apply_chat_template(CONVERSATION, tokenize=False).rstrip()
        assert last_only[0]["input_ids"].tolist() == tok(whole, add_special_tokens=False)["input_ids"]
    assert every[0]["input_ids"].tolist() == last_only[0]["input_ids"].tolist()
    assert (every[0]["input_ids"][0] == tok.eos_token_id) == (template == "human_assistant_bos")
    assert "kept all 3 records; 6 earlier assistant turns trained (--multiturn)" in capsys.readouterr().out


def test_multiturn_leaves_turns_the_template_rewrites_as_prompt_and_counts_them(tmp_path, tokenizer, capsys):
    """A template that renders an earlier assistant turn otherwise than its content (here: upper case, as templates
    that drop an earlier turn's reasoning do) cannot be matched: the turn stays prompt and the report says how many."""
    tok = chatml(tokenizer, "{{ m['content'] | upper if m['role'] == 'assistant' else m['content'] }}")
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 2)
    every, _ = build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", multiturn=True)
    assert trained_text(every[0], tok) == "Goodbye!<|im_end|>"
    assert ("0 earlier assistant turns trained (--multiturn), 4 left as prompt: the chat template renders them "
            "otherwise than a prompt ending at them") in capsys.readouterr().out


def test_multiturn_leaves_an_opening_assistant_turn_a_template_cannot_render_before_as_prompt(tmp_path, tokenizer,
                                                                                               capsys):
    """A conversation that opens with the assistant has no prompt before its first turn: transformers' "Cannot apply
    chat template to an empty conversation" ended the step with a traceback."""
    tok = chatml(tokenizer)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION[2:]}])  # assistant, user, ...
    every, _ = build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", multiturn=True)
    assert trained_text(every[0], tok) == "Fine, thanks.<|im_end|>|Goodbye!<|im_end|>"
    assert ("1 earlier assistant turn trained (--multiturn), 1 left as prompt: the chat template renders it otherwise "
            "than a prompt ending at it") in capsys.readouterr().out


def test_a_conversation_ending_with_a_user_turn_is_a_prompt_for_step_3_and_a_counted_skip_before(tmp_path, tokenizer,
                                                                                                   capsys):
    """A messages record whose last message is the user's (a prompt-only messages file; a ShareGPT conversation cut
    after a question) stopped every step with "the last message must be the assistant's answer"."""
    awaiting = CONVERSATION[1:4]  # user, assistant, user
    transcript = "\n\nHuman: Hi there.\n\nAssistant: Hello, friend.\n\nHuman: How are you?\n\nAssistant:"
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": awaiting}, {"messages": transcript},
                                                 {"messages": CONVERSATION[1:3]}])
    prompts, _ = build(tmp_path, tokenizer, [f"{path},{path}"], 3, data_split="0,0,1")
    assert sorted(item["prompt_text"] for item in prompts) == sorted(
        [format_prompt(awaiting, tokenizer)] * 2 + [format_prompt(CONVERSATION[1:2], tokenizer)])
    capsys.readouterr()
    sft, _ = build(tmp_path, tokenizer, [f"{path},{path}"], 1, data_split="1,0,0")
    assert len(sft) == 1 and sft.skipped == {"no answer (the conversation ends with a user turn)": 2}
    assert "skipped 2 of 3 records: 2 no answer (the conversation ends with a user turn)" in capsys.readouterr().out
    # the tools read such a file too: prompts to compare (prompt_eval), no pair to score (rw_eval)
    from dschat.tools.records import load_records

    records = load_records(path)
    assert [r.chosen for r in records] == [None, None, "Hello, friend."]
    assert records[0].messages == awaiting

def test_a_messages_field_written_as_a_whole_transcript_is_read_with_its_answer(tmp_path, tokenizer):
    """A messages (conversations) field may be a "Human: ... Assistant: ..." transcript; one ending with its answer
    stopped every step with a TypeError ("object of type 'NoneType' has no len()"): the check of the last turn's
    weight took the messages of a message list, which a transcript has none of. Its answer is trained (step 1) and
    is step 3's reference answer."""
    transcript = "\n\nHuman: Hi there.\n\nAssistant: Hello, friend.\n\nHuman: How are you?\n\nAssistant: Fine."
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": transcript}] * 2)
    sft, _ = build(tmp_path, tokenizer, [f"{path},{path}"], 1, data_split="1,0,0")
    assert len(sft) == 2 and trained_text(sft[0], tokenizer) == " Fine.<|endoftext|>"
    prompts, _ = build(tmp_path, tokenizer, [f"{path},{path}"], 3, data_split="0,0,1")
    assert prompts[0]["prompt_text"] == format_prompt(CONVERSATION[1:4], tokenizer)
    assert prompts[0]["chosen"] == "Fine."


@pytest.mark.parametrize("template", ["human_assistant", "chatml"])
def test_multiturn_trains_a_conversation_ending_with_a_user_turn_up_to_its_last_answer(tmp_path, tokenizer, capsys,
                                                                                      template):
    """With --multiturn, a conversation cut after a question (a ShareGPT dump) was skipped whole, its answers lost;
    TRL's and OpenRLHF's assistant-only losses train them. Its turns after the last answer are left out, and the
    report counts such conversations. One with no answer at all stays a counted skip."""
    tok = chatml(tokenizer) if template == "chatml" else tokenizer
    cut = CONVERSATION[:5] + [{"role": "user", "content": "Bye."}]  # ..., "Fine, thanks.", user
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": cut}, {"messages": CONVERSATION[:2]},
                                                 {"messages": CONVERSATION}])
    every, _ = build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", multiturn=True)
    texts = sorted(trained_text(item, tok) for item in every)
    answers = {"human_assistant": (" Hello, friend.\n\n| Fine, thanks.<|endoftext|>",
                                   " Hello, friend.\n\n| Fine, thanks.\n\n| Goodbye!<|endoftext|>"),
               "chatml": ("Hello, friend.<|im_end|>|Fine, thanks.<|im_end|>",
                          "Hello, friend.<|im_end|>|Fine, thanks.<|im_end|>|Goodbye!<|im_end|>")}[template]
    assert texts == sorted(answers)
    assert every.skipped == {"no answer (the conversation ends with a user turn)": 1}
    shorter = next(item for item in every if trained_text(item, tok) == answers[0])
    assert "Bye." not in tok.decode(shorter["input_ids"])  # the unanswered question is not in the example
    out = capsys.readouterr().out
    assert "skipped 1 of 3 records: 1 no answer (the conversation ends with a user turn)" in out
    assert "1 conversation ending with a user turn trained up to its last answer (--multiturn)" in out
    # two answers in a row before the last question: the record's error, as for a conversation ending with them
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": CONVERSATION[:3] + CONVERSATION[2:3] + cut[-1:]}])
    with pytest.raises(DatasetFormatError, match="two assistant messages in a row"):
        build(tmp_path, tok, [f"{bad},{bad}"], 1, data_split="1,0,0", multiturn=True)


@pytest.mark.parametrize("template", ["human_assistant", "chatml"])
def test_an_assistant_turn_of_weight_0_is_not_trained(tmp_path, tokenizer, capsys, template):
    """OpenAI's chat fine-tuning format marks an assistant turn not to train with "weight": 0. It was read as 1:
    --multiturn trained such a turn, and without it a last turn of weight 0 was the answer trained. Now such a turn
    stays prompt; a record whose last turn has it trains up to the turn before with --multiturn, and is skipped and
    counted without (nothing to train), as one ending with a user turn is."""
    tok = chatml(tokenizer) if template == "chatml" else tokenizer
    middle = [dict(m, weight=0) if m["content"] == "Fine, thanks." else dict(m, weight=1) if m["role"] == "assistant"
              else m for m in CONVERSATION]
    last = [dict(m, weight=0) if m["content"] == "Goodbye!" else m for m in CONVERSATION]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": middle}, {"messages": last}])
    every, _ = build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", multiturn=True)
    answers = {"human_assistant": (" Hello, friend.\n\n| Goodbye!<|endoftext|>",
                                   " Hello, friend.\n\n| Fine, thanks.<|endoftext|>"),
               "chatml": ("Hello, friend.<|im_end|>|Goodbye!<|im_end|>",
                          "Hello, friend.<|im_end|>|Fine, thanks.<|im_end|>")}[template]
    assert sorted(trained_text(item, tok) for item in every) == sorted(answers)
    assert "kept all 2 records; 2 earlier assistant turns trained (--multiturn)" in capsys.readouterr().out
    last_only, _ = build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0")
    assert [trained_text(item, tok) for item in last_only] == \
        [{"human_assistant": " Goodbye!<|endoftext|>", "chatml": "Goodbye!<|im_end|>"}[template]]
    assert last_only.skipped == {"no answer to train (the last assistant turn has weight 0)": 1}
    assert "skipped 1 of 2 records: 1 no answer to train (the last assistant turn has weight 0)" in \
        capsys.readouterr().out
    # the same conversation with another turn of weight 0 trains other turns: no copy (it was counted 'trained again');
    # without --multiturn only the last turn trains, and the same last turn is a copy
    every_weight = [dict(m, weight=1) if m["role"] == "assistant" else m for m in CONVERSATION]
    path = write_jsonl(tmp_path / "weights.jsonl", [{"messages": middle}, {"messages": every_weight}])
    build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", multiturn=True)
    assert "of an earlier record" not in capsys.readouterr().out
    build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0")
    assert "1 kept is an exact copy of an earlier record: trained again" in capsys.readouterr().out
    # a weight other than 0 or 1 (or null: 1) is its record's error
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": CONVERSATION}, {"messages": [
        dict(m, weight=0.5) if m["content"] == "Hello, friend." else m for m in CONVERSATION]}])
    with pytest.raises(DatasetFormatError, match=rf"{bad} line 2 \(record 1\): field 'messages': message 2 has weight "
                                                 r"0\.5: a weight is 0 \(the turn is not trained\) or 1"):
        build(tmp_path, tok, [f"{bad},{bad}"], 1, data_split="1,0,0")


def test_multiturn_keeps_a_conversation_longer_than_max_seq_len_with_its_turns_within_it(tmp_path, tokenizer, capsys):
    """With --multiturn, a conversation whose last answer did not fit --max_seq_len was skipped whole ("prompt leaves
    no room for an answer"), its earlier answers lost; TRL and OpenRLHF truncate it and train what is left. A turn
    across the cut is trained up to it; one with no assistant turn within the cut stays a counted skip."""
    tok = chatml(tokenizer)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    whole = build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", multiturn=True)[0][0]
    trained = (whole["labels"] != -100).nonzero().flatten().tolist()
    second_end = [i + 1 for i in trained if i + 1 not in trained][1]  # just after "Fine, thanks.<|im_end|>"
    capsys.readouterr()
    for limit, expected in ((second_end + 2, "Hello, friend.<|im_end|>|Fine, thanks.<|im_end|>"),
                            (second_end - 1, "Hello, friend.<|im_end|>|Fine, thanks.")):
        kept = build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", multiturn=True, max_seq_len=limit)[0]
        assert len(kept) == 1 and trained_text(kept[0], tok) == expected
        assert kept[0]["input_ids"].tolist() == whole["input_ids"][:limit].tolist()
        out = capsys.readouterr().out
        assert ("kept the 1 record; 2 earlier assistant turns trained (--multiturn); 1 conversation longer than "
                "--max_seq_len trained on its earlier assistant turns within it (--multiturn)") in out
    # without --multiturn the prompt leaves no room for the (only trained) last answer, as before
    last_only = build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", max_seq_len=second_end + 2)[0]
    assert len(last_only) == 0 and last_only.skipped == {f"prompt leaves no room for an answer in --max_seq_len "
                                                         f"{second_end + 2}": 1}
    early = build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", multiturn=True, max_seq_len=trained[0])[0]
    assert len(early) == 0 and early.skipped == {f"prompt leaves no room for an answer in --max_seq_len "
                                                 f"{trained[0]}": 1}


def test_multiturn_needs_offsets_from_a_fast_tokenizer(tmp_path, tokenizer, monkeypatch):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 2)
    slow = copy.deepcopy(tokenizer)
    monkeypatch.setattr(type(slow), "is_fast", property(lambda self: False))
    with pytest.raises(UsageError, match="--multiturn needs a fast tokenizer"):
        build(tmp_path, slow, [f"{path},{path}"], 1, data_split="1,0,0", multiturn=True)


def test_a_record_the_chat_template_refuses_is_an_error_naming_the_file_and_record(tmp_path, tokenizer):
    """Mistral-style templates raise_exception() on a system turn: jinja's TemplateError traceback named no record."""
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                          "{% endif %}" + CHAT_TEMPLATE)
    rows = records("alpha", 4)
    rows[2] = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."},
                            {"role": "assistant", "content": "Hi."}]}
    rows = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["chosen"]}]}
            if "prompt" in r else r for r in rows]
    path = write_jsonl(tmp_path / "sys.jsonl", rows)
    with pytest.raises(DatasetFormatError, match=r"sys\.jsonl line 3 \(record 2\): field 'messages': the "
                                                 r"tokenizer's chat template refuses them \(System role not "
                                                 r"supported\); the record's first user message: 'Say hi\.'"):
        build(tmp_path, chat, [f"{path},{path}"], 1, data_split="1,0,0")


def test_a_conversation_whose_roles_a_chat_template_refuses_to_see_unalternating_names_the_message(tmp_path,
                                                                                                      tokenizer):
    """Llama-2's and Mistral's templates raise "Conversation roles must alternate" on two user messages in a row or a
    later system message: the error named the record and its first user message, not which message broke the
    alternation."""
    chat = copy.deepcopy(tokenizer)  # (Llama-2's check: a first system message aside, user turns at even positions)
    chat.chat_template = ("{% set turns = messages[1:] if messages[0]['role'] == 'system' else messages %}"
                          "{% for m in turns %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
                          "{% endif %}{% endfor %}" + CHAT_TEMPLATE)

    def message(role, content):
        return {"role": role, "content": content}

    fine = [{"messages": [message("user", f"Q{i}?"), message("assistant", f"A{i}.")]} for i in range(3)]
    for turns, said, multiturn in (
            ([message("user", "Hello."), message("user", "Say hi."), message("assistant", "Hi.")],
             r"message 1 is a second 'user' message in a row .*; join the two into one message", False),
            ([message("system", "Be brief."), message("user", "One."), message("assistant", "Ok."),
              message("user", "Two."), message("user", "Three."), message("assistant", "Done.")],
             r"message 4 is a second 'user' message in a row", True),
            ([message("user", "One."), message("assistant", "Ok."), message("system", "Be brief."),
              message("user", "Two."), message("assistant", "Done.")],
             r"message 2 is a system message after the conversation began; put it first", False)):
        path = write_jsonl(tmp_path / "turns.jsonl", [*fine, {"messages": turns}])
        with pytest.raises(DatasetFormatError, match=r"turns\.jsonl line 4 \(record 3\): field 'messages': the "
                                                     r"tokenizer's chat template refuses them \(Conversation roles "
                                                     rf"must alternate user/assistant/user/assistant/\.\.\.\): {said}"):
            build(tmp_path, chat, [f"{path},{path}"], 1, data_split="1,0,0", multiturn=multiturn)
    # the field that holds the messages is named (a prompt's or a chosen conversation's was said to be 'messages')
    twice = [message("user", "Hello."), message("user", "Say hi.")]
    pairs = [{"prompt": [message("user", f"Q{i}?")], "chosen": f"A{i}.", "rejected": f"B{i}."} for i in range(3)]
    for field, record in (("prompt", {"prompt": twice, "chosen": "Hi.", "rejected": "No."}),
                          ("chosen", {"chosen": [*twice, message("assistant", "Hi.")],
                                      "rejected": [*twice, message("assistant", "No.")]})):
        rows = pairs if field == "prompt" else [{"chosen": [*r["prompt"], message("assistant", r["chosen"])],
                                                 "rejected": [*r["prompt"], message("assistant", r["rejected"])]}
                                                for r in pairs]
        path = write_jsonl(tmp_path / f"{field}.jsonl", [*rows, record])
        with pytest.raises(DatasetFormatError, match=rf"line 4 \(record 3\): field '{field}': the tokenizer's chat "
                                                     r"template refuses them .*: message 1 is a second 'user' message"):
            build(tmp_path, chat, [f"{path},{path}"], 2, data_split="0,1,0")


def test_records_already_formatted_with_special_tokens_are_said(tmp_path, tokenizer, capsys):
    """A prompt already run through a chat template, or an answer ending in the end token, was formatted a second
    time (a doubled BOS, template and end token inside the trained labels) without a word."""
    rows = records("alpha", 6)
    rows[1] = dict(rows[1], chosen=rows[1]["chosen"] + "<|endoftext|>")
    rows[3] = dict(rows[3], prompt="<|endoftext|>" + rows[3]["prompt"])
    path = write_jsonl(tmp_path / "formatted.jsonl", rows)
    build(tmp_path, tokenizer, [f"{path},{path}"], 1, data_split="1,0,0")
    assert ("2 with the tokenizer's special token '<|endoftext|>' in their text: already formatted, they are "
            "formatted again") in capsys.readouterr().out
    padded_as_eos = copy.deepcopy(tokenizer)  # (load_tokenizer pads with EOS where a tokenizer has no pad token)
    padded_as_eos.pad_token = padded_as_eos.eos_token
    build(tmp_path, padded_as_eos, [f"{path},{path}"], 1, data_split="1,0,0")
    assert "2 with the tokenizer's special token '<|endoftext|>'" in capsys.readouterr().out
    plain = write_jsonl(tmp_path / "plain.jsonl", records("alpha", 6))
    build(tmp_path, tokenizer, [f"{plain},{plain}"], 1, data_split="1,0,0")
    assert "already formatted" not in capsys.readouterr().out


def test_skip_counts_are_printed_and_exposed(tmp_path, tokenizer, capsys):
    rows = records("alpha", 6)
    rows += [dict(r, rejected=r["chosen"]) for r in records("alpha", 2, start=10)]
    rows += [dict(records("alpha", 1, start=20)[0], rejected=None)]
    rows += [dict(records("alpha", 1, start=30)[0], prompt="Long record 30. " + " ".join(["filler"] * 40))]
    path = write_jsonl(tmp_path / "skips.jsonl", rows)
    eval_path = write_jsonl(tmp_path / "skips_eval.jsonl", records("alpha", 2, start=40))
    train, eval_ = build(tmp_path, tokenizer, [f"{path},{eval_path}"], 2, data_split="0,1,0", max_prompt_len=32)
    expected = {"chosen==rejected": 2, "no rejected answer": 1, "prompt longer than 32 tokens": 1}
    assert train.skipped == expected and len(train) == 6
    assert eval_.skipped == {} and len(eval_) == 2
    out = capsys.readouterr().out
    assert ("skipped 4 of 10 records: 2 chosen==rejected, 1 no rejected answer, 1 prompt longer than 32 tokens"
            in out)
    cached, _ = build(tmp_path, tokenizer, [f"{path},{eval_path}"], 2, data_split="0,1,0", max_prompt_len=32)
    assert not cached.built and cached.skipped == expected  # counts survive the cache


def test_unpaired_preference_records_train_only_their_desirable_answers(tmp_path, tokenizer):
    """TRL's (KTO's) prompt/completion/label records: an answer marked label false is not one to imitate."""
    rows = [{"prompt": f"Name color {i}.", "completion": f"{'good' if i % 2 else 'bad'} {i}", "label": bool(i % 2)}
            for i in range(8)]
    path = write_jsonl(tmp_path / "kto.jsonl", rows)
    train, _ = build(tmp_path, tokenizer, [f"{path},{path}"], 1, data_split="1,0,0")
    texts = [tokenizer.decode(item["input_ids"]) for item in train]
    assert len(train) == 4 and all("good" in text and "bad" not in text for text in texts)
    assert train.skipped == {"undesirable answer (label false: TRL's unpaired preference data)": 4}
    prompts, _ = build(tmp_path, tokenizer, [f"{path},{path}"], 3, data_split="0,0,1")
    assert len(prompts) == 8 and sorted(item["label"] for item in prompts) == [False] * 4 + [True] * 4


def test_step3_records_carry_a_pairs_answers_for_reward_functions(tmp_path, tokenizer):
    """As TRL passes a dataset's columns: a reference answer for the reward function to compare with."""
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [dict(r, source="web") for r in records("alpha", 4)])
    items, _ = build(tmp_path, tokenizer, [f"{pairs},{pairs}"], 3, data_split="0,0,1")
    by_prompt = {r["prompt"]: r for r in records("alpha", 4)}
    for item in items:
        record = next(r for p, r in by_prompt.items() if p in item["prompt_text"])
        assert (item["chosen"], item["rejected"], item["source"]) == (record["chosen"], record["rejected"], "web")
    renamed = write_jsonl(tmp_path / "renamed.jsonl", [{"prompt": "Say hi.", "good": "Hi.", "bad": "Go.",
                                                        "chosen": "a column of its own"}] * 2)
    items, _ = build(tmp_path, tokenizer, [f"{renamed},{renamed}"], 3, data_split="0,0,1",
                     data_fields="chosen=good,rejected=bad")
    assert (items[0]["chosen"], items[0]["extra_chosen"]) == ("Hi.", "a column of its own")  # neither lost
    both = write_jsonl(tmp_path / "both.jsonl", [{"prompt": "Say hi.", "good": "Hi.", "bad": "Go.",
                                                  "chosen": "a column of its own", "extra_chosen": "another"}] * 2)
    with pytest.raises(UsageError, match=r"both.jsonl.*both a column 'extra_chosen' and a column 'chosen'"):
        build(tmp_path, tokenizer, [f"{both},{both}"], 3, data_split="0,0,1", data_fields="chosen=good,rejected=bad")
    completions = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "Say hi.", "completion": "Hi."}] * 2)
    items, _ = build(tmp_path, tokenizer, [f"{completions},{completions}"], 3, data_split="0,0,1")
    assert not {"chosen", "rejected", "completion"} & set(items[0])  # TRL passes no completion column


def test_data_given_twice_is_said(tmp_path, tokenizer, capsys):
    path = write_jsonl(tmp_path / "pairs.jsonl", records("alpha", 6))
    train, _ = build(tmp_path, tokenizer, [f"{path},{path}", f"jsonl:{path},{path}"], 1, data_split="1,0,0")
    assert len(train) == 12  # read twice, as given
    assert "the same data given more than once; each time its records are read again" in capsys.readouterr().out
    build(tmp_path, tokenizer, [f"{path},{path}"], 1, data_split="1,0,0")
    assert "more than once" not in capsys.readouterr().out


def test_records_repeated_in_a_file_or_across_files_are_counted_kept_and_said(tmp_path, tokenizer, capsys):
    """DeepSpeed-Chat and TRL train a repeated record again, as dschat does; it was not said at all."""
    rows = records("alpha", 6)
    first = write_jsonl(tmp_path / "first.jsonl", rows + [rows[0], rows[1], rows[1]])
    second = write_jsonl(tmp_path / "second.jsonl", [rows[2], dict(rows[3], rejected="Another bad one.")]
                         + records("beta", 2))
    eval_ = write_jsonl(tmp_path / "eval.jsonl", rows[:2])  # (the train files' records: each split is apart)
    other_eval = write_jsonl(tmp_path / "other_eval.jsonl", records("beta", 2, start=100))
    train, _ = build(tmp_path, tokenizer, [f"{first},{eval_}", f"{second},{other_eval}"], 2, data_split="0,1,0")
    assert len(train) == 13  # all kept
    out = capsys.readouterr().out
    assert f"{first},{eval_} train: kept all 9 records; 3 kept are exact copies of earlier records: trained again\n" \
        in out
    # (the pair with another rejected answer is another record)
    assert (f"{second},{other_eval} train: kept all 4 records; 1 kept is an exact copy of an earlier record (1 of "
            "another source's): trained again\n") in out
    # (the eval file repeats two train records: said, as the held-out numbers are partly on trained data)
    assert (f"{first},{eval_} eval: kept all 2 records; 2 are exact copies of train records: the held-out numbers "
            "are partly on trained data\n") in out
    assert f"{second},{other_eval} eval: kept all 2 records\n" in out
    both = write_jsonl(tmp_path / "both.jsonl", [rows[3], dict(rows[3], rejected="Another bad one.")])
    build(tmp_path, tokenizer, [f"{both},{other_eval}"], 1, data_split="1,0,0")
    assert "kept all 2 records; 1 kept is an exact copy" in capsys.readouterr().out  # what SFT reads of them
    build(tmp_path, tokenizer, [f"{other_eval},{other_eval}"], 1, data_split="1,0,0")
    out = capsys.readouterr().out
    assert f"{other_eval},{other_eval} train: kept all 2 records\n" in out  # (no copies within a split)
    assert f"{other_eval},{other_eval} eval: kept all 2 records; 2 are exact copies of train records" in out


def test_eval_records_repeated_across_sources_are_said_to_be_evaluated_again(tmp_path, tokenizer, capsys):
    """An eval record that repeats an earlier eval record is scored again in the held-out numbers; the report said it
    was 'trained again', as of a train record, though no eval record is trained on."""
    shared_eval = write_jsonl(tmp_path / "eval.jsonl", records("beta", 2, start=100))
    first = write_jsonl(tmp_path / "first.jsonl", records("alpha", 3))
    second = write_jsonl(tmp_path / "second.jsonl", records("gamma", 3))
    build(tmp_path, tokenizer, [f"{first},{shared_eval}", f"{second},{shared_eval}"], 2, data_split="0,1,0")
    out = capsys.readouterr().out
    assert (f"{second},{shared_eval} eval: kept all 2 records; 2 kept are exact copies of earlier records (2 of "
            "another source's): evaluated again\n") in out
    assert "trained again" not in out


def test_a_file_given_again_inside_a_folder_or_with_another_eval_file_is_said(tmp_path, tokenizer, capsys):
    """The same train file read through two specs that differ (its folder and the file; the file with and without an
    eval file): its records are read twice, and those of one spec's train split may be another's eval records."""
    folder = tmp_path / "data"
    folder.mkdir()
    train = write_jsonl(folder / "train.jsonl", records("alpha", 10))
    other_eval = write_jsonl(tmp_path / "other_eval.jsonl", records("alpha", 2, start=100))
    for specs in ([str(folder), train], [f"jsonl:{train}", f"{train},{other_eval}"]):
        build(tmp_path, tokenizer, specs, 1, data_split="1,0,0")
        said = [line for line in capsys.readouterr().out.splitlines() if "more than once" in line]
        assert len(said) == 1 and all(spec in said[0] for spec in specs), (specs, said)
    build(tmp_path, tokenizer, [train, other_eval], 1, data_split="1,0,0")
    assert "more than once" not in capsys.readouterr().out


def test_the_report_says_when_a_phase_trains_on_a_share_of_the_file(tmp_path, tokenizer, capsys):
    """DeepSpeed-Chat's --data_split gives step 3 a share of a prompts file: "kept all" alone read as the whole file."""
    spec = train_eval_spec(tmp_path, "alpha", 50, 10)
    train, _ = build(tmp_path, tokenizer, [spec], 3)
    out = capsys.readouterr().out
    assert (f"train: kept all {len(train)} records (this phase's share by --data_split 2,4,4: {len(train)} of the "
            "source's 50 records)") in out and len(train) < 50
    whole, _ = build(tmp_path, tokenizer, [spec], 3, data_split="0,0,1")
    assert len(whole) == 50 and "train: kept all 50 records\n" in capsys.readouterr().out


# --- caching ---

def test_cache_is_reused_unless_a_parameter_changes(tmp_path, tokenizer):
    spec = train_eval_spec(tmp_path, "alpha", 10, 2)
    base = dict(data_path=[spec], phase=1)
    first, _ = build(tmp_path, tokenizer, **base)
    again, _ = build(tmp_path, tokenizer, **base)
    assert first.built and not again.built and again.cache_path == first.cache_path

    chat = copy.deepcopy(tokenizer)
    chat.chat_template = CHAT_TEMPLATE
    bigger_vocab = copy.deepcopy(tokenizer)
    bigger_vocab.add_tokens(["<brand_new_token>"])
    renamed = copy.deepcopy(tokenizer)
    renamed.name_or_path = "some/other-model"
    variants = {
        "data_split": dict(data_split="3,4,3"), "seed": dict(seed=7), "max_seq_len": dict(max_seq_len=100),
        "max_prompt_len": dict(max_prompt_len=40), "include_prompt": dict(include_prompt_in_loss=True),
        "multiturn": dict(multiturn=True),
        "eot": dict(end_of_conversation_token="<pad>"), "fields": dict(data_fields="rejected=task"),
        "chat_template": dict(tok=chat), "vocab": dict(tok=bigger_vocab), "tokenizer_name": dict(tok=renamed),
        "phase": dict(phase=2), "second_dataset": dict(data_path=[spec, train_eval_spec(tmp_path, "beta", 5, 1)]),
    }
    paths = {first.cache_path}
    for name, change in variants.items():
        options = {**base, **change}
        tok = options.pop("tok", tokenizer)
        dataset, _ = build(tmp_path, tok, options.pop("data_path"), options.pop("phase"), **options)
        assert dataset.built and dataset.cache_path not in paths, name
        paths.add(dataset.cache_path)

    train_file = spec.split(",")[0]
    time.sleep(0.01)
    with open(train_file, "a") as f:  # an edited data file gets a new key
        f.write(json.dumps(records("alpha", 1, start=500)[0]) + "\n")
    edited, _ = build(tmp_path, tokenizer, **base)
    assert edited.built and edited.cache_path not in paths
    paths.add(edited.cache_path)
    # an edit that keeps the file's size and time (a same-length fix restored with touch -r) reused the stale cache
    stat, text = os.stat(train_file), open(train_file).read()
    with open(train_file, "w") as f:
        f.write(text.replace(" is fine.", " is good."))
    os.utime(train_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    same_stat, _ = build(tmp_path, tokenizer, **base)
    assert same_stat.built and same_stat.cache_path not in paths
    # ... and its rebuild read the old records from datasets' Arrow cache of the file (keyed by path and time)
    texts = [tokenizer.decode(same_stat[i]["input_ids"]) for i in range(len(same_stat))]
    assert texts and all(" is good." in text for text in texts), texts
    edited = same_stat

    reloaded, _ = build(tmp_path, tokenizer, **base, reload=True)
    assert reloaded.built and reloaded.cache_path == edited.cache_path

    tokenizer(["a", "a b c"], padding=True, truncation=True, max_length=2)  # leaves padding/truncation state behind
    after_padded_call, _ = build(tmp_path, tokenizer, **base)
    assert not after_padded_call.built and after_padded_call.cache_path == edited.cache_path


def hub_rows(answer, count=5):
    """Dahoas/rm-static records (its columns) whose chosen answer is ``answer``."""
    return [{"prompt": f"\n\nHuman: Hi record {i}.\n\nAssistant:", "response": answer, "chosen": answer,
             "rejected": " Go away."} for i in range(count)]


def decoded(dataset, tokenizer):
    return [tokenizer.decode(dataset[i]["input_ids"]) for i in range(len(dataset))]


def test_a_hub_dataset_is_keyed_by_the_data_it_loaded(tmp_path, tokenizer, monkeypatch):
    """A hub dataset was keyed by its name alone: once another version of it was loaded (a new revision in the HF
    cache), the steps went on training on the tokens of the old one, silently."""
    version = {}
    monkeypatch.setattr(DahoasRmstaticDataset, "load", lambda self: DatasetDict(
        {"train": Dataset.from_list(version["rows"]), "test": Dataset.from_list(version["rows"][:2])}))
    version["rows"] = hub_rows(" Hello.")
    first, _ = build(tmp_path, tokenizer, ["Dahoas/rm-static"], 1, data_split="1,0,0")
    version["rows"] = hub_rows(" Hello again.")
    newer, _ = build(tmp_path, tokenizer, ["Dahoas/rm-static"], 1, data_split="1,0,0")
    assert newer.built and newer.cache_path != first.cache_path
    assert len(newer) == 5 and all(text.endswith(" Hello again.<|endoftext|>") for text in decoded(newer, tokenizer))
    same, _ = build(tmp_path, tokenizer, ["Dahoas/rm-static"], 1, data_split="1,0,0")
    assert not same.built and same.cache_path == newer.cache_path


def test_only_rank_0_loads_a_hub_dataset_the_other_ranks_key_by_what_it_loaded(tmp_path, tokenizer, monkeypatch):
    """Every rank of every node loaded the hub dataset for the cache key: as many hub requests as ranks, and each node
    needed its own HF cache copy even with the tokens cached. Now rank 0 loads it and the others take its fingerprint."""
    from dschat.utils import dist

    monkeypatch.setattr(DahoasRmstaticDataset, "load", lambda self: DatasetDict(
        {"train": Dataset.from_list(hub_rows(" Hello.")), "test": Dataset.from_list(hub_rows(" Hello.")[:2])}))
    decided, own = [], dist.rank_0_decides
    monkeypatch.setattr(dist, "rank_0_decides", lambda decide: decided.append(own(decide)) or decided[-1])
    first, _ = build(tmp_path, tokenizer, ["Dahoas/rm-static"], 1, data_split="1,0,0")
    fingerprints = decided[0]
    assert list(fingerprints) == ["Dahoas/rm-static"] and set(fingerprints["Dahoas/rm-static"]) == {"train", "test"}

    def no_hub(self):
        raise AssertionError("a rank other than 0 loaded the hub dataset")

    monkeypatch.setattr(DahoasRmstaticDataset, "load", no_hub)
    monkeypatch.setattr(dist, "rank_0_decides", lambda decide: fingerprints)  # rank 1: rank 0 decided
    again, _ = build(tmp_path, tokenizer, ["Dahoas/rm-static"], 1, data_split="1,0,0")
    assert not again.built and again.cache_path == first.cache_path


def test_the_tokenized_data_says_which_data_of_a_hub_dataset_it_holds(tmp_path, tokenizer, monkeypatch):
    """What a step's checkpoints record (``PromptDataset.hub_data``), so that a resume notices a new revision: the
    fingerprints the cache is keyed by, also when a rank other than 0 built the cache (it loads the hub data itself);
    local data has none."""
    from dschat.utils import dist

    monkeypatch.setattr(DahoasRmstaticDataset, "load", lambda self: DatasetDict(
        {"train": Dataset.from_list(hub_rows(" Hello.")), "test": Dataset.from_list(hub_rows(" Hello.")[:2])}))
    decided, own = [], dist.rank_0_decides
    monkeypatch.setattr(dist, "rank_0_decides", lambda decide: decided.append(own(decide)) or decided[-1])
    local = write_jsonl(tmp_path / "local.jsonl", [{"prompt": f"Hi record {i}.", "chosen": " Hello."}
                                                   for i in range(5)])
    train, eval_ = build(tmp_path, tokenizer, ["Dahoas/rm-static", f"jsonl:{local}"], 1, data_split="1,0,0")
    assert train.built and train.hub_data == eval_.hub_data == decided[0] and list(decided[0]) == ["Dahoas/rm-static"]
    real_hub_sources = pipeline.hub_sources_on_rank_0
    monkeypatch.setattr(pipeline, "hub_sources_on_rank_0",  # rank 1: no adapters, rank 0's fingerprints
                        lambda *args: ({}, real_hub_sources(*args)[1]))
    other, _ = build(tmp_path, tokenizer, ["Dahoas/rm-static", f"jsonl:{local}"], 1, data_split="1,0,0", reload=True)
    assert other.built and other.hub_data == decided[0]


def test_a_cache_built_before_hub_data_was_reported_still_says_which_hub_data_it_holds(tmp_path, tokenizer,
                                                                                       monkeypatch):
    """A cache built before its report kept ``hub_data`` has the same key (the key held the hub fingerprints then too)
    and is reused: its dataset said {} of the hub data, a checkpoint recorded {}, and the resume after the cache was
    built again (--reload_data, another --data_path_output) was refused as another revision of the same data."""
    monkeypatch.setattr(DahoasRmstaticDataset, "load", lambda self: DatasetDict(
        {"train": Dataset.from_list(hub_rows(" Hello.")), "test": Dataset.from_list(hub_rows(" Hello.")[:2])}))
    fresh, _ = build(tmp_path, tokenizer, ["Dahoas/rm-static"], 1, data_split="1,0,0")
    assert list(fresh.hub_data) == ["Dahoas/rm-static"]
    meta = os.path.join(fresh.cache_path, pipeline.META_FILE)
    with open(meta) as f:
        report = json.load(f)["report"]
    with open(meta, "w") as f:
        json.dump({"report": [{k: v for k, v in entry.items() if k != "hub_data"} for entry in report]}, f)
    old, old_eval = build(tmp_path, tokenizer, ["Dahoas/rm-static"], 1, data_split="1,0,0")
    assert not old.built and old.hub_data == old_eval.hub_data == fresh.hub_data


def write_hub_revision(hf_cache, commit, rows):
    """``rows`` as revision ``commit`` of Dahoas/rm-static in datasets' cache, in the folder a load from the hub
    leaves (Dahoas___rm-static/default/0.0.0/COMMIT); built from a local file, so the builder is told the repository
    after it is made (it refuses data files that are not the repository's)."""
    from datasets.packaged_modules.json.json import Json

    files = {split: write_jsonl(hf_cache.parent / f"{commit}_{split}.jsonl", part)
             for split, part in (("train", rows), ("test", rows[:2]))}
    builder = Json(cache_dir=str(hf_cache), config_id="default", hash=commit, data_files=files)
    builder.repo_id, builder.dataset_name = "Dahoas/rm-static", "rm-static"
    builder._cache_dir = builder._build_cache_dir()
    builder.download_and_prepare()


def test_a_new_hub_revision_in_the_hf_cache_is_tokenized_again_offline(tmp_path, tokenizer, monkeypatch):
    """With HF_HUB_OFFLINE=1 datasets loads the latest revision its cache holds: a revision downloaded since (here
    written into the cache) gets a new key, and the same one keeps it, with no network."""
    hf_cache = tmp_path / "hf_cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(hf_cache))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # (the tests' environment is offline already)
    write_hub_revision(hf_cache, "aaaa", hub_rows(" Hello."))
    first, _ = build(tmp_path, tokenizer, ["Dahoas/rm-static"], 1, data_split="1,0,0")
    again, _ = build(tmp_path, tokenizer, ["Dahoas/rm-static"], 1, data_split="1,0,0")
    assert first.built and not again.built and again.cache_path == first.cache_path
    older = hf_cache / "Dahoas___rm-static" / "default" / "0.0.0" / "aaaa"
    os.utime(older, (time.time() - 60,) * 2)  # (datasets picks the latest cached revision by its folder's time)
    write_hub_revision(hf_cache, "bbbb", hub_rows(" Hello again."))
    newer, _ = build(tmp_path, tokenizer, ["Dahoas/rm-static"], 1, data_split="1,0,0")
    assert newer.built and newer.cache_path != first.cache_path
    assert all(text.endswith(" Hello again.<|endoftext|>") for text in decoded(newer, tokenizer))


def test_a_killed_builds_leftovers_are_removed_by_the_next_build_of_that_key_only(tmp_path):
    from dschat.data.cache import ensure_built

    folder, other = tmp_path / "phase1_abc", tmp_path / "phase1_def"
    for leftover in (tmp_path / "phase1_abc.building-x1", tmp_path / "phase1_abc.old-x2",
                     tmp_path / "phase1_def.building-x3"):  # the last: another key's build, maybe in progress
        leftover.mkdir()
    assert ensure_built(str(folder), lambda tmp: open(os.path.join(tmp, "data"), "w").write("ok"))
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == \
        ["phase1_abc", "phase1_def.building-x3"]
    assert not other.exists()


def _build_in_child(args):
    """Runs in a forked process: build the same dataset as the sibling, report (built, path, size)."""
    out_dir, spec, hf_cache, barrier = args
    datasets.config.HF_DATASETS_CACHE = hf_cache
    original = pipeline.build_and_save

    def slow_build(*a, **k):  # widen the race window so both processes really overlap
        time.sleep(0.5)
        return original(*a, **k)

    pipeline.build_and_save = slow_build
    barrier.wait()
    train, _ = create_prompt_dataset(0, [spec], "2,4,4", out_dir, 1, 1234, load_tiny_tokenizer(), 128)
    return train.built, train.cache_path, len(train)


def test_concurrent_builders_produce_one_cache(tmp_path):
    spec = train_eval_spec(tmp_path, "alpha", 20, 5)
    out_dir = str(tmp_path / "shared_out")
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Manager().Barrier(2)
    with ctx.Pool(2) as pool:
        results = pool.map(_build_in_child, [(out_dir, spec, str(tmp_path / "hf_cache"), barrier)] * 2)
    assert sorted(built for built, _, _ in results) == [False, True]  # exactly one process built
    assert results[0][1:] == results[1][1:]
    entries = os.listdir(os.path.join(out_dir, CACHE_SUBDIR))
    assert [e for e in entries if not e.endswith(".lock")] == [os.path.basename(results[0][1])]  # no temp folders


def test_leading_special_ids_keep_the_bos_and_drop_a_trailing_eos_whatever_the_vocabulary():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from dschat.data.pipeline import tokenize_texts

    def tokenizer(vocab, single):
        tok = Tokenizer(models.BPE(vocab, [], unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<s>", 0), ("</s>", 1)])
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")

    digits = tokenizer({"<s>": 0, "</s>": 1, **{str(d): d + 2 for d in range(10)}, "+": 12, "=": 13}, "<s> $A")
    assert digits("a", add_special_tokens=False)["input_ids"] == []  # the first probe has no tokens here
    assert tokenize_texts(digits, ["1+2="], True) == [[0, 3, 12, 4, 13]]
    bos_eos = tokenizer({"<s>": 0, "</s>": 1, "a": 2, "b": 3}, "<s> $A </s>")
    assert tokenize_texts(bos_eos, ["a b"], True) == [[0, 2, 3]]  # the BOS, not the EOS after the prompt


def test_a_custom_strict_source_names_itself_for_a_record_error():
    """extract_examples locates a strict source's bad record with raw.locate: a user's PromptRawDataset subclass with
    strict = True (documented) had no locate, so its record error became an AttributeError."""
    from dschat.data.base import PromptRawDataset

    raw = object.__new__(PromptRawDataset)
    raw.dataset_name = "my/source"
    assert raw.locate({"prompt": "x"}) == "my/source"


def test_a_source_without_a_share_of_the_phase_need_not_suit_it(tmp_path, tokenizer):
    """Step 1 on --sft_only_data_path alone (--data_split 0,0,1 is allowed with it): --data_path's prompts, step 3's,
    give it no record, so they are not refused for having no answers."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"Prompt {i}."} for i in range(10)])
    sft = write_jsonl(tmp_path / "sft.jsonl", records("sft", 10))
    train, _ = build(tmp_path, tokenizer, [prompts], 1, data_split="0,0,1", sft_only_data_path=[sft])
    assert len(train) == 9  # the SFT file's train part (its 90%), whole
    with pytest.raises(DatasetFormatError, match="has prompts but no answers"):  # with a share, still refused
        build(tmp_path, tokenizer, [prompts], 1, data_split="1,0,1", sft_only_data_path=[sft])


TWO_NODES_SCRIPT = """
import os, sys, torch
from dschat.data import create_prompt_dataset
from dschat.tiny import load_tiny_tokenizer
from dschat.utils.dist import ensure_distributed
rank, _ = ensure_distributed()
seen = []
for name in ("same.jsonl", "other.jsonl"):  # each 'node' reads its own copy in its working directory
    try:
        train, eval_ = create_prompt_dataset(0, [name], "10,0,0", sys.argv[1], 1, 1234, load_tiny_tokenizer(), 128)
        seen.append(f"{len(train)} {len(eval_)}")
    except Exception as error:
        seen.append(f"{type(error).__name__}: {error}")
""" + WRITE_SEEN_AND_END


def test_nodes_reading_copies_of_the_data_that_differ_stop_with_an_error_naming_it(tmp_path):
    """Two nodes (one rank each, both local rank 0), each reading --data_path from its own disk: a copy that differs
    (more records) gave the ranks datasets of other sizes, and the rank with fewer batches left the epoch while the
    other waited for it in a collective (a hang)."""
    nodes = [tmp_path / f"node{rank}" for rank in range(2)]
    for rank, node in enumerate(nodes):
        node.mkdir()
        write_jsonl(node / "same.jsonl", records("same", 20))
        write_jsonl(node / "other.jsonl", records("other", 20 + 10 * rank))
    run_as_two_nodes(tmp_path, TWO_NODES_SCRIPT, nodes)
    for node, (train, eval_) in zip(nodes, ((18, 2), (27, 3))):
        same, other = (node / "seen").read_text().splitlines()
        assert same == "18 2"  # (identical copies at other paths: the same data)
        assert other == (f"UsageError: the ranks read different phase-1 data: other.jsonl (its content), the record "
                         f"counts (here {train} train / {eval_} eval) differ between them (each node's own copy of a "
                         f"file, or of a hub dataset or model in its cache, that is not the same): give every node "
                         f"the same files")


TWO_HUB_COPIES_SCRIPT = """
import torch
from datasets import Dataset, DatasetDict
from dschat.data import DahoasRmstaticDataset, create_prompt_dataset
from dschat.tiny import load_tiny_tokenizer
from dschat.utils.dist import ensure_distributed
rank, _ = ensure_distributed()
answer = " Hello." if rank == 0 else " Goodbye."  # each node's HF cache: another revision, as many records
rows = [{"prompt": f"\\n\\nHuman: Hi record {i}.\\n\\nAssistant:", "response": answer, "chosen": answer,
         "rejected": " Go away."} for i in range(5)]
DahoasRmstaticDataset.load = lambda self: DatasetDict({"train": Dataset.from_list(rows),
                                                       "test": Dataset.from_list(rows[:2])})
try:
    create_prompt_dataset(0, ["Dahoas/rm-static"], "1,0,0", "own_cache", 1, 1234, load_tiny_tokenizer(), 128)
    seen = "same"
except Exception as error:
    seen = f"{type(error).__name__}: {error}"
with open("seen", "w") as f:
    f.write(seen)
from dschat.utils.cli import end_script
end_script()  # (a gloo rank aborted in the interpreter's teardown now and then)
"""


def test_nodes_whose_hub_caches_hold_other_revisions_stop_with_an_error_naming_the_dataset(tmp_path):
    """Rank 0 alone loads a hub dataset for the cache key: a node building its own cache from another revision in its
    own HF cache (as many records) trained on other data under rank 0's key, unnoticed."""
    nodes = [tmp_path / f"node{rank}" for rank in range(2)]
    for node in nodes:
        node.mkdir()
    run_as_two_nodes(tmp_path, TWO_HUB_COPIES_SCRIPT, nodes)
    for node in nodes:
        assert (node / "seen").read_text().startswith(
            "UsageError: the ranks read different phase-1 data: Dahoas/rm-static (its content) differ"), node


RELOAD_SCRIPT = """
import sys, time, torch
from dschat.data import create_prompt_dataset
from dschat.tiny import load_tiny_tokenizer
from dschat.utils.dist import ensure_distributed
rank, _ = ensure_distributed()
def build(cache, **options):
    return create_prompt_dataset(0, ["data.jsonl"], "10,0,0", cache, 1, 1234, load_tiny_tokenizer(), 128,
                                 **options)[0].built
built = []
for cache in (sys.argv[1], "cache_of_rank_%d" % rank):  # on storage both nodes see, then on each node's own
    build(cache)  # an earlier run's cache
    torch.distributed.barrier()
    if rank == 1:
        time.sleep(3)  # this node gets there later (its model loaded from a colder disk)
    built.append(str(build(cache, reload=True)))
with open(f"built_{rank}", "w") as f:
    f.write(" ".join(built))
from dschat.utils.cli import end_script
end_script()  # (a gloo rank aborted in the interpreter's teardown now and then)
"""


def test_a_forced_rebuild_is_done_once_on_each_storage_the_nodes_write_to(tmp_path):
    """--reload_data rebuilt the cache on each local rank 0: on storage two nodes share, the later node's built it a
    second time (and under train.py, whose steps have no --local_rank, every rank that came after the build did). On
    each node's own storage, each node rebuilds its cache."""
    write_jsonl(tmp_path / "data.jsonl", records("data", 20))
    run_as_two_nodes(tmp_path, RELOAD_SCRIPT, [tmp_path, tmp_path])
    # shared: built by one node, whichever took the lock first (the ranks meet at rank 0's token before it); each
    # node's own: by each
    shared, own = zip(*((tmp_path / f"built_{rank}").read_text().split() for rank in range(2)))
    assert sorted(shared) == ["False", "True"] and own == ("True", "True")


def test_a_system_column_is_the_conversations_first_message(tmp_path, tokenizer):
    """LLaMA-Factory's records give the system prompt as a column of its own ("system", beside ShareGPT's
    conversations): it was passed on as an extra column, and the model trained without it. It is the conversation's
    first message (the turns of weight 0 after it stay prompt with --multiturn; --data_fields system=NAME names
    another column); messages that begin with another system message are the record's error."""
    tok = chatml(tokenizer)
    sharegpt = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}], "system": "Be brief."}
    weighted = {"conversations": [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1", "weight": 0},
                                  {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}],
                "system": "Be brief."}
    path = write_jsonl(tmp_path / "system.jsonl", [sharegpt, weighted])
    train, _ = build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", multiturn=True)
    texts = [tok.decode(item["input_ids"]) for item in train]
    assert all(text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n") for text in texts)
    assert sorted(trained_text(item, tok) for item in train) == ["A2<|im_end|>", "Yo<|im_end|>"]
    renamed = write_jsonl(tmp_path / "renamed.jsonl", [{"conversations": sharegpt["conversations"], "sys": "Be kind."}])
    prompts, _ = build(tmp_path, tok, [f"{renamed},{renamed}"], 3, data_split="0,0,1", data_fields="system=sys")
    assert prompts[0]["prompt_text"].startswith("<|im_start|>system\nBe kind.<|im_end|>")
    twice = write_jsonl(tmp_path / "twice.jsonl", [{"messages": [{"role": "system", "content": "Be long."},
                                                                 {"role": "user", "content": "Hi"},
                                                                 {"role": "assistant", "content": "Yo"}],
                                                    "system": "Be brief."}])
    with pytest.raises(DatasetFormatError, match=r"twice.jsonl line 1 \(record 0\): field 'system': the record's "
                                                 r"messages begin with another system message"):
        build(tmp_path, tok, [f"{twice},{twice}"], 1, data_split="1,0,0")


def test_step3_reward_functions_still_get_the_system_column(tmp_path, tokenizer):
    """The system column became the conversation's system message (FORMAT_VERSION 31) and with it a used column, left
    out of step 3's extra columns: a reward function taking ``system=`` (TRL passes every dataset column) failed. It
    is passed as written, and the prompt keeps it once. So are Alpaca's input and history (FORMAT_VERSION 32)."""
    from dschat.data.collators import DataCollatorRLHF
    from dschat.rlhf.reward_fn import batch_extras, call_reward_fn

    tok = chatml(tokenizer)
    rows = [{"prompt": "Say hi.", "chosen": "Hi.", "system": system} for system in ("Be brief.", "Be kind.")]
    path = write_jsonl(tmp_path / "system.jsonl", rows)
    prompts, _ = build(tmp_path, tok, [f"{path},{path}"], 3, data_split="0,0,1")
    assert sorted(item["system"] for item in prompts) == ["Be brief.", "Be kind."]
    assert all(item["prompt_text"].count("<|im_start|>system\n" + item["system"]) == 1 for item in prompts)
    batch = DataCollatorRLHF(None, pad_token_id=0)([prompts[0], prompts[1]])

    def brief(prompts, completions, system, **columns):
        return [float(text == "Be brief.") for text in system]

    scores = call_reward_fn(brief, batch["prompt_text"], ["a", "b"], batch_extras(batch))
    assert scores == [float(item["system"] == "Be brief.") for item in (prompts[0], prompts[1])]
    renamed = write_jsonl(tmp_path / "renamed.jsonl", [{"prompt": "Say hi.", "sys": "Be kind."}] * 2)
    prompts, _ = build(tmp_path, tok, [f"{renamed},{renamed}"], 3, data_split="0,0,1", data_fields="system=sys")
    assert prompts[0]["sys"] == "Be kind." and "system" not in prompts[0]  # (its column's own name, as TRL's)
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "Add.", "input": "1 + 1", "output": "2",
                                                      "history": [["Hi", "Yo"]]}] * 2)  # (its input, history: the same)
    prompts, _ = build(tmp_path, tok, [f"{alpaca},{alpaca}"], 3, data_split="0,0,1")
    assert (prompts[0]["input"], prompts[0]["history"]) == ("1 + 1", [["Hi", "Yo"]])
    assert "Add.\n1 + 1" in prompts[0]["prompt_text"] and "Yo" in prompts[0]["prompt_text"]


def test_step3_reward_functions_get_alpacas_output_under_its_own_name(tmp_path, tokenizer):
    """An Alpaca record's output (read as its answer without --data_fields) came to step 3's reward functions as
    ``chosen=``, a name no column of the file has, which the README keeps for a pair's answers: a function taking
    ``output=`` (TRL passes each column under its own name) could not be called. It comes as ``output``, as written;
    Alpaca's pairs (chosen, rejected) and an answer renamed by --data_fields still come as ``chosen``."""
    from dschat.data.collators import DataCollatorRLHF
    from dschat.rlhf.reward_fn import batch_extras, call_reward_fn

    tok = chatml(tokenizer)
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": f"Add 1 and {i}.", "output": str(i + 1)}
                                                     for i in range(2)])
    prompts, _ = build(tmp_path, tok, [f"{alpaca},{alpaca}"], 3, data_split="0,0,1")
    assert sorted(item["output"] for item in prompts) == ["1", "2"] and "chosen" not in prompts[0]
    batch = DataCollatorRLHF(None, pad_token_id=0)([prompts[0], prompts[1]])

    def exact(prompts, completions, output, **columns):
        return [float(answer == reference) for answer, reference in zip(completions, output)]

    assert call_reward_fn(exact, batch["prompt_text"], batch["output"], batch_extras(batch)) == [1.0, 1.0]
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"instruction": "Add.", "chosen": "2", "rejected": "3"}] * 2)
    prompts, _ = build(tmp_path, tok, [f"{pairs},{pairs}"], 3, data_split="0,0,1")
    assert (prompts[0]["chosen"], prompts[0]["rejected"]) == ("2", "3")
    prompts, _ = build(tmp_path, tok, [f"{alpaca},{alpaca}"], 3, data_split="0,0,1",
                       data_fields="prompt=instruction,chosen=output")
    assert "output" not in prompts[0] and prompts[0]["chosen"] in ("1", "2")


def test_step3_reward_functions_get_a_messages_records_last_reply_as_chosen(tmp_path, tokenizer):
    """A messages record's last reply (its reference answer) was dropped before step 3: a reward function had nothing
    to compare with, while a pair's answers come as chosen and rejected, Alpaca's output as output. It comes as
    ``chosen``, as an answer renamed by --data_fields does (bare text; a reply calling tools as its message in a list,
    as a pair's), from the cache too; a conversation awaiting its answer, or whose last reply has weight 0 (no answer
    step 1 trains), has none: None in the batch, as a record without a column gives."""
    from dschat.data.collators import DataCollatorRLHF
    from dschat.rlhf.reward_fn import batch_extras, call_reward_fn

    tok = chatml(tokenizer)
    added = [{"role": "user", "content": "Add 1 and 1."}, {"role": "assistant", "content": "2"}]
    untrained = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hey.", "weight": 0}]
    conversations = [added, CONVERSATION, CONVERSATION[1:4], untrained]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages} for messages in conversations])
    expected = {format_prompt(added[:1], tok): "2", format_prompt(CONVERSATION[:-1], tok): "Goodbye!",
                format_prompt(CONVERSATION[1:4], tok): None, format_prompt(untrained[:1], tok): None}
    for built in (True, False):  # (built, then read from the cache)
        prompts, _ = build(tmp_path, tok, [f"{path},{path}"], 3, data_split="0,0,1")
        assert prompts.built is built and len(prompts) == 4
        assert {item["prompt_text"]: item.get("chosen") for item in prompts} == expected
    batch = DataCollatorRLHF(None, pad_token_id=0)([prompts[i] for i in range(4)])

    def exact(prompts, completions, chosen, **columns):
        return [float(reference is not None and answer == reference) for answer, reference in zip(completions, chosen)]

    answers = [expected[prompt] or "?" for prompt in batch["prompt_text"]]
    assert sorted(call_reward_fn(exact, batch["prompt_text"], answers, batch_extras(batch))) == [0, 0, 1, 1]
    assert sorted(batch["chosen"], key=str) == ["2", "Goodbye!", None, None]
    # a "chosen" column of the file's own beside the messages is kept, as extra_chosen
    beside = write_jsonl(tmp_path / "beside.jsonl", [{"messages": added, "chosen": "a column of its own"}] * 2)
    prompts, _ = build(tmp_path, tok, [f"{beside},{beside}"], 3, data_split="0,0,1")
    assert (prompts[0]["chosen"], prompts[0]["extra_chosen"]) == ("2", "a column of its own")
    # tool-calling conversations: the last reply after the tool's result; a reply that calls a tool, as its message
    tools = qwen_tools(tokenizer)
    calling = TOOL_CONVERSATION[:3]
    path = write_jsonl(tmp_path / "tools.jsonl", [{"messages": TOOL_CONVERSATION, "tools": [WEATHER_TOOL]},
                                                  {"messages": calling, "tools": [WEATHER_TOOL]}])
    prompts, _ = build(tmp_path, tools, [f"{path},{path}"], 3, data_split="0,0,1", max_seq_len=1024)
    assert sorted((item["chosen"] for item in prompts), key=str) == [
        "It is 22C.", [{"role": "assistant", "content": "", "tool_calls": calling[2]["tool_calls"]}]]


def test_step3_items_have_every_column_of_their_split_none_where_their_record_lacks_it(tmp_path, tokenizer):
    """A batch took the columns its own records had: a batch of records from a source without a column (another
    --data_path file) had no such key, and a reward function taking it (TRL's ``solution=``) stopped the run on that
    batch alone, while a batch with one such record gave None for the others. Every item has every column of its
    split (TRL's datasets have one schema too), from the cache as well; a name the prompt keys hold stays extra_."""
    from dschat.data.collators import DataCollatorRLHF
    from dschat.rlhf.reward_fn import batch_extras, call_reward_fn

    solved = write_jsonl(tmp_path / "solved.jsonl", [{"prompt": f"Add 1 and {i}.", "solution": str(i + 1)}
                                                     for i in range(2)])
    unsolved = write_jsonl(tmp_path / "unsolved.jsonl", [{"prompt": f"Name {i}.", "prompt_text": "m"} for i in range(2)])
    for built in (True, False):  # (built, then read from the cache)
        prompts, _ = build(tmp_path, tokenizer, [f"{solved},{solved}", f"{unsolved},{unsolved}"], 3,
                           data_split="0,0,1")
        items = {item["prompt_text"]: item for item in prompts}
        assert sorted((str(item.get("solution", "-")), str(item.get("extra_prompt_text", "-")))
                      for item in items.values()) == [("1", "None"), ("2", "None"), ("None", "m"), ("None", "m")]
        assert prompts.built is built and prompts.columns == ["extra_prompt_text", "solution"]
    batch = DataCollatorRLHF(None, pad_token_id=0)([item for item in items.values() if item["solution"] is None])

    def exact(prompts, completions, solution):
        return [float(answer == reference) for answer, reference in zip(completions, solution)]

    assert call_reward_fn(exact, batch["prompt_text"], ["2", "3"], batch_extras(batch)) == [0.0, 0.0]


def test_a_column_named_eval_weight_comes_as_extra_eval_weight_and_leaves_the_held_out_weights_alone(tmp_path,
                                                                                                     tokenizer):
    """The held-out loader adds each row's ``eval_weight`` (0 for a rank's padding repeats), read by the evaluations'
    means: a data column of that name was read as the weights on one rank (a row of weight 3 counted three times, a
    record without it failed as a None weight), and overwritten by them on several (the reward function lost it). It
    comes as ``extra_eval_weight``, as other names the batches hold do."""
    from dschat.data.collators import DataCollatorRLHF
    from dschat.data.samplers import EvalWeighted, eval_weights, weighted_collator
    from dschat.rlhf.reward_fn import batch_extras

    path = write_jsonl(tmp_path / "weighted.jsonl", [{"prompt": "Add 1 and 2.", "eval_weight": 3},
                                                     {"prompt": "Name a colour."}])
    prompts, _ = build(tmp_path, tokenizer, [f"{path},{path}"], 3, data_split="0,0,1")
    assert prompts.columns == ["extra_eval_weight"] and "eval_weight" not in prompts[0]
    collator = DataCollatorRLHF(None, pad_token_id=0)
    batch = collator([prompts[0], prompts[1]])  # (one rank's loader: no weights of its own)
    assert eval_weights(batch, 2).tolist() == [1.0, 1.0]
    assert sorted(batch_extras(batch)["extra_eval_weight"], key=str) == [3, None]
    weighted = weighted_collator(collator)([EvalWeighted(prompts)[(0, False)], EvalWeighted(prompts)[(1, True)]])
    assert eval_weights(weighted, 2).tolist() == [1.0, 0.0]  # (several ranks': the second a padding repeat)
    assert sorted(batch_extras(weighted)["extra_eval_weight"], key=str) == [3, None]


@pytest.mark.parametrize("column", ["eval_weight", "prompt_text", "prompt_att_mask"])
def test_a_reserved_column_beside_its_extra_form_is_refused_naming_the_file_and_both(tmp_path, tokenizer, column):
    """A record with both ``eval_weight`` and ``extra_eval_weight`` (any name dschat's batches hold, and its extra_
    form): the first comes as extra_eval_weight, where the second is, and one of the two was silently lost."""
    path = write_jsonl(tmp_path / "both.jsonl", [{"prompt": "Add 1 and 2.", column: "3", f"extra_{column}": "4"}])
    with pytest.raises(UsageError, match=rf"both.jsonl.*columns '{column}' and 'extra_{column}'.*rename one"):
        build(tmp_path, tokenizer, [f"{path},{path}"], 3, data_split="0,0,1")


def test_a_renamed_reserved_column_is_said_once(tmp_path, tokenizer, monkeypatch, capsys):
    """README: such a column "comes as extra_<name>, and a run says so": the renaming was silent. Said once per column,
    whether the data was built or read from the cache, its train and eval splits alike."""
    from dschat.data import pipeline

    monkeypatch.setattr(pipeline, "_RENAMES_SAID", set())
    path = write_jsonl(tmp_path / "weighted.jsonl", [{"prompt": "Add 1 and 2.", "eval_weight": 3, "solution": "3"},
                                                     {"prompt": "Name a colour.", "prompt_text": "x"}])
    capsys.readouterr()
    for _ in range(2):  # (built, then read from the cache)
        build(tmp_path, tokenizer, [f"{path},{path}"], 3, data_split="0,0,1")
    out = capsys.readouterr().out
    assert out.count("the data's column(s) eval_weight, prompt_text come to the prompt batches (and --reward_fn) as "
                     "extra_eval_weight, extra_prompt_text") == 1
    assert "solution" not in out


def test_a_reward_fn_argument_column_beside_its_extra_form_is_refused_naming_the_file_and_both(tmp_path, tokenizer):
    """Columns ``prompts`` and ``extra_prompts``: the first comes to the reward function as extra_prompts (prompts is
    its argument), where the second is, and one of the two was silently lost. Refused before the models load (the
    source named) and at a call (the batch's columns)."""
    from dschat.data.collators import DataCollatorRLHF
    from dschat.rlhf.reward_fn import batch_extras, call_reward_fn, check_takes_columns

    def score(prompts, completions, **columns):
        return [0.0] * len(completions)

    path = write_jsonl(tmp_path / "both.jsonl", [{"prompt": "Add 1 and 2.", "prompts": "a", "extra_prompts": "b"}])
    prompts, _ = build(tmp_path, tokenizer, [f"{path},{path}"], 3, data_split="0,0,1")
    check_takes_columns(score, ["prompts"], "training prompts", {"one.jsonl": ["prompts"]})  # (alone: fine)
    with pytest.raises(UsageError, match=r"both.jsonl.*columns 'prompts' and 'extra_prompts'.*argument of .*score"):
        check_takes_columns(score, prompts.columns, "training prompts", prompts.item_columns_by_source())
    batch = DataCollatorRLHF(None, pad_token_id=0)([prompts[0]])
    with pytest.raises(UsageError, match=r"columns 'prompts' and 'extra_prompts'"):
        call_reward_fn(score, batch["prompt_text"], ["3"], batch_extras(batch))


# --- tool calls ---

# Qwen2.5's template in short: the tools listed in the system turn, a call as <tool_call> JSON in the assistant turn,
# a tool's result as <tool_response> in a user turn (consecutive results in one)
QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}
TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                           "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "name": "get_weather", "content": "22C"}, {"role": "assistant", "content": "It is 22C."}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'


def qwen_tools(tokenizer):
    chat = chatml(tokenizer)
    chat.chat_template = QWEN_TOOLS_TEMPLATE
    return chat


def test_tool_calling_conversations_train_the_assistant_turns_only(tmp_path, tokenizer, capsys):
    """A conversation with a tool call and the tool's result (TRL's SFT data with a ``tools`` column) was refused
    ("message 3 has role 'tool'"). It is rendered by the chat template with its tools, as TRL renders it: the last
    answer is trained, with --multiturn the call too (as TRL's assistant-only loss), never the system, user or tool
    turns; the tool schemas are in the prompt."""
    tok = qwen_tools(tokenizer)
    path = write_jsonl(tmp_path / "tools.jsonl", [{"messages": TOOL_CONVERSATION, "tools": [WEATHER_TOOL]}] * 2)
    last_only, _ = build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", max_seq_len=1024)
    every, _ = build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", multiturn=True, max_seq_len=1024)
    whole = tok.apply_chat_template(TOOL_CONVERSATION, tools=[WEATHER_TOOL], tokenize=False).rstrip()
    assert '"name": "get_weather", "description": "The weather in a city."' in whole  # (the schemas are rendered)
    for dataset in (last_only, every):
        assert dataset[0]["input_ids"].tolist() == tok(whole, add_special_tokens=False)["input_ids"]
    assert trained_text(last_only[0], tok) == "It is 22C.<|im_end|>"
    assert trained_text(every[0], tok) == CALL + "|It is 22C.<|im_end|>"
    assert "kept all 2 records; 2 earlier assistant turns trained (--multiturn)" in capsys.readouterr().out
    # a prompt may end with the tool's result: step 3 answers from there, the tools rendered
    prompt = write_jsonl(tmp_path / "prompt.jsonl", [{"messages": TOOL_CONVERSATION[:4], "tools": [WEATHER_TOOL]}])
    prompts, _ = build(tmp_path, tok, [f"{prompt},{prompt}"], 3, data_split="0,0,1", max_seq_len=1024)
    assert prompts[0]["prompt_text"] == tok.apply_chat_template(TOOL_CONVERSATION[:4], tools=[WEATHER_TOOL],
                                                                add_generation_prompt=True, tokenize=False)
    assert prompts[0]["prompt_text"].endswith("<tool_response>\n22C\n</tool_response><|im_end|>\n"
                                              "<|im_start|>assistant\n")


def test_a_conversation_ending_with_a_tool_call_trains_the_call(tmp_path, tokenizer):
    """Function-calling SFT data (glaive's, xlam's, hermes') ends with the assistant's call: the call is the answer.
    Such a record was refused ("the last message calls a tool"). Its answer is the chat template's rendering of the
    call up to the EOT, with any text before it (also with --multiturn); a pair of two calls trains both (no tie: their
    text is empty alike); step 3's prompt is the turns before the call, its reference answers the call messages."""
    tok = qwen_tools(tokenizer)
    calling = TOOL_CONVERSATION[:3]
    said = copy.deepcopy(calling)
    said[2]["content"] = "Let me look."
    path = write_jsonl(tmp_path / "calls.jsonl", [{"messages": calling, "tools": [WEATHER_TOOL]},
                                                  {"messages": said, "tools": [WEATHER_TOOL]}])
    for multiturn in (False, True):
        train, _ = build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", max_seq_len=1024,
                         multiturn=multiturn)
        assert sorted(trained_text(item, tok) for item in train) == [CALL, "Let me look.\n" + CALL]
        whole = tok.apply_chat_template(calling, tools=[WEATHER_TOOL], tokenize=False).rstrip()
        assert tok.decode(train[0]["input_ids"]) in (whole, tok.apply_chat_template(
            said, tools=[WEATHER_TOOL], tokenize=False).rstrip())
    # --multiturn: a conversation cut after a question that follows the call's result trains up to the call
    asked = write_jsonl(tmp_path / "asked.jsonl", [{"messages": TOOL_CONVERSATION[:4] + [
        {"role": "user", "content": "And Lyon?"}], "tools": [WEATHER_TOOL]}] * 2)
    train, _ = build(tmp_path, tok, [f"{asked},{asked}"], 1, data_split="1,0,0", max_seq_len=1024, multiturn=True)
    assert trained_text(train[0], tok) == CALL
    lyon = copy.deepcopy(calling)
    lyon[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Lyon"}
    pair = write_jsonl(tmp_path / "pair.jsonl", [{"chosen": calling, "rejected": lyon, "tools": [WEATHER_TOOL]}] * 2)
    pairs, _ = build(tmp_path, tok, [f"{pair},{pair}"], 2, data_split="0,1,0", max_seq_len=1024)
    assert len(pairs) == 2
    assert tok.decode(pairs[0]["rejected_input_ids"]).endswith(CALL.replace("Paris", "Lyon"))
    assert tok.decode(pairs[0]["chosen_input_ids"]).endswith(CALL)
    prompts, _ = build(tmp_path, tok, [f"{path},{path}"], 3, data_split="0,0,1", max_seq_len=1024)
    assert prompts[0]["prompt_text"] == tok.apply_chat_template(calling[:2], tools=[WEATHER_TOOL],
                                                                add_generation_prompt=True, tokenize=False)
    prompt = write_jsonl(tmp_path / "prompt.jsonl", [{"prompt": calling[:2], "chosen": calling[2:],
                                                      "rejected": lyon[2:]}] * 2)
    prompts, _ = build(tmp_path, tok, [f"{prompt},{prompt}"], 3, data_split="0,0,1", max_seq_len=1024)
    assert prompts[0]["chosen"] == [{"role": "assistant", "content": "", "tool_calls": calling[2]["tool_calls"]}]


def test_sharegpt_function_call_and_observation_turns_are_tool_calls_and_results(tmp_path, tokenizer):
    """LLaMA-Factory's ShareGPT tool data (from: human/gpt/function_call/observation, its tools column as JSON text)
    was refused ("message 1 has role 'function_call'"). A function_call turn, whose value is the JSON of a call {name,
    arguments} (or of a list of them: parallel calls), is an assistant turn calling tools; an observation is the tool's
    result: the conversation trains as its OpenAI form does, also when it ends with the call. A value that is no call
    is the record's error."""
    tok = qwen_tools(tokenizer)
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    turns = [{"from": "human", "value": "Weather in Paris?"}, {"from": "function_call", "value": json.dumps(call)},
             {"from": "observation", "value": "22C"}, {"from": "gpt", "value": "It is 22C."}]
    tools = json.dumps([WEATHER_TOOL["function"]])
    path = write_jsonl(tmp_path / "sharegpt.jsonl", [{"conversations": turns, "tools": tools},
                                                     {"conversations": turns[:2], "tools": tools}])
    train, _ = build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", multiturn=True, max_seq_len=1024)
    openai = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
              {"role": "tool", "content": "22C"}, {"role": "assistant", "content": "It is 22C."}]
    whole = tok.apply_chat_template(openai, tools=[WEATHER_TOOL["function"]], tokenize=False).rstrip()
    assert sorted(trained_text(item, tok) for item in train) == [CALL, CALL + "|It is 22C.<|im_end|>"]
    assert whole in [tok.decode(item["input_ids"]) for item in train]
    parallel = [turns[0], {"from": "function_call", "value": json.dumps([call, {**call, "arguments": {"city": "Lyon"}}])}]
    path = write_jsonl(tmp_path / "parallel.jsonl", [{"conversations": parallel, "tools": tools}] * 2)
    train, _ = build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", max_seq_len=1024)
    assert trained_text(train[0], tok) == CALL.replace("<|im_end|>", "\n") + CALL.replace("Paris", "Lyon")
    broken = [turns[0], {"from": "function_call", "value": "get_weather(city='Paris')"}]
    path = write_jsonl(tmp_path / "broken.jsonl", [{"conversations": broken, "tools": tools}] * 2)
    with pytest.raises(DatasetFormatError, match=r"broken.jsonl line 1 \(record 0\): field 'conversations': message 1 "
                                                 r"\(from 'function_call'\) is not the JSON text of a call"):
        build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", max_seq_len=1024)


def test_openai_older_function_calling_trains_as_its_tool_calls_form(tmp_path, tokenizer):
    """OpenAI's older function-calling records (function_call with its arguments as JSON text, the result as role
    "function", the schemas in a "functions" column) were refused; they train token for token as their tool_calls
    form does, the schemas rendered in the prompt, with --multiturn the call too."""
    tok = qwen_tools(tokenizer)
    older = [TOOL_CONVERSATION[0], TOOL_CONVERSATION[1],
             {"role": "assistant", "content": None,
              "function_call": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}},
             {"role": "function", "name": "get_weather", "content": "22C"}, TOOL_CONVERSATION[4]]
    path = write_jsonl(tmp_path / "older.jsonl", [{"messages": older, "functions": [WEATHER_TOOL["function"]]}] * 2)
    train, _ = build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", multiturn=True, max_seq_len=1024)
    whole = tok.apply_chat_template(TOOL_CONVERSATION, tools=[WEATHER_TOOL["function"]], tokenize=False).rstrip()
    assert '"description": "The weather in a city."' in whole
    assert train[0]["input_ids"].tolist() == tok(whole, add_special_tokens=False)["input_ids"]
    assert trained_text(train[0], tok) == CALL + "|It is 22C.<|im_end|>"


@pytest.mark.parametrize("template", ["drops_calls", "none"])
def test_a_last_tool_call_a_template_does_not_render_is_the_records_error(tmp_path, tokenizer, template):
    """A conversation ending with a call, under a template that writes the call's turn as its (empty) text alone, or
    without a template, would train an empty answer: the record's error, naming it."""
    tok = chatml(tokenizer) if template == "drops_calls" else tokenizer
    path = write_jsonl(tmp_path / "calls.jsonl", [{"messages": CONVERSATION}, {"messages": TOOL_CONVERSATION[1:3]}])
    said = {"drops_calls": r"its answer calls the tool 'get_weather', but the tokenizer's chat template does not "
                           r"write the call after the prompt",
            "none": r"its answer calls the tool 'get_weather': tool calls are rendered only by a chat template that "
                    r"renders them, and the tokenizer has none"}[template]
    with pytest.raises(DatasetFormatError, match=rf"calls.jsonl line 2 \(record 1\): field 'messages': {said}"):
        build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", max_seq_len=1024)


@pytest.mark.parametrize("template", ["drops_tool_results", "drops_calls", "none"])
def test_tool_turns_a_template_does_not_render_are_the_records_error(tmp_path, tokenizer, template):
    """A chat template that leaves out tool results or calls (a plain ChatML one writes a call's empty content) would
    train the answer after a conversation without them, as TRL does without a word; without a template
    (Human:/Assistant:) there is no way to write them. Each is an error naming the file, record and message."""
    tok = {"drops_tool_results": qwen_tools(tokenizer), "drops_calls": chatml(tokenizer), "none": tokenizer}[template]
    if template == "drops_tool_results":
        tok.chat_template = QWEN_TOOLS_TEMPLATE.replace("+ message.content + '\\n</tool_response>'",
                                                        "+ '</tool_response>'")
        assert tok.chat_template != QWEN_TOOLS_TEMPLATE
    other = [{"messages": CONVERSATION}]
    path = write_jsonl(tmp_path / "tools.jsonl", other + [{"messages": TOOL_CONVERSATION, "tools": [WEATHER_TOOL]}])
    said = {"drops_tool_results": r"message 3 is a tool's result \(role 'tool'\), but the tokenizer's chat template "
                                  r"does not render its content \('22C'\)",
            "drops_calls": r"message 2 calls the tool 'get_weather', but the tokenizer's chat template does not "
                           r"render it",
            "none": r"message 2 calls the tool 'get_weather': tool calls and results are rendered only by a chat "
                    r"template that renders them, and the tokenizer has none"}[template]
    with pytest.raises(DatasetFormatError, match=rf"tools.jsonl line 2 \(record 1\): field 'messages': {said}"):
        build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", max_seq_len=1024)


def test_tool_records_read_under_renamed_fields(tmp_path, tokenizer):
    """--data_fields renames the conversation and the tools columns of tool-calling records."""
    tok = qwen_tools(tokenizer)
    path = write_jsonl(tmp_path / "tools.jsonl", [{"conv": TOOL_CONVERSATION, "functions": [WEATHER_TOOL]}])
    train, _ = build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", max_seq_len=1024,
                     data_fields="messages=conv,tools=functions")
    assert '"description": "The weather in a city."' in tok.decode(train[0]["input_ids"])
    assert trained_text(train[0], tok) == "It is 22C.<|im_end|>"


@pytest.mark.parametrize("template", ["plain_chatml", "none"])
def test_tools_a_template_does_not_render_are_the_records_error(tmp_path, tokenizer, template):
    """A record's tool schemas (a ``tools`` column) were passed to a chat template that writes none of them, or left
    out by the Human:/Assistant: format, without a word: the answer was trained as if no tool had been offered. A tool
    that is not in the rendered prompt (by its function's name) is the record's error."""
    tok = chatml(tokenizer) if template == "plain_chatml" else tokenizer
    answered = [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello, friend."}]
    path = write_jsonl(tmp_path / "tools.jsonl", [{"messages": answered}, {"messages": answered,
                                                                           "tools": [WEATHER_TOOL]}])
    said = {"plain_chatml": r"the tokenizer's chat template does not render the record's tool 'get_weather'",
            "none": r"the record's tools \('get_weather', ...\) are rendered only by a chat template that renders "
                    r"them, and the tokenizer has none"}[template]
    with pytest.raises(DatasetFormatError, match=rf"tools.jsonl line 2 \(record 1\): field 'tools': {said}"):
        build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", max_seq_len=1024)
    qwen, _ = build(tmp_path, qwen_tools(tokenizer), [f"{path},{path}"], 1, data_split="1,0,0", max_seq_len=1024)
    assert len(qwen) == 2


def test_tool_call_arguments_given_as_json_text_are_written_as_the_template_writes_an_object(tmp_path, tokenizer):
    """OpenAI's format gives a call's arguments as JSON text; HF's templates write ``arguments | tojson``, which wrote
    that text as a quoted string with its quotes escaped ("arguments": "{\\"city\\": ..."), and --multiturn trained the
    model to call tools so. Text holding a JSON object is read as that object; other text is kept."""
    tok = qwen_tools(tokenizer)
    as_text = copy.deepcopy(TOOL_CONVERSATION)
    as_text[2]["tool_calls"][0]["function"]["arguments"] = '{"city":  "Paris"}'
    path = write_jsonl(tmp_path / "tools.jsonl", [{"messages": as_text, "tools": [WEATHER_TOOL]}] * 2)
    every, _ = build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", multiturn=True, max_seq_len=1024)
    assert trained_text(every[0], tok) == CALL + "|It is 22C.<|im_end|>"


def test_arrow_read_tool_calls_and_schemas_train_what_the_file_held(tmp_path, tokenizer):
    """Arrow (parquet, save_to_disk, a hub download) merges the keys of nested objects across records and fills those
    a record lacks with None: one call's arguments came back as {'city': 'Paris', 'query': None}, and --multiturn
    trained '"query": null' in the call (the tool schemas got None fields the same way). Keys whose value is None are
    left out of a call's arguments and of the tool schemas: the parquet file trains the JSON Lines file's text."""
    import pandas as pd

    schema = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
    search_tool = {"type": "function", "function": {"name": "search", "description": "Search the web.",
                                                    "parameters": schema}}
    searching = copy.deepcopy(TOOL_CONVERSATION)
    searching[1]["content"], searching[4]["content"] = "Search for cats.", "Cats are found."
    searching[2]["tool_calls"][0]["function"] = {"name": "search", "arguments": {"query": "cats"}}
    searching[3] = {"role": "tool", "content": "cats: many"}
    rows = [{"messages": TOOL_CONVERSATION, "tools": [WEATHER_TOOL]}, {"messages": searching, "tools": [search_tool]}]
    jsonl = write_jsonl(tmp_path / "tools.jsonl", rows)
    parquet = str(tmp_path / "tools.parquet")
    pd.DataFrame(rows).to_parquet(parquet)
    assert pd.read_parquet(parquet)["messages"][0][2]["tool_calls"][0]["function"]["arguments"]["query"] is None
    tok = qwen_tools(tokenizer)
    texts = {}
    for path in (jsonl, parquet):
        data, _ = build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", multiturn=True, max_seq_len=1024)
        texts[path] = sorted((tok.decode(item["input_ids"]), trained_text(item, tok)) for item in data)
    assert texts[parquet] == texts[jsonl]
    assert [trained for _, trained in texts[parquet]] == [
        CALL + "|It is 22C.<|im_end|>",
        '<tool_call>\n{"name": "search", "arguments": {"query": "cats"}}\n</tool_call><|im_end|>|Cats are found.'
        '<|im_end|>']
    assert "null" not in "".join(whole for whole, _ in texts[parquet])
    # a null an argument must hold is kept where the arguments are given as JSON text (OpenAI's format)
    from dschat.data.base import checked_messages
    given = [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                                     "arguments": '{"unit": null}'}}]}]
    assert checked_messages(given, "messages")[0]["tool_calls"][0]["function"]["arguments"] == {"unit": None}


def test_a_null_written_in_a_json_or_csv_call_is_kept_and_arrows_fillers_are_not(tmp_path, tokenizer):
    """A null a call's arguments (or a tool schema) hold, written in a JSON Lines file ({"unit": null}), was left out
    with Arrow's fillers, and the model was trained on another call than the file's. JSON, JSON Lines and CSV files
    (read as written: no key another record has comes back) keep it, beside a record whose arguments have other keys,
    which gets none of them; parquet cannot tell the two apart, and leaves out both."""
    import pandas as pd

    nulled = copy.deepcopy(TOOL_CONVERSATION)
    nulled[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "unit": None}
    tool = copy.deepcopy(WEATHER_TOOL)
    tool["function"]["parameters"]["properties"]["unit"] = {"type": "string", "default": None}
    searching = copy.deepcopy(TOOL_CONVERSATION)
    searching[1]["content"] = "Search for cats."
    searching[2]["tool_calls"][0]["function"] = {"name": "get_weather", "arguments": {"query": "cats"}}
    rows = [{"messages": nulled, "tools": [tool]}, {"messages": searching, "tools": [WEATHER_TOOL]}]
    jsonl = write_jsonl(tmp_path / "tools.jsonl", rows)
    json_file = tmp_path / "tools.json"
    json_file.write_text(json.dumps(rows))
    csv = str(tmp_path / "tools.csv")
    pd.DataFrame([{name: json.dumps(value) for name, value in row.items()} for row in rows]).to_csv(csv, index=False)
    parquet = str(tmp_path / "tools.parquet")
    pd.DataFrame(rows).to_parquet(parquet)
    tok = qwen_tools(tokenizer)
    kept = CALL.replace('"Paris"}', '"Paris", "unit": null}')
    searched = CALL.replace('{"city": "Paris"}', '{"query": "cats"}')
    for path in (jsonl, str(json_file), csv, parquet):
        data, _ = build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", multiturn=True, max_seq_len=1024)
        whole = sorted(tok.decode(item["input_ids"]) for item in data)
        trained = sorted(trained_text(item, tok).removesuffix("|It is 22C.<|im_end|>") for item in data)
        if path == parquet:
            assert trained == sorted([CALL, searched]) and "null" not in "".join(whole)
        else:
            assert trained == sorted([kept, searched]), path
            paris, cats = sorted(whole, key=lambda text: "cats" in text)
            assert '"default": null' in paris and "null" not in cats, path


@pytest.mark.parametrize("renders_calls", [False, True])
def test_a_dropped_call_is_found_out_after_a_message_the_template_does_not_write_verbatim(tmp_path, tokenizer,
                                                                                           renders_calls):
    """A call's function name was looked for after the text of the message before it; where the template writes a
    message otherwise (trimmed), the search stayed where it was and found the name in the tool schemas the template
    lists first, so a template that drops the calls passed. The name is looked for in what the call's turn adds to the
    rendering; a template that renders the calls still passes."""
    tok = qwen_tools(tokenizer)
    tok.chat_template = QWEN_TOOLS_TEMPLATE.replace("'\\n' + message.content + '<|im_end|>\\n'",
                                                    "'\\n' + (message.content | trim) + '<|im_end|>\\n'")
    if not renders_calls:  # (a call's turn written as its text alone: empty)
        tok.chat_template = tok.chat_template.replace("(message.role == 'assistant' and not message.tool_calls)",
                                                      "message.role == 'assistant'")
    messages = copy.deepcopy(TOOL_CONVERSATION[1:])
    messages[0]["content"] = "  Weather\n  in Paris?"  # (kept so: its lines are indented alike)
    path = write_jsonl(tmp_path / "tools.jsonl", [{"messages": messages, "tools": [WEATHER_TOOL]}] * 2)
    assert tok.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False).count("get_weather") == \
        (2 if renders_calls else 1)  # (the schema's, and the call's where it is rendered)
    if renders_calls:
        train, _ = build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", multiturn=True, max_seq_len=1024)
        assert trained_text(train[0], tok) == CALL + "|It is 22C.<|im_end|>"
        return
    with pytest.raises(DatasetFormatError, match=r"tools.jsonl line 1 \(record 0\): field 'messages': message 1 calls "
                                                 r"the tool 'get_weather', but the tokenizer's chat template does not "
                                                 r"render it"):
        build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", max_seq_len=1024)


def test_two_tool_results_in_a_row_a_template_refuses_are_not_said_to_be_joined(tmp_path, tokenizer):
    """A template that wants roles to alternate refused two tool messages in a row (the results of parallel calls)
    and the error said "join the two into one message", which would make two results one: it says the template does
    not take consecutive tool results and what does."""
    tok = qwen_tools(tokenizer)
    tok.chat_template = ("{% for m in messages %}{% if not loop.first and m.role == messages[loop.index0 - 1].role %}"
                         "{{ raise_exception('Conversation roles must alternate') }}{% endif %}{% endfor %}"
                         + QWEN_TOOLS_TEMPLATE)
    parallel = copy.deepcopy(TOOL_CONVERSATION)
    call = parallel[2]["tool_calls"][0]
    parallel[2]["tool_calls"].append({**call, "function": {**call["function"], "arguments": {"city": "Lyon"}}})
    parallel[3:4] = [{"role": "tool", "name": "get_weather", "content": "22C"},
                     {"role": "tool", "name": "get_weather", "content": "19C"}]
    path = write_jsonl(tmp_path / "tools.jsonl", [{"messages": parallel, "tools": [WEATHER_TOOL]}] * 2)
    with pytest.raises(DatasetFormatError, match=r"tools.jsonl line 1 \(record 0\): field 'messages': the tokenizer's "
                                                 r"chat template refuses them \(Conversation roles must alternate\): "
                                                 r"message 4 is a second tool result in a row \(the results of "
                                                 r"parallel tool calls\), which the template does not take; use a "
                                                 r"chat template that does \(Qwen2.5's\), or give each call a turn "
                                                 r"of its own") as said:
        build(tmp_path, tok, [f"{path},{path}"], 1, data_split="1,0,0", max_seq_len=1024)
    assert "join" not in str(said.value)
