"""Property tests: random request sequences keep the cache's invariants.

After every operation: byte accounting per tier is exact and within capacity, the
index's structural invariants hold, every unit is queued exactly where it frees bytes,
and no object pinned by an in-flight request was ever moved or dropped.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_histate.core.cache import CacheConfig, HiStateCache, RequestHandle
from lmcache_histate.core.tiers import PlacementRules, TierSpec

CHUNK = 4
KV_BYTES = 10
SNAP_BYTES = 25


def chain(family: int, variant: int, length: int) -> list[int]:
    """Prefix ``family``; variant ``v`` diverges from variant 0 at chunk ``3·v``."""
    return [family * 10**6 + (variant if i >= 3 * variant else 0) * 1000 + i for i in range(length)]


def check_pins(events: list, open_: list[tuple[RequestHandle, int]]) -> None:
    """No part of a node pinned by a request still in flight was moved or dropped."""
    pinned = {node.key for handle, _ in open_ for node in handle.pinned}
    for event in events:
        assert event[0] == "stored" or event[1] not in pinned, f"pinned node moved: {event}"


op = st.one_of(
    st.tuples(
        st.just("begin"),
        st.integers(0, 4),  # session
        st.integers(0, 2),  # family
        st.integers(0, 3),  # variant
        st.integers(1, 14),  # chunks
        st.integers(0, CHUNK - 1),  # partial tail tokens
    ),
    st.tuples(st.just("complete"), st.integers(0, 10)),
    st.tuples(st.just("end"), st.integers(0, 4)),
)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cpu=st.integers(0, 30),
    disk=st.integers(0, 12),
    tau=st.sampled_from([0.0, 5.0, 600.0]),
    refresh_all=st.booleans(),
    exposed=st.booleans(),
    copy=st.booleans(),
    fixed=st.sampled_from([None, 0, CHUNK, 2 * CHUNK]),
    ops=st.lists(op, max_size=60),
)
def test_random_sequences_keep_invariants(
    cpu: int,
    disk: int,
    tau: float,
    refresh_all: bool,
    exposed: bool,
    copy: bool,
    fixed: int | None,
    ops: list,
) -> None:
    cfg = CacheConfig(
        chunk_tokens=CHUNK,
        kv_chunk_bytes=KV_BYTES,
        snapshot_bytes=SNAP_BYTES,
        tiers=(TierSpec("cpu", cpu * KV_BYTES), TierSpec("disk", disk * SNAP_BYTES)),
        rules=PlacementRules(final_copy_tier=1 if copy else None),
        tau=tau,
        refresh_all=refresh_all,
        exposed_ends=exposed,
        fixed_interval=fixed,
        supported_intervals=(CHUNK, 2 * CHUNK, 3 * CHUNK),
    )
    cache = HiStateCache(cfg)
    open_: list[tuple[RequestHandle, int]] = []
    now = 0.0
    for item in ops:
        now += 1.0
        if item[0] == "begin":
            _, session, family, variant, chunks, tail = item
            keys = chain(family, variant, chunks)
            handle = cache.begin(f"s{session}", keys, now)
            assert handle.match.hit_chunks <= handle.match.kv_chunks
            for node in handle.pinned:
                assert node.kv_tiers, "a pinned node must hold what the engine loads"
            open_.append((handle, chunks * CHUNK + tail))
        elif item[0] == "complete" and open_:
            handle, tokens = open_.pop(item[1] % len(open_))
            cache.complete(handle, tokens, now)
        elif item[0] == "end":
            cache.drop_session(f"s{item[1]}")
        check_pins(cache.take_events(), open_)
        cache.check()
    for handle, tokens in open_:
        cache.complete(handle, tokens, now + 1)
    cache.check()
    assert all(node.pins == 0 for node in cache.nodes())


@settings(deadline=None)
@given(
    ops=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.integers(1, 12)), max_size=30)
)
def test_hits_never_exceed_kv_match_and_land_on_snapshots(ops: list) -> None:
    cfg = CacheConfig(
        chunk_tokens=CHUNK,
        kv_chunk_bytes=KV_BYTES,
        snapshot_bytes=SNAP_BYTES,
        tiers=(TierSpec("cpu", 40 * KV_BYTES), TierSpec("disk", 6 * SNAP_BYTES)),
        supported_intervals=(CHUNK, 2 * CHUNK),
    )
    cache = HiStateCache(cfg)
    for t, (family, variant, chunks) in enumerate(ops):
        keys = chain(family, variant, chunks)
        m = cache.lookup(keys)
        if m.hit_chunks:
            assert m.hit_node is not None and m.hit_node.has_snapshot
            assert m.hit_node.key == keys[m.hit_chunks - 1]
        assert m.hit_chunks <= m.kv_chunks <= chunks
        cache.complete(cache.begin(f"f{family}", keys, float(t)), chunks * CHUNK, float(t))
        after = cache.lookup(keys)
        if m.kv_chunks < chunks:
            # It computed a new segment: its KV and final snapshot (on CPU, which holds
            # 40 chunks, more than a 12-chunk prompt and its snapshot) were stored.
            assert after.hit_chunks == after.kv_chunks == chunks
        else:
            # Fully cached already: nothing new was stored (retiring the session's old
            # final snapshot may still have made room on disk), so no hit grew.
            assert after.hit_chunks <= m.hit_chunks
