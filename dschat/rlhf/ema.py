"""Exponential moving average of the actor's weights (DeepSpeed-Chat's --enable_ema), any ZeRO stage, LoRA merged."""
import torch

from dschat.errors import UsageError
from dschat.models.lora import active_adapters, merged_fp32, plain_named, unwrap_peft, weight_deltas
from dschat.models.zero3 import gathered


@torch.no_grad()
def moving_average(model, model_ema, beta=0.992, device=None, zero_stage=None):
    """ema <- beta * ema + (1 - beta) * model, parameter by parameter (LoRA adapters folded in).

    ``model`` may be a PEFT model: its plain-model weights are ``dschat.models.lora``'s merge (all active adapters,
    fp32, rounded once to the EMA's dtype), the same weights its saved checkpoint holds. ``device`` and
    ``zero_stage`` are DeepSpeed-Chat's arguments, not read: ZeRO-3 parameters are gathered where they are.
    """
    check_not_engines(model, model_ema)
    base = unwrap_peft(model)
    sources = plain_named(base.named_parameters(), active_adapters(base))
    deltas = weight_deltas(base)
    for name, ema_param in model_ema.named_parameters():
        if name not in sources:
            raise KeyError(f"EMA parameter {name} has no counterpart in the actor")
        param, adapters = sources[name], deltas.get(name, [])
        fetch = [param] + [t for delta in adapters for t in delta.params()]
        with gathered(fetch), gathered([ema_param], modifier_rank=0):
            value = merged_fp32(param, adapters) if adapters else param.data
            ema_param.data.copy_(torch.lerp(value.to(ema_param.dtype), ema_param.data, beta))


def check_not_engines(model, model_ema):
    """DeepSpeed-Chat's loop calls ``moving_average(rlhf_engine.actor, rlhf_engine.actor_ema, zero_stage=...)`` after
    each PPO step. Here the trainer updates ``engine.actor_ema`` itself after each of the actor's optimizer steps
    (--enable_ema, --ema_beta): that call failed with a KeyError on the engines' "module." names, and one made to work
    would average twice per step."""
    from deepspeed import DeepSpeedEngine

    from dschat.hybrid_engine import HybridEngine

    if any(isinstance(m, (DeepSpeedEngine, HybridEngine)) for m in (model, model_ema)):
        raise UsageError("moving_average was given DeepSpeed engines (DeepSpeed-Chat's "
                         "moving_average(rlhf_engine.actor, rlhf_engine.actor_ema, ...)): the trainer already "
                         "updates engine.actor_ema after each of the actor's optimizer steps (enable_ema, ema_beta), "
                         "so drop this call; for models of your own, give their modules (engine.module)")
