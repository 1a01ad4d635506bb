"""Raw data sources: local files (formats, fields, record shapes, errors), name dispatch, hub adapters."""
import json
import os
import re
import shutil

import pandas as pd
import pytest
from datasets import Dataset, DatasetDict

from dschat.data import (HUB_DATASETS, AnthropicHhrlhfDataset, DahoasFullhhrlhfDataset, DahoasRmstaticDataset,
                         DahoasSyntheticinstructgptjpairwiseDataset, DatasetFormatError, OpenaiWebgptcomparisonsDataset,
                         SkipRecord, StanfordnlpSHPDataset, YitingxieRlhfrewarddatasetsDataset, get_raw_dataset,
                         parse_field_map)
from dschat.data.errors import RecordError
from dschat.data.reading import COMPRESSIONS
from dschat.errors import MissingInputError, UsageError
from helpers import hub_cache_snapshot

RECORDS = [{"prompt": f"Question number {i}?", "chosen": f"Good answer {i}.", "rejected": f"Bad answer {i}.",
            "task": f"t{i % 3}"} for i in range(20)]



def write_records(records, path, kind):
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif kind == "json":
        path.write_text(json.dumps(records, indent=1))
    elif kind == "parquet":
        pd.DataFrame(records).to_parquet(path)
    elif kind == "csv":
        pd.DataFrame(records).to_csv(path, index=False)
    return str(path)


def raw(spec, tmp_path, seed=1234, **fields):
    return get_raw_dataset(spec, str(tmp_path / "out"), seed, 0, **fields)


def as_tuples(adapter, data):
    return [(adapter.get_conversation(s)[0]["content"], adapter.get_chosen_text(s), adapter.get_rejected_text(s),
             adapter.get_extra(s)["task"]) for s in data]


def expected_tuples(records):
    return [(r["prompt"], r["chosen"], r["rejected"], r["task"]) for r in records]


# --- local formats ---

@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "csv"])
def test_local_file_formats_round_trip(tmp_path, kind):
    train = write_records(RECORDS[:15], tmp_path / f"train.{kind}", kind)
    eval_ = write_records(RECORDS[15:], tmp_path / f"eval.{kind}", kind)
    adapter = raw(f"{kind}:{train},{eval_}", tmp_path)
    assert as_tuples(adapter, adapter.get_train_data()) == expected_tuples(RECORDS[:15])
    assert as_tuples(adapter, adapter.get_eval_data()) == expected_tuples(RECORDS[15:])
    assert adapter.get_prompt(RECORDS[0]) == "\n\nHuman: Question number 0?\n\nAssistant:"
    assert adapter.get_prompt_and_chosen(RECORDS[0]) == "\n\nHuman: Question number 0?\n\nAssistant: Good answer 0."


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_bare_path_and_folder_forms(tmp_path, kind):
    folder = tmp_path / "data"
    folder.mkdir()
    write_records(RECORDS[:15], folder / f"train.{kind}", kind)
    write_records(RECORDS[15:], folder / f"test.{kind}", kind)
    for spec in (str(folder), f"{kind}:{folder}"):
        adapter = raw(spec, tmp_path)
        assert len(adapter.get_train_data()) == 15 and len(adapter.get_eval_data()) == 5
    single = raw(str(folder / f"train.{kind}"), tmp_path)  # a bare file: extension says the format
    assert len(single.get_train_data()) + len(single.get_eval_data()) == 15


def test_a_hub_datasets_downloaded_folder_reads_its_split_files(tmp_path):
    # `hf download --repo-type dataset NAME --local-dir FOLDER` writes FOLDER/data/train-00000-of-00001.parquet (what
    # load_dataset(FOLDER) reads, as TRL's users do): it was 'cannot tell what the folder holds', and parquet:FOLDER
    # 'the folder has no train.parquet'
    folder = tmp_path / "hub"
    (folder / "data").mkdir(parents=True)
    write_records(RECORDS[:15], folder / "data" / "train-00000-of-00001.parquet", "parquet")
    write_records(RECORDS[15:], folder / "data" / "test-00000-of-00001.parquet", "parquet")
    (folder / "README.md").write_text("---\ndataset_info: ...\n---\n")
    for spec in (str(folder), f"parquet:{folder}"):
        adapter = raw(spec, tmp_path)
        assert as_tuples(adapter, adapter.get_train_data()) == expected_tuples(RECORDS[:15])
        assert as_tuples(adapter, adapter.get_eval_data()) == expected_tuples(RECORDS[15:])
    with pytest.raises(UsageError, match=r"the folder's train data is .*train-00000-of-00001.parquet, not jsonl"):
        raw(f"jsonl:{folder}", tmp_path)
    # splits of other names (train_prefs) say what to give
    prefs = tmp_path / "prefs"
    (prefs / "data").mkdir(parents=True)
    for split in ("train_prefs", "test_prefs"):
        write_records(RECORDS, prefs / "data" / f"{split}-00000-of-00001.parquet", "parquet")
    with pytest.raises(UsageError, match=r"splits test_prefs, train_prefs, none of them train: give the files to read "
                                         r"as TYPE:TRAIN_PATH,EVAL_PATH \(e.g. parquet:.*train_prefs-00000-of-00001"
                                         r"\.parquet,.*test_prefs"):
        raw(str(prefs), tmp_path)


def test_a_hub_datasets_split_in_shards_is_read_as_one_and_a_missing_shard_is_said(tmp_path, capsys, monkeypatch):
    # FOLDER/data/train-00000-of-00002.parquet and train-00001-of-00002.parquet (load_dataset(FOLDER) reads them as one
    # split) were refused: "dschat reads one file per split: save the dataset as one"
    folder = tmp_path / "hub"
    (folder / "data").mkdir(parents=True)
    write_records(RECORDS[:5], folder / "data" / "train-00000-of-00002.parquet", "parquet")
    write_records(RECORDS[5:15], folder / "data" / "train-00001-of-00002.parquet", "parquet")
    write_records(RECORDS[15:17], folder / "data" / "test-00000-of-00002.parquet", "parquet")
    write_records(RECORDS[17:], folder / "data" / "test-00001-of-00002.parquet", "parquet")
    adapter = raw(str(folder), tmp_path)
    assert as_tuples(adapter, adapter.get_train_data()) == expected_tuples(RECORDS[:15])
    assert as_tuples(adapter, adapter.get_eval_data()) == expected_tuples(RECORDS[15:])
    # a download of some of the shards: those are read, and said (one shard alone was read as the whole split unsaid)
    (folder / "data" / "train-00001-of-00002.parquet").unlink()
    (folder / "data" / "test-00000-of-00002.parquet").unlink()
    adapter = raw(str(folder), tmp_path)
    assert as_tuples(adapter, adapter.get_train_data()) == expected_tuples(RECORDS[:5])
    assert as_tuples(adapter, adapter.get_eval_data()) == expected_tuples(RECORDS[17:])
    assert f"{folder}: the download holds 1 of the 2 train shards, 1 of the 2 test shards: reading those" in \
        capsys.readouterr().out
    # another download of as many shards, named alike (the relative path from another working directory): said too,
    # not taken for the one said (the notice was keyed by the name and the counts)
    for place in ("here", "there"):
        partial = tmp_path / place / "hub"
        shutil.copytree(folder, partial)
        monkeypatch.chdir(partial.parent)
        raw("hub", tmp_path)
        assert "hub: the download holds 1 of the 2 train shards" in capsys.readouterr().out, place
    # JSON Lines shards: a record's error names its shard, line and record there; a number among one shard's strings
    # is that record's error (the shards' columns were of other types)
    shards = tmp_path / "shards"
    (shards / "data").mkdir(parents=True)
    write_records(RECORDS[:5], shards / "data" / "train-00000-of-00002.jsonl", "jsonl")
    bad = [*RECORDS[5:8], {**RECORDS[8], "chosen": 5}]
    write_records(bad, shards / "data" / "train-00001-of-00002.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=r"train-00001-of-00002\.jsonl line 4 \(record 3\): field 'chosen': "
                                                 r"expected a string, got int"):
        raw(str(shards), tmp_path)


def test_a_hub_datasets_split_files_with_a_hash_after_the_shard_count_are_its_splits(tmp_path):
    """Dahoas/rm-static's download holds data/train-00000-of-00001-2a1df75c6bce91ab.parquet and
    test-00000-of-00001-8c7c51afc6d45980.parquet (datasets' older parquet exports), which load_dataset(FOLDER) reads
    as its train and test splits: the hash made them splits of their own, and the folder was refused as holding
    "none of them train"."""
    folder = tmp_path / "rm-static"
    (folder / "data").mkdir(parents=True)
    write_records(RECORDS[:15], folder / "data" / "train-00000-of-00001-2a1df75c6bce91ab.parquet", "parquet")
    write_records(RECORDS[15:], folder / "data" / "test-00000-of-00001-8c7c51afc6d45980.parquet", "parquet")
    (folder / "dataset_infos.json").write_text("{}")
    (folder / "README.md").write_text("---\nlicense: mit\n---\n")
    for spec in (str(folder), f"parquet:{folder}"):
        adapter = raw(spec, tmp_path)
        assert as_tuples(adapter, adapter.get_train_data()) == expected_tuples(RECORDS[:15])
        assert as_tuples(adapter, adapter.get_eval_data()) == expected_tuples(RECORDS[15:])
    # shards with hashes: read as one split
    for number, part in enumerate((RECORDS[:5], RECORDS[5:15])):
        write_records(part, folder / "data" / f"train-0000{number}-of-00002-{number}a{number}b.parquet", "parquet")
    (folder / "data" / "train-00000-of-00001-2a1df75c6bce91ab.parquet").unlink()
    adapter = raw(str(folder), tmp_path)
    assert as_tuples(adapter, adapter.get_train_data()) == expected_tuples(RECORDS[:15])
    # two files of one shard number (two exports' hashes) are no one split
    write_records(RECORDS[:5], folder / "data" / "train-00000-of-00002-9f9f.parquet", "parquet")
    with pytest.raises(UsageError, match=r"the train split in shards of more than one download \(files of one shard "
                                         r"number: train-00000-of-00002-0a0b\.parquet, "
                                         r"train-00000-of-00002-9f9f\.parquet\)"):
        raw(str(folder), tmp_path)


def write_hub_download(folder, splits):
    """A folder as `hf download --repo-type dataset NAME --local-dir FOLDER` writes it: data/SPLIT-00000-of-00001-
    HASH.parquet per split ({split: records}), README.md, .gitattributes and hf's own .cache/huggingface/."""
    (folder / "data").mkdir(parents=True)
    (folder / ".cache" / "huggingface").mkdir(parents=True)
    for number, (split, rows) in enumerate(splits.items()):
        write_records(rows, folder / "data" / f"{split}-00000-of-00001-{number}f3a.parquet", "parquet")
    (folder / "README.md").write_text("---\nlicense: mit\n---\n")
    (folder / ".gitattributes").write_text("*.parquet filter=lfs diff=lfs merge=lfs -text\n")
    (folder / ".cache" / "huggingface" / ".gitignore").write_text("*\n")


RM_STATIC_ROWS = [{"prompt": f"\n\nHuman: Question {i}?\n\nAssistant:", "response": f" Answer {i}.",
                   "chosen": f" Answer {i}.", "rejected": f" No {i}."} for i in range(20)]


def rm_static_in_the_hub_cache(tmp_path, monkeypatch):
    """Dahoas/rm-static downloaded into the hub cache under ``tmp_path`` (15 train, 5 test records), the working
    folder ``tmp_path``: its snapshot folder."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    snapshot = hub_cache_snapshot(tmp_path / "hub", "datasets--Dahoas--rm-static")
    write_hub_download(snapshot, {"train": RM_STATIC_ROWS[:15], "test": RM_STATIC_ROWS[15:]})
    return snapshot


def test_a_local_hub_copys_reader_is_made_once(tmp_path, monkeypatch):
    """Outside a ``reads_kept`` block, get_raw_dataset made the copy's reader twice: once to load the data, then again
    around the data it had loaded. Once now; inside a block, a later call makes one around the data kept."""
    from dschat.data.raw_datasets import HUB_COPIES, reads_kept

    monkeypatch.chdir(tmp_path)
    write_hub_download(tmp_path / "Dahoas" / "rm-static", {"train": RM_STATIC_ROWS[:15], "test": RM_STATIC_ROWS[15:]})
    made = []
    init = DahoasRmstaticDataset.__init__

    def counted(self, *args, **kwargs):
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(DahoasRmstaticDataset, "__init__", counted)
    reader = raw("Dahoas/rm-static", tmp_path)
    assert made == [reader] and len(reader.get_train_data()) == 15
    with reads_kept(HUB_COPIES):
        for seed in (1, 2):  # (the second call's data: the first's, in a reader of its own seed)
            made.clear()
            reader = raw("Dahoas/rm-static", tmp_path, seed=seed)
            assert made == [reader] and reader.seed == seed


def test_a_hub_datasets_download_under_its_name_is_read_by_its_reader_in_training_and_the_tools(tmp_path, monkeypatch,
                                                                                                tokenizer):
    """A download of Dahoas/rm-static at ./Dahoas/rm-static (`hf download --repo-type dataset Dahoas/rm-static
    --local-dir Dahoas/rm-static`) given as --data_path Dahoas/rm-static went to load_from_disk, whose FileNotFoundError
    ("neither a `Dataset` directory nor a `DatasetDict` directory") ended training in a traceback, where its path,
    ./Dahoas/rm-static, read as local data; the tools read it as local data. It is read by the dataset's reader now,
    as a save_to_disk copy there is, with the records its path reads."""
    from dschat.data.pipeline import create_prompt_dataset
    from dschat.tools.records import load_records

    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": f"\n\nHuman: Question {i}?\n\nAssistant:", "response": f" Answer {i}.",
             "chosen": f" Answer {i}.", "rejected": f" No {i}."} for i in range(20)]
    write_hub_download(tmp_path / "Dahoas" / "rm-static", {"train": rows[:15], "test": rows[15:]})

    def read(adapter, data):
        return [(adapter.get_conversation(s), adapter.get_chosen_text(s), adapter.get_rejected_text(s)) for s in data]

    named, path = raw("Dahoas/rm-static", tmp_path), raw("./Dahoas/rm-static", tmp_path)
    assert isinstance(named, DahoasRmstaticDataset)
    for part in ("get_train_data", "get_eval_data"):
        assert read(named, getattr(named, part)()) == read(path, getattr(path, part)())
    assert [chosen for _, chosen, _ in read(named, named.get_eval_data())] == [f"Answer {i}." for i in range(15, 20)]
    train, eval_ = create_prompt_dataset(0, ["Dahoas/rm-static"], "10,0,0", str(tmp_path / "out"), 1, 1234, tokenizer,
                                         128)
    assert (len(train), len(eval_)) == (15, 5)
    records = load_records("Dahoas/rm-static", flag="--pairs_file")
    assert [r.chosen for r in records] == [f"Answer {i}." for i in range(15, 20)]

    # a download without the test split the reader evaluates on, or a folder of neither layout, is said so
    shutil.rmtree("Dahoas")
    write_hub_download(tmp_path / "Dahoas" / "rm-static", {"train": rows})
    with pytest.raises(DatasetFormatError, match=r"^--sft_only_data_path Dahoas/rm-static: the download here holds "
                                                 r"the split train, not test, which Dahoas/rm-static's reader reads: "
                                                 r"download all its files \(hf download --repo-type dataset "
                                                 r"Dahoas/rm-static --local-dir Dahoas/rm-static\)"):
        get_raw_dataset("Dahoas/rm-static", None, 0, -1, flag="--sft_only_data_path")
    shutil.rmtree("Dahoas/rm-static/data")
    with pytest.raises(DatasetFormatError, match=r"^--data_path Dahoas/rm-static: the folder here is neither a "
                                                 r"save_to_disk copy of the dataset nor a download of its hub "
                                                 r"repository"):
        raw("Dahoas/rm-static", tmp_path)


def test_a_hub_datasets_download_in_the_hub_cache_is_read_offline_by_its_reader(tmp_path, monkeypatch, tokenizer,
                                                                                   capsys):
    """`hf download --repo-type dataset Dahoas/rm-static` without --local-dir puts the files in the hub cache
    (datasets--Dahoas--rm-static/snapshots/COMMIT), which datasets does not read offline: --data_path Dahoas/rm-static
    was "not in the datasets cache, and HF_HUB_OFFLINE is set", while the snapshot folder's path read as local data.
    The download is read by the dataset's reader now, and said."""
    from dschat.data.pipeline import create_prompt_dataset
    from dschat.errors import MissingInputError

    snapshot = rm_static_in_the_hub_cache(tmp_path, monkeypatch)
    adapter = raw("Dahoas/rm-static", tmp_path)
    assert isinstance(adapter, DahoasRmstaticDataset)
    assert [adapter.get_chosen_text(s) for s in adapter.get_eval_data()] == [f"Answer {i}." for i in range(15, 20)]
    assert f"--data_path Dahoas/rm-static: not in the datasets cache, read from its download in the hub cache, " \
           f"{snapshot}" in capsys.readouterr().out
    train, eval_ = create_prompt_dataset(0, ["Dahoas/rm-static"], "10,0,0", str(tmp_path / "out"), 1, 1234, tokenizer,
                                         128)
    assert (len(train), len(eval_)) == (15, 5)
    # a download without the reader's test split says so; one of no split files dschat reads is not in the cache
    (snapshot / "data" / "test-00000-of-00001-1f3a.parquet").unlink()
    with pytest.raises(DatasetFormatError, match=rf"^--data_path Dahoas/rm-static: the download in the hub cache "
                                                 rf"\({snapshot}\) holds the split train, not test"):
        raw("Dahoas/rm-static", tmp_path)
    shutil.rmtree(snapshot / "data")
    with pytest.raises(MissingInputError, match=r"^--data_path Dahoas/rm-static: not in the datasets cache, and "
                                                r"HF_HUB_OFFLINE is set"):
        raw("Dahoas/rm-static", tmp_path)


def write_hh_rlhf_download(folder, subsets):
    """A download of Anthropic/hh-rlhf as the hub holds it: SUBSET/train.jsonl.gz and SUBSET/test.jsonl.gz per subset
    ({subset: {split: records}}), red-team-attempts/red_team_attempts.jsonl.gz (of no split: not read by the dataset's
    default config), README.md and .gitattributes."""
    import gzip

    for subset, splits in subsets.items():
        (folder / subset).mkdir(parents=True)
        for split, rows in splits.items():
            (folder / subset / f"{split}.jsonl.gz").write_bytes(
                gzip.compress("".join(json.dumps(row) + "\n" for row in rows).encode()))
    (folder / "red-team-attempts").mkdir()
    (folder / "red-team-attempts" / "red_team_attempts.jsonl.gz").write_bytes(
        gzip.compress(json.dumps({"transcript": "\n\nHuman: Hi\n\nAssistant: Hello", "rating": 0}).encode() + b"\n"))
    (folder / "README.md").write_text("---\nlicense: mit\n---\n")
    (folder / ".gitattributes").write_text("*.gz filter=lfs diff=lfs merge=lfs -text\n")


def hh_rlhf_rows(subset, count):
    return [{"chosen": f"\n\nHuman: {subset} question {i}?\n\nAssistant: {subset} good {i}.",
             "rejected": f"\n\nHuman: {subset} question {i}?\n\nAssistant: {subset} bad {i}."} for i in range(count)]


def test_a_download_of_hh_rlhf_its_subsets_gzip_jsonl_files_is_read_as_its_default_config(tmp_path, monkeypatch,
                                                                                           tokenizer, capsys):
    """Anthropic/hh-rlhf's repository holds its data in a folder per subset, each a train.jsonl.gz and test.jsonl.gz:
    its download at ./Anthropic/hh-rlhf (or in the hub cache, offline) was "neither a save_to_disk copy of the dataset
    nor a download of its hub repository" (and the cache's "not in the datasets cache"). It is read now as
    load_dataset("Anthropic/hh-rlhf") reads it, and as DeepSpeed-Chat reads it: every subset's train (test) file, in
    the folders' order, joined, datasets' json loader decompressing them."""
    from huggingface_hub import constants

    from dschat.data.pipeline import create_prompt_dataset

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    subsets = {"harmless-base": {"train": hh_rlhf_rows("harmless", 6), "test": hh_rlhf_rows("harmless", 2)},
               "helpful-base": {"train": hh_rlhf_rows("helpful", 5), "test": hh_rlhf_rows("helpful", 3)}}
    snapshot = hub_cache_snapshot(tmp_path / "hub", "datasets--Anthropic--hh-rlhf")
    write_hh_rlhf_download(snapshot, subsets)
    write_hh_rlhf_download(tmp_path / "Anthropic" / "hh-rlhf", subsets)

    def read(adapter, data):
        return [(adapter.get_conversation(s), adapter.get_chosen_text(s), adapter.get_rejected_text(s)) for s in data]

    copy = raw("Anthropic/hh-rlhf", tmp_path)
    assert isinstance(copy, AnthropicHhrlhfDataset)
    assert (len(copy.get_train_data()), len(copy.get_eval_data())) == (11, 5)
    assert read(copy, copy.get_train_data())[0] == ([{"role": "user", "content": "harmless question 0?"}],
                                                   "harmless good 0.", "harmless bad 0.")
    assert read(copy, copy.get_train_data())[6][1] == "helpful good 0."  # (the second subset after the first)
    assert copy.get_prompt(copy.get_eval_data()[0]) == "\n\nHuman: harmless question 0?\n\nAssistant:"
    shutil.rmtree("Anthropic")
    cached = raw("Anthropic/hh-rlhf", tmp_path)
    assert f"--data_path Anthropic/hh-rlhf: not in the datasets cache, read from its download in the hub cache, " \
           f"{snapshot}" in capsys.readouterr().out
    for part in ("get_train_data", "get_eval_data"):
        assert read(cached, getattr(cached, part)()) == read(copy, getattr(copy, part)())
    # the download's folder as local data (its path), and a subset's folder, named to read it alone, are read so too
    for folder, (train, eval_) in ((snapshot, (11, 5)), (snapshot / "helpful-base", (5, 3))):
        local = raw(str(folder), tmp_path)
        assert (len(local.get_train_data()), len(local.get_eval_data())) == (train, eval_)
        assert read(local, local.get_eval_data())[-1] == read(copy, copy.get_eval_data())[-1]
    train, eval_ = create_prompt_dataset(0, ["Anthropic/hh-rlhf"], "0,10,0", str(tmp_path / "out"), 2, 1234,
                                         tokenizer, 128)
    assert (len(train), len(eval_)) == (11, 5)
    # a subset whose test file is missing, a download cut short: said, not 2 test records read as the subsets' all
    (snapshot / "helpful-base" / "test.jsonl.gz").unlink()
    for spec, where in (("Anthropic/hh-rlhf", "Anthropic/hh-rlhf"), (str(snapshot), re.escape(str(snapshot)))):
        with pytest.raises(UsageError, match=rf"^--data_path {where}: the download's subsets .*helpful-base hold no "
                                             r"test file, where its others do: a download cut short\?"):
            raw(spec, tmp_path)
    assert len(raw(str(snapshot / "harmless-base"), tmp_path).get_eval_data()) == 2  # (a subset named alone: read)
    (snapshot / "harmless-base" / "test.jsonl.gz").unlink()
    with pytest.raises(DatasetFormatError, match=r"^--data_path Anthropic/hh-rlhf: the download in the hub cache .* "
                                                 r"holds the split train, not test"):
        raw("Anthropic/hh-rlhf", tmp_path)


def test_a_compressed_hub_downloads_bad_line_is_named_by_file_and_line_as_a_plain_files_is(tmp_path, monkeypatch):
    """A hub download's compressed JSON Lines (Anthropic/hh-rlhf's SUBSET/train.jsonl.gz) was read by datasets' json
    loader alone: a bad line was "could not be read as compressed JSON: ..." with no line, a key written twice kept
    its last value without a word, and a string that is JSON in a column of mixed types came back decoded. It gets
    the plain file's checks now, over the file decompressed as it is read."""
    import gzip

    monkeypatch.chdir(tmp_path)
    subsets = {"harmless-base": {"train": hh_rlhf_rows("harmless", 4), "test": hh_rlhf_rows("harmless", 2)},
               "helpful-base": {"train": hh_rlhf_rows("helpful", 3), "test": hh_rlhf_rows("helpful", 2)}}
    download = tmp_path / "Anthropic" / "hh-rlhf"
    write_hh_rlhf_download(download, subsets)
    packed = download / "helpful-base" / "train.jsonl.gz"
    lines = [json.dumps(row) for row in subsets["helpful-base"]["train"]]
    for bad, said in (('{"chosen": "cut short', r"line 2: invalid JSON \(Unterminated string"),
                      ('{"chosen": "a", "rejected": "b", "chosen": "c"}', r"line 2: an object writes the key "
                                                                          r"'chosen' twice")):
        packed.write_bytes(gzip.compress("\n".join([lines[0], bad, lines[2]]).encode() + b"\n"))
        with pytest.raises(DatasetFormatError, match=rf"hh-rlhf/helpful-base/train\.jsonl\.gz {said}"):
            raw("Anthropic/hh-rlhf", tmp_path)
    # a file cut short is said to be, naming it (datasets said "Compressed file ended before the end-of-stream ...")
    packed.write_bytes(gzip.compress("\n".join(lines).encode())[:-12])
    with pytest.raises(DatasetFormatError, match=r"hh-rlhf/helpful-base/train\.jsonl\.gz: not readable as gzip "
                                                 r"data, as its name says it is \(Compressed file ended .*\): a "
                                                 r"file cut short"):
        raw("Anthropic/hh-rlhf", tmp_path)
    # a text that is JSON, "1", among numbers stays the text written (datasets' Json type read it as the number 1)
    rows = [{**row, "rating": rating} for row, rating in zip(subsets["helpful-base"]["train"], [2, "1", 3])]
    packed.write_bytes(gzip.compress("".join(json.dumps(row) + "\n" for row in rows).encode()))
    adapter = raw(str(download / "helpful-base"), tmp_path)
    assert [adapter.get_extra(sample)["rating"] for sample in adapter.get_train_data()] == [2, "1", 3]


def test_a_compressed_file_the_file_system_fails_to_read_is_not_said_to_be_cut_short(tmp_path, monkeypatch):
    """Every OSError while a .jsonl.gz was decompressed was "not readable as gzip data ...: a file cut short? download
    it again", an EIO of a failing disk or an EACCES too. Those (an errno: the file system's error, not the data's)
    stay the OSError they are, naming the file; gzip's own errors (BadGzipFile, no errno) are still the data's."""
    import errno
    import gzip

    from dschat.data import reading

    packed = tmp_path / "train.jsonl.gz"
    packed.write_bytes(gzip.compress(b'{"prompt": "a", "chosen": "b"}\n'))

    class FailingRead:  # (gzip's reader over a disk whose read fails)
        def __init__(self, path, mode, encoding=None):
            self.file = gzip.open(path, mode, encoding=encoding)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def read(self, size=-1):
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setitem(reading.DECOMPRESSORS, ".gz", type("FailingDisk", (), {"open": FailingRead}))
    with pytest.raises(OSError, match=rf"\[Errno {errno.EIO}\] {os.strerror(errno.EIO)}: '{re.escape(str(packed))}'") \
            as raised:
        reading.holds_no_bytes(str(packed))
    assert not isinstance(raised.value, DatasetFormatError)

    def not_permitted(path, mode, encoding=None):  # (its own file name, as open says it)
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setitem(reading.DECOMPRESSORS, ".gz", type("Unpermitted", (), {"open": not_permitted}))
    with pytest.raises(PermissionError, match=re.escape(str(packed))):
        reading.text_encoding(str(packed))
    monkeypatch.undo()
    packed.write_bytes(b"not gzip")  # (gzip's BadGzipFile: an OSError without an errno, the data's as before)
    with pytest.raises(DatasetFormatError, match=r"train\.jsonl\.gz: not gzip data, though its name says it is"):
        reading.holds_no_bytes(str(packed))


def test_a_download_of_shp_its_domains_folders_are_read_as_its_default_config(tmp_path, monkeypatch):
    """stanfordnlp/SHP keeps each domain's splits in a folder of its own (askacademia/train.json, validation.json,
    test.json: JSON Lines): its download at ./stanfordnlp/SHP was "neither a save_to_disk copy ... nor a download". Its
    reader reads every domain's train and validation files now, joined, as load_dataset("stanfordnlp/SHP") does."""
    monkeypatch.chdir(tmp_path)
    for domain in ("askacademia", "askbaking"):
        (tmp_path / "stanfordnlp" / "SHP" / domain).mkdir(parents=True)
        for split, count in (("train", 3), ("validation", 2), ("test", 1)):
            rows = [{"history": f"{domain} {split} post {i}", "human_ref_A": f"A {i}", "human_ref_B": f"B {i}",
                     "labels": 1, "domain": f"{domain}_{split}"} for i in range(count)]
            write_records(rows, tmp_path / "stanfordnlp" / "SHP" / domain / f"{split}.json", "jsonl")
    adapter = raw("stanfordnlp/SHP", tmp_path)
    assert (len(adapter.get_train_data()), len(adapter.get_eval_data())) == (6, 4)
    assert [adapter.get_conversation(s)[0]["content"] for s in adapter.get_eval_data()][::2] == \
        ["askacademia validation post 0", "askbaking validation post 0"]

def test_a_sharded_splits_record_shape_error_names_every_shard(tmp_path):
    # records of no field dschat reads were said to be of the first shard alone ("train-00000-of-00002.parquet: no
    # 'prompt', 'messages' or 'chosen' field"), as if the others were fine: the columns are every shard's
    folder = tmp_path / "hub"
    (folder / "data").mkdir(parents=True)
    renamed = [{"question": r["prompt"], "answer": r["chosen"]} for r in RECORDS]
    write_records(renamed[:5], folder / "data" / "train-00000-of-00002.parquet", "parquet")
    write_records(renamed[5:], folder / "data" / "train-00001-of-00002.parquet", "parquet")
    shards = r"hub/data/train-00000-of-00002\.parquet \.\.\. train-00001-of-00002\.parquet"
    with pytest.raises(DatasetFormatError, match=rf"{shards}: no 'prompt', 'messages' or 'chosen' field; the records "
                                                 r"have \['question', 'answer'\]"):
        raw(str(folder), tmp_path)
    with pytest.raises(DatasetFormatError, match=rf"{shards}: no 'query' field, which --data_fields prompt=query "
                                                 r"names"):
        raw(str(folder), tmp_path, prompt="query", chosen="answer")


def test_parquet_shards_of_string_and_large_string_text_join_and_other_types_are_named(tmp_path):
    # pandas' to_parquet writes text as large_string, datasets as string: shards of the two would not join
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "hub"
    (folder / "data").mkdir(parents=True)
    for number, (text, records) in enumerate(((pa.string(), RECORDS[:5]), (pa.large_string(), RECORDS[5:15]))):
        table = pa.table({name: pa.array([r[name] for r in records], text) for name in RECORDS[0]})
        pq.write_table(table, folder / "data" / f"train-0000{number}-of-00002.parquet")
    adapter = raw(str(folder), tmp_path)
    assert as_tuples(adapter, adapter.raw_datasets["train"]) == expected_tuples(RECORDS[:15])
    # a column of other types in the shards is an error naming them, not datasets' traceback
    pd.DataFrame([{**r, "task": 7} for r in RECORDS[5:15]]).to_parquet(folder / "data" / "train-00001-of-00002.parquet")
    with pytest.raises(DatasetFormatError, match=r"train-00000-of-00002\.parquet \.\.\. train-00001-of-00002\.parquet: "
                                                 r"the shards of one split hold different columns or types: .*task"):
        raw(str(folder), tmp_path)


def write_compressed(path, text):
    """``text`` written to ``path`` compressed as its extension says (.gz, .bz2 or .xz)."""
    import bz2
    import gzip
    import lzma

    path.write_bytes({".gz": gzip, ".bz2": bz2, ".xz": lzma}[path.suffix].compress(text.encode()))
    return str(path)


