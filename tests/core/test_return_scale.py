"""``τ`` fitted to whether a session returns (``core.rank`` NOTE 7, ``ReturnScale``).

Every expected value is worked out by hand in the comments.
"""

from __future__ import annotations

import math

import pytest

from lmcache_histate.core.cache import CacheConfig, HiStateCache
from lmcache_histate.core.ema import SeededEMA
from lmcache_histate.core.index import PrefixIndex
from lmcache_histate.core.rank import ReturnScale, gap_bin
from lmcache_histate.core.tiers import TierSpec


def _sessions(last: dict[str, float]) -> PrefixIndex:
    index = PrefixIndex(4)
    root = index.insert_chain([1])[0]
    for sid, t in last.items():
        index.set_session(sid, root, 4).last_access = t
    return index


def _dwell(*values: float) -> list[SeededEMA]:
    out = []
    for v in values:
        ema = SeededEMA(0.05)
        ema.observe(v)  # the first sample seeds the EMA: its value is v
        out.append(ema)
    return out


def test_gap_bins_are_sixteen_to_a_doubling_from_one_millisecond() -> None:
    assert gap_bin(0.0) == 0 and gap_bin(1e-3) == 0  # at or under the floor
    # 2 ms: 16·log2(2) = 16 → bin 17.
    assert gap_bin(2e-3) == 17
    # 1 s: 16·log2(1,000) = 16·9.96578 = 159.45 → bin 160.
    assert gap_bin(1.0) == 160


def test_tau_is_the_mean_gap_until_something_left_the_last_tier() -> None:
    index = _sessions({"A": 0.0})
    scale = ReturnScale(0.05, index.sessions)
    # A measured upper tier but nothing dropped from the last: D is unmeasured.
    scale.dwell = [*_dwell(100.0), SeededEMA(0.05)]
    assert scale.tau == 0.0  # no gap yet: LRU
    scale.observe_at(10.0, 10.0)  # seeds the EMA: 10
    scale.observe_at(20.0, 30.0)  # 10 + 0.05·(20 − 10) = 10.5
    assert scale.tau == 10.5 and scale.gap_ema == 10.5


def test_tau_is_fitted_to_the_returns_past_the_dwell() -> None:
    # D = 50 + 100 = 150 s. At now = 1,000: A idle 1,000 s (> D: gone), B idle 100 s,
    # C idle 0 s.
    index = _sessions({"A": 0.0, "B": 900.0, "C": 1000.0})
    scale = ReturnScale(0.05, index.sessions)
    scale.dwell = _dwell(50.0, 100.0)
    # Gap 1 = 200 s > D: b = 1, p = 1 → r = 1.5/3 = 0.5, τ = 150/ln 2 = 216.404 s.
    # The next estimate is due after max(1, 3 sessions) more gaps.
    scale.observe_at(200.0, 1000.0)
    assert scale.tau == pytest.approx(216.404, abs=1e-3)
    scale.observe_at(10.0, 1000.0)
    scale.observe_at(200.0, 1000.0)
    assert scale.tau == pytest.approx(216.404, abs=1e-3)  # not due yet
    # Gap 4: b = 3 (the 10 s gap is shorter than D), p = 1 → r = 3.5/5 = 0.7,
    # τ = 150/−ln 0.7 = 150/0.356675 = 420.551 s.
    scale.observe_at(200.0, 1000.0)
    assert scale.tau == pytest.approx(420.551, abs=1e-3)
    # The mean-gap EMA kept alongside: 200 → 190.5 → 190.975 → 191.42625.
    assert scale.gap_ema == pytest.approx(191.42625)


def test_a_gap_in_the_dwells_own_bin_does_not_count_as_longer() -> None:
    # D = 150 s: bin 16·log2(150,000) = 16·17.19460 = 275.11 → 276; a 151 s gap:
    # 16·log2(151,000) = 275.27 → 276, the same bin. b = 0, p = 1 (A idle 1,000 s):
    # r = 0.5/2 = 0.25, τ = 150/ln 4 = 108.202 s.
    index = _sessions({"A": 0.0})
    scale = ReturnScale(0.05, index.sessions)
    scale.dwell = _dwell(150.0)
    scale.observe_at(151.0, 1000.0)
    assert scale.tau == pytest.approx(108.202, abs=1e-3)


def test_the_cache_feeds_the_return_scale_and_not_the_returning_session() -> None:
    # Through the facade: nothing has left the last tier, so τ is the mean gap, as in the
    # default calibration (gaps 10 then 20 s: 10.5). The returning session is not counted
    # idle: its ``last_access`` is ``now`` when the gap is observed.
    cfg = CacheConfig(
        chunk_tokens=4, kv_chunk_bytes=40, snapshot_bytes=80,
        tiers=(TierSpec("cpu", 10_000), TierSpec("disk", 10_000)), ema_alpha=0.05,
        exposed_ends=True, return_tau=True,
    )
    cache = HiStateCache(cfg)
    keys = list(range(1, 9))
    for now, n in ((0.0, 2), (10.0, 4), (30.0, 8)):
        cache.complete(cache.begin("A", keys[:n], now), 4 * n, now)
    status = cache.stats()
    assert status.tau_s == 10.5 and status.tau_calibrated is True
    assert math.isclose(status.reaccess_gap_s, 10.5)
