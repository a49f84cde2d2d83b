"""``Trainer``: a data-parallel training loop over a ``GradSync``, with checkpoints.

``fit`` is the package's one training loop: forward, backward, telemetry and
checkpoints, with synchronisation left to a ``Strategy`` (default ``GradAveraging``);
the elastic trainer overrides only its hooks (``_start``, ``_next_batch``,
``_at_boundary``, ``_keep_going``, ``_finish``, ``_end``). What makes ``--resume``
bit-exact on CPU: docs/train.md#checkpoints-and-resuming.
"""

from __future__ import annotations

import hashlib
import random
import sys
import time
import warnings
from typing import Callable

import numpy
import torch

from ferrosync.core.env import discover
from ferrosync.core.validate import integer
from ferrosync.errors import ConfigError
from ferrosync.partition import ShardSampler
from ferrosync.storage.costs import parse_prices
from ferrosync.strategies import TELEMETRY_KEYS, GradAveraging, Strategy
from ferrosync.train.batching import batch_loader
from ferrosync.train.checkpoint import (
    NEW_RUN,
    Checkpoints,
    capture_rng,
    check_compatible,
    model_signature,
    restore_rng,
)
from ferrosync.train.fingerprint import check_same_data, fingerprint
from ferrosync.train.metrics import (
    PathClaim,
    final_line,
    format_summary,
    param_digest,
    require_tensorboard,
)
from ferrosync.train.run_log import LOSS_WINDOW, RunLog
from ferrosync.train.summary import float_or_none, summarise

