"""A job killed mid-run restarts under the same sync URL, resumes from its checkpoint,
and ends exactly where an uninterrupted run ends: a new generation, nothing mixed."""

from __future__ import annotations

import json

from train_cli import final_of, run_cli

FLAGS = ("--nproc", 2, "--batch-size", 512, "--steps", 70, "--checkpoint-every", 25,
         "--no-progress", "--sync-option", "heartbeat_timeout=5")


def test_killed_job_resumes_in_the_same_url(tmp_path):
    reference = run_cli(*FLAGS, "--sync", tmp_path / "ref-sync", "--checkpoint-dir",
                        tmp_path / "ref-ck", cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr
    want = final_of(reference.stdout)

    sync, ck = tmp_path / "sync", tmp_path / "ck"
    # rank 1 is SIGKILLed inside a put, around step 40 (after the step-25 checkpoint)
    fault = [{"rank": 1, "collective": 45, "phase": "write", "action": "kill"}]
    killed = run_cli(*FLAGS, "--sync", sync, "--checkpoint-dir", ck, cwd=tmp_path,
                     FERROSYNC_FAULTS=json.dumps(fault))
    assert killed.returncode != 0
    assert "rank 1" in killed.stderr
    assert json.loads((ck / "latest.json").read_text())["step"] == 25

    resumed = run_cli(*FLAGS, "--sync", sync, "--checkpoint-dir", ck, "--resume",
                      cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    got = final_of(resumed.stdout)
    assert got["resumed_from"] == 25 and got["steps"] == 70 and got["ranks_agree"]
    assert got["param_digest"] == want["param_digest"]
    # the restart ran in a generation of its own, next to the killed one
    # each launch is its own job (the launcher names it), so each has a namespace of
    # its own and starts at generation 0
    generations = sorted(p.name.split(".")[0] for p in sync.iterdir() if p.name.startswith("g"))
    assert generations == ["g0", "g0"], generations
    namespaces = sorted(p.name for p in sync.iterdir() if p.name.startswith("rdzv"))
    assert len(namespaces) == 2 and all(n.startswith("rdzv.launch-") for n in namespaces)
