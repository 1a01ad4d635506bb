"""What a parameter is under DeepSpeed ZeRO-3, in one place: a partitioned parameter holds only its rank's shard
(``numel()`` is 0 outside a gather) and carries its full size in ``ds_numel``."""
import contextlib


def is_zero3_param(param):
    return hasattr(param, "ds_id")


def holds_zero3_params(module):
    """Whether ``module`` has a ZeRO-3-partitioned parameter (its forwards gather them: a collective of every rank)."""
    return any(is_zero3_param(p) for p in module.parameters())


def full_numel(param):
    """The parameter's whole size, partitioned or not."""
    return getattr(param, "ds_numel", param.numel())


def gathered(params, modifier_rank=None):
    """Context in which the ZeRO-3-partitioned ``params`` are whole (read-only unless ``modifier_rank``: that rank's
    changes are partitioned again on exit); nothing to do for ordinary tensors."""
    partitioned = [p for p in params if is_zero3_param(p)]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank)



def no_in_place_rescaling(model):
    """transformers' RWKV (``rescale_every``) divides its blocks' output weights in place as a forward turns to eval
    mode (and halves the hidden states to match), and multiplies them back at the next training forward: fp16
    inference's guard against overflow. Under ZeRO-3 those writes land on a copy fetched for the forward, which its
    release drops, or on an empty shard: one eval and one training forward left block k's weights 2^k times the trained
    ones (and gathering them to write clashes with the forward's own fetch of them). Such modules of ``model`` compute
    in eval mode as in training mode, unscaled: the same values up to LayerNorm's epsilon (the rescaling divides every
    residual term alike), in fp16's range wherever the training forward is. Returns how many modules."""
    import types

    changed = 0
    for module in model.modules():
        if hasattr(module, "_rescale_layers") and hasattr(module, "layers_are_rescaled"):
            if module.layers_are_rescaled:  # (its weights divided already: unscaled, they would compute otherwise)
                raise RuntimeError(f"{type(module).__name__} ran in eval mode before ZeRO-3 was set up: its weights "
                                   "are held divided (rescale_every); prepare it before any forward")
            module._rescale_layers = types.MethodType(_stay_unscaled, module)
            changed += 1
    return changed


def _stay_unscaled(module):
    module.layers_are_rescaled = False  # (read by the forward: no hidden-state halving either)
