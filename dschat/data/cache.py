"""On-disk cache of tokenized datasets: the key, and an atomic, multi-process-safe build.

The key hashes every input that changes the tokenized result, so a stale cache is never reused and an
unchanged configuration never rebuilds. A cache folder appears only complete: it is built in a temporary
folder next to it and renamed into place (``os.replace``), under a ``FileLock`` so that ranks (or separate
jobs sharing ``output_path``) starting at once build it once; the others wait and then load it.
"""
import contextlib
import glob
import hashlib
import json
import os
import shutil
import tempfile

from filelock import FileLock

from dschat.utils.files import give_plain_modes, temp_folder

# Bump when the tokenized layout or the encoding rules change, so old caches are not reused.
FORMAT_VERSION = 45  # 2: phase 2 rows carry prompt_length; 3: CSV cells as text (extra columns included);
# 4: only empty CSV cells are missing ("NA", "None" are text);
# 5: prompts get only the tokenizer's leading special tokens;
# 6: phase 2 rows carry chosen_truncated, rejected_truncated and eot_length;
# 7: the report counts the records with an answer cut at max_seq_len; a prompt with no answer room says so;
# 8: TRL's prompt/completion records: the completion is the answer (no longer an extra column);
# 9: steps 1 and 2 skip TRL's unpaired preference records with label false; step 3's records carry the pair's
#    answers (chosen, rejected) for reward functions; a multi-line text keeps its first line's indentation; a
#    transcript prompt after a system message reads as one; local files are keyed by their content
# 10: phase 1 rows carry label_spans (--multiturn: the earlier assistant turns)
# 11: with a chat template the answer is the template's rendering of it up to the EOT (Llama-2's spaces)
# 12: a "label" column beside renamed answers (or --data_fields label=NAME) is KTO's; yes/no are labels;
#     without a chat template, a system message after a turn is a paragraph of its own
# 13: --multiturn trains a conversation ending with a user turn up to its last answer (it was skipped)
# 14: --multiturn keeps a conversation longer than max_seq_len with its assistant turns within it (it was skipped)
# 15: a CSV label column of 1.0/0.0 is KTO's
# 16: a CSV cell's "\r\n" line ends read as "\n"
# 17: a CSV header's names without the spaces around them
# 18: a "Human:/Assistant:" transcript's "\r\n" line ends read as "\n" (of JSON and hub data too)
# 19: a CSV label column holding 1.0/0.0 is KTO's also with another value in it (that value's record is an error)
# 20: a CSV row that repeats the header is an error (it was a record)
# 21: a CSV cell's spaces after its comma are not its text (a quoted cell after ", " reads as one)
# 22: a CSV's empty cells after the header's last column (a comma ending each line) are no index column
# 23: a JSON object writing a key twice is an error (a .json file's first value was lost)
# 24: a message with tool_calls (function_call) is an error (its text was trained without them)
# 25: NaN/Infinity in a JSON record is an error (JSON Lines read it as a float, a JSON array as null)
# 26: an assistant turn of weight 0 (OpenAI's format) is not trained (--multiturn: no label span)
# 27: a float label column (JSON, parquet) holding 1.0/0.0 is KTO's also with another value in it, as a CSV's
# 28: the report's exact copies (--multiturn): a conversation with other turns of weight 0 is not one
# 29: TRL's implicit-prompt string pairs where one is the other's beginning: its last word is its answer (was empty)
# 30: a null written in a JSON/JSON Lines/CSV file's tool call or tool schema is kept (it was left out as Arrow's fillers)
# 31: a record's system column (LLaMA-Factory's, orca_dpo_pairs') is its conversation's first message (it was extra)
# 32: Alpaca's input and history (beside an instruction named the prompt) are the prompt's (they were extra)
# 33: LLaMA-Factory's kto_tag column is the labels (steps 1 and 2 skip the answers tagged false)
# 34: phase 3's records carry the system column too, as reward functions' column (it was left out since 31)
# 35: a CSV cell holding the JSON text of one message (LLaMA-Factory's pairwise answers) is that message (was its text)
# 36: phase 3's Alpaca records carry their input and history columns too, as reward functions' (left out since 32)
# 37: only a CSV cell reads as a message's JSON text (35 read a JSON, JSON Lines or parquet string so too: it is text)
# 38: OpenAI's older function calling is read: function_call, role "function", a "functions" column as the tools (was
#     an extra column)
# 39: an explicit --data_fields naming the prompt reads Alpaca's input and history only where it names them (input=,
#     history=; they were read beside prompt=instruction, and are extra columns now)
# 40: likewise its system column: read only where it names it (system=); a "system" column beside it is an extra column
# 41: phase 3's Alpaca records (read without --data_fields) carry their output as the column "output" (was "chosen")
# 42: phase 3's messages records carry their last reply as the column "chosen" (it was dropped)
# 43: phase 3's report entries list their records' extra columns (each item gets every one of its split's, None
#     where its record has none)
# 44: a JSON or JSON Lines file's objects keep their keys in the order written (a record whose object of a column had
#     them in another order than an earlier record's got that one's: tool call arguments, tool schemas)
# 45: phase 2 rows carry the record's margin (TRL's RewardTrainer's "margin" column, or --data_fields margin=NAME; 0.0
#     where the data has none), which step 2's loss subtracts
CACHE_SUBDIR = "dschat_data_cache"
REBUILD_FILE = "rebuild_token"  # (in a cache folder a forced rebuild wrote: its token, see ensure_built)


