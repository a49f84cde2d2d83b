"""The tree reduce of elastic averages from 5 members on (ferrosync/elastic/tree.py,
docs/elastic.md#the-tree-reduce): its plan's bounds, and real member processes that
average through it, one of them dying in the middle of a tree round."""

from __future__ import annotations

import os

import pytest
import torch
from test_elastic import FAST, TIMEOUT, _values, w_fixed

import ferrosync
from ferrosync.core.runtime import Runtime
from ferrosync.elastic import tree
from ferrosync.elastic.options import ElasticOptions
from ferrosync.elastic.tree import TREE_FROM, TreePlan
from ranks import collect, run_ranks, start_ranks, wait_until

MIB = 1 << 20


# -- the plan: what every member computes alike ---------------------------------------------

@pytest.mark.parametrize("fan_in", [2, 3, 8])
@pytest.mark.parametrize("members", [5, 6, 7, 8, 9, 16, 17, 31, 64, 65, 100, 257])
@pytest.mark.unit
def test_the_plan_splits_every_range_and_gives_each_member_one_part_per_level(members, fan_in):
    plan = TreePlan(members, fan_in)
    units = 10_007
    for length in range(1, plan.depth + 1):
        spans = [plan.span(p, units) for p in plan.paths(length)]
        assert spans[0][0] == 0 and spans[-1][1] == units
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # a partition, in order
    per_level: dict[tuple[int, int], int] = {}
    for role, position in plan.assignments:
        assert 0 <= position < members
        if role[0] == "sum":
            per_level[(role[1], position)] = per_level.get((role[1], position), 0) + 1
    # every range of every level is summed by exactly one position, none twice a level
    assert max(per_level.values()) == 1
    for level in range(1, plan.depth + 1):
        sums = [r for r, _ in plan.assignments if r[0] == "sum" and r[1] == level]
        assert len(sums) == plan.nodes(level) * len(plan.paths(level))
    assert plan.nodes(plan.depth) == 1


@pytest.mark.unit
def test_no_member_reads_more_than_two_and_a_half_payloads_at_any_size():
    """The bound the tree is for, with the default fan-in: the busiest member's bytes
    per round stay under 2.5 P and its requests grow with log W, not W."""
    fan_in = ElasticOptions.parse({}).fan_in
    worst = {}
    for members in [*range(TREE_FROM, 80), 100, 128, 129, 500, 512, 513, 1000, 1024]:
        t = TreePlan(members, fan_in).traffic()
        busiest = max(x["read"] for x in t)
        assert busiest < 2.5, (members, busiest)
        assert 1.5 <= sum(x["read"] for x in t) / members <= 2.05
        worst[members] = max(x["puts"] + x["gets"] for x in t)
    assert worst[1000] < 80 < 999  # all-read-all: W - 1 GETs of contributions alone
    assert worst[1000] < 4 * worst[16]


@pytest.mark.unit
def test_each_member_takes_exactly_the_roles_whose_owner_it_is():
    """``TreeRound._mine`` (found by position) is the rule ``_owner`` states for every
    role: the designee's substitute, over rosters where some positions sit out."""
    import random
    from types import SimpleNamespace

    rng = random.Random(0)
    for members in (5, 7, 16, 37, 100, 257):
        plan = TreePlan(members, 4)
        ids = tuple(f"{i:016x}" for i in range(members))
        for _ in range(6):
            out = set(rng.sample(range(members), rng.randrange(members)))  # sit out
            roster = SimpleNamespace(round=3, members=ids,
                                     contributors=tuple(m for i, m in enumerate(ids)
                                                        if i not in out))
            taken = []
            for me in ids:
                r = tree.TreeRound(SimpleNamespace(member_id=me, clock=Runtime()), plan,
                                   SimpleNamespace(members=ids), roster, None, b"", [], 1.0,
                                   0.0)
                mine = r._mine()
                assert mine == [(role, d) for role, d in plan.assignments
                                if r._owner(role, d) == me]
                taken += mine
            assert sorted(taken) == sorted(plan.assignments)  # each role to one member


# -- members averaging through the tree ------------------------------------------------------

def w_tree(index, _world, url, job, members, rounds, options):
    with ferrosync.connect(url, elastic=True, min_ranks=members, job=job, timeout=TIMEOUT,
                           **FAST, **options) as sync:
        out = []
        for k in range(rounds):
            tensors = _values(index, k)
            sent = [t.clone() for t in tensors]
            weight = 0.0 if index == 1 and k == 1 else float(index + 1)
            total = sync.average_(tensors, weight=weight)
            out.append((total, sent, tensors, list(sync.membership)))
        return {"id": sync.member_id, "out": out}


def test_five_members_in_one_group_match_the_fixed_size_backend_bit_for_bit(tmp_path):
    """With one level (W <= fan_in) each range sums every contributor in roster order:
    exactly the all-read-all average, and the fixed-size backend's."""
    got = run_ranks(w_tree, 5, str(tmp_path / "el"), "one", 5, 3, {}, timeout=120)
    members = got[0]["out"][0][3]
    order = [None] * 5
    for index, g in enumerate(got):
        order[members.index(g["id"])] = index
    for g in got[1:]:
        for (t0, _, a, _m), (t1, _, b, _n) in zip(got[0]["out"], g["out"]):
            assert t0 == t1 and all(torch.equal(x, y) for x, y in zip(a, b))
    # the fixed-size backend with the same weights (index 1 sends weight 0 in round 1)
    fixed = run_ranks(w_fixed, 5, str(tmp_path / "fixed"), order, 3, (1, 1), timeout=120)
    for (te, _, e, _m), (tf, f) in zip(got[0]["out"], fixed[0]):
        assert te == tf
        assert all(torch.equal(x, y) for x, y in zip(e, f)), "tree != fixed-size backend"


