"""One rank of ``python -m ferrosync.train``: the built-in trainer or the user's SCRIPT.

Also the launcher's pre-flight: the checks a rank would make before touching the
sync URL (strategy, factories, checkpoint), done once in the launcher so that bad
input is one line and exit code 2 before any rank starts.
"""

from __future__ import annotations

import logging
import os
import re
import runpy
import signal
import sys
import time
import traceback

import torch

from ferrosync.api import connect, fail_open_syncs
from ferrosync.core import runtime
from ferrosync.core.env import ENV_URL
from ferrosync.elastic import peek_state
from ferrosync.errors import ConfigError, JobEnded, MemberDropped, SyncTimeout
from ferrosync.strategies import make_strategy
from ferrosync.train import demo
from ferrosync.train.checkpoint import Checkpoints, check_compatible, probe_location
from ferrosync.train.cli import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_EPOCHS,
    DEFAULT_LR,
    STRATEGY_FLAGS,
    resolve,
)
from ferrosync.train.elastic import (
    PUBLISH_EVERY_SECONDS,
    ElasticTrainer,
    MemberLeft,
    RejoinNeeded,
    metrics_path_for,
)
from ferrosync.train.metrics import probe_output_file, require_tensorboard
from ferrosync.train.threads import share_threads
from ferrosync.train.trainer import Trainer, resolve_device

LOSSES = {
    "cross_entropy": torch.nn.functional.cross_entropy,
    "mse": torch.nn.functional.mse_loss,
}
EVAL_BATCH = 1024
#: the exit code of a rank or member stopped by SIGTERM (128 + 15, as a shell reports
#: it): a fixed-size rank at once, an elastic member after finishing its round
SIGTERM_EXIT = 128 + signal.SIGTERM
#: an elastic member that gets SIGTERM finishes its round within this long, else it
#: leaves at once without publishing: inside the 30 s a Kubernetes pod (and GCE's
#: preemption notice) gives a process between SIGTERM and SIGKILL
LEAVE_GRACE_S = 25.0


# -- building the trainer from flags -----------------------------------------------------

def _strategy(args):
    timeout = args.timeout or 300.0
    if args.sync_every_seconds and 2 * args.sync_every_seconds > timeout:
        raise ConfigError(f"--sync-every-seconds {args.sync_every_seconds:g} needs --timeout "
                          f"above {2 * args.sync_every_seconds:g} (it is {timeout:g}): a rank "
                          "that reaches a sync early waits up to a whole window there",
                          hint="raise --timeout or sync more often")
    return make_strategy(args.strategy or "grad",
                         **{name: getattr(args, name) for name in STRATEGY_FLAGS})


def _model_fn(args):
    return resolve(args.model, "--model") if args.model else demo.model


def _optimizer_fn(args):
    name = args.optimizer or "sgd"
    lr = args.lr if args.lr is not None else DEFAULT_LR[name]
    if name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=lr)
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)


def _datasets(args):
    """(train, eval or None) from ``--data`` (or the demo)."""
    factory = resolve(args.data, "--data") if args.data else demo.data
    made = factory()
    if isinstance(made, (tuple, list)):
        if len(made) != 2:
            raise ConfigError(f"--data {args.data}: the factory returned {len(made)} items",
                              hint="return a Dataset, or a (train, eval) pair")
        train, evaluation = made
    else:
        train, evaluation = made, None
    try:
        _, target = train[0]
    except Exception as exc:  # noqa: BLE001
        # broad on purpose: whatever reading item 0 raises (not indexable, empty, not a
        # pair, the dataset's own error) is bad --data input, reported as one line and
        # exit 2 before this rank connects; the cause stays in the message
        cause = str(exc).splitlines()[0] if str(exc) else ""
        raise ConfigError(f"--data {args.data or 'demo'}: items must be (input, target) pairs "
                          f"(item 0: {type(exc).__name__}{': ' + cause if cause else ''})",
                          hint="return a Dataset whose items are (input, target)") from None
    return train, evaluation, target


def _is_integer_target(target) -> bool:
    if isinstance(target, torch.Tensor):
        return not target.is_floating_point() and not target.is_complex() \
            and target.dtype != torch.bool
    return isinstance(target, int) and not isinstance(target, bool)


