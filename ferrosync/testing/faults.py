"""Fault injection for tests and drills: make one rank fail at a chosen point.

``FERROSYNC_FAULTS`` (a JSON list of faults, set before a rank connects) makes opening a
rank's storage (``ferrosync.storage.engines.open_storage``, the one hook) wrap it in
``FaultyStorage``, the storage-level fault layer; nothing else changes. The fault
format, phases and actions: docs/contributing.md#tests-and-reliability.
"""

from __future__ import annotations

import errno as errno_mod
import json
import os
import signal
import time

from ferrosync.core import runtime, validate
from ferrosync.errors import ConfigError
from ferrosync.storage import names
from ferrosync.storage.engines import ENV_FAULTS, RECORD_LIMIT, LocalStorage, Reader, Storage
from ferrosync.storage.engines.base import check_key
from ferrosync.storage.engines.classify import storage_error
from ferrosync.storage.engines.local import write_file

PHASES = ("write", "publish", "read", "reduce")
ACTIONS = ("kill", "raise", "delay", "corrupt", "truncate", "delete", "replay")
_REPLAY_WAIT_S = 60.0  # the copied object is another rank's: bounded wait for it


def inject(storage: Storage, rank, spec: str) -> Storage:
    """``storage``, wrapped in ``FaultyStorage`` when ``spec`` (``$FERROSYNC_FAULTS``, as
    ``open_storage`` read it) names faults for this process. ``rank`` is this rank (a
    fixed-size job), or a function returning the member's current rank (an elastic
    job, whose ranks change)."""
    if callable(rank):
        faults = load_faults(None, spec)
        return FaultyStorage(storage, faults, rank=rank) if faults else storage
    faults = load_faults(rank, spec)
    return FaultyStorage(storage, faults) if faults else storage


def load_faults(rank: int | None, spec: str | None) -> list[dict]:
    """This rank's faults from ``spec``, the JSON of ``$FERROSYNC_FAULTS`` (validated),
    or [] (``rank`` None: every rank's, matched later against the rank of the moment)."""
    if not spec:
        return []
    try:
        faults = json.loads(spec)
    except ValueError as exc:
        raise ConfigError(f"{ENV_FAULTS} is not JSON ({exc})") from None
    if isinstance(faults, dict):
        faults = [faults]
    out = []
    for fault in faults:
        if not isinstance(fault, dict) or "rank" not in fault:
            raise ConfigError(f"{ENV_FAULTS}: every fault needs a 'rank', got {fault!r}")
        validate.choice(f"{ENV_FAULTS}: phase", fault.get("phase", "write"), PHASES)
        validate.choice(f"{ENV_FAULTS}: action", fault.get("action", "kill"), ACTIONS)
        if rank is None or fault["rank"] == rank:
            out.append({"phase": "write", "action": "kill", "object": "any", "times": 1,
                        **fault})
    return out


def _object_kind(key: str) -> tuple[str | None, int | None]:
    """("contrib" or "result", its collective or round) of the data object at ``key``;
    (None, None) for anything else (control records are never faulted)."""
    top, _, inside = key.partition("/")
    if inside and names.is_elastic_namespace(top):
        found = names.parse_elastic(inside)
        if found.kind == "elastic_contribution" or (
                found.kind == "elastic_piece" and found.number == 0):
            return "contrib", found.collective
        if found.kind in ("elastic_piece", "elastic_result"):
            return "result", found.collective
        return None, None
    found = names.parse(key.rpartition("/")[2])
    if found.kind not in ("contribution", "result"):
        return None, None
    return ("result" if found.kind == "result" else "contrib"), found.collective


