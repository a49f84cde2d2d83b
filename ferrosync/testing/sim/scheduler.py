"""Virtual time and a baton: N simulated processes of the production code, one thread
running at a time, in an order fixed by the seed (docs/elastic.md#simulation).

Every simulated thread runs only while it holds the baton and hands it on at every
point where real code could be overtaken (a sleep, a wait, a lock, a storage request),
to the next by (virtual time, sequence). ``kill`` unwinds a process with ``SimKilled``
(a ``BaseException``) and cuts its storage; ``pause`` stops scheduling it while virtual
time runs on.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import threading
import time

from ferrosync.core.runtime import Runtime
from ferrosync.storage.liveness import ProcessClock

#: a simulated thread's OS stack: the production code's call depth is modest, and a
#: thousand members run two thousand threads
STACK_BYTES = 1 << 20
#: trace events kept before they are hashed in one update (the digest of the joined
#: bytes is the digest of the updates one by one: buffering changes no digest)
NOTE_BATCH = 4096
#: wall seconds an idle OS thread waits for another simulated thread before it ends
IDLE_S = 5.0


def _baton():
    """A held lock: ``release`` hands it to the one thread that ``acquire``s it next.
    A bare lock, not a ``threading.Event``: a switch is one C call on each side (an
    Event's condition costs its Python code and a lock of its own per wait)."""
    lock = threading.Lock()
    lock.acquire()
    return lock


class _Worker:
    """An OS thread that runs simulated threads one after another (``Scheduler.spawn``)."""

    __slots__ = ("ready", "job")

    def __init__(self, job) -> None:
        self.ready = threading.Event()
        self.job = job  # (task, target) to run next


class SimKilled(BaseException):
    """The simulated process was killed: its threads unwind without touching anything."""


class Task:
    """One simulated thread: an OS thread that runs while it holds the baton."""

    __slots__ = ("name", "process", "go", "epoch", "done", "error", "joiners")

    def __init__(self, name: str, process) -> None:
        self.name = name
        self.process = process
        self.go = _baton()  # released when this task holds the baton
        self.epoch = 0  # wake-ups scheduled under an older epoch are stale
        self.done = False
        self.error: BaseException | None = None
        self.joiners: list[Task] = []

    def join(self, timeout: float | None = None) -> None:
        sched = self.process.sched
        if not self.done:
            self.joiners.append(sched.current)
            sched.block(None if timeout is None else sched.now + timeout)


class Process:
    """A simulated OS process: its tasks, its runtime, whether it is dead or stopped."""

    def __init__(self, sched: Scheduler, name: str, seed: int) -> None:
        self.sched = sched
        self.name = name
        self.dead = False
        self.paused_until = 0.0
        self.tasks: list[Task] = []
        self.runtime = SimRuntime(sched, self, seed)


class Scheduler:
    """The virtual clock, the run queue and the trace digest of one simulation."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self._heap: list = []
        self._seq = itertools.count()
        self._driver = _baton()  # released when the run is over
        self.current: Task | None = None
        self._digest = hashlib.blake2b(digest_size=16)
        self._notes: list[bytes] = []
        self.switches = 0
        self.failures: list[tuple[Task, BaseException]] = []
        self._until = 0.0
        self._stop = None
        self._idle: list[_Worker] = []  # OS threads waiting for a simulated thread
        self._idle_lock = threading.Lock()

    # -- the trace ---------------------------------------------------------------------
    def note(self, *fields) -> None:
        """Add an event to the trace (its digest is the run's fingerprint)."""
        notes = self._notes
        notes.append(repr((round(self.now, 9), *fields)).encode())
        if len(notes) >= NOTE_BATCH:
            self._flush_notes()

    def _flush_notes(self) -> None:
        self._digest.update(b"".join(self._notes))
        self._notes.clear()

    @property
    def digest(self) -> str:
        self._flush_notes()
        return self._digest.hexdigest()

    # -- for the driver ----------------------------------------------------------------
    def call_at(self, at: float, action) -> None:
        """Run ``action()`` on the driver at virtual time ``at`` (churn, checks)."""
        heapq.heappush(self._heap, (at, next(self._seq), action, None))

    def spawn(self, process: Process, name: str, target) -> Task:
        """A new simulated thread of ``process`` running ``target()``, runnable now: on
        an idle OS thread if there is one (starting one costs about a millisecond of
        wall time on a loaded machine, and ``Runtime.map`` starts a few per call)."""
        task = Task(name, process)
        process.tasks.append(task)
        with self._idle_lock:
            worker = self._idle.pop() if self._idle else None
            if worker is not None:
                worker.job = (task, target)
                worker.ready.set()
        if worker is None:
            worker = _Worker((task, target))
            old = threading.stack_size(STACK_BYTES)
            try:
                threading.Thread(target=self._serve, args=(worker,), name=f"sim-{name}",
                                 daemon=True).start()
            finally:
                threading.stack_size(old)
        self._push(self.now, task)
        return task

    def _serve(self, worker: _Worker) -> None:
        """An OS thread's life: simulated threads one after another, until it has been
        idle for ``IDLE_S`` of wall time."""
        while True:
            self._main(*worker.job, worker=worker)
            if not worker.ready.wait(IDLE_S):
                with self._idle_lock:
                    if not worker.ready.is_set():  # else a spawn just handed it a task
                        self._idle.remove(worker)
                        return
            worker.ready.clear()

    def kill(self, process: Process) -> None:
        """The process dies now: its threads unwind at once, touching nothing."""
        process.dead = True
        for task in process.tasks:
            if not task.done:
                self._push(self.now, task)

    def pause(self, process: Process, seconds: float) -> None:
        process.paused_until = max(process.paused_until, self.now + seconds)

    def run(self, until: float, stop=None) -> None:
        """Run the queue until virtual time ``until``, or until ``stop()`` is true."""
        self._until, self._stop = until, stop
        first = self._dispatch()
        if first is None:
            return
        self.current = first
        first.go.release()
        self._driver.acquire()

    def _dispatch(self) -> Task | None:
        """The next task to run (driver actions that fall due run here, on whichever
        thread holds the baton); None when the run is over."""
        heap = self._heap
        while heap:
            at, _, item, epoch = heap[0]
            if at > self._until or (self._stop is not None and self._stop()):
                return None
            heapq.heappop(heap)
            if epoch is None:
                self.now = max(self.now, at)
                try:
                    item()
                # broad on purpose: a failing driver action is a finding, not a hang
                except Exception as exc:  # noqa: BLE001
                    self.failures.append((Task("driver", None), exc))
                continue
            task = item
            if task.done or epoch != task.epoch:
                continue  # a stale wake-up (the task was woken otherwise first)
            process = task.process
            if process.paused_until > at and not process.dead:
                heapq.heappush(heap, (process.paused_until, next(self._seq), task, epoch))
                continue
            task.epoch += 1
            self.now = max(self.now, at)
            self.switches += 1
            return task
        return None

    def _pass_baton(self, nxt: Task | None) -> None:
        self.current = nxt
        (self._driver if nxt is None else nxt.go).release()

    def pending(self) -> list[Task]:
        """Tasks that have not finished (for a stall report)."""
        return [t for _, _, t, e in self._heap if e is not None and not t.done]

    # -- for simulated threads ---------------------------------------------------------
    def _push(self, at: float, task: Task) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), task, task.epoch))

    def wake(self, task: Task) -> None:
        """Make a blocked ``task`` runnable now."""
        self._push(self.now, task)

    def block(self, at: float | None = None) -> None:
        """Give the baton back; resume when woken (``wake``) or at ``at``."""
        task = self.current
        if at is not None:
            self._push(at, task)
        nxt = self._dispatch()
        if nxt is not task:  # else: nobody is due before this task, it runs on
            self._pass_baton(nxt)
            task.go.acquire()
        if task.process.dead:
            raise SimKilled(task.name)

    def _main(self, task: Task, target, worker: _Worker | None = None) -> None:
        task.go.acquire()
        try:
            if task.process.dead:
                raise SimKilled(task.name)
            target()
        except SimKilled:
            pass
        # broad on purpose: a simulated thread's failure is a finding, reported by the
        # simulation, never a crash of the driver
        except BaseException as exc:  # noqa: BLE001
            task.error = exc
            self.failures.append((task, exc))
        finally:
            task.done = True
            for joiner in task.joiners:
                self.wake(joiner)
            if worker is not None:  # idle before the baton goes: a spawn may reuse it
                with self._idle_lock:
                    self._idle.append(worker)
            self._pass_baton(self._dispatch())


