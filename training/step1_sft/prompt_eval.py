#!/usr/bin/env python
"""Compare a baseline and a fine-tuned model on the same prompts (DeepSpeed-Chat's step-1 ``prompt_eval.py``):
``python training/step1_sft/prompt_eval.py --model_name_or_path_baseline tiny-llama
--model_name_or_path_finetune output/step1_sft``."""
from dschat.tools.prompt_eval import main
from dschat.utils.cli import run_script

if __name__ == "__main__":
    run_script(main)
