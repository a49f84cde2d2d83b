"""What a run reports: per-step JSON lines, the parameter digest, the summary table and
the ``FINAL {json}`` line.

The metrics file's fields (``--metrics PATH``, rank 0, one line per optimizer step,
with ``ferrosync.strategies.TELEMETRY_KEYS``): docs/design.md#metrics-lines and
docs/train.md#metrics-and-plots; ``FINAL``: docs/design.md#final-line.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import warnings
import weakref

import torch

from ferrosync.core.private import host_dir, host_path
from ferrosync.errors import ConfigError
from ferrosync.storage import names

#: keys the FINAL line always carries (docs/design.md#final-line)
FINAL_KEYS = ("steps", "loss", "accuracy", "param_digest", "ranks_agree", "bytes_written",
              "bytes_read", "requests")


class PathClaim:
    """This process is the one writer of a local output file on this host.

    Two trainers started by hand in one directory with the same ``--metrics PATH``
    (two elastic members, two launches) would otherwise rewrite and interleave one
    file silently; the second is refused with a one-line ``ConfigError`` (exit 2)
    naming the process that writes it. The claim is an exclusive ``flock`` on a file
    named after the path's real location in this user's host-local directory
    (``/dev/shm/ferrosync-<uid>/claims``): the kernel drops it when its process dies,
    so a killed writer never blocks the next one. Claims of one path within one
    process nest (a notebook that builds a second trainer). Processes on other hosts
    writing one file on a shared file system are not seen.
    """

    _held: dict[str, list] = {}  # real path -> [fd, claims], this process's

    def __init__(self, path: str, flag: str = "--metrics") -> None:
        self.real = os.path.realpath(path)
        self._name = hashlib.sha256(self.real.encode()).hexdigest()[:32]
        #: the host-local file whose lock is the claim
        self.lock_file = os.path.join(host_path("claims"), self._name)
        held = self._held.get(self.real)
        if held is None:
            fd = self._lock(path, flag)
            held = self._held[self.real] = [fd, 0]  # fd None: no usable host directory
        held[1] += 1
        # released by release(), or when this object is collected
        self._finalizer = weakref.finalize(self, PathClaim._unclaim, self.real)

    def _lock(self, path: str, flag: str) -> int | None:
        """The locked claim file's descriptor; None (no claim, with a warning where the
        directory is someone else's) when there is no usable host directory."""
        try:
            with host_dir("claims") as directory:
                fd = directory.open_file(self._name, os.O_RDWR | os.O_CREAT)
        except ConfigError as exc:
            warnings.warn(f"{flag} {path} is not claimed against a second writer: {exc}",
                          RuntimeWarning, stacklevel=3)
            return None
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise ConfigError(
                f"{flag} {path}: another process on this host (pid {holder}) is writing "
                "this file; two writers would clobber each other",
                hint=f"give each process its own {flag} path (e.g. member-$$.jsonl)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def release(self) -> None:
        """Idempotent; the last claim of the path in this process unlocks it."""
        self._finalizer()

    @classmethod
    def _unclaim(cls, real: str) -> None:
        held = cls._held[real]
        held[1] -= 1
        if held[1] == 0:
            del cls._held[real]
            if held[0] is not None:
                os.close(held[0])


def probe_output_file(path: str, flag: str = "--metrics") -> None:
    """``path`` (a local output file) can be written the way ``MetricsWriter`` writes it:
    a new file in its directory (or, where that does not exist yet, in the nearest
    directory above it, which ``MetricsWriter`` would create it under). A
    ``ConfigError`` (exit 2) naming the path otherwise, so the launcher finds a
    read-only or mistyped path before any rank starts. Leaves nothing behind."""
    target = os.path.abspath(path)
    if os.path.isdir(target):
        raise ConfigError(f"{flag} {path} is a directory", hint="name a file in it")
    directory = os.path.dirname(target)
    while not os.path.lexists(directory):
        directory = os.path.dirname(directory)
    probe = os.path.join(directory, names.temp(os.path.basename(target)))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        os.close(os.open(probe, flags, 0o600))
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot create a file in {directory} "
                          f"({exc.strerror or exc})", hint=f"give {flag} a path this user "
                          "can write (a writable directory, not a read-only mount)") from None
    os.unlink(probe)


