"""How every code block of README.md and docs/*.md runs, for ``tests/test_docs.py``:
Sybil parses the documents, each block becomes one ``test_doc_example[...]`` there, and
the evaluators here run it (the comment below says how each kind of block runs, and the
documented substitutions). ``CTX`` holds what the evaluators need from pytest for the
block being run; the test fills it in."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sybil import Sybil
from sybil.parsers.markdown import CodeBlockParser, SkipParser

from ferrosync.core.ports import free_port  # noqa: F401 -- MASTER_PORT for a Python block (test_docs)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(rel: str) -> str:
    """The text of a file of the repository (``rel`` from its root)."""
    with open(os.path.join(ROOT, rel), encoding="utf-8", errors="replace") as f:
        return f.read()


# Sybil parses each document (fenced blocks, `<!-- skip: next "reason" -->` directives);
# every block becomes one test whose id names the document and line, and the evaluators
# below run it:
#
# * ```python``` blocks execute in a fresh namespace holding the names a snippet assumes
#   (`model`, `dataset`, `loss_fn`, `opt`, ... see `_python_namespace`), as rank 0 of a
#   world of one (RANK=0, WORLD_SIZE=1). A block whose first line is `# path/file.py` is
#   a file the docs ask you to write: it is written into every document's working
#   directory before any block runs, and the commands that use it run it.
# * ```bash``` blocks run command by command (`\` continuations joined, comments
#   dropped) in the document's working directory: `python -m ferrosync...`, `ferrosync
#   ...`, `python tools/...`, `python examples/...` and single-node `torchrun` (a
#   launch's launcher and the `ferrosync` tools run in this process, ranks as processes). The
#   documented substitutions: at most `_MAX_STEPS` optimizer steps (a `--steps` is
#   inserted or lowered; twice that with `--resume`, so a resumed run has steps left)
#   and at most 2 ranks per command (this suite runs on 2 cores); `tools/...` and
#   `examples/...` are the repository's (the docs' commands run from a clone's root);
#   an `--elastic` member with `--min-ranks M` is started M times, side by side, each in
#   its own directory (the recipe's "on each machine"). `pip install` lines are checked
#   against pyproject.toml (the extras exist), not run; `python -m pytest` is this suite.
# * ```diff``` blocks: the new side (context and `+` lines) runs as a Python block.
# * ```text``` blocks are sample outputs: each is compared with the output of a real run
#   (see `_OUTPUT_CHECKS`; the train sample with the uncapped demo, since its accuracy
#   and step count are what it shows); the samples are written by tools/docs/doc_outputs.py.
# * ```json``` blocks parse, and a metrics line holds the keys the trainer writes.
#
# Paths and URLs a block assumes: `/mnt/nfs/...` and `/mnt/scratch/...` become
# directories under the document's working directory, and `s3://bucket` and
# `s3://my-bucket` are buckets of the suite's local moto S3 server (tests/conftest.py),
# reached through `AWS_ENDPOINT_URL` as docs/train.md tells users of an S3-compatible
# store; buckets and those directories are emptied before each block. A block that
# cannot run here (a GPU, SLURM, several hosts, a real cloud, minutes of benchmark)
# carries a skip directive with its reason, and the text beside it says so.

#: the documents whose code blocks run
DOCUMENTS = ["README.md"] + sorted(
    os.path.join("docs", n) for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))
#: the documented substitutions for shell commands (see above)
_MAX_STEPS = 12
_MAX_NPROC = 2
BUCKETS = ("bucket", "my-bucket")
MOUNTS = {"/mnt/nfs/": "mnt-nfs/", "/mnt/scratch/": "mnt-scratch/"}
_COMMAND_TIMEOUT = 240.0


class _Context:
    """What the evaluators need from pytest for the block being run."""

    workdir: Path
    env: dict
    endpoint: str
    doc: str


CTX = _Context()


def _substitute_paths(text: str) -> str:
    for mount, local in MOUNTS.items():
        text = text.replace(mount, f"{CTX.workdir / local}/")
    return text


def _source(example) -> str:
    return str(example.parsed)


# -- python ------------------------------------------------------------------------------

def _python_namespace() -> dict:
    """The names the docs' snippets assume, small and deterministic."""
    import torch

    import ferrosync

    torch.manual_seed(0)
    x_all = torch.randn(256, 10)
    y_all = (x_all[:, 0] > 0).long() + (x_all[:, 1] > 0).long()
    dataset = torch.utils.data.TensorDataset(x_all, y_all)
    model = torch.nn.Linear(10, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32)
    x, y = x_all[:32], y_all[:32]
    loss_fn = torch.nn.functional.cross_entropy

    def my_accuracy(m):
        with torch.no_grad():
            return (m(x_all).argmax(-1) == y_all).float().mean().item()

    return {
        "torch": torch, "ferrosync": ferrosync, "dist": torch.distributed,
        "DistributedDataParallel": torch.nn.parallel.DistributedDataParallel,
        "dataset": dataset, "train_set": dataset, "loader": loader, "model": model,
        "opt": opt, "optimizer": opt, "loss_fn": loss_fn, "loss": loss_fn(model(x), y),
        "x": x, "y": y, "epochs": 1, "steps": 8, "total_steps": 8, "rank": 0, "world": 1,
        "my_accuracy": my_accuracy, "__name__": "__doc_example__",
        "target_port": int(CTX.endpoint.rsplit(":", 1)[1]),  # a server to proxy to
    }


