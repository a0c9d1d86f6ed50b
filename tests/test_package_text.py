"""The package's comments and docstrings give reasons, not history or test plumbing.

CONTRIBUTING.md's rule, checked on what ``lmcache_histate/`` and ``backends/`` install: git
keeps the history, so a "round N" or "issue N" in a module, or in the YAML and notes the
package ships, is a note that has gone stale; and code that calls itself a test hook
belongs in ``tests/support`` (the bundled trace sample's licence note may say it serves
tests: that is what the data is for, so only modules are checked for that).
"""

from __future__ import annotations

import re

from test_package_structure import PACKAGE_DIRS, ROOT

TEXT_SUFFIXES = {".py", ".yaml", ".yml", ".md"}

HISTORY = re.compile(r"\b(?:round|issue) #?\d+\b", re.IGNORECASE)
TEST_PLUMBING = re.compile(r"TEST HOOK|tests read|for tests\b", re.IGNORECASE)


def offending_lines(pattern: re.Pattern[str], suffixes: set[str]) -> list[str]:
    out = []
    for base in PACKAGE_DIRS.values():
        for path in sorted(base.rglob("*")):
            if path.suffix not in suffixes or "__pycache__" in path.parts:
                continue
            for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if pattern.search(line):
                    out.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()}")
    return out


def test_the_patterns_catch_what_they_name() -> None:
    # Hand-written lines, one per form the rule forbids, and two that must pass.
    assert HISTORY.search("# Before issue 9 round 4 this was a list")
    assert HISTORY.search("see Issue #12")
    assert not HISTORY.search("a TraceLab multi-round CSV; round r's prompt; round(x, 3)")
    assert TEST_PLUMBING.search("force_pressure_factor  # TEST HOOK")
    assert TEST_PLUMBING.search("kept because tests read it")
    assert not TEST_PLUMBING.search("back in RequestOutput (tests, the demo)")


def test_no_history_markers_in_the_package() -> None:
    assert offending_lines(HISTORY, TEXT_SUFFIXES) == []


def test_no_test_plumbing_in_the_package() -> None:
    assert offending_lines(TEST_PLUMBING, {".py"}) == []
