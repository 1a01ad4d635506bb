"""--mask_truncated_answers: an optimizer step whose accumulation group has no token in the loss on any rank (every
answer cut) is skipped, through DeepSpeed's own overflow path (``forced_overflow``): weights, Adam's state and the lr
schedule as they were, ``skipped_steps`` + 1. A group with a token anywhere (one micro-batch, one rank) steps on every
rank; a PPO-ptx actor steps on its language-model loss. ``tests/scripts/no_token_steps.py`` trains the tiny GPT-2 on
one rank here and on two through the deepspeed launcher."""
import contextlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dschat.utils.optim import optimizer_step
from launch import launch_and_load

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import no_token_steps  # noqa: E402


# --- forced_overflow on each optimizer DeepSpeed builds ----------------------------------------------------------
# (dtype, ZeRO stage, the DeepSpeed config's gradient accumulation dtype): the optimizer class DeepSpeed builds
OPTIMIZERS = {("fp32", 0, None): "AdamW", ("bf16", 0, None): "FP16_UnfusedOptimizer",
              ("fp32", 1, None): "DeepSpeedZeroOptimizer", ("bf16", 2, None): "DeepSpeedZeroOptimizer",
              ("fp32", 3, None): "DeepSpeedZeroOptimizer_Stage3", ("bf16", 3, None): "DeepSpeedZeroOptimizer_Stage3",
              ("bf16", 1, "fp32"): "BF16_Optimizer"}


