"""Rewrite the option tables in docs/reference.md from the options dataclasses.

    python tools/docs/options_table.py          # rewrite docs/reference.md in place
    python tools/docs/options_table.py --check  # exit 1 if docs/reference.md is out of date

Each table sits between ``<!-- options:NAME -->`` and ``<!-- /options:NAME -->``,
NAME a backend's registration in ``ferrosync/core/registry.py`` (which names its options
dataclass). ``tests/test_docs.py`` runs the
check, so an option added in code without its row there fails the suite.
"""

from __future__ import annotations

import argparse
import pathlib
import re

from ferrosync.core.registry import option_tables

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: the document holding every option table (the README links to it)
DOC = "docs/reference.md"


def render(text: str) -> str:
    """``text`` with every marked table replaced by the generated one."""
    for name, cls in option_tables().items():
        pattern = re.compile(rf"(<!-- options:{name} -->\n).*?(<!-- /options:{name} -->)",
                             re.S)
        if not pattern.search(text):
            raise SystemExit(f"{DOC} has no <!-- options:{name} --> block")
        table = cls.table()
        text = pattern.sub(lambda m, t=table: m.group(1) + t + "\n" + m.group(2), text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check, do not write")
    args = parser.parse_args()
    doc = ROOT / DOC
    old = doc.read_text()
    new = render(old)
    if args.check:
        if new != old:
            print(f"{DOC}'s option tables are out of date: run python tools/docs/options_table.py")
            return 1
        return 0
    doc.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
