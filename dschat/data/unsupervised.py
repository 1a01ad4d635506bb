"""Unsupervised (pretraining-style) data for step 3's PTX loss, as in DeepSpeed-Chat.

``unsupervised_dataset_name`` is a hub dataset (``datasets.load_dataset(name, config)``; its ``text``
column, else its first column, as DeepSpeed-Chat does), a folder written by ``save_to_disk`` (its train split) or a
hub dataset's download (``hf download --local-dir``: its train split files, in the config's folder when given), a
local file with a ``text`` field: ``text:PATH`` / a ``.txt`` path (one document per line), ``jsonl:PATH`` /
``.jsonl``, ``json:PATH`` / ``.json`` (JSON compressed too: ``.jsonl.gz``), ``csv:PATH`` / ``.csv``, ``parquet:PATH`` /
``.parquet``, or ``tiny``: the embedded data's prompts and chosen answers as documents. The texts are tokenized,
concatenated and cut into blocks of ``max_prompt_seq_len + max_answer_seq_len`` tokens, each document ended by the EOS
token (the remainder of each map batch is dropped). Blank documents (empty or whitespace-only lines of a .txt file,
say) are skipped, and counted in the data report as the prompt data's skipped records are.
"""
import contextlib
import os
import re

from dschat.errors import MissingInputError, UsageError, given_as
from .base import hub_cache_snapshot, load_hub_dataset_else_download, splits_said
from .digests import all_files, file_digest
from .errors import DatasetFormatError
from .pipeline import print_skip_lines
from .reading import (COMPRESSED_EXTENSIONS, caused_by, check_bytes_read_as, compressed_with, decompress_command,
                      holds_no_bytes, load_content_keyed, load_file, not_utf8_error, only_blank_lines, record_where,
                      text_encoding)
from .sources import data_spec_where

# (CSV and parquet as the prompt data's files: a .csv or .parquet path was looked up on the hub)
LOCAL_TEXT_TYPES = {"text": "text", "txt": "text", "jsonl": "jsonl", "json": "json", "csv": "csv", "parquet": "parquet"}


def get_unsupervised_data(args, tokenizer):
    """Train dataset of dicts (input_ids, attention_mask, labels), each a LongTensor of one block.

    ``args``: a namespace or dict with unsupervised_dataset_name, unsupervised_dataset_config_name,
    max_prompt_seq_len, max_answer_seq_len and optionally preprocessing_num_workers.
    """
    options = vars(args) if not isinstance(args, dict) else args
    block_size = int(options["max_prompt_seq_len"]) + int(options["max_answer_seq_len"])
    workers = options.get("preprocessing_num_workers")
    name = options["unsupervised_dataset_name"]
    config_name = options.get("unsupervised_dataset_config_name")
    train, text_column = load_unsupervised_train(name, config_name)
    record = unsupervised_data_record(name, config_name, train)
    locate = getattr(train, "locate_record", None) or (lambda index: f"--unsupervised_dataset_name {name} record {index}")
    documents = without_blank_documents(train, text_column, locate, workers)
    blank = len(train) - len(documents)
    if len(documents) == 0:  # (else 0 blocks, said only after tokenizing, as too little text for a batch)
        raise DatasetFormatError(f"--unsupervised_dataset_name {name}: all {len(train)} of its documents are blank "
                                 "(empty or whitespace only): no text to train on")
    report = [{"source": f"--unsupervised_dataset_name {name}", "split": "train", "total": len(train),
               "skipped": {BLANK_DOCUMENT: blank} if blank else {}}]

    def tokenize(batch):
        return with_eos(tokenizer(batch[text_column], return_token_type_ids=False), tokenizer.eos_token_id)

    tokenized = documents.map(tokenize, batched=True, num_proc=workers, remove_columns=documents.column_names,
                              desc="Tokenizing unsupervised data")
    blocks = tokenized.map(lambda batch: group_texts(batch, block_size), batched=True, num_proc=workers,
                           desc=f"Grouping texts in blocks of {block_size}").with_format("torch")
    blocks.data_record = record  # (what step 3's checkpoints record of it)
    blocks.skip_report = report
    print_skip_lines(options.get("local_rank") or 0, 3, report)
    return blocks


BLANK_DOCUMENT = "blank text (empty or whitespace only)"


