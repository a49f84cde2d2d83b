"""Threads and forks sharing a GradSync; tensors a collective cannot move.

* Two threads whose collectives overlap on one GradSync must never get each
  other's averages: the thread that arrives second gets ``ConfigError`` and the
  GradSync fails, so every rank ends with either its own exact result or a typed
  ferrosync error. Sequential use from another thread, and the library's own async
  runner, keep working.
* A forked child inherits a GradSync but not the right to use it: whatever the
  child does (exit, die, close, call a collective), the parent's job goes on.
* Bad tensors (expanded, sparse CSR, meta, ...) are a ``ConfigError`` before any
  storage request, and the GradSync stays usable.

Ranks are real processes; they synchronise through files and heartbeat records,
never by sleeping.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch

import ferrosync
from ferrosync.errors import ConfigError, FerrosyncError, PeerFailed, SyncClosed
from ranks import read_heartbeat, run_ranks, wait_until

FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0}




# -- threads ----------------------------------------------------------------------------------

N = 1 << 20  # 4 MiB per call: a collective lasts long enough for the threads to overlap


def own_value(thread: int, rank: int) -> float:
    return 10.0 * thread + rank + 1


def w_two_threads(rank, world, url, rounds):
    """Per round: a fresh connection, then two threads call average_ at once."""
    outcomes = []
    for _ in range(rounds):
        with ferrosync.connect(url, rank=rank, world_size=world, timeout=30, **FAST) as sync:
            sync.barrier()  # ranks start the round together
            start = threading.Barrier(2)
            results: dict[int, object] = {}

            def work(thread, sync=sync, start=start, results=results):
                x = torch.full((N,), own_value(thread, rank))
                start.wait()
                try:
                    sync.average_(x)
                    results[thread] = ("ok", x[0].item(), bool(torch.all(x == x[0])))
                except FerrosyncError as exc:
                    results[thread] = ("error", type(exc).__name__, str(exc))
                except BaseException as exc:  # an untyped error fails the test
                    results[thread] = ("untyped", type(exc).__name__, str(exc))

            threads = [threading.Thread(target=work, args=(t,), name=f"user-{t}")
                       for t in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert set(results) == {0, 1}, results  # no thread hung
            outcomes.append(results)
            try:
                sync.barrier()  # the GradSync is failed if the threads overlapped
            except FerrosyncError:
                pass
    return outcomes


def test_overlapping_threads_never_get_crossed_results(tmp_path):
    rounds = 4
    out = run_ranks(w_two_threads, 2, str(tmp_path / "run"), rounds, timeout=240)
    overlaps = 0
    for rank, outcomes in enumerate(out):
        for results in outcomes:
            for thread, result in results.items():
                kind = result[0]
                assert kind in ("ok", "error"), (rank, thread, result)
                if kind == "ok":
                    # its own average over the ranks, never the other thread's
                    want = (own_value(thread, 0) + own_value(thread, 1)) / 2
                    assert result[1] == want and result[2], (rank, thread, result)
                elif result[1] == "ConfigError":
                    overlaps += 1
                    assert "must not overlap" in result[2], result
    assert overlaps > 0  # the scenario did happen


def w_refused_while_inside(rank, world, url, files):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=30, reduce="root",
                           **FAST) as sync:
        with open(f"{files}.gen{rank}", "w") as f:
            f.write(sync.generation_url)
        if rank == 1:
            wait_until(lambda: os.path.exists(f"{files}.go"), "go")
            x = torch.full((8,), 2.0)
            try:
                sync.average_(x)
                return ("ok", x.tolist())
            except FerrosyncError as exc:
                return ("error", type(exc).__name__, str(exc))
        first: dict = {}

        def inside():
            x = torch.full((8,), 1.0)
            try:
                sync.average_(x)
                first["result"] = ("ok", x.tolist())
            except BaseException as exc:
                first["result"] = ("error", exc)

        thread = threading.Thread(target=inside, name="first")
        thread.start()
        # the first thread is provably inside collective 1: its heartbeat says so and
        # rank 1 has not started, so it cannot have finished
        gen = sync.generation_url
        wait_until(lambda: (r := read_heartbeat(gen, 0)) and r.get("collective") == 1,
                   "the first thread inside collective 1")
        requests = sync.stats["total"]["requests"]
        try:
            sync.barrier()
            second = "no error"
        except ConfigError as exc:
            second = exc
        open(f"{files}.go", "w").close()
        thread.join(60)
        try:
            sync.average_(torch.ones(8))
            third = "no error"
        except SyncClosed as exc:
            third = exc
        return second, first["result"], third, requests


def test_second_thread_is_refused_while_first_is_inside(tmp_path):
    files = str(tmp_path / "f")
    out = run_ranks(w_refused_while_inside, 2, str(tmp_path / "run"), files)
    second, first, third, _ = out[0]
    assert isinstance(second, ConfigError), second
    text = str(second)
    assert "thread 'MainThread' called barrier while thread 'first' is inside average" in text
    assert "rank 0" in text and str(tmp_path / "run") in text and "connect again" in text
    # the thread that was inside does not return a value the ranks may have crossed
    assert first[0] == "error" and isinstance(first[1], (ConfigError, PeerFailed)), first
    assert isinstance(third, SyncClosed), third  # the GradSync is failed
    # rank 1 averaged with the one call rank 0 made, or heard of the failure: typed
    assert out[1] == ("ok", [1.5] * 8) or out[1][0] == "error", out[1]


def w_sequential_threads(rank, world, url):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=30, **FAST) as sync:
        got = []
        x = torch.full((16,), float(rank))
        sync.average_(x)
        got.append(x[0].item())

        def worker():  # like torch DCP's async_save: a collective from a worker thread
            y = torch.full((16,), float(rank + 10))
            sync.average_(y)
            got.append(y[0].item())
            g = sync.all_gather(torch.tensor([rank]))
            got.append([t.item() for t in g])

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join(60)
        # the library's own runner thread, then a user-thread call that drains it
        handles = [sync.average_(torch.full((16,), float(rank + k)), async_op=True)
                   for k in (20, 30)]
        z = torch.full((16,), float(rank + 40))
        sync.average_(z)
        assert all(h.done() for h in handles)
        got += [h.wait() for h in handles]
        got.append(z[0].item())
        # async from a worker thread, waited for in the main thread
        box = {}
        thread = threading.Thread(target=lambda: box.setdefault(
            "h", sync.average_(torch.full((16,), float(rank)), async_op=True)))
        thread.start()
        thread.join(60)
        got.append(box["h"].wait(60))
        sync.barrier()
        return got


def test_sequential_use_from_other_threads_and_async_runner(tmp_path):
    out = run_ranks(w_sequential_threads, 2, str(tmp_path / "run"))
    want = [0.5, 10.5, [0, 1], 2.0, 2.0, 40.5, 2.0]
    assert out[0] == want and out[1] == want, out


@pytest.mark.unit
def test_close_ends_the_async_thread(tmp_path):
    """At exit a daemon thread still inside a torch op aborts the whole process
    (forced unwind through C++, "terminate called without an active exception"), so
    close(), which the exit hook calls, returns only once the async thread is gone."""
    sync = ferrosync.connect(str(tmp_path / "run"), rank=0, world_size=1, timeout=30)
    handles = [sync.average_(torch.ones(1000), async_op=True) for _ in range(5)]
    thread = sync._runner._thread
    sync.close()
    assert not thread.is_alive()
    assert all(h.done() for h in handles)


# -- fork -------------------------------------------------------------------------------------

FORK_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import torch
    import ferrosync
    from ferrosync.errors import ConfigError
    from ferrosync.storage.wire import decode_record

    rank, url, mode, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    # rank 1 beats rarely, so a "closed" beat written by its child would stay visible
    # for seconds; rank 0 checks every 0.2 s (both tolerate 20 s of silence)
    interval = 4.0 if rank == 1 else 0.2
    sync = ferrosync.connect(url, rank=rank, world_size=2, timeout=60,
                             heartbeat_interval=interval, heartbeat_timeout=20.0)
    results, child = [], None

    def average(value):
        x = torch.full((8,), value)
        sync.average_(x)
        results.append(x[0].item())

    def beat_of(r):
        try:
            with open(os.path.join(sync.generation_url, f"hb.r{r}"), "rb") as f:
                return decode_record(f.read(), None, path="hb")["beat"]
        except (OSError, ValueError):
            return None

    average(float(rank))
    if rank == 1:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child
            if mode == "exit":
                sys.exit(0)
            if mode == "raise":
                raise RuntimeError("the child fails")
            before = sync.stats["total"]["requests"]
            try:
                sync.average_(torch.ones(8))
                error = "no error"
            except ConfigError as exc:
                error = str(exc)
            sync.close()
            with open(out + ".child", "w") as f:
                json.dump({"error": error,
                           "requests": sync.stats["total"]["requests"] - before}, f)
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        child = os.waitstatus_to_exitcode(status)
        # rank 0 waits in collective 2 meanwhile; let it check on us a few times, so
        # that anything the child published would have been seen
        first = beat_of(0) or 0
        deadline = time.monotonic() + 60
        while (beat_of(0) or 0) < first + 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    for step in range(1, 4):
        average(float(rank + step))
    sync.barrier()
    sync.close()
    with open(out, "w") as f:
        json.dump({"results": results, "child": child}, f)
""")


