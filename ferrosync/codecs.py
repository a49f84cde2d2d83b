"""Payload encodings ("wire dtypes"): raw, 16-bit casts, and int8 with block scales.

A codec turns a 1-D float tensor into payload bytes and back. Every codec is a
sequence of fixed-size *frames* (``frame_elems`` elements in ``frame_bytes``
bytes), so a reader can stream any object in chunks of whole frames, and a
collective can be cut into slices on frame boundaries, without codec-specific
code in the transport.

* ``raw``: the tensors' own bytes. On the CPU the payload *is* the tensor memory
  (written and read with zero copies).
* ``bfloat16`` / ``float16`` / ``float32``: a cast on write; the reducer
  accumulates in float32 (float64 for float64 tensors) and the result is cast
  back to the wire dtype, so every rank decodes the very same bytes.
* ``int8``: frames of 256 values and one float32 scale (absmax / 127), 260 bytes
  for 1 KiB of float32: 25.4 % of the float32 bytes. Quantisation error is
  carried to the next call by *error feedback* (``ErrorFeedback``), kept by the
  caller per tensor layout.

Non-finite values keep their meaning: a float cast keeps inf/NaN as they are; an
int8 frame holding inf or NaN decodes to all-NaN, so AMP's ``GradScaler`` sees
``found_inf`` on every rank alike.
"""

from __future__ import annotations

import torch

from .errors import ConfigError

WIRE_DTYPES = ("float32", "bfloat16", "float16", "int8")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

CODEC_RAW = 0
CODEC_CAST = 1
CODEC_INT8 = 2

