"""ZeRO-3 on 2 CPU ranks through the deepspeed launcher (tests/scripts/hybrid_zero3.py)."""
from pathlib import Path

import pytest

from tests.launch import run_deepspeed

SCRIPT = Path(__file__).parent / "scripts" / "hybrid_zero3.py"


CASES = [("true", "layer"), ("true", "module"), ("false", "layer"), ("false", "module")]


@pytest.fixture(scope="module")
def zero3_launch():
    """One launch for every case (the launcher and the ranks' start cost ~20 s per launch); each test checks its own
    case's lines. The timeout turns a deadlock (ranks disagreeing on when to stop decoding) into a failure."""
    try:
        return run_deepspeed(SCRIPT, "--runs", *(f"{pin}:{fetch}" for pin, fetch in CASES), timeout=900)
    except AssertionError as error:  # every test that needs the launch fails with the script's output
        return error


@pytest.mark.multirank
@pytest.mark.parametrize("pin,fetch", CASES)
def test_zero3_two_ranks_match_unsharded_reference(pin, fetch, zero3_launch):
    if isinstance(zero3_launch, AssertionError):
        raise zero3_launch
    for rank in (0, 1):
        assert f"rank {rank} pin={pin == 'true'} fetch={fetch} lora=False: OK" in zero3_launch.stdout
        assert f"rank {rank} pin={pin == 'true'} fetch={fetch} lora=True: OK" in zero3_launch.stdout
        assert f"rank {rank} ALL OK" in zero3_launch.stdout
