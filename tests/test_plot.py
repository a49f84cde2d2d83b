"""``python -m ferrosync.train.plot``: the plotting ships in the package (an installed
ferrosync plots a ``--metrics`` file without a clone), as a process, as users run it:
a PNG from the metrics file a real run wrote (and then lost its last line's tail, as a
killed run leaves it); a file that is not a metrics file, a missing one, or an output
that cannot be written is one line and exit 2, with nothing written."""

from __future__ import annotations

import sys

from train_cli import cli_env, run_cli, run_forked


def _plot(*args, cwd):
    return run_forked([sys.executable, "-m", "ferrosync.train.plot", *map(str, args)],
                      cwd=cwd, env=cli_env(MPLBACKEND="Agg"), capture_output=True,
                      text=True, timeout=240)


def test_the_package_plots_a_metrics_file_and_refuses_what_is_not_one(tmp_path):
    metrics = tmp_path / "m.jsonl"
    run = run_cli("--nproc", "2", "--steps", "8", "--no-progress", "--metrics", metrics,
                  cwd=tmp_path, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(metrics, "a") as f:
        f.write('{"step": 9, "ep')  # a torn last line, as a killed run leaves
    result = _plot(metrics, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wrote {tmp_path / 'm.png'} (8 steps)"
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    other = tmp_path / "other.jsonl"
    other.write_text('{"a": 1}\n{"a": 2}\n')
    nowhere = tmp_path / "no-such-dir" / "x.png"
    for bad, out, says in ((other, tmp_path / "x.png", "line 1 is not a metrics line"),
                           (tmp_path / "missing.jsonl", tmp_path / "x.png", "does not exist"),
                           (tmp_path, tmp_path / "x.png", "is not a file"),
                           (metrics, nowhere, f"cannot write {nowhere}")):
        result = _plot(bad, "-o", out, cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert says in result.stderr and result.stderr.strip().count("\n") == 0, result.stderr
    assert not (tmp_path / "x.png").exists() and not nowhere.parent.exists()
