"""ZeRO-3 on 2 CPU ranks through the deepspeed launcher (tests/scripts/hybrid_zero3.py)."""
from pathlib import Path

import pytest

from tests.launch import run_deepspeed

SCRIPT = Path(__file__).parent / "scripts" / "hybrid_zero3.py"


@pytest.mark.multirank
@pytest.mark.parametrize("pin,fetch", [("true", "layer"), ("true", "module"), ("false", "layer"), ("false", "module")])
def test_zero3_two_ranks_match_unsharded_reference(pin, fetch):
    # The timeout turns a deadlock (ranks disagreeing on when to stop decoding) into a failure.
    proc = run_deepspeed(SCRIPT, "--pin", pin, "--fetch", fetch, timeout=400)
    for rank in (0, 1):
        assert f"rank {rank} pin={pin == 'true'} fetch={fetch} lora=False: OK" in proc.stdout
        assert f"rank {rank} pin={pin == 'true'} fetch={fetch} lora=True: OK" in proc.stdout
        assert f"rank {rank} ALL OK" in proc.stdout
