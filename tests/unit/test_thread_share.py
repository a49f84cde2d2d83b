"""``train/threads.py``: torch's thread pool sized to this process's share of the cores, in
this process over a registry in a temporary directory.

The other "processes" are entries naming real ones (this process's parent is alive; a pid
that no process has, or this pid with another start time, is gone), so counting needs no
process of its own; time is a ``FakeClock`` (tests/fakes.py) and torch's pool size is
recorded, not changed. Real processes sharing a host: tests/test_threads.py.
"""

from __future__ import annotations

import os

import pytest

from fakes import FakeClock
from ferrosync.train import threads
from ferrosync.train.threads import RECOUNT_S, ThreadShare, share_threads

DEAD_PID = 2**22 + 12345  # above Linux's pid_max: never a process


@pytest.fixture
def pool(monkeypatch):
    """torch.set_num_threads, recorded instead of done; atexit hooks not left behind."""
    sizes = []
    monkeypatch.setattr(threads.torch, "set_num_threads", sizes.append)
    monkeypatch.setattr(threads.atexit, "register", lambda fn: None)
    return sizes


@pytest.fixture
def clock(monkeypatch):
    return FakeClock().install(monkeypatch, threads)


def enter(directory, pid):
    """An entry for the process ``pid`` (with its real start time: it is that process)."""
    name = f"{pid}.{threads._start_time(pid) or ''}"
    (directory / name).touch()
    return directory / name


def test_count_sees_live_processes_and_removes_the_gone_ones(tmp_path, pool):
    share = ThreadShare(str(tmp_path), cores=4)
    assert share.register() and (tmp_path / share.name).exists()
    parent = enter(tmp_path, os.getppid())
    dead = tmp_path / f"{DEAD_PID}.123"
    reused = tmp_path / f"{os.getpid()}.1"  # this pid, but an earlier process's start time
    for path in (dead, reused):
        path.touch()
    (tmp_path / "notes").touch()  # not an entry: left alone
    assert share.count() == 2  # this process and its parent
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [share.name, parent.name, "notes"])
    share.unregister()
    share.unregister()  # idempotent
    assert not (tmp_path / share.name).exists()


def test_the_pool_follows_the_processes_at_most_once_a_second(tmp_path, pool, clock):
    share = ThreadShare(str(tmp_path), cores=4)
    share.register()
    assert share.adjust() is None and pool == []  # alone from the start: torch's default
    parent = enter(tmp_path, os.getppid())
    assert share.adjust() is None  # counted again only after RECOUNT_S
    clock.advance(RECOUNT_S)
    assert share.adjust() == 2 and pool == [2]  # 4 cores, 2 processes
    clock.advance(RECOUNT_S)
    assert share.adjust() == 2 and pool == [2]  # unchanged: not set again
    parent.unlink()
    clock.advance(RECOUNT_S)
    assert share.adjust() == 4 and pool == [2, 4]  # alone again: every core back


def test_a_share_is_at_least_one_thread(tmp_path, pool):
    share = ThreadShare(str(tmp_path), cores=1)
    share.register()
    enter(tmp_path, os.getppid())
    assert share.adjust() == 1 and pool == [1]


def test_a_registry_that_is_not_this_users_directory_is_not_trusted(tmp_path, pool):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "planted").symlink_to(target)
    share = ThreadShare(str(tmp_path / "planted"), cores=4)
    with pytest.warns(RuntimeWarning, match="a symbolic link occupies its name"):
        assert not share.register()
    assert list(target.iterdir()) == []
    assert share.adjust() is None and pool == []  # unregistered: threads left alone


def test_share_threads_leaves_a_users_omp_num_threads_alone(tmp_path, pool, monkeypatch):
    monkeypatch.setattr(threads, "registry_dir", lambda: str(tmp_path))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert share_threads() is None and list(tmp_path.iterdir()) == []
    monkeypatch.delenv("OMP_NUM_THREADS")
    share = share_threads()
    assert share is not None and (tmp_path / share.name).exists() and pool == []
    share.unregister()
