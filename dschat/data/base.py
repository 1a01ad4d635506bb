"""``PromptRawDataset``: the adapter interface every data source implements (DeepSpeed-Chat's, extended).

DeepSpeed-Chat adapters return pre-formatted strings (``get_prompt`` -> "\\n\\nHuman: ...\\n\\nAssistant:",
``get_chosen`` -> " ..."). dschat formats text itself (a chat template when the tokenizer has one), so
adapters also expose the structured content: ``get_conversation`` (prompt turns as role/content dicts,
ending with a user turn), ``get_chosen_text`` / ``get_rejected_text`` (bare answers, ``None`` when absent)
and ``get_reward_columns`` (the columns step 3 passes to reward functions, with ``get_reference_answers``: the
other columns, ``get_extra``, and the used ones a reward function may still read, ``reward_columns``). The string
methods are derived from the structured ones unless an adapter overrides them to reproduce DeepSpeed-Chat exactly.
"""
import json
import math
import os
import re

from dschat.errors import MissingInputError, excerpt, given_as
from .errors import DatasetFormatError, RecordError, SkipRecord
from .formatting import answer_message, parse_transcript, render_human_assistant, split_last_answer
from .splits import get_raw_dataset_split_index

VALID_ROLES = ("system", "user", "assistant", "tool", "ipython")
# A preference record's column TRL's RewardTrainer reads (Llama 2's margin loss): step 2 trains
# -logsigmoid(chosen - rejected - margin) on it (``get_margin``); --data_fields margin=NAME names another column
MARGIN_FIELD = "margin"
FLOAT32_MAX = 3.4028234663852886e38  # (the loss is computed in fp32: a larger margin would make it inf)
_NUMBER_TEXT = re.compile(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*")
# the roles of a tool's result (HF's "tool"; Llama-3.1's "ipython"): an answer may follow one, as it follows the user's
TOOL_ROLES = ("tool", "ipython")


def load_hub_dataset(name, flag, *args, **kwargs):
    """``datasets.load_dataset(name, ...)``; a hub that cannot be reached (offline) or lacks the dataset is an error
    in the user's input, named by its flag, instead of a traceback through datasets. The hub unreachable: read from
    datasets' cache alone (``read_hub_cache_only_if_unreachable``), not after each lookup's retries: said once it is
    read (the error of one that cannot be says why, once)."""
    from datasets import load_dataset

    from dschat.models.loading import hub_cache_only_said_after, hub_unavailable

    with hub_cache_only_said_after():
        try:
            return load_dataset(name, *args, **kwargs)
        except (ConnectionError, FileNotFoundError) as err:
            why = hub_unavailable()
            if why:  # (datasets says "Couldn't reach ... (OfflineModeIsEnabled)": the cache lacks it)
                raise MissingInputError(f"{flag} {name}: not in the datasets cache, and {why}; download it where the "
                                        "hub can be reached, or give a local file or a folder written by "
                                        "save_to_disk") from err
            raise MissingInputError(f"{flag} {name}: could not be loaded from the hub ({type(err).__name__}: {err}); "
                                    f"without the hub, give a local file or a folder written by save_to_disk") from err


def hub_cache_download(name, config_name=None):
    """The folder of the hub dataset ``name``'s download in the hub cache (``hub_cache_snapshot``; with
    ``config_name``, that config's folder in it, as Salesforce/wikitext's
    wikitext-2-raw-v1/train-00000-of-00002.parquet) where it holds split files dschat reads
    (``sources._hub_split_files``), else None. datasets reads only its own cache offline: such a download was "not in
    the datasets cache", while the folder's path read as local data."""
    from .sources import _hub_split_files

    folder = hub_cache_snapshot(name)
    if folder is None:
        return None
    folder = os.path.join(folder, config_name) if config_name else folder
    return folder if _hub_split_files(folder) else None


def hub_cache_snapshot(name):
    """The folder of the hub dataset ``name``'s download in the hub cache (``hf download --repo-type dataset NAME``
    without --local-dir: HF_HUB_CACHE/datasets--ORG--NAME/snapshots/COMMIT, its main revision), whatever it holds;
    None where there is none."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(name, repo_type="dataset", local_files_only=True)
    except LocalEntryNotFoundError:
        return None


def load_hub_dataset_else_download(name, flag, read_download, config_name=None, **kwargs):
    """``load_hub_dataset(name, flag, config_name, **kwargs)``; where datasets cannot load it (its cache lacks it, and
    the hub is out of reach), ``read_download(folder, copy)`` of its download in the hub cache (``hub_cache_download``;
    ``copy``: it as errors say it), said on stdout. A hub that answered, and failed, is its error to say. The prompt
    datasets' readers and step 3's --unsupervised_dataset_name read hub data so."""
    from dschat.models.loading import hub_cache_only_said_after, hub_unavailable

    # (offline mode turned on here, not in load_hub_dataset: its notice is said once either copy is read)
    with hub_cache_only_said_after():
        try:
            dataset = load_hub_dataset(name, flag, *([config_name] if config_name else []), **kwargs)
        except MissingInputError:
            snapshot = hub_unavailable() and hub_cache_download(name, config_name)
            if not snapshot:
                raise
            dataset = None
    if dataset is not None:
        return dataset
    from dschat.utils.dist import print_rank_0

    print_rank_0(f"[dschat.data] {given_as(flag, name)}: not in the datasets cache, read from its download in the hub "
                 f"cache, {snapshot}")
    return read_download(snapshot, f"the download in the hub cache ({snapshot})")


def splits_said(names):
    """A dataset's splits ``names`` as an error says them: "the split train", "the splits train, test"."""
    return f"the {'split' if len(names) == 1 else 'splits'} {', '.join(names)}"


def read_or_none(accessor, sample, errors=(SkipRecord,)):
    """``accessor(sample)``; None for a record it has nothing for (``errors``: e.g. a conversation awaiting its
    answer has no chosen one)."""
    try:
        return accessor(sample)
    except errors:
        return None


class PromptRawDataset:
    dataset_name = None        # the exact name get_raw_dataset dispatches on
    dataset_name_clean = None  # file-name-safe form, used for cached split indices
    used_columns = ()          # columns the accessors consume; the rest is get_extra()
    # used columns that step 3's reward functions still get (TRL passes them every dataset column): get_reward_columns
    reward_columns = ()
    strict = False             # True: a bad record is an error (local files); False: counted and skipped
    has_answers = True         # False: prompt-only data, usable in step 3 only
    margin_field = MARGIN_FIELD  # the column of a preference record's margin (``get_margin``)
    # the data's own eval split, which ``get_eval_data`` reads ("test"); None: it has none, and the seed holds out 10%
    eval_split = None

    def __init__(self, output_path, seed, local_rank, dataset_name=None, raw_datasets=None, flag="--data_path"):
        """``raw_datasets`` injects an already-loaded DatasetDict (tests, offline copies) instead of
        ``load_dataset(dataset_name)``; ``flag``: the one that gave the dataset, named where it cannot be loaded."""
        self.flag = flag
        self.output_path = output_path
        self.seed = seed
        self.local_rank = local_rank
        if dataset_name is not None:
            self.dataset_name = dataset_name
        self.raw_datasets = raw_datasets if raw_datasets is not None else self.load()

    def load(self):
        """The hub dataset; a folder at the path of its name is a local copy of it (``local_copy``). Where datasets
        cannot load it (its cache lacks it, and the hub is out of reach), its download in the hub cache is read as a
        copy too (``load_hub_dataset_else_download``)."""
        if os.path.isdir(self.dataset_name):
            return self.local_copy()
        return load_hub_dataset_else_download(self.dataset_name, self.flag, self.downloaded_copy)

    def splits_read(self):
        """The splits this reader reads: train, and its ``eval_split``."""
        return [name for name in ("train", self.eval_split) if name]

    def local_copy(self):
        """The folder at the path of the dataset's name (DeepSpeed-Chat's offline convention, ``./Dahoas/rm-static``):
        a ``save_to_disk`` copy, or a download of its hub repository (``hf download --repo-type dataset NAME
        --local-dir NAME``: ``downloaded_copy``). A download was given to load_from_disk, whose "neither a Dataset
        directory nor a DatasetDict directory" ended the step in a traceback, where its path as --data_path read."""
        from datasets import load_from_disk

        from .reading import _is_saved_dataset
        from .sources import _hub_split_files

        if _is_saved_dataset(self.dataset_name):
            saved = load_from_disk(self.dataset_name)
            self.check_copy_splits(list(saved) if hasattr(saved, "keys") else [], "the save_to_disk copy here",
                                   f"save the DatasetDict of its {' and '.join(self.splits_read())} splits, or give "
                                   "the data as disk:PATH to read it as local data")
            return saved
        if not _hub_split_files(self.dataset_name):
            raise DatasetFormatError(f"{given_as(self.flag, self.dataset_name)}: the folder here is neither a "
                                     "save_to_disk copy of the dataset nor a download of its hub repository "
                                     "(data/train-00000-of-00001.parquet and its other splits' files): save it there "
                                     f"with save_to_disk, or download it with {self.download_command()}")
        return self.downloaded_copy(self.dataset_name, "the download here")

    def downloaded_copy(self, folder, copy):
        """{split: Dataset} of the splits the reader reads of a download of the dataset's hub repository at ``folder``
        (``copy``: it as errors say it): data/train-00000-of-00001.parquet and its test file, each split read as a
        --data_path folder's are (``sources.hub_download_split``)."""
        from datasets import DatasetDict

        from .sources import _hub_split_files, check_download_splits, check_subsets_alike, hub_download_split

        downloaded = _hub_split_files(folder)
        self.check_copy_splits(list(downloaded), copy, f"download all its files ({self.download_command()}), or give "
                                                       "its files as TYPE:TRAIN_PATH,EVAL_PATH to read them as local "
                                                       "data")
        where = given_as(self.flag, self.dataset_name)
        check_subsets_alike(where, folder, downloaded, self.splits_read())
        check_download_splits(where, folder, downloaded, self.splits_read())
        return DatasetDict({name: hub_download_split(downloaded[name]) for name in self.splits_read()})

    def download_command(self):
        return f"hf download --repo-type dataset {self.dataset_name} --local-dir {self.dataset_name}"

    def check_copy_splits(self, splits, copy, remedy):
        """A local copy (``copy``: what and where it is) of the hub dataset must hold the splits its reader reads
        (``splits_read``): one without them was a KeyError ('test') traceback, in training and the tools alike.
        ``splits``: those it holds; ``remedy``: what to do, said after."""
        missing = [name for name in self.splits_read() if name not in splits]
        if missing:
            held = splits_said(splits) if splits else "one Dataset, no splits"
            raise DatasetFormatError(f"{given_as(self.flag, self.dataset_name)}: {copy} holds {held}, not "
                                     f"{' and '.join(missing)}, which {self.dataset_name}'s reader reads: {remedy}")

    def check_usable(self, train_phase):
        """Raise DatasetFormatError when this source cannot feed ``train_phase`` at all."""
        if train_phase in (1, 2) and not self.has_answers:
            raise DatasetFormatError(f"{self.dataset_name}: has prompts but no answers (no 'chosen' or 'completion' "
                                     f"field), so it can only be used in step 3, not step {train_phase} (an answer "
                                     f"field of another name: --data_fields chosen=NAME)")

    def get_train_data(self):
        raise NotImplementedError

    def get_eval_data(self):
        raise NotImplementedError

    def own_eval_data(self):
        """The data's own eval split (``eval_split``), else None (``get_eval_data`` is then the 10% the seed holds
        out of its train split)."""
        return None if self.eval_split is None else self.raw_datasets[self.eval_split]

    # --- structured accessors (what dschat's pipeline uses) ---
    def get_conversation(self, sample):
        raise NotImplementedError

    def get_chosen_text(self, sample):
        raise NotImplementedError

    def get_rejected_text(self, sample):
        return None

    def conversation_field(self, sample):
        """The field whose messages ``get_conversation`` reads (a chat template's refusal of them names it, and a
        message by its place there)."""
        return "messages"

    def get_tools(self, sample):
        """The record's tool schemas (a ``tools`` column: the chat template renders them), else None."""
        return None

    def get_untrained_turns(self, sample):
        """The positions of the conversation's assistant turns not to train (weight 0 in OpenAI's fine-tuning format):
        with step 1's ``--multiturn`` they stay prompt."""
        return frozenset()

    def is_undesirable(self, sample):
        """Whether the record's answer is marked as one not to imitate (TRL's unpaired preference data, KTO's
        ``label: false``): steps 1 and 2 skip it, counted; step 3 reads only its prompt."""
        return False

    def get_margin(self, sample):
        """The preference record's margin, a float, which step 2 subtracts from the score difference (TRL's
        RewardTrainer, from Llama 2: -logsigmoid(chosen - rejected - margin)); None where its data has no margin
        column. In data that has one, every record needs a margin (TRL's needs it too; 0 for none): a record without
        one (a misspelt key, a gap) or one that is no finite number is a RecordError, not a margin of 0."""
        if self.margin_field not in sample:
            return None
        return margin_value(sample[self.margin_field], self.margin_field)

    def get_extra(self, sample):
        return {key: value for key, value in sample.items() if key not in self.used_columns}

    def get_reward_columns(self, sample):
        """``get_extra``'s columns and the used ones of ``reward_columns`` (a system column, read into the prompt: a
        reward function taking ``system=`` got it before it was), as written: step 3 passes them to reward functions."""
        return {key: value for key, value in sample.items()
                if key not in self.used_columns or key in self.reward_columns}

    def locate(self, sample):
        """Where a record is, for a ``strict`` source's error about it (a local file's: its file and line)."""
        return self.dataset_name

    def get_reference_answers(self, sample):
        """A pair's answers as bare text, ``{"chosen": ..., "rejected": ...}`` (those the record has): step 3's
        reward functions get them as columns, as TRL passes a dataset's columns. A record whose answers do not read
        keeps its prompt, without them. An answer calling tools is its assistant message in a list (TRL's
        conversational completion): as text it was the empty string, its calls lost."""
        answers = {name: read_or_none(accessor, sample, (RecordError, SkipRecord))
                   for name, accessor in (("chosen", self.get_chosen_text), ("rejected", self.get_rejected_text))}
        return {name: [answer_message(text)] if getattr(text, "tool_calls", None) else text
                for name, text in answers.items() if text is not None}

    # --- DeepSpeed-Chat's string interface ---
    def get_prompt(self, sample):
        return render_human_assistant(self.get_conversation(sample))

    def get_chosen(self, sample):
        return _as_answer_string(self.get_chosen_text(sample))

    def get_rejected(self, sample):
        return _as_answer_string(self.get_rejected_text(sample))

    def get_prompt_and_chosen(self, sample):
        chosen = self.get_chosen(sample)
        return None if chosen is None else self.get_prompt(sample) + chosen

    def get_prompt_and_rejected(self, sample):
        rejected = self.get_rejected(sample)
        return None if rejected is None else self.get_prompt(sample) + rejected

    # --- helpers for adapters whose data has no eval split ---
    def seeded_train_eval_part(self, data, part):
        """Part 0 (90%) or 1 (10%) of a seeded split, as DeepSpeed-Chat does for train-only datasets."""
        index = get_raw_dataset_split_index(self.local_rank, self.output_path, self.dataset_name_clean,
                                            self.seed, "train_eval", "9,1", part, len(data))
        return data.select(index)

    def __repr__(self):
        return f"{type(self).__name__}({self.dataset_name!r})"


def margin_value(value, field=MARGIN_FIELD):
    """A record's margin as a float: a number, or a number's text (a CSV cell); a RecordError naming ``field`` for
    anything else (null, a bool, other text, NaN, an infinity or a number past fp32's range)."""
    if value is None:
        raise RecordError(field, "missing or null, where the data's other records have a margin: step 2 subtracts "
                                 "each record's margin in its loss (TRL's RewardTrainer needs one in every record); "
                                 "give it one (0 for no margin), or give the file no margin column")
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str) and _NUMBER_TEXT.fullmatch(value):
        number = float(value)
    why = ("is not a number" if number is None else "is not a finite number" if not math.isfinite(number) else
           "is past fp32's range, which the loss is computed in" if abs(number) > FLOAT32_MAX else None)
    if why:
        raise RecordError(field, f"{excerpt(value)} {why}: a preference record's margin is the number step 2 "
                                 "subtracts from the score difference, -logsigmoid(chosen - rejected - margin)")
    return number


