"""One member's side of every round: writing its contribution, agreeing on the roster, and
reading the others' contributions, verified (docs/elastic.md#rounds).

Every object goes through the job's object layer (``storage/objects.py``): sealed,
created exclusively, read bounded and checked against an ``Expected`` header; each
layout is described once (``layout.{digest}``) so a mismatch names the first difference.
``Exchange`` is also the ``RoundIO`` a ``TreeRound`` uses (``tree.py``).
"""

from __future__ import annotations

import json
import warnings

import torch

from ferrosync.compression.codecs import Codec, RawCodec, as_uint8
from ferrosync.core.common import MISMATCH_HINT, describe_mismatch
from ferrosync.elastic.membership import Roster
from ferrosync.elastic.tree import TreeRound, Units, plan
from ferrosync.errors import LayoutMismatch, MemberDropped, ShardCorrupt
from ferrosync.storage import names
from ferrosync.storage.incoming import Expected, Part
from ferrosync.storage.wire import FLAG_EMPTY, KIND_CONTRIB, layout_digest

#: contributions carry the bytes of every bucket of a call, so their header says uint8
_BYTES = RawCodec(torch.uint8)
#: the fields of a call's layout record that its digest covers (``api.plan_layouts``)
_LAYOUT_FIELDS = ("op", "bucket", "tensors")


