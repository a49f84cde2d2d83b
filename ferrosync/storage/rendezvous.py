"""Generations: how the ranks of one job agree on a fresh namespace, without listing.

Write-once records read by exact name in the job's namespace (claims, announcements,
objections, end markers) give every run a generation ``g{g}.{token}/``, fail ranks
that disagree at connect, and tell duplicate ranks and other jobs apart. The protocol:
docs/design.md#generations-and-rendezvous.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass

from ferrosync.core import runtime
from ferrosync.errors import ConfigError, DuplicateRank, ShardCorrupt, SyncTimeout
from ferrosync.storage import names
from ferrosync.storage.engines import Storage, object_exists
from ferrosync.storage.liveness import publish_abort
from ferrosync.storage.objects import Objects

#: default claim window of a job without an id, seconds (see the module docstring)
ANONYMOUS_CLAIM_WINDOW = 3.0
#: give up finding a free claim after this many lost exclusive-create races
_MAX_CLAIM_RACES = 64

# where a job's records live (``ns`` is ``names.namespace(job)``)
namespace = names.namespace


def join_key(ns: str, rank: int, attempt: int) -> str:
    return names.within(ns, names.join(rank, attempt))


def gen_key(ns: str, generation: int) -> str:
    return names.within(ns, names.announcement(generation))


def objection_key(ns: str, rank: int, attempt: int) -> str:
    return names.within(ns, names.objection(rank, attempt))


def end_key(ns: str, rank: int, attempt: int) -> str:
    return names.within(ns, names.end(rank, attempt))


def gen_prefix(generation: int, token: str) -> str:
    """The generation's data prefix. The random token makes it unique even if the
    rendezvous records were deleted and a number is reused: a stale directory of
    an earlier attempt can never be mistaken for the current one."""
    return names.generation_dir(generation, token)


@dataclass(frozen=True)
class Generation:
    number: int
    token: str  # 16 hex digits, random per announcement
    prefix: str
    settings: dict
    claim: Claim | None = None

    @property
    def tag(self) -> int:
        """The token as the 64-bit value every object header carries."""
        return int(self.token, 16)


def first_missing(storage: Storage, key_of, start: int = 0) -> int:
    """Smallest ``i >= start`` whose key does not exist (existence is prefix-closed)."""
    if not object_exists(storage, key_of(start)):
        return start
    low, step = start, 1  # key_of(low) exists
    while object_exists(storage, key_of(start + step)):
        low = start + step
        step *= 2
    high = start + step  # key_of(high) is missing
    while high - low > 1:
        mid = (low + high) // 2
        if object_exists(storage, key_of(mid)):
            low = mid
        else:
            high = mid
    return high


def _describe(record: dict) -> str:
    return f"pid {record.get('pid')} on {record.get('host')}"


class Claim:
    """This process's claim on a rank, and the duties that come with it.

    Created and written once at connect; ``check`` is called while joining, the
    guard thread (``start_guard``) objects to later claims while the job runs,
    ``release`` marks the claim ended at close. Thread-safe where it needs to be:
    the guard thread only writes objections and never raises.
    """

    def __init__(self, storage: Storage, ns: str, rank: int, key: bytes | None,
                 record: dict) -> None:
        self.storage = storage
        self.ns = ns
        self.rank = rank
        self.key = key
        self.record = record
        #: the rendezvous records of the job's namespace (``ns``)
        self.records = Objects.for_records(storage, ns, key=key, rank=rank)
        self.attempt = -1
        self.token = record["token"]
        self.written_at = 0.0
        self._watch = 0  # the next later claim to look for
        self._objected: set[int] = set()
        self._stop = threading.Event()
        self._guard: threading.Thread | None = None
        #: the guard thread's last failure, kept for whoever asks (never raised there)
        self.guard_error: BaseException | None = None
        #: why the end marker could not be written at ``release`` (None: it was)
        self.release_error: BaseException | None = None

    def write(self) -> None:
        """Take the next free attempt number with an exclusive create."""
        storage = self.storage
        attempt = first_missing(storage, lambda n: join_key(self.ns, self.rank, n))
        for _ in range(_MAX_CLAIM_RACES):
            if not self.records.put_record(names.join(self.rank, attempt), self.record,
                                           exclusive=True):
                attempt += 1  # another process claimed this attempt: we come after it
                continue
            self.attempt = attempt
            self._watch = attempt + 1
            self.written_at = time.monotonic()
            return
        raise DuplicateRank(
            f"lost {_MAX_CLAIM_RACES} races for a claim on rank {self.rank}", rank=self.rank,
            path=storage.path_of(self.ns),
            hint="many processes claim this rank at once: each process needs a distinct RANK",
        )

    def path(self) -> str:
        return self.storage.path_of(join_key(self.ns, self.rank, self.attempt))

    def previous_ended(self) -> bool:
        """True when no earlier claim can still be alive: none, or it wrote ``end``."""
        return self.attempt == 0 or object_exists(
            self.storage, end_key(self.ns, self.rank, self.attempt - 1))

    def check(self) -> None:
        """While joining: raise ``DuplicateRank`` if this claim is contested.

        Contested means a live earlier holder objected to it, or a later process
        claimed the same rank (we object to that one, and fail: our generation may
        have paired us with that other job's ranks).
        """
        self.check_objection()
        later = join_key(self.ns, self.rank, self._watch)
        if object_exists(self.storage, later):
            self._object(self._watch)
            raise DuplicateRank(
                f"another process claimed rank {self.rank} (attempt {self._watch}) while "
                f"this one (attempt {self.attempt}) was joining: two jobs share this URL",
                rank=self.rank, path=self.storage.path_of(later),
                hint="give each job its own URL or job id (connect(job=...) or "
                "FERROSYNC_JOB), and each process a distinct RANK",
            )

    def check_objection(self) -> None:
        name = names.objection(self.rank, self.attempt)
        raw = self.storage.read(self.records.key_of(name), rank=self.rank)
        if raw is None:
            return
        path = self.records.path_of(name)
        try:
            record = self.records.record_of(raw, name)
        except ShardCorrupt:
            record = {}
        raise DuplicateRank(
            f"rank {self.rank} is still running ({_describe(record)}, attempt "
            f"{record.get('attempt')}): two processes claim rank {self.rank}",
            rank=self.rank, path=path,
            hint="stop the old job first, or give each job its own URL or job id "
            "(connect(job=...) or FERROSYNC_JOB)",
        )

    def _object(self, attempt: int) -> None:
        if attempt in self._objected:
            return
        self._objected.add(attempt)
        record = {"attempt": self.attempt, "objects_to": attempt, "pid": os.getpid(),
                  "host": socket.gethostname()}
        # False: someone objected already, and the newcomer will see it
        self.records.put_record(names.objection(self.rank, attempt), record, exclusive=True)

    def guard_once(self) -> None:
        """While running: object to every later claim of this rank, and carry on."""
        while object_exists(self.storage, join_key(self.ns, self.rank, self._watch)):
            self._object(self._watch)
            self._watch += 1

    def start_guard(self, interval: float) -> None:
        """Object to later claims every ``interval`` s from a daemon thread.

        The newcomer's objection window is two intervals and a second, so a
        running job that is not paused always answers in time.
        """
        def run() -> None:
            while not self._stop.wait(interval):
                try:
                    self.guard_once()
                # broad on purpose: the guard must outlive storage trouble (the
                # collectives report it to the user); the cause is kept for them
                except Exception as exc:  # noqa: BLE001
                    self.guard_error = exc

        self._guard = threading.Thread(target=run, name=f"ferrosync-claim-r{self.rank}",
                                       daemon=True)
        self._guard.start()

    def release(self) -> None:
        """Stop guarding and mark the claim ended, so a restart need not wait."""
        self._stop.set()
        if self._guard is not None and self._guard is not threading.current_thread():
            self._guard.join(timeout=5.0)
        self._guard = None
        if self.attempt < 0:
            return
        try:
            # False: written already, and the claim is ended either way
            self.records.put_record(names.end(self.rank, self.attempt),
                                    {"pid": os.getpid()}, exclusive=True)
        # broad on purpose: release runs while closing or while an error unwinds, and a
        # missing end marker only makes a restart wait one objection window
        except Exception as exc:  # noqa: BLE001
            self.release_error = exc

    def forget(self) -> None:
        """In a forked child: the claim is the parent's; stop nothing, write nothing."""
        self._guard = None
        self.attempt = -1


@dataclass(frozen=True)
class _Plan:
    """Everything one rendezvous needs, checked by the caller."""

    storage: Storage
    ns: str
    rank: int
    world_size: int
    settings: dict
    key: bytes | None
    timeout: float
    poll: tuple[float, float]
    interval: float
    claim_window: float
    url: str
    records: Objects

    @property
    def objection_window(self) -> float:
        return 2 * self.interval + 1.0


def rendezvous(storage: Storage, rank: int, world_size: int, settings: dict, *,
               key: bytes | None, timeout: float, poll: tuple[float, float],
               heartbeat_interval: float, url: str, job: str | None = None,
               claim_window: float | None = None) -> Generation:
    """Collective: every rank of the job calls it once at connect.

    Blocks until the generation is announced and this rank's claim window has
    passed uncontested, at most ``timeout`` s (then ``SyncTimeout``). Raises
    ``ConfigError`` at once when the ranks disagree on world size, secret or
    wire settings, and ``DuplicateRank`` when another process claims this rank.
    ``claim_window`` defaults to 3 s without a ``job`` id and 0 with one.
    """
    if claim_window is None:
        # a world of one has no peers to mix with: only a shared anonymous job waits
        claim_window = ANONYMOUS_CLAIM_WINDOW if job is None and world_size > 1 else 0.0
    ns = namespace(job)
    plan = _Plan(storage, ns, rank, world_size, settings, key, timeout, poll,
                 heartbeat_interval, claim_window, url,
                 Objects.for_records(storage, ns, key=key, rank=rank))
    storage.makedirs(plan.ns)
    deadline = time.monotonic() + timeout
    claim = Claim(storage, plan.ns, rank, key, {
        "job": job, "rank": rank, "world_size": world_size, "settings": settings,
        "token": secrets.token_hex(8), "host": socket.gethostname(), "pid": os.getpid(),
        "wall_time": time.time(),
    })
    g0 = first_missing(storage, lambda g: gen_key(plan.ns, g))  # earlier ones can't be ours
    claim.write()
    generation = None
    try:
        if rank == 0:
            generation = _announce(plan, claim, deadline)
        else:
            generation = _await_announcement(plan, claim, g0, deadline)
        _settle(plan, claim, deadline)
    except BaseException as exc:
        if generation is not None:
            # peers may already be in their first collective: tell them now
            publish_abort(storage, generation.prefix, rank, exc, 0, key)
        claim.release()
        raise
    claim.start_guard(heartbeat_interval)
    return Generation(generation.number, generation.token, generation.prefix,
                      generation.settings, claim)


def _settle(plan: _Plan, claim: Claim, deadline: float) -> None:
    """Wait out this rank's claim window (and the objection window of a restart)."""
    if plan.world_size == 1:
        return  # nobody to pair with: a duplicate single process cannot mix data
    window = plan.claim_window
    if not claim.previous_ended():
        window = max(window, plan.objection_window)
    until = claim.written_at + window

    def settled():
        claim.check()
        return True if runtime.passed(until) else None

    def expired():
        raise SyncTimeout(
            f"timed out after {plan.timeout:g} s in the claim window: a job without an "
            f"id waits {window:g} s before its first collective (so that a second job "
            "on this URL is seen)", rank=plan.rank, path=plan.url,
            hint="give the job an id (connect(job=...) or FERROSYNC_JOB; "
            "init_process_group('ferrosync') finds one in torch's store), or a timeout "
            f"longer than {window:g} s")

    runtime.wait(settled, deadline=deadline, expired=expired, poll=plan.poll, wake=until)


def _read_announcement(plan: _Plan, g: int) -> dict | None:
    if g < 0:
        return None
    name = names.announcement(g)
    raw = plan.storage.read(plan.records.key_of(name), rank=plan.rank)
    if raw is None:
        return None
    path = plan.records.path_of(name)
    try:
        return plan.records.record_of(raw, name)
    except ShardCorrupt as exc:
        raise ConfigError(
            f"cannot read rank 0's announcement of generation {g} ({exc.what})",
            rank=plan.rank, path=path,
            hint="set the same secret (or none) on every rank, and let no other job "
            "write under this URL and job id",
        ) from None


def _mismatches(plan: _Plan, r: int, record: dict) -> list[str]:
    problems = []
    if record.get("world_size") != plan.world_size:
        problems.append(f"rank {r} has world_size={record.get('world_size')!r}, rank 0 has "
                        f"{plan.world_size}")
    theirs = record.get("settings", {})
    for name in sorted(set(plan.settings) | set(theirs)):
        if name != "world_size" and plan.settings.get(name) != theirs.get(name):
            problems.append(f"rank {r} has {name}={theirs.get(name)!r}, rank 0 has "
                            f"{plan.settings.get(name)!r}")
    return problems


def _announce(plan: _Plan, claim: Claim, deadline: float) -> Generation:
    storage = plan.storage
    g = first_missing(storage, lambda n: gen_key(plan.ns, n))
    previous = _read_announcement(plan, g - 1)
    consumed: dict[str, list] = previous.get("joins", {}) if previous else {}
    joins: dict[str, list] = {"0": [claim.attempt, claim.token]}
    problems: list[str] = []
    pending = list(range(1, plan.world_size))
    looks = []

    def look():
        if looks:  # between two looks: is this claim still uncontested?
            claim.check()
        looks.append(None)
        for r in list(pending):
            start = consumed.get(str(r), [-1])[0] + 1
            if not object_exists(storage, join_key(plan.ns, r, start)):
                continue
            latest = first_missing(storage, lambda n, r=r: join_key(plan.ns, r, n), start) - 1
            name = names.join(r, latest)
            try:
                raw = storage.read(plan.records.key_of(name), rank=0)
                record = plan.records.record_of(raw or b"", name)
            except ShardCorrupt as exc:
                record = {}
                problems.append(f"rank {r}'s join record is unreadable here ({exc.what}): "
                                "are the secrets the same on every rank?")
            joins[str(r)] = [latest, record.get("token")]
            if record:
                problems.extend(_mismatches(plan, r, record))
            pending.remove(r)
        # a disagreement is announced at once: nobody waits for the rest
        return True if not pending or problems else None

    def expired():
        raise SyncTimeout(
            f"timed out after {plan.timeout:g} s waiting for ranks {pending} to join",
            rank=0, path=plan.url,
            hint="start every rank with the same URL, job id and WORLD_SIZE "
            f"({plan.world_size}); check their logs",
        )

    if pending:
        runtime.wait(look, deadline=deadline, expired=expired, poll=plan.poll)
    token = secrets.token_hex(8)
    record = {
        "job": plan.ns, "generation": g, "token": token, "world_size": plan.world_size,
        "settings": plan.settings, "joins": joins, "error": "; ".join(problems) or None,
        "host": socket.gethostname(), "pid": os.getpid(), "wall_time": time.time(),
    }
    storage.makedirs(gen_prefix(g, token))
    if not plan.records.put_record(names.announcement(g), record, exclusive=True):
        raise DuplicateRank(
            f"another rank 0 announced generation {g} at the same moment", rank=0,
            path=storage.path_of(gen_key(plan.ns, g)),
            hint="two jobs share this URL: stop one, or give each its own URL or job id",
        )
    if problems:
        raise ConfigError("ranks disagree at rendezvous: " + record["error"], rank=0,
                          path=plan.url,
                          hint="start every rank with the same world size, options, secret "
                          "and ferrosync version")
    return Generation(g, token, gen_prefix(g, token), plan.settings)


def _await_announcement(plan: _Plan, claim: Claim, g: int, deadline: float) -> Generation:
    storage = plan.storage
    looks = []

    def look() -> Generation | None:
        nonlocal g
        if looks:  # between two looks: is this claim still uncontested?
            claim.check()
        looks.append(None)
        while (announced := _read_announcement(plan, g)) is not None:
            path = storage.path_of(gen_key(plan.ns, g))
            mine = announced.get("joins", {}).get(str(plan.rank))
            if mine == [claim.attempt, claim.token]:
                if announced.get("error"):
                    raise ConfigError(
                        "ranks disagree at rendezvous: " + announced["error"], rank=plan.rank,
                        path=plan.url, hint="start every rank with the same world size, "
                        "options, secret and ferrosync version")
                return Generation(g, announced["token"], gen_prefix(g, announced["token"]),
                                  announced["settings"])
            if mine is not None and mine[0] > claim.attempt:
                raise DuplicateRank(
                    f"generation {g} took a later process as rank {plan.rank} (attempt "
                    f"{mine[0]}, this process is attempt {claim.attempt})", rank=plan.rank,
                    path=path,
                    hint="each process needs a distinct RANK; two jobs must not share one URL",
                )
            if announced.get("world_size") != plan.world_size:
                raise ConfigError(
                    f"rank 0 announced a world of {announced.get('world_size')} ranks, this "
                    f"process is rank {plan.rank} of {plan.world_size}", rank=plan.rank,
                    path=path, hint="start every rank with the same WORLD_SIZE (or give "
                    "each job its own URL or job id)")
            g += 1  # announced before our claim became visible: not ours, look further
        return None

    def expired():
        raise SyncTimeout(
            f"timed out after {plan.timeout:g} s waiting for rank 0 to announce "
            f"generation {g}",
            rank=plan.rank, path=plan.url,
            hint="is rank 0 running, with the same URL and job id? (rank 0 waits for "
            f"every rank of WORLD_SIZE={plan.world_size} to join)",
        )

    return runtime.wait(look, deadline=deadline, expired=expired, poll=plan.poll)
