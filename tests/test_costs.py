"""What storage requests cost: counting by kind, pricing, and what runs report.

A real two-rank training run over an S3 server on loopback (moto) reports its requests
per hour and their price in ``FINAL``; ``ferrosync inspect`` reports the same rates
from the ranks' heartbeats.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
from train_cli import ROOT, cli_env, final_of, run_cli, run_forked

from ferrosync.errors import ConfigError
from ferrosync.storage.costs import DEFAULT_PRICES, hourly, is_billed, parse_prices, request_cost
from ferrosync.storage.engines import open_storage


@pytest.mark.unit
def test_prices_parse_over_the_defaults():
    assert parse_prices(None) == DEFAULT_PRICES
    got = parse_prices("put=0.0065, get=0.00052")
    assert got["put"] == 0.0065 and got["get"] == 0.00052 and got["list"] == 0.005
    assert parse_prices({"delete": 0}) == {**DEFAULT_PRICES, "delete": 0.0}
    for bad in ("post=1", "put=-1", "put=abc", "get", "put=inf"):
        with pytest.raises(ConfigError):
            parse_prices(bad)


@pytest.mark.unit
def test_cost_is_per_thousand_requests_of_each_kind():
    counts = {"requests": 3000, "puts": 1000, "gets": 2000, "deletes": 7, "lists": 0}
    assert request_cost(counts) == pytest.approx(0.005 + 2 * 0.0004)
    per_hour = hourly(counts, 1800.0, None, billed=True)
    assert per_hour["requests_per_hour"] == 6000
    assert per_hour["request_cost_per_hour"] == pytest.approx(2 * (0.005 + 0.0008))
    assert hourly(counts, 1800.0, None, billed=False)["request_cost_per_hour"] is None
    assert is_billed("s3://b/p") and is_billed("gs://b/p")
    assert not any(is_billed(u) for u in ("/tmp/x", "file:///x", "memory://x", "gloo://h:1"))


def test_object_store_counts_requests_by_kind(s3_transport):
    storage = open_storage(s3_transport.url, s3_transport.options["storage_options"])
    storage.put("a", [b"x"])
    assert storage.read("a") == b"x"
    assert storage.open("missing") is None
    storage.list("")
    storage.delete(["a"])
    c = storage.counters.snapshot()
    assert (c["puts"], c["gets"], c["deletes"], c["lists"]) == (1, 2, 1, 1), c
    assert c["requests"] >= 5


def test_training_over_s3_reports_request_rate_and_cost(tmp_path, s3_transport):
    opts = json.dumps(s3_transport.options["storage_options"])
    result = run_cli("--nproc", "2", "--steps", "6", "--no-progress", "--sync",
                     s3_transport.url, "--sync-option", f"storage_options={opts}",
                     "--storage-prices", "put=0.01,get=0.001", cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    final = final_of(result.stdout)
    req = final["storage_requests"]
    assert req["puts"] > 0 and req["gets"] > 0, req
    assert req["requests"] >= req["puts"] + req["gets"]
    per_hour = final["requests_per_hour"]
    assert per_hour > 0
    # the price is exactly the kinds' counts at the prices given, per hour of wall time
    want = (req["puts"] * 0.01 + req["gets"] * 0.001 + req["lists"] * 0.005) / 1000
    assert final["request_cost_per_hour"] == pytest.approx(
        want * per_hour / req["requests"], rel=1e-6)
    assert "storage requests" in result.stderr + result.stdout


def test_training_on_a_directory_has_no_request_bill(tmp_path):
    result = run_cli("--nproc", "2", "--steps", "3", "--no-progress", "--sync",
                     tmp_path / "run", cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    final = final_of(result.stdout)
    assert final["requests_per_hour"] > 0
    assert final["request_cost_per_hour"] is None
    # one count of requests, the same in FINAL's two places and in the summary, named
    # for what it is on a directory, and counted by kind as on an object store
    req = final["storage_requests"]
    assert final["requests"] == req["requests"] > 0
    assert req["puts"] > 0 and req["gets"] > 0 and req["deletes"] > 0, req
    assert req["requests"] >= req["puts"] + req["gets"] + req["deletes"]
    assert final["requests_are"] == "file operations"
    out = result.stdout + result.stderr
    row = re.search(r"^\[rank 0\]   file operations  +([\d,]+) \(all ranks\), ([\d,]+)/hour "
                    r"\(a directory: not billed\)$", out, re.M)
    assert row, out[-3000:]
    assert int(row.group(1).replace(",", "")) == final["requests"]
    assert "storage requests" not in out and " requests (all ranks)" not in out


def test_inspect_shows_request_rates_from_heartbeats(tmp_path):
    """A finished run's heartbeats (state closed) still carry each rank's counts."""
    run = tmp_path / "run"
    result = run_cli("--nproc", "2", "--steps", "3", "--no-progress", "--sync", run,
                     cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    out = run_forked([sys.executable, "-m", "ferrosync", "inspect", str(run), "--json",
                      "--watch", "0"], cwd=ROOT, env=cli_env(), capture_output=True,
                     text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    gens = [g for g in report["generations"] if g.get("storage_requests")]
    assert gens, report
    req = gens[-1]["storage_requests"]
    assert req["ranks"] == 2 and req["requests_per_hour"] > 0
    assert req["request_cost_per_hour"] is None  # a directory bills nothing
