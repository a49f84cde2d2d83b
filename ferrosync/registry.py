"""URL scheme -> backend class, imported lazily.

``import ferrosync`` must stay cheap: no fsspec, s3fs or CUDA initialisation until
a URL actually needs them. A missing driver is reported with the command that
installs it (see ``storage.open_storage``).
"""

from __future__ import annotations

import importlib

from .storage import split_url

# scheme -> "module:Class"; every other scheme is a storage URL (directory or fsspec)
TORCH_SCHEMES = {
    "gloo": "ferrosync.backends.torchdist:TorchDistSync",
    "nccl": "ferrosync.backends.torchdist:TorchDistSync",
    "torch": "ferrosync.backends.torchdist:TorchDistSync",
}
STORAGE_BACKEND = "ferrosync.backends.files:FileSync"


HIERARCHICAL_BACKEND = "ferrosync.backends.hierarchical:HierarchicalSync"
#: an elastic job's member: the storage transport with membership agreed each round
ELASTIC_BACKEND = "ferrosync.elastic:connect_elastic"


def _load(target: str):
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def storage_backend():
    """The GradSync class of storage URLs: a backend that composes others (the two-level
    sync meets its node leaders through storage) asks here instead of importing it."""
    return _load(STORAGE_BACKEND)


def backend_for(url: str, options: dict | None = None):
    """The GradSync subclass serving ``url`` (validation of the URL itself is its job).

    A storage URL with ``local=...`` gets the two-level backend (nodes reduce locally,
    leaders meet through the storage).
    """
    scheme, _ = split_url(url)
    if scheme in TORCH_SCHEMES:
        return _load(TORCH_SCHEMES[scheme])
    if (options or {}).get("local") is not None:
        return _load(HIERARCHICAL_BACKEND)
    return storage_backend()


def elastic_connector(url: str, options: dict | None = None):
    """``connect_elastic`` for ``connect(url, elastic=True)``: elastic jobs run on the
    storage transport only (a directory or an object store, without ``local=``)."""
    from .errors import ConfigError

    if backend_for(url, options) is not storage_backend():
        raise ConfigError(f"elastic=True needs a storage URL (a directory or an "
                          f"object store, without local=), got {url!r}")
    return _load(ELASTIC_BACKEND)
