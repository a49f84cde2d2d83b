"""The shared directory is untrusted input: links and special files planted in it.

Anyone who can write to a job's directory can put a symbolic link, a hard link, a
FIFO, a socket or a directory at a name a rank is about to open. Whatever is
planted, ferrosync must answer with a typed error (or carry on correctly) within
its timeouts, and never read, write, truncate or delete anything outside the run
directory. Everything here is real: files, links, FIFOs (``os.mkfifo``), sockets and,
end to end, rank processes (``tests/ranks.py``).

Synchronisation with the ranks uses files the test writes or waits for, each wait
bounded; a call that could block forever on a FIFO runs in a thread with a bound.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import sys
import threading
import time

import pytest
import torch
from train_cli import run_forked

import ferrosync
from ferrosync.errors import ConfigError, FerrosyncError, StorageError
from ferrosync.storage.engines import LocalStorage, object_exists
from ferrosync.storage.engines.local_tools import LocalTree
from ranks import RankFailure, collect, run_ranks, start_ranks, wait_until

FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0}
GEN = "g3.0123456789abcdef"  # a generation directory name, as the library makes them
BOUND = 10.0  # seconds: a refusal is immediate; this only keeps a regression from hanging
SECRET_BYTES = b"precious bytes that live outside the run directory\n" * 100


# -- helpers -------------------------------------------------------------------------------



def bounded(fn, timeout: float = BOUND):
    """``fn()`` in a thread: its value, or the exception it raised; fails the test if
    it is still running after ``timeout`` (blocked in open() on a FIFO, say)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn} still blocked after {timeout} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def release_fifo(path: str) -> None:
    """Unblock a reader stuck in open() on the FIFO ``path`` (a regression's cleanup)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def outside_file(tmp_path) -> str:
    """A file outside the run directory that nothing may ever change."""
    os.makedirs(tmp_path / "outside", exist_ok=True)
    path = str(tmp_path / "outside" / "victim")
    with open(path, "wb") as f:
        f.write(SECRET_BYTES)
    return path


def content(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def snapshot(directory: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, names in os.walk(directory):
        for name in names:
            full = os.path.join(dirpath, name)
            out[os.path.relpath(full, directory)] = content(full)
    return out


def plant(kind: str, path: str, target: str | None = None):
    """Put a ``kind`` at ``path``; returns what must be closed afterwards, if anything."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        os.symlink(target, path)
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path)
        return sock
    else:
        raise AssertionError(kind)
    return None


def assert_refused(exc: BaseException, path: str, what: str) -> None:
    assert isinstance(exc, StorageError), repr(exc)
    assert not isinstance(exc, (FileNotFoundError, FileExistsError)), repr(exc)
    assert path in str(exc) and what in str(exc), str(exc)
    assert exc.hint and "remove it" in exc.hint, exc.hint


def gen_dirs(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("g") and "." in n)


@pytest.fixture
def store(tmp_path):
    st = LocalStorage(str(tmp_path / "run"), recycle=True)
    st.makedirs(GEN)
    return st


# -- names inside the run directory ------------------------------------------------------------

KINDS = [("fifo", "a FIFO"), ("socket", "a socket"), ("directory", "a directory"),
         ("symlink", "a symbolic link")]


@pytest.mark.parametrize("kind, what", KINDS, ids=[k for k, _ in KINDS])
@pytest.mark.unit
def test_reading_a_planted_name_is_refused_at_once(tmp_path, store, kind, what):
    path = os.path.join(store.root, GEN, "abort.r1")
    victim = outside_file(tmp_path)
    keep = plant(kind, path, victim)
    try:
        for call in (lambda: store.open(f"{GEN}/abort.r1"),
                     lambda: store.read(f"{GEN}/abort.r1"),
                     lambda: object_exists(store, f"{GEN}/abort.r1")):
            with pytest.raises(StorageError) as info:
                bounded(call)
            assert_refused(info.value, path, what)
    finally:
        release_fifo(path)
        if keep is not None:
            keep.close()
    assert content(victim) == SECRET_BYTES


