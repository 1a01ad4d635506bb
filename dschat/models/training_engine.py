"""DeepSpeed engines around the models: a trained model's (optimizer, learning-rate schedule, ZeRO-3 fetch units,
activation checkpointing) and an evaluated-only one's. Steps 1-3 and the RLHF engine build theirs here."""
import contextlib
import functools
import math
import weakref

import torch

from dschat.compat import enable_activation_checkpointing
from dschat.errors import UsageError
from dschat.models.layers import DEFAULT_ZERO3_FETCH
from dschat.utils.dist import print_rank_0


def make_optimizer(param_groups, lr, offload):
    """DeepSpeed's CPU Adam under offload, its fused Adam on GPUs, torch's AdamW otherwise (no JIT build on CPU)."""
    from deepspeed.accelerator import get_accelerator

    betas = (0.9, 0.95)  # DeepSpeed-Chat's
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(param_groups, lr=lr, betas=betas)
    if get_accelerator().device_name() != "cpu":
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(param_groups, lr=lr, betas=betas)
    return torch.optim.AdamW(param_groups, lr=lr, betas=betas)


_OPEN_SCOPES = []  # the engine lists of the released_engines() blocks in progress, innermost last


@contextlib.contextmanager
def released_engines(only_on_error=False):
    """Every engine ``initialize_engine`` and ``initialize_frozen`` make within the block is released
    (``release_engine``) when it ends, by an error too: a step run in a process that goes on (a notebook, pytest)
    leaves no engine behind. ``only_on_error``: a block that ends well hands its engines to the enclosing block (if
    any) instead, as a constructor that keeps them does."""
    made = []
    _OPEN_SCOPES.append(made)
    failure = None
    try:
        yield
    except BaseException as error:
        failure = error
        raise
    finally:
        del _OPEN_SCOPES[next(i for i, scope in enumerate(_OPEN_SCOPES) if scope is made)]  # (not remove(): ==)
        if only_on_error and failure is None:
            if _OPEN_SCOPES:
                _OPEN_SCOPES[-1].extend(made)
        elif not collective_may_be_pending(failure):
            release_all(made, keep_errors=failure is None)


def collective_may_be_pending(failure):
    """Whether the ranks may have stopped apart, a collective still queued on this rank's stream (Ctrl-C, which each
    rank takes at its own point; another rank's failure): a release then waits on it (destroy() synchronizes the
    device) until the NCCL timeout, where the rank would have ended at once. As ``end_distributed`` leaves the process
    group alone then, the engines are left as they are (the process ends)."""
    from dschat.utils.dist import get_world_size, peer_failure

    return get_world_size() > 1 and (isinstance(failure, KeyboardInterrupt) or peer_failure(failure))


def release_all(engines, keep_errors=True):
    """Release each engine, the rest too where one fails (on a GPU, destroy() synchronizes: after a device-side
    assert, it raises that assert again). ``keep_errors``: the first such error is raised at the end; otherwise the
    block's own error, the one that says what went wrong, is left to go on."""
    error = None
    for engine in engines:
        try:
            release_engine(engine)
        except Exception as e:
            error = error or e
    if error is not None and keep_errors:
        raise error


def _made(engine):
    if _OPEN_SCOPES:
        _OPEN_SCOPES[-1].append(engine)
    return engine


def released_as(engine, wrapper):
    """``wrapper`` (a ``HybridEngine``) is released in ``engine``'s place by the ``released_engines`` blocks that hold
    ``engine``: with its engine, the wrapper's inference tensor-parallel group goes too, which torch would keep. A
    second wrapper of the same engine goes beside the first (each made a group of its own)."""
    for scope in _OPEN_SCOPES:
        if any(made is engine for made in scope):
            scope[:] = [wrapper if made is engine else made for made in scope]
        elif any(_wrapped_engine(made) is engine for made in scope):
            scope.append(wrapper)


