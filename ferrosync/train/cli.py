"""Command-line flags of ``python -m ferrosync.train`` and what they build.

The same parsing serves the launcher (``--nproc N``) and every rank, so a rank
started by the launcher, by ``torchrun`` or by ``srun`` sees identical settings.
Bad input becomes a ``ConfigError`` (one line, exit code 2), never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys

from ferrosync.core.validate import cli_number
from ferrosync.errors import ConfigError
from ferrosync.strategies import STRATEGIES, DiLoCo, LocalSGD, known_settings
from ferrosync.strategies.diloco import (
    OUTER_LR,
    OUTER_MOMENTUM,
    SPARSE_OUTER_LR,
    SPARSE_OUTER_MOMENTUM,
)
from ferrosync.strategies.streaming import FRAGMENTS, OVERLAP_STEPS
from ferrosync.train.elastic import PUBLISH_EVERY_SECONDS

PROG = "python -m ferrosync.train"
DEFAULT_EPOCHS = 10
DEFAULT_BATCH_SIZE = 64
DEFAULT_LR = {"sgd": 0.05, "adamw": 1e-3}
#: strategy settings: flag dest -> make_strategy keyword (the same names); the registry
#: declares them, and each needs its flag in ``_strategy_flags``
STRATEGY_FLAGS = known_settings()
#: flags that configure the built-in trainer, meaningless with a SCRIPT
TRAINER_FLAGS = ("steps", "epochs", "batch_size", "lr", "seed", "metrics", "checkpoint_dir",
                 "checkpoint_every", "resume", "strategy", "model", "data", "loss",
                 "optimizer", "device", "keep_checkpoints", "sync_options", "no_progress",
                 "tensorboard", "metrics_digest",
                 "timeout", "storage_prices", "publish_every", "publish_every_seconds",
                 *STRATEGY_FLAGS)

EPILOG = f"""\
examples:
  {PROG} --nproc 2                              demo: 2 local ranks, temporary sync dir
  {PROG} --nproc 4 --sync /mnt/nfs/run1 --checkpoint-dir /mnt/nfs/run1/ckpt \\
        --checkpoint-every 200 --metrics metrics.jsonl
  {PROG} --nproc 2 --model mypkg.nets:build --data mypkg.data:load
  {PROG} --nproc 4 --sync s3://bucket/run1 --strategy diloco --sync-every 50
  {PROG} --nproc 4 --strategy local-sgd --sync-every-seconds 5   uneven ranks
  {PROG} --nproc 2 my_script.py --my-flag 1     run your own script on every rank
  srun -N2 --ntasks-per-node=4 {PROG} --sync s3://bucket/run1   one rank per task

exit codes: 0 every rank succeeded; 1 a rank failed (or ranks ended with different
parameters); 2 bad input (one line, nothing written); 130 Ctrl-C; 143 stopped by
SIGTERM (a rank at once; an --elastic member after its round, having published the
state if it was rank 0, with a line saying it left)
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2 (via main), not usage + text
        raise ConfigError(message, hint=f"see {PROG} --help")


# the same bounds as the Trainer/strategy arguments they feed (ferrosync.core.validate)
_positive = cli_number(positive=True)
_non_negative = cli_number(minimum=0)


def _option(text: str) -> tuple[str, object]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(raw)
    except ValueError:
        return key, raw  # a bare string such as bfloat16


def build_parser() -> argparse.ArgumentParser:
    """Every flag of ``python -m ferrosync.train``, in five help groups."""
    p = _Parser(
        prog=PROG,
        description="Data-parallel training through shared storage: launch local ranks, "
        "run the built-in trainer (or your SCRIPT) on each, report how the ranks synced.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for add_group in (_launching_flags, _elastic_flags, _trainer_flags, _checkpoint_flags,
                      _strategy_flags):
        add_group(p)
    return p


