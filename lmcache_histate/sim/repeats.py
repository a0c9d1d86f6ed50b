"""Repeated runs: seeded jitter of a trace's timing, each metric's mean and spread, wins.

One replay is one draw of the timing: moving every session start by 2 % of the gap
between them moves a p99 by several tenths of a second, so a single run cannot tell a
policy's effect from the luck of who queued behind whom. ``histate simulate --repeats
K`` therefore replays the trace K times, each time with its timing jittered, and
reports every metric as the mean and the range (min–max) over the K runs.

* **Jitter** (``jitter_trace``): in repeat ``r`` every root session's start moves later
  by ``U(0, 2j)·g`` (±``j·g`` around a common delay ``j·g``, so no start moves before
  the trace's first), where ``g`` is the median gap between consecutive root-session starts
  (``session_gap_s`` for a staggered Weka folder; 0 when all start together, then starts
  stay put), and its subagents move with it (they keep their offset from the parent);
  every request's think time is scaled by ``1 + U(−j, j)``. The draws come from
  ``random.Random(f"jitter:{seed}:{r}")``: the same ``seed`` gives the same K traces, so
  every row of a repeat replays exactly the same timing, and a rerun gives the same
  table. ``j`` (``--jitter``) defaults to 0.1. With ``K = 1`` nothing is jittered: the
  single run is the trace as given.
* **Spread** (``Spread``): mean, min and max of a metric over the repeats.
* **Wins** (``verdict``, lower is better, as for every TTFT): a row beats another only
  where the two ranges do not overlap (its max below the other's min); otherwise the
  difference is within the spread and neither wins. Non-overlapping ranges of K runs
  each are rarer by chance than any difference of means, which is what a win must be.

Example (hand-made numbers): HiState's p99 over 3 repeats 4.6, 4.8, 5.0 s gives
``4.800 [4.600–5.000]``; a row at 5.1, 5.2, 5.3 s (mean 5.2) loses beyond the spread
(5.0 < 5.1: mark ``+`` for HiState); one at 4.9, 5.0, 5.4 s (mean 5.1, higher) is
within it (``=``).
"""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .config import SimSetup
from .report import (
    HISTATE,
    PolicySummary,
    jsonable,
    load_line,
    memory_cell,
    pyplot,
    reuse_sensitive,
    reuse_sensitive_neutral,
    summarize,
)
from .runner import Factory, run_policies
from .trace_model import Session, Trace

__all__ = [
    "DEFAULT_JITTER",
    "METRICS",
    "RepeatedRow",
    "Spread",
    "aggregate",
    "jitter_trace",
    "repeats_json",
    "repeats_markdown",
    "run_repeats",
    "verdict",
    "write_repeats_report",
]

DEFAULT_JITTER = 0.1


def _roots(trace: Trace) -> list[Session]:
    """Sessions the server admits on their own (``server._eligible_order``'s rule)."""
    ids = {s.id for s in trace.sessions}
    return [s for s in trace.sessions if s.parent is None or s.parent not in ids]


def _median_start_gap(roots: Sequence[Session]) -> float:
    starts = sorted(s.requests[0].arrival for s in roots if s.requests)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    return statistics.median(gaps) if gaps else 0.0


def jitter_trace(trace: Trace, seed: int, repeat: int, jitter: float = DEFAULT_JITTER) -> Trace:
    """Repeat ``repeat``'s copy of ``trace`` (module docstring: starts and think times)."""
    if not 0.0 <= jitter < 1.0:
        raise ValueError(f"jitter must be in [0, 1), got {jitter}")
    rng = random.Random(f"jitter:{seed}:{repeat}")
    roots = _roots(trace)
    gap = _median_start_gap(roots)
    # Roots first, in trace order, then the think times in trace order: the draws depend
    # on the trace alone, so every row of a repeat replays the same timing.
    shift = {s.id: rng.uniform(0.0, 2.0 * jitter) * gap for s in roots}
    sessions: list[Session] = []
    for s in trace.sessions:
        delta = shift[s.id] if s.id in shift else shift.get(s.parent or "", 0.0)
        reqs = tuple(
            replace(
                r, arrival=r.arrival + delta,
                think_time=r.think_time * (1.0 + rng.uniform(-jitter, jitter)),
            )
            for r in s.requests
        )
        sessions.append(replace(s, requests=reqs))
    return Trace(trace.name, trace.chunk_tokens, tuple(sessions))


@dataclass(frozen=True, slots=True)
class Spread:
    """A metric over the repeats: its mean, min and max (``n`` runs)."""

    mean: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        vals = [v for v in values if not math.isnan(v)]
        if not vals:
            return cls(math.nan, math.nan, math.nan, 0)
        return cls(sum(vals) / len(vals), min(vals), max(vals), len(vals))

    def fmt(self, digits: int = 3, scale: float = 1.0) -> str:
        if self.n == 0:
            return "–"
        mean = f"{self.mean * scale:.{digits}f}"
        if self.n == 1:
            return mean
        return f"{mean} [{self.lo * scale:.{digits}f}–{self.hi * scale:.{digits}f}]"


