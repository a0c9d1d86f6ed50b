"""The shared tier's re-scoring after commit (``shared_tier.scores``), driven with a real
core and no Redis: ``wrote`` / ``committed`` as the runtime's ``shared_route`` and the
tier's write call them, ``collect`` / ``sent`` as the janitor's tick does.

One small core: chunks of 4 tokens, 2,048 B of KV per chunk (512 B per token), 8,192 B
per snapshot, tier 0 = CPU and tier 1 = disk (1 MiB each), default rules (KV and final
snapshots on the CPU, intermediate ones on disk), ``p_end`` prior 0.9, no re-access gap
seen (τ = 0: no end hit is weighted as hidden, ``rank`` NOTE 3). ``C`` is in bytes:
tokens × 512.

Turn 1 of session "a" (t = 1): chunks 1-4, its final snapshot after chunk 4 (token 16).
Its bundle (``rank``: KV 1-4 + the final snapshot) is the unit every part of it leaves
the CPU with: the snapshot at p = 16 with no kept snapshot above (p_prev = 0), δ = 16;
the session ends there and passes it once: C = 16 · 0.9 = 14.4 tokens = 7,372.8 B;
M = 4 · 2,048 + 8,192 = 16,384 B.

Turn 2 (t = 5): chunks 1-6, final after chunk 6 (token 24). The old final snapshot
retires to disk as an intermediate one. The old chunks' KV (still on the CPU) now leaves
the CPU with the snapshot unit at 4, which carries its KV segment 1-4 but not the
snapshot (on disk): M = 4 · 2,048 = 8,192 B. Its C: δ = 16; its zone runs to the final
snapshot at q = 24, internal mass (24 − 16) · 1/24 = 1/3; one session passes it (its end
hits count, ``rank`` NOTE 1): C = 16 · (0.1 · 1/3 + 0.9 · 1) = 14.933 tokens =
7,645.87 B. The snapshot itself lies on disk, the last tier, which it leaves alone:
M = 8,192 B, the same C.
"""

from __future__ import annotations

import math

import pytest
from lmcache_histate.backends.server.shared_tier.scores import (
    CHANGED,
    SWEEP_BUDGET,
    SharedScores,
    unit_inputs,
)

from lmcache_histate.core.cache import CacheConfig, HiStateCache
from lmcache_histate.core.tiers import KV, SNAPSHOT, ServerTier, TierSpec

CPU, DISK = ServerTier.CPU, ServerTier.DISK
TURN1 = [1, 2, 3, 4]
TURN2 = [1, 2, 3, 4, 5, 6]
BUNDLE_1 = (1.0, 7372.8, 16384.0)  # turn 1's bundle (module docstring)
C_2 = 16 * (0.1 / 3 + 0.9) * 512  # 7,645.87 B: the snapshot at 4 after turn 2
# The parts turn 1 sends to the shared tier (every KV chunk, the final snapshot) and
# their object ids.
PARTS = {(k, KV): f"kv{k}" for k in TURN1} | {(4, SNAPSHOT): "s4"}


def core(cpu: int = 1 << 20, disk: int = 1 << 20) -> HiStateCache:
    return HiStateCache(CacheConfig(
        chunk_tokens=4, kv_chunk_bytes=2048, snapshot_bytes=8192,
        tiers=(TierSpec("cpu", cpu), TierSpec("disk", disk)),
        supported_intervals=(4, 8),
    ))


def store(c: HiStateCache, keys: list[int], now: float) -> None:
    """A STORE of session "a" the live server saw without a lookup (``attach``)."""
    c.complete(c.attach("a", keys), 4 * len(keys), now, boundaries=[4 * len(keys)])


def written(c: HiStateCache, *, commit: bool = True) -> SharedScores:
    """Turn 1's parts routed to the shared tier as ``shared_route`` does (header value =
    ``unit_inputs``), their entries committed (``commit``) or not yet."""
    scores = SharedScores()
    for where, oid in PARTS.items():
        scores.wrote(where, oid, unit_inputs(c, *where))
    if commit:
        scores.committed(PARTS.values())
    return scores