def _launching_flags(p: argparse.ArgumentParser) -> None:
    """Where ranks run and meet, or the SCRIPT they run instead."""
    g = p.add_argument_group("launching")
    g.add_argument("--nproc", type=cli_number(int, minimum=1), metavar="N",
                   help="start N local ranks (like torchrun --nproc-per-node); without it, "
                   "run one rank whose identity comes from the environment "
                   "(RANK/WORLD_SIZE from torchrun, or SLURM_PROCID/SLURM_NTASKS)")
    g.add_argument("--sync", metavar="URL",
                   help="where ranks meet: a shared directory, file://, s3://bucket/prefix, "
                   "... (default with --nproc: a fresh temporary directory; without "
                   "--nproc: $FERROSYNC_URL)")
    g.add_argument("--sync-option", dest="sync_options", action="append", type=_option,
                   default=None, metavar="KEY=VALUE",
                   help="option for ferrosync.connect, e.g. wire_dtype=bfloat16 or "
                   "heartbeat_timeout=30 (VALUE is JSON, else a string); repeatable")
    g.add_argument("--local", choices=["gloo", "nccl", "auto"],
                   help="two-level sync: ranks of a node reduce over gloo/NCCL and only one "
                   "leader per node uses the --sync storage (node identity from "
                   "LOCAL_RANK/LOCAL_WORLD_SIZE or SLURM_LOCALID/SLURM_NTASKS_PER_NODE)")
    g.add_argument("--nnodes-sim", type=cli_number(int, minimum=1), metavar="K",
                   help="with --nproc: simulate K nodes of nproc/K ranks each on this "
                   "machine (sets LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK per rank; "
                   "for testing --local)")
    g.add_argument("--timeout", type=_positive, metavar="S",
                   help="seconds any single wait for peers may last (default 300)")
    g.add_argument("--verbose", action="store_true",
                   help="a rank that fails prints the full traceback before its one-line "
                   "error (without it: the one line only)")
    g.add_argument("script", nargs="?", metavar="SCRIPT",
                   help="a Python script to run on every rank instead of the built-in "
                   "trainer; it calls ferrosync.connect() with no arguments")
    g.add_argument("script_args", nargs=argparse.REMAINDER, metavar="SCRIPT_ARGS",
                   help="arguments passed to SCRIPT")


def _elastic_flags(p: argparse.ArgumentParser) -> None:
    """Members that join and leave a running job (docs/elastic.md#the-trainer)."""
    g = p.add_argument_group("elastic jobs")
    g.add_argument("--elastic", action="store_true",
                   help="this process (each of --nproc) is one member of the elastic job at "
                   "--sync, started whenever it is started: it joins the running job (or "
                   "starts it, or resumes it from the store), members may die or leave, and "
                   "the launcher does not stop siblings when one fails; --steps counts the "
                   "job's global steps; grad, local-sgd or diloco")
    g.add_argument("--min-ranks", type=cli_number(int, minimum=1), metavar="M",
                   help="with --elastic: every round waits for at least M members (default 1)")
    g.add_argument("--max-ranks", type=cli_number(int, minimum=1), metavar="N",
                   help="with --elastic: admit at most N members; later ones wait")
    g.add_argument("--publish-every", type=cli_number(int, minimum=1), metavar="K",
                   help="with --elastic: rank 0 also publishes the job's state every K steps "
                   "(what the job resumes from if every member is lost; it is always "
                   "published when members join, when rank 0 leaves and at the end)")
    g.add_argument("--publish-every-seconds", type=_non_negative, metavar="S",
                   help="with --elastic: rank 0 also publishes at the first round boundary "
                   f"S seconds after its last publish (default {PUBLISH_EVERY_SECONDS:g}; 0 = "
                   "off): what a job that loses every member at once (SIGKILL) retrains at "
                   "most")


