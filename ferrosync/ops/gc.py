"""``ferrosync gc URL``: remove finished or dead generations and orphaned temp files,
never a live one.

A generation goes only when every rank finished, or none beat during the watch window
(a job's newest only when finished or its launcher provably exited); ``rdzv*/`` records
and elastic namespaces are never removed; a record that cannot be verified protects,
never unprotects; nothing is followed. The rules and why each is safe:
docs/operations.md#ferrosync-gc-url---keep-n---dry-run.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import sys
import time
from dataclasses import dataclass, field

from ferrosync.errors import StorageError
from ferrosync.ops.doctor import owned
from ferrosync.ops.keys import JobKeys
from ferrosync.ops.scan import (
    DOCTOR_PREFIX,
    GC_LOCK,
    FoundGeneration,
    Obj,
    human_bytes,
    printable,
    scan,
)
from ferrosync.ops.watch import FINAL_STATES, RankView, generation_status, judge
from ferrosync.storage import names
from ferrosync.storage.engines import LocalStorage, Storage, object_exists
from ferrosync.storage.engines.local_tools import LocalTree

REMOVABLE = ("finished", "dead", "empty", "orphan")


@dataclass
class Decision:
    """What gc does with one generation (or a group of loose files), and why."""

    target: str
    action: str  # remove | keep
    reason: str
    keys: list[str] = field(default_factory=list)
    bytes: int = 0
    directory: str | None = None  # local: remove this directory once empty
    #: a generation's rendezvous namespace ("rdzv" or "rdzv.{job}"; None: unannounced)
    namespace: str | None = None


def plan(storage: Storage, keys: JobKeys, window: float, keep: int) -> list[Decision]:
    """Decide, without deleting anything, what gc would remove."""
    since = time.monotonic()
    found = scan(storage, keys)
    gens = found.ordered()
    views = judge(storage, gens, keys, window)
    # a job being started may be in its namespace's newest announced generation before
    # its first heartbeat: each job's newest is removed only when finished
    newest = found.newest_prefixes
    decisions: list[Decision] = []
    kept_finished: dict[str | None, int] = {}  # per job namespace (None: unannounced)
    running_pids: dict[str, set[int]] = {}
    for gen in gens:  # newest first, so --keep keeps each job's newest
        status = generation_status(gen, views[gen.prefix], found)
        running_pids[gen.prefix] = _running_pids(views[gen.prefix])
        decision = _decide(gen, status, views[gen.prefix], newest, keys)
        if decision.action == "remove" and status in ("finished", "dead") and \
                kept_finished.get(gen.namespace, 0) < keep:
            kept_finished[gen.namespace] = kept_finished.get(gen.namespace, 0) + 1
            decision = Decision(gen.prefix, "keep", f"{status}; kept by --keep {keep}",
                                namespace=gen.namespace)
        decisions.append(decision)
        if decision.action == "keep":
            # not the parts of a kept generation's objects: a write of many parts over a
            # slow link may outlast any watch window before its manifest is put, so its
            # parts go with their generation (a part names no writer to ask)
            temps = [t for t in gen.temps if t.kind != "part"]
            decisions.extend(_loose_temps(storage, temps, running_pids[gen.prefix],
                                          f"temp files in {gen.prefix}", window, since))
    everyone = set().union(*running_pids.values()) if running_pids else set()
    probes, foreign = _doctors_own(storage, found.probes)
    theirs = {d.target for d in foreign}
    decisions.extend(d for d in _loose_temps(storage, found.temps + probes, everyone,
                                             "temp files and probes outside generations",
                                             window, since)
                     if d.target not in theirs)  # a doctor-like directory with their files
    decisions.extend(foreign)
    decisions.extend(_elastic_decision(ns, objs) for ns, objs in sorted(found.elastic.items()))
    if found.irregular:
        decisions.append(_irregular_decision(found.irregular))
    return decisions


def _doctors_own(storage: Storage, probes: list[Obj]) -> tuple[list[Obj], list[Decision]]:
    """Split ``probes`` into candidates (connect probes, and what doctor provably wrote
    in its directories: ``doctor.owned``) and a "keep" decision for each doctor-like
    directory holding anything else, a user's files under such a name."""
    candidates, dirs = [], {}
    for obj in probes:
        top, sep, _ = obj.key.partition("/")
        if sep and top.startswith(DOCTOR_PREFIX):
            dirs.setdefault(top, []).append(obj)
        else:
            candidates.append(obj)  # a connect probe, or an empty doctor directory
    kept = []
    for directory, objs in sorted(dirs.items()):
        ours = set(owned(storage, directory, [o.key for o in objs]))
        candidates.extend(o for o in objs if o.key in ours)
        others = [o for o in objs if o.key not in ours]
        if others:
            why = ("objects ferrosync doctor never writes" if ours else
                   f"no doctor mark ({names.DOCTOR_MARK}) naming it: not ferrosync's")
            kept.append(Decision(directory, "keep", f"{why}; left alone",
                                 [o.key for o in others], sum(o.size for o in others)))
    return candidates, kept


