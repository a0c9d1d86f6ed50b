"""``EvictionQueue.update_around(snapshot_only=True)`` (eviction NOTE 5): after a
snapshot is dropped alone, the units whose rank read it are re-ranked, with
hand-computed ranks, and the queue ends as a full ``update_around`` leaves it.

The tree is ``test_cost_and_rank``'s (one tier, chunks of 10 tokens, 4 B per token,
snapshots 200 B, ``p_end`` 0.9, every t = 100, τ = 10)::

    1 ─ 2[S] ─ 3 ─ 4[S] ─ 5 ─ 6[S]    session a ends at 6 (60 tokens)
                    └──── 7 ─ 8        session b ends at 8 (60 tokens)
"""

from __future__ import annotations

import pytest
from test_cost_and_rank import SNAP, queue, tree
from test_rank_stamps import no_rank

from lmcache_histate.core.eviction import EvictionQueue
from lmcache_histate.core.index import Node, PrefixIndex


def drop_alone(index: PrefixIndex, q: EvictionQueue, node: Node, *, generic: bool) -> None:
    index.clear_snapshot(node)
    if generic:
        q.update_around(node)
    else:
        q.update_around(node, snapshot_only=True)


def live(q: EvictionQueue) -> dict[int, float]:
    return {node.key: q.heaps[0].priority(node) for node in q.heaps[0]}


def test_dropping_s4_re_ranks_the_snapshot_above_and_the_bundle_below() -> None:
    """S4 goes. S2's zone now runs through 3, 4 down to the boundary S6 (mass
    (60 − 20)·1/60 = 2/3) and to 8, where b ends (internal (60 − 20)/60 = 2/3): C = 20·(0.1·4/3
    + 0.9·2) = 38.666667, H = 100 + 10·ln(154.666667 / 200) = 97.429549 (was 97.078636).
    The bundle 6's previous snapshot is now S2: δ = 40, C = 40·0.9·1 = 36, M = 200 + KV of
    6 and 5 = 280 (its segment still stops at 4, where the prefix branches), H = 100 +
    10·ln(144 / 280) = 93.350237 (was 86.418771). The dead tail 8 is unchanged; 4 is no
    longer a unit."""
    index, n = tree()
    q = queue(index, 1, tau=10.0)
    drop_alone(index, q, n[4], generic=False)
    got = live(q)
    assert set(got) == {2, 6, 8}
    assert got[2] == pytest.approx(97.429549, abs=1e-5)
    assert got[6] == pytest.approx(93.350237, abs=1e-5)
    assert got[8] == pytest.approx(100.0 + 10.0 * -20.723266, abs=1e-5)
    q.check(exact=True)


def test_a_parent_holding_a_snapshot_is_re_ranked_too() -> None:
    """With a snapshot at 3 as well, dropping S4 lengthens S3's zone (the parent's): down
    to S6 (mass (60 − 30)·1/60 = 0.5) and to 8 (internal (60 − 30)/60 = 0.5); δ = 10, C = 10·
    (0.1·1 + 0.9·2) = 19, H = 100 + 10·ln(76 / 200) = 90.324160. The bundle 6 resumes from
    S3 now: δ = 30, C = 27, H = 100 + 10·ln(108 / 280) = 90.473416. S2 (zone: 3 alone,
    boundary S3) keeps 100 + 10·ln(4·20·(0.1/3 + 1.8) / 200) = 96.898451."""
    index, n = tree()
    index.set_snapshot(n[3], 1, SNAP, 0.0)
    q = queue(index, 1, tau=10.0)
    drop_alone(index, q, n[4], generic=False)
    got = live(q)
    assert set(got) == {2, 3, 6, 8}
    assert got[3] == pytest.approx(90.324160, abs=1e-5)
    assert got[6] == pytest.approx(90.473416, abs=1e-5)
    assert got[2] == pytest.approx(96.898451, abs=1e-5)
    q.check(exact=True)


