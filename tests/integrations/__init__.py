"""Tests with the real PyTorch Lightning and HF Accelerate (the integrations extra).

A package, so its conftest is ``integrations.conftest`` and never shadows the
suite's top-level ``conftest`` module that other tests import from.
"""
