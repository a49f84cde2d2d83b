"""Every object name ferrosync writes on shared storage: formatted and parsed here only.

One format function per kind returns one path component (``within`` joins a directory
and a name; an elastic job's busiest kinds are a shard directory and a component,
``elastic_shard``); ``parse`` reads a component back into a ``Name`` whose ``kind`` says which
function made it. The names and where each lives: docs/design.md#object-names and
docs/design.md#rendezvous; where a kind may appear is the caller's business
(``ferrosync.ops.scan.classify``).
"""

from __future__ import annotations

import os
import re
import secrets
import zlib
from dataclasses import dataclass

from ferrosync.core.env import JOB_ID  # how a job id is spelled: the env check's rule

#: the rendezvous namespace of a job without an id
RDZV = "rdzv"
#: the file one ``ferrosync gc`` at a time holds an ``flock`` on (local stores)
GC_LOCK = ".ferrosync-gc.lock"
#: how the doctor's probe directories begin (``doctor_dir``)
DOCTOR_PREFIX = ".doctor."
#: the record doctor writes first in its directory: gc removes what is there only where
#: this mark names the directory (a user's files under such a name are not doctor's)
DOCTOR_MARK = "doctor.json"
#: the probe objects doctor writes in its directory, besides its mark
_DOCTOR_PROBE = re.compile(r"atomic|exclusive|mode|throughput|rename\.[abc]"
                           r"|(?:visible|lat)\.[0-9]+")
_GENERATION_TOKEN = re.compile(r"[0-9a-f]{16}")


# -- collective data (inside a generation directory) ------------------------------------

def contribution(seq: int, rank: int, slice_: int | None = None) -> str:
    """Rank ``rank``'s contribution to collective ``seq`` (or its slice ``slice_``)."""
    return f"c{seq}.r{rank}" if slice_ is None else f"c{seq}.r{rank}.s{slice_}"


def result(seq: int, slice_: int | None = None) -> str:
    """The result of collective ``seq`` (or slice ``slice_`` of it)."""
    return f"c{seq}.out" if slice_ is None else f"c{seq}.out.s{slice_}"


def message(src: int, dst: int, tag: int, number: int) -> str:
    """The ``number``-th point-to-point message (0, 1, ...) from rank ``src`` to rank
    ``dst`` with tag ``tag``: numbered per (src, dst, tag), alike on both sides."""
    return f"m{number}.r{src}.d{dst}.t{tag}"


def layout_record(digest: bytes, rank: int) -> str:
    """Rank ``rank``'s description of tensor-layout digest ``digest``."""
    return f"layout.{digest.hex()}.r{rank}"


def heartbeat(rank: int) -> str:
    """Rank ``rank``'s heartbeat record: the one name ferrosync overwrites."""
    return f"hb.r{rank}"


def abort(rank: int) -> str:
    """Rank ``rank``'s abort marker, written once when it fails."""
    return f"abort.r{rank}"


# -- rendezvous --------------------------------------------------------------------------

def namespace(job: str | None) -> str:
    """Where a job's rendezvous records live: ``rdzv`` or ``rdzv.{job}``."""
    return RDZV if job is None else f"{RDZV}.{job}"


def join(rank: int, attempt: int) -> str:
    """A process's ``attempt``-th claim on ``rank``."""
    return f"join.r{rank}.{attempt}"


def announcement(generation: int) -> str:
    """Rank 0's announcement of generation ``generation``."""
    return f"gen.{generation}"


def objection(rank: int, attempt: int) -> str:
    """A live holder's objection to claim ``attempt`` of ``rank``."""
    return f"dup.r{rank}.{attempt}"


def end(rank: int, attempt: int) -> str:
    """The holder of claim ``attempt`` of ``rank`` has closed."""
    return f"end.r{rank}.{attempt}"


def generation_dir(generation: int, token: str) -> str:
    """The directory of generation ``generation`` announced with ``token`` (16 hex)."""
    return f"g{generation}.{token}"


