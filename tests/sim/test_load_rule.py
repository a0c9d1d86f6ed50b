"""The load rule and what a table says about load: halves, bulk rate, neutral set, cap.

* ``halves.in_half``: the two halves are disjoint and cover every session; a half of a
  Weka folder is staggered as densely as a whole one;
* ``report.bulk_rate`` and ``report.reuse_sensitive_neutral`` on hand-made numbers;
* ``load.calibrate``: the derived cap meets a reachable target and says when one is not;
  a config's ``target_rate_per_h`` is validated at load.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcache_histate.sim.config import ConfigError, SimSetup, load_setup
from lmcache_histate.sim.halves import in_half
from lmcache_histate.sim.load import LOW_S, calibrate
from lmcache_histate.sim.report import bulk_rate, reuse_sensitive_neutral
from lmcache_histate.sim.runner import load_sim_trace
from lmcache_histate.sim.server import RequestResult, RunResult


def test_halves_split_the_sample_and_stagger_each_half_from_zero() -> None:
    setup = SimSetup.paper(session_gap_s=60.0)
    whole = load_sim_trace("weka-sample", setup)
    a, b = (load_sim_trace("weka-sample", setup, half=h) for h in ("a", "b"))
    roots = {s.id for s in whole.sessions if s.parent is None}
    ra = {s.id for s in a.sessions if s.parent is None}
    rb = {s.id for s in b.sessions if s.parent is None}
    assert ra and rb and not ra & rb and ra | rb == roots
    assert a.num_requests + b.num_requests == whole.num_requests
    # The docstring's example: crc32(b"trace_0002") = 1,170,861,099, odd: half b.
    assert in_half("trace_0002", "b") and not in_half("trace_0002", "a")
    # Each half's k-th file starts at k x 60 s, as a whole folder's would.
    starts = sorted(s.requests[0].arrival for s in a.sessions if s.parent is None)
    assert starts == [60.0 * k for k in range(len(ra))]
    with pytest.raises(ValueError, match="half must be one of a, b"):
        in_half("trace_0002", "c")


def test_bulk_rate_by_hand() -> None:
    # The docstring's example: arrivals 0, 10, ..., 990 s; 5th / 95th percentiles
    # 49.5 s / 940.5 s: 90 requests in 891 s = 363.64 per hour.
    assert bulk_rate([10.0 * i for i in range(100)]) == pytest.approx(90 * 3600 / 891)
    # A straggler far out moves the whole-run rate, not the bulk one much.
    with_tail = [10.0 * i for i in range(99)] + [100_000.0]
    assert bulk_rate(with_tail) == pytest.approx(90 * 3600 / (940.5 - 49.5), rel=0.02)
    assert bulk_rate([5.0]) == 0.0


def _run(name: str, hits: list[int], capacity: float) -> RunResult:
    res = [RequestResult("s", i, 100, 1, h, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, {}, {})
           for i, h in enumerate(hits)]
    return RunResult(name, "t", res, {}, 0.0, 0.0, 0, capacity_bytes=capacity)


def test_neutral_set_compares_the_rows_of_the_largest_finite_memory() -> None:
    # Hit % per request:         0   1   2   3
    runs = {"histate": _run("histate", [90, 90, 93, 90], 208.0),
            "vllm": _run("vllm", [90, 86, 96, 90], 208.0),
            "sglang": _run("sglang", [90, 90, 90, 95], 208.0),
            "marconi": _run("marconi", [0, 0, 0, 0], 45.0),
            "unlimited": _run("unlimited", [99, 99, 99, 99], float("inf"))}
    # 0: all 90 -> no; 1: 90 vs 86, 4 points -> no; 2: 96 − 90 = 6 -> yes; 3: 5 -> yes.
    # Marconi (45) and unlimited (∞) do not enter: they would put every request in.
    assert reuse_sensitive_neutral(runs) == {("s", 2), ("s", 3)}
    assert reuse_sensitive_neutral({"histate": runs["histate"],
                                    "marconi": runs["marconi"]}) is None


def test_the_derived_cap_meets_a_reachable_target_and_flags_one_that_is_not() -> None:
    setup = SimSetup.paper(max_sessions=6, session_gap_s=10.0)
    trace = load_sim_trace("weka-sample", setup)
    fast = calibrate(trace, setup, 1e9)  # faster than any cap can replay
    assert (fast.max_think_s, fast.reached) == (LOW_S, False)
    assert "NOT reached" in fast.line()
    # Half the rate the smallest cap gives: reachable, and met from below.
    cal = calibrate(trace, setup, fast.bulk_rate / 2)
    assert cal.reached and cal.bulk_rate <= fast.bulk_rate / 2
    assert cal.max_think_s > LOW_S


def test_a_bad_target_rate_is_refused_naming_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("target_rate_per_h: -5\n")
    with pytest.raises(ConfigError, match="target_rate_per_h must be > 0 requests per hour"):
        load_setup(cfg)
    cfg.write_text("target_rate_per_h: fast\n")
    with pytest.raises(ConfigError, match="target_rate_per_h: expected a number"):
        load_setup(cfg)