def tokenizer_fingerprint(tokenizer):
    """What about the tokenizer changes token ids: its full serialized form (vocab, merges, normalizer,
    added tokens, post-processor) when it is a fast tokenizer, else its vocabulary; and its chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    content = _encoding_rules(backend) if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return {
        "name_or_path": getattr(tokenizer, "name_or_path", None),
        "class": type(tokenizer).__name__,
        "vocab_sha256": hashlib.sha256(content.encode()).hexdigest(),
        "special_tokens": {name: str(value) for name, value in sorted(tokenizer.special_tokens_map.items())},
        "chat_template": getattr(tokenizer, "chat_template", None),
    }


def _encoding_rules(backend):
    """The serialized fast tokenizer without the padding and truncation settings its last call left behind (every
    call of the pipeline sets its own), so an earlier padded call in a notebook does not change the key."""
    state = json.loads(backend.to_str())
    state.pop("padding", None)
    state.pop("truncation", None)
    return json.dumps(state, sort_keys=True)


def cache_key(params):
    """sha256 of the JSON of ``params`` (sorted keys) plus FORMAT_VERSION."""
    text = json.dumps({"format_version": FORMAT_VERSION, **params}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def cache_folder(output_path, train_phase, key):
    return os.path.join(output_path, CACHE_SUBDIR, f"phase{train_phase}_{key[:32]}")


def ensure_built(folder, build_into, rebuild=None):
    """Build ``folder`` with ``build_into(tmp_folder)`` unless it exists; True if built here.

    ``rebuild`` (a token, the same in every process of a run) also rebuilds a folder that was not built under it: a
    forced rebuild that another process of the run already did (a rank of another node, on storage both see) while
    this one waited for the lock, or before it got here, is not done twice. (Not by file times: the nodes' clocks,
    and a file server's, differ.)
    The lock makes concurrent callers build once; the temp folder + rename makes a crash mid-build leave no
    half-written cache behind.
    """
    parent = os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    with FileLock(folder + ".lock"):
        if os.path.isdir(folder) and rebuild in (None, _rebuild_token(folder)):
            return False
        _remove_leftovers(folder)
        tmp = temp_folder(parent, os.path.basename(folder) + ".building-")
        try:
            build_into(tmp)
            if rebuild is not None:
                with open(os.path.join(tmp, REBUILD_FILE), "w") as f:
                    f.write(rebuild)
            give_plain_modes(tmp)
            if os.path.isdir(folder):
                _remove_folder(folder)
            os.replace(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return True


def _rebuild_token(folder):
    """The token of the forced rebuild that wrote ``folder`` (None: none)."""
    try:
        with open(os.path.join(folder, REBUILD_FILE)) as f:
            return f.read()
    except OSError:
        return None


def _remove_leftovers(folder):
    """Temp folders of this key that a killed build or removal left behind (under the key's lock, so none of them
    is another process's build in progress)."""
    for kind in (".building-", ".old-"):
        for path in glob.glob(os.path.join(glob.escape(folder) + kind + "*")):
            shutil.rmtree(path, ignore_errors=True)


def _remove_folder(folder):
    """Rename first so the cache path never points at a half-deleted folder."""
    trash = tempfile.mkdtemp(dir=os.path.dirname(folder), prefix=os.path.basename(folder) + ".old-")
    os.replace(folder, os.path.join(trash, "cache"))
    shutil.rmtree(trash, ignore_errors=True)


@contextlib.contextmanager
def quiet_datasets():
    """Hide datasets' per-save progress bars while writing/reading the cache (they are noise here)."""
    import datasets

    was_enabled = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()
