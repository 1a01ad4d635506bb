"""A ``--data_path`` spec resolved to a ``LocalSource``: its kind and its train and eval files (a folder's, a hub
download's layout, a split's shards).

Spec forms (one string per dataset in ``--data_path``)::

    jsonl:PATH  json:PATH  parquet:PATH  csv:PATH     one file
    TYPE:TRAIN_PATH,EVAL_PATH                         explicit eval file (same type)
    TYPE:DIR                                          DIR/train.EXT plus DIR/eval.EXT, test.EXT or validation.EXT
                                                      (its own extension: train.jsonl with eval.json; the first of
                                                      them there, the others said unread; eval.jsonl beside
                                                      eval.json, an error naming them); or, laid out as a
                                                      hub dataset's download, DIR/data/train-00000-of-00001.EXT
                                                      with its test file (a split of several files, its shards
                                                      train-0000K-of-0000N.EXT: all of them, read as one; a
                                                      hash after N too: train-00000-of-00001-HASH.EXT)
    disk:PATH                                         a save_to_disk folder: a DatasetDict (train plus
                                                      eval/test/validation) or a single Dataset
    PATH                                              a bare existing path; the extension (.jsonl, .json,
                                                      .parquet, .csv), a save_to_disk folder or the
                                                      DIR/train.EXT inside says what it is

A JSON or JSON Lines file compressed with gzip, bzip2 or xz and named so (x.jsonl.gz, x.json.bz2, x.jsonl.xz) is
"""
import collections
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from dschat.errors import MissingInputError, UsageError, given_as
from .base import splits_said
from .digests import all_files, file_digest_and_stamp
from .errors import DatasetFormatError
from .fields import EVAL_SPLIT_NAMES, EXTENSION_TYPES, LOCAL_TYPES, files_where
from .reading import (COMPRESSED_EXTENSIONS, PACKED_JSON, BinaryTable, _is_saved_dataset, binary_table_error,
                      binary_table_of, bytes_not_read_as, check_bytes_read_as, check_folder_not_compressed,
                      data_file_extensions, folder_fix, held_compression, load_split_files,
                      misnamed_compressed_error, read_as_command)


TINY_DATA_DIR = Path(__file__).resolve().parents[1] / "tiny" / "data"


@dataclass(frozen=True)
class LocalSource:
    """Where a local dataset's data lives: ``kind`` is one of LOCAL_TYPES; ``eval`` may be None, ``eval_kind`` its
    type where it differs (a folder's train.jsonl beside eval.json)."""
    kind: str
    train: str
    eval: str | None
    spec: str
    eval_kind: str | None = None
    unread_evals: tuple = ()  # (a folder's other eval files: test.jsonl read, validation.jsonl not; said on loading)
    more_train: tuple = ()  # (the train split's files after ``train``, where it is in shards: a hub dataset's download)
    more_eval: tuple = ()

    @property
    def train_files(self):
        return [self.train, *self.more_train]

    @property
    def eval_files(self):
        return [self.eval, *self.more_eval] if self.eval else []

    @property
    def train_where(self):
        """The train split's file, or its shards (``files_where``), for an error of its records as a whole (the
        embedded data by that name: its file is the package's, which the user never gave)."""
        return self._embedded_where("train") or files_where(self.train_files)

    @property
    def eval_where(self):
        return self._embedded_where("eval") or (files_where(self.eval_files) if self.eval else None)

    def _embedded_where(self, split):
        return f"the embedded tiny data ({split} split)" if self.spec == "tiny" else None  # (tiny_source's spec)

    @property
    def eval_type(self):
        return self.eval_kind or self.kind

    @property
    def files(self):
        return [*self.train_files, *self.eval_files]

    @property
    def name_clean(self):
        digest = hashlib.sha256("\n".join(os.path.abspath(p) for p in self.files).encode()).hexdigest()
        return f"local_{digest[:16]}"

    def fingerprint(self):
        """Path, size and content hash of every file, so an edited file gets a new cache key (even one whose size and
        time an edit kept)."""
        stats = []
        for path in self.files:
            for file in all_files(path):
                file = os.path.abspath(file)
                hashed = file_digest_and_stamp(file)  # (its size from the stamp hashed under: no stat more)
                stats.append([file, hashed.stamp.size if hashed.stamp else os.stat(file).st_size, hashed.sha256])
        return {"kind": self.kind, "files": stats, **({"eval_kind": self.eval_kind} if self.eval_kind else {})}


