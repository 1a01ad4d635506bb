"""``--data_fields`` parsing (``DataFields``), a dataset's identity across runs (``same_datasets``), and the
names of data kinds, split files, record fields and a message's speaker key.
"""
import os
import re
from dataclasses import dataclass

from dschat.errors import UsageError
from .base import MARGIN_FIELD


LOCAL_TYPES = ("jsonl", "json", "parquet", "csv", "disk")
EXTENSION_TYPES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
EVAL_SPLIT_NAMES = ("eval", "test", "validation")
FIELD_NAMES = ("prompt", "chosen", "rejected", "messages")


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


# the speaker key of a message ({role, content}, ShareGPT's {from, value}): JSON text of objects with none is data
SPEAKER_KEYS = ("role", "from")


def _is_one_message(value):
    """Whether ``value`` is one message (a dict with a speaker key), not a list of them."""
    return isinstance(value, dict) and any(key in value for key in SPEAKER_KEYS)


def _are_messages(value):
    return isinstance(value, list) and value and all(isinstance(m, dict) for m in value) and \
        any(key in m for m in value for key in SPEAKER_KEYS)
