"""``connect`` and ``GradSync``: the public collectives, written once for every backend.

``GradSync`` validates arguments, cuts buckets, keeps ``stats`` and runs every
collective through the adapter seam (``run_collective``, ``submit``); a backend
implements the abstract primitives and is registered in ``core/registry.py``.
Contracts: docs/design.md#backend-contract, docs/design.md#collective-order,
docs/design.md#adapter-seam.
"""

from __future__ import annotations

import abc
import hashlib
import json
import logging
import os
import sys

import torch

from ferrosync.compression.codecs import FLOAT_DTYPES
from ferrosync.core.async_runner import RUNNER_JOIN_TIMEOUT, AsyncRunner, SyncHandle
from ferrosync.core.env import ENV_URL, Identity, discover
from ferrosync.core.flat import (
    DTYPE_CODES,
    Bucket,
    BufferPool,
    as_tensor_list,
    check_tensors,
    layout_digest,
    layout_signature,
    plan_buckets,
)
from ferrosync.core.guard import OwnershipGuard, fail_open_syncs
from ferrosync.core.stats import StatsBook
from ferrosync.core.validate import error as value_error
from ferrosync.core.validate import number
from ferrosync.errors import ConfigError

__all__ = ["connect", "GradSync", "SyncHandle", "Receive", "fail_open_syncs", "plan_layouts"]


_log = logging.getLogger(__name__)


