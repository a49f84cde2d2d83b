"""Every object name ferrosync writes on shared storage: formatted and parsed here only.

(Skeleton: the collective data names. To be completed with the rendezvous, liveness,
temp, spare and probe names and a parser for each kind.)
"""

from __future__ import annotations


def contribution(seq: int, rank: int, slice_: int | None = None) -> str:
    """Rank ``rank``'s contribution to collective ``seq`` (or its slice ``slice_``)."""
    return f"c{seq}.r{rank}" if slice_ is None else f"c{seq}.r{rank}.s{slice_}"


def result(seq: int, slice_: int | None = None) -> str:
    """The result of collective ``seq`` (or slice ``slice_`` of it)."""
    return f"c{seq}.out" if slice_ is None else f"c{seq}.out.s{slice_}"


def layout_record(digest: bytes, rank: int) -> str:
    """Rank ``rank``'s description of tensor-layout digest ``digest``."""
    return f"layout.{digest.hex()}.r{rank}"
