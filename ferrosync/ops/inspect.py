"""``ferrosync inspect URL``: what is at a storage location, and is anyone alive there?

For every generation its status, ranks, heartbeats, stragglers, abort markers and
bytes; liveness from heartbeat counters over ``--watch`` seconds of this process's own
clock (docs/design.md#no-cross-host-clocks). Output: docs/operations.md#ferrosync-inspect-url.
"""

from __future__ import annotations

import json
import os
import time

from ferrosync.errors import StorageError
from ferrosync.ops.elastic_history import elastic_reports
from ferrosync.ops.elastic_history import render as render_elastic
from ferrosync.ops.keys import JobKeys, KeyFile
from ferrosync.ops.scan import (
    FoundGeneration,
    Namespace,
    Scan,
    human_bytes,
    printable_tree,
    read_record,
    scan,
)
from ferrosync.ops.watch import RankView, generation_status, judge, progress, stragglers
from ferrosync.storage.costs import hourly, is_billed, request_cost, request_noun
from ferrosync.storage.engines import Storage
from ferrosync.storage.liveness import describe_abort
from ferrosync.storage.wire import KIND_NAMES, head_size, parse_header


def rank_report(view: RankView) -> dict:
    """One rank as JSON: state, heartbeat counter (first -> last), position, error."""
    out = {"rank": view.rank, "state": view.state, "problem": view.problem}
    obs = view.heartbeat
    last = obs.last if obs is not None else None
    if last is not None and last.data is not None:
        first = obs.first.get("beat") if obs.first is not None else None
        out.update(
            beat_first=first, beat_last=last.get("beat"), beat_changed=obs.changed,
            watched_s=round(obs.watched_s, 3), collective=last.get("collective"),
            op=last.get("op"), host=last.get("host"), pid=last.get("pid"),
            heartbeat_state=last.get("state"), trust=last.trust,
            # another host's clock against ours: informational only, never for liveness
            heartbeat_wall_age_s=_wall_age(last.get("wall_time")),
            collective_wall_age_s=_wall_age(last.get("position_at")),
            **_request_rate(last),
        )
    if view.abort is not None:
        a = view.abort
        out["abort"] = {"type": a.get("type"), "message": a.get("message"),
                        "description": describe_abort(a.get("type"), a.get("message")),
                        "collective": a.get("collective"), "host": a.get("host"),
                        "pid": a.get("pid"), "trust": a.trust, "problem": a.problem}
    return out


def _request_rate(heartbeat) -> dict:
    """The rank's storage requests since it connected, from its own heartbeat (both
    times by its own clock): so far and per hour, and what they cost at S3 list prices."""
    counts, since, now = (heartbeat.get("requests"), heartbeat.get("connected_at"),
                          heartbeat.get("wall_time"))
    if not isinstance(counts, dict) or not all(
            isinstance(v, (int, float)) for v in (since, now)) or not now > since:
        return {}
    clean = {k: v for k, v in counts.items() if isinstance(v, int) and v >= 0}
    return {"requests_by_kind": clean, "connected_s": round(now - since, 1),
            "requests_so_far": clean.get("requests", 0),
            "request_cost_so_far": request_cost(clean),
            **hourly(clean, now - since, None, billed=True)}


def requests_summary(ranks: list[dict], url: str) -> dict | None:
    """All ranks' requests per hour and, on a billed object store, their cost per hour
    (None: no rank's heartbeat says); ``requests_are`` names them as the trainer's
    summary does (``costs.request_noun``: a directory's are file operations)."""
    billed = is_billed(url)
    rates = [r for r in ranks if r.get("requests_per_hour") is not None]
    if not rates:
        return None
    cost = sum(r["request_cost_per_hour"] for r in rates)
    so_far = sum(r["request_cost_so_far"] for r in rates)
    return {"requests_per_hour": sum(r["requests_per_hour"] for r in rates),
            "request_cost_per_hour": cost if billed else None,
            "requests_so_far": sum(r["requests_so_far"] for r in rates),
            "request_cost_so_far": so_far if billed else None, "ranks": len(rates),
            "requests_are": request_noun(url)}


def _wall_age(wall) -> float | None:
    if not isinstance(wall, (int, float)):
        return None
    return round(time.time() - wall, 1)


