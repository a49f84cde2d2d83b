"""``compression/encoder.py``: raw CPU payloads travel as views, lossy ones through the
pool, and int8 error feedback is kept per (stream, place), never mixed and never
applied to exact copies."""

from __future__ import annotations

import torch

from ferrosync.compression.codecs import Int8Codec, RawCodec
from ferrosync.compression.encoder import Encoder
from ferrosync.core.flat import BufferPool


def decode(codec, payload, n):
    return codec.decode(payload, n).clone()


def test_a_raw_cpu_payload_is_a_view_of_the_tensor():
    enc = Encoder(None, error_feedback=True, pool=BufferPool())
    x = torch.arange(4.0)
    codec = enc.codec(torch.float32)
    assert isinstance(codec, RawCodec) and enc.codec(torch.float32) is codec  # one per dtype
    payload = enc.encode(x, codec, place=("c", 0))
    assert payload.dtype == torch.uint8 and payload.data_ptr() == x.data_ptr()


def test_int8_feedback_carries_the_error_to_the_next_call_of_the_same_place():
    enc = Encoder("int8", error_feedback=True, pool=BufferPool())
    codec = enc.codec(torch.float32)
    assert isinstance(codec, Int8Codec)
    x = torch.linspace(-1.0, 1.0, 300) ** 3
    enc.stream = ("grads", b"digest")
    sent = [decode(codec, enc.encode(x, codec, place=("contrib",)), 300) for _ in range(50)]
    # what was sent over many calls averages to what was given: the error is delayed,
    # not lost (error feedback), far closer than one quantisation alone
    once = (sent[0] - x).abs().max()
    assert ((torch.stack(sent).mean(0) - x).abs().max()) < once / 10


def test_feedback_is_kept_apart_per_stream_and_place_and_cleared():
    enc = Encoder("int8", error_feedback=True, pool=BufferPool())
    codec = enc.codec(torch.float32)
    x = torch.linspace(-1.0, 1.0, 300) ** 3
    fresh = decode(codec, enc.encode(x, codec, place=None), 300)  # exact copy: no state
    enc.stream = ("grads", b"a")
    first = decode(codec, enc.encode(x, codec, place=("contrib",)), 300)
    assert torch.equal(first, fresh)  # no residual yet for this key
    enc.stream = ("params", b"a")  # other data: its own residuals
    assert torch.equal(decode(codec, enc.encode(x, codec, place=("contrib",)), 300), fresh)
    enc.stream = ("grads", b"a")
    assert not torch.equal(decode(codec, enc.encode(x, codec, place=("contrib",)), 300), fresh)
    enc.clear()
    assert torch.equal(decode(codec, enc.encode(x, codec, place=("contrib",)), 300), fresh)
    assert torch.equal(decode(codec, enc.encode(x, codec, place=None), 300), fresh)


def test_without_feedback_every_call_encodes_what_it_is_given():
    enc = Encoder("int8", error_feedback=False, pool=BufferPool())
    codec = enc.codec(torch.float32)
    x = torch.linspace(-1.0, 1.0, 300) ** 3
    enc.stream = ("grads", b"a")
    a = decode(codec, enc.encode(x, codec, place=("contrib",)), 300)
    b = decode(codec, enc.encode(x, codec, place=("contrib",)), 300)
    assert torch.equal(a, b)


def test_a_cast_codec_goes_through_the_pools_wire_buffer():
    pool = BufferPool()
    enc = Encoder("bfloat16", error_feedback=False, pool=pool)
    x = torch.randn(10)
    codec = enc.codec(torch.float32)
    payload = enc.encode(x, codec, place=None)
    assert payload.numel() == codec.nbytes(10) == 20
    assert payload.data_ptr() == pool.get("wire", 20, torch.uint8, "cpu").data_ptr()
    assert torch.equal(codec.decode(payload, 10), x.to(torch.bfloat16))
