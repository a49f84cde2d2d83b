"""The figures' parsing and writing (ferrosync/testing/figures.py, which
tools/docs/regen_figures.py runs), in-process on made-up runs: the script itself runs
benchmarks for half an hour, so none is run here (tests/test_tools.py runs its command
line's refusals and bench_strategies' ``--tiny``)."""

import os

import pytest

from ferrosync.testing import figures as rf

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(doc):
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        return f.read()


def srow(ranks, strategy, h=None, *, acc=0.9, per_seed=None, seeds=(0,), written=1e6,
         syncs=100, wall=1.0, vs_grad=None, pp=None, loss=0.2, frag=None):
    """One bench_strategies JSON row (the fields the figures read)."""
    row = {"ranks": ranks, "strategy": strategy, "sync_every": h, "seeds": list(seeds),
           "accuracy": acc, "accuracy_per_seed": per_seed or [acc] * len(seeds),
           "eval_loss": loss, "train_wall_s": wall, "bytes_written_per_rank": written,
           "syncs": syncs, "bytes_written_per_sync": written / syncs}
    if frag:
        row["fragments"], row["overlap_steps"] = frag
    if strategy != "grad":
        row["bytes_vs_grad"], row["accuracy_vs_grad_pp"] = vs_grad, pp
    return row


def test_span_collapses_equal_values_and_writes_minus_signs():
    assert rf.span([]) == "—"
    assert rf.span([1.234, 1.2351]) == "1.23–1.24×"
    assert rf.span([1.231, 1.234]) == "1.23×"
    assert rf.span([-0.5, -0.25], "{:+.2f}", " pp") == "−0.50–−0.25 pp"
    assert rf.span([4.41, 4.62], "{:.1f}", " s") == "4.4–4.6 s"


def test_write_between_puts_a_table_on_lines_of_its_own_and_names_the_document():
    text = "a <!-- figures:x -->old<!-- /figures:x --> b"
    assert rf.write_between(text, "x", "1.2×") == "a <!-- figures:x -->1.2×<!-- /figures:x --> b"
    assert rf.write_between(text, "x", "| t |") == (
        "a <!-- figures:x -->\n| t |\n<!-- /figures:x --> b")
    with pytest.raises(SystemExit, match="docs/train.md has no <!-- figures:y -->"):
        rf.write_between(text, "y", "z", "docs/train.md")


def bench_row(backend, payload, **fields):
    return {"world": 2, "payload": payload, "backend": backend, "threads": "default",
            "p50_ms": 10.0, **fields}


def test_bench_figures_read_the_seaweed_rows_cpu_bound_and_requests():
    mib = 1 << 20
    runs = []
    for k in range(2):
        rows = []
        for p in (1, 16, 64):
            rows.append(bench_row("s3-seaweed", p * mib, vs_floor=1.5 + k / 10,
                                  server_cpu_ms=40.0 * p, ranks_cpu_ms=20.0 * p, cores=2,
                                  floor_ms=10.0 * p, cpu_bound_vs_floor=3.0,
                                  vs_cpu_bound=1.1 + k / 100, requests_rank0=2.0 + k))
        for backend in rf.EMULATORS:
            rows += [bench_row(backend, p * mib, vs_floor=2.0, requests_rank0=3.0)
                     for p in (1, 16)]
        runs.append({"rows": rows})
    figs = rf.figures(runs, 1)
    assert set(rf.FIGURES) <= set(figs)
    assert figs["s3-floor"] == "1.50–1.60× at 1 MiB, 1.50–1.60× at 16 MiB, 1.50–1.60× at 64 MiB"
    assert figs["s3-cpu"].startswith("40 + 20 ms at 1 MiB, 640 + 320 ms at 16 MiB")
    assert figs["s3-cpu-bound"].startswith("3.00× at 1 MiB")
    assert figs["s3-vs-bound"].startswith("1.10–1.11× at 1 MiB")
    # the server's CPU alone over the 2 cores: 40 ms / 2 / 10 ms
    assert figs["s3-server-floor"].startswith("2.00× at 1 MiB")
    assert figs["s3-requests"].startswith("2.0–3.0 at 1 MiB")
    assert figs["emulator-requests"] == ("gcs-emulator 3.0 at 1 MiB, 3.0 at 16 MiB; "
                                         "azurite 3.0 at 1 MiB, 3.0 at 16 MiB")
    # rows without the figure (another table's runs) leave a dash, not an error
    assert rf.figures([{"rows": []}], 1)["s3-cpu"].startswith("— + — ms at 1 MiB")


