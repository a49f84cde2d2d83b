"""``python -m ferrosync.train --elastic`` (ferrosync/train/elastic.py, docs/elastic.md):
members started as separate processes, killed, stopped and started again while the
job runs, as a user on spot instances would.

Every member writes its own metrics file (one line per global step with the member
count), which is how the tests watch the job's progress: no sleeps stand in for it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from train_cli import final_of, read_metrics_so_far, run_forked, start_cli
from train_models import HOLD, HOLD_AT

import ferrosync
from ferrosync import names
from ferrosync.elastic.state import PublishedState
from ferrosync.errors import ShardCorrupt
from ferrosync.storage import open_storage
from ferrosync.train.__main__ import main
from ferrosync.train.elastic import GlobalBatches
from ferrosync.train.state_tree import flatten, unflatten
from ranks import wait_until

# short heartbeats: a killed member is dropped within seconds
FAST = ["--sync-option", "heartbeat_interval=0.3", "--sync-option", "heartbeat_timeout=3"]


def member(tmp_path, url, name, *flags, **env):
    """Start one member; its metrics file is tmp_path/name.jsonl."""
    return start_cli("--elastic", "--sync", url, "--no-progress", "--metrics",
                     tmp_path / f"{name}.jsonl", *flags, cwd=tmp_path, **env)


def metrics(tmp_path, name) -> list[dict]:
    return read_metrics_so_far(tmp_path / f"{name}.jsonl")


def last_step(tmp_path, name) -> int:
    rows = metrics(tmp_path, name)
    return rows[-1]["step"] if rows else -1


def wait_for(procs, predicate, what, timeout=120):
    """``wait_until`` that, when it fails, shows what every member wrote to stderr."""
    try:
        wait_until(predicate, what, timeout=timeout)
    except AssertionError as exc:
        for proc in procs.values():
            proc.kill()
        report = {n: p.communicate()[1][-1500:] for n, p in procs.items()}
        raise AssertionError(f"{exc}; members' stderr: {report}") from None


def join_requests(url, storage_options=None) -> int:
    """How many members have asked to join the (id-less) job at ``url``: its join
    queue's entries, read from the store the way a member reads them."""
    storage = open_storage(url, storage_options)
    try:
        return sum(1 for key, _ in storage.list(names.elastic_namespace(None))
                   if names.parse_elastic(key.rsplit("/", 1)[-1]).kind == "elastic_join")
    finally:
        storage.close()


def held(tmp_path, at: int) -> dict:
    """The environment that holds a member at its ``at``-th training step while
    tmp_path/hold exists (train_models.PacedMLP), and creates that file."""
    (tmp_path / "hold").touch()
    return {HOLD: tmp_path / "hold", HOLD_AT: at}


def admit_newcomer(procs, tmp_path, url, name, flags, *, hold: dict, storage_options=None):
    """Once the founders are held (``held``), start newcomer ``name``, wait until its
    join request is in the store, then let the job go on: it admits the newcomer at
    its next round, however long the newcomer took to start."""
    founders = list(procs)
    at = hold[HOLD_AT]
    wait_for(procs, lambda: all(last_step(tmp_path, n) >= at - 1 for n in founders),
             f"the founders held at step {at}")
    queued = join_requests(url, storage_options)
    procs[name] = member(tmp_path, url, name, *flags)
    wait_for(procs, lambda: join_requests(url, storage_options) > queued,
             f"member {name} asks to join")
    hold[HOLD].unlink()
    wait_for(procs, lambda: last_step(tmp_path, name) >= 0, f"member {name} trains")


def finals_of(procs, names) -> dict:
    """Wait for the named members; each must exit 0 with a FINAL line: those, by name."""
    finals = {}
    for name in names:
        code, out, err = finish(procs[name])
        assert code == 0, (name, err[-3000:])
        finals[name] = final_of(out)
    return finals


def finish(proc, timeout=240) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"member did not finish: {err[-2000:]}") from None
    return proc.returncode, out, err


