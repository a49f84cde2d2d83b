"""``elastic/events.py``: the membership event a sync whose members change delivers to its
subscribers (``GradSync.on_membership``), and how the strategies take it: the current
members at once, then one event per change naming who joined and who left, none while
the members stay; a fixed-size sync never calls back. ElasticSync's events under churn
are checked by the simulator's invariants (tests/test_elastic_sim.py).
"""

from __future__ import annotations

import pytest
import torch

from fakes import FakeSync, PlainSGD
from ferrosync.api import GradSync
from ferrosync.elastic.ballot import LeaveBallot
from ferrosync.elastic.events import MembershipChange, Subscribers
from ferrosync.errors import ConfigError
from ferrosync.strategies import GradAveraging, LocalSGD, StreamingDiLoCo

pytestmark = pytest.mark.unit


def test_a_subscriber_hears_the_members_at_once_then_each_change():
    subscribers, heard, later = Subscribers(), [], []
    subscribers.adopt(3, 0, ("a", "b"))  # no subscriber yet: nothing to tell
    subscribers.subscribe(heard.append, 3, 1, ("a", "b"))
    assert heard == [MembershipChange(3, 1, 2, ("a", "b"), ("a", "b"), ())]
    subscribers.adopt(4, 1, ("a", "b"))  # the same members: no event
    subscribers.subscribe(later.append, 4, 1, ("a", "b"))
    subscribers.adopt(5, 0, ("b", "c", "d"))
    change = MembershipChange(5, 0, 3, ("b", "c", "d"), ("c", "d"), ("a",))
    assert heard[1:] == [change] and later[1:] == [change]  # in subscription order, once
    assert len(heard) == 2


def test_a_fixed_size_sync_never_calls_back():
    heard = []
    FakeSync().on_membership(heard.append)
    assert heard == []
    GradSync.on_membership(None, heard.append)  # the contract's default
    assert heard == []


def test_a_strategy_keeps_the_latest_event_and_merges_its_own_window_under_churn():
    sync = FakeSync(elastic=True, world_size=3)
    strategy = LocalSGD(sync_every=1)
    model = torch.nn.Linear(2, 1)
    optimizer = PlainSGD(model.parameters(), lr=0.1)
    strategy.attach(model, optimizer, sync)
    assert strategy.membership.world_size == 3 and sync.calls == []
    sync.change(1, 0, ("m1", "m4"), joined=("m4",), left=("m0", "m2"))
    assert (strategy.membership.rank, strategy.membership.world_size) == (0, 2)
    assert strategy.membership.left == ("m0", "m2")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    assert strategy.step(model, optimizer)["synced"]
    assert sync.ops() == ["average_"]  # the merge alone, never a gather
    assert strategy.summary()["masses"] is None


def test_with_a_fixed_membership_a_strategy_hears_nothing_and_broadcasts_the_start():
    strategy, sync = GradAveraging(), FakeSync()
    strategy.attach(torch.nn.Linear(2, 1), None, sync)
    assert strategy.membership is None and sync.ops() == ["broadcast_"]


def test_streaming_diloco_refuses_a_rider_it_could_not_carry():
    with pytest.raises(ConfigError, match="cannot carry LeaveBallot: its fragments sync in "
                                          "several overlapped exchanges"):
        StreamingDiLoCo(sync_every=8, fragments=2).carry(LeaveBallot())
