"""HF Accelerate, the real library, on CPU with 2 processes.

Accelerate picks the backend itself: on CPU, ``InitProcessGroupKwargs(backend="ferrosync")``
is refused (``ValueError: Your assigned backend ferrosync is not available, please use
gloo``). What works (docs/ddp.md): ``torch.distributed.init_process_group("ferrosync")``
first, then ``Accelerator(cpu=True)``, which adopts the existing group (its
``state.backend`` still says ``"gloo"``; ``dist.get_backend()`` says ``"ferrosync"``).
``accelerate_script.py`` does that; the final parameters are compared bit for bit with
the same script on gloo (2 ranks: the float SUM is exact, see test_lightning.py).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(600)


def _ferrosync_train(jobs, d, backend, mode="preinit"):
    """The script on 2 ranks under ``python -m ferrosync.train --nproc 2`` (torchrun's
    environment, ``MASTER_ADDR``/``MASTER_PORT`` and ``FERROSYNC_URL`` for every rank)."""
    jobs.run(["-m", "ferrosync.train", "--nproc", "2", "--sync", str(d / "sync"),
              jobs.script("accelerate_script.py"), backend, str(d / "result.pt"), mode], cwd=d)
    return jobs.load(d / "result.pt")


@pytest.fixture(scope="module")
def gloo(tmp_path_factory, jobs):
    return _ferrosync_train(jobs, tmp_path_factory.mktemp("accelerate-gloo"), "gloo")


def _check_distributed(ranks, backend):
    for rank, r in enumerate(ranks):
        assert r["pg_backend"] == backend
        assert r["distributed_type"] == "DistributedType.MULTI_CPU"
        assert (r["num_processes"], r["process_index"]) == (2, rank)
        assert r["ddp"], "Accelerate did not wrap the model in DDP"
        assert r["batches"] == 4  # each rank got half the data
        assert r["gathered"] == [0.0, 1.0]


def test_accelerate_preinit_ferrosync_equals_gloo(tmp_path, jobs, gloo):
    fs = _ferrosync_train(jobs, tmp_path, "ferrosync")
    _check_distributed(fs, "ferrosync")
    _check_distributed(gloo, "gloo")
    assert fs[0]["accelerate_backend"] == "gloo"  # Accelerate's label, not the group's
    for r in fs[1:] + gloo:
        jobs.same_params(fs[0]["params"], r["params"])
    assert all(r["losses"] == gloo[0]["losses"] for r in fs + gloo)


def test_accelerate_launch_preinit_ferrosync_equals_gloo(tmp_path, jobs, gloo):
    # Accelerate's own launcher: on CPU it starts N processes only with --multi_gpu
    # (torchrun underneath); --cpu with --multi_gpu is refused, and --cpu alone starts one
    args = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(jobs.free_port()),
            jobs.script("accelerate_script.py"), "ferrosync", str(tmp_path / "result.pt")]
    jobs.run(args, cwd=tmp_path, FERROSYNC_URL=str(tmp_path / "sync"),
             HF_HOME=str(tmp_path / "hf"))
    fs = jobs.load(tmp_path / "result.pt")
    _check_distributed(fs, "ferrosync")
    for r in fs[1:] + gloo:
        jobs.same_params(fs[0]["params"], r["params"])


def test_accelerate_refuses_ferrosync_in_init_process_group_kwargs(tmp_path, jobs):
    # if a later Accelerate accepts it, this fails: then document that simpler recipe
    for r in _ferrosync_train(jobs, tmp_path, "ferrosync", mode="kwargs"):
        assert r["error"] == ("ValueError: Your assigned backend ferrosync is not available, "
                              "please use gloo")


def test_accelerator_without_cpu_true_is_not_distributed(tmp_path, jobs):
    # the trap the recipe avoids: on a host without an accelerator, Accelerator() (no
    # cpu=True, no ACCELERATE_USE_CPU) ignores the process group and each rank trains
    # alone on all the data
    for r in _ferrosync_train(jobs, tmp_path, "ferrosync", mode="preinit-nocpu"):
        assert r["pg_backend"] == "ferrosync"
        assert r["distributed_type"] == "DistributedType.NO"
        assert (r["num_processes"], r["ddp"], r["batches"]) == (1, False, 8)