def _as_answer_string(text):
    return None if text is None else " " + text


def trimmed(text):
    """``text`` without its surrounding whitespace, except the first line's indentation where the lines after it are
    indented at least as deep (a code block keeps its relative indentation); DeepSpeed-Chat's " answer" and prose
    whose first line alone is indented lose it."""
    lines = text.rstrip().split("\n")
    while not lines[0].strip():  # (the text is not blank: callers check)
        lines.pop(0)
    body = "\n".join(lines)
    first = _indent(lines[0])
    rest = [_indent(line) for line in lines[1:] if line.strip()]
    return body if first and rest and first <= min(rest) else body.lstrip()


def _indent(line):
    return len(line) - len(line.lstrip())


def required_text(sample, field):
    """The string in ``sample[field]``, ``trimmed``; RecordError if missing, not a string or empty."""
    value = sample.get(field)
    if value is None:
        raise RecordError(field, "missing or null")
    if not isinstance(value, str):
        raise RecordError(field, f"expected a string, got {type(value).__name__}")
    if not value.strip():
        raise RecordError(field, "empty text")
    return trimmed(value)


def optional_text(sample, field):
    """Like required_text, but a missing/null value is ``None`` (an empty string is still an error)."""
    if sample.get(field) is None:
        return None
    return required_text(sample, field)


