"""``StorageSync``: collectives through a shared directory or an fsspec object store.

What is here is connecting and the reduce algorithms (root, sharded, gather, exact copy:
docs/design.md#data-path-of-one-average); objects go through ``GenerationObjects``
(``objects.py``), headers through ``Expected`` (``incoming.py``), codecs through
``Encoder``, options through ``StorageOptions``.
"""

from __future__ import annotations

import logging

import torch

from ferrosync.api import GradSync
from ferrosync.compression.codecs import Codec, RawCodec, accumulator_dtype, as_uint8
from ferrosync.compression.encoder import Encoder
from ferrosync.core.common import accumulate, divide_into, total_weight
from ferrosync.errors import ShardCorrupt
from ferrosync.storage import names
from ferrosync.storage.engines import open_storage, probe_location
from ferrosync.storage.incoming import Expected, Part
from ferrosync.storage.liveness import Heartbeat, PeerMonitor, publish_abort
from ferrosync.storage.messages import Mailbox
from ferrosync.storage.objects import GenerationObjects
from ferrosync.storage.options import StorageOptions
from ferrosync.storage.rendezvous import rendezvous
from ferrosync.storage.wire import (
    FLAG_EMPTY,
    FLAG_UNCHANGED,
    KIND_BROADCAST,
    KIND_CONTRIB,
    KIND_RESULT,
    VERSION,
)

_log = logging.getLogger(__name__)


