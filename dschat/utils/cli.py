"""Entry points: a usage error (a flag, file or record of the user's, already named in the message) ends the run
with that message and exit status 2, not a traceback through DeepSpeed, datasets and the step code; a diverged run
(a non-finite loss or gradient norm: exit status 1), a rank whose collective failed because another rank stopped (1),
a write to a full disk (1) and Ctrl-C (130) are said in one line too; DSCHAT_TRACEBACK=1 shows the tracebacks. Also
what the ranks and tools say on stderr: a warning once per process (``say_once``), once per launch
(``first_to_say``)."""
import contextlib
import contextvars
import hashlib
import os
import select
import sys
import tempfile
import time


_IMPORTED = time.time()  # (imported first thing by the entry points: when the process started, where /proc is not)


def _started_ticks(pid):
    """When process ``pid`` started, in clock ticks since boot (/proc/PID/stat's field 22), else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])  # (counted after the command name)
    except (OSError, IndexError, ValueError):
        return None


def _process_started():
    """When this process started, in epoch seconds: from /proc to a clock tick (the time since the start against the
    boot clock); elsewhere the import time of this module, which the entry points import first."""
    ticks = _started_ticks("self")
    if ticks is None or not hasattr(time, "CLOCK_BOOTTIME"):
        return _IMPORTED
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))


# The ranks of one launch start within this of each other (their launcher, or a shell, starts them together); a run
# started again by the same parent starts a whole run later (a step imports torch for a second and more before it can
# say an error). A mark's own time could not tell them apart alone: the earlier run wrote it 20-70 ms before its
# processes ended, and a run started at once began within a tick and a slack of it and said nothing.
_SIBLINGS_S = 0.25
_CLOCK_SLACK_S = 0.05  # (a start read from /proc is a clock tick early)


def run_entry_point(main, resumable=False):
    """``main()``, its usage errors, a diverged run (``FloatingPointError``), another rank's failure and Ctrl-C each
    ended with one line; ``resumable``: a training entry point, whose Ctrl-C line says how to continue."""
    from dschat.errors import UsageError

    from dschat.utils.dist import get_rank, peer_failure
    from dschat.utils.files import full_disk_code

    traceback = os.environ.get("DSCHAT_TRACEBACK", "0") not in ("", "0")
    try:
        result = main()
    except UsageError as error:
        if traceback:
            raise
        if first_to_say(str(error)):
            print(f"error: {error}", file=sys.stderr, flush=True)
        end_distributed(peers_only=True)  # (the ranks stop together: no collective is pending)
        sys.exit(2)
    except FloatingPointError as error:  # a diverged run (a non-finite loss or gradient norm): its message says where
        if traceback:
            raise
        if first_to_say(str(error)):
            print(f"error: {error}", file=sys.stderr, flush=True)
        end_distributed(peers_only=True)
        sys.exit(1)
    except OSError as error:  # a full disk or quota (output to a file, a pipe's file, /dev/full): not a bug of ours
        if traceback or full_disk_code(error) is None:
            raise
        say_if_possible(f"error: {error.strerror}{f': {error.filename}' if error.filename else ''} (a write failed: "
                        "free some space or write elsewhere; DSCHAT_TRACEBACK=1 shows where)")
        sys.exit(1)
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
    end_distributed()
    return result


def say_if_possible(line):
    """``line`` on stderr, unless stderr cannot take it either (the same full disk)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError, AttributeError):  # (full, closed, or no stderr at all)
        pass


_SAID = set()
# (notice -> notice) the flags of a step's notices as the user typed them: train.py's, while it runs a step
# (``pipeline.says_train_py_flags``)
_NOTICE_SPELLING = contextvars.ContextVar("notice_spelling", default=None)


@contextlib.contextmanager
def notices_spelled(spelling):
    """``say_once``'s notices passed through ``spelling`` inside the block."""
    token = _NOTICE_SPELLING.set(spelling)
    try:
        yield
    finally:
        _NOTICE_SPELLING.reset(token)


