"""The scripts of ``tools/`` (benchmarks, document generators, drills, the simulator's
command line) and ``examples/``, run as a user runs them from a clone (``python
tools/KIND/SCRIPT``): each starts and explains itself; bench_strategies' ``--tiny``
and ``--dry-run``; regen_figures' refusals. The tests import none of them: each runs
as a process (forked from the suite's forkserver, tests/train_cli.py)."""

from __future__ import annotations

import glob
import json
import os
import sys

import pytest
from train_cli import run_forked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(os.path.relpath(path, ROOT) for pattern in ("tools/*.py", "tools/*/*.py",
                                                             "examples/*.py")
                 for path in glob.glob(os.path.join(ROOT, pattern)))


def run(*args: str):
    return run_forked([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                      timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))


def test_the_tools_are_sorted_by_kind():
    """Benchmarks, document generators and drills in a folder each; at the top only the
    simulator's pinned command lines; no package (tests import nothing from tools/)."""
    top = sorted(os.path.basename(s) for s in SCRIPTS if s.count(os.sep) == 1
                 and s.startswith("tools"))
    assert top == ["elastic_sim.py", "elastic_sim_sweep.py"]
    assert {s.split(os.sep)[1] for s in SCRIPTS if s.count(os.sep) == 2
            and s.startswith("tools")} == {"bench", "docs", "drills"}
    assert not glob.glob(os.path.join(ROOT, "tools", "**", "__init__.py"), recursive=True)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_explains_itself(script):
    done = run(script, "--help")
    assert done.returncode == 0, done.stderr
    assert "usage: " + os.path.basename(script) in done.stdout, done.stdout


def test_tiny_strategies_commands_keep_the_first_value_of_each_list():
    """bench_strategies --tiny, which regen_figures --tiny adds to every command."""
    done = run("tools/bench/bench_strategies.py", "--ranks", "3", "--sync-every", "30", "50",
               "--seeds", "0", "1", "2", "--tiny", "--dry-run")
    assert done.returncode == 0, done.stderr
    args = json.loads(done.stdout)["settings"]
    assert (args["ranks"], args["sync_every"], args["seeds"], args["overlap_steps"]) == (
        [3], [30], [0], [1])
    assert args["train_arg"] == ["--steps=60"]
    done = run("tools/bench/bench_strategies.py", "--tiny", "--dry-run")
    args = json.loads(done.stdout)["settings"]
    assert (args["ranks"], args["sync_every"]) == ([2], [20])  # bench_strategies' defaults, cut
    commands = json.loads(done.stdout)["commands"]
    assert all(c[:4] == ["-m", "ferrosync.train", "--nproc", "2"] and "--steps=60" in c
               for c in commands)


def test_the_command_line_refuses_unknown_sections_and_a_tiny_run_into_the_repository():
    done = run("tools/docs/regen_figures.py", "--only", "bench,elastic")
    assert done.returncode != 0 and "no section elastic" in done.stderr
    done = run("tools/docs/regen_figures.py", "--tiny")
    assert done.returncode != 0 and "give --out-dir" in done.stderr


def test_run_final_reads_the_last_line_and_names_a_failed_command():
    """The benchmarks' one reader of a training run's FINAL record."""
    from ferrosync.testing.measure import run_final

    final = run_final([sys.executable, "-c", "print('FINAL {\"steps\": 3}')"],
                      env=dict(os.environ), timeout=60)
    assert final["steps"] == 3 and final["command_s"] > 0
    with pytest.raises(RuntimeError, match=r"-c 'import sys.*exited 3:\nbroken"):
        run_final([sys.executable, "-c", "import sys; sys.stderr.write('broken'); sys.exit(3)"],
                  env=dict(os.environ), timeout=60)
    with pytest.raises(RuntimeError, match="exited 0"):  # no FINAL line last
        run_final([sys.executable, "-c", "print('FINAL {}'); print('more')"],
                  env=dict(os.environ), timeout=60)
