"""Local data files as a ``PromptRawDataset``.

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
read, in each of these forms, as the file decompressed, and checked so (``open_data_file``).

Without an eval file or split, the train data is split 90/10 with the seed (DeepSpeed-Chat's rule for
hub datasets that have no eval split), and the indices are cached under ``output_path``.

Record shapes (field names changeable with ``field_options``, e.g. from ``--data_fields
prompt=question,chosen=good``, or one mapping per dataset: ``parse_data_fields``):

* ``prompt`` + ``chosen`` [+ ``rejected``]: strings. ``prompt`` is the user message; a prompt that starts
  with "Human:" is read as a "Human:/Assistant:" transcript; ``prompt`` may also be a list of messages.
  Without a ``chosen`` field the data is prompt-only (step 3 only). A null ``rejected`` marks an SFT-only
  record (skipped, and counted, in step 2). TRL's ``completion`` is the ``chosen`` answer; a ``label`` column
  beside it (TRL's unpaired preference records, KTO's) marks the answers not to imitate, which steps 1 and 2 skip.
* ``messages``: a list of {role, content} ending with the assistant answer (SFT data; ShareGPT's
  ``conversations`` of {from, value} too, LLaMA-Factory's "function_call" and "observation" turns as tool calls and
  results; step 3's prompt is the turns before that answer, which its reward functions get as ``chosen``); one
  ending with a user turn is a prompt (step 3), skipped and counted by
  steps 1 and 2 (step 1's ``--multiturn`` trains its assistant turns before it). An assistant message's ``weight``
  (OpenAI's chat fine-tuning format) is 0 or 1: a turn of weight 0 is not trained (``--multiturn`` leaves it prompt;
  one that is the last turn makes the record a counted skip without ``--multiturn``). Tool calling (TRL's SFT data):
  an assistant message's ``tool_calls``, a tool's result as a message of role ``tool`` (or ``ipython``), the record's
  tool schemas in a ``tools`` column (``--data_fields tools=NAME``; OpenAI's older ``function_call``, role
  ``function`` and ``functions`` column read as these), rendered by the chat template
  (``apply_chat_template(tools=...)``; a template that leaves them out, or none, is the record's error when it is
  encoded); the answer follows the tool's result, or is the call itself where the conversation ends with one
  (function-calling data), and a prompt may end with a tool's result.
* ``chosen`` + ``rejected`` as message lists and no ``prompt`` (TRL's preference format), or as whole
  "\\n\\nHuman: ...\\n\\nAssistant: ..." transcripts (Anthropic/hh-rlhf's files): the turns before the last are
  the prompt and must be the same in both; the last (assistant) turns are the answers. Plain strings are TRL's
  implicit prompt: the words both begin with are the prompt ("The sky is" of "The sky is blue." and "... green.").
  ``chosen``/``rejected`` may be message lists next to a ``prompt`` too (TRL's explicit-prompt format).
* Alpaca's ``instruction`` [+ ``input``, ``history``] + ``output`` (LLaMA-Factory's default format; ``chosen`` and
  ``rejected`` for pairs): read as prompt records, the input joined after the instruction, the history's pairs the
  turns before (``LocalDataset._read_alpaca_columns``); under ``--data_fields`` naming the prompt, an input and
  history only where it names them (``input=NAME``, ``history=NAME``).

A ``system`` column (LLaMA-Factory's; ``--data_fields system=NAME``) is the conversation's first message, its system
prompt, beside any of these shapes; under ``--data_fields`` naming the record fields, only where it names it
(``LocalDataset._system_column``).

CSV cells are read as text ("5" stays "5"; an empty cell is null; a Windows file's "\\r\\n" line ends in a cell as
"\\n"), the header's names without the spaces around them; JSON values are kept as written, also in a column whose
type differs between records or whose objects write their keys in another order in another record (``_as_written``;
parquet and save_to_disk data hold one key order per column, the one they were written with). Every other column is
passed through ``get_extra``. Records are checked when the file is loaded: a malformed JSON line raises
``DatasetFormatError("FILE line N: ...")``; a missing/null/empty/wrongly typed field raises one naming the file, the
record (and its line where known: JSON Lines, CSV) and the field.
"""
import ast
import bz2
import collections
import contextlib
import copy
import functools
import gzip
import hashlib
import json
import lzma
import os
import re
import shlex
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dschat.errors import MissingInputError, UsageError, excerpt, given_as
from dschat.utils.files import atomic_file
from .base import (MARGIN_FIELD, ROLE_ALIASES, SHAREGPT_ROLES, TOOL_ROLES, VALID_ROLES, PromptRawDataset,
                   answer_from_transcript, checked_messages, final_assistant_answer, optional_text, prompt_messages,
                   required_text, splits_said, trimmed, untrained_turns, without_none_values)
from .errors import DatasetFormatError, EndsWithUser, RecordError, SkipRecord, UntrainedAnswer
from .formatting import parse_transcript, with_lf_line_ends

LOCAL_TYPES = ("jsonl", "json", "parquet", "csv", "disk")
EXTENSION_TYPES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
EVAL_SPLIT_NAMES = ("eval", "test", "validation")
FIELD_NAMES = ("prompt", "chosen", "rejected", "messages")
TINY_DATA_DIR = Path(__file__).resolve().parents[1] / "tiny" / "data"
_TRANSCRIPT_TURN = re.compile(r"(?:\A|\s)Assistant:")
_PROMPT_AFTER_PREAMBLE = re.compile(r"\n\nHuman: ")


def parse_field_map(text):
    """ "prompt=question,chosen=good" -> {"prompt": "question", "chosen": "good"} (for --data_fields). The
    per-dataset form (``parse_data_fields``) is refused here: it names datasets this one file is not one of."""
    fields = parse_data_fields(text)
    if fields.by_dataset:
        raise UsageError(f"--data_fields {text}: one mapping of this data's fields is read here, not one per dataset "
                         f"({', '.join(map(repr, fields.by_dataset))}): give it as 'prompt=question,chosen=good'")
    return fields.default


def _parsed_field_map(text, spec=None):
    """``spec``: the dataset it is given for, said in an error."""
    mapping = {}
    for item in str(text).split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key or not value:
            raise UsageError(f"--data_fields item {item!r} must look like 'prompt=question'")
        mapping[key] = value
    try:
        return checked_field_options(mapping)
    except UsageError as error:
        raise UsageError(f"--data_fields{f' (of {spec})' if spec else ''}: {error}") from None


@dataclass(frozen=True)
class DataFields:
    """--data_fields parsed: ``default`` renames the fields of every local dataset that has no mapping of its own;
    ``by_dataset`` {spec as given in --data_path: mapping} those of one dataset each (two files of other column
    names, e.g. question/answer beside instruction/output, read in one run). A dataset is matched by what it reads
    (``dataset_identity``): ``./data/x.jsonl`` names the --data_path entry ``jsonl:data/x.jsonl``."""
    default: dict
    by_dataset: dict

    def for_spec(self, spec):
        name = self._name_of(spec)
        return dict(self.default if name is None else self.by_dataset[name])

    def _name_of(self, spec):
        """The dataset of ``by_dataset`` that ``spec`` is (as written, else another spelling of it), else None."""
        if spec in self.by_dataset:
            return spec
        identity = dataset_identity(spec)
        return next((name for name in self.by_dataset if dataset_identity(name) == identity), None)

    def check_names(self, specs, flags="--data_path", fields_flag="--data_fields"):
        """Every dataset named is one of ``specs`` (a typo, or a path to other files than ``flags``' give, renamed
        nothing, unsaid), named once (two spellings of one file: which mapping was meant?), and a local one (a hub
        dataset's fields are fixed): a UsageError naming it, and these fields as ``fields_flag`` (train.py's
        --data-fields)."""
        given = {dataset_identity(spec): spec for spec in specs}
        named = {}
        for name in self.by_dataset:
            identity = dataset_identity(name)
            if identity not in given:
                raise UsageError(f"{fields_flag}: {name!r} is not a dataset of {flags} ({', '.join(specs) or 'none'}"
                                 f"): name each dataset as written there")
            if identity in named:
                raise UsageError(f"{fields_flag}: {named[identity]!r} and {name!r} are one dataset ({given[identity]} "
                                 f"of {flags}), given two mappings: give it one")
            named[identity] = name
            if _is_hub_name(name):
                raise UsageError(f"{fields_flag}: {name!r} is a hub dataset, whose fields are fixed: its fields "
                                 "cannot be renamed")

    def of_datasets(self, specs):
        """This mapping with only the datasets among ``specs`` named (a step given some of them)."""
        given = {dataset_identity(spec) for spec in specs}
        return DataFields(self.default, {name: mapping for name, mapping in self.by_dataset.items()
                                         if dataset_identity(name) in given})

    def anchored(self, anchor):
        """This mapping with each dataset's name as ``anchor`` gives it (``anchored_data_path``'s)."""
        return DataFields(self.default, {anchor(spec): mapping for spec, mapping in self.by_dataset.items()})

    def as_text(self):
        """The --data_fields text of this mapping (the per-dataset form where it has one)."""
        groups = [",".join(f"{key}={value}" for key, value in self.default.items())] if self.default else []
        groups += [f"{spec}:" + ",".join(f"{key}={value}" for key, value in mapping.items())
                   for spec, mapping in self.by_dataset.items()]
        return ";".join(groups)

    def cache_params(self, data_path, sft_only):
        """What the data cache is keyed by: the one mapping (as before the per-dataset form), else each source's."""
        if not self.by_dataset:
            return self.default
        return {"data_path": [self.for_spec(spec) for spec in data_path],
                "sft_only": [self.for_spec(spec) for spec in sft_only]}


def dataset_identity(spec):
    """What the --data_path entry ``spec`` reads, as --data_path resolves it: a local dataset's kind and its files'
    absolute paths (as ``LocalSource.fingerprint`` records them), so that ``./data/x.jsonl``, ``data/x.jsonl``,
    ``jsonl:data/x.jsonl`` and a folder with or without its trailing '/' are one; a hub name, or a spec that resolves
    to nothing (a missing file: its loader's error to say, not this question's), is its text."""
    from .raw_datasets import resolve_dataset_spec

    try:
        source = resolve_dataset_spec(spec)
    except UsageError:
        return spec
    if isinstance(source, type):
        return spec
    return source.kind, source.eval_type, tuple(os.path.abspath(path) for path in source.files)


def all_among(specs, others):
    """Whether every dataset of ``specs`` is one of ``others`` (by what it reads: ``dataset_identity``)."""
    given = {dataset_identity(spec) for spec in others}
    return all(dataset_identity(spec) in given for spec in specs)


def same_datasets(then, now, then_folder=None):
    """Whether the --data_path (or --sft_only_data_path) ``then`` (a run's record; its relative paths from
    ``then_folder``, None: this folder's) reads what ``now`` reads, dataset by dataset: ``./x.jsonl`` is
    ``jsonl:x.jsonl`` (``dataset_identity``; compared as text, a resume reran a finished step, or refused its
    checkpoint, over the same files)."""
    from .raw_datasets import anchored_spec

    then, now = ([value] if isinstance(value, str) else list(value or []) for value in (then, now))
    try:
        anchored = [anchored_spec(spec, then_folder) for spec in then] if then_folder is not None else then
    except UsageError:  # (a spec no run could have given: compared as written)
        return then == now
    return len(then) == len(now) and all(dataset_identity(old) == dataset_identity(new)
                                         for old, new in zip(anchored, now))


def same_data_fields(then, now, then_folder=None):
    """Whether the --data_fields ``then`` (a run's record; its datasets' relative paths from ``then_folder``, None:
    this folder's) rename as ``now`` do: parsed (``as_data_fields``: the notebook API's dict is the text it stands
    for), so that the order of the datasets' mappings and of a mapping's fields, spaces, and another spelling of a
    dataset's path change nothing (compared as text, a resume reran a finished step, or refused its checkpoint, over
    the same renaming)."""
    try:
        return _renaming(then, then_folder) == _renaming(now, None)
    except UsageError:  # (a text no run could have given: compared as written)
        return then == now


def _renaming(text, folder):
    """--data_fields ``text`` as what it renames: its default mapping, and each dataset's by what it reads."""
    from .raw_datasets import anchored_spec

    fields = as_data_fields(text)
    if folder is not None:
        fields = fields.anchored(lambda spec: anchored_spec(spec, folder))
    return fields.default, {dataset_identity(spec): mapping for spec, mapping in fields.by_dataset.items()}


def _is_hub_name(spec):
    """Whether ``spec`` names a hub dataset (a missing local file is its loader's error to say, not this question's)."""
    from .raw_datasets import resolve_dataset_spec

    try:
        return isinstance(resolve_dataset_spec(spec), type)
    except UsageError:
        return False


def parse_data_fields(text):
    """--data_fields as a ``DataFields``: one mapping for every dataset ("prompt=question,chosen=good"), or one per
    dataset, ';' between them, each after its dataset (as in --data_path, or another path to its files) and a ':'
    ("jsonl:qa.jsonl:prompt=question,chosen=answer;jsonl:alpaca.jsonl:prompt=instruction,chosen=output"), with at
    most one mapping of no dataset for the others. A dataset named twice, or two mappings of no dataset, is a
    UsageError (which one was meant?)."""
    if not text:
        return DataFields({}, {})
    groups = [group.strip() for group in str(text).split(";") if group.strip()]
    if not any(_names_a_dataset(group) for group in groups):
        return DataFields(_parsed_field_map(text), {})  # (a ';' in a column's name, as before)
    default, by_dataset = None, {}
    for group in groups:
        if not _names_a_dataset(group):
            if default is not None:
                raise UsageError(f"--data_fields: two mappings name no dataset ({default_text!r} and {group!r}): "
                                 "give one, for the datasets that have none of their own")
            default, default_text = _parsed_field_map(group), group
            continue
        spec, mapping = _dataset_and_mapping(group)
        if spec in by_dataset:
            raise UsageError(f"--data_fields: the dataset {spec!r} is given two mappings: give it one")
        by_dataset[spec] = _parsed_field_map(mapping, spec) if mapping else {}
    return DataFields(default or {}, by_dataset)


def as_data_fields(value):
    """--data_fields ``value`` as a ``DataFields``: its text (``parse_data_fields``), or the notebook API's dict, one
    mapping {field: column} or one per dataset {dataset: {field: column}} (a checkpoint's or a run's record of a
    notebook's run holds it so)."""
    if value is None or isinstance(value, str):
        return parse_data_fields(value)
    mapping = dict(value)
    per_dataset = [isinstance(fields, dict) for fields in mapping.values()]
    if any(per_dataset) and not all(per_dataset):
        raise UsageError(f"data_fields {mapping}: give one mapping {{field: column}}, or one per dataset {{dataset: "
                         f"{{field: column}}}}, not both")
    if any(per_dataset):
        return DataFields({}, {spec: checked_field_options(fields) for spec, fields in mapping.items()})
    return DataFields(checked_field_options(mapping), {})


def _names_a_dataset(group):
    """Whether a group of --data_fields starts with its dataset: a field's name between a ':' and its first '='
    (``SPEC:prompt=...``), or a ':' that ends it (``SPEC:``, renaming nothing). Another ':' is a column's name of the
    old form: "prompt=x;y:z" renames the prompt to the column "x;y:z", as before the per-dataset form."""
    if "=" not in group:
        return group.rstrip().endswith(":")
    return _split_at_dataset(group) is not None


_FIELD_START = re.compile(r":\s*([A-Za-z_]\w*)\s*=")


def _split_at_dataset(group):
    """(SPEC, mapping) where SPEC ends at the ':' before the first renamable field's name and its '=': a path may hold
    '=' itself (a Hive-style folder, ``data/lang=en/a.jsonl:prompt=q``). Failing that, at the first ':' before any
    name and '=', so a misspelt field (``SPEC:promt=q``) is still read as SPEC's and refused by its name. Either way
    never at a ':' that ends a bare type, which no dataset is (``jsonl:label=good/a.jsonl:prompt=q``'s SPEC is not
    ``jsonl``, though its folder's key is a field's name). None: no dataset."""
    renamable = set(renamable_fields())
    starts = [match for match in _FIELD_START.finditer(group) if group[:match.start()].strip()]
    starts = [match for match in starts if group[:match.start()].strip().lower() not in LOCAL_TYPES] or starts
    start = next((match for match in starts if match.group(1) in renamable), starts[0] if starts else None)
    return None if start is None else (group[:start.start()].strip(), group[start.start() + 1:].strip())


def _dataset_and_mapping(group):
    """ "jsonl:qa.jsonl:prompt=question" -> ("jsonl:qa.jsonl", "prompt=question"); "jsonl:qa.jsonl:" (no renaming)
    -> ("jsonl:qa.jsonl", "")."""
    if "=" in group:
        return _split_at_dataset(group)
    spec = group.rstrip()[:-1].strip()
    if not spec:
        raise UsageError(f"--data_fields item {group!r} must look like 'DATASET:prompt=question'")
    return spec, ""


