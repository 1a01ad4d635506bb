"""DPO's --rpo_alpha NLL term under --loss_agg global_token_mean (the default) is the mean over the chosen answer tokens
of the whole optimizer step, all its micro-batches on all ranks: the same four pairs split into 1x4, 2x2 or 4x1
micro-batches x pairs on one rank, or 1x2 and 2x1 on each of two, apply the same gradient, plain torch's of that loss;
token_mean keeps each micro-batch's own token mean (TRL's per batch), which depends on the split. The DPO term itself
stays the mean over the pairs."""
import sys
from pathlib import Path

import pytest
import torch

from launch import launch_and_load

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import dpo_rpo_token_mean  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory, distributed):
    """{"one", "two": ``dpo_rpo_token_mean.run()``'s}: one rank's in this process, two ranks' through the deepspeed
    launcher."""
    root = tmp_path_factory.mktemp("dpo_rpo_token_mean")
    one = dpo_rpo_token_mean.run()
    two = launch_and_load(SCRIPTS / "dpo_rpo_token_mean.py", str(root), timeout=300,
                          load=lambda: torch.load(root / "results.pt"))
    return {"one": one, "two": two}


CASES = [("one", mode, split) for mode in dpo_rpo_token_mean.MODES for split in ("1x4", "2x2", "4x1")] + \
    [("two", mode, split) for mode in dpo_rpo_token_mean.MODES for split in ("1x2", "2x1")]


@pytest.mark.parametrize("ranks, mode, split", CASES)
def test_the_step_applies_the_gradient_of_its_loss_agg(results, ranks, mode, split):
    case = results[ranks][f"{mode}_{split}"]
    (gradient, logged), (expected, loss) = case["trained"], case["torch"]
    torch.testing.assert_close(gradient, expected, rtol=1e-5, atol=1e-7,
                               msg=lambda m: f"{mode}, {split} on {ranks} rank(s): the applied gradient differs:\n{m}")
    if mode == "global_token_mean" or ranks == "one":  # (token_mean logs rank 0's micro-batches' mean)
        assert logged == pytest.approx(loss, rel=1e-6), f"{mode}, {split} on {ranks} rank(s): the logged loss"


def test_every_split_of_the_pairs_applies_the_same_gradient(results):
    """The brief's check itself: 1x4, 2x2 and 4x1 on one rank, and 1x2 and 2x1 on each of two ranks, alike."""
    gradients = [results[ranks][f"global_token_mean_{split}"]["trained"][0] for ranks, mode, split in CASES
                 if mode == "global_token_mean"]
    for gradient in gradients[1:]:
        torch.testing.assert_close(gradient, gradients[0], rtol=1e-5, atol=1e-7)


def test_each_micro_batchs_own_token_mean_depends_on_the_split(results):
    """token_mean (TRL's, and DPO's before global_token_mean) differs between the splits: the chosen answers' 1 to 14
    tokens make the test above tell the two means apart."""
    one = results["one"]
    whole, split = one["token_mean_1x4"]["trained"][0], one["token_mean_4x1"]["trained"][0]
    assert (whole - split).norm() > 0.05 * whole.norm()
    torch.testing.assert_close(one["token_mean_1x4"]["trained"][0], one["global_token_mean_1x4"]["trained"][0])


def test_dpo_reads_loss_agg_only_with_rpo_alpha():
    from dschat.args import step2_dpo_parser, supervised_conditional_flags, unread_conditional_flags

    parser = step2_dpo_parser()
    plain = parser.parse_args(["--loss_agg", "token_mean"])
    assert unread_conditional_flags(plain, parser, supervised_conditional_flags(2)) == \
        ["--loss_agg token_mean (read only with --rpo_alpha)"]
    rpo = parser.parse_args(["--loss_agg", "token_mean", "--rpo_alpha", "1.0"])
    assert unread_conditional_flags(rpo, parser, supervised_conditional_flags(2)) == []