class MetricsWriter:
    """Appends one JSON line per step to a local file (rank 0 only; with ``--elastic``
    every member its own).

    The path is claimed first (``PathClaim``: another live process writing it on this
    host is a ConfigError). On a resumed run, lines after the resumed step (written by
    the interrupted run after its last checkpoint) are dropped, so the file reads as
    one uninterrupted run.
    """

    def __init__(self, path: str, resume_step: int | None = None) -> None:
        self.path = os.path.abspath(path)
        self._claim = PathClaim(self.path)
        try:
            self._file = self._open(resume_step)
        except BaseException:
            self._claim.release()
            raise

    def _open(self, resume_step: int | None):
        directory = os.path.dirname(self.path)
        os.makedirs(directory, exist_ok=True)
        kept = []
        if resume_step is not None and os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as f:
                for line in f:
                    try:
                        if json.loads(line)["step"] <= resume_step:
                            kept.append(line if line.endswith("\n") else line + "\n")
                    except (ValueError, KeyError, TypeError):
                        continue  # a torn last line from a killed run
        # replace atomically, so a crash now leaves the old file or the new one; the
        # temp file is created here and now (O_EXCL|O_NOFOLLOW, an unguessable name),
        # so a link planted in a shared directory is never written through
        tmp = os.path.join(directory, names.temp(os.path.basename(self.path)))
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        with open(os.open(tmp, flags, 0o666), "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)
        return open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, separators=(", ", ": ")) + "\n")

    def close(self) -> None:
        self._file.close()
        self._claim.release()