def test_strategies_figures_come_from_the_commands_shown_before_them():
    default = ["python", "tools/bench/bench_strategies.py"]
    seeds = [*default, "--ranks", "3", "--strategies", "diloco", "--sync-every", "30", "50",
             "--seeds", "0", "1", "2"]
    streaming = [*default, "--ranks", "2", "--strategies", "diloco", "streaming-diloco",
                 "--sync-every", "30", "--fragments", "4", "--overlap-steps", "0", "1",
                 "--seeds", "0", "1"]
    assert rf.strategy_places(read("docs/performance.md")) == [("strategies-table", default),
                                                      ("streaming-summary", streaming)]
    assert rf.strategy_places(read("docs/train.md")) == [
        ("strategies-demo", default), ("strategies-seeds", seeds),
        ("streaming-table", streaming), ("streaming-summary", streaming)]
    for doc in rf.STRATEGY_DOCS:
        assert "strategies-machine" in rf.markers(read(doc))
    assert "streaming-machine" in rf.markers(read("docs/train.md"))


def test_strategy_places_joins_bash_continuations_and_refuses_a_figure_without_command():
    text = ("```bash\npython tools/bench/bench_strategies.py --ranks 2 \\\n    --seeds 0 1\n```\n"
            "<!-- figures:streaming-table -->x<!-- /figures:streaming-table -->\n"
            "<!-- figures:machine -->m<!-- /figures:machine -->")
    assert rf.strategy_places(text) == [
        ("streaming-table", ["python", "tools/bench/bench_strategies.py", "--ranks", "2",
                             "--seeds", "0", "1"])]
    with pytest.raises(SystemExit, match="strategies-seeds"):
        rf.strategy_places("<!-- figures:strategies-seeds -->x<!-- /figures:strategies-seeds"
                           " -->\n`python tools/bench/bench_strategies.py`")


def test_tiny_strategies_commands_keep_the_first_value_of_each_list():
    """The command keeps its values and gets bench_strategies' own ``--tiny``, which cuts
    each list to its first value (tests/test_tools.py runs that)."""
    command = ["python", "tools/bench/bench_strategies.py", "--ranks", "3",
               "--sync-every", "30", "50", "--seeds", "0", "1", "2"]
    assert rf.shrink_strategies(command) == [*command, "--tiny"]


def demo_runs():
    """Three runs of a 2-rank command: bytes differ by a byte, training times vary."""
    return [[srow(2, "grad", acc=0.9314, written=52.77e6 + k, syncs=2560, wall=4.4 + k / 10),
             srow(2, "diloco", 20, acc=0.9360, written=2.67e6, syncs=128, wall=2.0,
                  vs_grad=19.76, pp=0.46),
             srow(2, "diloco", 30, acc=0.9329, written=1.79e6 - k, syncs=86, wall=1.9,
                  vs_grad=29.4, pp=0.15)]
            for k in range(3)]


def test_demo_and_readme_tables_write_exact_values_and_time_ranges():
    check = rf.Check()
    configs = rf.by_config(demo_runs())
    demo = rf.demo_table(configs, check).splitlines()
    assert demo[2] == "| 2 | grad | — | 93.14 % | — | 4.4–4.6 s | 52.77 MB | — | 2,560 |"
    assert demo[3] == "| 2 | diloco | 20 | 93.60 % | +0.46 pp | 2.0 s | 2.67 MB | 19.8× | 128 |"
    readme = rf.readme_table(configs, check).splitlines()
    assert readme[2:] == ["| 2 | grad | 93.14 % | 52.77 MB | — |",
                          "| 2 | diloco, H=20 / 30 | 93.60 / 93.29 % | 2.67 / 1.79 MB | "
                          "19.8× / 29.4× |"]
    assert check.disagreements == []