def tiny_source():
    """The embedded default data (``dschat/tiny/data/{train,eval}.jsonl``)."""
    source = _folder_source("jsonl", str(TINY_DATA_DIR), "tiny")
    if source is None:
        raise MissingInputError(f"the tiny dataset is missing: expected {TINY_DATA_DIR}/train.jsonl")
    return source


LOCAL_JSONFILE = "local/jsonfile"


def local_jsonfile_source(flag="--data_path"):
    """DeepSpeed-Chat's ``--data_path local/jsonfile``: data/train.json and data/eval.json (JSON arrays of
    prompt/chosen/rejected records), read under the folder the step runs in, as DeepSpeed-Chat reads them under its
    application folder. ``flag``: the one that gave it (a tool's --pairs_file), named where they are not there."""
    train, evaluation = (os.path.abspath(os.path.join("data", f"{name}.json")) for name in ("train", "eval"))
    missing = [path for path in (train, evaluation) if not os.path.isfile(path)]
    if missing:
        raise MissingInputError(f"{given_as(flag, LOCAL_JSONFILE)} (DeepSpeed-Chat's local data) reads "
                                f"data/train.json and data/eval.json in the current folder: {' and '.join(missing)} "
                                "not found; run from the folder that holds data/, or give json:TRAIN_PATH,EVAL_PATH")
    return LocalSource("json", train, evaluation, LOCAL_JSONFILE)


def resolve_local_spec(spec, flag="--data_path"):
    """A LocalSource for a local spec; None when ``spec`` is neither ``TYPE:...`` nor an existing path. ``flag``: the
    one that gave it (a tool's --pairs_file), named by its errors."""
    kind, sep, rest = spec.partition(":")
    if sep and kind.lower() in LOCAL_TYPES:  # (JSONL:path too)
        return _typed_source(kind.lower(), rest, spec, flag)
    paths = _split_paths(spec, flag)
    if not os.path.exists(paths[0]):
        if names_a_data_file(paths[0]):
            raise missing_data_path(spec, paths[0], flag)
        return None
    return _typed_source(_infer_kind(paths[0], data_spec_where(spec, paths[0], flag)), spec, spec, flag)


def names_a_data_file(path):
    """Whether ``path`` ends as a data file's name (x.jsonl, compressed too: x.jsonl.gz): meant as a file here, never a
    hub dataset's name."""
    return data_file_extensions(path)[0].lower() in EXTENSION_TYPES


def missing_data_path(spec, path, flag):
    """The error for a ``path`` of the data ``spec`` that is not there: "--data_path SPEC: no such file or folder", the
    path named after the spec where the spec says more (its type, an eval file). It said "jsonl:x.jsonl: x.jsonl does
    not exist" (or "data file not found: x.jsonl") naming no flag, in training and in the tools alike."""
    return MissingInputError(f"{data_spec_where(spec, path, flag)}: no such file or folder"
                             f"{unexpanded_home_note(spec, path)}")


def data_spec_where(spec, path, flag):
    """How an error names the ``path`` of the data ``spec``: after the flag that gave it ("--data_path SPEC"), and the
    path after the spec where the spec says more (its type, an eval file: "--data_path jsonl:DIR: DIR")."""
    return given_as(flag, spec) + ("" if path == spec else f": {path}")


def unexpanded_home_note(spec, path):
    """Where the ``path`` of ``spec`` starts with a ~ that names a path once expanded: the shell left it (it expands
    none after --flag= nor after TYPE:), and data paths are read as given; the spec meant is said."""
    expanded = os.path.expanduser(path)
    if expanded != path and os.path.exists(expanded):
        return (f" (the shell did not expand its ~, as after --flag= or a TYPE: prefix; give "
                f"{spec.replace(path, expanded, 1)})")
    return ""


