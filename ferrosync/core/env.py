"""Who am I? Rank, world size and local rank from arguments or the environment.

Precedence (highest first): explicit arguments, torchrun's ``RANK``/``WORLD_SIZE``
(and ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``), SLURM's ``SLURM_PROCID``/``SLURM_NTASKS``
(and ``SLURM_LOCALID``/``SLURM_NTASKS_PER_NODE``). With nothing set, a process is
rank 0 of a world of 1, so a script runs unchanged on a laptop.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from typing import Mapping

from ferrosync.core.validate import error as value_error
from ferrosync.core.validate import integer
from ferrosync.errors import ConfigError

ENV_URL = "FERROSYNC_URL"
ENV_SECRET = "FERROSYNC_SECRET"
ENV_RANK = "RANK"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
ENV_SLURM_RANK = "SLURM_PROCID"
ENV_SLURM_WORLD_SIZE = "SLURM_NTASKS"
ENV_SLURM_LOCAL_RANK = "SLURM_LOCALID"
ENV_SLURM_LOCAL_WORLD_SIZE = "SLURM_NTASKS_PER_NODE"
ENV_JOB = "FERROSYNC_JOB"
ENV_SLURM_JOB = "SLURM_JOB_ID"
ENV_TORCHELASTIC_RUN = "TORCHELASTIC_RUN_ID"

#: how a job id may be spelled: it names a folder/prefix on the shared storage (a
#: rendezvous namespace: ``storage/names.py`` builds and parses those names with it)
JOB_ID = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
_JOB_ALPHABET = re.compile(JOB_ID)


@dataclass(frozen=True)
class Identity:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    source: str  # "arguments", "torchrun", "slurm" or "default": for error messages


def _int_var(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw.strip())
    except ValueError:
        # SLURM_NTASKS_PER_NODE can be "2(x3)" on heterogeneous allocations
        head = raw.strip().split("(")[0].split(",")[0]
        if head.isdigit():
            return int(head)
        raise value_error(f"environment variable {name}", "an integer", raw,
                          hint=f"unset {name} or set it to this process's value") from None


def discover(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> Identity:
    """Resolve this process's identity; validates ranges, does no I/O."""
    env = os.environ if env is None else env
    source = "arguments"
    if rank is None or world_size is None:
        for r_name, w_name, src in (
            (ENV_RANK, ENV_WORLD_SIZE, "torchrun"),
            (ENV_SLURM_RANK, ENV_SLURM_WORLD_SIZE, "slurm"),
        ):
            env_rank, env_world = _int_var(env, r_name), _int_var(env, w_name)
            if env_rank is None and env_world is None:
                continue
            if env_rank is None or env_world is None:
                missing = r_name if env_rank is None else w_name
                raise ConfigError(
                    f"{r_name if env_rank is not None else w_name} is set but {missing} is not",
                    hint=f"set both {r_name} and {w_name}, or pass rank= and world_size=",
                )
            rank = env_rank if rank is None else rank
            world_size = env_world if world_size is None else world_size
            source = src
            break
        else:
            source = "default" if rank is None and world_size is None else "arguments"
            rank = 0 if rank is None else rank
            world_size = 1 if world_size is None else world_size

    # the type here, the ranges below: their messages name where the values came from
    integer("rank", rank)
    integer("world_size", world_size)
    if world_size < 1:
        raise value_error("world_size", ">= 1", world_size, source=source)
    if not 0 <= rank < world_size:
        raise value_error("rank", f"in [0, {world_size})", rank, source=source,
                          hint="each process needs a distinct rank below the world size")

    local_rank = _int_var(env, ENV_LOCAL_RANK)
    local_world = _int_var(env, ENV_LOCAL_WORLD_SIZE)
    if local_rank is None:
        local_rank = _int_var(env, ENV_SLURM_LOCAL_RANK)
        local_world = _int_var(env, ENV_SLURM_LOCAL_WORLD_SIZE)
    if local_rank is None:
        local_rank, local_world = 0, local_world or 1
    local_world = local_world or max(local_rank + 1, 1)
    return Identity(rank, world_size, local_rank, local_world, source)


def check_job(job, *, source: str = "job") -> str:
    """Validate an explicit job id (``connect(job=...)``, ``$FERROSYNC_JOB``)."""
    if not isinstance(job, str) or not _JOB_ALPHABET.fullmatch(job):
        raise value_error(source, "1-64 characters of letters, digits, '.', '_' or '-' "
                          "(starting with a letter or digit)", job,
                          hint="the job id names a folder on the shared storage")
    return job


def discover_job(job: str | None = None, *, env: Mapping[str, str] | None = None) -> str | None:
    """The job id: ``job``, else ``$FERROSYNC_JOB``, else the scheduler's job id.

    Ranks of one job must agree on it, and two jobs on one URL must differ: SLURM's
    ``SLURM_JOB_ID`` and torchelastic's ``TORCHELASTIC_RUN_ID`` (``torchrun
    --rdzv-id``; its default value "none" is no id) are both. ``python -m
    ferrosync.train`` generates one for its ranks. None when nothing is known: the
    job is then anonymous and connect waits a short claim window instead (see
    ``ferrosync.storage.rendezvous``).
    """
    env = os.environ if env is None else env
    if job is not None:
        return check_job(job)
    if env.get(ENV_JOB):
        return check_job(env[ENV_JOB], source=ENV_JOB)
    for name in (ENV_SLURM_JOB, ENV_TORCHELASTIC_RUN):
        value = (env.get(name) or "").strip()
        if value and value.lower() != "none":
            # scheduler ids are not ours to validate: anything else is hashed to a safe name
            if _JOB_ALPHABET.fullmatch(value):
                return value
            return "h" + hashlib.blake2b(value.encode(), digest_size=8).hexdigest()
    return None
