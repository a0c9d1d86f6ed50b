"""``HiStateCache``: the policy core as one object, driven by the simulator and the server.

A request's life in the cache:

1. ``begin(session, chunk_hashes, now)`` matches the prompt, records whether the access
   continued the session from its end (for the hit-position model) and the gap since
   the session's previous access (for the score's ``τ``, ``score``), refreshes the hit
   prefix (refresh-all), and pins what the engine is about to load.
2. ``complete(request, input_tokens, now)`` stores the KV of every newly computed chunk,
   the snapshots the interval controller chose for the new segment (its final one always),
   moves the session's previous final snapshot to the snapshot tier, and unpins.

Everything is deterministic given the call sequence and the ``now`` values: the clock is
the caller's (simulated time in the simulator, wall time in the server).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .eviction import EvictionQueue
from .index import Match, Node, PrefixIndex
from .interval import IntervalController, ResidenceTracker
from .placement import PlacementListener, PlacementRules, TieredStore, TierSpec
from .score import ReaccessScale
from .units import HitModel

__all__ = ["CacheConfig", "HiStateCache", "RequestHandle"]


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Sizes and knobs of one cache instance.

    ``kv_chunk_bytes``: KV bytes of one chunk (chunk tokens × KV bytes per token);
    ``snapshot_bytes``: one recurrent-state snapshot. ``tau``: None calibrates the
    score's recency scale online (the design, ``score``); a number in seconds fixes it
    (0 = LRU over units). ``attention_tokens``: the context length at which causal
    attention costs as much per recomputed token as the rest of the prefill (linear cost
    ÷ attention cost per token pair; ``inf``: cost in tokens only, ``units``).
    ``fixed_interval`` (tokens) replaces the controller's choice, for
    baselines and ablations; 0 saves only each segment's final snapshot.
    """

    chunk_tokens: int
    kv_chunk_bytes: int
    snapshot_bytes: int
    tiers: tuple[TierSpec, ...]
    rules: PlacementRules = field(default_factory=PlacementRules)
    tau: float | None = None
    refresh_all: bool = True
    supported_intervals: tuple[int, ...] | None = None
    ema_alpha: float = 0.05
    end_probability_prior: float = 0.9
    fixed_interval: int | None = None
    attention_tokens: float = math.inf

    def __post_init__(self) -> None:
        for name in ("chunk_tokens", "kv_chunk_bytes", "snapshot_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.attention_tokens > 0:
            raise ValueError(f"attention_tokens must be positive, got {self.attention_tokens}")
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


@dataclass(slots=True)
class RequestHandle:
    session_id: str
    keys: tuple[int, ...]
    match: Match
    pinned: list[Node]
    at_end: bool | None
    began: float | None = None


class HiStateCache:
    """Index + eviction queue + placement + interval controller, wired together."""

    def __init__(self, config: CacheConfig, listener: PlacementListener | None = None) -> None:
        self.config = config
        self.index = PrefixIndex(config.chunk_tokens)
        self.hit_model = HitModel(config.ema_alpha, config.end_probability_prior)
        self.residence = ResidenceTracker(config.ema_alpha)
        self.reaccess = ReaccessScale(config.ema_alpha)
        self.queue = EvictionQueue(
            self.index,
            len(config.tiers),
            tau=config.tau,
            token_bytes=config.token_bytes,
            hit_model=self.hit_model,
            reaccess=self.reaccess,
            refresh_all=config.refresh_all,
            attention_tokens=config.attention_tokens,
        )
        self.store = TieredStore(
            self.index, self.queue, config.tiers, config.rules, self.residence, listener
        )
        self.interval = IntervalController(
            config.chunk_tokens,
            config.snapshot_bytes / config.token_bytes,
            config.supported_intervals,
            self.residence,
        )

    # ---------------------------------------------------------------- queries
    def lookup(self, keys: Sequence[int]) -> Match:
        """Pure: how much of ``keys`` would hit right now."""
        return self.index.match(keys)

    def snapshot_plan(self, start_tokens: int, input_tokens: int) -> list[int]:
        """Token positions at which to save states for a segment ``[start, input)``."""
        fixed = self.config.fixed_interval
        if fixed is None:
            return self.interval.boundaries(start_tokens, input_tokens)
        chunk = self.config.chunk_tokens
        end = input_tokens - input_tokens % chunk
        start = start_tokens - start_tokens % chunk
        if end <= start:
            return []
        points = list(range(start + fixed, end, fixed)) if fixed else []
        return [*points, end]

    def session_for(self, keys: Sequence[int]) -> str | None:
        """The session a chain continues: one whose end lies on it (deepest first).

        The live server sees no session ids, only chains of chunk keys; a request whose
        chain passes through a session's end continues that session.
        """
        for node in reversed(self.index.walk(keys)):
            if node.ends:
                return min(s.id for s in node.ends)
        return None

    # --------------------------------------------------------------- requests
    def begin(self, session_id: str, keys: Sequence[int], now: float) -> RequestHandle:
        keys = tuple(keys)
        path = self.index.walk(keys)
        match = self.index.match_path(path)
        session = self.index.sessions.get(session_id)
        at_end: bool | None = None
        if session is not None:
            end = session.node
            at_end = end.depth < 0 or (end.depth < len(path) and path[end.depth] is end)
            self.hit_model.observe(at_end)
            if session.last_access is not None:
                self.reaccess.observe(now - session.last_access)
            session.last_access = now
        self.queue.touch(path, match.hit_chunks, now)
        pinned = path[: match.kv_chunks]
        for node in pinned:
            node.pins += 1
        return RequestHandle(session_id, keys, match, pinned, at_end, now)

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
        self.release(handle)
        nodes = self.index.insert_chain(handle.keys[: input_tokens // chunk])
        # Other requests may have evicted part of the matched prefix since ``begin``: the
        # engine computed (or loaded) those chunks anyway, so they are stored again.
        start = 0
        while start < len(nodes) and nodes[start].kv_tiers:
            start += 1
        stored_kv = start
        for node in nodes[start:]:
            if not self.store.store_kv(node, self.config.kv_chunk_bytes, now, rerank=False):
                break
            stored_kv += 1
        if stored_kv < len(nodes):
            self.index.prune(nodes[-1])
        # The session moves before the new snapshots are ranked: their cost depends on
        # the hit density of the sessions through them (``index`` ``weight``), which
        # moving the session changes along its whole path.
        old_end = self._move_session(handle, nodes, stored_kv, input_tokens)
        # A chain may stop short of ``input_tokens`` (a trace that hashes fewer chunks):
        # the plan must end on the chain, or its final snapshot would have no node.
        plan = (
            list(boundaries)
            if boundaries is not None
            else self.snapshot_plan(
                handle.match.kv_chunks * chunk, min(input_tokens, len(nodes) * chunk)
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
                for pos in reversed(plan):
                    i = pos // chunk - 1
                    if 0 <= i < stored_kv and not nodes[i].snap_tiers:
                        snaps += self.store.store_snapshot(
                            nodes[i], self.config.snapshot_bytes, now, final=pos == plan[-1]
                        )
            finally:
                leaf.pins -= 1
        if stored_kv > start:
            # One re-ranking pass for the chain stored without it: the parent side of the
            # first new chunk (its old tail changed), then every new chunk once (evictions
            # during the stores may have queued some of them as leaves they no longer are).
            self.queue.update_around(nodes[start])
            for node in nodes[start:stored_kv]:
                self.queue.update(node)
        self._retire(old_end, nodes[stored_kv - 1] if stored_kv else None, now)
        return stored_kv - start, snaps

    def release(self, handle: RequestHandle) -> None:
        lost = []
        for node in handle.pinned:
            node.pins -= 1
            if not node.kv_tiers:
                lost.append(node)
        # A pinned node whose content was lost meanwhile (``lose``) was kept only for
        # the pin; deepest first, so each prune sees its children already gone.
        for node in reversed(lost):
            if not node.pins and node.key in self.index.nodes:
                self.index.prune(node)
        handle.pinned = []

    # ------------------------------------------------------- live-server hooks
    def attach(self, session_id: str, keys: Sequence[int]) -> RequestHandle:
        """A handle to ``complete`` a request whose ``begin`` was never seen.

        The live server sees stores that no lookup announced (an engine storing a
        prefix it computed from scratch, or the later stores of a chunked prefill).
        Such a handle refreshes nothing, samples nothing for the hit model and pins
        nothing: the access, if any, was already accounted for by its lookup.
        """
        keys = tuple(keys)
        return RequestHandle(session_id, keys, self.index.match(keys), [], None)

    def lose(self, key: int, part: str, tier: int) -> None:
        """An object vanished from ``tier`` without the policy deciding it.

        See ``TieredStore.lose``: dependents that can no longer be hit are dropped
        (reported to the listener); unknown keys are ignored.
        """
        node = self.index.get(key)
        if node is not None:
            self.store.lose(node, part, tier)

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
        nodes = self.index.insert_chain(keys)
        node = nodes[-1]
        ok = self.store.adopt(node, part, tier, nbytes, now)
        if not ok:
            self.index.prune(node)
        return ok

    def _move_session(
        self, handle: RequestHandle, nodes: list[Node], stored: int, input_tokens: int
    ) -> Node | None:
        """Point the session at its new end; returns its previous end (or None)."""
        sid = handle.session_id
        old = self.index.sessions.get(sid)
        old_end = old.node if old is not None else None
        end = nodes[stored - 1] if stored else self.index.root
        session = self.index.set_session(sid, end, max(1, input_tokens))
        if session.last_access is None:
            # A session's first request: its access was this handle's ``begin``.
            session.last_access = handle.began
        return old_end

    def _retire(self, old_end: Node | None, end: Node | None, now: float) -> None:
        """The previous end stopped being a final snapshot: retire it, re-rank both."""
        if old_end is not None and old_end is not end and old_end.depth >= 0:
            # Still the end of another session: still somebody's final snapshot.
            if old_end.snap_tiers and old_end.key in self.index.nodes and not old_end.ends:
                self.store.retire_final(old_end, now)
            if self.index.get(old_end.key) is old_end:
                self.queue.update_around(old_end)
        if end is not None and self.index.get(end.key) is end:
            self.queue.update_around(end)

    def score_status(self) -> dict[str, float | int | bool]:
        """The eviction score's knobs as they stand, for ``/status`` and ``/metrics``.

        ``tau_s``: the ``τ`` in use (seconds of recency per e-fold of expected loss per
        byte, ``score``); ``tau_calibrated``: whether it is the online estimate (else the
        configured constant); ``reaccess_gap_s`` / ``reaccess_samples``: the session
        re-access-gap EMA behind the estimate and how many gaps it has seen;
        ``end_probability``: the hit model's ``p_end``.
        """
        return {
            "tau_s": self.queue.tau,
            "tau_calibrated": self.queue.fixed_tau is None,
            "reaccess_gap_s": self.reaccess.gap_ema,
            "reaccess_samples": self.reaccess.samples,
            "end_probability": self.hit_model.end_probability,
        }

    def end_session(self, sid: str) -> None:
        self.index.drop_session(sid)

    def check(self) -> None:
        self.index.check()
        self.store.check()
        self.queue.check()
