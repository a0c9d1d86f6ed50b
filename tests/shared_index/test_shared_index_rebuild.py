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
from support.shared_index import make_index, write


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
