"""How much the cost term moves eviction decisions: ``H − t`` of the victims vs recency.

Replays a trace through the ``histate`` row and records, for every victim the eviction
queue returns, the cost term ``H − t`` (seconds of recency the unit's cost bought it),
per tier; and the gaps between consecutive requests of a session (the recency scale a
cost term must be comparable with). Works with any version of the core whose queue has
``victim(tier, below)`` returning ``(node, H)`` and nodes with ``access``, so the same
command measures the score before and after a change.

Usage: ``python benchmarks/sim_score_scale.py [--trace weka-sample] [--max-input-tokens N]
[--factor 0.125] [--policy histate]``
"""

from __future__ import annotations

import argparse
import statistics

from lmcache_histate.sim.config import SimSetup
from lmcache_histate.sim.runner import load_sim_trace, policy_factories
from lmcache_histate.sim.server import simulate


def _q(xs: list[float], p: float) -> float:
    return xs[int(p * (len(xs) - 1))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="weka-sample")
    ap.add_argument("--max-input-tokens", type=int, default=None)
    ap.add_argument("--factor", type=float, default=0.125, help="CPU+disk scale")
    ap.add_argument("--policy", default="histate")
    args = ap.parse_args()
    base = SimSetup.paper()
    setup = base.with_(cpu_bytes=int(base.cpu_bytes * args.factor),
                       disk_bytes=int(base.disk_bytes * args.factor))
    trace = load_sim_trace(args.trace, setup, args.max_input_tokens)
    policy = policy_factories(setup)[args.policy]()
    # Instrumentation: wraps the core's private eviction queue to record every victim's rank.
    queue = policy.cache._queue  # type: ignore[attr-defined]
    offsets: dict[int, list[float]] = {}
    victim = queue.victim

    def recording(tier: int, below: float | None = None):  # type: ignore[no-untyped-def]
        found = victim(tier, below)
        if found is not None:
            offsets.setdefault(tier, []).append(found[1] - found[0].access)
        return found

    queue.victim = recording
    run = simulate(trace, policy, setup)
    last: dict[str, float] = {}
    gaps = []
    for r in sorted(run.results, key=lambda r: r.start):
        if r.session_id in last:
            gaps.append(r.start - last[r.session_id])
        last[r.session_id] = r.start
    gaps.sort()
    print(f"{trace.name}, CPU+disk ×{args.factor:g}, {args.policy}: "
          f"{len(trace.sessions)} sessions, {trace.num_requests} requests")
    print(f"session re-access gaps (s): p10 {_q(gaps, .1):.1f}, p50 {_q(gaps, .5):.1f}, "
          f"p90 {_q(gaps, .9):.1f}, mean {statistics.fmean(gaps):.1f}")
    for tier in sorted(offsets):
        xs = sorted(offsets[tier])
        print(f"tier {tier}: {len(xs)} victims, H − t (s): p1 {_q(xs, .01):.2f}, "
              f"p10 {_q(xs, .1):.2f}, p50 {_q(xs, .5):.2f}, p90 {_q(xs, .9):.2f}, "
              f"p99 {_q(xs, .99):.2f}")
    print("final tau:", run.stats.get("tau", "n/a"))


if __name__ == "__main__":
    main()
