"""The backend contract: the same collectives, checked the same way on every transport.

Every test runs real processes (one per rank) against the ``case`` matrix in
conftest.py, and asserts two things: every rank ends with bit-identical tensors,
and they match a single-process float64 reference within the dtype's tolerance.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist

import ferrosync
from conftest import PG_INIT
from ferrosync.storage import names
from ferrosync.storage.engines import open_storage
from ranks import run_ranks, wait_until

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def make_tensors(rank: int, seed: int = 0) -> list[torch.Tensor]:
    """Per-rank inputs covering dtypes, shapes, an empty and a non-contiguous tensor."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return [
        torch.randn(7, 5, generator=g),
        (torch.randn(300, generator=g) * 4).to(torch.float16),
        torch.randn(2, 3, 4, generator=g).to(torch.bfloat16),
        torch.randn(11, generator=g, dtype=torch.float64),
        torch.randn(0, generator=g),
        torch.randn(4, 3, generator=g).t(),  # non-contiguous view
        torch.tensor(3.5) * (rank + 1),  # 0-d
    ]


def reference(world: int, weights: list[float], seed: int = 0) -> list[torch.Tensor]:
    per_rank = [make_tensors(r, seed) for r in range(world)]
    total = sum(weights)
    out = []
    for i, first in enumerate(per_rank[0]):
        if total == 0:
            out.append(first.clone())
            continue
        acc = sum(w * per_rank[r][i].to(torch.float64) for r, w in enumerate(weights))
        out.append((acc / total).to(first.dtype))
    return out


def assert_bit_identical(per_rank: list[list[torch.Tensor]]) -> None:
    first = per_rank[0]
    for rank, tensors in enumerate(per_rank[1:], start=1):
        assert len(tensors) == len(first)
        for i, (a, b) in enumerate(zip(first, tensors)):
            assert a.dtype == b.dtype and a.shape == b.shape, (rank, i)
            assert torch.equal(a.contiguous().view(-1).view(torch.uint8),
                               b.contiguous().view(-1).view(torch.uint8)), (
                f"rank {rank} differs from rank 0 in tensor {i}")


def connect(case_url, rank, world, options, **extra):
    options = {**options, **extra}
    if options.pop("elastic", False):
        # the elastic case: a member joins once the worker before it holds its place in
        # the join queue, so the founding roster lists the members in worker order and
        # every rank-indexed check below holds (the roster orders members, not connect)
        if rank:
            entry = os.path.join(case_url, f"el.{options['job']}", names.elastic_join(rank - 1))
            wait_until(lambda: os.path.exists(entry), timeout=60, what=entry)
        sync = ferrosync.connect(case_url, elastic=True, min_ranks=world, max_ranks=world,
                                 timeout=60, **options)
        assert (sync.rank, sync.world_size) == (rank, world), (sync.rank, rank)
        return sync
    pg_init = options.pop(PG_INIT, None)
    if pg_init is not None and not dist.is_initialized():
        # the "pg" case: TorchDistSync over ferrosync's own torch.distributed backend
        dist.init_process_group("ferrosync", init_method=pg_init, rank=rank, world_size=world)
    if "local_world_size" in options:  # the two-level case: consecutive ranks per node
        options.setdefault("local_rank", rank % options["local_world_size"])
    return ferrosync.connect(case_url, rank=rank, world_size=world, timeout=60, **options)


# -- workers (run in the rank processes) ---------------------------------------------------

def w_average(rank, world, url, options, weights, seed=0, calls=1):
    tensors = make_tensors(rank, seed)
    with connect(url, rank, world, options) as sync:
        for _ in range(calls):
            tensors = make_tensors(rank, seed)
            total = sync.average_(tensors, weight=weights[rank])
        return total, tensors, sync.stats


def w_model(rank, world, url, options):
    torch.manual_seed(0)  # same initial parameters on every rank
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    grads_before = [p.grad.clone() for p in model.parameters()]
    with connect(url, rank, world, options) as sync:
        sync.average_gradients(model)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(rank)  # make the parameters differ per rank
        sync.average_parameters(model)
    return grads_before, [p.grad for p in model.parameters()], [p.detach() for p in
                                                                 model.parameters()]


