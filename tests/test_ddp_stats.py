"""``ferrosync.ddp.stats(group=None)``: the GradSync's stats behind a real "ferrosync"
process group (real rank processes, tests/ranks.py)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

import ferrosync.ddp
from ferrosync.errors import ConfigError
from ranks import run_ranks

TIMEOUT = datetime.timedelta(seconds=60)


def _stats_worker(rank, world, location):
    dist.init_process_group("ferrosync", init_method=location, rank=rank, world_size=world,
                            timeout=TIMEOUT)
    try:
        before = ferrosync.ddp.stats()["total"]
        payload = torch.ones(4096)  # 16 KiB
        dist.all_reduce(payload)
        after = ferrosync.ddp.stats()
        sub = dist.new_group(list(range(world)))
        dist.all_reduce(payload, group=sub)
        return {"before": before, "after": after, "sum": payload[0].item(),
                "sub": ferrosync.ddp.stats(sub)["total"],
                "default_again": ferrosync.ddp.stats(dist.group.WORLD)["total"]}
    finally:
        dist.destroy_process_group()


def test_stats_of_the_ferrosync_group(tmp_path):
    results = run_ranks(_stats_worker, 2, str(tmp_path / "run"))
    for r in results:
        assert r["sum"] == 4.0  # 1 + 1, then again over the subgroup
        total, last = r["after"]["total"], r["after"]["last"]
        assert set(total) >= {"bytes_written", "bytes_read", "requests", "write_s", "wait_s"}
        assert total["bytes_written"] - r["before"]["bytes_written"] >= 4096 * 4 // 2
        assert total["requests"] > r["before"]["requests"]
        assert last["bytes_written"] > 0
        # the subgroup has its own GradSync and its own counters
        assert r["sub"]["bytes_written"] > 0
        assert r["default_again"] == total  # nothing ran in between: the same numbers


def _gloo_worker(rank, world, location):
    dist.init_process_group("gloo", init_method=f"file://{location}", rank=rank,
                            world_size=world, timeout=TIMEOUT)
    try:
        with pytest.raises(ConfigError, match="not a 'ferrosync' process group"):
            ferrosync.ddp.stats()
        return True
    finally:
        dist.destroy_process_group()


def test_stats_of_another_backend_is_a_clear_error(tmp_path):
    assert run_ranks(_gloo_worker, 2, str(tmp_path / "store")) == [True, True]
    with pytest.raises(ConfigError, match="no default process group"):
        ferrosync.ddp.stats()
