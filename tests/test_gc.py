"""``ferrosync gc`` is conservative: what it cannot read, parse or verify protects.

A generation goes only when gc can prove it is not its job's newest announced one and
not live. Junk at a rendezvous record or an abort marker (garbage, a deeply nested
record, a sparse file larger than any record) proves nothing, so it never unprotects a
generation: a job the scheduler suspended (SIGSTOP: no heartbeat moves) survives gc and
finishes correctly once resumed. Real rank processes and the real CLI throughout.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import uuid

import pytest
import torch
from test_ops import (
    DEAD_PID,
    FAST,
    NS,
    WATCH,
    generation_dirs,
    start_live,
    tool,
    tool_json,
    w_steps,
)
from train_cli import cli_env, command, run_forked

import ferrosync
from ferrosync.__main__ import main
from ferrosync.storage import names
from ferrosync.storage.engines import open_storage
from ferrosync.storage.wire import encode_record
from ranks import collect, run_ranks

JUNK = ["garbage", "nested", "sparse"]


def plant_junk(path: str, what: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        if what == "garbage":
            f.write(b"\x00not a record\xff")
        elif what == "nested":
            f.write(b"[" * 500_000)
        else:
            f.truncate(1 << 40)  # sparse: larger than any record, costs no disk


@pytest.mark.parametrize("what", JUNK)
def test_gc_never_removes_a_suspended_job_after_a_junk_announcement(tmp_path, capsys, what):
    url = str(tmp_path / "run")
    procs, q, stop = start_live(tmp_path, url)
    (live_dir,) = generation_dirs(url)
    for p in procs.values():
        os.kill(p.pid, signal.SIGSTOP)  # the scheduler suspends the job
    try:
        plant_junk(os.path.join(url, NS, "gen.99"), what)
        done = tool_json(capsys, "gc", url, "--watch", WATCH)
        decision = {d["target"]: d for d in done["decisions"]}[live_dir]
        assert decision["action"] == "keep", decision
        assert "newest generation of job tests" in decision["reason"], decision
        assert live_dir in generation_dirs(url)
    finally:
        for p in procs.values():
            os.kill(p.pid, signal.SIGCONT)
    open(stop, "w").close()
    out = collect(procs, q, timeout=60)
    assert all(isinstance(v, int) and v > 0 for v in out.values()), out  # resumed, finished


@pytest.mark.parametrize("what", JUNK)
def test_gc_keeps_a_dead_generation_whose_abort_marker_is_junk(tmp_path, capsys, what):
    """An older dead generation would go, but an abort marker gc cannot read says
    nothing about whether it finished: it stays (and says why)."""
    url = str(tmp_path / "run")
    procs, q, _stop = start_live(tmp_path, url)
    for p in procs.values():
        os.kill(p.pid, signal.SIGKILL)
    collect(procs, q, timeout=30)
    (dead_dir,) = generation_dirs(url)
    assert run_ranks(w_steps, 2, url, FAST, 1, str(tmp_path / "done")) == [1, 1]
    plant_junk(os.path.join(url, dead_dir, "abort.r1"), what)
    done = tool_json(capsys, "gc", url, "--watch", WATCH)
    decisions = {d["target"]: d for d in done["decisions"]}
    assert decisions[dead_dir]["action"] == "keep", decisions[dead_dir]
    assert "cannot prove" in decisions[dead_dir]["reason"]
    assert dead_dir in generation_dirs(url)
    # without the junk the same generation is provably dead and goes
    os.unlink(os.path.join(url, dead_dir, "abort.r1"))
    done = tool_json(capsys, "gc", url, "--watch", WATCH)
    assert {d["target"]: d["action"] for d in done["decisions"]}[dead_dir] == "remove"
    assert dead_dir not in generation_dirs(url)


# -- elastic namespaces ----------------------------------------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize("where", ["directory", "memory"])
def test_gc_never_touches_an_elastic_namespace_and_names_it(tmp_path, capsys, where):
    """A real elastic job (one member, in this process) on a directory and on an object
    store (memory://), plus a member's temp file whose pid is alive on no host here:
    what a member writing from another NFS client looks like. gc keeps every byte
    under ``el.<job>/`` and says so; "nothing here" would hide the job."""
    url = str(tmp_path / "run") if where == "directory" else \
        f"memory://gc-{uuid.uuid4().hex[:8]}/run"
    with ferrosync.connect(url, elastic=True, job="exp8", timeout=60) as sync:
        sync.average_(torch.ones(4))
    storage = open_storage(url)
    namespace = names.elastic_namespace("exp8")
    shard, _, roster = names.elastic_roster(9).rpartition("/")  # in its shard directory
    storage.makedirs(names.within(namespace, shard))
    in_flight = names.within(names.within(namespace, shard), names.temp(roster, pid=DEAD_PID))
    storage.put(in_flight, [b"a member's write in progress"])
    def listed():  # everything but gc's own lock file (directories)
        return sorted((k, n) for k, n in storage.list("") if k != names.GC_LOCK)

    before = listed()
    assert any(k == in_flight for k, _ in before)

    done = tool_json(capsys, "gc", url, "--watch", "0.2")
    (kept,) = [d for d in done["decisions"] if d["target"] == f"{namespace}/"]
    assert kept["action"] == "keep" and "an elastic job" in kept["reason"], kept
    assert "1 temp files" in kept["reason"] and "gc never removes anything there" in \
        kept["reason"]
    assert done["removed_objects"] == 0 and listed() == before
    code, text = tool(capsys, "gc", url, "--watch", "0.2")
    assert code == 0 and "nothing here" not in text, text
    assert f"keep         {namespace}/: an elastic job" in text, text
    assert text.rstrip().endswith("rdzv*/ records and elastic namespaces kept"), text
    report = tool_json(capsys, "inspect", url, "--watch", "0")
    assert report["orphan_temp_files"] == [] and report["foreign_objects"] == []
    assert [j["namespace"] for j in report["elastic_jobs"]] == [namespace]


# -- a full filesystem -----------------------------------------------------------------------

@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs of 64 inodes (root only): a filesystem that really fills up."""
    where = tmp_path / "full"
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=64", "tmpfs",
                           str(where)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def _fill(where, leave: int) -> None:
    free = os.statvfs(where).f_bavail * os.statvfs(where).f_frsize
    with open(where / "filler", "wb") as f:  # someone else's data
        f.write(b"x" * max(0, free - leave))


def test_gc_frees_a_full_filesystem_a_job_died_on(tmp_path, capsys, small_tmpfs):
    """A launched job runs out of space: its ranks cannot write their last heartbeat or
    an abort marker, so its only generation is dead and its job's newest (kept for a
    suspended job's sake). The key file proves the launch over (its launcher exited),
    so gc, without a secret and on a filesystem without room for its own lock file,
    removes it and gives the space back."""
    _fill(small_tmpfs, leave=40 * 1024)
    sync = small_tmpfs / "run"
    launch = run_forked(command("--nproc", 2, "--steps", 20, "--sync", sync, "--no-progress"),
                        cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                        timeout=180)
    assert launch.returncode == 1 and "No space left on device" in launch.stderr, \
        launch.stderr
    inodes = 0
    try:  # not even an empty file fits now
        while True:
            (small_tmpfs / f"inode.{inodes}").touch()
            inodes += 1
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    (prefix,) = [p.name for p in sync.iterdir() if p.name.startswith("g")]
    (namespace,) = [p.name for p in sync.iterdir() if p.name.startswith("rdzv.launch-")]
    blocks = os.statvfs(small_tmpfs).f_bfree

    code = main(["gc", str(sync), "--watch", WATCH])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "the filesystem is full" in err and "going on without the lock" in err
    # dead (its ranks' heartbeats stopped without a final state) and its job's newest,
    # so only the launcher's exit frees it
    assert re.search(rf"removed +{prefix} \(\d+ objects, .*\): dead, and its job is "
                     r"over: its launcher \(pid \d+ on .*\) has exited", out), out
    assert [p.name for p in sync.iterdir()] == [namespace]
    assert os.statvfs(small_tmpfs).f_bfree > blocks


# -- doctor directories: only what doctor provably wrote goes ------------------------------

USER_FILES = {"1": b"one", "2024.csv": b"a,b\n", "7.txt": b"seven", "31337.key": b"k" * 32,
              ".notes.4242.0123abcd.tmp": b"temp-like", "sub/9": b"nine"}


def _plant_doctor_dir(storage, marked: str | None) -> tuple[str, list[str], list[str]]:
    """A doctor-like directory of a dead pid holding a user's files, and (``marked``:
    the directory its mark names) what a doctor killed mid-run leaves there. Returns
    (directory, doctor's keys, the user's keys)."""
    from ferrosync.ops.doctor import mark

    directory = names.doctor_dir(pid=DEAD_PID, token="0badcafe")
    storage.makedirs(directory)
    users = []
    for name, data in USER_FILES.items():
        users.append(names.within(directory, name))
        storage.makedirs(users[-1].rpartition("/")[0])
        storage.put(users[-1], [data])
    doctors = []
    if marked is not None:
        doctors = [names.within(directory, n) for n in
                   (names.DOCTOR_MARK, "atomic", "lat.0", names.temp("visible.1",
                                                                     pid=DEAD_PID))]
        storage.put(doctors[0], [encode_record(mark(marked), None)])
        for key in doctors[1:]:
            storage.put(key, [b"probe bytes"])
    return directory, doctors, users


def _gc_keeps_users_files(capsys, url, options, storage, marked):
    directory, doctors, users = _plant_doctor_dir(storage, marked)
    so = ["--storage-options", json.dumps(options["storage_options"])] if options else []
    everything = {k for k, _ in storage.list("")}
    plan = tool_json(capsys, "gc", url, *so, "--watch", "0.2", "--dry-run")
    assert {k for k, _ in storage.list("")} == everything  # a dry run removes nothing
    done = tool_json(capsys, "gc", url, *so, "--watch", "0.2")
    left = {k for k, _ in storage.list("")}
    for key in users:
        assert key in left, (key, done["decisions"])
        assert storage.read(key) == USER_FILES[key.split("/", 1)[1]]
    removed = [k for d in done["decisions"] if d["action"] == "remove" for k in d["keys"]]
    (kept,) = [d for d in plan["decisions"] if d["target"] == directory]
    mine = users if marked == directory else users + doctors
    assert kept["action"] == "keep" and sorted(kept["keys"]) == sorted(mine), kept
    if marked == directory:  # a doctor killed mid-run: its own probes go, nothing else
        assert sorted(removed) == sorted(doctors) and not left & set(doctors), done
        assert "objects ferrosync doctor never writes" in kept["reason"], kept
    else:  # no mark, or another directory's: nothing here is provably doctor's
        assert removed == [] and set(doctors) <= left, done
        assert "no doctor mark" in kept["reason"], kept


@pytest.mark.unit
@pytest.mark.parametrize("where", ["directory", "memory"])
@pytest.mark.parametrize("marked", ["none", "copied", "doctor's"])
def test_gc_never_removes_a_users_files_under_a_doctor_name(tmp_path, capsys, where, marked):
    url = str(tmp_path / "run") if where == "directory" else \
        f"memory://gc-{uuid.uuid4().hex[:8]}/run"
    storage = open_storage(url)
    storage.makedirs("")
    directory = names.doctor_dir(pid=DEAD_PID, token="0badcafe")
    marked = {"none": None, "copied": names.doctor_dir(pid=7, token="12345678"),
              "doctor's": directory}[marked]
    _gc_keeps_users_files(capsys, url, None, storage, marked)


def test_gc_never_removes_a_users_files_under_a_doctor_name_on_s3(s3_transport, capsys):
    url, options = s3_transport.url, s3_transport.options
    storage = open_storage(url, options["storage_options"])
    _gc_keeps_users_files(capsys, url, options, storage,
                          names.doctor_dir(pid=DEAD_PID, token="0badcafe"))


def test_doctor_leaves_nothing_and_gc_needs_its_mark(tmp_path, capsys):
    """A real doctor run writes its mark first and removes it with its probes."""
    url = str(tmp_path / "run")
    report = tool_json(capsys, "doctor", url, "--size-mib", "0", "--samples", "2")
    assert all(c["status"] != "fail" for c in report["checks"]), report
    assert os.listdir(url) == []
