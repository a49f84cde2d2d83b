"""``ferrosync doctor URL``: is this storage location fit for a job, and which settings
suit it?

Checks the location, filesystem, atomic publish, the store's guarantees, exclusive
create, atomic rename, visibility, permissions, latency and throughput, then prints the
settings ``recommend.py`` derives for the job's mode. Its probes live under
``.doctor.{pid}.{hex}/`` after a mark naming the directory, so ``gc`` removes only what
doctor provably wrote (``owned``). The checks and what each means:
docs/operations.md#ferrosync-doctor-url.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import stat
import threading
import time
from dataclasses import dataclass, field

from ferrosync.core import runtime
from ferrosync.errors import ConfigError, ShardCorrupt, StorageError, one_line
from ferrosync.ops.keys import JobKeys, job_of
from ferrosync.ops.recommend import recommend
from ferrosync.ops.recommend import render as render_recommendation
from ferrosync.ops.scan import human_bytes, top_names
from ferrosync.storage import names
from ferrosync.storage.engines import (
    LOCAL_FILESYSTEMS,
    LocalStorage,
    Storage,
    mount_of,
    open_storage,
)
from ferrosync.storage.engines.local_tools import LocalTree
from ferrosync.storage.objects import Objects
from ferrosync.storage.providers import facts, provider_of

MiB = 1 << 20
VISIBILITY_LIMIT = 30.0  # seconds: an object not visible by then fails the check


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail | info
    summary: str
    data: dict = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    index = max(0, math.ceil(q / 100 * len(ordered)) - 1)
    return ordered[index]


def _stats_ms(values: list[float]) -> dict:
    return {"p50_ms": round(percentile(values, 50) * 1e3, 3),
            "p90_ms": round(percentile(values, 90) * 1e3, 3),
            "max_ms": round(max(values) * 1e3, 3), "n": len(values)}


class Doctor:
    """Runs the checks against ``storage``; a second, independent handle reads."""

    def __init__(self, storage: Storage, url: str, storage_options: dict | None, *,
                 size_mib: int, samples: int, payload_mib: int = 100,
                 world_size: int = 8, mode: str | None = None) -> None:
        self.storage = storage
        self.url = url
        self.options = storage_options
        self.size = size_mib * MiB
        self.samples = samples
        self.payload_mib = payload_mib
        self.world_size = world_size
        #: the job mode to recommend for: "fixed", "elastic", or None (from what is here)
        self.mode = mode
        self.local = isinstance(storage, LocalStorage)
        self.prefix = names.doctor_dir()
        #: doctor's scratch directory, through the object layer (plain records: no key)
        self.scratch = Objects.for_records(storage, self.prefix, key=None)
        self.checks: list[Check] = []
        self.measured: dict = {}
        self.mount: dict | None = None
        #: what the probes found: True / False, None where not applicable or not run
        self.capabilities: dict[str, bool | None] = {"exclusive_create": None,
                                                     "atomic_rename": None}
        self.store = provider_of(url)

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def add(self, name: str, status: str, summary: str, **data) -> None:
        # a report line each: a driver's message may span lines or quote a URL
        self.checks.append(Check(name, status, one_line(summary), data))

    # -- the run --------------------------------------------------------------------------
    def run(self) -> dict:
        self.check_store()
        try:
            usable = self.check_location()
        except (StorageError, OSError) as exc:
            self.add("location", "fail", f"cannot use this location: {exc}")
            usable = False
        if usable:
            # a second handle: its own fsspec instance (no shared caches) or file handles
            self.second = open_storage(self.url, self.options)
            try:
                # a location doctor cannot write to (read-only mount, no permission) is
                # a finding, reported as the failed check, not an abort of the whole run
                try:
                    self.storage.makedirs(self.prefix)
                    self.scratch.put_record(names.DOCTOR_MARK, mark(self.prefix))
                    writable = True
                except (StorageError, OSError) as exc:
                    self.add("writable", "fail", f"cannot create the scratch directory "
                             f"{self.prefix}/ here: {exc}; the write checks were skipped")
                    writable = False
                checks = [self.check_filesystem] if self.local else []
                if writable:
                    checks += [self.check_atomic, self.check_exclusive, self.check_rename,
                               self.check_visibility, self.check_permissions,
                               self.check_latency, self.check_throughput]
                for check in checks:
                    try:
                        check()
                    except (StorageError, OSError) as exc:
                        self.add(check.__name__[6:], "fail", f"storage failed: {exc}")
                self.check_safety()
            finally:
                try:
                    self.cleanup()
                except (StorageError, OSError) as exc:
                    self.add("cleanup", "warn", f"could not list or remove {self.prefix}/: "
                             f"{exc} (`ferrosync gc` removes probe objects)")
                self.second.close()
        return {
            "url": self.storage.url,
            "checks": [c.__dict__ for c in self.checks],
            "measured": self.measured,
            "capabilities": self.capabilities,
            "store": {**facts(self.store),
                      "driver_class": type(getattr(self.storage, "fs", self.storage)).__name__},
            "mode": self.mode or "fixed",
            "recommended": self.recommend() if "latency" in self.measured else None,
        }

    def check_store(self) -> None:
        """What this kind of store guarantees and costs, as documented (no request)."""
        st = self.store
        prices = (", ".join(f"{k} ${v:g}" for k, v in st.prices.items())
                  + f" per 1,000 ({st.price_basis})") if st.prices else "requests not billed"
        text = (f"{st.name} via {st.driver}: create only if absent by "
                f"{st.conditional_create}; read-after-write {st.read_after_write}; delete "
                f"visibility {st.delete_visibility}; {prices}")
        if st.emulator:
            text += f"; emulator or compatible server: {st.emulator}"
        self.add("store", "info", text.replace("`", ""))

    def check_location(self) -> bool:
        storage = self.storage
        if self.local:
            root = storage.root
            if os.path.exists(root) and not os.path.isdir(root):
                self.add("location", "fail", f"{root} exists and is not a directory")
                return False
            existed = os.path.isdir(root)
            storage.makedirs("")
            mode = stat.S_IMODE(os.stat(root).st_mode)
            self.add("location", "ok", ("exists" if existed else "created now")
                     + f", directory mode {mode:04o}", created=not existed, mode=f"{mode:04o}")
        else:
            created = False
            try:
                storage.probe_bucket()
            except ConfigError as exc:
                if not isinstance(exc.__cause__, FileNotFoundError):  # a missing bucket
                    # unreachable, no credentials, an object for a prefix: bad usage,
                    # one line and exit 2 (the CLI), not a report of checks
                    raise
                bucket = storage.root.split("/", 1)[0]
                try:
                    storage.fs.mkdir(bucket)
                    created = True
                except Exception as err:  # noqa: BLE001 - reported as the check's result
                    self.add("location", "fail", f"bucket {bucket!r} does not exist and "
                             f"could not be created ({type(err).__name__}: {err})")
                    return False
            self.add("location", "ok", "bucket created now" if created else "bucket reachable",
                     created=created)
        self.check_existing_jobs()
        return True

    def check_existing_jobs(self) -> None:
        """Jobs already here: how many, whose key this host has, and which mode (the
        recommendations follow it unless ``--elastic``/``--fixed`` says)."""
        top = top_names(self.storage)
        spaces = [n for n in top if names.parse(n).kind == "namespace"]  # rdzv/: no id
        elastic = [n for n in top if names.is_elastic_namespace(n)]
        if self.mode is None:
            self.mode = "elastic" if elastic and not spaces else "fixed"
        existing = [k for ns in spaces for k, _ in self.storage.list(ns)
                    if names.parse(k.rpartition("/")[2]).kind == "announcement"]
        if not existing and not elastic:
            return
        keys = JobKeys()
        known = [ns for ns in spaces + elastic if keys.key_file(job_of(ns)) is not None]
        found = ([f"{len(existing)} generation(s) of {len(spaces)} job namespace(s) "
                  "announced here already"] if existing else []) + (
            [f"elastic job(s) {', '.join(elastic)}"] if elastic else [])
        self.add("existing jobs", "info", f"{'; '.join(found)} (see `ferrosync inspect`; "
                 f"this host has the key file of {len(known)} of them); a new job gets "
                 "namespaces of its own", elastic=elastic, key_files=len(known))

    def check_filesystem(self) -> None:
        mount = mount_of(self.storage.root)
        if mount is None:
            self.add("filesystem", "info", "mount table unavailable (not Linux?)")
            return
        self.mount = mount
        fstype, opts = mount["fstype"], mount["options"]
        where = f"{fstype} at {mount['mountpoint']} from {mount['source']}"
        if fstype.startswith("nfs"):
            problems = nfs_problems(opts)
            status = "fail" if any(p[0] == "fail" for p in problems) else (
                "warn" if problems else "ok")
            text = "; ".join(p[1] for p in problems) or (
                "close-to-open consistency on, lookupcache="
                f"{_opt(opts, 'lookupcache') or 'all'}, hard mount")
            self.add("filesystem", status, f"{where}: {text}", **mount)
        elif fstype.startswith("fuse"):
            self.add("filesystem", "warn", f"{where}: a FUSE filesystem; atomic rename, "
                     "hard links and read-after-write depend on its driver. For S3/GCS use "
                     "the s3:// or gs:// URL directly", **mount)
        elif fstype in ("cifs", "smb3", "smbfs"):
            self.add("filesystem", "warn", f"{where}: SMB; mount with cache=strict and "
                     "check the atomic publish result below", **mount)
        elif fstype in LOCAL_FILESYSTEMS:
            self.add("filesystem", "ok", f"{where}: a local filesystem (ranks on other "
                     "nodes cannot share it)", **mount)
        else:
            self.add("filesystem", "info", where, **mount)

    def check_atomic(self) -> None:
        """A reader must see every version whole: never torn, short or missing."""
        size = 1 * MiB if self.local else 256 * 1024
        versions = 40 if self.local else 8
        key = self.key("atomic")
        self.storage.put(key, [_pattern(0, size)])
        done = threading.Event()
        errors: list[BaseException] = []

        def writer() -> None:
            try:
                for v in range(1, versions + 1):
                    self.storage.put(key, [_pattern(v, size)])
            except BaseException as exc:  # noqa: BLE001 - reported by the reader side
                errors.append(exc)
            finally:
                done.set()

        thread = threading.Thread(target=writer, name="ferrosync-doctor-writer", daemon=True)
        reads, bad, seen = 0, [], set()
        thread.start()
        try:
            while not done.is_set() or reads < 3:
                data = self.second.read(key, max_bytes=size)
                reads += 1
                version = _version_of(data, size)
                if version is None:
                    bad.append("missing" if data is None else f"torn ({len(data)} bytes)")
                else:
                    seen.add(version)
        finally:
            thread.join(timeout=120)
        if errors:
            raise errors[0]
        temps = [k for k, _ in self.storage.list(self.prefix)
                 if names.parse(k.rpartition("/")[2]).kind == "temp"]
        how = "temp file + os.replace" if self.local else "single PUT"
        if bad or temps:
            what = (f"{len(bad)} of {reads} reads were not a whole version "
                    f"({', '.join(sorted(set(bad)))})" if bad else "") + (
                f"; temp files left behind: {temps}" if temps else "")
            self.add("atomic publish", "fail", f"{how}: {what}. Readers could see partial "
                     "objects: use another filesystem or an object-store URL",
                     reads=reads, bad=len(bad))
        else:
            self.add("atomic publish", "ok", f"{how}: {reads} reads during {versions} "
                     f"replacements of a {human_bytes(size)} object saw {len(seen)} "
                     "versions, all whole; no temp file left", reads=reads)

    def check_exclusive(self) -> None:
        name = "exclusive"
        how = "os.link" if self.local else self.store.create_request
        self.capabilities["exclusive_create"] = False
        try:
            if not (self.scratch.create_bytes(name, [b"first"])
                    and self.scratch.create_bytes(name, [b"second"])):
                self.capabilities["exclusive_create"] = True
                self.add("exclusive create", "ok", f"{how}: a second create of one name fails")
                return
        except StorageError as exc:
            self.add("exclusive create", "fail", f"{how} is not supported here ({exc}); "
                     "connect refuses this location: rendezvous needs it to keep two jobs "
                     "from mixing, an elastic job to agree on its members")
            return
        self.add("exclusive create", "fail", f"{how} is not enforced (the second create "
                 "overwrote the first): connect refuses this location, since two jobs "
                 "sharing it could mix and an elastic job could not agree on its members; "
                 "use a driver or store that creates only if absent")

    def check_rename(self) -> None:
        """Rename a probe within its directory, as a local publish does (file systems)."""
        if not self.local:
            self.add("atomic rename", "info", "object store: nothing is renamed, one PUT "
                     "publishes an object whole (see atomic publish)")
            return
        self.capabilities["atomic_rename"] = False
        directory = os.path.join(self.storage.root, self.prefix)
        try:
            problems = probe_rename(directory)
        except OSError as exc:
            self.add("atomic rename", "fail", f"renaming within {directory} failed "
                     f"({type(exc).__name__}: {exc}): ferrosync publishes by rename; use "
                     "another filesystem or an object-store URL", errno=exc.errno)
            return
        driver = (self.mount or {}).get("fstype", "")
        if problems:
            self.add("atomic rename", "fail", "a rename within a directory did not move "
                     f"the file: {'; '.join(problems)}. Readers could see partial or "
                     "doubled objects: use another filesystem or an object-store URL",
                     problems=problems)
        elif driver in COPY_RENAME_FUSE:
            self.add("atomic rename", "warn", f"{driver} renames by copying then deleting "
                     "(only this host's kernel makes it look atomic; other hosts can see "
                     "both names, or none): use the object store's own URL (s3://, gs://, "
                     "az://) instead of the mount", driver=driver)
        else:
            self.capabilities["atomic_rename"] = True
            note = (f"; {driver} is a FUSE driver: other hosts see what it makes of "
                    "rename" if driver.startswith("fuse") else "")
            self.add("atomic rename", "ok", "os.rename/os.replace within a directory keep "
                     f"the file (same inode), the old name gone{note}")

    def check_safety(self) -> None:
        """Warn where neither exclusive create nor atomic rename holds (file systems)."""
        caps = self.capabilities
        if self.local and caps["exclusive_create"] is False and caps["atomic_rename"] is False:
            self.add("publish safety", "warn", "this location has neither exclusive create "
                     "nor atomic rename: readers can see partial objects and two jobs sharing "
                     "it are not detected. Use the object store's URL (s3://...) rather than "
                     "a FUSE mount of it, or a local or NFS directory")

    def check_visibility(self) -> None:
        trials = max(3, min(10, self.samples))
        fresh, overwrite = [], []
        for i in range(trials):
            key = self.key(f"visible.{i}")
            self.second.read(key)  # a miss first: a negative cache would now hide it
            self.storage.put(key, [b"v1"])
            fresh.append(self._until_seen(key, b"v1"))
            self.storage.put(key, [b"v2"])  # heartbeats are overwritten in place
            overwrite.append(self._until_seen(key, b"v2"))
        limit = max(fresh + overwrite)
        self.measured["visibility"] = {"new": _stats_ms(fresh), "overwrite": _stats_ms(overwrite)}
        text = (f"a second handle sees a new object after p50 {percentile(fresh, 50)*1e3:.2f} "
                f"ms (max {max(fresh)*1e3:.2f} ms), an overwritten one after max "
                f"{max(overwrite)*1e3:.2f} ms ({trials} trials)")
        if self.local:
            text += "; same host only: caches of other NFS clients are not measured"
        if math.isinf(limit):
            self.add("visibility", "fail", f"an object stayed invisible for "
                     f"{VISIBILITY_LIMIT:g} s to a second handle")
        else:
            self.add("visibility", "ok" if limit < 1.0 else "warn", text)

    def _until_seen(self, key: str, want: bytes) -> float:
        start = time.monotonic()
        return runtime.wait(
            lambda: time.monotonic() - start if self.second.read(key) == want else None,
            deadline=start + VISIBILITY_LIMIT, expired=lambda: math.inf, poll=(1e-4, 0.01))

    def check_permissions(self) -> None:
        if not self.local:
            self.add("permissions", "info", "object store: access is the bucket policy's "
                     "business; set a secret (FERROSYNC_SECRET) if others can write to it")
            return
        root = self.storage.root
        key = self.key("mode")
        self.storage.put(key, [b"x"])
        # lstat below the root: what ferrosync made there, never a link's target
        modes = {
            "location": stat.S_IMODE(os.stat(root).st_mode),
            "created_dir": stat.S_IMODE(os.lstat(os.path.join(root, self.prefix)).st_mode),
            "created_file": stat.S_IMODE(os.lstat(os.path.join(root, key)).st_mode),
        }
        umask = current_umask()
        data = {k: f"{v:04o}" for k, v in modes.items()}
        data["umask"] = f"{umask:04o}" if umask is not None else None
        text = (f"files {data['created_file']}, directories {data['created_dir']}, "
                f"location {data['location']}, umask {data['umask']}")
        if any(v & stat.S_IWOTH for v in modes.values()):
            self.add("permissions", "fail", text + ": world-writable, so any user can plant "
                     "objects; use a private directory (chmod o-w) and set a secret", **data)
        elif any(v & stat.S_IROTH for v in modes.values()):
            self.add("permissions", "warn", text + ": world-readable, so other users can read "
                     "gradients; chmod o-rx the location or tighten the umask", **data)
        else:
            self.add("permissions", "ok", text + ": owner and group only", **data)

    def check_latency(self) -> None:
        put, get, miss = [], [], []
        payload = secrets.token_bytes(1024)
        for i in range(self.samples):
            key = self.key(f"lat.{i}")
            t0 = time.perf_counter()
            self.storage.put(key, [payload])
            t1 = time.perf_counter()
            self.second.read(key)
            t2 = time.perf_counter()
            self.second.read(self.key(f"missing.{i}"))
            t3 = time.perf_counter()
            put.append(t1 - t0)
            get.append(t2 - t1)
            miss.append(t3 - t2)
        stats = {"put": _stats_ms(put), "get": _stats_ms(get), "open_miss": _stats_ms(miss)}
        self.measured["latency"] = stats
        self.add("latency", "info", ", ".join(
            f"{name} p50 {s['p50_ms']:.3g} ms p90 {s['p90_ms']:.3g} ms"
            for name, s in stats.items()) + f" (1 KiB objects, {self.samples} samples)")

    def check_throughput(self) -> None:
        if self.size <= 0:
            return
        block = secrets.token_bytes(MiB)
        data = block * (self.size // MiB)
        key = self.key("throughput")
        t0 = time.perf_counter()
        self.storage.put(key, [data])
        t1 = time.perf_counter()
        back = bytearray(len(data))
        reader = self.second.open(key, max_bytes=len(data))
        got = 0
        if reader is not None:
            with reader:
                got = reader.readinto(back)
        t2 = time.perf_counter()
        write, read = len(data) / (t1 - t0), len(data) / (t2 - t1)
        self.measured["throughput"] = {"bytes": len(data), "write_Bps": write, "read_Bps": read}
        self.storage.delete([key])
        if got != len(data) or back != data:
            self.add("throughput", "fail", f"the {human_bytes(len(data))} object read back "
                     "differs from what was written")
            return
        note = " (reads likely from this host's page cache)" if self.local else ""
        self.add("throughput", "info", f"write {write / 1e6:.0f} MB/s, read {read / 1e6:.0f} "
                 f"MB/s with one {human_bytes(len(data))} object{note}")

    def cleanup(self) -> None:
        # the mark last: a cleanup cut short leaves probes that gc can still prove doctor's
        keys = sorted(owned(self.storage, self.prefix, [k for k, _ in
                                                        self.storage.list(self.prefix)]),
                      key=lambda k: k.endswith("/" + names.DOCTOR_MARK))
        self.storage.delete(keys)
        if self.local:
            LocalTree(self.storage).remove_empty_dirs(self.prefix)  # never through a link
        left = self.storage.list(self.prefix)
        if left:
            self.add("cleanup", "warn", f"{len(left)} probe objects could not be removed "
                     f"under {self.prefix}/ (`ferrosync gc` removes them)")

    # -- recommendations -----------------------------------------------------------------
    def recommend(self) -> dict:
        """Settings for a job of this location's mode (``ops/recommend.py``)."""
        return recommend(self.storage, self.measured, mode=self.mode or "fixed",
                         payload_mib=self.payload_mib, world_size=self.world_size,
                         nfs=bool(self.mount and self.mount["fstype"].startswith("nfs")))


