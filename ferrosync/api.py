"""``connect`` and ``GradSync``: the public collectives, written once for every backend.

``GradSync`` validates arguments, groups tensors into flat dtype-homogeneous
buckets, times phases and keeps ``stats``. It is an abstract base: a backend
(docs/design.md#backend-contract) implements ``check_options`` and the primitives
that move bytes (``_average_flat``, ``_broadcast_flat``, ``_all_gather_flat``,
``_barrier``, ``_shutdown``), may override ``_publish_abort``, and is registered for
its URL schemes in ``registry.py``; ``tests/test_contract.py`` then runs it.

The collective contract (as with NCCL): every rank calls the same collectives in
the same order, with tensors of the same dtypes and shapes. A violation is
detected (each object carries a layout digest) and raised as ``LayoutMismatch``
on every rank, never silently averaged. A collective that raises leaves this
``GradSync`` unusable (the ranks no longer agree on where they are): close it
and reconnect, which starts a new generation.

**Threads.** A collective may be called from any thread (torch DCP's ``async_save``
calls from a worker thread), but two threads' calls on one ``GradSync`` must not
*overlap*. A collective is identified across ranks by its position in this
GradSync's sequence only, so when two threads call at once, which call is
collective *n* depends on the scheduler of each rank: a lock would serialise them,
in one order on one rank and in the other order on another, and the ranks would
silently average one thread's tensors with the other thread's (layouts being
equal, nothing could tell). So a thread that calls while another thread is inside
a collective on the same GradSync gets ``ConfigError`` before any I/O, and the
GradSync is failed: its abort marker gives the peers a typed error instead of a
crossed result, and the thread that was inside raises ``ConfigError`` too when its
collective ends (even if it completed: the ranks may have paired it with the other
thread's call, and its tensors hold whatever arrived). What cannot be detected are
calls that do not overlap on a rank but come in a different order on different
ranks (one thread's call ended before the other's began), including on a peer whose
threads happened not to overlap: order such calls yourself (join the thread,
``handle.wait()``). The async runner (``async_op=True``) is this library's own
thread: a call from another thread first waits for the submitted collectives.

**Processes.** A GradSync belongs to the process that connected. A forked child
inherits the object but not its threads, and its storage handles and files are the
parent's: in the child every collective raises ``ConfigError`` without any I/O,
``close()`` only marks the child's copy closed, and the exit and exception hooks
below ignore it, so a child that exits (or dies) never tells the parent's peers
that the parent's rank closed or failed.
"""

from __future__ import annotations

import abc
import atexit
import concurrent.futures
import hashlib
import json
import logging
import math
import os
import queue
import sys
import threading
import weakref

import torch

from .codecs import FLOAT_DTYPES
from .env import ENV_URL, Identity, discover
from .errors import ConfigError, FerrosyncError, SyncClosed
from .flat import (
    Bucket,
    BufferPool,
    as_tensor_list,
    check_tensors,
    layout_signature,
    plan_buckets,
)
from .stats import StatsBook
from .wire import DTYPE_CODES, layout_digest

__all__ = ["connect", "GradSync", "SyncHandle"]


_log = logging.getLogger(__name__)


