"""Adapters for hub datasets, and ``get_raw_dataset``: exact-name dispatch to an adapter or a local source.

Dispatch (first match wins):

1. an exact hub name in ``HUB_DATASETS`` (``"Dahoas/rm-static"``; no substring or prefix matching, so a
   typo is an error rather than a silently different dataset). If a folder exists at that relative path it
   is read as the dataset's copy (DeepSpeed-Chat's offline convention: a ``save_to_disk`` folder, or a download
   of its hub repository; ``PromptRawDataset.local_copy``), else ``load_dataset(name)``;
2. ``"tiny"``: the small dataset shipped in ``dschat/tiny/data/{train,eval}.jsonl``;
3. a local source: ``jsonl:PATH``, ``json:PATH``, ``parquet:PATH``, ``csv:PATH``, ``disk:PATH`` or a bare
   existing path (see ``dschat.data.sources`` for the forms).

Anything else raises ``ValueError`` listing the known names.

The hub schemas (columns, splits) follow the datasets' cards and DeepSpeed-Chat's ``raw_datasets.py``.
Datasets without an eval split get a seeded 90/10 train/eval split. Hub records that cannot be read
(an empty answer, a transcript without a final Human turn) are skipped and counted, not fatal: one bad row
out of 160k should not stop a run, and the count is printed.
"""
import contextlib
import os
import re

from dschat.errors import UsageError
from dschat.utils.files import path_under

from .base import PromptRawDataset, answer_from_transcript, conversation_from_transcript, required_text
from .errors import RecordError, SkipRecord
from .formatting import ASSISTANT_PREFIX

TINY_NAME = "tiny"


class _PromptChosenRejectedTranscripts(PromptRawDataset):
    """``prompt`` is a "\\n\\nHuman: ...\\n\\nAssistant:" transcript; ``chosen``/``rejected`` are " answer".

    The DeepSpeed-Chat string methods return the columns verbatim, exactly as DeepSpeed-Chat does.
    """
    eval_split = "test"
    used_columns = ("prompt", "response", "chosen", "rejected")

    def get_train_data(self):
        return self.raw_datasets["train"]

    def get_eval_data(self):
        return self.own_eval_data()

    def get_conversation(self, sample):
        return conversation_from_transcript(required_text(sample, "prompt"), "prompt")

    def get_chosen_text(self, sample):
        return required_text(sample, "chosen")

    def get_rejected_text(self, sample):
        return required_text(sample, "rejected")

    def get_prompt(self, sample):
        return sample["prompt"]

    def get_chosen(self, sample):
        return sample["chosen"]

    def get_rejected(self, sample):
        return sample["rejected"]

    def get_prompt_and_chosen(self, sample):
        return sample["prompt"] + sample["chosen"]

    def get_prompt_and_rejected(self, sample):
        return sample["prompt"] + sample["rejected"]


class DahoasRmstaticDataset(_PromptChosenRejectedTranscripts):
    """Columns prompt, response, chosen, rejected; splits train, test."""
    dataset_name = "Dahoas/rm-static"
    dataset_name_clean = "Dahoas_rm_static"


class DahoasFullhhrlhfDataset(_PromptChosenRejectedTranscripts):
    """Columns prompt, response, chosen, rejected; splits train, test."""
    dataset_name = "Dahoas/full-hh-rlhf"
    dataset_name_clean = "Dahoas_full_hh_rlhf"


class DahoasSyntheticinstructgptjpairwiseDataset(PromptRawDataset):
    """Columns prompt (a plain instruction), chosen, rejected; split train only (seeded 90/10 eval)."""
    dataset_name = "Dahoas/synthetic-instruct-gptj-pairwise"
    dataset_name_clean = "Dahoas_synthetic_instruct_gptj_pairwise"
    used_columns = ("prompt", "chosen", "rejected")

    def get_train_data(self):
        return self.seeded_train_eval_part(self.raw_datasets["train"], 0)

    def get_eval_data(self):
        return self.seeded_train_eval_part(self.raw_datasets["train"], 1)

    def get_conversation(self, sample):
        return [{"role": "user", "content": required_text(sample, "prompt")}]

    def get_chosen_text(self, sample):
        return required_text(sample, "chosen")

    def get_rejected_text(self, sample):
        return required_text(sample, "rejected")


