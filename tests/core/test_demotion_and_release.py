"""Where units leave the cache, and from when their recency counts.

* ``placement`` NOTE 1: a demotion into a tier that is not the last always lands (that
  tier demotes further); the last tier compares the arriving unit's ``H`` with its
  residents' ``H`` (``EvictionQueue.arrival_rank``), never a fast tier's ``t``.
* ``cache`` NOTE 1: a hit counts as read when the request completes (the engine
  held it until then), not only when it began.
* ``placement`` NOTE 3: a final snapshot retired while a read pinned it moves when that
  read ends, unless it ends a session again by then.

Chunks of 10 tokens, 1 B per token: a KV chunk is 10 B, a snapshot 20 B, unless a test
says otherwise. Every expected value is derived in the test's docstring.
"""

from __future__ import annotations

import pytest
from support.listeners import EventLog
from test_placement_rules import CHUNK, a_read_then_c_stored, request

from lmcache_histate.core.cache import CacheConfig, HiStateCache
from lmcache_histate.core.tiers import KV, SNAPSHOT, PlacementRules, TierSpec

KV_B, SNAP_B = 10, 20


def three_tiers(fast: int, mid: int, last: int) -> tuple[HiStateCache, EventLog]:
    cfg = CacheConfig(
        chunk_tokens=CHUNK, kv_chunk_bytes=KV_B, snapshot_bytes=SNAP_B,
        tiers=(TierSpec("gpu", fast), TierSpec("cpu", mid), TierSpec("disk", last)),
        rules=PlacementRules(kv_tier=0, snapshot_tier=2, final_tier=0), tau=0.0,
    )
    c = HiStateCache(cfg)
    return c, EventLog(c.take_events)


def test_a_demotion_into_a_middle_tier_lands_and_pushes_the_middle_tier_down() -> None:
    """Tiers 40 / 40 / 1000 B, τ = 0 (H = t). Each session: 2 KV chunks + its final
    snapshot = 40 B, one bundle.

    t = 0: A on the GPU. t = 10: B stored: A (t = 0) demoted to the CPU tier. t = 20: A
    read: t = 20 (it stays on the CPU: the core does not promote by itself). t = 30: C
    needs GPU room: B (t = 10) is demoted into the CPU tier, which holds only A (t = 20,
    newer than B). The CPU tier is not the last, so it makes room by its own ranking: A
    moves on to disk and B lands. Nothing leaves the cache (the old rule, "evict below
    only units ranked under the demoted one", dropped B here)."""
    c, ev = three_tiers(40, 40, 1000)
    log = a_read_then_c_stored(c, ev)
    assert not [e for e in log if e[0] == "dropped"]
    assert c.tiers_of(2, SNAPSHOT) == 1 << 2 and c.tiers_of(1, KV) == 1 << 2  # A on disk
    assert c.tiers_of(12, SNAPSHOT) == 1 << 1 and c.tiers_of(11, KV) == 1 << 1  # B on CPU
    assert c.tiers_of(22, SNAPSHOT) == 1 << 0  # C on the GPU
    assert [c.lookup(k).hit_chunks for k in ([1, 2], [11, 12], [21, 22])] == [2, 2, 2]
    c.check()


def test_the_last_tier_compares_the_arriving_units_h_with_its_residents_h() -> None:
    """Chunks of 4 tokens, 10 B of KV per chunk (2 B per token: C in bytes = tokens ×
    2, as in ``test_cache_facade``), 25 B per snapshot; τ fixed at 10 s; CPU 1000 B,
    disk 45 B. Session "a" = chunks 101..104 at t = 1, snapshots at token 8
    (intermediate, on disk) and 16 (final, CPU). From ``test_cache_facade``: S102 on disk
    has C = 15.2, M = 25: H = 1 + 10·ln(15.2/25) = 1 − 4.976 = −3.976. The CPU's victim
    is the bundle 103-104 + final (45 B); arriving on disk it would free M = 2·10 + 25 =
    45 B for C = 14.4: H = 1 + 10·ln(14.4/45) = 1 − 11.394 = −10.394 < −3.976. The disk
    (20 B free) keeps S102 and the bundle is the one that leaves the cache. (Compared by
    its CPU rank t = 1, as before, it pushed S102 out.)"""
    c = HiStateCache(CacheConfig(
        chunk_tokens=4, kv_chunk_bytes=10, snapshot_bytes=25,
        tiers=(TierSpec("cpu", 1000), TierSpec("disk", 45)),
        supported_intervals=(4, 8), tau=10.0,
    ))
    c.complete(c.attach("a", [101, 102, 103, 104]), 16, 1.0, boundaries=[8, 16])
    assert c.eviction_inputs(102, SNAPSHOT, 1) == pytest.approx((1.0, 15.2, 25.0))
    assert c.evict(0, 1, 2.0) == 45  # the bundle left the CPU tier ...
    assert c.tiers_of(104, SNAPSHOT) == 0 and 103 not in c  # ... and the cache
    assert c.tiers_of(102, SNAPSHOT) == 1 << 1  # S102 kept on disk
    assert c.lookup([101, 102, 103, 104]).hit_chunks == 2  # resumes from S102
    c.check()


