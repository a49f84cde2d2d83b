"""Scan a ferrosync storage location: what the operator tools see there.

``scan`` lists the location once (tools may list; the collective path never does),
classifies every key through ``ferrosync.storage.names``, reads announcements,
heartbeats and abort markers by exact name and verifies them with their job's key
(``keys.JobKeys``). A record that cannot be verified is shown, never acted upon; links,
FIFOs and devices are ``irregular`` and left alone (docs/design.md#operator-tools).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ferrosync.errors import ShardCorrupt, StorageError
from ferrosync.ops.keys import JobKeys, job_of
from ferrosync.storage import names
from ferrosync.storage.engines import FsspecStorage, LocalStorage, Storage
from ferrosync.storage.engines.local_tools import LocalTree
from ferrosync.storage.objects import Objects
from ferrosync.storage.wire import OpenedRecord

# re-exported for the tools: the names themselves live in ferrosync.storage.names
GC_LOCK = names.GC_LOCK
DOCTOR_PREFIX = names.DOCTOR_PREFIX
#: kinds of rendezvous records (kept by gc: they number future generations)
RDZV_KINDS = names.RENDEZVOUS_KINDS

MAX_WORLD = 1 << 20  # a larger world size in a record is not believed

#: how far to trust a control record: only "verified" and "plain" are acted upon
TRUSTED = ("verified", "plain")


@dataclass
class Obj:
    """One listed object: its key, size and what its name says it is."""

    key: str
    size: int
    # join, announcement, objection, end, contribution, result, layout, heartbeat, abort,
    # temp, ...
    kind: str
    rank: int | None = None
    collective: int | None = None
    pid: int | None = None  # temp files: the writer's process id
    namespace: str | None = None  # rendezvous records: "rdzv" or "rdzv.{job}"
    number: int | None = None  # rendezvous records: the claim's attempt or the generation
    #: parts of an object written in parts: that object's key (storage/engines/parts.py)
    target: str | None = None

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
class FoundGeneration:
    """A generation: its announcement (if any) and the objects under its directory."""

    number: int
    token: str
    announcement: Record | None = None
    objects: list[Obj] = field(default_factory=list)  # temps excluded
    temps: list[Obj] = field(default_factory=list)
    #: parts of its objects written in parts (their sizes count in those objects')
    parts: list[Obj] = field(default_factory=list)
    has_dir: bool = False  # a directory exists (local stores; object stores have none)
    #: the namespace whose announcement names this directory (None: none does)
    namespace: str | None = None
    #: other namespaces whose announcements name it too (copied or forged records)
    also_named_by: list[str] = field(default_factory=list)

    @property
    def prefix(self) -> str:
        return names.generation_dir(self.number, self.token)

    @property
    def job(self) -> str | None:
        """The job id of its namespace (None: a job without an id, or unannounced)."""
        return job_of(self.namespace) if self.namespace is not None else None

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


def _token(record: Record | None) -> str | None:
    """The generation token an announcement names, if it names a valid one."""
    token = record.get("token") if record is not None else None
    return token if names.is_generation_token(token) else None


@dataclass
class Namespace:
    """One job's rendezvous records: ``rdzv`` (a job without an id) or ``rdzv.{job}``.

    Generation numbers count per namespace: two jobs both have a generation 0.
    """

    name: str
    records: list[Obj] = field(default_factory=list)  # join, announcement, objection, end
    announcements: dict[int, Record] = field(default_factory=dict)  # by number, as read

    @property
    def job(self) -> str | None:
        return job_of(self.name)

    @property
    def bytes(self) -> int:
        return sum(o.size for o in self.records)

    def of_kind(self, kind: str) -> list[Obj]:
        return [o for o in self.records if o.kind == kind]

    @property
    def newest(self) -> int | None:
        """The newest announced generation number listed here (read or not)."""
        listed = [o.number for o in self.of_kind("announcement")]
        return max(listed) if listed else None

    def prefix_of(self, number: int) -> str | None:
        """The data prefix announcement ``number`` names (None: missing or unreadable)."""
        token = _token(self.announcements.get(number))
        return names.generation_dir(number, token) if token is not None else None

    @property
    def newest_prefix(self) -> str | None:
        newest = self.newest
        return self.prefix_of(newest) if newest is not None else None

    @property
    def maybe_newest(self) -> set[str]:
        """Every directory that may be this job's newest announced generation.

        Walking the listed announcements from the highest number down, each directory
        a record names is included (trusted or not), down to and including the newest
        one that is trusted and names its directory (``settled``). A record gc cannot
        read, parse or verify (junk at ``gen.99``, a forged or unverifiable one)
        protects, never unprotects: it proves nothing about what is newest, so the
        walk goes on below it and the generation it may pretend to supersede stays
        protected."""
        out: set[str] = set()
        for number in sorted({o.number for o in self.of_kind("announcement")}, reverse=True):
            prefix = self.prefix_of(number)
            if prefix is not None:
                out.add(prefix)
            if self.settled(number):
                break
        return out

    def settled(self, number: int) -> bool:
        """True when this namespace can never announce another directory numbered
        ``number``: its announcement of that number is here, trusted, and names its
        own directory. (Numbers are taken in order, so a later rank 0 of this job
        takes a higher one; a missing or untrusted record settles nothing.)"""
        record = self.announcements.get(number)
        return record is not None and record.usable and _token(record) is not None


@dataclass
class Scan:
    """Everything ``scan`` found under one URL."""

    url: str
    objects: list[Obj]
    generations: dict[str, FoundGeneration]  # by prefix ("g3.0123abcd...")
    #: every rendezvous namespace seen (records, or a directory), by name
    namespaces: dict[str, Namespace]
    rdzv: list[Obj]  # rendezvous records of every namespace
    temps: list[Obj]  # temporary files outside generation directories
    probes: list[Obj]  # leftover connect probes and doctor directories
    foreign: list[Obj]  # names ferrosync never writes: left alone
    #: everything under each elastic job's namespace (``el``, ``el.{job}``), by namespace:
    #: the elastic layer's own, read by ``elastic_history`` and never touched by gc
    elastic: dict[str, list[Obj]] = field(default_factory=dict)
    #: (key, what it is) of links, FIFOs, sockets, devices (local stores): left alone
    irregular: list[tuple[str, str]] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(o.size for o in self.objects)

    @property
    def newest_prefixes(self) -> set[str]:
        """The directories that may be a namespace's newest announced generation
        (``Namespace.maybe_newest``): a job that was just announced may not have
        heartbeated yet, and a suspended one does not, so each is protected."""
        return set().union(*(ns.maybe_newest for ns in self.namespaces.values()))

    def may_be_announced(self, gen: FoundGeneration) -> bool:
        """Could some job still announce this unannounced directory (or has it, in a
        record that cannot be read)? False only when every namespace here has a
        trusted announcement of its number naming another directory: then its
        rank 0 lost the race for that number, or died before announcing. With no
        namespace at all (records deleted) nothing is known: True."""
        if gen.announced:
            return False
        if not self.namespaces:
            return True
        return not all(ns.settled(gen.number) for ns in self.namespaces.values())

    def ordered(self) -> list[FoundGeneration]:
        """Generations, newest first (by number, then announced before unannounced)."""
        return sorted(self.generations.values(),
                      key=lambda g: (g.number, g.announced, g.token), reverse=True)


#: what the tools say about a record that ``wire.open_record`` does not trust
_DISTRUST = {
    "unverifiable": ("unverified", "the record carries a MAC and this host has no key for "
                     "its job: copy the job's key file from the host that launched it, or "
                     "pass --secret (or set FERROSYNC_SECRET)"),
    "unsigned": ("bad", "the record carries no MAC but a secret was given (forged, or the "
                 "job ran without a secret: then pass --secret '')"),
    "forged": ("bad", "MAC mismatch: forged, or a different secret"),
}


def lenient(opened: OpenedRecord, key: str) -> Record:
    """The control record at ``key`` (see ``wire.open_record``) and how far to trust it.

    Unlike ``wire.decode_record`` this never raises: an operator wants to *see* a
    record even when it cannot be verified. The JSON body is data only.
    """
    if opened.body is None and opened.auth in ("unsigned", "forged"):  # left unparsed
        trust, problem = _DISTRUST[opened.auth]
        return Record(key, None, trust, problem)
    if opened.body is None:
        return Record(key, None, "bad", f"not a ferrosync control record ({opened.problem})")
    if opened.trusted:
        return Record(key, opened.body, opened.auth)
    trust, problem = _DISTRUST[opened.auth]
    return Record(key, opened.body, trust, problem)


def read_record(storage: Storage, key: str, secret: bytes | None) -> Record | None:
    """The record at ``key`` (exact name), or None when it does not exist.

    A name the store refuses to read (a link or FIFO planted there, an I/O error)
    gives a "bad" record: the tool shows it and goes on, and nothing acts on it.
    """
    try:
        opened = Objects.for_records(storage, key=secret).inspect_record(key)
    except (StorageError, ShardCorrupt) as exc:  # ShardCorrupt: larger than any record
        return Record(key, None, "bad", f"unreadable: {exc}")
    return None if opened is None else lenient(opened, key)


def classify(key: str, size: int) -> Obj:
    """What a listed key is, from its name and its directory's name alone."""
    directory, _, name = key.rpartition("/")
    if key.startswith(DOCTOR_PREFIX) and directory:
        # everything under a doctor-like directory, temp-like names included: gc removes
        # only what doctor provably wrote there (``doctor.owned``)
        return Obj(key, size, "probe", pid=doctor_pid(key))
    found = names.parse(name)
    if found.kind == "temp":
        return Obj(key, size, "temp", pid=found.pid)
    if found.kind == "part":
        return Obj(key, size, "part", number=found.number,
                   target=names.within(directory, found.target))
    top = names.parse(directory)
    if top.kind == "namespace":
        if found.kind not in names.RENDEZVOUS_KINDS:
            return Obj(key, size, "foreign")  # nothing ferrosync writes there
        return Obj(key, size, found.kind, rank=found.rank, namespace=directory,
                   number=found.number)
    if not directory and found.kind in ("probe", "lock"):
        return Obj(key, size, found.kind)
    if top.kind == "generation":
        if found.kind not in names.GENERATION_KINDS:
            return Obj(key, size, "unknown")
        return Obj(key, size, found.kind, rank=found.rank, collective=found.collective)
    return Obj(key, size, "foreign")