@pytest.mark.parametrize("kind, what", KINDS, ids=[k for k, _ in KINDS])
@pytest.mark.unit
def test_an_exclusive_create_on_a_planted_name_is_refused(tmp_path, store, kind, what):
    """Not FileExistsError ("someone announced first"): the name holds no object."""
    path = os.path.join(store.root, GEN, "abort.r0")
    victim = outside_file(tmp_path)
    keep = plant(kind, path, victim)
    try:
        with pytest.raises(StorageError) as info:
            bounded(lambda: store.put(f"{GEN}/abort.r0", [b"record"], exclusive=True))
        assert_refused(info.value, path, what)
    finally:
        if keep is not None:
            keep.close()
    assert content(victim) == SECRET_BYTES
    assert not [n for n in os.listdir(os.path.dirname(path)) if n.endswith(".tmp")]


@pytest.mark.parametrize("kind", ["fifo", "socket", "symlink"])
@pytest.mark.unit
def test_publishing_replaces_a_planted_name_never_its_target(tmp_path, store, kind):
    """rename() replaces the link (or FIFO, or socket) itself: the object is published
    and whatever the link pointed to is untouched."""
    path = os.path.join(store.root, GEN, "hb.r1")
    victim = outside_file(tmp_path)
    keep = plant(kind, path, victim)
    try:
        bounded(lambda: store.put(f"{GEN}/hb.r1", [b"beat 2"]))
    finally:
        if keep is not None:
            keep.close()
    assert stat.S_ISREG(os.lstat(path).st_mode)
    assert store.read(f"{GEN}/hb.r1") == b"beat 2"
    assert content(victim) == SECRET_BYTES


@pytest.mark.unit
def test_publishing_onto_a_planted_directory_is_refused(store):
    path = os.path.join(store.root, GEN, "c1.out")
    os.mkdir(path)
    with pytest.raises(StorageError) as info:
        store.put(f"{GEN}/c1.out", [b"result"])
    assert_refused(info.value, path, "a directory")
    assert not [n for n in os.listdir(os.path.dirname(path)) if n.endswith(".tmp")]


@pytest.mark.unit
def test_a_link_at_a_data_object_name_is_never_read_or_deleted_through(tmp_path, store):
    path = os.path.join(store.root, GEN, "c1.r1")
    victim = outside_file(tmp_path)
    os.symlink(victim, path)
    with pytest.raises(StorageError) as info:
        store.open(f"{GEN}/c1.r1")
    assert_refused(info.value, path, "a symbolic link")
    assert store.park(f"{GEN}/c1.r1") is not None  # moves the link itself, nothing else
    assert store.list(GEN) == []  # a link is no object
    store.delete([f"{GEN}/c1.r1"])
    for spare in os.listdir(os.path.dirname(path)):
        store.delete([f"{GEN}/{spare}"])  # unlink() removes a link, never its target
    assert os.listdir(os.path.dirname(path)) == []
    assert content(victim) == SECRET_BYTES


# -- parked spares ---------------------------------------------------------------------------

def _park_one(store, size: int = 1 << 20) -> tuple[str, str]:
    store.put(f"{GEN}/c1.r1", [bytes(size)])
    spare = store.park(f"{GEN}/c1.r1")
    assert spare is not None and os.path.basename(spare).startswith(".spare.")
    return spare, os.path.join(store.root, spare)


@pytest.mark.unit
def test_a_genuine_spare_is_still_recycled(store):
    """The checks must not switch recycling off: a spare of ours is rewritten in place."""
    spare, path = _park_one(store)
    data = os.urandom(300 << 10)
    with open(path, "rb") as held:  # the spare's inode, whatever its name becomes
        store.put(f"{GEN}/c2.r1", [data], reuse=spare)
        assert held.read() == data  # rewritten in place (a fresh file would leave zeros)
    published = os.path.join(store.root, GEN, "c2.r1")
    assert os.path.getsize(published) == len(data)  # cut to size
    assert store.read(f"{GEN}/c2.r1") == data
    assert not os.path.lexists(path)


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo", "foreign-owner"])
@pytest.mark.unit
def test_a_planted_spare_is_never_written_through(tmp_path, store, kind):
    spare, path = _park_one(store)
    victim = outside_file(tmp_path)
    before = os.stat(victim)
    swap = path + ".planting"
    if kind == "symlink":
        os.symlink(victim, swap)
    elif kind == "hardlink":
        os.link(victim, swap)  # same filesystem: a second name for the victim's inode
    elif kind == "fifo":
        os.mkfifo(swap)
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a file to another uid needs root")
        with open(swap, "wb") as f:
            f.write(b"someone else's")
        os.chown(swap, 4242, 4242)
    os.replace(swap, path)  # atomically, as an attacker racing the job would
    data = os.urandom(400 << 10)
    bounded(lambda: store.put(f"{GEN}/c2.r1", [data], reuse=spare))
    # a fresh file of ours (inode numbers are reused at once: not a usable check)
    info = os.lstat(os.path.join(store.root, GEN, "c2.r1"))
    assert stat.S_ISREG(info.st_mode) and info.st_nlink == 1
    assert info.st_uid == os.geteuid() and info.st_size == len(data)
    assert store.read(f"{GEN}/c2.r1") == data
    assert content(victim) == SECRET_BYTES
    after = os.stat(victim)
    assert (after.st_size, after.st_mtime_ns, after.st_nlink) == (
        before.st_size, before.st_mtime_ns, before.st_nlink)
    # what was planted under the spare's name is gone from the directory, not reused
    left = sorted(os.listdir(os.path.join(store.root, GEN)))
    assert left == ["c2.r1"], left