class YitingxieRlhfrewarddatasetsDataset(PromptRawDataset):
    """Columns prompt (a Human/Assistant transcript without the final "Assistant:"), chosen and rejected
    ("Assistant: answer"); splits train, test."""
    dataset_name = "yitingxie/rlhf-reward-datasets"
    dataset_name_clean = "yitingxie_rlhf_reward_datasets"
    eval_split = "test"
    used_columns = ("prompt", "chosen", "rejected")

    def get_train_data(self):
        return self.raw_datasets["train"]

    def get_eval_data(self):
        return self.own_eval_data()

    def get_conversation(self, sample):
        return conversation_from_transcript(required_text(sample, "prompt"), "prompt")

    def get_chosen_text(self, sample):
        return _after_last_assistant_marker(sample, "chosen")

    def get_rejected_text(self, sample):
        return _after_last_assistant_marker(sample, "rejected")

    # DeepSpeed-Chat's strings, verbatim
    def get_prompt(self, sample):
        return sample["prompt"] + "Assistant:"

    def get_chosen(self, sample):
        return sample["chosen"].split("Assistant:")[-1]

    def get_rejected(self, sample):
        return sample["rejected"].split("Assistant:")[-1]

    def get_prompt_and_chosen(self, sample):
        return sample["prompt"] + sample["chosen"]

    def get_prompt_and_rejected(self, sample):
        return sample["prompt"] + sample["rejected"]


def _after_last_assistant_marker(sample, field):
    text = required_text(sample, field).split("Assistant:")[-1].strip()
    if not text:
        raise RecordError(field, "empty text after 'Assistant:'")
    return text


class OpenaiWebgptcomparisonsDataset(PromptRawDataset):
    """Columns question {id, full_text, dataset}, answer_0/1, score_0/1, quotes_0/1, tokens_0/1; split
    train only (seeded 90/10 eval). The higher-scored answer is chosen."""
    dataset_name = "openai/webgpt_comparisons"
    dataset_name_clean = "openai_webgpt_comparisons"
    used_columns = ("question", "quotes_0", "answer_0", "tokens_0", "score_0",
                    "quotes_1", "answer_1", "tokens_1", "score_1")

    def get_train_data(self):
        return self.seeded_train_eval_part(self.raw_datasets["train"], 0)

    def get_eval_data(self):
        return self.seeded_train_eval_part(self.raw_datasets["train"], 1)

    def get_conversation(self, sample):
        question = sample.get("question") or {}
        return [{"role": "user", "content": required_text(question, "full_text")}]

    def get_chosen_text(self, sample):
        # DeepSpeed-Chat's rule: answer_0 wins ties, so SFT (which needs no preference) keeps tied pairs
        better = "answer_0" if float(sample["score_0"]) >= float(sample["score_1"]) else "answer_1"
        return _without_citations(sample, better)

    def get_rejected_text(self, sample):
        # A tie carries no preference; DeepSpeed-Chat trained the reward model on it anyway (as answer_0 >
        # answer_1), which is label noise, so step 2 skips ties and counts them.
        if float(sample["score_0"]) == float(sample["score_1"]):
            raise SkipRecord("tied preference scores")
        worse = "answer_0" if float(sample["score_0"]) < float(sample["score_1"]) else "answer_1"
        return _without_citations(sample, worse)


def _without_citations(sample, field):
    """WebGPT answers cite browsing results as "[1]" / "(2)"; without browsing they only confuse the model."""
    text = required_text(sample, field)
    text = re.sub(r" [\(\[].*?[\)\]]", "", text)
    text = re.sub(r"[\(\[].*?[\)\]]", "", text).strip()
    if not text:
        raise RecordError(field, "empty text after removing citations")
    return text


