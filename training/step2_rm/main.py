#!/usr/bin/env python
"""Step 2 (reward model). ``python training/step2_rm/main.py`` or ``deepspeed training/step2_rm/main.py ...``."""
from dschat.steps.reward import main
from dschat.utils.cli import run_script

if __name__ == "__main__":
    run_script(main, resumable=True)
