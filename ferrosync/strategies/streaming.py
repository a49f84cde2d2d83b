"""Streaming DiLoCo (Douillard et al. 2025): DiLoCo one fragment at a time, each exchange
overlapped with the next inner steps.

Fragment f of ``F`` syncs every H steps at a staggered offset, with ``average_(...,
async_op=True)`` applied ``overlap_steps`` later and mixed by ``α``; the last sync merges
every fragment at once, so runs end on θ_g. With ``fragments=1, overlap_steps=0`` it is
``diloco`` bit for bit (docs/train.md#streaming-diloco).
"""

from __future__ import annotations

import collections
import time

import torch

from ferrosync.core.validate import integer, number
from ferrosync.errors import ConfigError
from ferrosync.strategies.base import norm
from ferrosync.strategies.diloco import DiLoCo

__all__ = ["StreamingDiLoCo", "partition", "FRAGMENTS", "OVERLAP_STEPS"]

FRAGMENTS = 4
OVERLAP_STEPS = 1
#: exchanges kept in ``stats["exchanges"]`` (telemetry only; a bounded history)
_EXCHANGE_LOG = 256


class StreamingDiLoCo(DiLoCo):
    """DiLoCo over staggered fragments with overlapped exchanges (see the module).

    Args:
        fragments: F, how many fragments the parameters are split into (at most the
            number of parameter tensors and at most ``sync_every``).
        overlap_steps: τ, inner steps between starting a fragment's exchange and
            applying it; 0 waits at once (synchronous). Must be below ``sync_every //
            fragments``, the fewest steps between two fragment syncs, so at most one
            exchange is in flight.
        alpha: the share of the local fragment kept when a merge lands, in [0, 1).
        **diloco: ``sync_every``, ``gamma``, ``outer_lr``, ``outer_momentum``,
            ``outer_optimizer`` (its ``step`` must skip tensors whose ``grad`` is None,
            as torch's optimizers do), ``outer_device`` (see ``DiLoCo``).
            ``sync_every_seconds`` is refused: fragments are staggered by step count.

    Memory: ``DiLoCo``'s three copies of the model on ``outer_device``.

    Raises:
        ConfigError: on bad settings (before any I/O), or in ``attach`` when the
            model has fewer parameter tensors than ``fragments``.
    """

    name = "streaming-diloco"
    settings = tuple(s for s in (*DiLoCo.settings, "fragments", "overlap_steps", "alpha")
                     if s != "sync_every_seconds")
    refuses_because = "staggers its fragment syncs by step count (use --sync-every)"

    def __init__(self, *, fragments: int = FRAGMENTS, overlap_steps: int = OVERLAP_STEPS,
                 alpha: float = 0.0, **diloco) -> None:
        if diloco.get("sync_every_seconds") is not None:
            raise ConfigError("--sync-every-seconds does not apply to --strategy "
                              f"{self.name}: {self.refuses_because}",
                              hint="give --sync-every H")
        super().__init__(**diloco)
        self.fragments = integer("fragments (--fragments)", fragments, minimum=1,
                                 hint=f"--fragments: how many parts the model syncs in "
                                 f"(default {FRAGMENTS})")
        if self.fragments > self.sync_every:
            raise ConfigError(
                f"--fragments {self.fragments} is more than --sync-every {self.sync_every}: "
                "each fragment needs its own step of the window",
                hint="lower --fragments or raise --sync-every")
        self.overlap_steps = integer("overlap_steps (--overlap-steps)", overlap_steps, minimum=0,
                                     hint="--overlap-steps: 0 is synchronous")
        spacing = self.sync_every // self.fragments
        if self.overlap_steps >= spacing:
            raise ConfigError(
                f"--overlap-steps {self.overlap_steps} must be below --sync-every "
                f"{self.sync_every} // --fragments {self.fragments} = {spacing}, the steps "
                "between two fragment syncs (one exchange in flight at a time)",
                hint=f"use --overlap-steps {spacing - 1} or less, or raise --sync-every")
        self.alpha = number("alpha (--alpha)", alpha, minimum=0, maximum=1,
                            hint="--alpha: 0 replaces the local fragment on merge")
        if self.alpha == 1:
            raise ConfigError("--alpha 1 would never take the global fragment",
                              hint="use a value in [0, 1); 0 is the default")
        # offsets (f + 1) * H // F: the steps from fragment f-1's sync to fragment f's
        offsets = [(f + 1) * self.sync_every // self.fragments for f in range(self.fragments)]
        self._gaps = [b - a for a, b in zip([0, *offsets], offsets)]
        self._next = 0                      # the fragment the next regular sync merges
        self._frag_window = [0] * self.fragments  # batches since each fragment's sync
        self._t = 0                         # this rank's optimizer steps (telemetry)
        self._inflight: dict | None = None  # the exchange started, not yet applied
        # this sync's collectives: (fragments, this rank's weight), see _weights
        self._plan_now: list[tuple[list[int], float]] = []
        self._final = False                 # this sync merges every fragment (the last)
        self._landed: dict | None = None    # telemetry of an exchange applied this step
        self._exchanges: collections.deque = collections.deque(maxlen=_EXCHANGE_LOG)
        self._restored_stream: dict | None = None

    @property
    def cadence(self) -> str:
        return (f"every {self.sync_every} steps in {self.fragments} fragments, "
                f"overlap {self.overlap_steps}")

    # -- setup ----------------------------------------------------------------------
    def carry(self, rider) -> None:
        """Refused: a window's syncs are several overlapped exchanges, not one
        collective a rider could count on (``Strategy.carry``)."""
        raise ConfigError(f"--strategy {self.name} cannot carry {type(rider).__name__}: "
                          "its fragments sync in several overlapped exchanges",
                          hint="use --strategy diloco (one merge per sync)")

    def check_model(self, model, rank: int | None = None) -> None:
        tensors = sum(1 for _ in model.parameters())
        if tensors < self.fragments:
            raise ConfigError(
                f"--fragments {self.fragments} is more than the model's {tensors} "
                "parameter tensors", rank=rank,
                hint=f"use --fragments {max(1, tensors)} or less")

    def attach(self, model, optimizer, sync) -> None:
        super().attach(model, optimizer, sync)
        self.check_model(model, rank=sync.rank)
        self._params = [p.detach() for p in model.parameters()]
        self._parts = partition([p.numel() for p in self._params], self.fragments)
        restored, self._restored_stream = self._restored_stream, None
        if restored is not None:
            self._next = int(restored["next"])
            self._frag_window = [int(w) for w in restored["frag_window"]]
            self._t = int(restored["t"])
            self._inflight = self._restore_inflight(restored["inflight"])

    def _tensors(self, f: int) -> list[torch.Tensor]:
        """What fragment ``f``'s exchange averages (the same tensor objects every time,
        so a lossy codec's per-stream state stays with its fragment): its Δ slice, and
        the buffers' staging copies for the last fragment."""
        copy = self.global_copy
        tensors = copy.delta[self._parts[f]]
        return [*tensors, *copy.stage] if f == self.fragments - 1 else tensors

    # -- the schedule (every decision from gathered numbers or step counts) ----------
    def _after_inner_step(self) -> None:
        self._t += 1
        self._frag_window = [w + 1 for w in self._frag_window]
        if self._inflight is not None:
            self._inflight["left"] -= 1
            if self._inflight["left"] <= 0:
                self._landed = self._land()

    def _period(self) -> int:
        # the steps from the previous fragment's sync to the next one's (the last step
        # of a run merges every fragment: PeriodicStrategy._due)
        return self._gaps[self._next]

    def _record(self, done: bool) -> list[float]:
        return [*super()._record(done), *(float(w) for w in self._frag_window)]

    def _weights(self, gathered: list[torch.Tensor]) -> list[float]:
        """Decides what this sync merges, identically on every rank: every fragment
        when every rank voted done (the final merge), else the next fragment in turn.
        Returns per-rank weights whose all-zero means "nothing to merge".

        Plans the merge's collectives: one per fragment, each with its own weights;
        or, where every rank weighs each fragment alike (lockstep: the weighted mean
        is then the plain mean), one collective for all of them, so the final merge
        of F fragments costs one exchange's round trips instead of F. (That exchange
        is a codec stream of its own: a lossy codec's residuals from the fragments'
        earlier syncs are not added to it.)"""
        def weight(mass: float) -> float:
            return mass ** self.gamma if mass > 0 else 0.0

        final = all(bool(g[1]) for g in gathered)
        chosen = range(self.fragments) if final else [self._next]
        if not final:
            self._next = (self._next + 1) % self.fragments
        rank = self.sync.rank
        per_fragment = {f: [weight(float(g[2 + f])) for g in gathered] for f in chosen}
        merged = [f for f in chosen if any(per_fragment[f])]  # nobody trained it: skip
        if len(merged) > 1 and all(len(set(per_fragment[f])) == 1 for f in merged):
            self._plan_now = [(merged, 1.0)]
        else:
            self._plan_now = [([f], per_fragment[f][rank]) for f in merged]
        for f in chosen:
            self._frag_window[f] = 0
        self._final = final
        return [sum(per_fragment[f][r] for f in chosen) for r in range(len(gathered))]

    # -- merging --------------------------------------------------------------------
    def step(self, model, optimizer) -> dict:
        telemetry = super().step(model, optimizer)
        landed, self._landed = self._landed, None
        return _with_landing(telemetry, landed)

    def synchronize(self, model, optimizer, *, done: bool = False) -> dict:
        """Collective, as ``PeriodicStrategy.synchronize``. An exchange still in flight
        (an idle rank's, or one the last step overtook) lands first: every rank's Δ
        for the next merge must start from its result."""
        landed = self._land() if self._inflight is not None else None
        telemetry = super().synchronize(model, optimizer, done=done)
        if self._inflight is not None and "mark" not in self._inflight:
            # bytes of the overlapped exchange moved after this call are counted when it
            # lands (with any other collective called meanwhile, e.g. a checkpoint's)
            self._inflight["mark"] = self._moved()
        return _with_landing(telemetry, landed)

    def _merge(self, params, weight):
        with torch.no_grad():
            if self._final or self.overlap_steps == 0:
                squares, post = 0.0, []
                for fragments, w in self._plan_now:
                    self._start(fragments, w, async_op=False)
                    for f in fragments:
                        distance, _ = self._apply(f, replace=self._final)
                        squares += distance ** 2
                        post.extend(self.global_copy.params[self._parts[f]])
                if self._final:  # every rank ends on θ_g, whatever alpha kept before
                    for p, g in zip(self._params, self.global_copy.params):
                        p.copy_(g)
                return squares ** 0.5, norm(post)
            ([f], w), = self._plan_now
            part = self._parts[f]
            self._start([f], w, async_op=True)
            # measured now (the merge lands later): how far this rank drifted from the
            # fragment's global copy, relative to that copy
            glob = self.global_copy.params[part]
            return (norm(g.to(p.device) - p for g, p in zip(glob, params[part])),
                    norm(glob))

    def _start(self, fragments: list[int], weight: float, *, async_op: bool) -> None:
        """Collective: Δ of ``fragments`` (and the buffers with the last fragment)
        averaged with this rank's ``weight``; in the background with ``async_op`` (one
        fragment; lands in ``overlap_steps`` steps), else in place before returning."""
        copy = self.global_copy
        for f in fragments:
            copy.pseudo_gradient(self._params, self._parts[f])
        if self.fragments - 1 in fragments:
            for s, b in zip(copy.stage, self.buffers):
                s.copy_(b)
        tensors = [t for f in fragments for t in self._tensors(f)]
        handle = self.sync.average_(tensors, weight=weight, async_op=async_op)
        if async_op:
            self._inflight = {"fragment": fragments[0], "handle": handle,
                              "left": self.overlap_steps, "started": self._t}

    def _land(self) -> dict:
        """Wait for the exchange in flight and apply it (see ``_apply``); returns the
        wait's telemetry and logs the exchange in ``stats["exchanges"]``."""
        flight, self._inflight = self._inflight, None
        start = time.perf_counter()
        handle = flight.get("handle")
        ready = handle is None or handle.done()  # the bytes arrived while we computed
        if handle is not None:
            handle.wait()
        with torch.no_grad():
            self._apply(flight["fragment"], replace=False)
        moved = self._moved() - flight["mark"] if "mark" in flight else 0
        self.count_bytes(moved)
        self._exchanges.append({"fragment": flight["fragment"], "started": flight["started"],
                                "landed": self._t, "ready": ready})
        return {"sync_s": time.perf_counter() - start, "sync_bytes": moved}

    def _apply(self, f: int, *, replace: bool) -> tuple[float, float]:
        """Local: the outer step on fragment ``f``'s global copy with its averaged Δ,
        then the local fragment := α·local + (1 - α)·global (just the global copy when
        α = 0 or ``replace``) and the buffers := their average. Returns ``(||pre -
        post||, ||post||)`` over the fragment."""
        part, copy = self._parts[f], self.global_copy
        glob, params = copy.params[part], self._params[part]
        copy.step(part)  # only tensors with a grad move: this fragment's
        distance = norm(p - g.to(p.device) for p, g in zip(params, glob))
        for p, g in zip(params, glob):
            if self.alpha == 0 or replace:
                p.copy_(g)
            else:
                p.mul_(self.alpha).add_(g.to(p.device), alpha=1 - self.alpha)
        if f == self.fragments - 1:
            for b, s in zip(self.buffers, copy.stage):
                b.copy_(s)
        return distance, norm(glob)

    def finish(self, model, optimizer) -> None:
        """Collective, as ``PeriodicStrategy.finish``; then lands any exchange still in
        flight and sets every fragment to its global copy, so every rank ends with
        identical parameters (the copies are identical everywhere)."""
        super().finish(model, optimizer)
        if self._inflight is not None:
            self._land()
        with torch.no_grad():
            for p, g in zip(self._params, self.global_copy.params):
                p.copy_(g)

    def _moved(self) -> int:
        total = self.sync.stats["total"]
        return total["bytes_written"] + total["bytes_read"]

    # -- checkpoints and reporting --------------------------------------------------
    def state_dict(self) -> dict:
        """DiLoCo's state plus the schedule and the exchange in flight. That exchange is
        waited for here (every rank started it, so it completes) and its averaged Δ
        saved, to be applied at the same step after a resume."""
        inflight = None
        if self._inflight is not None:
            flight = self._inflight
            if flight.get("handle") is not None:
                flight["handle"].wait()
            inflight = {"fragment": flight["fragment"], "left": flight["left"],
                        "started": flight["started"],
                        "tensors": [t.detach().to("cpu").clone()
                                    for t in self._tensors(flight["fragment"])]}
        return {**super().state_dict(),
                "streaming": {"fragments": self.fragments, "overlap_steps": self.overlap_steps,
                              "alpha": self.alpha, "next": self._next,
                              "frag_window": list(self._frag_window), "t": self._t,
                              "inflight": inflight}}

    def load_state_dict(self, state: dict) -> None:
        saved = state["streaming"]
        mine = (self.fragments, self.overlap_steps, self.alpha)
        theirs = (saved["fragments"], saved["overlap_steps"], saved["alpha"])
        if mine != theirs:
            raise ValueError(f"the checkpoint used fragments/overlap_steps/alpha {theirs}, "
                             f"this run {mine}")
        super().load_state_dict(state)
        self._restored_stream = saved

    def _restore_inflight(self, saved: dict | None) -> dict | None:
        if saved is None:
            return None
        tensors = self._tensors(int(saved["fragment"]))
        if [tuple(t.shape) for t in tensors] != [tuple(t.shape) for t in saved["tensors"]]:
            raise ConfigError("the checkpoint's exchange in flight does not fit this model",
                              rank=self.sync.rank, hint="resume with the model that wrote it")
        with torch.no_grad():
            for t, s in zip(tensors, saved["tensors"]):
                t.copy_(s)
        return {"fragment": int(saved["fragment"]), "handle": None,
                "left": int(saved["left"]), "started": int(saved["started"])}

    @property
    def stats(self) -> dict:
        """``DiLoCo``'s, plus ``exchanges``: the latest overlapped exchanges, each
        ``{"fragment", "started", "landed", "ready"}`` (this rank's step counts when
        it was started and applied; ``ready``: it had finished before it was needed)."""
        return {**super().stats, "exchanges": list(self._exchanges),
                "fragment_sizes": [sum(p.numel() for p in self._params[part])
                                   for part in getattr(self, "_parts", [])]}


def _with_landing(telemetry: dict, landed: dict | None) -> dict:
    """A step's telemetry plus the wait for, and the bytes of, an exchange that landed
    in it (moved in the background since it started)."""
    if landed is not None:
        telemetry["sync_s"] += landed["sync_s"]
        telemetry["sync_bytes"] = telemetry.get("sync_bytes", 0) + landed["sync_bytes"]
    return telemetry


def partition(sizes: list[int], parts: int) -> list[slice]:
    """Split items of ``sizes`` (in order) into ``parts`` contiguous, non-empty slices of
    about equal total size: cut ``k`` goes where the running total is closest to
    ``k/parts`` of the whole (the first such place; integer arithmetic, so every rank
    cuts identically). Needs ``1 <= parts <= len(sizes)``."""
    total, cuts = sum(sizes), [0]
    running = [0]
    for s in sizes:
        running.append(running[-1] + s)
    for k in range(1, parts):
        lo, hi = cuts[-1] + 1, len(sizes) - (parts - k)  # leave one item per later part
        cuts.append(min(range(lo, hi + 1),
                        key=lambda i: abs(parts * running[i] - k * total)))
    cuts.append(len(sizes))
    return [slice(a, b) for a, b in zip(cuts, cuts[1:])]

