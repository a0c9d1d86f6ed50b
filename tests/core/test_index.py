"""``PrefixIndex`` queries on a small tree (chunks of 10 tokens), values by hand."""

from __future__ import annotations

from lmcache_histate.core.cache import CacheConfig, HiStateCache
from lmcache_histate.core.index import PrefixIndex
from lmcache_histate.core.placement import KV, TierSpec


def test_paths_token_ends_and_membership() -> None:
    index = PrefixIndex(10)
    n1, n2, n3 = index.insert_chain([1, 2, 3])
    assert [n.key for n in n3.path()] == [3, 2, 1]  # deepest first, no root sentinel
    assert index.end_tokens(n3) == 30  # (depth 2 + 1) · 10
    assert (2 in index, 4 in index, len(index)) == (True, False, 3)
    assert index.get(4) is None and index.get(2) is n2
    assert index.walk([1, 2, 9, 3]) == [n1, n2]  # stops at the first unknown chunk


def test_session_for_finds_the_deepest_session_end_on_a_chain() -> None:
    cache = HiStateCache(CacheConfig(
        chunk_tokens=10, kv_chunk_bytes=10, snapshot_bytes=20,
        tiers=(TierSpec("cpu", 1000), TierSpec("disk", 1000)), tau=0.0,
    ))
    cache.complete(cache.begin("a", [1, 2], 0.0), 20, 0.0)
    cache.complete(cache.begin("b", [1, 2, 3, 4], 1.0), 40, 1.0)
    cache.complete(cache.begin("c", [1, 2, 3, 4], 2.0), 40, 2.0)
    # A chain through a's end (chunk 2) and, deeper, b's and c's (chunk 4): the deepest
    # end wins, ties by the smallest id.
    assert cache.session_for([1, 2, 3, 4, 5]) == "b"
    assert cache.session_for([1, 2, 7]) == "a"
    assert cache.session_for([1]) is None
    assert cache.session_for([9]) is None
    assert cache.adopt([], KV, 0, 10, 3.0) is False  # an empty chain names no object


def test_fixed_interval_plan_and_ending_a_session() -> None:
    """fixed_interval = 20 tokens, chunk 10: a segment [15, 75) starts on the grid at 10
    and ends at 70: states at 30, 50 and the final 70. A segment within one chunk
    ([10, 15) → [10, 10)) saves nothing."""
    cache = HiStateCache(CacheConfig(
        chunk_tokens=10, kv_chunk_bytes=10, snapshot_bytes=20,
        tiers=(TierSpec("cpu", 1000), TierSpec("disk", 1000)), tau=0.0, fixed_interval=20,
    ))
    assert cache.snapshot_plan(15, 75) == [30, 50, 70]
    assert cache.snapshot_plan(10, 15) == []
    cache.complete(cache.begin("a", [1, 2], 0.0), 20, 0.0)
    assert cache.session_for([1, 2]) == "a"
    cache.end_session("a")
    assert cache.session_for([1, 2]) is None
