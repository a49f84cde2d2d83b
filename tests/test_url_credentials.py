"""Credentials written into a URL (``s3://KEY:SECRET@bucket/x``) and a scheme in upper
case (``S3://``): refused before any request, exit 2, one line that never shows the
credentials, from the trainer (launcher and lone rank) and from every operator tool.
The one rule is ``ferrosync.errors.redact``; ``split_url`` refuses what it would change."""

from __future__ import annotations

import pickle
import sys

import pytest
from train_cli import cli_env, run_forked, run_main

from ferrosync.errors import ConfigError, StorageError, one_line, redact, relay_text
from ferrosync.storage.engines import split_url

SECRET_URL = "s3://AKIAEXAMPLEKEY:wJalr/K7MDENG+bPxRfi@bucket/run"
SHOWN = "s3://***@bucket/run"


@pytest.mark.unit
@pytest.mark.parametrize("text, shown", [
    (SECRET_URL, SHOWN),
    ("http://user:pw@127.0.0.1:9000/x", "http://***@127.0.0.1:9000/x"),
    ('cannot reach "gs://u:p@b/p" now', 'cannot reach "gs://***@b/p" now'),
    ("s3://bucket/run", "s3://bucket/run"),
    ("gs://bucket/obj@v2", "gs://bucket/obj@v2"),  # an '@' in the path: nothing to hide
    ("s3://TOKEN@bucket/run", SHOWN),  # a token alone (s3/gs names have no '@')
    ("HTTPS://ghp_Tok3n@example.com/x", "HTTPS://***@example.com/x"),
    ("abfs://container@account.dfs.core.windows.net/p",
     "abfs://container@account.dfs.core.windows.net/p"),  # adlfs' own spelling
    ("az://container@account/p", "az://container@account/p"),
    ("oci://bucket@namespace/p", "oci://bucket@namespace/p"),  # ocifs' own spelling
    ("abfs://container:AccountKey@account/p", "abfs://***@account/p"),
    ("/a/plain:path@x", "/a/plain:path@x"),
])
def test_redact_hides_user_and_password_of_every_url_in_a_text(text, shown):
    assert redact(text) == shown
    assert redact(redact(text)) == shown
    assert redact(None) is None


@pytest.mark.unit
def test_errors_never_carry_a_credential_and_urls_with_them_are_refused():
    err = StorageError(f"reading {SECRET_URL}/x failed", path=SECRET_URL,
                       hint=f"retry {SECRET_URL}")
    for text in (str(err), err.what, err.path, err.hint, relay_text(err),
                 str(pickle.loads(pickle.dumps(err))), relay_text(OSError(SECRET_URL))):
        assert "wJalr" not in text and "AKIAEXAMPLEKEY" not in text, text
    with pytest.raises(ConfigError, match=r"credentials in a URL are refused") as info:
        split_url(SECRET_URL)
    assert SHOWN in str(info.value) and "wJalr" not in str(info.value)
    assert "storage_options" in str(info.value)
    with pytest.raises(ConfigError, match=r"lower case; write s3://bucket/run$"):
        split_url("S3://bucket/run")
    assert split_url("s3://bucket/run") == ("s3", "bucket/run")


@pytest.mark.unit
def test_a_token_without_a_colon_is_refused_and_a_container_is_not():
    with pytest.raises(ConfigError, match=r"credentials in a URL are refused") as info:
        split_url("s3://TOKEN@bucket/run")
    assert SHOWN in str(info.value) and "TOKEN" not in str(info.value)
    assert split_url("abfs://container@account/p") == ("abfs", "container@account/p")


@pytest.mark.unit
def test_one_line_joins_a_drivers_lines_and_hides_credentials():
    driver = OSError(f"Parameter validation failed:\nInvalid bucket name {SECRET_URL}")
    assert one_line(driver) == f"Parameter validation failed: Invalid bucket name {SHOWN}"


def _clean(text: str) -> bool:
    return ("wJalr" not in text and "AKIAEXAMPLEKEY" not in text and "TOKEN" not in text
            and "Traceback" not in text)


@pytest.mark.parametrize("flags", [
    ("--nproc", 2, "--sync", SECRET_URL),
    ("--nproc", 2, "--sync", "s3://TOKEN@bucket/run"),
    ("--nproc", 1, "--checkpoint-dir", SECRET_URL),
    ("--sync", SECRET_URL),  # a rank started by hand (srun, torchrun)
])
def test_trainer_refuses_credentials_in_a_url(tmp_path, monkeypatch, capsys, flags):
    code, out, err = run_main([*flags, "--steps", 1], tmp_path, monkeypatch, capsys)
    assert code == 2, err
    assert _clean(out + err), out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and SHOWN in lines[0] and "refused" in lines[0], err


def test_trainer_names_the_lower_case_scheme(tmp_path, monkeypatch, capsys):
    code, _, err = run_main(["--nproc", 2, "--sync", "S3://bucket/run", "--steps", 1],
                            tmp_path, monkeypatch, capsys)
    assert code == 2 and "write s3://bucket/run" in err and "regex" not in err, err


@pytest.mark.parametrize("url", [SECRET_URL, "s3://TOKEN@bucket/run"])
@pytest.mark.parametrize("tool", ["inspect", "gc", "doctor"])
def test_operator_tools_refuse_credentials_in_a_url(tmp_path, tool, url):
    proc = run_forked([sys.executable, "-m", "ferrosync", tool, url], cwd=tmp_path,
                      env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert _clean(proc.stdout + proc.stderr), proc.stdout + proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"ferrosync {tool}: error: {SHOWN}: credentials in a URL")
