"""Data parallelism changes nothing of the update: two ranks, each with half of a rollout, make the optimizer step one
rank makes with all of it, for the normalisations that are global by design (--loss_agg global_token_mean and the
answer means over every rank's answers, --grpo_norm_by_std batch, --mask_truncated_answers, whitening of GAE's and
REINFORCE++'s advantages over the rollout), with and without gradient accumulation; and, for the PPO case with a critic
and a GRPO case, at each ZeRO stage over two optimizer steps (--ppo_epochs 2) and over two mini-batches of an epoch,
the weights after them (the global gradient clipping included) and the EMA copy's too."""
import sys
from pathlib import Path

import pytest
import torch

from launch import run_deepspeed

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import one_rank_vs_two  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory, distributed):
    """{"one", "two": {case: {model: [the gradient each optimizer step applied], "<model> weights": [its weights
    after them]}}}: one rank's in this process, two ranks' through the deepspeed launcher."""
    root = tmp_path_factory.mktemp("one_rank_vs_two")
    one = one_rank_vs_two.run(one_rank_vs_two.model_folder(root / "one"))
    run_deepspeed(SCRIPTS / "one_rank_vs_two.py", str(root), timeout=300)
    return {"one": one, "two": torch.load(root / "results.pt")}


# The first optimizer step's gradients agree to float rounding. Adam turns a gradient near 0 (beside its eps) into a
# step that rounding changes by a few 1e-6 (of the 1e-3 learning rate): the weights after the steps agree to 2% of one
# step, and the later steps' gradients, taken at those weights, to 0.1% (a divisor off by a rank is 50% or 100%).
FIRST_GRADIENT = {"rtol": 1e-4, "atol": 1e-6}
AFTER_A_STEP = {"rtol": 1e-3, "atol": 2e-5}


def assert_same_update(theirs, ours, what):
    """The gradients of each optimizer step and the weights after them (``run_case``'s dicts) agree."""
    assert ours.keys() == theirs.keys()
    assert "actor" in ours and "actor weights" in ours
    for model in ours:
        for step, (their, our) in enumerate(zip(theirs[model], ours[model])):
            weights = model.endswith(" weights")
            tolerance = FIRST_GRADIENT if step == 0 and not weights else AFTER_A_STEP
            name = model if weights else f"{model}'s gradient of optimizer step {step + 1}"
            torch.testing.assert_close(their, our, **tolerance, msg=lambda m: f"{what}: the {name} differ:\n{m}")


@pytest.mark.parametrize("case", one_rank_vs_two.case_names())
def test_two_ranks_with_half_the_rollout_each_step_as_one_rank_with_all_of_it(results, case):
    one, two = results["one"][case], results["two"][case]
    steps = one_rank_vs_two.optimizer_steps(case)
    for model in (name for name in one if not name.endswith(" weights")):
        assert len(one[model]) == len(two[model]) == steps, f"{case}: {steps} optimizer step(s) over the rollout"
    assert_same_update(two, one, f"{case}, 2 ranks against 1")


@pytest.mark.parametrize("ranks", ["one", "two"])
@pytest.mark.parametrize("stage", one_rank_vs_two.STAGES[1:])
@pytest.mark.parametrize("case", one_rank_vs_two.SHARDED)
def test_each_zero_stage_steps_as_zero_0(results, case, stage, ranks):
    """ZeRO's partitions change nothing of the update either, with gradient accumulation: a ZeRO-3 critic, called
    past its engine's forward, replaced the first micro-batch's gradient with the second's."""
    ours = results[ranks][f"{case}_zero{stage}_two_steps"]
    assert_same_update(ours, results[ranks][f"{case}_zero0_two_steps"], f"{case} on {ranks} rank(s), ZeRO-{stage} "
                       "against ZeRO-0")
