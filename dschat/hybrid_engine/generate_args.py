"""HF ``generate``'s arguments as the hybrid engine takes them: what a call leaves out comes, as in HF, from a
``generation_config`` argument, then the model's generation_config, then HF's defaults; what this decode cannot do
(beams, several sequences per prompt, logits processors it does not have) is an error, never ignored; and counts and
filters are checked as HF checks them, before the engine changes any state.
"""
import copy
import dataclasses
import numbers

import torch

from dschat.errors import UsageError
from dschat.models.loading import token_id_list

# HF generate kwargs that DeepSpeed-Chat-style callers pass and that change nothing here (ranks are kept in step
# automatically; the static cache is always used), and the values of HF's others that leave its output as this
# engine's. Any other kwarg or value would change what HF returns, and is an error rather than ignored.
# early_stopping: a beam-search setting; bos_token_id: HF's prompt when none is given (here one always is);
# renormalize_logits: HF's output scores only (its tokens are sampled from the softmax of the processed logits anyway)
NO_OP_HF_KWARGS = {"synced_gpus", "use_cache", "early_stopping", "bos_token_id", "renormalize_logits"}
NO_OP_VALUES = {"num_beams": 1, "num_return_sequences": 1, "length_penalty": 1.0, "no_repeat_ngram_size": 0,
                "typical_p": 1.0, "num_beam_groups": 1, "diversity_penalty": 0.0, "epsilon_cutoff": 0.0,
                "eta_cutoff": 0.0, "min_p": 0.0, "guidance_scale": 1.0, "encoder_repetition_penalty": 1.0}
# Settings a model's generation_config may carry that HF's generate applies (logits processors, stopping criteria, the
# output's type) and this decode does not: set (not None, False or empty), they are refused as the call's own are.
UNSUPPORTED_GENERATION_CONFIG = ("suppress_tokens", "begin_suppress_tokens", "bad_words_ids", "force_words_ids",
                                 "constraints", "sequence_bias", "forced_eos_token_id",
                                 "exponential_decay_length_penalty", "max_time", "stop_strings", "token_healing",
                                 "watermarking_config", "top_h", "dola_layers", "penalty_alpha",
                                 "return_dict_in_generate")
HF_DEFAULT_NEW_TOKENS = 20  # what HF generates when neither the call nor the generation_config gives a length
# HF's defaults of the decoding settings where the model's generation_config sets nothing (the repetition penalty
# applies to greedy decoding too)
HF_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}


@dataclasses.dataclass
class GenerateSettings:
    """One call's decoding settings, resolved and checked."""

    attention_mask: torch.Tensor
    max_new_tokens: int
    min_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    eos_list: list
    pad_token_id: int


