"""The paper's Figure 7 case, driven through the public cache API.

Session B has S1 after a long prefix, S2 shortly after S1 and its final S3; session C
has only its final S6. B is accessed last. Exactly one snapshot must go:
LRU evicts S1, LRU + refresh-all evicts S6, HiState evicts S2.
"""

from __future__ import annotations

import pytest

from lmcache_histate.core.cache import CacheConfig, HiStateCache
from lmcache_histate.core.placement import PlacementRules, TierSpec

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
        assert cache.index.get(key).has_snapshot
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
    found = cache.queue.victim(1)
    assert found is not None
    by_key = {v: k for k, v in names.items()}
    assert by_key[found[0].key] == victim, policy


def test_figure7_eviction_through_a_store() -> None:
    """Storing a fifth snapshot really drops S2 under HiState and keeps the rest."""
    cache, names = build(600.0, True)
    d = chain(3, 10)
    handle = cache.begin("D", d, 6.0)
    cache.complete(handle, 500, 6.0, boundaries=[500])
    cache.check()
    gone = [n for n, key in names.items() if not cache.index.get(key).has_snapshot]
    assert gone == ["S2"]
    # B's hit positions past S2 now fall back to S1, and the end still hits S3.
    assert cache.lookup(chain(1, 24)).hit_chunks == 24
    assert cache.lookup(chain(1, 22)).hit_chunks == 20
