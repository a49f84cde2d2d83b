"""PyTorch's own ``distributed_test.py`` on backend "ferrosync", side by side with gloo.

torch ships its distributed test suite in the wheel
(``torch/testing/_internal/distributed/distributed_test.py``); upstream runs it per backend
through ``test/distributed/test_distributed_spawn.py``: the environment names the
backend (``BACKEND``), the world size (``WORLD_SIZE``), a scratch directory
(``TEMP_DIR``) and the rendezvous (``INIT_METHOD``), and a ``TestDistBackend`` subclass
spawns one process per rank for every test. This file is that runner, in two roles:

* **with BACKEND set** it is the upstream runner: it runs the selected tests of
  ``TestDistBackendWithSpawn`` on that backend and writes one JSON record per test
  (passed, failed, skipped; the reason) to ``$FERROSYNC_SUITE_RESULTS``;
* **without** it is the driver: it runs the same selection once per backend (each in
  its own interpreter and scratch directory) and prints pass/fail/skip side by side::

    python tools/drills/torch_dist_suite.py                    # the whole file, gloo and ferrosync
    python tools/drills/torch_dist_suite.py -k send_recv       # tests whose name matches a regex
    python tools/drills/torch_dist_suite.py --backends ferrosync --tests test_barrier test_broadcast

**How the suite's backend-name gates are lifted for ferrosync** (without editing torch):
the suite decides what a backend may run by its name, three ways. (1) The feature
sets of ``common_distributed.DistTestCases.backend_feature`` ("ddp", "subgroup", ...)
list nccl, gloo and ucc: ferrosync is added to every set gloo is in, and to "plugin"
(``require_backend_is_available`` then counts it as available). (2) Decorators compare
the name literally (``require_backend_is_available({"gloo"})``, ``BACKEND != "gloo"``
for timeouts, "Batch Send Recv CPU"): they run once, when ``distributed_test`` is
imported, so the runner imports it with ``BACKEND=gloo`` and ferrosync gets exactly the
tests gloo gets. (3) A few test bodies branch on the name at run time
(``if BACKEND == "mpi" or BACKEND == "gloo":`` picks the CPU model): after the import
the module's ``BACKEND`` becomes ``"ferrosync"`` as a ``str`` that also compares equal
to ``"gloo"`` (``GlooGates``), so those branches take gloo's path, while
``init_process_group(backend=BACKEND)``, ``dist.get_backend()`` and every message
say "ferrosync". Tests that torch itself restricts to gloo inside torch (not in the
suite), such as ``monitored_barrier``, still fail on ferrosync: they are listed as out
of scope in ``OUT_OF_SCOPE`` and docs/ddp.md.

The selection is the whole file (285 tests on torch 2.13; those gloo skips on CPU with
2 ranks are skipped alike: CUDA, NCCL, MPI, larger worlds); ``-k REGEX`` or ``--tests``
narrow it. ``--start-method fork`` starts the ranks by fork instead of upstream's spawn
(the same tests, far cheaper to start; the pytest subset uses it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

#: tests that torch itself refuses for every backend but gloo, inside torch (not in the
#: suite's gates): they cannot pass on any other backend (docs/ddp.md)
OUT_OF_SCOPE = {
    r"monitored_barrier": "torch's dist.monitored_barrier raises 'monitored_barrier is only "
    "implemented for GLOO backend' for every other backend, before a backend is reached",
}
RESULTS_ENV = "FERROSYNC_SUITE_RESULTS"
SELECT_ENV = "FERROSYNC_SUITE_TESTS"
START_ENV = "FERROSYNC_SUITE_START"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class GlooGates(str):
    """The backend's name, compared as gloo's by the suite's run-time name checks.

    ``"ferrosync"`` for everything torch does with it (``str(...)``, ``.lower()``,
    ``dist.Backend(...)``, f-strings); ``==``/``!=`` with ``"gloo"`` as well as with
    ``"ferrosync"`` is true/false, so a test body that branches on gloo takes gloo's
    path (docs at the top of this file).
    """

    def __eq__(self, other):
        return other == "gloo" or str.__eq__(self, other)

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = str.__hash__


def _import_suite(backend: str):
    """``distributed_test`` with its gates lifted for ``backend`` (see the module docs)."""
    from torch.testing._internal.common_distributed import DistTestCases

    if backend != "gloo":
        for feature, backends in DistTestCases.backend_feature.items():
            if "gloo" in backends or feature == "plugin":
                backends.add(backend)
    os.environ["BACKEND"] = "gloo"  # the decorators run now, with gloo's name
    try:
        from torch.testing._internal.distributed import distributed_test
    finally:
        os.environ["BACKEND"] = backend
    if backend != "gloo":
        distributed_test.BACKEND = GlooGates(backend)
    return distributed_test


# -- the upstream runner's role (BACKEND set) ----------------------------------------------

if os.environ.get("BACKEND"):
    import torch  # noqa: E402  (the hook registers "ferrosync" on import torch)

    if os.environ["BACKEND"] not in ("gloo", "nccl", "ucc", "mpi"):
        import ferrosync  # noqa: F401  (registers the backend where no entry point is installed)
    _suite = _import_suite(os.environ["BACKEND"])

    class TestDistBackendWithSpawn(_suite.TestDistBackend, _suite.DistributedTest._DistTestBase):
        """As upstream's runner defines it; ``$FERROSYNC_SUITE_START=fork`` forks the ranks."""

        def setUp(self):
            super().setUp()
            if os.environ.get(START_ENV) == "fork":
                self._start_processes(torch.multiprocessing.get_context("fork").Process)
            else:
                self._spawn_processes()
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


