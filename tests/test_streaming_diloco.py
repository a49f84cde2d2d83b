"""Streaming DiLoCo on real rank processes: identical ends, equality with diloco, bytes per
sync, the overlapped exchange, checkpoint/resume, bad settings, the CLI.

Every rank trains on its own deterministic batches (seeded by rank and step), so ranks
really drift apart between syncs and every equality asserted here could fail.
"""

from __future__ import annotations

import pytest
import torch
from train_cli import final_of, read_metrics, run_cli

import ferrosync
from ferrosync.errors import ConfigError
from ferrosync.strategies import STRATEGIES, StreamingDiLoCo, make_strategy
from ferrosync.strategies.streaming import partition
from ranks import run_ranks

WIDTH = 64


def _model(batchnorm: bool = False) -> torch.nn.Module:
    """Four Linear(64, 64): 8 parameter tensors, so 4 fragments are exactly equal."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    if batchnorm:
        layers.append(torch.nn.BatchNorm1d(WIDTH))  # buffers travel with the last fragment
    for _ in range(3):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, WIDTH, generator=g), torch.randn(16, WIDTH, generator=g)


def _params(model) -> list[torch.Tensor]:
    return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


def w_loop(rank, world, url, name, settings, steps, *, batchnorm=False, plan=True,
           own_steps=None, stop_at=None, resume=None):
    """The trainer's loop by hand. ``steps``: the run's length (``begin``); ``own_steps``:
    instead, per-rank step counts without ``begin`` (a rank that runs out of data calls
    ``finish`` early); ``stop_at``: return a checkpoint after that step instead of
    finishing; ``resume``: the file of a checkpoint from ``stop_at`` to continue from.

    Returns per-step records (bytes this rank wrote, telemetry, each fragment's
    parameters), the final parameters, the strategy's stats and summary.
    """
    model = _model(batchnorm)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    strategy = make_strategy(name, **settings)
    start = 0
    if resume is not None:  # a file, as the trainer's: each rank loads its own copy
        resume = torch.load(resume, weights_only=True)
        model.load_state_dict(resume["model"][rank])
        opt.load_state_dict(resume["optimizer"][rank])
        strategy.load_state_dict(resume["strategy"])  # rank 0's, as the trainer does
        start = resume["step"]
    records = []
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=60,
                           heartbeat_interval=0.2) as sync:
        strategy.attach(model, opt, sync)
        if plan:
            strategy.begin(steps, start)
        last = own_steps[rank] if own_steps else steps
        # bytes written from the end of one step to the end of the next: an overlapped
        # exchange writes in the background, during compute as well
        before = sync.stats["total"]["bytes_written"]
        for step in range(start, last):
            x, y = _batch(rank, step)
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            telemetry = strategy.step(model, opt)
            after = sync.stats["total"]["bytes_written"]
            written, before = after - before, after
            records.append({"written": written,
                            "synced": telemetry["synced"],
                            "params": [p.detach().clone() for p in model.parameters()]})
            if stop_at is not None and step + 1 == stop_at:
                # every rank waits for its exchange in flight (rank 0's state is saved)
                return {"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "strategy": strategy.state_dict(), "step": stop_at}
        strategy.finish(model, opt)
        return records, _params(model), strategy.stats, strategy.summary()


def _checkpoint(parts, path) -> dict:
    """Every rank's model and optimizer, rank 0's strategy state (as the trainer saves)."""
    state = {"model": [p["model"] for p in parts],
             "optimizer": [p["optimizer"] for p in parts],
             "strategy": parts[0]["strategy"], "step": parts[0]["step"]}
    torch.save(state, path)
    return state


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# -- (a) identical ends -------------------------------------------------------------------

@pytest.mark.parametrize("own_steps", [None, [37, 20]])
def test_every_rank_ends_with_identical_parameters(tmp_path, own_steps):
    """Fragments, a 1-step overlap, alpha mixing and BatchNorm buffers; the second case has
    rank 1 run out of data at step 20 and join the remaining syncs idle from finish()."""
    settings = dict(sync_every=8, fragments=4, overlap_steps=1, alpha=0.5)
    out = run_ranks(w_loop, 2, str(tmp_path / "run"), "streaming-diloco", settings, 37,
                    batchnorm=True, plan=own_steps is None, own_steps=own_steps)
    (rec0, end0, stats0, summary0), (rec1, end1, _, summary1) = out
    # parameters and running statistics (num_batches_tracked, an integer count of each
    # rank's own steps, differs when a rank stops early: diloco leaves it so too)
    floats = [t for t in end0 if t.is_floating_point()]
    assert len(floats) == len(end0) - 1
    assert _same(floats, [t for t in end1 if t.is_floating_point()])
    assert not torch.equal(end0[0], _params(_model(True))[0])  # it trained
    # before finish the ranks differed (each trains on its own batches)
    assert not _same(rec0[-2]["params"], rec1[-2]["params"])
    total = 37 + (own_steps[1] if own_steps else 37)
    assert sum(summary0["masses"]) == total and summary0["masses"] == summary1["masses"]
    assert 0 < summary0["divergence_mean"] < 1


# -- (b) one fragment, no overlap: exactly diloco -----------------------------------------

def test_one_fragment_without_overlap_is_diloco_bit_for_bit(tmp_path):
    """H = 5 over 13 steps: three syncs, the last one the remainder window; BatchNorm
    buffers merge with the (only) fragment as diloco merges them."""
    diloco = run_ranks(w_loop, 2, str(tmp_path / "a"), "diloco", dict(sync_every=5), 13,
                       batchnorm=True)
    streaming = run_ranks(w_loop, 2, str(tmp_path / "b"), "streaming-diloco",
                          dict(sync_every=5, fragments=1, overlap_steps=0), 13,
                          batchnorm=True)
    for rank in range(2):
        d_rec, d_end, d_stats, _ = diloco[rank]
        s_rec, s_end, s_stats, _ = streaming[rank]
        assert [r["synced"] for r in s_rec] == [r["synced"] for r in d_rec]
        assert sum(r["synced"] for r in s_rec) == 3 and s_stats["syncs"] == d_stats["syncs"] == 3
        for d, s in zip(d_rec, s_rec):
            assert _same(d["params"], s["params"])
        assert _same(d_end, s_end)
    # and it did train, differently on each rank between syncs
    assert not _same(diloco[0][0][5]["params"], diloco[1][0][5]["params"])


def test_four_fragments_are_not_diloco(tmp_path):
    """The comparison above could not pass by accident: fragments change the result."""
    settings = dict(sync_every=8, fragments=4, overlap_steps=0)
    diloco = run_ranks(w_loop, 2, str(tmp_path / "a"), "diloco", dict(sync_every=8), 16)
    streaming = run_ranks(w_loop, 2, str(tmp_path / "b"), "streaming-diloco", settings, 16)
    assert not _same(diloco[0][1], streaming[0][1])
    assert _same(streaming[0][1], streaming[1][1])


# -- (c) bytes per sync -------------------------------------------------------------------

def test_each_sync_moves_about_one_fragment(tmp_path):
    """4 equal fragments: the largest step's writes (but the last) are about a quarter of
    diloco's, while the run's total stays about the same (the model crosses once per H)."""
    h, steps = 8, 32
    diloco = run_ranks(w_loop, 2, str(tmp_path / "a"), "diloco", dict(sync_every=h), steps)
    streaming = run_ranks(w_loop, 2, str(tmp_path / "b"), "streaming-diloco",
                          dict(sync_every=h, fragments=4, overlap_steps=1), steps)
    for rank in range(2):
        d_written = [r["written"] for r in diloco[rank][0]]
        s_written = [r["written"] for r in streaming[rank][0]]
        model_bytes = sum(p.numel() * 4 for p in _model().parameters())
        assert max(d_written) >= model_bytes  # diloco sends the whole model at once
        # (the last step merges every fragment at once, so that every rank ends equal)
        peak = max(s_written[:-1])
        assert 0.2 < peak / max(d_written) < 0.35, (peak, max(d_written))
        assert 0.9 < sum(s_written) / sum(d_written) < 1.3
        # diloco writes on 1 step in 8; streaming spreads its writes over the window
        assert sum(1 for w in d_written if w) == steps // h
        assert sum(1 for w in s_written if w) >= 4 * steps // h
    assert streaming[0][2]["fragment_sizes"] == [WIDTH * WIDTH + WIDTH] * 4


# -- (d) the overlap ----------------------------------------------------------------------

def test_the_exchange_lands_overlap_steps_after_it_starts(tmp_path):
    """Fragment syncs at steps 4, 8, ... (H = 8, F = 2), each applied 3 steps later:
    until then the ranks' copies of that fragment still differ; from the landing step
    on, they are the same global fragment (alpha 0 replaces)."""
    tau, h = 3, 8
    settings = dict(sync_every=h, fragments=2, overlap_steps=tau)
    out = run_ranks(w_loop, 2, str(tmp_path / "run"), "streaming-diloco", settings, 24)
    (rec0, _, stats0, _), (rec1, _, stats1, _) = out
    exchanges = [e for e in stats0["exchanges"] if e["landed"] - e["started"] == tau]
    # every sync but the final one (step 24 merges everything synchronously)
    assert [(e["fragment"], e["started"]) for e in exchanges] == [
        (0, 4), (1, 8), (0, 12), (1, 16), (0, 20)]
    def schedule(stats):  # "ready" (arrived before needed) is timing, per rank
        return [(e["fragment"], e["started"], e["landed"]) for e in stats["exchanges"]]

    assert schedule(stats0) == schedule(stats1)
    parts = {0: slice(0, 4), 1: slice(4, 8)}
    for e in exchanges:
        frag = parts[e["fragment"]]
        started, landed = e["started"] - 1, e["landed"] - 1  # record index of that step
        for i in range(started, landed):  # in flight: nothing applied yet
            assert not _same(rec0[i]["params"][frag], rec1[i]["params"][frag]), (e, i)
        assert _same(rec0[landed]["params"][frag], rec1[landed]["params"][frag]), e


# -- (e) checkpoint and resume ------------------------------------------------------------

@pytest.mark.parametrize("stop_at", [9, 11])
def test_resume_mid_run_matches_an_uninterrupted_run(tmp_path, stop_at):
    """Fragment syncs every 4 steps (H = 12, F = 3), applied 2 steps later. Stopping at
    step 9 leaves an exchange in flight (started at 8, lands at 10): the checkpoint
    carries its averaged delta, applied at the same step after the resume. Step 11:
    between exchanges."""
    settings = dict(sync_every=12, fragments=3, overlap_steps=2, alpha=0.25)
    full = run_ranks(w_loop, 2, str(tmp_path / "a"), "streaming-diloco", settings, 24)
    first = run_ranks(w_loop, 2, str(tmp_path / "b"), "streaming-diloco", settings, 24,
                      stop_at=stop_at)
    state = _checkpoint(first, tmp_path / "ck.pt")
    inflight = state["strategy"]["streaming"]["inflight"]
    assert (inflight is not None) == (stop_at == 9)
    resumed = run_ranks(w_loop, 2, str(tmp_path / "c"), "streaming-diloco", settings, 24,
                        resume=str(tmp_path / "ck.pt"))
    for rank in range(2):
        assert _same(resumed[rank][1], full[rank][1]), rank
        tail = full[rank][0][stop_at:]
        assert all(_same(a["params"], b["params"]) for a, b in zip(tail, resumed[rank][0]))


@pytest.mark.unit
def test_a_checkpoint_for_other_fragments_is_refused():
    saved = StreamingDiLoCo(sync_every=8, fragments=4)
    state = {"streaming": {"fragments": 2, "overlap_steps": 1, "alpha": 0.0}}
    with pytest.raises(ValueError, match="fragments/overlap_steps/alpha"):
        saved.load_state_dict(state)


# -- (f) settings -------------------------------------------------------------------------

@pytest.mark.parametrize("settings, needle", [
    (dict(fragments=0), "--fragments"),
    (dict(fragments=2.5), "--fragments"),
    (dict(fragments=31), "--fragments 31 is more than --sync-every 30"),
    (dict(overlap_steps=-1), "--overlap-steps"),
    (dict(overlap_steps=7), r"--overlap-steps 7 must be below --sync-every 30 // --fragments 4"),
    (dict(sync_every=8, fragments=4, overlap_steps=2), "--overlap-steps 2 must be below"),
    (dict(alpha=1.0), "--alpha 1"),
    (dict(alpha=-0.5), "--alpha"),
    (dict(sync_every_seconds=2.0), "--sync-every-seconds does not apply to --strategy "
     "streaming-diloco"),
])
def test_bad_settings_name_their_flag(settings, needle):
    with pytest.raises(ConfigError, match=needle.replace("-", r"\-").replace("(", r"\(")):
        make_strategy("streaming-diloco", **settings)


@pytest.mark.unit
def test_the_other_strategies_refuse_the_fragment_flags():
    with pytest.raises(ConfigError, match=r"\-\-fragments does not apply to --strategy diloco"):
        make_strategy("diloco", fragments=2)
    defaults = make_strategy("streaming-diloco")
    assert (defaults.fragments, defaults.overlap_steps, defaults.alpha) == (4, 1, 0.0)
    assert defaults.sync_every == 30 and STRATEGIES["streaming-diloco"] is StreamingDiLoCo


def w_too_few_tensors(rank, world, url):
    model = torch.nn.Linear(4, 4)  # 2 parameter tensors
    strategy = make_strategy("streaming-diloco", sync_every=8, fragments=4, overlap_steps=0)
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=30) as sync:
        strategy.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), sync)


def test_more_fragments_than_parameter_tensors_is_refused_on_attach(tmp_path):
    out = run_ranks(w_too_few_tensors, 2, str(tmp_path / "run"), expect_errors=True)
    for failure in out:
        assert isinstance(failure.error, ConfigError)
        assert "--fragments 4 is more than the model's 2 parameter tensors" in str(
            failure.error)


@pytest.mark.unit
def test_partition_is_contiguous_balanced_and_deterministic():
    assert partition([10] * 8, 4) == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    assert partition([100, 1, 1, 1, 100, 1], 2) == [slice(0, 3), slice(3, 6)]  # 102 each
    assert partition([5], 1) == [slice(0, 1)]
    for sizes in ([1, 1000, 1, 1, 1], [640, 64, 4096, 64, 256, 4], list(range(1, 20))):
        for parts in range(1, len(sizes) + 1):
            cut = partition(sizes, parts)
            assert len(cut) == parts and cut[0].start == 0 and cut[-1].stop == len(sizes)
            assert all(a.stop == b.start and a.start < a.stop for a, b in zip(cut, cut[1:]))


# -- the CLI ------------------------------------------------------------------------------

def test_cli_end_to_end(tmp_path):
    """60 steps, H 30, 4 fragments: syncs at steps 7, 15, 22, 30, 37, 45, 52 and the final
    merge of every fragment at 60."""
    metrics = tmp_path / "m.jsonl"
    proc = run_cli("--nproc", 2, "--strategy", "streaming-diloco", "--fragments", 4,
                   "--sync-every", 30, "--overlap-steps", 2, "--steps", 60,
                   "--metrics", metrics, "--no-progress", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    final = final_of(proc.stdout)
    assert final["ranks_agree"] is True and final["strategy"] == "streaming-diloco"
    assert final["rank_steps"] == [60, 60] and final["masses"] == [60, 60]
    assert final["syncs"] == 8 and final["skipped_syncs"] == 0
    assert 0 < final["divergence_mean"] < 1
    synced = [m["step"] for m in read_metrics(metrics) if m["synced"]]
    assert synced == [7, 15, 22, 30, 37, 45, 52, 60]


@pytest.mark.unit
def test_cli_refuses_time_based_cadence(tmp_path):
    proc = run_cli("--nproc", 2, "--strategy", "streaming-diloco", "--sync-every-seconds", 2,
                   "--steps", 10, "--no-progress", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "--sync-every-seconds does not apply to --strategy streaming-diloco" in proc.stderr


def _final(*flags, cwd) -> dict:
    proc = run_cli("--nproc", 2, "--steps", 90, "--no-progress", *flags, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return final_of(proc.stdout)


def test_cli_one_fragment_without_overlap_is_diloco(tmp_path):
    """The same digest end to end: the trainer, the demo model and data, 3 syncs."""
    diloco = _final("--strategy", "diloco", "--sync-every", 30, cwd=tmp_path)
    streaming = _final("--strategy", "streaming-diloco", "--sync-every", 30, "--fragments", 1,
                       "--overlap-steps", 0, cwd=tmp_path)
    assert diloco["ranks_agree"] and streaming["syncs"] == diloco["syncs"] == 3
    assert streaming["param_digest"] == diloco["param_digest"]
    overlapped = _final("--strategy", "streaming-diloco", "--sync-every", 30, "--fragments", 1,
                        "--overlap-steps", 1, cwd=tmp_path)
    assert overlapped["ranks_agree"] and overlapped["param_digest"] != diloco["param_digest"]


def test_cli_int8_outer_gradients(tmp_path):
    """``--sync-option wire_dtype=int8`` sends the fragments' pseudo-gradients as int8."""
    plain = _final("--strategy", "streaming-diloco", "--sync-every", 30, cwd=tmp_path)
    int8 = _final("--strategy", "streaming-diloco", "--sync-every", 30,
                  "--sync-option", "wire_dtype=int8", cwd=tmp_path)
    assert int8["ranks_agree"] and int8["syncs"] == plain["syncs"]
    assert int8["sync_bytes"] * 2 < plain["sync_bytes"], (int8["sync_bytes"],
                                                          plain["sync_bytes"])


