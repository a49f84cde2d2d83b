"""``ferrosync doctor``'s recommended settings follow the mode the job runs in, with the
defaults a job of that mode resolves on the store as their floor
(``storage/options.py``'s ``timing``): elastic members on an object store beat every
10 s, fixed-size ranks every 2 s. In-process; no request is made (the measurements are
a fast store's, as doctor would report them)."""

from __future__ import annotations

import pytest

from ferrosync.elastic.options import ElasticOptions
from ferrosync.ops.recommend import recommend, render
from ferrosync.storage.engines import open_storage
from ferrosync.storage.options import StorageOptions

pytestmark = pytest.mark.unit


def _measured(put90_ms=5.0, miss_ms=4.0, visible_ms=8.0) -> dict:
    ms = {"p50_ms": miss_ms, "p90_ms": miss_ms, "max_ms": miss_ms, "n": 3}
    return {"latency": {"put": {**ms, "p90_ms": put90_ms}, "get": ms, "open_miss": ms},
            "visibility": {"new": {**ms, "max_ms": visible_ms},
                           "overwrite": {**ms, "max_ms": visible_ms}}}


@pytest.mark.parametrize("url", ["s3://bucket/exp8", "/mnt/nfs/exp8"])
@pytest.mark.parametrize("mode, options", [("fixed", StorageOptions),
                                           ("elastic", ElasticOptions)])
def test_a_fast_store_gets_the_defaults_of_the_jobs_mode(url, mode, options):
    storage = open_storage(url)
    floor = options.parse({}).timing(storage)
    rec = recommend(storage, _measured(), mode=mode, payload_mib=100, world_size=8,
                    nfs=False)
    assert rec["heartbeat_interval"] == floor.heartbeat_interval
    assert rec["heartbeat_timeout"] == floor.heartbeat_timeout
    assert rec["poll_initial"] >= floor.poll[0] and rec["poll_max"] >= floor.poll[1]
    options.parse({k: rec[k] for k in ("poll_initial", "poll_max", "heartbeat_interval",
                                       "heartbeat_timeout")}).timing(storage)
    call = render(url, rec)[-1]
    assert call.startswith(f"  ferrosync.connect({url!r}" + (", elastic=True" if mode ==
                                                             "elastic" else ""))


def test_elastic_members_on_s3_are_not_told_to_beat_every_2_s():
    storage = open_storage("s3://bucket/exp8")
    elastic = recommend(storage, _measured(), mode="elastic", payload_mib=100,
                        world_size=8, nfs=False)
    fixed = recommend(storage, _measured(), mode="fixed", payload_mib=100, world_size=8,
                      nfs=False)
    assert (elastic["heartbeat_interval"], elastic["heartbeat_timeout"]) == (10, 30)
    assert (fixed["heartbeat_interval"], fixed["heartbeat_timeout"]) == (2, 20)


def test_a_slow_store_raises_the_interval_and_the_timeout_with_it():
    storage = open_storage("s3://bucket/exp8")
    rec = recommend(storage, _measured(put90_ms=900.0, visible_ms=3000.0), mode="elastic",
                    payload_mib=100, world_size=8, nfs=False)
    assert rec["heartbeat_interval"] == 18  # 20 puts of 0.9 s
    assert rec["heartbeat_timeout"] == 3 * 18 + 6  # three beats and twice the delay


def test_doctor_recommends_for_the_elastic_job_it_finds(capsys):
    """Without --mode, a location holding an elastic job (and no fixed-size one) gets
    the elastic members' settings; memory:// is an object store in this process."""
    import json
    import uuid

    import torch

    import ferrosync
    from ferrosync.__main__ import main

    url = f"memory://doctor-{uuid.uuid4().hex[:8]}/exp8"
    with ferrosync.connect(url, elastic=True, job="exp8", timeout=60) as sync:
        sync.average_(torch.ones(4))
    assert main(["doctor", url, "--size-mib", "0", "--samples", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "elastic" and report["recommended"]["mode"] == "elastic"
    (existing,) = [c for c in report["checks"] if c["name"] == "existing jobs"]
    assert existing["data"]["elastic"] == ["el.exp8"], existing


@pytest.mark.parametrize("write_mbps, wire", [(1000.0, None), (100.0, "int8"),
                                              (10.0, "topk")])
def test_a_slow_link_gets_a_compressed_wire(write_mbps, wire):
    """100 MiB over 2 ranks, 0.21 GB a collective: 0.21 s at 1 GB/s (no compression),
    2.1 s at 100 MB/s (int8), 21 s at 10 MB/s (topk)."""
    storage = open_storage("s3://bucket/exp8")
    measured = {**_measured(), "throughput": {"write_Bps": write_mbps * 1e6,
                                              "read_Bps": 2 * write_mbps * 1e6}}
    rec = recommend(storage, measured, mode="fixed", payload_mib=100, world_size=2,
                    nfs=False)
    assert rec.get("wire_dtype") == wire
    call = render("s3://bucket/exp8", rec)[-1]
    if wire is None:
        assert "wire_dtype" not in call
    else:
        assert f"wire_dtype={wire!r}" in call
        # what the doctor prints, connect takes
        StorageOptions.parse({"wire_dtype": rec["wire_dtype"]})
