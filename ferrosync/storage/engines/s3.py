"""S3 specifics: ``S3Storage`` (an ``FsspecStorage`` over s3fs whose exclusive create is
one conditional PUT, ``If-None-Match: *``), and the botocore settings ``open_s3`` gives
s3fs: one retry layer bounded by ``connect``'s timeout, botocore's redundant checksums
off, no payload hash over TLS, no ``Expect: 100-continue``; first-contact errors say
which endpoint was tried and where its address came from.
"""

from __future__ import annotations

import errno
import os
import time

from ferrosync.errors import ConfigError
from ferrosync.storage.engines.base import ExclusiveCreateUnsupported
from ferrosync.storage.engines.classify import cut_short, s3_code
from ferrosync.storage.engines.fsspec_store import (
    FsspecStorage,
    build,
    driver_class,
    precondition_failed,
)
from ferrosync.storage.engines.parts import DEFAULT_CONCURRENCY, ViewsBody

#: the most of a streamed GET body copied into its destination at once
_CHUNK = 1 << 20
#: what to check when an S3 endpoint does not answer
_ENDPOINT_HINT = ("check the endpoint: storage_options endpoint_url, or $AWS_ENDPOINT_URL / "
                  "$AWS_ENDPOINT_URL_S3 (for a local server such as MinIO or SeaweedFS), "
                  "and that the server is running and reachable from this host")


class S3Storage(FsspecStorage):
    """An s3:// or s3a:// store through s3fs."""

    _credentials_hint = (
        "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for "
        "temporary ones), or AWS_PROFILE, or pass storage_options key/secret (anon=True "
        "for a public bucket)")
    _unreachable_hint = _ENDPOINT_HINT
    #: retries of a conditional PUT that AWS answered 409 ConditionalRequestConflict
    _CONFLICT_RETRIES = 4
    _if_none_match: bool | None = None  # whether botocore can send it (checked once)

    def __init__(self, url: str, fs, root: str) -> None:
        #: s3fs: ``put(exclusive=True)`` is one conditional PUT (``If-None-Match: *``)
        self._conditional_put = hasattr(fs, "call_s3")
        super().__init__(url, fs, root)

    def _create_if_absent(self, key: str, path: str, data: bytes) -> None:
        """Create ``path`` only if absent: one PUT with ``If-None-Match: *``.

        The server answers 412 Precondition Failed when the key exists (AWS S3 since
        2024-08, MinIO, SeaweedFS, moto); that is ``FileExistsError`` (which
        ``Storage.exclusive_create`` checks for our own bytes: a PUT that landed and whose reply
        was lost is resent by aiohttp or botocore, and answered 412). AWS answers 409
        ConditionalRequestConflict while a concurrent conditional write of the key is
        in flight: retried here, a few times.

        Called through s3fs's ``call_s3`` rather than ``pipe_file(mode="create")``:
        the same request on every s3fs version, and s3fs's own translation maps a 412
        without AWS's ``Condition`` field (SeaweedFS, MinIO) to EINVAL, not EEXIST.
        """
        if not self._botocore_has_if_none_match():
            raise ExclusiveCreateUnsupported(
                "exclusive create needs conditional writes (If-None-Match), which this "
                "botocore cannot send", path=self.path_of(key),
                hint="upgrade botocore to 1.35.20 or newer (pip install -U s3fs botocore)")
        bucket, name, _ = self.fs.split_path(path)
        delay = 0.05
        for attempt in range(self._CONFLICT_RETRIES + 1):
            try:
                self.fs.call_s3("put_object", Bucket=bucket, Key=name, Body=data,
                                IfNoneMatch="*")
                return
            except Exception as exc:  # s3fs translates ClientError: look at the cause; re-raised
                if precondition_failed(exc):
                    raise FileExistsError(errno.EEXIST, "the object exists already",
                                          self.path_of(key)) from None
                if s3_code(exc) != "ConditionalRequestConflict" or (
                        attempt == self._CONFLICT_RETRIES):
                    raise
                time.sleep(delay)
                delay *= 2
            finally:
                self.fs.invalidate_cache(path)

    def _write_part(self, key: str, pieces: list) -> None:
        """One part's PUT with a body read straight out of the caller's buffers
        (``ViewsBody``): botocore and aiohttp stream it, so a part in flight is not
        copied, neither into ``bytes`` nor into the socket's send buffer (where a
        ``bytes`` body waits whole while a slow connection drains it)."""
        if not self._conditional_put:  # not s3fs: the driver's own write
            super()._write_part(key, pieces)
            return
        path = self.fs_path(key)
        bucket, name, _ = self.fs.split_path(path)

        def put() -> None:
            with ViewsBody(pieces) as body:
                self.fs.call_s3("put_object", Bucket=bucket, Key=name, Body=body)
            self.fs.invalidate_cache(path)

        self.retry("writing", key, put)

    def _get_into(self, key: str, start: int, view: memoryview, extra: int) -> int:
        """One ranged GET whose body is streamed into ``view`` chunk by chunk (at most
        ``_CHUNK`` bytes at a time on the client's event loop), never held whole: a part
        in flight costs its destination only. A body cut short is retried here
        (``_retryable``) and refills ``view`` from its start."""
        if not self._conditional_put:  # not s3fs: the driver's own read
            return super()._get_into(key, start, view, extra)
        from fsspec.asyn import sync

        bucket, name, _ = self.fs.split_path(self.fs_path(key))
        return self.retry("reading", key, sync, self.fs.loop, self._stream_into,
                           bucket, name, start, view, extra)

    async def _stream_into(self, bucket: str, name: str, start: int, view: memoryview,
                           extra: int) -> int:
        """The GET itself, on s3fs's event loop: bytes the object had (``_get_into``)."""
        ask = view.nbytes + extra
        reply = await self.fs._call_s3("get_object", Bucket=bucket, Key=name,
                                       Range=f"bytes={start}-{start + ask - 1}")
        body = reply["Body"]
        try:
            filled = 0
            while True:
                # at most one byte past the view: a longer object is refused, not read
                chunk = await body.read(max(1, min(_CHUNK, view.nbytes - filled)))
                if not chunk:
                    return filled
                if filled + len(chunk) > view.nbytes:
                    return filled + len(chunk)
                view[filled:filled + len(chunk)] = chunk
                filled += len(chunk)
        finally:
            body.close()

    def _retryable(self, exc: BaseException) -> bool:
        """botocore is the retry layer for whole requests (connection errors, 5xx,
        SlowDown, within ``connect``'s timeout: ``_s3_settings``): retrying what it gave
        up on would multiply the layers. What it cannot retry is a body cut after it
        returned the response (s3fs reads the stream outside botocore's retry): that
        is ours."""
        return cut_short(exc)

    @classmethod
    def _botocore_has_if_none_match(cls) -> bool:
        """Whether the installed botocore knows PutObject's IfNoneMatch (1.35.20+): s3fs
        silently drops parameters its botocore does not know, which would turn an
        exclusive create into an overwrite."""
        if cls._if_none_match is None:
            S3Storage._if_none_match = _botocore_knows("PutObject", "IfNoneMatch")
        return bool(cls._if_none_match)


