"""Data files' hashes (``file_digest``) and the stamps that key them; the hashes kept on disk, and their pruning,
so that a file is hashed once per change, also by several ranks and hosts at once.
"""
import collections
import contextlib
import functools
import hashlib
import json
import os
import re
import time

from dschat.utils.files import atomic_file


def file_digest(path):
    """The sha256 of a file's content: a hub cache's file by the name of the blob it links to, where the hub client
    named it so (``hub_blob_sha256``), else computed once for each stamp of the file (``_digest_of_open_file``: a write
    gives it another)."""
    return file_digest_and_stamp(path).sha256


class HashedFile(collections.namedtuple("HashedFile", "sha256 stamp head", defaults=(None,))):
    """A file's sha256 (None from ``shared_digest`` where no hash is kept) and the stamp (``FileStamp``) of the file
    open when it was found, None where the file was not opened (a hub blob, named by its hash): what the stamp says
    (its size, that the file is not written since) needs no other stat or open of it. ``head``: its first HEAD_BYTES,
    read in that open (None where not read), so a load tells its compression and text encoding by them
    (``compressed_with``, ``text_encoding``), not by opens of its own."""


def file_digest_and_stamp(path, check_head=None):
    """``file_digest`` of the file at ``path`` as a HashedFile. ``check_head``: called with the file's first bytes
    before it is read whole (where it is opened: not a hub blob), so that its error (a load's compression check) comes
    before a read of the whole file."""
    if blob := hub_blob_sha256(path):
        return HashedFile(blob, None)
    with open(path, "rb") as f:
        return _digest_of_open_file(f, os.path.abspath(path), check_head)


_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def hub_blob_sha256(path):
    """The sha256 of the content of a file of a Hugging Face hub cache (``REPO_TYPEs--ORG--NAME/snapshots/COMMIT/...``,
    a link to ``blobs/SHA256``), read from its blob's name, else None. The hub client names a large (LFS) file's blob
    by its content's sha256, the hash computed here otherwise: a c4 config's gzip'd shards or a dataset's parquet
    shards were read whole (~300 GB for c4's en) for the tokenized data's cache key, each process. A small file's blob
    is named by its git hash (40 digits, another hash), and is read. (A blob edited in place would keep its name: the
    hub client, too, takes the name for the content.)"""
    folder, name = os.path.split(os.path.realpath(path))
    repo, blobs = os.path.split(folder)
    in_hub_cache = blobs == "blobs" and os.path.basename(repo).startswith(("datasets--", "models--", "spaces--"))
    return name if in_hub_cache and _SHA256_HEX.fullmatch(name) else None


# Where a file's sha256 is kept for later processes (``_digest_of_open_file``), in datasets' cache beside the Arrow
# caches it keys (``load_content_keyed``); a file changed less than RACY_WINDOW_NS before it was hashed is not kept (a
# write in the same tick of the file system's clock would leave its change time as it was)
DIGEST_MEMO_FOLDER, RACY_WINDOW_NS = "dschat_file_sha256", 2 * 10**9

# The file systems whose change time a write always moves forward and nothing sets back: a kept hash is used only for
# a file on one of them. Not on the others: a read-only image's (squashfs, erofs: an Apptainer image's ctime is the
# stored mtime, its inodes fixed, so a same-size edit in a new image version has the old stamp), FAT's, many FUSE and
# object-store mounts', overlay's (its lower layers may be such images; a container's files are on it): those files are
# hashed by each process, as before the hashes were kept.
CHANGE_TIME_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "tmpfs", "nfs", "nfs4", "lustre",
                                      "gpfs", "ceph"})
MOUNTINFO = "/proc/self/mountinfo"


_DIGESTS = {}  # {(absolute path, stamp): sha256} read or computed in this process (``forget_file_digests``)


def shared_digest(path):
    """The sha256 of the file at ``path`` as every later process finds it without reading the file: its hub blob's
    name (``hub_blob_sha256``), or the hash kept under the stamp the file has now (``_digest_of_open_file``: on a file
    system whose change time a write moves, hashed after its last write's racy window); else None. A HashedFile: with
    the stamp the file has now (None for a hub blob's)."""
    if blob := hub_blob_sha256(path):
        return HashedFile(blob, None)
    with open(path, "rb") as f:
        stamp = _stat_stamp(os.fstat(f.fileno()))
        kept = _kept_digest(os.path.abspath(path), stamp) if _keeps_change_time(f.fileno()) else None
        return HashedFile(kept, stamp)


