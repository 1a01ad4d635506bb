"""A DeepSpeed engine's optimizer step, with dschat's guard against applying non-finite gradients, and a step skipped
on purpose through DeepSpeed's own overflow path."""
import contextlib
import math

import torch

from dschat.utils.dist import print_rank_0


def optimizer_step(engine, name, skip=False):
    """``engine.step()``; on an accumulation boundary, raise if that step applied a non-finite gradient norm.

    DeepSpeed skips a step whose gradients hold inf/NaN for fp16 (loss scaling), at ZeRO-3 (invalid norm), at ZeRO-0
    with bf16, and at ZeRO-1/2 in fp32 or with bf16 and ``--check_grad_overflow``. bf16 at ZeRO-1/2 without that flag
    (dschat's default: the per-tensor scan costs host time every step) applies them and the weights become NaN; the
    gradient norm DeepSpeed computes for clipping shows it, so stop right there, before the EMA, an evaluation or a
    checkpoint uses those weights. fp32 at ZeRO-0 reports no norm (a plain torch optimizer): unchecked, as in DeepSpeed.
    A skipped step (other than fp16's, whose loss scaler skips early steps as a matter of course) is reported here,
    so training that keeps skipping does not stall silently; the step loops count all of them (``skipped_steps``).
    ``skip``: a boundary's step is skipped on purpose (``forced_overflow``; the caller says why), said by the caller.
    Returns whether the step was an accumulation boundary (a real optimizer step).
    """
    boundary = engine.is_gradient_accumulation_boundary()
    if skip and boundary:
        _forced_skip(engine, name)
        return True
    engine.step()
    if not boundary:
        return False
    if not engine.was_step_applied():
        if not engine.fp16_enabled():  # fp16's loss scaler skips steps by design
            print_rank_0(f"[{name}] optimizer step skipped by DeepSpeed: inf/NaN gradients")
        return True
    norm = engine.get_global_grad_norm()  # a tensor, a float, or None where the optimizer reports none
    if norm is not None and not math.isfinite(float(norm)):
        raise FloatingPointError(
            f"{name}: the optimizer step applied gradients whose norm is {float(norm)}: the weights are no longer "
            "finite. With bf16 at ZeRO-1/2, --check_grad_overflow makes DeepSpeed skip such steps instead.")
    return True


def _forced_skip(engine, name):
    with forced_overflow(engine):
        engine.step()
    if engine.was_step_applied():  # a DeepSpeed whose step checks overflow some other way
        raise RuntimeError(f"DeepSpeed applied the {name}'s step it was made to skip "
                           f"({type(engine.optimizer).__name__} no longer asks the overridden check)")


def skipped_steps(engine):
    """The optimizer steps ``engine`` skipped over the whole run: on inf/NaN gradients, and those dschat made it skip
    (``forced_overflow``: --align_overflow, an accumulation group with no token in the loss). DeepSpeed's checkpoint
    keeps its count, so a resumed run's include those skipped before its checkpoint. 0 for an engine that keeps no
    count (a test's stand-in)."""
    return getattr(engine, "skipped_steps", 0)


# --- a step skipped on purpose ---------------------------------------------------------------------------------
FORCED_SKIP_USERS = "a forced step skip (--align_overflow, --mask_truncated_answers)"


@contextlib.contextmanager
def forced_overflow(engine):
    """For the ``engine.step()`` inside: the optimizer reports an overflow, so DeepSpeed skips the step as it skips an
    overflowed one (gradients cleared, parameters and optimizer state not updated, the lr scheduler not advanced,
    ``skipped_steps`` + 1, ``was_step_applied()`` False); a loss scale (``_update_scale``) is left as it was.

    Each optimizer DeepSpeed builds for dschat asks its own check, which is overridden on the instance for the block:
    ZeRO-0's fp16/bf16 wrappers their ``overflow_checker``; ZeRO-1/2 ``has_overflow``, asked only with
    ``check_grad_overflow`` (fp16's; bf16 and fp32 without it), so that is set too; ZeRO-3 ``has_overflow`` in fp16,
    else an invalid gradient norm (``_get_norm_groups``), DeepSpeed's own skip for one; BF16_Optimizer (bf16 at ZeRO-1
    with a --deepspeed_config's fp32 gradient accumulation) an invalid norm too; a plain torch optimizer
    (fp32 at ZeRO-0, which DeepSpeed does not wrap) takes no step and says ``overflow``, which DeepSpeed reads."""
    with _instance_overrides(*_overflow_overrides(engine.optimizer)):
        yield


