"""Strategies on real rank processes: the merge arithmetic, idle ranks, DiLoCo's outer step,
equivalence with gradient averaging, time-based windows and the two-level sync.

Parameters are driven with hand-set gradients and lr 1 where the test checks exact
arithmetic, so every expected value is a small dyadic number (exact in float32).
"""

from __future__ import annotations

import time

import pytest
import torch

import ferrosync
from ferrosync.errors import ConfigError
from ferrosync.strategies import (
    STRATEGIES,
    DiLoCo,
    GradAveraging,
    LocalSGD,
    Strategy,
    known_settings,
    make_strategy,
)
from ferrosync.strategies.periodic import apportion
from ranks import run_ranks

HB = {"heartbeat_interval": 0.2}


def _connect(url, rank, world, *, nodes_of=None):
    options = dict(HB)
    if nodes_of:  # two-level: nodes of `nodes_of` ranks, gloo inside, the directory between
        options.update(local="gloo", local_rank=rank % nodes_of, local_world_size=nodes_of)
    return ferrosync.connect(url, rank=rank, world_size=world, timeout=60, **options)


def _two_params() -> torch.nn.Module:
    """A 2-parameter model (weight and bias of Linear(1, 1)), both starting at 0."""
    model = torch.nn.Linear(1, 1)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def _local_step(strategy, model, optimizer, grad: float) -> dict:
    """One training step through the strategy, every gradient entry set to ``grad``."""
    for p in model.parameters():
        p.grad = torch.full_like(p, grad)
    return strategy.step(model, optimizer)


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# -- weighted merges --------------------------------------------------------------------

def w_weighted(rank, world, url, steps, gamma):
    """Rank r takes steps[r] steps with gradient -(r + 1) * 4 (lr 1), then everyone merges."""
    model = _two_params()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    strategy = LocalSGD(sync_every=1000, gamma=gamma)
    with _connect(url, rank, world) as sync:
        strategy.attach(model, opt, sync)
        for _ in range(steps[rank]):
            _local_step(strategy, model, opt, -4.0 * (rank + 1))
        before = _params(model)
        telemetry = strategy.synchronize(model, opt)
        return before, _params(model), telemetry, strategy.stats


@pytest.mark.parametrize("gamma", [1.0, 0.0])
def test_masses_3_1_0_give_the_work_weighted_average(tmp_path, gamma):
    out = run_ranks(w_weighted, 3, str(tmp_path / "run"), [3, 1, 0], gamma)
    a, b, c = (before[0] for before, *_ in out)
    assert a.item() == 12.0 and b.item() == 8.0 and c.item() == 0.0  # 3*4, 1*8, untouched
    expected = (3 * a + 1 * b) / 4 if gamma == 1.0 else (a + b) / 2   # rank 2 weighs 0
    for rank, (before, after, telemetry, stats) in enumerate(out):
        assert torch.equal(after[0], expected), (rank, after[0], expected)
        assert torch.equal(after[1], expected.view(1))  # the bias
        assert telemetry["masses"] == [3, 1, 0] and telemetry["skipped"] is False
        assert stats["masses"] == [3, 1, 0] and stats["syncs"] == 1
        # telemetry: ||pre - post|| / ||post|| from this rank's own starting point
        pre, post = (torch.cat([t.flatten() for t in ts]) for ts in (before, after))
        assert telemetry["divergence"] == pytest.approx(
            torch.linalg.vector_norm(pre - post).item() / telemetry["post_norm"])
        assert telemetry["pre_norm"] == pytest.approx(torch.linalg.vector_norm(pre).item())
        assert telemetry["post_norm"] == pytest.approx(torch.linalg.vector_norm(post).item())
        assert telemetry["sync_bytes"] > 0


def w_all_idle(rank, world, url, strategy_name):
    model = _two_params()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    strategy = make_strategy(strategy_name, sync_every=1000)
    with _connect(url, rank, world) as sync:
        strategy.attach(model, opt, sync)
        with torch.no_grad():  # ranks now differ, but nobody trained a batch
            for p in model.parameters():
                p.fill_(rank + 0.5)
        telemetry = strategy.synchronize(model, opt)
        return _params(model), telemetry, strategy.stats