def doctor_pid(key: str) -> int | None:
    """The pid in a doctor probe directory's name (``.doctor.{pid}.{hex}``)."""
    found = names.parse(key.split("/", 1)[0])
    return found.pid if found.kind == "doctor" else None


#: what is a temp file to the tools: a writer's temporary file, or a part of an object
#: written in parts whose object is not there (an aborted write's)
ORPHANS = ("temp", "part")


def _live_parts(objects: list[Obj]) -> set[str]:
    """The parts whose object is listed too (its manifest names them); each such object's
    size becomes its payload's, the sum of its parts'. A part whose object is missing is
    an aborted write's (a live write's until its manifest is put: gc's watch window)."""
    by_key = {o.key: o for o in objects}
    live = [o for o in objects if o.kind == "part" and o.target in by_key]
    counted: set[str] = set()
    for part in live:
        target = by_key[part.target]
        target.size = (target.size if part.target in counted else 0) + part.size
        counted.add(part.target)
    return {o.key for o in live}


def scan(storage: Storage, keys: JobKeys) -> Scan:
    """List the location once and read its announcements (each with its job's key)."""
    objects = [classify(key, size) for key, size in storage.list("")]
    live_parts = _live_parts(objects)
    generations: dict[str, FoundGeneration] = {}

    def generation_of(prefix: str) -> FoundGeneration:
        if prefix not in generations:
            found = names.parse(prefix)
            generations[prefix] = FoundGeneration(found.number, found.token)
        return generations[prefix]

    rdzv, temps, probes, foreign = [], [], [], []
    elastic: dict[str, list[Obj]] = {}
    for obj in objects:
        directory = obj.key.rpartition("/")[0]
        top = obj.key.split("/", 1)[0]
        if directory and names.is_elastic_namespace(top):
            elastic.setdefault(top, []).append(obj)  # temp files there included
        elif _is_generation(directory):
            gen = generation_of(directory)
            (gen.parts if obj.key in live_parts else gen.temps if obj.kind in ORPHANS
             else gen.objects).append(obj)
        elif obj.key in live_parts:
            continue  # counted in its object's size
        elif obj.kind in ORPHANS:
            temps.append(obj)
        elif obj.kind in RDZV_KINDS:
            rdzv.append(obj)
        elif obj.kind == "probe":
            probes.append(obj)
        elif obj.kind != "lock":
            foreign.append(obj)
    for name in _local_subdirs(storage):
        if _is_generation(name):
            generation_of(name).has_dir = True
        elif name.startswith(DOCTOR_PREFIX) and not any(
                p.key.startswith(name + "/") for p in probes):
            probes.append(Obj(name, 0, "probe-dir", pid=doctor_pid(name)))  # doctor's, empty
    namespaces: dict[str, Namespace] = {}
    for obj in rdzv:
        ns = namespaces.setdefault(obj.namespace, Namespace(obj.namespace))
        ns.records.append(obj)
        if obj.kind == "announcement":
            record = read_record(storage, obj.key, keys.secret(ns.name))
            if record is not None:  # else deleted since the listing
                ns.announcements[obj.number] = record
    for ns in sorted(namespaces.values(), key=lambda n: n.name):
        for number, record in sorted(ns.announcements.items()):
            # matched by number *and* token: two jobs' generation 0 never mix. An
            # announced generation with nothing stored was collected already, ran as a
            # world of one, or is starting (no heartbeat yet): it has no FoundGeneration
            gen = generations.get(ns.prefix_of(number) or "")
            if gen is None:
                continue
            if gen.announcement is None:
                gen.announcement, gen.namespace = record, ns.name
            elif record.usable and not gen.announcement.usable:
                gen.also_named_by.append(gen.namespace)
                gen.announcement, gen.namespace = record, ns.name
            else:
                gen.also_named_by.append(ns.name)
    # a job that started during the listing: its namespace directory existed before
    # any generation directory it made, so a scan of the root made after the one
    # that found the directories sees it (it settles nothing: see may_be_announced)
    for name in _local_subdirs(storage):
        if _is_namespace(name):
            namespaces.setdefault(name, Namespace(name))
    irregular = LocalTree(storage).irregular("") if isinstance(storage, LocalStorage) else []
    return Scan(storage.url, objects, generations, namespaces, rdzv, temps, probes, foreign,
                irregular=irregular, elastic=elastic)


