"""ferrosync/testing/wan_proxy.py: the slow-link proxy shapes bandwidth, adds latency, stays local.

Every test runs real TCP servers on 127.0.0.1 (an echo server and a sink that answers
with the byte count it received) and measures through the proxy with a wall clock.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from ferrosync.testing import fault_proxy, loopback, wan_proxy
from ferrosync.testing.wan_proxy import WanProxy, parse_duration, parse_link, parse_rate

IO_TIMEOUT = 10.0  # seconds any socket operation in these tests may block


class _Server:
    """A threaded TCP server on 127.0.0.1: ``echo`` sends back what it reads; ``sink``
    reads until EOF, then answers with the decimal count of bytes it received."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(IO_TIMEOUT)
        self.port = self.sock.getsockname()[1]
        self.threads: list[threading.Thread] = []
        self.stopping = False
        self.acceptor = threading.Thread(target=self._accept, daemon=True)
        self.acceptor.start()

    def _accept(self) -> None:
        while not self.stopping:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(IO_TIMEOUT)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            total = 0
            try:
                while data := conn.recv(65536):
                    total += len(data)
                    if self.mode == "echo":
                        conn.sendall(data)
                if self.mode == "sink":
                    conn.sendall(str(total).encode())
            except OSError:
                pass

    def close(self) -> None:
        self.stopping = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept (Linux)
        except OSError:
            pass
        self.sock.close()
        self.acceptor.join(IO_TIMEOUT)
        for t in self.threads:
            t.join(IO_TIMEOUT)


@pytest.fixture
def echo():
    server = _Server("echo")
    yield server
    server.close()


@pytest.fixture
def sink():
    server = _Server("sink")
    yield server
    server.close()


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _upload(port: int, size: int) -> float:
    """Send ``size`` bytes to the sink through ``port``; seconds until its answer."""
    payload = os.urandom(size)
    with _connect(port) as s:
        start = time.perf_counter()
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        answer = b""
        while data := s.recv(64):
            answer += data
        elapsed = time.perf_counter() - start
    assert int(answer) == size, "the sink did not receive every byte"
    return elapsed