def test_cli_interrupted_run_resumes_bit_identically(tmp_path):
    """The real trainer, checkpoints and Ctrl-C: fragment syncs every 5 steps (H 20, F 4),
    each landing 2 steps later, so the checkpoint at step 30 holds the exchange started
    at step 30. Rank 1 is paused inside step 40, the launcher interrupted, the run
    resumed from 30: the same final parameters as an uninterrupted run."""
    import signal
    import time

    from train_cli import start_cli

    flags = ("--nproc", 2, "--model", "train_models:dropout_mlp", "--batch-size", 512,
             "--steps", 50, "--checkpoint-every", 15, "--no-progress",
             "--strategy", "streaming-diloco", "--sync-every", 20, "--fragments", 4,
             "--overlap-steps", 2, "--alpha", 0.5)
    full = run_cli(*flags, "--checkpoint-dir", tmp_path / "ck_full", cwd=tmp_path)
    assert full.returncode == 0, full.stderr
    reference = final_of(full.stdout)
    ck, marker = tmp_path / "ck", tmp_path / "paused.r1"
    proc = start_cli(*flags, "--checkpoint-dir", ck, cwd=tmp_path,
                     FERROSYNC_TEST_PAUSE_AT=40, FERROSYNC_TEST_PAUSE_RANK=1,
                     FERROSYNC_TEST_PAUSE_DIR=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():  # polls a file the paused rank writes
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "rank 1 never reached step 40"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130
    saved = torch.load(ck / "step-00000030.pt", map_location="cpu", weights_only=True)
    inflight = saved["strategy"]["streaming"]["inflight"]
    assert inflight["fragment"] == 1 and inflight["started"] == 30 and inflight["left"] == 2
    resumed = run_cli(*flags, "--checkpoint-dir", ck, "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    final = final_of(resumed.stdout)
    assert final["resumed_from"] == 30 and final["ranks_agree"] is True
    assert final["param_digest"] == reference["param_digest"]
    assert final["syncs"] == reference["syncs"] == 10  # 5, 10, ..., 45 and the last, 50
