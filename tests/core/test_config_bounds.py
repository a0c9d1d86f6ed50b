"""Every bound of the core's configuration, at the bound: the smallest valid value is
accepted and the one below it is refused with a message naming the key and the value."""

from __future__ import annotations

import dataclasses
import re

import pytest

from lmcache_histate.core.cache import CacheConfig, HiStateCache, config_default
from lmcache_histate.core.interval import IntervalController, ResidenceTracker
from lmcache_histate.core.model_geometry import snapshot_tokens
from lmcache_histate.core.tiers import PlacementRules, TierSpec

BASE = CacheConfig(chunk_tokens=10, kv_chunk_bytes=10, snapshot_bytes=20,
                   tiers=(TierSpec("all", 100),))


def refused(message: str, **changes: object) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        dataclasses.replace(BASE, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "name", ["chunk_tokens", "kv_chunk_bytes", "snapshot_bytes", "max_interval_chunks"]
)
def test_sizes_must_be_positive(name: str) -> None:
    assert getattr(dataclasses.replace(BASE, **{name: 1}), name) == 1
    refused(f"{name} must be positive, got 0", **{name: 0})


def test_attention_tokens_and_fixed_interval() -> None:
    assert dataclasses.replace(BASE, attention_tokens=0.5).attention_tokens == 0.5
    refused("attention_tokens must be positive, got 0", attention_tokens=0)
    assert dataclasses.replace(BASE, fixed_interval=0).fixed_interval == 0
    assert dataclasses.replace(BASE, fixed_interval=20).fixed_interval == 20
    for bad in (-10, 15):  # −10 is a multiple of 10 but negative; 15 is not a multiple
        refused(f"fixed_interval must be 0 or a multiple of chunk_tokens (10), got {bad}",
                fixed_interval=bad)


def test_interval_controller_and_snapshot_token_bounds() -> None:
    # N_s = 1 token is valid; no supported interval may be 0 (a multiple of every chunk).
    assert IntervalController(chunk_tokens=10, snapshot_tokens=1).snapshot_tokens == 1.0
    with pytest.raises(ValueError, match=re.escape(
        "supported intervals must be positive multiples of the chunk size 10; got [0]"
    )):
        IntervalController(chunk_tokens=10, snapshot_tokens=1, supported=(0, 10))
    assert snapshot_tokens(20, 0.5) == 40.0  # 20 B / 0.5 B per token
    with pytest.raises(ValueError, match=r"^kv_bytes_per_token must be positive, got 0$"):
        snapshot_tokens(20, 0)


def test_max_interval_chunks_bounds_the_offered_intervals() -> None:
    # Chunks of 10 tokens, N_s = 20 B / 1 B per token = 20, pressure factor F = 1: a
    # 10 000-token segment's optimum sqrt(2·L·N_s·F) = sqrt(400 000) ≈ 632 tokens (63
    # chunks); the bound of 1 chunk leaves 10 tokens the only choice.
    one_tier = PlacementRules(kv_tier=0, snapshot_tier=0, final_tier=0)
    base = dataclasses.replace(BASE, rules=one_tier, initial_pressure_factor=1.0)
    assert HiStateCache(dataclasses.replace(base, max_interval_chunks=1)).interval_for(
        10_000) == 10
    assert HiStateCache(base).interval_for(10_000) > 10


def test_config_default_reads_cache_config() -> None:
    assert config_default("ema_alpha") == 0.05
    assert config_default("max_interval_chunks") == 64
    with pytest.raises(KeyError, match="chunk_tokens"):
        config_default("chunk_tokens")  # required: no default


def test_residence_averages_start_at_zero() -> None:
    res = ResidenceTracker()
    assert (res.kv_ema, res.snapshot_ema, res.kv_samples, res.snapshot_samples) == (0.0, 0.0, 0, 0)
