"""Process-group set-up: multi-rank CPU runs leave no DeepSpeed all-reduce buffers in /dev/shm behind (unlinked once
every rank has mapped them), and DeepSpeed's shared-memory all-reduce keeps working."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from launch import REPO, WRITE_SEEN_AND_END, remove_shm_buffers

from dschat.utils.dist import free_port, shm_buffers

SCRIPT = textwrap.dedent("""
    import os, sys, torch, deepspeed
    from dschat.utils.dist import ensure_distributed, shm_buffers
    rank, world = ensure_distributed()
    left = len(shm_buffers(os.environ["MASTER_PORT"], rank))  # unlinked once every rank has mapped it
    t = torch.ones(4)
    deepspeed.comm.inference_all_reduce(t)  # DeepSpeed's shared-memory all-reduce still works on the mappings
    assert t[0] == world == int(sys.argv[-2])
    with open(os.path.join(sys.argv[-1], f"buffers_of_rank_{rank}"), "w") as f:
        f.write(str(left))
    from dschat.utils.cli import end_script
    end_script()  # (a gloo rank aborted in the interpreter's teardown now and then)
""")


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_launched_cpu_run_removes_its_shm_buffers(tmp_path, ranks):
    script = tmp_path / "allreduce.py"
    script.write_text(SCRIPT)
    port = free_port()
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port", str(port),
           str(script), str(ranks), str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        seen = [(tmp_path / f"buffers_of_rank_{rank}").read_text() for rank in range(ranks)]
        assert seen == ["0"] * ranks, "the buffers are unlinked as soon as the process group has started"
        assert shm_buffers(port) == [], "the ranks' /dev/shm buffers outlived the run"
    finally:
        remove_shm_buffers(port)


def test_ranks_sharing_a_host_share_its_cores_unless_omp_num_threads_says(monkeypatch):
    from dschat.utils import dist

    before = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    try:
        for env, expected in (({"LOCAL_SIZE": "2"}, 4), ({"LOCAL_SIZE": "16"}, 1), ({"LOCAL_WORLD_SIZE": "4"}, 2),
                              ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 4), ({"MV2_COMM_WORLD_LOCAL_SIZE": "8"}, 1),
                              ({"LOCAL_SIZE": "2", "OMP_NUM_THREADS": "3"}, before), ({}, before)):
            torch.set_num_threads(before)
            for name in (*dist.LOCAL_SIZE_VARIABLES, "OMP_NUM_THREADS"):
                monkeypatch.delenv(name, raising=False)
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            dist.share_cpu_threads()
            assert torch.get_num_threads() == expected, env
    finally:
        torch.set_num_threads(before)


# What each launcher sets in a rank's environment, but RANK (a rank of two; rank 1), and two that start no ranks.
RANKS_OF_LAUNCHERS = {
    "openmpi (mpirun)": {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
    "mvapich (mpirun_rsh)": {"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "1"},
    "mvapich/mpich (hydra)": {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"},
    "slurm (srun)": {"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2"},
}
NO_RANKS = {
    "an sbatch script": {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "8"},
    "srun --pty bash": {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1", "PMI_RANK": "0",
                        "PMI_SIZE": "1"},
}


def launched_as(monkeypatch, env):
    """This process's environment as ``env`` alone of the launchers' variables."""
    from dschat.utils.dist import LAUNCHER_RANK_VARIABLES, LOCAL_SIZE_VARIABLES

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", *LOCAL_SIZE_VARIABLES,
                 *(name for pair in LAUNCHER_RANK_VARIABLES for name in pair), *env):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("launcher", [*RANKS_OF_LAUNCHERS, *NO_RANKS])
def test_ranks_of_a_launcher_that_sets_no_rank_are_left_to_deepspeeds_discovery(launcher, monkeypatch):
    """DeepSpeed's mvapich and slurm launchers set no RANK (DeepSpeed finds the world from MPI): their ranks were taken
    for plain processes and each made a world of one of its own (RANK 0, WORLD_SIZE 1): every rank trained alone on
    the first GPU and wrote the same output."""
    import deepspeed

    from dschat.utils import dist

    launched_as(monkeypatch, {**RANKS_OF_LAUNCHERS, **NO_RANKS}[launcher])
    seen = []

    def init_distributed(*args, **kwargs):
        seen.append((os.environ.get("RANK"), os.environ.get("WORLD_SIZE")))
        raise InterruptedError  # (no process group started)

    monkeypatch.setattr(deepspeed, "init_distributed", init_distributed)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "_mpi4py_installed", lambda: True)
    with pytest.raises(InterruptedError):
        dist.ensure_distributed()
    assert seen == [(None, None) if launcher in RANKS_OF_LAUNCHERS else ("0", "1")]


@pytest.mark.parametrize("launcher", [*RANKS_OF_LAUNCHERS, *NO_RANKS])
def test_ranks_of_a_launcher_that_sets_no_rank_without_mpi4py_stop_with_a_usage_error(launcher, monkeypatch):
    """DeepSpeed's MPI discovery imports mpi4py: srun's or mpirun's ranks without it stopped with a bare
    ModuleNotFoundError from inside DeepSpeed. Plain processes (sbatch, srun --pty) need no MPI and still start."""
    import deepspeed

    from dschat.errors import UsageError
    from dschat.utils import dist

    env = {**RANKS_OF_LAUNCHERS, **NO_RANKS}[launcher]
    launched_as(monkeypatch, env)
    started = []

    def init_distributed(*args, **kwargs):
        started.append(True)
        raise InterruptedError  # (no process group started)

    monkeypatch.setattr(deepspeed, "init_distributed", init_distributed)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "_mpi4py_installed", lambda: False)
    if launcher in NO_RANKS:
        with pytest.raises(InterruptedError):
            dist.ensure_distributed()
        assert started
        return
    with pytest.raises(UsageError, match="mpi4py") as error:
        dist.ensure_distributed()
    rank_variable = next(iter(env))
    assert f"{rank_variable}=1" in str(error.value) and "RANK, WORLD_SIZE" in str(error.value) and not started


@pytest.mark.parametrize("launcher", [*RANKS_OF_LAUNCHERS, *NO_RANKS])
def test_the_ranks_of_a_launcher_that_sets_no_world_size_say_a_shared_error_once(launcher, monkeypatch):
    """mpirun's and srun's ranks have no WORLD_SIZE before the process group starts: each printed a mistyped flag's
    usage block."""
    import uuid

    from dschat.utils.cli import first_to_say

    launched_as(monkeypatch, {**RANKS_OF_LAUNCHERS, **NO_RANKS}[launcher])
    message = f"error {uuid.uuid4()}"  # (this process plays both ranks of its launch: one parent, one start)
    assert [first_to_say(message), first_to_say(message)] == [True, launcher in NO_RANKS]


def _one_shell(tmp_path, monkeypatch, processes):
    """first_to_say in ranks of launches that share a parent (one shell): each call a process of ``processes``, (when
    it started, when it says its error)."""
    import tempfile
    from types import SimpleNamespace

    from dschat.utils import cli

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(cli, "_launch_id", lambda: "one-shell")
    processes, now = iter(processes), []

    def next_process():
        started, said_at = next(processes)
        now[:] = [said_at]
        return started

    monkeypatch.setattr(cli, "_process_started", next_process)
    monkeypatch.setattr(cli, "time", SimpleNamespace(time=lambda: now[0]))
    return cli


def test_two_ranks_that_find_an_earlier_runs_mark_say_the_error_once(tmp_path, monkeypatch):
    """Ranks started again by the same shell find the earlier run's mark: both could find it old before either
    rewrote it, and both printed the error (test_ranks_started_again_by_the_same_parent_print_the_error_again failed
    so under load). One rank claims the old mark's turn."""
    cli = _one_shell(tmp_path, monkeypatch, [(100.0, 102.0), (102.1, 104.0), (102.11, 104.01)])
    assert cli.first_to_say("error: bad flag")  # the earlier run's rank that said it
    said, real_read = [], cli._mark_started

    def other_rank_between_look_and_claim(mark):  # rank B runs whole after rank A read the old mark
        found = real_read(mark)
        if not said:
            said.append(None)
            said.append(cli.first_to_say("error: bad flag"))
        return found

    monkeypatch.setattr(cli, "_mark_started", other_rank_between_look_and_claim)
    said.append(cli.first_to_say("error: bad flag"))
    assert said[1:].count(True) == 1, said


