"""Operator tools (`ferrosync inspect | gc | doctor`) against real runs.

Jobs are real rank processes (tests/ranks.py). A *live* job is provably live while
the tools look at it: its ranks loop on a collective until the test creates a stop
file, and the test waits for files the ranks write (never a sleep). The tools run
in-process through ``ferrosync.__main__.main`` (their output captured), and once as
``python -m ferrosync`` to check the entry point and the exit codes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch

import ferrosync
from ferrosync.__main__ import main
from ferrosync.errors import DuplicateRank
from ferrosync.ops import keys
from ferrosync.ops.doctor import nfs_problems
from ranks import RankFailure, collect, run_ranks, start_ranks, wait_until

FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0}
NS = f"rdzv.{os.environ['FERROSYNC_JOB']}"  # the suite's job id (tests/conftest.py)
WATCH = "2"  # seconds: two periods of the library's default 1 s heartbeat
DEAD_PID = (1 << 22) + 12345  # above Linux's largest pid_max: never a live process




# -- workers ---------------------------------------------------------------------------------

def finish_together(rank, world, done):
    """Rank 0 leaves (and closes) only once every rank is out of the last collective.

    Works around a race in the library: a rank still polling for rank 0's last result
    may read rank 0's heartbeat saying "closed" before it sees that result, and raise
    PeerFailed (seen on S3; liveness.PeerMonitor.check raises for any closed peer,
    also one that finished the awaited collective)."""
    if rank:
        open(f"{done}.{rank}", "w").close()
    else:
        wait_until(lambda: all(os.path.exists(f"{done}.{r}") for r in range(1, world)),
                   "every rank out of its last collective")


def w_steps(rank, world, url, options, steps, done, fail_rank=None):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=60, **options) as sync:
        for _ in range(steps):
            sync.average_(torch.full((256,), float(rank)))
        if rank == fail_rank:
            raise ValueError("boom from the test")
        sync.barrier()
        finish_together(rank, world, done)
        return sync.generation


def w_live(rank, world, url, options, stop, started):
    """Loops until ``stop`` exists; all ranks agree on the step to stop at (they
    average the flag), so the job ends cleanly."""
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=120, **options) as sync:
        open(f"{started}.{rank}", "w").close()
        steps = 0
        while True:
            flag = torch.tensor([1.0 if os.path.exists(stop) else 0.0])
            sync.average_(flag)
            steps += 1
            if flag.item() > 0:
                finish_together(rank, world, stop)
                return steps
            time.sleep(0.005)  # pacing only: keeps two cores free for the tools


def w_straggle(rank, world, url, options, holding, release):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=120, **options) as sync:
        for _ in range(3):
            sync.barrier()
        if rank == 1:
            open(holding, "w").close()  # outside any collective; rank 0 waits in the next
            wait_until(lambda: os.path.exists(release), "release")
        sync.barrier()
        finish_together(rank, world, release)
        return True


# -- helpers ---------------------------------------------------------------------------------

def tool(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    out = capsys.readouterr().out
    return code, out


def tool_json(capsys, *argv) -> dict:
    code, out = tool(capsys, *argv, "--json")
    assert code == 0, out
    return json.loads(out)


def files_under(root: str) -> list[str]:
    out = []
    for dirpath, _dirs, names in os.walk(root):
        out.extend(os.path.relpath(os.path.join(dirpath, n), root) for n in names)
    return sorted(out)


def generation_dirs(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("g"))


def by_number(report: dict) -> dict[int, dict]:
    return {g["generation"]: g for g in report["generations"] if g["announced"]}


def start_live(tmp_path, url, options=FAST, env=None, name="live"):
    stop, started = str(tmp_path / f"{name}-stop"), str(tmp_path / f"{name}-started")
    procs, q = start_ranks(w_live, 2, url, options, stop, started, env=env)
    wait_until(lambda: all(os.path.exists(f"{started}.{r}") for r in range(2)), "ranks started")
    return procs, q, stop


def plant_strays(url: str, live_dir: str) -> tuple[str, str]:
    """Half-written temp files of dead writers (one in the live generation ``live_dir``,
    one in the rendezvous) and a file that is not ferrosync's; returns the two temps."""
    orphan = os.path.join(url, live_dir, f".c99.r1.{DEAD_PID}.deadbeef.tmp")
    rdzv_orphan = os.path.join(url, NS, f".join.r1.9.{DEAD_PID}.0badf00d.tmp")
    for path in (orphan, rdzv_orphan):
        with open(path, "wb") as f:
            f.write(b"half a write")
    with open(os.path.join(url, "notes.txt"), "w") as f:
        f.write("not ferrosync's: left alone")
    return orphan, rdzv_orphan