def test_diloco_job_survives_a_kill_and_takes_a_newcomer(tmp_path):
    """The spot-instance recipe: three members start, a fourth joins while they train,
    then one of the first is SIGKILLed; the survivors and the newcomer finish as one
    model."""
    url = str(tmp_path / "job")
    steps, h = 600, 30
    # --min-ranks 3: all three found the job (a slow starter would otherwise be a
    # newcomer, and the founders' hold would keep it out); three remain after the kill
    flags = ("--min-ranks", "3", "--strategy", "diloco", "--sync-every", h, "--steps", steps,
             "--model", "train_models:paced_mlp", *FAST)
    hold = held(tmp_path, at=h + 5)  # mid-round, after the first merge
    procs = {n: member(tmp_path, url, n, *flags, **hold) for n in ("a", "b", "c")}
    admit_newcomer(procs, tmp_path, url, "d", flags, hold=hold)
    procs["c"].send_signal(signal.SIGKILL)
    finals = finals_of(procs, ("a", "b", "d"))
    assert finish(procs["c"])[0] == -signal.SIGKILL
    digests = {f["param_digest"] for f in finals.values()}
    assert len(digests) == 1, finals  # one model
    for f in finals.values():
        assert f["steps"] == steps and f["elastic"] and f["ranks_agree"], f
        assert f["accuracy"] >= 0.9, f
        assert f["members"] == 3 and f["membership_changes"] >= 2, f
    assert finals["d"]["joined_at_step"] >= h and finals["d"]["joined_at_step"] % h == 0
    # every member's lines: the global step, one per step, and the member count
    a = metrics(tmp_path, "a")
    assert [r["step"] for r in a] == list(range(a[0]["step"], steps + 1))
    d = metrics(tmp_path, "d")
    assert d[0]["step"] == finals["d"]["joined_at_step"] + 1 and d[-1]["step"] == steps
    assert d[0]["members"] == 4 and d[-1]["members"] == 3  # with c, then without
    # the dead member held the survivors for about its heartbeat timeout, not longer
    assert max(r["sync_s"] for r in a) < 3 + 6, max(r["sync_s"] for r in a)


def test_grad_job_a_graceful_leave_is_seen_within_a_round(tmp_path):
    """SIGTERM makes a member leave; with a heartbeat timeout of 60 s the others must
    learn it from the member's own "left" record, not from its silence."""
    url = str(tmp_path / "job")
    flags = ("--min-ranks", "2", "--steps", 300, "--sync-option", "heartbeat_timeout=60")
    procs = {n: member(tmp_path, url, n, *flags) for n in ("a", "b", "c")}
    wait_until(lambda: last_step(tmp_path, "b") >= 60, "member b past step 60", timeout=120)
    procs["b"].send_signal(signal.SIGTERM)
    code, _, err = finish(procs["b"])
    assert code == 128 + signal.SIGTERM, err[-2000:]
    finals = list(finals_of(procs, ("a", "c")).values())
    assert finals[0]["param_digest"] == finals[1]["param_digest"]
    assert finals[0]["members"] == 2 and finals[0]["steps"] == 300
    rows = metrics(tmp_path, "a")
    assert max(r["sync_s"] for r in rows) < 10, "a graceful leave waited for the timeout"
    assert [r["members"] for r in rows][-1] == 2
    # grad: every member's step is one round, shards follow the member count
    assert all(r["synced"] for r in rows)


# more seeds for a longer shake-out: FERROSYNC_CHURN_SEEDS=1,2,3,4 pytest -k churn
@pytest.mark.parametrize("seed", [int(x) for x in os.environ.get(
    "FERROSYNC_CHURN_SEEDS", "7").split(",")])
