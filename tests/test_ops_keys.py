"""Key files (``ferrosync/ops/keys.py``): the launcher keeps each launch's key where only
its user can read it, and the tools refuse a key file anyone else could have read or
written. In-process, on real files in a temporary directory."""

from __future__ import annotations

import json
import os

import pytest

from ferrosync.errors import ConfigError
from ferrosync.ops import keys

pytestmark = pytest.mark.unit

SECRET = "ab" * 32


@pytest.fixture
def where(tmp_path):
    return str(tmp_path / "keys")


def test_a_key_file_is_private_and_read_back(where):
    path = keys.save("launch-0123", SECRET, "/mnt/nfs/run7", where)
    assert path == os.path.join(where, "launch-0123.key")
    assert os.stat(where).st_mode & 0o777 == 0o700
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.listdir(where) == ["launch-0123.key"]  # no temporary file left
    found = keys.load("launch-0123", where)
    assert found.secret == SECRET.encode() and found.url == "/mnt/nfs/run7"
    with pytest.raises(FileExistsError):  # never replaces another launch's key
        keys.save("launch-0123", "cd" * 32, "/elsewhere", where)
    assert keys.load("launch-0123", where).secret == SECRET.encode()

    job_keys = keys.JobKeys(b"operator's", where)
    assert job_keys.secret("rdzv.launch-0123") == SECRET.encode()
    assert job_keys.secret("el.launch-0123") == SECRET.encode()
    assert job_keys.secret("rdzv.other") == b"operator's"  # no key file: --secret's
    assert job_keys.secret("rdzv") == b"operator's" and job_keys.secret(None) == b"operator's"
    assert job_keys.used() == {"launch-0123": path}


def test_a_launch_with_the_users_own_secret_keeps_no_copy_of_it(where):
    keys.save("launch-own", None, "/mnt/nfs/run7", where)
    with open(keys.path_of("launch-own", where)) as f:
        assert json.load(f)["secret"] is None
    assert keys.JobKeys(b"users", where).secret("rdzv.launch-own") == b"users"


@pytest.mark.parametrize("job", ["../escape", ".hidden", "a/b", "", "x" * 65])
def test_a_job_id_from_storage_names_no_file_outside(where, job):
    assert keys.path_of(job, where) is None
    assert keys.load(job, where) is None


def test_key_files_others_could_read_or_replace_are_refused(where):
    path = keys.save("launch-0123", SECRET, "/run", where)
    os.chmod(path, 0o640)
    with pytest.raises(ConfigError, match=r"open to group or others \(mode 0640\); "
                       rf"chmod 600 {path}"):
        keys.load("launch-0123", where)
    os.chmod(path, 0o600)
    os.rename(path, path + ".real")
    os.symlink(path + ".real", path)
    with pytest.raises(ConfigError, match="cannot use the key file"):
        keys.load("launch-0123", where)
    os.unlink(path)
    with open(path, "w") as f:  # the user's own, private, but not a key file
        f.write('{"job": "someone-else"}')
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError, match="not a ferrosync key file"):
        keys.load("launch-0123", where)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_key_file_of_another_user_is_refused(where):
    path = keys.save("launch-0123", SECRET, "/run", where)
    os.chown(path, 1, 1)
    with pytest.raises(ConfigError, match="belongs to uid 1, not to you"):
        keys.load("launch-0123", where)


def test_a_key_directory_others_can_enter_is_refused(where):
    os.makedirs(where, mode=0o755)
    os.chmod(where, 0o755)
    with pytest.raises(ConfigError, match="chmod 700"):
        keys.save("launch-0123", SECRET, "/run", where)
    assert os.listdir(where) == []


def test_the_directory_follows_xdg_and_the_override():
    home = os.path.expanduser("~")
    assert keys.directory({}) == os.path.join(home, ".config", "ferrosync", "keys")
    assert keys.directory({"XDG_CONFIG_HOME": "/cfg"}) == "/cfg/ferrosync/keys"
    assert keys.directory({"XDG_CONFIG_HOME": "/cfg", keys.ENV_KEYS: "/k"}) == "/k"


