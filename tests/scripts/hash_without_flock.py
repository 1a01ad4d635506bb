"""A process of host HOST hashes a data file (``dschat.data.digests.file_digest``) with its hash cache on a file system
without flock (Lustre mounted without it, some FUSE mounts: flock fails with ENOSYS), its digest printed; with ``die``,
it is killed while hashing, as a rank killed by its job's end. Run by tests/test_data_sources.py:
``hash_without_flock.py HOST DATA [die]`` (HF_DATASETS_CACHE: the cache)."""
import errno
import fcntl
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dschat.data import digests  # noqa: E402

host, data, die = sys.argv[1], sys.argv[2], sys.argv[3:] == ["die"]
socket.gethostname = lambda: host  # (another node, or another container: its own host name)


def no_flock(*args):
    raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))


fcntl.flock = no_flock
digests._keeps_change_time = lambda fd: True  # (the data file as on ext4, whatever /tmp is here)
digests.RACY_WINDOW_NS = 0  # (written just before: as if long before)
if die:
    digests.hashlib.file_digest = lambda *args: os._exit(9)
print(digests.file_digest(data), flush=True)
