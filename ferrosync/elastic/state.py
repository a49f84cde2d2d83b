"""The state bootstrap of an elastic job (docs/elastic.md#state).

A member publishes tensors as ``state.{r}`` (one sealed object: a ``wire`` header,
whose layout digest covers the tensors' dtypes and shapes, then their raw bytes in
order) and then points ``state`` at it. The pointer is a sealed control record that
also carries the *manifest* (each tensor's name, dtype and shape) and a small JSON
``meta`` dict, so a joiner that does not know the layout yet (an optimizer whose
state is created lazily, a step counter) can allocate the tensors itself: nothing
read from the store is unpickled, and dtypes come from a fixed list.

Writing the object before the pointer means a pointer never names a state that was
not completely written. The publisher deletes the state it published before, so a
reader may find the pointer's object gone: it then reads the pointer again (bounded
by the timeout).
"""

from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import dataclass

import torch

from .. import names
from ..codecs import CODEC_RAW, as_uint8
from ..errors import LayoutMismatch, ShardCorrupt, SyncTimeout
from ..flat import check_tensors, layout_signature
from ..storage import Backoff, Storage
from ..wire import (
    DTYPE_CODES,
    HEADER_SIZE,
    KIND_BROADCAST,
    MAC_SIZE,
    Header,
    PayloadCheck,
    decode_record,
    encode_record,
    layout_digest,
    parse_header,
    seal,
)
from .rounds import read_sized

_UINT8 = DTYPE_CODES[torch.uint8]
#: the dtypes a manifest may name, by name (a fixed list: nothing else is constructed)
_DTYPES = {str(d).replace("torch.", ""): d for d in DTYPE_CODES}
#: how often a reader waiting for a newer state reads the pointer (first, longest; s)
_POLL = (0.02, 0.5)
#: the largest state ``read_state`` allocates unless told otherwise (``max_bytes``)
DEFAULT_MAX_STATE_BYTES = 16 << 30


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


