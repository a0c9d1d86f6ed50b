"""Rank stamps (``core/eviction.py`` NOTE 4): ``victim`` takes a top as current without
re-ranking it only while nothing its rank reads has changed since it was queued.

The tree, the queue and every expected ``H`` are ``test_cost_and_rank``'s (one tier,
chunks of 10 tokens, 4 B per token, snapshots 200 B, ``p_end`` 0.9, t = 100):
S2 and S4 ``100 + τ·ln 0.746667``, the bundle 6 ``100 + τ·ln 0.257143``, the dead
tail 8 ``t + τ·ln 1e-9``.
"""

from __future__ import annotations

import pytest
from test_cost_and_rank import LN_1E9, queue, tree

from lmcache_histate.core.eviction import EvictionQueue
from lmcache_histate.core.index import Node
from lmcache_histate.core.rank import ReaccessScale

LN_S2 = -0.292136  # ln(149.333333 / 200): S2 and S4 alone on the tree
LN_6 = -1.358123  # ln(72 / 280): the bundle


def no_rank(q: EvictionQueue, monkeypatch: pytest.MonkeyPatch) -> list[Node]:
    """Record every ``rank`` call of ``q``."""
    calls: list[Node] = []
    rank = q.rank

    def counted(anchor: Node, tier: int) -> float | None:
        calls.append(anchor)
        return rank(anchor, tier)

    monkeypatch.setattr(q, "rank", counted)
    return calls


def dead_tail_first(
    monkeypatch: pytest.MonkeyPatch, *, deferred: bool = False
) -> tuple[list[Node], tuple[Node, float]]:
    """The tree's queue at τ = 10 (``deferred`` as given): ``victim(0)``'s answer, the
    dead tail 8 (every unit's t = 100, and its ``ln(C/M)`` is the floor), and the
    ``rank`` calls it made."""
    index, n = tree()
    q = queue(index, 1, tau=10.0)
    calls = no_rank(q, monkeypatch)
    q.deferred = deferred
    found = q.victim(0)
    assert found is not None and found[0] is n[8]
    return calls, found


def test_a_top_nothing_touched_is_returned_as_queued_without_a_re_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls, found = dead_tail_first(monkeypatch)
    assert found[1] == pytest.approx(100.0 + 10.0 * LN_1E9, abs=1e-5)  # −107.232658
    assert calls == []


def test_a_top_accessed_since_it_was_queued_is_re_ranked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The dead tail is read at t = 300: its H is 300 + 10·(−20.723266) = 92.767342, above
    the bundle's 86.418771, which goes first."""
    index, n = tree()
    q = queue(index, 1, tau=10.0)
    calls = no_rank(q, monkeypatch)
    q.touch([n[k] for k in (1, 2, 3, 4, 7, 8)], 6, 300.0)
    found = q.victim(0)
    assert found is not None and found[0] is n[6]
    assert found[1] == pytest.approx(100.0 + 10.0 * LN_6, abs=1e-5)
    assert q.heaps[0].priority(n[8]) == pytest.approx(92.767342, abs=1e-5)
    assert calls == [n[8]]  # the bundle's stamp still held: t = 100 (not on 8's path)
    # Re-ranked in this tier only: the stamp no longer speaks for the whole unit.
    assert n[8].rank_stamp is None


def test_a_drift_of_tau_re_ranks_the_top() -> None:
    """S2 (t = 90) against the bundle (t = 100) alone, τ calibrated (EMA weight 1, so
    τ is the last gap). Queued at τ = 9.39 the bundle is first: H6 = 87.247220 below
    H2 = 87.256839. At τ = 9.37 the order flips (H2 = 87.262682, H6 = 87.274383): the
    stale bundle is re-ranked, then S2 (stale too), and S2 is the victim."""
    index, n = tree()
    n[2].access = 90.0
    reaccess = ReaccessScale(alpha=1.0)
    reaccess.observe(9.39)
    q = queue(index, 1, tau=None, reaccess=reaccess)
    for key in (1, 3, 4, 7, 8):
        q.remove(n[key])
    assert q.heaps[0].priority(n[6]) == pytest.approx(87.247220, abs=1e-5)
    reaccess.observe(9.37)
    found = q.victim(0)
    assert found is not None and found[0] is n[2]
    assert found[1] == pytest.approx(87.262682, abs=1e-5)
    assert q.heaps[0].priority(n[6]) == pytest.approx(87.274383, abs=1e-5)


def test_a_session_through_a_snapshot_re_ranks_it() -> None:
    """S2 (t = 99) against S4 (t = 100) alone: H2 = 96.078636 < H4 = 97.078636. A session
    c ending at chunk 3 (30 tokens) passes S2 and ends in its zone: internal
    2/3 + (30 − 20)/30 = 1, passes 3, C = 20·(0.1·1 + 0.9·3) = 56, C·4/M = 1.12,
    H2 = 99 + 10·ln 1.12 = 100.133287. Nothing is re-ranked when the session moves (the
    index resets the stamps on its path), so ``victim`` re-ranks S2 and returns S4."""
    index, n = tree()
    n[2].access = 99.0
    q = queue(index, 1, tau=10.0)
    for key in (1, 3, 6, 7, 8):
        q.remove(n[key])
    assert q.heaps[0].priority(n[2]) == pytest.approx(96.078636, abs=1e-5)
    index.set_session("c", n[3], 30)
    found = q.victim(0)
    assert found is not None and found[0] is n[4]
    assert found[1] == pytest.approx(97.078636, abs=1e-5)
    assert q.heaps[0].priority(n[2]) == pytest.approx(100.133287, abs=1e-5)


def test_no_stamp_is_trusted_while_a_re_ranking_is_deferred(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As ``TieredStore.store_kv(rerank=False)`` leaves it: the same top is re-ranked.
    calls, found = dead_tail_first(monkeypatch, deferred=True)
    assert calls == [found[0]]


def test_check_catches_an_input_changed_behind_the_queue() -> None:
    """S4's boundary snapshot 6 gains hit density without the index or the queue
    knowing: S4's stamp still vouches for its queued rank, which is no longer fresh."""
    index, n = tree()
    q = queue(index, 1, tau=10.0)
    q.check()
    n[6].weight += 1.0
    with pytest.raises(AssertionError, match="stamped"):
        q.check()
