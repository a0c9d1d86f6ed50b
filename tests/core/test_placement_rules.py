"""The paper's placement rules, observed through the cache's public API.

Where each object lands is read from the core's placement events
(``support.listeners.EventLog``; tier 0 = CPU, tier 1 = disk) and from ``lookup``;
nothing reaches into the cache's parts. Chunks of 10 tokens, 1 B per token: a KV chunk
is 10 B, a snapshot 20 B. ``τ = 0`` (LRU over units) wherever the test is about
placement rather than ranking, so every ``H`` is the unit's last access ``t``.
"""

from __future__ import annotations

from support.listeners import EventLog

from lmcache_histate.core.cache import CacheConfig, HiStateCache
from lmcache_histate.core.tiers import PlacementRules, TierSpec

CHUNK = 10
KV = 10
SNAP = 20
CPU, DISK = 0, 1


def cache(cpu: int, disk: int, tau: float = 0.0) -> tuple[HiStateCache, EventLog]:
    cfg = CacheConfig(
        chunk_tokens=CHUNK, kv_chunk_bytes=KV, snapshot_bytes=SNAP,
        tiers=(TierSpec("cpu", cpu), TierSpec("disk", disk)),
        rules=PlacementRules(kv_tier=CPU, snapshot_tier=DISK, final_tier=CPU), tau=tau,
    )
    c = HiStateCache(cfg)
    return c, EventLog(c.take_events)


def request(c: HiStateCache, sid: str, keys: list[int], now: float, snaps: list[int]) -> None:
    c.complete(c.begin(sid, keys, now), CHUNK * len(keys), now, boundaries=snaps)


def a_read_then_c_stored(c: HiStateCache, ev: EventLog) -> list[tuple]:
    """Sessions of 2 chunks and a final snapshot each: A at t = 0, B at t = 10, A read
    again at t = 20 (nothing new), C at t = 30. Returns the events of C's request."""
    request(c, "A", [1, 2], 0.0, [20])
    request(c, "B", [11, 12], 10.0, [20])
    request(c, "A", [1, 2], 20.0, [])
    ev.take()
    request(c, "C", [21, 22], 30.0, [20])
    return ev.take()


def test_intermediate_snapshots_go_to_disk_final_ones_and_kv_to_cpu() -> None:
    c, ev = cache(cpu=1000, disk=1000)
    # 4 chunks, snapshots at 20 tokens (intermediate, chunk 2) and 40 (final, chunk 4).
    request(c, "A", [1, 2, 3, 4], 0.0, [20, 40])
    stored = sorted(e for e in ev.take() if e[0] == "stored")
    assert stored == sorted([
        ("stored", 1, "kv", CPU), ("stored", 2, "kv", CPU),
        ("stored", 3, "kv", CPU), ("stored", 4, "kv", CPU),
        ("stored", 2, "snapshot", DISK),  # intermediate → the snapshot tier
        ("stored", 4, "snapshot", CPU),   # final → the final tier
    ])
    assert c.lookup([1, 2, 3]).hit_chunks == 2
    c.check()


def test_new_kv_demotes_colder_kv_instead_of_going_to_disk() -> None:
    """CPU holds 40 B: A's 2 KV chunks (20 B) and its final snapshot (20 B) fill it.

    B's first KV chunk needs 10 B on CPU: the coldest CPU unit, A's bundle (t = 0), is
    demoted whole to disk (KV of chunks 2 and 1, then the snapshot), and B's KV and
    final snapshot are stored on CPU. New KV never lands on disk directly.
    """
    c, ev = cache(cpu=40, disk=1000)
    request(c, "A", [1, 2], 0.0, [20])
    ev.take()
    request(c, "B", [11, 12], 10.0, [20])
    assert ev.take() == [
        ("moved", 2, "kv", DISK),
        ("moved", 1, "kv", DISK),
        ("moved", 2, "snapshot", DISK),
        ("stored", 11, "kv", CPU),
        ("stored", 12, "kv", CPU),
        ("stored", 12, "snapshot", CPU),
    ]
    assert c.lookup([1, 2]).hit_chunks == 2  # demoted, not lost
    c.check()


