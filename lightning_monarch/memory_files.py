"""Files without a name, which the kernel frees with the last process that holds one.

Runs in every process of ours that needs a scratch file: the controller (a stage's storages, an
elastic fit's resume point), each worker (a checkpoint sent with its stage) and each served host
(its preemption notice). A file in ``/dev/shm`` or the temporary directory has a name, which
outlives a process killed before its ``finally`` runs (SIGKILL by the OOM killer, a closed
notebook kernel, a scheduler): with a 7 B-parameter model's storages that is 28 GB of RAM that
nothing frees until a reboot. A :class:`MemoryFile` is Linux's ``memfd_create``, which never has a
name: its pages are freed once no process holds it open or mapped, whichever process dies and
whenever. Another process on this host opens it by its :attr:`~MemoryFile.path` in ``/proc``, as
any file, while the process that made it lives; :func:`open_memory_file` checks that the path still
names the same file (a process in another PID namespace sees another process under the same PID).
Monarch runs on Linux only, and so does this.
"""

from __future__ import annotations

import os
from typing import Optional

#: What tells one memory file from every other on this host: its device and inode numbers.
Identity = tuple[int, int]


class MemoryFile:
    """A file without a name, open in this process until :meth:`close`; ``name`` shows in
    ``/proc/<pid>/fd`` and ``/proc/<pid>/maps`` (as ``memfd:<name>``) only."""

    def __init__(self, name: str) -> None:
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        #: The path by which this process, and another on this host, opens the file.
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"
        status = os.fstat(self.fd)
        self.identity: Identity = (status.st_dev, status.st_ino)

    def close(self) -> None:
        """Close this process's hold on the file: its pages are freed once no other process holds it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_memory_file(path: str, identity: Identity) -> Optional[int]:
    """A read-only descriptor of the memory file that another process made (its ``path`` and
    ``identity``), to close when done; ``None`` if this process cannot reach it (that process is
    gone, or lives in another PID namespace)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    status = os.fstat(fd)
    if (status.st_dev, status.st_ino) != identity:
        os.close(fd)
        return None
    return fd


def write_at(fd: int, data: memoryview, offset: int) -> None:
    """All of ``data`` (bytes) into ``fd`` from ``offset``: one ``pwrite`` writes at most 2 GiB on Linux."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def read_at(fd: int, into: memoryview, offset: int) -> None:
    """``fd`` from ``offset`` into all of ``into`` (bytes): one ``pread`` reads at most 2 GiB on Linux."""
    done = 0
    while done < len(into):
        done += os.preadv(fd, [into[done:]], offset + done)
