"""Agreeing on the roster of one round (docs/elastic.md#rounds).

The roster of round r is complete when every member of roster r-1 contributed or is
gone and at least ``min_ranks`` members (joiners included) are there; it is written
with an exclusive create, so all members agree although each judged liveness alone.
Only the first live member of the previous roster checks completeness
(``Agreement.is_checker``, ``Agreement.complete``); waiting below ``min_ranks`` is logged
every ``PROGRESS_EVERY`` seconds.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import replace

from ferrosync.elastic.membership import ALIVE, ROSTER_RETENTION, HeartbeatWatch, Roster, Rosters
from ferrosync.elastic.plan import TREE_FROM
from ferrosync.errors import MemberDropped, ShardCorrupt, SyncTimeout
from ferrosync.storage import names
from ferrosync.storage.engines import object_exists

#: the most contribution bytes the checker keeps from its existence checks (S3)
KEEP_BUDGET = 256 << 20
#: contribution reads the checker has in flight on an object store: one after the
#: other, W markers cost W round trips (simulated S3, ~20 ms median / 200 ms p99 GETs:
#: 2.0 s at W = 50, 32.9 s at W = 1,000; 64 at a time 0.3 s and 1.3 s, 128 and 256 no
#: better: the slowest reads' tail remains), and one checker's ~2,000 GET/s stay below
#: a prefix's 5,500; each costs a thread (``Runtime.map``). A local disk reads one at a
#: time: an open there is cheaper than a thread.
READ_WIDTH = 64
#: the contributions the cheap pass reads at once first, and the factor by which the
#: next window grows while all of one are present: the pass stops at the first missing
#: one, so a poll while many members have not contributed yet costs a few reads, not
#: one per member, and once all have, W = 1,000 takes three windows (8, 64, the rest),
#: each as slow as its slowest read
FIRST_WINDOW = 8
WINDOW_GROWTH = 8
#: a waiting member checks every this many looks (one per heartbeat interval) whether
#: its round's roster was already pruned; rare, because each check costs two GETs
PRUNED_CHECK_EVERY = 4
#: join entries the checker reads, and joiners' heartbeats it judges, at a time
JOIN_READS = 16
#: seconds between two progress lines of one wait below ``min_ranks``
PROGRESS_EVERY = 30.0

#: where an elastic member says what it waits for (the trainer shows its INFO lines)
log = logging.getLogger("ferrosync.elastic")


def windows(items, first: int, growth: int = WINDOW_GROWTH):
    """``items`` in consecutive batches, ``first`` long and each next ``growth`` times
    longer: a caller that reads a batch at a time and stops at what it looks for makes
    few reads while that is near and few round trips when it is far or absent. Taken
    from ``items`` as needed: a lazy one (join entries read as they are reached) is
    read no further than the last batch."""
    items, width = iter(items), first
    while batch := list(itertools.islice(items, width)):
        yield batch
        width *= growth


class Progress:
    """Says on ``log`` how many members a wait below ``min_ranks`` has: when it starts,
    and every ``PROGRESS_EVERY`` seconds after, while it lasts."""

    def __init__(self, min_ranks: int, clock) -> None:
        self._min = min_ranks
        self._clock = clock
        self._next: float | None = None

    def below(self, here: int) -> None:
        now = self._clock.monotonic()
        if self._next is None or now >= self._next:
            log.info("waiting for members: %d here, %d needed (min_ranks=%d)", here,
                     self._min, self._min)
            self._next = now + PROGRESS_EVERY


class Agreement:
    """Waits for the roster of a round and writes it when this member is the checker."""

    def __init__(self, objects, rosters: Rosters, watch: HeartbeatWatch, *, min_ranks: int,
                 max_ranks: int | None, check_interval: float) -> None:
        self._objects = objects
        self._rosters = rosters
        self._watch = watch
        self._min = min_ranks
        self._max = max_ranks
        self._check_interval = check_interval
        #: the members a round had when it was last found below ``min_ranks`` (None: not)
        self.short: int | None = None
        self._present: dict[int, set[str]] = {}  # round -> members seen to contribute
        self._kept: dict[tuple[int, str], bytes] = {}  # see _exists()
        self._kept_bytes = 0
        self._keep_lock = objects.runtime.lock()  # _exists keeps bytes from map threads
        self.waiting_on = "the roster's writer"  # for the timeout message
        self._next_look = 0.0  # see wait: looks are paced across rounds
        #: ``fits(round, member)``: whether a newcomer's first contribution has this
        #: round's layout (set by the member for each round, with ``layout``)
        self.fits = None
        self.layout: dict | None = None
        #: the legal sizes of this round's contributions (None: unknown, as for a
        #: joiner), set by ``wait``
        self.sizes: tuple[int, ...] | None = None

    def contributed(self, round_: int, member: str) -> bool:
        """Whether ``member`` contributed to ``round_`` (see ``_look``)."""
        return self._look(round_, [member])[0]

    def _look(self, round_: int, members) -> list[bool]:
        """Whether each of ``members`` contributed to ``round_``. The ones not yet seen
        to are read concurrently (``READ_WIDTH`` in flight, on ``Runtime.map``'s
        threads); a member seen present is never read again in this round, since
        contributions are never withdrawn while the round is open."""
        seen = self._present.setdefault(round_, set())
        unseen = [m for m in dict.fromkeys(members) if m not in seen]
        if unseen:
            # bytes in flight stay within KEEP_BUDGET: an all-read-all round's
            # contributions are whole payloads
            width = min(self._width(), KEEP_BUDGET // max(self.sizes or (1,)))
            found = self._objects.runtime.map(lambda m: self._exists(round_, m),
                                              unseen, max(1, width))
            seen.update(m for m, yes in zip(unseen, found) if yes)
        return [m in seen for m in members]

    def _width(self, cap: int = READ_WIDTH) -> int:
        """Reads this member has in flight at once, at most ``cap`` (see
        ``READ_WIDTH``: one at a time on a local disk)."""
        return cap if self._objects.storage.round_trips_dominate else 1

    def _judge(self, members) -> list[str]:
        """``HeartbeatWatch.state`` of each of ``members``, read concurrently."""
        return self._objects.runtime.map(self._watch.state, members, self._width())

    def _exists(self, round_: int, member: str) -> bool:
        """One existence check of a contribution; may run on another thread (``_look``):
        it touches no state but the kept bytes, under their lock."""
        name = names.elastic_contribution(round_, member)
        objects = self._objects
        if not objects.storage.round_trips_dominate or self.sizes is None:
            # an open on a local disk: cheap (and a joiner does not know the layout)
            return object_exists(objects.storage, objects.key_of(name))
        # an object store has no cheaper existence check than the GET that fetches the
        # object: keep the bytes for the reduce (up to a budget) instead of fetching
        # them twice
        try:
            raw = objects.read_sized(name, self.sizes)
        except ShardCorrupt:  # not kept: the reduce reads it again and says why
            return True
        if raw is None:
            return False
        with self._keep_lock:
            if self._kept_bytes + len(raw) <= KEEP_BUDGET:
                self._kept[(round_, member)] = raw
                self._kept_bytes += len(raw)
        return True

    def take(self, round_: int, member: str) -> bytes | None:
        """The bytes of ``member``'s contribution to ``round_`` if this member kept them
        while checking (then forgotten here), else None."""
        with self._keep_lock:
            raw = self._kept.pop((round_, member), None)
            if raw is not None:
                self._kept_bytes -= len(raw)
        return raw

    def complete(self, prev: Roster, round_: int, full: bool) -> Roster | None:
        """The roster of ``round_`` if it can be decided now (written, or the winner's
        read back), else None with ``waiting_on`` saying why.

        The cheap pass (every poll) looks at the contributions in order up to the first
        missing one and at that member's heartbeat, reading the ones not yet seen in
        windows (``FIRST_WINDOW``, growing while all are present) of concurrent reads.
        A ``full`` pass (once per check interval, and whenever the first missing member
        is gone) reads every contribution not yet seen at once and judges every missing
        member in one pass, so members that die together start their silence clocks
        together and leave in one roster."""
        if not full:
            first = self._first_missing(prev.members, round_)
            if first is not None:
                i, member = first
                if self._watch.alive(member):
                    self.waiting_on = f"member {member} (rank {i}), alive but not contributed"
                    return None
        present = self._look(round_, prev.members)  # nothing left to read after a cheap pass
        survivors = [m for m, yes in zip(prev.members, present) if yes]
        missing = [(i, m) for i, (m, yes) in enumerate(zip(prev.members, present)) if not yes]
        # all, no short cut, read at once
        states = self._judge([m for _, m in missing])
        alive = [(i, m) for (i, m), state in zip(missing, states) if state == ALIVE]
        if alive:
            i, member = alive[0]
            self.waiting_on = (f"member {member} (rank {i}), alive but not contributed"
                               + (f", and {len(alive) - 1} more" if len(alive) > 1 else ""))
            return None
        # a contributor whose beat this member recently found missing (read while it
        # took over from a checker that died with it) is judged before the roster
        # lists it for the next round: it leaves with the others, instead of making
        # the next round (a tree's reduce) wait one more timeout for it
        late = [m for m in survivors if self._watch.overdue(m) and self._watch.alive(m)]
        if late:
            self.waiting_on = (f"member {late[0]} (rank {prev.members.index(late[0])}): "
                               "its heartbeat stopped, not yet past heartbeat_timeout")
            return None
        room = (1 << 62) if self._max is None else self._max - len(survivors)
        joiners, n = self._admissions(prev.join_next, set(survivors), room)
        # a contributor this member already knows to be gone (judged while it looked
        # for the checker: no extra read) counts in this round but not in the next, so
        # a job whose members all died restarts with the newcomers alone
        # admission is provisional: a newcomer whose first contribution does not fit the
        # round's layout (checked against this member's own) is refused alone, and the
        # others go on
        refused = self._refused(prev, round_, survivors)
        survivors = [m for m in survivors if m not in refused]
        members = [m for m in survivors if m not in self._watch.gone] + joiners
        if len(members) < max(self._min, 1):
            self.waiting_on = (f"joiners: {len(members)} member(s), "
                               f"fewer than min_ranks={self._min}")
            self.short = len(members)
            return None
        self.short = None
        roster = Roster(round_, tuple(survivors), tuple(members), n, prev.changes,
                        tuple(refused), self.layout if refused else None)
        changes = roster.changes_after(prev)
        # the members before the joiners are exactly the previous ones: only admissions
        admitted_only = bool(joiners) and changes > prev.changes and \
            members[:len(members) - len(joiners)] == list(prev.members)
        roster = replace(roster, changes=changes, admitted_only=admitted_only)
        return self._rosters.create(roster.chained(prev), prev, self._watch.how)

    def _first_missing(self, members, round_: int) -> tuple[int, str] | None:
        """The first of ``members`` (its rank and id) that has not contributed to
        ``round_``, else None: the unseen ones read in ``windows`` from
        ``FIRST_WINDOW`` while every contribution of a window is there."""
        seen = self._present.setdefault(round_, set())
        for batch in windows([(i, m) for i, m in enumerate(members) if m not in seen],
                             FIRST_WINDOW):
            present = self._look(round_, [m for _, m in batch])
            if not all(present):
                return batch[present.index(False)]
        return None

    def _admissions(self, n: int, survivors: set, room: int) -> tuple[list[str], int]:
        """The joiners to admit (queue order, at most ``room``) from join entry ``n``
        on, and the first entry not consumed. A joiner whose heartbeat says it left, or
        was never seen beating past the timeout, is skipped: its entry is consumed and
        it learns so (``PeerFailed``). Entries are read in batches doubling up to
        ``JOIN_READS`` (one GET when the queue is empty, the usual case) and the
        batch's joiners judged ``JOIN_READS`` at a time: one after the other, a queue
        that grew during a stall cost the checker O(queue) round trips, seconds on an
        object store, past the detection bound of the members it drops."""
        joiners: list[str] = []
        width, run, most = 1, self._objects.runtime.map, self._width(JOIN_READS)
        while len(joiners) < room:
            batch = run(self._rosters.join_entry, range(n, n + width), min(width, most))
            claimed = batch[:batch.index(None)] if None in batch else batch
            new = [m for m in dict.fromkeys(claimed) if m not in survivors]
            states = dict(zip(new, run(self._watch.state, new, most)))
            for member in claimed:
                if len(joiners) >= room:
                    break
                n += 1
                if member not in joiners and states.get(member) == ALIVE:
                    joiners.append(member)
            if len(claimed) < width:
                break
            width = min(2 * width, JOIN_READS)
        return joiners, n

    def _refused(self, prev: Roster, round_: int, survivors: list[str]) -> list[str]:
        """The survivors making their first contribution (admitted by ``prev``, which
        did not found the job) whose contribution does not fit this round's layout."""
        if self.fits is None or prev.founding:
            return []
        fresh = set(prev.members) - set(prev.contributors)
        return [m for m in survivors if m in fresh and not self.fits(round_, m)]

    def _check_not_pruned(self, round_: int) -> None:
        """``MemberDropped`` if round ``round_`` is over and its roster already deleted:
        this member fell more than ``ROSTER_RETENTION`` rounds behind (it was frozen
        while the others went on) and would otherwise wait out its timeout. Rosters
        are created in order and the hint is written after its roster, so a hint at or
        past ``round_`` means the roster existed; read it once more (it may have been
        created between the two reads)."""
        if self._rosters.latest_hint() >= round_ and self._rosters.read(round_) is None:
            raise MemberDropped(
                f"round {round_} is over and its roster is gone: this member fell more "
                f"than {ROSTER_RETENTION} rounds behind the others", collective=round_,
                path=self._rosters.path_of(names.elastic_roster(round_)),
                hint="connect again with elastic=True to rejoin as a new member")

    def is_checker(self, predecessors: list[str], after=(), everyone: bool = False,
                   ahead=None) -> bool:
        """True when every member before this one is gone (see the module docstring).

        On the way it reads the heartbeats of the members whose death this member
        would have to act on, so that members that die together start their silence
        clocks together: the predecessors in order up to the first one seen running
        now (``HeartbeatWatch.fresh``), and at least the first two (the checker and the next in
        line: when both die, the member after them has both clocks running); then, if
        none was seen running now (this member may be the checker within a timeout),
        the members ``after`` it too, whose contributions it will then judge. With
        ``everyone`` (a roster small enough that every member reads every contribution)
        it reads them all, every time.

        A queued joiner (``predecessors``: the previous roster's members; ``ahead()``:
        the members queued ahead of it; ``ahead`` None: a member) reads the members
        so, except that one it never read before stops the scan as a running one does
        (see ``_scan``): on its first look nothing is proven yet, and reading every
        member then (and on every later look, as long as such a look outlasted a beat
        gap) cost O(W) reads per joiner per interval. A member that then stays still is
        not fresh at the next look, one interval later, and the scan goes on past it.
        The joiners ahead are read (their join entries too), the same way, only once
        every member is gone: only then can one of them be the checker."""
        if ahead is None:
            gone, proven = self._scan(predecessors, everyone, trust_new=False)
            if not gone and (everyone or not proven):
                self._judge(after)
            return gone
        return self._scan(predecessors, everyone, trust_new=True)[0] and \
            self._scan(ahead(), False, trust_new=True)[0]

    def _scan(self, members, everyone: bool, trust_new: bool) -> tuple[bool, bool]:
        """Read ``members``' heartbeats in order up to the second one read when one was
        seen running now (with ``trust_new``: or never read before, until one is found
        neither: then the job may be dying, and one new member per look would start the
        others' silence clocks a look apart), all of them with ``everyone``: (all gone,
        one seen running). A member's look reads them in ``windows`` of concurrent
        reads from the two it always reads (one after the other, a look that proved
        nothing cost W round trips: at W = 1,000 a straggler's look held a round ~30 s);
        the judgement goes in order, and the members read past where it stops only had
        their silence clocks started sooner. (Before the shards these bursts went over
        one prefix's GET rate: W = 400 rounds of 122 s; over 256 shards they spread.)
        A joiner's (``trust_new``) stops after a few reads by design: one at a time, as
        many joiners look."""
        gone, proven, k = True, False, 0
        first, growth = (1, 1) if trust_new and not everyone else (2, WINDOW_GROWTH)
        for batch in windows(members, first, growth):
            new = [trust_new and not self._watch.seen(m) for m in batch]  # before reading
            states = self._judge(batch)
            for member, was_new, state in zip(batch, new, states):
                if state == ALIVE:
                    gone = False
                    fresh = self._watch.fresh(member)
                    trust_new = trust_new and (was_new or fresh)
                    proven = proven or was_new or fresh
                if proven and k >= 1 and not everyone:
                    return gone, proven
                k += 1
        return gone, proven

    def wait(self, round_: int, prev: Roster, predecessors: list[str],
             deadline: float, on_look=None, sizes: tuple[int, ...] | None = None,
             queued: int | None = None, ahead=None) -> Roster:
        """The roster of ``round_``, read or (as the checker) written; ``SyncTimeout``
        after ``deadline``. ``predecessors``: the members of ``prev`` before this one (a
        joiner: all of them), so the members after it are the rest of ``prev`` past its
        own place. A joiner passes ``ahead()``, the members queued ahead of it (read
        only when needed: see ``is_checker``), and ``queued``, the members and joiners
        up to and including it (what it says while there are fewer than
        ``min_ranks``). ``on_look()`` is called at each look while the roster is
        missing (a joiner's "has the job ended?"); it may raise.

        Looks (``is_checker``) come once per check interval of waiting, counted across
        rounds (a healthy job's short waits cost no more than one long one), and
        sooner when a judgement can change (``HeartbeatWatch.next_change``): the moment a
        watched member reaches the timeout, or the member this one would take over
        from stops being seen running."""
        self.sizes = sizes
        self.short = None
        progress = Progress(self._min, clock := self._objects.runtime)
        everyone = len(prev.members) < TREE_FROM
        after = prev.members[len(predecessors) + 1:]
        proof = () if everyone else predecessors[:2]
        gone = self._watch.gone
        # a joiner is the checker only once the joiners ahead are gone too: its looks say
        state = {"checker": ahead is None and all(m in gone for m in predecessors),
                 "looks": 0,
                 # a round that ends within a check interval (a healthy one) needs no
                 # full pass
                 "next_full": clock.monotonic() + self._check_interval}

        def next_look(now: float) -> float:
            # `now`: when this look began; a member whose timeout came while the look
            # read the others was read just short of it: look again at once
            change = self._watch.next_change(proof, since=now)
            return min(now + self._check_interval, change if change is not None else now
                       + self._check_interval)

        def between() -> Roster | None:
            now = clock.monotonic()
            if now >= self._next_look:
                state["looks"] += 1
                if on_look is not None:
                    on_look()
                if state["looks"] % PRUNED_CHECK_EVERY == 0:
                    self._check_not_pruned(round_)
                if not state["checker"]:
                    state["checker"] = self.is_checker(predecessors, after, everyone, ahead)
                    self.waiting_on = "the checker (the first live member) to write it"
                self._next_look = next_look(now)
            elif not state["checker"] and len(predecessors) == 1 and (
                    ahead is None or queued == 2):
                # next in line after the checker: a heartbeat read per poll (one member
                # pays it) sees a checker that closed at once, not after up to a
                # heartbeat interval (10 s on an object store), and one that stopped
                # beating one beat gap after its last beat (the next look comes then)
                state["checker"] = not self._watch.alive(predecessors[0])
            roster, full = None, now >= state["next_full"]
            if state["checker"]:
                roster = self.complete(prev, round_, full)
                if full:
                    state["next_full"] = next_look(now)
            here = self.short if state["checker"] else queued
            if roster is None and here is not None and here < self._min:
                progress.below(here)
            return roster

        def expired() -> SyncTimeout:
            return SyncTimeout(
                f"the roster of round {round_} was not agreed in time; waiting on "
                f"{self.waiting_on}", collective=round_,
                path=self._rosters.path_of(names.elastic_roster(round_)),
                hint="start more members (min_ranks), or raise timeout")

        roster = self._objects.wait_for(lambda: self._rosters.read(round_),
                                        deadline=deadline, expired=expired, between=between)
        for old in [r for r in self._present if r <= round_]:
            del self._present[old]
        for old in [k for k in self._kept if k[0] < round_]:
            self.take(*old)  # a round this member no longer reads
        return roster