def _wrapped_engine(made):
    """The DeepSpeed engine a ``HybridEngine`` wraps; None for any other engine."""
    from dschat.hybrid_engine import HybridEngine

    return made.ds_engine if isinstance(made, HybridEngine) else None


_RELEASED = weakref.WeakSet()  # the engines released (or begun to be): DeepSpeed's and HybridEngines, the one record


def release_engine(engine):
    """Let Python free a finished DeepSpeed engine (a ``HybridEngine``'s too): its model, optimizer states and ZeRO
    buckets (2 GB each at DeepSpeed's default size). Left alone, DeepSpeed 0.19 keeps every engine of a process for
    good, which gc.collect() cannot free:
    - ZeRO-1/2/3's gradient hooks (``register_post_accumulate_grad_hook``) are held by each parameter's C++ autograd
      data, which gc does not see, and reach the optimizer, which holds the parameters: ``engine.destroy()`` removes
      them, and ZeRO-3's module hooks;
    - ZeRO-3 appends the model to ``parameter_offload.FWD_MODULE_STACK`` (a module's global list) and never takes it
      out (nor the submodules a forward that raised had pushed), and caches each parameter coordinator and module in
      the class-wide ``lru_cache`` of its ``__params_to_release``: destroy() clears neither. The whole cache goes (it
      holds every engine's coordinator): another live engine's entries are computed again at their next use.
    A ``HybridEngine`` also drops what generating keeps (KV cache, inference copy, captured decode steps) and destroys
    the inference tensor-parallel group it made (``HybridEngine.release_generation``), which torch would keep for as
    long as the process runs.
    The engine cannot train, nor run a ZeRO-3 forward, afterwards. Once: releasing it again does nothing (an engine
    of a notebook's ``with DeepSpeedRLHFEngine`` inside a ``released_engines`` block, released by both)."""
    from dschat.hybrid_engine import HybridEngine

    if not isinstance(engine, HybridEngine):
        _release_deepspeed_engine(engine)
        return
    try:
        if not is_released(engine):  # (released before: on its own, release_generation(), or by another block)
            engine.release_generation()
    finally:  # (the DeepSpeed engine goes too, whatever destroying the group does)
        _release_deepspeed_engine(engine.ds_engine)


def first_release(engine):
    """Whether ``engine`` (a DeepSpeed engine or a ``HybridEngine``) was not released before; it counts as released
    from now on (a release that fails is not tried again)."""
    if engine in _RELEASED:
        return False
    _RELEASED.add(engine)
    return True


def is_released(engine):
    return engine in _RELEASED


def _release_deepspeed_engine(engine):
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    if not first_release(engine):  # (also a HybridEngine's, released before on its own or with another wrapper)
        return
    engine.destroy()
    # (its submodules too: a forward that raised never popped those it had pushed)
    modules = {id(m) for m in engine.module.modules()}
    parameter_offload.FWD_MODULE_STACK[:] = [m for m in parameter_offload.FWD_MODULE_STACK if id(m) not in modules]
    cached = getattr(PartitionedParameterCoordinator, "_PartitionedParameterCoordinator__params_to_release", None)
    # (DeepSpeed 0.19's instrument_w_nvtx wraps the lru_cache in a closure; a release without that wrapper, or without
    # the method, must not fail every step run at its end)
    for candidate in (cached, *(cell.cell_contents for cell in getattr(cached, "__closure__", None) or ())):
        if hasattr(candidate, "cache_clear"):
            candidate.cache_clear()


