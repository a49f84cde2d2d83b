"""ferrosync/core/registry.py: one registration per backend, and what is built from it.

In-process and quick: no rank process starts and no server either (the contract
cases' object stores are named by their scheme only).
"""

from __future__ import annotations

import os

import pytest

from conftest import CASES, case_registration
from ferrosync.api import GradSync
from ferrosync.core import registry
from ferrosync.errors import ConfigError
from ferrosync.storage.options import BackendOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: registered backends the contract matrix cannot run, each with why and where its own
#: tests are (none: the elastic backend runs it at fixed membership, its members joining
#: in worker order so that the roster's ranks are the workers')
OUTSIDE_THE_MATRIX: dict[str, str] = {}


def uncovered(tmp_path) -> set[str]:
    """Registered backends that no contract case exercises (less the exemptions)."""
    covered = {case_registration(backend, tmp_path) for backend, _ in CASES}
    return set(registry.REGISTRY) - covered - set(OUTSIDE_THE_MATRIX)


@pytest.mark.unit
def test_every_registered_backend_is_in_the_contract_matrix(tmp_path):
    """A new registration without a contract case (tests/conftest.py CASES) fails here."""
    assert uncovered(tmp_path) == set()
    for name, home in OUTSIDE_THE_MATRIX.items():
        assert name in registry.REGISTRY, f"exemption {name!r} is not a registered backend"
        assert os.path.exists(os.path.join(ROOT, home)), home


@pytest.mark.unit
def test_a_registration_without_a_contract_case_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))
    registry.register("carrier-pigeon", backend="ferrosync.storage.sync:FileSync",
                      options="ferrosync.storage.options:StorageOptions",
                      schemes=("pigeon",))
    assert uncovered(tmp_path) == {"carrier-pigeon"}
    assert registry.backend_for("pigeon://loft").__name__ == "FileSync"


@pytest.mark.unit
def test_each_registration_names_a_backend_and_its_options_class():
    for entry in registry.REGISTRY.values():
        backend, options = entry.load_backend(), entry.load_options()
        assert issubclass(backend, GradSync) and backend is not GradSync, entry
        assert issubclass(options, BackendOptions), entry
        # the class's own check_options returns the registered options class
        assert backend.check_options.__annotations__["return"] == options.__name__, entry


@pytest.mark.parametrize("url, options, name", [
    ("/shared/run", {}, "storage"),
    ("s3://bucket/run", {}, "storage"),
    ("file:///shared/run", {}, "storage"),
    ("gloo://127.0.0.1:1", {}, "torch"),
    ("nccl://127.0.0.1:1", {}, "torch"),
    ("torch://", {}, "torch"),
    ("/shared/run", {"local": "gloo"}, "hierarchical"),
    ("/shared/run", {"local": None}, "storage"),
    ("/shared/run", {"elastic": True}, "elastic"),
    ("s3://bucket/run", {"elastic": True, "min_ranks": 2}, "elastic"),
    ("/shared/run", {"elastic": False}, "storage"),
])
@pytest.mark.unit
def test_connect_chooses_by_scheme_then_option(url, options, name):
    assert registry.registration_for(url, options).name == name


@pytest.mark.unit
def test_elastic_runs_on_storage_urls_only():
    assert registry.backend_for("/shared/run", {"elastic": True}).__name__ == "ElasticSync"
    for url, options in [("gloo://127.0.0.1:1", {}), ("/shared/run", {"local": "gloo"})]:
        with pytest.raises(ConfigError, match="elastic=True .*needs a storage URL"):
            registry.registration_for(url, {**options, "elastic": True})


@pytest.mark.unit
def test_an_option_left_off_selects_nothing_and_is_dropped():
    assert registry.selected_options({"local": None, "elastic": False, "job": "x"}) == {
        "job": "x"}
    assert registry.selected_options({"elastic": True}) == {"elastic": True}


@pytest.mark.unit
def test_an_option_of_another_backend_says_which_backend_takes_it():
    from ferrosync.storage.options import StorageOptions

    with pytest.raises(ConfigError, match=r"min_ranks apply to an elastic job only "
                                          r"\(elastic=\.\.\.\)"):
        StorageOptions.parse({"min_ranks": 2})


@pytest.mark.unit
def test_shared_settings_come_from_the_options_class():
    """One home for "what every rank must pass alike": the fields marked shared, for
    the rendezvous of the storage backend and an elastic job's record alike."""
    from ferrosync.storage.options import ElasticOptions, StorageOptions

    assert StorageOptions.shared_names() == ("reduce", "wire_dtype", "topk_density",
                                             "topk_bits", "bucket_bytes",
                                             "sharded_min_bytes", "gather_max_ranks")
    assert ElasticOptions.shared_names() == ("wire_dtype", "topk_density", "topk_bits",
                                             "fan_in")
    topk = {"topk_density": 1 / 64, "topk_bits": 2}
    assert ElasticOptions.shared_defaults() == {"wire_dtype": None, **topk, "fan_in": 8}
    assert ElasticOptions.parse({"elastic": True, "fan_in": 3}).shared_settings() == {
        "wire_dtype": None, **topk, "fan_in": 3}


@pytest.mark.parametrize("kwargs, message", [
    ({"name": "storage"}, "already registered"),
    ({"name": "x", "schemes": ("gloo",)}, "already serve backend 'torch'"),
    ({"name": "x", "option": "local"}, "already selects backend 'hierarchical'"),
    ({"name": "x", "option": "elastic"}, "already selects backend 'elastic'"),
    ({"name": "x"}, "already serves storage URLs"),
    ({"name": "x", "schemes": ("a",), "option": "b"}, "not both"),
])
def test_one_answer_per_url(kwargs, message, monkeypatch):
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))
    with pytest.raises(ValueError, match=message):
        registry.register(backend="m:C", options="m:O", **kwargs)


@pytest.mark.unit
def test_option_tables_are_the_registrations():
    assert list(registry.option_tables()) == list(registry.REGISTRY)
    # the document tools/docs/options_table.py writes the tables into
    with open(os.path.join(ROOT, "docs", "reference.md")) as f:
        reference = f.read()
    for name in registry.REGISTRY:
        assert f"<!-- options:{name} -->" in reference, name
