"""torchrun-style scripts run unchanged: under ``python -m ferrosync.train`` (which gives
each rank torchrun's environment), under torchrun itself, and through ``env://``
without ``MASTER_ADDR`` when ``FERROSYNC_URL`` names the storage."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch
from train_cli import ForkedCli, cli_env, run_cli, run_forked

from ferrosync.core.ports import LOOPBACK, free_port
from ferrosync.train.launcher import _rank_env, torchrun_env
from ranks import communicate_all

#: what torchrun (LocalElasticAgent) gives a worker, plus the local-rank variables
TORCHRUN_KEYS = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
}

#: a torchrun-style script: init_process_group(backend) with no init_method (env://);
#: ``BACKEND --spawn LOCATION`` runs it through mp.spawn with init_method=LOCATION instead
SCRIPT = textwrap.dedent("""
    import gc, json, os, sys
    import torch
    import torch.distributed as dist

    def main(backend, **init):
        dist.init_process_group(backend, **init)
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(4):
            opt.zero_grad()
            ddp(torch.randn(6, 4, generator=gen)).square().mean().backward()
            opt.step()
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        keys = KEYS + ["OMP_NUM_THREADS", "FERROSYNC_JOB"]
        # one write per record, newline included: both ranks share torchrun's stdout,
        # and print() writes the text and its newline separately when unbuffered
        line = json.dumps({"rank": rank, "world": world, "backend": dist.get_backend(),
                           "sum": t.item(), "env": {k: os.environ.get(k) for k in keys},
                           "params": [p.detach().flatten().tolist()
                                      for p in model.parameters()]}) + "\\n"
        os.write(1, line.encode())
        # drop DDP (it holds the group) before destroying the group: a gloo group still
        # referenced at interpreter exit can abort the process (SIGABRT, "terminate
        # called without an active exception"; pytorch/pytorch#179291)
        del ddp, opt, model
        gc.collect()
        dist.destroy_process_group()

    def spawned(rank, backend, location):
        main(backend, init_method=location, rank=rank, world_size=2)

    if __name__ == "__main__":
        if sys.argv[2:3] == ["--spawn"]:
            import torch.multiprocessing as mp
            mp.spawn(spawned, args=(sys.argv[1], sys.argv[3]), nprocs=2)
        else:
            main(sys.argv[1])
""").replace("KEYS", repr(sorted(TORCHRUN_KEYS)))


def _records(stdout: str) -> dict[int, dict]:
    records = {}
    for line in stdout.splitlines():
        body = line.partition("] ")[2] if line.startswith("[rank ") else line
        if body.startswith("{"):
            record = json.loads(body)
            records[record["rank"]] = record
    return records


def _close(a, b, tol=1e-6) -> bool:
    return all(torch.allclose(torch.tensor(x), torch.tensor(y), rtol=tol, atol=tol)
               for x, y in zip(a, b, strict=True))


@pytest.mark.unit
def test_rank_env_is_torchruns():
    envs = [_rank_env(r, 4, "/x", 2, "launch-abc", 29555) for r in range(4)]
    for rank, env in enumerate(envs):
        assert TORCHRUN_KEYS <= set(env)
        assert env["RANK"] == env["ROLE_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "4"
        assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (str(rank % 2), "2")
        assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == (str(rank // 2), "2")
        assert env["ROLE_NAME"] == "default"
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (LOOPBACK, "29555")
        assert env["TORCHELASTIC_RUN_ID"] == env["FERROSYNC_JOB"] == "launch-abc"
        assert env["TORCHELASTIC_RESTART_COUNT"] == env["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert env["FERROSYNC_URL"] == "/x" and "OMP_NUM_THREADS" in env


@pytest.mark.unit
def test_torchrun_env_covers_torchs_agent():
    """Every variable torch's own agent sets for a worker (read from its source)."""
    from torch.distributed.elastic.agent.server import local_elastic_agent

    with open(local_elastic_agent.__file__, encoding="utf-8") as f:
        source = f.read()
    block = re.search(r"worker_env = \{(.*?)\n\s*\}", source, re.S)
    if block is None:
        pytest.skip("torch's LocalElasticAgent no longer builds worker_env as a dict literal")
    theirs = set(re.findall(r'"([A-Z][A-Z0-9_]+)":', block.group(1)))
    assert theirs and theirs <= set(torchrun_env(0, 1, 1, "j", 1))


