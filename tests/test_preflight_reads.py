"""train.py's pre-flight reads each data file once, and the steps it runs in-process read no local copy of a hub
dataset again that it loaded, nor a hub dataset it loaded offline from the caches."""
import os
import re
import runpy
from collections import Counter
from pathlib import Path

import pytest

from dschat.data import digests, reading
from dschat.steps import common, sft
from launch import REPO


class Ran(Exception):
    pass


def counted_reads(monkeypatch):
    """{file: how many times its records were read} (``reading.load_file``: every local file's, and a hub dataset's
    download's)."""
    reads, load_file = Counter(), reading.load_file
    monkeypatch.setattr(reading, "load_file", lambda kind, path: reads.update([os.path.realpath(path)]) or
                        load_file(kind, path))
    return reads


def stop_at_training_records(monkeypatch):
    """A step run stopped where its tokenized data is ready (``common.require_training_records`` raises Ran). The
    steps ``run_pipeline`` runs are imported first: one it first imported while the patch was in place (ppo, which
    imports the name) kept the raiser for the rest of the process, and a later test's step 3 raised Ran."""
    from dschat.steps import dpo, ppo, reward, sft  # noqa: F401

    monkeypatch.setattr(common, "require_training_records", lambda *a, **k: (_ for _ in ()).throw(Ran()))


def train_py_args(argv):
    return runpy.run_path(str(REPO / "train.py"))["parse_args"](argv)


def test_train_pys_pre_flight_reads_the_tiny_data_once_for_every_steps_check(tmp_path, distributed, monkeypatch):
    """Steps 1, 2 and 3 of the tiny default: the pre-flight checked step 1's answers, step 2's pairs and step 3's
    prompts each by reading the data anew (each read parses and validates every record): three reads of each file."""
    from dschat import pipeline
    from dschat.tiny import EVAL_FILE, TRAIN_FILE

    reads = counted_reads(monkeypatch)
    monkeypatch.setattr(sft, "main", lambda argv: (_ for _ in ()).throw(Ran()))
    with pytest.raises(Ran):
        pipeline.run_pipeline(train_py_args(["--output-dir", str(tmp_path / "out")]))
    assert reads == {os.path.realpath(TRAIN_FILE): 1, os.path.realpath(EVAL_FILE): 1}


def test_train_pys_pre_flight_reads_each_local_file_once_however_many_steps_check_it(tmp_path, distributed,
                                                                                     monkeypatch):
    """A user's file read by the pre-flight's checks of steps 1 and 2 once; what was read is let go with the
    pre-flight (the next one reads the file anew)."""
    from dschat import pipeline
    from dschat.args import step1_parser, step2_parser

    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "Hi?", "chosen": " Hello.", "rejected": " No."}\n' * 8)
    args = train_py_args(["--step", "1", "2", "--output-dir", str(tmp_path / "out"), "--data-path", str(data)])
    reads = counted_reads(monkeypatch)
    for times in (1, 2):
        pipeline.check_step_args([1, 2], args, True, {1: step1_parser, 2: step2_parser})
        assert reads == {str(data.resolve()): times}


def test_a_kept_read_of_a_file_written_since_is_read_again(tmp_path, monkeypatch):
    """A file written after it was read (another size or time) is read anew, its records checked: not the kept
    records of its earlier content."""
    from dschat.data.errors import DatasetFormatError
    from dschat.data.raw_datasets import LOCAL_FILES, get_raw_dataset, reads_kept

    data = tmp_path / "sft.jsonl"
    data.write_text('{"prompt": "Hi?", "chosen": " Hello."}\n' * 4)
    reads = counted_reads(monkeypatch)
    with reads_kept(LOCAL_FILES):
        for _ in range(2):
            get_raw_dataset(str(data), None, 1234, -1).check_usable(1)
        assert reads == {str(data.resolve()): 1}
        data.write_text('{"prompt": "Hi?"}\n' * 4)
        with pytest.raises(DatasetFormatError, match="has prompts but no answers"):
            get_raw_dataset(str(data), None, 1234, -1).check_usable(1)
    assert reads == {str(data.resolve()): 2}


