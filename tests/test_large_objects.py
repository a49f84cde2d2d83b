"""Objects larger than one request, through a real S3 server (SeaweedFS) behind a proxy
that refuses any request body over a limit with ``EntityTooLarge``, as S3 refuses a PUT
over 5 GiB: the suite's scaled-down version of a billion-parameter model's payloads
(docs/design.md#large-objects). A fixed-size job of two ranks and an elastic job of two
members average payloads several times the limit, exactly and bit-identically, and no
request the proxy sees is larger than the limit.
"""

from __future__ import annotations

import os

import pytest
import torch

import ferrosync
from conftest import s3_storage_options
from ferrosync.errors import ShardCorrupt, StorageError
from ferrosync.storage.engines import open_storage
from ferrosync.storage.engines.parts import MIN_PART
from ferrosync.testing.fault_proxy import Fault, FaultProxy
from ranks import run_ranks

#: the largest request body the proxy lets through (a tiny "5 GiB")
LIMIT = 256 << 10
#: float32 elements per rank: 1.5 MiB of payload, six times the limit
ELEMENTS = 3 * (1 << 17)
TIMEOUT = 60.0


@pytest.fixture
def limited(seaweed_transport, seaweed_endpoint):
    """(URL, storage_options, proxy): SeaweedFS behind a proxy refusing bodies > LIMIT."""
    port = int(seaweed_endpoint.rsplit(":", 1)[1])
    with FaultProxy(port, max_body=LIMIT) as proxy:
        yield seaweed_transport.url, s3_storage_options(proxy.endpoint), proxy


def _values(index: int) -> torch.Tensor:
    # small integers times 1, 2 or 3: every average of them is exact in float32
    return (torch.arange(ELEMENTS, dtype=torch.float32) % 977) * (index + 1)


def w_fixed(rank, world, url, storage_options):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=TIMEOUT,
                           storage_options=storage_options, max_request_bytes=LIMIT,
                           part_bytes=LIMIT // 2, transfer_concurrency=4) as sync:
        out = []
        for _ in range(2):
            tensor = _values(rank)
            sync.average_([tensor])
            out.append(tensor)
        return out


def w_elastic(index, _world, url, storage_options):
    with ferrosync.connect(url, elastic=True, min_ranks=2, max_ranks=2, job="large",
                           timeout=TIMEOUT, heartbeat_interval=0.3, heartbeat_timeout=10,
                           storage_options=storage_options, max_request_bytes=LIMIT,
                           transfer_concurrency=4) as sync:
        tensor = _values(index)
        sync.average_([tensor])
        return tensor


def _expected(world: int) -> torch.Tensor:
    return sum(_values(i) for i in range(world)) / world


def _no_request_over_the_limit(proxy) -> None:
    stats = proxy.stats()
    assert stats["too_large"] == 0, stats
    assert LIMIT // 4 < stats["largest_body"] <= LIMIT, stats  # parts were sent


def test_a_fixed_size_job_averages_payloads_larger_than_a_request(limited):
    url, storage_options, proxy = limited
    results = run_ranks(w_fixed, 2, url, storage_options, timeout=180)
    expected = _expected(2)
    for out in results:
        for tensor in out:
            assert torch.equal(tensor, expected)
    _no_request_over_the_limit(proxy)


def test_an_elastic_job_averages_payloads_larger_than_a_request(limited):
    url, storage_options, proxy = limited
    results = run_ranks(w_elastic, 2, url, storage_options, timeout=180)
    expected = _expected(2)
    for tensor in results:
        assert torch.equal(tensor, expected)
    _no_request_over_the_limit(proxy)


def test_the_limit_is_real_and_a_single_put_over_it_is_refused(limited):
    url, storage_options, proxy = limited
    storage = open_storage(url, storage_options, transfer={"part_bytes": 8 << 20})
    try:
        with pytest.raises(StorageError):
            storage.put("one-request", [os.urandom(LIMIT + 1)])
        assert proxy.stats()["too_large"] >= 1
    finally:
        storage.close()


