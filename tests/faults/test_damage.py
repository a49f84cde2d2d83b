"""Damaged objects (bit flips, truncation, deletion) are rejected, never averaged."""

from __future__ import annotations

import json
import random

import pytest
import torch

import ferrosync
from ferrosync.errors import PeerFailed, ShardCorrupt, SyncTimeout
from ranks import RankFailure, run_ranks

HB = {"heartbeat_interval": 0.1, "heartbeat_timeout": 2.0}


def w_average(rank, world, url, reduce, secret, timeout=20):
    opts = {"secret": secret} if secret else {}
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=timeout, reduce=reduce,
                           sharded_min_bytes=1, **HB, **opts) as sync:
        x = torch.arange(5000, dtype=torch.float32) + rank
        sync.average_(x)
        return x


def cases():
    rng = random.Random(7)
    out = []
    size = 112 + 5000 * 4  # header + payload of one root-mode contribution
    for i in range(24):
        action = "corrupt" if i % 3 else "truncate"
        offset = rng.randrange(size if action == "corrupt" else size - 1)
        out.append((action, offset, rng.randrange(8), rng.choice(["root", "sharded"]),
                    rng.choice([None, "k3y"])))
    return out


@pytest.mark.parametrize("action, offset, bit, reduce, secret", cases())
def test_damaged_object_raises_shard_corrupt_everywhere(tmp_path, action, offset, bit,
                                                        reduce, secret):
    fault = {"rank": 1, "collective": 1, "phase": "write", "object": "contrib",
             "action": action, "offset": offset, "bit": bit}
    results = run_ranks(w_average, 2, str(tmp_path / "run"), reduce, secret,
                        env={"FERROSYNC_FAULTS": json.dumps([fault])}, expect_errors=True)
    for rank, res in enumerate(results):
        assert isinstance(res, RankFailure), (rank, res)
        assert isinstance(res.error, ShardCorrupt), (rank, res.error)


def test_deleted_object_is_a_timeout_not_a_wrong_answer(tmp_path):
    fault = {"rank": 1, "collective": 1, "phase": "publish", "object": "contrib",
             "action": "delete"}
    results = run_ranks(w_average, 2, str(tmp_path / "run"), "root", None, 5,
                        env={"FERROSYNC_FAULTS": json.dumps([fault])}, expect_errors=True,
                        timeout=120)
    # either rank 0 read it before it vanished (a correct result), or everyone fails
    # with a clear error; never a wrong average
    if not any(isinstance(r, RankFailure) for r in results):
        for x in results:
            assert torch.equal(x, torch.arange(5000, dtype=torch.float32) + 0.5)
    else:
        for res in results:
            assert isinstance(res, RankFailure)
            assert isinstance(res.error, (SyncTimeout, PeerFailed)), res.error
