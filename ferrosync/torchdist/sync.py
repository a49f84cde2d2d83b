"""``TorchDistSync``: the same ``GradSync`` contract over NCCL or gloo (torch.distributed).

``gloo://HOST:PORT`` and ``nccl://HOST:PORT`` make (and on close destroy) the default
process group; ``torch://`` uses the existing one. Sum-and-count, layout checks before
any data moves, buckets and ``wire_dtype`` as on storage; storage-only options are
accepted with one warning (docs/design.md#gloo-and-nccl-urls).
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from ferrosync.api import GradSync
from ferrosync.compression.codecs import accumulator_dtype
from ferrosync.compression.encoder import Encoder
from ferrosync.core.common import accumulate, check_layouts, total_weight, weighted_copy
from ferrosync.core.common import translate_torch_error as _translate
from ferrosync.ddp import BACKEND_NAME
from ferrosync.errors import ConfigError
from ferrosync.storage.engines import Counters
from ferrosync.torchdist.options import TorchOptions

_ENV_VARS = ("MASTER_ADDR", "MASTER_PORT")

_log = logging.getLogger(__name__)


class TorchDistSync(GradSync):
    """GradSync over torch.distributed (NCCL for CUDA tensors, gloo for CPU tensors)."""

    default_bucket_bytes = TorchOptions.default("bucket_bytes")  # bucket_bytes=None: the same

    @classmethod
    def check_options(cls, options: dict) -> TorchOptions:
        return TorchOptions.parse(options)

    def __init__(self, url: str, identity, timeout: float, options: TorchOptions) -> None:
        # bytes this rank contributed / received; requests = collective calls
        self._counters = Counters()
        super().__init__(url, identity, timeout, self._counters, options.bucket_bytes)
        self._opts = options
        self.wire_dtype = options.wire_dtype
        self._encoder = Encoder.for_options(options, self.buffers)
        self._seq = 0
        self._owns_group = False
        self._cpu_group = None  # gloo group for CPU tensors when the default one is NCCL
        scheme = url.split("://", 1)[0].lower()
        td = datetime.timedelta(seconds=timeout)
        if not dist.is_available():
            raise ConfigError("this torch build has no torch.distributed",
                              hint="install a torch build with distributed support")
        if scheme == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise ConfigError(
                "nccl:// needs CUDA GPUs and a torch build with NCCL; none are available here",
                rank=self.rank, path=url, hint="use gloo://HOST:PORT for CPU tensors",
            )
        if scheme in ("gloo", "nccl"):
            host, port = _host_port(url)
            if dist.is_initialized():
                raise ConfigError(
                    "a default process group already exists", rank=self.rank, path=url,
                    hint="use connect('torch://') to share it, or connect before creating it",
                )
            try:
                store = dist.TCPStore(host, port, self.world_size, self.rank == 0, timeout=td)
                dist.init_process_group(scheme, store=store, rank=self.rank,
                                        world_size=self.world_size, timeout=td)
            except (RuntimeError, ValueError, OSError) as exc:
                raise _translate(exc, self.rank, 0, url, "rendezvous") from exc
            self._owns_group = True
        elif scheme == "torch":
            if not dist.is_initialized():
                missing = [v for v in _ENV_VARS if not os.environ.get(v)]
                if missing:
                    raise ConfigError(
                        f"torch:// found no process group and {missing} are not set",
                        rank=self.rank, path=url,
                        hint="run under torchrun, call init_process_group first, or use "
                        "gloo://HOST:PORT",
                    )
                backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() \
                    else "gloo"
                try:
                    dist.init_process_group(backend, init_method="env://", rank=self.rank,
                                            world_size=self.world_size, timeout=td)
                except (RuntimeError, ValueError, OSError) as exc:
                    raise _translate(exc, self.rank, 0, url, "rendezvous") from exc
                self._owns_group = True
            if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world_size):
                raise ConfigError(
                    f"the process group says rank {dist.get_rank()} of "
                    f"{dist.get_world_size()}, ferrosync was told rank {self.rank} of "
                    f"{self.world_size}", rank=self.rank, path=url,
                    hint="drop rank=/world_size= from connect() to take the group's",
                )
        else:  # pragma: no cover - the registry only routes these schemes here
            raise ConfigError(f"unsupported URL {url!r}")
        backend = str(dist.get_backend()).lower()
        self._backend = backend
        # ferrosync's own backend carries CPU tensors like gloo (torch:// over a group
        # made with init_process_group("ferrosync"))
        self._has_gloo = "gloo" in backend or backend == BACKEND_NAME
        self._has_nccl = "nccl" in backend
        if not self._has_gloo:
            # CPU tensors and the layout exchange need gloo next to NCCL
            self._cpu_group = dist.new_group(backend="gloo", timeout=td)

    # -- helpers -----------------------------------------------------------------------------
    def _group_for(self, device: torch.device):
        if device.type == "cuda":
            if not self._has_nccl:
                raise ConfigError(
                    f"a tensor on {device} was given to a gloo sync ({self.url})",
                    rank=self.rank, collective=self._seq, path=self.url,
                    hint="use nccl://HOST:PORT for CUDA tensors, or move them to the CPU",
                )
            return None
        if device.type != "cpu":
            raise ConfigError(f"tensors on {device} are not supported by {self.url}",
                              rank=self.rank, collective=self._seq, path=self.url)
        return self._cpu_group

    def _call(self, what: str, fn, *args, **kwargs):
        """Run one torch collective; map its failures to ferrosync errors."""
        t0 = time.perf_counter()
        try:
            fn(*args, **kwargs)
        except (RuntimeError, ValueError, OSError) as exc:
            raise _translate(exc, self.rank, self._seq, self.url, what) from exc
        finally:
            self.stats_book.add_time("wait_s", time.perf_counter() - t0)
            self._counters.add(requests=1)

    def _check_layout(self, op: str, digest: bytes, layout: dict) -> None:
        """Fixed-size exchange of the layout digest before any data moves."""
        self._seq += 1

        def gather(out, tensor):
            self._call(f"{op} (layout check)", dist.all_gather, out, tensor,
                       group=self._cpu_group)

        check_layouts(gather, self.world_size, self.rank, digest, layout,
                      collective=self._seq, url=self.url)

    # -- primitives --------------------------------------------------------------------------
    def _average_flat(self, flat, weight, digest, layout):
        self._check_layout(layout["op"], digest, layout)
        group = self._group_for(flat.device)
        if self.world_size == 1:
            return weight
        if self._opts.wire_dtype is not None and flat.dtype.is_floating_point:
            codec = self._encoder.codec(flat.dtype)
            if not codec.raw:
                # codec state belongs to what the data is (see api._stream), not its shape
                return self._average_encoded(flat, weight, codec,
                                             (layout.get("stream"), digest), group)
        n = flat.numel()
        acc_dtype = accumulator_dtype(flat.dtype)
        with self.stats_book.phase("reduce_s"):
            buf = self.buffers.get("allreduce", n + 1, acc_dtype, flat.device)
            weighted_copy(buf[:n], flat, weight)
            buf[n] = weight
        nbytes = buf.numel() * buf.element_size()
        self._call("average_", dist.all_reduce, buf, group=group)
        self._counters.add(written=nbytes, read=nbytes)
        total = float(buf[n].item())
        if total > 0:
            with self.stats_book.phase("read_s"):
                torch.div(buf[:n], total, out=flat)  # one pass: divide and narrow to dtype
        return total

    def _average_encoded(self, flat, weight, codec, ef_key, group):
        """wire_dtype path: all-gather encoded payloads, sum them in rank order locally."""
        n = flat.numel()
        nbytes = codec.nbytes(n)
        with self.stats_book.phase("reduce_s"):
            # [float64 weight | payload], padded to 8 bytes so every frame is aligned
            frame = self.buffers.get("frame", 8 + -(-nbytes // 8) * 8, torch.uint8, flat.device)
            frame[:8].copy_(torch.tensor([weight], dtype=torch.float64).view(torch.uint8))
            if weight > 0:
                self._encoder.encode_into(flat.to(torch.float32), codec,
                                          frame[8 : 8 + nbytes], ef_key)
            else:
                frame[8:].zero_()
            gathered = self.buffers.get("gathered", self.world_size * frame.numel(), torch.uint8,
                                      flat.device)
        self._call("average_", dist.all_gather_into_tensor, gathered, frame, group=group)
        self._counters.add(written=frame.numel(), read=gathered.numel())
        with self.stats_book.phase("reduce_s"):
            frames = gathered.view(self.world_size, frame.numel())
            weights = [float(f[:8].cpu().clone().view(torch.float64).item()) for f in frames]
            total = total_weight(weights)
            if total == 0:
                return 0.0
            acc = self.buffers.get("acc", n, accumulator_dtype(flat.dtype), flat.device)
            first = True
            for w, f in zip(weights, frames):
                if w == 0:
                    continue
                accumulate(acc, codec.decode(f[8 : 8 + nbytes], n), w, first=first)
                first = False
            acc.div_(total)
            if not codec.lossy_result:
                # topk: the sum of sparse payloads is dense; every rank summed the same
                # decoded payloads in the same order, so it is already identical everywhere
                flat.copy_(acc)
                return total
            # like the storage backend, the result travels (here: is rounded) in the wire
            # encoding, so every rank holds exactly what the others hold
            result = self.buffers.get("result", nbytes, torch.uint8, flat.device)
            codec.encode(acc, result)
            flat.copy_(codec.decode(result, n))
        return total

    def _broadcast_flat(self, flat, src, digest, layout):
        self._check_layout("broadcast", digest, layout)
        group = self._group_for(flat.device)
        if self.world_size == 1:
            return
        buf = flat if flat.dtype != torch.bool else flat.view(torch.uint8)
        self._call("broadcast_", dist.broadcast, buf, src=src, group=group)
        nbytes = flat.numel() * flat.element_size()
        self._counters.add(written=nbytes if self.rank == src else 0,
                           read=0 if self.rank == src else nbytes)

    def _all_gather_flat(self, flat, digest, layout):
        self._check_layout("all_gather", digest, layout)
        group = self._group_for(flat.device)
        out = [torch.empty_like(flat) for _ in range(self.world_size)]
        if self.world_size == 1:
            out[0].copy_(flat)
            return out
        if flat.dtype == torch.bool:
            views = [o.view(torch.uint8) for o in out]
            self._call("all_gather", dist.all_gather, views, flat.view(torch.uint8), group=group)
        else:
            self._call("all_gather", dist.all_gather, out, flat, group=group)
        nbytes = flat.numel() * flat.element_size()
        self._counters.add(written=nbytes, read=nbytes * (self.world_size - 1))
        return out

    def _barrier(self, digest, layout):
        # the layout exchange is itself an all-gather every rank must enter
        self._check_layout("barrier", digest, layout)

    def _publish_abort(self, exc):
        """Nothing to publish: a rank that fails leaves the process group (on exit or
        close), and the peers' next collective on it fails at once."""

    def _shutdown(self, failure):
        self._encoder.clear()
        if self._owns_group and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except (RuntimeError, ValueError):  # never raise from close(); a broken group
                _log.debug("rank %d: destroy_process_group failed", self.rank, exc_info=True)


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if not parts.hostname or parts.port is None:
        raise ConfigError(
            f"{url!r} needs a host and a port", path=url,
            hint="write it as gloo://HOST:PORT (rank 0 listens on HOST:PORT)",
        )
    return parts.hostname, parts.port
