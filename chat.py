#!/usr/bin/env python
"""Chat with a trained model: ``python chat.py --path output`` (interactive; 'clear' starts a new conversation,
'quit' or 'exit' ends it) or ``python chat.py --path output --prompt "Name 3 colors."`` (one answer, then exit)."""

from dschat.tools.chat import main
from dschat.utils.cli import run_script

if __name__ == "__main__":
    run_script(main)
