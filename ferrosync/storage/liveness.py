"""Heartbeats, abort markers and the peer checks that turn a hang into an error.

Each rank rewrites its heartbeat from a background thread (``Heartbeat``) and writes its
abort marker once when it fails; a waiting rank calls ``PeerMonitor.maybe_check`` from
its polling loop. A peer is dead when its counter has not changed for ``timeout`` of
this process's monotonic clock, not counting time this process was frozen
(``ProcessClock``). The rules and why: docs/design.md#liveness.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import weakref

from ferrosync.core import runtime as runtimes
from ferrosync.errors import (
    LayoutMismatch,
    PeerFailed,
    ShardCorrupt,
    StorageError,
    error_class,
    relay_text,
    relayed,
)
from ferrosync.storage import names
from ferrosync.storage.engines import REQUEST_KINDS, Storage
from ferrosync.storage.objects import Objects

#: the shortest gap in the process's timeline that counts as a freeze: scheduling
#: jitter on a loaded machine reaches tens of milliseconds, and re-arming on jitter
#: would postpone the detection of a dead peer for nothing
MIN_FREEZE_S = 0.25


def heartbeat_key(prefix: str, rank: int) -> str:
    return names.within(prefix, names.heartbeat(rank))


def abort_key(prefix: str, rank: int) -> str:
    return names.within(prefix, names.abort(rank))


def freeze_bound(interval: float) -> float:
    """The longest gap between two ticks of a running process with heartbeats every
    ``interval`` s, plus slack for scheduling; a longer gap is a freeze."""
    return max(1.5 * interval, MIN_FREEZE_S)


class ProcessClock:
    """When this process was last seen running, and when it last resumed from a freeze.

    ``tick`` is called by any thread that runs periodically (heartbeat thread, polling
    loops); it is cheap (one lock, no I/O). Monitors ``watch`` the clock with their own
    bound: a gap between consecutive ticks longer than a watcher's bound sets that
    watcher's ``resumed_at`` to the tick that ended the gap. One instance per process
    (``PROCESS_CLOCK``); tests make their own with a fake ``time_fn``.
    """

    def __init__(self, time_fn=time.monotonic) -> None:
        self._time = time_fn
        self._lock = threading.Lock()
        self._last: float | None = None
        self._watchers: weakref.WeakSet = weakref.WeakSet()

    def now(self) -> float:
        return self._time()

    def tick(self) -> float:
        """Record that this process runs now; returns the time read."""
        now = self._time()
        with self._lock:
            last = self._last
            # a thread that read the time just before another one ticked carries a
            # slightly older time: not a gap, and it must not move `_last` back
            if last is None or now > last:
                self._last = now
                # every watcher's bound is at least MIN_FREEZE_S: shorter gaps, i.e.
                # nearly every tick, need no look at the watchers
                if last is not None and now - last > MIN_FREEZE_S:
                    gap = now - last
                    for watcher in self._watchers:
                        if gap > watcher.freeze_bound:
                            watcher.resumed_at = now
        return now

    def watch(self, watcher) -> None:
        """``watcher`` has ``freeze_bound`` and a writable ``resumed_at``."""
        with self._lock:
            self._watchers.add(watcher)

    def _after_fork_in_child(self) -> None:
        # the parent's ticking threads do not exist here, and a thread may have held
        # the lock at the fork: start over
        self._lock = threading.Lock()
        self._last = None


PROCESS_CLOCK = ProcessClock()


class _Seen:
    """What this process knows of one peer's counter."""

    __slots__ = ("beat", "since", "read", "moved")

    def __init__(self, beat, now: float, moved: float | None) -> None:
        self.beat = beat
        self.since = now  # when this value was first read: its silence starts here
        self.read = now  # the latest read
        #: the read that saw the counter move shortly after a previous read (proof the
        #: peer ran then), None when this value was a first look or came after a gap
        self.moved = moved