def say_once(notice):
    """``notice`` on stderr, once per process (its flags spelled as ``notices_spelled`` says, inside it)."""
    spelling = _NOTICE_SPELLING.get()
    notice = spelling(notice) if spelling else notice
    if notice not in _SAID:
        _SAID.add(notice)
        print(notice, file=sys.stderr)


def run_script(main, resumable=False):
    """A script's ``if __name__ == "__main__"``: ``run_entry_point(main, resumable)``, then the process ends with its
    status (once ``main`` returns, ``returned_status`` of what it returned; a bug's traceback is printed as the
    interpreter would, status 1) through ``leave_process``."""
    import traceback

    try:
        status = returned_status(run_entry_point(main, resumable))
    except SystemExit as stop:
        status = exit_status(stop.code)
    except BaseException as error:  # noqa: BLE001 (a bug, or DSCHAT_TRACEBACK=1: the traceback the interpreter prints)
        if isinstance(error, BrokenPipeError) and output_reader_gone():
            status = 141  # (`| head` has its lines: the status SIGPIPE gives a C program, 128 + 13, no traceback)
        else:
            traceback.print_exc()
            status = 130 if isinstance(error, KeyboardInterrupt) else 1  # (the shell's status for Ctrl-C)
    leave_process(status)


def returned_status(result):
    """The status a ``main`` that returned ``result`` ends with: an int (chat's 0) is one, as ``sys.exit`` takes it;
    anything else, the results a notebook gets (a dict of metrics or scores) or None, is 0. (A bool is no status:
    True would have ended a run that had finished with 1.)"""
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def output_reader_gone():
    """Whether stdout or stderr is a pipe whose reader has closed it (a BrokenPipeError of another pipe is a bug's);
    such a stream is pointed at /dev/null, as Python's documentation advises, so that what is still written (atexit
    handlers, the flush at exit) goes nowhere instead of raising again."""
    gone = False
    for stream in (sys.stdout, sys.stderr):
        try:
            poller = select.poll()
            poller.register(stream.fileno(), select.POLLOUT)
            if not any(events & select.POLLERR for _, events in poller.poll(0)):  # (a pipe without its reader)
                continue
        except (AttributeError, ValueError, OSError):  # (no descriptor, closed, or no poll on this system)
            continue
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
        gone = True
    return gone


