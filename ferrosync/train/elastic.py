"""``ElasticTrainer``: the built-in training loop for a member of an elastic job
(``python -m ferrosync.train --elastic``; docs/elastic.md#the-trainer).

Every process is one member of the job at the sync URL; members start, die and
leave whenever they do. What keeps them one model:

* **Global steps.** ``--steps`` counts the job's steps. Every member takes its step
  k at the same collective round, so the step count, the data position and the
  end are agreed without a message: they advance identically on every member.
* **Data.** Each epoch is one permutation of the dataset drawn from ``(seed,
  epoch)``. A step takes the next ``members * batch_size`` samples and member k of
  the current roster trains on the k-th ``batch_size`` of them, so the members'
  shards of every step are disjoint and follow the membership (``GlobalBatches``).
* **Bootstrap through the store.** After every round that admits newcomers (and
  every ``publish_every`` steps, and at the end) rank 0 publishes the whole
  training state (model, optimizer, strategy, step, data position) with
  ``publish_state``. A newcomer reads exactly the state after the round that
  admitted it and makes its first collective in the next round, so the members wait
  for it for at most one of its steps. If no such state comes (the publisher is
  gone, or half the timeout passed), it leaves gracefully and joins again
  (``RejoinNeeded``).
* **Founding.** Members admitted by a roster none of whose members contributed to it start the
  job, or restart it after every member went: they resume from the newest
  published state (any number of members), else from ``seed``, and take rank 0's
  copy in one round (an average in which only rank 0 has weight, so a founder that
  dies meanwhile cannot stop it).
* **Policy when the membership changes** under ``grad``: the batch per member is
  fixed, so the global batch is ``members * batch_size``; the learning rate is not
  rescaled (the average is a mean, so the gradient's scale does not change with
  the member count, only its noise). ``local-sgd``/``diloco`` merge every H steps
  with each member weighted by its steps in the window (H for everyone).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from collections import deque

import torch

from ..costs import hourly, is_billed
from ..errors import ConfigError, PeerFailed, RejoinNeeded, SyncTimeout
from ..stats import PHASES
from ..strategies import DiLoCo, GradAveraging, LocalSGD
from .batching import batch_of
from .metrics import MetricsWriter, TensorBoardWriter, final_line, format_summary
from .state_tree import flatten, unflatten
from .trainer import (
    LOSS_WINDOW,
    Trainer,
    _close,
    check_same_data,
    derived_seed,
    seed_streams,
)

__all__ = ["ElasticTrainer", "GlobalBatches", "RejoinNeeded", "ELASTIC_STRATEGIES"]

#: the strategies an elastic job can run: one collective per sync, lockstep
ELASTIC_STRATEGIES = (GradAveraging, LocalSGD, DiLoCo)
#: ``meta["phase"]`` of a published state: training goes on; the last step is done
#: (the summary round comes next); the summary round is done too
TRAINING, FINISHED, SUMMARISED = "training", "finished", "summarised"


class GlobalBatches:
    """The job's data stream: each step takes the next ``world * batch_size`` samples
    of the epoch's permutation and member ``rank`` trains on its slice of them.

    ``epoch`` and ``position`` are the whole state; every member advances them
    identically (same world size each step), and a newcomer takes them from the
    published state. An epoch's tail shorter than a global batch is skipped.
    """

    def __init__(self, dataset, n: int, batch_size: int, seed: int) -> None:
        self.dataset, self.n, self.batch_size, self.seed = dataset, n, batch_size, seed
        self.epoch, self.position = 0, 0
        self._order: tuple[int, torch.Tensor] | None = None

    def take(self, rank: int, world_size: int):
        span = world_size * self.batch_size
        if span > self.n:
            raise ConfigError(f"{world_size} members x batch size {self.batch_size} is more "
                              f"than the {self.n} samples of the dataset", rank=rank,
                              hint="lower --batch-size or --max-ranks")
        if self.position + span > self.n:
            self.epoch, self.position = self.epoch + 1, 0
        order = self._permutation()
        start = self.position + rank * self.batch_size
        self.position += span
        return batch_of(self.dataset, order[start:start + self.batch_size])

    def _permutation(self) -> torch.Tensor:
        if self._order is None or self._order[0] != self.epoch:
            g = torch.Generator().manual_seed(derived_seed(self.seed, f"epoch{self.epoch}"))
            self._order = (self.epoch, torch.randperm(self.n, generator=g))
        return self._order[1]


class ElasticTrainer(Trainer):
    """Train as one member of an elastic job. Arguments as ``Trainer``, except:

    Args:
        steps: the job's global steps (``epochs`` converts at ``min_ranks`` members).
        min_ranks: only for converting ``epochs`` to steps.
        publish_every: rank 0 also publishes the state every this many steps (what
            a job restarted after losing every member resumes from); the state is
            always published after a round that admits newcomers and at the end.
        metrics_path: this member writes its own file (``members`` on every line).

    There are no checkpoint or resume arguments: the published state is the
    checkpoint, and a job whose members all went resumes from it by itself.
    """

    def __init__(self, model_fn, optimizer_fn, loss_fn, dataset, *, min_ranks: int = 1,
                 publish_every: int | None = None, **kwargs) -> None:
        self.min_ranks = min_ranks
        self.publish_every = publish_every
        super().__init__(model_fn, optimizer_fn, loss_fn, dataset, rank=0, world_size=1,
                         **kwargs)
        if not isinstance(self.strategy, ELASTIC_STRATEGIES):
            raise ConfigError(f"--elastic runs --strategy grad, local-sgd or diloco, not "
                              f"{self.strategy.name}",
                              hint="pick one of those (one merge per sync)")
        if not self.strategy.lockstep:
            raise ConfigError("--sync-every-seconds needs a fixed membership: an elastic "
                              "job merges every --sync-every H global steps",
                              hint="use --sync-every H")
        self.membership_changes = 0
        self.joined_at: int | None = None

    def _build_data(self, dataset, n, num_workers, *, epochs, steps) -> None:
        self.data = GlobalBatches(dataset, n, self.batch_size, self.seed)
        self.steps_per_epoch = n // (self.batch_size * self.min_ranks)
        if self.steps_per_epoch < 1:
            raise ConfigError(f"--min-ranks {self.min_ranks} x batch size {self.batch_size} "
                              f"is more than the {n} samples of the dataset",
                              hint="lower --batch-size")
        self.total_steps = min(s for s in (steps, epochs and epochs * self.steps_per_epoch)
                               if s)

    # -- the job's record and state ---------------------------------------------------
    def job_spec(self) -> dict:
        """What every member of the job must agree on, for ``connect(spec=...)``: a
        newcomer whose spec differs is refused before it writes anything (the job's
        record, docs/elastic.md#joining). The model's structure (not only its shapes),
        the optimizer and its settings (the learning rate), the strategy and its
        settings, the global steps, the batch size and the seed. Taken once, before
        training: a rejoin compares the configuration, not the optimizer's state."""
        if getattr(self, "_spec", None) is not None:
            return self._spec
        optimizer = {"class": type(self.optimizer).__name__,
                     "groups": [{k: _plain(v) for k, v in sorted(g.items()) if k != "params"}
                                for g in self.optimizer.param_groups]}
        strategy = {"name": self.strategy.name,
                    **{k: _plain(getattr(self.strategy, k, None))
                       for k in self.strategy.settings}}
        self._spec = {"model": model_fingerprint(self.model), "optimizer": optimizer,
                      "strategy": strategy, "total_steps": self.total_steps,
                      "batch_size": self.batch_size, "seed": self.seed}
        return self._spec

    # -- the job's state -------------------------------------------------------------
    def _state(self, phase: str, changes: int) -> tuple[dict, dict]:
        tensors, skeleton = {}, {}
        for part, tree in (("model", self.model.state_dict()),
                           ("optimizer", self.optimizer.state_dict()),
                           ("strategy", self.strategy.state_dict())):
            named, skeleton[part] = flatten(tree, part)
            tensors.update(named)
        meta = {"step": self.step, "epoch": self.data.epoch, "position": self.data.position,
                "phase": phase, "membership_changes": changes, "skeleton": skeleton,
                "strategy": self.strategy.name, "batch_size": self.batch_size,
                "seed": self.seed, "total_steps": self.total_steps,
                "data": self.data_fingerprint.hex()}
        return tensors, meta

    def _load(self, state, url: str, rank: int | None) -> str:
        """Adopt a published state; its phase. ConfigError if it is another job's."""
        meta = state.meta
        mine = {"strategy": self.strategy.name, "batch_size": self.batch_size,
                "seed": self.seed, "total_steps": self.total_steps}
        differ = {k: (meta.get(k), v) for k, v in mine.items() if meta.get(k) != v}
        if differ:
            text = ", ".join(f"{k} {theirs!r} (here {ours!r})" for k, (theirs, ours)
                             in differ.items())
            raise ConfigError(f"the elastic job at {url} runs with {text}",
                              rank=rank, path=url,
                              hint="start every member with the same flags (or use "
                              "another job id / URL)")
        if "data" in meta:  # a newcomer trains on the data the job trained on
            try:
                theirs = bytes.fromhex(str(meta["data"]))
            except ValueError:
                theirs = b""  # not a fingerprint: it cannot match
            check_same_data([theirs, self.data_fingerprint], rank=rank, what="member",
                            path=url)
        try:
            trees = {part: unflatten(meta["skeleton"][part], state.tensors)
                     for part in ("model", "optimizer", "strategy")}
            self.model.load_state_dict(trees["model"])
            self.optimizer.load_state_dict(trees["optimizer"])
            self.strategy.load_state_dict(trees["strategy"])
            self.step = int(meta["step"])
            self.data.epoch, self.data.position = int(meta["epoch"]), int(meta["position"])
            self.membership_changes = int(meta["membership_changes"])
            phase = meta["phase"]
        except (KeyError, IndexError, ValueError, RuntimeError, TypeError) as exc:
            raise ConfigError(
                f"the state published at {url} (round {state.round}) does not fit this "
                f"member ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
                rank=rank, path=url,
                hint="start every member with the same --model and --optimizer") from None
        if phase not in (TRAINING, FINISHED, SUMMARISED):
            raise ConfigError(f"the published state has an unknown phase {phase!r}",
                              rank=rank, path=url)
        return phase

    def _bootstrap(self, sync) -> str:
        """Collective for founders (one round), local for a newcomer: start from the
        job's state. Returns the phase to continue from. Publishes nothing: the
        strategy's state exists only once it is attached (``fit`` publishes then)."""
        founding = sync.founding
        # the largest state this model can have: the model, and per parameter byte the
        # optimizer's and the strategy's copies (AdamW: 2, DiLoCo: 2) with room to spare
        model_bytes = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        bound = 8 * model_bytes + (16 << 20)
        if founding:
            state = sync.read_state(max_bytes=bound)
        else:
            try:  # rank 0 publishes it after the round that admitted this member
                state = sync.read_state(min_round=sync.round, publisher=sync.membership[0],
                                        timeout=sync.timeout / 2, max_bytes=bound)
            except (SyncTimeout, PeerFailed) as exc:
                raise RejoinNeeded(str(exc), path=sync.url,
                                   hint="connect again as a new member") from exc
            if state.round != sync.round:  # only after being dropped: start over
                raise RejoinNeeded(f"the state is from round {state.round}, this member was "
                                   f"admitted in round {sync.round}")
        phase = self._load(state, sync.url, sync.rank) if state is not None else TRAINING
        self.joined_at = self.step
        if founding and phase != TRAINING:
            return SUMMARISED  # the job is over: report it, touch nothing
        if founding:
            # rank 0's start for everyone: only rank 0 has weight in this average
            with torch.no_grad():
                tensors = [t.detach() for t in self.model.state_dict().values()
                           if t.is_floating_point()]
                sync.average_(tensors, weight=1.0 if sync.rank == 0 else 0.0)
        return phase

    def _changes(self, sync) -> int:
        """The job's membership changes: counted in its rosters, the same on every
        member and over the job's whole life (a restart after every member was lost
        continues the count)."""
        return sync.membership_changes

    def _after_round(self, sync, phase: str) -> None:
        """Every member after a round: rank 0 publishes the state when newcomers need
        it, when ``publish_every`` says so, or at the end."""
        every = self.publish_every
        due = every and self.step // every > self._published // every
        if sync.rank == 0 and (sync.newcomers or due or phase != TRAINING):
            tensors, meta = self._state(phase, self._changes(sync))
            sync.publish_state(tensors, meta)
            self._published = self.step

    # -- the loop --------------------------------------------------------------------
    def fit(self, sync=None) -> dict:
        """Train as a member until the job's last step; the summary (FINAL's fields).

        Collective among the members of each round (see the module docstring).
        Raises ``RejoinNeeded`` when this newcomer must connect again, and whatever a
        collective raises (``PeerFailed`` if this member was dropped, ``SyncTimeout``
        below ``min_ranks``)."""
        sync = sync if sync is not None else self.sync
        if sync is None or not getattr(sync, "elastic", False):
            raise ConfigError("ElasticTrainer.fit needs connect(..., elastic=True)")
        # training randomness (dropout, augmentation) differs per member
        seed_streams(derived_seed(self.seed, sync.member_id))
        self._published = -1
        founding = sync.founding  # before the bootstrap's round changes it
        phase = self._bootstrap(sync)
        if phase == SUMMARISED:  # the job had ended before this member came
            return self._report(self._ended_summary(sync.url), rank=0)
        self.rank, self.world_size = sync.rank, sync.world_size
        strategy = self.strategy
        strategy.attach(self.model, self.optimizer, sync)  # elastic: broadcasts nothing
        strategy.begin(self.total_steps, self.step)
        if founding:
            # after attach: a strategy's state (DiLoCo's global copy and outer
            # optimizer) exists only from there, and --publish-every is due at once
            self._after_round(sync, TRAINING)
        metrics = (MetricsWriter(self.metrics_path, resume_step=self.step)
                   if self.metrics_path else None)
        if self.tensorboard_dir:  # every member writes its own, like its metrics file
            self._board = TensorBoardWriter(self.tensorboard_dir)
        bar = self._progress_bar()
        totals = {"compute_s": 0.0, "sync_s": 0.0, "checkpoint_s": 0.0, "checkpoints": 0}
        losses: deque[float] = deque(maxlen=LOSS_WINDOW)
        samples, start_step = 0, self.step
        begin = time.perf_counter()
        stats_begin, counters_begin = sync.stats["total"], sync.counters.snapshot()
        self.model.train()
        try:
            while phase == TRAINING and self.step < self.total_steps:
                rank, world = sync.rank, sync.world_size  # this step's shards
                record = self._train_step(sync, *self.data.take(rank, world))
                self.epoch = self.data.epoch
                samples += record.pop("samples")
                losses.append(record["loss"])
                totals["compute_s"] += record["compute_s"]
                totals["sync_s"] += record["sync_s"]
                if record["synced"]:
                    self._after_round(sync, TRAINING)
                if metrics is not None:
                    metrics.write({**record, "members": world})
                self._board_write({**record, "members": world})
                for hook in self.step_hooks:
                    hook()
                self.rank, self.world_size = sync.rank, sync.world_size
                if bar is not None:
                    self._update_bar(bar, record, samples, totals["sync_s"],
                                     time.perf_counter() - begin)
            if phase == TRAINING:
                strategy.finish(self.model, self.optimizer)
                phase = FINISHED
                self._after_round(sync, FINISHED)
        except BaseException:
            self._board_close(None)
            raise
        finally:
            _close(bar, metrics)
        wall = time.perf_counter() - begin
        self.rank, self.world_size = sync.rank, sync.world_size
        summary = self._summarise(sync, (stats_begin, counters_begin), totals, losses, wall,
                                  samples, start_step)
        # the rates are the job's: the summed counts over the longest member's time, the
        # same numbers on every member (one more round: every member's wall time)
        walls = sync.all_gather(torch.tensor([wall], dtype=torch.float64))
        job_wall = max(float(w[0]) for w in walls)
        summary.update(hourly(summary["storage_requests"], job_wall, self.storage_prices,
                              billed=is_billed(sync.url)),
                       samples_per_s=summary["samples"] / job_wall if job_wall > 0 else 0.0,
                       job_wall_s=job_wall)
        self._after_round(sync, SUMMARISED)
        sync.end_job()  # later comers report instead of waiting for a round
        summary.update(epochs=self.data.epoch + self.data.position / self.data.n,
                       membership_changes=self._changes(sync), members=sync.world_size,
                       joined_at_step=self.joined_at, elastic=True)
        self._board_close(summary)
        return self._report(summary, rank=sync.rank)

    def report_ended(self, state, url: str) -> dict:
        """Report a job that ended before this process could join it, from its
        published state (``JobEnded`` from connect): no collective, nothing written."""
        if state is None:
            raise ConfigError(f"the elastic job at {url} ended without publishing its state",
                              path=url, hint="start another job (another job id or URL)")
        self._load(state, url, None)
        self.joined_at = self.step
        return self._report(self._ended_summary(url), rank=0)

    def _ended_summary(self, url: str) -> dict:
        """The summary of a finished job's model as this process holds it, alone."""
        totals = {"compute_s": 0.0, "sync_s": 0.0, "checkpoint_s": 0.0, "checkpoints": 0}
        summary = self._summarise(_Alone(url), (_Alone.STATS, {}), totals, [], 0.0, 0,
                                  self.step)
        summary.update(epochs=self.data.epoch + self.data.position / self.data.n,
                       membership_changes=self.membership_changes, members=0,
                       joined_at_step=self.joined_at, elastic=True)
        return summary

    def _report(self, summary: dict, rank: int) -> dict:
        if self.report:
            if not summary["ranks_agree"]:
                print(f"ferrosync.train: members ended with DIFFERENT parameters: "
                      f"{summary['rank_digests']}", file=sys.stderr, flush=True)
            if rank == 0:
                print(format_summary(summary), flush=True)
            print(final_line(summary), flush=True)
        return summary


class _Alone:
    """Stands in for the sync when a process reports a job that had already ended:
    no collective, no traffic."""

    STATS = {"bytes_written": 0, "bytes_read": 0, "requests": 0,
             **{phase: 0.0 for phase in PHASES}}

    def __init__(self, url: str) -> None:
        self.url = url
        self.stats = {"total": dict(self.STATS)}
        self.counters = _NoCounters()

    def all_gather(self, tensor):
        return [tensor]


class _NoCounters:
    def snapshot(self) -> dict:
        return {}


def model_fingerprint(model: torch.nn.Module) -> str:
    """A digest of the module tree: every submodule's name and class, every parameter's
    and buffer's name, shape and dtype. Two models with the same parameter shapes but
    another activation module (``nn.ReLU`` against ``nn.Tanh``) differ; a functional
    call inside ``forward`` is not seen."""
    tree = [[name, f"{type(m).__module__}.{type(m).__qualname__}"]
            for name, m in model.named_modules()]
    tensors = [[name, list(t.shape), str(t.dtype)] for name, t in
               [*model.named_parameters(), *model.named_buffers()]]
    text = json.dumps({"modules": tree, "tensors": tensors}, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _plain(value):
    """``value`` as plain JSON for the job's spec (tuples as lists, others by repr)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return _plain(value.item())
    return repr(value)


def metrics_path_for(path: str | None) -> str | None:
    """Each local member of ``--nproc N --elastic`` writes its own file (or TensorBoard
    directory): ``PATH.K``."""
    if path is None or int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1) <= 1:
        return path
    return f"{path}.{os.environ.get('LOCAL_RANK', '0')}"