def _close_everything(namespace: dict) -> None:
    import torch.distributed as dist

    for value in namespace.values():
        close = getattr(value, "close", None)
        if callable(close) and type(value).__module__.startswith("ferrosync"):
            with contextlib.suppress(Exception):
                close()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _run_python(code: str, label: str) -> None:
    namespace = _python_namespace()
    if re.search(r"\bsync\b", code) and not re.search(r"\bsync\s*=|as sync\b", code):
        # a snippet that drives a sync it did not open: a world of one in a directory
        namespace["sync"] = namespace["ferrosync"].connect(
            str(CTX.workdir / "own-sync"), rank=0, world_size=1)
    try:
        exec(compile(code, label, "exec"), namespace)  # noqa: S102 - the docs' own code
    finally:
        _close_everything(namespace)


def _evaluate_python(example) -> None:
    source = _source(example)
    target = _file_block_path(source)
    if target is not None:  # a file the docs' commands run: written by the fixture
        compile(source, f"{CTX.doc}:{example.line}", "exec")
        assert (CTX.workdir / target).read_text() == source
        return None
    _run_python(_substitute_paths(source), f"{CTX.doc}:{example.line}")
    return None


def _file_block_path(source: str) -> str | None:
    first = source.lstrip().splitlines()[0] if source.strip() else ""
    m = re.fullmatch(r"#\s*([\w./-]+\.py)", first.strip())
    return m.group(1) if m else None


def file_blocks() -> dict[str, str]:
    """Every file a document asks you to write (a block starting `# path.py`)."""
    files = {}
    for doc in DOCUMENTS:
        for example in SYBIL.parse(Path(ROOT) / doc):
            if example.region.evaluator is _evaluate_python:
                path = _file_block_path(_source(example))
                if path:
                    files[path] = _source(example)
    return files


def _evaluate_diff(example) -> None:
    lines = []
    for line in _source(example).splitlines():
        if line.startswith("-"):
            continue
        lines.append(line[1:] if line[:1] in "+ " else line)
    _run_python(_substitute_paths("\n".join(lines)), f"{CTX.doc}:{example.line}")


# -- bash --------------------------------------------------------------------------------

def _commands(source: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", source)
    out = []
    for line in joined.splitlines():
        line = line.split(" #")[0].strip() if " #" in line else line.strip()
        if line and not line.startswith("#"):
            out.extend(part.strip() for part in line.split(" && "))
    return out


def _pyproject_extras() -> set[str]:
    text = read("pyproject.toml")
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+)\s*=", section, re.M))


def _check_pip(words: list[str]) -> None:
    extras = set()
    for w in words:
        m = re.search(r"(?:^|\.|ferrosync)\[([\w,-]+)\]", w)
        if m:
            extras.update(m.group(1).split(","))
        m = re.fullmatch(r"torch==([\d.]+)", w)
        if m:
            with open(os.path.join(ROOT, ".ci", "run")) as f:
                assert f"torch=={m.group(1)}" in f.read(), f"{w}: not the torch CI pins"
    missing = extras - _pyproject_extras()
    assert not missing, f"pip install names extras pyproject.toml lacks: {sorted(missing)}"


