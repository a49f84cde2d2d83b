"""Local SGD (model averaging): ranks step on their own, parameters are averaged now and then.

Every rank runs its own optimizer on its own batches; at each sync (every H steps
or S seconds, see ``PeriodicStrategy``) the parameters and floating-point buffers
become the work-weighted average over ranks. With ``sync_every=1`` and plain SGD
this is exactly per-step gradient averaging: ``mean(p - lr*g_r) = p - lr*mean(g_r)``.
"""

from __future__ import annotations

import torch

from ferrosync.errors import ConfigError
from ferrosync.strategies.base import norm
from ferrosync.strategies.periodic import PeriodicStrategy

__all__ = ["LocalSGD"]


class LocalSGD(PeriodicStrategy):
    """Average parameters every ``sync_every`` steps (or ``sync_every_seconds``).

    Each rank keeps its own optimizer state (momentum is not averaged). Memory: one
    staging copy of the parameters and floating-point buffers, used at syncs so the
    telemetry can compare before and after. Arguments as ``PeriodicStrategy``.
    """

    name = "local-sgd"
    #: plain averaging drifts more than DiLoCo's outer step corrects: merge more often
    default_sync_every = 20

    def attach(self, model, optimizer, sync) -> None:
        if getattr(sync, "wire_dtype", None) == "topk":
            # before any collective: every rank refuses alike
            raise ConfigError(
                "local-sgd cannot use wire_dtype='topk': it averages the parameters "
                "themselves, and topk sends only each chunk's largest values",
                rank=sync.rank, path=sync.url,
                hint="use --strategy diloco --outer-lr 1 --outer-momentum 0 (local SGD "
                "on pseudo-gradients, which topk sends), or wire_dtype='int8'")
        super().attach(model, optimizer, sync)
        self._stage = [t.detach().clone() for t in (*model.parameters(), *self.buffers)]

    def _merge(self, params, weight):
        local = [*params, *self.buffers]
        with torch.no_grad():
            for s, t in zip(self._stage, local):
                s.copy_(t)
            self.sync.average_([*self._stage, *self.riding(self._stage)], weight=weight)
            merged = self._stage[: len(params)]
            distance = norm(p - m for p, m in zip(params, merged))
            post_norm = norm(merged)
            for s, t in zip(self._stage, local):
                t.copy_(s)
        return distance, post_norm
