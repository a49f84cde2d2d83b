"""``ferrosync/core/private.py``: this user's directories outside the store (host-local memory,
the key directory) are created and verified like the store's own files, and used only
through their verified handle.

"Another local user" is real: the tests run as root, so a directory is handed to
another uid with ``os.chown`` (skipped when not root); "host-local memory" is a sticky
world-writable directory under tmp_path standing in for /dev/shm.
"""

from __future__ import annotations

import os
import stat

import pytest

from ferrosync.core import private
from ferrosync.core.private import PrivateDir
from ferrosync.errors import ConfigError
from ferrosync.train import threads
from ferrosync.train.metrics import PathClaim
from ferrosync.train.threads import ThreadShare

pytestmark = pytest.mark.unit

OTHER_UID = 12345  # another local user
#: a user's files named like registry entries (a pid, then anything)
VICTIMS = {"1": b"one", "2024.csv": b"a,b\n", "7.txt": b"seven", "31337.key": b"k" * 32}
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


@pytest.fixture
def shm(tmp_path, monkeypatch):
    """A stand-in for /dev/shm: world-writable with the sticky bit."""
    base = tmp_path / "shm"
    base.mkdir()
    os.chmod(base, 0o1777)
    monkeypatch.setattr(private, "host_base", lambda: str(base))
    monkeypatch.setattr(threads.atexit, "register", lambda fn: None)
    monkeypatch.setattr(threads.torch, "set_num_threads", lambda n: None)
    return base


@pytest.fixture
def victim(tmp_path):
    where = tmp_path / "victim"
    where.mkdir()
    for name, data in VICTIMS.items():
        (where / name).write_bytes(data)
    return where


def untouched(where) -> bool:
    return {p.name: p.read_bytes() for p in where.iterdir()} == VICTIMS


def plant(path, *, uid: int = OTHER_UID, mode: int = 0o777) -> None:
    path.mkdir()
    os.chown(path, uid, uid)
    os.chmod(path, mode)


@needs_root
def test_another_users_host_directory_never_makes_the_registry_delete(shm, victim):
    """The case seen in the field: another user makes /dev/shm/ferrosync-<uid> (0777) first, then
    swaps train-procs for a link to one of our directories."""
    planted = shm / f"ferrosync-{os.geteuid()}"
    plant(planted)
    share = ThreadShare(cores=4)
    with pytest.warns(RuntimeWarning, match=f"belongs to uid {OTHER_UID}"):
        registered = share.register()
    registry = planted / "train-procs"
    if registry.exists():  # the other user's swap
        registry.rename(planted / "was")
    registry.symlink_to(victim)
    if registered:
        share.count()
    assert not registered and untouched(victim)


def test_a_registry_swapped_for_a_link_is_still_cleaned_through_its_handle(shm, victim):
    """Stale entries are removed from the directory that was verified, whatever its name
    points at by now."""
    share = ThreadShare(cores=4)
    assert share.register()
    registry = shm / f"ferrosync-{os.geteuid()}" / "train-procs"
    assert stat.S_IMODE(registry.stat().st_mode) == 0o700
    (registry / "4206649.1").touch()  # a process that is gone
    registry.rename(registry.parent / "moved")
    registry.symlink_to(victim)
    assert share.count() == 1
    assert sorted(os.listdir(registry.parent / "moved")) == [share.name]
    assert untouched(victim)
    share.unregister()


@needs_root
@pytest.mark.parametrize("case", ["other user", "mode 777", "link", "file"])
def test_an_unsafe_part_is_refused(tmp_path, victim, case):
    top = tmp_path / "top"
    if case == "other user":
        plant(top, mode=0o700)
    elif case == "mode 777":
        plant(top, uid=os.geteuid())
    elif case == "link":
        top.symlink_to(victim)
    else:
        top.write_bytes(b"")
    with pytest.raises(ConfigError) as info:
        PrivateDir.open(str(top / "claims"), base=str(tmp_path))
    text = str(info.value)
    assert str(top) in text and "refused" in text and "\n" not in text, text
    assert untouched(victim) and not (victim / "claims").exists()


def test_a_shared_base_without_the_sticky_bit_is_refused(tmp_path):
    base = tmp_path / "open"
    base.mkdir()
    os.chmod(base, 0o777)
    with pytest.raises(ConfigError, match="others could replace what is in it"):
        PrivateDir.open(str(base / "ferrosync-0"), base=str(base))


def test_a_key_directory_others_may_enter_is_refused(tmp_path):
    keys_dir = tmp_path / "keys"
    keys_dir.mkdir(mode=0o755)
    os.chmod(keys_dir, 0o755)
    PrivateDir.open(str(keys_dir)).close()  # writable by no one else: fine for a host dir
    with pytest.raises(ConfigError, match="its mode 0755 lets group or others in"):
        PrivateDir.open(str(keys_dir), secret=True)


def test_parts_are_made_private_and_reused(tmp_path):
    with PrivateDir.open(str(tmp_path / "a" / "b"), base=str(tmp_path)) as d:
        os.close(d.open_file("x", os.O_WRONLY | os.O_CREAT))
        assert d.listdir() == ["x"]
    for part in (tmp_path / "a", tmp_path / "a" / "b"):
        assert stat.S_IMODE(part.stat().st_mode) == 0o700
    with PrivateDir.open(str(tmp_path / "a" / "b"), base=str(tmp_path)) as d:
        d.unlink("x")
        assert d.listdir() == []


@needs_root
def test_a_planted_claims_directory_is_never_written(shm, tmp_path):
    plant(shm / f"ferrosync-{os.geteuid()}")
    with pytest.warns(RuntimeWarning, match="is not claimed against a second writer"):
        claim = PathClaim(str(tmp_path / "metrics.jsonl"))
    claim.release()
    assert os.listdir(shm / f"ferrosync-{os.geteuid()}") == []


@needs_root
def test_a_key_directory_under_another_users_directory_is_refused(tmp_path, monkeypatch):
    from ferrosync.ops import keys

    config = tmp_path / "config"
    config.mkdir()
    plant(config / "ferrosync")  # the other user made ~/.config/ferrosync first
    monkeypatch.delenv(keys.ENV_KEYS, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config))
    with pytest.raises(ConfigError, match=f"belongs to uid {OTHER_UID}"):
        keys.save("launch-0123456789abcdef", "ab" * 16, "/tmp/run")
    assert os.listdir(config / "ferrosync") == []


@needs_root
def test_the_node_local_default_under_another_users_directory_is_refused(shm):
    from ferrosync.torchdist.hierarchical import _default_local_dir

    plant(shm / f"ferrosync-{os.geteuid()}")
    with pytest.raises(ConfigError, match="another user made it first"):
        _default_local_dir()
