"""``ElasticTrainer``: the built-in trainer as one member of an elastic job
(``python -m ferrosync.train --elastic``; docs/elastic.md#the-trainer).

It runs ``Trainer.fit`` and overrides only the loop's hooks: ``_next_batch`` (data that
follows the membership, ``GlobalBatches``), ``_start`` (join the job's state),
``_at_boundary`` (publish the state, leave on a vote) and ``_finish``/``_end``. Global
steps, data, bootstrap, founding, leaving and the policy when the membership changes:
docs/elastic.md#the-trainer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
import time
import types

import torch

from ferrosync.core.stats import PHASES
from ferrosync.elastic.ballot import LeaveBallot
from ferrosync.errors import ConfigError, PeerFailed, RejoinNeeded, SyncTimeout
from ferrosync.strategies import DiLoCo, GradAveraging, LocalSGD
from ferrosync.train.batching import batch_of
from ferrosync.train.fingerprint import check_same_data
from ferrosync.train.metrics import final_line, param_digest
from ferrosync.train.state_tree import flatten, unflatten
from ferrosync.train.summary import job_rates, summarise
from ferrosync.train.trainer import Trainer, derived_seed, seed_streams

__all__ = ["ElasticTrainer", "GlobalBatches", "MemberLeft", "Publishing", "RejoinNeeded",
           "ELASTIC_STRATEGIES", "PUBLISH_EVERY_SECONDS"]

#: the strategies an elastic job can run: one collective per sync, lockstep
ELASTIC_STRATEGIES = (GradAveraging, LocalSGD, DiLoCo)
#: ``meta["phase"]`` of a published state: training goes on; the last step is done
#: (the summary round comes next); the summary round is done too
TRAINING, FINISHED, SUMMARISED = "training", "finished", "summarised"
#: rank 0 publishes the state at the first round boundary this long after its last
#: publish (``--publish-every-seconds``): what a job that loses every member at once
#: without warning (SIGKILL) retrains at most; the cost is in docs/elastic.md
PUBLISH_EVERY_SECONDS = 300.0


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


@dataclasses.dataclass
class Publishing:
    """When rank 0 publishes the job's state besides joins, leaves and the end: every
    ``every`` global steps (``--publish-every``) and at the first round boundary
    ``seconds`` after its last publish (``--publish-every-seconds``; 0 or None: off)."""

    every: int | None = None
    seconds: float | None = PUBLISH_EVERY_SECONDS
    step: int = 0     # the step of the last publish (or where this member started)
    at: float = 0.0   # and when (time.monotonic)

    def due(self, step: int, now: float) -> bool:
        by_steps = bool(self.every) and step // self.every > self.step // self.every
        by_clock = bool(self.seconds) and now - self.at >= self.seconds
        return by_steps or by_clock

    def done(self, step: int, now: float) -> None:
        self.step, self.at = step, now


class MemberLeft(Exception):
    """Raised by ``ElasticTrainer.fit`` when the member was asked to leave
    (``request_leave``) and did: it finished its round at global ``step`` and, if it
    was rank 0, published the state first (``published``). Not a failure: close the
    sync without an error (outside the ``with connect(...)`` block's exception path)
    so the others read "left" at once."""

    def __init__(self, member: str, step: int, rank: int, published: bool) -> None:
        self.member, self.step, self.rank, self.published = member, step, rank, published
        super().__init__(str(self))

    def __str__(self) -> str:
        how = (f"it published the job's state at step {self.step} first" if self.published
               else f"as rank {self.rank} it published nothing: rank 0 publishes")
        return (f"member {self.member} left the job at step {self.step}, its round "
                f"finished; {how}")


class ElasticTrainer(Trainer):
    """Train as one member of an elastic job. Arguments as ``Trainer``, except:

    Args:
        steps: the job's global steps (``epochs`` converts at ``min_ranks`` members).
        min_ranks: only for converting ``epochs`` to steps.
        publish_every: rank 0 also publishes the state every this many steps (what
            a job restarted after losing every member resumes from).
        publish_every_seconds: and at the first round boundary this long after its
            last publish (default ``PUBLISH_EVERY_SECONDS``; 0 or None: off). The
            state is always published after a round that admits newcomers, when rank
            0 leaves (``request_leave``) and at the end.
        metrics_path: this member writes its own file (``members`` on every line).

    There are no checkpoint or resume arguments: the published state is the
    checkpoint, and a job whose members all went resumes from it by itself.
    """

    per_member = True

    def __init__(self, model_fn, optimizer_fn, loss_fn, dataset, *, min_ranks: int = 1,
                 publish_every: int | None = None,
                 publish_every_seconds: float | None = PUBLISH_EVERY_SECONDS,
                 **kwargs) -> None:
        self.min_ranks = min_ranks
        self.publishing = Publishing(publish_every, publish_every_seconds)
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
        self._phase = TRAINING
        self._leave_asked = self._stalled = False
        #: this member's vote to leave, riding in the strategy's syncs
        self.ballot = LeaveBallot()
        self.strategy.carry(self.ballot)
        self._members = None  # the sync's latest MembershipChange (on_membership)
        self._resumed: str | None = None  # the digest the first line after joining carries
        self._published = [0, 0.0]  # states this member published, and their seconds

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
        """The job's state for ``publish_state``: its tensors by name, and ``meta`` (the
        parts' skeletons, the step, the data position, the phase, the settings)."""
        parts = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "strategy": self.strategy.state_dict()}
        flat = {part: flatten(tree, part) for part, tree in parts.items()}
        tensors = {name: t for named, _ in flat.values() for name, t in named.items()}
        skeleton = {part: shape for part, (_, shape) in flat.items()}
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
        """Start from the job's state; returns the phase to continue from. A newcomer
        reads the state rank 0 publishes after the round that admitted it (no
        collective); founders read the newest published state and take rank 0's copy
        (one round). Publishes nothing: the strategy's state exists only once it is
        attached (``_start`` publishes then)."""
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
        if state is not None and phase == TRAINING:
            # FINAL's resumed_from, as for a fixed-size run resumed from a checkpoint:
            # the published state is the elastic job's checkpoint
            self.resumed_from = self.step
            if self.report:
                print(f"ferrosync.train: member {sync.member_id}: resuming from the state "
                      f"published at step {self.step} (round {state.round})",
                      file=sys.stderr, flush=True)
        if founding and phase != TRAINING:
            return SUMMARISED  # the job is over: report it, touch nothing
        if founding:
            self._take_rank0_copy(sync, state.round if state is not None else -1)
        return phase

    def _take_rank0_copy(self, sync, state_round: int) -> None:
        """Founders, one round: every tensor of rank 0's model, exactly (a broadcast: no
        codec touches it, whatever the job's ``wire_dtype``), and the step and data
        position it resumes from, compared with this founder's own. Rank 0 gone
        meanwhile, or another state read than rank 0's: join again (``RejoinNeeded``;
        as a newcomer this member then gets the state rank 0 publishes for it)."""
        mine = torch.tensor([self.step, self.data.epoch, self.data.position, state_round],
                            dtype=torch.int64)
        theirs = mine.clone()
        with torch.no_grad():
            try:
                sync.broadcast_([*self.model.state_dict().values(), theirs], src=0)
            except PeerFailed as exc:
                raise RejoinNeeded(f"rank 0 of the founders left before its model came: {exc}",
                                   path=sync.url, hint="connect again") from exc
        if not torch.equal(mine, theirs):
            raise RejoinNeeded(f"this founder read the state of round {state_round} (step "
                               f"{self.step}), rank 0 that of round {int(theirs[3])} (step "
                               f"{int(theirs[0])})", path=sync.url, hint="connect again")

    def request_leave(self) -> bool:
        """Ask this member to leave the job: its vote to leave rides in its next round
        (the strategy's ballot), after which it leaves (``fit`` raises ``MemberLeft``)
        and rank 0, which reads every vote of that round, publishes the state: so
        members asked at about the same time either leave in one round or the later
        ones find the state already published. At the job's last step it finishes the
        job instead. True when that will happen; False when there is nothing to
        finish (``fit`` is joining or not running, or the job waits below
        ``min_ranks`` because others left, with the state published): leave at once
        then. Safe to call from a signal handler."""
        self._leave_asked = self.ballot.vote = True
        return self.running and not self._stalled

    # -- the loop's hooks (Trainer.fit) -------------------------------------------------
    def _start(self, sync) -> dict | None:
        """Join the job's state (founders: one round); the report of a job that had
        already ended, else None after attaching the strategy (founders' rank 0
        publishes at once: the state of the new roster, with the strategy's)."""
        if not getattr(sync, "elastic", False):
            raise ConfigError("ElasticTrainer.fit needs connect(..., elastic=True)")
        sync.on_membership(self._members_changed)
        # training randomness (dropout, augmentation) differs per member
        seed_streams(derived_seed(self.seed, sync.member_id))
        founding = sync.founding  # before the bootstrap's round changes it
        self._stalled = False
        self._phase = self._bootstrap(sync)
        if self._phase == SUMMARISED:  # the job had ended before this member came
            return self._report_ended(self._ended_summary(sync.url))
        self._resumed = param_digest(self.model).hex() if self.metrics_digest else None
        self._follow_members()
        self.attach_strategy(sync)  # members change: the strategy broadcasts nothing
        self.publishing.done(self.step, time.monotonic())
        if founding:
            # after attach: a strategy's state (DiLoCo's global copy and outer
            # optimizer) exists only from there
            self._publish(sync, TRAINING, now=True)
        return None

    def _members_changed(self, change) -> None:
        # the elastic layer's event (inside a collective): taken up by _follow_members,
        # so a step's shards and metrics line keep the members it started with
        self._members = change

    def _follow_members(self) -> None:
        """``rank``/``world_size`` := the members after the latest collective."""
        self.rank, self.world_size = self._members.rank, self._members.world_size

    def _keep_going(self) -> bool:
        return self._phase == TRAINING and super()._keep_going()

    def _next_batch(self, sync):
        """This member's slice of the job's next global batch, for the current roster."""
        self._follow_members()  # this step's shards
        batch = self.data.take(self.rank, self.world_size)
        self.epoch = self.data.epoch  # the step's epoch, also for a newcomer's first line
        return batch

    def _record(self, *args) -> dict:
        record = {**super()._record(*args), "members": self.world_size, "rank": self.rank}
        if self.metrics_digest and self._resumed is not None:
            # the first line after joining: the model this member started from (a
            # founder's after taking rank 0's copy), to compare with the state it read
            record["resumed_digest"], self._resumed = self._resumed, None
        return record

    def _at_boundary(self, sync, record: dict) -> None:
        """After every step; at a round boundary (the step synced): members whose vote
        to leave rode in this round leave (so does one asked meanwhile when the job
        now waits below ``min_ranks``), and rank 0 publishes first when any member
        leaves or a publish is due (``_publish``). Publishes are counted in ``_end``."""
        if not record["synced"]:
            return None
        voters = self.ballot.voters  # the same on every member of the round
        self._stalled = voters > 0 and sync.world_size - voters < self.min_ranks
        leaving = (self.ballot.voted or (self._leave_asked and self._stalled)) and (
            self.step < self.total_steps)
        published = self._publish(sync, TRAINING, now=voters > 0 or leaving)
        if leaving:
            raise MemberLeft(sync.member_id, self.step, sync.rank, published)
        return None

    def _publish(self, sync, phase: str, *, now: bool = False) -> bool:
        """Rank 0, after a round: publish the job's state if newcomers need it, if
        ``now``, at the end (``phase`` is not TRAINING), or when ``publishing`` says it
        is due. Whether it published."""
        due = (now or phase != TRAINING or sync.newcomers
               or self.publishing.due(self.step, time.monotonic()))
        if sync.rank != 0 or not due:
            return False
        start = time.perf_counter()
        tensors, meta = self._state(phase, sync.membership_changes)
        sync.publish_state(tensors, meta)
        self.publishing.done(self.step, time.monotonic())
        self._published[0] += 1
        self._published[1] += time.perf_counter() - start
        return True

    def _finish(self, sync) -> None:
        if self._phase == TRAINING:
            super()._finish(sync)
            self._phase = FINISHED
            self._publish(sync, FINISHED)

    def _end(self, sync, summary: dict, log) -> dict:
        """The job's rates (one more round: the members' wall times, so the numbers are
        the same on every member), the last state published, the job marked ended."""
        walls = sync.all_gather(torch.tensor([log.wall], dtype=torch.float64))
        job_wall = max(float(w[0]) for w in walls)
        summary.update(job_rates(summary["storage_requests"], summary["samples"], job_wall,
                                 self.storage_prices_given, sync.url), job_wall_s=job_wall)
        self._publish(sync, SUMMARISED)
        sync.end_job()  # later comers report instead of waiting for a round
        self._follow_members()
        summary.update(epochs=self.data.epoch + self.data.position / self.data.n,
                       membership_changes=sync.membership_changes, members=sync.world_size,
                       joined_at_step=self.joined_at, elastic=True,
                       checkpoints=self._published[0], checkpoint_s=self._published[1])
        return summary

    # -- a job that ended before this member ------------------------------------------------
    def report_ended(self, state, url: str) -> dict:
        """Report a job that ended before this process could join it, from its
        published state (``JobEnded`` from connect): no collective, nothing written."""
        if state is None:
            raise ConfigError(f"the elastic job at {url} ended without publishing its state",
                              path=url, hint="start another job (another job id or URL)")
        self._load(state, url, None)
        self.joined_at = self.step
        return self._report_ended(self._ended_summary(url))

    def _ended_summary(self, url: str) -> dict:
        """The summary of a finished job's model as this process holds it, alone."""
        nothing = types.SimpleNamespace(
            counters_begin={}, stats_begin=_Alone.STATS, losses=(), samples=0, wall=0.0,
            start_step=self.step,
            totals={"compute_s": 0.0, "sync_s": 0.0, "checkpoint_s": 0.0, "checkpoints": 0})
        summary = summarise(self, _Alone(url), nothing)
        summary.update(epochs=self.data.epoch + self.data.position / self.data.n,
                       membership_changes=self.membership_changes, members=0,
                       joined_at_step=self.joined_at, elastic=True)
        return summary

    def _report_ended(self, summary: dict) -> dict:
        """One line saying so, then the job's ``FINAL`` line (its model, as published)."""
        if self.report:
            print(f"ferrosync.train: this job already ended at step {summary['steps']} "
                  "(FINAL below: the job's model as it ended; this member trained nothing)",
                  flush=True)
            print(final_line(summary), flush=True)
        return summary


class _Alone:
    """Stands in for the sync when a process reports a job that had already ended:
    no collective, no traffic."""

    STATS = {"bytes_written": 0, "bytes_read": 0, "requests": 0,
             **{phase: 0.0 for phase in PHASES}}
    rank, world_size = 0, 1

    def __init__(self, url: str) -> None:
        self.url = url
        self.stats = {"total": dict(self.STATS)}
        self.counters = types.SimpleNamespace(snapshot=dict)

    def all_gather(self, tensor):
        return [tensor]


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

