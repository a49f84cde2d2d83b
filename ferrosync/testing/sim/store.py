"""A simulated object store with an object store's documented behaviour, and the
``Storage`` each simulated member reaches it through.

``SimServer`` holds the bucket and models, per ``Profile`` (``PROFILES``): conditional
creates (412, and 409 for two in flight), latency and per-connection bandwidth, request
rates per partitioned prefix (503 SlowDown, the rate doubled after ``ramp_s``), GCS's
one write per second per name, lost replies and cut bodies. ``scale`` counts data
objects at the simulated payload's size. Profiles and their sources:
docs/elastic.md#simulation.
"""

from __future__ import annotations

import bisect
import math
import random
import re
from collections import defaultdict, deque
from dataclasses import dataclass

from ferrosync.storage.engines.base import BytesReader, Storage
from ferrosync.testing.sim.scheduler import SimKilled

_Z99 = 2.3263478740408408  # the standard normal's 99th percentile

#: keys that carry a payload (their bytes count ``scale`` times): a contribution, a
#: tree's pieces and results, a published state's parts
DATA_KEY = re.compile(r"(^|/)(r\d+\.([0-9a-f]{16}|t\d+\..*|m\..*)|state\..*)$")


@dataclass(frozen=True)
class Profile:
    """An object store's documented behaviour, as the simulator models it.

    Latencies in seconds (first byte: median and 99th percentile of a lognormal),
    ``bandwidth`` bytes/s per connection, ``put_rate``/``get_rate`` requests/s per
    partitioned prefix (None: no limit), ``ramp_s`` the sustained throttling after
    which a prefix's rates double (the store split it in two), ``object_write_rate``
    writes/s per object name (None: no limit), ``prefix_depth`` the '/'-separated
    components of a key that name its partition (0: the whole bucket is one; None: the
    key's whole directory, each shard directory of an elastic job its own partition),
    prices per 1,000 requests.

    S3 partitions a bucket by key range, at any character, and splits a partition under
    sustained load (503 SlowDown meanwhile; 30 to 60 minutes by accounts outside AWS's
    documentation, or ahead of time on request to AWS support). ``s3`` models a job
    past that warm-up: its namespace split at the shard directories
    (``names.elastic_shard``), each shard a partition of 3,500 PUT/s; ``s3cold`` a
    fresh bucket: the job's namespace one partition, split in two after each ``ramp_s``
    of throttling (docs/elastic.md, "Prefixes").
    """

    name: str
    put_median: float
    put_p99: float
    get_median: float
    get_p99: float
    bandwidth: float
    put_rate: float | None
    get_rate: float | None
    ramp_s: float
    object_write_rate: float | None
    prefix_depth: int | None
    prices: tuple[tuple[str, float], ...]
    lost_reply: float = 0.0
    cut_body: float = 0.0


_S3_PRICES = (("put", 0.005), ("get", 0.0004), ("delete", 0.0), ("list", 0.005))

PROFILES = {
    # S3 Standard: 3,500 PUT/COPY/POST/DELETE and 5,500 GET/HEAD per second per
    # partitioned prefix, scaling gradually (503 SlowDown meanwhile); first-byte
    # latency of small objects tens of ms (p99 hundreds); ~90 MB/s per connection.
    # Partitions: every directory its own (a job past S3's warm-up: see Profile)
    "s3": Profile("s3", 0.030, 0.250, 0.020, 0.200, 90e6, 3500.0, 5500.0, 600.0, None,
                  None, _S3_PRICES, lost_reply=0.001, cut_body=0.001),
    # S3 Standard on a fresh bucket: the first component of a key (the job's
    # namespace) one partition, split after 30 minutes of throttling (reported: 30-60)
    "s3cold": Profile("s3cold", 0.030, 0.250, 0.020, 0.200, 90e6, 3500.0, 5500.0, 1800.0,
                      None, 1, _S3_PRICES, lost_reply=0.001, cut_body=0.001),
    # S3 Express One Zone (directory buckets): single-digit ms latency, rates per
    # bucket (200,000 reads and 100,000 writes per second)
    "s3express": Profile("s3express", 0.004, 0.020, 0.003, 0.015, 90e6, 100000.0,
                         200000.0, 600.0, None, 0,
                         (("put", 0.00113), ("get", 0.00003), ("delete", 0.0),
                          ("list", 0.00113)), lost_reply=0.001, cut_body=0.001),
    # GCS: 1 write per second per object name; a bucket starts at ~1,000 writes and
    # 5,000 reads per second and doubles every 20 minutes of sustained load
    "gcs": Profile("gcs", 0.040, 0.300, 0.030, 0.250, 90e6, 1000.0, 5000.0, 1200.0, 1.0,
                   0, (("put", 0.005), ("get", 0.0004), ("delete", 0.0), ("list", 0.005)),
                   lost_reply=0.001, cut_body=0.001),
    # loopback (SeaweedFS on this machine): for comparison with tools/bench/elastic_costs.py
    "loopback": Profile("loopback", 0.002, 0.010, 0.001, 0.006, 1e9, None, None, 0.0,
                        None, 0, _S3_PRICES),
}


