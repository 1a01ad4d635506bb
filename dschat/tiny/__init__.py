"""The embedded offline default: a bundled synthetic assistant dataset, its tokenizer, tiny model presets
and the rule scorer that measures whether RLHF improved the policy.

With these, ``python train.py`` runs SFT, reward modelling and PPO anywhere, offline, on CPU, in minutes.
Rebuild the data and tokenizer with ``python -m dschat.tiny.generate_data``.
"""
from pathlib import Path

TINY_DIR = Path(__file__).resolve().parent
DATA_DIR = TINY_DIR / "data"
TRAIN_FILE = DATA_DIR / "train.jsonl"
EVAL_FILE = DATA_DIR / "eval.jsonl"
TOKENIZER_FILE = TINY_DIR / "tokenizer.json"

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"


def load_tiny_tokenizer():
    """The bundled byte-level BPE tokenizer as a transformers fast tokenizer.

    eos = bos = ``<|endoftext|>``; pad = ``<pad>``, deliberately a different token, so code that confuses
    padding with end-of-sequence fails here rather than on a real model. No chat template, right padding,
    and no special tokens added on encode (callers append eos themselves, as DeepSpeed-Chat does).
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_FILE), bos_token=EOS_TOKEN, eos_token=EOS_TOKEN,
                                   pad_token=PAD_TOKEN, unk_token=UNK_TOKEN, padding_side="right",
                                   model_max_length=512, clean_up_tokenization_spaces=False)


def __getattr__(name):
    # Presets and the scorer load lazily: importing the package for paths must not import transformers.
    if name in ("TINY_PRESETS", "is_tiny_preset", "create_tiny_model", "tiny_preset_name"):
        from dschat.tiny import presets
        return getattr(presets, name)
    if name in ("rule_score", "score_batch"):
        from dschat.tiny import scorer
        return getattr(scorer, name)
    raise AttributeError(f"module 'dschat.tiny' has no attribute {name!r}")


__all__ = ["DATA_DIR", "TRAIN_FILE", "EVAL_FILE", "TOKENIZER_FILE", "TINY_DIR", "EOS_TOKEN", "PAD_TOKEN",
           "UNK_TOKEN", "load_tiny_tokenizer", "TINY_PRESETS", "is_tiny_preset", "create_tiny_model",
           "rule_score", "score_batch"]