def generation_report(storage: Storage, gen: FoundGeneration, views: list[RankView],
                      found: Scan, objects: bool) -> dict:
    ann = gen.announcement
    out = {
        "generation": gen.number,
        "token": gen.token,
        "prefix": gen.prefix,
        "path": storage.path_of(gen.prefix),
        "status": generation_status(gen, views, found),
        "announced": gen.announced,
        # the job whose announcement names this directory (namespace None: none does;
        # job None in namespace "rdzv": a job without an id)
        "namespace": gen.namespace,
        "job": gen.job,
        "newest_of_job": gen.prefix in found.newest_prefixes,
        "also_named_by": list(gen.also_named_by),
        "world_size": gen.world_size,
        "objects": len(gen.objects),
        "bytes": gen.bytes,
        "temp_files": [t.key for t in gen.temps],
        "last_collective_on_storage": gen.last_collective(),
        "ranks": (ranks := [rank_report(v) for v in views]),
        "storage_requests": requests_summary(ranks, storage.url),
        "stragglers": stragglers(views),
        "progress": progress(views),
        "aborts": [rank_report(v)["abort"] | {"rank": v.rank}
                   for v in views if v.abort is not None],
    }
    if ann is not None:
        out["announcement"] = {
            "host": ann.get("host"), "pid": ann.get("pid"), "settings": ann.get("settings"),
            "error": ann.get("error"), "trust": ann.trust, "problem": ann.problem,
            "wall_age_s": _wall_age(ann.get("wall_time")),
        }
    if objects:
        out["object_list"] = [object_report(storage, o.key, o.size, o.kind)
                              for o in sorted(gen.objects, key=lambda o: o.key)]
    return out


def object_report(storage: Storage, key: str, size: int, kind: str) -> dict:
    """One object; for binary data objects, what its (crc-checked) header says."""
    out = {"key": key, "size": size, "kind": kind}
    if kind not in ("contribution", "result"):
        return out
    try:
        # the header and its MAC only, in one ranged read: O(1) whatever the object's size
        raw = storage.read_head(key, head_size(True))
    except StorageError as exc:  # something planted at the name since the listing
        out["header"] = f"unreadable: {exc}"
        return out
    if raw is None:
        out["header"] = "gone (deleted since the listing)"
        return out
    try:
        # the header's crc is checked; a MAC (if any) covers the payload and is not
        # verified here, so these fields are informational
        authenticated = len(raw) >= 8 and bool(int.from_bytes(raw[6:8], "little") & 1)
        head = parse_header(raw, path=storage.path_of(key),
                            key=b"inspect" if authenticated else None)
    except ValueError as exc:  # ShardCorrupt
        out["header"] = f"unreadable: {exc}"
        return out
    out["header"] = {
        "kind": KIND_NAMES.get(head.kind), "rank": head.rank, "world_size": head.world_size,
        "collective": head.collective, "slice": head.slice, "nslices": head.nslices,
        "count": head.count, "weight": head.weight, "payload_bytes": head.payload_nbytes,
        "authenticated": authenticated,
        "size_matches": size == head_size(authenticated) + head.payload_nbytes,
    }
    return out


def _latest(objs) -> dict[str, int]:
    """{rank: newest attempt} of claim-numbered records (join, end, dup)."""
    latest: dict[str, int] = {}
    for obj in objs:
        latest[str(obj.rank)] = max(obj.number, latest.get(str(obj.rank), -1))
    return dict(sorted(latest.items(), key=lambda kv: int(kv[0])))


def unconsumed_joins(ns: Namespace) -> dict[str, int]:
    """{rank: attempt} of a namespace's claims newer than every claim its announcements
    took (the newest's, or an earlier one's for a rank the newest lacks): ranks waiting
    for rank 0 to announce (or that gave up waiting)."""
    consumed: dict[str, int] = {}
    for record in ns.announcements.values():
        joins = record.get("joins")
        for r, v in (joins.items() if isinstance(joins, dict) else ()):
            if isinstance(v, list) and v and isinstance(v[0], int):
                consumed[str(r)] = max(v[0], consumed.get(str(r), -1))
    return {r: n for r, n in _latest(ns.of_kind("join")).items() if n > consumed.get(r, -1)}


def objection_report(storage: Storage, obj, secret: bytes | None) -> dict:
    """A ``dup`` record: a live holder of an earlier claim objected to claim ``attempt``."""
    record = read_record(storage, obj.key, secret)
    out = {"rank": obj.rank, "attempt": obj.number, "key": obj.key}
    if record is None:
        return out | {"trust": None, "problem": "gone (deleted since the listing)"}
    return out | {"by_attempt": record.get("attempt"), "host": record.get("host"),
                  "pid": record.get("pid"), "trust": record.trust, "problem": record.problem}


