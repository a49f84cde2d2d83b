"""The repository stands on its own: every document a file cites is in the repository.

Scans every ``*.py`` and ``*.md`` file (outside ``.git`` and build output) for
citations of documents and scripts (``docs/*.md``, ``tools/**/*.py``, ``examples/*.py``,
relative Markdown links, and the retired external design document) and checks that
each cited file exists, and that every ``#anchor`` a citation names is a heading of
the cited Markdown file (GitHub's rule: lowercase, punctuation removed, spaces to
hyphens). ``docs/design.md`` must exist.

And the documents run: every fenced code block of README.md and docs/*.md is one test,
``test_doc_example[<document>:<line>-<language>]`` (Sybil parses the documents; how each
kind of block runs, and the documented substitutions, are described in
``tests/doc_examples.py``, which runs them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# its asserts are the blocks' checks: rewritten as a test module's are, for their messages
pytest.register_assert_rewrite("doc_examples")
from doc_examples import (  # noqa: E402
    BUCKETS,
    CTX,
    DOCUMENTS,
    MOUNTS,
    ROOT,
    SYBIL,
    example_params,
    file_blocks,
    free_port,
    read,
)

DOC = "docs/design.md"
_SKIP_DIRS = {".git", "__pycache__", "build", "dist", ".venv", "venv", "node_modules",
              ".pytest_cache", ".ruff_cache", ".hypothesis"}

#: a repository path cited from anywhere (a Markdown file under docs, a script under tools
#: or examples), with an optional #anchor; not part of a longer path such as /tmp/docs/x.md
_CITED_PATH = re.compile(
    r"(?<![\w/.-])((?:docs/[\w.-]+\.md)|(?:tools|examples)/(?:[\w-]+/)*[\w.-]+\.py)"
    r"(?:#([\w-]+))?")
#: the external design document that used to be cited, by file name or as "... §N"
#: (spelt "[D]ESIGN" so that grepping the repository for citations does not find this line)
_EXTERNAL_DOC = re.compile(r"\b[D]ESIGN(?:\.md\b|\s*§)")
#: a Markdown link target: [text](target) with a relative .md target and optional anchor,
#: or a same-file anchor (#anchor)
_MD_LINK = re.compile(r"\]\((?!\w+://|mailto:)([^)\s#]*\.md)?(?:#([^)\s]*))?\)")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _repo_files(*suffixes: str) -> list[str]:
    found = []
    for directory, subdirs, files in os.walk(ROOT):
        subdirs[:] = sorted(d for d in subdirs
                            if d not in _SKIP_DIRS and not d.endswith(".egg-info"))
        for name in sorted(files):
            if name.endswith(suffixes):
                found.append(os.path.relpath(os.path.join(directory, name), ROOT))
    return found


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading's text: markup dropped, lowercased, punctuation
    removed (letters, digits, spaces, hyphens and underscores stay), spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](link) -> text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors_of(markdown: str) -> set[str]:
    """Every heading anchor of a Markdown text (``-1``, ``-2``... for repeated ones),
    ignoring ``#`` lines inside fenced code blocks."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in markdown.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = github_anchor(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        anchors.add(base if n == 0 else f"{base}-{n}")
    return anchors


def _citations() -> list[tuple[str, int, str, str | None]]:
    """(citing file, line, cited repository path, anchor or None) for every citation."""
    out = []
    for rel in _repo_files(".py", ".md"):
        text = read(rel)
        for m in _CITED_PATH.finditer(text):
            out.append((rel, _line_of(text, m.start()), m.group(1), m.group(2)))
        if rel.endswith(".md"):
            here = os.path.dirname(rel)
            for m in _MD_LINK.finditer(text):
                target, anchor = m.group(1), m.group(2)
                if target is None and anchor is None:
                    continue
                path = rel if target is None else os.path.normpath(os.path.join(here, target))
                out.append((rel, _line_of(text, m.start()), path.replace(os.sep, "/"),
                            anchor or None))
    return out


