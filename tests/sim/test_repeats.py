"""Repeated runs: jitter of the timing, mean [min–max] cells, wins only beyond the spread."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmcache_histate.cli import main
from lmcache_histate.sim.experiment import SimulateOptions, run_simulate
from lmcache_histate.sim.repeats import (
    Spread,
    aggregate,
    jitter_trace,
    repeats_markdown,
    verdict,
)
from lmcache_histate.sim.report import PolicySummary, TtftStats
from lmcache_histate.sim.trace_model import Request, Session, Trace

GIB = 1 << 30


# ------------------------------------------------------------------ spread and wins
def test_spread_cells_and_the_win_rule_on_hand_made_numbers() -> None:
    """HiState's p99 4.6, 4.8, 5.0 s: mean 4.8, range 4.6–5.0. A row at 5.1–5.3 s loses
    beyond it (5.0 < 5.1: +); one at 4.9, 5.0, 5.4 s has a higher mean (5.1) but the
    ranges overlap (=); touching ranges (5.0–5.2 against ≤ 5.0) overlap too; one at
    4.0–4.5 s wins (4.5 < 4.6: −)."""
    base = Spread.of([4.6, 4.8, 5.0])
    assert base.fmt() == "4.800 [4.600–5.000]"
    assert Spread.of([4.8]).fmt() == "4.800"  # one run: no range
    assert Spread.of([0.5, 0.6]).fmt(2, 100) == "55.00 [50.00–60.00]"
    assert verdict(Spread.of([5.1, 5.2, 5.3]), base) == "+"
    assert verdict(Spread.of([4.9, 5.0, 5.4]), base) == "="
    assert verdict(Spread.of([5.0, 5.2]), base) == "="
    assert verdict(Spread.of([4.0, 4.2, 4.5]), base) == "−"
    assert Spread.of([float("nan")]).fmt() == "–"


def _summary(name: str, hit: float, mean: float, p99: float) -> PolicySummary:
    return PolicySummary(
        name=name, requests=100, token_hit_rate=hit,
        ttft=TtftStats(100, mean, mean, p99, p99), makespan_s=3600.0, capacity_bytes=2 * GIB,
    )


def test_repeated_table_by_hand() -> None:
    """Three repeats of three rows (hand-made numbers):

    * histate: hit 50 % each time, mean 1.0 / 1.1 / 1.2 s, p99 4.6 / 4.8 / 5.0 s;
    * lru: hit 40 / 50 / 60 %, mean 1.3 / 1.4 / 1.5 s, p99 4.9 / 5.0 / 5.4 s: mean
      1.4 / 1.1 = 1.27, HiState's max 1.2 below lru's min 1.3 → +; p99 5.1 / 4.8 =
      1.06, ranges overlap (4.9 < 5.0) → =;
    * fast: mean 0.5 / 0.6 / 0.7 s (0.6 / 1.1 = 0.55, its max 0.7 below HiState's min
      1.0 → −), p99 3.0 / 3.1 / 3.2 s (3.1 / 4.8 = 0.65, 3.2 < 4.6 → −).
    No row holds a byte (``used_bytes`` 0): full at the end 0 [0–0] %. No row has
    reuse-sensitive numbers, so those tables are left out."""
    runs = [
        [_summary("histate", 0.5, m, p), _summary("lru", h, lm, lp), _summary("fast", 0.5, fm, fp)]
        for m, p, h, lm, lp, fm, fp in [
            (1.0, 4.6, 0.4, 1.3, 4.9, 0.5, 3.0),
            (1.1, 4.8, 0.5, 1.4, 5.0, 0.6, 3.1),
            (1.2, 5.0, 0.6, 1.5, 5.4, 0.7, 3.2),
        ]
    ]
    rows = aggregate(runs)
    assert [r.name for r in rows] == ["histate", "lru", "fast"]
    table = repeats_markdown(rows, 3, 0.1).splitlines()
    assert "| histate | 2 | 0 [0–0] | " \
           "50.00 [50.00–50.00] | 1.100 [1.000–1.200] | 4.800 [4.600–5.000] " \
           "| 1.00 = | 1.00 = |" in table
    assert "| lru | 2 | 0 [0–0] | " \
           "50.00 [40.00–60.00] | 1.400 [1.300–1.500] | 5.100 [4.900–5.400] " \
           "| 1.27 + | 1.06 = |" in table
    assert "| fast | 2 | 0 [0–0] | " \
           "50.00 [50.00–50.00] | 0.600 [0.500–0.700] | 3.100 [3.000–3.200] " \
           "| 0.55 − | 0.65 − |" in table
    assert not any("Reuse-sensitive" in line for line in table)
    assert any("3 repeats, timing jittered ±10 %" in line for line in table)


def test_every_repeat_must_have_the_same_rows() -> None:
    with pytest.raises(ValueError, match="same rows"):
        aggregate([[_summary("a", 0.5, 1, 2)], [_summary("b", 0.5, 1, 2)]])


# ------------------------------------------------------------------ jitter
def _req(sid: str, i: int, arrival: float, think: float) -> Request:
    return Request(sid, i, arrival, think, 1000, 10, (1, 2))


def _tiny() -> Trace:
    """Three sessions starting 0, 10 and 30 s (gaps 10 and 20: median 15 s); a subagent
    of the second 5 s after its start; think times 100 s and 0 s."""
    return Trace("tiny", 100, (
        Session("a", None, (_req("a", 0, 0.0, 0.0), _req("a", 1, 50.0, 100.0))),
        Session("b", None, (_req("b", 0, 10.0, 0.0),)),
        Session("b/sub", "b", (_req("b/sub", 0, 15.0, 0.0),)),
        Session("c", None, (_req("c", 0, 30.0, 0.0),)),
    ))


def test_jitter_moves_starts_and_think_times_within_their_bounds() -> None:
    """Jitter 0.1 and a median start gap of 15 s: every root starts 0–3 s later (U(0, 0.2)
    × 15), the subagent keeps its 5 s from its parent, the 100 s think time stays within
    90–110 s and a zero think time stays 0; the same (seed, repeat) gives the same trace,
    another repeat another one; jitter 0 changes nothing."""
    trace = _tiny()
    j = jitter_trace(trace, seed=0, repeat=0, jitter=0.1)
    by = {s.id: s for s in j.sessions}
    for sid, start in (("a", 0.0), ("b", 10.0), ("c", 30.0)):
        assert start <= by[sid].requests[0].arrival <= start + 3.0
    assert by["b/sub"].requests[0].arrival - by["b"].requests[0].arrival == pytest.approx(5.0)
    assert 90.0 <= by["a"].requests[1].think_time <= 110.0
    assert by["a"].requests[0].think_time == 0.0
    assert by["a"].requests[0].chunk_hashes == (1, 2)  # only the timing moves
    assert jitter_trace(trace, 0, 0, 0.1) == j
    assert jitter_trace(trace, 0, 1, 0.1) != j
    assert jitter_trace(trace, 0, 0, 0.0) == trace
    with pytest.raises(ValueError, match=r"jitter must be in \[0, 1\)"):
        jitter_trace(trace, 0, 0, 1.0)


# ------------------------------------------------------------------ the command
def test_simulate_repeats_reports_mean_and_range_of_its_runs(tmp_path: Path) -> None:
    """Two repeats of two rows on the bundled sample: each JSON metric is the mean, min
    and max of the two runs' own values, the runs differ (the timing moved), and every
    row of one repeat replayed the same timing (lru and histate see the same requests)."""
    exp = run_simulate(SimulateOptions(out=str(tmp_path), policies="histate,lru", plots=False,
                                       repeats=2))
    doc = json.loads((tmp_path / "report.json").read_text())
    assert (doc["repeats"], doc["jitter"], doc["meta"]["repeats"]) == (2, 0.1, 2)
    for row in doc["policies"]:
        runs = row["runs"]
        assert len(runs) == 2
        p99 = [r["ttft"]["p99"] for r in runs]
        m = row["metrics"]["ttft_p99"]
        assert (m["mean"], m["min"], m["max"], m["n"]) == (
            pytest.approx((p99[0] + p99[1]) / 2), min(p99), max(p99), 2)
    first, second = doc["policies"][0]["runs"]
    assert first["makespan_s"] != second["makespan_s"]
    assert [r["requests"] for r in doc["policies"][0]["runs"]] == \
           [r["requests"] for r in doc["policies"][1]["runs"]]
    assert "2 repeats" in exp.table and "[" in exp.table


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--repeats", "0"], "--repeats must be ≥ 1, got 0"),
        (["--repeats", "2", "--sweep"], "--repeats K > 1 does not combine with --sweep"),
        (["--repeats", "2", "--jitter", "1.5"], "--jitter must be in [0, 1), got 1.5"),
    ],
)
def test_bad_repeats_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["simulate", "--no-plots", "--policies", "lru", "--out", str(tmp_path),
                 *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
