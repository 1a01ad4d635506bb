"""ZeRO-3 on 2 CPU ranks through the deepspeed launcher (tests/scripts/hybrid_zero3.py)."""
from pathlib import Path

import pytest

from tests.launch import launch_once, launched, run_deepspeed

SCRIPT = Path(__file__).parent / "scripts" / "hybrid_zero3.py"


CASES = [("true", "layer"), ("true", "module"), ("false", "layer"), ("false", "module")]


@pytest.fixture(scope="module")
def zero3_launch():
    """Every case in one launch; each test checks its own case's lines. The timeout turns a deadlock (ranks disagreeing
    on when to stop decoding) into a failure."""
    return launch_once(SCRIPT, "--runs", *(f"{pin}:{fetch}" for pin, fetch in CASES))


@pytest.mark.multirank
@pytest.mark.parametrize("pin,fetch", CASES)
def test_zero3_two_ranks_match_unsharded_reference(pin, fetch, zero3_launch):
    proc = launched(zero3_launch)
    for rank in (0, 1):
        assert f"rank {rank} pin={pin == 'true'} fetch={fetch} lora=False: OK" in proc.stdout
        assert f"rank {rank} pin={pin == 'true'} fetch={fetch} lora=True: OK" in proc.stdout
        assert f"rank {rank} ALL OK" in proc.stdout


@pytest.mark.multirank
def test_eval_or_generate_on_one_rank_alone_stops_every_rank_and_a_write_on_rank_0_reaches_every_copy():
    """tests/scripts/hybrid_zero3_out_of_step.py: rank 0's lone generate paired with rank 1's next eval() (the ranks
    then one collective apart, hanging later); now both raise, saying so. A parameter replaced on rank 0 alone raised
    there alone (rank 1 went on into the gather); now both raise. Replaced on rank 0 before a train() with no eval()
    or generate, it was refused on no rank (train() met none); the train() that begins a train phase meets the world
    now: both raise there, rank 0 naming it. That meeting also catches an eval() + generate on rank 0 alone (it met
    rank 1's next rollout, then waited for ever): both stop at rank 1's train(). The timeout turns a hang into a
    failure."""
    proc = run_deepspeed(Path(__file__).parent / "scripts" / "hybrid_zero3_out_of_step.py", timeout=300)
    for rank in (0, 1):
        for line in ("out of step: refused", "in step again", "write seen", "surgery on rank 0: refused",
                     "surgery undone: in step", "surgery before train(): refused", "lone generate: out of step at "
                     "train()", "ALL OK"):
            assert f"rank {rank} {line}" in proc.stdout, (rank, line, proc.stdout[-3000:])