def mark(directory: str) -> dict:
    """The mark doctor writes first in ``directory``: a plain control record naming it."""
    return {"kind": "ferrosync doctor", "dir": directory}


def owned(storage: Storage, directory: str, keys: list[str]) -> list[str]:
    """Those of ``keys`` (listed under the doctor-like ``directory``) that doctor provably
    wrote: none unless ``directory`` holds doctor's mark naming it (a copy of another
    directory's mark names that one), then the names doctor writes, directly inside it.
    Anything else there is someone else's and never removed."""
    try:
        found = Objects.for_records(storage, directory, key=None).inspect_record(
            names.DOCTOR_MARK)
    except (StorageError, ShardCorrupt):  # a link, a FIFO, larger than any record
        return []
    if found is None or found.body != mark(directory):
        return []
    return [k for k in keys if k.rpartition("/")[0] == directory
            and names.doctor_object(k.rpartition("/")[2])]


def _pattern(version: int, size: int) -> bytes:
    """Version number, then a fill byte derived from it: any mix of two is detectable."""
    return version.to_bytes(8, "little") + bytes([version % 251 + 1]) * (size - 8)


def _version_of(data: bytes | None, size: int) -> int | None:
    if data is None or len(data) != size:
        return None
    version = int.from_bytes(data[:8], "little")
    fill = version % 251 + 1
    if data.count(fill, 8) != size - 8:
        return None
    return version


