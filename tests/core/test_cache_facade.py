"""The verbs of the core's facade (``HiStateCache``) that the simulator, the live runtime
and tests use instead of the private index / store / queue / interval controller.

One small cache: chunks of 4 tokens, 10 B of KV per chunk (2 B per token), 25 B per
snapshot (N_s = 25 / 2 = 12.5 token units), tier 0 = CPU and tier 1 = disk, default rules
(KV and final snapshots on tier 0, intermediate snapshots on tier 1).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from support.core_probe import next_victim

from lmcache_histate.core.cache import CacheConfig, HiStateCache
from lmcache_histate.core.tiers import KV, SNAPSHOT, ServerTier, TierSpec

CHUNK, KV_BYTES, SNAP_BYTES = 4, 10, 25
CPU, DISK = ServerTier.CPU, ServerTier.DISK
KEYS = [101, 102, 103, 104]


def stored(cpu: int = 1000, disk: int = 1000) -> HiStateCache:
    """Session "a": chunks 101..104, snapshots after chunk 2 (token 8, intermediate) and
    chunk 4 (token 16, the final), stored at t = 1."""
    cache = HiStateCache(CacheConfig(
        chunk_tokens=CHUNK, kv_chunk_bytes=KV_BYTES, snapshot_bytes=SNAP_BYTES,
        tiers=(TierSpec("cpu", cpu), TierSpec("disk", disk)),
        supported_intervals=(CHUNK, 2 * CHUNK),
    ))
    cache.complete(cache.attach("a", KEYS), 16, 1.0, boundaries=[8, 16])
    return cache


def test_queries_and_stats_describe_what_is_stored() -> None:
    cache = stored()
    # CPU: 4 KV chunks (40 B) + the final snapshot (25 B) = 65 B; disk: the intermediate 25 B.
    assert (cache.stats().used_bytes[CPU], cache.stats().used_bytes[DISK]) == (65, 25)
    assert cache.tiers_of(KEYS[0], KV) == 1 << CPU
    assert cache.tiers_of(KEYS[0], SNAPSHOT) == 0
    assert cache.tiers_of(KEYS[1], SNAPSHOT) == 1 << DISK
    assert cache.tiers_of(KEYS[3], SNAPSHOT) == 1 << CPU
    assert cache.tiers_of(999, KV) == 0  # unknown chunk
    assert cache.holds_kv_prefix(KEYS[:2]) and cache.holds_kv_prefix(KEYS)
    assert not cache.holds_kv_prefix([*KEYS, 105])
    assert KEYS[2] in cache and 999 not in cache
    assert cache.has_session("a") and cache.session_end("a") == KEYS[3]
    assert cache.session_end("nobody") is None
    stats = cache.stats()
    assert (stats.nodes, stats.sessions) == (4, 1)
    assert (stats.used_bytes, stats.capacity_bytes) == ((65, 25), (1000, 1000))
    assert stats.pressure_factor == 0.0  # no snapshot has left the cache yet
    assert stats.dropped_units == 0


def test_take_events_hands_out_each_placement_once_in_order() -> None:
    """``stored()``'s ``complete`` queued its KV prefix first (10 B each on the CPU), then
    the final snapshot (chunk 104, 25 B, CPU: the final tier) before the intermediate one
    (chunk 102, 25 B, disk): finals go first. Taken once, the queue is empty. Evicting 1 B
    from the disk, the last tier, drops the intermediate snapshot alone (KV stays cached
    below it): it left mask 0b10, which was all it held, stored and last accessed at t = 1."""
    cache = stored()
    assert cache.take_events() == [
        ("stored", 101, KV, CPU, 10), ("stored", 102, KV, CPU, 10),
        ("stored", 103, KV, CPU, 10), ("stored", 104, KV, CPU, 10),
        ("stored", 104, SNAPSHOT, CPU, 25), ("stored", 102, SNAPSHOT, DISK, 25),
    ]
    assert cache.take_events() == []
    assert cache.evict(DISK, 1, 2.0) == 25
    assert cache.take_events() == [("dropped", 102, SNAPSHOT, 0b10, 25, 0b10, 1.0, 1.0, True)]


def test_evict_demotes_the_lowest_ranked_cpu_unit() -> None:
    """No re-access gap has been seen, so τ = 0 and every tier ranks by recency, ties
    deepest first (eviction NOTE 3). Everything was stored at t = 1, so the deepest unit
    goes first: the bundle of chunks 3-4 (KV 2 × 10 B) and the final snapshot (25 B),
    demoted to disk (tier 0 is not the last): 45 B freed."""
    cache = stored()
    victim = next_victim(cache, CPU)
    assert victim is not None and victim[0] == KEYS[3]
    assert cache.evict(CPU, 1, 2.0) == 45
    assert (cache.stats().used_bytes[CPU], cache.stats().used_bytes[DISK]) == (65 - 45, 25 + 45)
    assert cache.tiers_of(KEYS[3], SNAPSHOT) == 1 << DISK
    cache.check()


def test_set_capacity_evicts_until_it_fits_and_keeps_what_is_pinned() -> None:
    cache = stored()
    handle = cache.begin("a", KEYS, 2.0)  # pins the path: its units cannot go
    assert cache.set_capacity(DISK, 0, 3.0) == 25  # what is held stays: capacity = held
    cache.release(handle)
    assert cache.set_capacity(DISK, 0, 4.0) == 0  # the intermediate snapshot is dropped
    assert cache.tiers_of(KEYS[1], SNAPSHOT) == 0 and cache.stats().used_bytes[DISK] == 0
    assert cache.stats().capacity_bytes == (1000, 0)
    cache.check()


def test_eviction_inputs_are_the_units_t_c_and_m_on_the_disk() -> None:
    cache = stored()
    # S102 (intermediate, on disk): p = 8, nothing above: delta = 8. Its zone: 103, then the
    # snapshot at 104 (q = 16), internal mass (16 - 8) * weight(104) = 8 * 1/16 = 0.5; one
    # session passes it. C = 8 * (0.1 * 0.5 + 0.9 * 1) = 7.6 tokens = 15.2 B-units; it
    # leaves the last tier alone: M = 25 B.
    assert cache.eviction_inputs(102, SNAPSHOT, DISK) == pytest.approx((1.0, 15.2, 25.0))
    assert cache.eviction_inputs(101, KV, DISK) is None  # its KV is on the CPU tier
    cache.evict(CPU, 1, 2.0)  # demotes the bundle: chunks 103-104 and the final snapshot
    # Bundle 104: delta = 16 - 8 = 8, session a ends there (no internal hit past its end),
    # passes 1: C = 8 * 0.9 = 7.2 tokens = 14.4; M = 25 + 2 * 10 = 45 B. Chunk 103's KV
    # leaves with it (same unit).
    assert cache.eviction_inputs(104, SNAPSHOT, DISK) == pytest.approx((1.0, 14.4, 45.0))
    assert cache.eviction_inputs(104, KV, DISK) == pytest.approx((1.0, 14.4, 45.0))
    assert cache.eviction_inputs(103, KV, DISK) == pytest.approx((1.0, 14.4, 45.0))
    cache.evict(CPU, 1000, 3.0)  # everything demoted: chunks 101-102 too
    # 101 and 102's KV lie above the snapshot at 102: interior KV, no unit on the last tier.
    assert cache.eviction_inputs(101, KV, DISK) is None
    assert cache.eviction_inputs(102, KV, DISK) is None


def test_follow_residence_sets_the_pressure_factor_the_interval_uses() -> None:
    """A 64-token segment, N_s = 12.5, intervals (4, 8); cost(I) = I/2 + F * N_s * 64 / I.
    F = 0 (no snapshot sample yet): cost(4) = 2, cost(8) = 4 -> 4.
    Pooled EMAs kv 1 s / state 100 s: F = 0.01: cost(4) = 2 + 2 = 4, cost(8) = 4 + 1 = 5 -> 4.
    Snapshot samples but no KV one: F = 1: cost(4) = 2 + 200 = 202, cost(8) = 4 + 100 = 104
    -> 8."""
    cache = stored()
    assert cache.interval_for(64) == 4
    assert cache.follow_residence(1.0, 3, 100.0, 2) == pytest.approx(0.01)
    assert cache.stats().pressure_factor == pytest.approx(0.01)
    assert cache.interval_for(64) == 4
    # No KV sample in the pooled EMAs: the neutral factor 1 (8).
    assert cache.follow_residence(1.0, 0, 100.0, 2) == 1.0
    assert cache.interval_for(64) == 8
    # The pooled EMAs replace the core's own only for planning: the core itself saw
    # nothing leave.
    assert cache.stats().kv_residence_s == cache.stats().snapshot_residence_s == 0.0


def test_eviction_inputs_edges() -> None:
    """A part not on the asked tier has no inputs even where its unit has bytes there; a
    KV tail past the last snapshot costs nothing to lose; a 1-byte unit still counts."""
    cache = HiStateCache(CacheConfig(
        chunk_tokens=CHUNK, kv_chunk_bytes=KV_BYTES, snapshot_bytes=SNAP_BYTES,
        tiers=(TierSpec("cpu", 1000), TierSpec("disk", 1000)),
        supported_intervals=(CHUNK, 2 * CHUNK),
    ))
    # Session "a" = 101..105 (20 tokens), snapshots at tokens 8 and 16: chunk 105 is a tail.
    cache.complete(cache.attach("a", [*KEYS, 105]), 20, 1.0, boundaries=[8, 16])
    # S102 lives on disk only; the unit it anchors on the CPU (KV 101-102, 20 B) is not it.
    assert cache.eviction_inputs(102, SNAPSHOT, CPU) is None
    assert cache.eviction_inputs(999, KV, CPU) is None  # unknown key
    # Chunk 105: t = 1, C = 0 (no snapshot at or past it to resume from), M = 10 B.
    assert cache.eviction_inputs(105, KV, CPU) == (1.0, 0.0, 10.0)
    # One token per chunk, 1 B per chunk and per snapshot (token_bytes = 1, N_s = 1);
    # session "b" = 1..4, snapshots at 2 (intermediate: disk) and 4. S2 as S102 above with
    # every length / 4: delta = 2, internal mass (4 - 2) * 1/4 = 0.5, passes 1:
    # C = 2 * (0.1 * 0.5 + 0.9 * 1) = 1.9 tokens = 1.9 B; alone on disk: M = 1 B.
    small = HiStateCache(CacheConfig(
        chunk_tokens=1, kv_chunk_bytes=1, snapshot_bytes=1,
        tiers=(TierSpec("cpu", 1000), TierSpec("disk", 1000)), supported_intervals=(1, 2),
    ))
    small.complete(small.attach("b", [1, 2, 3, 4]), 4, 1.0, boundaries=[2, 4])
    assert small.eviction_inputs(2, SNAPSHOT, DISK) == pytest.approx((1.0, 1.9, 1.0))


def test_initial_pressure_factor_is_the_factor_until_a_snapshot_leaves() -> None:
    """``stored()``'s segment (L = 64, N_s = 12.5, I in {4, 8}) under a core configured
    with ``initial_pressure_factor`` 1: cost(4) = 2 + 200 = 202, cost(8) = 4 + 100 = 104
    -> 8 (the default 0 gives 4: test_follow_residence_sets_the_pressure_factor_the_interval_uses).
    A negative or infinite value is refused at construction, naming the key."""
    base = stored().config
    cache = HiStateCache(replace(base, initial_pressure_factor=1.0))
    assert cache.stats().pressure_factor == 1.0
    assert cache.interval_for(64) == 8
    for bad in (-1.0, math.inf):
        with pytest.raises(ValueError, match="initial_pressure_factor must be a finite number ≥ 0"):
            replace(base, initial_pressure_factor=bad)


def test_a_step_grid_keeps_free_snapshots_on_step_ends() -> None:
    """Chunks of 4 tokens, snapshots of N_s = 12.5 KV tokens, intervals 4..64 (the default
    16 chunks). At pressure factor 0 (nothing has left yet) storage is free, so the plan
    is the cheapest interval that costs no extra step end: without a step grid every chunk
    (I = 4: cost I/2 = 2), with the engine's grid of 12 tokens the multiples of 12 only
    (cost 6 for I = 12, 12 for 24, ...): a 40-token segment from token 8 gets states at
    20, 32 and 44 (every 12 tokens from its start: the engine's step ends) and its final
    one at 48.
    ``set_step_grid`` moves a live core onto the grid an engine reports; a grid that is not
    whole chunks is refused, naming the key; None forgets it."""
    base = replace(stored().config, supported_intervals=None)
    free = HiStateCache(base)
    assert free.snapshot_plan(8, 48) == [12, 16, 20, 24, 28, 32, 36, 40, 44, 48]
    grid = HiStateCache(replace(base, step_tokens=12))
    assert grid.step_grid == 12
    assert grid.snapshot_plan(8, 48) == [20, 32, 44, 48]
    free.set_step_grid(12)
    assert free.snapshot_plan(8, 48) == [20, 32, 44, 48]
    free.set_step_grid(None)
    assert free.snapshot_plan(8, 20) == [12, 16, 20]
    for bad in (10, 0, True):
        with pytest.raises(ValueError, match="step_tokens must be a positive multiple of the "
                                             "chunk size 4"):
            free.set_step_grid(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="step_tokens must be a positive multiple"):
            replace(base, step_tokens=bad)


def test_a_priced_step_grid_buys_the_states_internal_hits_pay_for() -> None:
    """The segment of the test above (L = 40 from token 8, chunks of 4, grid 12) with a
    step end priced σ = 0.5 tokens (``interval`` NOTE 3): cost₀(I) = q·I/2 + 0.5·(40/I)·
    (ceil(I/12) − I/12). The core's own hit model gives ``q``: at ``p_end`` 0.5, 4 ->
    1 + 3.333, 8 -> 2 + 0.833 = 2.833, 12 -> 3 + 0 -> 8 (states every 8 tokens); at
    ``p_end`` 1 (q = 0) the grid; unpriced (σ = 0) the grid whatever q. With α = 1 one
    internal access sets ``p_end`` to 0 (q = 1): 4 -> 2 + 3.333, 8 -> 4 + 0.833, 12 -> 6
    -> 8 again."""
    base = replace(stored().config, supported_intervals=None, step_tokens=12, step_price=0.5)
    half = HiStateCache(replace(base, end_probability_prior=0.5))
    assert half.snapshot_plan(8, 48) == [16, 24, 32, 40, 48]
    unpriced = HiStateCache(replace(base, step_price=0.0, end_probability_prior=0.5))
    assert unpriced.snapshot_plan(8, 48) == [20, 32, 44, 48]
    live = HiStateCache(replace(base, end_probability_prior=1.0, ema_alpha=1.0))
    assert live.snapshot_plan(8, 48) == [20, 32, 44, 48]
    live.note_internal_access()
    assert live.stats().end_probability == 0.0
    assert live.snapshot_plan(8, 48) == [16, 24, 32, 40, 48]


def test_set_step_grid_takes_the_engines_step_price() -> None:
    """The live server's path to the priced plan of the test above: a core configured
    without grid or price (``p_end`` 0.5) plans every chunk; told the grid alone it keeps
    the grid's states, [20, 32, 44, 48]; told the price 0.5 too, cost₀ picks 8 as above,
    [16, 24, 32, 40, 48]; a later grid without a price keeps 0.5. ``stats`` reports both.
    A bad price is refused, naming the key, and changes neither grid nor price."""
    base = replace(stored().config, supported_intervals=None, end_probability_prior=0.5)
    cache = HiStateCache(base)
    assert (cache.stats().step_tokens, cache.stats().step_price) == (None, 0.0)
    cache.set_step_grid(12)
    assert cache.snapshot_plan(8, 48) == [20, 32, 44, 48]
    cache.set_step_grid(12, 0.5)
    assert cache.snapshot_plan(8, 48) == [16, 24, 32, 40, 48]
    cache.set_step_grid(12)
    assert (cache.stats().step_tokens, cache.stats().step_price) == (12, 0.5)
    for bad in (-1.0, math.inf, math.nan, True):
        with pytest.raises(ValueError, match="step_price must be a finite number ≥ 0"):
            cache.set_step_grid(24, bad)  # type: ignore[arg-type]
    assert (cache.stats().step_tokens, cache.stats().step_price) == (12, 0.5)


def test_a_step_grid_does_not_move_a_plan_under_pressure() -> None:
    """With the pressure factor 1 the storage term decides (step_price 0 prices no step
    end): the 64-token segment's cost I/2 + 12.5·64/I is lowest at I = 40 (20 + 20 = 40;
    36: 18 + 22.2; 44: 22 + 18.2), on the grid of 12 or not."""
    base = replace(stored().config, supported_intervals=None, initial_pressure_factor=1.0)
    plain = HiStateCache(base).snapshot_plan(0, 64)
    assert plain == [40, 64]
    assert HiStateCache(replace(base, step_tokens=12)).snapshot_plan(0, 64) == plain