def conversation_from_transcript(text, field):
    """Prompt turns from a "Human:/Assistant:" transcript that must end with a Human turn."""
    messages = parse_transcript(text)
    if not messages or messages[-1]["role"] != "user":
        raise RecordError(field, "the transcript must end with a non-empty 'Human:' turn")
    return messages


def answer_from_transcript(text, field):
    """The final Assistant turn of a full transcript, plus the turns before it."""
    prompt, answer = split_last_answer(parse_transcript(text))
    if answer is None:
        raise RecordError(field, "the transcript must end with a non-empty 'Assistant:' turn")
    if not prompt or prompt[-1]["role"] != "user":
        raise RecordError(field, "the transcript must have a 'Human:' turn before the final answer")
    return prompt, answer


# ShareGPT's speakers ({"from": "human", "value": ...}); LLaMA-Factory's tool turns: "function_call" (an assistant turn
# whose value is the call's JSON, ``sharegpt_calls``) and "observation" (the tool's result)
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant", "system": "system",
                  "function_call": "assistant", "observation": "tool"}
# other names of a role, each of one meaning: OpenAI's "developer" (its newer name of "system", for its o1 and later
# models; the chat templates of OpenAI-style models expect "system"), Gemma's and Gemini's "model" (the assistant) and
# OpenAI's older "function" (a function's result, with its "name": the "tool" role's, which templates render)
ROLE_ALIASES = {"developer": "system", "model": "assistant", "function": "tool"}


