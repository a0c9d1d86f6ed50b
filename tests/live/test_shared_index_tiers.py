"""Disk tiers of several servers (``HiStateDiskAdapter`` with a ``shared_index`` section, the
part of a server that reads, writes and deletes the shared folder) against a real
redis-server: a degraded server writes within its share of the budget; a server killed
(SIGKILL, a real process) while it holds load leases blocks nothing past the lease TTL; a
write that fails gives its reservation back at once; a server whose files another server
evicted still writes what the deployment reserved for it (``disk.tier`` NOTE 7).

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
from lmcache_histate.backends.server.disk.shared_link import key_id
from lmcache_histate.backends.server.disk.tier import HiStateDiskAdapter
from lmcache_histate.backends.server.shared_index.layout import KeySpace
from support.redis_server import RedisServer
from test_backend_disk_tier import MODEL, key, load, lookup, store

PAYLOAD = 1000
KEYS = KeySpace("t", MODEL)
F = df.header_size(df.ObjectId.of(key(1)), b"") + PAYLOAD  # one file's size


def tier(folder: Path, url: str, instance: str, budget: int, **index: Any) -> HiStateDiskAdapter:
    section = {"url": url, "deployment": "t", "instance": instance, "connect_timeout_s": 0.3,
               "op_timeout_s": 0.3, "retry_s": 0.2, **index}
    return HiStateDiskAdapter({"disk_path": str(folder), "disk_gib": budget / 2**30,
                               "index_model": MODEL, "shared_index": section})


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


def index_entries(client: redis.Redis) -> dict[str, dict[str, str]]:
    """Every object entry of the namespace (id -> fields), read straight from Redis."""
    return {KEYS.id_of(n): client.hgetall(n) for n in client.scan_iter(match=KEYS.object_pattern)}


def state_of(folder: Path, client: redis.Redis) -> tuple[dict[str, str], dict[str, int], int]:
    """(state per entry id, files on disk, the deployment's used bytes)."""
    states = {i: e["state"] for i, e in index_entries(client).items()}
    return states, files(folder), int(client.get(KEYS.used) or 0)


def test_a_failed_write_gives_its_reservation_back_at_once(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A regular file sits where object 1's directory must go, so its write fails with a
    real I/O error after the deployment reserved it (F bytes, state 'writing'). The
    reservation is given back in the same store: no entry, used 0 (before the fix it
    stayed 'writing' holding F until its deadline). Once the blocker is gone the same
    object is stored: one entry, one file, used F."""
    folder = tmp_path / "shared"
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    a = tier(folder, redis_server.url, "a", 4 * F)
    try:
        blocker = df.object_path(folder, df.ObjectId.of(key(1))).parent
        blocker.parent.mkdir(parents=True, exist_ok=True)
        blocker.write_bytes(b"not a directory")
        assert not store(a, [key(1)], payloads(1))
        assert a.stats["not_persisted_io_error"] == 1
        assert a.shared.stats["reserved"] == 1 and a.shared.stats["unreserved"] == 1
        assert state_of(folder, client) == ({}, {}, 0)
        blocker.unlink()
        assert store(a, [key(1)], payloads(1))
        entries, on_disk, used = state_of(folder, client)
        assert entries == {key_id(key(1)): "stored"}
        assert len(on_disk) == 1 and used == F == sum(on_disk.values())
    finally:
        a.close()
        client.close()


def test_files_another_server_evicted_do_not_block_writes_or_hide_objects(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Budget 2 F. A stores 1 and 2; B stores 3 and 4, and each of B's writes claims one
    of A's files (the deployment's lowest H = t: A's are older). A is told nothing (a
    claim informs only the claimant), so A's own view still holds 1 and 2: 2 F of its
    2 F capacity.
    * A stores 5: the deployment claims one of B's files and reserves 5 for A. A writes
      it although its own view is full (the deployment's budget bounds the folder).
      Before the fix: not persisted (local capacity), its entry left 'writing'.
    * A stores 1 again: the deployment has no entry for it and reserves it; A's entry
      for 1 is stale and is replaced by the new file. Before the fix: reported stored
      ("present") with no file and its entry left 'writing'.
    At the end: 2 entries, both stored, one file each, used 2 F, and A loads 1's bytes."""
    folder = tmp_path / "shared"
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    a = tier(folder, redis_server.url, "a", 2 * F)
    b = tier(folder, redis_server.url, "b", 2 * F)
    try:
        assert store(a, [key(1)], payloads(1)) and store(a, [key(2)], payloads(2))
        assert store(b, [key(3)], payloads(3)) and store(b, [key(4)], payloads(4))
        assert b.shared.stats["evicted"] == 2
        assert set(state_of(folder, client)[0]) == {key_id(key(3)), key_id(key(4))}
        assert a.contains(key(1)) and a.contains(key(2))  # A's stale view
        assert store(a, [key(5)], payloads(5))
        assert a.stats.get("not_persisted_capacity", 0) == 0
        assert store(a, [key(1)], payloads(1))
        assert a.stats["stale_entries_replaced"] == 1
        entries, on_disk, used = state_of(folder, client)
        assert entries == {key_id(key(5)): "stored", key_id(key(1)): "stored"}
        assert len(on_disk) == 2 and used == 2 * F == sum(on_disk.values())
        assert a.shared.stats.get("unreserved", 0) == 0
        assert lookup(a, [key(1)]) == [0]
        hits, data = load(a, [key(1)], [PAYLOAD])
        assert hits == [0] and data == payloads(1)
        a.submit_unlock([key(1)])
    finally:
        a.close()
        b.close()
        client.close()


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
        entries = index_entries(client)
        on_disk = files(folder)
        assert sorted(e["path"] for e in entries.values()) == sorted(on_disk)
        assert {e["state"] for e in entries.values()} == {"stored"}
        assert int(client.get(KEYS.used)) == sum(on_disk.values()) == 2 * F
    finally:
        if child is not None and child.is_alive():
            child.kill()
        a.close()
        client.close()
