"""Synchronisation strategies: who owns "synchronise + optimizer step" in a training loop.

A ``Strategy`` decides when and what to average and how much each rank counts; the
``GradSync`` it holds decides how the bytes move. A new strategy is a subclass
declaring its ``name`` and ``settings`` plus one entry in ``STRATEGIES``
(docs/train.md#writing-a-strategy-or-driving-one-yourself). Built in: ``grad``,
``local-sgd``, ``diloco``, ``streaming-diloco`` (docs/train.md#strategies,
docs/design.md#strategies).
"""

from __future__ import annotations

from ferrosync.errors import ConfigError
from ferrosync.strategies.base import TELEMETRY_KEYS, GradAveraging, Strategy
from ferrosync.strategies.diloco import DiLoCo
from ferrosync.strategies.local_sgd import LocalSGD
from ferrosync.strategies.periodic import PeriodicStrategy
from ferrosync.strategies.streaming import StreamingDiLoCo

__all__ = ["Strategy", "GradAveraging", "PeriodicStrategy", "LocalSGD", "DiLoCo",
           "StreamingDiLoCo", "STRATEGIES", "TELEMETRY_KEYS", "make_strategy",
           "known_settings", "flag"]

#: ``--strategy`` name -> class: the one place a new strategy is registered. Each class
#: declares its own ``name`` and the ``settings`` it takes (see ``Strategy``).
STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (GradAveraging, LocalSGD, DiLoCo, StreamingDiLoCo)}


def known_settings() -> tuple[str, ...]:
    """Every setting some registered strategy takes, in registry order (no repeats)."""
    return tuple(dict.fromkeys(key for cls in STRATEGIES.values() for key in cls.settings))


def flag(setting: str) -> str:
    """The CLI flag that sets ``setting``: ``sync_every`` -> ``--sync-every``."""
    return "--" + setting.replace("_", "-")


def make_strategy(name: str, **settings) -> Strategy:
    """The strategy called ``name``, built from CLI-style settings (None = default).

    ``settings``: any of ``known_settings()`` (``sync_every``, ``sync_every_seconds``,
    ``gamma`` for the periodic strategies; ``outer_lr``, ``outer_momentum``,
    ``outer_device`` for diloco and streaming-diloco; ``fragments``, ``overlap_steps``,
    ``alpha`` for streaming-diloco). Validates everything before any I/O.

    Raises:
        ConfigError: unknown name or setting, a setting that does not apply to this
            strategy, or a bad value.
    """
    cls = STRATEGIES.get(name)
    if cls is None:
        raise ConfigError(f"unknown strategy {name!r}",
                          hint=f"choose one of: {', '.join(STRATEGIES)}")
    known = known_settings()
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise ConfigError(f"make_strategy got unknown settings {unknown}",
                          hint=f"known: {', '.join(known)}")
    given = {k: v for k, v in settings.items()
             if v is not None and not (k in cls.implied and cls.implied[k] == v)}
    stray = [flag(k) for k in known if k in given and k not in cls.settings]
    if stray:
        verb = "does" if len(stray) == 1 else "do"
        raise ConfigError(
            f"{'/'.join(stray)} {verb} not apply to --strategy {name}, which "
            f"{cls.refuses_because}", hint=f"drop them ({_who_takes_what()})")
    return cls(**given)


def _who_takes_what() -> str:
    """``--sync-every/--gamma are for local-sgd and diloco, --outer-lr for diloco``."""
    takers: dict[tuple[str, ...], list[str]] = {}
    for key in known_settings():
        names = tuple(n for n, cls in STRATEGIES.items() if key in cls.settings)
        takers.setdefault(names, []).append(flag(key))
    parts = [f"{'/'.join(flags)}{' are' if i == 0 else ''} for {' and '.join(names)}"
             for i, (names, flags) in enumerate(takers.items())]
    return ", ".join(parts)
