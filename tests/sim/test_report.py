"""Report metrics: the reuse-sensitive definition, percentiles, hit rate, speedups."""

from __future__ import annotations

import math

import pytest

from lmcache_histate.sim.report import (
    TtftStats,
    markdown,
    percentile,
    reuse_sensitive,
    summarize,
    token_hit_rate,
)
from lmcache_histate.sim.server import RequestResult, RunResult


def res(sid: str, i: int, hit: int, tokens: int = 100, ttft: float = 1.0) -> RequestResult:
    return RequestResult(sid, i, tokens, 1, hit, 0.0, 0.0, 0.0, 0.0, 0.0, ttft,
                         {"disk": hit}, {"gpu": tokens - hit})


def run(name: str, hits: list[int], ttfts: list[float] | None = None) -> RunResult:
    ttfts = ttfts or [1.0] * len(hits)
    return RunResult(name, "t", [res("s", i, h, ttft=t) for i, (h, t) in
                                 enumerate(zip(hits, ttfts, strict=True))], {}, 0.0, 0.0, 0)


def test_reuse_sensitive_by_hand() -> None:
    # Per request (hit % of 100 tokens):   0    1    2    3    4    5   6
    unlimited = run("unlimited", [90, 90, 90, 90, 50, 0, 90])
    offload = run("vllm-cpu-disk-offload", [90, 86, 85, 90, 50, 0, 90])
    histate = run("histate", [90, 86, 85, 95, 46, 0, 84])
    # 0: equal everywhere -> no. 1: 4 points below unlimited, same as HiState -> no.
    # 2: exactly 5 points below unlimited -> yes. 3: HiState 5 points above -> yes.
    # 4: HiState 4 points below offload, offload = unlimited -> no. 5: all miss -> no.
    # 6: HiState 6 points *below* offload (offload = unlimited) -> yes: the difference
    #    counts both ways.
    runs = {"histate": histate, "vllm-cpu-disk-offload": offload, "unlimited": unlimited}
    assert reuse_sensitive(runs) == {("s", 2), ("s", 3), ("s", 6)}
    # Without one of the three rows there is no definition.
    assert reuse_sensitive({"histate": histate, "unlimited": unlimited}) is None


def test_percentile_interpolates() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert math.isnan(percentile([], 50))


def test_hit_rate_and_speedups() -> None:
    h = run("histate", [50, 100], [1.0, 2.0])
    b = run("base", [0, 100], [2.0, 4.0])
    assert token_hit_rate(h.results) == 0.75
    sums = summarize({"histate": h, "base": b}, {("s", 1)})
    assert sums[0].speedup["mean"] == 1.0
    assert sums[1].speedup["mean"] == pytest.approx(2.0)
    assert sums[1].speedup_sensitive["p99"] == pytest.approx(2.0)
    assert sums[1].sensitive == TtftStats(1, 4.0, 4.0, 4.0, 4.0)
    assert sums[0].read_bytes == {"disk": 150}
    table = markdown(sums)
    assert "| histate | – | – | 75.00 |" in table and "Reuse-sensitive requests (1)" in table


def test_every_table_says_memory_duration_and_rate() -> None:
    """Memory per row in every table (GiB; ∞ for the unlimited reference), the duration and
    request rate above them. 2 requests over 1,800 s = 0.5 h → 4 requests/h; over 3,600 s
    → 2/h: the line gives the range over the rows."""
    from dataclasses import replace

    h = replace(run("histate", [50, 100]), makespan=1800.0, capacity_bytes=291 * 2**30)
    b = replace(run("vllm-align-gpu", [0, 100]), makespan=3600.0, capacity_bytes=45 * 2**30)
    u = replace(run("unlimited", [50, 100]), makespan=1800.0, capacity_bytes=math.inf)
    sums = summarize({"histate": h, "vllm-align-gpu": b, "unlimited": u}, None)
    assert [s.request_rate for s in sums] == [4.0, 2.0, 4.0]
    same = summarize({"histate": h, "vllm-align-gpu": replace(b, capacity_bytes=291 * 2**30)},
                     None)
    table = markdown(sums, same)
    assert table.startswith("Simulated duration 0.50–1.00 h, 2 requests: 2–4 requests/h")
    # No ``used_*`` stats: 0 % full; the unlimited row's fill is undefined (–).
    assert "| histate | 291 | 0 | 75.00 |" in table
    assert "| vllm-align-gpu | 45 | 0 | 50.00 |" in table and "| unlimited | ∞ | – |" in table
    assert "| histate | 291 | 0.0 | 0.0 | 0.0 | 0.0 | 0.0 | 0.0 |" in table  # traffic (B, not GiB)
    assert "Same total memory: every row with 291 GiB" in table
    assert "| vllm-align-gpu | 291 | 0 | 50.00 |" in table


