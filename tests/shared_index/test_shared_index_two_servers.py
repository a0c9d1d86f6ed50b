"""Two servers (two index handles) on one real redis-server and one shared disk folder."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from lmcache_histate.backends.demo.servers import free_port
from lmcache_histate.backends.server.disk import file_format as df
from lmcache_histate.backends.server.shared_index.budget import (
    delete_victims,
    reserve_with_eviction,
)
from lmcache_histate.backends.server.shared_index.connection import IndexConnection, Unavailable
from lmcache_histate.backends.server.shared_index.index import (
    BudgetMismatch,
    SessionFacts,
    SharedIndex,
)
from lmcache_histate.backends.server.shared_index.layout import KeySpace
from support.redis_server import RedisServer
from support.shared_index import make_index, oid, record_size, settings, write


def test_b_loads_what_a_stored_with_identical_bytes(redis_server: RedisServer,
                                                    shared_dir: Path) -> None:
    a, b = make_index(redis_server.url, "A"), make_index(redis_server.url, "B")
    a.join(1 << 20)
    b.join(1 << 20)
    payload = bytes(range(256)) * 40  # 10,240 bytes
    rec = write(shared_dir, 7, payload)
    assert a.reserve([(rec.id, rec.size, rec.path)]).reserved == (rec.id,)
    assert a.commit([rec]) == [1]  # 1 = A's own reservation committed

    found = b.lookup([rec.id])
    loc = found[rec.id]
    assert (loc.owner, loc.path, loc.size, loc.crc) == ("A", rec.path, rec.size, rec.crc)
    assert loc.size == record_size(7, 10_240)
    assert df.decode_id(loc.oid) == oid(7)
    buf = bytearray(10_240)
    status, _ = df.read_object(shared_dir / loc.path, df.decode_id(loc.oid), memoryview(buf))
    assert status is df.ReadStatus.OK
    assert bytes(buf) == payload
    b.release([rec.id])

    # The same object stored again by B is not written twice: it is present.
    again = b.reserve([(rec.id, rec.size, rec.path)])
    assert (again.reserved, again.present) == ((), (rec.id,))
    assert a.usage() == (rec.size, 1 << 20, 0)  # counted once


def test_unreserve_gives_back_only_the_callers_own_reservations(
    redis_server: RedisServer, shared_dir: Path
) -> None:
    """A reserves objects 1 and 2, B reserves 3, A commits 2. A's unreserve of all three
    gives back only 1 (its own entry still 'writing'): 2 is stored, 3 is B's. Used bytes
    drop by 1's size alone, and 1 can then be reserved again (by B)."""
    a, b = make_index(redis_server.url, "A"), make_index(redis_server.url, "B")
    a.join(1 << 20)
    b.join(1 << 20)
    one, two, three = (write(shared_dir, n, bytes([n]) * 100) for n in (1, 2, 3))
    a.reserve([(r.id, r.size, r.path) for r in (one, two)])
    b.reserve([(three.id, three.size, three.path)])
    assert a.commit([two]) == [1]
    assert a.usage()[0] == one.size + two.size + three.size
    assert a.unreserve([one.id, two.id, three.id]) == 1
    assert a.usage()[0] == two.size + three.size
    assert set(b.lookup([one.id, two.id, three.id], lease=False)) == {two.id}
    assert b.reserve([(one.id, one.size, one.path)]).reserved == (one.id,)
    assert a.unreserve([]) == 0


def test_namespaces_are_separate(redis_server: RedisServer, shared_dir: Path) -> None:
    a = make_index(redis_server.url, "A")
    other = SharedIndex(IndexConnection(settings(redis_server.url, "X")),
                        KeySpace("another-deployment", "tiny-qwen3-next"), tau=0.0)
    a.join(1 << 20)
    other.join(1 << 20)
    rec = write(shared_dir, 1, b"abc")
    a.commit([rec])
    assert other.lookup([rec.id]) == {}
    assert a.keys.prefix == "histate:{test:tiny-qwen3-next}:"  # one hash slot per namespace


def test_budget_is_the_deployments_and_victims_go_by_lowest_h(
    redis_server: RedisServer, shared_dir: Path
) -> None:
    # tau = 10 s: H = t + 10 * ln(C / M). Three objects of the same size F, committed
    # within a second of each other, with C/M = 1, e^-2, e^-1: H = t1 + 0, t2 - 20,
    # t3 - 10. Lowest first: object 2, then 3, then 1.
    a, b = make_index(redis_server.url, "A", tau=10.0), make_index(redis_server.url, "B", tau=10.0)
    size = record_size(1, 1000)
    budget = 3 * size
    a.join(budget)
    b.join(budget)
    recs = [
        write(shared_dir, 1, b"1" * 1000, cost=size, freed=size),
        write(shared_dir, 2, b"2" * 1000, cost=size * math.exp(-2), freed=size),
        write(shared_dir, 3, b"3" * 1000, cost=size * math.exp(-1), freed=size),
    ]
    for r in recs[:2]:
        a.reserve([(r.id, r.size, r.path)])
        a.commit([r])
    b.reserve([(recs[2].id, recs[2].size, recs[2].path)])
    b.commit([recs[2]])
    assert a.usage() == (budget, budget, 0)

    # A fourth object does not fit: used + F > 3F, deficit F; B's write evicts A's object 2.
    new = write(shared_dir, 4, b"4" * 1000)
    first = b.reserve([(new.id, new.size, new.path)])
    assert (first.full, first.deficit) == ((new.id,), size)
    claimed: list[str] = []

    def deleter(victims):  # type: ignore[no-untyped-def]
        claimed.extend(v.id for v in victims)
        return delete_victims(shared_dir)(victims)

    res = reserve_with_eviction(b, [(new.id, new.size, new.path)], deleter)
    assert res.reserved == (new.id,)
    assert claimed == [recs[1].id]
    assert not (shared_dir / recs[1].path).exists()
    assert a.usage() == (budget, budget, 0)  # 3F: objects 1, 3 and the reserved 4
    # Next victims in order: object 3 (H = t3 - 10), then 1 (H = t1).
    assert [v.id for v in a.claim(size)] == [recs[2].id]
    assert [v.id for v in a.claim(size)] == [recs[0].id]


