"""A TCP proxy on loopback that behaves like a slow, distant link (no ``netem`` needed).

``WanProxy(target_port=..., rate_bps=..., rtt_s=...)``, or ``python -m
ferrosync.testing.wan_proxy``: one shared token-bucket link per direction, an optional
cap per connection (``connection_rate_bps``), a one-way delay of ``rtt_s / 2`` that is
latency, not lost throughput, and queues of about one bandwidth-delay product that push
back on the sender (docs/goodput.md). Loopback targets only; every wait is bounded.
"""

from __future__ import annotations

import argparse
import collections
import re
import signal
import socket
import sys
import threading
import time

if __package__:  # imported from the package, or run by path (standard library only)
    from ferrosync.testing.loopback import Lifetime, add_proxy_flags, check_loopback, split_target
else:
    from loopback import Lifetime, add_proxy_flags, check_loopback, split_target

__all__ = ["WanProxy", "parse_rate", "parse_duration", "parse_link", "check_loopback"]

#: bytes read from a socket at once: small enough that shaping is smooth at low rates
CHUNK = 16 * 1024
#: the token bucket's default depth: a few packets may leave back to back
DEFAULT_BURST = 16 * 1024
#: a queue never holds less than this (a tiny bandwidth-delay product would stall)
MIN_QUEUE = 256 * 1024
#: how often blocked threads look at the closing flag (accept, a full queue)
POLL_S = 0.2
#: seconds ``close`` waits for each thread
JOIN_S = 5.0

#: queue markers: the sender half-closed (pass it on), or its socket failed (tear down)
_EOF, _ERROR = object(), object()
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps|b)?(?:/s)?\s*$", re.I)
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_TIME = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)\s*$", re.I)
_TIME_SCALE = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_rate(text: str) -> float:
    """``"100Mbit"``, ``"1Gbit/s"``, ``"20mbps"`` (bits) or ``"12MB/s"`` (bytes, capital
    B) -> bits per second; decimal prefixes, as ``tc`` uses for bits."""
    match = _RATE.match(text)
    if not match:
        raise ValueError(f"rate {text!r}: expected e.g. 100Mbit, 1Gbit, 500kbit or 10MB/s")
    number, prefix, unit = match.groups()
    value = float(number) * _SCALE[prefix.lower()]
    if unit == "B":  # bytes per second
        value *= 8
    if value <= 0:
        raise ValueError(f"rate {text!r} must be positive")
    return value


def parse_duration(text: str) -> float:
    """``"50ms"``, ``"0.2s"``, ``"500us"`` -> seconds (a unit is required)."""
    match = _TIME.match(text)
    if not match:
        raise ValueError(f"time {text!r}: expected a number with a unit, e.g. 50ms or 0.2s")
    return float(match.group(1)) * _TIME_SCALE[match.group(2).lower()]


def parse_link(text: str) -> tuple[float | None, float]:
    """``"100Mbit/50ms"`` (RATE/RTT) -> (bits per second, seconds); ``"unlimited/0ms"``:
    no bandwidth limit (None). ValueError for anything else."""
    rate, sep, rtt = text.partition("/")
    if not sep:
        raise ValueError(f"link {text!r}: expected RATE/RTT, e.g. 100Mbit/50ms")
    return (None if rate.lower() == "unlimited" else parse_rate(rate)), parse_duration(rtt)


def _shutdown(sock: socket.socket) -> None:
    """Both directions of ``sock`` (an already shut or reset socket is fine)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Link:
    """One direction of the shared link: a token bucket (``rate_bps``, ``burst``
    bytes) that turns "received now" into "fully serialised at" for each chunk."""

    def __init__(self, rate_bps: float | None, burst: int) -> None:
        self.bytes_per_s = None if rate_bps is None else rate_bps / 8
        self.burst = burst
        self._clock = 0.0  # the bucket is empty at this time, full burst/rate later
        self._lock = threading.Lock()
        self.bytes = 0

    def departure(self, size: int, now: float) -> float:
        """When ``size`` bytes received at ``now`` have left at the link's rate."""
        with self._lock:
            self.bytes += size
            if self.bytes_per_s is None:
                return now
            # an idle link refills to at most `burst` bytes of credit
            self._clock = max(self._clock, now - self.burst / self.bytes_per_s)
            self._clock += size / self.bytes_per_s
            return max(now, self._clock)


