"""Built-in tasks bigger than the demo, where compute weighs against communication
(``tools/bench/bench_goodput.py``, docs/goodput.md).

``wide``: synthetic classification from a fixed random teacher with a residual MLP
student (``TiedResidualMLP``; ``--batch-size`` sets the compute-to-communication
ratio). ``lm``: a small transformer predicting the next byte of the standard library's
own source. Nothing is downloaded; the wide data depend only on ``WIDE_DATA_SEED``.
"""

from __future__ import annotations

import os
import sysconfig

import torch
from torch.utils.data import TensorDataset

WIDE_FEATURES = 128
WIDE_LATENT = 32
WIDE_CLASSES = 10
WIDE_TEACHER_HIDDEN = 32
WIDE_HIDDEN = 512
WIDE_DEPTH = 4
WIDE_TRAIN_SIZE = 131072
WIDE_EVAL_SIZE = 8192
WIDE_DATA_SEED = 20251201


def wide_data() -> tuple[TensorDataset, TensorDataset]:
    """(train, eval) datasets of ``(features float32[WIDE_FEATURES], label int64)``."""
    g = torch.Generator().manual_seed(WIDE_DATA_SEED)
    n = WIDE_TRAIN_SIZE + WIDE_EVAL_SIZE
    mix = torch.randn(WIDE_LATENT, WIDE_FEATURES, generator=g) / WIDE_LATENT**0.5
    latent = torch.randn(n, WIDE_LATENT, generator=g)
    # structured, correlated inputs plus independent noise, rescaled to unit variance
    x = (latent @ mix + 0.5 * torch.randn(n, WIDE_FEATURES, generator=g)) / 1.25**0.5
    w1 = torch.randn(WIDE_FEATURES, WIDE_TEACHER_HIDDEN, generator=g) / WIDE_FEATURES**0.5
    w2 = torch.randn(WIDE_TEACHER_HIDDEN, WIDE_CLASSES, generator=g) / WIDE_TEACHER_HIDDEN**0.5
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    split = WIDE_TRAIN_SIZE
    return (TensorDataset(x[:split].contiguous(), y[:split].contiguous()),
            TensorDataset(x[split:].contiguous(), y[split:].contiguous()))


class TiedResidualMLP(torch.nn.Module):
    """``WIDE_FEATURES -> WIDE_HIDDEN``, then ``WIDE_DEPTH`` residual blocks
    ``h = h + relu(block(h))`` that all share one ``WIDE_HIDDEN x WIDE_HIDDEN`` layer,
    then ``-> WIDE_CLASSES``. Sharing the block (as ALBERT or universal transformers
    share layers) gives ``WIDE_DEPTH`` times the compute of one layer for one layer's
    parameters: a compute-to-communication ratio of about 1 at 100 Mbit/s with a
    per-rank batch small enough that loading batches stays a few percent of a step."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(WIDE_FEATURES, WIDE_HIDDEN)
        self.block = torch.nn.Linear(WIDE_HIDDEN, WIDE_HIDDEN)
        self.out = torch.nn.Linear(WIDE_HIDDEN, WIDE_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        for _ in range(WIDE_DEPTH):
            h = h + torch.relu(self.block(h))
        return self.out(h)


def wide_model() -> torch.nn.Module:
    """The student (``wide_parameters()`` parameters, ``TiedResidualMLP``)."""
    return TiedResidualMLP()


def wide_parameters() -> int:
    """Parameters of ``wide_model()`` (without building it)."""
    h, f, c = WIDE_HIDDEN, WIDE_FEATURES, WIDE_CLASSES
    return f * h + h + h * h + h + h * c + c


LM_CONTEXT = 32
LM_WIDTH = 64
LM_HEADS = 4
LM_LAYERS = 2
LM_TEXT_BYTES = 3 << 20
LM_TRAIN_SIZE = 131072
LM_EVAL_SIZE = 8192
LM_EVAL_SHARE = 0.1  # the last tenth of the text (whole files) is held out


def _stdlib_text() -> bytes:
    """Up to ``LM_TEXT_BYTES`` of the standard library's top-level ``*.py`` files, in
    name order (deterministic for one Python version)."""
    root = sysconfig.get_paths()["stdlib"]
    parts, size = [], 0
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not name.endswith(".py") or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        parts.append(data)
        size += len(data)
        if size >= LM_TEXT_BYTES:
            break
    return b"".join(parts)[:LM_TEXT_BYTES]


def _windows(text: torch.Tensor, count: int) -> TensorDataset:
    """``count`` evenly spaced (context, next byte) samples of ``text`` (uint8)."""
    starts = torch.linspace(0, len(text) - LM_CONTEXT - 1, count).long()
    idx = starts[:, None] + torch.arange(LM_CONTEXT + 1)
    windows = text[idx]
    return TensorDataset(windows[:, :LM_CONTEXT].contiguous(),
                         windows[:, LM_CONTEXT].long().contiguous())


def lm_data() -> tuple[TensorDataset, TensorDataset]:
    """(train, eval) datasets of ``(context uint8[LM_CONTEXT], next byte int64)``."""
    text = torch.frombuffer(bytearray(_stdlib_text()), dtype=torch.uint8)
    split = int(len(text) * (1 - LM_EVAL_SHARE))
    return _windows(text[:split], LM_TRAIN_SIZE), _windows(text[split:], LM_EVAL_SIZE)


class ByteLM(torch.nn.Module):
    """Byte embeddings plus learned positions, ``LM_LAYERS`` pre-norm transformer layers
    (no dropout: runs compare at equal steps), and a linear head on the last position."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, LM_WIDTH)
        self.pos = torch.nn.Parameter(torch.randn(LM_CONTEXT, LM_WIDTH) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(LM_WIDTH, LM_HEADS, 4 * LM_WIDTH,
                                                 dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.body = torch.nn.TransformerEncoder(layer, LM_LAYERS, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(LM_WIDTH)
        self.head = torch.nn.Linear(LM_WIDTH, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(self.embed(x.long()) + self.pos)
        return self.head(self.norm(h[:, -1]))


def lm_model() -> torch.nn.Module:
    """The byte-level language model (``ByteLM``, about 0.13 M parameters)."""
    return ByteLM()