def test_step_1_reads_no_local_copy_of_a_hub_dataset_again_that_train_pys_pre_flight_loaded(tmp_path, distributed,
                                                                                            monkeypatch):
    """A download of Dahoas/rm-static at ./Dahoas/rm-static given to step 1: the pre-flight loaded it (its splits
    checked before step 1 runs), and step 1, run in the same process, read all its files again."""
    import pandas as pd

    from dschat import pipeline

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "Dahoas" / "rm-static" / "data"
    folder.mkdir(parents=True)
    for split in ("train", "test"):
        pd.DataFrame([{"prompt": f"\n\nHuman: Hi {i}?\n\nAssistant:", "response": " Hello.", "chosen": " Hello.",
                       "rejected": " No."} for i in range(8)]).to_parquet(folder / f"{split}-00000-of-00001.parquet")
    reads = counted_reads(monkeypatch)
    stop_at_training_records(monkeypatch)
    with pytest.raises(Ran):  # (step 1 ran up to its tokenized data)
        pipeline.run_pipeline(train_py_args(["--step", "1", "--output-dir", str(tmp_path / "out"),
                                             "--data-path", "Dahoas/rm-static"]))
    assert reads == {str(folder.resolve() / f"{split}-00000-of-00001.parquet"): 1 for split in ("train", "test")}


def test_a_kept_copy_whose_data_folder_is_a_link_is_read_again_once_its_files_are_written(tmp_path, monkeypatch):
    """./Dahoas/rm-static/data a link to the folder that holds the download's files (kept elsewhere): datasets reads
    through the link, but the copy's files were listed without entering it (pathlib's rglob does not), so its stamp
    held no file: one written since was not noticed, and the kept splits of its old records were read (as the
    tokenized-data cache's key, ``LocalSource.fingerprint``, held none of their content)."""
    import pandas as pd

    from dschat.data.sources import LocalSource
    from dschat.data.raw_datasets import HUB_COPIES, get_raw_dataset, reads_kept

    def write_split(split, rows):
        pd.DataFrame([{"prompt": f"\n\nHuman: Hi {i}?\n\nAssistant:", "response": " Hello.", "chosen": " Hello.",
                       "rejected": " No."} for i in range(rows)]).to_parquet(shared / f"{split}-00000-of-00001.parquet")

    monkeypatch.chdir(tmp_path)
    shared = tmp_path / "shared" / "rm-static"
    shared.mkdir(parents=True)
    for split in ("train", "test"):
        write_split(split, 8)
    (tmp_path / "Dahoas" / "rm-static").mkdir(parents=True)
    (tmp_path / "Dahoas" / "rm-static" / "data").symlink_to(shared, target_is_directory=True)
    copy = LocalSource("disk", "Dahoas/rm-static", None, "Dahoas/rm-static")
    before = copy.fingerprint()
    with reads_kept(HUB_COPIES):
        assert len(get_raw_dataset("Dahoas/rm-static", None, 1234, -1).get_train_data()) == 8
        write_split("train", 5)
        assert len(get_raw_dataset("Dahoas/rm-static", None, 1234, -1).get_train_data()) == 5
    assert copy.fingerprint() != before


def test_a_link_up_out_of_a_data_folder_is_not_walked(tmp_path):
    """A data folder's files walked into its linked folders (``digests.all_files``) stop at a link back to the folder or
    up to one holding it: the walk would not end, or would list (and hash) every file above it."""
    folder = tmp_path / "data" / "copy"
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "part.arrow").write_text("x")
    (tmp_path / "data" / "other.arrow").write_text("y")
    (folder / "train" / "back").symlink_to(folder, target_is_directory=True)
    (folder / "up").symlink_to(tmp_path / "data", target_is_directory=True)
    assert digests.all_files(str(folder)) == [str(folder / "train" / "part.arrow")]


def write_rm_static_in_datasets_cache(tmp_path):
    """Dahoas/rm-static in datasets' cache, as a load from the hub leaves it (``write_hub_revision``)."""
    import datasets
    from test_data_pipeline import hub_rows, write_hub_revision

    write_hub_revision(Path(datasets.config.HF_DATASETS_CACHE), "aaaa", hub_rows(" Hello."))
    return {}


