"""``ElasticSync``: a member of an elastic job, the ``GradSync`` that
``connect(url, elastic=True)`` returns (its collective contract: docs/elastic.md#rounds).

What lives here: connecting (the job's object layer, its record and admission:
``job.py``), the member's view of the membership, the backend primitives (each one
round through the round exchange, ``exchange.py``; averages from ``TREE_FROM``
members through the tree, ``tree.py``) and state for newcomers (``state.py``).
"""

from __future__ import annotations

import time

import torch

from ferrosync.api import GradSync, plan_layouts
from ferrosync.compression.codecs import Codec, accumulator_dtype
from ferrosync.compression.encoder import Encoder
from ferrosync.core import validate
from ferrosync.core.common import accumulate, divide_into, total_weight
from ferrosync.core.env import Identity
from ferrosync.elastic.events import Subscribers
from ferrosync.elastic.exchange import Exchange, decode
from ferrosync.elastic.job import admit, check_ended, check_record, mark_ended
from ferrosync.elastic.membership import ABORTED, LEFT, HeartbeatWatch, Roster, Rosters, heartbeat
from ferrosync.elastic.options import ElasticOptions
from ferrosync.elastic.rounds import Agreement
from ferrosync.elastic.state import DEFAULT_MAX_STATE_BYTES, PublishedState, StatePublisher
from ferrosync.elastic.tree import TREE_FROM, TreeRound, Units, plan
from ferrosync.errors import ConfigError, PeerFailed
from ferrosync.storage import names
from ferrosync.storage.engines import open_storage, probe_location
from ferrosync.storage.objects import Objects
from ferrosync.storage.wire import job_key, job_tag


def job_objects(storage, options: ElasticOptions, poll, rank=None, runtime=None) -> Objects:
    """The object layer of the elastic job ``options.job`` on ``storage``: its namespace,
    sealed with the job's own key, every header naming the job (``wire.job_key``,
    ``wire.job_tag``): an object copied from another job that shares the secret fails
    its MAC and never enters an average."""
    namespace = names.elastic_namespace(options.job)
    return Objects(storage, namespace, key=job_key(options.secret, namespace),
                   tag=job_tag(namespace), poll=poll, rank=rank, tag_name="job",
                   runtime=runtime)