def job_report(storage: Storage, ns: Namespace, found: Scan, keys: JobKeys) -> dict:
    """One job's rendezvous namespace: announcements, waiting claims, objections, and
    the key file its launcher left (whose key verified its records)."""
    announced = sorted(o.number for o in ns.of_kind("announcement"))
    ended = {(o.rank, o.number) for o in ns.of_kind("end")}
    secret = keys.secret(ns.name)
    return {
        "namespace": ns.name,
        "job": ns.job,
        "announcements": announced,
        "newest": ns.newest,
        "newest_prefix": ns.newest_prefix,
        "unconsumed_joins": unconsumed_joins(ns),
        # each rank's newest claim without an end marker: running, or killed
        "open_claims": {r: n for r, n in _latest(ns.of_kind("join")).items()
                        if (int(r), n) not in ended},
        **launch_report(keys.key_file(ns.job)),
        "objections": [objection_report(storage, o, secret) for o in
                       sorted(ns.of_kind("objection"), key=lambda o: (o.rank, o.number))],
        "announced_without_data": [n for n in announced if (p := ns.prefix_of(n)) is not None
                                   and p not in found.generations],
        "untrusted_announcements": sorted(n for n, r in ns.announcements.items()
                                          if not r.usable),
        "join_records": len(ns.of_kind("join")),
        "end_records": len(ended),
        "records": len(ns.records),
        "bytes": ns.bytes,
    }


def launch_report(key_file: KeyFile | None) -> dict:
    """The launch a job's key file describes: the file, and whether its launcher still
    runs (None: another host's, this host cannot tell)."""
    if key_file is None:
        return {"key_file": None, "launcher": None}
    running, state = key_file.launcher_state()
    return {"key_file": key_file.path,
            "launcher": {"host": key_file.launcher.get("host"),
                         "pid": key_file.launcher.get("pid"), "running": running,
                         "state": state}}


def build_report(storage: Storage, keys: JobKeys, window: float,
                 objects: bool = False) -> dict:
    """Scan, watch heartbeats for ``window`` s, and describe everything found."""
    found: Scan = scan(storage, keys)
    gens = found.ordered()
    views = judge(storage, gens, keys, window)
    reports = [generation_report(storage, g, views[g.prefix], found, objects) for g in gens]
    jobs = [job_report(storage, ns, found, keys)
            for _, ns in sorted(found.namespaces.items())]
    return {
        "url": storage.url,
        "watch_s": window,
        "total_bytes": found.total_bytes,
        "total_objects": len(found.objects),
        # what the generation lines count (their temp files apart): these, the rdzv
        # records and the rest (temp files, probes, elastic jobs, foreign) add up to
        # total_objects, and the header says so
        "generation_objects": sum(len(g.objects) for g in gens),
        # every namespace together; per job in "jobs"
        "rdzv": {"namespaces": len(jobs),
                 "announcements": sum(len(j["announcements"]) for j in jobs),
                 "join_records": sum(o.kind == "join" for o in found.rdzv),
                 "records": len(found.rdzv),
                 "bytes": sum(o.size for o in found.rdzv)},
        "jobs": jobs,
        "generations": reports,
        "orphan_temp_files": [o.key for o in found.temps],
        "leftover_probes": [o.key for o in found.probes],
        "elastic_jobs": elastic_reports(
            storage, [o.key for objs in found.elastic.values() for o in objs], keys),
        "foreign_objects": [o.key for o in found.foreign],
        "irregular_entries": [{"key": key, "kind": what} for key, what in found.irregular],
        "untrusted_announcements": sorted(
            r.key for ns in found.namespaces.values() for r in ns.announcements.values()
            if not r.usable),
    }


# -- text rendering ---------------------------------------------------------------------------

def render(report: dict) -> str:
    # every name and record field came from storage: escaped, so a key with a newline
    # or a bidirectional override cannot forge or reorder what the operator reads
    report = printable_tree(report)
    watched = (f"heartbeats watched up to {report['watch_s']:g} s" if report["watch_s"] > 0
               else "heartbeats not watched (--watch 0): liveness not judged")
    lines = [f"ferrosync inspect {report['url']}  ({watched})"]
    gens = report["generations"]
    lines.append(_render_totals(report))
    for job in report["jobs"]:
        lines.extend(_render_job(job))
    if not gens and not report["total_objects"]:
        lines.append("nothing here yet (no ferrosync job has used this location)")
    for gen in gens:
        lines.append("")
        lines.extend(_render_generation(gen))
    lines.extend(render_elastic(report["elastic_jobs"]))
    for title, key in (("orphaned temp files", "orphan_temp_files"),
                       ("leftover probes", "leftover_probes"),
                       ("objects ferrosync does not write (left alone)", "foreign_objects")):
        if report[key]:
            lines.append("")
            lines.append(f"{title}: {len(report[key])}")
            lines.extend(f"  {k}" for k in report[key][:20])
            if len(report[key]) > 20:
                lines.append(f"  ... and {len(report[key]) - 20} more (see --json)")
    lines.extend(_render_irregular(report["irregular_entries"]))
    lines.append("")
    lines.append("hb age: the writer's wall clock against this host's; informational only. "
                 "live/stale come from the beat counter changing while watched.")
    return "\n".join(lines)


