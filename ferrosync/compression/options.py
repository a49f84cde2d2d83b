"""The wire codec's options, one declaration shared by every backend that encodes
(``CodecOptions``: inherited by the storage, torch and elastic backends' options)."""

from __future__ import annotations

from dataclasses import dataclass

from ferrosync.compression.codecs import (
    TOPK_BITS,
    TOPK_BITS_RANGE,
    TOPK_DENSITY,
    TOPK_DENSITY_SHOWN,
    check_topk_bits,
    check_topk_density,
    check_wire_dtype,
)
from ferrosync.core.options import boolean, option


def _wire_dtype(_name, value):
    return check_wire_dtype(value)


@dataclass(frozen=True)
class CodecOptions:
    """How a contribution is encoded on the wire (``compression/codecs.py``)."""

    wire_dtype: str | None = option(
        None, "payload encoding: native, `\"float32\"`, `\"bfloat16\"`, `\"float16\"`, "
        "`\"int8\"` (block scales + error feedback), or `\"topk\"` (the largest values of "
        "each chunk in a few bits + error feedback: docs/topk.md)",
        shown="`None`", check=_wire_dtype, shared=True)
    topk_density: float = option(
        TOPK_DENSITY, f"with `wire_dtype=\"topk\"`: the share of each 4096-value chunk "
        f"sent, in {TOPK_DENSITY_SHOWN}", shown="1/64", check=check_topk_density,
        shared=True)
    topk_bits: int = option(
        TOPK_BITS, f"with `wire_dtype=\"topk\"`: bits per value sent, in "
        f"[{TOPK_BITS_RANGE[0]}, {TOPK_BITS_RANGE[1]}]",
        shown=str(TOPK_BITS), check=check_topk_bits, shared=True)
    error_feedback: bool = option(
        True, "carry int8 and topk quantisation error to this rank's next call",
        shown="`True`", check=boolean)
