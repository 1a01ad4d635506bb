"""Loading tokenizers and HF causal LMs (hub names, local folders, or dschat's tiny presets)."""
import contextlib
import difflib
import functools
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from dschat.compat import zero3_loads_initialize_per_module
from dschat.errors import MissingInputError, UsageError, given_as

DROPOUT_FIELDS = ("dropout", "attention_dropout", "hidden_dropout", "activation_dropout", "resid_pdrop",
                  "embd_pdrop", "attn_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob",
                  # GPT-Neo's, Starcoder2's and MPT's names for the embedding and residual dropouts
                  "embed_dropout", "resid_dropout", "embedding_dropout", "residual_dropout", "emb_pdrop")

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def dschat_cache_dir():
    return os.environ.get("DSCHAT_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dschat"))


def resolve_model_path(name_or_path):
    """A hub name or folder is returned as is; a tiny preset name ("tiny-llama") becomes a saved folder.

    Presets are built once with ``from_config`` and ``save_pretrained`` so that every step loads them through
    the same ``from_pretrained`` code as real models.
    """
    from dschat.tiny.presets import create_tiny_model, is_tiny_preset

    check_no_interrupted_save(name_or_path)  # (every load of a model, its config or tokenizer comes here first)
    if os.path.isdir(name_or_path) or not is_tiny_preset(name_or_path):
        return name_or_path
    from filelock import FileLock

    preset = name_or_path.split("/")[-1]
    folder = os.path.join(dschat_cache_dir(), "models", preset)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    with FileLock(folder + ".lock"):  # several ranks may start at once
        return create_tiny_model(preset, folder)


def check_no_interrupted_save(name_or_path, flag=None):
    """A folder that a save was killed in part-way (``run_layout.interrupted_save_message``: its files half moved in,
    or the folder swapped out and the new one not yet in), refused, naming it (and ``flag``) and how to finish the
    save: it would load as neither model, or as no folder at all. dschat's loaders (``resolve_model_path``: the
    steps, ``DeepSpeedRLHFEngine``, ``load_tokenizer``, ``load_causal_lm``, ``RewardModel.from_pretrained``, the
    tools) check it; transformers' own ``from_pretrained`` cannot."""
    from dschat.run_layout import interrupted_save_message

    if message := interrupted_save_message(name_or_path):
        raise MissingInputError(given_as(flag, message))


def looks_local(path):
    """A model name (``~`` already expanded) the user meant as a folder here, not a hub name ("ORG/NAME" or "NAME"):
    absolute, ./ or ../, deeper than ORG/NAME, or through a step's folder of a dschat run ("out/step1_sft")."""
    from dschat.run_layout import STEP_FOLDER_NAMES

    path = str(path)
    return (os.path.isabs(path) or path.startswith(("./", "../")) or path.count("/") > 1
            or not STEP_FOLDER_NAMES.isdisjoint(path.split("/")) or bool(run_folder_siblings(path)))


def run_folder_siblings(path):
    """The step folders beside ``path`` when its parent is a dschat run's output folder here ("out/step1_sfft": a
    mistyped step folder, not the hub model "step1_sfft" of an organisation "out"); else []."""
    from dschat.run_layout import STEP_FOLDER_NAMES

    parent = os.path.dirname(str(path).rstrip("/"))
    if not (parent and os.path.isdir(parent)):
        return []
    return sorted(name for name in STEP_FOLDER_NAMES if os.path.isdir(os.path.join(parent, name)))


def missing_folder_message(path):
    """"PATH: no such folder", with the step folder meant when ``path`` mistypes one beside it."""
    path = str(path).rstrip("/")
    close = difflib.get_close_matches(os.path.basename(path), run_folder_siblings(path), n=1)
    return f"{path}: no such folder" + (f" (did you mean {os.path.join(os.path.dirname(path), close[0])}?)"
                                        if close else "")


def check_not_a_file(path):
    """A model path that names a file here (its weights, the run's report.json): one error naming the folder meant,
    where transformers tries it as a folder or a hub name and fails with a message about neither."""
    if os.path.isfile(path):
        raise MissingInputError(f"{path}: a file, not a model folder: give the folder that holds the model (the one "
                                f"with its config.json), e.g. {os.path.dirname(os.path.abspath(path))}")


def hub_load(loader, name_or_path, **kwargs):
    """``loader(name_or_path)``; a name that is no folder here and fails as a hub name too is said to be either: a
    mistyped folder becomes, after the hub client's retries, one clear error instead of a hub traceback (at once for
    a name that is a local path, ``looks_local``, a mistyped tiny preset, and a hub name the hub cache lacks while
    the hub cannot be reached, ``unfetchable_hub_name``: as ``check_model_path`` says them for a flag; a notebook's
    load_tokenizer("org/name") waited 46 s of retries before its error)."""
    check_not_a_file(name_or_path)
    if looks_local(name_or_path) and not os.path.exists(name_or_path):
        raise MissingInputError(missing_folder_message(name_or_path))
    if unloadable := unknown_tiny_preset(name_or_path) or unfetchable_hub_name(name_or_path):
        raise MissingInputError(unloadable)
    try:
        return loader(name_or_path, **kwargs)
    except OSError as err:
        if os.path.isdir(name_or_path):
            raise
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise MissingInputError(f"{name_or_path}: no such folder here, and loading it as a Hugging Face hub name "
                                f"failed ({reason}); check the path, or the hub name and the network") from err


