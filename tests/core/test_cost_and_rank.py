"""``C`` and ``H`` on a small tree, every expected value worked out by hand.

The tree (chunks of 10 tokens; ``[S]`` = a snapshot at the chunk's end)::

    1 ─ 2[S] ─ 3 ─ 4[S] ─ 5 ─ 6[S]    session a ends at 6 (60 tokens)
                    └──── 7 ─ 8        session b ends at 8 (60 tokens), no snapshot

Hit densities (``weight`` = Σ 1/P_s over the sessions through a node): nodes 1–4 carry
both sessions (2/60), 5–6 only a (1/60), 7–8 only b (1/60). The units: snapshot units at
2 and 4 (they have KV below them), the bundle at 6 (KV leaf with a snapshot) and the dead
tail at 8 (KV leaf without one). The hit model's ``p_end`` is its prior, 0.9.

Bytes: 4 per token, so a KV chunk is 40 B; a snapshot is 200 B (50 token units).
"""

from __future__ import annotations

import math

import pytest

from lmcache_histate.core.eviction import EvictionQueue
from lmcache_histate.core.index import Node, PrefixIndex
from lmcache_histate.core.rank import HitModel, expected_recompute

CHUNK = 10
TOKEN_BYTES = 4
KV = CHUNK * TOKEN_BYTES
SNAP = 200
LN_1E9 = math.log(1e-9)  # −20.723266


def tree(kv_tier: int = 0, snap_tier: int = 0) -> tuple[PrefixIndex, dict[int, Node]]:
    index = PrefixIndex(CHUNK)
    a = index.insert_chain([1, 2, 3, 4, 5, 6])
    b = index.insert_chain([1, 2, 3, 4, 7, 8])
    nodes = {n.key: n for n in (*a, *b)}
    for key in (1, 2, 3, 4, 5, 6, 7, 8):
        index.set_kv(nodes[key], 1 << kv_tier, KV, 0.0)
    for key in (2, 4, 6):
        index.set_snapshot(nodes[key], 1 << snap_tier, SNAP, 0.0)
    index.set_session("a", nodes[6], 60)
    index.set_session("b", nodes[8], 60)
    for node in nodes.values():
        node.access = 100.0
    return index, nodes


def queue(index: PrefixIndex, tiers: int, tau: float, **kw: object) -> EvictionQueue:
    q = EvictionQueue(index, tiers, tau=tau, token_bytes=TOKEN_BYTES,
                      hit_model=HitModel(prior=0.9), **kw)  # type: ignore[arg-type]
    for node in index.nodes.values():
        q.update(node)
    return q


def test_expected_recompute_of_a_snapshot_a_bundle_and_a_dead_tail() -> None:
    """C = δ·((1 − p_end)·internal + p_end·passes) (``rank`` NOTE 1: every session passing
    a snapshot counts an end access, priced as the resume point it becomes)."""
    _, n = tree()
    # S2 (p = 20, nothing above: δ = 20). Its zone is 3, then boundary S4 at q = 40:
    # internal mass (40 − 20)·weight(4) = 20·2/60 = 2/3; sessions a and b pass 2: 2.
    # C = 20·(0.1·2/3 + 0.9·2) = 20·1.866667 = 37.333333.
    assert expected_recompute(n[2], CHUNK, 0.9) == pytest.approx(112 / 3)
    # S4 (p = 40, previous S2 at 20: δ = 20). Zone: 5 → boundary S6 at 60, mass
    # (60 − 40)·1/60 = 1/3; 7 → 8, where b ends: internal (60 − 40)/60 = 1/3; a and b
    # pass 4: 2. C = 20·(0.1·2/3 + 0.9·2) = 37.333333.
    assert expected_recompute(n[4], CHUNK, 0.9) == pytest.approx(112 / 3)
    # Bundle S6 (p = 60, previous S4 at 40: δ = 20): a ends here (no internal hit past
    # 60 in a 60-token context), one session passes 6. C = 20·0.9·1 = 18.
    assert expected_recompute(n[6], CHUNK, 0.9) == pytest.approx(18.0)
    # The dead tail holds no snapshot: nothing can hit in it, C = 0.
    assert expected_recompute(n[8], CHUNK, 0.9) == 0.0
    # p_end = 0.5 weighs end and internal hits equally: S4: 20·(0.5·2/3 + 0.5·2) = 26.666667.
    assert expected_recompute(n[4], CHUNK, 0.5) == pytest.approx(80 / 3)


