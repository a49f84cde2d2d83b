"""The job record and admission: what a member checks before it writes anything, and how
it gets into a roster (docs/elastic.md#joining).

``job`` (the first member's exclusive create: the job's ``spec`` and the settings
``ElasticOptions.shared_settings`` marks shared) is compared before a member writes;
``ended`` makes a later joiner fail at once with ``JobEnded``; ``admit`` appends the
joiner to the join queue and waits for a roster that admits it.
"""

from __future__ import annotations

import json

from ferrosync.core import runtime
from ferrosync.elastic.membership import Roster
from ferrosync.errors import ConfigError, JobEnded, MemberDropped, ShardCorrupt
from ferrosync.storage import names


def check_record(objects, spec: dict | None, settings: dict, defaults: dict,
                 url: str) -> None:
    """Verify the job's record (sealed with the job's key) against this member's
    ``spec`` and shared ``settings`` (``defaults``: each setting's value for a record
    that does not name it); the first member writes it. ``ConfigError`` naming every
    difference, or naming the secret when the record was sealed with another key."""
    name = names.ELASTIC_JOB_RECORD
    path = objects.path_of(name)
    mine = dict(spec or {})
    try:
        json.dumps(mine, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"spec must be plain JSON: {exc}") from None
    raw = objects.storage.read(objects.key_of(name))
    if raw is None:
        objects.storage.makedirs(objects.prefix)
        if objects.put_record(name, {"spec": mine, **settings}, exclusive=True):
            return
        raw = objects.storage.read(objects.key_of(name))  # another member was first
    opened = objects.opened_record(raw)
    if opened.auth in ("forged", "unsigned", "unverifiable"):
        raise ConfigError(
            "the elastic job's record is sealed with another key: this member's "
            "secret differs from the job's" if opened.auth != "unverifiable" else
            "the elastic job's record is sealed with a secret and this member has none",
            path=path, hint="start every member of a job with the job's secret "
            "(FERROSYNC_SECRET), or use another job id")
    record = objects.record_of(raw, name)
    theirs = record.get("spec")
    if not isinstance(theirs, dict):
        raise ShardCorrupt("the elastic job's record holds no spec", path=path,
                           hint="let nothing else write under this URL")
    for setting, value in settings.items():
        if record.get(setting, defaults[setting]) != value:
            raise ConfigError(
                f"this member does not fit the elastic job at {url}: the job runs with "
                f"{setting} {record.get(setting, defaults[setting])!r} (here {value!r})",
                path=path, hint=f"start every member with the same {setting} (or use "
                "another job id)")
    if not theirs or not mine:
        return  # one side states nothing to compare (a plain connect)
    differ = [k for k in sorted(set(theirs) | set(mine)) if theirs.get(k) != mine.get(k)]
    if differ:
        text = "; ".join(f"{k} {theirs.get(k)!r} (here {mine.get(k)!r})" for k in differ)
        raise ConfigError(f"this member does not fit the elastic job at {url}: the job "
                          f"runs with {text}", path=path,
                          hint="start every member with the same model and flags (or use "
                          "another job id / URL)")


def check_ended(objects) -> None:
    """``JobEnded`` if a member marked the job as ended (``mark_ended``)."""
    record = objects.read_record(names.ELASTIC_ENDED)
    if record is not None:
        raise JobEnded(f"the elastic job ended at round {record.get('round')}; there is "
                       "nothing left to join", path=objects.path_of(names.ELASTIC_ENDED),
                       hint="start another job (another job id or URL) to train again")


def mark_ended(objects, round_: int, member_id: str) -> None:
    """Mark the job as ended at ``round_`` (the first mark wins; never removed)."""
    objects.put_record(names.ELASTIC_ENDED, {"round": round_, "member": member_id},
                       exclusive=True)


def admit(objects, rosters, agreement, member_id: str, deadline: float) -> Roster:
    """Queue ``member_id`` in the join queue and wait for a roster that admits it
    (``SyncTimeout`` after ``deadline``; ``JobEnded`` as soon as the job is marked
    ended; ``MemberDropped`` if the members skipped its entry)."""
    check_ended(objects)
    prev = rosters.newest(deadline)
    entry = rosters.claim(member_id, prev.join_next, deadline)

    def next_round() -> Roster | None:
        """The next roster if it admits this member; None: wait for the one after."""
        nonlocal prev
        # the joiners ahead are read only if every member is gone (rounds.is_checker):
        # read on every connect, they cost O(queue) GETs per joiner
        roster = agreement.wait(
            prev.round + 1, prev, list(prev.members), deadline,
            on_look=lambda: check_ended(objects),
            queued=len(prev.members) + entry - prev.join_next + 1,
            ahead=lambda start=prev.join_next: rosters.entries(start, entry, deadline))
        if member_id in roster.members:
            return roster
        if roster.join_next > entry:
            raise MemberDropped(
                f"the members skipped this member's join entry {entry} in round "
                f"{roster.round} (its heartbeat looked dead to them)",
                path=objects.path_of(names.elastic_join(entry)),
                hint="check that the heartbeat can be written, then connect again")
        prev = roster
        return None

    # each round's wait ends by ``deadline`` on its own: no sleep between rounds
    return runtime.wait(next_round, deadline=runtime.FOREVER, poll=None,
                        runtime=objects.runtime)