def test_a_compressed_json_file_given_by_its_path_is_read_as_the_plain_file(tmp_path):
    """train.jsonl.gz given by its own path (as TRL's and OpenRLHF's users give it) was refused ("the file is compressed
    with gzip, which dschat does not read: decompress it"), though the same file in a hub download's folder was read.
    A JSON or JSON Lines file compressed with gzip, bzip2 or xz, named so, is read as the plain file, by its path or
    TYPE:PATH, as train or eval file; its edits are read (its cache keyed by the compressed file's content)."""
    def read(spec):
        adapter = raw(spec, tmp_path)
        return [as_tuples(adapter, getattr(adapter, part)()) for part in ("get_train_data", "get_eval_data")]

    plain_lines = write_records(RECORDS[:15], tmp_path / "train.jsonl", "jsonl")
    plain_eval = write_records(RECORDS[15:], tmp_path / "eval.jsonl", "jsonl")
    plain_array = write_records(RECORDS, tmp_path / "all.json", "json")
    lines = write_compressed(tmp_path / "train.jsonl.gz", "".join(json.dumps(r) + "\n" for r in RECORDS[:15]))
    packed_eval = write_compressed(tmp_path / "eval.jsonl.bz2", "".join(json.dumps(r) + "\n" for r in RECORDS[15:]))
    array = write_compressed(tmp_path / "all.json.xz", json.dumps(RECORDS, indent=1))
    plain = read(f"{plain_lines},{plain_eval}")
    assert plain[0] == expected_tuples(RECORDS[:15])
    for spec in (f"{lines},{packed_eval}", f"jsonl:{lines},{packed_eval}", f"{plain_lines},{packed_eval}"):
        assert read(spec) == plain, spec
    assert read(array) == read(f"json:{array}") == read(plain_array)  # (split 90/10 alike)
    assert sorted(read(array)[0] + read(array)[1]) == sorted(expected_tuples(RECORDS))
    stat = os.stat(lines)
    write_compressed(tmp_path / "train.jsonl.gz", "".join(json.dumps(r) + "\n" for r in RECORDS[5:20]))
    os.utime(lines, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # (its time kept: read again all the same)
    assert read(f"{lines},{packed_eval}")[0] == expected_tuples(RECORDS[5:20])
    # one not there is a missing file, not a hub dataset's name ("unknown dataset")
    with pytest.raises(MissingInputError, match=r"^--data_path .*missing\.jsonl\.gz: no such file or folder"):
        raw(str(tmp_path / "missing.jsonl.gz"), tmp_path)


def test_a_folders_eval_file_is_read_beside_its_train_file_where_one_of_them_is_compressed(tmp_path):
    """A folder of train.jsonl and test.jsonl.gz (or train.jsonl.gz and test.jsonl: the large file compressed, as
    compressed JSON is read by its own path) evaluates on its test file, as one of two plain files does: the folder's
    eval file was looked for uncompressed beside a plain train file, and beside a compressed one (a download's top
    level, which counts compressed split files alone) not at all, and the train file was split 90/10 without a word.
    A plain and a compressed file of one split name are an error, as two types of it are."""
    import gzip

    def write(path, records):
        text = "".join(json.dumps(r) + "\n" for r in records).encode()
        path.write_bytes(gzip.compress(text) if path.suffix == ".gz" else text)

    for train, evaluation in (("train.jsonl", "test.jsonl.gz"), ("train.jsonl.gz", "test.jsonl"),
                              ("train.jsonl", "eval.json.gz"), ("train.jsonl.gz", "validation.jsonl")):
        folder = tmp_path / f"{train}-{evaluation}"
        folder.mkdir()
        write(folder / train, RECORDS[:15])
        write(folder / evaluation, RECORDS[15:])
        adapter = raw(str(folder), tmp_path)
        assert as_tuples(adapter, adapter.get_train_data()) == expected_tuples(RECORDS[:15]), (train, evaluation)
        assert as_tuples(adapter, adapter.get_eval_data()) == expected_tuples(RECORDS[15:]), (train, evaluation)
    folder = tmp_path / "train.jsonl-test.jsonl.gz"
    write(folder / "test.jsonl", RECORDS[15:])
    with pytest.raises(UsageError, match=r"the folder holds test\.jsonl and test\.jsonl\.gz, and one file is the "
                                         r"eval data"):
        raw(str(folder), tmp_path)


def test_a_compressed_train_files_folder_picks_its_eval_file_as_a_plain_train_files_does(tmp_path, capsys):
    """Beside train.jsonl.gz the eval file was the folder's compressed split file whatever else it held: with
    eval.jsonl and test.jsonl.gz, test.jsonl.gz was read and eval.jsonl went unread without a word (beside train.jsonl
    eval.jsonl is read, test.jsonl.gz said unread); test.jsonl beside test.jsonl.gz was no error; validation.jsonl
    beside test.jsonl.gz was not said unread. Both train files now give the same eval data, error and notice."""
    import gzip

    def write(path, records):
        text = "".join(json.dumps(r) + "\n" for r in records).encode()
        path.write_bytes(gzip.compress(text) if path.suffix == ".gz" else text)

    def folder_of(train, *evals):  # (the train file's 12 records, then 4 for each eval file in turn)
        folder = tmp_path / "-".join((train, *evals))
        folder.mkdir()
        write(folder / train, RECORDS[:12])
        for k, name in enumerate(evals):
            write(folder / name, RECORDS[12 + 4 * k:16 + 4 * k])
        return str(folder)

    for train in ("train.jsonl", "train.jsonl.gz"):
        for evals in (("eval.jsonl", "test.jsonl.gz"), ("test.jsonl.gz", "validation.jsonl")):
            capsys.readouterr()
            adapter = raw(folder_of(train, *evals), tmp_path)
            assert as_tuples(adapter, adapter.get_eval_data()) == expected_tuples(RECORDS[12:16]), (train, evals)
            assert f"evaluating on {evals[0]}; {evals[1]} not read" in capsys.readouterr().out, (train, evals)
        with pytest.raises(UsageError, match=r"the folder holds test\.jsonl and test\.jsonl\.gz, and one file is the "
                                             r"eval data"):
            raw(folder_of(train, "test.jsonl", "test.jsonl.gz"), tmp_path)


def test_a_compressed_train_files_eval_file_in_data_is_read(tmp_path):
    """train.jsonl.gz at a folder's top level beside data/test.jsonl: d334ab4 looked for the eval file at the top
    level alone (as beside a plain train file) wherever the eval split file found was no shard, found none, and split
    the train file 90/10 without a word; data/test.jsonl is the eval data, as it was before."""
    import gzip

    folder = tmp_path / "download"
    (folder / "data").mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in RECORDS[:12]).encode()
    (folder / "train.jsonl.gz").write_bytes(gzip.compress(text))
    write_records(RECORDS[12:16], folder / "data" / "test.jsonl", "jsonl")
    adapter = raw(str(folder), tmp_path)
    assert as_tuples(adapter, adapter.get_train_data()) == expected_tuples(RECORDS[:12])
    assert as_tuples(adapter, adapter.get_eval_data()) == expected_tuples(RECORDS[12:16])


def test_a_broken_line_of_a_compressed_file_given_by_its_path_is_named_by_file_and_line(tmp_path):
    """A compressed JSON Lines file given by its path gets the plain file's checks, over its text decompressed: a
    bad line named by the file and its number, a key written twice refused; a CSV compressed is refused, saying to
    decompress it, and a JSON file compressed though its name does not say so, the name to give it."""
    lines = [json.dumps(r) for r in RECORDS[:4]]
    path = write_compressed(tmp_path / "train.jsonl.bz2", "\n".join([*lines[:2], '{"prompt": "cut', *lines[2:]]))
    for spec in (path, f"jsonl:{path}"):
        with pytest.raises(DatasetFormatError, match=rf"^{re.escape(path)} line 3: invalid JSON \(Unterminated "):
            raw(spec, tmp_path)
    write_compressed(tmp_path / "train.jsonl.bz2", "\n".join([lines[0], '{"prompt": "a", "prompt": "b"}']))
    with pytest.raises(DatasetFormatError, match=rf"^{re.escape(path)} line 2: an object writes the key 'prompt' "
                                                 "twice"):
        raw(path, tmp_path)
    packed_csv = write_compressed(tmp_path / "train.csv.gz", pd.DataFrame(RECORDS).to_csv(index=False))
    with pytest.raises(DatasetFormatError, match=rf"^--data_path {re.escape(packed_csv)}: the file is compressed with "
                                                 r"gzip, which dschat does not read here \(it reads JSON and JSON "
                                                 r"Lines compressed with gzip, bzip2 or xz, named so: x\.jsonl\.gz\): "
                                                 rf"decompress it \(gunzip -k {re.escape(packed_csv)}\)"):
        raw(packed_csv, tmp_path)


def test_a_file_named_compressed_that_is_not_is_said_so_not_called_a_file_cut_short(tmp_path):
    """train.jsonl.gz holding the plain JSON Lines text was "not readable as gzip data, as its name says it is (Not a
    gzipped file (b'{"')): a file cut short? download or compress it again": it is no file cut short. Data of no
    compression, or of another, is said to be no gzip data, with the name to give it, in the words a CSV named .gz is
    told so (``misnamed_compressed_error``: gzip's own "Not a gzipped file (b'{"')" no longer among them); a stream cut
    short is said so still, and one damaged inside is said to be damaged."""
    import bz2
    import gzip

    text = "".join(json.dumps(r) + "\n" for r in RECORDS[:4])
    path = tmp_path / "train.jsonl.gz"
    said = re.escape(f"{path}: not gzip data, though its name says it is")
    for data, advice in ((text.encode(), rf": where it is the uncompressed file, name it so "
                                         rf"\(mv {re.escape(str(path))} {re.escape(str(tmp_path / 'train.jsonl'))}\)"),
                         (bz2.compress(text.encode()), rf": it is compressed with bzip2; name it so \(mv "
                                                       rf"{re.escape(str(path))} {re.escape(str(tmp_path))}/train\.jsonl"
                                                       r"\.bz2\)")):
        path.write_bytes(data)
        with pytest.raises(DatasetFormatError, match=f"^{said}{advice}$"):
            raw(str(path), tmp_path)
    # (in the very words a plain CSV named .gz is told, refused before it is read: with the flag that gave it)
    plain_csv = tmp_path / "train.csv.gz"
    plain_csv.write_bytes(pd.DataFrame(RECORDS[:4]).to_csv(index=False).encode())
    path.write_bytes(text.encode())
    with pytest.raises(DatasetFormatError) as csv_error:
        raw(str(plain_csv), tmp_path)
    with pytest.raises(DatasetFormatError) as json_error:
        raw(str(path), tmp_path)
    assert str(json_error.value) == str(csv_error.value).removeprefix("--data_path ").replace(".csv", ".jsonl")
    packed = gzip.compress(text.encode())
    path.write_bytes(packed[:-12])
    with pytest.raises(DatasetFormatError, match=r"not readable as gzip data, as its name says it is \(Compressed "
                                                 r"file ended .*\): a file cut short\? download or compress it again$"):
        raw(str(path), tmp_path)
    path.write_bytes(packed[:-8] + bytes(b ^ 0xFF for b in packed[-8:-4]) + packed[-4:])  # (its CRC: not the data's)
    with pytest.raises(DatasetFormatError, match=r"not readable as gzip data, as its name says it is \(CRC check "
                                                 r"failed.*\): its data is damaged; download or compress it again$"):
        raw(str(path), tmp_path)


def test_a_misnamed_compressed_csv_is_told_a_command_that_decompresses_it(tmp_path):
    """x.csv holding gzip was told to run `gunzip -k x.csv`, which gunzip refuses ("unknown suffix -- ignored"); it is
    told to name it x.csv.gz first now, and the command given writes x.csv, read as the plain file."""
    import gzip
    import subprocess

    csv_text = pd.DataFrame(RECORDS).to_csv(index=False)
    path = tmp_path / "x.csv"
    path.write_bytes(gzip.compress(csv_text.encode()))
    with pytest.raises(DatasetFormatError, match=r"the file is compressed with gzip, which dschat does not read here "
                                                 r".*: decompress it \((.*)\) and give the file that writes$") as error:
        raw(str(path), tmp_path)
    command = re.search(r"decompress it \((.*)\) and give", str(error.value)).group(1)
    assert command == f"mv {path} {path}.gz && gunzip -k {path}.gz"
    subprocess.run(command, shell=True, check=True)
    assert path.read_text() == csv_text and len(raw(str(path), tmp_path).raw_datasets["train"]) == len(RECORDS)


def test_a_file_named_with_another_compressions_extension_is_told_a_command_that_writes_the_plain_file(tmp_path):
    """csv:x.csv.gz holding xz data was told `mv x.csv.gz x.csv.gz.xz && unxz -k x.csv.gz.xz`, which writes x.csv.gz:
    the plain CSV, named as gzip again (and x.jsonl.gz holding zstd so, x.jsonl.gz plain JSON Lines). The name's
    compression extension is replaced now: the command given writes x.csv, read as the plain file."""
    import lzma
    import subprocess

    csv_text = pd.DataFrame(RECORDS).to_csv(index=False)
    path = tmp_path / "x.csv.gz"
    path.write_bytes(lzma.compress(csv_text.encode()))
    with pytest.raises(DatasetFormatError, match=r"the file is compressed with xz, .*: decompress it \((.*)\) and "
                                                 r"give the file that writes$") as error:
        raw(f"csv:{path}", tmp_path)
    command = re.search(r"decompress it \((.*)\) and give", str(error.value)).group(1)
    assert command == f"mv {path} {tmp_path}/x.csv.xz && unxz -k {tmp_path}/x.csv.xz"
    subprocess.run(command, shell=True, check=True)
    plain = tmp_path / "x.csv"
    assert plain.read_text() == csv_text and len(raw(str(plain), tmp_path).raw_datasets["train"]) == len(RECORDS)
    from dschat.data.reading import decompress_command

    assert decompress_command("d/x.jsonl.gz", "zstd") == "mv d/x.jsonl.gz d/x.jsonl.zst && unzstd d/x.jsonl.zst"
    assert decompress_command("d/X.CSV.XZ", "xz") == "mv d/X.CSV.XZ d/X.CSV.xz && unxz -k d/X.CSV.xz"


def test_a_csv_named_compressed_is_told_by_its_bytes_not_its_name(tmp_path):
    """x.csv.gz holding xz, or the plain CSV, was told "the file is compressed with gzip ... decompress it (gunzip -k
    x.csv.gz)", which gunzip refuses ("not in gzip format"). The compression is told by the file's bytes now: xz data
    gets the command that decompresses it, plain text the name to give it; each command given, run, gives x.csv,
    read as the plain file."""
    import lzma
    import subprocess

    csv_text = pd.DataFrame(RECORDS).to_csv(index=False)
    path, plain = tmp_path / "x.csv.gz", tmp_path / "x.csv"
    for data, said in ((lzma.compress(csv_text.encode()), r"the file is compressed with xz, .*: decompress it \((.*)\) "
                                                          r"and give the file that writes$"),
                       (csv_text.encode(), r": not gzip data, though its name says it is: where it is the uncompressed "
                                           r"file, name it so \((.*)\)$")):
        plain.unlink(missing_ok=True)
        path.write_bytes(data)
        with pytest.raises(DatasetFormatError, match=said) as error:
            raw(str(path), tmp_path)
        subprocess.run(re.search(said, str(error.value)).group(1), shell=True, check=True)
        assert plain.read_text() == csv_text and len(raw(str(plain), tmp_path).raw_datasets["train"]) == len(RECORDS)


def test_a_folders_zipped_train_file_is_told_a_command_that_writes_beside_it(tmp_path):
    """A folder's train.csv.zip was told "decompress its files (unzip FOLDER/train.csv.zip) and give the folder
    again": unzip writes into the folder the command runs in, so the folder given again was refused again. Run
    elsewhere, the command given writes FOLDER/train.csv, and the folder is read."""
    import subprocess
    import zipfile

    folder, elsewhere = tmp_path / "zipped", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    with zipfile.ZipFile(folder / "train.csv.zip", "w") as archive:
        archive.writestr("train.csv", pd.DataFrame(RECORDS).to_csv(index=False))
    said = r"its train data train\.csv\.zip: the file is compressed with zip, which dschat does not read here .*: " \
           r"write its plain files \((.*)\) and give the folder again"
    with pytest.raises(DatasetFormatError, match=said) as error:
        raw(str(folder), tmp_path)
    subprocess.run(re.search(said, str(error.value)).group(1), shell=True, check=True, cwd=elsewhere,
                   stdout=subprocess.DEVNULL)
    assert len(raw(str(folder), tmp_path).raw_datasets["train"]) == len(RECORDS)


def test_json_lines_named_with_another_compression_is_told_a_name_that_replaces_it(tmp_path):
    """jsonl:x.jsonl.zst holding gzip was told "name it so (mv x.jsonl.zst x.jsonl.zst.gz)": the .zst kept hid the
    type, and x.jsonl.zst.gz given by its path was refused ("compressed with gzip ... decompress it"). The name given
    replaces the extension (x.jsonl.gz), as decompress_command's does (e973f4b): run, it is read by its path."""
    import gzip
    import subprocess

    path = tmp_path / "x.jsonl.zst"
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in RECORDS).encode()))
    said = r"which its name does not say: name it so \((mv .*)\), and it is read decompressed"
    with pytest.raises(DatasetFormatError, match=said) as error:
        raw(f"jsonl:{path}", tmp_path)
    subprocess.run(re.search(said, str(error.value)).group(1), shell=True, check=True)
    adapter = raw(str(tmp_path / "x.jsonl.gz"), tmp_path)
    assert len(adapter.raw_datasets["train"]) == len(RECORDS)


def test_a_gzip_file_named_jsonl_is_refused_by_its_first_bytes_before_it_is_hashed(tmp_path, monkeypatch):
    """A load of x.jsonl holding gzip hashed the whole file (a shard: hundreds of MB) before its first bytes, read in
    the same open, said it was compressed: they are checked before it is read whole now."""
    import gzip

    from dschat.data import digests, reading

    path = tmp_path / "x.jsonl"
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in RECORDS).encode()))

    def hashed_whole(*args):
        raise AssertionError(f"{path} hashed whole")

    monkeypatch.setattr(digests.hashlib, "file_digest", hashed_whole)
    with pytest.raises(DatasetFormatError, match="compressed with gzip, which its name does not say"):
        reading.load_file("jsonl", str(path))


def test_a_hub_blob_named_jsonl_holding_gzip_is_refused_though_its_hash_opens_nothing(tmp_path):
    """A hub cache's file is hashed by its blob's name, not opened (``hub_blob_sha256``): no first bytes come with its
    hash, and its compression is checked by an open of its own."""
    import gzip

    from dschat.data import reading

    snapshot = tmp_path / "datasets--org--name" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    path = snapshot / "x.jsonl"
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in RECORDS).encode()))
    link_into_hub_cache(snapshot)
    with pytest.raises(DatasetFormatError, match="compressed with gzip, which its name does not say"):
        reading.load_file("jsonl", str(path))


def test_a_compressed_file_given_with_its_type_is_said_with_the_flag_before_any_step_runs(tmp_path, monkeypatch):
    """jsonl:packed.jsonl (a .jsonl file that is gzip inside) passed the pre-flight check_data_paths, and loading it
    said "packed.jsonl: the file is compressed ..." naming no flag (--sft_only_data_path, a tool's --pairs_file); its
    bare path named it. It says the name to give it now (gunzip -k refuses that name). x.jsonl.gz, named so, was
    refused the same way, and is read now, by every flag that takes data."""
    import gzip

    from dschat.data.raw_datasets import check_data_paths
    from dschat.tools.records import load_records

    monkeypatch.chdir(tmp_path)
    for name in ("x.jsonl.gz", "packed.jsonl"):
        (tmp_path / name).write_bytes(gzip.compress(b'{"prompt": "a", "chosen": "b", "rejected": "c"}\n'))
    (tmp_path / "x.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 8)
    write_records(RECORDS, tmp_path / "eval.jsonl", "jsonl")
    for spec, path, said in (("jsonl:packed.jsonl", "packed.jsonl", "which its name does not say: name it so "
                                                                     "(mv packed.jsonl packed.jsonl.gz)"),
                             ("packed.jsonl", None, "which its name does not say"),
                             ("jsonl:eval.jsonl,packed.jsonl", "packed.jsonl", "which its name does not say"),
                             ("jsonl:x.jsonl.zst", "x.jsonl.zst", "which dschat does not read here")):
        said = re.escape(f"{spec}: {path}" if path else spec) + r": the file is compressed with (gzip|zstd), " + \
            re.escape(said)
        for flag, read in (("--sft_only_data_path", lambda: check_data_paths(["tiny"], [spec])),
                           ("--data_path", lambda: raw(spec, tmp_path)),
                           ("--pairs_file", lambda: load_records(spec, flag="--pairs_file"))):
            with pytest.raises(DatasetFormatError, match=f"^{flag} {said}"):
                read()
    for spec in ("x.jsonl.gz", "jsonl:x.jsonl.gz", "json:x.jsonl.gz", "jsonl:eval.jsonl,x.jsonl.gz"):
        check_data_paths(["tiny"], [spec])
        assert load_records(spec, flag="--pairs_file")[-1].user_message == "a"
        assert len(raw(spec, tmp_path).raw_datasets) == 2


def test_a_download_folder_without_a_train_split_advises_files_that_read_when_they_are_compressed(tmp_path,
                                                                                                   monkeypatch):
    """A folder whose compressed JSON splits are not named train (a hub download's train_prefs.jsonl.gz and
    test_prefs.jsonl.gz) is told to give them as jsonl:x/train_prefs.jsonl.gz,x/test_prefs.jsonl.gz, which reads: a
    compressed file given by its own path was refused, and the advice was to decompress them first."""
    import gzip

    monkeypatch.chdir(tmp_path)
    (tmp_path / "prefs").mkdir()
    for name, records in (("train_prefs.jsonl.gz", RECORDS[:15]), ("test_prefs.jsonl.gz", RECORDS[15:])):
        (tmp_path / "prefs" / name).write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode()))
    with pytest.raises(UsageError) as error:
        raw("prefs", tmp_path)
    advice = re.search(r"\(e\.g\. (\S+)\)$", str(error.value))
    assert advice.group(1) == "jsonl:prefs/train_prefs.jsonl.gz,prefs/test_prefs.jsonl.gz"
    adapter = raw(advice.group(1), tmp_path)
    assert as_tuples(adapter, adapter.get_eval_data()) == expected_tuples(RECORDS[15:])


def test_a_folder_whose_data_is_in_its_subfolders_says_which_it_joins(tmp_path, capsys):
    """A local folder with no data files at its top level is read as a hub download of subsets is: mydata/v1/
    train.jsonl and mydata/v2/train.jsonl joined as one dataset, without a word, though they may be two versions of
    one data. Said now on stdout, naming the subfolders, once per folder per process; what is read is the same."""
    folder = tmp_path / "mydata"
    for sub, records in (("v1", RECORDS[:12]), ("v2", RECORDS[12:])):
        (folder / sub).mkdir(parents=True)
        write_records(records, folder / sub / "train.jsonl", "jsonl")
    adapter = raw(str(folder), tmp_path)
    assert as_tuples(adapter, adapter.raw_datasets["train"]) == expected_tuples(RECORDS)
    assert (f"[dschat.data] {folder}: no data files at the folder's top level; the split files of its subfolders v1, "
            "v2 are read as one dataset, each split joined in that order\n") in capsys.readouterr().out
    raw(f"jsonl:{folder}/", tmp_path)  # (the same folder, spelled otherwise: said once)
    assert "subfolders" not in capsys.readouterr().out
    # one subfolder holding data joins nothing: nothing said
    shutil.copytree(folder / "v1", tmp_path / "one" / "v1")
    assert len(raw(str(tmp_path / "one"), tmp_path).raw_datasets["train"]) == 12
    assert "subfolders" not in capsys.readouterr().out


def test_a_subset_folder_of_a_hub_download_in_gzip_jsonl_is_read_and_other_compressed_folders_are_refused(tmp_path):
    """Anthropic/hh-rlhf's helpful-base/ holds train.jsonl.gz and test.jsonl.gz: the folder, named to read that subset
    alone, was refused ("its train data train.jsonl.gz is compressed with gzip ... decompress its files"). It is read
    as local data now, datasets' json loader decompressing the files, as a hub download's are; a folder whose
    compressed files datasets does not read so (CSV) is still refused, with the command that decompresses them."""
    import gzip

    folder = tmp_path / "helpful-base"
    folder.mkdir()
    for name, records in (("train.jsonl.gz", RECORDS[:15]), ("test.jsonl.gz", RECORDS[15:])):
        (folder / name).write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode()))
    for spec in (str(folder), f"jsonl:{folder}"):
        adapter = raw(spec, tmp_path)
        assert as_tuples(adapter, adapter.get_train_data()) == expected_tuples(RECORDS[:15])
        assert as_tuples(adapter, adapter.get_eval_data()) == expected_tuples(RECORDS[15:])
    packed = tmp_path / "packed"
    packed.mkdir()
    for name in ("train.csv.gz", "test.csv.gz"):
        (packed / name).write_bytes(gzip.compress(pd.DataFrame(RECORDS).to_csv(index=False).encode()))
    for spec in (str(packed), f"csv:{packed}"):
        with pytest.raises(DatasetFormatError, match=r"packed: its train data train.csv.gz: the file is compressed "
                                                     r"with gzip, which dschat does not read here .*: write its plain "
                                                     r"files \(gunzip -k .*train.csv.gz && gunzip -k .*test.csv.gz\) "
                                                     r"and give the folder again"):
            raw(spec, tmp_path)


def test_a_folders_compressed_train_file_is_said_in_the_words_of_the_file_given_by_its_path(tmp_path):
    """A folder whose train.csv.gz holds xz was told "its train data train.csv.gz is compressed with xz, which dschat
    does not read: decompress its files (...)", worded apart from the same file given by its path ("the file is
    compressed with xz, which dschat does not read here (it reads JSON and JSON Lines compressed ..., named so:
    x.jsonl.gz): decompress it (...)"). The folder's error says the file's words, then the commands for all its
    files."""
    import lzma

    folder = tmp_path / "packed"
    folder.mkdir()
    for name, records in (("train.csv.gz", RECORDS[:15]), ("test.csv.gz", RECORDS[15:])):
        (folder / name).write_bytes(lzma.compress(pd.DataFrame(records).to_csv(index=False).encode()))
    with pytest.raises(DatasetFormatError) as file_error:
        raw(str(folder / "train.csv.gz"), tmp_path)
    with pytest.raises(DatasetFormatError) as folder_error:
        raw(str(folder), tmp_path)
    file_words = re.search(r": (the file is compressed with xz, which .*\)): decompress it", str(file_error.value))
    assert file_words, str(file_error.value)
    said = str(folder_error.value)
    assert said.startswith(f"--data_path {folder}: its train data train.csv.gz: {file_words.group(1)}: write its "
                           "plain files ("), said
    assert said.endswith("test.csv.xz) and give the folder again"), said


def test_a_compressed_folders_files_are_told_by_their_bytes_not_their_names(tmp_path):
    """A folder of train.csv.gz holding xz and test.csv.gz holding plain text was told "its train data train.csv.gz
    is compressed with gzip ... (gunzip -k train.csv.gz && gunzip -k test.csv.gz)", which gunzip refuses ("not in gzip
    format"). Each file is told by its bytes now (as a file given by its path is): the commands given, run, write the
    plain train.csv and test.csv, and the folder is read; plain train text named .gz is said to be no gzip data."""
    import gzip
    import lzma
    import subprocess

    train_text, test_text = (pd.DataFrame(part).to_csv(index=False) for part in (RECORDS[:15], RECORDS[15:]))
    for train_bytes, test_bytes, said in (
            (lzma.compress(train_text.encode()), test_text.encode(),
             r"packed: its train data train.csv.gz: the file is compressed with xz, which dschat does not read here "
             r".*\): write its plain files \((.*)\) and give the folder again$"),
            (train_text.encode(), gzip.compress(test_text.encode()),
             r"packed: its train data train.csv.gz: not gzip data, though its name says it is: write its plain "
             r"files \((.*)\) and give the folder again$")):
        folder = tmp_path / "packed"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        (folder / "train.csv.gz").write_bytes(train_bytes)
        (folder / "test.csv.gz").write_bytes(test_bytes)
        with pytest.raises(DatasetFormatError, match=said) as error:
            raw(str(folder), tmp_path)
        subprocess.run(re.search(said, str(error.value)).group(1), shell=True, check=True)
        assert (folder / "train.csv").read_text() == train_text and (folder / "test.csv").read_text() == test_text
        adapter = raw(str(folder), tmp_path)
        assert as_tuples(adapter, adapter.get_train_data()) == expected_tuples(RECORDS[:15])
        assert as_tuples(adapter, adapter.get_eval_data()) == expected_tuples(RECORDS[15:])


def test_the_commands_dschat_gives_for_a_compressed_file_work_on_a_path_with_a_space_and_a_quote(tmp_path):
    """The decompress and rename commands in dschat's messages wrote paths as they are: under "my data's" the shell
    split the path at the space and read the quote as an open string, so no command given could be pasted. Paths are
    quoted where the shell needs it now (ordinary ones are written as before: the tests above): each message's
    command, run in a shell, writes the file named, which reads as the plain data."""
    import bz2
    import gzip
    import lzma
    import subprocess

    here = tmp_path / "my data's"
    here.mkdir()
    csv_text = pd.DataFrame(RECORDS).to_csv(index=False)
    jsonl_text = "".join(json.dumps(r) + "\n" for r in RECORDS)
    for name, data, spec, written in (
            ("a.csv", gzip.compress(csv_text.encode()), "{}", "a.csv"),  # (decompress_command: mv, then gunzip)
            ("b.csv.gz", csv_text.encode(), "{}", "b.csv"),  # (misnamed_compressed_error: plain, named .gz)
            ("c.jsonl.gz", jsonl_text.encode(), "{}", "c.jsonl"),  # (misnamed_compressed_error: plain)
            ("d.jsonl.gz", bz2.compress(jsonl_text.encode()), "{}", "d.jsonl.bz2"),  # (misnamed_compressed_error: bz2)
            ("e.jsonl", gzip.compress(jsonl_text.encode()), "jsonl:{}", "e.jsonl.gz"),  # (compressed_error: JSON)
            ("f/train.csv.gz", lzma.compress(csv_text.encode()), "{}", "f/train.csv")):  # (a folder's: xz)
        path = here / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
        given = str(path.parent if name.startswith("f/") else path)
        with pytest.raises(DatasetFormatError) as error:
            raw(spec.format(given), tmp_path)
        command = re.search(r"\(((?:mv|gunzip|unxz) .*?)\)(?:,| and|$)", str(error.value)).group(1)
        subprocess.run(command, shell=True, check=True, cwd=tmp_path)
        assert len(raw(str(here / written), tmp_path).raw_datasets["train"]) == len(RECORDS), (name, command)


@pytest.mark.parametrize("name", ["train.csv", "train.jsonl", "train.json"])
def test_a_parquet_file_named_as_text_is_told_the_name_to_give_it(tmp_path, name):
    """A Parquet file named train.csv or train.jsonl in a dataset folder was read as text: "not UTF-8 text (byte 0xd4
    at column 8); save the file as UTF-8", which is not the fix. It is told by its first bytes (b"PAR1") now, the file
    named with the name to give it; the command given makes the folder read as Parquet. Given as TYPE:PATH under its
    own name, the type to give is said."""
    import subprocess

    folder = tmp_path / "data"
    folder.mkdir()
    path = folder / name
    pd.DataFrame(RECORDS).to_parquet(path)
    with pytest.raises(DatasetFormatError, match=rf"{re.escape(str(path))}: the file is a Parquet file, not "
                                                 rf"{name.split('.')[1]}: name it so \((mv .*\.parquet)\), and it is "
                                                 r"read as parquet$") as error:
        raw(str(folder), tmp_path)
    subprocess.run(re.search(r"\((mv .*)\)", str(error.value)).group(1), shell=True, check=True)
    assert raw(str(folder), tmp_path).raw_datasets["train"]["prompt"] == [record["prompt"] for record in RECORDS]
    with pytest.raises(DatasetFormatError, match=r"train\.parquet: the file is a Parquet file, not csv: give it as "
                                                 r"parquet:\S+train\.parquet$"):
        raw(f"csv:{folder / 'train.parquet'}", tmp_path)


def test_a_parquet_file_given_as_another_type_is_told_the_type_to_give(tmp_path):
    """A Parquet file given as csv:x.csv was told to be named x.parquet, "and it is read as parquet": so named, the
    csv:x.csv given was a file not found, and the type was still the one to change. Given as TYPE:PATH, it is told the
    type to give (parquet:x.csv, read as it is named); given by its path alone, the name to give it, as before."""
    path = tmp_path / "x.csv"
    pd.DataFrame(RECORDS).to_parquet(path)
    with pytest.raises(DatasetFormatError, match=rf"the file is a Parquet file, not csv: give it as "
                                                 rf"parquet:{re.escape(str(path))}$"):
        raw(f"csv:{path}", tmp_path)
    assert raw(f"parquet:{path}", tmp_path).raw_datasets["train"]["prompt"] == [record["prompt"] for record in RECORDS]
    with pytest.raises(DatasetFormatError, match=r"not csv: name it so \(mv .*x\.parquet\), and it is read as parquet$"):
        raw(str(path), tmp_path)


# the command a binary table named as data is told (``binary_table_command``): a rename, or one and a Parquet write
TABLE_FIX = re.compile(r"\(((?:mv |python -c ).*)\)")


def write_unread_table(form, path, tmp_path):
    """Write RECORDS at ``path`` as a binary table dschat does not read: Feather v1, an Arrow IPC file (Feather v2),
    or an Arrow IPC stream (a save_to_disk shard's, copied)."""
    import pyarrow
    import pyarrow.feather

    if form == "stream":
        Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "saved"))
        shutil.copy(tmp_path / "saved" / "data-00000-of-00001.arrow", path)
    else:
        version = {"feather1": 1, "arrow": 2}[form]
        pyarrow.feather.write_feather(pyarrow.table(pd.DataFrame(RECORDS)), str(path), version=version)


