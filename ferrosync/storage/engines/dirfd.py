"""How the directory engine opens names below a root it does not trust: the ``os.open``
flags of each kind of name, and ``DirHandle``, an open directory used as ``dir_fd``.
Shared by ``local`` (the engine) and ``local_tools`` (the operator tools' directory work)
(docs/design.md#security-model).
"""

from __future__ import annotations

import os

CLOEXEC = getattr(os, "O_CLOEXEC", 0)
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
#: a directory handle used only as ``dir_fd``: O_PATH (Linux) needs search permission
#: only, as the path lookups it replaces did, not read permission
HANDLE = getattr(os, "O_PATH", os.O_RDONLY)
#: the root itself: links on the user's path to it are followed
ROOT_FLAGS = HANDLE | O_DIRECTORY | CLOEXEC
#: a directory below the root: a link there is refused (ENOTDIR)
DIR_FLAGS = HANDLE | O_DIRECTORY | NOFOLLOW | CLOEXEC
#: a directory to list (scandir reads it), below or at the root: no link either
LIST_FLAGS = os.O_RDONLY | O_DIRECTORY | NOFOLLOW | CLOEXEC
#: an object to read: no link, and no waiting in open() for a FIFO's writer; fstat
#: then refuses whatever is not a regular file
READ_FLAGS = os.O_RDONLY | NOFOLLOW | os.O_NONBLOCK | CLOEXEC
#: a temporary file: created now, so never an existing name or a link's target
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC
#: a parked spare to rewrite: checked with fstat once open
REUSE_FLAGS = os.O_WRONLY | NOFOLLOW | os.O_NONBLOCK | CLOEXEC
#: the gc lock: created if missing, never through a link, never waiting on a FIFO;
#: checked with fstat once open
LOCK_FLAGS = os.O_RDWR | os.O_CREAT | NOFOLLOW | os.O_NONBLOCK | CLOEXEC


class DirHandle:
    """An open directory below (or at) the root.

    The descriptor closes when the last user lets go of this object, so a handle one
    thread drops from the cache is never closed (and its number reused for another
    file) under an operation another thread is running with it.
    """

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def gone(self) -> bool:
        """True once the directory was removed (or its NFS handle went stale)."""
        try:
            return os.fstat(self.fd).st_nlink == 0
        except OSError:
            return True

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except Exception:  # noqa: BLE001 - at interpreter exit even ``os`` may be gone
            pass
