"""One ``histate simulate`` invocation as a function: set-up, trace, runs, report.

Kept apart from the CLI so that benchmarks and tests call the same path the command
does, and the CLI stays parsing plus printing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from .config import SimSetup, load_setup
from .load import with_target_load
from .repeats import (
    DEFAULT_JITTER,
    RepeatedRow,
    repeats_markdown,
    run_repeats,
    write_repeats_report,
)
from .report import (
    HISTATE,
    OFFLOAD,
    REFERENCE,
    PolicySummary,
    load_line,
    markdown,
    reuse_sensitive,
    reuse_sensitive_neutral,
    summarize,
    write_report,
)
from .runner import (
    SweepPoint,
    load_sim_trace,
    policy_factories,
    rewrite_trace,
    run_policies,
    select_policies,
    sweep_capacity,
    sweep_table,
)
from .server import RunResult
from .trace_model import Trace

__all__ = ["Experiment", "SimulateOptions", "policy_lines", "policy_names", "run_simulate"]

SWEEP_FACTORS = (1 / 32, 1 / 8, 1 / 4, 1 / 2, 1.0, 2.0)


@dataclass(slots=True)
class SimulateOptions:
    trace: str = "weka-sample"
    synthetic: str | None = None
    rewrite_share: float = 0.1
    rewrite_scope: str = "last"
    config: str | None = None
    policies: str | None = None
    max_input_tokens: int | None = None
    half: str | None = None  # one of two disjoint halves of the sessions (``halves``)
    out: str = "out/simulate"
    seed: int | None = None
    sweep: bool = False
    sweep_factors: tuple[float, ...] = SWEEP_FACTORS  # CPU and disk scales of --sweep
    plots: bool = True
    same_memory: bool = False
    repeats: int = 1
    jitter: float = DEFAULT_JITTER


@dataclass(slots=True)
class Experiment:
    setup: SimSetup
    trace: Trace
    runs: dict[str, RunResult]
    summaries: list[PolicySummary]
    sensitive: int | None
    sweep: list[SweepPoint] = field(default_factory=list)
    paths: dict[str, Path] = field(default_factory=dict)
    same: list[PolicySummary] = field(default_factory=list)
    repeated: list[RepeatedRow] = field(default_factory=list)  # --repeats K > 1
    repeats: int = 1
    jitter: float = DEFAULT_JITTER

    @property
    def table(self) -> str:
        if self.repeated:
            return repeats_markdown(self.repeated, self.repeats, self.jitter)
        out = markdown(self.summaries, self.same)
        if self.sweep:
            out += "\nCapacity sweep (CPU and disk scaled together, GPU fixed):\n\n"
            out += sweep_table(self.sweep, self.setup.gpu_bytes)
        return out


def _trace(opts: SimulateOptions, setup: SimSetup) -> Trace:
    if opts.synthetic is None:
        return load_sim_trace(opts.trace, setup, opts.max_input_tokens, opts.half)
    if opts.synthetic != "rewrite":
        raise ValueError(f"unknown synthetic trace {opts.synthetic!r}; known: rewrite")
    if not 0.0 <= opts.rewrite_share <= 1.0:
        raise ValueError(f"--rewrite-share must be in [0, 1], got {opts.rewrite_share}")
    return rewrite_trace(setup, opts.rewrite_share, opts.rewrite_scope)


def run_simulate(opts: SimulateOptions, console: Console | None = None) -> Experiment:
    """Run every selected policy on the trace and write the report into ``opts.out``."""
    setup = load_setup(opts.config) if opts.config else SimSetup.paper()
    if opts.seed is not None:
        setup = setup.with_(seed=opts.seed)
    trace = _trace(opts, setup)
    if trace.num_requests == 0:
        raise ValueError(f"trace {trace.name!r} has no requests (after filtering)")
    setup, calibration = with_target_load(trace, setup)
    if calibration is not None and console is not None:
        console.print(f"[load] {calibration.line()}")
    factories = select_policies(policy_factories(setup), opts.policies)
    if opts.repeats != 1:
        return _run_repeated(opts, setup, trace, factories, console)
    runs = run_policies(trace, setup, factories, console=console)
    sensitive = reuse_sensitive(runs)
    summaries = summarize(runs, sensitive, neutral=reuse_sensitive_neutral(runs))
    same = _same_memory(trace, setup, runs, console) if opts.same_memory else []
    points: list[SweepPoint] = []
    if opts.sweep:
        swept = [n for n in (HISTATE, OFFLOAD) if n in policy_factories(setup)]
        points = sweep_capacity(trace, setup, swept, opts.sweep_factors, console=console)
    meta = _meta(opts, setup, trace)
    meta.update({
        "reuse_sensitive_requests": len(sensitive) if sensitive is not None else None,
        "capped_think_gaps": max((r.capped_gaps for r in runs.values()), default=0),
        "load": load_line(summaries),
    })
    paths = write_report(
        Path(opts.out), summaries, meta, runs=runs, sweep=points, plots=opts.plots, same=same
    )
    return Experiment(
        setup, trace, runs, summaries, len(sensitive) if sensitive is not None else None,
        points, paths, same,
    )


def _meta(opts: SimulateOptions, setup: SimSetup, trace: Trace) -> dict[str, Any]:
    """The report's head: what was replayed, on which set-up."""
    meta: dict[str, Any] = {
        "trace": trace.name,
        "sessions": len(trace.sessions),
        "requests": trace.num_requests,
        "max_input_tokens": opts.max_input_tokens,
        "half": opts.half or "all sessions",
        "config": opts.config or "built-in paper set-up (configs/sim-paper.yaml)",
        "model": setup.geometry.name,
        "chunk_tokens": setup.chunk_tokens,
        "capacity_gib": {k: v / (1 << 30) for k, v in setup.capacities.items()},
        "max_sessions": setup.max_sessions,
        "max_think_s": setup.max_think_s,
        "target_rate_per_h": setup.target_rate_per_h,
        "session_gap_s": setup.session_gap_s,
        "tau": setup.tau,
        "seed": setup.seed,
        "cost_model": setup.cost.name,
        "reuse_sensitive_rows": f"{REFERENCE}, {OFFLOAD}, {HISTATE}",
        "capture": f"step overhead {setup.cost.step_overhead_s * 1e3:g} ms per extra prefill "
        f"step, engine steps of {setup.cost.engine_step_tokens} tokens",
    }
    if opts.synthetic:
        meta["rewrite_share"] = opts.rewrite_share
        meta["rewrite_scope"] = opts.rewrite_scope
    return meta


