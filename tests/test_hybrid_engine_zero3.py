"""ZeRO-3 on 2 CPU ranks through the deepspeed launcher (tests/scripts/hybrid_zero3.py)."""
from pathlib import Path

import pytest

from tests.launch import launch_once, launched

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