def resolve_settings(input_ids, attention_mask, generation_config, *, max_new_tokens=None, max_length=None,
                     min_new_tokens=None, min_length=None, do_sample=None, temperature=None, top_k=None, top_p=None,
                     repetition_penalty=None, eos_token_id=None, pad_token_id=None, default_eos=None, default_pad=None,
                     max_positions=None):
    """The call's settings for LEFT-padded ``input_ids`` (on the decode's device): each given one, else
    ``generation_config``'s, else HF's default. EOS and pad ids: the call's, else ``generation_config``'s (e.g.
    Qwen2.5-Instruct's two EOS ids), else ``default_eos``/``default_pad`` (the engine's tokenizer's), else pad = the
    first EOS. ``max_positions``: the model config's ``max_position_embeddings``, which caps HF's default length."""
    max_new_tokens, max_length = token_counts(max_new_tokens=max_new_tokens, max_length=max_length)
    # HF adds no minimum for a count <= 0: TRL's PPO examples pass min_length=-1
    min_new_tokens, min_length = token_counts(min_new_tokens=min_new_tokens, min_length=min_length, minimum=None)
    prompt_len = input_ids.shape[1]
    eos_list = token_id_list(first_not_none(eos_token_id, getattr(generation_config, "eos_token_id", None),
                                            default_eos))
    pad_token_id = first_not_none(pad_token_id, getattr(generation_config, "pad_token_id", None), default_pad,
                                  eos_list[0] if eos_list else None)
    pad_known = pad_token_id is not None
    pad_token_id = int(pad_token_id) if pad_known else 0  # no EOS either: no row ever ends, nothing is padded
    if do_sample is None:
        do_sample = bool(getattr(generation_config, "do_sample", False))
    temperature, top_k, top_p = (_from_config(name, value, generation_config) for name, value in
                                 (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)))
    repetition_penalty = float(_from_config("repetition_penalty", repetition_penalty, generation_config))
    check_repetition_penalty(repetition_penalty)
    if do_sample:  # greedy reads none of them
        check_temperature(temperature)
        top_k = 0 if _is_zero(top_k) else top_k  # HF's rule: any zero (TRL's PPO examples pass 0.0) is no top-k
        check_top_k_top_p(top_k, top_p)
    if attention_mask is None:
        attention_mask = default_attention_mask(input_ids, pad_token_id, eos_list) if pad_known \
            else torch.ones_like(input_ids)
    attention_mask = attention_mask.to(input_ids.device)
    check_left_padded(attention_mask)
    return GenerateSettings(
        attention_mask=attention_mask,
        max_new_tokens=resolve_max_new_tokens(max_new_tokens, max_length, prompt_len, generation_config,
                                              max_positions),
        min_new_tokens=resolve_min_new_tokens(min_new_tokens, min_length, prompt_len, generation_config),
        do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
        repetition_penalty=repetition_penalty, eos_list=eos_list, pad_token_id=pad_token_id)


def check_left_padded(attention_mask):
    """Prompts must be LEFT-padded: a row whose mask ends in 0 (right padding, a tokenizer's default) would have its
    first answer token predicted from a pad's position, a wrong answer that nothing else reports. A row with no real
    token (an empty prompt) and a gap inside a row pass."""
    mask = attention_mask.bool()
    right_padded = ~mask[:, -1] & mask.any(-1)
    if bool(right_padded.any()):
        rows = right_padded.nonzero().flatten().tolist()
        raise ValueError(f"the prompts must be LEFT-padded, but row(s) {rows[:8]} of the attention mask end with "
                         "padding (right-padded: the answer would follow a pad token); tokenize them with "
                         "padding_side='left' (dschat: load_tokenizer(path, padding_side='left'))")


def left_padded_lengths(attention_mask):
    """(B,) each row's count of real tokens where every row's are its last columns, at least one (left padding
    only), else None (no mask, an empty prompt, a hole in a row): what a row without its padding is."""
    if attention_mask is None:
        return None
    mask = attention_mask.long()
    lengths = mask.sum(1)
    trailing = mask.flip(1).cumprod(1).sum(1)  # real tokens before the first pad from the right
    return lengths if bool(((trailing == lengths) & (lengths > 0)).all()) else None


def resolve_max_new_tokens(max_new_tokens, max_length, prompt_len, generation_config, max_positions=None):
    """New tokens to generate: given, else from ``max_length`` (a total), else as the model's generation_config says,
    else HF's default of 20 (prompt + 20 cut at ``max_positions``, HF's rule); the engine holds them to
    ``max_out_tokens``."""
    if max_new_tokens is None and max_length is None:
        max_new_tokens = getattr(generation_config, "max_new_tokens", None)
        max_length = getattr(generation_config, "max_length", None) if max_new_tokens is None else None
    if max_new_tokens is None and max_length is None:
        max_length = prompt_len + HF_DEFAULT_NEW_TOKENS
        max_length = min(max_length, max_positions) if max_positions else max_length
    if max_new_tokens is None:
        max_new_tokens = max_length - prompt_len
    if max_new_tokens < 0:
        raise ValueError(f"max_length {max_length} is shorter than the prompt ({prompt_len} tokens)")
    if max_new_tokens == 0:  # HF refuses it too (GenerationConfig's check, or a max_length the prompt fills)
        raise ValueError(f"no new tokens to generate: max_new_tokens must be greater than 0 (max_length "
                         f"{max_length}, a prompt of {prompt_len} tokens)" if max_length is not None else
                         "max_new_tokens must be greater than 0, got 0")
    return max_new_tokens


