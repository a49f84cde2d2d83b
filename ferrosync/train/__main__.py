"""Entry point of ``python -m ferrosync.train``.

Run:
    python -m ferrosync.train --nproc 2                 # the demo on 2 local ranks
    python -m ferrosync.train --nproc 2 my_script.py    # your script on 2 local ranks
    srun python -m ferrosync.train --sync /nfs/run1     # one rank per SLURM task

``python -m ferrosync.train --help`` lists every flag. Exit codes: 0 when every rank
succeeded, 2 for bad input (found by the launcher or by a rank), 130 after Ctrl-C,
1 for any other failure.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    from ..errors import ConfigError
    from .cli import parse_args
    from .launcher import ENV_CHILD

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_args(argv)
        if args.nproc is not None and not os.environ.get(ENV_CHILD):
            from .launcher import launch

            return launch(args, argv)
        os.environ.pop(ENV_CHILD, None)  # a nested launch from a user script is a launcher
        from .runner import run_rank

        return run_rank(args)
    except ConfigError as exc:
        text = " ".join(str(exc).split())  # one line, whatever the message held
        print(f"ferrosync.train: error: {text}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("ferrosync.train: interrupted", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