@pytest.mark.parametrize("strategy_name", ["local-sgd", "diloco"])
def test_all_idle_skips_the_merge_on_every_rank(tmp_path, strategy_name):
    out = run_ranks(w_all_idle, 3, str(tmp_path / "run"), strategy_name)
    for rank, (params, telemetry, stats) in enumerate(out):
        assert all(torch.equal(p, torch.full_like(p, rank + 0.5)) for p in params), rank
        assert telemetry["skipped"] is True and telemetry["masses"] == [0, 0, 0]
        assert stats["skipped"] == 1 and stats["syncs"] == 1


def w_rank_runs_dry(rank, world, url, windows, h):
    """Rank r has data for windows[r] windows of h steps, then calls finish()."""
    model = _two_params()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    strategy = LocalSGD(sync_every=h)
    merges = []
    with _connect(url, rank, world) as sync:
        strategy.attach(model, opt, sync)
        for _ in range(windows[rank] * h):
            telemetry = _local_step(strategy, model, opt, -1.0)
            if telemetry["synced"]:
                merges.append((telemetry["masses"], telemetry["divergence"], _params(model)))
        strategy.finish(model, opt)
        return merges, _params(model), strategy.stats


def test_a_rank_without_batches_neither_hangs_nor_skews(tmp_path):
    """Rank 1 runs out of data after one window; rank 0 trains two more. Rank 1's
    finish() joins those syncs with zero mass: rank 0's progress is never pulled back."""
    h = 2
    (m0, p0, s0), (m1, p1, s1) = run_ranks(w_rank_runs_dry, 2, str(tmp_path / "run"),
                                           [3, 1], h)
    assert [m for m, _, _ in m0] == [[2, 2], [2, 0], [2, 0]]
    # after the first merge both ranks sit at 2; then only rank 0 moves: +2 per window
    assert [params[0].item() for _, _, params in m0] == [2.0, 4.0, 6.0]
    assert [d for _, d, _ in m0[1:]] == [0.0, 0.0]  # nothing pulled rank 0's weights
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    # ...and the last, idle one in which both voted done (nothing left to merge)
    assert s0["syncs"] == s1["syncs"] == 4 and s1["masses"] == [6, 2]
    assert s0["skipped"] == s1["skipped"] == 1


# -- DiLoCo ------------------------------------------------------------------------------

def w_diloco(rank, world, url, grads, outer_device):
    """Two windows of one local step each; returns θ after each outer step."""
    model = _two_params()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    strategy = DiLoCo(sync_every=1, outer_lr=0.7, outer_momentum=0.9,
                      outer_device=outer_device)
    out = []
    with _connect(url, rank, world) as sync:
        strategy.attach(model, opt, sync)
        for window in grads:
            for p, value in zip(model.parameters(), window[rank]):
                p.grad = torch.full_like(p, value)
            strategy.step(model, opt)
            out.append(_params(model))
        return out, strategy.state_dict()


@pytest.mark.parametrize("outer_device", [None, "cpu"])
def test_diloco_outer_step_is_nesterov_on_the_averaged_pseudo_gradient(tmp_path,
                                                                        outer_device):
    # grads[window][rank] = (d loss / d weight, d loss / d bias)
    grads = [[(1.0, -2.0), (3.0, 0.5)], [(-1.0, 4.0), (0.25, 1.0)]]
    out = run_ranks(w_diloco, 2, str(tmp_path / "run"), grads, outer_device)
    lr_in, lr_out, mu = 0.5, 0.7, 0.9
    theta = [0.0, 0.0]
    buf = None
    expected = []
    for window in grads:
        # each rank: θ_r = θ - lr_in * g_r; pseudo-gradient Δ = θ - mean(θ_r)
        delta = [theta[i] - sum(theta[i] - lr_in * g[i] for g in window) / 2 for i in range(2)]
        buf = delta if buf is None else [mu * b + d for b, d in zip(buf, delta)]
        update = [d + mu * b for d, b in zip(delta, buf)]  # Nesterov
        theta = [t - lr_out * u for t, u in zip(theta, update)]
        expected.append(list(theta))
    for rank, (windows, state) in enumerate(out):
        for got, want in zip(windows, expected):
            assert [p.item() for p in got] == pytest.approx(want, abs=1e-6), rank
        assert [g.item() for g in state["global"]] == pytest.approx(expected[-1], abs=1e-6)
        momentum = [s["momentum_buffer"].item() for s in state["outer"]["state"].values()]
        assert momentum == pytest.approx(buf, abs=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(out[0][0][-1], out[1][0][-1]))


# -- equivalence with gradient averaging -------------------------------------------------

