"""Faults of the shared tier with real processes: HiState servers, a Redis Cluster.

Each test starts a 3-master Redis Cluster on loopback (``redis_cluster``) and HiState
servers through the launcher (``test_backend_server.histate``) with separate disk folders
and the same ``shared_tier`` section, driven by the toy hybrid engine client, which
compares every restored byte with what was stored: a node killed after its stores, the
whole cluster stopped and restarted, a master killed mid-run. 0 wrong bytes in each.

Sizes with the harness's engine geometry (``test_backend_server``): one chunk's KV object
is 2,048 B of payload, one snapshot 8,192 B; a session P of 4 chunks with a snapshot at
its end resumes at 4 chunks from 4 KV objects + 1 snapshot.
"""

from __future__ import annotations

import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from support.lmcache_mp import (
    ATTN_GROUP,
    REC_GROUP,
    HybridEngineClient,
    LMCacheServer,
    LMCacheServerError,
    TokenSource,
)
from support.redis_cluster import RedisClusterNodes
from test_backend_server import CHUNK, GEOMETRY, histate, hs, settle, wait_until


def tier_section(cluster: RedisClusterNodes, instance: str,
                 budget_gib: float = 0.01) -> dict[str, Any]:
    """The ``shared_tier`` section of node ``instance`` (deployment ``t``)."""
    return {"nodes": cluster.nodes, "deployment": "t", "instance": instance,
            "budget_gib": budget_gib, "connect_timeout_s": 0.3, "op_timeout_s": 1.0,
            "retry_s": 0.3}


def shared(server: LMCacheServer) -> dict[str, Any]:
    return hs(server)["shared_tier"]


def shared_loads(server: LMCacheServer) -> tuple[int, int]:
    stats = shared(server)["stats"]
    return stats.get(f"loads_group_{ATTN_GROUP}", 0), stats.get(f"loads_group_{REC_GROUP}", 0)


def metrics(server: LMCacheServer) -> str:
    with urllib.request.urlopen(server.endpoints.http_url + "/metrics", timeout=10) as r:
        return r.read().decode()


def entries(cluster: RedisClusterNodes) -> list[dict[str, str]]:
    """Every entry of the shared tier's namespace, read straight from the cluster."""
    from lmcache_histate.backends.server.shared_index.layout import KeySpace
    from redis.cluster import ClusterNode, RedisCluster

    keys = KeySpace("t", "tiny-qwen3-next")
    client = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", s.port)
                                         for s in cluster.servers], decode_responses=True)
    try:
        names = list(client.scan_iter(match=keys.object_pattern, count=1000))
        return [client.hgetall(n) for n in names]
    finally:
        client.close()


def resume(server: LMCacheServer, prompt: list[int]) -> dict[str, Any]:
    return server.http("POST", "/histate/resume", {"token_ids": prompt})


@pytest.fixture
def tokens(request: pytest.FixtureRequest) -> TokenSource:
    import zlib

    return TokenSource(seed=zlib.crc32(request.node.nodeid.encode()))


def _median_lookup_s(engine: HybridEngineClient, p: list[int], n: int = 9) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        got = engine.lookup_and_retrieve(p)
        times.append(time.perf_counter() - t0)
        assert got.hit_chunks == 4 and got.ok
    return statistics.median(times)


def test_cluster_down_the_node_serves_its_own_tiers_as_fast_then_reconciles(
    tmp_path: Path, tokens: TokenSource, redis_cluster: RedisClusterNodes
) -> None:
    """The whole cluster stopped: the node's own hits cost what they cost with the
    cluster up (measured side by side, within 50 ms), restore the same bytes, /status and
    /metrics say degraded; the cluster restarted empty: connected again, the budget
    reconciled to what the cluster holds (nothing), and the next stores go there again."""
    p, q = tokens.tokens(4 * CHUNK), tokens.tokens(4 * CHUNK)
    with histate(tmp_path / "a", tmp_path / "disk-a",
                 shared_tier=tier_section(redis_cluster, "a")) as a:
        with HybridEngineClient(a.endpoints.zmq_url, GEOMETRY) as engine:
            sp = engine.store_chunks(p, snapshot_chunks=[3])
            settle(a)
            expected = engine.stored_bytes(sp, 4)
            assert shared(a)["used_bytes"] > 0
            # Routing: P resumes at its snapshot (chunk 3, 4 chunks); a prompt sharing P's
            # first 3 chunks has their KV here but no snapshot behind any of them: 0.
            assert resume(a, p) == {"instance": "a", "chunk_tokens": CHUNK,
                                    "kv_tokens": 4 * CHUNK, "resumable_tokens": 4 * CHUNK,
                                    "shared_tier": "connected"}
            other = p[: 3 * CHUNK] + tokens.tokens(2 * CHUNK)
            assert resume(a, other)["kv_tokens"] == 3 * CHUNK
            assert resume(a, other)["resumable_tokens"] == 0
            with pytest.raises(LMCacheServerError, match="token_ids must be a list"):
                a.http("POST", "/histate/resume", {"token_ids": ["x"]})
            up = _median_lookup_s(engine, p)
            redis_cluster.stop()
            down = _median_lookup_s(engine, p)
            got = engine.lookup_and_retrieve(p)
            assert engine.retrieved_bytes(got) == expected
            status = shared(a)
            assert status["mode"] == "degraded" and status["connection"]["outages"] == 1
            assert status["connection"]["skipped"] >= 9
            assert "histate_shared_tier_connected 0.0" in metrics(a)
            assert resume(a, p)["resumable_tokens"] == 4 * CHUNK  # no cluster needed
            assert resume(a, p)["shared_tier"] == "degraded"
            print(f"\nown-tier hit, median of 9: cluster up {up * 1e3:.1f} ms, "
                  f"down {down * 1e3:.1f} ms")
            assert down <= up + 0.050

            redis_cluster.start()  # same ports and slots, empty
            wait_until(lambda: shared(a)["mode"] == "connected", "the node to reconnect")
            wait_until(lambda: bool(shared(a)["last_reconcile"]), "a reconcile")
            assert shared(a)["used_bytes"] == 0  # the cluster lost everything: so did the budget
            assert shared(a)["connection"]["recoveries"] == 1
            # Q with an interval snapshot (after chunk 2) and its final one (after chunk 4):
            # A resumes at both from its own tiers; the cluster gets Q's 4 KV chunks and
            # the final snapshot only (shared_tier.plan).
            engine.store_chunks(q, snapshot_chunks=[1, 3])
            settle(a)
            assert shared(a)["used_bytes"] > 0
            assert resume(a, q[: 2 * CHUNK] + p)["resumable_tokens"] == 2 * CHUNK
            rows = entries(redis_cluster)
            assert sorted((e["kind"], e["depth"]) for e in rows) == [
                ("0", "0"), ("0", "1"), ("0", "2"), ("0", "3"), ("1", "3")]
        text = a.log_path.read_text(errors="replace")
        assert text.count("HiState shared tier: Redis at") == 2  # down once, back once


