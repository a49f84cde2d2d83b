"""What ferrosync's S3 requests look like on the wire, seen by a relay on loopback.

A relay between the client and a real S3 server (SeaweedFS) records every byte the
client sends, so these tests check the requests themselves, not their timing.
"""

from __future__ import annotations

import socket
import threading

import pytest

from ferrosync.storage.engines import open_storage


class Recorder:
    """A TCP relay on 127.0.0.1 to ``target_port`` that keeps what clients send.

    With ``tls`` (a server ``SSLContext``) it speaks HTTPS to clients and plain HTTP
    to the server, so what it keeps is the decrypted requests. One thread per
    connection moves both directions: an ``SSLSocket`` must not be read in one
    thread while another writes to it."""

    def __init__(self, target_port: int, tls=None) -> None:
        self.target_port = target_port
        self.sent = bytearray()
        self._tls = tls
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
            t = threading.Thread(target=self._pump, args=(client, upstream), daemon=True)
            t.start()
            self._threads.append(t)

    def _pump(self, client, upstream) -> None:
        import selectors
        import ssl

        try:
            if self._tls is not None:
                client.settimeout(10)
                client = self._tls.wrap_socket(client, server_side=True)
                self._sockets.append(client)
            client.settimeout(0.5)
            upstream.settimeout(0.5)
            peer = {client: upstream, upstream: client}
            with selectors.DefaultSelector() as selector:
                for sock in peer:
                    selector.register(sock, selectors.EVENT_READ)
                while not self._stop.is_set():
                    ready = {key.fileobj for key, _ in selector.select(0.5)}
                    if self._tls is not None and client.pending():
                        ready.add(client)  # decrypted bytes already buffered
                    for src in ready:
                        try:
                            data = src.recv(65536)
                        except (socket.timeout, ssl.SSLWantReadError):
                            continue  # part of a TLS record so far
                        if not data:
                            return
                        if src is client:
                            with self._lock:
                                self.sent += data
                        peer[src].sendall(data)
        except OSError:
            pass  # a failed handshake or a closed peer ends this connection
        finally:
            for sock in (client, upstream):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
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


def _self_signed_for_loopback(directory) -> tuple[str, str]:
    """A certificate and key for 127.0.0.1, valid for a day: (cert path, key path)."""
    import datetime
    import ipaddress

    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = str(directory / "cert.pem"), str(directory / "key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return cert_path, key_path


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


@pytest.fixture
def recorded_s3_over_tls(seaweed_endpoint, tmp_path):
    import ssl

    from conftest import s3_storage_options

    cert, key = _self_signed_for_loopback(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    recorder = Recorder(int(seaweed_endpoint.rsplit(":", 1)[1]), tls=context)
    options = s3_storage_options(f"https://127.0.0.1:{recorder.port}")
    options["client_kwargs"]["verify"] = cert  # trust the test's certificate only
    yield recorder, options
    recorder.close()


def _content_hashes(sent: bytes) -> list[bytes]:
    """The ``x-amz-content-sha256`` value of every PUT in ``sent``."""
    values = []
    for request in sent.lower().split(b"put /")[1:]:
        head = request.split(b"\r\n\r\n", 1)[0]
        for line in head.split(b"\r\n"):
            if line.startswith(b"x-amz-content-sha256:"):
                values.append(line.split(b":", 1)[1].strip())
    return values


def test_over_https_bodies_are_not_hashed_again(recorded_s3_over_tls):
    """Over TLS botocore's SHA-256 of every body is skipped (TLS guards the body in
    transit, ferrosync's checksum or MAC at rest); the server accepts the unsigned
    PUTs and the bytes read back. A user's ``config_kwargs`` setting wins."""
    recorder, options = recorded_s3_over_tls
    storage = open_storage("s3://ferrosync-tests/tls", options)
    storage.put("plain", [b"x" * 100_000])
    storage.put("exclusive", [b"y" * 1000], exclusive=True)
    assert storage.read("plain") == b"x" * 100_000
    assert storage.read("exclusive") == b"y" * 1000
    storage.close()
    hashes = _content_hashes(bytes(recorder.sent))
    assert len(hashes) >= 2 and set(hashes) == {b"unsigned-payload"}, hashes
    start = len(recorder.sent)
    signed = {**options, "config_kwargs": {"s3": {"payload_signing_enabled": True}}}
    storage = open_storage("s3://ferrosync-tests/tls2", signed)
    storage.put("plain", [b"z" * 1000])
    storage.close()
    hashes = _content_hashes(bytes(recorder.sent[start:]))
    assert hashes and all(len(h) == 64 and h != b"unsigned-payload" for h in hashes), hashes


def test_over_plain_http_bodies_stay_signed(recorded_s3):
    """Without TLS the signature is what guards a body in transit: every PUT's body
    is hashed into it."""
    recorder, options = recorded_s3
    storage = open_storage("s3://ferrosync-tests/http-signed", options)
    storage.put("plain", [b"x" * 1000])
    storage.close()
    hashes = _content_hashes(bytes(recorder.sent))
    assert hashes and all(len(h) == 64 for h in hashes), hashes


@pytest.mark.parametrize("options, tls", [
    ({}, True),  # AWS itself
    ({"use_ssl": False}, False),
    ({"client_kwargs": {"use_ssl": False}}, False),
    ({"endpoint_url": "https://s3.example"}, True),
    ({"client_kwargs": {"endpoint_url": "HTTPS://s3.example"}}, True),
    ({"client_kwargs": {"endpoint_url": "http://s3.example"}}, False),
])
@pytest.mark.unit
def test_which_endpoints_count_as_tls(options, tls, monkeypatch):
    from ferrosync.storage.engines.s3 import _s3_endpoint_uses_tls

    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    assert _s3_endpoint_uses_tls(options) is tls
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert _s3_endpoint_uses_tls(options) is (tls and "endpoint_url" in str(options))