# Besides the record fields: the column of TRL's unpaired preference labels (KTO's), beside an answer; and a
# record's tool schemas (TRL's "tools" column), which the chat template renders (apply_chat_template(tools=...)).
LABEL_FIELD = "label"
KTO_TAG = "kto_tag"  # LLaMA-Factory's name for that column (of its KTO records)
TOOLS_FIELD = "tools"
OPENAI_FUNCTIONS = "functions"  # the tools column of OpenAI's older function-calling records
# a record's system prompt as a column of its own (LLaMA-Factory's sharegpt and alpaca records): put before its messages
SYSTEM_FIELD = "system"
# Alpaca's columns (LLaMA-Factory's default format): the instruction is the prompt, its input joined after it, the
# history's pairs the turns before, the output the answer (``LocalDataset._read_alpaca_columns``)
ALPACA_INSTRUCTION, ALPACA_INPUT, ALPACA_OUTPUT, ALPACA_HISTORY = "instruction", "input", "output", "history"
# the prompt's parts an explicit --data_fields reads only where it names them (input=, history=: LLaMA-Factory's query
# and history columns): the input and history columns of Alpaca's records
PROMPT_PARTS = (ALPACA_INPUT, ALPACA_HISTORY)


def renamable_fields():
    return [*FIELD_NAMES, LABEL_FIELD, TOOLS_FIELD, SYSTEM_FIELD, *PROMPT_PARTS, MARGIN_FIELD]


def checked_field_options(field_options):
    renamable = renamable_fields()
    unknown = sorted(set(field_options) - set(renamable))
    if unknown:
        raise UsageError(f"unknown data field(s) {unknown}; the fields that can be renamed are {renamable}")
    return dict(field_options)


def files_where(paths):
    """The file, or the first shard of a split in several and the last one's name: "FOLDER/data/train-00000-of-00002
    .parquet ... train-00001-of-00002.parquet" (an error of their columns was said of the first shard alone)."""
    return paths[0] if len(paths) == 1 else f"{paths[0]} ... {os.path.basename(paths[-1])}"


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


def file_digest(path):
    """The sha256 of a file's content: a hub cache's file by the name of the blob it links to, where the hub client
    named it so (``hub_blob_sha256``), else computed once for each stamp of the file (``_digest_of_open_file``: a write
    gives it another)."""
    return file_digest_and_stamp(path).sha256


class HashedFile(collections.namedtuple("HashedFile", "sha256 stamp head", defaults=(None,))):
    """A file's sha256 (None from ``shared_digest`` where no hash is kept) and the stamp (``FileStamp``) of the file
    open when it was found, None where the file was not opened (a hub blob, named by its hash): what the stamp says
    (its size, that the file is not written since) needs no other stat or open of it. ``head``: its first HEAD_BYTES,
    read in that open (None where not read), so a load tells its compression and text encoding by them
    (``compressed_with``, ``text_encoding``), not by opens of its own."""


def file_digest_and_stamp(path):
    """``file_digest`` of the file at ``path`` as a HashedFile."""
    if blob := hub_blob_sha256(path):
        return HashedFile(blob, None)
    with open(path, "rb") as f:
        return _digest_of_open_file(f, os.path.abspath(path))


_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def hub_blob_sha256(path):
    """The sha256 of the content of a file of a Hugging Face hub cache (``REPO_TYPEs--ORG--NAME/snapshots/COMMIT/...``,
    a link to ``blobs/SHA256``), read from its blob's name, else None. The hub client names a large (LFS) file's blob
    by its content's sha256, the hash computed here otherwise: a c4 config's gzip'd shards or a dataset's parquet
    shards were read whole (~300 GB for c4's en) for the tokenized data's cache key, each process. A small file's blob
    is named by its git hash (40 digits, another hash), and is read. (A blob edited in place would keep its name: the
    hub client, too, takes the name for the content.)"""
    folder, name = os.path.split(os.path.realpath(path))
    repo, blobs = os.path.split(folder)
    in_hub_cache = blobs == "blobs" and os.path.basename(repo).startswith(("datasets--", "models--", "spaces--"))
    return name if in_hub_cache and _SHA256_HEX.fullmatch(name) else None


# Where a file's sha256 is kept for later processes (``_digest_of_open_file``), in datasets' cache beside the Arrow
# caches it keys (``load_content_keyed``); a file changed less than RACY_WINDOW_NS before it was hashed is not kept (a
# write in the same tick of the file system's clock would leave its change time as it was)
DIGEST_MEMO_FOLDER, RACY_WINDOW_NS = "dschat_file_sha256", 2 * 10**9

# The file systems whose change time a write always moves forward and nothing sets back: a kept hash is used only for
# a file on one of them. Not on the others: a read-only image's (squashfs, erofs: an Apptainer image's ctime is the
# stored mtime, its inodes fixed, so a same-size edit in a new image version has the old stamp), FAT's, many FUSE and
# object-store mounts', overlay's (its lower layers may be such images; a container's files are on it): those files are
# hashed by each process, as before the hashes were kept.
CHANGE_TIME_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "tmpfs", "nfs", "nfs4", "lustre",
                                      "gpfs", "ceph"})
MOUNTINFO = "/proc/self/mountinfo"


_DIGESTS = {}  # {(absolute path, stamp): sha256} read or computed in this process (``forget_file_digests``)


def shared_digest(path):
    """The sha256 of the file at ``path`` as every later process finds it without reading the file: its hub blob's
    name (``hub_blob_sha256``), or the hash kept under the stamp the file has now (``_digest_of_open_file``: on a file
    system whose change time a write moves, hashed after its last write's racy window); else None. A HashedFile: with
    the stamp the file has now (None for a hub blob's)."""
    if blob := hub_blob_sha256(path):
        return HashedFile(blob, None)
    with open(path, "rb") as f:
        stamp = _stat_stamp(os.fstat(f.fileno()))
        kept = _kept_digest(os.path.abspath(path), stamp) if _keeps_change_time(f.fileno()) else None
        return HashedFile(kept, stamp)


def _digest_of_open_file(f, path):
    """The sha256 of the file ``f``, opened at ``path`` (absolute), under the stamp of the file opened (device, inode,
    size, modification and change times; ``os.fstat``, not a stat before the open: an NFS client's stat answers from
    attributes it cached, up to a minute, where its open asks the server), kept for later processes
    (``DIGEST_MEMO_FOLDER``), so that a run's every process, and every later run, did not read the data whole again (a
    c4 config downloaded with --local-dir: ~300 GB each). A write sets the change time, which ``touch`` cannot set
    back: an edited file has another stamp, and is read. A file written while it was read keeps nothing, nor one on a
    file system not known to keep a real change time (``_keeps_change_time``). Processes hashing the same file at once
    (a node's ranks on a first run) take turns (``_memo_bucket_lock``): the first hashes it, the others read its hash.
    A HashedFile: with the stamp it was hashed under, and its first bytes."""
    stamp = _stat_stamp(os.fstat(f.fileno()))
    head = f.read(HEAD_BYTES)
    f.seek(0)
    keeps = _keeps_change_time(f.fileno())
    if (digest := _DIGESTS.get((path, stamp)) or (_kept_digest(path, stamp) if keeps else None)) is None:
        with _memo_bucket_lock(_digest_memo_path(path, stamp)) if keeps else contextlib.nullcontext():
            if (digest := _kept_digest(path, stamp) if keeps else None) is None:  # (kept while this one waited)
                hashed_at = time.time_ns()
                digest = hashlib.file_digest(f, "sha256").hexdigest()
                if _stat_stamp(os.fstat(f.fileno())) != stamp:  # (what was read is of neither stamp)
                    return HashedFile(digest, stamp, head)
                if keeps and stamp.ctime_ns < hashed_at - RACY_WINDOW_NS:
                    _keep_digest(path, stamp, digest)
    _DIGESTS[path, stamp] = digest
    return HashedFile(digest, stamp, head)


