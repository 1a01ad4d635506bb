#!/usr/bin/env python
"""Score answers with a trained reward model (DeepSpeed-Chat's step-2 ``rw_eval.py``):
``python training/step2_rm/rw_eval.py --model_name_or_path output/step2_rm`` (held-out pair accuracy),
``... --pairs_file pairs.jsonl`` or ``... --prompt "Name 3 colors." --answer "red, blue, green" --answer "red"``."""
from dschat.tools.rw_eval import main
from dschat.utils.cli import run_script

if __name__ == "__main__":
    run_script(main)
