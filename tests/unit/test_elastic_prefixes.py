"""How an elastic job's objects lie over partitioned prefixes (storage/names.py,
docs/elastic.md "Prefixes"): a round's data objects spread evenly over the shard
directories at a thousand members, every name reads back as what wrote it, a sharded
object outside its shard is nobody's, the records every member polls are sharded too,
and the simulated S3 rates each shard as its own partition (``s3``) or the whole
namespace as one (``s3cold``), split only under sustained throttling.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import replace

import pytest

from ferrosync.elastic.options import ElasticOptions
from ferrosync.elastic.plan import plan
from ferrosync.storage import names
from ferrosync.storage.engines import open_storage
from ferrosync.testing.sim.scheduler import Scheduler
from ferrosync.testing.sim.store import PROFILES, SimHTTPError, SimServer

FAN_IN = ElasticOptions().fan_in


def round_objects(round_: int, members: int) -> list[tuple[str, str, int | None]]:
    """(name, kind, tree level) of every data object a healthy tree round of ``members``
    writes: each member's slices and marker, each sum's outputs, each merge's result."""
    tree = plan(members, FAN_IN)
    ids = [f"{i:016x}" for i in range(members)]
    out = [(names.elastic_contribution(round_, i), "elastic_contribution", None)
           for i in ids]
    out += [(names.elastic_piece(round_, 0, n, (j,)), "elastic_piece", 0)
            for n in range(members) for j in range(tree.k(1))]
    for role, _ in tree.assignments:
        if role[0] == "merge":
            out.append((names.elastic_result(round_, role[1]), "elastic_result", None))
            continue
        _, level, node, path = role
        if level == tree.depth:
            out.append((names.elastic_result(round_, path), "elastic_result", None))
        else:
            out += [(names.elastic_piece(round_, level, node, path + (j,)), "elastic_piece",
                     level) for j in range(tree.k(level + 1))]
    # the plan's own count of a round's PUTs (what tools/bench/elastic_costs.py charges)
    assert len(out) == sum(t["puts"] for t in tree.traffic())
    return out


@pytest.mark.parametrize("round_", [1, 2, 7])
def test_a_thousand_member_round_spreads_over_the_shards(round_):
    objects = round_objects(round_, 1000)
    assert len(objects) > 20_000  # ~26,400: what one prefix of 3,500 PUT/s cannot take
    per_shard = Counter(name.partition("/")[0] for name, _, _ in objects)
    share = len(objects) / names.ELASTIC_SHARDS
    assert len(per_shard) == names.ELASTIC_SHARDS
    assert max(per_shard.values()) < 1.5 * share, per_shard.most_common(3)
    # each kind on its own spreads too (the slices, written at once, most of all)
    slices = Counter(n.partition("/")[0] for n, kind, level in objects if level == 0)
    assert max(slices.values()) < 2 * sum(slices.values()) / names.ELASTIC_SHARDS


def test_every_name_of_a_round_reads_back_as_what_wrote_it():
    for name, kind, level in round_objects(4, 37):
        found = names.parse_elastic(name)
        assert (found.kind, found.collective) == (kind, 4), name
        if level is not None:
            assert found.number == level, name
        shard, _, base = name.partition("/")
        assert shard == names.elastic_shard(base)
        assert names.parse_elastic(base).kind == "unknown"  # outside its shard
        other = f"p{(int(shard[1:], 16) + 1) % names.ELASTIC_SHARDS:02x}"
        assert names.parse_elastic(f"{other}/{base}").kind == "unknown"  # another one's
    # the records every member polls lie in shards too; the rest at the top, only there
    for name, kind in ((names.elastic_roster(4), "elastic_roster"),
                       (names.elastic_heartbeat("0" * 16), "elastic_heartbeat"),
                       (names.elastic_join(3), "elastic_join"),
                       (names.elastic_member("0" * 16), "elastic_member")):
        shard, _, base = name.partition("/")
        assert shard == names.elastic_shard(base) and names.parse_elastic(name).kind == kind
        assert names.parse_elastic(base).kind == "unknown"
    for name in (names.elastic_history(4), names.elastic_state(5, 0), names.ELASTIC_LATEST,
                 names.elastic_layout(b"\x01" * 8), names.ELASTIC_ENDED):
        assert "/" not in name and names.parse_elastic(name).kind != "unknown"
        assert names.parse_elastic(f"{names.elastic_shard(name)}/{name}").kind == "unknown"


