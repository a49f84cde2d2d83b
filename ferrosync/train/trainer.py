"""``Trainer``: a data-parallel training loop over a ``GradSync``, with checkpoints.

Every rank runs the same loop over its own shard of the data (``ShardSampler``)::

    trainer = ferrosync.Trainer(model_fn, optimizer_fn, loss_fn, dataset,
                                batch_size=64, epochs=5, eval_fn=evaluate)
    with ferrosync.connect() as sync:          # after the Trainer: bad input fails
        summary = trainer.fit(sync)            # before anything is written
    # summary["ranks_agree"], summary["accuracy"], ...

Synchronisation belongs to a ``Strategy`` (default ``GradAveraging``: average the
gradients every step); the loop itself only does forward, backward, telemetry and
checkpoints, so new strategies need no change here. The loop asks the strategy
whether to go on (``keep_going``) and whether this rank should train in the current
window (``wants_batch``; a time-based strategy may give a rank nothing left to do,
and it then joins the sync with zero work); with a lockstep strategy that is just
``step < total_steps``.

Determinism (what makes ``--resume`` bit-exact on CPU): the model is built from
``torch.manual_seed(seed)`` on every rank; then each rank seeds its own training
RNGs (torch, ``random``, NumPy) from ``(seed, rank)``; the data order depends only
on ``(seed, epoch)``; a checkpoint carries every rank's RNG states (gathered through
the sync), the optimizer and strategy state, and the position inside the epoch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import random
import sys
import time
import warnings
from collections import deque
from typing import Callable, ClassVar

import numpy
import torch

from ..costs import hourly, is_billed, parse_prices
from ..env import discover
from ..errors import ConfigError
from ..partition import ShardSampler
from ..stats import PHASES
from ..storage import REQUEST_KINDS
from ..strategies import TELEMETRY_KEYS, GradAveraging, Strategy
from ..validate import integer
from .batching import batch_loader
from .checkpoint import (
    CheckpointStore,
    capture_rng,
    check_compatible,
    model_signature,
    restore_rng,
)
from .fingerprint import SIZE, fingerprint, length_of
from .metrics import (
    MetricsWriter,
    TensorBoardWriter,
    final_line,
    format_summary,
    param_digest,
    require_tensorboard,
)

__all__ = ["Trainer", "resolve_device"]

#: the final "loss" is the mean over ranks of each rank's last this-many batch losses
LOSS_WINDOW = 20

#: the storage counters the summary reports (all requests, then each billed kind)
_REQUEST_KEYS = ("requests", *REQUEST_KINDS)


class Trainer:
    """Train ``model_fn()`` on ``dataset`` across every rank of a ``GradSync``.

    Args:
        model_fn: ``() -> torch.nn.Module``; called on every rank right after
            ``torch.manual_seed(seed)``, so every rank builds the same initial model
            (the strategy also broadcasts rank 0's parameters at the start).
        optimizer_fn: ``(parameters) -> torch.optim.Optimizer``.
        loss_fn: ``(model_output, target) -> scalar tensor``.
        dataset: a sized ``Dataset`` of ``(input, target)`` pairs; every rank holds
            the same dataset and trains on its ``ShardSampler`` shard.
        sync: the ``GradSync`` (may instead be passed to ``fit``).
        batch_size: per rank; the global batch is ``batch_size * world_size``.
        epochs, steps: how long to train; with both, whichever ends first. ``steps``
            counts optimizer steps. With a time-based strategy (``sync_every_seconds``)
            ranks take different numbers of steps and the length is a budget of
            ``steps * world_size`` batches over all ranks (the same samples).
        eval_fn: ``(model) -> {"loss": float, "accuracy": float | None}``; called on
            every rank after training (parameters are identical there by then);
            rank 0's result is reported.
        strategy: a ``Strategy``; default ``GradAveraging()`` (see
            ``ferrosync.strategies``: ``LocalSGD``, ``DiLoCo``).
        seed: model initialisation, data order and per-rank RNG seeds derive from it.
        metrics_path: rank 0 writes one JSON line per step there (a local path).
        tensorboard_dir: rank 0 writes TensorBoard scalars there (``TensorBoardWriter``;
            needs the ``tensorboard`` package: ``pip install 'ferrosync[tensorboard]'``).
        checkpoint_dir: directory or fsspec URL, visible to every rank.
        checkpoint_every: write a checkpoint every this many optimizer steps (and at
            the end); needs ``checkpoint_dir``.
        resume: continue from the latest checkpoint in ``checkpoint_dir``; a missing
            or incompatible checkpoint is a ``ConfigError`` raised here, before any
            collective, so nothing is written.
        keep_checkpoints: how many recent checkpoints to keep.
        storage_options: fsspec options for ``checkpoint_dir``.
        progress: rank 0 shows a tqdm bar on stderr.
        report: rank 0 prints the summary table and the ``FINAL {json}`` line.
        device: where to train (default: ``cuda:<local rank>`` if available, else cpu).
        num_workers: DataLoader worker processes.
        rank, world_size: this process's identity when ``sync`` is not given yet
            (default: from the environment, like ``connect``).

    Raises:
        ConfigError: on bad arguments or an unusable checkpoint (before any I/O
            on the sync; rank 0 also checks that ``checkpoint_dir`` is writable).
    """

    def __init__(
        self,
        model_fn: Callable[[], torch.nn.Module],
        optimizer_fn: Callable,
        loss_fn: Callable,
        dataset,
        *,
        sync=None,
        batch_size: int = 64,
        epochs: int | None = None,
        steps: int | None = None,
        eval_fn: Callable | None = None,
        strategy: Strategy | None = None,
        seed: int = 0,
        metrics_path: str | None = None,
        tensorboard_dir: str | None = None,
        checkpoint_dir: str | None = None,
        checkpoint_every: int | None = None,
        resume: bool = False,
        keep_checkpoints: int = 2,
        storage_options: dict | None = None,
        progress: bool = True,
        report: bool = True,
        device=None,
        num_workers: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        storage_prices: str | dict | None = None,
    ) -> None:
        # every argument is checked before anything is built (model_fn may be costly)
        self.batch_size = integer("batch_size", batch_size, minimum=1)
        epochs = integer("epochs", epochs, minimum=1, allow_none=True)
        steps = integer("steps", steps, minimum=1, allow_none=True)
        self.checkpoint_every = integer("checkpoint_every", checkpoint_every, minimum=1,
                                        allow_none=True)
        self.keep_checkpoints = integer("keep_checkpoints", keep_checkpoints, minimum=1)
        if epochs is None and steps is None:
            raise ConfigError("give epochs or steps (or both: whichever ends first)")
        self.seed = integer("seed", seed)
        self.storage_prices = parse_prices(storage_prices)  # checked now, priced per store
        self._storage_prices_given = storage_prices
        if (checkpoint_every or resume) and not checkpoint_dir:
            raise ConfigError("checkpoint_every and resume need checkpoint_dir",
                              hint="pass --checkpoint-dir DIR_OR_URL")
        _check_callables(model_fn=model_fn, optimizer_fn=optimizer_fn, loss_fn=loss_fn,
                         eval_fn=eval_fn)
        n = _dataset_length(dataset)

        if sync is not None:
            rank, world_size = sync.rank, sync.world_size
        identity = discover(rank, world_size)
        self.rank, self.world_size = identity.rank, identity.world_size
        self.sync = sync
        self.loss_fn, self.eval_fn = loss_fn, eval_fn
        self.strategy = strategy if strategy is not None else GradAveraging()
        if not isinstance(self.strategy, Strategy):
            raise ConfigError(f"strategy must be a ferrosync.strategies.Strategy, got "
                              f"{type(self.strategy).__name__}")
        self.metrics_path = metrics_path
        if tensorboard_dir is not None:
            require_tensorboard()  # a missing package is bad input, found before any I/O
        self.tensorboard_dir = tensorboard_dir
        self._board: TensorBoardWriter | None = None
        self._batch_accuracy: float | None = None
        #: called with no arguments after every step, on the training thread (the
        #: command line's ``ThreadShare.adjust``)
        self.step_hooks: list[Callable[[], object]] = []
        self.progress, self.report = progress, report
        self.device = resolve_device(device, identity.local_rank)

        self._build_model(model_fn, optimizer_fn)
        self._build_data(dataset, n, num_workers, epochs=epochs, steps=steps)
        # compared across ranks at the start of fit: the same data everywhere
        self.data_fingerprint = fingerprint(dataset, n)
        self.step, self.epoch, self.consumed = 0, 0, 0
        self.resumed_from = None
        self.checkpoints = (CheckpointStore(checkpoint_dir, storage_options)
                            if checkpoint_dir else None)
        if resume:
            self._resume()
        if self.checkpoints is not None and self.rank == 0:
            self.checkpoints.probe()

    # -- setup -------------------------------------------------------------------------
    def _build_model(self, model_fn, optimizer_fn) -> None:
        """The same initial model on every rank, its optimizer, then per-rank RNGs."""
        torch.manual_seed(self.seed)  # the same initial weights on every rank
        model = model_fn()
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model_fn must return a torch.nn.Module, got "
                              f"{type(model).__name__}")
        self.model = model.to(self.device)
        self.optimizer = optimizer_fn(self.model.parameters())
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer_fn must return a torch.optim.Optimizer, got "
                              f"{type(self.optimizer).__name__}")
        # training randomness (dropout, augmentation) differs per rank, reproducibly
        seed_streams(derived_seed(self.seed, self.rank))

    def _build_data(self, dataset, n: int, num_workers: int, *, epochs: int | None,
                    steps: int | None) -> None:
        """This rank's sampler and loader, and the run's length in optimizer steps."""
        if n < self.world_size:
            raise ConfigError(f"the dataset has {n} samples, fewer than the {self.world_size} "
                              "ranks: some ranks would have no data", rank=self.rank,
                              hint="start fewer ranks (--nproc) or give more data")
        self.sampler = ShardSampler(n, rank=self.rank, world_size=self.world_size,
                                    shuffle=True, seed=self.seed)
        # the loader gets its own generator: creating an iterator must not draw from
        # the global RNG, or a run resumed mid-epoch would be one draw out of step
        self.loader = batch_loader(dataset, self.sampler, self.batch_size,
                                   num_workers=num_workers,
                                   generator=torch.Generator().manual_seed(self.seed))
        self.steps_per_epoch = -(-len(self.sampler) // self.batch_size)
        if self.batch_size > len(self.sampler) and self.rank == 0:
            warnings.warn(
                f"ferrosync: batch size {self.batch_size} is larger than a rank's shard of "
                f"{len(self.sampler)} samples ({n} samples / {self.world_size} ranks): every "
                "step is a whole epoch of one smaller batch; lower --batch-size",
                stacklevel=3)
        limits = [s for s in (steps, epochs and epochs * self.steps_per_epoch) if s]
        self.total_steps = min(limits)

    # -- checkpoints -------------------------------------------------------------------
    def _resume(self) -> None:
        store = self.checkpoints
        meta = store.require_latest()
        check_compatible(meta, model=self.model, world_size=self.world_size,
                         strategy=self.strategy.name, url=store.url)
        state = store.load(meta)
        try:
            # ranks that drift apart between syncs each resume from their own file
            own = store.load_rank(meta, self.rank) if meta.get("rank_files") else state
            self.model.load_state_dict(own["model"])
            self.optimizer.load_state_dict(own["optimizer"])
            self.strategy.load_state_dict(state["strategy"])
            self.sampler.load_state_dict(own["sampler"])
            restore_rng({name: per_rank[self.rank] for name, per_rank in state["rng"].items()},
                        self.device)
            self.step, self.epoch = int(own["step"]), int(own["epoch"])
        except (KeyError, IndexError, ValueError, RuntimeError, TypeError) as exc:
            raise ConfigError(
                f"checkpoint {store.url}/{meta['file']} does not fit this run "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
                hint="resume with the settings that wrote it, or start without --resume",
            ) from None
        self.consumed = int(own["sampler"].get("consumed", 0))
        self.resumed_from = self.step

    def _save_checkpoint(self, sync) -> float:
        """Collective (every rank, at the same point of the strategy's agreed progress):
        gather RNG states; each rank writes its own state if ranks may differ; rank 0
        writes the checkpoint and ``latest.json``."""
        start = time.perf_counter()
        # every rank's random state, so each rank resumes its own streams
        rng = {name: sync.all_gather(t) for name, t in capture_rng(self.device).items()}
        epoch, consumed = self.epoch, self.consumed
        if consumed >= len(self.sampler):  # the epoch is done: resume at the next
            epoch, consumed = epoch + 1, 0
        own = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict(consumed) | {"epoch": epoch},
            "step": self.step,
            "epoch": epoch,
        }
        step = self.strategy.progress(self.step)  # the same on every rank
        per_rank = not (self.strategy.replicated and self.strategy.lockstep)
        if per_rank:
            # parameters, inner optimizer state and data position differ per rank
            self.checkpoints.save_rank(step, self.rank, own)
            sync.barrier()  # every rank file exists before latest.json can name the step
        if self.rank == 0:
            state = {**own, "strategy": self.strategy.state_dict(), "rng": rng}
            meta = {"step": step, "epoch": epoch, "world_size": self.world_size,
                    "strategy": self.strategy.name, "batch_size": self.batch_size,
                    "seed": self.seed, "model": model_signature(self.model),
                    "rank_files": per_rank}
            self.checkpoints.save(state, meta, keep=self.keep_checkpoints)
        return time.perf_counter() - start

    # -- the loop ----------------------------------------------------------------------
    def fit(self, sync=None) -> dict:
        """Collective: train to the end, then compare parameters across ranks.

        Every rank calls it with the same settings. Blocks for the whole run;
        raises whatever a collective raises (``PeerFailed`` when a peer dies,
        ``SyncTimeout``, ...). Returns the summary (the FINAL line's fields) on
        every rank; ``summary["ranks_agree"]`` is False if parameters differ.
        """
        sync = sync if sync is not None else self.sync
        if sync is None:
            raise ConfigError("no GradSync: pass sync= to Trainer or to fit()")
        if (sync.rank, sync.world_size) != (self.rank, self.world_size):
            raise ConfigError(
                f"the GradSync is rank {sync.rank} of {sync.world_size}, the Trainer was "
                f"built for rank {self.rank} of {self.world_size}",
                hint="build the Trainer with the same rank/world_size (or the same environment)",
            )
        self._check_same_data(sync)
        strategy = self.strategy
        strategy.attach(self.model, self.optimizer, sync)
        strategy.begin(self.total_steps, self.step)
        metrics = None
        if self.metrics_path and self.rank == 0:
            metrics = MetricsWriter(self.metrics_path, resume_step=self.resumed_from)
        if self.tensorboard_dir and self.rank == 0:
            self._board = TensorBoardWriter(self.tensorboard_dir)
        bar = self._progress_bar()
        totals = {"compute_s": 0.0, "sync_s": 0.0, "checkpoint_s": 0.0, "checkpoints": 0}
        losses: deque[float] = deque(maxlen=LOSS_WINDOW)
        start_step, samples = self.step, 0
        begin = time.perf_counter()
        stats_begin = sync.stats["total"]
        counters_begin = sync.counters.snapshot()  # every request, heartbeats included
        batches = self._batches()
        every = self.checkpoint_every
        self.model.train()
        try:
            while strategy.keep_going(self.step, self.total_steps):
                done_before = strategy.progress(self.step)
                if strategy.wants_batch():
                    record = self._train_step(sync, *next(batches))
                else:  # nothing left for this rank in this window: join the sync idle
                    record = self._idle_step(sync)
                samples += record.pop("samples")
                if record["loss"] is not None:
                    losses.append(record["loss"])
                totals["compute_s"] += record["compute_s"]
                totals["sync_s"] += record["sync_s"]
                if metrics is not None:
                    metrics.write(record)
                self._board_write(record)
                for hook in self.step_hooks:
                    hook()
                if bar is not None:
                    self._update_bar(bar, record, samples, totals["sync_s"],
                                     time.perf_counter() - begin)
                # agreed progress and the agreed end: every rank checkpoints together
                done_now = strategy.progress(self.step)
                due = every and done_now // every > done_before // every
                last = not strategy.keep_going(self.step, self.total_steps)
                if due or (self.checkpoints is not None and last):
                    totals["checkpoint_s"] += self._save_checkpoint(sync)
                    totals["checkpoints"] += 1
            strategy.finish(self.model, self.optimizer)
        except BaseException:
            self._board_close(None)
            raise
        finally:
            _close(bar, metrics)
        wall = time.perf_counter() - begin
        summary = self._summarise(sync, (stats_begin, counters_begin), totals, losses, wall,
                                  samples, start_step)
        self._board_close(summary)
        if self.report and self.rank == 0:
            if not summary["ranks_agree"]:
                print(f"ferrosync.train: ranks ended with DIFFERENT parameters: "
                      f"{summary['rank_digests']}", file=sys.stderr, flush=True)
            print(format_summary(summary), flush=True)
            print(final_line(summary), flush=True)
        return summary

    def _check_same_data(self, sync) -> None:
        """Collective (``all_gather`` of ``fingerprint.SIZE`` bytes): every rank holds the
        same dataset, or every rank raises the same ``ConfigError`` before any step."""
        mine = torch.frombuffer(bytearray(self.data_fingerprint), dtype=torch.uint8)
        check_same_data([bytes(t.tolist()) for t in sync.all_gather(mine)], rank=sync.rank,
                        path=sync.url)

    def _board_write(self, record: dict) -> None:
        if self._board is not None:
            trained = record["loss"] is not None  # an idle step trained no batch
            self._board.write({**record,
                               "accuracy": self._batch_accuracy if trained else None})

    def _board_close(self, summary: dict | None) -> None:
        """The end's eval numbers (``summary``; None after a failure), then close."""
        board, self._board = self._board, None
        if board is not None:
            if summary is not None:
                board.final(summary)
            board.close()

    def _batches(self):
        """This rank's batches, epoch after epoch, for as long as the loop asks."""
        while True:
            self.sampler.set_epoch(self.epoch)  # keeps a resumed mid-epoch position
            yield from self.loader
            self.epoch, self.consumed = self.epoch + 1, 0

    def _train_step(self, sync, x, y) -> dict:
        start = time.perf_counter()
        before = sync.stats["total"]
        x = x.to(self.device, non_blocking=True) if isinstance(x, torch.Tensor) else x
        y = y.to(self.device, non_blocking=True) if isinstance(y, torch.Tensor) else y
        self.optimizer.zero_grad(set_to_none=True)
        output = self.model(x)
        loss = self.loss_fn(output, y)
        loss.backward()
        self._batch_accuracy = (_batch_accuracy(output, y) if self._board is not None
                                else None)
        telemetry = self.strategy.step(self.model, self.optimizer)
        loss_value = float(loss.detach())  # after the step: no extra device sync before it
        self.step += 1
        batch = len(y)
        self.consumed += batch
        return self._record(sync, start, before, telemetry, loss_value, batch)

    def _idle_step(self, sync) -> dict:
        """Take part in a sync without training (this rank's share is done for now);
        its metrics line repeats the step number with ``loss`` null."""
        start = time.perf_counter()
        before = sync.stats["total"]
        telemetry = self.strategy.synchronize(self.model, self.optimizer)
        return self._record(sync, start, before, telemetry, None, 0)

    def _record(self, sync, start, before, telemetry, loss, batch) -> dict:
        after = sync.stats["total"]
        step_s = time.perf_counter() - start
        sync_s = float(telemetry.get("sync_s", 0.0))
        return {
            "step": self.step,
            "epoch": self.epoch,
            "loss": loss,
            "lr": _float_or_none(self.optimizer.param_groups[0].get("lr")),
            "compute_s": max(step_s - sync_s, 0.0),
            "sync_s": sync_s,
            "bytes": (after["bytes_written"] - before["bytes_written"]
                      + after["bytes_read"] - before["bytes_read"]),
            "requests": after["requests"] - before["requests"],
            "synced": bool(telemetry.get("synced", False)),
            **{key: telemetry.get(key) for key in TELEMETRY_KEYS},
            "samples": batch,
        }

    def _progress_bar(self):
        if not (self.progress and self.rank == 0):
            return None
        from tqdm import tqdm

        # through a pipe (the launcher, a log file) redraw rarely instead of 10x a second
        interactive = sys.stderr.isatty() or _env_flag("FERROSYNC_TTY")
        return tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step",
                    file=sys.stderr, dynamic_ncols=interactive,
                    mininterval=0.2 if interactive else 5.0)

    def _update_bar(self, bar, record: dict, samples: int, sync_s: float,
                    elapsed: float) -> None:
        bar.set_postfix(loss=f"{record['loss'] or 0:.4f}",
                        samples_s=f"{samples * self.world_size / elapsed:,.0f}",
                        sync=f"{100 * sync_s / elapsed:.0f}%", refresh=False)
        bar.update(self.step - bar.n)

    def _summarise(self, sync, begin, totals, losses, wall, samples, start_step) -> dict:
        """Collective: evaluate, then gather every rank's digest, counters and loss.

        ``begin``: ``(stats, counters)`` when ``fit`` started."""
        stats_begin, counters_begin = begin
        counters = sync.counters.snapshot()
        requests = [counters.get(k, 0) - counters_begin.get(k, 0) for k in _REQUEST_KEYS]
        evaluation = {}
        if self.eval_fn is not None:
            self.model.eval()
            with torch.no_grad():
                evaluation = dict(self.eval_fn(self.model) or {})
        stats = sync.stats["total"]
        mine = RankReport(
            digest=param_digest(self.model),
            bytes_written=stats["bytes_written"], bytes_read=stats["bytes_read"],
            requests=stats["requests"],
            loss=sum(losses) / len(losses) if losses else math.nan,
            steps=self.step, samples=samples, storage_requests=tuple(requests))
        per_rank = [RankReport.unpack(g) for g in sync.all_gather(mine.pack())]
        digests = [r.digest.hex() for r in per_rank]
        rank_losses = [r.loss for r in per_rank if math.isfinite(r.loss)]
        phases = {p: stats[p] - stats_begin[p] for p in PHASES}
        steps_run = self.step - start_step
        accuracy = evaluation.get("accuracy")
        storage_requests = {k: int(sum(r.storage_requests[i] for r in per_rank))
                            for i, k in enumerate(_REQUEST_KEYS)}
        samples_total = sum(r.samples for r in per_rank)
        return {
            "steps": self.step,
            "epochs": self.step / self.steps_per_epoch,
            "world_size": self.world_size,
            "strategy": self.strategy.name,
            "loss": sum(rank_losses) / len(rank_losses) if rank_losses else None,
            "eval_loss": _float_or_none(evaluation.get("loss")),
            "accuracy": _float_or_none(accuracy),
            "param_digest": digests[self.rank],
            "rank_digests": digests,
            "ranks_agree": len(set(digests)) == 1,
            "bytes_written": int(sum(r.bytes_written for r in per_rank)),
            "bytes_read": int(sum(r.bytes_read for r in per_rank)),
            "requests": int(sum(r.requests for r in per_rank)),
            "rank_steps": [int(r.steps) for r in per_rank],
            "samples": int(samples_total),
            "samples_per_s": samples_total / wall if wall > 0 else 0.0,
            "wall_s": wall,
            "compute_s": totals["compute_s"],
            "sync_s": totals["sync_s"],
            **phases,
            "storage_requests": storage_requests,
            **hourly(storage_requests, wall,
                     parse_prices(self._storage_prices_given, sync.url),
                     billed=is_billed(sync.url)),
            "checkpoint_s": totals["checkpoint_s"],
            "checkpoints": totals["checkpoints"],
            "steps_this_run": steps_run,
            "resumed_from": self.resumed_from,
            **self.strategy.summary(),
        }


@dataclasses.dataclass(frozen=True)
class RankReport:
    """What each rank contributes to the summary, gathered in one ``all_gather``:
    the parameter digest (32 bytes) then the numbers as float64, in field order."""

    digest: bytes
    bytes_written: float
    bytes_read: float
    requests: float
    loss: float  # NaN: this rank trained no batch
    steps: float
    samples: float
    storage_requests: tuple  # one per _REQUEST_KEYS

    DIGEST_BYTES: ClassVar[int] = 32
    NUMBERS: ClassVar[tuple[str, ...]] = ("bytes_written", "bytes_read", "requests", "loss",
                                          "steps", "samples")

    def pack(self) -> torch.Tensor:
        numbers = torch.tensor([*(getattr(self, n) for n in self.NUMBERS),
                                *self.storage_requests], dtype=torch.float64)
        return torch.cat([torch.frombuffer(bytearray(self.digest), dtype=torch.uint8),
                          numbers.view(torch.uint8)])

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> RankReport:
        digest = bytes(packed[:cls.DIGEST_BYTES].tolist())
        values = packed[cls.DIGEST_BYTES:].clone().view(torch.float64).tolist()
        fixed = len(cls.NUMBERS)
        return cls(digest=digest, **dict(zip(cls.NUMBERS, values[:fixed])),
                   storage_requests=tuple(values[fixed:]))


def check_same_data(prints: list[bytes], *, rank: int | None = None, what: str = "rank",
                    path: str | None = None) -> None:
    """Raise the one ``ConfigError`` for ranks whose dataset fingerprints (in rank
    order) differ from rank 0's: the data factory is not deterministic."""
    differ = [r for r, p in enumerate(prints) if p != prints[0]]
    if not differ:
        return
    lengths = {r: length_of(prints[r]) if len(prints[r]) == SIZE else None
               for r in (0, *differ)}
    if len(set(lengths.values())) > 1:
        how = ", ".join(f"{n} samples on {what} {r}" for r, n in lengths.items())
    else:
        how = (f"{lengths[0]} samples each, but other samples on {what}"
               f"{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} than on "
               f"{what} 0")
    raise ConfigError(
        f"the {what}s built different datasets ({how}); every {what} must train on the "
        "same data, so the data factory (--data) must be deterministic", rank=rank, path=path,
        hint="seed every random generator it uses (e.g. torch.Generator().manual_seed(0) "
        "passed to torch.randn, numpy.random.default_rng(0), random.Random(0)), or load "
        "the data from a file")


def resolve_device(device, local_rank: int = 0) -> torch.device:
    """``device`` as a ``torch.device``; None means ``cuda:<local rank>`` if CUDA is
    available, else cpu. Raises ConfigError for a name torch rejects or missing CUDA."""
    if device is None:
        device = (f"cuda:{local_rank % torch.cuda.device_count()}"
                  if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"device {device!r} is not a torch device",
                          hint="use cpu, cuda or cuda:N") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} needs CUDA, which is not available here",
                          hint="drop --device to train on the CPU")
    return resolved


