"""``create_prompt_dataset``: raw data -> per-phase shares -> tokenized, blended, cached torch datasets.

Shares: ``data_split="2,4,4"`` gives each phase a disjoint, seeded share of EVERY dataset's train data and,
separately, of its eval data (DeepSpeed-Chat's scheme, so step 2 and step 3 never see step 1's records).
``sft_only_data_path`` datasets join phase 1 whole. With several sources the result is concatenated and
shuffled with the seed.

Token layout (prompt = ``format_prompt(messages)``, answer = ``format_answer(text)`` without the EOT, then
the EOT token ids):

* phase 1: ``prompt + answer + eot``, cut on the right at ``max_seq_len``. A cut answer loses its EOT on
  purpose: training the model to stop right after a truncated answer would teach it to stop mid-sentence.
  Labels are -100 over the prompt (unless ``include_prompt_in_loss``), so the loss covers answer + EOT; with
  ``multiturn`` the earlier assistant turns inside the prompt keep theirs (``label_spans``, ``multiturn.py``), and a
  conversation whose prompt is longer than ``max_seq_len`` is kept when an earlier turn starts within it.
* phase 2: ``prompt + answer[:room] + eot`` for chosen and rejected: a long answer is cut but the EOT is
  kept, so the reward model always scores a sequence that ends the way generated answers do. The prompt's
  length is kept too (``prompt_length``): DPO sums log-probs over the answer tokens only. Each pair also
  records whether max_seq_len cut its answers (``chosen_truncated``, ``rejected_truncated``) and the EOT's
  length (``eot_length``): DPO leaves a cut answer's EOT out of its answer tokens, as phase 1 drops it. And the
  record's ``margin`` (TRL's RewardTrainer's column, 0.0 where its data has none), which step 2's loss subtracts.
* phase 3: the prompt ids alone (``max_prompt_len``, else ``max_seq_len``, is their limit).

The prompt is tokenized alone (the ids step 3 generates from, and the label boundary); the answer ids are
those it gets right after the prompt in a joint tokenization (see ``answer_ids_after_prompt``).

Skipped records (never silent; counted per reason, printed on rank 0, kept in ``dataset.skipped``): ``prompt longer than
N tokens`` (phase 3; phases 1-2 only when ``max_prompt_len`` is given), ``prompt leaves no room for an answer in
--max_seq_len N`` (phases 1-2), ``answer empty after truncation``, ``chosen==rejected``, ``chosen==rejected after
truncation``, ``no rejected answer`` (SFT-only records in phase 2), ``no answer (the conversation ends with a user
turn)`` (phases 1-2), ``undesirable answer`` (phases 1-2: TRL's unpaired preference records with ``label: false``),
adapter reasons such as ``tied preference scores``, and ``unreadable FIELD`` for malformed hub records. Malformed local
records are errors instead (``DatasetFormatError``), raised when the file is loaded.
"""
import json
import os
import uuid
from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from dschat.errors import UsageError, excerpt
from dschat.report import counted
from .base import TOOL_ROLES, has_tool_turns
from .cache import cache_folder, cache_key, ensure_built, quiet_datasets, tokenizer_fingerprint
from .errors import DatasetFormatError, EndsWithUser, RecordError, SkipRecord, UntrainedAnswer
from .fields import as_data_fields
from .formatting import (ToolCallAnswer, format_answer, format_prompt, get_eot_token, templated_answer,
                         uses_chat_template)
from .multiturn import answered_turns, check_offsets_available, earlier_answer_spans
from .raw_datasets import get_raw_dataset, resolve_dataset_spec
from .sources import LocalSource
from .splits import compute_split_indices, get_raw_dataset_split_index, get_shuffle_idx, parse_data_split

TOKENIZE_BATCH = 1000
META_FILE = "meta.json"


@dataclass(frozen=True)
class EncodeSettings:
    train_phase: int
    max_seq_len: int
    max_prompt_len: int | None
    include_prompt_in_loss: bool
    eot_token: str
    multiturn: bool = False  # phase 1: train the earlier assistant turns too (multiturn.py)
    # phase 2: read each pair's margin (step 2's loss subtracts it); DPO's loss has none, so a missing or bad margin,
    # which is the data's error for step 2, must not stop it (its rows carry 0.0)
    read_margins: bool = True

    @property
    def prompt_limit(self):
        """Longest prompt kept; None: no explicit limit (phases 1-2 without max_prompt_len)."""
        if self.train_phase == 3:
            return self.max_prompt_len or self.max_seq_len
        return self.max_prompt_len


@dataclass
class Example:
    messages: list
    chosen: str | None = None
    rejected: str | None = None
    extra: dict | None = None
    prompt_text: str | None = None  # format_prompt(messages), rendered where a refusal can name the record
    unanswered: bool = False  # --multiturn: a conversation ending with a user turn, trained up to its last answer
    untrained: frozenset = frozenset()  # --multiturn: positions of the assistant turns of weight 0 (stay prompt)
    tools: list | None = None  # the record's tool schemas, rendered by the chat template (apply_chat_template(tools=))
    margin: float | None = None  # phase 2: the pair's margin (step 2's loss subtracts it); None: its data has none


def phase_features(train_phase):
    from datasets import Features, List, Value

    ids = List(Value("int32"))
    return Features({
        1: {"input_ids": ids, "label_start": Value("int32"), "label_spans": ids},
        2: {"chosen_input_ids": ids, "rejected_input_ids": ids, "prompt_length": Value("int32"),
            "chosen_truncated": Value("bool"), "rejected_truncated": Value("bool"), "eot_length": Value("int32"),
            "margin": Value("float64")},
        3: {"prompt_input_ids": ids, "prompt_text": Value("string"), "messages_json": Value("string"),
            "extra_json": Value("string")},
    }[train_phase])


