"""The "ferrosync" torch.distributed backend: stock DDP, collectives, failures, S3.

Every multi-rank test starts real processes (tests/ranks.py). DDP results are
compared with the same loop on stock gloo (``ddp_workers.gloo_reference``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from math import factorial

import pytest
import torch
from ddp_workers import FAST, assert_matches_reference, collectives, gloo_reference, train

from ferrosync.errors import PeerFailed
from ferrosync.storage.wire import decode_record
from ranks import RankFailure, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def init_method(kind: str, tmp_path) -> str:
    """The init_method spellings a user may pass for a local location."""
    if kind == "dir-new":
        return str(tmp_path / "run" / "not-yet")
    if kind == "dir-existing":
        (tmp_path / "run").mkdir()
        return str(tmp_path / "run")
    if kind == "file-dir":
        (tmp_path / "run").mkdir()
        return f"file://{tmp_path / 'run'}"
    if kind == "file-store":  # torch's own meaning: a FileStore file
        return f"file://{tmp_path / 'store'}"
    raise AssertionError(kind)


def _forkserver_preloads(rank, world):
    return "torch._dynamo" in sys.modules, "forkserver_ready" in sys.modules


def test_ranks_fork_from_a_server_that_keeps_gloo_groups():
    # the forkserver passes over a preload it cannot import without a word; without
    # tests/forkserver_ready.py beside the preloaded torch._dynamo, the DDP-on-gloo
    # ranks below can deadlock when their group is destroyed (its docstring)
    [(dynamo, ready)] = run_ranks(_forkserver_preloads, 1)
    assert dynamo and ready


@pytest.mark.parametrize("kind", ["dir-new", "dir-existing", "file-dir", "file-store"])
def test_stock_ddp_matches_gloo_two_ranks(tmp_path, kind):
    results = run_ranks(train, 2, "ferrosync", init_method(kind, tmp_path))
    assert_matches_reference(results, gloo_reference(2))
    # the data went where docs/ddp.md says (beside torch's store file for file-store)
    location = {"dir-new": tmp_path / "run" / "not-yet",
                "file-store": tmp_path / "store.ferrosync"}.get(kind, tmp_path / "run")
    assert (location / f"rdzv.{os.environ['FERROSYNC_JOB']}").is_dir()


def test_stock_ddp_matches_gloo_three_ranks_unused_parameters(tmp_path):
    # find_unused_parameters adds DDP's int32 SUM allreduce every step
    results = run_ranks(train, 3, "ferrosync", init_method("dir-existing", tmp_path),
                        unused=True)
    assert_matches_reference(results, gloo_reference(3, unused=True))


def test_s3_init_method_with_options_from_environment(s3_transport):
    # an unmodified script: the endpoint and credentials arrive through the environment
    env = {"FERROSYNC_PG_OPTIONS": json.dumps(s3_transport.options)}
    results = run_ranks(train, 2, "ferrosync", s3_transport.url, steps=6, env=env)
    assert_matches_reference(results, gloo_reference(2, steps=6))


@pytest.mark.parametrize("world", [2, 3])
def test_collectives(tmp_path, world):
    # options through pg_options (the S3 test covers FERROSYNC_PG_OPTIONS)
    results = run_ranks(collectives, world, str(tmp_path / "run"), {"heartbeat_timeout": 60.0})
    ranks = range(1, world + 1)  # rank r contributes base * (r + 1)
    base = torch.arange(1, 7, dtype=torch.float32)
    total = sum(ranks)
    ints = [torch.tensor([r + 1, 3 * r, -r, 7, 1 << r]) for r in range(world)]
    expect = {
        "float32.SUM": base * total, "float32.AVG": base * total / world,
        "float32.MAX": base * world, "float32.MIN": base,
        "float32.PRODUCT": base ** world * factorial(world),
        "float16.SUM": (base * total).half(), "float16.AVG": (base * total / world).half(),
        "bfloat16.SUM": (base * total).bfloat16(),
        "bfloat16.AVG": (base * total / world).bfloat16(),
        "float64.SUM": base.double() * total, "float64.AVG": base.double() * total / world,
        "int64.SUM": sum(ints), "int64.MAX": torch.stack(ints).amax(0),
        "int64.MIN": torch.stack(ints).amin(0), "int64.PRODUCT": torch.stack(ints).prod(0),
        "int32.SUM": sum(ints).int(),
        "noncontiguous.SUM": torch.arange(12.0).view(3, 4).t() * total,
        "complex64.SUM": torch.tensor([1 + 2j, -1j]) * total,
        "async.AVG": base * total / world,
        "all_gather": torch.tensor([[r, 10 * r] for r in range(world)]),
        "all_gather_into_tensor": torch.tensor([v for r in range(world) for v in (r, -r)],
                                               dtype=torch.float32),
        "broadcast": torch.full((3,), float(world - 1)),
        "after_errors.MAX": base * world,
    }
    band, bor, bxor = ints[0].clone(), ints[0].clone(), ints[0].clone()
    for t in ints[1:]:
        band &= t
        bor |= t
        bxor ^= t
    expect.update({"int64.BAND": band, "int64.BOR": bor, "int64.BXOR": bxor})
    for rank, out in enumerate(results):
        for name, value in expect.items():
            assert torch.equal(out[name], value), f"rank {rank} {name}: {out[name]} != {value}"
        arange = torch.arange(2 * world, dtype=torch.float32)
        assert torch.equal(out["reduce_scatter_tensor"], (arange * total)[2 * rank:2 * rank + 2])
        assert torch.equal(out["reduce_scatter.MAX"],
                           torch.full((2,), 10 * rank + world - 1, dtype=torch.int64))
        # reduce: only the destination's tensor changes
        assert torch.equal(out["reduce"], sum(ints) if rank == 1 else ints[rank])
        assert torch.equal(out["scatter"], torch.full((3,), 100.0 + rank))
        assert out["all_gather_object"] == [{"rank": r, "pad": "x" * (100 * r)}
                                            for r in range(world)]
        last = world - 1
        assert out["broadcast_object_list"] == [last, f"from rank {last}", {"nested": [last] * 3}]
        assert out["errors"] == ["ConfigError"] * 3
        if rank in (0, 1):
            assert torch.equal(out["subgroup.SUM"], torch.tensor([3.0]))
        assert out["backend"] == "ferrosync"
        assert out["closed_after_destroy"] and out["threads_left"] == []
    assert torch.equal(results[0]["gather"], torch.tensor([[r, r + 0.5] for r in range(world)]))


def test_rank_failing_mid_step_makes_the_others_raise(tmp_path):
    # rank 1 raises before its 5th backward; rank 0 waits in that step's allreduce and
    # must get PeerFailed (heartbeat stopped: the failed process exits without cleanup)
    results = run_ranks(train, 2, "ferrosync", str(tmp_path / "run"), options=FAST,
                        fail=(1, 4), expect_errors=True, timeout=60)
    assert all(isinstance(r, RankFailure) for r in results)
    assert "injected failure" in str(results[1].error)
    assert isinstance(results[0].error, PeerFailed), results[0].traceback
    assert "rank 1" in str(results[0].error)


SCRIPT = textwrap.dedent("""
    import datetime, os, sys
    import torch, torch.distributed as dist
    import ferrosync
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = int(os.environ["RANK"])
    dist.init_process_group("ferrosync", init_method=sys.argv[1],
                            timeout=datetime.timedelta(seconds=60))
    model = DDP(torch.nn.Linear(4, 2))
    for step in range(10):
        loss = model(torch.randn(3, 4)).sum()
        if sys.argv[2] == "fail" and rank == 1 and step == 3:
            raise RuntimeError("injected failure")
        loss.backward()
    # no destroy_process_group(): interpreter exit closes the connection
""")


def run_script(tmp_path, mode: str):
    """Two real interpreters, ranks from the environment (torchrun style)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "PYTHONPATH": ROOT}
        procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path / "run"), mode],
                                      env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=120) for p in procs]
    return [p.returncode for p in procs], [err for _, err in outputs]


def test_uncaught_exception_in_a_script_fails_peers_without_crash(tmp_path):
    """The failing rank's uncaught exception publishes an abort marker; the other rank
    raises PeerFailed from backward() and exits with status 1, not a signal."""
    codes, errs = run_script(tmp_path, "fail")
    assert codes == [1, 1], (codes, errs)
    assert "injected failure" in errs[1]
    assert "PeerFailed" in errs[0] and "rank 1 failed" in errs[0], errs[0]


def test_script_exiting_without_destroy_closes_cleanly(tmp_path):
    codes, errs = run_script(tmp_path, "ok")
    assert codes == [0, 0], (codes, errs)
    for rank in range(2):  # each rank's last heartbeat says it closed (atexit ran)
        (beat,) = (tmp_path / "run").glob(f"g*/hb.r{rank}")
        assert decode_record(beat.read_bytes(), None, path=str(beat))["state"] == "closed"