class SilenceClocks:
    """The one rule of when a peer is dead: its heartbeat counter has not changed for
    ``timeout`` seconds of this process's clock while this process ran (time before
    ``resumed_at``, the end of this process's latest freeze, is nobody's silence).

    ``observe(peer, beat, now)`` records one read of ``peer``'s counter and returns
    how long it has been silent. The fixed-size backend's ``PeerMonitor`` and an
    elastic job's ``HeartbeatWatch`` both judge with it. The elastic job also asks, to choose
    whose heartbeats to read (never to judge a death), what the reads say short of a
    judgement, measured against ``freeze_bound``, the longest a running process goes
    without ticking, hence the longest a running peer's beats are apart:

    * ``fresh``: the counter was seen moving, by a read at most ``beat_gap`` after
      the previous one, less than ``beat_gap`` before the latest read: the peer runs
      now. A first read, or one long after the previous, proves nothing; a live peer
      stays fresh however often or seldom (within the window) it is read.
      ``beat_gap`` is one interval plus a quarter (at least ``MIN_FREEZE_S``) for the
      write, not the freeze bound's half: freshness only chooses whose heartbeats to
      read, so a live peer's late beat costs a few reads, while every second a dead
      checker stays fresh delays the silence clocks of those who die with it (a
      member behind it starts reading them when it turns stale: timeout + 1.5
      intervals after their death was past 1.5 timeouts at the object-store defaults).
    * ``overdue``: a recent read found the counter still for longer than
      ``freeze_bound``: a beat is missing (the peer is probably dead, not yet judged).
    * ``next_change(since)``: the earliest moment after ``since`` at which a judgement
      of a recently read peer changes without a new read showing a beat (a fresh peer
      turns stale, a silent one reaches the timeout), so a reader can look then, not a
      whole look period later. ``since`` is when the reader's latest look *began*: a
      look reads its peers one after the other, so a moment that passed during it may
      have come after that peer's read (silent 29.99 s of 30): it is still due, and
      dropping it would postpone the judgement by a whole look period.
    """

    def __init__(self, timeout: float, interval: float, *,
                 clock: ProcessClock | None = None) -> None:
        self.timeout = timeout
        #: read by the clock: a gap in this process's ticks longer than this is a freeze
        self.freeze_bound = freeze_bound(interval)
        #: set by the clock to the end of the latest freeze (0: none yet)
        self.resumed_at = 0.0
        #: a peer read this recently is being watched
        self.fresh_window = 2 * interval + self.freeze_bound
        #: a counter seen moving less than this before the latest read: ``fresh``
        self.beat_gap = min(self.freeze_bound, interval + max(interval / 4, MIN_FREEZE_S))
        self._seen: dict[object, _Seen] = {}
        (clock or PROCESS_CLOCK).watch(self)

    def observe(self, peer, beat, now: float) -> float:
        """Record a read of ``peer``'s counter at ``now``; seconds it has been silent."""
        last = self._seen.get(peer)
        if last is None or last.beat != beat:
            # the change happened after the previous read: only a read within a beat
            # gap of it dates the beat closely enough to say the peer runs now (one
            # 35 s after it would call a peer that beat once and died 30 s ago fresh)
            recent = last is not None and now - last.read <= self.beat_gap
            self._seen[peer] = _Seen(beat, now, now if recent else None)
            return 0.0
        last.read = now
        return now - max(last.since, self.resumed_at)

    def silent(self, peer, beat, now: float) -> bool:
        return self.observe(peer, beat, now) > self.timeout

    def seen(self, peer) -> bool:
        """Whether ``peer``'s counter was read before (and not forgotten)."""
        return peer in self._seen

    def fresh(self, peer) -> bool:
        """Whether the latest read of ``peer`` shows it running now (see the class)."""
        seen = self._seen.get(peer)
        return (seen is not None and seen.moved is not None
                and seen.moved >= self.resumed_at
                and seen.read - seen.moved < self.beat_gap)

    def overdue(self, peer, now: float) -> bool:
        """Whether a read of ``peer`` within ``fresh_window`` of ``now`` found its
        counter still for longer than ``freeze_bound`` (see the class)."""
        seen = self._seen.get(peer)
        return (seen is not None and now - seen.read <= self.fresh_window
                and seen.read - max(seen.since, self.resumed_at) > self.freeze_bound)

    def next_change(self, since: float, fresh_of=()) -> float | None:
        """The earliest moment after ``since`` (when the latest look began) at which a
        peer read within ``fresh_window`` reaches the timeout, or one of ``fresh_of``
        stops being fresh, unless a read shows it beating (None: no such moment). It
        may be past already: then a look is due now (see the class)."""
        times = []
        for seen in self._seen.values():
            if since - seen.read <= self.fresh_window:  # watched now
                times.append(max(seen.since, self.resumed_at) + self.timeout)
        for peer in fresh_of:
            seen = self._seen.get(peer)
            if seen is not None and seen.moved is not None:
                times.append(seen.moved + self.beat_gap)
        # only moments after the look's start: one that passed before it was judged by
        # that look's read (or is a peer the look no longer reads), not a look per poll
        return min((t for t in times if t > since), default=None)

    def forget(self, peer) -> None:
        """Drop what is known of ``peer`` (judged gone: it is never read again)."""
        self._seen.pop(peer, None)


