"""Servers and proxies for tests and benchmarks, on loopback only (never imported by
``import ferrosync``; every module imports only the standard library at module level):
``seaweed`` (SeaweedFS, a real S3 server), ``emulators`` (fake-gcs-server, Azurite),
``wan_proxy`` (a slow, distant link: ``python -m ferrosync.testing.wan_proxy``),
``fault_proxy`` (lost replies, cut bodies, resets, 503s: ``python -m
ferrosync.testing.fault_proxy``). ``faults`` (the storage-level fault layer,
``$FERROSYNC_FAULTS``) and the ``sim`` package are the exceptions to the
standard-library rule: they wrap or run ferrosync's own code (the simulator: the
elastic code, and torch, on a simulated store and clock, ``tools/elastic_sim.py``)."""