@contextlib.contextmanager
def _memo_bucket_lock(memo):
    """Held while what is kept at ``memo`` (a file in a bucket folder of a memo folder of datasets' cache: a kept hash,
    a JSON file's passed check) is made and kept, so that the processes making it at once (a node's ranks on a first
    run) take turns: the first makes it, the others, let in after, read what it kept. A file lock, not a collective:
    ranks need not make the same memos, nor in one order, nor have a process group; a rank killed while holding it
    lets it go. One lock per bucket (a 256th of the memos, by the entry's name), a file beside the bucket folder (at
    most 256, never pruned). Where it cannot be taken (a cache folder not writable, another user's lock file in a
    shared cache, a file system without flock), none is: the process makes the memo itself. flock alone, not
    filelock's FileLock: without flock, FileLock falls back to a marker file, which a process of another host or
    container never takes for stale, so a rank killed while holding it held every later process making a memo of its
    bucket up for ever (filelock 3 raised NotImplementedError there instead)."""
    import fcntl

    bucket = os.path.dirname(memo)
    fd = None
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(bucket), exist_ok=True)
        fd = os.open(f"{bucket}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    if fd is None:
        yield
        return
    try:
        with contextlib.suppress(OSError):  # (ENOSYS, ENOLCK: no flock there, so no lock)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (which lets the lock go)


# what tells one version of a file from another (``_digest_of_open_file``): a tuple, as kept hashes name it
FileStamp = collections.namedtuple("FileStamp", "device inode size mtime_ns ctime_ns")


def _stat_stamp(st):
    return FileStamp(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _keeps_change_time(fd):
    """Whether the file open as ``fd`` is on a mount of one of CHANGE_TIME_FILE_SYSTEMS, found by its mount's ID
    (``_mount_id``), not by its ``st_dev``: a btrfs file's st_dev is its subvolume's own anonymous device, which
    mountinfo's MAJOR:MINOR for the mount is not. False where this process's mounts cannot be read (no /proc: macOS)."""
    return _mount_file_systems().get(_mount_id(fd)) in CHANGE_TIME_FILE_SYSTEMS


def _mount_id(fd):
    """The ID of the mount that the file open as ``fd`` is read through (/proc/self/fdinfo's mnt_id, Linux 3.15 on:
    mountinfo's first field), else None."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", encoding="ascii", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name == "mnt_id" and value.strip().isdigit():
                    return int(value)
    except OSError:
        pass
    return None


@functools.cache
def _mount_file_systems():
    """{mount ID: file system type} of this process's mounts (MOUNTINFO, read once), empty where unreadable."""
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="replace") as f:
            return _file_systems_of_mountinfo(f.read())
    except OSError:
        return {}


def _file_systems_of_mountinfo(text):
    """{mount ID: file system type} of a /proc/PID/mountinfo's lines: ``ID PARENT MAJOR:MINOR ROOT MOUNT_POINT
    OPTIONS [OPTIONAL FIELDS...] - TYPE SOURCE SUPER_OPTIONS`` (spaces in paths written as \\040)."""
    types = {}
    for line in text.splitlines():
        mount, dash, file_system = line.partition(" - ")
        fields, file_system = mount.split(), file_system.split()
        if dash and fields and fields[0].isdigit() and file_system:
            types[int(fields[0])] = file_system[0]
    return types


def forget_file_digests():
    """Forget the digests this process read or computed (a later process's start, in tests)."""
    _DIGESTS.clear()


def _kept_digest(path, stamp):
    """The digest kept under ``stamp`` for the file at ``path``, else None."""
    try:
        with open(_digest_memo_path(path, stamp), encoding="ascii") as f:
            kept = f.read()
    except (OSError, ValueError):  # (none kept; a cache folder not readable)
        return None
    digest = kept.partition("\n")[0]  # (the file's path and stamp follow: ``_keep_digest``)
    return digest if _SHA256_HEX.fullmatch(digest) else None


def _digest_memo_folder():
    return _datasets_cache_folder(DIGEST_MEMO_FOLDER)


def _datasets_cache_folder(name):
    import datasets

    return os.path.join(datasets.config.HF_DATASETS_CACHE, name)


def _digest_memo_path(path, stamp):
    name = hashlib.sha256(repr((path, *stamp)).encode()).hexdigest()
    return os.path.join(_digest_memo_folder(), name[:2], name)


def _keep_digest(path, stamp, digest):
    """The digest of the file at ``path`` (absolute) under its ``stamp``, written whole, with the mode a plain ``open``
    gives (``atomic_file``: a reader never sees half of it, and the other users of a shared cache read it), the path
    and stamp after it (a line of JSON) for pruning to tell whether the file is still there as it was; then pruned now
    and then (``_prune_now_and_then``). A cache folder not writable keeps nothing."""
    with contextlib.suppress(OSError), atomic_file(_digest_memo_path(path, stamp)) as f:
        f.write(f"{digest}\n{json.dumps([path, *stamp])}")
    _prune_now_and_then(_digest_memo_folder())


# The kept hashes are pruned (``prune_kept_digests``) when one is written, at most once every PRUNE_INTERVAL_S (by the
# time of the file PRUNED_MARK): without it they were never removed, one more for each file written or removed since.
# An entry that names no file (written before entries named it) is removed once UNNAMED_ENTRY_AGE_S old.
PRUNE_INTERVAL_S, UNNAMED_ENTRY_AGE_S, PRUNED_MARK = 24 * 3600, 30 * 24 * 3600, "last_pruned"


def _prune_now_and_then(folder):
    """``prune_kept_digests(folder)`` where its PRUNED_MARK is missing or older than PRUNE_INTERVAL_S, touched first
    (processes that find it due at once each prune: redundant, not unsafe). Another user's mark in a shared cache,
    which this process cannot touch, leaves the pruning to that user."""
    mark = os.path.join(folder, PRUNED_MARK)
    with contextlib.suppress(OSError):
        if time.time() - os.stat(mark).st_mtime < PRUNE_INTERVAL_S:
            return
    try:
        with open(mark, "a"):
            os.utime(mark)
    except OSError:
        return
    prune_kept_digests(folder)


def prune_kept_digests(folder):
    """Remove the kept hashes in ``folder`` that no process will read again (``_stale_entry``). Safe beside processes
    writing entries: an entry is a temp file until it is whole (``atomic_file``), and one rewritten while this runs is
    of the same path and stamp, as stale or as live as before. An entry removed wrongly (a file this node cannot see,
    in a cache shared with others) costs only a hash computed again."""
    now = time.time()
    buckets = [entry.path for entry in os.scandir(folder) if entry.is_dir()] if os.path.isdir(folder) else []
    for bucket in buckets:
        with contextlib.suppress(OSError):
            for entry in os.scandir(bucket):
                with contextlib.suppress(OSError):
                    if _stale_entry(entry, now):
                        os.unlink(entry.path)


def _stale_entry(entry, now):
    """Whether the kept hash ``entry`` (an os.DirEntry) is of a file gone, or written since (another stamp: the
    device number aside, which a file of a shared NFS mount has another of on each node), or names no file and is
    UNNAMED_ENTRY_AGE_S old; or is a temp file of a writer killed that long ago."""
    old = now - entry.stat().st_mtime > UNNAMED_ENTRY_AGE_S
    if not _SHA256_HEX.fullmatch(entry.name):
        return old and entry.name.endswith(".tmp")  # (``atomic_file``'s)
    named = _entry_file(entry.path)
    if named is None:
        return old
    path, stamp = named
    try:
        now_stamp = _stat_stamp(os.stat(path))
    except (FileNotFoundError, NotADirectoryError):
        return True
    return now_stamp[1:] != stamp[1:]


def _entry_file(memo):
    """(path, stamp) that the kept hash ``memo`` was written for, else None (an entry written before they were)."""
    try:
        with open(memo, encoding="ascii") as f:
            path, *stamp = json.loads(f.read().partition("\n")[2])
    except (ValueError, TypeError):  # (not ASCII, no JSON, no list)
        return None
    return (path, tuple(stamp)) if isinstance(path, str) and len(stamp) == 5 else None


def all_files(path):
    """``path`` itself, or the files of the folder ``path`` (sorted), those under a linked folder in it too: datasets
    reads through such a link (a copy's data/ linked to where its files are kept), and pathlib's rglob did not enter
    it, so ``LocalSource.fingerprint`` and ``files_stamp`` held none of what was read there."""
    if os.path.isfile(path):
        return [path]
    files, walked, top = [], set(), os.path.realpath(path)
    for folder, subfolders, names in os.walk(path, followlinks=True):
        real = os.path.realpath(folder)
        # (a folder walked already, or a link up to one holding ``path``: the walk would not end, or list all above)
        if real in walked or top.startswith(real.rstrip(os.sep) + os.sep):
            subfolders[:] = []
            continue
        walked.add(real)
        subfolders.sort()  # (the same walk each time: a folder reached by two paths is listed under the first)
        files += [os.path.join(folder, name) for name in names if os.path.isfile(os.path.join(folder, name))]
    return sorted(files)


def files_stamp(paths):
    """(path, size, modification and change times) of every file of ``paths`` (files or folders): another stamp
    where a file was written since (``get_raw_dataset``'s kept reads: its records read again)."""
    stamps = []
    for path in paths:
        for file in all_files(path):
            st = os.stat(file)
            stamps.append((os.path.abspath(file), st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(stamps)


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


def _split_paths(text, flag=None):
    paths = [part.strip() for part in text.split(",")]
    if len(paths) > 2 or not all(paths):
        said = given_as(flag, text) if flag else f"local data spec {text!r}"
        raise UsageError(f"{said}: expected PATH or TRAIN_PATH,EVAL_PATH")
    return paths


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
        raise UsageError(f"{where}: cannot tell the format of the file from its extension; write jsonl:{path}, "
                         f"json:{path}, parquet:{path} or csv:{path}")
    return kind


def _is_saved_dataset(path):
    return any(os.path.isfile(os.path.join(path, name)) for name in ("dataset_dict.json", "state.json"))


def _typed_source(kind, paths_text, spec, flag):
    source = _source_of_paths(kind, paths_text, spec, flag)
    for file_kind, paths in ((source.kind, source.train_files), (source.eval_type, source.eval_files)):
        for path in paths:  # (said here, with the flag, before any step runs: loading said the file alone)
            if os.path.isfile(path):
                check_compression_read(file_kind, path, data_spec_where(spec, path, flag))
    return source


def _source_of_paths(kind, paths_text, spec, flag):
    paths = _split_paths(paths_text, flag)
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


@dataclass(frozen=True)
class Compression:
    """How a file compressed with one tool is told and undone: by its name's ``extension`` or its first bytes
    (``magic``, a regular expression); ``decompress``, the shell command that writes the plain file beside it
    (``decompress_command``); ``module``, what undoes it as the file is read (``open_data_file``), for the compressions
    of JSON that datasets' json loader undoes too (``PACKED_JSON``), else None."""
    extension: str
    magic: bytes
    decompress: str
    module: object = None


# by tool: hub datasets ship some data so (Anthropic/hh-rlhf's harmless-base/train.jsonl.gz, allenai/c4's shards);
# zstd needs a package datasets does not install, and a zip is an archive of files
COMPRESSIONS = {"gzip": Compression(".gz", rb"\x1f\x8b", "gunzip -k", gzip),
                "bzip2": Compression(".bz2", rb"BZh[1-9]1AY&SY", "bunzip2 -k", bz2),
                "xz": Compression(".xz", rb"\xfd7zXZ\x00", "unxz -k", lzma),
                "zstd": Compression(".zst", rb"\x28\xb5\x2f\xfd", "unzstd"),
                "zip": Compression(".zip", rb"PK\x03\x04", "unzip")}
COMPRESSED_EXTENSIONS = {compression.extension: tool for tool, compression in COMPRESSIONS.items()}
# the extension that names each compression of JSON dschat reads decompressed: gzip's .gz
PACKED_JSON_EXTENSIONS = {tool: compression.extension for tool, compression in COMPRESSIONS.items()
                          if compression.module}
HEAD_BYTES = 10  # (the first bytes read of a file: bzip2's magic, the longest, and a UTF-8 byte-order mark's 3)
# the modules that undo them, by the file's extension (``open_data_file``)
DECOMPRESSORS = {compression.extension: compression.module for compression in COMPRESSIONS.values()
                 if compression.module}
PACKED_JSON = tuple(DECOMPRESSORS)  # (their extensions: a JSON file named so, x.jsonl.gz, is read decompressed)
# the splits a hub dataset's subset folder holds (SUBSET/train.jsonl.gz), as datasets' default config finds them
_SUBSET_SPLIT_NAMES = ("train", *EVAL_SPLIT_NAMES)


def data_file_extensions(path):
    """(the extension of the file's data type, that of its compression or ""): train.jsonl.gz: (".jsonl", ".gz")."""
    stem, last = os.path.splitext(path)
    return (os.path.splitext(stem)[1], last) if last.lower() in PACKED_JSON else (last, "")


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


# --- reading files (datasets does the parsing; JSON is pre-checked for line-numbered errors) ---

# what the modules that undo the compressions of ``PACKED_JSON`` (``DECOMPRESSORS``) raise for data that is not what
# its name says or is cut short (bz2's OSError, "Invalid data stream"; gzip's BadGzipFile is one too: an OSError
# without an errno, unlike a read the file system failed)
DECOMPRESSION_ERRORS = (OSError, EOFError, zlib.error, lzma.LZMAError)


@contextlib.contextmanager
def open_data_file(path, encoding=None):
    """The file at ``path`` open to read, as text of ``encoding`` where one is given, else as bytes; decompressed as
    it is read where its name says it is compressed (``PACKED_JSON``: a hub download's train.jsonl.gz), so a JSON
    file's checks read, a line at a time, what datasets' json loader reads. A compressed file whose data does not
    decompress (cut short, or not what its name says) is an error naming it; one of no bytes is read as the empty
    file it is (it holds no compressed stream: bzip2's and xz's readers said "ended before the end-of-stream"). A read
    the file system fails (an OSError with an errno: EACCES, EIO) stays that error, naming the file: it was said to be
    a file cut short, to download again."""
    packed = data_file_extensions(path)[1].lower()
    mode = "rt" if encoding else "rb"
    if not packed or os.path.getsize(path) == 0:
        with open(path, mode, encoding=encoding) as f:
            yield f
        return
    try:
        with DECOMPRESSORS[packed].open(path, mode, encoding=encoding) as f:
            yield f
    except UsageError:
        raise  # (the reader's own errors: MissingInputError is an OSError too)
    except DECOMPRESSION_ERRORS as err:
        if isinstance(err, OSError) and err.errno is not None:  # (EACCES, EIO: the file system's, not the data's)
            if err.filename is None:  # (a failed read names no file)
                raise OSError(err.errno, err.strerror, path) from err
            raise
        raise undecompressable_error(path, packed, err) from err


def undecompressable_error(path, packed, err):
    """The error for the file at ``path``, named compressed (``packed``: its extension, ``PACKED_JSON``), whose data
    did not decompress (``err``): a stream cut short (EOFError: a download stopped); data not of that compression, by
    its first bytes (``compressed_with``): ``misnamed_compressed_error`` (it was "a file cut short?", which it is not);
    else a stream damaged inside."""
    tool = COMPRESSED_EXTENSIONS[packed]
    if isinstance(err, EOFError):
        return DatasetFormatError(f"{path}: not readable as {tool} data, as its name says it is ({err}): a file cut "
                                  "short? download or compress it again")
    held = compressed_with(path)
    if held == tool:
        return DatasetFormatError(f"{path}: not readable as {tool} data, as its name says it is ({err}): its data is "
                                  "damaged; download or compress it again")
    return misnamed_compressed_error(path, tool, held, read_decompressed=True)


def misnamed_compressed_error(path, named, held, where=None, read_decompressed=False):
    """The error for a file whose name says it is compressed with ``named`` (x.csv.gz, x.jsonl.gz), told by what its
    bytes hold (``held``: ``compressed_with``), not by its name: x.csv.gz holding xz, or the plain CSV, was told
    "compressed with gzip ... (gunzip -k x.csv.gz)", which gunzip refuses ("not in gzip format"). Data of no
    compression is told the name to give it; of a compression the file would be read decompressed in, named so
    (``read_decompressed``: a file ``open_data_file`` reads; PACKED_JSON_EXTENSIONS), that name; of another, that
    one's command (``compressed_error``). ``where``: how the error names ``path``."""
    misnamed = f"{where or path}: not {named} data, though its name says it is"
    if held is None:
        return DatasetFormatError(f"{misnamed}: where it is the uncompressed file, name it so "
                                  f"({plain_file_command(path, held)})")
    if read_decompressed and held in PACKED_JSON_EXTENSIONS:
        renamed = named_compressed_with(path, PACKED_JSON_EXTENSIONS[held])
        return DatasetFormatError(f"{misnamed}: it is compressed with {held}; name it so "
                                  f"({rename_command(path, renamed)})")
    return compressed_error(path, held, where)


def held_compression(path, named):
    """The compression the file at ``path``, named compressed with ``named`` (x.csv.gz), holds by its first bytes
    (``compressed_with``), None for none; where it cannot be read, ``named`` (the load would fail on its own)."""
    try:
        return compressed_with(path)
    except OSError:
        return named


def plain_file_command(path, held):
    """The shell command that writes the plain file of ``path``, a file named compressed (x.csv.gz) that holds
    ``held`` (``held_compression``): that compression's command (``decompress_command``), or for none the rename to
    the name without the compression's extension (x.csv)."""
    if held is None:
        return rename_command(path, os.path.splitext(path)[0])
    return decompress_command(path, held)


def text_encoding(path, head=None):
    """"utf-8-sig" for a file whose text starts with a UTF-8 byte-order mark (Windows editors write one), else
    "utf-8": the mark is not part of the first record. (A compressed file's text: ``open_data_file``.) ``head``: the
    file's first bytes where read already (``HashedFile.head``): a file not named compressed, its text's."""
    if head is None or data_file_extensions(path)[1]:
        with open_data_file(path) as f:
            head = f.read(3)
    return "utf-8-sig" if head.startswith(b"\xef\xbb\xbf") else "utf-8"


def holds_no_bytes(path):
    """Whether the file at ``path`` is empty: of a compressed file, its text (``open_data_file``)."""
    with open_data_file(path) as f:
        return not f.read(1)


def _json_reason(err):
    """json's message and column: "Unterminated string starting at column 7" (its message may end in "at")."""
    return f"{err.msg.removesuffix(' at')} at column {err.colno}"


class _KeysWrittenTwice:
    """json's ``object_pairs_hook`` that notes each object that writes a key twice (json keeps its last value, and the
    first was lost without a word; pyarrow refused a JSON Lines file's with an unrelated error)."""

    def __init__(self):
        self.twice = {}  # id of such an object -> the key
        self.objects = 0  # parsed so far: a record parsed with no other object inside it has no key order to gather

    def hook(self, pairs):
        self.objects += 1
        obj = dict(pairs)
        if len(obj) < len(pairs):
            seen = set()
            self.twice[id(obj)] = next(key for key, _ in pairs if key in seen or seen.add(key))
        return obj

    def key_in(self, value):
        """The key written twice in ``value`` or an object inside it, else None."""
        return _first_inside(value, lambda item: self.twice.get(id(item)) if isinstance(item, dict) else None)

    def check(self, record, where):
        key = self.key_in(record) if self.twice else None
        if key is not None:
            raise DatasetFormatError(f"{where}: an object writes the key {key!r} twice (JSON keeps only its last "
                                     "value); write each key once")


class NotJsonNumber(str):
    """NaN, Infinity or -Infinity as json's ``parse_constant`` reads them (Python's json.dumps writes a float NaN so):
    no JSON value, reported by ``check_json_numbers`` with the field that holds it."""


def check_json_numbers(record, where):
    """A record holding NaN or Infinity is an error naming its field: JSON Lines read it as a float ("expected a
    string, got float"), a JSON array as null ("missing or null"), and an extra column kept either."""
    for field, value in record.items():
        constant = _not_json_number_in(value)
        if constant is not None:
            raise DatasetFormatError(f"{where}: field {field!r}: {constant} is not a JSON value (Python's json.dumps "
                                     "writes a float NaN or infinity so); write null for a missing value, or text")


class _NotJsonNumbers:
    """json's ``parse_constant`` noting that NaN or Infinity was read: only then are the records walked for the field
    that holds it (walking every value of every record took longer than parsing them)."""

    def __init__(self):
        self.seen = False

    def parse(self, text):
        self.seen = True
        return NotJsonNumber(text)

    def check(self, record, where):
        if self.seen:
            check_json_numbers(record, where)


def _not_json_number_in(value):
    return _first_inside(value, lambda item: item if isinstance(item, NotJsonNumber) else None)


def _first_inside(value, find):
    """The first of ``find(item)`` that is not None, over a JSON value and every value inside it (depth first)."""
    found = find(value)
    if found is not None:
        return found
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((found for found in (_first_inside(child, find) for child in children) if found is not None), None)


def check_jsonl_lines(path, key_orders=None, encoding=None):
    """Line numbers (1-based) of the records in a JSONL file; DatasetFormatError at the first bad line. Where given,
    ``key_orders`` (a ``_KeyOrders``) gathers the order of its objects' keys in the same parse; ``encoding``, its
    ``text_encoding`` where found already.

    datasets/pyarrow report a malformed line without its number, so the file is checked here first.
    """
    record_lines, keys, constants = [], _KeysWrittenTwice(), _NotJsonNumbers()
    try:
        for line_number, line in record_text_lines(path, encoding):
            # a JSON array given as JSON Lines fails on its first line: said how to give it
            array = " (the file is one JSON array: give it as json:PATH)" if not record_lines and \
                line.lstrip().startswith("[") else ""
            objects = keys.objects
            try:  # (a record cut short is at its line's end, not the next)
                record = json.loads(line.rstrip("\r\n"), object_pairs_hook=keys.hook, parse_constant=constants.parse)
            except json.JSONDecodeError as err:
                raise DatasetFormatError(f"{path} line {line_number}: invalid JSON ({_json_reason(err)}){array}") \
                    from None
            if not isinstance(record, dict):
                raise DatasetFormatError(f"{path} line {line_number}: expected a JSON object, got "
                                         f"{type(record).__name__}{array}")
            keys.check(record, f"{path} line {line_number}")
            constants.check(record, f"{path} line {line_number} (record {len(record_lines)})")
            if key_orders is not None and keys.objects > objects + 1:  # (a flat record's: none to gather)
                key_orders.add(record)
            record_lines.append(line_number)
    except UnicodeDecodeError:
        raise not_utf8_error(path) from None
    return compact_lines(record_lines)


def record_text_lines(path, encoding=None):
    """(line number, line) of each line of a JSON Lines file's text that is not blank, numbered (from 1) as its check
    and its errors number them (a compressed file's text: ``open_data_file``; ``encoding``: ``text_encoding``'s where
    found already)."""
    with open_data_file(path, encoding or text_encoding(path)) as f:
        for line_number, line in enumerate(f, start=1):
            if line.strip():
                yield line_number, line


def compact_lines(lines):
    """Record line numbers (ascending) as a range where they run without a gap (a file of no blank lines: most), else
    the list: a list holds ~36 bytes a record for the whole run (allenai/c4's en, 365M records, ~13 GB while its
    shards were read). Either is indexed, measured and tested for emptiness alike."""
    if lines and lines[-1] - lines[0] + 1 == len(lines):
        return range(lines[0], lines[-1] + 1)
    return lines


def caused_by(error, kind):
    while error is not None:
        if isinstance(error, kind):
            return True
        error = error.__cause__ or error.__context__
    return False


def not_utf8_error(path):
    """A DatasetFormatError naming the first line of ``path`` that is not UTF-8 text (JSON files must be; a compressed
    file's text: ``open_data_file``)."""
    with open_data_file(path) as f:
        for line_number, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                return DatasetFormatError(f"{path} line {line_number}: not UTF-8 text (byte 0x{line[err.start]:02x} at "
                                          f"column {err.start + 1}); save the file as UTF-8")
    return DatasetFormatError(f"{path}: not UTF-8 text; save the file as UTF-8")


def check_json_document(path, key_orders=None, encoding=None):
    """A .json file must be one JSON array of objects (None returned) or JSON Lines (its record lines returned, as
    ``check_jsonl_lines``); DatasetFormatError with the line of a syntax error. Where given, ``key_orders`` (a
    ``_KeyOrders``) gathers the order of its objects' keys in the same parse; ``encoding``, its ``text_encoding``
    where found already."""
    encoding = encoding or text_encoding(path)
    try:
        if _starts_as_json_lines(path, encoding):
            return check_jsonl_lines(path, key_orders, encoding)
        with open_data_file(path, encoding) as f:
            text = f.read()
    except UnicodeDecodeError:
        raise not_utf8_error(path) from None
    if not text.strip():
        raise DatasetFormatError(f"{path}: no records ({_why_no_records('json', path)})")
    keys, constants = _KeysWrittenTwice(), _NotJsonNumbers()
    try:
        document = json.loads(text, object_pairs_hook=keys.hook, parse_constant=constants.parse)
    except json.JSONDecodeError as err:
        if _is_json_lines(text):
            return check_jsonl_lines(path, key_orders, encoding)
        raise DatasetFormatError(f"{path} line {err.lineno}: invalid JSON ({_json_reason(err)})") from None
    keys_of_records = _records_keys(document)
    key = keys_of_records[0] if keys_of_records else None
    if key is not None and len(document) == 1:  # (a one-key object is never a record)
        raise DatasetFormatError(f"{path}: the records are in the list under {key!r} of a JSON object; give a file "
                                 "that is that list (a JSON array of records) or JSON Lines")
    if len(keys_of_records) > 1 and len(keys_of_records) == len(document):  # nor one of record lists alone: splits
        # ({"train": [...], "test": [...]}; written on one line it was read as one JSON Lines record, to be named
        # with --data_fields)
        raise DatasetFormatError(f"{path}: the records are in the lists under {', '.join(map(repr, keys_of_records))}"
                                 " of a JSON object; give a file for each list (a JSON array of records, or JSON "
                                 "Lines): a train and an eval file as TYPE:TRAIN_PATH,EVAL_PATH")
    if key is not None and "\n" in text.strip():  # (or one record with a list of objects: a tool list, say)
        raise DatasetFormatError(f"{path}: expected a JSON array of records, got a JSON object: if the records are "
                                 f"the list under {key!r}, give a file that is that list (or JSON Lines); one record? "
                                 "put it in a JSON array, [...]")
    if isinstance(document, dict) and "\n" not in text.strip():  # JSON Lines of one record, as datasets reads it
        return check_jsonl_lines(path, key_orders, encoding)
    if not isinstance(document, list):
        one = " (one record? put it in a JSON array, [...])" if isinstance(document, dict) else ""
        raise DatasetFormatError(f"{path}: expected a JSON array of records, got a {type(document).__name__}{one}")
    if not document:
        raise DatasetFormatError(f"{path}: no records (the JSON array is empty)")
    for index, record in enumerate(document):
        if not isinstance(record, dict):
            raise DatasetFormatError(f"{path} record {index}: expected a JSON object, got {type(record).__name__}")
        keys.check(record, f"{path} record {index}")
        constants.check(record, f"{path} record {index}")
    if key_orders is not None and keys.objects > len(document):  # (flat records, the array's objects alone: none)
        for record in document:
            key_orders.add(record)
    return None


def _starts_as_json_lines(path, encoding=None):
    """Whether a .json file is JSON Lines by its start: a first line that is a whole JSON object, with more text on the
    lines after it, is no one JSON document, and ``check_json_document`` checks it as JSON Lines, as it did once it
    had read the whole text (allenai/c4's shards, ~800 MB decompressed) and failed to parse it. Only the first line,
    and the blank ones before and after it, are read (a file that starts otherwise, its first character alone).
    ``encoding``: ``text_encoding``'s where found already."""
    with open_data_file(path, encoding or text_encoding(path)) as f:
        start = f.read(1)
        while start.isspace():
            start = f.read(1)
        if start != "{":
            return False
        try:
            first = json.loads(start + f.readline())
        except json.JSONDecodeError:
            return False
        return isinstance(first, dict) and any(line.strip() for line in f)


def _records_keys(document):
    """The keys of a JSON object whose values are lists of records ({"data": [...]}, as load_dataset's field= reads
    it), else []; a list of messages ({"messages": [{"role": ...}]}, a record's own) holds no records."""
    if not isinstance(document, dict) or any(_are_messages(value) for value in document.values()):
        return []  # (an object with a message list of its own is a record)
    return [key for key, value in document.items() if isinstance(value, list) and value and
            all(isinstance(item, dict) for item in value) and
            not any(speaker in item for item in value for speaker in SPEAKER_KEYS)]


def _is_json_lines(text):
    """A .json file that is really JSON Lines (common) is accepted and checked line by line."""
    first = text.lstrip()[:1]
    return first == "{" and "\n" in text.strip()


def compressed_error(path, tool, where=None, kind=None):
    """The error for a data file compressed with ``tool`` that dschat does not read so: a JSON or JSON Lines file
    (``kind``) compressed with gzip, bzip2 or xz is, where its name says so (x.jsonl.gz): the name to give it (``gunzip
    -k x.jsonl`` would refuse it for its name); another is to be decompressed. ``where``: how the error names ``path``
    (``data_spec_where``: with the flag that gave it), else by itself."""
    extension = PACKED_JSON_EXTENSIONS.get(tool)
    if extension and kind in ("json", "jsonl"):
        return DatasetFormatError(f"{where or path}: the file is compressed with {tool}, which its name does not say: "
                                  f"name it so ({rename_command(path, named_compressed_with(path, extension))}), "
                                  "and it is read decompressed")
    return DatasetFormatError(f"{where or path}: the file is compressed with {tool}, which dschat does not read here "
                              "(it reads JSON and JSON Lines compressed with gzip, bzip2 or xz, named so: x.jsonl.gz): "
                              f"decompress it ({decompress_command(path, tool)}) and give the file that writes")


def decompress_command(path, tool):
    """The shell command that decompresses the file at ``path``, compressed with ``tool``, beside it. gunzip, unxz and
    unzstd refuse a file not named with their extension (x.csv holding gzip: `gunzip -k x.csv`, "unknown suffix --
    ignored"), and bunzip2 writes x.csv.out: such a file is named so first, and the plain file is written under its
    name. A name ending in another compression's extension (x.jsonl.gz holding zstd), or in the tool's own in capitals
    (unxz refuses .XZ), has it replaced, not added to: the plain file written is x.jsonl, not x.jsonl.gz (misnamed
    again). (unzip reads an archive of any name; it writes into the current folder, not the archive's, unless told:
    a folder's train.csv.zip was extracted where the command ran, and the folder given again was refused again.)
    Paths are quoted where the shell needs it (``rename_command``)."""
    extension, command = COMPRESSIONS[tool].extension, COMPRESSIONS[tool].decompress
    if tool == "zip":
        return f"{command} -d {shlex.quote(os.path.dirname(path) or '.')} {shlex.quote(path)}"
    if path.endswith(extension):
        return f"{command} {shlex.quote(path)}"
    packed = named_compressed_with(path, extension)
    return f"{rename_command(path, packed)} && {command} {shlex.quote(packed)}"


def rename_command(path, new):
    """The shell command that renames the file at ``path`` to ``new``: each path quoted where the shell would split or
    read it (``shlex.quote``: a space, a quote), so that the command can be pasted; an ordinary path is written as it
    is."""
    return f"mv {shlex.quote(path)} {shlex.quote(new)}"


def named_compressed_with(path, extension):
    """``path`` named with the compression ``extension``: a trailing compression extension of another (or in
    capitals) replaced, not added to (x.jsonl.zst holding gzip: x.jsonl.gz, not x.jsonl.zst.gz, whose .zst then
    hides its type)."""
    stem, last = os.path.splitext(path)
    return (stem if last.lower() in COMPRESSED_EXTENSIONS else path) + extension


def check_folder_not_compressed(folder, where=None):
    """A folder whose train data is compressed (Anthropic/hh-rlhf's helpful-base/train.jsonl.gz and test.jsonl.gz) is
    an error saying so, with the commands that write its split files plain, each told by the file's bytes
    (``plain_file_command``): it was "cannot tell what the folder holds" and, given TYPE:FOLDER, "the folder has no
    train.jsonl", neither of which is the fix. ``where``: how the error names the folder (``data_spec_where``: with the
    flag that gave it), else by itself."""
    names = [f"{split}{ext}{packed}" for split in ("train", *EVAL_SPLIT_NAMES) for ext in EXTENSION_TYPES
             for packed in COMPRESSED_EXTENSIONS]
    paths = [os.path.join(folder, name) for name in names if os.path.isfile(os.path.join(folder, name))]
    train = next((path for path in paths if os.path.basename(path).startswith("train.")), None)
    if train is None:
        return
    # each told by its bytes, not its name: train.csv.gz of xz, or plain text, was told `gunzip -k`, which refuses it
    held = {path: held_compression(path, COMPRESSED_EXTENSIONS[os.path.splitext(path)[1]]) for path in paths}
    commands = " && ".join(plain_file_command(path, held[path]) for path in paths)
    named = COMPRESSED_EXTENSIONS[os.path.splitext(train)[1]]
    if held[train] is None:
        raise DatasetFormatError(f"{where or folder}: its train data {os.path.basename(train)} is not {named} data, "
                                 f"though its name says it is: write its plain files ({commands}) and give the folder "
                                 "again")
    raise DatasetFormatError(f"{where or folder}: its train data {os.path.basename(train)} is compressed with "
                             f"{held[train]}, which dschat does not read: decompress its files ({commands}) and give "
                             "the folder again")


def compressed_with(path, head=None):
    """The tool that compressed the file at ``path`` (``COMPRESSIONS``: told by its first HEAD_BYTES, ``head`` where
    read already: ``HashedFile.head``), else None."""
    if head is None:
        with open(path, "rb") as f:
            head = f.read(HEAD_BYTES)
    return next((tool for tool, compression in COMPRESSIONS.items() if re.match(compression.magic, head)), None)


def check_compression_read(kind, path, where=None, head=None):
    """A data file of ``kind`` compressed otherwise than as JSON named so (``PACKED_JSON``: train.jsonl.gz, read
    decompressed, ``open_data_file``) is an error saying so (``compressed_error``): read as text it was 'not UTF-8
    text ... save the file as UTF-8'. ``where``: how the error names ``path``; ``head``: its first bytes where read
    already (``compressed_with``)."""
    if kind in ("json", "jsonl") and data_file_extensions(path)[1]:
        return
    tool = compressed_with(path, head)
    if tool:
        raise compressed_error(path, tool, where, kind)


# A JSON or JSON Lines file's check that passed (``checked_json``) is kept by the file's content (its sha256), in
# datasets' cache beside the kept hashes: the check reads ~50 MB of text a second, and read it again every run where
# datasets' load is its Arrow cache's (allenai/c4's en, ~800 GB of text: ~5 h of CPU a process). JSON_CHECK_VERSION:
# bumped when what the checks accept, or what they give (``_check_as_kept``), changes, so an older pass is not taken.
# (By hand, not by the code's digest as a split's records' pass: every edit of dschat.data would check c4 again.)
JSON_CHECK_MEMO_FOLDER, JSON_CHECK_VERSION = "dschat_json_checked", 1


def checked_json(kind, path, key_orders, hashed):
    """(record lines, HashedFile): ``check_jsonl_lines`` (``kind`` "jsonl") or ``check_json_document`` ("json") of the
    file at ``path``, its objects' key orders gathered into ``key_orders``; or, where that check passed for the same
    content before (of this process or an earlier one), what it gave then, the file not read (its record lines read
    again only for an error that names one: ``RecordLinesOnDemand``). A pass is kept only where later processes find
    the file's hash without reading it (``shared_digest``: a hub blob, or a hash kept under the file's stamp), and that
    hash is still the one the check was looked up by: a file written while it was checked keeps nothing, and is hashed
    again (the HashedFile given back): ``load_file`` keys its load's Arrow cache by it, which, keyed by the hash found
    before the check, cached the new content under the old content's name. ``hashed``: the file's
    (``file_digest_and_stamp``: ``load_file``'s load's cache key too, found once). Processes checking a file that keeps
    its pass at once (a node's ranks on a first run) take turns (``_memo_bucket_lock``): the first checks it, the
    others read what it kept (or, where it failed, check it themselves: a bad file keeps nothing)."""
    digest = hashed.sha256
    memo = _json_check_memo_path(kind, path, digest)
    kept = _kept_json_check(memo)
    if kept is None:
        # (no turns where nothing will be kept: each process checks as before, not one after another)
        with _memo_bucket_lock(memo) if shared_digest(path).sha256 == digest else contextlib.nullcontext():
            kept = _kept_json_check(memo)  # (kept by another process while this one waited)
            if kept is None:
                check = check_jsonl_lines if kind == "jsonl" else check_json_document
                record_lines = check(path, key_orders, text_encoding(path, hashed.head))
                shared = shared_digest(path)  # (its stamp now: the kept pass's, no stat)
                if shared.stamp != hashed.stamp:  # (written since it was hashed: the hash is of other content)
                    return record_lines, file_digest_and_stamp(path)
                if shared.sha256 == digest:
                    _keep_passed_check(memo, path, shared.stamp, _check_as_kept(record_lines, key_orders))
                return record_lines, hashed
    key_orders.add_kept(kept["key_orders"])
    return _record_lines_kept(kept["lines"], path), hashed


def _json_check_memo_path(kind, path, digest):
    """Where a passed check of a file of ``kind``, compressed as its name says (read decompressed:
    ``open_data_file``), of the content ``digest``, is kept."""
    name = hashlib.sha256(json.dumps([JSON_CHECK_VERSION, kind, data_file_extensions(path)[1].lower(),
                                      digest]).encode()).hexdigest()
    return os.path.join(_datasets_cache_folder(JSON_CHECK_MEMO_FOLDER), name[:2], name)


def _check_as_kept(record_lines, key_orders):
    """What a passed check gave, as JSON: its record lines as [first, count] where they run without a gap (a range:
    ``compact_lines``), as {"count": N} where not (read again where asked for: ``RecordLinesOnDemand``), None for a
    JSON array (records have no lines); and the key orders gathered."""
    lines = None if record_lines is None else [record_lines.start, len(record_lines)] \
        if isinstance(record_lines, range) else {"count": len(record_lines)}
    return {"lines": lines, "key_orders": key_orders.as_json()}


def _record_lines_kept(lines, path):
    """The record lines of ``_check_as_kept``'s ``lines`` for the file at ``path``."""
    if lines is None:
        return None
    if isinstance(lines, dict):
        return RecordLinesOnDemand(path, lines["count"])
    first, count = lines
    return range(first, first + count)


def _kept_json_check(memo):
    """The passed check kept at ``memo`` (``_check_as_kept``'s dict), else None (none kept, or not readable)."""
    try:
        with open(memo, encoding="utf-8") as f:
            kept = json.loads(f.readline())
    except (OSError, ValueError):
        return None
    return kept if isinstance(kept, dict) and {"lines", "key_orders"} <= kept.keys() else None


def _keep_passed_check(memo, path, stamp, kept):
    """Write a passed check (a JSON file's; a split's records', ``path`` its first file) at ``memo`` whole
    (``atomic_file``), the file's path and ``stamp`` (None: the file's now) on its second line, as a kept hash's, for
    pruning to remove it once the file is gone or written (``prune_kept_digests``; a copy of the content elsewhere then
    checks it again). A cache folder not writable keeps nothing."""
    with contextlib.suppress(OSError):
        entry = json.dumps([os.path.abspath(path), *(stamp or _stat_stamp(os.stat(path)))])
        with atomic_file(memo) as f:
            f.write(f"{json.dumps(kept)}\n{entry}")  # (ASCII: as pruning reads it)
    _prune_now_and_then(os.path.dirname(os.path.dirname(memo)))  # (its memo folder: the JSON checks' or records')


# A split's records that passed ``LocalDataset._validate`` (every record read through the accessors: ~7 s for 100 MB
# of JSON Lines on 2 CPU cores, more where a mixed-type column is decoded from JSON text each record) are kept as
# passed by the content of the split's files, the reader's settings and the code of dschat.data
# (``_records_check_memo``): a later run of the same data reads none of them again.
RECORDS_CHECK_MEMO_FOLDER = "dschat_records_checked"


def _records_check_memo(kind, digests, settings):
    """Where the pass of ``LocalDataset._validate`` over the records of files of ``kind`` loaded by the sha256s
    ``digests`` (``_split_digests``), read by a reader of ``settings`` (JSON), is kept; None for a save_to_disk folder
    (not a file hashed) or no files."""
    if kind == "disk" or not digests:
        return None
    import datasets
    import pyarrow

    key = json.dumps([_data_code_digest(), datasets.__version__, pyarrow.__version__, kind, digests, settings],
                     sort_keys=True, default=repr)
    name = hashlib.sha256(key.encode()).hexdigest()
    return os.path.join(_datasets_cache_folder(RECORDS_CHECK_MEMO_FOLDER), name[:2], name)


def _split_digests(kind, paths):
    """The sha256s of a split's files ``paths`` of ``kind`` (``file_digest``), taken before it is loaded: what its
    records' pass is kept by (``_records_check_memo``). Taken after, they were those of a write during the load (an
    eval file's during the train split's walk), and the records loaded before it kept their pass under the written
    content's hash. None for a save_to_disk folder (not a file hashed)."""
    return None if kind == "disk" else [file_digest(path) for path in paths]


def _hashes_shared(paths, digests):
    """Whether later processes find the hashes of the files ``paths`` without reading them (``shared_digest``), and
    they are still ``digests``, those the files were loaded by: else what is kept by them would not be found, or would
    be of other content (a file written since, as ``checked_json``'s)."""
    return all(shared_digest(path).sha256 == digest for path, digest in zip(paths, digests, strict=True))


@functools.cache
def _data_code_digest():
    """The sha256 of dschat.data's modules' source: what a record passes is decided all over them and changes with
    them, and a version bumped by hand would be forgotten, a record the new code refuses let through."""
    folder, digest = os.path.dirname(os.path.abspath(__file__)), hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()


class RecordLinesOnDemand(Sequence):
    """The record line numbers of a JSON Lines file whose records are not on lines without a gap, its check kept
    (``checked_json``): their count is known, and the numbers are read from the file (``record_text_lines``) only when
    one is asked for (an error naming a record's line)."""

    def __init__(self, path, count):
        self.path, self.count, self._lines = path, count, None

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        if self._lines is None:
            self._lines = [line_number for line_number, _ in record_text_lines(self.path)]
        return self._lines[index]


def load_file(kind, path):
    """(datasets.Dataset, record line numbers or None) for one local file or save_to_disk folder; a JSON file named
    compressed (x.jsonl.gz, a hub download's SUBSET/train.jsonl.gz), checked as it is decompressed, a line at a time
    (``open_data_file``), as a plain one is, then read by datasets' json loader, which decompresses it too. A JSON
    file's check that passed for its content before is not made again (``checked_json``)."""
    record_lines = header = None
    # (a JSON file's check's key and its load's: found once, again only where the file was written while it was
    # checked; its first bytes read in the same open)
    hashed = file_digest_and_stamp(path) if kind in ("json", "jsonl") else HashedFile(None, None)
    check_compression_read(kind, path, head=hashed.head)
    key_orders = _KeyOrders()  # (a JSON file's: gathered as it is checked, its one parse in Python)
    if kind in ("json", "jsonl"):
        record_lines, hashed = checked_json(kind, path, key_orders, hashed)
    elif kind == "csv":
        header, record_lines = csv_record_lines(path)
    builder = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}[kind]
    # (datasets would fail with its own wording; a CSV's rows are counted where the csv module could not read it)
    if (record_lines is not None and not record_lines) or (record_lines is None and _table_rows(kind, path) == 0):
        raise DatasetFormatError(f"{path}: no records ({_why_no_records(kind, path)})")
    try:
        options = _csv_options(path, header) if kind == "csv" else \
            {"encoding": text_encoding(path, hashed.head)} if builder == "json" else {}
        data = load_content_keyed(builder, path, hashed.sha256, **options)
    except Exception as err:  # pyarrow/datasets errors do not name the file; wrap them so they do
        if kind == "csv" and caused_by(err, UnicodeDecodeError):
            raise not_utf8_error(path) from err  # (pandas names the byte's offset, not its line)
        raise DatasetFormatError(f"{path}: could not be read as {kind}: {_error_text(err)}") from err
    if builder == "json":
        data = _as_written(kind, path, data, key_orders)
    if kind == "csv":
        data = _with_lf_line_ends(data)
    if record_lines is not None and len(record_lines) != len(data):  # (read otherwise than counted: say record numbers)
        record_lines = None
    return data, record_lines


def _why_no_records(kind, path):
    """Why a file holds no records: it is empty (no bytes), has only blank lines (spaces, tabs and line ends: it was
    said to be empty, and a CSV to have a header), or is a CSV of a header or a parquet file without rows."""
    if holds_no_bytes(path):
        return "the file is empty"
    if kind != "parquet" and only_blank_lines(path):
        return "it has only blank lines"
    return {"csv": "it has a header but no rows", "parquet": "it has no rows"}.get(kind, "the file is empty")


def only_blank_lines(path):
    """Whether a text file holds only whitespace after its byte-order mark (read a block at a time; a compressed
    file's text: ``open_data_file``)."""
    with open_data_file(path) as f:
        if f.read(1 << 16).removeprefix(b"\xef\xbb\xbf").strip():
            return False
        return not any(block.strip() for block in iter(lambda: f.read(1 << 16), b""))


def load_content_keyed(builder, path, digest=None, **options):
    """``load_dataset(builder)``'s train split of the file at ``path``, its Arrow cache keyed by the file's content
    (``digest``, where the caller has it: ``file_digest``).

    datasets keys the Arrow cache of a local file by its path and modification time only: a file edited with its
    time kept (``touch -r``, ``cp -p``, a rewrite within the file system's time resolution) was read back as its
    old records, under a tokenized-data cache key made from the new content. The content hash as the config name
    gives each content a cache of its own."""
    from datasets import load_dataset

    digest = digest or file_digest(path)
    return load_dataset(builder, name=f"content-{digest[:16]}", data_files={"train": path}, split="train", **options)


# A CSV written with ", " between its cells (by hand): a quoted cell after the space was read as text up to its next
# comma, quotes and all, so 'Q, "Yes, sure"' was the chosen answer '"Yes' and the rejected one 'sure"' (or a line of
# too many fields)
CSV_SPACING = {"skipinitialspace": True}


def check_csv_header(path, header):
    """A CSV header (``header``: its cells) that names a column twice is an error: pandas reads the second as
    "NAME.1", an extra column, and that column's text would silently go unread."""
    check_separated_by_commas(path, header)
    seen = {}
    for number, name in enumerate(map(_column_name, header), 1):
        if name in seen:
            raise DatasetFormatError(f"{path}: the header names column {name!r} twice (columns {seen[name]} and "
                                     f"{number}); give each column its own name")
        seen[name] = number


def check_separated_by_commas(path, header):
    """A header that is one column holding ";" or a tab is an error: a file separated by them (Excel's CSV where the
    decimal mark is a comma) read as one column, and the error said to name the fields with --data_fields."""
    separator = next((mark for mark in (";", "\t") if len(header) == 1 and mark in header[0]), None)
    if separator is not None:
        raise DatasetFormatError(f"{path}: the header is one column, {header[0]!r}: the file is separated by "
                                 f"{separator!r}, not commas; save it as comma-separated CSV")


def csv_record_lines(path):
    """(the header's cells, the lines (1-based) where its records start) of a CSV file, read once, as pandas reads
    them: after the header, a quoted cell may span lines, blank lines (and lines of spaces alone) are skipped, before
    the header too. The header is checked as soon as it is read (``check_csv_header``); a row that repeats it, or a
    record with more cells than it, is an error (``check_not_a_header``, ``check_no_extra_cells``). The lines are None,
    and the header where it was not reached, if the csv module cannot read the file (the loader says why)."""
    import csv

    starts, start, header = [], 1, None
    try:
        with open(path, newline="", encoding=text_encoding(path)) as f:
            lines = _LastLineRead(f)
            reader = csv.reader(lines, **CSV_SPACING)
            for row in reader:
                if row and lines.last.strip():  # (a row's last line is blank only where the row is that line alone)
                    starts.append(start)
                    if header is None:
                        header = row
                        check_csv_header(path, header)
                    else:
                        check_not_a_header(path, start, row, header)
                        check_no_extra_cells(path, start, row, header)
                start = reader.line_num + 1
    except (UnicodeDecodeError, csv.Error):
        return header, None
    return header, starts[1:]


class _LastLineRead:
    """A file's lines as the csv module reads them, keeping the last one read: a line of spaces alone is a blank line,
    which pandas skips (the header is the first line that is not), where the csv module reads it as one empty cell,
    as it reads a quoted empty cell (a record to pandas). A first line of spaces was the header [''], and every record
    'N cells, where the header names 1 columns'."""

    def __init__(self, lines):
        self.lines, self.last = lines, ""

    def __iter__(self):
        return self

    def __next__(self):
        self.last = next(self.lines)
        return self.last


def check_not_a_header(path, line, row, header):
    """A record that is the header again is an error: CSV files joined as they are (``cat a.csv b.csv``) put the second
    one's header among the records, where it was trained on as a record ("prompt" answered with "chosen"). Called for
    every record: its cells are compared only where it has the header's length and first name (each cell of each
    record was stripped and compared, a Python loop over every cell of a large file)."""
    if len(row) != len(header) or _column_name(row[0].lstrip("\ufeff")) != _column_name(header[0]):
        return
    if [_column_name(cell.lstrip("\ufeff")) for cell in row] == [_column_name(cell) for cell in header]:  # (its BOM)
        raise DatasetFormatError(f"{path} line {line}: the row repeats the header ({','.join(header)}); CSV files "
                                 "joined with their headers? remove it")


def check_no_extra_cells(path, line, row, header):
    """A record with more cells than the header names is an error: pandas took the first record's extra cells for an
    index column and read every record's cells under the next names (an unquoted comma in the first record made each
    prompt its chosen answer's text, without a word), and refused a later record's with "Expected 3 fields in line 5,
    saw 4" (no file named). Empty cells after the last (a delimiter ending a line) are no cells, on any line
    (``_csv_options`` reads the header's columns alone)."""
    if len(row) > len(header) and any(cell.strip() for cell in row[len(header):]):
        raise DatasetFormatError(f"{path} line {line}: {len(row)} cells, where the header names {len(header)} columns; "
                                 "quote a cell holding a comma (\"a, b\")")


def _table_rows(kind, path):
    """The number of records of a CSV or parquet file, or None (another kind, or not readable as this one: the
    loader says why)."""
    try:
        if kind == "csv":
            import pandas as pd

            return len(pd.read_csv(path, nrows=1, dtype=str, keep_default_na=False, **CSV_SPACING))
        if kind == "parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows
    except Exception:  # noqa: BLE001 (an empty CSV without a header, a damaged file: left to the loader's error)
        return 0 if kind == "csv" and os.path.getsize(path) == 0 else None
    return None


def _csv_options(path, header):
    """load_dataset's options for a CSV file: its cells are text, only an empty cell is missing (pandas would also read
    "NA", "None", "nan", ... as null), its columns are named as ``_column_name`` reads the header (``header``: its
    cells as ``csv_record_lines`` read them; None where the csv module could not, and pandas reads it), and the spaces
    after a comma are not the next cell's (``CSV_SPACING``)."""
    import pandas as pd

    if header is None:
        header = pd.read_csv(path, nrows=0, **CSV_SPACING).columns
    # (an empty header cell: named as pandas names it)
    names = [_column_name(cell) or f"Unnamed: {number}" for number, cell in enumerate(header)]
    # (usecols: a later line's empty cells after the last column, a comma ending it, are left out as the first
    # line's are; csv_record_lines refused non-empty ones)
    return {"features": _csv_text_features(names), "keep_default_na": False, "na_values": [""], "names": names,
            "header": 0, "index_col": False, "usecols": list(range(len(names))), **CSV_SPACING}



def _column_name(header_cell):
    """A CSV header cell's column name, without the spaces around it: a header written "prompt, chosen, rejected"
    named its columns " chosen" and " rejected", which no field is (and --data_fields cannot name), so its answers
    went unread ("has prompts but no answers")."""
    return header_cell.strip() or header_cell


def _csv_text_features(names):
    """Every CSV column as a string (CSV has no types: "5" or "007" is text, not a number)."""
    from datasets import Features, Value

    return Features({name: Value("string") for name in names})


def _with_lf_line_ends(data):
    """A CSV's text cells with "\\n" line ends: a quoted cell of a file written on Windows (Excel, ``to_csv`` there)
    keeps the file's "\\r\\n" inside it, which made a "Be brief.\\r\\n\\r\\nHuman: ..." prompt one user message (its
    system message and turns read as its text), cut a transcript's turns wherever a turn's text says "Human:" and
    trained the "\\r"s. The columns holding one are found by arrow's vectorised search: reading every cell into Python
    (``data[name]``, row by row) took seconds a column on a large file, most often one that holds none."""
    import pyarrow.compute as pc

    columns = [name for name in data.column_names
               if pc.any(pc.match_substring(data.data.column(name), "\r\n")).as_py()]
    if not columns:
        return data
    return data.map(_lf_cells, batched=True, fn_kwargs={"columns": columns}, desc="Reading CRLF line ends as LF")


def _lf_cells(batch, columns):
    return {name: [with_lf_line_ends(value) if value else value for value in batch[name]] for name in columns}


def _error_text(err):
    """The messages along an exception's cause chain ("An error occurred while generating the dataset" alone
    says nothing about what is wrong with the file)."""
    messages, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        message = str(err).strip() or type(err).__name__
        if message not in messages:
            messages.append(message)
        err = err.__cause__ or err.__context__
    return ": ".join(messages)


def _has_json_feature(feature):
    """Whether a feature is or holds datasets' ``Json`` type (its mixed-type columns; older datasets have no such
    type and fail on mixed columns themselves)."""
    try:
        from datasets import Json
    except ImportError:
        return False
    if isinstance(feature, Json):
        return True
    if isinstance(feature, dict):
        return any(_has_json_feature(value) for value in feature.values())
    if isinstance(feature, (list, tuple)):
        return any(_has_json_feature(value) for value in feature)
    inner = getattr(feature, "feature", None)
    return inner is not None and _has_json_feature(inner)


def _json_records(kind, path):
    """The records of a JSON/JSONL file as the json module reads them (the file was checked already). A .json of JSON
    Lines (``_starts_as_json_lines``: c4's shards) is read as JSON Lines, as its check reads it, not parsed whole
    first and failing."""
    with open_data_file(path, text_encoding(path)) as f:
        text = f.read()
    if kind == "json" and not _starts_as_json_lines(path):
        try:
            document = json.loads(text)
            return [document] if isinstance(document, dict) else document  # one JSON Lines record
        except json.JSONDecodeError:
            pass  # JSON Lines in a .json file (check_json_document accepted it)
    # "\n" only, as check_jsonl_lines reads the file: splitlines() would also split at U+2028, U+0085, ... which
    # JSON allows raw inside strings (ensure_ascii=False writes them so)
    return [json.loads(line) for line in text.split("\n") if line.strip()]


def _as_written(kind, path, data, key_orders):
    """A JSON or JSON Lines file's ``data`` (datasets') with its columns of mixed types and those whose objects datasets
    reordered (``key_orders``, the file's as it was checked: ``_KeyOrders.reordered_columns``) as the file writes them
    (``_exact_json_dataset``)."""
    mixed = any(_has_json_feature(feature) for feature in data.features.values())
    structs = [name for name, feature in data.features.items() if _holds_struct(feature)]
    if not mixed and not (structs and _json_type_available()):  # (a datasets without Json: as Arrow's, said there)
        return data
    # (the file is read again only where rebuilt: its key orders were gathered by its check's parse, and a large file
    # of messages was parsed a second time, whole or a line at a time, to look for a reordered object)
    reordered = key_orders.reordered_columns(data.features, structs)
    if not mixed and not reordered:
        return data
    return _exact_json_dataset(kind, path, data.features, also=reordered)


def _holds_struct(feature):
    """Whether a feature is or holds an Arrow struct (datasets' dict of features: a column of JSON objects)."""
    if isinstance(feature, dict):
        return True
    if isinstance(feature, (list, tuple)):
        return any(_holds_struct(value) for value in feature)
    inner = getattr(feature, "feature", None)
    return inner is not None and _holds_struct(inner)


# A list's items in a place of ``_KeyOrders`` (an object's keys are text, never None)
LIST_ITEM = None


class _KeyOrders:
    """The orders in which a JSON file's objects write their keys, column by column and place by place (the keys and
    list items that lead to an object), gathered by the parse that checks the file: ``reordered_columns`` says which
    columns datasets reordered, and a file of none is not parsed again.

    Arrow keeps one struct per column, its keys in the order it met them first: a later record's object of the same
    keys in another order came back in the first one's, so a tool call's arguments {"unit": "f", "city": "Rome"} were
    trained as {"city": "Rome", "unit": "f"} (``arguments | tojson``), and tool schemas' properties so too."""

    def __init__(self):
        self.orders = {}  # column -> {place: {the keys of an object there, in the order written}}

    def add(self, record):
        """The key orders of a parsed record's objects (its text, numbers and lists of them are passed over)."""
        for name, value in record.items():
            if isinstance(value, (dict, list)):
                self._add(self.orders.setdefault(name, {}), (), value)

    def _add(self, places, place, value):
        if isinstance(value, dict):
            places.setdefault(place, set()).add(tuple(value))
            for key, item in value.items():
                if isinstance(item, (dict, list)):
                    self._add(places, place + (key,), item)
        else:
            inside = place + (LIST_ITEM,)
            for item in value:
                if isinstance(item, (dict, list)):
                    self._add(places, inside, item)

    def as_json(self):
        """The orders gathered, as JSON ({column: [[place, [keys, ...]], ...]}: ``checked_json`` keeps them)."""
        return {name: [[list(place), [list(keys) for keys in orders]] for place, orders in places.items()]
                for name, places in self.orders.items()}

    def add_kept(self, kept):
        """Gather the orders ``as_json`` wrote."""
        for name, places in kept.items():
            for place, orders in places:
                self.orders.setdefault(name, {}).setdefault(tuple(place), set()).update(map(tuple, orders))

    def reordered_columns(self, features, names):
        """The columns among ``names`` (of datasets' ``features``) of which an object writes its keys in another order
        than datasets keeps."""
        return {name for name in names for place, orders in self.orders.get(name, {}).items()
                if _keys_reordered(orders, _feature_at(features[name], place))}


def _feature_at(feature, place):
    """The feature of the objects at ``place`` (``_KeyOrders``) of a column of ``feature``, else None."""
    for step in place:
        if step is LIST_ITEM:  # (a list of structs: [feature] or a List/Sequence's .feature)
            listed = isinstance(feature, (list, tuple)) and feature
            feature = feature[0] if listed else getattr(feature, "feature", None)
        else:
            feature = feature.get(step) if isinstance(feature, dict) else None
        if feature is None:
            return None
    return feature


def _keys_reordered(orders, feature):
    """Whether one of the key ``orders`` of objects of a struct ``feature`` is not the struct's."""
    return isinstance(feature, dict) and any(list(keys) != _struct_keys_among(feature, set(keys)) for keys in orders)


def _struct_keys_among(feature, keys):
    return [key for key in feature if key in keys]


def _exact_json_dataset(kind, path, features, also=()):
    """The file's records with every value exactly as written, for a file with mixed-type columns (and the columns
    ``also``, of objects datasets reordered).

    For a column whose values have different types in different records (e.g. a string in most records and
    a number in one), datasets infers a ``Json`` feature, which stores a string that is itself valid JSON
    as that JSON: the string "1" comes back as the number 1, "null" as None. Such columns are rebuilt here
    from the json module's records, each value JSON-encoded, so strings stay strings and a bad value is
    reported at its own record.
    """
    from datasets import Dataset, Features, Json

    records = _json_records(kind, path)
    columns = {}
    for record in records:
        for name in record:
            columns.setdefault(name, None)
    mixed = {name for name in columns if name not in features or _has_json_feature(features[name]) or name in also}
    data = {name: [record.get(name) for record in records] for name in columns}
    for name in mixed:
        data[name] = [None if value is None else json.dumps(value, ensure_ascii=False) for value in data[name]]
    exact = Features({name: Json() if name in mixed else features[name] for name in columns})
    return Dataset.from_dict(data, features=exact)


def load_saved_dataset(path):
    """(train, eval or None) from a save_to_disk folder (DatasetDict or a single Dataset)."""
    from datasets import DatasetDict, load_from_disk

    # load_from_disk's FileNotFoundError would end the run in a traceback instead of a usage error
    if not os.path.exists(path):
        raise MissingInputError(f"{path} does not exist")
    if not _is_saved_dataset(path):
        raise DatasetFormatError(f"{path}: not a save_to_disk folder (it has no dataset_dict.json or state.json)")
    try:
        saved = load_from_disk(path)
    except FileNotFoundError as err:  # e.g. a data file of the save is missing
        raise DatasetFormatError(f"{path}: an incomplete save_to_disk folder: {_error_text(err)}") from err
    if not isinstance(saved, DatasetDict):
        return saved, None
    if "train" not in saved:
        raise DatasetFormatError(f"{path}: the saved DatasetDict has no 'train' split (it has {list(saved)})")
    eval_names = [name for name in EVAL_SPLIT_NAMES if name in saved]
    if len(eval_names) > 1:  # (a hub dataset's train/validation/test: the others were left out without a word)
        from dschat.utils.dist import print_rank_0

        print_rank_0(f"[dschat.data] {path}: evaluating on its {eval_names[0]!r} split; "
                     f"{' and '.join(map(repr, eval_names[1:]))} not read")
    return saved["train"], saved[eval_names[0]] if eval_names else None


def _lists_of_objects(data):
    """{column: value} of the lists of objects of a dataset of one record (a JSON object on one line), else {}."""
    if len(data) != 1:
        return {}
    return {name: value for name, value in data[0].items() if isinstance(value, list) and value and
            all(isinstance(item, dict) for item in value)}


def load_split_files(kind, paths):
    """(Dataset, record places) of a split's files: one file (``load_file``), or a split's shards read as one dataset,
    in their order, their records' places a ``ShardPlaces``."""
    if len(paths) == 1:
        return load_file(kind, paths[0])
    from datasets import concatenate_datasets

    parts = _json_columns_alike(kind, paths, [load_file(kind, path) for path in paths])
    try:
        data = concatenate_datasets([part for part, _ in parts])
    except ValueError as err:  # (columns or types that differ between the shards)
        data = _joined_with_text_alike([part for part, _ in parts])
        if data is None:
            raise DatasetFormatError(f"{files_where(paths)}: the shards of one split hold different columns or "
                                     f"types: {err}") from err
    return data, ShardPlaces(paths, [lines for _, lines in parts], [len(part) for part, _ in parts])


def _joined_with_text_alike(parts):
    """The shards joined with their text columns of one type (one tool writes text as large_string, another as
    string), else None."""
    from datasets import concatenate_datasets

    try:
        return concatenate_datasets([_large_strings_as_strings(part) for part in parts])
    except ValueError:
        return None


def _large_strings_as_strings(data):
    """``data`` with its text columns of arrow's large_string (pandas' to_parquet writes them so) as string (datasets'
    own): shards written by the two would not join."""
    from datasets import Features, Value

    large = {name: Value("string") for name, feature in data.features.items() if feature == Value("large_string")}
    return data.cast(Features({**data.features, **large})) if large else data


def _json_columns_alike(kind, paths, parts):
    """The shards' (data, lines) with a column of mixed types in any shard (datasets' ``Json`` feature,
    ``_exact_json_dataset``) read so in every one: one number among a shard's strings made its column Json there and
    string in the others, and the shards would not join ("the features can't be aligned") where the record holding
    it is its record's error, as in one file. So too a column of objects whose structs differ between the shards (in
    their keys' order alone, the shards joined in the first one's: ``_KeyOrders``)."""
    mixed = {name for part, _ in parts for name, feature in part.features.items() if _has_json_feature(feature)}
    mixed |= _structs_differing(part for part, _ in parts)
    if not mixed or kind not in ("json", "jsonl"):
        return parts
    return [(part if all(_has_json_feature(part.features[name]) for name in mixed if name in part.features) else
             _exact_json_dataset(kind, path, {name: feature for name, feature in part.features.items()
                                              if name not in mixed}), lines)
            for path, (part, lines) in zip(paths, parts)]


def _structs_differing(datasets):
    """The struct columns whose Arrow types differ between ``datasets`` (a struct's type has its keys' order, which
    datasets' feature dicts compare without)."""
    types = {}
    for data in datasets:
        for name, feature in data.features.items():
            if _holds_struct(feature):
                types.setdefault(name, set()).add(str(data.data.schema.field(name).type))
    return {name for name, kinds in types.items() if len(kinds) > 1}


class ShardPlaces:
    """Where the records of a split read from several shard files are: record I of the whole is record I - (the
    records of the shards before) of its shard, and its errors name that file and line."""

    def __init__(self, paths, lines, sizes):
        self.paths, self.lines = paths, lines
        self.starts = [sum(sizes[:number]) for number in range(len(sizes))]

    def where(self, index):
        from bisect import bisect_right

        number = bisect_right(self.starts, index) - 1
        return record_where(self.paths[number], index - self.starts[number], self.lines[number])


def record_where(path, index, record_lines):
    """"FILE line N (record I)" where the line of record I is known, else "FILE record I" (a split in shards: the
    shard's, ``ShardPlaces``)."""
    if isinstance(record_lines, ShardPlaces):
        return record_lines.where(index)
    return f"{path} line {record_lines[index]} (record {index})" if record_lines else f"{path} record {index}"


def keeps_nulls(source):
    """Whether the files of ``source`` give back the nulls in a record's objects as written, and none that it lacks:
    JSON and JSON Lines (datasets reads a column of objects whose keys differ between records as its Json type,
    ``_exact_json_dataset``: exactly) and CSV (text); not parquet or save_to_disk folders, whose Arrow structs give back
    a key another record's object has as null (``without_none_values``), nor JSON read by a datasets without the Json
    type (as structs too). A source mixing them (train.jsonl beside eval.parquet) is read as Arrow's."""
    kinds = {source.kind, source.eval_type}
    return kinds <= {"csv"} or (kinds <= {"json", "jsonl", "csv"} and _json_type_available())


def _json_type_available():
    try:
        from datasets import Json  # noqa: F401
    except ImportError:
        return False
    return True


class LocalDataset(PromptRawDataset):
    """A ``PromptRawDataset`` over local files; records are validated when loaded (``strict``)."""
    strict = True

    def __init__(self, source, output_path, seed, local_rank, field_options=None):
        self.source = source
        self.fields = {name: name for name in renamable_fields()}
        self.renamed = checked_field_options(field_options or {})
        self.fields.update(self.renamed)
        self.margin_field = self.fields[MARGIN_FIELD]
        # (a CSV cell holds one message as its JSON text; a JSON or parquet file's text is text: ``_json_list_text``)
        self.csv_cells = "csv" in {source.kind, source.eval_type}
        self._name_as(source)
        super().__init__(output_path, seed, local_rank, dataset_name=source.spec, raw_datasets=None)

    def _name_as(self, source):
        self.dataset_name, self.dataset_name_clean = source.spec, "tiny" if source.spec == "tiny" else source.name_clean

    def spelled_as(self, source):
        """This reader as one made for ``source``, another spelling of the same files (``./a.jsonl``,
        ``jsonl:a.jsonl``, its absolute path: ``get_raw_dataset``'s kept reads): the records read, its name and the
        paths its errors give ``source``'s."""
        if source == self.source:
            return self
        reader = copy.copy(self)
        reader.source = source
        reader._name_as(source)
        return reader

    @property
    def eval_split(self):
        """Its eval file's (or save_to_disk split's), read as the split "eval"; None where it has none."""
        return None if self.raw_datasets["eval"] is None else "eval"

    @property
    def renames_record_fields(self):
        """Whether --data_fields renames a field of the records' shape (a tools=, label= or system= column alone kept
        ShareGPT's conversations from being read: "no 'prompt', 'messages' or 'chosen' field")."""
        return bool(set(self.renamed) & set(FIELD_NAMES))

    def load(self):
        self.keeps_nulls = keeps_nulls(self.source)
        # (the files' hashes as they are loaded: what their records' pass is kept by, ``_validate_unless_passed``)
        train_digests = _split_digests(self.source.kind, self.source.train_files)
        eval_digests = _split_digests(self.source.eval_type, self.source.eval_files)
        train, eval_data = self._load_splits()
        self._read_alpaca_columns(train.column_names)
        self._read_pairwise_conversations(train)
        if "chosen" not in self.renamed and "chosen" not in train.column_names and "completion" in train.column_names:
            self.fields["chosen"] = "completion"  # TRL's prompt-completion records: the completion is the answer
        self.label_field = self._label_column(train)
        if "conversations" in train.column_names and not self.renames_record_fields and not any(
                self.fields[name] in train.column_names for name in FIELD_NAMES):  # (a --data_fields typo stays one)
            self.fields["messages"] = "conversations"  # ShareGPT's own name for its from/value messages
        self._read_older_functions_column(train)
        self.shape = self._record_shape(train, self.source.train_where)
        self._check_renamed_columns_beside(train.column_names, self.source.train_where)
        self.system_field = self._system_column(train.column_names)
        self.used_columns = tuple(self.fields[name] for name in self._shape_fields()) + \
            ((self.system_field,) if self.system_field else ()) + \
            tuple(name for name in (self.input_field, self.history_field) if name and self.shape == "prompt")
        # (the system prompt, Alpaca's input and history: the prompt's, and columns too)
        self.reward_columns = tuple(name for name in (self.system_field, self.input_field, self.history_field) if name)
        self.alpaca_output = "chosen" not in self.renamed and self.fields["chosen"] == ALPACA_OUTPUT and \
            self.fields["rejected"] not in train.column_names
        if self.alpaca_output:  # (the reward functions' column under its own name: ``get_reference_answers``)
            self.reward_columns += (ALPACA_OUTPUT,)
        self.has_answers = self.shape != "prompt" or self.fields["chosen"] in train.column_names
        self.has_rejected = self.shape != "messages" and self.fields["rejected"] in train.column_names
        self._validate_unless_passed(train, self.source.kind, self.source.train_files, train_digests,
                                     self.source.train, self._train_lines)
        if eval_data is not None:
            eval_where = self.source.eval_where or self.source.train_where
            if self._record_shape(eval_data, eval_where) != self.shape:
                raise DatasetFormatError(f"{eval_where}: the eval records have different fields from the train "
                                         f"records ({eval_data.column_names} vs {train.column_names})")
            self._check_renamed_columns_beside(eval_data.column_names, eval_where)
            self._check_renamed_prompt_parts(eval_data.column_names, eval_where)
            self._validate_unless_passed(eval_data, self.source.eval_type, self.source.eval_files, eval_digests,
                                         self.source.eval or f"{self.source.train} (eval split)", self._eval_lines)
        return {"train": train, "eval": eval_data}

    def _system_column(self, columns):
        """The column read as each record's system prompt, else None: the one ``system=NAME`` names, or a "system"
        column (LLaMA-Factory's) where --data_fields names none of the record fields. A mapping that names them decides,
        as LLaMA-Factory's "columns" do (their system is None unless named): a "system" column beside it is an extra
        column unless it names it (one of something else, the system that wrote an answer, was put before every
        prompt)."""
        if SYSTEM_FIELD not in self.renamed and self.renames_record_fields:
            return None
        return self.fields[SYSTEM_FIELD] if self.fields[SYSTEM_FIELD] in columns else None

    def _check_renamed_columns_beside(self, columns, where):
        """A system=, tools= or margin= of --data_fields naming a column the train or eval file lacks is an error (a typo:
        the system prompt, the tool schemas or the margins went unread, without a word, where a misspelt prompt=, input=
        or label= is said), in
        a file the mapping is of: one that has a record field it renames, or any file where it renames none. A file of
        another shape under the same mapping (messages data beside renamed prompts) is read as before."""
        renamed_fields = [self.fields[name] for name in FIELD_NAMES if name in self.renamed]
        if renamed_fields and not any(field in columns for field in renamed_fields):
            return
        self._check_renamed((SYSTEM_FIELD, TOOLS_FIELD, MARGIN_FIELD), columns, where)

    def _read_older_functions_column(self, train):
        """OpenAI's older function-calling records name their tool schemas ``functions`` (each a bare function schema
        {"name", "description", "parameters"}, as LLaMA-Factory's tools are): read as the tools column where the records
        have none (it was an extra column, and the model trained to call functions it was not shown). Not where its
        first value given is something else (``_are_function_schemas``): a "functions" column of a code dataset's
        function names, say, is an extra column, as it was; read as the tools, it stopped the file."""
        columns = train.column_names
        if TOOLS_FIELD in self.renamed or self.fields[TOOLS_FIELD] in columns or OPENAI_FUNCTIONS not in columns:
            return
        first = next((value for value in train[:100][OPENAI_FUNCTIONS] if value), None)
        if first is None or _are_function_schemas(first):  # (none in the first records: later ones may hold some)
            self.fields[TOOLS_FIELD] = OPENAI_FUNCTIONS

    def _read_pairwise_conversations(self, train):
        """LLaMA-Factory's pairwise records (its ShareGPT conversations, or messages, ending with the user's turn, then
        chosen and rejected each one message, {"from": "gpt", "value": ...}) read without --data_fields: the
        conversation is the prompt (TRL's explicit-prompt format), the two messages the answers. They were "field
        'chosen': expected a non-empty list of messages, got dict". (Told by a chosen value that is one message: a
        messages column beside chosen and rejected lists is not read, as before.)"""
        columns = train.column_names
        if self.renames_record_fields or self.fields["prompt"] in columns or \
                not all(self.fields[name] in columns for name in ("chosen", "rejected")):
            return
        conversation = next((name for name in ("conversations", self.fields["messages"]) if name in columns), None)
        first = next((value for value in train[:100][self.fields["chosen"]] if value is not None), None)
        if conversation and (_is_one_message(first) or self.csv_cells and _message_of_json_text(first) is not None):
            self.fields["prompt"] = conversation

    def _read_alpaca_columns(self, columns):
        """Alpaca's records (LLaMA-Factory's default format: instruction, input, output, and system, history; chosen
        and rejected for preference data) are read without --data_fields: the instruction is the prompt, with its input
        (where given) after it on a line of its own, as LLaMA-Factory joins them, after the turns of its history
        ([instruction, answer] pairs), and the output is the answer. They were "no 'prompt' field".

        An explicit --data_fields mapping of the record's fields decides what is read, as LLaMA-Factory's "columns"
        do: an input and a history column are the prompt's only where it names them (``input=NAME``, ``history=NAME``;
        they may be named beside any prompt column). An input or history column of something else beside
        ``prompt=instruction`` stopped the file with an Alpaca-format error."""
        answered = ALPACA_OUTPUT in columns or self.fields["chosen"] in columns  # (dolly's instruction, context and
        # response are not Alpaca's: its context would be left out)
        if not self.renames_record_fields and ALPACA_INSTRUCTION in columns and answered and \
                not any(self.fields[name] in columns for name in ("prompt", "messages")):
            self.fields["prompt"] = ALPACA_INSTRUCTION
            if ALPACA_OUTPUT in columns and self.fields["chosen"] not in columns:
                self.fields["chosen"] = ALPACA_OUTPUT
        self.alpaca_detected = not self.renames_record_fields and self.fields["prompt"] == ALPACA_INSTRUCTION
        self._check_renamed_prompt_parts(columns, self.source.train_where)
        self.input_field, self.history_field = (self.fields[name] if name in self.renamed or self.alpaca_detected and
                                                self.fields[name] in columns else None for name in PROMPT_PARTS)

    def _alpaca_hint(self, field):
        """Said of an input or history column read as Alpaca's without --data_fields: how to read it as a column."""
        if not self.alpaca_detected or field in {self.renamed.get(name) for name in PROMPT_PARTS}:
            return ""
        return (f" (read so beside Alpaca's {ALPACA_INSTRUCTION!r}; a {field!r} column of something else is an extra "
                f"column under --data_fields prompt={ALPACA_INSTRUCTION},chosen={self.fields['chosen']}, which reads "
                "only the columns it names)")

    def _label_column(self, train):
        """The column of TRL's unpaired preference labels (KTO's prompt/completion/label records), else None: the one
        ``--data_fields label=NAME`` names, or a "label" column that reads as labels (every value one, or any a
        true/false or a float column's 1.0/0.0: a typo among them is then its record's error) beside TRL's completion
        or a renamed chosen, with no rejected; a category column beside a plain chosen stays data. A renamed label a
        file lacks is an error only where its columns hold true/false (an SFT file in the mix has no labels). A
        "kto_tag" column (LLaMA-Factory's KTO records, ShareGPT's conversations beside it) is the labels: it was an
        extra column, and the answers tagged false were trained on."""
        name, renamed, columns = self.fields[LABEL_FIELD], LABEL_FIELD in self.renamed, train.column_names
        if not renamed and name not in columns and KTO_TAG in columns:
            name, renamed = KTO_TAG, True  # (LLaMA-Factory's KTO records: their labels, whatever their answers' field)
        if name not in columns:
            if renamed and any(_says_true_or_false(values) for values in train[:100].values()):
                self._check_renamed((LABEL_FIELD,), columns, self.source.train_where)
            return None
        if renamed:
            return name
        answer_is_kto_like = self.fields["chosen"] == "completion" or "chosen" in self.renamed
        values = [value for value in train[name] if value is not None]
        labels = values and (all(_label_value(v) is not None for v in values) or _says_true_or_false(values))
        return name if answer_is_kto_like and self.fields["rejected"] not in columns and labels else None

    def _load_splits(self):
        self._train_lines = self._eval_lines = None
        if self.source.kind == "disk":
            if self.source.eval:
                return load_saved_dataset(self.source.train)[0], load_saved_dataset(self.source.eval)[0]
            return load_saved_dataset(self.source.train)
        train, self._train_lines = load_split_files(self.source.kind, self.source.train_files)
        if not self.source.eval:
            return train, None
        eval_data, self._eval_lines = load_split_files(self.source.eval_type, self.source.eval_files)
        if self.source.unread_evals:
            from dschat.utils.dist import print_rank_0

            print_rank_0(f"[dschat.data] {self.source.spec}: evaluating on {os.path.basename(self.source.eval)}; "
                         f"{' and '.join(self.source.unread_evals)} not read")
        return train, eval_data

    def get_train_data(self):
        if self.raw_datasets["eval"] is None:
            return self.seeded_train_eval_part(self.raw_datasets["train"], 0)
        return self.raw_datasets["train"]

    def get_eval_data(self):
        if self.raw_datasets["eval"] is None:
            return self.seeded_train_eval_part(self.raw_datasets["train"], 1)
        return self.raw_datasets["eval"]

    # --- record shapes ---
    def _record_shape(self, data, where):
        columns = data.column_names
        self._check_records_not_in_a_list(data, where)
        preference = self.fields["chosen"] in columns and self.fields["rejected"] in columns
        named_prompt = "prompt" in self.renamed and "messages" not in self.renamed and self.fields["prompt"] in columns
        if self.fields["messages"] in columns and not preference and not named_prompt:
            # the other fields are not read from messages records: a prompt column beside them (ultrachat's,
            # no_robots') is their first turn; preference records that also carry the chosen conversation as messages
            # (ultrafeedback_binarized's columns) read as preference pairs, and a prompt field named by --data_fields
            # as prompt records
            return "messages"
        if self.fields["prompt"] in columns:
            # Prompt-only (step 3) and SFT-only files legitimately lack the answer columns, under one --data_fields
            # for every file; only a rejected answer with no chosen one is a certain typo.
            if self.fields["rejected"] in columns:
                self._check_renamed(("chosen",), columns, where)
            return "prompt"
        self._check_renamed(("prompt",), columns, where)
        if self.fields["chosen"] in columns:
            return "chosen_messages"
        raise DatasetFormatError(
            f"{where}: no {self.fields['prompt']!r}, {self.fields['messages']!r} or {self.fields['chosen']!r} "
            f"field; the records have {columns}. Name yours with --data_fields, e.g. "
            f"'prompt=question,chosen=answer,rejected=bad_answer'{self._records_list_hint(data)}")

    def _check_records_not_in_a_list(self, data, where):
        """A file of one record (one JSON object on one line) without the records' fields, whose list of objects has
        them, is a JSON object holding the records in a list beside other fields ({"version": ..., "data": [...]},
        the layout load_dataset's field= reads): an error naming that list. It was read as one record of columns
        'version' and 'data', refused with "name yours with --data_fields". (Indented, or with no other field,
        ``check_json_document`` says so before loading.)"""
        defining = {self.fields[name] for name in ("prompt", "messages", "chosen")} | \
            (set() if self.renames_record_fields else {"conversations"})  # (ShareGPT's records, read as messages)
        lists = _lists_of_objects(data) if not defining & set(data.column_names) else {}
        holding = [name for name, value in lists.items() if any(defining & set(item) for item in value)]
        if holding:
            raise DatasetFormatError(f"{where}: the records are in the list under {holding[0]!r} of a JSON object; "
                                     "give a file that is that list (a JSON array of records) or JSON Lines")

    @staticmethod
    def _records_list_hint(data):
        """Said of a file of one record, without the records' fields, that holds one list of objects: they may be
        the records."""
        lists = _lists_of_objects(data)
        if len(lists) != 1:
            return ""
        (name, value), = lists.items()
        fields = sorted({field for item in value for field in item})
        return (f" (the file is one record; if the records are its list under {name!r}, of objects with the fields "
                f"{fields}, give a file that is that list (a JSON array of records) or JSON Lines)")

    def _check_renamed_prompt_parts(self, columns, where):
        """An input= or history= of --data_fields naming a column the train or eval file lacks is an error (a typo; the
        eval file's held-out prompts were built without it, unsaid), in a file with the prompt column: records of
        another shape in the mix need neither."""
        if self.fields["prompt"] in columns:
            self._check_renamed(PROMPT_PARTS, columns, where)

    def _check_renamed(self, names, columns, where):
        """A field the records' shape needs, renamed by --data_fields to a column the records lack, is an error
        naming it (else the records read as another shape and fail later, or not at all). Only fields the shape
        cannot do without are checked, so records of another shape (e.g. messages data next to the renamed data)
        are not rejected for a rename that does not apply."""
        for name in names:
            if name in self.renamed and self.fields[name] not in columns:
                # the field the user named is not there: say so, not what follows
                raise DatasetFormatError(f"{where}: no {self.fields[name]!r} field, which --data_fields "
                                         f"{name}={self.fields[name]} names; the records have {columns}")

    def check_usable(self, train_phase):
        if train_phase in (1, 2) and not self.has_answers and "chosen" in self.renamed:
            # a misspelt chosen=... is why the answers are missing: name it, not "no 'chosen' field"
            self._check_renamed(("chosen",), self.raw_datasets["train"].column_names, self.source.train_where)
        super().check_usable(train_phase)
        if train_phase == 2:
            self.check_rejected_rename()

    def check_rejected_rename(self):
        """A rejected=... that names a column the records lack is why they have no rejected answers: said as such.
        (Other steps' files may lack rejected answers under the same --data_fields; step 2's cannot. Conversations
        beside the renamed data, which have none under any name, are skipped and counted as without --data_fields.)"""
        if self.shape != "messages" and not self.has_rejected and "rejected" in self.renamed:
            self._check_renamed(("rejected",), self.raw_datasets["train"].column_names, self.source.train_where)

    def _shape_fields(self):
        return {"messages": ("messages",), "prompt": ("prompt", "chosen", "rejected"),
                "chosen_messages": ("chosen", "rejected")}[self.shape]

    # The reader's attributes that say where its data is and what it is called, not how a record is read
    # (``_reading_settings``)
    NOT_READING_SETTINGS = frozenset({"source", "dataset_name", "dataset_name_clean", "flag", "output_path", "seed",
                                      "local_rank", "raw_datasets", "_train_lines", "_eval_lines"})

    def _reading_settings(self):
        """How this reader reads a record (its field names, the record shape, its columns...), as JSON: every
        attribute set but NOT_READING_SETTINGS, so that one added later is in the records' pass's key
        (``_records_check_memo``) unless said to be of no matter."""
        return [type(self).__qualname__, {name: value for name, value in vars(self).items()
                                          if name not in self.NOT_READING_SETTINGS}]

    def _validate_unless_passed(self, data, kind, paths, digests, where, record_lines):
        """``_validate`` of the records of the files ``paths``, loaded by their sha256s ``digests``
        (``_split_digests``), unless they passed it before with the same content, reader settings and code
        (``_records_check_memo``), the pass kept where later processes find the files' hashes without reading them
        and those are still ``digests`` (as ``checked_json``'s; a failed walk keeps nothing). Processes walking the
        same records at once take turns (``_memo_bucket_lock``)."""
        memo = _records_check_memo(kind, digests, self._reading_settings())
        if memo is None:
            self._validate(data, where, record_lines)
            return
        if os.path.isfile(memo):
            return
        with _memo_bucket_lock(memo) if _hashes_shared(paths, digests) else contextlib.nullcontext():
            if os.path.isfile(memo):  # (kept by another process while this one waited)
                return
            self._validate(data, where, record_lines)
            if _hashes_shared(paths, digests):
                _keep_passed_check(memo, paths[0], None, {"passed": True})

    def _validate(self, data, path, record_lines):
        """Read every record through the accessors once, so a bad one fails now, with its location."""
        for index, sample in enumerate(data):
            try:
                self.get_conversation(sample)
                self.get_chosen_text(sample)
                self.get_rejected_text(sample)
                self.is_undesirable(sample)
                self.get_tools(sample)
            except SkipRecord:  # (counted where the phase reads it)
                pass
            except RecordError as err:
                raise DatasetFormatError(f"{record_where(path, index, record_lines)}: {err}"
                                         f"{self._other_shape_hint(sample, err)}") from None

    def locate(self, sample):
        """Where a record read after loading (e.g. one the tokenizer's chat template refuses) is: its file, line and
        record number, as on load; the source's name if not found."""
        eval_path = self.source.eval or f"{self.source.train} (eval split)"
        for data, path, lines in ((self.raw_datasets["train"], self.source.train, self._train_lines),
                                  (self.raw_datasets["eval"], eval_path, self._eval_lines)):
            for index, record in enumerate(data or ()):
                if record == sample or repr(record) == repr(sample):  # (repr: a NaN is not equal to itself)
                    return record_where(path, index, lines)
        return self.dataset_name

    def _other_shape_hint(self, sample, err):
        """A record missing a field of the file's shape that has another shape's field instead: the file mixes record
        shapes."""
        defining = {"prompt": "prompt", "messages": "messages", "chosen_messages": "chosen"}[self.shape]
        if err.detail != "missing or null" or err.field != self.fields[defining]:
            return ""
        own = {self.fields[name] for name in self._shape_fields()}
        other = [self.fields[name] for name in FIELD_NAMES
                 if self.fields[name] not in own and sample.get(self.fields[name]) is not None]
        if not other:
            return ""
        shape = {"prompt": "prompt/chosen/rejected", "chosen_messages": "chosen/rejected conversation"}.get(
            self.shape, self.shape)
        return (f" (it has {other[0]!r} instead: the file mixes record shapes and reads as {shape} records; give each "
                f"shape a file of its own)")

    # --- structured accessors ---
    def get_conversation(self, sample):
        return self._with_system(sample, self._conversation(sample))

    def _with_system(self, sample, messages):
        """``messages`` after the record's system prompt column (LLaMA-Factory's ``system``; ``--data_fields
        system=NAME``) where it has text: it was passed on as an extra column, and the model trained without it. Messages
        that begin with it already keep it once; beginning with another system message, they are the record's error
        (which of the two is meant cannot be told)."""
        field = self.system_field
        text = sample.get(field) if field else None
        if text is None:
            return messages
        if not isinstance(text, str):
            raise RecordError(field, f"expected the system prompt as text, got {type(text).__name__}")
        if not text.strip():
            return messages
        system = {"role": "system", "content": trimmed(text)}
        if messages and messages[0]["role"] == "system":
            if _turns_of(messages[:1]) != _turns_of([system]):
                raise RecordError(field, "the record's messages begin with another system message; give one of the "
                                         "two")
            return messages
        return [system, *messages]

    def _conversation(self, sample):
        if self.shape == "messages":
            awaiting = self._awaiting_answer(sample)
            if awaiting:  # a conversation awaiting its answer: step 3's prompt
                return awaiting
            return self._split_message_list(sample, self.fields["messages"])[0]
        if self.shape == "chosen_messages":
            return self._split_message_list(sample, self.fields["chosen"])[0]
        return self._prompt_conversation(sample)

    def conversation_field(self, sample):
        if self.shape == "prompt":  # (the chosen list's turns where they hold the prompt's: ``_prompt_conversation``)
            chosen = self.fields["chosen"]
            turns = self._answer_list_turns(sample, chosen) if sample.get(chosen) is not None else None
            return chosen if turns else self.fields["prompt"]
        return self.fields["chosen" if self.shape == "chosen_messages" else "messages"]

    def _prompt_conversation(self, sample):
        """The prompt field's messages; or the chosen answer list's turns before its answer, where they end with them
        (a system message or earlier turns the prompt field leaves out: orca_dpo_pairs', ultrafeedback's)."""
        prompt = self._prompt_field_messages(sample)
        chosen = self.fields["chosen"]
        turns = self._answer_list_turns(sample, chosen) if sample.get(chosen) is not None else None
        return self._holding_prompt(turns, prompt, chosen) or prompt

    def _prompt_field_messages(self, sample):
        field = self.fields["prompt"]
        value = _json_list_text(sample.get(field), field, self.csv_cells)
        if isinstance(value, (list, tuple)):
            return prompt_messages(self._checked_messages(value, sample, field), field)
        text, earlier = self._with_input(sample, required_text(sample, field)), self._history_turns(sample)
        try:
            return earlier + text_prompt_messages(text)
        except ValueError as error:
            raise RecordError(field, str(error)) from None

    def _with_input(self, sample, instruction):
        """An Alpaca record's instruction with its input (where it has one) on a line of its own after it."""
        value = sample.get(self.input_field) if self.input_field else None
        if value is None:
            return instruction
        if not isinstance(value, str):
            raise RecordError(self.input_field, f"expected text (the instruction's input), got {type(value).__name__}"
                                                f"{self._alpaca_hint(self.input_field)}")
        return instruction + "\n" + trimmed(value) if value.strip() else instruction

    def _history_turns(self, sample):
        """The earlier turns of an Alpaca record's history ([[instruction, answer], ...]), else []."""
        value = sample.get(self.history_field) if self.history_field else None
        if isinstance(value, str) and value.strip().startswith("["):  # (a CSV cell's JSON text)
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass  # (said below)
        if not value:
            return []
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(text, str) and text.strip()
                                                                          for text in pair) for pair in value):
            raise RecordError(self.history_field, "expected a list of [instruction, answer] pairs of text, as "
                                                  "LLaMA-Factory's Alpaca records give the turns before"
                                                  f"{self._alpaca_hint(self.history_field)}")
        return [{"role": role, "content": trimmed(text)} for pair in value
                for role, text in zip(("user", "assistant"), pair)]

    def _answer_list_turns(self, sample, field):
        """The turns before the answer of an answer given as a message list, else None (a string answer)."""
        value = _json_list_text(sample[field], field, self.csv_cells)
        if not isinstance(value, (list, tuple)):
            return None
        return final_assistant_answer(self._checked_messages(value, sample, field), field)[0]

    def _checked_messages(self, value, sample, field):
        """``checked_messages`` of the field's message list ``value``, the nulls of its calls kept where they are as
        written (``keeps_nulls``; a list given as JSON text)."""
        return checked_messages(value, field, self.keeps_nulls or isinstance(sample.get(field), str))

    def _holding_prompt(self, turns, prompt, field):
        """``turns`` (an answer list's, before its answer) when there are any: they must end with the ``prompt``
        field's messages (else the answer would be trained after another prompt, its turns dropped)."""
        if not turns:
            return None
        _check_answer_follows_user(turns, field)
        if len(turns) < len(prompt) or _turns_of(turns[len(turns) - len(prompt):]) != _turns_of(prompt):
            raise RecordError(field, f"its turns before the answer do not end with the prompt of field "
                                     f"{self.fields['prompt']!r}; give the answer alone, or turns ending with that "
                                     "prompt")
        return list(turns)

    def _awaiting_answer(self, sample):
        """The messages of a record whose last message is the user's (a message list, or a "Human: ... Assistant:"
        transcript ending with an empty assistant turn), else None."""
        field = self.fields["messages"]
        value = _json_list_text(sample.get(field), field, self.csv_cells)
        if isinstance(value, (list, tuple)):
            messages = self._checked_messages(value, sample, field)
        elif isinstance(value, str) and _TRANSCRIPT_TURN.search(value):
            messages = parse_transcript(value)
        else:
            return None  # (read as a transcript answer, which says what is wrong)
        return messages if messages and messages[-1]["role"] in ("user", *TOOL_ROLES) else None

    def _split_message_list(self, sample, field):
        """(prompt turns, answer) of a full conversation whose last message is the assistant's answer: a message
        list, or a "Human: ... Assistant: ..." transcript (Anthropic/hh-rlhf's chosen and rejected); a chosen and
        rejected pair of plain strings, TRL's implicit prompt: the words both begin with, then each one's answer."""
        value = _json_list_text(sample.get(field), field, self.csv_cells)
        if isinstance(value, str):
            if self.shape == "chosen_messages" and self._plain_string_pair(sample):
                return _split_at_shared_prompt(sample, field, self.fields["chosen"], self.fields["rejected"])
            return _transcript_answer(sample, field, WHOLE_CONVERSATIONS if self.shape == "chosen_messages" else
                                      CONVERSATION)
        prompt, answer = final_assistant_answer(self._checked_messages(value, sample, field), field)
        if self.shape != "messages":
            _check_answer_weighted(value, field)
        if not prompt:
            raise RecordError(field, "there must be a user message before the answer")
        _check_answer_follows_user(prompt, field)
        return prompt_messages(prompt, field), answer

    def _plain_string_pair(self, sample):
        """Whether the record's chosen and rejected are both strings, neither a transcript nor a message list."""
        values = [_json_list_text(sample.get(self.fields[name]), self.fields[name], self.csv_cells)
                  for name in ("chosen", "rejected")]
        return all(isinstance(v, str) and not _TRANSCRIPT_TURN.search(v) for v in values)

    def get_chosen_text(self, sample):
        if self.shape == "messages":
            awaiting = self._awaiting_answer(sample)
            if awaiting:
                raise EndsWithUser(self._with_system(sample, awaiting))
            answer = self._split_message_list(sample, self.fields["messages"])[1]
            messages, untrained = self._weighted_messages(sample)
            if untrained and len(messages) - 1 in untrained:  # (a transcript has no weights, and no messages here)
                raise UntrainedAnswer(messages)
            return answer
        if self.shape == "chosen_messages":
            return self._split_message_list(sample, self.fields["chosen"])[1]
        field = self.fields["chosen"]
        if field not in sample:
            return None  # prompt-only data
        if sample[field] is None:
            raise RecordError(field, "missing or null")
        return self._answer_value(sample, field)

    def get_tools(self, sample):
        """The record's ``tools`` column (renamed: ``--data_fields tools=NAME``): a list of tool schemas (JSON objects),
        or that list as JSON text; None where the record has none."""
        field = self.fields[TOOLS_FIELD]
        value = sample.get(field)
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else None
            except json.JSONDecodeError as err:
                raise RecordError(field, f"not a JSON list of tool schemas ({err})") from None
        elif isinstance(value, (list, tuple)) and not self.keeps_nulls:  # (Arrow's None for the keys other records'
            value = without_none_values(value)  # schemas have)
        if not value:
            return None
        if not isinstance(value, (list, tuple)) or not all(isinstance(tool, dict) for tool in value):
            raise RecordError(field, "expected a list of tool schemas ({\"type\": \"function\", \"function\": "
                                     "{\"name\", \"description\", \"parameters\"}}), as apply_chat_template(tools=...) "
                                     "takes")
        return list(value)

    def get_untrained_turns(self, sample):
        return self._weighted_messages(sample)[1] if self.shape == "messages" else frozenset()

    def _weighted_messages(self, sample):
        """(messages, positions of the assistant turns of weight 0) of a conversation record ((None, none) for a
        transcript: it has no weights)."""
        field = self.fields["messages"]
        value = _json_list_text(sample.get(field), field, self.csv_cells)
        if not isinstance(value, (list, tuple)):
            return None, frozenset()
        messages = self._checked_messages(value, sample, field)
        written = self._with_system(sample, messages)  # (the system column's message first: the positions after it)
        return written, frozenset(position + len(written) - len(messages)
                                  for position in untrained_turns(value, messages))

    def get_rejected_text(self, sample):
        field = self.fields["rejected"]
        if self.shape == "messages" or sample.get(field) is None:
            return None
        if self.shape == "chosen_messages":
            prompt, answer = self._split_message_list(sample, field)
            if _turns_of(prompt) != _turns_of(self._split_message_list(sample, self.fields["chosen"])[0]):
                raise RecordError(field, f"its prompt turns differ from those of {self.fields['chosen']!r}")
            return answer
        answer = self._answer_value(sample, field)
        self._check_follows_conversation(sample, field)
        return answer

    def _check_follows_conversation(self, sample, field):
        """A rejected answer given as a list with turns before it answered those turns: they must be the conversation's
        (the chosen list's turns, else the prompt field's), which both answers are trained after. Turns before the
        prompt that differ (another system message, another earlier exchange) were dropped without a word."""
        turns = self._answer_list_turns(sample, field)
        if turns and _turns_of(turns) != _turns_of(self._conversation(sample)):
            raise RecordError(field, "its turns before the answer differ from those the chosen answer follows; a "
                                     "pair's answers must answer the same conversation")

    def get_reference_answers(self, sample):
        # TRL's completion is no pair's answer (TRL passes no completion column); Alpaca's output read without
        # --data_fields is no pair's either: its column, as written, under its own name (it came as chosen=, which no
        # column of the file is called). A messages record's last reply, the answer step 1 trains, comes as chosen, as
        # an answer renamed by --data_fields does: it has no column of its own (it was dropped; none where the
        # conversation awaits its answer, or its last reply has weight 0)
        if self.shape != "messages" and (self.fields["chosen"] == "completion" or self.alpaca_output):
            return {}
        return super().get_reference_answers(sample)

    def is_undesirable(self, sample):
        if self.label_field is None:
            return False
        value = sample.get(self.label_field)
        label = _label_value(value)
        if label is None:
            said = "missing or null" if value is None else f"{excerpt(value)} is not a label ({LABEL_SPELLINGS})"
            raise RecordError(self.label_field, f"{said}: TRL's unpaired preference records (prompt, completion, "
                                                "label) each say whether to imitate their answer")
        return not label

    def _answer_value(self, sample, field):
        """An answer given as a string, or as a message list whose last message is the assistant's. Turns before it
        (ultrafeedback_binarized's chosen repeats its prompt) must be the prompt field's: they would be dropped."""
        value = _json_list_text(sample[field], field, self.csv_cells)
        if isinstance(value, (list, tuple)):
            turns, answer = final_assistant_answer(self._checked_messages(value, sample, field), field)
            _check_answer_weighted(value, field)
            self._holding_prompt(turns, self._prompt_field_messages(sample), field)
            return answer
        return optional_text(sample, field)


