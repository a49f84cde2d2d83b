"""A valid object copied under another rank's name is refused, never averaged.

Copying ``c1.r1`` onto ``c1.r2`` needs no key: the copy is a genuine, correctly
authenticated object, just not rank 2's. Every header field is compared with what
the reader expected at that name, so the copy fails as ``ShardCorrupt`` naming it.
"""

from __future__ import annotations

import json

import pytest
import torch

import ferrosync
from ferrosync.errors import FerrosyncError, ShardCorrupt
from ranks import RankFailure, run_ranks

HB = {"heartbeat_interval": 0.1, "heartbeat_timeout": 2.0}


def w_average(rank, world, url, reduce, secret):
    opts = {"secret": secret} if secret else {}
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=20, reduce=reduce,
                           sharded_min_bytes=1, **HB, **opts) as sync:
        x = torch.full((3000,), 10.0 * rank)
        sync.average_(x)
        return x


@pytest.mark.parametrize("reduce", ["root", "sharded"])
@pytest.mark.parametrize("secret", [None, "k3y"])
def test_object_replayed_under_another_rank_is_refused(tmp_path, reduce, secret):
    fault = {"rank": 2, "collective": 1, "phase": "write", "object": "contrib",
             "action": "replay", "from_rank": 1, "times": 0}
    results = run_ranks(w_average, 3, str(tmp_path / "run"), reduce, secret,
                        env={"FERROSYNC_FAULTS": json.dumps([fault])}, expect_errors=True)
    for rank, res in enumerate(results):
        # before the fix every rank returned 6.67 (1 counted twice) instead of 10
        assert isinstance(res, RankFailure), (rank, res[0])
        assert isinstance(res.error, FerrosyncError), (rank, res.error)
    corrupt = [r.error for r in results if isinstance(r.error, ShardCorrupt)]
    assert corrupt, results
    assert any("rank 1" in str(e) and "rank 2" in str(e) for e in corrupt), corrupt
