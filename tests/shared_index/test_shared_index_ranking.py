"""Deployment-wide ``H``: the core's score inputs, published to a real redis-server, rank
the shared disk tier as ``core/rank.py`` ranks it; the deployment's EMAs reach another
server's interval controller.

The core of ``stored()`` (as in ``tests/core/test_cache_facade.py``): chunks of 4 tokens,
10 B of KV per chunk (``token_bytes`` = 10 // 4 = 2 B), 25 B per snapshot (``N_s`` = 12.5
token units), tier 0 = CPU, tier 1 = disk; session "a" = chunks 101..104 with snapshots at
token 8 (chunk 102, intermediate: disk) and 16 (chunk 104, final: CPU), stored at t = 1.
``p_end`` is its prior, 0.9.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from lmcache_histate.backends.server.shared_index.deployment import (
    PROTECTED_RATIO,
    DeploymentSync,
)
from support.redis_server import RedisServer
from support.shared_index import make_index, write

from lmcache_histate.core.cache import CacheConfig, HiStateCache
from lmcache_histate.core.rank import score
from lmcache_histate.core.tiers import KV, SNAPSHOT, ServerTier, TierSpec

CPU, DISK = ServerTier.CPU, ServerTier.DISK
KEYS = [101, 102, 103, 104]


def stored(disk: int = 1000) -> HiStateCache:
    cache = HiStateCache(CacheConfig(
        chunk_tokens=4, kv_chunk_bytes=10, snapshot_bytes=25,
        tiers=(TierSpec("cpu", 1000), TierSpec("disk", disk)),
        supported_intervals=(4, 8),
    ))
    cache.complete(cache.attach("a", KEYS), 16, 1.0, boundaries=[8, 16])
    return cache


def synced(now: float) -> tuple[DeploymentSync, HiStateCache]:
    """A ``DeploymentSync`` fed the placement events of the core of ``stored()`` (as the
    runtime drains them, ``placed``), its clock at ``now``; object keys stood in for by
    strings ``"<node>/<part>"`` (their own ids)."""
    sync = DeploymentSync(lambda nk, part: [f"{nk}/{part}"], lambda key: key, lambda: now)
    cache = stored()
    sync.placed(cache.take_events())
    return sync, cache


def test_the_lua_ranking_is_core_score(redis_server: RedisServer, shared_dir: Path) -> None:
    """tau = 0.1 s. S: a snapshot with C/M = e^3 (expensive to lose); K: a KV chunk with
    C/M = e^-1. H_S = t_S + 0.3, H_K = t_K - 0.1: S outranks (stays) while K is less than
    0.4 s newer, and goes first once a K' is stored more than 0.4 s after it."""
    a = make_index(redis_server.url, "A", tau=0.1)
    a.join(1 << 20)
    client = a.conn.client
    s = write(shared_dir, 1, b"s" * 100, cost=0.0)
    k = write(shared_dir, 2, b"k" * 100, kind=0, cost=0.0)
    a.commit([s])
    a.commit([k])
    assert a.rescore([(s.id, s.size * math.exp(3), s.size), (k.id, k.size * math.exp(-1),
                                                              k.size)]) == 2
    t_s, t_k = (float(client.hget(a.keys.entry(r.id), "t")) for r in (s, k))
    assert t_k - t_s < 0.4  # committed one after the other
    for r, t, ln_ratio in ((s, t_s, 3.0), (k, t_k, -1.0)):
        h = client.zscore(a.keys.rank, r.id)
        assert h == pytest.approx(t + 0.1 * ln_ratio, abs=1e-4)  # by hand
        assert h == pytest.approx(score(t, r.size * math.exp(ln_ratio), r.size, 0.1), abs=1e-4)
    assert [v.id for v in a.claim(1)] == [k.id]  # the newer, cheap K goes first
    # Wait (on Redis's clock) until more than 0.4 s have passed since S was accessed.
    deadline = time.monotonic() + 10
    while (lambda sec_us: sec_us[0] + sec_us[1] / 1e6)(client.time()) < t_s + 0.5:
        assert time.monotonic() < deadline
    k2 = write(shared_dir, 3, b"q" * 100, kind=0, cost=0.0)
    a.commit([k2])
    a.rescore([(k2.id, k2.size * math.exp(-1), k2.size)])
    # H_K' = t_K' - 0.1 > t_S + 0.5 - 0.1 = t_S + 0.4 > H_S = t_S + 0.3: S goes first now.
    assert [v.id for v in a.claim(1)] == [s.id]