def prepare_zero3_hooks(model, ds_config, zero3_fetch):
    """Under ZeRO-3 with ``--zero3_fetch layer``, make the decoder layers DeepSpeed's fetch units (before
    ``deepspeed.initialize`` registers its hooks); a model that rescales weights in place as its mode changes (RWKV)
    no longer does (``no_in_place_rescaling``); a family whose forwards gather other weights by width is refused on
    several ranks without such units (``check_ranks_forward_alike``)."""
    from dschat.models.layers import (ZERO3_FETCH_UNITS, check_ranks_forward_alike, mark_zero3_leaf_layers,
                                      record_zero3_fetch)
    from dschat.models.zero3 import no_in_place_rescaling
    from dschat.utils.dist import get_world_size

    if zero3_fetch not in ZERO3_FETCH_UNITS:
        raise UsageError(f"--zero3_fetch must be one of {ZERO3_FETCH_UNITS}, got {zero3_fetch!r}")
    record_zero3_fetch(model, zero3_fetch)  # (the hybrid engine's check sees only the engine's module)
    if ds_config["zero_optimization"]["stage"] == 3:
        no_in_place_rescaling(model)
    if ds_config["zero_optimization"]["stage"] == 3 and zero3_fetch == "layer" and not mark_zero3_leaf_layers(model):
        print_rank_0(f"[zero3] {type(model).__name__}: no decoder stack usable as --zero3_fetch layer units (mixed "
                     "or miscounted blocks, or layerdrop); DeepSpeed's per-module hooks")
    if ds_config["zero_optimization"]["stage"] == 3:  # (after the layers were made units, or not)
        check_ranks_forward_alike(model, get_world_size(), zero3_fetch)


def initialize_engine(model, ds_config, lr, weight_decay, lora_learning_rate, lr_scheduler_type, num_warmup_steps,
                      total_steps, gradient_checkpointing=False, zero3_fetch=DEFAULT_ZERO3_FETCH, role=None):
    """Optimizer, scheduler and ``deepspeed.initialize`` for a trainable model. The optimizer follows the config's
    optimizer offload (``--offload``, or a user's config file), as DeepSpeed requires. ``role``: the model's name in
    what is said (step 3 trains two)."""
    from dschat.utils.ds_config import optimizer_offloaded

    import deepspeed
    from transformers import get_scheduler

    from dschat.models.lora import optimizer_param_groups

    prepare_zero3_hooks(model, ds_config, zero3_fetch)
    if gradient_checkpointing:
        enable_activation_checkpointing(model, use_reentrant=False)
    optimizer = make_optimizer(optimizer_param_groups(model, weight_decay, lora_learning_rate), lr,
                               optimizer_offloaded(ds_config))
    scheduler = get_scheduler(lr_scheduler_type, optimizer=optimizer, num_warmup_steps=num_warmup_steps,
                              num_training_steps=max(total_steps, 1))
    notice = warmup_notice(lr, lr_scheduler_type, num_warmup_steps, total_steps, role)
    if notice:
        print_rank_0(notice)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                      config=ds_config, dist_init_required=False)
    _made(engine)
    uncount_state_allocation_step(engine)
    scale_fp16_loss_at_zero_0(engine)
    values_through_engine_forward(engine)
    return engine


def uncount_state_allocation_step(engine):
    """fp16 or bf16 without ZeRO: DeepSpeed 0.19's FP16_Optimizer and FP16_UnfusedOptimizer (the wrappers of ZeRO-0's
    low-precision training) take one optimizer step with zero gradients as they are built, to allocate Adam's state
    (ZeRO's own optimizers no longer do: deepspeedai/DeepSpeed#5104). Adam counted it, so the first real step took
    step 2's bias correction: 0.735 of the step fp32 and ZeRO-1 to 3 take with betas (0.9, 0.95), the next ~20 steps
    smaller too. The state goes back to a fresh Adam's (step counts and moments 0: the zero gradients left the moments
    0 anyway), and the fp32 master weights to the model's: AdamW decayed them in that step (lr x weight_decay), and
    they are the model's weights as built, exactly (``refresh_fp32_params``)."""
    if not steps_adam_as_it_is_built(engine):
        return
    for state in engine.optimizer.optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                value.zero_()
            elif key == "step":
                state[key] = 0
    engine.optimizer.refresh_fp32_params()


