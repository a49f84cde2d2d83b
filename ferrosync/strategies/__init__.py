"""Synchronisation strategies: who owns "synchronise + optimizer step" in a training loop.

The trainer (``ferrosync.train``) never calls a collective for the model itself; it
hands that job to a ``Strategy``. A strategy decides *when* and *what* to average
(gradients every step, parameters every H steps, outer-optimizer deltas, ...); the
``GradSync`` it holds decides *how* the bytes move. So a new strategy is a new
subclass here and a name in ``STRATEGIES``, with no change to the trainer loop.

The loop, on every rank::

    strategy.attach(model, optimizer, sync)          # once, before the first step
    for batch in shard:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        telemetry = strategy.step(model, optimizer)  # must call optimizer.step()
    strategy.finish(model, optimizer)                # once, after the last step

``state_dict()``/``load_state_dict()`` travel in checkpoints (rank 0 writes them,
every rank loads them), so anything a strategy must remember across a restart
(steps since the last sync, an outer optimizer's momentum, ...) belongs there.
"""

from __future__ import annotations

import time

import torch

from ..errors import ConfigError

__all__ = ["Strategy", "GradAveraging", "STRATEGIES", "PLANNED", "make_strategy"]


class Strategy:
    """Base class. Subclasses set ``name`` and implement ``step``.

    Collective contract: every rank calls ``attach``, ``step`` and ``finish`` the
    same number of times in the same order, with models of the same structure; a
    strategy's collectives happen inside those calls only, and every rank must
    decide identically whether a given call synchronises (a decision taken from
    a local clock must first be agreed through the sync). Each call blocks until
    its collectives are done.
    """

    #: the ``--strategy`` value that selects this class
    name = ""

    def __init__(self) -> None:
        self.sync = None

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, sync) -> None:
        """Every rank, once, before training: start from identical state.

        The default broadcasts rank 0's parameters and buffers to every rank, so
        ranks agree even if the model factory drew different random weights.
        Subclasses that keep extra state (a copy of the parameters, an outer
        optimizer) create it here, after calling ``super().attach``.
        """
        self.sync = sync
        tensors = [t.detach() for t in (*model.parameters(), *model.buffers())]
        if tensors:
            sync.broadcast_(tensors, src=0)

    def step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Every rank, after ``loss.backward()``: synchronise (or not) and step.

        Must call ``optimizer.step()`` exactly once (the trainer zeroes the
        gradients before the next backward). Returns per-step telemetry for
        metrics and the progress bar: at least ``{"synced": bool, "sync_s":
        float}``, where ``sync_s`` is the wall time spent in collectives.
        """
        raise NotImplementedError

    def finish(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Every rank, once, after the last step: leave every rank with identical
        parameters (a strategy that lets ranks drift must average them here)."""

    def state_dict(self) -> dict:
        """What a checkpoint must carry to continue bit for bit: tensors, numbers,
        strings, lists and dicts only (checkpoints load with ``weights_only=True``)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``; called on every rank before ``attach``."""


class GradAveraging(Strategy):
    """Average gradients on every step, then step the optimizer (plain data parallel).

    After ``attach``, every rank holds identical parameters; since every rank then
    applies the same bit-identical averaged gradient with the same optimizer,
    they stay identical without ever exchanging parameters again.
    """

    name = "grad"

    def step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        start = time.perf_counter()
        self.sync.average_gradients(model)
        sync_s = time.perf_counter() - start
        optimizer.step()
        return {"synced": True, "sync_s": sync_s}


#: ``--strategy`` name -> class
STRATEGIES: dict[str, type[Strategy]] = {GradAveraging.name: GradAveraging}
#: names accepted by the CLI that are not implemented yet (issue 7)
PLANNED = ("local-sgd", "diloco")


def make_strategy(name: str, *, sync_every: int | None = None,
                  sync_every_seconds: float | None = None) -> Strategy:
    """The strategy called ``name``; validates its settings before any I/O.

    Raises:
        ConfigError: unknown or not-yet-available name, or a setting that does not
            apply to this strategy.
    """
    if name in PLANNED:
        raise ConfigError(
            f"--strategy {name} is not available yet",
            hint="use --strategy grad (gradient averaging every step) for now",
        )
    cls = STRATEGIES.get(name)
    if cls is None:
        choices = ", ".join([*STRATEGIES, *PLANNED])
        raise ConfigError(f"unknown strategy {name!r}", hint=f"choose one of: {choices}")
    if cls is GradAveraging and (sync_every not in (None, 1) or sync_every_seconds is not None):
        raise ConfigError(
            "--sync-every/--sync-every-seconds do not apply to --strategy grad, which "
            "averages gradients on every step",
            hint="drop them (they are for the periodic strategies local-sgd and diloco)",
        )
    return cls()