def _split_paths(text, flag=None, spec=None):
    """The one or two paths (TRAIN_PATH,EVAL_PATH) of ``text``: the data ``spec``'s after its TYPE: (all of it where
    ``spec`` is None). A UsageError names the spec as typed (``flag``'s) and the path it lacks: ``--data_path jsonl:``
    was said as "--data_path : expected PATH or ...", its empty part after TYPE: alone."""
    spec = text if spec is None else spec
    paths = [part.strip() for part in text.split(",")]
    if len(paths) > 2 or not all(paths):
        prefix = spec[:len(spec) - len(text)]  # (the spec's "jsonl:", or "")
        # (quoted where blank or ending in ":": it read as "--data_path : ..." or "--data_path jsonl:: ...")
        shown = spec if spec.strip() and not spec.rstrip().endswith(":") else repr(spec)
        said = given_as(flag, shown) if flag else f"local data spec {spec!r}"
        raise UsageError(f"{said}: {_paths_lacking(paths, prefix)}; expected {prefix}PATH or "
                         f"{prefix}TRAIN_PATH,EVAL_PATH")
    return paths


def _paths_lacking(paths, prefix):
    """What the split ``paths`` of a data spec (``_split_paths``) lack, in words: ``prefix`` is its TYPE:, or ""."""
    if len(paths) > 2:
        return f"{len(paths)} comma-separated paths"
    if not any(paths):
        return f"no path after {prefix}" if prefix else "no path"
    return "no train path before the comma" if not paths[0] else "no eval path after the comma"


def _infer_kind(path, where):
    """The type of the data at ``path`` (a folder's or a file's), else an error naming it as ``where``
    (``data_spec_where``: with the flag that gave it)."""
    if os.path.isdir(path):
        if _is_saved_dataset(path):
            return "disk"
        kinds = [kind for kind in ("jsonl", "json", "parquet", "csv")
                 if os.path.isfile(os.path.join(path, f"train.{kind}"))]
        if len(kinds) > 1:  # (the first was read, the others not, without a word)
            raise UsageError(f"{where}: the folder holds {' and '.join(f'train.{kind}' for kind in kinds)}: which is "
                             f"the train data? keep one, or give TYPE:PATH ({kinds[0]}:{path})")
        if kinds:
            return kinds[0]
        hub_splits = _hub_split_files(path)
        if hub_splits:  # (the kind of its train files; _folder_source says what else is wrong)
            return hub_data_kind(hub_splits.get("train", [*hub_splits.values()][0])[0])
        check_folder_not_compressed(path, where)
        raise UsageError(f"{where}: cannot tell what the folder holds: it is not a save_to_disk folder and has no "
                         "train.jsonl/.json/.parquet/.csv; use TYPE:PATH")
    ext, packed = data_file_extensions(path)
    kind = EXTENSION_TYPES.get(ext.lower())
    tool = COMPRESSED_EXTENSIONS.get(os.path.splitext(path)[1].lower())
    # JSON compressed with gzip, bzip2 or xz is read decompressed (``open_data_file``); another compressed file is
    # said so (not "write jsonl:FILE", which then read it as text that is not UTF-8)
    if tool and not (packed and kind in ("json", "jsonl")):
        raise misnamed_compressed_error(path, tool, held_compression(path, tool), where)
    if kind is None:
        _check_not_a_binary_table(path, where)
        raise UsageError(f"{where}: cannot tell the format of the file from its extension; write jsonl:{path}, "
                         f"json:{path}, parquet:{path} or csv:{path}")
    return kind


def _check_not_a_binary_table(path, where):
    """A file whose extension names no data type that is a binary table by its bytes (a save_to_disk shard given by
    its path, data-00000-of-00001.arrow; x.feather, x.pq) is said to be one, with its fix (``binary_table_error``): it
    was told to be given as jsonl:, json:, parquet: or csv:, none of which reads an Arrow or Feather file, and what it
    is only by the next run. One that cannot be read is left to the error that follows."""
    try:
        table = binary_table_of(path)
    except OSError:
        return
    if table is not None:
        raise binary_table_error(path, None, table, where)