def canonical_role(role):
    return ROLE_ALIASES.get(role, role) if isinstance(role, str) else role  # (another type is its record's error)


def is_sharegpt_message(message):
    """Whether ``message`` is ShareGPT's {from, value} (a null role beside "from": a fixed schema's filler)."""
    return message.get("role") is None and "from" in message


def message_role(message):
    """The role ``message`` (a dict, as written) has: its ShareGPT speaker's (``SHAREGPT_ROLES``; an unknown one as
    written) or its role, by the role's canonical name (``ROLE_ALIASES``). Every reading of a message's role resolves
    it here, so an empty system message is told by the role its message is read with."""
    if is_sharegpt_message(message):
        speaker = message["from"]
        return canonical_role(SHAREGPT_ROLES.get(speaker, speaker) if isinstance(speaker, str) else speaker)
    return canonical_role(message.get("role"))


def message_text(message):
    """The text ``message`` holds as written: ShareGPT's "value", else its "content"."""
    return message.get("value" if is_sharegpt_message(message) else "content")


def checked_messages(value, field, keep_nulls=False):
    """A list of {role, content} dicts with known roles and non-empty string content (also read: ShareGPT's
    {from, value} messages and content given as parts, OpenAI's and HF's [{"type": "text", "text": ...}]). A system
    message without text is left out (``is_empty_system_message``). ``keep_nulls``: the nulls in the calls' functions are as written (a JSON file's, not Arrow's fillers:
    ``without_none_values``)."""
    if value is None:
        raise RecordError(field, "missing or null")
    if not isinstance(value, (list, tuple)) or not value:
        got = "an empty list" if isinstance(value, (list, tuple)) else type(value).__name__
        raise RecordError(field, f"expected a non-empty list of messages, got {got}")
    messages = []
    for position, message in enumerate(value):
        if not isinstance(message, dict):
            raise RecordError(field, f"message {position} is a {type(message).__name__}, not a dict")
        if is_empty_system_message(message):
            continue
        if is_sharegpt_message(message):
            message = from_sharegpt(message, field, position)
        role, content = message_role(message), message.get("content")
        if isinstance(content, (list, tuple)):
            content = _text_of_parts(content, field, position)
        if role not in VALID_ROLES:
            raise RecordError(field, f"message {position} has role {role!r}; expected one of {VALID_ROLES}")
        message = with_function_call_as_tool_calls(message, role, field, position)
        calls = tool_calls(message, role, field, position, keep_nulls or message.get("from") == "function_call")
        if content is not None and not isinstance(content, str):  # (a number is no text to train on either)
            raise RecordError(field, f"message {position}'s content is not text ({type(content).__name__})")
        if calls and not (content or "").strip():
            content = ""  # (a turn that only calls a tool)
        elif not isinstance(content, str) or not content.strip():
            raise RecordError(field, f"message {position} has no text content")
        message_weight(message, field, position)
        messages.append({"role": role, "content": trimmed(content) if content else content,
                         **({"tool_calls": calls} if calls else {}), **tool_result_keys(message, role)})
    return messages