HUB_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                    "pytorch_model.bin.index.json")  # in from_pretrained's order of preference


def hub_file(name, file):
    """The local path of ``file`` of the hub model ``name`` (fetched once, then read from the hub cache); None where
    the model has no such file, or it cannot be fetched (offline: not in the hub cache)."""
    from transformers.utils.hub import cached_file

    return cached_file(name, file, _raise_exceptions_for_missing_entries=False,
                       _raise_exceptions_for_connection_errors=False)


# The snapshot folders ``hub_model_folder`` fetched in this process, by ``_hub_folder_key``
_FETCHED_HUB_FOLDERS = {}


def hub_model_folder(name, extra_files=()):
    """The local snapshot folder of the hub model ``name`` holding its config and the weights ``from_pretrained``
    would read (safetensors first; a sharded index's shards), and those of ``extra_files`` that it has: what readers
    of a folder's files by name (a reward model's value head) need. Fetched once per process: online, each fetch asks
    the hub for every file, and step 3 and the tools read a reward model's folder two or three times (its value head,
    whether it is a critic, its load)."""
    folder = _FETCHED_HUB_FOLDERS.get(_hub_folder_key(name, extra_files))
    if folder is None or not os.path.isdir(folder):  # (a snapshot removed since: fetched again)
        folder = _fetch_hub_model_folder(name, extra_files)
        if _extra_files_settled(name, folder, extra_files):
            # (keyed after the fetch: it may have turned offline mode on, ``read_hub_cache_only_if_unreachable``)
            _FETCHED_HUB_FOLDERS[_hub_folder_key(name, extra_files)] = folder
    return folder


def _extra_files_settled(name, folder, extra_files):
    """Whether each of ``extra_files`` is in the fetched ``folder`` or known not to be had: offline, or the hub said
    the model has none (the hub cache's marker of it, ``try_to_load_from_cache``). Else the folder is not kept: a file
    a connection error left unfetched (``hub_file`` answers None alike) was taken as missing for the rest of the
    process, a notebook's reward model "not a reward model" at each call after the network came back."""
    return all(os.path.exists(os.path.join(folder, file)) or hub_file_known_missing(name, file)
               for file in extra_files)


def hub_file_known_missing(name, file):
    """Whether ``hub_file(name, file)``'s None is settled: offline (only the hub cache is read), or the hub said the
    model has no such file (the hub cache's marker of it, ``try_to_load_from_cache``); not where a connection error
    left it unfetched, which the hub client answers alike."""
    from huggingface_hub import _CACHED_NO_EXIST, constants, try_to_load_from_cache

    return constants.HF_HUB_OFFLINE or try_to_load_from_cache(name, file) is _CACHED_NO_EXIST


def _hub_folder_key(name, extra_files):
    """What a fetched snapshot folder holds besides ``name`` and ``extra_files`` depends on: ``hub_lookup_key``."""
    return *hub_lookup_key(name), tuple(extra_files)


def hub_lookup_key(name):
    """The key of a per-process memo of what the hub model ``name`` is found to hold: besides the name, the hub cache
    it is read from (HF_HUB_CACHE, changed in a notebook: another download of the name) and whether the hub was asked
    (offline, a file the hub cache lacked is left out: online, it is fetched then)."""
    from huggingface_hub import constants

    return name, constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE


def hub_lookup_key_of_every_rank(name):
    """``hub_lookup_key`` for a memo whose miss is a collective (``rank_0_decides``), so the same on every rank:
    offline mode counted as the user chose it (``hub_offline_by_choice``), not as dschat turned it on after its own
    probe of the hub, which each rank makes apart (rank 0 alone in train.py's pre-flight of hub data): a rank whose
    key so changed missed the memo where the others hit it, and waited alone in the broadcast."""
    name, cache, _ = hub_lookup_key(name)
    return name, cache, hub_offline_by_choice()


