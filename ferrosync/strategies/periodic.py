"""Periodic strategies: ranks train on their own and merge every H steps or S seconds.

``PeriodicStrategy`` owns when to synchronise and how much each rank counts (``mass **
gamma``, 0 for an idle rank; every rank decides alike from gathered numbers); subclasses
(``LocalSGD``, ``DiLoCo``) own what a merge does to the model. How a sync goes, the
cadences and the end of training: docs/train.md#strategies.
"""

from __future__ import annotations

import math
import time

import torch

from ferrosync.core.validate import integer, number
from ferrosync.errors import ConfigError
from ferrosync.strategies.base import Strategy, float_buffers, norm

__all__ = ["PeriodicStrategy", "apportion"]


class PeriodicStrategy(Strategy):
    """Base of strategies that let ranks drift between syncs.

    Args:
        sync_every: synchronise after every H optimizer steps (per rank).
        sync_every_seconds: instead, synchronise when S seconds have passed since the
            previous sync (time-based cadence; ranks may then take different numbers
            of steps). Give at most one of the two; neither means
            ``sync_every=default_sync_every`` (the subclass's).
        gamma: a rank's weight in a merge is ``batches ** gamma`` (batches it trained
            since the last sync); 1.0 weighs by work done, 0 weighs every rank that
            worked equally. A rank with no batches always weighs 0.

    Raises:
        ConfigError: on bad settings (before any I/O).
    """

    replicated = False
    settings = ("sync_every", "sync_every_seconds", "gamma")
    refuses_because = "has no outer optimizer"
    #: H when neither ``sync_every`` nor ``sync_every_seconds`` is given
    default_sync_every = 20

    def __init__(self, *, sync_every: int | None = None,
                 sync_every_seconds: float | None = None, gamma: float = 1.0) -> None:
        super().__init__()
        if sync_every is not None and sync_every_seconds is not None:
            raise ConfigError("give --sync-every H or --sync-every-seconds S, not both",
                              hint="steps for a fixed cadence, seconds for uneven ranks")
        sync_every = integer("sync_every", sync_every, minimum=1, allow_none=True)
        sync_every_seconds = number("sync_every_seconds", sync_every_seconds, positive=True,
                                    allow_none=True)
        gamma = number("gamma", gamma, minimum=0)
        if sync_every is None and sync_every_seconds is None:
            sync_every = self.default_sync_every
        self.sync_every = sync_every
        self.sync_every_seconds = sync_every_seconds
        self.gamma = gamma
        self.lockstep = self.sync_every_seconds is None
        self._window = 0                 # batches this rank trained since the last sync
        self._masses: list[int] | None = None   # cumulative batches per rank
        self._global_batches = 0         # all ranks, all windows
        self._skipped = 0
        self._div_sum = 0.0
        self._last: dict = {}
        self._all_done = False
        self._steps_left: int | None = None     # lockstep with begin(): own steps to go
        self._budget: int | None = None         # time-based with begin(): global batches
        self._quota: int | None = None          # time-based: batches left in this window
        self._deadline = 0.0
        #: the model's floating-point buffers (running statistics): merged at every sync
        self.buffers: list[torch.Tensor] = []
        self._int_buffers: list[torch.Tensor] = []   # integer: never merged

    @property
    def cadence(self) -> str:
        """``"every 20 steps"`` or ``"every 5 s"``."""
        if self.lockstep:
            return f"every {self.sync_every} steps"
        return f"every {self.sync_every_seconds:g} s"

    # -- the loop's hooks -----------------------------------------------------------
    def attach(self, model, optimizer, sync) -> None:
        super().attach(model, optimizer, sync)
        if not self.lockstep and self.sync_every_seconds * 2 > sync.timeout:
            raise ConfigError(
                f"--sync-every-seconds {self.sync_every_seconds:g} is too close to the "
                f"sync timeout ({sync.timeout:g} s): a rank that reaches a sync early "
                "waits up to a whole window there", rank=sync.rank,
                hint="raise --timeout to more than twice the window, or sync more often")
        if self.membership is not None:  # the members change (membership_changed)
            if not self.lockstep:
                raise ConfigError("sync_every_seconds needs a fixed membership: an elastic "
                                  "job merges every sync_every steps", rank=sync.rank,
                                  hint="use sync_every H")
        elif self._masses is None:
            self._masses = [0] * sync.world_size
        if self._masses is not None and len(self._masses) != sync.world_size:
            raise ConfigError(f"the strategy state is for {len(self._masses)} ranks, this "
                              f"run has {sync.world_size}", rank=sync.rank)
        self.buffers = float_buffers(model)
        self._int_buffers = [b.detach() for b in model.buffers() if not b.is_floating_point()]
        self._deadline = self._next_deadline()

    def begin(self, total_steps: int, step: int = 0) -> None:
        if self.lockstep:
            self._steps_left = total_steps - step
            self._all_done = self._steps_left <= 0
        else:
            self._budget = total_steps * self.sync.world_size
            self._plan()

    def keep_going(self, step: int, total_steps: int) -> bool:
        if self.lockstep:
            return step < total_steps
        return not self._all_done

    def wants_batch(self) -> bool:
        return self._quota is None or self._window < self._quota

    def progress(self, step: int) -> int:
        if self.lockstep:
            return step
        return self._global_batches // self.sync.world_size

    def step(self, model, optimizer) -> dict:
        optimizer.step()
        self._window += 1
        if self._steps_left is not None:
            self._steps_left -= 1
        self._after_inner_step()
        if self._due():
            return self.synchronize(model, optimizer)
        return {"synced": False, "sync_s": 0.0}

    def _due(self) -> bool:
        if self._steps_left is not None and self._steps_left <= 0:
            return True  # the last step: merge the remainder window
        if self.lockstep:
            return self._window >= self._period()
        if self._quota is not None and self._window >= self._quota:
            return True
        return time.monotonic() >= self._deadline

    def synchronize(self, model, optimizer, *, done: bool = False) -> dict:
        """Collective: merge now, weighting each rank by the batches it trained since
        the last sync (a rank that trained none takes part with weight 0).

        Every rank calls it at the same point of the collective sequence (``step``
        does when the cadence says so; call it directly to force a merge, or when
        ``wants_batch()`` is False). ``done=True`` votes to end: ``finish`` returns
        once every rank has voted. Blocks until the merge is applied. Returns the
        sync's telemetry (see ``TELEMETRY_KEYS``).
        """
        done = done or (self._steps_left is not None and self._steps_left <= 0)
        if self.membership is not None:
            return self._merge_own_window(model, done)
        with self.measured({"synced": True}) as telemetry:
            record = torch.tensor(self._record(done), dtype=torch.float64)
            gathered = ([record] * self.sync.world_size if self._records_known()
                        else self.sync.all_gather(record))
            masses = [int(g[0]) for g in gathered]
            weights = self._weights(gathered)
            telemetry["masses"] = masses
            telemetry["skipped"] = not any(weights)
            if telemetry["skipped"]:
                self._skipped += 1  # every rank idle: nothing to merge, nothing moves
                telemetry.update(divergence=0.0, pre_norm=None, post_norm=None)
            else:
                self._merge_measured(model, weights[self.sync.rank], telemetry)
        self.syncs += 1
        self._window = 0
        self._masses = [a + m for a, m in zip(self._masses, masses)]
        self._global_batches += sum(masses)
        self._all_done = all(bool(g[1]) for g in gathered)
        self._plan()
        self._deadline = self._next_deadline()
        self._last = dict(telemetry)
        return telemetry

    def _records_known(self) -> bool:
        """Whether every rank's record is this rank's own, so a sync needs no gather:
        lockstep with a known end (``begin``). Every rank then trains every step of the
        same windows and reaches the end at the same step, so the windows, the done
        votes and anything a subclass counts per step (streaming's per-fragment
        windows) are equal everywhere. On slow links each collective costs round
        trips: the gather would add a whole latency-bound exchange to every sync
        for numbers every rank has."""
        return self.lockstep and self._steps_left is not None

    def _merge_own_window(self, model, done: bool) -> dict:
        """A sync while the members change (an elastic job's): the merge alone, never a
        gather (a membership change between two collectives would split one sync;
        every member trains every step of the round, so its weight is its own
        window's)."""
        with self.measured({"synced": True, "skipped": False}) as telemetry:
            weight = float(self._window) ** self.gamma if self._window > 0 else 0.0
            self._merge_measured(model, weight, telemetry)
            self.arrived()  # the riders rode in the merge
        self.syncs += 1
        self._window = 0
        self._all_done = done
        self._last = dict(telemetry)
        return telemetry

    def _merge_measured(self, model, weight: float, telemetry: dict) -> None:
        """Collective: ``_merge`` with this rank's ``weight``, and the merge's
        telemetry (divergence, norms before and after) into ``telemetry``."""
        params = [p.detach() for p in model.parameters()]
        pre_norm = norm(params)
        distance, post_norm = self._merge(params, weight)
        divergence = distance / post_norm if post_norm > 0 else 0.0
        self._div_sum += divergence
        telemetry.update(divergence=divergence, pre_norm=pre_norm, post_norm=post_norm)

    def finish(self, model, optimizer) -> None:
        while not self._all_done:  # leave no rank waiting on a sync we would skip
            self.synchronize(model, optimizer, done=True)
        if not self.lockstep and self._int_buffers:
            # integer buffers (BatchNorm's num_batches_tracked) are never averaged;
            # ranks that took different numbers of steps end with rank 0's
            self.sync.broadcast_(self._int_buffers, src=0)

    def membership_changed(self, change) -> None:
        super().membership_changed(change)
        self._masses = None  # per-rank totals mean nothing when the ranks change

    # -- merging (subclasses) -------------------------------------------------------
    def _period(self) -> int:
        """Lockstep: the batches that close the current window (``sync_every``; a
        subclass may stagger its syncs inside it)."""
        return self.sync_every

    def _after_inner_step(self) -> None:
        """Called by ``step`` after the optimizer step and the window count, before
        the cadence check: a subclass with work in flight (an overlapped exchange)
        finishes it here. Nothing by default."""

    def _record(self, done: bool) -> list[float]:
        """What this rank tells the others at a sync: its mass and its "done" vote
        first (``synchronize`` reads those two); a subclass may append more numbers,
        the same count on every rank."""
        return [float(self._window), float(done)]

    def _weights(self, gathered: list[torch.Tensor]) -> list[float]:
        """Every rank's merge weight from the gathered records (identical on every
        rank, since every rank gathered the same records): ``mass ** gamma``, 0 for
        a rank that trained nothing. All zero skips the merge."""
        return [float(m) ** self.gamma if m > 0 else 0.0
                for m in (int(g[0]) for g in gathered)]

    def _merge(self, params: list[torch.Tensor], weight: float) -> tuple[float, float]:
        """Collective: average this rank's contribution with weight ``weight`` and
        apply the result to ``params`` and ``self.buffers``; ``riding``'s tensors ride
        in that average.

        Returns ``(||pre - post||, ||post||)`` over the parameters, where pre is
        this rank's parameters before the merge.
        """
        raise NotImplementedError

    # -- planning -------------------------------------------------------------------
    def _plan(self) -> None:
        """Time-based cadence with a budget: the end, and this rank's next quota."""
        if self.lockstep or self._budget is None:
            return
        remaining = self._budget - self._global_batches
        if remaining <= 0:
            self._all_done, self._quota = True, 0
            return
        self._quota = apportion(remaining, self._masses)[self.sync.rank]

    def _next_deadline(self) -> float:
        if self.lockstep:
            return math.inf
        return time.monotonic() + self.sync_every_seconds

    # -- checkpoints and reporting --------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "cadence": self.cadence,
            "gamma": self.gamma,
            "window": self._window,
            "masses": list(self._masses or []),
            "global_batches": self._global_batches,
            "syncs": self.syncs,
            "skipped": self._skipped,
            "divergence_sum": self._div_sum,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["cadence"] != self.cadence or state["gamma"] != self.gamma:
            raise ValueError(f"the checkpoint synced {state['cadence']} with gamma "
                             f"{state['gamma']}, this run {self.cadence} with gamma "
                             f"{self.gamma}")
        super().load_state_dict(state)
        self._window = int(state["window"])
        self._masses = [int(m) for m in state["masses"]] or None
        self._global_batches = int(state["global_batches"])
        self.syncs = int(state["syncs"])
        self._skipped = int(state["skipped"])
        self._div_sum = float(state["divergence_sum"])

    @property
    def stats(self) -> dict:
        """Running totals and the last sync's telemetry (``last``: divergence,
        pre_norm, post_norm, sync_bytes, masses, skipped, sync_s)."""
        return {**super().stats, "skipped": self._skipped,
                "masses": list(self._masses or []), "last": dict(self._last)}

    def summary(self) -> dict:
        merged = self.syncs - self._skipped
        return {
            **super().summary(),
            "sync_every": self.sync_every,
            "sync_every_seconds": self.sync_every_seconds,
            "gamma": self.gamma,
            "skipped_syncs": self._skipped,
            "divergence": self._last.get("divergence"),
            "divergence_mean": self._div_sum / merged if merged else None,
            "pre_norm": self._last.get("pre_norm"),
            "post_norm": self._last.get("post_norm"),
            # identical on every rank; None in an elastic job (ranks change)
            "masses": list(self._masses) if self._masses is not None else None,
        }


def apportion(total: int, shares: list[int]) -> list[int]:
    """Split ``total`` items in proportion to ``shares`` (non-negative ints), exactly.

    Largest-remainder method in integer arithmetic (ties go to the lower rank), so
    every rank computes the same split and it sums to ``total``. All-zero shares
    split evenly.
    """
    if not any(shares):
        shares = [1] * len(shares)
    whole = sum(shares)
    quotas = [total * s // whole for s in shares]
    remainders = sorted(range(len(shares)), key=lambda r: (-(total * shares[r] % whole), r))
    for r in remainders[: total - sum(quotas)]:
        quotas[r] += 1
    return quotas
