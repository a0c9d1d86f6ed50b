"""The eviction score ``H = t + τ·ln(C/M)`` and its online ``τ`` (``core.rank``).

Every expected value is worked out by hand in the comments.
"""

from __future__ import annotations

import math

import pytest

from lmcache_histate.core.cache import CacheConfig, HiStateCache
from lmcache_histate.core.rank import MIN_RATIO, ReaccessScale, score
from lmcache_histate.core.tiers import TierSpec


def test_tau_zero_is_lru() -> None:
    # τ = 0: H = t whatever C/M (even C = 0, which would be ln 0 otherwise).
    assert score(5.0, 100.0, 10.0, 0.0) == 5.0
    assert score(5.0, 0.0, 10.0, 0.0) == 5.0


def test_cost_enters_as_seconds_per_e_fold() -> None:
    # A: t = 10, C/M = 100/1000 = 0.1 → H = 10 + 5·ln 0.1 = 10 − 11.5129 = −1.5129.
    # B: t = 0,  C/M = 1000/1000 = 1 → H = 0 + 5·ln 1 = 0.
    # A is 10 s more recent but 10× cheaper per byte: ln 10 · 5 s = 11.51 s > 10 s → A goes.
    assert score(10.0, 100.0, 1000.0, 5.0) == pytest.approx(-1.512925, abs=1e-6)
    assert score(0.0, 1000.0, 1000.0, 5.0) == 0.0


def test_a_constant_factor_on_cost_changes_no_decision() -> None:
    # Dividing both costs by N = 65 sessions shifts both H by 5·ln(1/65) = 5·(−4.174387)
    # = −20.871936: A: −1.512925 − 20.871936 = −22.384861; B: −20.871936. Same order,
    # same gap (1.512925).
    a = score(10.0, 100.0 / 65, 1000.0, 5.0)
    b = score(0.0, 1000.0 / 65, 1000.0, 5.0)
    assert a == pytest.approx(-22.384861, abs=1e-5)
    assert b == pytest.approx(-20.871936, abs=1e-5)
    assert b - a == pytest.approx(score(0.0, 1000.0, 1000.0, 5.0) - score(10.0, 100.0, 1000.0, 5.0))


def test_nothing_freed_or_one_byte_freed() -> None:
    # M = 0 frees nothing: the ratio counts as 0 and is floored: 7 + 2·ln(1e-9).
    assert score(7.0, 5.0, 0.0, 2.0) == pytest.approx(7.0 + 2.0 * math.log(1e-9))
    # M = 1, C = 1: ln 1 = 0, H = t.
    assert score(3.0, 1.0, 1.0, 4.0) == 3.0


def test_dead_tail_is_floored() -> None:
    # C = 0: H = t + τ·ln(1e-9) = 7 + 2·(−20.7233) = −34.4465.
    assert MIN_RATIO == 1e-9
    assert score(7.0, 0.0, 50.0, 2.0) == pytest.approx(7.0 + 2.0 * math.log(1e-9))
    assert score(7.0, 0.0, 50.0, 2.0) == pytest.approx(-34.446531, abs=1e-5)


def test_reaccess_scale_is_a_seeded_ema() -> None:
    r = ReaccessScale(alpha=0.05)
    assert r.tau == 0.0  # no gap seen yet: LRU
    r.observe(10.0)  # the first sample seeds: 10
    r.observe(20.0)  # 10 + 0.05·(20 − 10) = 10.5
    assert (r.tau, r.samples) == (10.5, 2)


def test_cache_calibrates_tau_from_session_gaps() -> None:
    cfg = CacheConfig(
        chunk_tokens=4, kv_chunk_bytes=40, snapshot_bytes=80,
        tiers=(TierSpec("cpu", 10_000), TierSpec("disk", 10_000)), ema_alpha=0.05,
    )
    cache = HiStateCache(cfg)
    keys = list(range(1, 9))
    # Session A reads the cache at t = 0, 10 and 30: gaps 10 (seeds) and 20 → 10.5.
    for now, n in ((0.0, 2), (10.0, 4), (30.0, 8)):
        cache.complete(cache.begin("A", keys[:n], now), 4 * n, now)
    # A request of another session samples no gap for A.
    cache.complete(cache.begin("B", [100, 101], 31.0), 8, 31.0)
    status = cache.stats()
    assert status.tau_s == 10.5 and status.tau_calibrated is True
    assert status.reaccess_samples == 2 and status.reaccess_gap_s == 10.5
    fixed = HiStateCache(CacheConfig(
        chunk_tokens=4, kv_chunk_bytes=40, snapshot_bytes=80,
        tiers=(TierSpec("cpu", 10_000), TierSpec("disk", 10_000)), tau=7.0,
    ))
    assert fixed.stats().tau_s == 7.0
    assert fixed.stats().tau_calibrated is False


def test_the_snapshot_plan_ends_on_the_chain() -> None:
    # A chain of 3 chunks (12 tokens) for a 20-token prompt: the final snapshot goes on
    # the chain's last chunk (12 tokens), not at 20 // 4 · 4 = 20 (no node there).
    cfg = CacheConfig(
        chunk_tokens=4, kv_chunk_bytes=40, snapshot_bytes=80,
        tiers=(TierSpec("cpu", 10_000), TierSpec("disk", 10_000)), fixed_interval=0,
    )
    cache = HiStateCache(cfg)
    kv, snaps = cache.complete(cache.begin("A", [1, 2, 3], 0.0), 20, 0.0)
    assert (kv, snaps) == (3, 1)
    assert cache.node(3).has_snapshot  # type: ignore[union-attr]
    assert cache.lookup([1, 2, 3]).hit_chunks == 3
