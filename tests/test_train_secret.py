"""``python -m ferrosync.train`` gives the ranks of a fixed-size launch a fresh secret.

Without a secret anyone who can write to the sync location can forge what the ranks
read, and object collectives unpickle it. The launcher starts every rank itself, so
it sets ``FERROSYNC_SECRET`` in their environments only, fresh per launch, unless the
user set one (kept) or named the job (a restart must read earlier launches' records:
then, as for ``--elastic`` members, it warns instead). It keeps the key in its user's
key file (``ferrosync/ops/keys.py``), so that the same user's ``inspect`` and ``gc``
verify the job without it. Real launcher, real ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import textwrap

from train_cli import run_cli, run_main

from ferrosync.__main__ import main
from ferrosync.ops import keys

SCRIPT = textwrap.dedent("""
    import hashlib, json, os
    import torch
    import ferrosync

    with ferrosync.connect() as sync:          # everything from the environment
        x = torch.ones(2)
        sync.average_(x)                       # fails if the ranks' secrets differ
        secret = os.environ.get("FERROSYNC_SECRET")
        print(json.dumps({"rank": sync.rank, "authenticated": sync._key is not None,
                          "secret": secret and hashlib.sha256(secret.encode()).hexdigest()}))
        sync.barrier()
""")


def launch(tmp_path, **env) -> tuple[dict, str]:
    script = tmp_path / "secret_script.py"
    script.write_text(SCRIPT)
    proc = run_cli("--nproc", 2, script, cwd=tmp_path, **env)
    assert proc.returncode == 0, proc.stderr
    records = {}
    for line in proc.stdout.splitlines():
        record = json.loads(line.partition("] ")[2])
        records[record["rank"]] = record
    assert sorted(records) == [0, 1]
    return records, proc.stderr


def job_of(stderr: str) -> str:
    return re.search(r"started 2 ranks \(.*\) of job (\S+);", stderr).group(1)


def test_each_launch_gives_its_ranks_a_fresh_secret(tmp_path):
    first, err = launch(tmp_path)
    second, _ = launch(tmp_path)
    for records in (first, second):
        assert all(r["authenticated"] for r in records.values())
        assert records[0]["secret"] == records[1]["secret"] is not None
    assert first[0]["secret"] != second[0]["secret"]
    assert "without a secret" not in err
    # the temporary sync directory is gone, and its key file with it
    assert not os.path.exists(keys.path_of(job_of(err)))


def test_a_secret_the_user_set_is_kept(tmp_path):
    records, err = launch(tmp_path, FERROSYNC_SECRET="users-own-secret")
    want = hashlib.sha256(b"users-own-secret").hexdigest()
    assert [r["secret"] for r in records.values()] == [want, want]


def test_a_job_the_user_named_gets_a_warning_instead(tmp_path):
    records, err = launch(tmp_path, FERROSYNC_JOB="my-job")
    assert not any(r["authenticated"] for r in records.values())
    assert ("ferrosync.train: warning: a job named by $FERROSYNC_JOB run without a secret"
            in err)
    assert "FERROSYNC_SECRET" in err
    assert not os.path.exists(keys.path_of("my-job"))  # a restart may run anywhere


def test_a_launched_job_is_inspected_and_collected_without_its_secret(tmp_path, capsys,
                                                                      monkeypatch):
    """The same user, no secret at hand: the tools find the job's key file by the job
    id on the store, verify its records (the ranks closed: finished) and remove it."""
    monkeypatch.delenv("FERROSYNC_SECRET", raising=False)
    sync = tmp_path / "sync"
    proc = run_cli("--nproc", 2, "--steps", 3, "--sync", sync, "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    job = job_of(proc.stderr)
    path = keys.path_of(job)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
    assert keys.load(job).url == str(sync)
    assert main(["inspect", str(sync), "--watch", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (gen,) = report["generations"]
    assert gen["status"] == "finished" and gen["job"] == job, gen
    assert [(r["state"], r["trust"]) for r in gen["ranks"]] == [("closed", "verified")] * 2
    (listed,) = report["jobs"]
    assert listed["key_file"] == path and listed["untrusted_announcements"] == []
    assert main(["gc", str(sync), "--watch", "0"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"removed +{gen['prefix']} .*: finished", out), out
    assert {p.name for p in sync.iterdir()} == {f"rdzv.{job}", ".ferrosync-gc.lock"}


def test_a_key_directory_others_can_enter_stops_the_launch(tmp_path, monkeypatch, capsys):
    shared = tmp_path / "keys"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    monkeypatch.setenv("FERROSYNC_KEYS", str(shared))
    code, out, err = run_main(["--nproc", 2, "--steps", 3, "--sync", tmp_path / "sync"],
                              tmp_path, monkeypatch, capsys)
    assert code == 2 and out == "", err
    (line,) = err.splitlines()
    assert line.startswith("ferrosync.train: error: the key directory ") and \
        f"chmod 700 {shared}" in line, line
    assert list(shared.iterdir()) == []
