"""Why one shared row beats another under least-loaded routing: what each shared tier holds.

One replay (no jitter) per variant of the fleet trace under least-loaded routing, printing
per row: token hits, the requests resumed from the shared tier, TTFT mean / p99, the
bytes written to the shared tier, and what it holds at the end (KV chunks, states). The
two diagnostic variants of ``histate+shared`` (not rows of the fleet table) change one
thing each: ``shared τ=0`` ranks the shared tier by recency (the core's own LRU knobs,
``baselines.LRU_ROWS["lru"]``), ``shared every state`` writes every state the node
captured to the shared tier, interval snapshots included (not ``shared_tier.plan``'s
rule: the final state only).

Usage: ``nice -n 5 python benchmarks/sim_fleet_why.py [--trace ../shared/traces/weka-cc]
[--config configs/sim-fleet.yaml]``.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from lmcache_histate.sim.baselines import LRU_ROWS
from lmcache_histate.sim.fleet import (
    HISTATE_SHARED,
    LMCACHE_SHARED,
    FleetRow,
    fleet_rows,
    fleet_trace,
    load_fleet,
    make_router,
    simulate_fleet,
)
from lmcache_histate.sim.load import with_target_load
from lmcache_histate.sim.report import percentile, token_hit_rate
from lmcache_histate.sim.runner import load_sim_trace
from lmcache_histate.sim.shared_tier import HiStateShared, LRUShared, SharedTierNode


class EveryState(HiStateShared):
    """Diagnostic: the shared tier gets each request's KV and every state captured."""

    def store(self, request, lookup, states, now):  # type: ignore[no-untyped-def]
        before = self.policy.counter.written_bytes["shared"]
        self.policy.cache.complete(lookup.handle, request.input_tokens, now, boundaries=states)
        return self.policy.counter.written_bytes["shared"] - before


def holds(row: FleetRow) -> tuple[int, int]:
    """(KV chunks, states) in the row's shared tier."""
    shared = row.shared
    if isinstance(shared, HiStateShared):
        nodes = shared.policy.cache.nodes()
        return sum(1 for n in nodes if n.kv_tiers), sum(1 for n in nodes if n.snap_tiers)
    assert isinstance(shared, LRUShared)
    heaps = shared.policy.engine.heaps[0]
    return len(heaps[0]), len(heaps[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="../shared/traces/weka-cc")
    ap.add_argument("--max-input-tokens", type=int, default=100_000)
    ap.add_argument("--config", default="configs/sim-fleet.yaml")
    args = ap.parse_args()
    setup, fleet = load_fleet(args.config)
    one = load_sim_trace(args.trace, setup, args.max_input_tokens)
    setup, _ = with_target_load(one, setup)  # per node, as benchmarks/sim_fleet.py
    trace = fleet_trace(one, fleet.copies, setup.session_gap_s)
    rows = fleet_rows(setup, fleet)

    def variant(shared_of) -> FleetRow:  # type: ignore[no-untyped-def]
        row = rows[HISTATE_SHARED]()
        first = row.nodes[0]
        assert isinstance(first, SharedTierNode) and isinstance(row.shared, HiStateShared)
        shared = shared_of(row.shared)
        for node in row.nodes:
            assert isinstance(node, SharedTierNode)
            node.shared = shared
        return FleetRow(row.name, row.nodes, shared)

    def tau0(s: HiStateShared) -> HiStateShared:
        config = replace(s.policy.cache.config, **LRU_ROWS["lru"])
        return HiStateShared(type(s.policy)(s.policy.name, config))

    def every(s: HiStateShared) -> HiStateShared:
        return EveryState(s.policy)

    variants = {
        HISTATE_SHARED: rows[HISTATE_SHARED],
        "histate+shared, shared τ=0": lambda: variant(tau0),
        "histate+shared, shared every state": lambda: variant(every),
        LMCACHE_SHARED: rows[LMCACHE_SHARED],
    }
    print("| variant | token hit % | resumed from shared | TTFT mean (s) | p99 (s) "
          "| written to shared (GiB) | holds KV chunks / states |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, make in variants.items():
        row = make()
        fr = simulate_fleet(trace, row, make_router("least-loaded", fleet.nodes), setup)
        ttfts = sorted(r.ttft for r in fr.run.results)
        written = sum(r.written_bytes.get("shared", 0) for r in fr.run.results)
        kv, states = holds(row)
        print(f"| {name} | {100 * token_hit_rate(fr.run.results):.2f} | {fr.shared_hits:,} | "
              f"{sum(ttfts) / len(ttfts):.3f} | {percentile(ttfts, 99):.3f} | "
              f"{written / (1 << 30):,.0f} | {kv:,} / {states:,} |", flush=True)


if __name__ == "__main__":
    main()
