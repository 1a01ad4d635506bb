"""Entry points: a data error (the user's file or record, already named in the message) ends the run with that
message and exit status 2, not a traceback through datasets and the step code; DSCHAT_TRACEBACK=1 shows it."""
import os
import sys


def run_entry_point(main):
    from dschat.data.errors import DatasetFormatError

    try:
        return main()
    except DatasetFormatError as error:
        if os.environ.get("DSCHAT_TRACEBACK", "0") not in ("", "0"):
            raise
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