def _digest_of_open_file(f, path, check_head=None):
    """The sha256 of the file ``f``, opened at ``path`` (absolute), under the stamp of the file opened (device, inode,
    size, modification and change times; ``os.fstat``, not a stat before the open: an NFS client's stat answers from
    attributes it cached, up to a minute, where its open asks the server), kept for later processes
    (``DIGEST_MEMO_FOLDER``), so that a run's every process, and every later run, did not read the data whole again (a
    c4 config downloaded with --local-dir: ~300 GB each). A write sets the change time, which ``touch`` cannot set
    back: an edited file has another stamp, and is read. A file written while it was read keeps nothing, nor one on a
    file system not known to keep a real change time (``_keeps_change_time``). Processes hashing the same file at once
    (a node's ranks on a first run) take turns (``_memo_bucket_lock``): the first hashes it, the others read its hash.
    A HashedFile: with the stamp it was hashed under, and its first bytes (given to ``check_head`` first, where
    given)."""
    stamp = _stat_stamp(os.fstat(f.fileno()))
    head = f.read(HEAD_BYTES)
    if check_head is not None:
        check_head(head)
    f.seek(0)
    keeps = _keeps_change_time(f.fileno())
    if (digest := _DIGESTS.get((path, stamp)) or (_kept_digest(path, stamp) if keeps else None)) is None:
        with _memo_bucket_lock(_digest_memo_path(path, stamp)) if keeps else contextlib.nullcontext():
            if (digest := _kept_digest(path, stamp) if keeps else None) is None:  # (kept while this one waited)
                hashed_at = time.time_ns()
                digest = hashlib.file_digest(f, "sha256").hexdigest()
                if _stat_stamp(os.fstat(f.fileno())) != stamp:  # (what was read is of neither stamp)
                    return HashedFile(digest, stamp, head)
                if keeps and stamp.ctime_ns < hashed_at - RACY_WINDOW_NS:
                    _keep_digest(path, stamp, digest)
    _DIGESTS[path, stamp] = digest
    return HashedFile(digest, stamp, head)


