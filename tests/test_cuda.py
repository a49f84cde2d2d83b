"""CUDA paths: the storage backend reducing on the GPU, and NCCL with CUDA tensors.

Collected everywhere, skipped with a reason on machines without enough CUDA devices
(CI is CPU-only); run them on a GPU machine with ``python -m pytest tests/test_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch

import ferrosync
from conftest import free_port
from ranks import run_ranks

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


def cuda_tensors(rank):
    g = torch.Generator().manual_seed(rank)
    device = torch.device("cuda", rank % torch.cuda.device_count())
    return [torch.randn(1000, generator=g).to(device),
            torch.randn(33, generator=g).half().to(device),
            torch.randn(7, 5, generator=g).bfloat16().to(device)]


def w_cuda_average(rank, world, url, options):
    tensors = cuda_tensors(rank)
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=60, **options) as sync:
        sync.average_(tensors)
        assert all(t.is_cuda for t in tensors)
    return [t.cpu() for t in tensors]


def expected(world):
    per_rank = [[t.cpu() for t in cuda_tensors(r)] for r in range(world)]
    return [(sum(p[i].double() for p in per_rank) / world).to(per_rank[0][i].dtype)
            for i in range(len(per_rank[0]))]


@needs_cuda
@pytest.mark.parametrize("options", [{}, {"reduce": "sharded", "sharded_min_bytes": 1},
                                     {"wire_dtype": "int8"}, {"reduce_device": "cpu"}])
def test_storage_backend_reduces_cuda_tensors(tmp_path, options):
    results = run_ranks(w_cuda_average, 2, str(tmp_path / "run"), options)
    for a, b in zip(*results):
        assert torch.equal(a, b)
    if "wire_dtype" not in options:
        for got, want in zip(results[0], expected(2)):
            torch.testing.assert_close(got, want)


@needs_two
def test_nccl_averages_cuda_tensors():
    results = run_ranks(w_cuda_average, 2, f"nccl://127.0.0.1:{free_port()}", {})
    for a, b in zip(*results):
        assert torch.equal(a, b)
    for got, want in zip(results[0], expected(2)):
        torch.testing.assert_close(got, want)