# -- directories -------------------------------------------------------------------------------

@pytest.mark.unit
def test_a_symlinked_directory_inside_the_run_directory_is_refused(tmp_path):
    root = tmp_path / "run"
    st = LocalStorage(str(root), recycle=True)
    st.makedirs("")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "c1.r1").write_bytes(SECRET_BYTES)
    os.symlink(elsewhere, root / GEN)
    os.symlink(elsewhere, root / "rdzv")
    before = snapshot(str(elsewhere))
    calls = {
        "put": lambda: st.put(f"{GEN}/c1.out", [b"x"]),
        "exclusive put": lambda: st.put(f"{GEN}/abort.r0", [b"x"], exclusive=True),
        "open": lambda: st.open(f"{GEN}/c1.r1"),
        "read": lambda: st.read("rdzv/gen.0"),
        "delete": lambda: st.delete([f"{GEN}/c1.r1"]),
        "park": lambda: st.park(f"{GEN}/c1.r1"),
        "makedirs": lambda: st.makedirs("rdzv"),
        "list": lambda: st.list(GEN),
    }
    for name, call in calls.items():
        with pytest.raises(StorageError) as info:
            call()
        assert "a symbolic link" in str(info.value) and "a directory" in str(info.value), name
        assert str(root) in str(info.value), name
    assert snapshot(str(elsewhere)) == before
    assert sorted(os.listdir(elsewhere)) == ["c1.r1"]
    # a listing of the root shows the links as links and never enters them
    assert st.list("") == []
    assert LocalTree(st).irregular("") == [(GEN, "a symbolic link"), ("rdzv", "a symbolic link")]


@pytest.mark.unit
def test_links_on_the_way_to_the_run_directory_are_the_users_business(tmp_path):
    """/scratch -> /lustre/...: a link to (or above) the root is followed."""
    (tmp_path / "real" / "runs").mkdir(parents=True)
    os.symlink(tmp_path / "real", tmp_path / "scratch")
    os.symlink(tmp_path / "scratch" / "runs", tmp_path / "runs-link")
    for url in (tmp_path / "scratch" / "runs" / "exp", tmp_path / "runs-link"):
        st = LocalStorage(str(url))
        st.makedirs(GEN)
        st.put(f"{GEN}/c1.r1", [b"data"])
        assert st.read(f"{GEN}/c1.r1") == b"data"
        assert st.list("") == [(f"{GEN}/c1.r1", 4)]
        st.delete([f"{GEN}/c1.r1"])
        assert st.open(f"{GEN}/c1.r1") is None


@pytest.mark.unit
def test_a_run_directory_replaced_by_a_file_is_named(tmp_path):
    path = tmp_path / "run"
    path.write_bytes(b"not a directory")
    st = LocalStorage(str(path))
    with pytest.raises(StorageError) as info:
        st.makedirs("rdzv")
    assert str(path) in str(info.value) and "not a directory" in str(info.value)


# -- other places that open files in the run or checkpoint directory ---------------------------