def _trainer_flags(p: argparse.ArgumentParser) -> None:
    """The built-in trainer: length, model, data, optimizer, output."""
    g = p.add_argument_group("built-in trainer")
    g.add_argument("--steps", type=cli_number(int, minimum=1), metavar="N",
                   help="optimizer steps to run (with --epochs too: whichever ends first)")
    g.add_argument("--epochs", type=cli_number(int, minimum=1), metavar="N",
                   help=f"passes over the data (default {DEFAULT_EPOCHS} when --steps is "
                   "not given)")
    g.add_argument("--batch-size", type=cli_number(int, minimum=1), metavar="B",
                   help=f"samples per rank per step (default {DEFAULT_BATCH_SIZE})")
    g.add_argument("--lr", type=_positive, metavar="LR",
                   help="learning rate (default 0.05 for sgd, 0.001 for adamw)")
    g.add_argument("--optimizer", choices=sorted(DEFAULT_LR),
                   help="sgd (momentum 0.9, the default) or adamw")
    g.add_argument("--seed", type=int, metavar="S",
                   help="seed for initial weights, data order and per-rank RNGs (default 0)")
    g.add_argument("--model", metavar="MODULE:FACTORY",
                   help="FACTORY() returns a torch.nn.Module (default: the demo MLP, "
                   "ferrosync.train.demo:model)")
    g.add_argument("--data", metavar="MODULE:FACTORY",
                   help="FACTORY() returns a Dataset of (input, target) pairs, or a "
                   "(train, eval) pair of them (default: the synthetic demo set)")
    g.add_argument("--loss", metavar="NAME",
                   help="cross_entropy, mse, or MODULE:FUNCTION(output, target) (default: "
                   "cross_entropy for integer targets, mse otherwise)")
    g.add_argument("--device", metavar="DEV",
                   help="torch device (default cuda:LOCAL_RANK when CUDA is available, else cpu)")
    g.add_argument("--metrics", metavar="PATH",
                   help="rank 0 appends one JSON line per optimizer step to this local file")
    g.add_argument("--metrics-digest", action="store_true",
                   help="add param_digest (SHA-256 of the model's parameters and buffers) "
                   "to the metrics line of every step that synced, and with --elastic "
                   "resumed_digest (the model a member starts from) to its first line: "
                   "ranks and members that finished the same round must agree; costs "
                   "one pass over the model per sync")
    g.add_argument("--tensorboard", metavar="DIR",
                   help="rank 0 also writes TensorBoard scalars per optimizer step to DIR "
                   "(loss, batch accuracy, lr, compute and sync time, bytes, requests; "
                   "members with --elastic; eval loss and accuracy at the end); needs "
                   "pip install 'ferrosync[tensorboard]'")
    g.add_argument("--no-progress", action="store_true",
                   help="no progress bar on rank 0")
    g.add_argument("--storage-prices", metavar="KIND=USD,...",
                   help="object-store request prices in USD per 1,000 requests for the "
                   "summary's cost per hour (default: the store's list prices, "
                   "docs/operations.md; S3 Standard's, put=0.005,get=0.0004,delete=0,"
                   "list=0.005, for a store not listed there)")


def _checkpoint_flags(p: argparse.ArgumentParser) -> None:
    """Where checkpoints go, how often, and resuming."""
    g = p.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-dir", metavar="URL",
                   help="directory or fsspec URL (s3://...) for checkpoints, visible to "
                   "every rank; a final checkpoint is written at the end")
    g.add_argument("--checkpoint-every", type=cli_number(int, minimum=1), metavar="N",
                   help="also write a checkpoint every N optimizer steps")
    g.add_argument("--keep-checkpoints", type=cli_number(int, minimum=1), metavar="K",
                   help="keep the newest K checkpoints (default 2)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir "
                   "(the same model and number of ranks)")


