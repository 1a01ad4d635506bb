"""Reward model / critic: a value head on a base transformer, scored at each sequence's last real token."""
import copy
import functools
import json
import logging
import math
import os
import re

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModel

from dschat.compat import (backbone_ignoring_lm_head, checkpointing_enable_call, disable_activation_checkpointing,
                           zero3_loads_initialize_per_module)
from dschat.errors import UsageError
from dschat.models.left_padding import warn_once_of_left_padding
from dschat.report import counted

VALUE_HEAD_FILE = "value_head.safetensors"
REWARD_META_FILE = "reward_model.json"
# Its "version": a file of a later version (a newer dschat's) may mean what this one cannot read, and is refused.
REWARD_META_VERSION = 1
# Its key for the (mean, std) a saved scorer divides its scores by (``RewardModel.score_normalization``).
SCORE_NORMALIZATION_KEY = "score_normalization"
# ... and for the pad id a *ForSequenceClassification scorer skips at the end of a row (``RewardModel.score_index``).
SCORE_SKIPS_KEY = "score_skips_token_id"
# ... and for what the model was trained as, where it is step 3's critic ("critic"): its files are a reward model's, and
# one saved from a notebook (``save_reward_model``) has no step-3 folder around it to be known by (``value_model_kind``)
ROLE_KEY, CRITIC_ROLE = "role", "critic"
# DeepSpeed-Chat's step 2 saves its RewardModel whole in one pytorch_model.bin: the backbone's weights under its
# attribute's name (misspelt there), the head as "v_head.weight".
DS_CHAT_WEIGHTS_FILE = "pytorch_model.bin"
DS_CHAT_BACKBONE_PREFIX = "rwtranrsformer."
DS_CHAT_HEAD_KEY = "v_head.weight"
# transformers' *ForSequenceClassification with one label (TRL's RewardTrainer saves reward models so; the
# score of a sequence is its last real token's, as here): the head is "score", a Linear without bias on the backbone.
SEQ_CLS_HEAD_KEY = "score.weight"
# OpenRLHF's reward models and critics: the backbone under its base_model_prefix, the head a Linear without bias named
# by config.json's "value_head_prefix" ("score"; "value_head" in older releases, which did not record it); with
# "normalize_reward", a score is (score - mean) / std, the mean and std of step 2's eval scores, also in config.json.
OPENRLHF_ARCHITECTURES = ("RewardModel", "CriticModel")
OPENRLHF_HEAD_KEYS = ("score.weight", "value_head.weight")
OPENRLHF_CONFIG_KEYS = ("value_head_prefix", "normalize_reward", "mean", "std")
VALUE_HEAD_FILES = (f"{VALUE_HEAD_FILE}, DeepSpeed-Chat's {DS_CHAT_HEAD_KEY} in {DS_CHAT_WEIGHTS_FILE}, the "
                    f"{SEQ_CLS_HEAD_KEY} of a one-label *ForSequenceClassification, or an OpenRLHF reward model's "
                    "value head")

# How ``value_head_width`` chose the head's width, as ``_check_head_width`` says it where the hidden states differ.
HEAD_WIDTH_SOURCES = {
    "trained head": "the width of the trained value head loaded into it, which equals its config's hidden size, so "
                    "the width was not measured (a head saved from the config's width, not from these hidden states)",
    "measured": "the width measured when the head was built (a forward of an empty copy of the backbone on the meta "
                "device), which this forward does not agree with",
    "config": "its config's hidden size, taken where the forward that measures the width (an empty copy of the "
              "backbone on the meta device) failed when the head was built",
}

logger = logging.getLogger(__name__)


def last_token_index(attention_mask):
    """Index of each row's last real token, right for left padding, right padding and pad == EOS."""
    length = attention_mask.shape[1]
    return length - 1 - attention_mask.long().flip(1).argmax(dim=1)


