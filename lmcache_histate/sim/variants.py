"""HiState and its ablations: configurations of the REAL policy core (``HiStateCache``).

Every variant is ``HiStatePolicy`` over the same three tiers and differs only in the
knobs the paper ablates, so a difference between two rows is the effect of that knob:

=====================  =====================================================================
``histate``            the full design: unified H-queue with ``τ`` calibrated online from
                       the sessions' re-access gaps (``core.rank``), refresh-all, a
                       snapshot's end hits weighted by the chance the tail below it has
                       left the cache when its session returns (``exposed_ends``,
                       ``core.eviction`` NOTE 7), online interval controller.
``histate-paper``      the paper's eviction rule, kept as its own row for the record:
                       refresh-all (a hit refreshes every unit on its prefix) with ``τ``
                       calibrated online, every passing session's end hits priced into a
                       snapshot's ``C`` (``exposed_ends`` off).
``histate-refresh-``    ``histate`` with a hit refreshing only the unit it resumed from
``hit``                (``refresh_all=False``): the candidate of the pressure matrix
                       (``benchmarks/sim_pressure.md``).
``histate-refresh-``    ``histate`` with refresh-all for the KV path but an intermediate
``used``               snapshot's unit ranked by when a hit last resumed from it
                       (``refresh_used``, ``core.eviction`` NOTE 6).
``histate-refresh-``    ``histate`` with an intermediate snapshot's unit ranked between the
``learned``            two: ``used + w·(access − used)``, ``w`` the measured resume rate of
                       snapshots last refreshed by a pass over that of those last used
                       (``refresh_learned``, ``core.eviction`` NOTE 8).
``histate-return-``    ``histate`` with ``τ`` fitted to whether a session idle as long as
``tau``                the tiers' dwell returns, not to the mean gap (``core.rank`` NOTE 7).
``histate-fixed-tau``  the same with the set-up's fixed ``tau`` (``histate.tau`` in the
                       config, seconds per e-fold of cost per byte): what calibration buys.
``histate-align``      snapshots only where vLLM's align mode keeps them
                       (``prefix_cache_retention_interval = 0``): each segment's final
                       one, i.e. ``fixed_interval = 0``.
``histate-every32``    a snapshot every 32 chunks (the paper's "every 32 blocks").
``histate-measured``   ``histate`` with measured hit positions (``core.hit_positions``)
                       instead of the paper's uniform ones: what measuring them buys.
``histate-neutral-``   ``histate`` starting from the paper's neutral pressure factor 1
``start``              instead of 0 while no snapshot has left the cache
                       (``core.interval`` NOTE 2): what free storage buys.
``histate-small-``     ``histate`` with vLLM's own scheduler: a one-chunk step grid, every
``steps``              prefill charged in steps of one chunk (the budget in [N, 2N) it
                       needs) instead of the planned step ends of HiState's scheduler on
                       the engine's grid (``sim.capture``): what the scheduler buys.
=====================  =====================================================================

The eviction ablations are baseline rows: ``lru`` is this same core with ``tau = 0`` and
no refresh-all (LRU over HiState's units), ``lru-refresh-all`` adds refresh-all back, and
``file-lru`` is the paper's file-level LRU (every KV chunk and snapshot file an LRU
object of its own, no units; ``baselines/file_lru.py``).

**The tiers and the GPU's role** (the same model must be used by the vLLM offload
baselines for a fair comparison; see ``TIER_MODEL``). Tiers are ``gpu`` → ``cpu`` →
``disk``, exclusive, with demotion:

* KV chunks are computed on the GPU and stay in its pool (vLLM's prefix cache) first;
  when the pool is full the lowest-ranked units are demoted to CPU memory (LMCache L1),
  and from there to disk when CPU memory is full; a unit leaving the disk leaves the
  cache. Each byte is resident on exactly one tier, so the cache holds up to
  gpu + cpu + disk bytes.
* A session's final snapshot stays with its KV in fast memory (GPU, then CPU when
  demoted with its bundle); intermediate snapshots and retired final ones go to disk.
* A hit reads the KV of every hit chunk and one snapshot from wherever they are; reads
  from the GPU are free, CPU reads cross PCIe, disk reads are SSD-bound. What a request
  read or recomputed is in the GPU pool afterwards (the engine loaded it there), so the
  prompt's cached KV and the resumed snapshot are promoted to the GPU tier when the
  request completes (``HiStatePolicy.promote_tier``), room being made by the core's own
  eviction (lowest-H units demoted). The baselines promote the same way.

Why demotion rather than "LMCache holds a write-through copy of everything": with a
write-through copy the GPU pool adds no capacity and only saves the PCIe transfer of
recently used prefixes; with demotion it adds capacity. Both are defensible; what
matters is that HiState and the vLLM-offload baselines get the same one. The vLLM
GPU-only baseline gets only the ``gpu`` tier.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..config import CORE_KNOBS, CoreKnobs, cache_config
from ..core.interval import supported_intervals
from ..core.tiers import PlacementRules, SimTier, TierSpec
from .capture import SMALL_STEP_ROWS
from .config import SimSetup
from .policy import HiStatePolicy, Policy

__all__ = [
    "TIER_MODEL",
    "VARIANTS",
    "VARIANT_LINES",
    "attention_tokens",
    "histate_policy",
    "histate_variants",
    "three_tier_policy",
]

TIER_MODEL = "exclusive gpu→cpu→disk with demotion; GPU reads free, CPU over PCIe, disk over SSD"

# The three tiers' indices in HiState's placement (plain ints: the core indexes lists with them).
_GPU, _DISK = int(SimTier.GPU), int(SimTier.DISK)

VARIANTS: dict[str, dict[str, Any]] = {
    "histate": {"tau": None},
    "histate-paper": {"tau": None, "refresh_all": True, "exposed_ends": False},
    "histate-refresh-hit": {"tau": None, "refresh_all": False},
    "histate-refresh-used": {"tau": None, "refresh_all": True, "refresh_used": True},
    "histate-refresh-learned": {"tau": None, "refresh_all": True, "refresh_learned": True},
    "histate-return-tau": {"tau": None, "return_tau": True},
    "histate-fixed-tau": {},
    "histate-align": {"fixed_interval": 0},
    "histate-every32": {"fixed_interval_chunks": 32},
    "histate-measured": {"tau": None, "hit_positions": "measured"},
    "histate-neutral-start": {"tau": None, "initial_pressure_factor": 1.0},
    "histate-small-steps": {"tau": None},
}

# One line per row for ``histate simulate --list-policies`` (the table above, shortened).
VARIANT_LINES: dict[str, str] = {
    "histate": "the full design: cost-aware H-queue, tau calibrated online, refresh-all, "
    "online snapshot interval",
    "histate-paper": "the paper's eviction rule as published (every end hit priced, no "
    "exposed_ends)",
    "histate-refresh-hit": "histate, a hit refreshing only the unit it resumed from",
    "histate-refresh-used": "histate, a snapshot ranked by when a hit last resumed from it",
    "histate-refresh-learned": "histate, a snapshot ranked between last pass and last use "
    "by a learned weight",
    "histate-return-tau": "histate, tau fitted to whether idle sessions return",
    "histate-fixed-tau": "histate with the config's fixed tau (what calibration buys)",
    "histate-align": "histate keeping only each segment's final snapshot (vLLM align mode's "
    "states)",
    "histate-every32": "histate with a snapshot every 32 chunks (the paper's fixed interval)",
    "histate-measured": "histate with measured instead of uniform hit positions",
    "histate-neutral-start": "histate starting from pressure factor 1 instead of 0",
    "histate-small-steps": "histate charged one-chunk prefill steps (vLLM's own scheduler)",
}


THREE_TIER_RULES = PlacementRules(kv_tier=_GPU, snapshot_tier=_DISK, final_tier=_GPU)
"""HiState's placement over gpu/cpu/disk: KV and final snapshots on the GPU first,
intermediate snapshots on disk (``TIER_MODEL``)."""


def three_tier_policy(
    name: str,
    *,
    chunk_tokens: int,
    kv_bytes_per_token: int,
    snapshot_bytes: int,
    gpu_bytes: int,
    cpu_bytes: int,
    disk_bytes: int,
    **knobs: Any,
) -> HiStatePolicy:
    """The real core over gpu/cpu/disk with HiState's placement and GPU promotion.

    The baselines' ``lru`` rows are this, with their knobs; the HiState rows are built the
    same way through the server's mapping (``histate_policy``).
    """
    knobs.setdefault("supported_intervals", supported_intervals(chunk_tokens))
    # The GPU tier is vLLM's own block pool: it ranks by recency (``rank`` NOTE 6).
    knobs.setdefault("recency_tiers", _GPU + 1)
    return HiStatePolicy.build(
        name,
        chunk_tokens=chunk_tokens,
        kv_bytes_per_token=kv_bytes_per_token,
        snapshot_bytes=snapshot_bytes,
        tiers=[("gpu", gpu_bytes), ("cpu", cpu_bytes), ("disk", disk_bytes)],
        rules=THREE_TIER_RULES,
        promote_tier=_GPU,
        **knobs,
    )


def histate_policy(setup: SimSetup, name: str = "histate", **overrides: Any) -> HiStatePolicy:
    """HiState over the set-up's gpu/cpu/disk tiers, with knob ``overrides``.

    The core's configuration comes from the server's mapping (``config.cache_config``,
    ``config`` NOTE 9): the set-up's ``tau``, ``ema_alpha`` and ``max_interval_chunks`` are
    the server keys of the same names, every other rule knob the server's default unless an
    override sets it; overrides of knobs the server has no key for (``refresh_used``,
    ``fixed_interval``, ...) and the engine's figures go beside the rule. The GPU tier is
    vLLM's own block pool, which ranks by recency (``rank`` NOTE 6).

    ``fixed_interval_chunks`` (chunks) is accepted as a convenience for
    ``fixed_interval`` (tokens). The rows plan on the engine's step grid at its step
    price (``CostModel.step_grid``), as the live server does with the grid the connector
    sends; the rows charged one-chunk steps (``capture.SMALL_STEP_ROWS``) run vLLM's own
    scheduler, whose grid is one chunk.
    """
    step, price = setup.cost.step_grid(setup.chunk_tokens)
    if name in SMALL_STEP_ROWS:
        step = setup.chunk_tokens
    chunks = overrides.pop("fixed_interval_chunks", None)
    if chunks is not None:
        overrides["fixed_interval"] = chunks * setup.chunk_tokens
    rule = {key: overrides.pop(key) for key in list(overrides) if key in CORE_KNOBS}
    knobs = replace(CoreKnobs(tau=setup.tau, ema_alpha=setup.ema_alpha,
                              max_interval_chunks=setup.max_interval_chunks), **rule)
    engine: dict[str, Any] = {"step_tokens": step, "step_price": price,
                              "recency_tiers": _GPU + 1, **overrides}
    config = cache_config(
        knobs,
        chunk_tokens=setup.chunk_tokens,
        kv_chunk_bytes=setup.kv_chunk_bytes,
        snapshot_bytes=setup.snapshot_bytes,
        tiers=(TierSpec("gpu", setup.gpu_bytes), TierSpec("cpu", setup.cpu_bytes),
               TierSpec("disk", setup.disk_bytes)),
        rules=THREE_TIER_RULES,
        **engine,
    )
    return HiStatePolicy(name, config, promote_tier=_GPU)


def attention_tokens(setup: SimSetup) -> float:
    """The cost model's ``K = a/b`` (``CacheConfig.attention_tokens``): recompute priced
    at its prefill rates, linear per token plus causal attention per token pair."""
    cost = setup.cost
    if cost.attention_s_per_token_pair <= 0:
        return math.inf
    return cost.prefill_s_per_token / cost.attention_s_per_token_pair


def histate_variants(setup: SimSetup) -> dict[str, Callable[[], Policy]]:
    """Factories for every HiState row, in report order (same shape as baselines').

    Each prices recompute with the set-up's cost model (``attention_tokens``; it only
    changes ranks where ``τ > 0``, so ``histate_policy``'s defaults stay the LRU rows'
    object model).
    """
    k = attention_tokens(setup)
    return {
        name: (lambda name=name, kw=kw: histate_policy(setup, name, attention_tokens=k, **dict(kw)))
        for name, kw in VARIANTS.items()
    }
