"""docs/design.md's file layout lists every module of abftgemm/ and attention/, and nothing else.

The layout is the first code block under ``## Layout``: a package line (``abftgemm/``,
``attention/``), then one entry per file or folder, indented two spaces, its description after
it (continued on lines indented further). A folder's entry names each of its files (``cli`` or
``cli.py``; its ``__init__.py`` is the folder itself). Files are those git tracks (a fresh
clone's).
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("abftgemm", "attention")
SOURCES = (".py", ".cu", ".cuh")


def layout() -> dict[str, str]:
    """``package/entry`` -> its description, from docs/design.md."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    block = re.search(r"^## Layout\n.*?^```\n(.*?)^```", text, re.DOTALL | re.MULTILINE).group(1)
    entries: dict[str, str] = {}
    package = entry = None
    for line in block.splitlines():
        top = re.match(r"^(\w+)/\s", line + " ")
        if top:
            package = top.group(1) if top.group(1) in PACKAGES else None
            entry = None
            continue
        if package is None:
            continue
        item = re.match(r"^  (\S+)\s*(.*)$", line)
        if item:
            entry = f"{package}/{item.group(1)}"
            entries[entry] = item.group(2)
        elif entry is not None and line.startswith("   "):
            entries[entry] += " " + line.strip()
    return entries


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", *PACKAGES], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    return [f for f in out if f.endswith(SOURCES) and (ROOT / f).exists()]


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the git checkout")
def test_the_layout_lists_every_file_and_nothing_else():
    entries, files = layout(), tracked()
    top = {"/".join(f.split("/")[:2]) + ("/" if f.count("/") > 1 else "") for f in files}
    assert sorted(top - entries.keys()) == [], "files docs/design.md's layout does not list"
    assert sorted(entries.keys() - top) == [], "entries of docs/design.md's layout with no file"
    unnamed = []
    for f in files:
        if f.count("/") < 2 or f.endswith("/__init__.py"):
            continue
        folder, name = "/".join(f.split("/")[:2]) + "/", Path(f).name
        words = set(re.findall(r"[\w.]+", entries[folder]))
        if name not in words and Path(name).stem not in words:
            unnamed.append(f)
    assert unnamed == [], "files the entry of their folder does not name"
