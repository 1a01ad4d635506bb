"""--align_overflow: when the actor's or the critic's fp16 gradients overflow, both optimizer steps are skipped.

The decision logic runs against small fake engines whose ``step`` follows DeepSpeed 0.19's code (the optimizer's
overflow check, its ``_update_scale``, the engine's ``_take_model_step`` bookkeeping): every case, order and failure
in milliseconds, on any machine. The override also runs against a real DeepSpeed ZeRO-2 engine in bf16 with
``check_grad_overflow`` (the overflow check fp16 runs at ZeRO-1/2, in the same optimizer class), which needs no fp16.
``tests/scripts/align_overflow_fp16.py`` checks real fp16 engines (loss scaling) at ZeRO-0/2/3 on 2 CPU ranks or up to
2 GPUs, where DeepSpeed's accelerator trains in fp16: a GPU, or its CPU accelerator on a CPU with AVX512-FP16 or
AMX-FP16 (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``); skipped elsewhere.
"""
from pathlib import Path

import pytest
import torch

from dschat.args import step3_parser
from dschat.errors import UsageError
from dschat.rlhf.config import step3_args
from dschat.rlhf.overflow import (check_align_overflow, forced_overflow, forced_skips, gradients_overflowed,
                                  steps_skipped_together)


# --- fakes that follow DeepSpeed 0.19's step ---------------------------------------------------------------------
class FakeZeroOptimizer:
    """DeepSpeedZeroOptimizer's shape: ``step`` asks ``has_overflow`` and calls ``_update_scale``."""

    partition_gradients = True

    def __init__(self, name, log):
        self.name, self.log = name, log
        self.grads_overflow = False
        self.overflow = False
        self.loss_scale = 2.0 ** 16
        self.weight = 0.0

    def has_overflow(self, partition_gradients=True):
        self.log.append(f"{self.name}.overflow_check")
        return self.grads_overflow

    def _update_scale(self, has_overflow=False):
        if has_overflow:
            self.loss_scale /= 2

    def step(self):
        self.overflow = self.has_overflow(self.partition_gradients)
        self._update_scale(self.overflow)
        if self.overflow:
            self.grads_overflow = False  # DeepSpeed clears the gradients
            return
        self.weight += 1.0


class FakeOverflowChecker:
    def __init__(self, optimizer):
        self.optimizer = optimizer

    def has_overflow(self, params=None):
        self.optimizer.log.append(f"{self.optimizer.name}.overflow_check")
        return self.optimizer.grads_overflow

    def check(self, param_groups=None):
        return self.has_overflow()


class FakeFp16Optimizer(FakeZeroOptimizer):
    """ZeRO-0's FP16_Optimizer shape: ``step`` asks its ``overflow_checker``."""

    def __init__(self, name, log):
        super().__init__(name, log)
        self.overflow_checker = FakeOverflowChecker(self)

    def step(self):
        self.overflow = self.overflow_checker.has_overflow([])
        if self.overflow:
            self._update_scale(True)
            self.grads_overflow = False
            return
        self._update_scale(False)
        self.weight += 1.0


class FakeScheduler:
    last_epoch = 0

    def step(self):
        self.last_epoch += 1


class FakeEngine:
    """DeepSpeedEngine's accumulation, ``step`` and ``_take_model_step`` bookkeeping."""

    def __init__(self, name, log, optimizer_class=FakeZeroOptimizer, gas=1):
        self.name, self.log, self.gas = name, log, gas
        self.optimizer = optimizer_class(name, log)
        self.lr_scheduler = FakeScheduler()
        self.micro_steps = self.skipped_steps = 0
        self._step_applied = False

    def is_gradient_accumulation_boundary(self):
        return (self.micro_steps + 1) % self.gas == 0

    def backward(self, loss, overflow=False):
        self.log.append(f"{self.name}.backward")

    def step(self):
        self.log.append(f"{self.name}.step")
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            self.optimizer.step()
            self._step_applied = not self.optimizer.overflow
            if self.optimizer.overflow:
                self.skipped_steps += 1
            else:
                self.lr_scheduler.step()
        self.micro_steps += 1

    def was_step_applied(self):
        return self._step_applied

    def fp16_enabled(self):
        return True

    def get_global_grad_norm(self):
        return None if self.optimizer.overflow else 1.0

    def train(self, mode=True):
        pass