def require_tensorboard():
    """``torch.utils.tensorboard.SummaryWriter``, or a ConfigError with the install
    command when the ``tensorboard`` package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch raises it when the tensorboard package is absent
        raise ConfigError("--tensorboard needs the tensorboard package, which is not "
                          "installed", hint="pip install 'ferrosync[tensorboard]'") from None
    return SummaryWriter


class TensorBoardWriter:
    """Writes a run's per-step numbers as TensorBoard scalars (``--tensorboard DIR``).

    Tags: ``train/loss``, ``train/accuracy`` (the batch's, for classification),
    ``train/lr``, ``time/compute_s``, ``time/sync_s``, ``sync/bytes``,
    ``sync/requests``, ``elastic/members`` (elastic jobs), and at the end
    ``eval/loss`` and ``eval/accuracy`` (with an eval set). The x axis is the
    optimizer step (the job's global step in an elastic job).
    """

    #: metrics-line key -> TensorBoard tag
    TAGS = {"loss": "train/loss", "accuracy": "train/accuracy", "lr": "train/lr",
            "compute_s": "time/compute_s", "sync_s": "time/sync_s", "bytes": "sync/bytes",
            "requests": "sync/requests", "members": "elastic/members"}

    def __init__(self, logdir: str) -> None:
        self._writer = require_tensorboard()(log_dir=logdir)

    def write(self, record: dict) -> None:
        for key, tag in self.TAGS.items():
            value = record.get(key)
            if value is not None:
                self._writer.add_scalar(tag, value, record["step"])

    def final(self, summary: dict) -> None:
        for key, tag in (("eval_loss", "eval/loss"), ("accuracy", "eval/accuracy")):
            if summary.get(key) is not None:
                self._writer.add_scalar(tag, summary[key], summary["steps"])

    def close(self) -> None:
        self._writer.close()


def param_digest(model: torch.nn.Module) -> bytes:
    """SHA-256 over every state-dict entry's name, dtype, shape and raw bytes.

    Equal digests mean bit-identical parameters and buffers.
    """
    return state_digest(model.state_dict())


def state_digest(state: dict) -> bytes:
    """``param_digest`` of a model's ``state_dict()`` given as such (a published
    elastic state's model part, rebuilt with ``state_tree.unflatten``)."""
    h = hashlib.sha256()
    for name, tensor in state.items():
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole > 0 else "-"


def format_summary(s: dict) -> str:
    """The human-readable table printed by rank 0 before the FINAL line."""
    wall = s["wall_s"]
    rows = [
        ("ranks", f"{s['world_size']} (strategy {s['strategy']})"),
        ("steps", f"{s['steps']} ({s['epochs']:.2f} epochs"
                  + (f", resumed at step {s['resumed_from']}" if s["resumed_from"] else "")
                  + ")"),
        ("samples/s", f"{s['samples_per_s']:,.0f} (all ranks)"),
        ("wall time", f"{wall:.2f} s"),
        ("compute", f"{s['compute_s']:.2f} s ({_pct(s['compute_s'], wall)})"),
        ("sync", f"{s['sync_s']:.2f} s ({_pct(s['sync_s'], wall)}): write {s['write_s']:.2f}, "
                 f"wait {s['wait_s']:.2f}, reduce {s['reduce_s']:.2f}, read {s['read_s']:.2f}"),
        ("syncs", _syncs(s)),
        ("checkpoints", f"{s['checkpoint_s']:.2f} s ({s['checkpoints']} written)"),
        ("bytes moved", f"written {_mb(s['bytes_written'])}, read {_mb(s['bytes_read'])} "
                        "(all ranks)"),
        (s.get("requests_are") or "storage requests", _request_rates(s)),
        ("final loss", _num(s["loss"])),
    ]
    if s.get("eval_loss") is not None:
        rows.append(("eval loss", _num(s["eval_loss"])))
    rows.append(("accuracy", "-" if s["accuracy"] is None else f"{100 * s['accuracy']:.2f}%"))
    agree = "yes" if s["ranks_agree"] else "NO: " + ", ".join(
        f"rank {r} {d[:12]}" for r, d in enumerate(s["rank_digests"]))
    rows.append(("ranks agree", f"{agree} (digest {s['param_digest'][:16]})"))
    width = max(len(k) for k, _ in rows)
    lines = ["ferrosync.train summary"] + [f"  {k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def _syncs(s: dict) -> str:
    """``128 (every 20 steps, 0 skipped), divergence last 0.0123 mean 0.0201, ...``."""
    if s.get("sync_every_seconds"):
        cadence = f"every {s['sync_every_seconds']:g} s"
    elif s.get("sync_every") in (None, 1):
        cadence = "every step"
    else:
        cadence = f"every {s['sync_every']} steps"
    text = f"{s.get('syncs', 0):,} ({cadence}, {s.get('skipped_syncs', 0)} skipped)"
    if s.get("divergence_mean") is not None:
        # a late member of a finished elastic job has a mean (from the state) but no last
        text += f", divergence last {_num(s.get('divergence'))} mean {s['divergence_mean']:.4f}"
    if s.get("masses") is not None:
        text += ", batches per rank " + "/".join(f"{m:,}" for m in s["masses"])
    return text


def _num(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def final_line(summary: dict) -> str:
    """``FINAL {json}`` on one line (non-finite numbers become null: strict JSON)."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
             for k, v in summary.items()}
    return "FINAL " + json.dumps(clean, separators=(",", ":"), sort_keys=True)


def _request_rates(s: dict) -> str:
    """All ranks' requests over the whole run (heartbeats included: the one count,
    FINAL's ``requests``), per hour, and what they cost per hour on an object store at
    the configured prices; a directory's are file operations, which nobody bills."""
    text = f"{s['requests']:,} (all ranks)"
    rate = s.get("requests_per_hour")
    if rate is not None:
        text += f", {rate:,.0f}/hour"
    cost = s.get("request_cost_per_hour")
    if cost is not None:
        text += f", ${cost:,.4f}/hour at list prices (--storage-prices)"
    elif s.get("requests_are") == "file operations":
        text += " (a directory: not billed)"
    return text