@pytest.mark.parametrize("form", ["feather1", "arrow", "stream"])
def test_the_command_given_for_an_arrow_or_feather_train_file_in_a_folder_makes_the_folder_read(tmp_path, form):
    """A folder whose train.csv is an Arrow or Feather file was told the command that writes train.parquet beside it,
    and, given again, "the folder holds train.parquet and train.csv: keep one". The command names the file as what it
    is (train.arrow, train.feather: no data name a folder is read by) before writing the Parquet file: following it,
    the folder loads its records."""
    import subprocess

    folder = tmp_path / "data"
    folder.mkdir()
    write_unread_table(form, folder / "train.csv", tmp_path)
    with pytest.raises(DatasetFormatError, match=r"train\.csv: the file is .*, not csv") as error:
        raw(str(folder), tmp_path)
    subprocess.run(TABLE_FIX.search(str(error.value)).group(1), shell=True, check=True)
    assert raw(str(folder), tmp_path).raw_datasets["train"]["prompt"] == [record["prompt"] for record in RECORDS]


@pytest.mark.parametrize("version", [1, 2])
def test_an_arrow_or_feather_file_named_as_data_is_told_how_to_write_it_as_parquet(tmp_path, version):
    """An Arrow IPC (Feather v2) or Feather v1 file named x.csv was read as text, its NUL bytes said "UTF-16?". It is
    told by its first bytes now: dschat reads neither, and the command given writes the Parquet file it reads."""
    import subprocess

    path = tmp_path / "x.csv"
    write_unread_table({1: "feather1", 2: "arrow"}[version], path, tmp_path)
    what = {1: "a Feather v1 file", 2: r"an Arrow IPC \(Feather v2\) file"}[version]
    with pytest.raises(DatasetFormatError, match=rf"x\.csv: the file is {what}, not csv, and dschat does not read "
                                                 r"it: name it so and write it as Parquet, which it reads "
                                                 r"\((mv .* && python -c .*)\)$") as error:
        raw(str(path), tmp_path)
    subprocess.run(TABLE_FIX.search(str(error.value)).group(1), shell=True, check=True)
    assert len(raw(str(tmp_path / "x.parquet"), tmp_path).raw_datasets["train"]) == len(RECORDS)


@pytest.mark.parametrize("name", ["x.jsonl", "x.csv", "x.json"])
def test_an_arrow_stream_named_as_data_is_told_what_it_is_and_the_fix(tmp_path, name):
    """datasets' save_to_disk shard (data-00000-of-00001.arrow) is an Arrow IPC stream: no magic word, its first bytes
    a continuation marker (0xFFFFFFFF). Named x.jsonl or x.csv it was "not UTF-8 text (a NUL byte ...: UTF-16?)". It
    is told by its first bytes and the schema they start now: the save_to_disk folder it is from is read as
    disk:FOLDER, and the command given writes the file alone as the Parquet file dschat reads. A text whose first bytes
    are 0xFF but does not end as a stream does stays "not UTF-8", and one of those four bytes alone is no stream."""
    import subprocess

    path = tmp_path / name
    write_unread_table("stream", path, tmp_path)
    assert path.read_bytes().startswith(b"\xff\xff\xff\xff")
    with pytest.raises(DatasetFormatError, match=rf"{re.escape(name)}: the file is an Arrow IPC stream \(.*\), not "
                                                 rf"{name.split('.')[1]}, and dschat does not read it: where it is "
                                                 r"from a save_to_disk folder, give the folder as disk:FOLDER; else "
                                                 r"name it so and write it as Parquet, which it reads "
                                                 r"\(mv .* && python -c .*\)$") as error:
        raw(str(path), tmp_path)
    assert len(raw(f"disk:{tmp_path / 'saved'}", tmp_path).raw_datasets["train"]) == len(RECORDS)
    subprocess.run(TABLE_FIX.search(str(error.value)).group(1), shell=True, check=True)
    assert raw(str(tmp_path / "x.parquet"), tmp_path).raw_datasets["train"]["prompt"] == [r["prompt"] for r in RECORDS]
    for text in (b"\xff\xff\xff\xff", b"\xff\xff\xff\xffprompt,chosen,rejected\n"):
        path.write_bytes(text)
        with pytest.raises(DatasetFormatError, match=r"not UTF-8 text"):
            raw(f"csv:{path}", tmp_path)


def write_arrow_stream(path, legacy=False, closed=True):
    """Write RECORDS at ``path`` as an Arrow IPC stream: of the framing before pyarrow 0.15 (``legacy``: no
    continuation marker; use_legacy_format), or not closed (no end-of-stream marker: a writer killed)."""
    import pyarrow
    import pyarrow.ipc

    table = pyarrow.table(pd.DataFrame(RECORDS))
    with open(path, "wb") as sink:
        writer = pyarrow.ipc.new_stream(sink, table.schema,
                                        options=pyarrow.ipc.IpcWriteOptions(use_legacy_format=legacy))
        writer.write_table(table)
        if closed:
            writer.close()


@pytest.mark.parametrize("legacy,closed", [(True, True), (False, False), (True, False)])
def test_an_unclosed_or_legacy_arrow_stream_named_as_data_is_told_what_it_is_and_the_fix(tmp_path, legacy, closed):
    """An Arrow IPC stream was told by its end-of-stream marker: one not closed (its writer killed) has none, and one
    of pyarrow before 0.15 starts without the continuation marker and ends with another, so named x.csv they were "not
    UTF-8 text (a NUL byte ...: UTF-16?)". Each is told by the schema its first bytes start now, with the fix, which,
    followed, writes the Parquet file dschat reads; a UTF-32 text, whose first bytes may look like a length alone, stays
    "not UTF-8"."""
    import subprocess

    path = tmp_path / "x.csv"
    write_arrow_stream(path, legacy, closed)
    assert path.read_bytes().startswith(b"\xff\xff\xff\xff") != legacy
    with pytest.raises(DatasetFormatError, match=r"x\.csv: the file is an Arrow IPC stream \(.*\), not csv, and "
                                                 r"dschat does not read it: .*\(mv .* && python -c .*\)$") as error:
        raw(str(path), tmp_path)
    subprocess.run(TABLE_FIX.search(str(error.value)).group(1), shell=True, check=True)
    assert raw(str(tmp_path / "x.parquet"), tmp_path).raw_datasets["train"]["prompt"] == [r["prompt"] for r in RECORDS]
    text = tmp_path / "y.csv"
    text.write_bytes("prompt,chosen,rejected\nHi?,Hello.,Go.\n".encode("utf-32-le"))
    with pytest.raises(DatasetFormatError, match=r"not UTF-8 text \(a NUL byte"):
        raw(str(text), tmp_path)


@pytest.mark.parametrize("name,form", [("data-00000-of-00001.arrow", "stream"), ("x.arrow", "arrow"),
                                       ("x.feather", "feather1"), ("x.pq", "parquet")])
def test_a_binary_table_whose_extension_names_no_data_type_is_told_what_it_is(tmp_path, name, form):
    """A save_to_disk shard given by its own path (data-00000-of-00001.arrow), or an Arrow, Feather or Parquet file
    named by an extension that is no data type's (x.feather, x.pq), was "cannot tell the format of the file from its
    extension; write jsonl:PATH, json:PATH, parquet:PATH or csv:PATH", none of which reads an Arrow or Feather file,
    and what the file is was told only by the next run, of the type followed. It is told by its bytes at once, with
    the command that, followed, makes it read."""
    import subprocess

    path = tmp_path / name
    if form == "parquet":
        pd.DataFrame(RECORDS).to_parquet(path)
    else:
        write_unread_table(form, path, tmp_path)
    with pytest.raises(UsageError, match=rf"^--data_path {re.escape(str(path))}: the file is an? ") as error:
        raw(str(path), tmp_path)
    assert "cannot tell the format" not in str(error.value)
    subprocess.run(TABLE_FIX.search(str(error.value)).group(1), shell=True, check=True)
    written = tmp_path / f"{os.path.splitext(name)[0]}.parquet"
    assert raw(str(written), tmp_path).raw_datasets["train"]["prompt"] == [record["prompt"] for record in RECORDS]


@pytest.mark.parametrize("in_folder", [False, True])
@pytest.mark.parametrize("name,form", [("train.jsonl.gz", "parquet"), ("train.csv.gz", "parquet"),
                                       ("train.json.xz", "parquet"), ("train.csv.gz", "arrow")])
def test_a_binary_table_named_compressed_is_told_its_fix_in_one_run(tmp_path, name, form, in_folder):
    """A Parquet file named train.jsonl.gz (or .csv.gz, .json.xz) was told "not gzip data ...: where it is the
    uncompressed file, name it so (mv train.jsonl.gz train.jsonl)", and only the next run that it is Parquet. It is
    told what it is now, and the command given, followed once, makes the file (or its folder) read."""
    import subprocess

    folder = tmp_path / "data"
    folder.mkdir()
    path = folder / name
    if form == "parquet":
        pd.DataFrame(RECORDS).to_parquet(path)
    else:
        write_unread_table(form, path, tmp_path)
    spec = str(folder if in_folder else path)
    with pytest.raises(DatasetFormatError, match=r"not (gzip|xz) data, though its name says it is: it is an? "
                                                 r"(Parquet|Arrow IPC)") as error:
        raw(spec, tmp_path)
    subprocess.run(TABLE_FIX.search(str(error.value)).group(1), shell=True, check=True)
    written = str(folder if in_folder else folder / "train.parquet")
    assert raw(written, tmp_path).raw_datasets["train"]["prompt"] == [record["prompt"] for record in RECORDS]


@pytest.mark.parametrize("form", ["parquet", "arrow"])
def test_a_folders_binary_tables_named_csv_are_all_told_their_fix_in_one_run(tmp_path, form):
    """A folder whose train.csv and test.csv are both Parquet (or Arrow) files was told of train.csv alone: followed,
    the next run told of test.csv. Every such file's command is told at once now (as a compressed folder's are): run,
    the commands make the folder load, its train and its eval records."""
    import subprocess

    folder = tmp_path / "data"
    folder.mkdir()
    for name, records in (("train.csv", RECORDS[:15]), ("test.csv", RECORDS[15:])):
        if form == "parquet":
            pd.DataFrame(records).to_parquet(folder / name)
        else:
            import pyarrow
            import pyarrow.feather

            pyarrow.feather.write_feather(pyarrow.table(pd.DataFrame(records)), str(folder / name))
    with pytest.raises(DatasetFormatError, match=r"train\.csv: the file is an? .*, not csv: make its files read as "
                                                 r"what they are \((.*)\) and give the folder again$") as error:
        raw(str(folder), tmp_path)
    assert "test.csv" in str(error.value)
    subprocess.run(TABLE_FIX.search(str(error.value)).group(1), shell=True, check=True)
    adapter = raw(str(folder), tmp_path)
    assert as_tuples(adapter, adapter.get_train_data()) == expected_tuples(RECORDS[:15])
    assert as_tuples(adapter, adapter.get_eval_data()) == expected_tuples(RECORDS[15:])


@pytest.mark.parametrize("test_as", ["parquet", "csv"])
def test_a_typed_folders_binary_tables_are_told_to_give_the_folder_again_without_its_type(tmp_path, test_as):
    """csv:FOLDER of a Parquet train.csv (and test.csv, or a real CSV test.csv) was told the renames "and give the
    folder again", or its one rename "name it so (mv train.csv train.parquet)": given again as csv:FOLDER, "the folder
    has no train.csv". It is told to give the folder without the type, which then reads."""
    import subprocess

    folder = tmp_path / "data"
    folder.mkdir()
    pd.DataFrame(RECORDS[:15]).to_parquet(folder / "train.csv")
    if test_as == "parquet":
        pd.DataFrame(RECORDS[15:]).to_parquet(folder / "test.csv")
    else:
        write_records(RECORDS[15:], folder / "test.csv", "csv")
    with pytest.raises(DatasetFormatError, match=rf"\) and give it again as {re.escape(str(folder))}, its type told "
                                                 r"by its files$") as error:
        raw(f"csv:{folder}", tmp_path)
    subprocess.run(TABLE_FIX.search(str(error.value)).group(1), shell=True, check=True)
    adapter = raw(str(folder), tmp_path)
    assert as_tuples(adapter, adapter.get_eval_data()) == expected_tuples(RECORDS[15:])


@pytest.mark.parametrize("tool,module", [("gzip", "gzip"), ("bzip2", "bz2"), ("xz", "lzma")])
@pytest.mark.parametrize("given", ["file", "folder"])
def test_a_compressed_parquet_file_named_as_json_is_told_what_it_is_and_its_fix(tmp_path, tool, module, given):
    """A Parquet file compressed with gzip and named train.jsonl.gz was "line 1: not UTF-8 text": only the compressed
    bytes were looked at. Its decompressed first bytes tell it, with the commands that decompress it to
    train.parquet, which, run, make the file (or its folder) read."""
    import importlib
    import io
    import subprocess

    folder = tmp_path / "data"
    folder.mkdir()
    parquet = io.BytesIO()
    pd.DataFrame(RECORDS[:15]).to_parquet(parquet)
    packed = folder / f"train.jsonl{COMPRESSIONS[tool].extension}"
    packed.write_bytes(importlib.import_module(module).compress(parquet.getvalue()))
    write_records(RECORDS[15:], folder / "test.jsonl", "jsonl")
    spec = str(folder if given == "folder" else packed)
    with pytest.raises(DatasetFormatError, match=rf"{re.escape(str(packed))}: the file is a Parquet file compressed "
                                                 rf"with {tool}, not JSON: decompress it to train\.parquet \(mv .*\), "
                                                 r"and it is read as parquet$") as error:
        raw(spec, tmp_path)
    subprocess.run(TABLE_FIX.search(str(error.value)).group(1), shell=True, check=True)
    if given == "folder":
        adapter = raw(spec, tmp_path)
        assert as_tuples(adapter, adapter.get_eval_data()) == expected_tuples(RECORDS[15:])
    else:
        adapter = raw(str(folder / "train.parquet"), tmp_path)
        data = [*adapter.get_train_data(), *adapter.get_eval_data()]
        assert sorted(as_tuples(adapter, data)) == sorted(expected_tuples(RECORDS[:15]))


def test_a_compressed_arrow_file_named_as_json_is_told_to_be_decompressed_and_written_as_parquet(tmp_path):
    """An Arrow file compressed with gzip and named train.jsonl.gz, which dschat does not read decompressed either, is
    told the commands that decompress it to train.arrow and write it as Parquet, which, run, make its folder read."""
    import gzip
    import io
    import subprocess

    folder = tmp_path / "data"
    folder.mkdir()
    arrow = io.BytesIO()
    pd.DataFrame(RECORDS[:15]).to_feather(arrow)
    (folder / "train.jsonl.gz").write_bytes(gzip.compress(arrow.getvalue()))
    write_records(RECORDS[15:], folder / "test.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=r"train\.jsonl\.gz: the file is an Arrow IPC \(Feather v2\) file "
                                                 r"compressed with gzip, not JSON, and dschat does not read it: "
                                                 r"decompress it to train\.arrow and write it as Parquet") as error:
        raw(str(folder), tmp_path)
    subprocess.run(TABLE_FIX.search(str(error.value)).group(1), shell=True, check=True)
    adapter = raw(str(folder), tmp_path)
    assert as_tuples(adapter, adapter.get_eval_data()) == expected_tuples(RECORDS[15:])


def test_a_compressed_legacy_arrow_stream_named_as_json_is_told_what_it_is_and_a_utf32_text_not(tmp_path):
    """An Arrow IPC stream of pyarrow before 0.15 (no continuation marker: its first bytes a length) compressed with
    gzip and named train.jsonl.gz was read as JSON, "UTF-16?". It is told what it is by its decompressed schema now,
    with the commands that, run, write the Parquet file dschat reads; a gzipped UTF-32 JSON text, whose first bytes
    may look like a length too, has no schema after them and stays "not UTF-8"."""
    import gzip
    import subprocess

    folder = tmp_path / "data"
    folder.mkdir()
    stream = tmp_path / "stream.arrow"
    write_arrow_stream(stream, legacy=True)
    packed = folder / "train.jsonl.gz"
    packed.write_bytes(gzip.compress(stream.read_bytes()))
    with pytest.raises(DatasetFormatError, match=r"train\.jsonl\.gz: the file is an Arrow IPC stream \(.*\) "
                                                 r"compressed with gzip, not JSON, and dschat does not read it: "
                                                 r".*decompress it to train\.arrow and write it as Parquet") as error:
        raw(str(packed), tmp_path)
    subprocess.run(TABLE_FIX.search(str(error.value)).group(1), shell=True, check=True)
    assert raw(str(folder / "train.parquet"), tmp_path).raw_datasets["train"]["prompt"] == \
        [record["prompt"] for record in RECORDS]
    text = folder / "text.jsonl.gz"
    text.write_bytes(gzip.compress('{"prompt": "Hi?", "chosen": "Hello."}\n'.encode("utf-32-le")))
    with pytest.raises(DatasetFormatError, match=r"not UTF-8 text \(a NUL byte"):
        raw(str(text), tmp_path)


@pytest.mark.parametrize("text", [b"PAR1", b"PAR1\n", b"FEA1 notes\n"])
def test_a_compressed_json_file_beginning_as_a_binary_tables_magic_but_no_table_is_told_its_json_error(tmp_path, text):
    """A JSON file read decompressed whose decompressed first bytes were a binary table's magic was told to be that
    table by them alone: four bytes "PAR1" gzipped as train.jsonl.gz were "a Parquet file compressed with gzip", with
    commands that fail on it (the Parquet file they write is none). It is told so where it ends as that table too, as
    a compressed text is; else its JSON check says what is wrong, at its line."""
    import gzip

    path = tmp_path / "train.jsonl.gz"
    path.write_bytes(gzip.compress(text))
    with pytest.raises(DatasetFormatError, match=rf"^{re.escape(str(path))} line 1: invalid JSON"):
        raw(str(path), tmp_path)


@pytest.mark.parametrize("column", ["PAR1", "FEA1", "ARROW1"])
def test_a_csv_whose_first_column_is_named_as_a_binary_tables_magic_is_read_as_csv(tmp_path, column):
    """A CSV whose header begins with a binary table's magic (a column named PAR1 or FEA1: "feature 1") was refused
    as "a Parquet file" or "a Feather v1 file": its first bytes alone told it. Such a file ends with its magic too;
    this text does not, and is read as the CSV it is."""
    path = tmp_path / "train.csv"
    pd.DataFrame([{column: str(i), **record} for i, record in enumerate(RECORDS)]).to_csv(path, index=False)
    assert path.read_bytes().startswith(column.encode())
    data = raw(f"csv:{path}", tmp_path).raw_datasets["train"]
    assert data["prompt"] == [record["prompt"] for record in RECORDS]


@pytest.mark.parametrize("magic", ["PAR1", "FEA1", "ARROW1"])
def test_a_csv_that_begins_and_ends_with_a_binary_tables_magic_is_read_as_csv(tmp_path, magic):
    """A CSV whose first column is named as a binary table's magic and whose last cell is that magic (no line end
    after it) was "a Parquet file" (or Feather, Arrow): its first and last bytes alone told it. Such a file holds its
    footer's length before its last magic; this text's four bytes there are a length far past its end."""
    path = tmp_path / "train.csv"
    path.write_text(f"{magic},prompt,chosen,rejected\n1,Hi?,Hello.,{magic}")
    data = raw(f"csv:{path}", tmp_path).raw_datasets["train"]
    assert (data[magic], data["rejected"]) == (["1"], [magic])


def test_folder_reads_an_eval_file_of_another_extension_and_refuses_two_eval_files(tmp_path, capsys):
    # train.jsonl beside eval.json: the eval file was not looked for and train was split 90/10, without a word
    folder = tmp_path / "data"
    folder.mkdir()
    write_records(RECORDS[:15], folder / "train.jsonl", "jsonl")
    write_records(RECORDS[15:], folder / "eval.json", "json")
    for spec in (str(folder), f"jsonl:{folder}"):
        adapter = raw(spec, tmp_path)
        assert as_tuples(adapter, adapter.get_train_data()) == expected_tuples(RECORDS[:15])
        assert as_tuples(adapter, adapter.get_eval_data()) == expected_tuples(RECORDS[15:])
    # one eval split under two extensions: either may be the eval data
    write_records(RECORDS[15:], folder / "eval.jsonl", "jsonl")
    with pytest.raises(UsageError, match=r"holds eval\.jsonl and eval\.json, and one file is the eval data"):
        raw(str(folder), tmp_path)
    (folder / "eval.json").unlink()
    (folder / "eval.jsonl").unlink()
    # test and validation both there (a hub dataset's splits written out): test is read, as a save_to_disk
    # DatasetDict's is, and the note says so (it was refused)
    write_records(RECORDS[15:17], folder / "test.jsonl", "jsonl")
    write_records(RECORDS[17:], folder / "validation.csv", "csv")
    adapter = raw(str(folder), tmp_path)
    assert as_tuples(adapter, adapter.get_eval_data()) == expected_tuples(RECORDS[15:17])
    assert "evaluating on test.jsonl; validation.csv not read" in capsys.readouterr().out
    write_records(RECORDS[:15], folder / "train.csv", "csv")  # two train files: the same
    with pytest.raises(UsageError, match=r"holds train\.jsonl and train\.csv: which is the train data"):
        raw(str(folder), tmp_path)


def test_save_to_disk_dataset_dict_with_test_and_validation_says_which_is_read(tmp_path, capsys):
    DatasetDict({"train": Dataset.from_list(RECORDS[:15]), "validation": Dataset.from_list(RECORDS[15:17]),
                 "test": Dataset.from_list(RECORDS[17:])}).save_to_disk(str(tmp_path / "dd"))
    adapter = raw(f"disk:{tmp_path / 'dd'}", tmp_path)
    assert as_tuples(adapter, adapter.get_eval_data()) == expected_tuples(RECORDS[17:])
    assert "evaluating on its 'test' split; 'validation' not read" in capsys.readouterr().out


def test_save_to_disk_dataset_dict_and_single_dataset(tmp_path):
    DatasetDict({"train": Dataset.from_list(RECORDS[:15]), "test": Dataset.from_list(RECORDS[15:])}).save_to_disk(
        str(tmp_path / "dd"))
    Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "single"))
    adapter = raw(f"disk:{tmp_path / 'dd'}", tmp_path)
    assert as_tuples(adapter, adapter.get_train_data()) == expected_tuples(RECORDS[:15])
    assert as_tuples(adapter, adapter.get_eval_data()) == expected_tuples(RECORDS[15:])
    bare = raw(str(tmp_path / "single"), tmp_path)  # a bare save_to_disk folder is recognised
    assert sorted(as_tuples(bare, bare.get_train_data()) + as_tuples(bare, bare.get_eval_data())) == \
        sorted(expected_tuples(RECORDS))


def test_single_file_gets_a_seeded_90_10_split(tmp_path):
    path = write_records(RECORDS, tmp_path / "all.jsonl", "jsonl")
    first = raw(path, tmp_path)
    train = [s["prompt"] for s in first.get_train_data()]
    eval_ = [s["prompt"] for s in first.get_eval_data()]
    assert (len(train), len(eval_)) == (18, 2)
    assert set(train).isdisjoint(eval_) and set(train) | set(eval_) == {r["prompt"] for r in RECORDS}
    assert [s["prompt"] for s in raw(path, tmp_path).get_eval_data()] == eval_  # deterministic (and cached)
    other_seeds = {tuple(s["prompt"] for s in raw(path, tmp_path, seed=seed).get_eval_data()) for seed in range(5)}
    assert len(other_seeds) > 1


def test_tiny_name_is_the_embedded_dataset(tmp_path):
    adapter = raw("tiny", tmp_path)
    sample = adapter.get_train_data()[0]
    assert adapter.get_conversation(sample)[0]["role"] == "user"
    assert adapter.get_chosen_text(sample) and "task" in adapter.get_extra(sample)
    assert len(adapter.get_eval_data()) > 0


def test_deepspeed_chats_local_jsonfile_reads_data_train_and_eval_json(tmp_path, monkeypatch):
    # DeepSpeed-Chat's --data_path local/jsonfile: data/train.json and data/eval.json where the step runs
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MissingInputError, match="local/jsonfile .*data/train.json and .*data/eval.json not found"):
        raw("local/jsonfile", tmp_path)
    (tmp_path / "data").mkdir()
    write_records(RECORDS[:15], tmp_path / "data" / "train.json", "json")
    write_records(RECORDS[15:], tmp_path / "data" / "eval.json", "json")
    adapter = raw("local/jsonfile", tmp_path)
    assert as_tuples(adapter, adapter.get_train_data()) == [tuple(r.values()) for r in RECORDS[:15]]
    assert as_tuples(adapter, adapter.get_eval_data()) == [tuple(r.values()) for r in RECORDS[15:]]


# --- field names and record shapes ---

def test_field_mapping(tmp_path):
    records = [{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"], "task": r["task"]}
               for r in RECORDS]
    path = write_records(records, tmp_path / "q.jsonl", "jsonl")
    adapter = raw(path, tmp_path, **parse_field_map("prompt=question, chosen=good,rejected=bad"))
    sample = adapter.get_train_data()[0]
    index = int(sample["question"].split()[-1].rstrip("?"))
    assert adapter.get_conversation(sample) == [{"role": "user", "content": RECORDS[index]["prompt"]}]
    assert (adapter.get_chosen_text(sample), adapter.get_rejected_text(sample)) == \
        (RECORDS[index]["chosen"], RECORDS[index]["rejected"])
    assert adapter.get_extra(sample) == {"task": RECORDS[index]["task"]}
    with pytest.raises(DatasetFormatError, match="--data_fields") as err:
        raw(path, tmp_path)  # without the mapping the fields are not found
    assert "question" in str(err.value)


def test_a_renamed_field_the_records_lack_is_named(tmp_path):
    path = write_records(RECORDS, tmp_path / "p.jsonl", "jsonl")  # prompt/chosen/rejected
    with pytest.raises(DatasetFormatError, match=r"no 'question' field, which --data_fields prompt=question names"):
        raw(path, tmp_path, **parse_field_map("prompt=question"))
    messages = write_records([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}],
                             tmp_path / "m.jsonl", "jsonl")
    raw(messages, tmp_path, **parse_field_map("prompt=question"))  # another shape's records: the rename does not apply


def test_a_renamed_field_the_embedded_data_lacks_is_said_of_the_embedded_data_not_its_package_file(tmp_path):
    # (train.py --data-fields prompt=question on the default data: the package's train.jsonl is no file the user gave)
    with pytest.raises(DatasetFormatError, match=r"^the embedded tiny data \(train split\): no 'question' field, "
                                                 r"which --data_fields prompt=question names; the records have "
                                                 r"\['prompt', 'chosen', 'rejected'") as err:
        raw("tiny", tmp_path, **parse_field_map("prompt=question"))
    assert "tiny/data" not in str(err.value)


def test_a_renamed_chosen_field_the_records_lack_is_named_and_answerless_files_still_load(tmp_path):
    mapping = parse_field_map("prompt=question,chosen=good,rejected=bad")
    typo = [{"question": r["prompt"], "goood": r["chosen"], "bad": r["rejected"]} for r in RECORDS]
    with pytest.raises(DatasetFormatError, match=r"no 'good' field, which --data_fields chosen=good names"):
        raw(write_records(typo, tmp_path / "q.jsonl", "jsonl"), tmp_path, **mapping)  # not read as prompt-only
    # one --data_fields covers every file: SFT-only and prompt-only files lack the answer columns by design
    sft_only = [{"question": r["prompt"], "good": r["chosen"]} for r in RECORDS]
    raw(write_records(sft_only, tmp_path / "sft.jsonl", "jsonl"), tmp_path, **mapping)
    prompts = [{"question": r["prompt"]} for r in RECORDS]
    raw(write_records(prompts, tmp_path / "prompts.jsonl", "jsonl"), tmp_path, **mapping)
    messages = write_records([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}],
                             tmp_path / "m.jsonl", "jsonl")
    raw(messages, tmp_path, **mapping)  # another shape's records: the renames do not apply


def test_a_renamed_rejected_field_the_records_lack_is_an_error_in_step_2_only(tmp_path):
    mapping = parse_field_map("prompt=question,chosen=good,rejected=bad")
    typo = raw(write_records([{"question": r["prompt"], "good": r["chosen"], "baad": r["rejected"]} for r in RECORDS],
                             tmp_path / "q.jsonl", "jsonl"), tmp_path, **mapping)
    typo.check_usable(1)  # an SFT file under the same mapping may lack the rejected answers
    typo.check_usable(3)
    with pytest.raises(DatasetFormatError, match=r"no 'bad' field, which --data_fields rejected=bad names"):
        typo.check_usable(2)  # not every record skipped as "no rejected answer"
    unmapped = raw(write_records([{"prompt": r["prompt"], "chosen": r["chosen"]} for r in RECORDS],
                                 tmp_path / "sft.jsonl", "jsonl"), tmp_path)
    unmapped.check_usable(2)  # no rename: an SFT-only source in a step-2 mix is a counted skip
    conversations = raw(write_records([{"messages": [{"role": "user", "content": r["prompt"]},
                                                     {"role": "assistant", "content": r["chosen"]}]} for r in RECORDS],
                                      tmp_path / "chat.jsonl", "jsonl"), tmp_path, **mapping)
    conversations.check_usable(2)  # beside the renamed pairs: skipped and counted, as without --data_fields


def test_a_misspelt_chosen_field_without_rejected_answers_is_named_in_steps_1_and_2(tmp_path):
    """The helper's case: prompt=question,chosen=goo over records with 'good' read as prompt-only records; steps 1
    and 2 then name the flag's field, not a missing 'chosen' field; step 3 takes the prompts."""
    typo = raw(write_records([{"question": r["prompt"], "good": r["chosen"]} for r in RECORDS],
                             tmp_path / "q.jsonl", "jsonl"), tmp_path, **parse_field_map("prompt=question,chosen=goo"))
    for step in (1, 2):
        with pytest.raises(DatasetFormatError, match=r"no 'goo' field, which --data_fields chosen=goo names"):
            typo.check_usable(step)
    typo.check_usable(3)


def test_parse_field_map_rejects_bad_input():
    assert parse_field_map("") == {}
    with pytest.raises(ValueError, match="prompt=question"):
        parse_field_map("prompt")
    with pytest.raises(ValueError, match="unknown data field"):
        parse_field_map("answer=x")


def test_messages_records_for_sft(tmp_path):
    records = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"},
                             {"role": "assistant", "content": "4"}], "source": "x"}] * 3
    path = write_records(records, tmp_path / "chat.jsonl", "jsonl")
    adapter = raw(f"{path},{path}", tmp_path)
    sample = adapter.get_train_data()[0]
    assert adapter.get_conversation(sample) == records[0]["messages"][:-1]
    assert adapter.get_chosen_text(sample) == "4" and adapter.get_rejected_text(sample) is None
    assert adapter.get_extra(sample) == {"source": "x"}
    doubled = write_records([{"messages": [*records[0]["messages"], {"role": "assistant", "content": "Or 5"}]}] * 2,
                            tmp_path / "doubled.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=r"line 1 \(record 0\): field 'messages': the conversation ends with "
                                                 r"two assistant messages in a row"):
        raw(f"{doubled},{doubled}", tmp_path)  # (it said "the prompt messages must end with a user message")


def test_preference_records_that_also_carry_messages_read_as_pairs(tmp_path):
    """ultrafeedback_binarized's columns (prompt, chosen, rejected as conversations, and messages = the chosen one)
    read as messages records: every rejected answer was lost, and step 2 and DPO had no records."""
    user = {"role": "user", "content": "Name a color."}
    chosen = [user, {"role": "assistant", "content": "Blue."}]
    records = [{"prompt": "Name a color.", "prompt_id": "a1", "chosen": chosen, "messages": chosen,
                "rejected": [user, {"role": "assistant", "content": "I like cars."}], "score_chosen": 8.0}] * 3
    path = write_records(records, tmp_path / "uf.jsonl", "jsonl")
    adapter = raw(f"{path},{path}", tmp_path)
    sample = adapter.get_train_data()[0]
    assert adapter.get_conversation(sample) == [user]
    assert (adapter.get_chosen_text(sample), adapter.get_rejected_text(sample)) == ("Blue.", "I like cars.")


def test_a_prompt_column_beside_messages_is_read_only_when_named(tmp_path):
    """ultrachat's and no_robots' prompt column is the conversation's first turn: the messages are read. A prompt
    field named by --data_fields is the user's choice: it was silently replaced by the messages' turns."""
    messages = [{"role": "user", "content": "msg 1"}, {"role": "assistant", "content": "a1"}]
    records = [{"prompt": "Real prompt 1.", "question": "Asked 1.", "messages": messages}] * 2
    path = write_records(records, tmp_path / "both.jsonl", "jsonl")
    sample = (adapter := raw(f"{path},{path}", tmp_path)).get_train_data()[0]
    assert adapter.get_conversation(sample) == messages[:1] and adapter.get_chosen_text(sample) == "a1"
    named = raw(f"{path},{path}", tmp_path, prompt="question")
    assert named.get_conversation(named.get_train_data()[0]) == [{"role": "user", "content": "Asked 1."}]