class StateStore:
    """Publishes and fetches the job's state objects in one elastic namespace."""

    def __init__(self, storage: Storage, namespace: str, secret: bytes | None) -> None:
        self._storage = storage
        self._ns = namespace
        self._secret = secret
        self._published: str | None = None  # the key this member published last

    def _key(self, name: str) -> str:
        return names.within(self._ns, name)

    def publish(self, tensors, round_: int, rank: int, meta: dict | None = None) -> int:
        labels, tensors = _named(tensors)
        check_tensors(tensors, op="publish_state", rank=rank, path=self._storage.url,
                      in_place=False, dtypes=tuple(DTYPE_CODES))
        meta = dict(meta or {})
        try:
            json.dumps(meta, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"publish_state meta must be plain JSON: {exc}") from None
        parts = [as_uint8(t.detach().contiguous().cpu()).numpy() for t in tensors
                 if t.numel()]
        nbytes = sum(p.nbytes for p in parts)
        header = Header(kind=KIND_BROADCAST, dtype=_UINT8, codec=CODEC_RAW, rank=rank,
                        world_size=0, generation=round_, collective=round_, count=nbytes,
                        offset=0, total=nbytes, weight=0.0, layout=_digest(tensors),
                        payload_nbytes=nbytes)
        key = self._key(names.elastic_state(round_))
        self._storage.put(key, [seal(header, parts, self._secret), *parts])
        manifest = {"names": labels,
                    "dtypes": [str(t.dtype).replace("torch.", "") for t in tensors],
                    "shapes": [list(t.shape) for t in tensors]}
        self._storage.put(self._key(names.ELASTIC_STATE_POINTER),
                          [encode_record({"round": round_, "manifest": manifest, "meta": meta},
                                         self._secret)])
        if self._published is not None and self._published != key:
            self._storage.delete([self._published])
        self._published = key
        return round_

    def _pointer(self, rank: int) -> dict | None:
        key = self._key(names.ELASTIC_STATE_POINTER)
        raw = self._storage.read(key)
        if raw is None:
            return None
        record = decode_record(raw, self._secret, path=self._storage.path_of(key), rank=rank)
        value = record.get("round")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ShardCorrupt("the state pointer is malformed", rank=rank,
                               path=self._storage.path_of(key),
                               hint="let nothing else write under this URL")
        return record

    def _object(self, deadline: float, rank: int, min_round: int | None, size_of,
                give_up=None):
        """(pointer record, verified header, payload) of the newest state, waiting until
        deadline for one published after ``min_round``; None if none was published.
        ``size_of(pointer)`` is the payload's size the reader expects (from its own
        tensors, or the manifest checked against its bound): the object is read only
        at that size. ``give_up()``, asked while waiting, raises to end the wait early."""
        head = HEADER_SIZE + (MAC_SIZE if self._secret is not None else 0)
        backoff = Backoff(*_POLL)
        while True:
            pointer = self._pointer(rank)
            fresh = pointer is not None and (min_round is None or pointer["round"] >= min_round)
            if fresh:
                key = self._key(names.elastic_state(pointer["round"]))
                raw = read_sized(self._storage, key, (head + size_of(pointer),), rank=rank)
                if raw is not None:
                    break
            elif min_round is None:
                return None
            if time.monotonic() > deadline:
                want = (f"a state published after round {min_round}" if not fresh
                        else "a state that is not replaced while it is read")
                raise SyncTimeout(f"waited for {want}", rank=rank,
                                  path=self._storage.path_of(
                                      self._key(names.ELASTIC_STATE_POINTER)),
                                  hint="the members publish state after each round that "
                                  "admits a joiner; check that one of them is running")
            if give_up is not None and not fresh:
                give_up()
            backoff.sleep(deadline)
        path = self._storage.path_of(key)
        header = parse_header(raw, path=path, rank=rank, key=self._secret)
        check = PayloadCheck(header, raw[:header.size], self._secret, path, rank)
        payload = memoryview(raw)[header.size:]
        check.update(payload)
        check.finish()
        if header.kind != KIND_BROADCAST or header.generation != pointer["round"]:
            raise ShardCorrupt(f"state object does not match round {pointer['round']}",
                               rank=rank, path=path, hint="let nothing else write under this URL")
        return pointer, header, payload, path

    def fetch(self, tensors, deadline: float, rank: int) -> int | None:
        _, tensors = _named(tensors)
        check_tensors(tensors, op="fetch_state", rank=rank, path=self._storage.url,
                      in_place=True, dtypes=tuple(DTYPE_CODES))
        nbytes = sum(t.numel() * t.element_size() for t in tensors)

        def size_of(pointer):
            manifest_bytes(pointer, rank, self._storage.url, None)  # a valid manifest
            return nbytes  # what these tensors hold: another size is another layout

        try:
            found = self._object(deadline, rank, None, size_of)
        except ShardCorrupt as exc:
            if "bytes; an object of this round has" in exc.what:
                raise LayoutMismatch("the published state has other dtypes or shapes than "
                                     "the tensors given", rank=rank, path=exc.path,
                                     hint="fetch into tensors shaped like the published "
                                     "ones") from None
            raise
        if found is None:
            return None
        pointer, header, payload, path = found
        if header.layout != _digest(tensors):
            raise LayoutMismatch("the published state has other dtypes or shapes than the "
                                 "tensors given", rank=rank, path=path,
                                 hint="fetch into tensors shaped like the published ones")
        _copy_into(tensors, header, payload, rank, path)
        return pointer["round"]

    def read(self, deadline: float, rank: int, min_round: int | None,
             give_up=None, max_bytes: int = DEFAULT_MAX_STATE_BYTES) -> PublishedState | None:
        found = self._object(
            deadline, rank, min_round,
            lambda pointer: manifest_bytes(pointer, rank, self._storage.url, max_bytes),
            give_up)
        if found is None:
            return None
        pointer, header, payload, path = found
        labels, tensors = _from_manifest(pointer, rank, path)
        if header.layout != _digest(tensors):  # binds the manifest to the object
            raise ShardCorrupt("the state pointer's manifest does not describe the state "
                               "object", rank=rank, path=path,
                               hint="let nothing else write under this URL")
        _copy_into(tensors, header, payload, rank, path)
        meta = pointer.get("meta", {})
        return PublishedState(pointer["round"], dict(zip(labels, tensors)),
                              meta if isinstance(meta, dict) else {})


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


def _from_manifest(pointer: dict, rank: int, path: str) -> tuple[list[str], list[torch.Tensor]]:
    """Empty tensors as the pointer's manifest describes them: called only once the
    manifest was checked (``manifest_bytes``) and the object of that size verified."""
    _check_manifest(pointer, rank, path)
    manifest = pointer["manifest"]
    return manifest["names"], [torch.empty(s, dtype=_DTYPES[d])
                               for d, s in zip(manifest["dtypes"], manifest["shapes"])]


def _copy_into(tensors: list[torch.Tensor], header: Header, payload, rank: int,
               path: str) -> None:
    expected = sum(t.numel() * t.element_size() for t in tensors)
    if header.payload_nbytes != expected:
        raise ShardCorrupt(f"state object holds {header.payload_nbytes} bytes, its layout "
                           f"{expected}", rank=rank, path=path,
                           hint="let nothing else write under this URL")
    offset = 0
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # read-only buffer: only ever read
        for t in tensors:
            n = t.numel() * t.element_size()
            if n:
                chunk = torch.frombuffer(payload[offset:offset + n], dtype=torch.uint8)
                t.copy_(chunk.view(t.dtype).view(t.shape))
            offset += n