def hub_offline_by_choice():
    """Whether the hub is not asked because the user said so (HF_HUB_OFFLINE), not because dschat found it unreachable
    (``use_hub_cache_only``)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) and not os.environ.get(HUB_UNREACHABLE_ENV)


def _fetch_hub_model_folder(name, extra_files=()):
    """``hub_model_folder``, fetched (or read from the hub cache offline) now."""
    from transformers.utils.hub import cached_file, get_checkpoint_shard_files

    folder = os.path.dirname(hub_load(cached_file, name, filename="config.json"))
    weights = next(filter(None, (hub_file(name, file) for file in HUB_WEIGHT_FILES)), None)
    if weights is None:
        raise MissingInputError(f"{name}: the hub model has none of {', '.join(HUB_WEIGHT_FILES)} (or they cannot be "
                                "fetched: offline, only the hub cache is read)")
    if weights.endswith(".index.json"):
        hub_load(get_checkpoint_shard_files, name, index_filename=weights)
    for file in extra_files:
        hub_file(name, file)
    return folder


@contextlib.contextmanager
def readable_weights(folder):
    """Loading a model's weights from ``folder``: a file of them that is truncated or damaged (a copy cut short, a
    full disk) is one UsageError naming the folder, instead of safetensors' or torch's traceback that names none."""
    from safetensors import SafetensorError

    from dschat.utils.files import unreadable_file_reason

    try:
        yield
    except Exception as error:
        # (an OSError of a local folder's file too: torch's reader of a cut .bin; a hub name's is hub_load's)
        reason = unreadable_file_reason(error, (SafetensorError, OSError) if os.path.isdir(folder) else
                                        (SafetensorError,))
        no_weights = "no file named" in str(error) and os.path.isdir(folder) and no_weights_message(folder)
        if no_weights:
            raise UsageError(no_weights) from None
        if reason is None or "no file named" in str(error):  # (no weights at all: transformers says so itself)
            raise
        raise UsageError(f"{folder}: its weights cannot be read ({reason}); a weights file there is damaged or was "
                         f"copied in part: restore the folder, or save the model again") from error


def check_model_path(name_or_path, flag):
    """A model that cannot load, as an error naming ``flag`` before anything loads: a local path (``looks_local``)
    that is not there (not transformers' "Repo id must be in the form ..." traceback from a hub lookup), a folder
    without a loadable model (``not_a_model_folder``, ``no_weights_message``, ``adapter_beside_model_message``) or
    that a save was killed in (``check_no_interrupted_save``: it would load as neither model), a mistyped tiny
    preset, a hub name that cannot be fetched (``unfetchable_hub_name``)."""
    check_no_interrupted_save(name_or_path, flag)
    if looks_local(name_or_path) and not os.path.exists(name_or_path):
        raise MissingInputError(f"{flag} {missing_folder_message(name_or_path)}")
    unloadable = os.path.isdir(name_or_path) and (not_a_model_folder(name_or_path) or no_weights_message(name_or_path)
                                                  or adapter_beside_model_message(name_or_path))
    if unloadable:
        raise MissingInputError(f"{flag} {unloadable}")
    if unknown := unknown_tiny_preset(name_or_path):
        raise MissingInputError(f"{flag} {unknown}")
    if unfetchable := unfetchable_hub_name(name_or_path):
        raise MissingInputError(f"{flag} {unfetchable}")


HUB_PROBE_TIMEOUT_S = 5
# Set (to the probe's failure) where dschat turned offline mode on itself: the processes a run starts inherit it
HUB_UNREACHABLE_ENV = "DSCHAT_HUB_UNREACHABLE"


def unfetchable_hub_name(name_or_path):
    """"NAME: no such folder here, nor in the hub cache, and ..." for a hub name (a mistyped one most often) that is
    not in the hub cache while the hub cannot be reached or is not to be asked (HF_HUB_OFFLINE), else None: decided at
    once, where the hub client retries each file it looks up for half a minute before it fails. For any hub name,
    offline mode is decided first (``read_hub_cache_only_if_unreachable``): a cached model then loads from the cache
    without the hub client's retries."""
    not_cached = hub_name_not_cached(name_or_path)
    if is_hub_name(name_or_path):
        # (quietly for a name the cache lacks: the error returned says why, and the notice would say it twice)
        read_hub_cache_only_if_unreachable(say=not not_cached)
    why = not_cached and hub_unavailable()
    if not why:
        return None
    advice = ("or download the model first" if hub_offline_by_choice() else
              "or the network (HF_HUB_OFFLINE=1 reads the hub cache without asking the hub)")
    return (f"{name_or_path}: no such folder here, nor a model of that name in the Hugging Face hub cache, and {why}: "
            f"check the name or path, {advice}")


def hub_unavailable():
    """Why no file can be fetched from the hub now (HF_HUB_OFFLINE; the hub not answering one short request), else
    None."""
    from huggingface_hub import constants

    if reason := os.environ.get(HUB_UNREACHABLE_ENV):  # (offline since dschat's probe, here or in a parent process)
        return f"the hub cannot be reached ({reason})"
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set, so the hub is not asked"
    probe_failure = hub_probe_failure(constants.ENDPOINT)
    return f"the hub cannot be reached ({probe_failure})" if probe_failure else None


def read_hub_cache_only_if_unreachable(say=True):
    """Before a hub model or dataset is read, with HF_HUB_OFFLINE unset: where the hub does not answer one short
    request (``hub_probe_failure``), offline mode for this process and those it starts (the launcher's ranks,
    datasets' workers), said once (unless not ``say``: the caller says it, ``say_hub_cache_only``, where no error
    that follows says why). Returns the probe's failure where it turned offline mode on now, else None. Without it
    each file the hub cache lacks (a tokenizer's optional files, a chat template, a dataset's lookups) costs the hub
    client's half a minute of retries: 214 s before step 1 started."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return None
    failure = hub_probe_failure(constants.ENDPOINT)
    if failure is None:
        return None
    use_hub_cache_only(failure)
    if say:
        say_hub_cache_only(failure)
    return failure


@contextlib.contextmanager
def hub_cache_only_said_after():
    """``read_hub_cache_only_if_unreachable``, its notice said once the block has read what it reads, not if it
    raises (its error says why: the notice would say it twice). Nested, the inner one finds offline mode on: the
    outer one says it."""
    failure = read_hub_cache_only_if_unreachable(say=False)
    yield
    if failure:
        say_hub_cache_only(failure)


def say_hub_cache_only(failure):
    """The notice that offline mode was turned on because the hub did not answer (``failure``: why)."""
    from dschat.utils.dist import print_rank_0

    print_rank_0(f"the hub cannot be reached ({failure}): this run reads the hub cache only, as with "
                 "HF_HUB_OFFLINE=1")


def use_hub_cache_only(reason):
    """Offline mode where each library reads it: huggingface_hub's constant (transformers asks its
    ``is_offline_mode()``, which returns it), datasets' own copy (read at its import), and the environment of the
    processes started from here."""
    import sys

    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True
    if (datasets_config := sys.modules.get("datasets.config")) is not None:
        datasets_config.HF_HUB_OFFLINE = datasets_config.HF_DATASETS_OFFLINE = True
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.pop("HF_DATASETS_OFFLINE", None)  # (an HF_DATASETS_OFFLINE=0 would turn datasets online again)
    os.environ[HUB_UNREACHABLE_ENV] = reason


def is_hub_name(name_or_path):
    """Whether ``name_or_path`` is read from the hub: no path here (nor meant as one), no tiny preset."""
    from dschat.tiny.presets import is_tiny_preset

    return not (os.path.exists(name_or_path) or looks_local(name_or_path) or is_tiny_preset(name_or_path))


def hub_name_not_cached(name_or_path):
    """Whether ``name_or_path`` names a hub model (no path here, no tiny preset) whose config the hub cache lacks."""
    from huggingface_hub import try_to_load_from_cache

    if not is_hub_name(name_or_path):
        return False
    try:
        return not isinstance(try_to_load_from_cache(str(name_or_path), "config.json"), str)
    except ValueError:  # no valid hub name either: transformers' error says so at once
        return False


@functools.cache
def hub_probe_failure(endpoint):
    """Why one short request to the hub at ``endpoint`` got no answer (any HTTP status is one), else None; asked once
    per process, through the hub client's own session (its proxy settings)."""
    from huggingface_hub.utils import get_session

    try:
        get_session().head(endpoint, timeout=HUB_PROBE_TIMEOUT_S)
    except Exception as error:  # (the hub client's transport errors: httpx's, or requests' in older clients)
        return str(error) or type(error).__name__
    return None


