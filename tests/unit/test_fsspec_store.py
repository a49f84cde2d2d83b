"""``storage/engines/fsspec_store.py`` in this process, over fsspec's ``memory://`` filesystem
and small drivers built on it (each standing for a kind of real driver the engine must handle).

The engine's rules: a create never degrades to an overwrite (a driver without a create
mode is refused; a 412 is "exists", and our own earlier create is recognised by its
bytes); reads are ranged and bounded, so an oversized object costs ``max_bytes + 1``
bytes; listing shows objects only; a partly missing batch delete still deletes the rest;
a parent is made for drivers with real directories; the first contact says what to check;
an unknown or missing driver says what to install. The same engine against real servers
is tested in tests/test_stores.py and tests/test_s3_*.py.
"""

from __future__ import annotations

import uuid

import pytest
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.registry import known_implementations
from fsspec.spec import AbstractFileSystem

from ferrosync.errors import ConfigError, ExclusiveCreateUnsupported, ShardCorrupt, StorageError
from ferrosync.storage.engines import open_storage
from ferrosync.storage.engines.fsspec_store import FsspecStorage, build, driver_class


@pytest.fixture
def root():
    root = f"/ferrosync-unit-{uuid.uuid4().hex[:12]}"
    yield root
    fs = MemoryFileSystem()
    for path in [p for p in fs.store if p.startswith(root + "/")]:
        fs.store.pop(path, None)
    fs.pseudo_dirs[:] = [d for d in fs.pseudo_dirs if not d.startswith(root)]


@pytest.fixture
def store(root):
    return open_storage(f"memory://{root}")


def _engine(cls, root, **kwargs) -> FsspecStorage:
    return FsspecStorage(f"{cls.protocol}://{root}", cls(skip_instance_cache=True, **kwargs),
                         root)


# -- creating ----------------------------------------------------------------------------------

def test_memory_is_one_processs_dictionary_polled_at_no_cost(store):
    # its create-if-absent: tests/test_storage.py and tests/test_stores.py
    assert (store.cheap_deletes, store.round_trips_dominate,
            store.shared_between_processes) == (True, False, False)
    assert store.poll_max < FsspecStorage.poll_max


class NoModeMemory(MemoryFileSystem):
    """A driver whose ``pipe_file`` predates fsspec's ``mode`` keyword."""

    protocol = "nomode"

    def pipe_file(self, path, value, **kwargs):
        if "mode" in kwargs:
            raise TypeError("pipe_file() got an unexpected keyword argument 'mode'")
        super().pipe_file(path, value)


def test_a_driver_without_a_create_mode_is_refused_never_overwritten(root):
    st = _engine(NoModeMemory, root)
    st.put("plain", [b"a"])  # a plain write needs no mode: it works
    st.put("claim", [b"first"])
    with pytest.raises(ExclusiveCreateUnsupported, match="NoModeMemory driver's pipe_file "
                                                         "takes no mode") as info:
        st.put("claim", [b"second"], exclusive=True)
    assert info.value.path == f"nomode://{root}/claim"
    assert st.read("claim") == b"first" and st.read("plain") == b"a"


class PreconditionFailed(Exception):
    """An HTTP client's error for a refused conditional write (aiohttp names it ``status``)."""

    status = 412


class ConditionalMemory(MemoryFileSystem):
    """A driver that answers a create on an existing name with an HTTP 412."""

    protocol = "conditional"

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        if mode == "create" and self.exists(path):
            raise PreconditionFailed("412 Precondition Failed")
        super().pipe_file(path, value)


def test_a_412_is_exists_and_our_own_earlier_create_is_recognised(root):
    st = _engine(ConditionalMemory, root)
    st.put("claim", [b"member ", b"a1b2"], exclusive=True)
    # the same create sent again (its reply was lost): the bytes say it is ours
    assert st.put("claim", [b"member a1b2"], exclusive=True) == 11
    with pytest.raises(FileExistsError):
        st.put("claim", [b"member c3d4"], exclusive=True)
    assert st.read("claim") == b"member a1b2"