class PromptDataset(Dataset):
    """The tokenized data of one phase (a torch Dataset over a memory-mapped Arrow table).

    Items: phase 1 ``input_ids, attention_mask, labels``; phase 2 ``chosen_input_ids,
    chosen_attention_mask, rejected_input_ids, rejected_attention_mask, prompt_length`` (how many prompt ids
    both sequences start with), ``chosen_truncated, rejected_truncated`` (whether max_seq_len cut that answer;
    its sequence still ends with the ``eot_length`` EOT ids), ``margin`` (a float: the record's, 0.0 where its data
    has none; step 2's loss subtracts it); phase 3 ``prompt_input_ids, prompt_text,
    messages`` plus the extra columns of its records (``columns``: None where a record lacks one). Token tensors are
    1-D LongTensors, unpadded.

    ``skipped`` (reason -> count), ``skip_report`` (per source), ``cache_path`` and ``built`` (whether this
    process built the cache) describe how it was made; ``hub_data`` ({hub dataset: ``hub_data_fingerprint``}) which
    data of each hub dataset it holds (what a step's checkpoints record of it, as they record local files' hashes).
    """
    # phase-3 item and batch keys that extra columns must not overwrite (such extras get an "extra_" prefix): the
    # item's, the collator's and the evaluation loader's (samplers.eval_weight: a column of that name was read as the
    # rows' weights in the held-out means on one rank, and overwritten by them on several)
    RESERVED_KEYS = ("prompt_input_ids", "prompt_text", "messages", "prompt", "prompt_att_mask", "eval_weight")

    def __init__(self, data, train_phase, skip_report=(), cache_path=None, built=False):
        super().__init__()
        self.data = data
        self.train_phase = train_phase
        self.skip_report = list(skip_report)
        self.skipped = dict(sum((Counter(entry["skipped"]) for entry in self.skip_report), Counter()))
        self.hub_data = {entry["source"]: entry["hub_data"] for entry in self.skip_report if "hub_data" in entry}
        self.cache_path = cache_path
        self.built = built
        # phase 3: the extra columns of its records, which every item has (None where its record has none): a batch
        # of records that all lacked one had no such key, and a reward function taking it failed on that batch alone
        self.columns = sorted({self._item_key(key) for entry in self.skip_report for key in entry.get("columns", ())})
        # (here, not at encoding: a cache built before this check is read through here too)
        check_no_renamed_column_clash(self.source_columns(), self.RESERVED_KEYS)
        say_renamed_columns(sorted({key for entry in self.skip_report for key in entry.get("columns", ())
                                    if key in self.RESERVED_KEYS}), "the prompt batches (and --reward_fn)")

    def __len__(self):
        return len(self.data)

    def __getitem__(self, idx):
        row = self.data[int(idx)]
        if self.train_phase == 1:
            input_ids = torch.tensor(row["input_ids"], dtype=torch.long)
            labels = input_ids.clone()
            labels[:row["label_start"]] = -100
            spans = row["label_spans"]  # --multiturn: the earlier assistant turns, inside the prompt
            for start, end in zip(spans[::2], spans[1::2]):
                labels[start:end] = input_ids[start:end]
            return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
        if self.train_phase == 2:
            chosen = torch.tensor(row["chosen_input_ids"], dtype=torch.long)
            rejected = torch.tensor(row["rejected_input_ids"], dtype=torch.long)
            return {"chosen_input_ids": chosen, "chosen_attention_mask": torch.ones_like(chosen),
                    "rejected_input_ids": rejected, "rejected_attention_mask": torch.ones_like(rejected),
                    "prompt_length": row["prompt_length"], "chosen_truncated": row["chosen_truncated"],
                    "rejected_truncated": row["rejected_truncated"], "eot_length": row["eot_length"],
                    "margin": row["margin"]}
        item = {"prompt_input_ids": torch.tensor(row["prompt_input_ids"], dtype=torch.long),
                "prompt_text": row["prompt_text"], "messages": json.loads(row["messages_json"])}
        for key, value in json.loads(row["extra_json"]).items():
            item[self._item_key(key)] = value
        for key in self.columns:
            item.setdefault(key, None)
        return item

    def _item_key(self, column):
        return extra_name(column) if column in self.RESERVED_KEYS else column

    @property
    def margin_records(self):
        """Phase 2: how many of its pairs carry a margin the loss subtracts (the data report's count; 0 where the
        margins were not read)."""
        return sum(entry.get("margin") or 0 for entry in self.skip_report)

    def source_columns(self):
        """{source: the extra columns of its records, as they are in the data}."""
        columns = {}
        for entry in self.skip_report:
            columns.setdefault(entry["source"], set()).update(entry.get("columns", ()))
        return {source: sorted(names) for source, names in columns.items()}

    def item_columns_by_source(self):
        """{source: the extra columns of its records, as its items have them (a reserved name's as extra_<name>)}."""
        return {source: sorted(map(self._item_key, names)) for source, names in self.source_columns().items()}


def extra_name(column):
    """The name a data column comes under when its own is taken (one of dschat's keys, a reward function's argument)."""
    return "extra_" + column


def renamed_columns_note(renamed, to):
    """The one wording of the note that the data's ``renamed`` columns come to ``to`` as extra_<name>."""
    return (f"the data's column(s) {', '.join(renamed)} come to {to} as "
            f"{', '.join(extra_name(name) for name in renamed)}")


_RENAMES_SAID = set()  # the data columns whose renaming this process has said (train and eval: once)


def say_renamed_columns(renamed, to):
    """README's "comes as extra_<name>, and a run says so": said once per column and process."""
    from dschat.utils.dist import print_rank_0

    unsaid = [name for name in renamed if name not in _RENAMES_SAID]
    if unsaid:
        _RENAMES_SAID.update(unsaid)
        print_rank_0(f"[data] {renamed_columns_note(unsaid, to)}: the names are dschat's own")


def check_no_renamed_column_clash(source_columns, taken, whose="one of dschat's own names"):
    """A source with a column named as one of ``taken`` (``whose``) and one named as its extra_<name> as well: both
    would come as extra_<name>, one of the two lost on each record that has both. A UsageError naming the source and
    both columns."""
    for source, columns in source_columns.items():
        clash = [name for name in taken if name in columns and extra_name(name) in columns]
        if clash:
            name = clash[0]
            raise UsageError(f"{source}: the prompt data has columns {name!r} and {extra_name(name)!r}; {name} is "
                             f"{whose}, so the column {name} comes as {extra_name(name)}, and one of the two would be "
                             f"lost: rename one of those columns")


def create_prompt_dataset(local_rank, data_path, data_split, output_path, train_phase, seed, tokenizer,
                          max_seq_len, end_of_conversation_token=None, sft_only_data_path=(), reload=False,
                          include_prompt_in_loss=False, max_prompt_len=None, data_fields=None, multiturn=False,
                          read_margins=True):
    """(train_dataset, eval_dataset) for ``train_phase`` (1, 2 or 3), built once and cached.

    ``data_path``: dataset names/specs (see ``get_raw_dataset``); ``data_split``: phase shares such as
    "2,4,4"; ``end_of_conversation_token``: defaults to ``get_eot_token(tokenizer)``; ``data_fields``: field
    renames for local data (dict or "prompt=question,chosen=good"; one per dataset: {spec: dict} or
    "SPEC:prompt=question;SPEC2:prompt=instruction", ``parse_data_fields``); ``reload``: rebuild the cache (once on
    each storage the ranks write to, by the first rank there; the others wait at a barrier and load the rebuilt data);
    ``multiturn``: phase 1 also trains the earlier assistant turns of a conversation (``multiturn.py``);
    ``read_margins``: phase 2 reads each pair's margin (step 2's); False (DPO) leaves them unread, counted as such.
    """
    if train_phase not in (1, 2, 3):
        raise ValueError(f"train_phase must be 1, 2 or 3, got {train_phase!r}")
    parse_data_split(data_split)  # fail early on a malformed split
    data_path = as_list(data_path)
    sft_only = as_list(sft_only_data_path) if train_phase == 1 else []
    if not data_path and not sft_only:
        raise UsageError("data_path is empty: give at least one dataset")
    flags = flags_of_sources(data_path, sft_only)
    say_sources_given_twice(data_path + sft_only, flags)
    field_options = _field_options(data_fields, data_path + sft_only)
    settings = EncodeSettings(train_phase, int(max_seq_len), max_prompt_len, bool(include_prompt_in_loss),
                              end_of_conversation_token or get_eot_token(tokenizer), bool(multiturn),
                              bool(read_margins))
    hub, hub_data = hub_sources_on_rank_0(flags, output_path, seed, local_rank)
    key = cache_key(_cache_params(data_path, sft_only, data_split, seed, field_options, settings, tokenizer, hub_data))
    folder = cache_folder(output_path, train_phase, key)

    def build_into(tmp):
        build_and_save(tmp, data_path, sft_only, data_split, output_path, seed, local_rank, tokenizer,
                       settings, field_options, reload, hub)

    from dschat.utils.dist import rank_0_decides

    # one token for every rank (rank 0's): the cache is rebuilt once on each storage the ranks write to, whichever rank
    # (of whichever node) gets there first
    rebuild = rank_0_decides(lambda: uuid.uuid4().hex) if reload else None
    built = ensure_built(folder, build_into, rebuild=rebuild)
    _barrier()
    train, eval_ = load_cached(folder, train_phase, built)
    for dataset in (train, eval_):  # a cache built before its report kept it: the data its key holds
        dataset.hub_data = {**hub_data, **dataset.hub_data}
    # (the hub data this rank's cache holds: a node that built from another revision in its own HF cache differs)
    check_same_data_on_every_rank(train_phase, data_path + sft_only, tokenizer, train, eval_, train.hub_data)
    _print_skip_report(local_rank, train, eval_)
    return train, eval_