class _Recorder:
    """A unittest result that keeps one record per test."""

    def __new__(cls, *args, **kwargs):
        import unittest

        class Result(unittest.TextTestResult):
            records: list[dict] = []

            def _add(self, test, outcome, detail=""):
                name = test.id().rsplit(".", 1)[-1]
                self.records.append({"test": name, "outcome": outcome,
                                     "detail": detail.strip()[-3000:],
                                     "seconds": round(time.monotonic() - self._t0, 2)})

            def startTest(self, test):
                self._t0 = time.monotonic()
                super().startTest(test)

            def addSuccess(self, test):
                super().addSuccess(test)
                self._add(test, "pass")

            def addFailure(self, test, err):
                super().addFailure(test, err)
                self._add(test, "fail", self._exc_info_to_string(err, test))

            def addError(self, test, err):
                super().addError(test, err)
                self._add(test, "fail", self._exc_info_to_string(err, test))

            def addSkip(self, test, reason):
                super().addSkip(test, reason)
                self._add(test, "skip", reason)

            def addExpectedFailure(self, test, err):
                super().addExpectedFailure(test, err)
                self._add(test, "skip", "expected failure")

            def addUnexpectedSuccess(self, test):
                super().addUnexpectedSuccess(test)
                self._add(test, "fail", "unexpected success")

        return Result(*args, **kwargs)


def _run_here() -> int:
    """The upstream runner: the tests chosen by ``$FERROSYNC_SUITE_TESTS`` (JSON: exact
    ``tests``, else those matching the regex ``pattern``), in the class's order."""
    import unittest

    choice = json.loads(os.environ[SELECT_ENV])
    names = unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn)
    if choice.get("tests"):
        wanted = set(choice["tests"])
        names = [n for n in names if n in wanted or n.rsplit("_", 1)[0] in wanted]
    else:
        names = [n for n in names if re.search(choice["pattern"], n)]
    suite = unittest.TestSuite(TestDistBackendWithSpawn(name) for name in names)
    runner = unittest.TextTestRunner(resultclass=_Recorder, verbosity=1, stream=sys.stderr)
    result = runner.run(suite)
    with open(os.environ[RESULTS_ENV], "w") as f:
        json.dump(result.records, f, indent=1)
    return 0


# -- the driver's role ---------------------------------------------------------------------

def choice(args) -> dict:
    """What to run, as the runner role reads it from ``$FERROSYNC_SUITE_TESTS``."""
    if args.tests:
        return {"tests": args.tests}
    return {"pattern": args.pattern or ".*"}


def out_of_scope(name: str) -> str | None:
    for pattern, why in OUT_OF_SCOPE.items():
        if re.search(pattern, name):
            return why
    return None


