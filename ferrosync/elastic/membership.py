"""Membership of an elastic job, agreed through the store alone (docs/elastic.md#rounds).

``heartbeat`` is the one heartbeat writer (``hb.{id}``: ``alive``, then ``left`` or
``aborted``); ``HeartbeatWatch`` says whether another member is gone, by the freeze-aware
rule of docs/design.md#liveness; ``Roster`` is one round's membership and ``Rosters``
reads rosters and join entries and creates the next roster exclusively (first writer
wins). Every record goes through the job's object layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ferrosync.core import runtime as runtimes
from ferrosync.elastic.history import History
from ferrosync.errors import ShardCorrupt, SyncTimeout
from ferrosync.storage import names
from ferrosync.storage.liveness import PROCESS_CLOCK, Heartbeat, SilenceClocks
from ferrosync.storage.rendezvous import first_missing

ALIVE, LEFT, ABORTED = "alive", "left", "aborted"
_STATES = (ALIVE, LEFT, ABORTED)

#: rosters older than this many rounds are deleted by the roster writer; a joiner
#: finds a recent one through the ``latest`` hint, which is at most a few rounds old
ROSTER_RETENTION = 64


def heartbeat(objects, member_id: str, interval: float) -> Heartbeat:
    """The heartbeat of member ``member_id`` in the job of ``objects`` (its namespace and
    key): ``liveness.Heartbeat`` writing ``p{xx}/hb.{id}`` with the member's id and the
    elastic states (``alive``, ``left``, ``aborted``)."""
    runtime = objects.runtime
    return Heartbeat(objects.storage, objects.prefix, 0, interval, objects.key, 0,
                     name=names.elastic_heartbeat(member_id), fields={"id": member_id},
                     running=ALIVE, clock=runtime.process_clock, runtime=runtime)


class HeartbeatWatch:
    """Whether other members are alive, judged from their heartbeats with the one
    liveness rule (``liveness.SilenceClocks``).

    A member whose heartbeat was never seen counts as silent from the first look, so
    a member that died before its first beat is declared gone after ``timeout`` too.
    What the latest reads say short of a judgement (``fresh``: proven running now;
    ``overdue``: a beat is missing; ``next_change``: when a judgement can change
    without a beat) tells a waiting member whose heartbeats to read, and when
    (``rounds.Agreement``), so that members that die together start their silence
    clocks together.
    """

    def __init__(self, objects, timeout: float, interval: float) -> None:
        self._objects = objects
        self._timeout = timeout
        self._clock = objects.runtime.process_clock or PROCESS_CLOCK
        self._silence = SilenceClocks(timeout, interval, clock=self._clock)
        # member ids this process has judged gone, by job namespace (the runtime's): a
        # member never comes back under its id (one that was dropped while alive rejoins
        # under a new one), so the judgement outlives the member that made it (a newcomer
        # that connects again after its state's publisher died knows at once that the
        # job's old members are gone)
        self.gone = objects.runtime.gone.setdefault(
            objects.storage.path_of(objects.prefix), set())
        self._how: dict[str, str] = {}  # member -> the state this HeartbeatWatch judged it gone in

    def state(self, member_id: str) -> str:
        """``alive``, or ``left``/``aborted`` (said so), or ``silent`` (timed out);
        a member once judged gone stays gone (and is not read again)."""
        if member_id in self.gone:
            return "gone"
        name = names.elastic_heartbeat(member_id)
        record = self._objects.read_record(name)
        beat, state = None, ALIVE
        if record is not None:
            if record.get("id") != member_id or record.get("state") not in _STATES:
                raise ShardCorrupt(f"heartbeat record of member {member_id} is not one",
                                   path=self._objects.path_of(name),
                                   hint="let nothing else write under this URL")
            beat, state = record.get("beat"), record["state"]
        if state == ALIVE and self._silence.silent(member_id, beat, self._clock.tick()):
            state = "silent"
        if state != ALIVE:
            self.gone.add(member_id)
            self._silence.forget(member_id)
            self._how[member_id] = state
        return state

    def how(self, member_id: str) -> str | None:
        """How a member that left the roster went: the state it was judged gone in here
        (``left``, ``aborted``, ``silent``), else its heartbeat's last state (read)."""
        if member_id not in self._how:
            try:
                record = self._objects.read_record(names.elastic_heartbeat(member_id))
            except ShardCorrupt:
                record = None
            state = record.get("state") if isinstance(record, dict) and \
                record.get("id") == member_id else None
            self._how[member_id] = state if state in _STATES else "silent"
        return self._how[member_id]

    def alive(self, member_id: str) -> bool:
        return self.state(member_id) == ALIVE

    def fresh(self, member_id: str) -> bool:
        return self._silence.fresh(member_id)

    def seen(self, member_id: str) -> bool:
        """Whether this watch read ``member_id``'s heartbeat before (or judged it gone)."""
        return member_id in self.gone or self._silence.seen(member_id)

    def overdue(self, member_id: str) -> bool:
        return member_id not in self.gone and \
            self._silence.overdue(member_id, self._clock.now())

    def next_change(self, fresh_of=(), since: float | None = None) -> float | None:
        """When (``time.monotonic``) a watched member can next be judged gone, or one of
        ``fresh_of`` stop being fresh: after ``since``, when the latest look began
        (default now), so possibly past (``SilenceClocks.next_change``)."""
        return self._silence.next_change(self._clock.now() if since is None else since,
                                         fresh_of)


