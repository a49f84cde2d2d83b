"""``storage/engines/classify.py``: transient or not, judged by type, errno, S3 code and HTTP
status (never by message), and the hint a ``StorageError`` carries."""

from __future__ import annotations

import errno

import pytest

from ferrosync.errors import StorageError
from ferrosync.storage.engines.classify import http_status, is_transient, s3_code, storage_error


class ClientError(Exception):
    """botocore's shape: a ``response`` dict with the error code and HTTP metadata."""

    def __init__(self, code, status):
        super().__init__(code)
        self.response = {"Error": {"Code": code},
                         "ResponseMetadata": {"HTTPStatusCode": status}}


class HttpError(Exception):
    def __init__(self, status, name="status"):
        super().__init__(f"HTTP {status}")
        setattr(self, name, status)


def translated(cause: BaseException) -> OSError:
    """What s3fs and gcsfs raise: an OSError caused by the client's error."""
    try:
        raise cause
    except BaseException as exc:
        try:
            raise OSError("translated") from exc
        except OSError as outer:
            return outer


@pytest.mark.parametrize("exc", [
    OSError(errno.ESTALE, "stale"), OSError(errno.EIO, "io"), OSError(errno.EINTR, "intr"),
    ConnectionResetError("reset"), TimeoutError("slow"),
    ClientError("SlowDown", 503), translated(ClientError("InternalError", 500)),
    HttpError(503), HttpError(500, "status_code"), translated(HttpError(503, "code")),
])
def test_transient(exc):
    assert is_transient(exc)


@pytest.mark.parametrize("exc", [
    OSError(errno.ENOSPC, "full"), PermissionError(errno.EACCES, "denied"),
    ClientError("AccessDenied", 403), ClientError("NoSuchBucket", 404), HttpError(404),
    ValueError("SlowDown 503 ServiceUnavailable"),  # words in a message mean nothing
])
def test_permanent(exc):
    assert not is_transient(exc)


def test_codes_and_statuses_are_found_behind_translated_errors():
    exc = translated(ClientError("SlowDown", 503))
    assert s3_code(exc) == "SlowDown" and http_status(exc) == 503
    assert s3_code(ValueError("x")) is None and http_status(ValueError("x")) is None
    flag = HttpError(True)  # a bool attribute named "status" is no HTTP status
    assert http_status(flag) is None


@pytest.mark.parametrize("exc, transient, hint", [
    (OSError(errno.EDQUOT, "quota"), False, "the disk quota is exceeded"),
    (OSError(errno.EROFS, "ro"), False, "the filesystem is read-only"),
    (ClientError("AccessDenied", 403), False, "access denied: check the credentials"),
    (HttpError(403), False, "access denied"),
    (OSError(errno.EIO, "io"), True, "kept failing after retries"),
    (ValueError("odd"), False, None),
])
def test_storage_error_hints(exc, transient, hint):
    err = storage_error("put", "s3://b/k", exc, transient)
    assert isinstance(err, StorageError) and err.path == "s3://b/k"
    assert err.what.startswith(f"put failed ({type(exc).__name__}: ")
    assert (err.hint is None) if hint is None else (hint in err.hint)
