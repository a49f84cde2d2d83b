"""Entry point of ``python -m ferrosync.train`` (``--help`` lists every flag;
docs/train.md).

Exit codes: 0 every rank succeeded, 2 bad input (found by the launcher or a rank), 130
after Ctrl-C, 143 after SIGTERM, 1 any other failure; every error is one line on
stderr, ``ferrosync.train: error: ...`` (a rank's traceback first with ``--verbose``).
"""

from __future__ import annotations

import os
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    from ferrosync.core import interrupts
    from ferrosync.errors import ConfigError
    from ferrosync.train.cli import parse_args
    from ferrosync.train.launcher import ENV_CHILD

    argv = sys.argv[1:] if argv is None else list(argv)
    args = None
    try:
        interrupts.release()  # a Ctrl-C while torch was importing arrives here
        args = parse_args(argv)
        if args.nproc is not None and not os.environ.get(ENV_CHILD):
            from ferrosync.train.launcher import launch

            return launch(args, argv)
        os.environ.pop(ENV_CHILD, None)  # a nested launch from a user script is a launcher
        from ferrosync.train.runner import run_rank

        if args.script is None:  # the built-in trainer's warnings read like its errors
            import warnings

            warnings.formatwarning = _one_line_warning

        return run_rank(args)
    except ConfigError as exc:
        _error(exc, args)
        return 2
    except KeyboardInterrupt:
        # a second Ctrl-C while saying so: already on the way out
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            note = None
            if args is not None:
                from ferrosync.train.runner import resume_note

                note = resume_note(args)
            print("ferrosync.train: interrupted" + (f"; {note}" if note else ""),
                  file=sys.stderr, flush=True)
        finally:
            signal.signal(signal.SIGINT, previous)
        return 130
    except Exception as exc:  # noqa: BLE001 - a rank's failure, reported as one line
        from ferrosync.api import fail_open_syncs

        fail_open_syncs(exc)  # peers learn now (what the excepthook would have done)
        _error(exc, args)
        return 1


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    text = " ".join(str(message).split())
    return f"ferrosync.train: warning: {text.removeprefix('ferrosync: ')}\n"


def _error(exc: BaseException, args) -> None:
    """One line on stderr: ferrosync's own errors (whose messages name the rank, the
    path and what to do) as they are, anything else with its type; the traceback
    before it with ``--verbose``."""
    from ferrosync.errors import ConfigError, FerrosyncError, one_line

    verbose = bool(getattr(args, "verbose", False))
    if verbose:
        import traceback

        traceback.print_exception(type(exc), exc, exc.__traceback__)
    # one line, whatever the message held; a driver's own error may quote a URL too
    text = one_line(exc)
    if type(exc) is not ConfigError:  # bad input reads as a sentence; the rest by type
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    if not isinstance(exc, FerrosyncError) and not verbose:
        text += " (--verbose for the traceback)"
    from ferrosync.train.launcher import ERROR_PREFIX

    print(ERROR_PREFIX + text, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
