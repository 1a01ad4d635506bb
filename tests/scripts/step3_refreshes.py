"""Step 3 (training/step3_ppo's main, the arguments given) with each refresh of the hybrid engine's inference copy
counted (``helpers.count_copy_refreshes``); each rank prints its counts. Run by tests/test_ppo.py through the
deepspeed launcher."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import count_copy_refreshes  # noqa: E402


def main():
    from dschat.steps import ppo
    from dschat.utils.dist import get_rank

    counts = count_copy_refreshes(setattr)
    ppo.main(sys.argv[1:])
    print(f"rank {get_rank()} refreshes={counts['refreshes']} by_writes={counts['by_writes']}", flush=True)


if __name__ == "__main__":
    main()