def check_same_data_on_every_rank(train_phase, specs, tokenizer, train, eval_, hub_data):
    """Every rank read the same data: on several nodes, each reading its own copy of a data file (or of a hub dataset
    or model in its own cache), copies that differ gave the ranks datasets of other sizes, and the rank with fewer
    batches left its epoch while the others waited for it in a collective (a hang); of one size, the ranks drew their
    shares from different records. Compares the sources' content (not their paths), the tokenizer and the record
    counts (collective); a UsageError on every rank naming what differs."""
    from dschat.utils.dist import get_world_size, local_device, names_differing_between_ranks

    if get_world_size() == 1:
        return
    values = {f"source {i:04d}": _content_fingerprint(spec, hub_data) for i, spec in enumerate(specs)}
    values["tokenizer"] = {key: value for key, value in tokenizer_fingerprint(tokenizer).items()
                           if key != "name_or_path"}  # (a folder's path may differ between nodes)
    values["records"] = [len(train), len(eval_)]
    differ = names_differing_between_ranks(values, local_device())
    if not differ:
        return
    said = [f"{specs[int(name.split()[1])]} (its content)" if name.startswith("source ") else
            "the tokenizer" if name == "tokenizer" else
            f"the record counts (here {len(train)} train / {len(eval_)} eval)" for name in values if name in differ]
    raise UsageError(f"the ranks read different phase-{train_phase} data: {', '.join(said)} differ between them "
                     "(each node's own copy of a file, or of a hub dataset or model in its cache, that is not the "
                     "same): give every node the same files")


def _content_fingerprint(spec, hub_data):
    """``_source_fingerprint`` without the files' paths: their sizes and content hashes."""
    fingerprint = _source_fingerprint(spec, hub_data)
    if "files" in fingerprint:
        fingerprint = {**fingerprint, "files": [stat[1:] for stat in fingerprint["files"]]}
    return fingerprint


def flags_of_sources(data_path, sft_only):
    """{spec: the flag that gave it} of the sources, in order: --data_path, else step 1's --sft_only_data_path. A
    source's errors name its flag: those of --sft_only_data_path's were said of --data_path."""
    return {**{spec: "--sft_only_data_path" for spec in sft_only}, **{spec: "--data_path" for spec in data_path}}


def say_sources_given_twice(specs, flags):
    """A source listed twice (in --data_path, or there and in --sft_only_data_path) is read twice: its records count
    double, and a record may land in one phase's train split and another's eval split. Said, as it may be meant.
    ``flags``: ``flags_of_sources``' (the first to resolve each spec, its errors name the flag that gave it)."""
    from dschat.utils.dist import print_rank_0

    sources = [resolve_dataset_spec(spec, flags[spec]) for spec in specs]
    # the files each reads: a folder's train file given again as a file (or with another eval file) is read twice too
    keys = [{os.path.abspath(path) for path in source.files} if isinstance(source, LocalSource) else {source}
            for source in sources]
    twice = sorted({spec for i, (spec, key) in enumerate(zip(specs, keys))
                    if any(key & other for j, other in enumerate(keys) if j != i)})
    if twice:
        print_rank_0(f"[dschat.data] {', '.join(twice)}: the same data given more than once; each time its records "
                     "are read again (they count twice)")


def phase_share_bound(data_path, data_split, seed, train_phase, data_fields=None):
    """How many training records ``train_phase``'s share of ``data_path`` holds, read without encoding any (records
    skipped while encoding come off it: a bound); None when a hub dataset is among them (train.py's pre-flight reads
    no hub data; the step counts it when it runs)."""
    specs = as_list(data_path)
    if any(isinstance(resolve_dataset_spec(spec), type) for spec in specs):
        return None
    total = 0
    fields = _field_options(data_fields, specs)
    for spec in specs:
        raw = get_raw_dataset(spec, None, seed, -1, **fields.for_spec(spec))
        total += len(compute_split_indices(seed, data_split, len(raw.get_train_data()))[train_phase - 1])
    return total


def has_no_pairs(data_path, seed, data_fields=None):
    """Whether every source of ``data_path`` is a local file without rejected answers (prompts, SFT or unpaired
    records), read without encoding: step 2 and DPO would skip all its records. False when a hub dataset is among
    them (train.py's pre-flight reads no hub data)."""
    specs = as_list(data_path)
    if any(isinstance(resolve_dataset_spec(spec), type) for spec in specs):
        return False
    fields = _field_options(data_fields, specs)
    sources = [get_raw_dataset(spec, None, seed, -1, **fields.for_spec(spec)) for spec in specs]
    for raw in sources:
        if hasattr(raw, "check_rejected_rename"):  # a misspelt rejected=... is said as such, not as "no pairs"
            raw.check_rejected_rename()
    return not any(getattr(raw, "has_rejected", True) for raw in sources)


def as_list(paths):
    """--data_path as a list; the notebook API may give one name as a string."""
    if isinstance(paths, str):
        return [paths]
    return list(paths or [])


def _field_options(data_fields, specs):
    """``data_fields`` (``as_data_fields``: text or the notebook API's dict) as a ``DataFields`` whose datasets are
    among ``specs``."""
    fields = as_data_fields(data_fields)
    fields.check_names(specs, "--data_path or --sft_only_data_path")
    return fields


def _cache_params(data_path, sft_only, data_split, seed, field_options, settings, tokenizer, hub_data):
    """Everything that changes the result (the source fingerprints include local files' content hashes and what the
    hub datasets loaded, ``hub_data``)."""
    return {
        "datasets": [_source_fingerprint(spec, hub_data) for spec in data_path],
        "sft_only": [_source_fingerprint(spec, hub_data) for spec in sft_only],
        "data_split": str(data_split), "seed": seed, "field_options": field_options.cache_params(data_path, sft_only),
        "train_phase": settings.train_phase, "max_seq_len": settings.max_seq_len,
        "max_prompt_len": settings.max_prompt_len, "eot_token": settings.eot_token,
        # the prompt mask only exists in phase 1; keeping it out of other keys avoids needless rebuilds
        "include_prompt_in_loss": settings.include_prompt_in_loss if settings.train_phase == 1 else None,
        "multiturn": settings.multiturn if settings.train_phase == 1 else None,
        "read_margins": settings.read_margins if settings.train_phase == 2 else None,
        "tokenizer": tokenizer_fingerprint(tokenizer),
    }


