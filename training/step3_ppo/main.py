#!/usr/bin/env python
"""Step 3 (PPO). ``python training/step3_ppo/main.py --actor_model_name_or_path output/step1_sft
--critic_model_name_or_path output/step2_rm`` or under ``deepspeed`` for several GPUs/ranks."""
from dschat.steps.ppo import main
from dschat.utils.cli import run_script

if __name__ == "__main__":
    run_script(main, resumable=True)
