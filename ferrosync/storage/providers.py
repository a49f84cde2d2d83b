"""What each store ferrosync names guarantees and costs: one table, read by the cost
summary (``storage/costs.py``), ``ferrosync doctor`` and docs/operations.md's store table
(a test keeps the two alike).

ferrosync needs a conditional create (checked at every connect), read-after-write and
delete visibility of a store; prices are list prices per 1,000 requests of each counted
kind (docs/operations.md#object-stores).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ferrosync.storage.engines import split_url
from ferrosync_schemes import SCHEMES, scheme

__all__ = ["Provider", "PROVIDERS", "UNKNOWN", "facts", "provider_of"]


@dataclass(frozen=True)
class Provider:
    """One kind of store: its name, the driver, and what it guarantees."""

    name: str
    driver: str
    #: the request that creates only if absent, in a few words (doctor's check names it)
    create_request: str
    conditional_create: str
    read_after_write: str
    delete_visibility: str
    #: USD per 1,000 requests by kind (put, get, delete, list); None: not billed
    prices: dict | None = None
    price_basis: str = ""
    #: what a user sets to reach an emulator or a compatible server
    emulator: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def schemes(self) -> tuple[str, ...]:
        """Its URL schemes, from the one table of schemes (``ferrosync_schemes``)."""
        return tuple(name for name, row in SCHEMES.items() if row.store == self.name)


PROVIDERS: tuple[Provider, ...] = (
    Provider(
        name="directory", driver="ferrosync (os calls)",
        create_request="os.link",
        conditional_create="`os.link` of a written temp file: EEXIST when the name exists",
        read_after_write="local: immediate; NFS: close-to-open (open() revalidates; mount "
        "with `lookupcache=positive`)",
        delete_visibility="local: immediate; NFS: with `lookupcache=positive`",
    ),
    Provider(
        name="Amazon S3", driver="s3fs",
        create_request="conditional PUT (If-None-Match: *)",
        conditional_create="PUT with `If-None-Match: *`: 412 when the key exists (AWS "
        "since 2024-08, MinIO, SeaweedFS); needs botocore >= 1.35.20",
        read_after_write="strong (AWS since 2020-12), also for overwrites",
        delete_visibility="strong: a GET after DELETE misses",
        prices={"put": 0.005, "get": 0.0004, "delete": 0.0, "list": 0.005},
        price_basis="S3 Standard, us-east-1",
        emulator="`client_kwargs={\"endpoint_url\": URL}` (moto, SeaweedFS, MinIO)",
    ),
    Provider(
        name="Google Cloud Storage", driver="gcsfs",
        create_request="insert with ifGenerationMatch=0",
        conditional_create="insert with `ifGenerationMatch=0`: 412 when the object exists",
        read_after_write="strong (global), also for overwrites",
        delete_visibility="strong: a GET after DELETE misses",
        prices={"put": 0.005, "get": 0.0004, "delete": 0.0, "list": 0.005},
        price_basis="Standard class in one region (Class A: insert, list; Class B: get); "
        "multi-region Class A is $0.01",
        emulator="`endpoint_url=URL, token=\"anon\"` (or `STORAGE_EMULATOR_HOST`): "
        "ferrosync then uses gcsfs's JSON-API driver, `gcsfs.core.GCSFileSystem`, "
        "instead of gcsfs >= 2026's default, whose gRPC bucket-layout lookups stall "
        "each upload a minute or more against an HTTP endpoint (`GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"
        "=false` before gcsfs is imported does the same)",
    ),
    Provider(
        name="Azure Blob Storage", driver="adlfs",
        create_request="Put Blob with If-None-Match: * (overwrite=False)",
        conditional_create="Put Blob with `If-None-Match: *` (adlfs: `overwrite=False`): "
        "409 BlobAlreadyExists when the blob exists",
        read_after_write="strong, also for overwrites",
        delete_visibility="strong: a GET after DELETE misses",
        prices={"put": 0.005, "get": 0.0004, "delete": 0.0, "list": 0.005},
        price_basis="block blobs, Hot tier, LRS (write and list $0.05, read $0.004 per "
        "10,000)",
        emulator="`connection_string=...;BlobEndpoint=URL/ACCOUNT;` (Azurite)",
    ),
    Provider(
        name="memory", driver="fsspec MemoryFileSystem",
        create_request="open(mode='xb')",
        conditional_create="`open(mode=\"xb\")` in this process",
        read_after_write="immediate (one process only)",
        delete_visibility="immediate (one process only)",
    ),
)

#: any other fsspec store: nothing is known until tried
UNKNOWN = Provider(
    name="other fsspec store", driver="its fsspec driver",
    create_request="pipe_file(mode='create')",
    conditional_create="`pipe_file(mode=\"create\")`; connect refuses the store unless a "
    "create of an existing name fails (fsspec's generic exists-then-write is refused)",
    read_after_write="unknown: `ferrosync doctor` measures it",
    delete_visibility="unknown: `ferrosync doctor` measures it",
)


def facts(store: Provider) -> dict:
    """``store`` as JSON (``ferrosync doctor --json``'s ``store``)."""
    return {"name": store.name, "driver": store.driver,
            "conditional_create": store.conditional_create,
            "read_after_write": store.read_after_write,
            "delete_visibility": store.delete_visibility,
            "prices_per_1000": dict(store.prices) if store.prices else None,
            "price_basis": store.price_basis or None,
            "emulator_settings": store.emulator or None}


def provider_of(url: str) -> Provider:
    """The ``Provider`` a URL names (``UNKNOWN`` for a scheme the table of schemes gives
    no store)."""
    protocol, _ = split_url(url)
    name = scheme(protocol).store
    return next((store for store in PROVIDERS if store.name == name), UNKNOWN)
