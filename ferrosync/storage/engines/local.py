"""The directory engine: ``LocalStorage``, a local or NFS directory reached through POSIX
directory handles (``dir_fd``), never following a link below its root.

Atomic publish is a temporary file in the same directory renamed onto the final name;
``put(exclusive=True)`` is ``link()``, which fails when the name exists (also on NFS).
Anything but a regular file at a name is refused with a ``StorageError``. Operations only
the operator tools need (listing irregular entries, removing empty directories, the gc
lock) are in ``local_tools``.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from typing import Iterable, Sequence

from ferrosync.errors import ConfigError, StorageError
from ferrosync.storage import names
from ferrosync.storage.engines.base import Counters, Reader, Storage, check_key
from ferrosync.storage.engines.classify import is_transient, storage_error
from ferrosync.storage.engines.dirfd import (
    CREATE_FLAGS,
    DIR_FLAGS,
    LIST_FLAGS,
    READ_FLAGS,
    REUSE_FLAGS,
    ROOT_FLAGS,
    DirHandle,
)
from ferrosync.storage.engines.mounts import is_local_filesystem

# File and directory modes: owner and group only, never world-accessible (the
# umask may remove more). Group access lets ranks run under different users of
# one group on a shared NFS export.
FILE_MODE = 0o660
DIR_MODE = 0o770

# errno values that mean "something other than a regular file (or a directory, for a
# key's directory) occupies this name": ELOOP from O_NOFOLLOW on a link (EMLINK and
# EFTYPE on the BSDs), ENXIO from a socket or a FIFO without a reader, EISDIR and
# ENOTDIR from a directory where a file belongs or the reverse
_OCCUPIED_ERRNOS = {errno.ELOOP, errno.EMLINK, errno.ENXIO, errno.EISDIR, errno.ENOTDIR,
                    getattr(errno, "EFTYPE", errno.ELOOP)}
_OCCUPIED_HINT = ("ferrosync never follows links or opens special files inside its "
                  "directory: remove it, find out who or what put it there, and give every "
                  "job a directory only its own user (or group) can write")


class _FdReader(Reader):
    def __init__(self, fd: int, path: str, counters: Counters, size: int) -> None:
        self._fd = fd
        self._path = path
        self._counters = counters
        self.size = size  # from the fstat that checked the file is regular

    def readinto(self, buf) -> int:
        view = memoryview(buf).cast("B")
        total = 0
        try:
            while total < len(view):
                n = os.readv(self._fd, [view[total:]])
                if n == 0:
                    break
                total += n
        except OSError as exc:
            raise storage_error("reading", self._path, exc, is_transient(exc)) from exc
        finally:
            self._counters.add(read=total)
        return total

    def readall(self) -> bytes:
        if self.size > _MAX_READ:
            return super().readall()
        try:
            # one allocation that read() fills in place: the object costs its size once
            data = os.read(self._fd, self.size)
        except OSError as exc:
            raise storage_error("reading", self._path, exc, is_transient(exc)) from exc
        self._counters.add(read=len(data))
        if len(data) < self.size and data:  # a short read (a signal, NFS): the rest too
            rest = bytearray(self.size - len(data))
            n = self.readinto(rest)
            return data + bytes(rest[:n])
        return data

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


#: the most one read() returns on Linux (0x7ffff000): a larger object is read into a
#: buffer instead
_MAX_READ = 0x7FFFF000

#: how often (s) a miss checks whether a cached directory was removed meanwhile
_GONE_CHECK_PERIOD = 1.0


class LocalStorage(Storage):
    """A directory on a local or network (NFS) filesystem.

    Every name below the root is reached through an open handle of its directory
    (``dir_fd``), opened once without following links and then kept: a link planted
    in place of ``rdzv`` or a generation directory is refused, and the data path
    makes no more system calls than plain paths would (fewer lookups, in fact).
    ``dir_handle``, ``forget_removed``, ``open_regular`` and ``entries`` are public for
    the operator tools' directory work (``local_tools``), which shares these handles.
    """

    poll_initial = 20e-6
    poll_max = 0.01
    heartbeat_interval = 1.0
    watch_periods = 3.0
    cheap_deletes = True

    def __init__(self, root: str, *, recycle: bool | None = None) -> None:
        root = os.path.abspath(os.path.expanduser(root))
        super().__init__(root)
        self.root = root
        self._made: set[str] = set()
        self._dirs: dict[str, DirHandle] = {}
        self._dirs_lock = threading.Lock()
        self._next_gone_check = 0.0
        # Rewriting a consumed file in place skips the kernel zeroing fresh page-cache
        # pages (32 MiB: 5 ms instead of 15 ms on tmpfs). Only on local filesystems: an
        # NFS client may hold cached pages of the old contents under the same inode.
        self.can_recycle = is_local_filesystem(root) if recycle is None else bool(recycle)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, check_key(key)) if key else self.root

    # -- directory handles ---------------------------------------------------------------
    def dir_handle(self, directory: str) -> DirHandle:
        """The handle of ``directory`` ("" is the root), opened on first use.

        FileNotFoundError when it does not exist (yet); StorageError when a link, a
        file or anything else but a directory holds its name.
        """
        handle = self._dirs.get(directory)
        if handle is None:
            handle = self._open_dir(directory)
        return handle

    def _open_dir(self, directory: str) -> DirHandle:
        if directory:
            parent, _, name = directory.rpartition("/")
            if parent not in self._dirs:
                # open the missing ancestors top down, in a loop: a deep key must not
                # recurse once per level
                parts = parent.split("/")
                for depth in range(1, len(parts)):
                    ancestor = "/".join(parts[:depth])
                    if ancestor not in self._dirs:
                        self._open_dir(ancestor)
            parent_fd = self.dir_handle(parent).fd
            try:
                fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
            except OSError as exc:
                if exc.errno in _OCCUPIED_ERRNOS:
                    raise _occupied(self._path(directory), parent_fd, name,
                                    expected="a directory") from None
                raise
        else:
            try:
                fd = os.open(self.root, ROOT_FLAGS)
            except NotADirectoryError:
                raise StorageError("the storage location is not a directory", path=self.root,
                                   hint="pass a directory (or a path to create) as the URL"
                                   ) from None
        handle = DirHandle(fd)
        with self._dirs_lock:
            # a racing thread's handle wins; ours closes when dropped
            return self._dirs.setdefault(directory, handle)

    def _locate(self, key: str) -> tuple[DirHandle, str]:
        """(handle of ``key``'s directory, the last part of ``key``)."""
        directory, _, name = check_key(key).rpartition("/")
        return self.dir_handle(directory), name

    def forget_removed(self, force: bool = True) -> bool:
        """Drop the handles of directories removed since they were opened (deleted,
        or deleted and made again: the next use then opens the new one by name).
        Returns whether any was dropped. Unforced, it runs at most once a period: a
        reader polling for a missing object must not stat every directory each time.
        """
        now = time.monotonic()
        if not force and now < self._next_gone_check:
            return False
        self._next_gone_check = now + _GONE_CHECK_PERIOD
        with self._dirs_lock:
            gone = [d for d, handle in self._dirs.items() if handle.gone()]
            for directory in gone:
                del self._dirs[directory]
                self._made.discard(directory)
        return bool(gone)

    def _recover(self) -> None:
        self.forget_removed()

    def close(self) -> None:
        with self._dirs_lock:
            self._dirs.clear()  # each descriptor closes once no operation holds it

    # -- the interface -------------------------------------------------------------------
    def makedirs(self, prefix: str) -> None:
        if prefix in self._made:
            return
        if "" not in self._made:
            # the root and its parents by path: links on the way there are the user's
            try:
                self.retry("creating the directory", "", os.makedirs, self.root, DIR_MODE,
                            True)
            except FileExistsError:
                raise StorageError("the storage location is not a directory", path=self.root,
                                   hint="pass a directory (or a path to create) as the URL"
                                   ) from None
            self.dir_handle("")
            self._made.add("")
        parent = ""
        for part in check_key(prefix).split("/") if prefix else ():
            here = f"{parent}/{part}" if parent else part
            self.retry("creating the directory", here, _mkdir_at, part,
                       self.dir_handle(parent).fd)
            self.dir_handle(here)  # refuses a link or a file found at the name
            parent = here
        self._made.add(prefix)

    def put(self, key: str, parts: Sequence, *, exclusive: bool = False,
            reuse: str | None = None) -> int:
        try:
            return self._put(key, parts, exclusive, reuse)
        except FileNotFoundError as exc:
            if not self.forget_removed():
                raise self._vanished(key) from exc
        try:  # the directory was removed, and perhaps made again: once more, by name
            return self._put(key, parts, exclusive, reuse)
        except FileNotFoundError as exc:
            raise self._vanished(key) from exc

    def _put(self, key: str, parts: Sequence, exclusive: bool, reuse: str | None) -> int:
        handle, name = self._locate(key)
        # The temporary name lives in the *same directory* so the rename is atomic;
        # names.temp hides it and marks it for `gc` if this process dies here.
        tmp = names.temp(name)
        spare = [None]
        if reuse is not None and self.can_recycle:
            spare[0] = self._adopt_spare(handle, key, reuse, tmp)
            if spare[0] is None:
                tmp = names.temp(name)  # whatever held the spare's name may still hold tmp

        def write() -> int:
            fd, spare[0] = spare[0], None  # a retry after a failure writes a fresh file
            return write_file(tmp, parts, dir_fd=handle.fd, fd=fd)

        nbytes = self.retry("writing", key, write)
        try:
            if exclusive:
                # an NFS LINK whose reply was lost is retransmitted and answered EEXIST
                if self.exclusive_create(key, parts, lambda: self.retry(
                        "publishing", key, self._publish, handle, tmp, name, key, True)):
                    _unlink_quietly(tmp, handle.fd)  # the link landed before: tmp is left
            else:
                self.retry("publishing", key, self._publish, handle, tmp, name, key, False)
        except BaseException:
            _unlink_quietly(tmp, handle.fd)
            raise
        # counted by kind as an object store's (a file, not a billed request: storage/costs.py)
        self.counters.add(puts=1, written=nbytes)
        return nbytes

    def _adopt_spare(self, handle: DirHandle, key: str, reuse: str, tmp: str) -> int | None:
        """Rename the parked spare ``reuse`` to ``tmp`` and open it for rewriting; None
        means "write a fresh file instead".

        Only a regular file of this uid with one link is rewritten. Anything else found
        under the spare's name (a planted link, a FIFO, a hard link to someone's file)
        is removed from the directory, never written through: its target is untouched.
        """
        directory, _, spare = check_key(reuse).rpartition("/")
        if directory != key.rpartition("/")[0]:
            return None
        self.counters.add(requests=1)
        try:
            # the old name vanishes atomically, as a delete would
            os.rename(spare, tmp, src_dir_fd=handle.fd, dst_dir_fd=handle.fd)
        except OSError:
            return None  # gone already, or unmovable: a fresh file does the job
        try:
            # lstat first: a planted device is never even opened
            if stat.S_ISREG(os.stat(tmp, dir_fd=handle.fd, follow_symlinks=False).st_mode):
                fd = os.open(tmp, REUSE_FLAGS, dir_fd=handle.fd)
                if _is_own_plain_file(os.fstat(fd)):
                    return fd
                os.close(fd)
        except OSError:
            pass
        _unlink_quietly(tmp, handle.fd)
        return None

    def _publish(self, handle: DirHandle, tmp: str, name: str, key: str, exclusive: bool) -> None:
        """Give the written temp file its final name: atomically replacing what is there,
        or (``exclusive``) only if nothing is. A link at the name is replaced or
        refused, never followed."""
        try:
            if exclusive:
                # link() fails if the name exists: an atomic create-if-absent that
                # also holds on NFS (the classic lock-file idiom)
                os.link(tmp, name, src_dir_fd=handle.fd, dst_dir_fd=handle.fd,
                        follow_symlinks=False)
                os.unlink(tmp, dir_fd=handle.fd)
            else:
                os.replace(tmp, name, src_dir_fd=handle.fd, dst_dir_fd=handle.fd)
        except FileExistsError:
            # taken: by an object (the answer the caller wants), or by something else
            _require_regular(self._path(key), handle.fd, name)
            raise
        except OSError as exc:
            if exc.errno in _OCCUPIED_ERRNOS:
                raise _occupied(self._path(key), handle.fd, name) from None
            raise

    def _vanished(self, key: str) -> StorageError:
        path = self._path(key)
        where = ("the run directory" if not os.path.isdir(self.root)
                 else f"its directory {os.path.dirname(path)}")
        return StorageError(
            f"cannot publish: {where} does not exist (any more)", path=path,
            hint="was the run directory deleted? restart the job (in a fresh directory if "
            "it was removed on purpose)",
        )

    def open(self, key: str, *, max_bytes: int | None = None,
             rank: int | None = None) -> Reader | None:
        self.counters.add(gets=1)
        try:
            fd, size = self.retry("opening", key, self.open_regular, key)
        except FileNotFoundError:
            # "not yet", unless a cached directory was removed (and made again) meanwhile
            if not self.forget_removed(force=False):
                return None
            try:
                fd, size = self.retry("opening", key, self.open_regular, key)
            except FileNotFoundError:
                return None
        try:
            self.check_size(key, size, max_bytes, rank)  # by fstat: nothing read yet
        except BaseException:
            os.close(fd)
            raise
        return _FdReader(fd, f"{self.root}/{key}", self.counters, size)

    def open_regular(self, key: str, flags: int = READ_FLAGS) -> tuple[int, int]:
        """(fd, size) of ``key`` opened with ``flags``: never through a link, never
        waiting for a FIFO's writer, and only when it is a regular file."""
        handle, name = self._locate(key)
        try:
            fd = os.open(name, flags, FILE_MODE, dir_fd=handle.fd)
        except OSError as exc:
            if exc.errno in _OCCUPIED_ERRNOS:
                raise _occupied(self._path(key), handle.fd, name) from None
            raise
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise _occupied(self._path(key), handle.fd, name, mode=info.st_mode)
        return fd, info.st_size

    def park(self, key: str) -> str | None:
        if not self.can_recycle:
            return None
        spare = names.spare()
        self.counters.add(requests=1)
        try:
            handle, name = self._locate(key)
            self.retry("parking", key, os.rename, name, spare, src_dir_fd=handle.fd,
                        dst_dir_fd=handle.fd)
        except FileNotFoundError:
            return None
        return names.within(key.rpartition("/")[0], spare)

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.counters.add(deletes=1)
            try:
                handle, name = self._locate(key)
                self.retry("deleting", key, self._unlink, handle, name, key)
            except FileNotFoundError:
                pass

    def _unlink(self, handle: DirHandle, name: str, key: str) -> None:
        """unlink() removes a link itself, never its target; a directory is refused."""
        try:
            os.unlink(name, dir_fd=handle.fd)
        except IsADirectoryError:
            raise _occupied(self._path(key), handle.fd, name) from None

    def list(self, prefix: str = "") -> list[tuple[str, int]]:
        """Regular files only: a link, FIFO or socket is no object (see ``local_tools``)."""
        return sorted((key, size) for key, mode, size in self.entries(prefix)
                      if stat.S_ISREG(mode))

    def entries(self, prefix: str) -> list[tuple[str, int, int]]:
        """(key, mode, size) of everything below ``prefix``, from lstat: links are
        listed, never followed, and a directory is entered only through a handle
        opened without following links."""
        try:
            top = self.dir_handle(check_key(prefix) if prefix else "")
            fd = os.open(".", LIST_FLAGS, dir_fd=top.fd)  # readable, and scandir's own
        except FileNotFoundError:
            return []
        out: list[tuple[str, int, int]] = []
        _walk(fd, prefix, out)
        return out



def _is_own_plain_file(info: os.stat_result) -> bool:
    """A file safe to rewrite in place: regular, ours, and reachable by one name only
    (a second link could be someone's file planted as our spare)."""
    return (stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()
            and info.st_nlink == 1)


_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISREG, "a regular file"))