class StanfordnlpSHPDataset(PromptRawDataset):
    """Columns history (the post), human_ref_A/B (comments), labels (1: A preferred), plus metadata
    (post_id, domain, upvote_ratio, score_A/B, ...) passed through as extras; splits train, validation,
    test."""
    dataset_name = "stanfordnlp/SHP"
    dataset_name_clean = "stanfordnlp_SHP"
    eval_split = "validation"
    used_columns = ("history", "human_ref_A", "human_ref_B", "labels")

    def get_train_data(self):
        return self.raw_datasets["train"]

    def get_eval_data(self):
        return self.own_eval_data()

    def get_conversation(self, sample):
        return [{"role": "user", "content": required_text(sample, "history")}]

    def get_chosen_text(self, sample):
        return required_text(sample, "human_ref_A" if int(sample["labels"]) == 1 else "human_ref_B")

    def get_rejected_text(self, sample):
        return required_text(sample, "human_ref_B" if int(sample["labels"]) == 1 else "human_ref_A")


class AnthropicHhrlhfDataset(PromptRawDataset):
    """Columns chosen and rejected, each a full "\\n\\nHuman: ...\\n\\nAssistant: ..." transcript whose last
    Assistant turn is the answer (the turns before it are the shared prompt); splits train, test."""
    dataset_name = "Anthropic/hh-rlhf"
    dataset_name_clean = "Anthropic_hh_rlhf"
    eval_split = "test"
    used_columns = ("chosen", "rejected")

    def get_train_data(self):
        return self.raw_datasets["train"]

    def get_eval_data(self):
        return self.own_eval_data()

    def get_conversation(self, sample):
        return answer_from_transcript(required_text(sample, "chosen"), "chosen")[0]

    def get_chosen_text(self, sample):
        return answer_from_transcript(required_text(sample, "chosen"), "chosen")[1]

    def get_rejected_text(self, sample):
        return answer_from_transcript(required_text(sample, "rejected"), "rejected")[1]

    # DeepSpeed-Chat-style strings cut from the transcript at its last "\n\nAssistant:"
    def get_prompt(self, sample):
        return _split_at_last_assistant(sample["chosen"])[0]

    def get_chosen(self, sample):
        return _split_at_last_assistant(sample["chosen"])[1]

    def get_rejected(self, sample):
        return _split_at_last_assistant(sample["rejected"])[1]


def _split_at_last_assistant(transcript):
    cut = transcript.rfind(ASSISTANT_PREFIX) + len(ASSISTANT_PREFIX)
    return transcript[:cut], transcript[cut:]


HUB_DATASETS = {cls.dataset_name: cls for cls in (
    DahoasRmstaticDataset,
    DahoasFullhhrlhfDataset,
    DahoasSyntheticinstructgptjpairwiseDataset,
    YitingxieRlhfrewarddatasetsDataset,
    OpenaiWebgptcomparisonsDataset,
    StanfordnlpSHPDataset,
    AnthropicHhrlhfDataset,
)}


def known_dataset_names():
    return sorted(HUB_DATASETS) + [TINY_NAME]


def unknown_dataset_error(dataset_name, flag="--data_path"):
    """A UsageError: a mistyped --data_path (``flag``) ends in "error: ..." and exit status 2, not a traceback. A name
    close to a known one is told it (Dahoas/rm-statik listed every name, the one meant among them), by its spelling
    alone: no hub is asked."""
    hint = close_dataset_names_hint(dataset_name)
    return UsageError(
        f"{f'{flag}: ' if flag else ''}unknown dataset {dataset_name!r}{hint}: not a known name and not an existing "
        f"local path. Known names (matched exactly): {', '.join(known_dataset_names())}. Local data: jsonl:PATH, "
        "json:PATH, parquet:PATH, csv:PATH, disk:PATH (a save_to_disk folder), or an existing "
        ".jsonl/.json/.parquet/.csv file or folder; 'TRAIN,EVAL' gives an explicit eval file.")


