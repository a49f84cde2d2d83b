"""``python -m ferrosync.train.plot``: the plotting ships in the package (an installed
ferrosync plots a ``--metrics`` file without a clone), as a process, as users run it:
a PNG from a real file (idle syncs and a torn last line included); a file that is not
a metrics file, or a missing one, is one line and exit 2, with nothing written."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _plot(*args, cwd):
    env = {**os.environ, "MPLBACKEND": "Agg",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "ferrosync.train.plot", *map(str, args)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


def test_the_package_plots_a_metrics_file_and_refuses_what_is_not_one(tmp_path):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(
        f'{{"step": {i}, "epoch": 0, "loss": {1 / i}, "lr": 0.1, "compute_s": 0.001, '
        f'"sync_s": 0.002, "bytes": 100, "requests": 4}}\n' for i in range(1, 31))
        # an idle sync (time-based strategy: rank 0 had nothing to train) has no loss
        + '{"step": 30, "epoch": 0, "loss": null, "lr": 0.1, "compute_s": 0.0, '
        '"sync_s": 0.002, "bytes": 100, "requests": 4}\n'
        + '{"step": 31, "ep')  # a torn last line, as a killed run leaves
    result = _plot(metrics, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wrote {tmp_path / 'm.png'} (31 steps)"
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    other = tmp_path / "other.jsonl"
    other.write_text('{"a": 1}\n{"a": 2}\n')
    for bad, says in ((other, "line 1 is not a metrics line"),
                      (tmp_path / "missing.jsonl", "does not exist")):
        result = _plot(bad, "-o", tmp_path / "x.png", cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert says in result.stderr and result.stderr.strip().count("\n") <= 1, result.stderr
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "x.png").exists()