def peek_state(url: str, options: dict, timeout: float = 300.0) -> PublishedState | None:
    """The newest state published in the elastic job at ``url`` (``options`` as for
    ``connect``: ``job``, ``secret``, ``storage_options``; others are ignored), read
    without joining it: for a process that found the job ended (``JobEnded``)."""
    checked = ElasticOptions.parse(options)
    storage = open_storage(url, checked.storage_options, timeout=timeout,
                           transfer=checked.transfer())
    try:
        objects = job_objects(storage, checked, (storage.poll_initial, storage.poll_max))
        return StatePublisher(objects).read(time.monotonic() + timeout, None, None)
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

    @classmethod
    def identity(cls, rank: int | None, world_size: int | None) -> Identity:
        """None yet: rank and world size follow the roster (``RANK``/``WORLD_SIZE`` in the
        environment are ignored, and passing them is a ``ConfigError``)."""
        if rank is not None or world_size is not None:
            raise ConfigError(
                "rank and world_size cannot be given with elastic=True: an elastic "
                "member's rank and world size follow the membership agreed each round",
                hint="drop rank=/world_size= (read sync.rank and sync.world_size instead)")
        return Identity(0, 1, 0, 1, "elastic")

    def __init__(self, url: str, identity: Identity, timeout: float,
                 options: ElasticOptions, *, storage=None, runtime=None) -> None:
        """``storage`` (an opened ``Storage`` for ``url``, which the member then owns)
        and ``runtime`` (a ``runtime.Runtime``: time, waits, threads) are for the
        elastic simulator (``ferrosync/testing/sim``); a real member opens ``url`` and
        runs on the process's own time."""
        if storage is None:
            # a member's rank changes: faults match its rank of the moment
            storage = open_storage(url, options.storage_options, timeout=timeout,
                                   transfer=options.transfer(), rank=lambda: self.rank)
        timing = options.timing(storage)
        super().__init__(url, identity, timeout, storage.counters)
        self._storage = storage
        self.job = options.job
        self.wire_dtype = options.wire_dtype
        #: the resolved liveness settings (the defaults depend on the kind of store)
        self.heartbeat_interval, self.heartbeat_timeout = (timing.heartbeat_interval,
                                                           timing.heartbeat_timeout)
        objects = self._objects = job_objects(storage, options, timing.poll, self.rank,
                                              runtime)
        self._clock = objects.runtime
        self.member_id = self._clock.token_hex(8)
        objects.before_put = self.guard.raise_if_failed
        self._rosters = Rosters(objects)
        self._watch = HeartbeatWatch(objects, timing.heartbeat_timeout, timing.heartbeat_interval)
        self._agreement = Agreement(objects, self._rosters, self._watch,
                                    min_ranks=options.min_ranks, max_ranks=options.max_ranks,
                                    check_interval=timing.heartbeat_interval)
        self._state = StatePublisher(objects)
        self._fan_in = options.fan_in
        self._exchange = Exchange(
            objects, self._rosters, self._agreement, self._watch,
            Encoder.for_options(options, self.buffers), self.stats_book,
            member_id=self.member_id, fan_in=options.fan_in, timeout=timeout,
            look_every=timing.heartbeat_interval)
        self._heartbeat = heartbeat(objects, self.member_id, timing.heartbeat_interval)
        self.membership: list[str] = []
        self._roster: Roster | None = None
        self._subscribers = Subscribers()
        self._connect(options, timeout)

    def _connect(self, options: ElasticOptions, timeout: float) -> None:
        """Check the job's record, introduce this member and wait for admission; on any
        failure nothing is left running (the others never wait on this member)."""
        objects, started = self._objects, False
        try:
            probe_location(self._storage, None)
            # nothing is written under the job before its record is verified: a member
            # with another secret or spec is refused without disturbing the job
            check_record(objects, options.spec, options.shared_settings(),
                         ElasticOptions.shared_defaults(), self.url)
            check_ended(objects)
            objects.put_record(names.elastic_member(self.member_id),
                               {"id": self.member_id, "min_ranks": options.min_ranks},
                               exclusive=True)
            self._heartbeat.start()
            started = True
            self._adopt(admit(objects, self._rosters, self._agreement, self.member_id,
                              self._clock.monotonic() + timeout))
        except BaseException:
            self.guard.abandon()
            if started:  # the others must not wait on a member that never joined
                self._heartbeat.stop(ABORTED)
            self._storage.close()
            raise

    # -- membership ---------------------------------------------------------------------
    @property
    def unauthenticated_storage(self) -> bool:
        return self._objects.key is None

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

    def _adopt(self, roster: Roster) -> None:
        """Make ``roster`` current: rank, world size and the membership counters."""
        members = list(roster.members)
        self._changed = members != self.membership
        self.membership = members
        self._roster = roster
        self.rank = self._objects.rank = members.index(self.member_id)
        self.world_size = len(members)
        self._subscribers.adopt(roster.round, self.rank, roster.members)

    def on_membership(self, callback) -> None:
        """``GradSync.on_membership``: ``callback`` gets the current members now, then a
        ``MembershipChange`` after every round that changed them."""
        self._subscribers.subscribe(callback, self._roster.round, self.rank,
                                    tuple(self._roster.members))

    def end_job(self) -> None:
        """Mark the job as ended (not a collective; any member, typically every member
        after the job's last round; the first mark wins): a process that tries to join
        later gets ``JobEnded`` at once instead of waiting for a round that never
        comes. The mark is never removed: the job id is then used up."""
        self.guard.check_usable()
        mark_ended(self._objects, self._roster.round, self.member_id)

    # -- one round per collective call ----------------------------------------------------------
    # A collective call is one round, however many dtype buckets its tensors make: the
    # buckets' bytes travel in one object, so the membership cannot change between
    # the buckets of one call (a broadcast's source, an average's weights).

    def _round(self, op: str, layout: dict, flats, codecs, weight: float, digest: bytes,
               send: bool, tree: bool = False) -> tuple[Roster, Roster, list]:
        """(previous roster, new roster, own wire bytes) of one round (``Exchange.run``)."""
        prev = self._roster
        self._objects.op = op
        self._exchange.layout = layout
        roster, wire = self._exchange.run(prev, flats, codecs, weight, digest, send, tree)
        return prev, roster, wire

    def _average(self, tensors, weight, stream):
        with torch.no_grad():
            planned = plan_layouts("average", tensors, self.bucket_bytes)
            flats = [bucket.flat(self.buffers) for bucket, _, _ in planned]
            # codec state (int8 error feedback) belongs to what the data is, not its shape
            self._exchange.encoder.stream = (stream, planned[0][1])
            total = self._average_flats([f for f, _ in flats], weight, planned[0][1],
                                        planned[0][2])
            if total > 0:
                for (bucket, _, _), (flat, is_copy) in zip(planned, flats):
                    if is_copy:
                        bucket.scatter(flat)
        return total

    def _average_flats(self, flats: list[torch.Tensor], weight: float, digest: bytes,
                       layout: dict) -> float:
        """Every contributor's flats summed in roster order, each into its own
        accumulator (float32 for half types), divided once by the total weight."""
        codecs = self._exchange.codecs(flats, encoded=True)
        # topk: the tree's partial sums would be dense (or, re-encoded, lossy), so a
        # sparse average is a flat round at every size: each member reads the others'
        # sparse contributions, (W-1)·P/110 bytes (docs/topk.md)
        if (len(self._roster.members) >= TREE_FROM and sum(f.numel() for f in flats)
                and all(c.lossy_result for c in codecs)):
            return self._tree_average(flats, codecs, weight, digest, layout)
        prev, roster, wire = self._round("average", layout, flats, codecs, weight, digest,
                                         send=weight > 0)
        accs = [self.buffers.get(f"acc{i}", f.numel(), accumulator_dtype(f.dtype), f.device)
                for i, f in enumerate(flats)]
        # this member's own contribution counts as what it sent, like everyone else's
        own = [f if c.raw else decode(p, f, c) for f, c, p in zip(flats, codecs, wire)]
        weights, first = [], True
        for member in roster.contributors:
            if member == self.member_id:
                w, values = weight, own
            else:
                w, values = self._exchange.contribution(roster.round, member, prev, digest,
                                                        flats, codecs)
            with self.stats_book.phase("reduce_s"):
                if w > 0 and values is not None:
                    for acc, v in zip(accs, values):
                        accumulate(acc, v.to(acc.device), w, first=first)
                    first = False
            weights.append(w)
        total = total_weight(weights)
        if total > 0:
            with self.stats_book.phase("reduce_s"):
                for flat, acc in zip(flats, accs):
                    divide_into(flat, acc, total)
        self._adopt(roster)
        return total

    def _tree_average(self, flats: list[torch.Tensor], codecs: list[Codec], weight: float,
                      digest: bytes, layout: dict) -> float:
        """The average through the tree (``tree.py``): from ``TREE_FROM`` members on."""
        prev, roster, wire = self._round("average", layout, flats, codecs, weight, digest,
                                         send=weight > 0, tree=True)
        tree = TreeRound(self._exchange, plan(len(prev.members), self._fan_in), prev, roster,
                         Units(flats, codecs), digest, wire, weight,
                         self._clock.monotonic() + self.timeout)
        # the member's garbage of round r-2 goes while it waits on the tree, not before
        total = self._clock.map(lambda job: job(), [lambda: tree.run(flats),
                                                    self._exchange.sweep], 2)[0]
        self._adopt(roster)
        return total

    def _broadcast(self, tensors, src):
        with torch.no_grad():
            planned = plan_layouts("broadcast", tensors, self.bucket_bytes)
            flats = [bucket.flat(self.buffers) for bucket, _, _ in planned]
            if self._broadcast_flats([f for f, _ in flats], src, planned[0][1],
                                     planned[0][2]):
                for (bucket, _, _), (flat, is_copy) in zip(planned, flats):
                    if is_copy:
                        bucket.scatter(flat)

    def _broadcast_flats(self, flats: list[torch.Tensor], src: int, digest: bytes,
                         layout: dict) -> bool:
        """The source's flats into ``flats``; True when they changed (not the source)."""
        codecs = self._exchange.codecs(flats, encoded=False)
        prev, roster, _ = self._round("broadcast", layout, flats, codecs, 1.0, digest,
                                      send=self.rank == src)
        source = prev.members[src]
        if source not in roster.contributors:
            raise PeerFailed(f"the broadcast source (rank {src}, member {source}) left "
                             f"during round {roster.round}", rank=self.rank,
                             collective=roster.round, path=self.url,
                             hint="broadcast again from a member that is still there")
        changed = source != self.member_id
        if changed:
            _w, values = self._exchange.contribution(roster.round, source, prev, digest,
                                                     flats, codecs)
            for flat, v in zip(flats, values or []):
                flat.copy_(v.to(flat.device))
        self._adopt(roster)
        return changed

    # -- the backend primitives (each one round) ----------------------------------------------
    def _average_flat(self, flat, weight, digest, layout):
        self._exchange.encoder.stream = (layout.get("stream"), digest)
        return self._average_flats([flat], weight, digest, layout)

    def _broadcast_flat(self, flat, src, digest, layout):
        self._broadcast_flats([flat], src, digest, layout)

    def _all_gather_flat(self, flat, digest, layout):
        """One tensor per contributor of the round, in roster order (its length is the
        round's membership, which may differ from ``world_size`` afterwards)."""
        codecs = self._exchange.codecs([flat], encoded=False)
        prev, roster, _ = self._round("all_gather", layout, [flat], codecs, 1.0, digest,
                                      send=True)
        out = []
        for member in roster.contributors:
            if member == self.member_id:
                out.append(flat.clone())
                continue
            _w, values = self._exchange.contribution(roster.round, member, prev, digest,
                                                     [flat], codecs)
            out.append(values[0].clone().to(flat.device) if values is not None
                       else flat.new_empty(0))
        self._adopt(roster)
        return out

    def _barrier(self, digest, layout):
        prev, roster, _ = self._round("barrier", layout, [], [], 1.0, digest, send=False)
        for member in roster.contributors:  # the layout check: every member is in a barrier
            if member != self.member_id:
                self._exchange.contribution(roster.round, member, prev, digest, [], [])
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
        self.guard.check_usable()
        return self._state.publish(tensors, self._roster.round, self.rank, meta)

    def fetch_state(self, tensors) -> int | None:
        """Copy the newest published state into ``tensors`` (same dtypes and shapes as
        published, else ``LayoutMismatch``); the round it was published after, or None
        if nothing was published yet. Not a collective; the tensors change only once
        the state verified."""
        self.guard.check_usable()
        return self._state.fetch(tensors, self._clock.monotonic() + self.timeout, self.rank)

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
        self.guard.check_usable()
        wait = self.timeout if timeout is None else validate.number(
            "timeout", timeout, positive=True)

        def give_up() -> None:
            state = self._watch.state(publisher)
            if state != "alive":
                raise PeerFailed(f"member {publisher}, which was to publish the state after "
                                 f"round {min_round}, is gone ({state})", rank=self.rank,
                                 collective=min_round,
                                 path=self._objects.path_of(names.ELASTIC_STATE_POINTER),
                                 hint="connect again to join through another round")

        max_bytes = validate.integer("max_bytes", max_bytes, minimum=0)
        return self._state.read(self._clock.monotonic() + wait, self.rank, min_round,
                                give_up if publisher is not None else None, max_bytes)

    def __repr__(self) -> str:
        return (f"ElasticSync(url={self.url!r}, member={self.member_id}, rank={self.rank}, "
                f"world_size={self.world_size})")
