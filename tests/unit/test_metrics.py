"""``train/metrics.py``: the metrics file a resumed run continues, the parameter digest,
the summary table and the strict-JSON ``FINAL`` line (docs/design.md#final-line)."""

from __future__ import annotations

import json
import math
import os

import torch

from ferrosync.train.metrics import MetricsWriter, final_line, format_summary, param_digest


def lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_a_fresh_file_gets_one_line_per_record(tmp_path):
    path = tmp_path / "sub" / "m.jsonl"  # its directory is made
    writer = MetricsWriter(str(path))
    for step in (1, 2):
        writer.write({"step": step, "loss": 0.5})
    writer.close()
    assert lines(path) == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.5}]


def test_a_resumed_run_drops_what_the_interrupted_run_wrote_after_its_checkpoint(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(f'{{"step": {s}}}\n' for s in range(1, 8)) + '{"step": 8, "lo')
    writer = MetricsWriter(str(path), resume_step=5)
    writer.write({"step": 6})
    writer.close()
    assert [r["step"] for r in lines(path)] == [1, 2, 3, 4, 5, 6]
    assert os.listdir(tmp_path) == ["m.jsonl"]  # the temporary file was renamed over it


def test_a_new_run_without_resume_starts_the_file_over(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n')
    MetricsWriter(str(path)).close()
    assert path.read_text() == ""


def test_the_digest_changes_with_any_bit_name_or_dtype():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    digest = param_digest(model)
    assert len(digest) == 32 and param_digest(model) == digest
    with torch.no_grad():
        model.bias[0] = torch.nextafter(model.bias[0], torch.tensor(2.0))
    assert param_digest(model) != digest
    renamed = torch.nn.Sequential(torch.nn.Linear(3, 2))
    renamed[0].load_state_dict(model.state_dict())
    assert param_digest(renamed) != param_digest(model)
    assert param_digest(model.double()) != param_digest(model.float())


def summary(**extra) -> dict:
    s = {"world_size": 2, "strategy": "grad", "steps": 12, "epochs": 0.05,
         "resumed_from": None, "samples_per_s": 7070.4, "wall_s": 2.0, "compute_s": 0.5,
         "sync_s": 1.0, "write_s": 0.1, "wait_s": 0.7, "reduce_s": 0.1, "read_s": 0.1,
         "syncs": 12, "skipped_syncs": 0, "checkpoint_s": 0.0, "checkpoints": 0,
         "bytes_written": 517770, "bytes_read": 516336, "requests": 190, "loss": 1.3269,
         "accuracy": 0.5957, "ranks_agree": True, "param_digest": "08a016cea9644b4c" * 4,
         "rank_digests": ["08a016cea9644b4c" * 4] * 2}
    s.update(extra)
    return s


def test_the_summary_has_a_row_per_fact():
    text = format_summary(summary())
    assert text.splitlines()[0] == "ferrosync.train summary"
    rows = {line.split("  ")[1].strip(): line for line in text.splitlines()[1:]}
    assert list(rows) == ["ranks", "steps", "samples/s", "wall time", "compute", "sync",
                          "syncs", "checkpoints", "bytes moved", "storage requests",
                          "final loss", "accuracy", "ranks agree"]
    assert "(50%)" in rows["sync"] and "every step" in rows["syncs"]
    assert "59.57%" in rows["accuracy"] and "yes (digest 08a016cea9644b4c)" in rows[
        "ranks agree"]


def test_the_summary_names_a_directorys_requests_file_operations():
    text = format_summary(summary(requests_are="file operations", requests_per_hour=3600.0,
                                  request_cost_per_hour=None))
    rows = {line.split("  ")[1].strip(): line for line in text.splitlines()[1:]}
    assert "storage requests" not in rows
    assert rows["file operations"].endswith("190 (all ranks), 3,600/hour (a directory: "
                                            "not billed)")
    assert rows["bytes moved"].endswith("(all ranks)") and "190" not in rows["bytes moved"]
    billed = format_summary(summary(requests_are="storage requests", requests_per_hour=36.0,
                                    request_cost_per_hour=0.5))
    assert "190 (all ranks), 36/hour, $0.5000/hour at list prices" in billed


def test_the_summary_says_which_ranks_disagree_and_how_often_a_strategy_synced():
    text = format_summary(summary(
        ranks_agree=False, rank_digests=["aa" * 32, "bb" * 32], strategy="diloco",
        sync_every=30, divergence=0.0123, divergence_mean=0.0201, masses=[30, 28],
        eval_loss=0.9, resumed_from=6))
    assert "NO: rank 0 aaaaaaaaaaaa, rank 1 bbbbbbbbbbbb" in text
    assert "every 30 steps, 0 skipped), divergence last 0.0123 mean 0.0201" in text
    assert "batches per rank 30/28" in text and "resumed at step 6" in text
    assert "eval loss" in text
    assert "every 5 s" in format_summary(summary(sync_every_seconds=5.0))


def test_the_final_line_is_strict_json_on_one_line():
    line = final_line({"steps": 3, "loss": math.nan, "accuracy": math.inf, "b": [1, 2]})
    assert line.startswith("FINAL {") and "\n" not in line
    record = json.loads(line[len("FINAL "):])
    assert record == {"steps": 3, "loss": None, "accuracy": None, "b": [1, 2]}
    assert list(record) == sorted(record)

