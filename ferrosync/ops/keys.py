"""Key files: what the launcher keeps of each launch so that its user's tools can verify
the job's records.

One home (``directory``, ``save``, ``load``, ``prune``) for the rules: a 0700 directory
of this user's, key files 0600 written without following links, looked up only by a
valid job id (``names.JOB_ID``), and a running launch's file never pruned. Format,
rules and sharing a key: docs/operations.md#key-files-every-job-visible-to-its-operator.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import stat
import time
from dataclasses import dataclass

from ferrosync.core.private import PrivateDir
from ferrosync.errors import ConfigError
from ferrosync.storage import names

#: the directory of key files (default: $XDG_CONFIG_HOME/ferrosync/keys)
ENV_KEYS = "FERROSYNC_KEYS"
SUFFIX = ".key"
#: a key file is a few hundred bytes: anything larger is not one
MAX_BYTES = 16384
#: ``ferrosync keys --prune`` (``keys_tool``) removes the key files of launches not
#: running after this many days (``--older-than``)
PRUNE_AFTER_DAYS = 30.0
_JOB = re.compile(names.JOB_ID)
_HEX_SECRET = re.compile(r"[0-9a-f]{16,1024}")
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_OPEN_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def directory(env=None) -> str:
    """Where key files live: ``$FERROSYNC_KEYS``, else ``$XDG_CONFIG_HOME/ferrosync/keys``,
    else ``~/.config/ferrosync/keys``."""
    env = os.environ if env is None else env
    if env.get(ENV_KEYS):
        return os.path.abspath(os.path.expanduser(env[ENV_KEYS]))
    config = env.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(config, "ferrosync", "keys")


def path_of(job: str, where: str | None = None) -> str | None:
    """The key file of ``job`` (None: not a job id, so it cannot name a file)."""
    if not isinstance(job, str) or not _JOB.fullmatch(job):
        return None
    return os.path.join(where or directory(), job + SUFFIX)


@dataclass(frozen=True)
class KeyFile:
    """One launch as its key file describes it."""

    job: str
    path: str
    secret: bytes | None  # None: the ranks used the user's own $FERROSYNC_SECRET
    url: str | None
    launcher: dict  # host, boot_id, pid_ns, pid, start

    def launcher_state(self) -> tuple[bool | None, str]:
        """(does the launcher still run?, in words): None when this host cannot tell.

        Its ranks die with their launcher (a parent-death signal, and the launcher
        stops them before it exits), so a launcher that no longer runs means no rank
        does. Only a tool in the launcher's own host, boot and pid namespace can look
        its pid up; the process start time tells a reused pid apart."""
        here, was = launch_context(), self.launcher
        pid, host = was.get("pid"), was.get("host")
        if host != here["host"]:
            return None, f"launched on {host}: only a tool there can tell if it runs"
        if was.get("boot_id") != here["boot_id"]:
            if here["boot_id"] and was.get("boot_id"):
                return False, f"{host} has rebooted since it was launched"
            return None, "this host cannot tell whether its launcher runs"
        if was.get("pid_ns") != here["pid_ns"] or not isinstance(pid, int):
            return None, f"launched from another pid namespace on {host}"
        if process_start(pid) == was.get("start"):
            return True, f"its launcher (pid {pid} on {host}) is running"
        return False, f"its launcher (pid {pid} on {host}) has exited"

    def launcher_gone(self) -> str | None:
        """Why the launch is provably over, or None (running, or cannot tell)."""
        running, why = self.launcher_state()
        return why if running is False else None


def launch_context(pid: int | None = None) -> dict:
    """This host, boot and pid namespace, and ``pid``'s start time (the launcher's)."""
    pid = os.getpid() if pid is None else pid
    return {"host": socket.gethostname(), "boot_id": _read_text(
        "/proc/sys/kernel/random/boot_id"), "pid_ns": _readlink("/proc/self/ns/pid"),
            "pid": pid, "start": process_start(pid)}


def process_start(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (/proc/PID/stat field 22); None
    when no such process runs (or there is no /proc)."""
    text = _read_text(f"/proc/{pid}/stat")
    if text is None:
        return None
    fields = text.rpartition(")")[2].split()  # after the command name, which may hold ")"
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


# -- writing (the launcher) -------------------------------------------------------------