# (id(storage), prefix, rank) -> the Heartbeat writing hb.r{rank} there; lets the
# monitor of the same rank read its own heartbeat's failures
_HEARTBEATS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _heartbeat_of(storage: Storage, prefix: str, rank: int) -> Heartbeat | None:
    return _HEARTBEATS.get((id(storage), prefix, rank))


def _after_fork_in_child() -> None:
    PROCESS_CLOCK._after_fork_in_child()
    _HEARTBEATS.clear()  # the parent's: their threads do not exist here


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Heartbeat:
    """Rewrites ``hb.r{rank}`` every ``interval`` seconds from a daemon thread.

    ``set_position`` is called by the collective code (cheap: it only stores the
    position, the next beat publishes it). ``stop`` writes a final beat with state
    "closed" or "aborted" (an elastic member: "left" or "aborted") and ends the
    thread; no "running" beat is written after it.

    A failed write is retried at the next beat, never raised from the thread: the
    error is kept in ``last_error`` and the start of the current run of failures in
    ``failing_since`` (monotonic; None while writes succeed), which ``PeerMonitor``
    reports (see ``failure``).
    """

    def __init__(self, storage: Storage, prefix: str, rank: int, interval: float,
                 key: bytes | None, generation: int, *, clock: ProcessClock | None = None,
                 name: str | None = None, fields: dict | None = None,
                 running: str = "running", runtime=None) -> None:
        """``name`` (default ``names.heartbeat(rank)``), ``fields`` (added to every
        record) and ``running`` (the state while beating) parameterise it for an
        elastic job's members (``hb.{id}``, state ``alive``, then ``left``/``aborted``).
        ``runtime`` (default ``runtime.DEFAULT``): its clock, thread, event and lock."""
        self._runtime = rt = runtime or runtimes.DEFAULT
        self._storage = storage
        self._prefix = prefix
        self._key = names.within(prefix, name) if name else heartbeat_key(prefix, rank)
        self._records = Objects.for_records(storage, key=key)
        self._interval = interval
        self._clock = clock or PROCESS_CLOCK
        self._lock = threading.Lock()
        # writes are serialised in beat order: a beat still in flight when ``stop``
        # writes the final state must not land after it (S3 keeps the last PUT)
        self._write_lock = rt.lock()
        self._stop = rt.event()
        self._record = {
            **(fields or {}),
            "beat": 0,
            "state": running,
            "rank": rank,
            "generation": generation,
            "collective": 0,
            "op": None,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "wall_time": rt.time(),  # for `inspect` only; never used for liveness
            "interval": interval,  # lets tools size their watch window
            # this process's storage requests since it connected (heartbeats included),
            # by this host's clock: `inspect` shows requests and their cost per hour
            "connected_at": rt.time(),
            "requests": {},
        }
        self._thread = None  # the runtime's thread handle
        self.last_error: BaseException | None = None
        self.failing_since: float | None = None
        self.failures = 0  # failed writes in the current run of failures

    @property
    def path(self) -> str:
        return self._storage.path_of(self._key)

    def start(self) -> None:
        _HEARTBEATS[(id(self._storage), self._prefix, self._record["rank"])] = self
        directory = self._key.rpartition("/")[0]
        if directory != self._prefix:
            # an elastic heartbeat's shard (names.elastic_shard), where a store has
            # directories: made when the member starts, not before it is admitted
            self._storage.makedirs(directory)
        self._beat()  # the first beat is synchronous: peers see us at once
        self._thread = self._runtime.start_thread(
            self._run, f"ferrosync-heartbeat-r{self._record['rank']}")

    def set_position(self, collective: int, op: str | None) -> None:
        with self._lock:
            self._record["collective"] = collective
            self._record["op"] = op
            # when it began, by this host's clock: `inspect` says since when a hung job
            # waits (for display only, like wall_time)
            self._record["position_at"] = self._runtime.time()

    def failure(self, now: float) -> tuple[float, BaseException] | None:
        """(seconds the writes have been failing, last error), or None if they work."""
        since, error = self.failing_since, self.last_error
        if since is None or error is None:
            return None
        return now - since, error

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._beat()

    def announce(self, state: str) -> None:
        """Publish ``state`` now (e.g. "aborted" while failing); later beats keep it."""
        self._beat(state)

    def _beat(self, state: str | None = None) -> None:
        with self._write_lock:
            # once stop began, only the final state is written: a periodic beat that
            # waited for the lock must not publish "running" after it
            if state is None and self._stop.is_set():
                return
            self._write(state)

    def _write(self, state: str | None) -> None:
        # ticks on both sides of the write: a slow write is a gap in this thread's
        # timeline, which must not look like a freeze (see the module docstring)
        now = self._clock.tick()
        with self._lock:
            self._record["beat"] += 1
            self._record["wall_time"] = self._runtime.time()
            counts = self._storage.counters.snapshot()
            self._record["requests"] = {k: counts.get(k, 0) for k in ("requests",
                                                                       *REQUEST_KINDS)}
            if state is not None:
                self._record["state"] = state
            record = dict(self._record)  # this beat's: later beats change the live one
        try:
            self._records.put_record(self._key, record)
        # broad on purpose: this runs on the heartbeat thread, which must outlive any
        # failure (a dead thread would make peers declare this rank dead); the error is
        # kept in last_error and PeerMonitor raises it once it lasts
        except Exception as exc:  # noqa: BLE001
            self.last_error = exc
            self.failures += 1
            if self.failing_since is None:
                self.failing_since = now
        else:
            self.failing_since = None
            self.failures = 0
        self._clock.tick()

    def stop(self, state: str = "closed") -> None:
        """Stop beating and publish ``state`` at once (never raises): the final state
        is what peers act on (a leave seen within their next look), so it is written
        before waiting for the thread, and tried again if the write fails."""
        self._stop.set()
        for attempt in range(3):
            self._beat(state)
            if self.failing_since is None:
                break
            self._runtime.sleep(0.05 * (attempt + 1))
        if self._thread is not None and self._thread is not self._runtime.current_thread():
            self._thread.join(timeout=max(5.0, 2 * self._interval))
        self._thread = None
        key = (id(self._storage), self._prefix, self._record["rank"])
        if _HEARTBEATS.get(key) is self:
            del _HEARTBEATS[key]