def w_fit_equivalence(rank, world, url):
    import train_models

    train, _ = train_models.small_data()
    results = {}
    with _connect(url, rank, world) as sync:
        for label, strategy in (("grad", GradAveraging()), ("local", LocalSGD(sync_every=1))):
            trainer = ferrosync.Trainer(
                train_models.wide_mlp, lambda p: torch.optim.SGD(p, lr=0.1),
                torch.nn.functional.cross_entropy, train, batch_size=20, steps=12,
                strategy=strategy, progress=False, report=False, rank=rank,
                world_size=world)
            results["init"] = _params(trainer.model)
            summary = trainer.fit(sync)
            results[label] = (summary, _params(trainer.model))
    return results


def test_local_sgd_every_step_with_plain_sgd_equals_gradient_averaging(tmp_path):
    out = run_ranks(w_fit_equivalence, 2, str(tmp_path / "run"))
    grad_params, local_params = out[0]["grad"][1], out[0]["local"][1]
    assert not torch.equal(grad_params[0], out[0]["init"][0])  # it trained
    for g, p in zip(grad_params, local_params):
        torch.testing.assert_close(p, g, rtol=1e-6, atol=1e-6)
    summary = out[0]["local"][0]
    assert summary["ranks_agree"] and summary["syncs"] == 12 and summary["masses"] == [12, 12]


# -- time-based windows -----------------------------------------------------------------