def _check_answer_weighted(value, field):
    """A pair's answer (a chosen or rejected list's last message) of weight 0 is an error: a weight says which turns
    of a conversation (``messages``) step 1 trains, and a pair's answers are both read (it was, without a word)."""
    if value[-1].get("weight") == 0:
        raise RecordError(field, f"its answer (message {len(value) - 1}) has weight 0: a weight says which turns of a "
                                 "'messages' conversation to train, and a pair's answers are both read; remove it")


def _check_answer_follows_user(turns, field):
    """The turns before a conversation's answer end with the user's (said as such: not "the prompt messages must end
    with a user message")."""
    if turns[-1]["role"] == "assistant":
        raise RecordError(field, "the conversation ends with two assistant messages in a row; the answer must follow "
                                 "a user message")


def _turns_of(messages):
    """(role, text, tool calls) of each message, its whitespace runs as one space (a file's \r\n is the same prompt);
    calls of other functions or arguments are other turns (of text alone, all of them read as the same empty turn)."""
    return [(message["role"], " ".join(message["content"].split()),
             json.dumps(message.get("tool_calls"), sort_keys=True, default=str)) for message in messages]


def text_prompt_messages(text):
    """The messages of a prompt given as (stripped) text: a DeepSpeed-Chat-style transcript ("Human: ...
    \n\nAssistant:"), maybe after a system message as dschat writes one ("Be brief.\n\nHuman: ..."), else one user
    message (whose words "Human:" or "Assistant:" are its own). A transcript not ending with a Human turn is a
    ValueError."""
    transcript = with_lf_line_ends(text)
    if transcript.startswith("Human:") or (_PROMPT_AFTER_PREAMBLE.search(transcript) and
                                           transcript.endswith("Assistant:")):
        messages = parse_transcript(transcript, preamble_role="system")
        if not messages or messages[-1]["role"] != "user":
            raise ValueError("the transcript must end with a non-empty 'Human:' turn")
        return messages
    return [{"role": "user", "content": text}]