def test_demotion_never_evicts_a_better_unit_from_the_lower_tier() -> None:
    """CPU and disk hold one session each (40 B). τ = 0: H = t.

    t = 0: A stored (CPU). t = 10: B stored, A demoted to disk. t = 20: A is read: its
    units get t = 20. t = 30: C needs CPU room: the CPU victim is B (t = 10); demoting it
    would need A's room on disk, but A's H (20) is above B's (10), so B is dropped
    instead and A stays.
    """
    c, ev = cache(cpu=40, disk=40)
    log = a_read_then_c_stored(c, ev)
    assert not [e for e in log if e[0] == "moved"]
    assert ("dropped", 12, "snapshot", 1 << CPU) in log
    assert [c.lookup(k).hit_chunks for k in ([1, 2], [11, 12], [21, 22])] == [2, 0, 2]
    c.check()


def test_a_retired_final_snapshot_never_evicts_a_better_disk_unit() -> None:
    """Disk holds one snapshot (20 B). τ = 0: H = t.

    t = 0: A's final at chunk 2 (CPU). t = 5: B stores 4 chunks with an intermediate
    snapshot at chunk 2 (disk, now full) and its final at chunk 4 (CPU). t = 10: A
    rewrites from chunk 1 on (chain 1, 5, 6): nothing hits (chunk 1 has no snapshot), so
    A's old final keeps t = 0. It is no longer final and retires to disk, where B's
    snapshot has H = 5 > 0: A's old final is dropped, B's stays.
    """
    c, ev = cache(cpu=1000, disk=20)
    request(c, "A", [1, 2], 0.0, [20])
    request(c, "B", [11, 12, 13, 14], 5.0, [20, 40])
    ev.take()
    request(c, "A", [1, 5, 6], 10.0, [30])
    log = ev.take()
    assert ("dropped", 2, "snapshot", 1 << CPU) in log
    assert not [e for e in log if e[0] == "moved" or e[1] == 12]
    assert c.lookup([11, 12]).hit_chunks == 2  # B's intermediate snapshot kept
    assert c.lookup([1, 2]).hit_chunks == 0  # A's old final gone, its KV stays
    assert c.lookup([1, 2]).kv_chunks == 2
    c.check()


def test_residence_times_reach_the_snapshot_plan() -> None:
    """One 40 B tier, N_s = 20 B / 1 B per token = 20 tokens; supported 10, 20, …, 640.

    t = 0: A stores 2 KV chunks, no snapshot. t = 10: A again, now with its final
    snapshot at 20 tokens (KV since 0, snapshot since 10). t = 30: B needs 10 B: A's
    bundle is the only unit and is dropped: snapshot residence 30 − 10 = 20 (seeds the
    EMA), KV residence 30 − 0 = 30 twice → F = 30 / 20 = 1.5.

    Plan for a 1,200-token segment, cost I/2 + F·20·1,200/I:
      F = 1.5 (I* = √72,000 = 268.3): 260 → 130 + 36,000/260 = 268.46; 270 → 135 +
      133.33 = 268.33 → 270: 270, 540, 810, 1,080, then the final 1,200.
      Before the drop no snapshot has left: F = 0, cost I/2 alone → every chunk.
    """
    cfg = CacheConfig(
        chunk_tokens=CHUNK, kv_chunk_bytes=KV, snapshot_bytes=SNAP,
        tiers=(TierSpec("all", 40),),
        rules=PlacementRules(kv_tier=0, snapshot_tier=0, final_tier=0), tau=0.0,
    )
    c = HiStateCache(cfg)
    events = EventLog(c.take_events)
    assert c.snapshot_plan(0, 1200) == list(range(10, 1201, 10))  # F = 0
    request(c, "A", [1, 2], 0.0, [])
    request(c, "A", [1, 2], 10.0, [20])
    request(c, "B", [11], 30.0, [10])
    assert ("dropped", 2, "snapshot", 1) in events.events
    assert c.snapshot_plan(0, 1200) == [270, 540, 810, 1080, 1200]


def test_p_end_follows_where_a_session_comes_back() -> None:
    """Prior 0.9, α = 0.05. A's first request samples nothing (no previous end); its
    continuation from the end samples an end access: 0.9 + 0.05·0.1 = 0.905; a request
    that reads only A's first chunk is internal: 0.905 − 0.05·0.905 = 0.85975."""
    c, _ = cache(cpu=1000, disk=1000)
    request(c, "A", [1, 2], 0.0, [20])
    assert c.stats().end_probability == 0.9
    request(c, "A", [1, 2, 3], 1.0, [30])
    assert abs(c.stats().end_probability - 0.905) < 1e-12
    request(c, "A", [1, 7], 2.0, [20])
    assert abs(c.stats().end_probability - 0.85975) < 1e-12
