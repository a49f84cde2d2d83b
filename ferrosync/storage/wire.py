"""The on-storage object format: a fixed 112-byte header, an optional MAC, then a raw
payload; and the JSON control records.

Fields, checks and records: docs/design.md#object-header, docs/design.md#header-checks,
docs/design.md#control-records. Nothing here is ever unpickled; with a secret a forged
or altered object is refused before a byte of it is trusted.
"""

from __future__ import annotations

import hmac
import json
import re
import struct
import sys
import zlib
from dataclasses import dataclass, replace

import numpy as np
import xxhash

# the dtype codes and the layout digest are the collective's (``core/flat.py``); objects
# carry them, and the layers above take them from here with the rest of the format
from ferrosync.core.flat import DTYPE_CODES, layout_digest  # noqa: F401
from ferrosync.errors import ShardCorrupt
from ferrosync.storage.engines import RECORD_LIMIT

MAGIC = b"FSYN"
VERSION = 1
HEADER = struct.Struct("<4sHHBBBBIIIIIQQQQQd8sQ8sII")
HEADER_SIZE = HEADER.size  # 112
MAC_SIZE = 32
_CRC_SPAN = 104  # header bytes covered by the header crc32

FLAG_AUTH = 1  # a MAC follows the header
FLAG_EMPTY = 2  # no payload: the writer's weight is zero (or the tensors are empty,
               # as in a barrier: an average of no elements)
FLAG_UNCHANGED = 4  # result: total weight was zero; every rank keeps its tensors
_KNOWN_FLAGS = FLAG_AUTH | FLAG_EMPTY | FLAG_UNCHANGED

KIND_CONTRIB = 1
KIND_RESULT = 2
KIND_BROADCAST = 3
KIND_ERROR = 4
KIND_NAMES = {1: "contribution", 2: "result", 3: "broadcast", 4: "error"}

CHECKSUM_XXH3 = 1
CHECKSUM_HMAC = 2

# the header's dtype codes (``core/flat.py``): a code read from an object -> its dtype
DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def head_size(authenticated) -> int:
    """Bytes before an object's payload: the fixed header, plus the MAC when the object
    is authenticated (``authenticated``: the job's key, or a truthy flag). The one
    home of this rule: every bound on an object's size starts from it."""
    return HEADER_SIZE + (MAC_SIZE if authenticated else 0)


if sys.byteorder != "little":  # pragma: no cover - no big-endian torch targets today
    raise ImportError("ferrosync's wire format is little-endian; this host is big-endian")


@dataclass(frozen=True)
class Header:
    kind: int
    dtype: int
    codec: int
    rank: int
    world_size: int
    generation: int
    collective: int
    count: int
    offset: int
    total: int
    weight: float
    layout: bytes
    payload_nbytes: int
    flags: int = 0
    slice: int = 0
    nslices: int = 1
    block: int = 0
    checksum_kind: int = CHECKSUM_XXH3
    checksum: bytes = b"\0" * 8
    version: int = VERSION

    @property
    def size(self) -> int:
        """Bytes before the payload: the fixed header plus the MAC, if any."""
        return head_size(self.flags & FLAG_AUTH)

    def pack(self) -> bytes:
        fixed = HEADER.pack(
            MAGIC, self.version, self.flags, self.kind, self.dtype, self.codec,
            self.checksum_kind, self.rank, self.world_size, self.slice, self.nslices,
            self.block, self.generation, self.collective, self.count, self.offset,
            self.total, float(self.weight), self.layout, self.payload_nbytes,
            self.checksum, 0, 0,
        )
        crc = zlib.crc32(fixed[:_CRC_SPAN])
        return fixed[:_CRC_SPAN] + struct.pack("<II", crc, 0)


class PayloadDigest:
    """Streaming integrity check over header + payload: xxh3, or HMAC with a key."""

    def __init__(self, key: bytes | None) -> None:
        self.key = key
        self._h = hmac.new(key, digestmod="sha256") if key else xxhash.xxh3_64()

    def update(self, chunk) -> None:
        self._h.update(chunk)

    def xxh3(self) -> bytes:
        return self._h.digest() if not self.key else b"\0" * 8

    def mac(self, header_bytes: bytes) -> bytes:
        """The MAC binds the (checksum-free) fixed header to the payload digest."""
        assert self.key is not None
        payload_mac = self._h.digest()
        return hmac.new(self.key, header_bytes + payload_mac, "sha256").digest()