def with_function_call_as_tool_calls(message, role, field, position):
    """An assistant message of OpenAI's older function calling, its ``function_call`` {"name", "arguments"}, as one
    calling that function in ``tool_calls`` (it was an error: "function_call ... is not read"); other messages as
    given. Both given, or a function_call that is no object or on another role, is the record's error."""
    call = message.get("function_call")
    if not call:  # (a null, a fixed schema's, is no call)
        return message
    if message.get("tool_calls"):
        raise RecordError(field, f"message {position} has both function_call and tool_calls; give its calls once, as "
                                 "tool_calls")
    if role != "assistant":
        raise RecordError(field, f"message {position} has function_call but role {role!r}; only an assistant turn "
                                 "calls functions")
    if not isinstance(call, dict):
        raise RecordError(field, f"message {position}'s function_call is a {type(call).__name__}, not an object "
                                 "{\"name\": ..., \"arguments\": ...}")
    return {**message, "tool_calls": [{"type": "function", "function": call}]}


def is_empty_system_message(message):
    """Whether ``message`` (a dict, as written) is a system message without text ("", spaces, null or no parts):
    SlimOrca's and LLaMA-Factory's records write "" where there is no system prompt, and one such record made the whole
    file an error ("message 0 has no text content"). It is no system message, as LLaMA-Factory reads it (the template's
    default system prompt, if it has one, is written instead)."""
    content = message_text(message)
    if message_role(message) != "system" or message.get("tool_calls"):
        return False
    return content is None or (isinstance(content, str) and not content.strip()) or \
        (isinstance(content, (list, tuple)) and not content)


