"""What ``import ferrosync`` offers: every exported name resolves to the object its home
module defines, and the heavy ones load only when first used (a fresh interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: exported names whose modules ``import ferrosync`` must not load
LAZY = {"ElasticSync": "ferrosync.elastic", "PublishedState": "ferrosync.elastic",
        "Strategy": "ferrosync.strategies", "DiLoCo": "ferrosync.strategies",
        "make_strategy": "ferrosync.strategies", "wrap": "ferrosync.ddp.comm_hook",
        "register_backend": "ferrosync.core.registry", "Trainer": "ferrosync.train"}

PROBE = """
import json, sys
import ferrosync
before = sorted(m for m in sys.modules if m.startswith("ferrosync"))
resolved = {name: getattr(ferrosync, name).__module__ for name in ferrosync.__all__
            if hasattr(getattr(ferrosync, name), "__module__")}
print(json.dumps({"before": before, "resolved": resolved}))
"""


def test_exported_names_resolve_and_load_lazily():
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERROSYNC_")}
    env["PYTHONPATH"] = ROOT
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout.strip().splitlines()[-1])
    loaded = [m for m in set(LAZY.values()) if m in record["before"]]
    assert not loaded, f"import ferrosync loaded {loaded}"
    for name, home in LAZY.items():
        assert record["resolved"][name].startswith(home), (name, record["resolved"][name])
    assert record["resolved"]["ElasticSync"] == "ferrosync.elastic.sync"
    assert record["resolved"]["register_backend"] == "ferrosync.core.registry"
