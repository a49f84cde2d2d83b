"""The ``Trainer`` API and the pieces behind the CLI, on real rank processes.

Checkpoints and the sync both go through a moto S3 server here (the CLI tests
use directories), resumed at an epoch boundary (the CLI test resumes mid-epoch).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from train_cli import ROOT, cli_env

import ferrosync
from ferrosync.errors import ConfigError
from ferrosync.strategies import GradAveraging, Strategy, make_strategy
from ranks import run_ranks


def _trainer(rank, world, url, options, *, strategy=None, **kwargs):
    import train_models

    train, evaluation = train_models.small_data()
    from ferrosync.train.runner import make_eval

    loss = torch.nn.functional.cross_entropy
    trainer = ferrosync.Trainer(
        train_models.dropout_mlp, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), loss,
        train, batch_size=25, strategy=strategy, progress=False, report=False,
        rank=rank, world_size=world, **kwargs)
    trainer.eval_fn = make_eval(evaluation, loss, True, trainer.device)
    return trainer


def w_fit(rank, world, url, options, **kwargs):
    trainer = _trainer(rank, world, url, options, **kwargs)
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=60, **options) as sync:
        summary = trainer.fit(sync)
    return summary, {k: v.clone() for k, v in trainer.model.state_dict().items()}


def test_resume_from_s3_at_an_epoch_boundary(s3_transport):
    import uuid

    options = s3_transport.options
    store_opts = options["storage_options"]

    def ck():
        return f"{s3_transport.url}-ck-{uuid.uuid4().hex[:6]}"

    # 500 samples / (2 ranks * 25) = 10 steps per epoch
    full_ck = ck()
    full = run_ranks(w_fit, 2, s3_transport.url + "/a", options, epochs=2,
                     checkpoint_dir=full_ck, checkpoint_every=10, storage_options=store_opts)
    part_ck = ck()
    run_ranks(w_fit, 2, s3_transport.url + "/b", options, steps=10, epochs=2,
              checkpoint_dir=part_ck, storage_options=store_opts)
    resumed = run_ranks(w_fit, 2, s3_transport.url + "/c", options, epochs=2,
                        checkpoint_dir=part_ck, resume=True, storage_options=store_opts)

    (s_full, p_full), (s_res, p_res) = full[0], resumed[0]
    assert s_full["steps"] == s_res["steps"] == 20
    assert s_res["resumed_from"] == 10 and s_res["steps_this_run"] == 10
    assert s_full["ranks_agree"] and s_res["ranks_agree"]
    assert s_res["param_digest"] == s_full["param_digest"]
    for key in p_full:
        assert torch.equal(p_full[key], p_res[key])
    assert 0.0 <= s_full["accuracy"] <= 1.0 and s_full["accuracy"] > 0.5
    assert s_full["checkpoints"] == 2
    # rank 1's parameters are rank 0's, bit for bit
    assert all(torch.equal(full[0][1][k], full[1][1][k]) for k in p_full)


class NoSync(Strategy):
    """A broken strategy: never averages, so ranks drift apart on their own shards."""

    name = "grad"

    def step(self, model, optimizer):
        optimizer.step()
        return {"synced": False, "sync_s": 0.0}


def w_no_sync(rank, world, url, options):
    summary, _ = w_fit(rank, world, url, options, steps=5, strategy=NoSync())
    return summary


def test_diverged_ranks_are_reported(tmp_path):
    summaries = run_ranks(w_no_sync, 2, str(tmp_path / "run"), {})
    for s in summaries:
        assert s["ranks_agree"] is False
        assert len(set(s["rank_digests"])) == 2


@pytest.mark.unit
def test_strategy_registry():
    assert isinstance(make_strategy("grad"), GradAveraging)
    assert isinstance(make_strategy("grad", sync_every=1), GradAveraging)
    with pytest.raises(ConfigError, match="unknown strategy"):
        make_strategy("allreduce")
    with pytest.raises(ConfigError, match="does not apply to --strategy grad"):
        make_strategy("grad", sync_every=4)


@pytest.mark.unit
def test_trainer_rejects_bad_arguments_before_io(tmp_path):
    import train_models

    train, _ = train_models.small_data()
    args = (train_models.dropout_mlp, lambda p: torch.optim.SGD(p, lr=0.1),
            torch.nn.functional.cross_entropy, train)
    with pytest.raises(ConfigError, match="give epochs or steps"):
        ferrosync.Trainer(*args, rank=0, world_size=1)
    with pytest.raises(ConfigError, match="batch_size"):
        ferrosync.Trainer(*args, steps=1, batch_size=0, rank=0, world_size=1)
    with pytest.raises(ConfigError, match="need checkpoint_dir"):
        ferrosync.Trainer(*args, steps=1, resume=True, rank=0, world_size=1)
    with pytest.raises(ConfigError, match="no checkpoint in"):
        ferrosync.Trainer(*args, steps=1, resume=True, checkpoint_dir=str(tmp_path / "ck"),
                          rank=0, world_size=1)
    assert not (tmp_path / "ck").exists()


def test_import_ferrosync_stays_cheap():
    code = ("import sys, ferrosync\n"
            "assert 'ferrosync.train' not in sys.modules\n"
            "print(ferrosync.Trainer.__module__)")
    out = subprocess.run([sys.executable, "-c", code], env=cli_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ferrosync.train.trainer"


@pytest.mark.unit
def test_pump_prefixes_lines_and_holds_final():
    import threading

    from ferrosync.train.launcher import _Pump

    class Sink:
        def __init__(self):
            self.data = b""
            self.buffer = self  # a binary stream, like sys.stdout.buffer

        def write(self, data):
            self.data += data

        def flush(self):
            pass

    read_fd, write_fd = os.pipe()
    sink = Sink()
    pump = _Pump(3, os.fdopen(read_fd, "rb"), sink, threading.Lock(), hold_final=True)
    pump.start()
    os.write(write_fd, b"hello\n\rbar 1\rbar 2")
    os.write(write_fd, b"\nFINAL {\"steps\": 1}\nlast words\nno newline")
    os.close(write_fd)
    pump.join(timeout=10)
    assert sink.data == (b"[rank 3] hello\n\r[rank 3] bar 1\r[rank 3] bar 2\n"
                         b"[rank 3] last words\n[rank 3] no newline\n")
    assert pump.final == b'FINAL {"steps": 1}'
    assert pump.error_line() == "no newline"


# not in the unit tier: matplotlib's first import on a machine (an empty MPLCONFIGDIR)
# builds its font cache by running `fc-list`, a process, which the unit tier refuses
def test_plot_metrics(tmp_path, monkeypatch):
    from ferrosync.train import plot as plot_metrics

    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(
        f'{{"step": {i}, "epoch": 0, "loss": {1 / i}, "lr": 0.1, "compute_s": 0.001, '
        f'"sync_s": 0.002, "bytes": 100, "requests": 4}}\n' for i in range(1, 31))
        # an idle sync (time-based strategy: rank 0 had nothing to train) has no loss
        + '{"step": 30, "epoch": 0, "loss": null, "lr": 0.1, "compute_s": 0.0, '
        '"sync_s": 0.002, "bytes": 100, "requests": 4}\n'
        + '{"step": 31, "ep')  # a torn last line, as a killed run leaves
    assert plot_metrics.main([str(metrics)]) == 0
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert plot_metrics.main([str(metrics), "-o", str(tmp_path / "x.png")]) == 2
    assert not (tmp_path / "x.png").exists()


@pytest.mark.unit
def test_rng_states_round_trip_through_a_checkpoint_file(tmp_path):
    import io
    import random

    import numpy

    from ferrosync.train.checkpoint import capture_rng, restore_rng

    def draw():
        return (random.random(), random.gauss(0, 1), numpy.random.rand(),
                numpy.random.standard_normal(), torch.rand(2).tolist())

    random.seed(3)
    numpy.random.seed(4)
    torch.manual_seed(5)
    random.gauss(0, 1)  # leaves a cached second normal in both generators
    numpy.random.standard_normal()
    buffer = io.BytesIO()
    torch.save(capture_rng(torch.device("cpu")), buffer)
    expected = draw()
    random.seed(0)
    numpy.random.seed(0)
    torch.manual_seed(0)
    restore_rng(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True),
                torch.device("cpu"))
    assert draw() == expected
