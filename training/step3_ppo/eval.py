#!/usr/bin/env python
"""Held-out reward and rule score of a PPO policy and a baseline:
``python training/step3_ppo/eval.py --policy output/step3_ppo/actor --baseline output/step1_sft
--reward_model output/step2_rm --output_json output/step3_eval.json``."""
from dschat.tools.ppo_eval import main
from dschat.utils.cli import run_script

if __name__ == "__main__":
    run_script(main)
