"""Process-group set-up: multi-rank CPU runs leave no DeepSpeed all-reduce buffers in /dev/shm behind (unlinked once
every rank has mapped them), and DeepSpeed's shared-memory all-reduce keeps working."""
import os
import subprocess
import sys
import textwrap

from launch import REPO, remove_shm_buffers

from dschat.utils.dist import free_port, shm_buffers

SCRIPT = textwrap.dedent("""
    import os, sys, torch, deepspeed
    from dschat.utils.dist import ensure_distributed, shm_buffers
    rank, world = ensure_distributed()
    left = len(shm_buffers(os.environ["MASTER_PORT"], rank))  # unlinked once every rank has mapped it
    t = torch.ones(4)
    deepspeed.comm.inference_all_reduce(t)  # DeepSpeed's shared-memory all-reduce still works on the mappings
    assert t[0] == world == 2
    with open(os.path.join(sys.argv[-1], f"buffers_of_rank_{rank}"), "w") as f:
        f.write(str(left))
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
        assert seen == ["0", "0"], "the buffers are unlinked as soon as the process group has started"
        assert shm_buffers(port) == [], "the ranks' /dev/shm buffers outlived the run"
    finally:
        remove_shm_buffers(port)
