"""What storage requests cost: rates per hour and the bill at object-store list prices.

On an object store the request bill can exceed the compute bill (a heartbeat every 2 s
is 1,800 PUTs per rank per hour), so the summary, ``FINAL`` and ``ferrosync inspect``
show requests per hour and their cost, in USD per 1,000 requests of each billed kind:
each store's list prices (``providers.PROVIDERS``), or the user's
(``--storage-prices put=...,get=...``; docs/operations.md#what-a-run-costs-so-far).
"""

from __future__ import annotations

from ferrosync.core.validate import choice, number
from ferrosync.storage.engines import split_url
from ferrosync.storage.providers import provider_of
from ferrosync_schemes import scheme

#: USD per 1,000 requests, by kind (S3 Standard list prices, us-east-1)
DEFAULT_PRICES = dict(provider_of("s3://").prices)
_COUNTER_OF = {"put": "puts", "get": "gets", "delete": "deletes", "list": "lists"}


def default_prices(url: str | None) -> dict[str, float]:
    """The list prices of the store ``url`` names (``providers.PROVIDERS``); S3's where it
    names none with prices (no URL, an unknown scheme, a directory)."""
    prices = provider_of(url).prices if url else None
    return dict(prices or DEFAULT_PRICES)


def parse_prices(text: str | dict | None, url: str | None = None) -> dict[str, float]:
    """``"put=0.005,get=0.0004"`` (or a dict) over the defaults for ``url``'s store
    (``default_prices``); ``ConfigError`` on an unknown kind or a value that is not a
    number >= 0."""
    prices = default_prices(url)
    if text is None:
        return prices
    items = text.items() if isinstance(text, dict) else (
        part.split("=", 1) if "=" in part else (part, None)
        for part in str(text).split(",") if part.strip())
    for kind, value in items:
        kind = str(kind).strip().lower()
        choice("storage price kind", kind, DEFAULT_PRICES,
               hint="use put=, get=, delete=, list= (USD per 1,000 requests)")
        try:
            price = float(value)
        except (TypeError, ValueError):
            price = value  # refused below, shown as given
        prices[kind] = number(f"storage price {kind}", price, minimum=0.0,
                              hint="USD per 1,000 requests, e.g. put=0.005,get=0.0004")
    return prices


def request_cost(counts: dict, prices: dict[str, float] | None = None) -> float:
    """USD for ``counts`` (``{"puts": n, "gets": n, ...}``) at ``prices``."""
    prices = prices or DEFAULT_PRICES
    return sum(counts.get(_COUNTER_OF[kind], 0) * price / 1000.0
               for kind, price in prices.items())


def hourly(counts: dict, seconds: float, prices: dict[str, float] | None,
           *, billed: bool) -> dict:
    """``requests_per_hour`` and, on a billed store (``billed``), the
    ``request_cost_per_hour`` in USD at ``prices``; None where nothing can be said."""
    if not seconds > 0:
        return {"requests_per_hour": None, "request_cost_per_hour": None}
    scale = 3600.0 / seconds
    return {
        "requests_per_hour": counts.get("requests", 0) * scale,
        "request_cost_per_hour": request_cost(counts, prices) * scale if billed else None,
    }


#: the torch.distributed transports' URL schemes: their requests are collective calls
_TRANSPORTS = ("gloo", "nccl", "torch")


def request_noun(url: str) -> str:
    """What one counted request is at ``url``, as the summaries name it: a billed
    ``"storage requests"`` on an object store, ``"file operations"`` on a directory
    (open, write and rename, unlink: not billed), ``"collective calls"`` on a
    torch.distributed transport."""
    protocol, _ = split_url(url)
    if protocol in _TRANSPORTS:
        return "collective calls"
    return "file operations" if scheme(protocol).store == "directory" else "storage requests"


def is_billed(url: str) -> bool:
    """Whether ``url`` is an object store that bills requests (not a directory, an
    in-memory store or a torch.distributed transport)."""
    protocol, _ = split_url(url)
    return request_noun(url) == "storage requests" and scheme(protocol).store != "memory"