# -- housekeeping ------------------------------------------------------------------------

def _token(token: str | None) -> str:
    return secrets.token_hex(4) if token is None else token


def temp(name: str, pid: int | None = None, token: str | None = None) -> str:
    """A temporary file for ``name`` in the same directory (so the rename onto ``name``
    is atomic). The leading dot hides it, the pid tells ``gc`` whether its writer may
    still run, and ``.tmp`` marks it for ``gc`` if the writer dies."""
    return f".{name}.{os.getpid() if pid is None else pid}.{_token(token)}.tmp"


def part(name: str, token: str, index: int) -> str:
    """Part ``index`` of one write of ``name`` larger than a request (``token``: 16 hex,
    that write's own): beside ``name``, hidden, until its manifest at ``name`` names it
    (``storage/engines/parts.py``)."""
    return f".{name}.{token}.p{index}"


def spare(pid: int | None = None, token: str | None = None) -> str:
    """A consumed object parked under a hidden name for a later rewrite in place."""
    return f".spare.{os.getpid() if pid is None else pid}.{_token(token)}"


def probe(rank: int, token: str | None = None) -> str:
    """The object a connect-time probe writes, reads back and deletes."""
    return f".probe.r{rank}.{_token(token)}"


def doctor_dir(pid: int | None = None, token: str | None = None) -> str:
    """The directory ``ferrosync doctor`` works in (removed when it is done)."""
    return f"{DOCTOR_PREFIX}{os.getpid() if pid is None else pid}.{_token(token)}"


def doctor_object(name: str) -> bool:
    """Whether doctor writes an object called ``name`` in its directory: its mark, a
    probe, or a probe's temporary file."""
    found = parse(name)
    if found.kind == "temp":
        name = found.target
    return name == DOCTOR_MARK or _DOCTOR_PROBE.fullmatch(name) is not None


def is_generation_token(token) -> bool:
    """Whether ``token`` is a generation token as rank 0 draws it (16 lowercase hex)."""
    return isinstance(token, str) and _GENERATION_TOKEN.fullmatch(token) is not None


def within(directory: str, name: str) -> str:
    """The storage key of ``name`` in ``directory`` ("" is the root)."""
    return f"{directory}/{name}" if directory else name


# -- parsing -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Name:
    """What one path component says about itself; fields that do not apply are None."""

    kind: str  # see KINDS
    rank: int | None = None
    collective: int | None = None  # contribution, result
    slice: int | None = None  # contribution, result: the slice, None when unsliced
    #: join, objection, end: the claim's attempt; announcement, generation: its number;
    #: part: its index
    number: int | None = None
    #: generation: its token; temp, spare, probe, doctor, part: the random hex
    token: str | None = None
    digest: str | None = None  # layout: the digest, hex
    pid: int | None = None  # temp, spare, doctor: the writer's process id
    job: str | None = None  # namespace: the job id (None: a job without one)
    #: temp: the name the temporary file will be renamed to; part: its object's name
    target: str | None = None
    peer: int | None = None  # message: the destination rank (``rank`` is the source)
    tag: int | None = None  # message: its tag


