"""DiLoCo (Douillard et al. 2023): local steps, then an outer optimizer step on the averaged
pseudo-gradient.

Every rank averages ``Δ_r = θ_g - θ_r`` work-weighted and applies the same outer step
(Nesterov SGD, lr 0.7, momentum 0.9) to the same bit-identical Δ, so θ_g and the outer
momentum stay identical without being sent. With ``wire_dtype="topk"`` it is SparseLoCo
and the outer step defaults to plain SGD, lr 1 (docs/topk.md#diloco-with-topk-is-sparseloco).
"""

from __future__ import annotations

from typing import Callable

import torch

from ferrosync.core.validate import number
from ferrosync.errors import ConfigError
from ferrosync.strategies.base import float_buffers, norm
from ferrosync.strategies.periodic import PeriodicStrategy

__all__ = ["DiLoCo", "GlobalCopy", "OUTER_LR", "OUTER_MOMENTUM"]

OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
#: the outer step's defaults with wire_dtype="topk": SparseLoCo's (its error feedback
#: accumulates like momentum; Nesterov on top overshoots: on the wide task, 300 steps,
#: H = 30, held-out accuracy 0.62 with (0.7, 0.9) and 0.76 with (1, 0); docs/topk.md)
SPARSE_OUTER_LR = 1.0
SPARSE_OUTER_MOMENTUM = 0.0


class GlobalCopy:
    """θ_g, the global parameters every rank holds identically, the outer optimizer that
    steps them, and what a merge sends: ``delta`` (Δ per parameter) and ``stage`` (a copy
    of the floating-point buffers), all on one device. ``part``: a slice of the
    parameters (a streaming fragment), all of them by default."""

    def __init__(self, params: list[torch.Tensor], buffers: list[torch.Tensor], device,
                 make_outer: Callable) -> None:
        place = (lambda t: t.to(device)) if device else (lambda t: t)
        self.params = [place(p).clone() for p in params]
        self.delta = [torch.empty_like(g) for g in self.params]
        self.stage = [place(b).clone() for b in buffers]
        self.outer = make_outer(self.params)

    def pseudo_gradient(self, local: list[torch.Tensor], part: slice = slice(None)) -> None:
        """``delta`` := θ_g - θ_r over ``part``, from this rank's parameters ``local``
        (all of them, indexed by ``part`` too)."""
        for d, g, p in zip(self.delta[part], self.params[part], local[part]):
            d.copy_(p)              # to the outer device
            torch.sub(g, d, out=d)  # Δ_r = θ_g - θ_r

    def step(self, part: slice = slice(None)) -> None:
        """The outer optimizer's step on ``part`` of θ_g with the averaged ``delta`` as
        its gradient (only tensors with a gradient move)."""
        glob = self.params[part]
        for g, d in zip(glob, self.delta[part]):
            g.grad = d
        self.outer.step()
        for g in glob:
            g.grad = None