@pytest.mark.unit
def test_checkpoints_never_follow_links(tmp_path):
    from ferrosync.train.checkpoint import Checkpoints

    directory = tmp_path / "ckpt"
    directory.mkdir()
    victim = outside_file(tmp_path)
    os.symlink(victim, directory / "latest.json")
    os.symlink(victim, directory / "step-00000001.pt")
    os.mkfifo(directory / "step-00000002.pt")
    ckpt = Checkpoints(str(directory))
    with pytest.raises(ConfigError) as info:
        bounded(ckpt.latest)
    assert "symbolic link" in str(info.value) and "latest.json" in str(info.value)
    with pytest.raises(StorageError) as info:
        bounded(lambda: ckpt.load({"step": 2, "file": "step-00000002.pt"}))
    assert_refused(info.value, str(directory / "step-00000002.pt"), "a FIFO")
    # saving replaces the links themselves; pruning never deletes (through) a link
    ckpt.save({"w": torch.ones(3)}, {"step": 5}, keep=1)
    assert ckpt.latest()["file"] == "step-00000005.pt"
    assert torch.equal(ckpt.load(ckpt.latest())["w"], torch.ones(3))
    assert os.path.islink(directory / "step-00000001.pt")
    assert content(victim) == SECRET_BYTES


@pytest.mark.unit
def test_the_gc_lock_is_never_opened_through_a_link(tmp_path, capsys):
    """filelock would open it O_TRUNC, emptying the link's target."""
    from ferrosync.__main__ import main

    root = tmp_path / "run"
    root.mkdir()
    victim = outside_file(tmp_path)
    os.symlink(victim, root / ".ferrosync-gc.lock")
    assert main(["gc", str(root), "--watch", "0"]) == 1
    err = capsys.readouterr().err
    assert "a symbolic link" in err and ".ferrosync-gc.lock" in err
    assert content(victim) == SECRET_BYTES


DEEP = 1500  # levels: past Python's recursion limit (1,000), under a 1,024-descriptor limit


