"""SIGKILL a rank at random points: survivors raise in bounded time, never read garbage.

Each trial kills one random rank (3-rank jobs) either from inside, at a random
collective and phase via the fault injector (``FERROSYNC_FAULTS``), or from outside
at a random moment. Survivors must either finish with exactly right averages (the
kill came after they had everything they needed) or raise ``PeerFailed`` /
``SyncTimeout`` well before the collective timeout.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest
import torch

import ferrosync
from ferrosync.errors import PeerFailed, SyncTimeout
from ranks import RankFailure, collect, start_ranks

HB = {"heartbeat_interval": 0.1, "heartbeat_timeout": 1.0}
STEPS = 6
WORLD = 3
BOUND_S = 15.0  # detection budget: heartbeat_timeout + start-up slack, far below timeout=60


def w_loop(rank, world, url, reduce, started, steps):
    sync = ferrosync.connect(url, rank=rank, world_size=world, timeout=60, reduce=reduce,
                             sharded_min_bytes=1, **HB)
    open(f"{started}.{rank}", "w").close()
    step_start = time.monotonic()
    try:
        for step in range(steps):
            step_start = time.monotonic()
            x = torch.full((30_000,), float(rank + step))
            sync.average_(x)
            # never a partial or mixed read: a finished average is exactly right
            want = torch.full((30_000,), (world - 1) / 2 + step)
            if not torch.equal(x, want):
                raise AssertionError(f"rank {rank} step {step}: wrong average {x[:3]}")
        return ("completed", 0.0)
    except (PeerFailed, SyncTimeout) as exc:
        return (type(exc).__name__, time.monotonic() - step_start)
    finally:
        sync.close()


def trials():
    rng = random.Random(20261129)
    out = []
    for i in range(50):
        victim = rng.randrange(WORLD)
        reduce = rng.choice(["root", "sharded"])
        if i % 5 == 4:
            out.append(("outside", victim, reduce, rng.uniform(0.0, 0.3), None))
        else:
            fault = {"rank": victim, "collective": rng.randint(1, STEPS),
                     "phase": rng.choice(["write", "publish", "read", "reduce"]),
                     "object": "any", "action": "kill"}
            out.append(("inside", victim, reduce, None, fault))
    return out


@pytest.mark.parametrize("how, victim, reduce, delay, fault", trials())
def test_sigkill_at_random_points(tmp_path, how, victim, reduce, delay, fault):
    url, started = str(tmp_path / "run"), str(tmp_path / "started")
    env = {"FERROSYNC_FAULTS": json.dumps([fault])} if fault else {}
    # killed from outside: run long enough that the random moment falls mid-run
    steps = STEPS if how == "inside" else 2000
    procs, q = start_ranks(w_loop, WORLD, url, reduce, started, steps, env=env)
    if how == "outside":
        deadline = time.monotonic() + 60
        while not all(os.path.exists(f"{started}.{r}") for r in range(WORLD)):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        time.sleep(delay)  # the random moment itself, not a synchronisation
        os.kill(procs[victim].pid, signal.SIGKILL)
    t0 = time.monotonic()
    out = collect(procs, q, timeout=90)
    assert time.monotonic() - t0 < 60, "survivors hung"
    survivors = [r for r in range(WORLD) if r != victim]
    for r in survivors:
        res = out[r]
        assert not isinstance(res, RankFailure), (r, res)  # no other error type, no garbage
        outcome, seconds = res
        assert outcome in ("completed", "PeerFailed", "SyncTimeout"), res
        assert seconds < BOUND_S, (r, res)
    if how == "inside":
        # the victim really died (unless its fault point was never reached)
        assert isinstance(out[victim], RankFailure) or out[victim][0] != "completed" or \
            fault["collective"] > STEPS
