"""Synchronisation strategies: who owns "synchronise + optimizer step" in a training loop.

The trainer (``ferrosync.train``) never calls a collective for the model itself; it
hands that job to a ``Strategy``. A strategy decides *when* and *what* to average
(gradients every step, parameters every H steps, outer-optimizer deltas, ...) and
how much each rank counts; the ``GradSync`` it holds decides *how* the bytes move.
So a new strategy is a new subclass here and a name in ``STRATEGIES``, with no
change to the trainer loop (see ``base`` for the loop every rank runs).

* ``grad`` (``GradAveraging``): the gradients, every step;
* ``local-sgd`` (``LocalSGD``): the parameters, every H steps or S seconds, work-weighted;
* ``diloco`` (``DiLoCo``): pseudo-gradients every H steps or S seconds, then an outer
  Nesterov step on a global copy.

``state_dict()``/``load_state_dict()`` travel in checkpoints (rank 0 writes them,
every rank loads them), so anything a strategy must remember across a restart
(steps since the last sync, an outer optimizer's momentum, ...) belongs there.
"""

from __future__ import annotations

from ..errors import ConfigError
from .base import TELEMETRY_KEYS, GradAveraging, Strategy
from .diloco import DiLoCo
from .local_sgd import LocalSGD
from .periodic import PeriodicStrategy

__all__ = ["Strategy", "GradAveraging", "PeriodicStrategy", "LocalSGD", "DiLoCo",
           "STRATEGIES", "TELEMETRY_KEYS", "make_strategy"]

#: ``--strategy`` name -> class
STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (GradAveraging, LocalSGD, DiLoCo)}

#: make_strategy keyword -> the CLI flag that sets it (for error messages)
_FLAGS = {"sync_every": "--sync-every", "sync_every_seconds": "--sync-every-seconds",
          "gamma": "--gamma", "outer_lr": "--outer-lr", "outer_momentum": "--outer-momentum",
          "outer_device": "--outer-device"}
_PERIODIC = ("sync_every", "sync_every_seconds", "gamma")
_OUTER = ("outer_lr", "outer_momentum", "outer_device")


def make_strategy(name: str, **settings) -> Strategy:
    """The strategy called ``name``, built from CLI-style settings (None = default).

    ``settings``: ``sync_every``, ``sync_every_seconds``, ``gamma`` (periodic
    strategies), ``outer_lr``, ``outer_momentum``, ``outer_device`` (diloco). Validates
    everything before any I/O.

    Raises:
        ConfigError: unknown name or setting, a setting that does not apply to this
            strategy, or a bad value.
    """
    cls = STRATEGIES.get(name)
    if cls is None:
        raise ConfigError(f"unknown strategy {name!r}",
                          hint=f"choose one of: {', '.join(STRATEGIES)}")
    unknown = sorted(set(settings) - set(_FLAGS))
    if unknown:
        raise ConfigError(f"make_strategy got unknown settings {unknown}",
                          hint=f"known: {', '.join(_FLAGS)}")
    given = {k: v for k, v in settings.items() if v is not None}
    if cls is GradAveraging and given.get("sync_every") == 1:
        del given["sync_every"]  # every step is what grad does anyway
    applicable = {GradAveraging: (), LocalSGD: _PERIODIC, DiLoCo: _PERIODIC + _OUTER}[cls]
    stray = [_FLAGS[k] for k in _FLAGS if k in given and k not in applicable]
    if stray:
        what = ("averages gradients on every step" if cls is GradAveraging
                else "has no outer optimizer")
        verb = "does" if len(stray) == 1 else "do"
        raise ConfigError(
            f"{'/'.join(stray)} {verb} not apply to --strategy {name}, which {what}",
            hint="drop them (--sync-every/--sync-every-seconds/--gamma are for local-sgd "
            "and diloco, --outer-* for diloco)")
    return cls(**given)
