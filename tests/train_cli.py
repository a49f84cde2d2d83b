"""Run ``python -m ferrosync.train`` as a real process, as a user would, and read what
it reports (the FINAL line, the metrics file).

A new interpreter pays torch's import, about 2.5 CPU-seconds, and the suite starts
hundreds of training processes. So a process started here is a fork of the suite's
forkserver (``tests/ranks.py``: torch and ferrosync already imported), made into
``python -m ferrosync.train ARGS``: its own pid, environment, working directory, module
search path, signal dispositions, stdin, stdout and stderr, the same ``main``, the same
exit code, atexit handlers and threads joined at exit (``ForkedCli``); ``python
SCRIPT.py ARGS`` (an example, a tool, a user's script) and torchrun (``python -m
torch.distributed.run``) likewise. The launcher of a ``--nproc`` run is run in the
test's process (``launch_in_process``), or forked when the test signals it
(``start_cli``), and starts its ranks the same way. What the user's interpreter start
itself does (``-m`` finding the module, ``$PYTHON*`` flags, the interpreter's own
shutdown) is the one thing not exercised; the tests that need real interpreters get
them (``start_cli(fork_ranks=False)``: the launcher's own ``Popen`` of its ranks; a
script's exit without ``destroy_process_group``; torch's hook autoloading).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
from unittest import mock

from ranks import TESTS

ROOT = os.path.dirname(TESTS)
#: required keys of every metrics line (docs/design.md#metrics-lines)
METRIC_KEYS = {"step", "epoch", "loss", "lr", "compute_s", "sync_s", "bytes", "requests"}


def cli_env(**extra) -> dict:
    env = dict(os.environ)
    # FERROSYNC_JOB too: the launcher names each launch's job, as it does for a user
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "FERROSYNC_URL", "SLURM_PROCID",
                 "SLURM_NTASKS", "FERROSYNC_JOB"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, TESTS])
    env["OMP_NUM_THREADS"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def command(*args) -> list[str]:
    return [sys.executable, "-m", "ferrosync.train", *map(str, args)]


def run_cli(*args, cwd, timeout: float = 180, **env) -> subprocess.CompletedProcess:
    """Run to completion (a test never hangs: ``timeout`` raises, and pytest-timeout
    stops a launcher run in this process). With ``--nproc`` the launcher runs in this
    process (``launch_in_process``) and starts its ranks as real processes."""
    argv = [str(a) for a in args]
    if "--nproc" in argv:
        code, out, err = launch_in_process(argv, cwd, cli_env(**env))
        return subprocess.CompletedProcess(command(*argv), code, out, err)
    return run_forked(command(*argv), cwd=cwd, env=cli_env(**env), capture_output=True,
                      text=True, timeout=timeout)


def run_forked(args: list[str], *, timeout: float | None = None, check: bool = False,
               capture_output: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` through ``ForkedCli``: ``python -m ferrosync.train`` and
    ``python -m ferrosync`` (the operator tools) start forked, anything else as usual."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with ForkedCli(args, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def launch_in_process(argv: list[str], cwd, env: dict, *,
                      merged: bool = False) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``python -m ferrosync.train ARGV`` (a launch:
    ``--nproc``), its launcher run as a call to ``main`` in this process, as if it were
    a process started in ``cwd`` with ``env`` (``as_process``). The ranks are real
    processes, forked (``ForkedCli``) where the launcher would start new interpreters:
    about 3 CPU-seconds saved per launch and 2.5 per rank, over a hundred launches in the
    suite. Warnings print, as in a process of its own, instead of failing (the suite's
    filterwarnings=error). ``merged``: stderr into stdout, interleaved as written (the
    third value is then empty)."""
    import io
    import warnings

    from ferrosync.train.__main__ import main

    assert "--nproc" in argv, "only a launch runs in this process (a rank would run here)"
    out_bytes, err_bytes = io.BytesIO(), io.BytesIO()
    out = io.TextIOWrapper(out_bytes, encoding="utf-8", errors="replace", write_through=True)
    err = out if merged else io.TextIOWrapper(err_bytes, encoding="utf-8", errors="replace",
                                              write_through=True)
    with as_process(cwd, env), ranks_forked(), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("default")
        try:
            code = main(list(argv))
        except SystemExit as exc:  # what argparse does on its own errors
            code = exc.code
    out.flush()
    err.flush()
    return (code, out_bytes.getvalue().decode("utf-8", "replace"),
            err_bytes.getvalue().decode("utf-8", "replace"))


@contextlib.contextmanager
def ranks_forked():
    """Within: the launcher starts its ranks as ``ForkedCli`` processes, not as new
    interpreters."""
    from ferrosync.train import launcher

    forking = types.SimpleNamespace(**{**vars(subprocess), "Popen": ForkedCli})
    with mock.patch.object(launcher, "subprocess", forking):
        yield


