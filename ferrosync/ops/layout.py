"""Read a ferrosync storage location as the operator tools see it.

What a job leaves under its URL (README, "How the storage backend works")::

    rdzv/join.r{rank}.{n}   JSON: rank's n-th attempt to join
    rdzv/gen.{g}            JSON: rank 0's announcement of generation g (its token)
    g{g}.{token}/           the generation's objects:
        c{s}.r{k}[.s{j}]    contributions (binary, 112-byte header)
        c{s}.out[.s{j}]     results and broadcasts (binary)
        layout.{d}.r{k}     JSON layout descriptions
        hb.r{k}             JSON heartbeat {beat, state, collective, op, pid, host, ...}
        abort.r{k}          JSON abort marker {type, message, collective, ...}
    .{name}.{pid}.{8 hex}.tmp   a writer's temporary file (an orphan if it was killed)

``scan`` lists the location once (tools may list; the collective path never does)
and reads the announcements, heartbeats and abort markers by exact name. Control
records are parsed as JSON only, never unpickled, and their MAC is checked when a
secret is given: a record that cannot be verified is shown but never acted upon.
"""

from __future__ import annotations

import hmac
import json
import os
import re
from dataclasses import dataclass, field

from ..storage import LocalStorage, Storage

RDZV = "rdzv"
GC_LOCK = ".ferrosync-gc.lock"
DOCTOR_PREFIX = ".doctor."

_JOIN = re.compile(r"rdzv/join\.r(\d+)\.(\d+)")
_GEN = re.compile(r"rdzv/gen\.(\d+)")
_GEN_DIR = re.compile(r"g(\d+)\.([0-9a-f]{16})")
_TEMP = re.compile(r"\.(.+)\.(\d+)\.([0-9a-f]{8})\.tmp")
_DOCTOR_DIR = re.compile(r"\.doctor\.(\d+)\.[0-9a-f]+(?:/|$)")
_PROBE = re.compile(r"\.probe\.r\d+\.[0-9a-f]{8}")
# names inside a generation directory -> kind; group 1 is the collective or the rank
_IN_GENERATION = (
    ("contribution", re.compile(r"c(\d+)\.r(\d+)(?:\.s(\d+))?")),
    ("result", re.compile(r"c(\d+)\.out(?:\.s(\d+))?")),
    ("layout", re.compile(r"layout\.([0-9a-f]+)\.r(\d+)")),
    ("heartbeat", re.compile(r"hb\.r(\d+)")),
    ("abort", re.compile(r"abort\.r(\d+)")),
)

MAX_WORLD = 1 << 20  # a larger world size in a record is not believed

#: how far to trust a control record: only "verified" and "plain" are acted upon
TRUSTED = ("verified", "plain")


@dataclass
class Obj:
    """One listed object: its key, size and what its name says it is."""

    key: str
    size: int
    kind: str  # join, announcement, contribution, result, layout, heartbeat, abort, temp, ...
    rank: int | None = None
    collective: int | None = None
    pid: int | None = None  # temp files: the writer's process id

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]


@dataclass
class Record:
    """A control record as read: ``data`` is None when it could not be parsed."""

    key: str
    data: dict | None
    trust: str  # verified | plain | unverified | bad
    problem: str | None = None

    @property
    def usable(self) -> bool:
        return self.data is not None and self.trust in TRUSTED

    def get(self, name: str, default=None):
        return (self.data or {}).get(name, default)


