"""Temporary files and folders for atomic writes (write aside, then ``os.replace``), with the permissions a plain
``mkdir`` / ``open`` would give: ``tempfile`` makes them owner-only, and the rename keeps that mode, so saved models
and data caches on shared storage would be unreadable to other users and services. Also: a run's relative paths
read from another working directory (``path_under``), and JSON written atomically (``write_json_atomic``) and read
back (``read_json_object``)."""
import contextlib
import errno
import json
import os
import re
import shutil
import tempfile


def _umask():
    """The process's umask, read from /proc where it can be (os.umask can only read it by setting it, which would
    briefly give files other threads create mode 0o777/0o666)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o077)  # the fallback: briefly stricter, never looser
    os.umask(mask)
    return mask


def temp_folder(parent, prefix):
    """A new folder in ``parent`` with the mode ``os.makedirs`` would give it."""
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    os.chmod(path, 0o777 & ~_umask())
    return path


def temp_file(parent, suffix):
    """(fd, path) of a new file in ``parent`` with the mode ``open(path, "w")`` would give it."""
    fd, path = tempfile.mkstemp(dir=parent, suffix=suffix)
    os.chmod(path, 0o666 & ~_umask())
    return fd, path


def give_plain_modes(folder):
    """Give every file and folder under ``folder`` the mode a plain ``open`` / ``mkdir`` would: some writers make
    owner-only files (safetensors' ``save_file``, hence ``save_pretrained``: 0o600), which the folder's other readers
    (a serving job, a colleague) could not open."""
    mask = _umask()
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            if not os.path.islink(os.path.join(root, name)):  # chmod follows links: leave what they point to alone
                os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


def check_writable_folder(path, flag):
    """An output folder this process can make (if need be) and write in (a model save is staged in it too:
    ``checkpoint.staging_parent``): one that cannot be is a UsageError naming ``flag`` before anything trains, not a
    traceback when the trained model is saved. Makes nothing (a run that fails later leaves no empty output folder,
    which would pass for a step's output)."""
    from dschat.errors import UsageError

    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path}: a file, not a folder")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):  # the folder a new one would be made in
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(20, "Not a directory", existing)
        os.rmdir(tempfile.mkdtemp(prefix=".dschat-write-check-", dir=existing))
    except OSError as error:
        raise UsageError(f"{flag} {path}: cannot write there ({error.strerror or error}: {existing})") from None


def path_under(folder, path):
    """``path`` as a process whose working directory was ``folder`` read it, if it is still there, else None: how
    the tools read a run's relative paths (data files, reward model, reward function) from any other folder."""
    if not (folder and path):
        return None
    anchored = os.path.join(folder, path)  # (an absolute ``path`` stays itself)
    if not os.path.exists(anchored):
        return None
    # "./my_reward_model" or "a/./b" as the tools echo it: without its "." parts ("x/link/.." only where it is the same)
    tidy = os.path.normpath(anchored)
    return tidy if os.path.exists(tidy) and os.path.samefile(tidy, anchored) else anchored


def read_json_object(path):
    """The JSON object in ``path`` (None: no such file); a file that holds none is a UsageError naming it."""
    from dschat.errors import UsageError

    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            value = json.load(f)
    except ValueError as error:
        raise UsageError(f"{path} is not JSON ({error}); restore or remove it") from None
    if not isinstance(value, dict):
        raise UsageError(f"{path} holds no JSON object; restore or remove it")
    return value


@contextlib.contextmanager
def atomic_file(path, mode="w"):
    """A new file, open in ``mode``, that replaces ``path`` whole when the block ends (``os.replace``): a reader never
    sees it half-written, and a block that fails leaves ``path`` as it was."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = temp_file(folder, ".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json_atomic(path, data, default=None):
    """Write JSON to ``path`` whole (``atomic_file``)."""
    with atomic_file(path) as f:
        json.dump(data, f, indent=2, default=default)


# What torch's zip reader says of a file cut short or corrupted (a RuntimeError, as are a CUDA out-of-memory and a
# collective's failure, which are not the file's).
ZIP_READER_MARKERS = ("PytorchStreamReader", "zip archive")


def unreadable_file_reason(error, kinds=()):
    """"Type: first sentence" of ``error`` when it is how a truncated, corrupted or missing file fails to load (an
    EOFError, an unpickling error, torch's zip reader's RuntimeError, or one of ``kinds``), else None."""
    import pickle

    import torch

    if isinstance(error, torch.cuda.OutOfMemoryError):
        return None
    zip_reader = isinstance(error, RuntimeError) and any(marker in str(error) for marker in ZIP_READER_MARKERS)
    if not (zip_reader or isinstance(error, (EOFError, pickle.UnpicklingError, *kinds))):
        return None
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0].split('. ')[0] if text else 'no message'}"


# What torch's zip writer (torch.save, hence DeepSpeed's checkpoints) says of a write that failed, a RuntimeError that
# names no cause: "[enforce fail at inline_container.cc] . unexpected pos 704 vs 598", "PytorchStreamWriter failed
# writing file data/0: file write failed", "basic_ios::clear: iostream error".
ZIP_WRITER_MARKERS = ("PytorchStreamWriter", "unexpected pos", "file write failed", "iostream error")
LOW_DISK_SPACE = 2**30  # less free after a failed write: the disk filled (the write's part is still on it)
PROBE_BYTES = 2**20  # what a write probe after torch's failed write writes: more than a quota's rounding leaves
FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


# How a Rust writer (safetensors: model saves) names the OS's error in its message ("Error while serializing: I/O
# error: No space left on device (os error 28)").
RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


@contextlib.contextmanager
def writes_said_on_a_full_disk(folder):
    """A write into ``folder`` that failed on a full disk or quota as torch's or safetensors' own error (which read as
    a bug's traceback), or as an OSError that names no file (a plain ``write``'s), is raised as the OSError (ENOSPC,
    EDQUOT) naming ``folder`` (and, for a full disk, the space left), which ``cli.run_entry_point`` says in one line.
    safetensors names the OS's error; torch's writer names none (``ZIP_WRITER_MARKERS``), so a write probe asks the
    disk (``probe_write_errno``: a quota, which the free space does not show), and its failure counts as a full disk's
    where under ``LOW_DISK_SPACE`` is free."""
    try:
        yield
    except Exception as error:
        code = unnamed_full_disk_errno(error) if isinstance(error, OSError) else full_disk_errno(error, folder)
        if code is None:
            raise
        free = free_space(folder) if code == errno.ENOSPC else None  # (a quota's limit is not the disk's space)
        left = f" ({free / 2**20:.1f} MiB free)" if free is not None else ""
        raise OSError(code, f"{os.strerror(code)}{left}", folder) from error


def unnamed_full_disk_errno(error):
    """ENOSPC or EDQUOT of an OSError that names no file (``os.write``'s, a file object's ``write``), else None."""
    return None if error.filename else full_disk_code(error)


def full_disk_code(error):
    """An OSError's errno where it is ENOSPC or EDQUOT, else None."""
    return error.errno if error.errno in FULL_DISK_ERRNOS else None


def full_disk_errno(error, folder):
    """ENOSPC or EDQUOT where ``error`` (not an OSError) is how torch or safetensors failed on a full disk or quota."""
    if rust := RUST_OS_ERROR.search(str(error)):
        return int(rust[1]) if int(rust[1]) in FULL_DISK_ERRNOS else None
    if isinstance(error, RuntimeError) and any(marker in str(error) for marker in ZIP_WRITER_MARKERS):
        if code := probe_write_errno(folder):
            return code
        free = free_space(folder)
        return errno.ENOSPC if free is not None and free < LOW_DISK_SPACE else None
    return None


def probe_write_errno(folder):
    """ENOSPC or EDQUOT where ``PROBE_BYTES`` written into ``folder`` (its nearest existing parent) and synced fail so,
    else None (the probe file goes): after torch's writer failed, a quota used up (EDQUOT, the disk itself may have
    terabytes free) or a disk full to this user (root's reserved blocks left) fail it too."""
    try:
        fd, path = temp_file(existing_parent(folder), ".write-probe")
    except OSError as error:
        return full_disk_code(error)
    try:
        try:
            os.write(fd, bytes(PROBE_BYTES))
            os.fsync(fd)  # (a network file system says a quota's error at the sync or close)
        finally:
            os.close(fd)
    except OSError as error:
        return full_disk_code(error)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return None


def existing_parent(folder):
    """``folder``, else its nearest parent that exists."""
    existing = os.path.abspath(folder)
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    return existing


def free_space(folder):
    """The bytes free to this user on the disk of ``folder`` (its nearest existing parent), None where unknown."""
    try:
        return shutil.disk_usage(existing_parent(folder)).free  # (statvfs's f_bavail: root's reserved blocks not)
    except OSError:
        return None
