"""Step 1's --loss_agg: global_token_mean (the default) makes an optimizer step's gradient the one of the token mean
over all its micro-batches on all ranks, whatever their token counts (as HF's Trainer since transformers 4.46 and TRL's
SFTTrainer); token_mean keeps DeepSpeed-Chat's mean of the micro-batches' means. Checked against plain torch over
micro-batches of 2 to 30 labelled tokens, with gradient accumulation, on one rank and on two (the ranks' token
counts differing too), at ZeRO-0 and ZeRO-2."""
import sys
from pathlib import Path

import pytest
import torch

from launch import launch_and_load

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import sft_token_mean  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory, distributed):
    """{"one", "two": ``sft_token_mean.run()``'s}: one rank's in this process, two ranks' through the deepspeed
    launcher."""
    root = tmp_path_factory.mktemp("sft_token_mean")
    one = sft_token_mean.run()
    two = launch_and_load(SCRIPTS / "sft_token_mean.py", str(root), timeout=300,
                          load=lambda: torch.load(root / "results.pt"))
    return {"one": one, "two": two}


CASES = [f"{mode}_zero{stage}" for mode in sft_token_mean.MODES for stage in sft_token_mean.STAGES]


@pytest.mark.parametrize("ranks", ["one", "two"])
@pytest.mark.parametrize("case", CASES)
def test_the_step_applies_the_gradient_of_its_loss_agg(results, case, ranks):
    (gradient, logged), (expected, loss) = results[ranks][case]["trained"], results[ranks][case]["torch"]
    torch.testing.assert_close(gradient, expected, rtol=1e-5, atol=1e-7,
                               msg=lambda m: f"{case} on {ranks} rank(s): the applied gradient differs:\n{m}")
    if case.startswith("global_token_mean") or ranks == "one":  # (token_mean logs rank 0's micro-batches' mean)
        assert logged == pytest.approx(loss, rel=1e-6), f"{case} on {ranks} rank(s): the logged loss"


def test_the_two_means_differ_on_these_micro_batches(results):
    """The micro-batches' token counts (2 to 30) make the two losses far apart: the test above tells them apart."""
    (token, _), (micro, _) = (results["one"][f"{mode}_zero0"]["torch"] for mode in sft_token_mean.MODES)
    assert (token - micro).norm() > 0.1 * micro.norm()


def test_step1_takes_the_token_mean_by_default_and_plain_dpo_says_it_ignores_the_flag(capsys):
    from dschat.args import step1_parser, supervised_conditional_flags, unread_conditional_flags

    assert step1_parser().parse_args([]).loss_agg == "global_token_mean"
    args = step1_parser().parse_args(["--loss_agg", "token_mean"])
    assert unread_conditional_flags(args, step1_parser(), supervised_conditional_flags(1)) == []
    assert unread_conditional_flags(args, step1_parser(), supervised_conditional_flags(2)) == \
        ["--loss_agg token_mean (read only with --rpo_alpha)"]
