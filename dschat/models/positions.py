"""How far a model's positions go: the longest sequence it takes as it would a shorter one."""
import torch

# Names of learned absolute position tables (GPT-2's wpe, OPT's embed_positions, GPT-Neo/BioGPT/...'s): an index past
# them fails (an IndexError, a CUDA device-side assert), where rotary or ALiBi positions only drift from what the model
# learned.
LEARNED_POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings")


def position_limit(*models):
    """The longest run of positions every model takes as it would a shorter one: at most its position table
    (``max_position_embeddings``, GPT-2's ``n_positions``) and, with a RoPE scaling that depends on the longest
    position, the length it switches at (LongRoPE's ``original_max_position_embeddings``; dynamic NTK keeps a
    stretched table cached up to its table size, so one less). None if no model says."""
    limits = []
    for model in models:
        config = getattr(model, "config", None)
        if hasattr(config, "get_text_config"):  # multimodal configs keep positions in their text config
            config = config.get_text_config()
        table = next((getattr(config, name) for name in ("max_position_embeddings", "n_positions")
                      if isinstance(getattr(config, name, None), int)), None)
        if table is not None:
            limits.append(table)
        for rope in _rope_settings(config):
            if isinstance(rope.get("original_max_position_embeddings"), int):
                limits.append(rope["original_max_position_embeddings"])
            if "dynamic" in str(rope.get("rope_type") or rope.get("type") or "") and table is not None:
                limits.append(table - 1)
    return min(limits) if limits else None


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
    if any(name.rsplit(".", 1)[-1] in LEARNED_POSITION_TABLES for name, _ in model.named_buffers()):
        return "precomputed"
    return None
