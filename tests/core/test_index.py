"""``PrefixIndex`` queries on a small tree (chunks of 10 tokens), values by hand."""

from __future__ import annotations

import pytest

from lmcache_histate.core.cache import CacheConfig, HiStateCache
from lmcache_histate.core.eviction import EvictionQueue
from lmcache_histate.core.index import ChainError, Node, PrefixIndex
from lmcache_histate.core.interval import ResidenceTracker
from lmcache_histate.core.rank import HitModel
from lmcache_histate.core.tiers import KV, TierSpec


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
    assert cache.recover([], KV, 0, 10, 3.0) is False  # an empty chain names no object


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
    cache.drop_session("a")
    assert cache.session_for([1, 2]) is None


def test_hit_density_follows_a_session_that_moves() -> None:
    # a ends at chunk 3 with 30 tokens: weight 1/30 on 1–3. Moved to chunk 2 with 20
    # tokens: 1/20 on 1–2, 0 on 3. Dropped: 0 everywhere.
    index = PrefixIndex(10)
    n1, n2, n3 = index.insert_chain([1, 2, 3])
    index.set_session("a", n3, 30)
    assert [n.weight for n in (n1, n2, n3)] == pytest.approx([1 / 30] * 3)
    index.set_session("a", n2, 20)
    assert [n.weight for n in (n1, n2, n3)] == pytest.approx([1 / 20, 1 / 20, 0.0])
    assert n3.ends is None and n2.ends == {index.sessions["a"]}
    index.drop_session("a")
    assert [n.weight for n in (n1, n2, n3)] == pytest.approx([0.0] * 3)
    assert n2.ends is None and "a" not in index.sessions


def test_bad_index_and_queue_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="chunk_tokens must be positive, got 0"):
        PrefixIndex(0)
    assert PrefixIndex(1).chunk_tokens == 1
    index = PrefixIndex(10)
    n1, n2 = index.insert_chain([1, 2])
    with pytest.raises(ValueError, match="end_tokens must be positive"):
        index.set_session("a", n1, 0)
    index.set_session("b", n1, 1)  # one token is a context
    with pytest.raises(ValueError, match="set_kv needs a non-empty tier mask"):
        index.set_kv(n1, 0, 10, 0.0)
    with pytest.raises(ChainError, match=r"KV of chunk 2 .* its parent chunk 1 is not"):
        index.set_kv(n2, 1, 10, 0.0)
    with pytest.raises(ChainError, match=r"snapshot at chunk 1 .* without its KV"):
        index.set_snapshot(n1, 1, 20, 0.0)
    index.set_kv(n1, 1, 10, 0.0)
    with pytest.raises(ValueError, match="set_snapshot needs a non-empty tier mask"):
        index.set_snapshot(n1, 0, 20, 0.0)
    index.set_kv(n2, 1, 10, 0.0)
    with pytest.raises(ChainError, match="chunk 1: cannot drop KV while descendants hold KV"):
        index.clear_kv(n1)
    index.set_snapshot(n2, 1, 20, 0.0)
    with pytest.raises(ChainError, match="chunk 2: drop the snapshot before the KV"):
        index.clear_kv(n2)
    with pytest.raises(ChainError, match=r"chunk hash 2 at position 0 .* must be chained"):
        index.insert_chain([2])
    with pytest.raises(ValueError, match="num_tiers must be positive"):
        EvictionQueue(index, 0, tau=1.0, token_bytes=1)
    with pytest.raises(ValueError, match="tau must be ≥ 0 or None"):
        EvictionQueue(index, 1, tau=-1.0, token_bytes=1)
    with pytest.raises(ValueError, match="token_bytes must be positive, got 0"):
        EvictionQueue(index, 1, tau=1.0, token_bytes=0)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\]"):
            HitModel(alpha=bad)
        with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\]"):
            ResidenceTracker(alpha=bad)
    with pytest.raises(ValueError, match=r"prior must be in \[0, 1\], got 1.5"):
        HitModel(prior=1.5)
    assert HitModel(alpha=1.0, prior=0.0).end_probability == 0.0
    assert HitModel(prior=1.0).end_probability == 1.0


