"""The fleet experiment: N nodes behind each router, local-only rows against shared tiers.

Replays ``--copies`` independent copies of the trace (``lmcache_histate.sim.fleet``:
4 × the paper's per-node load on 4 paper-load nodes by default) under each router, every
row ``--repeats`` times on jittered timing, and writes ``--page`` (default
``benchmarks/sim_fleet.md``: the command, the set-up, one table per router with each
row's memory and achieved request rate, the claims; anything below the page's notes
marker is kept across runs), ``fleet.json`` (every value of every repeat and part) and
``fleet.png`` (p99 and reuse-sensitive mean per router, min–max bars) under ``--out``
(default ``benchmarks/sim_fleet``). Model: ``lmcache_histate/sim/{fleet,shared_tier,
fleet_report}.py``.

Usage: ``nice -n 5 python benchmarks/sim_fleet.py [--trace ../shared/traces/weka-cc]
[--max-input-tokens 100000] [--config configs/sim-fleet.yaml] [--repeats 5]
[--jitter 0.1] [--routers least-loaded,...] [--rows histate,...]
[--router-rows ROUTER=ROW,...] [--jobs 2] [--out DIR] [--page FILE]``; ``--render``
rewrites the page's tables and the plot from ``--out``'s ``fleet.json``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lmcache_histate.sim.fleet import ROUTERS, ROWS, FleetSetup, fleet_trace, load_fleet
from lmcache_histate.sim.fleet_report import (
    RowOutcome,
    aggregate_cells,
    fleet_markdown,
    plot_fleet,
    read_fleet_json,
    run_fleet_repeat,
    write_fleet_json,
)
from lmcache_histate.sim.load import Calibration, with_target_load
from lmcache_histate.sim.runner import load_sim_trace

NOTES_MARKER = "<!-- notes below this line are kept when the page is rewritten -->"
_WORKER: dict[str, Any] = {}


def _trace(args: argparse.Namespace,
           think_cap_s: float | None = None) -> tuple[Any, Any, FleetSetup, Calibration | None]:
    """The node set-up, the fleet trace, the fleet. The node config's load rule
    (``sim/load.py``) sets each node's load: the think cap that gives one copy of the
    trace on one node the node config's target rate (``think_cap_s``: already derived),
    so ``copies`` copies on ``nodes`` nodes run at that rate per node."""
    setup, fleet = load_fleet(args.config)
    trace = load_sim_trace(args.trace, setup, args.max_input_tokens)
    cal = None
    if think_cap_s is None:
        setup, cal = with_target_load(trace, setup)
    else:
        setup = setup.with_(max_think_s=think_cap_s)
    return setup, fleet_trace(trace, fleet.copies, setup.session_gap_s), fleet, cal


def _init(args: argparse.Namespace, think_cap_s: float) -> None:
    _WORKER["state"] = _trace(args, think_cap_s)[:3]


def _unit(router: str, repeat: int, repeats: int, jitter: float,
          rows: list[str]) -> list[RowOutcome]:
    setup, trace, fleet = _WORKER["state"]
    return run_fleet_repeat(trace, setup, fleet, router, repeat, repeats, jitter, rows)


def _page(args: argparse.Namespace, meta: dict[str, Any], tables: str, old: str) -> str:
    notes = old.split(NOTES_MARKER, 1)[1] if NOTES_MARKER in old else "\n"
    cmd = " ".join(shlex.quote(a) for a in ["python", "benchmarks/sim_fleet.py", *sys.argv[1:]])
    head = [
        "# Simulator: a fleet of nodes, with and without a shared tier (`benchmarks/sim_fleet.py`)",
        "",
        "Model: `lmcache_histate/sim/fleet.py` (nodes, routers, rows), `sim/shared_tier.py` "
        "(a node over its own tiers and the shared tier; the network price), "
        "`sim/fleet_report.py` (repeats, halves, verdicts). Deterministic: the same command "
        "prints the same tables on any machine.",
        "",
        "Command (repo root):",
        "",
        "```",
        f"nice -n 5 {cmd}",
        "```",
        "",
        *(f"* {k}: {v}" for k, v in meta.items()),
        "",
        "Each cell is the mean [min–max] over the repeats. `÷ histate+shared` is the row's "
        "mean over histate+shared's, then `+` (histate+shared lower beyond the spread on all "
        "requests AND on each half of the sessions), `−` (the row lower, likewise) or `tie`. "
        "`resumed from shared %`: requests whose hit came from the shared tier. Memory: "
        "nodes × each node's own tiers + the ONE shared tier of the fleet.",
        "",
    ]
    return "\n".join(head) + "\n" + tables + "\n" + NOTES_MARKER + notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="../shared/traces/weka-cc")
    ap.add_argument("--max-input-tokens", type=int, default=100_000)
    ap.add_argument("--config", default="configs/sim-fleet.yaml")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--jitter", type=float, default=0.1)
    ap.add_argument("--routers", default=None, help="comma-separated (default: the config's)")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--router-rows", action="append", default=[], metavar="ROUTER=ROW,...",
                    help="rows for one router (default: --rows)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    ap.add_argument("--out", default="benchmarks/sim_fleet")
    ap.add_argument("--page", default="benchmarks/sim_fleet.md")
    ap.add_argument("--render", action="store_true",
                    help="rewrite the page's tables and the plot from --out's fleet.json, "
                         "running nothing")
    args = ap.parse_args()
    if args.render:
        _render(Path(args.out), Path(args.page))
        return
    if args.repeats < 1 or args.jobs < 1:
        ap.error("--repeats and --jobs must be ≥ 1")
    rows = _rows(ap, args.rows)
    router_rows: dict[str, list[str]] = {}
    for spec in args.router_rows:
        router, _, names = spec.partition("=")
        router_rows[router.strip()] = _rows(ap, names)
    t0 = time.perf_counter()
    setup, trace, fleet, cal = _trace(args)
    routers = ([r.strip() for r in args.routers.split(",")] if args.routers
               else list(fleet.routers))
    for r in routers:
        if r not in ROUTERS:
            ap.error(f"unknown router {r!r}; routers: {', '.join(ROUTERS)}")
    units = [(r, k) for r in routers for k in range(args.repeats)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    page = Path(args.page)
    old = page.read_text() if page.exists() else ""
    outcomes: list[RowOutcome] = []
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TextColumn("router × repeat"),
                        TimeElapsedColumn())
    with progress, ProcessPoolExecutor(args.jobs, initializer=_init,
                                       initargs=(args, setup.max_think_s)) as pool:
        task = progress.add_task(f"fleet ×{fleet.nodes} nodes", total=len(units))
        futures = {pool.submit(_unit, r, k, args.repeats, args.jitter,
                               router_rows.get(r, rows)): (r, k) for r, k in units}
        for done, fut in enumerate(as_completed(futures), 1):
            outcomes += fut.result()
            r, k = futures[fut]
            progress.update(task, advance=1, description=f"{r} #{k + 1}")
            # Every finished unit rewrites the results: a cut run keeps what it did.
            tables = _write(args, setup, trace, fleet, routers, outcomes, out, page, old, t0,
                            f"{done} of {len(units)} router × repeat units", cal)
    print(tables)


def _render(out: Path, page: Path) -> None:
    """The page's tables and claims and the plot again, from a finished ``fleet.json``;
    the page's head (command, set-up) and notes stay."""
    cells = read_fleet_json(out / "fleet.json")
    routers = list(dict.fromkeys(r for r, _ in cells))
    plot_fleet(cells, routers, out / "fleet.png")
    old = page.read_text()
    head = old.split("### Router", 1)[0]
    notes = old.split(NOTES_MARKER, 1)[1] if NOTES_MARKER in old else "\n"
    tables = fleet_markdown(cells, routers)
    page.write_text(head + tables + "\n" + NOTES_MARKER + notes)
    print(tables)