class DiLoCo(PeriodicStrategy):
    """Inner optimizer on each rank, outer optimizer on the averaged pseudo-gradient.

    Args:
        outer_lr, outer_momentum: the outer SGD (Nesterov when momentum > 0); by
            default 0.7 and 0.9, or 1 and 0 on a ``wire_dtype="topk"`` sync.
        outer_optimizer: instead, ``(list_of_tensors) -> torch.optim.Optimizer`` for
            the global copy (e.g. ``lambda p: torch.optim.SGD(p, lr=1.0)``, which
            makes DiLoCo plain Local SGD).
        outer_device: where the global copy, the outer optimizer's state and the
            pseudo-gradients live: None (the parameters' device) or ``"cpu"`` to
            save device memory (the merge then copies the parameters to the host and
            back once per sync).
        **periodic: ``sync_every``, ``sync_every_seconds``, ``gamma`` (see
            ``PeriodicStrategy``).

    Memory on ``outer_device``: the global parameters, the pseudo-gradient buffer and
    the outer optimizer's state (one momentum buffer): three copies of the model.
    """

    name = "diloco"
    settings = (*PeriodicStrategy.settings, "outer_lr", "outer_momentum", "outer_device")
    #: on the demo, H = 30 ends within a point of per-step averaging at 2, 3 and 4
    #: ranks over seeds 0-2 while writing 29x fewer bytes; H = 50 was 1 point worse on
    #: average at 3 ranks (docs/train.md, tools/bench/bench_strategies.py)
    default_sync_every = 30

    def __init__(self, *, outer_lr: float | None = None, outer_momentum: float | None = None,
                 outer_optimizer: Callable | None = None, outer_device=None,
                 **periodic) -> None:
        super().__init__(**periodic)
        # None: the default for the sync's wire, chosen in attach (OUTER_* or SPARSE_*)
        outer_lr = number("outer_lr", outer_lr, positive=True, allow_none=True,
                          hint=f"the default is {OUTER_LR} ({SPARSE_OUTER_LR} with topk)")
        outer_momentum = number("outer_momentum", outer_momentum, minimum=0, allow_none=True)
        if outer_optimizer is not None and not callable(outer_optimizer):
            raise ConfigError(f"outer_optimizer must be callable, got "
                              f"{type(outer_optimizer).__name__}")
        if outer_device is not None:
            try:
                outer_device = torch.device(outer_device)
            except (RuntimeError, TypeError, ValueError):
                raise ConfigError(f"outer_device {outer_device!r} is not a torch device",
                                  hint="use cpu, or None for the parameters' device") from None
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.outer_device = outer_device
        self._outer_factory = outer_optimizer
        self._pending: dict | None = None
        #: θ_g and the outer optimizer (``GlobalCopy``), from ``attach``
        self.global_copy: GlobalCopy | None = None

    def attach(self, model, optimizer, sync) -> None:
        sparse = getattr(sync, "wire_dtype", None) == "topk"
        if sparse and float_buffers(model):
            # before any collective: every rank refuses alike
            raise ConfigError(
                f"{self.name} cannot average this model's floating-point buffers (e.g. "
                "BatchNorm statistics) with wire_dtype='topk': it would send only each "
                "chunk's largest values of the buffers themselves", rank=sync.rank,
                path=sync.url, hint="use wire_dtype='int8' for models with float buffers")
        if self.outer_lr is None:
            self.outer_lr = SPARSE_OUTER_LR if sparse else OUTER_LR
        if self.outer_momentum is None:
            self.outer_momentum = SPARSE_OUTER_MOMENTUM if sparse else OUTER_MOMENTUM
        super().attach(model, optimizer, sync)
        params = [p.detach() for p in model.parameters()]
        copy = self.global_copy = GlobalCopy(params, self.buffers, self.outer_device,
                                             self._make_outer)
        if self._pending is not None:  # resumed: the checkpoint's θ_g and outer state
            if len(self._pending["global"]) != len(copy.params):
                raise ConfigError(
                    f"the checkpoint's DiLoCo state has {len(self._pending['global'])} "
                    f"global tensors, this model {len(copy.params)}", rank=sync.rank,
                    hint="resume with the model that wrote the checkpoint")
            with torch.no_grad():
                for g, saved in zip(copy.params, self._pending["global"]):
                    g.copy_(saved)
            copy.outer.load_state_dict(self._pending["outer"])
            self._pending = None

    def _make_outer(self, tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
        if self._outer_factory is not None:
            return self._outer_factory(tensors)
        return torch.optim.SGD(tensors, lr=self.outer_lr, momentum=self.outer_momentum,
                               nesterov=self.outer_momentum > 0)

    @property
    def outer(self) -> torch.optim.Optimizer:
        """The outer optimizer (over θ_g), from ``attach``."""
        return self.global_copy.outer

    def _merge(self, params, weight):
        copy = self.global_copy
        with torch.no_grad():
            copy.pseudo_gradient(params)
            for s, b in zip(copy.stage, self.buffers):
                s.copy_(b)
            tensors = [*copy.delta, *copy.stage]
            self.sync.average_([*tensors, *self.riding(tensors)], weight=weight)
            copy.step()
            distance = norm(p - g.to(p.device) for p, g in zip(params, copy.params))
            post_norm = norm(copy.params)
            for p, g in zip(params, copy.params):
                p.copy_(g)
            for b, s in zip(self.buffers, copy.stage):
                b.copy_(s)
        return distance, post_norm

    def state_dict(self) -> dict:
        return {**super().state_dict(),
                "global": [g.detach().to("cpu").clone() for g in self.global_copy.params],
                "outer": self.outer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._pending = {"global": state["global"], "outer": state["outer"]}