_LABEL_WORDS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}
LABEL_SPELLINGS = "true/false, 1/0, 1.0/0.0 or yes/no"  # (every spelling _label_value reads)
# 1/0 written as a float: pandas' to_csv writes a label column holding a null (NaN) as a float column, "1.0"/"0.0"
_NUMBER_LABEL = re.compile(r"([01])\.0*")


def _label_value(value):
    """A KTO label as a bool: a bool, 1/0 (also 1.0/0.0), or the text "true"/"false"/"1"/"0"/"yes"/"no"/"1.0"/"0.0" (a
    CSV cell, any case); else None."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        return _label_text_value(value.strip().lower())
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    return None


def _label_text_value(text):
    """The label a (stripped, lower-case) text spells, else None."""
    number = _NUMBER_LABEL.fullmatch(text)
    return number.group(1) == "1" if number else _LABEL_WORDS.get(text)


def _says_true_or_false(values):
    """Whether any value is a bool, the word true/false, or 1.0/0.0 as a float or its text (a float column of labels,
    as pandas writes one holding a null, to CSV or JSON): how KTO's labels are written (0/1 and yes/no are also other
    things). A float column was read as data where a CSV's text was labels: one score among 1.0/0.0 (0.7) left every
    answer trained from JSON Lines or parquet, and was its record's error from CSV."""
    return any(isinstance(v, bool) or (isinstance(v, float) and v in (0.0, 1.0))
               or (isinstance(v, str) and _spells_true_or_false(v.strip().lower())) for v in values)