def verdict(row: Spread, base: Spread) -> str:
    """``+``: ``base`` (HiState) is lower beyond the spread; ``−``: ``row`` is; ``=``:
    the ranges overlap (lower is better, module docstring)."""
    if row.n == 0 or base.n == 0:
        return ""
    if base.hi < row.lo:
        return "+"
    if row.hi < base.lo:
        return "−"
    return "="


def _sens(s: PolicySummary, key: str, field: str = "sensitive") -> float:
    stats = getattr(s, field)
    return getattr(stats, key) if stats is not None else math.nan


# Every metric the repeated report carries: name → value of one run's summary.
METRICS: dict[str, Callable[[PolicySummary], float]] = {
    "token_hit_rate": lambda s: s.token_hit_rate,
    "ttft_mean": lambda s: s.ttft.mean,
    "ttft_p50": lambda s: s.ttft.p50,
    "ttft_p95": lambda s: s.ttft.p95,
    "ttft_p99": lambda s: s.ttft.p99,
    "sensitive_mean": lambda s: _sens(s, "mean"),
    "sensitive_p99": lambda s: _sens(s, "p99"),
    "neutral_mean": lambda s: _sens(s, "mean", "neutral"),
    "neutral_p99": lambda s: _sens(s, "p99", "neutral"),
    "makespan_s": lambda s: s.makespan_s,
    "request_rate": lambda s: s.request_rate,
    "bulk_rate": lambda s: s.bulk_rate,
    "fill": lambda s: s.fill,
}


@dataclass(slots=True)
class RepeatedRow:
    """One row over K repeats: each metric's spread and the runs' own summaries."""

    name: str
    capacity_bytes: float
    metrics: dict[str, Spread]
    runs: list[PolicySummary] = field(default_factory=list)


def aggregate(per_repeat: Sequence[Sequence[PolicySummary]]) -> list[RepeatedRow]:
    """Rows in the first repeat's order; every repeat must have the same rows."""
    if not per_repeat:
        return []
    names = [s.name for s in per_repeat[0]]
    by_name: dict[str, list[PolicySummary]] = {n: [] for n in names}
    for summaries in per_repeat:
        if [s.name for s in summaries] != names:
            raise ValueError("every repeat must run the same rows in the same order")
        for s in summaries:
            by_name[s.name].append(s)
    return [
        RepeatedRow(
            n, runs[0].capacity_bytes,
            {m: Spread.of([f(s) for s in runs]) for m, f in METRICS.items()}, runs,
        )
        for n, runs in by_name.items()
    ]


def run_repeats(
    trace: Trace,
    setup: SimSetup,
    factories: Mapping[str, Factory],
    repeats: int,
    jitter: float = DEFAULT_JITTER,
    *,
    console: Any = None,
) -> list[RepeatedRow]:
    """Replay ``trace`` ``repeats`` times through every row (jittered if ``repeats > 1``);
    the reuse-sensitive requests of each repeat come from that repeat's own runs."""
    if repeats < 1:
        raise ValueError(f"repeats must be ≥ 1, got {repeats}")
    per_repeat = []
    for r in range(repeats):
        t = trace if repeats == 1 else jitter_trace(trace, setup.seed, r, jitter)
        label = "" if repeats == 1 else f"#{r + 1} "
        runs = run_policies(t, setup, dict(factories), console=console, label=label)
        per_repeat.append(
            summarize(runs, reuse_sensitive(runs), neutral=reuse_sensitive_neutral(runs))
        )
    return aggregate(per_repeat)


# ---------------------------------------------------------------- output
def _versus(row: RepeatedRow, base: RepeatedRow | None, metric: str) -> str:
    if base is None:
        return "–"
    r, b = row.metrics[metric], base.metrics[metric]
    if r.n == 0 or b.n == 0 or b.mean <= 0:
        return "–"
    return f"{r.mean / b.mean:.2f} {verdict(r, b)}"


