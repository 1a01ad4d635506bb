"""Saving trained models as folders ``from_pretrained`` loads, atomically, from any ZeRO stage."""
import os
import shutil
from contextlib import contextmanager

from dschat.models.lora import check_lora_mergeable, merge_lora_state_dict, unwrap_peft
from dschat.utils.dist import barrier, is_rank_0
from dschat.utils.files import temp_folder


def _is_zero3_param(param):
    return hasattr(param, "ds_id")


def gathered_state_dict(module):
    """The full state dict on rank 0 (None elsewhere), on CPU; every rank must call it under ZeRO-3."""
    import deepspeed

    state = {}
    for name, param in module.named_parameters():
        if _is_zero3_param(param):
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                if is_rank_0():
                    state[name] = param.detach().cpu().clone()
        elif is_rank_0():
            state[name] = param.detach().cpu().clone()
    if not is_rank_0():
        return None
    for name, buffer in module.state_dict().items():  # persistent buffers (parameters are already in)
        if name not in state:
            state[name] = buffer.detach().cpu().clone()
    return state


def plain_model_state_dict(module):
    """State dict of the unwrapped HF model: LoRA merged (fp32, rounded once), PEFT prefixes removed."""
    check_lora_mergeable(module)  # on every rank: none may raise alone after the collective gather
    state = gathered_state_dict(module)
    return None if state is None else merge_lora_state_dict(state, module)


@contextmanager
def atomic_folder(output_dir):
    """Write into a temporary sibling folder, then swap it in, so a crash never leaves a half-written folder."""
    parent = os.path.dirname(os.path.abspath(output_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = temp_folder(parent, f".{os.path.basename(output_dir)}.tmp-")
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_folder(tmp, output_dir)


def replace_folder(new, target):
    old = None
    if os.path.exists(target):
        old = f"{target}.old-{os.getpid()}"
        os.replace(target, old)
    os.replace(new, target)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def save_causal_lm(module, tokenizer, output_dir):
    """Save an actor / SFT model (any ZeRO stage, LoRA merged) with its tokenizer. Collective under ZeRO-3."""
    state = plain_model_state_dict(module)
    if is_rank_0():
        model = unwrap_peft(module)
        with atomic_folder(output_dir) as tmp:
            _save_pretrained(model, state, tmp)
            tokenizer.save_pretrained(tmp)
    barrier()


def save_reward_model(reward_model, tokenizer, output_dir):
    """Save a reward model / critic: backbone as an HF folder plus the value head. Collective under ZeRO-3."""
    backbone = reward_model.rwtransformer
    check_lora_mergeable(backbone)  # on every rank: none may raise alone after the collective gather
    state = gathered_state_dict(reward_model)
    if is_rank_0():
        backbone_state = {k[len("rwtransformer."):]: v for k, v in state.items() if k.startswith("rwtransformer.")}
        backbone_state = merge_lora_state_dict(backbone_state, backbone)
        with atomic_folder(output_dir) as tmp:
            _save_pretrained(unwrap_peft(backbone), backbone_state, tmp)
            reward_model.save_head_and_meta(tmp, state)
            tokenizer.save_pretrained(tmp)
    barrier()


def _save_pretrained(model, state, folder):
    """``save_pretrained`` with an explicit (gathered, merged) state dict, in the weights' training dtype."""
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    model.save_pretrained(folder, state_dict={k: v.contiguous() for k, v in state.items()},
                          safe_serialization=True)