def test_a_hit_prefix_counts_as_read_when_its_request_completes() -> None:
    """One 120 B tier, τ = 0 (H = t), refresh-all.

    t = 0: A = chunks 1, 2 with snapshots after 1 (intermediate) and 2 (final): 60 B.
    t = 10: A begins [1, 2, 3]: hits 2 chunks (nodes 1, 2 refreshed to t = 10, pinned).
    t = 20: B = chunk 11 + its final: 30 B (90 B used). t = 100: A completes: chunk 3
    and its final (30 B): 120 B, full; nodes 1, 2 are refreshed to t = 100 on release.
    t = 110: C = chunk 21 + final needs 10 B, then 20 B. Units by t: B's bundle (20),
    then A's (100). B goes (30 B) and C fits: A still resumes from S1 and S2.
    Refreshed at begin only, S2 and S1 (t = 10, deepest first) would have gone instead,
    20 B each, and B stayed."""
    c = HiStateCache(CacheConfig(
        chunk_tokens=CHUNK, kv_chunk_bytes=KV_B, snapshot_bytes=SNAP_B,
        tiers=(TierSpec("all", 120),), rules=PlacementRules(0, 0, 0), tau=0.0,
    ))
    request(c, "A", [1, 2], 0.0, [10, 20])
    handle = c.begin("A", [1, 2, 3], 10.0)
    assert handle.match.hit_chunks == 2
    request(c, "B", [11], 20.0, [10])
    c.complete(handle, 30, 100.0, boundaries=[30])
    assert c.stats().used_bytes[0] == 120
    request(c, "C", [21], 110.0, [10])
    assert c.lookup([1]).hit_chunks == 1  # S1 kept
    assert c.lookup([1, 2]).hit_chunks == 2  # S2 kept
    assert c.lookup([11]).hit_chunks == 0 and 11 not in c  # B's bundle left
    assert c.lookup([21]).hit_chunks == 1
    c.check()


def test_a_retired_final_snapshot_lands_in_a_snapshot_tier_that_is_not_the_last() -> None:
    """Tiers 1000 / 20 / 1000 B; KV and final snapshots on tier 0, intermediate and
    retired ones on tier 1 (not the last); τ = 0 (H = t).

    t = 0: A = chunks 1, 2, final after 2 (tier 0). t = 10: B = chunks 11, 12, 13 with an
    intermediate snapshot after 12 (tier 1, now full) and its final after 13. t = 20: A
    rewrites from chunk 1 on (chain 1, 5, 6; chunk 1 has no snapshot, so nothing hits
    and S2 keeps t = 0): its old final S2 retires to tier 1, which holds B's S12 (t = 10,
    newer). Tier 1 is not the last, so it makes room by its own ranking: S12 moves on to
    tier 2 and S2 lands on tier 1 (refused by rank, it would have been forgotten).
    Nothing leaves the cache."""
    c = HiStateCache(CacheConfig(
        chunk_tokens=CHUNK, kv_chunk_bytes=KV_B, snapshot_bytes=SNAP_B,
        tiers=(TierSpec("gpu", 1000), TierSpec("cpu", 20), TierSpec("disk", 1000)),
        rules=PlacementRules(kv_tier=0, snapshot_tier=1, final_tier=0), tau=0.0,
    ))
    events = EventLog(c.take_events)
    request(c, "A", [1, 2], 0.0, [20])
    request(c, "B", [11, 12, 13], 10.0, [20, 30])
    assert c.tiers_of(12, SNAPSHOT) == 1 << 1
    events.take()
    request(c, "A", [1, 5, 6], 20.0, [30])
    assert not [e for e in events.take() if e[0] == "dropped"]
    assert c.tiers_of(2, SNAPSHOT) == 1 << 1  # A's retired final
    assert c.tiers_of(12, SNAPSHOT) == 1 << 2  # B's intermediate, moved on
    assert c.lookup([1, 2]).hit_chunks == 2 and c.lookup([11, 12]).hit_chunks == 2
    c.check()