def _aligned_step(actor, critic):
    from dschat.utils.optim import optimizer_step

    with steps_skipped_together(actor, critic):
        optimizer_step(actor, "actor")
        optimizer_step(critic, "critic")


# --- the decision ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer_class", [FakeZeroOptimizer, FakeFp16Optimizer], ids=["zero1-3", "zero0_fp16"])
@pytest.mark.parametrize("actor_overflow, critic_overflow", [(True, False), (False, True), (True, True),
                                                              (False, False)])
def test_one_overflow_skips_both_steps_and_the_healthy_model_keeps_its_loss_scale(optimizer_class, actor_overflow,
                                                                                  critic_overflow, capsys):
    log = []
    actor, critic = FakeEngine("actor", log, optimizer_class), FakeEngine("critic", log, optimizer_class)
    actor.optimizer.grads_overflow, critic.optimizer.grads_overflow = actor_overflow, critic_overflow
    _aligned_step(actor, critic)
    skipped = actor_overflow or critic_overflow
    for engine, own in ((actor, actor_overflow), (critic, critic_overflow)):
        assert engine.was_step_applied() is not skipped, engine.name
        assert engine.optimizer.weight == (0.0 if skipped else 1.0), "a skipped step updates no weight"
        assert engine.lr_scheduler.last_epoch == (0 if skipped else 1), "the scheduler follows applied steps only"
        assert engine.skipped_steps == int(skipped)
        assert engine.optimizer.loss_scale == (2.0 ** 15 if own else 2.0 ** 16), "a forced skip keeps the scale"
        # the override lives for that one step: the class's methods show through again
        checker = getattr(engine.optimizer, "overflow_checker", engine.optimizer)
        assert "has_overflow" not in vars(checker) and "_update_scale" not in vars(engine.optimizer)
    out = capsys.readouterr().out
    expected = {(True, False): "OVERFLOW: actor overflow, skipping both actor and critic steps",
                (False, True): "OVERFLOW: critic overflow, skipping both actor and critic steps",
                (True, True): "OVERFLOW: actor and critic overflow"}.get((actor_overflow, critic_overflow))
    assert (expected in out) if expected else "OVERFLOW" not in out
    # the queries run in one order on every rank (collectives): actor, then critic, before either step
    assert log[:3] == ["actor.overflow_check", "critic.overflow_check", "actor.step"]
    # the next update, finite on both, applies both
    _aligned_step(actor, critic)
    assert actor.was_step_applied() and critic.was_step_applied()
    assert actor.optimizer.weight == critic.optimizer.weight == (1.0 if skipped else 2.0)


def test_decision_table():
    assert forced_skips(False, False) == ((), None)
    assert forced_skips(True, False)[0] == ("critic",)
    assert forced_skips(False, True)[0] == ("actor",)
    assert forced_skips(True, True)[0] == (), "both skip on their own"


def test_between_accumulation_boundaries_nothing_is_asked_or_forced():
    log = []
    actor, critic = FakeEngine("actor", log, gas=2), FakeEngine("critic", log, gas=2)
    actor.optimizer.grads_overflow = True
    _aligned_step(actor, critic)  # micro-step 1 of 2: steps are no-ops
    assert log == ["actor.step", "critic.step"]
    _aligned_step(actor, critic)  # the boundary
    assert log[2:4] == ["actor.overflow_check", "critic.overflow_check"]
    assert not actor.was_step_applied() and not critic.was_step_applied() and critic.skipped_steps == 1


def test_the_override_is_removed_when_the_step_raises():
    actor = FakeEngine("actor", [])
    with pytest.raises(RuntimeError, match="boom"):
        with forced_overflow(actor):
            assert actor.optimizer.has_overflow() is True
            raise RuntimeError("boom")
    assert "has_overflow" not in vars(actor.optimizer) and actor.optimizer.has_overflow() is False


