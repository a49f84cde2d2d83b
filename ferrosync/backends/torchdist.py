"""``TorchDistSync``: the same ``GradSync`` contract over NCCL or gloo (torch.distributed).

URLs:

* ``gloo://HOST:PORT`` / ``nccl://HOST:PORT``: rendezvous through torch's TCPStore at
  that address (rank 0 listens there) and initialise the default process group;
  ``close()`` destroys it again.
* ``torch://``: use the default process group that already exists (e.g. the script
  called ``init_process_group`` under torchrun), or initialise one from ``env://``
  (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``).

CUDA tensors travel over NCCL; CPU tensors over gloo (an ``nccl://`` sync creates a
gloo group next to NCCL for CPU tensors and control messages). A CUDA tensor given to
a gloo-only sync, or ``nccl://`` without CUDA, is a ``ConfigError``.

Semantics match the storage backend:

* **Sum-and-count**: the weight rides in the same reduction as the data (one extra
  element), so the divisor always matches what was summed. Half types are reduced in
  float32. NCCL and gloo hand every rank the same reduced bytes, and the division is
  the same local operation, so results are bit-identical on every rank.
* **Buckets**: tensors are flattened into dtype-homogeneous buckets of
  ``bucket_bytes`` (default 25 MiB): a model with hundreds of parameters costs a few
  collectives.
* **Layout checks**: gloo answers a size mismatch with garbage or by aborting the
  process, so every collective starts with a fixed-size exchange of the call's layout
  digest; a mismatch raises ``LayoutMismatch`` on every rank, naming the first
  differing tensor, before any data moves.
* **wire_dtype** (bfloat16, float16, int8) keeps its storage-backend meaning: each rank
  encodes its contribution, the encoded payloads are all-gathered, and every rank
  decodes and sums them in rank order in float32. This costs ``W`` payloads received
  per rank (vs ~2 for a ring all-reduce) and is meant for small worlds on slow links.

Storage-only options (``reduce``, ``secret``, ``storage_options``, polling and
heartbeat settings) are accepted with one warning, so switching a script's URL from a
bucket to ``gloo://`` never breaks it.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import warnings
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from ..api import GradSync
from ..codecs import (
    ErrorFeedback,
    Int8Codec,
    accumulator_dtype,
    check_wire_dtype,
    codec_for,
)
from ..errors import ConfigError, LayoutMismatch, PeerFailed, SyncTimeout
from ..storage import Counters
from .files import OPTIONS as STORAGE_OPTIONS
from .files import describe_mismatch

OPTIONS = {
    "bucket_bytes": (25 << 20, "flatten tensors into buckets of at most this many bytes"),
    "wire_dtype": (None, "None (native), float32, bfloat16, float16 or int8"),
    "error_feedback": (True, "carry int8 quantisation error to the next call"),
}
_STORAGE_ONLY = sorted(set(STORAGE_OPTIONS) - set(OPTIONS))
_ENV_VARS = ("MASTER_ADDR", "MASTER_PORT")


class TorchDistSync(GradSync):
    """GradSync over torch.distributed (NCCL for CUDA tensors, gloo for CPU tensors)."""

    default_bucket_bytes = 25 << 20

    @classmethod
    def check_options(cls, options: dict) -> dict:
        unknown = sorted(set(options) - set(OPTIONS) - set(_STORAGE_ONLY))
        if unknown:
            raise ConfigError(
                f"unknown option(s) {unknown} for a torch.distributed URL",
                hint="valid options: " + ", ".join(sorted(set(OPTIONS) | set(_STORAGE_ONLY))),
            )
        ignored = sorted(set(options) & set(_STORAGE_ONLY))
        if ignored:
            warnings.warn(
                f"ferrosync: options {ignored} only apply to storage URLs; the torch "
                "backend ignores them", stacklevel=3)
        out = {name: options.get(name, default) for name, (default, _) in OPTIONS.items()}
        bucket = out["bucket_bytes"]
        if bucket is not None and (isinstance(bucket, bool) or not isinstance(bucket, int)
                                   or bucket <= 0):
            raise ConfigError(f"bucket_bytes must be a positive int, got {bucket!r}")
        out["wire_dtype"] = check_wire_dtype(out["wire_dtype"])
        if not isinstance(out["error_feedback"], bool):
            raise ConfigError("error_feedback must be True or False")
        return out

    def __init__(self, url: str, identity, timeout: float, options: dict) -> None:
        # bytes this rank contributed / received; requests = collective calls
        self._counters = Counters()
        super().__init__(url, identity, timeout, self._counters, options["bucket_bytes"])
        self._opts = options
        self._ef = ErrorFeedback()
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
        self._has_gloo = "gloo" in backend
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
            self._stats.add_time("wait_s", time.perf_counter() - t0)
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
        if self._opts["wire_dtype"] is not None and flat.dtype.is_floating_point:
            codec = codec_for(flat.dtype, self._opts["wire_dtype"])
            if not codec.raw:
                # codec state belongs to what the data is (see api._stream), not its shape
                return self._average_encoded(flat, weight, codec,
                                             (layout.get("stream"), digest), group)
        n = flat.numel()
        acc_dtype = accumulator_dtype(flat.dtype)
        with self._stats.phase("reduce_s"):
            buf = self._pool.get("allreduce", n + 1, acc_dtype, flat.device)
            if weight > 0:
                buf[:n].copy_(flat)  # widen first, then scale in the accumulator dtype
                if weight != 1.0:
                    buf[:n].mul_(weight)
            else:
                buf[:n].zero_()  # adds nothing, even where this rank's tensors hold inf/NaN
            buf[n] = weight
        nbytes = buf.numel() * buf.element_size()
        self._call("average_", dist.all_reduce, buf, group=group)
        self._counters.add(written=nbytes, read=nbytes)
        total = float(buf[n].item())
        if total > 0:
            with self._stats.phase("read_s"):
                torch.div(buf[:n], total, out=flat)  # one pass: divide and narrow to dtype
        return total

    def _average_encoded(self, flat, weight, codec, ef_key, group):
        """wire_dtype path: all-gather encoded payloads, sum them in rank order locally."""
        n = flat.numel()
        nbytes = codec.nbytes(n)
        with self._stats.phase("reduce_s"):
            # [float64 weight | payload], padded to 8 bytes so every frame is aligned
            frame = self._pool.get("frame", 8 + -(-nbytes // 8) * 8, torch.uint8, flat.device)
            frame[:8].copy_(torch.tensor([weight], dtype=torch.float64).view(torch.uint8))
            if weight > 0:
                x = flat.to(torch.float32)
                if isinstance(codec, Int8Codec) and self._opts["error_feedback"]:
                    sent = self._ef.compensate(ef_key, x)
                    codec.encode(sent, frame[8 : 8 + nbytes])
                    self._ef.remember(ef_key, sent, codec.decode(frame[8 : 8 + nbytes], n))
                else:
                    codec.encode(x, frame[8 : 8 + nbytes])
            else:
                frame[8:].zero_()
            gathered = self._pool.get("gathered", self.world_size * frame.numel(), torch.uint8,
                                      flat.device)
        self._call("average_", dist.all_gather_into_tensor, gathered, frame, group=group)
        self._counters.add(written=frame.numel(), read=gathered.numel())
        with self._stats.phase("reduce_s"):
            frames = gathered.view(self.world_size, frame.numel())
            weights = [float(f[:8].cpu().clone().view(torch.float64).item()) for f in frames]
            total = 0.0
            for w in weights:
                total += w
            if total == 0:
                return 0.0
            acc = self._pool.get("acc", n, accumulator_dtype(flat.dtype), flat.device)
            first = True
            for w, f in zip(weights, frames):
                if w == 0:
                    continue
                values = codec.decode(f[8 : 8 + nbytes], n)
                if first:
                    acc.copy_(values)
                    if w != 1.0:
                        acc.mul_(w)
                    first = False
                else:
                    acc.add_(values, alpha=w)
            acc.div_(total)
            # like the storage backend, the result travels (here: is rounded) in the wire
            # encoding, so every rank holds exactly what the others hold
            result = self._pool.get("result", nbytes, torch.uint8, flat.device)
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

    def _shutdown(self, failure):
        self._ef.clear()
        if self._owns_group and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # never raise from close()
                pass


def check_layouts(gather, world_size: int, rank: int, digest: bytes, layout: dict, *,
                  collective: int, url: str, global_rank=lambda k: k) -> None:
    """Raise ``LayoutMismatch`` on every rank unless all ranks passed ``digest``.

    ``gather(out_list, tensor)`` all-gathers one tensor per rank (any group). Every
    rank exchanges the same fixed-size int64 first, so a mismatch can never turn into
    a size mismatch inside the transport (gloo aborts the process on one); only then
    are the JSON layout records exchanged, to name the first differing tensor.
    """
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
    digests = [torch.empty_like(mine) for _ in range(world_size)]
    gather(digests, mine)
    values = [int(t.item()) for t in digests]
    if len(set(values)) == 1:
        return
    other = next(k for k, v in enumerate(values) if v != values[rank])
    data = torch.frombuffer(bytearray(json.dumps(layout).encode()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.empty_like(size) for _ in range(world_size)]
    gather(sizes, size)
    padded = torch.zeros(max(int(s.item()) for s in sizes), dtype=torch.uint8)
    padded[: data.numel()] = data
    records = [torch.empty_like(padded) for _ in range(world_size)]
    gather(records, padded)
    try:
        theirs = json.loads(bytes(records[other][: int(sizes[other].item())].tolist()).decode())
    except ValueError:
        theirs = None
    raise LayoutMismatch(
        describe_mismatch(layout, theirs, global_rank(rank), global_rank(other)),
        rank=global_rank(rank), collective=collective, path=url,
        hint="every rank must pass the same tensors (count, dtype, shape) to the same "
        "collective, in the same order",
    )


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if not parts.hostname or parts.port is None:
        raise ConfigError(
            f"{url!r} needs a host and a port", path=url,
            hint="write it as gloo://HOST:PORT (rank 0 listens on HOST:PORT)",
        )
    return parts.hostname, parts.port


def _translate(exc: BaseException, rank: int, collective: int, url: str, what: str):
    """Turn a torch.distributed failure into the ferrosync error it really is."""
    text = str(exc)
    low = text.lower()
    if "timed out" in low or "timeout" in low:
        return SyncTimeout(
            f"{what} timed out ({text.splitlines()[0][:300]})", rank=rank,
            collective=collective, path=url,
            hint="are all ranks running with the same URL and calling the same collectives?",
        )
    if "address already in use" in low:
        return ConfigError(f"{what}: the port is taken ({text.splitlines()[0][:200]})",
                           rank=rank, path=url, hint="pick a free port for rank 0")
    return PeerFailed(
        f"{what} failed: {text.splitlines()[0][:300] if text else type(exc).__name__}",
        rank=rank, collective=collective, path=url,
        hint="another rank probably crashed or exited early: check its log",
    )