def _batch_accuracy(output, target) -> float | None:
    """The batch's share of ``argmax(output) == target`` for classification (class-index
    targets, one row of scores per sample), else None."""
    if not (isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor)
            and output.dim() == 2 and target.dim() == 1 and len(output) == len(target)
            and not target.is_floating_point() and target.dtype != torch.bool):
        return None
    with torch.no_grad():
        return float((output.argmax(dim=-1) == target).float().mean())


def _close(*outputs) -> None:
    """Close the progress bar and metrics writer a loop opened (either may be None)."""
    for output in outputs:
        if output is not None:
            output.close()


def derived_seed(seed: int, label) -> int:
    """A seed for one stream (a rank, a member, an epoch's order) derived from ``seed``.

    A hash, not seed + rank: runs with seeds 0 and 1 must not share streams."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{label}".encode(), digest_size=8).digest(),
                          "little") >> 1


def seed_streams(value: int) -> None:
    """Seed this process's training randomness: torch, ``random`` and NumPy."""
    torch.manual_seed(value)
    random.seed(value)
    numpy.random.seed(value % 2**32)


def _dataset_length(dataset) -> int:
    try:
        n = len(dataset)
    except TypeError:
        raise ConfigError("dataset must be sized (a map-style Dataset with __len__)",
                          hint="wrap an iterable dataset in a map-style one") from None
    if n == 0:
        raise ConfigError("dataset is empty")
    return n


def _check_callables(**functions) -> None:
    """``eval_fn`` may be None; the others must be given."""
    for name, fn in functions.items():
        if fn is not None and not callable(fn):
            raise ConfigError(f"{name} must be callable, got {type(fn).__name__}")


def _float_or_none(value) -> float | None:
    """A reported number (an optimizer's lr, ``eval_fn``'s results) for the summary:
    not a check (``validate.number`` would refuse a tensor or NumPy scalar, which
    ``float`` takes), and a non-finite one is reported as null, not refused."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")
