"""``TieredStore``'s events, counters and residence samples, event by event.

Driven directly (as ``test_store_outside_changes``): chunks of 10 tokens, 1 B per token,
KV chunk 10 B, snapshot 20 B, ``τ = 0`` (H = t). Each test names the store path it pins:
retiring a final snapshot (moved, copy released, or forgotten when the snapshot tier
cannot take it), promotion of each part, a drop while promoting, and a demotion onto a
tier that already holds a copy (three tiers, so the source tier's bit is not bit 0).
``Log`` below also keeps the source tier of a move, which ``EventLog`` leaves out.
"""

from __future__ import annotations

import pytest

from lmcache_histate.core.eviction import EvictionQueue
from lmcache_histate.core.index import Node, PrefixIndex
from lmcache_histate.core.placement import TieredStore
from lmcache_histate.core.tiers import KV, SNAPSHOT, PlacementRules, TierSpec

CPU, DISK, FAR = 0, 1, 2
KVB, SNAPB = 10, 20


class Log:
    """The store's events in order, each cut to ``(what, key, part, tier(s))``, with a
    move's source tier kept: ``("moved", key, part, src, dst)``."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store

    def take(self) -> list[tuple[object, ...]]:
        events, self.store.events = self.store.events, []
        return [e[:5] if e[0] == "moved" else e[:4] for e in events]


def make(
    *capacities: int, rules: PlacementRules | None = None
) -> tuple[PrefixIndex, EvictionQueue, TieredStore, Log]:
    index = PrefixIndex(10)
    queue = EvictionQueue(index, len(capacities), tau=0.0, token_bytes=1)
    tiers = [TierSpec(f"t{i}", c) for i, c in enumerate(capacities)]
    store = TieredStore(index, queue, tiers, rules)
    return index, queue, store, Log(store)


def check(index: PrefixIndex, queue: EvictionQueue, store: TieredStore) -> None:
    index.check()
    store.check()
    queue.check(exact=True)


def final_session(store: TieredStore, index: PrefixIndex, now: float) -> list[Node]:
    """KV of chunks 1 and 2, the final snapshot at chunk 2."""
    nodes = index.insert_chain([1, 2])
    for node in nodes:
        assert store.store_kv(node, KVB, now)
    assert store.store_snapshot(nodes[1], SNAPB, now, final=True)
    return nodes


def test_a_retired_final_snapshot_moves_to_the_snapshot_tier() -> None:
    """Default rules: final → CPU, home of snapshots → disk. CPU: KV 20 + snapshot 20 = 40 B;
    retiring moves the snapshot: CPU 20, disk 20, one ``moved`` event 0 → 1."""
    index, queue, store, log = make(100, 100)
    _, n2 = final_session(store, index, 0.0)
    assert store.used == [40, 0]
    log.take()
    store.retire_final(n2, 1.0)
    assert log.take() == [("moved", 2, SNAPSHOT, CPU, DISK)]
    assert n2.snap_tiers == 1 << DISK
    assert store.used == [20, 20]
    check(index, queue, store)


def test_a_retired_final_snapshot_releases_its_copy_outside_the_home_tier() -> None:
    """Finals on disk (tier 1) with a write-through copy on CPU, home of snapshots CPU.

    The final goes to disk and its copy to CPU: mask 0b11, CPU 20 (KV) + 20 = 40 B, disk
    20 B. Retiring keeps the home (CPU) copy and releases the disk one: one ``dropped``
    event with mask 1 << 1 = 0b10; disk back to 0 B, the snapshot's mask 0b01.
    """
    rules = PlacementRules(kv_tier=CPU, snapshot_tier=CPU, final_tier=DISK, final_copy_tier=CPU)
    index, queue, store, log = make(100, 100, rules=rules)
    _, n2 = final_session(store, index, 0.0)
    assert n2.snap_tiers == 0b11 and store.used == [40, 20]
    log.take()
    store.retire_final(n2, 1.0)
    assert log.take() == [("dropped", 2, SNAPSHOT, 0b10)]
    assert n2.snap_tiers == 0b01
    assert store.used == [40, 0]
    check(index, queue, store)


def test_a_final_snapshot_the_snapshot_tier_cannot_take_is_forgotten() -> None:
    """Disk holds 0 B: the retired final (stored at t = 2) is dropped at t = 7, its
    residence sampled: 7 − 2 = 5 s, which seeds the snapshot EMA (5.0, one sample)."""
    index, queue, store, log = make(100, 0)
    _, n2 = final_session(store, index, 2.0)
    log.take()
    store.retire_final(n2, 7.0)
    (event,) = store.events
    assert log.take() == [("dropped", 2, SNAPSHOT, 1 << CPU)]
    assert n2.snap_tiers == 0
    assert (store.residence.snapshot_ema, store.residence.snapshot_samples) == (5.0, 1)
    # The whole event, read after the node changed: 20 B left the mask 0b01 it was
    # held on (no copy left), stored at t = 2, last accessed at t = 2 (its store), with
    # no KV below it (a final snapshot on the leaf: not alone).
    assert event == ("dropped", 2, SNAPSHOT, 0b01, SNAPB, 0b01, 2.0, 2.0, False)
    assert store.used == [20, 0]
    check(index, queue, store)


def test_promote_reads_the_mask_of_the_part_it_moves() -> None:
    """Chunk 1: KV on disk, snapshot on CPU (adopted). Promoting the snapshot to CPU is a
    no-op (it is there, though the KV is not); promoting the KV moves it 1 → 0. A KV chunk
    without any snapshot (chunk 2, disk) is promoted as well."""
    index, queue, store, log = make(100, 100)
    n1, n2 = index.insert_chain([1, 2])
    assert store.recover(n1, KV, DISK, KVB, 0.0)
    assert store.recover(n1, SNAPSHOT, CPU, SNAPB, 0.0)
    assert store.recover(n2, KV, DISK, KVB, 0.0)
    assert store.used == [20, 20]
    assert store.promote(n1, SNAPSHOT, CPU, 1.0)
    assert log.take() == [] and n1.kv_tiers == 1 << DISK
    assert store.promote(n1, KV, CPU, 1.0)
    assert store.promote(n2, KV, CPU, 1.0)
    assert log.take() == [("moved", 1, KV, DISK, CPU), ("moved", 2, KV, DISK, CPU)]
    assert (n1.kv_tiers, n2.kv_tiers, n1.snap_tiers) == (1 << CPU, 1 << CPU, 1 << CPU)
    assert store.used == [40, 0]
    # A snapshot on disk while its KV is on CPU: promoting the snapshot moves it.
    (n3,) = index.insert_chain([1, 2, 3])[2:]
    assert store.store_kv(n3, KVB, 2.0)
    assert store.recover(n3, SNAPSHOT, DISK, SNAPB, 2.0)
    log.take()
    assert store.promote(n3, SNAPSHOT, CPU, 3.0)
    assert log.take() == [("moved", 3, SNAPSHOT, DISK, CPU)]
    check(index, queue, store)


def test_promote_to_a_tier_already_holding_the_part_changes_nothing() -> None:
    """KV of chunk 1 on disk only (10 B); promoting it to disk (tier 1): True, no event."""
    index, queue, store, log = make(100, 100)
    (n1,) = index.insert_chain([1])
    assert store.recover(n1, KV, DISK, KVB, 0.0)
    assert store.promote(n1, KV, DISK, 1.0)
    assert log.take() == []
    assert (n1.kv_tiers, store.used) == (1 << DISK, [0, 10])
    check(index, queue, store)


def test_a_promotion_that_drops_a_unit_samples_its_residence() -> None:
    """CPU 10 B holds B's chunk 11 (stored t = 5); disk 10 B holds A's chunk 1 (adopted
    t = 0), which the caller pins while promoting it at t = 10. Making CPU room demotes
    B's dead tail (H = 5); the disk has no unpinned unit below 5, so B is dropped: one
    dropped unit, KV residence 10 − 5 = 5 s (seeds the KV EMA), ``dropped`` with mask 0b01.
    """
    index, queue, store, log = make(10, 10)
    (a1,) = index.insert_chain([1])
    assert store.recover(a1, KV, DISK, KVB, 0.0)
    (b,) = index.insert_chain([11])
    assert store.store_kv(b, KVB, 5.0)
    log.take()
    a1.pins += 1
    assert store.promote(a1, KV, CPU, 10.0)
    a1.pins -= 1
    assert log.take() == [("dropped", 11, KV, 1 << CPU), ("moved", 1, KV, DISK, CPU)]
    assert store.dropped_units == 1
    assert (store.residence.kv_ema, store.residence.kv_samples) == (5.0, 1)
    assert store.used == [10, 0]
    check(index, queue, store)


def test_demoting_onto_a_tier_with_a_copy_releases_the_source_copy() -> None:
    """Three tiers. Chunk 1's KV sits on tiers 1 and 2 (adopted, 10 B each); tier 1 holds
    10 B. Storing chunk 5's KV with kv_tier = 1 demotes chunk 1 to tier 2, which already
    has it: the tier-1 copy is released (``dropped`` with mask 1 << 1 = 0b010), no move.
    """
    rules = PlacementRules(kv_tier=1, snapshot_tier=2, final_tier=1)
    index, queue, store, log = make(100, 10, 100, rules=rules)
    (n1,) = index.insert_chain([1])
    assert store.recover(n1, KV, DISK, KVB, 0.0)
    assert store.recover(n1, KV, FAR, KVB, 0.0)
    (n5,) = index.insert_chain([5])
    assert store.store_kv(n5, KVB, 1.0)
    assert log.take() == [("dropped", 1, KV, 0b010), ("stored", 5, KV, DISK)]
    assert (n1.kv_tiers, n5.kv_tiers) == (1 << FAR, 1 << DISK)
    assert store.used == [0, 10, 10]
    check(index, queue, store)


def test_losing_the_last_snapshot_copy_forgets_its_size() -> None:
    """A snapshot on CPU only (20 B) lost: no copy left, the node holds no snapshot bytes."""
    index, queue, store, _log = make(100, 100)
    _, n2 = final_session(store, index, 0.0)
    store.lose(n2, SNAPSHOT, CPU)
    assert (n2.snap_tiers, n2.snap_bytes) == (0, 0)
    assert store.used == [20, 0]
    check(index, queue, store)


def test_store_arguments_and_refusals() -> None:
    """What ``TieredStore`` refuses, and what it accepts twice without doing anything."""
    index, queue, store, log = make(30, 30)
    n1, n2 = index.insert_chain([1, 2])
    assert not store.store_kv(n2, KVB, 0.0)  # chunk 1 (depth 0) holds no KV: a gap
    assert not store.store_snapshot(n1, SNAPB, 0.0, final=True)  # no KV to resume from
    assert log.take() == []
    assert not store.store_kv(n1, 31, 0.0)  # 31 B fits no tier (30 B each)
    assert store.store_kv(n1, KVB, 0.0)
    assert store.store_kv(n1, KVB, 1.0)  # already cached: accepted, nothing stored
    assert not store.store_snapshot(n1, 31, 0.0, final=True)  # 31 B: no tier takes it
    assert store.store_snapshot(n1, SNAPB, 0.0, final=True)
    assert store.store_snapshot(n1, SNAPB, 1.0, final=True)  # already there
    assert log.take() == [("stored", 1, KV, CPU), ("stored", 1, SNAPSHOT, CPU)]
    assert store.used == [30, 0]
    index.prune(n2)  # chunk 2 never got its KV
    check(index, queue, store)
    tiers = (TierSpec("cpu", 10), TierSpec("disk", 10))
    with pytest.raises(ValueError, match=r"^at least one tier is needed$"):
        TieredStore(index, queue, ())
    with pytest.raises(ValueError, match=r"^the eviction queue must have one heap per tier$"):
        TieredStore(index, EvictionQueue(index, 1, tau=0.0, token_bytes=1), tiers)
    two = EvictionQueue(index, 2, tau=0.0, token_bytes=1)
    TieredStore(index, two, tiers, PlacementRules(kv_tier=1, snapshot_tier=1, final_tier=1))
    with pytest.raises(ValueError, match=r"^placement kv_tier=2 is not a tier index$"):
        TieredStore(index, two, tiers, PlacementRules(kv_tier=2))


def test_only_a_final_snapshot_gets_the_write_through_copy() -> None:
    """Intermediate snapshots → disk, finals → CPU with a copy on disk. Chunk 2's
    intermediate snapshot lands on disk alone (0b10); chunk 3's final on CPU and disk
    (0b11). CPU: KV 30 + final 20 = 50 B; disk: 20 + 20 = 40 B."""
    rules = PlacementRules(kv_tier=CPU, snapshot_tier=DISK, final_tier=CPU, final_copy_tier=DISK)
    index, queue, store, _log = make(100, 100, rules=rules)
    nodes = index.insert_chain([1, 2, 3])
    for node in nodes:
        assert store.store_kv(node, KVB, 0.0)
    assert store.store_snapshot(nodes[1], SNAPB, 0.0, final=False)
    assert store.store_snapshot(nodes[2], SNAPB, 0.0, final=True)
    assert (nodes[1].snap_tiers, nodes[2].snap_tiers) == (0b10, 0b11)
    assert store.used == [50, 40]
    check(index, queue, store)
    # Intermediate snapshots on CPU too: chunk 2's stays on CPU alone (0b01), no copy.
    rules = PlacementRules(kv_tier=CPU, snapshot_tier=CPU, final_tier=CPU, final_copy_tier=DISK)
    index, queue, store, _log = make(100, 100, rules=rules)
    nodes = index.insert_chain([1, 2])
    for node in nodes:
        assert store.store_kv(node, KVB, 0.0)
    assert store.store_snapshot(nodes[1], SNAPB, 0.0, final=False)
    assert nodes[1].snap_tiers == 0b01 and store.used == [40, 0]


def test_a_unit_larger_than_the_lower_tier_is_dropped_not_demoted() -> None:
    """CPU 40 B holds A's bundle (KV 1–2 + final snapshot at 2 = 40 B, t = 0); disk holds
    30 B. B's KV at t = 1 needs CPU room: demoting A would need 20 + 20 = 40 B > 30 B of
    disk, so A is dropped (snapshot first, then KV leaf first), then B is stored."""
    index, queue, store, log = make(40, 30)
    final_session(store, index, 0.0)
    log.take()
    (b,) = index.insert_chain([11])
    assert store.store_kv(b, KVB, 1.0)
    assert log.take() == [
        ("dropped", 2, SNAPSHOT, 1 << CPU),
        ("dropped", 2, KV, 1 << CPU),
        ("dropped", 1, KV, 1 << CPU),
        ("stored", 11, KV, CPU),
    ]
    assert store.used == [10, 0] and store.dropped_units == 1
    check(index, queue, store)


def test_demotion_makes_room_below_by_dropping_a_colder_unit() -> None:
    """CPU and disk hold one 10 B chunk each (τ = 0, H = t). t = 0: A's chunk 1 on CPU.
    t = 1: B's chunk 11 demotes A to disk. t = 2: C's chunk 21 needs CPU: the victim B
    (H = 1) needs disk room, where A (H = 0 < 1) is dropped; then B moves down."""
    index, queue, store, log = make(10, 10)
    for key, t in ((1, 0.0), (11, 1.0), (21, 2.0)):
        (node,) = index.insert_chain([key])
        assert store.store_kv(node, KVB, t)
    assert log.take() == [
        ("stored", 1, KV, CPU),
        ("moved", 1, KV, CPU, DISK),
        ("stored", 11, KV, CPU),
        ("dropped", 1, KV, 1 << DISK),
        ("moved", 11, KV, CPU, DISK),
        ("stored", 21, KV, CPU),
    ]
    assert store.used == [10, 10] and store.dropped_units == 1
    # t = 3: the same again one step on: B (H = 1) dropped from disk, C moves down.
    (node,) = index.insert_chain([31])
    assert store.store_kv(node, KVB, 3.0)
    assert store.dropped_units == 2
    check(index, queue, store)


def test_demotion_from_a_middle_tier_moves_only_what_is_there() -> None:
    """Three tiers; KV and finals on tier 1 (30 B), snapshots home on tier 2.

    Chunk 1's KV sits on tier 2 (adopted), chunk 2's KV and snapshot on tier 1 (30 B,
    full, t = 0). Chunk 5's KV (t = 1) needs 10 B on tier 1: the bundle at 2 demotes to
    tier 2: its segment is 2 → 1, but only chunk 2's KV (bit 1 << 1) and the snapshot
    are on tier 1; chunk 1 stays where it is. Tier 1: 30 − 30 + 10 = 10 B; tier 2:
    10 + 30 = 40 B.
    """
    rules = PlacementRules(kv_tier=1, snapshot_tier=2, final_tier=1)
    index, queue, store, log = make(100, 30, 100, rules=rules)
    n1, n2 = index.insert_chain([1, 2])
    assert store.recover(n1, KV, FAR, KVB, 0.0)
    assert store.recover(n2, KV, DISK, KVB, 0.0)
    assert store.recover(n2, SNAPSHOT, DISK, SNAPB, 0.0)
    assert store.used == [0, 30, 10]
    (n5,) = index.insert_chain([5])
    assert store.store_kv(n5, KVB, 1.0)
    assert log.take() == [
        ("moved", 2, KV, DISK, FAR),
        ("moved", 2, SNAPSHOT, DISK, FAR),
        ("stored", 5, KV, DISK),
    ]
    assert store.used == [0, 10, 40]
    check(index, queue, store)


def test_promote_takes_the_nearest_lower_copy() -> None:
    """Three tiers; chunk 1's KV on tiers 1 and 2 (adopted). Promoting it to tier 0 moves
    the tier-1 copy (the lowest set bit): ``moved`` 1 → 0, mask 0b101; bytes [10, 0, 10]."""
    index, queue, store, log = make(100, 100, 100)
    (n1,) = index.insert_chain([1])
    assert store.recover(n1, KV, DISK, KVB, 0.0)
    assert store.recover(n1, KV, FAR, KVB, 0.0)
    assert store.promote(n1, KV, CPU, 1.0)
    assert log.take() == [("moved", 1, KV, DISK, CPU)]
    assert n1.kv_tiers == 0b101
    assert store.used == [10, 0, 10]
    check(index, queue, store)


def test_an_intermediate_snapshot_dropped_alone_is_counted_and_sampled() -> None:
    """Chain 1 ─ 2 ─ 3, KV stored on the CPU at t = 0, snapshots at 1 and 2 on the disk
    (the default rules) at t = 4: each has KV below (intermediate). Dropping S1 at t = 10
    drops one unit, samples a snapshot residence of 10 − 4 = 6 s (seeds the EMA), reports
    the snapshot only and frees its 20 B of disk; the KV stays. Dropping S2 at t = 20
    makes two units and two samples."""
    index, queue, store, log = make(1000, 1000)
    n = index.insert_chain([1, 2, 3])
    for node in n:
        assert store.store_kv(node, KVB, 0.0)
    for node in n[:2]:
        assert store.store_snapshot(node, SNAPB, 4.0, final=False)
    assert store.used == [30, 40]
    log.take()
    store.drop(n[0], 10.0)
    assert log.take() == [("dropped", 1, SNAPSHOT, 1 << DISK)]
    assert store.dropped_units == 1
    assert (store.residence.snapshot_ema, store.residence.snapshot_samples) == (6.0, 1)
    assert store.used == [30, 20] and [node.kv_tiers for node in n] == [1, 1, 1]
    check(index, queue, store)
    store.drop(n[1], 20.0)
    assert store.dropped_units == 2 and store.residence.snapshot_samples == 2
    assert store.used == [30, 0]
    check(index, queue, store)
