"""Liveness as the tools judge it: does a rank's heartbeat counter change?

``observe`` reads heartbeats by exact name every ``poll`` seconds for up to ``window``
seconds of this process's own clock (docs/design.md#no-cross-host-clocks); a rank is
*stale* only if the window covered two of its heartbeat periods
(docs/operations.md#how-the-tools-judge-liveness).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ferrosync.core import runtime
from ferrosync.ops.keys import JobKeys
from ferrosync.ops.scan import FoundGeneration, Record, Scan, read_markers, read_record
from ferrosync.storage import names
from ferrosync.storage.engines import Storage

FINAL_STATES = ("closed", "aborted")


def default_interval(storage: Storage) -> float:
    """The heartbeat period a job uses on this store unless it sets one (ferrosync/storage/).
    A heartbeat record that names its own ``interval`` overrides it."""
    return storage.heartbeat_interval


def default_window(storage: Storage) -> float:
    """Long enough to see two heartbeats at the store's default period, short enough
    for an interactive tool (the engine's ``watch_periods`` of them)."""
    return storage.watch_periods * storage.heartbeat_interval


def poll_period(storage: Storage) -> float:
    """How often the tools read heartbeats on this store (the engine's ``watch_poll``)."""
    return storage.watch_poll


@dataclass
class Observation:
    """First and last heartbeat seen for one rank, and whether ``beat`` changed."""

    first: Record | None
    last: Record | None
    changed: bool
    watched_s: float  # monotonic seconds between the first and the last read


@dataclass
class RankView:
    """What the tools know about one rank of one generation."""

    rank: int
    state: str  # live | stale | closed | aborted | missing | unjudged | untrusted
    heartbeat: Observation | None
    abort: Record | None
    problem: str | None = None


def _beat(record: Record | None):
    return record.get("beat") if record is not None and record.usable else None


def _undecided(record: Record | None) -> bool:
    """Still worth watching: missing (maybe starting) or running."""
    if record is None:
        return True
    return record.usable and record.get("state") == "running"


def observe(storage: Storage, keys: dict[str, Record | None], window: float,
            secrets: dict[str, bytes | None], poll: float) -> dict[str, Observation]:
    """Watch the heartbeat records ``keys`` (with their first reads) for ``window`` s,
    each verified with its job's key (``secrets``, by record key)."""
    start = time.monotonic()
    last = dict(keys)
    changed = {k: False for k in keys}
    watching = [k for k, rec in keys.items() if _undecided(rec)]
    looks = []

    def look():
        if looks:  # the first look is the caller's: ``keys`` holds its reads
            for key in list(watching):
                record = read_record(storage, key, secrets[key])
                if record is None:
                    continue
                before = _beat(keys[key])
                if (keys[key] is None or before != _beat(record)) and record.usable:
                    changed[key] = True
                    watching.remove(key)
                last[key] = record
        looks.append(None)
        return None if watching else True

    runtime.wait(look, deadline=start + window, poll=(poll, poll))
    for key in keys:
        if changed[key]:
            # a fresh read: positions and ages as of the end of the watch, not the change
            last[key] = read_record(storage, key, secrets[key]) or last[key]
    watched = time.monotonic() - start
    return {k: Observation(keys[k], last[k], changed[k], watched) for k in keys}


def judge(storage: Storage, gens: list[FoundGeneration], keys: JobKeys,
          window: float) -> dict[str, list[RankView]]:
    """Rank views of every generation in ``gens``, from one shared watch window; each
    generation's records verified with its job's key."""
    aborts = {g.prefix: read_markers(storage, g, "abort", keys.secret(g.namespace))
              for g in gens}
    first: dict[str, Record | None] = {}
    secrets: dict[str, bytes | None] = {}
    ranks_of: dict[str, list[int]] = {}
    for gen in gens:
        beats = read_markers(storage, gen, "heartbeat", keys.secret(gen.namespace))
        world = gen.world_size or 0
        # every rank of the world, heartbeat or not: a missing one is worth reporting
        ranks = sorted(set(range(world)) | set(beats) | set(aborts[gen.prefix]))
        ranks_of[gen.prefix] = ranks
        if world == 1 and not beats:
            continue  # a world of one writes no heartbeats: nothing to watch
        for rank in ranks:
            key = names.within(gen.prefix, names.heartbeat(rank))
            first[key], secrets[key] = beats.get(rank), keys.secret(gen.namespace)
    seen = observe(storage, first, window, secrets, poll_period(storage))
    out = {}
    for gen in gens:
        views = []
        for rank in ranks_of[gen.prefix]:
            obs = seen.get(names.within(gen.prefix, names.heartbeat(rank)))
            view = _rank_view(rank, obs, aborts[gen.prefix].get(rank),
                              default_interval(storage))
            if gen.world_size == 1 and view.state == "missing":
                view.problem = "a world of one writes no heartbeats: liveness unknown"
            views.append(view)
        out[gen.prefix] = views
    return out


def _rank_view(rank: int, obs: Observation | None, abort: Record | None,
               interval: float) -> RankView:
    if abort is not None and abort.usable:
        return RankView(rank, "aborted", obs, abort)
    if abort is not None:
        # an abort marker that cannot be read or trusted proves nothing either way: the
        # rank is not judged (gc keeps its generation) rather than taken for stale
        return RankView(rank, "untrusted", obs, abort, abort.problem)
    last = obs.last if obs is not None else None
    if last is None:
        problem = abort.problem if abort is not None else None
        return RankView(rank, "missing", obs, abort, problem)
    if not last.usable:
        return RankView(rank, "untrusted", obs, abort, last.problem)
    state = last.get("state")
    if state in FINAL_STATES:
        return RankView(rank, state, obs, abort)
    if obs.changed:
        return RankView(rank, "live", obs, abort)
    period = last.get("interval")
    period = period if isinstance(period, (int, float)) and period > 0 else interval
    if obs.watched_s >= 2 * period:
        return RankView(rank, "stale", obs, abort,
                        f"heartbeat stuck at {last.get('beat')} for {obs.watched_s:.1f} s")
    return RankView(rank, "unjudged", obs, abort,
                    f"watched {obs.watched_s:.1f} s, under two heartbeat periods "
                    f"({period:g} s each): use a longer --watch")


def generation_status(gen: FoundGeneration, views: list[RankView], found: Scan) -> str:
    """live | finished | dead | empty | creating | orphan | unknown (see docs/operations.md).

    ``found`` is the scan ``gen`` comes from: an unannounced directory is judged
    against the newest announcement of every job namespace it could belong to.
    """
    states = [v.state for v in views]
    if "live" in states:
        return "live"
    if not gen.announced:
        if found.may_be_announced(gen):
            # rank 0 makes the directory just before announcing; with several jobs on
            # one location any of them may be about to announce this number
            return "creating"
        if not gen.objects and not gen.temps:
            return "orphan"  # a rank 0 that lost the race for this number, or was killed
        # otherwise its announcement is gone: judge it by its heartbeats like any other
    if states and all(s in FINAL_STATES for s in states):
        return "finished"
    if not gen.objects and not gen.temps:
        return "empty"  # a world of one, or ranks that never got to write
    if any(s in ("unjudged", "untrusted") for s in states):
        return "unknown"
    if "stale" in states and all(s in (*FINAL_STATES, "stale", "missing") for s in states):
        return "dead"
    return "unknown"


def _positions(views: list[RankView], which: str) -> dict[int, int]:
    """Each running rank's collective at the ``which`` ("first"/"last") read."""
    pos = {}
    for v in views:
        if v.state != "live" or v.heartbeat is None:
            continue
        record = getattr(v.heartbeat, which)
        col = record.get("collective") if record is not None else None
        if isinstance(col, int):
            pos[v.rank] = col
    return pos


def progress(views: list[RankView]) -> dict | None:
    """How far the leading live rank moved while watched (None: nothing live)."""
    first, last = _positions(views, "first"), _positions(views, "last")
    if not first or not last:
        return None
    seconds = max(v.heartbeat.watched_s for v in views if v.state == "live")
    lead_first, lead_last = max(first.values()), max(last.values())
    return {"from": lead_first, "to": lead_last, "seconds": round(seconds, 3),
            "stalled": lead_last == lead_first}


def stragglers(views: list[RankView]) -> list[int]:
    """Live ranks the others wait for: behind the leading collective while the leader
    did not move during the watch. (In a moving job a rank one collective behind is
    normal: rank 0 reduces before the others read the result.)"""
    moved = progress(views)
    if moved is None or not moved["stalled"]:
        return []
    last = _positions(views, "last")
    return sorted(r for r, col in last.items() if col < moved["to"])


