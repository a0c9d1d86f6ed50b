"""Where one row beats another, request by request: the evidence behind the verdict.

Replays a trace through a reference row (default ``histate``) and other rows, joins the
requests by (session, index) and splits the difference of their TTFTs into its parts
(queueing / sharing the GPU, loads, recompute, state capture), then lists which requests
the other row serves faster and why (it hit deeper, or the same depth cheaper).

Usage (the commands of ``benchmarks/sim_weka.md``)::

    python benchmarks/sim_weka/compare_rows.py --trace ../shared/traces/weka-cc \
        --max-input-tokens 100000 --config configs/sim-paper-load.yaml \
        --rows sglang-hicache-l3,vllm-cpu-disk-offload
"""

from __future__ import annotations

import argparse

from lmcache_histate.sim.config import SimSetup, load_setup
from lmcache_histate.sim.load import with_target_load
from lmcache_histate.sim.report import percentile
from lmcache_histate.sim.runner import load_sim_trace, policy_factories
from lmcache_histate.sim.server import RequestResult, simulate

PARTS = ("queue_s", "load_s", "recompute_s", "capture_s")


def _p(xs: list[float], q: float) -> float:
    return percentile(sorted(xs), q)


def compare(ref: dict, other: dict, name: str, ref_name: str, top: int) -> None:
    keys = sorted(ref)
    a: list[RequestResult] = [ref[k] for k in keys]
    b: list[RequestResult] = [other[k] for k in keys]
    n = len(keys)
    print(f"\n#### {ref_name} vs {name} ({n} requests)\n")
    print(f"| | {ref_name} | {name} |")
    print("|---|---:|---:|")
    for label, f in (("TTFT mean (s)", lambda rs: sum(r.ttft for r in rs) / n),
                     ("TTFT p99 (s)", lambda rs: _p([r.ttft for r in rs], 99)),
                     ("hit tokens (M)", lambda rs: sum(r.hit_tokens for r in rs) / 1e6)):
        print(f"| {label} | {f(a):.3f} | {f(b):.3f} |")
    for part in PARTS:
        print(f"| Σ {part} (s) | {sum(getattr(r, part) for r in a):.1f} | "
              f"{sum(getattr(r, part) for r in b):.1f} |")
    faster = [(x, y) for x, y in zip(a, b, strict=True) if y.ttft < 0.95 * x.ttft]
    slower = [(x, y) for x, y in zip(a, b, strict=True) if x.ttft < 0.95 * y.ttft]
    for label, pairs in ((f"{name} ≥ 5 % faster", faster), (f"{ref_name} ≥ 5 % faster", slower)):
        deeper_b = sum(y.hit_tokens > x.hit_tokens for x, y in pairs)
        deeper_a = sum(x.hit_tokens > y.hit_tokens for x, y in pairs)
        gain = sum(abs(x.ttft - y.ttft) for x, y in pairs)
        print(f"\n{label}: {len(pairs)} requests, Σ {gain:.1f} s; {name} hit deeper in "
              f"{deeper_b}, {ref_name} deeper in {deeper_a}, same depth in "
              f"{len(pairs) - deeper_a - deeper_b}.")
    tail = sorted(zip(a, b, strict=True), key=lambda p: p[1].ttft - p[0].ttft)[:top]
    print(f"\nThe {top} requests {name} serves fastest relative to {ref_name}:\n")
    print(f"| request | input | hit {ref_name} | hit {name} | TTFT {ref_name} | TTFT {name} "
          f"| capture {ref_name} | queue {ref_name} / {name} |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for x, y in tail:
        print(f"| {x.session_id}#{x.index} | {x.input_tokens:,} | {x.hit_tokens:,} | "
              f"{y.hit_tokens:,} | {x.ttft:.2f} | {y.ttft:.2f} | {x.capture_s:.2f} | "
              f"{x.queue_s:.2f} / {y.queue_s:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--max-input-tokens", type=int, default=None)
    ap.add_argument("--config", default=None)
    ap.add_argument("--reference", default="histate")
    ap.add_argument("--rows", required=True, help="comma-separated rows to compare")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    setup = load_setup(args.config) if args.config else SimSetup.paper()
    trace = load_sim_trace(args.trace, setup, args.max_input_tokens)
    setup, _ = with_target_load(trace, setup)  # the config's load rule (sim/load.py)
    factories = policy_factories(setup)
    names = [args.reference, *(r.strip() for r in args.rows.split(",") if r.strip())]
    runs = {n: {r.key: r for r in simulate(trace, factories[n](), setup).results}
            for n in names}
    for n in names[1:]:
        compare(runs[args.reference], runs[n], n, args.reference, args.top)


if __name__ == "__main__":
    main()