def _source_fingerprint(spec, hub_data):
    """``hub_data``: {spec: ``hub_data_fingerprint``} of the hub datasets (``hub_sources_on_rank_0``)."""
    resolved = resolve_dataset_spec(spec)
    if isinstance(resolved, type):
        if os.path.isdir(spec):  # a local copy under the hub name, saved or downloaded (PromptRawDataset.local_copy)
            return {"hub": spec, **LocalSource("disk", spec, None, spec).fingerprint()}
        return {"hub": spec, "data": hub_data.get(spec)}  # (none: a save_to_disk folder only rank 0's node has)
    return {"local": spec, **resolved.fingerprint()}


def hub_sources_on_rank_0(flags, output_path, seed, local_rank):
    """The hub datasets among ``specs`` loaded by rank 0 alone, as DeepSpeed-Chat's builds do: ({spec: adapter} on rank
    0, {} on the others, whose builds load their own), and {spec: ``hub_data_fingerprint``} on every rank, for the
    key. (Every rank asked the hub, and every node needed the dataset in its own HF cache even with its tokens
    cached.) ``flags``: {spec: the flag that gave it} (``flags_of_sources``), named where one cannot be loaded."""
    from dschat.utils.dist import rank_0_decides

    loaded = {}

    def load():
        loaded.update(load_hub_sources(flags, output_path, seed, local_rank))
        return {spec: hub_data_fingerprint(adapter.raw_datasets) for spec, adapter in loaded.items()}

    return loaded, rank_0_decides(load)


def load_hub_sources(flags, output_path, seed, local_rank):
    """{spec: adapter} of the hub datasets among ``specs``, loaded before the cache key, which holds what they loaded
    (``hub_data_fingerprint``); the build reads them without loading them again. A save_to_disk copy under a hub name is
    keyed by its files, as local data is, and loaded only by a build."""
    return {spec: get_raw_dataset(spec, output_path, seed, local_rank, flag=flag) for spec, flag in flags.items()
            if loads_from_the_hub(spec)}


def loads_from_the_hub(spec):
    """A hub dataset read through the HF datasets cache (not a local copy under its name, or local data)."""
    return isinstance(resolve_dataset_spec(spec), type) and not os.path.isdir(spec)


def hub_data_fingerprint(raw_datasets):
    """Each split's datasets fingerprint, which datasets keys its own cache by: for hub data the hash of its folder in
    the HF datasets cache (name, config, version and the commit of the hub revision it holds). A new revision
    downloaded, or another one in the HF cache, gets a new key; the same copy keeps it, online or offline (with
    HF_HUB_OFFLINE=1 datasets loads the latest copy it has, with that folder's fingerprint)."""
    return {name: split._fingerprint for name, split in sorted(raw_datasets.items())}


def _barrier():
    from dschat.utils.dist import barrier

    barrier()


# --- building ---

def build_and_save(folder, data_path, sft_only, data_split, output_path, seed, local_rank, tokenizer,
                   settings, field_options, reload, hub):
    """``hub``: the hub datasets already loaded (``load_hub_sources``); the other sources are loaded here."""
    parts = {"train": [], "eval": []}
    seen = {"train": {}, "eval": {}}  # each split's records so far, across sources (``count_duplicates``)
    report = []
    sources = [(spec, data_split) for spec in data_path] + [(spec, None) for spec in sft_only]
    raws = [_usable_source(spec, split, hub, output_path, seed, local_rank, settings.train_phase, field_options)
            for spec, split in sources]
    for split_name in ("train", "eval"):  # (every train record is seen before the eval records that repeat one)
        for index, ((spec, split), raw) in enumerate(zip(sources, raws)):
            data = raw.get_train_data() if split_name == "train" else raw.get_eval_data()
            records = data if split is None else _phase_share(raw, data, split_name, split, settings,
                                                              output_path, seed, local_rank, reload)
            table, skips, notes = encode_records(raw, records, tokenizer, settings, seen[split_name], index,
                                                 seen["train"] if split_name == "eval" else None)
            parts[split_name].append(table)
            # which data of a hub dataset these tokens hold (PromptDataset.hub_data): rank 0's load, or this rank's own
            loaded = {"hub_data": hub_data_fingerprint(raw.raw_datasets)} if loads_from_the_hub(spec) else {}
            report.append({"source": spec, "split": split_name, "total": len(records), "skipped": dict(skips),
                           "of": len(data), "data_split": None if split is None else str(split), **notes, **loaded})
    save_cache(folder, blend(parts["train"], seed, settings.train_phase),
               blend(parts["eval"], seed, settings.train_phase), report)


def _usable_source(spec, split, hub, output_path, seed, local_rank, train_phase, field_options):
    """The raw dataset of one --data_path / --sft_only_data_path source (``split`` None), checked to suit the
    phase."""
    flag = "--data_path" if split is not None else "--sft_only_data_path"
    raw = hub[spec] if spec in hub else get_raw_dataset(spec, output_path, seed, local_rank, flag=flag,
                                                        **field_options.for_spec(spec))
    if split is None or parse_data_split(split)[train_phase - 1] > 0:
        # (a source --data_split gives this phase no share of, e.g. step 3's prompts beside step 1's
        # --sft_only_data_path under 0,0,1, need not suit it)
        raw.check_usable(train_phase)
    return raw


def check_local_sources_usable(data_path, sft_only, data_split, seed, train_phase, data_fields=None):
    """The error a step of ``train_phase`` raises on loading its data where a local source cannot feed it (e.g.
    prompts without answers for step 1), found by reading the sources without encoding them (train.py's pre-flight,
    as ``has_no_pairs``). Hub datasets are left to the step: the pre-flight reads no hub data."""
    sources = [(spec, data_split) for spec in as_list(data_path)] + [(spec, None) for spec in as_list(sft_only)]
    fields = _field_options(data_fields, [spec for spec, _ in sources])
    for spec, split in sources:
        if not isinstance(resolve_dataset_spec(spec), type):  # (a hub dataset's reader is its class)
            _usable_source(spec, split, {}, None, seed, -1, train_phase, fields)


def _phase_share(raw, data, split_name, data_split, settings, output_path, seed, local_rank, reload):
    index = get_raw_dataset_split_index(local_rank, output_path, raw.dataset_name_clean, seed, split_name,
                                        data_split, settings.train_phase - 1, len(data), rebuild=reload)
    return data.select(index)


def blend(tables, seed, train_phase):
    """Concatenate, then shuffle with the seed when there is more than one source."""
    from datasets import Dataset, concatenate_datasets

    tables = [table for table in tables if len(table)]
    if not tables:
        features = phase_features(train_phase)
        return Dataset.from_dict({name: [] for name in features}, features=features)
    if len(tables) == 1:
        return tables[0]
    combined = concatenate_datasets(tables)
    return combined.select(get_shuffle_idx(seed, len(combined)))


def save_cache(folder, train, eval_, report):
    with quiet_datasets():
        for name, table in (("train", train), ("eval", eval_)):
            # datasets cannot reload a 0-shard save, so an empty table is written as one empty shard
            table.save_to_disk(os.path.join(folder, name), num_shards=1 if len(table) == 0 else None)
    with open(os.path.join(folder, META_FILE), "w") as f:
        json.dump({"report": report}, f, indent=1)


def load_cached(folder, train_phase, built):
    from datasets import load_from_disk

    with open(os.path.join(folder, META_FILE)) as f:
        report = json.load(f)["report"]
    with quiet_datasets():
        return tuple(PromptDataset(load_from_disk(os.path.join(folder, name)), train_phase,
                                   [entry for entry in report if entry["split"] == name], folder, built)
                     for name in ("train", "eval"))


# --- encoding ---

