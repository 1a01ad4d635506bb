"""Data parallelism changes nothing of the update: two ranks, each with half of a rollout, make the optimizer step one
rank makes with all of it, for the normalisations that are global by design (--loss_agg global_token_mean and the
answer means over every rank's answers, --grpo_norm_by_std batch, --mask_truncated_answers, whitening of GAE's and
REINFORCE++'s advantages over the rollout), with and without gradient accumulation."""
import sys
from pathlib import Path

import pytest
import torch

from launch import run_deepspeed

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import one_rank_vs_two  # noqa: E402


@pytest.fixture(scope="module")
def grads(tmp_path_factory, distributed):
    """{"one", "two": {case: {model: [the gradient each optimizer step applied]}}}: one rank's in this process, two
    ranks' through the deepspeed launcher."""
    root = tmp_path_factory.mktemp("one_rank_vs_two")
    one = one_rank_vs_two.run(one_rank_vs_two.model_folder(root / "one"))
    run_deepspeed(SCRIPTS / "one_rank_vs_two.py", str(root), timeout=300)
    return {"one": one, "two": torch.load(root / "grads.pt")}


@pytest.mark.parametrize("case", one_rank_vs_two.case_names())
def test_two_ranks_with_half_the_rollout_each_step_as_one_rank_with_all_of_it(grads, case):
    one, two = grads["one"][case], grads["two"][case]
    assert one.keys() == two.keys()
    for model in one:
        assert len(one[model]) == len(two[model]) == 1, "one optimizer step over the rollout"
        torch.testing.assert_close(two[model][0], one[model][0], rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{case}: the {model}'s gradient on 2 ranks differs from 1 rank's:\n{m}")