def _elastic_decision(namespace: str, objs: list[Obj]) -> Decision:
    """An elastic job's namespace: kept whole, and named with what it holds."""
    ended = any(o.name == names.ELASTIC_ENDED for o in objs)
    temps = sum(o.kind == "temp" for o in objs)
    state = ("it has ended (its end marker is there): remove it by hand once nobody needs "
             "its published state" if ended else "it may be running (members on other "
             "hosts included)")
    return Decision(f"{namespace}/", "keep",
                    f"an elastic job ({len(objs)} objects, "
                    f"{human_bytes(sum(o.size for o in objs))}"
                    + (f", {temps} temp files" if temps else "") + "); gc never removes "
                    f"anything there, temp files included: {state}", namespace=namespace)


def _irregular_decision(entries: list[tuple[str, str]]) -> Decision:
    """Links, FIFOs, sockets, devices: never followed, never removed, but named."""
    shown = ", ".join(f"{key} ({what})" for key, what in entries[:10])
    more = f" and {len(entries) - 10} more" if len(entries) > 10 else ""
    return Decision(
        "entries that are not regular files", "keep",
        f"{shown}{more}: ferrosync never writes links, FIFOs, sockets or devices, so someone "
        "planted them; gc never follows or removes them: find out who, then remove them "
        "by hand", [key for key, _ in entries])


def _running_pids(views: list[RankView]) -> set[int]:
    pids = set()
    for v in views:
        obs = v.heartbeat
        if obs is not None and obs.last is not None and v.state not in FINAL_STATES:
            pid = obs.last.get("pid")
            if isinstance(pid, int):
                pids.add(pid)
    return pids


def _decide(gen: FoundGeneration, status: str, views: list[RankView], newest: set[str],
            job_keys: JobKeys) -> Decision:
    keys = [o.key for o in gen.objects + gen.temps + gen.parts]
    over = _launch_over(gen, status, job_keys)
    if over is not None:
        return Decision(gen.prefix, "remove", f"{status}, and its job is over: {over}", keys,
                        gen.bytes, gen.prefix, gen.namespace)
    if status not in REMOVABLE:
        why = {
            "live": "live: heartbeat counters are moving (ranks "
                    f"{[v.rank for v in views if v.state == 'live']})",
            "creating": "being created: no announcement names it yet, and a job here may "
                        "still announce its number (rank 0 makes the directory just before)",
        }.get(status) or _unknown_reason(views)
        return Decision(gen.prefix, "keep", why, namespace=gen.namespace)
    if gen.announced and gen.prefix in newest and status != "finished":
        return Decision(gen.prefix, "keep",
                        f"{status}, but the newest generation of {_job_name(gen)} is removed "
                        "only when finished (a job being started may not have heartbeated "
                        "yet)", namespace=gen.namespace)
    why = {
        "finished": "finished: every rank closed or aborted",
        "dead": "dead: no heartbeat counter moved while watched (ranks "
                f"{[v.rank for v in views if v.state == 'stale']} stale)",
        "empty": f"empty and not the newest generation of {_job_name(gen)}",
        "orphan": "an empty, unannounced directory whose number every job here has "
                  "announced with another directory (its "
                  "rank 0 lost the race for that number, or was killed)",
    }[status]
    return Decision(gen.prefix, "remove", why, keys, gen.bytes,
                    gen.prefix if gen.has_dir or gen.objects else None, gen.namespace)


