"""Bad input to ``python -m ferrosync.train``: one line that says what to do, exit code 2,
nothing written (no checkpoint, no metrics file, no sync directory).

Two cases run as real processes, the way a user meets them; the rest call the same
``main`` in this process (the launcher refuses before it starts any rank, so a process
per case would only pay torch's import again)."""

from __future__ import annotations

import pytest
from train_cli import run_cli, run_main


def _listing(path):
    return sorted((p.name, p.read_bytes()) for p in path.iterdir()) if path.exists() else None


@pytest.fixture(scope="module")
def demo_checkpoint(tmp_path_factory):
    """A real checkpoint of the demo model, written by a 1-rank run."""
    where = tmp_path_factory.mktemp("demo_ck")
    proc = run_cli("--nproc", 1, "--steps", 2, "--checkpoint-dir", where / "ck",
                   "--no-progress", cwd=where)
    assert proc.returncode == 0, proc.stderr
    return where / "ck"


def _case(name, tmp_path, demo_checkpoint):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    return {
        "unknown flag": (["--nproc", 2, "--bogus"], "unrecognized arguments: --bogus"),
        "missing script": (["--nproc", 2, "no_such_script.py"], "does not exist"),
        "zero ranks": (["--nproc", 0], "--nproc: must be an integer >= 1"),
        "unreachable sync": (["--nproc", 2, "--sync", blocker / "run"], "cannot use sync URL"),
        "resume without checkpoint": (
            ["--nproc", 2, "--resume", "--checkpoint-dir", tmp_path / "ck"],
            "no checkpoint in"),
        "different model": (
            ["--nproc", 1, "--resume", "--checkpoint-dir", demo_checkpoint,
             "--model", "train_models:wide_mlp"], "different model"),
        "different world size": (
            ["--nproc", 2, "--resume", "--checkpoint-dir", demo_checkpoint],
            "written by 1 ranks, this run has 2"),
        "sync-every with grad": (["--nproc", 2, "--sync-every", 5],
                                 "--sync-every does not apply to --strategy grad"),
        "two cadences": (["--nproc", 2, "--strategy", "diloco", "--sync-every", 5,
                          "--sync-every-seconds", 2], "not both"),
        "outer flag without diloco": (["--nproc", 2, "--strategy", "local-sgd",
                                       "--outer-lr", 0.5], "--outer-lr does not apply"),
        "window beyond timeout": (["--nproc", 2, "--strategy", "local-sgd",
                                   "--sync-every-seconds", 200], "needs --timeout above 400"),
        "different strategy": (
            ["--nproc", 1, "--resume", "--checkpoint-dir", demo_checkpoint, "--strategy",
             "diloco"], "written with --strategy grad"),
        "trainer flag with script": (["--nproc", 2, "--steps", 3, __file__],
                                     "configure(s) the built-in trainer"),
        "URL with one slash": (["--nproc", 2, "--sync", "s3:/bucket/run7"],
                               "looks like a URL without the '//' after its scheme; write "
                               "s3://bucket/run7"),
        "misspelt scheme": (["--nproc", 2, "--sync", "s4://bucket/run7"],
                            "unknown URL scheme 's4'"),
        "scheme no driver serves": (["--nproc", 2, "--sync", "ftp://host/run7"],
                                    "ranks cannot meet on this store: the FTPFileSystem"),
        "memory for two processes": (["--nproc", 2, "--sync", "memory://exp7"],
                                     "memory://exp7 is one process's memory"),
        "checkpoint URL with one slash": (["--nproc", 2, "--checkpoint-dir", "s3:/b/ck"],
                                          "write s3://b/ck"),
        "model that needs arguments": (["--nproc", 2, "--model", "torch.nn:Linear"],
                                       "--model torch.nn:Linear cannot be called with no "
                                       "arguments (missing a required argument"),
        "data that needs arguments": (["--nproc", 2, "--data", "torch.nn:Linear"],
                                      "--data torch.nn:Linear cannot be called"),
        "model that is no module": (["--nproc", 2, "--model", "builtins:dict"],
                                    "--model must return a torch.nn.Module, got dict"),
        "loss that is a class": (["--nproc", 2, "--loss", "torch.nn:MSELoss"],
                                 "is a class, and the trainer calls it as FUNCTION"),
        "model factory that raises": (["--nproc", 2, "--model", "train_models:raising"],
                                      "--model train_models:raising: the factory raised "
                                      "FileNotFoundError: weights.pt: no such file"),
        "upper-case scheme": (["--nproc", 2, "--sync", "S3://bucket/run7"],
                              "URL schemes are lower case; write s3://bucket/run7"),
        "metrics under a file": (["--nproc", 2, "--metrics", blocker / "m.jsonl"],
                                 f"--metrics {blocker / 'm.jsonl'}: cannot create a file in "
                                 f"{blocker} (Not a directory)"),
        "checkpoint dir of another run": (
            ["--nproc", 1, "--checkpoint-dir", demo_checkpoint],
            f"--checkpoint-dir {demo_checkpoint} holds another run's checkpoints (the latest "
            "at step 2); starting here would replace them; pass --resume to continue that "
            "run, or choose an empty directory"),
    }[name]


