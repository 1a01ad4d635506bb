"""Process-group set-up: multi-rank CPU runs leave no DeepSpeed all-reduce buffers in /dev/shm behind."""
import os
import subprocess
import sys
import textwrap

from launch import REPO, free_port, remove_shm_buffers

from dschat.utils.dist import shm_buffers

SCRIPT = textwrap.dedent("""
    import os, sys, torch
    from dschat.utils.dist import ensure_distributed, shm_buffers
    rank, world = ensure_distributed()
    t = torch.ones(4)
    torch.distributed.all_reduce(t)
    assert t[0] == world == 2
    # DeepSpeed's CPU backend made this rank's buffer when the group started
    with open(os.path.join(sys.argv[-1], f"buffers_of_rank_{rank}"), "w") as f:
        f.write(str(len(shm_buffers(os.environ["MASTER_PORT"], rank))))
""")


def test_two_rank_cpu_run_removes_its_shm_buffers(tmp_path):
    script = tmp_path / "allreduce.py"
    script.write_text(SCRIPT)
    port = free_port()
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port),
           str(script), str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        seen = [(tmp_path / f"buffers_of_rank_{rank}").read_text() for rank in (0, 1)]
        assert seen == ["1", "1"], "each rank had its buffer while it ran"
        assert shm_buffers(port) == [], "the ranks' /dev/shm buffers outlived the run"
    finally:
        remove_shm_buffers(port)
