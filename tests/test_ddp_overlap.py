"""DDP over the "ferrosync" backend with overlap: allreduce runs on the GradSync's async
thread (ferrosync/ddp/process_group.py, ``_Pending``), so DDP overlaps each bucket's
storage round trip with the rest of the backward pass.

Results must still equal gloo's exactly, and a failure must stay a typed Python
exception: a peer killed in the middle of a backward pass makes the survivor raise
``PeerFailed`` from ``backward()`` (DDP's built-in reducer, no Python comm hook),
never crash the process. That last part runs in real interpreters started with
``subprocess`` so that the return code and stderr can be checked.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist
from ddp_workers import FAST
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ferrosync.errors import ConfigError, PeerFailed, SyncClosed
from ranks import RankFailure, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = datetime.timedelta(seconds=60)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def train_buckets(rank, world, backend, location, *, steps=8, options=None, hook=False,
                  ddp_kwargs=None):
    """DDP with several small gradient buckets (several allreduces in flight per
    backward). Returns (parameters, allreduce threads seen, overlap flag)."""
    kwargs = {"pg_options": options} if backend == "ferrosync" else {}
    dist.init_process_group(backend, init_method=location, rank=rank, world_size=world,
                            timeout=TIMEOUT, **kwargs)
    model = mlp()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.1, **(ddp_kwargs or {}))
    if hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    threads = set()
    overlap = None
    if backend == "ferrosync":
        pg = dist.group.WORLD
        overlap = pg.overlap
        average_flat = pg.sync._average_flat

        def spy(*args, **kw):
            threads.add(threading.current_thread().name)
            return average_flat(*args, **kw)

        pg.sync._average_flat = spy
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(16, 64, generator=g)
        y = torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dist.destroy_process_group()
    return params, sorted(threads), overlap


def _assert_equal(results, reference):
    for rank, ((params, _, _), (ref, _, _)) in enumerate(zip(results, reference)):
        for key, value in ref.items():
            assert torch.equal(params[key], value), f"rank {rank} {key} differs"


@pytest.mark.parametrize("world", [2, 3])
def test_overlapped_ddp_equals_gloo_bit_for_bit(tmp_path, world):
    reference = run_ranks(train_buckets, world, "gloo", f"file://{tmp_path}/gloo.store")
    results = run_ranks(train_buckets, world, "ferrosync", str(tmp_path / "run"))
    off = run_ranks(train_buckets, world, "ferrosync", str(tmp_path / "off"),
                    options={"overlap": False})
    for rank, (_, threads, overlap) in enumerate(results):
        # the buckets were reduced on the async thread, not inside backward's thread
        assert overlap is True and threads == [f"ferrosync-async-r{rank}"], threads
    for _, threads, overlap in off:
        assert overlap is False and threads == ["MainThread"], threads
    # overlap changes when the bytes move, not the arithmetic
    _assert_equal(results, off)
    if world == 2:  # a power of two: SUM as average x W is exact, as gloo's sum
        _assert_equal(results, reference)
    else:
        for (params, _, _), (ref, _, _) in zip(results, reference):
            for key in ref:
                torch.testing.assert_close(params[key], ref[key], rtol=1e-5, atol=1e-6)


def test_python_comm_hook_over_overlapped_allreduce_equals_gloo(tmp_path):
    # torch's default_hooks.allreduce_hook: dist.all_reduce(async_op=True).get_future()
    # .then(...), i.e. the future completed from the async thread, read from Python
    reference = run_ranks(train_buckets, 2, "gloo", f"file://{tmp_path}/gloo.store",
                          steps=4, hook=True)
    results = run_ranks(train_buckets, 2, "ferrosync", str(tmp_path / "run"), steps=4,
                        hook=True)
    _assert_equal(results, reference)


@pytest.mark.parametrize("ddp_kwargs", [
    {"static_graph": True},  # first step: DDP starts the allreduces from a final callback
    {"find_unused_parameters": True},  # plus DDP's own int allreduce, waited in C++
    {"gradient_as_bucket_view": True},
])
def test_ddp_variants_with_overlap_equal_gloo(tmp_path, ddp_kwargs):
    reference = run_ranks(train_buckets, 2, "gloo", f"file://{tmp_path}/gloo.store",
                          steps=4, ddp_kwargs=ddp_kwargs)
    results = run_ranks(train_buckets, 2, "ferrosync", str(tmp_path / "run"), steps=4,
                        ddp_kwargs=ddp_kwargs)
    _assert_equal(results, reference)


def async_work(rank, world, location):
    """``dist.all_reduce(async_op=True)`` returns before the bytes moved; the Work and
    its future deliver the result; a later collective waits for it (call order)."""
    dist.init_process_group("ferrosync", init_method=location, rank=rank, world_size=world,
                            timeout=TIMEOUT)
    sync = dist.group.WORLD.sync
    average_flat = sync._average_flat
    gate = threading.Event()

    def slow(*args, **kw):
        gate.wait(10)
        return average_flat(*args, **kw)

    sync._average_flat = slow
    t = torch.full((4,), float(rank + 1))
    work = dist.all_reduce(t, async_op=True)
    pending_at_return = not work.is_completed()
    gate.set()
    b = torch.full((2,), float(rank))
    dist.broadcast(b, src=1)  # synchronous: runs after the allreduce, on every rank
    assert work.is_completed()
    assert work.wait() is True
    value = work.get_future().wait()[0]
    dist.destroy_process_group()
    left = [th.name for th in threading.enumerate() if "ferrosync" in th.name]
    return pending_at_return, t, value, b, left


def test_async_allreduce_returns_at_once_and_keeps_call_order(tmp_path):
    results = run_ranks(async_work, 2, str(tmp_path / "run"))
    for pending, t, value, b, left in results:
        assert pending
        assert torch.equal(t, torch.full((4,), 3.0)) and torch.equal(value, t)
        assert torch.equal(b, torch.ones(2))
        assert left == []  # destroy_process_group joined the async thread


def failed_work(rank, world, location):
    """Rank 1 leaves before an async allreduce: rank 0's Work, its future and the next
    collective all raise typed errors."""
    dist.init_process_group("ferrosync", init_method=location, rank=rank, world_size=world,
                            timeout=TIMEOUT, pg_options=FAST)
    if rank == 1:
        raise RuntimeError("rank 1 leaves")
    work = dist.all_reduce(torch.ones(3), async_op=True)
    errors = {}
    for name, call in (("wait", work.wait),
                       ("future", lambda: work.get_future().wait()),
                       ("then", lambda: work.get_future().then(lambda f: f.value()).wait()),
                       ("next", lambda: dist.all_reduce(torch.ones(3))),
                       ("barrier", dist.barrier)):
        try:
            call()
            errors[name] = None
        except Exception as exc:  # noqa: BLE001 - the test checks the type
            errors[name] = (type(exc).__name__, isinstance(exc, (PeerFailed, SyncClosed)),
                            str(exc))
    errors["is_success"] = work.is_success()
    dist.destroy_process_group()
    return errors


def test_failed_async_allreduce_raises_typed_errors(tmp_path):
    rank0, rank1 = run_ranks(failed_work, 2, str(tmp_path / "run"), expect_errors=True,
                             timeout=60)
    assert isinstance(rank1, RankFailure)
    assert rank0["is_success"] is False
    assert rank0["wait"][0] == "PeerFailed", rank0
    assert rank0["future"][0] == "PeerFailed", rank0
    # a then-callback sees the typed error; torch's C++ future chain words it
    assert rank0["then"] is not None and "PeerFailed" in rank0["then"][2], rank0
    for name in ("next", "barrier"):  # later collectives: the GradSync is failed
        assert rank0[name] is not None and rank0[name][1], rank0


def bad_overlap_option(rank, world, location):
    dist.init_process_group("ferrosync", init_method=location, rank=rank, world_size=world,
                            timeout=TIMEOUT, pg_options={"overlap": "yes"})


def test_overlap_option_is_checked(tmp_path):
    (result,) = run_ranks(bad_overlap_option, 1, str(tmp_path / "run"), expect_errors=True)
    assert isinstance(result.error, ConfigError) and "overlap" in str(result.error), result


# -- a peer killed in the middle of a backward pass, in real interpreters -------------------

SCRIPT = textwrap.dedent("""
    import datetime, json, os, signal, sys, time
    import torch, torch.distributed as dist
    from torch import nn
    import ferrosync
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = int(os.environ["RANK"])
    location, mode, hook = sys.argv[1], sys.argv[2], sys.argv[3] == "hook"
    dist.init_process_group(
        "ferrosync", init_method=location, timeout=datetime.timedelta(seconds=8),
        pg_options={"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10))
    ddp = DDP(model, bucket_cap_mb=0.5)  # several buckets: some in flight when it dies
    if hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)

    def die(grad):  # the first layer's gradient: the last buckets of the backward pass
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "raise":
            raise RuntimeError("injected failure in backward")
        if mode == "hang":
            time.sleep(30)
        return grad

    x = torch.randn(8, 64)
    for step in range(6):
        if rank == 1 and step == 3:
            model[0].weight.register_hook(die)
        try:
            ddp(x).square().mean().backward()
        except Exception as exc:
            if rank != 0:
                raise  # uncaught: its abort marker tells rank 0
            print(json.dumps({"step": step, "type": type(exc).__name__,
                              "ferrosync": isinstance(exc, ferrosync.FerrosyncError),
                              "message": str(exc)}), flush=True)
            sys.exit(3)
    print(json.dumps({"step": None}), flush=True)
""")


def run_pair(tmp_path, mode: str, hook: bool):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "PYTHONPATH": ROOT,
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "run"), mode,
             "hook" if hook else "reducer"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        out0, err0 = procs[0].communicate(timeout=120)
    finally:
        procs[1].kill()
    out1, err1 = procs[1].communicate(timeout=30)
    return procs[0].returncode, out0, err0, procs[1].returncode, err1


@pytest.mark.parametrize("mode, hook, expected", [
    ("kill", False, "PeerFailed"),
    ("raise", False, "PeerFailed"),
    ("hang", False, "SyncTimeout"),
    ("kill", True, "PeerFailed"),
])
def test_peer_failing_mid_backward_gives_a_typed_exception_not_a_crash(tmp_path, mode, hook,
                                                                       expected):
    code, out, err, code1, err1 = run_pair(tmp_path, mode, hook)
    assert "Segmentation fault" not in err and "core dumped" not in err, err
    assert code == 3, (code, out, err)  # the script caught a Python exception: no signal
    report = json.loads(out.strip().splitlines()[-1])
    assert report["step"] == 3, report
    assert report["type"] == expected and report["ferrosync"], report
    if mode == "kill":
        assert code1 == -9, (code1, err1)
    if mode == "raise":
        assert "injected failure in backward" in err1
        assert "rank 1" in report["message"], report


@pytest.mark.timing
def test_overlap_adds_little_to_a_step_when_storage_is_slow(tmp_path):
    """The point of overlap: with a slow round trip per bucket, a step takes about one
    round trip longer than the compute, not one per bucket (sanity, generous bounds)."""
    results = run_ranks(slow_storage_steps, 2, str(tmp_path / "on"), True)
    off = run_ranks(slow_storage_steps, 2, str(tmp_path / "off"), False)
    # 4 buckets x 0.15 s: synchronous pays every one inside backward
    assert min(off) > 0.5, off
    assert max(results) < min(off) - 0.2, (results, off)


def slow_storage_steps(rank, world, location, overlap):
    dist.init_process_group("ferrosync", init_method=location, rank=rank, world_size=world,
                            timeout=TIMEOUT, pg_options={"overlap": overlap})
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.25)  # one bucket per layer
    sync = dist.group.WORLD.sync
    average_flat = sync._average_flat

    def slow(flat, *args, **kw):
        if flat.numel() > 1000:  # gradient buckets, not DDP's small bookkeeping
            time.sleep(0.15)
        return average_flat(flat, *args, **kw)

    x = torch.randn(32, 256)
    ddp(x).sum().backward()  # first step: DDP rebuilds its buckets
    sync._average_flat = slow
    layers = list(model)

    def compute_delay(grad):  # backward compute that communication can hide behind
        time.sleep(0.15)
        return grad

    for layer in layers[1:]:
        layer.weight.register_hook(compute_delay)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        ddp(x).sum().backward()
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    return min(times)


@pytest.mark.unit
def test_overlap_private_api_pinned_to_tested_torch():
    from ferrosync.ddp.process_group import OVERLAP_TESTED_TORCH, _overlap_supported

    assert _overlap_supported()
    assert torch.__version__.startswith(OVERLAP_TESTED_TORCH), (
        f"torch {torch.__version__}: re-run tests/test_ddp_overlap.py and add it to "
        "OVERLAP_TESTED_TORCH")
