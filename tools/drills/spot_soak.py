"""A spot soak: an elastic trainer job on SeaweedFS behind a lossy network, for N
minutes of seeded random joins, SIGTERMs, SIGKILLs and total losses; every round checked.

    python tools/drills/spot_soak.py --minutes 15 --seed 1
    python tools/drills/spot_soak.py --minutes 1 --loss-every 20 --publish-every-seconds 4
    python tools/drills/spot_soak.py --endpoint http://127.0.0.1:8333 --bucket b   # a running S3

A SeaweedFS server starts on loopback (or ``--endpoint`` names one) with the fault
proxy (``ferrosync/testing/fault_proxy.py``) in front of it: ``--lose-reply`` of
PUT/POST replies lost after the server acted, ``--cut-body`` of GET bodies cut,
``--reset`` of requests reset before they are forwarded, ``--slowdown`` answered 503
SlowDown, every request held ``--delay-ms`` (rolls seeded). Members are real
processes, ``python -m ferrosync.train --elastic --metrics-digest`` (the demo,
``--strategy``, ``--min-ranks 1``, a short ``--publish-every-seconds``), started and
signalled by a schedule drawn from ``--seed`` before anything runs (the same seed,
the same schedule: printed first): joins, single SIGTERMs and SIGKILLs, and every
``--loss-every`` seconds a total loss, SIGTERM and SIGKILL in turn (every member
gone; once they have all exited, the newest published state is read and new members
are started). The soak ends with a SIGTERM of every member, checked as a loss.

What is checked, from the members' metrics files (``--metrics-digest``: each line of
a step that synced carries ``param_digest``, SHA-256 of the model after it; a
member's first line after joining carries ``resumed_digest``, the model it started
from) and from the published states:

* **rounds**: members that finished the same round (the same global step between two
  total losses) hold bit-identical models and agree on the member count; a round
  is *checked* when at least two members reported it. A member's steps run on one
  by one from where it joined.
* **resumes**: a newcomer starts from the model the round it joined after ended with
  (the others' digest there); founders after a total loss from the published state
  read once every member had gone; founders of the first roster from one model.
* **published states**: the state read after a total loss is the model the members
  reported at its step (state published = state trained).
* **work lost per total loss**: steps between the furthest step reached and the
  published state (where the founders must resume): at most one round after a
  total SIGTERM; after a total SIGKILL, the seconds those steps took on rank 0's
  timeline (its metrics lines: its clock decides when it publishes, and its steps
  leave out its own publishing) at most ``--publish-every-seconds`` plus one round.
* **members**: a SIGTERMed member exits 143 (it left), a SIGKILLed one -9; any other
  end, or a member that ends without a signal, is a failure, listed by cause (its
  exit code and error line).

Printed: the schedule, each event as it happens, then rounds checked, wrong rounds,
resumes and published states checked, failed members by cause, work lost per total
loss, faults injected and requests per member per round. Exit status 1 if anything
was wrong, a bound failed or the job stalled; 2 on bad usage. The suite runs a short
version (tests/test_spot_soak.py); docs/elastic.md#spot-soak shows a long one.
"""

from __future__ import annotations

import sys

from ferrosync.testing.spot_soak import main

if __name__ == "__main__":
    sys.exit(main())
