"""How far a model's positions go: the longest sequence it takes as it would a shorter one."""
import torch

# Names of learned absolute position tables (GPT-2's wpe, OPT's embed_positions, GPT-Neo/BioGPT/...'s): an index past
# them fails (an IndexError, a CUDA device-side assert), where rotary or ALiBi positions only drift from what the model
# learned.
LEARNED_POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings")
# Config fields that hold a model's longest sequence, per family (Llama/OPT, GPT-2, others; MPT's max_seq_len).
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "max_seq_len")


def context_limit(config):
    """The longest sequence a model of ``config`` is made for, its context (the first of ``CONTEXT_FIELDS`` it sets;
    a multimodal config's text config's), else None. ``position_limit`` may be shorter (a RoPE scaling's switch)."""
    config = _text_config(config)
    return next((value for value in (getattr(config, name, None) for name in CONTEXT_FIELDS)
                 if isinstance(value, int) and not isinstance(value, bool) and value > 0), None)


def position_limit(*models):
    """The longest run of positions every model takes as it would a shorter one: at most its context
    (``context_limit``: its position table, ``max_position_embeddings``, GPT-2's ``n_positions``) and, with a RoPE
    scaling that depends on the longest position, the length it switches at (LongRoPE's
    ``original_max_position_embeddings``; dynamic NTK keeps a stretched table cached up to its table size, so one
    less). None if no model says."""
    limits = []
    for model in models:
        config = _text_config(getattr(model, "config", None))
        table = context_limit(config)
        if table is not None:
            limits.append(table)
        for rope in _rope_settings(config):
            if isinstance(rope.get("original_max_position_embeddings"), int):
                limits.append(rope["original_max_position_embeddings"])
            if "dynamic" in str(rope.get("rope_type") or rope.get("type") or "") and table is not None:
                limits.append(table - 1)
    return min(limits) if limits else None


def _text_config(config):
    """A multimodal config's text config, where it keeps its positions; else ``config``."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _rope_settings(config):
    """The RoPE parameter dicts of ``config``: one, or one per layer type (transformers 5, e.g. Gemma-3)."""
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    if not isinstance(rope, dict):
        return []
    nested = [value for value in rope.values() if isinstance(value, dict)]
    return nested + [rope]


def position_table(model):
    """What ``model`` looks positions up in, a table with no row past ``position_limit`` (past it, an IndexError): "a
    table of N learned positions" (an embedding, ``LEARNED_POSITION_TABLES``), "a table of N precomputed positions" (a
    buffer of such a name: GPT-J's and CodeGen's sinusoidal ``rotary_emb.embed_positions``, a row per position up to
    ``n_positions``) or None (positions computed as needed, rotary or ALiBi: past the limit they only drift). Returns
    "learned", "precomputed" or None, for those messages."""
    if any(isinstance(module, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in LEARNED_POSITION_TABLES
           for name, module in model.named_modules()):
        return "learned"
    if any(name.rsplit(".", 1)[-1] in LEARNED_POSITION_TABLES for name, _ in model.named_buffers()) or \
            bias_counts_key_slots(getattr(model, "config", None)):
        return "precomputed"
    return None


def bias_counts_key_slots(config):
    """Whether a model of ``config`` adds a position bias built ``context_limit`` keys long to its attention scores
    (MPT's ALiBi, made at every forward from ``max_seq_len``): more keys than that fail inside the model with a size
    mismatch, and every key slot counts, left padding and a static KV cache's unfilled slots included."""
    config = _text_config(config)
    return bool(getattr(getattr(config, "attn_config", None), "alibi", False)) and \
        isinstance(getattr(config, "max_seq_len", None), int)