def w_broadcast(rank, world, url, options):
    seen = []
    with connect(url, rank, world, options) as sync:
        for src in range(world):
            tensors = [
                torch.full((3, 2), float(rank)),
                torch.arange(5, dtype=torch.int64) * (rank + 1),
                torch.tensor([rank % 2 == 0, True]),
                torch.full((4,), rank, dtype=torch.bfloat16),
            ]
            sync.broadcast_(tensors, src=src)
            seen.append(tensors)
    return seen


def w_many(rank, world, url, options, steps):
    x = torch.full((1000,), float(rank))
    with connect(url, rank, world, options) as sync:
        for step in range(steps):
            x.fill_(rank + step)
            sync.average_(x)
            if step % 7 == 0:
                sync.barrier()
        where = getattr(sync, "generation_url", None)
        if where is None:  # an elastic job's namespace
            where = os.path.join(url, f"el.{options['job']}")
        return x, sync.stats, where


# -- tests -----------------------------------------------------------------------------------

def test_average_is_exact_and_bit_identical(case):
    weights = [1.0] * case.world_size
    results = run_ranks(w_average, case.world_size, case.url, case.options, weights)
    totals = [r[0] for r in results]
    assert totals == [float(case.world_size)] * case.world_size
    per_rank = [r[1] for r in results]
    assert_bit_identical(per_rank)
    for got, want in zip(per_rank[0], reference(case.world_size, weights)):
        torch.testing.assert_close(got, want)


def test_weighted_average_sum_and_count(case):
    weights = [0.0, 3.0, 1.0, 0.5, 2.0][: case.world_size]
    if case.world_size == 1:
        weights = [2.5]
    results = run_ranks(w_average, case.world_size, case.url, case.options, weights, seed=1)
    assert all(r[0] == sum(weights) for r in results)
    per_rank = [r[1] for r in results]
    assert_bit_identical(per_rank)
    for got, want in zip(per_rank[0], reference(case.world_size, weights, seed=1)):
        torch.testing.assert_close(got, want)


def test_all_zero_weights_leave_tensors_unchanged(case):
    weights = [0.0] * case.world_size
    results = run_ranks(w_average, case.world_size, case.url, case.options, weights, seed=2)
    for rank, (total, tensors, _stats) in enumerate(results):
        assert total == 0.0
        for got, want in zip(tensors, make_tensors(rank, seed=2)):
            assert torch.equal(got, want)


def test_average_gradients_and_parameters(case):
    results = run_ranks(w_model, case.world_size, case.url, case.options)
    grads_before = [r[0] for r in results]
    assert_bit_identical([r[1] for r in results])
    assert_bit_identical([r[2] for r in results])
    for i, got in enumerate(results[0][1]):
        want = sum(g[i].double() for g in grads_before) / case.world_size
        torch.testing.assert_close(got, want.float())
    # parameters were the shared init plus `rank`: their average adds (W-1)/2
    torch.manual_seed(0)
    init = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    shift = (case.world_size - 1) / 2
    for got, p in zip(results[0][2], init.parameters()):
        torch.testing.assert_close(got, p.detach() + shift)


def test_broadcast_from_every_source(case):
    results = run_ranks(w_broadcast, case.world_size, case.url, case.options)
    for src in range(case.world_size):
        per_rank = [seen[src] for seen in results]
        assert_bit_identical(per_rank)
        got = per_rank[0]
        assert torch.equal(got[0], torch.full((3, 2), float(src)))
        assert torch.equal(got[1], torch.arange(5) * (src + 1))
        assert torch.equal(got[2], torch.tensor([src % 2 == 0, True]))