def check_three_runs_report(report: dict, live_dir: str, procs) -> None:
    """``inspect --json`` on a finished run (g0), an aborted one (g1) and the live one
    (g2, ``live_dir``, ranks ``procs``) with the strays of ``plant_strays``."""
    gens = by_number(report)
    assert sorted(gens) == [0, 1, 2]
    assert gens[0]["status"] == "finished"
    assert [r["state"] for r in gens[0]["ranks"]] == ["closed", "closed"]
    assert gens[1]["status"] == "finished"
    messages = [a["message"] for a in gens[1]["aborts"]]
    assert any("boom from the test" in m for m in messages), gens[1]["aborts"]
    assert gens[2]["status"] == "live"
    for r in gens[2]["ranks"]:
        assert r["state"] == "live" and r["beat_changed"], r
        assert r["collective"] >= 1 and r["op"] == "average"
    # the planted orphan, and at most the live ranks' own writes in progress
    temps = gens[2]["temp_files"]
    assert f"{live_dir}/.c99.r1.{DEAD_PID}.deadbeef.tmp" in temps, temps
    live_pids = {str(p.pid) for p in procs.values()}
    in_progress = [t for t in temps if ".deadbeef." not in t]
    assert all(t.rsplit(".", 3)[1] in live_pids for t in in_progress), (temps, live_pids)
    assert report["orphan_temp_files"] == [f"{NS}/.join.r1.9.{DEAD_PID}.0badf00d.tmp"]
    # claims of every rank, and end markers: the rendezvous's, never "foreign"
    assert report["foreign_objects"] == ["notes.txt"]
    (job,) = report["jobs"]
    assert job["namespace"] == NS and job["job"] == "tests"
    assert job["announcements"] == [0, 1, 2] and job["newest"] == 2
    assert job["newest_prefix"] == live_dir and job["unconsumed_joins"] == {}
    assert job["end_records"] == 4  # both finished runs' ranks closed their claims
    assert job["open_claims"] == {"0": 2, "1": 2}  # the live run's
    assert {(g["job"], g["namespace"]) for g in gens.values()} == {("tests", NS)}
    assert [g["newest_of_job"] for _, g in sorted(gens.items())] == [False, False, True]
    assert all(g["bytes"] > 0 for g in gens.values())
    # one listing: the total is every generation, rdzv/ and the loose files
    loose = len(b"half a write") + len("not ferrosync's: left alone")
    assert report["total_bytes"] == sum(g["bytes"] for g in report["generations"]) + \
        report["rdzv"]["bytes"] + loose


# -- tests -----------------------------------------------------------------------------------