def test_an_optimizer_that_skips_no_forced_step_is_an_error_not_a_silent_misalignment():
    class Deaf(FakeZeroOptimizer):  # a DeepSpeed whose step would check overflow some other way
        def step(self):
            self.overflow = False
            self.weight += 1.0

    log = []
    actor, critic = FakeEngine("actor", log), FakeEngine("critic", log)
    actor.optimizer.__class__ = Deaf
    critic.optimizer.grads_overflow = True
    with pytest.raises(RuntimeError, match="applied the actor's step it was made to skip"):
        _aligned_step(actor, critic)


def test_an_optimizer_with_no_overflow_check_is_named():
    class PlainOptimizer:  # e.g. a torch optimizer: no loss scaling, no overflow check
        pass

    engine = FakeEngine("actor", [])
    engine.optimizer = PlainOptimizer()
    with pytest.raises(TypeError, match="PlainOptimizer"):
        gradients_overflowed(engine)
    with pytest.raises(TypeError, match="PlainOptimizer has no has_overflow"):
        with forced_overflow(engine):
            pass


# --- the trainer's order ---------------------------------------------------------------------------------------
def _fake_trainer(log, align, gas=1, **settings):
    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    trainer = DeepSpeedPPOTrainer.__new__(DeepSpeedPPOTrainer)  # the models are fakes: no __init__
    trainer.args = step3_args({"dtype": "fp16" if align else "bf16", "align_overflow": align, **settings})
    trainer.actor_model, trainer.critic_model = FakeEngine("actor", log, gas=gas), FakeEngine("critic", log, gas=gas)
    trainer.actor_ema, trainer.stats, trainer.cliprange_value = object(), {}, 0.2
    trainer.align_overflow = check_align_overflow(trainer.args)
    trainer._layout = lambda mask, start: "shifted"  # any layout: no masked-SDPA patching of the fake modules
    trainer._actor_loss = lambda *a: torch.tensor(0.5)
    trainer._values = lambda critic, seq, mask, layout: torch.zeros(seq.shape[0], seq.shape[1] - 1)
    trainer._update_ema = lambda: log.append("ema")
    return trainer


def _experience(rows=2, prompt=3, answer=4):
    zeros, ones = torch.zeros(rows, answer), torch.ones(rows, prompt + answer, dtype=torch.long)
    return {"prompts": ones[:, :prompt], "input_ids": ones, "attention_mask": ones, "action_mask": zeros + 1,
            "logprobs": zeros, "ref_logprobs": zeros, "value": zeros, "advantages": zeros, "returns": zeros}


def test_without_the_flag_the_actor_steps_before_the_critics_forward_as_before():
    log = []
    _fake_trainer(log, align=False).train_rlhf(_experience())
    assert log == ["actor.backward", "actor.step", "actor.overflow_check", "ema", "critic.backward", "critic.step",
                   "critic.overflow_check"]


def test_with_the_flag_the_actor_steps_after_the_critics_backward_and_both_skip_together(capsys):
    log = []
    trainer = _fake_trainer(log, align=True)
    trainer.critic_model.optimizer.grads_overflow = True
    actor_loss, critic_loss = trainer.train_rlhf(_experience())
    assert log == ["actor.backward", "critic.backward", "actor.overflow_check", "critic.overflow_check",
                   "actor.step", "critic.step", "critic.overflow_check"]
    # the forced skip is a skipped step like DeepSpeed's own fp16 skip: the EMA does not tick (see below)
    assert not trainer.actor_model.was_step_applied() and not trainer.critic_model.was_step_applied()
    assert trainer.actor_model.skipped_steps == trainer.critic_model.skipped_steps == 1
    assert trainer.actor_model.lr_scheduler.last_epoch == trainer.critic_model.lr_scheduler.last_epoch == 0
    assert "OVERFLOW: critic overflow, skipping both actor and critic steps" in capsys.readouterr().out
    assert torch.isfinite(actor_loss) and torch.isfinite(critic_loss)
    log.clear()
    trainer.train_rlhf(_experience())
    assert trainer.actor_model.was_step_applied() and trainer.critic_model.was_step_applied()


