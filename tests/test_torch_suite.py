"""A subset of PyTorch's own ``distributed_test.py`` on backend "ferrosync" (2 ranks).

``tools/drills/torch_dist_suite.py`` runs torch's suite on ferrosync beside gloo, with the
suite's backend-name gates lifted for ferrosync (its docstring says how); the whole
selection runs from one command and its table is in docs/ddp.md. Here one test of each
family that gloo passes on CPU runs on ferrosync through the same runner, ranks
forked (upstream spawns them: the same tests, slower to start). Needs ``expecttest``
(torch's test utilities import it; in the ``test`` extra).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: gloo passes every one of these on CPU over 2 ranks (docs/ddp.md's table)
SUBSET = [
    "test_all_reduce_sum", "test_all_reduce_coalesced_sum", "test_broadcast",
    "test_all_gather_coalesced_simple", "test_all_gather_object_subgroup",
    "test_barrier_timeout_full_group",
    "test_send_recv_any_source", "test_batch_isend_irecv_gloo_tags",
    "test_sparse_all_reduce_sum", "test_DistributedDataParallelCPU",
]


def test_torchs_own_tests_pass_on_ferrosync(tmp_path):
    pytest.importorskip("expecttest", reason="torch's test utilities need expecttest")
    out = tmp_path / "results.json"
    env = {k: v for k, v in os.environ.items() if k != "FERROSYNC_JOB"}  # no job id
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "drills", "torch_dist_suite.py"), "--backends",
         "ferrosync", "--start-method", "fork", "--json", str(out), "--tests", *SUBSET],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    records = json.loads(out.read_text())["ferrosync"]
    assert set(SUBSET) <= set(records)
    failed = {name: r["detail"][-1500:] for name, r in records.items()
              if name in SUBSET and r["outcome"] != "pass"}
    assert not failed, failed
