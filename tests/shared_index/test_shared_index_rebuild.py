"""Redis restarted empty while a server was away: another server's reconcile adopts the
files the first one has not re-registered yet; the writer's re-registration takes them
back with its own ranking, so they are not the deployment's first eviction victims.

Real ``redis-server``, real files in a shared folder; expected values written out.
"""

from __future__ import annotations

import time
from pathlib import Path

import redis
from lmcache_histate.backends.server.shared_index.reconcile import reconcile
from lmcache_histate.backends.server.shared_index.registration import Registrar
from support.redis_server import RedisServer
from support.shared_index import make_index, record_size, write


def test_writer_takes_back_files_adopted_during_its_outage(
    redis_server: RedisServer, shared_dir: Path
) -> None:
    a = make_index(redis_server.url, "A", op_timeout_s=0.3, connect_timeout_s=0.3)
    b = make_index(redis_server.url, "B", op_timeout_s=0.3, connect_timeout_s=0.3)
    a.join(1 << 20)
    reg = Registrar(a, 1 << 20)
    redis_server.kill()
    # A stores three objects while Redis is away (kept locally, cost 500 each) ...
    during = [write(shared_dir, n, bytes([n]) * 100, cost=500.0) for n in (1, 2, 3)]
    assert reg.committed(during) is None and a.conn.degraded
    redis_server.start()  # same port, empty
    # ... and B's reconcile sees them first: files without entries, adopted by B, C = 0.
    report = reconcile(b, shared_dir, grace_s=0.0)
    assert report["adopted"] == 3
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    entry = a.keys.entry(during[0].id)
    assert client.hget(entry, "owner") == "B" and float(client.hget(entry, "cost")) == 0.0

    time.sleep(0.06)  # past A's retry_s: its probe runs, then its re-registration
    assert a.conn.poll() is True
    assert reg.stats["taken_back"] == 3 and reg.stats["reregistered"] == 0
    for r in during:
        fields = client.hgetall(a.keys.entry(r.id))
        assert fields["owner"] == "A" and float(fields["cost"]) == 500.0
        assert "c:B" not in fields and "adopted" not in fields
    # The bytes are counted once: three files, no double count from the take-back.
    assert a.usage() == (sum(r.size for r in during), 1 << 20, 0)
    found = b.lookup([r.id for r in during], lease=False)
    assert {i: f.owner for i, f in found.items()} == {r.id: "A" for r in during}
    client.close()


def test_a_restart_between_two_calls_is_seen_at_the_next_heartbeat(
    redis_server: RedisServer, shared_dir: Path
) -> None:
    """Redis restarted empty while neither server had a call in flight: redis-py
    reconnects at the next command, so no call fails and no connection degrades. The
    heartbeat finds the deployment's epoch gone; each server then re-registers its own
    objects and the budget, the first one setting a new epoch that the other's heartbeat
    sees too."""
    a = make_index(redis_server.url, "A", op_timeout_s=0.3, connect_timeout_s=0.3)
    b = make_index(redis_server.url, "B", op_timeout_s=0.3, connect_timeout_s=0.3)
    a.join(1 << 20)
    b.join(1 << 20)
    reg_a, reg_b = Registrar(a, 1 << 20), Registrar(b, 1 << 20)
    mine_a = [write(shared_dir, n, bytes([n]) * 100, cost=500.0) for n in (1, 2, 3)]
    mine_b = [write(shared_dir, 4, bytes([4]) * 200, cost=700.0)]
    assert reg_a.committed(mine_a) == [2, 2, 2] and reg_b.committed(mine_b) == [2]
    assert a.heartbeat(30.0) == (1, 3 * record_size(1, 100) + record_size(4, 200))
    assert b.heartbeat(30.0) == (2, 3 * record_size(1, 100) + record_size(4, 200))

    redis_server.kill()
    redis_server.start()  # same port, empty; nothing was sent meanwhile
    # A's heartbeat: the script runs (used 0: nothing registered yet), the epoch is gone.
    assert a.heartbeat(30.0) == (1, 0)
    assert not a.conn.degraded and a.conn.counters().get("outages", 0) == 0
    assert a.conn.counters()["restarts_seen"] == 1
    assert reg_a.stats["reregistered"] == 3
    assert a.usage() == (3 * record_size(1, 100), 1 << 20, 0)
    # B's heartbeat sees the epoch A set, not its own: B re-registers too.
    assert b.heartbeat(30.0) == (2, 3 * record_size(1, 100))
    assert b.conn.counters()["restarts_seen"] == 1 and reg_b.stats["reregistered"] == 1
    assert a.usage() == (3 * record_size(1, 100) + record_size(4, 200), 1 << 20, 0)
    found = b.lookup([r.id for r in mine_a + mine_b], lease=False)
    assert {i: (f.owner, f.size) for i, f in found.items()} == {
        **{r.id: ("A", record_size(1, 100)) for r in mine_a},
        mine_b[0].id: ("B", record_size(4, 200)),
    }
    # Once is enough: the next heartbeats find the epoch they set.
    assert a.heartbeat(30.0) == (2, 3 * record_size(1, 100) + record_size(4, 200))
    b.heartbeat(30.0)
    assert a.conn.counters()["restarts_seen"] == b.conn.counters()["restarts_seen"] == 1
    assert reg_a.stats["reregister_runs"] == reg_b.stats["reregister_runs"] == 1
