#!/usr/bin/env python
"""Step 1 (SFT). Single process: ``python training/step1_sft/main.py``; several GPUs/ranks:
``deepspeed training/step1_sft/main.py --model_name_or_path facebook/opt-1.3b --data_path Dahoas/rm-static``."""
from dschat.steps.sft import main
from dschat.utils.cli import run_script

if __name__ == "__main__":
    run_script(main, resumable=True)
