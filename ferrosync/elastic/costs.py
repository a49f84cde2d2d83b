"""What an elastic round costs per member, modelled: requests by kind and bytes read and
written (all-read-all below ``TREE_FROM`` members, the tree reduce from there), a round's
critical path, and the job's request bill per hour (docs/elastic.md#cost).
``tools/bench/elastic_costs.py`` prints the model and measures real members against it."""

from __future__ import annotations

from ferrosync.elastic.options import ElasticOptions
from ferrosync.elastic.tree import TREE_FROM, TreePlan
from ferrosync.storage.engines import REQUEST_KINDS
from ferrosync.storage.engines.fsspec_store import FsspecStorage

#: the request kinds a round's model counts (the storage counters' names)
KINDS = REQUEST_KINDS


def model(w: int, payload: int, *, round_s: float, hb_interval: float,
          poll_s: float = 0.0, fan_in: int | None = None) -> dict:
    """Requests and bytes of one healthy round, per ordinary member (the mean), for the
    checker (member 0) and for the busiest member, as docs/elastic.md#rounds describes
    the protocol: all-read-all below ``TREE_FROM`` members, the tree reduce from there
    (``TreePlan.traffic``: the code's own plan, at the default ``fan_in``).

    ``round_s``: the round's wall time (heartbeats: one PUT per ``hb_interval``);
    ``poll_s``: the time a member spends polling for the roster (one GET per poll; the
    polls' count depends on the wait, so it is an input, 0 for the floor).
    """
    hb = round_s / hb_interval
    polls = 1.0 + (poll_s / 0.2 if poll_s else 0.0)  # at least the roster read
    if w < TREE_FROM:
        member = {
            "puts": 1.0 + hb,                 # its contribution, its heartbeats
            "gets": (w - 1) + polls,          # every other contribution, the roster
            "lists": 0.0,
            "deletes": 1.0,                   # its contribution of round r-2
            "bytes_read": (w - 1) * payload,
            "bytes_written": payload,
        }
        checker = dict(member)
        checker["gets"] += 2.0                # the join.{next} miss, its own contribution
        checker["bytes_read"] += payload      # it reads all W contributions (measured: W x P)
        busiest = checker
    else:
        plan = TreePlan(w, fan_in or ElasticOptions.parse({}).fan_in)
        per = [{"puts": t["puts"] + hb, "gets": t["gets"] + polls, "lists": 0.0,
                # every object a member wrote is deleted by it two rounds later, in
                # one request (a batch delete)
                "deletes": 1.0, "bytes_read": t["read"] * payload,
                "bytes_written": t["written"] * payload} for t in plan.traffic()]
        others = per[1:]
        member = {k: sum(d[k] for d in others) / len(others) for k in per[0]}
        checker = dict(per[0])
        # it looks for every member's header-only marker (its own included) instead of
        # downloading contributions, and the join.{next} miss
        checker["gets"] += w + 1.0
        busiest = max(per, key=lambda d: d["bytes_read"])
    checker["puts"] += 2.0                    # the roster, the `latest` hint
    # (its roster-r-64 DELETE comes once 64 rounds exist)
    for d in (member, checker, busiest):
        d["requests"] = sum(d[k] for k in KINDS)
    return {"member": member, "checker": checker, "busiest": busiest}


def polls(wait_s: float, first: float | None = None, longest: float | None = None) -> int:
    """How many polls a wait of ``wait_s`` makes: sleeps from ``first`` doubling to
    ``longest`` (default: the object stores' ``poll_initial`` and ``poll_max``), one
    request or two per poll."""
    first = FsspecStorage.poll_initial if first is None else first
    longest = FsspecStorage.poll_max if longest is None else longest
    n, slept, sleep = 1, 0.0, first
    while slept < wait_s:
        slept += sleep
        sleep = min(2 * sleep, longest)
        n += 1
    return n


def latency(w: int, payload: int, *, rtt: float, bandwidth: float) -> float:
    """Seconds of one round's critical path: RTT x the busiest member's requests, one
    after the other (all-read-all: write the contribution, read the roster, then the
    W-1 contributions; the tree: its slices and marker, the roster, then each level's
    reads and writes), + its bytes read over the bandwidth. A lower bound for the tree,
    whose levels also wait for each other."""
    busiest = model(w, payload, round_s=0.0, hb_interval=1.0)["busiest"]
    sequential = busiest["puts"] + busiest["gets"]
    return rtt * sequential + busiest["bytes_read"] / bandwidth


def job_cost_per_hour(w: int, payload: int, round_rate: float, hb_interval: float,
                      prices: dict) -> dict:
    """USD per hour of the job's requests at ``round_rate`` rounds per second (the
    heartbeats counted apart from the rounds)."""
    m = model(w, payload, round_s=0.0, hb_interval=hb_interval)
    per_round = {k: (w - 1) * m["member"][k] + m["checker"][k] for k in KINDS}
    rounds_per_hour = round_rate * 3600.0
    price_of = {"puts": "put", "gets": "get", "lists": "list", "deletes": "delete"}
    rounds = sum(per_round[k] * rounds_per_hour * prices[price_of[k]] / 1000 for k in KINDS)
    # liveness: every member beats once per interval, and a member waiting for a roster
    # reads the heartbeat of the first member before it once per interval (at most one
    # GET per member per interval: the upper bound, as if every member always waited)
    hb_puts = w * 3600.0 / hb_interval
    hb_gets = w * 3600.0 / hb_interval
    heartbeats = hb_puts * prices["put"] / 1000 + hb_gets * prices["get"] / 1000
    return {"requests_per_round": sum(per_round.values()),
            "gets_per_round": per_round["gets"], "rounds_usd": rounds,
            "heartbeat_puts_per_hour": hb_puts, "heartbeat_gets_per_hour": hb_gets,
            "heartbeats_usd": heartbeats}
