"""EXPERIMENT, not product code: ``histate simulate`` with a proposed core change applied.

Finding (benchmarks/README.md, "sim_weka"): in the policy core, a KV chunk that lies
between two snapshots (an *interior* segment: above an intermediate snapshot, below
the previous one) belongs to no eviction unit until every snapshot below it is gone
(``core.units``: a SNAPSHOT unit frees only its snapshot; a bundle's tail stops at the
nearest snapshot above). On a tier that holds the KV but not the snapshots (GPU or
CPU, intermediate snapshots living on disk), such KV can never be demoted: it squats
in the fast tiers, and every newer chunk falls through ``TieredStore._place`` to disk.
After a replay of the Weka subset, 100 % of the KV bytes on the GPU and CPU tiers
were in no unit.

Proposed change (for the core's owner; this script monkeypatches it in, the package
is untouched): on every tier but the last, the unit anchored at an intermediate
snapshot also carries the KV segment above it (``tail_chain(anchor)``) — demoting an
interior segment is always safe, only dropping must stay prefix-closed; on the last
tier a snapshot unit still frees only its snapshot.

Usage: ``python benchmarks/sim_segment_fix.py simulate [histate simulate options]``.
"""

from __future__ import annotations

import sys
from typing import Any

from lmcache_histate.core import eviction, placement, units

_unit_nodes = units.unit_nodes


def _extended_unit_nodes(anchor: Any) -> tuple[Any, list[Any]]:
    if units.unit_kind(anchor) is units.UnitKind.SNAPSHOT:
        return anchor, list(units.tail_chain(anchor))
    return _unit_nodes(anchor)


def _tier_bytes(self: Any, anchor: Any) -> list[int]:
    interior = units.unit_kind(anchor) is units.UnitKind.SNAPSHOT
    snap, chain = _extended_unit_nodes(anchor)
    last = len(self.heaps) - 1
    out = []
    for t in range(len(self.heaps)):
        bit = 1 << t
        total = snap.snap_bytes if snap is not None and snap.snap_tiers & bit else 0
        if not (interior and t == last):
            total += sum(n.kv_bytes for n in chain if n.kv_tiers & bit)
        out.append(total)
    return out


_drop = placement.TieredStore.drop


def _drop_prefix_closed(self: Any, anchor: Any, now: float) -> None:
    placement.unit_nodes = _unit_nodes  # dropping frees the snapshot only
    try:
        _drop(self, anchor, now)
    finally:
        placement.unit_nodes = _extended_unit_nodes


def install() -> None:
    eviction.EvictionQueue._tier_bytes = _tier_bytes  # type: ignore[method-assign]
    eviction.unit_nodes = _extended_unit_nodes  # type: ignore[assignment]
    placement.unit_nodes = _extended_unit_nodes  # type: ignore[assignment]
    placement.TieredStore.drop = _drop_prefix_closed  # type: ignore[method-assign]


if __name__ == "__main__":
    install()
    from lmcache_histate.cli import main

    sys.exit(main(sys.argv[1:]))