@pytest.mark.unit
def test_design_document_exists():
    assert os.path.isfile(os.path.join(ROOT, DOC)), f"{DOC} is missing"
    anchors = anchors_of(read(DOC))
    # the sections the code links to most; more are checked through the citations
    for anchor in ("storage-rules", "atomic-publish", "exact-name-polling",
                   "no-cross-host-clocks", "final-line", "metrics-lines"):
        assert anchor in anchors, f"{DOC} has no heading for #{anchor}"


@pytest.mark.unit
def test_no_citation_of_the_external_design_document():
    offenders = []
    for rel in _repo_files(".py", ".md"):
        text = read(rel)
        for m in _EXTERNAL_DOC.finditer(text):
            line = _line_of(text, m.start())
            offenders.append(f"{rel}:{line}: {text.splitlines()[line - 1].strip()}")
    assert not offenders, ("these lines cite a design document outside the repository; "
                           f"link the matching section of {DOC} instead:\n"
                           + "\n".join(offenders))


@pytest.mark.unit
def test_cited_files_exist():
    missing = sorted({f"{rel}:{line}: {path}" for rel, line, path, _ in _citations()
                      if not os.path.exists(os.path.join(ROOT, path))})
    assert not missing, "cited files that are not in the repository:\n" + "\n".join(missing)


def test_cited_anchors_exist():
    cache: dict[str, set[str]] = {}
    broken = []
    for rel, line, path, anchor in _citations():
        if anchor is None or not path.endswith(".md"):
            continue
        full = os.path.join(ROOT, path)
        if not os.path.isfile(full):
            continue  # reported by test_cited_files_exist
        if path not in cache:
            cache[path] = anchors_of(read(path))
        if anchor not in cache[path]:
            broken.append(f"{rel}:{line}: {path}#{anchor}")
    assert not broken, "links to headings that do not exist:\n" + "\n".join(sorted(set(broken)))


@pytest.mark.parametrize("heading, anchor", [
    ("Storage rules", "storage-rules"),
    ("Exact-name polling", "exact-name-polling"),
    ("FINAL line", "final-line"),
    ("Broadcast, all-gather and barrier", "broadcast-all-gather-and-barrier"),
    ("`ferrosync inspect URL`", "ferrosync-inspect-url"),
    ("Training with `python -m ferrosync.train`", "training-with-python--m-ferrosynctrain"),
])
def test_github_anchor_rule(heading, anchor):
    assert github_anchor(heading) == anchor


