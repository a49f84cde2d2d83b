"""What the suite's proxies (``fault_proxy``, ``wan_proxy``) share: the rule that they
forward to this machine only, and the command-line flags that name where to listen,
where to forward and for how long. Standard library only: the proxies run by path
(``python ferrosync/testing/fault_proxy.py``) without importing ferrosync or torch."""

from __future__ import annotations

import argparse
import ipaddress
import socket
import threading

__all__ = ["DEFAULT_DURATION", "Lifetime", "add_proxy_flags", "check_loopback", "split_target"]

#: the CLI's default lifetime: a proxy is a test instrument, never left running
DEFAULT_DURATION = 600.0

def check_loopback(host: str) -> str:
    """``host`` as a loopback IPv4 address; ValueError for anything that is not loopback
    (a proxy must never send a byte off this machine)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(
            host, None, socket.AF_INET, socket.SOCK_STREAM)}
    except socket.gaierror as exc:
        raise ValueError(f"target {host!r} does not resolve ({exc})") from None
    if not addresses or not all(ipaddress.ip_address(a).is_loopback for a in addresses):
        raise ValueError(f"target {host!r} ({', '.join(sorted(addresses))}) is not a "
                         "loopback address: the proxy only forwards to this machine "
                         "(use 127.0.0.1)")
    return "127.0.0.1" if host == "localhost" else sorted(addresses)[0]


def add_proxy_flags(p: argparse.ArgumentParser, what: str) -> None:
    """``--target``, ``--listen-port`` and ``--duration``; ``what`` names the server
    forwarded to in the help."""
    p.add_argument("--target", required=True, metavar="127.0.0.1:PORT",
                   help=f"the local {what} to forward to (loopback only)")
    p.add_argument("--listen-port", type=int, default=0, metavar="PORT",
                   help="port on 127.0.0.1 to listen on (default: a free one, printed)")
    p.add_argument("--duration", type=float, default=DEFAULT_DURATION, metavar="S",
                   help=f"exit after this many seconds (default {DEFAULT_DURATION:g})")


def split_target(target: str) -> tuple[str, int]:
    """``HOST:PORT`` as (host, port); ValueError naming the flag otherwise."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--target {target!r} is not HOST:PORT")
    return host, int(port)


class Lifetime:
    """A proxy's start, bounded life and context manager: ``start`` begins accepting
    (``_start_accepting``) and, with a ``duration``, arms a timer that calls ``close``;
    ``with proxy:`` starts it and closes it."""

    duration: float | None = None
    _timer: threading.Timer | None = None

    def _start_accepting(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def start(self):
        self._start_accepting()
        if self.duration is not None:
            self._timer = threading.Timer(self.duration, self.close)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