INT8_BLOCK = 256
_INT8_FRAME = 4 + INT8_BLOCK


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types (accumulating in 16 bits loses low-order ranks' bits)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def as_uint8(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


class Codec:
    code: int
    name: str
    frame_elems: int
    frame_bytes: int
    wire_dtype: torch.dtype | None
    #: the payload is the tensor's own bytes (zero-copy write and read on the CPU)
    raw: bool = False

    def nbytes(self, count: int) -> int:
        frames = -(-count // self.frame_elems)
        return frames * self.frame_bytes

    def encode(self, src: torch.Tensor, out: torch.Tensor) -> None:
        """Write the payload of ``src`` (1-D) into ``out`` (uint8, ``nbytes`` long)."""
        raise NotImplementedError

    def decode(self, payload: torch.Tensor, count: int) -> torch.Tensor:
        """The ``count`` values held by ``payload`` (uint8, whole frames): may be a view."""
        raise NotImplementedError


class RawCodec(Codec):
    code = CODEC_RAW
    frame_elems = 1
    raw = True

    def __init__(self, dtype: torch.dtype) -> None:
        self.wire_dtype = dtype
        self.name = "raw"
        self.frame_bytes = torch.empty((), dtype=dtype).element_size()

    def encode(self, src, out):
        out.copy_(as_uint8(src.contiguous()))

    def decode(self, payload, count):
        return payload[: count * self.frame_bytes].view(self.wire_dtype)


class CastCodec(Codec):
    code = CODEC_CAST
    frame_elems = 1

    def __init__(self, wire: torch.dtype) -> None:
        self.wire_dtype = wire
        self.name = str(wire).replace("torch.", "")
        self.frame_bytes = torch.empty((), dtype=wire).element_size()

    def encode(self, src, out):
        out.view(self.wire_dtype).copy_(src)

    def decode(self, payload, count):
        return payload[: count * self.frame_bytes].view(self.wire_dtype)


class Int8Codec(Codec):
    code = CODEC_INT8
    name = "int8"
    frame_elems = INT8_BLOCK
    frame_bytes = _INT8_FRAME
    wire_dtype = torch.int8

    def encode(self, src, out):
        count = src.numel()
        frames = -(-count // INT8_BLOCK)
        x = src.to(torch.float32)
        if frames * INT8_BLOCK != count:
            x = torch.nn.functional.pad(x, (0, frames * INT8_BLOCK - count))
        x = x.reshape(frames, INT8_BLOCK)
        absmax = x.abs().amax(dim=1, keepdim=True)
        finite = torch.isfinite(absmax)
        scale = absmax / 127.0
        inv = torch.where(finite & (scale > 0), 1.0 / scale, torch.zeros_like(scale))
        q = torch.clamp(torch.round(x * inv), -127, 127).to(torch.int8)
        # a frame with inf/NaN stores a NaN scale: it decodes to NaN, which keeps
        # "non-finite" visible to GradScaler on every rank
        scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
        framed = out[: frames * _INT8_FRAME].view(frames, _INT8_FRAME)
        framed[:, :4].copy_(scale.view(torch.uint8).reshape(frames, 4))
        framed[:, 4:].copy_(q.view(torch.uint8))

    def decode(self, payload, count):
        frames = -(-count // INT8_BLOCK)
        framed = payload[: frames * _INT8_FRAME].view(frames, _INT8_FRAME)
        scale = framed[:, :4].contiguous().view(torch.float32)
        values = framed[:, 4:].view(torch.int8).to(torch.float32) * scale
        return values.reshape(-1)[:count]


def codec_for(dtype: torch.dtype, wire_dtype: str | None) -> Codec:
    """The codec that carries ``dtype`` tensors for the ``wire_dtype`` option."""
    if wire_dtype is None or dtype not in FLOAT_DTYPES:
        return RawCodec(dtype)
    if wire_dtype == "int8":
        return Int8Codec()
    wire = getattr(torch, wire_dtype)
    return RawCodec(dtype) if wire == dtype else CastCodec(wire)


def check_wire_dtype(value) -> str | None:
    if value is None or value == "raw":
        return None
    if isinstance(value, torch.dtype):
        value = str(value).replace("torch.", "")
    if value not in WIRE_DTYPES:
        raise ConfigError(
            f"wire_dtype must be one of {', '.join(WIRE_DTYPES)} (or None), got {value!r}"
        )
    return value


class ErrorFeedback:
    """Residuals of a lossy codec, one per key (stream, layout digest, slot).

    The key names what the data is (a model's gradients, its parameters, a given
    list of tensors: see ``api._stream``), not only its shape: two kinds of data with
    one layout must never share a residual. At most ``max_keys`` residuals are kept
    (least recently used dropped first), so a caller that passes new tensors every
    call cannot grow memory without bound.

    ``compensate(key, x)`` returns ``x + residual`` (a new tensor), and
    ``remember(key, sent, decoded)`` keeps ``sent - decoded`` for the next call,
    so quantisation error is delayed, never lost (Seide et al. 2014; Karimireddy
    et al. 2019). Memory: one float32 vector per key, the size of the payload.
    """

    def __init__(self, max_keys: int = 256) -> None:
        self._residual: dict[object, torch.Tensor] = {}  # insertion order = recency
        self._max_keys = max_keys

    def compensate(self, key, x: torch.Tensor) -> torch.Tensor:
        acc = x.to(torch.float32, copy=True)
        residual = self._residual.pop(key, None)
        if residual is not None:
            self._residual[key] = residual  # most recently used last
        if residual is not None and residual.shape == acc.shape:
            acc.add_(residual)
        return acc

    def remember(self, key, sent: torch.Tensor, decoded: torch.Tensor) -> None:
        residual = self._residual.get(key)
        if residual is None or residual.shape != sent.shape:
            residual = torch.empty_like(sent, dtype=torch.float32)
            self._residual[key] = residual
            while len(self._residual) > self._max_keys:
                del self._residual[next(iter(self._residual))]
        torch.sub(sent, decoded, out=residual)
        # a non-finite step (AMP overflow) must not poison every later step
        residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)

    def clear(self) -> None:
        self._residual.clear()
