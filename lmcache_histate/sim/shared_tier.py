"""A tier shared by every node of a fleet, and a node that looks up its own tiers and it.

A fleet (``sim.fleet``) runs one engine per node, each with its own tiers (a ``Policy``
as on one node), and, for the rows that have one, ONE shared tier that every node reads
and writes: a Valkey/Redis Cluster for HiState and stock LMCache, Mooncake Store / 3FS
for SGLang HiCache's L3. ``SharedTierNode`` composes the two:

* **Lookup** (``begin``): the node's own tiers and the shared tier are both matched. The
  request resumes from the deeper hit; on a tie its own tiers win (no network read).
  A hit from the shared tier reads from the node's own tiers the KV chunks they hold
  (the leading chunks of its own KV match, each from the tier it is on) and from the
  shared tier the KV chunks beyond them plus the snapshot at the hit.
* **Pricing** (``NetworkModel``): a shared read costs its bytes over the network
  bandwidth plus a round-trip latency per object read (NOTE 1).
* **Store** (``complete``): the node stores what the request computed in its own tiers,
  exactly as on one node, and writes it through to the shared tier: the prompt's KV and
  states the node captured (its own plan, from the hit on: a state it did not compute
  is never written anywhere). Which states: stock LMCache and HiCache write every one
  (``LRUShared``: every key to every adapter); HiState writes the one at the request's
  end only, by the live backend's rule (``HiStateShared``, ``shared_tier.plan``). The
  shared tier's own engine decides what stays within its one budget: HiState's core or
  LRU. Writes run off the request path (LMCache and HiCache store asynchronously) and
  are not charged.

Both engines are the single-node ones (``HiStatePolicy`` over one ``shared`` tier,
``TieredLRU`` over one ``shared`` pool): no policy code is repeated here.

NOTE 1 (why 100 Gb/s and 0.2 ms). A cloud H100 node's front-end NIC, the one a
key-value store behind the serving fleet is reached over, is commonly 100 Gb/s Ethernet
(12.5 GB/s); the GPU-to-GPU RDMA fabric is faster but is not what Valkey or a TCP
Mooncake deployment uses. 0.2 ms per object is one in-datacenter round trip of a GET
(objects are fetched one after another: an upper bound, pipelined reads pay less). Both
are config keys (``configs/sim-fleet.yaml``), and every shared row pays the same price.

NOTE 2 (a lookup refreshes the shared tier). Every lookup consults the shared tier, so
its engine sees every access of the fleet, also those served from a node's own tiers.
The live adapters read L2 only on an L1 miss; charging every access here gives the
shared LRU rows a recency order at least as good as the real one, and HiState's core the
same re-access samples: the same rule for every shared row.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from ..backends.server.shared_tier.plan import to_shared
from ..core.tiers import SNAPSHOT, PlacementRules, TierSpec
from .baselines.end_state import EndStatePolicy, StatePlan
from .baselines.tiered_lru import KV, PoolSpec, TieredLRU, UseHandle
from .capture import Capture, capture_of
from .policy import HiStatePolicy, Lookup, Policy
from .trace_model import Request

__all__ = [
    "DEFAULT_NETWORK_BYTES_PER_S",
    "DEFAULT_OBJECT_LATENCY_S",
    "SHARED",
    "HiStateShared",
    "LRUShared",
    "NetworkModel",
    "SharedStore",
    "SharedTierNode",
]

SHARED = "shared"
DEFAULT_NETWORK_BYTES_PER_S = 12.5e9  # 100 Gb/s (NOTE 1)
DEFAULT_OBJECT_LATENCY_S = 2.0e-4  # one round trip per object read (NOTE 1)


@dataclass(frozen=True, slots=True)
class NetworkModel:
    """What a read from the shared tier costs: ``bytes / bytes_per_s + objects · latency``."""

    bytes_per_s: float = DEFAULT_NETWORK_BYTES_PER_S
    object_latency_s: float = DEFAULT_OBJECT_LATENCY_S

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0:
            raise ValueError(f"network bytes_per_s must be > 0, got {self.bytes_per_s}")
        if self.object_latency_s < 0:
            raise ValueError(f"object_latency_s must be ≥ 0, got {self.object_latency_s}")

    def read_time(self, nbytes: int, objects: int) -> float:
        return nbytes / self.bytes_per_s + objects * self.object_latency_s


class SharedStore:
    """One shared tier: match a request, store what a node computed (NOTE 2)."""

    name: str
    capacity: int

    def begin(self, request: Request, now: float) -> Lookup:
        """The shared tier's hit for ``request`` (``hit_tokens``; the handle pins it)."""
        raise NotImplementedError

    def kv_chunks(self, lookup: Lookup) -> int:
        raise NotImplementedError

    def store(
        self, request: Request, lookup: Lookup, states: list[int], now: float
    ) -> int:
        """Write the prompt's KV and the states at token positions ``states``; returns
        the bytes written."""
        raise NotImplementedError

    def used_bytes(self) -> int:
        raise NotImplementedError


