"""Torch's thread pool sized to this process's share of the host's cores.

``ThreadShare`` counts this user's ``python -m ferrosync.train`` processes on this host
(one file each under ``/dev/shm/ferrosync-<uid>/train-procs``, through
``ferrosync.core.private``) and sets ``torch.set_num_threads(cores // processes)``,
re-counted at most once a second; it does nothing when ``OMP_NUM_THREADS`` is set
(docs/train.md).
"""

from __future__ import annotations

import atexit
import os
import time
import warnings

import torch

from ferrosync.core import private
from ferrosync.core.private import PrivateDir
from ferrosync.errors import ConfigError

#: re-count the processes at most this often (seconds)
RECOUNT_S = 1.0
ENV_THREADS = "OMP_NUM_THREADS"


def registry_dir() -> str:
    """Where processes announce themselves: host-local memory, per user."""
    return private.host_path("train-procs")


def host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of
    ``/proc/PID/stat``): with the pid it names one process, never a later one that
    reuses the pid. None if there is no such process; "" where /proc is absent and
    the pid alone is checked."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return None
    return text.rsplit(")", 1)[-1].split()[19]


def _alive(pid: int, started: str) -> bool:
    if os.path.isdir("/proc"):
        return _start_time(pid) == started
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ThreadShare:
    """This process's entry in the registry and the thread count it implies."""

    def __init__(self, directory: str | None = None, cores: int | None = None) -> None:
        self.directory = directory or registry_dir()
        self._dir: PrivateDir | None = None
        self.cores = cores or host_cores()
        self.pid = os.getpid()
        started = _start_time(self.pid)
        self.name = f"{self.pid}.{started or ''}"
        self.threads: int | None = None
        self._next = 0.0
        self._registered = False

    def register(self) -> bool:
        """Announce this process; False (and threads left alone) if the directory is
        unusable: read-only, or not this user's private directory (planted by someone
        else, a link: then a warning says so, and nothing in it is touched)."""
        try:
            directory = PrivateDir.open(self.directory, base=_base_of(self.directory))
        except ConfigError as exc:
            warnings.warn(f"threads are not shared with this user's other trainers: {exc}",
                          RuntimeWarning, stacklevel=2)
            return False
        try:
            os.close(directory.open_file(self.name, os.O_WRONLY | os.O_CREAT))
        except OSError:
            directory.close()
            return False
        self._dir = directory
        self._registered = True
        atexit.register(self.unregister)
        return True

    def unregister(self) -> None:
        if self._registered:
            self._registered = False
            try:
                self._dir.unlink(self.name)
            except OSError:
                pass
            self._dir.close()

    def count(self) -> int:
        """Live registered processes (this one included); removes the dead ones' files,
        in the verified directory only (its handle: a name swapped for a link since
        redirects nothing)."""
        live = 0
        try:
            entries = self._dir.listdir()
        except OSError:
            return 1
        for entry in entries:
            pid, _, started = entry.partition(".")
            if not pid.isdigit():
                continue
            if entry == self.name or _alive(int(pid), started):
                live += 1
                continue
            try:
                self._dir.unlink(entry)
            except OSError:
                pass  # another process removed it first
        return max(live, 1)

    def adjust(self) -> int | None:
        """Call from the thread that runs torch's ops (OpenMP's setting is per thread):
        re-count at most every ``RECOUNT_S`` and resize the pool when the share
        changed. Returns the threads set (None if never changed)."""
        now = time.monotonic()
        if not self._registered or now < self._next:
            return self.threads
        self._next = now + RECOUNT_S
        processes = self.count()
        share = max(1, self.cores // processes) if processes > 1 else None
        if share is None and self.threads is None:
            return None  # alone from the start: torch's default stays
        share = share or self.cores
        if share != self.threads:
            torch.set_num_threads(share)
            self.threads = share
        return self.threads


def _base_of(directory: str) -> str:
    """Where the parts ferrosync owns begin: below host-local memory for the registry,
    else (a directory given by the caller) at the directory itself."""
    base = private.host_base()
    inside = os.path.commonpath([os.path.abspath(directory), base]) == base
    return base if inside else os.path.dirname(os.path.abspath(directory))


def share_threads() -> ThreadShare | None:
    """For ``python -m ferrosync.train``'s rank: register and size the pool now; the
    caller calls ``adjust()`` as it goes. None when ``OMP_NUM_THREADS`` is set (the
    user's or the launcher's choice wins) or the registry is unusable."""
    if os.environ.get(ENV_THREADS):
        return None
    share = ThreadShare()
    if not share.register():
        return None
    share.adjust()
    return share