def resolve_min_new_tokens(min_new_tokens, min_length, prompt_len, generation_config):
    """New tokens before EOS may end a row: given, else from ``min_length`` (a total), else the generation_config's;
    at least 0 (HF adds no minimum for a count <= 0)."""
    if min_new_tokens is None and min_length is None:
        min_new_tokens = getattr(generation_config, "min_new_tokens", None)
        min_length = getattr(generation_config, "min_length", None) if min_new_tokens is None else None
    if min_new_tokens is None:
        min_new_tokens = min_length - prompt_len if min_length is not None else 0
    return max(0, min_new_tokens)


def check_hf_kwargs(kwargs):
    """HF kwargs this decode cannot honour are errors; None, False and the values that change nothing pass."""
    for key, value in kwargs.items():
        empty = value is None or value is False or (isinstance(value, (list, tuple, dict)) and not value)
        if key in NO_OP_HF_KWARGS or empty or NO_OP_VALUES.get(key, object()) == value:
            continue
        raise ValueError(f"HybridEngine.generate does not support {key}={value!r}: its decode is greedy or "
                         "sampled (temperature, top-k, top-p), one sequence per prompt; generate with the HF "
                         "model for this")


def merged_generation_config(own, given=None):
    """The generation_config HF's ``generate`` reads: the model's ``own`` under ``given`` (a call's
    ``generation_config``), whose set values win, as in HF."""
    if given is None:
        return own
    merged = copy.deepcopy(given)
    if own is not None:
        merged.update(**own.to_dict(), defaults_only=True, allow_custom_entries=True)
    return merged


def check_generation_config(hf_kwargs, generation_config):
    """The model's generation_config may set what HF's ``generate`` applies and this decode does not (e.g.
    ``no_repeat_ngram_size``; its ``repetition_penalty`` is applied): an error, as for the call's own kwargs,
    unless the call overrides it (HF's rule: the call's value wins)."""
    checks = [*NO_OP_VALUES.items(), *((key, None) for key in UNSUPPORTED_GENERATION_CONFIG)]
    for key, no_op in checks:
        value = getattr(generation_config, key, None)
        empty = value is None or value is False or (isinstance(value, (list, tuple, dict, str)) and not value)
        if key in hf_kwargs or empty or value == no_op:
            continue
        raise UsageError(f"the model's generation_config sets {key}={value!r}, which HF's generate applies and "
                         f"the hybrid engine's decode does not: pass {key}={no_op!r} to generate without it, set "
                         f"it to {no_op!r} in the model's generation_config.json (step 3: in the actor's folder), "
                         "or generate without the hybrid engine")


def _is_integer(value):
    """An int-like count (numpy and 0-d integer tensors included; not a bool, not a float such as 4.0)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, numbers.Integral) or (torch.is_tensor(value) and value.numel() == 1
                                                   and not value.is_floating_point() and value.dtype != torch.bool)


def token_counts(minimum=0, **counts):
    """The call's token counts as ints (None stays None), checked: integers, not below ``minimum`` (None: any; a float
    such as 4.0 failed deep in the decode loop; a negative max_new_tokens was reported as a max_length shorter than
    the prompt)."""
    for name, value in counts.items():
        if value is not None and (not _is_integer(value) or (minimum is not None and value < minimum)):
            raise ValueError(f"{name} has to be an integer" + (f" >= {minimum}" if minimum is not None else "")
                             + f", got {value!r}")
    return [None if value is None else int(value) for value in counts.values()]


def _is_zero(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == 0


def check_top_k_top_p(top_k, top_p):
    """A sampled generation's filters, as HF checks them (a top_k <= 0 is no top-k, as the --top_k flag's): top_k an
    integer (a float or a string failed deep in torch), top_p not negative (it sampled greedily)."""
    if not _is_integer(top_k):
        raise ValueError(f"top_k has to be an integer (0: no top-k filtering), got {top_k!r}")
    if not top_p >= 0:
        raise ValueError(f"top_p has to be in [0, 1] (1: no nucleus filtering), got {top_p!r}")


def check_temperature(temperature):
    """HF's rule: strictly positive (NaN too is refused: it sampled token 0 at every step, with NaN log-probs)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")