def close_dataset_names_hint(dataset_name):
    """" (did you mean NAME?)" for a name close to a known one (``known_dataset_names``), by its spelling alone (no hub
    is asked), else "": training's unknown name and the tools' data flags say it alike."""
    from dschat.args import close_names  # (the names an unknown flag may have meant: the same test)

    meant = close_names(dataset_name, known_dataset_names())
    return f" (did you mean {' or '.join(meant)}?)" if meant else ""


def resolve_dataset_spec(dataset_name, flag="--data_path"):
    """A hub adapter class, or a ``LocalSource`` for tiny/local specs; UsageError for anything else, naming ``flag``
    (the one that gave it)."""
    from .sources import LOCAL_JSONFILE, local_jsonfile_source, resolve_local_spec, tiny_source

    if dataset_name in HUB_DATASETS:
        return HUB_DATASETS[dataset_name]
    if dataset_name == TINY_NAME:
        return tiny_source()
    if dataset_name == LOCAL_JSONFILE:
        return local_jsonfile_source(flag)
    source = resolve_local_spec(dataset_name, flag)
    if source is None:
        raise unknown_dataset_error(dataset_name, flag)
    return source


def anchored_spec(spec, folder):
    """``spec`` as a run whose working directory was ``folder`` read it, for use from any other: its relative local
    paths made absolute where the files are still there (DeepSpeed-Chat's local/jsonfile becomes the two files it
    read). Names (tiny, hub datasets), and specs whose files are no longer under ``folder`` (a moved project, read
    from the current folder as typed), come back unchanged."""
    from .fields import LOCAL_TYPES
    from .sources import LOCAL_JSONFILE, _split_paths

    if spec in HUB_DATASETS or spec == TINY_NAME:
        return spec
    if spec == LOCAL_JSONFILE:
        kind, paths = "json", [os.path.join("data", f"{name}.json") for name in ("train", "eval")]
    else:
        kind, sep, rest = spec.partition(":")
        kind = kind.lower()
        if not (sep and kind in LOCAL_TYPES):
            kind, rest = None, spec
        paths = [part.strip() for part in rest.split(",")] if kind is None else _split_paths(rest, spec=spec)
    anchored = [path_under(folder, path) for path in paths]
    if None in anchored:
        return spec
    return (f"{kind}:" if kind else "") + ",".join(anchored)


def anchored_data_path(specs, folder):
    """A run's ``--data_path`` (one spec or a list, kept so) with each spec ``anchored_spec``'d to ``folder``."""
    if isinstance(specs, str):
        return anchored_spec(specs, folder)
    return [anchored_spec(spec, folder) for spec in specs]


def is_tiny_data(specs):
    """Whether a --data_path (one spec or a list) reads the embedded data alone: ``tiny``, or local specs whose files
    are its shipped files (``dschat/tiny/data``, or copies of them), e.g. ``jsonl:dschat/tiny/data/eval.jsonl``. The
    bundled rule scorer knows those prompts; it was used only for the name ``tiny``, so the same prompts given by
    their path had no rule score."""
    specs = [specs] if isinstance(specs, str) else list(specs or [])
    return bool(specs) and all(_is_tiny_spec(spec) for spec in specs)


def _is_tiny_spec(spec):
    from .sources import LOCAL_JSONFILE, resolve_local_spec

    if spec == TINY_NAME:
        return True
    if spec in HUB_DATASETS or spec == LOCAL_JSONFILE:
        return False
    try:
        source = resolve_local_spec(spec)
    except UsageError:  # (a missing or malformed spec is its loader's error to say, not this question's)
        return False
    return source is not None and all(_is_tiny_file(path) for path in source.train_files + source.eval_files)


def _is_tiny_file(path):
    import filecmp

    from dschat.tiny import EVAL_FILE, TRAIN_FILE

    return os.path.isfile(path) and any(filecmp.cmp(path, shipped, shallow=False)
                                        for shipped in (TRAIN_FILE, EVAL_FILE))