def seal(header: Header, payload_parts, key: bytes | None) -> bytes:
    """Finish ``header`` for ``payload_parts`` and return the bytes to write first.

    Computes the payload checksum (or MAC) in one pass over the parts.
    """
    digest = PayloadDigest(key)
    for part in payload_parts:
        digest.update(part)
    if key is None:
        head = replace(header, checksum_kind=CHECKSUM_XXH3, checksum=digest.xxh3())
        return head.pack()
    head = replace(
        header, flags=header.flags | FLAG_AUTH, checksum_kind=CHECKSUM_HMAC, checksum=b"\0" * 8
    )
    packed = head.pack()
    return packed + digest.mac(packed)


def parse_header(raw, *, path: str, rank: int | None = None, key: bytes | None = None) -> Header:
    """Decode and check the fixed header in ``raw`` (at least HEADER_SIZE bytes).

    Checks magic, version, header crc and the authentication mode. Raises
    ``ShardCorrupt`` naming ``path`` on any failure: a header is never half-trusted.
    """
    raw = bytes(raw[:HEADER_SIZE])
    if len(raw) < HEADER_SIZE:
        raise ShardCorrupt(
            f"object is truncated: {len(raw)} bytes, shorter than the {HEADER_SIZE}-byte header",
            rank=rank, path=path, hint=_CORRUPT_HINT,
        )
    fields = HEADER.unpack(raw)
    magic, version, flags = fields[0], fields[1], fields[2]
    if magic != MAGIC:
        raise ShardCorrupt(
            f"not a ferrosync object (magic {magic!r})", rank=rank, path=path,
            hint="something else writes into this location: give the run its own URL",
        )
    if version != VERSION:
        raise ShardCorrupt(
            f"wire format version {version}, this ferrosync reads version {VERSION}",
            rank=rank, path=path, hint="run the same ferrosync version on every rank",
        )
    crc, reserved = struct.unpack_from("<II", raw, _CRC_SPAN)
    if zlib.crc32(raw[:_CRC_SPAN]) != crc or reserved != 0:
        raise ShardCorrupt("header checksum mismatch", rank=rank, path=path, hint=_CORRUPT_HINT)
    if key is not None and not flags & FLAG_AUTH:
        raise ShardCorrupt(
            "object carries no MAC but a secret is configured (forged, or written by a "
            "rank without the secret)", rank=rank, path=path,
            hint="set the same secret (FERROSYNC_SECRET) on every rank",
        )
    if key is None and flags & FLAG_AUTH:
        raise ShardCorrupt(
            "object is authenticated but this rank has no secret", rank=rank, path=path,
            hint="set the same secret (FERROSYNC_SECRET) on every rank",
        )
    (
        _m, _v, _f, kind, dtype, codec, checksum_kind, wrank, world, slc, nslices, block,
        generation, collective, count, offset, total, weight, layout, nbytes, checksum,
        _crc, _res,
    ) = fields
    if kind not in KIND_NAMES:
        raise ShardCorrupt(f"unknown object kind {kind}", rank=rank, path=path, hint=_CORRUPT_HINT)
    if flags & ~_KNOWN_FLAGS:
        raise ShardCorrupt(f"unknown header flags {flags:#x}", rank=rank, path=path,
                           hint="run the same ferrosync version on every rank")
    expected_checksum = CHECKSUM_HMAC if flags & FLAG_AUTH else CHECKSUM_XXH3
    if checksum_kind != expected_checksum:
        raise ShardCorrupt(
            f"checksum kind {checksum_kind} does not match the authentication flag",
            rank=rank, path=path, hint=_CORRUPT_HINT)
    return Header(
        kind=kind, dtype=dtype, codec=codec, rank=wrank, world_size=world,
        generation=generation, collective=collective, count=count, offset=offset,
        total=total, weight=weight, layout=layout, payload_nbytes=nbytes, flags=flags,
        slice=slc, nslices=nslices, block=block, checksum_kind=checksum_kind,
        checksum=checksum, version=version,
    )


