"""Eviction under pressure: HiState's unified queue vs the LRU rows, across capacities.

For each CPU+disk capacity factor (GPU fixed, as in ``histate simulate --sweep``) the
trace is replayed through the eviction rows (``histate``, ``lru``, ``lru-refresh-all``,
``file-lru``) and the two rows that define the reuse-sensitive requests (``unlimited``,
``vllm-cpu-disk-offload``; docs/design.md §6: hit rate ≥ 5 points below the unlimited cache
under disk offload, or HiState and disk offload ≥ 5 points apart). One row per policy:
token hit rate, TTFT mean and p99, reuse-sensitive mean and p99, units dropped, and the
row's memory (GPU + CPU + disk bytes it caches in, ``RunResult.capacity_bytes``).

Usage: ``python benchmarks/sim_eviction.py [--trace weka-sample] [--max-input-tokens N]
[--config configs/sim-paper.yaml] [--factors 0.125,0.25,0.5,1,2] [--policies a,b]
[--max-think-s S] [--session-gap-s S]``
"""

from __future__ import annotations

import argparse
import time

from lmcache_histate.sim.config import SimSetup, load_setup
from lmcache_histate.sim.load import with_target_load
from lmcache_histate.sim.report import (
    HISTATE,
    OFFLOAD,
    REFERENCE,
    TtftStats,
    reuse_sensitive,
    token_hit_rate,
)
from lmcache_histate.sim.runner import load_sim_trace, policy_factories
from lmcache_histate.sim.server import RunResult, simulate

EVICTION_ROWS = (HISTATE, "lru", "lru-refresh-all", "file-lru")
GIB = float(1 << 30)


def _cells(stats: TtftStats | None) -> str:
    return "– | –" if stats is None else f"{stats.mean:.3f} | {stats.p99:.3f}"


def run_point(trace, setup: SimSetup, names: list[str]) -> dict[str, RunResult]:
    factories = policy_factories(setup)
    return {n: simulate(trace, factories[n](), setup) for n in names if n in factories}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="weka-sample")
    ap.add_argument("--max-input-tokens", type=int, default=None)
    ap.add_argument("--config", default=None)
    ap.add_argument("--factors", default="0.125,0.25,0.5,1,2")
    ap.add_argument("--policies", default=",".join(EVICTION_ROWS))
    ap.add_argument("--max-think-s", type=float, default=None,
                    help="override the config's cap on think gaps (compresses the load)")
    ap.add_argument("--session-gap-s", type=float, default=None,
                    help="override the config's stagger between session starts")
    args = ap.parse_args()
    base = load_setup(args.config) if args.config else SimSetup.paper()
    if args.max_think_s is not None:  # a fixed cap in place of the config's target rate
        base = base.with_(max_think_s=args.max_think_s, target_rate_per_h=None)
    if args.session_gap_s is not None:
        base = base.with_(session_gap_s=args.session_gap_s)
    trace = load_sim_trace(args.trace, base, args.max_input_tokens)
    base, calibration = with_target_load(trace, base)  # the config's load rule (sim/load.py)
    if calibration is not None:
        print(calibration.line())
    rows = [p for p in args.policies.split(",") if p]
    names = list(dict.fromkeys([*rows, REFERENCE, OFFLOAD, HISTATE]))
    print(f"trace {trace.name}: {len(trace.sessions)} sessions, {trace.num_requests} requests")
    print()
    print("| CPU+disk (GiB) | policy | hit % | mean (s) | p99 (s) | sensitive mean (s) "
          "| sensitive p99 (s) | dropped units | memory (GiB) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for factor in (float(x) for x in args.factors.split(",")):
        setup = base.with_(
            cpu_bytes=int(base.cpu_bytes * factor), disk_bytes=int(base.disk_bytes * factor)
        )
        t0 = time.perf_counter()
        runs = run_point(trace, setup, names)
        sensitive = reuse_sensitive(runs) or set()
        cap = (setup.cpu_bytes + setup.disk_bytes) / GIB
        makespan = max(r.makespan for r in runs.values()) / 3600
        for name in rows:
            if name not in runs:
                continue
            res = runs[name].results
            all_ = TtftStats.of(r.ttft for r in res)
            sens = TtftStats.of(r.ttft for r in res if r.key in sensitive)
            dropped = runs[name].stats.get("dropped_units")
            units = "–" if dropped is None else f"{dropped:.0f}"  # file-lru drops objects
            memory = runs[name].capacity_bytes / GIB
            print(f"| {cap:.1f} | {name} | {100 * token_hit_rate(res):.2f} | {_cells(all_)} "
                  f"| {_cells(sens)} | {units} | {memory:.1f} |")
        print(f"<!-- factor {factor:g}: {len(sensitive)} reuse-sensitive requests, "
              f"{makespan:.2f} simulated h, {time.perf_counter() - t0:.0f} s -->")


if __name__ == "__main__":
    main()
