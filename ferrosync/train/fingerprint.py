"""A cheap fingerprint of a dataset, so ranks can check they hold the same data.

``fingerprint`` hashes the length and a few items at indices that depend only on the
length, with torch's, NumPy's and ``random``'s global generators seeded and restored
around it (an augmenting ``__getitem__`` still fingerprints alike); ``Trainer.fit``
compares the ranks' fingerprints before the first step (docs/train.md).
"""

from __future__ import annotations

import hashlib
import random

import numpy
import torch

from ferrosync.errors import ConfigError

#: items hashed besides the first and the last (a few reads, however large the data)
SAMPLED_ITEMS = 6
#: bytes of the fingerprint: the length (8, little-endian) then the items' hash
SIZE = 8 + 16
_INDEX_SEED = 0x5EED
_READ_SEED = 0


def sample_indices(n: int) -> list[int]:
    """The indices hashed for a dataset of ``n`` items: 0, n-1 and ``SAMPLED_ITEMS``
    others drawn from a generator seeded by a constant (so the same on every rank)."""
    g = torch.Generator().manual_seed(_INDEX_SEED)
    drawn = torch.randint(0, n, (SAMPLED_ITEMS,), generator=g).tolist() if n > 2 else []
    return sorted({0, n - 1, *drawn})


def fingerprint(dataset, n: int) -> bytes:
    """``SIZE`` bytes: ``n`` and a BLAKE2b hash of the sampled items' contents."""
    h = hashlib.blake2b(digest_size=SIZE - 8)
    with _fixed_randomness():
        for i in sample_indices(n):
            h.update(f"[{i}]".encode())
            _feed(h, dataset[i])
    return n.to_bytes(8, "little") + h.digest()


def length_of(value: bytes) -> int:
    """The dataset length a fingerprint carries."""
    return int.from_bytes(bytes(value[:8]), "little")


def check_same_data(prints: list[bytes], *, rank: int | None = None, what: str = "rank",
                    path: str | None = None) -> None:
    """Raise the one ``ConfigError`` for ranks whose dataset fingerprints (in rank
    order) differ from rank 0's: the data factory is not deterministic."""
    differ = [r for r, p in enumerate(prints) if p != prints[0]]
    if not differ:
        return
    lengths = {r: length_of(prints[r]) if len(prints[r]) == SIZE else None
               for r in (0, *differ)}
    if len(set(lengths.values())) > 1:
        how = ", ".join(f"{n} samples on {what} {r}" for r, n in lengths.items())
    else:
        how = (f"{lengths[0]} samples each, but other samples on {what}"
               f"{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} than on "
               f"{what} 0")
    raise ConfigError(
        f"the {what}s built different datasets ({how}); every {what} must train on the "
        "same data, so the data factory (--data) must be deterministic", rank=rank, path=path,
        hint="seed every random generator it uses (e.g. torch.Generator().manual_seed(0) "
        "passed to torch.randn, numpy.random.default_rng(0), random.Random(0)), or load "
        "the data from a file")


class _fixed_randomness:
    """Global torch/NumPy/``random`` state seeded for the reads, restored after."""

    def __enter__(self):
        self._torch = torch.random.fork_rng(devices=[])
        self._torch.__enter__()
        self._random, self._numpy = random.getstate(), numpy.random.get_state()
        torch.manual_seed(_READ_SEED)
        random.seed(_READ_SEED)
        numpy.random.seed(_READ_SEED)

    def __exit__(self, *exc):
        random.setstate(self._random)
        numpy.random.set_state(self._numpy)
        return self._torch.__exit__(*exc)


def _feed(h, item) -> None:
    """Hash an item's contents: tensors and arrays by dtype, shape and bytes; numbers
    and strings by value; containers recursively. Anything else (an object whose only
    stable description is its type) by its type name, never its repr, which may hold
    an address that differs between processes."""
    if isinstance(item, torch.Tensor):
        t = item.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(item.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(item, numpy.ndarray):
        h.update(f"A{item.dtype.str}{item.shape}".encode())
        if item.dtype == object:
            _feed(h, item.tolist())
        else:
            h.update(numpy.ascontiguousarray(item).tobytes())
    elif isinstance(item, (bool, int, float, complex, str, bytes, type(None), numpy.generic)):
        h.update(f"{type(item).__name__}:{item!r}".encode())
    elif isinstance(item, (tuple, list)):
        h.update(f"({len(item)}".encode())
        for part in item:
            _feed(h, part)
        h.update(b")")
    elif isinstance(item, dict):
        h.update(f"{{{len(item)}".encode())
        for key in sorted(item, key=str):
            _feed(h, key)
            _feed(h, item[key])
        h.update(b"}")
    elif hasattr(item, "__array__"):  # a PIL image, an array-like
        _feed(h, numpy.asarray(item))  # an ndarray: handled above, whatever its dtype
    else:
        h.update(f"?{type(item).__module__}.{type(item).__qualname__}".encode())
