"""LoRA through PEFT: family-neutral target selection, optimizer groups, and a drift-free merge."""
import torch
from torch import nn

# Output heads are never adapted: they are tied to embeddings in many models or newly initialised.
HEAD_NAMES = ("lm_head", "v_head", "score", "embed_out")


def lora_target_modules(model, lora_module_name=""):
    """Names of the Linear-like modules to adapt: those whose name contains ``lora_module_name`` (all when empty).

    DeepSpeed-Chat matched "decoder.layers." (an OPT path); matching a substring of the module path against the
    model's own Linear modules works for every family (GPT-2's Conv1D included).
    """
    from transformers.pytorch_utils import Conv1D

    names = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, Conv1D)):
            continue
        if any(part in HEAD_NAMES for part in name.split(".")):
            continue
        if lora_module_name and lora_module_name not in name:
            continue
        names.append(name)
    if not names:
        raise ValueError(f"--lora_module_name {lora_module_name!r} matches no Linear module of "
                         f"{type(model).__name__}")
    return names


def apply_lora(model, lora_dim, lora_module_name="", lora_alpha=None, lora_dropout=0.0,
               only_optimize_lora=False, modules_to_save=None):
    """Wrap ``model`` with PEFT LoRA adapters of rank ``lora_dim`` (returns the model unchanged when 0)."""
    if not lora_dim:
        return model
    from peft import LoraConfig, get_peft_model

    targets = lora_target_modules(model, lora_module_name)
    config = LoraConfig(r=lora_dim, lora_alpha=lora_alpha or lora_dim, lora_dropout=lora_dropout,
                        target_modules=targets, modules_to_save=modules_to_save, bias="none")
    model = get_peft_model(model, config)
    if not only_optimize_lora:  # DeepSpeed-Chat trains base weights too unless told otherwise
        for param in model.parameters():
            param.requires_grad_(True)
    return model


def is_lora_param(name):
    return "lora_" in name


def optimizer_param_groups(model, weight_decay, lora_learning_rate=None):
    """Weight decay on matrices only (biases and norm weights are 1-D); LoRA parameters may get their own lr."""
    groups = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decay = weight_decay if param.ndim >= 2 and not name.endswith(".bias") else 0.0
        lora = lora_learning_rate is not None and is_lora_param(name)
        key = (decay, lora)
        if key not in groups:
            groups[key] = {"params": [], "weight_decay": decay}
            if lora:
                groups[key]["lr"] = lora_learning_rate
        groups[key]["params"].append(param)
    return list(groups.values())


def merge_lora_state_dict(state_dict, layers):
    """Fold LoRA adapters into their base weights, in fp32, rounding once to the weight's dtype.

    ``state_dict`` uses PEFT names (``...q_proj.base_layer.weight``, ``...q_proj.lora_A.<adapter>.weight``);
    ``layers`` maps the layer prefix (``...q_proj``) to (alpha / r, fan_in_fan_out) as from ``lora_layers``.
    Returns plain names (``...q_proj.weight``)
    with the ``base_model.model.`` prefix removed, ready for the unwrapped model.
    """
    merged = {}
    for key, value in state_dict.items():
        if ".lora_" in key:
            continue
        if ".base_layer." in key:
            layer, leaf = key.split(".base_layer.")
            if leaf == "weight" and layer in layers:
                scaling, fan_in_fan_out = layers[layer]
                value = merge_lora_weight(value, *_lora_pair(state_dict, layer), scaling, fan_in_fan_out)
            key = f"{layer}.{leaf}"
        merged[_strip_peft_prefix(key)] = value
    return merged


def merge_lora_weight(weight, lora_a, lora_b, scaling, fan_in_fan_out=False):
    delta = (lora_b.float() @ lora_a.float()) * scaling
    if fan_in_fan_out:
        delta = delta.T
    return (weight.float() + delta).to(weight.dtype)


def _lora_pair(state_dict, layer):
    a = next(v for k, v in state_dict.items() if k.startswith(f"{layer}.lora_A.") and k.endswith(".weight"))
    b = next(v for k, v in state_dict.items() if k.startswith(f"{layer}.lora_B.") and k.endswith(".weight"))
    return a, b


def _strip_peft_prefix(key):
    return key[len("base_model.model."):] if key.startswith("base_model.model.") else key


def lora_layers(peft_model):
    """Layer prefix (as in the PEFT model's state dict) -> (scaling of its active adapter, fan_in_fan_out).

    fan_in_fan_out is True for GPT-2's Conv1D, whose weights are stored (in, out) while B @ A is (out, in).
    """
    from peft.tuners.lora import LoraLayer

    layers = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer):
            adapter = module.active_adapters[0]
            layers[name] = (module.scaling[adapter], bool(getattr(module, "fan_in_fan_out", False)))
    return layers


@torch.no_grad()
def unwrap_peft(model):
    """The plain HF model under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