def _typed_source(kind, paths_text, spec, flag):
    source = _source_of_paths(kind, paths_text, spec, flag)
    # (one file given as TYPE:PATH: its type, not its name, is the one to change where its bytes say another)
    typed = paths_text.strip() if paths_text != spec and os.path.isfile(paths_text.strip()) else None
    files = [(file_kind, path) for file_kind, paths in ((source.kind, source.train_files),
                                                        (source.eval_type, source.eval_files))
             for path in paths if os.path.isfile(path)]
    folder = paths_text.strip() if os.path.isdir(paths_text.strip()) else None
    fix = folder and _folder_files_fix(files, folder if paths_text != spec else None)
    for file_kind, path in files:  # (said here, with the flag, before any step runs: loading said the file alone)
        check_bytes_read_as(file_kind, path, data_spec_where(spec, path, flag), typed=path == typed, fix=fix)
    return source


def _folder_files_fix(files, typed_folder=None):
    """The fix of a folder's ``files`` ((kind, path) each) whose bytes say they are not read as named
    (``read_as_command``: a Parquet train.csv, a gzip test.csv), all of them in one (``folder_fix``), where there are
    two or more, else None (one is told its own fix): a folder whose train.csv and test.csv were both Parquet was told
    of train.csv alone, and took a run for each. A folder given as TYPE:FOLDER (``typed_folder``: its path) is to be
    given again without the type, which its renamed files tell: csv:FOLDER again said "the folder has no
    train.csv"; so too where one file alone is renamed to another type (``_renames_a_type``: a Parquet train.csv)."""
    commands = [command for kind, path in files if (command := read_as_command(kind, path))]
    if len(commands) < 2 and not (typed_folder and _renames_a_type(files)):
        return None
    again = f"give it again as {typed_folder}, its type told by its files" if typed_folder else "give the folder again"
    return folder_fix(commands, "make its files read as what they are", again)


def _renames_a_type(files):
    """Whether a fix of ``files`` ((kind, path) each) renames one to another data type: a binary table read as
    another kind (``bytes_not_read_as``: a Parquet train.csv, to train.parquet). A compressed one keeps its name's
    type (train.csv of gzip: gunzip writes train.csv)."""
    return any(isinstance(bytes_not_read_as(kind, path), BinaryTable) for kind, path in files)


def _source_of_paths(kind, paths_text, spec, flag):
    paths = _split_paths(paths_text, flag, spec)
    for path in paths:
        if not os.path.exists(path):
            raise missing_data_path(spec, path, flag)
    if kind != "disk" and os.path.isdir(paths[0]):
        if len(paths) > 1:
            raise UsageError(f"{given_as(flag, spec)}: give either a folder or TRAIN_PATH,EVAL_PATH files, not both")
        source = _folder_source(kind, paths[0], spec, flag)
        if source is None:
            check_folder_not_compressed(paths[0], data_spec_where(spec, paths[0], flag))
            raise MissingInputError(f"{given_as(flag, spec)}: the folder has no train.{kind}")
        return source
    return LocalSource(kind, paths[0], paths[1] if len(paths) > 1 else None, spec)


def _folder_source(kind, folder, spec, flag=None):
    """``flag``: the one that gave ``spec``, named by its errors."""
    train = os.path.join(folder, f"train.{kind}")
    if not os.path.isfile(train):
        return _hub_layout_source(kind, folder, spec, flag)
    evaluation, unread = _folder_eval_file(folder, spec, flag)
    eval_kind = evaluation and hub_data_kind(evaluation)  # (test.jsonl.gz: jsonl)
    return LocalSource(kind, train, evaluation, spec, eval_kind if eval_kind != kind else None, unread)