def test_inspect_and_gc_on_finished_aborted_and_live_runs(tmp_path, capsys):
    url = str(tmp_path / "run")
    assert run_ranks(w_steps, 2, url, FAST, 3, str(tmp_path / "done-a")) == [0, 0]  # finished
    failed = run_ranks(w_steps, 2, url, FAST, 2, str(tmp_path / "done-b"), fail_rank=1,
                       expect_errors=True)
    assert all(isinstance(r, RankFailure) for r in failed)  # generation 1: aborted
    procs, q, stop = start_live(tmp_path, url)  # generation 2: live
    try:
        live_dir = next(d for d in generation_dirs(url) if d.startswith("g2."))
        orphan, rdzv_orphan = plant_strays(url, live_dir)

        # the watch ends as soon as both live ranks have beaten: 10 s is only a bound
        report = tool_json(capsys, "inspect", url, "--watch", "10")
        check_three_runs_report(report, live_dir, procs)
        code, text = tool(capsys, "inspect", url, "--watch", "0")
        assert code == 0 and "boom from the test" in text and "FINISHED" in text
        detail = by_number(tool_json(capsys, "inspect", url, "--watch", "0", "--objects"))
        results = [o for o in detail[0]["object_list"] if o["kind"] == "result"]
        assert results, detail[0]["object_list"]
        for obj in results:  # the binary header agrees with the name and the size
            assert obj["key"].endswith(f"/c{obj['header']['collective']}.out"), obj
            assert obj["header"]["size_matches"] is True

        def settled():  # everything but the live generation's churning objects
            return [f for f in files_under(url) if not f.startswith(live_dir + "/")]

        before = settled()
        records = {f for f in before if f.startswith(NS + "/")} - {
            os.path.relpath(rdzv_orphan, url)}
        assert {f"{NS}/gen.{g}" for g in range(3)} | {
            f"{NS}/join.r{r}.{n}" for r in range(2) for n in range(3)} <= records, records
        plan = tool_json(capsys, "gc", url, "--dry-run", "--watch", WATCH)
        assert settled() == before  # a dry run deletes (and creates) nothing
        assert os.path.exists(orphan)
        removing = {d["target"] for d in plan["decisions"] if d["action"] == "remove"}
        assert any(t.startswith("g0.") for t in removing) and any(
            t.startswith("g1.") for t in removing)
        assert not any(t.startswith("g2.") for t in removing)

        done = tool_json(capsys, "gc", url, "--keep", "1", "--watch", WATCH)
        assert done["removed_objects"] > 0
        dirs = generation_dirs(url)
        assert [d.split(".")[0] for d in dirs] == ["g1", "g2"]  # g0 gone; g1 kept by --keep 1
        assert not os.path.exists(orphan) and not os.path.exists(rdzv_orphan)
        assert os.path.exists(os.path.join(url, live_dir, "hb.r0"))
        assert os.path.exists(os.path.join(url, "notes.txt"))
        assert {f for f in files_under(url) if f.startswith("rdzv")} == records  # all kept
    finally:
        open(stop, "w").close()
        out = collect(procs, q, timeout=60)
    assert all(isinstance(v, int) and v > 0 for v in out.values()), out  # undisturbed

    done = tool_json(capsys, "gc", url, "--watch", WATCH)
    assert generation_dirs(url) == []  # the live one finished: now it may go, newest or not
    assert any(d["target"].startswith("g2.") and d["action"] == "remove"
               for d in done["decisions"])
    # rdzv.tests/ survived, so the next job still gets a fresh generation number
    assert run_ranks(w_steps, 2, url, FAST, 1, str(tmp_path / "done-c")) == [3, 3]


def test_gc_keeps_the_newest_dead_generation_and_unannounced_ones(tmp_path, capsys):
    url = str(tmp_path / "run")
    procs, q, stop = start_live(tmp_path, url)
    for p in procs.values():
        os.kill(p.pid, signal.SIGKILL)
    collect(procs, q, timeout=30)
    (dead_dir,) = generation_dirs(url)
    creating = os.path.join(url, "g5.0123456789abcdef")  # rank 0 before its announcement
    loser = os.path.join(url, "g0.fedcba9876543210")  # lost generation 0 to another rank 0
    os.makedirs(creating)
    os.makedirs(loser)

    report = tool_json(capsys, "inspect", url, "--watch", WATCH)
    gens = {g["prefix"]: g for g in report["generations"]}
    assert gens[dead_dir]["status"] == "dead"
    assert [r["state"] for r in gens[dead_dir]["ranks"]] == ["stale", "stale"]
    assert gens["g5.0123456789abcdef"]["status"] == "creating"
    assert gens["g0.fedcba9876543210"]["status"] == "orphan"

    tool_json(capsys, "gc", url, "--watch", WATCH)
    # the newest generation goes only when finished; one being created is never touched
    assert generation_dirs(url) == sorted([dead_dir, "g5.0123456789abcdef"])

    assert run_ranks(w_steps, 2, url, FAST, 1, str(tmp_path / "done")) == [1, 1]
    done = tool_json(capsys, "gc", url, "--watch", WATCH)
    reasons = {d["target"]: d["reason"] for d in done["decisions"] if d["action"] == "remove"}
    assert reasons[dead_dir].startswith("dead"), reasons
    assert generation_dirs(url) == ["g5.0123456789abcdef"]


