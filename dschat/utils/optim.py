"""A DeepSpeed engine's optimizer step, with dschat's guard against applying non-finite gradients."""
import math

from dschat.utils.dist import print_rank_0


def optimizer_step(engine, name):
    """``engine.step()``; on an accumulation boundary, raise if that step applied a non-finite gradient norm.

    DeepSpeed skips a step whose gradients hold inf/NaN for fp16 (loss scaling), at ZeRO-3 (invalid norm), at ZeRO-0
    with bf16, and at ZeRO-1/2 in fp32 or with bf16 and ``--check_grad_overflow``. bf16 at ZeRO-1/2 without that flag
    (dschat's default: the per-tensor scan costs host time every step) applies them and the weights become NaN; the
    gradient norm DeepSpeed computes for clipping shows it, so stop right there, before the EMA, an evaluation or a
    checkpoint uses those weights. fp32 at ZeRO-0 reports no norm (a plain torch optimizer): unchecked, as in DeepSpeed.
    A skipped step (other than fp16's, whose loss scaler skips early steps as a matter of course) is reported here,
    so training that keeps skipping does not stall silently; the step loops count all of them (``skipped_steps``).
    Returns whether the step was an accumulation boundary (a real optimizer step).
    """
    boundary = engine.is_gradient_accumulation_boundary()
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


def skipped_steps(engine):
    """The optimizer steps ``engine`` skipped on inf/NaN gradients over the whole run: DeepSpeed's checkpoint keeps its
    count, so a resumed run's include those skipped before its checkpoint. 0 for an engine that keeps no count (a
    test's stand-in)."""
    return getattr(engine, "skipped_steps", 0)
