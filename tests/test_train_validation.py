"""Bad input to ``python -m ferrosync.train`` caught before training, and errors that
reach the launcher from a rank: one line each, printed once (real launcher, real ranks).

Factories: tests/train_data.py (``--data train_data:...``)."""

from __future__ import annotations

import random
import textwrap

import numpy
import pytest
import torch
from train_cli import final_of, run_cli, run_main
from train_data import augmented, seeded, unseeded_numpy

from ferrosync.train.fingerprint import fingerprint, length_of

DETERMINISTIC = "the data factory (--data) must be deterministic"


def _error_lines(stderr: str) -> list[str]:
    """The lines that report an error: the launcher's own, or its report of a rank's."""
    return [line for line in stderr.splitlines()
            if line.startswith("ferrosync.train: error: ") or " failed with exit code" in line
            or " failed too: " in line]


# -- the dataset fingerprint ----------------------------------------------------------------

@pytest.mark.unit
def test_fingerprint_tells_datasets_apart_and_leaves_the_rngs_alone():
    a, b = seeded(), seeded()
    torch.manual_seed(5)
    random.seed(5)
    numpy.random.seed(5)
    before = (torch.get_rng_state(), random.getstate(), numpy.random.get_state()[1].copy())
    assert fingerprint(a, len(a)) == fingerprint(b, len(b))
    assert length_of(fingerprint(a, len(a))) == len(a)
    # augmentation that draws from the global generators reads the same on every call
    assert fingerprint(augmented(), 512) == fingerprint(augmented(), 512)
    after = (torch.get_rng_state(), random.getstate(), numpy.random.get_state()[1])
    assert torch.equal(before[0], after[0]) and before[1] == after[1]
    assert (before[2] == after[2]).all()
    c, d = unseeded_numpy(), unseeded_numpy()
    assert fingerprint(c, len(c)) != fingerprint(d, len(d))
    # one changed sample at a sampled index (the last is always one) changes it
    x, y = a.tensors
    x = x.clone()
    x[-1, 0] += 1
    changed = torch.utils.data.TensorDataset(x, y)
    assert fingerprint(changed, len(changed)) != fingerprint(a, len(a))