class SlowOnRankZero(torch.nn.Module):
    """Rank 0 is a slow device: every training forward takes a second."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.BatchNorm1d(8),
                                       torch.nn.ReLU(), torch.nn.Linear(8, 4))
        self.delay = 1.0 if rank == 0 else 0.0

    def forward(self, x):
        if self.training and self.delay:
            time.sleep(self.delay)  # simulates a slow GPU, not a synchronisation
        return self.net(x)


def w_time_based(rank, world, url, metrics):
    import train_models

    train, _ = train_models.small_data()
    strategy = DiLoCo(sync_every_seconds=0.5)
    trainer = ferrosync.Trainer(
        lambda: SlowOnRankZero(rank), lambda p: torch.optim.SGD(p, lr=0.1),
        torch.nn.functional.cross_entropy, train, batch_size=20, steps=2,
        strategy=strategy, progress=False, report=False, metrics_path=metrics, rank=rank,
        world_size=world)
    with _connect(url, rank, world) as sync:
        return trainer.fit(sync)


def test_time_based_windows_share_a_budget_by_speed(tmp_path):
    """2 steps x 2 ranks = 4 batches. Window 1: slow rank 0 does 1 batch (its step
    outlasts the 0.5 s window), fast rank 1 reaches its quota of 2. The remaining batch
    goes to the faster rank, so rank 0 joins the second sync idle, with zero mass."""
    metrics = tmp_path / "m.jsonl"
    out = run_ranks(w_time_based, 2, str(tmp_path / "run"), str(metrics))
    for summary in out:
        assert summary["ranks_agree"], summary["rank_digests"]  # BatchNorm buffers too
        assert summary["masses"] == [1, 3], summary["masses"]
        assert summary["rank_steps"] == [1, 3] and summary["samples"] == 4 * 20
        assert summary["syncs"] == 2 and summary["skipped_syncs"] == 0
    from train_cli import read_metrics

    lines = read_metrics(metrics)
    assert [(m["step"], m["loss"] is None, m["masses"]) for m in lines] == [
        (1, False, [1, 2]), (1, True, [0, 1])]


@pytest.mark.unit
def test_apportion_is_exact_and_deterministic():
    assert apportion(1, [2, 1]) == [1, 0]
    assert apportion(1, [1, 2]) == [0, 1]
    assert apportion(7, [0, 0, 0]) == [3, 2, 2]
    assert apportion(10, [5, 3, 2]) == [5, 3, 2]
    for total in range(0, 50):
        for shares in ([1, 1, 1], [7, 0, 2], [100, 1, 1, 1]):
            q = apportion(total, shares)
            assert sum(q) == total and all(x >= 0 for x in q)


# -- two-level sync ----------------------------------------------------------------------

def w_two_level(rank, world, url, nodes_of, steps):
    model = _two_params()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    strategy = DiLoCo(sync_every=1000, outer_lr=1.0, outer_momentum=0.0)  # = model averaging
    with _connect(url, rank, world, nodes_of=nodes_of) as sync:
        strategy.attach(model, opt, sync)
        for _ in range(steps[rank]):
            _local_step(strategy, model, opt, -4.0 * (rank + 1))
        telemetry = strategy.synchronize(model, opt)
        strategy.finish(model, opt)
        return _params(model), telemetry


def test_strategies_run_unchanged_over_the_two_level_sync(tmp_path):
    steps = [3, 1, 0, 2]  # rank 2 (first rank of node 2) idle
    two = run_ranks(w_two_level, 4, str(tmp_path / "two"), 2, steps)
    flat = run_ranks(w_two_level, 4, str(tmp_path / "flat"), None, steps)
    # θ_r = 4 (r + 1) steps_r: 12, 8, 0, 32; weights 3, 1, 0, 2
    expected = (3 * 12.0 + 1 * 8.0 + 2 * 32.0) / 6
    for rank in range(4):
        params, telemetry = two[rank]
        assert telemetry["masses"] == steps
        assert all(p.item() == pytest.approx(expected, abs=1e-5) for p in params), params
        assert all(torch.equal(a, b) for a, b in zip(params, two[0][0]))
        assert all(torch.equal(a, b) for a, b in zip(params, flat[rank][0]))


# -- settings ----------------------------------------------------------------------------

@pytest.mark.unit
def test_strategy_registry_and_settings():
    assert isinstance(make_strategy("grad"), GradAveraging)
    assert isinstance(make_strategy("grad", sync_every=1), GradAveraging)
    local = make_strategy("local-sgd", sync_every_seconds=2.5, gamma=0.0)
    assert isinstance(local, LocalSGD) and not local.lockstep and local.gamma == 0.0
    diloco = make_strategy("diloco", outer_lr=0.5, outer_device="cpu")
    assert diloco.sync_every == 30 and diloco.outer_lr == 0.5 and diloco.lockstep
    assert make_strategy("local-sgd").sync_every == 20
    assert all(isinstance(s, Strategy) for s in (local, diloco))
    bad = [
        (dict(name="allreduce"), "unknown strategy"),
        (dict(name="grad", sync_every=4), "--sync-every does not apply to --strategy grad"),
        (dict(name="grad", gamma=0.5), "--gamma does not apply"),
        (dict(name="local-sgd", outer_lr=0.5), "--outer-lr does not apply"),
        (dict(name="diloco", sync_every=5, sync_every_seconds=1.0), "not both"),
        (dict(name="diloco", gamma=-1.0), "gamma must be"),
        (dict(name="diloco", outer_momentum=float("nan")), "outer_momentum must be"),
        (dict(name="diloco", outer_device="tpu9"), "not a torch device"),
        (dict(name="local-sgd", sync_every=0), "sync_every must be"),
        (dict(name="diloco", fragments=2), "--fragments does not apply to --strategy diloco"),
        (dict(name="streaming-diloco", sync_every_seconds=1.0), "--sync-every-seconds does "
         "not apply to --strategy streaming-diloco"),
    ]
    for kwargs, needle in bad:
        with pytest.raises(ConfigError, match=needle.replace("-", r"\-")):
            make_strategy(**kwargs)


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.unit
def test_every_registered_strategy_builds_with_defaults(name):
    strategy = make_strategy(name)
    assert type(strategy) is STRATEGIES[name] and strategy.name == name
    assert set(STRATEGIES[name].settings) <= set(known_settings())
    # every setting a strategy declares is a keyword its constructor takes
    for key in STRATEGIES[name].settings:
        assert isinstance(make_strategy(name, **{key: None}), STRATEGIES[name])


@pytest.mark.unit
def test_a_new_strategy_is_one_registry_entry(monkeypatch):
    """make_strategy needs nothing but the entry: the class declares its settings."""
    class Every(LocalSGD):
        name = "every"
        settings = ("sync_every",)
        refuses_because = "only takes --sync-every"

    monkeypatch.setitem(STRATEGIES, Every.name, Every)
    assert make_strategy("every", sync_every=3).sync_every == 3
    with pytest.raises(ConfigError, match="--gamma does not apply to --strategy every, "
                       "which only takes --sync-every"):
        make_strategy("every", gamma=0.5)


# -- BatchNorm under grad -----------------------------------------------------------------

def _bn_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.ReLU(), torch.nn.Linear(8, 4))


def w_grad_bn(rank, world, url, ck, steps, resume):
    import train_models

    train, _ = train_models.small_data()
    trainer = ferrosync.Trainer(
        _bn_model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        torch.nn.functional.cross_entropy, train, batch_size=20, steps=steps,
        checkpoint_dir=ck, checkpoint_every=3, resume=resume, progress=False,
        report=False, rank=rank, world_size=world)
    with _connect(url, rank, world) as sync:
        return trainer.fit(sync)


def test_grad_with_batchnorm_ends_identical_and_resumes_bit_identically(tmp_path):
    """Each rank's running statistics follow its own batches: they are averaged at the
    end, and checkpointed per rank so a resumed run matches an uninterrupted one."""
    full = run_ranks(w_grad_bn, 2, str(tmp_path / "a"), str(tmp_path / "ck_a"), 6, False)
    run_ranks(w_grad_bn, 2, str(tmp_path / "b"), str(tmp_path / "ck_b"), 3, False)
    assert (tmp_path / "ck_b" / "step-00000003.r1.pt").exists()
    resumed = run_ranks(w_grad_bn, 2, str(tmp_path / "c"), str(tmp_path / "ck_b"), 6, True)
    assert full[0]["ranks_agree"] and resumed[0]["ranks_agree"]
    assert resumed[0]["resumed_from"] == 3
    assert resumed[0]["param_digest"] == full[0]["param_digest"]


def w_count_collectives(rank, world, url, name, settings, steps, plan):
    """``steps`` steps of ``name``; returns (syncs, collectives this rank ran, params)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy = make_strategy(name, **settings)
    with _connect(url, rank, world) as sync:
        strategy.attach(model, opt, sync)
        if plan:
            strategy.begin(steps)
        before = sync.stats["total"]["collectives"]
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * rank + step)
            opt.zero_grad()
            model(torch.randn(8, 4, generator=g)).square().mean().backward()
            strategy.step(model, opt)
        strategy.finish(model, opt)
        return (strategy.summary()["syncs"], sync.stats["total"]["collectives"] - before,
                _params(model))