class GradSync(abc.ABC):
    """Averages tensors across ranks. Create with ``ferrosync.connect``.

    Attributes:
        rank, world_size, local_rank: this process's identity.
        url: where the ranks meet.
        stats: ``{"total": {...}, "last": {...}}`` (see ``ferrosync.core.stats``).

    What a backend (a subclass) is given besides these, its declared interface to the
    base: ``guard`` (the ``OwnershipGuard``: ``raise_if_failed`` before it publishes,
    ``check_usable`` before a call that is not a collective, ``abandon`` when its
    ``__init__`` fails), ``buffers`` (the ``BufferPool`` of its scratch tensors, cleared
    at close), ``stats_book`` (the ``StatsBook`` behind ``stats``: ``phase`` timers)
    and ``counters`` (its storage or transport counters).
    """

    #: per-backend default bucket size; None means one bucket per dtype
    default_bucket_bytes: int | None = None
    #: True for an elastic job's member, whose rank and world size may change after
    #: any collective (``ferrosync.elastic``); loops check it, strategies subscribe to
    #: ``on_membership`` instead
    elastic = False
    #: the ``wire_dtype`` option this backend averages with (None: native). With
    #: ``"topk"`` an average carries only each chunk's largest values: average changes
    #: (gradients, pseudo-gradients), never values such as parameters (docs/topk.md)
    wire_dtype: str | None = None
    #: True when this GradSync moves bytes through shared storage without a MAC (no
    #: secret): anyone who can write there can then replace what the ranks read
    #: (ddp warns before an object collective unpickles such bytes)
    unauthenticated_storage = False

    def __init__(self, url: str, identity: Identity, timeout: float, counters,
                 bucket_bytes: int | None = None) -> None:
        self.url = url
        self.rank = identity.rank
        self.world_size = identity.world_size
        self.local_rank = identity.local_rank
        self.timeout = timeout
        self.bucket_bytes = bucket_bytes if bucket_bytes is not None else self.default_bucket_bytes
        self.stats_book = StatsBook(counters)
        self.buffers = BufferPool()
        self.counters = counters
        self.guard = OwnershipGuard(self, self._publish_abort)
        self._runner: AsyncRunner | None = None  # started by the first async submission

    @classmethod
    def identity(cls, rank: int | None, world_size: int | None) -> Identity:
        """Who this process is in the job, before ``__init__``: ``rank`` and
        ``world_size`` as given to ``connect``, else from the environment (torchrun,
        SLURM), else 0 of 1. A backend whose membership is agreed at run time (an
        elastic job's) overrides it."""
        if rank is not None and world_size is None and discover().source == "default":
            raise ConfigError(
                f"rank={rank} given, but no world size: not as world_size=, and none in "
                "the environment",
                hint="pass world_size= as well; world sizes come from "
                "connect(world_size=...), or from WORLD_SIZE (torchrun, python -m "
                "ferrosync.train) or SLURM_NTASKS (srun) in every rank's environment")
        return discover(rank, world_size)

    @classmethod
    @abc.abstractmethod
    def check_options(cls, options: dict):
        """Validate ``connect``'s keyword options before any I/O and return them typed
        (a ``BackendOptions``, ``core/options.py``); a ``ConfigError`` names the first bad
        one. Called by ``connect`` with every option the user passed; the result is handed to
        ``__init__(url, identity, timeout, options)``."""

    def on_membership(self, callback) -> None:  # noqa: B027 (fixed members: nothing to say)
        """Subscribe ``callback(change)`` to this sync's membership: a backend whose
        members change (an elastic job's) calls it at once with the current members,
        then after every collective that changed them, before that collective returns
        (``ferrosync.elastic.events.MembershipChange``). A fixed-size sync's members
        never change: it never calls ``callback``."""

    # -- public collectives ------------------------------------------------------------
    def average_(self, tensors, *, weight: float = 1.0, async_op: bool = False):
        """Collective: in place, every tensor becomes ``Σ_r w_r·T_r / Σ_r w_r``.

        Every rank calls it with tensors of the same count, dtypes and shapes (float32,
        float16, bfloat16 or float64). Blocks until the average is in place; the
        tensors may be reused as soon as it returns. The result is bit-identical on
        every rank. A rank with ``weight=0`` adds nothing but still takes part and
        receives the average; if every weight is 0 the tensors stay unchanged.

        With ``async_op=True`` it returns at once with a ``SyncHandle``: a background
        thread moves the bytes while the caller goes on. The tensors must not be
        read or written until ``handle.wait()`` returns. Collectives still run in call
        order: a later collective on this GradSync first waits for earlier ones.

        Every tensor is checked before any I/O: dense (strided), holding data (not on
        the ``meta`` device), of a float dtype, and without elements that share memory
        (an ``expand``-ed tensor cannot be written in place). A bad one is a
        ``ConfigError`` naming it; nothing was sent and this GradSync stays usable.

        Returns:
            ``Σ_r w_r``, the total weight (identical on every rank), or a ``SyncHandle``
            whose ``wait()`` returns it.
        """
        tensors = as_tensor_list(tensors)
        return self._average_call(tensors, weight, async_op, _stream("average", tensors),
                                  "average_")

    def _average_call(self, tensors: list, weight, async_op: bool, stream: str, caller: str,
                      names: list[str] | None = None):
        """``average_`` for one kind of data: ``stream`` keys the codec's state;
        ``caller`` and ``names`` (one per tensor) word the validation errors."""
        weight = _check_weight(weight, self.rank)
        check_tensors(tensors, op=caller, rank=self.rank, path=self.url, names=names,
                      in_place=True,
                      dtypes=FLOAT_DTYPES,
                      dtype_hint="cast it, or use broadcast_ for integer tensors")
        body = lambda: self._average(tensors, weight, stream)  # noqa: E731
        if async_op:
            return self.submit("average", body)
        return self.run_collective("average", body)

    def average_gradients(self, module_or_params, *, weight: float = 1.0,
                          async_op: bool = False):
        """Collective: ``average_`` over every ``p.grad`` that is not None.

        All ranks must have gradients for the same parameters (a parameter unused on
        one rank but not another is a ``LayoutMismatch``; zero its grad instead).
        With ``async_op=True``, call ``handle.wait()`` before ``optimizer.step()``.
        """
        named = [(name, p) for name, p in _named_parameters(module_or_params)
                 if p.grad is not None]
        params = [p for _, p in named]
        # keyed by the parameters: zero_grad(set_to_none=True) makes new grad tensors
        return self._average_call([p.grad for p in params], weight, async_op,
                                  _stream("gradients", params), "average_gradients",
                                  [f"{name}.grad" for name, _ in named])

    def average_parameters(self, module_or_params, *, weight: float = 1.0,
                           async_op: bool = False):
        """Collective: ``average_`` over the parameters' data (Local SGD, model averaging).

        Refused with ``wire_dtype="topk"`` (before any I/O): a sparse average of the
        parameters themselves would zero most of them; average their change instead.
        """
        if self.wire_dtype == "topk":
            raise ConfigError(
                "average_parameters cannot use wire_dtype='topk': it sends only the largest "
                "values of each chunk, so averaging parameters would zero most of them",
                rank=self.rank, path=self.url,
                hint="average the change since the last sync (DiLoCo's pseudo-gradients: "
                "--strategy diloco), or use wire_dtype='int8' for parameters")
        named = _named_parameters(module_or_params)
        params = [p for _, p in named]
        return self._average_call([p.detach() for p in params], weight, async_op,
                                  _stream("parameters", params), "average_parameters",
                                  [name for name, _ in named])

    def broadcast_(self, tensors, *, src: int = 0) -> None:
        """Collective: in place, every rank's tensors become rank ``src``'s (any dtype).

        Every rank passes tensors of the same dtypes and shapes; blocks until done.
        The tensors are checked before any I/O as in ``average_`` (any dtype ferrosync
        can put on the wire), on the source too: every rank refuses alike.
        """
        tensors = as_tensor_list(tensors)
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.world_size:
            raise value_error("src", f"a rank in [0, {self.world_size})", src, rank=self.rank)
        check_tensors(tensors, op="broadcast_", rank=self.rank, path=self.url, in_place=True,
                      dtypes=tuple(DTYPE_CODES))
        self.run_collective("broadcast", lambda: self._broadcast(tensors, src))

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Collective: every rank's ``tensor`` (any dtype), as a list indexed by rank.

        Every rank passes a tensor of the same dtype and shape; blocks until all have
        arrived. The returned tensors are new (this rank's entry is a copy). The tensor
        is only read: an expanded or conjugate view is fine; sparse, ``meta`` and
        unsupported dtypes are a ``ConfigError`` before any I/O.
        """
        if not isinstance(tensor, torch.Tensor):
            raise value_error("all_gather's argument", "one tensor", tensor,
                              got=type(tensor).__name__, rank=self.rank)
        check_tensors([tensor], op="all_gather", rank=self.rank, path=self.url,
                      names=["tensor"], in_place=False, dtypes=tuple(DTYPE_CODES))
        # plain values in one block: contiguous() copies an expanded view, resolve_*()
        # applies a pending conjugation or negation (a flag on the view, not in memory)
        source = tensor.detach().resolve_conj().resolve_neg().contiguous()

        def body():
            (bucket, digest, layout), = plan_layouts("all_gather", [source],
                                                     self.bucket_bytes)
            flat = source.view(-1)
            return [t.view(tensor.shape) for t in self._all_gather_flat(flat, digest, layout)]

        return self.run_collective("all_gather", body)

    def barrier(self) -> None:
        """Collective: returns once every rank has entered."""
        def body():
            (_bucket, digest, layout), = plan_layouts("barrier", [], self.bucket_bytes)
            self._barrier(digest, layout)

        self.run_collective("barrier", body)

    # -- point-to-point and all-to-all (docs/design.md#point-to-point) -------------------
    def all_to_all(self, outputs: list, inputs: list) -> None:
        """Collective: rank r's ``inputs[j]`` lands in rank j's ``outputs[r]``, exactly.

        Every rank passes ``world_size`` inputs and ``world_size`` outputs of one dtype
        (any ferrosync carries); sizes may differ from pair to pair (uneven splits), but
        rank j's ``outputs[r]`` must have as many elements as rank r's ``inputs[j]``
        (else ``LayoutMismatch``; for a rank's own part, ``ConfigError`` before any I/O).
        Blocks until every output is in place.
        """
        self._check_point_to_point("all_to_all")
        inputs, outputs = as_tensor_list(inputs), as_tensor_list(outputs)
        for what, tensors, in_place in (("inputs", inputs, False), ("outputs", outputs, True)):
            if len(tensors) != self.world_size:
                raise value_error(f"all_to_all {what}", f"{self.world_size} tensors (one per "
                                  "rank)", tensors, got=f"{len(tensors)} tensors", rank=self.rank)
            check_tensors(tensors, op="all_to_all", rank=self.rank, path=self.url,
                          names=[f"{what}[{i}]" for i in range(len(tensors))],
                          in_place=in_place, dtypes=tuple(DTYPE_CODES))
        dtypes = {t.dtype for t in inputs + outputs}
        if len(dtypes) > 1:
            raise value_error("all_to_all tensors", "one dtype", sorted(map(str, dtypes)),
                              rank=self.rank)
        me = self.rank
        own_in, own_out = inputs[me].numel(), outputs[me].numel()
        if own_in != own_out:  # the one pair this rank can check alone: before any I/O
            raise value_error(
                f"all_to_all outputs[{me}] (what rank {me} sends itself)",
                f"{own_in} elements, like inputs[{me}]", None, got=f"{own_out} elements",
                rank=me, hint=f"rank {me}'s outputs[j] must be as large as rank j's "
                f"inputs[{me}]; for j = {me} that is its own inputs[{me}] (with "
                "all_to_all_single: equal output and input split sizes at its own rank)")
        layout = {"op": "all_to_all", "dtype": str(dtypes.pop())}
        digest = layout_digest(json.dumps(layout, sort_keys=True))

        def body():
            with torch.no_grad():
                flats = [_plain(t).view(-1) for t in inputs]
                outs = [_receiver(t) for t in outputs]
                self._all_to_all_flat([o[0] for o in outs], flats, digest, layout)
                for _, finish in outs:
                    finish()

        self.run_collective("all_to_all", body)

    def send(self, tensor: torch.Tensor, dst: int, *, tag: int = 0) -> None:
        """Point-to-point: publish ``tensor`` (any dtype) for rank ``dst``'s matching
        ``recv``. Not a collective (no other rank takes part, no collective number):
        the n-th send to ``dst`` with ``tag`` is the n-th ``recv`` there from this rank
        with ``tag``. Returns once the message is stored; never waits for ``dst``."""
        self._check_point_to_point("send")
        dst, tag = self._check_peer("dst", dst), _check_tag(tag, self.rank)
        check_tensors([tensor], op="send", rank=self.rank, path=self.url, names=["tensor"],
                      in_place=False, dtypes=tuple(DTYPE_CODES))
        source = _plain(tensor).view(-1)
        self.run_collective("send", lambda: self._send_flat(source, dst, tag))

    def recv(self, tensor: torch.Tensor, src: int | None = None, *, tag: int = 0) -> int:
        """Point-to-point: wait for the next message from rank ``src`` with ``tag`` (any
        rank's with ``src=None``: the lowest rank with one waiting, see
        ``storage/messages.py``) and copy it into ``tensor`` (same dtype and size as
        sent, else ``LayoutMismatch``). Returns the sender's rank."""
        return self.irecv(tensor, src, tag=tag).wait()

    def irecv(self, tensor: torch.Tensor, src: int | None = None, *, tag: int = 0) -> Receive:
        """``recv`` posted now and read by the returned ``Receive``'s ``wait()``: receives
        from one rank match its sends in the order they were posted, whichever is
        waited for first. Nothing is read (and nothing blocks) until then."""
        self._check_point_to_point("recv")
        if src is not None:
            src = self._check_peer("src", src)
        tag = _check_tag(tag, self.rank)
        check_tensors([tensor], op="recv", rank=self.rank, path=self.url, names=["tensor"],
                      in_place=True, dtypes=tuple(DTYPE_CODES))
        number = None
        if src is not None:  # the message is this one, whenever it is read (no I/O)
            self.guard.check_usable()
            number = self._post_recv(src, tag)
        return Receive(self, tensor, src, tag, number)

    def _check_point_to_point(self, op: str) -> None:
        if not self.point_to_point:
            raise ConfigError(f"{op} is not supported by {type(self).__name__}", rank=self.rank,
                              path=self.url, hint="point-to-point and all_to_all run on a "
                              "storage URL (a directory or an object store)")

    def _check_peer(self, name: str, peer) -> int:
        if isinstance(peer, bool) or not isinstance(peer, int) or not (
                0 <= peer < self.world_size) or peer == self.rank:
            raise value_error(name, f"another rank in [0, {self.world_size})", peer,
                              rank=self.rank)
        return peer

    def close(self) -> None:
        """Release storage handles and threads. Idempotent; never waits on peers and
        never raises because a peer failed (pending async collectives are cancelled).

        Called from another thread while a collective runs, it waits for that
        collective (bounded by its ``timeout``). In a forked child it only marks the
        child's copy closed: the handles, threads and objects are the parent's.
        """
        guard = self.guard
        if guard.close_forked_copy():
            return
        interrupted = sys.exc_info()[1]
        if isinstance(interrupted, KeyboardInterrupt):
            # close() in a ``finally`` while Ctrl-C/SIGINT unwinds: the peers must read
            # "interrupted", not a clean close ("ran fewer steps")
            guard.fail_unless_ended(interrupted)
        runner = self._runner
        if runner is not None:
            runner.stop()

        def shutdown(failure):
            try:
                self._shutdown(failure)
            finally:
                self.buffers.clear()

        guard.close(shutdown)
        if runner is not None and not runner.is_worker():
            # queued collectives fail fast once closed; joining matters at exit: a
            # daemon thread still inside a torch op when the interpreter finalizes is
            # killed by a forced unwind through C++ and the process aborts (SIGABRT)
            runner.join(RUNNER_JOIN_TIMEOUT)

    def __enter__(self) -> GradSync:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            self.guard.fail_unless_ended(exc)
        self.close()

    @property
    def stats(self) -> dict:
        return self.stats_book.as_dict()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(url={self.url!r}, rank={self.rank}, "
                f"world_size={self.world_size})")

    # -- the adapter seam ------------------------------------------------------------------
    def run_collective(self, op: str, body):
        """Run ``body()`` as this GradSync's next collective, on the calling thread, and
        return its value: the seam for adapters (``ddp/``) that move bytes with the
        public collectives or the backend primitives in an order of their own.

        Contract, the same as every built-in collective's: every rank runs the same
        sequence of collectives; ``op`` names this one in errors. Before any I/O it
        raises ``ConfigError`` in a forked child or while another thread is inside a
        collective, and ``SyncClosed`` once closed or failed; earlier ``submit``-ted
        work runs first. If ``body`` raises, this GradSync is failed (the peers are
        told) and the error propagates. Counts once in ``stats`` (nested public
        collectives inside ``body`` do not count again).
        """
        def counted():
            with self.stats_book.collective():
                return body()

        self.guard.check_process(op)
        runner = self._runner
        if runner is not None and not runner.is_worker():
            runner.drain()  # earlier async collectives first: call order is the contract
        return self.guard.run(op, counted)

    def submit(self, op: str, body) -> SyncHandle:
        """``run_collective(op, body)`` on this GradSync's async thread, after every
        earlier submission; returns its ``SyncHandle`` at once.

        Raises ``SyncClosed`` (closed or failed) or ``ConfigError`` (a forked child)
        before queueing anything; later errors are delivered by the handle. What
        ``body`` reads or writes must not be touched until the handle is done.
        """
        self.guard.check_usable()
        if self._runner is None:
            self._runner = AsyncRunner(f"ferrosync-async-r{self.rank}")
        return self._runner.submit(lambda: self.run_collective(op, body))

    # -- one call, bucket by bucket ------------------------------------------------------
    # A backend whose one round carries every bucket of a call (``ElasticSync``: the
    # membership must not change between buckets) overrides these two as a whole.

    def _average(self, tensors: list[torch.Tensor], weight: float, stream: str) -> float:
        total = 0.0
        with torch.no_grad():
            for bucket, digest, layout in plan_layouts("average", tensors, self.bucket_bytes):
                # which data this is, for codec state; local to this rank, not in the digest
                layout["stream"] = stream
                flat, is_copy = bucket.flat(self.buffers)
                total = self._average_flat(flat, weight, digest, layout)
                if is_copy and total > 0:
                    bucket.scatter(flat)
        return total

    def _broadcast(self, tensors: list[torch.Tensor], src: int) -> None:
        with torch.no_grad():
            for bucket, digest, layout in plan_layouts("broadcast", tensors,
                                                       self.bucket_bytes):
                flat, is_copy = bucket.flat(self.buffers)
                self._broadcast_flat(flat, src, digest, layout)
                if is_copy and self.rank != src:
                    bucket.scatter(flat)

    # -- backend primitives --------------------------------------------------------------
    # Called by the collectives above, inside ``run_collective`` (one thread at a time, in
    # call order); every rank calls the same primitive with the same ``digest``. A
    # primitive that raises fails this GradSync (``guard.fail`` publishes the abort).

    @abc.abstractmethod
    def _average_flat(self, flat: torch.Tensor, weight: float, digest: bytes,
                      layout: dict) -> float:
        """In place: ``flat`` becomes ``Σ w·flat / Σ w`` over the ranks (unchanged if
        Σw = 0), bit-identical on every rank; returns Σw.

        ``layout`` ({"op", "bucket", "tensors", "stream"}) describes the call for error
        messages (and, ``stream``, for codec state); ``digest`` is its fingerprint,
        which every rank must match, else ``LayoutMismatch`` on every rank.
        """

    @abc.abstractmethod
    def _broadcast_flat(self, flat: torch.Tensor, src: int, digest: bytes,
                        layout: dict) -> None:
        """In place: ``flat`` becomes rank ``src``'s bytes."""

    @abc.abstractmethod
    def _all_gather_flat(self, flat: torch.Tensor, digest: bytes,
                         layout: dict) -> list[torch.Tensor]:
        """Every rank's ``flat`` (new tensors, indexed by rank)."""

    @abc.abstractmethod
    def _barrier(self, digest: bytes, layout: dict) -> None:
        """Return once every rank has entered."""

    #: whether the backend implements the point-to-point primitives below
    point_to_point = False

    def _all_to_all_flat(self, outputs: list, inputs: list, digest: bytes,
                         layout: dict) -> None:
        """Collective: ``outputs[r]`` becomes rank r's ``inputs[self.rank]`` (contiguous)."""
        raise NotImplementedError

    def _send_flat(self, flat: torch.Tensor, dst: int, tag: int) -> None:
        """Point-to-point, no collective number: publish the next message to ``dst``."""
        raise NotImplementedError

    def _post_recv(self, src: int, tag: int) -> int:
        """Take the number of the next message from ``src`` on ``tag``."""
        raise NotImplementedError

    def _recv_flat(self, flat: torch.Tensor, src: int | None, tag: int,
                   number: int | None = None, block: bool = True) -> int | None:
        """Read message ``number`` of ``src`` (``None``: the next of any rank) into ``flat``;
        the source rank, or None when not ``block`` and nothing is there yet."""
        raise NotImplementedError

    @abc.abstractmethod
    def _publish_abort(self, exc: BaseException) -> None:
        """Tell peers this rank failed, so they raise now instead of at their timeout
        (best effort, must not raise)."""

    @abc.abstractmethod
    def _shutdown(self, failure: BaseException | None) -> None:
        """Stop threads and release handles; must not wait on peers or raise."""


def plan_layouts(op: str, tensors: list[torch.Tensor],
                 bucket_bytes: int | None) -> list[tuple[Bucket, bytes, dict]]:
    """The buckets of one call of collective ``op``, each with its layout record and
    that record's digest.

    The digest covers the whole call (operation and every tensor's dtype and shape),
    so a mismatch anywhere is caught at the first bucket.
    """
    buckets = plan_buckets(tensors, bucket_bytes)
    if not buckets:  # no tensors: still a collective (weights are summed)
        buckets = [Bucket(0, [], torch.float32, torch.device("cpu"), 0)]
    signature = layout_signature(tensors)
    out = []
    for bucket in buckets:
        layout = {"op": op, "bucket": f"{bucket.index}/{len(buckets)}", "tensors": signature}
        out.append((bucket, layout_digest(json.dumps(layout, sort_keys=True)), layout))
    return out


class Receive:
    """A posted point-to-point receive (``GradSync.irecv``); ``wait()`` reads it."""

    def __init__(self, sync: GradSync, tensor: torch.Tensor, src: int | None, tag: int,
                 number: int | None) -> None:
        self._sync, self._tensor, self._tag, self._number = sync, tensor, tag, number
        self.src = src  # the sender's rank once known
        self._done = False

    def _read(self, block: bool) -> None:
        with torch.no_grad():
            flat, finish = _receiver(self._tensor)
            source = self._sync._recv_flat(flat, self.src, self._tag, self._number,
                                           block=block)
            if source is not None:
                finish()
                self.src, self._done = source, True

    def wait(self) -> int:
        """Block until the message is in the tensor; returns the sender's rank."""
        if not self._done:
            self._sync.run_collective("recv", lambda: self._read(True))
        return self.src

    def done(self) -> bool:
        """Whether the message is in the tensor (one look, without waiting)."""
        if not self._done:
            self._sync.run_collective("recv", lambda: self._read(False))
        return self._done


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """Its values in one contiguous CPU block (conjugation and negation applied)."""
    return tensor.detach().resolve_conj().resolve_neg().contiguous().cpu()


def _receiver(tensor: torch.Tensor):
    """(a contiguous flat CPU tensor to receive into, a function that puts it in place)."""
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        return tensor.detach().view(-1), lambda: None
    flat = torch.empty(tensor.numel(), dtype=tensor.dtype)
    return flat, lambda: tensor.detach().copy_(flat.view(tensor.shape))


def _check_tag(tag, rank: int) -> int:
    if isinstance(tag, bool) or not isinstance(tag, int) or tag < 0:
        raise value_error("tag", "an integer >= 0", tag, rank=rank)
    return tag


def _stream(kind: str, tensors: list) -> str:
    """A name for "this kind of call on these very tensors", e.g. a model's gradients.

    Lossy codecs keep state per stream (int8 error feedback): a model's parameters
    and its gradients have one layout but are different data, and their residuals
    must never mix. Identity is the Python objects' (stable across steps for
    parameters), so the name only means something inside this process.
    """
    ids = ",".join(str(id(t)) for t in tensors)
    return f"{kind}:{hashlib.blake2b(ids.encode(), digest_size=8).hexdigest()}"


def _check_weight(weight, rank: int | None = None) -> float:
    if isinstance(weight, torch.Tensor):
        if weight.numel() != 1:
            raise value_error("weight", "a number", weight,
                              got=f"a tensor of shape {list(weight.shape)}", rank=rank,
                              hint="pass a Python float or a one-element tensor")
        weight = weight.item()
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise value_error("weight", "a number", weight, got=type(weight).__name__, rank=rank)
    return number("weight", weight, minimum=0.0, rank=rank,
                  hint="use weight=0 for a rank that contributes nothing")


def _named_parameters(module_or_params) -> list[tuple[str, torch.Tensor]]:
    """(name for error messages, parameter): the module's own names, else ``params[i]``.

    Sparse or otherwise unusable gradients are reported by ``check_tensors`` under
    these names (``embed.weight.grad``), before any I/O.
    """
    if isinstance(module_or_params, torch.nn.Module):
        return list(module_or_params.named_parameters())
    if isinstance(module_or_params, torch.Tensor):
        return [("params[0]", module_or_params)]
    params = list(module_or_params)
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise value_error(f"params[{i}]", "a tensor (pass an nn.Module or an iterable "
                              "of parameters)", p, got=type(p).__name__)
    return [(f"params[{i}]", p) for i, p in enumerate(params)]


# -- connect ------------------------------------------------------------------------------

def connect(url: str | None = None, *, rank: int | None = None, world_size: int | None = None,
            timeout: float = 300.0, **options) -> GradSync:
    """Connect this process to the ranks meeting at ``url``.

    Args:
        url: a directory (``/mnt/nfs/run``, ``file:///...``), an fsspec URL
            (``s3://bucket/prefix``, ``gs://...``, ``memory://...``), ``gloo://HOST:PORT``,
            ``nccl://HOST:PORT`` or ``torch://``. Default: ``$FERROSYNC_URL``.
        rank, world_size: default from the environment (torchrun, then SLURM), else 0 and 1.
        timeout: seconds any single wait may last (rendezvous, each collective) before
            ``SyncTimeout``.
        **options: backend options (``reduce``, ``wire_dtype``, ``secret``,
            ``storage_options``, ``heartbeat_timeout``, ...; see docs/reference.md). An
            unknown option is a ``ConfigError``. Two select another backend on a
            storage URL: ``local="gloo"`` (the two-level sync) and ``elastic=True``: join
            an elastic job (docs/elastic.md; with ``min_ranks``, ``max_ranks``,
            ``fan_in``): members come and go, ``rank``/``world_size`` are not given
            (``RANK``/``WORLD_SIZE`` in the environment are ignored) but follow the
            agreed membership, and ``connect`` returns an ``ElasticSync``.

    Collective: every rank calls it; it returns once all ranks have joined (or raises
    ``SyncTimeout`` after ``timeout``). Arguments are validated before any I/O. With
    ``elastic=True`` it returns once a roster admits this member.
    """
    from ferrosync.core.registry import registration_for, selected_options

    if url is None:
        url = os.environ.get(ENV_URL)
        if not url:
            raise ConfigError(
                "no URL given and FERROSYNC_URL is not set",
                hint="pass connect('/shared/dir') or connect('s3://bucket/run'), or set "
                "FERROSYNC_URL",
            )
    if not isinstance(url, str) or not url.strip():
        raise value_error("url", "a non-empty string", url)
    number("timeout", timeout, positive=True, unit="seconds")
    options = selected_options(options)
    backend = registration_for(url, options).load_backend()
    checked = backend.check_options(options)
    identity = backend.identity(rank, world_size)
    return backend(url.strip(), identity, float(timeout), checked)
