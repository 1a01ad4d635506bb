"""Run a script on 2 CPU ranks through the deepspeed launcher (the way users start multi-rank jobs)."""
import os
import subprocess
import sys
from pathlib import Path

from dschat.utils.dist import free_port, shm_buffers

REPO = Path(__file__).resolve().parents[1]


def remove_shm_buffers(port):
    """DeepSpeed's CPU all-reduce leaves a ~69 MB /dev/shm buffer per rank and launch (never unlinked). dschat's
    ranks unlink their own once the process group has started; a launch that crashed before or never called
    ``ensure_distributed`` may still leave them, and a suite of launches would fill the machine's shared memory, so
    each launch's buffers go when it ends."""
    for path in shm_buffers(port):
        try:
            os.unlink(path)
        except OSError:
            pass


def run_deepspeed(script, *args, num_gpus=2, timeout=900, env=None, check=True):
    """Launch ``deepspeed --num_gpus N script args``; fail the test with the output if it fails (``check``)."""
    port = free_port()
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(num_gpus),
           "--master_port", str(port), str(script), *each_flag_once(map(str, args))]
    full_env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                "OMP_NUM_THREADS": "1", **(env or {})}
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    finally:
        remove_shm_buffers(port)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return proc


def too_few_gpus(num_gpus=2):
    """Why ``num_gpus`` ranks cannot start here, or None: on the CPU any number can; on a machine with CUDA each
    rank needs its own device (the one-GPU checks of a GPU session run these modules' one-rank cases)."""
    import torch
    count = torch.cuda.device_count() if torch.cuda.is_available() else None
    if count is not None and count < num_gpus:
        return f"{num_gpus} ranks need {num_gpus} GPUs; this machine has {count}"
    return None


class SkippedOnRead(dict):
    """The results of ranks that could not start (:func:`too_few_gpus`): reading any of them skips the test."""

    def __init__(self, reason):
        super().__init__()
        self.reason = reason

    def __getitem__(self, key):
        import pytest
        pytest.skip(self.reason)


def launch_and_load(script, *args, load, timeout=900):
    """``load()`` after a 2-rank launch of ``script args``; :class:`SkippedOnRead` where 2 ranks cannot start."""
    reason = too_few_gpus()
    if reason:
        return SkippedOnRead(reason)
    run_deepspeed(script, *args, timeout=timeout)
    return load()


def each_flag_once(args):
    """``args`` with each ``--flag`` (and the values after it) given once, at its last place with its last values:
    tests override a shared list of flags by appending (``[*STEP3, "--max_answer_seq_len", "16"]``), and the step
    scripts refuse a flag given twice on their command line, as a user's typo."""
    groups = []
    for token in args:
        # (a value may start with "--": train.py's --step1-args "--max_steps 4", spaces and all)
        value = groups and groups[-1][0].endswith("-args") and len(groups[-1]) == 1 or " " in token
        if token.startswith("--") and not value or not groups:
            groups.append([token])
        else:
            groups[-1].append(token)
    flag = [group[0].split("=", 1)[0] if group[0].startswith("--") else None for group in groups]
    last = {name: index for index, name in enumerate(flag) if name is not None}
    return [token for index, group in enumerate(groups) if flag[index] is None or last[flag[index]] == index
            for token in group]


def launch_once(script, *args, timeout=900):
    """One launch shared by a module's tests (a module-scoped fixture returns it; the launcher and the ranks' start
    cost ~20 s each time): the finished process, or the AssertionError of a failed launch, which :func:`launched`
    raises again in every test that needs it."""
    try:
        return run_deepspeed(script, *args, timeout=timeout)
    except AssertionError as error:
        return error


def launched(launch):
    """The process of :func:`launch_once`; its error if the launch failed."""
    if isinstance(launch, AssertionError):
        raise launch
    return launch


# The end of a ``run_as_two_nodes`` script: its ``seen`` list written to the file "seen" of its node's folder, then the
# process group left (a gloo rank aborted in the interpreter's teardown now and then)
WRITE_SEEN_AND_END = """
with open("seen", "w") as f:
    f.write("\\n".join(seen))
from dschat.utils.cli import end_script
end_script()
"""


def run_as_two_nodes(tmp_path, source, nodes, timeout=300):
    """``source`` run as a script by two ranks started by hand, as on two nodes of one rank each (both local rank 0),
    each in its folder of ``nodes`` (its working directory); given the folder ``tmp_path / "cache"``."""
    script = tmp_path / "nodes.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1",
           "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "cache")], cwd=node, text=True,
                              env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for rank, node in enumerate(nodes)]
    outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), "\n".join(outputs)[-6000:]
