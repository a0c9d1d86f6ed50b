"""``TierCounter``: the simulator's count of dropped snapshots, and of those dropped alone.

Driven through a real ``TieredStore`` (chunks of 10 tokens, 1 B per token: KV chunk 10 B,
snapshot 20 B, ``τ = 0`` so ``H = t``; default rules: KV and final snapshots on tier 0,
intermediate snapshots on tier 1).
"""

from __future__ import annotations

from lmcache_histate.core.eviction import EvictionQueue
from lmcache_histate.core.index import PrefixIndex
from lmcache_histate.core.placement import TieredStore
from lmcache_histate.core.tiers import TierSpec
from lmcache_histate.sim.policy import TierCounter

KVB, SNAPB = 10, 20


def make(cpu: int, disk: int) -> tuple[PrefixIndex, TieredStore, TierCounter]:
    index = PrefixIndex(10)
    queue = EvictionQueue(index, 2, tau=0.0, token_bytes=1)
    counter = TierCounter(["cpu", "disk"])
    store = TieredStore(index, queue, [TierSpec("cpu", cpu), TierSpec("disk", disk)])
    return index, store, counter


def drain(store: TieredStore, counter: TierCounter) -> None:
    """Count the store's queued events, as ``HiStatePolicy.drain`` does the facade's."""
    events, store.events = store.events, []
    counter.count(events)


def test_an_intermediate_snapshot_leaving_the_last_tier_is_dropped_alone() -> None:
    """KV of chunks 1–3 on CPU (30 of 100 B); the disk holds one snapshot (20 B). The
    snapshot after chunk 1 (t = 0) is evicted by the one after chunk 2 (t = 1): one
    snapshot dropped, alone (chunk 1 keeps its KV: 30 B still on CPU), 20 B off the disk."""
    index, store, counter = make(100, 20)
    n1, n2, n3 = index.insert_chain([1, 2, 3])
    for node in (n1, n2, n3):
        assert store.store_kv(node, KVB, 0.0)
    assert store.store_snapshot(n1, SNAPB, 0.0, final=False)
    assert store.store_snapshot(n2, SNAPB, 1.0, final=False)
    drain(store, counter)
    assert (counter.snapshots_dropped, counter.snapshots_dropped_alone) == (1, 1)
    assert counter.dropped_bytes == {"disk": 20}
    assert store.used == [30, 20] and n1.kv_tiers == 1 and not n1.snap_tiers


def test_a_bundle_takes_its_snapshot_with_its_kv() -> None:
    """CPU 40 B holds A's bundle (KV 1–2 + final snapshot at 2 = 40 B, t = 0); the disk's
    30 B cannot take it (40 B), so B's KV at t = 1 drops it: one snapshot dropped, none
    alone; 40 B off the CPU."""
    index, store, counter = make(40, 30)
    a1, a2 = index.insert_chain([1, 2])
    for node in (a1, a2):
        assert store.store_kv(node, KVB, 0.0)
    assert store.store_snapshot(a2, SNAPB, 0.0, final=True)
    (b,) = index.insert_chain([11])
    assert store.store_kv(b, KVB, 1.0)
    drain(store, counter)
    assert (counter.snapshots_dropped, counter.snapshots_dropped_alone) == (1, 0)
    assert counter.dropped_bytes == {"cpu": 40}