def test_a_run_started_just_as_the_earlier_one_ended_says_the_error(tmp_path, monkeypatch):
    """The earlier run's mark is written 20-70 ms before its processes end, so a run its shell started at once began
    within the mark time's slack, took the mark for its own launch's, and said nothing (CI failed so). The ranks of one
    launch start together, or one starts late while the others still import; an earlier run's, a whole run earlier."""
    cli = _one_shell(tmp_path, monkeypatch, [(100.0, 102.0), (100.05, 102.05),  # one launch: ranks 50 ms apart
                                             (102.04, 104.0), (102.1, 104.1),  # the next: 40 ms after the mark
                                             (104.2, 106.0), (104.8, 106.6)])  # rank 1 started 0.6 s late
    said = [cli.first_to_say("error: bad flag") for _ in range(6)]
    assert said == [True, False] * 3


DECIDE_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    from dschat.errors import UsageError
    from dschat.utils.dist import ensure_distributed, rank_0_decides
    rank, world = ensure_distributed()

    def decide(kind):
        if kind == "usage":
            raise UsageError("bad flag")
        if kind == "other":
            raise ValueError("unreadable record")
        return {"rank": rank}

    seen = []
    for kind in ("value", "usage", "other"):
        try:
            seen.append(repr(rank_0_decides(lambda: decide(kind))))
        except Exception as error:
            seen.append(f"{type(error).__name__}: {error}")
    with open(os.path.join(sys.argv[-1], f"rank_{rank}"), "w") as f:
        f.write("\\n".join(seen))
    from dschat.utils.cli import end_script
    end_script()  # (a gloo rank aborted in the interpreter's teardown now and then)