def test_a_create_in_parts_whose_last_reply_is_lost_is_ours(limited):
    """The manifest's PUT lands and its reply is lost; botocore sends it again and the
    server answers 412: the manifest there names this write's token, so it is ours."""
    url, storage_options, proxy = limited
    storage = open_storage(url, storage_options, transfer={"max_request_bytes": LIMIT})
    data = os.urandom(3 * LIMIT + 11)
    proxy.add(Fault("lose_reply", methods=("PUT",), path=r"/created(\?|$)", times=1))
    try:
        storage.put("created", [data], exclusive=True)
        assert proxy.stats()["lose_reply"] == 1
        assert storage.read("created", max_bytes=None) == data
        with pytest.raises(FileExistsError):
            storage.put("created", [os.urandom(3 * LIMIT)], exclusive=True)
        assert len(storage.list("")) == 1 + 4  # the manifest and the first write's parts
        storage.delete(["created"])
        assert storage.list("") == []
    finally:
        storage.close()


def test_objects_in_parts_on_every_store(any_object_transport):
    """The same parts and manifest through each store's own driver (s3fs on moto and
    SeaweedFS, gcsfs on fake-gcs-server, adlfs on Azurite): whole, created once,
    deleted with their parts."""
    transport = any_object_transport
    storage = open_storage(transport.url, transport.options["storage_options"],
                           transfer={"max_request_bytes": MIN_PART, "concurrency": 3})
    data = os.urandom(3 * MIN_PART + 5)
    try:
        storage.put("in-parts", [data[:100], data[100:]], exclusive=True)
        assert storage.read("in-parts", max_bytes=len(data)) == data
        assert storage.read_head("in-parts", 64) == data[:64]
        with pytest.raises(FileExistsError):
            storage.put("in-parts", [data], exclusive=True)
        assert len(storage.list("")) == 1 + 4
        storage.delete(["in-parts"])
        assert storage.list("") == []
    finally:
        storage.close()


def test_a_part_cut_mid_body_is_read_again_into_its_place(limited):
    """Each part's GET body streams straight into the caller's buffer (S3Storage
    ``_get_into``); one cut halfway is sent again and refills the same slice: the bytes
    read back are exact, and the retry is no error and no extra counted request."""
    url, storage_options, proxy = limited
    storage = open_storage(url, storage_options, transfer={"max_request_bytes": LIMIT,
                                                           "concurrency": 2})
    data = os.urandom(3 * LIMIT + 11)
    try:
        storage.put("cut", [data])
        proxy.add(Fault("cut_body", methods=("GET",), path=r"\.p1(\?|$)", times=1))
        into = bytearray(len(data))
        before = storage.counters.snapshot()
        with storage.open("cut", max_bytes=len(data)) as reader:
            assert reader.readinto(into) == len(data)
        after = storage.counters.snapshot()
        assert proxy.stats()["cut_body"] == 1
        assert into == data
        assert after["gets"] - before["gets"] == 1 + 4  # the manifest, then each part once
        assert after["bytes_read"] - before["bytes_read"] >= len(data)
    finally:
        storage.close()


def test_a_part_longer_than_its_manifest_says_is_refused(limited):
    url, storage_options, _ = limited
    half = LIMIT // 2
    storage = open_storage(url, storage_options, transfer={"max_request_bytes": LIMIT,
                                                           "part_bytes": half})
    data = os.urandom(2 * half + 1)
    try:
        storage.put("long", [data])
        (part,) = [k for k, _ in storage.list("") if k.endswith(".p0")]
        storage.fs.pipe_file(storage.fs_path(part), os.urandom(half + 1))
        with pytest.raises(ShardCorrupt, match="more than"):
            storage.read("long", max_bytes=len(data))
    finally:
        storage.close()
