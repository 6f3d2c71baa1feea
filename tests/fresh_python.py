"""Run code in a fresh Python interpreter that imports this checkout (tests of process-wide
state: thread pools, warnings filters, benchmark scripts)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def env_with_checkout() -> dict[str, str]:
    """The environment with the repository root first on PYTHONPATH."""
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def run_python(*args: str, cwd: Path | None = None, timeout: int = 300) -> None:
    """``python *args`` in a new process; fails the test with its stderr unless it exits 0."""
    done = subprocess.run([sys.executable, *args], env=env_with_checkout(), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