def exit_status(code):
    """The process status ``sys.exit(code)`` gives: None 0, a number itself, anything else printed and 1."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def leave_process(status):
    """End the process with ``status`` as a normal exit does (other threads joined, atexit handlers run, output
    flushed), but without the interpreter's teardown: a rank of a gloo group aborted there now and then, after
    destroy_process_group, with "terminate called without an active exception" (a C++ thread destroyed while
    running), and the launcher returned 250 for a run that had finished; 2 of 20 two-rank runs of
    tests/scripts/align_overflow_fp16.py on a loaded 2-core machine, and a fresh-clone CI run."""
    import atexit
    import threading

    threading._shutdown()  # (the interpreter's first step at exit: idle thread pools told to stop, threads joined)
    atexit._run_exitfuncs()
    os._exit(flushed(status))


def flushed(status):
    """``status`` once Python's output streams and C's (printf of compiled code: DeepSpeed's CPU Adam says its
    configuration so) are flushed, as the interpreter's exit flushes them; output a stream could not take fails a run
    that had succeeded: with 120 as the interpreter's exit does (a full disk), with 141 where the pipe's reader had gone
    (`| head`: the status a pipe's reader leaving mid-run gives, ``run_script``), where a closed stream does not."""
    import ctypes

    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # (started with the descriptor closed)
            continue
        try:
            stream.flush()
        except BrokenPipeError:  # (its lines were lost: the reader has gone)
            status = status or 141
        except ValueError:  # (the stream was closed: nothing to say it to)
            pass
        except OSError:
            status = status or 120
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # (no C library to ask: nothing buffered there)
        pass
    return status


def end_script(status=0):
    """The end of a multi-rank script of its own (a test's, a check's): its process group left, then the process
    ended with ``status`` through ``leave_process``."""
    end_distributed()
    leave_process(status)


def end_distributed(peers_only=False):
    """A finished or refused run leaves the process group as torch asks (NCCL warns at exit otherwise:
    "destroy_process_group() was not called before program exit, which can leak resources"; a gloo group left to the
    interpreter's exit aborted a rank now and then, "terminate called without an active exception", and the
    launcher returned 250 instead of the run's status). Not after Ctrl-C or another rank's failure, where a
    collective may still be pending and the teardown could wait on it. ``peers_only``: only a group of several ranks
    (a process of one, such as a notebook or a test calling the entry point, goes on with its group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and (not peers_only or dist.get_world_size() > 1):
        dist.destroy_process_group()


def first_to_say(message):
    """Whether this process is the first rank of its launch on this machine to print ``message``: the ranks of a
    launch run the same checks, and each printed the same error (a 35-line usage block per rank for a mistyped
    flag); an error of one rank's own (another message) is still printed. One process alone: always."""
    from dschat.utils.dist import launched_ranks

    if launched_ranks() < 2:  # (mpirun's and srun's ranks have no WORLD_SIZE before the process group: each said it)
        return True
    folder = os.path.join(tempfile.gettempdir(), f"dschat-said-{os.getuid()}", _launch_id())
    mark = os.path.join(folder, hashlib.sha256(message.encode()).hexdigest()[:32])
    started = _process_started()
    try:
        os.makedirs(folder, exist_ok=True)
        if _write_mark(mark, started, replace=False):
            return True
        said_by = _mark_started(mark)
        if said_by is not None and _same_launch(started, *said_by):
            return False  # a rank of this launch said it
        # an earlier run's (the same shell ran the ranks again): one rank of this run claims its turn and says it (two
        # ranks that both found it old and rewrote it both said it)
        earlier = said_by[0] if said_by else "unreadable"
        try:
            os.close(os.open(f"{mark}.after-{earlier}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        _write_mark(mark, started, replace=True)
    except OSError:  # (no writable temp folder, no hard links: say it)
        return True
    return True


def _same_launch(started, writer_started, said_at):
    """Whether a mark written at ``said_at`` by a process started at ``writer_started`` is a rank of this launch's,
    this process started at ``started``: one started with it, or one that said it after this one started (a rank the
    launcher started late, while the others still imported)."""
    return abs(writer_started - started) < _SIBLINGS_S or said_at > started + _CLOCK_SLACK_S


def _write_mark(mark, started, replace):
    """``mark`` holds ``started``, the start of the process that says its message, and the time it says it, whole when
    another rank reads it (written aside, then linked or moved in); not ``replace``: False where a mark is there."""
    aside = f"{mark}.{os.getpid()}.tmp"
    with open(aside, "w") as f:
        f.write(f"{started!r} {time.time()!r}")
    try:
        if replace:
            os.replace(aside, mark)
            return True
        os.link(aside, mark)
        return True
    except FileExistsError:
        return False
    finally:
        if os.path.exists(aside):
            os.unlink(aside)


def _mark_started(mark):
    """(the start of the process that wrote ``mark``, when it wrote it), else None (an unreadable mark counts as an
    earlier run's)."""
    try:
        with open(mark) as f:
            writer_started, said_at = map(float, f.read().split())
        return writer_started, said_at
    except (OSError, ValueError):
        return None


def _launch_id():
    """The launcher process the ranks of this machine share (deepspeed's, torchrun's): its pid and start time, which
    a later launch reusing the pid does not share."""
    parent = os.getppid()
    started = _started_ticks(parent)
    return f"{parent}-{'' if started is None else started}"
