"""``--nproc N``: start N local ranks, forward their output, stop them all if one fails.

Each rank is ``python -m ferrosync.train`` with torchrun's environment, in its own
process group with a parent-death signal; output is prefixed ``[rank k]`` and rank 0's
``FINAL`` line printed last; bad input is checked before any rank starts; a launch
with its own job id gets a fresh secret kept in its user's key file. With ``--elastic``
a failed member does not stop its siblings. docs/design.md#launcher,
docs/train.md#what-the-launcher-does.
"""

from __future__ import annotations

import collections
import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

from ferrosync.core import runtime
from ferrosync.core.env import (
    ENV_JOB,
    ENV_LOCAL_RANK,
    ENV_LOCAL_WORLD_SIZE,
    ENV_RANK,
    ENV_SECRET,
    ENV_URL,
    ENV_WORLD_SIZE,
)
from ferrosync.core.ports import (
    LOOPBACK,
    free_port,  # the ranks all run on this host
)
from ferrosync.errors import ConfigError

#: set in each rank's environment: "you are a rank, ignore --nproc"
ENV_CHILD = "FERROSYNC_TRAIN_CHILD"
#: set when the launcher's stderr is a terminal, so rank 0 redraws its bar often
ENV_TTY = "FERROSYNC_TTY"
GRACE_S = 5.0
POLL_S = 0.05
_DELIMITER = re.compile(rb"[\r\n]")
#: how every error line of the launcher and of a rank begins: the launcher holds a
#: rank's back and reports it once, naming the rank
ERROR_PREFIX = "ferrosync.train: error: "
_ERROR = ERROR_PREFIX.encode()
_RANK_PREFIX = re.compile(r"^(?:\w+: )?rank \d+(?:, |: )")
_PR_SET_PDEATHSIG = 1
#: exit codes after Ctrl-C and SIGTERM (128 + the signal's number, as a shell reports)
_INTERRUPTED, _TERMINATED = 128 + signal.SIGINT, 128 + signal.SIGTERM


def launch(args, argv: list[str]) -> int:
    """Run ``args.nproc`` ranks of ``python -m ferrosync.train argv``; the exit code."""
    from ferrosync.train.runner import check_sync_options, check_sync_url, preflight, resume_note

    # every check that writes nothing, before anything is created or started
    if args.sync is not None:
        check_url(args.sync, args.sync_options, processes=args.nproc)
    if args.checkpoint_dir is not None:
        check_url(args.checkpoint_dir, args.sync_options, flag="--checkpoint-dir")
    check_sync_options(args.sync or tempfile.gettempdir(), args.sync_options,
                       elastic=args.elastic)
    if args.script is None:
        preflight(args, args.nproc)
    url, created, kept = args.sync, None, None
    if url is None:
        url = created = tempfile.mkdtemp(prefix="ferrosync-train-")
    try:
        if created is None:  # after the read-only checks: this one writes a probe
            check_sync_url(url, args.sync_options)
        commands, envs = [], []
        per_node = args.nproc // (args.nnodes_sim or 1)
        # an elastic job is the URL (plus the user's job id): a made-up id would keep
        # out the members that other commands start
        named = bool(os.environ.get(ENV_JOB))
        job = os.environ.get(ENV_JOB, "") if args.elastic else launch_job_id()
        port = free_port()
        secret = launch_secret(args.elastic)
        if not args.elastic and not named:  # a job id of this launch's own: its key file
            kept = keep_key(job, secret, url)
        for rank in range(args.nproc):
            commands.append([sys.executable, "-m", "ferrosync.train", *argv])
            envs.append(_rank_env(rank, args.nproc, url, per_node, job, port, secret))
        code = Supervisor(commands, envs, url=url, elastic=args.elastic, job=job).run()
        note = resume_note(args) if code in (_INTERRUPTED, _TERMINATED) else None
        if note:
            print(f"ferrosync.train: {note}", file=sys.stderr, flush=True)
        return code
    finally:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
            if kept:  # the job's records went with its temporary directory
                from ferrosync.ops.keys import discard

                discard(job)