class StorageSync(GradSync):
    """GradSync over a shared directory (local, NFS) or an fsspec object store
    (S3, GCS, Azure, ...)."""

    point_to_point = True

    @classmethod
    def check_options(cls, options: dict) -> StorageOptions:
        return StorageOptions.parse(options)

    def __init__(self, url: str, identity, timeout: float, options: StorageOptions) -> None:
        storage = open_storage(url, options.storage_options, timeout=timeout,
                               transfer=options.transfer(), rank=identity.rank)
        timing = options.timing(storage)
        super().__init__(url, identity, timeout, storage.counters, options.bucket_bytes)
        self._storage = storage
        self._opts = options
        self.wire_dtype = options.wire_dtype
        # objects are bound to their job through the generation token in every header
        # (covered by the MAC): a generation is announced in exactly one job's namespace
        self._key: bytes | None = options.secret
        self.job: str | None = options.job
        poll, interval = timing.poll, timing.heartbeat_interval
        self._encoder = Encoder.for_options(options, self.buffers)
        self._heartbeat = None
        self._objects: GenerationObjects | None = None
        try:
            probe_location(storage, self.rank)
            # the rendezvous record keeps every shared setting as a string
            settings = {k: str(v) for k, v in options.shared_settings().items()}
            settings.update(world_size=self.world_size, format=VERSION,
                            auth=self._key is not None)
            self._generation = rendezvous(
                storage, self.rank, self.world_size, settings, key=self._key,
                timeout=timeout, poll=poll, heartbeat_interval=interval, url=url,
                job=self.job, claim_window=options.claim_window,
            )
        except BaseException:
            self.guard.abandon()
            storage.close()
            raise
        prefix = self._generation.prefix
        monitor = PeerMonitor(storage, prefix, self.rank, interval,
                              timing.heartbeat_timeout, self._key, url)
        self._objects = GenerationObjects(
            storage, prefix, self._generation, rank=self.rank, world_size=self.world_size,
            key=self._key, poll=poll, monitor=monitor, stats=self.stats_book, timeout=timeout,
            url=url)
        self._objects.before_put = self.guard.raise_if_failed
        self._mailbox = Mailbox(
            self._objects, world_size=self.world_size, monitor=monitor, stats=self.stats_book,
            timeout=timeout, pool=self.buffers, chunk_bytes=options.chunk_bytes)
        if self.world_size > 1:
            self._heartbeat = Heartbeat(storage, prefix, self.rank, interval, self._key,
                                        self._generation.number)
            self._heartbeat.start()

    @property
    def unauthenticated_storage(self) -> bool:
        return self._key is None

    @property
    def generation(self) -> int:
        return self._generation.number

    @property
    def generation_url(self) -> str:
        """Where this generation's objects live (``<url>/g<n>.<token>``)."""
        return self._storage.path_of(self._generation.prefix)

    # -- helpers ---------------------------------------------------------------------------
    def _begin(self, op: str) -> int:
        seq = self._objects.begin(op)
        heartbeat = self._heartbeat  # read once: another thread's abort may clear it
        if heartbeat is not None:
            heartbeat.set_position(seq, op)
        return seq

    def _mode(self, nbytes: int) -> str:
        """The reduce algorithm for a payload of ``nbytes``: the same on every rank (it
        depends on shared settings, the world size and the kind of store only)."""
        mode = self._opts.reduce
        if mode == "auto":
            if (self._storage.round_trips_dominate
                    and self.world_size <= self._opts.gather_max_ranks):
                mode = "gather"
            elif nbytes >= self._opts.sharded_min_bytes:
                mode = "sharded"
            else:
                mode = "root"
        return mode

    def _expect(self, kind: int, dtype: torch.dtype, codec: Codec, digest: bytes,
                part: Part) -> Expected:
        return Expected(kind, dtype, codec, digest, part, self.world_size,
                        self._generation.tag, self._objects.seq)

    def _open(self, name: str, src: int, expected: Expected, wait_on, what: str):
        """Wait for ``name`` (written by rank ``src``) and check it against ``expected``."""
        objects = self._objects
        incoming = objects.wait_open(name, wait_on, what,
                                     expected.codec.nbytes(expected.part.count))
        try:
            expected.check(incoming.header, src, incoming.path, self.rank,
                           lambda other, theirs: objects.mismatch(other, theirs,
                                                                  expected.digest,
                                                                  incoming.path))
        except BaseException:
            incoming.reader.close()
            raise
        return incoming

    def _read_into(self, incoming, out: torch.Tensor, codec: Codec) -> None:
        incoming.read_into(out, codec, self._opts.chunk_bytes, self.buffers, self.stats_book)

    def _publish(self, name: str, expected: Expected, parts: list, weight: float,
                 flags: int = 0) -> None:
        header = expected.header(self.rank, weight=weight,
                                 nbytes=sum(p.nbytes for p in parts), flags=flags)
        self._objects.put(name, header, parts)

    # -- primitives ------------------------------------------------------------------------
    def _average_flat(self, flat, weight, digest, layout):
        s = self._begin(layout["op"])
        # codec state (int8 error feedback) belongs to what the data is, not its shape
        self._encoder.stream = (layout.get("stream"), digest)
        if self.world_size == 1:
            return weight
        self._objects.ensure_layout(digest, layout)
        codec = self._encoder.codec(flat.dtype)
        nbytes = flat.numel() * flat.element_size()
        mode = self._mode(nbytes)
        if layout["op"] == "barrier" and mode != "gather":
            # a barrier carries no data: never sharded; where gather is picked it is
            # the better barrier (one round trip, the ranks leave together: SeaweedFS,
            # 2 ranks, 5-6 ms and ~2.4 requests per rank instead of 14-15 ms and ~4.6)
            mode = "root"
        elif not codec.lossy_result:
            # topk: the average of sparse payloads is dense, so no rank publishes it;
            # every rank gathers the sparse contributions and sums them in rank order
            # (StorageOptions refuses reduce='root'/'sharded' with it)
            mode = "gather"
        if mode == "sharded":
            return self._average_sharded(s, flat, weight, digest, codec)
        if mode == "gather":
            return self._average_gathered(s, flat, weight, digest, codec)
        return self._average_root(s, flat, weight, digest, codec)

    def _barrier(self, digest, layout):
        self._average_flat(torch.empty(0), 1.0, digest, layout)

    def _reduce_from(self, acc, own: torch.Tensor, own_weight: float, names_by_rank: dict,
                     expected: Expected) -> list[float]:
        """Sum every rank's contribution to ``acc`` in rank order; return the weights.

        ``names_by_rank[k]`` is rank k's object name; ``own`` stands for this rank's slot
        and has been through the codec like every other rank's payload.
        """
        weights = []
        first = True
        objects = self._objects
        objects.gathering = names_by_rank
        for k in range(self.world_size):
            if k == self.rank:
                w = own_weight
                if w > 0:
                    with self.stats_book.phase("reduce_s"):  # own may be acc (rank 0)
                        accumulate(acc, own.to(acc.device), w, first=first)
                    first = False
                weights.append(w)
                continue
            incoming = self._open(names_by_rank[k], k, expected, range(k, self.world_size),
                                  f"contribution of rank {k}")
            with incoming:
                w = incoming.header.weight
                if w > 0:
                    for values, lo, hi in incoming.chunks(expected.codec, acc.device,
                                                          self._opts.chunk_bytes, self.buffers,
                                                          self.stats_book):
                        accumulate(acc[lo:hi], values, w, first=first)
                    first = False
            weights.append(w)
        objects.gathering = None
        return weights

    def _own_contribution(self, flat: torch.Tensor, payload, codec: Codec, part: Part,
                          device) -> torch.Tensor:
        """This rank's slot in the reduce: through the same encoding as every other
        rank's contribution (so a lossy codec treats every rank alike)."""
        own = flat[part.offset:part.offset + part.count]
        if payload is not None and not codec.raw:
            own = codec.decode(self._payload_part(payload, codec, part).to(device), part.count)
        return own

    @staticmethod
    def _payload_part(payload: torch.Tensor, codec: Codec, part: Part) -> torch.Tensor:
        """The bytes of ``part`` in an encoded payload (slices start on frame bounds)."""
        start = part.offset // codec.frame_elems * codec.frame_bytes
        return payload[start:start + codec.nbytes(part.count)]

    def _publish_result(self, name: str, acc: torch.Tensor, out: torch.Tensor, total: float,
                        expected: Expected) -> None:
        """Divide once, encode, publish; then decode the published bytes into ``out``."""
        codec = expected.codec
        direct = codec.raw and out.device.type == "cpu"
        with self.stats_book.phase("reduce_s"):
            if total == 0:
                parts, flags = [], FLAG_UNCHANGED
            elif direct:
                # divide straight into the output (rounding once to its dtype) and
                # publish those very bytes: no extra copy, and this rank provably holds
                # what every other rank will read
                divide_into(out, acc, total)
                parts, flags = [as_uint8(out).numpy()], 0
            else:
                divide_into(acc, acc, total)
                result = acc if acc.dtype == out.dtype else acc.to(out.dtype)
                payload = self._encoder.encode(result, codec, ("result", expected.part.index))
                parts, flags = [payload.numpy()], 0
        with self.stats_book.phase("write_s"):
            self._publish(name, expected, parts, total, flags)
        if total == 0 or direct:
            return
        with self.stats_book.phase("reduce_s"):
            # every rank, this one included, ends with the decoded published bytes
            if codec.raw and result.device == out.device:
                if result.data_ptr() != out.data_ptr():
                    out.copy_(result)
            else:
                out.copy_(codec.decode(payload.to(acc.device), acc.numel()))

    def _reduce_and_publish(self, flat, weight, payload, codec, digest, part: Part,
                            result_name: str, names_by_rank: dict) -> tuple:
        """Reducer of ``part``: accumulate every rank's contribution, publish an error
        record where the peers wait if that fails. Returns (accumulator, total weight)."""
        device = torch.device(self._opts.reduce_device or flat.device)
        own = self._own_contribution(flat, payload, codec, part, device)
        if (self.rank == 0 and codec.raw and device == flat.device
                and accumulator_dtype(flat.dtype) == flat.dtype):
            # rank 0 comes first in the rank-order sum, so it accumulates in its own
            # tensor (own is a view of flat): the same operations and bits as a separate
            # accumulator without a second payload-sized buffer or a copy pass (64 MiB:
            # peak RSS 137 -> 73 MB above baseline); a failed call leaves it undefined
            acc = own
        else:
            acc = self.buffers.get("acc", part.count, accumulator_dtype(flat.dtype), device)
        try:
            weights = self._reduce_from(acc, own, weight, names_by_rank,
                                        self._expect(KIND_CONTRIB, flat.dtype, codec, digest,
                                                     part))
        except BaseException as exc:
            self._objects.publish_error(result_name, exc)
            raise
        return acc, total_weight(weights)

    # root ----------------------------------------------------------------------------------
    def _average_root(self, s, flat, weight, digest, codec):
        n = flat.numel()
        whole = Part.whole(n)
        objects = self._objects
        result_name = names.result(s)
        if self.rank != 0:
            with self.stats_book.phase("write_s"):
                payload = self._encoder.encode(flat, codec, (0,)) if weight > 0 else None
                parts = [payload.numpy()] if payload is not None else []
                self._publish(names.contribution(s, self.rank),
                              self._expect(KIND_CONTRIB, flat.dtype, codec, digest, whole),
                              parts, weight, 0 if parts else FLAG_EMPTY)
            incoming = self._open(result_name, 0,
                                  self._expect(KIND_RESULT, flat.dtype, codec, digest, whole),
                                  [0], "the result from rank 0")
            with incoming:
                if not incoming.header.flags & FLAG_UNCHANGED:
                    self._read_into(incoming, flat, codec)
            # rank 0 has read our contribution (its result exists): ours to delete; and
            # it gathered every rank's, so every rank has finished earlier collectives
            objects.recycler.consumed(objects.key_of(names.contribution(s, self.rank)))
            objects.recycler.gathered([])
            return incoming.header.weight
        # rank 0's contribution goes through the same encoding as every other rank's
        payload = self._encoder.encode(flat, codec, (0,)) if weight > 0 and not codec.raw \
            else None
        acc, total = self._reduce_and_publish(
            flat, weight, payload, codec, digest, whole, result_name,
            {k: names.contribution(s, k) for k in range(self.world_size)})
        self._publish_result(result_name, acc, flat, total,
                             self._expect(KIND_RESULT, flat.dtype, codec, digest, whole))
        objects.recycler.gathered([objects.key_of(result_name)])
        return total

    # gather -------------------------------------------------------------------------------
    def _average_gathered(self, s, flat, weight, digest, codec):
        """Every rank publishes its contribution, reads every other rank's and reduces
        the whole payload itself, in rank order: one round trip through the store
        instead of root's two (contribution, then result), for (W-1)·P read per rank.
        Every rank sums the same decoded payloads in the same order with the same code,
        so the bits equal the root reduce's on every rank (a lossy result is rounded
        through the codec as root's published result is, with the same error feedback
        state on every rank). The one mode for topk: its sum is never re-encoded."""
        n = flat.numel()
        whole = Part.whole(n)
        objects = self._objects
        mine = names.contribution(s, self.rank)
        with self.stats_book.phase("write_s"):
            payload = self._encoder.encode(flat, codec, (0,)) if weight > 0 else None
            parts = [payload.numpy()] if payload is not None else []
            self._publish(mine, self._expect(KIND_CONTRIB, flat.dtype, codec, digest, whole),
                          parts, weight, 0 if parts else FLAG_EMPTY)
        acc = self.buffers.get("acc", n, accumulator_dtype(flat.dtype),
                             self._opts.reduce_device or flat.device)
        own = self._own_contribution(flat, payload, codec, whole, acc.device)
        weights = self._reduce_from(acc, own, weight,
                                    {k: names.contribution(s, k) for k in range(self.world_size)},
                                    self._expect(KIND_CONTRIB, flat.dtype, codec, digest, whole))
        total = total_weight(weights)
        if total > 0:
            with self.stats_book.phase("reduce_s"):
                if codec.raw or not codec.lossy_result:
                    divide_into(flat, acc, total)
                else:
                    divide_into(acc, acc, total)
                    result = acc if acc.dtype == flat.dtype else acc.to(flat.dtype)
                    wire = self._encoder.encode(result, codec, ("result", 0))
                    flat.copy_(codec.decode(wire.to(acc.device), n))
        # every rank published for s, so every rank finished s-1 (and read our older
        # contribution); ours for s goes once a later collective proves the same
        objects.recycler.gathered([objects.key_of(mine)])
        return total

    # sharded ------------------------------------------------------------------------------
    def _slices(self, n: int, codec: Codec) -> list[Part]:
        frames = -(-n // codec.frame_elems)
        w = self.world_size
        cuts = [min(frames * j // w * codec.frame_elems, n) for j in range(w + 1)]
        return [Part(cuts[j], cuts[j + 1] - cuts[j], n, j, w) for j in range(w)]

    def _average_sharded(self, s, flat, weight, digest, codec):
        slices = self._slices(flat.numel(), codec)
        me = self.rank
        objects = self._objects
        with self.stats_book.phase("write_s"):
            payload = self._encoder.encode(flat, codec, (0,)) if weight > 0 else None
            for part in slices:
                if part.index == me:
                    continue
                parts = [self._payload_part(payload, codec, part).numpy()] \
                    if payload is not None else []
                self._publish(names.contribution(s, me, part.index),
                              self._expect(KIND_CONTRIB, flat.dtype, codec, digest, part),
                              parts, weight, 0 if parts else FLAG_EMPTY)
        mine = slices[me]
        result_name = names.result(s, me)
        acc, total = self._reduce_and_publish(
            flat, weight, payload, codec, digest, mine, result_name,
            {k: names.contribution(s, k, me) for k in range(self.world_size)})
        # everyone finished the previous collective: our older result slices can go
        objects.recycler.gathered([])
        # our contribution to slice `me` is in acc now, so flat's slice may take the result
        self._publish_result(result_name, acc, flat[mine.offset:mine.offset + mine.count],
                             total, self._expect(KIND_RESULT, flat.dtype, codec, digest, mine))
        for part in slices:
            if part.index != me:
                self._receive_slice(s, flat, part, total, codec, digest)
        # every reducer has published, so every slice of ours was read
        objects.recycler.consumed(*(objects.key_of(names.contribution(s, me, p.index))
                                    for p in slices if p.index != me))
        objects.recycler.hold_until_gathered(objects.key_of(result_name))
        return total

    def _receive_slice(self, s, flat, part: Part, total: float, codec, digest) -> None:
        j = part.index
        incoming = self._open(names.result(s, j), j,
                              self._expect(KIND_RESULT, flat.dtype, codec, digest, part),
                              [j], f"result slice {j} from rank {j}")
        with incoming:
            if incoming.header.weight != total:
                raise ShardCorrupt(
                    f"rank {j} computed total weight {incoming.header.weight}, this rank "
                    f"{total}", rank=self.rank, collective=s, path=incoming.path)
            if total > 0:
                self._read_into(incoming, flat[part.offset:part.offset + part.count], codec)

    # exact copies (broadcast, all-gather) ---------------------------------------------------
    def _copy_expected(self, flat: torch.Tensor, digest: bytes) -> Expected:
        """Copies travel byte for byte (raw, whatever ``wire_dtype``)."""
        return self._expect(KIND_BROADCAST, flat.dtype, RawCodec(flat.dtype), digest,
                            Part.whole(flat.numel()))

    def _publish_copy(self, name: str, flat: torch.Tensor, digest: bytes) -> None:
        expected = self._copy_expected(flat, digest)
        with self.stats_book.phase("write_s"):
            payload = self._encoder.encode(flat, expected.codec, None)
            self._publish(name, expected, [payload.numpy()], 1.0)

    def _receive_copy(self, name: str, src: int, wait_on, what: str, out: torch.Tensor,
                      digest: bytes) -> None:
        """Wait for rank ``src``'s ``_publish_copy`` of ``name`` and read it into ``out``."""
        expected = self._copy_expected(out, digest)
        with self._open(name, src, expected, wait_on, what) as incoming:
            self._read_into(incoming, out, expected.codec)

    def _broadcast_flat(self, flat, src, digest, layout):
        s = self._begin("broadcast")
        if self.world_size == 1:
            return
        self._objects.ensure_layout(digest, layout)
        name = names.result(s)
        if self.rank == src:
            self._publish_copy(name, flat, digest)
        else:
            self._receive_copy(name, src, [src], f"the broadcast from rank {src}", flat, digest)
        if self.rank == 0:
            # rank 0 deletes it once every rank has shown up for a later gather
            self._objects.recycler.hold_until_gathered(self._objects.key_of(name))

    def _all_gather_flat(self, flat, digest, layout):
        s = self._begin("all_gather")
        out = [flat.clone() if k == self.rank else torch.empty_like(flat)
               for k in range(self.world_size)]
        if self.world_size == 1:
            return out
        objects = self._objects
        objects.ensure_layout(digest, layout)
        names_by_rank = {k: names.contribution(s, k) for k in range(self.world_size)}
        mine = names_by_rank[self.rank]
        self._publish_copy(mine, flat, digest)
        objects.gathering = names_by_rank
        for k in range(self.world_size):
            if k != self.rank:
                self._receive_copy(names_by_rank[k], k, range(k, self.world_size),
                                   f"the contribution of rank {k}", out[k], digest)
        objects.gathering = None
        # every rank wrote for s, so every rank finished the collectives before it
        objects.recycler.gathered([objects.key_of(mine)])
        return out

    def _all_to_all_flat(self, outputs, inputs, digest, layout):
        """Rank k publishes its chunk for rank j as ``c{s}.r{k}.s{j}`` (raw) and reads
        ``c{s}.r{j}.s{k}`` from every other rank j; chunks may differ in size (each
        reader knows what it expects from each rank, and the header says what came)."""
        s = self._begin("all_to_all")
        me = self.rank
        outputs[me].copy_(inputs[me])
        if self.world_size == 1:
            return
        objects = self._objects
        objects.ensure_layout(digest, layout)
        mine = []
        for j in range(self.world_size):
            if j != me:
                mine.append(names.contribution(s, me, j))
                self._publish_copy(mine[-1], inputs[j], digest)
        for k in range(self.world_size):
            if k != me:
                self._receive_copy(names.contribution(s, k, me), k, [k],
                                   f"the chunk rank {k} sends this rank", outputs[k], digest)
        # every rank published for s, so every rank finished the collectives before it
        objects.recycler.gathered([objects.key_of(name) for name in mine])

    # point-to-point (docs/design.md#point-to-point): messages through the ``Mailbox`` ----
    def _send_flat(self, flat, dst, tag):
        self._mailbox.send(flat, dst, tag)

    def _post_recv(self, src, tag):
        return self._mailbox.post(src, tag)

    def _recv_flat(self, flat, src, tag, number=None, block=True):
        return self._mailbox.receive(flat, src, tag, number, block=block)

    # failure and shutdown ------------------------------------------------------------------
    def _publish_abort(self, exc):
        if self._objects is None:
            return
        publish_abort(self._storage, self._objects.prefix, self.rank, exc, self._objects.seq,
                      self._key)
        if self._heartbeat is not None:
            self._heartbeat.stop("aborted")
            self._heartbeat = None

    def _shutdown(self, failure):
        try:
            if self._heartbeat is not None:
                self._heartbeat.stop("aborted" if failure is not None else "closed")
                self._heartbeat = None
            if self._generation.claim is not None:
                self._generation.claim.release()
            if failure is None:
                self._objects.recycler.release()
        except Exception:  # noqa: BLE001 - close() must not raise because storage or a
            # peer failed; the peers see our heartbeat stop either way
            _log.debug("rank %d: cleanup at close failed", self.rank, exc_info=True)
        finally:
            self._encoder.clear()
            self._storage.close()
