"""What ferrosync's S3 requests look like on the wire, seen by a relay on loopback.

A relay between the client and a real S3 server (SeaweedFS) records every byte the
client sends, so these tests check the requests themselves, not their timing.
"""

from __future__ import annotations

import socket
import threading

import pytest

from ferrosync.storage import open_storage


class Recorder:
    """A TCP relay on 127.0.0.1 to ``target_port`` that keeps what clients send."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.sent = bytearray()
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self.port = self._server.getsockname()[1]
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except socket.timeout:
                continue
            except OSError:
                return  # closed by close()
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
            self._sockets += [client, upstream]
            for src, dst, keep in ((client, upstream, True), (upstream, client, False)):
                t = threading.Thread(target=self._pump, args=(src, dst, keep), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src, dst, keep: bool) -> None:
        src.settimeout(0.5)
        try:
            while not self._stop.is_set():
                try:
                    data = src.recv(65536)
                except socket.timeout:
                    continue
                if not data:
                    break
                if keep:
                    with self._lock:
                        self.sent += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._threads[0].join(timeout=5)  # the accept loop first, then the server socket
        self._server.close()
        for t in self._threads[1:]:
            t.join(timeout=5)
        for sock in self._sockets:
            sock.close()


@pytest.fixture
def recorded_s3(seaweed_endpoint):
    from conftest import s3_storage_options

    port = int(seaweed_endpoint.rsplit(":", 1)[1])
    recorder = Recorder(port)
    yield recorder, s3_storage_options(f"http://127.0.0.1:{recorder.port}")
    recorder.close()


def test_puts_send_no_expect_continue(recorded_s3):
    """Every PUT goes in one round trip: no ``Expect: 100-continue`` (botocore adds it
    by default, and the client then waits for the server before sending the body)."""
    recorder, options = recorded_s3
    storage = open_storage("s3://ferrosync-tests/expect", options)
    storage.put("plain", [b"x" * 1000])
    storage.put("exclusive", [b"y" * 1000], exclusive=True)
    assert storage.read("plain") == b"x" * 1000
    storage.close()
    sent = bytes(recorder.sent).lower()
    assert sent.count(b"put /") >= 2, sent[:2000]
    assert b"expect: 100-continue" not in sent


def test_a_session_given_by_the_user_is_kept(recorded_s3):
    from aiobotocore.session import get_session

    recorder, options = recorded_s3
    session = get_session()
    storage = open_storage("s3://ferrosync-tests/expect2", {**options, "session": session})
    assert storage.fs.session is session
    storage.put("plain", [b"x" * 1000])
    storage.close()
    # the user's session keeps botocore's default, header and all
    assert b"expect: 100-continue" in bytes(recorder.sent).lower()


def test_puts_carry_no_redundant_crc_unless_the_user_asks(recorded_s3):
    """botocore's default CRC of every body is skipped (every object carries
    ferrosync's own checksum or MAC, verified by every reader); a user's
    ``config_kwargs`` setting wins."""
    from botocore.config import Config

    if "request_checksum_calculation" not in Config.OPTION_DEFAULTS:
        pytest.skip("this botocore computes no CRC by default")
    recorder, options = recorded_s3
    storage = open_storage("s3://ferrosync-tests/crc", options)
    storage.put("plain", [b"x" * 1000])
    storage.close()
    assert b"x-amz-checksum-crc32" not in bytes(recorder.sent).lower()
    start = len(recorder.sent)
    wanted = {**options, "config_kwargs": {"request_checksum_calculation": "when_supported"}}
    storage = open_storage("s3://ferrosync-tests/crc2", wanted)
    storage.put("plain", [b"x" * 1000])
    storage.close()
    assert b"x-amz-checksum-crc32" in bytes(recorder.sent[start:]).lower()