def steps_adam_as_it_is_built(engine):
    """Whether ``engine``'s optimizer is one of DeepSpeed's ZeRO-0 fp16/bf16 wrappers, which step Adam once with zero
    gradients as they are built (``uncount_state_allocation_step``)."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    return isinstance(getattr(engine, "optimizer", None), (FP16_Optimizer, FP16_UnfusedOptimizer))


def recount_restored_allocation_step(engine):
    """After ``engine.load_checkpoint``: a ZeRO-0 fp16/bf16 checkpoint saved before ``uncount_state_allocation_step``
    (dschat before 2026-12-07, 326ae58) carries Adam's step counts one higher than the steps Adam took, and a resume
    kept the extra count. Its moments are those of the steps taken (the allocation step's zero gradients left them 0),
    so counting it back gives the rest of the run the bias corrections of its own steps. Told by the counts, which no
    checkpoint records otherwise: the highest is one more than the restored engine's steps less its skipped ones (a
    parameter left without a gradient in a step counts fewer; a checkpoint saved since counts exactly). Returns
    (counted, taken) when it counted back, else None."""
    if not steps_adam_as_it_is_built(engine):
        return None
    states = [state for state in engine.optimizer.optimizer.state.values() if "step" in state]
    taken = engine.global_steps - engine.skipped_steps
    if not states or max(float(state["step"]) for state in states) != taken + 1:
        return None
    for state in states:
        state["step"] = state["step"] - 1  # (a new tensor: a restored state's step may be shared, ``own_step_counts``)
    return taken + 1, taken


def values_through_engine_forward(engine):
    """A trained critic's or reward model's ``engine.forward_value(...)`` (DeepSpeed-Chat's call, step 3's for the
    critic) runs as the engine's forward, not as the module's method reached past it (DeepSpeed's ``__getattr__``).
    DeepSpeed 0.19's engine forward does the ZeRO optimizer's bookkeeping of each micro-batch: ZeRO-3 counts the
    micro-step there, and with none counted each backward replaced the gradient the earlier micro-batches of an
    optimizer step had left (a ZeRO-3 critic with --gradient_accumulation_steps 2 trained on half its micro-batches).
    Held by a weak reference: no reference cycle keeps the engine."""
    if not callable(getattr(engine.module, "forward_value", None)):
        return
    engine.forward_value = functools.partial(_module_method_as_forward, weakref.ref(engine), "forward_value")


def _module_method_as_forward(engine_ref, method, *args, **kwargs):
    """``engine.module.<method>(*args, **kwargs)`` called through ``engine(...)``: the module's forward is that method
    for the call."""
    engine = engine_ref()
    module = engine.module
    own_forward = module.__dict__.get("forward")  # (an instance's own forward, e.g. a hook library's wrapper, stays)
    module.forward = getattr(module, method)
    try:
        return engine(*args, **kwargs)
    finally:
        if own_forward is None:
            del module.forward
        else:
            module.forward = own_forward


def scale_fp16_loss_at_zero_0(engine):
    """fp16 without ZeRO: DeepSpeed 0.19's ``engine.backward`` scales the loss for ZeRO optimizers only, while its
    FP16 optimizer still divides the gradients by the loss scale at ``step`` (deepspeedai/DeepSpeed#8393, open): every
    update came out 2**16 times too small, and no overflow was ever seen. The loss is scaled here, as that optimizer's
    own ``backward`` does; a DeepSpeed that scales it too is caught at the first backward (``_loss_scaled_once``)."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    optimizer = engine.optimizer
    if not engine.fp16_enabled() or isinstance(optimizer, ZeROOptimizer) or not hasattr(optimizer, "loss_scale") \
            or getattr(engine, "torch_autocast_z0_gradscaler", None) is not None:
        return
    backward, checked = engine.backward, []

    def backward_of_the_scaled_loss(loss, retain_graph=False, scale_wrt_gas=True):
        scale = optimizer.loss_scale or 1.0
        expected = scale / (engine.gradient_accumulation_steps() if scale_wrt_gas else 1)
        with contextlib.nullcontext() if checked else _loss_scaled_once(loss, expected):
            out = backward(loss.float() * scale, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas) / scale
        checked.append(True)  # (once: the check reads the gradient on the host)
        return out

    engine.backward = backward_of_the_scaled_loss


@contextlib.contextmanager
def _loss_scaled_once(loss, expected):
    """Around the backward of ``loss``: the gradient that reaches it is ``expected`` (the loss scale over the
    accumulation steps), not that times the scale again (a DeepSpeed that fixed #8393 would scale it twice)."""
    seen = []
    handle = loss.register_hook(lambda grad: seen.append(float(grad))) if loss.requires_grad else None
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()
    if seen and not math.isclose(seen[0], expected, rel_tol=1e-3):
        raise RuntimeError(f"fp16 at ZeRO-0: the loss's gradient is {seen[0]:g}, not the loss scale over the "
                           f"accumulation steps ({expected:g}): this DeepSpeed scales the loss itself, and dschat's "
                           "scaling for DeepSpeed 0.19 (scale_fp16_loss_at_zero_0) must go")


# transformers' polynomial schedule decays every rate to this (its default lr_end) and refuses a base rate not above it
POLYNOMIAL_LR_END = 1e-7


def check_schedule_reaches_its_end(lr_scheduler_type, rates):
    """``rates``: {flag: base learning rate} of the models a step trains. --lr_scheduler_type polynomial with a rate at
    or below its end (e.g. --actor_learning_rate 0 to train the critic alone) failed in transformers after the models
    had loaded ("lr_end (1e-07) must be smaller than initial lr"); said before anything loads."""
    low = {flag: rate for flag, rate in rates.items() if rate <= POLYNOMIAL_LR_END}
    if lr_scheduler_type == "polynomial" and low:
        said = ", ".join(f"{flag} {rate:g}" for flag, rate in low.items())
        raise UsageError(f"--lr_scheduler_type polynomial decays the learning rate to {POLYNOMIAL_LR_END:g} and needs "
                         f"a rate above it ({said}): give a larger rate, or another --lr_scheduler_type (constant, "
                         "linear)")


def warmup_notice(lr, lr_scheduler_type, num_warmup_steps, total_steps, role=None):
    """What to say when the warmup outlasts the run (step 3's default 100 steps against a short run's few): the
    learning rate rises all run long and never reaches the one asked for, so the run barely trains."""
    if lr_scheduler_type == "constant" or not lr or num_warmup_steps < max(total_steps, 1):
        return None
    reached = lr * (total_steps - 1) / num_warmup_steps  # the warmup's step s applies lr * s / warmup, from s = 0
    who = f" ({role})" if role else ""
    if not reached:
        return (f"[dschat] --num_warmup_steps {num_warmup_steps} >= this run's {total_steps} optimizer step{who}: it "
                "applies a learning rate of 0 (the warmup's first), so the run leaves the model as it was; give "
                "fewer warmup steps (0) or more steps")
    return (f"[dschat] --num_warmup_steps {num_warmup_steps} >= this run's {total_steps} optimizer steps{who}: the "
            f"learning rate rises all run long and never reaches {lr:g} (at most {reached:.3g}); give fewer warmup "
            "steps for a short run")


def initialize_frozen(model, ds_config, zero3_fetch=DEFAULT_ZERO3_FETCH):
    """A DeepSpeed engine for a model that is only evaluated (sharded under ZeRO-3, cast to the dtype)."""
    import deepspeed

    model.requires_grad_(False)
    prepare_zero3_hooks(model, ds_config, zero3_fetch)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, dist_init_required=False)
    _made(engine)
    engine.eval()
    return engine
