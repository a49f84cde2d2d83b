"""Many tensors as a few flat, dtype-homogeneous vectors (buckets), and reusable buffers.

``check_tensors`` refuses, before any I/O, what cannot travel this way; ``BufferPool``
keeps one growing buffer per role, so peak memory depends neither on the number of
ranks nor on the number of calls (docs/design.md#data-path-of-one-average,
docs/design.md#bounded-memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xxhash

from ferrosync.errors import ConfigError

#: the dtypes a collective can carry, each with its code in an object's header
#: (``storage/wire.py``); the codes are part of the format: append, never renumber
DTYPE_CODES = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.uint8: 5,
    torch.int8: 6,
    torch.int16: 7,
    torch.int32: 8,
    torch.int64: 9,
    torch.bool: 10,
    torch.complex64: 11,
    torch.complex128: 12,
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def layout_signature(tensors: list[torch.Tensor]) -> list[str]:
    """One ``dtype[shape]`` entry per tensor; what every rank must agree on."""
    return [f"{_dtype_name(t.dtype)}{list(t.shape)}" for t in tensors]


def layout_digest(signature: str) -> bytes:
    """8-byte digest of a layout signature string (dtypes and shapes, in order)."""
    return xxhash.xxh3_64_digest(signature.encode())


def has_internal_overlap(t: torch.Tensor) -> bool:
    """True if two elements of ``t`` are certainly one memory location (a stride of 0
    over a dimension longer than 1, as ``expand`` makes): torch refuses to write such
    a tensor in place. Like torch's own check, other aliasing strides are not hunted
    (they cannot be proven cheaply, and torch writes them)."""
    return t.numel() > 1 and any(
        stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride()))


def check_tensors(tensors: list[torch.Tensor], *, op: str, rank: int | None = None,
                  path: str | None = None, names: list[str] | None = None,
                  in_place: bool = True, dtypes: tuple | None = None,
                  dtype_hint: str | None = None) -> None:
    """Raise ``ConfigError`` for the first tensor a collective cannot move; no I/O.

    Called by every rank with the same kinds of tensors, so every rank refuses
    alike, before it takes part. ``rank`` and ``path`` (the URL) go into the error;
    ``names[i]`` labels tensor ``i`` (default ``tensors[i]``); ``in_place`` means
    results are written into the tensors; ``dtypes`` are the accepted dtypes (None:
    any).
    """
    for i, t in enumerate(tensors):
        label = names[i] if names is not None else f"tensors[{i}]"
        if t.layout != torch.strided or t.is_nested:
            kind = "nested" if t.is_nested else str(t.layout).replace("torch.", "")
            raise ConfigError(
                f"{label} is a {kind} tensor; {op} moves dense (strided) tensors",
                rank=rank, path=path,
                hint=f"pass {label}.to_dense() (and copy the result back into your sparse "
                "tensor if you need it), or use dense embeddings (sparse=False) for "
                "gradients",
            )
        if t.device.type == "meta":
            raise ConfigError(
                f"{label} is on the meta device, which is not supported: it has a shape "
                f"but no data to {op}",
                rank=rank, path=path,
                hint="materialise it first (module.to_empty(device='cpu' or 'cuda') and "
                "initialise or load the weights), then call the collective",
            )
        if t.is_quantized:
            raise ConfigError(
                f"{label} is a quantized tensor ({t.dtype}); {op} moves plain dtypes",
                rank=rank, path=path, hint=f"pass {label}.dequantize() or {label}.int_repr()",
            )
        if dtypes is not None and t.dtype not in dtypes:
            names_ = ", ".join(_dtype_name(d) for d in dtypes)
            raise ConfigError(
                f"{label} has dtype {t.dtype}; {op} takes {names_}", rank=rank, path=path,
                hint=dtype_hint or f"cast it ({label}.to(...)) to one of these",
            )
        if in_place and has_internal_overlap(t):
            raise ConfigError(
                f"{label} has elements that share memory (shape {list(t.shape)}, stride "
                f"{list(t.stride())}, e.g. made by expand()); {op} writes its result in "
                "place and cannot write different values to one memory location",
                rank=rank, path=path,
                hint="pass the tensor it was expanded from (its result is the same for "
                f"every copy), or a real copy ({label}.clone()) and use that afterwards",
            )


@dataclass
class Bucket:
    """Tensors (by index into the call's list) that travel as one flat vector."""

    index: int
    tensors: list[torch.Tensor]
    dtype: torch.dtype
    device: torch.device
    numel: int

    def flat(self, pool: BufferPool) -> tuple[torch.Tensor, bool]:
        """(flat vector, is_copy). A lone contiguous tensor is returned as a view.

        A conjugate or negative view is contiguous but its memory holds the values
        conjugated or negated, so it is copied (``copy_`` applies the flag each way).
        """
        t = self.tensors[0] if len(self.tensors) == 1 else None
        if t is not None and t.is_contiguous() and not t.is_conj() and not t.is_neg():
            return t.detach().view(-1), False
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
