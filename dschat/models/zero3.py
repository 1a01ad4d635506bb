"""What a parameter is under DeepSpeed ZeRO-3, in one place: a partitioned parameter holds only its rank's shard
(``numel()`` is 0 outside a gather) and carries its full size in ``ds_numel``."""
import contextlib


def is_zero3_param(param):
    return hasattr(param, "ds_id")


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