def _spells_true_or_false(text):
    return text in ("true", "false") or _NUMBER_LABEL.fullmatch(text) is not None


# the speaker key of a message ({role, content}, ShareGPT's {from, value}): JSON text of objects with none is data
SPEAKER_KEYS = ("role", "from")
# JSON text of a list of objects, also as json.dumps(indent=...) writes it ("[\n {")
_LIST_OF_OBJECTS = re.compile(r"\s*\[\s*\{")
# JSON text of one object: a message's (LLaMA-Factory's pairwise answers), in a CSV cell
_OBJECT = re.compile(r"\s*\{")


def _json_list_text(value, field, csv_cell=False):
    """A message list written as JSON text (a CSV cell holds no lists) as the list, and one message (LLaMA-Factory's
    pairwise answers: {"from": "gpt", "value": ...}) as a list of it, as is its JSON text in a CSV cell (``csv_cell``:
    a JSON or parquet file's string answer that reads as a message's JSON is an answer of JSON text, trained on as
    such, as it was before); any other value (a prompt that
    happens to read as JSON, "[1, 2, 3]", or an answer that is JSON objects, a tool call's
    '[{"name": "get_weather", "arguments": ...}]') as it is. A message list written as Python, as pandas' to_csv writes
    a list column, is its record's error (it was trained on as text)."""
    if _is_one_message(value):
        return [value]
    message = _message_of_json_text(value) if csv_cell else None
    if message is not None:  # (its JSON text, as a CSV cell holds it: read as the list of it is)
        return [message]
    if isinstance(value, str) and _LIST_OF_OBJECTS.match(value):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            if _are_messages(_python_literal(value)):
                raise RecordError(field, "a message list written as Python, not JSON (pandas' to_csv writes a list "
                                         "column so); write it as JSON text (json.dumps) or save the file as JSON "
                                         "Lines or parquet") from None
            return value
        return parsed if _are_messages(parsed) else value
    return value