def w_duplicate(rank, world, url, options):
    """A second process claiming a rank a running job holds: it must fail."""
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=30, **options):
        return "connected"


def test_two_jobs_with_ids_each_with_generation_0(tmp_path, capsys):
    url = str(tmp_path / "run")
    job_a, job_b = {"FERROSYNC_JOB": "job-a"}, {"FERROSYNC_JOB": "job-b"}
    for n in range(2):  # job-a: generations 0 and 1, finished
        assert run_ranks(w_steps, 2, url, FAST, 2, str(tmp_path / f"done-a{n}"),
                         env=job_a) == [n, n]
    a_dirs = generation_dirs(url)
    procs, q, stop = start_live(tmp_path, url, env=job_b, name="b")  # job-b: generation 0
    try:
        (b_dir,) = sorted(set(generation_dirs(url)) - set(a_dirs))
        assert b_dir.startswith("g0.")
        # the newcomer is objected to by the running rank 1 of job-b, and fails
        (dup,) = run_ranks(w_duplicate, 2, url, FAST, ranks=[1], env=job_b,
                           expect_errors=True)
        assert isinstance(dup, RankFailure) and isinstance(dup.error, DuplicateRank), dup
        # job-a's number 1 has another directory, but job-b may still announce a 1:
        # kept; every job announced a 0 with another directory: an orphan
        maybe_b = os.path.join(url, "g1.0123456789abcdef")
        loser = os.path.join(url, "g0.fedcba9876543210")
        os.makedirs(maybe_b)
        os.makedirs(loser)

        report = tool_json(capsys, "inspect", url, "--watch", "10")
        assert report["foreign_objects"] == []  # dup.*, end.* are the rendezvous's
        jobs = {j["job"]: j for j in report["jobs"]}
        assert sorted(jobs) == ["job-a", "job-b"]
        assert jobs["job-a"]["namespace"] == "rdzv.job-a"
        assert jobs["job-a"]["announcements"] == [0, 1] and jobs["job-b"]["announcements"] == [0]
        assert jobs["job-a"]["newest_prefix"] == next(d for d in a_dirs if d.startswith("g1."))
        assert jobs["job-b"]["newest_prefix"] == b_dir
        assert jobs["job-a"]["objections"] == [] and jobs["job-a"]["unconsumed_joins"] == {}
        (objection,) = jobs["job-b"]["objections"]
        assert (objection["rank"], objection["attempt"], objection["by_attempt"]) == (1, 1, 0)
        assert jobs["job-b"]["unconsumed_joins"] == {"1": 1}  # the newcomer's claim
        gens = {g["prefix"]: g for g in report["generations"]}
        assert sorted(gens) == sorted([*a_dirs, b_dir, "g1.0123456789abcdef",
                                       "g0.fedcba9876543210"])
        for d in a_dirs:
            assert (gens[d]["job"], gens[d]["status"]) == ("job-a", "finished"), gens[d]
        assert (gens[b_dir]["job"], gens[b_dir]["status"]) == ("job-b", "live")
        assert gens[b_dir]["newest_of_job"] is True
        assert gens["g1.0123456789abcdef"]["status"] == "creating"
        assert gens["g0.fedcba9876543210"]["status"] == "orphan"
        assert gens["g0.fedcba9876543210"]["job"] is None
        code, text = tool(capsys, "inspect", url, "--watch", "0")
        assert code == 0 and "job job-a (rdzv.job-a/)" in text and "job job-b" in text
        assert "OBJECTION rank 1 claim 1 by claim 0" in text

        records = {f for f in files_under(url) if f.startswith("rdzv")}
        assert {"rdzv.job-b/dup.r1.1", "rdzv.job-b/end.r1.1", "rdzv.job-a/end.r0.1"} <= records
        done = tool_json(capsys, "gc", url, "--watch", WATCH)
        removed = {d["target"]: d for d in done["decisions"] if d["action"] == "remove"}
        assert sorted(removed) == sorted([*a_dirs, "g0.fedcba9876543210"]), done["decisions"]
        assert {removed[d]["namespace"] for d in a_dirs} == {"rdzv.job-a"}
        assert generation_dirs(url) == sorted([b_dir, "g1.0123456789abcdef"])
        assert os.path.exists(os.path.join(url, b_dir, "hb.r0"))
        assert {f for f in files_under(url) if f.startswith("rdzv")} == records
    finally:
        open(stop, "w").close()
        out = collect(procs, q, timeout=60)
    assert all(isinstance(v, int) and v > 0 for v in out.values()), out  # undisturbed


