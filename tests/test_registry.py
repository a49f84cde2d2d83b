"""ferrosync/core/registry.py: one registration per backend, and what is built from it.

In-process and quick: no rank process starts and no server either (the contract
cases' object stores are named by their scheme only).
"""

from __future__ import annotations

import os
import sys

import pytest

from conftest import CASES, case_registration
from ferrosync.api import GradSync
from ferrosync.core import registry
from ferrosync.core.options import BackendOptions
from ferrosync.errors import ConfigError

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
    registry.register("carrier-pigeon", backend="ferrosync.storage.sync:StorageSync",
                      options="ferrosync.storage.options:StorageOptions",
                      schemes=("pigeon",))
    assert uncovered(tmp_path) == {"carrier-pigeon"}
    assert registry.backend_for("pigeon://loft").__name__ == "StorageSync"


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


@pytest.mark.parametrize("url, storage", [
    ("/shared/run", True), ("file:///shared/run", True), ("s3://bucket/run", True),
    ("gloo://127.0.0.1:1", False), ("nccl://127.0.0.1:1", False), ("torch://", False)])
@pytest.mark.unit
def test_served_by_storage_is_the_registrations_answer(url, storage):
    assert registry.served_by_storage(url) is storage


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
    from ferrosync.elastic.options import ElasticOptions
    from ferrosync.storage.options import StorageOptions

    assert StorageOptions.shared_names() == ("wire_dtype", "topk_density", "topk_bits",
                                             "bucket_bytes", "reduce",
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


# == backends of other distributions: register_backend and the entry-point group ==========

#: a plugin distribution's module: a backend serving ``pigeon://PATH`` (the storage
#: backend on the directory PATH), registered by a function or declared as a Registration
PLUGIN = '''
from dataclasses import dataclass

import ferrosync
from ferrosync.core.options import boolean, option
from ferrosync.storage.options import StorageOptions
from ferrosync.storage.sync import StorageSync


class PigeonSync(StorageSync):
    @classmethod
    def check_options(cls, options) -> "StorageOptions":
        return StorageOptions.parse(options)

    def __init__(self, url, identity, timeout, options):
        super().__init__(url.removeprefix("pigeon://"), identity, timeout, options)


def register():
    ferrosync.register_backend("pigeon", backend=PigeonSync, options=StorageOptions,
                               schemes=("pigeon",))


DECLARED = ferrosync.Registration("dove", backend="pigeon_plugin:PigeonSync",
                                  options="ferrosync.storage.options:StorageOptions",
                                  schemes=("dove",))


@dataclass(frozen=True)
class PostOptions(StorageOptions):
    pigeon_post: bool = option(False, "send by pigeon", check=boolean)


POST = ferrosync.Registration("post", backend="pigeon_plugin:PigeonSync",
                              options="pigeon_plugin:PostOptions", option="pigeon_post")


def broken():
    raise RuntimeError("no seed")
'''


def install_plugin(tmp_path, monkeypatch, entry_points: str) -> None:
    """An installed-like distribution on ``tmp_path`` (a ``.dist-info`` with its
    ``entry_points.txt``, found by ``importlib.metadata`` on ``sys.path``: no pip), and a
    registry that has not looked at entry points yet and forgets what this test adds."""
    site = tmp_path / "site"
    info = site / "pigeon_plugin-1.0.dist-info"
    info.mkdir(parents=True)
    (site / "pigeon_plugin.py").write_text(PLUGIN)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pigeon-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\n{entry_points}")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))
    monkeypatch.setitem(registry._plugins, "loaded", False)
    monkeypatch.delitem(sys.modules, "pigeon_plugin", raising=False)


@pytest.mark.unit
def test_an_installed_plugin_serves_its_scheme_on_first_use(tmp_path, monkeypatch):
    """The entry point's callable registers the backend the first time a URL needs an
    unknown scheme; connect then builds it like any other (a real average, one rank)."""
    import torch

    import ferrosync

    install_plugin(tmp_path, monkeypatch, "pigeon = pigeon_plugin:register\n")
    assert "pigeon" not in registry.REGISTRY  # nothing loads before a URL needs it
    registry.registration_for("/a/directory")
    assert "pigeon" not in registry.REGISTRY

    sync = ferrosync.connect(f"pigeon://{tmp_path / 'run'}", rank=0, world_size=1,
                             timeout=30, job="pigeon")
    try:
        assert type(sync).__name__ == "PigeonSync"
        t = torch.full((4,), 3.0)
        sync.average_([t])
        assert t.tolist() == [3.0] * 4
    finally:
        sync.close()
    assert registry.REGISTRY["pigeon"].backend == "pigeon_plugin:PigeonSync"
    assert not registry.served_by_storage("pigeon://loft")  # the trainer probes no store
    assert (tmp_path / "run").is_dir()  # the plugin's backend wrote where its URL says


@pytest.mark.unit
def test_a_declared_registration_loads_and_a_broken_plugin_is_named(tmp_path, monkeypatch):
    install_plugin(tmp_path, monkeypatch, "dove = pigeon_plugin:DECLARED\n"
                   "sparrow = pigeon_plugin:broken\n")
    with pytest.warns(UserWarning, match=r"entry point 'sparrow' \(pigeon_plugin:broken\) "
                      r"did not load: RuntimeError: no seed; fix or uninstall"):
        assert registry.registration_for("dove://loft").name == "dove"
    assert registry.backend_for("dove://loft").__name__ == "PigeonSync"
    assert registry.load_entry_points() == []  # once per process


@pytest.mark.unit
def test_a_plugin_that_selects_by_option_loads_on_that_option(tmp_path, monkeypatch):
    install_plugin(tmp_path, monkeypatch, "post = pigeon_plugin:POST\n")
    assert registry.registration_for("/a/directory", {"job": "j"}).name == "storage"
    assert "post" not in registry.REGISTRY  # every option known: no plugin needed
    assert registry.registration_for("/a/directory", {"pigeon_post": True}).name == "post"
    assert registry.registration_for("/a/directory", {"pigeon_post": False}).name == "storage"


@pytest.mark.unit
def test_register_backend_takes_classes_or_strings_and_tolerates_a_repeat(monkeypatch):
    import ferrosync
    from ferrosync.storage.options import StorageOptions
    from ferrosync.storage.sync import StorageSync

    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))
    entry = ferrosync.register_backend("kite", backend=StorageSync, options=StorageOptions,
                                       schemes=("kite",))
    assert entry == registry.Registration(
        "kite", backend="ferrosync.storage.sync:StorageSync",
        options="ferrosync.storage.options:StorageOptions", schemes=("kite",))
    assert ferrosync.register_backend("kite", backend="ferrosync.storage.sync:StorageSync",
                                      options=StorageOptions, schemes=("kite",)) == entry
    assert registry.backend_for("kite://x") is StorageSync
    with pytest.raises(ValueError, match="already registered"):
        ferrosync.register_backend("kite", backend=StorageSync, options=StorageOptions,
                                   schemes=("kestrel",))


