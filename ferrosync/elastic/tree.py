"""One round of the tree reduce of an elastic average from ``TREE_FROM`` members on: a
hierarchical reduce-scatter and all-gather over the previous roster
(docs/elastic.md#the-tree-reduce).

``TreeRound`` runs ``plan.py``'s plan; every object it reads is bound to its place in the
tree and verified before use, and one whose holder is gone is computed and created by
whoever needs it (the same bytes). What it uses of its member is the ``RoundIO``
interface, which ``exchange.Exchange`` implements.
"""

from __future__ import annotations

import bisect
import warnings
from dataclasses import dataclass
from typing import Protocol

import torch

from ferrosync.compression.codecs import RawCodec, accumulator_dtype, as_uint8
from ferrosync.core.common import accumulate, divide_into, total_weight
from ferrosync.elastic.plan import TREE_FROM, TreePlan, Units, itemsize, plan
from ferrosync.errors import ShardCorrupt, SyncTimeout
from ferrosync.storage import names
from ferrosync.storage.incoming import Expected, Part
from ferrosync.storage.wire import (
    FLAG_EMPTY,
    FLAG_UNCHANGED,
    KIND_CONTRIB,
    KIND_RESULT,
    layout_digest,
)

__all__ = ["TREE_FROM", "TreePlan", "RoundIO", "TreeRound", "Units", "plan"]

_BYTES = RawCodec(torch.uint8)
#: the most requests one role (or the final read of the average) keeps in flight: its
#: inputs or outputs, about ``fan_in`` of them, go out together, not one after another
WIDTH = 16


class _Abandoned(Exception):
    """A wait given up because another request of the same round failed (that error is
    the one raised: see ``TreeRound._gather``)."""


class RoundIO(Protocol):
    """What a ``TreeRound`` uses of its member (``exchange.Exchange`` implements it)."""

    member_id: str
    rank: int  # the member's rank, for error messages
    tag: int  # the job's tag, in every object's header
    look_every: float  # seconds between looks at the owners a wait depends on
    clock: object  # the member's ``runtime.Runtime`` (its ``monotonic``, ``map``, ``lock``)

    def path_of(self, name: str) -> str: ...

    def phase(self, name: str):
        """A context timing one phase of the round (``write_s``, ``wait_s``, ...)."""

    def write(self, name: str, expected: Expected, writer: int, parts: list, weight: float,
              flags: int, round_: int, *, shared: bool = False, what: str = "") -> None:
        """Seal and create one object (``shared``: another member may have created the
        same bytes first; else a name already taken is a planted object)."""

    def read(self, name: str, expected: Expected, writer: int, round_: int):
        """(header, payload) of the verified object, or None while it does not exist."""

    def missing_slice(self, round_: int, position: int, path) -> Exception:
        """The error for a slice of a contribution whose marker was seen, that is not
        there: naming its writer when it never wrote it, else this member."""

    def alive(self, member: str) -> bool: ...

    def known_gone(self, member: str) -> bool: ...

    def wait_for(self, attempt, *, deadline: float, expired, between):
        """``attempt()`` until it returns an object (``Objects.wait_for``), the sleeps
        timed as waiting."""


@dataclass
class Piece:
    """A verified object of the tree: its weight, flags and payload."""

    weight: float
    flags: int
    payload: memoryview