def without_blank_documents(train, text_column, locate, workers=None):
    """``train`` without its blank documents: a whitespace-only line of a .txt file was a document of its own (its
    spaces and an EOS trained on). A text that is no string is its record's error (the tokenizer's TypeError names
    neither the file nor the record)."""
    def keep(batch, indices):
        texts = batch[text_column]
        for index, text in zip(indices, texts):
            if not isinstance(text, str):
                said = "missing or null" if text is None else f"expected a string, got {type(text).__name__}"
                raise DatasetFormatError(f"{locate(index)}: field {text_column!r}: {said}")
        return [bool(text.strip()) for text in texts]

    return train.filter(keep, batched=True, with_indices=True, num_proc=workers, desc="Skipping blank documents")


def unsupervised_data_record(name, config_name=None, train=None):
    """What ``--unsupervised_dataset_name name`` reads, for step 3's checkpoints and output to record and a resume to
    compare, as the prompt data's files and hub data are: {"files": {path: sha256} of a local file or save_to_disk
    folder, "hub": {name: datasets fingerprint of its train split} (which another revision in the HF datasets cache
    changes)}; the embedded ``tiny`` documents hold neither. ``train``: the hub split already loaded (else loaded)."""
    if name == "tiny":
        return {"files": {}, "hub": {}}
    local = _local_text_source(name)
    if local is not None or os.path.isdir(name):
        paths = all_files(local[1]) if local is not None else local_copy_files(name, config_name)
        return {"files": {os.path.abspath(path): file_digest(path) for path in paths}, "hub": {}}
    if train is None:
        train, _ = load_unsupervised_train(name, config_name)
    return {"files": {}, "hub": {name: train._fingerprint}}


def local_copy_files(folder, config_name=None):
    """The files ``local_copy_train`` reads of ``folder``: a save_to_disk folder's (not the files datasets' map writes
    there: the tokenizing of this very run or another rank's), a download's train files (not its other configs' nor
    hf's own metadata)."""
    from .reading import _is_saved_dataset
    from .sources import _hub_split_files

    if _is_saved_dataset(folder):
        return [path for path in all_files(folder) if not written_by_map(os.path.basename(path))]
    return _hub_split_files(download_folder(folder, config_name)).get("train", [])


def written_by_map(file_name):
    """Whether a file of a save_to_disk folder is one datasets' ``map`` writes there: its cache files (``cache-*``)
    and the temporary file it writes each through (``tempfile``'s ``tmp`` and 8 characters), which lies there while a
    map runs, e.g. another rank's tokenizing of the same folder (or stays after one was killed)."""
    return file_name.startswith("cache-") or re.fullmatch(r"tmp[a-z0-9_]{8}", file_name) is not None


def changed_unsupervised_data(saved, now):
    """The files and hub dataset of two ``unsupervised_data_record``s that differ, as a resume says them."""
    from .raw_datasets import changed_names

    return changed_names(saved.get("files", {}), now.get("files", {})) + \
        [f"{name} (another revision in the HF datasets cache)"
         for name in changed_names(saved.get("hub", {}), now.get("hub", {}))]


def with_eos(tokenized, eos_token_id):
    """The documents' ``input_ids`` and ``attention_mask`` (the keys the blocks keep), each non-empty document ended
    by the EOS token unless the tokenizer ended it already, as OpenRLHF's and Megatron's pretraining data do:
    concatenated into blocks, one document otherwise ran on into the next ("apple doneEnd your reply") and the model
    learnt to continue across them."""
    rows = tokenized["input_ids"]
    masks = tokenized.get("attention_mask") or [[1] * len(ids) for ids in rows]
    for ids, mask in zip(rows, masks):
        if eos_token_id is not None and ids and ids[-1] != eos_token_id:
            ids.append(eos_token_id)
            mask.append(1)
    return {"input_ids": rows, "attention_mask": masks}