def _message_of_json_text(value):
    """The message ``value`` is the JSON text of ({"role": "assistant", "content": ...}, ShareGPT's {"from": "gpt",
    "value": ...}), else None: an answer that is some other JSON object ('{"name": "get_weather", ...}', or one with a
    role key but no text) is its text."""
    if not isinstance(value, str) or not _OBJECT.match(value):
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return None
    if not _is_one_message(parsed):
        return None
    speaker = parsed.get("role", parsed.get("from"))
    known = speaker in (*VALID_ROLES, *ROLE_ALIASES, *SHAREGPT_ROLES) if isinstance(speaker, str) else False
    return parsed if known and any(key in parsed for key in ("content", "value", "tool_calls", "function_call")) \
        else None


def _are_function_schemas(value):
    """Whether ``value`` (or the JSON text of it) is a list of function schemas: objects, each with its name."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return False
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(schema, dict) and isinstance(schema.get("name"), str) for schema in value)


def _is_one_message(value):
    """Whether ``value`` is one message (a dict with a speaker key), not a list of them."""
    return isinstance(value, dict) and any(key in value for key in SPEAKER_KEYS)


def _are_messages(value):
    return isinstance(value, list) and value and all(isinstance(m, dict) for m in value) and \
        any(key in m for m in value for key in SPEAKER_KEYS)


def _python_literal(text):
    """``text`` read as a Python literal, else None."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


