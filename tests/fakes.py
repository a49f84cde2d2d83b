"""Fakes for fast, deterministic in-process unit tests: a clock, a storage and a sync.

``FakeClock`` is time that moves only when the code under test sleeps (or a test
advances it), so a wait that would last 30 s takes microseconds, and a timeout is
reached at a known instant, whatever the machine's speed. Actions scheduled with
``call_at`` run on the sleeping thread when their time comes: a test plays "rank 0
announces after 0.5 s" into a rank's wait loop without a second thread, so no test
depends on which of two threads runs first.

``MemoryStorage`` is a real ``ferrosync.storage.engines.Storage`` (the interface every
store implements) holding objects in a dict, with what a test needs to provoke
trouble: a latency per request on the fake clock, failures injected into the next
matching requests, hooks run before a request (another process acting "just
before"), and a log of every request.

``FakeSync`` is a ``GradSync`` as one rank sees it, the other ranks' records and
contributions scripted: for the policy layers (strategies) above the transport.

Modules that take their clock from ``time`` and their polling from ``Backoff`` are
switched to the fake clock with ``clock.install(monkeypatch, module)``, which also
makes it ``ferrosync.core.runtime.DEFAULT`` (what the object layer, the elastic layer and
heartbeats run on when nothing is passed in).
"""

from __future__ import annotations

import fnmatch
import heapq
import itertools
import types

import torch

from ferrosync.core import runtime
from ferrosync.elastic.events import MembershipChange
from ferrosync.storage import liveness
from ferrosync.storage.engines import Storage
from ferrosync.storage.engines.base import BytesReader


class FakeClock:
    """Monotonic and wall time that advance only through ``sleep``/``advance``."""

    def __init__(self, start: float = 1000.0, wall: float = 1.7e9) -> None:
        self.now = start
        self._wall_offset = wall - start
        self._due: list[tuple[float, int, object]] = []
        self._order = itertools.count()
        self.slept = 0.0  # total fake seconds slept by the code under test

    # -- what the code under test calls -----------------------------------------------------
    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic

    def time(self) -> float:
        return self.now + self._wall_offset

    def sleep(self, seconds: float) -> None:
        self.slept += max(0.0, seconds)
        self.advance(seconds)

    def __call__(self) -> float:  # as a ``now`` function (liveness.ProcessClock)
        return self.now

    # -- what tests call -------------------------------------------------------------------------
    def advance(self, seconds: float) -> None:
        """Move time forward, running every action that falls due, in time order."""
        end = self.now + max(0.0, seconds)
        while self._due and self._due[0][0] <= end:
            at, _, action = heapq.heappop(self._due)
            self.now = max(self.now, at)
            action()  # may sleep itself: time then runs on from inside it
        self.now = max(self.now, end)

    def call_at(self, at: float, action) -> None:
        """Run ``action()`` once the clock passes ``at`` (on the thread that sleeps)."""
        heapq.heappush(self._due, (at, next(self._order), action))

    def call_later(self, delay: float, action) -> None:
        self.call_at(self.now + delay, action)

    def Backoff(self, initial: float, cap: float) -> FakeBackoff:  # noqa: N802 - the class it fakes
        return FakeBackoff(self, initial, cap)

    def runtime(self) -> FakeRuntime:
        """A ``ferrosync.core.runtime.Runtime`` on this clock (real threads and locks)."""
        return FakeRuntime(self)

    def install(self, monkeypatch, *modules) -> FakeClock:
        """Make ``modules`` read time from this clock (their ``time`` name, where they
        import one) and poll with its back-off (their ``Backoff`` name), and make a
        runtime on it the default one (``ferrosync.core.runtime.DEFAULT``)."""
        shim = types.SimpleNamespace(monotonic=self.monotonic, time=self.time,
                                     sleep=self.sleep, perf_counter=self.perf_counter)
        monkeypatch.setattr(runtime, "DEFAULT", self.runtime())
        for module in modules:
            if hasattr(module, "time"):
                monkeypatch.setattr(module, "time", shim)
            if hasattr(module, "Backoff"):
                monkeypatch.setattr(module, "Backoff", self.Backoff)
        return self


def install_elastic_clock(monkeypatch, *modules) -> FakeClock:
    """A ``FakeClock`` driving the elastic layer (and ``modules``): its time and the
    process clock its silence rule reads (the default runtime's), with no member
    judged gone yet (the judgements are per process, so other tests' members would
    leak in)."""
    clock = FakeClock().install(monkeypatch, *modules)
    monkeypatch.setattr(liveness, "PROCESS_CLOCK", runtime.DEFAULT.process_clock)
    return clock


