"""Metrics, tables and plots of a simulation: what the paper reports, per policy.

* **Token hit rate**: Σ hit tokens / Σ input tokens, where a hit token is one the engine
  did not recompute (it needs a snapshot at or after it, so KV alone does not count).
* **TTFT** mean / p50 / p95 / p99 over all requests and over the *reuse-sensitive* ones.
  The paper's definition, applied per request (identified by session and index): a
  request is reuse-sensitive if its hit rate under vLLM with CPU+disk offload is ≥ 5
  points below the unlimited cache's, or if HiState's and vLLM CPU+disk offload's hit
  rates differ by ≥ 5 points. It needs those three rows; without them it is omitted.
  Because it is defined against vLLM CPU+disk offload's own hits, part of any lead
  over that row on this set holds by construction; hence the *neutral* set beside it
  (``reuse_sensitive_neutral``): requests whose hit rates differ by ≥ 5 points between
  ANY two of the compared rows (the highest minus the lowest), no row singled out. The
  compared rows are those with the run's largest finite memory (the tiered rows given
  the same bytes): a GPU-only row or the unlimited reference would put into the set
  every request that memory alone decides. Both sets are computed over the rows of one
  run, so a table's columns share one set.
* **Speedups vs HiState**: baseline statistic / HiState statistic (> 1: HiState faster).
* **Tier traffic**: bytes read per tier (loads on hits) and written per tier (stores,
  demotions) over the run.
* **Memory and load**: every table gives each row's memory (GiB over all its tiers,
  ``RunResult.capacity_bytes``; ∞ for the unlimited reference) and how full it was at
  the end (``fill``: bytes held over capacity; near 100 % the memory bound the row), and
  is headed by the simulated duration and request rate (the replay is a closed loop, so
  rows differ a little: the range over the rows is printed): over the whole run, and
  over its *bulk* (``bulk_rate``: the central 90 % of requests by arrival, 0.9·n over the
  time from the 5th to the 95th percentile arrival), which a few long sessions left
  alone at the end cannot drag down. A *same-total-memory* table (``same``)
  repeats the rows that have less memory than HiState with their slowest tier grown to
  HiState's total, so that a gap between two rows can be told apart into what the
  memory gives and what the policy does with it.

Percentiles interpolate linearly between order statistics (numpy's default), so small
request sets give stable numbers. Plots need matplotlib (the ``sim`` extra) and are
drawn with the Agg backend (no display).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .server import RequestResult, RunResult

__all__ = [
    "HISTATE",
    "OFFLOAD",
    "REFERENCE",
    "PolicySummary",
    "TtftStats",
    "bulk_rate",
    "jsonable",
    "load_line",
    "markdown",
    "memory_cell",
    "percentile",
    "plot_cdf",
    "plot_sweep",
    "pyplot",
    "reuse_sensitive",
    "reuse_sensitive_neutral",
    "summarize",
    "token_hit_rate",
    "write_report",
]

HISTATE = "histate"
REFERENCE = "unlimited"
OFFLOAD = "vllm-cpu-disk-offload"
SENSITIVE_POINTS = 0.05
GIB = float(1 << 30)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """``q``-th percentile (0–100) of already sorted values, linear interpolation."""
    n = len(sorted_values)
    if n == 0:
        return math.nan
    pos = (n - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def token_hit_rate(results: Iterable[RequestResult]) -> float:
    hit = total = 0
    for r in results:
        hit += r.hit_tokens
        total += r.input_tokens
    return hit / total if total else 0.0


BULK = 0.9  # share of the requests, by arrival, that ``bulk_rate`` counts


def bulk_rate(arrivals: Iterable[float], share: float = BULK) -> float:
    """Requests per hour over the central ``share`` of the arrivals (module doc).
    Example: arrivals 0, 10, 20, …, 990 s (100 requests), share 0.9: the 5th and 95th
    percentile arrivals are 49.5 s and 940.5 s, so 90 requests in 891 s = 363.6 per hour."""
    xs = sorted(arrivals)
    if len(xs) < 2:
        return 0.0
    tail = 100.0 * (1.0 - share) / 2.0
    span = percentile(xs, 100.0 - tail) - percentile(xs, tail)
    return 3600.0 * share * len(xs) / span if span > 0 else 0.0


@dataclass(frozen=True, slots=True)
class TtftStats:
    n: int
    mean: float
    p50: float
    p95: float
    p99: float

    @classmethod
    def of(cls, ttfts: Iterable[float]) -> TtftStats | None:
        values = sorted(ttfts)
        if not values:
            return None
        return cls(
            len(values), sum(values) / len(values), percentile(values, 50),
            percentile(values, 95), percentile(values, 99),
        )

    def ratio(self, base: TtftStats) -> dict[str, float]:
        """self / base per statistic (how many times slower than ``base``)."""
        out = {}
        for key in ("mean", "p50", "p95", "p99"):
            b = getattr(base, key)
            out[key] = getattr(self, key) / b if b > 0 else math.nan
        return out


@dataclass(slots=True)
class PolicySummary:
    name: str
    requests: int
    token_hit_rate: float
    ttft: TtftStats
    sensitive: TtftStats | None = None
    neutral: TtftStats | None = None  # the policy-neutral reuse-sensitive set
    rewriting: TtftStats | None = None
    speedup: dict[str, float] = field(default_factory=dict)
    speedup_sensitive: dict[str, float] = field(default_factory=dict)
    read_bytes: dict[str, int] = field(default_factory=dict)
    written_bytes: dict[str, int] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    makespan_s: float = 0.0
    wall_s: float = 0.0
    capped_gaps: int = 0
    capacity_bytes: float = 0.0
    capture_s: float = 0.0  # Σ capture time (``capture``) over the requests
    used_bytes: float = 0.0  # bytes held over all tiers at the end (``stats`` used_*)
    bulk_rate: float = 0.0  # requests per hour over the bulk of the run (``bulk_rate``)

    @property
    def request_rate(self) -> float:
        """Requests per simulated hour."""
        return 3600.0 * self.requests / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def fill(self) -> float:
        """Bytes held at the end over capacity (nan for unbounded memory)."""
        if not self.capacity_bytes or math.isinf(self.capacity_bytes):
            return math.nan
        return self.used_bytes / self.capacity_bytes


def reuse_sensitive(
    runs: Mapping[str, RunResult],
    histate: str = HISTATE,
    offload: str = OFFLOAD,
    reference: str = REFERENCE,
    points: float = SENSITIVE_POINTS,
) -> set[tuple[str, int]] | None:
    """Keys (session, index) of the reuse-sensitive requests; None without the three rows."""
    if not all(n in runs for n in (histate, offload, reference)):
        return None
    rate = {n: {r.key: r.hit_rate for r in runs[n].results} for n in (histate, offload, reference)}
    out = set()
    eps = 1e-9  # hit rates are ratios of ints: "≥ 5 points" must not miss 0.05 on rounding
    for key, off in rate[offload].items():
        below_reference = rate[reference][key] - off >= points - eps
        differs = abs(rate[histate][key] - off) >= points - eps
        if below_reference or differs:
            out.add(key)
    return out


def reuse_sensitive_neutral(
    runs: Mapping[str, RunResult], points: float = SENSITIVE_POINTS
) -> set[tuple[str, int]] | None:
    """Keys of the requests whose hit rate differs by ≥ ``points`` between any two of the
    rows with the run's largest finite memory (module doc); None with fewer than two such
    rows. Example: hit rates 0.90, 0.93, 0.96 for one request in three rows of 208 GiB:
    0.96 − 0.90 = 0.06 ≥ 0.05, so it is in, whatever a 45 GiB row hit."""
    finite = [r.capacity_bytes for r in runs.values() if math.isfinite(r.capacity_bytes)]
    compared = [r for r in runs.values() if finite and r.capacity_bytes == max(finite)]
    if len(compared) < 2:
        return None
    lo: dict[tuple[str, int], float] = {}
    hi: dict[tuple[str, int], float] = {}
    for run in compared:
        for r in run.results:
            rate = r.hit_rate
            lo[r.key] = min(lo.get(r.key, rate), rate)
            hi[r.key] = max(hi.get(r.key, rate), rate)
    eps = 1e-9  # as in ``reuse_sensitive``
    return {k for k in lo if hi[k] - lo[k] >= points - eps}


def summarize(
    runs: Mapping[str, RunResult],
    sensitive: set[tuple[str, int]] | None,
    histate: str = HISTATE,
    neutral: set[tuple[str, int]] | None = None,
) -> list[PolicySummary]:
    """One summary per run, in the runs' order, with speedups against ``histate``;
    ``sensitive`` / ``neutral``: the two reuse-sensitive sets (``reuse_sensitive``,
    ``reuse_sensitive_neutral``), None to leave a set out."""
    out = []
    for name, run in runs.items():
        res = run.results
        read: Counter[str] = Counter()
        written: Counter[str] = Counter()
        for r in res:
            read.update(r.load_bytes)
            written.update(r.written_bytes)
        ttft = TtftStats.of(r.ttft for r in res)
        if ttft is None:
            raise ValueError(f"policy {name!r} completed no request")
        out.append(
            PolicySummary(
                name=name,
                requests=len(res),
                token_hit_rate=token_hit_rate(res),
                ttft=ttft,
                sensitive=TtftStats.of(r.ttft for r in res if r.key in sensitive)
                if sensitive is not None else None,
                neutral=TtftStats.of(r.ttft for r in res if r.key in neutral)
                if neutral is not None else None,
                rewriting=TtftStats.of(r.ttft for r in res if r.rewrite),
                read_bytes=dict(sorted(read.items())),
                written_bytes=dict(sorted(written.items())),
                stats=dict(run.stats),
                makespan_s=run.makespan,
                wall_s=run.wall_s,
                capped_gaps=run.capped_gaps,
                capacity_bytes=run.capacity_bytes,
                capture_s=sum(r.capture_s for r in res),
                used_bytes=sum(v for k, v in run.stats.items() if k.startswith("used_")),
                bulk_rate=bulk_rate(r.arrival for r in res),
            )
        )
    base = next((s for s in out if s.name == histate), None)
    if base is not None:
        for s in out:
            s.speedup = s.ttft.ratio(base.ttft)
            if s.sensitive is not None and base.sensitive is not None:
                s.speedup_sensitive = s.sensitive.ratio(base.sensitive)
    return out


# ---------------------------------------------------------------- output
def _f(x: float | None, digits: int = 3) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def memory_cell(s: Any) -> str:
    """A row's memory in GiB (``s.capacity_bytes``; ∞ for the unlimited reference)."""
    if math.isinf(s.capacity_bytes):
        return "∞"
    return f"{s.capacity_bytes / GIB:.0f}" if s.capacity_bytes else "–"