class SimEvent:
    """``threading.Event`` on the scheduler."""

    def __init__(self, sched: Scheduler) -> None:
        self._sched = sched
        self._flag = False
        self._waiters: list[Task] = []

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        self._flag = True
        for task in self._waiters:
            self._sched.wake(task)
        self._waiters.clear()

    def clear(self) -> None:
        self._flag = False

    def wait(self, timeout: float | None = None) -> bool:
        if not self._flag:
            sched = self._sched
            me = sched.current
            self._waiters.append(me)
            try:
                sched.block(None if timeout is None else sched.now + timeout)
            finally:
                if me in self._waiters:
                    self._waiters.remove(me)
        return self._flag


class SimLock:
    """``threading.Lock`` on the scheduler (held across storage requests)."""

    def __init__(self, sched: Scheduler) -> None:
        self._sched = sched
        self._owner: Task | None = None
        self._waiters: list[Task] = []

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        sched = self._sched
        while self._owner is not None:
            if not blocking:
                return False
            self._waiters.append(sched.current)
            sched.block()
        self._owner = sched.current
        return True

    def release(self) -> None:
        self._owner = None
        if self._waiters:
            self._sched.wake(self._waiters.pop(0))

    def locked(self) -> bool:
        return self._owner is not None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class SimRuntime(Runtime):
    """A simulated process's ``runtime.Runtime``: virtual time, the scheduler's waits
    and threads, its own liveness clock and ``gone`` judgements, ids from its seed."""

    #: wall time = virtual monotonic time + this (any fixed date: for ``inspect`` only)
    WALL_OFFSET = 1.7e9

    def __init__(self, sched: Scheduler, process: Process, seed: int) -> None:
        super().__init__()
        self._sched = sched
        self._process = process
        import random
        self._rng = random.Random(seed)
        self.process_clock = ProcessClock(self.monotonic)

    def monotonic(self) -> float:
        return self._sched.now

    def time(self) -> float:
        return self._sched.now + self.WALL_OFFSET

    def sleep(self, seconds: float) -> None:
        self._sched.block(self._sched.now + max(0.0, seconds))

    def event(self) -> SimEvent:
        return SimEvent(self._sched)

    def lock(self) -> SimLock:
        return SimLock(self._sched)

    def start_thread(self, target, name: str) -> Task:
        return self._sched.spawn(self._process, f"{self._process.name}/{name}", target)

    def current_thread(self):
        return self._sched.current

    def token_hex(self, nbytes: int) -> str:
        return f"{self._rng.getrandbits(8 * nbytes):0{2 * nbytes}x}"


def wall() -> float:
    """Real seconds (for ``wall_s`` only; never read by the simulation)."""
    return time.perf_counter()