def file_kind(mode: int) -> str:
    """What an ``st_mode`` is, in words, for messages."""
    for test, what in _KINDS:
        if test(mode):
            return what
    return "something that is not a regular file"


def _occupied(path: str, dir_fd: int, name: str, *, mode: int | None = None,
              expected: str = "a regular file") -> StorageError:
    """The error for a name held by something ferrosync refuses to open or replace."""
    if mode is None:
        try:
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except OSError:
            mode = 0
    return StorageError(f"{file_kind(mode)} occupies this name where ferrosync expects "
                        f"{expected}; refused", path=path, hint=_OCCUPIED_HINT)


def _require_regular(path: str, dir_fd: int, name: str) -> None:
    """Raise ``_occupied`` unless ``name`` is a regular file (by lstat) or gone."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise _occupied(path, dir_fd, name, mode=mode)


def _mkdir_at(name: str, dir_fd: int) -> None:
    try:
        os.mkdir(name, DIR_MODE, dir_fd=dir_fd)
    except FileExistsError:
        pass  # made by another rank, or something else: opening it will tell


def _walk(fd: int, base: str, out: list) -> None:
    """Append (key, mode, size) of everything in the directory ``fd`` (closed here)
    and below it to ``out``; lstat only, and directories opened with O_NOFOLLOW.

    Iterative, depth first: a tree of any depth (a 1,500-level chain is untrusted input
    like any other) neither exhausts Python's stack nor holds a descriptor per level;
    a directory's handle is closed once its last subdirectory has been opened."""
    # each frame: [its handle (None once closed), its key, subdirectory names left]
    stack = [[fd, base, _scan_into(fd, base, out)]]
    try:
        while stack:
            frame = stack[-1]
            if not frame[2]:
                stack.pop()
                if frame[0] is not None:  # a directory without subdirectories
                    os.close(frame[0])
                continue
            name = frame[2].pop()
            parent_fd = frame[0]
            if not frame[2]:  # its last subdirectory: the parent's handle is done
                frame[0] = None
            try:
                sub = os.open(name, LIST_FLAGS, dir_fd=parent_fd)
            except OSError:
                sub = None  # removed, or replaced by a link since: not entered
            finally:
                if frame[0] is None:
                    os.close(parent_fd)
            if sub is not None:
                key = f"{frame[1]}/{name}" if frame[1] else name
                stack.append([sub, key, _scan_into(sub, key, out)])
    finally:
        for frame in stack:
            if frame[0] is not None:
                os.close(frame[0])


