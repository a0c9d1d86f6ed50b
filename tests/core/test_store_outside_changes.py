"""``TieredStore`` driven directly: promotion, lost copies and adoption, byte by byte.

Chunks of 10 tokens, 1 B per token: KV chunk 10 B, snapshot 20 B; tier 0 = CPU, tier 1 =
disk. ``τ = 0`` (H = t). Every expected tier mask, byte count and event is worked out in
the test; ``check()`` recounts the bytes from the index after each step.
"""

from __future__ import annotations

from support.listeners import EventLog, store_events

from lmcache_histate.core.eviction import EvictionQueue
from lmcache_histate.core.index import Node, PrefixIndex
from lmcache_histate.core.placement import TieredStore
from lmcache_histate.core.tiers import KV, SNAPSHOT, PlacementRules, TierSpec

CPU, DISK = 0, 1
KVB, SNAPB = 10, 20


def make(cpu: int, disk: int) -> tuple[PrefixIndex, EvictionQueue, TieredStore, EventLog]:
    index = PrefixIndex(10)
    queue = EvictionQueue(index, 2, tau=0.0, token_bytes=1)
    store = TieredStore(index, queue, (TierSpec("cpu", cpu), TierSpec("disk", disk)),
                        PlacementRules())
    return index, queue, store, EventLog(store_events(store))


def check(queue: EvictionQueue, store: TieredStore, index: PrefixIndex) -> None:
    index.check()
    store.check()
    queue.check(exact=True)  # τ = 0: every rank is t, and nothing was accessed


def test_promote_makes_room_and_moves_the_part_up() -> None:
    """Disk holds session A (KV 1–2, snapshot at 2: 40 B); CPU (30 B) holds B's bundle
    (KV 11 + snapshot, t = 5). Promoting A's snapshot (20 B) to CPU demotes B's bundle
    (30 B) to disk, then moves the snapshot: CPU 20 B, disk 40 − 20 + 30 = 50 B."""
    index, queue, store, log = make(cpu=30, disk=100)
    a1, a2 = index.insert_chain([1, 2])
    for node in (a1, a2):
        assert store.recover(node, KV, DISK, KVB, 0.0)
    assert store.recover(a2, SNAPSHOT, DISK, SNAPB, 0.0)
    (b,) = index.insert_chain([11])
    assert store.store_kv(b, KVB, 5.0)
    assert store.store_snapshot(b, SNAPB, 5.0, final=True)
    log.take()
    assert store.promote(a2, SNAPSHOT, CPU, 10.0)
    assert log.take() == [("moved", 11, KV, DISK), ("moved", 11, SNAPSHOT, DISK),
                          ("moved", 2, SNAPSHOT, CPU)]
    assert (a2.snap_tiers, a2.kv_tiers, b.snap_tiers) == (1 << CPU, 1 << DISK, 1 << DISK)
    assert store.used == [20, 50]
    check(queue, store, index)
    # Already there: nothing to do. Larger than the tier: refused, nothing changes.
    assert store.promote(a2, SNAPSHOT, CPU, 11.0)
    small_index, _, small, small_log = make(cpu=15, disk=100)
    (n,) = small_index.insert_chain([1])
    assert small.recover(n, KV, DISK, KVB, 0.0) and small.recover(n, SNAPSHOT, DISK, SNAPB, 0.0)
    assert not small.promote(n, SNAPSHOT, CPU, 1.0)  # 20 B > 15 B of CPU
    assert small.promote(n, KV, CPU, 1.0)  # 10 B fits
    assert (n.kv_tiers, n.snap_tiers, small.used) == (1 << CPU, 1 << DISK, [10, 20])
    assert small_log.events == [("moved", 1, KV, CPU)]
    assert not small.promote(small_index.insert_chain([1, 2])[1], KV, CPU, 1.0)  # no KV


def two_copies() -> tuple[PrefixIndex, EvictionQueue, TieredStore, EventLog, list[Node]]:
    """KV 1–3 on CPU and adopted again on disk (same size: both bits), snapshot at 3."""
    index, queue, store, log = make(cpu=100, disk=100)
    nodes = index.insert_chain([1, 2, 3])
    for node in nodes:
        assert store.store_kv(node, KVB, 0.0)
        assert store.recover(node, KV, DISK, KVB, 0.0)
    assert store.store_snapshot(nodes[2], SNAPB, 0.0, final=True)
    assert [n.kv_tiers for n in nodes] == [0b11] * 3
    assert store.used == [30 + 20, 30]
    log.take()
    return index, queue, store, log, nodes


def test_losing_one_kv_copy_keeps_the_other() -> None:
    index, queue, store, log, nodes = two_copies()
    store.lose(nodes[1], KV, CPU)
    assert nodes[1].kv_tiers == 1 << DISK
    assert store.used == [50 - 10, 30]
    assert log.events == []  # the lost copy is not reported
    store.lose(nodes[1], KV, CPU)  # idempotent
    assert store.used == [40, 30]
    check(queue, store, index)


def test_losing_the_last_kv_copy_drops_what_depends_on_it() -> None:
    """Chunk 2's only copy (CPU) is lost: chunk 3 below it goes (KV on both tiers, and its
    snapshot on CPU), each reported with the tiers it left; chunk 1 stays."""
    index, queue, store, log, nodes = two_copies()
    store.lose(nodes[1], KV, DISK)  # chunk 2 now on CPU only
    store.lose(nodes[1], KV, CPU)
    assert log.events == [("dropped", 3, SNAPSHOT, 1 << CPU), ("dropped", 3, KV, 0b11)]
    assert store.used == [10, 10]
    assert [n.key for n in index.nodes.values()] == [1]
    check(queue, store, index)


def test_losing_one_snapshot_copy_keeps_the_other() -> None:
    index, queue, store, log, nodes = two_copies()
    assert store.recover(nodes[2], SNAPSHOT, DISK, SNAPB, 0.0)
    assert nodes[2].snap_tiers == 0b11
    store.lose(nodes[2], SNAPSHOT, CPU)
    assert nodes[2].snap_tiers == 1 << DISK
    assert store.used == [30, 30 + 20]
    store.lose(nodes[2], SNAPSHOT, DISK)
    assert nodes[2].snap_tiers == 0 and store.used == [30, 30]
    assert log.events == []
    check(queue, store, index)


def test_recover_accepts_what_fits_the_index_and_nothing_else() -> None:
    index, queue, store, log = make(cpu=100, disk=45)
    n1, n2 = index.insert_chain([1, 2])
    # KV of chunk 2 whose parent (chunk 1, depth 0) holds no KV: a gap, refused.
    assert not store.recover(n2, KV, DISK, KVB, 0.0)
    assert store.recover(n1, KV, DISK, KVB, 0.0)
    assert store.recover(n1, KV, DISK, KVB, 1.0)  # already there: accepted, no change
    assert store.used == [0, 10]
    assert not store.recover(n1, KV, CPU, KVB + 1, 0.0)  # a second copy of another size
    assert store.recover(n1, KV, CPU, KVB, 0.0)  # same size: both bits
    assert n1.kv_tiers == 0b11
    assert store.recover(n1, SNAPSHOT, DISK, SNAPB, 0.0)
    assert not store.recover(n1, SNAPSHOT, CPU, SNAPB + 1, 0.0)
    assert store.recover(n2, KV, DISK, KVB, 0.0)  # now its parent holds KV
    assert not store.recover(n2, SNAPSHOT, DISK, SNAPB, 0.0)  # 40 + 20 > 45 B of disk
    assert store.used == [10, 40]
    assert log.events == []  # adoption is not a placement decision
    check(queue, store, index)
