"""Run a function on N real processes, one per rank, and collect what each returns.

Ranks are real OS processes started from a forkserver that has already imported
torch and ferrosync, so a rank starts in tens of milliseconds instead of seconds
(the suite starts hundreds of them). Results and exceptions come back through a
multiprocessing queue (pickle between our own test processes, never from shared
storage).
"""

from __future__ import annotations

import importlib.util
import inspect
import multiprocessing as mp
import os
import pickle
import queue
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from unittest import mock

#: this folder: the forkserver's preloads of tests/ are found here
TESTS = os.path.dirname(os.path.abspath(__file__))

_CTX = None


def context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        # torch._dynamo: the first optimizer step of a process imports it (about 0.85
        # CPU-s per training rank); forkserver_ready keeps gloo groups from deadlocking
        # at teardown because of it (see its docstring).
        # The object stores' fsspec drivers too (about 0.4 CPU-seconds each per rank
        # that touches one): importing them starts no thread and no event loop, which
        # fsspec creates on first use, in the rank. A driver that is not installed is
        # skipped by the forkserver (its tests skip themselves).
        # ferrosync.elastic too: pure Python, no thread (about 0.2 CPU-s per member).
        # pytest: every test module a rank's target lives in imports it.
        # forkserver_ready last: it readies what the others built (see its docstring).
        _CTX.set_forkserver_preload(["torch", "torch._dynamo", "ferrosync",
                                     "ferrosync.storage.sync", "ferrosync.elastic",
                                     "pytest", "s3fs", "gcsfs", "adlfs", "ranks",
                                     "train_cli", "forkserver_ready"])
        # Python 3.11's forkserver imports its preloads before it takes the parent's
        # sys.path (and skips one it cannot import without a word), so the modules of
        # tests/ are found through its environment; it starts here, with it
        path = os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))
        with mock.patch.dict(os.environ, PYTHONPATH=path):
            from multiprocessing import forkserver

            forkserver.ensure_running()
    return _CTX


def use_fork() -> None:
    """Start ranks by forking this process from now on: for a process that is itself a
    fork of the forkserver (a forked launcher), where a forkserver of its own would
    cost a new interpreter, and whose preloads it already has."""
    global _CTX
    _CTX = mp.get_context("fork")


@dataclass
class RankFailure:
    """What a rank raised: the exception (our errors pickle) and its traceback text."""

    rank: int
    error: BaseException
    traceback: str

    def __repr__(self) -> str:
        return f"RankFailure(rank={self.rank}, {type(self.error).__name__}: {self.error})"


def _resolve(target):
    """Import a worker function by file path, so test modules in any folder work
    (the forkserver's sys.path was fixed when it started)."""
    module_name, path, qualname = target
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _entry(target, rank, world_size, args, kwargs, results, env):
    # the environment a new process started now would have: the forkserver's own is
    # whatever the test process had when it started (perhaps a test's monkeypatched
    # RANK, WORLD_SIZE or FERROSYNC_JOB), so a rank takes the starter's, whole
    os.environ.clear()
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(1)
        fn = _resolve(target)
        value = fn(rank, world_size, *args, **kwargs)
        results.put(_pack(rank, True, value, ""))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        try:
            results.put(_pack(rank, False, exc, traceback.format_exc()))
        except Exception:  # unpicklable exception: send its text
            results.put(_pack(rank, False, RuntimeError(repr(exc)), traceback.format_exc()))


def _pack(*item) -> bytes:
    # plain pickle: torch's queue reducers would share tensors through file
    # descriptors that die with this process
    return pickle.dumps(item)


def run_ranks(fn, world_size: int, *args, timeout: float = 90.0, expect_errors: bool = False,
              env: dict | None = None, ranks=None, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on each rank in its own process.

    Returns the per-rank return values in rank order. If a rank raised: re-raise
    (with every rank's traceback) unless ``expect_errors``, in which case its slot
    holds a ``RankFailure``. A rank that does not finish within ``timeout`` is
    killed and the call fails: a test never hangs.
    """
    procs, results = start_ranks(fn, world_size, *args, env=env, ranks=ranks, **kwargs)
    out = collect(procs, results, timeout)
    missing = sorted(set(procs) - set(out))
    if missing:
        raise TimeoutError(f"ranks {missing} did not finish within {timeout} s")
    ordered = [out[r] for r in sorted(procs)]
    failures = [v for v in ordered if isinstance(v, RankFailure)]
    if failures and not expect_errors:
        text = "\n".join(f"--- rank {f.rank} ---\n{f.traceback or f.error}" for f in failures)
        raise AssertionError(f"{len(failures)} rank(s) failed:\n{text}") from failures[0].error
    return ordered


def start_ranks(fn, world_size: int, *args, env: dict | None = None, ranks=None, **kwargs):
    """Start ranks without waiting: returns (processes by rank, results queue)."""
    ctx = context()
    results = ctx.Queue()
    env = {**os.environ, **{k: str(v) for k, v in (env or {}).items()}}
    which = list(range(world_size)) if ranks is None else list(ranks)
    target = (fn.__module__, inspect.getfile(fn), fn.__qualname__)
    procs = {
        r: ctx.Process(target=_entry, args=(target, r, world_size, args, kwargs, results, env),
                       daemon=True)
        for r in which
    }
    for p in procs.values():
        p.start()
    return procs, results


def collect(procs, results, timeout: float = 90.0) -> dict:
    """Gather {rank: value or RankFailure} from ``start_ranks``; kills stragglers."""
    out: dict[int, object] = {}
    exited: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < len(procs):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, value, tb = pickle.loads(results.get(timeout=min(remaining, 0.5)))
            except queue.Empty:
                # a rank that exited without reporting (SIGKILL, segfault); give its
                # queue feeder a moment, a clean exit flushes the result first
                now = time.monotonic()
                for r, p in procs.items():
                    if r not in out and p.exitcode is not None:
                        if now - exited.setdefault(r, now) > 2.0:
                            out[r] = RankFailure(r, RuntimeError(f"exit code {p.exitcode}"), "")
                continue
            out[rank] = value if ok else RankFailure(rank, value, tb)
    finally:
        for p in procs.values():
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return out


def communicate_all(procs, timeout: float = 120.0) -> list[tuple[int, str, str]]:
    """(returncode, stdout, stderr) of each ``subprocess.Popen`` in ``procs``, in order.
    One that runs past ``timeout`` kills them all and fails with every one's output."""
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise AssertionError([other.communicate() for other in procs]) from None
        done.append((proc.returncode, out, err))
    return done


def wait_until(predicate, what: str, timeout: float = 60.0):
    """Poll ``predicate`` until it returns something true; that value, or an
    AssertionError naming ``what`` after ``timeout`` s. For watching what another
    process does (a file it writes, a state it reaches): there is nothing to block on,
    so a short poll is the synchronisation, and the timeout keeps a test from hanging.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(0.01)


def read_heartbeat(gen_dir: str, rank: int) -> dict | None:
    """Rank ``rank``'s heartbeat record in a generation directory, or None while it is
    missing or being replaced (tests only: no secret)."""
    from ferrosync.storage.wire import decode_record

    try:
        with open(os.path.join(gen_dir, f"hb.r{rank}"), "rb") as f:
            return decode_record(f.read(), None, path="hb")
    except (OSError, ValueError):
        return None