class SimHTTPError(OSError):
    """An error reply as botocore shapes it (``classify`` reads code and status)."""

    def __init__(self, status: int, code: str, key: str) -> None:
        super().__init__(f"{status} {code}: {key}")
        self.response = {"Error": {"Code": code},
                         "ResponseMetadata": {"HTTPStatusCode": status}}


class LostReply(TimeoutError):
    """The server acted; its reply never came (the client times out and resends)."""


class _Prefix:
    """One partitioned prefix's recent requests and its current rate multiplier."""

    __slots__ = ("puts", "gets", "scale", "throttled_since", "throttled_last", "peak_put")

    def __init__(self) -> None:
        self.puts: deque = deque()
        self.gets: deque = deque()
        self.scale = 1.0
        self.throttled_since: float | None = None
        self.throttled_last = 0.0
        self.peak_put = 0


class SimServer:
    """The simulated bucket (see the module docstring)."""

    def __init__(self, sched, profile: Profile, seed: int, *, scale: float = 1.0) -> None:
        self.sched = sched
        self.profile = profile
        self.scale = scale
        self._rng = random.Random(seed)
        self.objects: dict[str, bytes] = {}
        self.created: dict[str, float] = {}  # key -> virtual time of its latest write
        self._inflight: set[str] = set()  # exclusive creates under way
        self._prefixes: dict[str, _Prefix] = defaultdict(_Prefix)
        self._last_write: dict[str, float] = {}
        self.slowdowns = 0
        self.requests: dict[str, int] = defaultdict(int)
        self.peak_prefix_put_rate = 0
        self.lost_replies = 0
        self.cut_bodies = 0
        p = profile
        #: (median, sigma) of the first-byte lognormal: [0] a read's, [1] a write's
        self._latency = tuple((median, math.log(p99 / median) / _Z99) for median, p99 in
                              ((p.get_median, p.get_p99), (p.put_median, p.put_p99)))

    # -- the model ---------------------------------------------------------------------
    def first_byte(self, kind: str) -> float:
        median, sigma = self._latency[kind == "put"]
        return median * math.exp(sigma * self._rng.gauss(0.0, 1.0))

    def modelled(self, key: str, size: int) -> int:
        return int(size * self.scale) if DATA_KEY.search(key) else size

    def transfer(self, key: str, size: int) -> float:
        # whole KiB: a record's size varies with the host's pid and name, which must
        # not change a seeded run's timing
        return math.ceil(self.modelled(key, size) / 1024) * 1024 / self.profile.bandwidth

    def partition(self, key: str) -> str:
        depth = self.profile.prefix_depth
        parts = key.split("/")[:-1]
        return "/".join(parts if depth is None else parts[:depth])

    def admit(self, kind: str, key: str) -> None:
        """Count a request against its prefix's rate; 503 SlowDown above it."""
        p = self.profile
        self.requests[kind] += 1
        rate = p.put_rate if kind in ("put", "delete") else p.get_rate
        if rate is None:
            return
        now = self.sched.now
        prefix = self._prefixes[self.partition(key)]
        window = prefix.puts if kind in ("put", "delete") else prefix.gets
        while window and window[0] <= now - 1.0:
            window.popleft()
        if kind in ("put", "delete"):
            prefix.peak_put = max(prefix.peak_put, len(window) + 1)
            self.peak_prefix_put_rate = max(self.peak_prefix_put_rate, prefix.peak_put)
        if len(window) >= rate * prefix.scale:
            self.slowdowns += 1
            if prefix.throttled_since is None:
                prefix.throttled_since = now
            elif now - prefix.throttled_since >= p.ramp_s > 0:
                prefix.scale *= 2  # S3 split the prefix: twice the rate from now on
                prefix.throttled_since = None
            prefix.throttled_last = now
            self.sched.note("503", kind, key)
            raise SimHTTPError(503, "SlowDown", key)
        if now - prefix.throttled_last > 1.0:
            # a whole window without a 503: the load is over, not sustained (requests
            # that get through a throttled prefix's rate do not end its throttling)
            prefix.throttled_since = None
        window.append(now)
        if kind == "put" and p.object_write_rate is not None:
            last = self._last_write.get(key)
            if last is not None and now - last < 1.0 / p.object_write_rate:
                self.slowdowns += 1
                self.sched.note("429", key)
                raise SimHTTPError(503, "SlowDown", key)  # GCS 429, retried by gcsfs
            self._last_write[key] = now

    def lose_reply(self) -> bool:
        lost = self._rng.random() < self.profile.lost_reply
        self.lost_replies += lost
        return lost

    def cut_body(self) -> bool:
        cut = self._rng.random() < self.profile.cut_body
        self.cut_bodies += cut
        return cut

    # -- requests (at the server) ------------------------------------------------------
    def put(self, key: str, data: bytes, exclusive: bool) -> None:
        if exclusive:
            if key in self.objects:
                raise FileExistsError(key)  # 412 Precondition Failed
        self.objects[key] = data
        self.created[key] = self.sched.now

    def prices(self) -> dict[str, float]:
        return dict(self.profile.prices)


