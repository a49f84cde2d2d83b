"""Membership history of the elastic jobs at a location, for ``ferrosync inspect``.

An elastic job (``ferrosync/elastic``) keeps one roster per round under ``el`` or
``el.{job}``, each naming the members that contributed to the round and the members
of the next one; roster writers keep the last ``ROSTER_RETENTION`` rounds. Comparing
consecutive rosters says who joined and who was dropped at which round; a dropped
member's last heartbeat says whether it left (a graceful close), aborted, or went
silent (died, or was paused past ``heartbeat_timeout``). Read-only: the tool never
writes under an elastic job.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import names
from ..errors import ShardCorrupt
from ..storage import Storage
from ..wire import decode_record, job_key
from .keys import JobKeys


@dataclass
class ElasticJob:
    namespace: str
    rosters: dict[int, dict] = field(default_factory=dict)  # round -> roster record
    heartbeats: dict[str, str] = field(default_factory=dict)  # member id -> hb key
    problems: list[str] = field(default_factory=list)
    state_key: str | None = None   # the published state's pointer
    ended_key: str | None = None   # the end marker (``end_job``)


def find_jobs(keys) -> dict[str, ElasticJob]:
    """Group listed keys by elastic namespace: rosters and heartbeats, by name only."""
    jobs: dict[str, ElasticJob] = {}
    for key in keys:
        top, _, rest = key.partition("/")
        if not rest or "/" in rest or not names.is_elastic_namespace(top):
            continue
        job = jobs.setdefault(top, ElasticJob(top))
        head, _, tail = rest.partition(".")
        if tail == "roster" and head.startswith("r") and head[1:].isdigit():
            job.rosters[int(head[1:])] = {"key": key}
        elif head == "hb" and names.is_member_id(tail):
            job.heartbeats[tail] = key
        elif rest == names.ELASTIC_STATE_POINTER:
            job.state_key = key
        elif rest == names.ELASTIC_ENDED:
            job.ended_key = key
    return jobs


def _read(storage: Storage, key: str, secret: bytes | None, problems: list[str]) -> dict | None:
    try:
        raw = storage.read(key)  # ShardCorrupt when larger than any record
        if raw is None:
            return None  # deleted since the listing
        return decode_record(raw, secret, path=storage.path_of(key))
    except ShardCorrupt as exc:
        problems.append(f"{key}: {exc.what}")
        return None


def job_history(storage: Storage, job: ElasticJob, keys: JobKeys) -> dict:
    """The job's rounds still on storage, and who joined or was dropped at each."""
    # each job's records are sealed with a key derived from its secret
    secret = job_key(keys.secret(job.namespace), job.namespace)
    rosters = {}
    for round_, entry in sorted(job.rosters.items()):
        record = _read(storage, entry["key"], secret, job.problems)
        if isinstance(record, dict) and isinstance(record.get("members"), list):
            rosters[round_] = record
    states = {}
    for member, key in job.heartbeats.items():
        record = _read(storage, key, secret, job.problems)
        if isinstance(record, dict):
            states[member] = record.get("state")
    events = []
    # the job's first roster on storage: everyone in it joined then (round 0), or the
    # history before it was pruned (the roster writers keep a window of rounds)
    previous = set() if rosters and min(rosters) == 0 else None
    for round_, record in rosters.items():
        members = [m for m in record["members"] if isinstance(m, str)]
        if previous is not None:
            before, now = previous, set(members)
            for m in members:
                if m not in before:
                    events.append({"round": round_, "member": m, "event": "joined"})
            for m in sorted(before - now):
                how = {"left": "left", "aborted": "aborted"}.get(states.get(m), "died")
                events.append({"round": round_, "member": m, "event": how})
        previous = set(members)
    last = rosters[max(rosters)] if rosters else None
    pointer = _read(storage, job.state_key, secret, job.problems) if job.state_key else None
    ended = _read(storage, job.ended_key, secret, job.problems) if job.ended_key else None
    meta = pointer.get("meta") if isinstance(pointer, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    return {
        "namespace": job.namespace,
        "job": job.namespace.partition(".")[2] or None,
        "rounds_on_storage": [min(rosters), max(rosters)] if rosters else None,
        "members": list(last["members"]) if last else [],
        "membership_changes": len(events),
        "events": events,
        # the newest published state: its round, and the trainer's step and phase
        "state": None if not isinstance(pointer, dict) else {
            "round": pointer.get("round"), "step": meta.get("step"),
            "phase": meta.get("phase")},
        "ended_at_round": ended.get("round") if isinstance(ended, dict) else None,
        "problems": job.problems,
    }


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
        for e in job["events"][-20:]:
            lines.append(f"  round {e['round']:<6} {e['member']}  {e['event']}")
        if len(job["events"]) > 20:
            lines.append(f"  ... {len(job['events']) - 20} earlier changes (see --json)")
        for problem in job["problems"]:
            lines.append(f"  problem: {problem}")
    return lines
