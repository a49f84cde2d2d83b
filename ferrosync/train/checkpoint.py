"""Training checkpoints in a directory or any fsspec URL, written atomically by rank 0
(per rank for strategies whose ranks drift).

``step-{n:08}.pt`` files go through the storage engines (a reader sees a whole file or
none), then ``latest.json`` declares each file's size and xxh3 and a checksum of itself;
a load reads at most the declared size and checks the checksums before ``torch.load(...,
weights_only=True)`` sees a byte. Layout and resuming: docs/train.md#checkpoints-and-resuming;
the trust rule: docs/design.md#security-model.
"""

from __future__ import annotations

import io
import json
import random
import re
import warnings

import numpy
import torch

from ferrosync.errors import ConfigError, ShardCorrupt, StorageError
from ferrosync.storage.engines import Storage, open_storage
from ferrosync.storage.engines import probe_location as probe_storage
from ferrosync.storage.engines.parts import listed_parts
from ferrosync.storage.wire import PayloadDigest, loads_bounded

LATEST = "latest.json"
#: 2: latest.json declares every file's checksum, and one of itself
FORMAT = 2
#: what a refused --resume can do instead (a used directory is refused without --resume)
NEW_RUN = "start a new run (no --resume) in an empty --checkpoint-dir"
#: index formats this version reads (1: no checksums; loaded with a warning)
READABLE_FORMATS = (1, 2)
_STEP_FILE = re.compile(r"^step-(\d{8,})\.pt$")
_ANY_STEP_FILE = re.compile(r"^step-(\d{8,})(?:\.r\d+)?\.pt$")