# -- rename probe -----------------------------------------------------------------------------

#: FUSE drivers whose rename is a copy then a delete (object stores have no rename)
COPY_RENAME_FUSE = {"fuse.s3fs", "fuse.goofys", "fuse.rclone", "fuse.gcsfuse",
                    "fuse.blobfuse", "fuse.blobfuse2", "fuse.geesefs"}
_PROBE_DIR_FLAGS = (os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
                    | getattr(os, "O_CLOEXEC", 0))
_PROBE_FILE_FLAGS = (os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                     | getattr(os, "O_CLOEXEC", 0))


def probe_rename(directory: str) -> list[str]:
    """Rename within ``directory`` the two ways a local publish does; return what went
    wrong (empty: the renames behaved atomically, as far as one host can tell).

    A rename must move the file itself: the same inode under the new name, nothing
    left under the old one, and ``os.replace`` onto an existing name must put the
    source file there. A copy then delete makes a new file instead. The probe files
    are created here (never following a link) and removed before returning.
    """
    files = ("rename.a", "rename.b", "rename.c")
    dfd = os.open(directory, _PROBE_DIR_FLAGS)
    problems = []
    try:
        first = _probe_file(dfd, files[0], b"A" * 4096)
        os.rename(files[0], files[1], src_dir_fd=dfd, dst_dir_fd=dfd)
        problems += _moved(dfd, files[0], files[1], first, b"A" * 4096, "to a new name")
        second = _probe_file(dfd, files[2], b"C" * 4096)
        os.replace(files[2], files[1], src_dir_fd=dfd, dst_dir_fd=dfd)
        problems += _moved(dfd, files[2], files[1], second, b"C" * 4096,
                           "onto an existing name")
    finally:
        for name in files:
            try:
                os.unlink(name, dir_fd=dfd)
            except OSError:
                pass
        os.close(dfd)
    return problems


