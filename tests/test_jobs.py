"""Job identity: two jobs on one URL never exchange data; ranks that disagree fail fast.

Each job's processes are real processes started in a chosen order with gaps, as a
re-run command or a second user would start them. Every rank must end with its own
job's exact average, or with a typed ferrosync error: never a mixed average.
"""

from __future__ import annotations

import time

import pytest
import torch

import ferrosync
from ferrosync.core.env import discover_job
from ferrosync.errors import ConfigError, DuplicateRank, FerrosyncError
from ranks import RankFailure, collect, run_ranks, start_ranks

FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 3.0}
ANONYMOUS = {"FERROSYNC_JOB": ""}  # clears the suite's job id: a job without an id
# each job's two values and their exact average
VALUES = {"A": (0.0, 1.0), "B": (100.0, 101.0)}
EXPECTED = {"A": 0.5, "B": 100.5}


def w_one_average(rank, world, url, value, options):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=30, **FAST,
                           **options) as sync:
        x = torch.full((1000,), value)
        sync.average_(x)
        return x


def _start_in_order(url, order, gap, job_ids):
    """Start each (job, rank) of ``order`` as its own process, ``gap`` s apart."""
    started = {}
    for i, (job, rank) in enumerate(order):
        if i:
            time.sleep(gap)  # the scenario: processes started this far apart
        env = {"FERROSYNC_JOB": job_ids[job]}
        started[(job, rank)] = start_ranks(w_one_average, 2, url, VALUES[job][rank], {},
                                           ranks=[rank], env=env)
    return {key: collect(procs, q, timeout=90)[key[1]]
            for key, (procs, q) in started.items()}


ORDERS = [
    [("B", 0), ("A", 1), ("A", 0), ("B", 1)],
    [("A", 1), ("B", 1), ("A", 0), ("B", 0)],
    [("A", 0), ("B", 0), ("B", 1), ("A", 1)],
]


@pytest.mark.parametrize("order", ORDERS, ids=["B0A1A0B1", "A1B1A0B0", "A0B0B1A1"])
def test_anonymous_jobs_started_together_never_mix(tmp_path, order):
    out = _start_in_order(str(tmp_path / "run"), order, 0.3, {"A": "", "B": ""})
    for (job, rank), res in out.items():
        if isinstance(res, RankFailure):
            assert isinstance(res.error, FerrosyncError), (job, rank, res)
        else:
            assert torch.equal(res, torch.full((1000,), EXPECTED[job])), (job, rank, res[0])
    # both jobs claimed both ranks within the claim window: the collision was seen
    duplicates = [r for r in out.values()
                  if isinstance(r, RankFailure) and isinstance(r.error, DuplicateRank)]
    assert duplicates, out


@pytest.mark.parametrize("order", ORDERS[:2], ids=["B0A1A0B1", "A1B1A0B0"])
def test_jobs_with_ids_share_a_url_and_both_finish(tmp_path, order):
    out = _start_in_order(str(tmp_path / "run"), order, 0.3, {"A": "job-a", "B": "job-b"})
    for (job, rank), res in out.items():
        assert not isinstance(res, RankFailure), (job, rank, res)
        assert torch.equal(res, torch.full((1000,), EXPECTED[job])), (job, rank, res[0])
    assert sorted(p.name for p in (tmp_path / "run").iterdir()
                  if p.name.startswith("rdzv")) == ["rdzv.job-a", "rdzv.job-b"]


def test_anonymous_job_alone_finishes_after_its_claim_window(tmp_path):
    results = run_ranks(w_one_average, 2, str(tmp_path / "run"), 3.0, {}, env=ANONYMOUS)
    assert all(torch.equal(r, torch.full((1000,), 3.0)) for r in results)


def w_connect_world(rank, world, url, claimed_world, options):
    began = time.monotonic()
    try:
        with ferrosync.connect(url, rank=rank, world_size=claimed_world, timeout=120, **FAST,
                               **options):
            return "connected"
    except FerrosyncError as exc:
        return type(exc).__name__, time.monotonic() - began, str(exc)


