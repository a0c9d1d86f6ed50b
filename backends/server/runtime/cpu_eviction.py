"""The L1 eviction policy's victim choice: CPU-tier units out by lowest ``H``.

Also keeps the ranks fresh when inputs shared by every unit drift (a re-rank sweep,
spread over janitor ticks or done at once before an eviction). State owned here: the
``(tau, p_end)`` the ranks were last computed with, and the sweep in progress. Called
within the runtime's step.
"""

from __future__ import annotations

from lmcache_histate.core.cache import HiStateCache
from lmcache_histate.core.tiers import ServerTier

from .stats import Stats

__all__ = ["RERANK_BUDGET", "CpuEvictor"]

RERANK_BUDGET = 4096  # nodes re-ranked per janitor tick (4 ticks/s) during a sweep


class CpuEvictor:
    """Re-rank sweeps and CPU-tier eviction by lowest ``H``."""

    def __init__(self, end_probability_prior: float, stats: Stats) -> None:
        self.stats = stats
        self._rank_basis: tuple[float, float] = (0.0, end_probability_prior)
        self._sweep: list[int] | None = None

    def rerank_step(self, core: HiStateCache, budget: int | None) -> None:
        """Re-rank queued units when the global inputs of ``C`` drifted.

        The core re-ranks a unit when it changes or is accessed, and lazily re-checks a
        candidate whose ``H`` *rose*; but every stored ``H`` also depends on two inputs
        shared by all units, the score's scale ``tau`` (calibrated online from session
        re-access gaps, ``core/rank.py`` NOTE 4) and ``p_end``, which drift for every unit at
        once (a fresh server starts from its priors). When either drifted noticeably since
        the last full re-rank (tau by 10 %, p_end by 0.02), a sweep re-ranks every node,
        ``budget`` nodes at a time (janitor ticks), or all at once (``budget=None``)
        before the L1 eviction loop picks victims.
        """
        if self._sweep is None:
            stats = core.stats()
            tau, p = stats.tau_s, stats.end_probability
            tau0, p0 = self._rank_basis
            if abs(tau - tau0) <= 0.1 * max(tau0, 1e-9) and abs(p - p0) <= 0.02:
                return
            self._rank_basis = (tau, p)
            self._sweep = [node.key for node in core.nodes()]
            self.stats["rerank_sweeps"] += 1
        sweep = self._sweep
        take = len(sweep) if budget is None else min(budget, len(sweep))
        core.rerank(sweep[len(sweep) - take :])
        del sweep[len(sweep) - take :]
        if not sweep:
            self._sweep = None

    def evict(self, core: HiStateCache, need_bytes: int, now: float) -> int:
        """Push units out of the CPU tier by lowest H until ``need_bytes`` are freed."""
        self.rerank_step(core, None)
        freed = core.evict(ServerTier.CPU, need_bytes, now)
        self.stats["l1_policy_evictions"] += 1 if freed else 0
        return freed
