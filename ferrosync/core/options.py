"""Options: how a backend declares what ``connect(url, **options)`` takes.

``connect`` hands the keyword arguments to the backend's ``check_options``, which calls
``Options.parse``: unknown names and bad values are a ``ConfigError`` before any I/O, and
the backend reads typed attributes, never string keys. ``option(...)`` is a field with its
description, check and docs default, from which docs/reference.md's tables are generated
(``table()``, ``tools/docs/options_table.py``). Each option is declared once, in a group (a
small frozen dataclass: ``BucketOptions`` here, ``compression/options.py``'s codec group,
``storage/options.py``'s) that the backends taking it inherit; a backend whose default
differs says so in ``defaults``.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ferrosync.core import validate
from ferrosync.errors import ConfigError


def option(default: Any, doc: str, *, shown=None, check=None, documented: bool = True,
           shared: bool = False):
    """A dataclass field carrying its description (``doc``), how the docs show its
    default (``shown``: text, or a function of the options class for a default that
    lives elsewhere, e.g. in the storage engines), its validator
    ``check(name, value) -> value``, and whether every rank of a job must pass the
    same value (``shared``: the one list of such settings, ``shared_settings``)."""
    return field(default=default, metadata={"doc": doc, "shown": shown, "check": check,
                                            "documented": documented, "shared": shared})


def duration(seconds: float) -> str:
    """``seconds`` as the docs write a duration: 20 µs, 5 ms, 10 s."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def per_store(local: float, object_store: float) -> str:
    """A default that depends on the kind of store, as the docs show it."""
    return f"{duration(local)} local, {duration(object_store)} object stores"


def mib(nbytes: int) -> str:
    """A size as the docs write it: 25 MiB, 5 GiB."""
    return f"{nbytes >> 30} GiB" if nbytes >= 1 << 30 else f"{nbytes >> 20} MiB"


# -- validators: check(name, value) -> normalised value -------------------------------------

def positive_or_none(name, value):
    return validate.number(name, value, positive=True, allow_none=True)


def positive(name, value):
    return validate.number(name, value, positive=True)


def positive_int_or_none(name, value):
    return validate.integer(name, value, minimum=1, allow_none=True)


def positive_int(name, value):
    return validate.integer(name, value, minimum=1)


def non_negative_int(name, value):
    return validate.integer(name, value, minimum=0)


def non_negative_int_or_none(name, value):
    return validate.integer(name, value, minimum=0, allow_none=True)


def seconds_or_none(name, value):
    return validate.number(name, value, minimum=0, allow_none=True, unit="seconds")


def boolean(name, value):
    return validate.boolean(name, value)


def dict_or_none(name, value):
    if value is not None and not isinstance(value, dict):
        raise validate.error(name, "a dict", value, got=type(value).__name__)
    return value


def str_or_none(name, value):
    if value is not None and (not isinstance(value, str) or not value):
        raise validate.error(name, "a non-empty path", value)
    return value


def device_or_none(name, value):
    if value is None:
        return None
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise validate.error(name, "'cpu' or 'cuda'", value) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{name}='cuda' but CUDA is not available",
                          hint=f"drop {name} or use 'cpu'")
    return device


