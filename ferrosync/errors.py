"""Every error ferrosync raises, in one place.

Each class is rooted in the nearest builtin (``SyncTimeout`` is a ``TimeoutError``,
``ConfigError`` a ``ValueError``) so that generic handlers keep working, and each
message names what an operator needs: the rank that saw it, the collective number,
the storage path, and what to do next.

All classes pickle cleanly (they travel between processes in tests and launchers):
the structured fields are rebuilt from ``__reduce__`` rather than re-parsed.
"""

from __future__ import annotations

import re

from ferrosync_schemes import scheme

__all__ = [
    "FerrosyncError",
    "ConfigError",
    "SyncTimeout",
    "PeerFailed",
    "ShardCorrupt",
    "LayoutMismatch",
    "DuplicateRank",
    "StorageError",
    "ExclusiveCreateUnsupported",
    "SyncClosed",
    "JobEnded",
    "MemberDropped",
    "RejoinNeeded",
    "ObjectCollectiveWarning",
    "redact",
    "one_line",
]

#: a URL's ``user:password@`` (``s3://KEY:SECRET@bucket/x``): everything from the scheme's
#: ``//`` to the last ``@`` of the word, when a ``:`` comes before it (a secret may hold
#: ``/`` or ``+``, so the URL's own parse of where the host starts cannot be trusted); or
#: a ``user@``/``TOKEN@`` with no ``:`` before the first ``/`` (``_hide`` keeps those of
#: the schemes where it names a container)
_URL_CREDENTIALS = re.compile(
    r"(?i)\b([a-z][a-z0-9+.-]*)://([^\s'\"@]*:[^\s'\"]*|[^\s'\"/@:]+)@")


def redact(text):
    """``text`` with every credential written into a URL replaced by ``***``
    (``s3://***@bucket/x``, ``s3://TOKEN@bucket/x`` too): the one rule that keeps them
    out of every message, log line and record ferrosync writes. ``abfs://container@acct``
    and ``oci://bucket@namespace`` name no user and stay (``ferrosync_schemes``'
    ``at_container``). ``redact(url) != url`` is how ``split_url`` finds a URL with
    credentials (and refuses it). None stays None."""
    if text is None:
        return None
    return _URL_CREDENTIALS.sub(_hide, str(text))


def _hide(match: re.Match) -> str:
    protocol, userinfo = match.group(1), match.group(2)
    if ":" not in userinfo and scheme(protocol.lower()).at_container:
        return match.group(0)
    return f"{protocol}://***@"


def one_line(text) -> str:
    """``text`` (an exception, a driver's message) as one redacted line: what every
    one-line error and report line ferrosync prints is made of."""
    return " ".join(redact(text).split())


class FerrosyncError(Exception):
    """Base class. ``rank``, ``collective``, ``path`` and ``hint`` may be None.

    The message is composed once from the parts, so ``str(err)`` reads like
    ``rank 1, collective 17, at /mnt/run/g3/c17.out: <what>; <hint>``.
    """

    def __init__(
        self,
        what: str,
        *,
        rank: int | None = None,
        collective: int | None = None,
        path: str | None = None,
        hint: str | None = None,
    ) -> None:
        # every part may quote a URL the user typed: none keeps a credential
        self.what = redact(what)
        self.rank = rank
        self.collective = collective
        self.path = redact(path)
        self.hint = redact(hint)
        super().__init__(self._compose())

    def _compose(self) -> str:
        where = []
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        if self.collective is not None:
            where.append(f"collective {self.collective}")
        if self.path is not None:
            where.append(f"at {self.path}")
        text = (", ".join(where) + ": " if where else "") + self.what
        if self.hint:
            text += f"; {self.hint}"
        return text

    def __reduce__(self):
        kwargs = {
            "rank": self.rank,
            "collective": self.collective,
            "path": self.path,
            "hint": self.hint,
        }
        return (_rebuild, (type(self), self.what, kwargs))


def _rebuild(cls, what, kwargs):
    return cls(what, **kwargs)


class ConfigError(FerrosyncError, ValueError):
    """Bad arguments, options, URL or environment; raised before any collective I/O."""


class SyncTimeout(FerrosyncError, TimeoutError):
    """A bounded wait expired (peers missing, generation never announced, ...)."""


class PeerFailed(FerrosyncError, RuntimeError):
    """Another rank published an abort marker, stopped heartbeating, or closed early."""


class MemberDropped(PeerFailed):
    """This member of an elastic job was dropped by the others (it looked gone: its
    heartbeat was silent past ``heartbeat_timeout``, or it fell so far behind that
    the round it needed is gone). It may connect again as a new member."""


class RejoinNeeded(FerrosyncError, RuntimeError):
    """A newcomer to an elastic job found no state for the round that admitted it (its
    publisher left first): close gracefully and connect again, as a new member (the
    trainer does so by itself)."""


class ShardCorrupt(FerrosyncError, ValueError):
    """A stored object failed its checks (magic, checksum, MAC, size); never averaged."""


class LayoutMismatch(FerrosyncError, ValueError):
    """Ranks called the same collective with different tensor counts, shapes or dtypes."""


class DuplicateRank(FerrosyncError, RuntimeError):
    """Two live processes claim the same rank under the same URL."""


class StorageError(FerrosyncError, OSError):
    """A storage request failed for a reason other than "not there yet"."""


class ExclusiveCreateUnsupported(StorageError):
    """This store (its fsspec driver, or the client under it) cannot create an object
    only if absent; ``put(exclusive=True)`` raises it instead of overwriting."""


class SyncClosed(FerrosyncError, RuntimeError):
    """A collective was called after ``close()`` or after an earlier collective failed."""


class JobEnded(SyncClosed):
    """The elastic job this process tried to join has ended (a member called
    ``end_job``): there is no round left to join."""


def error_class(name: str) -> type[FerrosyncError]:
    """The class to re-raise for a peer's error named ``name`` (from an abort marker
    or an error record): the same kind where it says something about the job
    (a layout mismatch is one on every rank), ``PeerFailed`` otherwise."""
    known = {cls.__name__: cls for cls in (
        ConfigError, SyncTimeout, PeerFailed, ShardCorrupt, LayoutMismatch, DuplicateRank,
        StorageError)}
    return known.get(name, PeerFailed)


def relay_text(exc: BaseException) -> str:
    """What peers are told of ``exc`` (abort markers, error records): never empty.

    ``MemoryError()`` and many others carry no message; a peer reading "rank 0
    reports: " with nothing after it learns nothing, so the type stands in for it.
    """
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (SIGINT or Ctrl-C)"
    text = redact(getattr(exc, "what", None) or str(exc))
    return text if text.strip() else f"{type(exc).__name__} (raised without a message)"


def relayed(message: object) -> str:
    """A peer's relayed message as a reader shows it: one that is empty or missing
    (an old writer's, or a planted record's) says so instead of vanishing."""
    text = "" if message is None else str(message)
    return text if text.strip() else "(no message given: see that rank's log)"


class ObjectCollectiveWarning(UserWarning):
    """An object collective (``broadcast_object_list`` and the like, which torch
    unpickles) ran on a ``"ferrosync"`` group whose storage objects carry no MAC: a
    writer to the storage could make every rank run code. Set a secret to close it."""