def _run_repeated(
    opts: SimulateOptions, setup: SimSetup, trace: Trace, factories: dict[str, Any],
    console: Console | None,
) -> Experiment:
    """``--repeats K``: every row K times on jittered timing (``repeats``)."""
    if opts.repeats < 1:
        raise ValueError(f"--repeats must be ≥ 1, got {opts.repeats}")
    if opts.sweep or opts.same_memory:
        raise ValueError("--repeats K > 1 does not combine with --sweep or --same-memory")
    if not 0.0 <= opts.jitter < 1.0:
        raise ValueError(f"--jitter must be in [0, 1), got {opts.jitter}")
    rows = run_repeats(trace, setup, factories, opts.repeats, opts.jitter, console=console)
    meta = _meta(opts, setup, trace)
    meta.update({"repeats": opts.repeats, "jitter": opts.jitter})
    paths = write_repeats_report(
        Path(opts.out), rows, meta, repeats=opts.repeats, jitter=opts.jitter, plots=opts.plots
    )
    first = [r.runs[0] for r in rows]
    sensitive = first[0].sensitive.n if first and first[0].sensitive else None
    return Experiment(
        setup, trace, {}, first, sensitive, paths=paths, repeated=rows,
        repeats=opts.repeats, jitter=opts.jitter,
    )


def _same_memory(
    trace: Trace, setup: SimSetup, runs: dict[str, RunResult], console: Console | None
) -> list[PolicySummary]:
    """The same-total-memory view: HiState's run, then every selected baseline that has
    less memory than it, re-run with its slowest tier grown to HiState's total."""
    if HISTATE not in runs:
        raise ValueError("the same-total-memory view needs the histate row")
    total = runs[HISTATE].capacity_bytes
    grown = policy_factories(setup, same_memory=True)
    chosen = {
        n: grown[n] for n, run in runs.items()
        if n != HISTATE and run.capacity_bytes < total and n in grown
    }
    again = run_policies(trace, setup, chosen, console=console, label="same memory ")
    return summarize({HISTATE: runs[HISTATE], **again}, None)


def policy_names(config: str | None = None) -> Sequence[str]:
    setup = load_setup(config) if config else SimSetup.paper()
    return list(policy_factories(setup))


def policy_lines(config: str | None = None) -> list[str]:
    """``--list-policies``: per row its name, memory under ``config`` and what it is."""
    from .baselines import BASELINE_LINES
    from .capture import capacity_of
    from .report import GIB
    from .variants import VARIANT_LINES

    setup = load_setup(config) if config else SimSetup.paper()
    meaning = {**VARIANT_LINES, **BASELINE_LINES}
    factories = policy_factories(setup)
    width = max(len(n) for n in factories)
    out = []
    for name, factory in factories.items():
        cap = capacity_of(factory())
        memory = "∞" if cap == float("inf") else f"{cap / GIB:.0f} GiB"
        out.append(f"{name:<{width}}  {memory:>8}  {meaning.get(name, '')}")
    return out
