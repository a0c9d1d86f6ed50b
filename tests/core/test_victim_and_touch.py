"""``EvictionQueue.victim``, ``touch`` and ``update_around`` at their edges.

The tree and the queue of ``test_cost_and_rank`` (one tier; chunks of 10 tokens, 4 B per
token, snapshots 200 B). With ``τ = 0`` every rank is the unit's ``t``, so the expected
order is read off the accesses set in each test. Units and depths: S2 (depth 1),
S4 (depth 3), the bundle 6 (depth 5), the dead tail 8 (depth 7); ties go deepest first
(``tie = −depth``).
"""

from __future__ import annotations

import pytest
from test_cost_and_rank import CHUNK, KV, SNAP, TOKEN_BYTES, queue, tree

from lmcache_histate.core.eviction import EvictionQueue
from lmcache_histate.core.index import Node, PrefixIndex
from lmcache_histate.core.units import HitModel


def lru_tree(refresh_all: bool = True) -> tuple[EvictionQueue, dict[int, Node]]:
    """τ = 0, one tier: S2 t = 5, S4 t = 5 (deeper: first of the two), bundle 6 t = 7,
    dead tail 8 t = 9."""
    index, n = tree()
    for key, t in ((2, 5.0), (4, 5.0), (6, 7.0), (8, 9.0)):
        n[key].access = t
    return queue(index, 1, tau=0.0, refresh_all=refresh_all), n


def test_a_pinned_top_is_skipped_and_put_back_as_it_was() -> None:
    q, n = lru_tree()
    heap = q.heaps[0]
    n[4].pins += 1
    found = q.victim(0)
    assert found == (n[2], 5.0)  # S4 (5, deeper) is pinned: the next unit, S2 (5)
    assert heap.priority(n[4]) == 5.0  # put back with its rank ...
    n[4].pins -= 1
    assert q.victim(0) == (n[4], 5.0)  # ... and its tie: deeper than S2 again
    q.check(exact=True)


def test_pinned_units_skipped_before_the_bound_stops_the_search_are_put_back() -> None:
    # S4 and S2 (5) pinned, the bundle (7) is not below 6: no victim, both still queued.
    q, n = lru_tree()
    n[2].pins += 1
    n[4].pins += 1
    assert q.victim(0, below=6.0) is None
    assert n[2] in q.heaps[0] and n[4] in q.heaps[0]
    assert q.heaps[0].priority(n[2]) == 5.0


def test_the_bound_is_strict() -> None:
    q, n = lru_tree()
    assert q.victim(0, below=5.0) is None  # S4's H = 5 is not below 5
    assert q.victim(0, below=5.5) == (n[4], 5.0)


def test_victim_re_ranks_a_top_refreshed_by_less_than_one() -> None:
    """Only the hit node is refreshed: S4 read at t = 5.8 (lazy: queued 5). ``victim``
    re-ranks it (5.8 > 5) and returns S2 (5)."""
    q, n = lru_tree(refresh_all=False)
    q.touch([n[k] for k in (1, 2, 3, 4)], 4, 5.8)
    assert q.heaps[0].priority(n[4]) == 5.0
    assert q.victim(0) == (n[2], 5.0)
    assert q.heaps[0].priority(n[4]) == 5.8


def test_a_rise_of_at_most_1e_9_counts_as_current() -> None:
    """S4's t becomes 5 + 1e-9 after it was queued at 5: within the tolerance, so S4 is
    returned with its queued rank 5 (re-ranking it would put it behind S2)."""
    q, n = lru_tree()
    n[4].access = 5.0 + 1e-9
    assert q.victim(0) == (n[4], 5.0)


def test_an_entry_that_frees_nothing_is_dropped_and_the_search_goes_on() -> None:
    # Chunk 3 anchors no unit (plain interior KV): a stale entry at 0 is discarded.
    q, n = lru_tree()
    q.heaps[0].set(n[3], 0.0, -n[3].depth)
    assert q.victim(0) == (n[4], 5.0)
    assert n[3] not in q.heaps[0]


@pytest.mark.parametrize("refresh_all", [True, False])
def test_a_one_chunk_hit_refreshes_that_chunk(refresh_all: bool) -> None:
    q, n = lru_tree(refresh_all)
    q.touch([n[1], n[2]], 1, 50.0)
    assert (n[1].access, n[2].access) == (50.0, 5.0)
    q.touch([n[1], n[2]], 0, 60.0)  # no hit: nothing refreshed
    assert n[1].access == 50.0


def test_a_snapshot_at_the_first_chunk_is_re_ranked_by_a_new_snapshot_two_below() -> None:
    """Chain 1 ─ 2 ─ 3 ─ 4 with KV, S1 at chunk 1 (depth 0, p = 10), session a ends at 4
    (40 tokens); one tier, τ = 10, t = 100, p_end = 0.9.

    Before: S1 (δ = 10) zone 2, 3, 4 where a ends: internal (40 − 10)/40 = 0.75, a
    passes: C = 10·(0.1·0.75 + 0.9) = 9.75; C·4/M = 39/200 = 0.195 → H = 100 +
    10·ln 0.195 = 100 − 16.347557 = 83.652443.
    A snapshot at 3 (p = 30): S1's zone ends there: (30 − 10)·1/40 = 0.5:
    C = 10·(0.05 + 0.9) = 9.5; 38/200 = 0.19 → H = 100 + 10·ln 0.19 = 83.392690.
    ``update_around(3)`` starts at its parent 2 and walks up to S1 at depth 0.
    """
    index = PrefixIndex(CHUNK)
    nodes = index.insert_chain([1, 2, 3, 4])
    for node in nodes:
        index.set_kv(node, 1, KV, 0.0)
        node.access = 100.0
    index.set_snapshot(nodes[0], 1, SNAP, 0.0)
    index.set_session("a", nodes[3], 40)
    q = EvictionQueue(index, 1, tau=10.0, token_bytes=TOKEN_BYTES, hit_model=HitModel(prior=0.9))
    for node in nodes:
        q.update(node)
    assert q.heaps[0].priority(nodes[0]) == pytest.approx(83.652443, abs=1e-5)
    index.set_snapshot(nodes[2], 1, SNAP, 100.0)
    q.update_around(nodes[2])
    assert q.heaps[0].priority(nodes[0]) == pytest.approx(83.392690, abs=1e-5)
    q.check(exact=True)
