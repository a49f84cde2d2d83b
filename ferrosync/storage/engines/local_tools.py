"""Operations on a ``LocalStorage`` directory that only the operator tools use (``gc``,
``scan``, ``inspect``, ``doctor``): the entries that are no object, removing emptied
directories, and the gc lock file. Kept out of the engine so the collective path never
reaches them; ``LocalTree`` is the narrow interface ``ferrosync.ops`` calls.
"""

from __future__ import annotations

import contextlib
import os
import stat

from ferrosync.errors import StorageError
from ferrosync.storage.engines.base import check_key
from ferrosync.storage.engines.dirfd import LIST_FLAGS, LOCK_FLAGS
from ferrosync.storage.engines.local import LocalStorage, file_kind


class LocalTree:
    """The tools' view of one ``LocalStorage`` directory (same handles, same counters)."""

    def __init__(self, storage: LocalStorage) -> None:
        self.storage = storage

    def irregular(self, prefix: str = "") -> list[tuple[str, str]]:
        """(key, what it is) of every entry below ``prefix`` that is neither a regular
        file nor a directory: links, FIFOs, sockets, devices. ferrosync never writes
        them; the operator tools report them and leave them alone."""
        return sorted((key, file_kind(mode)) for key, mode, _ in self.storage.entries(prefix)
                      if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)))

    def remove_empty_dirs(self, prefix: str) -> None:
        """Remove directory ``prefix`` and the empty directories below it, children
        first. Nothing is followed: a link at ``prefix`` or below is left alone, and
        so is a directory something new appeared in."""
        directory, _, name = check_key(prefix).rpartition("/")
        try:
            parent = self.storage.dir_handle(directory)
            fd = os.open(name, LIST_FLAGS, dir_fd=parent.fd)
        except (OSError, StorageError):
            return  # gone, or not a directory (a link): nothing of ours to remove
        _remove_empty_below(fd)
        try:
            os.rmdir(name, dir_fd=parent.fd)  # rmdir() of a link fails: never followed
        except OSError:
            pass
        self.storage.forget_removed()

    def open_lock(self, key: str) -> int:
        """A read-write descriptor of ``key`` (created if missing) to hold an fcntl
        lock on; only a regular file, never through a link (a lock file opened with
        O_TRUNC through a planted link would empty the link's target)."""
        storage = self.storage
        storage.counters.add(requests=1)
        return storage.retry("opening the lock file", key, storage.open_regular, key,
                             LOCK_FLAGS)[0]


def _remove_empty_below(fd: int) -> None:
    """rmdir every empty directory below the directory ``fd`` (closed here), children
    first; links are not followed and non-empty directories stay. Iterative (a tree of
    any depth is untrusted input), holding the handles of one branch only."""
    # each frame: [its handle, subdirectory names left, the one being visited]
    stack = [[fd, _subdirs(fd), None]]
    try:
        while stack:
            frame = stack[-1]
            if frame[2] is not None:  # back from a child: remove it if now empty
                with contextlib.suppress(OSError):  # not empty: something new appeared
                    os.rmdir(frame[2], dir_fd=frame[0])
                frame[2] = None
            if not frame[1]:
                os.close(stack.pop()[0])
                continue
            frame[2] = frame[1].pop()
            try:
                sub = os.open(frame[2], LIST_FLAGS, dir_fd=frame[0])
            except OSError:
                frame[2] = None
                continue
            stack.append([sub, _subdirs(sub), None])
    finally:
        for frame in stack:
            os.close(frame[0])


def _subdirs(fd: int) -> list[str]:
    """Names of the subdirectories (by lstat) of directory ``fd``, which stays open."""
    try:
        with os.scandir(fd) as entries:
            return [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