@pytest.mark.parametrize("factory, needle", [
    ("unseeded_numpy", "512 samples each, but other samples on rank 1 than on rank 0"),
    ("length_by_rank", "512 samples on rank 0, 520 samples on rank 1"),
])
def test_ranks_with_different_data_stop_before_training(tmp_path, factory, needle):
    metrics = tmp_path / "m.jsonl"
    proc = run_cli("--nproc", 2, "--steps", 5, "--data", f"train_data:{factory}",
                   "--metrics", metrics, "--no-progress", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    errors = _error_lines(proc.stderr)
    assert len(errors) == 1, proc.stderr  # once, from the launcher, naming the rank
    assert DETERMINISTIC in errors[0] and needle in errors[0], errors[0]
    assert "seed every random generator" in errors[0]
    assert "FINAL" not in proc.stdout
    assert not metrics.exists() or metrics.read_text() == ""  # no step was taken


def test_random_augmentation_is_not_different_data(tmp_path):
    proc = run_cli("--nproc", 2, "--steps", 3, "--data", "train_data:augmented",
                   "--no-progress", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert final_of(proc.stdout)["ranks_agree"] is True


# -- checks before any rank starts ------------------------------------------------------------

@pytest.mark.parametrize("args, needle", [
    (["--sync-option", "heartbeat_timout=30"], "unknown option(s) ['heartbeat_timout']"),
    (["--sync-option", "wire_dtype=int3"], "wire_dtype"),
    (["--elastic", "--sync-option", "reduce=root"], "for an elastic job"),
    (["--strategy", "streaming-diloco", "--fragments", "8"],
     "--fragments 8 is more than the model's 6 parameter tensors"),
])
def test_bad_settings_never_start_a_rank(tmp_path, args, needle, monkeypatch, capsys):
    """Without --sync too (a temporary directory): the options are still checked. In
    this process (test_train_errors runs the same refusals as real processes)."""
    code, stdout, stderr = run_main(["--nproc", 2, "--steps", 3, *args, "--no-progress"],
                                    tmp_path, monkeypatch, capsys)
    assert code == 2, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr  # no "started 2 ranks", no per-rank copies
    assert lines[0].startswith("ferrosync.train: error: ") and needle in lines[0], lines[0]
    assert stdout == ""


def test_more_ranks_than_samples_is_one_error(tmp_path):
    proc = run_cli("--nproc", 4, "--steps", 3, "--data", "train_data:three", "--no-progress",
                   cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    errors = _error_lines(proc.stderr)
    assert len(errors) == 1, proc.stderr
    assert "the dataset has 3 samples, fewer than the 4 ranks" in errors[0]


def test_batch_larger_than_a_shard_warns_once(tmp_path):
    proc = run_cli("--nproc", 2, "--steps", 2, "--data", "train_data:seeded", "--batch-size",
                   300, "--no-progress", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert warnings == ["[rank 0] ferrosync.train: warning: batch size 300 is larger than a "
                        "rank's shard of 256 samples (512 samples / 2 ranks): every step is a "
                        "whole epoch of one smaller batch; lower --batch-size"], proc.stderr


# -- errors from a rank ---------------------------------------------------------------------

@pytest.mark.parametrize("verbose", [False, True])
def test_a_rank_error_reaches_the_launcher_as_one_line(tmp_path, verbose):
    proc = run_cli("--nproc", 2, "--steps", 3, "--model", "train_data:fails_on_rank1",
                   "--no-progress", *(["--verbose"] if verbose else []), cwd=tmp_path,
                   timeout=120)
    assert proc.returncode == 1, proc.stderr
    expected = "ferrosync.train: rank 1 failed with exit code 1: RuntimeError: shape " \
               "trouble on rank 1"
    assert expected in proc.stderr
    assert ("Traceback" in proc.stderr) is verbose
    if not verbose:  # once: the launcher's report; rank 0's PeerFailed is not repeated
        assert proc.stderr.count("shape trouble on rank 1") == 1, proc.stderr
        assert expected + " (--verbose for the traceback)" in proc.stderr


def test_a_sigterm_while_a_rank_exits_prints_no_traceback(tmp_path):
    """The launcher stops the ranks a failed peer left with SIGTERM; one may already be
    exiting (closing its syncs at exit). The signal must not surface as a traceback
    ("Exception ignored in atexit callback ... SystemExit: 143"), nor change the exit."""
    proc = run_cli("--nproc", 1, "--steps", 2, "--model", "train_data:sigterm_at_exit",
                   "--no-progress", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "SystemExit" not in proc.stderr, proc.stderr
    assert final_of(proc.stdout)["steps"] == 2


def test_duplicate_rank_is_one_line(tmp_path):
    """A second launch with the running one's job id on its URL: the second reports
    DuplicateRank in one line, naming the rank, without a traceback."""
    import subprocess
    import time

    from train_cli import ForkedCli, cli_env, command, run_forked

    sync, metrics = tmp_path / "sync", tmp_path / "m.jsonl"
    # a paced model (50 ms a step): the first job runs for as long as the test needs
    # without taking the cores the second launch starts on
    env = cli_env(FERROSYNC_JOB="same", FERROSYNC_TEST_STEP_S=0.05)
    paced = ("--model", "train_models:paced_mlp")
    first = ForkedCli(command("--nproc", 2, "--steps", 1_000_000, "--sync", sync,
                              "--metrics", metrics, "--no-progress", *paced),
                      cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert time.monotonic() < deadline and first.poll() is None, "never trained"
            time.sleep(0.05)
        second = run_forked(command("--nproc", 2, "--steps", 5, "--sync", sync,
                                    "--no-progress", *paced), cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    finally:
        first.terminate()  # SIGTERM: the launcher stops its ranks
        first.wait(timeout=60)
    assert second.returncode == 1, second.stderr
    assert "DuplicateRank" in second.stderr and "Traceback" not in second.stderr
    failed = [line for line in second.stderr.splitlines() if " failed with exit code" in line]
    assert len(failed) == 1 and "DuplicateRank: rank " in failed[0], second.stderr


# -- FERROSYNC_JOB --------------------------------------------------------------------------

JOB_SCRIPT = textwrap.dedent("""
    import os
    import ferrosync

    with ferrosync.connect() as sync:
        sync.barrier()
        print("JOB", os.environ.get("FERROSYNC_JOB"), sync.rank)
""")


def test_launcher_keeps_the_users_job_id(tmp_path):
    script = tmp_path / "job_script.py"
    script.write_text(JOB_SCRIPT)
    sync = tmp_path / "sync"
    proc = run_cli("--nproc", 2, "--sync", sync, script, cwd=tmp_path, timeout=120,
                   FERROSYNC_JOB="kept-job")
    assert proc.returncode == 0, proc.stderr
    jobs = sorted(line.split("] ", 1)[1] for line in proc.stdout.splitlines() if "JOB" in line)
    assert jobs == ["JOB kept-job 0", "JOB kept-job 1"]
    assert (sync / "rdzv.kept-job").is_dir()  # the ranks met under the user's job id
    proc = run_cli("--nproc", 2, "--sync", sync, script, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    ids = {line.split()[-2] for line in proc.stdout.splitlines() if "JOB" in line}
    assert len(ids) == 1 and ids != {"kept-job"} and ids.pop().startswith("launch-")
