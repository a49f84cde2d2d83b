"""``storage/recycler.py`` in one process: when consumed objects go, and spares.

The ``Recycler`` over a ``MemoryStorage`` (tests/fakes.py), once as a store that
cannot recycle (an object store: consumed objects are deleted) and once as one that
can (a local file system: large consumed objects are parked and rewritten). The
cleanup rule it implements: docs/design.md#cleanup.
"""

from __future__ import annotations

import pytest

from fakes import MemoryStorage
from ferrosync.storage.recycler import RECYCLE_MIN_BYTES, Recycler

pytestmark = pytest.mark.unit

BIG = RECYCLE_MIN_BYTES
SMALL = RECYCLE_MIN_BYTES - 1


def store(*keys: str, **traits) -> MemoryStorage:
    storage = MemoryStorage(**traits)
    for key in keys:
        storage.objects[key] = b"x"
    return storage


def test_consumed_objects_go_at_the_next_flush_not_before():
    storage = store("g/c1.r0", "g/c1.r1", cheap_deletes=False)
    recycler = Recycler(storage, world_size=2)
    recycler.consumed("g/c1.r0", "g/c1.r1")
    recycler.before_collective()  # few enough: left for a wait, off the critical path
    assert set(storage.objects) == {"g/c1.r0", "g/c1.r1"}
    recycler.flush()
    assert storage.objects == {} and storage.requests("delete") == ["g/c1.r0", "g/c1.r1"]
    recycler.flush()  # nothing left: no request
    assert len(storage.requests("delete")) == 2


def test_garbage_piling_up_is_flushed_before_the_next_collective():
    world = 2
    limit = 2 * world + 8
    keys = [f"g/c{i}.r0" for i in range(limit + 1)]
    storage = store(*keys, cheap_deletes=False)
    recycler = Recycler(storage, world)
    recycler.consumed(*keys[:limit])
    recycler.before_collective()
    assert len(storage.objects) == len(keys)  # at the limit: still deferred
    recycler.consumed(keys[limit])
    recycler.before_collective()
    assert storage.objects == {}


@pytest.mark.parametrize("cheap", [True, False], ids=["cheap-deletes", "billed-deletes"])
def test_a_result_is_held_until_a_later_collective_gathered_every_rank(cheap):
    storage = store("g/c1.out", "g/c2.out", cheap_deletes=cheap)
    recycler = Recycler(storage, world_size=3)
    recycler.hold_until_gathered("g/c1.out")
    recycler.flush()
    assert "g/c1.out" in storage.objects  # a peer may still be reading it
    recycler.gathered(["g/c2.out"])  # every rank reached a later collective
    if not cheap:
        assert "g/c1.out" in storage.objects  # deleted at the next wait instead
        recycler.flush()
    assert set(storage.objects) == {"g/c2.out"}  # the new result is held in its turn
    recycler.gathered([])
    recycler.flush()
    assert storage.objects == {}


def test_large_consumed_objects_become_spares_rewritten_by_later_puts():
    storage = MemoryStorage(can_recycle=True)
    recycler = Recycler(storage, world_size=2)
    for key, size in (("g/c1.r0", BIG), ("g/c1.r0.s1", 4 * BIG), ("g/c1.r0.s2", SMALL)):
        storage.put(key, [b"x" * size])
        recycler.written(key, size)
    recycler.consumed("g/c1.r0", "g/c1.r0.s1", "g/c1.r0.s2")
    recycler.before_collective()  # recycling stores flush first, so puts find spares
    assert storage.requests("delete") == ["g/c1.r0.s2"]  # too small to be worth parking
    spares = sorted(k for k in storage.objects if "/.spare." in k)
    assert len(spares) == 2 and not {"g/c1.r0", "g/c1.r0.s1"} & set(storage.objects)
    assert recycler.take_spare(SMALL) is None  # a small put would truncate a spare away
    medium = recycler.take_spare(2 * BIG)  # the smallest spare that fits
    assert len(storage.objects[medium]) == 4 * BIG
    assert recycler.take_spare(2 * BIG) is None
    assert len(storage.objects[recycler.take_spare(BIG)]) == BIG
    assert recycler.take_spare(BIG) is None


def test_spares_are_capped_and_released_at_close():
    world = 1
    cap = 2 * world + 4
    storage = MemoryStorage(can_recycle=True)
    recycler = Recycler(storage, world)
    keys = [f"g/c{i}.r0" for i in range(cap + 2)]
    for key in keys:
        storage.put(key, [b"x" * BIG])
        recycler.written(key, BIG)
    recycler.consumed(*keys)
    recycler.flush()
    assert sum("/.spare." in k for k in storage.objects) == cap
    assert storage.requests("delete") == keys[cap:]  # the rest are deleted
    recycler.release()
    assert storage.objects == {}


def test_a_store_that_cannot_recycle_deletes_instead_of_parking():
    storage = MemoryStorage(can_recycle=False)
    recycler = Recycler(storage, world_size=2)
    storage.put("g/c1.r0", [b"x" * BIG])
    recycler.written("g/c1.r0", BIG)
    recycler.consumed("g/c1.r0")
    recycler.flush()
    assert storage.objects == {} and storage.requests("park") == []
    assert recycler.take_spare(BIG) is None
