"""The "ferrosync" backend as a real torch group: DeviceMesh, functional collectives,
DTensor, FSDP2, DCP async_save, integer AVG.

Every feature runs on real processes twice, on stock gloo and on the ferrosync
backend over a directory, and every rank's results are compared (exactly where
gloo's are deterministic). ``SyncProcessGroup`` carries a placeholder C++ backend
(torch's ``FakeProcessGroup`` with ``error_on_collective``) so that torch sees its
device types and name; the tests also prove that no collective reaches it.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ferrosync.ddp import factory
from ranks import run_ranks

TIMEOUT = datetime.timedelta(seconds=60)
WORLD = 2


def _init(backend: str, rank: int, world: int, location: str) -> None:
    if backend == "gloo":
        dist.init_process_group("gloo", init_method=f"file://{location}/gloo.store", rank=rank,
                                world_size=world, timeout=TIMEOUT)
    else:
        dist.init_process_group("ferrosync", init_method=f"{location}/run", rank=rank,
                                world_size=world, timeout=TIMEOUT)


def _placeholder_in_place() -> None:
    """On ferrosync: the group's CPU backend is still the placeholder that raises on
    every collective, so nothing the feature ran went through it unnoticed."""
    if dist.get_backend() != "ferrosync":
        return
    placeholder = dist.group.WORLD._get_backend(torch.device("cpu"))
    assert placeholder.name() == "fake", placeholder.name()
    assert placeholder.options.error_on_collective


def run_feature(rank, world, backend, location, feature):
    _init(backend, rank, world, location)
    try:
        out = FEATURES[feature](rank, world, location)
        _placeholder_in_place()
        out["group_name"] = dist.group.WORLD.group_name
        out["device_types"] = sorted(d.type for d in dist.group.WORLD._device_types)
        return out
    finally:
        dist.destroy_process_group()


# -- the features --------------------------------------------------------------------------

def mesh_funcol(rank, world, location):
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    t = torch.arange(4, dtype=torch.float32) * (rank + 1)
    out = {"all_reduce": funcol.all_reduce(t, "sum", mesh)}
    out["all_reduce_group"] = funcol.all_reduce(t, "sum", dist.group.WORLD)
    out["all_gather"] = funcol.all_gather_tensor(t, 0, mesh)
    out["reduce_scatter"] = funcol.reduce_scatter_tensor(
        torch.arange(2 * world, dtype=torch.float32) * (rank + 1), "sum", 0, mesh)
    out["broadcast"] = funcol.broadcast(t, 1, mesh)
    out = {k: funcol.wait_tensor(v).clone() for k, v in out.items()}
    out["mesh"] = mesh.mesh.tolist()
    return out


def mesh_2d(rank, world, location):
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    t = torch.tensor([float(rank), 1.0])
    return {"dp": funcol.wait_tensor(funcol.all_reduce(t, "sum", (mesh, 0))).clone(),
            "tp": funcol.wait_tensor(funcol.all_reduce(t, "sum", mesh["tp"])).clone(),
            "names_differ": mesh.get_group(0).group_name != mesh.get_group(1).group_name}


def dtensor_op(rank, world, location):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    a = torch.randn(8, 6)
    b = torch.randn(6, 4)
    da = distribute_tensor(a, mesh, [Shard(0)])
    db = distribute_tensor(b, mesh, [Replicate()])
    prod = da @ db
    total = prod.sum()  # a partial -> replicated reduction
    return {"local": da.to_local().clone(), "full": prod.full_tensor().clone(),
            "sum": total.full_tensor().clone(),
            "resharded": prod.redistribute(mesh, [Shard(1)]).to_local().clone()}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def fsdp2_step(rank, world, location):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = MLP()
    fully_shard(model.a, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    full = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    return {"loss": loss.detach().clone(), **full}


def int_avg(rank, world, location):
    ints = torch.tensor([rank + 1, 3 * rank - 4, -rank, 7, -(1 << rank)], dtype=torch.int64)
    out = {}
    for dtype in (torch.int64, torch.int32, torch.uint8):
        t = (ints.abs() if dtype == torch.uint8 else ints).to(dtype, copy=True)
        if dist.get_backend() == "gloo":  # gloo has no AVG: what NCCL computes
            dist.all_reduce(t)
            t = torch.div(t, world, rounding_mode="trunc")
        else:
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
        out[str(dtype)] = t
    return out


def dcp_async(rank, world, location):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    state = {"w": distribute_tensor(torch.randn(8, 3), mesh, [Shard(0)]),
             "b": torch.arange(5.0), "step": 7}
    path = os.path.join(location, f"ckpt-{dist.get_backend()}")
    future = dcp.async_save(state, checkpoint_id=path)
    future.result()
    loaded = {"w": distribute_tensor(torch.zeros(8, 3), mesh, [Shard(0)]),
              "b": torch.zeros(5), "step": 0}
    dcp.load(loaded, checkpoint_id=path)
    again = {"w": distribute_tensor(torch.zeros(8, 3), mesh, [Shard(0)]), "b": torch.zeros(5)}
    dcp.save(loaded, checkpoint_id=path + "-sync")
    dcp.load(again, checkpoint_id=path + "-sync")
    return {"w": loaded["w"].full_tensor().clone(), "w_local": loaded["w"].to_local().clone(),
            "b": loaded["b"].clone(), "step": loaded["step"],
            "w_sync": again["w"].full_tensor().clone(), "b_sync": again["b"].clone()}


FEATURES = {"mesh_funcol": mesh_funcol, "mesh_2d": mesh_2d, "dtensor_op": dtensor_op,
            "fsdp2_step": fsdp2_step, "int_avg": int_avg, "dcp_async": dcp_async}


# -- the tests -----------------------------------------------------------------------------

def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _compare(tmp_path, feature, *, exact=True, world=WORLD):
    (tmp_path / "g").mkdir()
    (tmp_path / "f").mkdir()
    gloo = run_ranks(run_feature, world, "gloo", str(tmp_path / "g"), feature)
    ours = run_ranks(run_feature, world, "ferrosync", str(tmp_path / "f"), feature)
    for rank, (ref, got) in enumerate(zip(gloo, ours)):
        assert got["device_types"] == ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        assert got["group_name"] == ref["group_name"]
        for key, value in ref.items():
            if key in ("group_name", "device_types"):
                continue
            if exact or not isinstance(value, torch.Tensor):
                assert _equal(got[key], value), f"rank {rank} {key}: {got[key]} != {value}"
            else:
                torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-7,
                                           msg=lambda m, k=key, r=rank: f"rank {r} {k}: {m}")
    return ours


def test_device_mesh_and_functional_collectives_match_gloo(tmp_path):
    ours = _compare(tmp_path, "mesh_funcol")
    t = torch.arange(4, dtype=torch.float32)
    assert torch.equal(ours[0]["all_reduce"], t * 3)  # not the unchanged input


def test_two_dimensional_mesh_matches_gloo(tmp_path):
    # the mesh dimensions are subgroups (new_group) of the ferrosync world group
    ours = _compare(tmp_path, "mesh_2d", world=4)
    assert [o["dp"][0].item() for o in ours] == [2.0, 4.0, 2.0, 4.0]
    assert [o["tp"][0].item() for o in ours] == [1.0, 1.0, 5.0, 5.0]
    assert all(o["names_differ"] for o in ours)


def test_dtensor_op_matches_gloo(tmp_path):
    _compare(tmp_path, "dtensor_op")


def test_fsdp2_fully_shard_step_matches_gloo(tmp_path):
    # gradients are reduce-scattered: SUM/AVG over 2 ranks is exact on both backends
    ours = _compare(tmp_path, "fsdp2_step")
    torch.manual_seed(0)
    assert not torch.equal(ours[0]["a.weight"], MLP().a.weight.detach())  # the step moved it


def test_integer_avg_is_sum_divided_toward_zero(tmp_path):
    ours = _compare(tmp_path, "int_avg")
    # rank r: [r+1, 3r-4, -r, 7, -(2^r)] -> sums [3, -5, -1, 14, -3] -> trunc /2
    assert ours[0]["torch.int64"].tolist() == [1, -2, 0, 7, -1]


def test_dcp_async_save_and_load_match_gloo(tmp_path):
    ours = _compare(tmp_path, "dcp_async")
    torch.manual_seed(0)
    w = torch.randn(8, 3)
    assert torch.equal(ours[1]["w"], w) and torch.equal(ours[1]["w_sync"], w)
    assert torch.equal(ours[0]["w_local"], w[:4]) and torch.equal(ours[1]["b_sync"],
                                                                  torch.arange(5.0))


# -- the placeholder -----------------------------------------------------------------------

def placeholder_probe(rank, world, location):
    """Every collective through torch's entry points (Python, C++ functional, object),
    on the world group and a subgroup; then the placeholder itself must raise."""
    import torch.distributed._functional_collectives as funcol

    _init("ferrosync", rank, world, location)
    try:
        pg = dist.group.WORLD
        placeholder = pg._get_backend(torch.device("cpu"))
        seen = []
        t = torch.ones(3) * (rank + 1)
        dist.all_reduce(t)
        seen.append(t.tolist())
        seen.append(funcol.all_reduce(torch.ones(2), "sum", pg).tolist())
        seen.append(funcol.all_gather_tensor(torch.full((1,), float(rank)), 0, pg).tolist())
        seen.append(funcol.reduce_scatter_tensor(torch.ones(world), "sum", 0, pg).tolist())
        objects = [None] * world
        dist.all_gather_object(objects, rank)
        seen.append(objects)
        sub = dist.new_group(list(range(world)))
        u = torch.ones(1)
        dist.all_reduce(u, group=sub)
        seen.append(u.tolist())
        seen.append(funcol.all_reduce(torch.ones(1), "sum", sub).tolist())
        seen.append([sub.group_name != pg.group_name,
                     sorted(d.type for d in sub._device_types)])
        a, b = torch.ones(2), torch.ones(1)
        with dist._coalescing_manager(device=torch.device("cpu")):
            dist.all_reduce(a)
            dist.all_reduce(b)
        seen.append(a.tolist() + b.tolist())
        # point-to-point and all-to-all through torch's own front ends (the placeholder's
        # send/recv would be silent no-ops even with error_on_collective)
        peer, prev = (rank + 1) % world, (rank - 1) % world
        got = torch.empty(1)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.tensor([1.0 * rank]),
                                                       peer),
                                            dist.P2POp(dist.irecv, got, prev)]):
            work.wait()
        a2a = funcol.all_to_all_single(torch.arange(world) + 10.0 * rank, None, None, pg)
        seen.append([got.item(), funcol.wait_tensor(a2a).tolist()])
        dist.barrier()
        # the placeholder would be a silent no-op without error_on_collective
        try:
            placeholder.allreduce([torch.ones(1)]).wait()
            raised = None
        except RuntimeError as exc:
            raised = str(exc)
        return seen, raised
    finally:
        dist.destroy_process_group()


def test_no_collective_reaches_the_placeholder(tmp_path):
    results = run_ranks(placeholder_probe, WORLD, str(tmp_path))
    for rank, (seen, raised) in enumerate(results):
        assert seen[-1] == [(rank - 1) % WORLD, [10.0 * k + rank for k in range(WORLD)]]
        assert seen[:-1] == [[3.0] * 3, [2.0, 2.0], [0.0, 1.0], [2.0], [0, 1], [2.0], [2.0],
                             [True, ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])],
                             [2.0, 2.0, 2.0]]
        assert raised is not None and "error_on_collective" in raised


@pytest.mark.unit
def test_placeholder_trick_pinned_to_tested_torch():
    tested = factory.PLACEHOLDER_TESTED_TORCH
    assert tested == ("2.13",)
    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if version not in tested:
        pytest.fail(f"torch {torch.__version__} is not in PLACEHOLDER_TESTED_TORCH {tested}: "
                    "rerun tests/test_pg_torch_features.py and add it")


def monitored_barrier_probe(rank, world, location):
    from ferrosync.errors import ConfigError

    _init("ferrosync", rank, world, location)
    try:
        errors = []
        try:
            dist.monitored_barrier()
        except ValueError as exc:
            errors.append((type(exc).__name__, isinstance(exc, ConfigError), str(exc)))
        try:
            dist.group.WORLD.monitored_barrier()
        except ValueError as exc:
            errors.append((type(exc).__name__, isinstance(exc, ConfigError), str(exc)))
        dist.barrier()  # the group is still usable
        return errors
    finally:
        dist.destroy_process_group()


def test_monitored_barrier_is_refused_by_torch_before_the_backend(tmp_path):
    # torch refuses every backend but gloo in dist.monitored_barrier itself, before any
    # backend is reached (a ValueError, the base class of ConfigError); the group's own
    # method raises ConfigError naming the alternative
    for errors in run_ranks(monitored_barrier_probe, WORLD, str(tmp_path)):
        (name, ours, text), (name2, ours2, text2) = errors
        assert (name, ours) == ("ValueError", False) and "only implemented for GLOO" in text
        assert (name2, ours2) == ("ConfigError", True) and "monitored_barrier" in text2
