"""The AVX2 re-run's selection (Makefile ``test-avx2``, docs/testing.md 3.3) cannot go stale.

``make test-avx2`` runs ``-m vllm_layout`` over the files in ``VLLM_TESTS`` only (collecting
all of ``tests/live`` costs more than the pure tests it would skip), so a test marked
``vllm_layout`` in a file missing from that list would silently run once.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def vllm_tests(makefile: str) -> set[str]:
    """The paths of ``VLLM_TESTS = a b \\`` (continued lines included)."""
    match = re.search(r"^VLLM_TESTS\s*=((?:[^\n]*\\\n)*[^\n]*)$", makefile, re.MULTILINE)
    assert match, "no VLLM_TESTS in the Makefile"
    return set(match.group(1).replace("\\\n", " ").split())


def test_the_makefile_list_is_read_across_continued_lines() -> None:
    text = "X = 1\nVLLM_TESTS = tests/a.py \\\n    tests/b.py \\\n tests/c.py\nY = 2\n"
    assert vllm_tests(text) == {"tests/a.py", "tests/b.py", "tests/c.py"}


def test_every_file_with_a_layout_test_is_in_the_avx2_rerun_and_no_other() -> None:
    listed = vllm_tests((ROOT / "Makefile").read_text())
    marked = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
              if re.search(r"^@pytest\.mark\.vllm_layout$", p.read_text(), re.MULTILINE)}
    assert marked == listed, {"marked, not listed": marked - listed,
                              "listed, nothing marked": listed - marked}
