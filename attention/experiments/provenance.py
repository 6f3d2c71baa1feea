"""When, on what machine and from which commit an experiment ran: the line every report of the
``abft`` command (campaign.md, train.md, train.json) carries."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path


def provenance() -> dict[str, str]:
    """When, on what and from which commit an experiment ran: ``date`` (UTC), ``commit`` (of
    the checkout the package runs from, ``-dirty`` with changes; ``unknown`` outside one) and
    ``machine`` (CPU model and cores)."""
    root = Path(__file__).resolve().parents[2]
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                  text=True, timeout=10, check=True).stdout.strip()
        commit = git("rev-parse", "--short", "HEAD")
        if git("status", "--porcelain", "--untracked-files=no"):
            commit += "-dirty"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit, "machine": f"{cpu}, {os.cpu_count()} cores"}


def provenance_line(p: dict[str, str] | None = None) -> str:
    """``Run <date> on machine <machine>, commit <commit>.`` of :func:`provenance` (now when
    ``p`` is None)."""
    p = provenance() if p is None else p
    return f"Run {p['date']} on machine {p['machine']}, commit {p['commit']}."
