"""The hidden member command line of the tools that start elastic members as copies of
themselves (``python TOOL --member --url U --job J ...``): its flags, the command and
environment that start a member, and the member's ``connect``. Standard library only at
import."""

from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["add_member_flags", "connect_member", "member_command", "member_env"]


def add_member_flags(parser: argparse.ArgumentParser) -> None:
    """``--member`` (run as one member) and what a member needs: ``--job``, ``--options``
    (JSON for ``connect``), ``--min-ranks``, ``--log``; hidden from ``--help``. The tool
    declares ``--url`` itself (its users give it too)."""
    parser.add_argument("--member", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--min-ranks", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--log", help=argparse.SUPPRESS)


def member_command(script: str, *, url: str, job: str, options: dict, min_ranks: int,
                   log: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The command that runs ``script`` as one member of elastic job ``job`` at ``url``,
    writing to ``log``; ``extra``: the tool's own member flags."""
    return [sys.executable, os.path.abspath(script), "--member", "--url", url, "--job", job,
            "--options", json.dumps(options), "--min-ranks", str(min_ranks), "--log", log,
            *extra]


def member_env(root: str) -> dict:
    """A member's environment: this one, ``root`` (the clone) as ``PYTHONPATH``, one
    intra-op thread (members share the machine's cores)."""
    return dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")


def connect_member(args: argparse.Namespace, timeout: float):
    """The member's ``ElasticSync``, from the flags ``add_member_flags`` declares."""
    import ferrosync

    return ferrosync.connect(args.url, elastic=True, min_ranks=args.min_ranks, job=args.job,
                             timeout=timeout, **json.loads(args.options))