def test_readme_option_tables_match_the_code():
    """The README's option tables are generated from the options dataclasses: an option
    added, renamed or re-described in code without regenerating them fails here."""
    result = subprocess.run([sys.executable, "tools/docs/options_table.py", "--check"],
                            cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.unit
def test_every_ferrosync_command_the_documents_name_exists():
    """A `ferrosync SUB` in a document's code span is a subcommand of the console script
    (docs once named a `ferrosync train` that did not exist: the trainer is
    `python -m ferrosync.train`). Code blocks run, so they need no such check."""
    import argparse

    from ferrosync.__main__ import build_parser

    (subs,) = [a.choices for a in build_parser()._actions
               if isinstance(a, argparse._SubParsersAction)]
    wrong = [f"{doc}:{_line_of(read(doc), m.start())}: ferrosync {m.group(1)}"
             for doc in DOCUMENTS
             for m in re.finditer(r"`(?:\$ )?ferrosync ([a-z][\w-]*)", read(doc))
             if m.group(1) not in subs]
    assert not wrong, (f"commands the console script does not have (it has "
                       f"{', '.join(subs)}):\n" + "\n".join(wrong))


@pytest.mark.unit
def test_every_option_is_documented_and_validated():
    import dataclasses

    from ferrosync.core.registry import option_tables

    for cls in option_tables().values():
        for f in dataclasses.fields(cls):
            if "doc" not in f.metadata:
                continue  # composed options (the two-level sync's storage options)
            assert f.metadata["doc"] and f.metadata["check"] is not None, (cls, f.name)


# == Every code block of README.md and docs/*.md runs ==================================
#
# one test per block (tests/doc_examples.py says how each kind of block runs)

@pytest.fixture(scope="module")
def _doc_servers(s3_endpoint):
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    for bucket in BUCKETS:
        client.create_bucket(Bucket=bucket)
    return client


@pytest.fixture(scope="module")
def _doc_workdirs(tmp_path_factory):
    files = file_blocks()
    made = {}

    def workdir(doc: str) -> Path:
        if doc not in made:
            d = tmp_path_factory.mktemp(doc.replace("/", "-").replace(".", "-"))
            for rel, text in files.items():
                (d / rel).parent.mkdir(parents=True, exist_ok=True)
                (d / rel).write_text(text)
            made[doc] = d
        return made[doc]

    return workdir


@pytest.mark.timeout(900)  # a block of several commands, each starting ranks
@pytest.mark.parametrize("doc, examples", example_params())
def test_doc_example(doc, examples, _doc_servers, _doc_workdirs, s3_endpoint, monkeypatch):
    """Run one code block of a document (see tests/doc_examples.py)."""
    from train_cli import cli_env

    workdir = _doc_workdirs(doc)
    for bucket in BUCKETS:  # every block starts from empty buckets and mounts
        listed = _doc_servers.list_objects_v2(Bucket=bucket).get("Contents", [])
        for obj in listed:
            _doc_servers.delete_object(Bucket=bucket, Key=obj["Key"])
    for local in MOUNTS.values():
        shutil.rmtree(workdir / local, ignore_errors=True)
        (workdir / local).mkdir()
    CTX.workdir, CTX.doc, CTX.endpoint = workdir, doc, s3_endpoint
    CTX.env = cli_env(AWS_ENDPOINT_URL=s3_endpoint, MPLBACKEND="Agg")
    CTX.env["PYTHONPATH"] = os.pathsep.join([ROOT, str(workdir)])
    # Python blocks: rank 0 of a world of one, in the working directory, under a job id
    # (as under a scheduler: no claim window), the S3 server found as docs/train.md says
    monkeypatch.chdir(workdir)
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port()), "AWS_ENDPOINT_URL": s3_endpoint,
                       "FERROSYNC_JOB": "docs",
                       "FERROSYNC_URL": str(workdir / "mnt-nfs" / "sync")}.items():
        monkeypatch.setenv(key, value)
    for example in examples:
        example.evaluate()


@pytest.mark.unit
def test_every_code_block_is_collected():
    """Every fenced block of every document is a test: a block in a language no
    evaluator handles (or with none) would otherwise escape."""
    for doc in DOCUMENTS:
        fences = sum(1 for line in read(doc).splitlines() if _FENCE.match(line)) // 2
        examples = [e for e in SYBIL.parse(Path(ROOT) / doc) if isinstance(e.parsed, str)]
        assert len(examples) == fences, (
            f"{doc}: {fences} fenced blocks but {len(examples)} collected; give every block "
            "a language this file evaluates (python, bash, diff, json, text)")


@pytest.mark.unit
def test_the_figures_come_from_the_commands_shown():
    """tools/docs/regen_figures.py finds docs/performance.md's bench commands and every
    marked place it writes (the script itself runs for half an hour: it is not run here)."""
    from ferrosync.testing import figures as regen_figures

    text = read(regen_figures.BENCH_DOC)
    commands = regen_figures.bench_commands(text)
    assert len(commands) == 4 and all(c[:2] == ["python", "tools/bench/bench.py"] for c in commands)
    for name in ("machine", *regen_figures.FIGURES):
        assert regen_figures.write_between(text, name, "X") != text
    table = text.split("<!-- figures:bench-table -->", 1)[1]
    assert re.search(r"^\| 2 \| 64 MiB \| \d\.\d\d(–\d\.\d\d)?× \|", table, re.M), (
        "the 2-rank, 64 MiB, default-threading row stays, as a ratio to gloo")


@pytest.mark.unit
def test_the_readme_names_the_machine_of_its_figure():
    """A ratio the README quotes holds on the machine it was measured on: the README
    names the machine beside it and links the page that has its command."""
    readme = read("README.md")
    for m in re.finditer(r"\d\.\d\d–\d\.\d\d×", readme):
        around = readme[max(0, m.start() - 300):m.end() + 300]
        assert "machine" in around and "docs/performance.md" in around, around
