"""Each store's semantics, on its real server, and no store without exclusive create.

What docs/operations.md's store table and ``ferrosync.storage.providers`` say about each object
store is tried here on the servers of the suite (moto and SeaweedFS for S3,
fake-gcs-server for GCS, Azurite for Azure Blob) through their real fsspec drivers:
conditional create (also raced), read-after-write over a new and an overwritten
object, and delete visibility. Stores that cannot create exclusively are real fsspec
drivers registered here (``fsspec.register_implementation``), not patched clients:
connect must refuse them, fixed-size and elastic alike.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import uuid

import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

import ferrosync
from ferrosync.errors import ConfigError, DuplicateRank, FerrosyncError
from ferrosync.storage.costs import DEFAULT_PRICES, parse_prices
from ferrosync.storage.engines import (
    ExclusiveCreateUnsupported,
    gcs_driver,
    open_storage,
    probe_location,
)
from ferrosync.storage.providers import PROVIDERS, UNKNOWN, provider_of
from ranks import RankFailure, collect, run_ranks, start_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- the semantics ferrosync relies on, on every object store of the suite -----------------

@pytest.fixture(params=["gs", "az"])
def emulator_transport(request):
    """GCS and Azure on their emulators: the S3 servers' racing creates and doctor run
    are tests/test_s3_servers.py's and tests/test_ops.py's already."""
    from conftest import OBJECT_TRANSPORTS

    return request.getfixturevalue(OBJECT_TRANSPORTS[request.param])


def test_create_read_overwrite_delete(any_object_transport):
    storage = open_storage(any_object_transport.url,
                           any_object_transport.options["storage_options"])
    second = open_storage(any_object_transport.url,
                          any_object_transport.options["storage_options"])
    assert second.read("k") is None  # a miss first: a cache must not keep it
    storage.put("k", [b"one"], exclusive=True)
    assert second.read("k") == b"one"  # read-after-write, another client
    with pytest.raises(FileExistsError):
        storage.put("k", [b"two"], exclusive=True)
    assert second.read("k") == b"one"  # the refused create changed nothing
    storage.put("k", [b"three"])  # an overwrite (heartbeats) is seen at once
    assert second.read("k") == b"three"
    storage.delete(["k"])
    assert second.read("k") is None  # delete visibility
    storage.put("k", [b"four"], exclusive=True)  # a deleted name can be created again
    assert second.read("k") == b"four"
    storage.delete(["k"])


def test_one_of_many_racing_creates_wins(emulator_transport):
    """Eight clients create one name at once: exactly one succeeds, and the object
    holds its bytes."""
    options = emulator_transport.options["storage_options"]
    clients = [open_storage(emulator_transport.url, options) for _ in range(8)]
    start = threading.Barrier(len(clients))
    won, errors = [], []

    def create(i: int) -> None:
        start.wait()
        try:
            clients[i].put("contested", [f"client {i}".encode()], exclusive=True)
            won.append(i)
        except FileExistsError:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(won) == 1, won
    assert clients[0].read("contested") == f"client {won[0]}".encode()


def test_connect_probe_passes_and_doctor_names_the_store(emulator_transport, capsys):
    from ferrosync.__main__ import main

    url, so = emulator_transport.url, emulator_transport.options["storage_options"]
    probe_location(open_storage(url, so), 0)  # the exclusive create is enforced
    code = main(["doctor", url, "--storage-options", json.dumps(so), "--size-mib", "0",
                 "--samples", "3", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    checks = {c["name"]: c for c in report["checks"]}
    store = provider_of(url)
    assert report["capabilities"]["exclusive_create"] is True
    assert checks["exclusive create"]["status"] == "ok", checks["exclusive create"]
    assert store.create_request in checks["exclusive create"]["summary"]
    assert report["store"]["name"] == store.name
    assert report["store"]["prices_per_1000"] == store.prices
    assert checks["store"]["status"] == "info"
    assert checks["visibility"]["status"] == "ok", checks["visibility"]
    assert open_storage(url, so).list() == []  # doctor cleaned up


# -- what exclusive create protects, on GCS and Azure ---------------------------------------

def w_anonymous(rank, world, url, value, options):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=60,
                           heartbeat_interval=0.5, heartbeat_timeout=5.0, **options) as sync:
        x = torch.full((1000,), value)
        sync.average_(x)
        return x


def test_anonymous_jobs_started_together_never_mix(emulator_transport):
    """Two jobs without an id, ranks started interleaved on one URL: each rank gets its
    own job's exact average or a ferrosync error, and the collision is seen."""
    values, expected = {"A": (0.0, 1.0), "B": (100.0, 101.0)}, {"A": 0.5, "B": 100.5}
    started = {}
    for i, (job, rank) in enumerate([("B", 0), ("A", 1), ("A", 0), ("B", 1)]):
        if i:
            time.sleep(0.3)  # the scenario: processes started this far apart
        started[(job, rank)] = start_ranks(
            w_anonymous, 2, emulator_transport.url, values[job][rank],
            emulator_transport.options, ranks=[rank], env={"FERROSYNC_JOB": ""})
    out = {key: collect(procs, q, timeout=120)[key[1]] for key, (procs, q) in started.items()}
    for (job, rank), res in out.items():
        if isinstance(res, RankFailure):
            assert isinstance(res.error, FerrosyncError), (job, rank, res)
        else:
            assert torch.equal(res, torch.full((1000,), expected[job])), (job, rank, res[0])
    assert any(isinstance(r, RankFailure) and isinstance(r.error, DuplicateRank)
               for r in out.values()), out


