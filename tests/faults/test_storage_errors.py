"""Permanent storage errors (disk full, permission denied) fail every rank, clearly."""

from __future__ import annotations

import json
import time

import pytest
import torch

import ferrosync
from ferrosync.errors import PeerFailed, StorageError
from ranks import RankFailure, run_ranks

HB = {"heartbeat_interval": 0.1, "heartbeat_timeout": 2.0}


def w_steps(rank, world, url):
    t0 = time.monotonic()
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=60, **HB) as sync:
        for step in range(4):
            t0 = time.monotonic()
            sync.average_(torch.ones(1000) * step)
    return "done", time.monotonic() - t0


@pytest.mark.parametrize("code, hint", [("ENOSPC", "storage is full"),
                                        ("EACCES", "permission denied"),
                                        ("EDQUOT", "quota")])
@pytest.mark.parametrize("phase", ["write", "read"])
def test_permanent_error_reaches_every_rank(tmp_path, code, hint, phase):
    fault = {"rank": 1, "collective": 2, "phase": phase, "object": "any", "action": "raise",
             "errno": code}
    start = time.monotonic()
    results = run_ranks(w_steps, 3, str(tmp_path / "run"),
                        env={"FERROSYNC_FAULTS": json.dumps([fault])}, expect_errors=True)
    assert time.monotonic() - start < 40  # far below timeout=60: peers were told
    err1 = results[1].error
    assert isinstance(err1, StorageError), err1
    assert hint in str(err1) and str(tmp_path) in str(err1)
    for rank in (0, 2):
        res = results[rank]
        assert isinstance(res, RankFailure), (rank, res)
        assert isinstance(res.error, (PeerFailed, StorageError)), (rank, res.error)
        assert "rank 1" in str(res.error), res.error