class DirectoryMemory(MemoryFileSystem):
    """A driver with real directories and no automatic parents (sftp, a local class)."""

    protocol = "dirs"
    made: list[str]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.made = []

    def makedirs(self, path, exist_ok=False):
        self.made.append(path)

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        parent = path.rpartition("/")[0]
        if parent not in self.made:
            raise FileNotFoundError(parent)
        super().pipe_file(path, value, mode=mode)


def test_a_missing_parent_is_made_then_the_write_retried(root):
    st = _engine(DirectoryMemory, root)
    st.put("g1/hb.r0", [b"beat"])
    assert st.fs.made == [f"{root}/g1"] and st.read("g1/hb.r0") == b"beat"


def test_a_parent_that_cannot_be_made_is_a_storage_error_naming_the_path(root, monkeypatch):
    st = _engine(DirectoryMemory, root)
    monkeypatch.setattr(st.fs, "makedirs", lambda path, exist_ok=False: None)  # no effect
    with pytest.raises(StorageError, match="its directory does not exist") as info:
        st.put("g1/hb.r0", [b"beat"])
    assert not isinstance(info.value, FileNotFoundError)  # never "not there yet"
    assert info.value.path == f"dirs://{root}/g1/hb.r0" and "writable location" in str(
        info.value)


def test_a_reused_name_is_deleted_as_the_new_object_is_written(store):
    store.put("spare", [b"old"])
    store.put("new", [b"data"], reuse="spare")
    assert store.read("spare") is None and store.read("new") == b"data"


# -- reading -----------------------------------------------------------------------------------

def test_an_oversized_object_costs_max_bytes_plus_one_and_is_refused(store):
    store.put("planted", [bytes(1 << 20)])
    before = store.counters.snapshot()
    with pytest.raises(ShardCorrupt, match="larger than the 100 bytes") as info:
        store.open("planted", max_bytes=100, rank=3)
    assert info.value.rank == 3 and info.value.path == store.path_of("planted")
    after = store.counters.snapshot()
    assert after["bytes_read"] - before["bytes_read"] == 101  # one ranged GET
    assert after["gets"] - before["gets"] == 1
    assert store.open("planted", max_bytes=1 << 20).size == 1 << 20  # at the bound: fine


def test_read_head_is_one_ranged_read_whatever_the_objects_size(store):
    store.put("claim", [b"member a1b2", bytes(1 << 20)])
    before = store.counters.snapshot()["bytes_read"]
    assert store.read_head("claim", 6) == b"member"
    assert store.counters.snapshot()["bytes_read"] - before == 6
    assert store.read_head("claim", 0) == b""
    assert store.read_head("missing", 6) is None
    assert store.open("missing") is None


# -- listing and deleting -------------------------------------------------------------------------

class DirectoryListing(MemoryFileSystem):
    """A driver that lists directory entries, the searched prefix among them (SeaweedFS's
    emptied "folders", directory markers)."""

    protocol = "listsdirs"

    def find(self, path, detail=False, **kwargs):
        found = dict(super().find(path, detail=True, **kwargs))
        found[path] = {"name": path, "type": "directory", "size": 0}
        found[f"{path}/empty"] = {"name": f"{path}/empty", "type": "directory", "size": 0}
        return found


def test_listing_shows_objects_only_with_their_sizes_relative_to_the_root(root):
    st = _engine(DirectoryListing, root)
    st.put("g1/hb.r0", [b"abc"])
    st.put("g1/c1.r0", [b"abcdef"])
    st.put("rdzv/gen.0", [b"x"])
    assert st.list() == [("g1/c1.r0", 6), ("g1/hb.r0", 3), ("rdzv/gen.0", 1)]
    assert st.list("g1") == [("g1/c1.r0", 6), ("g1/hb.r0", 3)]
    assert st.list("nothing-here") == []
    assert st.counters.snapshot()["lists"] == 3


def test_a_delete_with_a_missing_key_still_deletes_the_others(store):
    for key in ("a", "b", "c"):
        store.put(key, [key.encode()])
    store.delete(["a", "b", "never-written"])
    assert store.list() == [("c", 1)]
    store.delete([])  # nothing to do: no request
    assert store.counters.snapshot()["deletes"] == 1