def test_rank_on_the_last_tier_is_t_plus_tau_ln_cost_per_byte() -> None:
    index, n = tree()
    q = queue(index, 1, tau=10.0)
    # One tier, so every unit is priced by H = t + τ·ln(C·4 B / M), t = 100, τ = 10:
    # S2: M = 200 (dropped alone), C·4 = 149.333333 → ln 0.746667 = −0.292136 → 97.078636.
    # S4: the same C and M → 97.078636 (a tie: deepest first, NOTE 3 of eviction).
    # bundle 6: M = 200 + KV of 6 and 5 (80) = 280, C·4 = 72 → ln 0.257143 = −1.358123
    #   → 86.418771.
    # dead 8: M = KV of 8 and 7 = 80, C = 0 → floored: 100 + 10·(−20.723266) = −107.23266.
    assert q.rank(n[2], 0) == pytest.approx(97.078636, abs=1e-5)
    assert q.rank(n[4], 0) == pytest.approx(97.078636, abs=1e-5)
    assert q.rank(n[6], 0) == pytest.approx(86.418771, abs=1e-5)
    assert q.rank(n[8], 0) == pytest.approx(100.0 + 10.0 * LN_1E9, abs=1e-5)
    assert q.rank(n[3], 0) is None  # no unit is anchored at plain interior KV
    order = []
    while (found := q.victim(0)) is not None:
        order.append(found[0].key)
        q.heaps[0].discard(found[0])
    assert order == [8, 6, 4, 2]


def test_victim_flips_at_the_hand_computed_tau() -> None:
    """The older S2 (t = 90) against the bundle 6 (t = 100), on one tier.

    H2 = 90 + τ·(−0.292136), H6 = 100 + τ·(−1.358123): H6 < H2 ⟺ 10 < τ·1.065987
    ⟺ τ > 9.380977. Below it recency wins (S2 goes), above it cost does (the bundle,
    with the lower C/M, goes).
    """
    victims = {}
    for tau in (9.37, 9.39):
        index, n = tree()
        n[2].access = 90.0
        q = queue(index, 1, tau=tau)
        for key in (1, 3, 4, 7, 8):  # only S2 and the bundle compete
            q.remove(n[key])
        found = q.victim(0)
        assert found is not None
        victims[tau] = found[0].key
    assert victims == {9.37: 2, 9.39: 6}


def test_each_tier_has_its_own_ranking() -> None:
    """KV on tier 0, snapshots on tier 1 (the last). Tier 0 is the engine's own pool
    (``recency_tiers = 1``): it demotes, ranked by t alone; tier 1 drops, ranked by H.

    t: S2 90, S4 60, bundle 6 70, dead 8 80 (τ = 10, C as in the test above).
    Tier 0 (every unit moves its KV there): by t → 4 (60), 6 (70), 8 (80), 2 (90).
    Tier 1 frees snapshots only (M = 200 each; the dead tail frees nothing there):
    S2: 90 + 10·(−0.292136) = 87.078636; S4: 60 + 10·(−0.292136) = 57.078636;
    bundle 6: C·4/M = 72/200 = 0.36 → 70 + 10·(−1.021651) = 59.783488 → 4, 6, 2.
    """
    index, n = tree(kv_tier=0, snap_tier=1)
    for key, t in ((2, 90.0), (4, 60.0), (6, 70.0), (8, 80.0)):
        n[key].access = t
    q = queue(index, 2, tau=10.0, recency_tiers=1)
    assert n[8] in q.heaps[0] and n[8] not in q.heaps[1]
    assert q.rank(n[2], 0) == 90.0 and q.rank(n[6], 0) == 70.0
    assert q.rank(n[2], 1) == pytest.approx(87.078636, abs=1e-5)
    assert q.rank(n[4], 1) == pytest.approx(57.078636, abs=1e-5)
    assert q.rank(n[6], 1) == pytest.approx(59.783488, abs=1e-5)
    q.check(exact=True)
    orders = []
    for tier in (0, 1):
        order = []
        while (found := q.victim(tier)) is not None:
            order.append(found[0].key)
            q.heaps[tier].discard(found[0])
        orders.append(order)
    assert orders == [[4, 6, 8, 2], [4, 6, 2]]