class SimStorage(Storage):
    """One simulated member's connection to a ``SimServer`` (its own counters).

    Every request takes virtual time (the server's model) and is a point where the
    scheduler lets another member run; a request of a killed member raises
    ``SimKilled`` before it reaches the server. Retries are the storage layer's own
    (``Storage.retry``), on the member's virtual clock.
    """

    poll_initial = 0.005
    poll_max = 0.2
    heartbeat_interval = 1.0
    round_trips_dominate = True
    cheap_deletes = False
    retries = 8  # ferrosync's retries over the client library's (botocore: 3 attempts)

    def __init__(self, server: SimServer, process, url: str = "s3://sim/job") -> None:
        super().__init__(url)
        self.server = server
        self.process = process
        self.runtime = process.runtime
        self.retry_s = None

    # -- plumbing ----------------------------------------------------------------------
    def _wait(self, seconds: float) -> None:
        if self.process.dead:
            raise SimKilled(self.process.name)
        self.runtime.sleep(seconds)

    def _request(self, kind: str, key: str) -> float:
        """Send one request: the first half of its first-byte latency; 503 above the
        prefix's rate. Returns the rest of the latency (the reply's way back)."""
        latency = self.server.first_byte(kind)
        self._wait(latency / 2)
        self.server.sched.note(self.process.name, kind, key)
        self.server.admit(kind, key)
        return latency / 2

    # -- the Storage interface ---------------------------------------------------------
    def put(self, key, parts, *, exclusive=False, reuse=None) -> int:
        data = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
        if exclusive:
            self.exclusive_create(key, [data], lambda: self.retry(
                "creating", key, self._put_once, key, data, True))
        else:
            self.retry("writing", key, self._put_once, key, data, False)
        self.counters.add(puts=1, written=len(data))
        return len(data)

    def _put_once(self, key: str, data: bytes, exclusive: bool) -> None:
        server = self.server
        back = self._request("put", key)
        if exclusive and key in server._inflight:
            self._wait(back)
            raise FileExistsError(key)  # 409 ConditionalRequestConflict
        if exclusive:
            server._inflight.add(key)
        try:
            self._wait(server.transfer(key, len(data)))  # the body's upload
            server.put(key, data, exclusive)
        finally:
            server._inflight.discard(key)
        self._wait(back)
        if server.lose_reply():
            server.sched.note("lost", key)
            raise LostReply(key)

    def open(self, key, *, max_bytes=None, rank=None):
        data = self.retry("reading", key, self._get_once, key, None)
        self.counters.add(gets=1)
        if data is None:
            return None
        self.check_size(key, len(data), max_bytes, rank)
        self.counters.add(read=len(data))
        return BytesReader(data)

    def read_head(self, key, nbytes, *, rank=None):
        data = self.retry("reading", key, self._get_once, key, nbytes)
        self.counters.add(gets=1)
        if data is not None:
            self.counters.add(read=len(data))
        return data

    def _get_once(self, key: str, nbytes: int | None) -> bytes | None:
        server = self.server
        back = self._request("get", key)
        data = server.objects.get(key)
        if data is not None and nbytes is not None:
            data = data[:nbytes]
        self._wait(back + (server.transfer(key, len(data)) if data else 0.0))
        if data is not None and server.cut_body():
            server.sched.note("cut", key)
            raise SimHTTPError(500, "InternalError", key)  # a body cut short, read again
        return data

    def delete(self, keys) -> None:
        for key in list(keys):
            self.retry("deleting", key, self._delete_once, key)
            self.counters.add(deletes=1)

    def _delete_once(self, key: str) -> None:
        back = self._request("delete", key)
        self.server.objects.pop(key, None)
        self._wait(back)

    def list(self, prefix=""):
        back = self._request("list", prefix)
        self._wait(back)
        self.counters.add(lists=1)
        keys = sorted(self.server.objects)
        start = bisect.bisect_left(keys, prefix)
        out = []
        for key in keys[start:]:
            if not key.startswith(prefix):
                break
            out.append((key, len(self.server.objects[key])))
        return out

    def path_of(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url
