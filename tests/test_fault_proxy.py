"""ferrosync/testing/fault_proxy.py: each fault does what it says to one request, and
nothing else; requests without a fault pass whole.

In process and quick: the server is the standard library's HTTP server on 127.0.0.1
(it keeps what it was sent), the client ``http.client``.
"""

from __future__ import annotations

import http.client
import http.server
import threading
import time

import pytest

from ferrosync.testing.fault_proxy import (
    SLOWDOWN_BODY,
    TOO_LARGE_BODY,
    Fault,
    FaultProxy,
    check_loopback,
    parse_fault,
)

pytestmark = pytest.mark.unit
TIMEOUT = 10.0


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as object-store clients use

    def do_PUT(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.stored[self.path] = body
        self._answer(200, b"")

    def do_GET(self):
        body = self.server.stored.get(self.path)
        if body is None:
            self._answer(404, b"<Error><Code>NoSuchKey</Code></Error>")
        elif self.path.endswith("/chunked"):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(body), 7):
                part = body[i:i + 7]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
        else:
            self._answer(200, body)

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.stored = {}
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def proxy(server):
    with FaultProxy(server.server_address[1]) as p:
        p.clients = []
        yield p
        for conn in p.clients:
            conn.close()


def _client(proxy: FaultProxy) -> http.client.HTTPConnection:
    """A new connection to ``proxy`` (closed after the test)."""
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=TIMEOUT)
    proxy.clients.append(conn)
    return conn


def _request(conn, method: str, path: str, body: bytes | None = None):
    conn.request(method, path, body=body)
    response = conn.getresponse()
    return response.status, response.read()


def test_requests_without_a_fault_pass_whole_on_one_connection(server, proxy):
    conn = _client(proxy)
    assert _request(conn, "PUT", "/b/plain", b"x" * 100_000)[0] == 200
    assert _request(conn, "GET", "/b/plain") == (200, b"x" * 100_000)
    assert _request(conn, "PUT", "/b/chunked", b"abcdefghijklmnopqrstuvwxyz")[0] == 200
    assert _request(conn, "GET", "/b/chunked") == (200, b"abcdefghijklmnopqrstuvwxyz")
    assert _request(conn, "GET", "/b/missing")[0] == 404
    assert proxy.stats() == {"requests": 5, "largest_body": 100_000, "too_large": 0,
                             "lose_reply": 0, "cut_body": 0, "reset": 0, "slowdown": 0,
                             "delay": 0}


def test_a_body_over_the_limit_is_refused_as_s3_refuses_it(server):
    with FaultProxy(server.server_address[1], max_body=1000) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=TIMEOUT)
        try:
            assert _request(conn, "PUT", "/b/limit-ok", b"y" * 1000)[0] == 200
            status, body = _request(conn, "PUT", "/b/limit-over", b"z" * 1001)
            assert status == 400 and TOO_LARGE_BODY == body and b"EntityTooLarge" in body
            # the connection stays usable, and the server never saw the refused body
            assert _request(conn, "GET", "/b/limit-ok") == (200, b"y" * 1000)
            assert "/b/limit-over" not in server.stored
        finally:
            conn.close()
        assert proxy.stats()["largest_body"] == 1001
        assert proxy.stats()["too_large"] == 1


def test_a_lost_reply_comes_after_the_server_acted(server, proxy):
    proxy.add(Fault("lose_reply", methods=("PUT",), times=1))
    conn = _client(proxy)
    with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
        _request(conn, "PUT", "/b/lost", b"stored")
    assert server.stored["/b/lost"] == b"stored"  # the server has it, the client never heard
    conn = _client(proxy)  # spent: the next passes
    assert _request(conn, "PUT", "/b/lost", b"again")[0] == 200
    assert proxy.events == [("PUT", "/b/lost", "lose_reply")]