@dataclass(frozen=True)
class Roster:
    """The agreement of round ``round``.

    ``contributors``: whose contributions round ``round`` sums, in this order.
    ``members``: who takes part in the next round (the contributors not known to be
    gone, then the admitted joiners); a member's rank is its index here.
    ``join_next``: the first join entry not yet consumed. ``changes``: the rounds
    whose ``members`` differed from the previous round's, over the job's life (the
    first roster counts none; an admission undone by a refusal counts none): the
    job's count, the same on every member. ``admitted_only``: this roster counted a
    change only because it admitted joiners. ``refused``: newcomers whose first
    contribution did not fit the round's layout (left out of ``contributors`` and
    ``members``), and ``layout`` the checker's layout record of that round, so each
    can be told what differs. ``last_change``: the latest round (this one included)
    whose roster changed the membership, and ``change_before`` the one before it (None:
    none yet): where the job's history records are (``history.py``).
    """

    round: int
    contributors: tuple[str, ...]
    members: tuple[str, ...]
    join_next: int
    changes: int = 0
    refused: tuple[str, ...] = ()
    layout: dict | None = None
    admitted_only: bool = False
    last_change: int | None = None
    change_before: int | None = None

    @property
    def newcomers(self) -> frozenset:
        """The members this roster admitted (none are "new" in a founding roster)."""
        if self.founding:
            return frozenset()
        return frozenset(self.members) - frozenset(self.contributors)

    def changes_after(self, prev: Roster) -> int:
        """The job's count of membership changes with this roster after ``prev``.

        A refusal undoes the admission it refuses: when ``prev`` counted a change only
        for its joiners and this roster refuses all of them, that change is taken back,
        and leaving them out is no change of its own."""
        if prev.round < 0:
            return 0
        before = tuple(m for m in prev.members if m not in self.refused)
        count = prev.changes + (self.members != before)
        if self.refused and prev.admitted_only and prev.newcomers <= set(self.refused):
            count -= 1
        return count

    def chained(self, prev: Roster) -> Roster:
        """This roster with ``last_change``/``change_before`` following ``prev``'s."""
        if self.members != prev.members or self.refused:
            return replace(self, last_change=self.round, change_before=prev.last_change)
        return replace(self, last_change=prev.last_change, change_before=prev.change_before)

    @property
    def founding(self) -> bool:
        """No member of the next round contributed to this one: they start (or restart,
        after every member was lost) the job."""
        return not set(self.members) & set(self.contributors)

    def record(self) -> dict:
        record = {"round": self.round, "contributors": list(self.contributors),
                  "members": list(self.members), "join_next": self.join_next,
                  "changes": self.changes}
        if self.refused:
            record.update(refused=list(self.refused), layout=self.layout)
        if self.admitted_only:
            record["admitted_only"] = True
        for name in ("last_change", "change_before"):
            if getattr(self, name) is not None:
                record[name] = getattr(self, name)
        return record

    @classmethod
    def from_record(cls, record: dict, round_: int, path: str) -> Roster:
        try:
            layout = record.get("layout")
            roster = cls(int(record["round"]), tuple(record["contributors"]),
                         tuple(record["members"]), int(record["join_next"]),
                         int(record.get("changes", 0)), tuple(record.get("refused", ())),
                         layout if isinstance(layout, dict) else None,
                         record.get("admitted_only") is True,
                         *(_round_or_none(record.get(k), round_)
                           for k in ("last_change", "change_before")))
            ok = (roster.round == round_ and roster.join_next >= 0 and roster.changes >= 0
                  and all(names.is_member_id(m) for m in
                          roster.members + roster.contributors + roster.refused)
                  and len(set(roster.members)) == len(roster.members))
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ShardCorrupt(f"roster of round {round_} is malformed", path=path,
                               hint="let nothing else write under this URL")
        return roster