class Exchange:
    """The rounds of member ``member_id`` through the job's ``objects``.

    ``agreement`` agrees on rosters, ``watch`` judges liveness, ``encoder`` holds the
    codecs (int8 error feedback per member), ``stats`` the member's ``StatsBook``.
    ``layout`` is the layout record of the call being made (set per call): the roster's
    checker hands it to a newcomer it refuses, and a mismatch names the first
    difference from it.
    """

    def __init__(self, objects, rosters, agreement, watch, encoder, stats, *,
                 member_id: str, fan_in: int, timeout: float, look_every: float) -> None:
        self.objects = objects
        self.rosters = rosters
        self.agreement = agreement
        self.watch = watch
        self.encoder = encoder
        self.stats = stats
        self.member_id = member_id
        self.fan_in = fan_in
        self.timeout = timeout
        self.look_every = look_every
        self.layout: dict | None = None
        self.mine: list[tuple[int, str]] = []  # (round, key) of own objects
        self._described: set[bytes] = set()  # layouts whose record this member wrote
        #: (previous roster, roster, layout digest, wire bytes) of the round in progress
        self._round: tuple | None = None

    # -- RoundIO (tree.py) ----------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.objects.rank

    @property
    def tag(self) -> int:
        return self.objects.tag

    @property
    def clock(self):
        return self.objects.runtime

    def path_of(self, name: str) -> str:
        return self.objects.path_of(name)

    def phase(self, name: str):
        return self.stats.phase(name)

    def alive(self, member: str) -> bool:
        return self.watch.alive(member)

    def known_gone(self, member: str) -> bool:
        return member in self.watch.gone

    def wait_for(self, attempt, *, deadline: float, expired, between):
        return self.objects.wait_for(attempt, deadline=deadline, expired=expired,
                                     between=between, sleeping=lambda: self.phase("wait_s"))

    def write(self, name: str, expected: Expected, writer: int, parts: list, weight: float,
              flags: int, round_: int, *, shared: bool = False,
              what: str = "contribution") -> None:
        """Seal and create object ``name`` of ``round_`` under ``expected``'s header
        (deleted with this member's other objects of the round). A name already taken
        is ``ShardCorrupt`` (only this member writes it: something planted it), unless
        ``shared``: a tree object another member computed first (the same bytes)."""
        nbytes = sum(memoryview(p).nbytes for p in parts)
        header = expected.header(writer, weight=weight, nbytes=nbytes, flags=flags)
        if not self.objects.create(name, header, parts):
            if shared:
                return
            raise ShardCorrupt(
                f"an object already lies under this member's {what} to round {round_} "
                f"({name}; planted by something else: this member never wrote it)",
                rank=self.rank, collective=round_, path=self.path_of(name),
                hint="let nothing else write under this URL; set a secret so planted "
                "objects are refused by every member")
        self.mine.append((round_, self.objects.key_of(name)))

    def read(self, name: str, expected: Expected, writer: int, round_: int) -> tuple | None:
        """The verified object ``name`` of ``round_`` (header only when empty), or None
        while it does not exist. An object of another size is read (bounded) and
        verified too, so that another layout is named as such: a slice by its own
        digest, a computed object (whose digest covers its name) by the contributors'
        markers."""
        head = self.objects.head
        if expected.kind == KIND_CONTRIB:
            mismatch = self._mismatch(round_, self._round[0].members[writer], writer)
        else:
            def mismatch(_src, _theirs):
                return self._foreign(name, round_)
        return self.objects.read_verified(
            name, expected, writer, sizes=(head, head + expected.part.count),
            mismatch=mismatch, other_layouts=True)

    def missing_slice(self, round_: int, position: int, path) -> Exception:
        """The error for slice ``path`` of the member at ``position``, not there although
        its marker was seen: ``LayoutMismatch`` if its marker names another layout; the
        member at fault (``ShardCorrupt``) if its marker is there and the round is not
        over; else this member fell behind (``MemberDropped``)."""
        prev = self._round[0]
        member = prev.members[position]
        slice_ = names.elastic_piece(round_, 0, position, path)
        marker = self._marker(round_, member)  # raises on another layout
        if marker is not None and self.rosters.read(round_ + 2) is None:
            # its marker is there and nobody cleaned the round up: it never wrote it
            return ShardCorrupt(
                f"member {member} (rank {position}) marked its contribution to round "
                f"{round_} as written, but never wrote its slice {path[0]} (a member that "
                "does not follow the protocol, or a planted marker)", rank=self.rank,
                collective=round_, path=self.path_of(slice_),
                hint=f"find out what runs as member {member}; let nothing else write "
                "under this URL, and set a secret")
        return MemberDropped(
            f"slice {path[0]} of member {member}'s contribution to round {round_} is gone: "
            "this member fell behind and the others have moved on", rank=self.rank,
            collective=round_, path=self.path_of(slice_),
            hint="connect again with elastic=True to rejoin")

    # -- layouts ---------------------------------------------------------------------------------
    def describe(self, digest: bytes) -> None:
        """Publish the layout record of ``digest`` once (content-addressed: whoever calls
        with that layout writes the same record, so it is written only if missing)."""
        if digest in self._described or self.layout is None:
            return
        name = names.elastic_layout(digest)
        if self.objects.read_record(name) is None:
            self.objects.put_record(name, {k: self.layout.get(k) for k in _LAYOUT_FIELDS})
        self._described.add(digest)

    def _layout_of(self, digest: bytes) -> dict | None:
        """The layout record of ``digest``, if published and really of that digest."""
        try:
            record = self.objects.read_record(names.elastic_layout(digest))
        except ShardCorrupt:
            return None
        if record is None or layout_digest(json.dumps(record, sort_keys=True)) != digest:
            return None
        return record

    def _mismatch(self, round_: int, member: str, src: int):
        """``mismatch(src, their_digest)`` for an object of ``member`` (rank ``src`` of
        the previous roster): a ``LayoutMismatch`` naming the first difference between
        this member's call and theirs (from their layout record)."""
        def mismatch(_src, theirs: bytes) -> LayoutMismatch:
            described = describe_mismatch(self.layout or {}, self._layout_of(theirs),
                                          self.rank, src)
            return LayoutMismatch(
                f"member {member} (rank {src}) called round {round_} with another layout "
                f"than this member: {described}", rank=self.rank, collective=round_,
                path=self.path_of(names.elastic_contribution(round_, member)),
                hint=MISMATCH_HINT)
        return mismatch

    def _marker(self, round_: int, member: str):
        """``member``'s verified marker of the tree round in progress (None when gone);
        a marker of another layout raises ``LayoutMismatch`` naming the difference."""
        prev, _, digest, total = self._round
        src = prev.members.index(member)
        return self.objects.read_verified(
            names.elastic_contribution(round_, member),
            self.expected(round_, prev, digest, total), src, sizes=(self.objects.head,),
            mismatch=self._mismatch(round_, member, src), other_layouts=True)

    def _foreign(self, name: str, round_: int) -> Exception:
        """The error for a computed tree object of another layout or place: the first
        contributor whose marker names another layout (``LayoutMismatch``), else a
        copied object (``ShardCorrupt``)."""
        for member in self._round[1].contributors:
            if member != self.member_id:
                self._marker(round_, member)  # raises on another layout
        return ShardCorrupt(
            f"the object under {name} was made for another place in round {round_}'s "
            "tree or another layout (a copied object)", rank=self.rank, collective=round_,
            path=self.path_of(name), hint="let nothing else write under this URL; set a secret")

    # -- one round ---------------------------------------------------------------------------------
    def codecs(self, flats: list[torch.Tensor], encoded: bool) -> list[Codec]:
        """Each flat's codec: ``wire_dtype``'s for an average's contributions
        (``encoded``), the exact bytes otherwise (broadcasts, gathers, barriers)."""
        return [self.encoder.codec(f.dtype) if encoded else RawCodec(f.dtype) for f in flats]

    def encode(self, flats: list[torch.Tensor], codecs: list[Codec]) -> list:
        """The wire bytes of each flat (host numpy uint8), through its codec; int8 error
        feedback is keyed by the running stream and the flat's place in the call."""
        parts = []
        for i, (flat, codec) in enumerate(zip(flats, codecs)):
            if codec.raw:
                parts.append(as_uint8(flat.contiguous().cpu()).numpy())
            else:  # the encoder reuses one buffer per call: keep a copy per flat
                parts.append(self.encoder.encode(flat.contiguous(), codec, ("contribution", i))
                             .cpu().numpy().copy())
        return parts

    def expected(self, round_: int, prev: Roster, digest: bytes, total: int) -> Expected:
        """What every contribution to ``round_`` says about itself (the storage
        transport's header and checks): this job's tag, the round, the writer's rank in
        roster ``round_ - 1`` (which names the member), the layout and the size."""
        return Expected(KIND_CONTRIB, torch.uint8, _BYTES, digest, Part.whole(total),
                        len(prev.members), self.tag, round_)

    def sizes(self, total: int, tree: bool = False) -> tuple[int, ...]:
        """The legal sizes of a contribution of ``total`` payload bytes: empty (a zero
        weight, a barrier, a tree round's marker) and full; anything else is not one."""
        head = self.objects.head
        return (head,) if tree else (head, head + total)

    def run(self, prev: Roster, flats: list[torch.Tensor], codecs: list[Codec], weight: float,
            digest: bytes, send: bool, tree: bool = False) -> tuple[Roster, list]:
        """Write this member's contribution to the round after ``prev`` and agree on its
        roster. Returns (the new roster, the contribution's bytes per flat: empty when
        nothing was sent); raises ``LayoutMismatch`` if refused, ``MemberDropped`` if
        dropped. With ``tree`` the contribution is written as the tree's slices, then a
        header-only marker (what the roster's checker looks for)."""
        round_ = prev.round + 1
        pos = prev.members.index(self.member_id)
        self.describe(digest)
        wire = self.encode(flats, codecs) if send else []
        total = sum(c.nbytes(f.numel()) for f, c in zip(flats, codecs))
        if tree:
            slices = TreeRound(self, plan(len(prev.members), self.fan_in), prev,
                               Roster(round_, (), (), 0), Units(flats, codecs), digest,
                               wire, weight, 0.0)
            with self.phase("write_s"):
                slices.write_slices(wire, weight)
            parts, flags = [], FLAG_EMPTY
        else:
            parts = [p for p in wire if p.nbytes]
            flags = 0 if send and total else FLAG_EMPTY
        name = names.elastic_contribution(round_, self.member_id)
        with self.phase("write_s"):
            self.write(name, self.expected(round_, prev, digest, total), pos, parts, weight,
                       flags, round_)
        agreement = self.agreement
        agreement.layout = self.layout
        agreement.fits = lambda r, member: self.fits(r, member, prev, digest, total)
        with self.phase("wait_s"):
            roster = agreement.wait(round_, prev, list(prev.members[:pos]),
                                    self.objects.runtime.monotonic() + self.timeout,
                                    sizes=self.sizes(total, tree))
        self._round = (prev, roster, digest, total)
        self._check_kept(round_, roster, pos, name)
        # everyone who reads round r has finished it once roster r+2 exists (its
        # contributors finished r+1, hence r): older own objects are garbage
        done = [k for r, k in self.mine if r <= round_ - 2]
        if done:
            self.objects.storage.delete(done)
            self.mine = [(r, k) for r, k in self.mine if r > round_ - 2]
        return roster, wire

    def _check_kept(self, round_: int, roster: Roster, pos: int, name: str) -> None:
        """Raise if ``roster`` refused or dropped this member."""
        path = self.path_of(name)
        if self.member_id in roster.refused:
            self.objects.storage.delete([k for r, k in self.mine if r == round_])
            raise LayoutMismatch(
                f"this member was refused by the elastic job at round {round_}: its first "
                "collective does not fit the job's ("
                + describe_mismatch(self.layout or {}, roster.layout, pos, 0) + ")",
                rank=pos, collective=round_, path=path,
                hint="start every member with the same model and calls (pass spec= to be "
                "refused before joining); the job's members went on without this one")
        if self.member_id not in roster.contributors:
            # nobody reads what it wrote for this round (a tree round's slices too)
            self.objects.storage.delete([k for r, k in self.mine if r == round_])
            raise MemberDropped(
                f"this member was dropped from round {round_}: the others found it gone "
                "(heartbeat silent past heartbeat_timeout) before its contribution came",
                collective=round_, path=path,
                hint="connect again with elastic=True to rejoin as a new member")
        if self.member_id not in roster.members:
            # its contribution counts in this round (others read it: it stays), but the
            # checker knew it gone (left, aborted, or silent past the timeout)
            raise MemberDropped(
                f"this member was dropped after round {round_}: the others found it gone "
                "(heartbeat said left/aborted, or silent past heartbeat_timeout)",
                collective=round_, path=path,
                hint="connect again with elastic=True to rejoin as a new member")

    def fits(self, round_: int, member: str, prev: Roster, digest: bytes, total: int) -> bool:
        """Whether ``member``'s contribution to ``round_`` has this round's layout (its
        MAC verified first: a forged object is ``ShardCorrupt``, not a misfit). One far
        larger than any of this round's does not fit, whatever it says."""
        class Misfit(Exception):
            pass

        def misfit(_src, _theirs):
            return Misfit()

        def too_large():
            raise Misfit()

        try:
            self.objects.read_verified(
                names.elastic_contribution(round_, member),
                self.expected(round_, prev, digest, total), prev.members.index(member),
                sizes=self.sizes(total), mismatch=misfit, other_layouts=True,
                too_large=too_large)
        except Misfit:
            return False
        return True

    def contribution(self, round_: int, member: str, prev: Roster, digest: bytes,
                     flats: list[torch.Tensor], codecs: list[Codec]) -> tuple[float, list | None]:
        """(weight, one tensor per flat, or None when empty) of ``member``'s verified
        contribution to ``round_``: read at one of its two legal sizes (another layout's
        is verified and named), its MAC (or checksum) verified before any field is
        compared with the round's ``Expected``."""
        name = names.elastic_contribution(round_, member)
        total = sum(c.nbytes(f.numel()) for f, c in zip(flats, codecs))
        src = prev.members.index(member)
        with self.phase("read_s"):
            got = self.objects.read_verified(
                name, self.expected(round_, prev, digest, total), src,
                sizes=self.sizes(total), mismatch=self._mismatch(round_, member, src),
                other_layouts=True, data=self.agreement.take(round_, member))
        if got is None:
            raise MemberDropped(
                f"the contribution of member {member} to round {round_} is gone: this "
                "member fell behind and the others have moved on", collective=round_,
                path=self.path_of(name), hint="connect again with elastic=True to rejoin")
        header, payload = got
        if header.flags & FLAG_EMPTY:
            return header.weight, None
        views, offset = [], 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only buffer: only ever read
            for f, codec in zip(flats, codecs):
                n = codec.nbytes(f.numel())
                views.append(decode(payload[offset:offset + n], f, codec))
                offset += n
        return header.weight, views


def decode(data, flat: torch.Tensor, codec: Codec) -> torch.Tensor:
    """``flat``'s values held by ``data`` (its wire bytes through ``codec``)."""
    if not len(data):
        return flat.new_empty(0)
    if codec.raw:
        return torch.frombuffer(data, dtype=flat.dtype)
    return codec.decode(torch.frombuffer(data, dtype=torch.uint8), flat.numel())
