"""Many tensors as a few flat vectors, and reusable buffers.

A collective moves one flat, dtype-homogeneous vector per *bucket*: a model with
hundreds of parameters costs a few storage objects, not hundreds. A single
contiguous tensor is used in place (no copy); several tensors are gathered into
a pooled buffer and scattered back afterwards.

``BufferPool`` keeps one buffer per role and grows it only when a larger one is
needed, so steady-state training allocates nothing payload-sized per call and
peak memory does not depend on the number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import ConfigError


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def layout_signature(tensors: list[torch.Tensor]) -> list[str]:
    """One ``dtype[shape]`` entry per tensor; what every rank must agree on."""
    return [f"{_dtype_name(t.dtype)}{list(t.shape)}" for t in tensors]


@dataclass
class Bucket:
    """Tensors (by index into the call's list) that travel as one flat vector."""

    index: int
    tensors: list[torch.Tensor]
    dtype: torch.dtype
    device: torch.device
    numel: int

    def flat(self, pool: BufferPool) -> tuple[torch.Tensor, bool]:
        """(flat vector, is_copy). A lone contiguous tensor is returned as a view."""
        if len(self.tensors) == 1 and self.tensors[0].is_contiguous():
            return self.tensors[0].detach().view(-1), False
        buf = pool.get("flat", self.numel, self.dtype, self.device)
        offset = 0
        for t in self.tensors:
            n = t.numel()
            buf[offset : offset + n].view(t.shape).copy_(t.detach())
            offset += n
        return buf, True

    def scatter(self, flat: torch.Tensor) -> None:
        """Copy ``flat`` back into the tensors (after a collective changed it)."""
        offset = 0
        for t in self.tensors:
            n = t.numel()
            t.detach().copy_(flat[offset : offset + n].view(t.shape))
            offset += n


def plan_buckets(tensors: list[torch.Tensor], bucket_bytes: int | None) -> list[Bucket]:
    """Group tensors by (dtype, device) in order of first appearance.

    Within a group, consecutive tensors fill a bucket up to ``bucket_bytes``
    (a single larger tensor gets a bucket of its own). The plan depends only on the
    tensors' dtypes and shapes, so it is identical on every rank that passes the
    same layout.
    """
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    buckets: list[Bucket] = []
    for (dtype, device), members in groups.items():
        current: list[torch.Tensor] = []
        size = 0
        for t in members:
            nbytes = t.numel() * t.element_size()
            if current and bucket_bytes is not None and size + nbytes > bucket_bytes:
                buckets.append(_bucket(len(buckets), current, dtype, device))
                current, size = [], 0
            current.append(t)
            size += nbytes
        if current:
            buckets.append(_bucket(len(buckets), current, dtype, device))
    return buckets


def _bucket(index, tensors, dtype, device) -> Bucket:
    return Bucket(index, list(tensors), dtype, device, sum(t.numel() for t in tensors))


def as_tensor_list(tensors, what: str = "tensors") -> list[torch.Tensor]:
    """Accept one tensor or an iterable of tensors; reject anything else clearly."""
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    try:
        out = list(tensors)
    except TypeError:
        raise ConfigError(
            f"{what} must be a tensor or an iterable of tensors, got {type(tensors).__name__}"
        ) from None
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"{what}[{i}] is a {type(t).__name__}, not a torch.Tensor")
    return out


class BufferPool:
    """One growing buffer per (role, dtype, device, pinned); never shrinks.

    Callers must not hold a buffer across two ``get`` calls for the same role.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def get(self, role: str, numel: int, dtype: torch.dtype, device, *, pinned: bool = False):
        device = torch.device(device)
        key = (role, dtype, device, pinned)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            # drop the old one first, so growing never holds two copies
            self._buffers.pop(key, None)
            buf = torch.empty(max(numel, 1), dtype=dtype, device=device,
                              pin_memory=pinned and torch.cuda.is_available())
            self._buffers[key] = buf
        return buf[:numel]

    def clear(self) -> None:
        self._buffers.clear()
