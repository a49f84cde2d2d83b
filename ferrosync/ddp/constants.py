"""Names the ``"ferrosync"`` torch.distributed backend is known by.

Their own module so that ``ddp/__init__.py`` (which loads ``process_group`` on first use)
and ``process_group.py`` (which needs them) do not import each other.
"""

from ferrosync_schemes import BACKEND_NAME  # noqa: F401 - the one home of the name

#: JSON object of ``ferrosync.connect`` options for the backend, merged under ``pg_options``
ENV_PG_OPTIONS = "FERROSYNC_PG_OPTIONS"
