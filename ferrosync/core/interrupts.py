"""Ctrl-C while a ferrosync command starts: held until its ``main`` can act on it.

``hold_at_start`` (the first line of ``ferrosync/__init__.py``, for ferrosync's own
commands only) notes a SIGINT instead of raising it in the middle of importing torch;
``release``, called by the command's ``main``, restores Python's handler and raises
the noted interrupt there (docs/design.md#launcher). Standard library only.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

#: the modules run with ``-m`` (and the script) whose ``main`` calls ``release``
COMMANDS = ("ferrosync", "ferrosync.train", "ferrosync.train.__main__", "ferrosync.__main__",
            "ferrosync.testing.seaweed")

_held = False
_pending = False


def hold_at_start() -> None:
    """Hold SIGINT if this process is starting one of ``COMMANDS`` with Python's own
    Ctrl-C handler in place (one set by the user, or SIG_IGN, is left alone)."""
    global _held
    if _held or _command() not in COMMANDS:
        return
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return
    signal.signal(signal.SIGINT, _note)
    _held = True


def release() -> None:
    """Give SIGINT back to Python (``KeyboardInterrupt``), and raise one now if a Ctrl-C
    came while it was held. A no-op where nothing was held."""
    global _held, _pending
    if _held:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _held = False
    if _pending:
        _pending = False
        raise KeyboardInterrupt


def _note(signum, frame) -> None:
    global _pending
    _pending = True


def _command() -> str | None:
    """The module this interpreter was asked to run with ``-m``, or ``"ferrosync"`` for
    the console script; None otherwise (``sys.orig_argv``: Python 3.10 and later)."""
    argv = list(getattr(sys, "orig_argv", None) or [])[1:]
    while argv:
        arg = argv.pop(0)
        if arg == "-m":
            return argv[0] if argv else None
        if arg.startswith("-m") and not arg.startswith("--"):
            return arg[2:]
        if arg in ("-X", "-W", "--check-hash-based-pycs"):
            argv = argv[1:]  # the option's value
        elif arg.startswith("-c") or not arg.startswith("-"):  # -c CODE, or a script
            break
    if sys.argv and os.path.basename(sys.argv[0]) == "ferrosync":
        return "ferrosync"
    return None
