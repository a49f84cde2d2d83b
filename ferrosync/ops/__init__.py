"""Operator tools behind the ``ferrosync`` console script: ``inspect``, ``gc``, ``doctor``.

    ferrosync inspect URL      # generations, ranks, liveness, aborts, bytes
    ferrosync gc URL --dry-run # what would be removed, and why
    ferrosync doctor URL       # is this location fit for a job? recommended settings

Nothing here is imported by ``import ferrosync``: the CLI (``ferrosync/__main__.py``)
imports one tool module when it runs. ``keys`` (the per-job key files) is also what the
launcher writes each launch's key with. The tools may list the store; the listing ban
(docs/design.md#exact-name-polling) applies to the collective path only.
"""