# -- the base ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class BackendOptions:
    """Base: parsing, unknown-name errors and the docs table, shared by every backend."""

    #: how error messages name the URLs this backend serves
    scope: ClassVar[str] = "this URL"

    #: how the table words a shared setting (see ``option(shared=...)``)
    shared_doc: ClassVar[str] = "every rank of a job must pass the same"

    #: this backend's default of an option it inherits from a group, where it differs
    #: from the group's (name, check and description stay the group's)
    defaults: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("defaults", {})
        if not own:
            return
        inherited = {}
        for base in reversed(cls.__mro__[1:]):
            inherited.update(getattr(base, "__dataclass_fields__", {}))
        if "__annotations__" not in cls.__dict__:
            cls.__annotations__ = {}
        for name, default in own.items():
            shared = inherited.get(name)
            if shared is None or "doc" not in shared.metadata:
                raise TypeError(f"{cls.__name__}.defaults names {name!r}, an option it does "
                                "not inherit from a group (declare it in the class instead)")
            # re-listed as this class's own field (same metadata, its default): the
            # dataclass keeps the inherited position, so tables keep their order
            setattr(cls, name, field(default=default, metadata=shared.metadata))
            cls.__annotations__[name] = shared.type

    @classmethod
    def default(cls, name: str):
        """This backend's default of option ``name``."""
        return {f.name: f for f in dataclasses.fields(cls)}[name].default

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if "doc" in f.metadata]

    @classmethod
    def shared_names(cls) -> tuple[str, ...]:
        """The settings every rank of a job must share (fields marked ``shared``)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("shared"))

    @classmethod
    def shared_defaults(cls) -> dict:
        """The default of each shared setting (what a record that predates it means)."""
        return {name: cls.default(name) for name in cls.shared_names()}

    def shared_settings(self) -> dict:
        """This rank's values of the settings every rank of the job must share, by name
        (checked at the rendezvous, or against an elastic job's record)."""
        return {name: getattr(self, name) for name in self.shared_names()}

    @classmethod
    def parse(cls, options: dict, *, tolerated: tuple[str, ...] = ()):
        """Validate ``options`` (user keyword arguments): a ``ConfigError`` names the first
        unknown option or bad value. Names in ``tolerated`` are accepted and dropped."""
        known = cls.names()
        unknown = sorted(set(options) - set(known) - set(tolerated))
        if unknown:
            raise ConfigError(
                f"unknown option(s) {unknown} for {cls.scope}{_elsewhere(unknown)}",
                hint="valid options: " + ", ".join(sorted({*known, *tolerated})),
            )
        values = {}
        for f in dataclasses.fields(cls):
            if "doc" not in f.metadata:
                continue
            value = options.get(f.name, f.default)
            check = f.metadata["check"]
            values[f.name] = check(f.name, value) if check is not None else value
        parsed = cls(**values)
        parsed._check_together()
        if getattr(parsed, "wire_dtype", None) == "topk" and not getattr(
                parsed, "error_feedback", True):
            # legal, but every sync then drops what it does not send (~98 %) for good
            warnings.warn("ferrosync: wire_dtype='topk' with error_feedback=False loses "
                          "every value a sync does not send; keep error_feedback=True "
                          "unless that is what you measure", stacklevel=4)
        return parsed

    def _check_together(self) -> None:
        """Rules between options (after each one is valid on its own)."""

    @classmethod
    def table(cls) -> str:
        """The markdown table of documented options (docs/reference.md)."""
        rows = ["| option | default | meaning |", "|---|---|---|"]
        for f in dataclasses.fields(cls):
            meta = f.metadata
            if "doc" not in meta or not meta["documented"]:
                continue
            shown = meta["shown"] if meta["shown"] is not None else f"`{f.default!r}`"
            if callable(shown):
                shown = shown(cls)
            doc = meta["doc"] + (f"; {cls.shared_doc}" if meta["shared"] else "")
            rows.append(f"| `{f.name}` | {shown} | {doc} |")
        return "\n".join(rows)


# -- groups shared by several backends (each backend's class inherits the ones it takes) ----

@dataclass(frozen=True)
class BucketOptions:
    """How a call's tensors are cut into buckets (the storage and torch backends)."""

    bucket_bytes: int | None = option(
        None, "split a call's tensors into buckets of at most this many bytes (on a "
        "storage URL: one object each)",
        shown=lambda cls: mib(d) if (d := cls.default("bucket_bytes")) else "unlimited",
        check=positive_int_or_none, shared=True)


def _elsewhere(unknown: list[str]) -> str:
    """Where the ``unknown`` options belong, when another backend takes them: ``connect``
    picks the backend by the URL and the selecting options (``core/registry.py``)."""
    from ferrosync.core.registry import REGISTRY

    notes = []
    for entry in REGISTRY.values():
        cls = entry.load_options()
        theirs = [name for name in unknown if name in cls.names()]
        if theirs and entry.option is not None:
            notes.append(f"{', '.join(theirs)} apply to {cls.scope} only ({entry.option}=...)")
    return f" ({'; '.join(notes)})" if notes else ""