def test_dropping_a_session_takes_its_own_density_only() -> None:
    """Sessions of 60 and 40 tokens end at chunk 2: weight 1/60 + 1/40 on 1 and 2, two
    passes. Dropping the 40-token one leaves 1/60 and one pass."""
    index = PrefixIndex(10)
    n1, n2 = index.insert_chain([1, 2])
    index.set_session("long", n2, 60)
    index.set_session("short", n2, 40)
    assert n1.weight == pytest.approx(1 / 60 + 1 / 40)
    index.drop_session("short")
    assert (n1.weight, n2.weight) == (pytest.approx(1 / 60), pytest.approx(1 / 60))
    assert (n1.passes, n2.passes) == (1, 1)
    index.check()


def test_check_accepts_chunks_held_by_children_or_a_session_end_only() -> None:
    """Chain 1 ─ 2 without KV: chunk 2 holds a session end only, chunk 1 a child only;
    neither is unpruned."""
    index = PrefixIndex(10)
    _, n2 = index.insert_chain([1, 2])
    index.set_session("a", n2, 20)
    index.check()


def _chain_with_kv() -> tuple[PrefixIndex, Node, Node]:
    """Chunks 1 ─ 2, 10 B of KV each on tier 0."""
    index = PrefixIndex(10)
    n1, n2 = index.insert_chain([1, 2])
    for node in (n1, n2):
        index.set_kv(node, 1, 10, 0.0)
    return index, n1, n2


def test_check_catches_a_broken_child_map_and_a_lost_session_end() -> None:
    """Both chunks hold KV, so only the broken part can fail the check."""
    index, n1, n2 = _chain_with_kv()
    session = index.set_session("a", n2, 20)
    assert n2.ends is not None
    n2.ends.discard(session)
    with pytest.raises(AssertionError, match=r"^$"):  # the session assertion has no message
        index.check()
    n2.ends.add(session)
    index.check()
    # Chunk 2 without KV (held by the session end): chunk 1 passes its own checks with no
    # children map, so the missing map is found at chunk 2.
    index.clear_kv(n2)
    index.check()
    n1.children = None
    with pytest.raises(AssertionError):
        index.check()


def test_cleared_kv_and_pruned_nodes_hold_nothing() -> None:
    index, n1, n2 = _chain_with_kv()
    index.clear_kv(n2)
    assert (n2.kv_tiers, n2.kv_bytes, n1.kv_children) == (0, 0, 0)
    assert type(n2.kv_tiers) is int and type(n2.kv_bytes) is int
    index.prune(n2)
    assert n2.parent is None and 2 not in index
    index.check()


def test_a_match_stops_at_the_first_chunk_without_kv() -> None:
    index, n1, n2 = _chain_with_kv()
    (n3,) = index.insert_chain([1, 2, 3])[2:]  # chunk 3 announced, its KV not stored
    match = index.match_path([n1, n2, n3])
    assert (match.kv_chunks, match.hit_chunks, match.hit_node) == (2, 0, None)


def test_moving_a_session_moves_only_its_own_density() -> None:
    """long (60 tokens) and short (40) end at 2; short moves to 3 (a sibling of 2):
    node 2 keeps 1/60, node 3 gets 1/40, their parent 1 carries both."""
    index = PrefixIndex(10)
    n1, n2 = index.insert_chain([1, 2])
    (n3,) = index.insert_chain([1, 3])[1:]
    index.set_session("long", n2, 60)
    index.set_session("short", n2, 40)
    index.set_session("short", n3, 40)
    assert n2.weight == pytest.approx(1 / 60)
    assert n3.weight == pytest.approx(1 / 40)
    assert n1.weight == pytest.approx(1 / 60 + 1 / 40)
    assert (n1.passes, n2.passes, n3.passes) == (2, 1, 1)


def test_empty_tier_masks_are_refused_by_name() -> None:
    index = PrefixIndex(10)
    (n1,) = index.insert_chain([1])
    message = r"^set_kv needs a non-empty tier mask; use clear_kv to remove$"
    with pytest.raises(ValueError, match=message):
        index.set_kv(n1, 0, 10, 0.0)
    index.set_kv(n1, 1, 10, 0.0)
    with pytest.raises(ValueError, match=r"^set_snapshot needs a non-empty tier mask$"):
        index.set_snapshot(n1, 0, 20, 0.0)