@dataclass
class Generation:
    """A generation: its announcement (if any) and the objects under its directory."""

    number: int
    token: str
    announcement: Record | None = None
    objects: list[Obj] = field(default_factory=list)  # temps excluded
    temps: list[Obj] = field(default_factory=list)
    has_dir: bool = False  # a directory exists (local stores; object stores have none)

    @property
    def prefix(self) -> str:
        return f"g{self.number}.{self.token}"

    @property
    def announced(self) -> bool:
        return self.announcement is not None

    @property
    def bytes(self) -> int:
        return sum(o.size for o in self.objects) + sum(t.size for t in self.temps)

    @property
    def world_size(self) -> int | None:
        """From a trusted announcement, else from the ranks seen on storage (an
        unverified record must not make a tool probe a billion heartbeat names)."""
        if self.announcement is not None and self.announcement.usable:
            size = self.announcement.get("world_size")
            if isinstance(size, int) and 0 < size <= MAX_WORLD:
                return size
        ranks = [o.rank for o in self.objects if o.rank is not None]
        return max(ranks) + 1 if ranks else None

    def keys_of(self, kind: str) -> dict[int, str]:
        return {o.rank: o.key for o in self.objects if o.kind == kind and o.rank is not None}

    def last_collective(self) -> int | None:
        found = [o.collective for o in self.objects if o.collective is not None]
        return max(found) if found else None


@dataclass
class Scan:
    """Everything ``scan`` found under one URL."""

    url: str
    objects: list[Obj]
    generations: dict[str, Generation]  # by prefix ("g3.0123abcd...")
    announcements: dict[int, Record]  # by generation number
    rdzv: list[Obj]  # join records and announcements
    temps: list[Obj]  # temporary files outside generation directories
    probes: list[Obj]  # leftover connect probes and doctor directories
    foreign: list[Obj]  # names ferrosync never writes: left alone

    @property
    def total_bytes(self) -> int:
        return sum(o.size for o in self.objects)

    @property
    def newest_announced(self) -> int | None:
        return max(self.announcements) if self.announcements else None

    def ordered(self) -> list[Generation]:
        """Generations, newest first (by number, then announced before unannounced)."""
        return sorted(self.generations.values(),
                      key=lambda g: (g.number, g.announced, g.token), reverse=True)


def decode_lenient(raw: bytes, key: str, secret: bytes | None) -> Record:
    """Parse a control record (see ``wire.encode_record``) and say how far to trust it.

    Unlike ``wire.decode_record`` this never raises: an operator wants to *see* a
    record even when it cannot be verified. The JSON body is data only.
    """
    try:
        outer = json.loads(raw)
        body = outer["body"]
        data = json.loads(body)
        if not isinstance(data, dict):
            raise ValueError("record body is not an object")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        return Record(key, None, "bad", f"not a ferrosync control record ({exc})")
    mac = outer.get("mac")
    if secret is None:
        if mac is None:
            return Record(key, data, "plain")
        return Record(key, data, "unverified",
                      "the record carries a MAC: pass --secret (or set FERROSYNC_SECRET) to "
                      "verify it")
    if mac is None:
        return Record(key, data, "bad", "the record carries no MAC but a secret was given "
                      "(forged, or the job ran without a secret: then pass --secret '')")
    expected = hmac.new(secret, body.encode(), "sha256").hexdigest()
    if not hmac.compare_digest(expected, str(mac)):
        return Record(key, data, "bad", "MAC mismatch: forged, or a different secret")
    return Record(key, data, "verified")


def read_record(storage: Storage, key: str, secret: bytes | None) -> Record | None:
    """The record at ``key`` (exact name), or None when it does not exist."""
    raw = storage.read(key)
    if raw is None:
        return None
    return decode_lenient(raw, key, secret)


