"""Checkpoint reads (ferrosync/train/checkpoint.py) are bounded by what latest.json
declares: a step file that grew after it was written is refused unread, with one line
naming it and the declared size, however large it claims to be (sparse files cost
nothing here). Peak memory is measured by tools/bench/bounded_reads.py, not here.

Every file's checksum (and latest.json's own) is verified before torch.load sees a
byte: a flipped bit anywhere, a moved file or an edited index is one line naming the
file and the step.
"""

from __future__ import annotations

import io
import json
import os
import uuid

import pytest
import torch

from ferrosync.errors import ConfigError
from ferrosync.train.checkpoint import LATEST, Checkpoints

pytestmark = pytest.mark.unit


def _saved(url: str, *, rank_files: bool = False) -> tuple[Checkpoints, dict]:
    ckpt = Checkpoints(url)
    sizes = {}  # what the trainer gathers from its ranks
    if rank_files:
        for rank in range(2):
            sizes[ckpt.rank_key(7, rank)] = ckpt.save_rank(
                7, rank, {"w": torch.full((100,), float(rank))})
    ckpt.save({"w": torch.arange(1000.0)}, {"step": 7, "rank_files": rank_files}, keep=2,
              rank_files=sizes)
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


def _write_format_1(tmp_path, meta: dict, *, sizes: bool) -> None:
    """What ferrosync wrote before checkpoints carried checksums: bare torch.save files
    and an index of format 1 (before that, without sizes too)."""
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(1000.0)}, buffer)
    (tmp_path / meta["file"]).write_bytes(buffer.getvalue())
    old = {k: v for k, v in meta.items() if k not in ("checksum", "bytes")}
    if sizes:
        old["bytes"] = {meta["file"]: len(buffer.getvalue())}
    (tmp_path / LATEST).write_text(json.dumps({**old, "format": 1}))


@pytest.mark.parametrize("sizes", [True, False])
def test_an_index_of_format_1_still_loads_unverified_with_a_warning(tmp_path, sizes):
    """latest.json written before checksums (and before it declared sizes): read as then."""
    ckpt, meta = _saved(str(tmp_path))
    _write_format_1(tmp_path, meta, sizes=sizes)
    with pytest.warns(RuntimeWarning, match="before checkpoints carried checksums"):
        assert torch.equal(ckpt.load(ckpt.latest())["w"], torch.arange(1000.0))


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _refused(ckpt: Checkpoints, load, what: str, path) -> str:
    with pytest.raises(ConfigError) as info:
        load()
    text = str(info.value)
    assert str(path) in text and "step 7" in text and what in text, text
    assert "\n" not in text and "--resume" in text, text
    return text


# offsets: the first byte (zip's magic), the middle, the last byte
@pytest.mark.parametrize("where", [0, "middle", -1])
@pytest.mark.parametrize("name", ["step-00000007.pt", "step-00000007.r1.pt"])
def test_one_flipped_bit_is_refused_before_loading(tmp_path, monkeypatch, where, name):
    ckpt, meta = _saved(str(tmp_path), rank_files=True)
    size = os.path.getsize(tmp_path / name)
    _flip(tmp_path / name, size // 2 if where == "middle" else where)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was reached"))
    load = (lambda: ckpt.load(meta)) if name == meta["file"] else \
        (lambda: ckpt.load_rank(meta, 1))
    _refused(ckpt, load, "fails its checksum", tmp_path / name)
    _refused(ckpt, lambda: ckpt.verify(meta, 2), "fails its checksum",
             tmp_path / name)


def test_a_file_moved_to_another_rank_or_step_is_refused(tmp_path):
    ckpt, meta = _saved(str(tmp_path), rank_files=True)
    (tmp_path / "step-00000007.r1.pt").write_bytes(
        (tmp_path / "step-00000007.r0.pt").read_bytes())
    meta["bytes"]["step-00000007.r1.pt"] = meta["bytes"]["step-00000007.r0.pt"]
    _refused(ckpt, lambda: ckpt.load_rank(meta, 1), "fails its checksum",
             tmp_path / "step-00000007.r1.pt")


def test_an_index_that_declares_no_checksum_is_refused(tmp_path):
    """Format 2 always declares one: a file without one is not trusted."""
    ckpt, meta = _saved(str(tmp_path))
    del meta["xxh3"][meta["file"]]
    with pytest.raises(ConfigError, match="declares no checksum for 'step-00000007.pt'"):
        ckpt.load(meta)


def test_checkpoint_files_still_load_with_torch_load(tmp_path):
    """What docs/train.md promises: a step file is a plain torch.save file."""
    ckpt, meta = _saved(str(tmp_path), rank_files=True)
    assert meta["xxh3"] and sorted(meta["xxh3"]) == sorted(meta["bytes"])
    loaded = torch.load(tmp_path / meta["file"], weights_only=True)
    assert torch.equal(loaded["w"], torch.arange(1000.0))


@pytest.mark.parametrize("edit", ['"step": 7', '"epoch": 0'])
def test_an_edited_index_is_refused(tmp_path, edit):
    ckpt, _ = _saved(str(tmp_path))
    text = (tmp_path / LATEST).read_text()
    if edit not in text:  # the index has no epoch: add one
        text = text.replace('"file"', '"epoch": 3, "file"')
    else:
        text = text.replace(edit, edit.replace("7", "6").replace("0", "1"))
    (tmp_path / LATEST).write_text(text)
    with pytest.raises(ConfigError, match="latest.json fails its checksum") as info:
        ckpt.latest()
    assert str(tmp_path / LATEST) in str(info.value)


@pytest.mark.parametrize("sizes", [[1, 2], {"step-00000007.pt": -1},
                                   {"step-00000007.pt": "big"}, {"step-00000007.pt": True}])
def test_a_malformed_declaration_is_refused(tmp_path, sizes):
    ckpt, meta = _saved(str(tmp_path))
    with pytest.raises(ConfigError, match="declares no valid size"):
        ckpt.load({**meta, "bytes": sizes})