""")


def _run_on_two_ranks(tmp_path, name, source):
    """``source`` as a script launched on 2 CPU ranks, given ``tmp_path`` (where its ranks write what they saw)."""
    script = tmp_path / name
    script.write_text(source)
    port = free_port()
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port),
           str(script), str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    finally:
        remove_shm_buffers(port)


def test_rank_0s_decision_and_any_error_of_it_reach_every_rank(tmp_path):
    """An error other than a UsageError on rank 0 (an unreadable file) left the other ranks waiting in the broadcast."""
    _run_on_two_ranks(tmp_path, "decide.py", DECIDE_SCRIPT)
    assert (tmp_path / "rank_0").read_text().splitlines() == ["{'rank': 0}", "UsageError: bad flag",
                                                              "ValueError: unreadable record"]
    assert (tmp_path / "rank_1").read_text().splitlines() == [
        "{'rank': 0}", "UsageError: bad flag", "RuntimeError: rank 0 failed: ValueError: unreadable record"]


def test_the_ranks_of_a_launch_print_a_shared_error_once():
    """Every rank runs the same checks: a mistyped flag printed its usage block, and a usage error its line, once per
    rank."""
    from launch import run_deepspeed

    step1 = REPO / "training" / "step1_sft" / "main.py"
    for flags, said in ((["--zero_stagee", "3"], "error: unrecognized arguments: --zero_stagee 3"),
                        (["--only_optimize_lora"], "error: ")):
        proc = run_deepspeed(step1, *flags, check=False, timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and out.count(said) == 1, out[-3000:]
    assert out.count("error: ") == 1 and "lora" in out.split("error: ")[1].splitlines()[0]


def test_ranks_started_again_by_the_same_parent_print_the_error_again():
    # ranks started by hand from one shell (or a notebook) share a parent: the second run's error was not printed
    step1 = REPO / "training" / "step1_sft" / "main.py"
    for _ in range(2):
        procs = [subprocess.Popen([sys.executable, str(step1), "--zero_stagee", "3"], cwd=REPO, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env={**os.environ, "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank)})
                 for rank in range(2)]
        said = "".join(proc.communicate(timeout=300)[1] for proc in procs)
        assert said.count("error: unrecognized arguments: --zero_stagee 3") == 1, said


SAME_FLAGS_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    from dschat.utils.dist import check_same_on_every_rank, ensure_distributed, local_device
    rank, world = ensure_distributed()
    seen = []
    for flags in ({"seed": 1, "data_path": ["a.jsonl"], "tokenizer": object()},  # (an object: not compared)
                  {"seed": 1 + rank, "data_path": ["a.jsonl"], "lr": 0.1 * (1 + rank)}):
        try:
            check_same_on_every_rank(flags, local_device())
            seen.append("same")
        except Exception as error:
            seen.append(f"{type(error).__name__}: {error}")
    from argparse import Namespace
    from dschat.steps.common import setup_run
    try:  # a step's set-up compares its flags, but for --local_rank (each rank's own), and no other attribute
        setup_run(Namespace(dtype="fp32", seed=1234 + rank, local_rank=rank, global_rank=rank))  # (DeepSpeed-Chat's)
    except Exception as error:
        seen.append(f"{type(error).__name__}: {error}")
    with open(os.path.join(sys.argv[-1], f"rank_{rank}"), "w") as f:
        f.write("\\n".join(seen))
    from dschat.utils.cli import end_script
    end_script()  # (a gloo rank aborted in the interpreter's teardown now and then)
""")


