"""``Encoder``: a backend's codecs and their state (int8 and topk error feedback).

The one encoder of every backend that compresses (``StorageSync``, ``TorchDistSync``):
payloads go on the wire in the codec that ``wire_dtype`` picks per tensor dtype.
Lossy codecs keep state per *stream* (what the data is: a model's gradients, its
parameters; see ``api._stream``) and per place in the collective, so residuals of
unrelated data never mix. Used from the thread inside a collective only.
"""

from __future__ import annotations

import torch

from ferrosync.compression.codecs import (
    TOPK_BITS,
    TOPK_DENSITY,
    Codec,
    ErrorFeedback,
    as_uint8,
    codec_for,
)


class Encoder:
    def __init__(self, wire_dtype: str | None, error_feedback: bool, pool, *,
                 topk_density: float = TOPK_DENSITY, topk_bits: int = TOPK_BITS) -> None:
        self._wire_dtype = wire_dtype
        self._topk = {"topk_density": topk_density, "topk_bits": topk_bits}
        self._error_feedback = error_feedback
        self._pool = pool
        self._codecs: dict[torch.dtype, Codec] = {}
        self._ef = ErrorFeedback()
        self.stream: tuple = (None, b"")  # codec-state key of the running collective

    @classmethod
    def for_options(cls, options, pool) -> Encoder:
        """The encoder of a backend's ``options`` (``wire_dtype``, ``error_feedback``,
        ``topk_density``, ``topk_bits``)."""
        return cls(options.wire_dtype, options.error_feedback, pool,
                   topk_density=options.topk_density, topk_bits=options.topk_bits)

    def codec(self, dtype: torch.dtype) -> Codec:
        codec = self._codecs.get(dtype)
        if codec is None:
            codec = self._codecs[dtype] = codec_for(dtype, self._wire_dtype, **self._topk)
        return codec

    def encode(self, x: torch.Tensor, codec: Codec, place) -> torch.Tensor:
        """The payload of ``x`` as a host uint8 tensor (a view of ``x`` when raw on CPU).

        ``place`` names where in the collective this payload goes (contribution,
        result slice); with the running stream it keys the error feedback. ``None``:
        no feedback (exact copies).
        """
        if codec.raw and x.device.type == "cpu":
            return as_uint8(x)
        nbytes = codec.nbytes(x.numel())
        wire = self._pool.get("wire", nbytes, torch.uint8, x.device)
        self.encode_into(x, codec, wire, None if place is None else (*self.stream, *place))
        if wire.device.type != "cpu":
            host = self._pool.get("host", nbytes, torch.uint8, "cpu", pinned=True)
            host.copy_(wire)
            return host
        return wire

    def encode_into(self, x: torch.Tensor, codec: Codec, out: torch.Tensor, key) -> None:
        """Encode ``x`` into ``out`` (``codec.nbytes(x.numel())`` bytes, ``x``'s device).

        With int8 or topk, error feedback on and a ``key`` (what the data is and where it goes,
        e.g. ``(stream, digest, slot)``), the residual kept under ``key`` is added
        first and the new quantisation error is kept for the next call; ``key=None``
        encodes exactly what is given.
        """
        if codec.feedback and self._error_feedback and key is not None:
            sent = self._ef.compensate(key, x)
            codec.encode(sent, out)
            self._ef.remember(key, sent, codec.decode(out, x.numel()))
        else:
            codec.encode(x, out)

    def clear(self) -> None:
        self._ef.clear()
