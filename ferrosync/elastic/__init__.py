"""Elastic jobs: members join and leave a running job; membership is agreed through
the store alone, without a coordinator (docs/elastic.md).

``ferrosync.connect(url, elastic=True, min_ranks=1, max_ranks=None, ...)`` returns an
``ElasticSync``. Its collectives keep ``GradSync``'s contract among the members of
each round: every member calls the same collectives in the same order with the
same layouts. Each collective is one *round* r:

1. every member of the current roster (r-1) writes its contribution ``r{r}.{id}``;
2. the roster of r is agreed (``rounds.py``): who contributed in time, minus the
   members found gone, plus joiners admitted for the next round;
3. every member reads the contributions of the roster's contributors, in roster
   order, and reduces locally with the same code on the same bytes, so the result
   is bit-identical on every member (and, with the native wire, equal to the
   fixed-size backend's with ranks in that order).

With ``wire_dtype`` (an average's contributions only; broadcasts and gathers are
exact copies) each member encodes its contribution with the storage transport's
``Encoder``, int8 error feedback kept per member (a member's residual is its own,
whoever else is in the round). Every member decodes every contribution, its own
included, so each is counted alike, and the average of the decoded values is not
encoded again (nothing carries it), so it is still the same bits on every member,
a newcomer included. The job's record says which ``wire_dtype`` the job uses; a
member with another is refused before it writes anything.

``rank`` and ``world_size`` are this member's index in, and the size of, the latest
roster, so they may change after any collective; ``membership`` lists the member
ids and ``membership_changes`` counts the rounds in which the list changed, so a
sampler can re-shard when it moves.

A member left out of a roster although it contributed (it was too slow: its
heartbeat went silent for ``heartbeat_timeout``) raises ``PeerFailed`` saying it
was dropped; it may ``connect`` again to rejoin as a new member.
"""

from __future__ import annotations

import json
import secrets
import time
import warnings

import torch

from .. import names, validate
from ..api import GradSync
from ..backends.common import accumulate, describe_mismatch, divide_into, total_weight
from ..backends.encoder import Encoder
from ..backends.incoming import Expected, Part
from ..backends.options import ElasticOptions
from ..codecs import Codec, RawCodec, accumulator_dtype, as_uint8
from ..env import Identity
from ..errors import (
    ConfigError,
    JobEnded,
    LayoutMismatch,
    MemberDropped,
    PeerFailed,
    ShardCorrupt,
)
from ..storage import RECORD_LIMIT, open_storage, probe_location
from ..wire import (
    FLAG_EMPTY,
    HEADER_SIZE,
    KIND_CONTRIB,
    MAC_SIZE,
    PayloadCheck,
    decode_record,
    encode_record,
    job_key,
    job_tag,
    open_record,
    parse_header,
    seal,
)
from .membership import ABORTED, LEFT, Roster, Rosters, Watch, heartbeat
from .rounds import Agreement, read_sized
from .state import DEFAULT_MAX_STATE_BYTES, PublishedState, StateStore
from .tree import TREE_FROM, TreeRound, Units, plan

__all__ = ["ElasticSync", "ElasticOptions", "PublishedState", "connect_elastic", "peek_state"]

#: contributions carry the bytes of every bucket of a call, so their header says uint8
_BYTES = RawCodec(torch.uint8)


def connect_elastic(url: str, timeout: float, min_ranks, max_ranks, options: dict):
    """``connect(..., elastic=True)``: validate, then join the job (see ElasticSync)."""
    min_ranks = validate.integer("min_ranks", min_ranks, minimum=1)
    max_ranks = validate.integer("max_ranks", max_ranks, minimum=1, allow_none=True)
    if max_ranks is not None and max_ranks < min_ranks:
        raise ConfigError(f"max_ranks ({max_ranks}) must be >= min_ranks ({min_ranks})")
    checked = ElasticSync.check_options(options)
    return ElasticSync(url, timeout, checked, min_ranks=min_ranks, max_ranks=max_ranks)


def peek_state(url: str, options: dict, timeout: float = 300.0) -> PublishedState | None:
    """The newest state published in the elastic job at ``url`` (``options`` as for
    ``connect``: ``job``, ``secret``, ``storage_options``; others are ignored), read
    without joining it: for a process that found the job ended (``JobEnded``)."""
    checked = ElasticOptions.parse(options)
    storage = open_storage(url, checked.storage_options)
    try:
        namespace = names.elastic_namespace(checked.job)
        store = StateStore(storage, namespace, job_key(checked.secret, namespace))
        return store.read(time.monotonic() + timeout, None, None)
    finally:
        storage.close()