def test_ranks_given_different_flags_stop_together_with_an_error_naming_them(tmp_path):
    """Ranks started with different commands (a job launched by hand on each node) waited on each other in
    collectives they did not share: a hang, or models trained apart."""
    _run_on_two_ranks(tmp_path, "same.py", SAME_FLAGS_SCRIPT)
    assert (tmp_path / "rank_0").read_text().splitlines() == [
        "same", "UsageError: the ranks were given different values of --lr (rank 0: 0.1), --seed (rank 0: 1): give "
                "every rank the same command",
        "UsageError: the ranks were given different values of --seed (rank 0: 1234): give every rank the same command"]
    assert (tmp_path / "rank_1").read_text().splitlines() == [
        "same", "UsageError: the ranks were given different values of --lr, --seed: give every rank the same command",
        "UsageError: the ranks were given different values of --seed: give every rank the same command"]


SHARED_OUTPUT_SCRIPT = textwrap.dedent("""
    import os, socket, sys, torch
    from dschat.steps.common import check_output_dir_shared
    from dschat.utils.dist import ensure_distributed, local_device
    rank, world = ensure_distributed()
    out = sys.argv[-1]
    check_output_dir_shared(os.path.join(out, "one_host"), local_device())  # one machine: nothing written
    seen = [str(os.path.exists(os.path.join(out, "one_host")))]
    socket.gethostname = lambda: f"node{rank}"  # two nodes
    for folder in ("shared", f"own_{rank}"):  # one folder both see; each node's own copy of the path
        try:
            check_output_dir_shared(os.path.join(out, folder), local_device())
            seen.append("shared")
        except Exception as error:
            seen.append(f"{type(error).__name__}: {error}")
    seen.append(str(os.path.exists(os.path.join(out, "shared"))))  # the probe removed, and the folder it made
    with open(os.path.join(out, f"rank_{rank}"), "w") as f:
        f.write("\\n".join(seen))
    from dschat.utils.cli import end_script
    end_script()  # (a gloo rank aborted in the interpreter's teardown now and then)
""")


def test_an_output_dir_the_nodes_do_not_share_is_an_error_at_the_start(tmp_path):
    """Several nodes save, resume and pass models to the next step through --output_dir: each node's own copy of it
    failed late (step 2's ranks on the other nodes found no step-1 model, after step 1 had trained)."""
    _run_on_two_ranks(tmp_path, "shared.py", SHARED_OUTPUT_SCRIPT)
    for rank in (0, 1):
        said = (tmp_path / f"rank_{rank}").read_text().splitlines()
        assert said[:2] == ["False", "shared"] and said[3] == "False", said
        assert said[2].startswith(f"UsageError: --output_dir {tmp_path / f'own_{rank}'}: rank 1 (node1) cannot see "
                                  "the file rank 0 (node0) wrote there"), said