def _render_totals(report: dict) -> str:
    """The header's count of objects, broken down so that its parts add up: those of
    the generations (each generation's line counts its own), the rendezvous records,
    and the rest (listed below the generations)."""
    total, in_gens, rdzv = (report["total_objects"], report["generation_objects"],
                            report["rdzv"])
    other = total - in_gens - rdzv["records"]
    return (f"storage: {total} objects, {human_bytes(report['total_bytes'])} in all: "
            f"{in_gens} in {len(report['generations'])} generation(s), "
            f"{rdzv['records']} rendezvous records of {rdzv['namespaces']} job(s) "
            f"({rdzv['announcements']} announcements, {rdzv['join_records']} join records, "
            f"{human_bytes(rdzv['bytes'])})"
            + (f", {other} other (temp files, probes, elastic jobs, foreign: below)"
               if other else ""))


def _job_name(job: str | None) -> str:
    return f"job {job}" if job is not None else "the job without an id"


def _render_job(job: dict) -> list[str]:
    """One job namespace: its announcements, waiting claims and objections."""
    newest = f" (newest {job['newest']})" if job["newest"] is not None else ""
    lines = [f"{_job_name(job['job'])} ({job['namespace']}/): "
             f"{len(job['announcements'])} announcement(s){newest}, "
             f"{job['join_records']} claims, {human_bytes(job['bytes'])}"]
    if job["key_file"]:  # the directory is the user's key directory (--json: the path)
        lines.append(f"  key file {os.path.basename(job['key_file'])}: "
                     f"{job['launcher']['state']}")
    waiting = job["unconsumed_joins"]
    if waiting:
        lines.append(f"  claims newer than its newest announcement (ranks waiting for "
                     f"rank 0 to announce, or that gave up): ranks {sorted(map(int, waiting))}")
    for o in job["objections"]:
        by = (f" by claim {o['by_attempt']} (pid {o.get('pid')} on {o.get('host')})"
              if o.get("by_attempt") is not None else "")
        lines.append(f"  OBJECTION rank {o['rank']} claim {o['attempt']}{by}: two processes "
                     "claimed this rank" + (f"  [{o['trust']}: {o['problem']}]"
                                            if o.get("problem") else ""))
    bare = job["announced_without_data"]
    if bare:
        lines.append(f"  announced generations with no data left (collected, or a world of "
                     f"one): {_ranges(bare)}")
    if job["untrusted_announcements"]:
        lines.append(f"  announcements it cannot verify: generation(s) "
                     f"{_ranges(job['untrusted_announcements'])}")
    return lines


def _render_irregular(entries: list[dict]) -> list[str]:
    """Links, FIFOs, sockets, devices: ferrosync never writes them, so someone planted
    them; the operator should know, and remove them by hand."""
    if not entries:
        return []
    lines = ["", f"NOT REGULAR FILES (never followed or opened; left alone by every tool, "
             f"remove them by hand after finding out who put them there): {len(entries)}"]
    lines.extend(f"  {e['key']}  ({e['kind']})" for e in entries[:20])
    if len(entries) > 20:
        lines.append(f"  ... and {len(entries) - 20} more (see --json)")
    return lines