def test_storage_stays_bounded_over_many_collectives(case):
    if not case.is_storage:
        pytest.skip("no storage to inspect on a torch.distributed transport")
    steps = 40
    results = run_ranks(w_many, case.world_size, case.url, case.options, steps)
    for x, _stats, _gen in results:
        assert torch.equal(x, torch.full((1000,), (case.world_size - 1) / 2 + steps - 1))
    prefix = results[0][2][len(case.url.rstrip("/")) + 1:]
    storage = open_storage(case.url, case.options.get("storage_options"))
    names = [k for k, _ in storage.list(prefix)]
    assert names or case.world_size == 1, prefix
    # a collective's objects: c{n}.* (an elastic round's: r{n}.*, less the rosters, of
    # which an elastic job keeps a window of 64 for joiners: docs/elastic.md#cleanup)
    pattern = r"/r(\d+)\.(?!roster$)" if case.options.get("elastic") else r"/c(\d+)\."
    collectives = {int(m.group(1)) for k in names if (m := re.search(pattern, k))}
    # at most the last couple of collectives' objects survive (rule: cleanup)
    assert len(collectives) <= 2, sorted(collectives)
    hidden = [k.rsplit("/", 1)[-1] for k in names if k.rsplit("/", 1)[-1].startswith(".")]
    # no temporary files; recycled files parked under .spare.* are few
    assert all(h.startswith(".spare.") for h in hidden), hidden
    assert len(hidden) <= 2 * case.world_size + 4


def test_stats_count_what_moved(case):
    results = run_ranks(w_average, case.world_size, case.url, case.options,
                        [1.0] * case.world_size)
    for _total, tensors, stats in results:
        for part in ("total", "last"):
            for key in ("collectives", "bytes_written", "bytes_read", "requests", "write_s",
                        "wait_s", "reduce_s", "read_s"):
                assert key in stats[part], key
        assert stats["total"]["collectives"] == 1
        if case.world_size > 1:
            payload = sum(t.numel() * t.element_size() for t in tensors)
            assert stats["last"]["bytes_written"] > 0
            assert stats["last"]["requests"] > 0
            # nobody writes or reads more than ~2x the payload in one collective
            # (plus headers and control records)
            assert stats["last"]["bytes_written"] < 2 * payload + 8192
            assert stats["last"]["bytes_read"] < 2 * payload + 8192


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_root_sharded_and_gather_reduce_are_bit_identical(tmp_path, world_size):
    weights = [1.0, 0.0, 2.0, 0.25][:world_size]
    runs = {}
    for mode in ("root", "sharded", "gather"):
        url = str(tmp_path / mode)
        runs[mode] = run_ranks(w_average, world_size, url, {"reduce": mode}, weights, seed=3)
        assert_bit_identical([r[1] for r in runs[mode]])
    assert_bit_identical([runs["root"][0][1], runs["sharded"][0][1], runs["gather"][0][1]])


@pytest.mark.parametrize("wire", ["bfloat16", "float16", "int8"])
def test_wire_dtypes_are_close_and_smaller(case, wire):
    if case.world_size == 1:
        pytest.skip("a single rank sends nothing")
    weights = [1.0] * case.world_size
    results = run_ranks(w_average, case.world_size, case.url,
                        {**case.options, "wire_dtype": wire}, weights, seed=4)
    per_rank = [r[1] for r in results]
    assert_bit_identical(per_rank)
    want = reference(case.world_size, weights, seed=4)
    for got, ref in zip(per_rank[0], want):
        if ref.numel() == 0:
            continue
        # int8: error per element <= absmax/127 per frame on the way in and out
        bound = {"bfloat16": 2e-2, "float16": 2e-3, "int8": 6e-2}[wire]
        # the result is rounded to the wire dtype, then to the tensor's own dtype
        bound = max(bound, torch.finfo(ref.dtype).eps)
        scale = ref.double().abs().max().item() + 1e-12
        err = (got.double() - ref.double()).abs().max().item()
        assert err <= bound * scale + 1e-3, (wire, got.dtype, err, scale)


def test_topk_results_are_bit_identical(case):
    """wire_dtype="topk" on every backend: the sum of the decoded sparse contributions,
    the same bits on every rank (tests/test_topk.py checks the values against the
    rank-order sum)."""
    if case.world_size == 1:
        pytest.skip("a single rank sends nothing")
    weights = [1.0 + r for r in range(case.world_size)]
    results = run_ranks(w_average, case.world_size, case.url,
                        {**case.options, "wire_dtype": "topk"}, weights, seed=5, calls=2)
    assert_bit_identical([r[1] for r in results])
    assert all(r[0] == sum(weights) for r in results)
    for got, ref in zip(results[0][1], reference(case.world_size, weights, seed=5)):
        assert got.shape == ref.shape and bool(torch.isfinite(got).all())