def _reports_overflow(*args, **kwargs):
    return True


def _keeps_scale(*args, **kwargs):
    return None


def _takes_no_step(*args, **kwargs):
    return None


def _invalid_norm_groups(*args, **kwargs):
    return [torch.tensor(float("inf"))]


def _invalid_norm_grads(*args, **kwargs):
    return [torch.tensor(float("inf"))], {}


def _overflow_overrides(optimizer):
    """([(object, attribute, value)] replacing what ``optimizer`` has, [(object, attribute, value)] added) that make its
    step report an overflow; a TypeError naming an optimizer dschat cannot make skip."""
    if hasattr(optimizer, "overflow_checker"):  # ZeRO-0 fp16/bf16: FP16_Optimizer, FP16_UnfusedOptimizer
        checker = optimizer.overflow_checker
        overrides = [(checker, "has_overflow", _reports_overflow), (optimizer, "_update_scale", _keeps_scale)]
        if hasattr(checker, "check_using_norm"):  # ZeRO-0's legacy fused Adam/LAMB steps ask the norms instead
            overrides.append((checker, "check_using_norm", _reports_overflow))
        return overrides, []
    if hasattr(optimizer, "has_overflow"):  # ZeRO-1/2/3
        overrides = [(optimizer, "has_overflow", _reports_overflow), (optimizer, "_update_scale", _keeps_scale)]
        if hasattr(optimizer, "check_grad_overflow"):  # ZeRO-1/2 ask has_overflow only where this is set
            overrides.append((optimizer, "check_grad_overflow", True))
        if hasattr(optimizer, "_get_norm_groups"):  # ZeRO-3 asks has_overflow in fp16 only; else the norm decides
            overrides.append((optimizer, "_get_norm_groups", _invalid_norm_groups))
        return overrides, []
    if hasattr(optimizer, "get_grads_for_norm"):  # BF16_Optimizer (bf16 at ZeRO-1 with fp32 gradient accumulation)
        return [(optimizer, "get_grads_for_norm", _invalid_norm_grads)], []  # (it skips on an invalid norm alone)
    if isinstance(optimizer, torch.optim.Optimizer):  # fp32 at ZeRO-0: DeepSpeed reads an ``overflow`` if there
        return [(optimizer, "step", _takes_no_step)], [(optimizer, "overflow", True)]
    raise TypeError(f"{FORCED_SKIP_USERS}: DeepSpeed's {type(optimizer).__name__} has no has_overflow or "
                    "overflow_checker to override, and is no torch optimizer")


@contextlib.contextmanager
def _instance_overrides(overrides, added=()):
    """(object, attribute, value) set on each instance for the ``with`` block, then the instance as it was:
    ``overrides`` replace what the object has, ``added`` are attributes it has not."""
    missing = object()
    saved = []
    try:
        for obj, name, value in overrides:
            if not hasattr(obj, name):
                raise TypeError(f"{FORCED_SKIP_USERS}: DeepSpeed's {type(obj).__name__} has no {name} to override")
            saved.append((obj, name, vars(obj).get(name, missing)))
            setattr(obj, name, value)
        for obj, name, value in added:
            if hasattr(obj, name):
                raise TypeError(f"{FORCED_SKIP_USERS}: DeepSpeed's {type(obj).__name__} has a {name} already")
            saved.append((obj, name, missing))
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, before in reversed(saved):
            if before is missing:
                delattr(obj, name)  # the class's attribute shows through again
            else:
                setattr(obj, name, before)
