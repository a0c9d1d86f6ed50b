"""``scripts/planted_mutants.py`` still applies to today's code: each mutant's ``old``
snippet occurs exactly once in its file (moving code a mutant patches would stop the
script at the first stale one; docs/testing.md §5). Running the mutants
themselves is ``make planted-mutants`` (minutes); this only keeps them applicable."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_SCRIPT = ROOT / "scripts" / "planted_mutants.py"
_spec = importlib.util.spec_from_file_location("planted_mutants", _SCRIPT)
assert _spec is not None and _spec.loader is not None
planted = importlib.util.module_from_spec(_spec)
sys.modules["planted_mutants"] = planted  # dataclasses resolve their module by name
_spec.loader.exec_module(planted)


def test_there_are_thirteen_with_distinct_names() -> None:
    assert len(planted.MUTANTS) == 13
    assert len({m.name for m in planted.MUTANTS}) == 13


@pytest.mark.parametrize("mutant", planted.MUTANTS, ids=lambda m: m.name)
def test_each_snippet_occurs_once_and_the_patch_changes_it(mutant: object) -> None:
    text = (ROOT / mutant.path).read_text()  # type: ignore[attr-defined]
    assert text.count(mutant.old) == 1, mutant.name  # type: ignore[attr-defined]
    assert mutant.new != mutant.old  # type: ignore[attr-defined]
