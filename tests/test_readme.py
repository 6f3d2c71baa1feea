"""Every Python block of README.md runs on its own, in a fresh interpreter, outside the repository.

A block is a fenced code block whose info string is ``python``; each runs alone (nothing carries
over from the block before), in an empty temporary folder with the repository kept off
PYTHONPATH, as a reader pasting it into a new session would run it.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: A fenced ```python block: its body up to the closing fence.
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
#: Seconds one block may take (the slowest compiles numba kernels on first use).
BLOCK_TIMEOUT = 300


def python_blocks(text: str) -> list[str]:
    """The bodies of the fenced ``python`` blocks of a markdown text, in order."""
    return [m.group(1) for m in BLOCK.finditer(text)]


BLOCKS = python_blocks((ROOT / "README.md").read_text(encoding="utf-8"))


def test_blocks_found() -> None:
    # README.md has an API tour and an attention example; finding none means the pattern broke
    assert len(BLOCKS) >= 2


def test_block_pattern() -> None:
    text = "x\n```python\na = 1\n```\n```bash\nls\n```\n```python\nb = 2\nc = 3\n```\n"
    assert python_blocks(text) == ["a = 1\n", "b = 2\nc = 3\n"]


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(code: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=BLOCK_TIMEOUT, check=False)
    assert done.returncode == 0, f"README block failed:\n{code}\n--- stderr ---\n{done.stderr}"


def test_the_hypothesis_recipe_runs_on_a_cold_numba_cache(tmp_path: Path) -> None:
    # As written, then called, in a fresh interpreter whose numba cache is empty (a CI runner's
    # first run): the compile on the first examples once failed hypothesis's 200 ms deadline.
    (recipe,) = [b for b in BLOCKS if "def test_mine" in b]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "numba-cache")
    done = subprocess.run([sys.executable, "-c", recipe + "\ntest_mine()\nprint('ran')\n"],
                          cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT, check=False)
    assert done.returncode == 0 and done.stdout.strip().endswith("ran"), done.stderr
    assert any((tmp_path / "numba-cache").rglob("*.nbi"))  # it did compile from scratch


#: ``print(...)  # Counters(...)``: a printed value the README states in a comment.
STATED = re.compile(r"^\s*print\(.*\)\s+#\s+(Counters\(.*\))\s*$", re.MULTILINE)


def test_printed_values_the_readme_states_are_what_the_code_prints(tmp_path: Path) -> None:
    # allocations=8 stood in the README while the plan allocated 7
    stated = [(code, STATED.findall(code)) for code in BLOCKS if STATED.search(code)]
    assert stated
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for code, values in stated:
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=BLOCK_TIMEOUT, check=True)
        for value in values:
            assert value in done.stdout, f"README says {value}; the block printed {done.stdout}"
