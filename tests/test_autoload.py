"""``import torch`` registers backend "ferrosync" (the ``torch.backends`` entry point).

Each case runs in a fresh interpreter, because what matters is what ``import torch``
and ``import ferrosync`` do first, in which order, and what they load. These need
ferrosync installed (``pip install -e .``) so that its entry point is visible; they
are skipped, saying so, when it is not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from importlib.metadata import entry_points

import pytest
import torch

import ferrosync_autoload
from ferrosync.ddp import init_methods
from ranks import communicate_all

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOOK_FILE = os.path.join(ROOT, "ferrosync_autoload.py")


def _entry_point():
    found = [ep for ep in entry_points(group="torch.backends") if ep.name == "ferrosync"]
    return found[0] if found else None


def _installed_here() -> str | None:
    """None when this checkout's hook is the one torch will load, else why not."""
    ep = _entry_point()
    if ep is None:
        return "ferrosync's torch.backends entry point is not installed (pip install -e .)"
    if ep.value != "ferrosync_autoload:autoload":
        return f"another ferrosync entry point is installed: {ep.value}"
    code = "import importlib.util as u; print(u.find_spec('ferrosync_autoload').origin)"
    origin = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=_env(), cwd="/", timeout=60).stdout.strip()
    if os.path.realpath(origin) != os.path.realpath(HOOK_FILE):
        return f"the installed entry point loads {origin!r}, not this checkout's hook"
    return None


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("FERROSYNC_AUTOLOAD", "TORCH_DEVICE_BACKEND_AUTOLOAD", "PYTHONPATH",
                        "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "FERROSYNC_URL", "FERROSYNC_JOB", "SLURM_PROCID", "SLURM_NTASKS")}
    env["OMP_NUM_THREADS"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


_SKIP = None


def _require_installed():
    global _SKIP
    if _SKIP is None:
        _SKIP = _installed_here() or ""
    if _SKIP:
        pytest.skip(_SKIP)


def run_python(code: str, cwd, timeout: float = 120, **env) -> dict:
    """Run ``code`` in a fresh interpreter (cwd outside the checkout, no PYTHONPATH: only
    the installed ferrosync is visible); its last stdout line is a JSON record."""
    done = subprocess.run([sys.executable, "-W", "error", "-c", textwrap.dedent(code)],
                          cwd=cwd, env=_env(**env), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


PROLOGUE = """
import json, sys
def state():
    import torch.distributed as dist
    table = sys.modules["torch.distributed.rendezvous"]._rendezvous_handlers
    hook = sys.modules.get("ferrosync_autoload")
    return {
        "backend": "ferrosync" in dist.Backend.backend_list,
        "hook": hook is not None,
        "hook_error": repr(getattr(hook, "last_error", None)),
        "package": "ferrosync" in sys.modules,
        "heavy": sorted(m for m in sys.modules if m.split(".")[0] in ("fsspec", "s3fs")),
        "handlers": sorted(s for s in ("", "s3", "gs") if s in table),
        "file_wraps": getattr(getattr(table["file"], "ferrosync_wraps", None), "__name__", None),
        "env_wraps": getattr(getattr(table["env"], "ferrosync_wraps", None), "__name__", None),
    }
"""

WORLD_OF_ONE = """
import torch, torch.distributed as dist
dist.init_process_group("ferrosync", init_method=RUN, rank=0, world_size=1)
t = torch.tensor([1.0, 2.0]); dist.all_reduce(t)
result = {"name": dist.get_backend(), "t": t.tolist()}
dist.destroy_process_group()
"""

REGISTERED = {"backend": True, "hook": True, "hook_error": "None", "heavy": [],
              "handlers": ["", "gs", "s3"], "file_wraps": "_file_rendezvous_handler",
              "env_wraps": "_env_rendezvous_handler"}


def test_hook_is_the_installed_entry_point():
    _require_installed()
    assert _entry_point().load() is ferrosync_autoload.autoload


def test_import_torch_alone_registers_without_importing_ferrosync(tmp_path):
    _require_installed()
    before = run_python(PROLOGUE + "import torch\nprint(json.dumps(state()))", tmp_path)
    assert before == {**REGISTERED, "package": False}
    run = tmp_path / "run"
    after = run_python(PROLOGUE + f"RUN = {str(run)!r}\nimport torch\n" + WORLD_OF_ONE
                       + "print(json.dumps({**result, **state()}))", tmp_path)
    assert after["name"] == "ferrosync" and after["t"] == [1.0, 2.0]
    assert after["package"]  # loaded on first use, by the backend
    assert run.is_dir()


@pytest.mark.parametrize("order", ["ferrosync", "ferrosync,torch", "torch,ferrosync"])
def test_import_ferrosync_registers_once(tmp_path, order):
    """``import ferrosync`` after, before or without ``import torch``: no warning (``-W
    error``), nothing registered twice, torch's handlers wrapped once."""
    _require_installed()
    imports = "".join(f"import {name}\n" for name in order.split(","))
    code = (PROLOGUE + f"RUN = {str(tmp_path / 'run')!r}\n" + imports
            + "import ferrosync\nassert ferrosync.ddp.register()  # again: still fine\n"
            + WORLD_OF_ONE + "print(json.dumps({**result, **state()}))")
    got = run_python(code, tmp_path)
    assert got == {**REGISTERED, "package": True, "name": "ferrosync", "t": [1.0, 2.0]}


@pytest.mark.parametrize("switch", ["FERROSYNC_AUTOLOAD", "TORCH_DEVICE_BACKEND_AUTOLOAD"])
def test_off_switches(tmp_path, switch):
    _require_installed()
    code = PROLOGUE + textwrap.dedent("""
        import torch, torch.distributed as dist, warnings
        s = state()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch: "Device capability ... unknown"
                dist.init_process_group("ferrosync", store=dist.HashStore(), rank=0,
                                        world_size=1)
            s["error"] = None
        except Exception as exc:
            s["error"] = str(exc)
        print(json.dumps(s))
    """)
    got = run_python(code, tmp_path, **{switch: "0"})
    assert not got["backend"] and not got["package"]
    assert got["hook"] == (switch == "FERROSYNC_AUTOLOAD")  # torch's switch: never loaded
    assert "Unknown backend type ferrosync" in got["error"]
    assert got["handlers"] == [] and got["file_wraps"] is None
    # import ferrosync still registers everything
    code = PROLOGUE + "import ferrosync\nprint(json.dumps(state()))"
    assert run_python(code, tmp_path, **{switch: "0"})["backend"]


UNMODIFIED_SCRIPT = """
import argparse, json, sys
import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--dist-backend", default="gloo")
p.add_argument("--dist-url", default="env://")
p.add_argument("--rank", type=int)
p.add_argument("--world-size", type=int)
a = p.parse_args()
loaded_before = "ferrosync" in sys.modules
dist.init_process_group(a.dist_backend, init_method=a.dist_url, rank=a.rank,
                        world_size=a.world_size)
torch.manual_seed(0)
model = torch.nn.Linear(3, 2)
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(a.rank)
for _ in range(3):
    opt.zero_grad()
    ddp(torch.randn(5, 3, generator=gen)).square().sum().backward()
    opt.step()
print(json.dumps({"rank": dist.get_rank(), "backend": dist.get_backend(),
                  "loaded_before": loaded_before,
                  "params": [q.detach().flatten().tolist() for q in model.parameters()]}))
dist.destroy_process_group()
"""


def test_unmodified_script_with_two_processes(tmp_path):
    """An imagenet-style script that never imports ferrosync, --dist-backend ferrosync."""
    _require_installed()
    script = tmp_path / "main.py"
    script.write_text(UNMODIFIED_SCRIPT)
    run = tmp_path / "run"
    env = _env(FERROSYNC_JOB=f"t-{uuid.uuid4().hex[:8]}")  # one job: both ranks
    procs = [subprocess.Popen(
        [sys.executable, "-W", "error", str(script), "--dist-backend", "ferrosync",
         "--dist-url", str(run), "--rank", str(rank), "--world-size", "2"],
        cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    records = []
    for code, out, err in communicate_all(procs):
        assert code == 0, err
        records.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["rank"] for r in records] == [0, 1]
    assert {r["backend"] for r in records} == {"ferrosync"}
    assert not any(r["loaded_before"] for r in records)
    assert records[0]["params"] == records[1]["params"]


# -- the hook itself, in this process -------------------------------------------------------

@pytest.mark.unit
def test_one_table_of_schemes_one_registrar():
    """The registrar takes its schemes and the backend's name from the table the package
    reads (``ferrosync_schemes``), and its wrappers call handlers init_methods has."""
    import ferrosync_schemes
    from ferrosync.core.env import ENV_URL
    from ferrosync.ddp import constants
    from ferrosync.storage.providers import provider_of

    assert ferrosync_autoload.BACKEND_NAME == constants.BACKEND_NAME == "ferrosync"
    assert ferrosync_autoload.ENV_URL == ENV_URL
    objects = ferrosync_schemes.ddp_object_schemes()
    assert {"s3", "gs", "az"} <= set(objects) and "memory" not in objects
    for scheme in (*objects, *ferrosync_autoload.TAKES_OVER):
        name = "object_store" if scheme in objects else scheme
        assert callable(getattr(init_methods, f"{name}_handler")), scheme
    for scheme, row in ferrosync_schemes.SCHEMES.items():
        url = f"{scheme}:///x" if row.protocol == "file" else f"{scheme}://bucket/x"
        assert provider_of(url).name == (row.store or "other fsspec store")


@pytest.mark.unit
def test_hook_never_raises(monkeypatch):
    def boom():
        raise RuntimeError("a torch API change")

    monkeypatch.setattr(ferrosync_autoload, "register", boom)
    monkeypatch.delenv("FERROSYNC_AUTOLOAD", raising=False)
    ferrosync_autoload.autoload()
    assert "a torch API change" in str(ferrosync_autoload.last_error)
    monkeypatch.setenv("FERROSYNC_AUTOLOAD", "0")
    ferrosync_autoload.autoload()  # off: register is not even called
    assert ferrosync_autoload.last_error is None


@pytest.mark.unit
def test_register_is_idempotent_in_this_process():
    import importlib

    table = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    before = dict(table)
    assert ferrosync_autoload.register() is True
    assert ferrosync_autoload.register() is True
    assert dict(table) == before


@pytest.mark.unit
def test_nothing_without_torch_distributed(monkeypatch):
    import importlib

    table = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    before = dict(table)
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    assert ferrosync_autoload.register() is False
    assert dict(table) == before


@pytest.mark.unit
def test_hook_imports_only_torch():
    import ast

    with open(HOOK_FILE, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    top = {alias.name for node in tree.body if isinstance(node, ast.Import)
           for alias in node.names}
    top |= {node.module for node in tree.body if isinstance(node, ast.ImportFrom)}
    # torch and ferrosync only inside functions; the table of schemes imports nothing
    assert top <= {"__future__", "os", "ferrosync_schemes"}, top


def test_a_gloo_user_imports_nothing_of_ferrosync(tmp_path):
    """``init_process_group("gloo")`` through ``env://`` and a ``file://`` store file:
    the hook's wrappers hand both to torch without importing ferrosync (they are not
    ferrosync's forms). This checkout's hook is loaded (first on PYTHONPATH)."""
    if _entry_point() is None:
        pytest.skip("ferrosync's torch.backends entry point is not installed (pip install -e .)")
    store = tmp_path / "store"
    record = run_python(PROLOGUE + f"""
import os, socket
import torch, torch.distributed as dist
import ferrosync_autoload
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", init_method="env://", rank=0, world_size=1)
dist.destroy_process_group()
after_env = "ferrosync" in sys.modules
dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
t = torch.ones(2); dist.all_reduce(t); dist.destroy_process_group()
print(json.dumps({{**state(), "after_env": after_env, "hook_file": ferrosync_autoload.__file__}}))
""", tmp_path, PYTHONPATH=ROOT)
    assert record["hook_file"] == HOOK_FILE
    assert record["backend"] and record["env_wraps"] == "_env_rendezvous_handler"
    assert record["after_env"] is False and record["package"] is False, record
    assert record["heavy"] == []
