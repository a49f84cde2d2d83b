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




# -- ferrosync keys: listing and pruning ----------------------------------------------------

DAY = 86400.0


def _key(where, job, url, *, launcher=None, age_days=0.0):
    """A key file as the launcher writes it, with another launcher or age when given."""
    path = keys.save(job, SECRET, url, where)
    if launcher is not None:
        with open(path) as f:
            body = json.load(f)
        body["launcher"] = {**body["launcher"], **launcher}
        os.unlink(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(body, f)
    stamp = os.stat(path).st_mtime - age_days * DAY
    os.utime(path, (stamp, stamp))
    return path


#: a launcher on this host that has exited (no process has this pid and start time)
EXITED = {"pid": 4_194_303, "start": 1}


def test_prune_removes_the_keys_of_launches_that_are_over_and_nothing_else(where, tmp_path):
    alive_dir = tmp_path / "run-alive"
    alive_dir.mkdir()
    gone_dir = str(tmp_path / "run-gone")  # never made: the run directory is gone
    _key(where, "running-old", gone_dir, age_days=90)  # this process is its launcher
    _key(where, "exited-dir-gone", gone_dir, launcher=EXITED)
    _key(where, "exited-dir-kept", str(alive_dir), launcher=EXITED, age_days=2)
    _key(where, "exited-old", str(alive_dir), launcher=EXITED, age_days=45)
    _key(where, "exited-s3", "s3://bucket/run", launcher=EXITED, age_days=5)
    _key(where, "elsewhere-old", "s3://bucket/run", launcher={"host": "node9"}, age_days=31)
    _key(where, "elsewhere-young", gone_dir, launcher={"host": "node9"}, age_days=29)
    open_key = _key(where, "open-to-others", gone_dir, launcher=EXITED, age_days=90)
    os.chmod(open_key, 0o644)
    target = tmp_path / "precious.key"
    target.write_text("a user's file")
    os.symlink(target, os.path.join(where, "planted.key"))
    with open(os.path.join(where, "notes.txt"), "w") as f:
        f.write("mine")

    found = {e.name: e for e in keys.entries(where)}
    assert found["running-old.key"].running is True
    assert found["exited-dir-gone.key"].store_gone and not found["exited-dir-kept.key"].store_gone
    assert found["open-to-others.key"].key is None and "chmod 600" in found[
        "open-to-others.key"].problem
    planned = keys.prune(list(found.values()), 30 * DAY, where, dry_run=True)
    assert len(os.listdir(where)) == 10  # a dry run removes nothing
    removed = {e.name: why for e, why in keys.prune(list(found.values()), 30 * DAY, where)}
    assert removed == {e.name: why for e, why in planned}
    assert removed == {
        "exited-dir-gone.key": "its launch is over and its run directory is gone",
        "exited-old.key": "not running, 45 days old",
        "elsewhere-old.key": "not running, 31 days old"}
    assert sorted(os.listdir(where)) == [
        "elsewhere-young.key", "exited-dir-kept.key", "exited-s3.key", "notes.txt",
        "open-to-others.key", "planted.key", "running-old.key"]
    assert target.read_text() == "a user's file"  # a link's target is never touched
    # a shorter age takes the young ones of launches that are over, never a running one
    removed = {e.name for e, _ in keys.prune(keys.entries(where), 1 * DAY, where)}
    assert removed == {"elsewhere-young.key", "exited-dir-kept.key", "exited-s3.key"}
    assert "running-old.key" in os.listdir(where)


def test_ferrosync_keys_lists_and_prunes_from_the_command_line(where, tmp_path, capsys,
                                                              monkeypatch):
    from ferrosync.__main__ import main

    monkeypatch.setenv(keys.ENV_KEYS, where)
    _key(where, "launch-a", str(tmp_path / "gone"), launcher=EXITED)
    _key(where, "launch-b", str(tmp_path), launcher=EXITED)
    assert main(["keys"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"ferrosync keys {where}: 2 file(s)\n")
    assert f"launch-a  0.0 h  {tmp_path / 'gone'} (gone)  its launcher (pid" in out
    assert "ferrosync keys --prune removes" in err  # says how, removes nothing
    assert sorted(os.listdir(where)) == ["launch-a.key", "launch-b.key"]
    assert main(["keys", "--prune", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(e["job"], e["removed"]) for e in report["entries"]] == [
        ("launch-a", "its launch is over and its run directory is gone"), ("launch-b", None)]
    assert os.listdir(where) == ["launch-b.key"]
    with pytest.raises(SystemExit) as exc:
        main(["keys", "--prune", "--older-than", "-1"])
    assert exc.value.code == 2
    os.chmod(where, 0o755)  # a key directory others may enter: refused, one line, exit 2
    assert main(["keys", "--prune"]) == 2
    assert "chmod 700" in capsys.readouterr().err


def test_ferrosync_keys_never_shows_a_credential_an_old_key_file_holds(where, capsys,
                                                                      monkeypatch):
    """Key files written before URLs with credentials were refused may hold one."""
    from ferrosync.__main__ import main

    monkeypatch.setenv(keys.ENV_KEYS, where)
    _key(where, "launch-old", "s3://AKIAKEY:s3cr3t@bucket/run", launcher=EXITED)
    assert main(["keys"]) == 0
    out = capsys.readouterr().out
    assert "s3://***@bucket/run" in out and "s3cr3t" not in out and "AKIAKEY" not in out
    assert main(["keys", "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)["entries"]
    assert entry["url"] == "s3://***@bucket/run"