CASES = ["unknown flag", "missing script", "zero ranks", "unreachable sync",
         "resume without checkpoint", "different model", "different world size",
         "sync-every with grad", "two cadences", "outer flag without diloco",
         "window beyond timeout", "different strategy", "trainer flag with script",
         "URL with one slash", "misspelt scheme", "scheme no driver serves",
         "memory for two processes", "checkpoint URL with one slash",
         "model that needs arguments", "data that needs arguments", "model that is no module",
         "loss that is a class", "model factory that raises", "upper-case scheme",
         "metrics under a file", "checkpoint dir of another run"]


#: the cases run as a real ``python -m ferrosync.train`` process
IN_A_PROCESS = ("unknown flag", "resume without checkpoint", "checkpoint dir of another run")


def _run(args, tmp_path, in_a_process, monkeypatch, capsys):
    """(exit code, stdout, stderr) of the command line ``args``."""
    if in_a_process:
        proc = run_cli(*args, cwd=tmp_path, timeout=60)
        return proc.returncode, proc.stdout, proc.stderr
    return run_main(args, tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("name", CASES)
def test_bad_input_is_one_line_and_exit_2(tmp_path, demo_checkpoint, name, monkeypatch,
                                          capsys):
    args, needle = _case(name, tmp_path, demo_checkpoint)
    before = _listing(demo_checkpoint)
    sync = tmp_path / "sync"
    if "--sync" not in args:
        args = [*args[:2], "--sync", sync, *args[2:]]
    if "--nproc" in args and "--metrics" not in args and not any(
            str(a).endswith(".py") for a in args):
        args = [*args, "--metrics", tmp_path / "metrics.jsonl"]
    code, stdout, stderr = _run(args, tmp_path, name in IN_A_PROCESS, monkeypatch, capsys)
    assert code == 2, (stdout, stderr)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("ferrosync.train: error: ") and needle in lines[0], lines[0]
    assert stdout == ""
    assert not sync.exists() and not (tmp_path / "metrics.jsonl").exists()
    assert not (tmp_path / "ck").exists() and not (tmp_path / "s3:").exists()
    assert _listing(demo_checkpoint) == before


def test_a_rank_alone_reports_bad_input_with_exit_2(tmp_path):
    """Without the launcher (one rank, as under srun), the rank itself exits 2."""
    proc = run_cli("--sync", tmp_path / "sync", "--resume", "--checkpoint-dir",
                   tmp_path / "ck", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "no checkpoint in" in proc.stderr
    assert not (tmp_path / "sync").exists() and not (tmp_path / "ck").exists()


def test_a_factory_that_cannot_build_on_meta_is_left_to_the_ranks(tmp_path):
    proc = run_cli("--nproc", 1, "--steps", 1, "--model", "train_models:value_reading",
                   "--no-progress", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_used_checkpoint_dir_keeps_its_run_and_metrics(tmp_path, demo_checkpoint,
                                                          monkeypatch, capsys):
    """Without --resume, neither the launcher nor a rank started by hand (srun) touches
    another run's checkpoints or the metrics file they go with."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n{"step": 2}\n')
    before = _listing(demo_checkpoint)
    for args in (["--nproc", 2], ["--sync", tmp_path / "sync"]):
        code, out, err = run_main([*args, "--checkpoint-dir", demo_checkpoint, "--metrics",
                                   metrics, "--steps", 5], tmp_path, monkeypatch, capsys)
        assert code == 2 and out == "", err
        assert "holds another run's checkpoints" in err and "--resume" in err, err
        assert _listing(demo_checkpoint) == before
        assert metrics.read_text() == '{"step": 1}\n{"step": 2}\n'
        assert not (tmp_path / "sync").exists()


def test_metrics_in_a_read_only_directory_is_refused_before_any_rank(
        tmp_path, read_only_dir, monkeypatch, capsys):
    code, out, err = run_main(["--nproc", 2, "--metrics", read_only_dir / "m.jsonl",
                               "--sync", tmp_path / "sync"], tmp_path, monkeypatch, capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and f"cannot create a file in {read_only_dir}" in err, err
    assert list(read_only_dir.iterdir()) == [] and not (tmp_path / "sync").exists()


@pytest.mark.parametrize("launcher", [True, False], ids=["launcher", "rank-alone"])
def test_a_flipped_checkpoint_byte_is_refused_with_exit_2(tmp_path, demo_checkpoint, launcher):
    """One flipped byte in the step file: one line naming the file, the step and what to
    do, exit 2, before the model is touched (the launcher: before any rank starts)."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(demo_checkpoint, ck)
    (step_file,) = ck.glob("step-*.pt")
    data = bytearray(step_file.read_bytes())
    data[len(data) // 2] ^= 0x04
    step_file.write_bytes(bytes(data))
    args = (["--nproc", 1] if launcher else []) + [
        "--sync", tmp_path / "sync", "--resume", "--checkpoint-dir", ck, "--steps", 4,
        "--no-progress"]
    proc = run_cli(*args, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert str(step_file) in lines[0] and "(step 2)" in lines[0], lines[0]
    assert "fails its checksum" in lines[0] and "--resume" in lines[0], lines[0]
    assert "FINAL" not in proc.stdout
