"""``python -m ferrosync.train --tensorboard DIR``: a real run, its event file read back
with TensorBoard's own reader."""

from __future__ import annotations

import pytest
from train_cli import final_of, run_cli

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)

PER_STEP = ("train/loss", "train/accuracy", "train/lr", "time/compute_s", "time/sync_s",
            "sync/bytes", "sync/requests")


def _scalars(directory) -> dict[str, list]:
    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}


def test_tensorboard_has_every_scalar_per_step(tmp_path):
    board = tmp_path / "tb"
    steps = 12
    proc = run_cli("--nproc", 2, "--steps", steps, "--tensorboard", board, "--metrics",
                   tmp_path / "m.jsonl", "--no-progress", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    final = final_of(proc.stdout)
    assert len(list(board.glob("events.out.tfevents.*"))) == 1  # rank 0 only
    scalars = _scalars(board)
    for tag in PER_STEP:
        assert [e.step for e in scalars[tag]] == list(range(1, steps + 1)), tag
    assert [e.value for e in scalars["train/lr"]] == pytest.approx([0.05] * steps)
    assert all(e.value > 0 for e in scalars["sync/bytes"] + scalars["sync/requests"])
    assert all(0 <= e.value <= 1 for e in scalars["train/accuracy"])
    # the end's evaluation, at the last step, equals the FINAL line's
    (accuracy,) = scalars["eval/accuracy"]
    assert accuracy.step == steps and accuracy.value == pytest.approx(final["accuracy"])
    assert "elastic/members" not in scalars


def test_tensorboard_elastic_writes_members(tmp_path):
    board = tmp_path / "tb"
    proc = run_cli("--nproc", 2, "--elastic", "--min-ranks", 2, "--steps", 6, "--tensorboard",
                   board, "--sync", tmp_path / "sync", "--no-progress", cwd=tmp_path,
                   timeout=180)
    assert proc.returncode == 0, proc.stderr
    for member in ("0", "1"):  # each local member its own directory, as --metrics
        scalars = _scalars(f"{board}.{member}")
        assert [e.value for e in scalars["elastic/members"]] == [2.0] * 6
        assert [e.step for e in scalars["train/loss"]] == list(range(1, 7))


def test_missing_tensorboard_is_one_line_with_the_install_hint(tmp_path):
    """The package made unimportable for the launcher and its ranks: bad input, exit 2,
    before any rank starts."""
    hide = tmp_path / "hide"
    (hide / "tensorboard").mkdir(parents=True)
    (hide / "tensorboard" / "__init__.py").write_text(
        "raise ImportError('tensorboard is not installed here')\n")
    from train_cli import ROOT, TESTS, cli_env, command, run_forked

    # a process of its own (forked from the suite's forkserver, which never imports
    # tensorboard): whether tensorboard imports is a process's state, and this test
    # process may have imported it already
    proc = run_forked(command("--nproc", 2, "--steps", 2, "--tensorboard", tmp_path / "tb",
                              "--no-progress"), cwd=tmp_path, capture_output=True,
                      text=True, timeout=60, env=cli_env(PYTHONPATH=f"{hide}:{ROOT}:{TESTS}"))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'ferrosync[tensorboard]'" in lines[0], lines
    assert not (tmp_path / "tb").exists()
