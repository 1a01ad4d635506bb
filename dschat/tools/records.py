"""Prompts (and answers) for the tools: from the command line, from a local file or a hub dataset dschat knows, or the
tiny held-out data."""
import os
import re
from dataclasses import dataclass
from itertools import islice

from dschat.args import DEFAULT_SEED
from dschat.data.base import read_or_none
from dschat.data.raw_datasets import HUB_DATASETS, TINY_NAME, close_dataset_names_hint
from dschat.errors import MissingInputError, UsageError, given_as
from dschat.report import counted
from dschat.tiny import EVAL_FILE


@dataclass
class Record:
    messages: list          # prompt turns, ending with the user's
    chosen: str | None = None
    rejected: str | None = None

    @property
    def user_message(self):
        """The last user turn: what the tiny rule scorer reads the instruction from."""
        return self.messages[-1]["content"]


def prompt_record(text, flag="--prompt"):
    """A command-line prompt, read as training data reads a prompt field: a "Human: ... Assistant: ... Human: ..."
    transcript, else one user message (a question about the words "Human:" and "Assistant:" is not split at them)."""
    from dschat.data.local import text_prompt_messages
    from dschat.tools.common import check_utf8

    check_utf8(text, flag)
    if not text.strip():  # (answered as an empty Human turn; chat.py's and rw_eval's --prompt refuse it too)
        raise UsageError(f"{flag}: a prompt is empty")
    try:
        return Record(text_prompt_messages(text.strip()))
    except ValueError as error:
        raise UsageError(f"{flag} {text!r}: {error}") from None


def check_local_data_there(spec, flag=None):
    """A tool's data ``spec`` whose path is meant as one here (``looks_local``: absolute, ./, ../, ~, deeper than
    ORG/NAME; a trailing /; a data file's extension) and is not there: "no such file or folder", naming ``flag``.
    Such a mistyped folder had the advice for a hub dataset's name (``no_local_data``), a file "data file not found"
    naming no flag. Typed specs (jsonl:PATH) and names (tiny, local/jsonfile, a hub dataset's) say their own."""
    from dschat.data.fields import LOCAL_TYPES
    from dschat.data.sources import LOCAL_JSONFILE, _split_paths, missing_data_path, names_a_data_file
    from dschat.models.loading import looks_local

    kind, typed, _ = spec.partition(":")
    if spec in (TINY_NAME, LOCAL_JSONFILE) or (typed and kind.lower() in LOCAL_TYPES):
        return
    for path in _split_paths(spec, flag):
        meant_here = looks_local(os.path.expanduser(path)) or path.endswith("/") or names_a_data_file(path)
        if meant_here and not os.path.exists(path):
            raise missing_data_path(spec, path, flag)


def no_local_data(path, flag=None):
    """The error for a tool's data (``flag``'s) that is no local file or folder nor a hub dataset dschat reads by name
    (``tool_raw_dataset``): "no data file at acme/pairs" named neither the flag nor why. The advice to download it is
    for a hub dataset's name alone (ORG/NAME): ``nope`` was told to download it too."""
    hint = close_dataset_names_hint(path)  # (at the end: the message begins with the flag and the path as given)
    if not looks_like_hub_dataset(path):
        return MissingInputError(f"{given_as(flag, path)}: no such file, folder or dataset (the tools read local "
                                 "data: a .jsonl/.json/.parquet/.csv file, a folder of them, TYPE:PATH, "
                                 f"local/jsonfile or tiny, or a hub dataset dschat knows by name){hint}")
    return MissingInputError(f"{given_as(flag, path)}: no local data file or folder there, nor a hub dataset dschat "
                             f"reads by name ({', '.join(sorted(HUB_DATASETS))}): give its download, hf download "
                             f"--repo-type dataset NAME --local-dir DIR{hint}")


# a hub dataset's name, ORG/NAME (letters, digits, '-', '_', '.'), as every one dschat reads (HUB_DATASETS) is
_HUB_DATASET_NAME = re.compile(r"[\w.-]+/[\w.-]+")


def looks_like_hub_dataset(name):
    return _HUB_DATASET_NAME.fullmatch(name) is not None