def unknown_tiny_preset(name_or_path):
    """"NAME: no such tiny preset ..." for a mistyped preset name ("tiny-lama") that is no folder either, else None:
    no hub model is named so, and a hub lookup of it takes a minute of retries offline."""
    from dschat.tiny.presets import PRESET_PREFIX, TINY_PRESETS, is_tiny_preset

    bare = str(name_or_path).removeprefix(PRESET_PREFIX)
    if bare.startswith("tiny-") and not is_tiny_preset(name_or_path) and not os.path.exists(name_or_path):
        return f"{name_or_path}: no such tiny preset (they are {', '.join(TINY_PRESETS)}) nor folder"
    return None


def not_a_model_folder(path, expected="a model folder (config.json)"):
    """Why the folder ``path`` holds no model (a PEFT adapter's, a step's training checkpoint, a train.py run's
    output, or nothing), else None: transformers would fail on it with "Unrecognized model ... Should have a
    `model_type` key" or a tokenizer backend error."""
    # what PEFT's save_pretrained writes (OpenRLHF's LoRA saves add the base model's config.json, without its weights)
    adapter_only = os.path.isfile(os.path.join(path, "adapter_config.json")) and not holds_weights(path)
    if os.path.isfile(os.path.join(path, "config.json")) and not adapter_only:
        return None
    if adapter_only:
        return (f"{path}: a PEFT adapter folder (adapter_config.json), not a whole model: merge the adapter into its "
                "base model (PEFT's merge_and_unload(), then save_pretrained with the tokenizer) and pass that folder "
                "(dschat's steps save LoRA models merged)")
    from dschat.run_layout import (CHECKPOINTS_DIR, CRITIC_DIR, DPO_DIR, PPO_ACTOR_DIR, PPO_DIR, RM_DIR, RUN_ARGS_FILE,
                                   SFT_DIR)

    parts = os.path.abspath(path).split(os.sep)
    if CHECKPOINTS_DIR in parts:  # (a step's --save_interval states: no config.json, no HF weights)
        step_output = os.sep.join(parts[:len(parts) - 1 - parts[::-1].index(CHECKPOINTS_DIR)]) or os.sep
        if os.path.isfile(os.path.join(step_output, RUN_ARGS_FILE)):
            return (f"{path}: a training checkpoint (DeepSpeed's states, which --resume continues from), not a saved "
                    f"model: the step saves its model in {step_output} when it finishes")

    run_models = (SFT_DIR, RM_DIR, DPO_DIR, PPO_ACTOR_DIR, f"{PPO_DIR}/{CRITIC_DIR}")
    inside = [os.path.join(path, sub) for sub in run_models if os.path.isfile(os.path.join(path, sub, "config.json"))]
    holds = f" (a run's output folder: its models are {', '.join(inside)})" if inside else ""
    return f"{path}: no model in this folder: expected {expected}{holds}"