def _botocore_knows(operation: str, parameter: str) -> bool:
    """Whether the installed botocore's S3 model has ``parameter`` in ``operation``."""
    try:
        import botocore.exceptions
        import botocore.model
        import botocore.session
    except ImportError:
        return False
    try:
        model = botocore.session.get_session().get_service_model("s3")
        members = model.operation_model(operation).input_shape.members
    except (botocore.exceptions.BotoCoreError, botocore.model.OperationNotFoundError):
        # no S3 model in this botocore (DataNotFoundError), or no such operation:
        # treat as unsupported
        return False
    return parameter in members


def _s3_settings(storage_options: dict, timeout: float | None) -> None:
    """botocore settings for s3fs, in ``storage_options`` (the user's own win).

    One retry layer, not three multiplied (botocore x s3fs x ours took 2 minutes to
    report a dead endpoint): botocore's adaptive mode backs off on 503 SlowDown and
    connection errors; s3fs and ferrosync then try once. With ``timeout`` its connect
    and read timeouts and its attempts fit in it: a closed port or an unreachable
    endpoint is reported within ``connect``'s timeout, not after botocore's defaults.
    """
    connect_s, read_s, attempts = 5.0, 60.0, 5
    if timeout is not None and timeout > 0:
        connect_s = min(connect_s, max(0.5, timeout / 4))
        read_s = min(read_s, max(1.0, timeout))
        attempts = 5 if timeout >= 60 else 3 if timeout >= 15 else 2
    config = dict(storage_options.get("config_kwargs") or {})
    config.setdefault("retries", {"mode": "adaptive", "max_attempts": attempts})
    config.setdefault("connect_timeout", connect_s)
    config.setdefault("read_timeout", read_s)
    # botocore's pool holds 10 connections: fewer than one object's parts in flight
    # (``parts.DEFAULT_CONCURRENCY``), and a gather reads several objects at once
    config.setdefault("max_pool_connections", 4 * DEFAULT_CONCURRENCY)
    for key, value in _redundant_checksums_off().items():
        config.setdefault(key, value)
    if _s3_endpoint_uses_tls(storage_options):
        s3_config = dict(config.get("s3") or {})
        s3_config.setdefault("payload_signing_enabled", False)
        config["s3"] = s3_config
    storage_options["config_kwargs"] = config
    if "session" not in storage_options:
        storage_options["session"] = _s3_session_without_expect_continue()