def deep_chain(root: str, levels: int = DEEP, leaf: str | None = None,
               name: str = "d") -> str:
    """``root/d/d/.../d`` (``levels`` deep, each called ``name``) made through handles
    (the path is longer than some calls take); a file ``leaf`` at the bottom if named.
    Returns the key of the bottom."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(levels):
            os.mkdir(name, dir_fd=fd)
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = sub
        if leaf:
            with open(os.open(leaf, os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd), "wb") as f:
                f.write(SECRET_BYTES)
    finally:
        os.close(fd)
    return "/".join([name] * levels)


def remove_tree(root: str) -> None:
    """Empty ``root`` of a deep tree: pytest's own clean-up of tmp_path recurses
    (shutil.rmtree) and would fail on it."""
    store = LocalStorage(root)
    store.delete(key for key, _ in store.list(""))
    for name in os.listdir(root):
        LocalTree(store).remove_empty_dirs(name)


@pytest.mark.unit
def test_inspect_and_gc_report_a_deep_tree(tmp_path, capsys):
    """A 1,500-level tree is listed without recursion: a report, exit 0, nothing removed."""
    from ferrosync.__main__ import main

    root = tmp_path / "run"
    root.mkdir()
    bottom = deep_chain(str(root), leaf="user.csv")
    try:
        assert main(["inspect", str(root), "--watch", "0", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["total_objects"] == 1, report["total_objects"]
        assert f"{bottom}/user.csv" in json.dumps(report["foreign_objects"])
        for argv in (["gc", str(root), "--dry-run", "--watch", "0"],
                     ["gc", str(root), "--watch", "0"]):
            assert main(argv) == 0
            assert "0 objects" in capsys.readouterr().out
        store = LocalStorage(str(root))
        assert store.read(f"{bottom}/user.csv") == SECRET_BYTES
    finally:
        remove_tree(str(root))


@pytest.mark.unit
def test_emptied_directories_of_any_depth_are_removed(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    store = LocalStorage(str(root))
    os.mkdir(root / GEN)
    deep_chain(str(root / GEN))
    deep_chain(str(root / GEN / "d"), levels=3, leaf="kept", name="e")  # a branch that stays
    LocalTree(store).remove_empty_dirs(GEN)
    assert store.list(GEN) == [(f"{GEN}/d/e/e/e/kept", len(SECRET_BYTES))]
    os.unlink(os.path.join(root, GEN, "d/e/e/e/kept"))
    LocalTree(store).remove_empty_dirs(GEN)
    assert os.listdir(root) == []  # the whole chain, and nothing recursed


@pytest.mark.unit
def test_the_ddp_init_method_directory_is_owner_and_group_only(tmp_path):
    from ferrosync.ddp.init_methods import STORE_FILE, _directory_store
    from ferrosync.storage.engines.local import DIR_MODE

    old = os.umask(0)  # so the mode asked for is the mode made
    try:
        _directory_store(str(tmp_path / "pg"), 1)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "pg").st_mode) == DIR_MODE == 0o770
    victim = outside_file(tmp_path)
    (tmp_path / "pg2").mkdir()
    os.symlink(victim, tmp_path / "pg2" / STORE_FILE)
    with pytest.raises(StorageError) as info:
        _directory_store(str(tmp_path / "pg2"), 1)
    assert "a symbolic link" in str(info.value) and STORE_FILE in str(info.value)
    assert content(victim) == SECRET_BYTES


# -- end to end: real ranks ---------------------------------------------------------------------

def w_connect(rank, world, url, timeout):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=timeout, **FAST) as sync:
        sync.average_(torch.ones(8))
    return "connected"


def w_first_job(rank, world, url):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=30, **FAST) as sync:
        sync.average_(torch.ones(8))
    return True


@pytest.mark.timing
def test_a_fifo_at_the_first_announcement_fails_connect_typed(tmp_path):
    # where the announcement of generation 0 lives: ask a first job, not the source
    first = str(tmp_path / "first")
    assert run_ranks(w_first_job, 2, first) == [True, True]
    found = [os.path.relpath(os.path.join(d, n), first)
             for d, _, names in os.walk(first) for n in names if n == "gen.0"]
    assert len(found) == 1, found
    url = str(tmp_path / "run")
    fifo = os.path.join(url, found[0])
    os.makedirs(os.path.dirname(fifo))
    os.mkfifo(fifo)
    timeout = 6.0
    start = time.monotonic()
    results = run_ranks(w_connect, 2, url, timeout, expect_errors=True, timeout=60)
    took = time.monotonic() - start
    assert all(isinstance(r, RankFailure) for r in results), results
    assert all(isinstance(r.error, FerrosyncError) for r in results), results
    assert took < timeout + 15, took  # within its timeout (plus process start-up)
    refused = [r.error for r in results if isinstance(r.error, StorageError)]
    assert refused, results  # at least the rank that read it says what is there
    assert_refused(refused[0], fifo, "a FIFO")


def w_paused(rank, world, url, n, steps_before, steps_after, paused, go, reduce="root",
             names=False):
    """Average ``steps_before`` times, stop outside any collective until ``{go}.{rank}``
    exists (bounded), then ``steps_after`` more; returns every result's first element
    (and with ``names``, what the generation directory holds before closing)."""
    out = []
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=20, reduce=reduce,
                           **FAST) as sync:
        for step in range(steps_before + steps_after):
            if step == steps_before:
                open(f"{paused}.{rank}", "w").close()
                wait_until(lambda: os.path.exists(f"{go}.{rank}"), "go", timeout=40)
            x = torch.full((n,), float(2 * step + rank))
            sync.average_(x)
            assert torch.all(x == x[0]), "an element differs"
            out.append(float(x[0]))
        if names:
            sync.barrier()
            (gen,) = gen_dirs(url)
            return out, sorted(os.listdir(os.path.join(url, gen)))
    return out


def expected(steps: int) -> list[float]:
    return [2 * step + 0.5 for step in range(steps)]


def release(go: str, *ranks: int) -> None:
    for rank in ranks:
        open(f"{go}.{rank}", "w").close()


@pytest.mark.parametrize("name", ["abort.r1", "hb.r1"])
def test_a_fifo_at_a_control_record_during_a_collective(tmp_path, name):
    """Rank 1 holds back; rank 0 waits in a collective and checks rank 1's records."""
    url, paused, go = str(tmp_path / "run"), str(tmp_path / "paused"), str(tmp_path / "go")
    procs, results = start_ranks(w_paused, 2, url, 8, 1, 2, paused, go)
    fifo = None
    try:
        wait_until(lambda: all(os.path.exists(f"{paused}.{r}") for r in (0, 1)), "pause")
        (gen,) = gen_dirs(url)
        fifo = os.path.join(url, gen, name)
        swap = fifo + ".planting"
        os.mkfifo(swap)
        os.replace(swap, fifo)  # over the heartbeat: atomically, as an attacker would
        # rank 0 goes on and waits for rank 1, which stays out until rank 0 gave up or
        # the FIFO was replaced by rank 1's own next heartbeat (then nobody may read it)
        release(go, 0)
        wait_until(lambda: os.path.exists(os.path.join(url, gen, "abort.r0"))
                   or stat.S_ISREG(os.lstat(fifo).st_mode), "rank 0 refusing or a heartbeat",
                   timeout=20)
    finally:
        release(go, 0, 1)
        out = collect(procs, results, timeout=60)
        if fifo is not None:
            release_fifo(fifo)
    assert sorted(out) == [0, 1], out
    for rank, value in out.items():
        assert value == expected(3) or isinstance(value, RankFailure), (rank, value)
        if isinstance(value, RankFailure):
            assert isinstance(value.error, FerrosyncError), (rank, value)
    if name == "abort.r1":  # nobody replaces it: rank 0 must have read it, and refused
        assert isinstance(out[0], RankFailure), out
        assert_refused(out[0].error, fifo, "a FIFO")