def _render_generation(gen: dict) -> list[str]:
    lines = [f"generation {gen['generation']}  {gen['prefix']}  {gen['status'].upper()}  "
             + (f"{_job_name(gen['job'])}  " if gen["namespace"] else "")
             + f"world {gen['world_size']}  {gen['objects']} objects  "
             f"{human_bytes(gen['bytes'])}"
             + ("" if gen["announced"] else "  (no announcement)")]
    if gen["also_named_by"]:
        lines.append(f"  ALSO NAMED by announcements in {', '.join(gen['also_named_by'])} "
                     "(copied or forged records)")
    ann = gen.get("announcement")
    if ann:
        age = f", {ann['wall_age_s']:g} s ago by its clock" if ann["wall_age_s"] is not None \
            else ""
        lines.append(f"  announced by pid {ann['pid']} on {ann['host']}{age}")
        if ann.get("error"):
            lines.append(f"  settings disagreed: {ann['error']}")
        if ann.get("problem"):
            lines.append(f"  announcement {ann['trust']}: {ann['problem']}")
    if gen["last_collective_on_storage"] is not None:
        lines.append(f"  newest collective with objects on storage: "
                     f"{gen['last_collective_on_storage']}")
    if gen["ranks"]:
        lines.append("  rank  state      beat            collective  op            "
                     "host:pid                 hb age")
    for r in gen["ranks"]:
        beat = "-"
        if r.get("beat_last") is not None:
            beat = (f"{r['beat_first']} -> {r['beat_last']}" if r.get("beat_changed")
                    else f"{r['beat_last']} (final)" if r["state"] in ("closed", "aborted")
                    else f"{r['beat_last']} (same)")
        where = f"{r.get('host')}:{r.get('pid')}" if r.get("host") else "-"
        age = f"{r['heartbeat_wall_age_s']:g} s" if r.get("heartbeat_wall_age_s") is not None \
            else "-"
        lines.append(f"  {r['rank']:<5} {r['state']:<10} {beat:<15} "
                     f"{_dash(r.get('collective')):<11} {_dash(r.get('op')):<13} "
                     f"{where:<24} {age}")
        if r.get("problem"):
            lines.append(f"        {r['problem']}")
    prog = gen["progress"]
    if prog is not None:
        lines.append(f"  progress: collective {prog['from']} -> {prog['to']} in "
                     f"{prog['seconds']:.1f} s" + ("  (STALLED)" if prog["stalled"] else ""))
        if prog["stalled"]:
            lines.extend(_since(gen["ranks"]))
    if gen["stragglers"]:
        lines.append(f"  stragglers (the others wait for them): ranks {gen['stragglers']}")
    req = gen.get("storage_requests")
    if req:
        cost, so_far = req["request_cost_per_hour"], req["request_cost_so_far"]
        lines.append(f"  {req.get('requests_are', 'storage requests')}: "
                     f"{req['requests_so_far']:,} so far"
                     + (f" (${so_far:,.4f})" if so_far is not None else "")
                     + f", {req['requests_per_hour']:,.0f}/hour"
                     + (f" (${cost:,.4f}/hour)" if cost is not None else "")
                     + f" over {req['ranks']} ranks since they connected"
                     + (", at S3 list prices" if cost is not None else ""))
    for a in gen["aborts"]:
        where = f" at collective {a['collective']}" if a.get("collective") is not None else ""
        lines.append(f"  ABORT rank {a['rank']}{where}: {a['description']}"
                     + (f"  [{a['trust']}: {a['problem']}]" if a.get("problem") else ""))
    if gen["temp_files"]:
        lines.append(f"  temp files: {len(gen['temp_files'])} (a killed writer's, or one "
                     "being written)")
    for obj in gen.get("object_list", []):
        head = obj.get("header")
        detail = ""
        if isinstance(head, dict):
            detail = (f"  {head['kind']} rank {head['rank']} collective {head['collective']} "
                      f"slice {head['slice']}/{head['nslices']} count {head['count']} "
                      f"weight {head['weight']:g}"
                      + ("" if head["size_matches"] else "  SIZE MISMATCH"))
        elif head:
            detail = f"  {head}"
        lines.append(f"    {obj['key']}  {human_bytes(obj['size'])}{detail}")
    return lines


def _since(ranks: list[dict]) -> list[str]:
    """Since when each live rank of a stalled generation has been in its collective (its
    own clock against ours: a hint, like hb age)."""
    return [f"  rank {r['rank']} entered collective {r['collective']} ({r.get('op')}) "
            f"{r['collective_wall_age_s']:g} s ago by its clock"
            for r in ranks if r["state"] == "live" and r.get("collective_wall_age_s")
            is not None]


def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    parts, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            parts.append(f"{start}-{n}" if n != start else f"{n}")
            start = None
    return ", ".join(parts)


def _dash(value) -> str:
    return "-" if value is None else str(value)


def run(storage: Storage, keys: JobKeys, window: float, *, as_json: bool,
        objects: bool) -> int:
    report = build_report(storage, keys, window, objects)
    print(json.dumps(report, indent=2, sort_keys=True) if as_json else render(report))
    return 0
