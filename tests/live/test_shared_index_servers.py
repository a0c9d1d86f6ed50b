"""Two real HiState servers on one disk folder, sharing one index in a real redis-server.

Each test starts a ``redis-server`` on a free port (the ``redis_server`` fixture) and two
servers through the launcher (``test_backend_server.histate``) whose YAML carries the
same ``shared_index`` section (instances ``a`` and ``b``), and drives them with the toy
hybrid engine client: what server A writes to the shared folder, server B finds through
the index and loads.

Sizes with the harness's default engine geometry (``test_backend_server``): one chunk's
attention object is 2,048 B of payload, one recurrent snapshot 8,192 B.
"""

from __future__ import annotations

import contextlib
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from lmcache_histate.backends.server.disk import file_format as df
from lmcache_histate.backends.server.shared_index.layout import KeySpace
from support.lmcache_mp import (
    ATTN_GROUP,
    REC_GROUP,
    HybridEngineClient,
    LMCacheServer,
    TokenSource,
)
from support.redis_server import RedisServer
from test_backend_server import (
    CHUNK,
    GEOMETRY,
    KV,
    SNAP,
    cpu_fill_for,
    histate,
    hs,
    loads,
    on_disk,
    settle,
    wait_until,
)

DEPLOYMENT = "t"
MODEL = "tiny-qwen3-next"  # the namespace the launcher derives from the YAML's model


def section(url: str, instance: str) -> dict[str, Any]:
    return {
        "url": url, "deployment": DEPLOYMENT, "instance": instance,
        "connect_timeout_s": 0.3, "op_timeout_s": 0.3, "retry_s": 0.2, "lease_ttl_s": 2.0,
    }


@contextlib.contextmanager
def two_servers(
    tmp_path: Path, disk: Path, url: str, **values: Any
) -> Iterator[tuple[LMCacheServer, LMCacheServer]]:
    with (
        histate(tmp_path / "a", disk, shared_index=section(url, "a"), **values) as a,
        histate(tmp_path / "b", disk, shared_index=section(url, "b"), **values) as b,
    ):
        yield a, b


def shared(server: LMCacheServer) -> dict[str, Any]:
    return hs(server)["disk"]["shared_index"]


def entries(url: str) -> dict[str, dict[str, str]]:
    """Every object entry of the namespace (id -> fields), read straight from Redis."""
    keys = KeySpace(DEPLOYMENT, MODEL)
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        names = list(client.scan_iter(match=keys.object_pattern, count=1000))
        return {keys.id_of(n): client.hgetall(n) for n in names}
    finally:
        client.close()


def files(disk: Path) -> dict[str, int]:
    """Object files of the shared folder: relative path -> size."""
    return {
        str(p.relative_to(disk)): p.stat().st_size
        for p in df.iter_files(disk) if p.name.endswith(df.SUFFIX)
    }


def store_demoted(server: LMCacheServer, engine: HybridEngineClient, p: list[int],
                  q: list[int]) -> tuple[bytes, bytes]:
    """Store session P, then Q, whose bundle pushes P's (4 KV chunks + its snapshot) to the
    shared folder; returns the bytes a 4-chunk hit of P must restore."""
    sp = engine.store_chunks(p, snapshot_chunks=[3])
    engine.store_chunks(q, snapshot_chunks=[3])
    settle(server)
    return engine.stored_bytes(sp, 4)


def metrics(server: LMCacheServer) -> str:
    with urllib.request.urlopen(server.endpoints.http_url + "/metrics", timeout=10) as r:
        return r.read().decode()


@pytest.fixture
def tokens(request: pytest.FixtureRequest) -> TokenSource:
    import zlib

    return TokenSource(seed=zlib.crc32(request.node.nodeid.encode()))