@contextlib.contextmanager
def _memo_bucket_lock(memo):
    """Held while what is kept at ``memo`` (a file in a bucket folder of a memo folder of datasets' cache: a kept hash,
    a JSON file's passed check) is made and kept, so that the processes making it at once (a node's ranks on a first
    run) take turns: the first makes it, the others, let in after, read what it kept. A file lock, not a collective:
    ranks need not make the same memos, nor in one order, nor have a process group; a rank killed while holding it
    lets it go. One lock per bucket (a 256th of the memos, by the entry's name), a file beside the bucket folder (at
    most 256, never pruned). Where it cannot be taken (a cache folder not writable, another user's lock file in a
    shared cache, a file system without flock), none is: the process makes the memo itself. flock alone, not
    filelock's FileLock: without flock, FileLock falls back to a marker file, which a process of another host or
    container never takes for stale, so a rank killed while holding it held every later process making a memo of its
    bucket up for ever (filelock 3 raised NotImplementedError there instead)."""
    import fcntl

    bucket = os.path.dirname(memo)
    fd = None
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(bucket), exist_ok=True)
        fd = os.open(f"{bucket}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    if fd is None:
        yield
        return
    try:
        with contextlib.suppress(OSError):  # (ENOSYS, ENOLCK: no flock there, so no lock)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (which lets the lock go)


# what tells one version of a file from another (``_digest_of_open_file``): a tuple, as kept hashes name it
FileStamp = collections.namedtuple("FileStamp", "device inode size mtime_ns ctime_ns")


def _stat_stamp(st):
    return FileStamp(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _keeps_change_time(fd):
    """Whether the file open as ``fd`` is on a mount of one of CHANGE_TIME_FILE_SYSTEMS, found by its mount's ID
    (``_mount_id``), not by its ``st_dev``: a btrfs file's st_dev is its subvolume's own anonymous device, which
    mountinfo's MAJOR:MINOR for the mount is not. False where this process's mounts cannot be read (no /proc: macOS)."""
    return _mount_file_systems().get(_mount_id(fd)) in CHANGE_TIME_FILE_SYSTEMS


def _mount_id(fd):
    """The ID of the mount that the file open as ``fd`` is read through (/proc/self/fdinfo's mnt_id, Linux 3.15 on:
    mountinfo's first field), else None."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", encoding="ascii", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name == "mnt_id" and value.strip().isdigit():
                    return int(value)
    except OSError:
        pass
    return None


@functools.cache
def _mount_file_systems():
    """{mount ID: file system type} of this process's mounts (MOUNTINFO, read once), empty where unreadable."""
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="replace") as f:
            return _file_systems_of_mountinfo(f.read())
    except OSError:
        return {}


def _file_systems_of_mountinfo(text):
    """{mount ID: file system type} of a /proc/PID/mountinfo's lines: ``ID PARENT MAJOR:MINOR ROOT MOUNT_POINT
    OPTIONS [OPTIONAL FIELDS...] - TYPE SOURCE SUPER_OPTIONS`` (spaces in paths written as \\040)."""
    types = {}
    for line in text.splitlines():
        mount, dash, file_system = line.partition(" - ")
        fields, file_system = mount.split(), file_system.split()
        if dash and fields and fields[0].isdigit() and file_system:
            types[int(fields[0])] = file_system[0]
    return types


def forget_file_digests():
    """Forget the digests this process read or computed (a later process's start, in tests)."""
    _DIGESTS.clear()


def _kept_digest(path, stamp):
    """The digest kept under ``stamp`` for the file at ``path``, else None."""
    try:
        with open(_digest_memo_path(path, stamp), encoding="ascii") as f:
            kept = f.read()
    except (OSError, ValueError):  # (none kept; a cache folder not readable)
        return None
    digest = kept.partition("\n")[0]  # (the file's path and stamp follow: ``_keep_digest``)
    return digest if _SHA256_HEX.fullmatch(digest) else None


def _digest_memo_folder():
    return _datasets_cache_folder(DIGEST_MEMO_FOLDER)


def _datasets_cache_folder(name):
    import datasets

    return os.path.join(datasets.config.HF_DATASETS_CACHE, name)


def _digest_memo_path(path, stamp):
    name = hashlib.sha256(repr((path, *stamp)).encode()).hexdigest()
    return os.path.join(_digest_memo_folder(), name[:2], name)


def _keep_digest(path, stamp, digest):
    """The digest of the file at ``path`` (absolute) under its ``stamp``, written whole, with the mode a plain ``open``
    gives (``atomic_file``: a reader never sees half of it, and the other users of a shared cache read it), the path
    and stamp after it (a line of JSON) for pruning to tell whether the file is still there as it was; then pruned now
    and then (``_prune_now_and_then``). A cache folder not writable keeps nothing."""
    with contextlib.suppress(OSError), atomic_file(_digest_memo_path(path, stamp)) as f:
        f.write(f"{digest}\n{json.dumps([path, *stamp])}")
    _prune_now_and_then(_digest_memo_folder())


# The kept hashes are pruned (``prune_kept_digests``) when one is written, at most once every PRUNE_INTERVAL_S (by the
# time of the file PRUNED_MARK): without it they were never removed, one more for each file written or removed since.
# An entry that names no file (written before entries named it) is removed once UNNAMED_ENTRY_AGE_S old.
PRUNE_INTERVAL_S, UNNAMED_ENTRY_AGE_S, PRUNED_MARK = 24 * 3600, 30 * 24 * 3600, "last_pruned"


def _prune_now_and_then(folder):
    """``prune_kept_digests(folder)`` where its PRUNED_MARK is missing or older than PRUNE_INTERVAL_S, touched first
    (processes that find it due at once each prune: redundant, not unsafe). Another user's mark in a shared cache,
    which this process cannot touch, leaves the pruning to that user."""
    mark = os.path.join(folder, PRUNED_MARK)
    with contextlib.suppress(OSError):
        if time.time() - os.stat(mark).st_mtime < PRUNE_INTERVAL_S:
            return
    try:
        with open(mark, "a"):
            os.utime(mark)
    except OSError:
        return
    prune_kept_digests(folder)


def prune_kept_digests(folder):
    """Remove the kept hashes in ``folder`` that no process will read again (``_stale_entry``). Safe beside processes
    writing entries: an entry is a temp file until it is whole (``atomic_file``), and one rewritten while this runs is
    of the same path and stamp, as stale or as live as before. An entry removed wrongly (a file this node cannot see,
    in a cache shared with others) costs only a hash computed again."""
    now = time.time()
    buckets = [entry.path for entry in os.scandir(folder) if entry.is_dir()] if os.path.isdir(folder) else []
    for bucket in buckets:
        with contextlib.suppress(OSError):
            for entry in os.scandir(bucket):
                with contextlib.suppress(OSError):
                    if _stale_entry(entry, now):
                        os.unlink(entry.path)


def _stale_entry(entry, now):
    """Whether the kept hash ``entry`` (an os.DirEntry; or kept pass: ``_keep_passed_check``) is of a file gone, or
    written since (another stamp: the device number aside, which a file of a shared NFS mount has another of on each
    node), of any of the files it names (a split's records' pass names all its files), or names no file and is
    UNNAMED_ENTRY_AGE_S old; or is a temp file of a writer killed that long ago."""
    old = now - entry.stat().st_mtime > UNNAMED_ENTRY_AGE_S
    if not _SHA256_HEX.fullmatch(entry.name):
        return old and entry.name.endswith(".tmp")  # (``atomic_file``'s)
    named = _entry_files(entry.path)
    if named is None:
        return old
    return any(_gone_or_written(path, stamp) for path, stamp in named)


def _gone_or_written(path, stamp):
    """Whether the file at ``path`` is gone, or has another stamp than ``stamp`` (its device number aside). A path no
    file can have (a NUL in it: a hand-corrupted entry; os.stat raises ValueError) is of a file gone."""
    try:
        now_stamp = _stat_stamp(os.stat(path))
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return True
    return now_stamp[1:] != stamp[1:]


def _entry_files(memo):
    """[(path, stamp)] of the files the kept entry ``memo`` was written for, from its second line: a kept hash's one
    file, [path, *stamp]; a kept pass's files, [[path, *stamp], ...]. None for an entry written before entries named
    their files, or not readable so."""
    try:
        with open(memo, encoding="ascii") as f:
            named = json.loads(f.read().partition("\n")[2])
    except ValueError:  # (not ASCII, no JSON)
        return None
    files = named if isinstance(named, list) and named and all(isinstance(one, list) for one in named) else [named]
    if not all(isinstance(one, list) and len(one) == 6 and isinstance(one[0], str) for one in files):
        return None
    return [(path, tuple(stamp)) for path, *stamp in files]


def all_files(path):
    """``path`` itself, or the files of the folder ``path`` (sorted), those under a linked folder in it too: datasets
    reads through such a link (a copy's data/ linked to where its files are kept), and pathlib's rglob did not enter
    it, so ``LocalSource.fingerprint`` and ``files_stamp`` held none of what was read there."""
    if os.path.isfile(path):
        return [path]
    files, walked, top = [], set(), os.path.realpath(path)
    for folder, subfolders, names in os.walk(path, followlinks=True):
        real = os.path.realpath(folder)
        # (a folder walked already, or a link up to one holding ``path``: the walk would not end, or list all above)
        if real in walked or top.startswith(real.rstrip(os.sep) + os.sep):
            subfolders[:] = []
            continue
        walked.add(real)
        subfolders.sort()  # (the same walk each time: a folder reached by two paths is listed under the first)
        files += [os.path.join(folder, name) for name in names if os.path.isfile(os.path.join(folder, name))]
    return sorted(files)


def files_stamp(paths):
    """(path, size, modification and change times) of every file of ``paths`` (files or folders): another stamp
    where a file was written since (``get_raw_dataset``'s kept reads: its records read again)."""
    stamps = []
    for path in paths:
        for file in all_files(path):
            st = os.stat(file)
            stamps.append((os.path.abspath(file), st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(stamps)


HEAD_BYTES = 10  # (the first bytes read of a file: bzip2's magic, the longest, and a UTF-8 byte-order mark's 3)
