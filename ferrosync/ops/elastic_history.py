"""Membership history of the elastic jobs at a location, for ``ferrosync inspect``.

Shows the job's compacted history record (``elastic/history.py``), then what the rosters
still on storage add after it, and how each dropped member went (its last heartbeat:
left, aborted or silent). Read-only: it never writes under an elastic job
(docs/elastic.md#inspecting-an-elastic-job).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ferrosync.elastic.history import EVENTS, checked, count, departure, unrecorded
from ferrosync.errors import ShardCorrupt
from ferrosync.ops.keys import JobKeys
from ferrosync.storage import names
from ferrosync.storage.engines import Storage
from ferrosync.storage.objects import Objects
from ferrosync.storage.wire import job_key

#: history records read at most per job (the newest first): two are kept, more only
#: after a writer died between two requests
HISTORY_READS = 3


@dataclass
class ElasticJob:
    namespace: str
    rosters: dict[int, dict] = field(default_factory=dict)  # round -> roster record
    heartbeats: dict[str, str] = field(default_factory=dict)  # member id -> hb key
    histories: dict[int, str] = field(default_factory=dict)  # round -> history key
    problems: list[str] = field(default_factory=list)
    state_key: str | None = None   # the published state's pointer
    ended_key: str | None = None   # the end marker (``end_job``)


def find_jobs(keys) -> dict[str, ElasticJob]:
    """Group listed keys by elastic namespace: rosters, history records and heartbeats,
    by name only."""
    jobs: dict[str, ElasticJob] = {}
    for key in keys:
        top, _, rest = key.partition("/")
        if not rest or not names.is_elastic_namespace(top):
            continue
        job = jobs.setdefault(top, ElasticJob(top))
        found = names.parse_elastic(rest)
        if found.kind == "elastic_roster":
            job.rosters[found.collective] = {"key": key}
        elif found.kind == "elastic_history":
            job.histories[found.collective] = key
        elif found.kind == "elastic_heartbeat":
            job.heartbeats[found.token] = key
        elif found.kind == "elastic_state_pointer":
            job.state_key = key
        elif found.kind == "elastic_ended":
            job.ended_key = key
    return jobs


def _read(storage: Storage, key: str, secret: bytes | None, problems: list[str]) -> dict | None:
    try:
        # ShardCorrupt when larger than any record; None: deleted since the listing
        return Objects.for_records(storage, key=secret).read_record(key)
    except ShardCorrupt as exc:
        problems.append(f"{key}: {exc.what}")
        return None


def _number(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _history(storage, job: ElasticJob, secret, latest: dict | None) -> dict | None:
    """The newest readable history record: the one the newest roster names first."""
    named = _number(latest.get("last_change")) if latest else None
    order = sorted(job.histories, reverse=True)
    if named in job.histories:
        order.remove(named)
        order.insert(0, named)
    for round_ in order[:HISTORY_READS]:
        record = checked(_read(storage, job.histories[round_], secret, job.problems), round_)
        if record is not None:
            return record
        job.problems.append(f"{job.histories[round_]}: not a history record")
    return None


def _recorded(record: dict) -> list[dict]:
    """The events of a history record's full entries, oldest first."""
    events = []
    for entry in record["recent"]:
        for event in EVENTS:
            listed = entry.get(event)
            for member in listed if isinstance(listed, list) else []:
                if isinstance(member, str):
                    events.append({"round": entry["round"], "member": member, "event": event})
            more = count(entry, event) - (len(listed) if isinstance(listed, list) else 0)
            if more > 0:  # beyond the ids a record lists per change
                events.append({"round": entry["round"], "member": None, "event": event,
                               "count": more})
    return events


