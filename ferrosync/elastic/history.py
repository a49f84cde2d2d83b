"""The membership history of an elastic job, kept for its whole life and bounded in
size (docs/elastic.md#inspecting-an-elastic-job).

Rosters are deleted ``ROSTER_RETENTION`` rounds after they are written, so they tell
only the last rounds' story. The history outlives them: the writer of a roster that
changes the membership (someone joined, left, was dropped or refused) folds that
change into the job's compacted history record ``history.{round}`` and creates it
(an exclusive create: sealed, MAC before parse, bounded like every record). A round
without a change costs nothing; a change costs one GET (the previous record), one
PUT and one batch DELETE (the record before the previous one: two are kept, so a
reader racing the delete still finds one), plus one heartbeat GET per departed
member this writer did not judge itself (to say how it went).

**The record**: the last ``KEEP`` changes in full (``recent``: the round, the change's
effect on the job's count, and per event the member ids, at most ``IDS`` of each,
then a count), the older ones as counts per event (``older``), and ``changes``, the
job's count as the roster says it. Whatever the record does not hold (see below) is
``changes`` minus what it accounts for: a reader shows it as unrecorded.

**Writers change and die.** Each roster names the round of the latest change
(``last_change``) and of the one before (``change_before``), so the writer of the
next change finds the record to fold without listing, whoever wrote it. A writer that
dies between its roster and its record leaves no record for its change: the next
change's writer rebuilds that change from its two rosters (if they are still kept;
else the change goes unrecorded) and folds it into the record before it, found
through the rosters' chain (up to ``WALK`` records back, several writers having died
in a row; past that, or where the chain is pruned, it starts a new record). What a
record lacks shows as its count minus what it accounts for: the roster's count itself
is never lost (rosters are written first), so ``ferrosync inspect`` counts changes as
the members do.
"""

from __future__ import annotations

from ferrosync.errors import ShardCorrupt
from ferrosync.storage import names

#: changes kept in full in the record (older ones are counted per event)
KEEP = 64
#: member ids listed per event of one change (beyond: a count): a record holds at most
#: KEEP x len(EVENTS) x IDS ids (about 100 KB), far below a record's limit
IDS = 16
#: records a writer looks back through for the newest one (each missing one: a writer
#: that died between its roster and its record)
WALK = 4
#: the events of a change, in the order they are shown
EVENTS = ("joined", "left", "aborted", "died", "refused")
#: a heartbeat's final state -> the event of a departure (anything else: silent)
_DEPARTED = {"left": "left", "aborted": "aborted"}


def departure(state: str | None) -> str:
    """The event of a member that left the roster, from its heartbeat's last state."""
    return _DEPARTED.get(state, "died")


def change(prev, roster, how) -> dict | None:
    """The history entry of ``roster`` after ``prev`` (None: the membership did not
    change). ``how(member)``: the final heartbeat state of a departed member."""
    before, after = set(prev.members), set(roster.members)
    refused = set(roster.refused)
    ids = {"joined": [m for m in roster.members if m not in before],
           "refused": list(roster.refused)}
    for member in prev.members:
        if member not in after and member not in refused:
            ids.setdefault(departure(how(member)), []).append(member)
    if not any(ids.values()):
        return None
    entry = {"round": roster.round, "delta": roster.changes - prev.changes}
    for event in EVENTS:
        members = ids.get(event) or []
        if members:
            entry[event] = members[:IDS]
            if len(members) > IDS:
                entry[event + "_more"] = len(members) - IDS
    return entry


def count(entry: dict, event: str) -> int:
    """How many members ``entry`` lists under ``event`` (listed and counted)."""
    listed = entry.get(event)
    more = entry.get(event + "_more", 0)
    return (len(listed) if isinstance(listed, list) else 0) + \
        (more if isinstance(more, int) and not isinstance(more, bool) else 0)


def fold(base: dict | None, entries: list[dict], changes: int, round_: int,
         base_round: int | None) -> dict:
    """The record after ``base`` with ``entries`` appended: the last ``KEEP`` in full,
    the rest counted; ``changes`` is the job's count at ``round_``."""
    recent = list(base["recent"]) if base else []
    older = dict(base["older"]) if base else {}
    recent.extend(entries)
    while len(recent) > KEEP:
        gone = recent.pop(0)
        older["changes"] = older.get("changes", 0) + gone.get("delta", 0)
        older["entries"] = older.get("entries", 0) + 1
        for event in EVENTS:
            if count(gone, event):
                older[event] = older.get(event, 0) + count(gone, event)
        older.setdefault("since", gone["round"])
    return {"round": round_, "changes": changes, "base": base_round, "older": older,
            "recent": recent}


def unrecorded(record: dict) -> int:
    """The changes of the job's count that ``record`` holds no entry for."""
    held = record["older"].get("changes", 0) + sum(e.get("delta", 0)
                                                  for e in record["recent"])
    return max(0, record["changes"] - held)


def checked(record, round_: int) -> dict | None:
    """``record`` if it is a history record of ``round_`` (the shape this module
    writes), else None."""
    def number(v):
        return isinstance(v, int) and not isinstance(v, bool)

    if not isinstance(record, dict) or record.get("round") != round_ or \
            not number(record.get("changes")) or not isinstance(record.get("older"), dict) \
            or not isinstance(record.get("recent"), list) or len(record["recent"]) > KEEP:
        return None
    if not all(isinstance(e, dict) and number(e.get("round")) and number(e.get("delta", 0))
               for e in record["recent"]):
        return None
    if not all(number(v) for v in record["older"].values()):
        return None
    base = record.get("base")
    return record if base is None or number(base) else None


class History:
    """Reads and writes the history records of one job (``objects``: its object layer;
    ``rosters``: its ``membership.Rosters``, to rebuild a change whose writer died)."""

    def __init__(self, objects, rosters) -> None:
        self._objects = objects
        self._rosters = rosters

    def read(self, round_: int | None) -> dict | None:
        """The record of the change at ``round_`` (None: none, or not one)."""
        if round_ is None:
            return None
        try:
            return checked(self._objects.read_record(names.elastic_history(round_)), round_)
        except ShardCorrupt:
            return None  # not ours: the next record starts over (the count says so)

    def append(self, prev, roster, how) -> None:
        """Record ``roster``'s change after ``prev`` (its writer, right after creating it;
        nothing when the membership did not change)."""
        entry = change(prev, roster, how)
        if entry is None:
            return
        entries, base = [entry], None
        at, before = prev.last_change, prev.change_before
        for _ in range(WALK):
            if at is None:
                break
            base = self.read(at)
            if base is not None:
                break
            # the writer of the change at ``at`` died before its record: rebuild that
            # change from its rosters while they are kept (else the count says it is
            # unrecorded), and look for the record before it
            missed, at_roster = self._rebuild(at, how)
            if missed is not None:
                entries.insert(0, missed)
            at, before = (at_roster.change_before if at_roster else before), None
        record = fold(base, entries, roster.changes, roster.round,
                      base["round"] if base else None)
        self._objects.put_record(names.elastic_history(roster.round), record, exclusive=True)
        if base is not None and base.get("base") is not None:
            # two records stay: a reader racing this delete still finds one
            self._objects.storage.delete(
                [self._objects.key_of(names.elastic_history(base["base"]))])

    def _rebuild(self, round_: int, how):
        """(the entry of the change at ``round_``, its roster), from the rosters kept."""
        at = self._rosters.read(round_)
        before = self._rosters.read(round_ - 1) if at is not None else None
        return (change(before, at, how) if before is not None else None), at