def test_sharegpt_messages_and_text_content_parts_are_read(tmp_path):
    """They were "message 0 has role None" and "message 0 has no text content"."""
    sharegpt = [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}] * 2
    path = write_records(sharegpt, tmp_path / "sharegpt.jsonl", "jsonl")
    for fields in ("messages=conversations", ""):  # ShareGPT's own column name is read without --data_fields too
        adapter = raw(f"{path},{path}", tmp_path, **parse_field_map(fields))
        sample = adapter.get_train_data()[0]
        assert adapter.get_conversation(sample) == [{"role": "user", "content": "Hi"}]
        assert adapter.get_chosen_text(sample) == "Hello"
    with pytest.raises(DatasetFormatError, match="no 'prompt', 'convs' or 'chosen' field"):  # a typo stays one
        raw(f"{path},{path}", tmp_path, **parse_field_map("messages=convs"))
    # renaming only another column (the tools') still reads the conversations: it was "no 'prompt', 'messages' or
    # 'chosen' field"
    path = write_records([dict(record, functions="[]") for record in sharegpt], tmp_path / "tools.jsonl", "jsonl")
    adapter = raw(f"{path},{path}", tmp_path, **parse_field_map("tools=functions"))
    assert adapter.get_chosen_text(adapter.get_train_data()[0]) == "Hello"
    parts = [{"messages": [{"role": "user", "content": [{"type": "text", "text": "Name a color."}]},
                           {"role": "assistant", "content": [{"type": "text", "text": "Blue."}]}]}] * 2
    path = write_records(parts, tmp_path / "parts.jsonl", "jsonl")
    adapter = raw(f"{path},{path}", tmp_path)
    sample = adapter.get_train_data()[0]
    assert adapter.get_conversation(sample) == [{"role": "user", "content": "Name a color."}]
    assert adapter.get_chosen_text(sample) == "Blue."
    image = [{"messages": [{"role": "user", "content": [{"type": "image", "text": None}]},
                           {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}] * 2
    path = write_records(image, tmp_path / "image.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=r"message 0 has a 'image' content part; only text parts are read"):
        raw(f"{path},{path}", tmp_path)


def test_alpaca_records_read_their_instruction_input_history_and_output(tmp_path):
    """LLaMA-Factory's default format (Alpaca's instruction, input, output, with system and history; chosen and
    rejected for preference data) was "no 'prompt', 'messages' or 'chosen' field", and read with --data_fields
    prompt=instruction,chosen=output its input and history were extra columns: the model trained without them. The
    instruction is the prompt, its input on a line of its own after it (as LLaMA-Factory joins them), after the
    history's turns and the system message; the output is the answer."""
    records = [{"instruction": "Add the numbers.", "input": "1 + 1", "output": "2", "system": "Be exact.",
                "history": [["Hi.", "Hello."]]},
               {"instruction": "Name a color.", "input": "", "output": "Blue.", "system": "", "history": []}]
    path = write_records(records, tmp_path / "alpaca.jsonl", "jsonl")
    for fields in ("", "prompt=instruction,chosen=output,input=input,history=history,system=system"):
        adapter = raw(f"{path},{path}", tmp_path, **parse_field_map(fields))
        first, second = adapter.get_train_data()
        assert adapter.get_conversation(first) == [
            {"role": "system", "content": "Be exact."}, {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Add the numbers.\n1 + 1"}]
        assert adapter.get_chosen_text(first) == "2" and adapter.get_extra(first) == {}
        assert adapter.get_conversation(second) == [{"role": "user", "content": "Name a color."}]
    pairs = [{"instruction": "Add.", "input": "1 + 1", "chosen": "2", "rejected": "3"}]
    path = write_records(pairs, tmp_path / "pairs.jsonl", "jsonl")
    adapter = raw(path, tmp_path)
    sample = adapter.get_train_data()[0]
    assert adapter.get_conversation(sample) == [{"role": "user", "content": "Add.\n1 + 1"}]
    assert (adapter.get_chosen_text(sample), adapter.get_rejected_text(sample)) == ("2", "3")
    dolly = [{"instruction": "Summarize.", "context": "A long text.", "response": "Short."}]  # (not Alpaca's columns)
    path = write_records(dolly, tmp_path / "dolly.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match="no 'prompt', 'messages' or 'chosen' field"):
        raw(path, tmp_path)
    path = write_records([dict(records[0], history=[["Hi."]])], tmp_path / "history.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=r"record 0\): field 'history': expected a list of \[instruction, "
                                                 r"answer\] pairs .*; a 'history' column of something else is an "
                                                 r"extra column under --data_fields prompt=instruction,chosen=output"):
        raw(path, tmp_path)


def test_an_explicit_data_fields_mapping_decides_which_alpaca_columns_are_read(tmp_path):
    """Named by --data_fields prompt=instruction, a record's input and history columns were read as Alpaca's whatever
    they held: a plain-text history (a log, say) or an input of another type stopped the file ("field 'history':
    expected a list of [instruction, answer] pairs"). An explicit mapping decides, as LLaMA-Factory's columns do: they
    are extra columns unless it names them (input=, history=; the input of any prompt column: dolly's context)."""
    records = [{"instruction": "Add the numbers.", "input": 7, "history": "asked twice before", "output": "2"}] * 2
    path = write_records(records, tmp_path / "other.jsonl", "jsonl")
    adapter = raw(f"{path},{path}", tmp_path, **parse_field_map("prompt=instruction,chosen=output"))
    sample = adapter.get_train_data()[0]
    assert adapter.get_conversation(sample) == [{"role": "user", "content": "Add the numbers."}]
    assert adapter.get_chosen_text(sample) == "2"
    assert adapter.get_extra(sample) == {"input": 7, "history": "asked twice before"}
    with pytest.raises(DatasetFormatError, match=r"field 'history': expected a list of \[instruction, answer\] pairs"):
        raw(f"{path},{path}", tmp_path, **parse_field_map("prompt=instruction,chosen=output,history=history"))
    dolly = [{"instruction": "Summarize.", "context": "A long text.", "response": "Short."}] * 2
    path = write_records(dolly, tmp_path / "dolly.jsonl", "jsonl")
    adapter = raw(f"{path},{path}", tmp_path, **parse_field_map("prompt=instruction,input=context,chosen=response"))
    sample = adapter.get_train_data()[0]
    assert adapter.get_conversation(sample) == [{"role": "user", "content": "Summarize.\nA long text."}]
    with pytest.raises(DatasetFormatError, match=r"no 'contxt' field, which --data_fields input=contxt names"):
        raw(f"{path},{path}", tmp_path, **parse_field_map("prompt=instruction,input=contxt,chosen=response"))
    held_out = write_records([{"instruction": "Summarize.", "response": "Short."}], tmp_path / "eval.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=r"eval.jsonl: no 'context' field, which --data_fields input=context"):
        raw(f"{path},{held_out}", tmp_path, **parse_field_map("prompt=instruction,input=context,chosen=response"))
    chat = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}] * 2
    path = write_records(chat, tmp_path / "messages.jsonl", "jsonl")  # (a file of another shape under the same fields)
    adapter = raw(f"{path},{path}", tmp_path, **parse_field_map("prompt=instruction,input=context,chosen=response"))
    assert adapter.get_chosen_text(adapter.get_train_data()[0]) == "Yo"


def test_an_explicit_data_fields_mapping_reads_a_system_column_only_where_it_names_it(tmp_path):
    """Any "system" column was put before every prompt as its system message, also under a --data_fields mapping of
    the record fields that did not name it: a column of something else (the system that wrote the answer, as in MT
    and summarization data) trained and generated after "online-B" as a system prompt. As LLaMA-Factory's "columns"
    (system: None unless named), such a mapping reads it only where it names it (system=NAME); without one, a "system"
    column (LLaMA-Factory's records) is read as before."""
    records = [{"question": "Translate: Hallo.", "good": "Hello.", "system": "online-B"}] * 2
    path = write_records(records, tmp_path / "mt.jsonl", "jsonl")
    adapter = raw(f"{path},{path}", tmp_path, **parse_field_map("prompt=question,chosen=good"))
    sample = adapter.get_train_data()[0]
    assert adapter.get_conversation(sample) == [{"role": "user", "content": "Translate: Hallo."}]
    assert adapter.get_extra(sample) == {"system": "online-B"}  # (an extra column: step 3's reward functions get it)
    adapter = raw(f"{path},{path}", tmp_path, **parse_field_map("prompt=question,chosen=good,system=system"))
    assert adapter.get_conversation(adapter.get_train_data()[0])[0] == {"role": "system", "content": "online-B"}
    unmapped = write_records([{"prompt": "Hi", "chosen": "Yo", "system": "Be brief."}] * 2, tmp_path / "lf.jsonl",
                             "jsonl")
    for fields in ("", "label=verdict"):  # (no record field named: read as LLaMA-Factory's)
        adapter = raw(f"{unmapped},{unmapped}", tmp_path, **parse_field_map(fields))
        assert adapter.get_conversation(adapter.get_train_data()[0])[0] == {"role": "system", "content": "Be brief."}


def test_a_misspelt_system_or_tools_column_of_data_fields_is_said(tmp_path):
    """A system= or tools= naming a column the file lacks was ignored without a word (the model trained without the
    system prompt or the tool schemas), while a misspelt prompt=, input= or label= is said: it is an error naming
    the flag, where the file is the mapping's (it has a record field the mapping renames, or the mapping renames
    none); a file of another shape under the same mapping is read as before."""
    chat = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}],
             "sys": "Be brief.", "functions_json": "[]"}] * 2
    path = write_records(chat, tmp_path / "chat.jsonl", "jsonl")
    for fields, column in (("system=sytem", "sytem"), ("tools=fuctions_json", "fuctions_json"),
                           ("messages=messages,system=sytem", "sytem")):
        name = fields.split(",")[-1].split("=")[0]
        with pytest.raises(DatasetFormatError, match=rf"chat.jsonl: no '{column}' field, which --data_fields "
                                                     rf"{name}={column} names; the records have \["):
            raw(f"{path},{path}", tmp_path, **parse_field_map(fields))
    adapter = raw(f"{path},{path}", tmp_path, **parse_field_map("system=sys,tools=functions_json"))
    assert adapter.get_conversation(adapter.get_train_data()[0])[0] == {"role": "system", "content": "Be brief."}
    held_out = write_records([{"messages": chat[0]["messages"], "functions_json": "[]"}], tmp_path / "eval.jsonl",
                             "jsonl")  # (the eval file's prompts were evaluated without the train file's system prompt)
    with pytest.raises(DatasetFormatError, match=r"eval.jsonl: no 'sys' field, which --data_fields system=sys names"):
        raw(f"{path},{held_out}", tmp_path, **parse_field_map("system=sys,tools=functions_json"))
    prompts = [{"question": "Say hi.", "good": "Hi."}] * 2
    other = write_records(prompts, tmp_path / "prompts.jsonl", "jsonl")  # (the mapping's file lacks it: said)
    with pytest.raises(DatasetFormatError, match=r"no 'sys' field, which --data_fields system=sys names"):
        raw(f"{other},{other}", tmp_path, **parse_field_map("prompt=question,chosen=good,system=sys"))
    # chat.jsonl beside them, of another shape (none of the renamed record fields): its messages read as before
    adapter = raw(f"{path},{path}", tmp_path, **parse_field_map("prompt=question,chosen=good,system=systm"))
    assert adapter.get_chosen_text(adapter.get_train_data()[0]) == "Yo"


def test_llama_factorys_pairwise_records_answer_their_conversation_with_one_message_each(tmp_path):
    """LLaMA-Factory's pairwise records (ShareGPT's conversations, or OpenAI's messages, then chosen and rejected each
    one message) were "field 'chosen': expected a non-empty list of messages, got dict". The conversation is the
    prompt, the two messages the answers."""
    sharegpt = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"}],
                "chosen": {"from": "gpt", "value": "Hello."}, "rejected": {"from": "gpt", "value": "Go away."}}
    openai = {"messages": [{"role": "user", "content": "Hi"}], "chosen": {"role": "assistant", "content": "Hello."},
              "rejected": {"role": "assistant", "content": "Go away."}}
    for name, record in (("sharegpt", sharegpt), ("openai", openai)):
        path = write_records([record] * 2, tmp_path / f"{name}.jsonl", "jsonl")
        adapter = raw(f"{path},{path}", tmp_path)
        sample = adapter.get_train_data()[0]
        assert adapter.get_conversation(sample)[-1] == {"role": "user", "content": "Hi"}
        assert (adapter.get_chosen_text(sample), adapter.get_rejected_text(sample)) == ("Hello.", "Go away.")
    assert adapter.get_conversation(sample) == [{"role": "user", "content": "Hi"}] and adapter.get_extra(sample) == {}


def test_a_csv_answer_written_as_the_json_text_of_one_message_reads_as_that_message(tmp_path):
    """A CSV cell holding the JSON text of a message list was read as the list, but that of one message (LLaMA-Factory's
    pairwise answers, {"role": "assistant", ...}) was trained on as its JSON text. It reads as the list of it; a JSON
    answer that is no message (a tool call's object) is still its text."""
    def answers(wrap):
        return [{"prompt": "Hi", "chosen": wrap({"role": "assistant", "content": "Hello."}),
                 "rejected": wrap({"from": "gpt", "value": "Go away."})}] * 2

    for wrap in (lambda m: json.dumps([m]), json.dumps):  # the list's JSON text, and the message's
        path = write_records(answers(wrap), tmp_path / "pairs.csv", "csv")
        adapter = raw(f"{path},{path}", tmp_path)
        sample = adapter.get_train_data()[0]
        assert (adapter.get_chosen_text(sample), adapter.get_rejected_text(sample)) == ("Hello.", "Go away.")
    conversation = [{"from": "human", "value": "Hi"}]
    llama_factory = [{"conversations": json.dumps(conversation), "chosen": json.dumps({"from": "gpt", "value": "Yo."}),
                      "rejected": json.dumps({"from": "gpt", "value": "No."})}] * 2
    path = write_records(llama_factory, tmp_path / "lf.csv", "csv")
    adapter = raw(f"{path},{path}", tmp_path)
    sample = adapter.get_train_data()[0]
    assert adapter.get_conversation(sample) == [{"role": "user", "content": "Hi"}]
    assert (adapter.get_chosen_text(sample), adapter.get_rejected_text(sample)) == ("Yo.", "No.")
    call = json.dumps({"name": "weather", "arguments": {"city": "Paris"}})
    path = write_records([{"prompt": "Call it.", "chosen": call, "rejected": "No."}] * 2, tmp_path / "call.csv", "csv")
    adapter = raw(f"{path},{path}", tmp_path)
    assert adapter.get_chosen_text(adapter.get_train_data()[0]) == call
    # OpenAI's older call message (function_call, no content) is a message too: its call is the answer
    older = json.dumps({"role": "assistant", "function_call": {"name": "weather", "arguments": '{"city": "Paris"}'}})
    path = write_records([{"prompt": "Call it.", "chosen": older, "rejected": "No."}] * 2, tmp_path / "older.csv",
                         "csv")
    adapter = raw(f"{path},{path}", tmp_path)
    answer = adapter.get_chosen_text(adapter.get_train_data()[0])
    assert (str(answer), answer.tool_calls) == ("", [{"type": "function", "function": {
        "name": "weather", "arguments": {"city": "Paris"}}}])


def test_a_json_lines_answer_that_is_the_json_text_of_a_message_stays_its_text(tmp_path):
    """Only a CSV cell, which cannot hold an object, writes one message as its JSON text: a JSON Lines (or JSON,
    parquet) string is text. An answer or prompt whose text is a message's JSON (a task that writes JSON) was read as
    that message (a user's as an error) since the CSV rule came; it is trained on as written, as before."""
    user, assistant = ({"role": role, "content": "hi"} for role in ("user", "assistant"))
    records = [{"prompt": json.dumps(user), "chosen": json.dumps(assistant), "rejected": json.dumps(user)}] * 2
    for kind in ("jsonl", "json", "parquet"):
        path = write_records(records, tmp_path / f"pairs.{kind}", kind)
        adapter = raw(f"{path},{path}", tmp_path)
        sample = adapter.get_train_data()[0]
        assert adapter.get_conversation(sample) == [{"role": "user", "content": json.dumps(user)}], kind
        assert (adapter.get_chosen_text(sample), adapter.get_rejected_text(sample)) == \
            (json.dumps(assistant), json.dumps(user)), kind


def test_trl_preference_records_with_implicit_and_explicit_prompt(tmp_path):
    user = {"role": "user", "content": "Name a color."}
    implicit = [{"chosen": [user, {"role": "assistant", "content": "Blue."}],
                 "rejected": [user, {"role": "assistant", "content": "Dog."}]}]
    adapter = raw(write_records(implicit, tmp_path / "imp.jsonl", "jsonl") + "," + str(tmp_path / "imp.jsonl"),
                  tmp_path)
    sample = adapter.get_train_data()[0]
    assert adapter.get_conversation(sample) == [user]
    assert (adapter.get_chosen_text(sample), adapter.get_rejected_text(sample)) == ("Blue.", "Dog.")

    explicit = [{"prompt": [user], "chosen": [{"role": "assistant", "content": "Red."}],
                 "rejected": [{"role": "assistant", "content": "Cat."}]}]
    path = write_records(explicit, tmp_path / "exp.jsonl", "jsonl")
    adapter = raw(f"{path},{path}", tmp_path)
    sample = adapter.get_train_data()[0]
    assert adapter.get_conversation(sample) == [user]
    assert (adapter.get_chosen_text(sample), adapter.get_rejected_text(sample)) == ("Red.", "Cat.")


def test_trl_string_pairs_with_an_implicit_prompt_read_the_words_both_begin_with_as_the_prompt(tmp_path):
    """TRL's standard preference format with an implicit prompt ({"chosen": "The sky is blue.", "rejected": "The sky
    is green."}) was refused: "a string without 'Human:'/'Assistant:' turns"."""
    rows = [{"chosen": "The sky is blue.", "rejected": "The sky is green."},
            {"chosen": "Pick a color:\nblue", "rejected": "Pick a color:\nblack"},  # (not "ue" and "ack")
            {"chosen": "Say yes. Yes", "rejected": "Say yes. Yes!"},  # (one the other's beginning)
            {"chosen": "2+2=4", "rejected": "2+2=5"}, {"chosen": "x=12", "rejected": "x=13"},  # (no space: TRL's cut)
            {"chosen": "天空是蓝色的", "rejected": "天空是绿色的"}]  # (no word boundary at all)
    path = write_records(rows, tmp_path / "implicit.jsonl", "jsonl")
    adapter = raw(f"{path},{path}", tmp_path)
    read = [(adapter.get_conversation(sample), adapter.get_chosen_text(sample), adapter.get_rejected_text(sample))
            for sample in adapter.get_train_data()]
    user = [{"role": "user", "content": text} for text in ("The sky is", "Pick a color:", "Say yes.", "2+2=", "x=",
                                                            "天空是")]
    assert read == [([user[0]], "blue.", "green."), ([user[1]], "blue", "black"), ([user[2]], "Yes", "Yes!"),
                    ([user[3]], "4", "5"), ([user[4]], "12", "13"), ([user[5]], "蓝色的", "绿色的")]
    apart = write_records([{"chosen": "Blue.", "rejected": "Green."}], tmp_path / "apart.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=r"field 'chosen': a string without 'Human:'/'Assistant:' turns that "
                                                 r"shares no beginning with 'rejected'"):
        raw(apart, tmp_path)


def test_trl_string_pairs_whose_first_words_merely_begin_alike_share_no_prompt(tmp_path):
    # "Blue."/"Black." were read with the prompt "Bl", "Sure, ..."/"Sorry, ..." with the prompt "S" (the cut where
    # two texts part, meant for text without spaces, was taken for any pair parting in its first word); a shared
    # beginning in an unspaced script after a spaced one keeps its characters
    for pair in ({"chosen": "Blue.", "rejected": "Black."},
                 {"chosen": "Sure, here it is.", "rejected": "Sorry, I cannot help."}):
        path = write_records([pair], tmp_path / "apart.jsonl", "jsonl")
        with pytest.raises(DatasetFormatError, match=r"field 'chosen': a string without 'Human:'/'Assistant:' turns "
                                                     r"that shares no beginning with 'rejected'"):
            adapter = raw(f"{path},{path}", tmp_path)
            adapter.get_conversation(adapter.get_train_data()[0])
    rows = [{"chosen": "答：天空是蓝色的", "rejected": "答：天空是绿色的"}, {"chosen": "Q: 空は青い", "rejected": "Q: 空は赤い"}]
    path = write_records(rows, tmp_path / "mixed.jsonl", "jsonl")
    adapter = raw(f"{path},{path}", tmp_path)
    read = [(adapter.get_conversation(sample), adapter.get_chosen_text(sample), adapter.get_rejected_text(sample))
            for sample in adapter.get_train_data()]
    assert read == [([{"role": "user", "content": "答：天空是"}], "蓝色的", "绿色的"),
                    ([{"role": "user", "content": "Q: 空は"}], "青い", "赤い")]


def test_trl_string_pairs_where_one_is_the_others_beginning_keep_an_answer_on_both_sides(tmp_path):
    # "The sky is blue." and "The sky is blue. Really." were read with the prompt "The sky is blue." and an empty chosen
    # answer, trained as DPO's preferred answer (a chosen field "" is an error); the shorter one's last word is its answer
    rows = [{"chosen": "The sky is blue.", "rejected": "The sky is blue. Really."},
            {"chosen": "The sky is blue. Really!", "rejected": "The sky is blue."},
            {"chosen": "2+2=4", "rejected": "2+2=45"}, {"chosen": "天空是蓝色的", "rejected": "天空是蓝色的吗"}]
    path = write_records(rows, tmp_path / "implicit.jsonl", "jsonl")
    adapter = raw(f"{path},{path}", tmp_path)
    read = [(adapter.get_conversation(sample)[0]["content"], adapter.get_chosen_text(sample),
             adapter.get_rejected_text(sample)) for sample in adapter.get_train_data()]
    assert read == [("The sky is", "blue.", "blue. Really."), ("The sky is", "blue. Really!", "blue."),
                    ("2+2=", "4", "45"), ("天空是蓝色", "的", "的吗")]
    alone = write_records([{"chosen": "Blue.", "rejected": "Blue. Really."}], tmp_path / "alone.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=r"field 'chosen': a string without 'Human:'/'Assistant:' turns that "
                                                 r"shares no beginning with 'rejected'"):
        adapter = raw(f"{alone},{alone}", tmp_path)
        adapter.get_conversation(adapter.get_train_data()[0])


def test_trl_prompt_completion_records_read_the_completion_as_the_answer(tmp_path):
    """TRL's SFT format: it was "has prompts but no answers", usable in step 3 only."""
    user = {"role": "user", "content": "Name a color."}
    answer = {"role": "assistant", "content": "Blue."}
    for name, records in (("plain", [{"prompt": "Name a color.", "completion": " Blue."}] * 2),
                          ("chat", [{"prompt": [user], "completion": [answer]}] * 2)):
        path = write_records(records, tmp_path / f"{name}.jsonl", "jsonl")
        adapter = raw(f"{path},{path}", tmp_path)
        adapter.check_usable(1)
        sample = adapter.get_train_data()[0]
        assert adapter.get_chosen_text(sample).strip() == "Blue." and adapter.get_rejected_text(sample) is None
        assert adapter.get_conversation(sample)[-1]["content"] == "Name a color."
    answerless = write_records([{"prompt": "Name a color."}] * 2, tmp_path / "prompts.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=r"no 'chosen' or 'completion' field.*--data_fields chosen=NAME"):
        raw(f"{answerless},{answerless}", tmp_path).check_usable(1)


@pytest.mark.parametrize("kind,labels", [("jsonl", [True, False]), ("parquet", [True, False]),
                                         ("csv", [True, False]), ("jsonl", ["true", "False"]), ("jsonl", [1, 0]),
                                         ("csv", [1, 0]), ("parquet", [1.0, 0.0])])
def test_unpaired_preference_labels_are_read_however_the_file_writes_them(tmp_path, kind, labels):
    """A CSV's label cells are text ("True"/"False"): they were not taken as labels, and every undesirable answer was
    trained on."""
    rows = [{"prompt": f"Q{i}?", "completion": f"A{i}", "label": labels[i % 2]} for i in range(4)]
    path = write_records(rows, tmp_path / f"kto.{kind}", kind)
    adapter = raw(f"{kind}:{path},{path}", tmp_path)
    marked = {adapter.get_chosen_text(s): adapter.is_undesirable(s) for s in adapter.get_train_data()}
    assert marked == {"A0": False, "A1": True, "A2": False, "A3": True}
    other = write_records([dict(r, label="positive") for r in rows], tmp_path / "other.jsonl", "jsonl")
    adapter = raw(f"{other},{other}", tmp_path)  # a label column of other values is data, not KTO's
    assert not any(adapter.is_undesirable(s) for s in adapter.get_train_data())
    unlabelled = write_records(rows[:3] + [dict(rows[3], label=None)], tmp_path / "null.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=r"line 4 \(record 3\): field 'label': missing or null"):
        raw(f"{unlabelled},{unlabelled}", tmp_path)  # (it made the whole file read as data without labels)


def test_csv_labels_written_as_floats_or_words_are_labels_and_a_bad_cell_names_its_line(tmp_path):
    """pandas writes a label column holding a null (NaN) as floats, "1.0"/"0.0": the column was read as data, not
    labels, and every undesirable answer was trained on without a word."""
    for labels in (["1.0", "0.0"], ["True", "False"], ["true", "false"], [" TRUE ", "0"]):
        path = tmp_path / "kto.csv"
        path.write_text("prompt,completion,label\n" + "".join(f"Q{i}?,A{i},{labels[i % 2]}\n" for i in range(4)))
        adapter = raw(f"csv:{path},{path}", tmp_path)
        assert [adapter.is_undesirable(s) for s in adapter.get_train_data()] == [False, True, False, True], labels
    floats = write_records([{"prompt": f"Q{i}?", "completion": f"A{i}", "label": [1.0, 0.0, None][i % 3]}
                            for i in range(4)], tmp_path / "nan.csv", "csv")
    with pytest.raises(DatasetFormatError, match=rf"{floats} line 4 \(record 2\): field 'label': missing or null"):
        raw(f"csv:{floats},{floats}", tmp_path)
    path.write_text("prompt,completion,label\nQ0?,A0,1.0\nQ1?,A1,False\nQ2?,A2,maybe\n")
    with pytest.raises(DatasetFormatError, match=rf"{path} line 4 \(record 2\): field 'label': 'maybe' is not a "
                                                 r"label"):
        raw(f"csv:{path},{path}", tmp_path)


def test_a_value_that_is_no_label_among_a_csvs_1_0_and_0_0_labels_names_its_line(tmp_path):
    """A "0.5" among them made the column data: every answer, those labelled 0.0 too, was trained on without a word."""
    path = tmp_path / "kto.csv"
    path.write_text("prompt,completion,label\nQ0?,A0,1.0\nQ1?,A1,0.0\nQ2?,A2,0.5\n")
    with pytest.raises(DatasetFormatError, match=rf"{path} line 4 \(record 2\): field 'label': '0.5' is not a label "
                                                 r"\(true/false, 1/0, 1\.0/0\.0 or yes/no\)"):  # (1.0/0.0 said too)
        raw(f"csv:{path},{path}", tmp_path)
    # a text in the label column (columns shifted by one) is quoted by its ends, not whole
    path.write_text("prompt,completion,label\nQ0?,A0,1.0\nQ1?,A1,0.0\nQ2?,A2," + "A long answer. " * 500 + "\n")
    with pytest.raises(DatasetFormatError, match=r"record 2\): field 'label': 'A long answer\. .* \(7,500 characters "
                                                 r"in all\) \.\.\. '.* A long answer\. ' is not a label") as raised:
        raw(f"csv:{path},{path}", tmp_path)
    assert len(str(raised.value)) < 500


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "csv"])
@pytest.mark.parametrize("score", [0.7, 2.0])
def test_a_score_among_a_float_columns_1_0_and_0_0_labels_is_its_records_error_in_any_file(tmp_path, kind, score):
    """A float label column (as pandas writes one holding a null) with a score among its 1.0/0.0: from CSV its record's
    error, but from JSON Lines or parquet the column was read as data, and every answer, those labelled 0.0 too, was
    trained on without a word."""
    rows = [{"prompt": f"Q{i}?", "completion": f"A{i}", "label": label} for i, label in enumerate([1.0, 0.0, score])]
    path = write_records(rows, tmp_path / f"kto.{kind}", kind)
    where = rf"{path} line 4 \(record 2\)" if kind == "csv" else rf"{path} line 3 \(record 2\)" if kind == "jsonl" \
        else rf"{path} record 2"
    with pytest.raises(DatasetFormatError, match=rf"{where}: field 'label': '?{score}'? is not a label"):
        raw(f"{kind}:{path},{path}", tmp_path)


