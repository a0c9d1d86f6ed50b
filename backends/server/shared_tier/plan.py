"""What a node writes to the shared tier: what another node needs to resume a session.

Pure (no LMCache, no I/O): the live runtime (``runtime.shared_route``) and the fleet
simulator (``lmcache_histate.sim.shared_tier.HiStateShared``) both ask ``to_shared`` about
every object the node's core just placed, so the simulator runs the live backend's rule.

Rule: a committed object the node's core holds goes to the shared tier when it is

* a KV chunk: every chunk under a resumable boundary is needed by a node that lacks it
  (a node reads from the shared tier only the chunks its own tiers miss), or
* a final snapshot: the state at the end of the request that stored it (the last whole
  chunk of its tokens), the session's deepest resumable boundary. When the session's
  next turn ends deeper, it stays in the shared tier as a historical snapshot until the
  shared tier's own ranking (``H``) lets it go.

Interval snapshots (the ones the node's plan puts inside a request for its own tiers) do
not go (NOTE 1).

NOTE 1 (why not the interval snapshots). A node plans interval snapshots for its own
tiers: they let a request that diverges inside the previous one (a rewrite, a retry)
recompute only from the last interval. A next turn on another node extends the previous
request and resumes at its end, from the final snapshot; an interval snapshot below it is
never the deepest hit there while the final one is present. Writing them spends the one
budget of the fleet on objects no other node resumes from: in one unjittered
least-loaded replay of the fleet simulator (``benchmarks/sim_fleet_why.py``) the nodes
wrote 1,625 GiB with every state against 1,411 GiB with final ones only, and the shared
tier held 8,977 KV chunks against 9,288; p99 5.84 against 5.85 s, one run each: no
difference in latency at that load. A diverging turn that lands on another node resumes
from the deepest final or historical snapshot below the divergence.
"""

from __future__ import annotations

from lmcache_histate.core.tiers import KV, SNAPSHOT

__all__ = ["to_shared"]


def to_shared(part: str, *, final: bool) -> bool:
    """Whether an object of ``part`` (``KV`` / ``SNAPSHOT``) the node's core holds goes to
    the shared tier; ``final``: a snapshot at the end of its request (module doc)."""
    if part == KV:
        return True
    return part == SNAPSHOT and final
