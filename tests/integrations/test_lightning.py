"""PyTorch Lightning 2.x: ``Trainer(accelerator="cpu", devices=2,
strategy=DDPStrategy(process_group_backend="ferrosync"))``, the real library.

``lightning_script.py`` runs the whole job (Lightning's subprocess launcher starts the
second rank by rerunning it) once with ``"ferrosync"`` (data under ``$FERROSYNC_URL``;
Lightning initialises with ``env://`` and its own TCP store) and once with ``"gloo"``.

The final parameters are compared **bit for bit**: with 2 ranks the backend's float
``SUM`` (the average × 2) is exact, and a sum of two numbers does not depend on order,
so DDP's gradients, and so the weights, equal gloo's. (With a world size that is not a
power of two they would agree to about one float32 ulp: docs/ddp.md.)
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, jobs):
    out = {}
    for backend in ("ferrosync", "gloo"):
        d = tmp_path_factory.mktemp(f"lightning-{backend}")
        jobs.run([jobs.script("lightning_script.py"), backend, str(d / "result.pt")], cwd=d,
                 FERROSYNC_URL=str(d / "sync"))
        out[backend] = jobs.load(d / "result.pt")
    return out


def test_lightning_ddp_ferrosync_equals_gloo(runs, jobs):
    fs, gloo = runs["ferrosync"], runs["gloo"]
    assert [r["backend"] for r in fs] == ["ferrosync", "ferrosync"]
    assert [r["backend"] for r in gloo] == ["gloo", "gloo"]
    assert [r["steps"] for r in fs + gloo] == [4] * 4
    for r in fs[1:] + gloo:
        jobs.same_params(fs[0]["params"], r["params"])
    # self.log(..., sync_dist=True): the same values on every rank and backend
    assert all(r["logged"] == gloo[0]["logged"] for r in fs + gloo)
    assert all(r["epoch_loss"] == gloo[0]["epoch_loss"] for r in fs + gloo)


def test_lightning_sync_dist_sends_int64_avg(runs):
    # Lightning reduces with AVG on any backend not named gloo (on gloo: SUM, then it
    # divides); at epoch end that includes its int64 batch-size counter
    for r in runs["ferrosync"]:
        assert ("torch.float32", "AVG") in r["all_reduce"]
        assert ("torch.int64", "AVG") in r["all_reduce"], r["all_reduce"]
    for r in runs["gloo"]:
        assert {op for _, op in r["all_reduce"]} == {"SUM"}


def test_lightning_test_after_fit_works_like_gloo(runs):
    """``trainer.test()`` after ``fit``: sync_dist all_reduces of inference tensors
    (torch.inference_mode is per thread; the ferrosync group's allreduce runs on a
    library thread) give gloo's values on every rank."""
    fs, gloo = runs["ferrosync"], runs["gloo"]
    assert all(r["test_all_reduce"] for r in fs + gloo), [r["test_all_reduce"] for r in fs]
    assert all(r["test_loss"] == gloo[0]["test_loss"] for r in fs + gloo), \
        [r["test_loss"] for r in fs + gloo]
