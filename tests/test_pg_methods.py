"""Every collective of ``dist.ProcessGroup`` reaches ferrosync's own code, never the placeholder.

``SyncProcessGroup`` registers torch's ``FakeProcessGroup`` (``error_on_collective``) as
a placeholder backend so that torch sees device types and a name
(``ddp/factory.py``); a collective method it did not override would reach that
placeholder (``allgather_coalesced`` once did). So: every public method of
``dist.ProcessGroup`` that is not an accessor must be a Python method of
``SyncProcessGroup`` (statically, so a collective a new torch adds fails here), and
calling each one on a real 2-rank group gives ferrosync's result or its one-line
refusal naming the op, never the placeholder's error.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from ferrosync.ddp.process_group import SyncProcessGroup
from ranks import run_ranks

#: methods of dist.ProcessGroup that are not collectives (accessors, registration,
#: bookkeeping torch's C++ base class answers itself)
NOT_COLLECTIVES = {
    "BackendType", "CUSTOM", "GLOO", "MPI", "NCCL", "UCC", "UNDEFINED", "XCCL",
    "_backend_id", "_device_types", "_get_backend", "_get_backend_name", "_has_hooks", "_id",
    "_get_sequence_number_for_group", "_set_sequence_number_for_group",
    "_pybind11_conduit_v1_", "_register_backend", "_register_on_completion_hook",
    "_set_default_backend", "_set_group_desc", "_set_group_name", "bound_device_id",
    "boxed", "unbox", "group_desc", "group_name", "name", "rank", "size",
    "get_group_store", "use_pg_for_symm_mem_rendezvous",
}


def collectives() -> list[str]:
    return sorted(n for n in dir(dist.ProcessGroup)
                  if not n.startswith("__") and n not in NOT_COLLECTIVES)


def _defined_in_python(name: str) -> bool:
    for cls in SyncProcessGroup.__mro__:
        if cls is dist.ProcessGroup:
            return False
        if name in vars(cls):
            return True
    return False


@pytest.mark.unit
def test_every_collective_is_ferrosyncs_own():
    missing = [n for n in collectives() if not _defined_in_python(n)]
    assert not missing, f"dist.ProcessGroup methods that would reach the placeholder: {missing}"


def _calls(pg, rank: int, world: int):
    """(method, call) for every collective, with arguments a 2-rank group accepts."""
    other = 1 - rank
    t = lambda *v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    opts = dist.AllreduceOptions()
    root = dist.ReduceOptions()
    return [
        ("allreduce", lambda: pg.allreduce([t(rank)], opts)),
        ("allreduce_coalesced", lambda: pg.allreduce_coalesced([t(rank), t(1)],
                                                               dist.AllreduceCoalescedOptions())),
        ("broadcast", lambda: pg.broadcast([t(rank)], dist.BroadcastOptions())),
        ("allgather", lambda: pg.allgather([[t(0), t(0)]], [t(rank)])),
        ("allgather_coalesced", lambda: pg.allgather_coalesced([[t(0)], [t(0)]], [t(rank)])),
        ("_allgather_base", lambda: pg._allgather_base(t(0, 0), t(rank))),
        ("all_gather_single", lambda: pg.all_gather_single(t(0, 0), t(rank))),
        ("allgather_into_tensor_coalesced",
         lambda: pg.allgather_into_tensor_coalesced([t(0, 0)], [t(rank)])),
        ("all_gather_single_coalesced", lambda: pg.all_gather_single_coalesced([t(0, 0)],
                                                                               [t(rank)])),
        ("reduce", lambda: pg.reduce([t(rank)], root)),
        ("reduce_scatter", lambda: pg.reduce_scatter([t(0)], [[t(1), t(2)]],
                                                     dist.ReduceScatterOptions())),
        ("_reduce_scatter_base", lambda: pg._reduce_scatter_base(t(0), t(1, 2))),
        ("reduce_scatter_single", lambda: pg.reduce_scatter_single(t(0), t(1, 2))),
        ("reduce_scatter_tensor_coalesced",
         lambda: pg.reduce_scatter_tensor_coalesced([t(0)], [t(1, 2)])),
        ("reduce_scatter_single_coalesced",
         lambda: pg.reduce_scatter_single_coalesced([t(0)], [t(1, 2)])),
        ("gather", lambda: pg.gather([[t(0), t(0)]] if rank == 0 else [], [t(rank)],
                                     dist.GatherOptions())),
        ("scatter", lambda: pg.scatter([t(0)], [[t(1), t(2)]] if rank == 0 else [],
                                       dist.ScatterOptions())),
        ("alltoall", lambda: pg.alltoall([t(0), t(0)], [t(rank), t(rank + 2)],
                                         dist.AllToAllOptions())),
        ("alltoall_base", lambda: pg.alltoall_base(t(0, 0), t(rank, rank), [], [],
                                                   dist.AllToAllOptions())),
        ("all_to_all_single", lambda: pg.all_to_all_single(t(0, 0), t(rank, rank), [], [],
                                                           dist.AllToAllOptions())),
        ("send", lambda: pg.send([t(rank)], other, 3)),
        ("recv", lambda: pg.recv([t(0)], other, 3)),
        ("send", lambda: pg.send([t(rank)], other, 4)),
        ("recv_anysource", lambda: pg.recv_anysource([t(0)], 4)),
        ("barrier", lambda: pg.barrier(dist.BarrierOptions())),
        ("_start_coalescing", lambda: pg._start_coalescing(torch.device("cpu"))),
        ("_end_coalescing", lambda: pg._end_coalescing(torch.device("cpu"))),
        ("_wait_for_pending_works", lambda: pg._wait_for_pending_works()),
        ("monitored_barrier", lambda: pg.monitored_barrier()),
        ("set_timeout", lambda: pg.set_timeout(datetime.timedelta(seconds=5))),
        ("_enable_collectives_timing", lambda: pg._enable_collectives_timing()),
        ("split_group", lambda: pg.split_group([0])),
        ("merge_remote_group", lambda: pg.merge_remote_group(None, 2, None)),
        ("abort", lambda: None), ("shutdown", lambda: None),  # destroy_process_group calls them
    ]


def walk(rank, world, location):
    from ferrosync.errors import ConfigError

    os.environ["FERROSYNC_JOB"] = "walk"
    import ferrosync  # noqa: F401

    dist.init_process_group("ferrosync", init_method=location, rank=rank, world_size=world)
    pg = dist.distributed_c10d._get_default_group()
    seen = {}
    try:
        for name, call in _calls(pg, rank, world):
            try:
                work = call()
                if work is not None and hasattr(work, "wait"):
                    work.wait()
                seen[name] = "ok"
            except ConfigError as exc:
                assert "\n" not in str(exc).split(";")[0]
                seen[name] = "refused: " + str(exc)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                seen[name] = f"{type(exc).__name__}: {exc}"
    finally:
        dist.destroy_process_group()
    return seen


def test_no_collective_reaches_the_placeholder_or_goes_unanswered(tmp_path):
    results = run_ranks(walk, 2, str(tmp_path / "run"), timeout=120)
    called = {name for name, _ in _calls(None, 0, 2)}
    assert called == set(collectives()), "every collective is called by this test"
    for seen in results:
        for name, outcome in seen.items():
            assert "error_on_collective" not in outcome and "Fake" not in outcome, (name, outcome)
            assert outcome == "ok" or outcome.startswith("refused: ") and name in outcome, \
                (name, outcome)
        refused = {n for n, o in seen.items() if o != "ok"}
        assert refused == {"monitored_barrier", "set_timeout", "_enable_collectives_timing",
                           "split_group", "merge_remote_group"}


def uneven_own_part(rank, world, location, own_in, own_out):
    """all_to_all_single where rank 0 gives itself ``own_in`` rows but expects ``own_out``
    back from itself."""
    from ferrosync.errors import ConfigError

    dist.init_process_group("ferrosync", init_method=f"{location}/run", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    try:
        splits_in, splits_out = ([own_in, 2], [own_out, 1]) if rank == 0 else ([1, 1], [2, 1])
        out = torch.empty(sum(splits_out))
        try:
            dist.all_to_all_single(out, torch.ones(sum(splits_in)), splits_out, splits_in)
        except Exception as exc:  # noqa: BLE001 - the type and text are the result
            return type(exc).__name__, isinstance(exc, ConfigError), str(exc)
        return "no error", False, ""
    finally:
        dist.destroy_process_group()


# 1 row into 2: torch's copy_ would broadcast it silently; 2 into 3: torch's RuntimeError
@pytest.mark.parametrize("own_in, own_out", [(1, 2), (2, 3)])
def test_all_to_all_with_an_uneven_own_part_is_named_before_anything_moves(tmp_path, own_in,
                                                                           own_out):
    """Rank 0's own output part differs from its own input part: a ferrosync error
    naming the rank and both sizes at once."""
    results = run_ranks(uneven_own_part, 2, str(tmp_path), own_in, own_out, timeout=120)
    name, is_config, text = results[0]
    assert (name, is_config) == ("ConfigError", True), results[0]
    assert "rank 0" in text and "outputs[0]" in text, text
    assert f"{own_in} elements" in text and f"{own_out} elements" in text, text
    assert results[1][0] not in ("RuntimeError", "no error"), results[1]