@pytest.mark.unit
def test_free_port_is_free():
    import socket

    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, port))  # nothing holds it


@pytest.mark.unit
def test_env_handler_takes_over_only_without_master_addr(monkeypatch, tmp_path):
    """``env://`` in this process: torch's handler unless MASTER_ADDR is unset and
    FERROSYNC_URL is set; then a store naming no location, shared with no one."""
    import torch.distributed as dist

    import ferrosync  # noqa: F401 - registers the handlers (if autoload has not)
    from ferrosync.ddp.init_methods import EnvStore, location_of
    from ferrosync.errors import ConfigError

    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "FERROSYNC_URL"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR expected"):  # torch's own error
        next(dist.rendezvous("env://", 0, 1))

    monkeypatch.setenv("FERROSYNC_URL", str(tmp_path / "run"))
    store, rank, world = next(dist.rendezvous("env://?use_libuv=1", 1, 2))
    assert isinstance(store, EnvStore) and (rank, world) == (1, 2)
    assert location_of(dist.PrefixStore("default_pg", store)) is None  # -> FERROSYNC_URL
    with pytest.raises(ConfigError, match="MASTER_PORT"):
        store.get("a peer's key")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    _, rank, world = next(dist.rendezvous("env://"))
    assert (rank, world) == (0, 1)

    monkeypatch.setenv("MASTER_ADDR", LOOPBACK)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    store, _, _ = next(dist.rendezvous("env://", 0, 1))
    assert isinstance(store, dist.TCPStore)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """The script under the launcher, per backend: {rank: record}."""
    tmp_path = tmp_path_factory.mktemp("torchrun_style")
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    out = {}
    for backend in ("gloo", "ferrosync"):
        proc = run_cli("--nproc", 2, script, backend, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        out[backend] = _records(proc.stdout)
        out[backend + ":stderr"] = proc.stderr
    return out


@pytest.mark.parametrize("backend", ["gloo", "ferrosync"])
def test_launcher_runs_torchrun_style_script(results, backend):
    records = results[backend]
    assert sorted(records) == [0, 1]
    url = re.search(r"sync URL (\S+)", results[backend + ":stderr"]).group(1)
    for rank, r in records.items():
        assert (r["world"], r["backend"], r["sum"]) == (2, backend, 3.0)
        env = r["env"]
        assert env["LOCAL_RANK"] == env["ROLE_RANK"] == str(rank)
        assert env["MASTER_ADDR"] == LOOPBACK and int(env["MASTER_PORT"]) > 0
        assert env["TORCHELASTIC_RUN_ID"] == env["FERROSYNC_JOB"]
        assert env["TORCHELASTIC_RUN_ID"].startswith("launch-")
        assert env["OMP_NUM_THREADS"] == "1"
    assert records[0]["params"] == records[1]["params"]  # every rank ends the same
    assert len({r["env"]["MASTER_PORT"] for r in records.values()}) == 1
    assert url  # the ferrosync backend's data went to the launcher's sync URL


def test_launcher_results_match_gloo(results):
    assert _close(results["ferrosync"][0]["params"], results["gloo"][0]["params"])


def _run_ranks(script, args, world, cwd, **env):
    base = {k: v for k, v in cli_env(**env).items()
            if k not in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    procs = [ForkedCli([sys.executable, str(script), *args], cwd=cwd,
                              env={**base, "RANK": str(r), "WORLD_SIZE": str(world)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    return communicate_all(procs)


def test_env_without_master_addr_uses_ferrosync_url(tmp_path, results):
    """``init_process_group("ferrosync")`` with RANK/WORLD_SIZE and FERROSYNC_URL only:
    no TCP port at all; the data goes to FERROSYNC_URL."""
    script = tmp_path / "script.py"
    script.write_text("import ferrosync  # PYTHONPATH is this checkout, not the install\n"
                      + SCRIPT)
    run = tmp_path / "run"
    done = _run_ranks(script, ["ferrosync"], 2, tmp_path, FERROSYNC_URL=run,
                      FERROSYNC_JOB=f"t-{uuid.uuid4().hex[:8]}")
    records = {}
    for code, out, err in done:
        assert code == 0, err
        records.update(_records(out))
    assert sorted(records) == [0, 1] and records[0]["params"] == records[1]["params"]
    assert records[0]["sum"] == 3.0
    assert _close(records[0]["params"], results["gloo"][0]["params"])
    assert run.is_dir() and any(run.iterdir())


def test_env_without_master_addr_refuses_gloo_clearly(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import ferrosync\n" + SCRIPT)
    done = _run_ranks(script, ["gloo"], 2, tmp_path, FERROSYNC_URL=tmp_path / "run")
    for code, _, err in done:
        assert code != 0
        assert "MASTER_ADDR" in err and "ConfigError" in err


def test_real_torchrun_with_ferrosync_url(tmp_path, results):
    """torchrun --standalone runs the same script with the ferrosync backend, the data
    going to FERROSYNC_URL (torchrun's TCPStore serves only torch's own keys)."""
    script = tmp_path / "script.py"
    script.write_text("import ferrosync\n" + SCRIPT)
    run = tmp_path / "run"
    env = cli_env(FERROSYNC_URL=run)
    env.pop("FERROSYNC_JOB", None)  # torchrun's run id names the job
    proc = run_forked(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), "ferrosync"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=180)
    assert proc.returncode == 0, proc.stderr
    records = _records(proc.stdout)
    assert sorted(records) == [0, 1] and records[0]["params"] == records[1]["params"]
    assert _close(records[0]["params"], results["gloo"][0]["params"])
    assert any(run.iterdir())


def test_mp_spawn_with_a_directory(tmp_path, results):
    script = tmp_path / "script.py"
    script.write_text("import ferrosync\n" + SCRIPT)
    proc = run_forked([sys.executable, str(script), "ferrosync", "--spawn",
                           str(tmp_path / "run")], cwd=tmp_path, timeout=180,
                          env=cli_env(FERROSYNC_JOB=f"t-{uuid.uuid4().hex[:8]}"),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    records = _records(proc.stdout)
    assert sorted(records) == [0, 1] and records[0]["params"] == records[1]["params"]
    assert {r["backend"] for r in records.values()} == {"ferrosync"}
    assert _close(records[0]["params"], results["gloo"][0]["params"])


def test_slurm_environment_without_master_addr(tmp_path, results):
    """What ``srun --ntasks 2 python script.py`` gives each task (simulated: no SLURM
    here): SLURM_PROCID/SLURM_NTASKS, no RANK, no MASTER_ADDR; FERROSYNC_URL set."""
    script = tmp_path / "script.py"
    script.write_text("import ferrosync\n" + SCRIPT)
    base = {k: v for k, v in cli_env(FERROSYNC_URL=tmp_path / "run").items()
            if k not in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    job = f"{uuid.uuid4().int % 10**8}"
    procs = [ForkedCli([sys.executable, str(script), "ferrosync"], cwd=tmp_path,
                              env={**base, "SLURM_PROCID": str(r), "SLURM_NTASKS": "2",
                                   "SLURM_LOCALID": str(r), "SLURM_NTASKS_PER_NODE": "2",
                                   "SLURM_JOB_ID": job},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    records = {}
    for code, out, err in communicate_all(procs):
        assert code == 0, err
        records.update(_records(out))
    assert sorted(records) == [0, 1] and records[0]["params"] == records[1]["params"]
    assert _close(records[0]["params"], results["gloo"][0]["params"])
