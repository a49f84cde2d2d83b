"""Lossy codecs treat every contribution alike and keep state per kind of data.

* Every rank's contribution, rank 0's included, goes through the wire encoding: the
  result must not depend on which rank holds which values.
* int8 error feedback is keyed by what the data is: averaging a model's parameters
  must not leave a residual that later lands on its gradients (same layout).
"""

from __future__ import annotations

import pytest
import torch

import ferrosync
from ranks import run_ranks


def w_half_overflow(rank, world, url, reduce, big_rank):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=30, reduce=reduce,
                           sharded_min_bytes=1, wire_dtype="float16") as sync:
        x = torch.full((4096,), 70000.0 if rank == big_rank else 1.0)  # > fp16's 65504
        x[:10] = 3.0 + rank
        sync.average_(x)
        return x


@pytest.mark.parametrize("reduce", ["root", "sharded"])
def test_result_does_not_depend_on_which_rank_holds_the_values(dir_transport, reduce):
    url = dir_transport.url
    first = run_ranks(w_half_overflow, 2, url + "/a", reduce, 0)
    second = run_ranks(w_half_overflow, 2, url + "/b", reduce, 1)
    assert torch.equal(first[0], first[1]) and torch.equal(second[0], second[1])
    # 70000 is inf in float16 whichever rank sends it (rank 0 used to skip the encoding)
    assert torch.isinf(first[0][10:]).all() and torch.isinf(second[0][10:]).all()
    assert torch.equal(first[0][:10], torch.full((10,), 3.5))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))


def w_grads_after_params(rank, world, url, average_params_first):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=30,
                           wire_dtype="int8") as sync:
        model = _model()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(rank)  # large values: a large int8 residual
        if average_params_first:
            sync.average_parameters(model)
        torch.manual_seed(100 + rank)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-4  # small gradients
        exact = [p.grad.clone() for p in model.parameters()]
        sync.average_gradients(model)
        return [p.grad for p in model.parameters()], exact


def test_parameter_residual_never_lands_on_gradients(dir_transport):
    url = dir_transport.url
    alone = run_ranks(w_grads_after_params, 2, url + "/alone", False)
    after = run_ranks(w_grads_after_params, 2, url + "/after", True)
    for rank in range(2):
        for g_alone, g_after in zip(alone[rank][0], after[rank][0]):
            # the first gradient call starts with no residual either way
            assert torch.equal(g_alone, g_after)
    exact = [(a + b) / 2 for a, b in zip(alone[0][1], alone[1][1])]
    worst = max((g - e).abs().max().item() for g, e in zip(after[0][0], exact))
    assert worst < 1e-5, worst  # int8 error of ~1e-4 gradients (3.6e-4 when mixed)


@pytest.mark.unit
def test_error_feedback_memory_is_bounded():
    from ferrosync.compression.codecs import ErrorFeedback

    ef = ErrorFeedback(max_keys=4)
    x = torch.ones(10)
    for key in range(10):
        sent = ef.compensate(key, x)
        ef.remember(key, sent, sent * 0.5)
    assert len(ef._residual) == 4
    assert set(ef._residual) == {6, 7, 8, 9}
