"""Checks for user-supplied values: one wording for every ``ConfigError`` about a value.

Every public entry point (``connect`` options, ``Trainer`` arguments, strategies,
``shard_indices``, the CLIs) validates its arguments with these before any I/O, so a
bad value fails at once, on every rank, with the same message. ``bool`` is refused
wherever a number is expected: ``True`` is an ``int`` to Python, never to a user.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable

from ferrosync.errors import ConfigError


def error(name: str, wanted: str, value, *, got: str | None = None, source: str | None = None,
          rank: int | None = None, hint: str | None = None) -> ConfigError:
    """The ``ConfigError`` for a bad value, in the one wording: ``"{name} must be
    {wanted}, got {value!r} (from {source})"``.

    ``got`` replaces ``repr(value)`` where the repr would say too much or too little (a
    tensor: its shape; a wrong type: the type's name); ``source`` says where the value
    came from (``"torchrun"``, ``"slurm"``). For a check no helper below fits: raise it.
    """
    shown = repr(value) if got is None else got
    where = f" (from {source})" if source else ""
    return ConfigError(f"{name} must be {wanted}, got {shown}{where}", rank=rank, hint=hint)


def _refuse(name: str, wanted: str, value, rank: int | None, hint: str | None):
    raise error(name, wanted, value, rank=rank, hint=hint)


def integer(name: str, value, *, minimum: int | None = None, maximum: int | None = None,
            allow_none: bool = False, rank: int | None = None,
            hint: str | None = None) -> int | None:
    """``value`` as an int in ``[minimum, maximum]`` (either bound optional)."""
    if value is None and allow_none:
        return None
    if minimum == 1 and maximum is None:
        wanted = "a positive int"
    elif minimum is not None and maximum is not None:
        wanted = f"an int in [{minimum}, {maximum}]"
    elif minimum is not None:
        wanted = f"an int >= {minimum}"
    elif maximum is not None:
        wanted = f"an int <= {maximum}"
    else:
        wanted = "an int"
    if isinstance(value, bool) or not isinstance(value, int) or (
        minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        _refuse(name, wanted, value, rank, hint)
    return value


def number(name: str, value, *, positive: bool = False, minimum: float | None = None,
           maximum: float | None = None, allow_none: bool = False, unit: str = "",
           rank: int | None = None, hint: str | None = None) -> float | None:
    """``value`` as a finite float; ``positive`` means ``> 0``, ``minimum`` ``>=``."""
    if value is None and allow_none:
        return None
    what = f"a number{' of ' + unit if unit else ''}"
    if positive:
        wanted = f"a positive {what[2:]}"
    elif minimum is not None and maximum is not None:
        wanted = f"{what} in [{minimum:g}, {maximum:g}]"
    elif minimum is not None:
        wanted = f"{what} >= {minimum:g}"
    else:
        wanted = f"a finite {what[2:]}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
        value
    ) or (positive and not value > 0) or (minimum is not None and value < minimum) or (
        maximum is not None and value > maximum
    ):
        _refuse(name, wanted, value, rank, hint)
    return float(value)


def boolean(name: str, value, *, rank: int | None = None) -> bool:
    if not isinstance(value, bool):
        _refuse(name, "True or False", value, rank, None)
    return value


def choice(name: str, value, choices: Iterable, *, rank: int | None = None,
           hint: str | None = None):
    choices = tuple(choices)
    if value not in choices:
        _refuse(name, "one of " + ", ".join(repr(c) for c in choices), value, rank, hint)
    return value


def cli_number(kind: type = float, *, positive: bool = False,
               minimum: float | None = None) -> Callable[[str], float]:
    """An ``argparse`` ``type=`` that parses ``kind`` (``int`` or ``float``) and applies
    the same bounds as the API it feeds: ``positive`` means ``> 0``, ``minimum`` ``>=``."""
    noun = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {noun}, got {text!r}") from None
        if (kind is float and not math.isfinite(value)) or (positive and not value > 0) or (
            minimum is not None and value < minimum
        ):
            bound = "> 0" if positive else f">= {minimum:g}"
            raise argparse.ArgumentTypeError(f"must be {noun} {bound}, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse
