"""Tests with the real PyTorch Lightning and HF Accelerate (the ``integrations`` extra).

Each test runs a real 2-process job in a subprocess with a timeout (Lightning's own
subprocess launcher, ``python -m ferrosync.train --nproc 2``, ``accelerate launch``)
and compares the ``"ferrosync"`` backend's final parameters with gloo's. A test whose
library is not installed is skipped, with the install command as the reason.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from ferrosync.core.ports import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
INSTALL = "pip install -e '.[integrations]'"

#: test file -> (import name, distribution, lowest version the tests were written for)
REQUIRES = {
    "test_lightning.py": ("lightning", "lightning", (2, 2)),
    "test_accelerate.py": ("accelerate", "accelerate", (0, 30)),
}

#: seconds one 2-process job may take (they take 5-15 s on 2 shared cores)
JOB_TIMEOUT = 240


def _missing(module: str, dist: str, lowest: tuple[int, int]) -> str | None:
    if importlib.util.find_spec(module) is None:
        return f"{dist} is not installed ({INSTALL})"
    version = importlib.metadata.version(dist)
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts < lowest:
        return f"{dist} {version} is older than {'.'.join(map(str, lowest))} ({INSTALL})"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        need = REQUIRES.get(os.path.basename(str(item.fspath)))
        if need is None:
            continue
        reason = _missing(*need)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


def job_env(**extra: str) -> dict:
    """This process's environment without anything that would make a library think it
    is already inside a distributed job, CPU only, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                        "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "FERROSYNC_URL",
                        "PL_GLOBAL_SEED", "ACCELERATE_USE_CPU")
           and not k.startswith(("TORCHELASTIC_", "SLURM_", "PMI_", "OMPI_"))}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               HF_HUB_OFFLINE="1", FERROSYNC_JOB=env.get("FERROSYNC_JOB", "tests"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def run_job(args: list[str], cwd, **env: str) -> str:
    """Run ``python ARGS`` (a whole 2-process job) with a timeout; its output, or a
    failure showing the end of it. ``python -m ferrosync.train`` and a script start
    forked from the suite's forkserver (tests/train_cli.py), the launcher's ranks
    forked from it; the processes the libraries start themselves are new interpreters."""
    from train_cli import run_forked

    try:
        proc = run_forked([sys.executable, *args], cwd=cwd, env=job_env(**env),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode(errors="replace")
        pytest.fail(f"{args} ran past {JOB_TIMEOUT} s; output:\n{out[-4000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{args} exited {proc.returncode}; output:\n{proc.stdout[-4000:]}")
    if "terminate called" in proc.stdout:
        # a rank aborted at exit; Lightning's launcher does not report its children's
        # exit status, so their output is the only sign
        pytest.fail(f"{args}: a process aborted; output:\n{proc.stdout[-4000:]}")
    return proc.stdout


def load_ranks(prefix) -> list[dict]:
    import torch

    return [torch.load(f"{prefix}.rank{r}", weights_only=False) for r in range(2)]


def assert_same_params(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), (
            f"{name}: max |diff| {(a[name] - b[name]).abs().max().item():.3g}")


@pytest.fixture(scope="session")
def jobs():
    """The helpers above, for the tests (two ``conftest`` modules cannot both be imported
    by that name)."""
    return SimpleNamespace(run=run_job, load=load_ranks, same_params=assert_same_params,
                           free_port=free_port, script=lambda name: os.path.join(HERE, name))
