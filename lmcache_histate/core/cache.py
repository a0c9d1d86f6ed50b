"""``HiStateCache``: the policy core as one object, driven by the simulator and the server.

It owns and wires the parts: the prefix index (``index``), the eviction queue (``eviction``,
ranked by ``H`` over the hit model, ``rank``), the tiered store (``placement``), the
interval controller and residence tracker (``interval``) and the re-access scale
(``rank``). It runs a request's life itself (below), and holds the values that cross the
facade: its configuration (``CacheConfig``, whose defaults are the parts' own, NOTE 2),
a request's handle (``RequestHandle``) and its stats (``CacheStats``).

Everything is deterministic given the call sequence and the ``now`` values: the clock is
the caller's (simulated time in the simulator, wall time in the server).

This object is the only way into the core: its index, eviction queue, tiered store and
interval controller are private. Its verbs, by who calls them:

* the simulator and the server: the request life ``begin`` → ``promote`` → ``complete`` /
  ``release``, the plan ``snapshot_plan``, the placement events ``take_events``, ``stats``,
  and ``check`` (the invariants,
  O(n)); reads for inspection: ``lookup`` (what would hit, changing nothing), ``node`` /
  ``nodes``, ``tiers_of``;
* the live server, which sees chains of chunk keys and outside changes rather than a
  simulator's whole requests: ``attach`` (a store no lookup announced), ``session_for`` /
  ``has_session`` / ``session_end`` / ``drop_session``, ``note_internal_access``,
  ``holds_kv_prefix``, ``lose``, ``recover``, ``evict``, ``rerank``, ``set_capacity``,
  ``set_step_grid`` / ``step_grid``, ``interval_for``;
* a deployment that shares its last tier: ``eviction_inputs``, ``follow_residence``.

**A request's life: ``begin`` → (``promote``) → ``complete`` / ``release``.**

1. ``begin(session, keys, now)`` matches the prompt against the index, samples the
   hit-position model (did the access continue the session from its end? if not, where
   in its segment did it leave the context: ``hit_positions``) and the
   session's re-access gap (for the score's ``τ``), refreshes the hit prefix
   (refresh-all), and pins the KV prefix the engine is about to load.
2. ``promote(handle, tier, now)`` (simulator only) moves what the request loaded up to a
   faster tier, prefix first, while the pins keep it from being evicted.
3. ``complete(handle, input_tokens, now)`` refreshes the hit prefix again (NOTE 1),
   unpins, stores the KV of every chunk not cached (again), moves the session's end to
   the new tail, stores the snapshots of the segment's plan (``snapshot_plan``: the
   interval controller's boundaries, or a fixed interval; placed by the measured hit
   positions of the request's content kind), final one first, re-ranks the new chain
   once, and retires the session's previous final snapshot to the snapshot tier.
4. ``release(handle)`` unpins without storing, pruning nodes that lost their content
   while pinned.

Invariants kept: pins taken by ``begin`` are released exactly once (``complete`` calls
``release``); KV is stored prefix-first, so a chain that stops storing stops at a prefix;
the session's end is moved before the new snapshots are ranked (their cost depends on the
sessions through them). Deterministic given the call sequence and the ``now`` values.

NOTE 1 (recency counts from release). A request holds what it hit from ``begin`` to
``complete`` (pinned: nothing of it can be evicted meanwhile), so the time it last
*used* its prefix is its completion, which is where the engines put it too: vLLM frees a
finished request's blocks to the tail of its free queue (``v1/core/block_pool.py``
``free_blocks``), and the LRU rows here re-queue a prompt when it is admitted
(``sim/baselines/tiered_lru.py``). Refreshed only at ``begin``, a prefix that waited
behind a long prefill (minutes, for a 500K-token prompt under load) came out of it as
the oldest thing in the cache: on the whole Weka folder at 1/8 of the paper's CPU+disk a
session's hit prefix, snapshots first, left within seconds of the request finishing,
and with them the whole context (``benchmarks/sim_eviction.md``).

NOTE 2 (defaults). ``CacheConfig``'s field defaults are the core's knob defaults, written
once, by the parts that use them (``ema.DEFAULT_ALPHA``, ``rank.END_PROBABILITY_PRIOR``,
``interval``'s ``INITIAL_PRESSURE_FACTOR`` and ``MAX_INTERVAL_CHUNKS``): the parts take
them as their own defaults without importing this module, which imports them (no cycle);
the server and simulator schemas read them through ``config_default``. Invariants of
those defaults: ``0 < ema_alpha <= 1`` (``ema.check_alpha``), ``0 <=
end_probability_prior <= 1`` (``rank.HitModel``), ``max_interval_chunks >= 1``
(``CacheConfig.__post_init__``).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

from .ema import DEFAULT_ALPHA
from .eviction import EvictionQueue
from .hit_positions import HitPositions
from .index import Match, Node, PrefixIndex, Session
from .interval import (
    INITIAL_PRESSURE_FACTOR,
    MAX_INTERVAL_CHUNKS,
    IntervalController,
    ResidenceTracker,
    check_step_price,
    check_step_tokens,
    supported_intervals,
)
from .model_geometry import snapshot_tokens
from .placement import PlacementEvent, TieredStore
from .rank import END_PROBABILITY_PRIOR, HitModel, ReaccessScale, ReturnScale
from .tiers import KV, SNAPSHOT, PlacementRules, TierSpec

__all__ = [
    "HIT_POSITION_MODES",
    "CacheConfig",
    "CacheStats",
    "HiStateCache",
    "PlacementEvent",
    "RequestHandle",
    "check_step_price",
    "check_step_tokens",
    "config_default",
]

HIT_POSITION_MODES = ("measured", "uniform")
"""Values of ``CacheConfig.hit_positions``: learned online, or the paper's uniform model."""


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Sizes and knobs of one cache instance.

    ``kv_chunk_bytes``: KV bytes of one chunk (chunk tokens × KV bytes per token);
    ``snapshot_bytes``: one recurrent-state snapshot. ``tau``: None calibrates the
    score's recency scale online (the design, ``rank``); a number in seconds fixes it
    (0 = LRU over units). ``refresh_used``: an intermediate snapshot's unit ranks by
    when its snapshot was last resumed from, not by when the prefix through it was
    refreshed (``eviction`` NOTE 6). ``refresh_learned``: by ``used + w·(access − used)``,
    ``w`` the measured resume rate of snapshots last refreshed by a pass over that of
    those last used (``eviction`` NOTE 8). ``exposed_ends`` (the design, on by default: the
    simulator's HiState rows and the live server run it): a snapshot's ``C`` counts the end
    hits of a session whose tail below it is in a tier above the last weighted by the
    chance that the tail has left the cache when the session returns (``eviction`` NOTE
    7; off: the paper's pricing, every passing session in full, the ``histate-paper``
    row). ``return_tau``: the calibrated ``τ`` is fitted to whether a session idle as long
    as the tiers' dwell returns, not to the mean gap (``rank`` NOTE 7; needs
    ``exposed_ends``, which measures the dwell: without it ``τ`` stays the mean gap).
    ``attention_tokens``: the context length at which causal attention costs as much per
    recomputed token as the rest of the prefill (linear cost ÷ attention cost per token
    pair; ``inf``: cost in tokens only, ``rank``).
    ``ema_alpha``: the weight of the newest sample in every EMA of the core (residence
    times, ``p_end``, re-access gap); ``end_probability_prior``: ``p_end`` before any access
    was seen. ``max_interval_chunks``: without ``supported_intervals``, the interval
    controller offers every multiple of the chunk up to this many chunks.
    ``fixed_interval`` (tokens) replaces the controller's choice, for
    baselines and ablations; 0 saves only each segment's final snapshot.
    ``hit_positions``: ``"uniform"`` (default) is the paper's model; ``"measured"`` learns
    where internal hits land inside segments and uses it for ``C`` and for placing
    interval snapshots (``hit_positions``; off by default: it lost mean and p99 on the
    whole Weka folder under pressure, ``benchmarks/sim_eviction.md``).
    ``recency_tiers``: how many leading tiers are the engine's own block pool, which
    ranks by recency alone (vLLM's prefix cache is LRU); the simulator's GPU tier is
    one, the live server has none. Every other tier ranks by ``H`` (``rank`` NOTE 6).
    ``initial_pressure_factor``: the interval controller's pressure factor until a
    snapshot has left the cache (0: storage is free, ``interval`` NOTE 2).
    ``step_tokens``: the engine's step grid ``B`` (its prefill step budget rounded down to
    whole chunks; None: unknown), where a planned state costs no extra step end: at
    pressure factor 0 the plan keeps states on that grid only (``interval`` NOTE 2); the
    live server learns it from each plan request (``HiStateCache.set_step_grid``).
    ``step_price``: one extra step end's fixed time in tokens of prefill time (``σ``,
    ``interval``), 0: step ends are priced only at pressure factor 0; the live server
    learns it from the plan requests of an engine that measures it (``set_step_grid``).
    """

    chunk_tokens: int
    kv_chunk_bytes: int
    snapshot_bytes: int
    tiers: tuple[TierSpec, ...]
    rules: PlacementRules = field(default_factory=PlacementRules)
    tau: float | None = None
    refresh_all: bool = True
    refresh_used: bool = False
    refresh_learned: bool = False
    exposed_ends: bool = True
    return_tau: bool = False
    supported_intervals: tuple[int, ...] | None = None
    max_interval_chunks: int = MAX_INTERVAL_CHUNKS
    ema_alpha: float = DEFAULT_ALPHA
    end_probability_prior: float = END_PROBABILITY_PRIOR
    initial_pressure_factor: float = INITIAL_PRESSURE_FACTOR
    fixed_interval: int | None = None
    attention_tokens: float = math.inf
    hit_positions: str = "uniform"
    recency_tiers: int = 0
    step_tokens: int | None = None
    step_price: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.recency_tiers < len(self.tiers):
            raise ValueError(
                f"recency_tiers must be in [0, {len(self.tiers) - 1}] (the last tier always "
                f"ranks by H), got {self.recency_tiers}"
            )
        if self.hit_positions not in HIT_POSITION_MODES:
            raise ValueError(
                f"hit_positions must be one of {', '.join(HIT_POSITION_MODES)}, "
                f"got {self.hit_positions!r}"
            )
        for name in ("chunk_tokens", "kv_chunk_bytes", "snapshot_bytes", "max_interval_chunks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.initial_pressure_factor < math.inf:
            raise ValueError(
                f"initial_pressure_factor must be a finite number ≥ 0, "
                f"got {self.initial_pressure_factor}"
            )
        if not self.attention_tokens > 0:
            raise ValueError(f"attention_tokens must be positive, got {self.attention_tokens}")
        check_step_tokens(self.step_tokens, self.chunk_tokens)
        check_step_price(self.step_price)
        if self.fixed_interval is not None and (
            self.fixed_interval < 0 or self.fixed_interval % self.chunk_tokens
        ):
            raise ValueError(
                f"fixed_interval must be 0 or a multiple of chunk_tokens "
                f"({self.chunk_tokens}), got {self.fixed_interval}"
            )

    @property
    def token_bytes(self) -> int:
        return max(1, self.kv_chunk_bytes // self.chunk_tokens)

    @property
    def snapshot_tokens(self) -> float:
        """``N_s``: one snapshot in KV-token units (of whole KV bytes per token)."""
        return snapshot_tokens(self.snapshot_bytes, self.token_bytes)


def config_default(name: str) -> Any:
    """``CacheConfig``'s default value of the knob ``name`` (NOTE 2).

    NOTE 4: read through ``dataclasses.fields``: with ``slots=True`` a field's class
    attribute is its slot descriptor, not its default.
    """
    for f in fields(CacheConfig):
        if f.name == name and f.default is not MISSING:
            return f.default
    raise KeyError(f"CacheConfig has no knob {name!r} with a default value")


@dataclass(frozen=True, slots=True)
class CacheStats:
    """The core's learned state and occupancy at one instant (``HiStateCache.stats``).

    ``used_bytes`` / ``capacity_bytes``: per tier, in the order of ``CacheConfig.tiers``;
    ``tau_s``: the eviction score's recency scale in use (seconds of recency per e-fold of
    expected loss per byte, ``rank``), ``tau_calibrated``: whether it is the online
    estimate (else the configured constant), ``reaccess_gap_s`` / ``reaccess_samples``:
    the session re-access-gap EMA behind the estimate and how many gaps it has seen;
    ``end_probability``: the hit model's ``p_end``; ``kv_residence_s`` /
    ``snapshot_residence_s``: the residence-time EMAs behind ``pressure_factor``;
    ``hit_position_samples`` / ``hit_position_spread``: internal hits placed in their
    segments so far and the spread ``s`` of their distribution (1 = uniform,
    ``hit_positions``), None unless positions are configured ``measured``;
    ``step_tokens`` / ``step_price``: the step grid and step price the interval controller
    plans with (``CacheConfig``, ``HiStateCache.set_step_grid``); ``dwell_s``: per tier, how
    long the units leaving it had sat unread (the EMAs behind ``exposed_ends``' weight,
    ``eviction`` NOTE 7; 0 until one has left), None with ``exposed_ends`` off.
    """

    nodes: int
    sessions: int
    used_bytes: tuple[int, ...]
    capacity_bytes: tuple[int, ...]
    pressure_factor: float
    end_probability: float
    hit_samples: int
    tau_s: float
    tau_calibrated: bool
    reaccess_gap_s: float
    reaccess_samples: int
    kv_residence_s: float
    snapshot_residence_s: float
    dropped_units: int
    hit_position_samples: int | None = None
    hit_position_spread: float | None = None
    step_tokens: int | None = None
    step_price: float = 0.0
    dwell_s: tuple[float, ...] | None = None


@dataclass(slots=True)
class RequestHandle:
    session_id: str
    keys: tuple[int, ...]
    match: Match
    pinned: list[Node]
    at_end: bool | None
    began: float | None = None
    kind: Hashable = None  # content kind of the input the request appends
    segment_start: int | None = None  # where that input starts (tokens; None: unknown)


class HiStateCache:
    """Index + eviction queue + placement + interval controller, wired together."""

    def __init__(self, config: CacheConfig) -> None:
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
            self._reaccess.dwell = self._queue.dwell  # ``rank`` NOTE 7's ``D``
        self._store = TieredStore(
            self._index, self._queue, config.tiers, config.rules, self._residence
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

    # ----------------------------------------------------------------- events
    def take_events(self) -> list[PlacementEvent]:
        """The placement events queued since the last call, oldest first, and an empty
        queue (``placement``, "Events"): what was stored, moved and dropped where. The
        owner drains them after each call that places, evicts or loses anything
        (``complete``, ``release``, ``promote``, ``evict``, ``set_capacity``,
        ``lose``); an owner that never acts on them still drains them, or they
        accumulate."""
        store = self._store
        events, store.events = store.events, []
        return events

    # ---------------------------------------------------------------- queries
    def lookup(self, keys: Sequence[int]) -> Match:
        """Pure: how much of ``keys`` would hit right now."""
        return self._index.match(keys)

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
    # The algorithm of the module docstring's request life.
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
        fixed = self.config.fixed_interval
        if fixed is None:
            return self._interval.boundaries(
                start_tokens,
                input_tokens,
                positions=self._positions,
                kind=kind,
                segment_start=segment_start,
            )
        chunk = self.config.chunk_tokens
        end = input_tokens - input_tokens % chunk
        start = start_tokens - start_tokens % chunk
        if end <= start:
            return []
        points = list(range(start + fixed, end, fixed)) if fixed else []
        return [*points, end]

    def begin(
        self, session_id: str, keys: Sequence[int], now: float, kind: Hashable = None
    ) -> RequestHandle:
        """Match, sample, refresh and pin a request's prompt whose new input is of
        content ``kind`` (None: unknown) (module docstring, step 1)."""
        keys = tuple(keys)
        path = self._index.walk(keys)
        match = self._index.match_path(path)
        session = self._index.sessions.get(session_id)
        at_end: bool | None = None
        segment_start = 0
        if session is not None:
            end = session.node
            at_end = end.depth < 0 or (end.depth < len(path) and path[end.depth] is end)
            self._hit_model.observe(at_end)
            if not at_end and self._positions is not None:
                self._observe_divergence(session, end, path, self._positions)
            segment_start = session.segments.end
            last, session.last_access = session.last_access, now
            if last is not None:
                # After the update: this session is no longer idle (``rank`` NOTE 7).
                self._reaccess.observe_at(now - last, now)
        self._queue.touch(path, match.hit_chunks, now)
        pinned = path[: match.kv_chunks]
        for node in pinned:
            node.pins += 1
        return RequestHandle(session_id, keys, match, pinned, at_end, now, kind, segment_start)

    def _observe_divergence(
        self, session: Session, end: Node, path: Sequence[Node], positions: HitPositions
    ) -> None:
        """An internal access: record where it left the session's context, relative to
        the segment it falls in (``hit_positions``), and forget the context after it.

        The divergence is the deepest common node of the prompt's path and the session's
        chain (found walking up from the session's end: O(depth), like ``walk``).
        """
        node: Node | None = end
        while node is not None and node.depth >= 0 and (
            node.depth >= len(path) or path[node.depth] is not node
        ):
            node = node.parent
        common = (node.depth + 1 if node is not None else 0) * self.config.chunk_tokens
        where = session.segments.locate(common)
        if where is not None:
            positions.observe(*where)
        session.segments.cut(common)

    def complete(
        self,
        handle: RequestHandle,
        input_tokens: int,
        now: float,
        boundaries: Sequence[int] | None = None,
    ) -> tuple[int, int]:
        """Store what the request computed; returns ``(kv chunks, snapshots)`` stored.

        The engine has finished loading by now, so the request's pins are released first:
        what it read may be moved or evicted to make room for what it computed.
        """
        chunk = self.config.chunk_tokens
        # The hit counts as read when the engine releases it (NOTE 1); a handle that
        # pinned nothing (``attach``) refreshes nothing.
        self._queue.touch(
            handle.pinned, min(handle.match.hit_chunks, len(handle.pinned)), now, sample=False
        )
        self.release(handle)
        nodes = self._index.insert_chain(handle.keys[: input_tokens // chunk])
        # Other requests may have evicted part of the matched prefix since ``begin``: the
        # engine computed (or loaded) those chunks anyway, so they are stored again.
        start = 0
        while start < len(nodes) and nodes[start].kv_tiers:
            start += 1
        stored_kv = start
        for node in nodes[start:]:
            if not self._store.store_kv(node, self.config.kv_chunk_bytes, now, rerank=False):
                break
            stored_kv += 1
        if stored_kv < len(nodes):
            self._index.prune(nodes[-1])
        # The session moves before the new snapshots are ranked: their cost depends on
        # the hit density of the sessions through them (``index`` ``weight``), which
        # moving the session changes along its whole path.
        old_end = self._move_session(handle, nodes, stored_kv, input_tokens)
        self._index.sessions[handle.session_id].segments.append(input_tokens, handle.kind)
        # A chain may stop short of ``input_tokens`` (a trace that hashes fewer chunks):
        # the plan must end on the chain, or its final snapshot would have no node.
        plan = (
            list(boundaries)
            if boundaries is not None
            else self.snapshot_plan(
                handle.match.kv_chunks * chunk,
                min(input_tokens, len(nodes) * chunk),
                handle.kind,
                handle.segment_start,
            )
        )
        snaps = 0
        if stored_kv:
            # The new tail is pinned while its snapshots are placed, so that placing one
            # cannot evict the KV it belongs to; the final one goes first: it is always
            # kept, the intermediate ones compete for what room is left.
            leaf = nodes[stored_kv - 1]
            leaf.pins += 1
            try:
                segments = self._index.sessions[handle.session_id].segments
                for pos in reversed(plan):
                    i = pos // chunk - 1
                    if 0 <= i < stored_kv and not nodes[i].snap_tiers:
                        nodes[i].seg_offset = segments.boundary(pos)
                        snaps += self._store.store_snapshot(
                            nodes[i], self.config.snapshot_bytes, now, final=pos == plan[-1]
                        )
            finally:
                leaf.pins -= 1
        if stored_kv > start:
            # One re-ranking pass for the chain stored without it: the parent side of the
            # first new chunk (its old tail changed), then every new chunk once (evictions
            # during the stores may have queued some of them as leaves they no longer are).
            self._queue.update_around(nodes[start])
            for node in nodes[start:stored_kv]:
                self._queue.update(node)
            self._queue.deferred = False  # every unit the stores changed is re-ranked
        self._retire(old_end, nodes[stored_kv - 1] if stored_kv else None, now)
        return stored_kv - start, snaps

    def promote(self, handle: RequestHandle, tier: int, now: float) -> int:
        """Move the prompt's cached KV (prefix first) and its resumed snapshot to ``tier``.

        Called between ``begin`` and ``complete``, while the request still pins its path,
        so making room cannot evict what is being promoted; stops at the first object that
        does not fit. Returns the bytes moved. (The simulator's model of vLLM keeping what
        a request loaded in its GPU pool, ``sim/policy.py``.)
        """
        store, queue = self._store, self._queue
        bit = 1 << tier
        hit = handle.match.hit_node
        moved: list[Node] = []
        nbytes = 0
        for node in handle.pinned:
            if not node.kv_tiers:
                break  # evicted since begin: complete() stores it again
            if node.kv_tiers & bit:
                continue
            if not store.promote(node, KV, tier, now, rerank=False):
                break
            nbytes += node.kv_bytes
            moved.append(node)
        if (
            hit is not None
            and hit.snap_tiers
            and not hit.snap_tiers & bit
            and hit.kv_tiers & bit
            and store.promote(hit, SNAPSHOT, tier, now, rerank=False)
        ):
            nbytes += hit.snap_bytes
            moved.append(hit)
        if moved:
            # Units whose per-tier bytes changed: anchors on the path, and the zone
            # below its deepest promoted node (tails running through it).
            for node in handle.pinned:
                if node.snap_tiers or not node.kv_children:
                    queue.update(node)
            queue.update_around(moved[-1])
            queue.deferred = False  # every unit the moves changed is re-ranked
        return nbytes

    def release(self, handle: RequestHandle) -> None:
        """Unpin a request's path without storing (module docstring, step 4); a final
        snapshot whose retirement this read put off moves now (``placement`` NOTE 3)."""
        pinned = handle.pinned
        for node in pinned:
            node.pins -= 1
        # A pinned node whose content was lost meanwhile (``lose``) was kept only for
        # the pin; deepest first, so each prune sees its children already gone. The
        # pins are a chain from the root (``begin``) and KV is prefix-closed, so those
        # nodes are its tail: found from its end instead of testing every node.
        cut = len(pinned)
        while cut and not pinned[cut - 1].kv_tiers:
            cut -= 1
        for node in reversed(pinned[cut:]):
            if not node.pins and node.key in self._index.nodes:
                self._index.prune(node)
        if self._store.retire_later:  # a final retired while this read pinned it
            self._store.retire_pending(pinned)
        handle.pinned = []

    def _move_session(
        self, handle: RequestHandle, nodes: list[Node], stored: int, input_tokens: int
    ) -> Node | None:
        """Point the session at its new end; returns its previous end (or None)."""
        sid = handle.session_id
        old = self._index.sessions.get(sid)
        old_end = old.node if old is not None else None
        end = nodes[stored - 1] if stored else self._index.root
        session = self._index.set_session(sid, end, max(1, input_tokens))
        if session.last_access is None:
            # A session's first request: its access was this handle's ``begin``.
            session.last_access = handle.began
        return old_end

    def _retire(self, old_end: Node | None, end: Node | None, now: float) -> None:
        """The previous end stopped being a final snapshot: retire it, re-rank both."""
        if old_end is not None and old_end is not end and old_end.depth >= 0:
            # Still the end of another session: still somebody's final snapshot.
            if old_end.snap_tiers and old_end.key in self._index.nodes and not old_end.ends:
                self._store.retire_final(old_end, now)
            if self._index.get(old_end.key) is old_end:
                self._queue.update_around(old_end)
        if end is not None and self._index.get(end.key) is end:
            self._queue.update_around(end)

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
        (queued as events, ``take_events``); unknown keys are ignored.
        """
        node = self._index.get(key)
        if node is not None:
            self._store.lose(node, part, tier)

    def recover(
        self, keys: Sequence[int], part: str, tier: int, nbytes: int, now: float
    ) -> bool:
        """Take an object that survived a restart on ``tier``, at the end of chain
        ``keys``, into placement (the core's one meaning of the verb).

        Restart recovery: the backend rebuilds the index from what survived on disk,
        parents before children. ``now`` becomes the object's last access. Refused
        (False, nothing changed) where ``TieredStore.recover`` refuses.
        """
        if not keys:
            return False
        nodes = self._index.insert_chain(keys)
        node = nodes[-1]
        ok = self._store.recover(node, part, tier, nbytes, now)
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
        decides when it makes room (each move queued as an event, ``take_events``)."""
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

        NOTE 3: units that cannot go (pinned by a request in flight) stay; the capacity is
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
        unit below it (``rank.unit_nodes``).
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
