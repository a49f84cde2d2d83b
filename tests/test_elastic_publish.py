"""An elastic trainer job's published state (``--publish-every``, docs/elastic.md):
what a job resumes from after it lost every member (SIGKILL or SIGTERM), a late member
of a finished job, the state's manifest checked on read, rank 0 publishing when a
member leaves, and when rank 0 publishes. Members run as separate processes
(tests/elastic_members.py), the pieces in process.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import time

import pytest
import torch
from elastic_members import FAST, finals_of, finish, held, last_step, member, metrics, wait_for
from train_cli import final_of, run_forked, start_cli
from train_models import HOLD

import ferrosync
from ferrosync.elastic.state import PublishedState
from ferrosync.errors import ShardCorrupt
from ranks import wait_until


def test_a_job_that_lost_every_member_resumes_with_another_count(tmp_path):
    """Two members publish the state every 20 steps and are both SIGKILLed; three new
    members resume the job from the store and finish it."""
    url = str(tmp_path / "job")
    flags = ("--steps", 200, "--publish-every", 20, *FAST)
    first = {n: member(tmp_path, url, n, "--min-ranks", "2", *flags) for n in ("a", "b")}
    wait_until(lambda: last_step(tmp_path, "a") >= 70, "member a past step 70", timeout=120)
    for proc in first.values():
        proc.send_signal(signal.SIGKILL)
    killed_at = max(last_step(tmp_path, n) for n in ("a", "b"))
    for proc in first.values():
        finish(proc)
    second = {n: member(tmp_path, url, n, "--min-ranks", "3", *flags) for n in ("c", "d", "e")}
    finals = list(finals_of(second, second).values())
    assert len({f["param_digest"] for f in finals}) == 1
    resumed = {f["joined_at_step"] for f in finals}
    assert len(resumed) == 1
    (at,) = resumed
    # the newest state published before the kill: a multiple of 20, at most 40 back
    assert at % 20 == 0 and killed_at - 40 <= at <= killed_at, (at, killed_at)
    assert all(f["steps"] == 200 and f["members"] == 3 for f in finals)
    c = metrics(tmp_path, "c")
    assert c[0]["step"] == at + 1 and {r["members"] for r in c} == {3}


@pytest.mark.parametrize("strategy", [("grad",), ("local-sgd", "--sync-every", 5),
                                      ("diloco", "--sync-every", 5)])
def test_publish_every_works_for_every_strategy(tmp_path, strategy):
    """``--publish-every K`` publishes at the founding round too: the strategy's state
    (DiLoCo's global copy and outer optimizer) must exist by then, for every strategy."""
    url = str(tmp_path / "job")
    flags = ("--min-ranks", "2", "--steps", 20, "--publish-every", 5, "--strategy",
             *strategy, *FAST)
    procs = {n: member(tmp_path, url, n, *flags) for n in ("a", "b")}
    finals = finals_of(procs, procs)
    assert len({f["param_digest"] for f in finals.values()}) == 1, finals
    assert all(f["steps"] == 20 and f["ranks_agree"] for f in finals.values()), finals
    # founders of a new job resumed from nothing
    assert all(f["resumed_from"] is None for f in finals.values()), finals
    # the published state is the job's end, readable by a process that comes later
    code, out, err = finish(member(tmp_path, url, "c", *flags))
    assert code == 0, err[-2000:]
    assert final_of(out)["param_digest"] == finals["a"]["param_digest"]


def test_a_finished_job_reports_without_training(tmp_path):
    url = str(tmp_path / "job")
    flags = ("--steps", 30, "--strategy", "local-sgd", "--sync-every", 10)
    code, out, err = finish(member(tmp_path, url, "a", *flags))
    assert code == 0, err
    done = final_of(out)
    code, out, err = finish(member(tmp_path, url, "b", *flags))
    assert code == 0, err
    again = final_of(out)
    assert again["param_digest"] == done["param_digest"] and again["steps"] == 30
    # one line says so (no summary table of a run that trained nothing), then FINAL
    said, final = out.strip().splitlines()[-2:]
    assert said.startswith("ferrosync.train: this job already ended at step 30 (FINAL"), out
    assert final.startswith("FINAL ") and "samples/s" not in out, out
    assert again["steps_this_run"] == 0 and metrics(tmp_path, "b") == []
    # inspect tells the story: the state's step and phase, and the end marker
    out = run_forked([sys.executable, "-m", "ferrosync", "inspect", url, "--json",
                      "--watch", "0"], capture_output=True, text=True, timeout=60)
    (job,) = json.loads(out.stdout)["elastic_jobs"]
    assert job["state"]["step"] == 30 and job["state"]["phase"] == "summarised", job
    assert job["ended_at_round"] is not None and not job["problems"], job
    # another member count does not matter, other flags do: one line, exit 2
    code, out, err = finish(member(tmp_path, url, "c", "--steps", 40, "--strategy",
                                   "local-sgd", "--sync-every", 10))
    assert code == 2 and "total_steps 30 (here 40)" in err and "Traceback" not in err, err


@pytest.mark.unit
def test_read_state_refuses_a_manifest_that_does_not_match(tmp_path):
    import ferrosync
    from ferrosync.storage import names
    from ferrosync.storage.wire import decode_record, encode_record

    with ferrosync.connect(str(tmp_path), elastic=True, job="st", timeout=20) as sync:
        assert sync.read_state() is None
        sync.barrier()
        sync.publish_state({"w": torch.arange(6.0).view(2, 3), "n": torch.tensor([7])},
                           {"step": 3})
        got = sync.read_state(min_round=sync.round)
        assert isinstance(got, PublishedState) and got.meta == {"step": 3}
        assert torch.equal(got.tensors["w"], torch.arange(6.0).view(2, 3))
        assert got.tensors["n"].dtype == torch.int64
        # a pointer rewritten to describe other shapes than the object holds
        pointer = tmp_path / names.elastic_namespace("st") / names.ELASTIC_STATE_POINTER
        record = decode_record(pointer.read_bytes(), None, path=str(pointer))
        record["manifest"]["shapes"][0] = [3, 2]
        pointer.write_bytes(encode_record(record, None))
        with pytest.raises(ShardCorrupt, match="manifest does not describe"):
            sync.read_state()
        record["manifest"]["dtypes"][0] = "object"
        pointer.write_bytes(encode_record(record, None))
        with pytest.raises(ShardCorrupt, match="no valid manifest"):
            sync.read_state()


def test_one_member_started_after_total_loss_trains_from_the_newest_state(tmp_path):
    """Every member is SIGKILLed (their last contributions stay on storage); one new
    member, started alone, resumes from the newest published step after about one
    heartbeat timeout: the dead members leave in one roster, not one after another,
    and it does not wait for a dead member to publish the state."""
    url = str(tmp_path / "job")
    flags = ("--min-ranks", "1", "--steps", 400, "--publish-every", 20,
             "--model", "train_models:paced_mlp", *FAST)
    first = {n: member(tmp_path, url, n, *flags) for n in ("a", "b", "c")}
    wait_until(lambda: min(last_step(tmp_path, n) for n in first) >= 45
               and {r["members"] for r in metrics(tmp_path, "a")[-1:]} == {3},
               "three members past step 45", timeout=120)
    for proc in first.values():
        proc.send_signal(signal.SIGKILL)
    for proc in first.values():
        finish(proc)
    killed_at = max(last_step(tmp_path, n) for n in first)
    out = run_forked([sys.executable, "-m", "ferrosync", "inspect", url, "--json",
                      "--watch", "0"], capture_output=True, text=True, timeout=60)
    (job,) = json.loads(out.stdout)["elastic_jobs"]
    newest = job["state"]["step"]  # the newest published state
    started = time.monotonic()
    procs = {"d": member(tmp_path, url, "d", *flags)}
    wait_for(procs, lambda: last_step(tmp_path, "d") >= 0, "the new member trains")
    took = time.monotonic() - started
    (final,) = finals_of(procs, ["d"]).values()
    at = final["joined_at_step"]
    assert at == newest and killed_at - 40 <= at <= killed_at, (at, newest, killed_at)
    assert final["steps"] == 400 and final["members"] == 1
    # the old way waited one timeout per dead member, then for a dead rank 0's state
    print(f"the new member trained {took:.1f} s after it started (heartbeat_timeout 3 s)")
    assert took < 3 * 3 + 20, took


def test_every_member_stopped_by_sigterm_then_a_new_one_resumes_where_they_left(tmp_path):
    """Total loss by SIGTERM (every member gets a preemption notice at once): each
    finishes its round (diloco: the merge at step 24), rank 0 publishes, and each says
    it left and exits 143; a member started later resumes at exactly step 24, and its
    first metrics line carries the data's epoch there (1), not 0. Meanwhile a third
    process started on a running member's metrics file is refused in one line."""
    url = str(tmp_path / "job")
    # 2 members x 1024 samples: 16 steps per epoch of the demo's 32,768
    flags = ("--min-ranks", "2", "--strategy", "diloco", "--sync-every", 4, "--steps", 40,
             "--batch-size", 1024, "--model", "train_models:paced_mlp", *FAST)
    hold = held(tmp_path, at=22)  # inside the round that merges at step 24
    procs = {n: member(tmp_path, url, n, *flags, **hold) for n in ("a", "b")}
    wait_for(procs, lambda: min(last_step(tmp_path, n) for n in procs) >= 21,
             "both members held at step 22")
    code, _, err = finish(start_cli("--elastic", "--sync", url, "--no-progress", "--metrics",
                                    tmp_path / "a.jsonl", *flags, cwd=tmp_path))
    assert code == 2 and len(err.strip().splitlines()) == 1, err[-2000:]
    assert "another process on this host" in err and "a.jsonl" in err, err
    for proc in procs.values():
        proc.send_signal(signal.SIGTERM)
    hold[HOLD].unlink()
    said = {}
    for name, proc in procs.items():
        code, _, err = finish(proc)
        assert code == 128 + signal.SIGTERM, (name, err[-2000:])
        (said[name],) = [line for line in err.splitlines() if "left the job at step" in line]
        assert last_step(tmp_path, name) == 24, metrics(tmp_path, name)[-1]
    assert sum("published the job's state at step 24" in line for line in said.values()) == 1, said
    c = member(tmp_path, url, "c", *flags[2:], "--min-ranks", "1")
    code, out, err = finish(c)
    assert code == 0, err[-3000:]
    final = final_of(out)
    assert final["joined_at_step"] == 24 and final["steps"] == 40, final
    # it says what it resumed from, and FINAL says so as a resumed fixed-size run's does
    assert final["resumed_from"] == 24, final
    assert re.search(r"^ferrosync\.train: member \S+: resuming from the state published at "
                     r"step 24 \(round \d+\)$", err, re.M), err[-3000:]
    assert "resumed at step 24" in out + err  # the summary's steps row
    first = metrics(tmp_path, "c")[0]
    assert (first["step"], first["epoch"], first["members"]) == (25, 1, 1), first


def _small_trainer(strategy, **kwargs):
    from ferrosync.train.elastic import ElasticTrainer

    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(96, 6, generator=g),
                                          torch.randint(0, 3, (96,), generator=g))
    return ElasticTrainer(lambda: torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(),
                                                      torch.nn.Linear(5, 3)),
                          lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                          torch.nn.functional.cross_entropy, data, steps=30, batch_size=8,
                          strategy=strategy, progress=False, report=False,
                          publish_every_seconds=0, **kwargs)