def from_sharegpt(message, field, position):
    """A ShareGPT message ({from, value}) as an OpenAI one ({role, content}); LLaMA-Factory's "function_call" turn as
    an assistant turn with its ``tool_calls`` (its value was read as a role no one knew)."""
    speaker = message["from"]
    if speaker != "function_call":
        return {**message, "role": message_role(message), "content": message_text(message)}
    return {"from": speaker, "role": "assistant", "content": "",  # (its JSON text: its nulls are as written)
            "tool_calls": sharegpt_calls(message.get("value"), field, position)}


def sharegpt_calls(value, field, position):
    """The ``tool_calls`` of a "function_call" turn, whose value is the JSON text of a call {"name": ..., "arguments":
    ...} or of a list of them (parallel calls), as LLaMA-Factory writes it."""
    try:
        calls = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as err:
        calls, error = None, f" ({err})"
    else:
        error = ""
    calls = [calls] if isinstance(calls, dict) else calls
    if not isinstance(calls, list) or not calls or not all(isinstance(call, dict) for call in calls):
        raise RecordError(field, f"message {position} (from 'function_call') is not the JSON text of a call "
                                 f"{{\"name\": ..., \"arguments\": {{...}}}} or a list of them{error}")
    return [{"type": "function", "function": call} for call in calls]