def test_a_link_at_a_data_object_name_fails_the_collective_typed(tmp_path):
    url, paused, go = str(tmp_path / "run"), str(tmp_path / "paused"), str(tmp_path / "go")
    victim = outside_file(tmp_path)
    procs, results = start_ranks(w_paused, 2, url, 8, 1, 2, paused, go)
    try:
        wait_until(lambda: all(os.path.exists(f"{paused}.{r}") for r in (0, 1)), "pause")
        (gen,) = gen_dirs(url)
        present = set(os.listdir(os.path.join(url, gen)))
        # every contribution name rank 1 could publish next: rank 0 (the reducer) will
        # find a link where it waits for rank 1's data
        for s in range(100):
            if f"c{s}.r1" not in present:
                os.symlink(victim, os.path.join(url, gen, f"c{s}.r1"))
        release(go, 0)
        wait_until(lambda: os.path.exists(os.path.join(url, gen, "abort.r0")),
                   "rank 0 refusing the link", timeout=20)
    finally:
        release(go, 0, 1)
        out = collect(procs, results, timeout=60)
    assert isinstance(out[0], RankFailure), out
    err = out[0].error
    assert isinstance(err, StorageError) and "a symbolic link" in str(err), err
    assert os.path.join(url, gen) in str(err)
    assert isinstance(out[1], RankFailure) and isinstance(out[1].error, FerrosyncError), out
    assert content(victim) == SECRET_BYTES


def test_links_planted_over_parked_spares_are_never_written_through(tmp_path):
    url, paused, go = str(tmp_path / "run"), str(tmp_path / "paused"), str(tmp_path / "go")
    victim = outside_file(tmp_path)
    victim2 = str(tmp_path / "outside" / "victim2")
    shutil.copyfile(victim, victim2)
    n = 1 << 18  # 1 MiB of float32: large enough to be recycled
    procs, results = start_ranks(w_paused, 2, url, n, 4, 4, paused, go, names=True)
    try:
        wait_until(lambda: all(os.path.exists(f"{paused}.{r}") for r in (0, 1)), "pause")
        (gen,) = gen_dirs(url)
        spares = sorted(s for s in os.listdir(os.path.join(url, gen)) if s.startswith(".spare."))
        assert spares, os.listdir(os.path.join(url, gen))  # the job recycles on this disk
        for i, spare in enumerate(spares):
            path = os.path.join(url, gen, spare)
            swap = path + ".planting"
            if i % 2:
                os.link(victim2, swap)  # a second name for someone's file
            else:
                os.symlink(victim, swap)
            os.replace(swap, path)
    finally:
        release(go, 0, 1)
        out = collect(procs, results, timeout=90)
    assert out[0][0] == out[1][0] == expected(8), out  # the exact result, no error
    for rank in (0, 1):  # each planted spare was taken (and refused) before the end
        assert not set(spares) & set(out[rank][1]), (spares, out[rank][1])
    for path in (victim, victim2):
        assert content(path) == SECRET_BYTES
        assert os.stat(path).st_nlink == 1  # the planted hard link is gone again


def w_removed_dir(rank, world, url, paused, go):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=20, reduce="root",
                           **FAST) as sync:
        sync.average_(torch.ones(8))
        open(f"{paused}.{rank}", "w").close()
        wait_until(lambda: os.path.exists(go), "go", timeout=40)
        sync.average_(torch.ones(8))
    return True