def _train_args(words: list[str], i: int) -> list[str]:
    """words[i] is `ferrosync.train`: cap --steps and --nproc before any SCRIPT."""
    head, tail = words[:i + 1], words[i + 1:]
    script_at = next((k for k, w in enumerate(tail) if w.endswith(".py")), len(tail))
    flags, rest = tail[:script_at], tail[script_at:]
    steps = _MAX_STEPS * (2 if "--resume" in flags else 1)
    out, k = [], 0
    while k < len(flags):
        w = flags[k]
        if w == "--steps":
            out += [w, str(min(int(flags[k + 1]), steps))]
            k += 2
            continue
        if w in ("--nproc", "--nproc-per-node"):
            out += [w, str(min(int(flags[k + 1]), _MAX_NPROC))]
            k += 2
            continue
        out.append(w)
        k += 1
    if "--steps" not in out and not rest:
        out += ["--steps", str(steps)]
    return head + out + rest


def _prepare(command: str, cap: bool = True) -> tuple[dict, list[str]]:
    words = shlex.split(_substitute_paths(command))
    # the docs' scripts are the repository's (their commands run from a clone's root)
    words = [os.path.join(ROOT, w) if w.startswith(("tools/", "examples/")) else w
             for w in words]
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    for i, w in enumerate(words):
        if w in ("ferrosync.train",) and cap:
            words = _train_args(words, i)
            break
    if words and words[0] == "torchrun":
        words = [sys.executable, "-m", "torch.distributed.run"] + [
            str(min(int(w), _MAX_NPROC)) if prev == "--nproc-per-node" else w
            for prev, w in zip([""] + words[1:], words[1:])]
    elif words and words[0] == "python":
        words[0] = sys.executable
    elif words and words[0] == "ferrosync":
        words = [sys.executable, "-m", "ferrosync"] + words[1:]
    return env, words


def _runnable(words: list[str]) -> bool:
    if not words or words[0] != sys.executable:
        return False
    if words[1:3] == ["-m", "torch.distributed.run"]:
        return "--nnodes" not in words
    if words[1] == "-m":
        return words[2].startswith("ferrosync")
    return words[1].startswith((os.path.join(ROOT, "tools") + os.sep,
                                os.path.join(ROOT, "examples") + os.sep))


def _run_command(command: str, cap: bool = True) -> str:
    words0 = shlex.split(command)
    if words0[0] == "pip":
        _check_pip(words0)
        return ""
    if words0[:3] == ["python", "-m", "pytest"]:
        with open(os.path.join(ROOT, ".ci", "run")) as f:
            assert "python -m pytest -q" in f.read()
        return ""  # this suite
    extra_env, words = _prepare(command, cap)
    assert _runnable(words), (
        f"{CTX.doc}: `{command}` cannot run in the test suite; run it here or mark its "
        "block with <!-- skip: next \"reason\" --> and say so in the text")
    env = {**CTX.env, **extra_env}
    members = 1
    if "--elastic" in words and "--nproc" not in words and "--min-ranks" in words:
        members = int(words[words.index("--min-ranks") + 1])
    from train_cli import ForkedCli, launch_in_process

    if members == 1 and words[1:3] == ["-m", "ferrosync.train"] and "--nproc" in words:
        # a launch: its launcher runs in this process, its ranks as real processes
        code, out, _ = launch_in_process(words[3:], CTX.workdir, env, merged=True)
        _check_outcome(words, code, out)
        return out
    if words[1:3] == ["-m", "ferrosync"]:  # an operator tool: in this process too
        code, out = _tool_in_process(words[3:], env)
        _check_outcome(words, code, out)
        return out
    procs = []
    for k in range(members):
        cwd = CTX.workdir if members == 1 else CTX.workdir / f"member-{k}"
        cwd.mkdir(exist_ok=True)
        procs.append(ForkedCli(words, cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True))
    outputs = []
    deadline = time.monotonic() + _COMMAND_TIMEOUT
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, out in zip(procs, outputs):
        _check_outcome(words, p.returncode, out)
    return "\n".join(outputs)


def _tool_in_process(argv: list[str], env: dict) -> tuple[int, str]:
    """(exit code, stdout and stderr) of ``ferrosync ARGV`` run as a call to its
    ``main`` in this process, in the document's directory with ``env`` as the
    environment (both restored): a process of its own would only pay torch's import
    again. Warnings print, as in a process of its own."""
    import io
    import warnings

    from ferrosync.__main__ import main

    out = io.StringIO()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(CTX.workdir)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), \
                warnings.catch_warnings():
            warnings.simplefilter("default")
            try:
                code = main(list(argv))
            except SystemExit as exc:  # argparse's own errors
                code = exc.code
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return code, out.getvalue()