def classify(key: str, size: int) -> Obj:
    """What a listed key is, from its name alone."""
    name = key.rsplit("/", 1)[-1]
    if m := _TEMP.fullmatch(name):
        return Obj(key, size, "temp", pid=int(m.group(2)))
    if m := _JOIN.fullmatch(key):
        return Obj(key, size, "join", rank=int(m.group(1)))
    if _GEN.fullmatch(key):
        return Obj(key, size, "announcement")
    if "/" not in key and (_PROBE.fullmatch(key) or key == GC_LOCK):
        return Obj(key, size, "probe" if key != GC_LOCK else "lock")
    if key.startswith(DOCTOR_PREFIX):
        return Obj(key, size, "probe", pid=doctor_pid(key))
    directory = key.rsplit("/", 1)[0] if "/" in key else ""
    if _GEN_DIR.fullmatch(directory):
        for kind, pattern in _IN_GENERATION:
            if m := pattern.fullmatch(name):
                if kind in ("contribution", "result"):
                    rank = int(m.group(2)) if kind == "contribution" else None
                    return Obj(key, size, kind, rank=rank, collective=int(m.group(1)))
                return Obj(key, size, kind, rank=int(m.group(m.lastindex)))
        return Obj(key, size, "unknown")
    return Obj(key, size, "foreign")


def doctor_pid(key: str) -> int | None:
    """The pid in a doctor probe directory's name (``.doctor.{pid}.{hex}``)."""
    m = _DOCTOR_DIR.match(key)
    return int(m.group(1)) if m else None


def scan(storage: Storage, secret: bytes | None) -> Scan:
    """List the location once and read its announcements, heartbeats and aborts."""
    objects = [classify(key, size) for key, size in storage.list("")]
    generations: dict[str, Generation] = {}

    def generation_of(prefix: str) -> Generation:
        if prefix not in generations:
            m = _GEN_DIR.fullmatch(prefix)
            generations[prefix] = Generation(int(m.group(1)), m.group(2))
        return generations[prefix]

    rdzv, temps, probes, foreign = [], [], [], []
    for obj in objects:
        directory = obj.key.rsplit("/", 1)[0] if "/" in obj.key else ""
        if _GEN_DIR.fullmatch(directory):
            gen = generation_of(directory)
            (gen.temps if obj.kind == "temp" else gen.objects).append(obj)
        elif obj.kind == "temp":
            temps.append(obj)
        elif obj.kind in ("join", "announcement"):
            rdzv.append(obj)
        elif obj.kind == "probe":
            probes.append(obj)
        elif obj.kind != "lock":
            foreign.append(obj)
    for name in _local_subdirs(storage):
        if _GEN_DIR.fullmatch(name):
            generation_of(name).has_dir = True
        elif name.startswith(DOCTOR_PREFIX) and not any(
                p.key.startswith(name + "/") for p in probes):
            probes.append(Obj(name, 0, "probe-dir", pid=doctor_pid(name)))  # doctor's, empty
    announcements: dict[int, Record] = {}
    for obj in rdzv:
        if obj.kind == "announcement":
            number = int(obj.key.rsplit(".", 1)[1])
            record = read_record(storage, obj.key, secret)
            if record is None:
                continue  # deleted since the listing
            announcements[number] = record
    for number, record in announcements.items():
        prefix = f"g{number}.{record.get('token')}"
        # an announced generation with nothing stored was collected already, ran as a
        # world of one, or is starting (no heartbeat yet): it has no Generation entry
        if prefix in generations:
            generations[prefix].announcement = record
    return Scan(storage.url, objects, generations, announcements, rdzv, temps, probes, foreign)


def _local_subdirs(storage: Storage) -> list[str]:
    """Top-level directory names (local stores only: a listing shows files, and an
    empty generation directory still needs to be seen and removed)."""
    if not isinstance(storage, LocalStorage):
        return []
    try:
        with os.scandir(storage.root) as entries:
            return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return []


def read_markers(storage: Storage, gen: Generation, kind: str,
                 secret: bytes | None) -> dict[int, Record]:
    """Read every listed ``kind`` ("heartbeat" or "abort") record of ``gen`` by name."""
    out = {}
    for rank, key in sorted(gen.keys_of(kind).items()):
        record = read_record(storage, key, secret)
        if record is not None:
            out[rank] = record
    return out


def human_bytes(n: int) -> str:
    step = 1024.0
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < step or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= step
    raise AssertionError("unreachable")