def local_data_source(spec, flag=None):
    """The ``LocalSource`` of a tool's data ``spec`` (``flag``'s): a local path, TYPE:PATH or ``local/jsonfile``. A
    name that reads no local data here (a hub dataset's dschat does not know, or one that names nothing) is
    ``no_local_data``, with
    --data_split as without it: ``load_phase_held_out`` said training's "unknown dataset ... Known names ...", naming
    no flag, where ``load_records`` said this."""
    from dschat.data.sources import LOCAL_JSONFILE, local_jsonfile_source, resolve_local_spec

    check_local_data_there(spec, flag)
    source = local_jsonfile_source(flag) if spec == LOCAL_JSONFILE else resolve_local_spec(spec, flag)
    if source is None:
        raise no_local_data(spec, flag)
    return source


def load_records(path, data_fields=None, limit=None, flag=None, seed=None):
    """The records of local data or a hub dataset's, read by the training data's own adapter (``tool_raw_dataset``):
    its eval part (``eval_records``), the first ``limit``; ``seed``: training's, which holds out the eval share of a
    hub dataset without an eval split (None: the steps' default --seed). Said on stdout.

    So data is accepted here exactly when training accepts it (prompt/chosen/rejected strings, message lists,
    transcripts, TRL's preference format, renamed fields). ``tiny`` is the embedded held-out data.
    """
    spec = str(EVAL_FILE) if str(path) == TINY_NAME else str(path)
    raw = tool_raw_dataset(spec, file_field_options(data_fields, path), DEFAULT_SEED if seed is None else seed, flag)
    held_out, part = eval_records(raw, spec, seed)
    samples = list(islice(held_out, limit))
    print(f"[dschat] {counted(len(samples), 'record')} of {path}{f' ({part})' if part else ''}")
    return [as_record(raw, sample) for sample in samples]


def eval_records(raw, spec, seed):
    """(the records the tools read of the raw dataset ``raw`` of ``spec``, that part in words, None for all of it): its
    own eval split (two files, a folder or save_to_disk copy with an eval split, DeepSpeed-Chat's ``local/jsonfile``, a
    hub dataset's test split, SHP's validation split); a hub dataset without one (``seed_holds_out``): the 10% of its
    train split that training's ``seed`` holds out (``get_eval_data``), as all of it held the pairs steps 1-3 trained
    on; else all of the local data."""
    own = raw.own_eval_data()
    if own is not None:
        return own, eval_part_said(raw)
    if seed_holds_out(spec):
        seed_said = f"the steps' default --seed {DEFAULT_SEED}" if seed is None else f"--seed {seed}"
        return raw.get_eval_data(), f"the 10% of its train split {seed_said} holds out, which no step trains on"
    return raw.raw_datasets["train"], None


def recorded_seed(run):
    """The --seed that a step's run record ``run`` (read_run_args', or None) holds, else None: the seed that chose the
    share it held out of data without an eval split (a seed of 0 too)."""
    seed = ((run or {}).get("flags") or {}).get("seed")
    return None if seed in (None, "") else seed


def seed_holds_out(spec):
    """Whether the tools' data ``spec`` is a hub dataset without an eval split (Dahoas/synthetic-instruct-gptj-pairwise,
    openai/webgpt_comparisons), whose eval share the training seed holds out of its train split."""
    reader = HUB_DATASETS.get(spec)
    return reader is not None and reader.eval_split is None


def tool_raw_dataset(spec, field_options, seed, flag=None):
    """The raw dataset of a tool's data ``spec`` (``flag``'s), read as training reads it: a hub dataset's name by that
    dataset's own reader, its columns and its eval split (else ``seed``'s held-out share), from where training reads
    it (``get_raw_dataset``: a local copy under its name, DeepSpeed-Chat's offline ``./Dahoas/rm-static``; else the
    datasets cache or the hub, and offline its download in the hub cache, which the tools did not read: "no local data
    file or folder there"); ``tiny`` as the embedded data; else local data (``local_data_source``)."""
    from dschat.data.local import LocalDataset
    from dschat.data.sources import tiny_source
    from dschat.data.raw_datasets import get_raw_dataset

    if spec in HUB_DATASETS:
        return get_raw_dataset(spec, None, seed, -1, flag=flag)
    source = tiny_source() if spec == TINY_NAME else local_data_source(spec, flag)
    return LocalDataset(source, output_path=None, seed=seed, local_rank=-1, field_options=field_options)


