"""Operator tools behind the ``ferrosync`` console script: ``inspect``, ``gc``, ``doctor``
and ``keys`` (docs/operations.md).

Nothing here is imported by ``import ferrosync``: the CLI (``ferrosync/__main__.py``)
imports one tool module when it runs, and the launcher writes each launch's key file
with ``keys``. The tools may list the store; the listing ban
(docs/design.md#exact-name-polling) is the collective path's.
"""
