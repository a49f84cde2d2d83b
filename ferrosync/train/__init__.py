"""``python -m ferrosync.train``: launcher, built-in trainer, checkpoints and metrics.

Modules: ``cli`` (flags), ``launcher`` (``--nproc``: local ranks, output, failures),
``runner`` (one rank: the trainer or a user SCRIPT), ``trainer`` (``Trainer``: the one
training loop), ``elastic`` (``ElasticTrainer``: that loop's hooks for a member of an
elastic job), ``run_log`` (what the loop reports as it goes), ``summary`` (the
``FINAL`` fields), ``checkpoint``, ``metrics``, ``demo`` (the built-in synthetic task).
See docs/train.md.
"""

from __future__ import annotations

from ferrosync.train.trainer import Trainer

__all__ = ["Trainer"]