@pytest.mark.timing
@pytest.mark.parametrize("worlds", [(3, 2), (2, 3)], ids=["rank0-says-3", "rank0-says-2"])
def test_world_sizes_that_disagree_fail_every_rank_at_connect(tmp_path, worlds):
    url = str(tmp_path / "run")
    p0, q0 = start_ranks(w_connect_world, 2, url, worlds[0], {}, ranks=[0])
    p1, q1 = start_ranks(w_connect_world, 2, url, worlds[1], {}, ranks=[1])
    out = {**collect(p0, q0, timeout=90), **collect(p1, q1, timeout=90)}
    for rank, res in out.items():
        name, seconds, text = res
        assert name == "ConfigError", (rank, res)
        assert seconds < 60, (rank, res)  # far inside the 120 s timeout: not a timeout
        assert "world" in text, text


@pytest.mark.timing
@pytest.mark.parametrize("secrets", [("s3cret", "other"), ("s3cret", None), (None, "s3cret")])
def test_secrets_that_disagree_fail_every_rank_at_connect(tmp_path, secrets):
    url = str(tmp_path / "run")
    started = [start_ranks(w_connect_world, 2, url, 2,
                           {"secret": secrets[r]} if secrets[r] else {}, ranks=[r])
               for r in (0, 1)]
    out = {}
    for procs, q in started:
        out.update(collect(procs, q, timeout=90))
    for rank, res in out.items():
        name, seconds, text = res
        assert name == "ConfigError", (rank, res)
        assert seconds < 60, (rank, res)
        assert "secret" in text, text


def test_wire_settings_that_disagree_fail_every_rank(tmp_path):
    url = str(tmp_path / "run")
    started = [start_ranks(w_connect_world, 2, url, 2, {"wire_dtype": dtype}, ranks=[r])
               for r, dtype in ((0, "bfloat16"), (1, "float16"))]
    out = {}
    for procs, q in started:
        out.update(collect(procs, q, timeout=90))
    for rank, res in out.items():
        assert res[0] == "ConfigError" and "wire_dtype" in res[2], (rank, res)


@pytest.mark.unit
def test_job_id_is_checked_before_any_io(tmp_path):
    url = tmp_path / "never-created"
    for bad in ("../up", "", "a/b", "x" * 65, 7):
        with pytest.raises(ConfigError, match="job"):
            ferrosync.connect(str(url), job=bad)
    with pytest.raises(ConfigError, match="claim_window"):
        ferrosync.connect(str(url), claim_window=-1)
    assert not url.exists()


@pytest.mark.unit
def test_job_id_precedence():
    assert discover_job("mine", env={"FERROSYNC_JOB": "env"}) == "mine"
    assert discover_job(env={"FERROSYNC_JOB": "env", "SLURM_JOB_ID": "77"}) == "env"
    assert discover_job(env={"SLURM_JOB_ID": "77", "TORCHELASTIC_RUN_ID": "t"}) == "77"
    assert discover_job(env={"TORCHELASTIC_RUN_ID": "none"}) is None
    hashed = discover_job(env={"TORCHELASTIC_RUN_ID": "my run/1"})
    assert hashed.startswith("h") and "/" not in hashed
    assert discover_job(env={}) is None
    with pytest.raises(ConfigError, match="FERROSYNC_JOB"):
        discover_job(env={"FERROSYNC_JOB": "a b"})


@pytest.mark.unit
def test_launcher_gives_every_rank_one_new_job_id(monkeypatch):
    from ferrosync.train.launcher import _rank_env, launch_job_id

    monkeypatch.delenv("FERROSYNC_JOB", raising=False)
    first, second = launch_job_id(), launch_job_id()
    assert first != second and discover_job(first) == first
    envs = [_rank_env(r, 2, "/x", None, first) for r in range(2)]
    assert {e["FERROSYNC_JOB"] for e in envs} == {first}
    monkeypatch.setenv("FERROSYNC_JOB", "kept")
    assert launch_job_id() == "kept"
