"""The values that cross the core's facade (``cache.HiStateCache``): its configuration,
a request's handle between ``begin`` and ``complete``, and the stats it reports.

``CacheConfig``'s field defaults are the core's knob defaults, written once: the server
and simulator schemas, the core's own parts (``ema``, ``units``, ``interval``) and the
simulator's baselines read them through ``config_default``. Invariants of those defaults:
``0 < ema_alpha <= 1`` (``ema.check_alpha``), ``0 <= end_probability_prior <= 1``
(``units.HitModel``), ``max_interval_chunks >= 1`` (``CacheConfig.__post_init__``).

Their own module because both sides of the facade use them: ``request_path`` (which
``cache`` owns) takes the configuration and the handle, so they cannot live in ``cache``
without an import cycle. ``cache`` names them in its ``__all__``: a caller of the core
imports the facade and its values from one place.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from .index import Match, Node
from .model_geometry import snapshot_tokens
from .tiers import PlacementRules, TierSpec

__all__ = [
    "HIT_POSITION_MODES",
    "CacheConfig",
    "CacheStats",
    "RequestHandle",
    "check_step_price",
    "check_step_tokens",
    "config_default",
]

HIT_POSITION_MODES = ("measured", "uniform")
"""Values of ``CacheConfig.hit_positions``: learned online, or the paper's uniform model."""


def check_step_tokens(step_tokens: int | None, chunk_tokens: int) -> int | None:
    """``step_tokens`` if it is None or a positive multiple of ``chunk_tokens``, else
    ``ValueError`` naming both."""
    if step_tokens is not None and (
        isinstance(step_tokens, bool) or not isinstance(step_tokens, int)
        or step_tokens <= 0 or step_tokens % chunk_tokens
    ):
        raise ValueError(
            f"step_tokens must be a positive multiple of the chunk size {chunk_tokens} "
            f"(the step budget rounded down to whole chunks), got {step_tokens!r}"
        )
    return step_tokens


def check_step_price(step_price: float) -> float:
    """``step_price`` as a float if it is a finite number ≥ 0, else ``ValueError``."""
    if isinstance(step_price, bool) or not isinstance(step_price, int | float) \
            or not 0.0 <= step_price < math.inf:
        raise ValueError(f"step_price must be a finite number ≥ 0, got {step_price!r}")
    return float(step_price)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Sizes and knobs of one cache instance.

    ``kv_chunk_bytes``: KV bytes of one chunk (chunk tokens × KV bytes per token);
    ``snapshot_bytes``: one recurrent-state snapshot. ``tau``: None calibrates the
    score's recency scale online (the design, ``score``); a number in seconds fixes it
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
    as the tiers' dwell returns, not to the mean gap (``score`` NOTE 4; needs
    ``exposed_ends``, which measures the dwell: without it ``τ`` stays the mean gap).
    ``attention_tokens``: the context length at which causal attention costs as much per
    recomputed token as the rest of the prefill (linear cost ÷ attention cost per token
    pair; ``inf``: cost in tokens only, ``units``).
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
    one, the live server has none. Every other tier ranks by ``H`` (``score`` NOTE 3).
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
    max_interval_chunks: int = 64
    ema_alpha: float = 0.05
    end_probability_prior: float = 0.9
    initial_pressure_factor: float = 0.0
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
    """``CacheConfig``'s default value of the knob ``name`` (module docstring).

    NOTE 1: read through ``dataclasses.fields``: with ``slots=True`` a field's class
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
    expected loss per byte, ``score``), ``tau_calibrated``: whether it is the online
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