__all__ = ["Trainer", "resolve_device", "LOSS_WINDOW"]


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
        metrics_path: rank 0 writes one JSON line per step there (a local path;
            another live process writing it on this host is a ConfigError, here).
        metrics_digest: every line of a step that synced also carries
            ``param_digest`` (``metrics.param_digest``, hex): what ranks, or members
            of an elastic job, that finished the same round must agree on.
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

    #: False: rank 0 writes the metrics file and TensorBoard and prints the summary
    #: for all ranks. True (an elastic job): every member writes its own and reports.
    per_member = False

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
        metrics_digest: bool = False,
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
        epochs, steps, self.checkpoint_every = (
            integer(name, value, minimum=1, allow_none=True) for name, value in
            (("epochs", epochs), ("steps", steps), ("checkpoint_every", checkpoint_every)))
        self.keep_checkpoints = integer("keep_checkpoints", keep_checkpoints, minimum=1)
        if epochs is None and steps is None:
            raise ConfigError("give epochs or steps (or both: whichever ends first)")
        self.seed = integer("seed", seed)
        parse_prices(storage_prices)  # checked now; priced per store (summary.job_rates)
        self.storage_prices_given = storage_prices
        if (checkpoint_every or resume) and not checkpoint_dir:
            raise ConfigError("checkpoint_every and resume need checkpoint_dir",
                              hint="pass --checkpoint-dir DIR_OR_URL")
        _check_callables(model_fn=model_fn, optimizer_fn=optimizer_fn, loss_fn=loss_fn,
                         eval_fn=eval_fn)
        n = _dataset_length(dataset)
        self.strategy = _strategy(strategy)
        if tensorboard_dir is not None:
            require_tensorboard()  # a missing package is bad input, found before any I/O
        if sync is not None:
            rank, world_size = sync.rank, sync.world_size
        identity = discover(rank, world_size)
        self.rank, self.world_size = identity.rank, identity.world_size
        self.sync, self.loss_fn, self.eval_fn = sync, loss_fn, eval_fn
        self.metrics_path, self.tensorboard_dir = metrics_path, tensorboard_dir
        self.metrics_digest = bool(metrics_digest)
        if metrics_path and (self.per_member or self.rank == 0):
            self._metrics_claim = PathClaim(metrics_path)  # another writer: refused now
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
        self.checkpoints = (Checkpoints(checkpoint_dir, storage_options)
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
                hint=f"resume with the settings that wrote it, or {NEW_RUN}",
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
        rank_files = {}
        if per_rank:
            # parameters, inner optimizer state and data position differ per rank
            nbytes, digest = self.checkpoints.save_rank(step, self.rank, own)
            # a barrier that carries each rank file's size and checksum: every rank file
            # exists before latest.json can name the step, and latest.json declares what
            # each holds (a reader is held to it), whatever a listing would show
            mine = torch.tensor([nbytes, int.from_bytes(bytes.fromhex(digest), "little",
                                                        signed=True)], dtype=torch.int64)
            rank_files = {self.checkpoints.rank_key(step, k): (
                int(t[0]), int(t[1]).to_bytes(8, "little", signed=True).hex())
                for k, t in enumerate(sync.all_gather(mine))}
        if self.rank == 0:
            state = {**own, "strategy": self.strategy.state_dict(), "rng": rng}
            meta = {"step": step, "epoch": epoch, "world_size": self.world_size,
                    "strategy": self.strategy.name, "batch_size": self.batch_size,
                    "seed": self.seed, "model": model_signature(self.model),
                    "rank_files": per_rank}
            self.checkpoints.save(state, meta, keep=self.keep_checkpoints,
                                  rank_files=rank_files)
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
        ended = self._start(sync)        # checks, the strategy; an elastic member joins
        if ended is not None:            # an elastic job that ended before this member
            return ended
        self._log = log = RunLog(self, sync)  # metrics file, TensorBoard, progress, totals
        self.model.train()
        try:
            while self._keep_going():
                if self.strategy.wants_batch():
                    record = self._train_step(sync, *self._next_batch(sync), log)
                else:  # nothing left for this rank in this window: join the sync idle
                    record = self._idle_step(sync)
                log.step(record, world_size=self.world_size, accuracy=self._batch_accuracy)
                # a checkpoint when one is due; an elastic member publishes, or leaves
                log.saved(self._at_boundary(sync, record))
            self._finish(sync)
        except BaseException:
            log.close(None)
            raise
        log.stop()
        summary = self._end(sync, summarise(self, sync, log), log)
        log.close(summary)
        return self._report(summary)

    # -- the loop's hooks (ElasticTrainer overrides them) --------------------------------
    def _start(self, sync) -> dict | None:
        """Collective, before the first step: the sync fits this trainer, every rank
        holds the same data, the strategy is attached (rank 0's model everywhere).
        Returns None: train (an elastic member returns the report of a job that had
        ended before it came)."""
        if (sync.rank, sync.world_size) != (self.rank, self.world_size):
            raise ConfigError(
                f"the GradSync is rank {sync.rank} of {sync.world_size}, the Trainer was "
                f"built for rank {self.rank} of {self.world_size}",
                hint="build the Trainer with the same rank/world_size (or the same environment)",
            )
        mine = torch.frombuffer(bytearray(self.data_fingerprint), dtype=torch.uint8)
        check_same_data([bytes(t.tolist()) for t in sync.all_gather(mine)], rank=sync.rank,
                        path=sync.url)
        self.attach_strategy(sync)
        self._stream = self._batches()
        self._saved_at = self.strategy.progress(self.step)  # the last checkpoint's progress
        return None

    @property
    def running(self) -> bool:
        """Whether ``fit`` is training: from its first step to its summary."""
        log = getattr(self, "_log", None)  # made by fit
        return log is not None and log.open

    def attach_strategy(self, sync) -> None:
        """Collective (as the strategy's ``attach``): attach the strategy to this
        trainer's model, optimizer and ``sync`` and start its schedule at the current
        step; ``fit`` does it before the first step."""
        self.strategy.attach(self.model, self.optimizer, sync)
        self.strategy.begin(self.total_steps, self.step)

    def _keep_going(self) -> bool:
        return self.strategy.keep_going(self.step, self.total_steps)

    def _next_batch(self, sync):
        """This rank's next ``(input, target)``: its shard, epoch after epoch."""
        return next(self._stream)

    def _at_boundary(self, sync, record: dict) -> float | None:
        """Collective, after every step: a checkpoint when the agreed progress crossed a
        multiple of ``checkpoint_every``, and at the end. Its seconds, or None."""
        if self.checkpoints is None:
            return None
        done = self.strategy.progress(self.step)  # the same on every rank
        every = self.checkpoint_every
        if not (every and done // every > self._saved_at // every) and self._keep_going():
            return None
        self._saved_at = done
        return self._save_checkpoint(sync)

    def _finish(self, sync) -> None:
        """Collective, after the last step: every rank ends with the same model."""
        self.strategy.finish(self.model, self.optimizer)

    def _end(self, sync, summary: dict, log: RunLog) -> dict:
        """After the summary round: what the summary still needs (nothing here)."""
        return summary

    def _report(self, summary: dict) -> dict:
        """Rank 0 (every member of an elastic job) prints the summary table and the
        ``FINAL`` line."""
        if self.report and (self.per_member or self.rank == 0):
            if not summary["ranks_agree"]:
                print(f"ferrosync.train: {'members' if self.per_member else 'ranks'} ended "
                      f"with DIFFERENT parameters: {summary['rank_digests']}",
                      file=sys.stderr, flush=True)
            if self.rank == 0:
                print(format_summary(summary), flush=True)
            print(final_line(summary), flush=True)
        return summary

    # -- one step ----------------------------------------------------------------------
    def _batches(self):
        """This rank's batches, epoch after epoch, for as long as the loop asks."""
        while True:
            self.sampler.set_epoch(self.epoch)  # keeps a resumed mid-epoch position
            yield from self.loader
            self.epoch, self.consumed = self.epoch + 1, 0

    def _train_step(self, sync, x, y, log: RunLog) -> dict:
        start = time.perf_counter()
        before = sync.stats["total"]
        x = x.to(self.device, non_blocking=True) if isinstance(x, torch.Tensor) else x
        y = y.to(self.device, non_blocking=True) if isinstance(y, torch.Tensor) else y
        self.optimizer.zero_grad(set_to_none=True)
        output = self.model(x)
        loss = self.loss_fn(output, y)
        loss.backward()
        self._batch_accuracy = _batch_accuracy(output, y) if log.wants_accuracy else None
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
        """The step's metrics line (``metrics.py``), plus ``samples`` for the totals."""
        after = sync.stats["total"]
        step_s = time.perf_counter() - start
        sync_s = float(telemetry.get("sync_s", 0.0))
        synced = bool(telemetry.get("synced", False))
        digest = {}
        if self.metrics_digest:  # between syncs the ranks' models may differ: no digest
            digest["param_digest"] = param_digest(self.model).hex() if synced else None
        return {
            "step": self.step,
            "epoch": self.epoch,
            "loss": loss,
            "lr": float_or_none(self.optimizer.param_groups[0].get("lr")),
            "compute_s": max(step_s - sync_s, 0.0),
            "sync_s": sync_s,
            "bytes": (after["bytes_written"] - before["bytes_written"]
                      + after["bytes_read"] - before["bytes_read"]),
            "requests": after["requests"] - before["requests"],
            "synced": synced,
            **{key: telemetry.get(key) for key in TELEMETRY_KEYS},
            **digest,
            "samples": batch,
        }


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


def _strategy(strategy) -> Strategy:
    """``strategy``, by default ``GradAveraging()``; a ConfigError if it is not one."""
    strategy = strategy if strategy is not None else GradAveraging()
    if not isinstance(strategy, Strategy):
        raise ConfigError(f"strategy must be a ferrosync.strategies.Strategy, got "
                          f"{type(strategy).__name__}")
    return strategy


def _check_callables(**functions) -> None:
    """``eval_fn`` may be None; the others must be given."""
    for name, fn in functions.items():
        if fn is not None and not callable(fn):
            raise ConfigError(f"{name} must be callable, got {type(fn).__name__}")