def group_texts(batch, block_size):
    """Concatenate a batch's token lists and cut them into ``block_size`` blocks; labels = input_ids."""
    concatenated = {key: [token for row in rows for token in row] for key, rows in batch.items()}
    total = len(next(iter(concatenated.values()), []))
    if total >= block_size:  # drop the remainder; a batch shorter than one block stays one short block
        total = (total // block_size) * block_size
    blocks = {key: [values[i:i + block_size] for i in range(0, total, block_size)]
              for key, values in concatenated.items()}
    blocks["labels"] = [list(block) for block in blocks["input_ids"]]
    return blocks


def load_unsupervised_train(name, config_name=None):
    """(train Dataset, text column) for a hub name, a save_to_disk folder, a local text/JSON file or ``tiny``."""
    if name == "tiny":
        return _tiny_documents(), "text"
    local = _local_text_source(name)
    if local is None:
        train = local_copy_train(name, config_name) if os.path.isdir(name) else load_hub_train(name, config_name)
        return train, "text" if "text" in train.column_names else train.column_names[0]
    kind, path = local
    check_local_file(name, kind, path)
    # read as the prompt data's files are: a JSON string that is valid JSON ("null", "[1, 2]") in a column of mixed
    # types stays a string (datasets' Json feature decoded it, and blamed its record for the one of another type)
    train, record_lines = _text_file_lines(path) if kind == "text" else load_file(kind, path)
    if "text" not in train.column_names:
        raise DatasetFormatError(f"{path}: unsupervised data needs a 'text' field; the records have "
                                 f"{train.column_names}")
    train.locate_record = lambda index: record_where(path, index, record_lines)
    return train, "text"


def check_unsupervised_file(name, config_name=None):
    """A local ``--unsupervised_dataset_name`` file that is missing, empty or only blank lines, or a hub dataset's
    download folder without the train files of the config ``config_name`` (or with an empty shard of them), is an
    error naming it: train.py checks before step 1 trains (step 3 read it after steps 1 and 2). A download's files
    are not read here (allenai/c4's en/ is 1024 shards): step 3 reads them."""
    from .reading import _is_saved_dataset

    local = _local_text_source(name) if name and name != "tiny" else None
    if local is not None:
        check_local_file(name, *local)
    elif name and name != "tiny" and os.path.isdir(name) and not _is_saved_dataset(name):
        local_download_train_files(name, config_name)


def check_local_file(name, kind, path):
    """A local ``--unsupervised_dataset_name`` file dschat cannot read is an error naming the flag: compressed
    otherwise than JSON named so (docs.jsonl.gz, read decompressed) or a .txt, which the text reader decompresses, or
    a binary table not of its type (a Parquet file named docs.jsonl or docs.txt: the .txt was said "UTF-16?" or "not
    UTF-8") (``check_bytes_read_as``; the error named the file alone, when step 3 loaded it), or without text
    (``check_has_text``). ``name`` given as TYPE:PATH is told the type to give, not the name."""
    check_bytes_read_as(kind, path, data_spec_where(name, path, "--unsupervised_dataset_name"), typed=name != path)
    check_has_text(name, kind, path)


def check_has_text(name, kind, path):
    """A local file of ``kind`` at ``path`` that is empty or holds only blank lines is an error naming it: datasets'
    own error for an empty one names neither file nor cause, and a text file's blank lines were each skipped as a
    blank document, which left no block to train on, said only after tokenizing."""
    with named_by_the_flag(name, path):  # (a compressed file's text, docs.jsonl.gz: one not decompressing is said)
        empty = holds_no_bytes(path)
        blank = not empty and kind != "parquet" and only_blank_lines(path)
    if empty:
        raise DatasetFormatError(f"--unsupervised_dataset_name {name}: {path} is empty")
    if blank:
        raise DatasetFormatError(f"--unsupervised_dataset_name {name}: {path} has only blank lines: no documents")


@contextlib.contextmanager
def named_by_the_flag(name, path):
    """A data error said while the file ``path`` of --unsupervised_dataset_name ``name`` is read (by its path:
    ``open_data_file``'s), named with the flag (``data_spec_where``) as the other unsupervised errors are: a
    docs.jsonl.gz that does not decompress was said by its path alone."""
    try:
        yield
    except DatasetFormatError as err:
        where = data_spec_where(name, path, "--unsupervised_dataset_name")
        raise DatasetFormatError(f"{where}: {str(err).removeprefix(f'{path}: ')}") from err


def _text_file_lines(path):
    """(Dataset of a text file's lines as its "text" column, None: no record lines to say)."""
    encoding = text_encoding(path)  # (its own error, outside the one below that says the load's)
    try:
        return _without_line_start_marks(load_content_keyed("text", path, encoding=encoding)), None
    except Exception as err:  # name the file; pyarrow's messages do not
        if caused_by(err, UnicodeDecodeError):  # (datasets says only "An error occurred while generating the dataset")
            tool = compressed_with(path)  # (datasets unpacks a compressed text file: its bytes are not the text's)
            if tool:
                raise DatasetFormatError(f"{path}: the text compressed in it ({tool}) is not UTF-8: decompress it "
                                         f"({decompress_command(path, tool)}) and save the text as UTF-8") from err
            raise not_utf8_error(path) from err
        raise DatasetFormatError(f"{path}: could not be read as text: {err}") from err


BYTE_ORDER_MARK = "\ufeff"


def _without_line_start_marks(lines):
    """A text file's lines without a UTF-8 byte-order mark at their start: files joined with ``cat`` keep each later
    file's mark at the start of its first line, which was trained on as that document's text (the file's own first
    mark is read as the encoding's). The lines are searched by arrow's vectorised starts_with: reading each one into
    Python (``lines["text"]``, row by row) took 6 s a million lines, most often to find none."""
    import pyarrow.compute as pc

    if not pc.any(pc.starts_with(lines.data.column("text"), BYTE_ORDER_MARK)).as_py():
        return lines
    return lines.map(lambda batch: {"text": [text.lstrip(BYTE_ORDER_MARK) if text else text for text in batch["text"]]},
                     batched=True, desc="Removing byte-order marks")


def load_hub_train(name, config_name=None, flag="--unsupervised_dataset_name"):
    """The train split of the hub dataset ``name`` (``config_name``'s), as step 3 reads it: from datasets' cache, else,
    offline, from its download in the hub cache (``load_hub_dataset_else_download``, as the prompt data's); an error
    names ``flag`` (train.py's pre-flight: the --step3-args that gave it). Read offline in a ``reads_kept(HUB_CACHES)``
    block (train.py's pre-flight, then its step 3), loaded once."""
    from dschat.models.loading import hub_unavailable

    from .raw_datasets import HUB_CACHES, hub_caches_stamp, read_once

    def key():
        stamp = hub_caches_stamp(name)
        return stamp and ("unsupervised train", config_name, stamp)  # (not the prompt data's splits of the name)

    def read_download(folder, copy):
        return downloaded_train(name, folder, copy, flag)

    def load():
        try:
            return load_hub_dataset_else_download(name, flag, read_download, config_name, split="train")
        except MissingInputError:
            snapshot = hub_unavailable() and hub_cache_snapshot(name)
            if snapshot:  # (downloaded, with no config named or not the one named: said so, not "not in the cache")
                check_config_named(given_as(flag, name), snapshot, config_name,
                                   f"not in the datasets cache, and its download in the hub cache ({snapshot})",
                                   f"hf download --repo-type dataset {name}")
            raise

    return read_once(HUB_CACHES, key, load)


def downloaded_train(name, folder, copy, flag="--unsupervised_dataset_name"):
    """The train split of a download of the hub dataset ``name`` at ``folder`` (the config's folder of it: c4's en/;
    ``copy``: it as errors say it), its shards read as one, as a --data_path folder's are (``hub_download_split``); an
    error names ``flag``."""
    from .sources import hub_download_split

    return hub_download_split(download_train_files(name, folder, copy, flag))


def download_train_files(name, folder, copy, flag="--unsupervised_dataset_name"):
    """``downloaded_train``'s files, checked (``sources.check_download_splits``: some of its shards are read, and
    said), not read."""
    from .sources import _hub_split_files, check_download_splits

    splits = _hub_split_files(folder)
    if "train" not in splits:
        held = f"holds {splits_said(splits)}, not train, which unsupervised data reads" if splits else \
            "is neither a save_to_disk folder nor a download of a hub dataset's repository (no train split files there)"
        raise DatasetFormatError(f"{given_as(flag, name)}: {copy} {held}: download all its files (hf download "
                                 f"--repo-type dataset {name}), or give its train file as --unsupervised_dataset_name")
    check_download_splits(given_as(flag, name), folder, splits, ["train"])
    return splits["train"]


def local_copy_train(folder, config_name=None):
    """The train split of a folder given as --unsupervised_dataset_name: a save_to_disk folder's, else a download's of
    a hub dataset's repository there (``hf download --repo-type dataset allenai/c4 --local-dir allenai/c4``, which
    DeepSpeed-Chat's load_dataset reads by its path), in the folder of ``config_name`` when given (en/), as its
    download in the hub cache is read (``downloaded_train``); it was load_from_disk's traceback, "neither a `Dataset`
    directory nor a `DatasetDict` directory"."""
    from .reading import _is_saved_dataset
    from .sources import hub_download_split

    if _is_saved_dataset(folder):
        return _saved_train_split(folder)
    return hub_download_split(local_download_train_files(folder, config_name))


def local_download_train_files(folder, config_name=None):
    """The train files of the download at ``folder`` (``local_copy_train``'s), in the folder of ``config_name``,
    checked (``check_config_named``, ``download_train_files``), not read."""
    check_config_named(given_as("--unsupervised_dataset_name", folder), folder, config_name, "the download here",
                       f"hf download --repo-type dataset NAME --local-dir {folder}")
    return download_train_files(folder, download_folder(folder, config_name), "the download here")


def check_config_named(where, download, config_name, copy, command):
    """A hub dataset's download at ``download`` (``copy``: it as errors say it, after ``where``: the flag and name)
    whose data is in its configs' folders (``hub_config_folders``: allenai/c4's en/, realnewslike/) is read in the
    folder of the config named: none named, or one it does not hold, is an error naming the configs it holds and the
    flag that names one (the hub cache's was "not in the datasets cache ... download it", the folder here "neither a
    save_to_disk folder nor a download"). ``command``: the one that downloads it, said with the config's folder."""
    from .sources import _hub_split_files, hub_config_folders, names_said

    if _hub_split_files(download_folder(download, config_name)):
        return
    configs = hub_config_folders(download)
    if not configs:  # (no config's data either: the caller says what the download lacks)
        return
    if config_name is None:
        raise UsageError(f"{where}: {copy} keeps each config's data in a folder of its own ({names_said(configs)}): "
                         "name the one to read with --unsupervised_dataset_config_name")
    raise MissingInputError(f"{where}: {copy} holds no config {config_name} (its configs: {names_said(configs)}): "
                            f"download it ({command} --include '{config_name}/*'), or name one of those with "
                            "--unsupervised_dataset_config_name")


def download_folder(folder, config_name=None):
    """The folder of a download's ``config_name`` (c4's en/), else the download's own."""
    return os.path.join(folder, config_name) if config_name else folder


def reads_the_hub(name):
    """Whether --unsupervised_dataset_name ``name`` is a hub dataset (not tiny, a local file or a save_to_disk
    folder). A local file's name that is not there is its error (``_local_text_source``)."""
    return bool(name) and name != "tiny" and _local_text_source(name) is None and not os.path.isdir(name)


def _tiny_documents():
    import json

    from datasets import Dataset

    from dschat.tiny import TRAIN_FILE

    with open(TRAIN_FILE, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return Dataset.from_dict({"text": [f"{r['prompt']} {r['chosen']}" for r in records]})


def _saved_train_split(folder):
    from datasets import DatasetDict, load_from_disk

    saved = load_from_disk(folder)
    if not isinstance(saved, DatasetDict):
        return saved
    if "train" not in saved:
        raise DatasetFormatError(f"{folder}: unsupervised data needs a 'train' split; the folder has {list(saved)}")
    return saved["train"]


def _local_text_source(name):
    """(kind: "text" or one of fields.LOCAL_TYPES, path) for "TYPE:PATH" or a .txt/.jsonl/.json/.csv/.parquet path, also
    compressed (corpus.txt.gz; one not there: MissingInputError); None for hub names and save_to_disk folders."""
    kind, sep, rest = name.partition(":")
    if sep and kind.lower() in LOCAL_TEXT_TYPES:  # (TXT:path too)
        if not os.path.isfile(rest):
            raise MissingInputError(f"--unsupervised_dataset_name {name}: unsupervised data file not found: {rest}")
        return LOCAL_TEXT_TYPES[kind.lower()], rest
    stem, packed = os.path.splitext(name)
    # (a compressed file, corpus.txt.gz, by the extension under its compressor's: it was looked up on the hub; the
    # text reader decompresses it, and JSON's reader, named so (docs.jsonl.gz); the others say it is compressed)
    extension = os.path.splitext(stem if packed.lower() in COMPRESSED_EXTENSIONS else name)[1].lstrip(".").lower()
    # (no hub name ends so: a mistyped file is not looked up on the hub; a save_to_disk folder's name may)
    if extension in LOCAL_TEXT_TYPES and not os.path.isdir(name):
        if not os.path.isfile(name):
            raise MissingInputError(f"--unsupervised_dataset_name {name}: unsupervised data file not found")
        return LOCAL_TEXT_TYPES[extension], name
    return None