def _scan_into(fd: int, base: str, out: list) -> list[str]:
    """Append (key, mode, size) of the entries of directory ``fd`` (left open) to
    ``out``; returns the names of its subdirectories (from lstat), last to visit first."""
    subdirs = []
    with os.scandir(fd) as entries:  # reads a duplicate: fd stays open
        for entry in entries:
            key = f"{base}/{entry.name}" if base else entry.name
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed since the directory was read
            out.append((key, info.st_mode, info.st_size))
            if stat.S_ISDIR(info.st_mode):
                subdirs.append(entry.name)
    subdirs.reverse()  # popped from the end: visited in listing order
    return subdirs


def write_file(path: str, parts: Sequence, *, dir_fd: int | None = None,
                fd: int | None = None) -> int:
    """Write ``parts`` to ``path`` (relative to ``dir_fd`` if given) and return the
    bytes written; on any failure the file is removed.

    Without ``fd`` the file is created here (O_EXCL|O_NOFOLLOW: never an existing
    name, never a link's target); with ``fd``, an already checked spare open as
    ``path``, the old bytes are overwritten and the file is cut to size.
    """
    existing = fd is not None
    if fd is None:
        fd = os.open(path, CREATE_FLAGS, FILE_MODE, dir_fd=dir_fd)
    try:
        try:
            views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
            total = 0
            while views:
                # writev may write less than asked, and takes at most IOV_MAX buffers
                n = os.writev(fd, views[:512])
                total += n
                while views and n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                if views and n:
                    views[0] = views[0][n:]
            if existing:
                os.ftruncate(fd, total)
        finally:
            os.close(fd)  # on NFS close() flushes, and may be where ENOSPC shows
    except BaseException:
        _unlink_quietly(path, dir_fd)
        raise
    return total


def _unlink_quietly(path: str, dir_fd: int | None = None) -> None:
    try:
        os.unlink(path, dir_fd=dir_fd)
    except OSError:
        pass


def open_local(url: str, protocol: str, rest: str, storage_options: dict,
               timeout: float | None) -> LocalStorage:
    """file:// URLs and bare paths: a directory (``storage_options`` do not apply)."""
    if storage_options:
        raise ConfigError(
            f"storage_options {sorted(storage_options)} do not apply to a local path",
            hint="drop storage_options for a directory URL",
        )
    if not rest:
        raise ConfigError(f"URL {url!r} names no directory")
    return LocalStorage(rest)
