"""Elastic jobs (ferrosync/elastic, docs/elastic.md): membership agreed through a
directory by real processes; members join, leave gracefully and die.

Every member contributes a value that names it (10**index, weight 1), so the average
of a round says exactly who was in it: with members {0, 1} it is 5.5, with {0, 1, 2}
37.0, and any other set gives another number.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest
import torch
from train_cli import run_forked

import ferrosync
from ferrosync.errors import ConfigError, LayoutMismatch, PeerFailed, SyncTimeout
from ferrosync.storage import names
from ranks import collect, run_ranks, start_ranks, wait_until

# short enough to keep the file fast, long enough for a loaded 2-core machine
FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.5}
TIMEOUT = 30.0


def avg_of(indices) -> float:
    return sum(10.0 ** i for i in indices) / len(indices)


def _values(index: int, round_: int):
    g = torch.Generator().manual_seed(1000 * index + round_)
    return [torch.randn(257, generator=g), torch.randn(33, generator=g).to(torch.float16),
            torch.randn(5, generator=g).to(torch.bfloat16)]


# -- (a) no change: equal to the fixed-size backend, bit-identical everywhere -----------------

def w_steady(index, _world, url, rounds):
    with ferrosync.connect(url, elastic=True, min_ranks=3, job="steady", timeout=TIMEOUT,
                           **FAST) as sync:
        start = sync.round
        out = []
        for k in range(rounds):
            tensors = _values(index, k)
            total = sync.average_(tensors, weight=index + 1)
            out.append((total, tensors))
        gathered = sync.all_gather(torch.tensor([index]))
        return {"id": sync.member_id, "members": sync.membership, "rank": sync.rank,
                "world": sync.world_size, "start": start, "end": sync.round, "out": out,
                "gathered": [int(t) for t in gathered]}


def w_fixed(rank, world, url, order, rounds, zero_at=None):
    """The fixed-size backend's averages of the same values; ``zero_at``: the (index,
    round) that sends weight 0."""
    index = order[rank]
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=TIMEOUT) as sync:
        out = []
        for k in range(rounds):
            tensors = _values(index, k)
            total = sync.average_(tensors, weight=0 if (index, k) == zero_at else index + 1)
            out.append((total, tensors))
        return out


def test_steady_members_match_the_fixed_size_backend_bit_for_bit(tmp_path):
    rounds = 3
    got = run_ranks(w_steady, 3, str(tmp_path / "el"), rounds, timeout=120)
    members = got[0]["members"]
    assert all(g["members"] == members for g in got) and len(members) == 3
    # one round per call, however many dtypes (buckets) a call's tensors make
    assert all(g["end"] - g["start"] == rounds + 1 for g in got)
    assert sorted(g["rank"] for g in got) == [0, 1, 2]
    by_id = {g["id"]: g for g in got}
    order = [None] * 3  # roster position -> the test's index of that member
    for index, g in enumerate(got):
        order[members.index(g["id"])] = index
    # all_gather comes back in roster order
    assert all(g["gathered"] == order for g in got)
    reference = got[0]["out"]
    for g in got[1:]:
        for (t0, a), (t1, b) in zip(reference, g["out"]):
            assert t0 == t1 == 6.0
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    fixed = run_ranks(w_fixed, 3, str(tmp_path / "fixed"), order, rounds, timeout=120)
    for (te, e), (tf, f) in zip(by_id[members[0]]["out"], fixed[0]):
        assert te == tf
        assert all(torch.equal(x, y) for x, y in zip(e, f)), "elastic != fixed-size backend"


# -- codecs: encoded contributions, the same average on every member -----------------------

def w_encoded(index, _world, url, wire_dtype, rounds):
    with ferrosync.connect(url, elastic=True, min_ranks=3, job="encoded", timeout=TIMEOUT,
                           wire_dtype=wire_dtype, **FAST) as sync:
        out = []
        for k in range(rounds):
            tensors = _values(index, k)
            sent = [t.clone() for t in tensors]
            total = sync.average_(tensors, weight=index + 1)
            out.append((total, sent, tensors))
        return {"id": sync.member_id, "members": sync.membership, "out": out}


def _through(codec, t: torch.Tensor) -> torch.Tensor:
    """What ``codec`` carries of ``t`` (no error feedback: a member's first round)."""
    wire = torch.empty(codec.nbytes(t.numel()), dtype=torch.uint8)
    codec.encode(t, wire)
    return codec.decode(wire, t.numel())


@pytest.mark.parametrize("wire_dtype", ["bfloat16", "int8"])
def test_encoded_contributions_average_alike_on_every_member(tmp_path, wire_dtype):
    """With a wire_dtype every member's result is the same bits, and in the first round
    (no error feedback yet) exactly the weighted average, in roster order, of what the
    codec carries of each member's tensors; later rounds stay close to the exact
    average (error feedback is per member)."""
    from ferrosync.compression.codecs import accumulator_dtype, codec_for
    from ferrosync.core.common import accumulate, divide_into

    rounds = 3
    got = run_ranks(w_encoded, 3, str(tmp_path), wire_dtype, rounds, timeout=120)
    members = got[0]["members"]
    assert all(g["members"] == members for g in got) and len(members) == 3
    for g in got[1:]:
        for (t0, _, a), (t1, _, b) in zip(got[0]["out"], g["out"]):
            assert t0 == t1 == 6.0
            assert all(torch.equal(x, y) for x, y in zip(a, b)), "members disagree"
    by_position = sorted(got, key=lambda g: members.index(g["id"]))
    weights = [got.index(g) + 1 for g in by_position]  # the test's index + 1
    for slot, result in enumerate(got[0]["out"][0][2]):
        dtype = result.dtype
        codec = codec_for(dtype, wire_dtype)
        acc = torch.empty(result.numel(), dtype=accumulator_dtype(dtype))
        for i, (g, w) in enumerate(zip(by_position, weights)):
            accumulate(acc, _through(codec, g["out"][0][1][slot]), w, first=i == 0)
        expected = torch.empty_like(result)
        divide_into(expected, acc, float(sum(weights)))
        assert torch.equal(result, expected), (dtype, wire_dtype)
    for k in range(rounds):
        exact = sum(w * g["out"][k][1][0].double() for g, w in zip(by_position, weights)) / 6
        err = (got[0]["out"][k][2][0].double() - exact).abs().max().item()
        assert err < (0.05 if wire_dtype == "int8" else 0.02), (k, err)


@pytest.mark.unit
def test_a_member_with_another_wire_dtype_is_refused_before_it_writes(tmp_path):
    url = str(tmp_path)
    with ferrosync.connect(url, elastic=True, job="wire", timeout=10.0, **FAST) as sync:
        before = sorted(p.name for p in (tmp_path / "el.wire").iterdir())
        with pytest.raises(ConfigError, match=r"wire_dtype None \(here 'int8'\)"):
            ferrosync.connect(url, elastic=True, job="wire", wire_dtype="int8", timeout=10.0,
                              **FAST)
        assert sorted(p.name for p in (tmp_path / "el.wire").iterdir()) == before
        t = torch.full((3,), 2.0)
        assert sync.average_([t]) == 1.0 and t.tolist() == [2.0, 2.0, 2.0]


# -- (b) SIGKILL, (c) graceful leave ---------------------------------------------------------

def w_rounds(index, _world, url, rounds, position, how, job, hb_timeout, gate, options=None):
    opts = dict(FAST, heartbeat_timeout=hb_timeout, **(options or {}))
    # min_ranks=2: the job goes on with two (min_ranks holds in every round, so 3
    # would stop it); the barriers gather the third before the logged rounds
    # all three connect together (a start gate beside the store), so that the first two
    # spin few barrier rounds and the whole history stays inside the rosters' window
    open(os.path.join(gate, str(index)), "w").close()
    wait_until(lambda: len(os.listdir(gate)) == 3, "all three members at the gate")
    sync = ferrosync.connect(url, elastic=True, min_ranks=2, job=job, timeout=TIMEOUT, **opts)
    while sync.world_size < 3:
        sync.barrier()
    log = []
    for k in range(rounds):
        t = torch.full((4,), 10.0 ** index)
        began = time.monotonic()
        total = sync.average_([t])
        log.append((total, t[0].item(), time.monotonic() - began, sync.world_size,
                    sync.membership_changed))
        if k == 2 and sync.rank == position:  # the rank is agreed: exactly one goes
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            sync.close()
            return log
    sync.close()
    return log


# position 0 is the member that checks and writes the rosters: the next one must take
# over (at once after a close, after the heartbeat timeout after a SIGKILL)
@pytest.mark.parametrize("position", [0, 2])
@pytest.mark.parametrize("how", ["kill", "close"])
def test_a_member_that_goes_is_dropped_and_the_rest_continue(tmp_path, how, position):
    hb_timeout = 2.5 if how == "kill" else 20.0  # a graceful leave must not wait for it
    gate = tmp_path.parent / f"{tmp_path.name}-gate"
    gate.mkdir()
    got = run_ranks(w_rounds, 3, str(tmp_path), 7, position, how, f"go-{how}", hb_timeout,
                    str(gate), timeout=120, expect_errors=True)
    gone = [i for i, g in enumerate(got) if not isinstance(g, list) or len(g) == 3]
    assert len(gone) == 1, got
    stay = [i for i in range(3) if i not in gone]
    if how == "kill":
        assert "exit code -9" in repr(got[gone[0]])
    else:
        assert [x[1] for x in got[gone[0]]] == pytest.approx([37.0] * 3)
    for i in stay:
        log = got[i]
        totals = [x[0] for x in log]
        averages = [x[1] for x in log]
        # rounds 0-2 had all three members, every later one exactly the survivors
        assert totals == [3.0] * 3 + [2.0] * 4, log
        assert averages == pytest.approx([avg_of([0, 1, 2])] * 3 + [avg_of(stay)] * 4)
        assert [x[3] for x in log] == [3] * 3 + [2] * 4
        assert [x[4] for x in log][3:] == [True, False, False, False]
        drop_round = log[3][2]
        if how == "kill":
            assert drop_round < hb_timeout + 4.0, f"drop took {drop_round:.1f} s"
        else:
            assert drop_round < 4.0, f"a graceful leave took {drop_round:.1f} s to be seen"
    # `ferrosync inspect` tells the whole story from the job's history record: the three
    # joined (the founders at round 0), the one that went left or died; the changes
    # counted as the rosters count them (the founding round counts none)
    report = inspect_json(tmp_path)
    (job,) = report["elastic_jobs"]
    assert job["job"] == f"go-{how}" and len(job["members"]) == 2, job
    kinds = [e["event"] for e in job["events"]]
    assert kinds == ["joined"] * 3 + ["left" if how == "close" else "died"], job["events"]
    assert job["events"][0]["round"] == 0 and not job["problems"], job
    assert job["membership_changes"] == len({e["round"] for e in job["events"]} - {0}), job
    assert not [k for k in report["foreign_objects"] if k.startswith("el.")]
    text = run_forked([sys.executable, "-m", "ferrosync", "inspect", str(tmp_path),
                       "--watch", "0"], capture_output=True, text=True, timeout=60).stdout
    assert f"elastic job go-{how}" in text and "2 member(s) now" in text, text


def inspect_json(url) -> dict:
    out = run_forked([sys.executable, "-m", "ferrosync", "inspect", str(url), "--json",
                      "--watch", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


# -- (d) a newcomer joins at a round boundary ----------------------------------------------

def w_grow(index, _world, url, extra):
    sync = ferrosync.connect(url, elastic=True, min_ranks=2, job="grow", timeout=TIMEOUT,
                             **FAST)
    state = torch.zeros(3)
    fetched = sync.fetch_state([state]) if index == 2 else None
    joined = sync.round if index == 2 else None
    log = []
    while joined is None or sync.round < joined + extra:
        t = torch.full((2,), 10.0 ** index)
        total = sync.average_([t])
        log.append((sync.round, total, t[0].item()))
        if sync.rank == 0:
            sync.publish_state([torch.full((3,), float(sync.round))])
        if joined is None and sync.world_size == 3:
            joined = sync.round
        time.sleep(0.02)  # a training step's worth of work between rounds
    sync.close()
    return {"log": log, "joined": joined, "fetched": fetched, "state": state.tolist()}


def test_a_newcomer_joins_at_a_round_boundary(tmp_path):
    url = str(tmp_path)
    procs, results = start_ranks(w_grow, 3, url, 4, ranks=[0, 1])
    roster = tmp_path / "el.grow" / names.elastic_roster(3)
    wait_until(roster.exists, "round 3 of the first two members", timeout=60)
    late, late_results = start_ranks(w_grow, 3, url, 4, ranks=[2])
    got = collect(procs, results, 120)
    got.update(collect(late, late_results, 120))
    assert sorted(got) == [0, 1, 2] and all(isinstance(v, dict) for v in got.values()), got
    joined = got[2]["joined"]
    assert got[0]["joined"] == got[1]["joined"] == joined >= 3
    # the newcomer took the state published after the round it was admitted in (or
    # one before it, published by a member that had not seen that roster yet)
    assert got[2]["fetched"] in (joined - 1, joined)
    assert got[2]["state"] == [float(got[2]["fetched"])] * 3
    for index in (0, 1):
        for round_, total, value in got[index]["log"]:
            expect = [0, 1] if round_ <= joined else [0, 1, 2]
            assert (total, value) == (len(expect), pytest.approx(avg_of(expect))), round_
    assert [r for r, _, _ in got[2]["log"]] == list(range(joined + 1, joined + 5))
    assert all(x[1:] == (3.0, pytest.approx(37.0)) for x in got[2]["log"])


def w_swap(index, _world, url, gate):
    """Members 0-2 start the job; member 2 leaves exactly when newcomer 3 is queued,
    so one round drops 2 and admits 3."""
    ns = os.path.join(url, "el.swap")
    if index == 3:
        wait_until(lambda: os.path.exists(gate), "member 2 ready to leave")
        sync = ferrosync.connect(url, elastic=True, min_ranks=2, job="swap", timeout=TIMEOUT,
                                 **FAST)
    else:
        sync = ferrosync.connect(url, elastic=True, min_ranks=3, job="swap", timeout=TIMEOUT,
                                 **FAST)
        sync.barrier()
        if index == 2:
            open(gate, "w").close()
            # leave once the newcomer's join entry is there (3 entries were the founders')
            wait_until(lambda: os.path.exists(os.path.join(ns, names.elastic_join(3))),
                       "the newcomer")
            sync.close()
            return {"left": True}
    log = []
    for _ in range(1 if index == 3 else 2):
        t = torch.full((2,), 10.0 ** index)
        total = sync.average_([t])
        log.append((total, t[0].item(), sync.world_size, sync.newcomers,
                    sync.membership_changed))
    sync.close()
    return {"id": sync.member_id, "log": log}


def test_a_join_and_a_leave_in_the_same_round(tmp_path):
    got = run_ranks(w_swap, 4, str(tmp_path), str(tmp_path.parent / f"{tmp_path.name}.gate"),
                    timeout=120)
    newcomer = got[3]["id"]
    for index in (0, 1):
        (t1, v1, w1, new1, changed1), (t2, v2, w2, new2, changed2) = got[index]["log"]
        # the round that dropped member 2 is over members 0 and 1 and admits member 3
        assert (t1, w1, new1, changed1) == (2.0, 3, [newcomer], True)
        assert v1 == pytest.approx(avg_of([0, 1]))
        # the next one is over 0, 1 and the newcomer
        assert (t2, w2, new2, changed2) == (3.0, 3, [], False)
        assert v2 == pytest.approx(avg_of([0, 1, 3]))
    assert got[3]["log"] == [(3.0, pytest.approx(avg_of([0, 1, 3])), 3, [], False)]


def w_paused(index, _world, url, files):
    """Member 1 stops outside any collective until told to go on, so member 0 waits
    for it in a round, watching its heartbeat; the test suspends both meanwhile."""
    # min_ranks=1: a member 0 that judged member 1 dead would go on without it
    with ferrosync.connect(url, elastic=True, min_ranks=1, job="pause", timeout=TIMEOUT,
                           **FAST) as sync:
        while sync.world_size < 2:
            sync.barrier()
        changes = sync.membership_changes
        # whole or absent: the test reads it as soon as the name exists
        with open(f"{files}.id{index}.tmp", "w") as f:
            f.write(sync.member_id)
        os.replace(f"{files}.id{index}.tmp", f"{files}.id{index}")
        if index == 1:
            wait_until(lambda: os.path.exists(f"{files}.go"), "go", timeout=TIMEOUT)
        total = sync.average_([torch.full((2,), 10.0 ** index)])
        sync.barrier()
        return {"total": total, "world": sync.world_size,
                "changes": sync.membership_changes - changes}


def _beat(url, files, index) -> int:
    with open(f"{files}.id{index}", encoding="utf-8") as f:
        member = f.read()
    raw = json.loads((url / "el.pause" / names.elastic_heartbeat(member)).read_text())
    return json.loads(raw["body"])["beat"]


def test_suspending_the_whole_job_drops_nobody(tmp_path):
    """SIGSTOP every member for longer than heartbeat_timeout (a suspended job or VM),
    then SIGCONT: the time a member was frozen is not the other's silence. Member 0
    resumes first and looks at member 1's unchanged heartbeat before member 1 runs."""
    files, url = str(tmp_path / "f"), tmp_path / "run"
    procs, results = start_ranks(w_paused, 2, str(url), files)
    wait_until(lambda: all(os.path.exists(f"{files}.id{i}") for i in range(2)), "connect",
               timeout=60)

    def two_beats_of_member_0():  # it runs, so it has looked at member 1 meanwhile
        first = _beat(url, files, 0)
        wait_until(lambda: _beat(url, files, 0) >= first + 2, "two beats of member 0")

    os.kill(procs[1].pid, signal.SIGSTOP)
    two_beats_of_member_0()
    os.kill(procs[0].pid, signal.SIGSTOP)
    time.sleep(FAST["heartbeat_timeout"] + 2.0)  # the suspension being simulated
    os.kill(procs[0].pid, signal.SIGCONT)
    two_beats_of_member_0()
    os.kill(procs[1].pid, signal.SIGCONT)
    open(f"{files}.go", "w").close()
    got = collect(procs, results, 90)
    assert got[0] == got[1] == {"total": 2.0, "world": 2, "changes": 0}, got


# -- (e) min_ranks, (f) jobs, (g) configuration ---------------------------------------------

@pytest.mark.unit
def test_fewer_than_min_ranks_is_a_sync_timeout(tmp_path):
    began = time.monotonic()
    with pytest.raises(SyncTimeout, match="min_ranks=2"):
        ferrosync.connect(str(tmp_path), elastic=True, min_ranks=2, timeout=3.0, **FAST)
    assert 3.0 <= time.monotonic() - began < 15.0


def w_job(index, _world, url):
    job = "left" if index < 2 else "right"
    with ferrosync.connect(url, elastic=True, min_ranks=2, job=job, timeout=TIMEOUT,
                           **FAST) as sync:
        out = []
        for _ in range(3):
            t = torch.full((3,), 10.0 ** index)
            out.append((sync.average_([t]), t[0].item(), sync.world_size))
        return out


def test_two_elastic_jobs_on_one_url_never_mix(tmp_path):
    got = run_ranks(w_job, 4, str(tmp_path), timeout=120)
    for index, log in enumerate(got):
        expect = avg_of([0, 1]) if index < 2 else (100.0 + 1000.0) / 2
        assert [(t, w) for t, _, w in log] == [(2.0, 2)] * 3
        assert [v for _, v, _ in log] == pytest.approx([expect] * 3)


@pytest.mark.unit
def test_elastic_configuration_errors(tmp_path, monkeypatch):
    url = str(tmp_path)
    with pytest.raises(ConfigError, match="rank and world_size"):
        ferrosync.connect(url, elastic=True, world_size=2)
    with pytest.raises(ConfigError, match="rank and world_size"):
        ferrosync.connect(url, elastic=True, rank=0)
    with pytest.raises(ConfigError, match="apply to an elastic job only"):
        ferrosync.connect(url, min_ranks=2)
    with pytest.raises(ConfigError, match="max_ranks"):
        ferrosync.connect(url, elastic=True, min_ranks=3, max_ranks=2)
    with pytest.raises(ConfigError, match="unknown option"):
        ferrosync.connect(url, elastic=True, reduce="root")  # a roster decides that
    with pytest.raises(ConfigError, match="storage URL"):
        ferrosync.connect("gloo://127.0.0.1:1", elastic=True)
    # the launcher's RANK/WORLD_SIZE do not apply to an elastic member
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with ferrosync.connect(url, elastic=True, timeout=10.0, **FAST) as sync:
        assert (sync.rank, sync.world_size) == (0, 1)
        t = torch.full((2,), 4.0)
        assert sync.average_([t]) == 1.0 and t.tolist() == [4.0, 4.0]


# -- more: a stalled member is dropped, layouts, max_ranks, S3 -----------------------------

def w_stall(index, _world, url, files):
    opts = dict(FAST, heartbeat_timeout=1.5)
    sync = ferrosync.connect(url, elastic=True, min_ranks=2, job="stall", timeout=TIMEOUT,
                             **opts)
    while sync.world_size < 3:
        sync.barrier()
    log = []
    for k in range(4):
        if index == 2 and k == 1:
            # the test stops this process (SIGSTOP) here, past the heartbeat timeout
            open(os.path.join(files, "ready"), "w").close()
            wait_until(lambda: os.path.exists(os.path.join(files, "go")), "go", 60)
        t = torch.full((2,), 10.0 ** index)
        total = sync.average_([t])
        log.append((total, t[0].item()))
    sync.close()
    return log


def test_a_stalled_member_is_dropped_and_told_so(tmp_path):
    url, files = str(tmp_path / "store"), str(tmp_path)
    procs, results = start_ranks(w_stall, 3, url, files, ranks=[0, 1])
    stalled, stalled_results = start_ranks(w_stall, 3, url, files, ranks=[2])
    wait_until(lambda: os.path.exists(os.path.join(files, "ready")), "member 2 ready", 60)
    os.kill(stalled[2].pid, signal.SIGSTOP)
    try:
        open(os.path.join(files, "go"), "w").close()
        got = collect(procs, results, 60)
    finally:
        os.kill(stalled[2].pid, signal.SIGCONT)
    late = collect(stalled, stalled_results, 60)[2]
    for index in (0, 1):
        assert got[index] == [(3.0, pytest.approx(37.0))] + [(2.0, pytest.approx(5.5))] * 3
    assert isinstance(late.error, PeerFailed) and "dropped" in str(late.error), late


def w_mismatch(index, _world, url):
    with ferrosync.connect(url, elastic=True, min_ranks=2, job="mismatch", timeout=TIMEOUT,
                           **FAST) as sync:
        sync.average_([torch.zeros(4 + index)])


def test_a_layout_mismatch_is_raised_on_every_member(tmp_path):
    got = run_ranks(w_mismatch, 2, str(tmp_path), timeout=60, expect_errors=True)
    assert all(isinstance(g.error, LayoutMismatch) for g in got), got


def w_capped(index, _world, url, stop):
    try:
        sync = ferrosync.connect(url, elastic=True, min_ranks=2, max_ranks=2, job="capped",
                                 timeout=4.0, **FAST)
    except SyncTimeout as exc:
        return ("timeout", str(exc))
    sizes = set()
    while sync.round < stop:
        sync.barrier()
        sizes.add(sync.world_size)
        time.sleep(0.05)  # a training step between rounds
    sync.close()
    return ("member", sorted(sizes))


def test_max_ranks_admits_no_more(tmp_path):
    # 120 rounds of >= 50 ms outlast the third member's 4 s connect timeout
    got = run_ranks(w_capped, 3, str(tmp_path), 120, timeout=120)
    assert sorted(kind for kind, _ in got) == ["member", "member", "timeout"], got
    assert all(detail == [2] for kind, detail in got if kind == "member")


def test_a_graceful_leave_over_s3(seaweed_transport, tmp_path):
    t = seaweed_transport
    got = run_ranks(w_rounds, 3, t.url, 5, 1, "close", "s3-leave", 20.0, str(tmp_path),
                    options=t.options, timeout=180)
    gone = [i for i, g in enumerate(got) if len(g) == 3]
    stay = [i for i in range(3) if i not in gone]
    assert len(gone) == 1
    for i in stay:
        assert [x[0] for x in got[i]] == [3.0] * 3 + [2.0] * 2
        assert [x[1] for x in got[i]] == pytest.approx([37.0] * 3 + [avg_of(stay)] * 2)


def w_secret(index, _world, url):
    with ferrosync.connect(url, elastic=True, min_ranks=2, job="keys", timeout=10.0,
                           secret=f"key-{index}", **FAST) as sync:
        sync.barrier()


def test_records_without_the_jobs_secret_are_refused(tmp_path):
    # each member holds another key: the one that comes second finds the job's record
    # sealed with another key and is refused before it writes anything; the first
    # waits alone for min_ranks and times out
    got = run_ranks(w_secret, 2, str(tmp_path), timeout=60, expect_errors=True)
    errors = sorted((type(g.error).__name__, str(g.error)) for g in got)
    assert [kind for kind, _ in errors] == ["ConfigError", "SyncTimeout"], errors
    assert "secret differs from the job's" in errors[0][1], errors


def w_cohort(index, _world, url, rounds, hb_timeout, gate):
    opts = dict(FAST, heartbeat_timeout=hb_timeout)
    open(os.path.join(gate, str(index)), "w").close()
    wait_until(lambda: len(os.listdir(gate)) == 4, "all four members at the gate")
    sync = ferrosync.connect(url, elastic=True, min_ranks=2, job="cohort", timeout=TIMEOUT,
                             **opts)
    while sync.world_size < 4:
        sync.barrier()
    log = []
    for k in range(rounds):
        t = torch.full((4,), 10.0 ** index)
        began = time.monotonic()
        total = sync.average_([t])
        log.append((total, t[0].item(), time.monotonic() - began, sync.world_size))
        if k == 2 and sync.rank in (0, 1):  # the checker and the next in line die together
            os.kill(os.getpid(), signal.SIGKILL)
    sync.close()
    return log


def test_members_killed_together_leave_together(tmp_path):
    """Ranks 0 and 1 (the roster's checker and its successor) are SIGKILLed in the same
    round: the survivors drop both in one roster, after about one heartbeat timeout
    (both silence clocks run at once), not one timeout per dead member."""
    hb_timeout = 5.0
    gate = tmp_path.parent / f"{tmp_path.name}-gate"
    gate.mkdir()
    got = run_ranks(w_cohort, 4, str(tmp_path), 6, hb_timeout, str(gate), timeout=120,
                    expect_errors=True)
    stay = [i for i, g in enumerate(got) if isinstance(g, list) and len(g) == 6]
    assert len(stay) == 2, got
    for i in stay:
        log = got[i]
        assert [x[3] for x in log] == [4] * 3 + [2] * 3, log  # 4 -> 2 in one round
        assert [x[0] for x in log] == [4.0] * 3 + [2.0] * 3, log
        assert [x[1] for x in log][3:] == pytest.approx([avg_of(stay)] * 3)
        print(f"member {i}: the drop round took {log[3][2]:.2f} s")
        # one timeout per dead member would be >= 2 x hb_timeout
        assert log[3][2] < 2 * hb_timeout, f"the drop took {log[3][2]:.1f} s"


def w_term(index, _world, url, files, how):
    """Members average until five rounds after a member left; SIGTERM makes that one
    leave: its handler calls ``close()`` in the middle of whatever the member was doing
    (``how`` = "close") and exits, or raises ``SystemExit`` out of the ``with`` block
    (``how`` = "exit")."""
    sync = ferrosync.connect(url, elastic=True, min_ranks=2, job="term", timeout=TIMEOUT,
                             heartbeat_interval=0.2, heartbeat_timeout=60.0)
    closed = os.path.join(files, "closed")

    def on_term(*_):
        if how == "close":
            sync.close()
        with open(closed + ".tmp", "w") as f:
            f.write(repr(time.time()))
        os.rename(closed + ".tmp", closed)
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    log = []
    with sync:
        while True:
            sync.average_([torch.full((4,), 10.0 ** index)])
            log.append((sync.round, sync.world_size, time.time()))
            if sync.round == 20:
                # whole or absent: the test reads it once it exists
                with open(os.path.join(files, f".at20.{index}"), "w") as f:
                    f.write(str(os.getpid()))
                os.rename(os.path.join(files, f".at20.{index}"),
                          os.path.join(files, f"at20.{index}"))
            if os.path.exists(closed):
                at = float(open(closed).read())
                if sum(1 for _, _, t in log if t > at) >= 5:
                    return log
            time.sleep(0.01)


@pytest.mark.parametrize("how", ["close", "exit"])
def test_a_member_closed_from_a_signal_handler_is_seen_within_a_round(tmp_path, how):
    """A member that catches SIGTERM and calls ``close()`` (or leaves its ``with``
    block through ``SystemExit``) mid-round is a visible leave: with a heartbeat
    timeout of 60 s, the others drop it in the round after the close (the round in
    flight may still count it), never by its silence."""
    files = tmp_path / "files"
    files.mkdir()
    procs, results = start_ranks(w_term, 3, str(tmp_path / "store"), str(files), how)
    wait_until(lambda: len(list(files.glob("at20.*"))) == 3, "round 20", timeout=60)
    os.kill(int((files / "at20.1").read_text()), signal.SIGTERM)
    got = collect(procs, results, timeout=90)
    closed = float((files / "closed").read_text())
    for index in (0, 2):
        log = got[index]
        assert isinstance(log, list), got
        after = [world for _, world, at in log if at > closed]
        assert after.count(3) <= 1 and after[-1] == 2, (after, log[-8:])


# -- a newcomer that does not fit is refused alone ------------------------------------------

def w_fitting(index, _world, url, members, stop):
    with ferrosync.connect(url, elastic=True, min_ranks=members, job="refuse",
                           timeout=TIMEOUT, **FAST) as sync:
        log = []
        while True:
            t, done = torch.full((8,), 10.0 ** index), torch.tensor([float(os.path.exists(stop))])
            total = sync.average_([t, done])
            log.append((total, t[0].item(), sync.world_size, sync.membership_changes))
            if done.item() > 0:  # the same average on every member: all stop together
                return log
            time.sleep(0.02)  # a training step's worth of work between rounds


def w_misfit(index, _world, url):
    sync = ferrosync.connect(url, elastic=True, job="refuse", timeout=TIMEOUT, **FAST)
    changes = sync.membership_changes
    try:
        sync.average_([torch.zeros(5), torch.zeros(1)])
    except LayoutMismatch as exc:
        return {"error": str(exc), "changes": changes}
    return {"error": None}


@pytest.mark.parametrize("members", [2, 5])  # 5: a tree round
def test_a_newcomer_with_other_shapes_is_refused_alone(tmp_path, members):
    """A plain connect (no spec) with other tensor shapes: the roster's checker finds
    its first contribution's layout differs from its own, leaves it out of the round
    and tells it what differs; the members average on, and the job's count of
    membership changes is what it was."""
    url, stop = str(tmp_path / "store"), str(tmp_path / "stop")
    procs, results = start_ranks(w_fitting, members, url, members, stop)
    wait_until((tmp_path / "store" / "el.refuse" / names.elastic_roster(3)).exists, "round 3",
               timeout=60)
    late, late_results = start_ranks(w_misfit, 1, url)
    (misfit,) = collect(late, late_results, 60).values()
    open(stop, "w").close()
    got = collect(procs, results, 120)
    assert misfit["error"] and "refused" in misfit["error"], misfit
    assert "float32[8]" in misfit["error"] and "float32[5]" in misfit["error"], misfit
    for log in got.values():
        assert all(total == members for total, *_ in log), log
        assert [v for _, v, _, _ in log] == pytest.approx([avg_of(range(members))] * len(log))
        assert members + 1 in {w for *_, w, _ in log}, log  # it was admitted for a round
        # the admission counted for the round it lasted; the refusal took it back
        assert all(c == (w == members + 1) for *_, w, c in log), log
        assert log[-1][2] == members and log[-1][3] == 0, log