@pytest.mark.parametrize("name, settings", [
    ("diloco", {"sync_every": 4}),
    ("streaming-diloco", {"sync_every": 8, "fragments": 2, "overlap_steps": 1}),
])
def test_a_lockstep_sync_with_a_known_end_is_one_collective(tmp_path, name, settings):
    """With ``begin`` every rank's record is its own: each sync is its merge alone (the
    record gather would cost a latency-bound exchange per sync on a slow link).
    Without ``begin`` (the end unknown) the gather stays: two collectives per sync."""
    known = run_ranks(w_count_collectives, 2, str(tmp_path / "a"), name, settings, 18, True)
    unknown = run_ranks(w_count_collectives, 2, str(tmp_path / "b"), name, settings, 18, False)
    for syncs, collectives, _ in known:  # streaming's final merge is one collective too
        assert syncs >= 4 and collectives == syncs
    for syncs, collectives, _ in unknown:
        assert syncs >= 4 and collectives >= 2 * syncs
    assert all(torch.equal(a, b) for a, b in zip(known[0][2], known[1][2]))


def w_stops_early(rank, world, url, stop_at):
    """Both ranks announce 12 steps with ``begin``; rank 1 leaves after ``stop_at``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    strategy = DiLoCo(sync_every=4)
    started = time.monotonic()
    with _connect(url, rank, world) as sync:
        strategy.attach(model, opt, sync)
        strategy.begin(12)
        try:
            for _ in range(12 if rank == 0 else stop_at):
                opt.zero_grad()
                model(torch.randn(8, 4)).square().mean().backward()
                strategy.step(model, opt)
            strategy.finish(model, opt)
        except ferrosync.FerrosyncError as exc:
            return type(exc).__name__, str(exc), time.monotonic() - started
        return None, None, time.monotonic() - started


@pytest.mark.timing
def test_a_rank_that_breaks_its_announced_end_fails_its_peer_promptly(tmp_path):
    """``begin(total)`` promises every rank trains to ``total``; a loop that stops one
    rank early breaks that promise. The peer still waiting must get a typed error
    naming the missing rank (the one that left closed its GradSync, so its heartbeat
    says so) long before the collective's 60 s timeout, not hang."""
    out = run_ranks(w_stops_early, 2, str(tmp_path / "run"), 6)
    kind, message, took = out[0]
    assert kind == "PeerFailed", out[0]
    assert "rank 1" in message and took < 30, out[0]
    assert out[1][0] is None  # the rank that left saw no error of its own