def test_a_run_directory_deleted_mid_run_is_named(tmp_path):
    url, paused, go = str(tmp_path / "run"), str(tmp_path / "paused"), str(tmp_path / "go")
    procs, results = start_ranks(w_removed_dir, 2, url, paused, go)
    try:
        wait_until(lambda: all(os.path.exists(f"{paused}.{r}") for r in (0, 1)), "pause")
        shutil.rmtree(url)  # rm -rf by an operator, while the job runs
    finally:
        open(go, "w").close()
        out = collect(procs, results, timeout=60)
    assert all(isinstance(v, RankFailure) for v in out.values()), out
    assert all(isinstance(v.error, FerrosyncError) for v in out.values()), out
    err = out[1].error  # rank 1 publishes a contribution into the removed directory
    assert isinstance(err, StorageError) and not isinstance(err, FileNotFoundError), err
    assert "was the run directory deleted? restart the job" in str(err)
    assert url in str(err)


# -- end to end: the operator tools -------------------------------------------------------------

def w_job(rank, world, url, steps):
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=30, **FAST) as sync:
        for _ in range(steps):
            sync.average_(torch.ones(8))
        sync.barrier()
        return sync.generation


def tool(*argv, timeout: float = 30.0) -> tuple[int, str, str, float]:
    """Run ``python -m ferrosync ...`` as a separate process, bounded (a tool blocked
    on a FIFO must fail the test, not hang it)."""
    start = time.monotonic()
    proc = run_forked([sys.executable, "-m", "ferrosync", *argv], capture_output=True,
                      text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start


@pytest.mark.timing
def test_inspect_and_gc_with_planted_fifos_and_links(tmp_path):
    url = str(tmp_path / "run")
    assert run_ranks(w_job, 2, url, 2) == [0, 0]
    assert run_ranks(w_job, 2, url, 2) == [1, 1]
    old, new = gen_dirs(url)
    victim = outside_file(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "hb.r0").write_bytes(SECRET_BYTES)
    os.symlink(victim, os.path.join(url, old, "c99.r1"))  # in a finished generation
    os.replace(os.path.join(url, new, "hb.r1"), str(tmp_path / "hb.r1.saved"))
    os.mkfifo(os.path.join(url, new, "hb.r1"))  # read by exact name while watching
    os.mkfifo(os.path.join(url, new, "abort.r1"))
    os.symlink(elsewhere, os.path.join(url, "g7.0123456789abcdef"))  # a generation's name
    before = snapshot(str(tmp_path / "outside")), snapshot(str(elsewhere))
    try:
        code, out, err, took = tool("inspect", url, "--watch", "1", "--json")
        assert code == 0, err
        assert took < 25, took
        report = json.loads(out)
        planted = {e["key"]: e["kind"] for e in report["irregular_entries"]}
        assert planted == {f"{old}/c99.r1": "a symbolic link",
                           f"{new}/hb.r1": "a FIFO (named pipe)",
                           f"{new}/abort.r1": "a FIFO (named pipe)",
                           "g7.0123456789abcdef": "a symbolic link"}, planted
        gens = {g["prefix"]: g for g in report["generations"]}
        assert sorted(gens) == [old, new]  # the linked "generation" is never entered
        rank1 = next(r for r in gens[new]["ranks"] if r["rank"] == 1)
        assert rank1["state"] != "closed", rank1  # its heartbeat could not be read

        code, text, err, took = tool("inspect", url, "--watch", "0")
        assert code == 0 and "NOT REGULAR FILES" in text and f"{new}/hb.r1" in text, (text, err)

        code, out, err, took = tool("gc", url, "--watch", "1", "--json")
        assert code == 0, err
        assert took < 25, took
        done = json.loads(out)
        removed = {d["target"] for d in done["decisions"] if d["action"] == "remove"}
        assert old in removed, done["decisions"]  # finished: its objects went...
        assert os.listdir(os.path.join(url, old)) == ["c99.r1"]  # ...but not the link
        assert os.path.islink(os.path.join(url, old, "c99.r1"))
        kept = [d for d in done["decisions"] if d["target"] == "entries that are not "
                "regular files"]
        assert kept and kept[0]["action"] == "keep", done["decisions"]
        assert stat.S_ISFIFO(os.lstat(os.path.join(url, new, "abort.r1")).st_mode)
        assert os.path.islink(os.path.join(url, "g7.0123456789abcdef"))
    finally:
        for name in ("hb.r1", "abort.r1"):
            release_fifo(os.path.join(url, new, name))
    assert (snapshot(str(tmp_path / "outside")), snapshot(str(elsewhere))) == before