def run_backend(backend: str, tests: dict, *, world_size: int = 2, start: str = "spawn",
                timeout: float = 3600.0, log=None) -> dict[str, dict]:
    """Run the ``tests`` chosen (see ``choice``) on ``backend`` in a fresh interpreter;
    {test: record}."""
    with tempfile.TemporaryDirectory(prefix=f"torchsuite-{backend}-") as scratch:
        temp_dir = os.path.join(scratch, "temp")
        os.makedirs(temp_dir)
        results = os.path.join(scratch, "results.json")
        env = dict(os.environ)
        for key in ("FERROSYNC_JOB", "FERROSYNC_URL", "RANK", "WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
            env.pop(key, None)
        env.update(BACKEND=backend, WORLD_SIZE=str(world_size), TEMP_DIR=temp_dir,
                   INIT_METHOD="env://", TMPDIR=scratch, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])),
                   **{RESULTS_ENV: results, SELECT_ENV: json.dumps(tests), START_ENV: start})
        proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env,
                              cwd=scratch, stdout=log, stderr=log if log else subprocess.PIPE,
                              timeout=timeout, check=False)
        if not os.path.exists(results):
            tail = (proc.stderr or b"")[-4000:].decode(errors="replace") if not log else ""
            raise RuntimeError(f"the {backend} run wrote no results (exit {proc.returncode})"
                               f"\n{tail}")
        with open(results) as f:
            return {r["test"]: r for r in json.load(f)}


def table(runs: dict[str, dict[str, dict]]) -> str:
    """Markdown: one row per test some backend ran (passed or failed), then the tests
    every backend skipped, counted by the suite's reason."""
    backends = list(runs)
    tests = list(dict.fromkeys(name for records in runs.values() for name in records))
    lines = ["| test | " + " | ".join(backends) + " |", "|---|" + "---|" * len(backends)]
    skipped: dict[str, int] = {}
    for name in tests:
        records = [runs[b].get(name) for b in backends]
        if all(r is not None and r["outcome"] == "skip" for r in records):
            reason = records[0]["detail"].splitlines()[0][:80] if records[0]["detail"] else "?"
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        cells = [r["outcome"] if r else "-" for r in records]
        note = out_of_scope(name)
        lines.append(f"| {name} | " + " | ".join(cells) + " |" + (" out of scope" if note else ""))
    lines.append("")
    lines.append("Skipped by every backend: " + "; ".join(
        f"{count} ({reason})" for reason, count in sorted(skipped.items(), key=lambda i: -i[1])))
    totals = []
    for backend in backends:
        outcomes = [r["outcome"] for r in runs[backend].values()]
        totals.append(f"{backend}: {outcomes.count('pass')} pass, {outcomes.count('fail')} "
                      f"fail, {outcomes.count('skip')} skip")
    return "\n".join(lines) + "\n\n" + "; ".join(totals)


def verdict(runs: dict[str, dict[str, dict]], reference: str = "gloo") -> list[str]:
    """Tests the reference passes and another backend does not, out-of-scope ones aside."""
    problems = []
    for backend, records in runs.items():
        if backend == reference or reference not in runs:
            continue
        for name, ref in runs[reference].items():
            mine = records.get(name, {}).get("outcome")
            if ref["outcome"] == "pass" and mine != "pass" and not out_of_scope(name):
                problems.append(f"{name}: {reference} passes, {backend} {mine}")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="gloo,ferrosync")
    parser.add_argument("-k", dest="pattern", help="only tests whose name matches this regex")
    parser.add_argument("--tests", nargs="*", help="exactly these tests")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--start-method", choices=("spawn", "fork"), default="spawn")
    parser.add_argument("--json", help="also write {backend: {test: record}} here")
    parser.add_argument("--log", help="append the runs' output (every rank's stderr) here")
    parser.add_argument("--details", action="store_true",
                        help="print the failure of every test that gloo passes and the "
                        "other backend does not")
    args = parser.parse_args(argv)
    tests = choice(args)
    runs = {}
    log = open(args.log, "a") if args.log else None  # noqa: SIM115 - closed below
    for backend in args.backends.split(","):
        t0 = time.monotonic()
        runs[backend] = run_backend(backend, tests, world_size=args.world_size,
                                    start=args.start_method, log=log)
        print(f"{backend}: {len(runs[backend])} tests in {time.monotonic() - t0:.0f} s",
              file=sys.stderr)
    if log is not None:
        log.close()
    print(table(runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    problems = verdict(runs)
    for problem in problems:
        print("NOT LIKE GLOO:", problem)
        if args.details:
            name = problem.split(":")[0]
            for backend, records in runs.items():
                if backend != "gloo" and name in records:
                    print(records[name]["detail"])
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(_run_here() if os.environ.get("BACKEND") else main())
