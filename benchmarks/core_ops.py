"""Cost of the policy core's decisions as the cache grows: µs per operation.

Builds caches holding 10K / 100K / 1M objects (KV chunks + snapshots of many sessions,
one snapshot every 4 chunks, Qwen3.5-9B sizes), full to capacity, then times:

* insert  — store one new chunk's KV into the full CPU tier (includes the eviction or
            demotion it forces, and the re-ranking around both places);
* lookup  — match a 100-chunk chain (per chain);
* evict   — pick the lowest-H unit of the disk tier and drop it, before any access;
* access  — ``begin`` on a cached 100-chunk session (refresh-all writes the new access
            time into its path; nothing is re-ranked, ``core.eviction`` NOTE 1);
* evict after access — the same eviction after the accesses: it also re-ranks the
            refreshed units that reach the top of the heap (the work an access defers).

All sizes run side by side in one process, so the ratios between rows are what to read
on a shared machine. Usage: ``python benchmarks/core_ops.py [--sizes 10000,100000,1000000]``.
"""

from __future__ import annotations

import argparse
import random
import resource
import time

from lmcache_histate.core.cache import CacheConfig, HiStateCache
from lmcache_histate.core.geometry import preset
from lmcache_histate.core.placement import PlacementRules, TierSpec

CHUNK = 528
SESSION_CHUNKS = 100
SNAP_EVERY = 4
OPS = 2000


def build(objects: int) -> tuple[HiStateCache, list[list[int]]]:
    geo = preset("qwen3.5-9b")
    kv = CHUNK * geo.kv_bytes_per_token
    snap = geo.snapshot_bytes
    per_session_kv = SESSION_CHUNKS
    per_session_snap = SESSION_CHUNKS // SNAP_EVERY
    sessions = max(1, objects // (per_session_kv + per_session_snap))
    cfg = CacheConfig(
        chunk_tokens=CHUNK,
        kv_chunk_bytes=kv,
        snapshot_bytes=snap,
        tiers=(
            TierSpec("cpu", sessions * per_session_kv * kv + sessions * snap),
            TierSpec("disk", sessions * per_session_snap * snap),
        ),
        rules=PlacementRules(kv_tier=0, snapshot_tier=1, final_tier=0),
        tau=600.0,
        fixed_interval=SNAP_EVERY * CHUNK,
    )
    cache = HiStateCache(cfg)
    chains = []
    for s in range(sessions):
        keys = [s * 1_000_000 + i for i in range(SESSION_CHUNKS)]
        chains.append(keys)
        handle = cache.begin(f"s{s}", keys, float(s))
        cache.complete(handle, SESSION_CHUNKS * CHUNK, float(s))
    return cache, chains


def timed(fn, n: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - start) / n * 1e6


def run(objects: int, rng: random.Random) -> dict[str, float]:
    t0 = time.perf_counter()
    cache, chains = build(objects)
    build_s = time.perf_counter() - t0
    # A micro-benchmark of the core's own operations (victim, drop, insert, store_kv): it
    # times the private parts behind the facade directly.
    index, queue, store = cache._index, cache._queue, cache._store
    held = len(index.nodes) + sum(1 for n in index.nodes.values() if n.snap_tiers)
    now = float(len(chains) + 10)
    picks = [rng.choice(chains) for _ in range(OPS)]

    lookup = timed(lambda i: cache.lookup(picks[i]), OPS)

    def evict(_: int) -> None:
        found = queue.victim(1)
        if found is not None:
            store.drop(found[0], now)

    ev_clean = timed(evict, OPS // 2)

    def access(i: int) -> None:
        cache.release(cache.begin(f"a{i}", picks[i], now + i))

    acc = timed(access, OPS)

    # New chunks extending fresh prefixes: the CPU tier is full, so each insert evicts.
    base = 9_000_000_000
    fresh = [index.insert_chain([base + i])[0] for i in range(OPS)]
    kv_bytes = cache.config.kv_chunk_bytes
    insert = timed(lambda i: store.store_kv(fresh[i], kv_bytes, now + OPS + i), OPS)
    ev = timed(evict, OPS // 2)
    return {
        "objects": held,
        "build_s": build_s,
        "mem_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "insert_us": insert,
        "lookup_us": lookup,
        "access_us": acc,
        "evict_us": ev_clean,
        "evict_after_us": ev,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,100000,1000000")
    args = ap.parse_args()
    rng = random.Random(0)
    rows = [run(int(s), rng) for s in args.sizes.split(",")]
    print(
        "| objects | build (s) | peak RSS (MiB) | insert (µs) | lookup 100 chunks (µs) "
        "| access (µs) | evict (µs) | evict after access (µs) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['objects']:,} | {r['build_s']:.1f} | {r['mem_mib']:.0f} | {r['insert_us']:.1f} "
            f"| {r['lookup_us']:.1f} | {r['access_us']:.1f} | {r['evict_us']:.1f} "
            f"| {r['evict_after_us']:.1f} |"
        )


if __name__ == "__main__":
    main()
