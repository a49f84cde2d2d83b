"""``train/run_log.py``: what the training loop reports as it goes, for a stand-in trainer.

Who writes (rank 0 of a fixed-size job, every member of an elastic one, each continuing
its own file), the running totals the summary reads (samples, the loss window, times,
checkpoints), each record reaching the metrics file, TensorBoard and the step hooks, and
the order of closing: the metrics file at ``stop``, TensorBoard after the summary's eval
numbers, everything when opening failed half way. TensorBoard is a recording fake here
(tests/test_tensorboard.py runs the real one).
"""

from __future__ import annotations

import json
import types

import pytest

from ferrosync.train import run_log
from ferrosync.train.metrics import PathClaim
from ferrosync.train.run_log import LOSS_WINDOW, RunLog


class Board:
    """A ``TensorBoardWriter`` that records what it is given."""

    opened: list[Board] = []

    def __init__(self, logdir):
        self.logdir, self.records, self.finals, self.closed = logdir, [], [], 0
        Board.opened.append(self)

    def write(self, record):
        self.records.append(dict(record))

    def final(self, summary):
        self.finals.append(summary)

    def close(self):
        self.closed += 1


@pytest.fixture(autouse=True)
def board(monkeypatch):
    Board.opened = []
    monkeypatch.setattr(run_log, "TensorBoardWriter", Board)
    return Board


def _trainer(tmp_path, **overrides):
    settings = dict(per_member=False, rank=0, step=0, resumed_from=None, total_steps=10,
                    metrics_path=str(tmp_path / "m.jsonl"), tensorboard_dir=None,
                    progress=False, step_hooks=[])
    settings.update(overrides)
    return types.SimpleNamespace(**settings)


def _sync():
    return types.SimpleNamespace(
        stats={"total": {"bytes_written": 5, "bytes_read": 7}},
        counters=types.SimpleNamespace(snapshot=lambda: {"requests": 3}))


def _record(step, loss=0.5, samples=8):
    return {"step": step, "loss": loss, "compute_s": 0.25, "sync_s": 0.125,
            "synced": True, "samples": samples}


def _lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_rank_0_of_a_fixed_size_job_writes_and_continues_from_its_checkpoint(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)))
    log = RunLog(_trainer(tmp_path, step=2, resumed_from=2), _sync())
    log.step(_record(3), world_size=2)
    log.close(None)
    # the interrupted run's lines after its checkpoint are dropped; "samples" is no column
    assert [(line["step"], "samples" in line) for line in _lines(path)] == [
        (1, False), (2, False), (3, False)]
    other = RunLog(_trainer(tmp_path, rank=1, metrics_path=str(tmp_path / "r1.jsonl"),
                            tensorboard_dir=str(tmp_path / "tb")), _sync())
    assert other.metrics is None and other.board is None  # only rank 0 writes
    assert not (tmp_path / "r1.jsonl").exists()


def test_every_elastic_member_writes_its_own_file_from_the_step_it_joined_at(tmp_path):
    path = tmp_path / "member.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (5, 6, 7)))
    log = RunLog(_trainer(tmp_path, per_member=True, rank=3, step=6, resumed_from=None,
                          metrics_path=str(path)), _sync())
    log.step(_record(7), world_size=4)
    log.close(None)
    assert [line["step"] for line in _lines(path)] == [5, 6, 7]


def test_the_totals_and_the_loss_window_follow_the_records(tmp_path):
    hooks = []
    log = RunLog(_trainer(tmp_path, step=4, step_hooks=[lambda: hooks.append(1)]), _sync())
    assert (log.start_step, log.samples, log.stats_begin, log.counters_begin) == (
        4, 0, {"bytes_written": 5, "bytes_read": 7}, {"requests": 3})
    for step in range(5, 5 + LOSS_WINDOW + 3):
        log.step(_record(step, loss=float(step)), world_size=2)
    log.step(_record(99, loss=None, samples=0), world_size=2)  # an idle step trains nothing
    steps = LOSS_WINDOW + 4
    assert log.samples == 8 * (steps - 1) and len(hooks) == steps
    assert list(log.losses) == [float(s) for s in range(8, 8 + LOSS_WINDOW)]  # the last ones
    assert log.totals["compute_s"] == 0.25 * steps and log.totals["sync_s"] == 0.125 * steps
    log.saved(None)  # nothing written
    log.saved(1.5)
    log.saved(0.5)
    assert (log.totals["checkpoint_s"], log.totals["checkpoints"]) == (2.0, 2)
    log.close(None)


def test_tensorboard_gets_each_steps_accuracy_and_the_eval_numbers_last(tmp_path, board):
    log = RunLog(_trainer(tmp_path, tensorboard_dir=str(tmp_path / "tb")), _sync())
    assert log.wants_accuracy
    (tb,) = board.opened
    log.step(_record(1), world_size=1, accuracy=0.75)
    log.step(_record(2, loss=None, samples=0), world_size=1, accuracy=0.75)
    assert [r["accuracy"] for r in tb.records] == [0.75, None]  # an idle step: no batch
    log.stop()
    assert log.metrics is None and log.wall > 0 and tb.closed == 0  # the summary is next
    log.close({"eval_loss": 0.3})
    log.close({"eval_loss": 0.3})  # idempotent
    assert tb.finals == [{"eval_loss": 0.3}] and tb.closed == 1 and not log.open


def test_after_a_failure_tensorboard_closes_without_eval_numbers(tmp_path, board):
    log = RunLog(_trainer(tmp_path, tensorboard_dir=str(tmp_path / "tb")), _sync())
    log.close(None)
    (tb,) = board.opened
    assert tb.finals == [] and tb.closed == 1


def test_outputs_opened_before_a_failing_one_are_closed(tmp_path, monkeypatch):
    def refuse(logdir):
        raise OSError("no space for the event file")

    monkeypatch.setattr(run_log, "TensorBoardWriter", refuse)
    path = tmp_path / "m.jsonl"
    with pytest.raises(OSError, match="no space"):
        RunLog(_trainer(tmp_path, tensorboard_dir=str(tmp_path / "tb")), _sync())
    assert str(path.resolve()) not in PathClaim._held  # the metrics file was released


def test_the_progress_bar_is_rank_0s_and_counts_optimizer_steps(tmp_path, monkeypatch):
    monkeypatch.delenv("FERROSYNC_TTY", raising=False)
    log = RunLog(_trainer(tmp_path, progress=True, step=2, metrics_path=None), _sync())
    bar = log.bar
    assert (bar.n, bar.total, bar.mininterval) == (2, 10, 5.0)  # through a pipe: rarely
    log.step(_record(3), world_size=2)
    log.step(_record(5), world_size=2)  # the step, not the number of records
    assert bar.n == 5 and "loss" in bar.postfix
    log.stop()
    assert log.bar is None
    assert RunLog(_trainer(tmp_path, progress=True, rank=1, metrics_path=None),
                  _sync()).bar is None