def private_directory(where: str | None = None) -> PrivateDir:
    """The key directory, created 0700 if missing and verified (``ferrosync.core.private``:
    this user's, no link on the parts ferrosync makes, no access for group or others);
    ``ConfigError`` otherwise. The default's parts begin below the config directory."""
    if where is None and not os.environ.get(ENV_KEYS):
        config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(
            os.path.expanduser("~"), ".config")
        return PrivateDir.open(directory(), base=config, secret=True, what="key directory")
    return PrivateDir.open(where or directory(), secret=True, what="key directory")


def save(job: str, secret: str | None, url: str, where: str | None = None) -> str:
    """Write ``job``'s key file (0600, created exclusively, never through a link);
    returns its path. ``ConfigError`` for an unsafe key directory; ``OSError`` when it
    cannot be written (a full disk, a read-only home)."""
    with private_directory(where) as keys_dir:
        path = path_of(job, keys_dir.path)
        if path is None:
            raise ConfigError(f"job id {job!r} cannot name a key file")
        body = json.dumps({"v": 1, "job": job, "secret": secret, "url": url,
                           "launcher": launch_context()}, sort_keys=True).encode()
        temp = f".{job}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = keys_dir.open_file(temp, _OPEN_NEW, 0o600)
        try:
            try:
                os.write(fd, body)
                os.fchmod(fd, 0o600)  # whatever the umask
            finally:
                os.close(fd)
            # exclusive: never replaces another launch's file
            keys_dir.link(temp, os.path.basename(path))
        finally:
            keys_dir.unlink(temp)
    return path


def discard(job: str, where: str | None = None) -> None:
    """Remove ``job``'s key file (a launch whose sync directory is gone with it)."""
    path = path_of(job, where)
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


# -- reading (the tools) ----------------------------------------------------------------

def load(job: str, where: str | None = None) -> KeyFile | None:
    """``job``'s key file, or None when there is none. ``ConfigError`` when it is a link
    or not a regular file, not this user's, readable or writable by group or others,
    or not a key file."""
    path = path_of(job, where)
    if path is None:
        return None
    try:
        fd = os.open(path, _OPEN_READ)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a link planted at the name
        raise ConfigError(f"cannot use the key file {path} ({exc.strerror})", path=path,
                          hint="it must be a regular file of yours: remove it, and copy "
                          "the job's key file there again") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"the key file {path} is not a regular file",
                              hint="remove it; a key file is a plain file of yours, mode 0600")
        _check_private(path, info, "key file", "600")
        raw = os.read(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)
    return _parse(raw, job, path)


def _check_private(path: str, info: os.stat_result, what: str, mode: str) -> None:
    if info.st_uid != os.geteuid():
        raise ConfigError(f"the {what} {path} belongs to uid {info.st_uid}, not to you "
                          f"(uid {os.geteuid()})", hint=f"use a {what} of your own "
                          f"(${ENV_KEYS} names the directory)")
    if info.st_mode & 0o077:
        raise ConfigError(f"the {what} {path} is open to group or others (mode "
                          f"{stat.S_IMODE(info.st_mode):04o})",
                          hint=f"chmod {mode} {path} (a key others can read or replace "
                          "protects nothing)")


def _parse(raw: bytes, job: str, path: str) -> KeyFile:
    try:
        if len(raw) > MAX_BYTES:
            raise ValueError(f"larger than {MAX_BYTES} bytes")
        record = json.loads(raw)
        if not isinstance(record, dict) or record.get("job") != job:
            raise ValueError(f"it does not name job {job}")
        secret = record.get("secret")
        if secret is not None and not (isinstance(secret, str)
                                       and _HEX_SECRET.fullmatch(secret)):
            raise ValueError("its secret is not a hex string")
        launcher = record.get("launcher")
        url = record.get("url")
    except ValueError as exc:
        raise ConfigError(f"{path} is not a ferrosync key file ({exc})", path=path,
                          hint="remove it, or copy the job's key file there again") from None
    return KeyFile(job, path, secret.encode() if secret else None,
                   url if isinstance(url, str) else None,
                   launcher if isinstance(launcher, dict) else {})