def job_history(storage: Storage, job: ElasticJob, keys: JobKeys) -> dict:
    """The job's history (its record, then the rosters still on storage after it), its
    count of changes (the newest roster's) and who is a member now."""
    # each job's records are sealed with a key derived from its secret
    secret = job_key(keys.secret(job.namespace), job.namespace)
    rosters = {}
    for round_, entry in sorted(job.rosters.items()):
        record = _read(storage, entry["key"], secret, job.problems)
        if isinstance(record, dict) and isinstance(record.get("members"), list):
            rosters[round_] = record
    last = rosters[max(rosters)] if rosters else None
    record = _history(storage, job, secret, last)
    events = _recorded(record) if record else []
    held = record["changes"] - unrecorded(record) if record else 0
    after = record["round"] if record else -1
    # then the rosters after the record (all of them without one): round 0 on storage
    # means everyone in it joined then; else the history before the first was pruned
    previous = set() if rosters and min(rosters) == 0 and after < 0 else None
    for round_, roster in rosters.items():
        members = [m for m in roster["members"] if isinstance(m, str)]
        if previous is not None and round_ > after and set(members) != previous:
            held += round_ > 0  # the first roster counts no change
            for m in members:
                if m not in previous:
                    events.append({"round": round_, "member": m, "event": "joined"})
            for m in sorted(previous - set(members)):
                events.append({"round": round_, "member": m,
                               "event": departure(_last_state(storage, job, m, secret))})
        previous = set(members)
    # the job's count, as its members have it (FINAL's membership_changes); rosters
    # written before they counted: the changes found
    changes = _number(last.get("changes")) if last else None
    changes = held if changes is None else changes
    pointer = _read(storage, job.state_key, secret, job.problems) if job.state_key else None
    ended = _read(storage, job.ended_key, secret, job.problems) if job.ended_key else None
    meta = pointer.get("meta") if isinstance(pointer, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    return {
        "namespace": job.namespace,
        "job": job.namespace.partition(".")[2] or None,
        "rounds_on_storage": [min(rosters), max(rosters)] if rosters else None,
        "members": list(last["members"]) if last else [],
        "membership_changes": changes,
        "events": events,
        # the changes before ``events``, compacted in the record (counts per event;
        # ``since``: the round of the oldest), and the changes of the count that
        # neither the record nor the rosters on storage describe
        "earlier": dict(record["older"]) if record else {},
        "unrecorded": max(0, changes - held),
        # the newest published state: its round, and the trainer's step and phase
        "state": None if not isinstance(pointer, dict) else {
            "round": pointer.get("round"), "step": meta.get("step"),
            "phase": meta.get("phase")},
        "ended_at_round": ended.get("round") if isinstance(ended, dict) else None,
        "problems": job.problems,
    }


def _last_state(storage, job: ElasticJob, member: str, secret) -> str | None:
    """The state in ``member``'s last heartbeat, read only for a departure the rosters
    show (the history record says how the others went)."""
    key = job.heartbeats.get(member)
    record = _read(storage, key, secret, job.problems) if key else None
    return record.get("state") if isinstance(record, dict) else None


def elastic_reports(storage: Storage, listed, keys: JobKeys) -> list[dict]:
    """The history of every elastic job among the ``listed`` keys."""
    return [job_history(storage, job, keys) for _, job in sorted(find_jobs(listed).items())]


def render(jobs: list[dict]) -> list[str]:
    lines = []
    for job in jobs:
        span = job["rounds_on_storage"]
        rounds = f"rounds {span[0]}-{span[1]} on storage" if span else "no roster yet"
        lines.append("")
        lines.append(f"elastic job {job['job'] or '(no id)'}  {job['namespace']}/  {rounds}  "
                     f"{len(job['members'])} member(s) now, "
                     f"{job['membership_changes']} change(s)")
        state = job.get("state")
        if state:
            step = f", step {state['step']}" if state.get("step") is not None else ""
            phase = f", {state['phase']}" if state.get("phase") else ""
            lines.append(f"  state published after round {state['round']}{step}{phase}")
        if job.get("ended_at_round") is not None:
            lines.append(f"  ENDED at round {job['ended_at_round']}: later members report, "
                         "nobody joins")
        earlier = job.get("earlier") or {}
        if earlier.get("entries"):
            counted = ", ".join(f"{earlier[e]} {e}" for e in EVENTS if earlier.get(e))
            lines.append(f"  from round {earlier.get('since')}: {earlier['entries']} "
                         f"earlier change(s) compacted ({counted})")
        for e in job["events"][-20:]:
            who = e["member"] if e["member"] is not None else f"{e.get('count')} more"
            lines.append(f"  round {e['round']:<6} {who}  {e['event']}")
        if len(job["events"]) > 20:
            lines.append(f"  ... {len(job['events']) - 20} earlier changes (see --json)")
        if job.get("unrecorded"):
            lines.append(f"  {job['unrecorded']} change(s) not recorded (a roster writer "
                         "stopped before its history record, and its rosters are pruned)")
        for problem in job["problems"]:
            lines.append(f"  problem: {problem}")
    return lines
