"""``Encoder``: a ``FileSync``'s codecs and their state (int8 error feedback).

Payloads go on the wire in the codec that ``wire_dtype`` picks per tensor dtype.
Lossy codecs keep state per *stream* (what the data is: a model's gradients, its
parameters; see ``api._stream``) and per place in the collective, so residuals of
unrelated data never mix. Used from the thread inside a collective only.
"""

from __future__ import annotations

import torch

from ..codecs import Codec, ErrorFeedback, Int8Codec, as_uint8, codec_for


class Encoder:
    def __init__(self, wire_dtype: str | None, error_feedback: bool, pool) -> None:
        self._wire_dtype = wire_dtype
        self._error_feedback = error_feedback
        self._pool = pool
        self._codecs: dict[torch.dtype, Codec] = {}
        self._ef = ErrorFeedback()
        self.stream: tuple = (None, b"")  # codec-state key of the running collective

    def codec(self, dtype: torch.dtype) -> Codec:
        codec = self._codecs.get(dtype)
        if codec is None:
            codec = self._codecs[dtype] = codec_for(dtype, self._wire_dtype)
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
        if isinstance(codec, Int8Codec) and self._error_feedback and place is not None:
            key = (*self.stream, *place)
            sent = self._ef.compensate(key, x)
            codec.encode(sent, wire)
            self._ef.remember(key, sent, codec.decode(wire, x.numel()))
        else:
            codec.encode(x, wire)
        if wire.device.type != "cpu":
            host = self._pool.get("host", nbytes, torch.uint8, "cpu", pinned=True)
            host.copy_(wire)
            return host
        return wire

    def clear(self) -> None:
        self._ef.clear()