def test_a_leased_object_is_skipped_until_released(redis_server: RedisServer,
                                                   shared_dir: Path) -> None:
    # tau = 0: LRU. Objects 1, 2 committed in that order; B leases 1 (loading it).
    a, b = make_index(redis_server.url, "A"), make_index(redis_server.url, "B")
    a.join(1 << 20)
    r1, r2 = write(shared_dir, 1, b"a" * 100), write(shared_dir, 2, b"b" * 100)
    a.commit([r1])
    a.commit([r2])
    assert r1.id in b.lookup([r1.id])  # the lookup refreshed t1: now 2 is the oldest
    a.commit([r1])  # re-commit of a stored entry changes nothing (status 0)
    assert [v.id for v in a.claim(1)] == [r2.id]
    assert a.claim(1) == []  # object 1 is leased by B
    b.release([r1.id])
    assert [v.id for v in a.claim(1)] == [r1.id]
    assert b.lookup([r1.id]) == {}  # an entry being evicted is not found


def test_a_hit_refreshes_last_access_for_refresh_all(redis_server: RedisServer,
                                                     shared_dir: Path) -> None:
    # LRU (tau = 0): 1, 2, 3 committed in order; a hit on 3 touching its prefix 1
    # (refresh-all) leaves 2 the least recently used.
    a, b = make_index(redis_server.url, "A"), make_index(redis_server.url, "B")
    a.join(1 << 20)
    recs = [write(shared_dir, n, bytes([n]) * 50) for n in (1, 2, 3)]
    for r in recs:
        a.commit([r])
    b.lookup([recs[2].id], touch=[recs[0].id], lease=False)
    assert [v.id for v in a.claim(3 * recs[0].size)] == [recs[1].id, recs[0].id, recs[2].id]


def test_deployment_emas_and_session_hand_off(redis_server: RedisServer) -> None:
    a, b = make_index(redis_server.url, "A"), make_index(redis_server.url, "B")
    # Seeded EMA, alpha 0.05: first sample 10 -> 10; then 20 -> 10 + 0.05 * (20 - 10) = 10.5.
    assert a.observe([("kv", 10.0)]) == [10.0]
    assert b.observe([("kv", 20.0)]) == [10.5]
    assert a.emas() == {"kv": 10.5, "kv_n": 2.0}
    # A session served by A moves to B: B learns A owned it and its final snapshot.
    assert a.session_begin("s1").owner == ""
    a.session_end("s1", "ab" * 16, 768)
    facts = b.session_begin("s1")
    assert (facts.owner, facts.end, facts.end_tokens) == ("A", "ab" * 16, 768)
    assert facts.gap is not None and facts.gap >= 0
    assert b.emas()["gap_n"] == 1.0
    b.session_begin("s2")  # a new session at B, no final snapshot yet
    assert a.sessions(idle_at_most_s=60.0) == {
        "s1": SessionFacts("B", "ab" * 16, 768, None),  # now served by B
        "s2": SessionFacts("B", "", 0, None),
    }
    assert a.sessions(idle_at_most_s=-60.0) == {}  # none accessed in the future


def test_rescore_moves_an_object_in_the_ranking(redis_server: RedisServer,
                                                shared_dir: Path) -> None:
    # tau = 10 s. Both objects start with C/M = 1 (H = t); object 1, older, would go first.
    # Its owner learns a session now needs it: C/M = e^3, H1 = t1 + 30 s > H2 = t2 (t2 - t1
    # is well under a second), so object 2 goes first.
    a = make_index(redis_server.url, "A", tau=10.0)
    a.join(1 << 20)
    r1, r2 = write(shared_dir, 1, b"a" * 100), write(shared_dir, 2, b"b" * 100)
    a.commit([r1])
    a.commit([r2])
    assert a.rescore([(r1.id, r1.size * math.exp(3), r1.size)]) == 1
    assert [v.id for v in a.claim(1)] == [r2.id]


def test_join_refuses_another_budget_and_an_unreachable_redis(redis_server: RedisServer) -> None:
    make_index(redis_server.url, "A").join(4 << 30)  # the first server sets 4 GiB
    with pytest.raises(BudgetMismatch) as err:
        make_index(redis_server.url, "B").join(2 << 30)
    assert str(err.value).startswith(
        "disk_gib: this server's disk budget (2147483648 bytes) differs from the "
        "deployment's (4294967296 bytes"
    )
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nobody listens there
    with pytest.raises(Unavailable, match=r"Redis at redis://127\.0\.0\.1:\d+/0 is unreachable"):
        make_index(dead, "C", connect_timeout_s=0.2).join(4 << 30)
