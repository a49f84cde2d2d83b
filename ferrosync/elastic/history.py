"""The membership history of an elastic job, kept for its whole life and bounded in size.

The writer of a roster that changes the membership folds the change into the compacted
record ``history.{round}`` (the last ``KEEP`` changes in full, older ones counted); a
change whose writer died is rebuilt by the next one from the rosters' chain. The
record, its cost and what a reader shows: docs/elastic.md#inspecting-an-elastic-job.
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
