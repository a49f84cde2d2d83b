"""``ferrosync gc URL``: remove finished generations and orphaned temp files, never live ones.

Run it (exit 0 whatever it finds; 2 on bad usage)::

    ferrosync gc /mnt/nfs/exp7 --dry-run       # the plan, and why
    ferrosync gc /mnt/nfs/exp7 --keep 2        # keep the two newest finished generations
    ferrosync gc s3://bucket/exp7 --storage-options '{"profile": "ops"}' --secret "$KEY"

What goes, and why it is safe:

* A generation is removed when it is **finished** (every rank's last heartbeat says
  closed or aborted, or it left an abort marker) or **dead** (no rank's heartbeat
  counter changed during the watch window, at least two heartbeat periods of this
  process's monotonic clock). A live generation is never removed.
* The **newest** generation is removed only when finished: a job that has just been
  announced may not have written its first heartbeat yet. A generation directory
  without an announcement and numbered above the newest announcement is a rank 0
  between creating it and announcing it: left alone.
* ``rdzv/`` records are kept: they number future generations and let a restart skip
  consumed join records (a few hundred bytes each).
* A temp file ``.{name}.{pid}.{hex}.tmp`` goes with its generation, or on its own
  when it outlived the watch window and its pid is none of its generation's running
  ranks (and, on a local directory, no live process here).
* Records that cannot be verified (a MAC and no ``--secret``, or a bad MAC) are never
  acted upon: their generation is kept and the reason printed.
* On a local or NFS directory one ``gc`` at a time holds ``.ferrosync-gc.lock``
  (filelock); jobs never take it, they are protected by liveness.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

from ..storage import LocalStorage, Storage, object_exists
from .layout import DOCTOR_PREFIX, GC_LOCK, Generation, Obj, human_bytes, scan
from .watch import FINAL_STATES, RankView, generation_status, judge

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


def plan(storage: Storage, secret: bytes | None, window: float, keep: int) -> list[Decision]:
    """Decide, without deleting anything, what gc would remove."""
    since = time.monotonic()
    found = scan(storage, secret)
    gens = found.ordered()
    views = judge(storage, gens, secret, window)
    # a job being started may be in the newest announced generation before its first
    # heartbeat: that one is removed only when finished
    newest = found.newest_announced
    decisions: list[Decision] = []
    kept_finished = 0
    running_pids: dict[str, set[int]] = {}
    for gen in gens:  # newest first, so --keep keeps the newest
        status = generation_status(gen, views[gen.prefix], newest)
        running_pids[gen.prefix] = _running_pids(views[gen.prefix])
        decision = _decide(gen, status, views[gen.prefix], newest)
        if decision.action == "remove" and status in ("finished", "dead") and kept_finished < keep:
            kept_finished += 1
            decision = Decision(gen.prefix, "keep", f"{status}; kept by --keep {keep}")
        decisions.append(decision)
        if decision.action == "keep":
            decisions.extend(_loose_temps(storage, gen.temps, running_pids[gen.prefix],
                                          f"temp files in {gen.prefix}", window, since))
    everyone = set().union(*running_pids.values()) if running_pids else set()
    decisions.extend(_loose_temps(storage, found.temps + found.probes, everyone,
                                  "temp files and probes outside generations", window, since))
    return decisions


def _running_pids(views: list[RankView]) -> set[int]:
    pids = set()
    for v in views:
        obs = v.heartbeat
        if obs is not None and obs.last is not None and v.state not in FINAL_STATES:
            pid = obs.last.get("pid")
            if isinstance(pid, int):
                pids.add(pid)
    return pids


def _decide(gen: Generation, status: str, views: list[RankView], newest: int | None,
            ) -> Decision:
    keys = [o.key for o in gen.objects] + [t.key for t in gen.temps]
    if status not in REMOVABLE:
        why = {
            "live": "live: heartbeat counters are moving (ranks "
                    f"{[v.rank for v in views if v.state == 'live']})",
            "creating": "being created: rank 0 has made it and not announced it yet",
        }.get(status) or _unknown_reason(views)
        return Decision(gen.prefix, "keep", why)
    if gen.announced and gen.number == newest and status != "finished":
        return Decision(gen.prefix, "keep",
                        f"{status}, but the newest generation is removed only when finished "
                        "(a job being started may not have heartbeated yet)")
    why = {
        "finished": "finished: every rank closed or aborted",
        "dead": "dead: no heartbeat counter moved while watched (ranks "
                f"{[v.rank for v in views if v.state == 'stale']} stale)",
        "empty": "empty and not the newest generation",
        "orphan": "an empty, unannounced directory below the newest announcement (its "
                  "rank 0 lost the race for that number, or was killed)",
    }[status]
    return Decision(gen.prefix, "remove", why, keys, gen.bytes,
                    gen.prefix if gen.has_dir or gen.objects else None)


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
        elif obj.kind == "probe-dir" or object_exists(storage, obj.key):
            gone.append(obj)
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
        keys = sorted(d.keys, key=lambda k: k.rsplit("/", 1)[-1].startswith("hb."))
        storage.delete(keys)
        objects += len(keys)
        nbytes += d.bytes
        if d.directory and isinstance(storage, LocalStorage):
            _remove_empty_dirs(os.path.join(storage.root, d.directory))
    return objects, nbytes


def _remove_empty_dirs(path: str) -> None:
    for dirpath, _dirs, _files in os.walk(path, topdown=False):  # children first
        try:
            os.rmdir(dirpath)
        except OSError:
            pass  # not empty: something new appeared there; leave it


def _locked(storage: Storage):
    """One gc at a time on a local/NFS directory; object stores have no lock."""
    if not isinstance(storage, LocalStorage):
        return None
    import filelock

    path = os.path.join(storage.root, GC_LOCK)
    try:
        return filelock.FileLock(path, timeout=0, mode=0o660)
    except TypeError:  # filelock < 3.10 has no mode argument
        return filelock.FileLock(path, timeout=0)


def run(storage: Storage, secret: bytes | None, window: float, *, keep: int, dry_run: bool,
        as_json: bool) -> int:
    if isinstance(storage, LocalStorage) and not os.path.isdir(storage.root):
        print(f"nothing to collect: {storage.root} does not exist")
        return 0
    lock = None if dry_run else _locked(storage)
    if lock is not None:
        import filelock

        try:
            lock.acquire()
        except filelock.Timeout:
            print(f"another `ferrosync gc` holds {lock.lock_file}; try again when it is done")
            return 1
    try:
        decisions = plan(storage, secret, window, keep)
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
        print(f"  {verb:<12} {d.target}{size}: {d.reason}")
    if not decisions:
        print("  nothing here")
    total = sum(len(d.keys) for d in decisions if d.action == "remove")
    total_bytes = sum(d.bytes for d in decisions if d.action == "remove")
    print(f"{'would remove' if dry_run else 'removed'} {total} objects, "
          f"{human_bytes(total_bytes)}; rdzv/ records kept")
    return 0
