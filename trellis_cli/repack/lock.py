"""One repack at a time per OUT: an exclusive, non-blocking lock held for the whole run.

The lock is `OUT.partial.lock`, beside the stage (the stage itself is deleted and renamed while the run
works, so it cannot carry the lock). A second repack into the same OUT fails at once, naming the pid that
holds the lock, before it reads or writes anything. The lock file is removed when the run ends; a run
killed outright leaves it behind, unlocked, and the next run takes it over.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from trellis_cli.errors import UsageError
from trellis_cli.header import file_kind

LOCK_SUFFIX = ".lock"


class StageLock:
    """`with StageLock(stage_path):` -> held exclusively, or UsageError naming the holder."""

    def __init__(self, stage: Path, out: Path) -> None:
        self.path = stage.with_name(stage.name + LOCK_SUFFIX)
        self.out = out
        self.fd = -1

    def __enter__(self) -> "StageLock":
        for _ in range(10):  # the holder may remove the file between our open and our lock: open it again
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd)
                os.close(fd)
                raise UsageError(f"{self.out}: another trellis repack (pid {holder}) is writing it (lock "
                                 f"{self.path}); wait for it to finish, then rerun") from None
            if _same_file(fd, self.path):
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                self.fd = fd
                return self
            os.close(fd)
        raise UsageError(f"{self.path}: the lock file keeps being replaced; is another repack starting?")

    def refuse_unusable(self) -> None:
        """What `__enter__` would refuse about the lock file, said without creating or opening it (a dry run
        gives the real run's answer)."""
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return
        except OSError:
            return  # the real run's open names the OS's reason
        if stat.S_ISLNK(mode):
            raise UsageError(f"{self.path}: the lock file of {self.out} is a symbolic link; refusing it")
        if not stat.S_ISREG(mode):
            raise UsageError(f"{self.path}: the lock file of {self.out} is {file_kind(mode)}, not a regular file; "
                             f"remove it and rerun")

    def _open(self) -> int:
        try:
            # O_NONBLOCK: a FIFO planted under the lock's name must not block the open.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
        except OSError as e:
            if e.errno != errno.ELOOP:  # an I/O error (no such folder, permission, full disk): exit 1, named
                e.filename = str(self.path)
                raise
            raise UsageError(f"{self.path}: the lock file of {self.out} is a symbolic link; refusing it") from e
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # a FIFO, socket or device: flock fails on some with a bare EINVAL
            os.close(fd)
            raise UsageError(f"{self.path}: the lock file of {self.out} is {file_kind(mode)}, not a regular file; "
                             f"remove it and rerun")
        return fd

    def __exit__(self, *exc) -> None:
        if self.fd >= 0:
            try:
                self.path.unlink(missing_ok=True)  # while still held: a waiting opener then sees a stale file
            finally:
                os.close(self.fd)
                self.fd = -1


def _read_pid(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return text if text.isdigit() else "unknown"


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)