def _loss(args, target):
    """(loss_fn, classification?) from ``--loss`` and the first target."""
    name = args.loss
    integer = _is_integer_target(target)
    if name is None:
        name = "cross_entropy" if integer else "mse"
    if name in LOSSES:
        return LOSSES[name], name == "cross_entropy"
    if ":" in name:
        return resolve(name, "--loss"), integer
    raise ConfigError(f"unknown --loss {name!r}",
                      hint="use cross_entropy, mse or MODULE:FUNCTION")


def make_eval(dataset, loss_fn, classification: bool, device):
    """An ``eval_fn``: mean loss (and accuracy for classification) over ``dataset``."""
    def evaluate(model: torch.nn.Module) -> dict:
        loader = torch.utils.data.DataLoader(dataset, batch_size=EVAL_BATCH)
        seen, correct, loss_sum = 0, 0, 0.0
        for x, y in loader:
            x = x.to(device) if isinstance(x, torch.Tensor) else x
            y = y.to(device)
            out = model(x)
            loss_sum += float(loss_fn(out, y)) * len(y)
            if classification:
                correct += int((out.argmax(dim=-1) == y).sum())
            seen += len(y)
        return {"loss": loss_sum / seen if seen else None,
                "accuracy": correct / seen if classification and seen else None}
    return evaluate


def build_trainer(args) -> Trainer:
    """The Trainer (``ElasticTrainer`` with ``--elastic``) for these flags; everything
    that can fail on bad input fails here."""
    strategy = _strategy(args)
    train, evaluation, target = _datasets(args)
    loss_fn, classification = _loss(args, target)
    epochs = args.epochs if args.epochs or args.steps else DEFAULT_EPOCHS
    common = dict(batch_size=args.batch_size or DEFAULT_BATCH_SIZE, epochs=epochs,
                  steps=args.steps, strategy=strategy, seed=args.seed or 0,
                  progress=not args.no_progress, storage_prices=args.storage_prices,
                  metrics_digest=args.metrics_digest)
    if args.elastic:
        trainer = ElasticTrainer(
            _model_fn(args), _optimizer_fn(args), loss_fn, train, **common,
            min_ranks=args.min_ranks or 1, publish_every=args.publish_every,
            publish_every_seconds=(PUBLISH_EVERY_SECONDS if args.publish_every_seconds is None
                                   else args.publish_every_seconds),
            metrics_path=metrics_path_for(args.metrics),
            tensorboard_dir=metrics_path_for(args.tensorboard),
            device=resolve_device(args.device, int(os.environ.get("LOCAL_RANK", 0) or 0)))
    else:
        trainer = Trainer(
            _model_fn(args), _optimizer_fn(args), loss_fn, train, **common,
            metrics_path=args.metrics, tensorboard_dir=args.tensorboard,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every, resume=args.resume,
            keep_checkpoints=args.keep_checkpoints or 2,
            storage_options=_checkpoint_options(args), device=args.device)
    if evaluation is not None:
        trainer.eval_fn = make_eval(evaluation, loss_fn, classification, trainer.device)
    return trainer


def _checkpoint_options(args) -> dict | None:
    """The sync's fsspec ``storage_options`` (credentials, endpoint) also serve an object
    store checkpoint directory; a local directory takes none."""
    from ferrosync.storage.engines import split_url

    options = args.sync_options.get("storage_options")
    if options and args.checkpoint_dir and split_url(args.checkpoint_dir)[0] not in (
            "file", "local"):
        return options
    return None


# -- checks the launcher makes before starting any rank ------------------------------------

def check_sync_options(url: str, options: dict, *, elastic: bool = False) -> None:
    """``--sync-option``s against the options of the backend that will serve ``url``
    (through the backend's own ``check_options``, the parser
    ``connect`` uses): a ConfigError naming the first bad one, before any rank starts."""
    from ferrosync.core.registry import backend_for

    if elastic:
        from ferrosync.elastic import ElasticSync

        ElasticSync.check_options(options)
    else:
        backend_for(url, options).check_options(options)