def adapter_beside_model_message(path):
    """Why the model folder ``path`` cannot train: a PEFT adapter saved beside its whole model (a merged model saved
    into the adapter's folder), else None. transformers then loads the adapter onto the model and freezes every weight
    of it (a step failed with "optimizer got an empty parameter list", or with LoRA a PEFT version error), and a
    merged adapter would count twice."""
    if not (os.path.isfile(os.path.join(path, "adapter_config.json")) and holds_weights(path)):
        return None
    return (f"{path}: a whole model (config.json) beside a PEFT adapter (adapter_config.json), which transformers "
            "would load onto it, freezing the model's weights (and applying the adapter twice if they have it "
            "merged): move the adapter's files (adapter_config.json, adapter_model.*) out of the folder")


def adapter_message(path):
    """Why a folder holding a PEFT adapter does not load as a model (an adapter alone, or beside a whole model), else
    None: checked wherever a model loads (``create_hf_model``, the reward model's), the tools' loads included."""
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        return None
    return adapter_beside_model_message(path) or not_a_model_folder(path)


def holds_weights(path):
    return any(is_weights_file(name) for name in os.listdir(path))


def is_weights_file(name):
    """transformers' weights files, whole or sharded (model-00001-of-00002.safetensors), and their index."""
    return name.startswith(("model", "pytorch_model")) and name.endswith((".safetensors", ".bin", ".index.json"))


def no_weights_message(path):
    """Why the model folder ``path`` cannot load (config.json without transformers' weights files, whole or sharded),
    else None."""
    names = os.listdir(path)
    if "config.json" not in names or any(map(is_weights_file, names)):
        return None
    return (f"{path}: config.json but no weights (model*.safetensors, pytorch_model*.bin): copy them too, or save the "
            "model with save_pretrained")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model",
                   "vocab.txt", "tiktoken.model", "tekken.json", "sentencepiece.bpe.model", "spm.model")
# Beside them: what else a tokenizer reads from its folder (its chat templates among them: transformers' folder of
# named ones too).
TOKENIZER_EXTRA_FILES = ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                         "merges.txt", "additional_chat_templates")


def check_tokenizer_files(path, flag=None):
    """A model folder here without any tokenizer file: one error naming it (and ``flag``), where transformers says
    "Couldn't instantiate the backend tokenizer ... You need to have sentencepiece or tiktoken installed"."""
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise MissingInputError(f"{given_as(flag, path)}: no tokenizer files (tokenizer.json, "
                                "tokenizer_config.json, ...): save the tokenizer with the model "
                                "(tokenizer.save_pretrained(folder)) or copy its files there")


DEFAULT_EOT_TOKEN = "<|endoftext|>"


def load_tokenizer(name_or_path, padding_side="right", add_eot_token=False, eot_token=DEFAULT_EOT_TOKEN):
    """The tokenizer of a model; a missing EOS token becomes ``eot_token`` if ``add_eot_token``; a missing pad token
    becomes the EOS token (masks, not ids, mark padding). A tokenizer's own EOS token is kept: it ends every answer
    (``get_eot_token``), so there --add_eot_token / --eot_token do nothing, and a warning says so."""
    path = resolve_model_path(name_or_path)
    check_tokenizer_files(path)
    tokenizer = hub_load(AutoTokenizer.from_pretrained, path, use_fast=True)  # a model's first load: its name checked
    if tokenizer.eos_token is None:
        if not add_eot_token:
            raise UsageError(f"tokenizer of {name_or_path} has no EOS token; pass --add_eot_token to add "
                             f"{eot_token!r} (--eot_token) as the end-of-conversation token")
        tokenizer.add_special_tokens({"eos_token": eot_token})
    elif (add_eot_token or eot_token != DEFAULT_EOT_TOKEN) and eot_token != tokenizer.eos_token:
        _warn_eot_unused(name_or_path, tokenizer.eos_token, add_eot_token, eot_token)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    check_default_chat_template(tokenizer, name_or_path)
    # the step's side (right to train, left to generate); the saved models keep the folder's (``saved_as_loaded``)
    tokenizer.padding_side = padding_side
    return tokenizer


def check_default_chat_template(tokenizer, name_or_path):
    """Named chat templates (``additional_chat_templates/*.jinja``: tool_use, rag, ...) need one called "default" for
    dschat's plain conversations; without it every record failed in transformers' apply_chat_template, as data was
    built."""
    templates = getattr(tokenizer, "chat_template", None)
    if isinstance(templates, dict) and "default" not in templates:
        raise UsageError(f"the tokenizer of {name_or_path} has named chat templates ({', '.join(sorted(templates))}) "
                         "and none called 'default', which dschat formats conversations with; save the one to use as "
                         "chat_template.jinja (or name it default)")


@contextlib.contextmanager
def saved_as_loaded(tokenizer):
    """The tokenizer with the padding side its model folder gave it (transformers keeps the folder's settings in
    ``init_kwargs``), while it is saved: the side a step pads with is the step's (a step-1 model saved padding right
    warned and generated otherwise in batches of HF's generate)."""
    source = (getattr(tokenizer, "init_kwargs", None) or {}).get("padding_side")
    if source is None:  # (a folder that says none: as it is)
        yield tokenizer
        return
    current = tokenizer.padding_side
    tokenizer.padding_side = source
    try:
        yield tokenizer
    finally:
        tokenizer.padding_side = current


_WARNED_EOT = set()


