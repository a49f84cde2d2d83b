"""Elastic jobs against a hostile or careless writer (docs/elastic.md#trust): objects
copied between jobs that share a secret, objects planted under a member's name, and
forged records. Members are real processes; the planting is done by this process,
between the members' rounds, through the store as any writer would.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import ferrosync
from ferrosync.errors import FerrosyncError, ShardCorrupt
from ferrosync.storage import names
from ranks import collect, run_ranks, start_ranks, wait_until

FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.5}
TIMEOUT = 30.0


def w_source(_index, _world, url, secret):
    """Job A: one member averages twice; its contributions stay on storage (a member
    deletes its own only two rounds later)."""
    with ferrosync.connect(url, elastic=True, job="A", secret=secret, timeout=TIMEOUT,
                           **FAST) as sync:
        for _ in range(2):
            sync.average_([torch.full((4,), 100.0)])
        return sync.member_id, sync.round


def w_target(index, _world, url, secret, gate):
    """Job B: two members; rank 1 says where its next contribution goes, and both wait
    until something was planted there before they average."""
    with ferrosync.connect(url, elastic=True, job="B", min_ranks=2, secret=secret,
                           timeout=TIMEOUT, **FAST) as sync:
        if sync.rank == 1:
            with open(os.path.join(gate, "target.tmp"), "w") as f:
                f.write(f"{sync.member_id} {sync.round + 1}")
            os.rename(os.path.join(gate, "target.tmp"), os.path.join(gate, "target"))
        wait_until(lambda: os.path.exists(os.path.join(gate, "planted")), "the plant")
        t = torch.full((4,), float(index))
        try:
            sync.average_([t])
        except FerrosyncError as exc:
            return ("error", type(exc).__name__, str(exc), t.tolist())
        return ("averaged", t.tolist())


@pytest.mark.parametrize("source_secret", ["team", None],
                         ids=["same-secret-other-job", "no-secret"])
def test_an_object_planted_under_a_members_name_never_enters_an_average(tmp_path,
                                                                         source_secret):
    """Job A's contribution copied under a member of job B (same URL, and with a
    ``source_secret`` of "team" the same secret): every member of B fails with a
    ferrosync error (the owner's own write finds the name taken, the others refuse the
    object's MAC), and no member's tensor changes."""
    url = str(tmp_path / "store")
    ((a_id, a_round),) = run_ranks(w_source, 1, url, source_secret, timeout=60)
    source = os.path.join(url, "el.A", names.elastic_contribution(a_round, a_id))
    assert os.path.exists(source)
    gate = tmp_path / "gate"
    gate.mkdir()
    procs, results = start_ranks(w_target, 2, url, "team", str(gate))
    wait_until(lambda: (gate / "target").exists(), "job B's member 1 ready", timeout=60)
    member, round_ = (gate / "target").read_text().split()
    planted = os.path.join(url, "el.B", names.elastic_contribution(int(round_), member))
    os.makedirs(os.path.dirname(planted), exist_ok=True)  # its shard, if nobody made it yet
    shutil.copyfile(source, planted)
    (gate / "planted").touch()
    got = collect(procs, results, timeout=90)
    outcomes = [got[i] for i in sorted(got)]
    assert all(o[0] == "error" for o in outcomes), outcomes
    assert all(o[1] == "ShardCorrupt" for o in outcomes), outcomes
    for index, o in enumerate(outcomes):
        assert o[3] == [float(index)] * 4, o  # untouched: nothing was averaged
    texts = " | ".join(o[2] for o in outcomes)
    assert "already lies under this member's contribution" in texts, texts
    assert "MAC" in texts, texts


@pytest.mark.unit
def test_jobs_sharing_a_secret_seal_with_different_keys():
    from ferrosync.storage.wire import job_key

    a, b = job_key(b"team", "el.A"), job_key(b"team", "el.B")
    assert a != b and len(a) == 32 and job_key(None, "el.A") is None
    assert job_key(b"team", "el.A") == a and job_key(b"other", "el.A") != a
    with pytest.raises(ShardCorrupt):
        from ferrosync.storage.wire import decode_record, encode_record
        decode_record(encode_record({"x": 1}, a), b, path="el.B/x")


def _one_member(url, job):
    return ferrosync.connect(url, elastic=True, job=job, timeout=TIMEOUT, **FAST)


@pytest.mark.unit
def test_a_manifest_declaring_a_huge_state_is_refused_before_allocating(tmp_path):
    """A state pointer whose manifest declares 2**39 float32 elements (2 TiB) is
    ``ShardCorrupt`` before anything is read or allocated by it."""
    from ferrosync.storage.wire import encode_record

    url = str(tmp_path)
    with _one_member(url, "huge") as sync:
        sync.barrier()
        sync.publish_state([torch.ones(3)])
        assert sync.read_state().tensors["0"].tolist() == [1.0] * 3
        forged = {"round": sync.round, "meta": {},
                  "manifest": {"names": ["0"], "dtypes": ["float32"], "shapes": [[2**39]]}}
        (tmp_path / "el.huge" / "state").write_bytes(encode_record(forged, None))
        with pytest.raises(ShardCorrupt, match="more than"):
            sync.read_state()
        with pytest.raises(ShardCorrupt, match="more than"):
            sync.read_state(max_bytes=1 << 20)


# The two below need the bounded reads (Storage.read refuses objects over the
# record limit; wire's record decoding is depth-bounded): elastic routes every record
# through them and has no size or JSON checks of its own.


@pytest.mark.unit
def test_a_sparse_huge_join_entry_is_a_ferrosync_error(tmp_path):
    url = str(tmp_path)
    with _one_member(url, "sparse") as sync:
        sync.barrier()
        entry = tmp_path / "el.sparse" / names.elastic_join(sync._roster.join_next)
        entry.parent.mkdir(exist_ok=True)
        with open(entry, "wb") as f:
            f.truncate(2**40)  # sparse: costs no disk
        with pytest.raises(FerrosyncError):
            sync.barrier()


@pytest.mark.unit
def test_a_deeply_nested_join_entry_is_a_ferrosync_error(tmp_path):
    import json

    from ferrosync.storage.wire import VERSION

    url = str(tmp_path)
    with _one_member(url, "nested") as sync:
        sync.barrier()
        body = "[" * 100000 + "]" * 100000
        entry = tmp_path / "el.nested" / names.elastic_join(sync._roster.join_next)
        entry.parent.mkdir(exist_ok=True)
        entry.write_bytes(json.dumps({"v": VERSION, "body": body}).encode())
        with pytest.raises(FerrosyncError):
            sync.barrier()