def test_random_churn_ends_as_one_model(tmp_path, seed):
    """Members are SIGKILLed or SIGTERMed at random points and replaced at once, four
    times; whoever is left at the end finishes the job with one model."""
    rng = random.Random(seed)
    url = str(tmp_path / "job")
    steps = 500
    flags = ("--min-ranks", "2", "--steps", steps, *FAST)
    procs = {f"m{i}": member(tmp_path, url, f"m{i}", *flags) for i in range(3)}
    gone = {}
    for event in range(4):
        alive = sorted(n for n, p in procs.items() if n not in gone)
        target = max(last_step(tmp_path, n) for n in alive) + rng.randint(15, 60)
        wait_until(lambda alive=alive, target=target: target >= steps or
                   max(last_step(tmp_path, n) for n in alive) >= target,
                   f"step {target} (event {event}, seed {seed})", timeout=120)
        victim = rng.choice(alive)
        how = rng.choice([signal.SIGKILL, signal.SIGTERM])
        procs[victim].send_signal(how)
        gone[victim] = how
        name = f"m{len(procs)}"
        procs[name] = member(tmp_path, url, name, *flags)
    finals = {}
    for name, proc in procs.items():
        code, out, err = finish(proc)
        if name in gone:
            assert code in (-gone[name], 128 + gone[name], 0), (name, code, err[-2000:])
            continue
        assert code == 0, (name, seed, err[-3000:])
        finals[name] = final_of(out)
    assert len(finals) >= 2
    assert len({f["param_digest"] for f in finals.values()}) == 1, (seed, finals)
    for name, f in finals.items():
        assert f["steps"] == steps and f["ranks_agree"], f
        rows = metrics(tmp_path, name)
        if rows:  # one line per global step from where it joined
            assert [r["step"] for r in rows] == list(range(rows[0]["step"], steps + 1))


def test_a_member_paused_past_the_timeout_rejoins(tmp_path):
    """SIGSTOP one member while the others go on: they drop it; on SIGCONT it learns
    it was dropped (its round's roster is long gone), joins again as a newcomer and
    finishes with the same model."""
    url = str(tmp_path / "job")
    flags = ("--min-ranks", "2", "--steps", 300, "--model", "train_models:paced_mlp", *FAST)
    procs = {n: member(tmp_path, url, n, *flags) for n in ("a", "b", "c")}
    wait_for(procs, lambda: min(last_step(tmp_path, n) for n in procs) >= 20,
             "all three past step 20")
    procs["c"].send_signal(signal.SIGSTOP)
    stopped_at = last_step(tmp_path, "a")
    # the others go on for more rounds than the rosters are kept (64): c must learn
    # it was dropped from its own round's roster being gone, not wait out its timeout
    wait_for(procs, lambda: any(r["members"] == 2 and r["step"] > stopped_at + 80
                                for r in metrics(tmp_path, "a")), "c dropped, 80 rounds on")
    procs["c"].send_signal(signal.SIGCONT)
    code, out, err = finish(procs["c"])
    assert code == 0 and "fell more than 64 rounds behind" in err and "joining again" in err, \
        err[-3000:]
    finals = {"c": final_of(out), **finals_of(procs, ("a", "b"))}
    assert len({f["param_digest"] for f in finals.values()}) == 1, finals
    assert finals["c"]["joined_at_step"] > stopped_at and finals["c"]["members"] == 3
    # its metrics read as one run: up to the pause, then from where it rejoined
    steps = [r["step"] for r in metrics(tmp_path, "c")]
    assert steps == sorted(set(steps)) and steps[-1] == 300


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


def test_launcher_members_outlive_a_failed_sibling(tmp_path):
    url = str(tmp_path / "job")
    proc = start_cli("--nproc", 3, "--elastic", "--min-ranks", "2", "--sync", url,
                     "--steps", 400, "--no-progress", *FAST, "--metrics",
                     tmp_path / "m.jsonl", cwd=tmp_path)
    # each local member writes its own metrics file, PATH.K
    wait_until(lambda: _lines(tmp_path / "m.jsonl.1") > 40, "member 1 past step 40",
               timeout=120)
    os.kill(_member_pid(url), signal.SIGKILL)
    code, out, err = finish(proc)
    assert code == 1, err[-2000:]
    assert "member 1 was killed by SIGKILL" in err and "went on without it" in err, err
    assert "stopped" not in err
    final = final_of(out)
    assert final["steps"] == 400 and final["members"] == 2 and final["ranks_agree"]
    for k in (0, 2):  # the survivors trained to the end (the later one from its join)
        steps = [json.loads(line)["step"] for line in
                 (tmp_path / f"m.jsonl.{k}").read_text().splitlines()]
        assert steps == list(range(steps[0], 401)), k


