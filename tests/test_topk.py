"""wire_dtype="topk": the frame format, exact error feedback, ranges, non-finite values,
and exact, bit-identical averages of sparse contributions on every backend."""

from __future__ import annotations

import pytest
import torch

import ferrosync
from conftest import free_port
from ferrosync.compression.codecs import TOPK_CHUNK, Int8Codec, TopKCodec, codec_for
from ferrosync.compression.encoder import Encoder
from ferrosync.core.flat import BufferPool
from ferrosync.errors import ConfigError
from ferrosync.storage.options import StorageOptions
from ferrosync.torchdist.options import TorchOptions
from ranks import run_ranks


def roundtrip(codec, x):
    out = torch.empty(codec.nbytes(x.numel()), dtype=torch.uint8)
    codec.encode(x, out)
    return out, codec.decode(out, x.numel())


# -- the codec ------------------------------------------------------------------------------

@pytest.mark.unit
def test_golden_bytes_pin_the_frame_format():
    x = torch.zeros(TOPK_CHUNK + 4)
    x[7], x[100], x[TOPK_CHUNK + 1] = -4.0, 1.5, 3.0
    codec = TopKCodec(density=2 / TOPK_CHUNK, bits=2)  # k = 2, levels ±s/2, ±s
    wire, y = roundtrip(codec, x)
    assert codec.frame_bytes == 9 and codec.block == (2 << 4 | 2)
    assert bytes(wire.tolist()) == bytes([
        0x00, 0x00, 0x80, 0x40,  # scale 4.0 (float32 LE)
        0x07, 0x00, 0x64, 0x00,  # indices 7, 100 (uint16 LE), largest first
        0x03,                    # codes: 0b11 (-, j=1: -4.0), 0b00 (+, j=0: 2.0)
        0x00, 0x00, 0x40, 0x40,  # scale 3.0
        0x01, 0x00, 0x01, 0x00,  # index 1; slot 2 repeats slot 1 (nothing else to send)
        0x05,                    # codes 0b01, 0b01 (+3.0)
    ])
    expected = torch.zeros_like(x)
    expected[7], expected[100], expected[TOPK_CHUNK + 1] = -4.0, 2.0, 3.0
    assert torch.equal(y, expected)