@contextlib.contextmanager
def as_process(cwd, env: dict, script_dir: str | None = None):
    """This process as a new ``python -m`` process would start (``python SCRIPT`` where
    ``script_dir`` is the script's directory, which goes first on the module search
    path): ``env`` as the environment, ``cwd`` as the directory, and what
    ``$PYTHONPATH`` puts first on the module search path; all put back afterwards, and
    modules imported from those paths forgotten (another test's directory may hold a
    module of the same name)."""
    added = [p for p in [script_dir, *env.get("PYTHONPATH", "").split(os.pathsep)]
             if p and p not in sys.path]
    saved_env, saved_cwd, saved_modules = dict(os.environ), os.getcwd(), set(sys.modules)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        # The one sys.path change in tests/, tools/ and examples/: what $PYTHONPATH gives
        # a new interpreter (a new list, put back afterwards with whatever the code under
        # test added to it)
        with mock.patch.object(sys, "path", added + sys.path):
            yield
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        for name in set(sys.modules) - saved_modules:
            where = getattr(sys.modules[name], "__file__", None) or ""
            if any(where.startswith(os.path.join(p, "")) for p in added):
                del sys.modules[name]


#: the modules ``ForkedCli`` forks (``python -m NAME``): the module whose ``main`` runs
FORKED = {"ferrosync.train": "ferrosync.train.__main__", "ferrosync": "ferrosync.__main__",
          "torch.distributed.run": "torch.distributed.run"}


def _forked_entry(args: list[str], cwd) -> tuple[str, list[str]] | None:
    """(what runs, its arguments) where ``args``, run in ``cwd``, is a command
    ``ForkedCli`` forks: ``python -m NAME ...`` for a NAME in ``FORKED`` (the module),
    or ``python FILE.py ...`` (the script's absolute path); None for anything else."""
    if len(args) >= 3 and args[:2] == [sys.executable, "-m"] and args[2] in FORKED:
        return FORKED[args[2]], args[3:]
    if len(args) >= 2 and args[0] == sys.executable and args[1].endswith(".py"):
        script = os.path.join(os.fspath(cwd or os.getcwd()), args[1])
        if os.path.isfile(script):
            return os.path.abspath(script), args[2:]
    return None


class ForkedCli(subprocess.Popen):
    """``subprocess.Popen`` of ``python -m ferrosync.train ARGS`` (or ``python -m
    ferrosync ARGS``, the operator tools) whose process is a fork of the suite's
    forkserver (see the module's docstring) instead of a new interpreter; any other
    command starts as ``Popen`` would start it.

    Everything ``Popen`` offers works (``communicate``, ``poll``, ``wait``, signals,
    ``returncode``, text or bytes pipes, ``start_new_session``); the process is the
    forkserver's child, so its exit status comes from there. ``pass_fds`` is not
    supported and ``preexec_fn`` is not run: the only one given is the launcher's
    parent-death hook, and the parent here is the forkserver, which outlives no test
    worker.
    """

    _forked = None

    def __init__(self, args, *, fork_ranks: bool = True, **kwargs) -> None:
        # fork_ranks: a launch's ranks forked from its launcher (a fork itself), not
        # new interpreters; False where the launcher's own process start is under test
        self._fork_ranks = fork_ranks
        super().__init__(args, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                       startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread,
                       c2pwrite, errread, errwrite, *rest):
        entry = None if shell else _forked_entry(list(map(str, args)), cwd)
        if entry is None:
            return super()._execute_child(
                args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread,
                errwrite, *rest)
        from multiprocessing.connection import Connection

        from ranks import context

        assert not pass_fds, "ForkedCli passes no file descriptors but its stdio"
        new_session = rest[5]  # restore_signals, gid, gids, uid, umask, start_new_session
        ends = []
        for fd, mode in ((p2cread, os.O_RDONLY), (c2pwrite, os.O_WRONLY),
                         (errwrite, os.O_WRONLY)):
            # -1: inherit; a forkserver child's inherited stdio is /dev/null or its own
            ends.append(Connection(os.dup(fd) if fd != -1 else os.open(os.devnull, mode)))
        env = dict(os.environ if env is None else env)
        forked = context().Process(
            target=_cli_main, args=(*entry, env, cwd or os.getcwd(), ends, new_session,
                                    self._fork_ranks), daemon=True)
        try:
            forked.start()
        finally:
            for end in ends:
                end.close()
            # the child holds its copies; closed as Popen closes them after a fork
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        self._forked = forked
        self.pid = forked.pid
        self._child_created = True

    def _internal_poll(self, _deadstate=None, **_kwargs):
        if self._forked is None:
            return super()._internal_poll(_deadstate, **_kwargs)
        if self.returncode is None and self._forked.exitcode is not None:
            self.returncode = self._forked.exitcode
        return self.returncode

    def _wait(self, timeout):
        if self._forked is None:
            return super()._wait(timeout)
        self._forked.join(timeout)
        if self._forked.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.returncode = self._forked.exitcode
        return self.returncode


