"""``strategies/periodic.py`` against a ``FakeSync`` (tests/fakes.py): when a periodic strategy
synchronises and how much each rank counts, decided in this process (``LocalSGD`` is the
concrete class; what its merge does is tests/unit/test_local_sgd.py's).

The other ranks' records are scripted, so every branch of the policy is reached from one
rank's point of view: the cadence in steps (with and without a known end, where the sync
needs no gather), in seconds on a ``FakeClock``, the weights ``mass ** gamma`` and 0 for an
idle rank, a sync where every rank is idle, ``finish`` waiting for every rank's vote, the
time-based budget shared out by speed, and an elastic member's merge.
"""

from __future__ import annotations

import pytest
import torch

from fakes import FakeClock, FakeSync, PlainSGD
from ferrosync.errors import ConfigError
from ferrosync.strategies import periodic
from ferrosync.strategies.local_sgd import LocalSGD


@pytest.fixture
def clock(monkeypatch):
    return FakeClock().install(monkeypatch, periodic)


def _attached(strategy, sync):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = PlainSGD(model.parameters(), lr=0.5)
    strategy.attach(model, optimizer, sync)
    sync.calls.clear()  # attach's broadcast
    return model, optimizer


def _train(strategy, model, optimizer, steps, clock=None, seconds=0.0) -> list[bool]:
    """``steps`` training steps (each ``seconds`` long on ``clock``); which ones synced."""
    synced = []
    for _ in range(steps):
        if clock is not None:
            clock.advance(seconds)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        synced.append(strategy.step(model, optimizer)["synced"])
    return synced


# -- settings ----------------------------------------------------------------------------------

@pytest.mark.parametrize("settings, words", [
    ({"sync_every": 5, "sync_every_seconds": 2.0}, "not both"),
    ({"sync_every": 0}, "sync_every"),
    ({"sync_every": 2.5}, "sync_every"),
    ({"sync_every_seconds": 0}, "sync_every_seconds"),
    ({"gamma": -1}, "gamma"),
])
def test_bad_settings_are_refused_before_any_sync(settings, words):
    with pytest.raises(ConfigError, match=words):
        LocalSGD(**settings)


def test_the_cadence_defaults_to_the_classes_own_period():
    assert LocalSGD().sync_every == LocalSGD.default_sync_every
    assert LocalSGD().cadence == f"every {LocalSGD.default_sync_every} steps"
    timed = LocalSGD(sync_every_seconds=2.5)
    assert (timed.lockstep, timed.sync_every, timed.cadence) == (False, None, "every 2.5 s")


def test_a_window_too_close_to_the_timeout_is_refused_at_attach():
    with pytest.raises(ConfigError, match=r"too close to the sync timeout \(3 s\)") as info:
        _attached(LocalSGD(sync_every_seconds=2.0), FakeSync(rank=1, timeout=3.0))
    assert info.value.rank == 1 and "raise --timeout" in str(info.value)


def test_an_elastic_job_merges_by_steps_only():
    with pytest.raises(ConfigError, match="needs a fixed membership"):
        _attached(LocalSGD(sync_every_seconds=2.0), FakeSync(elastic=True))


# -- the cadence in steps ----------------------------------------------------------------------

def test_lockstep_syncs_every_h_steps_with_a_gather_of_the_masses():
    strategy, sync = LocalSGD(sync_every=3), FakeSync()
    model, optimizer = _attached(strategy, sync)
    assert _train(strategy, model, optimizer, 6) == [False, False, True] * 2
    assert optimizer.steps == 6
    assert sync.ops() == ["all_gather", "average_"] * 2
    assert sync.calls[0][1] == [3.0, 0.0]  # its mass, and not done
    assert strategy.summary()["masses"] == [6, 6]


def test_a_known_end_syncs_the_remainder_and_needs_no_gather():
    strategy, sync = LocalSGD(sync_every=3, gamma=0.5), FakeSync()
    model, optimizer = _attached(strategy, sync)
    strategy.begin(7)
    synced = []
    step = 0
    while strategy.keep_going(step, 7):
        synced += _train(strategy, model, optimizer, 1)
        step += 1
    assert synced == [False, False, True, False, False, True, True]  # the last window: 1
    assert sync.ops() == ["average_"] * 3  # every rank's record is its own: no gather
    assert sync.weights() == [3 ** 0.5, 3 ** 0.5, 1.0]
    strategy.finish(model, optimizer)
    assert len(sync.calls) == 3  # every rank voted done at its last sync


# -- the weights -------------------------------------------------------------------------------

@pytest.mark.parametrize("gamma", [1.0, 0.0, 2.0])
def test_each_rank_weighs_its_mass_to_the_gamma_and_an_idle_one_nothing(gamma):
    records = [{0: [3.0, 0.0], 1: [1.0, 0.0], 2: [0.0, 0.0]}]
    for rank, mass in ((0, 3), (1, 1), (2, 0)):
        strategy = LocalSGD(sync_every=5, gamma=gamma)
        sync = FakeSync(rank=rank, world_size=3, peer_records=records)
        model, optimizer = _attached(strategy, sync)
        _train(strategy, model, optimizer, mass)
        telemetry = strategy.synchronize(model, optimizer)
        assert telemetry["masses"] == [3, 1, 0] and not telemetry["skipped"]
        assert sync.weights() == [mass ** gamma if mass else 0.0]
        assert strategy.summary()["masses"] == [3, 1, 0]


