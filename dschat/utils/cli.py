"""Entry points: a usage error (a flag, file or record of the user's, already named in the message) ends the run
with that message and exit status 2, not a traceback through DeepSpeed, datasets and the step code; a rank whose
collective failed because another rank stopped says so in one line (exit status 1), as does Ctrl-C (130);
DSCHAT_TRACEBACK=1 shows the tracebacks."""
import os
import sys


def run_entry_point(main, resumable=False):
    """``main()``, its usage errors, another rank's failure and Ctrl-C each ended with one line; ``resumable``: a
    training entry point, whose Ctrl-C line says how to continue."""
    from dschat.errors import UsageError

    from dschat.utils.dist import get_rank, peer_failure

    traceback = os.environ.get("DSCHAT_TRACEBACK", "0") not in ("", "0")
    try:
        result = main()
    except UsageError as error:
        if traceback:
            raise
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: one line, not a traceback each
        if traceback:
            raise
        if get_rank() == 0:
            hint = " (with --save_interval, --resume continues from the last checkpoint)" if resumable else ""
            print(f"error: interrupted{hint}", file=sys.stderr, flush=True)
        sys.exit(130)
    except RuntimeError as error:  # another rank stopped: its error says why, this rank's traceback would bury it
        if traceback or not peer_failure(error):
            raise
        # (or it was interrupted or killed: the deepspeed launcher kills the ranks on Ctrl-C, some before they print)
        print(f"error: rank {get_rank()} stopped: another rank stopped first (its error, if it printed one, is "
              "above)", file=sys.stderr, flush=True)
        sys.exit(1)
    _end_distributed()
    return result


def _end_distributed():
    """A finished run leaves the process group as torch asks (NCCL warns at exit otherwise: "destroy_process_group()
    was not called before program exit, which can leak resources")."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