@pytest.mark.parametrize("mode", ["exit", "raise", "close"])
def test_forked_child_never_speaks_for_the_parent(tmp_path, mode):
    script = tmp_path / "rank.py"
    script.write_text(FORK_SCRIPT)
    url = str(tmp_path / "run")
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), url, mode,
                               str(tmp_path / f"out{rank}")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    outputs = [p.communicate(timeout=120) for p in procs]
    for rank, (p, (_, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank}:\n{err}"
    res0 = json.loads((tmp_path / "out0").read_text())
    res1 = json.loads((tmp_path / "out1").read_text())
    assert res0["results"] == res1["results"] == [0.5, 1.5, 2.5, 3.5]
    if mode == "raise":
        assert res1["child"] == 1 and "the child fails" in outputs[1][1]
    else:
        assert res1["child"] == 0
    if mode == "close":
        child = json.loads((tmp_path / "out1.child").read_text())
        assert "this GradSync belongs to pid" in child["error"], child
        assert "connect again in the child" in child["error"], child
        assert child["requests"] == 0, child  # neither the refused call nor close()


# -- tensors a collective cannot move ------------------------------------------------------------

def bad_tensors():
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state"
        warnings.simplefilter("ignore", UserWarning)
        csr = torch.eye(3).to_sparse_csr()
    return {
        "expanded": (torch.zeros(1).expand(4), "share memory"),
        "csr": (csr, "sparse_csr tensor"),
        "coo": (torch.eye(3).to_sparse(), "sparse_coo tensor"),
        "meta": (torch.zeros(4, device="meta"), "meta device"),
        "int": (torch.zeros(4, dtype=torch.int32), "has dtype torch.int32"),
    }


@pytest.mark.parametrize("op", ["average_", "broadcast_", "all_gather", "average_gradients",
                                "average_parameters"])
@pytest.mark.parametrize("kind", ["expanded", "csr", "coo", "meta", "int"])
@pytest.mark.unit
def test_bad_tensor_is_refused_before_any_io(tmp_path, op, kind):
    tensor, needle = bad_tensors()[kind]
    with ferrosync.connect(str(tmp_path / "run"), rank=0, world_size=1) as sync:
        requests = sync.stats["total"]["requests"]
        good = torch.ones(3)
        if op in ("average_", "broadcast_"):
            call = lambda: getattr(sync, op)([good, tensor])  # noqa: E731
            label = "tensors[1]"
        elif op == "all_gather":
            call = lambda: sync.all_gather(tensor)  # noqa: E731
            label = "tensor"
        else:
            model = torch.nn.Module()
            model.register_parameter("a", torch.nn.Parameter(torch.ones(2)))
            if op == "average_gradients":
                model.a.grad = torch.ones(2)
                twin = torch.zeros(tensor.shape, device=tensor.device)
                model.register_parameter("w", torch.nn.Parameter(twin))
                try:
                    model.w.grad = tensor
                except RuntimeError:
                    pytest.skip(f"torch refuses a {kind} .grad for a dense parameter")
                label = "w.grad"
            else:
                model.register_parameter("w", torch.nn.Parameter(tensor, requires_grad=False))
                label = "w"
            call = lambda: getattr(sync, op)(model)  # noqa: E731
        fine = (op == "all_gather" and kind == "expanded") or (
            op in ("broadcast_", "all_gather") and kind == "int")
        if fine:  # read-only use of an expanded tensor, integers outside average_
            call()
            return
        with pytest.raises(ConfigError) as info:
            call()
        text = str(info.value)
        assert label in text and needle in text and "rank 0" in text, text
        assert info.value.hint, text  # says what to do
        assert sync.stats["total"]["requests"] == requests  # nothing was sent
        sync.average_(good)  # still usable: the refused call was never a collective
        assert torch.equal(good, torch.ones(3))


def w_bad_on_every_rank(rank, world, url, op):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=30, **FAST) as sync:
        requests = sync.stats["total"]["requests"]
        x = torch.zeros(1)
        try:
            if op == "broadcast_":
                sync.broadcast_(x.expand(4), src=0)
            else:
                sync.average_(x.expand(4))
            refused = None
        except ConfigError as exc:
            refused = str(exc)
        sent = sync.stats["total"]["requests"] - requests
        y = torch.full((4,), float(rank))
        sync.average_(y)  # the job goes on: the refused call was not a collective
        return refused, sent, y.tolist()