# a decimal number: ASCII digits only (``\d`` would take any script's), leading zeros
# accepted as the tools always have
_N = r"([0-9]+)"
# (kind, pattern, fields in group order); tried in order, each anchored at both ends.
# Temporary files come first: ".{name}...tmp" may wrap any other name.
_PATTERNS = (
    ("temp", rf"\.(.+)\.{_N}\.([0-9a-f]{{8}})\.tmp", ("target", "pid", "token")),
    ("part", rf"\.(.+)\.([0-9a-f]{{16}})\.p{_N}", ("target", "token", "number")),
    ("spare", rf"\.spare\.{_N}\.([0-9a-f]{{8}})", ("pid", "token")),
    ("probe", rf"\.probe\.r{_N}\.([0-9a-f]{{8}})", ("rank", "token")),
    ("doctor", rf"\.doctor\.{_N}\.([0-9a-f]+)", ("pid", "token")),
    ("lock", re.escape(GC_LOCK), ()),
    ("contribution", rf"c{_N}\.r{_N}(?:\.s{_N})?", ("collective", "rank", "slice")),
    ("result", rf"c{_N}\.out(?:\.s{_N})?", ("collective", "slice")),
    ("layout", rf"layout\.([0-9a-f]+)\.r{_N}", ("digest", "rank")),
    ("message", rf"m{_N}\.r{_N}\.d{_N}\.t{_N}", ("number", "rank", "peer", "tag")),
    ("heartbeat", rf"hb\.r{_N}", ("rank",)),
    ("abort", rf"abort\.r{_N}", ("rank",)),
    ("namespace", rf"{RDZV}(?:\.({JOB_ID}))?", ("job",)),
    ("join", rf"join\.r{_N}\.{_N}", ("rank", "number")),
    ("announcement", rf"gen\.{_N}", ("number",)),
    ("objection", rf"dup\.r{_N}\.{_N}", ("rank", "number")),
    ("end", rf"end\.r{_N}\.{_N}", ("rank", "number")),
    ("generation", rf"g{_N}\.([0-9a-f]{{16}})", ("number", "token")),
)
_COMPILED = tuple((kind, re.compile(pattern), fields) for kind, pattern, fields in _PATTERNS)
_TEXT_FIELDS = {"token", "digest", "job", "target"}

#: every kind ``parse`` can answer
KINDS = tuple(kind for kind, _, _ in _PATTERNS) + ("unknown",)
#: rendezvous records (inside a namespace)
RENDEZVOUS_KINDS = ("join", "announcement", "objection", "end")
#: objects inside a generation directory
GENERATION_KINDS = ("contribution", "result", "layout", "message", "heartbeat", "abort")


def _first_match(compiled, name: str) -> Name:
    """The ``Name`` of the first pattern of ``compiled`` that ``name`` matches whole."""
    for kind, pattern, fields in compiled:
        m = pattern.fullmatch(name)
        if m is None:
            continue
        values = {}
        for field_name, value in zip(fields, m.groups()):
            if value is not None:
                values[field_name] = value if field_name in _TEXT_FIELDS else int(value)
        return Name(kind, **values)
    return Name("unknown")


def parse(name: str) -> Name:
    """What the path component ``name`` is; ``Name("unknown")`` for anything else."""
    return _first_match(_COMPILED, name)


# -- elastic jobs (ferrosync/elastic) ----------------------------------------------------
#
# An elastic job's namespace ``el`` or ``el.{job}`` holds (docs/elastic.md)::
#
#     p{xx}/member.{id}  a member's introduction, written once (``elastic_member``)
#     p{xx}/hb.{id}      its heartbeat, overwritten (``elastic_heartbeat``)
#     p{xx}/join.{n}     the n-th entry of the join queue (``elastic_join``)
#     p{xx}/r{r}.roster  the membership agreed for round r (``elastic_roster``)
#     history.{r}        the membership history as of the change at round r
#                        (``elastic_history``)
#     p{xx}/r{r}.{id}    a member's contribution to round r (``elastic_contribution``)
#     p{xx}/r{r}.t{l}.{n}.{path}  a piece of a tree reduce: level l, node n, range path
#                        (``elastic_piece``; level 0: the slices of a contribution)
#     p{xx}/r{r}.m.{path}  a range of a tree reduce's average (``elastic_result``)
#     latest             hint: a recent roster's round (``ELASTIC_LATEST``)
#     state / state.{r}.{i}  the published training state's parts and their pointer
#                        (``elastic_state``)
#     layout.{digest}    what a call of that layout digest passed (``elastic_layout``)
#     ended              the job is over: joiners stop waiting (``ELASTIC_ENDED``)
#     job                what every member must agree on (``ELASTIC_JOB_RECORD``)
#
# Member ids are 16 lowercase hex digits, so ``hb.{id}`` never reads as ``hb.r{k}`` and
# ``join.{n}`` never as ``join.r{k}.{n}``.
#
# The ``p{xx}/`` kinds lie in one of ``ELASTIC_SHARDS`` shard directories, ``xx`` a
# hash of the name (``elastic_shard``), so that an object store that rates requests per
# partitioned prefix (S3: 3,500 PUT/s, 5,500 GET/s each) spreads them over that many
# partitions once it has split the namespace there (docs/elastic.md, "Prefixes"): a
# round's data objects (nearly every PUT), the records every member polls or reads
# many times a round (rosters, heartbeats, join entries: a thousand members' GETs) and
# the introductions (a thousand PUTs when a job starts). Any member computes a key
# from the name alone. The rest stays at the top: written or read a few times a round.

