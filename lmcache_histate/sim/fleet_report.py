"""The fleet experiment: every row under every router, K jittered repeats, and its verdicts.

One *cell* is a (router, row) pair; one *repeat* replays every row of a router on the
same jittered copy of the fleet trace (``repeats.jitter_trace``, seeded by the set-up's
seed and the repeat), so rows of a repeat see the same timing. Each metric of a cell is
reported as mean [min–max] over the repeats (``repeats.Spread``).

* **Reuse-sensitive requests** (per router and repeat): those whose token hit rate under
  the ``unlimited`` reference (one cache the whole fleet reads) is ≥ 5 points above
  the local ``vllm-cpu-disk-offload`` row's (``report.reuse_sensitive`` with the offload
  row in HiState's place): the requests that a better cache could speed up, chosen by
  neither HiState row.
* **Halves.** The trace's sessions are split by the simulator's one rule
  (``halves.in_half``: CRC-32 of the root session's trace id, even A, odd B); a subagent
  goes with its conversation, every copy of a session with it (``session_halves``). Each
  metric is also computed on each half.
* **Verdict** of a row against ``histate+shared`` on a metric (``claim``): ``+``
  (histate+shared lower) only if the repeats' ranges do not overlap (``repeats.verdict``)
  on all requests AND on each half; ``−`` likewise the other way; otherwise ``tie``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import SimSetup
from .fleet import (
    HISTATE_LOCAL,
    HISTATE_SHARED,
    LOCAL_ROWS,
    REFERENCE,
    SGLANG_SHARED,
    VLLM_LOCAL,
    FleetRun,
    FleetSetup,
    fleet_rows,
    make_router,
    simulate_fleet,
    stable_hash,
)
from .halves import in_half
from .repeats import Spread, jitter_trace, verdict
from .report import GIB, PolicySummary, pyplot, reuse_sensitive, summarize
from .server import RunResult
from .trace_model import Trace

__all__ = [
    "PARTS",
    "FleetCell",
    "RowOutcome",
    "aggregate_cells",
    "claim",
    "fleet_markdown",
    "plot_fleet",
    "read_fleet_json",
    "run_fleet_repeat",
    "session_halves",
]

PARTS = ("all", "A", "B")


def _base_id(session_id: str) -> str:
    """The trace's own session id of a fleet copy's session (``fleet.fleet_trace``)."""
    return session_id.rsplit("@", 1)[0]


def session_halves(trace: Trace) -> dict[str, str]:
    """Session id → ``"A"`` or ``"B"``: its root session's trace id in half ``a`` or ``b``
    of ``halves.in_half`` (module docstring)."""
    ids = {s.id for s in trace.sessions}
    root = {s.id: (s.parent if s.parent in ids else s.id) for s in trace.sessions}
    return {sid: ("A" if in_half(_base_id(r), "a") else "B") for sid, r in root.items()}


@dataclass(slots=True)
class RowOutcome:
    """One row's numbers from one repeat: metric → value per part (``PARTS``)."""

    router: str
    row: str
    repeat: int
    node_bytes: float
    shared_bytes: float
    nodes: int
    values: dict[str, dict[str, float]]


def _metrics(s: PolicySummary, shared_hits: int) -> dict[str, float]:
    return {
        "token_hit_rate": s.token_hit_rate,
        "ttft_mean": s.ttft.mean,
        "ttft_p99": s.ttft.p99,
        "sensitive_mean": s.sensitive.mean if s.sensitive is not None else math.nan,
        "request_rate": s.request_rate,
        "shared_hit_share": shared_hits / s.requests if s.requests else 0.0,
    }


def _subset(run: RunResult, keep: Callable[[str], bool]) -> RunResult:
    res = [r for r in run.results if keep(r.session_id)]
    return RunResult(run.policy, run.trace, res, run.stats, run.makespan, run.wall_s,
                     run.capped_gaps, capacity_bytes=run.capacity_bytes)


