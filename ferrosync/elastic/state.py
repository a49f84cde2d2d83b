"""The minimal state bootstrap of an elastic job (docs/elastic.md#state).

A member publishes tensors as ``state.{r}`` (one sealed object: a ``wire`` header,
whose layout digest covers the tensors' dtypes and shapes, then their raw bytes in
order) and then points ``state`` at it; a joiner reads the pointer, then the object,
and verifies both before copying a byte. Writing the object before the pointer means
a pointer never names a state that was not completely written. The publisher deletes
the state it published before, so a reader may find the pointer's object gone: it
then reads the pointer again (bounded by the timeout).
"""

from __future__ import annotations

import json
import time
import warnings

import torch

from .. import names
from ..codecs import CODEC_RAW, as_uint8
from ..errors import LayoutMismatch, ShardCorrupt, SyncTimeout
from ..flat import check_tensors, layout_signature
from ..storage import Storage
from ..wire import (
    DTYPE_CODES,
    KIND_BROADCAST,
    Header,
    PayloadCheck,
    decode_record,
    encode_record,
    layout_digest,
    parse_header,
    seal,
)

_UINT8 = DTYPE_CODES[torch.uint8]


def _digest(tensors: list[torch.Tensor]) -> bytes:
    return layout_digest(json.dumps({"op": "elastic_state", "tensors": layout_signature(tensors)}))


class StateStore:
    """Publishes and fetches the job's state objects in one elastic namespace."""

    def __init__(self, storage: Storage, namespace: str, secret: bytes | None) -> None:
        self._storage = storage
        self._ns = namespace
        self._secret = secret
        self._published: str | None = None  # the key this member published last

    def _key(self, name: str) -> str:
        return names.within(self._ns, name)

    def publish(self, tensors: list[torch.Tensor], round_: int, rank: int) -> int:
        check_tensors(tensors, op="publish_state", rank=rank, path=self._storage.url,
                      in_place=False, dtypes=tuple(DTYPE_CODES))
        parts = [as_uint8(t.detach().contiguous().cpu()).numpy() for t in tensors
                 if t.numel()]
        nbytes = sum(p.nbytes for p in parts)
        header = Header(kind=KIND_BROADCAST, dtype=_UINT8, codec=CODEC_RAW, rank=rank,
                        world_size=0, generation=round_, collective=round_, count=nbytes,
                        offset=0, total=nbytes, weight=0.0, layout=_digest(tensors),
                        payload_nbytes=nbytes)
        key = self._key(names.elastic_state(round_))
        self._storage.put(key, [seal(header, parts, self._secret), *parts])
        self._storage.put(self._key(names.ELASTIC_STATE_POINTER),
                          [encode_record({"round": round_}, self._secret)])
        if self._published is not None and self._published != key:
            self._storage.delete([self._published])
        self._published = key
        return round_

    def _pointer(self) -> int | None:
        key = self._key(names.ELASTIC_STATE_POINTER)
        raw = self._storage.read(key)
        if raw is None:
            return None
        record = decode_record(raw, self._secret, path=self._storage.path_of(key))
        value = record.get("round")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ShardCorrupt("the state pointer is malformed", path=self._storage.path_of(key),
                               hint="let nothing else write under this URL")
        return value

    def fetch(self, tensors: list[torch.Tensor], deadline: float, rank: int) -> int | None:
        check_tensors(tensors, op="fetch_state", rank=rank, path=self._storage.url,
                      in_place=True, dtypes=tuple(DTYPE_CODES))
        while True:
            round_ = self._pointer()
            if round_ is None:
                return None
            key = self._key(names.elastic_state(round_))
            raw = self._storage.read(key)
            if raw is not None:
                break
            if time.monotonic() > deadline:  # replaced faster than we can read it
                raise SyncTimeout("the published state kept being replaced while read",
                                  rank=rank, path=self._storage.path_of(key),
                                  hint="publish state less often, or raise timeout")
            time.sleep(0.01)
        path = self._storage.path_of(key)
        header = parse_header(raw, path=path, rank=rank, key=self._secret)
        check = PayloadCheck(header, raw[:header.size], self._secret, path, rank)
        payload = memoryview(raw)[header.size:]
        check.update(payload)
        check.finish()
        if header.layout != _digest(tensors):
            raise LayoutMismatch("the published state has other dtypes or shapes than the "
                                 "tensors given", rank=rank, path=path,
                                 hint="fetch into tensors shaped like the published ones")
        expected = sum(t.numel() * t.element_size() for t in tensors)
        if header.kind != KIND_BROADCAST or header.generation != round_ or (
                header.payload_nbytes != expected):
            raise ShardCorrupt(f"state object does not match round {round_}", rank=rank,
                               path=path, hint="let nothing else write under this URL")
        offset = 0
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # read-only buffer: only ever read
            for t in tensors:
                n = t.numel() * t.element_size()
                if n:
                    chunk = torch.frombuffer(payload[offset:offset + n], dtype=torch.uint8)
                    t.copy_(chunk.view(t.dtype).view(t.shape))
                offset += n
        return round_
