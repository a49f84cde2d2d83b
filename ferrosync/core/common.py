"""Code every backend shares: layout checks and their messages, the weighted
accumulate, and the translation of torch.distributed failures into ferrosync errors.

A backend never imports another backend's module (docs/design.md#backend-contract): a new
transport is one module plus one ``register(...)`` in ``ferrosync/core/registry.py``.
"""

from __future__ import annotations

import errno
import json

import numpy as np
import torch
import torch.distributed as dist

from ferrosync.errors import ConfigError, LayoutMismatch, PeerFailed, SyncTimeout

#: the hint of every LayoutMismatch
MISMATCH_HINT = ("every rank must pass the same tensors (count, dtype, shape) to the same "
                 "collective, in the same order")


# -- the weighted accumulate ------------------------------------------------------------------

def _host_array(t: torch.Tensor):
    """``t`` as a numpy array sharing its memory, or None (not on the CPU, or a dtype
    numpy lacks: bfloat16)."""
    if t.device.type != "cpu" or t.dtype not in _NUMPY_DTYPES:
        return None
    return t.detach().numpy()


# Why numpy on the CPU: these passes are memory-bound, and torch runs them on its
# intra-op pool (one thread per core by default), whose threads spin after each
# region. Beside the training process's own threads and the other ranks on the host
# that is oversubscription: measured on 2 cores, 2 ranks at default threading, 64 MiB
# took 1.2x gloo's time through torch's pool against 0.4-0.5x with one thread per
# rank. numpy's ufuncs run on the calling thread only, and give the same IEEE results
# for these operations (copy, add, scale and divide by a float32-rounded scalar).
_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def accumulate(acc: torch.Tensor, values: torch.Tensor, weight: float, *, first: bool) -> None:
    """``acc = weight·values`` when ``first``, else ``acc += weight·values``.

    Computed in ``acc``'s dtype (float32 for half types): copy first, then scale,
    because ``torch.mul(half, w, out=f32)`` would multiply in half precision before
    widening. Every backend sums in rank order with this, so results are the same
    bits whichever backend reduced. On the CPU it uses one thread (see above).
    """
    a, v = _host_array(acc), _host_array(values)
    if first and values is acc:
        # in-place reduce (StorageSync's rank 0 sums into its own tensor): nothing to copy
        if weight != 1.0:
            if a is not None:
                np.multiply(a, a.dtype.type(weight), out=a)
            else:
                acc.mul_(weight)
        return
    if a is not None and v is not None and (first or weight == 1.0):
        if first:
            np.copyto(a, v, casting="same_kind")
            if weight != 1.0:
                np.multiply(a, a.dtype.type(weight), out=a)
        else:
            np.add(a, v, out=a, casting="same_kind")
        return
    if first:
        acc.copy_(values)
        if weight != 1.0:
            acc.mul_(weight)
    elif weight == 1.0:
        acc.add_(values)
    else:
        acc.add_(values, alpha=weight)


def divide_into(out: torch.Tensor, acc: torch.Tensor, total: float) -> None:
    """``out = acc / total``, rounded once to ``out``'s dtype (one thread on the CPU)."""
    a, o = _host_array(acc), _host_array(out)
    if a is not None and o is not None:
        np.divide(a, a.dtype.type(total), out=o, casting="same_kind")
        return
    torch.div(acc, total, out=out)


def weighted_copy(out: torch.Tensor, values: torch.Tensor, weight: float) -> None:
    """``out = weight·values``; zeros for weight 0, so a rank that contributes nothing
    adds nothing even where its tensors hold inf or NaN."""
    if weight > 0:
        accumulate(out, values, weight, first=True)
    else:
        out.zero_()


def total_weight(weights) -> float:
    """Σ weights in rank order: the same float sum on every rank."""
    total = 0.0
    for w in weights:
        total += w
    return total


# -- layout checks ---------------------------------------------------------------------------