# a file of one split as the hub stores a dataset's data (datasets' naming): train-00000-of-00001.parquet, or with a
# hash after the shard count, as datasets' older parquet exports wrote it (Dahoas/rm-static's
# train-00000-of-00001-2a1df75c6bce91ab.parquet; datasets' own pattern, SPLIT-00000-of-00001*.*, reads both), or as
# TFDS named allenai/c4's shards, the dataset's name before the split and a dot after it
# (c4-train.00000-of-01024.json.gz); a compression's extension may follow (``PACKED_JSON``)
_HUB_SPLIT_FILE = re.compile(r"(?:[^.]*-(?=(?:train|validation|test)\.))?"
                             r"(?P<split>.+?)[-.](?P<shard>\d{5})-of-(?P<shards>\d{5})(?P<suffix>-[^.]+)?"
                             r"(?P<ext>\.[A-Za-z]+)(?P<packed>\.[A-Za-z0-9]+)?\Z")


# the splits a hub dataset's subset folder holds (SUBSET/train.jsonl.gz), as datasets' default config finds them
_SUBSET_SPLIT_NAMES = ("train", *EVAL_SPLIT_NAMES)


def hub_data_kind(path):
    """The data type of a hub download's file by its name (train-00000-of-00001.parquet: parquet; train.jsonl.gz:
    jsonl), else None: a type dschat does not read, or one compressed that is not JSON (``PACKED_JSON``)."""
    ext, packed = data_file_extensions(path)
    kind = EXTENSION_TYPES.get(ext)
    return kind if not packed or kind in ("json", "jsonl") else None


def _hub_split_files(folder):
    """{split: [files]} of a folder laid out as a hub dataset's repository (what ``hf download --repo-type dataset
    NAME --local-dir FOLDER`` writes, and ``load_dataset(FOLDER)`` reads): FOLDER/data/SPLIT-00000-of-00001.EXT, the
    same beside data/, FOLDER/data/SPLIT.EXT, or FOLDER/SPLIT.EXT compressed (a subset's folder of such a download,
    Anthropic/hh-rlhf's helpful-base/train.jsonl.gz: FOLDER/train.EXT uncompressed is a folder of local files,
    ``_folder_source``); where it holds none of those, its subsets' SUBSET/SPLIT.EXT
    (Anthropic/hh-rlhf's harmless-base/train.jsonl.gz, stanfordnlp/SHP's askacademia/train.json), each split the files
    of every subset, joined in the folders' order, as the dataset's default config reads them. Only the data file
    types dschat reads count (``hub_data_kind``: JSON compressed too). A subfolder of shards is a config's
    (wikitext's wikitext-2-raw-v1/, c4's en/), which load_dataset reads only where it is named: never joined."""
    splits = {}
    _add_split_files(splits, os.path.join(folder, "data"), shards=True, plain="all")
    _add_split_files(splits, folder, shards=True, plain="compressed")
    if splits or not os.path.isdir(folder):
        return splits
    for entry in sorted(os.scandir(folder), key=lambda entry: entry.name):
        if entry.is_dir() and not entry.name.startswith("."):  # (not hf's own .cache/huggingface/)
            _add_split_files(splits, entry.path, shards=False, plain="all")
    return {split: files for split, files in splits.items() if split in _SUBSET_SPLIT_NAMES}


def hub_config_folders(folder):
    """The names (sorted) of the subfolders of a hub dataset's download that hold split files of their own
    (``_hub_split_files``): its configs' folders where its splits are not at its root (allenai/c4's en/ and
    realnewslike/, Salesforce/wikitext's wikitext-2-raw-v1/), which load_dataset reads one of, the one named."""
    if not os.path.isdir(folder):
        return []
    return sorted(entry.name for entry in os.scandir(folder)
                  if entry.is_dir() and not entry.name.startswith(".") and _hub_split_files(entry.path))


def _add_split_files(splits, where, shards, plain):
    """Add the files of the folder ``where`` that hold a split to ``splits`` ({split: [files]}): those named as its
    shards (``shards``: ``_HUB_SPLIT_FILE``), and those named SPLIT.EXT (``plain``: "all", "compressed" or None)."""
    if not os.path.isdir(where):
        return
    for name in sorted(os.listdir(where)):
        match = _HUB_SPLIT_FILE.match(name)
        ext, packed = data_file_extensions(name)
        split = (match["split"] if shards else None) if match else \
            name[:len(name) - len(ext + packed)] if plain == "all" or (plain == "compressed" and packed) else None
        if split and hub_data_kind(name) and os.path.isfile(os.path.join(where, name)):
            splits.setdefault(split, []).append(os.path.join(where, name))


