"""Eviction under pressure, judged over repeated runs: the pressure matrix.

Cells: the paper-load set-up's CPU + disk (``configs/sim-paper-load.yaml``) scaled by
each factor (GPU fixed) × each number of concurrent sessions (``max_sessions``). Every
cell replays the trace ``--repeats`` times per row on jittered timing
(``lmcache_histate.sim.repeats``: the same K timings for every row of a cell) and keeps
each metric's mean [min–max]. Output (``--out``, default ``benchmarks/sim_pressure``):
``matrix.json`` (written after every cell, so a cut run keeps what it finished), one
Markdown table per metric (printed: rows × cells, each cell ``mean [min–max]`` and the
verdict mark against histate, ``repeats.verdict``), a check table (does any row beat
histate beyond the spread; is histate's reuse-sensitive mean ≥ 5 % below lru, file-lru
and vllm-cpu-disk-offload) and ``heatmap.png`` (per cell, histate's mean ÷ the best
baseline's mean, the HiState rows and unlimited aside: below 1 histate is ahead; the
same for histate-refresh-hit).

Usage: ``nice -n 10 python benchmarks/sim_pressure.py [--trace ../shared/traces/weka-cc]
[--max-input-tokens 100000] [--config configs/sim-paper-load.yaml]
[--factors 1,0.5,0.25,0.125] [--sessions 24,48] [--repeats 5] [--jitter 0.1]
[--policies a,b,...] [--half a|b] [--out DIR]``; ``--render DIR`` re-prints the tables of a finished
``matrix.json`` without running anything.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from lmcache_histate.sim.config import load_setup
from lmcache_histate.sim.load import with_target_load
from lmcache_histate.sim.repeats import Spread, run_repeats, verdict
from lmcache_histate.sim.report import HISTATE, OFFLOAD, REFERENCE, jsonable, pyplot
from lmcache_histate.sim.runner import load_sim_trace, policy_factories, select_policies

ROWS = (HISTATE, "histate-paper", "histate-refresh-hit", "histate-refresh-used",
        "histate-refresh-learned", "lru",
        "file-lru", "lru-refresh-all", OFFLOAD, "vllm-retention", "sglang-hicache",
        "sglang-hicache-l3", REFERENCE)
# metric key, title, digits, scale
TABLES = (
    ("sensitive_mean", "Reuse-sensitive TTFT mean (s)", 3, 1.0),
    ("neutral_mean", "Reuse-sensitive TTFT mean, policy-neutral set (s)", 3, 1.0),
    ("ttft_p99", "TTFT p99 (s)", 2, 1.0),
    ("ttft_mean", "TTFT mean (s)", 3, 1.0),
    ("sensitive_p99", "Reuse-sensitive TTFT p99 (s)", 2, 1.0),
    ("token_hit_rate", "Token hit rate (%)", 2, 100.0),
    ("fill", "Memory full at the end (%)", 0, 100.0),
    ("bulk_rate", "Achieved request rate over the bulk of the run (requests/h)", 0, 1.0),
)
# The metrics a verdict mark is printed for (times: lower is better).
LOWER_IS_BETTER = ("sensitive_mean", "neutral_mean", "ttft_p99", "ttft_mean", "sensitive_p99")
# The rows whose ratio to the best baseline the heat map shows.
HEAT_ROWS = (HISTATE, "histate-refresh-hit", "histate-refresh-used")
# The rows histate's reuse-sensitive mean must beat by ≥ 5 % in the pressure cells.
FIVE_PERCENT_ROWS = ("lru", "file-lru", OFFLOAD)


def _cell_name(sessions: int, factor: float) -> str:
    return f"{sessions} sessions, ×{factor:g}"


def _spread(d: dict[str, Any]) -> Spread:
    nan = math.nan
    return Spread(*(nan if d[k] is None else d[k] for k in ("mean", "min", "max")), d["n"])


def run_matrix(args: argparse.Namespace) -> dict[str, Any]:
    base = load_setup(args.config)
    t0 = time.perf_counter()
    trace = load_sim_trace(args.trace, base, args.max_input_tokens, args.half)
    print(f"[pressure] {trace.name}: {len(trace.sessions)} sessions, {trace.num_requests} "
          f"requests (loaded in {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "command": " ".join(sys.argv), "trace": trace.name, "sessions_in_trace":
        len(trace.sessions), "requests": trace.num_requests, "config": args.config,
        "repeats": args.repeats, "jitter": args.jitter, "half": args.half, "cells": [],
    }
    for sessions in (int(s) for s in args.sessions.split(",")):
        # The load rule (``sim.load``) per number of sessions; capacities do not enter it.
        loaded, cal = with_target_load(trace, base.with_(max_sessions=sessions))
        if cal is not None:
            print(f"[pressure] {sessions} sessions: {cal.line()}", file=sys.stderr)
        for factor in (float(f) for f in args.factors.split(",")):
            setup = loaded.with_(
                cpu_bytes=int(base.cpu_bytes * factor), disk_bytes=int(base.disk_bytes * factor),
            )
            factories = select_policies(policy_factories(setup), args.policies)
            t = time.perf_counter()
            rows = run_repeats(trace, setup, factories, args.repeats, args.jitter)
            doc["cells"].append({
                "name": _cell_name(sessions, factor), "sessions": sessions, "factor": factor,
                "cpu_gib": setup.cpu_bytes / (1 << 30), "disk_gib": setup.disk_bytes / (1 << 30),
                "max_think_s": setup.max_think_s,
                "rows": {
                    r.name: {k: {"mean": s.mean, "min": s.lo, "max": s.hi, "n": s.n}
                             for k, s in r.metrics.items()}
                    for r in rows
                },
            })
            print(f"[pressure] {_cell_name(sessions, factor)}: {time.perf_counter() - t:.0f} s",
                  file=sys.stderr)
            (out / "matrix.json").write_text(json.dumps(jsonable(doc), indent=1) + "\n")
    return doc


def tables(doc: dict[str, Any]) -> str:
    cells = doc["cells"]
    names = list(dict.fromkeys(n for c in cells for n in c["rows"]))
    lines: list[str] = []
    for metric, title, digits, scale in TABLES:
        lines += [f"### {title}", "",
                  "| policy | " + " | ".join(c["name"] for c in cells) + " |",
                  "|---|" + "---:|" * len(cells)]
        for name in names:
            row = [f"| {name} |"]
            for c in cells:
                if name not in c["rows"]:
                    row.append(" – |")
                    continue
                s = _spread(c["rows"][name][metric])
                mark = ""
                if metric in LOWER_IS_BETTER and name != HISTATE and HISTATE in c["rows"]:
                    mark = " " + verdict(s, _spread(c["rows"][HISTATE][metric]))
                row.append(f" {s.fmt(digits, scale)}{mark} |")
            lines.append("".join(row))
        lines.append("")
    lines += ["### Checks", "",
              "| cell | rows ahead of histate beyond the spread (p99) | (reuse-sensitive mean) "
              "| (neutral set mean) "
              "| histate's reuse-sensitive mean vs " + ", ".join(FIVE_PERCENT_ROWS) + " |",
              "|---|---|---|---|---|"]
    for c in cells:
        rows = c["rows"]
        if HISTATE not in rows:
            continue
        ahead = {}
        for metric in ("ttft_p99", "sensitive_mean", "neutral_mean"):
            h = _spread(rows[HISTATE][metric])
            ahead[metric] = [n for n in rows if n not in (HISTATE, REFERENCE)
                             and verdict(_spread(rows[n][metric]), h) == "−"] or ["none"]
        h = _spread(rows[HISTATE]["sensitive_mean"]).mean
        pct = [f"{100 * (h / _spread(rows[n]['sensitive_mean']).mean - 1):+.1f} %"
               for n in FIVE_PERCENT_ROWS if n in rows]
        lines.append(f"| {c['name']} | {', '.join(ahead['ttft_p99'])} | "
                     f"{', '.join(ahead['sensitive_mean'])} | "
                     f"{', '.join(ahead['neutral_mean'])} | {' / '.join(pct)} |")
    return "\n".join(lines) + "\n"


def _is_histate(name: str) -> bool:
    return name == HISTATE or name.startswith(HISTATE + "-")


def heatmap(doc: dict[str, Any], path: Path, subjects: tuple[str, ...] = HEAT_ROWS) -> Path:
    """Per cell, a HiState row's mean ÷ the best baseline's (HiState rows and unlimited
    aside): one line of panels (p99, reuse-sensitive mean) per row in ``subjects``."""
    plt = pyplot()
    cells = doc["cells"]
    subjects = tuple(n for n in subjects if any(n in c["rows"] for c in cells))
    sessions = sorted({c["sessions"] for c in cells})
    factors = sorted({c["factor"] for c in cells}, reverse=True)
    panels = (("ttft_p99", "p99 TTFT"), ("sensitive_mean", "reuse-sensitive mean TTFT"))
    fig, axes = plt.subplots(len(subjects), 2, squeeze=False,
                             figsize=(13, len(subjects) * (1.2 + 0.9 * len(sessions))))
    for row_axes, subject in zip(axes, subjects, strict=True):
        for ax, (metric, title) in zip(row_axes, panels, strict=True):
            grid = [[math.nan] * len(factors) for _ in sessions]
            best = [[""] * len(factors) for _ in sessions]
            for c in cells:
                rows = c["rows"]
                others = {n: _spread(v[metric]).mean for n, v in rows.items()
                          if not _is_histate(n) and n != REFERENCE}
                if subject not in rows or not others:
                    continue
                name, value = min(others.items(), key=lambda kv: kv[1])
                i, j = sessions.index(c["sessions"]), factors.index(c["factor"])
                grid[i][j] = _spread(rows[subject][metric]).mean / value
                best[i][j] = name
            im = ax.imshow(grid, cmap="RdYlGn_r", vmin=0.5, vmax=1.5, aspect="auto")
            for i in range(len(sessions)):
                for j in range(len(factors)):
                    if not math.isnan(grid[i][j]):
                        ax.text(j, i, f"{grid[i][j]:.2f}\n{best[i][j]}", ha="center",
                                va="center", fontsize=6)
            ax.set_xticks(range(len(factors)), [f"CPU+disk ×{f:g}" for f in factors],
                          fontsize=8)
            ax.set_yticks(range(len(sessions)), [f"{s} sessions" for s in sessions], fontsize=8)
            ax.set_title(f"{title}: {subject} ÷ best baseline", fontsize=9)
            fig.colorbar(im, ax=ax, fraction=0.04)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="../shared/traces/weka-cc")
    ap.add_argument("--max-input-tokens", type=int, default=100_000)
    ap.add_argument("--config", default="configs/sim-paper-load.yaml")
    ap.add_argument("--factors", default="1,0.5,0.25,0.125")
    ap.add_argument("--sessions", default="24,48")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--jitter", type=float, default=0.1)
    ap.add_argument("--policies", default=",".join(ROWS))
    ap.add_argument("--half", choices=["a", "b"], default=None,
                    help="one of two disjoint halves of the sessions (sim/halves.py)")
    ap.add_argument("--out", default="benchmarks/sim_pressure")
    ap.add_argument("--render", help="print the tables of DIR/matrix.json and redraw its heat map")
    args = ap.parse_args()
    if args.render:
        doc = json.loads((Path(args.render) / "matrix.json").read_text())
        out = Path(args.render)
    else:
        doc = run_matrix(args)
        out = Path(args.out)
    print(tables(doc))
    print(f"heat map: {heatmap(doc, out / 'heatmap.png')}")


if __name__ == "__main__":
    main()