#: an elastic job without an id
ELASTIC = "el"
#: the hint naming a recent roster (overwritten by roster writers)
ELASTIC_LATEST = "latest"
#: the pointer to the newest published state (overwritten)
ELASTIC_STATE_POINTER = "state"
#: the job's end marker (exclusive create by any member, never removed)
ELASTIC_ENDED = "ended"
#: the job's record: what its members agree on (exclusive create by the first member)
ELASTIC_JOB_RECORD = "job"
_MEMBER_ID = re.compile(r"[0-9a-f]{16}")
#: shard directories of an elastic job's busiest kinds: two hex digits, a split point
#: S3 can use at any scale (256 partitions: 896,000 PUT/s); a directory each on a file
#: system, made on first use
ELASTIC_SHARDS = 256


def elastic_namespace(job: str | None) -> str:
    """Where an elastic job's objects live: ``el`` or ``el.{job}``."""
    return ELASTIC if job is None else f"{ELASTIC}.{job}"


def is_elastic_namespace(name: str) -> bool:
    """Whether the path component ``name`` is an elastic job's namespace."""
    return name == ELASTIC or name.startswith(ELASTIC + ".")


def is_member_id(member_id) -> bool:
    """Whether ``member_id`` is an elastic member id (16 lowercase hex)."""
    return isinstance(member_id, str) and _MEMBER_ID.fullmatch(member_id) is not None


def elastic_member(member_id: str) -> str:
    """Member ``member_id``'s introduction record."""
    return _sharded(f"member.{member_id}")


def elastic_heartbeat(member_id: str) -> str:
    """Member ``member_id``'s heartbeat record."""
    return _sharded(f"hb.{member_id}")


def elastic_join(n: int) -> str:
    """Entry ``n`` of the join queue."""
    return _sharded(f"join.{n}")


def elastic_roster(round_: int) -> str:
    """The roster (agreed membership) of round ``round_``."""
    return _sharded(f"r{round_}.roster")


def elastic_history(round_: int) -> str:
    """The job's membership history as of the change at round ``round_``
    (``elastic/history.py``)."""
    return f"history.{round_}"


def elastic_shard(name: str) -> str:
    """The shard directory ``p{xx}`` of the object named ``name`` (its last
    component): CRC-32 of the name modulo ``ELASTIC_SHARDS``, the same everywhere, so
    a round's objects (and each member's, each tree level's) spread evenly."""
    return f"p{zlib.crc32(name.encode('ascii')) % ELASTIC_SHARDS:02x}"


def _sharded(name: str) -> str:
    return f"{elastic_shard(name)}/{name}"


def elastic_contribution(round_: int, member_id: str) -> str:
    """Member ``member_id``'s contribution to round ``round_``."""
    return _sharded(f"r{round_}.{member_id}")


def _path(path) -> str:
    return ".".join(str(int(j)) for j in path)