def _cli_main(module: str, argv: list[str], env: dict, cwd: str, ends,
              new_session: bool, fork_ranks: bool) -> None:
    """In the forked process: become ``python -m MODULE ARGV`` (or ``python MODULE
    ARGV`` where MODULE is a script's path), run it, exit. With ``fork_ranks``, a launch
    (``--nproc``) or one of the repository's tools forks the processes it starts from
    here (each starts them all before any thread of its own)."""
    import atexit
    import importlib
    import io
    import multiprocessing
    import runpy
    import warnings

    if new_session:
        os.setsid()
    for fd, end in enumerate(ends):
        os.dup2(end.fileno(), fd)
        end.close()
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False),
                                               line_buffering=True, write_through=True)
                              for fd in (1, 2))
    # a new interpreter's warning filters (the forkserver's, a new interpreter's own,
    # with $PYTHONWARNINGS first) and signal dispositions, whatever it inherited
    for option in filter(None, env.get("PYTHONWARNINGS", "").split(",")):
        warnings._setoption(option)  # the interpreter's own parser of -W and the variable
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # the test worker ends a forked CLI left running (a daemon there); here it may start
    # processes of its own, as any process may
    multiprocessing.current_process()._config["daemon"] = False
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    code = 1
    script = module.endswith(".py")
    # a launch, or a tool of the repository's (tools/bench/elastic_costs.py starts members),
    # forks the processes it starts, from here: this process is no forkserver's client
    forks = fork_ranks and ((module == FORKED["ferrosync.train"] and "--nproc" in argv)
                            or module.startswith(os.path.join(ROOT, "tools", "")))
    if forks:
        import ranks

        ranks.use_fork()
    with as_process(cwd, env, script_dir=os.path.dirname(module) if script else None), \
            (mock.patch.object(subprocess, "Popen", ForkedCli) if forks
             else contextlib.nullcontext()):
        try:
            if script:
                # as the interpreter runs it: __main__ with its file (multiprocessing's
                # spawn finds the script there for its children), argv[0] the path
                sys.argv = [module, *argv]
                runpy.run_path(module, run_name="__main__")
                code = 0
            else:
                entry = importlib.import_module(module)
                sys.argv = [entry.__file__, *argv]
                code = entry.main(argv)
        except SystemExit as exc:
            code = exc.code
        except BaseException:  # noqa: BLE001 - what the interpreter does with it
            sys.excepthook(*sys.exc_info())
        # interpreter shutdown: non-daemon threads joined, then the atexit handlers
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_main(args, cwd, monkeypatch, capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``python -m ferrosync.train ARGS`` run as a call
    to its ``main`` in this process: for input the launcher refuses before any rank
    starts, where a process would only pay torch's import again. The environment is
    ``cli_env``'s (monkeypatched back afterwards); stdout and stderr through capsys."""
    from ferrosync.train.__main__ import main

    monkeypatch.chdir(cwd)
    for name in set(os.environ) - set(cli_env()):
        monkeypatch.delenv(name)
    try:
        code = main([str(a) for a in args])
    except SystemExit as exc:  # what argparse does on its own errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def start_cli(*args, cwd, fork_ranks: bool = True, **env) -> subprocess.Popen:
    """Start without waiting (``ForkedCli``); the tests send it SIGINT (Ctrl-C), SIGTERM,
    SIGKILL, SIGSTOP. A suite started in the background by a non-interactive shell
    (`cmd &`) inherits SIGINT ignored; the forked process restores Python's handler, so
    the launcher under test sees Ctrl-C the way a terminal user's would. A launch's
    ranks are forked too, unless ``fork_ranks=False``: new interpreters, started by the
    launcher's own ``Popen`` (with its parent-death hook)."""
    return ForkedCli(command(*args), cwd=cwd, env=cli_env(**env), stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True, fork_ranks=fork_ranks)


def final_of(stdout: str) -> dict:
    """The FINAL record, which must be the last line of stdout."""
    last = stdout.rstrip("\n").splitlines()[-1]
    assert last.startswith("FINAL "), f"last stdout line is not FINAL: {last!r}"
    return json.loads(last[len("FINAL "):])


def read_metrics(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def read_metrics_so_far(path) -> list[dict]:
    """The complete lines of a metrics file a running job is still writing: none before
    the file exists, and nothing from the line being written."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    break  # the line being written
    except FileNotFoundError:
        pass
    return rows


def await_point(proc: subprocess.Popen, ready, what: str, timeout: float = 120) -> None:
    """Block until ``ready()`` says ``proc`` reached a point (a marker file it wrote, a
    library it mapped); fails at once if ``proc`` exits first, or after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{what} never came"
        time.sleep(0.01)


@contextlib.contextmanager
def reaped(proc: subprocess.Popen):
    """Within: a process the test signals; killed and reaped on the way out if it still
    runs (a failed assertion must not leave it behind)."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