class OutputDirChecked(Exception):
    pass


def test_the_steps_that_write_their_output_dir_check_it_and_step_3s_readers_do_not(tmp_path, distributed,
                                                                                   monkeypatch):
    """The check ran at set-up, which the RLHF engine and step 3's prompt loaders (train.py's DPO report, ppo_eval)
    share: with no --output_dir of theirs, they probed step 3's default, output/step3_ppo under the working
    directory, which they never write (on several nodes: made it there, or stopped naming an --output_dir nobody
    gave). The steps check theirs, after the check that it is writable (whose error names the flag)."""
    from dschat.steps import common, ppo, sft
    from dschat.tiny import load_tiny_tokenizer
    from helpers import SFT_FAST

    checked = []

    def check(folder, device):
        checked.append(folder)
        raise OutputDirChecked

    monkeypatch.setattr(common, "check_output_dir_shared", check)
    monkeypatch.setattr(ppo, "check_output_dir_shared", check, raising=False)
    monkeypatch.chdir(tmp_path)
    tokenizer = load_tiny_tokenizer()
    tokenizer.padding_side = "left"
    ppo.prompt_loaders({"data_path": ["tiny"], "data_output_path": str(tmp_path / "data")}, tokenizer,
                       held_out_only=True)
    assert checked == []
    for main, out in ((sft.main, tmp_path / "sft"), (ppo.main, tmp_path / "ppo")):
        with pytest.raises(OutputDirChecked):
            main(["--output_dir", str(out), "--data_output_path", str(tmp_path / "data"),
                  *(SFT_FAST if main is sft.main else [])])
    assert checked == [str(tmp_path / "sft"), str(tmp_path / "ppo")]


@pytest.mark.parametrize("platform, asks_mpi", [({"AZUREML_EXPERIMENT_ID": "x"}, False),
                                                ({"SM_TRAINING_ENV": "{}"}, False),
                                                ({"DLTS_JOB_ID": "x"}, True),
                                                ({"AZUREML_EXPERIMENT_ID": "x", "DLTS_JOB_ID": "x"}, True)])
def test_only_the_platforms_deepspeed_reads_without_mpi_skip_the_mpi4py_error(platform, asks_mpi, monkeypatch):
    """DeepSpeed reads AzureML's variables (not on DLTS) and SageMaker's; on DLTS it asks MPI (mpi4py) as elsewhere:
    there mpirun's ranks without mpi4py still stopped with DeepSpeed's bare ModuleNotFoundError."""
    import deepspeed

    from dschat.errors import UsageError
    from dschat.utils import dist

    launched_as(monkeypatch, RANKS_OF_LAUNCHERS["openmpi (mpirun)"])
    for name in ("AZUREML_EXPERIMENT_ID", "SM_TRAINING_ENV", "DLTS_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in platform.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(deepspeed, "init_distributed", lambda *a, **k: (_ for _ in ()).throw(InterruptedError()))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "_mpi4py_installed", lambda: False)
    with pytest.raises(UsageError if asks_mpi else InterruptedError):
        dist.ensure_distributed()


def test_the_mpi4py_error_does_not_send_deepspeeds_own_mpi_launches_back_to_the_deepspeed_launcher(monkeypatch):
    """`deepspeed --launcher slurm` (or openmpi, mvapich) starts its ranks through srun/mpirun, which set no RANK: the
    error told those users to "start the ranks with the deepspeed launcher", which they had done."""
    import deepspeed

    from dschat.errors import UsageError
    from dschat.utils import dist

    launched_as(monkeypatch, RANKS_OF_LAUNCHERS["slurm (srun)"])
    monkeypatch.setattr(deepspeed, "init_distributed", lambda *a, **k: pytest.fail("no error"))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "_mpi4py_installed", lambda: False)
    with pytest.raises(UsageError) as error:
        dist.ensure_distributed()
    said = str(error.value)
    assert "torchrun" in said and "default (pdsh)" in said and "--launcher openmpi, mvapich and slurm" in said, said