def by_id(updates: list[tuple[str, float, float, float]]) -> dict[str, tuple[float, ...]]:
    out = {oid: rest for oid, *rest in updates}
    assert len(out) == len(updates), "an id sent twice in one batch"
    return out


def test_a_written_unchanged_part_is_not_sent_again() -> None:
    """Every part of turn 1 leaves with the bundle: the header carried (t, C, M) =
    (1, 7,372.8, 16,384). Nothing changed since: ticks at t = 2 and 3 send nothing (the
    header's value is the published one: ``scores`` NOTE 2)."""
    c = core()
    store(c, TURN1, 1.0)
    for where in PARTS:
        assert unit_inputs(c, *where) == pytest.approx(BUNDLE_1)
    scores = written(c)
    assert scores.collect(c, 2.0) == []
    assert scores.collect(c, 3.0) == []
    assert len(scores) == 5


def test_a_next_turn_republishes_the_old_chunks_new_unit() -> None:
    """Turn 2 (t = 5) makes the old final bundle interior KV: M 16,384 -> 8,192 for the
    4 old chunks (on the CPU) and for the retired snapshot (alone on disk), C 7,372.8 ->
    7,645.87 (module docstring): ln(C/M) moves by ln(7,645.87/8,192) − ln(7,372.8/16,384)
    = −0.0690 + 0.7985 = 0.7295 ≥ CHANGED. t stays 1 (an ``attach`` refreshes nothing):
    age at t = 6 is 5 s. Sent once: the tick after sends nothing."""
    c = core()
    store(c, TURN1, 1.0)
    scores = written(c)
    store(c, TURN2, 5.0)
    assert c.tiers_of(4, SNAPSHOT) == 1 << DISK  # retired
    assert math.log(C_2 / 8192) - math.log(7372.8 / 16384) == pytest.approx(0.7295, abs=1e-4)
    assert by_id(scores.collect(c, 6.0)) == {
        oid: pytest.approx((C_2, 8192.0, 5.0)) for oid in PARTS.values()
    }
    assert scores.collect(c, 7.0) == []


def test_an_access_moves_t_and_that_alone_republishes() -> None:
    """After turn 2 was sent, a lookup of the whole chain at t = 9 (``begin``) reads
    every unit (t = 9) and samples an end access: p_end = 0.9 + 0.05 · (1 − 0.9) = 0.905,
    so C = 16 · (0.095/3 + 0.905) · 512 = 7,673.17 B, a move of ln(7,673.17/7,645.87)
    = 0.0036 < CHANGED in ln(C/M): the moved t alone sends all five again, age 10 − 9 =
    1 s."""
    c = core()
    store(c, TURN1, 1.0)
    scores = written(c)
    store(c, TURN2, 5.0)
    assert len(scores.collect(c, 6.0)) == 5
    c.release(c.begin("a", TURN2, 9.0))
    cost = 16 * (0.095 / 3 + 0.905) * 512
    assert math.log(cost / C_2) < CHANGED
    assert by_id(scores.collect(c, 10.0)) == {
        oid: pytest.approx((cost, 8192.0, 1.0)) for oid in PARTS.values()
    }
    assert scores.collect(c, 11.0) == []


def test_a_change_before_the_commit_is_sent_after_it_whatever_the_tick() -> None:
    """``scores`` NOTE 2. Turn 2 lands while turn 1's write is still in flight: a tick
    then sends nothing (the index would skip entries not stored yet, and the commit
    writes the header's 16,384). After the commit the next tick sends the new unit
    (C 7,645.87, M 8,192, age 7 − 1 = 6 s), as a tick that fell only after the commit
    does: the same value either way."""
    def after_commit(tick_in_between: bool) -> dict[str, tuple[float, ...]]:
        c = core()
        store(c, TURN1, 1.0)
        scores = written(c, commit=False)
        store(c, TURN2, 5.0)
        if tick_in_between:
            assert scores.collect(c, 6.0) == []
        scores.committed(PARTS.values())
        return by_id(scores.collect(c, 7.0))

    expected = {oid: pytest.approx((C_2, 8192.0, 6.0)) for oid in PARTS.values()}
    assert after_commit(True) == expected
    assert after_commit(False) == expected