def _uploads_at_once(port: int, size: int, n: int) -> list[float]:
    """``n`` uploads of ``size`` bytes started together: each one's seconds."""
    times: list[float] = []
    threads = [threading.Thread(target=lambda: times.append(_upload(port, size)))
               for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(IO_TIMEOUT)
    return times


def _round_trip(s: socket.socket, message: bytes = b"ping") -> float:
    start = time.perf_counter()
    s.sendall(message)
    got = b""
    while len(got) < len(message):
        chunk = s.recv(64)
        assert chunk, f"the connection closed after {got!r}"  # not a busy loop on EOF
        got += chunk
    assert got == message
    return time.perf_counter() - start


@pytest.mark.unit
def test_parse_rate_and_time():
    assert parse_rate("100Mbit") == 100e6
    assert parse_rate("1Gbit/s") == 1e9
    assert parse_rate("500kbit") == 500e3
    assert parse_rate("10MB/s") == 80e6  # capital B: bytes
    assert parse_duration("50ms") == pytest.approx(0.05)
    assert parse_duration("0.2s") == pytest.approx(0.2)
    for bad in ("fast", "-1Mbit", "0Mbit"):
        with pytest.raises(ValueError):
            parse_rate(bad)
    with pytest.raises(ValueError, match="unit"):
        parse_duration("50")  # no unit: ambiguous


@pytest.mark.unit
def test_parse_link():
    """The benchmarks' RATE/RTT (bench_goodput, bench_topk)."""
    assert parse_link("100Mbit/50ms") == (100e6, pytest.approx(0.05))
    assert parse_link("unlimited/0ms") == (None, 0.0)
    for bad in ("100Mbit", "fast/50ms", "100Mbit/50"):
        with pytest.raises(ValueError):
            parse_link(bad)


@pytest.mark.timing
@pytest.mark.unit
def test_throughput_matches_the_rate(sink):
    size, rate = 4_000_000, 20e6  # 1.6 s at 20 Mbit/s
    with WanProxy(sink.port, rate_bps=rate, rtt_s=0.0) as proxy:
        elapsed = _upload(proxy.port, size)
        assert proxy.stats()["bytes_up"] == size
    measured = size * 8 / elapsed
    assert 0.75 * rate <= measured <= 1.25 * rate, f"{measured / 1e6:.1f} Mbit/s"


@pytest.mark.timing
@pytest.mark.unit
def test_each_connection_is_capped_beside_the_shared_link(sink):
    """With each connection capped at a quarter of the link, one upload gets a quarter
    of the link and four at once fill it: four take about as long as one."""
    size, rate = 500_000, 40e6
    with WanProxy(sink.port, rate_bps=rate, connection_rate_bps=rate / 4) as proxy:
        one = _upload(proxy.port, size)
        times = _uploads_at_once(proxy.port, size, 4)
        assert proxy.stats()["connections"] == 5
    alone = size * 8 / (rate / 4)  # 0.4 s: the connection's cap, not the link's rate
    assert 0.75 * alone <= one <= 1.25 * alone, one
    assert len(times) == 4
    assert 0.75 * alone <= max(times) <= 1.25 * alone * 1.25, times  # the link is not the limit


@pytest.mark.timing
@pytest.mark.unit
def test_connections_share_the_link(sink):
    """Two uploads at once take as long as their sum at the rate: one link, not two."""
    size, rate = 1_000_000, 20e6
    with WanProxy(sink.port, rate_bps=rate) as proxy:
        times = _uploads_at_once(proxy.port, size, 2)
        assert proxy.stats()["connections"] == 2
    assert len(times) == 2
    expected = 2 * size * 8 / rate  # 0.8 s for both together
    assert 0.75 * expected <= max(times) <= 1.25 * expected, times


@pytest.mark.timing
@pytest.mark.unit
def test_round_trip_time_is_added(echo):
    rtt = 0.1
    with WanProxy(echo.port, rate_bps=100e6, rtt_s=rtt) as proxy, _connect(proxy.port) as s:
        samples = sorted(_round_trip(s) for _ in range(5))
    assert samples[0] >= rtt, samples  # never faster than the set RTT
    assert samples[len(samples) // 2] <= rtt + 0.03, samples  # and not far above it


@pytest.mark.timing
@pytest.mark.unit
def test_latency_does_not_throttle_a_long_transfer(sink):
    """Delay is latency: 4 MB with a 200 ms RTT takes size/rate + a one-way delay,
    not a delay per chunk (which would take minutes)."""
    size, rate, rtt = 4_000_000, 40e6, 0.2  # 0.8 s of serialisation
    with WanProxy(sink.port, rate_bps=rate, rtt_s=rtt) as proxy:
        elapsed = _upload(proxy.port, size)
    # data reaches the sink after rtt/2, its answer comes back after another rtt/2
    expected = size * 8 / rate + rtt
    assert expected * 0.9 <= elapsed <= expected * 1.25, (elapsed, expected)


def test_refuses_targets_off_this_machine():
    for host in ("8.8.8.8", "192.168.1.1", "10.0.0.1"):
        with pytest.raises(ValueError, match="not a loopback"):
            WanProxy(80, target_host=host)
    # the CLI says so in one line and exits 2 (run by its path: no torch to import)
    result = subprocess.run(
        [sys.executable, wan_proxy.__file__, "--target", "8.8.8.8:80",
         "--duration", "1"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "not a loopback address" in result.stderr


@pytest.mark.timing
@pytest.mark.unit
def test_stops_at_its_duration(echo):
    proxy = WanProxy(echo.port, duration=0.5).start()
    with _connect(proxy.port) as s:  # a connection open at the deadline is dropped too
        assert _round_trip(s) < 1.0
        assert proxy.wait_closed(timeout=5.0), "the proxy outlived its duration"
        s.settimeout(2.0)
        try:
            assert s.recv(1) == b""
        except ConnectionResetError:
            pass
    with pytest.raises(OSError):
        _connect(proxy.port).close()
    assert all(not t.is_alive() for t in threading.enumerate()
               if t.name.startswith("wan-proxy-") and not t.name.endswith("-reap"))


def test_cli_forwards_then_exits_at_its_duration(echo):
    proc = subprocess.Popen(
        [sys.executable, "-m", "ferrosync.testing.wan_proxy", "--target",
         f"127.0.0.1:{echo.port}", "--rate", "50Mbit", "--rtt", "20ms", "--duration", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()  # printed once it listens
        assert "listening on 127.0.0.1:" in first, first
        port = int(first.split("127.0.0.1:")[1].split()[0])
        with _connect(port) as s:
            assert _round_trip(s) >= 0.02
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)
    assert loopback.DEFAULT_DURATION > 0  # the CLI is always bounded in time


def test_the_cli_refuses_a_target_off_this_machine():
    # by its path: the standard library is all it imports (not ferrosync, nor torch)
    done = subprocess.run([sys.executable, fault_proxy.__file__, "--target", "192.0.2.1:80",
                           "--duration", "1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "loopback" in done.stderr
