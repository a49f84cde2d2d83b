"""``FileSync``: collectives through a shared directory or an fsspec object store.

Objects of generation ``g`` (all below ``g{g}.{token}/``; ``s`` is the collective number)::

    c{s}.r{k}          rank k's contribution                       (root reduce)
    c{s}.out           the average, published by rank 0            (root reduce)
    c{s}.r{k}.s{j}     slice j of rank k's contribution            (sharded reduce)
    c{s}.out.s{j}      slice j of the average, published by rank j (sharded reduce)
    c{s}.out           a broadcast, published by its source
    c{s}.r{k}          rank k's copy in an all-gather
    c{s}.out[.s{j}]    an error record, where the peers wait, when a reducer fails
    layout.{d}.r{k}    rank k's description of layout digest d (for mismatch errors)
    hb.r{k}, abort.r{k}  liveness (see liveness.py)

**Root reduce** (docs/design.md#root-reduce): ranks k > 0 publish their contribution;
rank 0 streams them *in rank order* into one accumulator (float32 for half types,
on the tensors' device), divides once by the total weight, publishes the result,
and every rank (rank 0 included) decodes the same published bytes, so results are
bit-identical everywhere. Rank 0's memory is the accumulator plus one read chunk,
whatever the number of ranks.

**Sharded reduce**: the flat vector is cut into ``world_size`` slices on codec
frame boundaries; rank j reduces slice j from every rank's slice object (again in
rank order, so the bits equal the root reduce's) and publishes it; every rank
reads every slice. No rank moves more than about twice the payload per
collective, and the reduce work is spread over all ranks.

**Cleanup** without coordination messages: an object is deleted by its writer
(or by rank 0 for results) once it is provably consumed: a contribution once
the result covering it was read (the result's existence proves the reducer read
it); a result once every rank has published its next contribution (which they do
only after reading the result). So at most about two collectives' objects exist.
Deletes are deferred to the next wait, where they cost no latency.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time

import torch

from ..api import GradSync
from ..codecs import (
    Codec,
    ErrorFeedback,
    Int8Codec,
    RawCodec,
    accumulator_dtype,
    as_uint8,
    check_wire_dtype,
    codec_for,
)
from ..env import ENV_JOB, ENV_SECRET, discover_job
from ..errors import (
    ConfigError,
    LayoutMismatch,
    PeerFailed,
    ShardCorrupt,
    StorageError,
    SyncTimeout,
    error_class,
)
from ..faults import FaultyStorage, load_faults
from ..liveness import Heartbeat, PeerMonitor, publish_abort
from ..rendezvous import rendezvous
from ..storage import Backoff, object_exists, open_storage
from ..wire import (
    DTYPE_CODES,
    FLAG_AUTH,
    FLAG_EMPTY,
    FLAG_UNCHANGED,
    HEADER_SIZE,
    KIND_BROADCAST,
    KIND_CONTRIB,
    KIND_ERROR,
    KIND_NAMES,
    KIND_RESULT,
    MAC_SIZE,
    VERSION,
    Header,
    PayloadCheck,
    decode_record,
    encode_record,
    parse_header,
    seal,
)

REDUCE_MODES = ("root", "sharded", "auto")
_RECYCLE_MIN_BYTES = 256 << 10

# name -> (default, description); validated in check_options
OPTIONS = {
    "reduce": ("auto", "'root', 'sharded' or 'auto' (sharded for large payloads)"),
    "wire_dtype": (None, "payload encoding: None (native), float32, bfloat16, float16, int8"),
    "secret": (None, f"shared key for authenticated objects (default ${ENV_SECRET})"),
    "job": (None, f"job id: jobs with different ids never meet on one URL (default "
                  f"${ENV_JOB}, then SLURM_JOB_ID, TORCHELASTIC_RUN_ID)"),
    "claim_window": (None, "seconds each rank waits before its first collective so a second "
                           "job claiming the same ranks is seen (default 3 without a job id, "
                           "else 0)"),
    "storage_options": (None, "dict passed to the fsspec filesystem"),
    "poll_initial": (None, "first polling sleep, seconds (default per store)"),
    "poll_max": (None, "longest polling sleep, seconds (default per store)"),
    "heartbeat_interval": (None, "seconds between heartbeats (default 1 local, 2 object stores)"),
    "heartbeat_timeout": (20.0, "seconds without a heartbeat before a peer counts as dead"),
    "bucket_bytes": (None, "split a call's tensors into objects of at most this size"),
    "chunk_bytes": (8 << 20, "bytes read per step while streaming a payload"),
    "reduce_device": (None, "where to reduce: None (the tensors' device), 'cpu' or 'cuda'"),
    "error_feedback": (True, "carry int8 quantisation error to the next call"),
    # measured (tools/bench.py, 2 and 4 ranks): sharded wins from 1 MiB up, root below
    "sharded_min_bytes": (1 << 20, "with reduce='auto': shard payloads at least this large"),
}
# Options that change what goes on the wire: every rank must agree (checked at rendezvous).
_SHARED_SETTINGS = ("reduce", "wire_dtype", "sharded_min_bytes", "bucket_bytes")


def _positive(name, value, *, integer=False, allow_none=True):
    if value is None and allow_none:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0 or (
        not integer and not math.isfinite(value)
    ):
        raise ConfigError(f"{name} must be a positive {'int' if integer else 'number'}, "
                          f"got {value!r}")
    return value


def _non_negative(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        0 <= value < math.inf
    ):
        raise ConfigError(f"{name} must be a number of seconds >= 0, got {value!r}")
    return float(value)


class FileSync(GradSync):
    """GradSync over a shared directory (local, NFS) or an fsspec object store."""

    @classmethod
    def check_options(cls, options: dict) -> dict:
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ConfigError(
                f"unknown option(s) {unknown} for a storage URL",
                hint="valid options: " + ", ".join(sorted(OPTIONS)),
            )
        out = {name: options.get(name, default) for name, (default, _) in OPTIONS.items()}
        if out["reduce"] not in REDUCE_MODES:
            raise ConfigError(f"reduce must be one of {REDUCE_MODES}, got {out['reduce']!r}")
        out["wire_dtype"] = check_wire_dtype(out["wire_dtype"])
        secret = out["secret"] if out["secret"] is not None else os.environ.get(ENV_SECRET)
        if secret is not None:
            if isinstance(secret, str):
                secret = secret.encode()
            if not isinstance(secret, (bytes, bytearray)) or not secret:
                raise ConfigError("secret must be a non-empty str or bytes")
            secret = bytes(secret)
        out["secret"] = secret
        out["job"] = discover_job(out["job"])
        if out["claim_window"] is not None:
            out["claim_window"] = _non_negative("claim_window", out["claim_window"])
        if out["storage_options"] is not None and not isinstance(out["storage_options"], dict):
            raise ConfigError("storage_options must be a dict")
        for name in ("poll_initial", "poll_max", "heartbeat_interval"):
            out[name] = _positive(name, out[name])
        out["heartbeat_timeout"] = _positive("heartbeat_timeout", out["heartbeat_timeout"],
                                             allow_none=False)
        for name in ("bucket_bytes",):
            out[name] = _positive(name, out[name], integer=True)
        out["chunk_bytes"] = _positive("chunk_bytes", out["chunk_bytes"], integer=True,
                                       allow_none=False)
        out["sharded_min_bytes"] = _positive("sharded_min_bytes", out["sharded_min_bytes"],
                                             integer=True, allow_none=False)
        if out["poll_initial"] and out["poll_max"] and out["poll_initial"] > out["poll_max"]:
            raise ConfigError("poll_initial must not exceed poll_max")
        device = out["reduce_device"]
        if device is not None:
            try:
                device = torch.device(device)
            except (RuntimeError, TypeError):
                raise ConfigError(
                    f"reduce_device must be 'cpu' or 'cuda', got {device!r}") from None
            if device.type == "cuda" and not torch.cuda.is_available():
                raise ConfigError("reduce_device='cuda' but CUDA is not available",
                                  hint="drop reduce_device or use 'cpu'")
            out["reduce_device"] = device
        if not isinstance(out["error_feedback"], bool):
            raise ConfigError("error_feedback must be True or False")
        return out

    def __init__(self, url: str, identity, timeout: float, options: dict) -> None:
        storage = open_storage(url, options["storage_options"])
        faults = load_faults(identity.rank)  # $FERROSYNC_FAULTS: tests and drills only
        if faults:
            storage = FaultyStorage(storage, faults)
        super().__init__(url, identity, timeout, storage.counters, options["bucket_bytes"])
        self._storage = storage
        self._opts = options
        # objects are bound to their job through the generation token in every header
        # (covered by the MAC): a generation is announced in exactly one job's namespace
        self._key: bytes | None = options["secret"]
        self.job: str | None = options["job"]
        self._poll = (
            options["poll_initial"] or storage.poll_initial,
            options["poll_max"] or storage.poll_max,
        )
        interval = options["heartbeat_interval"] or storage.heartbeat_interval
        if options["heartbeat_timeout"] <= 2 * interval:
            raise ConfigError(
                f"heartbeat_timeout ({options['heartbeat_timeout']:g} s) must exceed twice "
                f"the heartbeat interval ({interval:g} s)")
        self._codecs: dict[torch.dtype, Codec] = {}
        self._ef = ErrorFeedback()
        self._codec_key: tuple = (None, b"")  # codec-state key of the running collective
        self._layouts: dict[bytes, dict] = {}
        self._seq = 0
        self._op = ""
        self._deadline = 0.0
        self._garbage: list[str] = []  # provably consumed, delete at the next wait
        self._after_gather: list[str] = []  # delete once every rank has moved on
        # consumed objects this rank wrote, kept to be rewritten by later puts instead of
        # being deleted (local filesystems only, see LocalStorage.can_recycle)
        self._written: dict[str, int] = {}
        self._spares: list[tuple[int, str]] = []
        self._heartbeat = None
        self._prefix = None
        self._gathering: dict[int, str] | None = None  # names awaited in a gather
        try:
            self._probe()
            settings = {name: str(options[name]) for name in _SHARED_SETTINGS}
            settings.update(world_size=self.world_size, format=VERSION,
                            auth=self._key is not None)
            self._generation = rendezvous(
                storage, self.rank, self.world_size, settings, key=self._key,
                timeout=timeout, poll=self._poll, heartbeat_interval=interval, url=url,
                job=self.job, claim_window=options["claim_window"],
            )
        except BaseException:
            self._closed = True
            storage.close()
            raise
        self._prefix = self._generation.prefix
        self._monitor = PeerMonitor(storage, self._prefix, self.rank, interval,
                                    options["heartbeat_timeout"], self._key, url)
        if self.world_size > 1:
            self._heartbeat = Heartbeat(storage, self._prefix, self.rank, interval, self._key,
                                        self._generation.number)
            self._heartbeat.start()

    @property
    def generation(self) -> int:
        return self._generation.number

    @property
    def generation_url(self) -> str:
        """Where this generation's objects live (``<url>/g<n>.<token>``)."""
        return self._storage.path_of(self._prefix)

    # -- connect-time checks -------------------------------------------------------------
    def _probe(self) -> None:
        """Fail at connect, not at the first step, when the location is unusable."""
        storage = self._storage
        if hasattr(storage, "probe_bucket"):
            storage.probe_bucket()
        key = f".probe.r{self.rank}.{secrets.token_hex(4)}"
        payload = b"ferrosync probe " + secrets.token_bytes(8)
        try:
            storage.makedirs("")
            storage.put(key, [payload])
            back = storage.read(key)
            storage.delete([key])
        except (StorageError, OSError) as exc:
            what = exc.what if isinstance(exc, StorageError) else f"{type(exc).__name__}: {exc}"
            hint = exc.hint if isinstance(exc, StorageError) else None
            raise ConfigError(
                f"cannot use this location ({what})", rank=self.rank, path=storage.url,
                hint=hint or "check that the path is a writable directory (or the bucket "
                "exists) on every node",
            ) from None
        if back != payload:
            raise ConfigError(
                "read-after-write returned different bytes", rank=self.rank, path=storage.url,
                hint="this storage is not consistent enough for ferrosync (see `ferrosync "
                "doctor`)",
            )

    # -- helpers ---------------------------------------------------------------------------
    def _key_of(self, name: str) -> str:
        return f"{self._prefix}/{name}"

    def _begin(self, op: str) -> int:
        if self._storage.can_recycle or len(self._garbage) > 2 * self.world_size + 8:
            # recycling: consumed files become spares before this collective's puts;
            # otherwise only when waits were all too short to delete them for free
            self._flush_garbage()
        self._seq += 1
        self._op = op
        self._deadline = time.monotonic() + self.timeout
        heartbeat = self._heartbeat  # read once: another thread's abort may clear it
        if heartbeat is not None:
            heartbeat.set_position(self._seq, op)
        return self._seq

    def _codec(self, dtype: torch.dtype) -> Codec:
        codec = self._codecs.get(dtype)
        if codec is None:
            codec = self._codecs[dtype] = codec_for(dtype, self._opts["wire_dtype"])
        return codec

    def _mode(self, nbytes: int) -> str:
        mode = self._opts["reduce"]
        if mode == "auto":
            mode = "sharded" if nbytes >= self._opts["sharded_min_bytes"] else "root"
        return mode

    def _reduce_device(self, flat: torch.Tensor) -> torch.device:
        return self._opts["reduce_device"] or flat.device

    def _header(self, kind: int, dtype: torch.dtype, codec: Codec, *, count: int, offset: int,
                total: int, weight: float, digest: bytes, nbytes: int, flags: int = 0,
                slice_: int = 0, nslices: int = 1) -> Header:
        return Header(
            kind=kind, dtype=DTYPE_CODES[dtype], codec=codec.code, rank=self.rank,
            world_size=self.world_size, generation=self._generation.tag,
            collective=self._seq, count=count, offset=offset, total=total, weight=weight,
            layout=digest, payload_nbytes=nbytes, flags=flags, slice=slice_, nslices=nslices,
            block=codec.frame_elems if isinstance(codec, Int8Codec) else 0,
        )

    def _put(self, name: str, header: Header, parts: list) -> None:
        key = self._key_of(name)
        if self._failure is not None:
            # another thread failed this GradSync (overlapping calls): publish nothing
            # more that peers could pair with the wrong call
            raise ConfigError("calls on one GradSync from two threads must not overlap, and "
                              "another thread's call failed it", rank=self.rank,
                             collective=self._seq, path=self._storage.path_of(key),
                             hint="call collectives of one GradSync from one thread at a time")
        head = seal(header, parts, self._key)
        nbytes = len(head) + header.payload_nbytes
        self._storage.put(key, [head, *parts], reuse=self._take_spare(nbytes))
        # collective data objects only (not heartbeats or layout records): what a
        # collective costs in objects
        self._storage.counters.add(objects=1)
        if self._storage.can_recycle:
            self._written[key] = nbytes

    def _take_spare(self, nbytes: int) -> str | None:
        """The smallest spare that fits: its pages get rewritten instead of allocated.

        Small objects are not worth it (and would truncate a large spare's pages away).
        """
        if nbytes < _RECYCLE_MIN_BYTES or not self._spares:
            return None
        self._spares.sort()
        for i, (size, _key) in enumerate(self._spares):
            if size >= nbytes:
                return self._spares.pop(i)[1]
        return None

    def _flush_garbage(self) -> None:
        if not self._garbage:
            return
        keys, self._garbage = self._garbage, []
        doomed = []
        for key in keys:
            size = self._written.pop(key, None)
            if (size is not None and size >= _RECYCLE_MIN_BYTES
                    and len(self._spares) < 2 * self.world_size + 4):
                # hidden name: a parked file must not look like a live collective object
                spare = self._storage.park(key)
                if spare is not None:
                    self._spares.append((size, spare))
                    continue
            doomed.append(key)
        if doomed:
            self._storage.delete(doomed)

    def _ensure_layout(self, digest: bytes, layout: dict) -> None:
        """Publish this rank's description of ``digest`` once, for mismatch messages."""
        if digest in self._layouts:
            return
        self._layouts[digest] = layout
        name = f"layout.{digest.hex()}.r{self.rank}"
        self._storage.put(self._key_of(name), [encode_record(layout, self._key)])

    def _wait_open(self, name: str, wait_on, what: str):
        """Block until object ``name`` exists; return (reader, header, raw header bytes).

        Polls the exact name with back-off; while waiting, deletes garbage and checks
        the peers in ``wait_on`` (abort markers, heartbeats) once per interval.
        """
        key = self._key_of(name)
        storage = self._storage
        with self._stats.phase("wait_s"):
            reader = storage.open(key)
            if reader is None:
                self._flush_garbage()
                backoff = Backoff(*self._poll)
                while (reader := storage.open(key)) is None:
                    # time this process spent stopped (SIGSTOP, a VM pause) is nobody's
                    # delay: the collective's own timeout restarts when it resumes
                    self._deadline = max(self._deadline,
                                         self._monitor.resumed_at + self.timeout)
                    if time.monotonic() >= self._deadline:
                        raise self._timeout_error(wait_on, what)
                    self._monitor.maybe_check(wait_on, self._seq, self._op)
                    backoff.sleep(self._deadline)
        path = storage.path_of(key)
        try:
            with self._stats.phase("read_s"):
                raw = bytearray(HEADER_SIZE + MAC_SIZE)
                got = reader.readinto(memoryview(raw)[:HEADER_SIZE])
                header = parse_header(raw[:got], path=path, rank=self.rank, key=self._key)
                if header.flags & FLAG_AUTH:
                    reader.readinto(memoryview(raw)[HEADER_SIZE:])
            if header.generation != self._generation.tag or header.collective != self._seq:
                raise ShardCorrupt(
                    f"object belongs to generation tag {header.generation:016x} collective "
                    f"{header.collective}, expected {self._generation.token} collective "
                    f"{self._seq}", rank=self.rank, collective=self._seq, path=path,
                    hint="something else writes under this URL: give each job its own URL",
                )
            expected = header.size + header.payload_nbytes
            if reader.size != expected:
                raise ShardCorrupt(
                    f"object has {reader.size} bytes, its header says {expected}",
                    rank=self.rank, collective=self._seq, path=path,
                    hint="the object was truncated or appended to on storage",
                )
            if header.kind == KIND_ERROR:
                raise self._remote_error(reader, header, bytes(raw), path)
        except BaseException:
            reader.close()
            raise
        return reader, header, bytes(raw[: header.size])

    def _timeout_error(self, wait_on, what: str) -> SyncTimeout:
        missing = list(wait_on)
        if self._gathering is not None:  # name every rank still missing, not just the first
            missing = [k for k in wait_on if k != self.rank and not object_exists(
                self._storage, self._key_of(self._gathering[k]))]
        return SyncTimeout(
            f"timed out after {self.timeout:g} s in {self._op} waiting for {what} "
            f"(ranks {missing})",
            rank=self.rank, collective=self._seq, path=self._storage.path_of(self._prefix),
            hint="are those ranks running with the same URL, and calling the same "
            "collectives in the same order?",
        )

    def _remote_error(self, reader, header: Header, raw_head: bytes, path: str):
        data = self._read_payload_bytes(reader, header, raw_head, path)
        try:
            info = json.loads(data.decode())
            cls = error_class(info.get("type", ""))
            message = str(info.get("message", ""))
        except (ValueError, UnicodeDecodeError):
            cls, message = PeerFailed, "(unreadable error record)"
        return cls(f"rank {header.rank} reports: {message}", rank=self.rank,
                   collective=self._seq, path=path,
                   hint="fix the cause named above and restart every rank")

    def _read_payload_bytes(self, reader, header, raw_head, path) -> bytes:
        buf = bytearray(header.payload_nbytes)
        check = PayloadCheck(header, raw_head, self._key, path, self.rank)
        got = reader.readinto(buf)
        check.update(memoryview(buf)[:got])
        check.finish()
        return bytes(buf)

    def _publish_error(self, name: str, exc: BaseException) -> None:
        """Publish an error record where peers wait, so they fail now, not at timeout."""
        body = json.dumps({"type": type(exc).__name__, "message": getattr(exc, "what", str(exc))})
        payload = body.encode()
        header = Header(
            kind=KIND_ERROR, dtype=DTYPE_CODES[torch.uint8], codec=0, rank=self.rank,
            world_size=self.world_size, generation=self._generation.tag,
            collective=self._seq, count=len(payload), offset=0, total=len(payload),
            weight=0.0, layout=b"\0" * 8, payload_nbytes=len(payload),
        )
        try:
            self._put(name, header, [payload])
        except Exception:
            pass  # the peers will still see our abort marker or time out

    def _check_header(self, header: Header, path: str, *, kind: int, src: int, digest: bytes,
                      codec: Codec, dtype: torch.dtype, count: int, offset: int,
                      slice_: int = 0, nslices: int = 1, total: int | None = None) -> None:
        """Compare every field of ``header`` with what this rank expects at ``path``.

        The generation token and collective number were checked when the object was
        opened; here the writer's rank (an object copied onto another rank's name is a
        replay), kind, layout, encoding, size and slice. With a secret the header is
        authenticated, so a forger cannot edit these fields, only move whole objects.
        """
        if header.rank != src:
            raise ShardCorrupt(
                f"object was written by rank {header.rank} but lies under rank {src}'s name "
                "(a copied or replayed object)", rank=self.rank, collective=self._seq,
                path=path,
                hint="something else writes under this URL: give each job its own URL, "
                "and set a secret if the storage is shared with others",
            )
        if header.kind != kind:
            raise ShardCorrupt(
                f"expected a {KIND_NAMES[kind]} object, found a {KIND_NAMES[header.kind]}",
                rank=self.rank, collective=self._seq, path=path,
                hint="ranks called different collectives: keep the collective order identical",
            )
        if header.layout != digest:
            raise self._mismatch(src, header.layout, digest, path)
        block = codec.frame_elems if isinstance(codec, Int8Codec) else 0
        expect = (DTYPE_CODES[dtype], codec.code, block, count, offset,
                  count if total is None else total, slice_, nslices, self.world_size)
        got = (header.dtype, header.codec, header.block, header.count, header.offset,
               header.total, header.slice, header.nslices, header.world_size)
        if got != expect:
            raise ShardCorrupt(
                "header fields (dtype, codec, block, count, offset, total, slice, nslices, "
                f"world) = {got}, "
                f"expected {expect}", rank=self.rank, collective=self._seq, path=path,
                hint="ranks must use the same options (wire_dtype, reduce) and ferrosync "
                "version",
            )
        if not math.isfinite(header.weight) or header.weight < 0:
            raise ShardCorrupt(f"invalid weight {header.weight} from rank {header.rank}",
                               rank=self.rank, collective=self._seq, path=path)
        if header.flags & FLAG_EMPTY and header.payload_nbytes:
            raise ShardCorrupt("an empty contribution carries a payload", rank=self.rank,
                               collective=self._seq, path=path)
        if not header.flags & (FLAG_EMPTY | FLAG_UNCHANGED) and (
            header.payload_nbytes != codec.nbytes(count)
        ):
            raise ShardCorrupt(
                f"payload has {header.payload_nbytes} bytes, {count} elements need "
                f"{codec.nbytes(count)}", rank=self.rank, collective=self._seq, path=path)

    def _mismatch(self, other: int, their_digest: bytes, my_digest: bytes, path: str):
        mine = self._layouts.get(my_digest, {})
        theirs = None
        raw = self._storage.read(self._key_of(f"layout.{their_digest.hex()}.r{other}"))
        if raw is not None:
            try:
                theirs = decode_record(raw, self._key, path=path)
            except ShardCorrupt:
                theirs = None
        return LayoutMismatch(
            describe_mismatch(mine, theirs, self.rank, other), rank=self.rank,
            collective=self._seq, path=path,
            hint="every rank must pass the same tensors (count, dtype, shape) to the same "
            "collective, in the same order",
        )

    def _stream(self, reader, header: Header, raw_head: bytes, codec: Codec,
                device: torch.device, path: str):
        """Yield ``(values, start, end)`` decoded chunk by chunk onto ``device``.

        The payload is verified as it streams; ``ShardCorrupt`` is raised at the end
        (after the last chunk) if its checksum or MAC fails, so a consumer must not
        publish anything derived from the chunks before the generator is exhausted.
        """
        check = PayloadCheck(header, raw_head, self._key, path, self.rank)
        total = header.payload_nbytes
        step = max(1, self._opts["chunk_bytes"] // codec.frame_bytes) * codec.frame_bytes
        buf = self._pool.get("read", min(step, total), torch.uint8, "cpu",
                             pinned=device.type == "cuda")
        done = elem = 0
        while done < total:
            size = min(step, total - done)
            view = buf[:size]
            host = view.numpy()
            t0 = time.perf_counter()
            got = reader.readinto(host)
            t1 = time.perf_counter()
            self._stats.add_time("read_s", t1 - t0)
            check.update(host[:got])
            if got < size:
                check.finish()  # raises: truncated
            n = min(size // codec.frame_bytes * codec.frame_elems, header.count - elem)
            chunk = view if device.type == "cpu" else view.to(device, non_blocking=False)
            yield codec.decode(chunk, n), elem, elem + n
            self._stats.add_time("reduce_s", time.perf_counter() - t1)
            elem += n
            done += size
        check.finish()

    def _receive_into(self, reader, header, raw_head, codec, out: torch.Tensor, path) -> None:
        """Read a result payload into ``out`` (verified before returning)."""
        if codec.raw and out.device.type == "cpu" and out.dtype == codec.wire_dtype:
            # zero-copy: the payload lands straight in the caller's memory
            check = PayloadCheck(header, raw_head, self._key, path, self.rank)
            host = as_uint8(out).numpy()
            with self._stats.phase("read_s"):
                got = reader.readinto(host)
                check.update(host[:got])
            check.finish()
            return
        for values, lo, hi in self._stream(reader, header, raw_head, codec, out.device, path):
            out[lo:hi].copy_(values)

    def _encode(self, x: torch.Tensor, codec: Codec, ef_key) -> torch.Tensor:
        """The payload of ``x`` as a host uint8 tensor (a view of ``x`` when raw on CPU)."""
        if codec.raw and x.device.type == "cpu":
            return as_uint8(x)
        nbytes = codec.nbytes(x.numel())
        if isinstance(codec, Int8Codec) and self._opts["error_feedback"] and ef_key is not None:
            wire = self._pool.get("wire", nbytes, torch.uint8, x.device)
            sent = self._ef.compensate(ef_key, x)
            codec.encode(sent, wire)
            self._ef.remember(ef_key, sent, codec.decode(wire, x.numel()))
        else:
            wire = self._pool.get("wire", nbytes, torch.uint8, x.device)
            codec.encode(x, wire)
        if wire.device.type != "cpu":
            host = self._pool.get("host", nbytes, torch.uint8, "cpu", pinned=True)
            host.copy_(wire)
            return host
        return wire

    # -- primitives ------------------------------------------------------------------------
    def _average_flat(self, flat, weight, digest, layout):
        s = self._begin(layout["op"])
        # codec state (int8 error feedback) belongs to what the data is, not its shape
        self._codec_key = (layout.get("stream"), digest)
        if self.world_size == 1:
            return weight
        self._ensure_layout(digest, layout)
        codec = self._codec(flat.dtype)
        nbytes = flat.numel() * flat.element_size()
        if layout["op"] != "barrier" and self._mode(nbytes) == "sharded":
            return self._average_sharded(s, flat, weight, digest, codec)
        return self._average_root(s, flat, weight, digest, codec)

    def _barrier(self, digest, layout):
        self._average_flat(torch.empty(0), 1.0, digest, layout)

    def _accumulate(self, acc: torch.Tensor, values: torch.Tensor, weight: float, first: bool):
        """acc (+)= weight * values, in float32/64; ``first`` initialises instead of adding."""
        if first:
            # copy first, then scale: torch.mul(half, w, out=f32) would multiply in
            # half precision before widening
            acc.copy_(values)
            if weight != 1.0:
                acc.mul_(weight)
        elif weight == 1.0:
            acc.add_(values)
        else:
            acc.add_(values, alpha=weight)

    def _reduce_from(self, acc, own: torch.Tensor, own_weight: float, digest, codec, names,
                     *, dtype: torch.dtype, offset: int, full: int, slice_: int,
                     nslices: int) -> list[float]:
        """Sum every rank's contribution to ``acc`` in rank order; return the weights.

        ``names[k]`` is rank k's object name; ``own`` stands for this rank's slot and
        has been through the codec like every other rank's payload. ``dtype`` is the
        callers' tensor dtype, which every header must name.
        """
        weights = []
        first = True
        count = acc.numel()
        self._gathering = names
        for k in range(self.world_size):
            if k == self.rank:
                w = own_weight
                if w > 0:
                    with self._stats.phase("reduce_s"):
                        self._accumulate(acc, own.to(acc.device), w, first)
                    first = False
                weights.append(w)
                continue
            reader, header, raw = self._wait_open(
                names[k], range(k, self.world_size), f"contribution of rank {k}")
            path = self._storage.path_of(self._key_of(names[k]))
            with reader:
                self._check_header(header, path, kind=KIND_CONTRIB, src=k, digest=digest,
                                   codec=codec, dtype=dtype, count=count, offset=offset,
                                   slice_=slice_, nslices=nslices, total=full)
                w = header.weight
                if w > 0:
                    for values, lo, hi in self._stream(reader, header, raw, codec,
                                                       acc.device, path):
                        self._accumulate(acc[lo:hi], values, w, first)
                    first = False
            weights.append(w)
        self._gathering = None
        return weights

    def _publish_result(self, name: str, acc: torch.Tensor, out: torch.Tensor, total: float,
                        digest, codec, *, offset: int, full: int, slice_: int, nslices: int):
        """Divide once, encode, publish; then decode the published bytes into ``out``."""
        dtype = out.dtype
        direct = codec.raw and out.device.type == "cpu"
        with self._stats.phase("reduce_s"):
            if total == 0:
                parts, flags = [], FLAG_UNCHANGED
            elif direct:
                # divide straight into the output (rounding once to its dtype) and
                # publish those very bytes: no extra copy, and this rank provably holds
                # what every other rank will read
                torch.div(acc, total, out=out)
                parts, flags = [as_uint8(out).numpy()], 0
            else:
                acc.div_(total)
                result = acc if acc.dtype == dtype else acc.to(dtype)
                payload = self._encode(result, codec, (*self._codec_key, "result", slice_))
                parts, flags = [payload.numpy()], 0
        header = self._header(KIND_RESULT, dtype, codec, count=acc.numel(), offset=offset,
                              total=full, weight=total, digest=digest,
                              nbytes=sum(p.nbytes for p in parts), flags=flags,
                              slice_=slice_, nslices=nslices)
        with self._stats.phase("write_s"):
            self._put(name, header, parts)
        if total == 0 or direct:
            return
        with self._stats.phase("reduce_s"):
            # every rank, this one included, ends with the decoded published bytes
            if codec.raw and result.device == out.device:
                if result.data_ptr() != out.data_ptr():
                    out.copy_(result)
            else:
                decoded = codec.decode(payload.to(acc.device), acc.numel())
                out.copy_(decoded)

    def _average_root(self, s, flat, weight, digest, codec):
        n = flat.numel()
        result_name = f"c{s}.out"
        if self.rank != 0:
            with self._stats.phase("write_s"):
                payload = self._encode(flat, codec, (*self._codec_key, 0)) if weight > 0 else None
                parts = [payload.numpy()] if payload is not None else []
                header = self._header(KIND_CONTRIB, flat.dtype, codec, count=n, offset=0,
                                      total=n, weight=weight, digest=digest,
                                      nbytes=sum(p.nbytes for p in parts),
                                      flags=0 if parts else FLAG_EMPTY)
                self._put(f"c{s}.r{self.rank}", header, parts)
            reader, header, raw = self._wait_open(result_name, [0], "the result from rank 0")
            path = self._storage.path_of(self._key_of(result_name))
            with reader:
                self._check_header(header, path, kind=KIND_RESULT, src=0, digest=digest,
                                   codec=codec, dtype=flat.dtype, count=n, offset=0)
                if not header.flags & FLAG_UNCHANGED:
                    self._receive_into(reader, header, raw, codec, flat, path)
            # rank 0 has read our contribution (its result exists): ours to delete; and
            # it gathered every rank's, so every rank has finished earlier collectives
            self._garbage.append(self._key_of(f"c{s}.r{self.rank}"))
            self._after_gather_done([])
            return header.weight

        acc = self._pool.get("acc", n, accumulator_dtype(flat.dtype), self._reduce_device(flat))
        names = {k: f"c{s}.r{k}" for k in range(self.world_size)}
        own = flat
        if weight > 0 and not codec.raw:
            # rank 0's contribution goes through the same encoding as every other rank's
            payload = self._encode(flat, codec, (*self._codec_key, 0))
            own = codec.decode(payload.to(acc.device), n)
        try:
            weights = self._reduce_from(acc, own, weight, digest, codec, names,
                                        dtype=flat.dtype, offset=0, full=n, slice_=0, nslices=1)
        except BaseException as exc:
            self._publish_error(result_name, exc)
            raise
        total = 0.0
        for w in weights:  # rank order: the same float sum on every rank
            total += w
        self._publish_result(result_name, acc, flat, total, digest, codec,
                             offset=0, full=n, slice_=0, nslices=1)
        self._after_gather_done([self._key_of(result_name)])
        return total

    def _after_gather_done(self, new_results: list[str]) -> None:
        """Called by every rank once collective s is known to have gathered all ranks:
        every rank has then finished the collectives before s, so the results this
        rank was holding for them can go. ``new_results`` are held until next time."""
        self._garbage.extend(self._after_gather)
        self._after_gather = list(new_results)
        if not self._storage.cheap_deletes:
            return  # deleted at the next wait, off the critical path
        self._flush_garbage()

    # sharded ------------------------------------------------------------------------------
    def _slices(self, n: int, codec: Codec) -> list[tuple[int, int]]:
        frames = -(-n // codec.frame_elems)
        w = self.world_size
        cuts = [frames * j // w * codec.frame_elems for j in range(w + 1)]
        return [(min(cuts[j], n), min(cuts[j + 1], n)) for j in range(w)]

    def _average_sharded(self, s, flat, weight, digest, codec):
        n = flat.numel()
        bounds = self._slices(n, codec)
        me = self.rank
        with self._stats.phase("write_s"):
            payload = self._encode(flat, codec, (*self._codec_key, 0)) if weight > 0 else None
            for j, (lo, hi) in enumerate(bounds):
                if j == me:
                    continue
                if payload is not None:
                    fb, fe = codec.frame_bytes, codec.frame_elems
                    part = payload[lo // fe * fb : lo // fe * fb + codec.nbytes(hi - lo)]
                    parts = [part.numpy()]
                else:
                    parts = []
                header = self._header(KIND_CONTRIB, flat.dtype, codec, count=hi - lo, offset=lo,
                                      total=n, weight=weight, digest=digest,
                                      nbytes=sum(p.nbytes for p in parts),
                                      flags=0 if parts else FLAG_EMPTY, slice_=j,
                                      nslices=len(bounds))
                self._put(f"c{s}.r{me}.s{j}", header, parts)
        lo, hi = bounds[me]
        acc = self._pool.get("acc", hi - lo, accumulator_dtype(flat.dtype),
                             self._reduce_device(flat))
        names = {k: f"c{s}.r{k}.s{me}" for k in range(self.world_size)}
        result_name = f"c{s}.out.s{me}"
        own = flat[lo:hi]
        if payload is not None and not codec.raw:
            # our own slice goes through the same encoding as every other rank's
            fb, fe = codec.frame_bytes, codec.frame_elems
            part = payload[lo // fe * fb : lo // fe * fb + codec.nbytes(hi - lo)]
            own = codec.decode(part.to(acc.device), hi - lo)
        try:
            weights = self._reduce_from(acc, own, weight, digest, codec, names,
                                        dtype=flat.dtype, offset=lo, full=n, slice_=me,
                                        nslices=len(bounds))
        except BaseException as exc:
            self._publish_error(result_name, exc)
            raise
        total = 0.0
        for w in weights:
            total += w
        # everyone finished the previous collective: our older result slices can go
        self._after_gather_done([])
        # our contribution to slice `me` is in acc now, so flat[lo:hi] may take the result
        self._publish_result(result_name, acc, flat[lo:hi], total, digest, codec,
                             offset=lo, full=n, slice_=me, nslices=len(bounds))
        for j, (jlo, jhi) in enumerate(bounds):
            if j == me:
                continue
            name = f"c{s}.out.s{j}"
            reader, header, raw = self._wait_open(name, [j], f"result slice {j} from rank {j}")
            path = self._storage.path_of(self._key_of(name))
            with reader:
                self._check_header(header, path, kind=KIND_RESULT, src=j, digest=digest,
                                   codec=codec, dtype=flat.dtype, count=jhi - jlo, offset=jlo,
                                   slice_=j, nslices=len(bounds), total=n)
                if header.weight != total:
                    raise ShardCorrupt(
                        f"rank {j} computed total weight {header.weight}, this rank {total}",
                        rank=self.rank, collective=s, path=path)
                if total > 0:
                    self._receive_into(reader, header, raw, codec, flat[jlo:jhi], path)
        # every reducer has published, so every slice of ours was read
        self._garbage.extend(self._key_of(f"c{s}.r{me}.s{j}") for j in range(len(bounds))
                             if j != me)
        self._after_gather.append(self._key_of(result_name))
        return total

    # exact copies (broadcast, all-gather) ---------------------------------------------------
    def _publish_copy(self, name: str, flat: torch.Tensor, digest: bytes) -> None:
        """Publish ``flat`` byte for byte (raw, whatever ``wire_dtype``)."""
        codec = RawCodec(flat.dtype)
        with self._stats.phase("write_s"):
            payload = self._encode(flat, codec, None)
            header = self._header(KIND_BROADCAST, flat.dtype, codec, count=flat.numel(),
                                  offset=0, total=flat.numel(), weight=1.0, digest=digest,
                                  nbytes=payload.numel())
            self._put(name, header, [payload.numpy()])

    def _receive_copy(self, name: str, src: int, wait_on, what: str, out: torch.Tensor,
                      digest: bytes) -> None:
        """Wait for rank ``src``'s ``_publish_copy`` of ``name`` and read it into ``out``."""
        codec = RawCodec(out.dtype)
        reader, header, raw = self._wait_open(name, wait_on, what)
        path = self._storage.path_of(self._key_of(name))
        with reader:
            self._check_header(header, path, kind=KIND_BROADCAST, src=src, digest=digest,
                               codec=codec, dtype=out.dtype, count=out.numel(), offset=0)
            self._receive_into(reader, header, raw, codec, out, path)

    # broadcast ----------------------------------------------------------------------------
    def _broadcast_flat(self, flat, src, digest, layout):
        s = self._begin("broadcast")
        if self.world_size == 1:
            return
        self._ensure_layout(digest, layout)
        name = f"c{s}.out"
        if self.rank == src:
            self._publish_copy(name, flat, digest)
        else:
            self._receive_copy(name, src, [src], f"the broadcast from rank {src}", flat, digest)
        if self.rank == 0:
            # rank 0 deletes it once every rank has shown up for a later gather
            self._after_gather.append(self._key_of(name))

    # all-gather ----------------------------------------------------------------------------
    def _all_gather_flat(self, flat, digest, layout):
        s = self._begin("all_gather")
        out = [flat.clone() if k == self.rank else torch.empty_like(flat)
               for k in range(self.world_size)]
        if self.world_size == 1:
            return out
        self._ensure_layout(digest, layout)
        mine = f"c{s}.r{self.rank}"
        self._publish_copy(mine, flat, digest)
        names = {k: f"c{s}.r{k}" for k in range(self.world_size)}
        self._gathering = names
        for k in range(self.world_size):
            if k != self.rank:
                self._receive_copy(names[k], k, range(k, self.world_size),
                                   f"the contribution of rank {k}", out[k], digest)
        self._gathering = None
        # every rank wrote for s, so every rank finished the collectives before it
        self._after_gather_done([self._key_of(mine)])
        return out

    # failure and shutdown ------------------------------------------------------------------
    def _publish_abort(self, exc):
        if self._prefix is None:
            return
        publish_abort(self._storage, self._prefix, self.rank, exc, self._seq, self._key)
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
                self._flush_garbage()
                self._storage.delete([key for _, key in self._spares])
                self._spares.clear()
        except Exception:
            pass  # close() must not raise because storage or a peer failed
        finally:
            self._ef.clear()
            self._storage.close()


def describe_mismatch(mine: dict, theirs: dict | None, me: int, other: int) -> str:
    """Name the first difference between two layout records, for LayoutMismatch."""
    if not theirs:
        return (f"rank {other} sent a different tensor layout (its layout record is missing); "
                f"rank {me} called {mine.get('op')} with {mine.get('tensors')}")
    if mine.get("op") != theirs.get("op"):
        return f"rank {me} called {mine.get('op')}, rank {other} called {theirs.get('op')}"
    a, b = mine.get("tensors", []), theirs.get("tensors", [])
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return (f"{mine.get('op')}: first difference at tensor {i}: rank {me} has {x}, "
                    f"rank {other} has {y}")
    if len(a) != len(b):
        return f"{mine.get('op')}: rank {me} passed {len(a)} tensors, rank {other} passed {len(b)}"
    return (f"{mine.get('op')}: bucket {mine.get('bucket')} on rank {me} vs "
            f"{theirs.get('bucket')} on rank {other}")