def test_secret_authenticates_every_object(case):
    options = {**case.options, "secret": "s3cr3t-for-tests"}
    weights = [1.0] * case.world_size
    results = run_ranks(w_average, case.world_size, case.url, options, weights)
    assert_bit_identical([r[1] for r in results])
    for got, want in zip(results[0][1], reference(case.world_size, weights)):
        torch.testing.assert_close(got, want)


def test_large_payload_streams_in_chunks(tmp_path):
    def_options = {"chunk_bytes": 1 << 16, "reduce": "root"}
    results = run_ranks(w_large, 3, str(tmp_path / "run"), def_options)
    assert_bit_identical([[r] for r in results])
    expected = sum(torch.arange(300_001, dtype=torch.float32) * (r + 1) for r in range(3)) / 3
    torch.testing.assert_close(results[0], expected)


def w_large(rank, world, url, options):
    x = torch.arange(300_001, dtype=torch.float32) * (rank + 1)
    with connect(url, rank, world, options) as sync:
        sync.average_(x)
    return x


def w_all_gather(rank, world, url, options):
    with connect(url, rank, world, options) as sync:
        a = sync.all_gather(torch.arange(6, dtype=torch.int32).reshape(2, 3) * rank)
        b = sync.all_gather(torch.tensor([float(rank)], dtype=torch.bfloat16))
        sync.average_(torch.ones(2))  # cleanup of all-gather objects rides on later gathers
        return a, b


def test_all_gather(case):
    results = run_ranks(w_all_gather, case.world_size, case.url, case.options)
    for a, b in results:
        assert len(a) == len(b) == case.world_size
        for k in range(case.world_size):
            assert torch.equal(a[k], torch.arange(6, dtype=torch.int32).reshape(2, 3) * k)
            assert b[k].item() == k and b[k].dtype == torch.bfloat16


def w_recycle(rank, world, url, options, steps):
    with connect(url, rank, world, options) as sync:
        for step in range(steps):
            x = torch.arange(200_000, dtype=torch.float32) * (rank + 1) + step
            sync.average_(x)
            want = torch.arange(200_000, dtype=torch.float32) * (world + 1) / 2 + step
            assert torch.equal(x, want), step
        return sync.stats["total"]


@pytest.mark.parametrize("reduce", ["root", "sharded", "gather"])
def test_recycled_files_never_leak_old_contents(tmp_path, reduce):
    # 800 KB objects are recycled: every step must still see exactly its own data
    results = run_ranks(w_recycle, 3, str(tmp_path / "run"),
                        {"reduce": reduce, "sharded_min_bytes": 1}, 12)
    assert all(r["collectives"] == 12 for r in results)


def w_async(rank, world, url, options, signal):
    model_a = torch.nn.Linear(50, 20)
    with connect(url, rank, world, options) as sync:
        for p in model_a.parameters():
            p.grad = torch.full_like(p, float(rank))
        if rank == 1:
            # joins only once rank 0 has seen its own call return unfinished
            wait_until(signal.exists, timeout=30, what="rank 0's signal")
        handle = sync.average_gradients(model_a, async_op=True)
        pending = None
        if rank == 0:
            # rank 1 has not called yet, so the collective cannot be complete: the call
            # returned before it and this thread runs meanwhile
            pending = not handle.done()
            signal.touch()
        total = handle.wait()
        # a synchronous collective right after an async one keeps the call order
        x = torch.full((3,), float(rank))
        h2 = sync.average_(x, async_op=True)
        y = torch.full((2,), float(rank) * 2)
        sync.average_(y)  # waits for h2 first
        assert h2.done()
        return total, [p.grad for p in model_a.parameters()], x, y, pending


def test_async_average_overlaps_and_keeps_order(case, tmp_path):
    signal = tmp_path / "rank0-returned"
    if case.world_size == 1:
        signal.touch()  # no peer to wait for
    results = run_ranks(w_async, case.world_size, case.url, case.options, signal)
    mean = (case.world_size - 1) / 2
    if case.world_size > 1:
        assert results[0][4] is True, "average_(async_op=True) waited for the collective"
    for total, grads, x, y, _ in results:
        assert total == case.world_size
        for g in grads:
            assert torch.equal(g, torch.full_like(g, mean))
        assert torch.equal(x, torch.full((3,), mean))
        assert torch.equal(y, torch.full((2,), 2 * mean))
