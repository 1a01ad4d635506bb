"""Tiny randomly initialised causal LMs of several architectures, sized for CPU runs in minutes.

A preset is saved to a folder with ``save_pretrained`` and later steps load it with ``from_pretrained``, so
the tiny default exercises the same loading path as a real checkpoint.
"""
import hashlib
import json
from pathlib import Path

from dschat.errors import UsageError
from dschat.tiny import TOKENIZER_FILE, load_tiny_tokenizer

PRESET_PREFIX = "dschat/"
MARKER_FILE = "dschat_tiny_preset.json"
MAX_POSITIONS = 512

# Shared sizes: hidden 128, 4 heads, 2 layers, MLP 256. Llama-family presets use 2 kv heads (grouped-query
# attention) so code that assumes num_key_value_heads == num_attention_heads breaks on them.
HIDDEN, HEADS, KV_HEADS, LAYERS, MLP = 128, 4, 2, 2, 256


def _special_ids():
    tokenizer = load_tiny_tokenizer()
    return {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}


def tiny_llama_config():
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                       max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False, **_special_ids())


def tiny_qwen2_config():
    from transformers import Qwen2Config
    return Qwen2Config(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                       max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True, **_special_ids())


def tiny_mistral_config():
    from transformers import MistralConfig
    return MistralConfig(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=MAX_POSITIONS, sliding_window=None, tie_word_embeddings=False,
                         **_special_ids())


def tiny_opt_config():
    from transformers import OPTConfig
    return OPTConfig(hidden_size=HIDDEN, ffn_dim=MLP, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                     word_embed_proj_dim=HIDDEN, max_position_embeddings=MAX_POSITIONS, do_layer_norm_before=True,
                     **_special_ids())


def tiny_gpt2_config():
    from transformers import GPT2Config
    ids = _special_ids()
    return GPT2Config(n_embd=HIDDEN, n_inner=MLP, n_layer=LAYERS, n_head=HEADS, n_positions=MAX_POSITIONS,
                      **ids)


TINY_PRESETS = {
    "tiny-llama": tiny_llama_config,
    "tiny-opt": tiny_opt_config,
    "tiny-gpt2": tiny_gpt2_config,
    "tiny-qwen2": tiny_qwen2_config,
    "tiny-mistral": tiny_mistral_config,
}


def tiny_preset_name(name):
    """The preset key for "tiny-llama" or "dschat/tiny-llama"; None for anything else."""
    if not isinstance(name, str):
        return None
    key = name[len(PRESET_PREFIX):] if name.startswith(PRESET_PREFIX) else name
    return key if key in TINY_PRESETS else None


def is_tiny_preset(name):
    """True exactly for preset names, bare ("tiny-llama") or namespaced ("dschat/tiny-llama")."""
    return tiny_preset_name(name) is not None


def tiny_preset_model_type(name):
    """config.model_type of preset ``name`` ("tiny-llama": "llama"), None for anything else: a preset has no
    config.json to read where a step names it (its folder is built when it loads)."""
    preset = tiny_preset_name(name)
    return TINY_PRESETS[preset]().model_type if preset is not None else None


def _marker(preset, seed):
    # The tokenizer's hash is part of the identity: a regenerated tokenizer must rebuild the models.
    return {"preset": preset, "seed": seed, "tokenizer_sha256": hashlib.sha256(TOKENIZER_FILE.read_bytes()).hexdigest()}


def _already_built(save_dir, marker):
    marker_path = save_dir / MARKER_FILE
    if not marker_path.is_file() or not (save_dir / "model.safetensors").is_file():
        return False
    try:
        return json.loads(marker_path.read_text()) == marker
    except (OSError, ValueError):
        return False


def create_tiny_model(name, save_dir, seed=1234):
    """Build preset ``name`` with random weights, save model + tokenizer to ``save_dir``, return the folder.

    Idempotent: a folder already holding this preset (same seed, same tokenizer) is returned untouched.
    """
    import torch
    from transformers import AutoModelForCausalLM

    preset = tiny_preset_name(name)
    if preset is None:
        raise UsageError(f"unknown tiny preset {name!r}; choose from {sorted(TINY_PRESETS)}")
    save_dir = Path(save_dir)
    marker = _marker(preset, seed)
    if _already_built(save_dir, marker):
        return str(save_dir)

    config = TINY_PRESETS[preset]()
    # Seed a private generator state so building a model neither depends on nor disturbs the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.bos_token_id = config.bos_token_id

    save_dir.mkdir(parents=True, exist_ok=True)
    # transformers 5 writes only on torch.distributed rank 0, but a preset is built by whichever rank holds the
    # cache lock first: this process must write the files whatever its rank.
    model.should_save_on_this_rank = lambda is_main_process: True
    model.save_pretrained(save_dir, safe_serialization=True)
    load_tiny_tokenizer().save_pretrained(save_dir)
    # Written last: its presence means the folder is complete.
    (save_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    return str(save_dir)