class FaultyStorage(Storage):
    """Wraps a storage and fires the configured faults; otherwise passes through."""

    def __init__(self, inner: Storage, faults: list[dict], *, rank=None) -> None:
        self._inner = inner
        self._faults = faults
        #: the writer's rank of the moment (an elastic member's), matched by each fault;
        #: None: the faults were chosen for this rank already
        self._rank = rank
        # look like the wrapped store to the backend
        self.url = inner.url
        self.counters = inner.counters
        self.poll_initial, self.poll_max = inner.poll_initial, inner.poll_max
        self.heartbeat_interval = inner.heartbeat_interval
        self.can_recycle = inner.can_recycle
        self.cheap_deletes = inner.cheap_deletes
        self.round_trips_dominate = inner.round_trips_dominate

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def probe_bucket(self) -> None:
        self._inner.probe_bucket()

    def _match(self, phase: str, key: str) -> dict | None:
        kind, collective = _object_kind(key)
        if kind is None:
            return None  # control records (heartbeats, layouts, rendezvous) are spared
        for fault in self._faults:
            if fault["phase"] != phase or fault.get("times", 1) < 0:
                continue
            if self._rank is not None and fault["rank"] != self._rank():
                continue
            if fault.get("collective") not in (None, collective):
                continue
            if fault.get("object", "any") not in ("any", kind):
                continue
            if fault.get("times", 1) > 0:
                fault["times"] -= 1
                if fault["times"] == 0:
                    fault["times"] = -1  # spent
            return fault
        return None

    def _act(self, fault: dict, key: str) -> None:
        action = fault["action"]
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "delay":
            time.sleep(float(fault.get("seconds", 1.0)))
        elif action == "raise":
            code = getattr(errno_mod, str(fault.get("errno", "EIO")))
            exc = OSError(code, os.strerror(code), self.path_of(key))
            raise storage_error("writing" if fault["phase"] in ("write", "publish")
                                 else "reading", self.path_of(key), exc, False)
        elif action in ("corrupt", "truncate", "delete"):
            self._damage(action, key, fault.get("offset"))

    def _damage(self, action: str, key: str, offset) -> None:
        data = self._inner.read(key, max_bytes=None)  # damaging its own test objects
        if data is None:
            return
        if action == "delete":
            self._inner.delete([key])
            return
        pos = len(data) // 2 if offset is None else int(offset) % max(1, len(data))
        if action == "corrupt":
            damaged = bytearray(data)
            damaged[pos] ^= 0xFF
        else:
            damaged = data[:pos]
        # rewrite under the same name, as a failing disk or a stray writer would
        self._inner.delete([key])
        self._inner.put(key, [bytes(damaged)])

    def _copy_of(self, key: str, rank: int) -> bytes | None:
        """The bytes of ``rank``'s object named like ``key`` (waits for it, bounded);
        None for a slice ``rank`` reduces itself, which it never writes."""
        directory, _, name = key.rpartition("/")
        found = names.parse(name)
        if _object_kind(key)[0] is not None and found.kind not in ("contribution", "result"):
            raise ConfigError("replay fault: only a fixed-size job's objects are replayed",
                              path=self.path_of(key))
        if found.kind == "contribution":
            if found.slice == rank:
                return None
            name = names.contribution(found.collective, rank, found.slice)
        source = names.within(directory, name)
        def expired():
            raise ConfigError(f"replay fault: {source} never appeared",
                              path=self.path_of(source))

        # polling another process's file: there is nothing to wait on
        return runtime.wait(lambda: self._inner.read(source, max_bytes=None),
                            deadline=time.monotonic() + _REPLAY_WAIT_S, expired=expired,
                            poll=(0.005, 0.005))

    # -- the interface -----------------------------------------------------------------------
    def put(self, key, parts, *, exclusive=False, reuse=None):
        fault = self._match("write", key)
        if fault is not None and fault["action"] in ("corrupt", "truncate"):
            # damaged before it becomes visible: every reader sees the damage
            data = bytearray(b"".join(bytes(memoryview(p).cast("B")) for p in parts))
            offset = fault.get("offset")
            pos = len(data) // 2 if offset is None else int(offset) % max(1, len(data))
            if fault["action"] == "corrupt":
                data[pos] ^= 1 << int(fault.get("bit", 0))
            else:
                del data[pos:]
            parts, fault = [bytes(data)], None
        elif fault is not None and fault["action"] == "replay":
            copy = self._copy_of(key, int(fault.get("from_rank", 0)))
            parts, fault = ([copy] if copy is not None else parts), None
        if fault is not None:
            if fault["action"] == "kill" and isinstance(self._inner, LocalStorage):
                # leave half of the bytes in a temporary file, as a real crash would
                data = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
                head, name = os.path.split(os.path.join(self._inner.root, check_key(key)))
                write_file(os.path.join(head, names.temp(name, token="dead0000")),
                            [data[: len(data) // 2]])
            self._act(fault, key)
        n = self._inner.put(key, parts, exclusive=exclusive, reuse=reuse)
        fault = self._match("publish", key)
        if fault is not None:
            self._act(fault, key)
        return n

    def open(self, key, *, max_bytes=None, rank=None):
        fault = self._match("read", key)
        if fault is not None:
            self._act(fault, key)
        reader = self._inner.open(key, max_bytes=max_bytes, rank=rank)
        if reader is None:
            return None
        fault = self._match("reduce", key)
        return _AfterReader(reader, self, fault, key) if fault is not None else reader

    def read(self, key, *, max_bytes=RECORD_LIMIT, rank=None):
        return self._inner.read(key, max_bytes=max_bytes, rank=rank)

    def read_head(self, key, nbytes, *, rank=None):
        return self._inner.read_head(key, nbytes, rank=rank)  # a ranged read where it has one

    def delete(self, keys):
        self._inner.delete(keys)

    def park(self, key):
        return self._inner.park(key)

    def makedirs(self, prefix):
        self._inner.makedirs(prefix)

    def list(self, prefix=""):
        return self._inner.list(prefix)

    def path_of(self, key):
        return self._inner.path_of(key)

    def close(self):
        self._inner.close()


class _AfterReader(Reader):
    """Fires a "reduce" fault once the object's bytes have been read."""

    def __init__(self, inner: Reader, storage: FaultyStorage, fault: dict, key: str) -> None:
        self._inner, self._storage, self._fault, self._key = inner, storage, fault, key
        self.size = inner.size
        self._seen = 0

    def readinto(self, buf) -> int:
        n = self._inner.readinto(buf)
        self._seen += n
        if self._seen >= self.size - 144 and self._fault is not None:  # payload consumed
            fault, self._fault = self._fault, None
            self._storage._act(fault, self._key)
        return n

    def close(self) -> None:
        self._inner.close()
