"""The one place ferrosync registers with torch: backend ``"ferrosync"`` and its init_methods.

torch (2.5 and later) calls every entry point of group ``torch.backends`` at the end
of ``import torch`` (``torch._import_device_backends``). ferrosync's entry point is
``autoload`` below, so an unmodified script can say
``init_process_group("ferrosync", init_method="/shared/run")`` or
``--dist-backend ferrosync`` without importing ferrosync; ``import ferrosync`` calls
``register`` too (``ferrosync.ddp.register``), for an environment without the entry
point or with the hook switched off. Nothing else in ferrosync calls torch's
registration API, and nothing this module loads imports it back.

This module is the one home of which init_methods ferrosync takes over (the backend's
name and the schemes come from the one table, ``ferrosync_schemes``, which the package
reads too):

* ``scheme://...`` for each scheme the table marks ``ddp="object"`` (``s3``, ``gs``,
  ``az``, ...) and any added with ``register_scheme``: the ranks meet in storage only;
* a bare path (``/shared/run``, torch has no handler for it), and ``file://`` naming a
  directory (``takes_over_file``: torch's own handler fails there);
* ``env://`` without ``MASTER_ADDR`` but with ``$FERROSYNC_URL`` (``takes_over_env``).

Everything else goes straight to torch's own handler: a gloo user's ``env://`` or
``file://`` store file imports nothing of ferrosync. It lives outside the ``ferrosync``
package and imports nothing of it at module level: importing the package would load
torch-heavy modules from the middle of ``import torch``. The handlers' work
(``ferrosync.ddp.init_methods``) and the backend factory (``ferrosync.ddp.factory``)
load on first use.

Every registration is idempotent and leaves a registration already there alone. The
hook swallows any exception (kept in ``last_error``): an exception here would make
``import torch`` itself fail in the whole environment, and ``import ferrosync``
retries (with a warning) anyway. Off switches: ``FERROSYNC_AUTOLOAD=0`` (this hook
only) or torch's ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (every autoloaded extension).
"""

from __future__ import annotations

import os

from ferrosync_schemes import BACKEND_NAME, ddp_object_schemes

#: set to 0 to keep ``import torch`` from registering backend "ferrosync"
ENV_SWITCH = "FERROSYNC_AUTOLOAD"
#: == ferrosync.core.env.ENV_URL (a test keeps them equal: that module is inside the package)
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
    """Register the backend and the init_method handlers with torch; False when torch
    has no torch.distributed. Idempotent; imports nothing of ferrosync."""
    import torch

    dist = torch.distributed
    if not dist.is_available():
        return False
    if not hasattr(dist.Backend, BACKEND_NAME.upper()):
        dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True,
                                      devices=["cpu", "cuda"])
    table = _rendezvous()._rendezvous_handlers
    if "" not in table:
        _rendezvous().register_rendezvous_handler("", _local_handler)
    for scheme in ddp_object_schemes():
        register_scheme(scheme)
    for scheme, takes_over in TAKES_OVER.items():
        current = table.get(scheme)
        if current is not None and not hasattr(current, "ferrosync_wraps"):
            # torch refuses a second handler for a scheme: the wrapper replaces its entry
            table[scheme] = _wrapper(scheme, takes_over, current)
    return True


def register_scheme(scheme: str) -> bool:
    """Accept ``scheme://bucket/prefix`` as an init_method naming an fsspec location.

    Returns False when a handler for ``scheme`` exists already (it is kept).
    """
    rendezvous = _rendezvous()
    if scheme in rendezvous._rendezvous_handlers:
        return False
    rendezvous.register_rendezvous_handler(scheme, _object_store_handler)
    return True


def _rendezvous():
    import importlib

    # the module, not the function torch.distributed re-exports under the same name
    return importlib.import_module("torch.distributed.rendezvous")


# -- which init_methods are ferrosync's own -------------------------------------------------
#
# Only what torch itself would reject: everything else goes to torch's handler directly,
# without importing anything of ferrosync.

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


#: torch's own handlers that ferrosync wraps, with the rule for what it takes over
TAKES_OVER = {"file": takes_over_file, "env": takes_over_env}


def _handlers():
    from ferrosync.ddp import init_methods

    return init_methods


def _create_backend(backend_opts, pg_options):
    from ferrosync.ddp.factory import create_backend

    return create_backend(backend_opts, pg_options)


def _local_handler(url: str, **kwargs):
    yield from _handlers().local_handler(url, **kwargs)


def _object_store_handler(url: str, **kwargs):
    yield from _handlers().object_store_handler(url, **kwargs)


def _wrapper(scheme: str, takes_over, torch_handler):
    """torch's ``scheme`` handler, except for URLs ferrosync takes over, which go to
    ``init_methods.<scheme>_handler``."""

    def handler(url: str, **kwargs):
        if takes_over(url):
            yield from getattr(_handlers(), f"{scheme}_handler")(url, **kwargs)
        else:
            yield from torch_handler(url, **kwargs)

    handler.ferrosync_wraps = torch_handler
    return handler
