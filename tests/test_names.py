"""ferrosync.storage.names: every name formats and parses back, and no two kinds are confused."""

from __future__ import annotations

import itertools
import os

import pytest

from ferrosync.storage import names

pytestmark = pytest.mark.unit

TOKEN16 = "0123456789abcdef"

# (formatted name, the fields parse must give back); one or more of every kind
CASES = [
    (names.contribution(7, 3), names.Name("contribution", rank=3, collective=7)),
    (names.contribution(7, 3, 2), names.Name("contribution", rank=3, collective=7, slice=2)),
    (names.contribution(0, 0, 0), names.Name("contribution", rank=0, collective=0, slice=0)),
    (names.result(12), names.Name("result", collective=12)),
    (names.result(12, 4), names.Name("result", collective=12, slice=4)),
    (names.layout_record(bytes.fromhex("00ff10aa20bb30cc"), 5),
     names.Name("layout", rank=5, digest="00ff10aa20bb30cc")),
    (names.message(2, 0, 5, 11), names.Name("message", rank=2, peer=0, tag=5, number=11)),
    (names.message(0, 1, 0, 0), names.Name("message", rank=0, peer=1, tag=0, number=0)),
    (names.heartbeat(9), names.Name("heartbeat", rank=9)),
    (names.abort(2), names.Name("abort", rank=2)),
    (names.namespace(None), names.Name("namespace")),
    (names.namespace("job-a"), names.Name("namespace", job="job-a")),
    (names.namespace("launch-5d1c.0e7_a"), names.Name("namespace", job="launch-5d1c.0e7_a")),
    (names.join(1, 4), names.Name("join", rank=1, number=4)),
    (names.announcement(3), names.Name("announcement", number=3)),
    (names.objection(1, 5), names.Name("objection", rank=1, number=5)),
    (names.end(0, 2), names.Name("end", rank=0, number=2)),
    (names.generation_dir(6, TOKEN16), names.Name("generation", number=6, token=TOKEN16)),
    (names.temp("c3.r1.s0", pid=4242, token="deadbeef"),
     names.Name("temp", pid=4242, token="deadbeef", target="c3.r1.s0")),
    (names.temp("hb.r0", pid=1, token="0000aaaa"),
     names.Name("temp", pid=1, token="0000aaaa", target="hb.r0")),
    (names.part("c3.r1.s0", "0123456789abcdef", 12),
     names.Name("part", number=12, token="0123456789abcdef", target="c3.r1.s0")),
    (names.spare(pid=77, token="cafe0123"), names.Name("spare", pid=77, token="cafe0123")),
    (names.probe(3, token="89abcdef"), names.Name("probe", rank=3, token="89abcdef")),
    (names.doctor_dir(pid=55, token="a1b2c3d4"), names.Name("doctor", pid=55, token="a1b2c3d4")),
    (names.GC_LOCK, names.Name("lock")),
]


@pytest.mark.parametrize("name,expected", CASES, ids=[c[0] for c in CASES])
def test_format_then_parse_gives_the_fields_back(name, expected):
    assert names.parse(name) == expected


def test_the_formats_are_the_documented_spellings():
    assert names.contribution(7, 3) == "c7.r3"
    assert names.contribution(7, 3, 2) == "c7.r3.s2"
    assert names.result(12) == "c12.out"
    assert names.result(12, 4) == "c12.out.s4"
    assert names.layout_record(b"\x01\x02", 5) == "layout.0102.r5"
    assert names.heartbeat(9) == "hb.r9"
    assert names.message(2, 0, 5, 11) == "m11.r2.d0.t5"
    assert names.abort(2) == "abort.r2"
    assert names.namespace(None) == "rdzv"
    assert names.namespace("j") == "rdzv.j"
    assert names.join(1, 4) == "join.r1.4"
    assert names.announcement(3) == "gen.3"
    assert names.objection(1, 5) == "dup.r1.5"
    assert names.end(0, 2) == "end.r0.2"
    assert names.generation_dir(6, TOKEN16) == f"g6.{TOKEN16}"
    assert names.temp("x", pid=1, token="0badcafe") == ".x.1.0badcafe.tmp"
    assert names.spare(pid=1, token="0badcafe") == ".spare.1.0badcafe"
    assert names.probe(3, token="0badcafe") == ".probe.r3.0badcafe"
    assert names.doctor_dir(pid=1, token="0badcafe") == ".doctor.1.0badcafe"
    assert names.within("", "hb.r0") == "hb.r0"
    assert names.within(f"g0.{TOKEN16}", "hb.r0") == f"g0.{TOKEN16}/hb.r0"


def test_random_parts_default_to_this_process_and_fresh_hex():
    for make, kind in ((lambda: names.temp("c1.out"), "temp"), (names.spare, "spare"),
                       (names.doctor_dir, "doctor")):
        first, second = make(), make()
        assert first != second  # a fresh token each time
        parsed = names.parse(first)
        assert parsed.kind == kind and parsed.pid == os.getpid()
    probe = names.parse(names.probe(4))
    assert probe.kind == "probe" and probe.rank == 4 and len(probe.token) == 8


def test_no_name_parses_as_another_kind():
    kinds = [expected.kind for _, expected in CASES]
    assert set(kinds) == set(names.KINDS) - {"unknown"}  # every kind is covered above
    for (name_a, a), (name_b, b) in itertools.combinations(CASES, 2):
        assert (name_a == name_b) == (a == b)
        if a.kind != b.kind:
            assert names.parse(name_a).kind != b.kind, (name_a, b.kind)


@pytest.mark.parametrize("name", [
    "", "notes.txt", "README", "c", "c1", "c1.r", "c1.rx", "c1.r2.s", "c1.r2.x3", "c1.outs",
    "c-1.r2", "C1.r2", "layout.XYZ.r1", "layout..r1", "hb.r", "hb.rx", "hb.0", "abort.1",
    "join.r1", "join.1.2", "gen.", "gen.x", "dup.r1", "end.r1", "g1", "g1.0123",
    "g1.0123456789ABCDEF", "g1.0123456789abcdef0", "rdzv.", "rdzv.-bad", "rdzv.a/b",
    "rdzvx", ".tmp", ".x.tmp", ".x.1.abc.tmp", ".x.1.ABCDEF12.tmp", ".spare.1", ".spare.x.0badcafe",
    ".probe.1.0badcafe", ".probe.r1.0badcaf", ".doctor.x.ab", ".doctor.1.", "ferrosync-gc.lock",
    "step-00000040.pt", "latest.json", "m1.r2.d3", "m1.r2.d3.t-4", "mx.r1.d2.t3",
    "c1.r2/hb.r0", "c\u0661.r1", "hb.r\u0662",
])
def test_foreign_names_parse_as_unknown(name):
    assert names.parse(name) == names.Name("unknown")


def test_data_and_rendezvous_kind_groups():
    assert set(names.GENERATION_KINDS) == {"contribution", "result", "layout", "message",
                                           "heartbeat", "abort"}
    assert set(names.RENDEZVOUS_KINDS) == {"join", "announcement", "objection", "end"}


def test_generation_tokens():
    assert names.is_generation_token(TOKEN16)
    for bad in (None, 5, "", TOKEN16.upper(), TOKEN16 + "0", TOKEN16[:-1], "../" + TOKEN16[3:]):
        assert not names.is_generation_token(bad)
