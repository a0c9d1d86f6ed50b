"""The L1 eviction policy's victim choice: CPU-tier units out by lowest ``H``.

Also keeps the ranks fresh when inputs shared by every unit drift (a re-rank sweep,
spread over janitor ticks or done at once before an eviction).
"""

from __future__ import annotations

from .object_map import CPU

RERANK_BUDGET = 4096  # nodes re-ranked per janitor tick (4 ticks/s) during a sweep


class CpuEvictionMixin:
    """Re-rank sweeps and ``evict_cpu`` of ``HiStateRuntime``."""

    def _rerank_step(self, budget: int | None) -> None:
        """Re-rank queued units when the global inputs of ``C`` drifted (under the lock).

        The core re-ranks a unit when it changes or is accessed, and lazily re-checks a
        candidate whose ``H`` *rose*; but every stored ``H`` also depends on two inputs
        shared by all units, the score's scale ``tau`` (calibrated online from session
        re-access gaps, ``core/score.py``) and ``p_end``, which drift for every unit at
        once (a fresh server starts from its priors). When either drifted noticeably since
        the last full re-rank (tau by 10 %, p_end by 0.02), a sweep re-ranks every node,
        ``budget`` nodes at a time (janitor ticks), or all at once (``budget=None``)
        before the L1 eviction loop picks victims.
        """
        core = self.core
        if core is None:
            return
        if self._sweep is None:
            score = core.score_status()
            tau, p = float(score["tau_s"]), float(score["end_probability"])
            tau0, p0 = self._rank_basis
            if abs(tau - tau0) <= 0.1 * max(tau0, 1e-9) and abs(p - p0) <= 0.02:
                return
            self._rank_basis = (tau, p)
            self._sweep = list(core.index.nodes)
            self.stats["rerank_sweeps"] += 1
        sweep = self._sweep
        take = len(sweep) if budget is None else min(budget, len(sweep))
        nodes = core.index.nodes
        for nk in sweep[len(sweep) - take :]:
            node = nodes.get(nk)
            if node is not None:
                core.queue.update(node)
        del sweep[len(sweep) - take :]
        if not sweep:
            self._sweep = None

    def evict_cpu(self, need_bytes: int) -> int:
        """Push units out of the CPU tier by lowest H until ``need_bytes`` are freed."""
        now = self.clock()
        freed = 0
        with self.lock:
            self._drain_locked()
            core = self.core
            if core is None:
                return 0
            self._rerank_step(None)
            store = core.store
            while freed < need_bytes:
                before = store.used[CPU]
                found = core.queue.victim(CPU)
                if found is None:
                    break
                anchor, rank = found
                store.evict(anchor, CPU, now, rank)
                gain = before - store.used[CPU]
                if gain <= 0:
                    break
                freed += gain
            self.stats["l1_policy_evictions"] += 1 if freed else 0
            actions = self._take_actions()
        self._run(actions)
        return freed