def test_gc_keeps_each_jobs_newest_generation(tmp_path, capsys):
    """A job killed in generation 0 keeps it (it may be restarting), though another
    job on the location has announced higher numbers."""
    url = str(tmp_path / "run")
    procs, q, stop = start_live(tmp_path, url)  # job "tests", generation 0
    for p in procs.values():
        os.kill(p.pid, signal.SIGKILL)
    collect(procs, q, timeout=30)
    (dead_dir,) = generation_dirs(url)
    other = {"FERROSYNC_JOB": "other"}
    for n in range(2):
        assert run_ranks(w_steps, 2, url, FAST, 1, str(tmp_path / f"done{n}"),
                         env=other) == [n, n]
    done = tool_json(capsys, "gc", url, "--watch", WATCH)
    decisions = {d["target"]: d for d in done["decisions"]}
    assert decisions[dead_dir]["action"] == "keep", decisions[dead_dir]
    assert "newest generation of job tests" in decisions[dead_dir]["reason"]
    assert generation_dirs(url) == [dead_dir]  # the other job's two finished ones went
    report = tool_json(capsys, "inspect", url, "--watch", "0")
    jobs = {j["job"]: j for j in report["jobs"]}
    assert jobs["tests"]["open_claims"] == {"0": 0, "1": 0}  # killed: no end markers
    assert jobs["other"]["announced_without_data"] == [0, 1]


@pytest.mark.unit
def test_rendezvous_records_of_every_namespace_are_classified():
    from ferrosync.ops.scan import classify

    kinds = {key: (o.kind, o.namespace, o.rank, o.number) for key in (
        "rdzv/join.r1.2", "rdzv/gen.3", "rdzv.job-a/dup.r1.4", "rdzv.job-a/end.r0.5",
        "rdzv.launch-0123456789abcdef/gen.0", "rdzv.job-a/notes", "rdzv.-bad/gen.0",
        "rdzv.job-a/sub/gen.0") if (o := classify(key, 1))}
    assert kinds == {
        "rdzv/join.r1.2": ("join", "rdzv", 1, 2),
        "rdzv/gen.3": ("announcement", "rdzv", None, 3),
        "rdzv.job-a/dup.r1.4": ("objection", "rdzv.job-a", 1, 4),
        "rdzv.job-a/end.r0.5": ("end", "rdzv.job-a", 0, 5),
        "rdzv.launch-0123456789abcdef/gen.0": (
            "announcement", "rdzv.launch-0123456789abcdef", None, 0),
        "rdzv.job-a/notes": ("foreign", None, None, None),
        "rdzv.-bad/gen.0": ("foreign", None, None, None),  # not a job id
        "rdzv.job-a/sub/gen.0": ("foreign", None, None, None),
    }