def _check_outcome(words: list[str], code: int, out: str) -> None:
    """A documented command succeeds; a training run's FINAL says its ranks agree."""
    assert code == 0, f"{CTX.doc}: `{' '.join(words)}` exited {code}:\n" + out[-3000:]
    if "ferrosync.train" in words and not any(w.endswith(".py") for w in words):
        finals = [line for line in out.splitlines() if line.startswith("FINAL {")]
        assert finals, out[-2000:]
        record = json.loads(finals[-1][len("FINAL "):])
        assert record["ranks_agree"] is True, record


def _evaluate_bash(example) -> None:
    for command in _commands(_source(example)):
        _run_command(command)


# -- json and sample outputs -------------------------------------------------------------

def _evaluate_json(example) -> None:
    record = json.loads(_source(example))
    if "step" in record:  # a --metrics line: at least the keys every line carries
        from train_cli import METRIC_KEYS

        assert METRIC_KEYS <= set(record), sorted(METRIC_KEYS - set(record))
    return None


def _evaluate_text(example) -> None:
    source = _source(example)
    first = source.lstrip().splitlines()[0]
    for prefix, check in _OUTPUT_CHECKS.items():
        if first.startswith(prefix):
            check(source)
            return
    raise AssertionError(f"{CTX.doc}:{example.line}: a text block with no check for "
                         f"{first!r}: add one to _OUTPUT_CHECKS or mark it skipped")


def _check_layout(sample: str) -> None:
    """README's Layout: every file and directory it lists exists where it is drawn, every
    script or document it names in a description exists, and every module of the
    package and of its layer packages is listed."""
    parents: dict[int, str] = {}
    listed = set()
    for line in sample.splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name, _, description = line.strip().partition(" ")
        path = os.path.join(parents.get(depth - 1, ""), name) if depth else name
        assert os.path.exists(os.path.join(ROOT, path)), f"README Layout: {path} does not exist"
        listed.add(path.rstrip("/"))
        if name.endswith("/"):
            parents[depth] = path
            for cited in re.findall(r"[\w-]+\.(?:py|md)\b", description):
                assert os.path.exists(os.path.join(ROOT, path, cited)), (
                    f"README Layout: {path}{cited} does not exist")
    for package in ("ferrosync", "ferrosync/core", "ferrosync/compression", "ferrosync/storage",
                    "ferrosync/storage/engines", "ferrosync/torchdist"):
        for entry in sorted(os.listdir(os.path.join(ROOT, package))):
            full = f"{package}/{entry}"
            if entry.startswith("_") or not (entry.endswith(".py") or os.path.isdir(
                    os.path.join(ROOT, full))):
                continue
            assert full in listed, f"README Layout does not list {full}"


def _kind(line: str) -> str:
    """What kind of line an output line is: its text up to the first number or hex
    token (rank rows, which start with a number, are all one kind)."""
    for mount, local in MOUNTS.items():  # a real run's paths, as the docs show them
        line = line.replace(f"{CTX.workdir / local}/", mount)
    line = re.sub(r"\b[0-9a-f]{8,}\b", "H", line)
    return re.split(r"\d", line, maxsplit=1)[0].rstrip()


def _kinds(text: str, *, skip_first: int = 0) -> set[str]:
    return {_kind(line) for line in text.splitlines()[skip_first:]
            if line.strip() and line.strip() != "..."}


def _shape(line: str) -> str:
    """A line's words with its numbers, hex ids and temporary paths blanked."""
    line = re.sub(r"\S*/ferrosync-train-\w+", "TMP", line)
    return re.sub(r"\d+", "N", re.sub(r"\b[0-9a-f]{16}\b", "H", line))


def _check_train_sample(sample: str) -> None:
    """docs/train.md's sample run against the real demo (2 ranks, the documented
    command, 10 epochs): what does not depend on the machine — the same summary rows in
    the same order, the same step count, bytes written within 2 % of the sample, every
    FINAL key it shows, the documented accuracy (>= 90 %) and every rank's digest the
    same. Accuracy, digests and timings differ between machines and torch builds (the
    sample says so), so they are not compared with the sample's."""
    out = _run_command("python -m ferrosync.train --nproc 2 --no-progress", cap=False)
    real_final = json.loads(out.strip().splitlines()[-1][len("FINAL "):])

    def rows(text):
        return [m.group(1) for m in re.finditer(r"^\[rank 0\]   (\w[\w ]*?)\s{2,}", text,
                                                 re.M)]

    assert rows(sample) == rows(out), (rows(sample), rows(out))
    # the launcher's first line has the real one's words (pids, job id, paths differ)
    assert _shape(sample.lstrip().splitlines()[0]) == _shape(out.lstrip().splitlines()[0]), (
        sample.lstrip().splitlines()[0], out.lstrip().splitlines()[0])
    doc_final = sample.strip().splitlines()[-1]
    shown = set(re.findall(r'"(\w+)":', doc_final))
    assert shown <= set(real_final), sorted(shown - set(real_final))
    doc = {k: json.loads(v) for k, v in re.findall(r'"(\w+)":([^,.}]+[^,}]*)', doc_final)}
    assert doc["steps"] == real_final["steps"]
    assert real_final["accuracy"] >= 0.90 and doc["accuracy"] >= 0.90, (doc, real_final)
    assert real_final["ranks_agree"] is True
    assert abs(doc["bytes_written"] / real_final["bytes_written"] - 1) <= 0.02
    assert re.search(r"ranks agree\s+yes \(digest [0-9a-f]{16}\)", sample)
    m = re.search(r"accuracy\s+([\d.]+)%", sample)
    assert float(m.group(1)) == round(doc["accuracy"] * 100, 2), "summary and FINAL differ"