def _launch_over(gen: FoundGeneration, status: str, job_keys: JobKeys) -> str | None:
    """Why ``gen``'s job is provably over (its launcher has exited, so no rank runs),
    for a generation nothing else would remove (its job's newest, or records that say
    nothing); None otherwise. A heartbeat that moved (``live``) outweighs it."""
    if status in ("live", "finished", "orphan") or not gen.announced:
        return None
    key_file = job_keys.key_file(gen.job)
    return key_file.launcher_gone() if key_file is not None else None


def _job_name(gen: FoundGeneration) -> str:
    if gen.namespace is None:
        return "its job"
    return f"job {gen.job}" if gen.job is not None else "the job without an id"


def _unknown_reason(views: list[RankView]) -> str:
    problems = sorted({f"rank {v.rank} {v.state}: {v.problem}" for v in views if v.problem})
    return "cannot prove it finished or dead" + (f" ({'; '.join(problems)})" if problems else "")


def _loose_temps(storage: Storage, objs: list[Obj], running: set[int], what: str,
                 window: float, since: float) -> list[Decision]:
    """Temp files and probes whose writer provably is gone: they outlived the watch
    window (re-checked by exact name) and their pid is not a running rank's."""
    if not objs:
        return []
    # a candidate must exist for a whole window after the listing that found it
    time.sleep(max(0.0, since + window - time.monotonic()))
    gone, kept = [], []
    for obj in objs:
        if obj.pid is not None and (obj.pid in running or _alive_here(storage, obj.pid)):
            kept.append(obj)
        elif window <= 0:
            kept.append(obj)
        elif obj.kind == "probe-dir" or _still_there(storage, obj.key) and not (
                obj.target is not None and _still_there(storage, obj.target)):
            gone.append(obj)  # (a part: its object is still missing after the window)
    out = []
    files = [o for o in gone if o.kind != "probe-dir"]
    if files:
        out.append(Decision(what, "remove", f"outlived the {window:g} s watch window and "
                            "their writer is not running", [o.key for o in files],
                            sum(o.size for o in files)))
    dirs = sorted({o.key.split("/", 1)[0] for o in gone if o.key.startswith(DOCTOR_PREFIX)})
    out.extend(Decision(d, "remove", "a doctor probe directory left behind", directory=d)
               for d in dirs)
    if kept:
        why = ("no watch window (--watch 0): cannot tell an orphan from a file being written"
               if window <= 0 else
               f"their writer may still be running (pids {sorted({o.pid for o in kept})})")
        out.append(Decision(what, "keep", why, [o.key for o in kept]))
    return out


def _still_there(storage: Storage, key: str) -> bool:
    """The candidate still exists as an object; something the store refuses to open
    (planted at its name since the listing) is not removed."""
    try:
        return object_exists(storage, key)
    except StorageError:
        return False