def eval_part_said(raw):
    """The data's own eval split as said: a local file's "eval part", a hub dataset's split by its name ("test",
    SHP's "validation")."""
    return "its eval part" if raw.eval_split == "eval" else f"its {raw.eval_split} split"


def file_field_options(data_fields, path):
    """--data_fields of the one data file ``path`` a tool reads: its own mapping where they give one per dataset (a
    dataset named there that is not this file is a UsageError), else the one mapping."""
    from dschat.data.fields import parse_data_fields

    fields = parse_data_fields(data_fields)
    fields.check_names([str(path)], "the file read here")
    return fields.for_spec(str(path))


def as_record(raw, sample):
    # (a conversation awaiting its answer has no chosen one)
    return Record(raw.get_conversation(sample), read_or_none(raw.get_chosen_text, sample),
                  raw.get_rejected_text(sample))


def load_phase_held_out(spec, data_fields, data_split, seed, phase, limit=None, flag=None):
    """The records step ``phase`` evaluated on (``pipeline.build_and_save``'s eval share): phase ``phase``'s share by
    ``data_split`` of the eval part of the data ``spec`` (``tiny`` too), its eval file, else the 10% of its file that
    ``seed`` holds out, which no step trains on; the first ``limit``. Said on stdout. ``load_records`` of a file
    without an eval file read the whole file, records the step trained on among them."""
    from dschat.data.splits import get_raw_dataset_split_index

    raw = tool_raw_dataset(spec, file_field_options(data_fields, spec), seed, flag)  # (as load_records reads it)
    held_out = raw.get_eval_data()
    share = held_out.select(get_raw_dataset_split_index(-1, None, raw.dataset_name_clean, seed, "eval", data_split,
                                                        phase - 1, len(held_out)))
    samples = list(islice(share, limit))
    eval_part = eval_part_said(raw) if raw.eval_split else f"the 10% --seed {seed} holds out"
    first = f" (the first of {len(share)})" if len(samples) < len(share) else ""
    print(f"[dschat] {counted(len(samples), 'record')} of {spec}{first}: step {phase}'s held-out pairs, phase "
          f"{phase}'s share by --data_split {data_split} of {eval_part}")
    return [as_record(raw, sample) for sample in samples]


def check_data_fields_read(parser, data_fields, file_flag, file_read):
    """--data_fields given where no file of ``file_flag`` is read (the embedded data, or prompts on the command line)
    is a flag error: it was ignored, unsaid, and the user saw other records than the ones whose fields they named."""
    if data_fields and not file_read:
        parser.error(f"--data_fields {data_fields}: it names the fields of {file_flag}, which is not read here: give "
                     f"{file_flag} with it")


def check_count_read(parser, argv, count_flag, texts_flag, texts_given):
    """A count of records (--num_prompts, --num_pairs) given with texts on the command line (``texts_given``: by
    --prompts, --prompt), which it does not count, is a flag error: every text given is read whatever the count, and
    the count was ignored, unsaid."""
    from dschat.tools.common import given_dests

    if texts_given and count_flag.removeprefix("--") in given_dests(parser, argv):
        parser.error(f"{count_flag} counts the records taken from a data file or the embedded data, not {texts_flag}, "
                     f"which are all read: leave {count_flag} out")


def tiny_held_out_records(limit=None):
    """The embedded data's held-out records (never trained on by any step)."""
    return load_records(TINY_NAME, limit=limit)


def is_tiny_held_out(path):
    """Whether a data file flag names the embedded data, which the bundled rule scorer reads the instructions of:
    ``tiny``, its held-out file, or its folder (read for its eval part) or files by any spec ``is_tiny_data`` takes."""
    from dschat.data.raw_datasets import is_tiny_data

    return is_tiny_data(str(path))