@pytest.mark.parametrize("skipped_by", ["actor_overflow", "aligned_critic_overflow", "no_token_in_the_loss"])
def test_a_skipped_step_does_not_move_the_ema_and_the_next_applied_one_does(skipped_by):
    """The EMA ticked on every accumulation boundary, also one whose step was skipped (DeepSpeed's fp16 overflow,
    --align_overflow's skip for the critic's, --mask_truncated_answers' for no token in the loss): the weights had not
    moved, and the tick decayed the average towards them once more, as if the actor had stepped."""
    log = []
    trainer = _fake_trainer(log, align=skipped_by == "aligned_critic_overflow")
    if skipped_by == "no_token_in_the_loss":
        trainer._step_actor(skip=True)
    else:
        overflowing = trainer.actor_model if skipped_by == "actor_overflow" else trainer.critic_model
        overflowing.optimizer.grads_overflow = True
        trainer.train_rlhf(_experience())
    assert trainer.actor_model.skipped_steps == 1 and "ema" not in log
    log.clear()
    trainer.train_rlhf(_experience())
    assert trainer.actor_model.was_step_applied() and log.count("ema") == 1


def test_with_the_flag_and_accumulation_the_ema_follows_boundaries_only():
    log = []
    trainer = _fake_trainer(log, align=True, gradient_accumulation_steps=2)
    trainer.actor_model.gas = trainer.critic_model.gas = 2
    trainer.train_rlhf(_experience())
    assert log == ["actor.backward", "critic.backward", "actor.step", "critic.step"], "no boundary: nothing asked"
    log.clear()
    trainer.train_rlhf(_experience())
    assert log.count("ema") == 1 and "actor.overflow_check" in log


# --- the flag ----------------------------------------------------------------------------------------------------
def test_the_step3_parser_takes_the_flag():
    assert step3_parser().parse_args(["--align_overflow"]).align_overflow is True
    assert step3_parser().parse_args([]).align_overflow is False
    assert step3_args({"align_overflow": "true", "dtype": "fp16"}).align_overflow is True


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_flag_without_fp16_is_a_usage_error_naming_it(dtype):
    from dschat.rlhf.engine import check_step3_settings

    settings = step3_args({"align_overflow": True, "dtype": dtype, "actor_model_name_or_path": "tiny-llama"})
    with pytest.raises(UsageError, match=f"--align_overflow .*--dtype {dtype}"):
        check_align_overflow(settings)
    with pytest.raises(UsageError, match="--align_overflow"):  # step 3's checks before any model loads
        check_step3_settings(settings, 1)
    assert check_align_overflow(step3_args({"dtype": dtype})) is False, "off: any dtype"


def test_the_flag_with_nothing_to_align_is_a_usage_error():
    with pytest.raises(UsageError, match="--align_overflow .*--advantage_estimator grpo trains no critic"):
        check_align_overflow(step3_args({"align_overflow": True, "dtype": "fp16", "advantage_estimator": "grpo"}))
    with pytest.raises(UsageError, match="--align_overflow .*--unsupervised_dataset_name"):
        check_align_overflow(step3_args({"align_overflow": True, "dtype": "fp16",
                                         "unsupervised_dataset_name": "jsonl:x.jsonl"}))
    assert check_align_overflow(step3_args({"align_overflow": True, "dtype": "fp16"})) is True