@pytest.mark.parametrize("extra_snapshot", [False, True])
@pytest.mark.parametrize("dropped", [2, 4, 6])
def test_the_same_queue_as_update_around(dropped: int, extra_snapshot: bool) -> None:
    """Every snapshot of the tree (S6 as part of the bundle: the common drop keeps its
    KV), with and without a snapshot on the parent: the two re-rankings leave the same
    entries at the same ranks."""
    queues = []
    for generic in (False, True):
        index, n = tree()
        if extra_snapshot:
            index.set_snapshot(n[3], 1, SNAP, 0.0)
        q = queue(index, 1, tau=10.0)
        drop_alone(index, q, n[dropped], generic=generic)
        q.check(exact=True)
        queues.append(live(q))
    assert queues[0] == queues[1]


def test_a_snapshot_at_the_first_chunk_is_the_one_above() -> None:
    """Chain 1[S] ─ 2[S] ─ 3, session a ends at 3 (30 tokens, density 1/30). S1 (p = 10,
    δ = 10, passed by a) first bounds its zone at S2 (mass (20 − 10)/30 = 1/3): C =
    10·(0.1/3 + 0.9) = 9.333333, H = 100 + 10·ln(37.333333 / 200) = 83.215692. With S2
    gone its zone reaches a's end (internal (30 − 10)/30 = 2/3): C = 10·(0.1·2/3 + 0.9) =
    9.666667, H = 100 + 10·ln(38.666667 / 200) = 83.566605 (a snapshot at depth 0 is a
    snapshot above like any other)."""
    index = PrefixIndex(10)
    n = index.insert_chain([1, 2, 3])
    for node in n:
        index.set_kv(node, 1, 40, 0.0)
    for node in n[:2]:
        index.set_snapshot(node, 1, SNAP, 0.0)
    index.set_session("a", n[2], 30)
    for node in n:
        node.access = 100.0
    q = queue(index, 1, tau=10.0)
    assert q.heaps[0].priority(n[0]) == pytest.approx(83.215692, abs=1e-5)
    drop_alone(index, q, n[1], generic=False)
    assert q.heaps[0].priority(n[0]) == pytest.approx(83.566605, abs=1e-5)
    q.check(exact=True)


@pytest.mark.parametrize("extra_snapshot", [False, True])
def test_every_unit_it_re_ranks_is_stamped(
    extra_snapshot: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The re-ranked units carry a current stamp (NOTE 4), so ``victim`` takes each as
    queued, without a re-rank: the dead tail 8 (below), then the snapshot above (S2; S3,
    the parent, with a snapshot at 3), each the top once the others are set aside."""
    index, n = tree()
    if extra_snapshot:
        index.set_snapshot(n[3], 1, SNAP, 0.0)
    q = queue(index, 1, tau=10.0)
    for node in n.values():
        node.rank_stamp = None  # only what the drop re-ranks is stamped now
    drop_alone(index, q, n[4], generic=False)
    calls = no_rank(q, monkeypatch)
    found = q.victim(0)
    assert found is not None and found[0] is n[8]
    q.remove(n[8])
    q.remove(n[6])
    if extra_snapshot:
        q.remove(n[2])
    found = q.victim(0)
    assert found is not None and found[0] is n[3 if extra_snapshot else 2]
    assert calls == []


def test_a_change_at_the_first_chunk_stays_inside_its_own_prefix() -> None:
    """Two prompts that share nothing: 1[S] ─ 2 and 11[S] ─ 12. A change at chunk 1 (the
    root's child) re-ranks what lies under 1 and nothing under 11: the root is not a
    parent whose branches the change reaches (every prefix hangs from it). Both re-ranked
    units, ``node`` itself included, carry a current stamp."""
    index = PrefixIndex(10)
    a = index.insert_chain([1, 2])
    b = index.insert_chain([11, 12])
    for node in (*a, *b):
        index.set_kv(node, 1, 40, 0.0)
        node.access = 100.0
    for node in (a[0], b[0]):
        index.set_snapshot(node, 1, SNAP, 0.0)
    q = queue(index, 1, tau=10.0)
    for node in (*a, *b):
        node.rank_stamp = None
    for only in (False, True):
        q.update_around(a[0], snapshot_only=only)
        # Stamped with the epoch and the access they were ranked with (NOTE 4).
        stamps = [node.rank_stamp for node in (*a, *b)]
        assert stamps == [(q.epoch, 100.0), (q.epoch, 100.0), None, None]
