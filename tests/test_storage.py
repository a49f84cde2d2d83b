"""The storage layer: atomic publish, exact-name reads, errors that are not "not yet"."""

from __future__ import annotations

import os
import signal
import stat
import time
import uuid

import pytest

from ferrosync.errors import ConfigError, StorageError
from ferrosync.storage.engines import LocalStorage, open_storage
from ranks import start_ranks


@pytest.mark.unit
def test_put_open_delete_roundtrip(tmp_path):
    st = LocalStorage(str(tmp_path))
    st.makedirs("d")
    assert st.open("d/x") is None  # not there yet: None, not an error
    n = st.put("d/x", [b"hello ", memoryview(b"world")])
    assert n == 11
    with st.open("d/x") as reader:
        buf = bytearray(reader.size)
        assert reader.readinto(buf) == 11
    assert bytes(buf) == b"hello world"
    st.delete(["d/x", "d/missing"])  # a missing key is fine
    assert st.open("d/x") is None
    assert st.counters.snapshot()["requests"] >= 4


@pytest.mark.unit
def test_files_are_not_world_accessible(tmp_path):
    st = LocalStorage(str(tmp_path / "run"))
    st.makedirs("g")
    st.put("g/x", [b"data"])
    mode = stat.S_IMODE(os.stat(tmp_path / "run" / "g" / "x").st_mode)
    assert mode & 0o007 == 0
    assert stat.S_IMODE(os.stat(tmp_path / "run" / "g").st_mode) & 0o007 == 0


@pytest.mark.unit
def test_exclusive_put_refuses_an_existing_name(tmp_path):
    st = LocalStorage(str(tmp_path))
    st.put("once", [b"a"], exclusive=True)
    with pytest.raises(FileExistsError):
        st.put("once", [b"b"], exclusive=True)
    assert st.read("once") == b"a"
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


@pytest.mark.unit
@pytest.mark.unit
@pytest.mark.parametrize("url", ["dir", "memory://"])
def test_a_create_finding_its_own_bytes_is_ours(tmp_path, url):
    """Storage.exclusive_create, on every engine: an "exists" answer over exactly our bytes is our
    own create that landed before (a lost reply, sent again); anything else is not."""
    st = open_storage(str(tmp_path) if url == "dir" else f"memory://own-{uuid.uuid4().hex}")
    st.put("claim", [b"member ", memoryview(b"a1b2")], exclusive=True)
    assert st.put("claim", [b"member a1b2"], exclusive=True) == 11  # ours, in other parts
    for other in ([b"member c3d4"], [b"member a1b"], [b"member a1b2", b"!"], [b""]):
        with pytest.raises(FileExistsError):
            st.put("claim", other, exclusive=True)
    assert st.read("claim") == b"member a1b2"
    assert st.read_head("claim", 6) == b"member" and st.read_head("claim", 99) == b"member a1b2"
    assert st.read_head("none", 6) is None
    if url == "dir":
        assert sorted(os.listdir(tmp_path)) == ["claim"]  # no temporary file left


def test_errors_other_than_not_found_propagate(tmp_path):
    st = LocalStorage(str(tmp_path))
    os.mkdir(tmp_path / "adir")
    with pytest.raises(StorageError) as info:
        st.open("adir")  # exists but is no object: an error, never "not yet"
    assert str(tmp_path / "adir") in str(info.value)


@pytest.mark.unit
def test_writing_into_a_missing_directory_names_the_path(tmp_path):
    st = LocalStorage(str(tmp_path))
    with pytest.raises(StorageError) as info:
        st.put("no/such/dir/x", [b"a"])
    assert not isinstance(info.value, FileNotFoundError)  # never "not there yet"
    assert str(tmp_path / "no" / "such" / "dir" / "x") in str(info.value)
    assert "was the run directory deleted? restart the job" in str(info.value)


@pytest.mark.unit
def test_a_deleted_run_directory_is_named_when_publishing(tmp_path):
    root = tmp_path / "run"
    st = LocalStorage(str(root))
    st.makedirs("g1.0123456789abcdef")
    st.put("g1.0123456789abcdef/hb.r0", [b"beat"])
    for name in os.listdir(root / "g1.0123456789abcdef"):  # rm -rf by hand, mid-run
        os.unlink(root / "g1.0123456789abcdef" / name)
    os.rmdir(root / "g1.0123456789abcdef")
    os.rmdir(root)
    with pytest.raises(StorageError) as info:
        st.put("g1.0123456789abcdef/hb.r0", [b"beat"])
    assert "the run directory does not exist" in str(info.value)
    assert str(root / "g1.0123456789abcdef" / "hb.r0") in str(info.value)
    assert "restart the job" in str(info.value)
    assert st.open("g1.0123456789abcdef/hb.r0") is None  # readers: simply not there
    # made again by hand: the store finds the new directory by name
    os.makedirs(root / "g1.0123456789abcdef")
    st.put("g1.0123456789abcdef/hb.r0", [b"again"])
    assert st.read("g1.0123456789abcdef/hb.r0") == b"again"


