"""Faults: Redis killed and restarted, a lease holder killed, stale entries, orphan files."""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from pathlib import Path

import pytest
from lmcache_histate.backends.demo.servers import free_port
from lmcache_histate.backends.server.disk import file_format as df
from lmcache_histate.backends.server.shared_index.budget import local_delete_allowed
from lmcache_histate.backends.server.shared_index.connection import IndexConnection
from lmcache_histate.backends.server.shared_index.reconcile import reconcile
from lmcache_histate.backends.server.shared_index.registration import Registrar
from support.redis_server import RedisServer
from support.shared_index import hold_lease, make_index, settings, write

LOGGER = "lmcache_histate.shared_index"


def test_redis_killed_mid_run_degrades_then_reregisters(
    redis_server: RedisServer, shared_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    a = make_index(redis_server.url, "A", op_timeout_s=0.3, connect_timeout_s=0.3)
    b = make_index(redis_server.url, "B", op_timeout_s=0.3, connect_timeout_s=0.3)
    a.join(1 << 20)
    reg = Registrar(a, 1 << 20)
    before = [write(shared_dir, n, bytes([n]) * 100) for n in (1, 2)]
    assert reg.committed(before) == [2, 2]  # registered without a reservation

    redis_server.kill()  # no save: Redis loses every key
    during = write(shared_dir, 3, b"3" * 100)
    assert reg.committed([during]) is None  # degraded: kept locally
    assert a.lookup([before[0].id]) is None  # callers fall back to their local view
    assert a.claim(100) is None and a.usage() is None
    c = a.conn.counters()
    # One failed call entered degraded mode; the three after it were not attempted.
    assert (c["failures"], c["outages"], c["skipped"]) == (1, 1, 3)
    assert a.conn.poll() is False  # probe: still down (retry_s = 0.05 s)
    warnings = [r for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()

    redis_server.start()  # same port, empty
    time.sleep(0.06)  # past retry_s
    assert a.conn.poll() is True
    assert reg.stats["reregistered"] == 3  # 2 from before the outage + 1 during it
    assert a.conn.counters()["recoveries"] == 1
    found = b.lookup([r.id for r in (*before, during)], lease=False)
    assert set(found) == {before[0].id, before[1].id, during.id}
    assert a.usage() == (sum(r.size for r in (*before, during)), 1 << 20, 0)
    assert len([r for r in caplog.records if r.name == LOGGER]) == 2  # the outage, the end


def test_a_killed_holders_lease_expires(redis_server: RedisServer, shared_dir: Path) -> None:
    a = make_index(redis_server.url, "A")
    a.join(1 << 20)
    rec = write(shared_dir, 1, b"x" * 100)
    a.commit([rec])
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    holder = ctx.Process(target=hold_lease, args=(redis_server.url, rec.id, 0.5, ready))
    holder.start()
    try:
        assert ready.wait(60), "the lease holder did not start"
        os.kill(holder.pid, 9)  # SIGKILL: the lease is never released
        holder.join(10)
        assert a.claim(1) == []  # leased (0.5 s)
        time.sleep(0.6)  # past the lease
        assert [v.id for v in a.claim(1)] == [rec.id]
    finally:
        if holder.is_alive():
            holder.kill()
            holder.join(10)


def test_entry_whose_file_is_gone_is_a_miss_and_cleaned_up(
    redis_server: RedisServer, shared_dir: Path
) -> None:
    a, b = make_index(redis_server.url, "A"), make_index(redis_server.url, "B")
    a.join(1 << 20)
    rec = write(shared_dir, 1, b"y" * 100)
    a.commit([rec])
    (shared_dir / rec.path).unlink()  # e.g. removed by hand
    loc = b.lookup([rec.id])[rec.id]
    status, _ = df.read_object(shared_dir / loc.path, df.decode_id(loc.oid),
                               memoryview(bytearray(100)))
    assert status is df.ReadStatus.MISSING
    assert b.forget_stored([rec.id]) == 1
    assert b.lookup([rec.id]) == {}
    assert a.usage() == (0, 1 << 20, 0)


def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_reconcile_adopts_orphans_and_clears_stale_and_expired_entries(
    redis_server: RedisServer, shared_dir: Path
) -> None:
    a = make_index(redis_server.url, "A", write_ttl_s=0.1, claim_ttl_s=0.1)
    b = make_index(redis_server.url, "B", write_ttl_s=0.1, claim_ttl_s=0.1)
    a.join(1 << 20)
    # 1: a file nobody registered (a server died between rename and commit), 120 s old.
    orphan = write(shared_dir, 1, b"1" * 100)
    _age(shared_dir / orphan.path, 120)
    # 2: an orphan written 1 s ago: its commit may be on its way (grace 60 s), kept.
    young = write(shared_dir, 2, b"2" * 100)
    # 3: an eviction claimed by A, which died before deleting the file (deadline 0.1 s).
    claimed = write(shared_dir, 6, b"6" * 100)
    a.commit([claimed])
    assert [v.id for v in a.claim(1)] == [claimed.id]
    # 4: a stored entry whose file is gone.
    stale = write(shared_dir, 3, b"3" * 100)
    a.commit([stale])
    (shared_dir / stale.path).unlink()
    # 5: a reservation whose writer died before writing (deadline 0.1 s).
    dead_write = write(shared_dir, 4, b"4" * 100)
    (shared_dir / dead_write.path).unlink()
    a.reserve([(dead_write.id, dead_write.size, dead_write.path)])
    # 6: a reservation whose writer died after the rename: the file is complete.
    done_write = write(shared_dir, 5, b"5" * 100)
    _age(shared_dir / done_write.path, 120)
    a.reserve([(done_write.id, done_write.size, done_write.path)])
    # 7: temporaries: a dead writer's (old) and one being written now; a foreign file.
    shard = shared_dir / orphan.path.split("/")[0]
    old_tmp = shard / (Path(orphan.path).name + ".99.1.tmp")
    old_tmp.write_bytes(b"partial")
    _age(old_tmp, 120)
    new_tmp = shard / (Path(orphan.path).name + ".99.2.tmp")
    new_tmp.write_bytes(b"partial")
    foreign = shard / "notes.txt"
    foreign.write_text("not ours")
    time.sleep(0.15)  # past the write and claim deadlines

    report = reconcile(b, shared_dir, grace_s=60.0)

    assert report["adopted"] == 1 and report["stale_forgotten"] == 1
    assert report["writes_expired"] == 1 and report["writes_adopted"] == 1
    assert report["claims_completed"] == 1 and report["tmp_removed"] == 1
    found = a.lookup([r.id for r in (orphan, young, stale, dead_write, done_write, claimed)],
                     lease=False)
    assert set(found) == {orphan.id, done_write.id}
    assert found[orphan.id].owner == "B"  # adopted by the reconciling server
    assert (shared_dir / young.path).exists()  # within its grace period
    assert not (shared_dir / claimed.path).exists()
    assert not old_tmp.exists() and new_tmp.exists() and foreign.exists()
    # Bytes held: the two adopted files only (each 100-byte payload + header).
    assert a.usage() == (orphan.size + done_write.size, 1 << 20, 0)
    # A second pass finds nothing left to do (young is still in its grace period).
    again = reconcile(a, shared_dir, grace_s=60.0)
    assert sum(v for k, v in again.items() if k != "files") == 0


def test_local_deletes_wait_for_leases_granted_before_the_outage(tmp_path: Path) -> None:
    # Redis never reachable (a port nobody listens on); lease_ttl 30 s, fake clock.

    now = [100.0]
    conn = IndexConnection(settings(f"redis://127.0.0.1:{free_port()}/0", "A",
                                    connect_timeout_s=0.2),
                           clock=lambda: now[0])
    assert local_delete_allowed(conn) is False  # connected: deletes go through claims
    assert conn.call(lambda c: c.ping(), "fallback") == "fallback"
    assert conn.degraded
    now[0] = 129.9  # 29.9 s into the outage: a lease granted just before may still run
    assert local_delete_allowed(conn) is False
    now[0] = 130.0  # 30 s: every lease granted before the outage has expired
    assert local_delete_allowed(conn) is True
