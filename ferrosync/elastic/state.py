"""The state bootstrap of an elastic job: published tensors for newcomers
(docs/elastic.md#state).

A member writes the state as sealed parts ``state.{r}.{i}`` and then points ``state`` at
them with a record carrying the manifest (names, dtypes, shapes) and a JSON ``meta``:
nothing is unpickled, and a pointer never names a state not completely written. A
reader streams and verifies every part before it hands anything out.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from ferrosync.compression.codecs import CODEC_RAW, as_uint8
from ferrosync.core.flat import check_tensors, layout_signature
from ferrosync.errors import LayoutMismatch, ShardCorrupt, SyncTimeout
from ferrosync.storage import names
from ferrosync.storage.wire import DTYPE_CODES, KIND_BROADCAST, Header, layout_digest

_UINT8 = DTYPE_CODES[torch.uint8]
#: the dtypes a manifest may name, by name (a fixed list: nothing else is constructed)
_DTYPES = {str(d).replace("torch.", ""): d for d in DTYPE_CODES}
#: how often a reader waiting for a newer state reads the pointer (first, longest; s)
_POLL = (0.02, 0.5)
#: the largest state ``read_state`` allocates unless told otherwise (``max_bytes``)
DEFAULT_MAX_STATE_BYTES = 16 << 30
#: a state's parts: an eighth of it, within these bounds (bytes)
PART_BYTES = (1 << 20, 64 << 20)


def part_bytes(total: int) -> int:
    """The size of each part (the last may be shorter) of a state of ``total`` bytes."""
    return min(max(total // 8, PART_BYTES[0]), PART_BYTES[1])


def _spans(total: int, part: int) -> list[tuple[int, int]]:
    """(first byte, end byte) of each part of a ``total``-byte stream."""
    return [(lo, min(lo + part, total)) for lo in range(0, total, part)] or [(0, 0)]


def _views(buffers: list, lo: int, hi: int) -> list:
    """Byte views of ``buffers`` (one stream, in order) covering [lo, hi)."""
    out, start = [], 0
    for buf in buffers:
        end = start + len(buf)
        if end > lo and start < hi:
            out.append(buf[max(lo, start) - start:min(hi, end) - start])
        start = end
    return out


@dataclass(frozen=True)
class PublishedState:
    """What ``ElasticSync.read_state`` returns: the round the state was published
    after, its tensors by name (in published order), and the publisher's ``meta``."""

    round: int
    tensors: dict[str, torch.Tensor]
    meta: dict


def _digest(tensors: list[torch.Tensor]) -> bytes:
    return layout_digest(json.dumps({"op": "elastic_state", "tensors": layout_signature(tensors)}))


def _named(tensors) -> tuple[list[str], list[torch.Tensor]]:
    """(names, tensors) of a list (named "0", "1", ...) or a dict of tensors."""
    if isinstance(tensors, dict):
        if not all(isinstance(k, str) for k in tensors):
            raise TypeError("state tensor names must be strings")
        return list(tensors), list(tensors.values())
    tensors = list(tensors)
    return [str(i) for i in range(len(tensors))], tensors