def w_elastic(index, _world, url, options):
    with ferrosync.connect(url, elastic=True, min_ranks=2, job="emulated", timeout=60,
                           heartbeat_interval=0.5, heartbeat_timeout=5.0, **options) as sync:
        x = torch.full((100,), 10.0 ** index)
        total = sync.average_(x)
        return total, x, sorted(sync.membership)


def test_elastic_job_agrees_on_its_members(emulator_transport):
    results = run_ranks(w_elastic, 2, emulator_transport.url, emulator_transport.options)
    assert results[0][2] == results[1][2] and len(results[0][2]) == 2
    for total, x, _members in results:
        assert total == 2
        assert torch.equal(x, torch.full((100,), 5.5))


# -- stores that cannot create exclusively: real drivers, registered -------------------------

class _Prefixed:
    """Strips its own ``scheme://`` as MemoryFileSystem strips ``memory://``."""

    @classmethod
    def _strip_protocol(cls, path):
        scheme = cls.protocol if isinstance(cls.protocol, str) else cls.protocol[0]
        if isinstance(path, str) and path.startswith(scheme + "://"):
            path = path[len(scheme) + 3:]
        return super()._strip_protocol(path)


class OverwritingMemory(MemoryFileSystem):
    """Takes ``mode`` and ignores it: every create is an overwrite (as an old driver
    that only ever overwrote, given the keyword by **kwargs). Written as a user would,
    without a ``_strip_protocol`` of its own."""

    protocol = "fs-overwrites"

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        return super().pipe_file(path, value, mode="overwrite", **kwargs)


class ModelessMemory(_Prefixed, MemoryFileSystem):
    """A driver whose ``pipe_file`` has no ``mode`` at all (fsspec before 2024.12)."""

    protocol = "fs-modeless"

    def pipe_file(self, path, value):
        return super().pipe_file(path, value)


class GenericLocal(_Prefixed, LocalFileSystem):
    """A local driver keeping fsspec's generic ``pipe_file``: ``exists()``, then a
    plain write (two writers can both pass the check)."""

    protocol = "fs-generic"

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("auto_mkdir", True)  # an object store has no directories to make
        super().__init__(*args, **kwargs)


NO_CREATE = {"fs-overwrites": OverwritingMemory, "fs-modeless": ModelessMemory,
             "fs-generic": GenericLocal}


@pytest.fixture(params=sorted(NO_CREATE))
def no_create_url(request, tmp_path):
    fsspec.register_implementation(request.param, NO_CREATE[request.param], clobber=True)
    if request.param == "fs-generic":
        return f"fs-generic://{tmp_path}/run"
    return f"{request.param}://ferrosync-{uuid.uuid4().hex[:8]}/run"


def _assert_refused(exc: ConfigError, url: str) -> None:
    text = str(exc)
    assert url in text
    assert "exclusively" in text
    assert "two jobs" in text and "mix" in text
    assert "elastic job cannot agree on its members" in text
    assert "ferrosync doctor" in text


@pytest.mark.unit
def test_connect_refuses_a_store_without_exclusive_create(no_create_url):
    # a named job, a single rank: nothing else would ever notice
    with pytest.raises(ConfigError) as info:
        ferrosync.connect(no_create_url, rank=0, world_size=1, timeout=300, job="solo")
    _assert_refused(info.value, no_create_url)
    assert info.value.rank == 0


