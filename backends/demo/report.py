"""The demo's report: per-request table, summary table and the HiState-vs-LRU line.

The line gives a TTFT ratio only where the hits differ (``compare``) and always with its
spread over sessions; with equal hits the runs did the same work and a ratio would only
measure the machine.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from .runs import RunResult
from .workload import DemoRequest

__all__ = ["HIT_TIE_POINTS", "compare", "comparison_line", "report", "summarize"]


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(result: RunResult) -> dict[str, Any]:
    rows = result.rows
    ttft = [r["ttft_s"] * 1000 for r in rows]
    prompt = sum(r["prompt_tokens"] for r in rows)
    cached = sum(r["cached_tokens"] for r in rows)
    return {
        "requests": len(rows),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "computed_tokens": prompt - cached,
        "ttft_mean_ms": statistics.fmean(ttft) if ttft else 0.0,
        "ttft_p50_ms": _pct(ttft, 0.5) if ttft else 0.0,
        "ttft_p90_ms": _pct(ttft, 0.9) if ttft else 0.0,
        "ttft_max_ms": max(ttft) if ttft else 0.0,
        "disk_files": result.disk_files,
        "disk_mb": result.disk_bytes / 1e6,
        "wall_s": result.seconds,
    }


HIT_TIE_POINTS = 5.0
"""Hit rates closer than this (percentage points of prompt tokens) tie: the runs computed
about the same tokens, so a TTFT ratio between them measures the machine, not the cache
(the reuse-sensitive threshold of ``sim.report``)."""


def compare(ours: Sequence[dict[str, Any]], theirs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """HiState's rows against a baseline's (same requests, same order), for the summary line.

    ``hits_tie``: hit rates within :data:`HIT_TIE_POINTS`; then no ratio is given. Else
    ``ratio`` = the baseline's mean TTFT / ours, with its spread over sessions (``lo``,
    ``hi``: the same ratio per session, each session's requests only) and ``verdict``:
    ``faster`` / ``slower`` when every session's ratio lies above / below 1, else ``tie``."""
    def rate(rows: Sequence[dict[str, Any]]) -> float:
        return 100 * sum(r["cached_tokens"] for r in rows) / max(
            sum(r["prompt_tokens"] for r in rows), 1)

    def ratio(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> float:
        return (statistics.fmean(b["ttft_s"] for _, b in pairs)
                / statistics.fmean(a["ttft_s"] for a, _ in pairs))

    out: dict[str, Any] = {"hit_rate": rate(ours), "baseline_hit_rate": rate(theirs)}
    out["hits_tie"] = abs(out["hit_rate"] - out["baseline_hit_rate"]) < HIT_TIE_POINTS
    if out["hits_tie"]:
        return out
    pairs = list(zip(ours, theirs, strict=True))
    sessions = sorted({a["session"] for a, _ in pairs})
    per_session = [ratio([(a, b) for a, b in pairs if a["session"] == s]) for s in sessions]
    out.update(ratio=ratio(pairs), lo=min(per_session), hi=max(per_session),
               sessions=len(sessions))
    out["verdict"] = ("faster" if out["lo"] > 1 else "slower" if out["hi"] < 1 else "tie")
    return out


def comparison_line(c: dict[str, Any]) -> str:
    """The summary sentence of :func:`compare`: no ratio where hits tie, else the ratio with
    its spread over sessions and what it supports."""
    hits = f"hit rate {c['hit_rate']:.1f} % vs {c['baseline_hit_rate']:.1f} %"
    if c["hits_tie"]:
        return (f"HiState vs stock LMCache (LRU): {hits}: the hits tie (within "
                f"{HIT_TIE_POINTS:g} points), so the runs did about the same work and no TTFT "
                "ratio is given; their TTFT differences are this machine's noise.")
    said = {"faster": "HiState faster in every session",
            "slower": "LRU faster in every session",
            "tie": "a tie: the sessions disagree"}[c["verdict"]]
    return (f"HiState vs stock LMCache (LRU): {hits}; TTFT mean LRU / HiState = "
            f"{c['ratio']:.2f} [{c['lo']:.2f} – {c['hi']:.2f} over {c['sessions']} sessions]: "
            f"{said}.")


def _short(session: str) -> str:
    return session.removeprefix("trace_")


def report(console: Any, workload: Sequence[DemoRequest], results: Sequence[RunResult],
           settings: dict[str, Any]) -> dict[str, Any]:
    from rich.table import Table

    by_key = {r.variant.key: r for r in results}
    hs = by_key["histate"]
    order = [r.variant for r in results]
    names = " / ".join(
        {"histate": "HS", "histate-every": "HS-all", "lru": "LRU"}[v.key] for v in order
    )
    table = Table(title="Per request, in replay order "
                        "(HS = HiState, HS-all = HiState with a state at every chunk, "
                        "LRU = stock LMCache)")
    table.add_column("#", justify="right")
    table.add_column("session")
    table.add_column("turn", justify="right")
    table.add_column("prompt", justify="right")
    table.add_column(f"cached tokens {names}", justify="right")
    table.add_column(f"TTFT ms {names}", justify="right")
    table.add_column("HS states", justify="right")
    for i, rows in enumerate(zip(*(r.rows for r in results), strict=True)):
        first = rows[0]
        table.add_row(
            str(i + 1), _short(first["session"]), str(first["turn"] + 1),
            str(first["prompt_tokens"]),
            " / ".join(str(r["cached_tokens"]) for r in rows),
            " / ".join(f"{r['ttft_s'] * 1000:.0f}" for r in rows),
            str(hs.rows[i]["states_saved"]),
        )
    console.print(table)

    sums = {r.variant.key: summarize(r) for r in results}
    summary = Table(title="Summary")
    summary.add_column("")
    for r in results:
        summary.add_column(r.variant.title, justify="right")
    lines = [
        ("requests", "requests", "{:d}"),
        ("prompt tokens", "prompt_tokens", "{:,d}"),
        ("cached tokens (hit rate)", None, None),
        ("tokens computed", "computed_tokens", "{:,d}"),
        ("TTFT mean (ms)", "ttft_mean_ms", "{:.0f}"),
        ("TTFT p50 (ms)", "ttft_p50_ms", "{:.0f}"),
        ("TTFT p90 (ms)", "ttft_p90_ms", "{:.0f}"),
        ("TTFT max (ms)", "ttft_max_ms", "{:.0f}"),
        ("disk tier at the end (files / MB)", None, None),
        ("start-up + own requests (s)", "wall_s", "{:.1f}"),
    ]
    for label, key, fmt in lines:
        cells = []
        for r in results:
            s = sums[r.variant.key]
            if label.startswith("cached"):
                cells.append(f"{s['cached_tokens']:,d} ({100 * s['hit_rate']:.1f} %)")
            elif label.startswith("disk"):
                cells.append(f"{s['disk_files']} / {s['disk_mb']:.1f}")
            else:
                cells.append(fmt.format(s[key]))  # type: ignore[union-attr]
        summary.add_row(label, *cells)
    console.print(summary)
    versus = compare(hs.rows, by_key["lru"].rows)
    console.print(comparison_line(versus))
    counters = hs.server.get("counters", {})
    # What the HiState servers wrote into vLLM's blocks, beside what vLLM reported cached
    # (its own prefix cache is emptied after every request, so all of it came from them).
    loaded = {r.variant.key: int(r.server.get("counters", {}).get("loaded_tokens", 0))
              for r in results if r.variant.policy == "histate"}
    console.print(
        f"HiState server: pressure factor {hs.server.get('pressure_factor', 1.0):.2f}; "
        f"{sum(r['states_saved'] or 0 for r in hs.rows)} recurrent states saved by the "
        f"connector (LRU run: one per chunk stored), "
        f"{counters.get('kv_demoted', 0)} KV chunks demoted to disk; loaded into vLLM "
        f"{loaded['histate']:,d} tokens (vLLM's cached tokens: "
        f"{sums['histate']['cached_tokens']:,d}). Settings: "
        + ", ".join(f"{k}={v}" for k, v in settings.items())
    )
    return {"settings": settings, "summary": sums, "versus_lru": versus,
            "server_loaded_tokens": loaded,
            "requests": {r.variant.key: r.rows for r in results}}


