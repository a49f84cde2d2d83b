"""Transient-error classification: whether a failed storage request may succeed if tried
again, and the ``StorageError`` (with a hint saying what to do) for one that failed.

Judged by exception type, errno, S3 error code and HTTP status only, for every client
under fsspec (botocore, aiohttp, azure, gcsfs); ``Storage.retry`` and the engines ask
here (``is_transient``; ``cut_short`` for a body cut mid-transfer, which no client
retries under ``S3Storage``). Named ``classify`` so it never shadows ``ferrosync.errors``.
"""

from __future__ import annotations

import asyncio
import errno

from ferrosync.errors import StorageError

# errno values that mean "try the same request again": NFS stale handles after
# a concurrent rename, interrupted calls, brief server hiccups.
_TRANSIENT_ERRNOS = {errno.ESTALE, errno.EINTR, errno.EAGAIN, errno.EIO, errno.ETIMEDOUT}
_PERMANENT_HINTS = {
    errno.ENOSPC: "the storage is full: free space or point the URL elsewhere",
    errno.EDQUOT: "the disk quota is exceeded: free space or raise the quota",
    errno.EACCES: "permission denied: check the directory's owner and mode",
    errno.EPERM: "operation not permitted: check the directory's owner and mode",
    errno.EROFS: "the filesystem is read-only: mount it read-write",
}


# Object-store answers that mean "busy or hiccuped: the same request may succeed":
# S3 error codes (botocore ``ClientError.response["Error"]["Code"]``) and HTTP statuses
_TRANSIENT_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout"}
_TRANSIENT_STATUSES = {500, 503}
# S3 error codes that mean "these credentials may not do this"
_DENIED_CODES = {"AccessDenied"}


def _client_types() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """(transient, cut short): the object-store clients' failures that may pass if the
    request is sent again (connection failures that are not ``OSError``s with a
    transient errno), and among them those of a reply whose body ended early (reset or
    closed mid-transfer): botocore's (s3fs), aiohttp's (s3fs, gcsfs, adlfs, http) and
    azure-core's (adlfs), where installed. Imported lazily: a local-only install has
    none of them."""
    import http.client

    transient: list[type] = [ConnectionError, TimeoutError, asyncio.TimeoutError]
    cut: list[type] = [http.client.IncompleteRead]
    try:
        from botocore.exceptions import (
            ConnectionClosedError,
            EndpointConnectionError,
            IncompleteReadError,
            ReadTimeoutError,
            ResponseStreamingError,
        )
        transient += [ConnectionClosedError, EndpointConnectionError, ReadTimeoutError]
        cut += [IncompleteReadError, ResponseStreamingError]
    except ImportError:
        pass
    try:
        from aiohttp import ClientOSError, ClientPayloadError, ServerDisconnectedError
        transient += [ClientOSError, ServerDisconnectedError]
        cut += [ClientPayloadError]
    except ImportError:
        pass
    try:
        from azure.core.exceptions import (
            IncompleteReadError as AzureIncompleteRead,
        )
        from azure.core.exceptions import ServiceRequestError, ServiceResponseError
        transient += [ServiceRequestError, ServiceResponseError]
        cut += [AzureIncompleteRead]
    except ImportError:
        pass
    return tuple(transient + cut), tuple(cut)


_CLIENT_TYPES: tuple[tuple[type, ...], tuple[type, ...]] | None = None


def _types() -> tuple[tuple[type, ...], tuple[type, ...]]:
    global _CLIENT_TYPES
    if _CLIENT_TYPES is None:
        _CLIENT_TYPES = _client_types()
    return _CLIENT_TYPES


def causes(exc: BaseException | None, depth: int = 8):
    """``exc`` and what it was raised from or while handling (s3fs and gcsfs raise an
    ``OSError`` whose cause is the client's error), nearest first."""
    for _ in range(depth):
        if exc is None:
            return
        yield exc
        exc = exc.__cause__ or exc.__context__


def s3_response(exc: BaseException) -> dict | None:
    """The botocore response dict behind ``exc`` (a ``ClientError``'s), or None."""
    for cause in causes(exc):
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            return response
    return None


def s3_code(exc: BaseException) -> str | None:
    """The S3 error code behind ``exc`` ("SlowDown", "AccessDenied", ...), or None."""
    code = ((s3_response(exc) or {}).get("Error") or {}).get("Code")
    return code if isinstance(code, str) else None


def http_status(exc: BaseException) -> int | None:
    """The HTTP status behind ``exc``: botocore's response metadata, or the attribute
    the other clients name it by (aiohttp ``status``, azure ``status_code``, gcsfs
    ``code``)."""
    response = s3_response(exc)
    if response is not None:
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        return status if isinstance(status, int) else None
    for cause in causes(exc):
        for name in ("status", "status_code", "code"):
            status = getattr(cause, name, None)
            if isinstance(status, int) and not isinstance(status, bool):
                return status
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether the same request may succeed if tried again, judged by type (of ``exc``
    or the client's error behind it), errno, S3 error code and HTTP status only.
    Messages are never searched: their wording is no contract, and a path or bucket
    name may contain any word or number."""
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    transient, _ = _types()
    if any(isinstance(cause, transient) for cause in causes(exc)):
        return True
    # the client's answer behind a translated error (s3fs: an OSError caused by it)
    return s3_code(exc) in _TRANSIENT_CODES or http_status(exc) in _TRANSIENT_STATUSES


def cut_short(exc: BaseException) -> bool:
    """Whether ``exc`` is a reply whose body ended early: the connection was reset or
    closed mid-transfer (aiohttp's ``ClientPayloadError``, botocore's
    ``IncompleteReadError``, azure's ``IncompleteReadError``). Transient; and the one
    transient failure that a client which retries whole requests (botocore) never
    sees, since it hands the body over to be read after its retries are done."""
    _, cut = _types()
    return any(isinstance(cause, cut) for cause in causes(exc))


def storage_error(what: str, path: str, exc: BaseException, transient: bool) -> StorageError:
    hint = None
    if isinstance(exc, OSError) and exc.errno in _PERMANENT_HINTS:
        hint = _PERMANENT_HINTS[exc.errno]
    elif isinstance(exc, PermissionError) or s3_code(exc) in _DENIED_CODES or (
            http_status(exc) == 403):
        hint = "access denied: check the credentials and the bucket policy"
    elif transient:
        hint = "the storage kept failing after retries: check that it is reachable"
    cause = f"{type(exc).__name__}: {exc}"
    return StorageError(f"{what} failed ({cause})", path=path, hint=hint)
