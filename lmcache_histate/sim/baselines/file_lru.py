"""``file-lru``: the paper's "file-level LRU" ablation, faithfully — objects, not units.

HiState's eviction ranks *units* (a session's final bundle, an intermediate snapshot
with the KV segment above it; ``core.rank``) by ``H``. The paper's ablation replaces
that with what a file cache does: every KV chunk and every snapshot file is an
independent LRU object. Everything else stays HiState's, so the row isolates eviction:

* **the same tiers and tier model** as the ``histate`` row (``sim/variants.py``):
  exclusive gpu → cpu → disk with demotion, one byte budget per tier shared by KV and
  snapshots, hits read back to the GPU. The engine is ``TieredLRU``, the LRU-per-object
  engine the vLLM rows use (its recency rules: a finished request releases every KV
  chunk of its prompt and only the snapshot it resumed from plus those it saved);
* **the same placement**: KV and each segment's final snapshot are stored on the GPU,
  intermediate snapshots straight onto the disk tier as files of their own (HiState's
  snapshot tier), and each object moves down one tier at a time when LRU picks it;
* **the same interval control**: ``IntervalController`` with the pressure factor from
  the observed residence times of KV and snapshots (every object leaving the cache is
  a sample, as in ``TieredStore.drop``);
* **the same capture bill**: the interval states are planned when the request is
  scheduled (``plan``, as ``histate_capture`` does for HiState's rows), charged from
  that plan (``capture``: one-chunk prefill steps, one device → host copy per
  intermediate state) and stored by ``complete`` exactly as planned.

What it lacks is exactly the ablated mechanism: no units (a KV chunk can leave while the
snapshot that makes it useful stays, and vice versa), no cost term, no refresh-all
(the snapshots on the prefix below the one resumed from keep their own age). Dropping a
KV chunk drops the KV below it (prefix closure, ``TieredLRU``), and a snapshot without
its KV with it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...core.cache import config_default
from ...core.index import Node, PrefixIndex
from ...core.interval import IntervalController, ResidenceTracker, supported_intervals
from ..capture import Capture
from ..policy import Lookup
from ..trace_model import Request
from .end_state import EndStatePolicy, StatePlan
from .tiered_lru import STATE, PoolSpec, TieredLRU, UseHandle

__all__ = ["FileLRU", "file_lru_policy"]


class _ObservedIndex(PrefixIndex):
    """A prefix index that samples residence times whenever an object leaves it."""

    def __init__(self, chunk_tokens: int, residence: ResidenceTracker) -> None:
        super().__init__(chunk_tokens)
        self.residence = residence
        self.clock = 0.0

    def clear_kv(self, node: Node) -> None:
        if node.kv_tiers:
            self.residence.observe_kv(self.clock - node.kv_since)
        super().clear_kv(node)

    def clear_snapshot(self, node: Node) -> None:
        if node.snap_tiers:
            self.residence.observe_snapshot(self.clock - node.snap_since)
        super().clear_snapshot(node)


class FileLRU(TieredLRU):
    """``TieredLRU`` whose intermediate snapshots are stored on ``snapshot_tier``.

    ``sizes``: (chunk tokens, KV bytes per chunk, snapshot bytes).
    """

    def __init__(
        self, sizes: tuple[int, int, int], pools: Sequence[PoolSpec], residence: ResidenceTracker
    ) -> None:
        super().__init__(*sizes, pools)
        self.index = _ObservedIndex(sizes[0], residence)
        self.snapshot_tier = len(self.tier_names) - 1
        self._final_chunks = 0

    def admit_at(
        self, handle: UseHandle, state_chunks: Sequence[int], now: float
    ) -> dict[str, int]:
        """``admit`` with the clock set for residence samples and the final one known."""
        assert isinstance(self.index, _ObservedIndex)
        self.index.clock = now
        self._final_chunks = max(state_chunks, default=0)
        return self.admit(handle, state_chunks, now)

    def _store(self, node: Node, kind: int, now: float) -> bool:
        if kind != STATE or node.depth + 1 == self._final_chunks:
            return super()._store(node, kind, now)
        tier = self.snapshot_tier
        pool = self._pool[tier][STATE]
        size = self.sizes[STATE]
        if not self._make_room(pool, size, None):
            return False
        self.index.set_snapshot(node, 1 << tier, size, now)
        self.used[pool] += size
        self.written[self.tier_names[tier]] += size
        self.heaps[tier][STATE].set(node, now)
        return True


class FileLRUPolicy(EndStatePolicy):
    """HiState's interval plan over ``FileLRU`` (``begin`` is ``EndStatePolicy``'s)."""

    def __init__(self, name: str, engine: FileLRU, interval: IntervalController) -> None:
        super().__init__(name, engine)
        self.file_engine = engine
        self.interval = interval

    def plan(self, request: Request, handle: UseHandle) -> StatePlan:
        """HiState's interval boundaries of the new segment, the last one final."""
        chunk = self.chunk_tokens
        bounds = self.interval.boundaries(
            handle.match.kv_chunks * chunk, len(handle.keys) * chunk
        )
        chunks = [p // chunk for p in bounds]
        return StatePlan(chunks[-1] if chunks else 0, chunks)

    def capture(self, request: Request, lookup: Lookup) -> Capture:
        """HiState's bill (``histate_capture``): prefill in steps of one chunk (the
        engine must be able to end a step at any planned boundary), and a device → host
        copy of every intermediate state."""
        mid = len(lookup.handle.plan.mid)
        return Capture(step_tokens=self.chunk_tokens, host_states=mid if self.has_host_tier else 0)

    def complete(self, request: Request, lookup: Lookup, now: float) -> dict[str, int]:
        handle: UseHandle = lookup.handle
        return self.file_engine.admit_at(handle, handle.plan.chunks, now)

    def stats(self) -> dict[str, float]:
        out = super().stats()
        out["pressure_factor"] = self.interval.pressure_factor
        return out


def file_lru_policy(
    name: str,
    tiers: Sequence[tuple[str, int]],
    *,
    chunk_tokens: int,
    kv_bytes_per_token: int,
    snapshot_bytes: int,
    max_interval_chunks: int = config_default("max_interval_chunks"),
    ema_alpha: float = config_default("ema_alpha"),
) -> FileLRUPolicy:
    """File-level LRU over ``tiers`` = [(name, capacity bytes), ...], fastest first (the
    last one is the snapshot tier), with HiState's interval control: the supported
    intervals up to ``max_interval_chunks`` chunks and residence-time EMAs of weight
    ``ema_alpha``, as the ``histate`` row's (``baselines`` NOTE 1)."""
    chunk, per_token, snapshot = chunk_tokens, kv_bytes_per_token, snapshot_bytes
    residence = ResidenceTracker(ema_alpha)
    engine = FileLRU(
        (chunk, chunk * per_token, snapshot),
        [PoolSpec(tier, capacity) for tier, capacity in tiers],
        residence,
    )
    interval = IntervalController(
        chunk,
        snapshot / per_token,
        supported_intervals(chunk, max_interval_chunks),
        residence,
    )
    return FileLRUPolicy(name, engine, interval)