def _a_finished_job() -> str:
    """A local directory holding one finished 2-rank job (the docs' /mnt/nfs/exp7)."""
    where = CTX.workdir / "mnt-nfs" / "exp7"
    _run_command(f"python -m ferrosync.train --nproc 2 --sync {where}")
    return str(where)


def _check_inspect_sample(sample: str) -> None:
    """operations.md's inspect sample shows every kind of line inspect prints for a
    finished job (header, storage and job summaries, generation, rank table, footer)."""
    out = _run_command(f"ferrosync inspect {_a_finished_job()} --watch 0")
    missing = _kinds(out, skip_first=1) - _kinds(sample, skip_first=2)
    assert not missing, f"kinds of line inspect prints that the sample lacks: {missing}"


def _check_gc_sample(sample: str) -> None:
    out = _run_command(f"ferrosync gc {_a_finished_job()} --dry-run --watch 0")
    missing = _kinds(out, skip_first=1) - _kinds(sample, skip_first=2)
    assert not missing, f"kinds of line gc prints that the sample lacks: {missing}"


def _check_doctor_sample(sample: str) -> None:
    """operations.md's doctor sample: the checks a fresh local directory gets, in order,
    each in the table below it, and the recommendation lines."""
    out = _run_command(f"ferrosync doctor {CTX.workdir / 'mnt-scratch' / 'exp7'} "
                       "--size-mib 1 --samples 5")

    def checks(text):
        return re.findall(r"^  \[(?:ok  |info|warn|fail)\] (\S+(?: \S+)?)\s{2,}", text, re.M)

    assert checks(sample) == checks(out), (checks(sample), checks(out))
    table = read("docs/operations.md").split("What each check means:", 1)[1]
    for name in checks(out) + ["existing jobs"]:
        assert re.search(rf"^\| {re.escape(name)}\b", table, re.M), (
            f"docs/operations.md's check table has no row for {name!r}")
    assert _kinds(out, skip_first=1) <= _kinds(sample, skip_first=2)


_OUTPUT_CHECKS: dict = {
    "ferrosync/": _check_layout,
    "ferrosync.train: started": _check_train_sample,
    "$ ferrosync inspect": _check_inspect_sample,
    "$ ferrosync gc": _check_gc_sample,
    "$ ferrosync doctor": _check_doctor_sample,
}

SYBIL = Sybil(parsers=[
    SkipParser(),
    CodeBlockParser(language="python", evaluator=_evaluate_python),
    CodeBlockParser(language="bash", evaluator=_evaluate_bash),
    CodeBlockParser(language="diff", evaluator=_evaluate_diff),
    CodeBlockParser(language="json", evaluator=_evaluate_json),
    CodeBlockParser(language="text", evaluator=_evaluate_text),
], path=ROOT)


def example_params() -> list:
    """One test per code block: (document, line, language, [skip directive,] block)."""
    items = []
    for doc in DOCUMENTS:
        pending = []
        for example in SYBIL.parse(Path(ROOT) / doc):
            if not isinstance(example.parsed, str):  # a skip directive: goes with the next
                pending.append(example)
                continue
            language = {_evaluate_python: "python", _evaluate_bash: "bash",
                        _evaluate_diff: "diff", _evaluate_json: "json",
                        _evaluate_text: "text"}[example.region.evaluator]
            items.append(pytest.param(doc, pending + [example],
                                      id=f"{doc}:{example.line}-{language}"))
            pending = []
        assert not pending, f"{doc}: a skip directive with no code block after it"
    return items