# what chosen and rejected must hold without a prompt field: said where a record holds something else
WHOLE_CONVERSATIONS = ("without a 'prompt' field (--data_fields prompt=...), chosen and rejected must be whole "
                       "conversations, as message lists or \"\\n\\nHuman: ...\\n\\nAssistant: ...\" transcripts, or "
                       "strings that begin with the same prompt (TRL's implicit prompt)")


# what a messages field must hold (the explanation above is about chosen and rejected)
CONVERSATION = ("a conversation must be a list of messages ({role, content}) or a "
                "\"\\n\\nHuman: ...\\n\\nAssistant: ...\" transcript")


def _transcript_answer(sample, field, must_hold):
    """(prompt turns, answer) of a "Human:/Assistant:" transcript string; a string with no such turns is an error
    that says what the field must hold (``must_hold``)."""
    text = required_text(sample, field)
    if not _TRANSCRIPT_TURN.search(text):
        raise RecordError(field, f"a string without 'Human:'/'Assistant:' turns: {must_hold}")
    return answer_from_transcript(text, field)


# scripts written without spaces between words (Han, kana, Thai, Lao, Khmer, Myanmar, Tibetan): each character is a
# word boundary's side, so a shared beginning in them ends where the two part
_UNSPACED_SCRIPTS = ("\u0e00-\u0eff\u0f00-\u0fff\u1000-\u109f\u1780-\u17ff\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff"
                     "\uf900-\ufaff\uff66-\uff9f\U00020000-\U0003ffff")
# the end of a shared beginning that is the start of a word of a spaced script: it stays with the answers
_SPACED_WORD_TAIL = re.compile(rf"[^\W{_UNSPACED_SCRIPTS}]+\Z")
# the last word of a text (a character of an unspaced script), with the spaces after it
_LAST_WORD = re.compile(rf"(?:[{_UNSPACED_SCRIPTS}]|[^\s{_UNSPACED_SCRIPTS}]+)\s*\Z")


def _split_at_shared_prompt(sample, field, chosen_field, rejected_field):
    """(prompt turns, answer) of ``field`` in a pair of plain strings with TRL's implicit prompt ("The sky is blue."
    and "The sky is green."): the prompt is what both begin with up to the last word boundary (the start of the word
    they part in, "bl" of "blue" and "black", stays with the answers; "2+2=4" and "2+2=5" part after "2+2=", as TRL
    cuts them), the answer the rest. Text without word boundaries ("天空是蓝色的") is cut where the two part, as TRL
    cuts every pair: each of its characters is a word). Words of a spaced script that merely begin alike ("Blue."
    and "Black.", "Sure, ..." and "Sorry, ...") share no prompt: "Bl" or "S" is no prompt. Where one is the other's
    beginning ("The sky is blue." and "The sky is blue. Really."), the shorter one's last word is its answer (an empty
    answer is no answer, as an empty field is none)."""
    chosen, rejected = required_text(sample, chosen_field), required_text(sample, rejected_field)
    shared = _SPACED_WORD_TAIL.sub("", os.path.commonprefix([chosen, rejected]))
    if not (chosen[len(shared):].strip() and rejected[len(shared):].strip()):
        shared = _LAST_WORD.sub("", shared)  # one is the other's beginning: its last word is its answer, not nothing
    if not shared.strip():
        other = rejected_field if field == chosen_field else chosen_field
        raise RecordError(field, f"a string without 'Human:'/'Assistant:' turns that shares no beginning with "
                                 f"{other!r}: {WHOLE_CONVERSATIONS}")
    try:
        prompt = text_prompt_messages(shared.strip())
    except ValueError as error:
        raise RecordError(field, f"the prompt it shares with the other answer: {error}") from None
    return prompt, (chosen if field == chosen_field else rejected)[len(shared):].strip()