def reads_the_hub(spec):
    """Whether the data spec ``spec`` is a hub dataset read from the hub (not ``is_local_hub_copy``)."""
    return spec in HUB_DATASETS and not os.path.isdir(spec)


def is_local_hub_copy(spec):
    """Whether ``spec`` is a hub dataset's name that a folder here holds a copy of: saved with save_to_disk or
    downloaded (``PromptRawDataset.local_copy`` reads it, by the dataset's own reader, in training and the tools)."""
    return spec in HUB_DATASETS and os.path.isdir(spec)


def check_data_paths(data_path, sft_only_data_path=()):
    """Every spec names a known dataset or a local file or folder that is there: checked before any model loads (and
    by train.py before step 1 runs), not when the step reaches its data; an error names the flag that gave it. Loads
    nothing; a hub dataset's, with the hub unreachable, turns offline mode on
    (``read_hub_cache_only_if_unreachable``)."""
    for flag, specs in (("--data_path", data_path), ("--sft_only_data_path", sft_only_data_path)):
        for spec in ([specs] if isinstance(specs, str) else specs or []):
            resolve_dataset_spec(spec, flag)
            if reads_the_hub(spec):
                from dschat.models.loading import read_hub_cache_only_if_unreachable

                read_hub_cache_only_if_unreachable()


def get_raw_dataset(dataset_name, output_path, seed, local_rank, flag="--data_path", **field_options):
    """The adapter for ``dataset_name``. ``field_options`` (prompt=..., chosen=..., rejected=...,
    messages=...) rename the fields of local data; hub datasets have fixed schemas and ignore them. ``flag``: the one
    that gave it (step 1's --sft_only_data_path), named where it cannot be read. Inside a ``reads_kept`` block, files
    read before (unchanged since) are not read again."""
    from .digests import files_stamp
    from .local import LocalDataset

    resolved = resolve_dataset_spec(dataset_name, flag)
    if isinstance(resolved, type):
        return _hub_dataset_reader(resolved, dataset_name, output_path, seed, local_rank, flag)
    # (a local reader's load depends on its files, however spelled, their types and field names; its seed, output path
    # and rank hold its eval share's indices)
    return read_once(LOCAL_FILES, lambda: (resolved.kind, resolved.eval_type, len(resolved.train_files), output_path,
                                           seed, local_rank, repr(sorted(field_options.items())),
                                           files_stamp(resolved.files)),
                     lambda: LocalDataset(resolved, output_path, seed, local_rank, field_options)).spelled_as(resolved)


def _hub_dataset_reader(reader_class, name, output_path, seed, local_rank, flag):
    """The hub dataset ``name``'s reader (``reader_class``), made once: a reader built to load the data was built again
    around what it had loaded. Inside a ``reads_kept`` block of its kind (a local copy's, or the caches' offline) the
    data of an earlier call is taken, in a reader made with this caller's seed, output path and flag."""
    from .digests import files_stamp

    def reader(raw_datasets=None):
        return reader_class(output_path, seed, local_rank, flag=flag, raw_datasets=raw_datasets)

    if is_local_hub_copy(name):
        kind, key = HUB_COPIES, lambda: (name, files_stamp([name]))
    else:
        kind, key = HUB_CACHES, lambda: hub_caches_stamp(name)
    loaded_by = []  # (the reader that loads the data in this call, if it does: the one returned)

    def load():
        loaded_by.append(reader())
        return loaded_by[0].raw_datasets

    raw_datasets = read_once(kind, key, load)
    return loaded_by[0] if loaded_by else reader(raw_datasets)


def hub_caches_stamp(name):
    """What a load of the hub dataset ``name`` reads while the hub is not asked (offline, or out of reach): the files
    of its folders in datasets' cache and in the hub cache (a download of it), stamped (``files_stamp``): another
    stamp where a revision was added since. None with the hub at hand: a load may fetch another revision."""
    from huggingface_hub import constants

    from dschat.models.loading import hub_unavailable
    from .digests import files_stamp

    if not hub_unavailable():
        return None
    hub_download = os.path.join(constants.HF_HUB_CACHE, f"datasets--{name.replace('/', '--')}")
    folders = (datasets_cache_folder(name), hub_download)
    return name, folders, files_stamp(folders)


