"""Process-group set-up that works under the deepspeed launcher and in a plain ``python`` process."""
import contextlib
import glob
import hashlib
import importlib.util
import os
import socket
import sys

import torch

from dschat.errors import UsageError


def free_port():
    """A TCP port nobody listens on now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_distributed():
    """Initialise torch.distributed through DeepSpeed once; a plain process becomes a world of one.

    Returns (rank, world_size). Safe to call many times.
    """
    import deepspeed
    from dschat.compat import prepare_for_zero_init

    prepare_for_zero_init()
    if not torch.distributed.is_initialized():
        share_cpu_threads()
        if not under_launcher():
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
        check_world_discoverable()
        deepspeed.init_distributed()
        _unlink_own_shm_buffer()
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


# Launchers that set no RANK, with each rank's variables for its rank and the number of ranks; DeepSpeed's
# init_distributed finds their world itself (its MPI discovery, through mpi4py). Open MPI's mpirun; MPICH's, MVAPICH's
# and Cray's (PMI); MVAPICH's mpirun_rsh; srun (DeepSpeed's slurm launcher). Only a launch of several ranks counts: an
# sbatch script (no step) and `srun --pty bash` (a step of one task; PMI_SIZE 1 where an MPI plugin is on) are plain
# processes. (deepspeed's own launcher, torchrun and DeepSpeed's mpich and impi launchers set RANK.)
LAUNCHER_RANK_VARIABLES = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
                           ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"), ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"))


def under_launcher():
    """Whether a launcher started this process as one of its ranks (deepspeed's, torchrun's, mpirun's, srun's). Ranks
    of one that sets no RANK (DeepSpeed's mvapich and slurm launchers) were taken for a plain process: each trained
    alone, as rank 0 of a world of one on the first GPU, and train.py started a launch of its own on each."""
    return "RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ or _ranks_without_world_size() > 1


def launched_ranks():
    """How many ranks the launcher that started this process started (1: a plain process), known before any process
    group: WORLD_SIZE, else the variables of a launcher that sets none (mpirun's, srun's), which DeepSpeed sets it
    from only as the process group starts."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return _ranks_without_world_size()


def _ranks_without_world_size():
    """The number of ranks a launcher that sets no WORLD_SIZE says it started (``LAUNCHER_RANK_VARIABLES``), else 1."""
    return max((int(os.environ[size]) for rank, size in LAUNCHER_RANK_VARIABLES
                if rank in os.environ and os.environ.get(size)), default=1)


# What torch.distributed's env:// start reads; without them DeepSpeed asks MPI (mpi4py) for the world.
PROCESS_GROUP_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def check_world_discoverable():
    """Ranks of a launcher that sets no RANK (srun, mpirun) without mpi4py stopped in DeepSpeed's MPI discovery with
    a bare ``No module named 'mpi4py'``: a UsageError naming the launcher's variable and the ways out instead."""
    missing = [name for name in PROCESS_GROUP_VARIABLES if name not in os.environ]
    if not missing or _mpi4py_installed():
        return
    from deepspeed.comm.comm import in_aml, in_aws_sm, in_dlts

    # DeepSpeed reads AzureML's and SageMaker's own variables (AzureML's not on DLTS, where it asks MPI as elsewhere)
    if (in_aml() and not in_dlts()) or in_aws_sm():
        return
    seen = ", ".join(f"{name}={os.environ[name]}" for pair in LAUNCHER_RANK_VARIABLES for name in pair
                     if name in os.environ)
    raise UsageError(f"this process was started as one of several ranks ({seen or 'RANK=' + os.environ['RANK']}) by "
                     f"a launcher that does not set {', '.join(missing)}: DeepSpeed then finds the ranks' world "
                     "through MPI, with mpi4py, which is not installed. Install it (`pip install mpi4py`, built "
                     "against the launcher's MPI), or start the ranks with a launcher that sets them: torchrun, or "
                     "the deepspeed launcher's default (pdsh), mpich or impi launcher (its --launcher openmpi, "
                     "mvapich and slurm set none either)")


def _mpi4py_installed():
    return importlib.util.find_spec("mpi4py") is not None


LOCAL_SIZE_VARIABLES = ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")


def share_cpu_threads():
    """Several ranks on this host under a launcher that set no OMP_NUM_THREADS (DeepSpeed's sets none unless it binds
    cores; torchrun sets 1): each rank takes its share of the cores, as each would otherwise run a thread per core and
    together oversubscribe them (two CPU ranks on two cores ran 4-5x slower). The ranks here as each launcher says:
    DeepSpeed's openmpi and mvapich launchers set no LOCAL_SIZE (every rank took every core); srun's are left as they
    are (it commonly binds each task to CPUs of its own, which a share would cut again)."""
    ranks_here = int(next((os.environ[name] for name in LOCAL_SIZE_VARIABLES if os.environ.get(name)), 1))
    if ranks_here > 1 and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // ranks_here))


def _shm_buffer(addr, port, rank):
    """The name of the /dev/shm all-reduce buffer DeepSpeed's CPU backend creates for a rank of a launch."""
    return f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def shm_buffers(port, rank="*"):
    """The /dev/shm all-reduce buffers of the ranks of a launch on ``port`` (any master address)."""
    return glob.glob(_shm_buffer("*", port, rank))


def _unlink_own_shm_buffer():
    """DeepSpeed's CPU backend creates a ~69 MB /dev/shm buffer per rank (one rank under the launcher included) and never
    unlinks it, so every CPU run would leave its buffers behind until shared memory fills up. Once every rank has mapped every buffer (they
    do while the process group starts; the barrier makes sure all have), each rank unlinks its own by its exact name:
    the mappings stay valid, and nothing is left behind even if a rank is killed."""
    from deepspeed.accelerator import get_accelerator

    addr, port, rank = (os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT", "RANK"))
    if get_accelerator().device_name() != "cpu" or None in (addr, port, rank):  # one rank under a launcher too
        return
    torch.distributed.barrier()
    try:
        os.unlink(_shm_buffer(addr, port, rank))
    except OSError:
        pass


def get_rank():
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def get_world_size():
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def is_rank_0():
    return get_rank() == 0


def print_rank_0(*args, **kwargs):
    if is_rank_0():
        print_beside_progress_bars(*args, **kwargs)


# what ``print_rank_0_once`` has said in this process, by its caller's key
_SAID_ONCE = set()


def print_rank_0_once(key, text):
    """``print_rank_0(text)`` the first time this process is asked with ``key`` (hashable: what the notice is
    about), nothing after: a notice of the data, read by the pre-flight and again by a step, said once."""
    if key not in _SAID_ONCE:
        _SAID_ONCE.add(key)
        print_rank_0(text)


def print_beside_progress_bars(*args, **kwargs):
    """``print`` (flushed) with tqdm's progress bars cleared first and drawn again after it, as ``tqdm.write`` does: a
    line printed under a bar (a step's --print_loss line, step 3's hybrid-engine stats after every iteration) was
    glued to the bar's last drawing, so a terminal or log kept a copy of the bar at the start of such lines."""
    tqdm = sys.modules.get("tqdm.std")  # (no bar was ever drawn where tqdm is not imported)
    with tqdm.tqdm.external_write_mode(file=kwargs.get("file")) if tqdm else contextlib.nullcontext():
        print(*args, **kwargs, flush=True)


def barrier():
    if torch.distributed.is_initialized() and get_world_size() > 1:
        torch.distributed.barrier()


def rank_0_decides(decide, patience=None):
    """``decide()`` run on rank 0, and its result on every rank (its error raised on every rank): a decision
    made from files, such as which checkpoint to resume and whether it fits, is made once, so that no rank goes on
    into a collective (DeepSpeed's loading, an evaluation) while another stops. ``patience`` (a timedelta): how long
    the other ranks wait for a long one (rank 0 converting a checkpoint), on a gloo group of its own with that
    timeout; in the process group's collective they failed once its timeout passed (DeepSpeed's default: 10
    minutes), and a retry converted again from the start."""
    from dschat.errors import UsageError

    if get_world_size() == 1:
        return decide()
    group = torch.distributed.new_group(backend="gloo", timeout=patience) if patience is not None else None
    outcome, failed = [None], None
    if is_rank_0():
        try:
            outcome[0] = ("decided", decide())
        except UsageError as error:
            outcome[0], failed = ("usage", str(error)), error
        except Exception as error:  # any other failure stops every rank too, not only rank 0
            outcome[0], failed = ("failed", f"rank 0 failed: {type(error).__name__}: {error}"), error
    # (the rank's own device: under NCCL, before any engine has set one, torch would take cuda:0 on every rank)
    try:
        torch.distributed.broadcast_object_list(outcome, src=0, group=group,
                                                device=local_device() if group is None else torch.device("cpu"))
    finally:
        if group is not None:
            torch.distributed.destroy_process_group(group)
    if failed is not None:
        raise failed
    kind, value = outcome[0]
    if kind == "usage":
        raise UsageError(value)
    if kind == "failed":
        raise RuntimeError(value)
    return value


def check_same_on_every_rank(flags, device):
    """``flags`` ({name: value}) the same on every rank, else a UsageError on every rank naming the flags that differ:
    ranks given different commands (a multi-node job started by hand) would otherwise wait on each other in a
    collective they do not share, and hang, or train apart. Compares a hash of each plain value (collective)."""
    from dschat.errors import UsageError

    if get_world_size() == 1:
        return
    names = sorted(name for name, value in flags.items() if _plain(value))  # (an object's repr holds its address)
    if _differs_between_ranks(torch.tensor([len(names)], device=device)).item():
        raise UsageError("the ranks run different commands (another number of flags): give every rank the same one")
    differ = names_differing_between_ranks({name: flags[name] for name in names}, device)
    if differ:
        said = ", ".join(f"--{name} (rank 0: {flags[name]!r})" if is_rank_0() else f"--{name}" for name in differ)
        raise UsageError(f"the ranks were given different values of {said}: give every rank the same command")


def names_differing_between_ranks(values, device):
    """The names of ``values`` ({name: plain value}, the same names on every rank) whose values differ between ranks,
    sorted. Compares a hash of each value (collective)."""
    names = sorted(values)
    digests = [int.from_bytes(hashlib.sha256(repr((name, values[name])).encode()).digest()[:7], "big") for name in names]
    differ = _differs_between_ranks(torch.tensor(digests, dtype=torch.int64, device=device))
    return [names[i] for i in differ.nonzero().flatten().tolist()]


def gathered_objects(value, device):
    """``value`` (picklable) of every rank, in rank order (collective; the rank's own device: under NCCL torch would
    take the current device, cuda:0 on every rank before an engine has set one)."""
    values = [None] * get_world_size()
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        torch.distributed.all_gather_object(values, value)
    return values


def _differs_between_ranks(values):
    """Per element of an int64 tensor of the same shape on every rank: whether the ranks hold different values (one
    all-reduce: the maximum of the values and of their negations)."""
    extremes = all_reduce(torch.stack([values, -values]), "max")
    return extremes[0] != -extremes[1]


def _plain(value):
    if isinstance(value, (list, tuple)):
        return all(_plain(item) for item in value)
    return value is None or isinstance(value, (str, int, float, bool))


def local_device():
    """The accelerator device of this rank (``cpu`` under DeepSpeed's CPU accelerator)."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() == "cpu":
        return torch.device("cpu")
    return torch.device(acc.device_name(int(os.environ.get("LOCAL_RANK", 0))))


def all_reduce(tensor, op="sum", group=None):
    """In-place all-reduce that is a no-op in a world of one."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size(group) == 1:
        return tensor
    ops = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX,
           "min": torch.distributed.ReduceOp.MIN}
    torch.distributed.all_reduce(tensor, op=ops[op], group=group)
    return tensor


# What a rank with no call says in ``in_step_with_other_ranks``' all-reduce of the most calls: above any count, so that
# the max tells every rank.
NO_CALLS = 2**62


def in_step_with_other_ranks(calls, spare, synced, device, no_calls_error=None):
    """The result of each of ``calls`` (callables), in order. Under ``synced`` each call's forwards are collectives
    over every rank (ZeRO-3's weight gathers), so every rank must make as many calls, in the same order: the ranks
    first agree on the most calls any makes (one all-reduce of one int, before any call: agreed after its own calls,
    a rank with fewer waited in the all-reduce while a peer's next call waited for its weights, a hang), then a rank
    with fewer calls ``spare()`` for each it lacks, its result dropped (``spare`` keeps its random draws out of the
    caller's). Within one call the callers keep the ranks stepping until all have finished. A rank with no call can
    make no spare one (``spare`` repeats one of its calls): it says so in the same all-reduce (``NO_CALLS``), and
    every rank raises ``no_calls_error(own)`` together (``own``: this rank had none), before any call; raised on
    that rank alone, its peers waited for ever."""
    total = len(calls)
    if synced:
        total = int(all_reduce(torch.tensor([total or NO_CALLS], device=device), "max").item())
        if not calls or total == NO_CALLS:
            raise (no_calls_error or _no_calls_error)(not calls)
    results = [call() for call in calls]
    for _ in range(total - len(calls)):
        spare()
    return results


def _no_calls_error(own):
    return RuntimeError(f"{'this rank' if own else 'another rank'} has no call to make, so it cannot keep in step "
                        "with its peers (its spare calls repeat one of its own): give every rank at least one")


def rank_mean(value, device):
    """The mean of a per-rank number over all ranks (collective)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    return all_reduce(t).item() / get_world_size()


# What a collective raises on a rank whose peer stopped (its own error printed by that rank): gloo's and NCCL's words.
PEER_FAILURE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing",
                        "NCCL communicator was aborted", "ProcessGroupNCCL")


def peer_failure(error):
    """Whether ``error`` is a collective failing because another rank stopped (not this rank's own failure)."""
    return (isinstance(error, RuntimeError) and get_world_size() > 1
            and any(marker in str(error) for marker in PEER_FAILURE_MARKERS))