def check_sync_url(url: str, options: dict) -> None:
    """Reachability of a storage sync URL (torch URLs are checked by ranks); writes a
    probe, so it comes after the read-only checks."""
    from ferrosync.core.registry import served_by_storage
    from ferrosync.storage.engines import open_storage

    if not served_by_storage(url):
        return
    # the first contact with an object store is bounded: a dead endpoint is one line
    probe_location(open_storage(url, options.get("storage_options"), timeout=60.0),
                   what="sync URL")


def preflight(args, world_size: int) -> None:
    """What every rank would reject before connecting, checked once by the launcher."""
    strategy = _strategy(args)
    model_fn = _model_fn(args)
    resolve_device(args.device)
    _check_strategy_fits(strategy, model_fn, args.model or "ferrosync.train.demo:model")
    if args.tensorboard:
        require_tensorboard()
    if args.metrics and not args.elastic:  # a member writes its own name (metrics_path_for)
        probe_output_file(args.metrics)
    if args.data:
        resolve(args.data, "--data")
    if args.loss:
        _loss(args, None)  # resolves MODULE:FUNCTION, rejects unknown names
    if args.checkpoint_dir:
        store = Checkpoints(args.checkpoint_dir, _checkpoint_options(args))
        if args.resume:
            meta = store.require_latest()
            torch.manual_seed(args.seed or 0)
            check_compatible(meta, model=model_fn(), world_size=world_size,
                             strategy=strategy.name, url=store.url)
            store.verify(meta, world_size)  # a damaged file: exit 2 before any rank starts
        else:
            refuse_used_checkpoint_dir(store)
        store.probe()


def refuse_used_checkpoint_dir(store: Checkpoints) -> None:
    """Without ``--resume``, a ``--checkpoint-dir`` that holds a run's checkpoints is
    bad input (``ConfigError``, exit 2): a new run would point its ``latest.json`` at
    its own first checkpoint and prune the old run's, and rewrite ``--metrics`` from
    step 1, silently. Checked by the launcher, and by a rank started without it."""
    meta = store.latest()
    if meta is not None:
        raise ConfigError(
            f"--checkpoint-dir {store.url} holds another run's checkpoints (the latest at "
            f"step {meta['step']}); starting here would replace them",
            hint="pass --resume to continue that run, or choose an empty directory")