def test_a_tier_that_is_not_the_engines_pool_ranks_by_h_even_when_it_demotes() -> None:
    """The tree of the test above with ``recency_tiers = 0`` (the live server: CPU and
    disk are both HiState's): tier 0 ranks by H as well, with M = the bytes each unit
    moves out of it (``rank`` NOTE 6).

    t: S2 90, S4 60, bundle 6 70, dead 8 80, τ = 10. On tier 0 every unit frees the two
    KV chunks of its segment, M = 80 B (the snapshots are on tier 1):
    S2: C·4 = 149.333333, ln(149.333333/80) = 0.624154 → 90 + 6.241539 = 96.241539;
    S4: the same ratio → 66.241539; bundle 6: ln(72/80) = −0.105361 → 68.946395;
    dead 8: C = 0, floored → 80 + 10·(−20.723266) = −127.232658.
    Order: 8, 4, 6, 2 (by t alone it was 4, 6, 8, 2: the dead tail now goes first).
    """
    index, n = tree(kv_tier=0, snap_tier=1)
    for key, t in ((2, 90.0), (4, 60.0), (6, 70.0), (8, 80.0)):
        n[key].access = t
    q = queue(index, 2, tau=10.0)
    assert q.rank(n[2], 0) == pytest.approx(96.241539, abs=1e-5)
    assert q.rank(n[4], 0) == pytest.approx(66.241539, abs=1e-5)
    assert q.rank(n[6], 0) == pytest.approx(68.946395, abs=1e-5)
    assert q.rank(n[8], 0) == pytest.approx(80.0 + 10.0 * LN_1E9, abs=1e-5)
    q.check(exact=True)
    order = []
    while (found := q.victim(0)) is not None:
        order.append(found[0].key)
        q.heaps[0].discard(found[0])
    assert order == [8, 4, 6, 2]
    with pytest.raises(ValueError, match="recency_tiers"):
        queue(index, 2, tau=10.0, recency_tiers=2)


@pytest.mark.parametrize(("refresh_all", "order"), [(True, [8, 6, 4, 2]), (False, [4, 8, 2, 6])])
def test_refresh_all_or_only_the_hit_unit(refresh_all: bool, order: list[int]) -> None:
    """A hit on session a's whole prefix at t = 200, on tier 0 (the engine's pool,
    ranked by t).

    Before: S2 90, S4 60, bundle 6 70, dead 8 80. Refresh-all writes 200 into 1–6:
    8 (80) goes first, then the tie at 200 deepest first: 6, 4, 2. Without it only the
    hit node 6 gets 200: 4 (60), 8 (80), 2 (90), 6 (200). The refresh is lazy: the
    queued ranks still say 60/70/90 until ``victim`` re-ranks the top.
    """
    index, n = tree(kv_tier=0, snap_tier=1)
    for key, t in ((2, 90.0), (4, 60.0), (6, 70.0), (8, 80.0)):
        n[key].access = t
    q = queue(index, 2, tau=10.0, refresh_all=refresh_all, recency_tiers=1)
    path = [n[k] for k in (1, 2, 3, 4, 5, 6)]
    q.touch(path, 6, 200.0)
    assert q.heaps[0].priority(n[6]) == 70.0  # not re-ranked by the access
    assert [n[k].access for k in (2, 4, 6)] == ([200.0] * 3 if refresh_all else [90.0, 60.0, 200.0])
    q.check()  # queued ranks are lower bounds of the fresh ones on tier 0
    got = []
    while (found := q.victim(0)) is not None:
        got.append(found[0].key)
        q.heaps[0].discard(found[0])
    assert got == order


