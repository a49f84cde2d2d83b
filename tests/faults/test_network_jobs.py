"""Jobs over S3 through a lossy network: the contract suite's S3 case and an elastic
job, with the suite's SeaweedFS behind a fault proxy (``lossy.LOSSY``: 5 % of PUT
replies lost after the server stored them, 5 % of GET bodies cut, 1 % of requests
reset before they arrive, 1 % answered 503 SlowDown; seeded).

Every average must be exact and bit-identical on every rank and member, and nobody
may fail: a lost reply or a retry is never an error of its own. The contract tests
are the contract suite's own functions (imported, so collected here with this
module's ``case``): a subset that writes, reads, races and deletes every kind of
object; the rest of the suite runs on the same engine without faults.
"""

from __future__ import annotations

import pytest
import torch
from lossy import LOSSY, lossy_proxy, through
from test_contract import (  # noqa: F401  (collected here, on the lossy case)
    test_all_gather,
    test_average_is_exact_and_bit_identical,
    test_broadcast_from_every_source,
    test_storage_stays_bounded_over_many_collectives,
)

import ferrosync
from conftest import Case
from ferrosync.testing.fault_proxy import Fault
from ranks import run_ranks

#: what the faults must have hit during the elastic job, at least once each
HIT = ("lose_reply", "cut_body")
#: an elastic job of a few rounds makes a few dozen PUTs, and at 5 % none loses its reply
#: one run in eight: the first conditional creates (records, contributions) lose theirs
#: for certain, so the recognise-our-own-create path runs every time
CERTAIN_LOSSES = 3
CERTAIN = (Fault("lose_reply", 1.0, methods=("PUT",), header="If-None-Match",
                 times=CERTAIN_LOSSES),)
#: the elastic job: members (all from the start) and rounds
MEMBERS, ROUNDS = 3, 5


@pytest.fixture
def lossy_s3(seaweed_transport):
    """(the SeaweedFS transport through a lossy proxy, the proxy)."""
    proxy = lossy_proxy(seaweed_transport, seed=30)
    yield through(seaweed_transport, proxy), proxy
    proxy.close()


@pytest.fixture
def case(lossy_s3) -> Case:
    """The contract suite's S3 case at 2 ranks, through the lossy network."""
    return Case(lossy_s3[0], 2)


@pytest.fixture
def certainly_lossy_s3(seaweed_transport):
    """``lossy_s3`` whose first conditional creates lose their replies for certain."""
    proxy = lossy_proxy(seaweed_transport, seed=30, faults=CERTAIN + LOSSY)
    yield through(seaweed_transport, proxy), proxy
    proxy.close()


def w_elastic(index, world, url, options, rounds):
    with ferrosync.connect(url, elastic=True, min_ranks=world, max_ranks=world, job="lossy",
                           timeout=120, heartbeat_interval=1.0, heartbeat_timeout=30.0,
                           **options) as sync:
        out = []
        for k in range(rounds):
            # exact in float32: sums of small integers times a power of two
            x = torch.full((3000,), float(index + 1) * 2.0 ** k)
            total = sync.average_(x, weight=1.0)
            out.append((total, x))
        return sorted(sync.membership), out


def test_an_elastic_job_through_a_lossy_network(certainly_lossy_s3):
    transport, proxy = certainly_lossy_s3
    results = run_ranks(w_elastic, MEMBERS, transport.url, transport.options, ROUNDS,
                        timeout=240)
    members = {tuple(m) for m, _ in results}
    assert len(members) == 1 and len(members.pop()) == MEMBERS
    for _, out in results:
        assert len(out) == ROUNDS
        for k, (total, x) in enumerate(out):
            assert total == MEMBERS
            assert torch.equal(x, torch.full((3000,), (MEMBERS + 1) / 2 * 2.0 ** k)), k
    hit = proxy.stats()
    assert all(hit[kind] > 0 for kind in HIT), hit
    assert hit["lose_reply"] >= CERTAIN_LOSSES, hit
