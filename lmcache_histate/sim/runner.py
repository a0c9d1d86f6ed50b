"""Running policies over a trace: trace loading, the policy registry, progress, sweeps.

The registry is HiState's variants (``variants``) plus the baselines'
``baseline_policies(setup)``, imported lazily so the simulator works (with the HiState
rows only) where the baselines package is absent. Every factory builds a FRESH policy:
runs never share state, so the order policies run in cannot change a result.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .config import SimSetup
from .halves import in_half
from .policy import Policy
from .server import RunResult, simulate
from .synthetic import paper_rewrite_trace
from .trace_model import Trace
from .traces import load_trace, load_weka, sample_trace_dir
from .variants import histate_variants

__all__ = [
    "SweepPoint",
    "load_sim_trace",
    "policy_factories",
    "rewrite_trace",
    "run_policies",
    "select_policies",
    "sweep_capacity",
    "sweep_table",
]

Factory = Callable[[], Policy]


def _is_weka(spec: str) -> bool:
    if spec in ("weka-sample", "sample"):
        return True
    p = Path(spec)
    return p.is_dir() or p.name.removesuffix(".gz").endswith(".json")


def load_sim_trace(
    spec: str, setup: SimSetup, max_input_tokens: int | None = None, half: str | None = None
) -> Trace:
    """Load a trace at the set-up's chunk size (``traces.load_trace`` specs).

    Weka sessions all start at t = 0 in their files, so they are staggered by
    ``setup.session_gap_s`` (see ``SimSetup``); other formats carry their own start
    times. ``max_input_tokens`` keeps only sessions whose largest input is ≤ it (for
    Weka: whole files, main conversation and subagents together). ``half`` (``a`` or
    ``b``) keeps one of two disjoint halves of the root sessions (``halves``).
    """
    keep = None if half is None else partial(in_half, half=half)
    if _is_weka(spec):
        path = sample_trace_dir() if spec in ("weka-sample", "sample") else Path(spec)
        if not path.exists():
            raise FileNotFoundError(f"trace not found: {path}")
        name = "weka-sample" if spec in ("weka-sample", "sample") else None
        return load_weka(
            path, setup.chunk_tokens, max_input_tokens=max_input_tokens,
            session_gap=setup.session_gap_s, name=name, keep=keep,
        )
    trace = load_trace(spec, setup.chunk_tokens)
    if max_input_tokens is not None:
        trace = trace.filter_sessions(lambda s: s.max_input_tokens <= max_input_tokens)
    if keep is not None:
        trace = trace.filter_sessions(lambda s: keep(s.parent or s.id))
    return trace


def rewrite_trace(setup: SimSetup, share: float, scope: str = "last") -> Trace:
    """The paper's rewrite test (16 turns × 8K new tokens, 24 sessions), staggered starts;
    ``scope``: where a rewrite cuts (``synthetic.REWRITE_SCOPES``)."""
    trace = paper_rewrite_trace(share, setup.seed, setup.chunk_tokens, rewrite_scope=scope)
    if not setup.session_gap_s:
        return trace
    sessions = []
    for k, s in enumerate(trace.sessions):
        shift = k * setup.session_gap_s
        reqs = tuple(replace(r, arrival=r.arrival + shift) for r in s.requests)
        sessions.append(replace(s, requests=reqs))
    return Trace(trace.name, trace.chunk_tokens, tuple(sessions))


def policy_factories(setup: SimSetup, *, same_memory: bool = False) -> dict[str, Factory]:
    """Every known policy: HiState variants first, then the baselines (if installed).

    ``same_memory``: the baselines get HiState's total memory (``baseline_policies``).
    """
    out: dict[str, Factory] = dict(histate_variants(setup))
    try:
        module = importlib.import_module("lmcache_histate.sim.baselines")
    except ModuleNotFoundError as e:
        if e.name not in ("lmcache_histate.sim.baselines",):
            raise
        return out
    registry = getattr(module, "baseline_policies", None)
    if registry is None:
        return out
    for name, factory in _call_registry(registry, setup, same_memory).items():
        if name in out:
            raise ValueError(f"baseline {name!r} clashes with a HiState variant name")
        out[name] = factory
    return out


def _call_registry(
    registry: Callable[..., dict[str, Factory]], setup: SimSetup, same_memory: bool = False
) -> dict[str, Factory]:
    """``registry(setup)``; registries that take the set-up's fields by name also work."""
    params = inspect.signature(registry).parameters
    if "setup" in params or len(params) == 1:
        return registry(setup)
    if same_memory and "same_memory" not in params:
        raise ValueError("the baselines' registry has no same-total-memory view")
    fields = {
        "chunk_tokens": setup.chunk_tokens,
        "kv_bytes_per_token": setup.kv_bytes_per_token,
        "snapshot_bytes": setup.snapshot_bytes,
        "gpu_bytes": setup.gpu_bytes,
        "cpu_bytes": setup.cpu_bytes,
        "disk_bytes": setup.disk_bytes,
        "seed": setup.seed,
        "max_interval_chunks": setup.max_interval_chunks,
        "ema_alpha": setup.ema_alpha,
        "step_grid": setup.cost.step_grid(setup.chunk_tokens),
    }
    if same_memory:
        fields["same_memory"] = True
    return registry(**{k: v for k, v in fields.items() if k in params})