class PayloadCheck:
    """Verifies a payload streamed in chunks against its header; raise at ``finish``."""

    def __init__(self, header: Header, header_raw: bytes, key: bytes | None, path: str,
                 rank: int | None) -> None:
        self.header = header
        self._header_raw = bytes(header_raw[:HEADER_SIZE])
        self._mac = bytes(header_raw[HEADER_SIZE:HEADER_SIZE + MAC_SIZE]) if key else b""
        self._digest = PayloadDigest(key)
        self._path = path
        self._rank = rank
        self._seen = 0

    def update(self, chunk) -> None:
        self._seen += len(memoryview(chunk).cast("B"))
        self._digest.update(chunk)

    def finish(self) -> None:
        h = self.header
        if self._seen != h.payload_nbytes:
            raise ShardCorrupt(
                f"payload is truncated: {self._seen} of {h.payload_nbytes} bytes",
                rank=self._rank, path=self._path, hint=_CORRUPT_HINT,
            )
        if self._digest.key is None:
            ok = self._digest.xxh3() == h.checksum
        else:
            ok = hmac.compare_digest(self._digest.mac(self._header_raw), self._mac)
        if not ok:
            what = "MAC" if self._digest.key else "checksum"
            raise ShardCorrupt(
                f"payload {what} mismatch ({h.payload_nbytes} bytes from rank {h.rank})",
                rank=self._rank, collective=h.collective, path=self._path,
                hint=_CORRUPT_HINT if not self._digest.key else
                "the object was altered or written without the secret",
            )


_CORRUPT_HINT = (
    "the object was damaged or torn on storage; check the storage's health and that "
    "nothing else writes under this URL"
)


# -- small JSON records: rendezvous, heartbeats, abort markers, layouts ------------------
#
# Control records are JSON (never pickle). With a secret they carry an HMAC over
# their canonical JSON, so a tenant without the key cannot forge an abort, keep a
# dead rank "alive", or steer a rendezvous.

_RECORD_LIMIT = RECORD_LIMIT  # a control record larger than this is not ours
#: the deepest JSON nesting ferrosync reads (its own records nest 3 levels at most);
#: deeper input is refused before the parser recurses (``[`` * 500,000 would raise
#: RecursionError from inside ``json``)
JSON_MAX_DEPTH = 64
# a JSON string literal: brackets inside one do not nest (unrolled, so linear time)
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)