def repeats_markdown(rows: Sequence[RepeatedRow], repeats: int, jitter: float) -> str:
    """The TTFT and reuse-sensitive tables: mean [min–max] per cell, and per row the
    ratio of its mean to HiState's with the verdict mark (``verdict``)."""
    base = next((r for r in rows if r.name == HISTATE), None)
    lines = [
        load_line([s for r in rows for s in r.runs]),
        "",
        f"{repeats} repeat{'s' if repeats > 1 else ''}"
        + (f", timing jittered ±{100 * jitter:g} %" if repeats > 1 else "")
        + ": each cell is the mean [min–max] over the repeats; ×HiState = the row's mean "
        "/ HiState's, then + (HiState lower beyond the spread: its max below the row's "
        "min), − (the row lower beyond the spread) or = (the ranges overlap: no win).",
        "",
        "| policy | memory (GiB) | full at end % | token hit % | TTFT mean (s) | p99 (s) "
        "| mean ×HiState | p99 ×HiState |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        m = r.metrics
        lines.append(
            f"| {r.name} | {memory_cell(r)} | {m['fill'].fmt(0, 100)} | "
            f"{m['token_hit_rate'].fmt(2, 100)} | "
            f"{m['ttft_mean'].fmt()} | {m['ttft_p99'].fmt()} | "
            f"{_versus(r, base, 'ttft_mean')} | {_versus(r, base, 'ttft_p99')} |"
        )
    if any(r.metrics["sensitive_mean"].n for r in rows):
        lines += [
            "",
            "Reuse-sensitive requests (each repeat's own set):",
            "",
            "| policy | memory (GiB) | mean (s) | p99 (s) | mean ×HiState | p99 ×HiState |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            m = r.metrics
            if not m["sensitive_mean"].n:
                continue
            lines.append(
                f"| {r.name} | {memory_cell(r)} | {m['sensitive_mean'].fmt()} | "
                f"{m['sensitive_p99'].fmt()} | {_versus(r, base, 'sensitive_mean')} | "
                f"{_versus(r, base, 'sensitive_p99')} |"
            )
    if any(r.metrics["neutral_mean"].n for r in rows):
        lines += [
            "",
            "Reuse-sensitive requests, policy-neutral set (each repeat's own: hit rates ≥ 5 "
            "points apart between any two rows of the largest finite memory):",
            "",
            "| policy | memory (GiB) | mean (s) | p99 (s) | mean ×HiState | p99 ×HiState |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            m = r.metrics
            if m["neutral_mean"].n:
                lines.append(
                    f"| {r.name} | {memory_cell(r)} | {m['neutral_mean'].fmt()} | "
                    f"{m['neutral_p99'].fmt()} | {_versus(r, base, 'neutral_mean')} | "
                    f"{_versus(r, base, 'neutral_p99')} |"
                )
    return "\n".join(lines) + "\n"


def repeats_json(rows: Sequence[RepeatedRow]) -> list[dict[str, Any]]:
    """Per row: each metric's mean / min / max / n, and every run's full summary."""
    return [
        {
            "name": r.name,
            "capacity_bytes": r.capacity_bytes,
            "metrics": {
                k: {"mean": s.mean, "min": s.lo, "max": s.hi, "n": s.n}
                for k, s in r.metrics.items()
            },
            "runs": [asdict(s) for s in r.runs],
        }
        for r in rows
    ]


def write_repeats_report(
    out_dir: Path,
    rows: Sequence[RepeatedRow],
    meta: Mapping[str, Any],
    *,
    repeats: int,
    jitter: float,
    plots: bool = True,
) -> dict[str, Path]:
    """``report.md``, ``report.json`` and (``plots``) ``ttft_spread.png`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out_dir / "report.md", "json": out_dir / "report.json"}
    head = [f"# Simulation: {meta.get('trace', '?')}", ""]
    head += [f"* {k}: {v}" for k, v in meta.items() if k != "trace"]
    paths["markdown"].write_text(
        "\n".join(head) + "\n\n" + repeats_markdown(rows, repeats, jitter)
    )
    doc = {"meta": dict(meta), "repeats": repeats, "jitter": jitter,
           "policies": repeats_json(rows)}
    paths["json"].write_text(json.dumps(jsonable(doc), indent=2) + "\n")
    if plots:
        paths["spread"] = plot_spread(rows, out_dir / "ttft_spread.png")
    return paths


def plot_spread(rows: Sequence[RepeatedRow], path: Path) -> Path:
    """Mean TTFT, p99 and reuse-sensitive mean per row: a dot at the mean, a bar from
    the min to the max over the repeats."""
    plt = pyplot()
    panels = [("ttft_mean", "TTFT mean (s)"), ("ttft_p99", "TTFT p99 (s)"),
              ("sensitive_mean", "reuse-sensitive mean (s)")]
    panels = [p for p in panels if any(r.metrics[p[0]].n for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 0.35 * len(rows) + 1.6),
                             squeeze=False)
    ys = list(range(len(rows)))
    for ax, (metric, label) in zip(axes[0], panels, strict=True):
        for y, r in zip(ys, rows, strict=True):
            s = r.metrics[metric]
            if not s.n:
                continue
            colour = "black" if r.name == HISTATE else "tab:blue"
            ax.errorbar([s.mean], [y], xerr=[[s.mean - s.lo], [s.hi - s.mean]], fmt="o",
                        color=colour, capsize=3)
        ax.set_yticks(ys, [r.name for r in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel(label)
        ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