def write_rm_static_in_hub_cache(tmp_path):
    """Dahoas/rm-static downloaded into the hub cache (hf download without --local-dir): {its shard: 1}."""
    import pandas as pd

    snapshot = tmp_path / "hub" / "datasets--Dahoas--rm-static" / "snapshots" / ("0" * 40)
    (snapshot / "data").mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    shards = [snapshot / "data" / f"{split}-00000-of-00001.parquet" for split in ("train", "test")]
    for shard in shards:
        pd.DataFrame([{"prompt": f"\n\nHuman: Hi {i}?\n\nAssistant:", "response": " Hello.", "chosen": " Hello.",
                       "rejected": " No."} for i in range(8)]).to_parquet(shard)
    return {str(shard.resolve()): 1 for shard in shards}


@pytest.mark.parametrize("write", [write_rm_static_in_datasets_cache, write_rm_static_in_hub_cache])
def test_step_1_loads_no_hub_dataset_again_that_train_pys_pre_flight_loaded_offline(tmp_path, distributed,
                                                                                   monkeypatch, write):
    """train.py --data-path Dahoas/rm-static offline (the tests' HF_HUB_OFFLINE=1), the dataset in datasets' cache or
    downloaded into the hub cache: the pre-flight loaded it (check_hub_data_at_hand) and step 1, run in the same
    process, loaded it again (the download's files read again); a revision added since is loaded anew."""
    from huggingface_hub import constants

    from dschat import pipeline
    from dschat.data import base

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    shard_reads = write(tmp_path)
    loads, load_hub_dataset = [], base.load_hub_dataset
    monkeypatch.setattr(base, "load_hub_dataset", lambda name, *a, **k: loads.append(name) or
                        load_hub_dataset(name, *a, **k))
    reads = counted_reads(monkeypatch)
    stop_at_training_records(monkeypatch)
    argv = ["--step", "1", "--output-dir", str(tmp_path / "out"), "--data-path", "Dahoas/rm-static"]
    with pytest.raises(Ran):  # (step 1 ran up to its tokenized data)
        pipeline.run_pipeline(train_py_args(argv))
    assert loads == ["Dahoas/rm-static"] and reads == shard_reads


def test_a_kept_hub_dataset_read_offline_is_loaded_again_once_a_revision_is_added(tmp_path, monkeypatch):
    """Kept while the caches hold what they held: a revision added to datasets' cache since (which datasets loads,
    the latest) is loaded, not the kept one."""
    import time

    import datasets

    from dschat.data import base
    from dschat.data.raw_datasets import HUB_CACHES, get_raw_dataset, reads_kept
    from test_data_pipeline import hub_rows, write_hub_revision

    hf_cache = Path(datasets.config.HF_DATASETS_CACHE)
    write_hub_revision(hf_cache, "aaaa", hub_rows(" Hello."))
    loads, load_hub_dataset = [], base.load_hub_dataset
    monkeypatch.setattr(base, "load_hub_dataset", lambda name, *a, **k: loads.append(name) or
                        load_hub_dataset(name, *a, **k))

    def chosen():
        return get_raw_dataset("Dahoas/rm-static", None, 1234, -1).get_train_data()[0]["chosen"]

    with reads_kept(HUB_CACHES):
        assert [chosen(), chosen()] == [" Hello.", " Hello."] and len(loads) == 1
        os.utime(hf_cache / "Dahoas___rm-static" / "default" / "0.0.0" / "aaaa", (time.time() - 60,) * 2)
        write_hub_revision(hf_cache, "bbbb", hub_rows(" Hello again."))
        assert chosen() == " Hello again." and len(loads) == 2