# --- a real DeepSpeed ZeRO-2 engine ------------------------------------------------------------------------------
def _zero2_engine(nan_gradients):
    """A tiny ZeRO-2 engine whose first layer's gradient is NaN while ``nan_gradients[0]`` is True. bf16 with
    DeepSpeed's overflow check: the check fp16 always runs at ZeRO-1/2, in the same optimizer class."""
    import deepspeed

    from dschat.utils.ds_config import get_train_ds_config

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    model[0].weight.register_hook(lambda grad: torch.full_like(grad, float("nan")) if nan_gradients[0] else grad)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    config = get_train_ds_config(dtype="bf16", stage=2, check_grad_overflow=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine


def _backward(engine):
    engine.backward(engine(torch.randn(1, 8, dtype=torch.bfloat16, device=engine.device)).float().pow(2).mean())


def _weights(engine):
    return [p.detach().clone() for p in engine.module.parameters()]


def test_a_real_zero2_engine_is_asked_and_made_to_skip_like_an_overflowed_step(distributed):
    actor_nan, critic_nan = [True], [False]
    actor, critic = _zero2_engine(actor_nan), _zero2_engine(critic_nan)
    _backward(actor), _backward(critic)
    assert gradients_overflowed(actor) is True and gradients_overflowed(critic) is False
    before, lrs = _weights(critic), critic.get_lr()
    _aligned_step(actor, critic)
    assert not actor.was_step_applied() and not critic.was_step_applied()
    assert actor.skipped_steps == critic.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(critic))), "the healthy model did not move"
    assert critic.lr_scheduler.last_epoch == actor.lr_scheduler.last_epoch == 0 and critic.get_lr() == lrs
    assert "has_overflow" not in vars(critic.optimizer) and "_update_scale" not in vars(critic.optimizer)
    actor_nan[0] = False
    _backward(actor), _backward(critic)
    assert gradients_overflowed(actor) is False, "the skipped step cleared the NaN gradients"
    before = _weights(actor), _weights(critic)
    _aligned_step(actor, critic)
    assert actor.was_step_applied() and critic.was_step_applied()
    assert critic.lr_scheduler.last_epoch == actor.lr_scheduler.last_epoch == 1
    for engine, weights in zip((actor, critic), before):
        assert not all(torch.equal(a, b) for a, b in zip(weights, _weights(engine))), "a normal update moves both"


def test_get_overflow_says_whose_last_step_skipped_its_inf_nan_gradients_as_deepspeed_chats_does(distributed):
    """DeepSpeed-Chat's loop asks ``trainer.get_overflow()`` after each iteration (its --test_stop_step counts the
    steps that did not overflow): an AttributeError here."""
    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    actor_nan, critic_nan = [True], [False]
    trainer = DeepSpeedPPOTrainer.__new__(DeepSpeedPPOTrainer)  # (real engines, no models to build)
    trainer.actor_model, trainer.critic_model = _zero2_engine(actor_nan), _zero2_engine(critic_nan)
    assert trainer.get_overflow() == (False, False)  # no step yet
    for nan in (True, False):
        actor_nan[0] = nan
        for engine in (trainer.actor_model, trainer.critic_model):
            _backward(engine)
            engine.step()
        assert trainer.get_overflow() == (nan, False)
    actor_nan[0], critic_nan[0] = False, True
    for engine in (trainer.actor_model, trainer.critic_model):
        _backward(engine)
        engine.step()
    assert trainer.get_overflow() == (False, True)
    trainer.critic_model = None  # a critic-free estimator's
    assert trainer.get_overflow() == (False, False)


@pytest.mark.multirank
def test_real_fp16_engines_at_zero_0_2_3_skip_together_on_every_rank():
    """``tests/scripts/align_overflow_fp16.py`` through the deepspeed launcher: 2 ranks on the CPU (gloo), one per GPU
    (at most 2) on GPUs; the overflow is made on the last rank alone."""
    from deepspeed.accelerator import get_accelerator

    from launch import run_deepspeed

    accelerator = get_accelerator()
    if not accelerator.is_fp16_supported():
        pytest.skip(f"DeepSpeed's {accelerator.device_name()} accelerator cannot train in fp16 (a CPU needs "
                    "AVX512-FP16 or AMX-FP16)")
    ranks = 2 if accelerator.device_name() == "cpu" else min(2, accelerator.device_count())
    proc = run_deepspeed(Path(__file__).parent / "scripts" / "align_overflow_fp16.py", num_gpus=ranks, timeout=600)
    for rank in range(ranks):
        assert f"rank {rank} of {ranks} on {accelerator.device_name()}: all passed" in proc.stdout, proc.stdout[-6000:]
    # every stage and case ran all its checks on every rank: the query, 5 per model after the skip, 3 after the next
    assert proc.stdout.count("PASS rank ") == ranks * 3 * 3 * (1 + 2 * 5 + 2 * 3)