# ------------------------------------------------------------------------------------------
def test_b_loads_what_a_stored_bytes_identical(
    tmp_path: Path, tokens: TokenSource, redis_server: RedisServer
) -> None:
    """A session stored through A and demoted to the shared folder is restored through B,
    whose own CPU tier and local view hold nothing of it: 4 KV chunks + the snapshot come
    from A's files, byte for byte."""
    disk = tmp_path / "disk"
    fill = cpu_fill_for(4 * KV + SNAP + 3 * KV)
    p, q = tokens.tokens(4 * CHUNK), tokens.tokens(4 * CHUNK)
    with two_servers(tmp_path, disk, redis_server.url, cpu_fill=fill) as (a, b):
        with HybridEngineClient(a.endpoints.zmq_url, GEOMETRY) as engine_a:
            expected = store_demoted(a, engine_a, p, q)
            assert on_disk(disk, engine_a, p, ATTN_GROUP) == [0, 1, 2, 3]
            assert on_disk(disk, engine_a, p, REC_GROUP) == [3]
        # Every file A wrote is an entry owned by A, stored, of the file's size.
        on_folder = files(disk)
        index = entries(redis_server.url)
        assert {e["path"]: int(e["size"]) for e in index.values()} == on_folder
        assert {e["owner"] for e in index.values()} == {"a"}
        assert {e["state"] for e in index.values()} == {"stored"}
        assert shared(a)["used_bytes"] == sum(on_folder.values())
        # Ranked by A's core (shared_link NOTE 2, docs/shared-index.md §3): P's 4 KV chunks
        # and its snapshot leave the disk as one bundle, M = 4 × 2,048 + 8,192 = 16,384
        # payload bytes each; Q's final snapshot has a write-through copy on the folder
        # (its KV is on A's CPU tier): its bundle frees only that copy there, M = 8,192.
        # C is A's share alone (B's core holds none of them): C ≠ M.
        assert sorted(float(e["freed"]) for e in index.values()) == [SNAP] + [4 * KV + SNAP] * 5
        assert all(float(e["cost"]) == float(e["c:a"]) > 0 for e in index.values())
        assert all(float(e["cost"]) != float(e["freed"]) for e in index.values())

        with HybridEngineClient(b.endpoints.zmq_url, GEOMETRY, seed=1) as engine_b:
            assert loads(b) == (0, 0)
            got = engine_b.lookup_and_retrieve(p)
            assert got.hit_chunks == 4
            assert engine_b.retrieved_bytes(got) == expected
            assert loads(b) == (4, 1)  # 4 KV chunks + 1 snapshot read from A's files
        link = shared(b)["link"]
        assert link["lookup_hits"] >= 5
        # The load leases were given back (by B's background thread, right after the
        # unlock): nothing blocks an eviction of these files.
        client = redis.Redis.from_url(redis_server.url, decode_responses=True)
        keys = KeySpace(DEPLOYMENT, MODEL)
        wait_until(lambda: sum(client.zcard(keys.lease(i)) for i in index) == 0,
                   "B's leases given back", timeout=5)
        client.close()


def test_redis_killed_both_keep_serving_then_reregister(
    tmp_path: Path, tokens: TokenSource, redis_server: RedisServer
) -> None:
    """Redis killed (its data lost): both servers keep answering from their local view
    (A still restores its own files, B misses them instead of failing), degraded mode shows
    in /status and /metrics; Redis back empty: A registers its files again and B hits them."""
    disk = tmp_path / "disk"
    fill = cpu_fill_for(4 * KV + SNAP + 3 * KV)
    p, q = tokens.tokens(4 * CHUNK), tokens.tokens(4 * CHUNK)
    with two_servers(tmp_path, disk, redis_server.url, cpu_fill=fill) as (a, b):
        with HybridEngineClient(a.endpoints.zmq_url, GEOMETRY) as engine_a:
            expected = store_demoted(a, engine_a, p, q)
            registered = len(entries(redis_server.url))
            assert registered == len(files(disk)) >= 5

            redis_server.kill()
            a.clear_l1()
            settle(a)
            got = engine_a.lookup_and_retrieve(p)  # A's local view: its own files
            assert got.hit_chunks == 4 and engine_a.retrieved_bytes(got) == expected
            status_a = shared(a)
            assert status_a["mode"] == "degraded"
            assert status_a["connection"]["outages"] == 1
            assert "histate_shared_index_connected 0.0" in metrics(a)

        with HybridEngineClient(b.endpoints.zmq_url, GEOMETRY, seed=1) as engine_b:
            got = engine_b.lookup_and_retrieve(p)  # B's local view holds none of them
            assert got.hit_chunks == 0 and got.ok
            assert b.http("GET", "/healthcheck") == {"status": "healthy"}
            assert shared(b)["mode"] == "degraded"

            redis_server.start()  # same port, empty
            wait_until(lambda: shared(a)["mode"] == "connected", "A to reconnect")
            wait_until(lambda: shared(b)["mode"] == "connected", "B to reconnect")
            # A registered again every file it holds (P's 5 objects + Q's final snapshot).
            wait_until(lambda: len(entries(redis_server.url)) == len(files(disk)),
                       "A's files registered again")
            assert shared(a)["registrar"]["reregistered"] == len(files(disk))
            assert "histate_shared_index_connected 1.0" in metrics(a)
            got = engine_b.lookup_and_retrieve(p)
            assert got.hit_chunks == 4 and engine_b.retrieved_bytes(got) == expected