def test_llama_factorys_kto_tag_column_is_the_labels(tmp_path):
    """LLaMA-Factory's KTO records (ShareGPT's conversations with a kto_tag) were read as SFT records, the kto_tag an
    extra column: the answers tagged false were trained on. The kto_tag is the labels (a bad one, its record's error);
    --data_fields label=NAME still names another column."""
    def tagged(answer, tag):
        return {"conversations": [{"from": "human", "value": "Q?"}, {"from": "gpt", "value": answer}], "kto_tag": tag}

    path = write_records([tagged("Good.", True), tagged("Bad.", False)], tmp_path / "kto.jsonl", "jsonl")
    adapter = raw(f"{path},{path}", tmp_path)
    assert {adapter.get_chosen_text(s): adapter.is_undesirable(s) for s in adapter.get_train_data()} == \
        {"Good.": False, "Bad.": True}
    path = write_records([tagged("Good.", True), tagged("Bad.", "maybe")], tmp_path / "typo.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=r"line 2 \(record 1\): field 'kto_tag': 'maybe' is not a label"):
        raw(path, tmp_path)


def test_unpaired_preference_labels_hold_under_renamed_fields_and_a_bad_one_is_its_records_error(tmp_path):
    """The labels were read only beside a field named "completion", and only where every value was one: renamed
    answers, a "yes"/"no" column or one typo left every undesirable answer to be trained on, without a word."""
    rows = [{"question": f"Q{i}?", "response": f"A{i}", "label": "yes" if i % 2 == 0 else "no"} for i in range(4)]
    path = write_records(rows, tmp_path / "kto.jsonl", "jsonl")
    adapter = raw(f"{path},{path}", tmp_path, prompt="question", chosen="response")
    assert {adapter.get_chosen_text(s): adapter.is_undesirable(s) for s in adapter.get_train_data()} == \
        {"A0": False, "A1": True, "A2": False, "A3": True}
    named = write_records([{"prompt": r["question"], "completion": r["response"], "good": r["label"] == "yes"}
                           for r in rows], tmp_path / "named.jsonl", "jsonl")
    adapter = raw(f"{named},{named}", tmp_path, label="good")
    assert [adapter.is_undesirable(s) for s in adapter.get_train_data()] == [False, True, False, True]
    with pytest.raises(DatasetFormatError, match=r"no 'goood' field, which --data_fields label=goood names"):
        raw(f"{named},{named}", tmp_path, label="goood")
    plain = write_records([{"prompt": "Q?", "completion": "A"}] * 2, tmp_path / "sft.jsonl", "jsonl")
    assert raw(f"{plain},{plain}", tmp_path, label="good").label_field is None  # an SFT file beside the KTO one
    # a category or flag column beside a plain chosen answer is data, as a category beside a completion
    for column in ([0, 1, 0, 1], [0, 1, 2, 3], ["math", "no", "code", "chat"]):
        flagged = write_records([{"prompt": f"Q{i}?", "chosen": f"A{i}", "label": v} for i, v in enumerate(column)],
                                tmp_path / "flag.jsonl", "jsonl")
        assert not any(raw(f"{flagged},{flagged}", tmp_path).is_undesirable(s) for s in
                       raw(f"{flagged},{flagged}", tmp_path).get_train_data())
    category = write_records([dict(r, label=v) for r, v in zip(rows, ["math", "no", "code", "chat"])],
                             tmp_path / "category.jsonl", "jsonl")
    assert raw(f"{category},{category}", tmp_path, prompt="question", chosen="response").label_field is None
    typo = write_records([dict(r, label=r["label"] == "yes") for r in rows[:3]] + [dict(rows[3], label="flase")],
                         tmp_path / "typo.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=r"line 4 \(record 3\): field 'label': 'flase' is not a label "
                                                 r"\(true/false, 1/0, 1\.0/0\.0 or yes/no\)"):
        raw(f"{typo},{typo}", tmp_path, prompt="question", chosen="response")


def test_answer_lists_that_repeat_the_prompt_are_read_and_ones_with_another_prompt_are_an_error(tmp_path):
    """ultrafeedback_binarized's chosen/rejected lists repeat the prompt field's turn before the answer; lists with
    other turns lost them without a word, and their answer was trained after the prompt field's."""
    def pair(question, lead):
        return {"prompt": question, "chosen": [{"role": "user", "content": lead}, {"role": "assistant", "content": "7"}],
                "rejected": [{"role": "user", "content": lead}, {"role": "assistant", "content": "8"}]}

    good = write_records([pair("What is 3+4?", "What is 3+4? ")] * 2, tmp_path / "uf.jsonl", "jsonl")
    adapter = raw(f"{good},{good}", tmp_path)
    sample = adapter.get_train_data()[0]
    assert adapter.get_conversation(sample) == [{"role": "user", "content": "What is 3+4?"}]
    assert (adapter.get_chosen_text(sample), adapter.get_rejected_text(sample)) == ("7", "8")
    # orca_dpo_pairs': a system message before the prompt in the lists only: the lists' turns are the conversation
    system = {"role": "system", "content": "Be exact."}
    orca = [{**pair("What is\r\n3+4?", "What is\n3+4?"), "rejected": "8"}] * 2
    orca[0]["chosen"] = [system, *orca[0]["chosen"]]
    adapter = raw(f"{write_records(orca, tmp_path / 'orca.jsonl', 'jsonl')},{tmp_path / 'orca.jsonl'}", tmp_path)
    sample = adapter.get_train_data()[0]
    assert adapter.get_conversation(sample) == [system, {"role": "user", "content": "What is\n3+4?"}]
    assert (adapter.get_chosen_text(sample), adapter.get_rejected_text(sample)) == ("7", "8")
    bad = write_records([pair("What is 3+4?", "What is 3+4?"), pair("Totally different", "What is 3+4?")],
                        tmp_path / "bad.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=r"line 2 \(record 1\): field 'chosen': its turns before the answer "
                                                 r"do not end with the prompt of field 'prompt'"):
        raw(f"{bad},{bad}", tmp_path)


def test_a_rejected_list_after_other_turns_than_the_chosen_answers_is_an_error(tmp_path):
    """Beside a prompt field, a rejected list whose turns before the prompt differ from the chosen list's (another
    system message, another earlier exchange) was trained after the chosen list's turns, its own dropped."""
    def message(role, content):
        return {"role": role, "content": content}

    def pair(chosen_lead, rejected_lead):
        question = message("user", "What is up?")
        return {"prompt": "What is up?", "chosen": [*chosen_lead, question, message("assistant", "Good.")],
                "rejected": [*rejected_lead, question, message("assistant", "Bad.")]}

    history = [message("user", "Hi"), message("assistant", "Hello")]
    same = write_records([pair(history, history)] * 2, tmp_path / "same.jsonl", "jsonl")
    adapter = raw(f"{same},{same}", tmp_path)
    sample = adapter.get_train_data()[0]
    assert adapter.get_conversation(sample) == [*history, message("user", "What is up?")]
    assert (adapter.get_chosen_text(sample), adapter.get_rejected_text(sample)) == ("Good.", "Bad.")
    for name, rejected_lead in (("history", [message("user", "Bye"), message("assistant", "Ciao")]),
                                ("system", [message("system", "Be rude."), *history]), ("none", [])):
        bad = write_records([pair(history, history), pair(history, rejected_lead)], tmp_path / f"{name}.jsonl", "jsonl")
        with pytest.raises(DatasetFormatError, match=r"line 2 \(record 1\): field 'rejected': its turns before the "
                                                     r"answer differ from those the chosen answer follows"):
            raw(f"{bad},{bad}", tmp_path)


def test_trimmed_keeps_a_code_blocks_indentation_only():
    from dschat.data.base import trimmed

    assert trimmed("    x = 1\n    y = 2\n") == "    x = 1\n    y = 2"
    assert trimmed(" x = 1\n    y = 2") == " x = 1\n    y = 2"  # relative indentation kept
    assert trimmed(" Sure.\n1. a") == "Sure.\n1. a"  # DeepSpeed-Chat's " answer"
    assert trimmed("  Sure.\nHere is how") == "Sure.\nHere is how"  # prose whose first line alone is indented
    assert trimmed("\n\n  hi  ") == "hi"


def test_code_answers_keep_their_indentation_and_a_system_preamble_reads_as_a_transcript(tmp_path):
    """An answer's first-line indentation was stripped (its code no longer lined up); a DeepSpeed-Chat-style prompt
    after a system message, as dschat itself writes one, was wrapped in a second Human/Assistant pair."""
    records = [{"prompt": "You are brief.\n\nHuman: Indent this.\n\nAssistant:", "chosen": "    x = 1\n    y = 2\n",
                "rejected": " Plain."}] * 2
    path = write_records(records, tmp_path / "code.jsonl", "jsonl")
    adapter = raw(f"JSONL:{path},{path}", tmp_path)  # (a type prefix in any case)
    sample = adapter.get_train_data()[0]
    assert adapter.get_conversation(sample) == [{"role": "system", "content": "You are brief."},
                                                {"role": "user", "content": "Indent this."}]
    assert adapter.get_prompt(sample) == records[0]["prompt"]
    assert (adapter.get_chosen_text(sample), adapter.get_rejected_text(sample)) == ("    x = 1\n    y = 2", "Plain.")


def test_trl_records_with_different_prompts_are_an_error(tmp_path):
    records = [{"chosen": [{"role": "user", "content": "A?"}, {"role": "assistant", "content": "a"}],
                "rejected": [{"role": "user", "content": "B?"}, {"role": "assistant", "content": "b"}]}]
    path = write_records(records, tmp_path / "bad.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=r"line 1 \(record 0\).*'rejected'.*prompt turns differ"):
        raw(path, tmp_path)
    # the same prompt, one copy written with \r\n: as with a prompt field, whitespace runs compare as one space
    records[0]["chosen"][0]["content"], records[0]["rejected"][0]["content"] = "Why\r\nnot?", "Why\nnot?"
    adapter = raw(write_records(records, tmp_path / "crlf.jsonl", "jsonl"), tmp_path)
    assert adapter.get_rejected_text(adapter.get_train_data()[0]) == "b"


def test_transcript_prompt_in_a_local_file(tmp_path):
    records = [{"prompt": "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: Bye?\n\nAssistant:", "chosen": " Bye!"}]
    path = write_records(records, tmp_path / "t.jsonl", "jsonl")
    adapter = raw(f"{path},{path}", tmp_path)
    sample = adapter.get_train_data()[0]
    assert [m["role"] for m in adapter.get_conversation(sample)] == ["user", "assistant", "user"]
    assert adapter.get_chosen_text(sample) == "Bye!"


def test_hh_rlhf_transcripts_in_a_local_file_read_as_the_hub_adapter_reads_them(tmp_path):
    # Anthropic/hh-rlhf's own jsonl files: chosen and rejected are whole transcripts, no prompt field
    row = {"chosen": "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: Name a color.\n\nAssistant: Blue.",
           "rejected": "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: Name a color.\n\nAssistant: Dog."}
    path = write_records([row], tmp_path / "hh.jsonl", "jsonl")
    local = raw(f"{path},{path}", tmp_path)
    hub = adapter_for(AnthropicHhrlhfDataset, tmp_path, {"train": [row], "test": [row]})
    for adapter in (local, hub):
        sample = adapter.get_train_data()[0]
        assert [m["role"] for m in adapter.get_conversation(sample)] == ["user", "assistant", "user"]
        assert (adapter.get_chosen_text(sample), adapter.get_rejected_text(sample)) == ("Blue.", "Dog.")
    plain = write_records([{"question": "Q?", "chosen": "a", "rejected": "b"}], tmp_path / "plain.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=r"line 1 \(record 0\): field 'chosen': a string without "
                                                 r"'Human:'/'Assistant:' turns that shares no beginning with "
                                                 r"'rejected': without a 'prompt' field"):
        raw(plain, tmp_path)


# --- bad input ---

def test_a_json_object_holding_the_records_under_a_key_says_so(tmp_path):
    # {"data": [...]} (load_dataset's field= layout) was "one record? put it in a JSON array", or on one line a record
    # of one column 'data', to be named with --data_fields
    records = [{"prompt": f"Q{i}?", "chosen": "Yes.", "rejected": "No."} for i in range(3)]
    for name, text, said in (("one_line.json", json.dumps({"data": records}),
                              "the records are in the list under 'data' of a JSON object; give a file that is that "
                              "list"),
                             ("indented.json", json.dumps({"version": "1.0", "data": records}, indent=1),
                              r"expected a JSON array of records, got a JSON object: if the records are the list "
                              r"under 'data', give a file that is that list \(or JSON Lines\); one record\? put it in a "
                              r"JSON array")):
        (tmp_path / name).write_text(text)
        with pytest.raises(DatasetFormatError, match=rf"{name}: {said}"):
            raw(f"json:{tmp_path / name}", tmp_path)
    (tmp_path / "record.json").write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                                                   {"role": "assistant", "content": "Yo"}]}))
    assert len(raw(f"json:{tmp_path / 'record.json'}", tmp_path).raw_datasets["train"]) == 1  # a record of its own


def test_a_one_line_json_object_holding_the_records_beside_other_fields_says_so(tmp_path):
    # {"version": ..., "data": [...]} (SQuAD's container, load_dataset's field= layout) written on one line was read as
    # one record of columns 'version' and 'data': "no 'prompt' ... field; name yours with --data_fields"
    records = [{"question": f"Q{i}?", "answer": "Yes.", "n": i if i else "zero"} for i in range(3)]  # (mixed n: Json)
    pairs = [{"prompt": r["question"], "chosen": r["answer"]} for r in records]
    sharegpt = [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]}]
    for name, rows, fields in (("squad.json", pairs, {}), ("squad.jsonl", pairs, {}),
                               ("renamed.jsonl", records, {"prompt": "question"}), ("sharegpt.json", sharegpt, {})):
        (tmp_path / name).write_text(json.dumps({"version": "1.1", "data": rows}) + "\n")
        with pytest.raises(DatasetFormatError, match=rf"{name}: the records are in the list under 'data' of a JSON "
                                                     r"object; give a file that is that list \(a JSON array of "
                                                     r"records\) or JSON Lines$"):
            raw(f"{tmp_path / name}", tmp_path, **fields)
    # a list of objects of other fields may hold the records: said beside the fields the file has
    squad = {"version": "1.1", "data": [{"title": "T", "paragraphs": []}]}
    (tmp_path / "real_squad.json").write_text(json.dumps(squad))
    with pytest.raises(DatasetFormatError, match=r"the records have \['version', 'data'\]\. Name yours with "
                                                 r"--data_fields.* \(the file is one record; if the records are its "
                                                 r"list under 'data', of objects with the fields \['paragraphs', "
                                                 r"'title'\], give a file that is that list"):
        raw(f"json:{tmp_path / 'real_squad.json'}", tmp_path)
    # a one-line record of its own with a list of objects (a tool list) is still a record
    tool = {"type": "function", "function": {"name": "get_weather"}}
    (tmp_path / "pair.json").write_text(json.dumps({"prompt": "Weather?", "chosen": "Sunny.", "tools": [tool]}))
    assert len(raw(f"json:{tmp_path / 'pair.json'}", tmp_path).raw_datasets["train"]) == 1


def test_a_json_object_of_split_lists_says_so_on_one_line_as_indented(tmp_path):
    # {"train": [...], "test": [...]} written by json.dump without indent was read as one JSON Lines record of columns
    # 'train' and 'test', to be named with --data_fields (indented, it was told the records are under 'train')
    records = [{"prompt": f"Q{i}?", "chosen": "Yes.", "rejected": "No."} for i in range(3)]
    for name, indent in (("one_line.json", None), ("indented.json", 1)):
        (tmp_path / name).write_text(json.dumps({"train": records, "test": records[:1]}, indent=indent))
        with pytest.raises(DatasetFormatError, match=rf"{name}: the records are in the lists under 'train', 'test' "
                                                     r"of a JSON object; give a file for each list .*TYPE:TRAIN_PATH,"
                                                     r"EVAL_PATH") as error:
            raw(f"json:{tmp_path / name}", tmp_path)
        assert "--data_fields" not in str(error.value)


def test_one_indented_record_with_a_list_of_objects_is_not_said_to_hold_records_under_it(tmp_path):
    # a record with a tool list ({"messages": [...], "tools": [{"type": "function", ...}]}, TRL's tool-calling data),
    # written with json.dumps(indent=...), was said to hold "the records in the list under 'tools'"
    tool = {"type": "function", "function": {"name": "get_weather"}}
    chat = {"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sunny."}],
            "tools": [tool]}
    (tmp_path / "chat.json").write_text(json.dumps(chat, indent=2))
    with pytest.raises(DatasetFormatError, match=r"chat.json: expected a JSON array of records, got a dict \(one "
                                                 r"record\? put it in a JSON array"):
        raw(f"json:{tmp_path / 'chat.json'}", tmp_path)
    pair = {"prompt": "Weather?", "chosen": "Sunny.", "rejected": "Rainy.", "tools": [tool]}
    (tmp_path / "pair.json").write_text(json.dumps(pair, indent=2))
    with pytest.raises(DatasetFormatError, match=r"pair.json: .*one record\? put it in a JSON array") as error:
        raw(f"json:{tmp_path / 'pair.json'}", tmp_path)
    assert "the records are in the list under 'tools'" not in str(error.value)


def test_a_messages_string_that_is_no_transcript_says_what_a_conversation_is(tmp_path):
    # it said "without a 'prompt' field, chosen and rejected must be whole conversations", of a record with neither
    path = write_records([{"messages": "Hello there"}], tmp_path / "chat.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=r"line 1 \(record 0\): field 'messages': a string without "
                                                 r"'Human:'/'Assistant:' turns: a conversation must be a list of "
                                                 r"messages") as error:
        raw(path, tmp_path)
    assert "chosen and rejected" not in str(error.value)


def test_a_message_list_that_is_empty_or_holds_a_number_says_so(tmp_path):
    """They said "expected a non-empty list of messages, got list" (of an empty one) and "message 0 has no text
    content" (of a 7)."""
    answer = {"role": "assistant", "content": "A."}
    for messages, said in (([], "expected a non-empty list of messages, got an empty list"),
                           ([{"role": "user", "content": 7}, answer], r"message 0's content is not text \(int\)"),
                           ([{"role": "user", "content": " "}, answer], "message 0 has no text content")):
        path = write_records([{"messages": [{"role": "user", "content": "Q?"}, answer]}, {"messages": messages}],
                             tmp_path / "chat.jsonl", "jsonl")
        with pytest.raises(DatasetFormatError, match=rf"line 2 \(record 1\): field 'messages': {said}$"):
            raw(f"{path},{path}", tmp_path)


def test_a_system_message_without_text_is_no_system_message(tmp_path):
    """SlimOrca's and LLaMA-Factory's records write a system prompt of "" where there is none: one such record made
    the whole file an error ("message 0 has no text content"). It is left out (as LLaMA-Factory reads it), ShareGPT's
    and OpenAI's form alike, and the turns of weight 0 after it are still the ones not trained."""
    empty_system = [{"from": "system", "value": ""}, {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]
    weighted = [{"role": "system", "content": " "}, {"role": "user", "content": "Q1"},
                {"role": "assistant", "content": "A1", "weight": 0}, {"role": "user", "content": "Q2"},
                {"role": "assistant", "content": "A2"}]
    path = write_records([{"conversations": empty_system}, {"conversations": weighted}], tmp_path / "slim.jsonl",
                         "jsonl")
    adapter = raw(f"{path},{path}", tmp_path)
    first, second = adapter.get_train_data()
    assert adapter.get_conversation(first) == [{"role": "user", "content": "Hi"}]
    assert adapter.get_chosen_text(first) == "Yo"
    assert adapter.get_conversation(second)[0] == {"role": "user", "content": "Q1"}
    assert adapter.get_untrained_turns(second) == {1}  # (A1, after Q1: the system message is not counted)
    path = write_records([{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " "},
                                        {"role": "assistant", "content": "A."}]}], tmp_path / "user.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=r"field 'messages': message 1 has no text content"):
        raw(path, tmp_path)  # (a user's turn without text is still an error)


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    lines = [json.dumps(RECORDS[0]), "", json.dumps(RECORDS[1]), '{"prompt": "x", "chosen": ']
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetFormatError, match=rf"{path} line 4: invalid JSON \(Expecting value at column 27\)"):
        raw(str(path), tmp_path)
    assert issubclass(DatasetFormatError, ValueError)
    path.write_text('{"prompt": "x\n')  # json's message ends in "at": said once
    with pytest.raises(DatasetFormatError,
                       match=r"line 1: invalid JSON \(Unterminated string starting at column 12\)$"):
        raw(str(path), tmp_path)
    # a JSON array given as JSON Lines (one line, or pretty-printed): said how to give it
    for text in (json.dumps(RECORDS[:2]), json.dumps(RECORDS[:2], indent=1)):
        path.write_text(text + "\n")
        with pytest.raises(DatasetFormatError, match=r"line 1: .*\(the file is one JSON array: give it as json:PATH\)"):
            raw(f"jsonl:{path}", tmp_path)


def test_a_file_that_is_not_utf8_names_file_and_line(tmp_path):
    # e.g. a Latin-1 export: an error naming the line, not a UnicodeDecodeError traceback
    lines = [json.dumps(r).encode() for r in RECORDS[:3]]
    lines[1] = lines[1].replace(b"Question", b"Qu\xe9stion")
    (tmp_path / "latin1.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DatasetFormatError, match=r"latin1.jsonl line 2: not UTF-8 text \(byte 0xe9 at column 15\)"):
        raw(str(tmp_path / "latin1.jsonl"), tmp_path)
    (tmp_path / "latin1.json").write_bytes(b"[\n" + b",\n".join(lines) + b"\n]\n")
    with pytest.raises(DatasetFormatError, match=r"latin1.json line 3: not UTF-8 text"):
        raw(str(tmp_path / "latin1.json"), tmp_path)
    (tmp_path / "latin1.csv").write_bytes(b"prompt,chosen,rejected\nHi,yes,no\nQu\xe9stion,yes,no\n")
    with pytest.raises(DatasetFormatError, match=r"latin1.csv line 3: not UTF-8 text.*save the file as UTF-8"):
        raw(f"csv:{tmp_path / 'latin1.csv'}", tmp_path)  # (pandas' error named a byte offset, no line)


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16"])
@pytest.mark.parametrize("kind", ["jsonl", "json", "csv"])
def test_a_utf16_file_is_told_it_is_not_utf8(tmp_path, kind, encoding):
    """A UTF-16 file without a byte-order mark decoded as UTF-8 (ASCII with a NUL after each character): a JSON file
    was "invalid JSON (... at column 2)", a CSV "Field "" does not exist in schema". With a mark or without, it is told
    by the NUL bytes among its first bytes."""
    text = {"jsonl": "".join(json.dumps(r) + "\n" for r in RECORDS[:2]), "json": json.dumps(RECORDS[:2]),
            "csv": "prompt,chosen,rejected\nHi,yes,no\n"}[kind]
    path = tmp_path / f"wide.{kind}"
    path.write_bytes(text.encode(encoding))
    with pytest.raises(DatasetFormatError, match=r"wide\.\w+: not UTF-8 text \(a NUL byte among its first 10 bytes: "
                                                 r"UTF-16\?\); save the file as UTF-8"):
        raw(f"{kind}:{path}", tmp_path)


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv"])
def test_a_utf8_byte_order_mark_is_not_part_of_the_first_record(tmp_path, kind):
    # Windows editors save UTF-8 with a BOM; JSON's parser refused the first line (CSV: pandas drops it, kept as a guard)
    train = tmp_path / f"bom_train.{kind}"
    train.write_bytes(b"\xef\xbb\xbf" + open(write_records(RECORDS[:15], train, kind), "rb").read())
    eval_ = write_records(RECORDS[15:], tmp_path / f"eval.{kind}", kind)
    adapter = raw(f"{kind}:{train},{eval_}", tmp_path)
    assert as_tuples(adapter, adapter.get_train_data()) == expected_tuples(RECORDS[:15])


@pytest.mark.parametrize("extension", [".gz", ".bz2", ".xz"])
def test_a_compressed_json_files_byte_order_mark_is_told_by_its_text_not_its_compressed_bytes(tmp_path, extension):
    """A JSON file's load tells its text's encoding by the first bytes read in its hash's open (``HashedFile.head``):
    of a file named compressed those are the compression's (gzip's 1f 8b), not the text's, so its text's byte-order
    mark must be read from the text (``text_encoding``): taken from the compressed bytes, a marked train.jsonl.gz was
    read as plain UTF-8, its first record refused (or its first key '\ufeffprompt')."""
    from dschat.data import reading

    train = tmp_path / f"bom_train.jsonl{extension}"
    with reading.DECOMPRESSORS[extension].open(train, "wb") as f:
        f.write(b"\xef\xbb\xbf" + open(write_records(RECORDS[:15], tmp_path / "train.jsonl", "jsonl"), "rb").read())
    eval_ = write_records(RECORDS[15:], tmp_path / "eval.jsonl", "jsonl")
    adapter = raw(f"jsonl:{train},{eval_}", tmp_path)
    assert as_tuples(adapter, adapter.get_train_data()) == expected_tuples(RECORDS[:15])


def test_unsupervised_text_files_with_a_byte_order_mark(tmp_path):
    from dschat.data.unsupervised import load_unsupervised_train

    (tmp_path / "docs.txt").write_bytes(b"\xef\xbb\xbfFirst line.\nSecond line.\n")
    (tmp_path / "docs.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "First."}).encode() + b"\n")
    assert load_unsupervised_train(str(tmp_path / "docs.txt"))[0][0] == {"text": "First line."}
    assert load_unsupervised_train(str(tmp_path / "docs.jsonl"))[0][0] == {"text": "First."}
    # text files joined with cat: the second one's mark began its first line's document, and was trained on
    (tmp_path / "joined.txt").write_bytes(b"\xef\xbb\xbfFirst line.\n\xef\xbb\xbfSecond file.\nThird \xef\xbb\xbfline.\n")
    assert load_unsupervised_train(str(tmp_path / "joined.txt"))[0]["text"] == \
        ["First line.", "Second file.", "Third \ufeffline."]


def test_an_unsupervised_text_file_is_searched_for_marks_without_reading_each_line_into_python(tmp_path, monkeypatch):
    """The search for byte-order marks read every line as a Python string, row by row (``lines["text"]``): a text file
    of a million lines took 6.9 s to load instead of 0.8, most often to find none."""
    from dschat.data.unsupervised import load_unsupervised_train

    def no_column_reads(self, key):
        assert not isinstance(key, str), f"column {key!r} read into Python"
        return original(self, key)

    (tmp_path / "plain.txt").write_text("First line.\nSecond line.\n")
    (tmp_path / "joined.txt").write_bytes(b"\xef\xbb\xbfFirst line.\n\xef\xbb\xbfSecond file.\n")
    original = Dataset.__getitem__
    monkeypatch.setattr(Dataset, "__getitem__", no_column_reads)
    plain, joined = (load_unsupervised_train(str(tmp_path / name))[0] for name in ("plain.txt", "joined.txt"))
    monkeypatch.undo()
    assert plain["text"] == ["First line.", "Second line."]
    assert joined["text"] == ["First line.", "Second file."]


def test_files_without_records_say_so(tmp_path):
    # CSV and parquet failed with datasets' own wording: 'Instruction "train" corresponds to no data!', 'BatchSize
    # must be greater than 0'
    # a file of blank lines alone (it has bytes) was "the file is empty", and a CSV of them "it has a header"
    files = {"empty.jsonl": ("", "the file is empty"), "empty.csv": ("", "the file is empty"),
             "blank.jsonl": ("\n \n\t\r\n", "it has only blank lines"),
             "blank.json": ("\n\n", "it has only blank lines"),
             "blank.csv": ("\n  \n\n", "it has only blank lines"),
             "header.csv": ("prompt,chosen,rejected\n\n", "it has a header but no rows")}
    for name, (text, _) in files.items():
        (tmp_path / name).write_text(text)
    no_rows = tmp_path / "empty.parquet"
    pd.DataFrame({"prompt": [], "chosen": []}).to_parquet(no_rows)
    for path, what in ((no_rows, "it has no rows"), *((tmp_path / name, what) for name, (_, what) in files.items())):
        with pytest.raises(DatasetFormatError, match=rf"{path}: no records \({what}\)"):
            raw(str(path), tmp_path)


def test_a_csv_records_error_names_its_line(tmp_path):
    # it said "record 1": the record is on line 5 (a quoted cell over two lines, a blank line)
    path = tmp_path / "bad.csv"
    path.write_text('prompt,chosen,rejected\n"a\nmultiline",b,c\n\nd,,f\n')
    with pytest.raises(DatasetFormatError, match=rf"{path} line 5 \(record 1\): field 'chosen': missing or null"):
        raw(str(path), tmp_path)


def test_a_csv_line_of_spaces_is_skipped_as_a_blank_line_before_the_header_too(tmp_path):
    # pandas skips a line of spaces (or tabs) as a blank one: a first such line was read as the header [''], and each
    # record refused with "3 cells, where the header names 1 columns"; a later one was counted as a record, so a
    # record's error said "record 1" with no line
    path = tmp_path / "spaced.csv"
    path.write_text("  \nprompt,chosen,rejected\nQ1,A1,B1\n \t\nQ2,A2,B2\n")
    adapter = raw(f"{path},{path}", tmp_path)
    assert [(adapter.get_conversation(s)[0]["content"], adapter.get_chosen_text(s), adapter.get_rejected_text(s))
            for s in adapter.get_train_data()] == [("Q1", "A1", "B1"), ("Q2", "A2", "B2")]
    path.write_text("\t\nprompt,chosen,rejected\nQ1,A1,B1\n   \nQ2,,B2\n")
    with pytest.raises(DatasetFormatError, match=rf"{path} line 5 \(record 1\): field 'chosen': missing or null"):
        raw(str(path), tmp_path)


def test_a_csv_written_with_crlf_line_ends_reads_as_the_lf_one(tmp_path):
    """A cell of a Windows CSV keeps its "\\r\\n"s: a prompt with a system message read as one user message (the
    transcript as its text), a transcript whose turn says "Human:" was cut there, and answers kept their "\\r"s."""
    records = [{"prompt": "Be brief.\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: What is 2+2?\n\nAssistant:",
                "chosen": "Four:\n2+2=4", "rejected": "Five"},
               {"prompt": "Human: Say 'Human: hi'\n\nAssistant: Human: hi\n\nHuman: Thanks\n\nAssistant:",
                "chosen": "You are welcome.", "rejected": "No"}]
    read = {}
    for line_end in ("\n", "\r\n"):
        path = tmp_path / f"{len(line_end)}.csv"
        pd.DataFrame([{k: v.replace("\n", line_end) for k, v in r.items()} for r in records]).to_csv(
            path, index=False, lineterminator=line_end)
        adapter = raw(f"{path},{path}", tmp_path)
        read[line_end] = [(adapter.get_conversation(s), adapter.get_chosen_text(s), adapter.get_rejected_text(s))
                          for s in adapter.get_train_data()]
    assert read["\r\n"] == read["\n"]
    assert read["\n"][0][0] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2+2?"}]


def test_a_csv_is_searched_for_crlf_line_ends_without_reading_each_cell_into_python(tmp_path, monkeypatch):
    """The search for "\\r\\n" read every column as Python strings, row by row (``data[name]``): a 300,000-record CSV
    took 7 s to load instead of 1, most often to find none."""
    from dschat.data.reading import load_file

    def no_column_reads(self, key):
        assert not isinstance(key, str), f"column {key!r} read into Python"
        return original(self, key)

    original = Dataset.__getitem__
    monkeypatch.setattr(Dataset, "__getitem__", no_column_reads)
    for line_end in ("\n", "\r\n"):
        path = tmp_path / f"{len(line_end)}.csv"
        pd.DataFrame([{"prompt": f"Q{i}{line_end}more", "chosen": "A", "rejected": None} for i in range(3)]).to_csv(
            path, index=False, lineterminator=line_end)
        data, _ = load_file("csv", str(path))
        rows = data.to_list()
        assert [row["prompt"] for row in rows] == [f"Q{i}\nmore" for i in range(3)]
        assert [row["rejected"] for row in rows] == [None] * 3


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_transcripts_written_with_crlf_line_ends_read_as_the_lf_ones(tmp_path, kind):
    """A JSON string or parquet cell holding a "\\r\\n" transcript: a system message before its first turn made the
    prompt one user message (the transcript as its text), and hh-rlhf's turns were cut where a turn says "Human:"."""
    records = [{"prompt": "Be brief.\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: What is 2+2?\n\nAssistant:",
                "chosen": "4", "rejected": "5"},
               {"prompt": "Human: Say 'Human: hi'\n\nAssistant: Human: hi\n\nHuman: Thanks\n\nAssistant:",
                "chosen": "You are welcome.", "rejected": "No"}]
    hh = [{"chosen": "\n\nHuman: Say 'Human: hi'\n\nAssistant: Human: hi",
           "rejected": "\n\nHuman: Say 'Human: hi'\n\nAssistant: Hi"}] * 2
    read = {}
    for line_end in ("\n", "\r\n"):
        read[line_end] = []
        for name, rows in (("prompts", records), ("hh", hh)):
            rows = [{k: v.replace("\n", line_end) for k, v in r.items()} for r in rows]
            path = write_records(rows, tmp_path / f"{name}{len(line_end)}.{kind}", kind)
            adapter = raw(f"{path},{path}", tmp_path)
            read[line_end] += [(adapter.get_conversation(s), adapter.get_chosen_text(s), adapter.get_rejected_text(s))
                               for s in adapter.get_train_data()]
    assert read["\r\n"] == read["\n"]
    assert read["\n"][0][0][0] == {"role": "system", "content": "Be brief."}


def test_a_csv_header_with_spaces_around_its_names_names_the_fields(tmp_path):
    """A header written "prompt, chosen, rejected" named the columns " chosen" and " rejected": step 1 said the file
    "has prompts but no answers", and "prompt ,chosen" made the records read as chosen/rejected conversations."""
    for header in ("prompt, chosen, rejected", "prompt ,chosen,rejected ", " prompt,\tchosen,rejected"):
        path = tmp_path / "spaced.csv"
        path.write_text(f"{header}\nQ?,A.,B.\nQ2?,A2.,B2.\n")
        adapter = raw(f"{path},{path}", tmp_path)
        adapter.check_usable(2)
        assert [(adapter.get_conversation(s)[0]["content"], adapter.get_chosen_text(s), adapter.get_rejected_text(s))
                for s in adapter.get_train_data()] == [("Q?", "A.", "B."), ("Q2?", "A2.", "B2.")], header
    path.write_text("prompt,chosen, chosen\nq,a,b\n")
    with pytest.raises(DatasetFormatError, match=r"the header names column 'chosen' twice \(columns 2 and 3\)"):
        raw(f"{path},{path}", tmp_path)


def test_a_csv_written_with_comma_space_reads_its_quoted_cells(tmp_path):
    """A quoted cell after ", " was read up to its next comma, quotes and all: 'Q, "Yes, sure"' was the chosen answer
    '"Yes' and the rejected one 'sure"', without a word (a row of another count of commas: pandas' "Expected 3 fields in
    line 3, saw 4")."""
    path = tmp_path / "spaced.csv"
    rows = 'prompt, chosen, rejected\nQ1?, "Yes, sure.", "No, never."\nQ2?, "Yes, sure"\nQ3?, "Two\nlines", No\n'
    path.write_text(rows)
    adapter = raw(f"{path},{path}", tmp_path)
    assert [(adapter.get_chosen_text(s), adapter.get_rejected_text(s)) for s in adapter.get_train_data()] == \
        [("Yes, sure.", "No, never."), ("Yes, sure", None), ("Two\nlines", "No")]
    path.write_text(rows + "\nQ4?, , No\n")  # (its line counted after the quoted cell of two lines)
    with pytest.raises(DatasetFormatError, match=rf"{path} line 7 \(record 3\): field 'chosen': missing or null"):
        raw(f"{path},{path}", tmp_path)


def test_a_csv_record_with_more_cells_than_the_header_names_its_line(tmp_path):
    """pandas took the first record's extra cell for an index column: an unquoted comma in the first record, or a comma
    ending every line, read each record's cells under the next names (its chosen answer as its prompt), silently; a
    later record's extra cell was pandas' own error, "Expected 3 fields in line 5, saw 4", also for a comma ending
    that line alone, which the first line may end with."""
    path = tmp_path / "cells.csv"
    path.write_text("prompt,chosen,rejected\n\nQ1, with a comma,A1,B1\nQ2,A2,B2\n")
    with pytest.raises(DatasetFormatError, match=rf"{path} line 3: 4 cells, where the header names 3 columns; quote a "
                                                 r"cell holding a comma"):
        raw(f"{path},{path}", tmp_path)
    path.write_text("prompt,chosen,rejected\nQ1,A1,B1,\nQ2,A2,B2, \n")  # (a comma ending each line: no cell)
    adapter = raw(f"{path},{path}", tmp_path)
    assert [(adapter.get_conversation(s)[0]["content"], adapter.get_chosen_text(s), adapter.get_rejected_text(s))
            for s in adapter.get_train_data()] == [("Q1", "A1", "B1"), ("Q2", "A2", "B2")]
    for rows in ("Q1,A1,B1\nQ2,A2,B2,\nQ3,A3,B3\n", "Q1,A1,B1,\nQ2,A2,B2\nQ3,A3,B3,,\n"):  # (on some lines only)
        path.write_text("prompt,chosen,rejected\n" + rows)
        adapter = raw(f"{path},{path}", tmp_path)
        assert [(adapter.get_conversation(s)[0]["content"], adapter.get_chosen_text(s), adapter.get_rejected_text(s))
                for s in adapter.get_train_data()] == [("Q1", "A1", "B1"), ("Q2", "A2", "B2"), ("Q3", "A3", "B3")]
    path.write_text("prompt,chosen,rejected\nQ1,A1,B1\nQ2,A2,B2\n\nQ3, with a comma,A3,B3\n")
    with pytest.raises(DatasetFormatError, match=rf"{path} line 5: 4 cells, where the header names 3 columns; quote a "
                                                 r"cell holding a comma"):
        raw(f"{path},{path}", tmp_path)


def test_a_csv_row_that_repeats_the_header_names_its_line(tmp_path):
    """Two CSV files joined with ``cat`` put the second one's header among the records: it was trained on as a record,
    "prompt" answered with "chosen"."""
    part = "prompt,chosen,rejected\nQ?,A.,B.\nQ2?,A2.,B2.\n"
    path = tmp_path / "joined.csv"
    path.write_text(part + "\ufeff" + part.replace("\n", "\r\n"))  # (the second written on Windows)
    with pytest.raises(DatasetFormatError, match=rf"{path} line 4: the row repeats the header "
                                                 r"\(prompt,chosen,rejected\); CSV files joined with their headers\?"):
        raw(f"{path},{path}", tmp_path)


def test_a_csvs_records_are_compared_with_its_header_only_where_they_could_repeat_it(tmp_path, monkeypatch):
    """Each cell of each record was stripped and compared with the header's names, a Python loop over every cell of
    a large file: a record is compared only where it has the header's length and first name."""
    from dschat.data import reading

    calls = []
    name = reading._column_name
    monkeypatch.setattr(reading, "_column_name", lambda cell: calls.append(cell) or name(cell))
    path = tmp_path / "big.csv"
    path.write_text("prompt,chosen,rejected\n" + "".join(f"Q{i}?,A{i}.,B{i}.\n" for i in range(100)))
    assert reading.csv_record_lines(str(path))[1] == list(range(2, 102))
    assert len(calls) <= 2 * 100 + 10  # (the first cell of each and its header name; it was 6 a record)
    path.write_text("prompt,chosen,rejected\nQ?,A.,B.\n prompt , chosen,rejected\n")
    with pytest.raises(DatasetFormatError, match=rf"{path} line 3: the row repeats the header"):
        reading.csv_record_lines(str(path))


def test_a_csv_separated_by_semicolons_or_tabs_says_so(tmp_path):
    """It read as one column, and the error said to name the fields with --data_fields."""
    path = tmp_path / "excel.csv"
    for separator in (";", "\t"):
        path.write_text(separator.join(["prompt", "chosen", "rejected"]) + "\n" + separator.join("QAB") + "\n")
        with pytest.raises(DatasetFormatError, match=rf"{path}: the header is one column, .*: the file is separated by "
                                                     rf"{re.escape(repr(separator))}, not commas; save it as "
                                                     "comma-separated CSV"):
            raw(f"{path},{path}", tmp_path)


def test_a_csv_header_naming_a_column_twice_is_an_error(tmp_path):
    """pandas read the second "chosen" as an extra column "chosen.1": its answers went unread, silently."""
    path = tmp_path / "twice.csv"
    path.write_text("\ufeffprompt,chosen,chosen\nq,a,b\nr,c,d\n", encoding="utf-8")
    with pytest.raises(DatasetFormatError, match=rf"{path}: the header names column 'chosen' twice \(columns 2 and "
                                                 r"3\); give each column its own name"):
        raw(f"{path},{path}", tmp_path)


def test_message_lists_in_csv_cells_as_json_text_are_read(tmp_path):
    # a CSV holds no lists: the JSON text was taken for a Human/Assistant transcript and refused (messages), or
    # trained on as the raw JSON string (TRL's conversational prompt/chosen/rejected)
    user, answer = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}
    path = write_records([{"messages": json.dumps([user, answer])}] * 2, tmp_path / "chat.csv", "csv")
    adapter = raw(f"{path},{path}", tmp_path)
    sample = adapter.get_train_data()[0]
    assert (adapter.get_conversation(sample), adapter.get_chosen_text(sample)) == ([user], "Hello")
    pairs = write_records([{"prompt": json.dumps([user]), "chosen": json.dumps([answer]),
                            "rejected": json.dumps([{"role": "assistant", "content": "Bye"}])}] * 2,
                          tmp_path / "pairs.csv", "csv")
    adapter = raw(f"{pairs},{pairs}", tmp_path)
    sample = adapter.get_train_data()[0]
    assert (adapter.get_conversation(sample), adapter.get_chosen_text(sample), adapter.get_rejected_text(sample)) \
        == ([user], "Hello", "Bye")
    plain = write_records([{"prompt": "[1, 2, 3]", "chosen": "6", "rejected": "5"}] * 2, tmp_path / "sum.csv", "csv")
    adapter = raw(f"{plain},{plain}", tmp_path)  # text that reads as JSON but holds no messages stays text
    assert adapter.get_conversation(adapter.get_train_data()[0]) == [{"role": "user", "content": "[1, 2, 3]"}]


def test_message_lists_in_csv_cells_as_indented_json_text_are_read(tmp_path):
    # json.dumps(indent=...) writes "[\n {": such a cell was read as the raw JSON string, a prompt and answers of text
    user, answer = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}
    pairs = write_records([{"prompt": json.dumps([user], indent=1), "chosen": json.dumps([answer], indent=2),
                            "rejected": json.dumps([{"role": "assistant", "content": "Bye"}], indent=1)}] * 2,
                          tmp_path / "pairs.csv", "csv")
    adapter = raw(f"{pairs},{pairs}", tmp_path)
    sample = adapter.get_train_data()[0]
    assert (adapter.get_conversation(sample), adapter.get_chosen_text(sample), adapter.get_rejected_text(sample)) \
        == ([user], "Hello", "Bye")


