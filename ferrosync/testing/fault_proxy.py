"""A fault-injecting HTTP/1.1 proxy on loopback: the faults of a real network, on demand.

``FaultProxy(target_port=..., faults=[Fault(...)], seed=...)`` forwards whole requests
and replies to a loopback server except where a fault fires (``FAULT_KINDS``: lost
reply, cut body, reset, 503 SlowDown, delay); also a command
(``python ferrosync/testing/fault_proxy.py --help``). The faults and how they are chosen:
docs/contributing.md#tests-and-reliability. Every socket wait is bounded
(``IO_TIMEOUT``); standard library only.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import select
import signal
import socket
import struct
import sys
import threading
from dataclasses import dataclass

if __package__:  # imported from the package, or run by path (standard library only)
    from ferrosync.testing.loopback import Lifetime, add_proxy_flags, check_loopback, split_target
else:
    from loopback import Lifetime, add_proxy_flags, check_loopback, split_target

__all__ = ["FAULT_KINDS", "Fault", "FaultProxy", "parse_fault", "check_loopback"]

#: what a fault can do to one request (see the module docstring)
FAULT_KINDS = ("lose_reply", "cut_body", "reset", "slowdown", "delay")
#: seconds any one socket operation may block (a client or server gone quiet)
IO_TIMEOUT = 120.0
#: how often the acceptor looks at the closing flag
POLL_S = 0.2
#: seconds ``close`` waits for each thread
JOIN_S = 5.0
#: the longest request or response head (status line and headers) accepted
MAX_HEAD = 64 * 1024
#: the body of the 503 a ``slowdown`` answers with: S3's own error document
SLOWDOWN_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                 b"<Message>Please reduce your request rate.</Message>"
                 b"<RequestId>fault-proxy</RequestId></Error>")
#: the body of the 400 a request over ``max_body`` is answered with: S3's own
TOO_LARGE_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>EntityTooLarge'
                  b"</Code><Message>Your proposed upload exceeds the maximum allowed size"
                  b"</Message><RequestId>fault-proxy</RequestId></Error>")
_TIME = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)\s*$", re.I)
_TIME_SCALE = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass
class Fault:
    """One fault and the requests it applies to (see the module docstring).

    Args:
        kind: one of ``FAULT_KINDS``.
        probability: the chance that a matching request gets it.
        methods: HTTP methods it applies to (upper case); empty: every method.
        path: a regular expression searched in the request target; None: any.
        header: only requests that carry this header (e.g. ``If-None-Match``).
        times: apply it at most this often (None: no limit); counts down as applied.
        seconds: how long a ``delay`` holds the request.
    """

    kind: str
    probability: float = 1.0
    methods: tuple[str, ...] = ()
    path: str | None = None
    header: str | None = None
    times: int | None = None
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {self.kind!r}: expected one of {FAULT_KINDS}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"fault probability {self.probability} is not in [0, 1]")
        if self.times is not None and self.times < 0:
            raise ValueError(f"fault times {self.times} is negative")
        if self.seconds < 0:
            raise ValueError(f"fault seconds {self.seconds} is negative")
        self.methods = tuple(m.upper() for m in self.methods)
        self._path = re.compile(self.path) if self.path is not None else None

    def matches(self, method: str, target: str, headers: dict[str, str]) -> bool:
        return ((not self.methods or method in self.methods)
                and (self._path is None or self._path.search(target) is not None)
                and (self.header is None or self.header.lower() in headers)
                and (self.times is None or self.times > 0))


def parse_fault(text: str) -> Fault:
    """``KIND[:PROBABILITY[:METHODS[:SECONDS]]]``, e.g. ``lose_reply:0.05:PUT``,
    ``cut_body:0.1:GET,HEAD``, ``delay:1:any:20ms``; METHODS ``any`` is every method."""
    kind, *rest = text.strip().split(":")
    probability = float(rest[0]) if rest and rest[0] else 1.0
    methods = tuple(m for m in rest[1].split(",") if m and m.lower() != "any") if len(
        rest) > 1 else ()
    seconds = 0.0
    if len(rest) > 2:
        match = _TIME.match(rest[2])
        if not match:
            raise ValueError(f"fault {text!r}: delay {rest[2]!r} needs a unit (e.g. 20ms)")
        seconds = float(match.group(1)) * _TIME_SCALE[match.group(2).lower()]
    if len(rest) > 3:
        raise ValueError(f"fault {text!r}: expected KIND[:P[:METHODS[:SECONDS]]]")
    return Fault(kind, probability, methods, seconds=seconds)


class _Closed(Exception):
    """The peer closed the connection (or the proxy is closing)."""


class _Stream:
    """Buffered reads of HTTP/1.1 messages from one socket (raw bytes kept)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise _Closed()
        self.buf += data

    def line(self) -> bytes:
        while (end := self.buf.find(b"\r\n")) < 0:
            if len(self.buf) > MAX_HEAD:
                raise _Closed()
            self._fill()
        out = bytes(self.buf[:end + 2])
        del self.buf[:end + 2]
        return out

    def exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def rest(self) -> bytes:
        """Everything until the peer closes (a response framed by the close)."""
        try:
            while True:
                self._fill()
        except _Closed:
            pass
        out = bytes(self.buf)
        self.buf.clear()
        return out

    def head(self) -> tuple[bytes, dict[str, str]]:
        """The start line and headers (raw), and the headers by lower-case name."""
        lines = [self.line()]
        while lines[-1] != b"\r\n":
            lines.append(self.line())
            if sum(map(len, lines)) > MAX_HEAD:
                raise _Closed()
        headers = {}
        for raw in lines[1:-1]:
            name, _, value = raw.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return b"".join(lines), headers

    def body(self, headers: dict[str, str], *, until_close: bool) -> bytes:
        """The raw body a message's headers frame: chunked, by length, or (a response
        without either) until the close."""
        if "chunked" in headers.get("transfer-encoding", "").lower():
            out = []
            while True:
                size_line = self.line()
                out.append(size_line)
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while (trailer := self.line()) != b"\r\n":
                        out.append(trailer)
                    out.append(trailer)
                    return b"".join(out)
                out.append(self.exact(size + 2))
        if "content-length" in headers:
            return self.exact(int(headers["content-length"]))
        return self.rest() if until_close else b""


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP reset (SO_LINGER 0), as a dropped connection looks."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def _gone(sock: socket.socket) -> bool:
    """Whether the server closed this idle connection (readable with nothing to read)."""
    ready, _, _ = select.select([sock], [], [], 0)
    if not ready:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _without_expect(head: bytes) -> bytes:
    """The request head less its ``Expect`` header (the proxy answers 100 itself)."""
    lines = head.split(b"\r\n")
    return b"\r\n".join(li for li in lines if not li.lower().startswith(b"expect:"))


