"""The S3 endpoint goes away mid-run: every rank gets a clear error after bounded
retries; once it is back, a new run under the same URL works.

On both servers: moto (stopped in this process; its objects stay in memory) and
SeaweedFS (killed with SIGKILL, as a crash would; restarted on the same ports and
data directory, as a real server comes back)."""

from __future__ import annotations

import os
import time

import pytest
import torch

import ferrosync
from conftest import free_port, s3_storage_options, start_seaweed
from ferrosync.errors import PeerFailed, StorageError, SyncTimeout
from ranks import RankFailure, collect, start_ranks


def start_server(port):
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    import boto3

    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}",
                 region_name="us-east-1").create_bucket(Bucket="outage")  # idempotent
    return server


class Moto:
    """moto's server: goes away and comes back in this process."""

    def __init__(self, tmp_path) -> None:
        pytest.importorskip("moto.server")
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.server = start_server(self.port)

    def down(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def up(self) -> None:
        self.server = start_server(self.port)


class Seaweed:
    """A SeaweedFS of this test's own (the session's one stays up): killed, restarted."""

    def __init__(self, tmp_path) -> None:
        self.server = start_seaweed(tmp_path / "seaweed", bucket="outage")
        self.endpoint = self.server.endpoint

    def down(self) -> None:
        self.server.stop(kill=True)

    def up(self) -> None:
        # the restart reuses the server's ports (the clients know its S3 port); another
        # test's free-port probe or launcher may hold one of them for a moment, and
        # weed then exits "address already in use": wait until every port binds, retry
        for attempt in range(3):
            try:
                self.server.start()
                return
            except RuntimeError as exc:
                if "address already in use" not in str(exc) or attempt == 2:
                    raise
                self._wait_for_free_ports(time.monotonic() + 30)

    def _wait_for_free_ports(self, deadline: float) -> None:
        import socket

        for port in self.server.ports.values():
            while True:
                with socket.socket() as sock:
                    # as weed's (Go's) listeners do: a closed connection's TIME_WAIT
                    # does not keep the port from them
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    try:
                        sock.bind(("127.0.0.1", port))
                        break
                    except OSError:
                        assert time.monotonic() < deadline, f"port {port} stays taken"
                time.sleep(0.05)  # poll the port again


@pytest.fixture(params=["moto", "seaweed"])
def outage_server(request, tmp_path):
    pytest.importorskip("s3fs")
    server = (Moto if request.param == "moto" else Seaweed)(tmp_path)
    yield server
    server.down()


def w_until_failure(rank, world, url, options, progress):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=120, **options) as sync:
        step = 0
        t_fail = None
        try:
            while True:
                x = torch.full((1000,), float(rank + step))
                sync.average_(x)
                assert torch.equal(x, torch.full((1000,), 0.5 + step))
                step += 1
                with open(f"{progress}.{rank}", "w") as f:
                    f.write(str(step))
                t_fail = time.monotonic()
        except (StorageError, PeerFailed, SyncTimeout) as exc:
            return type(exc).__name__, str(exc), time.monotonic() - (t_fail or 0), step


def w_short_run(rank, world, url, options):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=60, **options) as sync:
        x = torch.full((10,), float(rank))
        sync.average_(x)
        return x, sync.generation


@pytest.mark.timeout(240)
def test_s3_outage_then_recovery(tmp_path, outage_server):
    server = outage_server
    url = "s3://outage/run"
    storage_options = s3_storage_options(server.endpoint)
    # still retried (botocore, 3 attempts), just not for as long as the defaults
    storage_options["config_kwargs"] = {"retries": {"mode": "standard", "max_attempts": 3},
                                        "connect_timeout": 2}
    options = {"storage_options": storage_options,
               "heartbeat_interval": 0.5, "heartbeat_timeout": 10.0}
    progress = str(tmp_path / "progress")
    procs, q = start_ranks(w_until_failure, 2, url, options, progress)
    try:
        deadline = time.monotonic() + 60
        while not all(os.path.exists(f"{progress}.{r}") for r in range(2)):
            assert time.monotonic() < deadline, "ranks never made progress"
            time.sleep(0.01)
    finally:
        server.down()
    out = collect(procs, q, timeout=150)
    for rank in range(2):
        res = out[rank]
        assert not isinstance(res, RankFailure), res
        kind, message, seconds, steps = res
        assert steps >= 1
        assert kind in ("StorageError", "PeerFailed"), res
        if kind == "StorageError":
            assert "127.0.0.1" in message and "after retries" in message, message
        assert seconds < 90, res  # bounded retries, not the 120 s collective timeout
    # the endpoint comes back with its objects: a new run works, in a new generation
    # of its own
    server.up()
    results = collect(*start_ranks(w_short_run, 2, url, options), timeout=120)
    generations = set()
    for rank in range(2):
        x, generation = results[rank]
        assert torch.equal(x, torch.full((10,), 0.5))
        generations.add(generation)
    assert generations == {1}, generations  # never mixed with the interrupted one