def _server(profile: str) -> SimServer:
    return SimServer(Scheduler(), PROFILES[profile], 0)


def test_s3_rates_each_shard_directory_as_its_own_partition():
    server = _server("s3")
    a, b = (f"el.sim/{names.elastic_piece(1, 0, n, (0,))}" for n in (0, 1))
    assert a.split("/")[1] != b.split("/")[1]  # two shards
    for _ in range(3500):
        server.admit("put", a)
    with pytest.raises(SimHTTPError):
        server.admit("put", a)
    server.admit("put", b)  # another shard: its own 3,500 PUT/s
    server.admit("put", "el.sim/" + names.ELASTIC_LATEST)  # the top: its own too
    assert server.slowdowns == 1
    assert server.partition(a) == "el.sim/" + a.split("/")[1]


def test_s3cold_rates_the_whole_namespace_as_one_partition_until_it_splits():
    server = _server("s3cold")
    keys = [f"el.sim/{names.elastic_piece(1, 0, n, (0,))}" for n in range(3500)]
    assert len({k.split("/")[1] for k in keys}) == names.ELASTIC_SHARDS
    for key in keys:
        server.admit("put", key)
    for late in ("el.sim/" + names.ELASTIC_LATEST, "el.sim/" + names.elastic_result(1, (0,))):
        with pytest.raises(SimHTTPError):
            server.admit("put", late)  # one partition: the shards do not help yet
    assert server.partition(keys[0]) == server.partition("el.sim/latest") == "el.sim"


def test_a_partition_throttled_for_ramp_s_splits_in_two():
    profile = replace(PROFILES["s3cold"], ramp_s=3.0)
    server = SimServer(Scheduler(), profile, 0)
    keys = [f"el.sim/{names.elastic_result(1, (n,))}" for n in range(8000)]

    def second(admitted: int) -> int:
        """One second of PUTs: how many got through before the first 503."""
        for i, key in enumerate(keys[:admitted + 1]):
            try:
                server.admit("put", key)
            except SimHTTPError:
                return i
        return admitted + 1

    assert second(3500) == 3500  # throttled from here on...
    for _ in range(2):
        server.sched.now += 1.0
        assert second(3500) == 3500  # ...sustained, though 3,500 PUTs a second got through
    server.sched.now += 1.0
    assert second(3500) == 3500  # ramp_s of throttling: this 503 split the partition
    server.sched.now += 1.0
    assert second(7000) == 7000  # twice the rate
    server.sched.now += 30.0
    assert second(7000) == 7000 and server.slowdowns == 6  # one 503 a second


def test_a_pause_between_bursts_is_no_sustained_throttling():
    profile = replace(PROFILES["s3cold"], ramp_s=3.0)
    server = SimServer(Scheduler(), profile, 0)
    for now in (0.0, 2.5, 5.0, 7.5):  # a 503 every burst, a quiet window between
        server.sched.now = now
        for n in range(3500):
            server.admit("put", f"el.sim/x.{n}")
        with pytest.raises(SimHTTPError):
            server.admit("put", "el.sim/x.late")
    server.sched.now += 1.0
    server.admit("put", "el.sim/x.next")
    assert server._prefixes["el.sim"].scale == 1.0  # never split


def test_listing_a_job_with_every_shard_directory_leaves_no_descriptor_open(tmp_path):
    """``gc``, ``inspect`` and tests list a namespace whose 256 shard directories hold
    no subdirectories: each was left open once (a leaf directory's handle was never
    closed), 256 descriptors a listing."""
    storage = open_storage(str(tmp_path))
    ns = names.elastic_namespace("fds")
    for n in range(800):  # most of the 256 shards
        name = names.elastic_join(n)
        storage.makedirs(names.within(ns, name.rpartition("/")[0]))
        storage.put(names.within(ns, name), [b"{}"])
    storage.list("")  # the directory handles the engine keeps are open by now
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        listed = storage.list("")
    assert len(listed) == 800
    assert len(os.listdir("/proc/self/fd")) == before
