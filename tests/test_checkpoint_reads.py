"""Checkpoint reads (ferrosync/train/checkpoint.py) are bounded by what latest.json
declares: a step file that grew after it was written is refused unread, with one line
naming it and the declared size, however large it claims to be (sparse files cost
nothing here). Peak memory is measured by tools/bounded_reads.py, not here.
"""

from __future__ import annotations

import json
import os
import uuid

import pytest
import torch

from ferrosync.errors import ConfigError
from ferrosync.train.checkpoint import LATEST, CheckpointStore

pytestmark = pytest.mark.unit


def _saved(url: str, *, rank_files: bool = False) -> tuple[CheckpointStore, dict]:
    ckpt = CheckpointStore(url)
    sizes = {}  # what the trainer gathers from its ranks
    if rank_files:
        for rank in range(2):
            sizes[ckpt.rank_key(7, rank)] = ckpt.save_rank(
                7, rank, {"w": torch.full((100,), float(rank))})
    ckpt.save({"w": torch.arange(1000.0)}, {"step": 7, "rank_files": rank_files}, keep=2,
              rank_sizes=sizes)
    return ckpt, ckpt.latest()


def test_latest_declares_every_file_of_its_step(tmp_path):
    ckpt, meta = _saved(str(tmp_path), rank_files=True)
    names = ["step-00000007.pt", "step-00000007.r0.pt", "step-00000007.r1.pt"]
    assert sorted(meta["bytes"]) == names
    for name in names:
        assert meta["bytes"][name] == os.path.getsize(tmp_path / name)
    assert torch.equal(ckpt.load(meta)["w"], torch.arange(1000.0))
    assert torch.equal(ckpt.load_rank(meta, 1)["w"], torch.full((100,), 1.0))


@pytest.mark.parametrize("grown", ["step-00000007.pt", "step-00000007.r1.pt"])
def test_a_file_that_grew_is_refused_unread(tmp_path, grown):
    ckpt, meta = _saved(str(tmp_path), rank_files=True)
    declared = meta["bytes"][grown]
    os.truncate(tmp_path / grown, 1 << 40)  # sparse: 1 TiB claimed, no block written
    before = ckpt.storage.counters.snapshot()["bytes_read"]
    with pytest.raises(ConfigError) as info:
        ckpt.load(meta) if grown == meta["file"] else ckpt.load_rank(meta, 1)
    text = str(info.value)
    assert str(tmp_path / grown) in text and f"{declared} bytes {LATEST}" in text
    assert "\n" not in info.value.what
    assert ckpt.storage.counters.snapshot()["bytes_read"] == before


def test_an_object_that_grew_costs_at_most_its_declared_size(tmp_path):
    """On an object store the read asks for one byte more than declared (a ranged GET)."""
    url = f"memory://ckpt-{uuid.uuid4().hex}"
    ckpt, meta = _saved(url)
    declared = meta["bytes"][meta["file"]]
    ckpt.storage.put(meta["file"], [bytes(declared * 50)])  # replaced by a larger one
    before = ckpt.storage.counters.snapshot()["bytes_read"]
    with pytest.raises(ConfigError, match="larger than the"):
        ckpt.load(meta)
    assert ckpt.storage.counters.snapshot()["bytes_read"] - before <= declared + 1


def test_an_index_without_sizes_still_loads(tmp_path):
    """latest.json written before it declared sizes: read as then (whole)."""
    ckpt, meta = _saved(str(tmp_path))
    del meta["bytes"]
    (tmp_path / LATEST).write_text(json.dumps(meta))
    assert torch.equal(ckpt.load(ckpt.latest())["w"], torch.arange(1000.0))


@pytest.mark.parametrize("sizes", [[1, 2], {"step-00000007.pt": -1},
                                   {"step-00000007.pt": "big"}, {"step-00000007.pt": True}])
def test_a_malformed_declaration_is_refused(tmp_path, sizes):
    ckpt, meta = _saved(str(tmp_path))
    with pytest.raises(ConfigError, match="declares no valid size"):
        ckpt.load({**meta, "bytes": sizes})