@pytest.mark.unit
@pytest.mark.parametrize("bits", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n", [1, TOPK_CHUNK - 1, 3 * TOPK_CHUNK + 17])
def test_sizes_and_sparsity(bits, n):
    codec = TopKCodec(1 / 64, bits)
    x = torch.randn(n) * torch.logspace(-3, 3, n)
    wire, y = roundtrip(codec, x)
    frames = -(-n // TOPK_CHUNK)
    assert wire.numel() == frames * (4 + 2 * 64 + -(-64 * bits // 8))
    assert (y != 0).sum() <= frames * 64
    # every value sent has its input's sign and is within a factor 2 of it
    sent = y != 0
    assert (torch.sign(y[sent]) == torch.sign(x[sent])).all()
    assert ((y[sent].abs() <= 2 * x[sent].abs()) & (x[sent].abs() <= 2 * y[sent].abs())).all()
    # the largest value of each chunk goes out exactly
    for f in range(frames):
        chunk = x[f * TOPK_CHUNK:(f + 1) * TOPK_CHUNK]
        i = int(chunk.abs().argmax())
        assert y[f * TOPK_CHUNK + i] == chunk[i]


@pytest.mark.unit
def test_at_least_50x_fewer_bytes_than_float32_and_12x_fewer_than_int8():
    n = 1 << 20
    topk = TopKCodec().nbytes(n)
    assert 4 * n / topk >= 100  # 148 bytes per 4096 values
    assert Int8Codec().nbytes(n) / topk >= 25


@pytest.mark.unit
def test_error_feedback_keeps_exactly_what_was_not_delivered():
    """residual + decoded == the compensated input, bit for bit in float32, each step;
    and the delayed values do arrive."""
    pool = BufferPool()
    encoder = Encoder.for_options(StorageOptions.parse({"wire_dtype": "topk"}), pool)
    codec = encoder.codec(torch.float32)
    torch.manual_seed(0)
    n = 2 * TOPK_CHUNK + 100
    sent_total = torch.zeros(n, dtype=torch.float64)
    given_total = torch.zeros(n, dtype=torch.float64)
    residual = torch.zeros(n)
    steps = 60
    for _ in range(steps):
        x = torch.randn(n) * torch.logspace(-4, 2, n)[torch.randperm(n)]
        compensated = x + residual  # what the encoder sends, in float32
        wire = encoder.encode(x, codec, ("grads",))
        decoded = codec.decode(wire, n)
        residual = encoder._ef._residual[(None, b"", "grads")]
        assert torch.equal(residual + decoded, compensated)
        assert torch.equal(compensated - decoded, residual)
        sent_total += decoded
        given_total += x
    # what is still owed is exactly the residual (up to float64 sums of the steps)
    owed = (given_total - sent_total - residual.double()).abs().max().item()
    assert owed < 1e-6 * given_total.abs().max().item()


@pytest.mark.unit
def test_non_finite_chunks_decode_to_nan_and_others_are_untouched():
    codec = TopKCodec()
    x = torch.randn(3 * TOPK_CHUNK)
    x[5] = float("inf")
    x[TOPK_CHUNK + 9] = float("nan")
    _, y = roundtrip(codec, x)
    assert torch.isnan(y[:2 * TOPK_CHUNK]).all()
    clean = x[2 * TOPK_CHUNK:]
    _, alone = roundtrip(codec, clean)
    assert torch.equal(y[2 * TOPK_CHUNK:], alone)
    # error feedback does not carry the overflow into the next step
    encoder = Encoder.for_options(StorageOptions.parse({"wire_dtype": "topk"}), BufferPool())
    encoder.encode(x, codec, ("g",))
    assert torch.isfinite(encoder._ef._residual[(None, b"", "g")]).all()


@pytest.mark.unit
def test_a_forged_index_stays_inside_its_chunk():
    codec = TopKCodec(2 / TOPK_CHUNK, 2)
    wire, _ = roundtrip(codec, torch.randn(2 * TOPK_CHUNK))
    wire[4:6] = torch.tensor([0xFF, 0xFF], dtype=torch.uint8)  # index 65535
    y = codec.decode(wire, 2 * TOPK_CHUNK)
    assert y.numel() == 2 * TOPK_CHUNK and (y[:TOPK_CHUNK] != 0).sum() <= 2


@pytest.mark.unit
@pytest.mark.parametrize("options, words", [
    ({"topk_density": 0}, "topk_density must be a number in [1/4096, 0.5], got 0"),
    ({"topk_density": 0.75}, "topk_density must be a number in [1/4096, 0.5]"),
    ({"topk_density": "dense"}, "topk_density must be a number"),
    ({"topk_bits": 0}, "topk_bits must be an int in [1, 8], got 0"),
    ({"topk_bits": 16}, "topk_bits must be an int in [1, 8], got 16"),
    ({"topk_bits": 2.0}, "topk_bits must be an int in [1, 8]"),
    ({"wire_dtype": "topk", "reduce": "root"}, "wire_dtype='topk' cannot use reduce='root'"),
    ({"wire_dtype": "topk", "reduce": "sharded"}, "cannot use reduce='sharded'"),
])
def test_out_of_range_options_are_clear_config_errors(options, words):
    with pytest.raises(ConfigError, match=None) as info:
        StorageOptions.parse(options)
    assert words in str(info.value)


@pytest.mark.unit
def test_options_reach_the_codec_on_every_backend():
    assert TorchOptions.parse({"wire_dtype": "topk", "topk_bits": 4}).topk_bits == 4
    opts = StorageOptions.parse({"wire_dtype": "topk", "topk_density": 0.03, "topk_bits": 3})
    codec = Encoder.for_options(opts, BufferPool()).codec(torch.bfloat16)
    assert isinstance(codec, TopKCodec) and (codec.k, codec.bits) == (123, 3)
    assert not isinstance(codec_for(torch.int64, "topk"), TopKCodec)  # integers exact


# -- averaging sparse contributions ------------------------------------------------------------

def _data(rank: int, step: int, n: int = 3 * TOPK_CHUNK + 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, generator=g) * (1 + rank)


def _expected(world: int, steps: int, weights) -> list[torch.Tensor]:
    """What every rank must hold after each step: each rank's payload decoded (with its
    own error feedback), summed in rank order in float32, divided once."""
    encoders = [Encoder.for_options(StorageOptions.parse({"wire_dtype": "topk"}), BufferPool())
                for _ in range(world)]
    out = []
    for step in range(steps):
        acc = None
        for r in range(world):
            enc = encoders[r]
            enc.stream = ("s", b"d")
            x = _data(r, step)
            codec = enc.codec(x.dtype)
            decoded = codec.decode(enc.encode(x, codec, (0,)), x.numel())
            acc = decoded * weights[r] if acc is None else acc + decoded * weights[r]
        out.append(acc / sum(weights))
    return out


def w_average(rank, world, url, steps, options):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=60, wire_dtype="topk",
                           **options) as sync:
        results = []
        x = torch.empty(3 * TOPK_CHUNK + 5)  # one tensor: error feedback follows it
        for step in range(steps):
            x.copy_(_data(rank, step))
            sync.average_(x, weight=1.0 + rank)
            results.append(x.clone())
        written = sync.stats["total"]["bytes_written"]
        with pytest.raises(ConfigError, match="average_parameters cannot use"):
            sync.average_parameters(torch.nn.Linear(2, 2))
        y = torch.arange(10.0) * (rank + 1)
        sync.broadcast_(y, src=1)  # an exact copy, whatever wire_dtype
        return results, written, y


@pytest.mark.parametrize("world", [2, 3])
def test_directory_average_is_exact_and_bit_identical(dir_transport, world):
    steps = 3
    got = run_ranks(w_average, world, dir_transport.url, steps, {})
    want = _expected(world, steps, [1.0 + r for r in range(world)])
    for rank in range(world):
        results, written, y = got[rank]
        for step in range(steps):
            # the same operations in the same order: equal bits, not just close values
            assert torch.equal(results[step], got[0][0][step])
            assert torch.allclose(results[step], want[step], rtol=1e-6, atol=1e-7)
        assert torch.equal(y, torch.arange(10.0) * 2)
        # one sparse contribution per step, headers included: ~110x under float32
        assert written < steps * 4 * (3 * TOPK_CHUNK + 5) / 50, written


def test_gloo_average_is_exact_and_bit_identical():
    steps = 3
    url = f"gloo://127.0.0.1:{free_port()}"
    got = run_ranks(w_average, 2, url, steps, {})
    want = _expected(2, steps, [1.0, 2.0])
    for step in range(steps):
        assert torch.equal(got[0][0][step], got[1][0][step])
        assert torch.allclose(got[0][0][step], want[step], rtol=1e-6, atol=1e-7)


def test_s3_average_is_bit_identical(seaweed_transport):
    got = run_ranks(w_average, 2, seaweed_transport.url, 2, seaweed_transport.options)
    want = _expected(2, 2, [1.0, 2.0])
    for step in range(2):
        assert torch.equal(got[0][0][step], got[1][0][step])
        assert torch.allclose(got[0][0][step], want[step], rtol=1e-6, atol=1e-7)


# -- DDP --------------------------------------------------------------------------------------

def w_ddp(rank, world, url, steps):
    import torch.distributed as dist

    from ferrosync.ddp import SyncProcessGroup, wrap

    torch.manual_seed(rank)  # wrap broadcasts rank 0's weights
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 4))
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=60,
                           wire_dtype="topk") as sync:
        ddp = wrap(model, sync, bucket_cap_mb=0.02)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        residuals = []
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * rank + step)
            x = torch.randn(32, 64, generator=g)
            loss = ddp(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            residuals.append(len(sync._encoder._ef._residual))
        # an allreduce of other float tensors would go sparse: refused
        with pytest.raises(ConfigError, match="cannot use wire_dtype='topk'"):
            SyncProcessGroup(sync).allreduce([torch.ones(3)], dist.AllreduceOptions())
        return [p.detach().clone() for p in model.parameters()], residuals


def test_ddp_hook_averages_topk_gradients_identically_with_feedback(dir_transport):
    got = run_ranks(w_ddp, 2, dir_transport.url, 4)
    for a, b in zip(got[0][0], got[1][0]):
        assert torch.equal(a, b)
    residuals = got[0][1]
    # one residual per bucket, kept across steps (not a new one per step); DDP
    # rebuilds its buckets once after the first step
    assert residuals[0] > 1 and len(set(residuals[1:])) == 1, residuals


# -- elastic jobs -------------------------------------------------------------------------------

ELASTIC_N = 16 * TOPK_CHUNK  # 256 KiB of float32


def w_elastic(index, _world, url, members, rounds):
    with ferrosync.connect(url, elastic=True, min_ranks=members, job="topk", timeout=60,
                           heartbeat_interval=0.2, heartbeat_timeout=2.5, fan_in=2,
                           wire_dtype="topk") as sync:
        x = torch.empty(ELASTIC_N)
        out = []
        for k in range(rounds):
            x.copy_(_data(index, k, ELASTIC_N))
            total = sync.average_(x)
            out.append((total, x.clone(), sync.stats["last"]["bytes_read"]))
        return out


def test_elastic_average_from_five_members_is_a_flat_round_of_sparse_reads(tmp_path):
    """From 5 members an average would go through the tree, whose partial sums are
    dense: with topk it is a flat round, every member reading the others' sparse
    contributions and summing them in roster order: the same bits everywhere."""
    got = run_ranks(w_elastic, 5, str(tmp_path / "el"), 5, 2, timeout=120)
    for k in range(2):
        total, reference, _ = got[0][k]
        assert total == 5.0
        for member in got[1:]:
            assert member[k][0] == total and torch.equal(member[k][1], reference)
        # the plain mean of the members' inputs, seen through topk: close in norm only
        # where error feedback has not caught up yet, but every member agrees on it
        assert torch.isfinite(reference).all() and (reference != 0).any()
    for member in got:
        _, _, read = member[1]
        # four sparse contributions of ~2.4 KiB each plus control records, never the
        # 256 KiB dense partial sums of a tree round
        assert read < 4 * ELASTIC_N * 4 / 20, read


# -- the trainer --------------------------------------------------------------------------------

WIDE = ["--model", "ferrosync.train.tasks:wide_model", "--data",
        "ferrosync.train.tasks:wide_data", "--batch-size", "64", "--lr", "0.1"]


def _diloco(tmp_path, wire: str, *flags):
    from train_cli import final_of, run_cli

    proc = run_cli("--nproc", 2, "--sync", tmp_path / wire, *WIDE, "--strategy", "diloco",
                   "--sync-every", 2, "--steps", 4, "--no-progress", "--sync-option",
                   f"wire_dtype={wire}", *flags, cwd=tmp_path)
    return proc, (final_of(proc.stdout) if proc.returncode == 0 else None)


def test_trainer_diloco_topk_moves_50x_fewer_bytes_per_sync_than_float32(tmp_path):
    _, dense = _diloco(tmp_path, "float32")
    proc, sparse = _diloco(tmp_path, "topk")
    assert sparse is not None, proc.stderr
    assert dense["ranks_agree"] and sparse["ranks_agree"]
    per_sync = {w: f["sync_bytes"] / f["syncs"] for w, f in (("f", dense), ("t", sparse))}
    # the whole wire of a sync (every object's header and control records included)
    assert per_sync["f"] / per_sync["t"] >= 50, per_sync


def test_trainer_refuses_topk_for_local_sgd_with_exit_2(tmp_path):
    from train_cli import run_cli

    proc = run_cli("--nproc", 2, "--sync", tmp_path / "run", "--strategy", "local-sgd",
                   "--steps", 2, "--no-progress", "--sync-option", "wire_dtype=topk",
                   cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "local-sgd cannot use wire_dtype='topk'" in proc.stderr


def test_trainer_names_the_allowed_range(tmp_path):
    from train_cli import run_cli

    proc = run_cli("--nproc", 2, "--sync", tmp_path / "run", "--strategy", "diloco",
                   "--steps", 2, "--no-progress", "--sync-option", "wire_dtype=topk",
                   "--sync-option", "topk_bits=12", cwd=tmp_path)
    assert proc.returncode == 2
    assert "topk_bits must be an int in [1, 8], got 12" in proc.stderr


def test_trainer_streaming_diloco_and_grad_run_with_topk(tmp_path):
    """Streaming DiLoCo's fragments and per-step gradient averaging (DGC's setting) on a
    topk sync: every rank ends with the same parameters."""
    from train_cli import final_of, run_cli

    for strategy, flags in (("streaming-diloco", ["--sync-every", 4, "--fragments", 2]),
                            ("grad", [])):
        proc = run_cli("--nproc", 2, "--sync", tmp_path / strategy, "--strategy", strategy,
                       *flags, "--steps", 8, "--no-progress", "--sync-option",
                       "wire_dtype=topk", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        final = final_of(proc.stdout)
        assert final["ranks_agree"] and final["steps"] == 8


def test_trainer_elastic_diloco_with_topk_ends_alike(tmp_path):
    from train_cli import final_of, run_cli

    proc = run_cli("--elastic", "--min-ranks", 2, "--nproc", 2, "--sync", tmp_path / "el",
                   "--strategy", "diloco", "--sync-every", 5, "--steps", 20, "--no-progress",
                   "--sync-option", "wire_dtype=topk", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    final = final_of(proc.stdout)
    assert final["ranks_agree"] and final["syncs"] == 4
    assert len(set(final["rank_digests"])) == 1


@pytest.mark.unit
def test_topk_without_error_feedback_warns():
    with pytest.warns(UserWarning, match="error_feedback=False loses"):
        StorageOptions.parse({"wire_dtype": "topk", "error_feedback": False})