def test_a_cut_body_stops_mid_transfer(server, proxy):
    server.stored["/b/cut"] = b"0123456789" * 10
    proxy.add(Fault("cut_body", methods=("GET",), path=r"/cut$", times=1))
    conn = _client(proxy)
    conn.request("GET", "/b/cut")
    response = conn.getresponse()
    assert response.status == 200 and response.length == 100
    with pytest.raises(http.client.IncompleteRead) as info:
        response.read()
    assert info.value.partial == b"0123456789" * 5
    assert _request(_client(proxy), "GET", "/b/cut") == (200, b"0123456789" * 10)


def test_a_reset_request_never_reaches_the_server(server, proxy):
    proxy.add(Fault("reset", path="/never", times=1))
    with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
        _request(_client(proxy), "PUT", "/b/never", b"lost")
    assert "/b/never" not in server.stored


def test_slowdown_answers_503_and_keeps_the_connection(server, proxy):
    proxy.add(Fault("slowdown", methods=("PUT",), times=1))
    conn = _client(proxy)
    assert _request(conn, "PUT", "/b/busy", b"later") == (503, SLOWDOWN_BODY)
    assert b"<Code>SlowDown</Code>" in SLOWDOWN_BODY
    assert "/b/busy" not in server.stored
    assert _request(conn, "PUT", "/b/busy", b"later")[0] == 200
    assert server.stored["/b/busy"] == b"later"


def test_a_delay_holds_the_request(server, proxy):
    proxy.add(Fault("delay", seconds=0.3, times=1))
    start = time.monotonic()
    assert _request(_client(proxy), "GET", "/b/missing")[0] == 404
    assert time.monotonic() - start >= 0.3


def test_expect_continue_is_answered_by_the_proxy(server, proxy):
    conn = _client(proxy)
    conn.putrequest("PUT", "/b/expect")
    conn.putheader("Content-Length", "4")
    conn.putheader("Expect", "100-continue")
    conn.endheaders()
    conn.sock.settimeout(TIMEOUT)
    assert conn.sock.recv(64).startswith(b"HTTP/1.1 100 Continue")
    conn.send(b"body")
    assert conn.getresponse().status == 200
    assert server.stored["/b/expect"] == b"body"


def test_faults_match_method_path_and_header():
    fault = Fault("lose_reply", methods=("put",), path=r"/join\.\d+$", header="If-None-Match")
    assert fault.matches("PUT", "/b/el.x/join.3", {"if-none-match": "*"})
    assert not fault.matches("GET", "/b/el.x/join.3", {"if-none-match": "*"})
    assert not fault.matches("PUT", "/b/el.x/join.3x", {"if-none-match": "*"})
    assert not fault.matches("PUT", "/b/el.x/join.3", {})
    for bad in (dict(kind="drop"), dict(kind="reset", probability=1.5),
                dict(kind="reset", times=-1)):
        with pytest.raises(ValueError):
            Fault(**bad)


def test_seeded_rolls_repeat():
    def rolls(seed):
        proxy = FaultProxy(9, [Fault("cut_body", 0.3), Fault("reset", 0.3)], seed=seed)
        try:
            return [getattr(proxy._choose("GET", "/k", {})[0], "kind", None)
                    for _ in range(200)]
        finally:
            proxy.close()

    first = rolls(7)
    assert first == rolls(7) and first != rolls(8)
    assert 0.15 < first.count("cut_body") / 200 < 0.45


def test_parse_fault_and_loopback_only():
    assert parse_fault("lose_reply:0.05:PUT") == Fault("lose_reply", 0.05, ("PUT",))
    assert parse_fault("cut_body:0.1:GET,HEAD").methods == ("GET", "HEAD")
    assert parse_fault("delay:1:any:20ms").seconds == pytest.approx(0.02)
    assert parse_fault("reset") == Fault("reset")
    with pytest.raises(ValueError, match="unit"):
        parse_fault("delay:1:any:20")
    assert check_loopback("localhost").startswith("127.")
    with pytest.raises(ValueError, match="loopback"):
        check_loopback("192.0.2.1")
