"""The elastic protocol in virtual time: N members of the production code on a
simulated object store, with churn, every round checked (docs/elastic.md#simulation).

    python tools/elastic_sim.py --members N --rounds R --seed S [--profile s3|s3express|gcs]
                                [--churn SPEC] [--payload BYTES] [--compute-s S]

``--churn``: comma-separated ``kind=rate`` pairs, events per virtual hour across the
job (``joins``, ``leaves``, ``kills``, ``pauses``, ``total_loss``, ``stragglers``), e.g.
``joins=600,leaves=300,kills=300,pauses=120``. The last line is ``SIM {json}``; the exit
status is 0 only when no invariant was broken (``violations`` empty, ``wrong_rounds``
0), else 1, printing the command that replays the run; 2 on bad usage. The same seed
gives the same ``trace_digest``.
"""

from __future__ import annotations

import gc
import os
import sys

# the pinned command runs from a clone without an install: the clone's ferrosync
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from ferrosync.testing.sim.cli import main  # noqa: E402

if __name__ == "__main__":
    # what the imports made (torch's hundreds of thousands of objects) lives as long as
    # this process: out of the collector's way, a full collection no longer walks it
    # again and again (a tenth of the CPU of a W = 200 run); the trace is unchanged
    gc.freeze()
    sys.exit(main())
