"""The S3 path a newcomer meets first, and ``file://`` URLs.

* Without the ``s3`` extra (s3fs or botocore missing), and for every fsspec protocol
  whose driver is missing, a ``ConfigError`` carries the exact ``pip install``.
* Missing credentials and an unreachable endpoint (a closed loopback port) are
  ferrosync errors naming the endpoint and the environment variables to check, within
  ``connect``'s timeout; the CLI prints them as one line and exits 2.
* A URL naming an existing object is a ``ConfigError``.
* ``file://localhost/p`` and ``file:///p`` are ``/p``; another host is refused.
* A driver with real directories and no auto-mkdir works (no raw FileNotFoundError).

"Without the extra" runs a real interpreter in which importing the blocked packages
fails (a meta-path finder installed before anything is imported); nothing is
uninstalled. Servers are the real moto fixture on loopback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

import ferrosync
from conftest import BUCKET, free_port
from ferrosync.errors import ConfigError
from ferrosync.storage.engines import LocalStorage, open_storage
from ranks import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BLOCKER = textwrap.dedent("""
    import sys
    BLOCKED = set(sys.argv[1].split(","))

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
            return None

    sys.meta_path.insert(0, Blocker())
""")


def python(code: str, blocked: list[str], *args, env=None, timeout=120):
    """Run ``code`` in a fresh interpreter where ``blocked`` top-level packages cannot
    be imported; (returncode, stdout, stderr)."""
    script = BLOCKER + textwrap.dedent(code)
    full_env = dict(os.environ, PYTHONPATH=ROOT)
    for name, value in (env or {}).items():  # None: removed
        full_env.pop(name, None) if value is None else full_env.__setitem__(name, value)
    proc = subprocess.run([sys.executable, "-c", script, ",".join(blocked), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=full_env,
                          cwd=ROOT)
    return proc.returncode, proc.stdout, proc.stderr


TRY_ALL = """
    import contextlib, io, json, sys
    import ferrosync
    from ferrosync.__main__ import main

    url, options = sys.argv[2], json.loads(sys.argv[3])
    try:
        ferrosync.connect(url, rank=0, world_size=1, timeout=20, storage_options=options)
    except ferrosync.ConfigError as exc:
        print("ERR", exc)
    for tool in ("inspect", "gc", "doctor"):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main([tool, url, "--storage-options", json.dumps(options)])
        print("TOOL", json.dumps([tool, code, err.getvalue()]))
