"""The settings ``ferrosync doctor`` recommends for a fixed-size or an elastic job, from
what it measured.

The floor is what a job of that mode resolves by itself on this store (the options'
``timing(storage)``); above it each setting follows the measured latency, visibility
and throughput, and the result is parsed by the same options class, so ``connect``
accepts it. The rule per setting: docs/operations.md#ferrosync-doctor-url.
"""

from __future__ import annotations

import math

from ferrosync.compression.codecs import Int8Codec, TopKCodec
from ferrosync.elastic.options import ElasticOptions
from ferrosync.storage.options import StorageOptions

MiB = 1 << 20
#: a float32 collective of the payload taking this long at the measured throughput is
#: a slow link: int8 from 1 s, topk from 4 s (where int8 would still take over 1 s)
INT8_FROM_S = 1.0
TOPK_FROM_S = 4.0
MODES = ("fixed", "elastic")
#: the heartbeat settings shown, in order
SHOWN = ("poll_initial", "poll_max", "heartbeat_interval", "heartbeat_timeout", "timeout")


def nice(x: float) -> float:
    """Round up to two significant digits, so settings read like a human chose them."""
    if x <= 0:
        return 0.0
    scale = 10 ** (math.floor(math.log10(x)) - 1)
    return round(math.ceil(x / scale - 1e-9) * scale, 12)


def options_class(mode: str):
    return ElasticOptions if mode == "elastic" else StorageOptions


def recommend(storage, measured: dict, *, mode: str, payload_mib: int, world_size: int,
              nfs: bool) -> dict:
    """Settings for a job of ``mode`` on ``storage`` from doctor's ``measured``."""
    cls = options_class(mode)
    floor = cls.parse({}).timing(storage)  # what a job of this mode resolves by itself
    lat = measured["latency"]
    miss50, miss90 = lat["open_miss"]["p50_ms"] / 1e3, lat["open_miss"]["p90_ms"] / 1e3
    put90 = lat["put"]["p90_ms"] / 1e3
    vis = measured.get("visibility", {})
    vis_max = max((v["max_ms"] / 1e3 for v in vis.values()), default=0.0)
    interval = nice(max(floor.heartbeat_interval, 20 * put90))
    out = {
        "mode": mode,
        "poll_initial": nice(max(floor.poll[0], min(miss50 / 2, 0.05))),
        "poll_max": nice(max(floor.poll[1], min(4 * miss90, 1.0))),
        "heartbeat_interval": interval,
        "heartbeat_timeout": float(max(floor.heartbeat_timeout,
                                       3 * interval + round(2 * vis_max))),
    }
    # connect accepts it (one home for the rules between them)
    cls.parse({k: out[k] for k in SHOWN if k in out}).timing(storage)
    tp = measured.get("throughput")
    if tp:
        # root reduce: rank 0 reads world_size - 1 contributions and writes one result
        seconds = payload_mib * MiB * world_size / min(tp["write_Bps"], tp["read_Bps"])
        out["timeout"] = float(max(300, math.ceil(10 * seconds + vis_max)))
        out["timeout_basis"] = (f"10x one collective of {payload_mib} MiB over "
                                f"{world_size} ranks at the measured throughput")
        out.update(_wire(seconds))
    if nfs:
        out["nfs_mount_options"] = "hard,lookupcache=positive (keep the default cto)"
    return out


def _wire(seconds: float) -> dict:
    """The ``wire_dtype`` for a link where a float32 collective takes ``seconds``."""
    if seconds < INT8_FROM_S:
        return {}
    n = 1 << 20
    codec = TopKCodec() if seconds >= TOPK_FROM_S else Int8Codec()
    ratio = 4 * n / codec.nbytes(n)
    use = (" (average gradients or DiLoCo's pseudo-gradients with it, never parameters: "
           "docs/topk.md)" if codec.name == "topk" else "")
    return {"wire_dtype": codec.name,
            "wire_basis": f"that collective takes about {seconds:.3g} s here in float32; "
                          f"{codec.name} moves {ratio:.0f}x fewer bytes{use}"}


def render(url: str, rec: dict) -> list[str]:
    """The report's recommendation lines: the settings, then the call that uses them."""
    elastic = rec.get("mode") == "elastic"
    pairs = [f"{n}={rec[n]:g}" for n in SHOWN if n in rec]
    lines = ["", "recommended settings" + (" for an elastic job's members (connect(..., "
                                         "elastic=True), --elastic):" if elastic else ":"),
             "  " + "  ".join(pairs)]
    if "timeout_basis" in rec:
        lines.append(f"  (timeout: {rec['timeout_basis']}; scale it with your payload)")
    if "wire_basis" in rec:
        lines.append(f"  (wire_dtype={rec['wire_dtype']!r}: {rec['wire_basis']})")
        pairs.append(f"wire_dtype={rec['wire_dtype']!r}")
    args = ", ".join(p for p in pairs if not p.startswith("timeout="))
    timeout = f", timeout={rec['timeout']:g}" if "timeout" in rec else ""
    mode = ", elastic=True" if elastic else ""
    lines.append(f"  ferrosync.connect({url!r}{mode}{timeout}, {args})")
    if rec.get("nfs_mount_options"):
        lines.append(f"  NFS mount options: {rec['nfs_mount_options']}")
    return lines
