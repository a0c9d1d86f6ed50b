"""The core hooks the live LMCache backend needs: ``attach``, ``lose`` and ``recover``.

The server sees stores no lookup announced (``attach``), objects that vanish without the
policy deciding it — an operator clearing the CPU tier, a corrupted file, a failed disk
write (``lose``) — and, after a restart, objects found on disk (``recover``). Each must keep
the index, accounting and queue invariants that the rest of the core relies on.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.listeners import EventLog

from lmcache_histate.core.cache import CacheConfig, HiStateCache, RequestHandle
from lmcache_histate.core.tiers import KV, SNAPSHOT, PlacementRules, ServerTier, TierSpec

CHUNK = 4
KV_BYTES = 10
SNAP_BYTES = 25
CPU, DISK = ServerTier.CPU, ServerTier.DISK


def make(cpu: int = 100, disk: int = 100, copy: bool = True) -> tuple[HiStateCache, EventLog]:
    cfg = CacheConfig(
        chunk_tokens=CHUNK,
        kv_chunk_bytes=KV_BYTES,
        snapshot_bytes=SNAP_BYTES,
        tiers=(TierSpec("cpu", cpu * KV_BYTES), TierSpec("disk", disk * SNAP_BYTES)),
        rules=PlacementRules(final_copy_tier=DISK if copy else None),
        supported_intervals=(CHUNK, 2 * CHUNK),
    )
    c = HiStateCache(cfg)
    return c, EventLog(c.take_events)


def chain(n: int, family: int = 1) -> list[int]:
    return [family * 1000 + i for i in range(n)]


def store(cache: HiStateCache, sid: str, keys: list[int], snaps: list[int], now: float) -> None:
    handle = cache.attach(sid, keys)
    cache.complete(handle, len(keys) * CHUNK, now, boundaries=[(i + 1) * CHUNK for i in snaps])


def test_attach_neither_refreshes_nor_pins_nor_samples() -> None:
    cache, _ = make()
    keys = chain(4)
    store(cache, "a", keys, [1, 3], now=1.0)
    samples = cache.stats().hit_samples
    access = [cache.node(k).access for k in keys]
    handle = cache.attach("a", keys)
    assert handle.match.hit_chunks == 4
    assert handle.pinned == []
    assert cache.stats().hit_samples == samples
    assert [cache.node(k).access for k in keys] == access
    cache.check()


def test_attach_then_complete_extends_the_session() -> None:
    cache, _ = make()
    keys = chain(6)
    store(cache, "a", keys[:3], [2], now=1.0)
    store(cache, "a", keys, [5], now=2.0)
    assert cache.session_end("a") == keys[5]
    # The older final (chunk 2) was retired: its CPU copy released, the disk copy kept.
    assert cache.node(keys[2]).snap_tiers == 1 << DISK
    assert cache.node(keys[5]).snap_tiers == (1 << CPU) | (1 << DISK)
    cache.check()


def test_lose_one_copy_keeps_the_other() -> None:
    cache, rec = make()
    keys = chain(4)
    store(cache, "a", keys, [3], now=1.0)
    node = cache.node(keys[3])
    assert node.snap_tiers == 0b11
    rec.events.clear()
    cache.lose(keys[3], SNAPSHOT, CPU)
    assert node.snap_tiers == 1 << DISK
    assert rec.events == []  # the lost copy itself is not reported
    assert cache.lookup(keys).hit_chunks == 4
    cache.lose(keys[3], SNAPSHOT, CPU)  # idempotent
    cache.check()


def test_lose_last_snapshot_copy_falls_back_to_the_previous_one() -> None:
    cache, rec = make()
    keys = chain(4)
    store(cache, "a", keys, [1, 3], now=1.0)
    rec.events.clear()
    cache.lose(keys[3], SNAPSHOT, CPU)
    cache.lose(keys[3], SNAPSHOT, DISK)
    assert not cache.node(keys[3]).has_snapshot
    assert cache.lookup(keys).hit_chunks == 2
    assert rec.events == []
    cache.check()


def test_lose_last_kv_copy_drops_what_depends_on_it() -> None:
    cache, rec = make()
    keys = chain(6)
    store(cache, "a", keys, [1, 3, 5], now=1.0)
    branch = [*keys[:3], 7777, 7778]
    store(cache, "b", branch, [4], now=2.0)
    rec.events.clear()
    cache.lose(keys[2], KV, CPU)
    # Chunks 0-1 and the snapshot at 1 survive; everything from chunk 2 down is gone.
    assert cache.lookup(keys).hit_chunks == 2
    assert cache.lookup(branch).hit_chunks == 2
    for key in (*keys[2:], 7777, 7778):
        assert key not in cache
    dropped = {(key, part) for kind, key, part, _ in rec.events if kind == "dropped"}
    assert (keys[2], KV) not in dropped  # the lost object itself
    assert {(keys[3], KV), (keys[3], SNAPSHOT), (keys[5], SNAPSHOT), (7778, SNAPSHOT)} <= dropped
    assert {kind for kind, *_ in rec.events} == {"dropped"}
    cache.check()


def test_lose_kv_with_a_disk_copy_only_forgets_that_copy() -> None:
    cache, _ = make(cpu=2)  # two KV chunks fit on the CPU: older KV is demoted to disk
    keys = chain(4)
    store(cache, "a", keys, [3], now=1.0)
    on_disk = [k for k in keys if cache.node(k).kv_tiers == 1 << DISK]
    assert on_disk
    cache.lose(on_disk[0], KV, CPU)  # not on the CPU: nothing happens
    assert cache.lookup(keys).hit_chunks == 4
    cache.check()


def test_lose_under_a_pin_is_pruned_on_release() -> None:
    cache, _ = make()
    keys = chain(4)
    store(cache, "a", keys, [3], now=1.0)
    handle = cache.begin("a", keys, now=2.0)
    assert len(handle.pinned) == 4
    cache.lose(keys[0], KV, CPU)
    cache.release(handle)
    assert not cache.nodes()
    cache.check()


def test_recover_rebuilds_a_disk_chain_and_refuses_gaps_and_overflow() -> None:
    cache, rec = make(disk=3)
    keys = chain(5)
    for i in range(3):
        assert cache.recover(keys[: i + 1], KV, DISK, KV_BYTES, now=float(i))
    assert cache.recover(keys[:3], SNAPSHOT, DISK, SNAP_BYTES, now=3.0)
    assert not cache.recover(keys[:5], KV, DISK, KV_BYTES, now=4.0)  # chunk 3 missing: gap
    assert not cache.recover([4242], SNAPSHOT, DISK, SNAP_BYTES, now=4.0)  # no KV under it
    assert 4242 not in cache
    assert rec.events == []  # adoption is not a placement decision
    assert cache.lookup(keys).hit_chunks == 3
    assert cache.stats().used_bytes[DISK] == 3 * KV_BYTES + SNAP_BYTES
    big = [9000 + i for i in range(8)]
    fits = [cache.recover(big[: i + 1], KV, DISK, KV_BYTES, now=5.0) for i in range(8)]
    assert fits == [True, True] + [False] * 6  # 75 B of disk: 55 B used, room for two more
    cache.check()


def test_recovered_units_are_evictable_by_h() -> None:
    cache, _ = make(cpu=100, disk=2)
    keys = chain(2)
    assert cache.recover(keys[:1], KV, DISK, KV_BYTES, now=0.0)
    assert cache.recover(keys[:1], SNAPSHOT, DISK, SNAP_BYTES, now=0.0)
    # A new session's intermediate snapshots must evict the adopted, older unit.
    other = chain(6, family=2)
    store(cache, "b", other, [1, 3, 5], now=10.0)
    assert cache.lookup(keys).hit_chunks == 0
    cache.check()


op = st.one_of(
    st.tuples(st.just("store"), st.integers(0, 3), st.integers(0, 2), st.integers(1, 10)),
    st.tuples(st.just("lose"), st.integers(0, 2), st.integers(0, 9), st.booleans(), st.booleans()),
    st.tuples(st.just("begin"), st.integers(0, 3), st.integers(0, 2), st.integers(1, 10)),
    st.tuples(st.just("release"), st.integers(0, 5)),
    st.tuples(st.just("recover"), st.integers(0, 2), st.integers(1, 10), st.booleans()),
)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cpu=st.integers(0, 20),
    disk=st.integers(0, 8),
    copy=st.booleans(),
    ops=st.lists(op, max_size=50),
)
def test_random_outside_changes_keep_invariants(cpu: int, disk: int, copy: bool, ops: list) -> None:
    cache, _ = make(cpu=cpu, disk=disk, copy=copy)
    open_: list[RequestHandle] = []
    now = 0.0
    for item in ops:
        now += 1.0
        kind = item[0]
        if kind == "store":
            _, session, family, n = item
            keys = chain(n, family)
            snaps = sorted({n - 1, *range(1, n, 3)})
            store(cache, f"s{session}", keys, snaps, now)
        elif kind == "lose":
            _, family, i, kv, disk_tier = item
            cache.lose(chain(10, family)[i], KV if kv else SNAPSHOT, DISK if disk_tier else CPU)
        elif kind == "begin":
            _, session, family, n = item
            open_.append(cache.begin(f"s{session}", chain(n, family), now))
        elif kind == "release" and open_:
            cache.release(open_.pop(item[1] % len(open_)))
        elif kind == "recover":
            _, family, n, kv = item
            part, size = (KV, KV_BYTES) if kv else (SNAPSHOT, SNAP_BYTES)
            cache.recover(chain(n, family), part, DISK, size, now)
        cache.check()
    for handle in open_:
        cache.release(handle)
    cache.check()
    assert all(node.pins == 0 for node in cache.nodes())
