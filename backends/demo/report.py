"""The demo's report: per-request table, summary table and the HiState-vs-LRU line."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from .runs import RunResult
from .workload import DemoRequest

__all__ = ["report", "summarize"]


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
        ("run time incl. start-up (s)", "wall_s", "{:.1f}"),
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
    h, b = sums["histate"], sums["lru"]
    if h["ttft_mean_ms"] > 0 and h["ttft_p90_ms"] > 0:
        console.print(
            f"HiState vs stock LMCache (LRU): hit rate {100 * h['hit_rate']:.1f} % vs "
            f"{100 * b['hit_rate']:.1f} %; TTFT mean {h['ttft_mean_ms']:.0f} vs "
            f"{b['ttft_mean_ms']:.0f} ms (LRU / HiState = "
            f"{b['ttft_mean_ms'] / h['ttft_mean_ms']:.2f}), p90 {h['ttft_p90_ms']:.0f} vs "
            f"{b['ttft_p90_ms']:.0f} ms ({b['ttft_p90_ms'] / h['ttft_p90_ms']:.2f})."
        )
    counters = hs.server.get("counters", {})
    console.print(
        f"HiState server: pressure factor {hs.server.get('pressure_factor', 1.0):.2f}; "
        f"{sum(r['states_saved'] or 0 for r in hs.rows)} recurrent states saved by the "
        f"connector (LRU run: one per chunk stored), "
        f"{counters.get('kv_demoted', 0)} KV chunks demoted to disk. Settings: "
        + ", ".join(f"{k}={v}" for k, v in settings.items())
    )
    return {"settings": settings, "summary": sums,
            "requests": {r.variant.key: r.rows for r in results}}


