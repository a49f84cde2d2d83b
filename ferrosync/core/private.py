"""This user's own directories outside the store (``/dev/shm/ferrosync-<uid>/...``, the
key directory): created and verified here only.

Every part below a trusted base is made 0700, opened through its parent's handle
without following a link and checked with ``fstat``; anything else is a
``ConfigError`` naming the path, and every later use goes through the verified handle
(docs/design.md#security-model).
"""

from __future__ import annotations

import os
import stat
import tempfile

from ferrosync.errors import ConfigError

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
#: the base: links on the way to it are followed (the system's, or the user's choice)
_BASE_FLAGS = os.O_RDONLY | _DIRECTORY | _CLOEXEC
#: a part ferrosync owns: never a link (ELOOP/ENOTDIR), readable so it can be listed
_PART_FLAGS = os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC


class PrivateDir:
    """An open, verified directory of this user; use it through its methods (each
    relative to the handle, never following a link) and ``close`` it."""

    def __init__(self, fd: int, path: str) -> None:
        self.fd = fd
        self.path = path

    @classmethod
    def open(cls, path: str, *, base: str | None = None, secret: bool = False,
             what: str = "directory") -> PrivateDir:
        """Create (0700) and verify ``path``; ``base`` (default: its parent) is where
        the parts ferrosync owns begin; ``secret``: ``path`` itself must keep group and
        others out entirely; ``what`` names it in errors ("key directory"). A
        ``ConfigError`` when any part is unsafe."""
        path = os.path.abspath(os.path.expanduser(path))
        base = os.path.abspath(os.path.expanduser(base)) if base else os.path.dirname(path)
        parts = [p for p in os.path.relpath(path, base).split(os.sep) if p not in ("", ".")]
        if not parts or ".." in parts:
            raise ConfigError(f"{path} is not below {base}")  # an internal misuse
        fd = _open_base(base, path)
        here = base
        try:
            for i, part in enumerate(parts):
                here = os.path.join(here, part)
                try:
                    os.mkdir(part, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass  # ours from before, or planted: the checks below tell
                try:
                    sub = os.open(part, _PART_FLAGS, dir_fd=fd)
                except OSError as exc:  # ELOOP/ENOTDIR: a link or a file at the name
                    raise _unsafe(here, _occupant(part, fd, exc), what) from None
                os.close(fd)
                fd = sub
                _check(os.fstat(fd), here, what, secret=secret and i == len(parts) - 1)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path)

    def open_file(self, name: str, flags: int, mode: int = 0o600) -> int:
        """``os.open`` of ``name`` in this directory, never through a link."""
        return os.open(name, flags | _NOFOLLOW | _CLOEXEC, mode, dir_fd=self.fd)

    def listdir(self) -> list[str]:
        return os.listdir(self.fd)

    def unlink(self, name: str) -> None:
        """Remove ``name`` from this very directory (a link itself, never its target)."""
        os.unlink(name, dir_fd=self.fd)

    def link(self, src: str, dst: str) -> None:
        """Hard-link ``src`` as ``dst`` here: fails if ``dst`` exists (an exclusive publish)."""
        os.link(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> PrivateDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit even ``os`` may be gone
            pass


def host_base() -> str:
    """Host-local memory (``/dev/shm``), else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def host_path(name: str = "") -> str:
    """``<host_base>/ferrosync-<uid>[/<name>]``: what this user's processes on this host
    share (open it with ``host_dir``)."""
    top = os.path.join(host_base(), f"ferrosync-{os.geteuid()}")
    return os.path.join(top, name) if name else top


def host_dir(name: str = "") -> PrivateDir:
    """``host_path(name)`` created and verified (``ConfigError`` when unsafe)."""
    return PrivateDir.open(host_path(name), base=host_base())


def _open_base(base: str, path: str) -> int:
    try:
        os.makedirs(base, 0o700, exist_ok=True)
        fd = os.open(base, _BASE_FLAGS)
    except OSError as exc:
        raise ConfigError(f"cannot use {base} for {path} ({exc.strerror or exc})",
                          hint="make it a directory this user can write") from None
    info = os.fstat(fd)
    # the base may be shared (/dev/shm, /tmp): then only with the sticky bit, so no one
    # else can rename or remove what this user makes in it
    if info.st_uid not in (0, os.geteuid()) or (
            info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX):
        os.close(fd)
        raise _unsafe(base, f"it belongs to uid {info.st_uid} with mode "
                      f"{stat.S_IMODE(info.st_mode):04o}: others could replace what is in it",
                      "base directory")
    return fd


def _occupant(name: str, dir_fd: int, exc: OSError) -> str:
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except OSError:
        return f"it cannot be opened as a directory ({exc.strerror})"
    what = "a symbolic link" if stat.S_ISLNK(mode) else "something that is no directory"
    return f"{what} occupies its name"


def _check(info: os.stat_result, path: str, what: str, *, secret: bool) -> None:
    if info.st_uid != os.geteuid():
        raise _unsafe(path, f"it belongs to uid {info.st_uid}, not to this user "
                      f"(uid {os.geteuid()}): another user made it first", what)
    if info.st_mode & (0o077 if secret else 0o022):
        raise _unsafe(path, f"its mode {stat.S_IMODE(info.st_mode):04o} lets "
                      f"{'group or others in' if secret else 'others write to it'}", what,
                      hint=f"chmod 700 {path} (nothing others can enter or change is "
                      "trusted)")


def _unsafe(path: str, why: str, what: str = "directory", hint: str | None = None
            ) -> ConfigError:
    return ConfigError(f"the {what} {path} is not a private directory of this user: {why}; "
                       "refused", hint=hint or "remove it and find out who made it; "
                       "ferrosync never uses a directory another user made or can change")