def run_fleet_repeat(
    trace: Trace,
    setup: SimSetup,
    fleet: FleetSetup,
    router: str,
    repeat: int,
    repeats: int,
    jitter: float,
    rows: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[RowOutcome]:
    """Every row (``rows``; None = all) on repeat ``repeat``'s copy of ``trace``."""
    t = trace if repeats == 1 else jitter_trace(trace, setup.seed, repeat, jitter)
    factories = fleet_rows(setup, fleet)
    names = list(factories) if rows is None else list(rows)
    runs: dict[str, FleetRun] = {}
    seed = stable_hash(f"route:{setup.seed}:{repeat}")
    shape: dict[str, tuple[float, float]] = {}
    for name in names:
        row = factories[name]()
        shape[name] = (row.capacity_bytes - (row.shared.capacity if row.shared else 0),
                       float(row.shared.capacity if row.shared else 0))
        runs[name] = simulate_fleet(t, row, make_router(router, fleet.nodes, seed), setup)
        if progress is not None:
            progress(name)
    plain = {n: r.run for n, r in runs.items()}
    sensitive = reuse_sensitive(plain, histate=VLLM_LOCAL, offload=VLLM_LOCAL,
                                reference=REFERENCE)
    half = session_halves(t)
    values: dict[str, dict[str, dict[str, float]]] = {n: {} for n in names}
    for part in PARTS:
        keep = (lambda sid: True) if part == "all" else (lambda sid, p=part: half[sid] == p)
        sub = {n: _subset(r, keep) for n, r in plain.items()}
        for s in summarize(sub, sensitive, histate=HISTATE_SHARED):
            keys = runs[s.name].shared_hit_keys
            hits = sum(1 for r in sub[s.name].results if r.key in keys)
            values[s.name][part] = _metrics(s, hits)
    return [
        RowOutcome(router, n, repeat, shape[n][0], shape[n][1], fleet.nodes, values[n])
        for n in names
    ]


@dataclass(slots=True)
class FleetCell:
    """A (router, row) over the repeats: each (part, metric)'s values."""

    router: str
    row: str
    node_bytes: float
    shared_bytes: float
    nodes: int
    values: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def spread(self, metric: str, part: str = "all") -> Spread:
        return Spread.of(self.values.get((part, metric), []))

    @property
    def memory(self) -> str:
        """``N×node + shared = total`` GiB (∞ for the reference)."""
        if math.isinf(self.node_bytes):
            return "∞"
        node = self.node_bytes / self.nodes / GIB
        total = (self.node_bytes + self.shared_bytes) / GIB
        if not self.shared_bytes:
            return f"{self.nodes}×{node:.0f} = {total:.0f}"
        return f"{self.nodes}×{node:.0f} + {self.shared_bytes / GIB:.0f} = {total:.0f}"


def aggregate_cells(outcomes: Sequence[RowOutcome]) -> dict[tuple[str, str], FleetCell]:
    """(router, row) → cell, in the order first seen."""
    cells: dict[tuple[str, str], FleetCell] = {}
    for o in sorted(outcomes, key=lambda o: o.repeat):
        cell = cells.setdefault((o.router, o.row), FleetCell(
            o.router, o.row, o.node_bytes, o.shared_bytes, o.nodes))
        for part, metrics in o.values.items():
            for m, v in metrics.items():
                cell.values.setdefault((part, m), []).append(v)
    return cells


def claim(row: FleetCell, base: FleetCell, metric: str) -> str:
    """``+`` / ``−`` / ``tie`` (module docstring: beyond the spread on all and both halves);
    a single run has no spread, so it claims nothing."""
    spreads = [(row.spread(metric, p), base.spread(metric, p)) for p in PARTS]
    if any(r.n < 2 or b.n < 2 for r, b in spreads):
        return "tie"
    marks = {verdict(r, b) for r, b in spreads}
    if marks == {"+"}:
        return "+"
    if marks == {"−"}:
        return "−"
    return "tie"


def _versus(row: FleetCell, base: FleetCell | None, metric: str) -> str:
    if base is None or row is base or row.row == REFERENCE:
        return "–"
    r, b = row.spread(metric), base.spread(metric)
    if not r.n or not b.n or b.mean <= 0:
        return "–"
    return f"{r.mean / b.mean:.2f} {claim(row, base, metric)}"


def fleet_markdown(cells: Mapping[tuple[str, str], FleetCell], routers: Sequence[str]) -> str:
    """One table per router, then the claims the acceptance asks for."""
    out: list[str] = []
    for router in routers:
        mine = [c for (r, _), c in cells.items() if r == router]
        if not mine:
            continue
        base = cells.get((router, HISTATE_SHARED))
        out += [
            f"### Router: {router}", "",
            "| row | memory (GiB) | requests/h | token hit % | resumed from shared % "
            "| TTFT mean (s) | p99 (s) | reuse-sensitive mean (s) | p99 ÷ histate+shared "
            "| sensitive mean ÷ histate+shared |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for c in mine:
            out.append(
                f"| {c.row} | {c.memory} | {c.spread('request_rate').fmt(0)} | "
                f"{c.spread('token_hit_rate').fmt(2, 100)} | "
                f"{c.spread('shared_hit_share').fmt(1, 100)} | {c.spread('ttft_mean').fmt()} | "
                f"{c.spread('ttft_p99').fmt()} | {c.spread('sensitive_mean').fmt()} | "
                f"{_versus(c, base, 'ttft_p99')} | {_versus(c, base, 'sensitive_mean')} |"
            )
        out.append("")
    out += _claims(cells)
    return "\n".join(out) + "\n"


def _claims(cells: Mapping[tuple[str, str], FleetCell]) -> list[str]:
    lines = ["### Claims (beyond the spread on all requests and on both halves, else tie)", ""]
    base = cells.get(("least-loaded", HISTATE_SHARED))
    if base is not None:
        for name in (*LOCAL_ROWS, SGLANG_SHARED, *(
                r for (rt, r) in cells if rt == "least-loaded"
                and r not in (*LOCAL_ROWS, SGLANG_SHARED, HISTATE_SHARED, REFERENCE))):
            row = cells.get(("least-loaded", name))
            if row is None:
                continue
            parts = []
            for metric, label in (("ttft_p99", "p99"), ("sensitive_mean", "reuse-sensitive mean")):
                mark = claim(row, base, metric)
                word = {"+": "ahead of", "−": "BEHIND", "tie": "tie with"}[mark]
                ratio = row.spread(metric).mean / base.spread(metric).mean
                parts.append(f"{label}: {word} (the row at {ratio:.2f}× histate+shared)")
            lines.append(f"* least-loaded, histate+shared vs {name}: " + "; ".join(parts))
    sa_base = cells.get(("session-affinity", HISTATE_SHARED))
    sa_local = cells.get(("session-affinity", HISTATE_LOCAL))
    if sa_base is not None and sa_local is not None:
        parts = []
        for metric, label in (("ttft_p99", "p99"), ("sensitive_mean", "reuse-sensitive mean"),
                              ("ttft_mean", "mean")):
            b, r = sa_base.spread(metric), sa_local.spread(metric)
            parts.append(f"{label} {b.mean:.3f} s vs {r.mean:.3f} s "
                         f"(histate {r.mean / b.mean:.3f}×, {claim(sa_local, sa_base, metric)})")
        lines.append("* session-affinity, histate+shared's lead over histate (local only): "
                     + "; ".join(parts))
    return lines


def fleet_json(cells: Mapping[tuple[str, str], FleetCell]) -> list[dict[str, Any]]:
    return [
        {"router": c.router, "row": c.row, "node_bytes": c.node_bytes,
         "shared_bytes": c.shared_bytes, "nodes": c.nodes,
         "values": {f"{p}:{m}": v for (p, m), v in c.values.items()}}
        for c in cells.values()
    ]


def write_fleet_json(path: Path, cells: Mapping[tuple[str, str], FleetCell]) -> Path:
    path.write_text(json.dumps(fleet_json(cells), indent=1) + "\n")
    return path


def read_fleet_json(path: Path) -> dict[tuple[str, str], FleetCell]:
    """The cells ``write_fleet_json`` wrote, in their order."""
    cells: dict[tuple[str, str], FleetCell] = {}
    for d in json.loads(path.read_text()):
        cell = FleetCell(d["router"], d["row"], d["node_bytes"], d["shared_bytes"], d["nodes"])
        for key, values in d["values"].items():
            part, metric = key.split(":", 1)
            cell.values[(part, metric)] = [float(v) for v in values]
        cells[(cell.router, cell.row)] = cell
    return cells


def plot_fleet(cells: Mapping[tuple[str, str], FleetCell], routers: Sequence[str],
               path: Path) -> Path:
    """p99 and reuse-sensitive mean per router: a marker at each row's mean, a bar from
    its min to its max over the repeats; the legend outside the axes."""
    plt = pyplot()
    from matplotlib import ticker

    rows = list(dict.fromkeys(r for (_, r) in cells))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(1, len(rows))
    for ax, (metric, label) in zip(axes, (("ttft_p99", "TTFT p99 (s)"),
                                          ("sensitive_mean", "reuse-sensitive mean (s)")),
                                   strict=True):
        for k, name in enumerate(rows):
            xs, ys, lo, hi = [], [], [], []
            for x, router in enumerate(routers):
                c = cells.get((router, name))
                if c is None or not c.spread(metric).n:
                    continue
                s = c.spread(metric)
                xs.append(x - 0.4 + width * (k + 0.5))
                ys.append(s.mean)
                lo.append(s.mean - s.lo)
                hi.append(s.hi - s.mean)
            style = {"color": "black"} if name == HISTATE_SHARED else (
                {"color": "0.6"} if name == REFERENCE else {})
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=3, label=name, **style)
        ax.set_xticks(range(len(routers)), routers)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3, which="both")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