def _warn_eot_unused(name_or_path, eos_token, add_eot_token, eot_token):
    """DeepSpeed-Chat appends --eot_token to every answer; dschat adds it only as the EOS of a tokenizer without one.
    Warned once per setting (step 3 loads the tokenizer of each model)."""
    if (eos_token, add_eot_token, eot_token) in _WARNED_EOT:
        return
    _WARNED_EOT.add((eos_token, add_eot_token, eot_token))
    from dschat.utils.dist import print_rank_0

    given = ["--add_eot_token"] if add_eot_token else []
    given += [f"--eot_token {eot_token!r}"] if eot_token != DEFAULT_EOT_TOKEN else []
    print_rank_0(f"warning: {' '.join(given)} has no effect: the tokenizer of {name_or_path} has its own EOS token "
                 f"{eos_token!r}, which ends every answer and stops generation instead of {eot_token!r} (the flags "
                 f"only add an EOS token to a tokenizer that has none)")


def configure_dropout(config, dropout):
    """Set every dropout probability the config has (names differ between model families), in its sub-configs too
    (MPT's attention dropout is ``attn_config.attn_pdrop``)."""
    if dropout is None:
        return config
    for owner, field, _ in dropout_fields(config):
        set_dropout_field(owner, field, dropout)
    return config


def dropout_fields(config, prefix=""):
    """(config or sub-config, field name, dotted name) for every ``DROPOUT_FIELDS`` field of ``config`` and of the
    configs nested in it (transformers' ``sub_configs``: MPT's ``attn_config``, a multimodal model's
    ``text_config``)."""
    found = [(config, field, prefix + field) for field in DROPOUT_FIELDS if hasattr(config, field)]
    for name, value in vars(config).items():
        if isinstance(value, PretrainedConfig):
            found += dropout_fields(value, f"{prefix}{name}.")
    return found


def set_dropout_field(config, field, dropout):
    """``config.field = dropout``; a field that transformers types as an int (MPT's ``attn_config.attn_pdrop``, whose
    strict config refuses 0.0 and would not load a saved 0.1) takes a whole ``dropout`` as an int, and keeps its value
    otherwise, with a warning."""
    from huggingface_hub.errors import StrictDataclassError

    try:
        setattr(config, field, dropout)
    except StrictDataclassError:
        if float(dropout).is_integer():
            setattr(config, field, int(dropout))
            return
        from dschat.utils.dist import print_rank_0

        print_rank_0(f"warning: dropout {dropout} leaves {type(config).__name__}'s {field} at "
                     f"{getattr(config, field)}: transformers types it as an int (a config saved with a fraction there "
                     "would not load)")


def config_dropouts(config):
    """The dropout probabilities above zero that ``config`` sets, by field name (``configure_dropout``'s fields; a
    sub-config's by dotted name, "attn_config.attn_pdrop")."""
    values = {name: getattr(owner, field, None) for owner, field, name in dropout_fields(config)}
    return {name: value for name, value in values.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0}


def zero3_enabled(ds_config):
    return bool(ds_config) and ds_config.get("zero_optimization", {}).get("stage", 0) == 3


def model_load_context(ds_config):
    """Under ZeRO-3, ``from_pretrained`` must build the model sharded (``zero.Init``).

    transformers does this while an ``HfDeepSpeedConfig`` object is alive; the returned object must be kept
    referenced until the model is built.
    """
    if not zero3_enabled(ds_config):
        return None
    from dschat.compat import prepare_for_zero_init
    from transformers.integrations.deepspeed import HfDeepSpeedConfig

    prepare_for_zero_init()
    return HfDeepSpeedConfig(ds_config)


def training_dtype(ds_config):
    """The dtype a DeepSpeed config trains (or evaluates) in. DeepSpeed casts the module to fp16/bf16 when they are
    enabled and leaves it as it is otherwise, and transformers loads a checkpoint in the dtype it was stored in: so
    an fp32 run of a bf16 checkpoint must ask for fp32 itself, or it trains in bf16 with no fp32 master weights."""
    for key, dtype in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
        if (ds_config.get(key) or {}).get("enabled"):
            return dtype
    return "fp32"


def load_dtype(dtype, ds_config):
    """The torch dtype to load weights in: ``dtype`` ("bf16", ...) if given, else the DeepSpeed config's training
    dtype; None (the checkpoint's own) for neither, e.g. the tools' inference."""
    if not dtype and not ds_config:
        return None
    return TORCH_DTYPES[dtype or training_dtype(ds_config)]


def create_hf_model(model_class, model_name_or_path, tokenizer, ds_config=None, rlhf_training=False,
                    dropout=None, dtype=None):
    """Build ``model_class`` from a hub name, a folder or a tiny preset (DeepSpeed-Chat's signature).

    ``rlhf_training=True`` builds the architecture without loading weights (the caller loads a checkpoint).
    """
    path = resolve_model_path(model_name_or_path)
    if os.path.isdir(path) and (adapter := adapter_message(path)):  # (the tools load here too)
        raise UsageError(adapter)
    config = configure_dropout(hub_load(AutoConfig.from_pretrained, path), dropout)  # a typo: one clear error
    if ds_config is not None:  # (a training load: every rank loads the model)
        check_same_config_on_every_rank(model_name_or_path, config)
    keep_alive = model_load_context(ds_config)  # noqa: F841 (must outlive from_pretrained)
    torch_dtype = load_dtype(dtype, ds_config)
    if rlhf_training:
        model = model_class.from_config(config, dtype=torch_dtype)
    else:
        with readable_weights(path), zero3_loads_initialize_per_module():
            model, loading = model_class.from_pretrained(path, config=config, dtype=torch_dtype,
                                                         output_loading_info=True)
        check_weights_loaded(model_name_or_path, model, loading)
    sync_special_tokens(model, tokenizer)
    return model


