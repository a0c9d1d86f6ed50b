"""``HiStateCache``: the policy core as one object, driven by the simulator and the server.

It owns and wires the parts: the prefix index (``index``), the eviction queue (``eviction``,
ranked by ``score`` over the hit model of ``units``), the tiered store (``placement``), the
interval controller and residence tracker (``interval``) and the re-access scale
(``score``). A request's life (``begin`` → ``promote`` → ``complete`` / ``release``) is the
algorithm of ``request_path.RequestPath``, which the facade owns and delegates to; this
module holds the wiring, the queries and the live-server hooks.

Everything is deterministic given the call sequence and the ``now`` values: the clock is
the caller's (simulated time in the simulator, wall time in the server).

This object is the only way into the core: its index, eviction queue, tiered store and
interval controller are private. Its verbs, by who calls them:

* the simulator and the server: the request life ``begin`` → ``promote`` → ``complete`` /
  ``release``, the plan ``snapshot_plan``, ``stats``, and ``check`` (the invariants,
  O(n)); reads for inspection: ``lookup`` (what would hit, changing nothing), ``node`` /
  ``nodes``, ``tiers_of``;
* the live server, which sees chains of chunk keys and outside changes rather than a
  simulator's whole requests: ``attach`` (a store no lookup announced), ``session_for`` /
  ``has_session`` / ``session_end`` / ``drop_session``, ``note_internal_access``,
  ``holds_kv_prefix``, ``lose``, ``adopt``, ``evict``, ``rerank``, ``set_capacity``,
  ``set_step_grid`` / ``step_grid``, ``interval_for``;
* a deployment that shares its last tier: ``eviction_inputs``, ``follow_residence``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace

from .cache_types import (
    CacheConfig,
    CacheStats,
    RequestHandle,
    check_step_price,
    check_step_tokens,
)
from .eviction import EvictionQueue
from .hit_positions import HitPositions
from .index import Match, Node, PrefixIndex
from .interval import IntervalController, ResidenceTracker, supported_intervals
from .placement import TieredStore
from .request_path import RequestPath
from .score import ReaccessScale, ReturnScale
from .tiers import KV, PlacementListener, TierSpec
from .units import HitModel

__all__ = ["CacheConfig", "CacheStats", "HiStateCache", "RequestHandle"]


class HiStateCache:
    """Index + eviction queue + placement + interval controller, wired together."""

    def __init__(self, config: CacheConfig, listener: PlacementListener | None = None) -> None:
        self.config = config
        self._index = PrefixIndex(config.chunk_tokens)
        self._positions = HitPositions() if config.hit_positions == "measured" else None
        self._hit_model = HitModel(config.ema_alpha, config.end_probability_prior)
        self._residence = ResidenceTracker(config.ema_alpha, config.initial_pressure_factor)
        self._reaccess = (
            ReturnScale(config.ema_alpha, self._index.sessions)
            if config.return_tau
            else ReaccessScale(config.ema_alpha)
        )
        self._queue = EvictionQueue(
            self._index,
            len(config.tiers),
            tau=config.tau,
            token_bytes=config.token_bytes,
            hit_model=self._hit_model,
            reaccess=self._reaccess,
            refresh_all=config.refresh_all,
            refresh_used=config.refresh_used,
            refresh_learned=config.refresh_learned,
            exposed_ends=config.exposed_ends,
            attention_tokens=config.attention_tokens,
            positions=self._positions,
            recency_tiers=config.recency_tiers,
        )
        if isinstance(self._reaccess, ReturnScale):
            self._reaccess.dwell = self._queue.dwell  # ``score`` NOTE 4's ``D``
        self._store = TieredStore(
            self._index, self._queue, config.tiers, config.rules, self._residence, listener
        )
        self._interval = IntervalController(
            config.chunk_tokens,
            config.snapshot_tokens,
            config.supported_intervals
            or supported_intervals(config.chunk_tokens, config.max_interval_chunks),
            self._residence,
            step_tokens=config.step_tokens,
            step_price=config.step_price,
            hits=self._hit_model,
        )
        self._requests = RequestPath(
            config,
            self._index,
            self._queue,
            self._store,
            self._interval,
            self._hit_model,
            self._reaccess,
            self._positions,
        )

    # ---------------------------------------------------------------- queries
    def lookup(self, keys: Sequence[int]) -> Match:
        """Pure: how much of ``keys`` would hit right now."""
        return self._index.match(keys)

    def snapshot_plan(
        self,
        start_tokens: int,
        input_tokens: int,
        kind: Hashable = None,
        segment_start: int | None = None,
    ) -> list[int]:
        """Token positions at which to save states for a span ``[start, input)`` whose new
        input (content ``kind``, None: unknown) starts at ``segment_start`` (a handle's;
        None: the whole span is new)."""
        return self._requests.snapshot_plan(start_tokens, input_tokens, kind, segment_start)

    def session_for(self, keys: Sequence[int]) -> str | None:
        """The session a chain continues: one whose end lies on it (deepest first).

        The live server sees no session ids, only chains of chunk keys; a request whose
        chain passes through a session's end continues that session.
        """
        for node in reversed(self._index.walk(keys)):
            if node.ends:
                return min(s.id for s in node.ends)
        return None

    def node(self, key: int) -> Node | None:
        """The chunk node of ``key`` (read-only: inspect, never mutate), or None."""
        return self._index.get(key)

    def nodes(self) -> list[Node]:
        """Every chunk node in the index (read-only)."""
        return list(self._index.nodes.values())

    def __contains__(self, key: object) -> bool:
        return key in self._index.nodes

    def has_session(self, session_id: str) -> bool:
        return session_id in self._index.sessions

    def session_end(self, session_id: str) -> int | None:
        """The key of the chunk a session ends at (None: unknown session, or at the root)."""
        session = self._index.sessions.get(session_id)
        return None if session is None or session.node.depth < 0 else session.node.key

    def tiers_of(self, key: int, part: str) -> int:
        """Bitmask of the tiers holding ``part`` (``KV`` / ``SNAPSHOT``) of ``key``; 0 if none."""
        node = self._index.get(key)
        if node is None:
            return 0
        return node.kv_tiers if part == KV else node.snap_tiers

    def holds_kv_prefix(self, keys: Sequence[int]) -> bool:
        """Whether every chunk of the chain ``keys`` has its KV cached somewhere."""
        path = self._index.walk(keys)
        return len(path) == len(keys) and all(n.kv_tiers for n in path)

    def set_step_grid(self, step_tokens: int | None, step_price: float | None = None) -> None:
        """Plan on the engine's step grid ``step_tokens`` from now on (None: unknown), as
        ``CacheConfig.step_tokens``, with each extra step end priced ``step_price`` tokens
        (``CacheConfig.step_price``; None keeps the current price); the live server calls
        it with what each plan request reports, since only the engine knows its step budget
        and measures its step time. Both are checked before either changes."""
        step_tokens = check_step_tokens(step_tokens, self.config.chunk_tokens)
        if step_price is not None:
            self._interval.step_price = check_step_price(step_price)
        self._interval.step_tokens = step_tokens

    @property
    def step_grid(self) -> int | None:
        """The step grid the interval controller plans on (``set_step_grid``)."""
        return self._interval.step_tokens

    def interval_for(self, segment_tokens: int) -> int:
        """The snapshot interval the controller would choose for a segment of this length."""
        return self._interval.choose(segment_tokens).interval

    def stats(self) -> CacheStats:
        """Occupancy and the learned state (fields: ``CacheStats``), for reports, the
        simulator's rows and the live server's eviction sweeps."""
        store, queue, reaccess, positions = self._store, self._queue, self._reaccess, \
            self._positions
        return CacheStats(
            nodes=len(self._index),
            sessions=len(self._index.sessions),
            used_bytes=tuple(store.used),
            capacity_bytes=tuple(t.capacity for t in store.tiers),
            pressure_factor=self._interval.pressure_factor,
            end_probability=self._hit_model.end_probability,
            hit_samples=self._hit_model.samples,
            tau_s=float(queue.tau),
            tau_calibrated=queue.fixed_tau is None,
            reaccess_gap_s=float(reaccess.gap_ema),
            reaccess_samples=int(reaccess.samples),
            kv_residence_s=self._residence.kv_ema,
            snapshot_residence_s=self._residence.snapshot_ema,
            dropped_units=store.dropped_units,
            hit_position_samples=None if positions is None else positions.samples,
            hit_position_spread=None if positions is None else positions.spread(),
            step_tokens=self._interval.step_tokens,
            step_price=self._interval.step_price,
            dwell_s=tuple(d.value for d in queue.dwell) if queue.exposed_ends else None,
        )

    # --------------------------------------------------------------- requests
    # The algorithm is ``request_path.RequestPath``'s; see there.
    def begin(
        self, session_id: str, keys: Sequence[int], now: float, kind: Hashable = None
    ) -> RequestHandle:
        """Match, sample, refresh and pin a request's prompt whose new input is of
        content ``kind`` (None: unknown) (``RequestPath.begin``)."""
        return self._requests.begin(session_id, keys, now, kind)

    def complete(
        self,
        handle: RequestHandle,
        input_tokens: int,
        now: float,
        boundaries: Sequence[int] | None = None,
    ) -> tuple[int, int]:
        """Store what the request computed; returns ``(kv chunks, snapshots)`` stored
        (``RequestPath.complete``)."""
        return self._requests.complete(handle, input_tokens, now, boundaries)

    def promote(self, handle: RequestHandle, tier: int, now: float) -> int:
        """Move the prompt's cached KV and resumed snapshot to ``tier``; returns the bytes
        moved (``RequestPath.promote``)."""
        return self._requests.promote(handle, tier, now)

    def release(self, handle: RequestHandle) -> None:
        """Unpin a request's path without storing (``RequestPath.release``)."""
        self._requests.release(handle)

    # ------------------------------------------------------- live-server hooks
    def attach(self, session_id: str, keys: Sequence[int]) -> RequestHandle:
        """A handle to ``complete`` a request whose ``begin`` was never seen.

        The live server sees stores that no lookup announced (an engine storing a
        prefix it computed from scratch, or the later stores of a chunked prefill).
        Such a handle refreshes nothing, samples nothing for the hit model and pins
        nothing: the access, if any, was already accounted for by its lookup.
        """
        keys = tuple(keys)
        return RequestHandle(session_id, keys, self._index.match(keys), [], None)

    def lose(self, key: int, part: str, tier: int) -> None:
        """An object vanished from ``tier`` without the policy deciding it.

        See ``TieredStore.lose``: dependents that can no longer be hit are dropped
        (reported to the listener); unknown keys are ignored.
        """
        node = self._index.get(key)
        if node is not None:
            self._store.lose(node, part, tier)

    def adopt(
        self, keys: Sequence[int], part: str, tier: int, nbytes: int, now: float
    ) -> bool:
        """Register an object found resident on ``tier`` at the end of chain ``keys``.

        Restart recovery: the backend rebuilds the index from what survived on disk,
        parents before children. ``now`` becomes the object's last access. Refused
        (False, nothing changed) where ``TieredStore.adopt`` refuses.
        """
        if not keys:
            return False
        nodes = self._index.insert_chain(keys)
        node = nodes[-1]
        ok = self._store.adopt(node, part, tier, nbytes, now)
        if not ok:
            self._index.prune(node)
        return ok

    def note_internal_access(self) -> None:
        """A lookup matched cached context without passing any session's end (live server:
        a rewrite or a shared prefix): one sample "not at an end" for the hit model."""
        self._hit_model.observe(False)

    def evict(self, tier: int, need_bytes: int, now: float) -> int:
        """Push units out of ``tier`` by lowest rank until ``need_bytes`` are freed (or
        nothing more can go); returns the bytes freed. Demoted or dropped as the core
        decides when it makes room (listener events report each move)."""
        store, freed = self._store, 0
        while freed < need_bytes:
            before = store.used[tier]
            found = self._queue.victim(tier)
            if found is None:
                break
            store.evict(found[0], tier, now)
            gain = before - store.used[tier]
            if gain <= 0:
                break
            freed += gain
        return freed

    def rerank(self, keys: Sequence[int]) -> None:
        """Recompute the rank of the units anchored at ``keys`` (unknown keys skipped)."""
        nodes = self._index.nodes
        for key in keys:
            node = nodes.get(key)
            if node is not None:
                self._queue.update(node)

    def set_capacity(self, tier: int, nbytes: int, now: float) -> int:
        """Resize ``tier`` to ``nbytes``, evicting by lowest rank until what it holds fits.

        NOTE 1: units that cannot go (pinned by a request in flight) stay; the capacity is
        then what is held. Returns the capacity in effect.
        """
        store = self._store
        store.tiers = _with_capacity(store.tiers, tier, nbytes)
        store.make_room(tier, 0, now)
        if store.used[tier] > nbytes:
            store.tiers = _with_capacity(store.tiers, tier, store.used[tier])
        return store.tiers[tier].capacity

    def eviction_inputs(self, key: int, part: str, tier: int) -> tuple[float, float, float] | None:
        """``(t, C, M)`` of the unit with which ``part`` of ``key`` leaves ``tier``, as the
        eviction queue ranks it: ``H = score(t, C, M, τ)`` (``C`` in the bytes ``M`` is
        counted in, ``M`` the bytes the unit frees in ``tier``).

        For a deployment whose servers share the last tier (one disk folder, one ranking
        computed elsewhere from these inputs). None when the part is not in ``tier`` or
        leaves it with no unit: interior KV of the last tier, which goes only after every
        unit below it (``units.unit_nodes``).
        """
        node = self._index.get(key)
        if node is None or not (self.tiers_of(key, part) >> tier) & 1:
            return None
        anchor = node
        if part == KV:  # the anchor is the KV leaf (or snapshot) the segment runs down to
            while anchor.kv_children == 1 and not anchor.snap_tiers:
                anchor = next(c for c in anchor.children.values() if c.kv_tiers)
            if anchor.kv_children and tier == len(self.config.tiers) - 1:
                return None  # an intermediate snapshot leaves the last tier alone
        found = self._queue.inputs(anchor, tier)
        if found is None:
            return None
        access, cost, freed = found
        return access, cost, float(freed)

    def follow_residence(
        self, kv_s: float, kv_samples: int, snapshot_s: float, snapshot_samples: int
    ) -> float:
        """Make the interval controller plan with these residence-time EMAs (a
        deployment's, pooled over servers that share a tier) instead of this core's own;
        eviction keeps feeding the core's own tracker. Returns the pressure factor in
        effect: ``kv_s / snapshot_s`` once both have samples (``ResidenceTracker``)."""
        pooled = ResidenceTracker(self.config.ema_alpha, self.config.initial_pressure_factor)
        pooled.kv_ema, pooled.kv_samples = float(kv_s), int(kv_samples)
        pooled.snapshot_ema, pooled.snapshot_samples = float(snapshot_s), int(snapshot_samples)
        self._interval.residence = pooled
        return self._interval.pressure_factor

    def drop_session(self, sid: str) -> None:
        """Forget session ``sid`` (its end marker; what it stored stays cached): the live
        server's idle expiry. Unknown ids are ignored."""
        self._index.drop_session(sid)

    def check(self) -> None:
        self._index.check()
        self._store.check()
        self._queue.check()


def _with_capacity(tiers: tuple[TierSpec, ...], tier: int, nbytes: int) -> tuple[TierSpec, ...]:
    return tuple(
        replace(spec, capacity=nbytes) if t == tier else spec for t, spec in enumerate(tiers)
    )