def test_inspect_names_the_straggler(tmp_path, capsys):
    url = str(tmp_path / "run")
    holding, release = str(tmp_path / "holding"), str(tmp_path / "release")
    procs, q = start_ranks(w_straggle, 2, url, FAST, holding, release)
    try:
        wait_until(lambda: os.path.exists(holding), "rank 1 holding")
        # rank 0's heartbeat shows it inside collective 4 once it has begun it
        deadline = time.monotonic() + 30
        while True:
            report = tool_json(capsys, "inspect", url, "--watch", "1")
            (gen,) = report["generations"]
            where = {r["rank"]: r.get("collective") for r in gen["ranks"]}
            if where == {0: 4, 1: 3} and gen["progress"]["stalled"]:
                break
            assert time.monotonic() < deadline, gen
        assert gen["status"] == "live"
        assert gen["stragglers"] == [1]
        code, text = tool(capsys, "inspect", url, "--watch", "1")
        assert "stragglers (the others wait for them): ranks [1]" in text
        # since when, by the ranks' own clock (this host's here)
        assert re.search(r"rank 0 entered collective 4 \(barrier\) [0-9.]+ s ago", text), text
        assert all(r["collective_wall_age_s"] >= 0 for r in gen["ranks"]), gen["ranks"]
    finally:
        open(release, "w").close()
        out = collect(procs, q, timeout=60)
    assert out == {0: True, 1: True}


def w_join_only(rank, world, url, options):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=1.0, **options):
        pass


def test_inspect_shows_join_records_no_announcement_consumed(tmp_path, capsys):
    url = str(tmp_path / "run")
    assert run_ranks(w_steps, 2, url, FAST, 1, str(tmp_path / "done")) == [0, 0]
    (gave_up,) = run_ranks(w_join_only, 2, url, FAST, ranks=[1], expect_errors=True)
    assert isinstance(gave_up, RankFailure)  # rank 0 never came: SyncTimeout
    report = tool_json(capsys, "inspect", url, "--watch", "0")
    (job,) = report["jobs"]
    assert job["unconsumed_joins"] == {"1": 1}  # attempt 0 went into gen 0
    assert job["open_claims"] == {}  # every claim ended: closed, or gave up
    assert report["foreign_objects"] == []


def w_secret(rank, world, url, options, done):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=60, secret="s3cret",
                           **options) as sync:
        sync.barrier()
        finish_together(rank, world, done)