"""


def tools_of(out: str) -> dict:
    return {tool: (code, err) for tool, code, err in (
        json.loads(line[5:]) for line in out.splitlines() if line.startswith("TOOL "))}


def test_s3_without_the_extra_names_the_pip_command():
    """botocore blocked (s3fs cannot import without it; s3fs itself missing is
    tests/test_failures.py's case): connect and every tool say what to install."""
    code, out, err = python(TRY_ALL, ["botocore"], "s3://bucket/run", "{}")
    assert "ERR" in out and "pip install 'ferrosync[s3]'" in out, (out, err)
    tools = tools_of(out)
    assert sorted(tools) == ["doctor", "gc", "inspect"], out
    for tool, (code, text) in tools.items():
        lines = text.strip().splitlines()
        assert code == 2 and len(lines) == 1, (tool, text)
        assert "pip install 'ferrosync[s3]'" in lines[0], (tool, text)


#: (protocol, its driver's module, the package to install), from fsspec's registry
DRIVERS = [("gs", "gcsfs", "gcsfs"), ("az", "adlfs", "adlfs"), ("oci", "ocifs", "ocifs"),
           ("webdav", "webdav4", "webdav4"), ("sftp", "paramiko", "paramiko"),
           ("lakefs", "lakefs_spec", "lakefs-spec")]


def test_every_missing_fsspec_driver_names_its_package():
    code, out, err = python("""
        import json, sys
        from ferrosync.storage.engines import open_storage
        from ferrosync.errors import ConfigError
        for protocol in json.loads(sys.argv[2]):
            try:
                open_storage(protocol + "://bucket/run")
            except ConfigError as exc:
                print("ERR", protocol, exc)
    """, [m for _, m, _ in DRIVERS], json.dumps([p for p, _, _ in DRIVERS]))
    errors = {line.split()[1]: line for line in out.splitlines() if line.startswith("ERR ")}
    assert sorted(errors) == sorted(p for p, _, _ in DRIVERS), (out, err)
    for protocol, _, package in DRIVERS:
        assert errors[protocol].endswith(f"; pip install {package}"), errors[protocol]


def no_credentials_env(tmp_path) -> dict:
    """Extra environment for ``python``: no AWS variable, file or instance metadata."""
    return {"HOME": str(tmp_path), "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": str(tmp_path / "none"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
            "AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None}


def test_missing_credentials_name_the_endpoint_and_variables(s3_endpoint, tmp_path):
    options = json.dumps({"endpoint_url": s3_endpoint})
    code, out, err = python(TRY_ALL, [], f"s3://{BUCKET}/no-credentials", options,
                            env=no_credentials_env(tmp_path))
    assert "ERR" in out, (out, err)
    assert f"no usable credentials for {s3_endpoint} (from endpoint_url)" in out
    assert "AWS_ACCESS_KEY_ID" in out and "AWS_SECRET_ACCESS_KEY" in out
    tools = tools_of(out)
    assert sorted(tools) == ["doctor", "gc", "inspect"], out
    for tool, (code, text) in tools.items():
        lines = text.strip().splitlines()
        assert code == 2 and len(lines) == 1, (tool, text)
        assert "no usable credentials" in lines[0] and "AWS_ACCESS_KEY_ID" in lines[0]


@pytest.mark.unit
def test_a_closed_port_fails_within_the_connect_timeout(tmp_path, capsys):
    port = free_port()  # bound once, then closed: nothing listens there
    options = {"endpoint_url": f"http://127.0.0.1:{port}"}
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as info:
        ferrosync.connect(f"s3://{BUCKET}/closed", rank=0, world_size=1, timeout=5,
                          storage_options=options)
    took = time.monotonic() - t0
    # botocore's defaults alone took 21-32 s; its retries now fit in the timeout
    assert took < 15, took
    text = str(info.value)
    assert text.startswith("rank 0, at ") and f"http://127.0.0.1:{port} (from endpoint_url)" in text
    assert "AWS_ENDPOINT_URL" in text
    from ferrosync.__main__ import main

    capsys.readouterr()
    code = main(["gc", f"s3://{BUCKET}/closed", "--storage-options", json.dumps(options)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "cannot reach" in lines[0] or "no answer from" in lines[0], lines


def test_a_url_naming_an_existing_object_is_refused(s3_transport):
    options = s3_transport.options["storage_options"]
    storage = open_storage(s3_transport.url, options)
    storage.put("model.pt", [b"weights"])
    with pytest.raises(ConfigError, match="names an existing object"):
        ferrosync.connect(f"{s3_transport.url}/model.pt", rank=0, world_size=1,
                          storage_options=options, timeout=20)
    # the prefix itself, and a new prefix below the bucket, are fine
    ferrosync.connect(f"{s3_transport.url}/fresh", rank=0, world_size=1,
                      storage_options=options, timeout=20).close()


@pytest.mark.unit
def test_file_urls_follow_rfc_8089(tmp_path):
    for url in (f"file://{tmp_path}/run", f"file://localhost{tmp_path}/run",
                f"file://LOCALHOST{tmp_path}/run"):
        storage = open_storage(url)
        assert isinstance(storage, LocalStorage) and storage.root == f"{tmp_path}/run", url
    with pytest.raises(ConfigError, match="names the host 'fileserver'"):
        open_storage(f"file://fileserver{tmp_path}/run")
    with pytest.raises(ConfigError, match="names the host"):
        ferrosync.connect(f"file://node7/{tmp_path}/run", rank=0, world_size=1)


def w_localhost_url(rank, world, url, cwd):
    os.chdir(cwd)  # ranks in different directories must still meet
    with ferrosync.connect(url, rank=rank, world_size=world, timeout=30) as sync:
        import torch

        x = torch.full((4,), float(rank))
        sync.average_(x)
        return x.tolist()


def test_ranks_in_different_directories_meet_through_file_localhost(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    url = f"file://localhost{tmp_path}/run"
    results = run_ranks(_w_in_dir, 2, url, [str(d) for d in dirs])
    assert results == [[0.5] * 4, [0.5] * 4]
    assert (tmp_path / "run").is_dir() and not (tmp_path / "a" / "localhost").exists()


def _w_in_dir(rank, world, url, dirs):
    return w_localhost_url(rank, world, url, dirs[rank])


def w_real_directories(rank, world, root):
    """A driver with real directories and no auto-mkdir (fsspec's local filesystem
    class under its own protocol name), registered the way a user would."""
    import fsspec
    import torch
    from fsspec.implementations.local import LocalFileSystem

    class RealDirs(LocalFileSystem):
        protocol = ("realdirs",)

        @classmethod
        def _strip_protocol(cls, path):
            if isinstance(path, str) and path.startswith("realdirs://"):
                path = path[len("realdirs://"):]
            return LocalFileSystem._strip_protocol(path)

        def pipe_file(self, path, value, mode="overwrite", **kwargs):
            # a whole-object put, as every store ferrosync supports has (a reader never
            # sees it half-written), with a real exclusive create (connect requires
            # one) and no auto-mkdir: written aside, then linked into place, which
            # fails if the name exists (an open(..., "xb") would show a reader the
            # empty file before the write)
            import os
            import tempfile

            path = self._strip_protocol(path)
            fd, aside = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".put-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(value)
                if mode == "create":
                    os.link(aside, path)
                else:
                    os.replace(aside, path)
            finally:
                if os.path.exists(aside):
                    os.unlink(aside)

    fsspec.register_implementation("realdirs", RealDirs, clobber=True)
    with ferrosync.connect(f"realdirs://{root}/run", rank=rank, world_size=world,
                           timeout=30) as sync:
        x = torch.full((4,), float(rank))
        sync.average_(x)
        return x.tolist()


def test_a_driver_with_real_directories_and_no_auto_mkdir(tmp_path):
    assert run_ranks(w_real_directories, 2, str(tmp_path)) == [[0.5] * 4, [0.5] * 4]
