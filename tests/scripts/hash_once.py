"""Two ranks of a node hash the same data file at once (``dschat.data.digests.file_digest``), the hash slowed to take a
second, each hash computed written as a line to ``<out>/hashed``; then rank 0 alone hashes another file (no rank may
wait for the others there). Run by tests/test_data_sources.py through the deepspeed launcher:
``hash_once.py <data file> <other data file> <out>``."""
import hashlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dschat.data import digests  # noqa: E402
from dschat.utils.cli import end_script  # noqa: E402
from dschat.utils.dist import barrier, ensure_distributed  # noqa: E402

data, other, out = sys.argv[-3:]  # (after the launcher's --local_rank=N)
digests._keeps_change_time = lambda fd: True  # (the test's files as on ext4, whatever /tmp is here)
digests.RACY_WINDOW_NS = 0  # (written just before: as if long before)
real_file_digest = hashlib.file_digest


def slow_recorded_digest(f, *args):
    time.sleep(1)  # (long enough for the other rank to start hashing too, where nothing stops it)
    with open(os.path.join(out, "hashed"), "a") as record:
        record.write(f"{os.environ['RANK']} {os.path.basename(f.name)}\n")
    return real_file_digest(f, *args)


digests.hashlib.file_digest = slow_recorded_digest
rank, _ = ensure_distributed()
barrier()
with open(os.path.join(out, f"digest{rank}"), "w") as f:
    f.write(digests.file_digest(data))
if rank == 0:
    digests.file_digest(other)
barrier()
end_script()
