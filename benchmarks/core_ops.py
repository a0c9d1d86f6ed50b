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

While the operations run, the caches built are frozen out of the cyclic GC (``frozen``): a
full collection's cost grows with every object of the process, not with the operation timed.
All sizes run side by side in one process, so the ratios between rows are what to read
on a shared machine. ``--against REF`` compares this checkout's core with the core of git
revision ``REF`` instead: both are imported into one process (REF's ``lmcache_histate/core``
extracted with ``git archive``; the core imports only itself), both caches are built, and
the batches of each operation alternate between the two, so load swings hit both alike;
it also checks that both evict the same units in the same order. Besides the ratio of the
totals it prints the median of the per-batch ratios, which a load spike during a few
batches does not move.

Usage: ``python benchmarks/core_ops.py [--sizes 10000,100000,1000000]``,
``python benchmarks/core_ops.py --against main [--sizes 1000000] [--ops 6000 --batches 120]``;
``--phases evict --clock process`` times only the evictions, by the process's CPU time
(a job on the other core then costs less of the comparison: it still shares the caches).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import random
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

CHUNK = 528
SESSION_CHUNKS = 100
SNAP_EVERY = 4
OPS = 2000
PHASES = ("lookup", "evict", "access", "insert", "evict_after")


def load_core(ref: str | None) -> ModuleType:
    """The policy core package: this checkout's, or git revision ``ref``'s (extracted
    into a temporary folder and imported under another name)."""
    if ref is None:
        return importlib.import_module("lmcache_histate.core")
    root = Path(__file__).resolve().parent.parent
    blob = subprocess.run(["git", "-C", str(root), "archive", ref, "lmcache_histate/core"],
                          check=True, capture_output=True).stdout
    tmp = Path(tempfile.mkdtemp(prefix="core_ops_"))
    (tmp / "core.tar").write_bytes(blob)
    with tarfile.open(tmp / "core.tar") as tar:
        tar.extractall(tmp, filter="data")
    (tmp / "lmcache_histate" / "core").rename(tmp / "core_at_ref")
    sys.path.insert(0, str(tmp))
    return importlib.import_module("core_at_ref")


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