def datasets_cache_folder(name):
    """The folder of datasets' cache that holds the hub dataset ``name``'s Arrow files, as datasets names it (its
    offline load's ``CachedDatasetModuleFactory``): ORG___NAME, the name's last part snake-cased (stanfordnlp/SHP's:
    stanfordnlp___shp)."""
    import datasets
    from datasets.naming import camelcase_to_snakecase

    *namespace, dataset = name.split("/")
    return os.path.join(datasets.config.HF_DATASETS_CACHE, "___".join([*namespace, camelcase_to_snakecase(dataset)]))


# What a ``reads_kept`` block may keep: local data's readers; the data of a local copy under a hub name; that of a
# hub dataset read offline from the caches.
LOCAL_FILES, HUB_COPIES, HUB_CACHES = "local files", "local copies of hub datasets", "hub datasets read offline"
_KEPT = {}  # {kind: {key: what was read}} of the kinds the open ``reads_kept`` blocks keep


@contextlib.contextmanager
def reads_kept(*kinds):
    """Inside it, ``get_raw_dataset`` reads the files of each of ``kinds`` once: a later reader of the same files,
    unchanged, gets what the first read (train.py's pre-flight checks each step's data; the steps it runs in-process
    read the local copies of hub datasets it loaded, and the hub datasets it loaded offline from the caches). What was
    read is let go when the block that opened its kind ends."""
    opened = [kind for kind in kinds if kind not in _KEPT]  # (an inner block keeps what an outer one keeps)
    _KEPT.update({kind: {} for kind in opened})
    try:
        yield
    finally:
        for kind in opened:
            del _KEPT[kind]


def read_once(kind, key, read):
    """``read()``, or what it gave earlier for the same ``key()`` where a ``reads_kept`` block keeps ``kind`` (a key
    of None: read again)."""
    kept = _KEPT.get(kind)
    key = key() if kept is not None else None
    if key is None:  # (no block keeps ``kind``, or a key of None: what ``read`` gives may differ now)
        return read()
    if key not in kept:
        kept[key] = read()
    return kept[key]


__all__ = ["PromptRawDataset", "HUB_DATASETS", "TINY_NAME", "check_data_paths", "get_raw_dataset",
           "resolve_dataset_spec", "known_dataset_names"] + [cls.__name__ for cls in HUB_DATASETS.values()]


def local_data_files(specs):
    """[[path, sha256 of its content], ...] of the local files ``specs`` read (hub datasets and the embedded data
    have none): kept with a step's output and its checkpoints, so that a resume notices data edited since (by
    content: a copy or checkout that only gives the files new times is the same data)."""
    files = []
    for spec in specs or ():
        if spec in HUB_DATASETS or spec == TINY_NAME:
            continue
        try:
            source = resolve_dataset_spec(spec)
            files += [[path, digest] for path, _, digest in
                      (source.fingerprint()["files"] if not isinstance(source, type) else [])]
        except (UsageError, OSError):  # a hub name; a file gone (the step itself says so)
            continue
    return sorted(files)


def changed_data_files(saved, now, both_only=False):
    """The paths whose content differs between two ``local_data_files`` lists, or that only one has (``both_only``:
    not those)."""
    return changed_names(*({path: digest for path, digest, *_ in files} for files in (saved, now)), both_only)


def changed_names(saved, now, both_only=False):
    """The names whose value differs between two {name: value} records, or that only one has (``both_only``: not
    those): files whose content changed (``changed_data_files``); hub datasets whose data did
    (``PromptDataset.hub_data``)."""
    names = saved.keys() & now.keys() if both_only else saved.keys() | now.keys()
    return sorted(name for name in names if saved.get(name) != now.get(name))