def test_an_entry_already_in_the_tier_gets_this_nodes_value() -> None:
    """An id the tier held already (``present``, or a commit answering 0) holds another
    write's value without this node's share: the next tick sends this node's, unchanged
    as it is (turn 1's bundle, age 2 − 1 = 1 s); the ones committed now send nothing."""
    c = core()
    store(c, TURN1, 1.0)
    scores = written(c, commit=False)
    scores.committed(["kv1", "kv2", "kv3"], present=["kv4", "s4"])
    assert by_id(scores.collect(c, 2.0)) == {
        "kv4": pytest.approx((7372.8, 16384.0, 1.0)),
        "s4": pytest.approx((7372.8, 16384.0, 1.0)),
    }


def test_a_batch_not_sent_is_collected_again() -> None:
    """Turn 2's batch goes nowhere (degraded: ``sent(..., False)``): the next tick
    collects the same five values again (age now 7 − 1 = 6 s); once sent, nothing."""
    c = core()
    store(c, TURN1, 1.0)
    scores = written(c)
    store(c, TURN2, 5.0)
    first = scores.collect(c, 6.0)
    assert len(first) == 5
    scores.sent(first, ok=False)
    again = scores.collect(c, 7.0)
    assert by_id(again) == {oid: pytest.approx((C_2, 8192.0, 6.0)) for oid in PARTS.values()}
    scores.sent(again, ok=True)
    assert scores.collect(c, 8.0) == []


def test_a_part_the_core_let_go_leaves_the_round_with_its_last_value() -> None:
    """``scores`` NOTE 1. After turn 2 was sent, the disk is emptied (capacity 0): the
    snapshot at 4 (8,192 B, alone) is dropped; the rest stays. Its part leaves this
    node's round without an update (no withdrawal: the entry keeps C 7,645.87, M 8,192);
    the four KV parts stay (5 parts -> 4) and now leave with turn 2's bundle, chunks
    1-6 + the final at 6 (t = 5): δ = 24 with no snapshot above, C = 24 · 0.9 = 21.6
    tokens = 11,059.2 B, M = 6 · 2,048 + 8,192 = 20,480 B, age 8 − 5 = 3 s. Once the
    CPU is emptied too, every part leaves, and nothing is sent."""
    c = core()
    store(c, TURN1, 1.0)
    scores = written(c)
    store(c, TURN2, 5.0)
    scores.sent(scores.collect(c, 6.0), ok=True)
    c.set_capacity(DISK, 0, 7.0)
    assert c.tiers_of(4, SNAPSHOT) == 0 and c.tiers_of(4, KV) == 1 << CPU
    assert by_id(scores.collect(c, 8.0)) == {
        f"kv{k}": pytest.approx((11059.2, 20480.0, 3.0)) for k in TURN1
    }
    assert len(scores) == 4
    # Everything let go: every part leaves, still nothing sent.
    c.set_capacity(CPU, 0, 9.0)
    assert all(not c.tiers_of(*where) for where in PARTS)
    assert scores.collect(c, 10.0) == []
    assert len(scores) == 0


