"""``strategies/diloco.py`` against a ``FakeSync`` (tests/fakes.py): the outer step on the
averaged pseudo-gradient, decided in this process.

The other rank's pseudo-gradient is scripted relative to this rank's, so the averaged
``Δ`` is known exactly and the outer step can be checked against the formula of SGD with
Nesterov momentum written out by hand; an outer SGD with lr 1 makes DiLoCo Local SGD; a
resumed run continues bit for bit from the checkpointed global copy and momentum. The
outer ``torch.optim.SGD`` is ``PlainSGD`` here, which follows its rule (constructing the
first real one imports ``torch._dynamo``, seconds); DiLoCo with the real one on real
ranks: tests/test_strategies.py.
"""

from __future__ import annotations

import pytest
import torch

from fakes import FakeSync, PlainSGD
from ferrosync.errors import ConfigError
from ferrosync.strategies.diloco import (
    OUTER_LR,
    OUTER_MOMENTUM,
    SPARSE_OUTER_LR,
    SPARSE_OUTER_MOMENTUM,
    DiLoCo,
)
from ferrosync.strategies.local_sgd import LocalSGD

LR = 0.5  # the inner optimizer's


@pytest.fixture(autouse=True)
def outer_sgd(monkeypatch):
    """DiLoCo's default outer optimizer, ``torch.optim.SGD``, as ``PlainSGD``; its settings."""
    made = []

    def sgd(params, **settings):
        made.append(settings)
        return PlainSGD(params, **settings)

    monkeypatch.setattr(torch.optim, "SGD", sgd)
    return made


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


def _window(strategy, model, optimizer, steps: int) -> dict:
    """``steps`` inner steps with every gradient 1; the telemetry of the last."""
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        telemetry = strategy.step(model, optimizer)
    return telemetry


def _peer_delta_plus(shift: float, mass: int):
    """The peer's pseudo-gradient: this rank's plus ``shift`` (it moved ``shift`` further),
    weighted by its ``mass`` (the batches it trained: gamma 1)."""
    return lambda n, tensors: [(float(mass), [t + shift for t in tensors])]


@pytest.mark.parametrize("settings, words", [
    ({"outer_lr": 0}, f"outer_lr.*the default is {OUTER_LR}"),
    ({"outer_momentum": -0.1}, "outer_momentum"),
    ({"outer_optimizer": "sgd"}, "outer_optimizer must be callable, got str"),
    ({"outer_device": "no-such-device"}, "'no-such-device' is not a torch device"),
    ({"sync_every": 3, "sync_every_seconds": 1.0}, "not both"),
])
def test_bad_settings_are_refused_before_any_sync(settings, words):
    with pytest.raises(ConfigError, match=words):
        DiLoCo(**settings)


def test_the_outer_step_is_nesterov_sgd_on_the_averaged_pseudo_gradient(outer_sgd):
    # every window: this rank's Δ is LR·2 = 1 (two inner steps), the peer's 3, so Δ = 2
    model = _model()
    start = [p.detach().clone().double() for p in model.parameters()]
    strategy, optimizer = DiLoCo(sync_every=2), PlainSGD(model.parameters(), lr=LR)
    strategy.attach(model, optimizer, FakeSync(peer_parts=_peer_delta_plus(2.0, 2)))
    assert outer_sgd == [{"lr": OUTER_LR, "momentum": OUTER_MOMENTUM, "nesterov": True}]
    delta, buf, theta = 2.0, 0.0, 0.0  # theta: how far θ_g moved from the start
    for _ in range(3):
        telemetry = _window(strategy, model, optimizer, 2)
        assert telemetry["synced"] and telemetry["masses"] == [2, 2]
        buf = OUTER_MOMENTUM * buf + delta
        theta -= OUTER_LR * (delta + OUTER_MOMENTUM * buf)  # Nesterov
        for p, s in zip(model.parameters(), start):
            assert torch.allclose(p.detach().double(), s + theta, atol=1e-5), (p, s + theta)