class GradSync(abc.ABC):
    """Averages tensors across ranks. Create with ``ferrosync.connect``.

    Attributes:
        rank, world_size, local_rank: this process's identity.
        url: where the ranks meet.
        stats: ``{"total": {...}, "last": {...}}`` (see ``ferrosync.stats``).
    """

    #: per-backend default bucket size; None means one bucket per dtype
    default_bucket_bytes: int | None = None
    #: True for an elastic job's member, whose rank and world size may change after
    #: any collective (``ferrosync.elastic``); strategies and loops check it
    elastic = False

    def __init__(self, url: str, identity: Identity, timeout: float, counters,
                 bucket_bytes: int | None = None) -> None:
        self.url = url
        self.rank = identity.rank
        self.world_size = identity.world_size
        self.local_rank = identity.local_rank
        self.timeout = timeout
        self.bucket_bytes = bucket_bytes if bucket_bytes is not None else self.default_bucket_bytes
        self._stats = StatsBook(counters)
        self._pool = BufferPool()
        self._closed = False
        self._failure: BaseException | None = None
        self._failed_at: int | None = None
        # the process that connected: a forked child inherits this object, not the right
        # to use it (see the module docstring)
        self._pid = os.getpid()
        # held by a running collective so that close() from another thread waits for it;
        # never contended between collectives, which _enter keeps from overlapping
        self._lock = threading.RLock()
        # protects _owner/_depth/_failure transitions; held for a few instructions only,
        # never across I/O, so a thread checking for overlap never blocks
        self._guard = threading.Lock()
        self._owner: threading.Thread | None = None  # the thread inside a collective
        self._owner_op: str | None = None
        self._depth = 0  # nested calls by the owner (average_gradients -> average_)
        self._overlap: ConfigError | None = None  # the overlap that failed this GradSync
        self._runner: _AsyncRunner | None = None
        self.counters = counters
        _LIVE.add(self)

    @classmethod
    @abc.abstractmethod
    def check_options(cls, options: dict):
        """Validate ``connect``'s keyword options before any I/O and return them typed
        (``backends/options.py``); a ``ConfigError`` names the first bad one. Called by
        ``connect`` with every option the user passed; the result is handed to
        ``__init__(url, identity, timeout, options)``."""

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
            return self._submit("average", tensors, body)
        return self._collective("average", tensors, body)

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
        """Collective: ``average_`` over the parameters' data (Local SGD, model averaging)."""
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
            raise ConfigError(f"src must be a rank in [0, {self.world_size}), got {src!r}",
                              rank=self.rank)
        check_tensors(tensors, op="broadcast_", rank=self.rank, path=self.url, in_place=True,
                      dtypes=tuple(DTYPE_CODES))
        self._collective("broadcast", tensors, lambda: self._broadcast(tensors, src))

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Collective: every rank's ``tensor`` (any dtype), as a list indexed by rank.

        Every rank passes a tensor of the same dtype and shape; blocks until all have
        arrived. The returned tensors are new (this rank's entry is a copy). The tensor
        is only read: an expanded or conjugate view is fine; sparse, ``meta`` and
        unsupported dtypes are a ``ConfigError`` before any I/O.
        """
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"all_gather takes one tensor, got {type(tensor).__name__}",
                              rank=self.rank)
        check_tensors([tensor], op="all_gather", rank=self.rank, path=self.url,
                      names=["tensor"], in_place=False, dtypes=tuple(DTYPE_CODES))
        # plain values in one block: contiguous() copies an expanded view, resolve_*()
        # applies a pending conjugation or negation (a flag on the view, not in memory)
        source = tensor.detach().resolve_conj().resolve_neg().contiguous()

        def body():
            (bucket, digest, layout), = self._buckets("all_gather", [source])
            flat = source.view(-1)
            return [t.view(tensor.shape) for t in self._all_gather_flat(flat, digest, layout)]

        return self._collective("all_gather", [source], body)

    def barrier(self) -> None:
        """Collective: returns once every rank has entered."""
        def body():
            (_bucket, digest, layout), = self._buckets("barrier", [])
            self._barrier(digest, layout)

        self._collective("barrier", [], body)

    def close(self) -> None:
        """Release storage handles and threads. Idempotent; never waits on peers and
        never raises because a peer failed (pending async collectives are cancelled).

        Called from another thread while a collective runs, it waits for that
        collective (bounded by its ``timeout``). In a forked child it only marks the
        child's copy closed: the handles, threads and objects are the parent's.
        """
        if os.getpid() != self._pid:
            self._closed = True
            _LIVE.discard(self)
            return
        runner = self._runner
        if runner is not None:
            runner.stop()
        with self._lock:
            if not self._closed:
                self._closed = True
                _LIVE.discard(self)
                try:
                    self._shutdown(self._failure)
                finally:
                    self._pool.clear()
        if runner is not None and not runner.is_worker():
            # queued collectives fail fast once closed; joining matters at exit: a
            # daemon thread still inside a torch op when the interpreter finalizes is
            # killed by a forced unwind through C++ and the process aborts (SIGABRT)
            runner.join(_RUNNER_JOIN_TIMEOUT)

    def __enter__(self) -> GradSync:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and self._failure is None and not self._closed:
            self._fail(exc)
        self.close()

    @property
    def stats(self) -> dict:
        return self._stats.as_dict()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(url={self.url!r}, rank={self.rank}, "
                f"world_size={self.world_size})")

    # -- shared machinery --------------------------------------------------------------
    def _submit(self, op: str, tensors: list, body) -> SyncHandle:
        self._check_usable()
        return self._run_async(lambda: self._collective(op, tensors, body))

    def _run_async(self, fn) -> SyncHandle:
        """Queue ``fn`` on this GradSync's async thread (started on first use), after
        every earlier submission; ``fn`` runs its collective through ``_collective``.
        For this module and the DDP process group's async allreduce."""
        if self._runner is None:
            self._runner = _AsyncRunner(f"ferrosync-async-r{self.rank}")
        return self._runner.submit(fn)

    def _collective(self, op: str, tensors: list, body):
        """Run ``body`` as this GradSync's next collective, on the calling thread.

        Refuses a forked child and a second thread (see the module docstring) before
        any I/O; fails the GradSync (abort marker for the peers) if ``body`` raises.
        """
        self._check_process(op)
        if self._runner is not None and not self._runner.is_worker():
            self._runner.drain()  # earlier async collectives first: call order is the contract
        self._enter(op)
        try:
            with self._lock:
                self._check_usable()
                with self._stats.collective():
                    try:
                        value = body()
                    except BaseException as exc:
                        if self._failure is not None and not isinstance(exc, FerrosyncError):
                            # another thread failed this GradSync meanwhile and this is
                            # the fallout (state torn down under us): say so, typed
                            raise self._failed_meanwhile(op) from exc
                        self._fail(exc)
                        raise
                    if self._failure is not None:
                        # failed by another thread while body ran: the ranks may have
                        # paired this call with another thread's, so the value is suspect
                        raise self._failed_meanwhile(op)
                    return value
        finally:
            self._leave()

    def _enter(self, op: str) -> None:
        """Make the calling thread the one inside a collective, or fail: a second thread
        must not wait for its turn, because its turn would differ between ranks."""
        me = threading.current_thread()
        with self._guard:
            owner = self._owner
            if owner is None or owner is me:
                if owner is None:
                    self._owner, self._owner_op = me, op
                self._depth += 1
                return
            inside = self._owner_op
        error = ConfigError(
            f"thread {me.name!r} called {op} while thread {owner.name!r} is inside {inside} "
            "on the same GradSync; collectives from two threads must not overlap (each "
            "rank would order them its own way and average one thread's tensors with "
            "another's)",
            rank=self.rank, path=self.url,
            hint="call the collectives from one thread, or let a call return (join the "
            "thread, handle.wait()) before the next starts; this GradSync is now failed: "
            "close it and connect again (all ranks)",
        )
        with self._guard:
            if self._overlap is None:
                self._overlap = error
        self._fail(error)
        raise error

    def _leave(self) -> None:
        with self._guard:
            self._depth -= 1
            if self._depth == 0:
                self._owner = self._owner_op = None

    def _failed_meanwhile(self, op: str) -> FerrosyncError:
        failure = self._failure
        if failure is self._overlap and isinstance(failure, ConfigError):
            return ConfigError(
                f"{op} on thread {threading.current_thread().name!r} ran while another "
                f"thread called a collective on the same GradSync ({failure.what}); its "
                "result is discarded (the tensors hold undefined values)",
                rank=self.rank, path=self.url, hint=failure.hint,
            )
        return SyncClosed(
            f"this GradSync was failed from another thread while {op} ran "
            f"({type(failure).__name__}: {failure}); its result is discarded (the tensors "
            "hold undefined values)",
            rank=self.rank, path=self.url,
            hint="close this GradSync and connect again (all ranks)",
        )

    def _check_process(self, op: str) -> None:
        if os.getpid() != self._pid:
            raise ConfigError(
                f"this GradSync belongs to pid {self._pid}; this is pid {os.getpid()}, a "
                f"forked child, which cannot run {op} on it (its storage handles, threads "
                "and collective sequence are the parent's)",
                rank=self.rank, path=self.url,
                hint="connect again in the child (ferrosync.connect(...) with the child's "
                "own rank and URL), or fork before connecting",
            )

    def _check_usable(self) -> None:
        self._check_process("a collective")
        if self._closed:
            raise SyncClosed("this GradSync is closed", rank=self.rank, path=self.url,
                             hint="connect again to start a new generation")
        if self._failure is not None:
            raise SyncClosed(
                f"an earlier collective failed ({type(self._failure).__name__}: "
                f"{self._failure})", rank=self.rank, path=self.url,
                hint="close this GradSync and connect again (all ranks)",
            )

    def _fail(self, exc: BaseException) -> None:
        """Record the first failure and tell the peers (abort marker); later calls and
        calls in a forked child do nothing (the child must not speak for the parent)."""
        if os.getpid() != self._pid:
            return
        with self._guard:
            if self._failure is not None:
                return
            self._failure = exc
        try:
            self._publish_abort(exc)
        except Exception:  # noqa: BLE001 - never mask the original error with this one
            _log.warning("rank %d: could not tell the peers this rank failed", self.rank,
                         exc_info=True)

    def _buckets(self, op: str, tensors: list[torch.Tensor]) -> list[tuple[Bucket, bytes, dict]]:
        """Plan the buckets, each with its layout record and that record's digest.

        The digest covers the whole call (operation and every tensor's dtype and
        shape), so a mismatch anywhere is caught at the first bucket.
        """
        buckets = plan_buckets(tensors, self.bucket_bytes)
        if not buckets:  # no tensors: still a collective (weights are summed)
            buckets = [Bucket(0, [], torch.float32, torch.device("cpu"), 0)]
        signature = layout_signature(tensors)
        out = []
        for bucket in buckets:
            layout = {"op": op, "bucket": f"{bucket.index}/{len(buckets)}", "tensors": signature}
            out.append((bucket, layout_digest(json.dumps(layout, sort_keys=True)), layout))
        return out

    def _average(self, tensors: list[torch.Tensor], weight: float, stream: str) -> float:
        total = 0.0
        with torch.no_grad():
            for bucket, digest, layout in self._buckets("average", tensors):
                # which data this is, for codec state; local to this rank, not in the digest
                layout["stream"] = stream
                flat, is_copy = bucket.flat(self._pool)
                total = self._average_flat(flat, weight, digest, layout)
                if is_copy and total > 0:
                    bucket.scatter(flat)
        return total

    def _broadcast(self, tensors: list[torch.Tensor], src: int) -> None:
        with torch.no_grad():
            for bucket, digest, layout in self._buckets("broadcast", tensors):
                flat, is_copy = bucket.flat(self._pool)
                self._broadcast_flat(flat, src, digest, layout)
                if is_copy and self.rank != src:
                    bucket.scatter(flat)

    # -- backend primitives --------------------------------------------------------------
    # Called by the collectives above, inside ``_collective`` (one thread at a time, in
    # call order); every rank calls the same primitive with the same ``digest``. A
    # primitive that raises fails this GradSync (``_fail`` publishes the abort).

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

    @abc.abstractmethod
    def _publish_abort(self, exc: BaseException) -> None:
        """Tell peers this rank failed, so they raise now instead of at their timeout
        (best effort, must not raise)."""

    @abc.abstractmethod
    def _shutdown(self, failure: BaseException | None) -> None:
        """Stop threads and release handles; must not wait on peers or raise."""


class SyncHandle(concurrent.futures.Future):
    """The pending result of a collective started with ``async_op=True``: a
    ``concurrent.futures.Future`` (``done()``, ``result()``, ``exception()``,
    ``add_done_callback``, ``concurrent.futures.wait``) plus ``wait()``.

    It cannot be cancelled: the peers run the collective whatever this rank wants, so
    skipping it would pair every later call with the wrong one (``cancel()`` returns
    False).
    """

    def cancel(self) -> bool:
        return False

    def wait(self, timeout: float | None = None):
        """Block until the collective finished; return its value or raise its error.

        ``timeout`` bounds this wait only (the collective keeps its own timeout); past
        it, ``TimeoutError``.
        """
        try:
            return self.result(timeout)
        except concurrent.futures.TimeoutError:
            if self.done():
                raise  # the collective itself raised a TimeoutError
            raise TimeoutError(
                f"the async collective did not finish within {timeout} s") from None


#: how long close() waits for the async thread to finish its queue (seconds)
_RUNNER_JOIN_TIMEOUT = 10.0


class _AsyncRunner:
    """One daemon thread running submitted collectives in order.

    A daemon thread, so a process whose peers vanished can still exit; the
    collective's own timeout bounds how long a running one can take.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: list[SyncHandle] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn) -> SyncHandle:
        handle = SyncHandle()
        self._pending.append(handle)
        self._queue.put((fn, handle))
        return handle

    def is_worker(self) -> bool:
        return threading.current_thread() is self._thread

    def drain(self) -> None:
        """Wait for every submitted collective (errors stay with their handles)."""
        concurrent.futures.wait(self._pending)
        self._pending = [h for h in self._pending if not h.done()]

    def stop(self) -> None:
        self._queue.put(None)

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the thread to finish (after ``stop``)."""
        self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, handle = item
            handle.set_running_or_notify_cancel()  # never cancelled (SyncHandle.cancel)
            try:
                handle.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - delivered by handle.wait()
                handle.set_exception(exc)


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
            raise ConfigError(
                f"weight must be a number, got a tensor of shape {list(weight.shape)}",
                rank=rank, hint="pass a Python float or a one-element tensor")
        weight = weight.item()
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise ConfigError(f"weight must be a number, got {type(weight).__name__}", rank=rank)
    weight = float(weight)
    if not math.isfinite(weight) or weight < 0:
        raise ConfigError(f"weight must be finite and >= 0, got {weight}", rank=rank,
                          hint="use weight=0 for a rank that contributes nothing")
    return weight


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
            raise ConfigError(
                f"expected an nn.Module or an iterable of parameters, found "
                f"{type(p).__name__} at params[{i}]"
            )
    return [(f"params[{i}]", p) for i, p in enumerate(params)]


# -- connect ------------------------------------------------------------------------------

def connect(url: str | None = None, *, rank: int | None = None, world_size: int | None = None,
            timeout: float = 300.0, elastic: bool = False, min_ranks: int = 1,
            max_ranks: int | None = None, **options) -> GradSync:
    """Connect this process to the ranks meeting at ``url``.

    Args:
        url: a directory (``/mnt/nfs/run``, ``file:///...``), an fsspec URL
            (``s3://bucket/prefix``, ``gs://...``, ``memory://...``), ``gloo://HOST:PORT``,
            ``nccl://HOST:PORT`` or ``torch://``. Default: ``$FERROSYNC_URL``.
        rank, world_size: default from the environment (torchrun, then SLURM), else 0 and 1.
        timeout: seconds any single wait may last (rendezvous, each collective) before
            ``SyncTimeout``.
        **options: backend options (``reduce``, ``wire_dtype``, ``secret``,
            ``storage_options``, ``heartbeat_timeout``, ...; see the README). An
            unknown option is a ``ConfigError``.
        elastic: join an elastic job on a storage URL (docs/elastic.md): members come
            and go, ``rank``/``world_size`` are not given (``RANK``/``WORLD_SIZE`` in
            the environment are ignored) but follow the agreed membership.
        min_ranks, max_ranks: with ``elastic``, the fewest members a round waits for
            and the most it admits (None: no limit).

    Collective: every rank calls it; it returns once all ranks have joined (or raises
    ``SyncTimeout`` after ``timeout``). Arguments are validated before any I/O. With
    ``elastic=True`` it returns once a roster admits this member.
    """
    from .registry import backend_for

    if url is None:
        url = os.environ.get(ENV_URL)
        if not url:
            raise ConfigError(
                "no URL given and FERROSYNC_URL is not set",
                hint="pass connect('/shared/dir') or connect('s3://bucket/run'), or set "
                "FERROSYNC_URL",
            )
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"url must be a non-empty string, got {url!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
        0 < timeout < math.inf
    ):
        raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
    from . import validate

    if validate.boolean("elastic", elastic):
        if rank is not None or world_size is not None:
            raise ConfigError(
                "rank and world_size cannot be given with elastic=True: an elastic "
                "member's rank and world size follow the membership agreed each round",
                hint="drop rank=/world_size= (read sync.rank and sync.world_size instead)")
        from .registry import elastic_connector

        return elastic_connector(url, options)(url.strip(), float(timeout), min_ranks,
                                               max_ranks, options)
    if min_ranks != 1 or max_ranks is not None:
        raise ConfigError("min_ranks and max_ranks apply to elastic jobs only",
                          hint="pass elastic=True, or drop min_ranks/max_ranks")
    identity = discover(rank, world_size)
    if "local" in options and options["local"] is None:
        del options["local"]  # local=None: the flat (one-level) backend
    backend = backend_for(url, options)
    checked = backend.check_options(options)
    return backend(url.strip(), identity, float(timeout), checked)