def test_message_lists_in_csv_cells_written_as_python_are_an_error(tmp_path):
    # pandas' to_csv writes a list column as Python ("[{'role': 'user', ...}]"): it was trained on as text
    user, answer = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}
    pairs = tmp_path / "pairs.csv"
    pd.DataFrame([{"prompt": [user], "chosen": [answer], "rejected": [answer | {"content": "Bye"}]}] * 2).to_csv(
        pairs, index=False)
    with pytest.raises(DatasetFormatError, match=r"pairs.csv line 2 \(record 0\): field 'prompt': a message list "
                                                 r"written as Python, not JSON"):
        raw(f"{pairs},{pairs}", tmp_path)
    chat = tmp_path / "chat.csv"
    pd.DataFrame([{"messages": [user, answer]}] * 2).to_csv(chat, index=False)
    with pytest.raises(DatasetFormatError, match=r"field 'messages': a message list written as Python"):
        raw(f"{chat},{chat}", tmp_path)
    plain = write_records([{"prompt": "[{'city': 'Paris'}] or [{'city': 'Oslo'}]?", "chosen": "Paris",
                            "rejected": "Oslo"}] * 2, tmp_path / "cities.csv", "csv")
    adapter = raw(f"{plain},{plain}", tmp_path)  # Python text that holds no messages stays text
    assert adapter.get_chosen_text(adapter.get_train_data()[0]) == "Paris"


@pytest.mark.parametrize("kind", ["jsonl", "csv"])
def test_text_of_json_objects_that_are_no_messages_stays_text(tmp_path, kind):
    """An answer that is JSON objects (a tool call) or a prompt that is a JSON record list is text, not a message list
    refused for its "role None"; JSON text of messages with a bad role is still its record's error."""
    call = json.dumps([{"name": "get_weather", "arguments": {"city": "Paris"}}])
    table = json.dumps([{"city": "Paris", "temp": 21, "value": 3}, {"city": "Oslo", "temp": 9, "content": "x"}])
    path = write_records([{"prompt": f"Warmest? {i}", "chosen": call, "rejected": "Paris."} for i in range(2)]
                         + [{"prompt": table, "chosen": "Paris", "rejected": call}], tmp_path / f"tools.{kind}", kind)
    adapter = raw(f"{path},{path}", tmp_path)
    samples = list(adapter.get_train_data())
    assert [adapter.get_chosen_text(s) for s in samples] == [call, call, "Paris"]
    assert adapter.get_conversation(samples[2]) == [{"role": "user", "content": table}]
    assert adapter.get_rejected_text(samples[2]) == call
    bad = write_records([{"prompt": "Hi", "chosen": json.dumps([{"role": "bot", "content": "Hello"}])}] * 2,
                        tmp_path / f"bad.{kind}", kind)
    with pytest.raises(DatasetFormatError, match=r"field 'chosen': message 0 has role 'bot'"):
        raw(f"{bad},{bad}", tmp_path)


def test_a_file_mixing_record_shapes_says_so(tmp_path):
    chat = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
    rows = [{"prompt": "a", "chosen": "b", "rejected": "c"}] * 2 + [chat]
    path = write_records(rows, tmp_path / "mixed.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=r"line 3 \(record 2\): field 'prompt': missing or null \(it has "
                                                 r"'messages' instead: the file mixes record shapes"):
        raw(f"{path},{path}", tmp_path)
    sft = write_records([chat] * 2 + [{"prompt": "a", "chosen": "b"}], tmp_path / "sft.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=r"line 3 \(record 2\): field 'messages': missing or null \(it has "
                                                 r"'prompt' instead: the file mixes record shapes"):
        raw(f"{sft},{sft}", tmp_path)
    pairs = [{"prompt": "a", "chosen": "b", "rejected": "c", "messages": chat["messages"]}] * 2
    one_null = write_records(pairs + [dict(pairs[0], chosen=None)], tmp_path / "uf.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError) as refused:  # one shape: no hint of mixed shapes
        raw(f"{one_null},{one_null}", tmp_path)
    assert "field 'chosen': missing or null" in str(refused.value) and "mixes" not in str(refused.value)


def test_a_json_object_writing_a_key_twice_names_its_record(tmp_path):
    """json keeps a key's last value: a .json record's first "prompt" was lost without a word, and pyarrow refused a
    JSON Lines message writing "content" twice with "field 'messages': expected a non-empty list of messages"."""
    path = tmp_path / "twice.json"
    path.write_text(json.dumps(RECORDS[:2], indent=1).replace('"chosen": "Good answer 1."',
                                                              '"prompt": "Another question?", "chosen": "Good answer 1."'))
    with pytest.raises(DatasetFormatError, match=rf"{path} record 1: an object writes the key 'prompt' twice \(JSON "
                                                 r"keeps only its last value\); write each key once"):
        raw(f"{path},{path}", tmp_path)
    path = tmp_path / "twice.jsonl"
    user = '{"role": "user", "content": "Hi", "content": "Hello"}'
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]})
                    + f'\n{{"messages": [{user}, {{"role": "assistant", "content": "A"}}]}}\n')
    with pytest.raises(DatasetFormatError, match=rf"{path} line 2: an object writes the key 'content' twice"):
        raw(f"{path},{path}", tmp_path)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_in_a_json_record_names_file_record_and_field(tmp_path, constant):
    """Python's json.dumps writes a float NaN as NaN, which is no JSON: JSON Lines read it as a float ("expected a
    string, got float"), a JSON array as null ("missing or null"). Both now say what it is, at its record and field."""
    records = [dict(RECORDS[0]), dict(RECORDS[1], rejected=float(constant.replace("Infinity", "inf")))]
    said = (rf"field 'rejected': {constant} is not a JSON value \(Python's json.dumps writes a float NaN or infinity "
            r"so\); write null for a missing value, or text")
    path = tmp_path / "nan.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(DatasetFormatError, match=rf"{path} line 2 \(record 1\): {said}"):
        raw(f"{path},{path}", tmp_path)
    path = tmp_path / "nan.json"
    path.write_text(json.dumps(records, indent=1))
    with pytest.raises(DatasetFormatError, match=rf"{path} record 1: {said}"):
        raw(f"{path},{path}", tmp_path)
    path.write_text(json.dumps([{"messages": [{"role": "user", "content": "Q"},
                                              {"role": "assistant", "content": float("nan")}]}]))
    with pytest.raises(DatasetFormatError, match=rf"{path} record 0: field 'messages': NaN is not a JSON value"):
        raw(f"{path},{path}", tmp_path)


def test_json_records_are_walked_for_nan_only_where_the_file_holds_one(tmp_path, monkeypatch):
    """Every value of every record was walked in Python for a NaN: checking a 300,000-line JSON Lines file took 2.2 s,
    its parse 0.6 s."""
    from dschat.data import reading

    walked = []
    walk = reading._not_json_number_in
    monkeypatch.setattr(reading, "_not_json_number_in", lambda value: walked.append(value) or walk(value))
    clean = [dict(RECORDS[0]), dict(RECORDS[1])]
    (tmp_path / "clean.jsonl").write_text("".join(json.dumps(r) + "\n" for r in clean))
    (tmp_path / "clean.json").write_text(json.dumps(clean))
    assert list(reading.check_jsonl_lines(str(tmp_path / "clean.jsonl"))) == [1, 2]
    assert reading.check_json_document(str(tmp_path / "clean.json")) is None
    assert walked == []
    (tmp_path / "nan.jsonl").write_text("".join(json.dumps(r) + "\n" for r in clean + [dict(RECORDS[2], task=float("nan"))]))
    with pytest.raises(DatasetFormatError, match=r"line 3 \(record 2\): field 'task': NaN is not a JSON value"):
        reading.check_jsonl_lines(str(tmp_path / "nan.jsonl"))


def test_a_pair_answer_of_weight_0_is_an_error(tmp_path):
    """OpenAI's "weight": 0 says which turns of a conversation not to train; on a pair's answer (TRL's preference lists)
    it was read without a word, the answer trained on as any other."""
    prompt = [{"role": "user", "content": "Q?"}]
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"chosen": prompt + [{"role": "assistant", "content": "A.", "weight": 1}],
                                "rejected": prompt + [{"role": "assistant", "content": "B."}]}) + "\n" +
                    json.dumps({"chosen": prompt + [{"role": "assistant", "content": "A."}],
                                "rejected": prompt + [{"role": "assistant", "content": "B.", "weight": 0}]}) + "\n")
    with pytest.raises(DatasetFormatError, match=rf"{path} line 2 \(record 1\): field 'rejected': its answer \(message "
                                                 r"1\) has weight 0: a weight says which turns of a 'messages' "
                                                 "conversation to train"):
        raw(f"{path},{path}", tmp_path)
    path.write_text(json.dumps({"prompt": "Q?", "chosen": [{"role": "assistant", "content": "A.", "weight": "0"}],
                                "rejected": "B."}) + "\n")
    with pytest.raises(DatasetFormatError, match=r"field 'chosen': message 0 has weight '0': a weight is 0 \(the turn "
                                                 r"is not trained\) or 1, as in OpenAI's fine-tuning format"):
        raw(f"{path},{path}", tmp_path)


def test_a_json_file_of_json_lines_is_checked_a_line_at_a_time_not_read_whole(tmp_path):
    """A .json file that is JSON Lines (allenai/c4's shards, c4-train.00000-of-01024.json.gz, ~800 MB decompressed;
    stanfordnlp/SHP's files) was read whole into memory, to be told from one JSON document by a parse that failed,
    then checked a line at a time. Its first line, a whole object with more lines after it, says so now: the whole
    text is never held. The same file's checks say what they said (its bad line by number)."""
    import gzip
    import tracemalloc

    from dschat.data import reading

    rows = [json.dumps({"text": f"document {i} " + "word " * 200, "url": f"https://x/{i}"}) for i in range(4000)]
    path = tmp_path / "c4-train.00000-of-00001.json.gz"
    path.write_bytes(gzip.compress("\n".join(rows).encode() + b"\n"))
    size = sum(len(row) + 1 for row in rows)
    tracemalloc.start()
    try:
        assert list(reading.check_json_document(str(path))) == list(range(1, 4001))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < size / 4, (peak, size)
    path.write_bytes(gzip.compress("\n".join([*rows[:2], '{"text": "cut', *rows[2:4]]).encode()))
    with pytest.raises(DatasetFormatError, match=r"json\.gz line 3: invalid JSON \(Unterminated string"):
        reading.check_json_document(str(path))


def test_the_record_lines_of_a_json_lines_file_without_gaps_are_held_as_a_range(tmp_path):
    """Each record's line number was held as a Python int in a list, ~36 bytes a record, for the whole run (and every
    shard's at once while a split's shards were read: ~13 GB for allenai/c4's en, 365M records, each process). Lines
    without a gap, a file of no blank lines, are held as a range now; a file with blank lines keeps its list, and
    errors name the line either way."""
    import tracemalloc

    from dschat.data import reading

    path = tmp_path / "many.jsonl"
    path.write_text("".join(f'{{"prompt": "q{i}", "chosen": "a", "rejected": "b"}}\n' for i in range(50000)))
    tracemalloc.start()
    try:
        lines = reading.check_jsonl_lines(str(path))
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert (len(lines), lines[0], lines[-1]) == (50000, 1, 50000)
    assert held < 50000, held
    path.write_text(path.read_text().replace("\n", "\n\n", 2))  # (blank lines after records 1 and 2)
    assert list(reading.check_jsonl_lines(str(path))[:4]) == [1, 3, 5, 6]
    path.write_text("".join(f'{{"prompt": "q{i}", "chosen": "a", "rejected": "b"}}\n' for i in range(30)) +
                    '{"prompt": "q", "chosen": 7, "rejected": "b"}\n')
    with pytest.raises(DatasetFormatError, match=rf"{path} line 31 \(record 30\): field 'chosen'"):
        raw(f"{path},{path}", tmp_path)


def test_malformed_json_document_names_line(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[\n {"prompt": "a", "chosen": "b"},\n {"prompt": "c" "chosen": "d"}\n]\n')
    with pytest.raises(DatasetFormatError, match=rf"{path} line 3"):
        raw(str(path), tmp_path)


def test_a_json_file_of_one_json_lines_record_is_that_record(tmp_path):
    """A .json file holding one record on one line is JSON Lines of one record, as datasets reads it (it was refused
    as "expected a JSON array", while two such lines were read); a pretty-printed lone object is told to be an
    array."""
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"prompt": "Is it one?", "chosen": "Yes.", "rejected": "No."}) + "\n")
    adapter = raw(str(path), tmp_path)
    records = list(adapter.get_train_data())
    assert len(records) == 1 and "Is it one?" in adapter.get_prompt(records[0])
    assert adapter.get_chosen(records[0]).strip() == "Yes."
    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps({"prompt": "Is it one?", "chosen": "Yes."}, indent=1))
    with pytest.raises(DatasetFormatError, match=r"expected a JSON array of records, got a dict \(one record\? put "
                                                 r"it in a JSON array"):
        raw(str(pretty), tmp_path)


def test_empty_text_names_file_line_record_and_field(tmp_path):
    records = [dict(r) for r in RECORDS[:4]]
    records[2]["chosen"] = "   "
    path = tmp_path / "empty.jsonl"
    path.write_text("\n" + "".join(json.dumps(r) + "\n" for r in records))  # leading blank line
    with pytest.raises(DatasetFormatError, match=rf"{path} line 4 \(record 2\): field 'chosen': empty text"):
        raw(str(path), tmp_path)


def test_missing_field_names_file_record_and_field(tmp_path):
    records = [dict(r) for r in RECORDS[:4]]
    records[1]["prompt"] = None
    path = write_records(records, tmp_path / "missing.parquet", "parquet")
    with pytest.raises(DatasetFormatError, match=rf"{path} record 1: field 'prompt': missing or null"):
        raw(path, tmp_path)


def test_wrong_type_names_file_record_and_field(tmp_path):
    records = [{"prompt": "q", "chosen": 7}, {"prompt": "q2", "chosen": 8}]
    path = write_records(records, tmp_path / "typed.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=r"line 1 \(record 0\): field 'chosen': expected a string, got int"):
        raw(path, tmp_path)


def test_csv_columns_are_text_and_only_empty_cells_null(tmp_path):
    path = tmp_path / "numeric.csv"
    path.write_text("prompt,chosen,rejected\nWhat is 2 plus 3?,5,6\nWhat is 0.5 doubled?,1.0,007\nSay hi.,hi,\n"
                    "Abbreviate not applicable.,NA,None\n")
    adapter = raw(f"csv:{path},{path}", tmp_path)
    data = adapter.get_train_data()
    assert [(adapter.get_chosen_text(s), adapter.get_rejected_text(s)) for s in data] == \
        [("5", "6"), ("1.0", "007"), ("hi", None), ("NA", "None")]  # text as written; only an empty cell is null


def test_a_late_wrongly_typed_json_value_is_reported_at_its_own_line(tmp_path):
    records = [dict(r) for r in RECORDS]
    records[2]["chosen"] = "1"  # strings that are valid JSON must stay strings
    records[3]["prompt"] = "null"
    records[4]["prompt"] = [{"role": "user", "content": "Hi"}]  # a prompt may be a string or a message list
    records[5]["task"] = 3  # a mixed extra column is passed through as written
    path = write_records(records, tmp_path / "mixed.jsonl", "jsonl")
    adapter = raw(f"{path},{path}", tmp_path)
    data = adapter.get_train_data()
    assert adapter.get_chosen_text(data[2]) == "1" and adapter.get_conversation(data[3])[0]["content"] == "null"
    assert adapter.get_conversation(data[4]) == [{"role": "user", "content": "Hi"}]
    assert [adapter.get_extra(s)["task"] for s in data][4:7] == ["t1", 3, "t0"]
    records[15]["chosen"] = 42
    path = write_records(records, tmp_path / "late.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=r"late.jsonl line 16 \(record 15\): field 'chosen': expected a "
                                                 r"string, got int"):
        raw(path, tmp_path)


def test_read_errors_name_their_cause(tmp_path):
    empty_csv = tmp_path / "empty.csv"
    empty_csv.write_text("")
    with pytest.raises(DatasetFormatError, match=rf"{empty_csv}: no records \(the file is empty\)"):
        raw(f"csv:{empty_csv}", tmp_path)
    jsonl = write_records([*RECORDS[:2], {**RECORDS[2], "more": "x"}], tmp_path / "data.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=rf"{jsonl} line 3: 5 cells, where the header names 4 columns"):
        raw(f"csv:{jsonl}", tmp_path)
    unclosed = tmp_path / "unclosed.csv"
    unclosed.write_text('prompt,chosen,rejected\nQ,A,B\nQ2,"A2,B2\n')
    with pytest.raises(DatasetFormatError, match=r"could not be read as csv: An error occurred while generating "
                                                 r"the dataset: Error tokenizing data"):  # the cause, not only that
        raw(f"csv:{unclosed}", tmp_path)
    empty_json = tmp_path / "empty.json"
    empty_json.write_text("\n")
    with pytest.raises(DatasetFormatError, match=rf"{empty_json}: no records \(it has only blank lines\)"):
        raw(str(empty_json), tmp_path)


def test_jsonl_strings_may_hold_raw_unicode_line_separators(tmp_path):
    # ensure_ascii=False writes U+2028/U+2029/U+0085 raw inside strings; only "\n" ends a JSONL record
    records = [{**RECORDS[0], "prompt": "one\u2028two\u2029three\x85four"}, {**RECORDS[1], "task": 5}]
    path = tmp_path / "separators.jsonl"  # the mixed "task" column is read back record by record
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    adapter = raw(f"{path},{path}", tmp_path)
    data = adapter.get_train_data()
    assert [adapter.get_conversation(s)[0]["content"] for s in data] == [r["prompt"] for r in records]
    assert [adapter.get_extra(s)["task"] for s in data] == ["t0", 5]
    records[1]["chosen"] = 42  # a bad record after the separators is reported at its own line
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    with pytest.raises(DatasetFormatError, match=r"line 2 \(record 1\): field 'chosen': expected a string, got int"):
        raw(f"{path},{path}", tmp_path)


def test_bad_message_list_is_an_error(tmp_path):
    records = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "robot", "content": "beep"}]}]
    path = write_records(records, tmp_path / "roles.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=r"record 0\): field 'messages': message 1 has role 'robot'"):
        raw(path, tmp_path)


def test_openai_developer_and_gemma_model_roles_are_system_and_assistant(tmp_path):
    """OpenAI's "developer" (its newer name of "system") and Gemma's "model" (the assistant) were "message 0 has role
    'developer'": they are read as the roles they name (an empty developer message, as an empty system one, is none)."""
    records = [{"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                             {"role": "model", "content": "Hello"}]},
               {"messages": [{"role": "developer", "content": ""}, {"role": "user", "content": "Yo"},
                             {"role": "model", "content": "Hey"}]}]
    path = write_records(records, tmp_path / "roles.jsonl", "jsonl")
    adapter = raw(f"{path},{path}", tmp_path)
    first, second = adapter.get_train_data()
    assert adapter.get_conversation(first) == [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Hi"}]
    assert adapter.get_chosen_text(first) == "Hello"
    assert adapter.get_conversation(second) == [{"role": "user", "content": "Yo"}]
    assert adapter.get_chosen_text(second) == "Hey"


def test_an_empty_system_message_is_told_by_the_role_the_message_is_read_with(tmp_path):
    """ShareGPT's speakers were resolved twice: once to read a message (its role by its canonical name: "developer" as
    "system") and once to tell an empty system message, without the aliases; a ShareGPT "developer" turn without text
    was "message 0 has no text content" where an OpenAI one is no message. One resolution reads both alike."""
    records = [{"conversations": [{"from": speaker, "value": ""}, {"from": "human", "value": "Hi"},
                                  {"from": "gpt", "value": "Hello"}]} for speaker in ("developer", "system")]
    records.append({"conversations": [{"from": "developer", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                      {"from": "model", "value": "Hello"}]})
    path = write_records(records, tmp_path / "sharegpt.jsonl", "jsonl")
    adapter = raw(f"{path},{path}", tmp_path)
    first, second, third = adapter.get_train_data()
    assert adapter.get_conversation(first) == adapter.get_conversation(second) == [{"role": "user", "content": "Hi"}]
    assert adapter.get_conversation(third) == [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Hi"}]
    assert adapter.get_chosen_text(first) == adapter.get_chosen_text(third) == "Hello"


CALL = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}


@pytest.mark.parametrize("messages, said", [
    ([{"role": "assistant", "content": None, "function_call": {"name": "weather", "arguments": "{}"},
       "tool_calls": [CALL]}], r"message 1 has both function_call and tool_calls; give its calls once"),
    ([{"role": "user", "content": "Now.", "function_call": {"name": "weather", "arguments": "{}"}}],
     r"message 1 has function_call but role 'user'; only an assistant turn calls functions"),
    ([{"role": "assistant", "content": None, "function_call": {"arguments": "{}"}}],
     r"message 1 has a tool call without a function name"),
    ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": {}}}]},
      {"role": "tool", "content": "Sunny."}, {"role": "assistant", "content": "Sunny."}],
     r"message 1 has a tool call without a function name"),
    ([{"role": "tool", "content": "Sunny.", "tool_calls": [CALL]}, {"role": "assistant", "content": "Sunny."}],
     r"message 1 has tool_calls but role 'tool'; only an assistant turn calls tools"),
    ([{"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": " "},
      {"role": "assistant", "content": "Sunny."}], r"message 2 has no text content")])
def test_tool_calls_and_results_are_read_and_malformed_ones_are_errors(tmp_path, messages, said):
    """An assistant message with tool_calls was refused ("message 1 has tool_calls, which is not read"), and so was a
    tool's result (role 'tool'). They are read now (the chat template renders them: test_data_pipeline's tool tests),
    with the calls and the result's name kept; OpenAI's older function_call, a call without a name or on another role,
    and an empty result are the record's error. A null or empty tool_calls column (a fixed schema's) is no call. A
    conversation ending with a call has it as its answer (it was an error): its text with the calls."""
    records = [{"messages": [{"role": "user", "content": "Weather?"}, *messages]}]
    path = write_records(records, tmp_path / "calls.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=rf"record 0\): field 'messages': {said}"):
        raw(path, tmp_path)
    called = [{"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": [CALL]},
                            {"role": "tool", "name": "weather", "content": "Sunny."},
                            {"role": "assistant", "content": "Sunny."}], "tools": json.dumps([{"type": "function"}])}]
    plain = [{"messages": [{"role": "user", "content": "Weather?", "tool_calls": None},
                           {"role": "assistant", "content": "Sunny.", "tool_calls": []}]}]
    ipython = [{"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": [CALL]},
                             {"role": "ipython", "content": "Sunny."}]}]  # (Llama-3.1's role; a prompt ending so)
    ending = [{"messages": [{"role": "user", "content": "Weather?"},
                            {"role": "assistant", "content": "Let me look.", "tool_calls": [CALL]}]}]
    path = write_records(called + plain + ipython + ending, tmp_path / "plain.jsonl", "jsonl")
    adapter = raw(f"{path},{path}", tmp_path)
    first, second, third, fourth = adapter.get_train_data()
    answer = adapter.get_chosen_text(fourth)
    assert (str(answer), answer.tool_calls) == ("Let me look.", [CALL])
    assert adapter.get_conversation(fourth) == [{"role": "user", "content": "Weather?"}]
    assert adapter.get_conversation(third)[-1] == {"role": "ipython", "content": "Sunny."}
    assert adapter.get_conversation(first)[1:] == [{"role": "assistant", "content": "", "tool_calls": [CALL]},
                                                   {"role": "tool", "content": "Sunny.", "name": "weather"}]
    assert adapter.get_tools(first) == [{"type": "function"}] and adapter.get_tools(second) is None
    assert adapter.get_chosen_text(second) == "Sunny." and adapter.get_conversation(second) == [
        {"role": "user", "content": "Weather?"}]


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_openai_older_function_calling_is_read_as_tool_calls_and_results(tmp_path, kind):
    """OpenAI's older function-calling format (an assistant message's function_call {name, arguments: JSON text}, the
    result as role "function" with its name, the schemas in a "functions" column) was refused ("message 1 has
    function_call (OpenAI's older form), which is not read"). It reads as its newer form does: the call as tool_calls
    (its arguments as the object their text holds), the result as a tool's with its name, the functions as the
    record's tools; a conversation ending with the call has it as its answer."""
    function = {"name": "weather", "description": "The weather.", "parameters": {"type": "object"}}
    older = {"messages": [{"role": "user", "content": "Weather?"},
                          {"role": "assistant", "content": None,
                           "function_call": {"name": "weather", "arguments": '{"city": "Paris"}'}},
                          {"role": "function", "name": "weather", "content": "Sunny."},
                          {"role": "assistant", "content": "Sunny."}], "functions": [function]}
    ending = {"messages": older["messages"][:2], "functions": [function]}
    path = write_records([older, ending], tmp_path / f"older.{kind}", kind)
    adapter = raw(f"{path},{path}", tmp_path)
    first, second = adapter.get_train_data()
    assert adapter.get_conversation(first) == [{"role": "user", "content": "Weather?"},
                                               {"role": "assistant", "content": "", "tool_calls": [CALL]},
                                               {"role": "tool", "content": "Sunny.", "name": "weather"}]
    assert adapter.get_chosen_text(first) == "Sunny."
    answer = adapter.get_chosen_text(second)
    assert (str(answer), answer.tool_calls) == ("", [CALL])
    assert adapter.get_tools(first) == [function] == adapter.get_tools(second)


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_functions_column_of_something_else_stays_an_extra_column(tmp_path, kind):
    """Read as OpenAI's older tool schemas, any column named "functions" became the records' tools: a code dataset's
    list of function names, or a note, stopped the file ("field 'functions': expected a list of tool schemas"), where
    it was an extra column. Only a column of function schemas (objects with a name) is read as the tools."""
    records = [{"prompt": "Write f.", "chosen": "def f(): pass", "rejected": "No.", "functions": ["f", "g"]}] * 2
    path = write_records(records, tmp_path / f"code.{kind}", kind)
    adapter = raw(f"{path},{path}", tmp_path)
    sample = adapter.get_train_data()[0]
    assert adapter.get_tools(sample) is None and adapter.get_extra(sample) == {"functions": ["f", "g"]}
    chat = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}],
             "functions": "helpers.py"}] * 2
    path = write_records(chat, tmp_path / f"notes.{kind}", kind)
    adapter = raw(f"{path},{path}", tmp_path)
    sample = adapter.get_train_data()[0]
    assert adapter.get_chosen_text(sample) == "Yo" and adapter.get_extra(sample) == {"functions": "helpers.py"}
    schemas = [{"name": "weather", "description": "The weather.", "parameters": {"type": "object"}}]
    path = write_records([{**chat[0], "functions": json.dumps(schemas)}] * 2, tmp_path / f"text.{kind}", kind)
    adapter = raw(f"{path},{path}", tmp_path)  # (the schemas as JSON text are read as the tools)
    assert adapter.get_tools(adapter.get_train_data()[0]) == schemas


