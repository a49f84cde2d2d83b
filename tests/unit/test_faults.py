"""``testing/faults.py`` in one process: which faults a rank loads from ``$FERROSYNC_FAULTS``,
and ``FaultyStorage`` over the in-memory store (tests/fakes.py) firing each non-fatal
action at its phase, object kind and collective, and only as often as asked. The
``kill`` action is the multi-process suites' (tests/faults/)."""

from __future__ import annotations

import json
import os

import pytest

from fakes import FakeClock, MemoryStorage
from ferrosync.errors import ConfigError, StorageError
from ferrosync.storage import names
from ferrosync.storage.engines import ENV_FAULTS, LocalStorage, open_storage
from ferrosync.testing import faults
from ferrosync.testing.faults import FaultyStorage, load_faults

C3_R1 = f"g/{names.contribution(3, 1)}"
C3_OUT = f"g/{names.result(3)}"


def loaded(monkeypatch, value, rank=1):
    monkeypatch.setenv(ENV_FAULTS, value if isinstance(value, str) else json.dumps(value))
    return load_faults(rank, os.environ.get(ENV_FAULTS))


def test_no_variable_no_faults(monkeypatch):
    monkeypatch.delenv(ENV_FAULTS, raising=False)
    assert load_faults(0, os.environ.get(ENV_FAULTS)) == []


def test_opening_a_ranks_storage_is_the_one_hook(monkeypatch, tmp_path):
    """``open_storage`` wraps a rank's storage where ``$FERROSYNC_FAULTS`` names faults for
    it (an elastic member's: any rank's, matched later); a tool's, a checkpoint's or
    another rank's storage stays the engine's own."""
    monkeypatch.delenv(ENV_FAULTS, raising=False)
    assert type(open_storage(str(tmp_path), rank=1)) is LocalStorage
    monkeypatch.setenv(ENV_FAULTS, json.dumps([{"rank": 1}]))
    wrapped = open_storage(str(tmp_path), rank=1)
    assert type(wrapped) is FaultyStorage and wrapped.url == str(tmp_path)
    assert type(open_storage(str(tmp_path), rank=lambda: 0)) is FaultyStorage
    assert type(open_storage(str(tmp_path), rank=0)) is LocalStorage
    assert type(open_storage(str(tmp_path))) is LocalStorage
    monkeypatch.setenv(ENV_FAULTS, "not json")
    with pytest.raises(ConfigError, match="is not JSON"):
        open_storage(str(tmp_path), rank=0)


def test_a_rank_loads_its_own_faults_with_the_defaults(monkeypatch):
    got = loaded(monkeypatch, [{"rank": 1, "collective": 3}, {"rank": 0, "action": "delay"}])
    assert got == [{"phase": "write", "action": "kill", "object": "any", "times": 1,
                    "rank": 1, "collective": 3}]
    assert loaded(monkeypatch, {"rank": 1, "phase": "read"})[0]["phase"] == "read"


@pytest.mark.parametrize("value, words", [
    ("not json", "is not JSON"),
    ([{"collective": 1}], "every fault needs a 'rank'"),
    ([{"rank": 0, "phase": "later"}], "phase must be one of"),
    ([{"rank": 0, "action": "explode"}], "action must be one of"),
])
def test_bad_faults_are_config_errors_on_every_rank(monkeypatch, value, words):
    with pytest.raises(ConfigError, match=words):
        loaded(monkeypatch, value, rank=5)  # not this rank's, refused all the same


def wrap(*specs) -> tuple[FaultyStorage, MemoryStorage]:
    inner = MemoryStorage()
    full = [{"phase": "write", "action": "kill", "object": "any", "times": 1, **s}
            for s in specs]
    return FaultyStorage(inner, full), inner


def test_write_phase_corruption_is_published_damaged():
    storage, inner = wrap({"action": "corrupt", "offset": 1, "bit": 3})
    storage.put(C3_R1, [b"\x00\x00\x00\x00"])
    assert inner.objects[C3_R1] == b"\x00\x08\x00\x00"
    storage.put(C3_R1.replace("c3", "c4"), [b"\x00\x00"])  # once only
    assert inner.objects[C3_R1.replace("c3", "c4")] == b"\x00\x00"


def test_publish_phase_truncation_and_deletion_hit_the_visible_object():
    storage, inner = wrap({"phase": "publish", "action": "truncate", "offset": 2})
    storage.put(C3_R1, [b"abcdef"])
    assert inner.objects[C3_R1] == b"ab"
    storage, inner = wrap({"phase": "publish", "action": "delete", "object": "result"})
    storage.put(C3_R1, [b"contrib"])
    storage.put(C3_OUT, [b"result"])
    assert set(inner.objects) == {C3_R1}


def test_control_records_are_spared_and_the_collective_must_match():
    storage, inner = wrap({"action": "truncate", "offset": 1, "collective": 4, "times": 0})
    storage.put(f"g/{names.heartbeat(1)}", [b"beat"])
    storage.put(C3_R1, [b"three"])
    assert inner.objects == {f"g/{names.heartbeat(1)}": b"beat", C3_R1: b"three"}
    for _ in range(3):  # times 0: every time
        storage.put(C3_R1.replace("c3", "c4"), [b"four"])
        assert inner.objects[C3_R1.replace("c3", "c4")] == b"f"


def test_raise_gives_the_storage_error_of_that_errno():
    storage, _ = wrap({"phase": "read", "action": "raise", "errno": "EACCES"})
    with pytest.raises(StorageError, match=r"reading failed \(PermissionError") as info:
        storage.open(C3_OUT)
    assert info.value.path == "mem://test/" + C3_OUT and "permission" in info.value.hint
    assert storage.open(C3_OUT) is None  # spent: the next open passes through


def test_delay_sleeps_then_the_put_goes_through(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(faults, "time", clock)
    storage, inner = wrap({"action": "delay", "seconds": 2.5})
    storage.put(C3_R1, [b"x"])
    assert clock.slept == 2.5 and inner.objects[C3_R1] == b"x"


def test_reduce_phase_fires_once_the_payload_was_read():
    storage, inner = wrap({"phase": "reduce", "action": "delete"})
    inner.objects[C3_OUT] = b"r" * 1000
    reader = storage.open(C3_OUT)
    buf = bytearray(400)
    reader.readinto(buf)
    assert C3_OUT in inner.objects  # not yet: the payload is still being read
    reader.readinto(bytearray(600))
    assert C3_OUT not in inner.objects
    reader.close()


def test_replay_publishes_a_copy_of_another_ranks_object():
    storage, inner = wrap({"action": "replay", "from_rank": 0})
    inner.objects[f"g/{names.contribution(3, 0)}"] = b"rank zero's bytes"
    storage.put(C3_R1, [b"rank one's bytes"])
    assert inner.objects[C3_R1] == b"rank zero's bytes"


def test_the_wrapper_looks_like_the_store_it_wraps():
    storage, inner = wrap()
    assert storage.url == inner.url and storage.counters is inner.counters
    assert storage.cheap_deletes == inner.cheap_deletes
    storage.put("g/x", [b"1"])
    assert storage.list("g/") == [("g/x", 1)] and storage.read("g/x") == b"1"
    storage.delete(["g/x"])
    assert inner.objects == {}