# -- aborting on process exit ----------------------------------------------------------------
#
# An uncaught exception that ends the process must leave an abort marker, or the
# peers would wait out their whole timeout. sys.excepthook runs before atexit, so
# it records the failure; atexit then closes whatever is still open.

_LIVE: weakref.WeakSet[GradSync] = weakref.WeakSet()
_previous_excepthook = sys.excepthook


def fail_open_syncs(exc: BaseException) -> None:
    """Fail every open GradSync of this process with ``exc``: each publishes its abort
    marker, so its peers raise ``PeerFailed`` now instead of waiting out a timeout.

    For code that ends the process on an exception it handles itself (the launcher's
    script runner prints a one-line error and exits 1): an uncaught exception does
    this through ``sys.excepthook``. A forked child's copies are the parent's and are
    left alone.
    """
    pid = os.getpid()
    for sync in list(_LIVE):
        if sync._pid == pid and sync._failure is None and not sync._closed:
            sync._fail(exc)


def _excepthook(exc_type, exc, tb):
    fail_open_syncs(exc)
    _previous_excepthook(exc_type, exc, tb)


def _close_all() -> None:
    pid = os.getpid()
    for sync in list(_LIVE):
        if sync._pid != pid:
            continue  # a forked child exiting must not publish "closed" for the parent
        try:
            sync.close()
        except Exception:  # noqa: BLE001 - at exit: one sync must not stop the others
            _log.warning("could not close %r at exit", sync, exc_info=True)


sys.excepthook = _excepthook
atexit.register(_close_all)
