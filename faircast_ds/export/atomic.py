"""Publishing a directory atomically: readers see the previous complete version or the new one.

The new content is written into a temporary directory beside the target (same filesystem), every
file and the directory itself are fsynced, and the temporary directory is then renamed over the
target. On Linux an existing target is swapped in one step (``renameat2(RENAME_EXCHANGE)``); where
that call is missing the old version is moved aside first, so a crash in between leaves the target
absent (never half written). Leftovers of writers that died are removed by the next writer.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import tempfile
from pathlib import Path

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file and directory under ``root`` (directories after their contents)."""
    for dirpath, _, files in os.walk(root, topdown=False):
        for f in files:
            _fsync_path(os.path.join(dirpath, f))
        _fsync_path(dirpath)


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths; False where the system cannot."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    errno = ctypes.get_errno()
    if errno in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: this filesystem or kernel cannot exchange
        return False
    raise OSError(errno, os.strerror(errno), a)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _scratch_prefix(target: Path, kind: str) -> str:
    return f".{target.name}.{kind}-"


def remove_stale(target: str | os.PathLike) -> list[str]:
    """Remove temporary directories beside ``target`` left by writers that are no longer running (putting
    back a previous version that a writer had moved aside and not replaced)."""
    target = Path(target).absolute()
    removed = []
    if not target.parent.is_dir():
        return removed
    for kind in ("tmp", "old"):
        prefix = _scratch_prefix(target, kind)
        for entry in target.parent.iterdir():
            if not entry.name.startswith(prefix):
                continue
            pid = entry.name[len(prefix):].split("-", 1)[0]
            if pid.isdigit() and pid_alive(int(pid)) and int(pid) != os.getpid():
                continue  # another writer is at work
            previous = entry / "previous"
            if kind == "old" and previous.is_dir() and not target.exists():
                os.rename(previous, target)  # the writer died between moving the old version aside and renaming
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(str(entry))
    return removed


class AtomicDirectory:
    """A temporary directory beside ``target``; :meth:`commit` publishes it as ``target``.

    ``with AtomicDirectory(path) as tmp: ...write into tmp...`` commits when the block succeeds and
    discards the temporary directory when it raises.
    """

    def __init__(self, target: str | os.PathLike) -> None:
        self.target = Path(target).absolute()
        self.target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(self.target)
        self.path = Path(tempfile.mkdtemp(prefix=_scratch_prefix(self.target, "tmp") + f"{os.getpid()}-",
                                          dir=self.target.parent))
        self._done = False

    def commit(self) -> None:
        """fsync the new content, then make it the target in one rename."""
        fsync_tree(str(self.path))
        os.chmod(self.path, 0o755)  # mkdtemp makes it private; an export is read by other processes
        if self.target.exists() and not self.target.is_dir():
            raise FileExistsError(f"{self.target} exists and is not a directory")
        if not self.target.exists():
            os.rename(self.path, self.target)
        elif _exchange(str(self.path), str(self.target)):
            shutil.rmtree(self.path)  # now the previous version
        else:
            old = Path(tempfile.mkdtemp(prefix=_scratch_prefix(self.target, "old") + f"{os.getpid()}-",
                                        dir=self.target.parent))
            os.rename(self.target, old / "previous")
            os.rename(self.path, self.target)
            shutil.rmtree(old)
        _fsync_path(str(self.target.parent))
        self._done = True

    def discard(self) -> None:
        if not self._done:
            shutil.rmtree(self.path, ignore_errors=True)
            self._done = True

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()