def _strategy_flags(p: argparse.ArgumentParser) -> None:
    """``make_strategy`` and its settings (``STRATEGY_FLAGS``)."""
    g = p.add_argument_group("synchronisation strategy")
    g.add_argument("--strategy", choices=list(STRATEGIES),
                   help="grad: average gradients every step (the default); local-sgd: "
                   "each rank steps alone, parameters are averaged every H steps; "
                   "diloco: like local-sgd, but an outer Nesterov step is applied to the "
                   "averaged change; streaming-diloco: diloco one fragment of the model "
                   "at a time, each exchange overlapped with the next steps")
    g.add_argument("--sync-every", type=cli_number(int, minimum=1), metavar="H",
                   help="local-sgd/diloco/streaming-diloco: synchronise every H optimizer "
                   f"steps (default {LocalSGD.default_sync_every} for local-sgd, "
                   f"{DiLoCo.default_sync_every} for diloco; streaming-diloco syncs each "
                   "fragment every H steps, staggered)")
    g.add_argument("--sync-every-seconds", type=_positive, metavar="S",
                   help="local-sgd/diloco: synchronise every S seconds instead, so faster "
                   "ranks train more batches; the run is then a budget of samples "
                   "(--steps x ranks batches) shared by speed")
    g.add_argument("--gamma", type=_non_negative, metavar="G",
                   help="local-sgd/diloco/streaming-diloco: weigh each rank by (batches "
                   "since the last sync) ** G (default 1; 0 = every rank that trained "
                   "counts equally)")
    g.add_argument("--outer-lr", type=_positive, metavar="LR",
                   help=f"diloco/streaming-diloco: outer learning rate (default {OUTER_LR}; "
                   f"{SPARSE_OUTER_LR} with --sync-option wire_dtype=topk)")
    g.add_argument("--outer-momentum", type=_non_negative, metavar="M",
                   help="diloco/streaming-diloco: outer Nesterov momentum (default "
                   f"{OUTER_MOMENTUM}, {SPARSE_OUTER_MOMENTUM:g} with wire_dtype=topk; 0 = plain "
                   "SGD)")
    g.add_argument("--outer-device", choices=["cpu"],
                   help="diloco/streaming-diloco: keep the global parameters and outer "
                   "state on the CPU (default: the training device)")
    g.add_argument("--fragments", type=cli_number(int, minimum=1), metavar="F",
                   help="streaming-diloco: split the parameters into F contiguous parts of "
                   f"about equal size, synced at staggered steps (default {FRAGMENTS})")
    g.add_argument("--overlap-steps", type=cli_number(int, minimum=0), metavar="T",
                   help="streaming-diloco: apply each fragment's exchange T inner steps after "
                   f"starting it, overlapping it with compute (default {OVERLAP_STEPS}; 0 = "
                   "wait at once; below H // F)")
    g.add_argument("--alpha", type=cli_number(minimum=0), metavar="A",
                   help="streaming-diloco: when a merge lands keep A of the local fragment: "
                   "A*local + (1-A)*global (default 0 = replace; below 1)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse and cross-check the flags; raises ConfigError on bad input."""
    args = build_parser().parse_args(argv)
    if args.script is not None:
        given = [f"--{name.replace('_', '-')}" for name in TRAINER_FLAGS
                 if getattr(args, name) not in (None, False)]
        if given:
            raise ConfigError(
                f"{', '.join(given)} configure(s) the built-in trainer, not SCRIPT",
                hint="put your script's own flags after SCRIPT",
            )
        if not os.path.isfile(args.script):
            raise ConfigError(f"SCRIPT {args.script!r} does not exist",
                              hint="give the path of a Python file (or no SCRIPT for the "
                              "built-in trainer)")
    _check_elastic(args)
    if args.checkpoint_every and not args.checkpoint_dir:
        raise ConfigError("--checkpoint-every needs --checkpoint-dir")
    if args.resume and not args.checkpoint_dir:
        raise ConfigError("--resume needs --checkpoint-dir",
                          hint="give the checkpoint directory of the run to continue")
    args.sync_options = dict(args.sync_options or [])
    if args.local is not None:
        args.sync_options["local"] = args.local
    if args.nnodes_sim is not None:
        if args.nproc is None:
            raise ConfigError("--nnodes-sim needs --nproc", hint="e.g. --nproc 4 --nnodes-sim 2")
        if args.nproc % args.nnodes_sim:
            raise ConfigError(f"--nproc {args.nproc} is not a multiple of --nnodes-sim "
                              f"{args.nnodes_sim}", hint="every simulated node needs the same "
                              "number of ranks")
    return args


def _check_elastic(args) -> None:
    """The flags that only make sense with --elastic, and those that cannot go with it."""
    if not args.elastic:
        given = [f for f, v in (("--min-ranks", args.min_ranks), ("--max-ranks", args.max_ranks),
                                ("--publish-every", args.publish_every),
                                ("--publish-every-seconds", args.publish_every_seconds))
                 if v is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} need(s) --elastic")
        return
    if args.min_ranks and args.max_ranks and args.max_ranks < args.min_ranks:
        raise ConfigError(f"--max-ranks {args.max_ranks} is below --min-ranks {args.min_ranks}")
    refused = [(args.checkpoint_dir, "--checkpoint-dir", "the job's state is published on "
                "--sync and a job that lost every member resumes from it by itself"),
               (args.resume, "--resume", "a member always continues the job at --sync"),
               (args.local, "--local", "members are not grouped by node"),
               (args.sync_every_seconds, "--sync-every-seconds",
                "members merge every --sync-every H global steps")]
    for value, flag, why in refused:
        if value:
            raise ConfigError(f"{flag} does not go with --elastic: {why}",
                              hint=f"drop {flag}")
    if args.strategy not in (None, "grad", "local-sgd", "diloco"):
        raise ConfigError(f"--elastic runs --strategy grad, local-sgd or diloco, not "
                          f"{args.strategy}", hint="pick one of those")


#: how the trainer calls what each flag names: FACTORY() for a model or data set,
#: FUNCTION(output, target) for a loss
CALLED_WITH = {"--model": ("no arguments", 0), "--data": ("no arguments", 0),
               "--loss": ("(output, target)", 2)}


def resolve(spec: str, flag: str):
    """``module:attr`` (attr may be dotted) -> the callable it names, once its signature
    is known to take the arguments the trainer will pass (``CALLED_WITH``): a
    ``--model torch.nn:Linear`` is one line and exit 2 here, in the launcher, not a
    TypeError on every rank."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{flag} {spec!r} is not MODULE:FACTORY",
                          hint=f"e.g. {flag} mypkg.models:build")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: the current directory imports
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{flag} {spec}: cannot import {module_name!r} ({exc})",
                          hint="make it importable from the current directory or "
                          "PYTHONPATH") from None
    except Exception as exc:  # noqa: BLE001 - the module's own code failed on import
        raise ConfigError(f"{flag} {spec}: importing {module_name!r} failed "
                          f"({type(exc).__name__}: {' '.join(str(exc).split())})",
                          hint="fix the module (run `python -c 'import "
                          f"{module_name}'` to see the traceback)") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{flag} {spec}: {module_name!r} has no attribute {attr!r}",
                              hint="check the name after the colon")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{flag} {spec}: {attr!r} is not callable")
    _check_call(obj, spec, flag)
    return obj


def _check_call(obj, spec: str, flag: str) -> None:
    """``obj`` accepts the call the trainer makes (a callable without a signature,
    some builtins, is left to the ranks)."""
    what, count = CALLED_WITH.get(flag, ("no arguments", 0))
    if count and inspect.isclass(obj):  # torch.nn:MSELoss would build a module per step
        raise ConfigError(f"{flag} {spec} is a class, and the trainer calls it as "
                          f"FUNCTION{what}", hint="name a function, e.g. "
                          "torch.nn.functional:mse_loss")
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*[None] * count)
    except TypeError as exc:
        example = ("def build(): return torch.nn.Linear(10, 4)" if count == 0 else
                   "def loss(output, target): ...")
        raise ConfigError(f"{flag} {spec} cannot be called with {what} ({exc})",
                          hint=f"name a function the trainer can call that way, e.g. "
                          f"{example}") from None