def _next_request(client: socket.socket, reader: _Stream) -> tuple[bytes, str, str, dict, int]:
    """The client's next whole request (raw, less any ``Expect``: the proxy answers
    ``100 Continue`` itself), its method, target, headers and body's length (framing
    included, as the server would receive it)."""
    head, headers = reader.head()
    if headers.get("expect", "").lower() == "100-continue":
        client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        head = _without_expect(head)
    body = reader.body(headers, until_close=False)
    method, target = (part.decode("latin-1") for part in head.split(b" ", 2)[:2])
    return head + body, method, target, headers, len(body)


class _Upstream:
    """The server side of one client connection: connected on first use, and again
    where the server closed it while idle."""

    def __init__(self, proxy: FaultProxy) -> None:
        self.proxy = proxy
        self.sock: socket.socket | None = None
        self.stream: _Stream | None = None

    def exchange(self, request: bytes, method: str) -> tuple[bytes, dict, bytes, bool]:
        """Send ``request``; the reply's head (raw), headers, raw body, and whether the
        connection stays open after it."""
        if self.sock is not None and _gone(self.sock):
            self.close()  # a request sent on it would be lost through no fault of ours
        if self.sock is None:
            self.sock = self.proxy._track(socket.create_connection(self.proxy.target,
                                                                   timeout=IO_TIMEOUT))
            self.stream = _Stream(self.sock)
        self.sock.sendall(request)
        head, headers = self.stream.head()
        status = int(head.split(b" ", 2)[1])
        if method == "HEAD" or status in (204, 304) or status < 200:
            return head, headers, b"", True
        framed_by_close = "content-length" not in headers and (
            "chunked" not in headers.get("transfer-encoding", "").lower())
        return head, headers, self.stream.body(headers, until_close=True), not framed_by_close

    def close(self) -> None:
        self.proxy._forget(self.sock)
        self.sock = self.stream = None