def tool_calls(message, role, field, position, keep_nulls=False):
    """An assistant message's ``tool_calls`` (OpenAI's and HF's: [{"type": "function", "function": {"name",
    "arguments"}}], an "id" kept), else None (a null or empty list, a fixed schema's, is no call). Another role's, or
    a call without a function name, is its record's error. The nulls in a function are left out (Arrow's fillers,
    ``without_none_values``) unless ``keep_nulls``."""
    calls = message.get("tool_calls")
    if not calls:
        return None
    if role != "assistant":
        raise RecordError(field, f"message {position} has tool_calls but role {role!r}; only an assistant turn calls "
                                 "tools")
    if not isinstance(calls, (list, tuple)):
        raise RecordError(field, f"message {position}'s tool_calls is a {type(calls).__name__}, not a list")
    checked = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise RecordError(field, f"message {position} has a tool call without a function name; each is "
                                     "{\"type\": \"function\", \"function\": {\"name\": ..., \"arguments\": {...}}}")
        call = {key: value for key, value in call.items() if value is not None}
        function = dict(function) if keep_nulls else without_none_values(function)
        if "arguments" in function:
            function["arguments"] = json_object_arguments(function["arguments"])
        call["function"] = function
        checked.append(call)
    return checked


def without_none_values(value):
    """``value`` with the keys of its objects (nested ones too) whose value is None left out; JSON text as given.

    Arrow (parquet, save_to_disk, a hub download) stores the objects of a column as one struct of every key any record
    has, and gives back a key a record lacks as None: a call's arguments {"city": "Paris"} came back as {"city":
    "Paris", "query": None}, which templates write as "query": null, and tool schemas got "required": null so. Arrow
    gives back a null written in the file the same way, so it is left out of such data too; JSON, JSON Lines and CSV
    files keep theirs (``LocalDataset.keeps_nulls``), as do arguments given as JSON text (OpenAI's format)."""
    if isinstance(value, dict):
        return {key: without_none_values(item) for key, item in value.items() if item is not None}
    if isinstance(value, (list, tuple)):
        return [without_none_values(item) for item in value]
    return value


def json_object_arguments(arguments):
    """A call's arguments as a dict where given as the JSON text of one (OpenAI's format): HF's chat templates write
    ``arguments | tojson``, and the text was written as a quoted string, its quotes escaped (the model trained to
    call tools so); other values as given."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def tool_result_keys(message, role):
    """The ``name`` and ``tool_call_id`` of a tool's result (templates write the tool's name, or match the call)."""
    if role not in TOOL_ROLES:
        return {}
    return {key: message[key] for key in ("name", "tool_call_id") if isinstance(message.get(key), str)}


def has_tool_turns(messages):
    """Whether a conversation holds a tool's result or an assistant turn calling one."""
    return any(message["role"] in TOOL_ROLES or message.get("tool_calls") for message in messages)


def message_weight(message, field, position):
    """A message's ``weight`` (OpenAI's chat fine-tuning format: 0, an assistant turn not trained, or 1, the default
    where it is missing or null); another value is its record's error (it was read as 1, without a word)."""
    weight = message.get("weight")
    if weight is None:
        return 1
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight not in (0, 1):
        raise RecordError(field, f"message {position} has weight {weight!r}: a weight is 0 (the turn is not trained) "
                                 "or 1, as in OpenAI's fine-tuning format")
    return int(weight)


def untrained_turns(value, messages):
    """The positions of the assistant turns of weight 0 in a message list ``value`` (``messages``: it checked)."""
    value = [raw for raw in value if not is_empty_system_message(raw)]  # (left out of ``messages``)
    return frozenset(position for position, (raw, message) in enumerate(zip(value, messages))
                     if message["role"] == "assistant" and raw.get("weight") == 0)


def _text_of_parts(parts, field, position):
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RecordError(field, f"message {position} has a {kind!r} content part; only text parts are read")
        texts.append(part["text"])
    return "\n".join(texts)


def prompt_messages(messages, field):
    if messages[-1]["role"] not in ("user", *TOOL_ROLES):
        raise RecordError(field, "the prompt messages must end with a user message (or a tool's result)")
    return messages


def final_assistant_answer(messages, field):
    prompt, answer = split_last_answer(messages)
    if answer is None:
        raise RecordError(field, "the last message must be the assistant's answer")
    return prompt, answer  # (a last turn calling tools: a ToolCallAnswer, the call trained as the template writes it)


__all__ = ["PromptRawDataset", "read_or_none", "required_text", "optional_text",
           "conversation_from_transcript", "answer_from_transcript", "checked_messages", "untrained_turns",
           "prompt_messages", "final_assistant_answer", "has_tool_turns", "TOOL_ROLES", "without_none_values"]