def _round_or_none(value, round_: int) -> int | None:
    """``value`` if it is a round at or before ``round_``, None if absent; else
    ``ValueError`` (a malformed roster)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= round_:
        raise ValueError(value)
    return value


#: the roster before the first: nobody, and the join queue starts at entry 0
EMPTY = Roster(-1, (), (), 0)


class Rosters:
    """Reads and writes rosters, join entries and the ``latest`` hint (``objects``: the
    job's object layer)."""

    def __init__(self, objects) -> None:
        self._objects = objects
        self._joins: dict[int, str] = {}  # entry -> member id (entries never change)
        self.history = History(objects, self)

    def path_of(self, name: str) -> str:
        return self._objects.path_of(name)

    def read(self, round_: int) -> Roster | None:
        if round_ < 0:
            return EMPTY
        name = names.elastic_roster(round_)
        record = self._objects.read_record(name)
        if record is None:
            return None
        return Roster.from_record(record, round_, self._objects.path_of(name))

    def create(self, roster: Roster, prev: Roster | None = None, how=None) -> Roster:
        """Publish ``roster`` unless another member was first; return the winner. Given
        the roster before it (``prev``, which ``roster`` is ``chained`` to), the winner
        records a membership change in the job's history (``how(member)``: a departed
        member's final heartbeat state)."""
        objects = self._objects
        if not objects.put_record(names.elastic_roster(roster.round), roster.record(),
                                  exclusive=True):
            return self.read(roster.round)
        if prev is not None:
            self.history.append(prev, roster, how)
        # a hint only: a joiner probes upward from it, so a stale or raced value costs
        # a few reads, never correctness
        objects.put_record(names.ELASTIC_LATEST, {"round": roster.round})
        old = roster.round - ROSTER_RETENTION
        if old >= 0:
            objects.storage.delete([objects.key_of(names.elastic_roster(old))])
        return roster

    def latest_hint(self) -> int:
        record = self._objects.read_record(names.ELASTIC_LATEST)
        if record is None:
            return -1
        value = record.get("round")
        return value if isinstance(value, int) and not isinstance(value, bool) else -1

    def newest(self, deadline: float) -> Roster:
        """The newest roster: from the hint, probing upward (no listing)."""
        hints = []

        def attempt():
            hints.append(self.latest_hint())
            return self.read(hints[-1])

        def expired():
            # the hinted roster stays deleted (the hint went stale by ROSTER_RETENTION
            # rounds between two reads, and nobody moves it on)
            return SyncTimeout(
                f"the roster of round {hints[-1]} named by the 'latest' hint stays missing",
                path=self._objects.path_of(names.ELASTIC_LATEST),
                hint="roster writers may have stopped mid-update; retry the connect")

        roster = self._objects.wait_for(attempt, deadline=deadline, expired=expired,
                                        poll=(0.01, 0.01))
        while (following := self.read(roster.round + 1)) is not None:
            roster = following
        return roster

    def join_entry(self, n: int) -> str | None:
        """The member id of join entry ``n``, or None if nobody claimed it yet."""
        if n in self._joins:
            return self._joins[n]
        name = names.elastic_join(n)
        record = self._objects.read_record(name)
        if record is None:
            return None
        member = record.get("id")
        if not names.is_member_id(member):
            raise ShardCorrupt(f"join entry {n} is malformed", path=self._objects.path_of(name),
                               hint="let nothing else write under this URL")
        self._joins[n] = member
        return member

    def entries(self, start: int, end: int, deadline: float):
        """The member ids of the claimed join entries ``start`` to ``end - 1``, in order,
        each read as the caller gets to it (``SyncTimeout`` once past ``deadline``)."""
        for k in range(start, end):
            if runtimes.passed(deadline, self._objects.runtime):
                raise SyncTimeout(
                    f"reading the {end - start} join entries ahead of this "
                    "member took longer than its timeout",
                    path=self._objects.path_of(names.elastic_join(k)),
                    hint="let nothing else write under this URL, or raise timeout")
            member = self.join_entry(k)
            if member is not None:
                yield member

    def claim(self, member_id: str, start: int, deadline: float) -> int:
        """Append ``member_id`` to the join queue: the first free entry from ``start``,
        found by galloping probes and bisection (entries are never removed, so the
        taken ones are a prefix: logarithmic in the queue's length, however many
        entries something planted); an entry taken meanwhile moves on to the next free
        one. ``SyncTimeout`` once past ``deadline``."""
        objects = self._objects
        n = start
        while True:
            n = first_missing(objects.storage,
                              lambda i: objects.key_of(names.elastic_join(i)), n)
            if objects.put_record(names.elastic_join(n), {"id": member_id}, exclusive=True):
                self._joins[n] = member_id
                return n
            n += 1
            if runtimes.passed(deadline, objects.runtime):
                raise SyncTimeout(
                    f"no free entry of the join queue found in time (the last tried: {n})",
                    path=objects.path_of(names.elastic_join(n)),
                    hint="many members join at once, or something fills the queue: let "
                    "nothing else write under this URL, or raise timeout")