def _rows(ap: argparse.ArgumentParser, spec: str) -> list[str]:
    rows = [r.strip() for r in spec.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"unknown row(s) {', '.join(unknown)}; rows: {', '.join(ROWS)}")
    return rows


def _write(args: argparse.Namespace, setup: Any, trace: Any, fleet: FleetSetup,
           routers: list[str], outcomes: list[RowOutcome], out: Path, page: Path, old: str,
           t0: float, done: str, cal: Calibration | None) -> str:
    cells = aggregate_cells(outcomes)
    write_fleet_json(out / "fleet.json", cells)
    plot_fleet(cells, routers, out / "fleet.png")
    tables = fleet_markdown(cells, routers)
    gib = float(1 << 30)
    meta = {
        "trace": f"{trace.name}: {len(trace.sessions)} sessions, {trace.num_requests:,} "
                 f"requests ({fleet.copies} copies of the subset with inputs ≤ "
                 f"{args.max_input_tokens:,} tokens, own ids and hashes, starts interleaved)",
        "nodes": f"{fleet.nodes}, each the per-node set-up of `{args.config}`'s node_config "
                 f"(GPU {setup.gpu_bytes / gib:.1f}, CPU {setup.cpu_bytes / gib:.1f}, disk "
                 f"{setup.disk_bytes / gib:.1f} GiB; ≤ {setup.max_sessions} sessions per node, "
                 f"{fleet.nodes * setup.max_sessions} in the fleet)",
        "load per node": (cal.line() + " (one copy of the trace on one node, "
                          "`sim/load.py`)") if cal is not None
                         else f"think gaps capped at {setup.max_think_s:.0f} s",
        "shared tier": f"one budget of {fleet.shared_bytes / gib:.0f} GiB for the fleet; a read "
                       f"costs bytes / {fleet.network.bytes_per_s * 8 / 1e9:g} Gb/s + "
                       f"{fleet.network.object_latency_s * 1e3:g} ms per object "
                       "(`sim/shared_tier.py` NOTE 1)",
        "repeats": f"{args.repeats}, timing jittered ±{100 * args.jitter:g} % "
                   "(`sim/repeats.py`), the same timings for every row of a router",
        "halves": "CRC-32 of the session's trace id even: half A, odd: B (`sim/halves.py`, "
                  "as every simulator page; subagents and copies with their conversation); "
                  "a claim must hold on both",
        "reuse-sensitive": "requests whose hit rate under `unlimited` (one cache the whole fleet "
                           "reads) is ≥ 5 points above the local vllm-cpu-disk-offload row's",
        "wall time": f"{(time.perf_counter() - t0) / 60:.1f} min with --jobs {args.jobs} "
                     f"({done})",
    }
    page.write_text(_page(args, meta, tables, old))
    return tables


if __name__ == "__main__":
    main()