@pytest.mark.unit
@pytest.mark.parametrize("wire", ["int8", "bfloat16"])
def test_leaving_members_and_founders_through_a_lossy_wire(tmp_path, wire):
    """In process, two members (threads) of a job whose averages go through an int8 /
    bfloat16 wire. Member b (rank 1) is asked to leave (SIGTERM's path): its vote
    rides in its next round, after which it leaves and rank 0, asked nothing, publishes
    that step's state (the ballot: so members asked at nearly the same time never
    strand each other). Then rank 0 is asked and leaves, publishing. Two founders
    restart the job: right after founding each holds the published model bit for bit
    (a broadcast; an average through the codec rounded it on every founder)."""
    from concurrent.futures import ThreadPoolExecutor

    from ferrosync.strategies import GradAveraging
    from ferrosync.train.elastic import MemberLeft
    from ferrosync.train.metrics import param_digest

    class Recording(GradAveraging):
        def attach(self, model, optimizer, sync):  # after founding, before training
            self.digest = param_digest(model)
            super().attach(model, optimizer, sync)

    url = str(tmp_path)
    options = dict(elastic=True, job="leave", wire_dtype=wire, timeout=60,
                   heartbeat_interval=0.2, heartbeat_timeout=5)
    a, b = _small_trainer(GradAveraging()), _small_trainer(GradAveraging())
    seen = {}

    def pace_a():  # a waits for b to join, then records what is published when b leaves
        sync = seen["a_sync"]
        if sync.world_size < 2 and "b_left" not in seen:
            time.sleep(0.02)  # rounds go on (b is admitted at one); bounded by the steps
        if "b_left" in seen and a.step > seen["b_left"].step and "state" not in seen:
            seen["state"] = sync.read_state().meta["step"]  # a published at b's last step
            a.request_leave()

    def ask_b():
        if b.joined_at is not None and b.step == b.joined_at + 2:
            b.request_leave()

    a.step_hooks.append(pace_a)
    b.step_hooks.append(ask_b)

    def member(name, trainer):
        with ferrosync.connect(url, **options) as sync:
            seen[f"{name}_sync"] = sync
            try:
                trainer.fit(sync)
            except MemberLeft as left:
                seen[f"{name}_left"] = left
                return left

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(member, "a", a)
        wait_until(lambda: "a_sync" in seen, "member a connected", timeout=30)
        second = pool.submit(member, "b", b)
        left_a, left_b = first.result(timeout=120), second.result(timeout=120)
    assert (left_b.rank, left_b.published) == (1, False), left_b
    assert left_b.step == b.joined_at + 3  # asked after step +2: its vote rode in step +3
    assert seen["state"] == left_b.step  # rank 0 published when b left
    assert left_a.published and left_a.step > left_b.step, left_a
    published = param_digest(a.model)

    def found(trainer):
        with ferrosync.connect(url, min_ranks=2, **options) as sync:
            return trainer.fit(sync)

    founders = [_small_trainer(Recording()) for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        finals = list(pool.map(found, founders))
    assert [f.strategy.digest for f in founders] == [published, published]
    assert all(f["joined_at_step"] == left_a.step and f["steps"] == 30 for f in finals)
    assert finals[0]["param_digest"] == finals[1]["param_digest"]


@pytest.mark.unit
def test_rank_0_publishes_by_steps_and_by_clock():
    from ferrosync.train.elastic import PUBLISH_EVERY_SECONDS, Publishing

    clock = Publishing()  # the default: the clock alone
    clock.done(step=10, now=100.0)
    assert not clock.due(11, 100.0 + PUBLISH_EVERY_SECONDS - 1)
    assert clock.due(11, 100.0 + PUBLISH_EVERY_SECONDS)
    steps = Publishing(every=20, seconds=0)
    steps.done(step=39, now=0.0)
    assert not steps.due(39, 1e9) and steps.due(40, 0.0)
    steps.done(step=40, now=0.0)
    assert not steps.due(59, 0.0) and steps.due(61, 0.0)