def encode_records(raw, records, tokenizer, settings, seen=None, source=0, train_seen=None):
    """(datasets.Dataset of the phase's rows, Counter of skip reasons, the report's notes) for the records of one
    source. Notes: ``cut`` (how many rows max_seq_len cut an answer of), ``formatted`` (``already_formatted(...)``),
    ``duplicates`` (``count_duplicates``, given the split's ``seen`` records and this ``source``'s number),
    ``in_train`` (for eval records, given every train record in ``train_seen``: how many repeat one) and with
    ``--multiturn`` ``turns`` ([earlier assistant turns trained, not found in the prompt]), ``unanswered`` and
    ``last_turn_cut`` (conversations trained on their earlier turns only: ending with a user turn, longer than
    max_seq_len)."""
    from datasets import Dataset

    skips = Counter()
    multiturn = settings.multiturn and settings.train_phase == 1
    examples = extract_examples(raw, records, settings.train_phase, skips, tokenizer, multiturn, settings.eot_token,
                                settings.read_margins)
    encoder = {1: encode_sft, 2: encode_pair, 3: encode_prompt}[settings.train_phase]
    rows, kept, unanswered = [], [], 0
    for example, tokens in zip(examples, tokenize_examples(examples, tokenizer, settings)):
        try:
            rows.append(encoder(example, tokens, settings))
            kept.append(example)
            unanswered += example.unanswered
        except SkipRecord as skip:
            skips[skip.reason] += 1
    features = phase_features(settings.train_phase)
    keys = [record_key(example) for example in kept]  # (hashed once for the duplicate and in-train counts)
    notes = {"cut": sum(1 for row in rows if row.get("cut") or row.get("chosen_truncated")
                        or row.get("rejected_truncated")),
             "formatted": already_formatted(examples, tokenizer),
             "duplicates": count_duplicates(keys, {} if seen is None else seen, source),
             "in_train": sum(key in train_seen for key in keys) if train_seen else 0}
    if settings.train_phase == 2 and settings.read_margins:
        notes["margin"] = sum(example.margin is not None for example in kept)
    elif settings.train_phase == 2:  # (DPO: the records of the share whose margin it leaves unread, as it did)
        notes["margin_unread"] = sum(sample.get(raw.margin_field) is not None for sample in records)
    if settings.train_phase == 3:  # (the split's columns: PromptDataset gives each item all of them)
        notes["columns"] = sorted({key for example in kept for key in example.extra or {}})
    if multiturn:
        notes["turns"] = [sum(len(row["label_spans"]) // 2 for row in rows), sum(row["turns_missed"] for row in rows)]
        notes["unanswered"] = unanswered
        notes["last_turn_cut"] = sum(row["last_turn_cut"] for row in rows)
    return Dataset.from_dict({name: [row[name] for row in rows] for name in features}, features=features), skips, notes


def count_duplicates(keys, seen, source):
    """[how many kept records (their ``record_key``s) repeat an earlier one exactly (what the phase reads of them:
    messages, answers, extra fields, the turns it trains), how many of those first came from another source], else
    None. ``seen`` (record hash -> source number) carries over between the sources of a split: the same pair in two
    --data_path files counts too. Kept, as DeepSpeed-Chat and TRL keep them (a repeated record trains twice); said in
    the data report."""
    again = elsewhere = 0
    for key in keys:
        if key in seen:
            again += 1
            elsewhere += seen[key] != source
        else:
            seen[key] = source
    return [again, elsewhere] if again else None


def record_key(example):
    """A hash of what the phase reads of a record (messages, answers, extra fields, the turns it does not train, its
    tools):
    equal for exact copies. (The same conversation with another assistant turn of weight 0 trains other turns with
    --multiturn: it was counted as a copy, 'trained again'.)"""
    import hashlib

    text = json.dumps([example.messages, example.chosen, example.rejected, example.extra, sorted(example.untrained),
                       example.tools, [getattr(answer, "tool_calls", None) for answer in (example.chosen,
                                                                                          example.rejected)],
                       example.margin],
                      sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def already_formatted(examples, tokenizer):
    """[how many records, e.g. which token] whose text holds one of the tokenizer's special tokens: a prompt already
    run through a chat template (OpenRLHF's data without --apply_chat_template) is formatted again, with a second
    BOS and template, and an answer ending in the end token gets a second one. Said in the data report."""
    specials = {token for token in [*tokenizer.all_special_tokens, *(added.content for added in
                getattr(tokenizer, "added_tokens_decoder", {}).values() if added.special)]
                if token and token not in {tokenizer.pad_token} - {tokenizer.eos_token, tokenizer.bos_token}}
    count, example = 0, None
    for item in examples:
        texts = [m["content"] for m in item.messages] + [item.chosen or "", item.rejected or ""]
        found = next((token for token in specials if any(token in text for text in texts)), None)
        if found:
            count, example = count + 1, example or found
    return [count, example] if count else None


def extract_examples(raw, records, train_phase, skips, tokenizer, multiturn=False, eot_token=None, read_margins=True):
    examples = []
    for sample in records:
        try:
            example = extract_example(raw, sample, train_phase, multiturn, read_margins)
            example.prompt_text = rendered_prompt(example.messages, tokenizer, raw, sample, example.tools)
            check_answer_calls_rendered(example, tokenizer, eot_token, raw)
            examples.append(example)
        except SkipRecord as skip:
            skips[skip.reason] += 1
        except RecordError as err:
            if raw.strict:  # a local file's record: an error naming it (its fields were validated on load)
                raise DatasetFormatError(f"{raw.locate(sample)}: {err}") from err
            skips[f"unreadable {err.field}"] += 1
    return examples


def rendered_prompt(messages, tokenizer, raw=None, sample=None, tools=None):
    """``format_prompt``; a chat template that refuses the messages (``raise_exception``: "System role not
    supported", roles not alternating) is a RecordError of the record (``sample`` of ``raw``: of the field that holds
    them; a prompt's message list was said to be field 'messages'), not jinja's traceback. So are tool turns that no
    chat template renders (``check_tool_turns_rendered``)."""
    from jinja2.exceptions import TemplateError

    try:
        text = format_prompt(messages, tokenizer, tools) if uses_chat_template(tokenizer) or \
            not (tools or has_tool_turns(messages)) else None
    except TemplateError as err:
        first = next((m["content"] for m in messages if m["role"] == "user"), "")
        raise RecordError(_conversation_field(raw, sample),
                          f"the tokenizer's chat template refuses them ({err}){refused_message(messages)}; the "
                          f"record's first user message: {excerpt(first)}") from err
    try:
        check_tool_turns_rendered(messages, text, "messages", tokenizer, tools)
    except RecordError as err:  # (of the field that holds the messages)
        raise RecordError(_conversation_field(raw, sample), err.detail) from err
    check_tools_rendered(tools, text, getattr(raw, "fields", {}).get("tools", "tools"))
    return text


def _conversation_field(raw, sample):
    """The field that holds the record's messages, for its error (read only then: it was read for every record)."""
    return raw.conversation_field(sample) if raw is not None else "messages"


def check_tools_rendered(tools, text, field):
    """Each of a record's tool schemas must be in the prompt ``text`` the chat template rendered (None: no template)
    by its function's name: a template that leaves them out (a plain ChatML one), or the Human:/Assistant: format,
    would train the answer to a conversation without the tools it was given."""
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        name = function.get("name")
        if text is None:
            raise RecordError(field, f"the record's tools ({name!r}, ...) are rendered only by a chat template that "
                                     "renders them, and the tokenizer has none (the Human:/Assistant: format); use a "
                                     "tokenizer whose chat template renders tools (Qwen2.5's, Llama-3.1's), or leave "
                                     "the record out")
        if not isinstance(name, str) or name not in text:
            raise RecordError(field, f"the tokenizer's chat template does not render the record's tool {name!r} (not "
                                     "in its prompt), so the model would be trained without it; use a chat template "
                                     "that renders tools (apply_chat_template(tools=...): Qwen2.5's, Llama-3.1's), or "
                                     "leave the record out")


def check_tool_turns_rendered(messages, text, field, tokenizer=None, tools=None):
    """A tool's result or an assistant's tool call must be in the prompt ``text`` the chat template rendered (None:
    no template): a template that drops them, or writes no calls, would train the answer after a conversation without
    them, as TRL's SFTTrainer does without a word. Each such turn is rendered again with its function names (a
    result: its content) replaced by a mark, which must be in that rendering: a name was looked for after the text of
    the message before, and where the template wrote that message otherwise (trimmed) it was found in the tool
    schemas the template lists first, so a template that dropped the calls passed."""
    if not has_tool_turns(messages):
        return
    for index, message in enumerate(messages):
        calls = message.get("tool_calls") or ()
        if message["role"] not in TOOL_ROLES and not calls:
            continue
        if text is None:
            raise RecordError(field, f"message {index} {_tool_turn(message)}: tool calls and results are rendered "
                                     "only by a chat template that renders them, and the tokenizer has none (the "
                                     "Human:/Assistant: format); use a tokenizer whose chat template renders tools "
                                     "(Qwen2.5's, Llama-3.1's), or leave the record out")
        piece = _unrendered_piece(messages, index, text, tokenizer, tools)
        if piece is not None:
            raise RecordError(field, f"message {index} {_tool_turn(message)}, but the tokenizer's chat template "
                                     f"does not render {'it' if calls else 'its content'} ({excerpt(piece)}): the "
                                     "model would be trained without it; use a chat template that renders tool "
                                     "calls and results (Qwen2.5's, Llama-3.1's), or leave the record out")


def _unrendered_piece(messages, index, text, tokenizer, tools):
    """The first function name of message ``index``'s calls (a tool result's content) that the chat template does not
    write, else None: the messages rendered with each one replaced by a mark (``TOOL_TURN_MARK``) must hold the mark.
    A template that refuses the marked messages: the piece must be in ``text``."""
    from jinja2.exceptions import TemplateError

    message, marked = messages[index], list(messages)
    calls = message.get("tool_calls") or ()
    pieces = [call["function"]["name"] for call in calls] or [message["content"]]
    marks = [TOOL_TURN_MARK.format(number) for number in range(len(pieces))]
    if calls:
        marked[index] = {**message, "tool_calls": [{**call, "function": {**call["function"], "name": mark}}
                                                   for call, mark in zip(calls, marks)]}
    else:
        marked[index] = {**message, "content": marks[0]}
    try:
        rendered = format_prompt(marked, tokenizer, tools)
    except (TemplateError, ValueError):
        return next((piece for piece in pieces if piece not in text), None)
    return next((piece for piece, mark in zip(pieces, marks) if mark not in rendered), None)


def check_answer_calls_rendered(example, tokenizer, eot_token=None, raw=None):
    """An answer that calls tools (``ToolCallAnswer``: the conversation's last turn is the call) is trained as the chat
    template writes its turn after the prompt (``format_answer``): each call's function name, replaced by a mark, must
    be in what the template writes there up to its EOT. Without a template, or with one that drops the calls (a plain
    ChatML one writes the call's empty content), the answer would be an empty turn: the record's error."""
    for side in ("chosen", "rejected"):
        answer = getattr(example, side)
        calls = getattr(answer, "tool_calls", None)
        if not calls:
            continue
        field = _answer_field(raw, side)
        if not uses_chat_template(tokenizer):
            raise RecordError(field, f"its answer calls the tool {calls[0]['function']['name']!r}: tool calls are "
                                     "rendered only by a chat template that renders them, and the tokenizer has none "
                                     "(the Human:/Assistant: format); use a tokenizer whose chat template renders "
                                     "tools (Qwen2.5's, Llama-3.1's), or leave the record out")
        name = _unrendered_answer_call(example, answer, tokenizer, eot_token or get_eot_token(tokenizer))
        if name is not None:
            raise RecordError(field, f"its answer calls the tool {name!r}, but the tokenizer's chat template does not "
                                     "write the call after the prompt, up to its end token: the model would be trained "
                                     "on an empty turn; use a chat template that renders tool calls (Qwen2.5's, "
                                     "Llama-3.1's), or leave the record out")


def _unrendered_answer_call(example, answer, tokenizer, eot):
    """The first function name of ``answer``'s calls that the template does not write in the answer's turn, else
    None."""
    marks = [TOOL_TURN_MARK.format(number) for number in range(len(answer.tool_calls))]
    marked = ToolCallAnswer(answer, [{**call, "function": {**call["function"], "name": mark}}
                                     for call, mark in zip(answer.tool_calls, marks)])
    written = templated_answer(example.messages, marked, tokenizer, eot, tools=example.tools) or ""
    return next((call["function"]["name"] for call, mark in zip(answer.tool_calls, marks) if mark not in written),
                None)


def _answer_field(raw, side):
    """The field that holds a record's ``side`` answer ("chosen": a conversation's last turn, in its messages)."""
    fields = getattr(raw, "fields", {})
    if side == "chosen" and getattr(raw, "shape", None) == "messages":
        return fields.get("messages", "messages")
    return fields.get(side, side)


# what stands for a tool call's function name or a tool result's content where their rendering is checked (letters,
# digits and "_", as a function's name: templates that escape or quote it write it as it is)
TOOL_TURN_MARK = "dschat_tool_turn_mark_{}"


def _tool_turn(message):
    if message.get("tool_calls"):
        return f"calls the tool {message['tool_calls'][0]['function']['name']!r}"
    return f"is a tool's result (role {message['role']!r})"


def refused_message(messages):
    """": message N ..." naming the message a chat template that wants alternating roles (Llama-2's, Mistral's:
    "Conversation roles must alternate") most likely refuses, and how to mend it; else "". It named none: the record's
    first message was said, and which of its turns broke the alternation was left to find. Two tool results in a row
    (parallel calls') are not said to be joined: a template that takes them is wanted."""
    for index, (before, message) in enumerate(zip(messages, messages[1:]), start=1):
        if message["role"] == before["role"] and message["role"] in TOOL_ROLES:  # (not to be joined: two results)
            return (f": message {index} is a second tool result in a row (the results of parallel tool calls), which "
                    "the template does not take; use a chat template that does (Qwen2.5's), or give each call a turn "
                    "of its own, its result after it")
        if message["role"] == before["role"]:
            return (f": message {index} is a second {message['role']!r} message in a row (the template wants user and "
                    "assistant turns to alternate); join the two into one message")
    for index, message in enumerate(messages[1:], start=1):
        if message["role"] == "system":
            return (f": message {index} is a system message after the conversation began; put it first, or into the "
                    "user message after it")
    return ""


UNDESIRABLE = "undesirable answer (label false: TRL's unpaired preference data)"


def extract_example(raw, sample, train_phase, multiturn=False, read_margins=True):
    """Only the accessors a phase needs are called, so e.g. a tie only matters in phase 2. ``multiturn``: phase 1
    trains a conversation ending with a user turn up to its last answer; ``read_margins``: phase 2 reads the pair's
    margin (step 2's; not DPO's, which a bad margin must not stop)."""
    example = _extract_example(raw, sample, train_phase, multiturn, read_margins)
    example.tools = raw.get_tools(sample)
    return example


def _columns_beside_answers(columns, answers):
    """A step-3 record's reward columns beside its reference ``answers``: a column named as an answer (its field renamed
    by --data_fields) comes as extra_<name>, and one the record also has under that name is an error, not lost."""
    for name in answers:
        if name in columns and extra_name(name) in columns:
            raise RecordError(extra_name(name), f"the record has both a column {extra_name(name)!r} and a column "
                                                f"{name!r}, which comes to the prompt batches (and --reward_fn) as "
                                                f"{extra_name(name)!r} beside its reference answer: rename one of them")
    return {extra_name(k) if k in answers else k: v for k, v in columns.items()}


def _extract_example(raw, sample, train_phase, multiturn, read_margins):
    messages = raw.get_conversation(sample)
    if train_phase == 3:
        answers = raw.get_reference_answers(sample)  # a data column of the same name (fields renamed) stays extra_
        return Example(messages, extra={**_columns_beside_answers(raw.get_reward_columns(sample), answers), **answers})
    if raw.is_undesirable(sample):
        raise SkipRecord(UNDESIRABLE)
    untrained = raw.get_untrained_turns(sample) if multiturn else frozenset()
    try:
        chosen = raw.get_chosen_text(sample)
    except (EndsWithUser, UntrainedAnswer) as skip:  # (a last turn of weight 0: trained up to the one before)
        if not multiturn:
            raise
        return Example(*answered_turns(skip, untrained), unanswered=isinstance(skip, EndsWithUser),
                       untrained=untrained)
    if chosen is None:
        raise SkipRecord("no chosen answer")
    if train_phase == 1:
        return Example(messages, chosen, untrained=untrained)
    rejected = raw.get_rejected_text(sample)
    if rejected is None:
        raise SkipRecord("no rejected answer")
    if rejected == chosen:
        raise SkipRecord("chosen==rejected")
    return Example(messages, chosen, rejected, margin=raw.get_margin(sample) if read_margins else None)


def tokenize_examples(examples, tokenizer, settings):
    """Per example a dict of token id lists: prompt, eot, and chosen/rejected answers where present.

    The prompt is tokenized alone (step 3 generates from exactly these ids) and the label boundary is its
    length. A chat template already writes its BOS text, so special tokens are added to the prompt only
    without a template. The EOT ids are appended, not tokenized with the text, so they are always the
    EOT token itself.
    """
    prompt_texts = [example.prompt_text or format_prompt(example.messages, tokenizer, example.tools)
                    for example in examples]
    add_special = not uses_chat_template(tokenizer)
    multiturn = settings.multiturn and settings.train_phase == 1
    if multiturn:  # the prompt's token offsets come with its ids: each earlier assistant turn's tokens are found there
        check_offsets_available(tokenizer)
        prompts, offsets = tokenize_texts(tokenizer, prompt_texts, add_special, with_offsets=True)
    else:
        prompts = tokenize_texts(tokenizer, prompt_texts, add_special)
    columns = {"prompt_text": prompt_texts, "prompt": prompts}
    for side in ("chosen", "rejected"):
        texts = [getattr(example, side) for example in examples]
        if texts and all(text is not None for text in texts):
            answers = [format_answer(text, tokenizer, add_eot=False, eot_token=settings.eot_token,
                                     messages=example.messages, prompt=prompt, tools=example.tools)
                       for text, example, prompt in zip(texts, examples, prompt_texts)]
            joint = tokenize_texts(tokenizer, [p + a for p, a in zip(prompt_texts, answers)], add_special)
            columns[side] = [answer_ids_after_prompt(tokenizer, prompt, ids, answer)
                             for prompt, ids, answer in zip(prompts, joint, answers)]
    if multiturn:
        columns["earlier"] = earlier_answer_spans([example.messages for example in examples], prompt_texts, offsets,
                                                  tokenizer, settings.eot_token,
                                                  [example.untrained for example in examples],
                                                  [example.tools for example in examples])
    eot = tokenizer(settings.eot_token, add_special_tokens=False)["input_ids"]
    if not eot:
        raise UsageError(f"the end-of-conversation token {settings.eot_token!r} tokenizes to nothing")
    return [dict({name: values[i] for name, values in columns.items()}, eot=eot) for i in range(len(examples))]


def answer_ids_after_prompt(tokenizer, prompt_ids, joint_ids, answer_text):
    """The answer's ids as the tokenizer produces them right after the prompt.

    Tokenized alone, an answer can get tokens it never has in context (SentencePiece tokenizers such as
    Llama-2's turn the leading space of " Sure" into a lone "▁" at the start of a string), which would teach
    the model a token sequence it cannot produce at generation time. So the answer is cut from the joint
    tokenization; only when the tokenizer merged across the boundary (the prompt ids are not a prefix) is
    it tokenized alone, keeping the prompt ids exact.
    """
    if joint_ids[:len(prompt_ids)] == prompt_ids:
        return joint_ids[len(prompt_ids):]
    return tokenizer(answer_text, add_special_tokens=False)["input_ids"]


def tokenize_texts(tokenizer, texts, add_special_tokens, with_offsets=False):
    """Token ids of ``texts`` (``with_offsets``: and each token's (start, end) characters, (0, 0) for the added ones).
    ``add_special_tokens`` adds only the special tokens the tokenizer puts before a text (BOS): one that also appends
    EOS (``add_eos_token=True``) would end every prompt there, and the answer would follow an EOS."""
    prefix = leading_special_ids(tokenizer) if add_special_tokens else []
    # transformers' "Token indices sequence length is longer than the specified maximum" (once per tokenizer): the
    # steps cut and skip records by their own length flags, and the data report counts them
    if hasattr(tokenizer, "deprecation_warnings"):
        tokenizer.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
    ids, offsets = [], []
    for start in range(0, len(texts), TOKENIZE_BATCH):
        batch = tokenizer(texts[start:start + TOKENIZE_BATCH], add_special_tokens=False, return_attention_mask=False,
                          return_offsets_mapping=with_offsets)
        ids.extend(prefix + row for row in batch["input_ids"])
        if with_offsets:
            offsets.extend([(0, 0)] * len(prefix) + list(row) for row in batch["offset_mapping"])
    return (ids, offsets) if with_offsets else ids


def leading_special_ids(tokenizer):
    """The ids the tokenizer's post-processor puts before a text (e.g. [BOS]; [] for GPT-2), found around a probe
    text that has tokens of its own (with none, only a leading BOS can be told apart)."""
    for probe in ("a", "Hello world", "0", "."):
        plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
        if plain:
            full = tokenizer(probe, add_special_tokens=True)["input_ids"]
            for start in range(len(full) - len(plain) + 1):
                if full[start:start + len(plain)] == plain:
                    return full[:start]
            return []
    full = tokenizer("", add_special_tokens=True)["input_ids"]
    return full[:1] if full and full[0] == tokenizer.bos_token_id else []


def _check_prompt_limit(prompt, settings):
    if settings.prompt_limit is not None and len(prompt) > settings.prompt_limit:
        raise SkipRecord(f"prompt longer than {settings.prompt_limit} tokens")


def _no_answer_room(max_seq_len):
    return SkipRecord(f"prompt leaves no room for an answer in --max_seq_len {max_seq_len}")


def scored_sequence(prompt, answer, eot, max_seq_len):
    """(``prompt + answer[:room] + eot``, whether the answer was cut): step 2's sequence of one answer. A long answer is
    cut but its EOT kept, so the reward model reads the score where generated answers end too. ``SkipRecord`` when the
    prompt leaves no room for an answer."""
    room = max_seq_len - len(prompt) - len(eot)
    if room <= 0:
        raise _no_answer_room(max_seq_len)
    return prompt + answer[:room] + eot, len(answer) > room


def encode_sft(example, tokens, settings):
    prompt = tokens["prompt"]
    _check_prompt_limit(prompt, settings)
    limit = settings.max_seq_len
    spans, missed = tokens.get("earlier", ([], 0))
    spans = spans_within(spans, limit)
    # --multiturn: a conversation longer than max_seq_len keeps its turns within it (as TRL and OpenRLHF truncate)
    if len(prompt) >= limit and not spans:
        raise _no_answer_room(limit)
    full = prompt + tokens["chosen"] + tokens["eot"]
    input_ids = full[:limit]
    if len(input_ids) <= len(prompt) and not spans:
        raise SkipRecord("answer empty after truncation")
    # ("cut", "turns_missed", "last_turn_cut": counted for the report, not stored)
    return {"input_ids": input_ids, "label_start": 0 if settings.include_prompt_in_loss else len(prompt),
            "label_spans": spans, "cut": len(full) > limit and len(input_ids) > len(prompt), "turns_missed": missed,
            "last_turn_cut": len(input_ids) <= len(prompt)}


def spans_within(spans, limit):
    """Flattened [start, end) token spans cut at ``limit`` tokens: a span past it goes, one across it ends there."""
    kept = []
    for start, end in zip(spans[::2], spans[1::2]):
        if start < limit:
            kept += [start, min(end, limit)]
    return kept


def encode_pair(example, tokens, settings):
    prompt, eot = tokens["prompt"], tokens["eot"]
    _check_prompt_limit(prompt, settings)
    chosen, chosen_cut = scored_sequence(prompt, tokens["chosen"], eot, settings.max_seq_len)
    rejected, rejected_cut = scored_sequence(prompt, tokens["rejected"], eot, settings.max_seq_len)
    if chosen == rejected:
        raise SkipRecord("chosen==rejected after truncation")
    # the EOT after a cut answer stays for the reward model; DPO leaves it out of the answer (collators.py)
    return {"chosen_input_ids": chosen, "rejected_input_ids": rejected, "prompt_length": len(prompt),
            "chosen_truncated": chosen_cut, "rejected_truncated": rejected_cut, "eot_length": len(eot),
            "margin": example.margin or 0.0}


def encode_prompt(example, tokens, settings):
    _check_prompt_limit(tokens["prompt"], settings)
    return {"prompt_input_ids": tokens["prompt"], "prompt_text": tokens["prompt_text"],
            "messages_json": json.dumps(example.messages, ensure_ascii=False),
            "extra_json": json.dumps(example.extra or {}, ensure_ascii=False, default=str)}


# --- reporting ---

def format_skip_line(entry):
    """ "SOURCE train: skipped 3 of 500 records: 2 chosen==rejected, 1 prompt longer than 256 tokens", and when the
    phase's share is not the whole source, how much of it: " (this phase's share by --data_split 2,4,4: 500 of the
    source's 1250 records)"; and how many kept records had an answer cut: "; 4 kept with an answer cut at
    --max_seq_len" """
    skipped = sum(entry["skipped"].values())
    where = f"{entry['source']} {entry['split']}"
    share = ""
    if entry.get("data_split") and entry.get("of", entry["total"]) != entry["total"]:
        share = (f" (this phase's share by --data_split {entry['data_split']}: {entry['total']} of the source's "
                 f"{counted(entry['of'], 'record')})")
    if not entry["total"]:
        return f"{where}: no records in this phase's share{share}"
    cut = f"; {entry['cut']} kept with an answer cut at --max_seq_len" if entry.get("cut") else ""
    if entry.get("turns"):
        trained, missed = entry["turns"]
        cut += f"; {trained} earlier assistant turn{'s' if trained != 1 else ''} trained (--multiturn)"
        if missed:
            cut += (f", {missed} left as prompt: the chat template renders {'them' if missed != 1 else 'it'} otherwise "
                    f"than a prompt ending at {'them' if missed != 1 else 'it'}")
    if entry.get("last_turn_cut"):
        count = entry["last_turn_cut"]
        cut += (f"; {count} conversation{'s' if count != 1 else ''} longer than --max_seq_len trained on "
                f"{'their' if count != 1 else 'its'} earlier assistant turns within it (--multiturn)")
    if entry.get("unanswered"):
        count = entry["unanswered"]
        cut += (f"; {count} conversation{'s' if count != 1 else ''} ending with a user turn trained up to "
                f"{'their' if count != 1 else 'its'} last answer (--multiturn)")
    if entry.get("duplicates"):
        count, elsewhere = entry["duplicates"]
        again = "evaluated again" if entry["split"] == "eval" else "trained again"  # (no eval record trains)
        cut += (f"; {count} kept {'is an exact copy' if count == 1 else 'are exact copies'} of "
                f"{'an earlier record' if count == 1 else 'earlier records'}"
                + (f" ({elsewhere} of another source's)" if elsewhere else "") + f": {again}")
    if entry.get("in_train"):
        count = entry["in_train"]
        cut += (f"; {count} {'is an exact copy of a train record' if count == 1 else 'are exact copies of train records'}"
                ": the held-out numbers are partly on trained data")
    if entry.get("margin"):
        count = entry["margin"]
        cut += (f"; {count} with a margin, which step 2's loss subtracts: -logsigmoid(chosen - rejected - margin), "
                "as TRL's RewardTrainer's (DPO does not read it)")
    if entry.get("margin_unread"):
        count = entry["margin_unread"]
        cut += (f"; {count} with a margin, which is not read: DPO's loss has none (step 2's reward model loss "
                "subtracts it)")
    if entry.get("formatted"):
        count, token = entry["formatted"]
        cut += (f"; {count} with the tokenizer's special token {token!r} in their text: already formatted, they are "
                "formatted again (give plain text or messages)")
    if not skipped:
        kept = "the 1 record" if entry["total"] == 1 else f"all {entry['total']} records"
        return f"{where}: kept {kept}{share}{cut}"
    reasons = ", ".join(f"{count} {reason}" for reason, count in
                        sorted(entry["skipped"].items(), key=lambda item: (-item[1], item[0])))
    return f"{where}: skipped {skipped} of {counted(entry['total'], 'record')}{share}: {reasons}{cut}"


def _print_skip_report(local_rank, *datasets):
    for dataset in datasets:
        print_skip_lines(local_rank, dataset.train_phase, dataset.skip_report)


def print_skip_lines(local_rank, train_phase, entries):
    """Each report entry's ``format_skip_line``, on rank 0 (also step 3's unsupervised data's)."""
    from dschat.utils.dist import is_rank_0

    if local_rank > 0 or not is_rank_0():
        return
    for entry in entries:
        print(f"[dschat.data] phase {train_phase} {format_skip_line(entry)}", flush=True)