def test_a_deterministic_figure_the_runs_disagree_on_is_written_as_a_range_and_reported():
    runs = demo_runs()
    runs[1][1]["accuracy"] = 0.9370
    check = rf.Check()
    table = rf.demo_table(rf.by_config(runs), check)
    assert "| 93.60–93.70 % |" in table
    assert check.disagreements == ["2 ranks diloco H=20 accuracy: 93.60–93.70 % over 3 runs"]
    with pytest.raises(ValueError, match="different configurations"):
        rf.by_config([runs[0], runs[1][:2]])


def seeds_runs():
    return [[srow(3, "grad", acc=0.9476, per_seed=[0.95, 0.94, 0.9528], seeds=(0, 1, 2)),
             srow(3, "diloco", 50, acc=0.9377, per_seed=[0.93, 0.9400, 0.9431],
                  seeds=(0, 1, 2), vs_grad=48.1, pp=-0.99)]
            for _ in range(2)]


def test_seeds_sentence_gives_each_h_against_grad_mean_and_per_seed():
    assert rf.seeds_sentence(rf.by_config(seeds_runs()), rf.Check()) == (
        "grad 94.76 %, diloco H = 50 93.77 % (−0.99 pp, 48.1× fewer bytes; "
        "seeds 0 / 1 / 2: −2.0 / +0.0 / −1.0 pp)")
    two_ranks = seeds_runs()
    for rows in two_ranks:
        rows.append(srow(2, "grad", seeds=(0, 1, 2)))
    with pytest.raises(SystemExit, match="one --ranks value"):
        rf.seeds_sentence(rf.by_config(two_ranks), rf.Check())


def streaming_runs():
    seeds = (0, 1)
    return [[srow(2, "grad", acc=0.9373, per_seed=[0.9314, 0.9431], seeds=seeds,
                  written=52.77e6, syncs=2560, wall=10.1, loss=0.1542),
             srow(2, "diloco", 30, acc=0.9342, per_seed=[0.9329, 0.9355], seeds=seeds,
                  written=1.79e6, syncs=86, wall=2.6 + k, vs_grad=29.5, pp=-0.31),
             srow(2, "streaming-diloco", 30, acc=0.9336, per_seed=[0.9333, 0.9338],
                  seeds=seeds, written=1.87e6, syncs=342, wall=5.6, vs_grad=28.2, pp=-0.37,
                  frag=(4, 0)),
             srow(2, "streaming-diloco", 30, acc=0.9336, per_seed=[0.9263, 0.9409],
                  seeds=seeds, written=1.87e6, syncs=342, wall=7.3, vs_grad=28.2, pp=-0.37,
                  frag=(4, 1))]
            for k in range(3)]


def test_streaming_table_and_summary():
    check = rf.Check()
    configs = rf.by_config(streaming_runs())
    table = rf.streaming_table(configs, check).splitlines()
    assert table[0].startswith("| strategy | F/τ | accuracy (seeds 0, 1) | vs grad |")
    assert table[3] == ("| diloco | — | 93.42 % (93.29, 93.55) | −0.31 pp | 0.2000 | 1.79 MB "
                        "| 20.8 kB | 86 | 2.6–4.6 s |")
    assert table[5].startswith("| streaming-diloco | 4/1 | 93.36 % (92.63, 94.09) |")
    assert rf.streaming_summary(configs, check) == (
        "93.36 % (F/τ 4/0), 93.36 % (F/τ 4/1) against `diloco`'s 93.42 %, with 3.8× fewer "
        "bytes per sync (+4 % in total) over 4.0× as many syncs")
    assert check.disagreements == []
