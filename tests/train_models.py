"""Models and data for the trainer tests, importable by ranks as ``--model train_models:...``.

``DropoutMLP`` draws random numbers every step (dropout), so a resumed run matches an
uninterrupted one only if every rank's RNG state survives the checkpoint. With
``FERROSYNC_TEST_PAUSE_AT=K`` and ``FERROSYNC_TEST_PAUSE_RANK=R`` in the environment,
rank R announces itself in ``FERROSYNC_TEST_PAUSE_DIR`` at its K-th training forward
and waits there to be killed: the test then interrupts the run at a known step. With
``FERROSYNC_TEST_PAUSE_HOLD_TERM=1`` the paused rank outlives SIGTERM and announces it
(``paused.rR.term``): the launcher is then inside its stop, waiting for that rank.
"""

from __future__ import annotations

import os
import signal
import time

import torch
from torch.utils.data import TensorDataset

PAUSE_AT = "FERROSYNC_TEST_PAUSE_AT"
PAUSE_RANK = "FERROSYNC_TEST_PAUSE_RANK"
PAUSE_DIR = "FERROSYNC_TEST_PAUSE_DIR"
HOLD_TERM = "FERROSYNC_TEST_PAUSE_HOLD_TERM"


class DropoutMLP(torch.nn.Module):
    def __init__(self, features: int = 10, classes: int = 4) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(features, 32), torch.nn.ReLU(), torch.nn.Dropout(0.25),
            torch.nn.Linear(32, classes),
        )
        self.calls = 0
        pause = os.environ.get(PAUSE_AT)
        same_rank = os.environ.get(PAUSE_RANK, "0") == os.environ.get("RANK", "0")
        self.pause_at = int(pause) if pause and same_rank else 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls == self.pause_at:
                self._pause()
        return self.net(x)

    def _pause(self) -> None:
        marker = os.path.join(os.environ[PAUSE_DIR], f"paused.r{os.environ.get('RANK', '0')}")
        if os.environ.get(HOLD_TERM) == "1":
            signal.signal(signal.SIGTERM, lambda signum, frame: _announce(marker + ".term"))
        _announce(marker)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the test kills this process
            time.sleep(0.05)
        raise RuntimeError("test pause: nobody stopped this rank within 120 s")


def _announce(path: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def dropout_mlp() -> torch.nn.Module:
    return DropoutMLP()


def wide_mlp() -> torch.nn.Module:
    """Same input and output as the demo, different parameter shapes."""
    return torch.nn.Sequential(torch.nn.Linear(10, 48), torch.nn.ReLU(), torch.nn.Linear(48, 4))


def small_data(n: int = 600, features: int = 10, classes: int = 4):
    """A small deterministic (train, eval) classification set."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, features, generator=g)
    y = (x[:, :classes] * torch.arange(1, classes + 1)).argmax(dim=1)
    cut = n * 5 // 6
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


HOLD = "FERROSYNC_TEST_HOLD"
HOLD_AT = "FERROSYNC_TEST_HOLD_AT"


class PacedMLP(torch.nn.Module):
    """The demo's model with a fixed compute time per training forward
    (``FERROSYNC_TEST_STEP_S`` seconds, default 0.01): a stand-in for a model whose
    step takes that long. Same parameters as the demo's.

    With ``FERROSYNC_TEST_HOLD=PATH`` and ``FERROSYNC_TEST_HOLD_AT=K``, the K-th
    training forward waits while PATH exists: the test holds the job mid-round until a
    newcomer has asked to join, however slowly this machine starts a process, and lets
    it go by deleting PATH."""

    def __init__(self) -> None:
        super().__init__()
        from ferrosync.train import demo

        self.net = demo.model()
        self.step_s = float(os.environ.get("FERROSYNC_TEST_STEP_S", "0.01"))
        self.hold = os.environ.get(HOLD)
        self.hold_at = int(os.environ.get(HOLD_AT, "0"))
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.hold and self.calls == self.hold_at:
                self._wait_for_release()
            time.sleep(self.step_s)  # the time a bigger model would compute
        return self.net(x)

    def _wait_for_release(self) -> None:
        deadline = time.monotonic() + 120
        while os.path.exists(self.hold):
            if time.monotonic() > deadline:
                raise RuntimeError(f"test hold: {self.hold} still there after 120 s")
            time.sleep(0.02)


def paced_mlp() -> torch.nn.Module:
    return PacedMLP()


def paced_tanh_mlp() -> torch.nn.Module:
    """``paced_mlp`` with Tanh instead of ReLU: the same parameter shapes, another model."""
    model = PacedMLP()
    for i, layer in enumerate(model.net):
        if isinstance(layer, torch.nn.ReLU):
            model.net[i] = torch.nn.Tanh()
    return model


def raising() -> torch.nn.Module:
    """A factory that fails on its own (a missing weights file): bad --model input."""
    raise FileNotFoundError("weights.pt: no such file")


def value_reading() -> torch.nn.Module:
    """A factory that cannot build on the meta device (it reads a value): the launcher
    leaves it to the ranks."""
    model = torch.nn.Linear(10, 4)
    if float(model.weight.detach().sum()) != float(model.weight.detach().sum()):  # a value
        raise AssertionError("unreachable")
    return model
