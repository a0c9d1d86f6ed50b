"""Capacity planning with the simulator: how much CPU memory and disk does HiState need?

    .venv/bin/python examples/capacity_planning.py --trace MY_TRACES [--config MY_SETUP.yaml]

Replays your agent trace (a Weka/Claude Code folder or ``*.json.gz`` file, a TraceLab ``.csv``
or a Mooncake ``.jsonl``) through the same policy core the server runs, on the simulated GPU
server of ``--config`` (model, GPU pool, CPU and disk capacities, cost model: start from
``configs/sim-paper.yaml``), with the CPU and disk capacities scaled from 1/32x to 2x. It prints,
per capacity, HiState's p99 time to first token beside vLLM's CPU+disk offload, and the
smallest capacity at which HiState's p99 is within ``--slack`` of an unlimited cache's: the
memory and disk to buy for this workload.

It is ``histate simulate --sweep`` (the same function, ``run_simulate``) plus the reading of the
sweep; the full report (Markdown, JSON, PNG plots) is written to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lmcache_histate.sim.experiment import SimulateOptions, run_simulate

GIB = 1 << 30


def plan(points: list[Any], reference_p99: float, slack: float) -> dict[str, Any]:
    """Rows of the sweep per capacity, and the smallest capacity that meets the target.

    ``points``: the sweep's ``SweepPoint``s (policy, factor, capacities, hit rate, p99).
    Target: HiState's p99 TTFT at most ``(1 + slack) x`` the unlimited cache's.
    """
    target = reference_p99 * (1 + slack)
    rows: dict[float, dict[str, Any]] = {}
    for p in points:
        row = rows.setdefault(p.factor, {"factor": p.factor, "cpu_gib": p.cpu_bytes / GIB,
                                         "disk_gib": p.disk_bytes / GIB})
        row[p.policy] = {"p99_s": p.ttft_p99, "hit_rate": p.token_hit_rate}
    ordered = [rows[f] for f in sorted(rows)]
    enough = [r for r in ordered if r["histate"]["p99_s"] <= target]
    return {"target_p99_s": target, "rows": ordered,
            "recommended": enough[0] if enough else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="weka-sample",
                        help="your trace: folder or file (default: the bundled sample)")
    parser.add_argument("--config", help="simulated server (default: configs/sim-paper.yaml)")
    parser.add_argument("--max-input-tokens", type=int, help="skip longer sessions")
    parser.add_argument("--slack", type=float, default=0.1,
                        help="allowed p99 TTFT above the unlimited cache (default 0.1 = 10%%)")
    parser.add_argument("--out", default="out/capacity-planning", help="report folder")
    parser.add_argument("--json", help="also write the plan as JSON to this file")
    args = parser.parse_args(argv)

    # The three rows the plan reads; --sweep re-runs HiState and vLLM CPU+disk offload at
    # 1/32 .. 2x the configured CPU and disk capacities.
    exp = run_simulate(SimulateOptions(
        trace=args.trace, config=args.config, max_input_tokens=args.max_input_tokens,
        policies="histate,vllm-cpu-disk-offload,unlimited", sweep=True, out=args.out,
    ))
    reference = next(s for s in exp.summaries if s.name == "unlimited")
    result = plan(exp.sweep, reference.ttft.p99, args.slack)

    print(f"trace {exp.trace.name}: {len(exp.trace.sessions)} sessions, "
          f"{exp.trace.num_requests} requests; model {exp.setup.geometry.name}")
    print(f"target: HiState p99 TTFT <= {result['target_p99_s']:.2f} s "
          f"(unlimited cache {reference.ttft.p99:.2f} s + {args.slack:.0%})\n")
    print("| CPU GiB | disk GiB | HiState p99 s (hit rate) | vLLM CPU+disk p99 s (hit rate) |")
    print("|---:|---:|---:|---:|")
    for row in result["rows"]:
        hs, off = row["histate"], row["vllm-cpu-disk-offload"]
        print(f"| {row['cpu_gib']:.1f} | {row['disk_gib']:.1f} | "
              f"{hs['p99_s']:.2f} ({hs['hit_rate']:.1%}) | "
              f"{off['p99_s']:.2f} ({off['hit_rate']:.1%}) |")
    best = result["recommended"]
    if best is None:
        print("\nno capacity in the sweep meets the target: raise capacity in --config")
    else:
        print(f"\nsmallest capacity meeting the target: CPU {best['cpu_gib']:.1f} GiB + disk "
              f"{best['disk_gib']:.1f} GiB ({best['factor']:g}x the configured capacities)")
    print(f"full report: {exp.paths.get('markdown', args.out)}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
