"""Shared fixtures: storage locations, a real S3 endpoint, and the backend matrix.

S3 is a real HTTP endpoint: moto's threaded server on 127.0.0.1 (a free port),
reached through s3fs with ``endpoint_url``, the way s3fs tests itself. Nothing
but loopback is ever contacted.
"""

from __future__ import annotations

import os
import socket
import sys
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


@pytest.fixture
def dir_transport(tmp_path) -> Transport:
    return Transport("dir", str(tmp_path / "run"))


# The contract matrix: (backend, world size). Each contract test runs on every case.
CASES = [("dir", 1), ("dir", 2), ("dir", 3), ("dir", 4), ("s3", 2), ("gloo", 2), ("gloo", 3),
         ("nccl", 2)]
STORAGE_BACKENDS = ("dir", "s3")


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
    elif backend == "s3":
        transport = request.getfixturevalue("s3_transport")
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