class FakeRuntime(runtime.Runtime):
    """``ferrosync.core.runtime.Runtime`` on a ``FakeClock``: its time, sleeps and back-off,
    a process clock of its own and no member judged gone; threads and locks are real."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock
        self.monotonic, self.time, self.sleep = clock.monotonic, clock.time, clock.sleep
        self.Backoff = clock.Backoff
        self.process_clock = liveness.ProcessClock(clock)


class FakeBackoff:
    """``storage.Backoff`` on a fake clock: the same doubling schedule, no real sleep."""

    def __init__(self, clock: FakeClock, initial: float, cap: float) -> None:
        self._clock = clock
        self.delay = initial
        self._cap = cap

    def sleep(self, deadline: float) -> None:
        self._clock.sleep(max(0.0, min(self.delay, deadline - self._clock.now)))
        self.delay = min(self.delay * 2, self._cap)


class MemoryStorage(Storage):
    """A ``Storage`` in a dict. Puts are atomic (whole objects), as on every real store.

    Args:
        clock: a ``FakeClock`` each request advances by ``latency`` seconds.
        can_recycle, cheap_deletes, round_trips_dominate: the store's traits.

    Trouble on demand: ``fail(op, pattern, exc, times=1)`` raises ``exc`` from the
    next ``times`` requests ``op`` ("put", "open", "delete", "park", "list") on keys
    matching the glob ``pattern``; ``before(op, pattern, action)`` runs
    ``action(key)`` once, just before the next such request. ``log`` lists every
    request as ``(op, key)``.
    """

    def __init__(self, url: str = "mem://test", *, clock: FakeClock | None = None,
                 latency: float = 0.0, can_recycle: bool = False,
                 cheap_deletes: bool = True, round_trips_dominate: bool = False) -> None:
        super().__init__(url)
        self.objects: dict[str, bytes] = {}
        self.clock = clock
        self.latency = latency
        self.can_recycle = can_recycle
        self.cheap_deletes = cheap_deletes
        self.round_trips_dominate = round_trips_dominate
        self.log: list[tuple[str, str]] = []
        self._failures: list[list] = []  # [op, pattern, exc, times left]
        self._hooks: list[tuple[str, str, object]] = []
        self._spares = itertools.count()

    # -- trouble -----------------------------------------------------------------------------
    def fail(self, op: str, pattern: str, exc: BaseException, *, times: int = 1) -> None:
        self._failures.append([op, pattern, exc, times])

    def before(self, op: str, pattern: str, action) -> None:
        self._hooks.append((op, pattern, action))

    def _request(self, op: str, key: str) -> None:
        self.log.append((op, key))
        for hook in list(self._hooks):
            if hook[0] == op and fnmatch.fnmatchcase(key, hook[1]):
                self._hooks.remove(hook)
                hook[2](key)
        if self.clock is not None and self.latency:
            self.clock.advance(self.latency)  # not a sleep of the code under test
        for failure in self._failures:
            if failure[0] == op and failure[3] > 0 and fnmatch.fnmatchcase(key, failure[1]):
                failure[3] -= 1
                raise failure[2]

    def requests(self, op: str, pattern: str = "*") -> list[str]:
        """Keys of the logged ``op`` requests matching ``pattern``, in order."""
        return [k for o, k in self.log if o == op and fnmatch.fnmatchcase(k, pattern)]

    # -- the Storage interface ---------------------------------------------------------------
    def put(self, key, parts, *, exclusive=False, reuse=None) -> int:
        self._request("put", key)
        data = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
        if exclusive and key in self.objects:
            raise FileExistsError(self.path_of(key))
        if reuse is not None and self.can_recycle:
            self.objects.pop(reuse, None)  # its storage became this object
        self.objects[key] = data
        self.counters.add(puts=1, written=len(data))
        return len(data)

    def open(self, key, *, max_bytes=None, rank=None):
        self._request("open", key)
        self.counters.add(gets=1)
        data = self.objects.get(key)
        if data is None:
            return None
        self.check_size(key, len(data), max_bytes, rank)  # Storage's one size rule
        self.counters.add(read=len(data))
        return BytesReader(data)  # what an object store's GET gives

    def delete(self, keys) -> None:
        for key in list(keys):
            self._request("delete", key)
            self.counters.add(deletes=1)
            self.objects.pop(key, None)

    def park(self, key):
        if not self.can_recycle:
            return None
        self._request("park", key)
        data = self.objects.pop(key, None)
        if data is None:
            return None
        spare = f"{key.rsplit('/', 1)[0]}/.spare.{next(self._spares)}"
        self.objects[spare] = data
        return spare

    def list(self, prefix=""):
        self._request("list", prefix)
        self.counters.add(lists=1)
        return sorted((k, len(v)) for k, v in self.objects.items() if k.startswith(prefix))


class FakeSync:
    """A ``GradSync`` of ``world_size`` ranks as rank ``rank`` sees it, in this process: what
    the other ranks send is scripted, every call is logged in ``calls`` as ``(op, detail)``.

    For the policy layers (strategies) that decide *when* to synchronise and *how much* each
    rank counts: the arithmetic of a collective is the real one (``Σ w·T / Σ w``, tensors
    unchanged when every weight is 0), the bytes are not moved.

    Args:
        peer_records: the other ranks' ``all_gather`` records, one ``{rank: values}`` per
            gather, in order; a rank missing from it (or every rank, once the list is
            used up) sent this rank's own record.
        peer_parts: ``(n, tensors) -> [(weight, tensors), ...]``, the other ranks'
            contributions to this rank's ``n``-th ``average_`` (0-based; default none).
        moved: bytes written and read per collective, in ``stats["total"]``.
        elastic: the members may change, as an elastic job's: ``on_membership`` tells a
            subscriber who they are at once (``change`` plays a change).
    """

    def __init__(self, rank: int = 0, world_size: int = 2, *, timeout: float = 60.0,
                 elastic: bool = False, peer_records=(), peer_parts=None,
                 moved: int = 100, wire_dtype: str | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.timeout, self.elastic = timeout, elastic
        self.wire_dtype = wire_dtype
        self.url = "fake://sync"
        self.contributors = list(range(world_size))
        self.peer_records = list(peer_records)
        self.peer_parts = peer_parts or (lambda n, tensors: [])
        self.moved = moved
        self.calls: list[tuple[str, object]] = []
        self.averages = 0
        self.subscribers: list = []

    @property
    def stats(self) -> dict:
        moved = len(self.calls) * self.moved
        return {"total": {"bytes_written": moved, "bytes_read": moved}}

    def ops(self) -> list[str]:
        return [op for op, _ in self.calls]

    def weights(self) -> list[float]:
        """The weight this rank gave each of its averages, in order."""
        return [detail[0] for op, detail in self.calls if op.startswith("average")]

    def on_membership(self, callback) -> None:
        if self.elastic:
            self.subscribers.append(callback)
            members = tuple(f"m{r}" for r in range(self.world_size))
            callback(MembershipChange(0, self.rank, self.world_size, members, members, ()))

    def change(self, round: int, rank: int, members: tuple[str, ...], joined=(), left=()):
        """Play a membership change to the subscribers (an elastic sync's round)."""
        self.rank, self.world_size = rank, len(members)
        self.contributors = list(members)
        for callback in self.subscribers:
            callback(MembershipChange(round, rank, len(members), tuple(members),
                                      tuple(joined), tuple(left)))

    def all_gather(self, tensor):
        scripted = self.peer_records.pop(0) if self.peer_records else {}
        self.calls.append(("all_gather", tensor.tolist()))
        return [tensor.clone() if r == self.rank or r not in scripted
                else torch.tensor(scripted[r], dtype=tensor.dtype)
                for r in range(self.world_size)]

    def average_(self, tensors, *, weight: float = 1.0) -> float:
        tensors = list(tensors)
        parts = [(weight, tensors), *self.peer_parts(self.averages, tensors)]
        self.averages += 1
        self.calls.append(("average_", (weight, tensors)))
        total = sum(w for w, _ in parts)
        if total:
            sums = [sum(w * p[i].double() for w, p in parts) for i in range(len(tensors))]
            for t, s in zip(tensors, sums):
                t.copy_(s / total)
        return total

    def average_gradients(self, module_or_params, *, weight: float = 1.0) -> float:
        params = (list(module_or_params.parameters()) if hasattr(module_or_params, "parameters")
                  else list(module_or_params))
        grads = [p.grad for p in params if p.grad is not None]
        total = self.average_(grads, weight=weight)
        self.calls[-1] = ("average_gradients", self.calls[-1][1])
        return total

    def broadcast_(self, tensors, *, src: int = 0) -> None:
        self.calls.append(("broadcast_", (src, list(tensors))))


class PlainSGD:
    """SGD by ``torch.optim.SGD``'s rule (momentum buffer = the first gradient, then
    ``m·buf + g``; Nesterov steps by ``g + m·buf``), logged into ``log`` as
    ``("optimizer.step", None)`` when given: the optimizer of policy tests. Constructing a
    process's first ``torch.optim`` optimizer imports ``torch._dynamo`` (seconds); the
    strategies' use of the real one is tested on real ranks (tests/test_strategies.py)."""

    def __init__(self, params, lr: float = 1.0, log: list | None = None, *,
                 momentum: float = 0.0, nesterov: bool = False) -> None:
        self.params, self.lr, self.log = list(params), lr, log
        self.momentum, self.nesterov = momentum, nesterov
        self.buffers: dict[int, torch.Tensor] = {}
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        if self.log is not None:
            self.log.append(("optimizer.step", None))
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if p.grad is None:
                    continue
                step = p.grad
                if self.momentum:
                    buf = self.buffers.get(i)
                    buf = step.clone() if buf is None else buf.mul_(self.momentum).add_(step)
                    self.buffers[i] = buf
                    step = step + self.momentum * buf if self.nesterov else buf
                p.sub_(self.lr * step)

    def state_dict(self) -> dict:
        return {"state": {i: {"momentum_buffer": b.clone()} for i, b in self.buffers.items()},
                "lr": self.lr, "momentum": self.momentum, "nesterov": self.nesterov}

    def load_state_dict(self, state: dict) -> None:
        self.buffers = {i: s["momentum_buffer"].clone() for i, s in state["state"].items()}