def test_a_new_snapshot_re_ranks_the_snapshot_above_it() -> None:
    """Without S4 (snapshots at 2 and 6 only), a snapshot appears at 7 (50 tokens, on b's
    branch, below the plain branch point 4): S2's zone now ends there, and S2 is two
    levels above the new snapshot's parent, so only ``update_around``'s walk up finds it.

    S2 (one tier, τ = 10, t = 100, δ = 20, a and b pass: 2). Before: zone 3, 4, 5 →
    boundary S6 at 60: (60 − 20)·1/60 = 2/3; 7 → 8 where b ends: (60 − 20)/60 = 2/3;
    C = 20·(0.1·4/3 + 0.9·2) = 38.666667, C·4/M = 154.666667/200 = 0.773333
    → H = 100 + 10·(−0.257045) = 97.429549. After: the boundary at 7 gives
    (50 − 20)·weight(7) = 30/60 = 1/2 instead of 2/3: C = 20·(0.1·7/6 + 1.8) = 38.333333,
    C·4/M = 0.766667 → H = 100 + 10·(−0.265703) = 97.342968.
    S7: δ = 50 − 20 = 30, zone 8 where b ends: (60 − 50)/60 = 1/6, one session passes:
    C = 30·(0.1/6 + 0.9) = 27.5, C·4/M = 0.55 → H = 100 + 10·(−0.597837) = 94.021630.
    """
    index, n = tree()
    index.clear_snapshot(n[4])
    q = queue(index, 1, tau=10.0)
    assert q.heaps[0].priority(n[2]) == pytest.approx(97.429549, abs=1e-5)
    index.set_snapshot(n[7], 1, SNAP, 100.0)
    q.update_around(n[7])
    assert q.heaps[0].priority(n[2]) == pytest.approx(97.342968, abs=1e-5)
    assert q.heaps[0].priority(n[7]) == pytest.approx(94.021630, abs=1e-5)
    q.check(exact=True)


def test_check_catches_a_stale_rank() -> None:
    index, n = tree()
    q = queue(index, 1, tau=10.0)
    q.check(exact=True)
    q.heaps[0].set(n[4], 95.0, -n[4].depth)  # fresh rank is 97.078636
    with pytest.raises(AssertionError, match="rank"):
        q.check(exact=True)


def test_check_catches_a_rank_above_the_fresh_one_on_tiers_ranked_by_t() -> None:
    """Without ``exact``, ``check`` still rejects a queued rank *above* the fresh one where
    ranks are ``t`` alone: the engine's pool (``recency_tiers``), and every tier when
    ``τ = 0``."""
    # Two tiers, τ = 10: tier 0 (KV, the engine's pool) is ranked by t; S4's fresh rank
    # there is t = 100.
    index, n = tree(kv_tier=0, snap_tier=1)
    q = queue(index, 2, tau=10.0, recency_tiers=1)
    q.check()
    q.heaps[0].set(n[4], 101.0, -n[4].depth)
    with pytest.raises(AssertionError, match="above fresh"):
        q.check()
    # One tier, τ = 0: the last tier is ranked by t too (fresh 100).
    index, n = tree()
    q = queue(index, 1, tau=0.0)
    q.heaps[0].set(n[4], 101.0, -n[4].depth)
    with pytest.raises(AssertionError, match="above fresh"):
        q.check()
    # A queued rank *below* the fresh one is a lazy refresh, accepted (NOTE 1); the
    # refresh also voids the unit's stamp (NOTE 4), as here.
    q.heaps[0].set(n[4], 99.0, -n[4].depth)
    n[4].rank_stamp = None
    q.check()


def test_check_reads_every_tier_after_one_a_unit_is_not_on() -> None:
    """Everything on tier 1 of two: no unit is queued on tier 0, so ``check`` must go on
    to tier 1 to find S4's stale rank there (fresh 97.078636, as on one tier)."""
    index, n = tree(kv_tier=1, snap_tier=1)
    q = queue(index, 2, tau=10.0)
    assert len(q.heaps[0]) == 0
    q.check(exact=True)
    q.heaps[1].set(n[4], 95.0, -n[4].depth)
    with pytest.raises(AssertionError, match="stale rank"):
        q.check(exact=True)


