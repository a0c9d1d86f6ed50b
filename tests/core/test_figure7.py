"""The paper's Figure 7 case, driven through the public cache API.

Session B has S1 after a long prefix, S2 shortly after S1 and its final S3; session C
has only its final S6. B is accessed last. Exactly one snapshot must go:
LRU evicts S1, LRU + refresh-all evicts S6, HiState evicts S2.
"""

from __future__ import annotations

import pytest
from support.core_probe import next_victim

from lmcache_histate.core.cache import CacheConfig, HiStateCache
from lmcache_histate.core.tiers import PlacementRules, TierSpec

CHUNK = 50
TOKEN_BYTES = 100
SNAP = 1572 * TOKEN_BYTES


def chain(prefix: int, n: int) -> list[int]:
    return [prefix * 10_000 + i for i in range(n)]


def build(tau: float, refresh_all: bool) -> tuple[HiStateCache, dict[str, int]]:
    # All snapshots share tier 1 (room for exactly the four), KV lives on a roomy tier 0.
    cfg = CacheConfig(
        chunk_tokens=CHUNK,
        kv_chunk_bytes=CHUNK * TOKEN_BYTES,
        snapshot_bytes=SNAP,
        tiers=(TierSpec("cpu", 10**9), TierSpec("disk", 4 * SNAP)),
        rules=PlacementRules(kv_tier=0, snapshot_tier=1, final_tier=1),
        tau=tau,
        refresh_all=refresh_all,
    )
    cache = HiStateCache(cfg)
    b = chain(1, 24)  # session B: 1,200 tokens
    c = chain(2, 20)  # session C: 1,000 tokens
    steps = [  # (time, session, chain, input tokens): each request saves its final only
        (1.0, "B", b, 1000),  # S1 at 1,000
        (2.0, "B", b, 1050),  # S2 at 1,050 (S1 becomes intermediate)
        (3.0, "B", b, 1200),  # S3 at 1,200 (final)
        (4.0, "C", c, 1000),  # S6 at 1,000 (final of C)
    ]
    for now, sid, keys, tokens in steps:
        handle = cache.begin(sid, keys[: tokens // CHUNK], now)
        cache.complete(handle, tokens, now, boundaries=[tokens])
    # B is read again (a pure hit at S3, nothing new to store).
    cache.release(cache.begin("B", b, 5.0))
    names = {
        "S1": b[19],
        "S2": b[20],
        "S3": b[23],
        "S6": c[19],
    }
    for key in names.values():
        assert cache.node(key).has_snapshot  # type: ignore[union-attr]
    return cache, names


@pytest.mark.parametrize(
    ("policy", "tau", "refresh_all", "victim"),
    [
        ("LRU", 0.0, False, "S1"),
        ("LRU + refresh-all", 0.0, True, "S6"),
        ("HiState", 600.0, True, "S2"),
    ],
)
def test_figure7_victims(policy: str, tau: float, refresh_all: bool, victim: str) -> None:
    cache, names = build(tau, refresh_all)
    found = next_victim(cache, 1)
    assert found is not None
    by_key = {v: k for k, v in names.items()}
    assert by_key[found[0]] == victim, policy


def test_figure7_eviction_through_a_store() -> None:
    """Storing a fifth snapshot really drops S2 under HiState and keeps the rest."""
    cache, names = build(600.0, True)
    d = chain(3, 10)
    handle = cache.begin("D", d, 6.0)
    cache.complete(handle, 500, 6.0, boundaries=[500])
    cache.check()
    gone = [n for n, key in names.items() if not cache.node(key).has_snapshot]  # type: ignore[union-attr]
    assert gone == ["S2"]
    # B's hit positions past S2 now fall back to S1, and the end still hits S3.
    assert cache.lookup(chain(1, 24)).hit_chunks == 24
    assert cache.lookup(chain(1, 22)).hit_chunks == 20


def test_figure7_victim_flips_at_the_hand_computed_tau() -> None:
    """HiState's S2 vs refresh-all's S6: the victim flips where τ·ln(C6/C2) = 1 s.

    p_end: prior 0.9, three end accesses of B (t = 2, 3, 5) with α = 0.05:
    1 − 0.1·0.95³ = 1 − 0.0857375 = 0.9142625.
    C2: S2 at 1,050, previous snapshot S1 at 1,000 → δ = 50; its zone ends at S3
    (1,200), B's density 1/1,200 → internal mass (1,200 − 1,050)/1,200 = 0.125; one
    session (B) passes S2, whose end access resumes from S2 once S3's tail is gone
    (``rank`` NOTE 1): C2 = 50 · (0.0857375 · 0.125 + 0.9142625 · 1)
    = 50 · 0.9249796875 = 46.248984375.
    C6: S6 is C's final at 1,000, no snapshot before it → δ = 1,000, one session end;
    C6 = 1,000 · p_end = 914.2625.
    Both free one snapshot (M = 1,572 tokens) in the snapshot tier; after B's read at
    t = 5, H2 = 5 + τ·ln(C2/M) and H6 = 4 + τ·ln(C6/M), so H2 < H6 ⟺
    τ > 1 / ln(C6/C2) = 1 / ln(19.76827) = 1 / 2.98408 = 0.33511 s.
    (S1, S3 stay above S2: same t = 5, larger C: C1 = 1,000 · (0.0857375 · 50/1,200 +
    0.9142625) = 917.83, C3 = 150·p_end = 137.1.)
    """
    by_tau = {}
    for tau in (0.33, 0.34):
        cache, names = build(tau, True)
        found = next_victim(cache, 1)
        assert found is not None
        by_tau[tau] = {v: k for k, v in names.items()}[found[0]]
    assert by_tau == {0.33: "S6", 0.34: "S2"}


def test_refresh_is_lazy_and_victim_reranks_stale_entries() -> None:
    """B's read at t = 5 writes t = 5 into S1..S3 without re-ranking them (lazy).

    Queued ranks (τ = 0, so H = the t it was ranked with): the request at t = 3 stored S3
    and moved B's end off S2, which re-ranks S3, S2 and S2's parent S1 with t = 3; S6 was
    ranked at its store at t = 4; nothing was re-ranked at t = 5. The top is S1 at 3,
    stale; ``victim`` re-ranks S1, S2 and S3 to 5 and returns S6 (4), refresh-all's
    victim.
    """
    cache, names = build(0.0, True)
    heap = cache._queue.heaps[1]  # white box: the queued ranks are what this test pins
    node = {n: cache.node(k) for n, k in names.items()}
    assert [heap.priority(node[n]) for n in ("S1", "S2", "S3", "S6")] == [3.0, 3.0, 3.0, 4.0]
    found = next_victim(cache, 1)
    assert found is not None and found[0] == names["S6"]
    assert [heap.priority(node[n]) for n in ("S1", "S2", "S3", "S6")] == [5.0, 5.0, 5.0, 4.0]


def test_a_cold_prefix_leaves_a_fast_tier_from_its_tail() -> None:
    """LRU tiers break ties deepest first (eviction NOTE 3).

    One session of 6 chunks (4 tokens each) with a snapshot every 2 chunks, all stored
    at t = 1 on tier 0 (room for all of it) and never read again: its units are the
    snapshot units at chunks 2 and 4 (each carrying the 2 KV chunks above it when
    demoted) and the bundle at chunk 6, all with t = 1. Tier 0 is not the last, so it
    ranks by t alone: the tie goes to the deepest unit, the bundle (depth 5), then the
    snapshot unit at chunk 4 (depth 3), then chunk 2 (depth 1).
    """
    cfg = CacheConfig(
        chunk_tokens=4, kv_chunk_bytes=40, snapshot_bytes=80,
        tiers=(TierSpec("cpu", 10_000), TierSpec("disk", 10_000)),
        rules=PlacementRules(kv_tier=0, snapshot_tier=0, final_tier=0),
        fixed_interval=8, tau=5.0,
    )
    cache = HiStateCache(cfg)
    keys = [1, 2, 3, 4, 5, 6]
    cache.complete(cache.begin("A", keys, 1.0), 24, 1.0)
    order = []
    queue = cache._queue  # white box: each victim is taken off the heap, not evicted
    while (found := queue.victim(0)) is not None and len(order) < 3:
        order.append(found[0].key)
        queue.heaps[0].discard(found[0])
    assert order == [6, 4, 2]


def test_cost_priced_with_causal_attention() -> None:
    """``attention_tokens`` K: the recompute of [p_prev, p) costs δ·(1 + (p + p_prev)/2K).

    With K = 10,000 (p_end and the zone masses as in the τ-flip test above):
    S6: δ = 1,000 over [0, 1,000) → factor 1 + 1,000/20,000 = 1.05;
        C6 = 914.2625 · 1.05 = 959.975625.
    S2: δ = 50 over [1,000, 1,050) → factor 1 + 2,050/20,000 = 1.1025;
        C2 = 46.248984375 · 1.1025 = 50.989505.
    """
    cache, names = build(600.0, True)
    s6, s2 = cache.node(names["S6"]), cache.node(names["S2"])
    queue = cache._queue  # white box: the cost term itself, for a changed K
    assert queue.cost(s6) == pytest.approx(914.2625)  # type: ignore[arg-type]
    queue.attention_tokens = 10_000.0
    assert queue.cost(s6) == pytest.approx(959.975625)  # type: ignore[arg-type]
    assert queue.cost(s2) == pytest.approx(50.989505, abs=1e-6)  # type: ignore[arg-type]


def test_a_cold_session_leaves_the_last_tier_from_its_tail() -> None:
    """``rank`` NOTE 1: at the last tier a cold session peels from its tail, keeping a
    resume point, instead of losing its intermediates first and then its whole context.

    One tier (the last), 4-token chunks, 10 B per KV token (a chunk = 40 B), 80-B
    snapshots (N_s = 8 tokens), τ = 5 s, snapshots every 8 tokens. Session A (24 tokens,
    t = 1) holds 6 KV chunks (240 B) and snapshots at 8, 16 and 24 (240 B): 480 B, the
    tier's capacity. p_end is the prior 0.9 (no access has continued a session yet).
    Units and their C/M (tokens):
    * bundle at 24 (KV chunks 5–6 + the final): C = δ·p_end = 8·0.9 = 7.2,
      M = 80/10 + 8 = 16 → 0.45, H = 1 + 5·ln 0.45 = −2.99;
    * snapshot at 16: δ = 8, internal mass (24 − 16)·(1/24) = 1/3, one session passes:
      C = 8·(0.1/3 + 0.9) = 7.467, M = 8 → 0.933, H = 1 + 5·ln 0.933 = 0.66;
    * snapshot at 8: the same C and M (its zone ends at 16: (16 − 8)/24 = 1/3): H = 0.66.
    Session B (t = 2) stores one chunk and its final: 120 B. The bundle goes first and
    frees 160 B, enough: A keeps KV chunks 1–4 and the snapshots at 8 and 16, so A's
    next request resumes from 16 tokens. (Priced by internal hits alone, the snapshots'
    C/M would be 8·0.1/3/8 = 0.033: both would go first, then A's whole context.)
    """
    cfg = CacheConfig(
        chunk_tokens=4, kv_chunk_bytes=40, snapshot_bytes=80,
        tiers=(TierSpec("disk", 480),),
        rules=PlacementRules(kv_tier=0, snapshot_tier=0, final_tier=0),
        fixed_interval=8, tau=5.0,
    )
    cache = HiStateCache(cfg)
    a = [1, 2, 3, 4, 5, 6]
    cache.complete(cache.begin("A", a, 1.0), 24, 1.0)
    assert cache.stats().end_probability == pytest.approx(0.9)
    assert cache.stats().used_bytes[0] == 480
    cache.complete(cache.begin("B", [101], 2.0), 4, 2.0)
    cache.check()
    nodes = [cache.node(k) for k in a]
    assert [n is not None and n.has_kv for n in nodes] == [True] * 4 + [False] * 2
    assert [i + 1 for i, n in enumerate(nodes[:4]) if n.has_snapshot] == [2, 4]
    assert cache.lookup(a).hit_chunks == 4