def _exact(got, k):
    """The weighted average of round ``k``'s contributions, in float64."""
    weights = [0.0 if i == 1 and k == 1 else float(i + 1) for i in range(len(got))]
    total = sum(weights)
    sent = [g["out"][k][1] for g in got]
    return total, [sum(w * s[j].double() for w, s in zip(weights, sent)) / total
                   for j in range(len(sent[0]))]


@pytest.mark.parametrize("wire_dtype", [None, "int8"])
def test_a_deep_tree_averages_alike_on_every_member(tmp_path, wire_dtype):
    """fan_in=2 makes a tree of several levels out of 5 members: partial sums travel up
    as float32 pieces and the average comes back down; every member gets the same bits,
    the exact weighted average up to float rounding (and the codec's error), a member
    with weight 0 counting for nothing."""
    options = {"fan_in": 2, "wire_dtype": wire_dtype}
    got = run_ranks(w_tree, 5, str(tmp_path / "el"), "deep", 5, 3, options, timeout=120)
    assert TreePlan(5, 2).depth == 2
    for k in range(3):
        reference = got[0]["out"][k]
        for g in got[1:]:
            assert g["out"][k][0] == reference[0]
            assert all(torch.equal(x, y) for x, y in zip(g["out"][k][2], reference[2]))
        total, exact = _exact(got, k)
        assert reference[0] == total
        tol = [1e-6, 2e-3, 2e-2] if wire_dtype is None else [0.05, 0.05, 0.05]
        for value, want, t in zip(reference[2], exact, tol):
            assert torch.allclose(value.double(), want, atol=t), (k, value, want)


def test_each_member_reads_under_two_and_a_half_payloads(tmp_path):
    """Measured through ``sync.stats`` (every byte the member's storage read in the
    round, heartbeats included): 1 MiB float32 payloads, 5 members."""
    got = run_ranks(w_bytes, 5, str(tmp_path / "el"), timeout=120)
    for rows in got:
        for read in rows:
            assert 1.0 * MIB < read < 2.5 * MIB, [r / MIB for r in rows]


def w_bytes(index, _world, url):
    with ferrosync.connect(url, elastic=True, min_ranks=5, job="bytes", timeout=TIMEOUT,
                           **FAST) as sync:
        flat = torch.full((MIB // 4,), float(index))
        sync.average_([flat])  # the first round through the tree (5 members)
        reads = []
        for _ in range(3):
            sync.average_([flat])
            reads.append(sync.stats["last"]["bytes_read"])
        sync.barrier()
        return reads


def w_dies(index, _world, url, gate):
    open(os.path.join(gate, str(index)), "w").close()
    wait_until(lambda: len(os.listdir(gate)) == 5, "all five members at the gate")
    with ferrosync.connect(url, elastic=True, min_ranks=4, job="dies", timeout=TIMEOUT,
                           **FAST) as sync:
        while sync.world_size < 5:
            sync.barrier()
        out = []
        for k in range(4):
            if k == 2 and index == 4:
                # dies after its contribution, before its part of the tree: the others
                # must compute its ranges themselves once its heartbeat goes silent
                def die(self, flats):
                    os._exit(3)
                tree.TreeRound.run = die
            t = torch.full((100,), float(10 ** index))
            total = sync.average_([t])
            out.append((total, t.clone(), sync.world_size))
        return out


def test_a_member_that_dies_inside_a_tree_round_is_covered_by_the_others(tmp_path):
    gate = tmp_path.parent / f"{tmp_path.name}-gate"
    gate.mkdir()
    procs, results = start_ranks(w_dies, 5, str(tmp_path / "el"), str(gate))
    got = collect(procs, results, 120)
    assert procs[4].exitcode == 3 and not isinstance(got.get(4), list)
    everyone, survivors = sum(10.0 ** i for i in range(5)) / 5, sum(10.0 ** i for i in range(4)) / 4
    for i in range(4):
        log = got[i]
        # round 2 still counts the dead member's contribution (it was written); round 3
        # is the survivors'
        assert [x[0] for x in log] == [5.0, 5.0, 5.0, 4.0], log
        assert [x[1][0].item() for x in log] == pytest.approx([everyone] * 3 + [survivors])
        # round 2's roster was agreed before the death: it leaves in round 3's
        assert [x[2] for x in log] == [5, 5, 5, 4]
        assert all(torch.equal(x[1], got[0][j][1]) for j, x in enumerate(log))


def w_misplaced(index, _world, url):
    if index == 0:
        # this member seals each range of the average it computes as if it were the
        # next range: a valid object of the job under the wrong name (what a copy
        # between names looks like to a reader)
        original = tree.TreeRound._expected

        def misplaced(self, kind, name, writer, path):
            if kind == "flat":
                name = name + ".elsewhere"
            return original(self, kind, name, writer, path)
        tree.TreeRound._expected = misplaced
    with ferrosync.connect(url, elastic=True, min_ranks=5, job="misplaced", timeout=20,
                           secret=b"tree-secret", **FAST) as sync:
        t = torch.full((1000,), float(index))
        sync.average_([t])
        return t[0].item()


def test_a_tree_object_under_another_name_is_refused(tmp_path):
    got = run_ranks(w_misplaced, 5, str(tmp_path / "el"), timeout=120, expect_errors=True)
    assert not any(isinstance(g, float) for g in got), got  # nobody used an average
    texts = [str(g.error) for g in got]
    assert any("made for another place" in t for t in texts), texts
    assert all(type(g.error).__name__ in ("ShardCorrupt", "PeerFailed", "SyncTimeout",
                                          "MemberDropped") for g in got), texts