def test_records_that_cannot_be_verified_are_never_acted_upon(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("FERROSYNC_SECRET", raising=False)
    url = str(tmp_path / "run")
    run_ranks(w_secret, 2, url, FAST, str(tmp_path / "done-a"))
    run_ranks(w_secret, 2, url, FAST, str(tmp_path / "done-b"))
    report = tool_json(capsys, "inspect", url, "--watch", "0.5")
    assert {g["status"] for g in report["generations"]} == {"unknown"}
    assert {r["state"] for g in report["generations"] for r in g["ranks"]} == {"untrusted"}
    tool_json(capsys, "gc", url, "--watch", "0.5")
    assert len(generation_dirs(url)) == 2  # kept: without the key it proves nothing

    wrong = tool_json(capsys, "gc", url, "--watch", "0.5", "--secret", "wrong")
    assert len(generation_dirs(url)) == 2, wrong
    tool_json(capsys, "gc", url, "--watch", "0.5", "--secret", "s3cret")
    assert generation_dirs(url) == []


@pytest.mark.parametrize("argv", [
    [],
    ["inspect"],
    ["frobnicate", "/tmp/x"],
    ["gc", "/tmp/x", "--keep", "-1"],
    ["inspect", "/tmp/x", "--watch", "soon"],
    ["inspect", "/tmp/x", "--storage-options", "{not json"],
    ["doctor", "/tmp/x", "--samples", "0"],
])
@pytest.mark.unit
def test_bad_usage_exits_2(argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2


@pytest.mark.parametrize("argv", [
    ["inspect", "nosuch://bucket/run"],
    ["gc", "{tmp}", "--storage-options", '{"anon": true}'],  # options for a local path
    ["inspect", "{tmp}/a-file"],
])
@pytest.mark.unit
def test_bad_url_exits_2(tmp_path, capsys, argv):
    (tmp_path / "a-file").write_text("not a directory")
    code = main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert code == 2
    assert "error" in capsys.readouterr().err


def test_python_dash_m_entry_point(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(ferrosync.__file__))}
    ok = subprocess.run([sys.executable, "-m", "ferrosync", "inspect", str(tmp_path / "none"),
                         "--watch", "0"], capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "nothing here yet" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "ferrosync", "gc"], capture_output=True,
                         text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "URL" in bad.stderr


@pytest.mark.unit
def test_doctor_creates_checks_and_cleans_up(tmp_path, capsys):
    url = str(tmp_path / "new" / "location")
    report = tool_json(capsys, "doctor", url, "--size-mib", "2", "--samples", "5")
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["location"]["data"]["created"] is True and os.path.isdir(url)
    for name in ("atomic publish", "exclusive create", "visibility", "permissions",
                 "latency", "throughput"):
        assert name in checks, sorted(checks)
    assert checks["atomic publish"]["status"] == "ok", checks["atomic publish"]
    assert checks["exclusive create"]["status"] == "ok"
    assert report["measured"]["latency"]["put"]["n"] == 5
    rec = report["recommended"]
    assert rec["heartbeat_timeout"] > 2 * rec["heartbeat_interval"]
    assert 0 < rec["poll_initial"] <= rec["poll_max"]
    assert os.listdir(url) == []  # probes removed
    mode = stat.S_IMODE(os.stat(url).st_mode)
    assert not mode & stat.S_IWOTH

    os.chmod(url, 0o777)  # anyone may plant objects here
    report = tool_json(capsys, "doctor", url, "--size-mib", "0", "--samples", "3")
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["permissions"]["status"] == "fail"
    assert "world-writable" in checks["permissions"]["summary"]
    code, text = tool(capsys, "doctor", url, "--size-mib", "0", "--samples", "3", "--strict")
    assert code == 1 and "recommended settings" in text


@pytest.mark.unit
def test_nfs_mount_options_are_judged():
    assert nfs_problems(["rw", "hard", "lookupcache=positive"]) == []
    status = {s for s, _ in nfs_problems(["rw", "nocto", "soft"])}
    assert status == {"fail", "warn"}
    assert any("lookupcache=positive" in text for _, text in nfs_problems(["rw", "hard"]))


def test_s3_smoke_inspect_gc_doctor(s3_transport, capsys, tmp_path):
    url, opts = s3_transport.url, s3_transport.options
    assert run_ranks(w_steps, 2, url, {**FAST, **opts}, 2, str(tmp_path / "done")) == [0, 0]
    so = json.dumps(opts["storage_options"])
    report = tool_json(capsys, "inspect", url, "--storage-options", so, "--watch", "1")
    (gen,) = report["generations"]
    assert gen["status"] == "finished" and gen["bytes"] > 0
    assert [r["state"] for r in gen["ranks"]] == ["closed", "closed"]

    doctor = tool_json(capsys, "doctor", url, "--storage-options", so, "--size-mib", "1",
                       "--samples", "3")
    checks = {c["name"]: c["status"] for c in doctor["checks"]}
    assert checks["atomic publish"] == "ok" and checks["visibility"] == "ok", doctor
    assert "fail" not in checks.values(), doctor

    tool_json(capsys, "gc", url, "--storage-options", so, "--watch", "1")
    after = tool_json(capsys, "inspect", url, "--storage-options", so, "--watch", "0")
    assert after["generations"] == []  # the finished generation is gone ...
    (job,) = after["jobs"]
    assert job["announced_without_data"] == [0]  # ... its announcement stays
    assert job["namespace"] == NS and after["foreign_objects"] == []
    assert not [k for k in after["leftover_probes"]]  # doctor cleaned up after itself

    # beside an elastic job (one member, this process): doctor recommends what elastic
    # members beat at on S3, and gc keeps every byte of it, by name
    with ferrosync.connect(url, elastic=True, timeout=60, **opts) as sync:
        sync.average_(torch.ones(4))
    doctor = tool_json(capsys, "doctor", url, "--storage-options", so, "--size-mib", "0",
                       "--samples", "3", "--mode", "elastic")
    assert doctor["mode"] == "elastic" and doctor["recommended"]["heartbeat_interval"] >= 10
    done = tool_json(capsys, "gc", url, "--storage-options", so, "--watch", "1")
    assert [d["target"] for d in done["decisions"]] == ["el.tests/"], done
    assert done["removed_objects"] == 0


# -- doctor: exclusive create and atomic rename, tried on the location -----------------------

@pytest.mark.unit
def test_doctor_finds_exclusive_create_and_atomic_rename_on_a_directory(tmp_path, capsys):
    url = str(tmp_path / "loc")
    report = tool_json(capsys, "doctor", url, "--size-mib", "0", "--samples", "3")
    checks = {c["name"]: c for c in report["checks"]}
    assert report["capabilities"] == {"exclusive_create": True, "atomic_rename": True}
    assert checks["exclusive create"]["status"] == "ok", checks["exclusive create"]
    assert checks["atomic rename"]["status"] == "ok", checks["atomic rename"]
    assert "same inode" in checks["atomic rename"]["summary"]
    assert "publish safety" not in checks
    assert os.listdir(url) == []  # the rename probes went with the rest
    code, text = tool(capsys, "doctor", url, "--size-mib", "0", "--samples", "3")
    assert "[ok  ] atomic rename" in text and "[ok  ] exclusive create" in text


@pytest.mark.unit
def test_rename_probe_leaves_nothing_behind(tmp_path):
    from ferrosync.ops.doctor import probe_rename

    assert probe_rename(str(tmp_path)) == []
    assert os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError):
        probe_rename(str(tmp_path / "missing"))