def _probe_file(dfd: int, name: str, data: bytes) -> os.stat_result:
    fd = os.open(name, _PROBE_FILE_FLAGS, 0o600, dir_fd=dfd)
    try:
        os.write(fd, data)
        return os.fstat(fd)
    finally:
        os.close(fd)


def _moved(dfd: int, old: str, new: str, before: os.stat_result, data: bytes,
           how: str) -> list[str]:
    problems = []
    try:
        os.stat(old, dir_fd=dfd, follow_symlinks=False)
        problems.append(f"renaming {how} left the old name behind")
    except FileNotFoundError:
        pass
    after = os.stat(new, dir_fd=dfd, follow_symlinks=False)
    if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
        problems.append(f"renaming {how} made a new file (inode {before.st_ino} became "
                        f"{after.st_ino}): a copy, not a rename")
    fd = os.open(new, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0), dir_fd=dfd)
    try:
        if os.read(fd, len(data) + 1) != data:
            problems.append(f"after renaming {how} the new name holds other bytes")
    finally:
        os.close(fd)
    return problems


# -- mount options (the mount table itself is read by ferrosync.storage.engines.mount_of) ----------

def _opt(options: list[str], name: str) -> str | None:
    for opt in options:
        if opt == name:
            return ""
        if opt.startswith(name + "="):
            return opt.split("=", 1)[1]
    return None


