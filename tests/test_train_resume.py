"""Interrupt a checkpointed run for real, resume it, and get bit-identical parameters.

The model draws random numbers every step (dropout), the run crosses an epoch
boundary after the resume point, and the checkpoint is taken mid-epoch: the
resumed run matches only if the weights, the optimizer, every rank's RNG state and
the sampler position all survive. The launcher gets Ctrl-C (SIGINT) while rank 1 is
inside step 40 (it announces itself through a marker file; see
train_models.DropoutMLP); killing a rank outright is test_train_launcher's job.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from train_cli import final_of, read_metrics, read_metrics_so_far, run_cli, start_cli

# 32768 demo samples / (2 ranks * 512) = 32 steps per epoch; checkpoints at 15, 30, 45
FLAGS = ("--nproc", 2, "--model", "train_models:dropout_mlp", "--batch-size", 512,
         "--steps", 50, "--checkpoint-every", 15, "--no-progress")
#: grad keeps ranks identical; diloco (merging every 20 steps) resumes at step 30 in the
#: middle of a window, so each rank's own weights and inner momentum, DiLoCo's global
#: copy and its outer momentum must all survive
STRATEGIES = {"grad": (), "diloco": ("--strategy", "diloco", "--sync-every", 20)}


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_interrupted_run_resumes_bit_identically(tmp_path, strategy):
    flags = (*FLAGS, *STRATEGIES[strategy])
    full = run_cli(*flags, "--checkpoint-dir", tmp_path / "ck_full", cwd=tmp_path)
    assert full.returncode == 0, full.stderr
    reference = final_of(full.stdout)

    ck = tmp_path / "ck"
    metrics = tmp_path / "metrics.jsonl"
    marker = tmp_path / "paused.r1"
    proc = start_cli(*flags, "--checkpoint-dir", ck, "--metrics", metrics, cwd=tmp_path,
                     FERROSYNC_TEST_PAUSE_AT=40, FERROSYNC_TEST_PAUSE_RANK=1,
                     FERROSYNC_TEST_PAUSE_DIR=tmp_path)
    try:
        # rank 1 paused inside step 40, and rank 0's metrics past step 38: under
        # diloco the ranks do not meet between steps 20 and 40, so rank 0 may lag
        deadline = time.monotonic() + 120
        while not (marker.exists() and max(
                (m["step"] for m in read_metrics_so_far(metrics)), default=0) >= 39):
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "rank 1 never reached step 40"
            time.sleep(0.05)
        paused_pid = int(marker.read_text())
        proc.send_signal(signal.SIGINT)  # Ctrl-C on the launcher
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "interrupted: stopped every rank" in err
    # and says where to continue from
    assert f"the latest checkpoint is step 30 in {ck}: run the same command with --resume" \
        in err, err
    with pytest.raises(ProcessLookupError):  # the launcher reaped it before exiting
        os.kill(paused_pid, 0)
    latest = json.loads((ck / "latest.json").read_text())
    assert latest["step"] == 30  # mid-epoch 0 of 32 steps
    assert not (ck / "step-00000045.pt").exists()
    assert max(m["step"] for m in read_metrics(metrics)) >= 39

    resumed = run_cli(*flags, "--checkpoint-dir", ck, "--metrics", metrics, "--resume",
                      cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    final = final_of(resumed.stdout)
    assert final["resumed_from"] == 30 and final["steps"] == 50
    assert final["ranks_agree"] is True
    assert final["param_digest"] == reference["param_digest"]

    # the last checkpoints are bitwise equal too, optimizer state included
    a, b = _load(tmp_path / "ck_full" / "step-00000050.pt"), _load(ck / "step-00000050.pt")
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for pid, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"],
                           b["optimizer"]["state"][pid]["momentum_buffer"])
    assert a["sampler"] == b["sampler"] and a["epoch"] == b["epoch"] == 1
    for ra, rb in zip(a["rng"]["torch"], b["rng"]["torch"]):
        assert torch.equal(ra, rb)
    if strategy == "diloco":
        assert final["syncs"] == reference["syncs"] == 3  # steps 20, 40 and the last, 50
        for ga, gb in zip(a["strategy"]["global"], b["strategy"]["global"]):
            assert torch.equal(ga, gb)
        for pid, state in a["strategy"]["outer"]["state"].items():
            assert torch.equal(state["momentum_buffer"],
                               b["strategy"]["outer"]["state"][pid]["momentum_buffer"])
        for rank in range(2):  # each rank's own file: its inner optimizer's momentum
            ra, rb = (_load(d / f"step-00000050.r{rank}.pt") for d in (tmp_path / "ck_full", ck))
            for pid, state in ra["optimizer"]["state"].items():
                assert torch.equal(state["momentum_buffer"],
                                   rb["optimizer"]["state"][pid]["momentum_buffer"])
    # two checkpoints kept; the metrics file reads as one run
    rank_files = [f"step-000000{s}.r{r}.pt" for s in (45, 50) for r in range(2)]
    assert sorted(p.name for p in ck.glob("step-*.pt")) == sorted(
        ["step-00000045.pt", "step-00000050.pt"] + (rank_files if strategy != "grad" else []))
    assert [m["step"] for m in read_metrics(metrics)] == list(range(1, 51))
