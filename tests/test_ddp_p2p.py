"""Point-to-point and all-to-all through storage (``storage/messages.py``), against gloo.

In-process tests connect two or three ranks from threads of this process (each its own
``StorageSync`` on a temporary directory): message order per (source, destination, tag),
receiving from any source, uneven all_to_all, and the trust rules (a moved, tampered,
mis-sized or missing message is refused, typed). The multi-process tests run the same
program on gloo and on the ``"ferrosync"`` backend and compare every received tensor
bit for bit, and train a two-stage pipeline (``torch.distributed.pipelining``) both ways.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

import ferrosync
from ferrosync.errors import LayoutMismatch, ShardCorrupt, SyncTimeout
from ferrosync.storage import names
from ranks import run_ranks


def _threads(world: int, fn, url: str, timeout: float = 60.0, **options):
    """Run ``fn(sync)`` on ``world`` ranks connected from threads; their results."""
    out, errors = {}, []

    def rank(r):
        try:
            with ferrosync.connect(url, rank=r, world_size=world, job="p2p", timeout=timeout,
                                   **options) as sync:
                out[r] = fn(sync)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append((r, exc))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out, errors


@pytest.mark.unit
def test_messages_arrive_exactly_in_order_per_pair_and_tag(tmp_path):
    sent = [torch.randn(5, dtype=torch.float16), torch.arange(7),
            torch.tensor([True, False]), torch.randn(3, dtype=torch.complex64)]

    def program(sync):
        if sync.rank == 0:
            sync.send(sent[0], 1)
            sync.send(sent[1], 1)
            sync.send(sent[2], 1, tag=9)
            sync.send(sent[3], 1)
            return None
        first, second = torch.empty(5, dtype=torch.float16), torch.empty(7, dtype=torch.long)
        a, b = sync.irecv(first, 0), sync.irecv(second, 0)
        flags = torch.empty(2, dtype=torch.bool)
        assert sync.recv(flags, 0, tag=9) == 0  # another tag: its own order
        assert b.wait() == 0 and a.wait() == 0  # waited out of order, matched as posted
        last = torch.empty(3, dtype=torch.complex64)
        sync.recv(last, 0)
        return [first, second, flags, last]

    out, errors = _threads(2, program, str(tmp_path))
    assert not errors
    for got, want in zip(out[1], sent):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.unit
def test_any_source_takes_the_lowest_rank_with_a_message(tmp_path):
    sent = threading.Barrier(3)

    def program(sync):
        if sync.rank:
            sync.send(torch.full((2,), float(sync.rank)), 0)
            sent.wait()
            return None
        sent.wait()  # both messages are stored before rank 0 looks
        got = []
        for _ in range(2):
            t = torch.empty(2)
            got.append((sync.recv(t), t[0].item()))
        return got

    out, errors = _threads(3, program, str(tmp_path))
    assert not errors and out[0] == [(1, 1.0), (2, 2.0)]


@pytest.mark.unit
def test_all_to_all_with_uneven_splits(tmp_path):
    def program(sync):
        r, w = sync.rank, sync.world_size
        inputs = [torch.arange(r + j + 1, dtype=torch.int32) + 100 * r for j in range(w)]
        outputs = [torch.empty(k + r + 1, dtype=torch.int32) for k in range(w)]
        sync.all_to_all(outputs, inputs)
        return outputs

    out, errors = _threads(3, program, str(tmp_path))
    assert not errors
    for r in range(3):
        for k in range(3):
            assert torch.equal(out[r][k], torch.arange(k + r + 1, dtype=torch.int32) + 100 * k)


def _tamper_then_receive(tmp_path, tamper, receive_tag=0, size=4, secret=None):
    stored = threading.Event()
    done = threading.Event()

    def program(sync):
        if sync.rank == 0:
            sync.send(torch.arange(4.0), 1)
            stored.set()
            done.wait(30)  # alive (heartbeating) while rank 1 reads
            return None
        stored.wait(30)
        folder = sync.generation_url
        tamper(folder, names.message(0, 1, 0, 0))
        try:
            sync.recv(torch.empty(size), 0, tag=receive_tag)
        finally:
            done.set()

    options = {"secret": secret} if secret else {}
    return _threads(2, program, str(tmp_path), **options)


@pytest.mark.unit
def test_a_message_moved_to_another_tag_is_refused(tmp_path):
    def move(folder, name):
        os.rename(os.path.join(folder, name),
                  os.path.join(folder, names.message(0, 1, 5, 0)))

    _, errors = _tamper_then_receive(tmp_path, move, receive_tag=5)
    assert [type(e) for _, e in errors] == [ShardCorrupt], errors
    assert "digest" in str(errors[0][1])


@pytest.mark.unit
@pytest.mark.parametrize("secret", [None, "k" * 32])
def test_a_tampered_message_is_refused(tmp_path, secret):
    def flip(folder, name):
        path = os.path.join(folder, name)
        with open(path, "r+b") as f:
            data = bytearray(f.read())
            data[-1] ^= 1
            f.seek(0)
            f.write(data)

    _, errors = _tamper_then_receive(tmp_path, flip, secret=secret)
    assert [type(e) for _, e in errors] == [ShardCorrupt], errors


@pytest.mark.unit
def test_a_message_of_another_size_is_a_layout_mismatch(tmp_path):
    _, errors = _tamper_then_receive(tmp_path, lambda folder, name: None, size=6)
    assert [type(e) for _, e in errors] == [LayoutMismatch], errors
    assert "4 elements" in str(errors[0][1]) and "6" in str(errors[0][1])


@pytest.mark.unit
def test_a_message_never_sent_times_out_naming_it(tmp_path):
    done = threading.Event()

    def program(sync):
        if sync.rank == 1:
            try:
                sync.recv(torch.empty(1), 0, tag=3)
            finally:
                done.set()
        done.wait(30)  # rank 0 lives on (beating) without sending

    _, errors = _threads(2, program, str(tmp_path), timeout=1.0)
    (rank, error), = errors
    assert rank == 1 and isinstance(error, SyncTimeout)
    assert "message 0 from rank 0 (tag 3)" in str(error)


@pytest.mark.unit
def test_a_sender_that_closed_without_sending_fails_the_receive(tmp_path):
    def program(sync):
        if sync.rank == 1:
            sync.recv(torch.empty(1), 0)

    _, errors = _threads(2, program, str(tmp_path))
    (rank, error), = errors
    assert rank == 1 and isinstance(error, ferrosync.PeerFailed) and "closed" in str(error)


# -- against gloo, on real processes -----------------------------------------------------------

def exchange(rank, world, init_method, backend):
    import torch.distributed as dist

    os.environ.pop("FERROSYNC_JOB", None)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    try:
        other = 1 - rank
        gen = torch.Generator().manual_seed(rank)
        out = []
        x = torch.randn(33, generator=gen)
        if rank == 0:
            dist.send(x, 1)
            y = torch.empty(17, dtype=torch.float64)
            dist.recv(y, 1, tag=2)
        else:
            y = torch.empty(33)
            dist.recv(y, 0)
            dist.send(torch.randn(17, dtype=torch.float64, generator=gen), 0, tag=2)
        out += [y]
        bufs = [torch.empty(3, dtype=torch.bfloat16) for _ in range(2)]
        ops = [dist.P2POp(dist.isend, torch.randn(3, generator=gen).bfloat16(), other),
               dist.P2POp(dist.irecv, bufs[0], other),
               dist.P2POp(dist.isend, torch.randn(3, generator=gen).bfloat16(), other, tag=1),
               dist.P2POp(dist.irecv, bufs[1], other, tag=1)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        out += bufs
        if rank == 1:
            dist.send(torch.tensor([7]), 0)
        else:
            any_ = torch.empty(1, dtype=torch.long)
            assert dist.recv(any_) == 1
            out.append(any_)
        even = torch.empty(4)
        dist.all_to_all_single(even, torch.randn(4, generator=gen))
        uneven_in = torch.arange(5 * 3).view(5, 3) + 100 * rank
        splits_in = [2, 3] if rank == 0 else [1, 4]
        splits_out = [2, 1] if rank == 0 else [3, 4]
        uneven = torch.empty(sum(splits_out), 3, dtype=torch.long)
        dist.all_to_all_single(uneven, uneven_in, splits_out, splits_in)
        lists = [torch.empty(2, dtype=torch.int32) for _ in range(2)]
        dist.all_to_all(lists, [torch.full((2,), 10 * rank + j, dtype=torch.int32)
                                for j in range(2)])
        return out + [even, uneven, *lists]
    finally:
        dist.destroy_process_group()


def pipeline(rank, world, init_method, backend, steps=3):
    """GPipe over two stages of a small MLP: rank 0 runs the first half, rank 1 the
    second and the loss; the activations and gradients between them are send/recv."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    os.environ.pop("FERROSYNC_JOB", None)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        full = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 4))
        part = full[:2] if rank == 0 else full[2:]
        stage = PipelineStage(part, rank, world, torch.device("cpu"))
        losses = []
        schedule = ScheduleGPipe(stage, n_microbatches=4,
                                 loss_fn=lambda out, y: torch.nn.functional.mse_loss(out, y))
        opt = torch.optim.SGD(part.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(1)
        for _ in range(steps):
            x, y = torch.randn(16, 8, generator=data), torch.randn(16, 4, generator=data)
            opt.zero_grad()
            if rank == 0:
                schedule.step(x)
            else:
                step_losses = []
                schedule.step(target=y, losses=step_losses)
                losses.append(torch.stack(step_losses))
            opt.step()
        return losses, [p.detach().clone() for p in part.parameters()]
    finally:
        dist.destroy_process_group()


def both(rank, world, init_method, backend):
    return (exchange(rank, world, init_method + ".x", backend),
            pipeline(rank, world, init_method + ".p", backend))


def test_point_to_point_all_to_all_and_a_pipeline_equal_gloos_bit_for_bit(tmp_path):
    """Every tensor received equals gloo's bit for bit; and a two-stage GPipe trains
    to the same losses and weights as over gloo, bit for bit: the stages compute the
    same operations on the same inputs, and storage carries every activation and
    gradient byte for byte (nothing is reduced, so nothing depends on the transport)."""
    runs = {b: run_ranks(both, 2, f"file://{tmp_path}/{b}", b, timeout=180)
            for b in ("gloo", "ferrosync")}
    for (theirs, _), (ours, _) in zip(runs["gloo"], runs["ferrosync"]):
        assert len(theirs) == len(ours) >= 7
        for a, b in zip(theirs, ours):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.view(torch.uint8) if a.dtype != torch.bool else a,
                               b.view(torch.uint8) if b.dtype != torch.bool else b)
    (g0, g1), (f0, f1) = [[r[1] for r in runs[b]] for b in ("gloo", "ferrosync")]
    assert len(g1[0]) == 3 and all(torch.equal(a, b) for a, b in zip(g1[0], f1[0]))
    for theirs, ours in ((g0[1], f0[1]), (g1[1], f1[1])):
        assert all(torch.equal(a, b) for a, b in zip(theirs, ours))
