"""Putting a fault proxy (``ferrosync.testing.fault_proxy``) in front of a suite server.

Shared by the tests under tests/faults/ that run through a lossy network: the proxy
sits between the client and the real server the session fixture started, and the
transport's options are rewritten to reach the server through it.
"""

from __future__ import annotations

import json
import re

from conftest import Transport
from ferrosync.testing.fault_proxy import Fault, FaultProxy

_ENDPOINT = re.compile(r"http://127\.0\.0\.1:(\d+)")

#: the loss rates of the drills through the proxy: 5 % of PUT (and POST: GCS uploads,
#: S3 multi-deletes) replies lost after the server acted, 5 % of GET bodies cut, 1 %
#: of requests reset before they reach the server, 1 % answered 503 SlowDown
LOSSY = (Fault("lose_reply", 0.05, methods=("PUT", "POST")),
         Fault("cut_body", 0.05, methods=("GET",)),
         Fault("reset", 0.01),
         Fault("slowdown", 0.01))


def server_port(transport: Transport) -> int:
    """The port of the loopback server ``transport``'s options point at."""
    found = set(_ENDPOINT.findall(json.dumps(transport.options)))
    assert len(found) == 1, f"expected one loopback endpoint in {transport.options}"
    return int(found.pop())


def through(transport: Transport, proxy: FaultProxy) -> Transport:
    """``transport`` reaching its server through ``proxy``."""
    port = server_port(transport)
    text = json.dumps(transport.options).replace(f"http://127.0.0.1:{port}", proxy.endpoint)
    return Transport(transport.name, transport.url, json.loads(text))


def lossy_proxy(transport: Transport, seed: int = 0, faults=LOSSY) -> FaultProxy:
    """A started proxy in front of ``transport``'s server, with ``faults`` (fresh
    copies: a ``Fault`` counts down its ``times``)."""
    copies = [Fault(f.kind, f.probability, f.methods, f.path, f.header, f.times, f.seconds)
              for f in faults]
    return FaultProxy(server_port(transport), copies, seed=seed).start()
