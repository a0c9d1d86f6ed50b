"""The shared tier (L2 adapter on a Redis Cluster) driven through LMCache's adapter API.

Real parts: a 3-master Redis Cluster on loopback (``support.redis_cluster``) and two
adapters standing for two nodes (instances ``a`` and ``b``) of one deployment. These pin
down what a node reads from another through the cluster, that a wrong value is never
served, the one budget, and the faults: the whole cluster down and back, one master
killed and restarted empty. The vLLM round trip across two servers is
``test_shared_tier_vllm.py``.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Iterator
from typing import Any

import pytest
from lmcache_histate.backends.server.disk import file_format as df
from lmcache_histate.backends.server.disk.shared_link import key_id
from lmcache_histate.backends.server.shared_tier.tier import HiStateSharedAdapter
from support.redis_cluster import RedisClusterNodes
from test_backend_disk_tier import MODEL, key, load, lookup, store

PAYLOAD = 1000


def value_size(i: int) -> int:
    """Bytes of one test object's value: the disk format's 32-byte fixed header, the
    encoded key (model length 2 + model, rank 4, group 4, hash length 2 + the 32-byte hash,
    salt length 2, no salt), no parent, then the payload."""
    oid = df.ObjectId.of(key(i))
    return 32 + (2 + len(MODEL) + 4 + 4 + 2 + len(oid.chunk_hash) + 2) + PAYLOAD


def params(cluster: RedisClusterNodes, instance: str, budget: int = 1 << 20,
           **more: Any) -> dict[str, Any]:
    return {"shared_tier": {"nodes": cluster.nodes, "deployment": "t", "instance": instance,
                            "budget_gib": budget / 2**30, "retry_s": 0.3, **more},
            "index_model": "m"}


@pytest.fixture
def nodes(redis_cluster: RedisClusterNodes) -> Iterator[tuple[HiStateSharedAdapter, ...]]:
    a = HiStateSharedAdapter(params(redis_cluster, "a", budget=10 * value_size(0)))
    b = HiStateSharedAdapter(params(redis_cluster, "b", budget=10 * value_size(0)))
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def payload(i: int) -> bytes:
    return bytes([i % 251]) * PAYLOAD


def test_b_loads_what_a_stored_verified_and_counted_once(
    redis_cluster: RedisClusterNodes, nodes: tuple[HiStateSharedAdapter, ...]
) -> None:
    a, b = nodes
    keys = [key(i) for i in range(3)]
    assert store(a, keys, [payload(i) for i in range(3)])
    assert lookup(b, keys) == [0, 1, 2]
    hits, data = load(b, keys, [PAYLOAD] * 3)
    assert hits == [0, 1, 2] and data == [payload(i) for i in range(3)]
    status = b.report_status()
    assert status["mode"] == "connected"
    assert status["used_bytes"] == 3 * value_size(0)  # one budget: bytes of the values
    assert status["stats"]["objects_loaded"] == 3
    # Stored again by B: present, nothing written twice, nothing counted twice.
    assert store(b, keys, [payload(i) for i in range(3)])
    assert b.report_status()["stats"]["present"] == 3
    assert b.report_status()["used_bytes"] == 3 * value_size(0)


def test_a_wrong_value_is_never_served_and_leaves(
    redis_cluster: RedisClusterNodes, nodes: tuple[HiStateSharedAdapter, ...]
) -> None:
    a, b = nodes
    keys = [key(i) for i in range(3)]
    assert store(a, keys, [payload(i) for i in range(3)])
    v0, v1, v2 = (a.value_key(key_id(k)) for k in keys)
    good = a.data.get(v0)
    flipped = bytearray(a.data.get(v1))
    flipped[-1] ^= 1  # one payload bit
    a.data.set(v1, bytes(flipped))
    a.data.set(v2, good)  # a whole valid value of another object
    assert lookup(b, keys) == [0, 1, 2]  # the entries say stored ...
    hits, data = load(b, keys, [PAYLOAD] * 3)
    assert hits == [0]  # ... only the intact one is served
    assert data[1] == bytes(PAYLOAD) and data[2] == bytes(PAYLOAD)  # nothing copied out
    stats = b.report_status()
    assert stats["stats"]["corrupt_values"] == 2
    assert stats["used_bytes"] == value_size(0)  # their entries and bytes went
    assert a.data.exists(v1, v2) == 0  # and their values
    assert lookup(b, keys) == [0]


def test_one_budget_for_every_node_evicts_by_rank(redis_cluster: RedisClusterNodes) -> None:
    size = value_size(0)
    # No fault here: a loaded host's slow call must not trip the breaker (generous waits).
    slow = {"op_timeout_s": 20.0, "connect_timeout_s": 10.0}
    a = HiStateSharedAdapter(params(redis_cluster, "a", budget=2 * size + size // 2, **slow))
    b = HiStateSharedAdapter(params(redis_cluster, "b", budget=2 * size + size // 2, **slow))
    try:
        assert store(a, [key(0)], [payload(0)]), a.report_status()
        time.sleep(1.1)  # H = t + ...: the second object is accessed a second later
        assert store(a, [key(1)], [payload(1)]), a.report_status()
        # Over budget: the lowest H (key 0) goes.
        assert store(b, [key(2)], [payload(2)]), b.report_status()
        status = b.report_status()
        assert status["used_bytes"] == 2 * size <= status["budget_bytes"]
        assert lookup(a, [key(0), key(1), key(2)]) == [1, 2]
        assert a.data.exists(a.value_key(key_id(key(0)))) == 0
        assert b.report_status()["stats"]["evicted"] == 1
    finally:
        a.close()
        b.close()


def _lookup_seconds(node: HiStateSharedAdapter, keys: list, n: int = 15) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        lookup(node, keys)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def test_cluster_down_then_back(
    redis_cluster: RedisClusterNodes, nodes: tuple[HiStateSharedAdapter, ...],
    caplog: pytest.LogCaptureFixture,
) -> None:
    a, b = nodes
    keys = [key(i) for i in range(4)]
    assert store(a, keys, [payload(i) for i in range(4)])
    up = _lookup_seconds(b, keys)
    caplog.set_level(logging.WARNING, logger="lmcache_histate.shared_index")
    redis_cluster.stop()
    first = time.perf_counter()
    assert lookup(b, keys) == []  # the call that finds out: refused at once on loopback
    first = time.perf_counter() - first
    down = _lookup_seconds(b, keys)
    assert b.report_status()["mode"] == "degraded"
    assert b.report_status()["connection"]["skipped"] >= 15
    assert not store(a, keys, [payload(i) for i in range(4)])  # no write while down
    print(f"\nlookup median: cluster up {up * 1e3:.3f} ms, down {down * 1e3:.3f} ms "
          f"(first call {first * 1e3:.1f} ms)")
    assert down <= up + 0.050
    lines = [r.getMessage() for r in caplog.records if "HiState shared tier" in r.getMessage()]
    assert sum("unreachable" in m for m in lines) == 2  # one per node, once
    redis_cluster.start()  # restarted empty, same slots
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (a.degraded or b.degraded
                                           or not b.report_status()["last_reconcile"]):
        time.sleep(0.1)
    lines = [r.getMessage() for r in caplog.records if "HiState shared tier" in r.getMessage()]
    assert sum("usable again" in m for m in lines) == 2
    # Everything was lost with the cluster: the budget says so, and the tier works again.
    assert b.report_status()["used_bytes"] == 0
    assert lookup(b, keys) == []
    assert store(a, keys, [payload(i) for i in range(4)])
    assert lookup(b, keys) == [0, 1, 2, 3]
    hits, data = load(b, keys, [PAYLOAD] * 4)
    assert hits == [0, 1, 2, 3] and data == [payload(i) for i in range(4)]


def test_a_master_killed_loses_only_its_values(
    redis_cluster: RedisClusterNodes, nodes: tuple[HiStateSharedAdapter, ...]
) -> None:
    a, b = nodes
    keys = [key(i) for i in range(8)]
    assert store(a, keys, [payload(i) for i in range(8)])
    index_node = a.data.get_node_from_key(a.index.keys.used).port
    where = {i: a.data.get_node_from_key(a.value_key(key_id(k))).port for i, k in enumerate(keys)}
    victims = [n for n, s in enumerate(redis_cluster.servers)
               if s.port != index_node and s.port in where.values()]
    assert victims, where  # 8 values over 3 masters: another master holds some
    dead = redis_cluster.servers[victims[0]].port
    lost = sorted(i for i, port in where.items() if port == dead)
    redis_cluster.kill(victims[0])
    redis_cluster.wait_state("fail", 15)  # full coverage required: the cluster refuses
    assert lookup(b, keys) == [] and b.degraded
    redis_cluster.servers[victims[0]].start()  # back empty, with its slots
    redis_cluster.wait_state("ok", 30)
    # Each node that saw the outage reconciles once every master answers (a try while the
    # killed one still refused changes nothing: its values are unknown, not gone); the
    # first to run forgets the lost entries, the other finds nothing left to forget.
    def gone() -> int:
        return sum(n.report_status()["stats"].get("values_gone", 0) for n in (a, b))

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (b.degraded or gone() < len(lost)):
        time.sleep(0.1)
    assert gone() == len(lost)
    kept = [i for i in range(8) if i not in lost]
    assert b.report_status()["used_bytes"] == len(kept) * value_size(0)
    assert lookup(b, keys) == kept
    hits, data = load(b, keys, [PAYLOAD] * 8)
    assert hits == kept
    # Every buffer is the right object or untouched zeros: 0 wrong bytes.
    for i, got in enumerate(data):
        assert got in (payload(i), bytes(PAYLOAD))