def json_depth(data: bytes | str) -> int:
    """How deeply ``data``'s arrays and objects nest, counted without parsing (one
    vectorised pass over the bytes outside string literals); for malformed input an
    upper bound of what a parser would reach."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    outside = np.frombuffer(_JSON_STRING.sub(b'""', bytes(data)), dtype=np.uint8)
    if not outside.size:
        return 0
    step = ((outside == ord("[")) | (outside == ord("{"))).astype(np.int32)
    step -= ((outside == ord("]")) | (outside == ord("}"))).astype(np.int32)
    return int(np.cumsum(step).max(initial=0))


def loads_bounded(data: bytes | str, max_depth: int = JSON_MAX_DEPTH):
    """``json.loads`` of untrusted ``data`` that never recurses past ``max_depth``:
    deeper (or malformed) input raises ``ValueError``, never ``RecursionError``."""
    depth = json_depth(data)
    if depth > max_depth:
        raise ValueError(f"JSON nested {depth} levels deep, more than the {max_depth} "
                         "ferrosync reads")
    try:
        return json.loads(data)
    except RecursionError:  # pragma: no cover - the depth check comes first
        raise ValueError("JSON nested too deeply") from None


def encode_record(record: dict, key: bytes | None) -> bytes:
    body = json.dumps(record, sort_keys=True, separators=(",", ":"))
    if key is None:
        return json.dumps({"v": VERSION, "body": body}).encode()
    mac = hmac.new(key, body.encode(), "sha256").hexdigest()
    return json.dumps({"v": VERSION, "body": body, "mac": mac}).encode()


@dataclass(frozen=True)
class OpenedRecord:
    """A control record as ``open_record`` found it; nothing in it is trusted yet.

    ``auth`` says how its MAC relates to the key it was opened with:

    * ``verified``: a key was given and the MAC matches;
    * ``plain``: no key, and the record carries no MAC;
    * ``unsigned``: a key was given but the record carries no MAC;
    * ``unverifiable``: the record carries a MAC but no key was given;
    * ``forged``: the MAC does not match the key;
    * ``malformed``: not a control record at all (``problem`` says why).

    ``body`` is the parsed JSON object, or None when it cannot be parsed (then
    ``problem`` says why); only ``verified`` and ``plain`` bodies may be acted upon.
    """

    body: dict | None
    auth: str
    problem: str | None = None

    @property
    def trusted(self) -> bool:
        return self.body is not None and self.auth in ("verified", "plain")


def open_record(data: bytes, key: bytes | None) -> OpenedRecord:
    """Check a control record's size, version and MAC, and parse its body; never raises.

    The one place these checks live: ``decode_record`` (the collective path) refuses
    anything but a trusted record, the operator tools show every record with how far
    it can be trusted. The body is JSON only, never unpickled. The envelope
    (``{"v", "body", "mac"}``, strings only) is parsed one level deep; with a key the
    body is parsed only once its MAC matches (``unsigned`` and ``forged`` records
    come back without a body), and every parse is depth-bounded (``loads_bounded``).
    """
    try:
        if len(data) > _RECORD_LIMIT:
            raise ValueError(f"{len(data)} bytes is too large for a control record")
        outer = loads_bounded(data, max_depth=1)
        if not isinstance(outer, dict) or outer.get("v") != VERSION:
            raise ValueError("not a version-1 ferrosync record")
        body = outer["body"]
        if not isinstance(body, str):
            raise TypeError("record body is not a string")
        body_bytes = body.encode("utf-8", "surrogatepass")
    except (ValueError, KeyError, TypeError) as exc:  # UnicodeError is a ValueError
        return OpenedRecord(None, "malformed", str(exc))
    if key is None:
        auth = "unverifiable" if "mac" in outer else "plain"
    elif "mac" not in outer:
        auth = "unsigned"
    else:
        mac = hmac.new(key, body_bytes, "sha256").hexdigest()
        auth = "verified" if hmac.compare_digest(mac, str(outer["mac"])) else "forged"
    if auth in ("unsigned", "forged"):
        return OpenedRecord(None, auth, "not parsed: its MAC does not match the secret")
    try:
        record = loads_bounded(body)
        if not isinstance(record, dict):
            raise ValueError("record body is not an object")
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        return OpenedRecord(None, auth, str(exc))
    return OpenedRecord(record, auth)


def decode_record(data: bytes, key: bytes | None, *, path: str, rank: int | None = None) -> dict:
    """Parse a trusted control record; raise ``ShardCorrupt`` naming ``path`` if it is
    not one (malformed, or its MAC does not match ``key``)."""
    opened = open_record(data, key)
    if opened.auth in ("forged", "unsigned"):
        problem = "MAC mismatch (forged, or written without the secret)"
    elif opened.auth == "unverifiable":
        problem = "record is authenticated but this rank has no secret"
    else:  # verified, plain, or malformed
        problem = opened.problem
    if problem is None:
        return opened.body
    raise ShardCorrupt(
        f"unreadable control record ({problem})", rank=rank, path=path,
        hint="set the same secret on every rank, and let nothing else write under this URL",
    )


# -- keys ---------------------------------------------------------------------------------

def job_key(secret: bytes | None, namespace: str) -> bytes | None:
    """The key that seals the objects and records of the job in ``namespace``, derived
    from the shared ``secret`` (None without one): HMAC-SHA256(secret, label +
    namespace). Jobs that share a secret (a team-wide ``FERROSYNC_SECRET``) get
    different keys, so an object copied from one job into another fails its MAC
    instead of entering the other job's average; the secret itself never seals
    anything such a copy could be replayed with."""
    if secret is None:
        return None
    return hmac.new(secret, b"ferrosync job key v1\0" + namespace.encode(), "sha256").digest()


def job_tag(namespace: str) -> int:
    """A 64-bit tag of the job in ``namespace`` for the header's generation field, so an
    object names its job even without a secret (then covered by the checksum only)."""
    return int.from_bytes(xxhash.xxh3_64_digest(b"ferrosync job\0" + namespace.encode()),
                          "little")