def positions_from_mask(attention_mask):
    """Position ids that ignore left padding (0 at each row's first real token)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def pairwise_loss(chosen_scores, rejected_scores, margin=None):
    """-log sigmoid(r_chosen - r_rejected - margin), averaged over pairs; ``margin`` (one per pair, None: 0) asks the
    chosen answer to score that much above the rejected one (TRL's RewardTrainer, from Llama 2's margin loss)."""
    difference = chosen_scores - rejected_scores
    if margin is not None:
        if margin.shape != difference.shape:  # (broadcast, a wrong one would shift every pair by every margin)
            raise ValueError(f"pairwise_loss: {tuple(margin.shape)} margins for {tuple(difference.shape)} pairs: give "
                             "one margin per pair")
        difference = difference - margin.to(difference)
    return -F.logsigmoid(difference).mean()


def check_backbone(base_model):
    """``RewardModel``'s ``base_model`` is a backbone (``AutoModel``'s, as DeepSpeed-Chat's ``create_critic_model``
    loads it): a causal LM (step 1's output loaded with ``AutoModelForCausalLM``) gives its LM head's logits, not
    hidden states, and the value head failed on them at the first forward ("mat1 and mat2 shapes cannot be
    multiplied (20x1008 and 128x1)")."""
    head = getattr(base_model, "get_output_embeddings", None)
    if head is not None and head() is not None:
        raise UsageError(f"RewardModel(base_model, ...): base_model is a {type(base_model).__name__}, a model with an "
                         "LM head, whose outputs are logits over its vocabulary, not the hidden states the value head "
                         "reads: give its backbone, AutoModel.from_pretrained(path) (as create_critic_model loads it) "
                         "or model.base_model")


class ValueHead(nn.Linear):
    """Linear(hidden, 1) without bias; ``fp32`` (--compute_fp32_loss) computes it in fp32 from low-precision hidden
    states. Inside the module's own forward, so that ZeRO-3's hooks have gathered a partitioned weight first."""

    def __init__(self, hidden_size, fp32=False):
        super().__init__(hidden_size, 1, bias=False)
        self.fp32 = fp32

    def forward(self, hidden):
        if self.fp32:
            return F.linear(hidden.float(), self.weight.float())
        return super().forward(hidden)


class RewardModel(nn.Module):
    """``base_model`` is an HF backbone (``AutoModel``), possibly PEFT-wrapped; the head is Linear(hidden, 1).
    DeepSpeed-Chat's arguments, in its order: ``tokenizer`` is taken and not read (DeepSpeed-Chat finds each
    sequence's end by its pad id; dschat by the attention mask), so ``RewardModel(base, tokenizer)`` ported from it
    does not pass the tokenizer as ``compute_fp32_loss``. ``trained_head_width``: the width of the trained head that
    will be loaded into it (``from_pretrained``), which spares measuring the backbone's (``value_head_width``)."""

    def __init__(self, base_model, tokenizer=None, num_padding_at_beginning=0, compute_fp32_loss=False, *,
                 trained_head_width=None):
        super().__init__()
        check_backbone(base_model)
        self.value_head_loaded = False  # from_pretrained: whether the folder held a trained head
        self.embedding_rows_loaded = None  # from_pretrained: the checkpoint's, before any growth
        # (mean, std) a frozen scorer's values are normalized by (an OpenRLHF reward model's), else None
        self.score_normalization = None
        # the pad id transformers' *ForSequenceClassification skips to find the scored token (a TRL reward model loaded
        # to score: ``score_index``), else None
        self.score_skips_token_id = None
        self.trained_as_critic = False  # step 3's engine sets it on its critic: saved with it (ROLE_KEY)
        self.config = base_model.config
        width, self.head_width_source = value_head_width(base_model, trained_head_width)
        self.v_head = ValueHead(width, fp32=compute_fp32_loss)
        self.rwtransformer = base_model
        # Kept for DeepSpeed-Chat compatibility; the end token comes from the attention mask instead.
        self.num_padding_at_beginning = num_padding_at_beginning

    @property
    def compute_fp32_loss(self):
        return self.v_head.fp32

    @compute_fp32_loss.setter
    def compute_fp32_loss(self, value):
        self.v_head.fp32 = value

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        # (DeepSpeed-Chat's call on the critic, or its engine's, forwarded here: dschat's non-reentrant default, as
        # the actor's, not transformers' reentrant one)
        checkpointing_enable_call(self.rwtransformer, gradient_checkpointing_kwargs)

    def gradient_checkpointing_disable(self):
        disable_activation_checkpointing(self.rwtransformer)

    def token_values(self, input_ids, attention_mask, use_cache=False, position_ids=None, **kwargs):
        """Per-token values, shape (B, T). Positions count real tokens only; with no ``attention_mask`` (rows that start
        at column 0, see dschat/rlhf/layout.py) they are the model's default, 0, 1, ..."""
        if position_ids is None and attention_mask is not None:
            position_ids = positions_from_mask(attention_mask)
        self._warn_of_left_padding(attention_mask)
        out = self.rwtransformer(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 use_cache=use_cache, **kwargs)
        self._check_head_width(out[0])
        values = self.v_head(out[0]).squeeze(-1)
        if self.score_normalization is not None:
            mean, std = self.score_normalization
            values = (values - mean) / std
        return values

    def _warn_of_left_padding(self, attention_mask):
        """Said once per family (``LEFT_PADDING_MOVES_SCORES``) where its rows come left-padded; for other families a
        dictionary look-up, and no host sync."""
        warn_once_of_left_padding(
            self, attention_mask, "the reward model or critic", "scores left-padded rows otherwise than the rows alone",
            "dschat left-pads its rows in step 3 with --padded_forwards (its experience, training forwards and "
            "held-out reward_mean); step 2, step 3's default forwards and held-out evaluation, and rw_eval give it "
            "rows that start at their first token")

    def _check_head_width(self, hidden):
        """A ``UsageError`` where the backbone's hidden states are not as wide as the value head (its width taken from
        the config, unmeasured: ``HEAD_WIDTH_SOURCES``), rather than a matmul's shape error."""
        if hidden.shape[-1] != self.v_head.in_features:
            raise UsageError(f"{type(self.rwtransformer).__name__}'s hidden states are {hidden.shape[-1]} wide, but "
                             f"the value head reads {self.v_head.in_features}: "
                             f"{HEAD_WIDTH_SOURCES[self.head_width_source]}. dschat cannot make a reward model or "
                             "critic of this model: give another (--model_name_or_path in step 2, "
                             "--critic_model_name_or_path or --reward_model_name_or_path in step 3)")

    def forward(self, input_ids, attention_mask, margin=None, **kwargs):
        """DeepSpeed-Chat's convention: the first half of the batch is chosen, the second half rejected. ``margin``:
        each pair's (the collator's), subtracted from the score difference in the loss (``pairwise_loss``)."""
        if input_ids.shape[0] % 2:
            raise ValueError(f"RewardModel.forward takes pairs: the chosen answers then as many rejected ones, a "
                             f"batch of even size (this one has {counted(input_ids.shape[0], 'row')}); score single "
                             "answers with end_scores or forward_value")
        scores = self.end_scores(input_ids, attention_mask, **kwargs)
        half = input_ids.shape[0] // 2
        chosen, rejected = scores[:half], scores[half:]
        return {"loss": pairwise_loss(chosen.float(), rejected.float(), margin),
                "chosen_mean_scores": chosen, "rejected_mean_scores": rejected}

    def end_scores(self, input_ids, attention_mask, **kwargs):
        if attention_mask is None:  # (DeepSpeed-Chat's forward takes None: it finds each end by the pad id)
            raise ValueError("RewardModel scores each row at its last real token, which it finds by the "
                             "attention_mask: give it (a tokenizer's output has it)")
        values = self.token_values(input_ids, attention_mask, **kwargs)
        return values.gather(1, self.score_index(input_ids, attention_mask)[:, None]).squeeze(1)

    def score_index(self, input_ids, attention_mask):
        """The position each row is scored at: its last real token (``last_token_index``: the answer's EOS, where
        dschat, DeepSpeed-Chat and OpenRLHF train the head). A *ForSequenceClassification loaded to score (TRL's reward
        models) scores where transformers does, at the last real token that is not its pad id
        (``score_skips_token_id``): with pad == EOS, the token before the answer's EOS, where TRL trained it."""
        if self.score_skips_token_id is None or input_ids is None:
            return last_token_index(attention_mask)
        kept = attention_mask.bool() & (input_ids != self.score_skips_token_id)
        kept = torch.where(kept.any(1, keepdim=True), kept, attention_mask.bool())  # (a row of pads alone)
        return last_token_index(kept)

    def forward_value(self, input_ids=None, attention_mask=None, past_key_values=None, position_ids=None,
                      head_mask=None, inputs_embeds=None, return_value_only=False, prompt_length=0,
                      use_cache=False):
        """Per-token values and the score at each row's last real token (DeepSpeed-Chat's critic API)."""
        values = self.token_values(input_ids, attention_mask, use_cache=use_cache, position_ids=position_ids)
        if return_value_only:
            return values
        if attention_mask is None:
            raise ValueError("forward_value needs the attention_mask to find each row's last token "
                             "(or return_value_only=True)")
        end = values.gather(1, self.score_index(input_ids, attention_mask)[:, None]).squeeze(1)
        return {"values": values, "chosen_end_scores": end}

    def apply_lora(self, lora_dim, module_name, lora_alpha, only_optimize_lora, module_name_flag="--lora_module_name"):
        """LoRA adapters on the backbone (``lora.apply_lora``); the value head trains even when only the adapters do
        (it is what makes the backbone a reward model, new in step 2)."""
        from dschat.models.lora import apply_lora

        self.rwtransformer = apply_lora(self.rwtransformer, lora_dim, module_name, lora_alpha,
                                        only_optimize_lora=only_optimize_lora, module_name_flag=module_name_flag)
        if lora_dim and only_optimize_lora:
            self.v_head.requires_grad_(True)
        return self

    # --- saving and loading -------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path, tokenizer=None, compute_fp32_loss=False, dropout=None, dtype=None,
                        ds_config=None, rlhf_training=False, new_head_expected=False, normalize_scores=False,
                        min_embedding_rows=0):
        """Load a trained reward model (a folder or hub name of a layout ``is_reward_model_folder`` knows: step 2's,
        DeepSpeed-Chat's, TRL's, OpenRLHF's) or a plain HF model (value head newly made, with a warning unless
        ``new_head_expected``: as transformers warns of a new classification head, its scores mean nothing until step 2
        trains it). ``normalize_scores``: a frozen scorer keeps an OpenRLHF reward model's normalization
        (``score_normalization``); a model to train (a critic, step 2's) starts from the raw scores.
        ``min_embedding_rows``: with ``tokenizer``, the embeddings are grown to at least these rows (step 3's actor's:
        every id the actor can sample has one); ``embedding_rows_loaded`` keeps the checkpoint's."""
        from dschat.models.loading import (adapter_message, check_same_config_on_every_rank, check_weights_loaded,
                                           configure_dropout, embedding_rows, hub_load, load_dtype,
                                           model_load_context, readable_weights, sync_special_tokens)

        name, path = path, reward_model_folder(path)
        if os.path.isdir(path) and (adapter := adapter_message(path)):  # (transformers would load the adapter on it)
            raise UsageError(adapter)
        saved_reward_meta(path)  # (a newer dschat's file: refused before the backbone loads)
        config = configure_dropout(hub_load(AutoConfig.from_pretrained, path), dropout)
        if ds_config is not None:  # (a training load: every rank loads the model)
            check_same_config_on_every_rank(name, config)
        keep_alive = model_load_context(ds_config)  # noqa: F841
        torch_dtype = load_dtype(dtype, ds_config)
        ds_chat_file = ds_chat_reward_weights(path)
        renamed = {"key_mapping": {f"^{re.escape(DS_CHAT_BACKBONE_PREFIX)}": ""}} if ds_chat_file else {}
        score_heads = [key.rsplit(".", 1)[0] for key in score_head_keys(_config_dict(path))]  # (OpenRLHF's)
        with readable_weights(path), backbone_ignoring_lm_head(config, score_heads), \
                zero3_loads_initialize_per_module():
            backbone, loading = AutoModel.from_pretrained(path, config=config, dtype=torch_dtype,
                                                          output_loading_info=True, **renamed)
        check_weights_loaded(name, backbone, loading)
        head = trained_value_head(path, ds_chat_file)
        model = cls(backbone, compute_fp32_loss=compute_fp32_loss,
                    trained_head_width=None if head is None else head.shape[-1])
        model.value_head_loaded = head is not None  # else a new random head (a critic may start so)
        if model.value_head_loaded:
            model.v_head.load_state_dict({"weight": checked_head_shape(head, model, name, path, ds_chat_file)})
        elif not new_head_expected:
            logger.warning("%s has no trained value head (%s): the head is new and random, so its scores mean nothing "
                           "until step 2 trains it; to score, load step 2's output folder", name, VALUE_HEAD_FILES)
        model.v_head.to(backbone.dtype)
        # (a head dschat or DeepSpeed-Chat saved was trained here, on raw scores: a config's old statistics are not its;
        # a normalizing scorer dschat saved as it was loaded keeps its own, in reward_model.json)
        from_score_head = head is not None and not ds_chat_file and not os.path.exists(os.path.join(path,
                                                                                                 VALUE_HEAD_FILE))
        normalization = score_normalization(path) if from_score_head else saved_score_normalization(path)
        for key in OPENRLHF_CONFIG_KEYS:  # (held by ``score_normalization`` if kept: not in a saved copy's config)
            backbone.config.__dict__.pop(key, None)
        if normalization and normalize_scores:
            model.score_normalization = normalization
        elif normalization:
            logger.info("%s: its scores are normalized by mean %.4g and std %.4g when it scores; trained here, it "
                        "starts from the raw scores", name, *normalization)
        skips = sequence_classification_pad_id(path, config) if from_score_head else saved_score_skips(path)
        if skips is not None and normalize_scores:
            model.score_skips_token_id = skips
        elif skips is not None:
            logger.info("%s: it scores a row at its last token that is not its pad id %d when it scores "
                        "(transformers' *ForSequenceClassification); trained here, at each row's last token", name,
                        skips)
        model.embedding_rows_loaded = embedding_rows(backbone)
        if tokenizer is not None:  # (its saved config says the tokenizer's pad and EOS ids, as a policy's does)
            sync_special_tokens(backbone, tokenizer, min_embedding_rows)
        return model

    def save_head_and_meta(self, folder, state_dict):
        from safetensors.torch import save_file

        save_file({"weight": state_dict["v_head.weight"].contiguous()}, os.path.join(folder, VALUE_HEAD_FILE))
        meta = {"format": "dschat-reward-model", "version": REWARD_META_VERSION, "value_head": VALUE_HEAD_FILE}
        if self.score_normalization is not None:  # (a scorer loaded so: saved without it, it would score raw)
            mean, std = self.score_normalization
            meta[SCORE_NORMALIZATION_KEY] = {"mean": mean, "std": std}
        if self.score_skips_token_id is not None:  # (likewise: saved without it, it would score another token)
            meta[SCORE_SKIPS_KEY] = self.score_skips_token_id
        if self.trained_as_critic:
            meta[ROLE_KEY] = CRITIC_ROLE
        with open(os.path.join(folder, REWARD_META_FILE), "w") as f:
            json.dump(meta, f)


def reward_model_folder(name_or_path):
    """The folder of a reward model's files: a folder as is, a tiny preset's, or a hub name's snapshot with its config,
    weights and value-head files (fetched, or read from the hub cache offline): its head can be read, or found
    missing, before any model loads."""
    from dschat.models.loading import hub_model_folder, resolve_model_path

    path = resolve_model_path(name_or_path)
    if os.path.isdir(path):
        return path
    return hub_model_folder(path, extra_files=(VALUE_HEAD_FILE, REWARD_META_FILE))


def has_trained_value_head(name_or_path):
    """Whether a folder, tiny preset or hub name holds a trained reward model (its files read before any model loads):
    without one, its scores would come from a new random head and mean nothing."""
    return is_reward_model_folder(reward_model_folder(name_or_path))


def is_reward_model_folder(path):
    """A step-2 output: dschat's (backbone + ``value_head.safetensors``) or DeepSpeed-Chat's; a one-label
    *ForSequenceClassification (TRL's reward models) or an OpenRLHF reward model."""
    return (os.path.exists(os.path.join(path, VALUE_HEAD_FILE)) or ds_chat_reward_weights(path) is not None
            or score_head_location(path) is not None)


def holds_reward_model(path):
    """``is_reward_model_folder`` of the folder ``path``, read once per state of its files (``folder_files_stamp``): a
    policy is asked at its early check (the steps', train.py's, the tools') and again at its load (step 3's actor twice,
    with its reference), train.py's --reward-model at every check, and a weights file may be opened to list its names.
    A folder whose files cannot be listed now is read as it is."""
    try:
        stamp = folder_files_stamp(path)
    except OSError:
        return is_reward_model_folder(path)
    return _is_reward_model_folder_stamped(os.path.realpath(path), stamp)


def folder_files_stamp(path):
    """(name, size, modification time) of each file of the folder ``path``, sorted: what tells its files changed
    without reading them (a value head saved into it, a config or weights file rewritten)."""
    stamp = []
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.is_file():
                st = entry.stat()
                stamp.append((entry.name, st.st_size, st.st_mtime_ns))
    return tuple(sorted(stamp))


@functools.lru_cache(maxsize=64)
def _is_reward_model_folder_stamped(folder, stamp):
    return is_reward_model_folder(folder)


def _config_dict(path):
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        return {}
    with open(config_file) as f:
        return json.load(f)


def score_head_keys(config):
    """The weight names a saved score head may have, from a folder's config.json (a dict): a one-label
    *ForSequenceClassification's "score.weight", an OpenRLHF reward model's or critic's value head; else ()."""
    architectures = config.get("architectures") or []
    if config.get("value_head_prefix") or any(name in OPENRLHF_ARCHITECTURES for name in architectures):
        prefix = config.get("value_head_prefix")
        return (f"{prefix}.weight",) if prefix else OPENRLHF_HEAD_KEYS
    labels = len(config.get("id2label") or {}) or config.get("num_labels")
    if labels == 1 and any(name.endswith("ForSequenceClassification") for name in architectures):
        return (SEQ_CLS_HEAD_KEY,)
    return ()


def hub_holds_reward_model(name):
    """Whether the hub model ``name`` is a reward model by its config.json (a one-label *ForSequenceClassification of
    a decoder family, OpenRLHF's) or dschat's reward-model file, fetched alone (the weights come when it loads); None
    when its config cannot be fetched (no such model, a gated one; offline: not in the hub cache). DeepSpeed-Chat's
    layout is told by its weights' names only: a folder of it is read, a hub name is not. None too when dschat's file
    is not there for a connection error (``hub_file_known_missing``): a caller that keeps the answer asks again."""
    from dschat.models.loading import hub_file, hub_file_known_missing

    try:
        config_file = hub_file(name, "config.json")
    except OSError:  # (an invalid repo id, a gated repo)
        return None
    if config_file is None:
        return None
    with open(config_file) as f:
        config = json.load(f)
    keys = score_head_keys(config)
    if keys == (SEQ_CLS_HEAD_KEY,) and not _classifier_has(os.path.dirname(config_file), SEQ_CLS_HEAD_KEY):
        return False  # (e.g. an encoder's: its head is "classifier")
    if keys or hub_file(name, REWARD_META_FILE) is not None:
        return True
    return False if hub_file_known_missing(name, REWARD_META_FILE) else None


def _classifier_has(folder, key):
    """Whether transformers' *ForSequenceClassification of the config in ``folder`` has the weight ``key``, built on
    the meta device (no memory, no weights)."""
    from transformers import AutoModelForSequenceClassification

    try:
        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            return key in AutoModelForSequenceClassification.from_config(config).state_dict()
    except (ValueError, KeyError, ImportError, OSError):  # (a family transformers does not know)
        return False


def score_head_location(path):
    """(weights file, key) of the score head saved with the whole model in the folder ``path`` (see
    ``score_head_keys``), else None. Only names are read: an index's weight map, a file's keys."""
    keys = score_head_keys(_config_dict(path))
    return next(filter(None, (_weight_location(path, key) for key in keys)), None)


def _weight_location(path, key):
    """(the file of the folder's weights that holds ``key``, key), else None."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if os.path.isfile(os.path.join(path, index)):
            with open(os.path.join(path, index)) as f:
                file = json.load(f).get("weight_map", {}).get(key)
            return (os.path.join(path, file), key) if file else None
    for name in ("model.safetensors", DS_CHAT_WEIGHTS_FILE):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            return (file, key) if key in _weight_names(file) else None
    return None


def _weight_names(file):
    if file.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(file, "pt") as f:
            return set(f.keys())
    try:
        return set(_load_bin(file).keys())
    except Exception:  # (a damaged file: loading it as a model says so, naming the folder)
        return set()


def _read_weight(location):
    file, key = location
    if file.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(file, "pt") as f:
            return f.get_tensor(key)
    return _load_bin(file)[key]


def _load_bin(file):
    """A .bin's state dict, memory-mapped (one in torch's old, non-zip format cannot be and is read whole)."""
    try:
        return torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError:
        return torch.load(file, map_location="cpu", weights_only=True)


def _score_head(location, path):
    key = location[1]
    # (transformers' decoder families and OpenRLHF's heads have no bias)
    if _weight_location(path, key[:-len("weight")] + "bias"):

        raise UsageError(f"{path}: its score head ({key}) has a bias, which dschat's value head (a Linear without "
                         "bias) cannot hold")
    return _read_weight(location)


def score_normalization(path):
    """(mean, std) that an OpenRLHF reward model saved with "normalize_reward" divides its scores by, else None."""
    config = _config_dict(path)
    if not config.get("normalize_reward") or not score_head_keys(config):
        return None
    return checked_normalization(config.get("mean", 0.0), config.get("std", 1.0), f"{path}: config.json's "
                                 "normalize_reward")


def checked_normalization(mean, std, where):
    """(mean, std) as floats; a UsageError naming ``where`` unless both are finite numbers and std > 0 (NaN: every
    score NaN; 0: every score infinite)."""
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (mean, std)):
        raise UsageError(f"{where} scores (score - mean) / std, whose mean and std must be finite numbers: {mean!r}, "
                         f"{std!r}")
    if not std > 0:
        raise UsageError(f"{where} divides scores by its std, {float(std)}, which must be > 0")
    return float(mean), float(std)


def saved_reward_meta(path):
    """The ``reward_model.json`` that ``save_head_and_meta`` wrote in ``path``, {} where there is none; one of a later
    version than ``REWARD_META_VERSION`` (a newer dschat's) is a UsageError naming it: its keys may mean what this
    dschat would read otherwise, or not at all."""
    from dschat.utils.files import read_json_object

    file = os.path.join(path, REWARD_META_FILE)
    meta = read_json_object(file) or {}
    version = meta.get("version", REWARD_META_VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise UsageError(f"{file}: its \"version\" is {version!r}, not a version number: restore the file")
    if version > REWARD_META_VERSION:
        raise UsageError(f"{file}: version {version} of dschat's reward-model format, newer than this dschat reads "
                         f"(version {REWARD_META_VERSION}): load it with the dschat that saved it, or a newer one")
    return meta


def saved_as_critic(path):
    """Whether ``path`` holds step 3's critic as ``save_reward_model`` saved it (its ``reward_model.json``'s role)."""
    return saved_reward_meta(path).get(ROLE_KEY) == CRITIC_ROLE


def saved_score_normalization(path):
    """(mean, std) that a normalizing scorer (an OpenRLHF reward model loaded to score) was saved with by
    ``save_reward_model``, in its ``reward_model.json``, else None."""
    saved = saved_reward_meta(path).get(SCORE_NORMALIZATION_KEY)
    if saved is None:
        return None
    where = f"{os.path.join(path, REWARD_META_FILE)}'s {SCORE_NORMALIZATION_KEY}"
    if not isinstance(saved, dict):
        raise UsageError(f"{where}: expected {{\"mean\": ..., \"std\": ...}}, got {saved!r}")
    return checked_normalization(saved.get("mean"), saved.get("std"), where)


def sequence_classification_pad_id(path, config):
    """The pad id a one-label *ForSequenceClassification in ``path`` skips to find the token it scores (its config's,
    as saved: transformers scores the last token that is not it), else None (another layout, or no pad id)."""
    if score_head_keys(_config_dict(path)) != (SEQ_CLS_HEAD_KEY,):
        return None
    return config.get_text_config(decoder=True).pad_token_id


def saved_score_skips(path):
    """The pad id a scorer loaded from a *ForSequenceClassification was saved with by ``save_reward_model``, in its
    ``reward_model.json``, else None."""
    saved = saved_reward_meta(path).get(SCORE_SKIPS_KEY)
    if saved is not None and (not isinstance(saved, int) or isinstance(saved, bool) or saved < 0):
        raise UsageError(f"{os.path.join(path, REWARD_META_FILE)}'s {SCORE_SKIPS_KEY}: expected a token id, got "
                         f"{saved!r}")
    return saved


def ds_chat_reward_weights(path):
    """DeepSpeed-Chat's step-2 output in the folder ``path``: its weights file, else None (the keys are read, not
    the tensors: torch maps the file)."""
    file = os.path.join(path, DS_CHAT_WEIGHTS_FILE)
    if not os.path.isfile(file) or os.path.exists(os.path.join(path, VALUE_HEAD_FILE)):
        return None
    try:
        keys = torch.load(file, map_location="cpu", mmap=True, weights_only=True).keys()
    except Exception:  # (a damaged file: loading it as a model says so, naming the folder)
        return None
    return file if DS_CHAT_HEAD_KEY in keys and any(k.startswith(DS_CHAT_BACKBONE_PREFIX) for k in keys) else None


def trained_value_head_location(path, ds_chat_file=None):
    """(file, key) of the value head step 2 saved in ``path`` (dschat's file, or DeepSpeed-Chat's ``ds_chat_file``),
    or of the score head of a one-label *ForSequenceClassification or an OpenRLHF reward model, else None."""
    head_file = os.path.join(path, VALUE_HEAD_FILE)
    if os.path.exists(head_file):
        return head_file, "weight"
    if ds_chat_file:
        return ds_chat_file, DS_CHAT_HEAD_KEY
    return score_head_location(path) if os.path.isdir(path) else None


def trained_value_head(path, ds_chat_file=None):
    """The weight of the head at ``trained_value_head_location``, else None."""
    from dschat.models.loading import readable_weights

    with readable_weights(path):
        location = trained_value_head_location(path, ds_chat_file)
        if location is None:
            return None
        if location[0] in (os.path.join(path, VALUE_HEAD_FILE), ds_chat_file):
            return _read_weight(location)
        return _score_head(location, path)  # (a score head saved with the whole model: checked for a bias)


def checked_head_shape(head, model, name, path, ds_chat_file=None):
    """``head`` (a trained head's saved weight) where it fits ``model.v_head``, the (1, width) head built for the
    backbone; else a UsageError naming where it was saved and both widths, instead of load_state_dict's "size
    mismatch" (a head copied next to another backbone)."""
    if tuple(head.shape) == tuple(model.v_head.weight.shape):
        return head
    file, key = trained_value_head_location(path, ds_chat_file)
    saved = f"{key} in {file}" if key != "weight" else file
    if head.dim() == 2 and head.shape[0] == 1:
        what = f"reads hidden states {head.shape[-1]} wide"
    else:
        what = f"has shape {tuple(head.shape)}, not (1, width) (one score per token)"
    width = model.v_head.in_features
    backbone = (f"its backbone's hidden states are {width} wide" if model.head_width_source == "measured" else
                f"its backbone's config gives {width} as the width of its hidden states")  # (unmeasured)
    raise UsageError(f"{name}: its trained value head ({saved}) {what}, but {backbone}: the head was trained on "
                     "another model (a head file copied next to this one?). Load the folder step 2 saved as it was, "
                     "the head beside the backbone it was trained on, or train a reward model on this backbone "
                     "(step 2)")


def _hidden_size(config):
    for field in ("hidden_size", "n_embd", "d_model"):
        if getattr(config, field, None):
            return getattr(config, field)
    raise ValueError(f"cannot find the hidden size in {type(config).__name__}")


def configured_hidden_width(config):
    """The width of a backbone's last hidden state by its config: OPT's project_out width, else its hidden size (a
    multimodal backbone, e.g. Gemma-3 4B and up, keeps its decoder's sizes in its text config)."""
    text_config = config.get_text_config(decoder=True)
    return getattr(text_config, "word_embed_proj_dim", None) or _hidden_size(text_config)


def value_head_width(backbone, trained_head_width=None):
    """(width, how it was found: a key of ``HEAD_WIDTH_SOURCES``): the width of the hidden states the value head reads.
    A trained head's (``trained_head_width``, from its saved weight's shape) where the config says the same: then
    nothing needs measuring (the probe takes 0.6-0.8 s per 7B config on the CPU, which every load of a reward model or
    critic paid). Else measured (``measured_hidden_width``: Reformer's is twice its config's hidden_size; a head saved
    for another backbone then fails to load on its shape, ``checked_head_shape``), else the config's
    (``configured_hidden_width``)."""
    if trained_head_width is not None and trained_head_width == _configured_width_if_any(backbone.config):
        return trained_head_width, "trained head"
    measured = measured_hidden_width(backbone)
    if measured:
        return measured, "measured"
    return configured_hidden_width(backbone.config), "config"


def _configured_width_if_any(config):
    try:
        return configured_hidden_width(config)
    except ValueError:  # (no width field: only the probe can tell)
        return None


def measured_hidden_width(backbone):
    """The width of ``backbone``'s last hidden state, which the value head reads, from a forward over two tokens through
    an empty copy of it on the meta device (``_meta_copy``, ``_MetaValuesReadAsZero``): the backbone's own weights are
    neither read nor written (RWKV divides some in place at a forward in eval mode), the global RNG is left as it was,
    and it takes no memory and well under a second (the loaded weights' forward took 3-8 s per 7B parameters on the
    CPU); ZeRO-3-partitioned or quantized weights are measured alike. None where the copy cannot be built or run: then
    ``configured_hidden_width``. Reformer's width is two streams concatenated, twice its config's hidden_size, which
    no config field says."""
    try:
        # (RNG forked: Reformer's forward reseeds the global generator where its config sets hash_seed)
        with torch.random.fork_rng(devices=[]), torch.no_grad(), torch.device("meta"), _MetaValuesReadAsZero():
            out = _meta_copy(backbone)(input_ids=torch.zeros((1, 2), dtype=torch.long))
        hidden = out[0]
        return hidden.shape[-1] if torch.is_tensor(hidden) and hidden.dim() == 3 else None
    except Exception:  # noqa: BLE001 (a probe: the config's width stands, and _check_head_width names a mismatch)
        return None


def _meta_copy(backbone):
    """A new instance of ``backbone``'s HF class (under any PEFT wrapper) from a copy of its config, in eval mode, built
    where it is called on the meta device: no weights, no initialization cost."""
    from dschat.models.lora import unwrap_peft

    model = unwrap_peft(backbone)
    return type(model)(copy.deepcopy(model.config)).to(torch.bfloat16).eval()


class _MetaValuesReadAsZero(TorchDispatchMode):
    """A meta tensor has shapes and no values: reading one (``.item()``, ``if tensor:``) raised, and a forward that
    branches on one failed (Reformer's axial position embeddings check the largest position id; transformers' masks
    look for packed rows). Read as 0 instead: the probe needs the forward's shapes, not its values."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return torch.zeros((), dtype=args[0].dtype).item()
        return func(*args, **(kwargs or {}))


def create_critic_model(model_name_or_path, tokenizer, ds_config=None, num_padding_at_beginning=0,
                        rlhf_training=False, dropout=None, zero_stage=0, compute_fp32_loss=False, dtype=None,
                        normalize_scores=False, min_embedding_rows=0):
    """DeepSpeed-Chat's entry point: a reward model / critic from a step-2 folder or any HF model folder
    (``normalize_scores``, ``min_embedding_rows``: see ``RewardModel.from_pretrained``)."""
    model = RewardModel.from_pretrained(model_name_or_path, tokenizer=tokenizer, compute_fp32_loss=compute_fp32_loss,
                                        dropout=dropout, dtype=dtype, ds_config=ds_config, new_head_expected=True,
                                        normalize_scores=normalize_scores, min_embedding_rows=min_embedding_rows)
    model.num_padding_at_beginning = num_padding_at_beginning
    return model


def load_reward_model(path, **kwargs):
    """One call to get the reward model (or critic) that step 2 (or step 3) saved, to score with (an OpenRLHF reward
    model's scores normalized as it saved them); a folder without its trained value head is an error
    (``RewardModel.from_pretrained`` makes a new one)."""
    from dschat.errors import UsageError

    model = RewardModel.from_pretrained(path, new_head_expected=True, normalize_scores=True, **kwargs)
    if not model.value_head_loaded:
        raise UsageError(f"{path}: no trained value head ({VALUE_HEAD_FILES}): not a reward model or critic that step "
                         "2 or 3 saved (RewardModel.from_pretrained makes a new random head for training)")
    return model
