"""What the training loop reports as it goes: one ``RunLog`` per ``fit``.

Every step's record goes to the metrics file (``--metrics``), TensorBoard
(``--tensorboard``), the progress bar and the step hooks, and into the running
totals the summary reports (``summary.summarise``). The fixed-size trainer and the
elastic trainer share this one home, so a change to what a run reports lands once.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque

from ferrosync.train.metrics import MetricsWriter, TensorBoardWriter

__all__ = ["RunLog", "LOSS_WINDOW"]

#: the final "loss" is the mean over ranks of each rank's last this-many batch losses
LOSS_WINDOW = 20


class RunLog:
    """The outputs and totals of one ``fit`` on this process.

    Args:
        trainer: the ``Trainer``; its ``per_member`` says who writes: rank 0 (a
            fixed-size job, whose metrics continue from ``resumed_from``), or every
            member of an elastic job (each its own files, continued from the step it
            joined at).
        sync: the ``GradSync`` (its counters at the start are the run's zero).
    """

    def __init__(self, trainer, sync) -> None:
        writes = trainer.per_member or trainer.rank == 0
        resume = trainer.step if trainer.per_member else trainer.resumed_from
        self.metrics = self.board = self.bar = None
        self.open = True  # until ``close``: the loop, its end and the summary run
        try:
            if writes and trainer.metrics_path:
                self.metrics = MetricsWriter(trainer.metrics_path, resume_step=resume)
            if writes and trainer.tensorboard_dir:
                self.board = TensorBoardWriter(trainer.tensorboard_dir)
        except BaseException:
            self.close(None)
            raise
        if trainer.progress and trainer.rank == 0:
            self.bar = _progress_bar(trainer)
        self.hooks = trainer.step_hooks
        self.totals = {"compute_s": 0.0, "sync_s": 0.0, "checkpoint_s": 0.0, "checkpoints": 0}
        self.losses: deque[float] = deque(maxlen=LOSS_WINDOW)
        self.samples, self.start_step = 0, trainer.step
        self.wall = 0.0
        self.begin = time.perf_counter()
        self.stats_begin = sync.stats["total"]
        self.counters_begin = sync.counters.snapshot()  # every request, heartbeats included

    @property
    def wants_accuracy(self) -> bool:
        """Whether the loop should measure each batch's accuracy (TensorBoard shows it)."""
        return self.board is not None

    def step(self, record: dict, *, world_size: int, accuracy: float | None = None) -> None:
        """One step's ``record`` (``Trainer._record``): totals, the metrics line,
        TensorBoard, the step hooks, the progress bar."""
        self.samples += record.pop("samples")
        if record["loss"] is not None:  # an idle step trained no batch
            self.losses.append(record["loss"])
        self.totals["compute_s"] += record["compute_s"]
        self.totals["sync_s"] += record["sync_s"]
        if self.metrics is not None:
            self.metrics.write(record)
        if self.board is not None:
            trained = record["loss"] is not None
            self.board.write({**record, "accuracy": accuracy if trained else None})
        for hook in self.hooks:
            hook()
        if self.bar is not None:
            elapsed = time.perf_counter() - self.begin
            self.bar.set_postfix(loss=f"{record['loss'] or 0:.4f}",
                                 samples_s=f"{self.samples * world_size / elapsed:,.0f}",
                                 sync=f"{100 * self.totals['sync_s'] / elapsed:.0f}%",
                                 refresh=False)
            self.bar.update(record["step"] - self.bar.n)

    def saved(self, seconds: float | None) -> None:
        """A checkpoint (an elastic job: a published state) took ``seconds``; None:
        nothing was written."""
        if seconds is not None:
            self.totals["checkpoint_s"] += seconds
            self.totals["checkpoints"] += 1

    def stop(self) -> None:
        """The loop is over: the wall time stops, the progress bar and the metrics file
        close (TensorBoard waits for the summary's eval numbers, ``close``)."""
        self.wall = time.perf_counter() - self.begin
        self._close_files()

    def close(self, summary: dict | None) -> None:
        """Close everything; ``summary``'s eval numbers go to TensorBoard first (None
        after a failure). Idempotent."""
        self.open = False
        self._close_files()
        board, self.board = self.board, None
        if board is not None:
            if summary is not None:
                board.final(summary)
            board.close()

    def _close_files(self) -> None:
        bar, self.bar = self.bar, None
        metrics, self.metrics = self.metrics, None
        for output in (bar, metrics):
            if output is not None:
                output.close()


def _progress_bar(trainer):
    from tqdm import tqdm

    # through a pipe (the launcher, a log file) redraw rarely instead of 10x a second
    interactive = sys.stderr.isatty() or os.environ.get("FERROSYNC_TTY", "") not in ("", "0")
    return tqdm(total=trainer.total_steps, initial=trainer.step, desc="train", unit="step",
                file=sys.stderr, dynamic_ncols=interactive,
                mininterval=0.2 if interactive else 5.0)
