"""The built-in demo task: a small MLP learns a synthetic classification problem.

Nothing is downloaded. Inputs are standard-normal vectors; each label is the
argmax of a fixed random "teacher" network's output, so the task is learnable
(a student MLP can represent the teacher) but not linearly separable. The data
depend only on ``DATA_SEED``, never on ``--seed`` or the number of ranks, so runs
with different settings train on the same problem.

These two functions are also the reference for ``--model`` and ``--data``:
``python -m ferrosync.train --model ferrosync.train.demo:model
--data ferrosync.train.demo:data`` is exactly the default run.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

FEATURES = 10
CLASSES = 4
TEACHER_HIDDEN = 16
HIDDEN = 64
TRAIN_SIZE = 32768
EVAL_SIZE = 4096
DATA_SEED = 20240611


def data() -> tuple[TensorDataset, TensorDataset]:
    """(train, eval) datasets of ``(features float32[FEATURES], label int64)`` pairs."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    w1 = torch.randn(FEATURES, TEACHER_HIDDEN, generator=generator) / FEATURES**0.5
    w2 = torch.randn(TEACHER_HIDDEN, CLASSES, generator=generator) / TEACHER_HIDDEN**0.5
    x = torch.randn(TRAIN_SIZE + EVAL_SIZE, FEATURES, generator=generator)
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    return (TensorDataset(x[:TRAIN_SIZE], y[:TRAIN_SIZE]),
            TensorDataset(x[TRAIN_SIZE:], y[TRAIN_SIZE:]))


def model() -> torch.nn.Module:
    """The student: FEATURES -> 64 -> 64 -> CLASSES with ReLU (about 5k parameters)."""
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )
