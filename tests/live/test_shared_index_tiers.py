"""Disk tiers of several servers (``HiStateDiskAdapter`` with a ``shared_index`` section, the
part of a server that reads, writes and deletes the shared folder) against a real
redis-server: a degraded server writes within its share of the budget; a server killed
(SIGKILL, a real process) while it holds load leases blocks nothing past the lease TTL.

Every object here has a 1,000-byte payload and the same key shape, so every file has the
same size ``F`` (header + 1,000 B); budgets are counted in ``F``.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import redis
from lmcache_histate.backends.server.disk import file_format as df
from lmcache_histate.backends.server.disk.keys import to_oid
from lmcache_histate.backends.server.disk.shared_link import key_id
from lmcache_histate.backends.server.disk.tier import HiStateDiskAdapter
from lmcache_histate.backends.server.shared_index.layout import KeySpace
from support.redis_server import RedisServer
from test_backend_disk_tier import MODEL, key, lookup, store

PAYLOAD = 1000
KEYS = KeySpace("t", MODEL)
F = df.header_size(to_oid(key(1)), b"") + PAYLOAD  # one file's size


def tier(folder: Path, url: str, instance: str, budget: int, **index: Any) -> HiStateDiskAdapter:
    section = {"url": url, "deployment": "t", "instance": instance, "connect_timeout_s": 0.3,
               "op_timeout_s": 0.3, "retry_s": 0.2, **index}
    return HiStateDiskAdapter({"path": str(folder), "capacity_bytes": budget, "model": MODEL,
                               "shared_index": section})


def files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size
            for p in df.iter_files(folder) if p.name.endswith(df.SUFFIX)}


def payloads(n: int) -> list[bytes]:
    return [bytes([n % 256]) * PAYLOAD]


def test_degraded_servers_write_within_their_share(tmp_path: Path,
                                                   redis_server: RedisServer) -> None:
    """Budget 10 F. A stores 2 objects while Redis answers; both servers heartbeat: 2 alive,
    used 2 F, A's own 2 F, B's 0. Redis is killed; each server tries 8 more objects.
    Shares (shared_link NOTE 4): A holds at most 2 F + (10 F - 2 F) // 2 = 6 F (4 more
    objects), B 0 + 4 F (4 objects): 2 + 4 + 4 = 10 files = the budget. Without the
    share each would have written 8: 18 files in a 10-file budget."""
    folder = tmp_path / "shared"
    a = tier(folder, redis_server.url, "a", 10 * F)
    b = tier(folder, redis_server.url, "b", 10 * F)
    try:
        assert store(a, [key(1), key(2)], payloads(1) * 2)
        a.shared.heartbeat()
        b.shared.heartbeat()
        assert (a.shared.alive, b.shared.alive) == (2, 2)
        redis_server.kill()
        a_ok = [store(a, [key(10 + i)], payloads(i)) for i in range(8)]
        b_ok = [store(b, [key(20 + i)], payloads(i)) for i in range(8)]
        assert a.shared.index.conn.degraded and b.shared.index.conn.degraded
        assert (a.shared.degraded_share(), b.shared.degraded_share()) == (6 * F, 4 * F)
        assert a_ok == [True] * 4 + [False] * 4
        assert b_ok == [True] * 4 + [False] * 4
        assert (a.stats["not_persisted_degraded_share"],
                b.stats["not_persisted_degraded_share"]) == (4, 4)
        on_disk = files(folder)
        assert len(on_disk) == 10 and sum(on_disk.values()) == 10 * F  # the budget, exactly
    finally:
        a.close()
        b.close()


def lock_and_wait(folder: str, url: str, ids: list[int], ready: Any) -> None:
    """Child process body, server B's disk tier: lookup-and-lock A's objects (the step
    before a load: their leases are taken), signal ``ready``, and never unlock."""
    b = tier(Path(folder), url, "b", 2 * F, lease_ttl_s=2.0)
    assert lookup(b, [key(i) for i in ids]) == list(range(len(ids)))
    ready.set()
    time.sleep(600)


def test_a_server_killed_while_loading_blocks_nothing_past_its_leases(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Budget 2 F, full with A's objects 1 and 2. B (another process) locks both for a
    load and is SIGKILLed holding the leases (TTL 2 s). While the leases live, A's next
    store finds no victim it may claim: object 3 is not persisted and both files stay.
    Once they expired (polled, on Redis's clock), the store claims the deployment's
    lowest H (object 1, the least recently accessed: no runtime, so H = t), deletes its
    file and writes 3. Throughout: used <= budget; at rest entries = files, used = their
    bytes."""
    folder = tmp_path / "shared"
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    a = tier(folder, redis_server.url, "a", 2 * F)
    child = None
    try:
        assert store(a, [key(1)], payloads(1))
        assert store(a, [key(2)], payloads(2))
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Event()
        child = ctx.Process(target=lock_and_wait, args=(str(folder), redis_server.url, [1, 2],
                                                        ready))
        child.start()
        assert ready.wait(120), "server B did not lock A's objects"
        ids = [key_id(key(i)) for i in (1, 2)]
        expiry = [float(client.zscore(KEYS.lease(i), "b")) / 1000 for i in ids]
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        assert child.exitcode == -signal.SIGKILL

        def now() -> float:
            sec, usec = client.time()
            return sec + usec / 1e6

        assert not store(a, [key(3)], payloads(3))  # leased: nothing may go
        assert now() < min(expiry)  # (the leases were still live for that store)
        assert a.stats["not_persisted_deployment_budget"] == 1
        assert len(files(folder)) == 2
        deadline = time.monotonic() + 30
        while not store(a, [key(3)], payloads(3)):
            assert int(client.get(KEYS.used)) <= 2 * F
            assert time.monotonic() < deadline, "the dead server's leases never expired"
        assert now() >= min(expiry)
        assert not client.exists(KEYS.entry(ids[0]))  # object 1 claimed and dropped
        assert client.hget(KEYS.entry(ids[1]), "state") == "stored"
        entries = {KEYS.id_of(n): client.hgetall(n)
                   for n in client.scan_iter(match=KEYS.object_pattern)}
        on_disk = files(folder)
        assert sorted(e["path"] for e in entries.values()) == sorted(on_disk)
        assert {e["state"] for e in entries.values()} == {"stored"}
        assert int(client.get(KEYS.used)) == sum(on_disk.values()) == 2 * F
    finally:
        if child is not None and child.is_alive():
            child.kill()
        a.close()
        client.close()