def describe_mismatch(mine: dict, theirs: dict | None, me: int, other: int) -> str:
    """Name the first difference between two layout records, for LayoutMismatch."""
    if not theirs:
        return (f"rank {other} sent a different tensor layout (its layout record is missing); "
                f"rank {me} called {mine.get('op')} with {mine.get('tensors')}")
    if mine.get("op") != theirs.get("op"):
        return f"rank {me} called {mine.get('op')}, rank {other} called {theirs.get('op')}"
    a, b = mine.get("tensors", []), theirs.get("tensors", [])
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return (f"{mine.get('op')}: first difference at tensor {i}: rank {me} has {x}, "
                    f"rank {other} has {y}")
    if len(a) != len(b):
        return f"{mine.get('op')}: rank {me} passed {len(a)} tensors, rank {other} passed {len(b)}"
    return (f"{mine.get('op')}: bucket {mine.get('bucket')} on rank {me} vs "
            f"{theirs.get('bucket')} on rank {other}")


def check_layouts(gather, world_size: int, rank: int, digest: bytes, layout: dict, *,
                  collective: int, url: str, global_rank=lambda k: k) -> None:
    """Raise ``LayoutMismatch`` on every rank unless all ranks passed ``digest``.

    Collective over a torch process group: ``gather(out_list, tensor)`` all-gathers one
    tensor per rank. Every rank exchanges the same fixed-size int64 first, so a
    mismatch can never turn into a size mismatch inside the transport (gloo aborts the
    process on one); only then are the JSON layout records exchanged, to name the
    first differing tensor.
    """
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
    digests = [torch.empty_like(mine) for _ in range(world_size)]
    gather(digests, mine)
    values = [int(t.item()) for t in digests]
    if len(set(values)) == 1:
        return
    other = next(k for k, v in enumerate(values) if v != values[rank])
    data = torch.frombuffer(bytearray(json.dumps(layout).encode()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.empty_like(size) for _ in range(world_size)]
    gather(sizes, size)
    padded = torch.zeros(max(int(s.item()) for s in sizes), dtype=torch.uint8)
    padded[: data.numel()] = data
    records = [torch.empty_like(padded) for _ in range(world_size)]
    gather(records, padded)
    try:
        theirs = json.loads(bytes(records[other][: int(sizes[other].item())].tolist()).decode())
    except ValueError:
        theirs = None
    raise LayoutMismatch(
        describe_mismatch(layout, theirs, global_rank(rank), global_rank(other)),
        rank=global_rank(rank), collective=collective, path=url, hint=MISMATCH_HINT,
    )


# -- torch.distributed failures ----------------------------------------------------------------

def translate_torch_error(exc: BaseException, rank: int, collective: int, url: str,
                          what: str):
    """The ferrosync error a torch.distributed failure really is.

    The exception's type decides where torch gives one: ``DistNetworkError`` or an
    ``OSError`` with ``EADDRINUSE`` for a taken port. torch has no timeout type (gloo's
    and the TCPStore's timeouts are ``RuntimeError``/``DistStoreError`` whose only
    mark is their text), so timeouts are recognised by their message, the one place
    where text decides.
    """
    text = str(exc)
    first = text.splitlines()[0] if text else type(exc).__name__
    if _port_taken(exc):
        return ConfigError(f"{what}: the port is taken ({first[:200]})", rank=rank, path=url,
                           hint="pick a free port for rank 0")
    if "timed out" in text.lower() or "timeout" in text.lower():
        return SyncTimeout(
            f"{what} timed out ({first[:300]})", rank=rank, collective=collective, path=url,
            hint="are all ranks running with the same URL and calling the same collectives?",
        )
    return PeerFailed(
        f"{what} failed: {first[:300]}", rank=rank, collective=collective, path=url,
        hint="another rank probably crashed or exited early: check its log",
    )


def _port_taken(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return True
    # torch's TCPStore server reports a bind failure as DistNetworkError, errno in text
    return isinstance(exc, dist.DistNetworkError) and "address already in use" in str(exc).lower()
