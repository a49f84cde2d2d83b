"""Plot a ``--metrics`` file: loss and sync time per optimizer step, as a PNG.

Run:
    python -m ferrosync.train --nproc 2 --metrics metrics.jsonl
    python -m ferrosync.train.plot metrics.jsonl                 # writes metrics.png
    python -m ferrosync.train.plot metrics.jsonl -o run1.png --smooth 50

Needs matplotlib, an optional extra: ``pip install 'ferrosync[plot]'`` (without it: one
line saying so, exit 2). Part of the package, so an installed ferrosync plots without
a clone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

#: what every line of a --metrics file has that the plot draws
_KEYS = frozenset({"step", "loss", "sync_s", "compute_s"})


def read_metrics(path: str) -> list[dict]:
    """The JSON lines of ``path``; a torn last line (a killed run) is skipped.
    ValueError (its message names the line) when it is not a metrics file."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            if number < len(lines):  # not just a torn last line: not a metrics file
                raise ValueError(f"{path}: line {number} is not JSON; give a file written "
                                 "by --metrics") from None
            continue
        if not isinstance(record, dict) or not _KEYS <= set(record):
            raise ValueError(f"{path}: line {number} is not a metrics line (it lacks "
                             f"{', '.join(sorted(_KEYS))}); give a file written by --metrics")
        records.append(record)
    if not records:
        raise ValueError(f"{path} holds no metrics; give a file written by --metrics")
    return records


def moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ferrosync.train.plot",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("metrics", help="JSON-lines file written by --metrics")
    parser.add_argument("-o", "--output", help="PNG to write (default: METRICS with .png)")
    parser.add_argument("--smooth", type=int, default=20,
                        help="moving-average window in steps for the smoothed lines (default 20)")
    args = parser.parse_args(argv)
    if args.smooth < 1:
        parser.error("--smooth must be >= 1")
    if not os.path.isfile(args.metrics):
        what = "is not a file" if os.path.lexists(args.metrics) else "does not exist"
        return _usage_error(f"{args.metrics} {what}; give the file --metrics wrote")
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return _usage_error("matplotlib is not installed; run: pip install "
                            "'ferrosync[plot]'")
    try:
        records = read_metrics(args.metrics)
    except ValueError as exc:
        return _usage_error(str(exc))
    except OSError as exc:
        return _usage_error(f"cannot read {args.metrics} ({exc.strerror or exc})")
    steps = [r["step"] for r in records]
    # a rank 0 that joined a time-based sync with nothing to train writes loss null
    trained = [r for r in records if r["loss"] is not None]
    loss_steps, loss = [r["step"] for r in trained], [r["loss"] for r in trained]
    sync_ms = [1000 * r["sync_s"] for r in records]
    compute_ms = [1000 * r["compute_s"] for r in records]

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    top.plot(loss_steps, loss, color="tab:blue", alpha=0.3, linewidth=0.8,
             label="loss (rank 0)")
    top.plot(loss_steps, moving_average(loss, args.smooth), color="tab:blue",
             label=f"mean of {args.smooth}")
    top.set_ylabel("loss")
    top.legend()
    bottom.plot(steps, sync_ms, color="tab:red", alpha=0.3, linewidth=0.8, label="sync")
    bottom.plot(steps, moving_average(sync_ms, args.smooth), color="tab:red",
                label=f"sync, mean of {args.smooth}")
    bottom.plot(steps, moving_average(compute_ms, args.smooth), color="tab:green",
                label=f"compute, mean of {args.smooth}")
    bottom.set_ylabel("ms per step")
    bottom.set_xlabel("optimizer step")
    bottom.legend()
    fig.suptitle(os.path.basename(args.metrics))
    fig.tight_layout()
    output = args.output or os.path.splitext(args.metrics)[0] + ".png"
    try:
        fig.savefig(output, dpi=100)
    except OSError as exc:  # a mistyped or read-only -o: bad input, not a crash
        return _usage_error(f"cannot write {output} ({exc.strerror or exc}); give -o a "
                            "path in a directory this user can write")
    finally:
        plt.close(fig)
    print(f"wrote {output} ({len(records)} steps)")
    return 0


def _usage_error(message: str) -> int:
    print(f"ferrosync.train.plot: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