def test_an_outer_sgd_with_lr_1_is_local_sgd():
    # the peer ends each window 1 further along: Δ_peer = Δ + 1, θ_peer = θ - 1
    diloco_model, local_model = _model(), _model()
    diloco = DiLoCo(sync_every=3, outer_optimizer=lambda params: PlainSGD(params, lr=1.0))
    diloco_opt = PlainSGD(diloco_model.parameters(), lr=LR)
    diloco.attach(diloco_model, diloco_opt, FakeSync(peer_parts=_peer_delta_plus(1.0, 3)))
    local, local_opt = LocalSGD(sync_every=3), PlainSGD(local_model.parameters(), lr=LR)
    local.attach(local_model, local_opt, FakeSync(peer_parts=_peer_delta_plus(-1.0, 3)))
    for _ in range(2):
        a = _window(diloco, diloco_model, diloco_opt, 3)
        b = _window(local, local_model, local_opt, 3)
        assert a["synced"] and b["synced"]
        for x, y in zip(diloco_model.parameters(), local_model.parameters()):
            assert torch.allclose(x, y, atol=1e-6)
        assert a["divergence"] == pytest.approx(b["divergence"], rel=1e-5)


def test_a_resumed_run_continues_bit_for_bit_from_the_checkpointed_outer_state():
    whole_model = _model()
    whole, whole_opt = DiLoCo(sync_every=2), PlainSGD(whole_model.parameters(), lr=LR)
    whole.attach(whole_model, whole_opt, FakeSync(peer_parts=_peer_delta_plus(0.5, 2)))
    _window(whole, whole_model, whole_opt, 4)  # two syncs in one run

    first_model = _model()
    first, first_opt = DiLoCo(sync_every=2), PlainSGD(first_model.parameters(), lr=LR)
    first.attach(first_model, first_opt, FakeSync(peer_parts=_peer_delta_plus(0.5, 2)))
    _window(first, first_model, first_opt, 2)
    state = first.state_dict()
    assert len(state["outer"]["state"]) == 2  # the momentum buffers travel with it

    resumed_model = _model(seed=1)  # other initial weights: the checkpoint's replace them
    resumed_model.load_state_dict(first_model.state_dict())
    resumed, resumed_opt = DiLoCo(sync_every=2), PlainSGD(resumed_model.parameters(), lr=LR)
    resumed.load_state_dict(state)
    sync = FakeSync(peer_parts=_peer_delta_plus(0.5, 2))
    resumed.attach(resumed_model, resumed_opt, sync)
    assert sync.calls == []  # every rank resumes from its own state: nothing broadcast
    _window(resumed, resumed_model, resumed_opt, 2)
    for a, b in zip(resumed_model.parameters(), whole_model.parameters()):
        assert torch.equal(a, b)


def test_a_checkpoint_of_another_model_is_refused_at_attach():
    saved = DiLoCo(sync_every=2)
    saved.attach(_model(), None, FakeSync())
    state = saved.state_dict()
    bigger = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    again = DiLoCo(sync_every=2)
    again.load_state_dict(state)
    with pytest.raises(ConfigError, match="has 2 global tensors, this model 4") as info:
        again.attach(bigger, None, FakeSync(rank=1))
    assert info.value.rank == 1 and "resume with the model that wrote" in str(info.value)


@pytest.mark.parametrize("wire, settings, expected", [
    (None, {}, {"lr": OUTER_LR, "momentum": OUTER_MOMENTUM, "nesterov": True}),
    ("int8", {}, {"lr": OUTER_LR, "momentum": OUTER_MOMENTUM, "nesterov": True}),
    # SparseLoCo: the error feedback accumulates like momentum, so none on top
    ("topk", {}, {"lr": SPARSE_OUTER_LR, "momentum": SPARSE_OUTER_MOMENTUM,
                  "nesterov": False}),
    ("topk", {"outer_momentum": 0.5}, {"lr": SPARSE_OUTER_LR, "momentum": 0.5,
                                       "nesterov": True}),
    ("topk", {"outer_lr": 0.3, "outer_momentum": 0.9},
     {"lr": 0.3, "momentum": 0.9, "nesterov": True}),
])
def test_outer_step_defaults_follow_the_wire(outer_sgd, wire, settings, expected):
    strategy = DiLoCo(sync_every=2, **settings)
    strategy.attach(_model(), PlainSGD(_model().parameters(), lr=LR),
                    FakeSync(wire_dtype=wire))
    assert outer_sgd[-1] == expected


def test_topk_refuses_models_with_float_buffers_and_local_sgd_refuses_topk():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    sync = FakeSync(wire_dtype="topk")
    with pytest.raises(ConfigError, match="floating-point buffers"):
        DiLoCo().attach(model, PlainSGD(model.parameters(), lr=LR), sync)
    with pytest.raises(ConfigError, match="local-sgd cannot use wire_dtype='topk'"):
        LocalSGD().attach(_model(), PlainSGD(_model().parameters(), lr=LR), sync)
    assert sync.calls == []  # refused before any collective
