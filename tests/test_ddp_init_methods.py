"""init_method URLs for backend "ferrosync": which store torch gets, where the data goes.

These call ``torch.distributed.rendezvous`` directly (it builds the store; no
process group is created), plus one-rank process groups in child processes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from ddp_workers import init_without_location

import ferrosync  # noqa: F401 - registers the backend and the handlers
from ferrosync.ddp.factory import _options
from ferrosync.ddp.init_methods import STORE_FILE, UrlStore, location_of
from ferrosync.errors import ConfigError
from ranks import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def meet(url: str, rank: int = 0, world_size: int = 1):
    """(store wrapped as torch wraps it, rank, world_size) for ``url``."""
    store, rank, world_size = next(dist.rendezvous(url, rank, world_size))
    return dist.PrefixStore("default_pg", store), rank, world_size


@pytest.mark.parametrize("spelling", ["bare", "file"])
@pytest.mark.unit
def test_directory_that_does_not_exist_yet(tmp_path, spelling):
    path = tmp_path / "a" / "run"
    url = str(path) if spelling == "bare" else f"file://{path}/"
    store, rank, world = meet(url, 0, 2)
    assert (rank, world) == (0, 2)
    assert location_of(store) == str(path)
    assert (path / STORE_FILE).is_file()  # a real FileStore: gloo could use it too


@pytest.mark.parametrize("spelling", ["bare", "file"])
@pytest.mark.unit
def test_existing_directory(tmp_path, spelling):
    url = str(tmp_path) if spelling == "bare" else f"file://{tmp_path}"
    store, _, _ = meet(url)
    assert location_of(store) == str(tmp_path)
    store.set("k", "v")  # usable as a store
    assert store.get("k") == b"v"


@pytest.mark.unit
def test_file_url_naming_a_file_keeps_torchs_meaning(tmp_path):
    store, _, _ = meet(f"file://{tmp_path / 'store'}")
    assert (tmp_path / "store").is_file()
    assert location_of(store) == str(tmp_path / "store") + ".ferrosync"


@pytest.mark.unit
def test_relative_bare_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store, _, _ = meet("runs/exp1")
    assert location_of(store) == str(tmp_path / "runs" / "exp1")


@pytest.mark.unit
def test_object_store_url():
    store, rank, world = meet("s3://bucket/runs/exp7", 1, 3)
    assert (rank, world) == (1, 3)
    assert location_of(store) == "s3://bucket/runs/exp7"


@pytest.mark.unit
def test_rank_and_world_size_from_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    _, rank, world = meet("s3://bucket/run", -1, -1)
    assert (rank, world) == (2, 4)


@pytest.mark.unit
def test_unknown_query_parameters_are_refused():
    with pytest.raises(ConfigError, match="FERROSYNC_PG_OPTIONS"):
        meet("s3://bucket/run?endpoint_url=http://x")
    with pytest.raises(ConfigError, match="names no bucket"):
        meet("s3:///run")


@pytest.mark.unit
def test_url_store_refuses_keys_other_ranks_would_have_set():
    store = UrlStore("s3://bucket/run", 0)
    store.set("mine", "1")
    assert store.get("mine") == b"1" and store.add("n", 2) == 2 and store.check(["mine"])
    with pytest.raises(ConfigError, match="only with backend='ferrosync'"):
        dist.PrefixStore("p", store).get("peer-key")


@pytest.mark.unit
def test_pg_options_and_environment(monkeypatch):
    monkeypatch.setenv("FERROSYNC_PG_OPTIONS", '{"secret": "a", "reduce": "root"}')
    assert _options({"secret": "b"}) == {"secret": "b", "reduce": "root"}
    with pytest.raises(ConfigError, match="must be a dict"):
        _options(["secret"])
    monkeypatch.setenv("FERROSYNC_PG_OPTIONS", "[1]")
    with pytest.raises(ConfigError, match="JSON object"):
        _options(None)
    monkeypatch.setenv("FERROSYNC_PG_OPTIONS", "{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        _options(None)


def test_store_without_location_needs_ferrosync_url(tmp_path):
    failure, = run_ranks(init_without_location, 1, "", expect_errors=True)
    assert isinstance(failure.error, ConfigError), failure.traceback
    assert "FERROSYNC_URL" in str(failure.error)
    (url, t), = run_ranks(init_without_location, 1, str(tmp_path / "run"))
    assert url == str(tmp_path / "run") and torch.equal(t, torch.ones(2))


def test_import_registers_without_loading_storage_drivers():
    code = (
        "import sys, torch.distributed as dist, ferrosync\n"
        "from torch.distributed import rendezvous\n"
        "handlers = sys.modules['torch.distributed.rendezvous']._rendezvous_handlers\n"
        "assert 'ferrosync' in dist.Backend.backend_list\n"
        "assert '' in handlers and 's3' in handlers and 'gs' in handlers\n"
        "assert dist.Backend.default_device_backend_map['cpu'] == 'gloo'  # not taken over\n"
        "ferrosync.ddp.register()  # idempotent\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('fsspec', 's3fs')]\n"
    )
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
