"""``strategies/local_sgd.py`` against a ``FakeSync`` (tests/fakes.py): what a Local SGD merge
does to the model (when it merges is tests/unit/test_periodic.py's).

The other rank's contribution is scripted relative to this rank's, so each expected value
is exact: the parameters and floating-point buffers become the work-weighted average,
integer buffers are never averaged, the telemetry compares before and after, and with one
step per window and plain SGD the result is per-step gradient averaging's.
"""

from __future__ import annotations

import math

import torch

from fakes import FakeSync, PlainSGD
from ferrosync.strategies.base import GradAveraging
from ferrosync.strategies.local_sgd import LocalSGD


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, 1), torch.nn.BatchNorm1d(1))


def _step(strategy, model, optimizer, grad: float = 1.0) -> dict:
    for p in model.parameters():
        p.grad = torch.full_like(p, grad)
    return strategy.step(model, optimizer)


def test_a_merge_is_the_work_weighted_average_of_parameters_and_float_buffers():
    # this rank trained 3 batches, the peer 1 and holds every value 4 higher: the average
    # is this rank's values plus 1, for the parameters and the running statistics alike
    model = _model()
    sync = FakeSync(peer_records=[{1: [1.0, 0.0]}],
                    peer_parts=lambda n, tensors: [(1.0, [t + 4.0 for t in tensors])])
    strategy, optimizer = LocalSGD(sync_every=3), PlainSGD(model.parameters(), lr=0.25)
    strategy.attach(model, optimizer, sync)
    model[1].num_batches_tracked.fill_(7)
    for _ in range(2):
        _step(strategy, model, optimizer)
    pre = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    pre_params = [p.detach().clone() - 0.25 for p in model.parameters()]  # after step 3
    telemetry = _step(strategy, model, optimizer)
    assert telemetry["synced"] and telemetry["masses"] == [3, 1]
    post = [t.detach() for t in (*model.parameters(), *model.buffers())]
    params = len(list(model.parameters()))
    for i, (b, a) in enumerate(zip(pre, post)):
        if a.is_floating_point():
            step = 0.25 if i < params else 0.0  # the third local step, then the merge
            assert torch.allclose(a, b - step + 1.0), (i, b, a)
    assert model[1].num_batches_tracked.item() == 7  # an integer buffer is never averaged
    post_params = [p.detach() for p in model.parameters()]
    distance = math.sqrt(sum(p.numel() for p in post_params))  # every entry moved by 1
    post_norm = math.sqrt(sum(float((p.double() ** 2).sum()) for p in post_params))
    pre_norm = math.sqrt(sum(float((p.double() ** 2).sum()) for p in pre_params))
    assert math.isclose(telemetry["divergence"], distance / post_norm, rel_tol=1e-5)
    assert math.isclose(telemetry["post_norm"], post_norm, rel_tol=1e-5)
    assert math.isclose(telemetry["pre_norm"], pre_norm, rel_tol=1e-5)


def test_one_step_windows_with_plain_sgd_are_gradient_averaging():
    """mean(p - lr·g_r) = p - lr·mean(g_r): the peer's gradient is 3 where this rank's is 1."""
    lr = 0.5
    local_model, grad_model = _model(), _model()
    params = len(list(local_model.parameters()))
    # the peer's parameters after its own step: this rank's, moved by lr·(3 - 1) more
    # (its buffers: this rank's)
    local, local_opt = LocalSGD(sync_every=1), PlainSGD(local_model.parameters(), lr=lr)
    local.attach(local_model, local_opt, FakeSync(peer_parts=lambda n, tensors: [
        (1.0, [t - lr * 2.0 if i < params else t for i, t in enumerate(tensors)])]))
    grad, grad_opt = GradAveraging(), PlainSGD(grad_model.parameters(), lr=lr)
    grad.attach(grad_model, grad_opt,
                FakeSync(peer_parts=lambda n, grads: [(1.0, [g * 3.0 for g in grads])]))
    for _ in range(3):
        assert _step(local, local_model, local_opt)["synced"]
        _step(grad, grad_model, grad_opt)
    for a, b in zip(local_model.parameters(), grad_model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_a_time_based_run_ends_with_rank_0s_integer_buffers():
    model = _model()
    sync = FakeSync(rank=1)
    strategy = LocalSGD(sync_every_seconds=5.0)
    strategy.attach(model, PlainSGD(model.parameters()), sync)
    sync.calls.clear()
    strategy.finish(model, None)  # every rank votes done at its first finishing sync
    op, (src, tensors) = sync.calls[-1]
    # ranks that took different numbers of steps count batches differently
    assert (op, src) == ("broadcast_", 0)
    assert [t.data_ptr() for t in tensors] == [model[1].num_batches_tracked.data_ptr()]