def check_repetition_penalty(penalty):
    """HF's rule: a strictly positive penalty (1.0: none)."""
    if not penalty > 0:
        raise ValueError(f"repetition_penalty has to be strictly positive, got {penalty}")


def _from_config(name, value, generation_config):
    """A sampling setting as HF resolves it: the argument, else the model's generation_config, else HF's default."""
    return first_not_none(value, getattr(generation_config, name, None), HF_SAMPLING_DEFAULTS[name])


def first_not_none(*values):
    for v in values:
        if v is not None:
            return v
    return None


def default_attention_mask(input_ids, pad_token_id, eos_list):
    """HF's rule: mask pad tokens when padding is recognisable (pad present and not an EOS id), else attend to all."""
    if pad_token_id not in eos_list and bool((input_ids == pad_token_id).any()):
        return (input_ids != pad_token_id).long()
    return torch.ones_like(input_ids)


# generation_config entries that leave the decoded tokens as they are (ids the callers give, bookkeeping, caching,
# what is returned), and the settings that only sampling reads
NOT_DECODING_SETTINGS = {"bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id",
                         "transformers_version", "_from_model_config", "use_cache", "cache_implementation",
                         "cache_config", "return_dict_in_generate", "output_scores", "output_logits",
                         "output_attentions", "output_hidden_states"}
SAMPLING_ONLY_SETTINGS = {"temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
                          "top_h"}


def settings_from_generation_config(generation_config, call_kwargs):
    """{setting: value} of a model's ``generation_config`` that HF's ``generate`` applies to a call with
    ``call_kwargs``: set there (not HF's default), not given by the call, and read by its decoding (the sampling
    ones only where it samples; ``max_length`` not beside a ``max_new_tokens``). E.g. Qwen2.5-Instruct's
    repetition_penalty 1.05 under a tool's --temperature: the tools, as step 3, give only the settings they have
    flags for, where TRL and OpenRLHF give every one."""
    if generation_config is None:
        return {}
    sampled = call_kwargs.get("do_sample", getattr(generation_config, "do_sample", False))
    ignored = NOT_DECODING_SETTINGS | set(call_kwargs) | (set() if sampled else SAMPLING_ONLY_SETTINGS | {"do_sample"})
    if "max_new_tokens" in call_kwargs:
        ignored.add("max_length")
    no_op = {**NO_OP_VALUES, "repetition_penalty": 1.0, "min_new_tokens": 0, "min_length": 0, "temperature": 1.0}
    return {key: value for key, value in generation_config.to_diff_dict().items()
            if key not in ignored and not key.startswith("_") and not _is_unset(value)
            and (key not in no_op or value != no_op[key])}


def _is_unset(value):
    """None, False or empty: a setting that changes nothing."""
    return value is None or value is False or (isinstance(value, (list, tuple, dict, str)) and not value)


def generation_config_note(model, call_kwargs, whose, applies_to, setter):
    """The sentence saying what ``model``'s generation_config applies to a call with ``call_kwargs`` that no flag
    sets (``settings_from_generation_config``; ``setter``: whose flags do not), None where it applies nothing: the
    tools' and step 3's one wording."""
    settings = settings_from_generation_config(getattr(model, "generation_config", None), call_kwargs)
    if not settings:
        return None
    said = ", ".join(f"{key}={value!r}" for key, value in settings.items())
    return (f"{whose} generation_config applies {said}{applies_to} (no {setter} sets it; edit its "
            "generation_config.json to generate without it)")
