"""``ferrosync keys``: list the key files the launcher keeps, and prune those of
launches that are over. What a key file is, which ones are read and which ones go are
``keys.py``'s rules (``entries``, ``KeyEntry.prune_reason``, ``prune``); this module
only runs them and prints what it found, every name and URL escaped (they come from
files; a URL redacted as every message's is)."""

from __future__ import annotations

import json
import sys

from ferrosync.errors import redact
from ferrosync.ops import keys
from ferrosync.ops.scan import printable

__all__ = ["run"]


def run(*, prune_them: bool, older_than_days: float, dry_run: bool, as_json: bool,
        where: str | None = None) -> int:
    """``ferrosync keys``: list the key files, and with ``prune_them`` remove those of
    launches that are over; exit status 0."""
    where = where or keys.directory()
    found = keys.entries(where)
    removed = keys.prune(found, older_than_days * 86400, where, dry_run) if prune_them else []
    gone = {e.name: why for e, why in removed}
    if as_json:
        print(json.dumps({"directory": where, "pruned": bool(prune_them and not dry_run),
                          "entries": [{
                              "name": e.name, "job": e.key.job if e.key else None,
                              "url": redact(e.key.url) if e.key else None,
                              "age_s": round(e.age_s),
                              "running": e.running, "state": e.state or None,
                              "store_gone": e.store_gone, "problem": e.problem,
                              "removed": gone.get(e.name)} for e in found]}, indent=1))
        return 0
    verb = "would remove" if dry_run else "removed"
    print(f"ferrosync keys {where}: {len(found)} file(s)"
          + (f", {verb} {len(removed)}" if prune_them else ""))
    for e in found:
        age = f"{e.age_s / 86400:.1f} d" if e.age_s >= 86400 else f"{e.age_s / 3600:.1f} h"
        if e.key is None:
            print(f"  {printable(e.name)}  {age}  {printable(e.problem)}")
            continue
        # a key file written before URLs with credentials were refused may hold one
        url = printable(redact(e.key.url) or "?") + (" (gone)" if e.store_gone else "")
        mark = f"  -> {verb}: {gone[e.name]}" if e.name in gone else ""
        print(f"  {printable(e.key.job)}  {age}  {url}  {printable(e.state)}{mark}")
    if not prune_them and any(e.prune_reason(older_than_days * 86400) for e in found):
        print(f"ferrosync keys --prune removes the key files of launches that are over "
              f"(their run directory gone, or older than {older_than_days:g} days)",
              file=sys.stderr)
    return 0