def check_url(url: str, options: dict, *, processes: int = 1, flag: str = "--sync") -> None:
    """What the launcher can tell about a storage ``url`` without a request, through the
    storage layer's own reading of it (``ConfigError``, exit 2, before any rank starts):
    a mistyped URL (``s3:/bucket``, ``split_url``), a scheme no installed fsspec driver
    serves (``driver_class``, with the ``pip install``), a driver that cannot create
    only if absent (``--sync`` only: rendezvous needs it), and a store that is one
    process's own (``memory://``) for more than one process."""
    from ferrosync.core.registry import served_by_storage
    from ferrosync.storage.engines import open_storage, split_url
    from ferrosync.storage.engines.base import EXCLUSIVE_CREATE_HINT
    from ferrosync.storage.engines.fsspec_store import driver_class, generic_create

    protocol, _ = split_url(url)
    if not served_by_storage(url) or protocol in ("file", "local"):
        return  # a directory: only its probe (a write) tells more
    why = generic_create(driver_class(url, protocol))
    if why is not None and flag == "--sync":
        raise ConfigError(f"{flag} {url}: ranks cannot meet on this store: {why}",
                          hint=EXCLUSIVE_CREATE_HINT)
    try:
        storage = open_storage(url, options.get("storage_options"))  # no request yet
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - a driver that refuses the URL it was given
        raise ConfigError(f"{flag} {url}: the {protocol}:// driver refused it "
                          f"({type(exc).__name__}: {' '.join(str(exc).split())})",
                          hint="check the URL against the driver's documentation") from None
    try:
        if processes > 1 and not storage.shared_between_processes:
            raise ConfigError(
                f"{flag} {url} is one process's memory: the {processes} processes of this "
                "launch would each see only their own", hint="use a directory "
                "(/dev/shm/NAME on one machine) or an object store; memory:// suits "
                "--nproc 1 and tests in one process")
    finally:
        storage.close()


def launch_job_id() -> str:
    """The job id every rank of this launch shares: ``$FERROSYNC_JOB`` or a new one.

    The launcher starts every rank of its job, so it can name the job: two launches
    on one ``--sync`` URL then never meet, and no rank waits the claim window of a
    job without an id. A job id the user set (for a restart that must find its
    earlier generations under the same name) is kept. SLURM's and torchrun's ids are
    not used here: one allocation may run several launches.
    """
    return os.environ.get(ENV_JOB) or f"launch-{uuid.uuid4().hex[:16]}"


def launch_secret(elastic: bool) -> str | None:
    """A fresh secret for the ranks of this launch, or None (with a warning on stderr
    where the ranks run without one).

    Without a secret, anyone who can write to the sync location can forge what ranks
    read, and object collectives (``broadcast_object_list``, ...) unpickle it. A
    fixed-size launch starts every rank itself, so it can give them one nobody else
    knows: ``$FERROSYNC_SECRET``, set in each rank's environment only. Not when the
    user set a secret (kept), nor for ``--elastic`` members (members started by other
    commands must share the user's secret), nor when the user named the job
    (``$FERROSYNC_JOB``: a restart under that name must read the earlier launches'
    records, which a new secret would reject).
    """
    if os.environ.get(ENV_SECRET):
        return None
    if elastic or os.environ.get(ENV_JOB):
        why = "--elastic members" if elastic else f"a job named by ${ENV_JOB}"
        print(f"ferrosync.train: warning: {why} run without a secret: anyone who can "
              "write to the sync location can forge what the ranks read (and run code "
              f"through object collectives); set the same {ENV_SECRET} for every "
              "process of the job", file=sys.stderr, flush=True)
        return None
    return secrets.token_hex(32)


def keep_key(job: str, secret: str | None, url: str) -> str | None:
    """Write the launch's key file (``ferrosync/ops/keys.py``), so that its user's
    ``ferrosync inspect``, ``gc`` and ``doctor`` verify the job without the secret
    being copied by hand, and can tell when the launch is over; returns its path.

    ``ConfigError`` (exit 2, before any rank starts) for a key directory others can
    enter; a key that cannot be written (full disk, read-only home) is a warning: the
    job runs, and the tools see it as they would without the file."""
    from ferrosync.ops import keys

    try:
        return keys.save(job, secret, url)
    except OSError as exc:
        print(f"ferrosync.train: warning: cannot keep the key of job {job} in "
              f"{keys.directory()} ({exc.strerror or exc}): `ferrosync inspect` and `gc` "
              "will not verify it", file=sys.stderr, flush=True)
        return None