class Side:
    """One core's cache, full to capacity, and the operations timed on it."""

    def __init__(self, core: ModuleType, objects: int, seed: int = 0) -> None:
        cache_m = importlib.import_module(core.__name__ + ".cache")
        place = importlib.import_module(core.__name__ + ".placement")
        geo = importlib.import_module(core.__name__ + ".model_presets").preset("qwen3.5-9b")
        kv, snap = CHUNK * geo.kv_bytes_per_token, geo.snapshot_bytes
        per_snap = SESSION_CHUNKS // SNAP_EVERY
        sessions = max(1, objects // (SESSION_CHUNKS + per_snap))
        cfg = cache_m.CacheConfig(
            chunk_tokens=CHUNK,
            kv_chunk_bytes=kv,
            snapshot_bytes=snap,
            tiers=(
                place.TierSpec("cpu", sessions * SESSION_CHUNKS * kv + sessions * snap),
                place.TierSpec("disk", sessions * per_snap * snap),
            ),
            rules=place.PlacementRules(kv_tier=0, snapshot_tier=1, final_tier=0),
            tau=600.0,
            fixed_interval=SNAP_EVERY * CHUNK,
            # The simulator's HiState rows price end hits by exposure (``core.eviction``
            # NOTE 7); a core without the knob is timed with its own pricing.
            **({"exposed_ends": True} if "exposed_ends" in _fields(cache_m.CacheConfig) else {}),
        )
        t0 = time.perf_counter()
        self.cache = cache = cache_m.HiStateCache(cfg)
        # A core that queues its placement events is drained after each operation, as
        # its owners do (``HiStateCache.take_events``): the timing includes the queue.
        self.drain: Callable[[], object] = getattr(cache, "take_events", lambda: None)
        chains = []
        for s in range(sessions):
            keys = [s * 1_000_000 + i for i in range(SESSION_CHUNKS)]
            chains.append(keys)
            handle = cache.begin(f"s{s}", keys, float(s))
            cache.complete(handle, SESSION_CHUNKS * CHUNK, float(s))
            self.drain()
        self.build_s = time.perf_counter() - t0
        # A micro-benchmark of the core's own operations (victim, drop, insert, store_kv):
        # it times the private parts behind the facade directly.
        self.index, self.queue, self.store = cache._index, cache._queue, cache._store
        self.objects = len(self.index.nodes) + sum(
            1 for n in self.index.nodes.values() if n.snap_tiers
        )
        self.now = float(len(chains) + 10)
        rng = random.Random(seed)
        self.picks = [rng.choice(chains) for _ in range(OPS)]
        self.fresh: list = []
        self.victims: list[int] = []

    def op(self, phase: str) -> Callable[[int], None]:
        if phase == "insert" and not self.fresh:
            # New chunks extending fresh prefixes: the CPU tier is full, so each evicts.
            self.fresh = [self.index.insert_chain([9_000_000_000 + i])[0] for i in range(OPS)]
        return getattr(self, "evict" if phase == "evict_after" else phase)

    def lookup(self, i: int) -> None:
        self.cache.lookup(self.picks[i])

    def evict(self, _: int) -> None:
        found = self.queue.victim(1)
        if found is not None:
            self.victims.append(found[0].key)
            self.store.drop(found[0], self.now)
            self.drain()

    def access(self, i: int) -> None:
        self.cache.release(self.cache.begin(f"a{i}", self.picks[i], self.now + i))

    def insert(self, i: int) -> None:
        kv = self.cache.config.kv_chunk_bytes
        self.store.store_kv(self.fresh[i], kv, self.now + OPS + i)
        self.drain()


def count(phase: str) -> int:
    return OPS // 2 if phase.startswith("evict") else OPS


@contextmanager
def frozen() -> Iterator[None]:
    """Collect, then keep every object built so far out of the cyclic GC's reach while the
    operations run (``gc.freeze``), and give them back to it afterwards. A full collection
    walks every object of the process: its cost grows with the cache, not with the
    operation, and where it lands depends on the allocations before it. Unfrozen, one
    landed in the 100K insert window (51 ms, +25 µs per insert). Given back, a finished
    size's cache (its nodes reference each other) is collected before the next one is built,
    as it was without the freeze."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run(objects: int) -> dict[str, float]:
    gc.collect()  # the previous size's cache
    side = Side(load_core(None), objects)
    row = {"objects": side.objects, "build_s": side.build_s}
    with frozen():
        for phase in PHASES:
            fn, n = side.op(phase), count(phase)
            start = time.perf_counter()
            for i in range(n):
                fn(i)
            row[phase] = (time.perf_counter() - start) / n * 1e6
    row["mem_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return row


def against(
    ref: str,
    objects: int,
    batches: int = 40,
    phases: tuple[str, ...] = PHASES,
    clock: Callable[[], float] = time.perf_counter,
) -> None:
    """Both cores side by side, batches alternated (module docstring). The ratio is of
    the totals; the median of the per-batch ratios (each pair ran back to back) is the
    one a load swing during a few batches does not move."""
    gc.collect()  # the previous size's caches
    sides = {"this checkout": Side(load_core(None), objects), ref: Side(load_core(ref), objects)}
    names = list(sides)
    print(f"{objects:,} objects; µs per operation, mean of {batches} alternated batches\n")
    print(f"| operation | {names[0]} | {names[1]} | ratio | median batch ratio |")
    print("|---|---:|---:|---:|---:|")
    with frozen():
        for phase in phases:
            fns = {name: side.op(phase) for name, side in sides.items()}
            per = count(phase) // batches
            spent = dict.fromkeys(names, 0.0)
            ratios = []
            for k in range(batches):
                took = {}
                for name in names if k % 2 == 0 else reversed(names):
                    fn = fns[name]
                    start = clock()
                    for i in range(k * per, (k + 1) * per):
                        fn(i)
                    took[name] = clock() - start
                    spent[name] += took[name]
                ratios.append(took[names[0]] / took[names[1]])
            us = {name: spent[name] / (per * batches) * 1e6 for name in names}
            print(f"| {phase.replace('_', ' ')} | {us[names[0]]:.1f} | {us[names[1]]:.1f} "
                  f"| {us[names[0]] / us[names[1]]:.2f} | {statistics.median(ratios):.2f} |")
    same = sides[names[0]].victims == sides[names[1]].victims
    print(f"\nSame {len(sides[names[0]].victims):,} victims in the same order: {same}")


def main() -> None:
    global OPS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=None, help="default 10000,100000,1000000 (1000000 "
                    "with --against)")
    ap.add_argument("--against", default=None, metavar="REF",
                    help="a git revision whose core runs side by side with this checkout's")
    ap.add_argument("--ops", type=int, default=OPS, help=f"operations of each kind (default "
                    f"{OPS}; half as many evictions)")
    ap.add_argument("--batches", type=int, default=40, help="alternated batches with --against")
    ap.add_argument("--phases", default=",".join(PHASES),
                    help="with --against: the operations to time, in this order")
    ap.add_argument("--clock", choices=("wall", "process"), default="wall",
                    help="with --against: wall time (default) or the process's CPU time")
    args = ap.parse_args()
    OPS = args.ops
    if args.against:
        phases = tuple(args.phases.split(","))
        if not set(phases) <= set(PHASES):
            ap.error(f"--phases: choose among {','.join(PHASES)}")
        clock = time.process_time if args.clock == "process" else time.perf_counter
        for size in (args.sizes or "1000000").split(","):
            against(args.against, int(size), args.batches, phases, clock)
        return
    rows = [run(int(s)) for s in (args.sizes or "10000,100000,1000000").split(",")]
    print(
        "| objects | build (s) | peak RSS (MiB) | insert (µs) | lookup 100 chunks (µs) "
        "| access (µs) | evict (µs) | evict after access (µs) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['objects']:,} | {r['build_s']:.1f} | {r['mem_mib']:.0f} | {r['insert']:.1f} "
            f"| {r['lookup']:.1f} | {r['access']:.1f} | {r['evict']:.1f} "
            f"| {r['evict_after']:.1f} |"
        )


if __name__ == "__main__":
    main()