class StatePublisher:
    """Publishes and reads the job's state objects through the job's object layer."""

    def __init__(self, objects) -> None:
        self._objects = objects
        self._published: list[str] = []  # the keys of what this member published last

    def publish(self, tensors, round_: int, rank: int, meta: dict | None = None) -> int:
        labels, tensors = _named(tensors)
        check_tensors(tensors, op="publish_state", rank=rank, path=self._objects.storage.url,
                      in_place=False, dtypes=tuple(DTYPE_CODES))
        meta = dict(meta or {})
        try:
            json.dumps(meta, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"publish_state meta must be plain JSON: {exc}") from None
        buffers = [as_uint8(t.detach().contiguous().cpu()).numpy() for t in tensors
                   if t.numel()]
        nbytes = sum(b.nbytes for b in buffers)
        spans = _spans(nbytes, part_bytes(nbytes))
        digest = _digest(tensors)
        keys = []
        for i, (lo, hi) in enumerate(spans):
            # the header names the round in its generation field (not the job's tag, as
            # a contribution does): the pointer says which round to expect
            header = Header(kind=KIND_BROADCAST, dtype=_UINT8, codec=CODEC_RAW, rank=rank,
                            world_size=0, generation=round_, collective=round_,
                            count=hi - lo, offset=lo, total=nbytes, weight=0.0,
                            layout=digest, payload_nbytes=hi - lo, slice=i,
                            nslices=len(spans))
            name = names.elastic_state(round_, i)
            self._objects.put(name, header, _views(buffers, lo, hi))
            keys.append(self._objects.key_of(name))
        manifest = {"names": labels,
                    "dtypes": [str(t.dtype).replace("torch.", "") for t in tensors],
                    "shapes": [list(t.shape) for t in tensors]}
        self._objects.put_record(names.ELASTIC_STATE_POINTER,
                                 {"round": round_, "manifest": manifest, "meta": meta,
                                  "parts": len(spans)})
        old = [k for k in self._published if k not in keys]
        if old:
            self._objects.storage.delete(old)
        self._published = keys
        return round_

    def _pointer(self, rank: int) -> dict | None:
        record = self._objects.read_record(names.ELASTIC_STATE_POINTER)
        if record is None:
            return None
        value = record.get("round")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ShardCorrupt("the state pointer is malformed", rank=rank,
                               path=self._objects.path_of(names.ELASTIC_STATE_POINTER),
                               hint="let nothing else write under this URL")
        return record

    def _read(self, deadline: float, rank: int, min_round: int | None, allocate,
              give_up=None):
        """(pointer, tensors) of the newest state, waiting until ``deadline`` for one
        published after ``min_round``; None if none was published (and ``min_round`` is
        None). ``allocate(pointer)`` checks the pointer's manifest and returns the
        tensors to read the object into, whose dtypes and shapes the object must have;
        they are returned only once the object's checksum or MAC verified.
        ``give_up()``, asked while waiting, raises to end the wait early."""
        objects = self._objects
        seen = {"fresh": False}

        def attempt():
            pointer = self._pointer(rank)
            seen["fresh"] = pointer is not None and (min_round is None
                                                     or pointer["round"] >= min_round)
            if not seen["fresh"]:
                return () if min_round is None else None
            tensors = allocate(pointer)
            if not self._read_parts(pointer, tensors, rank):
                return None  # replaced by a newer state meanwhile: read the pointer again
            return pointer, tensors

        def between():
            if give_up is not None and not seen["fresh"]:
                give_up()

        def expired():
            want = (f"a state published after round {min_round}" if not seen["fresh"]
                    else "a state that is not replaced while it is read")
            return SyncTimeout(f"waited for {want}", rank=rank,
                               path=objects.path_of(names.ELASTIC_STATE_POINTER),
                               hint="the members publish state after each round that "
                               "admits a joiner; check that one of them is running")

        found = objects.wait_for(attempt, deadline=deadline, expired=expired,
                                 between=between, poll=_POLL)
        return found or None

    def _read_parts(self, pointer: dict, tensors: list[torch.Tensor], rank: int) -> bool:
        """Read every part of the state ``pointer`` names into ``tensors`` (False when a
        part is gone: a newer state replaced it), each at exactly the size its place in
        the stream gives, its header checked against that place and the tensors'
        layout, its checksum or MAC verified as its bytes arrive."""
        objects, round_ = self._objects, pointer["round"]
        buffers = [as_uint8(t).numpy() for t in tensors if t.numel()]
        nbytes, digest = sum(b.nbytes for b in buffers), _digest(tensors)
        parts = pointer.get("parts")
        if parts is None:  # one object, as an older publisher wrote it
            spans, names_ = [(0, nbytes)], [names.elastic_state(round_)]
        else:
            spans = _spans(nbytes, part_bytes(nbytes))
            names_ = [names.elastic_state(round_, i) for i in range(len(spans))]
            if parts != len(spans):
                raise ShardCorrupt(f"the state pointer of round {round_} names {parts!r} "
                                   f"parts, its manifest {len(spans)}", rank=rank,
                                   path=objects.path_of(names.ELASTIC_STATE_POINTER),
                                   hint="let nothing else write under this URL")
        for i, ((lo, hi), name) in enumerate(zip(spans, names_)):
            incoming = objects.open_object(name, max_bytes=objects.head + hi - lo,
                                           collective=round_, tag=round_)
            if incoming is None:
                return False
            with incoming:
                h = incoming.header
                if h.layout != digest:  # binds the manifest to the object
                    raise ShardCorrupt("the state pointer's manifest does not describe the "
                                       "state object", rank=rank, path=incoming.path,
                                       hint="let nothing else write under this URL")
                place = (h.offset, h.count, h.total, h.slice, h.nslices)
                if (h.kind != KIND_BROADCAST or h.payload_nbytes != hi - lo
                        or place != (lo, hi - lo, nbytes, i, len(spans))):
                    raise ShardCorrupt(
                        f"state object does not match round {round_}'s manifest "
                        f"({h.payload_nbytes} bytes at {h.offset}, {hi - lo} expected at "
                        f"{lo})", rank=rank, path=incoming.path,
                        hint="let nothing else write under this URL")
                incoming.read_into_buffers(_views(buffers, lo, hi))
        return True

    def fetch(self, tensors, deadline: float, rank: int) -> int | None:
        _, tensors = _named(tensors)
        check_tensors(tensors, op="fetch_state", rank=rank, path=self._objects.storage.url,
                      in_place=True, dtypes=tuple(DTYPE_CODES))
        signature = layout_signature(tensors)

        def allocate(pointer):
            manifest_bytes(pointer, rank, self._objects.storage.url, None)  # a valid one
            if _signature(pointer) != signature:
                raise LayoutMismatch("the published state has other dtypes or shapes than "
                                     "the tensors given", rank=rank,
                                     path=self._objects.path_of(names.ELASTIC_STATE_POINTER),
                                     hint="fetch into tensors shaped like the published "
                                     "ones")
            # one copy to read into: the caller's tensors change only once it verified
            return [torch.empty(t.shape, dtype=t.dtype) for t in tensors]

        found = self._read(deadline, rank, None, allocate)
        if found is None:
            return None
        pointer, fresh = found
        with torch.no_grad():
            for t, f in zip(tensors, fresh):
                t.copy_(f)
        return pointer["round"]

    def read(self, deadline: float, rank: int, min_round: int | None,
             give_up=None, max_bytes: int = DEFAULT_MAX_STATE_BYTES) -> PublishedState | None:
        def allocate(pointer):
            manifest_bytes(pointer, rank, self._objects.storage.url, max_bytes)
            manifest = pointer["manifest"]
            return [torch.empty(s, dtype=_DTYPES[d])
                    for d, s in zip(manifest["dtypes"], manifest["shapes"])]

        found = self._read(deadline, rank, min_round, allocate, give_up)
        if found is None:
            return None
        pointer, tensors = found
        meta = pointer.get("meta", {})
        return PublishedState(pointer["round"], dict(zip(pointer["manifest"]["names"], tensors)),
                              meta if isinstance(meta, dict) else {})