class HiStateShared(SharedStore):
    """The HiState core over one ``shared`` tier of ``capacity`` bytes: its own residence
    times, pressure factor and ``τ`` decide what leaves (one budget for the fleet)."""

    def __init__(self, policy: HiStatePolicy) -> None:
        if len(policy.tier_names) != 1:
            raise ValueError("the shared tier is one tier")
        self.policy = policy
        self.name = policy.name
        self.capacity = policy.cache.config.tiers[0].capacity

    @classmethod
    def like(cls, node: HiStatePolicy, capacity: int) -> HiStateShared:
        """The core with ``node``'s knobs (``τ``, refresh, intervals, EMAs, cost) over one
        ``shared`` tier of ``capacity`` bytes, ranked by H throughout (no engine pool)."""
        config = replace(
            node.cache.config, tiers=(TierSpec(SHARED, capacity),),
            rules=PlacementRules(kv_tier=0, snapshot_tier=0, final_tier=0),
            recency_tiers=0,
        )
        return cls(HiStatePolicy(SHARED, config))

    def begin(self, request: Request, now: float) -> Lookup:
        return self.policy.begin(request, now)

    def kv_chunks(self, lookup: Lookup) -> int:
        return lookup.handle.match.kv_chunks

    def store(self, request: Request, lookup: Lookup, states: list[int], now: float) -> int:
        """The live rule (``shared_tier.plan.to_shared``): the prompt's KV and, of the
        states, the final one, at the request's end (the plan's last, ``interval``
        invariant)."""
        before = self.policy.counter.written_bytes[SHARED]
        end = states[-1] if states else None
        kept = [s for s in states if to_shared(SNAPSHOT, final=s == end)]
        self.policy.cache.complete(lookup.handle, request.input_tokens, now, boundaries=kept)
        self.policy.drain()
        return self.policy.counter.written_bytes[SHARED] - before

    def used_bytes(self) -> int:
        return self.policy.cache.stats().used_bytes[0]