def _alive_here(storage: Storage, pid: int) -> bool:
    """On a local directory, a temp file of a process alive on this host is kept (its
    pid may be a coincidence on NFS: then the file is merely kept, never lost)."""
    if not isinstance(storage, LocalStorage):
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def apply(storage: Storage, decisions: list[Decision]) -> tuple[int, int]:
    """Delete what ``decisions`` remove; returns (objects, bytes) removed."""
    objects = nbytes = 0
    for d in decisions:
        if d.action != "remove":
            continue
        # heartbeats last: a concurrent `inspect` never sees data without its liveness
        # (and doctor's mark last: what a cut-short gc leaves is still provably doctor's)
        keys = sorted(d.keys, key=lambda k: k.rpartition("/")[2] == names.DOCTOR_MARK or
                      names.parse(k.rpartition("/")[2]).kind == "heartbeat")
        storage.delete(keys)
        objects += len(keys)
        nbytes += d.bytes
        if d.directory and isinstance(storage, LocalStorage):
            # empty ones only, children first, never through a link
            LocalTree(storage).remove_empty_dirs(d.directory)
    return objects, nbytes


class _GcLock:
    """One gc at a time on a local/NFS directory: an exclusive ``fcntl.flock`` on
    ``.ferrosync-gc.lock``, taken here rather than through a lock library because the
    file must be opened without following links (``LocalTree.open_lock``): a link
    planted at its name is refused, never truncated or written through."""

    def __init__(self, storage: LocalStorage) -> None:
        self._tree = LocalTree(storage)
        self._fd: int | None = None
        self.lock_file = storage.path_of(GC_LOCK)

    def acquire(self) -> str:
        """Take the lock without waiting: "held", "busy" (another gc holds it) or "full"
        (the filesystem has no room for the lock file: gc goes on without it)."""
        try:
            fd = self._tree.open_lock(GC_LOCK)
        except StorageError as exc:
            if getattr(exc.__cause__, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
                return "full"
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return "busy"
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return "held"

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def _locked(storage: Storage) -> _GcLock | None:
    """One gc at a time on a local/NFS directory; object stores have no lock."""
    return _GcLock(storage) if isinstance(storage, LocalStorage) else None


def run(storage: Storage, keys: JobKeys, window: float, *, keep: int, dry_run: bool,
        as_json: bool) -> int:
    if isinstance(storage, LocalStorage) and not os.path.isdir(storage.root):
        print(f"nothing to collect: {storage.root} does not exist")
        return 0
    lock = None if dry_run else _locked(storage)
    taken = lock.acquire() if lock is not None else None
    if taken == "busy":
        print(f"another `ferrosync gc` holds {lock.lock_file}; try again when it is done")
        return 1
    if taken == "full":
        print(f"ferrosync gc: the filesystem is full, so {lock.lock_file} cannot be "
              "created: going on without the lock (run one gc at a time)", file=sys.stderr)
    try:
        decisions = plan(storage, keys, window, keep)
        removed = (0, 0) if dry_run else apply(storage, decisions)
    finally:
        if lock is not None:
            lock.release()
    if as_json:
        print(json.dumps({
            "url": storage.url, "dry_run": dry_run, "keep": keep, "watch_s": window,
            "decisions": [d.__dict__ for d in decisions],
            "removed_objects": removed[0], "removed_bytes": removed[1],
        }, indent=2, sort_keys=True))
        return 0
    print(f"ferrosync gc {storage.url}" + ("  (dry run: nothing deleted)" if dry_run else ""))
    for d in decisions:
        verb = ("would remove" if dry_run else "removed") if d.action == "remove" else "keep"
        size = f" ({len(d.keys)} objects, {human_bytes(d.bytes)})" if d.action == "remove" \
            else ""
        print(f"  {verb:<12} {printable(d.target)}{size}: {printable(d.reason)}")
    if not decisions:
        print("  nothing here")
    total = sum(len(d.keys) for d in decisions if d.action == "remove")
    total_bytes = sum(d.bytes for d in decisions if d.action == "remove")
    elastic = " and elastic namespaces" if any(
        names.is_elastic_namespace(d.target.rstrip("/")) for d in decisions) else ""
    print(f"{'would remove' if dry_run else 'removed'} {total} objects, "
          f"{human_bytes(total_bytes)}; rdzv*/ records{elastic} kept")
    return 0