def describe_abort(kind, message) -> str:
    """An abort marker's cause as a reader wants it: ``terminated by SIGTERM`` for a
    rank whose signal handler exited with 128 + the signal's number (the trainer's
    SIGTERM handler raises ``SystemExit(143)``), else ``Type: message``."""
    if kind == "SystemExit":
        try:
            code = int(str(message))
        except ValueError:
            code = None
        if code is not None and code > 128:
            try:
                return f"terminated by {signal.Signals(code - 128).name}"
            except ValueError:
                pass  # not a signal's number: an ordinary exit code
    return f"{kind}: {message}"


def publish_abort(storage: Storage, prefix: str, rank: int, exc: BaseException,
                  collective: int | None, key: bytes | None) -> BaseException | None:
    """Write this rank's abort marker once; best effort (we are already failing).

    Returns None when the marker was written (or one was there already), else the
    error that kept it from being written, for a caller that can report it; it is
    never raised, so it cannot replace the error being published.
    """
    record = {
        "rank": rank,
        "collective": collective,
        "type": type(exc).__name__,
        "message": relay_text(exc)[:4000],
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }
    try:
        # False: published already (the exception handler and atexit both try)
        Objects.for_records(storage, prefix, key=key).put_record(
            names.abort(rank), record, exclusive=True)
    # broad on purpose: called while an error unwinds, whatever the storage raises must
    # not replace it; peers then learn of the failure from the silence instead
    except Exception as write_error:  # noqa: BLE001
        return write_error
    return None


