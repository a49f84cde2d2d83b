"""``HierarchicalSync``: fast links inside a node, shared storage between nodes.

``connect(url, local="gloo" | "nccl" | "auto")``: the ranks of a node reduce ``[w·T, w]``
to their leader, the leaders run the storage collective, and each leader broadcasts the
result and a status word inside its node, so every rank ends with the flat weighted
average's bytes (docs/design.md#two-level-sync).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os

import torch
import torch.distributed as dist

from ferrosync.api import GradSync
from ferrosync.compression.codecs import accumulator_dtype
from ferrosync.core.common import check_layouts, weighted_copy
from ferrosync.core.common import translate_torch_error as _translate
from ferrosync.core.env import Identity
from ferrosync.core.private import host_dir
from ferrosync.core.registry import storage_backend
from ferrosync.errors import ConfigError, FerrosyncError, error_class, relay_text, relayed
from ferrosync.storage.engines import Counters
from ferrosync.torchdist.options import HierarchicalOptions

_STATUS_OK, _STATUS_FAILED = 0.0, 1.0
_MESSAGE_BYTES = 2048

_log = logging.getLogger(__name__)


class _Counters:
    """Storage counters of the inter-node sync (leaders) plus local bytes moved."""

    def __init__(self) -> None:
        self.local = Counters()
        self.inter: Counters | None = None

    def snapshot(self) -> dict:
        out = self.local.snapshot()
        if self.inter is not None:
            for key, value in self.inter.snapshot().items():
                out[key] += value
        return out


def node_identity(identity: Identity,
                  options: HierarchicalOptions) -> tuple[int, int, int, int]:
    """(node, nnodes, local_rank, local_world_size), validated."""
    local_rank = options.local_rank
    local_world = options.local_world_size
    if local_rank is None:
        local_rank = identity.local_rank
    if local_world is None:
        local_world = identity.local_world_size
    if local_world < 1 or not 0 <= local_rank < local_world:
        raise ConfigError(f"local_rank {local_rank} is not below local_world_size {local_world}")
    if identity.world_size % local_world:
        raise ConfigError(
            f"world_size {identity.world_size} is not a multiple of local_world_size "
            f"{local_world}", hint="every node must run the same number of ranks")
    group_rank = os.environ.get("GROUP_RANK")
    node = int(group_rank) if group_rank and group_rank.isdigit() else (
        identity.rank // local_world)
    if identity.rank != node * local_world + local_rank:
        raise ConfigError(
            f"rank {identity.rank} is not rank {local_rank} of node {node} with "
            f"{local_world} ranks per node", hint="ranks of a node must be consecutive")
    return node, identity.world_size // local_world, local_rank, local_world


class HierarchicalSync(GradSync):
    """GradSync whose leaders meet through storage and whose nodes use gloo/NCCL."""

    @classmethod
    def check_options(cls, options: dict) -> HierarchicalOptions:
        return HierarchicalOptions.parse(options)

    def __init__(self, url: str, identity: Identity, timeout: float,
                 options: HierarchicalOptions) -> None:
        node, nnodes, local_rank, local_world = node_identity(identity, options)
        self._counters = _Counters()
        super().__init__(url, identity, timeout, self._counters, None)
        self.wire_dtype = options.storage.wire_dtype  # the leaders' (inside a node: exact)
        self.node, self.nnodes = node, nnodes
        self.local_rank, self.local_world_size = local_rank, local_world
        mode = options.local
        if mode == "auto":
            mode = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
        self.local_mode = mode
        self._inter: GradSync | None = None
        self._gloo = self._nccl = None
        td = datetime.timedelta(seconds=timeout)
        self._make_local_groups(url, options.local_dir, td)
        if local_rank == 0:
            node_identity_ = Identity(node, nnodes, 0, 1, "hierarchical")
            try:
                self._inter = storage_backend()(url, node_identity_, timeout, options.storage)
            except BaseException as exc:
                self._tell_node_failed(exc)
                self._destroy_local()
                raise
            self._counters.inter = self._inter.counters
            self._tell_node_ok()
        else:
            self._expect_ok()

    # -- local groups --------------------------------------------------------------------------
    def _make_local_groups(self, url: str, local_dir: str | None, td) -> None:
        """Meet the node's ranks through a node-local storage sync, then build gloo
        (+NCCL)."""
        base = local_dir or _default_local_dir()
        digest = hashlib.sha256(url.encode()).hexdigest()[:16]
        local_url = os.path.join(base, digest, f"n{self.node}")
        meet = storage_backend()(
            local_url, Identity(self.local_rank, self.local_world_size, 0, 1, "node-local"),
            td.total_seconds(), storage_backend().check_options({"heartbeat_timeout": 10.0}))
        try:
            store = None
            port = torch.zeros(1, dtype=torch.int64)
            if self.local_rank == 0:
                # don't wait for the clients here: they learn the port from us below
                store = dist.TCPStore("127.0.0.1", 0, self.local_world_size, True, timeout=td,
                                      wait_for_workers=False)
                port[0] = store.port
            meet.broadcast_(port, src=0)
            if store is None:
                store = dist.TCPStore("127.0.0.1", int(port.item()), self.local_world_size,
                                      False, timeout=td)
            prefix = f"{meet.generation_url}"
            self._gloo = dist.ProcessGroupGloo(dist.PrefixStore(prefix + "/gloo", store),
                                               self.local_rank, self.local_world_size, td)
            if self.local_mode == "nccl":
                self._nccl = dist.ProcessGroupNCCL(dist.PrefixStore(prefix + "/nccl", store),
                                                   self.local_rank, self.local_world_size)
            self._store = store
        except (RuntimeError, ValueError, OSError) as exc:
            raise _translate(exc, self.rank, 0, local_url, "local rendezvous") from exc
        finally:
            meet.close()

    def _pg(self, device: torch.device):
        if device.type == "cuda":
            if self._nccl is None:
                raise ConfigError(
                    f"a tensor on {device} with local='{self.local_mode}'", rank=self.rank,
                    path=self.url, hint="use local='nccl' (or 'auto') for CUDA tensors")
            return self._nccl
        return self._gloo

    def _local(self, what: str, work_fn) -> None:
        try:
            work_fn().wait()
        except (RuntimeError, ValueError, OSError) as exc:
            raise _translate(exc, self.rank, 0, self.url, f"{what} inside node {self.node}") \
                from exc
        finally:
            self._counters.local.add(requests=1)

    def _local_reduce(self, buf: torch.Tensor) -> None:
        if self.local_world_size == 1:
            return
        opts = dist.ReduceOptions()
        opts.rootRank, opts.reduceOp = 0, dist.ReduceOp.SUM
        self._local("local reduce", lambda: self._pg(buf.device).reduce([buf], opts))
        nbytes = buf.numel() * buf.element_size()
        self._counters.local.add(written=nbytes if self.local_rank else 0,
                                 read=nbytes if not self.local_rank else 0)

    def _local_broadcast(self, buf: torch.Tensor, root: int = 0) -> None:
        if self.local_world_size == 1:
            return
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self._local("local broadcast", lambda: self._pg(buf.device).broadcast([buf], opts))

    @property
    def unauthenticated_storage(self) -> bool:
        # only the leaders touch storage, through their storage sync
        return self._inter is not None and self._inter.unauthenticated_storage

    # -- leader -> node status ---------------------------------------------------------------
    def _tell_node_ok(self) -> None:
        self._local_broadcast(torch.tensor([_STATUS_OK], dtype=torch.float64))

    def _tell_node_failed(self, exc: BaseException) -> None:
        """Leader: make the node's ranks raise too (best effort: we are failing)."""
        try:
            self._local_broadcast(torch.tensor([_STATUS_FAILED], dtype=torch.float64))
        except FerrosyncError:  # the node's group is broken too: its ranks raise anyway
            _log.debug("rank %d: could not tell node %d it failed", self.rank, self.node,
                       exc_info=True)
            return
        self._send_failure(exc)

    def _send_failure(self, exc: BaseException) -> None:
        """Leader, after a failed status went out: the error itself, as JSON."""
        try:
            text = json.dumps({"type": type(exc).__name__,
                               "message": relay_text(exc)}).encode()
            msg = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
            data = text[: _MESSAGE_BYTES]
            msg[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self._local_broadcast(msg)
        except FerrosyncError:  # the status already went out; the text is a courtesy
            _log.debug("rank %d: could not send the failure text to node %d", self.rank,
                       self.node, exc_info=True)

    def _expect_ok(self) -> None:
        status = torch.zeros(1, dtype=torch.float64)
        self._local_broadcast(status)
        if status.item() != _STATUS_OK:
            self._raise_leader_failure()

    def _raise_leader_failure(self):
        msg = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
        self._local_broadcast(msg)
        raw = bytes(msg.tolist()).rstrip(b"\0")
        try:
            info = json.loads(raw.decode())
        except ValueError:
            info = {"type": "PeerFailed", "message": "(unreadable)"}
        cls = error_class(str(info.get("type")))
        raise cls(f"the leader of node {self.node} (rank {self.rank - self.local_rank}) "
                  f"reports: {relayed(info.get('message'))}", rank=self.rank, path=self.url,
                  hint="see the leader's log; every rank of every node stops")

    def _leader_step(self, fn, failed_buffer: torch.Tensor | None = None):
        """Run ``fn`` on the leader; on failure, tell the node before raising.

        The node's ranks are blocked in a broadcast of a known shape: the failure
        status must travel in that very shape (``failed_buffer``, whose last element
        is the status), or they would read garbage as a result.
        """
        try:
            return fn()
        except BaseException as exc:
            exc = self._between_nodes(exc)
            if failed_buffer is None:
                self._tell_node_failed(exc)
            else:
                failed_buffer[-1] = _STATUS_FAILED
                try:
                    self._local_broadcast(failed_buffer)
                    self._send_failure(exc)
                except FerrosyncError:  # the node's group is broken: its ranks raise anyway
                    _log.debug("rank %d: could not tell node %d it failed", self.rank,
                               self.node, exc_info=True)
            raise exc

    def _between_nodes(self, exc: BaseException) -> BaseException:
        """Leaders meet as storage ranks 0..nnodes-1: say which node a rank number is."""
        if not isinstance(exc, FerrosyncError) or getattr(exc, "_translated", False):
            return exc
        L = self.local_world_size
        note = (f" [between node leaders: storage rank k is node k, i.e. global rank k*{L}; "
                f"this is node {self.node}]")
        new = type(exc)(exc.what + note, rank=self.rank, collective=exc.collective,
                        path=exc.path, hint=exc.hint)
        new._translated = True
        return new

    def _check_layout(self, digest: bytes, layout: dict) -> None:
        """Inside the node, before any data moves (leaders check across nodes too)."""
        if self.local_world_size == 1:
            return
        base = self.rank - self.local_rank

        def gather(out, tensor):
            self._local("layout check", lambda: self._gloo.allgather([out], [tensor]))

        check_layouts(gather, self.local_world_size, self.local_rank, digest, layout,
                      collective=0, url=self.url, global_rank=lambda k: base + k)

    # -- primitives --------------------------------------------------------------------------
    def _average_flat(self, flat, weight, digest, layout):
        self._check_layout(digest, layout)
        n = flat.numel()
        acc = accumulator_dtype(flat.dtype)
        # [w·T..., w, status]: the weight rides with the data; the status lets a failed
        # leader stop its node at once
        buf = self.buffers.get("local", n + 2, acc, flat.device)
        weighted_copy(buf[:n], flat, weight)
        buf[n] = weight
        buf[n + 1] = _STATUS_OK
        self._local_reduce(buf)
        if self.local_rank == 0:
            node_weight = float(buf[n].item())

            def inter():
                # in the accumulator dtype: a half-type node average rounded before the
                # storage average would round twice (the contract suite measured 4e-2
                # relative error in float16); the result is rounded once, below
                node_avg = self.buffers.get("node", n, acc, flat.device)
                if node_weight > 0:
                    torch.div(buf[:n], node_weight, out=node_avg)
                total = self._inter.average_(node_avg, weight=node_weight)
                return node_avg, total

            node_avg, total = self._leader_step(inter, failed_buffer=buf)
            if total > 0:
                buf[:n].copy_(node_avg)
            buf[n] = total
        self._local_broadcast(buf)
        if buf[n + 1].item() != _STATUS_OK:
            self._raise_leader_failure()
        total = float(buf[n].item())
        if total > 0:
            flat.copy_(buf[:n])
        return total

    def _broadcast_flat(self, flat, src, digest, layout):
        self._check_layout(digest, layout)
        src_node, src_local = divmod(src, self.local_world_size)
        buf = flat if flat.dtype != torch.bool else flat.view(torch.uint8)
        if self.node == src_node and src_local != 0:
            self._local_broadcast(buf, root=src_local)  # to the leader (and the node)
        if self.local_rank == 0:
            self._leader_step(lambda: self._inter.broadcast_(flat, src=src_node))
            self._tell_node_ok()
        else:
            self._expect_ok()
        self._local_broadcast(buf)

    def _all_gather_flat(self, flat, digest, layout):
        self._check_layout(digest, layout)
        L = self.local_world_size
        local = [torch.empty_like(flat) for _ in range(L)]
        if L > 1:
            view = (lambda t: t.view(torch.uint8)) if flat.dtype == torch.bool else (
                lambda t: t)
            self._local("local all-gather",
                        lambda: self._pg(flat.device).allgather([[view(t) for t in local]],
                                                                [view(flat)]))
        else:
            local[0].copy_(flat)
        full = torch.empty((self.world_size, *flat.shape), dtype=flat.dtype, device=flat.device)
        if self.local_rank == 0:
            def inter():
                parts = self._inter.all_gather(torch.stack(local))
                return torch.cat(parts)

            full.copy_(self._leader_step(inter))
            self._tell_node_ok()
        else:
            self._expect_ok()
        self._local_broadcast(full if flat.dtype != torch.bool else full.view(torch.uint8))
        return list(full.unbind(0))

    def _barrier(self, digest, layout):
        # the layout exchange is itself a node-wide all-gather every local rank enters
        self._check_layout(digest, layout)
        if self.local_rank == 0:
            self._leader_step(self._inter.barrier)
            self._tell_node_ok()
        else:
            self._expect_ok()

    def _publish_abort(self, exc):
        if self._inter is not None:
            self._inter.guard.fail(exc)
        else:
            # a non-leader cannot reach storage: breaking the node's group makes the
            # leader raise at once, and it tells the other nodes
            self._destroy_local()

    def _destroy_local(self) -> None:
        for pg in (self._nccl, self._gloo):
            if pg is not None:
                for method in ("abort", "shutdown"):
                    fn = getattr(pg, method, None)
                    if fn is not None:
                        try:
                            fn()
                            break
                        except RuntimeError:  # already broken or shut down: try the next
                            _log.debug("rank %d: %s() of the local group failed", self.rank,
                                       method, exc_info=True)
                            continue
        self._nccl = self._gloo = None
        self._store = None

    def _shutdown(self, failure):
        try:
            if self._inter is not None:
                self._inter.close()
        finally:
            self._destroy_local()


def _default_local_dir() -> str:
    """This user's host directory, created and verified (``ferrosync.core.private``: a
    directory another user made first is a ``ConfigError``), then used by path: nobody
    else can rename anything inside it."""
    with host_dir() as directory:
        return directory.path