def capture_rng(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's random states as fixed-size tensors (same shapes on every rank,
    so they can be gathered): torch (CPU, and CUDA when training there), Python's
    ``random`` and NumPy's global generator, which data pipelines often use."""
    version, words, gauss = random.getstate()
    np_name, np_key, np_pos, np_has_gauss, np_gauss = numpy.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        # Mersenne Twister words and positions are < 2**32: exact in int64
        "python": torch.tensor([version, *words, gauss is not None], dtype=torch.int64),
        "python_gauss": torch.tensor([gauss or 0.0], dtype=torch.float64),
        "numpy": torch.tensor([*np_key.tolist(), np_pos, np_has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([np_gauss], dtype=torch.float64),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Undo ``capture_rng`` (one rank's entry)."""
    torch.set_rng_state(state["torch"])
    words = state["python"].tolist()
    gauss = float(state["python_gauss"][0]) if words[-1] else None
    random.setstate((words[0], tuple(words[1:-1]), gauss))
    key = state["numpy"].tolist()
    numpy.random.set_state(("MT19937", numpy.array(key[:-2], dtype=numpy.uint32), key[-2],
                            key[-1], float(state["numpy_gauss"][0])))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def model_signature(model: torch.nn.Module) -> list[list]:
    """[name, shape, dtype] of every state-dict entry: what a checkpoint must match."""
    return [[name, list(t.shape), str(t.dtype).replace("torch.", "")]
            for name, t in model.state_dict().items()]


def probe_location(storage: Storage, what: str, *, exclusive: bool = True) -> None:
    """Fail now, with a ConfigError, if ``storage`` cannot be written and read back.

    ``ferrosync.storage.engines.probe_location`` (the one probe every caller uses), called by
    the launcher or rank 0 before training, with ``what`` naming the location in the
    message ("sync URL", "checkpoint directory").
    """
    probe_storage(storage, None, what=what, exclusive=exclusive)


class Checkpoints:
    """Reads and writes checkpoints under one URL.

    Args:
        url: a directory or an fsspec URL (``s3://bucket/run/ckpt``).
        storage_options: passed to the fsspec filesystem (credentials, endpoint).
    """

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        if not isinstance(url, str) or not url.strip():
            raise ConfigError(f"checkpoint directory must be a non-empty string, got {url!r}")
        self.url = url.strip()
        self.storage = open_storage(self.url, storage_options)

    def probe(self) -> None:
        """Rank 0, before training: the location must accept writes."""
        # checkpoints are only ever overwritten: no exclusive create to require
        probe_location(self.storage, what="checkpoint directory", exclusive=False)

    def latest(self) -> dict | None:
        """The newest checkpoint's description (``latest.json``), or None if none."""
        try:
            raw = self.storage.read(LATEST)
        except (StorageError, OSError) as exc:
            raise ConfigError(f"cannot read checkpoints at {self.url} ({exc})",
                              hint="check the --checkpoint-dir URL and its permissions") from None
        if raw is None:
            return None
        try:
            meta = loads_bounded(raw.decode())
            int(meta["step"]), str(meta["file"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise ConfigError(
                f"{self.storage.path_of(LATEST)} is not a ferrosync checkpoint index",
                hint="point --checkpoint-dir at a directory written by ferrosync.train",
            ) from None
        if meta.get("format") != 1 and meta.get("checksum") != _index_checksum(meta):
            raise ConfigError(
                f"{self.storage.path_of(LATEST)} fails its checksum (step "
                f"{meta['step']}): it was damaged or edited after it was written; refused",
                hint=f"restore it from a copy, or {NEW_RUN}")
        return meta

    def require_latest(self) -> dict:
        """``latest()``, or a ConfigError telling the user how to start instead."""
        meta = self.latest()
        if meta is None:
            raise ConfigError(
                f"--resume: no checkpoint in {self.url}",
                hint="drop --resume to start from scratch, or point --checkpoint-dir at "
                "the run's checkpoint directory",
            )
        return meta

    def load(self, meta: dict) -> dict:
        """The checkpoint ``meta`` describes, loaded without unpickling code."""
        key = meta["file"]
        if not _STEP_FILE.match(key):
            raise ConfigError(f"{LATEST} at {self.url} names an unexpected file {key!r}",
                              hint="point --checkpoint-dir at a directory written by "
                              "ferrosync.train")
        return self._load_key(key, meta)

    def verify(self, meta: dict, world_size: int) -> None:
        """The launcher, before any rank starts: every file of the checkpoint ``meta``
        describes passes its checksum (read once, never unpickled), else the
        ``ConfigError`` a rank would raise, now."""
        key = meta["file"]
        if not _STEP_FILE.match(key):
            self.load(meta)  # the error for a foreign name
        files = [key] + ([self.rank_key(int(meta["step"]), r) for r in range(world_size)]
                         if meta.get("rank_files") else [])
        for name in files:
            self._verify(name, self._read(name, _declared(meta, name)), meta)

    def _load_key(self, key: str, meta: dict) -> dict:
        raw = self._read(key, _declared(meta, key))
        self._verify(key, raw, meta)
        try:
            # BytesIO shares the bytes (no copy): the tensors are the one other cost
            return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        # torch.load raises whatever its unpickler meets (UnpicklingError, RuntimeError,
        # EOFError, ...): each means a damaged or foreign file, named with its cause below
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(
                f"cannot load checkpoint {self.storage.path_of(key)} "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
                hint=f"it is damaged or not a ferrosync checkpoint; {NEW_RUN}",
            ) from None

    def _verify(self, key: str, raw: bytes, meta: dict) -> None:
        """``raw`` (the bytes of ``key``) matches the checksum ``meta`` declares for it,
        else a one-line ``ConfigError``. An index of format 1 predates checksums: its
        files load unverified, with a warning."""
        step, path = int(meta["step"]), self.storage.path_of(key)
        if meta.get("format") == 1:
            warnings.warn(f"checkpoint {path} (step {step}) was written before checkpoints "
                          "carried checksums: loaded unverified", RuntimeWarning, stacklevel=4)
            return
        sums = meta.get("xxh3")
        declared = sums.get(key) if isinstance(sums, dict) else None
        if not isinstance(declared, str):
            raise ConfigError(f"{LATEST} at {self.url} declares no checksum for {key!r} "
                              f"(step {step})", hint=_DAMAGED_HINT)
        found = checksum([raw])
        if found != declared:
            raise ConfigError(
                f"checkpoint {path} (step {step}) fails its checksum (xxh3 {found}, "
                f"{LATEST} declares {declared}): it was damaged after it was written; "
                "refused before loading", hint=_DAMAGED_HINT)

    def _read(self, key: str, declared: int | None) -> bytes:
        """The bytes of ``key``, refused unread when larger than ``declared`` (what
        ``latest.json`` says it holds; None for an index written before it said so,
        read whole as then)."""
        path = self.storage.path_of(key)
        try:
            raw = self.storage.read(key, max_bytes=declared)
        except ShardCorrupt:  # storage's size check, before a byte was read
            raise ConfigError(
                f"checkpoint {path} is larger than the {declared} bytes {LATEST} declares "
                "for it: it changed after it was written; refused unread",
                hint=f"restore the file that was written, or {NEW_RUN}") from None
        except MemoryError:  # only without a declared size: the allocation itself failed
            raise ConfigError(
                f"checkpoint {path} is larger than this host's memory",
                hint="it is damaged or not a ferrosync checkpoint; start without "
                "--resume") from None
        if raw is None:
            raise ConfigError(f"checkpoint {path} is missing",
                              hint="the directory was pruned by hand: restore the file "
                              f"or {NEW_RUN}")
        return raw

    @staticmethod
    def rank_key(step: int, rank: int) -> str:
        return f"step-{step:08d}.r{rank}.pt"

    def save_rank(self, step: int, rank: int, state: dict) -> tuple[int, str]:
        """Every rank (before rank 0's ``save`` of the same step): this rank's own state.
        Returns its size in bytes and its checksum, for ``save``'s ``rank_files``."""
        self.storage.makedirs("")
        return self._put(self.rank_key(step, rank), state)

    def load_rank(self, meta: dict, rank: int) -> dict:
        """This rank's file of the checkpoint ``meta`` describes (see ``save_rank``)."""
        return self._load_key(self.rank_key(int(meta["step"]), rank), meta)

    def _put(self, key: str, state: dict) -> tuple[int, str]:
        """Write ``state`` (torch.save) as ``key``; (bytes written, their checksum)."""
        buffer = io.BytesIO()
        torch.save(state, buffer)
        payload = buffer.getbuffer()
        return self.storage.put(key, [payload]), checksum([payload])

    def save(self, state: dict, meta: dict, *, keep: int = 2,
             rank_files: dict[str, tuple[int, str]] | None = None) -> str:
        """Rank 0: publish ``state`` as ``step-<step>.pt``, then point ``latest.json`` at
        it, then delete all but the newest ``keep`` checkpoints. Returns the file's path.
        ``rank_files``: the size and checksum of every rank file of this step, as its
        writer wrote it (``save_rank``'s answers, gathered); ``latest.json`` declares them.
        """
        step = int(meta["step"])
        key = f"step-{step:08d}.pt"
        self.storage.makedirs("")
        written = {**(rank_files or {}), key: self._put(key, state)}
        listing = self.storage.list("")
        files = [(int(m.group(1)), name, size) for name, size in listing
                 if "/" not in name and (m := _ANY_STEP_FILE.match(name))]
        # the sizes and checksums readers are held to: every file of this step as its
        # writer wrote it
        meta = {**meta, "format": FORMAT, "file": key,
                "bytes": {name: size for name, (size, _) in written.items()},
                "xxh3": {name: digest for name, (_, digest) in written.items()}}
        meta["checksum"] = _index_checksum(meta)
        # latest.json only after the checkpoint itself is complete: a crash between
        # the two leaves the previous (whole) checkpoint as the latest
        self.storage.put(LATEST, [json.dumps(meta, sort_keys=True).encode()])
        self._prune(keep, step, [(s, name) for s, name, _ in files], listing)
        return self.storage.path_of(key)

    def _prune(self, keep: int, newest: int, files: list[tuple[int, str]],
               listing: list[tuple[str, int]]) -> None:
        complete = sorted({step for step, name in files
                           if step <= newest and _STEP_FILE.match(name)})
        kept = set(complete[-keep:] if keep > 0 else [])
        # files of older steps go, rank files of a step whose main file never
        # appeared (a crash mid-checkpoint) too; never anything newer than this one
        doomed = [name for step, name in files if step <= newest and step not in kept]
        # with the parts of those written in parts by an earlier run (storage/engines/parts.py)
        self.storage.delete(doomed + listed_parts(listing, doomed))


_DAMAGED_HINT = (f"restore the file from a copy, or {NEW_RUN} (the older "
                 "step-*.pt files beside it are not "
                 "indexed by latest.json); check the disk or store that holds "
                 "--checkpoint-dir")


def checksum(parts) -> str:
    """The hex xxh3-64 of ``parts`` (``wire.PayloadDigest``, the store's checksum)."""
    digest = PayloadDigest(None)
    for part in parts:
        digest.update(part)
    return digest.xxh3().hex()


def _index_checksum(meta: dict) -> str:
    """The checksum of ``meta`` without its own, as canonical JSON: what latest.json's
    ``checksum`` must say."""
    return checksum([json.dumps({k: v for k, v in meta.items() if k != "checksum"},
                                sort_keys=True).encode()])


def _declared(meta: dict, key: str) -> int | None:
    """The size ``meta`` (``latest.json``) declares for ``key``; None where it declares
    none (an index written before sizes were). A malformed declaration is a
    ``ConfigError``."""
    sizes = meta.get("bytes")
    size = None if sizes is None else sizes.get(key) if isinstance(sizes, dict) else sizes
    if size is None:
        return None
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ConfigError(f"{LATEST} declares no valid size for {key!r} ({size!r})",
                          hint="point --checkpoint-dir at a directory written by "
                          "ferrosync.train")
    return size


def check_compatible(meta: dict, *, model: torch.nn.Module, world_size: int, strategy: str,
                     url: str) -> None:
    """Raise ConfigError unless the checkpoint ``meta`` fits this run."""
    if meta.get("format") not in READABLE_FORMATS:
        raise ConfigError(f"checkpoint at {url} has format {meta.get('format')!r}, this "
                          f"version reads {READABLE_FORMATS}", hint="resume with the "
                          f"ferrosync version that wrote it, or {NEW_RUN}")
    theirs = {name: (shape, dtype) for name, shape, dtype in meta.get("model", [])}
    ours = {name: (shape, dtype) for name, shape, dtype in model_signature(model)}
    if theirs != ours:
        missing = sorted(set(ours) - set(theirs))
        extra = sorted(set(theirs) - set(ours))
        changed = sorted(n for n in set(ours) & set(theirs) if ours[n] != theirs[n])
        if changed:
            detail = (f"{changed[0]!r} is {theirs[changed[0]]} there and "
                      f"{ours[changed[0]]} here")
        elif missing:
            detail = f"it lacks {missing[0]!r}"
        else:
            detail = f"it has {extra[0]!r}, which this model lacks"
        raise ConfigError(
            f"checkpoint at {url} was written for a different model ({detail})",
            hint="resume with the same --model, or point --checkpoint-dir at a fresh directory",
        )
    if int(meta.get("world_size", world_size)) != world_size:
        raise ConfigError(
            f"checkpoint at {url} was written by {meta['world_size']} ranks, this run has "
            f"{world_size}",
            hint=f"resume with {meta['world_size']} ranks (the data order and every rank's "
            f"random state depend on it), or {NEW_RUN}",
        )
    if meta.get("strategy", strategy) != strategy:
        raise ConfigError(
            f"checkpoint at {url} was written with --strategy {meta['strategy']}, this run "
            f"uses {strategy}", hint=f"resume with --strategy {meta['strategy']}",
        )
