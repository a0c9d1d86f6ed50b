"""What a node writes to the shared tier: what another node needs to resume a session.

Pure (no LMCache, no I/O): the live runtime (``runtime.shared_route``) and the fleet
simulator (``lmcache_histate.sim.shared_tier.HiStateShared``) both ask ``to_shared`` about
every object the node's core just placed, so the simulator runs the live backend's rule.

Rule: a committed object the node's core holds goes to the shared tier when it is

* a KV chunk: every chunk under a resumable boundary is needed by a node that lacks it
  (a node reads from the shared tier only the chunks its own tiers miss), or
* a snapshot at a session's end: the request's final state, the session's deepest
  resumable boundary. When the session's next turn ends deeper, it stays in the shared
  tier as a historical snapshot until the shared tier's own ranking (``H``) lets it go.

Interval snapshots (the ones the node's plan puts inside a request for its own tiers) do
not go (NOTE 1).

NOTE 1 (why not the interval snapshots). A node plans interval snapshots for its own
tiers: they let a request that diverges inside the previous one (a rewrite, a retry)
recompute only from the last interval. A next turn on another node extends the previous
request and resumes at its end, from the final snapshot; an interval snapshot below it is
never the deepest hit there while the final one is present. Writing every interval
snapshot fills the one budget of the fleet with objects no other node resumes from, and
the ranking then evicts final bundles to make room: with them, the fleet simulator's
least-loaded p99 was 6.22 s, with final snapshots only 5.81 s (one run each,
``benchmarks/sim_fleet_why.py``). A diverging turn that lands on another node still
resumes from the deepest final or historical snapshot below the divergence.
"""

from __future__ import annotations

from lmcache_histate.core.tiers import KV, SNAPSHOT

__all__ = ["to_shared"]


def to_shared(part: str, *, session_end: bool) -> bool:
    """Whether an object of ``part`` (``KV`` / ``SNAPSHOT``) the node's core holds goes to
    the shared tier; ``session_end``: the object's chunk ends a session (module doc)."""
    if part == KV:
        return True
    return part == SNAPSHOT and session_end
