"""Heartbeats, abort markers and the peer checks that turn a hang into an error.

Each rank of a generation owns two control objects in the generation's prefix:

* ``hb.r{rank}``: rewritten every ``interval`` seconds by a background thread with
  an increasing ``beat`` counter and where the rank is (collective, operation). It
  is the one key ferrosync overwrites: readers only ever ask "did the counter
  change?", which tolerates a stale read of one period.
* ``abort.r{rank}``: written once when the rank fails (an exception inside a
  collective, or an uncaught exception ending the process), carrying the error.

A waiting rank calls ``PeerMonitor.check`` for the ranks it waits on, at most once
per interval. A peer is dead when its counter has not changed for ``timeout``
seconds *of the reader's own monotonic clock*: another host's wall clock or a
file's mtime is never compared (clocks differ between nodes).
"""

from __future__ import annotations

import os
import socket
import threading
import time

from .errors import LayoutMismatch, PeerFailed, ShardCorrupt, error_class
from .storage import Storage
from .wire import decode_record, encode_record


def heartbeat_key(prefix: str, rank: int) -> str:
    return f"{prefix}/hb.r{rank}"


def abort_key(prefix: str, rank: int) -> str:
    return f"{prefix}/abort.r{rank}"


class Heartbeat:
    """Rewrites ``hb.r{rank}`` every ``interval`` seconds from a daemon thread.

    ``set_position`` is called by the collective code (cheap: it only stores the
    position, the next beat publishes it). ``stop`` joins the thread and writes a
    final beat with state "closed" or "aborted".
    """

    def __init__(self, storage: Storage, prefix: str, rank: int, interval: float,
                 key: bytes | None, generation: int) -> None:
        self._storage = storage
        self._key = heartbeat_key(prefix, rank)
        self._secret = key
        self._interval = interval
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._record = {
            "beat": 0,
            "state": "running",
            "rank": rank,
            "generation": generation,
            "collective": 0,
            "op": None,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "wall_time": time.time(),  # for `inspect` only; never used for liveness
            "interval": interval,  # lets tools size their watch window
        }
        self._thread: threading.Thread | None = None
        self.last_error: BaseException | None = None

    def start(self) -> None:
        self._beat()  # the first beat is synchronous: peers see us at once
        self._thread = threading.Thread(
            target=self._run, name=f"ferrosync-heartbeat-r{self._record['rank']}", daemon=True
        )
        self._thread.start()

    def set_position(self, collective: int, op: str | None) -> None:
        with self._lock:
            self._record["collective"] = collective
            self._record["op"] = op

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._beat()

    def _beat(self, state: str | None = None) -> None:
        with self._lock:
            self._record["beat"] += 1
            self._record["wall_time"] = time.time()
            if state is not None:
                self._record["state"] = state
            data = encode_record(self._record, self._secret)
        try:
            self._storage.put(self._key, [data])
        except Exception as exc:  # the collective path reports storage failures itself
            self.last_error = exc

    def stop(self, state: str = "closed") -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, 2 * self._interval))
        self._thread = None
        self._beat(state)


def publish_abort(storage: Storage, prefix: str, rank: int, exc: BaseException,
                  collective: int | None, key: bytes | None) -> None:
    """Write ``abort.r{rank}`` once; best effort (we are already failing)."""
    record = {
        "rank": rank,
        "collective": collective,
        "type": type(exc).__name__,
        "message": str(exc)[:4000],
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }
    try:
        storage.put(abort_key(prefix, rank), [encode_record(record, key)], exclusive=True)
    except Exception:
        pass


class PeerMonitor:
    """Checks the ranks a collective waits on; raises instead of letting it hang."""

    def __init__(self, storage: Storage, prefix: str, rank: int, interval: float,
                 timeout: float, key: bytes | None, url: str) -> None:
        self._storage = storage
        self._prefix = prefix
        self._rank = rank
        self._interval = interval
        self._timeout = timeout
        self._key = key
        self._url = url
        self._seen: dict[int, tuple[object, float]] = {}
        self._next_check = 0.0

    def maybe_check(self, ranks, collective: int, op: str) -> None:
        """``check`` at most once per interval (call it from every poll iteration)."""
        now = time.monotonic()
        if now < self._next_check:
            return
        if self._next_check == 0.0:
            # the first poll of the run only arms the timer: most waits are short
            self._next_check = now + self._interval
            return
        self._next_check = now + self._interval
        self.check(ranks, collective, op)

    def check(self, ranks, collective: int, op: str) -> None:
        now = time.monotonic()
        for peer in ranks:
            if peer == self._rank:
                continue
            abort_path = abort_key(self._prefix, peer)
            data = self._storage.read(abort_path)
            if data is not None:
                raise self._peer_error(peer, abort_path, data, collective)
            hb_path = heartbeat_key(self._prefix, peer)
            raw = self._storage.read(hb_path)
            beat = None
            if raw is not None:
                try:
                    record = decode_record(raw, self._key, path=self._storage.path_of(hb_path),
                                           rank=self._rank)
                except ShardCorrupt:
                    record = {}
                beat = record.get("beat")
                state = record.get("state")
                closed_at = record.get("collective")
                # a peer that closed *after* entering this collective finished it (it
                # published what we wait for, the next poll will see it): not a failure
                if state == "closed" and isinstance(closed_at, int) and closed_at < collective:
                    raise PeerFailed(
                        f"rank {peer} closed its connection (after collective "
                        f"{record.get('collective')}) while this rank waits for it",
                        rank=self._rank, collective=collective, path=self._url,
                        hint="every rank must call the same collectives in the same order "
                        "(one rank ran fewer steps or batches)",
                    )
                peer_op = record.get("op")
                if record.get("collective") == collective and peer_op and peer_op != op:
                    raise LayoutMismatch(
                        f"rank {self._rank} called {op}, rank {peer} called {peer_op} "
                        "(seen in its heartbeat)",
                        rank=self._rank, collective=collective, path=self._url,
                        hint="every rank must call the same collectives in the same order",
                    )
            last = self._seen.get(peer)
            if last is None or last[0] != beat:
                self._seen[peer] = (beat, now)
            elif now - last[1] > self._timeout:
                what = "no heartbeat" if beat is None else f"heartbeat stuck at {beat}"
                raise PeerFailed(
                    f"rank {peer} looks dead: {what} for {now - last[1]:.1f} s "
                    f"(heartbeat_timeout={self._timeout:g} s)",
                    rank=self._rank, collective=collective,
                    path=self._storage.path_of(hb_path),
                    hint="the process was killed, ran out of memory, or its node is down; "
                    "check that rank's log, then restart the job",
                )

    def _peer_error(self, peer: int, path: str, data: bytes, collective: int):
        cls = PeerFailed
        try:
            record = decode_record(data, self._key, path=self._storage.path_of(path),
                                   rank=self._rank)
            what = f"{record.get('type')}: {record.get('message')}"
            where = record.get("collective")
            cls = error_class(str(record.get("type")))
        except ShardCorrupt as exc:
            what, where = f"(unreadable abort marker: {exc})", None
        return cls(
            f"rank {peer} failed" + (f" at collective {where}" if where is not None else "")
            + f" with {what}",
            rank=self._rank, collective=collective, path=self._storage.path_of(path),
            hint=f"see rank {peer}'s log for the cause, fix it, and restart the job",
        )
