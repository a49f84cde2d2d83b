"""Payload encodings ("wire dtypes"): raw, 16-bit casts, int8 with block scales, sparse
low-bit top-k, and their error feedback.

A codec turns a 1-D float tensor into a sequence of fixed-size frames and back, so a
reader streams and a collective slices any payload on frame boundaries without
codec-specific code in the transport. What each codec sends and how non-finite values
survive: docs/design.md#codecs; top-k: docs/topk.md.
"""

from __future__ import annotations

import torch

from ferrosync.core import validate
from ferrosync.errors import ConfigError

WIRE_DTYPES = ("float32", "bfloat16", "float16", "int8", "topk")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

CODEC_RAW = 0
CODEC_CAST = 1
CODEC_INT8 = 2
CODEC_TOPK = 3

INT8_BLOCK = 256
_INT8_FRAME = 4 + INT8_BLOCK

TOPK_CHUNK = 4096  # chunk-local indices fit a uint16
TOPK_DENSITY = 1 / 64
TOPK_BITS = 2
#: the allowed ranges: at least one value per chunk, at most half of them (beyond
#: that the indices alone outweigh int8), and 1 to 8 bits per value
TOPK_DENSITY_RANGE = (1 / TOPK_CHUNK, 0.5)
TOPK_BITS_RANGE = (1, 8)


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
    #: the header's ``block`` field: the codec's parameters, so ranks that disagree on
    #: them fail on the first object instead of decoding garbage
    block: int = 0
    #: an average may be published through this codec (lossy but dense): False for
    #: sparse codecs, whose sum is not sparse (backends gather the contributions)
    lossy_result: bool = True
    #: lossy in a way that error feedback repays (int8, topk)
    feedback: bool = False

    def nbytes(self, count: int) -> int:
        frames = -(-count // self.frame_elems)
        return frames * self.frame_bytes

    def encode(self, src: torch.Tensor, out: torch.Tensor) -> None:
        """Write the payload of ``src`` (1-D) into ``out`` (uint8, ``nbytes`` long)."""
        raise NotImplementedError

    def decode(self, payload: torch.Tensor, count: int) -> torch.Tensor:
        """The ``count`` values held by ``payload`` (uint8, whole frames): may be a view."""
        raise NotImplementedError

    def chunk_frames(self, chunk_bytes: int) -> int:
        """Frames per streaming read of about ``chunk_bytes`` (bounds the read buffer)."""
        return max(1, chunk_bytes // self.frame_bytes)


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
    block = INT8_BLOCK
    feedback = True

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


class TopKCodec(Codec):
    """Chunked top-k, quantised to ``bits`` bits: one frame per ``TOPK_CHUNK`` values.

    Frame: float32 scale ``s`` (the chunk's largest magnitude; NaN if the chunk holds
    inf or NaN, and then the whole chunk decodes to NaN), ``k`` uint16 chunk-local
    indices, then ``k`` codes of ``bits`` bits packed little-endian (code ``c``: bit
    ``bits-1`` the sign, the low bits ``j``; value ``±(j+1)·s/L``, ``L = 2**(bits-1)``;
    one bit: ``±s``). Slots are in descending magnitude. A slot whose value would not
    be within a factor 2 of its level repeats slot 0 (same index and code) and sends
    nothing new: so every value sent is within a factor 2 of its input, and
    ``input - sent`` is exact in float32 (Sterbenz): error feedback keeps exactly what
    was not delivered.
    """

    code = CODEC_TOPK
    name = "topk"
    frame_elems = TOPK_CHUNK
    wire_dtype = torch.uint8
    lossy_result = False
    feedback = True

    def __init__(self, density: float = TOPK_DENSITY, bits: int = TOPK_BITS) -> None:
        self.k = max(1, min(TOPK_CHUNK, round(density * TOPK_CHUNK)))
        self.bits = bits
        self.levels = 1 << (bits - 1)
        self._code_bytes = -(-self.k * bits // 8)
        self.frame_bytes = 4 + 2 * self.k + self._code_bytes
        self.block = self.k << 4 | bits

    def chunk_frames(self, chunk_bytes: int) -> int:
        # bounded by the float32 values a read decodes to (110x its bytes by default)
        return max(1, chunk_bytes // (4 * TOPK_CHUNK))

    def _chunks(self, src: torch.Tensor) -> torch.Tensor:
        count = src.numel()
        frames = -(-count // TOPK_CHUNK)
        x = src.to(torch.float32)
        if frames * TOPK_CHUNK != count:
            x = torch.nn.functional.pad(x, (0, frames * TOPK_CHUNK - count))
        return x.reshape(frames, TOPK_CHUNK)

    def _values(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The value of each code (float32, one row per frame): the one formula for
        encoder and decoder, so the encoder knows the very bits every reader gets."""
        sign_bit = 1 << (self.bits - 1)
        j = (codes & (sign_bit - 1)).to(torch.float32) + 1
        mag = j * (scale / self.levels)
        return torch.where((codes & sign_bit) != 0, -mag, mag)

    def encode(self, src, out):
        x = self._chunks(src)
        frames = x.shape[0]
        if frames == 0:
            return
        mag = x.abs()
        top, idx = torch.topk(mag, self.k, dim=1, sorted=True)
        scale = top[:, :1]
        finite = torch.isfinite(mag).all(dim=1, keepdim=True)
        picked = torch.gather(x, 1, idx)
        safe = torch.where(finite & (scale > 0), scale, torch.ones_like(scale))
        j = torch.clamp(torch.round(top / safe * self.levels) - 1, 0, self.levels - 1)
        codes = j.to(torch.uint8) | torch.where(
            picked < 0, 1 << (self.bits - 1), 0).to(torch.uint8)
        sent = self._values(codes, safe)
        # Sterbenz: keep a slot only if its value is within 2x of the input's, else it
        # repeats slot 0 (which sends the chunk's scale exactly)
        keep = (top * 2 >= sent.abs()) & (top <= sent.abs() * 2)
        keep[:, 0] = True
        idx = torch.where(keep, idx, idx[:, :1])
        codes = torch.where(keep, codes, codes[:, :1])
        scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
        framed = out[: frames * self.frame_bytes].view(frames, self.frame_bytes)
        framed[:, :4].copy_(scale.contiguous().view(torch.uint8).reshape(frames, 4))
        framed[:, 4:4 + 2 * self.k].copy_(
            idx.to(torch.int16).contiguous().view(torch.uint8).reshape(frames, 2 * self.k))
        framed[:, 4 + 2 * self.k:].copy_(self._pack(codes))

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        frames = codes.shape[0]
        shifts = torch.arange(self.bits, dtype=torch.uint8, device=codes.device)
        bits = ((codes.unsqueeze(-1) >> shifts) & 1).reshape(frames, -1)
        bits = torch.nn.functional.pad(bits, (0, self._code_bytes * 8 - bits.shape[1]))
        weights = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8,
                               device=codes.device)
        return (bits.reshape(frames, self._code_bytes, 8) * weights).sum(
            dim=-1, dtype=torch.uint8)

    def _unpack(self, packed: torch.Tensor) -> torch.Tensor:
        frames = packed.shape[0]
        shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
        bits = ((packed.unsqueeze(-1) >> shifts) & 1).reshape(frames, -1)
        bits = bits[:, : self.k * self.bits].reshape(frames, self.k, self.bits)
        weights = torch.tensor([1 << b for b in range(self.bits)], dtype=torch.uint8,
                               device=packed.device)
        return (bits * weights).sum(dim=-1, dtype=torch.uint8)

    def decode(self, payload, count):
        frames = -(-count // TOPK_CHUNK)
        if frames == 0:
            return torch.zeros(0, dtype=torch.float32, device=payload.device)
        framed = payload[: frames * self.frame_bytes].view(frames, self.frame_bytes)
        scale = framed[:, :4].contiguous().view(torch.float32)
        idx = framed[:, 4:4 + 2 * self.k].contiguous().view(torch.int16).to(torch.int64)
        idx = idx & (TOPK_CHUNK - 1)  # a forged index cannot reach outside its chunk
        codes = self._unpack(framed[:, 4 + 2 * self.k:])
        dense = torch.zeros(frames, TOPK_CHUNK, dtype=torch.float32, device=payload.device)
        # repeated slots carry identical values, so the scatter is deterministic
        dense.scatter_(1, idx, self._values(codes, scale))
        dense.masked_fill_(torch.isnan(scale), float("nan"))
        return dense.reshape(-1)[:count]


def codec_for(dtype: torch.dtype, wire_dtype: str | None, *, topk_density: float = TOPK_DENSITY,
              topk_bits: int = TOPK_BITS) -> Codec:
    """The codec that carries ``dtype`` tensors for the ``wire_dtype`` option."""
    if wire_dtype is None or dtype not in FLOAT_DTYPES:
        return RawCodec(dtype)
    if wire_dtype == "int8":
        return Int8Codec()
    if wire_dtype == "topk":
        return TopKCodec(topk_density, topk_bits)
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


#: the allowed range as the docs and errors write it
TOPK_DENSITY_SHOWN = f"[1/{TOPK_CHUNK}, {TOPK_DENSITY_RANGE[1]:g}]"


def check_topk_density(name: str, value) -> float:
    lo, hi = TOPK_DENSITY_RANGE
    hint = (f"the share of each {TOPK_CHUNK}-value chunk sent with wire_dtype='topk' "
            f"(default 1/64 = {TOPK_DENSITY:g})")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            lo <= value <= hi):  # NaN fails too
        raise validate.error(name, f"a number in {TOPK_DENSITY_SHOWN}", value, hint=hint)
    return float(value)


def check_topk_bits(name: str, value) -> int:
    lo, hi = TOPK_BITS_RANGE
    return validate.integer(name, value, minimum=lo, maximum=hi,
                            hint="bits per value sent with wire_dtype='topk' (default 2)")


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