def _hub_layout_source(kind, folder, spec, flag=None):
    """A LocalSource of a folder laid out as a hub dataset's repository (``_hub_split_files``): its train files, and
    its eval, test or validation files (the first there, as ``_folder_eval_file``); None where it holds no such files.
    A split of several files (shards, train-00000-of-00002.parquet and train-00001-of-00002.parquet) is read as one, as
    load_dataset(FOLDER) reads it (it was refused: "dschat reads one file per split"); one of which only some shards
    are there is read from those, and said (``check_download_splits``)."""
    splits = _hub_split_files(folder)
    if not splits:
        return None
    if "train" not in splits:
        named = sorted(splits, key=lambda name: not name.startswith("train"))[:2]  # (train_prefs before test_prefs)
        files = ",".join(os.path.relpath(splits[name][0]) for name in named)
        raise UsageError(f"{given_as(flag, spec)}: the folder holds a hub dataset's files of {splits_said(splits)}, "
                         f"{'not' if len(splits) == 1 else 'none of them'} train: give the files to read as "
                         f"TYPE:TRAIN_PATH,EVAL_PATH (e.g. {kind}:{files})")
    eval_names = [name for name in EVAL_SPLIT_NAMES if name in splits]
    check_subsets_alike(given_as(flag, spec), folder, splits, ["train", *eval_names[:1]])
    check_download_splits(given_as(flag, spec), folder, splits, ["train", *eval_names[:1]])
    train = splits["train"][0]
    if hub_data_kind(train) != kind:
        raise UsageError(f"{given_as(flag, spec)}: the folder's train data is {os.path.relpath(train)}, not {kind}")
    evaluation = splits[eval_names[0]] if eval_names else [None]
    unread = tuple(os.path.basename(path) for name in eval_names[1:] for path in splits[name])
    if _eval_files_named_plainly(folder, train, [path for name in eval_names for path in splits[name]]):
        # (a compressed train file at the top level, as a plain one: the top level of a download counts compressed
        # split files alone, so a plain eval file went unread, train.jsonl.gz beside eval.jsonl and test.jsonl.gz
        # evaluated on test.jsonl.gz, and test.jsonl beside test.jsonl.gz was no error)
        evaluation[0], unread = _folder_eval_file(folder, spec, flag)
    eval_kind = evaluation[0] and hub_data_kind(evaluation[0])
    say_subfolders_joined(spec, folder, [*splits["train"], *(evaluation if evaluation[0] else [])])
    return LocalSource(kind, train, evaluation[0], spec, eval_kind if eval_kind != kind else None, unread,
                       more_train=tuple(splits["train"][1:]), more_eval=tuple(evaluation[1:]))


def say_subfolders_joined(spec, folder, files):
    """A folder with no data files at its top level whose split files (``files``, those read) are in two or more of
    its subfolders (``_hub_split_files``: mydata/v1/train.jsonl and mydata/v2/train.jsonl, or a hub download's
    subsets) is read as one dataset, each split its subfolders' files joined: said on stdout, naming them, once per
    folder per process, so no two datasets are merged without a word (``spec``: the data as given)."""
    from dschat.utils.dist import print_rank_0_once

    top = {os.path.normpath(folder), os.path.normpath(os.path.join(folder, "data"))}
    subfolders = sorted({os.path.normpath(os.path.dirname(path)) for path in files} - top)
    if len(subfolders) < 2:
        return
    print_rank_0_once(("subfolders joined", os.path.realpath(folder)),
                      f"[dschat.data] {spec}: no data files at the folder's top level; the split files of its "
                      f"subfolders {', '.join(map(os.path.basename, subfolders))} are read as one dataset, each split "
                      "joined in that order")


