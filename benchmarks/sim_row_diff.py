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
3. by whether a request *rewrites* (``rewrite_stats``: it keeps only part of its
   predecessor's prompt, so it resumes from a snapshot inside the context, or from
   nothing): the mean TTFT and missed tokens of both rows over the rewriting requests
   and over all others, and, among the reuse-sensitive requests one row hit more of,
   how many rewrite, how many tokens more, and the idle time before them;
4. the idle times of all requests and A's calibrated ``τ`` (``RunResult.stats``), and
   before the tables each row's drops (units, and intermediate snapshots dropped alone)
   and its interval control's pressure factor at the end;
5. the p99 TTFT over all requests and the requests that make it (at or above their
   row's p99 in either row), split as in 1.

``--fixed-interval-chunks K`` gives both rows (rows on the HiState core only) one fixed
snapshot interval, so that where snapshots are placed (the interval control reads each
row's own residence times) cannot differ between them: what differs is then eviction.

Usage: ``python benchmarks/sim_row_diff.py --trace ../shared/traces/weka-cc
--config configs/sim-paper.yaml --factor 0.25 [--rows histate,file-lru]
[--session-gap-s S] [--fixed-interval-chunks K]``
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from sim_eviction import GIB, run_point

from lmcache_histate.sim.baselines import LRU_ROWS
from lmcache_histate.sim.config import SimSetup, load_setup
from lmcache_histate.sim.load import with_target_load
from lmcache_histate.sim.policy import Policy
from lmcache_histate.sim.report import OFFLOAD, REFERENCE, percentile, reuse_sensitive
from lmcache_histate.sim.rewrite_stats import rewriting_requests
from lmcache_histate.sim.runner import load_sim_trace
from lmcache_histate.sim.server import RequestResult, simulate
from lmcache_histate.sim.variants import VARIANTS, histate_policy


def quantiles(values: Iterable[float]) -> str:
    xs = sorted(values)
    if not xs:
        return "–"
    return " / ".join(f"{xs[min(len(xs) - 1, int(q * len(xs)))]:.0f}" for q in (0.5, 0.9, 0.99))


# What each row's ``RunResult.stats`` says of its drops and its interval control.
DROPS = (("dropped_units", "dropped units"),
         ("snapshots_dropped_alone", "of them intermediate snapshots alone"),
         ("pressure_factor", "pressure factor at the end"))
# The rows built on the HiState core, as ``histate_policy`` knobs.
CORE_ROWS: dict[str, dict[str, object]] = {
    **LRU_ROWS,
    **{n: k for n, k in VARIANTS.items()
       if not {"fixed_interval", "fixed_interval_chunks"} & k.keys()},
}


def fixed_interval_row(setup: SimSetup, name: str, chunks: int) -> Policy:
    """Row ``name`` with a snapshot every ``chunks`` chunks (``--fixed-interval-chunks``)."""
    if name not in CORE_ROWS:
        raise SystemExit(f"--fixed-interval-chunks: {name!r} is not a row on the HiState core "
                         f"whose interval can be fixed; rows: {', '.join(CORE_ROWS)}")
    return histate_policy(setup, name, fixed_interval_chunks=chunks, **dict(CORE_ROWS[name]))


Key = tuple[str, int]
Row = tuple[str, dict[Key, RequestResult]]


def print_rewrites(rewrites: set[Key], sensitive: set[Key], row_a: Row, row_b: Row,
                   idle: dict[Key, float]) -> None:
    """Both rows over the requests that rewrite their predecessor's prompt (``rewrites``:
    they need a snapshot inside the context) and over all others; then, among the reuse-sensitive
    requests where one row hit more, how many rewrite, how much more, and how long their
    sessions were idle."""
    (a, ra), (b, rb) = row_a, row_b
    print(f"\nrewriting requests: {len(rewrites & sensitive)} of "
          f"{len(sensitive)} reuse-sensitive, {len(rewrites)} of {len(ra)} in all\n")
    print(f"| requests | count | {a} mean TTFT (s) | {b} mean TTFT (s) | {a} missed tokens (M) "
          f"| {b} missed tokens (M) |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, keys in (("rewriting", [k for k in ra if k in rewrites]),
                        ("all others", [k for k in ra if k not in rewrites])):
        n = max(1, len(keys))
        print(f"| {label} | {len(keys)} | {sum(ra[k].ttft for k in keys) / n:.3f} "
              f"| {sum(rb[k].ttft for k in keys) / n:.3f} "
              f"| {sum(ra[k].input_tokens - ra[k].hit_tokens for k in keys) / 1e6:.1f} "
              f"| {sum(rb[k].input_tokens - rb[k].hit_tokens for k in keys) / 1e6:.1f} |")
    print("\n| reuse-sensitive, who hit more | requests | of them rewriting | extra hit tokens (M) "
          "| extra per request p50 / p90 / p99 (tokens) "
          "| idle before, p50 / p90 / p99 (s) |")
    print("|---|---:|---:|---:|---|---|")
    for more, less, label in ((rb, ra, f"{b} more"), (ra, rb, f"{a} more")):
        keys = [k for k in sensitive if more[k].hit_tokens > less[k].hit_tokens]
        extra = [more[k].hit_tokens - less[k].hit_tokens for k in keys]
        print(f"| {label} | {len(keys)} | {sum(k in rewrites for k in keys)} | "
              f"{sum(extra) / 1e6:.2f} | {quantiles(extra)} | "
              f"{quantiles(idle[k] for k in keys)} |")


def print_split(keys: Iterable[Key], row_a: Row, row_b: Row, title: str) -> None:
    """``keys`` by who hit more tokens: A − B TTFT summed, and cut into queueing,
    recompute and load."""
    (a, ra), (b, rb) = row_a, row_b
    keys = list(keys)
    print(f"| {title}, who hit more | requests | Σ ΔTTFT (s) | Δ queue (s) | Δ recompute (s) "
          "| Δ load (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, pick in (("same", lambda x, y: x == y), (f"{b} more", lambda x, y: y > x),
                        (f"{a} more", lambda x, y: x > y)):
        d = [(ra[k], rb[k]) for k in keys if pick(ra[k].hit_tokens, rb[k].hit_tokens)]
        print(f"| {label} | {len(d)} | {sum(x.ttft - y.ttft for x, y in d):.0f} "
              f"| {sum(x.queue_s - y.queue_s for x, y in d):.0f} "
              f"| {sum(x.recompute_s - y.recompute_s for x, y in d):.0f} "
              f"| {sum(x.load_s - y.load_s for x, y in d):.0f} |")


def print_tail(rewrites: set[Key], row_a: Row, row_b: Row) -> None:
    """The p99 TTFT over all requests (``report.percentile``, as the results tables) and
    the requests that make it: those at or above their row's p99 in either row, split
    as the reuse-sensitive ones (which of them one row hit more of, and what the TTFT
    difference is made of)."""
    (a, ra), (b, rb) = row_a, row_b
    p99 = {n: percentile(sorted(r.ttft for r in rows.values()), 99.0)
           for n, rows in ((a, ra), (b, rb))}
    tail = {n: {k for k, r in rows.items() if r.ttft >= p99[n]} for n, rows in ((a, ra), (b, rb))}
    union = tail[a] | tail[b]
    print(f"\np99 TTFT, all requests: {a} {p99[a]:.3f} s, {b} {p99[b]:.3f} s; at or above "
          f"it: {a} {len(tail[a])}, {b} {len(tail[b])} requests, {len(tail[a] & tail[b])} "
          f"in both; of the {len(union)} in either, {len(union & rewrites)} rewrite\n")
    print_split(union, row_a, row_b, "p99 tail")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="weka-sample")
    ap.add_argument("--config", default="configs/sim-paper.yaml")
    ap.add_argument("--factor", type=float, default=0.25)
    ap.add_argument("--rows", default="histate,file-lru")
    ap.add_argument("--session-gap-s", type=float, default=None)
    ap.add_argument("--fixed-interval-chunks", type=int, default=None,
                    help="both rows place a snapshot every K chunks (rows on the HiState "
                         "core only): separates where snapshots are placed from what is "
                         "evicted")
    args = ap.parse_args()
    a, b = args.rows.split(",")
    base = load_setup(args.config)
    if args.session_gap_s is not None:
        base = base.with_(session_gap_s=args.session_gap_s)
    setup = base.with_(cpu_bytes=int(base.cpu_bytes * args.factor),
                       disk_bytes=int(base.disk_bytes * args.factor))
    trace = load_sim_trace(args.trace, base, None)
    setup, _ = with_target_load(trace, setup)  # the config's load rule (sim/load.py)
    if args.fixed_interval_chunks is None:
        runs = run_point(trace, setup, list(dict.fromkeys([a, b, REFERENCE, OFFLOAD])))
    else:
        runs = run_point(trace, setup, [REFERENCE, OFFLOAD])
        for name in dict.fromkeys([a, b]):
            runs[name] = simulate(trace, fixed_interval_row(setup, name,
                                                            args.fixed_interval_chunks), setup)
    # The reuse-sensitive set is defined against row A (``reuse_sensitive``'s "histate").
    sensitive = reuse_sensitive(runs, histate=a) or set()
    ra, rb, ru = ({r.key: r for r in runs[n].results} for n in (a, b, REFERENCE))
    idle = {(r.session_id, r.index): min(r.think_time, setup.max_think_s) if r.index else 0.0
            for s in trace.sessions for r in s.requests}

    memory = {n: runs[n].capacity_bytes / GIB for n in (a, b)}
    fixed = ("" if args.fixed_interval_chunks is None
             else f", both rows with a snapshot every {args.fixed_interval_chunks} chunks")
    print(f"{trace.name} at {args.factor:g}x CPU+disk{fixed}, {a} − {b}, "
          f"{len(sensitive)} reuse-sensitive requests; memory (GPU + CPU + disk): "
          f"{a} {memory[a]:.1f} GiB, {b} {memory[b]:.1f} GiB\n")
    for n in (a, b):
        st = runs[n].stats
        print(f"{n}: " + ", ".join(f"{label} {st[key]:g}" for key, label in DROPS if key in st))
    print()
    print_split(sensitive, (a, ra), (b, rb), "reuse-sensitive")
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
    rewrites = rewriting_requests(trace)
    print_rewrites(rewrites, sensitive, (a, ra), (b, rb), idle)
    print_tail(rewrites, (a, ra), (b, rb))
    tau = runs[a].stats.get("tau")
    print(f"\nidle before a request, all requests, p50 / p90 / p99 (s): "
          f"{quantiles(idle[k] for k in ra)}; {a}'s calibrated τ at the end: "
          f"{'–' if tau is None else f'{tau:.1f} s'}")


if __name__ == "__main__":
    main()
