#!/usr/bin/env python
"""Step 2, DPO (instead of steps 2 and 3). ``python training/step2_dpo/main.py --model_name_or_path output/step1_sft``
or ``deepspeed training/step2_dpo/main.py ...``."""
from dschat.steps.dpo import main
from dschat.utils.cli import run_script

if __name__ == "__main__":
    run_script(main, resumable=True)