def test_node_a_killed_then_a_master_killed_mid_run_serves_no_wrong_byte(
    tmp_path: Path, tokens: TokenSource, redis_cluster: RedisClusterNodes
) -> None:
    """What node A put in the shared tier outlives A (SIGKILL): B, whose own tiers hold
    nothing, resumes A's 6 sessions (4 chunks each) from the cluster, byte for byte. Then
    B restores them in a loop while one master is SIGKILLed and restarted empty: every
    restore is a miss or exactly the stored bytes; once the cluster is whole again, the
    sessions whose values survived resume from it and the budget counts only what the
    cluster holds."""
    sessions = [tokens.tokens(4 * CHUNK) for _ in range(6)]
    with (
        histate(tmp_path / "a", tmp_path / "disk-a",
                shared_tier=tier_section(redis_cluster, "a")) as a,
        histate(tmp_path / "b", tmp_path / "disk-b",
                shared_tier=tier_section(redis_cluster, "b")) as b,
    ):
        with HybridEngineClient(a.endpoints.zmq_url, GEOMETRY) as engine_a:
            stored = [engine_a.store_chunks(s, snapshot_chunks=[3]) for s in sessions]
            settle(a)
            expected = [engine_a.stored_bytes(sp, 4) for sp in stored]
            # Each session's 4 KV chunks (kept by A's core) and its final snapshot.
            assert shared(a)["stats"]["objects_stored"] == 5 * len(sessions)
            # Ranked by A's core, not by value size: each KV object leaves A's CPU tier
            # with its session's bundle, M = 4 x 2,048 + 8,192 = 16,384 payload bytes; the
            # final snapshot's durable copy on disk frees only itself, M = 8,192.
            rows = entries(redis_cluster)
            assert len(rows) == 5 * len(sessions)
            assert {(e["kind"], float(e["freed"])) for e in rows} == {("0", 16384.0),
                                                                        ("1", 8192.0)}
            assert all(0 < float(e["cost"]) != float(e["size"]) for e in rows)
            a.kill()
        with HybridEngineClient(b.endpoints.zmq_url, GEOMETRY, seed=1) as engine_b:
            for i, s in enumerate(sessions):  # node A is gone
                got = engine_b.lookup_and_retrieve(s)
                assert got.hit_chunks == 4 and engine_b.retrieved_bytes(got) == expected[i]
            assert shared_loads(b) == (4 * len(sessions), len(sessions))
            text = metrics(b)
            assert f'histate_l2_objects_loaded{{tier="shared"}} {5.0 * len(sessions)}' in text
            assert 'histate_l2_objects_loaded{tier="disk"} 0.0' in text

            wrong = hits = 0
            redis_cluster.kill(1)
            for step in range(2 * len(sessions)):
                if step == len(sessions):
                    redis_cluster.servers[1].start()
                    redis_cluster.wait_state("ok", 30)
                    wait_until(lambda: shared(b)["mode"] == "connected", "B to reconnect")
                    wait_until(lambda: bool(shared(b)["last_reconcile"]), "B's reconcile")
                i = step % len(sessions)
                got = engine_b.lookup_and_retrieve(sessions[i])
                if got.hit_chunks:
                    hits += 1
                    wrong += engine_b.retrieved_bytes(got) != expected[i]
            assert wrong == 0
            # Whole again: a session resumes iff all its 5 values survived the kill.
            survived = [engine_b.lookup_and_retrieve(s).hit_chunks == 4 for s in sessions]
        status = shared(b)
        assert status["mode"] == "connected"
        assert status["stats"].get("corrupt_values", 0) == 0
        lost = status["stats"]["values_gone"]
        assert lost > 0  # a master holds about a third of the 30 values
        assert status["used_bytes"] <= status["budget_bytes"]
        print(f"\nsessions resumable after the kill: {sum(survived)} of {len(sessions)}; "
              f"reconcile: {status['last_reconcile']}; hits during the fault: {hits}")