def test_check_accepts_a_unit_freeing_a_single_byte() -> None:
    # One chunk of KV holding 1 B on the only tier: a dead tail freeing 1 B, queued.
    index = PrefixIndex(CHUNK)
    (node,) = index.insert_chain([1])
    index.set_kv(node, 1, 1, 0.0)
    q = queue(index, 1, tau=0.0)
    assert node in q.heaps[0]
    q.check(exact=True)


def test_check_tolerance_is_one_part_in_a_billion_at_least_1e_9() -> None:
    """tol = 1e-9 · max(1, |fresh|), the bound itself accepted.

    τ = 0, one chunk of KV accessed at t: fresh rank = t.
    t = 0: tol = 1e-9 · max(1, 0) = 1e-9; queued 1e-9 differs by exactly tol → accepted
    (``exact`` and not); 1.5e-9 → rejected.
    t = 1.5: tol = 1e-9 · max(1, 1.5) = 1.5e-9; queued 1.5 + 1.2e-9 → accepted, 1.5 + 2e-9
    → rejected (the floor of 1 is no more than the floor: 2 would accept it).
    t = 1000: tol = 1e-6; queued 1000 + 5e-7 → accepted (an absolute 1e-9 would reject it).
    """
    index = PrefixIndex(CHUNK)
    (node,) = index.insert_chain([1])
    index.set_kv(node, 1, KV, 0.0)
    node.access = 0.0
    q = queue(index, 1, tau=0.0)
    heap = q.heaps[0]
    heap.set(node, 1e-9, 0)
    q.check(exact=True)
    q.check()
    heap.set(node, 1.5e-9, 0)
    with pytest.raises(AssertionError, match="stale rank"):
        q.check(exact=True)
    with pytest.raises(AssertionError, match="above fresh"):
        q.check()
    node.access = 1.5
    heap.set(node, 1.5 + 1.2e-9, 0)
    q.check(exact=True)
    heap.set(node, 1.5 + 2e-9, 0)
    with pytest.raises(AssertionError, match="stale rank"):
        q.check(exact=True)
    node.access = 1000.0
    heap.set(node, 1000.0 + 5e-7, 0)
    q.check(exact=True)


def test_cost_uses_the_bytes_per_token() -> None:
    """The same tree with 8 B per token (KV chunk 80 B): C·8/M for S2 is
    298.666667/200 = 1.493333, ln = 0.401011 → H = 100 + 4.010108 = 104.010108,
    i.e. τ·ln 2 = 6.931472 above the 4 B/token rank (97.078636)."""
    index, n = tree()
    q = EvictionQueue(index, 1, tau=10.0, token_bytes=8, hit_model=HitModel(prior=0.9))
    assert q.rank(n[2], 0) == pytest.approx(104.010108, abs=1e-5)


def test_p_end_moves_with_end_and_internal_accesses() -> None:
    # prior 0.9, α = 0.05: end → 0.9 + 0.05·(1 − 0.9) = 0.905;
    # internal → 0.905 − 0.05·0.905 = 0.85975.
    model = HitModel(alpha=0.05, prior=0.9)
    model.observe(True)
    assert model.end_probability == pytest.approx(0.905)
    model.observe(False)
    assert model.end_probability == pytest.approx(0.85975)
    assert model.samples == 2


def test_previous_snapshot_at_the_first_chunk_and_two_ends_in_a_zone() -> None:
    """Chain 1 ─ 2 ─ 3 with snapshots at 1 (depth 0, 10 tokens) and 3 (30 tokens); two
    sessions end at 2 (20 tokens each). S3: δ = 30 − 10 = 20, its zone is empty (no
    end past 30): C = 0. S1 (δ = 10): zone 2 (ends of c and d: internal (20 − 10)/20 =
    0.5 each; c and d pass 1), boundary S3 at 30 with weight 0: C = 10·(0.1·1 + 0.9·2) = 19."""
    index = PrefixIndex(CHUNK)
    n1, n2, n3 = index.insert_chain([1, 2, 3])
    for node in (n1, n2, n3):
        index.set_kv(node, 1, KV, 0.0)
    index.set_snapshot(n1, 1, SNAP, 0.0)
    index.set_snapshot(n3, 1, SNAP, 0.0)
    index.set_session("c", n2, 20)
    index.set_session("d", n2, 20)
    assert expected_recompute(n3, CHUNK, 0.9) == 0.0
    assert expected_recompute(n1, CHUNK, 0.9) == pytest.approx(19.0)
    # S3 with a session ending beyond it (40 tokens at 3: internal (40 − 30)/40 = 0.25,
    # one end): C = 20·(0.1·0.25 + 0.9) = 18.5, δ from S1 at depth 0.
    index.set_session("e", n3, 40)
    assert expected_recompute(n3, CHUNK, 0.9) == pytest.approx(18.5)


