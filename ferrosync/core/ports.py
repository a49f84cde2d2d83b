"""The loopback address local servers and rendezvous listen on, and free ports on it:
the launcher's rendezvous port, the test servers' and proxies' ports. Standard library
only."""

from __future__ import annotations

import socket

__all__ = ["LOOPBACK", "free_port", "free_ports"]

#: the one address servers, proxies and local rendezvous listen on
LOOPBACK = "127.0.0.1"


def free_ports(n: int, host: str = LOOPBACK) -> list[int]:
    """``n`` distinct TCP ports on ``host`` that nothing listens on now (all held open
    until every one is chosen; as torchrun --standalone picks its port, another program
    could still take one before its user binds it)."""
    socks = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def free_port(host: str = LOOPBACK) -> int:
    """One port of ``free_ports``."""
    return free_ports(1, host)[0]
