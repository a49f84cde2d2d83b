"""``SyncProcessGroup``: a ``torch.distributed`` process group whose collectives run on a
``GradSync``.

Built by ``init_process_group("ferrosync", ...)`` over a storage ``GradSync``
(``create_backend``) or by ``ferrosync.ddp.wrap`` over any one. It keeps every torch
backend's contract; ``allreduce`` overlaps with the backward pass (``overlap``), and a
failure reaches Python typed without crashing DDP's reducer (``_Pending``). Reductions,
overlap and errors: docs/ddp.md#what-the-backend-implements and
docs/design.md#ddp-process-group; how torch sees the group: ``factory``.
"""

from __future__ import annotations

import threading
import warnings
from functools import reduce

import torch
import torch.distributed as dist
from torch.futures import Future

from ferrosync.api import GradSync
from ferrosync.compression.codecs import FLOAT_DTYPES
from ferrosync.core import validate
from ferrosync.ddp.constants import BACKEND_NAME
from ferrosync.ddp.inference import StandIns as _StandIns
from ferrosync.ddp.inference import inference_safe as _inference_safe
from ferrosync.ddp.inference import needs_stand_ins as _needs_stand_ins
from ferrosync.ddp.object_warning import warn_object_collective as _warn_object_collective
from ferrosync.ddp.work import Done as _Done
from ferrosync.ddp.work import Pending as _Pending
from ferrosync.ddp.work import Received as _Received
from ferrosync.errors import ConfigError, ObjectCollectiveWarning

__all__ = ["SyncProcessGroup", "sync_of", "ObjectCollectiveWarning"]

_Op = dist.ReduceOp.RedOpType
_AVERAGED = FLOAT_DTYPES  # the dtypes GradSync.average_ takes
_HALF = (torch.float16, torch.bfloat16)
# combine two ranks' tensors; applied left to right in rank order
_COMBINE = {
    _Op.SUM: torch.add,
    _Op.PRODUCT: torch.mul,
    _Op.MIN: torch.minimum,
    _Op.MAX: torch.maximum,
    _Op.BAND: torch.bitwise_and,
    _Op.BOR: torch.bitwise_or,
    _Op.BXOR: torch.bitwise_xor,
}
_BITWISE = (_Op.BAND, _Op.BOR, _Op.BXOR)
_INTEGER = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


#: torch versions on which the async allreduce's private API is tested
#: (``Future._set_unwrap_func``, ``torch._C._current_graph_task_id``,
#: ``Variable._execution_engine.queue_callback``)
OVERLAP_TESTED_TORCH = ("2.13",)


def _overlap_supported() -> bool:
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    return (hasattr(Future, "_set_unwrap_func")
            and hasattr(torch._C, "_current_graph_task_id")
            and hasattr(engine, "queue_callback"))


def _reduce_op(opts) -> _Op:
    if opts is None:
        return _Op.SUM
    op = opts.reduceOp
    if isinstance(op, dist.ReduceOp):
        op = op.op
    return op if isinstance(op, _Op) else _Op(op)


def _sparse_sum(sync: GradSync, t: torch.Tensor) -> torch.Tensor:
    """The sum over the ranks of a sparse COO tensor, in rank order (gloo's sparse
    allreduce): every rank's indices and values through ``all_gather`` (padded to the
    largest count of entries), summed and coalesced alike on every rank."""
    t = t.coalesce()
    indices, values = t.indices(), t.values()
    counts = [int(c) for c in sync.all_gather(torch.tensor([indices.shape[1]]))]
    most = max(counts)
    pad = most - indices.shape[1]
    indices = torch.cat([indices, indices.new_zeros((indices.shape[0], pad))], 1)
    values = torch.cat([values, values.new_zeros((pad, *values.shape[1:]))])
    parts = zip(counts, sync.all_gather(indices), sync.all_gather(values))
    total = reduce(torch.add, [torch.sparse_coo_tensor(i[:, :n], v[:n], t.shape)
                               for n, i, v in parts])
    return total.coalesce()