def torchrun_env(rank: int, world_size: int, per_node: int, job: str, port: int) -> dict:
    """What torchrun (``LocalElasticAgent``) puts in a worker's environment, for one
    launch of ``world_size`` ranks on this host, ``per_node`` per simulated node.

    ``MASTER_ADDR``/``MASTER_PORT`` make ``env://`` (``init_process_group`` without
    init_method) work for every backend; ``TORCHELASTIC_RUN_ID`` is the launch's job
    id; there are no restarts. ``TORCHELASTIC_USE_AGENT_STORE`` is False: no agent
    runs a store for the ranks, so ``env://`` makes rank 0 start the TCPStore (an
    inherited True from an outer torchrun would make every rank a client of a store
    that is not there).
    """
    return {
        ENV_RANK: str(rank),
        ENV_WORLD_SIZE: str(world_size),
        ENV_LOCAL_RANK: str(rank % per_node),
        ENV_LOCAL_WORLD_SIZE: str(per_node),
        "GROUP_RANK": str(rank // per_node),  # the node index
        "GROUP_WORLD_SIZE": str(world_size // per_node),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": job or "none",  # torchrun's spelling of "no id"
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                                          "1"),
    }


def _rank_env(rank: int, world_size: int, url: str, per_node: int | None = None,
              job: str | None = None, port: int | None = None,
              secret: str | None = None) -> dict:
    """A rank's environment; ``per_node`` < world_size simulates several nodes.

    Every rank of a launch must get the same ``job``, ``port`` and ``secret``
    (``launch`` passes them; ``launch_secret``); the defaults suit a single call."""
    per_node = per_node or world_size
    env = dict(os.environ)
    job = launch_job_id() if job is None else job  # "": no job id (an elastic launch)
    port = port or free_port()
    env.update(torchrun_env(rank, world_size, per_node, job, port))
    env.pop(ENV_JOB, None)
    if job:
        env[ENV_JOB] = job
    if secret:
        env[ENV_SECRET] = secret
    env.update({
        ENV_URL: url,
        ENV_CHILD: "1",
        "PYTHONUNBUFFERED": "1",  # output reaches the launcher as it is written
    })
    if world_size > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N ranks must not oversubscribe
    if sys.stderr.isatty():
        env[ENV_TTY] = "1"
    # the ranks must import this very ferrosync, whatever their sys.path would say
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _load_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


class _Stop(Exception):
    """The launcher itself was asked to stop (SIGTERM)."""


class _Pump(threading.Thread):
    """Copies one rank's stdout or stderr to ours, prefixing every line.

    Complete lines go out whole (so ranks' lines never interleave mid-line); a
    progress bar's carriage-return redraw goes out as soon as it arrives.
    """

    def __init__(self, rank: int, source, sink, lock: threading.Lock, *,
                 hold_final: bool, hold_error: bool = False) -> None:
        super().__init__(daemon=True, name=f"rank{rank}-pump")
        self.prefix = f"[rank {rank}] ".encode()
        self.source, self.sink, self.lock = source, sink, lock
        self.hold_final, self.hold_error = hold_final, hold_error
        self.final: bytes | None = None
        #: the rank's one-line error (``ERROR_PREFIX`` ...), held back: the launcher
        #: reports it once, naming the rank, instead of every rank's copy
        self.error: str | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self._buf = b""
        self._open = False  # a partial redraw was written: continue without prefix
        self._after_cr = False

    def run(self) -> None:
        fd = self.source.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            self._feed(chunk)
        if self._buf:
            self._feed(b"\n")
        self.source.close()

    def _feed(self, chunk: bytes) -> None:
        self._buf += chunk
        out = []
        while (m := _DELIMITER.search(self._buf)) is not None:
            segment, delim = self._buf[:m.start()], self._buf[m.start():m.end()]
            self._buf = self._buf[m.end():]
            if delim == b"\n" and not self._open:
                self.tail.append(segment.decode(errors="replace"))
                if self.hold_final and segment.startswith(b"FINAL "):
                    self.final = segment
                    continue
                if self.hold_error and segment.startswith(_ERROR):
                    self.error = segment[len(_ERROR):].decode(errors="replace").strip()
                    continue
            if self._open or (not segment and delim == b"\r"):
                out.append(segment + delim)  # a continuation, or a bare redraw marker
            else:
                out.append(self.prefix + segment + delim)
            self._open = False
            self._after_cr = delim == b"\r"
        if self._buf and self._after_cr:
            out.append(self._buf if self._open else self.prefix + self._buf)
            self._buf, self._open = b"", True
        if out:
            _write(self.sink, self.lock, b"".join(out))

    def error_line(self) -> str:
        if self.error is not None:
            return self.error
        for line in reversed(self.tail):
            if line.strip():
                return line.strip()
        return ""


class Supervisor:
    """Runs one process per rank and stops them all as soon as one fails (with
    ``elastic``: lets the others run on, each an independent member)."""

    def __init__(self, commands: list[list[str]], envs: list[dict], *, url: str,
                 elastic: bool = False, job: str = "") -> None:
        self.commands, self.envs, self.url, self.job = commands, envs, url, job
        self.elastic = elastic
        self.word = "member" if elastic else "rank"
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[tuple[_Pump, _Pump]] = []
        self.stopped: set[int] = set()  # ranks this launcher signalled
        self.out_lock, self.err_lock = threading.Lock(), threading.Lock()

    def _say(self, text: str) -> None:
        _write(sys.stderr, self.err_lock, f"ferrosync.train: {text}\n".encode())

    def run(self) -> int:
        # a signal the launcher was started with ignored (nohup, `cmd &`) stays ignored
        previous = {sig: signal.signal(sig, _stop_once) for sig in _STOP_SIGNALS
                    if signal.getsignal(sig) is not signal.SIG_IGN}
        try:
            self._start()
            failed = self._wait()
        except KeyboardInterrupt:
            self._stop_all()
            self._say("interrupted: stopped every rank")
            return _INTERRUPTED
        except _Stop:
            self._stop_all()
            self._say("terminated: stopped every rank")
            return _TERMINATED
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._stop_all()
            self._drain()
        return self._report(failed)

    def _start(self) -> None:
        parent = os.getpid()

        def die_with_parent() -> None:  # runs in the child, between fork and exec
            if _PRCTL is not None:
                _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # the launcher died before prctl took effect
                os._exit(1)

        # start every process before any pump thread: fork with threads running is
        # best kept to a minimum
        for command, env in zip(self.commands, self.envs):
            self.procs.append(subprocess.Popen(
                command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True, preexec_fn=die_with_parent,
            ))
        pids = ", ".join(f"rank {r} pid {p.pid}" for r, p in enumerate(self.procs))
        job = f" of job {self.job}" if self.job else ""
        self._say(f"started {len(self.procs)} ranks ({pids}){job}; sync URL {self.url}")
        for rank, proc in enumerate(self.procs):
            out = _Pump(rank, proc.stdout, sys.stdout, self.out_lock,
                        hold_final=rank == 0 or self.elastic)
            err = _Pump(rank, proc.stderr, sys.stderr, self.err_lock, hold_final=False,
                        hold_error=True)
            out.start()
            err.start()
            self.pumps.append((out, err))

    def _wait(self) -> list[int]:
        """Block until every rank exited 0 (returns []) or until ranks failed on their
        own (returns them; none has been stopped by the launcher yet)."""
        def ended() -> list[int] | None:
            codes = [p.poll() for p in self.procs]
            failed = [r for r, code in enumerate(codes) if code not in (None, 0)]
            if self.elastic and all(code is not None for code in codes):
                return failed  # members outlive a failed sibling: wait for everyone
            if (failed and not self.elastic) or all(code == 0 for code in codes):
                return failed
            return None

        # a training run takes what it takes: the children bound themselves
        return runtime.wait(ended, deadline=runtime.FOREVER, poll=(POLL_S, POLL_S))

    def _stop_all(self) -> None:
        alive = [p for p in self.procs if p.poll() is None]
        for proc in alive:
            _signal_group(proc, signal.SIGTERM)
        self.stopped.update(self.procs.index(p) for p in alive)
        deadline = time.monotonic() + GRACE_S
        for proc in alive:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                try:
                    proc.wait(timeout=GRACE_S)
                except subprocess.TimeoutExpired:  # stuck in the kernel: report, not hang
                    self._say(f"rank {self.procs.index(proc)} (pid {proc.pid}) did not exit")

    def _drain(self) -> None:
        for out, err in self.pumps:
            out.join(timeout=5.0)
            err.join(timeout=5.0)

    def _report(self, failed: list[int]) -> int:
        finals = [(r, out.final) for r, (out, _) in enumerate(self.pumps)
                  if out.final is not None]
        final = finals[0][1] if finals else None
        for rank, line in finals[1:]:  # elastic: every member that finished reports
            _write(sys.stdout, self.out_lock, f"[rank {rank}] ".encode() + line + b"\n")
        code = 0
        if failed:
            # ranks that failed in the same instant: name the cause, not a peer that
            # merely reported it (PeerFailed)
            failed.sort(key=lambda r: "PeerFailed" in self.pumps[r][1].error_line())
            first = failed[0]
            rc = self.procs[first].returncode
            how = (f"was killed by {signal.Signals(-rc).name}" if rc < 0
                   else f"failed with exit code {rc}")
            error = self.pumps[first][1].error_line()
            self._say(f"{self.word} {first} {how}" + (f": {error}" if error else ""))
            # another rank's own error once more only if it says something new (a peer
            # reporting the first failure, PeerFailed, does not)
            told = {_unranked(error)}
            others = []
            for rank in sorted(set(failed[1:])):
                line = self.pumps[rank][1].error_line()
                if self.pumps[rank][1].error is not None and _unranked(line) not in told \
                        and not line.startswith("PeerFailed"):
                    told.add(_unranked(line))
                    self._say(f"{self.word} {rank} failed too: {line}")
                else:
                    others.append(rank)
            if others:
                self._say(f"{self.word}s {others} failed too")
            if self.elastic and final is not None:
                self._say("the elastic job went on without it and finished")
            stopped = sorted(self.stopped - set(failed))
            if stopped:
                self._say(f"stopped ranks {stopped}")
            code = 2 if rc == 2 else 1
        if final is not None:
            _write(sys.stdout, self.out_lock, final + b"\n")
        return code


def _unranked(error: str) -> str:
    """An error line without the rank it starts with: every rank's copy of the same
    error (each names itself) compares equal."""
    return _RANK_PREFIX.sub("", error, count=1)


def _write(stream, lock: threading.Lock, data: bytes) -> None:
    with lock:
        try:
            binary = getattr(stream, "buffer", None)
            if binary is not None:
                stream.flush()  # anything written as text before must come first
                binary.write(data)
                binary.flush()
            else:  # a text-only stream (an embedding application's)
                stream.write(data.decode(errors="replace"))
                stream.flush()
        except (BrokenPipeError, ValueError):
            # our reader went away (`| head`) or the stream is closed: drop the output,
            # but keep draining the ranks' pipes, or they would block on a full pipe
            pass


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the rank and anything it started (DataLoader workers)
    except (ProcessLookupError, PermissionError):
        pass


#: what asks the launcher to stop every rank: Ctrl-C (130) and SIGTERM (143)
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _stop_once(signum, frame):
    # The first stop signal decides the exit code. A second one (a supervisor's SIGTERM
    # repeated, Ctrl-C pressed again) asks for the stop already under way: ignored from
    # here, in the handler itself, so it cannot land in the middle of the stop (it would
    # leave the launcher with a raw exception and its ranks running). The stop is still
    # bounded: SIGKILL after GRACE_S, and SIGKILL to the launcher still works.
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise _Stop()
