"""The paper's rewrite test in simulation: HiState vs vLLM with CPU+disk offload (LRU).

24 sessions × 16 turns × 8K new tokens (``synthetic.paper_rewrite_trace``), a share of
requests rewriting earlier context at a random position inside an earlier turn: the
most recent one (scope ``last``, where Claude Code cuts, ``sim.rewrite_stats``) or any
(scope ``any``); the paper sweeps 0–10 % and reports the mean TTFT of the rewriting
requests (HiState −18 to −21 %). Ten seeds per share by default, because each seed
draws different rewriting requests and cut positions; the table reports each seed, and
per share the mean [min–max] over the seeds. A row is "lower" only where every seed's
Δ is below 0 (the range lies below 0); otherwise the share is a tie. ``--json`` writes
those summaries (what ``benchmarks/claims.py`` checks the pages against).
``--measure TRACE`` first prints where the requests of a real trace cut (at the Weka
block size, 64 tokens).

Usage: ``python benchmarks/sim_rewrite.py [--shares 0,0.05,0.1] [--seeds 0,1,...,9]
[--scopes last,any] [--config configs/sim-paper.yaml] [--row histate]
[--baseline vllm-cpu-disk-offload] [--measure ../shared/traces/weka-cc] [--json PATH]``
(``--row histate-measured``: the same with measured hit positions, ``core/hit_positions.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from lmcache_histate.sim.capture import capacity_of
from lmcache_histate.sim.config import GIB, SimSetup, load_setup
from lmcache_histate.sim.report import HISTATE, OFFLOAD, token_hit_rate
from lmcache_histate.sim.rewrite_stats import rewrite_stats
from lmcache_histate.sim.runner import policy_factories, rewrite_trace
from lmcache_histate.sim.server import simulate
from lmcache_histate.sim.traces import load_trace


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def measure(spec: str) -> None:
    """Where the requests of a real trace rewrite their predecessors' context."""
    st = rewrite_stats(load_trace(spec, 64))
    far = sum(v for k, v in st.turns_back.items() if k >= 10)
    offsets = sorted(st.last_turn_offsets)
    median = statistics.median(offsets) if offsets else float("nan")
    print(f"{spec}: {st.requests:,} requests, {st.rewrites:,} rewrite their predecessor's "
          f"context: {st.turns_back[0]:,} ({st.last_turn_share:.0%}) inside its most recent "
          f"turn (median offset {median:.3f}), {st.resets:,} resets, "
          f"{st.rewrites - st.resets - st.turns_back[0] - far:,} 1–9 turns back, "
          f"{far:,} ≥ 10 turns back.\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shares", default="0,0.05,0.1")
    ap.add_argument("--seeds", default=",".join(str(i) for i in range(10)))
    ap.add_argument("--json", default=None, help="write the per-share summaries here")
    ap.add_argument("--scopes", default="last,any")
    ap.add_argument("--measure", default=None, help="a Weka trace to measure rewrites in")
    ap.add_argument("--config", default=None)
    ap.add_argument("--row", default=HISTATE)
    ap.add_argument("--baseline", default=OFFLOAD)
    args = ap.parse_args()
    if args.measure:
        measure(args.measure)
    base = load_setup(args.config) if args.config else SimSetup.paper()
    shares = [float(x) for x in args.shares.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    scopes = args.scopes.split(",")
    names = (args.row, args.baseline)
    factories = policy_factories(base)
    memory = ", ".join(f"{n} {capacity_of(factories[n]()) / GIB:.0f} GiB" for n in names)
    print(f"Memory per row: {memory}. Duration and rate: {names[0]}'s run / {names[1]}'s.\n")
    print(f"| scope | share | seed | rewriting requests | {names[0]} rw mean (s) "
          f"| {names[1]} rw mean (s) "
          f"| Δ rw mean | {names[0]} all mean (s) | {names[1]} all mean (s) | Δ all mean "
          f"| hit % {names[0]} / {names[1]} | duration (h) | requests/h |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|")
    summary: list[dict[str, object]] = []
    for scope, share in ((c, s) for c in scopes for s in shares):
        deltas: list[float] = []
        rates_seen: list[float] = []
        for seed in seeds:
            setup = base.with_(seed=seed)
            trace = rewrite_trace(setup, share, scope)
            factories = policy_factories(setup)
            runs = {n: simulate(trace, factories[n](), setup) for n in names}
            rw = {n: _mean([r.ttft for r in runs[n].results if r.rewrite]) for n in names}
            al = {n: _mean([r.ttft for r in runs[n].results]) for n in names}
            hits = [100 * token_hit_rate(runs[n].results) for n in names]
            n_rw = sum(r.rewrite for r in runs[names[0]].results)
            d_rw = rw[names[0]] / rw[names[1]] - 1 if n_rw else float("nan")
            d_al = al[names[0]] / al[names[1]] - 1
            if n_rw:
                deltas.append(d_rw)
            cells = (f"{rw[names[0]]:.3f} | {rw[names[1]]:.3f} | {d_rw:+.1%}" if n_rw
                     else "– | – | –")
            hours = [runs[n].makespan / 3600 for n in names]
            rates = [len(runs[n].results) / h for n, h in zip(names, hours, strict=True)]
            rates_seen.append(rates[0])
            print(f"| {scope} | {share:.0%} | {seed} | {n_rw} | {cells} | {al[names[0]]:.3f} | "
                  f"{al[names[1]]:.3f} | {d_al:+.1%} | {hits[0]:.2f} / {hits[1]:.2f} | "
                  f"{hours[0]:.2f} / {hours[1]:.2f} | {rates[0]:,.0f} / {rates[1]:,.0f} |")
        if deltas:
            verdict = "lower on every seed" if max(deltas) < 0 else (
                "higher on every seed" if min(deltas) > 0 else "tie (the range spans 0)")
            print(f"| {scope} | {share:.0%} | mean [min–max] over {len(deltas)} seeds | | | | "
                  f"{_mean(deltas):+.1%} [{min(deltas):+.1%} … {max(deltas):+.1%}]: "
                  f"{verdict} | | | | | | |")
            summary.append({"scope": scope, "share": share, "seeds": len(deltas),
                            "mean": _mean(deltas), "min": min(deltas), "max": max(deltas),
                            "requests_per_h": _mean(rates_seen)})
    if args.json:
        memory = {n: capacity_of(factories[n]()) / GIB for n in names}
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "row": names[0],
                                               "baseline": names[1], "memory_gib": memory,
                                               "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
