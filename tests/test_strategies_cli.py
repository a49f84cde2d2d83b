"""``python -m ferrosync.train --strategy local-sgd|diloco`` as a user runs it: real
launcher, real ranks, a temporary sync directory; what FINAL and the metrics say."""

from __future__ import annotations

import re

import pytest
from train_cli import METRIC_KEYS, final_of, read_metrics, run_cli

from ferrosync.strategies import TELEMETRY_KEYS
from ferrosync.train.cli import STRATEGY_FLAGS, TRAINER_FLAGS, build_parser

STEPS = 100
H = 20


@pytest.fixture(scope="module")
def grad_bytes(tmp_path_factory):
    """Bytes the per-step baseline writes for the same run (the comparison point)."""
    where = tmp_path_factory.mktemp("grad")
    proc = run_cli("--nproc", 2, "--steps", STEPS, "--no-progress", cwd=where)
    assert proc.returncode == 0, proc.stderr
    return final_of(proc.stdout)["bytes_written"]


@pytest.mark.parametrize("strategy", ["local-sgd", "diloco"])
def test_periodic_strategy_end_to_end(tmp_path, strategy, grad_bytes):
    metrics = tmp_path / "m.jsonl"
    proc = run_cli("--nproc", 2, "--strategy", strategy, "--sync-every", H, "--steps", STEPS,
                   "--metrics", metrics, "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    final = final_of(proc.stdout)
    assert final["ranks_agree"] is True and final["strategy"] == strategy
    assert final["steps"] == STEPS and final["rank_steps"] == [STEPS, STEPS]
    assert final["syncs"] == STEPS // H and final["masses"] == [STEPS, STEPS]
    assert final["skipped_syncs"] == 0 and final["sync_every"] == H
    assert 0 < final["divergence_mean"] < 1 and final["post_norm"] > 0
    # 5 merges instead of 100 gradient averages
    assert final["bytes_written"] * 10 < grad_bytes, (final["bytes_written"], grad_bytes)
    # (the label column's width follows the summary's longest label)
    assert re.search(rf"syncs +{STEPS // H} \(every {H} steps, 0 skipped\)", proc.stdout)

    lines = read_metrics(metrics)
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    for m in lines:
        assert METRIC_KEYS | set(TELEMETRY_KEYS) | {"synced"} <= set(m), m
        if m["step"] % H:
            assert not m["synced"] and m["masses"] is None and m["divergence"] is None
        else:
            assert m["synced"] and m["masses"] == [H, H] and m["skipped"] is False
            assert m["divergence"] > 0 and m["pre_norm"] > 0 and m["post_norm"] > 0
            assert m["sync_bytes"] > 0 and m["bytes"] >= m["sync_bytes"]


def test_time_based_cadence_end_to_end(tmp_path):
    proc = run_cli("--nproc", 2, "--strategy", "local-sgd", "--sync-every-seconds", 0.3,
                   "--steps", 200, "--batch-size", 32, "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    final = final_of(proc.stdout)
    assert final["ranks_agree"] is True
    # the budget: 200 steps x 2 ranks worth of batches, shared by speed, exactly
    assert sum(final["masses"]) == 400 and final["rank_steps"] == final["masses"]
    assert final["samples"] == 400 * 32 and final["sync_every_seconds"] == 0.3
    assert final["syncs"] >= 1 and "every 0.3 s" in proc.stdout


@pytest.mark.unit
def test_every_strategy_setting_has_its_flag():
    """The registry declares the settings; each needs a flag of the same dest."""
    dests = {action.dest for action in build_parser()._actions}
    assert set(STRATEGY_FLAGS) <= dests
    assert set(STRATEGY_FLAGS) <= set(TRAINER_FLAGS)