def _signature(pointer: dict) -> list[str]:
    """The layout signature of the tensors a (checked) manifest describes."""
    manifest = pointer["manifest"]
    return layout_signature([torch.empty(s, dtype=_DTYPES[d], device="meta")
                             for d, s in zip(manifest["dtypes"], manifest["shapes"])])


def manifest_bytes(pointer: dict, rank: int, path: str, max_bytes: int | None) -> int:
    """The bytes the pointer's manifest declares, checked as untrusted input before
    anything is read or allocated by it: ``ShardCorrupt`` if it is malformed, or if it
    declares more than ``max_bytes`` (the largest state the reader accepts)."""
    _check_manifest(pointer, rank, path)
    manifest = pointer["manifest"]
    nbytes = sum(math.prod(s) * _DTYPES[d].itemsize
                 for d, s in zip(manifest["dtypes"], manifest["shapes"]))
    if max_bytes is not None and nbytes > max_bytes:
        raise ShardCorrupt(f"the state's manifest declares {nbytes} bytes, more than the "
                           f"{max_bytes} this reader accepts", rank=rank, path=path,
                           hint="let nothing else write under this URL; pass a larger "
                           "max_bytes to read_state for a state that large")
    return nbytes


def _check_manifest(pointer: dict, rank: int, path: str) -> None:
    manifest = pointer.get("manifest")
    try:
        labels, dtypes, shapes = manifest["names"], manifest["dtypes"], manifest["shapes"]
        ok = (len(labels) == len(dtypes) == len(shapes)
              and all(isinstance(n, str) for n in labels) and len(set(labels)) == len(labels)
              and all(d in _DTYPES for d in dtypes)
              and all(isinstance(s, list) and all(
                  isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**40 for x in s)
                  for s in shapes))
    except (TypeError, KeyError):
        ok = False
    if ok:  # the whole state must fit in memory: refuse an absurd size before allocating
        ok = sum(math.prod(s) * _DTYPES[d].itemsize for d, s in zip(dtypes, shapes)) < 2**42
    if not ok:
        raise ShardCorrupt("the state pointer carries no valid manifest (published by an "
                           "older ferrosync, or garbled)", rank=rank, path=path,
                           hint="publish the state again with this version")