def test_a_kept_hub_datasets_stamp_holds_the_folder_datasets_caches_it_in(tmp_path, monkeypatch):
    """datasets keeps stanfordnlp/SHP's Arrow files under stanfordnlp___shp (the name's last part snake-cased, as its
    offline load looks for them): the stamp looked in stanfordnlp___SHP, never there, so a revision added to datasets'
    cache inside a block was not loaded, the kept one was."""
    import datasets
    from huggingface_hub import constants

    from dschat.data.raw_datasets import hub_caches_stamp

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    before = hub_caches_stamp("stanfordnlp/SHP")
    revision = Path(datasets.config.HF_DATASETS_CACHE) / "stanfordnlp___shp" / "default" / "0.0.0" / "aaaa"
    revision.mkdir(parents=True)
    (revision / "shp-train.arrow").write_bytes(b"arrow")
    assert hub_caches_stamp("stanfordnlp/SHP") != before


def test_a_hub_dataset_read_with_the_hub_at_hand_is_not_kept(reachable_hub):
    """Online, a load may fetch a revision the caches lack: nothing identifies it before it is loaded."""
    from dschat.data.raw_datasets import hub_caches_stamp

    assert hub_caches_stamp("Dahoas/rm-static") is None


def test_step_3_loads_no_unsupervised_hub_data_again_that_train_pys_pre_flight_loaded_offline(tmp_path, distributed,
                                                                                             monkeypatch, tokenizer):
    """--step3-args '--unsupervised_dataset_name wikitext --unsupervised_dataset_config_name wikitext-2-raw-v1'
    offline, downloaded into the hub cache: the pre-flight loaded its train split (check_hub_data_at_hand), and step 3,
    in the same block (run_pipeline's), loaded it again, its shards read again."""
    from types import SimpleNamespace

    import pandas as pd
    from huggingface_hub import constants

    from dschat import pipeline
    from dschat.data import base
    from dschat.data.raw_datasets import HUB_CACHES, reads_kept
    from dschat.data.unsupervised import get_unsupervised_data

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    config = tmp_path / "hub" / "datasets--wikitext" / "snapshots" / ("0" * 40) / "wikitext-2-raw-v1"
    config.mkdir(parents=True)
    (config.parents[2] / "refs").mkdir()
    (config.parents[2] / "refs" / "main").write_text("0" * 40)
    shards = [config / f"train-0000{shard}-of-00002.parquet" for shard in range(2)]
    for shard in shards:
        pd.DataFrame({"text": [f"Document {i} of {shard.name}." for i in range(6)]}).to_parquet(shard)
    loads, load_hub_dataset = [], base.load_hub_dataset
    monkeypatch.setattr(base, "load_hub_dataset", lambda name, *a, **k: loads.append(name) or
                        load_hub_dataset(name, *a, **k))
    reads = counted_reads(monkeypatch)
    flags = {"unsupervised_dataset_name": "wikitext", "unsupervised_dataset_config_name": "wikitext-2-raw-v1"}
    with reads_kept(HUB_CACHES):
        pipeline.check_hub_data_at_hand(SimpleNamespace(), {3: SimpleNamespace(**flags)})
        blocks = get_unsupervised_data({**flags, "max_prompt_seq_len": 6, "max_answer_seq_len": 4}, tokenizer)
    assert len(blocks) > 0 and loads == ["wikitext"] and reads == {str(shard.resolve()): 1 for shard in shards}


def test_a_local_file_spelled_otherwise_is_read_once_and_named_as_each_spelling_gives_it(tmp_path, monkeypatch):
    """./prompts.jsonl, jsonl:prompts.jsonl and its absolute path read the same file: the pre-flight read it for each
    spelling (--data-path as one, a step's --data_path as another). Read once now; each reader names its spelling."""
    from dschat.data.errors import DatasetFormatError
    from dschat.data.raw_datasets import LOCAL_FILES, get_raw_dataset, reads_kept

    monkeypatch.chdir(tmp_path)
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "Hi?"}\n' * 4)
    reads = counted_reads(monkeypatch)
    with reads_kept(LOCAL_FILES):
        for spec in ("./prompts.jsonl", "jsonl:prompts.jsonl", str(data), "json:prompts.jsonl"):
            with pytest.raises(DatasetFormatError, match=rf"^{re.escape(spec)}: has prompts but no answers"):
                get_raw_dataset(spec, None, 1234, -1).check_usable(1)
    assert reads == {str(data.resolve()): 2}  # (read as JSON Lines, and as a JSON document: another reader)