@pytest.mark.parametrize("exclusive, rename, warned", [
    (False, False, True), (True, False, False), (False, True, False), (True, True, False)])
@pytest.mark.unit
def test_doctor_warns_only_when_neither_holds(tmp_path, exclusive, rename, warned):
    from ferrosync.ops.doctor import Doctor
    from ferrosync.storage.engines import open_storage

    url = str(tmp_path / "loc")
    doctor = Doctor(open_storage(url), url, None, size_mib=0, samples=3)
    doctor.capabilities.update(exclusive_create=exclusive, atomic_rename=rename)
    doctor.check_safety()
    found = [c for c in doctor.checks if c.name == "publish safety"]
    assert bool(found) == warned
    if warned:
        assert found[0].status == "warn"
        assert "neither exclusive create nor atomic rename" in found[0].summary


def test_doctor_on_both_s3_servers(any_s3_transport, capsys):
    """moto and SeaweedFS both honour If-None-Match: the conditional PUT is enforced."""
    url, opts = any_s3_transport.url, any_s3_transport.options
    so = json.dumps(opts["storage_options"])
    report = tool_json(capsys, "doctor", url, "--storage-options", so, "--size-mib", "1",
                       "--samples", "3")
    checks = {c["name"]: c for c in report["checks"]}
    assert report["capabilities"] == {"exclusive_create": True, "atomic_rename": None}
    assert checks["exclusive create"]["status"] == "ok", checks["exclusive create"]
    assert "If-None-Match" in checks["exclusive create"]["summary"]
    assert checks["atomic rename"]["status"] == "info"
    assert "publish safety" not in checks
    assert not [c for c in report["checks"] if c["status"] == "fail"], report["checks"]
    from ferrosync.storage.engines import open_storage

    assert open_storage(url, opts["storage_options"]).list() == []  # cleaned up


def test_a_launch_is_over_when_its_launcher_has_exited():
    """The launcher's pid and start time, read back on this host: running while it
    runs, exited after (a reused pid has another start time)."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        record = keys.KeyFile("j", "p", None, None, keys.launch_context(child.pid))
        assert record.launcher_state() == (
            True, f"its launcher (pid {child.pid} on {record.launcher['host']}) is running")
        assert record.launcher_gone() is None
    finally:
        child.communicate(b"")
    assert record.launcher_gone() == (f"its launcher (pid {child.pid} on "
                                      f"{record.launcher['host']}) has exited")
    elsewhere = keys.KeyFile("j", "p", None, None, {**record.launcher, "host": "other"})
    assert elsewhere.launcher_state()[0] is None and elsewhere.launcher_gone() is None
    rebooted = keys.KeyFile("j", "p", None, None, {**record.launcher, "boot_id": "old"})
    if record.launcher["boot_id"]:
        assert "has rebooted" in rebooted.launcher_gone()
