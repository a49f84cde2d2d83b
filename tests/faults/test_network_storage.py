"""Each object store's engine through a lossy network: every fault is scripted on one
request, so each test knows which request met it (``ferrosync.testing.fault_proxy``
between the real fsspec driver and the suite's real server).

A lost reply is never an error of its own: a create that landed is recognised as ours
by its bytes, whoever sent it again; a cut body, a reset and a 503 are retried.
"""

from __future__ import annotations

import uuid

import pytest
from lossy import lossy_proxy, through

from ferrosync.storage.engines import open_storage
from ferrosync.testing.fault_proxy import Fault


@pytest.fixture(params=["s3-seaweed", "gs", "az"])
def proxied(request):
    """(storage through a proxy with no faults yet, the proxy), on each object store's
    real server (SeaweedFS for S3: the engine is moto's too)."""
    from conftest import OBJECT_TRANSPORTS

    server = request.getfixturevalue(OBJECT_TRANSPORTS[request.param])
    proxy = lossy_proxy(server, faults=())
    transport = through(server, proxy)
    storage = open_storage(transport.url, transport.options["storage_options"], timeout=60)
    yield storage, proxy
    proxy.close()


def _name(what: str) -> str:
    return f"{what}-{uuid.uuid4().hex[:8]}"


def test_a_create_whose_reply_is_lost_is_ours(proxied):
    storage, proxy = proxied
    key = _name("created")
    # the next PUT (S3, Azure) or POST (a GCS upload, its name in the body)
    proxy.add(Fault("lose_reply", methods=("PUT", "POST"), times=1))
    assert storage.put(key, [b"mine, ", b"in two parts"], exclusive=True) == 18
    assert proxy.stats()["lose_reply"] == 1
    assert storage.read(key) == b"mine, in two parts"
    # someone else's bytes at the name are still someone else's
    with pytest.raises(FileExistsError):
        storage.put(key, [b"not mine"], exclusive=True)
    # a create that finds a longer object holding our bytes as its prefix is not ours
    with pytest.raises(FileExistsError):
        storage.put(key, [b"mine, "], exclusive=True)


def test_a_plain_put_whose_reply_is_lost_lands_once(proxied):
    storage, proxy = proxied
    key = _name("overwritten")
    proxy.add(Fault("lose_reply", methods=("PUT", "POST"), times=1))
    storage.put(key, [b"v1"])
    assert proxy.stats()["lose_reply"] == 1
    assert storage.read(key) == b"v1"


def test_a_body_cut_mid_transfer_is_read_again(proxied):
    storage, proxy = proxied
    key = _name("cut")
    data = bytes(range(256)) * 64
    storage.put(key, [data])
    proxy.add(Fault("cut_body", methods=("GET",), path=key, times=1))
    assert storage.read(key, max_bytes=len(data)) == data
    assert proxy.stats()["cut_body"] == 1
    proxy.add(Fault("cut_body", methods=("GET",), path=key, times=1))
    assert storage.read_head(key, 100) == data[:100]


def test_resets_and_slowdowns_are_retried(proxied):
    storage, proxy = proxied
    key = _name("busy")
    # azure-storage-blob waits 15 s (+-3) before it retries a 503: its SlowDown is
    # tried by tools/drills/network_drill.py, not here
    kinds = ("reset",) if storage.url.startswith("az://") else ("reset", "slowdown")
    for kind in kinds:
        proxy.add(Fault(kind, path=key, times=1))  # the put
        storage.put(key, [kind.encode()], exclusive=kind == "reset")
        proxy.add(Fault(kind, path=key, times=1))  # the read
        assert storage.read(key) == kind.encode()
    assert [proxy.stats()[kind] for kind in kinds] == [2] * len(kinds)
