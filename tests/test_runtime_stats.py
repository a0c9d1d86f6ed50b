"""The runtime's counters (``backends/server/runtime/stats.py``): declared keys only.

A counter written or read under a key nobody declared (a typo) raises ``KeyError`` naming
it, where a ``Counter`` read 0; ``/metrics`` reads declared keys and refuses, at
registration, a series over an undeclared one.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from lmcache_histate.backends.server import metrics
from lmcache_histate.backends.server.runtime.stats import KEYS, Stats


def test_the_keys_are_parts_by_tiers_by_events_and_the_named_ones() -> None:
    """2 parts x 2 tiers x 3 events (12) + 2 parts x 4 tier-less events (8) + 2 x 3 hook
    counters (6) + 19 named = 45 keys, each at 0 at the start."""
    assert len(KEYS) == 45
    assert {"kv_stored.cpu", "snapshot_lost.disk", "kv_demoted", "snapshot_not_placed",
            "errors.lookup", "over_max_model_tokens.store", "hits.end"} <= KEYS
    stats = Stats()
    assert set(stats) == KEYS and not any(stats.values()) and stats.counted() == {}


def test_a_typo_raises_where_a_declared_key_counts() -> None:
    stats = Stats()
    part, tier = "snapshot", "disk"
    stats[f"{part}_stored.{tier}"] += 1
    stats["hit_tokens"] += 32
    assert stats["snapshot_stored.disk"] == 1
    assert stats.counted() == {"hit_tokens": 32, "snapshot_stored.disk": 1}
    with pytest.raises(KeyError, match=r"no runtime counter 'snapshot_stored\.dsik'"):
        stats[f"{part}_stored.dsik"] += 1
    with pytest.raises(KeyError, match="'hits_tokens'"):
        _ = stats["hits_tokens"]  # a read of a typo
    with pytest.raises(KeyError, match="'lookup'"):
        stats.update({"lookups": 1, "lookup": 1})
    assert stats["lookups"] == 0  # the refused update changed nothing
    stats.check()
    dict.__setitem__(stats, "stray", 1)  # an assignment the dict itself lets through
    with pytest.raises(AssertionError, match="undeclared runtime counters"):
        stats.check()


def test_metrics_read_declared_keys_and_refuse_a_typo() -> None:
    """Every ``/metrics`` counter series reads a declared key: one STORE's counts show up
    under their labels; a series over an undeclared key fails when it is built."""
    stats = Stats()
    stats["snapshot_stored.disk"] += 2
    stats["kv_lost.cpu"] += 1
    series = metrics._series(SimpleNamespace(stats=stats))  # type: ignore[arg-type]
    assert series["histate_snapshots_stored"]() == [(0.0, {"tier": "cpu"}),
                                                    (2.0, {"tier": "disk"})]
    assert (1.0, {"reason": "lost_cpu"}) in series["histate_kv_chunks_dropped"]()
    del stats["hit_tokens"]  # as if metrics named a counter nobody declares
    with pytest.raises(KeyError, match="undeclared runtime counters"):
        metrics._series(SimpleNamespace(stats=stats))  # type: ignore[arg-type]