class ElasticSync(GradSync):
    """A member of an elastic job. Create with ``connect(url, elastic=True)``.

    ``connect`` returns once this member is in a roster (it takes part from the next
    round), or raises ``SyncTimeout`` when no roster admits it within ``timeout``
    (fewer than ``min_ranks`` members, or ``max_ranks`` reached).
    """

    elastic = True

    @classmethod
    def check_options(cls, options: dict) -> ElasticOptions:
        return ElasticOptions.parse(options)

    def __init__(self, url: str, timeout: float, options: ElasticOptions, *,
                 min_ranks: int = 1, max_ranks: int | None = None) -> None:
        storage = open_storage(url, options.storage_options)
        timing = options.timing(storage)
        super().__init__(url, Identity(0, 1, 0, 1, "elastic"), timeout, storage.counters)
        self._storage = storage
        self.job = options.job
        self.member_id = secrets.token_hex(8)
        self._ns = names.elastic_namespace(self.job)
        # every record and object of the job is sealed with the job's own key and its
        # header names the job (wire.job_key, wire.job_tag): an object copied from
        # another job that shares the secret fails its MAC, never enters an average
        self._secret = job_key(options.secret, self._ns)
        self._tag = job_tag(self._ns)
        poll, interval = timing.poll, timing.heartbeat_interval
        #: the resolved liveness settings (the defaults depend on the kind of store)
        self.heartbeat_interval, self.heartbeat_timeout = interval, timing.heartbeat_timeout
        self._rosters = Rosters(storage, self._ns, self._secret, url)
        watch = self._watch = Watch(storage, self._ns, self._secret,
                                    timing.heartbeat_timeout, url, interval)
        self._agreement = Agreement(storage, self._rosters, watch, min_ranks=min_ranks,
                                    max_ranks=max_ranks, poll=poll, check_interval=interval,
                                    url=url)
        self._state = StateStore(storage, self._ns, self._secret)
        self._wire_dtype = options.wire_dtype
        self._fan_in = options.fan_in
        self._encoder = Encoder(options.wire_dtype, options.error_feedback, self._pool)
        self._heartbeat = heartbeat(storage, self._ns, self.member_id, interval, self._secret)
        self._mine: list[tuple[int, str]] = []  # (round, key) of own contributions
        # the layout record of the collective being called (its op, dtypes and shapes):
        # the roster's checker hands it to a newcomer it refuses, naming the difference
        self._call_layout: dict | None = None
        self.membership: list[str] = []
        self._roster: Roster | None = None
        started = False
        try:
            probe_location(storage, None)
            # nothing is written under the job before its record is verified: a member
            # with another secret or spec is refused without disturbing the job
            self._check_job(options.spec)
            self._check_ended()
            storage.put(self._key(names.elastic_member(self.member_id)),
                        [encode_record({"id": self.member_id, "min_ranks": min_ranks},
                                       self._secret)], exclusive=True)
            self._heartbeat.start()
            started = True
            self._adopt(self._join(time.monotonic() + timeout))
        except BaseException:
            self._closed = True
            if started:  # the others must not wait on a member that never joined
                self._heartbeat.stop(ABORTED)
            storage.close()
            raise

    # -- membership ---------------------------------------------------------------------
    def _key(self, name: str) -> str:
        return names.within(self._ns, name)

    @property
    def round(self) -> int:
        """The round of the latest roster this member has seen."""
        return self._roster.round

    @property
    def contributors(self) -> list[str]:
        """The members whose contributions made the latest round (roster order); empty
        in the roster that admitted this member when it founded (or re-founded) the job."""
        return list(self._roster.contributors)

    @property
    def founding(self) -> bool:
        """No member of the current roster contributed to the round that made it: the
        members start the job, or restart it after every member was lost."""
        return self._roster.founding

    @property
    def membership_changes(self) -> int:
        """The rounds whose membership changed over the job's life (the first roster
        counts none): the job's count, read from the roster, the same on every member."""
        return self._roster.changes

    @property
    def newcomers(self) -> list[str]:
        """The members the latest round admitted: they take part from the next round and
        need the job's state (``publish_state`` after this round)."""
        return [m for m in self._roster.members if m not in self._roster.contributors]

    @property
    def membership_changed(self) -> bool:
        """Whether the latest collective changed the membership (re-shard the data)."""
        return self._changed

    def _join(self, deadline: float) -> Roster:
        """Queue this member in the join queue and wait for a roster that admits it."""
        self._check_ended()
        prev = self._rosters.newest(deadline)
        entry = self._rosters.claim(self.member_id, prev.join_next)
        while True:
            ahead = [self._rosters.join_entry(k) for k in range(prev.join_next, entry)]
            predecessors = list(prev.members) + [m for m in ahead if m is not None]
            roster = self._agreement.wait(prev.round + 1, prev, predecessors, deadline,
                                          on_look=self._check_ended)
            if self.member_id in roster.members:
                return roster
            if roster.join_next > entry:
                raise MemberDropped(
                    f"the members skipped this member's join entry {entry} in round "
                    f"{roster.round} (its heartbeat looked dead to them)",
                    path=self._storage.path_of(self._key(names.elastic_join(entry))),
                    hint="check that the heartbeat can be written, then connect again")
            prev = roster

    def _check_job(self, spec: dict | None) -> None:
        """Verify the job's record (sealed with the job's key) and compare ``spec`` with
        the one it holds; the first member writes it. ``ConfigError`` naming every
        difference, or naming the secret when the record was sealed with another key."""
        key = self._key(names.ELASTIC_JOB_RECORD)
        path = self._storage.path_of(key)
        mine = dict(spec or {})
        try:
            json.dumps(mine, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"spec must be plain JSON: {exc}") from None
        raw = self._storage.read(key)
        if raw is None:
            self._storage.makedirs(self._ns)
            try:
                self._storage.put(key, [encode_record(
                    {"spec": mine, "wire_dtype": self._wire_dtype, "fan_in": self._fan_in},
                    self._secret)], exclusive=True)
                return
            except FileExistsError:  # another member was first: check against its record
                raw = self._storage.read(key)
        opened = open_record(raw, self._secret)
        if opened.auth in ("forged", "unsigned", "unverifiable"):
            raise ConfigError(
                "the elastic job's record is sealed with another key: this member's "
                "secret differs from the job's" if opened.auth != "unverifiable" else
                "the elastic job's record is sealed with a secret and this member has none",
                path=path, hint="start every member of a job with the job's secret "
                "(FERROSYNC_SECRET), or use another job id")
        record = decode_record(raw, self._secret, path=path)
        theirs = record.get("spec")
        if not isinstance(theirs, dict):
            raise ShardCorrupt("the elastic job's record holds no spec", path=path,
                               hint="let nothing else write under this URL")
        if record.get("wire_dtype") != self._wire_dtype:
            raise ConfigError(
                f"this member does not fit the elastic job at {self.url}: the job's "
                f"contributions are encoded with wire_dtype {record.get('wire_dtype')!r} "
                f"(here {self._wire_dtype!r})", path=path,
                hint="start every member with the same wire_dtype (or use another job id)")
        if record.get("fan_in", 8) != self._fan_in:
            raise ConfigError(
                f"this member does not fit the elastic job at {self.url}: the job's tree "
                f"reduce groups fan_in={record.get('fan_in', 8)!r} members (here "
                f"{self._fan_in!r})", path=path,
                hint="start every member with the same fan_in (or use another job id)")
        if not theirs or not mine:
            return  # one side states nothing to compare (a plain connect)
        differ = [k for k in sorted(set(theirs) | set(mine)) if theirs.get(k) != mine.get(k)]
        if differ:
            text = "; ".join(f"{k} {theirs.get(k)!r} (here {mine.get(k)!r})" for k in differ)
            raise ConfigError(f"this member does not fit the elastic job at {self.url}: the "
                              f"job runs with {text}", path=path,
                              hint="start every member with the same model and flags (or "
                              "use another job id / URL)")

    def _check_ended(self) -> None:
        """``JobEnded`` if a member marked the job as ended (``end_job``)."""
        key = self._key(names.ELASTIC_ENDED)
        raw = self._storage.read(key)
        if raw is not None:
            record = decode_record(raw, self._secret, path=self._storage.path_of(key))
            raise JobEnded(f"the elastic job ended at round {record.get('round')}; there is "
                           "nothing left to join", path=self._storage.path_of(key),
                           hint="start another job (another job id or URL) to train again")

    def end_job(self) -> None:
        """Mark the job as ended (not a collective; any member, typically every member
        after the job's last round; the first mark wins): a process that tries to join
        later gets ``JobEnded`` at once instead of waiting for a round that never
        comes. The mark is never removed: the job id is then used up."""
        self._check_usable()
        try:
            self._storage.put(self._key(names.ELASTIC_ENDED),
                              [encode_record({"round": self._roster.round,
                                              "member": self.member_id}, self._secret)],
                              exclusive=True)
        except FileExistsError:
            pass  # another member marked it first

    def _adopt(self, roster: Roster) -> None:
        """Make ``roster`` current: rank, world size and the membership counters."""
        members = list(roster.members)
        self._changed = members != self.membership
        self.membership = members
        self._roster = roster
        self.rank = members.index(self.member_id)
        self.world_size = len(members)

    # -- one round ------------------------------------------------------------------------
    # A collective call is one round, however many dtype buckets its tensors make: the
    # buckets' bytes travel in one object, so the membership cannot change between
    # the buckets of one call (a broadcast's source, an average's weights).

    def _codecs(self, flats: list[torch.Tensor], encoded: bool) -> list[Codec]:
        """Each flat's codec: ``wire_dtype``'s for an average's contributions
        (``encoded``), the exact bytes otherwise (broadcasts, gathers, barriers)."""
        return [self._encoder.codec(f.dtype) if encoded else RawCodec(f.dtype)
                for f in flats]

    def _encode(self, flats: list[torch.Tensor], codecs: list[Codec]) -> list:
        """The wire bytes of each flat (host numpy uint8), through its codec; int8 error
        feedback is keyed by the running stream and the flat's place in the call."""
        parts = []
        for i, (flat, codec) in enumerate(zip(flats, codecs)):
            if codec.raw:
                parts.append(as_uint8(flat.contiguous().cpu()).numpy())
            else:  # the encoder reuses one buffer per call: keep a copy per flat
                parts.append(self._encoder.encode(flat.contiguous(), codec, ("contribution", i))
                             .cpu().numpy().copy())
        return parts

    def _exchange(self, flats: list[torch.Tensor], codecs: list[Codec], weight: float,
                  digest: bytes, send: bool, tree: bool = False) -> tuple[Roster, Roster, list]:
        """Write this member's contribution to the next round and agree on its roster.
        Returns (previous roster, new roster, the contribution's bytes per flat: empty
        when nothing was sent); raises ``PeerFailed`` if dropped. With ``tree`` the
        contribution is written as the tree's slices, then a header-only marker (what
        the roster's checker looks for)."""
        prev = self._roster
        round_ = prev.round + 1
        pos = prev.members.index(self.member_id)
        wire = self._encode(flats, codecs) if send else []
        total = sum(c.nbytes(f.numel()) for f, c in zip(flats, codecs))
        if tree:
            slices = TreeRound(self, plan(len(prev.members), self._fan_in), prev,
                               Roster(round_, (), (), 0), Units(flats, codecs), digest,
                               wire, weight, 0.0)
            with self._stats.phase("write_s"):
                slices.write_slices(wire, weight)
            parts, flags = [], FLAG_EMPTY
        else:
            parts = [p for p in wire if p.nbytes]
            flags = 0 if send and total else FLAG_EMPTY
        key = self._key(names.elastic_contribution(round_, self.member_id))
        with self._stats.phase("write_s"):
            self._put_object(key, self._expected(round_, prev, digest, total), pos, parts,
                             weight, flags, round_)
        agreement = self._agreement
        agreement.layout = self._call_layout
        agreement.fits = lambda r, member: self._fits(r, member, prev, digest, total)
        with self._stats.phase("wait_s"):
            roster = agreement.wait(round_, prev, list(prev.members[:pos]),
                                    time.monotonic() + self.timeout,
                                    sizes=self.contribution_sizes(total, tree))
        if self.member_id in roster.refused:
            self._storage.delete([k for r, k in self._mine if r == round_])
            mine = self._call_layout or {}
            raise LayoutMismatch(
                f"this member was refused by the elastic job at round {round_}: its first "
                "collective does not fit the job's ("
                + describe_mismatch(mine, roster.layout, pos, 0) + ")", rank=pos,
                collective=round_, path=self._storage.path_of(key),
                hint="start every member with the same model and calls (pass spec= to be "
                "refused before joining); the job's members went on without this one")
        if self.member_id not in roster.contributors:
            # nobody reads what it wrote for this round (a tree round's slices too)
            self._storage.delete([k for r, k in self._mine if r == round_])
            raise MemberDropped(
                f"this member was dropped from round {round_}: the others found it gone "
                "(heartbeat silent past heartbeat_timeout) before its contribution came",
                collective=round_, path=self._storage.path_of(key),
                hint="connect again with elastic=True to rejoin as a new member")
        if self.member_id not in roster.members:
            # its contribution counts in this round (others read it: it stays), but the
            # checker knew it gone (left, aborted, or silent past the timeout)
            raise MemberDropped(
                f"this member was dropped after round {round_}: the others found it gone "
                "(heartbeat said left/aborted, or silent past heartbeat_timeout)",
                collective=round_, path=self._storage.path_of(key),
                hint="connect again with elastic=True to rejoin as a new member")
        # everyone who reads round r has finished it once roster r+2 exists (its
        # contributors finished r+1, hence r): older own contributions are garbage
        done = [k for r, k in self._mine if r <= round_ - 2]
        if done:
            self._storage.delete(done)
            self._mine = [(r, k) for r, k in self._mine if r > round_ - 2]
        return prev, roster, wire

    def _fits(self, round_: int, member: str, prev: Roster, digest: bytes, total: int) -> bool:
        """Whether ``member``'s contribution to ``round_`` has this round's layout (its
        MAC verified first: a forged object is ``ShardCorrupt``, not a misfit). One far
        larger than any of this round's does not fit, whatever it says."""
        key = self._key(names.elastic_contribution(round_, member))
        head = HEADER_SIZE + (MAC_SIZE if self._secret is not None else 0)
        try:
            reader = self._storage.open(key, max_bytes=2 * (head + total) + RECORD_LIMIT,
                                        rank=self.rank)
        except ShardCorrupt:
            return False
        if reader is None:
            return True
        with reader:
            buf = bytearray(reader.size)
            raw = bytes(buf[:reader.readinto(buf)])

        class Misfit(Exception):
            pass

        def misfit(_src, _theirs):
            return Misfit()

        try:
            self._verified(raw, key, self._expected(round_, prev, digest, total),
                           prev.members.index(member), f"member {member}", round_, misfit)
        except Misfit:
            return False
        return True

    def _expected(self, round_: int, prev: Roster, digest: bytes, total: int) -> Expected:
        """What every contribution to ``round_`` says about itself (the storage
        transport's header and checks): this job's tag, the round, the writer's rank in
        roster ``round_ - 1`` (which names the member), the layout and the size."""
        return Expected(KIND_CONTRIB, torch.uint8, _BYTES, digest, Part.whole(total),
                        len(prev.members), self._tag, round_)

    def contribution_sizes(self, total: int, tree: bool = False) -> tuple[int, ...]:
        """The legal sizes of a contribution of ``total`` payload bytes: empty (a zero
        weight, a barrier, a tree round's marker) and full; anything else is not one."""
        head = HEADER_SIZE + (MAC_SIZE if self._secret is not None else 0)
        return (head,) if tree else (head, head + total)

    def _put_object(self, key: str, expected: Expected, writer: int, parts: list,
                    weight: float, flags: int, round_: int, exclusive_ok: bool = False,
                    what: str = "contribution") -> None:
        """Write one object of round ``round_`` under ``expected``'s header (exclusive
        create; deleted with this member's other objects of the round). A name already
        taken is ``ShardCorrupt`` (only this member writes it: something planted it),
        unless ``exclusive_ok``: a tree object another member computed first (the
        same bytes)."""
        nbytes = sum(p.nbytes if hasattr(p, "nbytes") else len(p) for p in parts)
        header = expected.header(writer, weight=weight, nbytes=nbytes, flags=flags)
        try:
            self._storage.put(key, [seal(header, parts, self._secret), *parts], exclusive=True)
        except FileExistsError:
            if exclusive_ok:
                return
            raise ShardCorrupt(
                f"an object already lies under this member's {what} to round {round_} "
                f"({key.rsplit('/', 1)[-1]}; planted by something else: this member "
                "never wrote it)",
                rank=self.rank, collective=round_, path=self._storage.path_of(key),
                hint="let nothing else write under this URL; set a secret so planted "
                "objects are refused by every member") from None
        self._mine.append((round_, key))

    def _verified(self, raw: bytes, key: str, expected: Expected, src: int, who: str,
                  round_: int, mismatch) -> tuple:
        """(header, payload view) of ``raw``, the object at ``key``: its MAC (or
        checksum) verified before any field is used, then the job's tag, the round and
        every field ``expected`` names (``src``: the writer field it must carry)."""
        path = self._storage.path_of(key)
        header = parse_header(raw, path=path, rank=self.rank, key=self._secret)
        check = PayloadCheck(header, raw[:header.size], self._secret, path, self.rank)
        payload = memoryview(raw)[header.size:]
        check.update(payload)
        check.finish()
        if header.generation != self._tag or header.collective != round_:
            raise ShardCorrupt(
                f"the object under {who}'s {key.rsplit('/', 1)[-1]} of round {round_} "
                f"belongs to job tag {header.generation:016x} round {header.collective} "
                f"(this job: {self._tag:016x}); a copied or replayed object", rank=self.rank,
                collective=round_, path=path,
                hint="give each job its own id and set a secret; let nothing else write "
                "under this URL")
        expected.check(header, src, path, self.rank, mismatch)
        return header, payload

    def _read_verified(self, key: str, expected: Expected, src: int, who: str,
                       round_: int) -> tuple | None:
        """The verified object at ``key`` of exactly the size ``expected`` allows
        (header only when empty), or None while it does not exist."""
        head = HEADER_SIZE + (MAC_SIZE if self._secret is not None else 0)
        path = self._storage.path_of(key)

        def mismatch(_src, _theirs):
            # a tree object's digest covers its name: another one is a copy, not a layout
            return ShardCorrupt(
                f"the object under {key.rsplit('/', 1)[-1]} was made for another place in "
                f"round {round_}'s tree or another layout (a copied object)",
                rank=self.rank, collective=round_, path=path,
                hint="let nothing else write under this URL; set a secret")

        if expected.kind == KIND_CONTRIB:
            mismatch = self._layout_mismatch(round_, who, src, path)
        with self._stats.phase("read_s"):
            raw = read_sized(self._storage, key, (head, head + expected.part.count),
                             rank=self.rank, collective=round_)
        if raw is None:
            return None
        return self._verified(raw, key, expected, src, who, round_, mismatch)

    def _layout_mismatch(self, round_: int, who: str, src: int, path: str):
        def mismatch(_src, _theirs):
            return LayoutMismatch(
                f"{who} (rank {src}) called round {round_} with another layout "
                "(operation, dtypes or shapes) than this member", rank=self.rank,
                collective=round_, path=path,
                hint="every member must call the same collectives in order")
        return mismatch

    def _explain_missing(self, round_: int, member: str, prev: Roster, digest: bytes,
                         total: int) -> None:
        """A slice of ``member``'s tree contribution is missing although its marker was
        seen: ``LayoutMismatch`` when its marker is a contribution of another layout
        (a member that did not take the tree's path), else nothing (it was deleted)."""
        key = self._key(names.elastic_contribution(round_, member))
        src = prev.members.index(member)
        path = self._storage.path_of(key)
        # bounded as a whole contribution of another layout is (rounds.read_sized)
        reader = self._storage.open(key, max_bytes=2 * (HEADER_SIZE + MAC_SIZE + total)
                                    + RECORD_LIMIT, rank=self.rank)
        if reader is None:
            return
        with reader:
            head = bytearray(HEADER_SIZE)
            got = reader.readinto(head)
        header = parse_header(head[:got], path=path, rank=self.rank, key=self._secret)
        if header.layout != digest:
            raise self._layout_mismatch(round_, f"member {member}", src, path)(src, None)

    def _contribution(self, round_: int, member: str, prev: Roster, digest: bytes,
                      flats: list[torch.Tensor], codecs: list[Codec]) -> tuple[float, list | None]:
        """(weight, one tensor per flat, or None when empty) of ``member``'s verified
        contribution to ``round_``: its size is one of the two legal ones before a byte
        is read, its MAC (or checksum) verified before any field is used, and every
        header field checked against the round's ``Expected``."""
        key = self._key(names.elastic_contribution(round_, member))
        path = self._storage.path_of(key)
        total = sum(c.nbytes(f.numel()) for f, c in zip(flats, codecs))
        mismatch = self._layout_mismatch(round_, f"member {member}",
                                         prev.members.index(member), path)

        def wrong_size(reader):
            # another size is another layout, or a forgery: the header (crc-checked, not
            # yet authenticated) tells which to report; either way nothing is used
            head = bytearray(HEADER_SIZE)
            got = reader.readinto(head)
            header = parse_header(head[:got], path=path, rank=self.rank, key=self._secret)
            if header.layout != digest:
                raise mismatch(prev.members.index(member), header.layout)

        raw = self._agreement.take(round_, member)
        if raw is None:
            with self._stats.phase("read_s"):
                raw = read_sized(self._storage, key, self.contribution_sizes(total),
                                 rank=self.rank, collective=round_, wrong_size=wrong_size)
        if raw is None:
            raise MemberDropped(
                f"the contribution of member {member} to round {round_} is gone: this "
                "member fell behind and the others have moved on", collective=round_,
                path=path, hint="connect again with elastic=True to rejoin")
        header, payload = self._verified(
            raw, key, self._expected(round_, prev, digest, total), prev.members.index(member),
            f"member {member}", round_, mismatch)
        if header.flags & FLAG_EMPTY:
            return header.weight, None
        views, offset = [], 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only buffer: only ever read
            for f, codec in zip(flats, codecs):
                n = codec.nbytes(f.numel())
                views.append(self._decode(payload[offset:offset + n], f, codec))
                offset += n
        return header.weight, views

    @staticmethod
    def _decode(data, flat: torch.Tensor, codec: Codec) -> torch.Tensor:
        """``flat``'s values held by ``data`` (its wire bytes through ``codec``)."""
        if not len(data):
            return flat.new_empty(0)
        if codec.raw:
            return torch.frombuffer(data, dtype=flat.dtype)
        return codec.decode(torch.frombuffer(data, dtype=torch.uint8), flat.numel())

    def _average(self, tensors, weight, stream):
        with torch.no_grad():
            planned = self._buckets("average", tensors)
            flats = [bucket.flat(self._pool) for bucket, _, _ in planned]
            # codec state (int8 error feedback) belongs to what the data is, not its shape
            self._encoder.stream = (stream, planned[0][1])
            self._call_layout = planned[0][2]
            total = self._average_flats([f for f, _ in flats], weight, planned[0][1])
            if total > 0:
                for (bucket, _, _), (flat, is_copy) in zip(planned, flats):
                    if is_copy:
                        bucket.scatter(flat)
        return total

    def _average_flats(self, flats: list[torch.Tensor], weight: float, digest: bytes) -> float:
        """Every contributor's flats summed in roster order, each into its own
        accumulator (float32 for half types), divided once by the total weight."""
        codecs = self._codecs(flats, encoded=True)
        members = len(self._roster.members)
        if members >= TREE_FROM and sum(f.numel() for f in flats):
            return self._tree_average(flats, codecs, weight, digest)
        prev, roster, wire = self._exchange(flats, codecs, weight, digest, send=weight > 0)
        accs = [self._pool.get(f"acc{i}", f.numel(), accumulator_dtype(f.dtype), f.device)
                for i, f in enumerate(flats)]
        # this member's own contribution counts as what it sent, like everyone else's
        own = [f if c.raw else self._decode(p, f, c) for f, c, p in zip(flats, codecs, wire)]
        weights, first = [], True
        for member in roster.contributors:
            if member == self.member_id:
                w, values = weight, own
            else:
                w, values = self._contribution(roster.round, member, prev, digest, flats,
                                               codecs)
            with self._stats.phase("reduce_s"):
                if w > 0 and values is not None:
                    for acc, v in zip(accs, values):
                        accumulate(acc, v.to(acc.device), w, first=first)
                    first = False
            weights.append(w)
        total = total_weight(weights)
        if total > 0:
            with self._stats.phase("reduce_s"):
                for flat, acc in zip(flats, accs):
                    divide_into(flat, acc, total)
        self._adopt(roster)
        return total

    def _tree_average(self, flats: list[torch.Tensor], codecs: list[Codec], weight: float,
                      digest: bytes) -> float:
        """The average through the tree (``tree.py``): from ``TREE_FROM`` members on."""
        prev = self._roster
        prev_, roster, wire = self._exchange(flats, codecs, weight, digest, send=weight > 0,
                                             tree=True)
        tree = TreeRound(self, plan(len(prev.members), self._fan_in), prev, roster,
                         Units(flats, codecs), digest, wire, weight,
                         time.monotonic() + self.timeout)
        total = tree.run(flats)
        self._adopt(roster)
        return total

    def _broadcast(self, tensors, src):
        with torch.no_grad():
            planned = self._buckets("broadcast", tensors)
            flats = [bucket.flat(self._pool) for bucket, _, _ in planned]
            self._call_layout = planned[0][2]
            if self._broadcast_flats([f for f, _ in flats], src, planned[0][1]):
                for (bucket, _, _), (flat, is_copy) in zip(planned, flats):
                    if is_copy:
                        bucket.scatter(flat)

    def _broadcast_flats(self, flats: list[torch.Tensor], src: int, digest: bytes) -> bool:
        """The source's flats into ``flats``; True when they changed (not the source)."""
        codecs = self._codecs(flats, encoded=False)
        prev, roster, _ = self._exchange(flats, codecs, 1.0, digest, send=self.rank == src)
        source = prev.members[src]
        if source not in roster.contributors:
            raise PeerFailed(f"the broadcast source (rank {src}, member {source}) left "
                             f"during round {roster.round}", rank=self.rank,
                             collective=roster.round, path=self.url,
                             hint="broadcast again from a member that is still there")
        changed = source != self.member_id
        if changed:
            _w, values = self._contribution(roster.round, source, prev, digest, flats,
                                            codecs)
            for flat, v in zip(flats, values or []):
                flat.copy_(v.to(flat.device))
        self._adopt(roster)
        return changed

    # -- the backend primitives (each one round) ----------------------------------------------
    def _average_flat(self, flat, weight, digest, layout):
        self._encoder.stream = (layout.get("stream"), digest)
        self._call_layout = layout
        return self._average_flats([flat], weight, digest)

    def _broadcast_flat(self, flat, src, digest, layout):
        self._call_layout = layout
        self._broadcast_flats([flat], src, digest)

    def _all_gather_flat(self, flat, digest, layout):
        """One tensor per contributor of the round, in roster order (its length is the
        round's membership, which may differ from ``world_size`` afterwards)."""
        codecs = self._codecs([flat], encoded=False)
        self._call_layout = layout
        prev, roster, _ = self._exchange([flat], codecs, 1.0, digest, send=True)
        out = []
        for member in roster.contributors:
            if member == self.member_id:
                out.append(flat.clone())
                continue
            _w, values = self._contribution(roster.round, member, prev, digest, [flat],
                                            codecs)
            out.append(values[0].clone().to(flat.device) if values is not None
                       else flat.new_empty(0))
        self._adopt(roster)
        return out

    def _barrier(self, digest, layout):
        self._call_layout = layout
        prev, roster, _ = self._exchange([], [], 1.0, digest, send=False)
        for member in roster.contributors:  # the layout check: every member is in a barrier
            if member != self.member_id:
                self._contribution(roster.round, member, prev, digest, [], [])
        self._adopt(roster)

    def _publish_abort(self, exc):
        # the others drop this member at once instead of after the heartbeat timeout
        self._heartbeat.announce(ABORTED)

    def _shutdown(self, failure):
        # own contributions stay: slower members may still be reading the last ones
        self._heartbeat.stop(ABORTED if failure is not None else LEFT)
        self._storage.close()

    # -- state for joiners ------------------------------------------------------------------
    def publish_state(self, tensors, meta: dict | None = None) -> int:
        """Publish ``tensors`` (a list, or a dict by name) and a small JSON ``meta`` dict
        as the job's state after the current round. Not a collective: typically rank 0
        calls it after a round that admitted newcomers. Returns the round."""
        self._check_usable()
        return self._state.publish(tensors, self._roster.round, self.rank, meta)

    def fetch_state(self, tensors) -> int | None:
        """Copy the newest published state into ``tensors`` (same dtypes and shapes as
        published, else ``LayoutMismatch``); the round it was published after, or None
        if nothing was published yet. Not a collective."""
        self._check_usable()
        return self._state.fetch(tensors, time.monotonic() + self.timeout, self.rank)

    def read_state(self, min_round: int | None = None, timeout: float | None = None, *,
                   publisher: str | None = None,
                   max_bytes: int = DEFAULT_MAX_STATE_BYTES) -> PublishedState | None:
        """The newest published state as new tensors (by name) and its ``meta``, for a
        joiner that cannot shape the tensors itself. Not a collective.

        With ``min_round``, waits (up to ``timeout``, default the sync's) for a state
        published after that round, e.g. the round that admitted this member, and
        raises ``SyncTimeout`` if none comes; with ``publisher`` (a member id, e.g.
        ``membership[0]``) too, the wait ends with ``PeerFailed`` as soon as that
        member is gone (left, aborted or silent). Without ``min_round``, returns None
        when nothing was published yet. A manifest declaring more than ``max_bytes``
        (default 16 GiB) is ``ShardCorrupt`` before anything is allocated by it."""
        self._check_usable()
        wait = self.timeout if timeout is None else validate.number(
            "timeout", timeout, positive=True)
        key = self._key(names.ELASTIC_STATE_POINTER)

        def give_up() -> None:
            state = self._watch.state(publisher)
            if state != "alive":
                raise PeerFailed(f"member {publisher}, which was to publish the state after "
                                 f"round {min_round}, is gone ({state})", rank=self.rank,
                                 collective=min_round, path=self._storage.path_of(key),
                                 hint="connect again to join through another round")

        max_bytes = validate.integer("max_bytes", max_bytes, minimum=0)
        return self._state.read(time.monotonic() + wait, self.rank, min_round,
                                give_up if publisher is not None else None, max_bytes)

    def __repr__(self) -> str:
        return (f"ElasticSync(url={self.url!r}, member={self.member_id}, rank={self.rank}, "
                f"world_size={self.world_size})")
