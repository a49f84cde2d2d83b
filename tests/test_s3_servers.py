"""S3 on two real servers (moto and SeaweedFS): conditional writes, error paths, and
the test server itself staying on loopback.

Exclusive create is one PUT with ``If-None-Match: *``; a server that knows the key
answers 412 Precondition Failed, which ``put(..., exclusive=True)`` turns into
``FileExistsError``. Both servers honour it, also under a race of processes.
"""

from __future__ import annotations

import os
import socket

import pytest

from conftest import BUCKET, s3_storage_options
from ferrosync.errors import StorageError
from ferrosync.storage.engines import open_storage
from ferrosync.storage.engines.s3 import S3Storage
from ranks import context, run_ranks

ROUNDS = 20


def storage_of(transport):
    return open_storage(transport.url, transport.options["storage_options"])


# -- exclusive create ------------------------------------------------------------------------

def w_race(rank, world, url, storage_options, keys, barrier):
    """Every rank creates every key exclusively, all at once; returns the keys it won."""
    storage = open_storage(url, storage_options)
    won = []
    for key in keys:
        barrier.wait(timeout=60)
        try:
            storage.put(key, [f"rank {rank}".encode()], exclusive=True)
            won.append(key)
        except FileExistsError:
            pass
    return won


def test_racing_processes_create_one_key_exactly_once(seaweed_transport):
    """SeaweedFS only: moto checks If-None-Match and stores the object in two steps
    without a lock (moto/s3/responses.py, 5.x), so two of its server threads can both
    create a key; under a loaded machine this test caught exactly that. A real S3 server
    decides a conditional put atomically, which is what this test holds us to."""
    world = 3
    keys = [f"race/k{i}" for i in range(ROUNDS)]
    barrier = context().Barrier(world)
    won = run_ranks(w_race, world, seaweed_transport.url,
                    seaweed_transport.options["storage_options"], keys, barrier, timeout=120)
    storage = storage_of(seaweed_transport)
    for key in keys:
        winners = [rank for rank in range(world) if key in won[rank]]
        assert len(winners) == 1, (key, winners)
        assert storage.read(key) == f"rank {winners[0]}".encode()


def test_exclusive_put_refuses_an_existing_key_in_one_request(any_s3_transport):
    storage = storage_of(any_s3_transport)
    assert storage.put("once", [b"first"], exclusive=True) == 5
    assert storage.counters.snapshot()["requests"] == 1
    with pytest.raises(FileExistsError) as info:
        storage.put("once", [b"second"], exclusive=True)
    assert info.value.filename == f"{any_s3_transport.url}/once"
    assert storage.read("once") == b"first"
    storage.put("once", [b"third"])  # a plain put still overwrites
    assert storage.read("once") == b"third"


def test_a_create_that_already_landed_is_ours(any_s3_transport):
    """A 412 over our own bytes is our success (our first PUT landed and only its answer
    got lost: aiohttp or botocore sent it again), whoever retried; over other bytes it
    is someone else's. tests/faults/test_network_storage.py loses the reply for real."""
    storage = storage_of(any_s3_transport)
    storage.put("landed", [b"mine"], exclusive=True)
    storage.put("landed", [b"mine"], exclusive=True)  # same bytes: ours
    with pytest.raises(FileExistsError):
        storage.put("landed", [b"other"], exclusive=True)


def test_inspect_reads_a_header_not_the_object(seaweed_transport):
    """``inspect --objects`` reads each data object's header and MAC in one ranged GET:
    O(1) bytes whatever the object's size (a whole-object read cost 2.3 GiB of RSS for
    a 1 GiB object)."""
    import torch

    from ferrosync.ops.inspect import object_report
    from ferrosync.storage.wire import (
        DTYPE_CODES,
        HEADER_SIZE,
        KIND_CONTRIB,
        MAC_SIZE,
        Header,
        seal,
    )

    storage = storage_of(seaweed_transport)
    payload = bytes(8 << 20)
    count = len(payload) // 4
    header = Header(kind=KIND_CONTRIB, dtype=DTYPE_CODES[torch.float32], codec=0, rank=1,
                    world_size=2, generation=5, collective=3, count=count, offset=0,
                    total=count, weight=1.0, layout=b"\1" * 8, payload_nbytes=len(payload))
    head = seal(header, [payload], b"k" * 32)
    storage.put("g/c3.r1", [head, payload])
    before = storage.counters.snapshot()
    report = object_report(storage, "g/c3.r1", len(head) + len(payload), "contribution")
    after = storage.counters.snapshot()
    assert after["gets"] - before["gets"] == 1
    assert after["bytes_read"] - before["bytes_read"] == HEADER_SIZE + MAC_SIZE
    assert report["header"]["rank"] == 1 and report["header"]["collective"] == 3
    assert report["header"]["authenticated"] and report["header"]["size_matches"]
    assert object_report(storage, "g/c4.r1", 0, "contribution")["header"].startswith("gone")


def test_exclusive_put_refuses_to_degrade_to_an_overwrite(any_s3_transport, monkeypatch):
    # as with a botocore before 1.35.20, which s3fs would let drop IfNoneMatch silently
    monkeypatch.setattr(S3Storage, "_if_none_match", False)
    storage = storage_of(any_s3_transport)
    with pytest.raises(StorageError) as info:
        storage.put("never", [b"x"], exclusive=True)
    assert info.value.path == f"{any_s3_transport.url}/never"
    assert "botocore" in info.value.hint
    assert storage.read("never") is None


# -- error messages ---------------------------------------------------------------------------

def test_storage_errors_name_the_url_once(seaweed_transport):
    """SeaweedFS checks signatures (moto does not): a wrong secret fails every request."""
    options = dict(seaweed_transport.options["storage_options"], secret="wrong")
    storage = open_storage(seaweed_transport.url, options)
    calls = {
        "put": lambda: storage.put("a/b", [b"x"]),
        "create": lambda: storage.put("a/b", [b"x"], exclusive=True),
        "open": lambda: storage.open("a/b"),
        "delete": lambda: storage.delete(["a/b", "a/c"]),
        "list": lambda: storage.list("a"),
    }
    for name, call in calls.items():
        with pytest.raises(StorageError) as info:
            call()
        text = str(info.value)
        assert info.value.path.startswith(f"{seaweed_transport.url}/a"), (name, text)
        assert text.count(BUCKET) == 1, (name, text)  # was s3://bkt/run/bkt/run/a/b
        assert "credentials" in text, (name, text)


# -- the SeaweedFS server itself --------------------------------------------------------------

def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on, from /proc."""
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = local.split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((socket.inet_ntop(family, raw), int(hex_port, 16)))
    return sorted(found, key=lambda a: a[1])


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs Linux /proc")
def test_seaweed_listens_on_loopback_only_on_its_ports(seaweed_server):
    sockets = listening_sockets(seaweed_server.proc.pid)
    assert sockets, "no listening socket found"
    assert {address for address, _ in sockets} == {"127.0.0.1"}, sockets
    assert {port for _, port in sockets} == set(seaweed_server.ports.values()), sockets


def test_seaweed_needs_the_configured_identity(seaweed_endpoint):
    options = s3_storage_options(seaweed_endpoint)
    options["key"] = "nobody"
    with pytest.raises(StorageError, match="access denied"):
        open_storage(f"s3://{BUCKET}/anon", options).put("x", [b"x"])