def check_same_config_on_every_rank(name, config):
    """Every rank read the same config for the model ``name`` (collective): on several nodes, each reading its own
    copy of a model folder (or of a hub model in its cache) that differs, the ranks built models of other shapes and
    failed deep in DeepSpeed's first collective (gloo: "Received data size doesn't match expected size"; NCCL: a hang
    or garbage). Its weights need no check: rank 0's are the ones trained (DeepSpeed broadcasts them; under ZeRO-3
    transformers loads them on rank 0). A UsageError on every rank naming the settings that differ."""
    import json

    from dschat.utils.dist import gathered_objects, get_world_size, local_device, names_differing_between_ranks

    if get_world_size() == 1:
        return
    # (the folder's path may differ between nodes; transformers' version is no setting of the model)
    settings = {key: value for key, value in config.to_dict().items()
                if key not in ("_name_or_path", "transformers_version")}
    if not names_differing_between_ranks({"config": json.dumps(settings, sort_keys=True, default=str)},
                                         local_device()):
        return
    every = gathered_objects(settings, local_device())
    differ = sorted({key for other in every for key in {*other, *every[0]} if other.get(key) != every[0].get(key)})
    said = ", ".join(_first_difference(key, every) for key in differ[:5])  # (the same line on every rank: said once)
    raise UsageError(f"{name}: the ranks read different configs of the model: {said}"
                     f"{f' and {len(differ) - 5} more' if len(differ) > 5 else ''} "
                     f"{'differs' if len(differ) == 1 else 'differ'} between them (each node's "
                     "own copy of the model folder, or of a hub model in its cache, that is not the same): give every "
                     "node the same model")


def _first_difference(key, every):
    """``key`` (rank 0: its value, rank R: another), R the first rank of ``every`` (each rank's settings) whose value
    of it is not rank 0's."""
    other = next(rank for rank, settings in enumerate(every) if settings.get(key) != every[0].get(key))
    return f"{key} (rank 0: {every[0].get(key)!r}, rank {other}: {every[other].get(key)!r})"


def check_weights_loaded(name, model, loading):
    """Most of ``model``'s weights missing from the checkpoint ``name`` (``loading``: from_pretrained's loading info)
    is an error: its weights are named for another layout, and the model would train from random values with only
    transformers' load report to say so. A few missing (a new head) stay transformers' warning."""
    missing = sorted(loading.get("missing_keys") or ())
    total = len(model.state_dict())
    if total and len(missing) > total // 2:
        unexpected = sorted(loading.get("unexpected_keys") or ())
        found = f"; the checkpoint's are named e.g. {', '.join(unexpected[:2])}" if unexpected else ""
        raise UsageError(f"{name}: {len(missing)} of the {total} weights of {type(model).__name__} are not in its "
                         f"checkpoint (e.g. {', '.join(missing[:2])}){found}: the model would train from random "
                         "values. Give a folder saved with save_pretrained (or DeepSpeed-Chat's step-1/step-2 output)")


def embedding_rows(model):
    """Rows of the input embedding; under ZeRO-3 the local tensor is an empty shard, ``ds_shape`` is the real one."""
    weight = model.get_input_embeddings().weight
    return getattr(weight, "ds_shape", weight.shape)[0]


