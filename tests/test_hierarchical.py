"""Two-level sync: 2 simulated nodes x 2 ranks (gloo inside, a directory between)."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch

import ferrosync
from ferrosync.errors import LayoutMismatch, PeerFailed, SyncTimeout
from ranks import RankFailure, collect, run_ranks, start_ranks

HB = {"heartbeat_interval": 0.1, "heartbeat_timeout": 2.0}
L = 2  # ranks per simulated node


def tensors(rank, seed=0):
    g = torch.Generator().manual_seed(100 * seed + rank)
    return [torch.randn(1000, generator=g), torch.randn(7, 3, generator=g).half(),
            torch.randn(5, generator=g, dtype=torch.float64)]


def connect(url, rank, world, hierarchical, **opts):
    if hierarchical:
        opts.update(local="gloo", local_rank=rank % L, local_world_size=L)
    return ferrosync.connect(url, rank=rank, world_size=world, timeout=60, **HB, **opts)


def w_average(rank, world, url, hierarchical, weights, opts):
    ts = tensors(rank)
    with connect(url, rank, world, hierarchical, **opts) as sync:
        total = sync.average_(ts, weight=weights[rank])
        stats = sync.stats["last"]
        x = torch.arange(6) * (rank + 1)
        sync.broadcast_(x, src=3)
        gathered = sync.all_gather(torch.tensor([rank, rank * 10]))
        sync.barrier()
        return total, ts, stats, x, gathered


WEIGHTS = {
    "equal": [1.0, 1.0, 1.0, 1.0],
    "zero-rank": [0.0, 3.0, 1.0, 2.0],
    "idle-node": [0.0, 0.0, 2.0, 0.5],
    "all-idle": [0.0, 0.0, 0.0, 0.0],
}


@pytest.mark.parametrize("reduce", ["root", "sharded"])
@pytest.mark.parametrize("case", list(WEIGHTS))
def test_two_level_equals_flat(tmp_path, case, reduce):
    weights = WEIGHTS[case]
    opts = {"reduce": reduce, "sharded_min_bytes": 1}
    two = run_ranks(w_average, 4, str(tmp_path / "two"), True, weights, opts)
    flat = run_ranks(w_average, 4, str(tmp_path / "flat"), False, weights, opts)
    for rank in range(4):
        total, ts, _stats, x, gathered = two[rank]
        assert total == sum(weights)
        if sum(weights) == 0:  # nothing moved: every rank keeps its own tensors
            for got, orig in zip(ts, tensors(rank)):
                assert torch.equal(got, orig)
            continue
        for a, b in zip(ts, two[0][1]):  # bit-identical on every rank of every node
            assert torch.equal(a, b)
        for got, want in zip(ts, flat[0][1]):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 if got.dtype !=
                                       torch.float16 else 1e-3)
        assert torch.equal(x, torch.arange(6) * 4)
        assert [g.tolist() for g in gathered] == [[r, r * 10] for r in range(4)]


def test_storage_objects_scale_with_nodes(tmp_path):
    two = run_ranks(w_average, 4, str(tmp_path / "two"), True, WEIGHTS["equal"],
                    {"reduce": "root"})
    written = [r[2]["objects_written"] for r in two]
    # leaders (ranks 0 and 2) write for the 2 nodes; the other ranks never touch storage
    assert written[1] == written[3] == 0
    # three dtypes -> three collectives, each one contribution + one result: objects per
    # collective == number of nodes (4 ranks would write 4 each: 3 contributions + 1)
    assert written[0] + written[2] == 3 * 2, written


def w_kill_wait(rank, world, url, ready, victim):
    with connect(url, rank, world, True) as sync:
        sync.barrier()
        if rank == victim:
            open(ready, "w").close()
            while True:  # killed here by the test
                time.sleep(0.05)
        t0 = time.monotonic()
        try:
            sync.average_(torch.ones(10))
        except (PeerFailed, SyncTimeout) as exc:
            return type(exc).__name__, time.monotonic() - t0, str(exc)


@pytest.mark.timing
@pytest.mark.parametrize("victim", [1, 2], ids=["non-leader", "leader"])
def test_a_dead_rank_stops_every_node(tmp_path, victim):
    ready = str(tmp_path / "ready")
    procs, q = start_ranks(w_kill_wait, 4, str(tmp_path / "run"), ready, victim)
    deadline = time.monotonic() + 60
    while not os.path.exists(ready):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(procs[victim].pid, signal.SIGKILL)
    out = collect({r: p for r, p in procs.items() if r != victim}, q, timeout=60)
    for rank, res in out.items():
        assert not isinstance(res, RankFailure), (rank, res)
        kind, seconds, message = res
        assert kind == "PeerFailed", res
        assert seconds < 15, res  # heartbeat_timeout 2 s, never the 60 s timeout


def w_mismatch(rank, world, url):
    with connect(url, rank, world, True) as sync:
        sync.average_(torch.ones(3 + (rank == 3)))


def test_layout_mismatch_inside_a_node(tmp_path):
    results = run_ranks(w_mismatch, 4, str(tmp_path / "run"), expect_errors=True)
    for res in results:
        assert isinstance(res, RankFailure), res
    # node 1 sees it locally; node 0 hears it from node 1's leader
    assert isinstance(results[3].error, LayoutMismatch), results[3].error
    assert re.search(r"rank 2 has float32\[3\], rank 3 has float32\[4\]|rank 3 has float32\[4\]",
                     str(results[3].error))
    for res in results[:2]:
        assert isinstance(res.error, (LayoutMismatch, PeerFailed)), res.error


def test_trainer_simulates_nodes_with_local_gloo(tmp_path):
    # the launcher simulates 2 nodes x 2 ranks; only the 2 leaders touch the storage
    import json

    from train_cli import run_cli

    sync_dir = tmp_path / "sync"
    out = run_cli("--nproc", "4", "--nnodes-sim", "2", "--local", "gloo", "--sync", sync_dir,
                  "--steps", "30", "--no-progress", cwd=tmp_path, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    final = json.loads(out.stdout.strip().splitlines()[-1].split(" ", 1)[1])
    assert final["ranks_agree"] is True and final["steps"] == 30
    # a storage generation for 2 node leaders, not 4 ranks
    gens = [p for p in sync_dir.iterdir() if p.name.startswith("g")]
    assert {p.name.split(".")[0] for p in gens} == {"g0"}
    heartbeats = {p.name for p in gens[0].iterdir() if p.name.startswith("hb.")}
    assert heartbeats == {"hb.r0", "hb.r1"}, heartbeats


@pytest.mark.unit
def test_bad_node_shapes_are_config_errors(tmp_path):
    from ferrosync.errors import ConfigError

    with pytest.raises(ConfigError, match="not a multiple"):
        ferrosync.connect(str(tmp_path), rank=0, world_size=3, local="gloo",
                          local_rank=0, local_world_size=2)
    with pytest.raises(ConfigError, match="local must be one of"):
        ferrosync.connect(str(tmp_path), rank=0, world_size=2, local="shm")
    with pytest.raises(ConfigError, match="--nnodes-sim"):
        from ferrosync.train.cli import parse_args

        parse_args(["--nproc", "3", "--nnodes-sim", "2"])
