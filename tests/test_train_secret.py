"""``python -m ferrosync.train`` gives the ranks of a fixed-size launch a fresh secret.

Without a secret anyone who can write to the sync location can forge what the ranks
read, and object collectives unpickle it. The launcher starts every rank itself, so
it sets ``FERROSYNC_SECRET`` in their environments only, fresh per launch, unless the
user set one (kept) or named the job (a restart must read earlier launches' records:
then, as for ``--elastic`` members, it warns instead). Real launcher, real ranks.
"""

from __future__ import annotations

import hashlib
import json
import textwrap

from train_cli import run_cli

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


def test_each_launch_gives_its_ranks_a_fresh_secret(tmp_path):
    first, err = launch(tmp_path)
    second, _ = launch(tmp_path)
    for records in (first, second):
        assert all(r["authenticated"] for r in records.values())
        assert records[0]["secret"] == records[1]["secret"] is not None
    assert first[0]["secret"] != second[0]["secret"]
    assert "without a secret" not in err


def test_a_secret_the_user_set_is_kept(tmp_path):
    records, _ = launch(tmp_path, FERROSYNC_SECRET="users-own-secret")
    want = hashlib.sha256(b"users-own-secret").hexdigest()
    assert [r["secret"] for r in records.values()] == [want, want]


def test_a_job_the_user_named_gets_a_warning_instead(tmp_path):
    records, err = launch(tmp_path, FERROSYNC_JOB="my-job")
    assert not any(r["authenticated"] for r in records.values())
    assert ("ferrosync.train: warning: a job named by $FERROSYNC_JOB run without a secret"
            in err)
    assert "FERROSYNC_SECRET" in err