def grow_embeddings_for(model, tokenizer, rows=0):
    """Grow (never shrink) the embeddings so every token id of the tokenizer has a row, and to at least ``rows``."""
    needed = max(int(8 * ((len(tokenizer) + 7) // 8)) if len(tokenizer) > embedding_rows(model) else 0, rows)
    if needed > embedding_rows(model):
        model.resize_token_embeddings(needed)


def token_id_list(token_ids):
    """An EOS setting as HF takes it (an int, a list of ints, a tensor or numpy value of either, or None) as a list."""
    if token_ids is None:
        return []
    if isinstance(token_ids, torch.Tensor) or hasattr(token_ids, "tolist"):
        token_ids = token_ids.tolist()
    return [int(t) for t in token_ids] if isinstance(token_ids, (list, tuple)) else [int(token_ids)]


def stop_token_ids(model, tokenizer):
    """The ids that end an answer: the tokenizer's EOS (training ends answers with it), then any other EOS id the
    model's generation_config lists (e.g. Qwen2.5-Instruct's <|endoftext|> beside <|im_end|>), as HF's generate
    stops on them."""
    listed = token_id_list(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    return list(dict.fromkeys([tokenizer.eos_token_id, *listed]))


def generable_token_count(model, tokenizer):
    """How many of the model's first ids may be generated: the tokenizer's, raised past any stop or pad id beyond them
    (a generation_config whose EOS id the tokenizer lacks: its answers would otherwise never end). Ids from it on,
    embedding rows no token has, are left out of the choice (``sampling.chosen_columns``, HF's ``suppress_tokens``)."""
    specials = [i for i in (*stop_token_ids(model, tokenizer), tokenizer.pad_token_id) if i is not None]
    return max([len(tokenizer), *(int(i) + 1 for i in specials)])


def sync_special_tokens(model, tokenizer, rows=0):
    """Make the model's config and generation config agree with the tokenizer; grow the embeddings if needed (to at
    least ``rows`` too). Other EOS ids the generation config lists are kept after the tokenizer's
    (``stop_token_ids``): HF's generate stops on them too, with the saved model as with the original."""
    grow_embeddings_for(model, tokenizer, rows)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.pad_token_id = tokenizer.pad_token_id
        eos = stop_token_ids(model, tokenizer)
        generation_config.eos_token_id = eos if len(eos) > 1 else eos[0]


def check_not_a_reward_model(model_name_or_path, flag=None):
    """A step-2 reward-model folder given as a policy is an error (naming ``flag``, if given): it holds no LM head, so
    the model would generate from a new random one and still train and be scored. The folder is read once per state
    of its files (``holds_reward_model``): the early checks' callers load the model later, which checks it again."""
    from dschat.models.reward_model import holds_reward_model

    path = resolve_model_path(model_name_or_path)
    if os.path.isdir(path) and holds_reward_model(path):
        raise UsageError(f"{given_as(flag, model_name_or_path)}: {value_model_kind(path)}, not a policy: "
                         "pass a language model, e.g. train.py's <output>/step1_sft or <output>/step3_ppo/actor")


CRITIC_KIND = "step 3's critic (the value model PPO trains beside the actor)"


def value_model_kind(path):
    """What the value-head folder ``path`` is, in words: step 3 saves its critic as step 2 saves a reward model (the
    same files), so a critic is known by the role its ``reward_model.json`` names (``saved_as_critic``) or by its
    place, the critic folder of a step-3 output (its actor, or its training_args.json, beside it); a folder with a
    training_args.json of its own is step 2's output. Else it may be either (a critic that an older dschat saved
    elsewhere): it was called "a reward model (step 2's output)" whatever it was."""
    from dschat.models.reward_model import saved_as_critic
    from dschat.run_layout import ACTOR_DIR, CRITIC_DIR, RUN_ARGS_FILE

    folder = os.path.abspath(path)
    step_output = os.path.dirname(folder)
    placed = os.path.basename(folder) == CRITIC_DIR and any(os.path.exists(os.path.join(step_output, name))
                                                            for name in (ACTOR_DIR, RUN_ARGS_FILE))
    if placed or saved_as_critic(folder):
        return CRITIC_KIND
    if os.path.isfile(os.path.join(folder, RUN_ARGS_FILE)):
        return "a reward model (step 2's output)"
    return "a reward model or critic (a value-head model)"


def critic_given_as_reward_model(name_or_path):
    """What is wrong with scoring by ``name_or_path`` (a folder, tiny preset or hub name given as the reward model)
    when it is step 3's critic, else None: saved with a reward model's files it scores as one, though its head learned
    PPO's value estimates. Step 3 and the tools (rw_eval, ppo_eval) warn of it in these same words."""
    from dschat.models.reward_model import reward_model_folder

    if value_model_kind(reward_model_folder(name_or_path)) != CRITIC_KIND:
        return None
    return (f"{name_or_path}: {CRITIC_KIND}, not a reward model: it scores with PPO's value estimates, not step 2's "
            "rewards (step 2's output folder, e.g. train.py's <output>/step2_rm, holds the reward model)")


def load_causal_lm(model_name_or_path, tokenizer, ds_config=None, dropout=None, dtype=None):
    """A policy (SFT model, actor, reference, DPO policy); not a reward model (``check_not_a_reward_model``)."""
    check_not_a_reward_model(model_name_or_path)
    return create_hf_model(AutoModelForCausalLM, model_name_or_path, tokenizer, ds_config, dropout=dropout,
                           dtype=dtype)


def check_fits_before_loading(path, length, what):
    """``check_sequence_fits`` of the model at ``path`` from its config alone (``model_skeleton``), before it loads (a
    tool's too-short model was refused only once it had loaded); a config that cannot be read alone is left to the
    loaded model's check."""
    skeleton = model_skeleton(path)
    if skeleton is not None:
        check_sequence_fits(skeleton, length, what, warn=False)


def check_sequence_fits(model, length, flags, warn=True):
    """A clear error when sequences of ``length`` tokens (``flags`` name where it comes from) are longer than the
    model's position table (learned or precomputed); a warning for other position schemes (unless not ``warn``)."""
    from dschat.models.positions import position_limit, position_table
    from dschat.utils.dist import print_rank_0

    limit = position_limit(model)
    if limit is None or length <= limit:
        return
    table = position_table(model)
    if table is not None:
        raise UsageError(f"{flags} = {length} tokens, but the model has a table of {limit} {table} positions: "
                         f"make it at most {limit}")
    if warn:
        print_rank_0(f"warning: {flags} = {length} tokens is past the {limit} positions the model was configured for")


def model_skeleton(name_or_path):
    """The causal LM of a model's config on the meta device (no weights, no memory), for the checks that read its
    layout before it loads; None when transformers cannot build one from the config alone."""
    try:
        config = hub_load(AutoConfig.from_pretrained, resolve_model_path(name_or_path))
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError, OSError):
        return None

