"""The end of a run: evaluate, gather every rank's numbers in one collective, and build
the summary (the ``FINAL`` line's fields, docs/train.md#metrics-and-plots).

``summarise`` is the one place the summary is built, for the fixed-size trainer and
for an elastic member alike (which adds the job's fields afterwards, ``ElasticTrainer``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from ferrosync.core.stats import PHASES
from ferrosync.storage.costs import hourly, is_billed, parse_prices, request_noun
from ferrosync.storage.engines import REQUEST_KINDS
from ferrosync.train.metrics import param_digest

__all__ = ["RankReport", "summarise", "job_rates"]

#: the storage counters the summary reports (all requests, then each billed kind)
REQUEST_KEYS = ("requests", *REQUEST_KINDS)


def summarise(trainer, sync, log) -> dict:
    """Collective (one ``all_gather``): evaluate, then gather every rank's digest,
    counters and loss into the summary. ``log``: the run's ``RunLog`` (its totals,
    losses, samples, start and wall time)."""
    counters = sync.counters.snapshot()
    requests = [counters.get(k, 0) - log.counters_begin.get(k, 0) for k in REQUEST_KEYS]
    evaluation = {}
    if trainer.eval_fn is not None:
        trainer.model.eval()
        with torch.no_grad():
            evaluation = dict(trainer.eval_fn(trainer.model) or {})
    stats = sync.stats["total"]
    losses = log.losses
    mine = RankReport(
        digest=param_digest(trainer.model),
        bytes_written=stats["bytes_written"], bytes_read=stats["bytes_read"],
        loss=sum(losses) / len(losses) if losses else math.nan,
        steps=trainer.step, samples=log.samples, storage_requests=tuple(requests))
    per_rank = [RankReport.unpack(g) for g in sync.all_gather(mine.pack())]
    digests = [r.digest.hex() for r in per_rank]
    rank_losses = [r.loss for r in per_rank if math.isfinite(r.loss)]
    storage_requests = {k: int(sum(r.storage_requests[i] for r in per_rank))
                        for i, k in enumerate(REQUEST_KEYS)}
    samples = int(sum(r.samples for r in per_rank))
    return {
        "steps": trainer.step,
        "epochs": trainer.step / trainer.steps_per_epoch,
        "world_size": sync.world_size,
        "strategy": trainer.strategy.name,
        "loss": sum(rank_losses) / len(rank_losses) if rank_losses else None,
        "eval_loss": float_or_none(evaluation.get("loss")),
        "accuracy": float_or_none(evaluation.get("accuracy")),
        "param_digest": digests[sync.rank],
        "rank_digests": digests,
        "ranks_agree": len(set(digests)) == 1,
        "bytes_written": int(sum(r.bytes_written for r in per_rank)),
        "bytes_read": int(sum(r.bytes_read for r in per_rank)),
        # one count of requests: the run's, every request (heartbeats included), the
        # same number as storage_requests["requests"] (not sync.stats', which counts
        # only inside collectives and from connect on)
        "requests": storage_requests["requests"],
        "rank_steps": [int(r.steps) for r in per_rank],
        "samples": samples,
        "wall_s": log.wall,
        "compute_s": log.totals["compute_s"],
        "sync_s": log.totals["sync_s"],
        **{p: stats[p] - log.stats_begin[p] for p in PHASES},
        "storage_requests": storage_requests,
        **job_rates(storage_requests, samples, log.wall, trainer.storage_prices_given,
                    sync.url),
        "checkpoint_s": log.totals["checkpoint_s"],
        "checkpoints": log.totals["checkpoints"],
        "steps_this_run": trainer.step - log.start_step,
        "resumed_from": trainer.resumed_from,
        **trainer.strategy.summary(),
    }


def job_rates(storage_requests: dict, samples: int, wall: float, prices, url: str) -> dict:
    """``samples_per_s``, ``requests_per_hour`` and ``request_cost_per_hour`` over
    ``wall`` seconds, at ``prices`` (``--storage-prices``, else ``url``'s store's), and
    what a request is at ``url`` (``requests_are``: ``costs.request_noun``)."""
    return {"samples_per_s": samples / wall if wall > 0 else 0.0,
            **hourly(storage_requests, wall, parse_prices(prices, url),
                     billed=is_billed(url)),
            "requests_are": request_noun(url)}


def float_or_none(value) -> float | None:
    """A reported number (an optimizer's lr, ``eval_fn``'s results) for the summary:
    not a check (``validate.number`` would refuse a tensor or NumPy scalar, which
    ``float`` takes), and a non-finite one is reported as null, not refused."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


@dataclasses.dataclass(frozen=True)
class RankReport:
    """What each rank contributes to the summary, gathered in one ``all_gather``:
    the parameter digest (32 bytes) then the numbers as float64, in field order."""

    digest: bytes
    bytes_written: float
    bytes_read: float
    loss: float  # NaN: this rank trained no batch
    steps: float
    samples: float
    storage_requests: tuple  # one per REQUEST_KEYS

    DIGEST_BYTES: ClassVar[int] = 32
    NUMBERS: ClassVar[tuple[str, ...]] = ("bytes_written", "bytes_read", "loss", "steps",
                                          "samples")

    def pack(self) -> torch.Tensor:
        numbers = torch.tensor([*(getattr(self, n) for n in self.NUMBERS),
                                *self.storage_requests], dtype=torch.float64)
        return torch.cat([torch.frombuffer(bytearray(self.digest), dtype=torch.uint8),
                          numbers.view(torch.uint8)])

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> RankReport:
        digest = bytes(packed[:cls.DIGEST_BYTES].tolist())
        values = packed[cls.DIGEST_BYTES:].clone().view(torch.float64).tolist()
        fixed = len(cls.NUMBERS)
        return cls(digest=digest, **dict(zip(cls.NUMBERS, values[:fixed])),
                   storage_requests=tuple(values[fixed:]))
