"""The ``ferrosync`` console script (and ``python -m ferrosync``): ``inspect``, ``gc``,
``doctor`` and ``keys`` over a storage location.

Usage, flags and exit status (0 ran, 1 storage failed, 2 bad usage):
docs/operations.md and docs/design.md#operator-tools. The tools live in
``ferrosync.ops`` and are imported only here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ferrosync.core.env import ENV_SECRET
from ferrosync.core.validate import cli_number
from ferrosync.errors import ConfigError, StorageError, one_line
from ferrosync.ops.keys import directory as keys_directory

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
#: seconds the tools give their first contact with an object store (probe_bucket)
TOOL_CONTACT_TIMEOUT = 30.0


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ferrosync",
        description="Operator tools for a ferrosync storage location (directory, NFS, "
        "s3://, ...). See docs/operations.md.",
    )
    subs = parser.add_subparsers(dest="command", metavar="{inspect,gc,doctor,keys}")
    subs.required = True

    def common(sub: argparse.ArgumentParser, *, secret: bool) -> None:
        sub.add_argument("url", metavar="URL",
                         help="the job's storage URL: a directory, file://, s3://, gs://, ...")
        sub.add_argument("--storage-options", type=_json_object, default=None,
                         metavar="JSON", help="JSON object passed to the fsspec filesystem "
                         "(credentials, endpoint_url, ...); not for local paths")
        if secret:
            sub.add_argument("--secret", default=None,
                             help=f"shared key to verify the records of jobs without a key "
                             f"file (default ${ENV_SECRET}; '' for none); a job started by "
                             "python -m ferrosync.train is verified with the key file its "
                             f"launcher left in {keys_directory()}")

    def watch(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--watch", type=cli_number(minimum=0), default=None, metavar="SECONDS",
                         help="watch heartbeat counters this long to tell live ranks from "
                         "stale ones (default 3 s locally, 5 s on object stores; 0 skips)")

    p = subs.add_parser("inspect", help="generations, ranks, liveness, aborts, bytes",
                        description="Describe what is stored at URL and whether its ranks "
                        "are alive.")
    common(p, secret=True)
    watch(p)
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--objects", action="store_true",
                   help="list every object of every generation (with data headers)")

    p = subs.add_parser("gc", help="remove finished generations and orphaned temp files",
                        description="Remove finished or dead generations and orphaned "
                        "temp files; never live ones.")
    common(p, secret=True)
    watch(p)
    p.add_argument("--keep", type=cli_number(int, minimum=0), default=0, metavar="N",
                   help="keep each job's N newest finished generations (default 0)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, delete nothing")
    p.add_argument("--json", action="store_true", help="print one JSON document")

    p = subs.add_parser("doctor", help="check a storage location before a job",
                        description="Check URL (created if missing) for atomicity, "
                        "visibility, permissions, latency and throughput; print settings.")
    common(p, secret=False)
    p.add_argument("--size-mib", type=cli_number(int, minimum=0), default=64, metavar="N",
                   help="object size for the throughput check, MiB (default 64; 0 skips)")
    p.add_argument("--samples", type=cli_number(int, minimum=1), default=30, metavar="N",
                   help="round trips per latency measurement (default 30)")
    p.add_argument("--payload-mib", type=cli_number(int, minimum=1), default=100, metavar="N",
                   help="your per-collective payload, MiB, for the timeout advice "
                   "(default 100)")
    p.add_argument("--world-size", type=cli_number(int, minimum=1), default=8, metavar="N",
                   help="ranks in your job, for the timeout advice (default 8)")
    p.add_argument("--mode", choices=["fixed", "elastic"], default=None,
                   help="recommend settings for a fixed-size job (connect(url)) or an "
                   "elastic one (connect(url, elastic=True)); default: elastic when the "
                   "location holds an elastic job and no fixed-size one")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--strict", action="store_true", help="exit 1 if any check fails")

    from ferrosync.ops.keys import PRUNE_AFTER_DAYS

    p = subs.add_parser("keys", help="list or prune the key files the launcher keeps",
                        description=f"List the key files in {keys_directory()} (one per "
                        "launch of python -m ferrosync.train); --prune removes those of "
                        "launches that are over. A running launch's is never removed.")
    p.add_argument("--prune", action="store_true",
                   help="remove the key files of launches whose launcher has exited and "
                   "whose run directory is gone, or that are not running and older than "
                   "--older-than")
    p.add_argument("--older-than", type=cli_number(minimum=0), default=PRUNE_AFTER_DAYS,
                   metavar="DAYS", help=f"with --prune: the age, in days, from which the key "
                   f"file of a launch that is not running goes (default {PRUNE_AFTER_DAYS:g})")
    p.add_argument("--dry-run", action="store_true", help="with --prune: say, remove nothing")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    return parser


def _keys(args):
    """Each job's key: its launcher's key file, else --secret / $FERROSYNC_SECRET."""
    from ferrosync.ops.keys import JobKeys

    value = args.secret if args.secret is not None else os.environ.get(ENV_SECRET)
    return JobKeys(value.encode() if value else None)


def _dispatch(args) -> int:
    from ferrosync.storage.engines import open_storage

    # the first contact is bounded: a dead endpoint or missing credentials is one line
    storage = open_storage(args.url, args.storage_options, timeout=TOOL_CONTACT_TIMEOUT)
    try:
        if args.command == "doctor":
            from ferrosync.ops import doctor

            return doctor.run(storage, args.url, args.storage_options, size_mib=args.size_mib,
                              samples=args.samples, payload_mib=args.payload_mib,
                              world_size=args.world_size, as_json=args.json,
                              strict=args.strict, mode=args.mode)
        from ferrosync.ops.watch import default_window

        window = args.watch if args.watch is not None else default_window(storage)
        if args.command == "inspect":
            from ferrosync.ops import inspect

            _check_reachable(storage)
            return inspect.run(storage, _keys(args), window, as_json=args.json,
                               objects=args.objects)
        from ferrosync.ops import gc

        _check_reachable(storage)
        return gc.run(storage, _keys(args), window, keep=args.keep, dry_run=args.dry_run,
                      as_json=args.json)
    finally:
        storage.close()


def _check_reachable(storage) -> None:
    """A missing bucket is bad usage (exit 2); a missing directory is merely empty."""
    from ferrosync.storage.engines import LocalStorage

    storage.probe_bucket()
    if isinstance(storage, LocalStorage) and os.path.exists(storage.url) and not (
            os.path.isdir(storage.url)):
        raise ConfigError("not a directory", path=storage.url,
                          hint="pass the directory the job was given as its URL")


def main(argv: list[str] | None = None) -> int:
    """Run one tool; returns the exit status (argparse exits 2 itself on bad flags)."""
    from ferrosync.core import interrupts

    try:
        interrupts.release()  # a Ctrl-C while torch was importing arrives here
    except KeyboardInterrupt:
        print("ferrosync: interrupted", file=sys.stderr)
        return 130
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "keys":  # the user's own key files: no storage location
            from ferrosync.ops import keys_tool

            return keys_tool.run(prune_them=args.prune, older_than_days=args.older_than,
                            dry_run=args.dry_run, as_json=args.json)
        return _dispatch(args)
    except ConfigError as exc:
        print(f"ferrosync {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (StorageError, OSError) as exc:  # a driver's own error may quote a URL, span lines
        print(f"ferrosync {args.command}: storage failed: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