class JobKeys:
    """The secret that verifies each job's records, for the tools: the job's own key
    file where the launcher left one, else the operator's ``--secret`` (or
    ``$FERROSYNC_SECRET``), which covers jobs started otherwise.

    ``namespace`` is where a job's records live (``rdzv.{job}``, ``el.{job}``; a job
    without an id, or None, has no key file)."""

    def __init__(self, fallback: bytes | None = None, where: str | None = None) -> None:
        self.fallback = fallback
        self.where = where
        self._files: dict[str, KeyFile | None] = {}

    def key_file(self, job: str | None) -> KeyFile | None:
        if job is None:
            return None
        if job not in self._files:
            self._files[job] = load(job, self.where)
        return self._files[job]

    def secret(self, namespace: str | None) -> bytes | None:
        found = self.key_file(job_of(namespace))
        if found is not None and found.secret is not None:
            return found.secret
        return self.fallback

    def used(self) -> dict[str, str]:
        """{job: key file path} of the key files found so far."""
        return {job: f.path for job, f in sorted(self._files.items()) if f is not None}


def job_of(namespace: str | None) -> str | None:
    """``rdzv.{job}`` / ``el.{job}`` -> ``job``; a namespace without an id -> None."""
    if not namespace or "." not in namespace:
        return None
    return namespace.split(".", 1)[1]


# -- listing and pruning (``ferrosync keys``) -------------------------------------------

@dataclass(frozen=True)
class KeyEntry:
    """One name in the key directory, as ``ferrosync keys`` reports it."""

    name: str
    age_s: float
    key: KeyFile | None  # None: not a usable key file (``problem`` says why)
    problem: str | None = None
    running: bool | None = None  # the launcher's state (None: this host cannot tell)
    state: str = ""
    store_gone: bool = False  # a local run directory that no longer exists

    def prune_reason(self, older_than_s: float) -> str | None:
        """Why ``--prune`` removes it, or None (kept)."""
        if self.key is None or self.running:
            return None  # not a key file of ours, or its launch runs
        if self.running is False and self.store_gone:
            return "its launch is over and its run directory is gone"
        if self.age_s > older_than_s:
            return f"not running, {self.age_s / 86400:.0f} days old"
        return None


def _local_dir_of(url: str | None) -> str | None:
    """The directory a key file's URL names, if it is a local one (else None)."""
    if not url:
        return None
    if url.startswith("file://"):
        url = url[len("file://"):]
        url = url[len("localhost"):] if url.startswith("localhost/") else url
    return url if "://" not in url and os.path.isabs(url) else None


def entries(where: str | None = None, now: float | None = None) -> list[KeyEntry]:
    """Every name in the key directory (none if it does not exist), sorted; each key
    file read with ``load``'s checks, so a file that fails them is reported, not used.
    ``ConfigError`` when the directory is not private (``private_directory``)."""
    where = where or directory()
    if not os.path.lexists(where):
        return []
    now = time.time() if now is None else now
    out = []
    with private_directory(where) as keys_dir:
        listing = [(name, info) for name in sorted(keys_dir.listdir())
                   if (info := _lstat_in(keys_dir, name)) is not None]
    for name, info in listing:
        age = max(0.0, now - info.st_mtime)
        job = name[:-len(SUFFIX)] if name.endswith(SUFFIX) else None
        if job is None or path_of(job, where) is None:
            out.append(KeyEntry(name, age, None, "not a key file's name (left alone)"))
            continue
        try:
            key = load(job, where)
        except ConfigError as exc:
            out.append(KeyEntry(name, age, None, str(exc)))
            continue
        if key is None:
            continue  # removed meanwhile
        running, state = key.launcher_state()
        local = _local_dir_of(key.url)
        out.append(KeyEntry(name, age, key, None, running, state,
                            store_gone=local is not None and not os.path.lexists(local)))
    return out


def prune(found: list[KeyEntry], older_than_s: float, where: str | None = None,
          dry_run: bool = False) -> list[tuple[KeyEntry, str]]:
    """Remove the key files ``KeyEntry.prune_reason`` gives a reason for (not with
    ``dry_run``); (entry, reason) of each. Unlinked through a handle on the directory
    opened without following links: a name is removed, never a link's target."""
    chosen = [(e, why) for e in found if (why := e.prune_reason(older_than_s))]
    if dry_run or not chosen:
        return chosen
    with private_directory(where) as keys_dir:
        for entry, _ in chosen:
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                keys_dir.unlink(entry.name)
    return chosen


def _lstat_in(keys_dir: PrivateDir, name: str) -> os.stat_result | None:
    """``name``'s own status in the verified directory (never a link's target); None
    once it is gone."""
    try:
        return os.stat(name, dir_fd=keys_dir.fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