def check_subsets_alike(where, folder, splits, names):
    """The splits ``names`` of a download whose splits are in subset folders (``_hub_split_files``: Anthropic/
    hh-rlhf's harmless-base/train.jsonl.gz) must each be in every subset of ``folder`` that holds any of them: a
    subset's test file missing (a download cut short) left its records out of the joined split, unsaid. ``splits``:
    {split: [files]}; ``where``: the data as its errors name it, after its flag."""
    held = {name: {os.path.dirname(path) for path in splits[name]} for name in names if name in splits}
    subsets = {subset for folders in held.values() for subset in folders} - {folder, os.path.join(folder, "data")}
    for name, folders in held.items():
        lacking = sorted(subsets - folders)
        if lacking:
            raise UsageError(f"{where}: the download's subsets {', '.join(map(os.path.relpath, lacking))} hold no "
                             f"{name} file, where its others do: a download cut short? download the dataset again "
                             "(all its files), or give a subset's folder to read it alone")


def hub_download_split(files):
    """A split of a hub dataset's download, its ``files`` (``_hub_split_files``, checked by the caller:
    ``check_download_splits``), read as a --data_path folder's split is, its shards (its subsets' files) read as one
    (``load_split_files``)."""
    return load_split_files(hub_data_kind(files[0]), files)[0]


def check_download_splits(where, folder, splits, names):
    """The splits ``names`` of the download at ``folder`` (``splits``: {split: [files]}, ``_hub_split_files``) checked
    (``_check_split_files``; ``where``: the data as its errors name it, after its flag). A split of which the download
    holds only some numbered shards is read from those, as a download of some of allenai/c4's 1024 shards
    (``hf download --include 'en/c4-train.0000[0-9]-of-01024.json.gz'``, the common way to use it: its en config is
    300+ GB) needs; how many of how many is said once (rank 0) per download folder and name given, so that no partial
    split is read unsaid (``where`` may name two: a relative path from another working directory, a name's download
    here and in the hub cache)."""
    from dschat.utils.dist import print_rank_0_once

    partial = [said for name in names if (said := _check_split_files(where, name, splits[name]))]
    if partial:
        print_rank_0_once(("partial download", where, os.path.realpath(folder), *partial),
                          f"[dschat.data] {where}: the download holds {', '.join(partial)}: reading those")


def _check_split_files(where, name, files):
    """A split's files (sorted) must be of one type, and in each folder (a subset's, as Anthropic/hh-rlhf's
    harmless-base/) one file, or shards SPLIT-0000K-of-0000N.EXT of one type and one N (``_check_shards``): two
    layouts of a split side by side, or a shard that is empty, is an error naming the files (and the data as
    ``where`` names it: after its flag). Returns "K of the N SPLIT shards" where only K of its N shards are there
    (a subset missing a split file is ``check_subsets_alike``'s error), else None."""
    if len({hub_data_kind(path) for path in files}) > 1:
        raise UsageError(f"{where}: the folder holds the {name} split in files of different types: "
                         f"{', '.join(os.path.relpath(path) for path in files)}; keep those of the split to read")
    present = total = 0
    for folder in dict.fromkeys(os.path.dirname(path) for path in files):
        counts = _check_shards(where, name, [path for path in files if os.path.dirname(path) == folder])
        present, total = (present + counts[0], total + counts[1]) if counts else (present + 1, total + 1)
    return f"{present} of the {total} {name} shards" if present < total else None


def _check_shards(where, name, files):
    """``_check_split_files`` of the split's files in one folder: (shards there, shards in all) of a split in
    numbered shards, None for one file of it. Some of the shards are a download of some (c4's); two shards of one
    number, shards of two totals, or an empty shard (a download cut short) are errors."""
    if len(files) == 1 and not _HUB_SPLIT_FILE.match(os.path.basename(files[0])):
        return None
    shards = [_HUB_SPLIT_FILE.match(os.path.basename(path)) for path in files]
    names = ", ".join(os.path.relpath(path) for path in files)
    if not all(shards) or len({(shard["ext"], shard["packed"]) for shard in shards}) > 1:
        raise UsageError(f"{where}: the folder holds the {name} split in the files {names}: one file, or the shards of "
                         f"one type named {name}-00000-of-0000N.EXT, is one split; keep those of the split to read")
    mixed = _shards_mixed(shards)
    if mixed:
        raise UsageError(f"{where}: the folder holds the {name} split in shards of more than one download ({mixed}): "
                         "keep those of one download of the split")
    empty = [os.path.relpath(path) for path in files if os.path.getsize(path) == 0]
    if empty:
        raise DatasetFormatError(f"{where}: {names_said(empty)} {'is' if len(empty) == 1 else 'are'} empty (0 bytes): "
                                 "a download cut short? download it again")
    return len(files), int(shards[0]["shards"])


