"""``benchmarks/claims.py``: the simulator's pages say what their result files say.

* ``compare``: "lower" only beyond the spread on all sessions AND both halves, else tie
  (hand-made spreads);
* ``check_page`` reports a block whose numbers differ from its file and a ranking word
  written outside a block (hand-made page and file);
* the real pages (README.md, benchmarks/README.md) against the recorded files: no
  problem. This reads JSON only; it runs no simulation.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from lmcache_histate.sim.repeats import Spread

CLAIMS = Path(__file__).resolve().parents[2] / "benchmarks" / "claims.py"


def _claims() -> ModuleType:
    spec = importlib.util.spec_from_file_location("claims", CLAIMS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("claims", module)  # its dataclass resolves its module by name
    spec.loader.exec_module(module)
    return module


def _set(h: tuple[float, float], v: tuple[float, float]) -> dict[str, dict[str, Spread]]:
    mean = lambda lo, hi: (lo + hi) / 2  # noqa: E731
    return {"histate": {"ttft_p99": Spread(mean(*h), *h, 5)},
            "vllm": {"ttft_p99": Spread(mean(*v), *v, 5)}}


def test_lower_only_beyond_the_spread_on_all_sessions_and_both_halves() -> None:
    compare = _claims().compare
    whole, a = _set((4.6, 5.0), (5.1, 5.6)), _set((4.4, 4.9), (5.0, 5.3))
    b_overlaps, b_lower = _set((4.5, 5.2), (4.8, 5.4)), _set((4.5, 4.7), (4.8, 5.4))
    assert compare([whole, a, b_lower], "histate", "vllm", "ttft_p99") == "lower"
    # Half b's ranges overlap (5.2 > 4.8): the whole-set lead does not carry: a tie.
    assert compare([whole, a, b_overlaps], "histate", "vllm", "ttft_p99") == "tie"
    assert compare([whole, a, b_lower], "vllm", "histate", "ttft_p99") == "higher"


def test_check_page_reports_a_stale_number_and_a_hand_written_ranking() -> None:
    claims = _claims()
    doc = {"doc": {"row": "histate", "baseline": "vllm",
                   "memory_gib": {"histate": 291.0, "vllm": 291.0}, "summary": [
                       {"scope": "last", "share": 0.05, "seeds": 10, "mean": -0.118,
                        "min": -0.165, "max": 0.004, "requests_per_h": 942.4}]}}
    rendered = claims.render_rewrite({"rewrite": doc["doc"]})
    assert rendered.startswith("Memory histate / vllm: 291 / 291 GiB.")
    assert ("| last | 5% | 942 | -11.8% [-16.5% … +0.4%] over 10 seeds "
            "| tie (the range spans 0) |") in rendered
    page = ("### Rewrite test\n\n<!-- claims:rewrite -->\n" + rendered + "<!-- /claims -->\n"
            "\n* HiState is ahead at 5 %.\n")
    problems = claims.check_page("P.md", page, {"rewrite": doc["doc"]})
    assert [str(p) for p in problems] == [
        "P.md: ranking word 'ahead' outside a claims block: '* HiState is ahead at 5 %.'"]
    stale = page.replace("-11.8%", "-15.0%")
    (problem,) = [p for p in claims.check_page("P.md", stale, {"rewrite": doc["doc"]})
                  if "differs" in p.what]
    assert "block 'rewrite' differs from its file: line 5" in problem.what


def test_the_pages_say_what_the_recorded_files_say() -> None:
    assert [str(p) for p in _claims().check()] == []


def test_a_pressure_cell_lists_a_row_only_where_both_halves_agree() -> None:
    """One cell; ``lru``'s p99 is below HiState's beyond the spread on all sessions and
    half a, but the ranges overlap on half b: with the halves it is not listed; without
    them it is, and the cell says "all only"."""
    def cell(lru_p99: tuple[float, float]) -> dict[str, object]:
        def m(lo: float, hi: float) -> dict[str, float]:
            return {"mean": (lo + hi) / 2, "min": lo, "max": hi, "n": 5}
        row = {k: m(1.0, 1.2) for k in ("sensitive_mean", "neutral_mean", "bulk_rate", "fill")}
        return {"name": "24 sessions, ×0.125", "sessions": 24, "factor": 0.125,
                "max_think_s": 572.0,
                "rows": {"histate": {**row, "ttft_p99": m(5.0, 5.4)},
                         "lru": {**row, "ttft_p99": m(*lru_p99)}}}

    claims = _claims()
    whole = {"repeats": 5, "cells": [cell((4.5, 4.9))]}
    halves = {"pressure-a": {"cells": [cell((4.4, 4.8))]},
              "pressure-b": {"cells": [cell((4.8, 5.1))]}}
    with_halves = claims.render_pressure({"pressure": whole, **halves}).splitlines()[2]
    assert with_halves.startswith("| 24 × 0.125 | 572 |")
    assert with_halves.endswith("| none; none; none | none; none; none |")
    alone = claims.render_pressure({"pressure": whole}).splitlines()[2]
    assert alone.startswith("| 24 × 0.125 (all only) | 572 |")
    assert alone.endswith("| lru; none; none | none; none; none |")
