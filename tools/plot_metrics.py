"""Plot a ``--metrics`` file: what ``python -m ferrosync.train.plot`` does (the plotting
is part of the package, ``ferrosync/train/plot.py``; this script is kept for old
commands).

    python tools/plot_metrics.py metrics.jsonl     # = python -m ferrosync.train.plot ...
"""

from __future__ import annotations

import sys

from ferrosync.train.plot import main, moving_average, read_metrics

__all__ = ["main", "moving_average", "read_metrics"]

if __name__ == "__main__":
    sys.exit(main())