def nfs_problems(options: list[str]) -> list[tuple[str, str]]:
    """(status, text) for NFS mount options that hurt ferrosync (docs/reference.md, "NFS")."""
    problems = []
    if _opt(options, "nocto") is not None:
        problems.append(("fail", "nocto: open() no longer revalidates, so readers can see "
                         "stale or missing objects; remount without nocto"))
    lookup = _opt(options, "lookupcache")
    if lookup not in ("positive", "pos", "none"):
        problems.append(("warn", f"lookupcache={lookup or 'all'}: a cached \"no such file\" "
                         "can hide a new object for up to acdirmax seconds; remount with "
                         "lookupcache=positive"))
    if _opt(options, "soft") is not None:
        problems.append(("warn", "soft mount: timeouts surface as EIO errors; prefer hard"))
    return problems


def current_umask() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return None


# -- output ----------------------------------------------------------------------------------

def render(report: dict) -> str:
    lines = [f"ferrosync doctor {report['url']}"]
    for c in report["checks"]:
        lines.append(f"  [{c['status']:<4}] {c['name']:<17} {c['summary']}")
    rec = report.get("recommended")
    if rec:
        lines.extend(render_recommendation(report["url"], rec))
    return "\n".join(lines)


def run(storage: Storage, url: str, storage_options: dict | None, *, size_mib: int,
        samples: int, payload_mib: int, world_size: int, as_json: bool, strict: bool,
        mode: str | None = None) -> int:
    doctor = Doctor(storage, url, storage_options, size_mib=size_mib, samples=samples,
                    payload_mib=payload_mib, world_size=world_size, mode=mode)
    report = doctor.run()
    print(json.dumps(report, indent=2, sort_keys=True) if as_json else render(report))
    failed = any(c["status"] == "fail" for c in report["checks"])
    return 1 if strict and failed else 0


__all__ = ["Doctor", "run", "render", "mount_of", "nfs_problems", "probe_rename"]
