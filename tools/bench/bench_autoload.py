"""What the ``torch.backends`` autoload hook costs a gloo user.

Times ``import torch`` and ``init_process_group("gloo", init_method="env://")`` (a world
of one, a TCPStore on loopback) in fresh interpreters, with the hook on (default) and
off (``FERROSYNC_AUTOLOAD=0``), alternating, and says whether anything of ferrosync
was imported. Run from a checkout whose entry point is installed (``pip install -e .``);
this checkout's hook is the one loaded (it is first on ``PYTHONPATH``)::

    python tools/bench/bench_autoload.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from ferrosync.core.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import torch.distributed as dist
dist.init_process_group("gloo", init_method="env://", rank=0, world_size=1)
t2 = time.perf_counter()
dist.destroy_process_group()
import ferrosync_autoload
print(json.dumps({"import_torch_ms": (t1 - t0) * 1e3, "init_ms": (t2 - t1) * 1e3,
                  "ferrosync_imported": any(m == "ferrosync" or m.startswith("ferrosync.")
                                            for m in sys.modules),
                  "hook": ferrosync_autoload.__file__}))
"""


def once(autoload: bool) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("FERROSYNC_AUTOLOAD", "FERROSYNC_URL", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=ROOT, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               OMP_NUM_THREADS="1")
    if not autoload:
        env["FERROSYNC_AUTOLOAD"] = "0"
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=300, cwd="/", check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    results = {True: [], False: []}
    once(True), once(False)  # warm the page cache for both
    for _ in range(args.runs):
        for autoload in (True, False):  # alternating: drift hits both alike
            results[autoload].append(once(autoload))
    print(f"command: python tools/bench/bench_autoload.py --runs {args.runs}")
    for autoload, label in ((False, "FERROSYNC_AUTOLOAD=0"), (True, "hook on (default)")):
        rows = results[autoload]
        init = sorted(r["init_ms"] for r in rows)
        imp = sorted(r["import_torch_ms"] for r in rows)
        print(f"{label:22} init_process_group(gloo, env://) {init[0]:.1f}-{init[-1]:.1f} ms, "
              f"import torch {imp[0]:.0f}-{imp[-1]:.0f} ms, ferrosync imported: "
              f"{sorted({r['ferrosync_imported'] for r in rows})}")
    print(f"hook loaded from {results[True][0]['hook']}")


if __name__ == "__main__":
    main()
