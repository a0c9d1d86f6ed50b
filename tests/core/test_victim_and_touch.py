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
from lmcache_histate.core.rank import HitModel


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


def test_a_demoting_tier_skips_a_unit_whose_kv_segment_is_pinned() -> None:
    """Two tiers, everything on tier 0 (a demoting tier), τ = 0, accesses as in
    ``lru_tree``. Out of tier 0 S4's unit is its snapshot *and* its KV segment (4 and 3,
    down to S2), so pinning chunk 3 alone (a request reading the prefix 1–3) pins S4's
    unit there: ``victim(0)`` skips S4 (5, deeper) and returns S2 (5), whose segment
    (2, 1) is not pinned. Out of the last tier S4's snapshot would go alone and chunk 3's
    pin would not hold it (``pinned`` with ``tier=None``)."""
    index, n = tree()
    for key, t in ((2, 5.0), (4, 5.0), (6, 7.0), (8, 9.0)):
        n[key].access = t
    q = queue(index, 2, tau=0.0)
    n[3].pins += 1
    assert q.pinned(n[4], 0) and not q.pinned(n[4])
    assert q.victim(0) == (n[2], 5.0)
    n[3].pins -= 1
    assert q.victim(0) == (n[4], 5.0)


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


def test_refresh_all_is_the_default() -> None:
    index, n = tree()
    q = EvictionQueue(index, 1, tau=0.0, token_bytes=TOKEN_BYTES)
    q.touch([n[1], n[2], n[3], n[4]], 4, 200.0)
    assert [n[k].access for k in (1, 2, 3, 4)] == [200.0] * 4


def test_bytes_freed_count_every_copy_and_the_first_chunk() -> None:
    """Chain 1 ─ 2 with the bundle at 2 (session a ends there, 20 tokens); one tier per
    case, τ = 10, t = 100. Bundle: δ = 20, a ends at it, one session passes: C = 20·0.9
    = 18, C·4 = 72.

    One tier: M = snapshot 200 + KV of 2 and of 1 (the first chunk, depth 0) 80 = 280:
    H = 100 + 10·ln(72/280) = 100 + 10·(−1.358123) = 86.418771.
    Two tiers (tier 0 the engine's pool, ranked by t), KV and the snapshot on both
    (copies): each tier frees everything of the unit: tier 0 by t (100), tier 1: M = 280
    again → 86.418771.
    Two tiers, everything on the last (mask 0b10): nothing to free on tier 0 (None); the
    bundle drops whole from tier 1: 86.418771.
    Two tiers, KV on the last, the snapshot on both: tier 0 frees the snapshot's copy
    alone (ranked by t: 100); tier 1 as before.
    """
    for tiers, mask, snap_mask in ((1, 0b1, 0b1), (2, 0b11, 0b11), (2, 0b10, 0b10),
                                   (2, 0b10, 0b11)):
        index = PrefixIndex(CHUNK)
        n1, n2 = index.insert_chain([1, 2])
        for node in (n1, n2):
            index.set_kv(node, mask, KV, 0.0)
            node.access = 100.0
        index.set_snapshot(n2, snap_mask, SNAP, 0.0)
        index.set_session("a", n2, 20)
        q = EvictionQueue(index, tiers, tau=10.0, token_bytes=TOKEN_BYTES,
                          hit_model=HitModel(prior=0.9), recency_tiers=tiers - 1)
        assert q.rank(n2, tiers - 1) == pytest.approx(86.418771, abs=1e-5)
        if tiers == 2:
            assert q.rank(n2, 0) == (None if snap_mask == mask == 0b10 else 100.0)


def test_a_snapshot_leaving_the_last_tier_frees_only_itself() -> None:
    """KV and snapshots all on tier 1 of two (τ = 10): S4's unit drops alone from the last
    tier, M = 200, as on one tier: H = 97.078636 (``test_cost_and_rank``)."""
    index, n = tree(kv_tier=1, snap_tier=1)
    q = queue(index, 2, tau=10.0)
    assert q.rank(n[4], 1) == pytest.approx(97.078636, abs=1e-5)
    assert q.rank(n[4], 0) is None


def test_defaults_and_argument_checks() -> None:
    """Without a hit model the prior p_end = 0.9 prices S2 as in ``test_cost_and_rank``
    (97.078636 at τ = 10); without a fixed τ the calibrated one starts at 0 (no gap seen)."""
    index, n = tree()
    q = EvictionQueue(index, 1, tau=10.0, token_bytes=TOKEN_BYTES)
    assert q.rank(n[2], 0) == pytest.approx(97.078636, abs=1e-5)
    assert EvictionQueue(index, 1, tau=None, token_bytes=TOKEN_BYTES).tau == 0.0
    with pytest.raises(ValueError, match=r"^num_tiers must be positive$"):
        EvictionQueue(index, 0, tau=0.0, token_bytes=TOKEN_BYTES)


def test_a_cleared_snapshot_re_ranks_the_snapshot_two_levels_below() -> None:
    """S2 goes (one tier, τ = 10, t = 100): ``update_around(2)`` walks 3 (plain KV) down to
    S4, whose previous snapshot is now none: δ = 40 (was 20). Its zone is unchanged
    (``test_cost_and_rank``: internal 2/3, two sessions pass):
    C = 40·(0.1·2/3 + 0.9·2) = 74.666667, C·4/M = 298.666667/200 = 1.493333
    → H = 100 + 10·0.401011 = 104.010108."""
    index, n = tree()
    q = queue(index, 1, tau=10.0)
    index.clear_snapshot(n[2])
    q.update_around(n[2])
    assert q.heaps[0].priority(n[4]) == pytest.approx(104.010108, abs=1e-5)
    assert n[2] not in q.heaps[0]
    q.check(exact=True)


def test_the_walk_below_goes_on_past_a_branch_without_kv() -> None:
    """A request's chain 1–4, 9 is in the index before chunk 9's KV is stored (no KV, no
    unit). S4 goes: the bundle 6 below must be re-ranked although the walk meets 9 first
    (last inserted, popped first): δ = 60 − 20 = 40, C = 40·0.9·1 = 36, M = 200 + KV of 6
    and 5 (80) = 280: C·4/M = 144/280 = 0.514286 → H = 100 + 10·(−0.664976) = 93.350240."""
    index, n = tree()
    index.insert_chain([1, 2, 3, 4, 9])
    q = queue(index, 1, tau=10.0)
    index.clear_snapshot(n[4])
    q.update_around(n[4])
    assert q.heaps[0].priority(n[6]) == pytest.approx(93.350240, abs=1e-5)
    q.check(exact=True)