def _split_rows(error, what: str, tensor: torch.Tensor, sizes, world: int) -> list:
    """``tensor`` cut along dim 0 by ``sizes`` (evenly when empty), for all_to_all_single."""
    sizes = list(sizes or [])
    rows = tensor.shape[0] if tensor.dim() else 1
    if not sizes:
        if rows % world:
            raise error(f"all_to_all_single {what} has {rows} rows, not divisible by the "
                        f"world size {world}", hint="pass split sizes")
        sizes = [rows // world] * world
    if len(sizes) != world or sum(sizes) != rows:
        raise error(f"all_to_all_single {what} split sizes {sizes} do not cut its {rows} "
                    f"rows into {world} parts")
    return list(torch.split(tensor.view(rows, -1) if tensor.dim() else tensor.view(1, 1),
                            sizes))


class SyncProcessGroup(dist.ProcessGroup):
    """A process group over ``sync``: rank and size are the GradSync's.

    Args:
        sync: any connected ``GradSync`` (storage, gloo, nccl).
        owns_sync: close ``sync`` when the group shuts down (``destroy_process_group``).
            ``init_process_group`` sets it; ``wrap`` leaves the caller's sync open.
        overlap: run ``allreduce`` of CPU tensors on the GradSync's async thread (see
            the module docstring); False makes it synchronous. Falls back to False, with a
            ``RuntimeWarning``, on a torch without the private API it needs.
    """

    def __init__(self, sync: GradSync, *, owns_sync: bool = False,
                 overlap: bool = True) -> None:
        if not isinstance(sync, GradSync):
            raise ConfigError(f"SyncProcessGroup needs a GradSync, got {type(sync).__name__}",
                              hint="create one with ferrosync.connect(url)")
        validate.boolean("overlap", overlap, rank=sync.rank)
        super().__init__(sync.rank, sync.world_size)
        self.sync = sync
        self._owns_sync = owns_sync
        if overlap and not _overlap_supported():
            warnings.warn(f"ferrosync cannot run allreduce asynchronously on torch "
                          f"{torch.__version__} (private API missing); DDP will not overlap "
                          "communication with the backward pass", RuntimeWarning, stacklevel=2)
            overlap = False
        self.overlap = overlap
        self._pending: list[_Pending] = []  # async allreduces not yet settled
        self._pending_lock = threading.Lock()
        self._settle_task: int | None = None  # the backward whose final callback is queued

    def getBackendName(self) -> str:  # torch's name for it
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"SyncProcessGroup({self.sync!r})"

    # -- checks (before any I/O, so a bad call leaves the GradSync usable) -------------------
    def _error(self, what: str, hint: str | None = None) -> ConfigError:
        return ConfigError(what, rank=self.sync.rank, path=self.sync.url, hint=hint)

    def _check_op(self, op: _Op, tensors) -> None:
        if op not in _COMBINE and op != _Op.AVG:  # PREMUL_SUM, or a future op
            raise self._error(f"reduce op {op.name} is not supported",
                              hint="use SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR or BXOR")
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise self._error(f"tensors[{i}] is a {type(t).__name__}, not a tensor")
            if t.is_sparse:
                raise self._error(f"tensors[{i}] is sparse; only dense tensors are supported")
            if op == _Op.AVG and t.dtype == torch.bool:
                raise self._error(f"AVG is undefined for bool tensors[{i}]",
                                  hint="use SUM, MAX or BOR, or cast to an integer dtype")
            if op == _Op.AVG and not (t.dtype in _AVERAGED or t.dtype in _INTEGER
                                      or t.is_complex()):
                raise self._error(f"AVG is not supported for tensors[{i}] of {t.dtype}",
                                  hint="use SUM and divide, or cast to float32")
            if op in _BITWISE and (t.is_floating_point() or t.is_complex()):
                raise self._error(f"{op.name} needs integer or bool tensors, tensors[{i}] is "
                                  f"{t.dtype}")
            if op in (_Op.MIN, _Op.MAX) and t.is_complex():
                raise self._error(f"{op.name} is undefined for complex tensors[{i}]")
            if (op in (_Op.SUM, _Op.AVG) and self.sync.wire_dtype == "topk"
                    and (t.dtype in _AVERAGED or t.is_complex())):
                # a sparse sum of arbitrary tensors (losses, metrics, parameters) would
                # silently drop most of their values; only updates may go sparse
                raise self._error(
                    f"allreduce {op.name} of {t.dtype} tensors[{i}] cannot use "
                    "wire_dtype='topk': it sends only each chunk's largest values",
                    hint="average DDP's gradients with ferrosync.ddp.wrap(model, sync) or "
                    "register_comm_hook(sync, ferrosync.ddp.hook); give other allreduces a "
                    "group without wire_dtype='topk'")

    def _check_list(self, what: str, tensors, count: int, numel: int) -> None:
        if len(tensors) != count:
            raise self._error(f"{what} has {len(tensors)} tensors, expected {count}")
        for i, t in enumerate(tensors):
            if numel is not None and t.numel() != numel:
                raise self._error(f"{what}[{i}] has {t.numel()} elements, expected {numel}",
                                  hint="every rank's tensor must have the same shape")

    # -- reductions -------------------------------------------------------------------------
    def _allreduce(self, tensors: list[torch.Tensor], op: _Op) -> None:
        """In place, after ``_check_op``. One collective per group of tensors, in a
        fixed order (so every rank issues the same sequence)."""
        tensors = [torch.view_as_real(t) if t.is_complex() and op in (_Op.SUM, _Op.AVG) else t
                   for t in tensors]
        if op in (_Op.SUM, _Op.AVG):
            floats = [t for t in tensors if t.dtype in _AVERAGED]
            others = [t for t in tensors if t.dtype not in _AVERAGED]
        else:
            floats, others = [], tensors
        if floats:
            self._average(floats, scale=op == _Op.SUM)
        for t in others:
            parts = self.sync.all_gather(t)
            if op == _Op.AVG:  # integers: NCCL's meaning, the sum divided toward zero
                t.copy_(torch.div(reduce(torch.add, parts), self.sync.world_size,
                                  rounding_mode="trunc"))
            else:
                t.copy_(reduce(_COMBINE[op], parts))

    def _average(self, tensors: list[torch.Tensor], *, scale: bool) -> None:
        world = self.sync.world_size
        if not scale:
            self.sync.average_(tensors)
            return
        # a sum is the average times W; half types go through float32 so that the
        # result is rounded to half once, not twice
        work = [t.float() if t.dtype in _HALF else t for t in tensors]
        self.sync.average_(work)
        for t, w in zip(tensors, work):
            if world != 1:
                w.mul_(world)
            if w is not t:
                t.copy_(w)

    # -- torch.distributed.ProcessGroup interface ------------------------------------------
    def allreduce(self, tensors, opts=None):
        op = _reduce_op(opts)
        if op == _Op.SUM and tensors and all(t.is_sparse for t in tensors):
            self._settle()
            with torch.no_grad():
                for t in tensors:
                    t.copy_(_sparse_sum(self.sync, t))
            return _Done(tensors)
        self._check_op(op, tensors)
        tensors = list(tensors)
        # inference tensors (Lightning's test loop): the collective runs on normal
        # stand-ins outside inference mode, the results are copied back inside it
        stand_ins = _StandIns(tensors) if _needs_stand_ins(tensors) else None
        work_on = stand_ins.args if stand_ins is not None else tensors
        if self.overlap and all(t.device.type == "cpu" for t in tensors):
            return self._start(lambda: self._allreduce(work_on, op), tensors,
                               stand_ins)
        self._settle()
        with torch.no_grad(), torch.inference_mode(False):
            self._allreduce(work_on, op)
        if stand_ins is not None:
            stand_ins.restore()
        return _Done(tensors)

    # -- the async allreduce ------------------------------------------------------------------
    def _start(self, body, result, stand_ins: _StandIns | None) -> _Pending:
        """Run ``body`` (after ``_check_op``; it works on ``result``'s tensors, or on
        their ``stand_ins``) as the next collective on the GradSync's async thread;
        return its ``Work``, whose value is ``result``."""
        self._raise_failed()
        sync = self.sync
        work = _Pending(result, sync.rank, sync.url)

        def job() -> None:
            with torch.no_grad():
                body()
            if stand_ins is not None:
                stand_ins.restore()  # before the Work completes: waiters see results

        # before any I/O: a closed or failed GradSync raises here, queueing nothing
        handle = sync.submit("allreduce", job)
        with self._pending_lock:
            self._pending.append(work)
        # the Work completes on the async thread, with the collective's error if any
        handle.add_done_callback(lambda done: work.finish(done.exception()))
        self._settle_at_end_of_backward()
        return work

    def _settle_at_end_of_backward(self) -> None:
        """Inside a backward pass, queue ``_settle`` as an autograd final callback (once
        per backward): ``backward()`` then raises a failed allreduce's typed error
        before DDP's reducer copies the bucket into the gradients."""
        task = torch._C._current_graph_task_id()
        if task < 0 or task == self._settle_task:
            return
        self._settle_task = task
        torch.autograd.Variable._execution_engine.queue_callback(self._settle)

    def _raise_failed(self) -> None:
        """Raise the error of an async allreduce that already failed (typed, once)."""
        with self._pending_lock:
            failed = next((w for w in self._pending if w.is_completed() and w.failure), None)
            self._pending = [w for w in self._pending if not w.is_completed()]
        if failed is not None:
            raise failed.failure

    def _settle(self) -> None:
        """Wait for every async allreduce started so far; raise the first failure."""
        with self._pending_lock:
            pending, self._pending = self._pending, []
        error = None
        for work in pending:
            work.settle()  # each collective is bounded by the GradSync's timeout
            error = error or work.failure
        if error is not None:
            raise error

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    @_inference_safe
    def broadcast(self, tensors, opts=None):
        self._settle()
        _warn_object_collective(self.sync)
        src = 0 if opts is None else opts.rootRank
        with torch.no_grad():
            self.sync.broadcast_(list(tensors), src=src)
        return _Done(tensors)

    @_inference_safe
    def allgather(self, output_tensors, input_tensors, opts=None):
        self._settle()
        _warn_object_collective(self.sync)
        if len(output_tensors) != len(input_tensors):
            raise self._error(f"allgather got {len(output_tensors)} output lists for "
                              f"{len(input_tensors)} inputs")
        for outs, inp in zip(output_tensors, input_tensors):
            self._check_list("allgather output", outs, self.sync.world_size, inp.numel())
        with torch.no_grad():
            for outs, inp in zip(output_tensors, input_tensors):
                for out, part in zip(outs, self.sync.all_gather(inp)):
                    out.copy_(part.view(out.shape))
        return _Done(output_tensors)

    def _check_world_times(self, what: str, whole: torch.Tensor, part: torch.Tensor) -> None:
        world = self.sync.world_size
        if whole.numel() != world * part.numel():
            raise self._error(f"{what} has {whole.numel()} elements, expected {world} x "
                              f"{part.numel()} (world size x the per-rank tensor)")

    def _coalesced(self, single, outputs, inputs, opts):
        for output, input in zip(outputs, inputs):
            single(output, input, opts)
        return _Done(outputs)

    @_inference_safe
    def _allgather_base(self, output, input, opts=None):
        self._settle()
        _warn_object_collective(self.sync)
        self._check_world_times("all_gather_into_tensor output", output, input)
        with torch.no_grad():
            parts = self.sync.all_gather(input)
            output.copy_(torch.cat([p.reshape(-1) for p in parts]).view(output.shape))
        return _Done([output])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._coalesced(self._allgather_base, outputs, inputs, opts)

    # torch >= 2.13 names for the two above (dist.all_gather_single / all_gather_into_tensor)
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced

    @_inference_safe
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        self._settle()
        op = _reduce_op(opts)
        world = self.sync.world_size
        for out, ins in zip(output_tensors, input_tensors):
            self._check_list("reduce_scatter input", ins, world, out.numel())
            self._check_op(op, [out, *ins])
        with torch.no_grad():
            for out, ins in zip(output_tensors, input_tensors):
                flat = torch.cat([t.reshape(-1) for t in ins])
                self._allreduce([flat], op)
                self._take_own_slice(out, flat)
        return _Done(output_tensors)

    @_inference_safe
    def _reduce_scatter_base(self, output, input, opts=None):
        self._settle()
        op = _reduce_op(opts)
        self._check_world_times("reduce_scatter_tensor input", input, output)
        self._check_op(op, [output, input])
        with torch.no_grad():
            flat = input.detach().reshape(-1).clone()
            self._allreduce([flat], op)
            self._take_own_slice(output, flat)
        return _Done([output])

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._coalesced(self._reduce_scatter_base, outputs, inputs, opts)

    # torch >= 2.13 names (dist.reduce_scatter_single / reduce_scatter_tensor)
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def _take_own_slice(self, out: torch.Tensor, flat: torch.Tensor) -> None:
        n = out.numel()
        out.copy_(flat[self.sync.rank * n:(self.sync.rank + 1) * n].view(out.shape))

    @_inference_safe
    def reduce(self, tensors, opts=None):
        self._settle()
        op = _reduce_op(opts)
        self._check_op(op, tensors)
        root = 0 if opts is None else opts.rootRank
        with torch.no_grad():
            # only the root's tensors change, as with gloo
            work = list(tensors) if self.sync.rank == root else [t.clone() for t in tensors]
            self._allreduce(work, op)
        return _Done(tensors)

    @_inference_safe
    def gather(self, output_tensors, input_tensors, opts=None):
        self._settle()
        _warn_object_collective(self.sync)
        root = 0 if opts is None else opts.rootRank
        (inp,) = input_tensors
        if self.sync.rank == root:
            self._check_list("gather output", output_tensors[0], self.sync.world_size,
                             inp.numel())
        with torch.no_grad():
            parts = self.sync.all_gather(inp)
            if self.sync.rank == root:
                for out, part in zip(output_tensors[0], parts):
                    out.copy_(part.view(out.shape))
        return _Done(output_tensors)

    @_inference_safe
    def scatter(self, output_tensors, input_tensors, opts=None):
        self._settle()
        _warn_object_collective(self.sync)
        root = 0 if opts is None else opts.rootRank
        (out,) = output_tensors
        world = self.sync.world_size
        if self.sync.rank == root:
            self._check_list("scatter input", input_tensors[0], world, out.numel())
        with torch.no_grad():
            rows = torch.empty((world, out.numel()), dtype=out.dtype, device=out.device)
            if self.sync.rank == root:
                for row, t in zip(rows, input_tensors[0]):
                    row.copy_(t.reshape(-1))
            self.sync.broadcast_([rows], src=root)
            out.copy_(rows[self.sync.rank].view(out.shape))
        return _Done(output_tensors)

    # dist._coalescing_manager(device=...): nothing to batch; the end waits for the
    # allreduces started inside (without these, torch would ask the placeholder backend)
    def _start_coalescing(self, device=None) -> None:
        pass

    def _end_coalescing(self, device=None):
        self._settle()
        return _Done([])

    @_inference_safe
    def barrier(self, opts=None):
        self._settle()
        self.sync.barrier()
        return _Done([])

    @_inference_safe
    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """``output_lists[r][i]`` becomes rank r's ``input_list[i]`` (gloo's layout: one
        list per rank); one all-gather of the inputs laid end to end when they share a
        dtype, else one per input."""
        self._settle()
        _warn_object_collective(self.sync)
        world = self.sync.world_size
        if len(output_lists) != world:
            raise self._error(f"all_gather_coalesced got {len(output_lists)} output lists, "
                              f"expected {world} (one per rank)")
        for r, outs in enumerate(output_lists):
            self._check_list(f"all_gather_coalesced output_lists[{r}]", outs, len(input_list),
                             None)
            for i, (out, inp) in enumerate(zip(outs, input_list)):
                if out.numel() != inp.numel():
                    raise self._error(f"all_gather_coalesced output_lists[{r}][{i}] has "
                                      f"{out.numel()} elements, input_list[{i}] {inp.numel()}")
        with torch.no_grad():
            groups = ([list(input_list)] if len({t.dtype for t in input_list}) <= 1
                      else [[t] for t in input_list])
            first = 0
            for group in groups:
                flat = torch.cat([t.detach().reshape(-1) for t in group]) if group else \
                    torch.empty(0)
                for r, part in enumerate(self.sync.all_gather(flat)):
                    offset = 0
                    for i, t in enumerate(group, start=first):
                        out = output_lists[r][i]
                        out.copy_(part[offset:offset + t.numel()].view(out.shape))
                        offset += t.numel()
                first += len(group)
        return _Done(output_lists)

    # -- all-to-all and point-to-point (GradSync.all_to_all / send / irecv) ------------------
    @_inference_safe
    def alltoall(self, output_tensors, input_tensors, opts=None):
        self._settle()
        self.sync.all_to_all(list(output_tensors), list(input_tensors))
        return _Done(output_tensors)

    @_inference_safe
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        self._settle()
        world = self.sync.world_size
        outputs = _split_rows(self._error, "output", output, output_split_sizes, world)
        inputs = _split_rows(self._error, "input", input, input_split_sizes, world)
        self.sync.all_to_all(outputs, inputs)
        return _Done([output])

    # torch >= 2.13's name for it (dist.all_to_all_single)
    all_to_all_single = alltoall_base

    def send(self, tensors, dst, tag=0):
        """Publishes the message now (it never waits for ``dst``): complete when returned."""
        self._settle()
        (tensor,) = tensors
        self.sync.send(tensor, dst, tag=tag)
        return _Done(list(tensors))

    def recv(self, tensors, src, tag=0):
        """A posted receive: the message is this one (the next from ``src`` on ``tag``),
        read by the returned Work's ``wait``."""
        (tensor,) = tensors
        return _Received(self.sync.irecv(tensor, src, tag=tag), list(tensors))

    def recv_anysource(self, tensors, tag=0):
        """A receive from whichever rank has a message first (``storage/messages.py``);
        the Work's ``_source_rank()`` names it."""
        (tensor,) = tensors
        return _Received(self.sync.irecv(tensor, None, tag=tag), list(tensors))

    def _wait_for_pending_works(self) -> None:
        self._settle()

    def _refuse(self, name: str, hint: str):
        raise self._error(f"{name} is not supported by the {BACKEND_NAME} backend", hint=hint)

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        self._refuse("monitored_barrier", "use barrier(): it raises PeerFailed or SyncTimeout "
                     "naming a rank that failed or never arrived")

    def set_timeout(self, timeout) -> None:
        self._refuse("set_timeout", "pass timeout= to init_process_group or new_group")

    def _enable_collectives_timing(self) -> None:
        self._refuse("_enable_collectives_timing", "ferrosync.ddp.stats(group) gives the "
                     "seconds each phase took")

    def split_group(self, *args, **kwargs):
        self._refuse("split_group", "use dist.new_group(ranks)")

    def merge_remote_group(self, *args, **kwargs):
        self._refuse("merge_remote_group", "use dist.new_group(ranks)")

    # -- lifetime ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Called by ``destroy_process_group``: closes an owned GradSync (never waits on
        peers, never raises because a peer failed) and joins its async thread."""
        if self._owns_sync:
            self.sync.close()  # also joins the async thread: queued work fails fast

    def abort(self) -> None:
        self.shutdown()


def sync_of(group) -> GradSync | None:
    """The GradSync behind ``group``: a ``SyncProcessGroup``, or a torch ``ProcessGroup``
    wrapping one (what ``init_process_group("ferrosync")`` and ``new_group`` make); None
    for any other group."""
    if isinstance(group, SyncProcessGroup):
        return group.sync
    if isinstance(group, dist.ProcessGroup):
        try:  # torch wraps the backend a factory returned in a ProcessGroup
            backend = group._get_backend(torch.device("cpu"))
        except (RuntimeError, AttributeError, ValueError):
            return None
        if isinstance(backend, SyncProcessGroup):
            return backend.sync
    return None