def test_c_is_the_sum_of_the_servers_shares(redis_server: RedisServer,
                                            shared_dir: Path) -> None:
    """A commits with its C = 40 (M = 100); B's core also holds the object for its own
    sessions: C = 60. cost = 40 + 60 = 100, H = t + 10 * ln(100/100) = t. B's sessions end
    (share 0, M unchanged): cost = 40, H = t + 10 * ln(0.4) = t - 9.162907."""
    a, b = make_index(redis_server.url, "A", tau=10.0), make_index(redis_server.url, "B",
                                                                    tau=10.0)
    a.join(1 << 20)
    r = write(shared_dir, 1, b"x" * 100, cost=40.0, freed=100.0)
    a.commit([r])
    entry = a.keys.entry(r.id)
    client = a.conn.client
    t = float(client.hget(entry, "t"))
    assert b.rescore([(r.id, 60.0, 100.0)]) == 1
    assert float(client.hget(entry, "cost")) == 100.0
    assert client.zscore(a.keys.rank, r.id) == pytest.approx(t, abs=1e-4)
    b.rescore([(r.id, 0.0, -1.0)])
    assert (float(client.hget(entry, "cost")), float(client.hget(entry, "freed"))) == (40.0, 100.0)
    assert client.zscore(a.keys.rank, r.id) == pytest.approx(t - 9.162907, abs=1e-4)
    # An access 0 s ago through B moves t forward to B's "now"; never backwards.
    b.rescore([(r.id, 0.0, -1.0, 0.0)])
    assert float(client.hget(entry, "t")) >= t
    b.rescore([(r.id, 0.0, -1.0, 3600.0)])  # an hour ago: t stays
    assert float(client.hget(entry, "t")) >= t


def test_collect_publishes_the_cores_inputs_once() -> None:
    """The runtime's part: what a tick publishes for the core of ``stored()`` after its
    bundle was demoted (values of the first test), and nothing again when they did not
    change."""
    sync, cache = synced(now=10.0)
    cache.evict(CPU, 1, 2.0)
    sync.placed(cache.take_events())
    batch = sync.collect(cache, lambda: KEYS, 4, 0)
    by_id = {u[0]: tuple(round(x, 9) for x in u[1:]) for u in batch.updates}
    # (C, M, age = now - t = 10 - 1 = 9 s)
    assert by_id == {
        f"102/{SNAPSHOT}": (15.2, 25.0, 9.0),
        f"103/{KV}": (14.4, 45.0, 9.0), f"104/{KV}": (14.4, 45.0, 9.0),
        f"104/{SNAPSHOT}": (14.4, 45.0, 9.0),
    }
    assert sync.collect(cache, lambda: KEYS, 4, 0).updates == []  # unchanged: not again
    cache.evict(CPU, 1000, 3.0)
    sync.placed(cache.take_events())
    batch = sync.collect(cache, lambda: KEYS, 4, 0)
    by_id = {u[0]: u[1:3] for u in batch.updates}
    # Interior KV 101, 102: protected (C/M = 1e9 per byte-unit: C = 1e9, M = 1).
    assert by_id == {f"101/{KV}": (PROTECTED_RATIO, 1.0), f"102/{KV}": (PROTECTED_RATIO, 1.0)}


def test_a_cpu_drop_is_a_residence_sample_and_a_disk_drop_withdraws_the_share() -> None:
    """Everything stored at t = 1. The disk is made 0 B at clock 11: the intermediate
    snapshot leaves the disk (its file stays the deployment's: no sample, share 0). Then
    the CPU tier is made 0 B: with no room below, its 4 KV chunks and the final snapshot
    leave the cache: 4 ``kv`` samples and 1 ``state`` sample of 11 - 1 = 10 s."""
    sync, cache = synced(now=11.0)
    cache.set_capacity(DISK, 0, 11.0)
    sync.placed(cache.take_events())
    batch = sync.collect(cache, lambda: KEYS, 4, 0)
    assert batch.samples == []
    assert (f"102/{SNAPSHOT}", 0.0, -1.0, -1.0) in batch.updates
    cache.set_capacity(CPU, 0, 11.0)
    sync.placed(cache.take_events())
    batch = sync.collect(cache, lambda: KEYS, 4, 0)
    assert sorted(batch.samples) == [("kv", 10.0)] * 4 + [("state", 10.0)]


def test_pressure_seen_by_a_changes_the_interval_b_plans(redis_server: RedisServer) -> None:
    """A's evictions (residence samples kv 100 s, state 1 s, sent with ``observe`` as A's
    tick does) reach B's core at B's next tick: F = T_KV / T_state = 100/1 = 100.
    B plans a 64-token segment with N_s = 12.5 and I in {4, 8}: cost I/2 + F * 12.5 * 64/I:
    F = 0 (no snapshot seen leaving): I = 4 -> 2, I = 8 -> 4: 4;
    F = 100: I = 4 -> 2 + 20,000 = 20,002, I = 8 -> 4 + 10,000 = 10,004: 8."""
    a, b = make_index(redis_server.url, "A"), make_index(redis_server.url, "B")
    core_b = stored()
    sync_b = DeploymentSync(lambda nk, part: [], str, time.time)
    assert core_b.interval_for(64) == 4
    a.sync([("kv", 100.0), ("state", 1.0)], [], [("s1", "", 0)])
    emas = sync_b.sync(b, sync_b.collect(core_b, lambda: [], 4, 0))
    assert emas == {"kv": 100.0, "kv_n": 1.0, "state": 1.0, "state_n": 1.0}
    assert sync_b.apply(core_b, emas) == pytest.approx(100.0)
    assert core_b.interval_for(64) == 8
    assert core_b.stats().pressure_factor == pytest.approx(100.0)
