"""Mount detection: which mount holds a path, and whether it is a local filesystem.

``LocalStorage`` asks (a file rewritten in place is safe only where the page cache is the
only cache); ``ferrosync doctor`` reads the mount options (NFS ``lookupcache``, ``nocto``).
"""

from __future__ import annotations

import os
import re

# Filesystems whose page cache is the only cache: rewriting a file in place is seen by
# every reader at once, and ranks on other nodes cannot share them. Network and FUSE
# filesystems are excluded on purpose.
LOCAL_FILESYSTEMS = frozenset({
    "tmpfs", "ramfs", "ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "overlay",
    "jfs", "reiserfs", "bcachefs"})


def mount_of(path: str) -> dict | None:
    """The mount holding ``path`` (the longest mount point that contains it, the later
    of two at one point): ``{"source", "mountpoint", "fstype", "options"}``, or None
    where /proc/self/mountinfo cannot be read (not Linux).

    A path that does not exist yet is looked up by its nearest existing parent.
    ``options`` are the mount's own and its superblock's (where NFS keeps ``nocto``,
    ``lookupcache``, ``soft``), as /proc/self/mounts would show them.
    """
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    path = os.path.realpath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    best = None
    for line in lines:
        mount = _mountinfo_entry(line)
        if mount is None:
            continue
        point = mount["mountpoint"]
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best["mountpoint"])):
            best = mount
    return best


def _mountinfo_entry(line: str) -> dict | None:
    """One line of /proc/self/mountinfo (proc(5)): ``id parent dev root mountpoint
    options [optional fields...] - fstype source super-options``."""
    left, _, right = line.partition(" - ")
    fields, tail = left.split(), right.split()
    if len(fields) < 6 or len(tail) < 2:
        return None
    options = fields[5].split(",")
    if len(tail) > 2:
        options += [o for o in tail[2].split(",") if o not in options]
    return {"source": _unescape(tail[1]), "mountpoint": _unescape(fields[4]),
            "fstype": tail[0], "options": [_unescape(o) for o in options]}


def _unescape(text: str) -> str:
    """The kernel writes space, tab, newline and backslash in mount fields as octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def is_local_filesystem(path: str) -> bool:
    """True when ``path`` lies on a local filesystem (``LOCAL_FILESYSTEMS``)."""
    mount = mount_of(path)
    return mount is not None and mount["fstype"] in LOCAL_FILESYSTEMS
