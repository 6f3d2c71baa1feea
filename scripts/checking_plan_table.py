"""Print the checking plan's table (attention.plan.plan_markdown); ``--write`` puts it into
docs/checking_plan.md between its ``checking plan table`` markers.

Usage::

    python scripts/checking_plan_table.py [--write]
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attention.plan import plan_markdown  # noqa: E402

DOC = ROOT / "docs" / "checking_plan.md"
BLOCK = re.compile(r"(<!-- BEGIN checking plan table -->\n).*?(\n<!-- END checking plan table)",
                   re.DOTALL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"update {DOC.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    table = plan_markdown()
    if not args.write:
        print(table)
        return 0
    doc = DOC.read_text(encoding="utf-8")
    if not BLOCK.search(doc):
        raise SystemExit(f"{DOC} has no 'checking plan table' markers")
    DOC.write_text(BLOCK.sub(lambda m: m.group(1) + table + m.group(2), doc), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