def test_markdown_tables_cell_by_cell() -> None:
    """Every table of the report for two hand-built rows, each cell worked out by hand.

    histate (2 GiB): requests hit 50 and 100 of 100 tokens, TTFT 1 s and 3 s (the second
    a rewrite, and the one reuse-sensitive request); it reads 0.5 GiB from CPU and 1 GiB
    from disk and writes 0.25 GiB to the GPU per request.
    lru (1 GiB): hits 0 and 100, TTFT 2 s and 6 s; reads 1 GiB from CPU, writes 1 GiB to
    the GPU per request and 0.5 GiB to disk once. Both replays last 3,600 s.

    token hit: 150/200 = 75.00 %, 100/200 = 50.00 %. TTFT percentiles of two values
    interpolate: p50 = mean, p95 = lo + 0.95·(hi − lo), p99 = lo + 0.99·(hi − lo):
    histate 2.000 / 2.000 / 2.900 / 2.980; lru 4.000 / 4.000 / 5.800 / 5.960; lru ×HiState:
    p99 5.96/2.98 = 2.00, mean 4/2 = 2.00. Rate: 2 requests in 1 h = 2 requests/h; over
    the bulk: arrivals 0 and 1,800 s, 5th / 95th percentiles 90 and 1,710 s, 0.9 × 2
    requests in 1,620 s = 4 requests/h. Full at the end: histate holds 1 GiB of 2 (50 %),
    lru 0.25 GiB of 1 (25 %). The neutral set is request 0 alone: histate 1 s, lru 2 s.
    """
    from dataclasses import replace

    gib = 2**30

    def r(i: int, hit: int, ttft: float, read: dict[str, int], written: dict[str, int],
          rewrite: bool = False) -> RequestResult:
        return RequestResult("s", i, 100, 1, hit, 1800.0 * i, 0.0, 0.0, 0.0, 0.0, ttft, read,
                             written, rewrite)

    h = RunResult("histate", "t", [
        r(0, 50, 1.0, {"cpu": gib // 2}, {"gpu": gib // 4}),
        r(1, 100, 3.0, {"disk": gib}, {"gpu": gib // 4}, rewrite=True),
    ], {"used_gpu": gib}, 3600.0, 0.0, 0, capacity_bytes=2 * gib)
    b = RunResult("lru", "t", [
        r(0, 0, 2.0, {}, {"gpu": gib}),
        r(1, 100, 6.0, {"cpu": gib}, {"gpu": gib, "disk": gib // 2}, rewrite=True),
    ], {"used_cpu": gib // 4}, 3600.0, 0.0, 0, capacity_bytes=gib)
    sums = summarize({"histate": h, "lru": b}, {("s", 1)}, neutral={("s", 0)})
    same = summarize({"histate": h, "lru": replace(b, capacity_bytes=2 * gib)}, None)
    load = ("Simulated duration 1.00 h, 2 requests: 2 requests/h over the run, 4/h over its "
            "bulk (the central 90% of requests; ranges over the rows: closed loop).")
    head = ("| policy | memory (GiB) | full at end % | token hit % | TTFT mean (s) | p50 | p95 "
            "| p99 | p99 ×HiState | mean ×HiState |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    assert markdown(sums, same) == (
        f"{load}\n\n{head}"
        "| histate | 2 | 50 | 75.00 | 2.000 | 2.000 | 2.900 | 2.980 | 1.00 | 1.00 |\n"
        "| lru | 1 | 25 | 50.00 | 4.000 | 4.000 | 5.800 | 5.960 | 2.00 | 2.00 |\n"
        "\nReuse-sensitive requests (1):\n\n"
        "| policy | memory (GiB) | mean (s) | p50 | p95 | p99 | p99 ×HiState | mean ×HiState |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|\n"
        "| histate | 2 | 3.000 | 3.000 | 3.000 | 3.000 | 1.00 | 1.00 |\n"
        "| lru | 1 | 6.000 | 6.000 | 6.000 | 6.000 | 2.00 | 2.00 |\n"
        "\nReuse-sensitive requests, policy-neutral set (1: hit rates ≥ 5 points apart between "
        "any two rows of the largest finite memory):\n\n"
        "| policy | memory (GiB) | mean (s) | p50 | p95 | p99 |\n"
        "|---|---:|---:|---:|---:|---:|\n"
        "| histate | 2 | 1.000 | 1.000 | 1.000 | 1.000 |\n"
        "| lru | 1 | 2.000 | 2.000 | 2.000 | 2.000 |\n"
        "\nRewriting requests:\n\n"
        "| policy | memory (GiB) | n | mean TTFT (s) | p50 | p99 |\n"
        "|---|---:|---:|---:|---:|---:|\n"
        "| histate | 2 | 1 | 3.000 | 3.000 | 3.000 |\n"
        "| lru | 1 | 1 | 6.000 | 6.000 | 6.000 |\n"
        "\nTier traffic (GiB) and state-capture time (s, summed over the requests):\n\n"
        "| policy | memory (GiB) | read cpu | read disk | written gpu | written cpu "
        "| written disk | capture (s) |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|\n"
        "| histate | 2 | 0.5 | 1.0 | 0.5 | 0.0 | 0.0 | 0.0 |\n"
        "| lru | 1 | 1.0 | 0.0 | 2.0 | 0.0 | 0.5 | 0.0 |\n"
        "\nSame total memory: every row with 2 GiB (each row's slowest tier grown to "
        f"HiState's total; a GPU-only row gets that much GPU). {load}\n\n{head}"
        "| histate | 2 | 50 | 75.00 | 2.000 | 2.000 | 2.900 | 2.980 | 1.00 | 1.00 |\n"
        "| lru | 2 | 12 | 50.00 | 4.000 | 4.000 | 5.800 | 5.960 | 2.00 | 2.00 |\n"
    )