class FaultProxy(Lifetime):
    """Forward 127.0.0.1:``port`` to 127.0.0.1:``target_port``, injecting ``faults``.

    Args:
        target_port: the local HTTP server to forward to.
        faults: ``Fault``s, tried in order for each request (``add`` appends more).
        seed: seeds the probability rolls.
        target_host: must be a loopback address (ValueError otherwise).
        port: where to listen on 127.0.0.1 (0: a free port, see ``.port``).
        duration: close by itself after this many seconds (None: only on ``close``).
        max_body: refuse a request whose body is larger, as S3 refuses a PUT over
            5 GiB (``400 EntityTooLarge``; None: no limit).

    ``counts`` holds requests seen, the largest request body (``largest_body``), the
    bodies refused (``too_large``) and faults applied by kind; ``events`` the
    (method, target, kind) of each applied fault, in order.
    """

    def __init__(self, target_port: int, faults: list[Fault] | tuple = (), *, seed: int = 0,
                 target_host: str = "127.0.0.1", port: int = 0,
                 duration: float | None = None, max_body: int | None = None) -> None:
        self.target = (check_loopback(target_host), int(target_port))
        self.faults = list(faults)
        self.duration = duration
        self.max_body = max_body
        self.counts = {"requests": 0, "largest_body": 0, "too_large": 0,
                       **{kind: 0 for kind in FAULT_KINDS}}
        self.events: list[tuple[str, str, str]] = []
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self.closing = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server(("127.0.0.1", port))
        self._listener.settimeout(POLL_S)
        self.port = self._listener.getsockname()[1]
        self._timer: threading.Timer | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, fault: Fault) -> Fault:
        """Append ``fault`` (scripted tests add theirs while clients run)."""
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        """Drop every fault: from now on requests pass unharmed."""
        with self._lock:
            self.faults.clear()

    def _too_large(self, size: int) -> bool:
        """Count a request body of ``size`` bytes; whether it is over ``max_body``."""
        with self._lock:
            self.counts["largest_body"] = max(self.counts["largest_body"], size)
            refused = self.max_body is not None and size > self.max_body
            self.counts["too_large"] += refused
        return refused

    def _start_accepting(self) -> None:
        self._spawn(self._accept, "fault-proxy-accept")

    def stats(self) -> dict:
        with self._lock:
            return dict(self.counts)

    # -- choosing ------------------------------------------------------------------------------
    def _choose(self, method: str, target: str, headers: dict) -> tuple[Fault | None, float]:
        """The fault for this request (or None) and the delay to add before it."""
        chosen, delay = None, 0.0
        with self._lock:
            self.counts["requests"] += 1
            for fault in self.faults:
                if not fault.matches(method, target, headers):
                    continue
                if fault.kind != "delay" and chosen is not None:
                    continue
                if fault.probability < 1.0 and self._random.random() >= fault.probability:
                    continue
                if fault.kind == "delay":
                    delay += fault.seconds
                    self._spend(fault, method, target)
                else:
                    chosen = fault
        return chosen, delay

    def _spend(self, fault: Fault, method: str, target: str) -> None:
        """Count an applied fault (under the lock)."""
        if fault.times is not None:
            fault.times -= 1
        self.counts[fault.kind] += 1
        self.events.append((method, target, fault.kind))

    def _applied(self, fault: Fault, method: str, target: str) -> None:
        with self._lock:
            self._spend(fault, method, target)

    # -- connections ---------------------------------------------------------------------------
    def _spawn(self, fn, name: str, *args) -> None:
        t = threading.Thread(target=fn, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def _track(self, sock: socket.socket) -> socket.socket:
        sock.settimeout(IO_TIMEOUT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._sockets.add(sock)
        return sock

    def _forget(self, sock: socket.socket | None, reset: bool = False) -> None:
        if sock is None:
            return
        with self._lock:
            self._sockets.discard(sock)
        if reset:
            _reset(sock)
        else:
            sock.close()

    def _accept(self) -> None:
        n = 0
        while not self.closing.is_set():
            try:
                client, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            n += 1
            self._spawn(self._serve, f"fault-proxy-{n}", self._track(client))

    def _serve(self, client: socket.socket) -> None:
        """Requests of one client connection, one at a time, over one server connection."""
        upstream = _Upstream(self)
        reader = _Stream(client)
        try:
            while not self.closing.is_set():
                try:
                    request, method, target, headers, size = _next_request(client, reader)
                except _Closed:
                    return  # the client is done with this connection
                if self._too_large(size):
                    client.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/xml"
                                   b"\r\nContent-Length: %d\r\n\r\n" % len(TOO_LARGE_BODY)
                                   + TOO_LARGE_BODY)
                    continue
                fault, delay = self._choose(method, target, headers)
                if delay and self.closing.wait(delay):
                    return
                kind = fault.kind if fault is not None else None
                if kind == "reset":
                    self._applied(fault, method, target)
                    self._forget(client, reset=True)
                    return
                if kind == "slowdown":
                    self._applied(fault, method, target)
                    client.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml"
                                   b"\r\nContent-Length: %d\r\n\r\n" % len(SLOWDOWN_BODY)
                                   + SLOWDOWN_BODY)
                    continue
                reply_head, reply_headers, reply, stays_open = upstream.exchange(request,
                                                                                 method)
                if kind == "lose_reply":  # the server acted; the client never hears
                    self._applied(fault, method, target)
                    self._forget(client, reset=True)
                    return
                if kind == "cut_body" and reply:
                    self._applied(fault, method, target)
                    client.sendall(reply_head + reply[:len(reply) // 2])
                    # a close, not a reset: a reset may discard what the client has not
                    # read yet, and the half body must arrive before the end does
                    client.shutdown(socket.SHUT_WR)
                    return
                client.sendall(reply_head + reply)
                if not stays_open or "close" in (headers.get("connection", "").lower(),
                                                 reply_headers.get("connection", "").lower()):
                    return
        except (OSError, _Closed, ValueError, IndexError):
            return  # a peer went away or spoke something that is not HTTP/1.1: drop both
        finally:
            upstream.close()
            if client.fileno() >= 0:
                self._forget(client)

    def close(self) -> None:
        """Stop accepting, drop every connection, and join the threads (bounded)."""
        if self.closing.is_set():
            return
        self.closing.set()
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.cancel()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept (Linux)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
            except OSError:
                pass
        for t in threads:
            if t is not threading.current_thread():
                t.join(JOIN_S)


def add_fault_flags(p: argparse.ArgumentParser, delay_ms: float = 0.0) -> None:
    """The network's faults as a tool's flags (tools/drills/network_drill.py,
    tools/drills/spot_soak.py): shares of requests, as the suite's drills set them."""
    p.add_argument("--lose-reply", type=float, default=0.05,
                   help="share of PUT/POST replies lost after the server acted")
    p.add_argument("--cut-body", type=float, default=0.05,
                   help="share of GET bodies cut mid-transfer")
    p.add_argument("--reset", type=float, default=0.01,
                   help="share of requests reset before they are forwarded")
    p.add_argument("--slowdown", type=float, default=0.01,
                   help="share of requests answered 503 SlowDown")
    p.add_argument("--delay-ms", type=float, default=delay_ms,
                   help="latency added to every request, in milliseconds")


def network_faults(args) -> list:
    """The proxy's ``Fault``s for the flags ``add_fault_flags`` added."""
    faults = [Fault("delay", seconds=args.delay_ms / 1e3)] if args.delay_ms else []
    return faults + [Fault("lose_reply", args.lose_reply, methods=("PUT", "POST")),
                     Fault("cut_body", args.cut_body, methods=("GET",)),
                     Fault("reset", args.reset), Fault("slowdown", args.slowdown)]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_proxy_flags(p, "HTTP server")
    p.add_argument("--fault", type=parse_fault, action="append", default=[],
                   metavar="KIND[:P[:METHODS[:SECONDS]]]",
                   help=f"a fault to inject, repeatable; KIND is one of {', '.join(FAULT_KINDS)}"
                   " (e.g. lose_reply:0.05:PUT, cut_body:0.05:GET, delay:1:any:20ms)")
    p.add_argument("--seed", type=int, default=0, help="seed of the probability rolls")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        host, port = split_target(args.target)
        proxy = FaultProxy(port, args.fault, seed=args.seed, target_host=host,
                           port=args.listen_port, duration=args.duration)
    except ValueError as exc:
        print(f"fault_proxy: {exc}", file=sys.stderr)
        return 2
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with proxy:
        print(f"fault_proxy: listening on {proxy.endpoint} -> {host}:{port}, "
              f"{len(args.fault)} fault(s), seed {args.seed}, for {args.duration:g} s",
              flush=True)
        try:
            while not done.wait(POLL_S) and not proxy.closing.is_set():
                pass
        except KeyboardInterrupt:
            pass
    print(f"fault_proxy: closed {json.dumps(proxy.stats())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
