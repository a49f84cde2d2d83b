"""Members of an elastic trainer job (``python -m ferrosync.train --elastic``) as
separate processes, for tests/test_elastic_train.py and tests/test_elastic_publish.py.

Every member writes its own metrics file (one line per global step with the member
count), which is how the tests watch the job's progress: no sleeps stand in for it.
"""

from __future__ import annotations

import subprocess

from train_cli import final_of, read_metrics_so_far, start_cli
from train_models import HOLD, HOLD_AT

from ferrosync.storage import names
from ferrosync.storage.engines import open_storage
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
                   if names.parse_elastic(key.partition("/")[2]).kind == "elastic_join")
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
