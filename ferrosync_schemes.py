"""ferrosync's URL schemes: one table, in the style of fsspec's ``known_implementations``.

Each scheme says which engine opens it (``opener``, a ``"module:function"`` string
imported on first use), the fsspec protocol behind it, the ``pip install`` that adds a
missing driver (``install``), which store it is (``store``: a ``ferrosync.storage.providers.STORES``
name, for guarantees and prices) and whether the ``"ferrosync"`` torch.distributed
backend takes it over as an ``init_method`` (``ddp``: ``"object"`` for object-store
URLs, whose ranks meet in storage only; ``"directory"`` for ``file://`` naming a
directory, which torch's own handler rejects). Read by ``ferrosync.storage.engines``
(``open_storage``), ``ferrosync.storage.providers``, the driver hints of
``ferrosync.storage.engines.fsspec_store`` and the torch hook (``ferrosync_autoload``).

Beside the schemes, the name the torch backend is registered under (``BACKEND_NAME``):
the registrar and the package both need it, and this is the module both can import.

A top-level module of its own, importing nothing: the torch hook reads it while
``import torch`` runs, where importing the ``ferrosync`` package would load torch-heavy
modules (and ``ferrosync.storage.engines`` reads it without importing the hook).
"""

from __future__ import annotations

from typing import NamedTuple

#: the torch.distributed backend's name (registered by ``ferrosync_autoload.register``)
BACKEND_NAME = "ferrosync"


class Scheme(NamedTuple):
    """One URL scheme (see the module docstring)."""

    opener: str
    protocol: str
    install: str | None = None
    store: str | None = None
    ddp: str | None = None
    #: the part before ``@`` names a container, not a user (adlfs'
    #: ``abfs://container@account``, ocifs' ``oci://bucket@namespace``); in any other
    #: scheme it is a user name or a token, hidden and refused (``ferrosync.errors.redact``)
    at_container: bool = False


_LOCAL = "ferrosync.storage.engines.local:open_local"
_S3 = "ferrosync.storage.engines.s3:open_s3"
_GCS = "ferrosync.storage.engines.fsspec_store:open_gcs"
#: the opener of any fsspec URL without a row here (``memory://``, a registered driver)
FSSPEC = "ferrosync.storage.engines.fsspec_store:open_fsspec"

SCHEMES: dict[str, Scheme] = {
    "file": Scheme(_LOCAL, "file", store="directory", ddp="directory"),
    "local": Scheme(_LOCAL, "file", store="directory"),
    "s3": Scheme(_S3, "s3", "pip install 'ferrosync[s3]'", "Amazon S3", "object"),
    "s3a": Scheme(_S3, "s3a", "pip install 'ferrosync[s3]'", "Amazon S3", "object"),
    "gs": Scheme(_GCS, "gs", "pip install gcsfs", "Google Cloud Storage", "object"),
    "gcs": Scheme(_GCS, "gcs", "pip install gcsfs", "Google Cloud Storage", "object"),
    "az": Scheme(FSSPEC, "az", "pip install adlfs", "Azure Blob Storage", "object",
                  at_container=True),
    "abfs": Scheme(FSSPEC, "abfs", "pip install adlfs", "Azure Blob Storage", "object",
                  at_container=True),
    "abfss": Scheme(FSSPEC, "abfss", "pip install adlfs", "Azure Blob Storage", "object",
                  at_container=True),
    "adl": Scheme(FSSPEC, "adl", "pip install adlfs", ddp="object"),
    "oss": Scheme(FSSPEC, "oss", "pip install ossfs", ddp="object"),
    "oci": Scheme(FSSPEC, "oci", "pip install ocifs", ddp="object", at_container=True),
    "hdfs": Scheme(FSSPEC, "hdfs", "pip install pyarrow", ddp="object"),
    "webhdfs": Scheme(FSSPEC, "webhdfs", "pip install requests", ddp="object"),
    "memory": Scheme(FSSPEC, "memory", store="memory"),
}


def scheme(protocol: str) -> Scheme:
    """The row of ``protocol``; any other is an fsspec driver's (``FSSPEC``)."""
    return SCHEMES.get(protocol) or Scheme(FSSPEC, protocol)


def ddp_object_schemes() -> tuple[str, ...]:
    """The schemes the torch backend accepts as object-store ``init_method`` URLs."""
    return tuple(name for name, row in SCHEMES.items() if row.ddp == "object")