def _shards_mixed(shards):
    """What makes the shard files ``shards`` (``_HUB_SPLIT_FILE`` matches) no set of one download's shards, else None:
    two totals, two files of one number (two exports, their hashes differing), a number past its total."""
    totals = sorted({int(shard["shards"]) for shard in shards})
    if len(totals) > 1:
        return f"shards of {' and '.join(map(str, totals))} in all"
    numbers = [int(shard["shard"]) for shard in shards]
    counts = collections.Counter(numbers)
    repeated = sorted(shard.string for shard, number in zip(shards, numbers) if counts[number] > 1)
    if repeated:
        return f"files of one shard number: {names_said(repeated)}"
    past = [shard.string for shard, number in zip(shards, numbers) if number >= totals[0]]
    return f"a shard number past the total: {names_said(past)}" if past else None


def names_said(names, most=4):
    """``names`` joined, the first ``most`` of more and how many others (a download of 2 of allenai/c4's 1024 shards
    lacks 1022)."""
    if len(names) <= most:
        return ", ".join(names)
    return f"{', '.join(names[:most - 1])} and {len(names) - most + 1} others"


def _folder_eval_file(folder, spec, flag=None):
    """(the folder's eval file, the other eval files it holds, not read): eval, test or validation, the first of them
    there, with any of the file extensions, JSON's compressed too (``_split_file_names``: test.jsonl.gz) (train.jsonl
    beside eval.json: the eval file was not looked for, and the train file was split 90/10). A folder of train,
    validation and test files (a hub dataset's splits written out) evaluates on test, as a save_to_disk DatasetDict of
    them does, and says so (``LocalDataset`` on loading); one name with two extensions (eval.jsonl and eval.json) is
    an error naming them: either may be the eval data."""
    for name in EVAL_SPLIT_NAMES:
        found = [os.path.join(folder, file) for file in _split_file_names(name)
                 if os.path.isfile(os.path.join(folder, file))]
        if len(found) > 1:
            names = " and ".join(os.path.basename(path) for path in found)
            raise UsageError(f"{given_as(flag, spec)}: the folder holds {names}, and one file is the eval data: give "
                             f"it as TYPE:TRAIN_PATH,EVAL_PATH, or keep one of them in the folder")
        if found:
            later = EVAL_SPLIT_NAMES[EVAL_SPLIT_NAMES.index(name) + 1:]
            unread = tuple(file for other in later for file in _split_file_names(other)
                           if os.path.isfile(os.path.join(folder, file)))
            return found[0], unread
    return None, ()


def _eval_files_named_plainly(folder, train, eval_files):
    """Whether the eval file of ``folder``, whose hub-layout train file is ``train``, is ``_folder_eval_file``'s, as
    beside a plain train.EXT: ``train`` lies at the folder's top level (train.jsonl.gz), and each eval split file
    found (``eval_files``) lies there too and is no shard (test-00000-of-00002.jsonl.gz: a download's, read as its
    splits). One in data/ (data/test.jsonl) is read as found: ``_folder_eval_file`` looks at the top level alone, and
    the train file was split 90/10 without a word."""
    return os.path.samefile(os.path.dirname(train), folder) and all(
        os.path.samefile(os.path.dirname(path), folder) and not _HUB_SPLIT_FILE.match(os.path.basename(path))
        for path in eval_files)


def _split_file_names(name):
    """The names a folder's file of the split ``name`` may have: NAME.EXT of each type dschat reads, and JSON's
    compressed as it reads them (``PACKED_JSON``: test.jsonl.gz beside train.jsonl was not looked for, and the train
    file was split 90/10)."""
    return [name + extension + packed for extension, kind in EXTENSION_TYPES.items()
            for packed in ("", *(PACKED_JSON if kind in ("json", "jsonl") else ()))]
