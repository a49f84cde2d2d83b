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
    values every rank received, so all ranks see the same loop.

    Membership: ``attach`` subscribes ``membership_changed`` to the sync
    (``GradSync.on_membership``); a sync whose members change (an elastic job's) tells
    it who they are at once and after every change, and ``membership`` holds the latest
    event (None with a fixed membership). Riders: a component given to ``carry`` (an
    elastic member's ``LeaveBallot``) rides in the strategy's one collective per sync
    (``riding``, then ``arrived``).
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
        #: the syncs (collective merges) this rank joined
        self.syncs = 0
        self._sync_bytes = 0
        #: the sync's latest membership event (``MembershipChange``); None while the
        #: members are fixed
        self.membership = None
        #: what rides in every sync's collective (``carry``)
        self.riders: list = []

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
        calling ``super().attach``. Members that change (a membership event came) agree
        on their start through the store instead (``ferrosync.train.elastic``): nothing
        is broadcast.
        """
        self.sync = sync
        sync.on_membership(self.membership_changed)
        if self._restored or self.membership is not None:
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
        return {"syncs": self.syncs, "sync_bytes": self._sync_bytes}

    def summary(self) -> dict:
        """Keys for the trainer's summary and FINAL line, the same set for every
        strategy (None where it does not apply): ``syncs`` (collective merges this
        rank joined), ``sync_bytes`` (bytes this rank moved in them), the cadence
        (``sync_every``, ``sync_every_seconds``), ``gamma``, ``skipped_syncs``
        (all ranks idle), the last sync's ``divergence``/``pre_norm``/``post_norm``
        and the mean ``divergence_mean`` (this rank's), and ``masses``: batches each
        rank trained in total (identical on every rank)."""
        return {"syncs": self.syncs, "sync_bytes": self._sync_bytes, "sync_every": None,
                "sync_every_seconds": None, "gamma": None, "skipped_syncs": 0,
                "divergence": None, "divergence_mean": None, "pre_norm": None,
                "post_norm": None, "masses": None}

    # -- membership and riders --------------------------------------------------------
    def membership_changed(self, change) -> None:
        """The sync's membership event (``ferrosync.elastic.events.MembershipChange``):
        the members at ``attach``, then after every collective that changed them (inside
        it). Kept in ``membership``; a subclass whose state depends on the members
        updates it here. Never called with a fixed membership."""
        self.membership = change

    def carry(self, rider) -> None:
        """Carry ``rider`` in every sync's one collective from now on: its
        ``tensors(beside)`` are averaged with the strategy's own (``riding``), and its
        ``arrived(sync)`` runs once they are (``arrived``). An elastic member's vote to
        leave rides so (``ferrosync.elastic.ballot.LeaveBallot``), at no extra round.
        ``ConfigError`` from a strategy with no one collective per sync."""
        self.riders.append(rider)

    def riding(self, beside: list[torch.Tensor]) -> list[torch.Tensor]:
        """Subclasses, in the collective of a sync: the riders' tensors, to average
        with ``beside`` (at the sync's weight)."""
        return [t for rider in self.riders for t in rider.tensors(beside)]

    def arrived(self) -> None:
        """Subclasses, after the collective that carried ``riding``'s tensors."""
        for rider in self.riders:
            rider.arrived(self.sync)

    @contextmanager
    def measured(self, telemetry: dict):
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
            self.count_bytes(moved)

    def count_bytes(self, moved: int) -> None:
        """Add ``moved`` to ``stats["sync_bytes"]``: ``measured`` does for its block;
        a subclass does for bytes moved outside one (an overlapped exchange's)."""
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
        with self.measured({"synced": True}) as telemetry:
            if self.riders:  # they ride along as more "gradients"
                params = list(model.parameters())
                self.sync.average_gradients([*params, *self._holders(self.riding(params))])
                self.arrived()
            else:
                self.sync.average_gradients(model)
        self.syncs += 1
        optimizer.step()
        return telemetry

    def _holders(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Stand-in parameters whose ``grad`` are the riders' ``tensors``, the same
        ones while the tensors are (``average_gradients`` keeps a lossy codec's state
        per parameter list, so the list must be stable)."""
        held = getattr(self, "_held", [])
        if len(held) != len(tensors) or any(h.grad is not t for h, t in zip(held, tensors)):
            held = self._held = [torch.zeros(t.shape, dtype=t.dtype, device=t.device,
                                             requires_grad=True) for t in tensors]
            for h, t in zip(held, tensors):
                h.grad = t
        return held

    def summary(self) -> dict:
        return {**super().summary(), "sync_every": 1}

    def finish(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        buffers = float_buffers(model)
        if buffers:
            with self.measured({}):
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