def _lines(path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _member_pid(url) -> int:
    """The pid of the launcher's member 1 (LOCAL_RANK=1), from /proc."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"FERROSYNC_URL") == url.encode() and env.get(b"LOCAL_RANK") == b"1" \
                and env.get(b"FERROSYNC_TRAIN_CHILD") == b"1":
            return int(entry)
    raise AssertionError("member 1 not found")


def test_a_diloco_job_over_s3_takes_a_newcomer_and_a_leave(seaweed_transport, tmp_path):
    """The same over the real S3 server: two members start, a third joins, one leaves."""
    options = json.dumps(seaweed_transport.options["storage_options"])
    flags = ("--min-ranks", "2", "--strategy", "diloco", "--sync-every", 10, "--steps", 300,
             "--model", "train_models:paced_mlp", "--sync-option",
             f"storage_options={options}", *FAST)
    url = seaweed_transport.url
    hold = held(tmp_path, at=35)  # mid-round, after the merge at step 30
    procs = {n: member(tmp_path, url, n, *flags, **hold) for n in ("a", "b")}
    admit_newcomer(procs, tmp_path, url, "c", flags, hold=hold,
                   storage_options=seaweed_transport.options["storage_options"])
    procs["b"].send_signal(signal.SIGTERM)
    assert finish(procs["b"])[0] == 128 + signal.SIGTERM
    finals = list(finals_of(procs, ("a", "c")).values())
    assert finals[0]["param_digest"] == finals[1]["param_digest"]
    assert finals[1]["joined_at_step"] >= 30 and finals[1]["joined_at_step"] % 10 == 0
    assert all(f["members"] == 2 and f["steps"] == 300 for f in finals)
    assert finals[0]["storage_requests"]["requests"] > 0


@pytest.mark.parametrize("flags, words", [
    (["--min-ranks", "2"], "--min-ranks need(s) --elastic"),
    (["--elastic", "--checkpoint-dir", "ck"], "--checkpoint-dir does not go with --elastic"),
    (["--elastic", "--strategy", "streaming-diloco"], "grad, local-sgd or diloco"),
    (["--elastic", "--sync-every-seconds", "5", "--strategy", "diloco"],
     "--sync-every-seconds does not go with --elastic"),
    (["--elastic", "--min-ranks", "3", "--max-ranks", "2"], "below --min-ranks"),
])
def test_elastic_flag_errors_are_one_line(flags, words, capsys):
    assert main(["--sync", "/nonexistent", *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err


# -- the pieces, in process ----------------------------------------------------------------

@pytest.mark.unit
def test_state_tree_round_trip_keeps_key_types_and_odd_floats():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=1e-3)
    opt.param_groups[0]["params"][0].grad = torch.ones(3)
    opt.step()
    tree = {"optimizer": opt.state_dict(), "x": (1, float("inf"), None, "s"), "t": torch.ones(2)}
    tensors, skeleton = flatten(tree, "s")
    back = unflatten(json.loads(json.dumps(skeleton)), tensors)
    assert list(back["optimizer"]["state"]) == [0]  # an int key stays an int
    assert back["x"] == (1, float("inf"), None, "s")
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"],
                       opt.state_dict()["state"][0]["exp_avg"])
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=1e-3)
    fresh.load_state_dict(back["optimizer"])
    with pytest.raises(TypeError, match="cannot be handed"):
        flatten({"f": object()}, "s")
    with pytest.raises(ValueError):
        unflatten({"zz": 1}, {})


@pytest.mark.unit
def test_global_batches_are_disjoint_and_follow_the_member_count():
    data = list(range(100))
    dataset = [(torch.tensor([i]), i) for i in data]
    seen = []
    for world in (2, 3, 1, 4):  # the member count changes every step
        streams = [GlobalBatches(dataset, 100, 5, seed=1) for _ in range(world)]
        for s in streams:  # every member at the same position
            s.epoch, s.position = 0, len(seen)
        step = [set(s.take(k, world)[1].tolist()) for k, s in enumerate(streams)]
        assert all(len(b) == 5 for b in step)
        assert len(set().union(*step)) == 5 * world  # disjoint within the step
        assert not set().union(*step) & set(seen)    # and new to the epoch
        seen += sorted(set().union(*step))
        assert len({(s.epoch, s.position) for s in streams}) == 1


@pytest.mark.unit
def test_read_state_refuses_a_manifest_that_does_not_match(tmp_path):
    import ferrosync
    from ferrosync import names
    from ferrosync.wire import decode_record, encode_record

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


@pytest.mark.parametrize("flags, words", [
    (("--model", "train_models:paced_tanh_mlp"), "model"),
    (("--model", "train_models:paced_mlp", "--lr", "0.5"), "optimizer"),
    (("--model", "train_models:wide_mlp"), "model"),
], ids=["other-activation", "other-lr", "other-shapes"])
def test_a_newcomer_that_does_not_fit_is_refused_alone(tmp_path, flags, words):
    """A newcomer with another model structure (same shapes, another activation),
    another learning rate or other shapes is refused before it writes anything, with
    a one-line error naming the difference; the running members go on and count no
    membership change."""
    url = str(tmp_path / "job")
    job = ("--min-ranks", "2", "--steps", 60, *FAST)
    hold = held(tmp_path, at=15)
    procs = {n: member(tmp_path, url, n, "--model", "train_models:paced_mlp", *job, **hold)
             for n in ("a", "b")}
    wait_for(procs, lambda: min(last_step(tmp_path, n) for n in procs) >= 14,
             "the job held at step 15")
    code, _, err = finish(member(tmp_path, url, "c", *job, *flags))
    assert code == 2 and "does not fit the elastic job" in err and words in err, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    hold[HOLD].unlink()
    finals = finals_of(procs, ("a", "b"))
    assert all(f["membership_changes"] == 0 and f["members"] == 2 for f in finals.values())
    assert len({f["param_digest"] for f in finals.values()}) == 1


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
    (final,) = finals_of({"c": c}, ["c"]).values()
    assert final["joined_at_step"] == 24 and final["steps"] == 40, final
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


@pytest.mark.unit
def test_elastic_progress_lines_show_on_stderr(capsys):
    """The elastic layer says what a member waits for through the ``ferrosync.elastic``
    logger at INFO; a member of the trainer shows those lines on stderr."""
    import logging

    from ferrosync.train.runner import show_elastic_progress

    logger = logging.getLogger("ferrosync.elastic")
    level = logger.level
    handler = show_elastic_progress()
    try:
        assert show_elastic_progress() is handler  # once per process
        handler.setStream(sys.stderr)  # this test's captured stderr
        logger.info("waiting for members: 1 here, 2 needed (min_ranks=2)")
        logger.debug("not shown")
        logging.getLogger("ferrosync.elastic.rounds").info("still waiting")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert capsys.readouterr().err == (
        "ferrosync.elastic: waiting for members: 1 here, 2 needed (min_ranks=2)\n"
        "ferrosync.elastic: still waiting\n")


@pytest.mark.unit
def test_a_metrics_path_has_one_writer_per_host(tmp_path):
    """A file another process holds is refused in one line naming its pid; claims of
    one path within one process nest; the last release frees it."""
    import fcntl

    from ferrosync.errors import ConfigError
    from ferrosync.train.metrics import PathClaim

    path = tmp_path / "m.jsonl"
    first = PathClaim(str(path))
    second = PathClaim(str(tmp_path / "." / "m.jsonl"))  # the same file: nests
    second.release()
    second.release()  # idempotent
    other = os.open(first.lock_file, os.O_RDWR)  # another open file: another process
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert os.pread(other, 32, 0) == f"{os.getpid()}\n".encode()
        first.release()
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free now
        os.pwrite(other, b"4242\n", 0)
        with pytest.raises(ConfigError, match="pid 4242") as refused:
            PathClaim(str(path))
        assert "--metrics" in str(refused.value) and "\n" not in str(refused.value)
    finally:
        os.close(other)
    PathClaim(str(path)).release()  # the lock went with its file: free again