@pytest.mark.unit
def test_an_option_is_declared_once_and_a_backend_may_only_change_its_default():
    """Backends that take an option share its one declaration (check, description, shared
    or not); ``defaults`` changes nothing but the default, and names only inherited ones."""
    import dataclasses

    from ferrosync.core.options import BackendOptions, BucketOptions
    from ferrosync.elastic.options import ElasticOptions
    from ferrosync.storage.options import StorageOptions
    from ferrosync.torchdist.options import TorchOptions

    def meta(cls, name):
        return {f.name: f for f in dataclasses.fields(cls)}[name].metadata

    assert TorchOptions.parse({}).bucket_bytes == 25 << 20
    assert StorageOptions.parse({}).bucket_bytes is None
    assert meta(TorchOptions, "bucket_bytes") == meta(StorageOptions, "bucket_bytes")
    assert StorageOptions.parse({}).heartbeat_timeout == 20.0
    assert ElasticOptions.parse({}).heartbeat_timeout is None
    assert meta(StorageOptions, "heartbeat_timeout") == meta(ElasticOptions, "heartbeat_timeout")
    for name in ("wire_dtype", "topk_density", "topk_bits", "error_feedback"):
        assert meta(TorchOptions, name) is meta(StorageOptions, name) is meta(ElasticOptions,
                                                                              name)
    with pytest.raises(TypeError, match="Wrong.defaults names 'reduce', an option it does "
                       "not inherit"):
        @dataclasses.dataclass(frozen=True)
        class Wrong(BackendOptions, BucketOptions):
            defaults = {"reduce": "root"}
