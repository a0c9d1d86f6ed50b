"""Probe timing of a degraded index connection, against a real ``redis-server``: a refusal
(an ACL right missing) is probed with a doubling wait up to 8 × retry_s; an unreachable
Redis every retry_s. The clock is injected; the faults are real Redis replies.
"""

from __future__ import annotations

from pathlib import Path

import redis
from lmcache_histate.backends.server.shared_index.connection import IndexConnection
from support.redis_server import RedisServer

from lmcache_histate.config import SharedIndexConfig

PASSWORD = "backoff-test-password-0123"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def connection(tmp_path: Path, url: str, clock: Clock) -> IndexConnection:
    pw = tmp_path / "pw"
    pw.write_text(PASSWORD)
    pw.chmod(0o600)
    cfg = SharedIndexConfig(url=url, deployment="d", instance="a", password_file=str(pw),
                            op_timeout_s=0.3, connect_timeout_s=0.3, retry_s=1.0)
    return IndexConnection(cfg, clock=clock)


def probes_at(conn: IndexConnection, clock: Clock, times: list[float]) -> list[float]:
    """Poll at each offset from now; the offsets at which a probe was sent."""
    start, sent = clock.t, []
    for dt in times:
        clock.t = start + dt
        before = conn.counters().get("probes", 0)
        conn.poll()
        if conn.counters().get("probes", 0) > before:
            sent.append(dt)
    return sent


def test_refusals_back_off_and_unreachable_does_not(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", config=(
        f"user h on >{PASSWORD} ~* +@all -hset\nuser default off\n"))
    server.start()
    clock = Clock()
    try:
        conn = connection(tmp_path, f"redis://h@127.0.0.1:{server.port}/0", clock)
        conn.probe = lambda c: c.hset("k", "f", 1)  # refused until the right returns
        assert conn.call(lambda c: c.hset("k", "f", 1), "fallback") == "fallback"
        assert conn.degraded and conn.fault == "permission denied"
        steps = [0.5 * i for i in range(1, 65)]  # every 0.5 s for 32 s
        # Waits 1, 2, 4, 8, 8, 8 s after the fault (retry_s = 1, cap 8 x retry_s).
        assert probes_at(conn, clock, steps) == [1.0, 3.0, 7.0, 15.0, 23.0, 31.0]
        assert conn.degraded

        conn.probe = lambda c: c.ping()
        server.kill()  # now unreachable as well: the next probes come every retry_s
        other = connection(tmp_path, f"redis://h@127.0.0.1:{server.port}/0", clock)
        assert other.call(lambda c: c.get("k"), "fallback") == "fallback"
        assert other.fault == "unreachable"
        assert probes_at(other, clock, [0.5 * i for i in range(1, 9)]) == [1.0, 2.0, 3.0, 4.0]
    finally:
        server.stop()


def test_classes_of_faults(tmp_path: Path) -> None:
    from lmcache_histate.backends.server.shared_index.connection import classify

    server = RedisServer(tmp_path / "redis", config=(
        f"user h on >{PASSWORD} ~* +@all -hset\nuser default off\n"))
    server.start()
    try:
        good = redis.Redis(port=server.port, username="h", password=PASSWORD)
        faults = []
        for call in (lambda: good.hset("k", "f", 1),
                     lambda: good.eval("return redis.call('HSET', KEYS[1], 'f', 1)", 1, "k"),
                     lambda: good.eval("return redis.call('NOPE')", 0),
                     lambda: redis.Redis(port=server.port, username="h", password="x").ping()):
            try:
                call()
            except redis.RedisError as exc:
                faults.append(classify(exc))
        server.kill()
        try:
            good.ping()
        except redis.RedisError as exc:
            faults.append(classify(exc))
        assert faults == ["permission denied", "permission denied", "script error",
                          "credentials refused", "unreachable"]
        good.close()
    finally:
        server.stop()