def test_parquet_call_arguments_keep_their_key_order_only_as_json_text(tmp_path):
    """A parquet column of objects is one Arrow struct, its keys in one order for every record: arguments written
    {"unit", "city"} after a record's {"city", "unit"} come back in the first one's order (the file no longer holds
    theirs). Given as JSON text (OpenAI's form) they keep their own order, as the README says."""
    def record(arguments):
        call = {"type": "function", "function": {"name": "weather", "arguments": arguments}}
        return {"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": [call]}]}

    orders = [{"city": "Paris", "unit": "C"}, {"unit": "F", "city": "Rome"}]
    for name, as_text in (("struct", False), ("text", True)):
        path = write_records([record(json.dumps(args) if as_text else args) for args in orders],
                             tmp_path / f"{name}.parquet", "parquet")
        adapter = raw(f"{path},{path}", tmp_path)
        read = [list(adapter.get_chosen_text(sample).tool_calls[0]["function"]["arguments"])
                for sample in adapter.get_train_data()]
        assert read == ([list(args) for args in orders] if as_text else [["city", "unit"]] * 2)


def test_a_pairs_answers_after_other_tool_calls_are_an_error(tmp_path):
    """A preference pair's turns before its answers are compared (they are the prompt both answers are trained after):
    by their roles and text only, turns that call a tool with other arguments read as the same, and the rejected
    answer was trained after the chosen one's call."""
    def conversation(city, answer):
        call = {"type": "function", "function": {"name": "weather", "arguments": {"city": city}}}
        return [{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "content": "Sunny."}, {"role": "assistant", "content": answer}]

    same = [{"chosen": conversation("Paris", "Sunny."), "rejected": conversation("Paris", "Rainy.")}]
    path = write_records(same, tmp_path / "same.jsonl", "jsonl")
    adapter = raw(f"{path},{path}", tmp_path)
    assert adapter.get_rejected_text(adapter.get_train_data()[0]) == "Rainy."
    other = [{"chosen": conversation("Paris", "Sunny."), "rejected": conversation("Rome", "Rainy.")}]
    path = write_records(other, tmp_path / "other.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=r"record 0\): field 'rejected': its prompt turns differ from those "
                                                 r"of 'chosen'"):
        raw(path, tmp_path)


# --- name dispatch ---

@pytest.mark.parametrize("name", ["Dahoas/rm-static-typo", "rm-static", "dahoas/rm-static", "Dahoas/rm-static ",
                                  "Dahoas/rm", "hh-rlhf", "tiny2"])
def test_names_match_exactly(tmp_path, name, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="unknown dataset") as err:
        raw(name, tmp_path)
    assert "Dahoas/rm-static" in str(err.value) and "jsonl:PATH" in str(err.value)


def test_a_name_close_to_a_known_one_is_told_it_without_the_hub(tmp_path, monkeypatch):
    """--data_path Dahoas/rm-statik listed every known name but did not say which was meant. A close spelling is told
    the known name (a case or separator slip too), by its spelling alone: with no network it is said the same; a name
    close to none is told none."""
    import socket

    from dschat.data.raw_datasets import check_data_paths

    def no_network(*args, **kwargs):
        raise OSError("no network in this test")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    for name, meant in (("Dahoas/rm-statik", "Dahoas/rm-static"), ("dahoas/rm-static", "Dahoas/rm-static"),
                        ("Anthropic/hh_rlhf", "Anthropic/hh-rlhf"), ("tiny2", "tiny")):
        with pytest.raises(UsageError, match=rf"^--data_path: unknown dataset '{name}' \(did you mean {meant}\?\): "
                                             "not a known name"):
            check_data_paths([name])
    with pytest.raises(UsageError, match=r"^--data_path: unknown dataset 'acme/pairs': not a known name"):
        check_data_paths(["acme/pairs"])


def test_known_names_dispatch_to_their_adapter(tmp_path, monkeypatch):
    monkeypatch.setattr(DahoasRmstaticDataset, "load", lambda self: DatasetDict({"train": Dataset.from_list([])}))
    assert type(raw("Dahoas/rm-static", tmp_path)) is DahoasRmstaticDataset
    assert set(HUB_DATASETS) == {"Dahoas/rm-static", "Dahoas/full-hh-rlhf", "Dahoas/synthetic-instruct-gptj-pairwise",
                                 "yitingxie/rlhf-reward-datasets", "openai/webgpt_comparisons", "stanfordnlp/SHP",
                                 "Anthropic/hh-rlhf"}


def test_missing_local_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        raw(f"jsonl:{tmp_path / 'nope.jsonl'}", tmp_path)
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        raw(str(tmp_path / "nope.parquet"), tmp_path)


def test_a_missing_data_path_is_said_with_the_flag_that_gave_it(tmp_path, monkeypatch):
    """A missing typed spec said "jsonl:x.jsonl: x.jsonl does not exist", a missing file "data file not found: x.jsonl",
    an unknown name "unknown dataset 'x'", naming no flag (--data_path, or step 1's --sft_only_data_path)."""
    from dschat.data.raw_datasets import check_data_paths

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "a.jsonl").write_text(json.dumps(RECORDS[0]) + "\n")
    for spec, said in (("jsonl:./x.jsonl", "jsonl:./x.jsonl: ./x.jsonl: no such file or folder"),
                       ("x.jsonl", "x.jsonl: no such file or folder"),
                       ("a.jsonl,x.jsonl", "a.jsonl,x.jsonl: a.jsonl: no such file or folder"),
                       # (a ~ after TYPE: is one the shell leaves: the spec meant is said)
                       ("jsonl:~/a.jsonl", rf"jsonl:~/a.jsonl: ~/a.jsonl: no such file or folder \(the shell did "
                                           rf"not expand its ~, as after --flag= or a TYPE: prefix; give "
                                           rf"jsonl:{tmp_path}/home/a.jsonl\)")):
        with pytest.raises(MissingInputError, match=rf"^--data_path {said}$"):
            check_data_paths([spec])
        with pytest.raises(MissingInputError, match=rf"^--sft_only_data_path {said}$"):
            check_data_paths(["tiny"], [spec])
    with pytest.raises(UsageError, match=r"^--data_path: unknown dataset 'nope': not a known name"):
        check_data_paths("nope")


def test_a_data_path_of_unreadable_form_is_said_with_the_flag_that_gave_it(tmp_path, monkeypatch):
    """The errors of a data path that is there but of no form dschat reads named the path alone, not the flag that
    gave it (--sft_only_data_path, a tool's --pairs_file): "cannot tell what the folder X holds", "cannot tell the
    format of X", a compressed file or folder, a hub dataset's download without a train split or of shards of two downloads, a
    folder of two eval files, a spec of three paths."""
    import gzip

    from dschat.data.raw_datasets import check_data_paths
    from dschat.tools.records import load_records

    monkeypatch.chdir(tmp_path)
    for folder in ("empty", "both", "packed", "prefs/data", "hub/data", "evals", "shards/data"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "empty" / "notes.txt").write_text("x")
    (tmp_path / "notes.txt").write_text("x")
    for name in ("both/train.jsonl", "both/train.json", "evals/train.jsonl", "evals/eval.jsonl", "evals/eval.json"):
        write_records(RECORDS, tmp_path / name, os.path.splitext(name)[1][1:])
    for name in ("train.csv.gz", "packed/train.csv.gz"):
        (tmp_path / name).write_bytes(gzip.compress(b"{}\n"))
    write_records(RECORDS, tmp_path / "prefs/data/train_prefs-00000-of-00001.parquet", "parquet")
    write_records(RECORDS, tmp_path / "hub/data/train-00000-of-00001.parquet", "parquet")
    write_records(RECORDS, tmp_path / "shards/data/train-00000-of-00002.parquet", "parquet")
    write_records(RECORDS, tmp_path / "shards/data/train-00001-of-00003.parquet", "parquet")  # (another download's)
    for spec, said in (("empty", "empty: cannot tell what the folder holds"),
                       ("notes.txt", "notes.txt: cannot tell the format of the file from its extension"),
                       ("notes.txt,empty", "notes.txt,empty: notes.txt: cannot tell the format"),
                       ("both", "both: the folder holds train.jsonl and train.json"),
                       ("train.csv.gz", "train.csv.gz: the file is compressed with gzip"),
                       ("packed", "packed: its train data train.csv.gz: the file is compressed with gzip"),
                       ("csv:packed", "csv:packed: packed: its train data train.csv.gz: the file is compressed"),
                       ("prefs", "prefs: the folder holds a hub dataset's files of the split train_prefs, not train"),
                       ("jsonl:hub", "jsonl:hub: the folder's train data is"),
                       ("evals", "evals: the folder holds eval.jsonl and eval.json"),
                       ("shards", r"shards: the folder holds the train split in shards of more than one download "
                                  r"\(shards of 2 and 3 in all\)"),
                       ("a,b,c", "a,b,c: 3 comma-separated paths; expected PATH or TRAIN_PATH,EVAL_PATH")):
        for flag, read in (("--sft_only_data_path", lambda: check_data_paths(["tiny"], [spec])),
                           ("--pairs_file", lambda: load_records(spec, flag="--pairs_file"))):
            with pytest.raises(UsageError) as error:
                read()
            assert re.match(rf"{flag} {said}", str(error.value)), (flag, spec, str(error.value))


def test_a_data_spec_lacking_a_path_says_it_as_typed_and_what_it_lacks():
    """``--data_path jsonl:`` was said as "--data_path : expected PATH or TRAIN_PATH,EVAL_PATH": the spec's empty part
    after jsonl: alone, though the user typed jsonl:. The spec is said as typed, and the path it lacks."""
    from dschat.data.raw_datasets import check_data_paths

    for spec, said in (("jsonl:", "'jsonl:': no path after jsonl:; expected jsonl:PATH or jsonl:TRAIN_PATH,EVAL_PATH"),
                       ("", "'': no path; expected PATH or TRAIN_PATH,EVAL_PATH"),
                       ("jsonl:a.jsonl,", "jsonl:a.jsonl,: no eval path after the comma; expected jsonl:PATH or "
                                          "jsonl:TRAIN_PATH,EVAL_PATH"),
                       ("csv:,b.csv", "csv:,b.csv: no train path before the comma; expected csv:PATH or "
                                      "csv:TRAIN_PATH,EVAL_PATH"),
                       ("jsonl:a,b,c", "jsonl:a,b,c: 3 comma-separated paths; expected jsonl:PATH or "
                                       "jsonl:TRAIN_PATH,EVAL_PATH")):
        with pytest.raises(UsageError) as error:
            check_data_paths([spec])
        assert str(error.value) == f"--data_path {said}", spec


def test_bad_data_paths_are_usage_errors(tmp_path, monkeypatch):
    # entry points print a UsageError as "error: ..." and exit 2 instead of a traceback
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match="unknown dataset 'typo.txt'"):
        raw("typo.txt", tmp_path)
    folder = tmp_path / "not_saved"  # a folder of files, not a save_to_disk folder
    folder.mkdir()
    write_records(RECORDS[:2], folder / "x.jsonl", "jsonl")
    with pytest.raises(DatasetFormatError, match=rf"{folder}: not a save_to_disk folder"):
        raw(f"disk:{folder}", tmp_path)
    Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "partial"))
    for arrow in (tmp_path / "partial").glob("*.arrow"):
        arrow.unlink()
    with pytest.raises(DatasetFormatError, match=r"partial: an incomplete save_to_disk folder: .*\.arrow"):
        raw(f"disk:{tmp_path / 'partial'}", tmp_path)
    with pytest.raises(MissingInputError, match="gone"):
        raw(f"disk:{tmp_path / 'gone'}", tmp_path)


# --- hub adapters on hand-made records with each dataset's real schema (no download) ---

def adapter_for(cls, tmp_path, splits):
    return cls(str(tmp_path / "out"), 1234, 0, raw_datasets=DatasetDict(
        {name: Dataset.from_list(rows) for name, rows in splits.items()}))


RM_STATIC = {"prompt": "\n\nHuman: What is a cuss word?\n\nAssistant: A rude word.\n\nHuman: Name one.\n\nAssistant:",
             "response": " I'd rather not.", "chosen": " I'd rather not.", "rejected": " Sure: darn."}


@pytest.mark.parametrize("cls", [DahoasRmstaticDataset, DahoasFullhhrlhfDataset])
def test_dahoas_transcript_adapters(tmp_path, cls):
    adapter = adapter_for(cls, tmp_path, {"train": [RM_STATIC] * 3, "test": [RM_STATIC]})
    assert len(adapter.get_train_data()) == 3 and len(adapter.get_eval_data()) == 1
    assert adapter.get_conversation(RM_STATIC) == [
        {"role": "user", "content": "What is a cuss word?"}, {"role": "assistant", "content": "A rude word."},
        {"role": "user", "content": "Name one."}]
    assert (adapter.get_chosen_text(RM_STATIC), adapter.get_rejected_text(RM_STATIC)) == ("I'd rather not.", "Sure: darn.")
    assert adapter.get_prompt(RM_STATIC) == RM_STATIC["prompt"]  # DeepSpeed-Chat's strings, verbatim
    assert adapter.get_prompt_and_rejected(RM_STATIC) == RM_STATIC["prompt"] + " Sure: darn."
    assert adapter.get_extra(RM_STATIC) == {}


def test_synthetic_instruct_adapter_splits_train_90_10(tmp_path):
    rows = [{"prompt": f"Write a haiku {i}", "chosen": f"Leaves fall {i}", "rejected": f"No {i}"} for i in range(30)]
    adapter = adapter_for(DahoasSyntheticinstructgptjpairwiseDataset, tmp_path, {"train": rows})
    train, eval_ = adapter.get_train_data(), adapter.get_eval_data()
    assert (len(train), len(eval_)) == (27, 3)
    assert {r["prompt"] for r in train}.isdisjoint(r["prompt"] for r in eval_)
    assert adapter.get_conversation(rows[0]) == [{"role": "user", "content": "Write a haiku 0"}]
    assert adapter.get_prompt_and_chosen(rows[0]) == "\n\nHuman: Write a haiku 0\n\nAssistant: Leaves fall 0"


def test_yitingxie_adapter(tmp_path):
    row = {"prompt": "\n\nHuman: How do I bake bread?\n\n", "chosen": "Assistant: Mix flour and water.",
           "rejected": "Assistant: Buy it."}
    adapter = adapter_for(YitingxieRlhfrewarddatasetsDataset, tmp_path, {"train": [row], "test": [row]})
    assert adapter.get_conversation(row) == [{"role": "user", "content": "How do I bake bread?"}]
    assert (adapter.get_chosen_text(row), adapter.get_rejected_text(row)) == ("Mix flour and water.", "Buy it.")
    assert adapter.get_prompt(row) == row["prompt"] + "Assistant:"
    assert adapter.get_chosen(row) == " Mix flour and water."


def webgpt_row(score_0, score_1):
    return {"question": {"id": "q1", "full_text": "Why is the sky blue?", "dataset": "eli5"},
            "quotes_0": {"title": ["t"], "extract": ["e"]}, "answer_0": "Rayleigh scattering [1] of light.",
            "tokens_0": [1, 2], "score_0": score_0,
            "quotes_1": {"title": ["t"], "extract": ["e"]}, "answer_1": "Because (2) it is.", "tokens_1": [3],
            "score_1": score_1}


def test_webgpt_adapter_picks_higher_score_and_removes_citations(tmp_path):
    row = webgpt_row(-1.0, 1.0)
    adapter = adapter_for(OpenaiWebgptcomparisonsDataset, tmp_path, {"train": [row] * 10})
    assert (len(adapter.get_train_data()), len(adapter.get_eval_data())) == (9, 1)
    assert adapter.get_conversation(row) == [{"role": "user", "content": "Why is the sky blue?"}]
    assert adapter.get_chosen_text(row) == "Because it is."
    assert adapter.get_rejected_text(row) == "Rayleigh scattering of light."
    assert adapter.get_extra(row) == {}
    tie = webgpt_row(0.0, 0.0)
    assert adapter.get_chosen_text(tie) == "Rayleigh scattering of light."  # SFT can use a tied pair
    with pytest.raises(SkipRecord, match="tied"):
        adapter.get_rejected_text(tie)  # the reward model cannot


def test_shp_adapter_uses_labels_and_passes_metadata(tmp_path):
    row = {"post_id": "p1", "domain": "askculinary_train", "upvote_ratio": 0.9, "history": "How long to boil an egg?",
           "c_root_id_A": "a", "c_root_id_B": "b", "created_at_utc_A": 1, "created_at_utc_B": 2, "score_A": 3,
           "score_B": 10, "human_ref_A": "Forever.", "human_ref_B": "About 9 minutes.", "labels": 0,
           "seconds_difference": 1.0, "score_ratio": 3.3}
    adapter = adapter_for(StanfordnlpSHPDataset, tmp_path, {"train": [row], "validation": [row], "test": [row]})
    assert len(adapter.get_eval_data()) == 1
    assert adapter.get_conversation(row) == [{"role": "user", "content": "How long to boil an egg?"}]
    assert (adapter.get_chosen_text(row), adapter.get_rejected_text(row)) == ("About 9 minutes.", "Forever.")
    assert adapter.get_chosen_text(dict(row, labels=1)) == "Forever."
    assert adapter.get_extra(row)["domain"] == "askculinary_train" and "history" not in adapter.get_extra(row)


def test_anthropic_hh_adapter_splits_shared_prompt_from_answers(tmp_path):
    prefix = "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Tell me a joke."
    row = {"chosen": prefix + "\n\nAssistant: Why did the chicken cross the road?",
           "rejected": prefix + "\n\nAssistant: No."}
    adapter = adapter_for(AnthropicHhrlhfDataset, tmp_path, {"train": [row], "test": [row]})
    assert adapter.get_conversation(row) == [{"role": "user", "content": "Hi"},
                                             {"role": "assistant", "content": "Hello!"},
                                             {"role": "user", "content": "Tell me a joke."}]
    assert (adapter.get_chosen_text(row), adapter.get_rejected_text(row)) == ("Why did the chicken cross the road?", "No.")
    assert adapter.get_prompt(row) == prefix + "\n\nAssistant:"
    assert adapter.get_chosen(row) == " Why did the chicken cross the road?"
    with pytest.raises(RecordError, match="'chosen'"):
        adapter.get_chosen_text({"chosen": prefix, "rejected": prefix})  # no final answer


def test_the_data_fields_help_names_every_field_that_can_be_renamed():
    """--data_fields' help listed prompt, chosen, rejected, messages and label, not tools= (TRL's tool schemas) nor
    system= (LLaMA-Factory's system column): flags a user learns only from the README or an error."""
    from dschat.args import step1_parser
    from dschat.data.fields import (FIELD_NAMES, LABEL_FIELD, PROMPT_PARTS, SYSTEM_FIELD, TOOLS_FIELD,
                                    checked_field_options)

    renamable = (*FIELD_NAMES, LABEL_FIELD, TOOLS_FIELD, SYSTEM_FIELD, *PROMPT_PARTS)
    assert checked_field_options({name: "x" for name in renamable})  # (the list the loader accepts)
    action = next(a for a in step1_parser()._actions if "--data_fields" in a.option_strings)
    assert [name for name in renamable if f"{name}=" not in action.help] == []


def link_into_hub_cache(snapshot):
    """A download of the snapshot folder ``snapshot`` as the hub client lays it out: each file moved to the repository's
    blobs/ under the sha256 of its content (the hub's name of a large file's blob) and linked back from the snapshot."""
    import hashlib

    blobs = snapshot.parent.parent / "blobs"
    blobs.mkdir(exist_ok=True)
    for path in sorted(p for p in snapshot.rglob("*") if p.is_file()):
        blob = blobs / hashlib.sha256(path.read_bytes()).hexdigest()
        path.replace(blob)
        path.symlink_to(os.path.relpath(blob, path.parent))


def test_a_hub_cache_files_content_hash_is_its_blobs_name_not_read(tmp_path, monkeypatch, tokenizer):
    """The tokenized data's cache key holds each data file's sha256: a hub cache download's shards (c4's en: ~300 GB)
    were read whole for it, in each process, though the hub client names each one's blob by that very hash. A file
    outside a hub cache is still read for it, and an edit of it still gets a new cache."""
    import hashlib

    from dschat.data import digests
    from dschat.data.pipeline import create_prompt_dataset

    snapshot = rm_static_in_the_hub_cache(tmp_path, monkeypatch)
    link_into_hub_cache(snapshot)
    shards = sorted(snapshot.glob("data/*.parquet"))
    hashed = []
    file_digest = hashlib.file_digest
    monkeypatch.setattr(digests.hashlib, "file_digest", lambda f, *a: hashed.append(f.name) or file_digest(f, *a))

    assert [digests.file_digest(str(shard)) for shard in shards] == \
        [hashlib.sha256(shard.read_bytes()).hexdigest() for shard in shards]  # (its blob's name: the same key)
    train, _ = create_prompt_dataset(0, ["Dahoas/rm-static"], "10,0,0", str(tmp_path / "out"), 1, 1234, tokenizer, 128)
    assert len(train) == 15 and hashed == []
    # (a copy of them outside it, one of them edited, is read for its hash, and gets a cache of its own)
    copy = tmp_path / "copy"
    shutil.copytree(snapshot, copy)
    write_records(RM_STATIC_ROWS[:14], next((copy / "data").glob("train-*.parquet")), "parquet")
    train, _ = create_prompt_dataset(0, [f"parquet:{copy}"], "10,0,0", str(tmp_path / "out"), 1, 1234, tokenizer, 128)
    assert len(train) == 14 and sorted(map(os.path.basename, set(hashed))) == [shard.name for shard in shards]


def mount_id_of(path):
    """The ID of the mount ``path`` is read through (``digests._mount_id`` of it open)."""
    from dschat.data import digests

    fd = os.open(path, os.O_RDONLY)
    try:
        return digests._mount_id(fd)
    finally:
        os.close(fd)


def on_file_system(monkeypatch, path, file_system):
    """This process's mounts (``digests._mount_file_systems``) say ``path``'s mount holds a ``file_system``."""
    from dschat.data import digests

    monkeypatch.setattr(digests, "_mount_file_systems", lambda: {mount_id_of(path): file_system}, raising=False)


def test_a_files_content_hash_is_kept_for_later_processes_until_it_is_written(tmp_path, monkeypatch):
    """A data file outside the hub cache (c4 downloaded with --local-dir: ~300 GB) was read whole for its hash by every
    process of every run. Its hash is kept under its stamp: a later process reads none; a write (even one that keeps
    its size and time, restored with touch -r) is read; a file written just before it was hashed is not kept."""
    import hashlib

    from dschat.data import digests

    on_file_system(monkeypatch, tmp_path, "ext4")  # (a file system whose change time a write sets)
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "Hi?", "chosen": "Hello."}\n')
    hashed = []
    file_digest = hashlib.file_digest
    monkeypatch.setattr(digests.hashlib, "file_digest", lambda f, *a: hashed.append(f.name) or file_digest(f, *a))

    def digest_in_a_new_process():
        digests.forget_file_digests()
        return digests.file_digest(str(data))

    # (written just now: not kept, however long the machine stalls between the write and the hash: the window is
    # wide here, and 2 s, the default, would keep it after a 3 s stall)
    monkeypatch.setattr(digests, "RACY_WINDOW_NS", 10**18)
    with monkeypatch.context() as stalled:
        stalled.setattr(digests.time, "time_ns", lambda time_ns=digests.time.time_ns: time_ns() + 3 * 10**9)
        first = digest_in_a_new_process()
        assert first == hashlib.sha256(data.read_bytes()).hexdigest() and len(hashed) == 1
        assert digest_in_a_new_process() == first and len(hashed) == 2
    monkeypatch.setattr(digests, "RACY_WINDOW_NS", 0)  # (as if written long before)
    assert [digest_in_a_new_process() for _ in range(3)] == [first] * 3 and len(hashed) == 3
    stat = data.stat()
    data.write_text('{"prompt": "Hi?", "chosen": "Hullo."}\n')
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert digest_in_a_new_process() == hashlib.sha256(data.read_bytes()).hexdigest() != first and len(hashed) == 4


def test_a_kept_content_hash_is_that_of_the_file_opened_not_of_a_stat_before_it(tmp_path, monkeypatch):
    """The kept hash was looked up under a stat taken before the file was opened. An NFS client's stat answers from the
    attributes it cached (up to a minute, acregmax) where its open asks the server: a file written on another machine
    kept its old stamp for a later process's stat, which took the old file's kept hash, and its tokenized data, for
    the data read. The stamp is now the opened file's (``os.fstat``); a file written while it is read keeps no hash
    under the stamp it had before (the hash is of neither)."""
    import hashlib

    from dschat.data import digests

    on_file_system(monkeypatch, tmp_path, "ext4")  # (a file system whose change time a write sets)
    monkeypatch.setattr(digests, "RACY_WINDOW_NS", 0)  # (as if written long before)
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "Hi?", "chosen": "Hello."}\n')
    old = digests.file_digest(str(data))  # (kept)
    cached_attributes = os.stat(data)
    data.write_text('{"prompt": "Hi?", "chosen": "Hullo there."}\n')  # (another machine's edit)
    real_stat = os.stat
    with monkeypatch.context() as patch:
        patch.setattr(digests.os, "stat", lambda path, *a, **kw: cached_attributes if str(path) == str(data)
                      else real_stat(path, *a, **kw))
        digests.forget_file_digests()  # (a later process)
        assert digests.file_digest(str(data)) == hashlib.sha256(data.read_bytes()).hexdigest() != old

    # (written while it is read: the stamp it had when opened keeps nothing)
    other = tmp_path / "other.jsonl"
    other.write_text('{"prompt": "Hey?", "chosen": "Hello."}\n')
    before = os.stat(other)
    file_digest = hashlib.file_digest

    def written_while_read(f, *a):
        other.write_text('{"prompt": "Hey?", "chosen": "Hullo there."}\n')
        return file_digest(f, *a)

    monkeypatch.setattr(digests.hashlib, "file_digest", written_while_read)
    digests.file_digest(str(other))
    stamp = (before.st_dev, before.st_ino, before.st_size, before.st_mtime_ns, before.st_ctime_ns)
    assert not os.path.exists(digests._digest_memo_path(str(other), stamp))


def test_a_kept_content_hash_can_be_read_by_the_other_users_of_a_shared_cache(tmp_path, monkeypatch):
    """A team's shared HF_HOME: the kept hash was written owner-only (mkstemp's 0o600, kept by the rename), so another
    user read none of them and hashed the data whole again, each run, and its own entry then hid the first user's. It
    has the mode a plain ``open`` gives (``dschat.utils.files.atomic_file``)."""
    import glob
    import stat

    import datasets

    from dschat.data import digests

    on_file_system(monkeypatch, tmp_path, "ext4")  # (a file system whose change time a write sets)
    monkeypatch.setattr(digests, "RACY_WINDOW_NS", 0)  # (as if written long before)
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "Hi?", "chosen": "Hello."}\n')
    mask = os.umask(0o022)
    try:
        digests.file_digest(str(data))
    finally:
        os.umask(mask)
    [memo] = glob.glob(os.path.join(datasets.config.HF_DATASETS_CACHE, digests.DIGEST_MEMO_FOLDER, "*", "*"))
    assert stat.S_IMODE(os.stat(memo).st_mode) == 0o644


def test_a_files_content_hash_is_kept_only_on_a_file_system_whose_change_time_a_write_sets(tmp_path, monkeypatch):
    """The kept hash trusted a file's change time everywhere: on a read-only image (squashfs, erofs: an Apptainer
    image's ctime is the stored mtime, its inodes fixed), a same-size edit in a new image version had the old stamp,
    and its old hash, so the old file's tokenized data. Kept (read and written) only on a file system known to keep a
    real change time (ext4 here); on another, or one this process's mounts do not name, hashed by each process."""
    import glob
    import hashlib

    import datasets

    from dschat.data import digests

    monkeypatch.setattr(digests, "RACY_WINDOW_NS", 0)  # (as if written long before)
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "Hi?", "chosen": "Hello."}\n')
    hashed = []
    file_digest = hashlib.file_digest
    monkeypatch.setattr(digests.hashlib, "file_digest", lambda f, *a: hashed.append(f.name) or file_digest(f, *a))
    memos = os.path.join(datasets.config.HF_DATASETS_CACHE, digests.DIGEST_MEMO_FOLDER, "*", "*")

    def hashes_in_new_processes():
        hashed.clear()
        for _ in range(3):
            digests.forget_file_digests()  # (a later process)
            assert digests.file_digest(str(data)) == hashlib.sha256(data.read_bytes()).hexdigest()
        return len(hashed)

    for file_system in ("squashfs", "erofs", "vfat", "fuse.s3fs", "overlay", None):
        on_file_system(monkeypatch, tmp_path, file_system)
        assert hashes_in_new_processes() == 3 and not glob.glob(memos), file_system
    on_file_system(monkeypatch, tmp_path, "ext4")
    assert hashes_in_new_processes() == 1 and len(glob.glob(memos)) == 1
    # (a hash kept on ext4 is not read once the mounts say otherwise: another image of the same stamp)
    on_file_system(monkeypatch, tmp_path, "squashfs")
    assert hashes_in_new_processes() == 3


def test_kept_content_hashes_of_files_gone_or_written_since_are_pruned_now_and_then(tmp_path, monkeypatch):
    """The kept hashes (``<HF_DATASETS_CACHE>/dschat_file_sha256``) were never removed: one more for each data file
    written or removed since. When one is written, at most once a day, those of a file gone or written since (another
    stamp) are removed, and an entry naming no file (written before entries named it) 30 days old; live entries, and
    an entry being written (a temp file), stay."""
    import glob
    import time

    from dschat.data import digests

    on_file_system(monkeypatch, tmp_path, "ext4")  # (a file system whose change time a write sets)
    monkeypatch.setattr(digests, "RACY_WINDOW_NS", 0)  # (as if written long before)
    folder = digests._digest_memo_folder()

    def kept(name, text):
        path = tmp_path / name
        path.write_text(text)
        digests.forget_file_digests()
        digests.file_digest(str(path))
        st = os.stat(path)
        return path, digests._digest_memo_path(str(path), digests._stat_stamp(st))

    live, live_memo = kept("live.jsonl", "live")
    gone, gone_memo = kept("gone.jsonl", "gone")
    edited, edited_memo = kept("edited.jsonl", "edited")
    gone.unlink()
    edited.write_text("edited again")
    os.makedirs(os.path.join(folder, "ab"), exist_ok=True)
    unnamed_old, unnamed_new = (os.path.join(folder, "ab", name * 64) for name in "ab")
    for memo in (unnamed_old, unnamed_new):
        with open(memo, "w") as f:
            f.write("0" * 64)  # (an entry of the digest alone)
    writing = os.path.join(folder, "ab", "tmpq1w2e3.tmp")
    with open(writing, "w") as f:
        f.write("0" * 32)
    month_ago = time.time() - 31 * 24 * 3600
    os.utime(unnamed_old, (month_ago, month_ago))
    # (pruned a day ago: the next entry written prunes)
    os.utime(os.path.join(folder, digests.PRUNED_MARK), (month_ago, month_ago))
    _, new_memo = kept("new.jsonl", "new")
    memos = set(glob.glob(os.path.join(folder, "*", "*")))
    assert memos == {live_memo, new_memo, unnamed_new, writing}, memos
    assert digests._kept_digest(str(live), digests._stat_stamp(os.stat(live))) is not None  # (still read)
    # (pruned just now: not again until a day has passed)
    live.unlink()
    kept("newer.jsonl", "newer")
    assert os.path.exists(live_memo)
    digests.prune_kept_digests(folder)
    assert not os.path.exists(live_memo)


def test_a_kept_hash_naming_a_path_with_a_nul_is_pruned_as_junk_not_a_crash(tmp_path):
    """A kept entry's path with a NUL (a hand-corrupted entry: no file has one) made os.stat raise ValueError, which
    pruning did not expect: the process writing a kept hash crashed. Such an entry names no file there is, and is
    removed as one of a file gone; the others are pruned as before."""
    from dschat.data import digests

    folder = digests._digest_memo_folder()
    live = tmp_path / "live.jsonl"
    live.write_text("live")
    stamp = digests._stat_stamp(os.stat(live))
    entries = {name: os.path.join(folder, "ab", name * 64) for name in "abc"}
    os.makedirs(os.path.dirname(entries["a"]))
    for name, named in (("a", [str(tmp_path / "no\0such.jsonl"), *stamp]),  # (json writes the NUL as \u0000)
                        ("b", [[str(live), *stamp], ["\0", *stamp]]),  # (a kept pass naming two files)
                        ("c", [str(live), *stamp])):
        with open(entries[name], "w") as f:
            f.write("0" * 64 + "\n" + json.dumps(named))
    digests.prune_kept_digests(folder)
    assert [name for name, memo in sorted(entries.items()) if os.path.exists(memo)] == ["c"]