def test_a_sync_where_every_rank_is_idle_is_skipped_everywhere():
    strategy, sync = LocalSGD(sync_every=3), FakeSync()
    model, optimizer = _attached(strategy, sync)
    before = [p.detach().clone() for p in model.parameters()]
    telemetry = strategy.synchronize(model, optimizer)
    assert telemetry["skipped"] and telemetry["divergence"] == 0.0
    assert sync.ops() == ["all_gather"]  # nothing merged, nothing moved
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    summary = strategy.summary()
    assert summary["skipped_syncs"] == 1 and summary["divergence_mean"] is None


def test_finish_joins_syncs_until_every_rank_voted_done():
    # the peer is still training at this rank's first finishing sync, done at the second
    strategy = LocalSGD(sync_every=5)
    sync = FakeSync(peer_records=[{1: [2.0, 0.0]}, {1: [1.0, 1.0]}])
    model, optimizer = _attached(strategy, sync)
    strategy.finish(model, optimizer)
    gathers = [detail for op, detail in sync.calls if op == "all_gather"]
    assert gathers == [[0.0, 1.0], [0.0, 1.0]]  # zero mass, voting done, twice
    assert sync.weights() == [0.0, 0.0]  # took part in the peer's merges with nothing
    assert strategy.summary()["masses"] == [0, 3]


# -- the cadence in seconds --------------------------------------------------------------------

def test_a_time_window_closes_on_this_ranks_own_clock(clock):
    strategy, sync = LocalSGD(sync_every_seconds=2.0), FakeSync()
    model, optimizer = _attached(strategy, sync)
    synced = _train(strategy, model, optimizer, 8, clock, seconds=0.5)
    assert synced == [False, False, False, True] * 2  # the window restarts at each sync
    assert [detail for op, detail in sync.calls if op == "all_gather"] == [[4.0, 0.0]] * 2
    assert strategy.keep_going(8, 8)  # time-based without begin(): until told to stop


def test_a_time_budget_is_shared_out_by_speed_and_ends_everywhere_at_once(clock):
    # 2 ranks, 5 steps of the baseline: 10 batches. This rank trains 2 in the first
    # window while the peer trains 6; the 2 left are apportioned 1 and 1.
    strategy = LocalSGD(sync_every_seconds=2.0)
    sync = FakeSync(peer_records=[{1: [6.0, 0.0]}, {1: [1.0, 0.0]}])
    model, optimizer = _attached(strategy, sync)
    strategy.begin(5)
    assert strategy._quota == 5 and strategy.progress(0) == 0  # even, before any mass
    assert _train(strategy, model, optimizer, 2, clock, seconds=1.0) == [False, True]
    assert strategy.progress(2) == 4  # 8 of the 10 batches, per rank of the baseline
    assert strategy.wants_batch() and strategy.keep_going(2, 5)
    assert _train(strategy, model, optimizer, 1, clock, seconds=0.1) == [True]  # its quota
    assert not strategy.keep_going(3, 5) and strategy.progress(3) == 5
    assert strategy.summary()["masses"] == [3, 7]


def test_a_rank_whose_quota_is_zero_joins_the_next_sync_without_a_batch(clock):
    strategy = LocalSGD(sync_every_seconds=2.0)
    sync = FakeSync(rank=1, world_size=2, peer_records=[{0: [3.0, 0.0]}])
    model, optimizer = _attached(strategy, sync)
    strategy.begin(2)  # 4 batches
    clock.advance(2.0)
    strategy.synchronize(model, optimizer)  # this rank trained none: 3 done, 1 left
    assert strategy._quota == 0 and not strategy.wants_batch()
    assert strategy.keep_going(0, 2)


# -- checkpoints and elastic jobs --------------------------------------------------------------

def test_the_state_round_trips_and_a_changed_cadence_or_world_is_refused():
    strategy, sync = LocalSGD(sync_every=2), FakeSync(world_size=3)
    model, optimizer = _attached(strategy, sync)
    _train(strategy, model, optimizer, 3)
    state = strategy.state_dict()
    again = LocalSGD(sync_every=2)
    again.load_state_dict(state)
    assert again.state_dict() == state and state["window"] == 1 and state["masses"] == [2] * 3
    with pytest.raises(ValueError, match="synced every 2 steps with gamma 1.0, this run "
                                         "every 4 steps with gamma 1.0"):
        LocalSGD(sync_every=4).load_state_dict(state)
    with pytest.raises(ConfigError, match="the strategy state is for 3 ranks, this run has 2"):
        _attached(again, FakeSync(world_size=2))


def test_an_elastic_member_merges_its_own_window_without_a_gather():
    sync = FakeSync(elastic=True, world_size=3)
    strategy = LocalSGD(sync_every=2, gamma=2.0)
    model, optimizer = _attached(strategy, sync)
    assert sync.calls == []  # elastic members start from the store, not a broadcast
    assert _train(strategy, model, optimizer, 4) == [False, True, False, True]
    assert sync.ops() == ["average_"] * 2 and sync.weights() == [4.0, 4.0]
    assert strategy.summary()["masses"] is None  # per-rank totals mean nothing here
