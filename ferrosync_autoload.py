"""torch's autoload hook for ferrosync: backend ``"ferrosync"`` without ``import ferrosync``.

torch (2.5 and later) calls every entry point of group ``torch.backends`` at the end
of ``import torch`` (``torch._import_device_backends``). ferrosync's entry point is
``autoload`` below, so an unmodified script can say
``init_process_group("ferrosync", init_method="/shared/run")`` or
``--dist-backend ferrosync`` without importing ferrosync.

This module lives outside the ``ferrosync`` package on purpose: importing a module
inside it would run ``ferrosync/__init__.py`` (which imports torch) from the middle
of ``import torch``. It imports nothing but torch (already half-imported when the
hook runs) and registers thin wrappers that import ``ferrosync.ddp`` on first use:

* the backend factory (``ferrosync.ddp.factory.create_backend``);
* the init_method handlers of ``ferrosync.ddp.init_methods``: bare paths, the
  object-store schemes, and torch's ``file://`` and ``env://`` handlers wrapped so
  they only change what torch itself would reject. What they take over is decided
  here (``takes_over_env``, ``takes_over_file``) without importing ferrosync: a
  plain gloo ``env://`` or ``file://`` rendezvous imports nothing of it.

Every registration is idempotent and leaves a registration already there alone;
``import ferrosync`` afterwards sees them and registers nothing twice. Any
exception is swallowed (kept in ``last_error``): an exception here would make
``import torch`` itself fail in the whole environment, and ``import ferrosync``
retries (with a warning) anyway.

Off switches: ``FERROSYNC_AUTOLOAD=0`` (this hook only) or torch's
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (every autoloaded extension).
"""

from __future__ import annotations

import os

#: set to 0 to keep ``import torch`` from registering backend "ferrosync"
ENV_SWITCH = "FERROSYNC_AUTOLOAD"
BACKEND_NAME = "ferrosync"  # == ferrosync.ddp.BACKEND_NAME
#: == ferrosync.ddp.init_methods.OBJECT_SCHEMES (a test keeps them equal): that module
#: cannot be imported from here without importing the ferrosync package
OBJECT_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "oci",
                  "hdfs", "webhdfs")
#: torch handlers that ferrosync wraps: scheme -> factory name in init_methods
WRAPPED = {"file": "_file_handler", "env": "_env_handler"}
#: == ferrosync.env.ENV_URL
ENV_URL = "FERROSYNC_URL"

#: the exception that stopped the last ``autoload`` (None: it registered, or was off)
last_error: BaseException | None = None


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def autoload() -> None:
    """The ``torch.backends`` entry point. Never raises."""
    global last_error
    try:
        if enabled():
            register()
        last_error = None
    except Exception as exc:  # never break `import torch`
        last_error = exc


def register() -> bool:
    """Register the lazy backend and handlers; False when torch has no torch.distributed."""
    import importlib

    import torch

    dist = torch.distributed
    if not dist.is_available():
        return False
    if not hasattr(dist.Backend, BACKEND_NAME.upper()):
        dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True,
                                      devices=["cpu", "cuda"])
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    table = rendezvous._rendezvous_handlers
    if "" not in table:
        rendezvous.register_rendezvous_handler("", _local_handler)
    for scheme in OBJECT_SCHEMES:
        if scheme not in table:
            rendezvous.register_rendezvous_handler(scheme, _object_store_handler)
    for scheme, factory in WRAPPED.items():
        current = table.get(scheme)
        if current is not None and not hasattr(current, "ferrosync_wraps"):
            table[scheme] = _lazy_wrapper(factory, current)
    return True


# -- which init_methods are ferrosync's own (the one home of these rules) -----------------
#
# ferrosync only takes over what torch itself would reject; everything else goes to
# torch's handler directly, without importing anything of ferrosync: a gloo user's
# ``init_process_group("gloo", "env://")`` costs what it costs without ferrosync.

def takes_over_env(url: str) -> bool:
    """``env://`` is ferrosync's only without ``MASTER_ADDR`` (where torch fails) and
    with ``$FERROSYNC_URL`` set."""
    return not os.environ.get("MASTER_ADDR") and bool(os.environ.get(ENV_URL, "").strip())


def takes_over_file(url: str) -> bool:
    """``file://`` is ferrosync's only when it names a directory (or ends in ``/``),
    where torch's FileStore fails ("Is a directory")."""
    from urllib.parse import urlsplit

    path = urlsplit(url).path
    return bool(path) and (path.endswith("/") or os.path.isdir(path))


TAKES_OVER = {"file": takes_over_file, "env": takes_over_env}


def _init_methods():
    import importlib

    return importlib.import_module("ferrosync.ddp.init_methods")


def _create_backend(backend_opts, pg_options):
    from ferrosync.ddp.factory import create_backend

    return create_backend(backend_opts, pg_options)


def _local_handler(url: str, **kwargs):
    yield from _init_methods()._local_handler(url, **kwargs)


def _object_store_handler(url: str, **kwargs):
    yield from _init_methods()._object_store_handler(url, **kwargs)


def _lazy_wrapper(factory: str, torch_handler):
    """torch's handler wrapped by ``init_methods.<factory>``, built on first use: a URL
    ferrosync does not take over (``TAKES_OVER``) goes straight to torch's handler,
    and nothing of ferrosync is imported for it."""
    scheme = next(k for k, v in WRAPPED.items() if v == factory)

    def handler(url: str, **kwargs):
        if not TAKES_OVER[scheme](url):
            yield from torch_handler(url, **kwargs)
            return
        yield from getattr(_init_methods(), factory)(torch_handler)(url, **kwargs)

    handler.ferrosync_wraps = torch_handler
    return handler
