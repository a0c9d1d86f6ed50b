"""Request by request: where two eviction rows part at one capacity point.

A row's mean TTFT over the reuse-sensitive requests says *that* it lost, not *where*.
This replays one point (``sim_eviction``'s set-up: CPU+disk scaled by ``--factor``) with
row A, row B and the two rows that define the reuse-sensitive set, then splits A − B:

1. by who hit more tokens (same / B more / A more): the TTFT difference summed and cut
   into queueing, recompute and load (a miss costs its own recompute *and* the queueing
   it puts on every prefill running beside it);
2. among the requests the unlimited cache hits at least half of: those A lost (hit
   < half of the unlimited hit) while B kept them (≥ 90 %), the reverse, and those both
   lost, each with the tokens at stake and the idle time (the capped think time) before
   the request — recency decides a point when these idle times are far above ``τ``;
3. the idle times of all requests and A's calibrated ``τ`` (``RunResult.stats``).

Usage: ``python benchmarks/sim_row_diff.py --trace ../shared/traces/weka-cc
--config configs/sim-paper.yaml --factor 0.25 [--rows histate,file-lru]
[--session-gap-s S]``
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from sim_eviction import GIB, run_point

from lmcache_histate.sim.config import load_setup
from lmcache_histate.sim.report import OFFLOAD, REFERENCE, reuse_sensitive
from lmcache_histate.sim.runner import load_sim_trace


def quantiles(values: Iterable[float]) -> str:
    xs = sorted(values)
    if not xs:
        return "–"
    return " / ".join(f"{xs[min(len(xs) - 1, int(q * len(xs)))]:.0f}" for q in (0.5, 0.9, 0.99))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="weka-sample")
    ap.add_argument("--config", default="configs/sim-paper.yaml")
    ap.add_argument("--factor", type=float, default=0.25)
    ap.add_argument("--rows", default="histate,file-lru")
    ap.add_argument("--session-gap-s", type=float, default=None)
    args = ap.parse_args()
    a, b = args.rows.split(",")
    base = load_setup(args.config)
    if args.session_gap_s is not None:
        base = base.with_(session_gap_s=args.session_gap_s)
    setup = base.with_(cpu_bytes=int(base.cpu_bytes * args.factor),
                       disk_bytes=int(base.disk_bytes * args.factor))
    trace = load_sim_trace(args.trace, base, None)
    runs = run_point(trace, setup, list(dict.fromkeys([a, b, REFERENCE, OFFLOAD])))
    # The reuse-sensitive set is defined against row A (``reuse_sensitive``'s "histate").
    sensitive = reuse_sensitive(runs, histate=a) or set()
    ra, rb, ru = ({r.key: r for r in runs[n].results} for n in (a, b, REFERENCE))
    idle = {(r.session_id, r.index): min(r.think_time, setup.max_think_s) if r.index else 0.0
            for s in trace.sessions for r in s.requests}

    memory = {n: runs[n].capacity_bytes / GIB for n in (a, b)}
    print(f"{trace.name} at {args.factor:g}x CPU+disk, {a} − {b}, "
          f"{len(sensitive)} reuse-sensitive requests; memory (GPU + CPU + disk): "
          f"{a} {memory[a]:.1f} GiB, {b} {memory[b]:.1f} GiB\n")
    print("| who hit more | requests | Σ ΔTTFT (s) | Δ queue (s) | Δ recompute (s) | Δ load (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, pick in (("same", lambda x, y: x == y), (f"{b} more", lambda x, y: y > x),
                        (f"{a} more", lambda x, y: x > y)):
        keys = [k for k in sensitive if pick(ra[k].hit_tokens, rb[k].hit_tokens)]
        d = [(ra[k], rb[k]) for k in keys]
        print(f"| {label} | {len(keys)} | {sum(x.ttft - y.ttft for x, y in d):.0f} "
              f"| {sum(x.queue_s - y.queue_s for x, y in d):.0f} "
              f"| {sum(x.recompute_s - y.recompute_s for x, y in d):.0f} "
              f"| {sum(x.load_s - y.load_s for x, y in d):.0f} |")
    miss = {n: sum(r.input_tokens - r.hit_tokens for r in runs[n].results) for n in (a, b)}
    print(f"\nmissed tokens, all requests: {a} {miss[a] / 1e6:.1f} M, {b} {miss[b] / 1e6:.1f} M\n")

    print("| among requests the unlimited cache hits ≥ half of | requests | tokens at stake (M) "
          "| idle before, p50 / p90 / p99 (s) |")
    print("|---|---:|---:|---|")
    groups: dict[str, list[tuple[str, int]]] = {}
    for k, u in ru.items():
        if u.hit_tokens < 0.5 * u.input_tokens:
            continue
        ha, hb = ra[k].hit_tokens / u.hit_tokens, rb[k].hit_tokens / u.hit_tokens
        lost_a, lost_b, kept_a, kept_b = ha < 0.5, hb < 0.5, ha >= 0.9, hb >= 0.9
        label = (f"{a} lost, {b} kept" if lost_a and kept_b else
                 f"{b} lost, {a} kept" if lost_b and kept_a else
                 "both lost" if lost_a and lost_b else None)
        if label is not None:
            groups.setdefault(label, []).append(k)
    for label, keys in sorted(groups.items()):
        print(f"| {label} | {len(keys)} | {sum(ru[k].hit_tokens for k in keys) / 1e6:.1f} "
              f"| {quantiles(idle[k] for k in keys)} |")
    tau = runs[a].stats.get("tau")
    print(f"\nidle before a request, all requests, p50 / p90 / p99 (s): "
          f"{quantiles(idle[k] for k in ra)}; {a}'s calibrated τ at the end: "
          f"{'–' if tau is None else f'{tau:.1f} s'}")


if __name__ == "__main__":
    main()
