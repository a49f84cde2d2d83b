"""Benchmarks and document generators. Each runs as a script from a clone's root
(``python tools/bench/bench.py``) or as a module (``python -m tools.bench``); the tests import
them as ``from tools import NAME`` (pyproject's pytest ``pythonpath`` puts the root
first). The servers they start live in ``ferrosync/testing/``."""
