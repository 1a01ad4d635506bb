"""dschat: DeepSpeed-Chat-style RLHF (SFT, reward model, PPO) with a model-agnostic hybrid engine.

Heavy modules load lazily so ``import dschat`` stays cheap.
"""
import importlib

__version__ = "0.1.0"

_LAZY = {
    "DeepSpeedRLHFEngine": "dschat.rlhf.engine",
    "DeepSpeedPPOTrainer": "dschat.rlhf.trainer",
    "DeepSpeedPPOTrainerUnsupervised": "dschat.rlhf.trainer",
    "HybridEngine": "dschat.hybrid_engine",
    "RewardModel": "dschat.models.reward_model",
    "create_hf_model": "dschat.models.loading",
    "create_critic_model": "dschat.models.reward_model",
    "load_tokenizer": "dschat.models.loading",
    "prompt_loaders": "dschat.steps.ppo",
    "create_prompt_dataset": "dschat.data",
    "save_causal_lm": "dschat.models.checkpoint",
    "save_reward_model": "dschat.models.checkpoint",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dschat' has no attribute {name!r}")


def __dir__():
    # (the lazy names too: a notebook's tab completion, dir(dschat), listed none of the README's imports)
    return sorted(set(globals()) | set(_LAZY))


__all__ = sorted(_LAZY)
