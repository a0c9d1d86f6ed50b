"""The eviction queue's consistency checks: O(n) or per victim, for tests.

``EvictionQueue.check`` and the stamp verification behind ``EvictionQueue.verify_stamps``
(``eviction`` NOTE 4) live here, apart from the queue's hot paths: they only read the
queue (its heaps, ``rank`` and the bytes each unit frees per tier) and assert.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .eviction import EvictionQueue
    from .index import Node

__all__ = ["check_queue", "verify_stamp"]


def verify_stamp(queue: EvictionQueue, anchor: Node, tier: int, queued: float) -> None:
    """A top whose stamp ``victim`` trusts has a fresh rank equal to the queued one."""
    fresh = queue.rank(anchor, tier)
    assert fresh is not None, f"stamped {anchor} frees nothing in tier {tier}"
    tol = 1e-9 * max(1.0, abs(fresh))
    assert abs(fresh - queued) <= tol, f"stamped {anchor}: queued {queued} ≠ {fresh}"


def check_queue(queue: EvictionQueue, exact: bool = False) -> None:
    """Every unit is queued in exactly the tiers where it frees bytes.

    And at a rank consistent with a fresh ``rank()``: in the tiers ranked by ``t`` alone
    (every tier when ``τ = 0``) a queued rank is never above the fresh one (accesses only
    raise ``t``, ``eviction`` NOTE 1). On the cost-ranked tier ``τ`` and ``p_end`` drift
    both ways, so there only ``exact`` checks: every queued rank *equals* the fresh one,
    which holds whenever no access and no sample happened since the last structural
    change (a test's quiescent point).
    """
    live = set(queue.index.nodes.values())
    for heap in queue.heaps:
        for anchor in heap:
            assert anchor in live, f"queued node {anchor} is not in the index"
    first = queue._first_cost_tier(queue.tau)
    for node in live:
        # Per tier through ``units.unit_parts``: the hot path's ``tier_bytes`` computes
        # all tiers in one walk, so this also checks that walk against the definition.
        freed = [queue._freed_in(node, tier) for tier in range(len(queue.heaps))]
        for tier, heap in enumerate(queue.heaps):
            assert (freed[tier] > 0) == (node in heap), (node, tier, freed)
            if node not in heap:
                continue
            queued, fresh = heap.priority(node), queue.rank(node, tier)
            assert fresh is not None
            tol = 1e-9 * max(1.0, abs(fresh))
            if exact:
                assert abs(queued - fresh) <= tol, f"stale rank {queued} ≠ {fresh}: {node}"
            elif tier < first:
                assert queued <= fresh + tol, f"rank {queued} above fresh {fresh}: {node}"
