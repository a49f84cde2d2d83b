"""The DDP comm hook: DDP's gradient buckets averaged through any GradSync.

``wrap`` runs DDP with no torch.distributed process group at all; "hook-local"
runs DDP over a per-process world-size-1 gloo group and registers the hook by
hand. Both must train exactly like DDP on gloo.
"""

from __future__ import annotations

import pytest
import torch
from ddp_workers import (
    FAST,
    assert_matches_reference,
    gloo_reference,
    mismatched_buckets,
    train,
)

import ferrosync
from ferrosync.errors import ConfigError, LayoutMismatch, PeerFailed
from ranks import RankFailure, run_ranks

PARAMETERS = ["body.0.weight", "body.0.bias", "body.1.weight", "body.1.bias",
              "body.3.weight", "body.3.bias"]


@pytest.mark.parametrize("world, unused", [(2, False), (3, True)])
def test_wrap_matches_gloo(tmp_path, world, unused):
    results = run_ranks(train, world, "wrap", str(tmp_path / "run"), unused=unused)
    assert_matches_reference(results, gloo_reference(world, unused=unused))


def test_wrap_over_s3(s3_transport):
    results = run_ranks(train, 2, "wrap", s3_transport.url, steps=6,
                        options=s3_transport.options)
    assert_matches_reference(results, gloo_reference(2, steps=6))


def test_hook_on_ddp_over_world_size_one_groups(tmp_path):
    # no process-group network between ranks; buffers are not broadcast (each rank's
    # DDP sees a world of one), so only the parameters are compared
    results = run_ranks(train, 2, "hook-local", str(tmp_path / "run"))
    assert_matches_reference(results, gloo_reference(2), keys=PARAMETERS)


def test_differing_buckets_raise_layout_mismatch_on_every_rank(tmp_path):
    results = run_ranks(mismatched_buckets, 2, str(tmp_path / "run"), expect_errors=True)
    for result in results:
        assert isinstance(result, RankFailure)
        assert isinstance(result.error, LayoutMismatch), result.traceback
        assert "bucket 0" in str(result.error)
    # the rank that detects it names both sides' shapes
    assert any("[0, 6, 4]" in str(r.error) and "[0, 4, 6]" in str(r.error) for r in results)


def test_rank_failing_under_wrap_makes_the_others_raise(tmp_path):
    results = run_ranks(train, 2, "wrap", str(tmp_path / "run"), fail=(0, 3), options=FAST,
                        expect_errors=True, timeout=60)
    assert "injected failure" in str(results[0].error)
    assert isinstance(results[1].error, PeerFailed), results[1].traceback


@pytest.mark.unit
def test_wrap_and_hook_reject_what_is_not_a_gradsync():
    with pytest.raises(ConfigError, match="GradSync"):
        ferrosync.ddp.wrap(torch.nn.Linear(2, 2), "s3://bucket/run")
    with pytest.raises(ConfigError, match="GradSync"):
        ferrosync.ddp.hook(None, None)
    with pytest.raises(ConfigError, match="GradSync"):
        ferrosync.ddp.SyncProcessGroup(object())