def test_concurrent_eviction_from_both_stays_in_budget_and_orphans_nothing(
    tmp_path: Path, tokens: TokenSource, redis_server: RedisServer
) -> None:
    """Both servers write sessions at once into a deployment budget of 12 KV chunk files:
    writes evict by the deployment ranking from both sides. At the end the budget holds,
    every entry is a stored file of its size and every file is an entry (nothing evicted
    twice, nothing orphaned), and nothing either server loaded was corrupt."""
    disk = tmp_path / "disk"
    kv_file = KV + 200  # payload + header (< 200 B: the key's model name, hash, parent)
    budget = 12 * kv_file + 2 * (SNAP + 200)
    fill = cpu_fill_for(4 * KV + SNAP + 3 * KV)
    sessions = [tokens.tokens(4 * CHUNK) for _ in range(12)]
    with two_servers(
        tmp_path, disk, redis_server.url, cpu_fill=fill, disk_gib=budget / 2**30
    ) as (a, b):
        errors: list[BaseException] = []

        def drive(server: LMCacheServer, mine: list[list[int]], seed: int) -> None:
            try:
                with HybridEngineClient(server.endpoints.zmq_url, GEOMETRY, seed=seed) as e:
                    for s in mine:
                        e.store_chunks(s, snapshot_chunks=[3])
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        threads = [
            threading.Thread(target=drive, args=(a, sessions[0::2], 1)),
            threading.Thread(target=drive, args=(b, sessions[1::2], 2)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        settle(a)
        settle(b)
        on_folder = files(disk)
        index = entries(redis_server.url)
        assert {e["state"] for e in index.values()} <= {"stored"}
        assert {e["path"]: int(e["size"]) for e in index.values()} == on_folder
        used, deployment_budget = shared(a)["used_bytes"], shared(a)["budget_bytes"]
        assert deployment_budget == int(budget / 2**30 * 2**30)
        assert used == sum(on_folder.values()) <= deployment_budget
        evicted = shared(a)["link"].get("evicted", 0) + shared(b)["link"].get("evicted", 0)
        assert evicted >= 1  # 12 sessions' files do not fit: the ranking made room
        for server in (a, b):
            assert hs(server)["disk"]["stats"].get("corrupt_files", 0) == 0
        # The deployment's residence EMAs (every eviction of both servers) drive both
        # interval controllers: each server's pressure factor is the deployment's
        # F = T_KV / T_state (0 until a snapshot left, 1 until KV did too: core/interval.py
        # NOTE 2), read back on its ticks.
        client = redis.Redis.from_url(redis_server.url, decode_responses=True)
        ema_key = KeySpace(DEPLOYMENT, MODEL).ema

        def deployment_f() -> float:
            e = {k: float(v) for k, v in client.hgetall(ema_key).items()}
            if not e.get("state_n"):
                return 0.0
            if not e.get("kv_n"):
                return 1.0
            if e["state"] <= 0:
                return 1.0 if e["kv"] <= 0 else 1e6
            return max(e["kv"] / e["state"], 1e-6)

        n_kv, n_state = (float(client.hget(ema_key, f) or 0) for f in ("kv_n", "state_n"))
        assert n_kv + n_state >= evicted  # each deletion is a sample
        # Bundles (KV + snapshot, one H) left: both kinds seen, so F is measured.
        assert n_kv > 0 and n_state > 0
        wait_until(lambda: all(abs(hs(s)["pressure_factor"] - deployment_f()) < 1e-9
                               for s in (a, b)), "both servers follow the deployment's F")
        for server in (a, b):  # both published their cores' score inputs and samples
            sync = hs(server)["deployment_sync"]
            assert sync["syncs"] > 0 and sync["published"] > 0 and sync["sessions"] > 0
        client.close()


def test_unreachable_redis_or_another_budget_refuses_the_start(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A server whose Redis cannot be reached does not start serving a shared folder from a
    partial view; nor does one configured with another disk budget than the deployment's:
    both fail at start, the message naming the key."""
    from lmcache_histate.backends.demo.servers import free_port
    from support.lmcache_mp import LMCacheServerError

    disk = tmp_path / "disk"
    closed = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    with (
        pytest.raises(LMCacheServerError, match=r"shared_index: Redis at \S+ is unreachable"),
        histate(tmp_path / "down", disk, shared_index=section(closed, "a")),
    ):
        pass
    with (
        histate(tmp_path / "a", disk, shared_index=section(redis_server.url, "a")),
        pytest.raises(LMCacheServerError, match="disk_gib: this server's disk budget"),
        histate(tmp_path / "b", disk, shared_index=section(redis_server.url, "b"),
                disk_gib=0.02),
    ):
        pass