def _s3_endpoint(storage_options: dict) -> str:
    """The S3 endpoint ``storage_options`` (or the environment) point s3fs at, in
    words, for error messages."""
    client = storage_options.get("client_kwargs") or {}
    for name, value in (("endpoint_url", storage_options.get("endpoint_url")),
                        ("client_kwargs endpoint_url", client.get("endpoint_url")),
                        ("$AWS_ENDPOINT_URL_S3", os.environ.get("AWS_ENDPOINT_URL_S3")),
                        ("$AWS_ENDPOINT_URL", os.environ.get("AWS_ENDPOINT_URL"))):
        if value:
            return f"{value} (from {name})"
    return "AWS S3 itself (no endpoint_url, $AWS_ENDPOINT_URL_S3 or $AWS_ENDPOINT_URL set)"


def _redundant_checksums_off() -> dict:
    """botocore settings that skip its own CRC of every request and response body
    where S3 does not require one.

    Every object ferrosync writes carries its own checksum (xxh3) or MAC over the
    whole payload, verified by every reader before a byte is used (``wire``), so
    botocore's CRC (default since botocore 1.36) only costs CPU on the ranks' cores:
    a 16 MiB PUT took 25-27 ms of client CPU with it, 18 ms without, and a 16 MiB GET
    31-32 ms against 16-17 ms (SeaweedFS on loopback). Operations S3 requires a
    checksum for still get one. Empty on a botocore without these settings."""
    from botocore.config import Config

    keys = ("request_checksum_calculation", "response_checksum_validation")
    return {k: "when_required" for k in keys if k in Config.OPTION_DEFAULTS}


def _s3_endpoint_uses_tls(storage_options: dict) -> bool:
    """Whether the S3 endpoint ``storage_options`` reach speaks HTTPS, so botocore's
    SHA-256 of every request body can be skipped (``payload_signing_enabled``).

    botocore signs each PUT's body unless the request goes over HTTPS *and* carries a
    checksum header; with its CRC off (``_redundant_checksums_off``) it hashes every
    body again, 8 ms of client CPU per 16 MiB (SeaweedFS on loopback, signed 16.7 ms
    against unsigned 8.9-9.2 ms a PUT). Over TLS the body cannot be changed in transit,
    and every reader checks ferrosync's own checksum or MAC, so the hash buys nothing.
    Over plain HTTP the signature is what guards the body in transit: it stays.

    HTTPS: an explicit endpoint (s3fs's ``endpoint_url``, ``client_kwargs``'s, or
    ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``) that starts with ``https://``, or
    none at all (AWS itself, over TLS unless ``use_ssl`` is off).
    """
    client = storage_options.get("client_kwargs") or {}
    endpoint = (storage_options.get("endpoint_url") or client.get("endpoint_url")
                or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
    if endpoint:
        return str(endpoint).strip().lower().startswith("https://")
    return client.get("use_ssl", storage_options.get("use_ssl", True)) is not False


def _s3_session_without_expect_continue():
    """An aiobotocore session whose S3 clients never send ``Expect: 100-continue``.

    botocore adds the header to every PUT with a file-like body, and the client then
    waits for the server's ``100 Continue`` before sending the body: one more round
    trip per PUT. Through a 50 ms-RTT link a small PUT took 105 ms with it, 54 ms
    without (ferrosync/testing/wan_proxy.py, docs/goodput.md). What it would save, a rejected
    upload's bytes, does not apply to objects this small or this often written. A
    session given in ``storage_options`` is used as it is.
    """
    from aiobotocore.session import get_session
    from botocore.handlers import add_expect_header

    session = get_session()
    session.unregister("before-call.s3", add_expect_header)
    return session


def open_s3(url: str, protocol: str, rest: str, storage_options: dict,
            timeout: float | None) -> S3Storage:
    """s3:// and s3a://: s3fs with ``_s3_settings``; s3fs tries once, botocore retries
    requests (one layer, within ``timeout``), ferrosync only bodies cut short."""
    cls = driver_class(url, protocol)  # first: what follows imports botocore
    endpoint = _s3_endpoint(storage_options)
    try:
        _s3_settings(storage_options, timeout)
    except ImportError as exc:  # s3fs without botocore/aiobotocore
        raise ConfigError(
            f"the {protocol}:// driver is incomplete ({type(exc).__name__}: {exc})",
            path=url, hint="pip install 'ferrosync[s3]'") from None
    storage = build(url, protocol, cls, storage_options, timeout, S3Storage)
    storage.endpoint = endpoint
    if hasattr(storage.fs, "retries"):
        # s3fs's own loop: a single attempt; botocore retries requests, ferrosync a body
        # cut short (S3Storage._retryable)
        storage.fs.retries = 1
    return storage