def _engine(dtype, stage, grad_accum_dtype):
    import deepspeed

    from dschat.utils.ds_config import get_train_ds_config

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    config = get_train_ds_config(dtype=dtype, stage=stage, gradient_accumulation_steps=2)
    if grad_accum_dtype:
        config["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine


def _backward(engine, scale=1.0):
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    engine.backward(engine(torch.randn(2, 8, dtype=dtype, device=engine.device)).float().pow(2).mean() * scale)


def _state(engine):
    """The master weights, Adam's state, the lr schedule and the skip count (``no_token_steps.model_state``)."""
    state = no_token_steps.model_state(engine)
    return {"weights": state["weights"], "moments": state["optimizer"], "lr_steps": state["lr_steps"],
            "lr": state["lr"], "skipped": state["skipped_steps"]}


@pytest.mark.parametrize("dtype, stage, grad_accum_dtype", OPTIMIZERS, ids=[f"{d}_zero{s}{'_' + a if a else ''}"
                                                                           for d, s, a in OPTIMIZERS])
def test_a_forced_skip_leaves_weights_adam_state_and_lr_schedule_of_every_deepspeed_optimizer_as_they_were(
        distributed, dtype, stage, grad_accum_dtype):
    """Each optimizer DeepSpeed builds for dschat asks another overflow check (or none: fp32 at ZeRO-0, bf16 at
    ZeRO-1/2 without --check_grad_overflow, ZeRO-3 outside fp16): a skip forced on any of them leaves the step
    undone as DeepSpeed's overflow path does, and the next step applies as usual."""
    engine = _engine(dtype, stage, grad_accum_dtype)
    assert type(engine.optimizer).__name__ == OPTIMIZERS[dtype, stage, grad_accum_dtype]
    for _ in range(2):  # a real step: Adam's moments no longer 0, so a step on zero gradients would move weights
        _backward(engine)
        optimizer_step(engine, "model")
    before, attributes = _state(engine), set(vars(engine.optimizer))
    for _ in range(2):
        _backward(engine, 0.0)
        optimizer_step(engine, "model", skip=True)
    after = _state(engine)
    assert not engine.was_step_applied() and after["skipped"] == before["skipped"] + 1
    assert torch.equal(after["weights"], before["weights"]) and torch.equal(after["moments"], before["moments"])
    assert (after["lr_steps"], after["lr"]) == (before["lr_steps"], before["lr"])
    assert set(vars(engine.optimizer)) == attributes  # the overrides are gone
    for _ in range(2):
        _backward(engine)
        optimizer_step(engine, "model")
    assert engine.was_step_applied() and _state(engine)["lr_steps"] == before["lr_steps"] + 1
    assert not torch.equal(_state(engine)["weights"], before["weights"])


def test_a_skip_asked_between_accumulation_boundaries_is_an_ordinary_micro_step(distributed):
    engine = _engine("fp32", 0, None)
    _backward(engine)
    assert optimizer_step(engine, "model", skip=True) is False  # (no optimizer step to skip)
    _backward(engine)
    optimizer_step(engine, "model")
    assert engine.was_step_applied() and engine.skipped_steps == 0


# --- the trainer: one rank and two ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results(tmp_path_factory, distributed):
    """{"one", "two": ``no_token_steps.run``'s results}: one rank's in this process, two ranks' (rank 0's view)
    through the deepspeed launcher."""
    root = tmp_path_factory.mktemp("no_token_steps")
    one = no_token_steps.run(no_token_steps.model_folder(root / "one"))
    two = launch_and_load(SCRIPTS / "no_token_steps.py", str(root / "two"), timeout=300,
                          load=lambda: torch.load(root / "two" / "results.pt"))
    return {"one": one, "two": two}


def _unchanged(case, model):
    before, after = case["before"][model], case["after"][model]
    return (torch.equal(before["weights"], after["weights"]) and torch.equal(before["optimizer"], after["optimizer"])
            and (before["lr_steps"], before["lr"]) == (after["lr_steps"], after["lr"]))


def _skipped(case, model):
    return case["after"][model]["skipped_steps"] - case["before"][model]["skipped_steps"]


@pytest.mark.parametrize("ranks", ["one", "two"])
@pytest.mark.parametrize("name", ["every_answer_cut", "every_answer_cut_zero2"])
def test_a_step_with_every_answer_cut_leaves_both_models_as_they_were_and_says_so(results, ranks, name):
    """Its loss is 0 and its gradients 0; stepped, Adam's momentum and weight decay moved the weights, Adam counted
    a step and the lr schedule advanced. Skipped: all as it was, DeepSpeed's skip count + 1, reported as
    "<model>_no_token_steps" (not as a skip on inf/NaN gradients)."""
    case = results[ranks][name]
    for model in ("actor", "critic"):
        assert _unchanged(case, model), model
        assert _skipped(case, model) == 1
        assert case["result"][f"{model}_no_token_steps"] == 1 and case["result"][f"{model}_skipped_steps"] == 0


@pytest.mark.parametrize("ranks", ["one", "two"])
def test_a_step_with_tokens_in_one_micro_batch_of_one_rank_steps_on_every_rank(results, ranks):
    """One rank: the step's second micro-batch holds an ended answer. Two ranks: rank 1's does, rank 0's answers are
    all cut (these results are rank 0's): the ranks agree on the group's tokens, and rank 0 steps too."""
    case = results[ranks]["tokens_on_the_last_rank_only"]
    for model in ("actor", "critic"):
        assert not _unchanged(case, model), model
        assert case["after"][model]["lr_steps"] == case["before"][model]["lr_steps"] + 1
        assert _skipped(case, model) == 0 and case["result"][f"{model}_no_token_steps"] == 0


@pytest.mark.parametrize("ranks", ["one", "two"])
def test_a_ptx_actor_steps_on_its_language_model_loss_while_the_critic_skips(results, ranks):
    """PPO-ptx: the actor's step accumulates the language-model micro-steps, whose loss has tokens: it steps on them
    alone; the critic's loss has none, and it skips."""
    case = results[ranks]["every_answer_cut_ptx"]
    assert not _unchanged(case, "actor") and case["result"]["actor_no_token_steps"] == 0
    assert _unchanged(case, "critic") and case["result"]["critic_no_token_steps"] == 1


def test_step3s_record_and_log_line_say_the_steps_skipped_for_no_token(results, monkeypatch, tmp_path):
    """train_rollout's counts reach the iteration's record (its JSON line and TensorBoard) and its printed line, apart
    from the skips on inf/NaN gradients."""
    from dschat.rlhf.config import step3_args
    from dschat.steps import ppo

    trained = {**results["one"]["every_answer_cut"]["result"], "kl_coef": 0.1}
    rows = no_token_steps.ROWS
    buffer = [{"rewards": torch.zeros(rows), "input_ids": torch.zeros(rows, 3), "attention_mask": torch.ones(rows, 3),
               "action_mask": torch.ones(rows, 2)}]
    gen_stats = {"answer_length": 2.0, "empty_answers": 0, "truncated_answers": rows, "generation_time": 0.1,
                 "experience_time": 0.1}
    monkeypatch.setattr(ppo, "rank_mean", lambda value, device: value)
    record = ppo._iteration_record(0, buffer, SimpleNamespace(stats={}), gen_stats, trained, 0.1, 1.0, "cpu")
    assert (record["actor_no_token_steps"], record["critic_no_token_steps"]) == (1, 1)
    assert (record["actor_skipped_steps"], record["critic_skipped_steps"]) == (0, 0)
    lines = []
    bar = SimpleNamespace(update=lambda n: None, set_postfix=lambda **kw: None, write=lines.append)
    args = step3_args({key: value for key, value in no_token_steps.SETTINGS.items() if key != "reward_fn"})
    ppo._log_iteration(record, str(tmp_path / "step3_log.jsonl"), None, bar, args,
                       SimpleNamespace(actor_model=object()), buffer)
    assert lines[0].endswith(f"(all {rows} answers truncated and left out of the loss by --mask_truncated_answers: "
                             "a loss of 0, no gradient; optimizer steps skipped for no token in the loss: actor 1 of "
                             "1, critic 1 of 1)"), lines[0]
    assert "inf/NaN" not in lines[0]


def test_the_end_of_run_warning_leaves_the_steps_skipped_for_no_token_out(capsys):
    """DeepSpeed counts a step skipped for no token alike with one skipped on inf/NaN gradients: a run whose answers
    were mostly cut was warned that its gradients were not finite."""
    from dschat.rlhf.config import step3_args
    from dschat.steps import ppo

    args = step3_args({key: value for key, value in no_token_steps.SETTINGS.items() if key != "reward_fn"})
    steps = 2 * ppo.optimizer_steps_per_iteration(args)
    engine = SimpleNamespace(skipped_steps=steps, fp16_enabled=lambda: False)
    for skipped_for_no_token, warned in ((steps, False), (0, True)):
        counts = {"actor": skipped_for_no_token, "critic": skipped_for_no_token}
        ppo.warn_of_skipped_ppo_steps(SimpleNamespace(actor_model=engine, critic_model=engine,
                                                      no_token_skips=counts), args, 2)
        said = capsys.readouterr().out
        assert ("skipped" in said and "inf/NaN" in said) is warned, said


@contextlib.contextmanager
def _trained_once(tmp_path):
    """(engine, trainer) of the tiny GPT-2 actor and critic (``no_token_steps``' settings), after one ordinary step
    (Adam's moments not 0), for a notebook's hand loop."""
    from dschat import DeepSpeedPPOTrainer, DeepSpeedRLHFEngine
    from dschat.tiny import load_tiny_tokenizer

    folder = no_token_steps.model_folder(tmp_path)
    tokenizer = load_tiny_tokenizer()
    tokenizer.padding_side = "left"
    args = {**no_token_steps.SETTINGS, "critic_model_name_or_path": str(folder)}
    with DeepSpeedRLHFEngine(actor_model_name_or_path=str(folder), tokenizer=tokenizer, args=args) as engine:
        trainer = DeepSpeedPPOTrainer(engine=engine, args=args)
        trainer.train_rollout([no_token_steps.rollout(trainer, range(no_token_steps.ROWS))])
        yield engine, trainer


@contextlib.contextmanager
def _interrupted_in_the_forward(engine):
    """The calls inside stop at the actor's first forward (a notebook's interrupt), before any backward."""
    def interrupt(module, inputs):
        raise KeyboardInterrupt

    hook = engine.actor.module.register_forward_pre_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        hook.remove()


def test_a_micro_batch_stopped_before_its_backward_leaves_the_next_no_token_step_skipped(distributed, tmp_path):
    """A train_rollout stopped in a group's first micro-batch before its backward (a notebook's interrupt during the
    forward, an error there) leaves DeepSpeed at its accumulation boundary, so the next call goes on; the trainer had
    already counted that micro-batch in its group, and from then on it decided each group at a micro-batch off
    DeepSpeed's boundary, where a skip is ignored: every later step with no token in the loss was taken."""
    with _trained_once(tmp_path) as (engine, trainer):
        every_answer_cut = no_token_steps.rollout(trainer, [])
        with _interrupted_in_the_forward(engine):
            trainer.train_rollout([every_answer_cut])
        before = no_token_steps.model_state(engine.actor)
        result = trainer.train_rollout([no_token_steps.rollout(trainer, [])])
        assert torch.equal(no_token_steps.model_state(engine.actor)["weights"], before["weights"])
        assert result["actor_no_token_steps"] == result["critic_no_token_steps"] == 1


def test_a_hand_loop_retrying_a_groups_last_micro_batch_still_skips_its_no_token_step(distributed, tmp_path):
    """train_rlhf interrupted in the last micro-batch of a group before its backward (a notebook's interrupt), then
    called again on that micro-batch: DeepSpeed took one micro-step of the group, as before the interrupt, and the
    retried one ends it. A count of the trainer's own had taken the interrupted call for the group's last and the retry
    for the next group's first, so the step with no token in the loss was taken, on zero gradients (Adam's momentum and
    weight decay moving the weights); the position in the group is DeepSpeed's, and it is skipped."""
    from dschat.rlhf.trainer import split_rows

    with _trained_once(tmp_path) as (engine, trainer):
        first, last = split_rows(no_token_steps.rollout(trainer, []),
                                 no_token_steps.SETTINGS["per_device_training_batch_size"])
        before = no_token_steps.model_state(engine.actor)
        trainer.train_rlhf(first)
        with _interrupted_in_the_forward(engine):
            trainer.train_rlhf(last)
        trainer.train_rlhf(last)
        assert engine.actor.is_gradient_accumulation_boundary() is False  # (the step ended: the next one's first)
        assert torch.equal(no_token_steps.model_state(engine.actor)["weights"], before["weights"])
        assert trainer.no_token_skips == {"actor": 1, "critic": 1}