def test_pinned_looks_at_what_would_leave_the_tier() -> None:
    """S4's unit demotes with its KV segment (4 and 3) from tier 0 but drops alone from
    the last tier: a pin on chunk 3 blocks the first, not the second."""
    index, n = tree(kv_tier=0, snap_tier=1)
    q = queue(index, 2, tau=10.0)
    n[3].pins += 1
    assert q.pinned(n[4], 0) is True
    assert q.pinned(n[4], 1) is False
    assert q.pinned(n[4]) is False
    n[4].pins += 1
    assert q.pinned(n[4], 1) is True


def test_victim_respects_the_bound() -> None:
    # One tier (τ = 10): the lowest H is the dead tail's, −107.23266.
    index, n = tree()
    q = queue(index, 1, tau=10.0)
    assert q.victim(0, below=-107.3) is None  # nothing below the bound
    found = q.victim(0, below=-107.2)
    assert found is not None and found[0] is n[8]


def test_a_snapshot_inside_a_segment_re_ranks_the_units_below_it() -> None:
    """A snapshot appears at 5, inside the bundle 6's KV segment (one tier, τ = 10, t = 100).

    Bundle 6: previous snapshot now S5 at 50 → δ = 10, C = 10·0.9 = 9; its segment is 6
    alone: M = 200 + 40 → H = 100 + 10·ln(36/240) = 100 − 18.971200 = 81.028800.
    S5: δ = 10, zone: boundary S6 at 60, (60 − 50)·1/60 = 1/6; a passes 5:
    C = 10·(0.1/6 + 0.9·1) = 9.166667, C·4/M = 36.666667/200 = 0.183333
    → H = 100 + 10·(−1.696449) = 83.035507.
    S4: zone 5 is now a boundary at 50: 10·1/60 = 1/6, plus b's end (1/3); a and b pass 4:
    C = 20·(0.1·0.5 + 0.9·2) = 37 → H = 100 + 10·ln 0.74 = 96.988949.
    ``update_around(5)`` reaches all three: S5, its parent S4, and the bundle below.
    """
    index, n = tree()
    q = queue(index, 1, tau=10.0)
    index.set_snapshot(n[5], 1, SNAP, 100.0)
    q.update_around(n[5])
    heap = q.heaps[0]
    assert heap.priority(n[6]) == pytest.approx(81.028800, abs=1e-5)
    assert heap.priority(n[5]) == pytest.approx(83.035507, abs=1e-5)
    assert heap.priority(n[4]) == pytest.approx(96.988949, abs=1e-5)
    q.check(exact=True)


def test_refresh_used_ranks_a_mid_prefix_snapshot_by_its_last_resume() -> None:
    """``eviction`` NOTE 6: KV on tier 0 (the engine's pool, ranked by t), snapshots on
    tier 1 (the last, ranked by H, τ = 10). Every snapshot is stored at t = 0 (``used``
    0), every node read at 100; then a hit on a's whole prefix resumes from S6 at 200.

    Refresh-all writes 200 into ``access`` of 1–6 under both rules; ``refresh_used``
    also writes 200 into ``used`` of the hit node 6 only. S2 and S4 (intermediate
    snapshots) then rank by ``used`` = 0: on tier 0 (t alone) 0 instead of 200, on
    tier 1 exactly 200 below their refresh-all ranks (same C, same M). S6 (a bundle:
    a hit through it reads its KV) reads ``access`` under both: 200 on tier 0, the
    same H on tier 1.
    """
    ranks = {}
    for used in (False, True):
        index, n = tree(kv_tier=0, snap_tier=1)
        q = queue(index, 2, tau=10.0, refresh_all=True, refresh_used=used, recency_tiers=1)
        q.touch([n[k] for k in (1, 2, 3, 4, 5, 6)], 6, 200.0)
        assert [n[k].access for k in (2, 4, 6)] == [200.0] * 3
        assert [n[k].used for k in (2, 4, 6)] == [0.0, 0.0, 200.0 if used else 0.0]
        q.check()
        ranks[used] = {(k, t): q.rank(n[k], t) for k in (2, 4, 6) for t in (0, 1)}
    for k in (2, 4):
        assert ranks[True][(k, 1)] == pytest.approx(ranks[False][(k, 1)] - 200.0)
        assert (ranks[True][(k, 0)], ranks[False][(k, 0)]) == (0.0, 200.0)
    assert ranks[True][(6, 1)] == ranks[False][(6, 1)]
    assert ranks[True][(6, 0)] == ranks[False][(6, 0)] == 200.0