def _restarted() -> bool:
    """This rank is torchrun's restart of a failed attempt (``--max-restarts``), run with
    the first attempt's flags: the checkpoints there may be that attempt's own, which it
    overwrites as it always did (pass ``--resume`` to continue them instead)."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0").strip()
    return count.isdigit() and int(count) > 0


def resume_note(args) -> str | None:
    """For a run stopped early (Ctrl-C, SIGTERM): where it can continue from, when its
    ``--checkpoint-dir`` holds a checkpoint; None otherwise (or when it cannot be read)."""
    if not args.checkpoint_dir or args.elastic:
        return None
    try:
        meta = Checkpoints(args.checkpoint_dir, _checkpoint_options(args)).latest()
    except (ConfigError, OSError):  # nothing to add to the stop: say nothing
        return None
    if meta is None:
        return None
    return (f"the latest checkpoint is step {meta['step']} in {args.checkpoint_dir}: run "
            "the same command with --resume to continue from it")


def _check_strategy_fits(strategy, model_fn, spec: str) -> None:
    """The ``--model`` factory (``spec``) and the strategy's settings against the model
    (``--fragments`` against its parameter tensors), with the model built on the meta
    device: no memory, no weights. A factory that raises its own error is bad input; one
    that cannot build there (it loads weights, moves itself to a device) is left to the
    ranks, which run the same check in ``Strategy.attach``."""
    try:
        with torch.device("meta"):
            model = model_fn()
    except Exception as exc:  # noqa: BLE001 - the factory's own code failed
        if re.search(r"\bmeta\b", str(exc), re.IGNORECASE):  # "meta tensor", "'Meta' backend"
            # it cannot build there (it loads weights, moves itself to a device, reads
            # a value): the ranks build it for real and check it then
            return
        # it raised for a reason of its own (a missing file, a bad setting): every rank
        # would raise the same; building one on the CPU here would cost the memory
        # (and, for a factory that moves itself to a GPU, a device context) of a rank
        cause = " ".join(str(exc).split())
        raise ConfigError(f"--model {spec}: the factory raised {type(exc).__name__}"
                          f"{': ' + cause if cause else ''} (called once by the launcher, "
                          "on the meta device)", hint="fix the factory; run it in Python "
                          "to see the traceback") from None
    if not isinstance(model, torch.nn.Module):  # every rank would refuse it (Trainer)
        raise ConfigError(f"--model must return a torch.nn.Module, got "
                          f"{type(model).__name__}", hint="return the model itself")
    strategy.check_model(model)


# -- one rank ------------------------------------------------------------------------------

def _stop_on_sigterm() -> None:
    # The launcher stops ranks with SIGTERM. As an exception it unwinds `with connect()`
    # (peers learn at once through the abort marker) and removes temporary files
    # instead of killing the process mid-write.
    def handler(signum, frame):
        raise SystemExit(SIGTERM_EXIT)

    signal.signal(signal.SIGTERM, handler)


class _LeftAtOnce(SystemExit):
    """An elastic member stopped by SIGTERM without finishing a round (``why``)."""

    def __init__(self, why: str) -> None:
        super().__init__(SIGTERM_EXIT)
        self.why = why


def _leave_on_sigterm(trainer: ElasticTrainer) -> None:
    """SIGTERM (a preemption notice, the launcher's stop) asks an elastic member to
    leave: it finishes its round, publishes the state if it is rank 0, and leaves
    (``MemberLeft``), within ``LEAVE_GRACE_S``. Past the grace, at a second SIGTERM,
    or while it is not training (joining), it leaves at once."""
    def at_once(why):
        def handler(signum, frame):
            raise _LeftAtOnce(why)
        return handler

    def asked(signum, frame):
        if not trainer.request_leave():
            raise _LeftAtOnce("no round to finish: it was joining, or the job waits below "
                              "--min-ranks after others left")
        signal.signal(signal.SIGTERM, at_once("a second SIGTERM"))
        signal.signal(signal.SIGALRM, at_once(f"its round did not end within {LEAVE_GRACE_S:g} s"))
        signal.setitimer(signal.ITIMER_REAL, LEAVE_GRACE_S)

    signal.signal(signal.SIGTERM, asked)


def show_elastic_progress() -> logging.Handler:
    """The elastic layer's progress lines (logger ``ferrosync.elastic``, INFO: "waiting
    for members: 1 here, 2 needed ...", at the start of a wait and every 30 s) on
    stderr, one line each: what a member started by hand is waiting for. Once per
    process; returns the handler."""
    logger = logging.getLogger("ferrosync.elastic")
    for handler in logger.handlers:
        if getattr(handler, "ferrosync_train", False):
            return handler
    handler = logging.StreamHandler()  # sys.stderr
    handler.ferrosync_train = True
    handler.setFormatter(logging.Formatter("ferrosync.elastic: %(message)s"))  # submodules too
    handler.setLevel(logging.INFO)
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    return handler


def _ignore_sigterm_while_exiting() -> None:
    # Once the rank's work is over it is already on its way out (reporting its error,
    # closing syncs at exit). A SIGTERM then (the launcher stopping the ranks a failed
    # peer left) would raise SystemExit inside an atexit callback or a finalizer, which
    # Python prints as a traceback and otherwise ignores; there is nothing left to
    # interrupt, and the launcher's SIGKILL after its grace period still ends a hang.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def run_rank(args) -> int:
    """Run this process's rank; returns the exit code (ConfigError propagates: exit 2)."""
    _stop_on_sigterm()
    try:
        return _run_rank(args)
    finally:
        _ignore_sigterm_while_exiting()


def _run_rank(args) -> int:
    url = args.sync or os.environ.get(ENV_URL)
    if not url:
        raise ConfigError("--sync URL is required without --nproc (or set FERROSYNC_URL)",
                          hint="for a run on this machine use --nproc N")
    # a process started by hand shares the host's cores with its siblings (the
    # launcher's ranks have OMP_NUM_THREADS=1 and are left alone)
    share = share_threads()
    if args.script is not None:
        return run_script(args, url)
    if args.checkpoint_dir and not args.resume and args.nproc is None and not _restarted():
        # a rank started without the launcher (srun, torchrun), before it connects: every
        # rank reads the same latest.json, so all refuse alike
        refuse_used_checkpoint_dir(Checkpoints(args.checkpoint_dir,
                                                   _checkpoint_options(args)))
    trainer = build_trainer(args)
    if share is not None:
        trainer.step_hooks.append(share.adjust)
    if args.elastic:
        return run_member(trainer, args, url)
    with connect(url, timeout=args.timeout or 300.0, **args.sync_options) as sync:
        summary = trainer.fit(sync)
    return 0 if summary["ranks_agree"] else 1


def run_member(trainer: ElasticTrainer, args, url: str) -> int:
    """One member of the elastic job at ``url``: join (or found), train to the job's
    end, report. A newcomer whose state never came, or a member the others dropped
    (it was paused or starved past ``heartbeat_timeout``), joins again as a new member;
    attempts that make no progress for ``--timeout`` end in ``SyncTimeout``. SIGTERM:
    it leaves after its round (``_leave_on_sigterm``), says so, exits ``SIGTERM_EXIT``."""
    show_elastic_progress()
    _leave_on_sigterm(trainer)
    try:
        return _membership(trainer, args, url)
    except _LeftAtOnce as exc:
        print(f"ferrosync.train: SIGTERM: the member left the job at once ({exc.why}); "
              "it published nothing", file=sys.stderr, flush=True)
        raise


def _membership(trainer: ElasticTrainer, args, url: str) -> int:
    timeout = args.timeout or 300.0
    deadline = time.monotonic() + timeout
    while True:
        try:
            sync = connect(url, elastic=True, min_ranks=args.min_ranks or 1,
                           max_ranks=args.max_ranks, timeout=timeout,
                           spec=trainer.job_spec(), **args.sync_options)
        except JobEnded:  # it ended before this member got in: report its model
            summary = trainer.report_ended(peek_state(url, args.sync_options, timeout), url)
            break
        left = None
        with sync:
            try:
                summary = trainer.fit(sync)
                break
            except MemberLeft as exc:  # not an error: the close says "left"
                signal.setitimer(signal.ITIMER_REAL, 0)  # the grace is over
                left = exc
            except (RejoinNeeded, MemberDropped) as exc:
                if trainer.joined_at is not None and trainer.step > trainer.joined_at:
                    deadline = time.monotonic() + timeout  # it trained: a fresh bound
                if runtime.passed(deadline):
                    raise SyncTimeout(f"could not stay in the elastic job: {exc}", path=url,
                                      hint="check that its members are running") from exc
                print(f"ferrosync.train: member {sync.member_id}: {exc}; joining again",
                      file=sys.stderr, flush=True)
        if left is not None:
            print(f"ferrosync.train: SIGTERM: {left} (exit code {SIGTERM_EXIT})",
                  file=sys.stderr, flush=True)
            return SIGTERM_EXIT
    signal.setitimer(signal.ITIMER_REAL, 0)  # a SIGTERM at the end: the job is done
    return 0 if summary["ranks_agree"] else 1


def run_script(args, url: str) -> int:
    """Run SCRIPT as ``__main__`` in this process, like ``python SCRIPT SCRIPT_ARGS``."""
    os.environ[ENV_URL] = url
    path = os.path.abspath(args.script)
    sys.argv = [args.script, *args.script_args]
    sys.path.insert(0, os.path.dirname(path))
    try:
        runpy.run_path(path, run_name="__main__")
    except ConfigError as exc:
        # re-raised for main's one-line exit 2, which an excepthook never sees: tell
        # peers now, or they wait out a timeout
        fail_open_syncs(exc)
        raise
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - reported like `python SCRIPT` would
        fail_open_syncs(exc)
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != path:
            tb = tb.tb_next  # start at the script's frame: the launcher's are noise
        traceback.print_exception(type(exc), exc, tb or exc.__traceback__)
        return 1
    return 0