# -- the first contact ----------------------------------------------------------------------------

class NoCredentialsError(Exception):
    """botocore's name for it (the classification goes by class name)."""


class Bucket(AbstractFileSystem):
    """A remote store's first contact: ``ls`` of the bucket fails with ``error``, if any;
    ``objects`` are the paths that are objects."""

    protocol = "bucket"

    def __init__(self, error=None, objects=(), **kwargs):
        super().__init__(**kwargs)
        self.error, self.objects = error, set(objects)

    def ls(self, path, detail=False, refresh=False, **kwargs):
        if self.error is not None:
            raise self.error
        return []

    def isfile(self, path):
        return path in self.objects


@pytest.mark.parametrize("error, words, hint", [
    (FileNotFoundError("b"), "bucket 'b' does not exist", "create it first"),
    (PermissionError("denied"), "no access to bucket 'b' (denied)", "bucket policy"),
    (NoCredentialsError("Unable to locate credentials"),
     "no usable credentials for the bucket:// store", "check the credentials"),
    (TimeoutError("connect"), "no answer from the bucket:// store within 4 s",
     "reachable from this host"),
    (ConnectionRefusedError(111, "Connection refused"), "cannot reach the bucket:// store",
     "reachable from this host"),
])
def test_a_failed_first_contact_says_what_is_wrong_and_what_to_check(error, words, hint):
    st = FsspecStorage("bucket://b/run", Bucket(error, skip_instance_cache=True), "b/run")
    st.first_contact_timeout = 4
    with pytest.raises(ConfigError) as info:
        st.probe_bucket()
    assert words in str(info.value) and hint in (info.value.hint or "")
    assert info.value.path == "bucket://b/run"


def test_an_unclassified_first_contact_failure_is_a_storage_error_with_its_cause():
    st = FsspecStorage("bucket://b/run", Bucket(RuntimeError("teapot"),
                                                skip_instance_cache=True), "b/run")
    with pytest.raises(StorageError, match=r"contacting the store failed \(RuntimeError: "
                                           r"teapot\)"):
        st.probe_bucket()


def test_a_url_naming_an_object_rather_than_a_prefix_is_refused():
    fs = Bucket(objects={"b/run"}, skip_instance_cache=True)
    with pytest.raises(ConfigError, match="names an existing object, not a prefix") as info:
        FsspecStorage("bucket://b/run", fs, "b/run").probe_bucket()
    assert "bucket://b/run-run/" in info.value.hint
    FsspecStorage("bucket://b/other", fs, "b/other").probe_bucket()  # a prefix: fine


# -- opening a URL ---------------------------------------------------------------------------------

def test_an_unknown_scheme_or_a_missing_driver_says_what_to_install(monkeypatch):
    with pytest.raises(ConfigError, match="unknown URL scheme 'nosuch' in 'nosuch://x'"):
        driver_class("nosuch://x", "nosuch")
    monkeypatch.setitem(known_implementations, "absentfs", {
        "class": "absent_fs_pkg.core.AbsentFileSystem", "err": "pip install absent-fs"})
    with pytest.raises(ConfigError, match="the absentfs:// driver is not installed") as info:
        driver_class("absentfs://b/run", "absentfs")
    assert info.value.hint == "pip install absent-fs-pkg" and info.value.path == "absentfs://b/run"


class Strict(MemoryFileSystem):
    """A driver that takes no option it does not know."""

    protocol = "strict"

    def __init__(self, *, skip_instance_cache=False):
        super().__init__(skip_instance_cache=skip_instance_cache)


def test_options_a_driver_rejects_are_a_config_error_naming_the_driver():
    with pytest.raises(ConfigError, match="storage_options rejected by Strict") as info:
        build("strict://b/run", "strict", Strict, {"anon": True}, None)
    assert "driver's documentation" in info.value.hint
    st = build("strict://b/run", "strict", Strict, {}, 7.0)
    assert (st.root, st.first_contact_timeout) == ("/b/run", 7.0)