@pytest.mark.unit
def test_elastic_connect_refuses_a_store_without_exclusive_create(no_create_url):
    with pytest.raises(ConfigError) as info:
        ferrosync.connect(no_create_url, elastic=True, timeout=300)
    _assert_refused(info.value, no_create_url)


@pytest.mark.unit
def test_exclusive_put_never_degrades_to_an_overwrite(no_create_url):
    storage = open_storage(no_create_url)
    storage.makedirs("")
    storage.put("k", [b"first"])
    if no_create_url.startswith("fs-overwrites"):
        # the driver says nothing: only trying it on the location tells (connect's probe)
        storage.put("k", [b"second"], exclusive=True)
        assert storage.read("k") == b"second"
    else:
        with pytest.raises(ExclusiveCreateUnsupported) as info:
            storage.put("k", [b"second"], exclusive=True)
        assert "ferrosync doctor" in str(info.value)
        assert storage.read("k") == b"first"


@pytest.mark.unit
def test_doctor_fails_exclusive_create_on_a_store_without_it(capsys):
    from ferrosync.__main__ import main

    fsspec.register_implementation("fs-overwrites", OverwritingMemory, clobber=True)
    url = f"fs-overwrites://ferrosync-{uuid.uuid4().hex[:8]}/doctor"
    main(["doctor", url, "--size-mib", "0", "--samples", "3", "--json"])
    report = json.loads(capsys.readouterr().out)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["capabilities"]["exclusive_create"] is False
    assert checks["exclusive create"]["status"] == "fail"
    assert "connect refuses" in checks["exclusive create"]["summary"]
    assert report["store"]["name"] == UNKNOWN.name
    assert report["store"]["driver_class"] == "OverwritingMemory"


@pytest.mark.unit
def test_memory_store_creates_exclusively():
    url = f"memory://ferrosync-{uuid.uuid4().hex[:8]}/run"
    with ferrosync.connect(url, rank=0, world_size=1, timeout=60, job="solo") as sync:
        assert sync.world_size == 1


# -- GCS driver settings -----------------------------------------------------------------

@pytest.mark.unit
def test_gcs_emulator_endpoint_gets_the_json_api_driver(monkeypatch):
    pytest.importorskip("gcsfs")
    from gcsfs.core import GCSFileSystem

    extended = fsspec.get_filesystem_class("gs")
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    local = {"endpoint_url": "http://127.0.0.1:4443"}
    assert gcs_driver(extended, local) is GCSFileSystem
    assert gcs_driver(extended, {"endpoint_url": "https://storage.googleapis.com"}) is extended
    assert gcs_driver(extended, {}) is extended
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:4443")
    assert gcs_driver(extended, {}) is GCSFileSystem
    assert gcs_driver(GCSFileSystem, local) is GCSFileSystem


def test_gcs_emulator_storage_uses_the_json_api_driver(gcs_server):
    from gcsfs.core import GCSFileSystem

    storage = open_storage("gs://ferrosync-tests/driver", gcs_server.storage_options())
    assert type(storage.fs) is GCSFileSystem


# -- prices and the documented table ---------------------------------------------------------

@pytest.mark.unit
def test_default_prices_follow_the_store():
    for store in PROVIDERS:
        for scheme in store.schemes:
            want = store.prices or DEFAULT_PRICES
            # a file:// URL names no host (another host is a ConfigError): its path only
            url = f"{scheme}:///run" if scheme in ("file", "local") else f"{scheme}://bucket/run"
            assert parse_prices(None, url) == want, scheme
    assert parse_prices(None, "fs-unknown://x") == DEFAULT_PRICES
    assert parse_prices("get=0.001", "gs://b/x") == {**provider_of("gs://").prices, "get": 0.001}


def _store_table() -> dict[str, list[str]]:
    """docs/operations.md's store table: the first cell of each row -> its cells."""
    with open(os.path.join(ROOT, "docs", "operations.md")) as f:
        text = f.read()
    section = text.split("## Object stores", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("| store ") and "---" not in line:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells
    return rows


@pytest.mark.unit
def test_docs_store_table_says_what_the_code_knows():
    rows = _store_table()
    for store in PROVIDERS:
        if not store.prices:
            continue
        cells = rows[store.name]
        assert store.driver in cells[1], (store.name, cells)
        prices = [float(x) for x in re.findall(r"\$([0-9.]+)", cells[5])]
        want = [store.prices[k] for k in ("put", "get", "delete", "list")]
        assert prices == want, (store.name, cells[5])
