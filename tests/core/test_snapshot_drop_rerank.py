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
