"""The spot soak (tools/drills/spot_soak.py, docs/elastic.md#spot-soak), short: an elastic
trainer job on the suite's SeaweedFS behind the fault proxy, with joins, a SIGTERM, a
SIGKILL, a total loss of each kind and new members after each; and the soak's checks
on reports that must fail them.
"""

from __future__ import annotations

import subprocess
import types

import pytest
from train_cli import ForkedCli

from conftest import BUCKET
from ferrosync.testing import spot_soak

#: the short version: 48 s of churn from 3 members, seed 3's schedule (below)
SHORT = ["--minutes", "0.8", "--seed", "3", "--first-members", "3", "--max-members", "3",
         "--gap", "5", "10", "--loss-every", "16", "--publish-every-seconds", "4",
         "--heartbeat-interval", "0.5", "--heartbeat-timeout", "5",
         "--lose-reply", "0.03", "--cut-body", "0.03", "--reset", "0.01",
         "--slowdown", "0.01", "--stall-timeout", "60"]


def test_a_short_spot_soak_keeps_every_round_and_every_bound(seaweed_endpoint, tmp_path,
                                                              capsys, monkeypatch):
    # the members are `python -m ferrosync.train` processes forked from the suite's
    # forkserver (torch already imported: about 3 CPU-seconds saved per member)
    monkeypatch.setattr(spot_soak, "subprocess",
                        types.SimpleNamespace(**{**vars(subprocess), "Popen": ForkedCli}))
    args = spot_soak.parse_args([*SHORT, "--endpoint", seaweed_endpoint, "--bucket", BUCKET,
                                 "--workdir", str(tmp_path)])
    planned = [e.action for e in spot_soak.make_schedule(
        3, 48, first=3, max_members=3, gap=(5, 10), loss_every=16)]
    assert {"join", "term", "kill", "lose_term", "lose_kill", "end"} <= set(planned)
    summary = spot_soak.soak(args)
    out = capsys.readouterr().out
    assert summary.ok, out
    assert summary.rounds["checked"] >= 5 and not summary.rounds["wrong"], out
    assert [loss["kind"] for loss in summary.losses] == ["kill", "term", "end"], out
    # the founders after each total loss resumed exactly where the state was published
    for loss in summary.losses[:2]:
        assert min(loss["resumed"]) == loss["published"] and loss["state_ok"], out
    assert summary.resumes["checked"] >= 3, out
    assert all(summary.faults[kind] > 0 for kind in ("lose_reply", "cut_body", "reset")), out


@pytest.mark.unit
def test_the_soak_schedule_is_the_seeds_and_its_checks_can_fail():
    """The same seed draws the same schedule; a member whose model differs in a round,
    a resume from another model and work lost past a bound are each reported."""
    schedule = spot_soak.make_schedule(5, 300, loss_every=60)
    assert schedule == spot_soak.make_schedule(5, 300, loss_every=60)
    assert schedule != spot_soak.make_schedule(6, 300, loss_every=60)

    def line(step, digest, members=2, **extra):
        return {"step": step, "members": members, "param_digest": digest, "requests": 5,
                "compute_s": 0.5, "sync_s": 0.5, **extra}

    a = spot_soak.Record("a", 0, True, [line(1, "x1", resumed_digest="x0"), line(2, "x2"),
                                        line(3, "x3")], 143, "term")
    b = spot_soak.Record("b", 0, True, [line(1, "x1", resumed_digest="x0"), line(2, "BAD"),
                                        line(3, "x3")], -9, "kill")
    c = spot_soak.Record("c", 1, True, [line(2, "y", 1, resumed_digest="other")], 1, "term",
                         stderr="ferrosync.train: error: ShardCorrupt: ...\n")
    rounds = spot_soak.check_rounds([a, b, c])
    assert rounds["checked"] == 3 and len(rounds["wrong"]) == 1 and "step 2" in rounds["wrong"][0]
    losses = [spot_soak.Loss("kill", 0, 10.0, (1, "x1"))]
    resumes = spot_soak.check_resumes([a, b, c], losses, rounds["groups"])
    assert resumes["checked"] == 2 and len(resumes["wrong"]) == 1, resumes
    (kill,) = spot_soak.check_losses([a, b, c], losses, round_steps=1, publish_s=0.5)
    assert (kill["reached"], kill["lost_steps"], kill["lost_s"]) == (3, 2, 2.0)
    assert not kill["ok"] and kill["state_ok"] and kill["resumed"] == [1]
    failed = spot_soak.failures([a, b, c])
    assert list(failed.values()) == [["c"]] and "ShardCorrupt" in next(iter(failed))