def w_blocked_writer(rank, world, root, ready):
    # fault injection in this process only: stop between writing and publishing
    import threading

    def stall(src, dst, **dir_fds):
        open(ready, "w").close()
        threading.Event().wait()

    os.replace = stall
    LocalStorage(root).put("shard", [b"x" * (1 << 20)])


def test_killed_writer_never_exposes_a_partial_object(tmp_path):
    root, ready = str(tmp_path / "run"), str(tmp_path / "ready")
    os.makedirs(root)
    procs, _ = start_ranks(w_blocked_writer, 1, root, ready)
    deadline = time.monotonic() + 30
    while not os.path.exists(ready):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # the bytes are fully written, under a temporary name in the same directory
    temps = [n for n in os.listdir(root) if n.endswith(".tmp")]
    assert len(temps) == 1 and temps[0].startswith(".shard.")
    os.kill(procs[0].pid, signal.SIGKILL)
    procs[0].join(10)
    st = LocalStorage(root)
    assert st.open("shard") is None  # readers never see it
    assert os.path.getsize(os.path.join(root, temps[0])) == 1 << 20  # orphan left for `gc`


@pytest.mark.unit
def test_memory_and_bad_urls():
    st = open_storage("memory://ferrosync-test-storage")
    st.put("a/b", [b"xyz"])
    assert st.read("a/b") == b"xyz"
    assert st.read("a/c") is None
    assert [k for k, _ in st.list("a")] == ["a/b"]
    with pytest.raises(ConfigError):
        open_storage("/tmp/x", {"anon": True})
    with pytest.raises(ConfigError, match="unknown URL scheme"):
        open_storage("bogus://x")


def test_s3_roundtrip_and_single_request_reads(s3_transport):
    st = open_storage(s3_transport.url, s3_transport.options["storage_options"])
    assert st.open("k") is None
    st.put("k", [b"abc", b"def"])
    before = st.counters.snapshot()["requests"]
    assert st.read("k") == b"abcdef"
    assert st.counters.snapshot()["requests"] - before == 1  # one GET, no HEAD first
    with pytest.raises(FileExistsError):
        st.put("k", [b"again"], exclusive=True)
    st.delete(["k"])
    assert st.open("k") is None


# -- error classification and the mount table ------------------------------------------------