def test_the_ranks_of_a_node_hash_a_data_file_once(tmp_path):
    """On a first run every rank hashed the same data files at once (c4's shards: ~300 GB, read whole by each), where
    the hash one computes is kept for the others. They take turns now (a file lock per bucket of the kept hashes):
    through the deepspeed launcher, 2 CPU ranks hashing one file at once hash it once, and both get its hash; rank 0
    hashing a file alone after does not wait for the other rank."""
    import hashlib
    from pathlib import Path

    from tests.launch import run_deepspeed

    data, other = tmp_path / "train.jsonl", tmp_path / "other.jsonl"
    data.write_text('{"prompt": "Hi?", "chosen": "Hello."}\n')
    other.write_text('{"prompt": "Hey?", "chosen": "Hello."}\n')
    run_deepspeed(Path(__file__).parent / "scripts" / "hash_once.py", data, other, tmp_path, timeout=300)
    hashed = sorted(line.split()[1] for line in (tmp_path / "hashed").read_text().splitlines())
    assert hashed == ["other.jsonl", "train.jsonl"], hashed
    digests = {(tmp_path / f"digest{rank}").read_text() for rank in (0, 1)}
    assert digests == {hashlib.sha256(data.read_bytes()).hexdigest()}


def test_a_process_killed_while_hashing_on_a_cache_without_flock_holds_no_later_one_up(tmp_path):
    """On a hash cache whose file system has no flock (Lustre mounted without it, some FUSE mounts), the hashing lock
    fell back to filelock's soft lock, a marker file that a process of another host or container never judges stale:
    a rank killed while hashing left it, and every later process hashing a file of its bucket waited forever, without
    a word. Without flock no lock is taken now (each process hashes, as on a cache it cannot write)."""
    import hashlib
    import subprocess
    import sys
    from pathlib import Path

    script = str(Path(__file__).parent / "scripts" / "hash_without_flock.py")
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "Hi?", "chosen": "Hello."}\n')
    killed = subprocess.run([sys.executable, script, "node-a", str(data), "die"], env=env, timeout=120)
    assert killed.returncode == 9
    try:
        later = subprocess.run([sys.executable, script, "node-b", str(data)], env=env, capture_output=True, text=True,
                               timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("a process of another host waited for the lock of the killed one")
    assert later.stdout.strip() == hashlib.sha256(data.read_bytes()).hexdigest(), later.stderr


def test_a_files_file_system_is_read_from_this_processs_mountinfo(tmp_path, monkeypatch):
    """The mounts' file systems by device (/proc/self/mountinfo's MAJOR:MINOR and the type after " - "); none where
    it cannot be read (no /proc: macOS), so nothing is kept there."""
    from dschat.data import digests

    mountinfo = (
        "27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
        "36 27 7:3 / /mnt/my\\040image rw,nosuid master:2 shared:3 - squashfs /dev/loop3 ro\n"
        "40 27 0:45 / /data rw - fuse.s3fs s3fs rw\n")
    assert digests._file_systems_of_mountinfo(mountinfo) == {27: "ext4", 36: "squashfs", 40: "fuse.s3fs"}
    digests._mount_file_systems.cache_clear()
    try:
        # (this machine's own: the mount a file here is read through is one of them)
        assert mount_id_of(tmp_path) in digests._mount_file_systems()
        digests._mount_file_systems.cache_clear()
        monkeypatch.setattr(digests, "MOUNTINFO", str(tmp_path / "none"))
        with open(tmp_path / "data.txt", "w") as f:
            assert digests._mount_file_systems() == {} and not digests._keeps_change_time(f.fileno())
    finally:
        digests._mount_file_systems.cache_clear()


def test_a_btrfs_files_content_hash_is_kept_though_its_device_is_not_its_mounts(tmp_path, monkeypatch):
    """A btrfs file's st_dev is its subvolume's own anonymous device, never the MAJOR:MINOR mountinfo shows for the
    mount: the kept hash, looked up by st_dev, was kept on no btrfs file (which README names as keeping it), and each
    process read such a file whole again. The mount is found by the open file's mount ID (fdinfo's mnt_id) now."""
    import glob
    import hashlib

    import datasets

    from dschat.data import digests

    monkeypatch.setattr(digests, "RACY_WINDOW_NS", 0)  # (as if written long before)
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "Hi?", "chosen": "Hello."}\n')
    device = os.stat(data).st_dev
    unlike_it = f"0:{os.minor(device) + 1 if os.major(device) == 0 else 99}"  # (a subvolume's device is not the mount's)
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"{mount_id_of(data)} 1 {unlike_it} /@ / rw,relatime shared:1 - btrfs /dev/sda2 "
                         "rw,space_cache=v2,subvolid=256,subvol=/@\n")
    monkeypatch.setattr(digests, "MOUNTINFO", str(mountinfo))
    digests._mount_file_systems.cache_clear()
    hashed = []
    file_digest = hashlib.file_digest
    monkeypatch.setattr(digests.hashlib, "file_digest", lambda f, *a: hashed.append(f.name) or file_digest(f, *a))
    try:
        for _ in range(3):
            digests.forget_file_digests()  # (a later process)
            assert digests.file_digest(str(data)) == hashlib.sha256(data.read_bytes()).hexdigest()
    finally:
        digests._mount_file_systems.cache_clear()
    assert len(hashed) == 1
    assert len(glob.glob(os.path.join(datasets.config.HF_DATASETS_CACHE, digests.DIGEST_MEMO_FOLDER, "*", "*"))) == 1


@pytest.mark.parametrize("name", ["train.jsonl", "c4-train.00000-of-00001.json.gz"])
def test_a_json_files_passed_check_is_kept_by_its_content_and_a_changed_file_is_checked_again(tmp_path, monkeypatch,
                                                                                             name):
    """A JSON file's line-by-line check (~50 MB of text a second) was made by every process of every run, though
    datasets' load came from its Arrow cache: allenai/c4's en, ~800 GB of text, ~5 h of CPU a process. A passed check
    is kept by the file's content now: a later process reads what it gave (record lines, key orders) without checking
    the file; a changed file is checked again, its bad line named; a file whose hash later processes would not find
    without reading it (a file system not known to keep a change time) is checked every time, as before, where it is
    not a hub download's (its blob named by its hash)."""
    import gzip

    from dschat.data import digests, reading

    on_file_system(monkeypatch, tmp_path, "ext4")  # (a file system whose change time a write sets)
    monkeypatch.setattr(digests, "RACY_WINDOW_NS", 0)  # (as if written long before)
    path = tmp_path / name
    rows = [{"prompt": "Weather?", "chosen": "Sun.", "meta": {"city": "Paris", "unit": "c"}},
            {"prompt": "In F?", "chosen": "Hot.", "meta": {"unit": "f", "city": "Rome"}},
            {"prompt": "Rain?", "chosen": "No."}]

    def write(text):
        path.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())

    write(json.dumps(rows[0]) + "\n\n" + "".join(json.dumps(row) + "\n" for row in rows[1:]))  # (a gap: line 2)
    checked = []
    check = reading.check_jsonl_lines
    monkeypatch.setattr(reading, "check_jsonl_lines", lambda *args: checked.append(args[0]) or check(*args))

    def read_in_a_new_process():
        digests.forget_file_digests()
        return reading.load_file("json" if name.endswith(".json.gz") else "jsonl", str(path))

    first, lines = read_in_a_new_process()
    again, kept_lines = read_in_a_new_process()
    assert len(checked) == 1 and again[:] == first[:] and list(kept_lines) == list(lines) == [1, 3, 4]
    assert list(again[1]["meta"]) == ["unit", "city"]  # (the key orders the check gathered: as written)
    assert reading.record_where(str(path), 2, kept_lines) == f"{path} line 4 (record 2)"
    write("".join(json.dumps(row) + "\n" for row in rows))  # (no gap: lines kept as a range)
    assert list(read_in_a_new_process()[1]) == [1, 2, 3] == list(read_in_a_new_process()[1]) and len(checked) == 2
    write(json.dumps(rows[0]) + "\n" + json.dumps(rows[1]) + "\n" + '{"prompt": "cut\n')
    for _ in range(2):
        with pytest.raises(DatasetFormatError, match=rf"{re.escape(str(path))} line 3: invalid JSON"):
            read_in_a_new_process()
    assert len(checked) == 4
    on_file_system(monkeypatch, tmp_path, "overlay")
    write("".join(json.dumps(row) + "\n" for row in rows[1:]))
    read_in_a_new_process()
    read_in_a_new_process()
    assert len(checked) == 6
    # (a hub download's file there too: its blob's name is its hash, which every process finds)
    snapshot = hub_cache_snapshot(tmp_path / "hub", "datasets--allenai--c4")
    snapshot.mkdir(parents=True)
    path = path.replace(snapshot / name)
    link_into_hub_cache(snapshot)
    read_in_a_new_process()
    read_in_a_new_process()
    assert len(checked) == 7


def test_a_json_files_load_opens_it_for_its_hash_once_and_stats_it_for_none(tmp_path, monkeypatch):
    """One load of a JSON Lines file opened it for its hash three times (its check's key, the check's keeping, its
    Arrow cache's key) and stat'ed it once more for the kept check's stamp; the source's cache key stat'ed it for its
    size beside opening it for its hash. Over c4's 1024 shards that adds up. Now the hash is found once a load, with
    the stamp of the file it was read from (its size there): the load opens the file for its hash once, and once more
    after a first check (whether the file was written while it was checked, and the stamp to keep the pass under); the
    cache key opens it once. Its first bytes (compressed? its text's encoding) were read by two opens more, and a
    first check's by a third: they are read in its hash's open. (datasets' own reads, in its load, are not counted.)"""
    from dschat.data import digests, reading, sources

    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "Hi?", "chosen": "Hello."}\n')
    opened_and_stated_by = opens_and_stats_counter(monkeypatch, data)
    # (cold: its hash and first bytes (compressed? its encoding), whether its pass will be kept (the ranks' turns),
    # the check's read, its stamp after the check)
    assert opened_and_stated_by(lambda: reading.load_file("jsonl", str(data))) == {"opened": 4, "stated": 0}
    # (warm: its hash and first bytes)
    assert opened_and_stated_by(lambda: reading.load_file("jsonl", str(data))) == {"opened": 1, "stated": 0}
    source = sources.LocalSource("jsonl", str(data), None, str(data))
    assert opened_and_stated_by(source.fingerprint) == {"opened": 1, "stated": 1}  # (all_files: is it a file?)
    assert source.fingerprint()["files"] == [[str(data), data.stat().st_size, digests.file_digest(str(data))]]


def test_a_csv_files_load_reads_its_first_bytes_in_its_hashs_open(tmp_path, monkeypatch):
    """A CSV file's load opened it for its first bytes twice (compressed? its text's encoding) and once more for its
    hash, beside the read of its records' lines: its first bytes are read in its hash's open now, as a JSON file's
    are. (datasets' own reads, in its load, are not counted.)"""
    from dschat.data import reading

    data = tmp_path / "train.csv"
    data.write_text("prompt,chosen\nHi?,Hello.\n")
    opened_and_stated_by = opens_and_stats_counter(monkeypatch, data)
    # (its hash and first bytes, its records' lines; cold or warm, the hash's open finds its stamp)
    assert opened_and_stated_by(lambda: reading.load_file("csv", str(data))) == {"opened": 2, "stated": 0}
    assert opened_and_stated_by(lambda: reading.load_file("csv", str(data))) == {"opened": 2, "stated": 0}


def opens_and_stats_counter(monkeypatch, data):
    """A function that runs ``read`` as a new process would (no hash found in this one, ``forget_file_digests``) and
    gives how many times it opened and stat'ed the file ``data`` (datasets' own reads, in its load, not counted); the
    hash of ``data`` kept as on ext4, the kept entries not pruned (once a day: it stats every kept file)."""
    import builtins

    import datasets

    from dschat.data import digests, reading

    on_file_system(monkeypatch, data.parent, "ext4")  # (a file system whose change time a write sets)
    monkeypatch.setattr(digests, "RACY_WINDOW_NS", 0)  # (as if written long before)
    monkeypatch.setattr(digests, "_prune_now_and_then", lambda folder: None)
    monkeypatch.setattr(reading, "_prune_now_and_then", lambda folder: None)  # (its own name of it: the kept passes')
    opened, stated = [], []
    counting = [True]

    def counted(real, calls):
        def call(file, *args, **kwargs):
            if counting[0] and not isinstance(file, int) and os.fspath(file) == str(data):
                calls.append(file)
            return real(file, *args, **kwargs)
        return call

    def load_dataset_uncounted(*args, real=datasets.load_dataset, **kwargs):
        counting[0] = False
        try:
            return real(*args, **kwargs)
        finally:
            counting[0] = True

    monkeypatch.setattr(builtins, "open", counted(builtins.open, opened))
    monkeypatch.setattr(os, "stat", counted(os.stat, stated))
    monkeypatch.setattr(datasets, "load_dataset", load_dataset_uncounted)

    def opened_and_stated_by(read):
        digests.forget_file_digests()  # (a new process)
        del opened[:], stated[:]
        read()
        return {"opened": len(opened), "stated": len(stated)}

    return opened_and_stated_by


@pytest.mark.parametrize("kind, name, old, new, read_by", [
    ("jsonl", "train.jsonl", '{"prompt": "Hi?", "chosen": "Hello."}\n', '{"prompt": "Bye?", "chosen": "Goodbye."}\n',
     "check_jsonl_lines"),
    ("csv", "train.csv", "prompt,chosen\nHi?,Hello.\n", "prompt,chosen\nBye?,Goodbye.\n", "check_csv_header")])
def test_a_file_written_while_it_is_read_is_loaded_under_the_hash_of_what_is_read(tmp_path, monkeypatch, kind, name,
                                                                                   old, new, read_by):
    """A JSON file's load hashed it once, before its check, and keyed its Arrow cache by that hash: a file written
    while it was checked (a first check, no pass kept) had its new rows cached under its old content's name, and a
    later load of the old content (its time kept, as datasets' own key has it) read the new rows. A CSV load, which
    hashes the file first (its first bytes read in that open) and then reads its record lines, did the same. A file
    whose stamp after that read is not the one it was hashed under is hashed again, and loaded under that hash."""
    from dschat.data import digests, reading

    on_file_system(monkeypatch, tmp_path, "ext4")  # (a file system whose change time a write sets)
    monkeypatch.setattr(digests, "RACY_WINDOW_NS", 0)  # (as if written long before: its hash kept)
    data = tmp_path / name
    data.write_text(old)
    times = os.stat(data)

    def write(text):
        data.write_text(text)
        os.utime(data, ns=(times.st_atime_ns, times.st_mtime_ns))  # (its time kept)

    read = getattr(reading, read_by)
    monkeypatch.setattr(reading, read_by, lambda path, *args: write(new) or read(path, *args))
    assert reading.load_file(kind, str(data))[0]["prompt"] == ["Bye?"]
    monkeypatch.setattr(reading, read_by, read)
    write(old)
    digests.forget_file_digests()  # (a later process)
    assert reading.load_file(kind, str(data))[0]["prompt"] == ["Hi?"]


def _check_json_in_child(args):
    """Runs in a forked process: check the JSON Lines file ``path`` (``reading.checked_json``) once both processes are
    ready, the check slowed and each one made written as a line to ``marker``; (record lines, key orders) back."""
    import time

    from dschat.data import digests, reading

    path, marker, barrier = args
    check = reading.check_jsonl_lines

    def slow_recorded_check(*check_args):
        time.sleep(1)  # (long enough for the other process to start checking too, where nothing stops it)
        with open(marker, "a") as f:
            f.write(f"{os.getpid()}\n")
        return check(*check_args)

    reading.check_jsonl_lines = slow_recorded_check
    barrier.wait()
    key_orders = reading._KeyOrders()
    lines, _ = reading.checked_json("jsonl", path, key_orders, digests.file_digest_and_stamp(path))
    return list(lines), key_orders.as_json()


def test_key_orders_are_written_the_same_whether_gathered_by_a_check_or_read_from_a_kept_one():
    """``_KeyOrders.as_json`` wrote a place's orders in its set's order, which follows how the set was filled: the
    process that checked a JSON file and one that read the kept check gave the same orders in different orders (CI
    failed on it once in ~16 runs). They are sorted now."""
    import itertools

    from dschat.data import reading

    gathered = reading._KeyOrders()
    for keys in itertools.permutations("abcd"):  # (24 orders: some share a slot of the set's table, whatever the seed)
        gathered.add({"meta": dict.fromkeys(keys, 1)})
    kept = json.loads(json.dumps(gathered.as_json()))
    read = reading._KeyOrders()
    read.add_kept({"meta": [[place, orders[::-1]] for place, orders in kept["meta"]]})  # (filled the other way)
    assert read.as_json() == kept
    assert kept["meta"][0][1] == sorted(kept["meta"][0][1])


def test_the_processes_of_a_node_check_a_json_file_once(tmp_path, monkeypatch):
    """On a first run every rank of a node checked the same JSON file at once (allenai/c4's en: ~5 h of CPU each),
    where the pass one keeps is read by the others. They take turns now (the kept hashes' lock per bucket): two
    processes checking one file at once check it once, and both get what the check gave."""
    import multiprocessing

    from dschat.data import digests

    on_file_system(monkeypatch, tmp_path, "ext4")  # (a file system whose change time a write sets)
    monkeypatch.setattr(digests, "RACY_WINDOW_NS", 0)  # (as if written long before)
    path, marker = tmp_path / "train.jsonl", tmp_path / "checked"
    path.write_text('{"prompt": "Hi?", "chosen": "Hello.", "meta": {"b": 1, "a": 2}}\n\n'
                    '{"prompt": "Hey?", "chosen": "Hello.", "meta": {"a": 1, "b": 2}}\n')
    digests.file_digest(str(path))  # (its hash kept: the processes only check it)
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Manager().Barrier(2)
    with ctx.Pool(2) as pool:
        results = pool.map(_check_json_in_child, [(str(path), str(marker), barrier)] * 2)
    assert len(marker.read_text().splitlines()) == 1
    assert results[0] == results[1] and results[0][0] == [1, 3]


def test_a_splits_records_that_passed_are_not_read_again_for_the_same_content_and_settings(tmp_path, monkeypatch):
    """Every load read every record through the accessors (``LocalDataset._validate``; ~7 s for 100 MB of JSON Lines
    on 2 CPU cores), each run, though the JSON check before it was kept by the file's content. The records' pass is
    kept now by the content of the split's files, the reader's settings and dschat.data's code: a later process,
    another seed or output folder, walks none of them; other settings (--data_fields) walk them again; a bad record
    keeps nothing, its error the same each time; a file whose hash later processes would not find is walked each
    time, as before."""
    from dschat.data import digests, local

    on_file_system(monkeypatch, tmp_path, "ext4")  # (a file system whose change time a write sets)
    monkeypatch.setattr(digests, "RACY_WINDOW_NS", 0)  # (as if written long before)
    walked = []
    read = local.LocalDataset.get_conversation
    monkeypatch.setattr(local.LocalDataset, "get_conversation", lambda self, sample: walked.append(1) or
                        read(self, sample))

    def walked_in_a_new_process(spec, seed=1234, **fields):
        digests.forget_file_digests()
        walked.clear()
        raw(spec, tmp_path / f"run{seed}", seed, **fields)
        return len(walked)

    records = [{**record, "meta": i if i % 2 else f"id{i}"} for i, record in enumerate(RECORDS)]  # (mixed types)
    (tmp_path / "data").mkdir()
    train = write_records(records, tmp_path / "data" / "train.jsonl", "jsonl")
    test = write_records(records[:5], tmp_path / "data" / "test.jsonl", "jsonl")
    folder = str(tmp_path / "data")
    assert walked_in_a_new_process(folder) == 25
    assert walked_in_a_new_process(folder, seed=7) == 0
    assert walked_in_a_new_process(folder, prompt="chosen", chosen="prompt") == 25
    assert walked_in_a_new_process(folder, prompt="chosen", chosen="prompt") == 0
    write_records(records[:4] + [{**records[4], "chosen": 5}], tmp_path / "data" / "test.jsonl", "jsonl")
    for _ in range(2):
        with pytest.raises(DatasetFormatError, match=rf"{re.escape(test)} line 5 \(record 4\): .*'chosen'"):
            walked_in_a_new_process(folder, seed=8)
    assert walked_in_a_new_process(train) == 0  # (the train file alone: its pass was kept)
    on_file_system(monkeypatch, tmp_path, "overlay")
    write_records(records[:10], tmp_path / "data" / "train.jsonl", "jsonl")
    assert [walked_in_a_new_process(train) for _ in range(2)] == [10, 10]



def _mixed_type_records(texts=("id", "7")):
    """RECORDS with a column of mixed types: a number in every other record, text in the others (a text that is JSON,
    "7", among them: it stays text)."""
    return [{**record, "meta": i if i % 2 else texts[i % 4 // 2]} for i, record in enumerate(RECORDS)]


def _parses_counted(monkeypatch):
    """The files that ``reading._json_records`` (the json module's parse of a whole file that rebuilds its mixed-type
    columns) parses, as a list to read and clear."""
    from dschat.data import reading

    parsed, parse = [], reading._json_records
    monkeypatch.setattr(reading, "_json_records", lambda kind, path: parsed.append(path) or parse(kind, path))
    return parsed


def test_a_files_mixed_type_columns_are_not_parsed_again_for_the_same_content_and_reading(tmp_path, monkeypatch):
    """A column of mixed types is rebuilt from the json module's parse of the whole file (``_exact_json_dataset``:
    datasets' Json type read the text "7" as the number 7), which every load made again (5-9 s of each warm load of
    100 MB of JSON Lines on 2 busy CPU cores), though the file's check and its datasets load were kept by its
    content. The rebuilt records are kept in datasets' cache by the file's content, how it is read and dschat.data's
    code: a later process parses none of it; another reading of it (as json, not jsonl; other code) or another
    content parses it again, and its new values are read."""
    from dschat.data import digests, reading

    on_file_system(monkeypatch, tmp_path, "ext4")  # (a file system whose change time a write sets)
    monkeypatch.setattr(digests, "RACY_WINDOW_NS", 0)  # (as if written long before)
    parsed = _parses_counted(monkeypatch)
    path = write_records(_mixed_type_records(), tmp_path / "train.jsonl", "jsonl")

    def meta_in_a_new_process(kind="jsonl"):
        digests.forget_file_digests()
        parsed.clear()
        data, _ = reading.load_file(kind, path)
        return list(data["meta"]), len(parsed)

    written = [record["meta"] for record in _mixed_type_records()]
    assert meta_in_a_new_process() == (written, 1)
    assert meta_in_a_new_process() == (written, 0)
    assert meta_in_a_new_process("json") == (written, 1)  # (another reading of it)
    with monkeypatch.context() as code:
        code.setattr(reading, "_data_code_digest", lambda: "other code")
        assert meta_in_a_new_process() == (written, 1)
    rewritten = [record["meta"] for record in _mixed_type_records(texts=("no", "[1]"))]
    write_records(_mixed_type_records(texts=("no", "[1]")), tmp_path / "train.jsonl", "jsonl")
    assert [meta_in_a_new_process() for _ in range(2)] == [(rewritten, 1), (rewritten, 0)]


def test_a_files_mixed_type_columns_alone_are_kept_beside_its_datasets_load(tmp_path):
    """The records rebuilt for a mixed-type column (``_exact_json_dataset``) were kept whole in datasets' cache, every
    column of them, beside datasets' own Arrow cache of the file: a mixed-type file was kept twice, neither copy
    pruned. The rebuilt columns alone are kept now; the others are datasets' load's, as written."""
    import glob

    import datasets
    import pyarrow

    from dschat.data import reading

    records = _mixed_type_records()
    path = write_records(records, tmp_path / "train.jsonl", "jsonl")
    data, _ = reading.load_file("jsonl", path)
    assert data.to_list() == [{name: record[name] for name in data.column_names} for record in records]
    kept = glob.glob(os.path.join(datasets.config.HF_DATASETS_CACHE, "generator", "*", "*", "*.arrow"))
    assert [pyarrow.ipc.open_stream(copy).schema.names for copy in kept] == [["meta"]]


def _meta_as_text(batch):
    return {"meta_text": [repr(value) for value in batch["meta"]]}


def test_a_map_of_a_files_mixed_type_columns_is_not_served_from_rows_rebuilt_by_other_code(tmp_path, monkeypatch):
    """A mixed-type file's dataset keeps its rows' fingerprint whatever code rebuilt them (``_exact_json_dataset``);
    datasets' map caches in the folder of its first cache file. Joined to datasets' load with that load's file first,
    a map was cached in the load's folder, not keyed by dschat.data's code: rows that other code rebuilt otherwise
    were served the map of the old rows. Its cache is the rebuilt columns' folder's, keyed by the code, as before."""
    from dschat.data import digests, reading

    path = write_records(_mixed_type_records(), tmp_path / "train.jsonl", "jsonl")

    def meta_and_its_map():
        digests.forget_file_digests()
        data, _ = reading.load_file("jsonl", path)
        return list(data["meta"]), list(data.map(_meta_as_text, batched=True)["meta_text"])

    written = [record["meta"] for record in _mixed_type_records()]
    assert meta_and_its_map() == (written, list(map(repr, written)))
    monkeypatch.setattr(reading, "_data_code_digest", lambda: "other code")  # (which rebuilds the values as lists)
    monkeypatch.setattr(reading, "_json_text", lambda value: None if value is None else json.dumps([value]))
    listed = [[value] for value in written]
    assert meta_and_its_map() == (listed, list(map(repr, listed)))


def test_a_shards_mixed_type_columns_are_not_parsed_again_for_the_same_content(tmp_path, monkeypatch):
    """A shard whose column is text alone, beside a shard where it has mixed types, is rebuilt as that one is
    (``_json_columns_alike``), from its parse: kept as a file's, by its content."""
    from dschat.data import digests, reading

    on_file_system(monkeypatch, tmp_path, "ext4")  # (a file system whose change time a write sets)
    monkeypatch.setattr(digests, "RACY_WINDOW_NS", 0)  # (as if written long before)
    parsed = _parses_counted(monkeypatch)
    records = _mixed_type_records()
    texts = [{**record, "meta": f"{i}"} for i, record in enumerate(RECORDS)]
    paths = [write_records(records, tmp_path / "train-00000-of-00002.jsonl", "jsonl"),
             write_records(texts, tmp_path / "train-00001-of-00002.jsonl", "jsonl")]

    def meta_in_a_new_process():
        digests.forget_file_digests()
        parsed.clear()
        data, _ = reading.load_split_files("jsonl", paths)
        return list(data["meta"]), sorted(parsed)

    written = [record["meta"] for record in records + texts]
    assert meta_in_a_new_process() == (written, sorted(paths))
    assert meta_in_a_new_process() == (written, [])


def test_a_files_mixed_type_columns_written_while_parsed_are_kept_under_no_content(tmp_path, monkeypatch):
    """A file written after it was hashed, before its mixed-type columns were parsed (or while), would keep the new
    records under the hash of the content it had before: put back as it was, that content would be read as the records
    written meanwhile. Nothing is kept then; the load gets the records as the file has them now."""
    from dschat.data import digests, reading

    on_file_system(monkeypatch, tmp_path, "ext4")  # (a file system whose change time a write sets)
    monkeypatch.setattr(digests, "RACY_WINDOW_NS", 0)  # (as if written long before)
    before, after = _mixed_type_records(), _mixed_type_records(texts=("no", "[1]"))
    path = write_records(before, tmp_path / "train.jsonl", "jsonl")
    parse = reading._json_records

    def written_while_parsed(kind, parsed_path):
        write_records(after, tmp_path / "train.jsonl", "jsonl")
        return parse(kind, parsed_path)

    digests.forget_file_digests()
    with monkeypatch.context() as writer:
        writer.setattr(reading, "_json_records", written_while_parsed)
        data, _ = reading.load_file("jsonl", path)
    assert list(data["meta"]) == [record["meta"] for record in after]
    write_records(before, tmp_path / "train.jsonl", "jsonl")
    digests.forget_file_digests()
    data, _ = reading.load_file("jsonl", path)
    assert list(data["meta"]) == [record["meta"] for record in before]


def test_a_hub_downloads_mixed_type_split_keeps_its_fingerprint_when_dschats_code_changes(tmp_path, monkeypatch):
    """A hub dataset read from its download is recorded by its splits' datasets fingerprints (``hub_data_fingerprint``:
    a finished step whose record differs now is trained again, "another revision in the HF datasets cache"). A split
    with a mixed-type column, rebuilt and kept in datasets' cache (``_exact_json_dataset``), took the key it was kept
    under, dschat.data's code in it, as its fingerprint: every change of that code, an upgrade, trained again the steps
    trained on it. The records are still rebuilt for other code; the fingerprint changes with their content alone."""
    from dschat.data import digests, reading
    from dschat.data.pipeline import hub_data_fingerprint
    from dschat.data.sources import hub_download_split

    parsed = _parses_counted(monkeypatch)
    path = write_records(_mixed_type_records(), tmp_path / "train-00000-of-00001.jsonl", "jsonl")

    def fingerprint_in_a_new_process():
        digests.forget_file_digests()
        parsed.clear()
        return hub_data_fingerprint({"train": hub_download_split([path])}), len(parsed)

    before, _ = fingerprint_in_a_new_process()
    with monkeypatch.context() as code:
        code.setattr(reading, "_data_code_digest", lambda: "other code")
        assert fingerprint_in_a_new_process() == (before, 1)
    write_records(_mixed_type_records(texts=("no", "[1]")), tmp_path / "train-00000-of-00001.jsonl", "jsonl")
    assert fingerprint_in_a_new_process()[0] != before


def test_a_splits_records_pass_is_pruned_once_any_of_its_files_is_written(tmp_path, monkeypatch):
    """A split's records' pass named its first file alone for pruning (``prune_kept_digests``): a pass of shards whose
    second was written since, which no process reads again (kept by the old content's hash), stayed for as long as
    the first was there as it was. It names all the split's files now, and goes once any of them is written."""
    import glob

    import datasets

    from dschat.data import digests, reading

    on_file_system(monkeypatch, tmp_path, "ext4")  # (a file system whose change time a write sets)
    monkeypatch.setattr(digests, "RACY_WINDOW_NS", 0)  # (as if written long before)
    shards = tmp_path / "shards"
    (shards / "data").mkdir(parents=True)
    write_records(RECORDS[:5], shards / "data" / "train-00000-of-00002.jsonl", "jsonl")
    write_records(RECORDS[5:10], shards / "data" / "train-00001-of-00002.jsonl", "jsonl")
    test = write_records(RECORDS[10:15], shards / "data" / "test-00000-of-00001.jsonl", "jsonl")
    digests.forget_file_digests()
    raw(str(shards), tmp_path)
    folder = os.path.join(datasets.config.HF_DATASETS_CACHE, reading.RECORDS_CHECK_MEMO_FOLDER)
    passes = glob.glob(os.path.join(folder, "*", "*"))
    assert len(passes) == 2  # (the train split's and the test split's)
    write_records(RECORDS[5:9], shards / "data" / "train-00001-of-00002.jsonl", "jsonl")  # (the second shard)
    digests.prune_kept_digests(folder)
    [kept] = glob.glob(os.path.join(folder, "*", "*"))
    assert [path for path, _ in digests._entry_files(kept)] == [test]


def test_a_splits_records_pass_is_kept_by_the_content_it_loaded_not_by_a_write_during_the_load(tmp_path, monkeypatch):
    """A split's records' pass was kept by the hashes of its files taken after the load (the eval split's after the
    train split's walk, seconds to minutes of it): an eval file written meanwhile kept the pass of the records loaded
    before the write under the new content's hash, and the next run took the new records, a bad one among them, as
    passed, unread. The pass is kept by the hashes the files were loaded by; a file written since keeps none."""
    from dschat.data import digests, local

    on_file_system(monkeypatch, tmp_path, "ext4")  # (a file system whose change time a write sets)
    monkeypatch.setattr(digests, "RACY_WINDOW_NS", 0)  # (as if written long before)
    (tmp_path / "data").mkdir()
    train = write_records(RECORDS, tmp_path / "data" / "train.jsonl", "jsonl")
    test = write_records(RECORDS[:5], tmp_path / "data" / "test.jsonl", "jsonl")
    validate = local.LocalDataset._validate

    def eval_file_written_during_the_train_walk(self, data, path, record_lines):
        validate(self, data, path, record_lines)
        if path == train:
            write_records(RECORDS[:4] + [{**RECORDS[4], "chosen": 5}], tmp_path / "data" / "test.jsonl", "jsonl")

    monkeypatch.setattr(local.LocalDataset, "_validate", eval_file_written_during_the_train_walk)
    digests.forget_file_digests()
    raw(str(tmp_path / "data"), tmp_path / "run1")  # (its eval split loaded before the write: it passes)
    monkeypatch.setattr(local.LocalDataset, "_validate", validate)
    digests.forget_file_digests()
    with pytest.raises(DatasetFormatError, match=rf"{re.escape(test)} line 5 \(record 4\): .*'chosen'"):
        raw(str(tmp_path / "data"), tmp_path / "run2")
