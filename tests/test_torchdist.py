"""Backend-specific tests for TorchDistSync (gloo here; NCCL where GPUs exist)."""

from __future__ import annotations

import os

import pytest
import torch

import ferrosync
from conftest import free_port
from ferrosync.errors import ConfigError, LayoutMismatch, PeerFailed
from ranks import RankFailure, run_ranks


def w_torchrun_env(rank, world, port, preinit):
    import torch.distributed as dist

    # what torchrun exports for every rank
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    if preinit:  # the script already made the default group: torch:// shares it
        dist.init_process_group("gloo")
    sync = ferrosync.connect("torch://")
    x = torch.full((5,), float(rank))
    total = sync.average_(x, weight=rank + 1)
    sync.close()
    still = dist.is_initialized()
    if preinit:
        dist.destroy_process_group()
    return total, x, still


@pytest.mark.parametrize("preinit", [False, True], ids=["env-init", "existing-group"])
def test_torch_url_under_torchrun_environment(preinit):
    results = run_ranks(w_torchrun_env, 3, free_port(), preinit)
    want = (0 * 1 + 1 * 2 + 2 * 3) / 6
    for total, x, still in results:
        assert total == 6.0
        assert torch.equal(x, torch.full((5,), want))
        # a group the user created survives close(); one ferrosync created does not
        assert still is preinit


@pytest.mark.unit
def test_nccl_without_gpus_is_a_config_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="nccl:// needs CUDA"):
        ferrosync.connect(f"nccl://127.0.0.1:{free_port()}", rank=0, world_size=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensor_on_gloo_is_a_config_error():
    with ferrosync.connect(f"gloo://127.0.0.1:{free_port()}", rank=0, world_size=1) as sync:
        with pytest.raises(ConfigError, match="use nccl://"):
            sync.average_(torch.ones(3, device="cuda"))


@pytest.mark.unit
def test_unsupported_device_is_a_config_error():
    with ferrosync.connect(f"gloo://127.0.0.1:{free_port()}", rank=0, world_size=1) as sync:
        with pytest.raises(ConfigError, match="not supported"):
            sync.average_(torch.ones(3, device="meta"))


@pytest.mark.parametrize("url", ["gloo://127.0.0.1", "gloo://:29500", "nccl://"])
@pytest.mark.unit
def test_url_needs_host_and_port(url):
    if url.startswith("nccl") and not torch.cuda.is_available():
        pytest.skip("nccl:// is refused earlier without CUDA")
    with pytest.raises(ConfigError, match="host and a port"):
        ferrosync.connect(url, rank=0, world_size=1)


@pytest.mark.unit
def test_storage_only_options_warn_once_and_unknown_ones_fail():
    url = f"gloo://127.0.0.1:{free_port()}"
    with pytest.warns(UserWarning, match=r"\['heartbeat_timeout', 'reduce'\]"):
        sync = ferrosync.connect(url, rank=0, world_size=1, reduce="sharded",
                                 heartbeat_timeout=30.0)
    sync.close()
    with pytest.raises(ConfigError, match="unknown option"):
        ferrosync.connect(url, rank=0, world_size=1, bogus=1)


def w_mismatch(rank, world, port, variant):
    sync = ferrosync.connect(f"gloo://127.0.0.1:{port}", rank=rank, world_size=world,
                             timeout=30)
    try:
        if variant == "shape":
            sync.average_([torch.ones(4), torch.ones(3 + rank)])
        else:
            sync.barrier() if rank == 1 else sync.average_(torch.ones(4))
    finally:
        sync.close()


@pytest.mark.parametrize("variant, needle", [
    ("shape", "first difference at tensor 1: rank 0 has float32[3], rank 1 has float32[4]"),
    ("order", "rank 0 called average, rank 1 called barrier"),
])
def test_layout_mismatch_raises_everywhere_instead_of_aborting(variant, needle):
    results = run_ranks(w_mismatch, 2, free_port(), variant, expect_errors=True)
    for res in results:
        assert isinstance(res, RankFailure) and isinstance(res.error, LayoutMismatch), res
    assert needle in str(results[0].error)


def w_peer_dies(rank, world, port):
    sync = ferrosync.connect(f"gloo://127.0.0.1:{port}", rank=rank, world_size=world,
                             timeout=60)
    sync.barrier()
    if rank == 1:
        os._exit(3)  # dies without a word
    sync.average_(torch.ones(4))


def test_dead_peer_is_peer_failed():
    results = run_ranks(w_peer_dies, 2, free_port(), expect_errors=True)
    assert isinstance(results[0], RankFailure)
    assert isinstance(results[0].error, PeerFailed), results[0].error
    assert "rank 0" in str(results[0].error)
