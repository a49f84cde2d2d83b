"""The tree reduce's reads in virtual time (ferrosync/elastic/tree.py in the simulator,
docs/elastic.md#the-tree-reduce): a role's inputs and the average's ranges are read
together, not one after another, and the average's bits do not depend on the order in
which they arrive."""

from __future__ import annotations

import re
from collections import defaultdict

import torch

from ferrosync.testing.sim import world as world_module
from ferrosync.testing.sim.store import SimServer, SimStorage
from ferrosync.testing.sim.world import World

MEMBERS = 20  # fan_in 8: level 1 has 3 groups of 6-7, level 2 one group of 3


def _requests(monkeypatch) -> list:
    """Every request a member sends the simulated store, as (virtual time it was sent,
    member, kind, key)."""
    seen: list = []
    real = SimStorage._request

    def request(self, kind: str, key: str) -> float:
        seen.append((self.server.sched.now, self.process.name, kind, key.rsplit("/", 1)[-1]))
        return real(self, kind, key)

    monkeypatch.setattr(SimStorage, "_request", request)
    return seen


def test_a_roles_inputs_and_the_averages_ranges_are_requested_at_one_instant(monkeypatch):
    """Each member asks for all the slices its level-1 role sums, and for all the ranges
    of the average it does not compute, at the same virtual instant: one round trip, where
    reading them one after another takes one request latency (> 0) each."""
    requests = _requests(monkeypatch)
    result = World(MEMBERS, 3, 4, min_ranks=MEMBERS).run()
    assert result["violations"] == [] and result["wrong_rounds"] == 0, result["details"]
    slices: dict = defaultdict(dict)  # (member, round) -> {key: first request's time}
    ranges: dict = defaultdict(dict)
    written = set()  # a create whose reply was lost reads its own object back: not an input
    for now, member, kind, key in requests:
        if kind == "put":
            written.add((member, key))
        if kind != "get" or (member, key) in written:
            continue
        if m := re.fullmatch(r"r(\d+)\.t0\.\d+\.\d+", key):
            slices[member, int(m[1])].setdefault(key, now)
        elif m := re.fullmatch(r"r(\d+)\.m\.\d+", key):
            ranges[member, int(m[1])].setdefault(key, now)
    for seen in (slices, ranges):
        multi = {k: v for k, v in seen.items() if len(v) > 1}
        assert len(multi) >= MEMBERS * 2  # most members, in rounds 2 and 3 at least
        for (member, round_), first in multi.items():
            assert len(set(first.values())) == 1, (member, round_, sorted(first.items()))


def _float_draws(self, member_id: str, round_: int) -> torch.Tensor:
    """A contribution whose float32 sums depend on their order (magnitudes 2**-8..2**8),
    drawn from the member and the round alone."""
    gen = torch.Generator().manual_seed(world_module._seed_of(member_id, round_) >> 1)
    grad = torch.randn(world_module.REAL_FLOATS, generator=gen) * \
        2.0 ** torch.randint(-8, 9, (world_module.REAL_FLOATS,), generator=gen)
    self.contributions[(member_id, round_)] = grad.clone()
    return grad


def _run(monkeypatch, store_seed: int) -> tuple[World, dict]:
    """The same members and contributions (world seed 7) over a store whose latencies
    come from ``store_seed``; returns the world and, per (round, range), the level-1
    nodes in the order they started writing that range's pieces."""
    requests = _requests(monkeypatch)
    # members arrive 2 s apart: the same queue, so the same rosters, in both runs
    world = World(MEMBERS, 3, 7, min_ranks=MEMBERS, spread_s=2.0 * MEMBERS)
    world.server = SimServer(world.sched, world.profile, store_seed,
                             scale=world.payload / (world_module.REAL_FLOATS * 4))
    result = world.run()
    # the simulator's exact reference assumes integer draws: only it may disagree
    assert set(result["violations"]) <= {"wrong_average"}, result["details"]
    order: dict = defaultdict(list)
    for _now, _member, kind, key in requests:
        m = re.fullmatch(r"r(\d+)\.t1\.(\d+)\.(\d+\.\d+)", key)
        if kind == "put" and m and int(m[2]) not in order[m[1], m[3]]:
            order[m[1], m[3]].append(int(m[2]))
    monkeypatch.undo()
    return world, order


def test_the_average_is_the_same_bits_whatever_order_its_inputs_arrive_in(monkeypatch):
    monkeypatch.setattr(World, "contribution", _float_draws)
    first, order_a = _run(monkeypatch, 101)
    monkeypatch.setattr(World, "contribution", _float_draws)
    second, order_b = _run(monkeypatch, 202)
    assert first.rosters == second.rosters and {1, 2, 3} <= set(first.rosters)
    # the level-2 sums' inputs came in other orders in the two runs ...
    assert sum(order_a[k] != order_b[k] for k in order_a) >= 3, (order_a, order_b)
    # ... on data whose float32 sum does depend on the order ...
    contributors = first.rosters[2][0]
    draws = [first.contributions[(m, 2)] for m in contributors]
    assert not torch.equal(sum(draws), sum(reversed(draws)))
    # ... and every member of both runs holds the same bytes after every round
    assert first.models == second.models and len(first.models) == 3