def elastic_piece(round_: int, level: int, node: int, path) -> str:
    """A piece of a tree reduce (``elastic/tree.py``): at level 0 the slice ``path``
    of the contribution of roster position ``node``; above, range ``path`` of the
    partial sum of tree node ``node`` of ``level``."""
    return _sharded(f"r{round_}.t{level}.{node}.{_path(path)}")


def elastic_result(round_: int, path) -> str:
    """The range ``path`` of a tree reduce's average (``elastic/tree.py``)."""
    return _sharded(f"r{round_}.m.{_path(path)}")


def elastic_layout(digest: bytes) -> str:
    """The description of the call whose layout digest is ``digest`` (content-addressed:
    every member that calls with that layout writes the same record)."""
    return f"layout.{digest.hex()}"


def elastic_state(round_: int, part: int | None = None) -> str:
    """The training state published after round ``round_``: part ``part`` of it (an
    older publisher wrote one object, without a part)."""
    return f"state.{round_}" if part is None else f"state.{round_}.{part}"


_ELASTIC_PATTERNS = (
    ("elastic_member", r"member\.([0-9a-f]{16})", ("token",)),
    ("elastic_heartbeat", r"hb\.([0-9a-f]{16})", ("token",)),
    ("elastic_join", rf"join\.{_N}", ("number",)),
    ("elastic_roster", rf"r{_N}\.roster", ("collective",)),
    ("elastic_history", rf"history\.{_N}", ("collective",)),
    ("elastic_contribution", rf"r{_N}\.([0-9a-f]{{16}})", ("collective", "token")),
    ("elastic_piece", rf"r{_N}\.t{_N}\.[0-9]+(?:\.[0-9]+)+", ("collective", "number")),
    ("elastic_result", rf"r{_N}\.m(?:\.[0-9]+)+", ("collective",)),
    ("elastic_latest", re.escape(ELASTIC_LATEST), ()),
    ("elastic_state_pointer", re.escape(ELASTIC_STATE_POINTER), ()),
    ("elastic_state", rf"state\.{_N}(?:\.{_N})?", ("collective", "slice")),
    ("elastic_layout", r"layout\.([0-9a-f]{16})", ("digest",)),
    ("elastic_ended", re.escape(ELASTIC_ENDED), ()),
    ("elastic_job", re.escape(ELASTIC_JOB_RECORD), ()),
)
_ELASTIC_COMPILED = tuple((kind, re.compile(p), f) for kind, p, f in _ELASTIC_PATTERNS)
#: what ``parse_elastic`` can answer (``collective`` holds the round, ``token`` the id,
#: ``number`` a join entry's index or a tree piece's level)
ELASTIC_KINDS = tuple(kind for kind, _, _ in _ELASTIC_PATTERNS) + ("unknown",)


#: the kinds that lie in a shard directory (``elastic_shard``), and only there
ELASTIC_SHARDED_KINDS = ("elastic_member", "elastic_heartbeat", "elastic_join",
                         "elastic_roster", "elastic_contribution", "elastic_piece",
                         "elastic_result")
_ELASTIC_SHARD = re.compile(r"(p[0-9a-f]{2})/([^/]+)")


def in_elastic_shard(name: str) -> bool:
    """Whether ``name`` (a path inside an elastic namespace) lies in a shard directory."""
    return _ELASTIC_SHARD.fullmatch(name) is not None


def parse_elastic(name: str) -> Name:
    """What ``name`` (its path inside an elastic namespace) is; ``Name("unknown")``
    otherwise, a data object outside its shard directory included."""
    sharded = _ELASTIC_SHARD.fullmatch(name)
    found = _first_match(_ELASTIC_COMPILED, name if sharded is None else sharded[2])
    in_place = found.kind not in ELASTIC_SHARDED_KINDS if sharded is None else (
        found.kind in ELASTIC_SHARDED_KINDS and elastic_shard(sharded[2]) == sharded[1])
    return found if in_place else Name("unknown")
