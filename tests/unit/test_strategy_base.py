"""``strategies/base.py`` against a ``FakeSync`` (tests/fakes.py): the ``Strategy`` contract's
defaults and the per-step baseline, ``GradAveraging``, decided in this process.

What a strategy asks of its sync, and when, is the policy under test: the start from rank
0's state (and none after a restore or in an elastic job), one gradient average per step
before the optimizer steps, the running statistics averaged once at the end, the bytes each
sync moved, and an elastic member's vote riding along with the gradients. The strategies on
real rank processes are in tests/test_strategies.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from fakes import FakeSync, PlainSGD
from ferrosync.elastic.ballot import LeaveBallot
from ferrosync.strategies.base import GradAveraging, Strategy, float_buffers, norm


def _model(batchnorm: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(3, 2)] + ([torch.nn.BatchNorm1d(2)] if batchnorm else [])
    return torch.nn.Sequential(*layers)


def _grads(model, value: float) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, value)


def test_attach_starts_every_rank_from_rank_0s_parameters_and_buffers():
    model, sync = _model(batchnorm=True), FakeSync(rank=1)
    Strategy().attach(model, None, sync)
    ((op, (src, tensors)),) = sync.calls
    expected = [*model.parameters(), *model.buffers()]
    assert (op, src) == ("broadcast_", 0) and len(tensors) == len(expected)
    # the model's own storage, so that rank 0's values land in the model
    assert all(t.data_ptr() == e.data_ptr() for t, e in zip(tensors, expected))


@pytest.mark.parametrize("how", ["restored", "elastic"])
def test_attach_broadcasts_nothing_after_a_restore_or_in_an_elastic_job(how):
    strategy, sync = Strategy(), FakeSync(elastic=how == "elastic")
    if how == "restored":
        strategy.load_state_dict(strategy.state_dict())
    strategy.attach(_model(), None, sync)
    assert sync.calls == [] and strategy.sync is sync


def test_the_bases_step_and_idle_sync_must_be_provided():
    strategy = Strategy()
    strategy.name = "mine"
    with pytest.raises(NotImplementedError):
        strategy.step(None, None)
    with pytest.raises(NotImplementedError, match="strategy 'mine' has no idle sync"):
        strategy.synchronize(None, None)
    # the local questions default to the per-step baseline's answers
    assert strategy.keep_going(4, 5) and not strategy.keep_going(5, 5)
    assert strategy.wants_batch() and strategy.progress(7) == 7


def test_grad_averages_the_gradients_then_steps_once_and_counts_the_bytes():
    model = _model()
    sync = FakeSync(moved=50, peer_parts=lambda n, grads: [(1.0, [g * 0 + 3.0 for g in grads])])
    optimizer = PlainSGD(model.parameters(), log=sync.calls)
    strategy = GradAveraging()
    strategy.attach(model, optimizer, sync)
    before = [p.detach().clone() for p in model.parameters()]
    sync.calls.clear()
    _grads(model, 1.0)
    telemetry = strategy.step(model, optimizer)
    assert sync.ops() == ["average_gradients", "optimizer.step"]
    # the mean of this rank's 1 and the peer's 3, applied with lr 1
    for p, b in zip(model.parameters(), before):
        assert torch.allclose(p.detach(), b - 2.0)
    assert telemetry["synced"] is True and telemetry["sync_bytes"] == 100
    assert telemetry["sync_s"] >= 0.0
    strategy.step(model, optimizer)
    assert strategy.stats == {"syncs": 2, "sync_bytes": 200}
    summary = strategy.summary()
    assert summary["sync_every"] == 1 and summary["syncs"] == 2
    assert set(summary) == set(Strategy().summary())  # the same keys for every strategy


def test_grad_averages_float_buffers_once_at_the_end_and_checkpoints_per_rank():
    model, sync = _model(batchnorm=True), FakeSync()
    strategy = GradAveraging()
    strategy.attach(model, None, sync)
    assert not strategy.replicated  # running statistics drift apart between steps
    sync.calls.clear()
    strategy.finish(model, None)
    ((op, (weight, tensors)),) = sync.calls
    bn = model[1]
    assert op == "average_" and weight == 1.0
    # the running statistics, in place; never the integer batch counter
    assert [t.data_ptr() for t in tensors] == [bn.running_mean.data_ptr(),
                                               bn.running_var.data_ptr()]
    assert [b.data_ptr() for b in float_buffers(model)] == [t.data_ptr() for t in tensors]
    plain = GradAveraging()
    plain.attach(_model(), None, FakeSync())
    assert plain.replicated
    sync = plain.sync
    sync.calls.clear()
    plain.finish(_model(), None)
    assert sync.calls == []  # nothing to average


def test_an_elastic_members_vote_rides_with_the_gradients_and_is_counted():
    model = _model()
    params = list(model.parameters())
    # three other members: two vote to leave in the first sync, one in the second
    votes = iter([1.0, 0.0, 0.0])

    def peers(n, tensors):
        vote = next(votes)
        return [(1.0, [*(t * 0 for t in tensors[:-1]), torch.full((1,), v, dtype=torch.float64)])
                for v in (vote, 1.0, 0.0)]

    sync = FakeSync(elastic=True, world_size=4, peer_parts=peers)
    strategy, optimizer, ballot = GradAveraging(), PlainSGD(params, lr=0.1), LeaveBallot()
    strategy.carry(ballot)
    strategy.attach(model, optimizer, sync)
    assert sync.calls == []  # elastic members agree on their start through the store
    ballot.vote = True
    _grads(model, 1.0)
    strategy.step(model, optimizer)
    assert ballot.voted and ballot.voters == 3  # this member, and two of the others
    (holder,) = strategy._held
    ballot.vote = False
    _grads(model, 1.0)
    strategy.step(model, optimizer)
    assert not ballot.voted and ballot.voters == 1
    assert strategy._held == [holder]  # a stable list: a codec's state is per list


def test_a_fixed_size_job_casts_no_ballot():
    strategy, ballot = Strategy(), LeaveBallot()
    strategy.sync = FakeSync()
    ballot.vote = True  # a fixed-size job's trainer carries no ballot
    assert strategy.riding([torch.zeros(2)]) == []
    strategy.arrived()
    assert ballot.voters == 0


def test_norm_is_one_vector_accumulated_in_float64():
    assert norm([torch.tensor([3.0]), torch.tensor([[4.0]])]) == 5.0
    big = torch.tensor([1e30, 1e30], dtype=torch.float32)  # its square overflows float32
    assert math.isclose(norm([big]), math.sqrt(2) * 1e30, rel_tol=1e-6)
    assert norm([]) == 0.0