def select_policies(available: dict[str, Factory], names: str | None) -> dict[str, Factory]:
    """``names``: comma-separated list, ``all`` or None (= all). Unknown names: ValueError."""
    if names is None or names.strip() in ("", "all"):
        return dict(available)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in available]
    if unknown:
        raise ValueError(
            f"unknown polic{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)}; "
            f"available: {', '.join(available)}"
        )
    return {n: available[n] for n in dict.fromkeys(wanted)}


def _progress(console: Console | None) -> Progress:
    console = console or Console(stderr=True)
    return Progress(
        TextColumn("[bold]{task.description:<20}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests"),
        TimeElapsedColumn(),
        console=console,
        disable=not console.is_terminal,
        transient=False,
    )


def run_policies(
    trace: Trace,
    setup: SimSetup,
    factories: dict[str, Factory],
    *,
    console: Console | None = None,
    label: str = "",
) -> dict[str, RunResult]:
    """Replay ``trace`` once per policy (a Rich bar per policy, per request)."""
    out: dict[str, RunResult] = {}
    total = trace.num_requests
    with _progress(console) as bar:
        for name, factory in factories.items():
            task = bar.add_task(f"{label}{name}", total=total)
            run = simulate(
                trace, factory(), setup,
                progress=lambda n, task=task: bar.update(task, completed=n),
            )
            run.policy = name
            out[name] = run
    return out


@dataclass(frozen=True, slots=True)
class SweepPoint:
    policy: str
    factor: float
    cpu_bytes: int
    disk_bytes: int
    token_hit_rate: float
    ttft_mean: float
    ttft_p99: float
    makespan_s: float = 0.0
    requests: int = 0


def sweep_capacity(
    trace: Trace,
    setup: SimSetup,
    policies: Sequence[str],
    factors: Iterable[float] = (0.125, 0.25, 0.5, 1.0, 2.0),
    *,
    console: Console | None = None,
) -> list[SweepPoint]:
    """Re-run ``policies`` with CPU and disk capacities scaled by each factor."""
    from .report import percentile, token_hit_rate

    points: list[SweepPoint] = []
    for f in factors:
        scaled = setup.with_(
            cpu_bytes=int(setup.cpu_bytes * f), disk_bytes=int(setup.disk_bytes * f)
        )
        available = policy_factories(scaled)
        chosen = {n: available[n] for n in policies if n in available}
        runs = run_policies(trace, scaled, chosen, console=console, label=f"×{f:g} ")
        for name, run in runs.items():
            ttfts = sorted(r.ttft for r in run.results)
            points.append(
                SweepPoint(
                    name, f, scaled.cpu_bytes, scaled.disk_bytes, token_hit_rate(run.results),
                    sum(ttfts) / len(ttfts) if ttfts else 0.0, percentile(ttfts, 99.0),
                    run.makespan, len(run.results),
                )
            )
    return points


def sweep_table(points: Sequence[SweepPoint], gpu_bytes: int) -> str:
    """The capacity sweep as Markdown: one line per (factor, policy), with each run's
    memory (GPU + CPU + disk), duration and request rate."""
    gib = float(1 << 30)
    lines = [
        "| policy | CPU+disk (GiB) | memory (GiB) | token hit % | TTFT mean (s) | p99 (s) "
        "| duration (h) | requests/h |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in sorted(points, key=lambda p: (p.factor, p.policy)):
        hours = p.makespan_s / 3600
        rate = p.requests / hours if hours > 0 else 0.0
        lines.append(
            f"| {p.policy} | {(p.cpu_bytes + p.disk_bytes) / gib:.1f} | "
            f"{(gpu_bytes + p.cpu_bytes + p.disk_bytes) / gib:.1f} | "
            f"{100 * p.token_hit_rate:.2f} | {p.ttft_mean:.3f} | {p.ttft_p99:.3f} | "
            f"{hours:.2f} | {rate:,.0f} |"
        )
    return "\n".join(lines) + "\n"