class PeerMonitor:
    """Checks the ranks a collective waits on; raises instead of letting it hang.

    Called by the waiting thread only (``maybe_check`` from every poll iteration of
    a wait); it never blocks beyond the storage reads of one check. Raises
    ``PeerFailed`` (a peer aborted, closed early or stopped beating), the peer's own
    error class when its abort marker names one, ``LayoutMismatch`` (the peer's
    heartbeat shows another operation at this collective), or ``StorageError`` (this
    rank's own heartbeat has not been written for ``timeout``). A point-to-point wait
    passes ``collective=None, op=None``: it has no place in the collective sequence, so
    only aborts, silence and a closed peer count.
    """

    def __init__(self, storage: Storage, prefix: str, rank: int, interval: float,
                 timeout: float, key: bytes | None, url: str, *,
                 clock: ProcessClock | None = None) -> None:
        self._storage = storage
        self._prefix = prefix
        self._rank = rank
        self._interval = interval
        self._timeout = timeout
        self._records = Objects.for_records(storage, key=key, rank=rank)
        self._url = url
        self._clock = clock or PROCESS_CLOCK
        self._silence = SilenceClocks(timeout, interval, clock=self._clock)
        self._next_check = 0.0

    @property
    def resumed_at(self) -> float:
        """The end of this process's latest freeze (0: none yet)."""
        return self._silence.resumed_at

    def maybe_check(self, ranks, collective: int, op: str) -> None:
        """``check`` at most once per interval (call it from every poll iteration)."""
        now = self._clock.tick()
        if now < self._next_check:
            return
        if self._next_check == 0.0:
            # the first poll of the run only arms the timer: most waits are short
            self._next_check = now + self._interval
            return
        self._next_check = now + self._interval
        self.check(ranks, collective, op)

    def check(self, ranks, collective: int, op: str) -> None:
        now = self._clock.tick()
        self._check_own_heartbeat(collective, now)
        for peer in ranks:
            if peer == self._rank:
                continue
            abort_path = abort_key(self._prefix, peer)
            data = self._storage.read(abort_path, rank=self._rank)
            if data is not None:
                raise self._peer_error(peer, abort_path, data, collective, now)
            hb_path = heartbeat_key(self._prefix, peer)
            raw = self._storage.read(hb_path, rank=self._rank)
            beat = None
            if raw is not None:
                try:
                    record = self._records.record_of(raw, hb_path)
                except ShardCorrupt:
                    record = {}
                beat = record.get("beat")
                state = record.get("state")
                closed_at = record.get("collective")
                # a peer that closed *after* entering this collective finished it (it
                # published what we wait for, the next poll will see it): not a failure.
                # A point-to-point wait (collective None) has no position to compare: a
                # closed peer fails it, and the waiter looks for the message once more
                if state == "closed" and (collective is None or (
                        isinstance(closed_at, int) and closed_at < collective)):
                    raise PeerFailed(
                        f"rank {peer} closed its connection (after collective "
                        f"{record.get('collective')}) while this rank waits for it",
                        rank=self._rank, collective=collective, path=self._url,
                        hint="every rank must call the same collectives in the same order "
                        "(one rank ran fewer steps or batches)",
                    )
                peer_op = record.get("op")
                if (op is not None and record.get("collective") == collective and peer_op
                        and peer_op != op):
                    raise LayoutMismatch(
                        f"rank {self._rank} called {op}, rank {peer} called {peer_op} "
                        "(seen in its heartbeat)",
                        rank=self._rank, collective=collective, path=self._url,
                        hint="every rank must call the same collectives in the same order",
                    )
            # silence is only counted from the moment this process last resumed: a
            # peer is not to blame for time during which this process could not look
            silent = self._silence.observe(peer, beat, now)
            if silent > self._timeout:
                what = "no heartbeat" if beat is None else f"heartbeat stuck at {beat}"
                raise PeerFailed(
                    f"rank {peer} looks dead: {what} for {silent:.1f} s "
                    f"(heartbeat_timeout={self._timeout:g} s)" + self._own_trouble(now),
                    rank=self._rank, collective=collective,
                    path=self._storage.path_of(hb_path),
                    hint="the process was killed, ran out of memory, or its node is down; "
                    "check that rank's log, then restart the job",
                )

    def _check_own_heartbeat(self, collective: int, now: float) -> None:
        """Raise once this rank's own heartbeat writes have failed for ``timeout``:
        by then every peer takes this rank for dead, so waiting on is pointless."""
        heartbeat = _heartbeat_of(self._storage, self._prefix, self._rank)
        failing = heartbeat.failure(now) if heartbeat is not None else None
        if failing is None or failing[0] <= self._timeout:
            return
        seconds, error = failing
        raise StorageError(
            f"this rank's heartbeat could not be written for {seconds:.1f} s "
            f"({heartbeat.failures} failed writes; last: {type(error).__name__}: {error}); "
            "its peers now take it for dead",
            rank=self._rank, collective=collective, path=heartbeat.path,
            hint="fix the storage error above (space, permissions, credentials, "
            "network), then restart the job",
        ) from error

    def _own_trouble(self, now: float) -> str:
        heartbeat = _heartbeat_of(self._storage, self._prefix, self._rank)
        failing = heartbeat.failure(now) if heartbeat is not None else None
        if failing is None:
            return ""
        seconds, error = failing
        return (f"; this rank's own heartbeat writes have been failing for {seconds:.1f} s "
                f"too ({type(error).__name__}: {error}): the shared storage may be the "
                "problem, not the peer")

    def _peer_error(self, peer: int, path: str, data: bytes, collective: int, now: float):
        cls = PeerFailed
        try:
            record = self._records.record_of(data, path)
            what = describe_abort(record.get("type"), relayed(record.get("message")))
            where = record.get("collective")
            cls = error_class(str(record.get("type")))
        except ShardCorrupt as exc:
            what, where = f"(unreadable abort marker: {exc})", None
        at = f" at collective {where}" if where is not None else ""
        # "rank 1 was terminated by SIGTERM at collective 8", else "rank 1 failed at
        # collective 8 with RuntimeError: ..."
        how = (f"was {what}{at}" if what.startswith("terminated by ")
               else f"failed{at} with {what}")
        return cls(
            f"rank {peer} {how}" + self._own_trouble(now),
            rank=self._rank, collective=collective, path=self._storage.path_of(path),
            hint=f"see rank {peer}'s log for the cause, fix it, and restart the job",
        )
