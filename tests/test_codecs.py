"""Wire codecs: exactness where promised, bounded error otherwise, non-finite kept."""

from __future__ import annotations

import pytest
import torch

from ferrosync.compression.codecs import (
    INT8_BLOCK,
    CastCodec,
    ErrorFeedback,
    Int8Codec,
    RawCodec,
    check_wire_dtype,
    codec_for,
)
from ferrosync.errors import ConfigError

pytestmark = pytest.mark.unit


def roundtrip(codec, x):
    out = torch.empty(codec.nbytes(x.numel()), dtype=torch.uint8)
    codec.encode(x, out)
    return codec.decode(out, x.numel())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                   torch.int64])
def test_raw_is_exact(dtype):
    x = (torch.randn(1001) * 100).to(dtype)
    assert torch.equal(roundtrip(RawCodec(dtype), x), x)


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16])
def test_cast_equals_torch_cast(wire):
    x = torch.randn(513)
    assert torch.equal(roundtrip(CastCodec(wire), x), x.to(wire))
    assert CastCodec(wire).nbytes(513) == 513 * 2


@pytest.mark.parametrize("n", [1, INT8_BLOCK - 1, INT8_BLOCK, 3 * INT8_BLOCK + 17])
def test_int8_error_bound_and_size(n):
    x = torch.randn(n) * torch.logspace(-3, 3, n)
    y = roundtrip(Int8Codec(), x)
    # the error of each element is at most half a step of its frame's scale
    padded = torch.nn.functional.pad(x, (0, -n % INT8_BLOCK)).reshape(-1, INT8_BLOCK)
    step = padded.abs().amax(dim=1, keepdim=True) / 127
    bound = (step / 2).expand(-1, INT8_BLOCK).reshape(-1)[:n] * (1 + 1e-6)
    assert ((y - x).abs() <= bound).all()
    assert Int8Codec().nbytes(n) == -(-n // INT8_BLOCK) * (INT8_BLOCK + 4)


def test_int8_is_under_30_percent_of_float32():
    n = 1 << 20
    assert Int8Codec().nbytes(n) / (4 * n) < 0.30


def test_non_finite_values_stay_non_finite():
    x = torch.zeros(3 * INT8_BLOCK)
    x[5] = float("inf")
    x[INT8_BLOCK + 7] = float("nan")
    y = roundtrip(Int8Codec(), x)
    assert not torch.isfinite(y[:INT8_BLOCK]).any()
    assert not torch.isfinite(y[INT8_BLOCK: 2 * INT8_BLOCK]).any()
    assert torch.equal(y[2 * INT8_BLOCK:], x[2 * INT8_BLOCK:])  # clean frames unaffected
    z = roundtrip(CastCodec(torch.bfloat16), x)
    assert torch.isinf(z[5]) and torch.isnan(z[INT8_BLOCK + 7])


def test_error_feedback_delays_error_instead_of_losing_it():
    codec, ef = Int8Codec(), ErrorFeedback()
    x = torch.randn(4 * INT8_BLOCK) * 0.01
    x[0] = 10.0  # a large value makes small ones in its frame quantise to zero
    sent_total = torch.zeros_like(x)
    steps = 200
    for _ in range(steps):
        comp = ef.compensate("k", x)
        wire = torch.empty(codec.nbytes(x.numel()), dtype=torch.uint8)
        codec.encode(comp, wire)
        decoded = codec.decode(wire, x.numel())
        ef.remember("k", comp, decoded)
        sent_total += decoded
    # with feedback, the running mean converges to the true value
    err_fb = (sent_total / steps - x).abs().max().item()
    err_plain = (roundtrip(codec, x) - x).abs().max().item()
    assert err_fb < err_plain / 20


def test_codec_selection_and_validation():
    assert isinstance(codec_for(torch.float32, None), RawCodec)
    assert isinstance(codec_for(torch.float32, "float32"), RawCodec)
    assert isinstance(codec_for(torch.float32, "bfloat16"), CastCodec)
    assert isinstance(codec_for(torch.float16, "int8"), Int8Codec)
    assert isinstance(codec_for(torch.int64, "int8"), RawCodec)  # integers are never lossy
    assert check_wire_dtype(torch.bfloat16) == "bfloat16"
    with pytest.raises(ConfigError):
        check_wire_dtype("int4")