class LRUShared(SharedStore):
    """One LRU pool of ``capacity`` bytes for KV and states alike (``TieredLRU``): stock
    LMCache's remote L2 (LRU) and Mooncake Store's eviction (approximate LRU, ``sim.fleet``
    module docstring)."""

    def __init__(self, name: str, capacity: int, *, chunk_tokens: int,
                 kv_bytes_per_token: int, snapshot_bytes: int) -> None:
        self.name = name
        self.capacity = capacity
        self.policy = EndStatePolicy(name, TieredLRU(
            chunk_tokens, chunk_tokens * kv_bytes_per_token, snapshot_bytes,
            [PoolSpec(SHARED, capacity)],
        ))

    def begin(self, request: Request, now: float) -> Lookup:
        return self.policy.begin(request, now)

    def kv_chunks(self, lookup: Lookup) -> int:
        return lookup.handle.match.kv_chunks

    def store(self, request: Request, lookup: Lookup, states: list[int], now: float) -> int:
        chunk = self.policy.chunk_tokens
        written = self.policy.engine.admit(lookup.handle, [s // chunk for s in states], now)
        return written.get(SHARED, 0)

    def used_bytes(self) -> int:
        return sum(self.policy.engine.used)


@dataclass(slots=True)
class _Pair:
    """A request's lookups on the node's own tiers and on the shared tier."""

    local: Lookup
    shared: Lookup | None
    from_shared: bool
    shared_bytes: int = 0
    shared_objects: int = 0
    states: list[int] | None = None  # token positions captured (planned when scheduled)


def _fastest(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


class SharedTierNode:
    """One node's engine (``local``: a HiState core or a vLLM/SGLang engine row) over its
    own tiers, plus the fleet's ``shared`` tier (None: local only). Module docstring."""

    def __init__(
        self, name: str, local: Policy, shared: SharedStore | None = None,
        network: NetworkModel | None = None,
    ) -> None:
        if not isinstance(local, HiStatePolicy | EndStatePolicy):
            raise TypeError(f"node engine {type(local).__name__} has no per-chunk tiers")
        self.name = name
        self.local = local
        self.shared = shared
        self.network = network or NetworkModel()
        self.chunk_tokens = (
            local.cache.config.chunk_tokens if isinstance(local, HiStatePolicy)
            else local.chunk_tokens
        )
        self.shared_hits = 0
        self.shared_read_bytes = 0
        self.shared_written_bytes = 0

    # ------------------------------------------------------------ the node's engine
    def _kv_tier_names(self, lookup: Lookup) -> list[str]:
        """The tier of each chunk of the node's own KV match, in prefix order."""
        local = self.local
        if isinstance(local, HiStatePolicy):
            names = local.tier_names
            return [names[_fastest(n.kv_tiers)] for n in lookup.handle.pinned]
        handle: UseHandle = lookup.handle
        engine = local.engine
        return [engine.tier_names[engine.tier(n, KV)] for n in handle.kv_nodes]

    def _floor(self, request: Request, pair: _Pair) -> None:
        """A hit from the shared tier: the engine's plan keeps no state below it (the
        node did not compute there)."""
        if not pair.from_shared or isinstance(self.local, HiStatePolicy):
            return
        handle: UseHandle = pair.local.handle
        hit = pair.shared.hit_tokens // self.chunk_tokens if pair.shared else 0
        plan: StatePlan = handle.plan
        mid = [c for c in plan.mid if c > hit]
        handle.plan = StatePlan(plan.final, mid, min(plan.splits, len(mid)))

    def _states(self, request: Request, pair: _Pair) -> list[int]:
        """Token positions of the states the node captures for this request: planned
        when it is scheduled (``capture``), as the engine must know them then."""
        if pair.states is None:
            local = self.local
            if isinstance(local, HiStatePolicy):
                pair.states = local.plan(request, pair.local.handle, self._resumed_chunks(pair))
            else:
                pair.states = [c * self.chunk_tokens for c in pair.local.handle.plan.chunks]
        return pair.states

    def _resumed_chunks(self, pair: _Pair) -> int | None:
        if not pair.from_shared or pair.shared is None:
            return None
        return pair.shared.hit_tokens // self.chunk_tokens

    # ------------------------------------------------------------------- Policy
    def begin(self, request: Request, now: float) -> Lookup:
        local = self.local.begin(request, now)
        if self.shared is None:
            return Lookup(local.hit_tokens, dict(local.load_bytes), _Pair(local, None, False))
        shared = self.shared.begin(request, now)
        if shared.hit_tokens <= local.hit_tokens:
            pair = _Pair(local, shared, False)
            self._floor(request, pair)
            return Lookup(local.hit_tokens, dict(local.load_bytes), pair)
        # Resume from the shared tier: own KV where the node holds it, the rest and the
        # snapshot over the network.
        hit = shared.hit_tokens // self.chunk_tokens
        own = self._kv_tier_names(local)[:hit]
        kv_bytes = self._kv_chunk_bytes()
        loads: Counter[str] = Counter()
        for tier in own:
            loads[tier] += kv_bytes
        remote = hit - len(own)
        shared_bytes = remote * kv_bytes + self._snapshot_bytes()
        loads[SHARED] += shared_bytes
        pair = _Pair(local, shared, True, shared_bytes, remote + 1)
        self._floor(request, pair)
        self.shared_hits += 1
        self.shared_read_bytes += shared_bytes
        return Lookup(shared.hit_tokens, dict(loads), pair)

    def _kv_chunk_bytes(self) -> int:
        local = self.local
        if isinstance(local, HiStatePolicy):
            return local.cache.config.kv_chunk_bytes
        return local.engine.sizes[0]

    def _snapshot_bytes(self) -> int:
        local = self.local
        if isinstance(local, HiStatePolicy):
            return local.cache.config.snapshot_bytes
        return local.engine.sizes[1]

    def load_time(self, lookup: Lookup) -> float:
        """Seconds to read what ``lookup``'s shared part reads over the network."""
        pair: _Pair = lookup.handle
        return self.network.read_time(pair.shared_bytes, pair.shared_objects)

    def local_loads(self, lookup: Lookup) -> dict[str, int]:
        """``lookup.load_bytes`` without the shared tier's (priced by ``load_time``)."""
        return {k: v for k, v in lookup.load_bytes.items() if k != SHARED}

    def capture(self, request: Request, lookup: Lookup) -> Capture:
        pair: _Pair = lookup.handle
        if isinstance(self.local, HiStatePolicy):
            plan = self._states(request, pair)
            hit = lookup.hit_tokens
            return Capture(step_ends=tuple(b - hit for b in plan[:-1] if b > hit),
                           host_states=max(0, len(plan) - 1))
        return capture_of(self.local, request, pair.local)

    def complete(self, request: Request, lookup: Lookup, now: float) -> dict[str, int]:
        pair: _Pair = lookup.handle
        states = self._states(request, pair)
        if isinstance(self.local, HiStatePolicy):
            written = self.local.complete(request, pair.local, now, self._resumed_chunks(pair))
        else:
            written = self.local.complete(request, pair.local, now)
        if self.shared is not None and pair.shared is not None:
            nbytes = self.shared.store(request, pair.shared, states, now)
            self.shared_written_bytes += nbytes
            if nbytes:
                written = {**written, SHARED: nbytes}
        return written

    def capacity_bytes(self) -> float:
        """The node's own tiers (the shared tier is counted once, by the fleet)."""
        local = self.local
        if isinstance(local, HiStatePolicy):
            return float(sum(t.capacity for t in local.cache.config.tiers))
        return float(local.capacity_bytes())

    def stats(self) -> dict[str, float]:
        out = dict(self.local.stats())
        out["shared_hits"] = float(self.shared_hits)
        out["shared_read_bytes"] = float(self.shared_read_bytes)
        out["shared_written_bytes"] = float(self.shared_written_bytes)
        return out