class TreeRound:
    """The tree reduce of one average round, from the contributions to the average.

    ``io`` is the member's side of the round (``RoundIO``); ``prev`` the roster whose
    positions the tree groups, ``roster`` the round's agreement (whose contributions
    count, who takes part in the reduce)."""

    def __init__(self, io: RoundIO, plan_: TreePlan, prev, roster, units: Units, digest: bytes,
                 own_wire: list, own_weight: float, deadline: float) -> None:
        self.io = io
        self.plan = plan_
        self.prev = prev
        self.roster = roster
        self.units = units
        self.digest = digest
        self.round = roster.round
        self.deadline = deadline
        self.me = prev.members.index(io.member_id)
        self._own = (own_weight, own_wire)
        contributing = set(roster.contributors)
        members = set(roster.members)
        self._active = [p for p, m in enumerate(prev.members)
                        if m in contributing and m in members]
        self._active_set = set(self._active)
        self._done: dict[str, Piece] = {}  # objects this member computed this round
        self._owners: set[str] | None = None  # see _look_at_owners
        self._roles: list[tuple] | None = None  # see _mine
        self._next_look: float | None = None  # one look schedule for all waits at once
        self._looking = io.clock.lock()
        self._failed: list[BaseException] = []  # the first failed request ends the round

    # -- who does what --------------------------------------------------------------------
    def substitute(self, position: int) -> int:
        """The position that does ``position``'s part: itself while it takes part in the
        reduce, else the next one that does (cyclically): the same on every member."""
        if position in self._active_set:
            return position
        later = bisect.bisect_right(self._active, position)  # _active is in order
        return self._active[later % len(self._active)]

    def _mine(self) -> list[tuple]:
        """(role, designee) of the roles that fall to this member, in ``assignments``
        order: those of its own position and of the positions not taking part just
        before it, which it substitutes for (``substitute``). Found by position: judging
        every role's owner cost each member O(W) per round."""
        if self._roles is None:
            positions, active, n = [], self._active_set, len(self.prev.members)
            if self.me in active:
                p = self.me
                while True:
                    positions.append(p)
                    p = (p - 1) % n
                    if p in active or p == self.me:
                        break
            by, assignments = self.plan.by_designee, self.plan.assignments
            self._roles = [assignments[i] for i in
                           sorted(i for p in positions for i in by.get(p, ()))]
        return self._roles

    def _owner(self, role, designee: int | None = None) -> str:
        if designee is None:
            designee = self.plan.designee(role)
        return self.prev.members[self.substitute(designee)]

    # -- names, sizes and headers -----------------------------------------------------------
    def _expected(self, kind_of_bytes: str, name: str, writer: int, path) -> tuple[Expected, int]:
        """The header every copy of object ``name`` carries (the slices of a
        contribution carry the call's layout digest, so another layout is reported as
        such; a computed object's digest also covers its name) and its payload size."""
        lo, hi = self.plan.span(path, self.units.total)
        index, of = self.plan.index(path)
        nbytes = self.units.nbytes(kind_of_bytes, lo, hi)
        offset = self.units.nbytes(kind_of_bytes, 0, lo)
        total = self.units.nbytes(kind_of_bytes, 0, self.units.total)
        if kind_of_bytes == "wire":
            kind, digest = KIND_CONTRIB, self.digest
        else:
            kind = KIND_RESULT
            digest = layout_digest(f"{self.digest.hex()} {kind_of_bytes} {name}")
        return Expected(kind, torch.uint8, _BYTES, digest,
                        Part(offset, nbytes, total, index, of), len(self.prev.members),
                        self.io.tag, self.round), writer

    # -- writing ----------------------------------------------------------------------------
    def write_slices(self, wire: list, weight: float) -> None:
        """This member's contribution as one slice per level-1 slot (before its marker)."""
        send = bool(wire)

        def write(j: int) -> None:
            path = (j,)
            name = names.elastic_piece(self.round, 0, self.me, path)
            expected, _ = self._expected("wire", name, self.me, path)
            parts = []
            if send:
                span = self.plan.span(path, self.units.total)
                for i, _e0, _e1, fa, fb in self.units.pieces(*span):
                    fbytes = self.units.codecs[i].frame_bytes
                    parts.append(wire[i][fa * fbytes:fb * fbytes])
            parts = [p for p in parts if p.nbytes]
            self.io.write(name, expected, self.me, parts, weight, 0 if send else FLAG_EMPTY,
                          self.round, what=f"contribution (slice {j})")

        self._gather(write, range(self.plan.k(1)))

    def _write(self, name: str, expected: Expected, writer: int, parts, weight: float,
               flags: int) -> Piece:
        payload = b"".join(bytes(p) for p in parts) if len(parts) > 1 else \
            (bytes(parts[0]) if parts else b"")
        self.io.write(name, expected, writer, [payload] if payload else [], weight, flags,
                      self.round, shared=True)
        piece = Piece(weight, flags, memoryview(payload))
        self._done[name] = piece
        return piece

    # -- reading ----------------------------------------------------------------------------
    def _read(self, name: str, expected: Expected, writer: int) -> Piece | None:
        """The verified object ``name`` (None when it does not exist yet)."""
        raw = self.io.read(name, expected, writer, self.round)
        if raw is None:
            return None
        header, payload = raw
        return Piece(header.weight, header.flags, payload)

    def _slice(self, position: int, path) -> Piece:
        """Slice ``path`` of the contribution of ``position`` (written before its marker,
        so it exists; if not, ``missing_slice`` says whose fault that is)."""
        if position == self.me:
            weight, wire = self._own
            return Piece(weight, 0 if wire else FLAG_EMPTY, None)  # see _values
        name = names.elastic_piece(self.round, 0, position, path)
        expected, _ = self._expected("wire", name, position, path)
        piece = self._read(name, expected, position)
        if piece is None:
            raise self.io.missing_slice(self.round, position, path)
        return piece

    def _obtain(self, name: str, role, expected: Expected, writer: int,
                wait: bool = True) -> Piece | None:
        """Object ``name`` (an output of ``role``): computed here when this member is
        the role's owner, else read, computed here once its owner is found gone.
        Without ``wait``, one read: None while it is not there (and its owner not
        known gone)."""
        if name in self._done:
            return self._done[name]
        owner = self._owner(role)
        if owner == self.io.member_id:
            self._compute(role)
            return self._done[name]
        self._watch(owner)
        if not wait:
            with self.io.phase("wait_s"):
                piece = self._read(name, expected, writer)
            if piece is None and self.io.known_gone(owner):
                self._compute(role)
                return self._done[name]
            return piece

        def attempt():
            with self.io.phase("wait_s"):
                return self._read(name, expected, writer)

        def between():
            if self._failed:
                raise _Abandoned()  # another request of this round failed: so does it
            self._look()
            if self.io.known_gone(owner):
                self._compute(role)  # its owner is gone: everyone needs it
                return self._done[name]
            return None

        def expired():
            return SyncTimeout(
                f"round {self.round}'s tree reduce waited too long for {name} from "
                f"member {owner}, alive but not done", rank=self.io.rank,
                collective=self.round, path=self.io.path_of(name),
                hint="raise timeout, or find out why that member is stuck")

        return self.io.wait_for(attempt, deadline=self.deadline, expired=expired,
                                between=between)

    def _gather(self, fn, items) -> list:
        """``[fn(x) for x in items]``, up to ``WIDTH`` at once (``Runtime.map``): a
        role's inputs are read, and its outputs written, together. The first call that
        fails ends every wait of this round still running (``_obtain``), and its error
        is the one raised."""
        def call(item):
            try:
                return fn(item)
            except _Abandoned:
                raise
            except BaseException as exc:  # broad on purpose: re-raised by map below
                self._failed.append(exc)
                raise

        try:
            return self.io.clock.map(call, items, WIDTH)  # one item: no thread
        except _Abandoned:
            raise self._failed[0] from None

    def _collect(self, fetch, items) -> list[Piece]:
        """``fetch(x, wait)`` of every item (``_obtain``'s ``wait``), in ``items``'
        order: all read together; while some are missing, wait for the first of them
        alone, then read the others together again. One wait polls at a time, not one
        per item: the items come from one level of the tree, written about together,
        so when one is there the others mostly are too (docs/elastic.md#the-tree-reduce)."""
        items = list(items)
        got = dict(zip(items, self._gather(lambda x: fetch(x, False), items)))
        missing = [x for x in items if got[x] is None]
        while missing:
            got[missing[0]] = self._gather(lambda x: fetch(x, True), missing[:1])[0]
            rest = missing[1:]
            got.update(zip(rest, self._gather(lambda x: fetch(x, False), rest)))
            missing = [x for x in rest if got[x] is None]
        return [got[x] for x in items]

    def _watch(self, owner: str) -> None:
        """Count ``owner`` among the members the looks read, and start the round's look
        schedule at the first wait."""
        if self._owners is None:
            me, owners = self.io.member_id, set()
            for role, _ in self._mine():
                owners.update(self._owner(r) for r in self._inputs(role))
            owners.update(self._owner(self._range_role((j,))) for j in range(self.plan.k(1)))
            owners.discard(me)
            self._owners = owners
        self._owners.add(owner)  # one whose role this member took over, too
        if self._next_look is None:
            self._next_look = self.io.clock.monotonic() + self.io.look_every

    def _look(self) -> None:
        """Look at the owners once per ``look_every`` of this round, however many waits
        run at once (one of them looks; the others see its judgements)."""
        now = self.io.clock.monotonic()
        if now < self._next_look or not self._looking.acquire(blocking=False):
            return
        try:
            self._next_look = now + self.io.look_every
            self._look_at_owners()
        finally:
            self._looking.release()

    def _look_at_owners(self) -> None:
        """Look at the heartbeat of every member whose object this member will wait for
        in this round (about ``fan_in`` per level), not only the one it waits for now:
        members that died together start their silence clocks together, so this round
        waits out one ``heartbeat_timeout`` for all of them, not one after another."""
        for member in sorted(self._owners):
            self.io.alive(member)  # judged once per look; gone ones stay gone

    def _inputs(self, role) -> list[tuple]:
        """The roles whose outputs ``role`` reads (a level-1 sum reads contributions)."""
        if role[0] == "merge":
            path = role[1]
            return [self._range_role(path + (j,)) for j in range(self.plan.k(len(path) + 1))]
        _, level, node, path = role
        if level == 1:
            return []
        return [("sum", level - 1, child, path[:-1]) for child in self.plan.children(level, node)]

    def _range_role(self, path) -> tuple:
        """The role that writes range ``path`` of the average."""
        return ("sum", self.plan.depth, 0, path) if len(path) == self.plan.depth \
            else ("merge", path)

    def _output(self, level: int, node: int, path) -> tuple[str, tuple, Expected, int]:
        """(name, role, expectation, writer) of the object carrying range ``path`` of
        the sum over ``node`` of ``level`` (level 0: a contribution's slice)."""
        depth = self.plan.depth
        if level == depth:  # the root's ranges are the average's
            name = names.elastic_result(self.round, path)
            expected, writer = self._expected("flat", name, 0, path)
            return name, ("sum", level, node, path), expected, writer
        name = names.elastic_piece(self.round, level, node, path)
        expected, writer = self._expected("sum", name, node, path)
        return name, ("sum", level, node, path[:-1]), expected, writer

    def _result(self, path, wait: bool = True) -> Piece | None:
        """Range ``path`` of the average (a root range, or a merge of its sub-ranges)."""
        if len(path) == self.plan.depth:
            name, role, expected, writer = self._output(self.plan.depth, 0, path)
        else:
            name = names.elastic_result(self.round, path)
            role = ("merge", path)
            expected, writer = self._expected("flat", name, 0, path)
        return self._obtain(name, role, expected, writer, wait)

    # -- computing ----------------------------------------------------------------------------
    def _values(self, piece: Piece, kind: str, path) -> list[tuple[int, int, int, torch.Tensor]]:
        """(flat, first element, end element, values) of each flat a piece covers; its
        bytes are of ``kind`` (``Units.nbytes``): a contribution's wire bytes (its codec
        decodes them), a partial sum's or the average's (raw, in their dtype)."""
        lo, hi = self.plan.span(path, self.units.total)
        out, offset = [], 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only buffers: only ever read
            for i, e0, e1, fa, fb in self.units.pieces(lo, hi):
                flat, codec = self.units.flats[i], self.units.codecs[i]
                if kind == "wire" and piece.payload is None:  # this member's own slice
                    wire = self._own[1][i]
                    values = flat[e0:e1] if codec.raw else codec.decode(
                        torch.from_numpy(wire[fa * codec.frame_bytes:fb * codec.frame_bytes]),
                        e1 - e0)
                elif kind == "wire":
                    n = (fb - fa) * codec.frame_bytes
                    data = piece.payload[offset:offset + n]
                    values = codec.decode(torch.frombuffer(data, dtype=torch.uint8), e1 - e0) \
                        if n else flat.new_empty(0)
                    offset += n
                else:
                    dtype = self.units.dtype(kind, i)
                    n = (e1 - e0) * itemsize(dtype)
                    data = piece.payload[offset:offset + n]
                    values = torch.frombuffer(data, dtype=dtype) if n else \
                        torch.empty(0, dtype=dtype)
                    offset += n
                out.append((i, e0, e1, values))
        return out

    def _compute(self, role) -> None:
        if role[0] == "merge":
            return self._merge(role[1])
        _, level, node, path = role
        contributing = set(self.roster.contributors)
        children = [c for c in self.plan.children(level, node)
                    if level > 1 or self.prev.members[c] in contributing]

        def fetch(child: int, wait: bool) -> Piece | None:
            if level == 1:
                return self._slice(child, path)  # there already (before its marker)
            name, crole, expected, writer = self._output(level - 1, child, path)
            return self._obtain(name, crole, expected, writer, wait)

        # every input first (read together), then added in the children's order: the
        # same sum, bit for bit, whatever order the inputs arrived in
        pieces = self._collect(fetch, children)
        sums: dict[int, torch.Tensor] = {}
        first = True
        for piece in pieces:
            if piece.weight <= 0 or piece.flags & FLAG_EMPTY:
                continue
            with self.io.phase("reduce_s"):
                for i, e0, e1, values in self._values(piece, "wire" if level == 1 else "sum",
                                                      path):
                    acc = sums.get(i)
                    if acc is None:
                        acc = sums[i] = torch.empty(
                            e1 - e0, dtype=accumulator_dtype(self.units.flats[i].dtype))
                    accumulate(acc, values.to(acc.device),
                               piece.weight if level == 1 else 1.0, first=first)
                first = False
        weight = total_weight([p.weight for p in pieces])
        del pieces  # only the sums from here on
        if level == self.plan.depth:
            self._finish(path, weight, sums, first)
            return

        def write(j: int) -> None:
            sub = path + (j,)
            name, _, expected, writer = self._output(level, node, sub)
            if first:  # nothing with weight: an empty piece
                self._write(name, expected, writer, [], weight, FLAG_EMPTY)
                return
            lo, hi = self.plan.span(sub, self.units.total)
            base = self.plan.span(path, self.units.total)[0]
            parts = []
            for i, e0, e1, _fa, _fb in self.units.pieces(lo, hi):
                start = self._element_offset(i, base)
                parts.append(as_uint8(sums[i][e0 - start:e1 - start]).numpy())
            self._write(name, expected, writer, parts, weight, 0)

        self._gather(write, range(self.plan.k(level + 1)))

    def _element_offset(self, i: int, lo: int) -> int:
        """The first element of flat ``i`` in a range starting at unit ``lo``."""
        start = self.units.starts[i]
        return max(0, lo - start) * self.units.codecs[i].frame_elems

    def _finish(self, path, weight: float, sums: dict, empty: bool) -> None:
        """A root range: the average (the sums divided once by the job's total weight,
        rounded to each flat's dtype), or unchanged when the total weight is zero."""
        name, _, expected, writer = self._output(self.plan.depth, 0, path)
        if weight <= 0 or empty:
            self._write(name, expected, writer, [], weight, FLAG_UNCHANGED if weight <= 0
                        else 0)
            return
        parts = []
        with self.io.phase("reduce_s"):
            span = self.plan.span(path, self.units.total)
            for i, e0, e1, _fa, _fb in self.units.pieces(*span):
                out = torch.empty(e1 - e0, dtype=self.units.flats[i].dtype)
                divide_into(out, sums[i], weight)
                parts.append(as_uint8(out).numpy())
        self._write(name, expected, writer, parts, weight, 0)

    def _merge(self, path) -> None:
        """Range ``path`` of the average from its sub-ranges one level down the tree."""
        name = names.elastic_result(self.round, path)
        expected, writer = self._expected("flat", name, 0, path)
        subs = self._collect(lambda j, wait: self._result(path + (j,), wait),
                             range(self.plan.k(len(path) + 1)))
        weight, flags = self._agree(subs, name)
        self._write(name, expected, writer,
                    [] if flags else [s.payload for s in subs], weight, flags)

    def _agree(self, pieces: list[Piece], what: str) -> tuple[float, int]:
        """The one total weight (and flags) that every range of the average carries."""
        weights = {(p.weight, p.flags & FLAG_UNCHANGED) for p in pieces}
        if len(weights) != 1:
            raise ShardCorrupt(
                f"the ranges of round {self.round}'s average disagree on the total weight "
                f"({sorted(weights)}) at {what}", rank=self.io.rank, collective=self.round,
                path=self.io.path_of(what),
                hint="let nothing else write under this URL; set a secret")
        weight, unchanged = weights.pop()
        return weight, unchanged

    # -- the round ------------------------------------------------------------------------------
    def run(self, flats: list[torch.Tensor]) -> float:
        """Do this member's part of the tree, then read the average into ``flats``;
        returns the total weight (0: every member keeps its tensors)."""
        plan_ = self.plan
        for role, _ in self._mine():
            if not self._computed(role):
                self._compute(role)
        ranges = self._collect(lambda j, wait: self._result((j,), wait), range(plan_.k(1)))
        weight, unchanged = self._agree(ranges, names.elastic_result(self.round, (0,)))
        if unchanged or weight <= 0:
            return 0.0
        with self.io.phase("reduce_s"):
            for j, piece in enumerate(ranges):
                for i, e0, e1, values in self._values(piece, "flat", (j,)):
                    flats[i][e0:e1].copy_(values)
        return weight

    def _computed(self, role) -> bool:
        if role[0] == "merge":
            return names.elastic_result(self.round, role[1]) in self._done
        _, level, node, path = role
        return self._output(level, node, path + (0,) if level < self.plan.depth else path)[0] \
            in self._done
