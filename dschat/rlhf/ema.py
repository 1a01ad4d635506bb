"""Exponential moving average of the actor's weights (DeepSpeed-Chat's --enable_ema), any ZeRO stage, LoRA merged."""
import contextlib

import torch

from dschat.models.lora import lora_layers, merge_lora_weight


def _gathered(params, modifier_rank=None):
    """Gather ZeRO-3 partitions (a no-op for ordinary parameters)."""
    import deepspeed

    z3 = [p for p in params if hasattr(p, "ds_id")]
    if not z3:
        return contextlib.nullcontext()
    return deepspeed.zero.GatheredParameters(z3, modifier_rank=modifier_rank)


def _plain_name(name):
    name = name[len("base_model.model."):] if name.startswith("base_model.model.") else name
    return name.replace(".base_layer.", ".")


def _actor_sources(model):
    """Plain parameter name -> (parameter, LoRA (A, B, scaling, fan_in_fan_out) or None)."""
    params = dict(model.named_parameters())
    layers = lora_layers(model) if hasattr(model, "peft_config") else {}
    sources = {}
    for name, param in params.items():
        if ".lora_" in name:
            continue
        lora = None
        if name.endswith(".base_layer.weight"):
            layer = name[: -len(".base_layer.weight")]
            if layer in layers:
                a = next(p for n, p in params.items() if n.startswith(f"{layer}.lora_A."))
                b = next(p for n, p in params.items() if n.startswith(f"{layer}.lora_B."))
                lora = (a, b, *layers[layer])
        sources[_plain_name(name)] = (param, lora)
    return sources


@torch.no_grad()
def moving_average(model, model_ema, beta=0.992):
    """ema <- beta * ema + (1 - beta) * model, parameter by parameter (LoRA adapters folded in)."""
    sources = _actor_sources(model)
    for name, ema_param in model_ema.named_parameters():
        if name not in sources:
            raise KeyError(f"EMA parameter {name} has no counterpart in the actor")
        param, lora = sources[name]
        fetch = [param] + ([lora[0], lora[1]] if lora else [])
        with _gathered(fetch), _gathered([ema_param], modifier_rank=0):
            value = param.data if lora is None else merge_lora_weight(param.data, lora[0].data, lora[1].data,
                                                                      lora[2], lora[3])
            ema_param.data.copy_(torch.lerp(value.to(ema_param.dtype), ema_param.data, beta))