def _is_generation(name: str) -> bool:
    return names.parse(name).kind == "generation"


def _is_namespace(name: str) -> bool:
    return names.parse(name).kind == "namespace"


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


def namespace_names(storage: Storage) -> list[str]:
    """The rendezvous namespaces (``rdzv``, ``rdzv.{job}``) at the top of the location,
    without listing everything below it."""
    return [n for n in top_names(storage) if _is_namespace(n)]


def top_names(storage: Storage) -> list[str]:
    """The names at the top of the location (directories, prefixes and objects), without
    listing everything below it."""
    if isinstance(storage, LocalStorage):
        found = _local_subdirs(storage)
    elif isinstance(storage, FsspecStorage):
        storage.fs.invalidate_cache()
        try:
            found = storage.fs.ls(storage.root, detail=False)
        except FileNotFoundError:
            found = []
        found = [str(p).rstrip("/").rsplit("/", 1)[-1] for p in found]
    else:
        found = [key.split("/", 1)[0] for key, _ in storage.list("") if "/" in key]
    return sorted(set(found))


def read_markers(storage: Storage, gen: FoundGeneration, kind: str,
                 secret: bytes | None) -> dict[int, Record]:
    """Read every listed ``kind`` ("heartbeat" or "abort") record of ``gen`` by name."""
    out = {}
    for rank, key in sorted(gen.keys_of(kind).items()):
        record = read_record(storage, key, secret)
        if record is not None:
            out[rank] = record
    return out


def printable(text: object) -> str:
    """``text`` safe to print on an operator's terminal: every character that is not
    printable (newlines and other controls, bidirectional overrides such as U+202E,
    zero-width and other format characters, line separators) and every backslash are
    written as Python escapes, so a name planted in storage cannot forge a line of the
    report or reverse how it reads."""
    text = str(text)
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(c if c.isprintable() and c != "\\" else
                   ("\\\\" if c == "\\" else repr(c)[1:-1]) for c in text)


def printable_tree(value):
    """``printable`` applied to every string (and key) in a JSON-like report."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable_tree(k): printable_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [printable_tree(v) for v in value]
    return value


def human_bytes(n: int) -> str:
    step = 1024.0
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < step or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= step
    raise AssertionError("unreachable")