def test_exposed_ends_discount_the_end_hits_a_tail_in_a_faster_tier_still_serves() -> None:
    """``eviction`` NOTE 7 on the module's tree, two tiers (tier 1 the last), τ = 10.

    Snapshots and the KV of 1–4 and 7–8 on tier 1; the KV of 5–6 (a's tail below S4) on
    tier 0. Before any unit has left a tier nothing is discounted: S4's C is the paper's
    20·(0.1·2/3 + 0.9·2) = 37.333333. Then a unit read at 95 is demoted out of tier 0 at
    100 (dwell 5 s, the EMA's seed) and one read at 98 dropped from tier 1 at 100 (2 s):
    a tail on tier 0 leaves the cache after S = 5 + 2 = 7 s, so a's end hits still need
    S4 with probability exp(−7/10) = 0.496585 (the share its tail serves: 0.503415). The
    table is read at the next epoch (a re-access sample). S4: passes 2 − 0.503415 =
    1.496585, C = 20·(0.1·2/3 + 0.9·1.496585) = 28.271869, H on tier 1 (M = 200) =
    100 + 10·ln(113.087475/200) = 94.298443 (97.078636 without the rule). S2's child 3
    is on the last tier: its C stays 37.333333. Demoting 5 to tier 1 (re-ranked around
    it, as every move is) gives S4 the paper's C back; with 5 and 7 on tier 0 both
    sessions' shares go: 2 − 2·0.503415 = 0.993171, C = 19.210404, H = 90.434290.
    """
    index, n = tree(kv_tier=1, snap_tier=1)
    for key in (5, 6):
        n[key].kv_tiers = 1
    q = queue(index, 2, tau=10.0, recency_tiers=1, exposed_ends=True)
    assert q.cost(n[4]) == pytest.approx(112 / 3)
    n[1].access = 95.0
    q.observe_demotion(n[1], 0, 100.0)
    n[3].access = 98.0
    q.observe_demotion(n[3], 1, 100.0)
    assert [d.value for d in q.dwell] == [5.0, 2.0]
    assert q.cost(n[4]) == pytest.approx(112 / 3)  # not before the next epoch
    q.reaccess.observe(30.0)
    for node in index.nodes.values():
        q.update(node)
    assert q.cost(n[4]) == pytest.approx(28.271869, abs=1e-6)
    assert q.cost(n[2]) == pytest.approx(112 / 3)
    assert q.heaps[1].priority(n[4]) == pytest.approx(94.298443, abs=1e-5)
    q.check(exact=True)
    n[5].kv_tiers = 2
    q.update_around(n[5])
    assert q.heaps[1].priority(n[4]) == pytest.approx(97.078636, abs=1e-5)
    q.check(exact=True)
    for key in (5, 7):
        n[key].kv_tiers = 1
        q.update_around(n[key])
    assert q.cost(n[4]) == pytest.approx(19.210404, abs=1e-6)
    assert q.heaps[1].priority(n[4]) == pytest.approx(90.434290, abs=1e-5)
    q.check(exact=True)
    plain = queue(index, 2, tau=10.0, recency_tiers=1)
    plain.observe_demotion(n[1], 0, 200.0)
    plain.reaccess.observe(30.0)
    assert plain.cost(n[4]) == pytest.approx(112 / 3)  # the paper's pricing: no discount
