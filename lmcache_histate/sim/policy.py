"""The interface between the simulator's server model and a caching policy.

The server model asks a policy two things per request: what hits when the request is
scheduled (``begin``: tokens the engine can skip and the bytes it must read from each
tier), and what it stores once its prefill is done (``complete``: bytes written per
tier). HiState and its ablations are the real policy core (``HiStateCache``) behind this
interface; baselines implement it with their own (documented) rules.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..core.cache import CacheConfig, HiStateCache, PlacementEvent, RequestHandle
from ..core.tiers import SNAPSHOT, PlacementRules, TierSpec
from .trace_model import Request

__all__ = ["HiStatePolicy", "Lookup", "Policy", "TierCounter"]


@dataclass(slots=True)
class Lookup:
    """What a request finds when it is scheduled.

    ``hit_tokens``: prompt tokens not recomputed (a state must exist there);
    ``load_bytes``: bytes read per tier name to resume (GPU-resident reads are free in
    the cost model but reported); ``handle``: the policy's own token for ``complete``.
    """

    hit_tokens: int
    load_bytes: dict[str, int] = field(default_factory=dict)
    handle: Any = None


class Policy(Protocol):
    name: str

    def begin(self, request: Request, now: float) -> Lookup: ...

    def complete(self, request: Request, lookup: Lookup, now: float) -> dict[str, int]:
        """Store what the request computed; returns bytes written per tier name."""
        ...

    def stats(self) -> dict[str, float]: ...


class TierCounter:
    """Counts, from the core's placement events (``HiStateCache.take_events``), the bytes
    written to / dropped from each tier, and the snapshots dropped: all of them, and those
    that leave *alone*, their KV staying cached below them (an intermediate snapshot
    leaving the last tier; a bundle's snapshot leaves with its KV leaf)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.written_bytes: Counter[str] = Counter()
        self.dropped_bytes: Counter[str] = Counter()
        self.snapshots_dropped = 0
        self.snapshots_dropped_alone = 0

    def count(self, events: Iterable[PlacementEvent]) -> None:
        names = self.names
        for event in events:
            match event:
                case ("stored", _key, _part, tier, nbytes):
                    self.written_bytes[names[tier]] += nbytes
                case ("moved", _key, _part, _src, dst, nbytes):
                    self.written_bytes[names[dst]] += nbytes
                case ("dropped", _key, part, tiers, nbytes, _held, _since, _access, alone):
                    for t, name in enumerate(names):
                        if tiers & (1 << t):
                            self.dropped_bytes[name] += nbytes
                    if part == SNAPSHOT:
                        self.snapshots_dropped += 1
                        self.snapshots_dropped_alone += alone


def _fastest(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


class HiStatePolicy:
    """The policy core itself, driven by the simulator (HiState and its ablations).

    ``promote_tier`` models the engine's side of a hit: what a request reads (or
    recomputes over cached KV) ends up in the GPU's block pool and stays there, as in
    vLLM, whose prefix cache keeps the blocks LMCache loaded into it. With the GPU as
    tier 0 of an exclusive hierarchy (``sim/variants.py``), that is a move of the
    prompt's cached KV and the resumed snapshot to tier 0 when the request completes,
    making room there through the core's own eviction (``TieredStore.make_room``: the
    lowest-H units are demoted). The baselines model the same engine behaviour
    (``baselines/tiered_lru.py``), so rows differ by policy, not by engine. ``None``
    (default) leaves placement to the core alone.
    """

    def __init__(self, name: str, config: CacheConfig, promote_tier: int | None = None) -> None:
        self.name = name
        self.tier_names = [t.name for t in config.tiers]
        self.counter = TierCounter(self.tier_names)
        self.cache = HiStateCache(config)
        self.promote_tier = promote_tier
        self.promoted_bytes = 0

    @classmethod
    def build(
        cls,
        name: str,
        *,
        chunk_tokens: int,
        kv_bytes_per_token: int,
        snapshot_bytes: int,
        tiers: list[tuple[str, int]],
        rules: PlacementRules,
        promote_tier: int | None = None,
        **knobs: Any,
    ) -> HiStatePolicy:
        return cls(
            name,
            CacheConfig(
                chunk_tokens=chunk_tokens,
                kv_chunk_bytes=chunk_tokens * kv_bytes_per_token,
                snapshot_bytes=snapshot_bytes,
                tiers=tuple(TierSpec(n, c) for n, c in tiers),
                rules=rules,
                **knobs,
            ),
            promote_tier=promote_tier,
        )

    def begin(self, request: Request, now: float) -> Lookup:
        handle = self.cache.begin(request.session_id, request.chunk_hashes, now, request.kind)
        loads: Counter[str] = Counter()
        hit = handle.match.hit_chunks
        if hit:
            # ``pinned`` is the matched KV path (hit ≤ KV match): no second walk.
            names = self.tier_names
            for node in handle.pinned[:hit]:
                loads[names[_fastest(node.kv_tiers)]] += node.kv_bytes
            snap = handle.match.hit_node
            assert snap is not None
            loads[names[_fastest(snap.snap_tiers)]] += snap.snap_bytes
        return Lookup(hit * self.cache.config.chunk_tokens, dict(loads), handle)

    def plan(
        self, request: Request, handle: RequestHandle, start_chunks: int | None = None
    ) -> list[int]:
        """Token positions of the states this request saves: the core's plan for the span
        it computes, from its KV match (or from ``start_chunks`` if that lies deeper: a
        prefix resumed from elsewhere, ``sim.shared_tier``) to its last hashed chunk."""
        # The snapshot plan ends at the last HASHED chunk, like the baselines' end state
        # (``len(keys)``): a trace may hash fewer chunks than ``input_tokens // chunk``
        # (the trailing blocks it does not list), and a plan ending past the stored chain
        # would skip the segment's final snapshot. ``input_tokens`` stays the session's
        # context length.
        chunk = self.cache.config.chunk_tokens
        start = handle.match.kv_chunks
        if start_chunks is not None:
            start = max(start, start_chunks)
        return self.cache.snapshot_plan(
            start * chunk,
            min(request.input_tokens, len(handle.keys) * chunk),
            handle.kind,
            handle.segment_start,
        )

    def complete(
        self, request: Request, lookup: Lookup, now: float, start_chunks: int | None = None
    ) -> dict[str, int]:
        """Promote, then store the prompt's KV and the planned states (``plan``)."""
        handle: RequestHandle = lookup.handle
        before = Counter(self.counter.written_bytes)
        if self.promote_tier is not None:
            self.promoted_bytes += self.cache.promote(handle, self.promote_tier, now)
        plan = self.plan(request, handle, start_chunks)
        self.cache.complete(handle, request.input_tokens, now, boundaries=plan)
        self.drain()
        after = self.counter.written_bytes
        return {name: after[name] - before[name] for name in after if after[name] != before[name]}

    def drain(self) -> None:
        """Count the core's placement events (after each call that places anything)."""
        self.counter.count(self.cache.take_events())

    def stats(self) -> dict[str, float]:
        core = self.cache.stats()
        out: dict[str, float] = {
            "pressure_factor": core.pressure_factor,
            "end_probability": core.end_probability,
            "tau": core.tau_s,
            "reaccess_samples": float(core.reaccess_samples),
            "dropped_units": float(core.dropped_units),
            "snapshots_dropped": float(self.counter.snapshots_dropped),
            "snapshots_dropped_alone": float(self.counter.snapshots_dropped_alone),
            "promoted_bytes": float(self.promoted_bytes),
        }
        for name, used in zip(self.tier_names, core.used_bytes, strict=True):
            out[f"used_{name}"] = float(used)
        for name in self.tier_names:
            out[f"written_{name}"] = float(self.counter.written_bytes[name])
        return out