@pytest.mark.parametrize("recency_tiers", [-1, 2])
def test_recency_tiers_outside_the_tiers_is_refused_with_the_allowed_range(
    recency_tiers: int,
) -> None:
    """Two tiers: 0 or 1 leading tiers may rank by recency (the last always ranks by H)."""
    tiers = (TierSpec("cpu", 100), TierSpec("disk", 100))
    with pytest.raises(ValueError, match=r"recency_tiers must be in \[0, 1\]"):
        CacheConfig(chunk_tokens=CHUNK, kv_chunk_bytes=KV_B, snapshot_bytes=SNAP_B,
                    tiers=tiers, recency_tiers=recency_tiers)
    ok = CacheConfig(chunk_tokens=CHUNK, kv_chunk_bytes=KV_B, snapshot_bytes=SNAP_B,
                     tiers=tiers, recency_tiers=1)
    assert ok.recency_tiers == 1


@pytest.mark.parametrize("refresh_all", [True, False])
def test_a_handle_that_pinned_nothing_refreshes_nothing_when_it_completes(
    refresh_all: bool,
) -> None:
    """``attach`` (a store no lookup announced, as the live server sees) pins nothing, so
    its ``complete`` refreshes nothing, with or without refresh-all. Two tiers of 1000 B.
    t = 0: A = chunks 1, 2, final after 2. t = 50: an attached store of chunks 1, 2, 3
    (it matches 2 chunks) completes with its final after 3: S2 retires to disk with its
    t = 0; completed through ``begin`` (which pinned the path) it would be read at 50."""
    def cache() -> HiStateCache:
        c = HiStateCache(CacheConfig(
            chunk_tokens=CHUNK, kv_chunk_bytes=KV_B, snapshot_bytes=SNAP_B,
            tiers=(TierSpec("cpu", 1000), TierSpec("disk", 1000)), tau=0.0,
            refresh_all=refresh_all,
        ))
        request(c, "A", [1, 2], 0.0, [20])
        return c

    attached = cache()
    handle = attached.attach("A", [1, 2, 3])
    assert handle.match.hit_chunks == 2 and not handle.pinned
    attached.complete(handle, 30, 50.0, boundaries=[30])
    inputs = attached.eviction_inputs(2, SNAPSHOT, 1)
    assert inputs is not None and inputs[0] == 0.0
    attached.check()
    begun = cache()
    begun.complete(begun.begin("A", [1, 2, 3], 10.0), 30, 50.0, boundaries=[30])
    inputs = begun.eviction_inputs(2, SNAPSHOT, 1)
    assert inputs is not None and inputs[0] == 50.0


@pytest.mark.parametrize("ends_again", [False, True])
def test_a_final_retired_under_a_read_moves_when_the_read_ends(ends_again: bool) -> None:
    """Two tiers of 1000 B. Session A: chunks 1, 2 with its final snapshot after 2 (on
    the CPU). A read of A's prefix (``begin`` at t = 2) is in flight when A's next turn
    (chunks 1-3, final after 3) lands at t = 5: S2 stops being final but stays on the CPU
    (no move under a read, no event for it). When the read ends it moves to disk, its
    home as an intermediate snapshot: one ``moved`` event, 20 B from tier 0 to 1. If
    session B ended at chunk 2 meanwhile (a store of chunks 1, 2 at t = 6), S2 is a final
    snapshot again and stays: no event."""
    c = HiStateCache(CacheConfig(
        chunk_tokens=CHUNK, kv_chunk_bytes=KV_B, snapshot_bytes=SNAP_B,
        tiers=(TierSpec("cpu", 1000), TierSpec("disk", 1000)),
    ))
    request(c, "A", [1, 2], 0.0, [20])
    read = c.begin("R", [1, 2], 2.0)
    c.complete(c.attach("A", [1, 2, 3]), 30, 5.0, boundaries=[30])
    assert c.tiers_of(2, SNAPSHOT) == 1 << 0
    if ends_again:
        c.complete(c.attach("B", [1, 2]), 20, 6.0, boundaries=[20])
    c.take_events()
    c.release(read)
    if ends_again:
        assert c.take_events() == [] and c.tiers_of(2, SNAPSHOT) == 1 << 0
    else:
        assert c.take_events() == [("moved", 2, SNAPSHOT, 0, 1, SNAP_B)]
        assert c.tiers_of(2, SNAPSHOT) == 1 << 1
    c.check()