class _Pipe:
    """One direction of one connection: a reader stamps each chunk with its release
    time (link departure + one-way delay), a writer forwards it then, in order."""

    def __init__(self, proxy: WanProxy, src: socket.socket, dst: socket.socket,
                 link: _Link, name: str) -> None:
        self.proxy, self.src, self.dst, self.link = proxy, src, dst, link
        #: this connection's own cap (a store's per-connection rate), before the link
        self.own = _Link(proxy.connection_rate_bps, proxy.burst_bytes)
        self.queue: collections.deque = collections.deque()  # (release_at, bytes | marker)
        self.queued = 0
        self.cond = threading.Condition()
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self._read, name=f"{name}-read", daemon=True),
                        threading.Thread(target=self._write, name=f"{name}-write",
                                         daemon=True)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def _read(self) -> None:
        limit = self.proxy.queue_limit
        try:
            while not self.proxy.closing.is_set():
                with self.cond:  # back-pressure: stop reading while the path is full
                    while self.queued >= limit and not self.proxy.closing.is_set():
                        self.cond.wait(POLL_S)
                data = self.src.recv(CHUNK)
                # stamped on arrival: through the connection's own cap, serialised at
                # the shared link's rate, then delayed
                capped = self.own.departure(len(data), time.monotonic())
                release = self.link.departure(len(data), capped) + self.proxy.delay_s
                with self.cond:
                    self.queue.append((release, data or _EOF))  # an EOF follows the data
                    self.queued += len(data)
                    self.cond.notify_all()
                if not data:
                    return
        except OSError:
            pass
        # the source failed (a reset) or the proxy is closing: end the connection
        with self.cond:
            self.queue.append((0.0, _ERROR))
            self.cond.notify_all()

    def _write(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.queue and not self.proxy.closing.is_set():
                        self.cond.wait(POLL_S)
                    if self.proxy.closing.is_set():
                        return
                    release, data = self.queue[0]
                # wait until the chunk has crossed the link; woken early only by close
                wait = release - time.monotonic()
                if wait > 0 and self.proxy.closing.wait(wait):
                    return
                if data is _EOF:  # the sender half-closed: pass it on, after the data
                    self.dst.shutdown(socket.SHUT_WR)
                    return
                if data is _ERROR:
                    self._tear_down()
                    return
                self.dst.sendall(data)
                with self.cond:
                    self.queue.popleft()
                    self.queued -= len(data)
                    self.cond.notify_all()
        except OSError:
            self._tear_down()  # the receiver is gone: so is the connection
        finally:
            self.done.set()

    def _tear_down(self) -> None:
        """End both sockets of the connection (wakes the other direction's reader)."""
        _shutdown(self.src)
        _shutdown(self.dst)


class WanProxy(Lifetime):
    """Forward 127.0.0.1:``port`` to 127.0.0.1:``target_port`` through a slow link.

    Args:
        target_port: the local server to forward to.
        rate_bps: bits per second in each direction, shared by all connections
            (None: unlimited).
        connection_rate_bps: bits per second in each direction of each connection,
            on top of the shared rate, as an object store serves each connection
            (None: unlimited).
        rtt_s: round-trip time to add; each direction delays by half of it.
        target_host: must be a loopback address (ValueError otherwise).
        port: where to listen on 127.0.0.1 (0: a free port, see ``.port``).
        burst_bytes: the token bucket's depth.
        duration: close by itself after this many seconds (None: only on ``close``).
    """

    def __init__(self, target_port: int, *, rate_bps: float | None = None,
                 rtt_s: float = 0.0, target_host: str = "127.0.0.1", port: int = 0,
                 burst_bytes: int = DEFAULT_BURST, duration: float | None = None,
                 connection_rate_bps: float | None = None) -> None:
        for name, rate in (("rate_bps", rate_bps), ("connection_rate_bps", connection_rate_bps)):
            if rate is not None and rate <= 0:
                raise ValueError(f"{name} must be positive or None, got {rate}")
        if rtt_s < 0:
            raise ValueError(f"rtt_s must be >= 0, got {rtt_s}")
        if duration is not None and duration <= 0:
            raise ValueError(f"duration must be positive or None, got {duration}")
        self.target = (check_loopback(target_host), int(target_port))
        self.rate_bps, self.rtt_s, self.delay_s = rate_bps, rtt_s, rtt_s / 2
        self.connection_rate_bps, self.burst_bytes = connection_rate_bps, burst_bytes
        self.duration = duration
        # about one bandwidth-delay product in flight per direction, like a TCP window
        slowest = min((r for r in (rate_bps, connection_rate_bps) if r is not None),
                      default=None)
        bdp = 0 if slowest is None else int(slowest / 8 * max(rtt_s, 0.01))
        self.queue_limit = max(MIN_QUEUE, 2 * bdp)
        self.up = _Link(rate_bps, burst_bytes)  # client -> server
        self.down = _Link(rate_bps, burst_bytes)  # server -> client
        self.closing = threading.Event()
        self.closed = threading.Event()
        self.connections = 0
        self._pipes: list[_Pipe] = []
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", port))
        self._listener.listen(128)
        self._listener.settimeout(POLL_S)  # accept looks at the closing flag this often
        self.port = self._listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept, name="wan-proxy-accept",
                                          daemon=True)
        self._timer: threading.Timer | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _start_accepting(self) -> None:
        self._acceptor.start()

    def wait_closed(self, timeout: float) -> bool:
        """True once the proxy has closed (``close`` or ``duration``), within ``timeout``."""
        return self.closed.wait(timeout)

    def stats(self) -> dict:
        """Bytes that entered each direction of the link, and connections accepted."""
        return {"bytes_up": self.up.bytes, "bytes_down": self.down.bytes,
                "connections": self.connections}

    def _accept(self) -> None:
        while not self.closing.is_set():
            try:
                client, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()  # the client sees a closed connection, as from a dead server
                continue
            for s in (client, server):
                s.settimeout(None)
                # Nagle would hold small requests back: the only added latency is ours
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            n = self.connections = self.connections + 1
            pipes = [_Pipe(self, client, server, self.up, f"wan-proxy-{n}-up"),
                     _Pipe(self, server, client, self.down, f"wan-proxy-{n}-down")]
            with self._lock:
                if self.closing.is_set():
                    client.close()
                    server.close()
                    return
                self._pipes.extend(pipes)
                self._sockets.extend((client, server))
            for p in pipes:
                p.start()
            threading.Thread(target=self._reap, args=(pipes, client, server),
                             name=f"wan-proxy-{n}-reap", daemon=True).start()

    def _reap(self, pipes: list[_Pipe], client: socket.socket, server: socket.socket) -> None:
        """Close a connection's sockets once both directions have finished."""
        for p in pipes:
            while not p.done.wait(POLL_S):
                if self.closing.is_set():
                    return  # close() takes care of the sockets
        with self._lock:
            # writers also finish because close() began: then close() owns the sockets
            # (closing a socket here would not wake a reader blocked on it; shutdown does)
            if self.closing.is_set():
                return
            for s in (client, server):
                self._sockets.remove(s)
                _shutdown(s)
                s.close()
            for p in pipes:
                if p in self._pipes:
                    self._pipes.remove(p)

    def close(self) -> None:
        """Stop accepting, drop every connection, and join the threads (bounded)."""
        if self.closing.is_set():
            self.closed.wait(JOIN_S * 2)
            return
        self.closing.set()
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.cancel()
        if self._acceptor.is_alive() and self._acceptor is not threading.current_thread():
            self._acceptor.join(JOIN_S)
        self._listener.close()
        with self._lock:
            pipes, sockets = list(self._pipes), list(self._sockets)
            self._pipes.clear()
            self._sockets.clear()
        for s in sockets:
            _shutdown(s)  # wakes a reader blocked in recv, and the peer sees the end
        for p in pipes:
            p.wake()
        for p in pipes:
            for t in p.threads:
                if t.is_alive():
                    t.join(JOIN_S)
        for s in sockets:
            s.close()
        self.closed.set()


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_proxy_flags(p, "server")
    p.add_argument("--rate", type=parse_rate, default=None, metavar="RATE",
                   help="bandwidth per direction, e.g. 100Mbit, 1Gbit (default: unlimited)")
    p.add_argument("--connection-rate", type=parse_rate, default=None, metavar="RATE",
                   help="bandwidth per direction of each connection, beside the shared "
                   "--rate, as an object store serves each connection (default: unlimited)")
    p.add_argument("--rtt", type=parse_duration, default=0.0, metavar="TIME",
                   help="round-trip time to add, e.g. 50ms (half each way; default 0)")
    p.add_argument("--burst", type=int, default=DEFAULT_BURST, metavar="BYTES",
                   help=f"token bucket depth in bytes (default {DEFAULT_BURST})")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        host, port = split_target(args.target)
        proxy = WanProxy(port, rate_bps=args.rate, rtt_s=args.rtt, target_host=host,
                         port=args.listen_port, burst_bytes=args.burst,
                         duration=args.duration, connection_rate_bps=args.connection_rate)
    except ValueError as exc:
        print(f"wan_proxy: {exc}", file=sys.stderr)
        return 2
    # SIGTERM ends it as cleanly as the duration does
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=proxy.close).start())
    rate = "unlimited" if args.rate is None else f"{args.rate / 1e6:g} Mbit/s"
    if args.connection_rate is not None:
        rate += f" ({args.connection_rate / 1e6:g} Mbit/s per connection)"
    with proxy:
        print(f"wan_proxy: listening on 127.0.0.1:{proxy.port} -> "
              f"{proxy.target[0]}:{proxy.target[1]}, {rate}, rtt {args.rtt * 1e3:g} ms, "
              f"for {args.duration:g} s", flush=True)
        try:
            proxy.wait_closed(args.duration + JOIN_S * 4)
        except KeyboardInterrupt:
            pass
    print(f"wan_proxy: closed ({proxy.stats()})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
