"""The elastic protocol in virtual time: N members of the production code on a
simulated object store, with churn, every round checked (docs/elastic.md#simulation).

The simulator's command line, ``python tools/elastic_sim.py`` (that script's docstring
gives its usage): ``SIM {json}`` last, exit 0 only when no invariant was broken."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from ferrosync.testing.sim.store import PROFILES
from ferrosync.testing.sim.world import World, parse_churn

__all__ = ["command", "main", "parser", "simulate"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="elastic_sim.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--members", type=int, required=True,
                   help="members at the start (founders)")
    p.add_argument("--rounds", type=int, required=True,
                   help="rounds the job averages before it ends")
    p.add_argument("--seed", type=int, required=True,
                   help="the seed: the same seed gives the same trace_digest")
    p.add_argument("--profile", choices=sorted(PROFILES), default="s3",
                   help="the simulated store's behaviour (docs/elastic.md, Simulation)")
    p.add_argument("--churn", default="",
                   help="kind=rate pairs, events per virtual hour across the job "
                   "(joins, leaves, kills, pauses, total_loss, stragglers)")
    p.add_argument("--payload", type=int, default=1 << 20, help="bytes per member (1 MiB)")
    p.add_argument("--compute-s", type=float, default=1.0,
                   help="virtual seconds of training between rounds")
    p.add_argument("--publish-every", type=int, default=5,
                   help="rounds between publishes of the job's state")
    p.add_argument("--heartbeat-interval", type=float, default=None,
                   help="the members' heartbeat_interval (default: the object-store one)")
    p.add_argument("--heartbeat-timeout", type=float, default=None,
                   help="the members' heartbeat_timeout (default: the object-store one)")
    p.add_argument("--min-ranks", type=int, default=1,
                   help="the members' min_ranks (the founding roster waits for them)")
    p.add_argument("--spread-s", type=float, default=0.0,
                   help="the first members arrive evenly over this many virtual seconds")
    p.add_argument("--progress", action="store_true",
                   help="a line on stderr per round (for long runs)")
    return p


def command(args) -> str:
    """The command that replays this run."""
    parts = ["python", "tools/elastic_sim.py", "--members", args.members, "--rounds",
             args.rounds, "--seed", args.seed, "--profile", args.profile]
    if args.churn:
        parts += ["--churn", args.churn]
    parts += ["--payload", args.payload, "--compute-s", args.compute_s]
    if args.publish_every != 5:
        parts += ["--publish-every", args.publish_every]
    for name in ("heartbeat_interval", "heartbeat_timeout"):
        if getattr(args, name) is not None:
            parts += [f"--{name.replace('_', '-')}", getattr(args, name)]
    if args.min_ranks != 1:
        parts += ["--min-ranks", args.min_ranks]
    if args.spread_s:
        parts += ["--spread-s", args.spread_s]
    return shlex.join(str(p) for p in parts)


def simulate(args) -> dict:
    options = {name: getattr(args, name) for name in ("heartbeat_interval",
                                                      "heartbeat_timeout")
               if getattr(args, name) is not None}
    world = World(args.members, args.rounds, args.seed, profile=args.profile,
                  churn=parse_churn(args.churn), payload=args.payload,
                  compute_s=args.compute_s, publish_every=args.publish_every,
                  member_options=options, min_ranks=args.min_ranks,
                  spread_s=args.spread_s,
                  progress=(lambda line: print(line, file=sys.stderr, flush=True))
                  if args.progress else None)
    return world.run()


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        parse_churn(args.churn)
    except ValueError as exc:
        p.error(f"--churn: {exc}")
    for name in ("members", "rounds", "payload", "publish_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.compute_s < 0 or args.spread_s < 0:
        p.error("--compute-s and --spread-s must be >= 0")
    if not 1 <= args.min_ranks <= args.members:
        p.error("--min-ranks must be between 1 and --members")
    result = simulate(args)
    clean = not result["violations"] and not result["wrong_rounds"]
    if not clean:
        print(f"invariants broken: {', '.join(result['violations'])}; replay with: "
              f"{command(args)}", file=sys.stderr)
    print("SIM " + json.dumps(result), flush=True)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