def test_interior_kv_of_the_last_tier_keeps_its_value_and_its_place() -> None:
    """Turn 1 demoted to disk (CPU capacity 0 at t = 2) before it is routed: the header
    carries the bundle on disk, (1, 7,372.8, 16,384). Turn 2 (t = 5, CPU room again)
    puts chunks 5-6 on the CPU: chunks 1-4 are interior KV of the last tier, which leave
    it with no unit (``unit_inputs`` None): nothing is sent for them, their entries keep
    M = 16,384, and they stay in the round. The old snapshot leaves disk alone: M 8,192,
    C 7,645.87, sent."""
    c = core(cpu=0)
    store(c, TURN1, 1.0)
    assert c.tiers_of(1, KV) == c.tiers_of(4, SNAPSHOT) == 1 << DISK
    scores = written(c)
    assert scores.collect(c, 2.0) == []
    c.set_capacity(CPU, 1 << 20, 3.0)
    store(c, TURN2, 5.0)
    assert [unit_inputs(c, k, KV) for k in TURN1] == [None] * 4
    assert by_id(scores.collect(c, 6.0)) == {"s4": pytest.approx((C_2, 8192.0, 5.0))}
    assert len(scores) == 5


def test_at_most_sweep_budget_parts_per_tick_in_a_round() -> None:
    """SWEEP_BUDGET + 88 one-chunk sessions (600) and a later one, each on the CPU
    (1 chunk + its final snapshot: 10,240 B), each chunk's KV written; an access
    of each at t = 2 moves every t, so every part visited is sent. Tick 1 visits the
    last 512 written, tick 2 the first 88; a part written in between waits for the next
    round (tick 3), which finds the 600 unchanged."""
    n = SWEEP_BUDGET + 88
    c = core(cpu=601 * 10_240)  # every session's bundle (2,048 + 8,192 B) on the CPU
    scores = SharedScores()
    for k in range(1, n + 1):
        c.complete(c.attach(f"s{k}", [k]), 4, 1.0, boundaries=[4])
        scores.wrote((k, KV), f"kv{k}", unit_inputs(c, k, KV))
    scores.committed(f"kv{k}" for k in range(1, n + 1))
    for k in range(1, n + 1):
        c.release(c.begin(f"s{k}", [k], 2.0))
    tick1 = {oid for oid, *_ in scores.collect(c, 3.0)}
    assert tick1 == {f"kv{k}" for k in range(89, n + 1)}
    k_new = n + 1
    c.complete(c.attach("new", [k_new]), 4, 3.5, boundaries=[4])
    scores.wrote((k_new, KV), "new", None)  # header priced by size: sent at its first visit
    scores.committed(["new"])
    tick2 = {oid for oid, *_ in scores.collect(c, 4.0)}
    assert tick2 == {f"kv{k}" for k in range(1, 89)}
    assert [oid for oid, *_ in scores.collect(c, 5.0)] == ["new"]


def test_a_read_in_flight_during_the_next_turn_delays_the_new_unit_only_until_it_ends() -> None:
    """The live server's order that varied between runs: a lookup (a probe, another
    request) pins turn 1's path at t = 2 and is still in flight when turn 2's store lands
    (t = 5). The old final snapshot is not moved under that read (``placement`` NOTE 3):
    it is an intermediate snapshot still on the CPU, so the old chunks leave the CPU
    with it, M = 4 · 2,048 + 8,192 = 16,384; the lookup sampled an end access, p_end =
    0.905, so C = 16 · (0.095/3 + 0.905) · 512 = 7,673.17 B, and read them at t = 2: sent
    at t = 6 with age 4. When the read ends the retirement is made: the snapshot goes to
    disk and the old chunks' unit frees M = 8,192 (C unchanged): sent once more."""
    c = core()
    store(c, TURN1, 1.0)
    scores = written(c)
    read = c.begin("a", TURN1, 2.0)
    store(c, TURN2, 5.0)
    cost = 16 * (0.095 / 3 + 0.905) * 512
    assert c.tiers_of(4, SNAPSHOT) == 1 << CPU
    assert by_id(scores.collect(c, 6.0)) == {
        oid: pytest.approx((cost, 16384.0, 4.0)) for oid in PARTS.values()
    }
    c.release(read)
    assert c.tiers_of(4, SNAPSHOT) == 1 << DISK
    assert by_id(scores.collect(c, 7.0)) == {
        oid: pytest.approx((cost, 8192.0, 5.0)) for oid in PARTS.values()
    }
    c.check()
