"""--align_overflow (DeepSpeed-Chat's): with fp16 loss scaling, when the actor's or the critic's gradients overflow,
both optimizer steps are skipped, so the two models stay in step.

DeepSpeed-Chat asks each optimizer ``check_overflow(external=True)`` and sets ``optimizer.skip_step`` on the other;
DeepSpeed 0.19 has neither. Here:

- the overflow is asked of the check the optimizer's own step runs (``has_overflow`` of ZeRO-1/2/3, the
  ``overflow_checker`` of ZeRO-0's fp16 optimizers): a collective over the data-parallel group, so every rank asks it
  of the same engines in the same order;
- a model whose own gradients are finite skips its step through DeepSpeed's own overflow path: for that one
  ``engine.step()`` its optimizer's overflow check answers True (an override on the optimizer instance, removed
  afterwards: ``forced_overflow`` of dschat/utils/optim.py, which also skips the steps of --mask_truncated_answers'
  accumulation groups with no token in the loss). DeepSpeed then does what it does for an overflowed step:
  gradients cleared, parameters not updated, the lr scheduler not advanced, ``skipped_steps`` + 1,
  ``was_step_applied()`` False;
- that model's loss scaler is left as it was (``_update_scale`` does nothing for that step; DeepSpeed's overflow
  path would halve the scale, or at ZeRO-1/2/3 first use up its hysteresis): its gradients fit the scale, so lowering
  it would only lose precision, and a partner that keeps overflowing could drive it to DeepSpeed's minimum scale. The
  overflowed model's scaler reacts as DeepSpeed's always does.
"""
import contextlib

from dschat.errors import UsageError
from dschat.utils.dist import print_rank_0
from dschat.utils.optim import forced_overflow


def check_align_overflow(args):
    """Whether --align_overflow is on; a UsageError naming the flag when it would have nothing to align."""
    if not args.align_overflow:
        return False
    if args.dtype != "fp16":
        raise UsageError(f"--align_overflow skips the actor's and critic's steps together when fp16 loss scaling "
                         f"overflows; --dtype {args.dtype} has no loss scaling: give --dtype fp16 or drop the flag")
    if args.advantage_estimator != "gae":
        raise UsageError(f"--align_overflow aligns the actor's steps with the critic's; --advantage_estimator "
                         f"{args.advantage_estimator} trains no critic: drop the flag")
    if args.unsupervised_dataset_name:
        raise UsageError("--align_overflow aligns the actor's PPO step with the critic's; with "
                         "--unsupervised_dataset_name dschat accumulates the actor's PPO and language-model losses "
                         "into one step, taken after the language-model micro-step, which this alignment does not "
                         "cover (DeepSpeed-Chat steps them separately and aligns the PPO one): drop one of the two")
    return True


def gradients_overflowed(engine):
    """Whether the engine's accumulated gradients hold an inf/NaN on any rank: the check its optimizer's step runs.
    A collective over the data-parallel group (every rank calls it, for the same engines in the same order)."""
    optimizer = engine.optimizer
    if hasattr(optimizer, "overflow_checker"):  # ZeRO-0 fp16: FP16_Optimizer, FP16_UnfusedOptimizer
        return bool(optimizer.overflow_checker.check())
    if hasattr(optimizer, "has_overflow"):  # ZeRO-1/2 (its step passes partition_gradients), ZeRO-3
        return bool(optimizer.has_overflow(getattr(optimizer, "partition_gradients", True)))
    raise TypeError(f"--align_overflow: cannot ask DeepSpeed's {type(optimizer).__name__} whether its gradients "
                    "overflowed (it has neither has_overflow nor an overflow_checker)")


def forced_skips(actor_overflow, critic_overflow):
    """The models to make skip (their own gradients finite while the other's overflowed) and DeepSpeed-Chat's line."""
    if actor_overflow and critic_overflow:
        return (), "OVERFLOW: actor and critic overflow"
    if actor_overflow:
        return ("critic",), "OVERFLOW: actor overflow, skipping both actor and critic steps"
    if critic_overflow:
        return ("actor",), "OVERFLOW: critic overflow, skipping both actor and critic steps"
    return (), None


@contextlib.contextmanager
def steps_skipped_together(actor, critic):
    """Around the actor's and the critic's ``step()`` (after both backwards): when either's gradients overflowed, both
    steps are skipped. Only at an accumulation boundary of both (between boundaries a step applies nothing)."""
    if not (actor.is_gradient_accumulation_boundary() and critic.is_gradient_accumulation_boundary()):
        yield
        return
    engines = {"actor": actor, "critic": critic}
    to_skip, message = forced_skips(gradients_overflowed(actor), gradients_overflowed(critic))  # this order, all ranks
    if message:
        print_rank_0(message)
    with contextlib.ExitStack() as stack:
        for name in to_skip:
            stack.enter_context(forced_overflow(engines[name]))
        yield
    for name in to_skip:
        if engines[name].was_step_applied():  # a DeepSpeed whose step checks overflow some other way
            raise RuntimeError(f"--align_overflow: DeepSpeed applied the {name}'s step it was made to skip "
                               f"({type(engines[name].optimizer).__name__} no longer asks the overridden check)")
    if actor.was_step_applied() != critic.was_step_applied():  # a skip for an invalid norm of finite gradients
        print_rank_0(f"[align_overflow] only the {'actor' if actor.was_step_applied() else 'critic'}'s step was "
                     "applied: DeepSpeed found an overflow in the other's gradient norm that its check did not show")