def test_the_shared_output_check_leaves_no_folder_it_made(tmp_path, monkeypatch):
    """check_writable_folder makes nothing (a step failing after it left an empty output folder); the probe of several
    nodes made --output_dir, and its parents, and left them. Two nodes faked in one process (rank 0's view)."""
    from dschat.steps import common

    answers = iter([["node0", "node1"], [True, True]])  # the ranks' hosts, then whether each saw the probe
    monkeypatch.setattr(common, "get_world_size", lambda: 2)
    monkeypatch.setattr(common, "gathered_objects", lambda value, device: next(answers))
    (tmp_path / "kept").mkdir()
    common.check_output_dir_shared(str(tmp_path / "kept" / "new" / "step1_sft"), torch.device("cpu"))
    assert os.listdir(tmp_path / "kept") == []
    (tmp_path / "kept" / "out").mkdir()
    (tmp_path / "kept" / "out" / "model.bin").write_text("")
    answers = iter([["node0", "node1"], [True, True]])
    common.check_output_dir_shared(str(tmp_path / "kept" / "out"), torch.device("cpu"))
    assert os.listdir(tmp_path / "kept" / "out") == ["model.bin"]


def _as_drawn(line):
    """What a terminal shows of ``line``: each carriage return starts writing over it again from its first column."""
    shown = ""
    for part in line.split("\r"):
        shown = part + shown[len(part):]
    return shown.rstrip()


def test_a_line_printed_under_a_progress_bar_starts_a_line_of_its_own(capsys):
    """print_rank_0 (a step's --print_loss line) and the hybrid engine's stats line (after every step-3 iteration)
    were printed after the bar's drawing: 'step1 epoch 1/1:  40%|...| 2/5 [...][step1] step 2 loss ...'."""
    from tqdm.auto import tqdm

    from dschat.utils.dist import print_rank_0

    bar = tqdm(total=5, desc="step1 epoch 1/1", file=sys.stdout, mininterval=0)
    bar.update(2)
    print_rank_0("[step1] step 2 loss 1.0000")
    bar.close()
    lines = [_as_drawn(line) for line in capsys.readouterr().out.split("\n")]
    assert "[step1] step 2 loss 1.0000" in lines, lines


DS_CONFIG_NODES_SCRIPT = """
from types import SimpleNamespace
from dschat.steps.common import check_same_ds_config_file
from dschat.utils.dist import ensure_distributed, local_device
ensure_distributed()
seen = []
for name in ("same.json", "other.json", "missing.json"):  # each 'node' reads its own copy in its working directory
    try:
        check_same_ds_config_file(SimpleNamespace(deepspeed_config=name), local_device())
        seen.append("same")
    except Exception as error:
        seen.append(f"{type(error).__name__}: {error}")
""" + WRITE_SEEN_AND_END


def test_nodes_reading_copies_of_the_deepspeed_config_that_differ_stop_with_an_error_naming_it(tmp_path):
    """Two nodes (one rank each), each reading --deepspeed_config from its own disk: copies with other ZeRO bucket
    sizes made the ranks' reductions differ, and they failed deep in DeepSpeed (gloo aborted: "Received data size
    doesn't match expected size"; NCCL hangs). The ranks compared the flag (one path), not the file."""
    from launch import run_as_two_nodes

    nodes = [tmp_path / f"node{rank}" for rank in range(2)]
    for rank, node in enumerate(nodes):
        node.mkdir()
        (node / "same.json").write_text(json.dumps({"gradient_clipping": 1.0}, indent=rank))  # (layout alone differs)
        (node / "other.json").write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 10 ** (3 + rank)}}))
    (nodes[0] / "missing.json").write_text("{}")  # (node 1 has no copy)
    run_as_two_nodes(tmp_path, DS_CONFIG_NODES_SCRIPT, nodes)
    differ = ("UsageError: DeepSpeed config {!r} (--deepspeed_config / --deepspeed): its content differs between the "
              "ranks (each node's own copy): give every node the same file")
    for node in nodes:
        assert (node / "seen").read_text().split("\n") == ["same", differ.format("other.json"),
                                                           differ.format("missing.json")], node
