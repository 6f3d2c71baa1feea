"""Every mutation of ``make mutations`` still finds its text: an edit of the source that drops a
mutated line would otherwise leave the mutant unable to run (scripts/mutation_check.py stops on
it), and a required check of the suite's power unchecked until someone runs the whole campaign."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mutation_check():
    spec = importlib.util.spec_from_file_location("mutation_check",
                                                  ROOT / "scripts" / "mutation_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_mutation_finds_its_text_once() -> None:
    check = _mutation_check()
    assert len(check.MUTATIONS) > 20
    assert check.stale(list(check.MUTATIONS)) == []


def test_a_mutation_whose_text_is_gone_is_reported() -> None:
    check = _mutation_check()
    gone = check.Mutation("gone", "abftgemm/locate.py", (("no such line", "x"),), True)
    (line,) = check.stale([gone])
    assert line.startswith("gone: 'no such line' occurs 0 times")
