"""The ``Strategy`` contract and the per-step baseline, ``GradAveraging``.

Every rank calls ``attach``, ``begin``, ``keep_going``, ``wants_batch``, ``step`` (which
must call ``optimizer.step()``), ``synchronize`` and ``finish`` the same number of times
in the same order; the loop: docs/train.md#writing-a-strategy-or-driving-one-yourself.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager

import torch

__all__ = ["Strategy", "GradAveraging", "TELEMETRY_KEYS"]

#: per-sync telemetry keys a strategy's ``step``/``synchronize`` may return (besides ``synced``
#: and ``sync_s``); the trainer writes each on every metrics line, null when absent
TELEMETRY_KEYS = ("divergence", "pre_norm", "post_norm", "sync_bytes", "masses", "skipped")


class Strategy:
    """Base class. Subclasses set ``name`` and implement ``step``.

    Collective contract: every rank calls ``attach``, ``step``, ``synchronize`` and
    ``finish`` the same number of times in the same order, with models of the
    same structure; a strategy's collectives happen inside those calls only, and
    every rank decides identically whether a given call synchronises (a decision
    taken from a local clock is first agreed through the sync). Each call blocks
    until its collectives are done. ``keep_going``, ``wants_batch`` and
    ``progress`` are local and cheap; their answers only change at a sync, from
    values every rank received, so all ranks see the same loop. In an elastic job a
    strategy's one collective per sync also carries ``_ballot`` (then ``_count``):
    the members' votes to leave (``ElasticTrainer.request_leave``).
    """

    #: the ``--strategy`` value that selects this class
    name = ""
    #: the ``make_strategy`` settings (CLI flags: ``sync_every`` is ``--sync-every``)
    #: this class takes as keyword arguments; any other given setting is refused
    settings: tuple[str, ...] = ()
    #: settings whose given value is what the class does anyway (dropped, not refused)
    implied: dict = {}
    #: completes "--gamma does not apply to --strategy NAME, which ..."
    refuses_because = "does not take it"
    #: every rank takes the same number of optimizer steps (so a loop may decide
    #: "checkpoint now" or "stop" from its own step count)
    lockstep = True
    #: every rank holds identical parameters *and optimizer state* after every
    #: step (so one rank's copy is a checkpoint of all of them)
    replicated = True

    def __init__(self) -> None:
        self.sync = None
        self._restored = False
        self._syncs = 0
        self._sync_bytes = 0
        #: an elastic member's vote to leave the job, cast in its next sync (``_ballot``);
        #: after each sync ``voted`` says whether this member's vote was in it and
        #: ``voters`` how many of the sync's members voted to leave (the same everywhere)
        self.vote, self.voted, self.voters = False, False, 0
        self._box: torch.Tensor | None = None

    # -- the loop's hooks -----------------------------------------------------------
    def check_model(self, model: torch.nn.Module, rank: int | None = None) -> None:
        """Local: raise ``ConfigError`` if the settings cannot work with ``model`` (its
        parameters may be on the meta device: the launcher checks before any rank
        starts). ``attach`` calls it too. Nothing to check by default."""

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, sync) -> None:
        """Every rank, once, before training: start from identical state.

        Broadcasts rank 0's parameters and buffers to every rank, so ranks agree
        even if the model factory drew different random weights. After
        ``load_state_dict`` (a resumed run) every rank already holds its own
        checkpointed state and nothing is broadcast. Subclasses that keep extra
        state (a copy of the parameters, an outer optimizer) create it here, after
        calling ``super().attach``. An elastic job's members agree on their start
        through the store instead (``ferrosync.train.elastic``): nothing is broadcast.
        """
        self.sync = sync
        if self._restored or sync.elastic:
            return
        tensors = [t.detach() for t in (*model.parameters(), *model.buffers())]
        if tensors:
            sync.broadcast_(tensors, src=0)

    def begin(self, total_steps: int, step: int = 0) -> None:
        """Every rank, once after ``attach`` (optional): the run lasts ``total_steps``
        optimizer steps of the per-step baseline and this rank has done ``step``.
        Local; lets a periodic strategy plan its last sync and a time-based one
        share out the remaining samples."""

    def keep_going(self, step: int, total_steps: int) -> bool:
        """Local: whether the loop should continue (identical on every rank)."""
        return step < total_steps

    def wants_batch(self) -> bool:
        """Local: False when this rank should not train in the current window but
        call ``synchronize`` with zero work (its share of the samples is done)."""
        return True

    def progress(self, step: int) -> int:
        """Local: optimizer steps of the per-step baseline completed by all ranks
        together, as agreed at the last sync (for checkpoint cadence)."""
        return step

    def step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Every rank, after ``loss.backward()``: synchronise (or not) and step.

        Must call ``optimizer.step()`` exactly once (the trainer zeroes the
        gradients before the next backward). Returns per-step telemetry for
        metrics and the progress bar: at least ``{"synced": bool, "sync_s":
        float}``, where ``sync_s`` is the wall time spent in collectives, plus any
        of ``TELEMETRY_KEYS`` when it synchronised.
        """
        raise NotImplementedError

    def synchronize(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Collective: synchronise now without a new batch (see ``wants_batch``)."""
        raise NotImplementedError(f"strategy {self.name!r} has no idle sync")

    def finish(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Every rank, once, after the last step: leave every rank with identical
        parameters and buffers."""

    def state_dict(self) -> dict:
        """What a checkpoint must carry to continue bit for bit: tensors, numbers,
        strings, lists and dicts only (checkpoints load with ``weights_only=True``).
        Rank 0's copy is saved; it must describe every rank (it is identical on all
        of them at any step where a checkpoint may be taken)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``; called on every rank before ``attach`` (which then
        broadcasts nothing: each rank resumes from its own checkpointed state)."""
        self._restored = True

    # -- reporting ------------------------------------------------------------------
    @property
    def stats(self) -> dict:
        """This rank's running totals: ``syncs`` and ``sync_bytes`` (bytes this rank
        wrote plus read in the strategy's collectives)."""
        return {"syncs": self._syncs, "sync_bytes": self._sync_bytes}

    def summary(self) -> dict:
        """Keys for the trainer's summary and FINAL line, the same set for every
        strategy (None where it does not apply): ``syncs`` (collective merges this
        rank joined), ``sync_bytes`` (bytes this rank moved in them), the cadence
        (``sync_every``, ``sync_every_seconds``), ``gamma``, ``skipped_syncs``
        (all ranks idle), the last sync's ``divergence``/``pre_norm``/``post_norm``
        and the mean ``divergence_mean`` (this rank's), and ``masses``: batches each
        rank trained in total (identical on every rank)."""
        return {"syncs": self._syncs, "sync_bytes": self._sync_bytes, "sync_every": None,
                "sync_every_seconds": None, "gamma": None, "skipped_syncs": 0,
                "divergence": None, "divergence_mean": None, "pre_norm": None,
                "post_norm": None, "masses": None}

    # -- an elastic member's ballot --------------------------------------------------
    def _ballot(self, beside: list[torch.Tensor]) -> list[torch.Tensor]:
        """In an elastic job, ``[vote]``: one float64 element that the sync's collective
        carries besides the tensors ``beside`` (on their device, in a dtype bucket of
        its own, so a lossy wire codes it apart from them), so after every sync every
        member knows how many of its members voted to leave (``_count``), at no extra
        round. ``[]`` in a fixed-size job."""
        if not self.sync.elastic:
            return []
        device = beside[0].device if beside else torch.device("cpu")
        if self._box is None or self._box.device != device:
            self._box = torch.zeros(1, dtype=torch.float64, device=device)
        self.voted = bool(self.vote)
        self._box.fill_(1.0 if self.voted else 0.0)
        return [self._box]

    def _count(self) -> None:
        """After the sync that carried the ballot: ``voters``, the members that voted to
        leave (the average of the votes times the contributors, rounded: a lossy wire's
        error is far below a half vote)."""
        if self.sync.elastic and self._box is not None:
            self.voters = round(float(self._box[0]) * len(self.sync.contributors))

    @contextmanager
    def _measured(self, telemetry: dict):
        """Times a block of collectives into ``telemetry`` (``sync_s``, ``sync_bytes``)."""
        start = time.perf_counter()
        before = self.sync.stats["total"]
        try:
            yield telemetry
        finally:
            after = self.sync.stats["total"]
            moved = (after["bytes_written"] - before["bytes_written"]
                     + after["bytes_read"] - before["bytes_read"])
            telemetry["sync_s"] = time.perf_counter() - start
            telemetry["sync_bytes"] = moved
            self._sync_bytes += moved


class GradAveraging(Strategy):
    """Average gradients on every step, then step the optimizer (plain data parallel).

    After ``attach``, every rank holds identical parameters; since every rank then
    applies the same bit-identical averaged gradient with the same optimizer,
    they stay identical without ever exchanging parameters again. Floating-point
    buffers (BatchNorm running statistics), which each rank updates from its own
    batches, are averaged once in ``finish`` (and, since they differ until then,
    such a model is checkpointed per rank).
    """

    name = "grad"
    implied = {"sync_every": 1}
    refuses_because = "averages gradients on every step"

    def attach(self, model, optimizer, sync) -> None:
        super().attach(model, optimizer, sync)
        # running statistics drift apart between steps: checkpoint every rank's own
        self.replicated = not float_buffers(model)

    def step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        with self._measured({"synced": True}) as telemetry:
            if self.sync.elastic:  # the ballot rides along as one more "gradient"
                params = list(model.parameters())
                self.sync.average_gradients([*params, self._ballot_param(params)])
                self._count()
            else:
                self.sync.average_gradients(model)
        self._syncs += 1
        optimizer.step()
        return telemetry

    def _ballot_param(self, params: list[torch.Tensor]) -> torch.Tensor:
        """A stand-in parameter whose ``grad`` is the ballot (``average_gradients``
        keeps a lossy codec's state per parameter list, so the list must be stable)."""
        (box,) = self._ballot(params)
        holder = getattr(self, "_ballot_holder", None)
        if holder is None or holder.grad is not box:
            holder = self._ballot_holder = torch.zeros(1, dtype=torch.float64,
                                                       device=box.device, requires_grad=True)
            holder.grad = box
        return holder

    def summary(self) -> dict:
        return {**super().summary(), "sync_every": 1}

    def finish(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        buffers = float_buffers(model)
        if buffers:
            with self._measured({}):
                self.sync.average_(buffers)


def float_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's floating-point buffers (running statistics), detached."""
    return [b.detach() for b in model.buffers() if b.is_floating_point()]


def norm(tensors) -> float:
    """The 2-norm of several tensors taken as one vector (accumulated in float64)."""
    total = 0.0
    for t in tensors:
        total += float(torch.linalg.vector_norm(t.detach(), dtype=torch.float64)) ** 2
    return math.sqrt(total)