@pytest.mark.parametrize("op", ["average_", "broadcast_"])
def test_bad_tensor_on_every_rank_leaves_the_job_usable(tmp_path, op):
    out = run_ranks(w_bad_on_every_rank, 2, str(tmp_path / "run"), op)
    for refused, sent, y in out:
        assert refused and "tensors[0] has elements that share memory" in refused
        assert sent == 0
        assert y == [0.5] * 4


def w_bad_on_one_rank(rank, world, url):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=30, **FAST) as sync:
        x = torch.full((4,), float(rank))
        if rank == 1:
            x = torch.zeros(1, device="meta").expand(4)
        sync.average_(x)  # rank 1 raises ConfigError; `with` tells rank 0
        return x.tolist()


def test_bad_tensor_on_one_rank_gives_the_peer_a_typed_error(tmp_path):
    out = run_ranks(w_bad_on_one_rank, 2, str(tmp_path / "run"), expect_errors=True)
    assert isinstance(out[1].error, ConfigError) and "meta device" in str(out[1].error)
    err = out[0].error  # no wrong result: the peer's own ConfigError, re-raised here
    assert isinstance(err, ConfigError) and "rank 1 failed" in str(err), err


@pytest.mark.unit
def test_views_that_are_not_plain_memory_still_work(tmp_path):
    with ferrosync.connect(str(tmp_path / "run"), rank=0, world_size=1) as sync:
        t = torch.arange(6.0).view(2, 3).t()  # non-contiguous, no overlap
        sync.average_(t)
        assert torch.equal(t, torch.arange(6.0).view(2, 3).t())
        z = (torch.arange(3.0) * (1 + 1j)).to(torch.complex64)
        zc = z.conj()  # contiguous memory holding the conjugates
        sync.broadcast_(zc, src=0)
        assert torch.equal(zc, z.conj())
        g = sync.all_gather(zc)
        assert torch.equal(g[0], z.conj().resolve_conj())


def w_views(rank, world, url):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=30, **FAST) as sync:
        z = (torch.arange(3.0) * (1 + 1j) + rank).to(torch.complex64)
        zc = z.conj()
        sync.broadcast_(zc, src=0)
        fresh = (torch.arange(3.0) * (1 + 1j) + rank).to(torch.complex64)
        g = sync.all_gather(fresh.conj())  # (z now holds rank 0's values)
        t = (torch.arange(6.0) + rank).view(2, 3).t()
        sync.average_(t)
        return zc.resolve_conj(), g, t.contiguous()


def test_views_across_ranks(tmp_path):
    out = run_ranks(w_views, 2, str(tmp_path / "run"))
    base = (torch.arange(3.0) * (1 + 1j)).to(torch.complex64)
    for zc, g, t in out:
        assert torch.equal(zc, base.conj())
        assert torch.equal(g[0], base.conj()) and torch.equal(g[1], (base + 1).conj())
        assert torch.equal(t, (torch.arange(6.0) + 0.5).view(2, 3).t().contiguous())
