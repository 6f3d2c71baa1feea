"""Figures are labelled by date, commit and machine, not by a work period (issue 27).

The README, bench/NOTES.md and the file names under bench/results/ say when and where a figure
was measured with a date, a commit and a machine. A label that only the person who wrote it can
place ("this stop", "today", "yesterday", "round 2", a result file called ``...-final.json``)
goes stale the day after: these tests fail on one.
"""
from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Words that place a figure in a work period rather than at a date, commit and machine.
WORK_PERIOD = re.compile(
    r"\b(?:this|last|next|previous|that) (?:stop|session|round|phase|work period)\b"
    r"|\bstop's\b|\b(?:session|stop|round|phase) \d+\b"
    r"|\b(?:today|today's|yesterday|yesterday's|tonight)\b"
    r"|\bthis (?:morning|afternoon|evening|night)(?:'s)?\b", re.IGNORECASE)

#: Result names end in what was run: never in a relative label of the work that ran it.
RELATIVE_SUFFIX = re.compile(r"-(?:final|after|before|new|old|latest|session\d*|stop\d*|"
                             r"round\d*|phase\d*)(?:\.\w+)?$")


@pytest.mark.parametrize("path", ["README.md", "bench/NOTES.md"])
def test_figures_are_not_labelled_by_work_period(path):
    lines = (ROOT / path).read_text(encoding="utf-8").splitlines()
    found = [f"{path}:{n}: {line.strip()}" for n, line in enumerate(lines, 1)
             if WORK_PERIOD.search(line)]
    assert not found, "\n".join(found)


def test_result_files_are_named_by_date_machine_and_commit():
    wrong = []
    for entry in sorted((ROOT / "bench" / "results").iterdir()):
        name = entry.name
        if not re.match(r"20\d\d-\d\d-\d\d-", name) or not re.search(r"\b[0-9a-f]{7}\b", name) \
                or RELATIVE_SUFFIX.search(name):
            wrong.append(name)
    assert not wrong, wrong


def test_the_patterns_catch_what_they_are_for():
    assert WORK_PERIOD.search("6739a57 (before this stop)")
    assert WORK_PERIOD.search("across this morning's runs")
    assert WORK_PERIOD.search("85 ms yesterday")
    assert not WORK_PERIOD.search("alternating in one session (AMD EPYC, 2 cores)")
    assert not WORK_PERIOD.search("one run in a quiet phase of the machine")
    assert RELATIVE_SUFFIX.search("2026-12-01-amd-epyc-attention-76e5b5c-final.json")
    assert not RELATIVE_SUFFIX.search("2026-12-01-amd-epyc-attention-f4f15fe-run2.json")


#: A time or a speed-up in prose: ``3.1 ms``, ``0.3 s``, ``2x faster``, ``tens of microseconds``.
TIMING = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|us|µs|ns|s|sec|seconds|minutes)\b"
                    r"|\b\d+(?:\.\d+)?\s?x (?:faster|slower)\b")
#: The same in words, which prose may break over two lines.
TIMING_WORDS = re.compile(r"\b(?:tens|hundreds|thousands) of\s+(?:micro|milli|nano)?seconds\b")
#: Times that are settings or other libraries' numbers, not measurements of this code.
NOT_MEASUREMENTS = ("taken at most every 0.1 s",  # threads.py: the load sampling interval
                    "Hypothesis's default 200 ms deadline")  # testing.py: Hypothesis's setting


def test_no_timing_figures_in_the_packages_source():
    """Timing figures go stale in docstrings and comments: they live in bench/NOTES.md, with
    the date, commit and machine that measured them."""
    found = []
    for path in sorted(p for package in ("abftgemm", "attention")
                       for p in (ROOT / package).rglob("*") if p.suffix in (".py", ".cu", ".cuh")):
        lines = [re.sub(r"^\s*(?:#|//)?\s*", "", ln)
                 for ln in path.read_text(encoding="utf-8").splitlines()] + [""]
        for n, (line, after) in enumerate(itertools.pairwise(lines), 1):  # a figure split over two
            both = f"{line} {after}"
            words = TIMING_WORDS.search(both)
            if (TIMING.search(line) or words and words.start() < len(line)) \
                    and not any(s in both for s in NOT_MEASUREMENTS):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line}")
    assert not found, "\n".join(found)