@pytest.mark.unit
def test_transient_errors_are_told_by_type_code_and_status_not_by_text():
    import errno

    from ferrosync.storage.engines.classify import is_transient, storage_error

    botocore = pytest.importorskip("botocore.exceptions")

    def client_error(code: str, status: int):
        return botocore.ClientError(
            {"Error": {"Code": code, "Message": "m"},
             "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    assert is_transient(client_error("SlowDown", 503))
    assert is_transient(client_error("Whatever", 500))  # by status
    assert not is_transient(client_error("NoSuchBucket", 404))
    # s3fs raises an OSError caused by the ClientError: the cause decides
    translated = OSError(errno.EREMOTEIO, "We encountered an internal error")
    translated.__cause__ = client_error("InternalError", 500)
    assert is_transient(translated)
    assert is_transient(botocore.EndpointConnectionError(endpoint_url="http://nowhere"))
    assert is_transient(OSError(errno.ESTALE, "stale"))
    # words and numbers in a message (a bucket called "svc-503") decide nothing
    assert not is_transient(ValueError("bucket svc-503 SlowDown 500 ReadTimeout"))

    class HttpError(Exception):  # gcsfs-style: the status as an attribute
        def __init__(self, code: int) -> None:
            super().__init__(f"HTTP {code}")
            self.code = code

    assert is_transient(HttpError(503)) and not is_transient(HttpError(404))
    denied = storage_error("reading", "s3://b/k", client_error("AccessDenied", 403), False)
    assert "access denied" in str(denied)
    assert "access denied" not in str(
        storage_error("reading", "s3://b/k", ValueError("AccessDenied"), False))


@pytest.mark.unit
@pytest.mark.unit
def test_a_body_cut_short_is_transient_for_every_client():
    import errno
    import http.client

    from ferrosync.storage.engines.classify import cut_short, is_transient

    aiohttp = pytest.importorskip("aiohttp")
    botocore = pytest.importorskip("botocore.exceptions")
    azure = pytest.importorskip("azure.core.exceptions")
    cut = [aiohttp.ClientPayloadError("Response payload is not completed"),
           botocore.IncompleteReadError(actual_bytes=3, expected_bytes=9),
           azure.IncompleteReadError("incomplete"), http.client.IncompleteRead(b"abc", 6)]
    for exc in cut:
        assert cut_short(exc) and is_transient(exc), exc
    # behind a driver's translation (an OSError raised from it): the cause decides
    translated = OSError(errno.EREMOTEIO, "read failed")
    translated.__cause__ = cut[0]
    assert cut_short(translated) and is_transient(translated)
    # a whole request that failed is transient, but no body was cut short
    for exc in (aiohttp.ServerDisconnectedError(), ConnectionResetError(),
                botocore.ConnectionClosedError(endpoint_url="http://127.0.0.1:9"),
                azure.ServiceResponseError("reset")):
        assert is_transient(exc) and not cut_short(exc), exc
    assert not cut_short(ValueError("Response payload is not completed"))


def test_mountinfo_lines_are_parsed_with_superblock_options_and_escapes():
    from ferrosync.storage.engines.mounts import _mountinfo_entry

    nfs = ("36 25 0:31 / /mnt/my\\040runs rw,relatime shared:1 - nfs4 server:/export "
           "rw,vers=4.2,hard,lookupcache=pos,nocto")
    assert _mountinfo_entry(nfs) == {
        "source": "server:/export", "mountpoint": "/mnt/my runs", "fstype": "nfs4",
        "options": ["rw", "relatime", "vers=4.2", "hard", "lookupcache=pos", "nocto"]}
    assert _mountinfo_entry("garbage") is None


@pytest.mark.unit
def test_mount_of_finds_the_longest_mount_point_of_a_path_not_made_yet(tmp_path):
    from ferrosync.storage.engines import is_local_filesystem, mount_of

    mount = mount_of(str(tmp_path / "not" / "made" / "yet"))
    if mount is None:
        pytest.skip("no /proc/self/mountinfo here")
    assert str(tmp_path).startswith(mount["mountpoint"].rstrip("/") + "/") or \
        mount["mountpoint"] == "/"
    assert is_local_filesystem(str(tmp_path)) == (mount["fstype"] in (
        "tmpfs", "ramfs", "ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "overlay",
        "jfs", "reiserfs", "bcachefs"))


@pytest.mark.unit
def test_probe_location_names_rank_and_url(tmp_path):
    from ferrosync.storage.engines import probe_location

    probe_location(LocalStorage(str(tmp_path / "fine")), 3)
    assert os.listdir(tmp_path / "fine") == []  # the probe object is gone again
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a directory belongs")
    with pytest.raises(ConfigError, match="cannot use this location") as info:
        probe_location(LocalStorage(str(blocker)), 3)
    assert info.value.rank == 3 and info.value.path == str(blocker)
    with pytest.raises(ConfigError, match="cannot use sync URL") as info:
        probe_location(LocalStorage(str(blocker)), None, what="sync URL")
    assert info.value.rank is None

    class Forgetful(LocalStorage):
        def read(self, key):
            return b"something else"

    with pytest.raises(ConfigError, match="read-after-write returned different bytes"):
        probe_location(Forgetful(str(tmp_path / "forgetful")), 0)


@pytest.mark.unit
def test_open_storage_picks_the_engine_by_scheme(tmp_path):
    """``open_storage``'s scheme table: a directory, S3 (its own engine, one retry layer
    for whole requests: botocore's), any other fsspec driver; a bad URL is a
    ``ConfigError``. No I/O."""
    pytest.importorskip("s3fs")
    from ferrosync.storage.engines import FsspecStorage
    from ferrosync.storage.engines.s3 import S3Storage

    for url in (str(tmp_path / "a"), f"file://{tmp_path}/b"):
        assert type(open_storage(url)) is LocalStorage, url
    s3 = open_storage("s3://bucket/run", {"endpoint_url": "http://127.0.0.1:9"}, timeout=4)
    assert type(s3) is S3Storage and s3._conditional_put
    assert s3.fs.retries == 1 and s3.first_contact_timeout == 4 and s3.retry_s == 4
    # botocore retries whole requests; ferrosync only what it cannot: a body cut short
    from aiohttp import ClientPayloadError
    from botocore.exceptions import ConnectionClosedError

    assert not s3._retryable(ConnectionClosedError(endpoint_url="http://127.0.0.1:9"))
    assert s3._retryable(ClientPayloadError("Response payload is not completed"))
    assert s3.endpoint == "http://127.0.0.1:9 (from endpoint_url)"
    memory = open_storage("memory://run")
    assert type(memory) is FsspecStorage and not memory._conditional_put
    assert memory.retries == FsspecStorage.retries
    with pytest.raises(ConfigError, match="unknown URL scheme"):
        open_storage("nosuchscheme://x")
    with pytest.raises(ConfigError, match="do not apply to a local path"):
        open_storage(str(tmp_path), {"anon": True})
