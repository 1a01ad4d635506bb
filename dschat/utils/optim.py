"""A DeepSpeed engine's optimizer step, with dschat's guard against applying non-finite gradients."""
import math


def optimizer_step(engine, name):
    """``engine.step()``; on an accumulation boundary, raise if that step applied a non-finite gradient.

    DeepSpeed skips a step whose gradients hold inf/NaN for fp16, for bf16 at ZeRO-0, and for bf16 at ZeRO-1/2 with
    ``--check_grad_overflow``. Without that flag (dschat's default: the per-tensor scan costs host time every step)
    and at ZeRO-3, bf16 steps apply them and the weights become NaN. The gradient norm, computed anyway for clipping,
    shows it: stop right there, before the EMA, an evaluation or a checkpoint uses those weights. Returns whether the
    step was an accumulation boundary (a real optimizer step).
    """
    boundary = engine.is_gradient_accumulation_boundary()
    engine.step()
    if boundary and getattr(engine, "_step_applied", True):  # False: DeepSpeed skipped it (overflow)
        norm = engine.get_global_grad_norm()  # None where DeepSpeed computed no norm (no clipping)
        if norm is not None and not math.isfinite(float(norm)):
            raise FloatingPointError(
                f"{name}: the optimizer step applied gradients whose norm is {float(norm)}: the weights are no longer "
                "finite. With bf16 at ZeRO-1/2, --check_grad_overflow makes DeepSpeed skip such steps instead.")
    return boundary