def fill_cell(s: Any) -> str:
    """How full a row's memory was at the end, in % (``PolicySummary.fill``)."""
    f = s.fill
    return "–" if math.isnan(f) else f"{100 * f:.0f}"


def load_line(summaries: Sequence[PolicySummary]) -> str:
    """Simulated duration and request rate, whole run and bulk (ranges over the rows)."""
    hours = [s.makespan_s / 3600 for s in summaries]
    rates = [s.request_rate for s in summaries]
    bulk = [s.bulk_rate for s in summaries]
    if not hours:
        return ""

    def span(xs: list[float], fmt: str) -> str:
        lo, hi = format(min(xs), fmt), format(max(xs), fmt)
        return lo if lo == hi else f"{lo}–{hi}"

    n = max(s.requests for s in summaries)
    return (f"Simulated duration {span(hours, '.2f')} h, {n:,} requests: "
            f"{span(rates, ',.0f')} requests/h over the run, {span(bulk, ',.0f')}/h over "
            f"its bulk (the central {BULK:.0%} of requests; ranges over the rows: closed "
            "loop).")


def _ttft_table(summaries: Sequence[PolicySummary]) -> list[str]:
    lines = [
        "| policy | memory (GiB) | full at end % | token hit % | TTFT mean (s) | p50 | p95 | p99 "
        "| p99 ×HiState | mean ×HiState |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        t = s.ttft
        lines.append(
            f"| {s.name} | {memory_cell(s)} | {fill_cell(s)} | {100 * s.token_hit_rate:.2f} | "
            f"{_f(t.mean)} | "
            f"{_f(t.p50)} | {_f(t.p95)} | {_f(t.p99)} | {_f(s.speedup.get('p99'), 2)} | "
            f"{_f(s.speedup.get('mean'), 2)} |"
        )
    return lines


def markdown(
    summaries: Sequence[PolicySummary], same: Sequence[PolicySummary] = ()
) -> str:
    """The results as Markdown: the load line, then the TTFT table, reuse-sensitive and
    rewrite tables, traffic table, and (``same``) the same-total-memory table."""
    lines = [load_line(summaries), "", *_ttft_table(summaries)]
    if any(s.sensitive for s in summaries):
        n = next(s.sensitive.n for s in summaries if s.sensitive)
        lines += [
            "",
            f"Reuse-sensitive requests ({n}):",
            "",
            "| policy | memory (GiB) | mean (s) | p50 | p95 | p99 | p99 ×HiState "
            "| mean ×HiState |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for s in summaries:
            t = s.sensitive
            if t is None:
                continue
            lines.append(
                f"| {s.name} | {memory_cell(s)} | {_f(t.mean)} | {_f(t.p50)} | {_f(t.p95)} | "
                f"{_f(t.p99)} | {_f(s.speedup_sensitive.get('p99'), 2)} | "
                f"{_f(s.speedup_sensitive.get('mean'), 2)} |"
            )
    if any(s.neutral for s in summaries):
        n = next(s.neutral.n for s in summaries if s.neutral)
        lines += [
            "",
            f"Reuse-sensitive requests, policy-neutral set ({n}: hit rates ≥ 5 points apart "
            "between any two rows of the largest finite memory):",
            "",
            "| policy | memory (GiB) | mean (s) | p50 | p95 | p99 |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for s in summaries:
            t = s.neutral
            if t is not None:
                lines.append(f"| {s.name} | {memory_cell(s)} | {_f(t.mean)} | {_f(t.p50)} | "
                             f"{_f(t.p95)} | {_f(t.p99)} |")
    if any(s.rewriting for s in summaries):
        lines += ["", "Rewriting requests:", "",
                  "| policy | memory (GiB) | n | mean TTFT (s) | p50 | p99 |",
                  "|---|---:|---:|---:|---:|---:|"]
        for s in summaries:
            if s.rewriting is not None:
                t = s.rewriting
                lines.append(f"| {s.name} | {memory_cell(s)} | {t.n} | {_f(t.mean)} | "
                             f"{_f(t.p50)} | {_f(t.p99)} |")
    tiers = ("gpu", "cpu", "disk")
    lines += [
        "",
        "Tier traffic (GiB) and state-capture time (s, summed over the requests):",
        "",
        "| policy | memory (GiB) | read cpu | read disk | written gpu | written cpu "
        "| written disk | capture (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        r = [s.read_bytes.get(t, 0) / GIB for t in tiers[1:]]
        w = [s.written_bytes.get(t, 0) / GIB for t in tiers]
        lines.append(f"| {s.name} | {memory_cell(s)} | " + " | ".join(f"{v:.1f}" for v in (*r, *w))
                     + f" | {s.capture_s:.1f} |")
    if same:
        total = max(s.capacity_bytes for s in same) / GIB
        lines += [
            "",
            f"Same total memory: every row with {total:.0f} GiB (each row's slowest tier "
            "grown to HiState's total; a GPU-only row gets that much GPU). "
            + load_line(same),
            "",
            *_ttft_table(same),
        ]
    return "\n".join(lines) + "\n"


def jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    return x


def write_report(
    out_dir: Path,
    summaries: Sequence[PolicySummary],
    meta: Mapping[str, Any],
    *,
    runs: Mapping[str, RunResult] | None = None,
    sweep: Sequence[Any] = (),
    plots: bool = True,
    same: Sequence[PolicySummary] = (),
) -> dict[str, Path]:
    """Write ``report.md``, ``report.json`` and (``plots``) PNGs into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out_dir / "report.md", "json": out_dir / "report.json"}
    head = [f"# Simulation: {meta.get('trace', '?')}", ""]
    head += [f"* {k}: {v}" for k, v in meta.items() if k != "trace"]
    paths["markdown"].write_text("\n".join(head) + "\n\n" + markdown(summaries, same))
    doc = {
        "meta": dict(meta),
        "policies": [asdict(s) for s in summaries],
        "same_memory": [asdict(s) for s in same],
        "sweep": [asdict(p) for p in sweep],
    }
    paths["json"].write_text(json.dumps(jsonable(doc), indent=2) + "\n")
    if plots and runs is not None:
        paths["cdf"] = plot_cdf(runs, out_dir / "ttft_cdf.png")
    if plots and sweep:
        paths["sweep"] = plot_sweep(sweep, out_dir / "hit_rate_vs_capacity.png")
    return paths


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_cdf(runs: Mapping[str, RunResult], path: Path) -> Path:
    """TTFT CDF per policy (log x axis: TTFTs span milliseconds to minutes)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colours = plt.get_cmap("tab20").colors
    styles = ("-", "--", "-.", ":")
    for i, (name, run) in enumerate(runs.items()):
        xs = sorted(max(r.ttft, 1e-4) for r in run.results)
        ys = [(k + 1) / len(xs) for k in range(len(xs))]
        if name == HISTATE:
            ax.step(xs, ys, where="post", label=name, color="black", lw=2.4, zorder=5)
        else:
            ax.step(xs, ys, where="post", label=name, lw=1.2, color=colours[(2 * i) % 20],
                    ls=styles[i % len(styles)])
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, which="both", alpha=0.3)
    # The legend beside the axes, never over the curves.
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_sweep(points: Sequence[Any], path: Path) -> Path:
    """Token hit rate and p99 TTFT vs CPU+disk capacity, one line per policy."""
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
    for name in dict.fromkeys(p.policy for p in points):
        pts = sorted((p for p in points if p.policy == name), key=lambda p: p.factor)
        xs = [(p.cpu_bytes + p.disk_bytes) / GIB for p in pts]
        a1.plot(xs, [100 * p.token_hit_rate for p in pts], marker="o", label=name)
        a2.plot(xs, [p.ttft_p99 for p in pts], marker="o", label=name)
    for ax, label in ((a1, "token hit rate (%)"), (a2, "p99 TTFT (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("CPU + disk capacity (GiB, scaled together)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    a2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
