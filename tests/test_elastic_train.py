"""``python -m ferrosync.train --elastic`` (ferrosync/train/elastic.py, docs/elastic.md):
members started as separate processes, killed, stopped and started again while the
job runs, as a user on spot instances would (tests/elastic_members.py); what a job
resumes from after it lost every member is tests/test_elastic_publish.py's.

Every member writes its own metrics file (one line per global step with the member
count), which is how the tests watch the job's progress: no sleeps stand in for it.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sys

import pytest
import torch
from elastic_members import (
    FAST,
    admit_newcomer,
    finals_of,
    finish,
    held,
    last_step,
    member,
    metrics,
    wait_for,
)
from train_cli import final_of, start_cli
from train_models import HOLD

from ferrosync.train.__main__ import main
from ferrosync.train.elastic import GlobalBatches
from ferrosync.train.state_tree import flatten, unflatten
from ranks import wait_until


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


def test_launcher_members_outlive_a_failed_sibling(tmp_path):
    url = str(tmp_path / "job")
    proc = start_cli("--nproc", 3, "--elastic", "--min-ranks", "2", "--sync", url,
                     "--steps", 400, "--no-progress", *FAST, "--metrics",
                     tmp_path / "m.jsonl", cwd=tmp_path)
    started = _started_line(proc)
    # each local member writes its own metrics file, PATH.K
    wait_until(lambda: _lines(tmp_path / "m.jsonl.1") > 40, "member 1 past step 40",
               timeout=120)
    os.kill(int(re.search(r"rank 1 pid (\d+)", started).group(1)), signal.SIGKILL)
    code, out, err = finish(proc)
    err = started + err
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


def _started_line(proc) -> str:
    """The launcher's stderr up to its "started N ranks (rank 0 pid P, ...)" line, which
    it writes before anything else a rank says."""
    seen, line = "", ""
    while not line.startswith("ferrosync.train: started "):
        line = proc.stderr.readline()
        assert line, f"the launcher exited before starting its ranks: {seen}"
        seen += line
    return seen


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
