"""The facade's hooks for the live server: ``evict``, ``rerank``, ``note_internal_access``,
``session_end``, each against values worked out by hand.

Set-up of ``test_placement_rules``: chunks of 10 tokens, 1 B per token (KV chunk 10 B,
snapshot 20 B), tier 0 = CPU, tier 1 = disk, ``τ = 0`` (H = t) unless a test says
otherwise. Requests without boundaries store KV only: each is a dead tail.
"""

from __future__ import annotations

import pytest
from support.core_probe import next_victim
from test_placement_rules import CPU, DISK, cache, request

from lmcache_histate.core.cache import CacheConfig, HiStateCache
from lmcache_histate.core.tiers import KV, PlacementRules, TierSpec


def test_evict_frees_what_was_asked_and_reports_it() -> None:
    """Dead tails A [1] (t = 0), B [2] (t = 1), C [3] (t = 2) on CPU, 10 B each.

    evict(CPU, 20): A then B are demoted (10 + 10 = 20 freed), C stays: 20.
    evict(CPU, 100): C goes (10), then nothing is left: 10.
    evict(DISK, 10) at t = 7: the last tier drops A (the oldest there): 10.
    """
    c, _ = cache(cpu=1000, disk=1000)
    for key, t in ((1, 0.0), (2, 1.0), (3, 2.0)):
        request(c, f"s{key}", [key], t, [])
    assert c.evict(CPU, 20, 5.0) == 20
    assert [c.tiers_of(k, KV) for k in (1, 2, 3)] == [1 << DISK, 1 << DISK, 1 << CPU]
    assert c.evict(CPU, 100, 6.0) == 10
    assert c.stats().used_bytes[CPU] == 0
    assert c.evict(DISK, 10, 7.0) == 10
    assert [c.tiers_of(k, KV) for k in (1, 2, 3)] == [0, 1 << DISK, 1 << DISK]
    c.check()


def test_evict_counts_units_of_a_single_byte() -> None:
    """KV chunks of 1 B, one tier: two dead tails; evict(0, 2) takes both: 1 + 1 = 2."""
    cfg = CacheConfig(chunk_tokens=10, kv_chunk_bytes=1, snapshot_bytes=2,
                      tiers=(TierSpec("all", 10),), rules=PlacementRules(0, 0, 0), tau=0.0)
    c = HiStateCache(cfg)
    request(c, "a", [1], 0.0, [])
    request(c, "b", [2], 1.0, [])
    assert c.evict(0, 2, 2.0) == 2
    assert c.stats().used_bytes[0] == 0


def test_evict_keeps_a_better_unit_on_the_lower_tier() -> None:
    """``test_placement_rules.test_demotion_never_evicts_a_better_unit_from_the_lower_tier``
    through ``evict``: CPU and disk 40 B; A (t = 0) demoted by B (t = 10), A read at 20.
    evict(CPU, 40) at 30: B (H = 10) cannot push A (H = 20) off disk: B is dropped (40)."""
    c, _ = cache(cpu=40, disk=40)
    request(c, "A", [1, 2], 0.0, [20])
    request(c, "B", [11, 12], 10.0, [20])
    request(c, "A", [1, 2], 20.0, [])
    assert c.evict(CPU, 40, 30.0) == 40
    assert [c.lookup(k).hit_chunks for k in ([1, 2], [11, 12])] == [2, 0]
    c.check()


def test_rerank_prices_a_unit_with_the_hit_model_as_it_is_now() -> None:
    """One tier, τ = 10. A [1, 2] with its final snapshot at 20 tokens, t = 0: the bundle
    at 2 frees KV 20 B + snapshot 20 B = 40 B; δ = 20, A ends at it (no internal mass),
    one session passes: C = 20·p_end.

    p_end = 0.9: C = 18 → H = 10·ln(18/40) = 10·(−0.798508) = −7.985077.
    One internal access: p_end = 0.9 − 0.05·0.9 = 0.855 → C = 17.1 → H = 10·ln 0.4275
    = 10·(−0.798508 − 0.051293) = −8.498010. The queued rank is not refreshed by the
    access (a lower fresh rank is not re-checked by ``victim``) until ``rerank``."""
    cfg = CacheConfig(chunk_tokens=10, kv_chunk_bytes=10, snapshot_bytes=20,
                      tiers=(TierSpec("all", 1000),), rules=PlacementRules(0, 0, 0), tau=10.0)
    c = HiStateCache(cfg)
    request(c, "A", [1, 2], 0.0, [20])
    found = next_victim(c, 0)
    assert found is not None and found[0] == 2
    assert found[1] == pytest.approx(-7.985077, abs=1e-5)
    c.note_internal_access()
    assert c.stats().end_probability == pytest.approx(0.855)
    assert next_victim(c, 0)[1] == pytest.approx(-7.985077, abs=1e-5)  # type: ignore[index]
    c.rerank([999, 2])  # an unknown key is skipped
    found = next_victim(c, 0)
    assert found is not None and found[0] == 2
    assert found[1] == pytest.approx(-8.498010, abs=1e-5)


def test_session_end_names_the_last_chunk() -> None:
    c, _ = cache(cpu=1000, disk=1000)
    request(c, "A", [1, 2], 0.0, [20])
    request(c, "X", [5], 1.0, [10])  # a one-chunk session ends at depth 0
    assert (c.session_end("A"), c.session_end("X"), c.session_end("nobody")) == (2, 5, None)


def test_promote_reports_the_bytes_it_moved() -> None:
    """A [1..5] with snapshots at 10 and 30 tokens (intermediate: disk) and 50 (final: CPU).
    CPU: KV 5·10 = 50 B + the final snapshot 20 B. Promoting the prompt to CPU moves
    nothing (0). To disk: the KV (50), then the resumed final snapshot, its KV now there
    (20): 70; the units along the path are re-ranked (S1 no longer frees anything on CPU,
    ``check``); to disk again: 0."""
    c, ev = cache(cpu=1000, disk=1000)
    request(c, "A", [1, 2, 3, 4, 5], 0.0, [10, 30, 50])
    handle = c.begin("A", [1, 2, 3, 4, 5], 1.0)
    assert handle.match.hit_chunks == 5
    assert c.promote(handle, CPU, 1.0) == 0
    ev.take()
    assert c.promote(handle, DISK, 1.0) == 70
    assert ev.take() == [*(("moved", k, "kv", DISK) for k in (1, 2, 3, 4, 5)),
                         ("moved", 5, "snapshot", DISK)]
    c.check()
    assert c.promote(handle, DISK, 1.0) == 0
    assert c.stats().used_bytes[DISK] == 50 + 3 * 20
    c.release(handle)
    c.check()


def test_promote_stops_at_what_does_not_fit_or_is_gone() -> None:
    """Disk holds 5 B: A's first KV chunk (10 B) does not fit, nothing moves (0). After
    chunk 1's KV is lost (and everything below it), there is nothing to promote (0)."""
    c, _ = cache(cpu=1000, disk=5)
    request(c, "A", [1, 2], 0.0, [20])
    handle = c.begin("A", [1, 2], 1.0)
    assert c.promote(handle, DISK, 1.0) == 0
    c.lose(1, KV, CPU)
    assert c.promote(handle, DISK, 1.0) == 0
    c.release(handle)
    c.check()


def test_stats_report_the_score_knobs() -> None:
    """Fixed τ = 0: not calibrated. A's continuation from its end is one hit sample.
    With ``tau=None`` the calibrated τ starts at 0 (no re-access gap seen yet)."""
    c, _ = cache(cpu=1000, disk=1000)
    assert next_victim(c, CPU) is None  # nothing stored yet
    request(c, "A", [1, 2], 0.0, [20])
    request(c, "A", [1, 2, 3], 1.0, [30])
    stats = c.stats()
    assert (stats.tau_s, stats.tau_calibrated, stats.hit_samples) == (0.0, False, 1)
    cfg = CacheConfig(chunk_tokens=10, kv_chunk_bytes=10, snapshot_bytes=20,
                      tiers=(TierSpec("all", 1000),), rules=PlacementRules(0, 0, 0))
    calibrated = HiStateCache(cfg).stats()
    assert (calibrated.tau_s, calibrated.tau_calibrated) == (0.0, True)


def test_begin_reports_whether_a_session_came_back_at_its_end() -> None:
    """X ends at chunk 5 (depth 0). A new session has no end to come back to (None); X
    reading [5, 6] continues from its end (True: 0.9 + 0.05·0.1 = 0.905); X then reading
    [7] does not pass chunk 5 (False: 0.905 − 0.05·0.905 = 0.85975)."""
    c, _ = cache(cpu=1000, disk=1000)
    first = c.begin("X", [5], 0.0)
    assert first.at_end is None
    c.complete(first, 10, 0.0, boundaries=[10])
    back = c.begin("X", [5, 6], 1.0)
    assert back.at_end is True
    c.complete(back, 10, 1.0, boundaries=[10])  # X still ends at chunk 5
    assert c.stats().end_probability == pytest.approx(0.905)
    away = c.begin("X", [7], 2.0)
    assert away.at_end is False
    assert c.stats().end_probability == pytest.approx(0.85975)
    c.release(away)


def test_a_request_that_stores_nothing_still_counts_as_an_access() -> None:
    """A at t = 0 (stored), read at 10 without storing (released), read at 25: re-access
    gaps 10 and 15 → EMA 10 + 0.05·(15 − 10) = 10.25 over 2 samples."""
    c, _ = cache(cpu=1000, disk=1000)
    request(c, "A", [1, 2], 0.0, [20])
    c.release(c.begin("A", [1, 2], 10.0))
    c.release(c.begin("A", [1, 2], 25.0))
    status = c.stats()
    assert (status.reaccess_samples, status.reaccess_gap_s) == (2, pytest.approx(10.25))


def test_complete_counts_what_it_stored() -> None:
    """A [1..4] with boundaries 5 (inside the first chunk: no state there), 20, 40 and 50
    (past the chain): snapshots at chunks 2 and 4 only → (4 KV, 2 snapshots). B then reads
    A's first two chunks and computes a third (11): 1 new KV chunk, its final snapshot."""
    c, _ = cache(cpu=1000, disk=1000)
    handle = c.begin("A", [1, 2, 3, 4], 0.0)
    assert c.complete(handle, 40, 0.0, boundaries=[5, 20, 40, 50]) == (4, 2)
    handle = c.begin("B", [1, 2, 11], 1.0)
    assert c.complete(handle, 30, 1.0, boundaries=[30]) == (1, 1)
    c.release(handle)  # already released by complete: nothing left to unpin
    assert c.node(2).pins == 0  # type: ignore[union-attr]
    c.check()


def test_an_end_at_the_first_chunk_retires_unless_another_session_ends_there() -> None:
    """X ends at chunk 5 (depth 0; final snapshot on CPU). Y reads it too and ends there.
    X moves on to [5, 6]: chunk 5 is still Y's end, its snapshot stays on CPU. Y moves on
    to [5, 7]: now nobody ends at 5 and its snapshot retires to disk."""
    c, ev = cache(cpu=1000, disk=1000)
    request(c, "X", [5], 0.0, [10])
    request(c, "Y", [5], 1.0, [10])
    ev.take()
    request(c, "X", [5, 6], 2.0, [20])
    assert not [e for e in ev.take() if e[1] == 5]
    request(c, "Y", [5, 7], 3.0, [20])
    assert ("moved", 5, "snapshot", DISK) in ev.take()
    assert c.tiers_of(5, "snapshot") == 1 << DISK
    c.check()


def test_the_config_reaches_the_hit_model_and_the_cost() -> None:
    """``end_probability_prior`` 0.5 and ``attention_tokens`` K = 20 (one tier, τ = 10).
    A's bundle at 2 (δ = 20, p = 20, p_prev = 0): C = 20·0.5·1 pass · (1 + (20 + 0)/(2·20))
    = 10·1.5 = 15; M = 40 B → H = 10·ln(15/40) = 10·(−0.980829) = −9.808293."""
    cfg = CacheConfig(chunk_tokens=10, kv_chunk_bytes=10, snapshot_bytes=20,
                      tiers=(TierSpec("all", 1000),), rules=PlacementRules(0, 0, 0), tau=10.0,
                      attention_tokens=20.0, end_probability_prior=0.5)
    c = HiStateCache(cfg)
    assert c.stats().end_probability == 0.5
    request(c, "A", [1, 2], 0.0, [20])
    found = next_victim(c, 0)
    assert found is not None and found[0] == 2
    assert found[1] == pytest.approx(-9.808293, abs=1e-5)


def test_promote_skips_what_is_already_there_and_a_snapshot_whose_kv_is_not() -> None:
    """A [1, 2] promoted to disk whole. B [1, 2, 3] (chunk 3 and B's final on CPU):
    promoting B's prompt to disk skips 1 and 2, moves chunk 3 (10) and B's snapshot (20):
    30. Then with 30 B KV chunks and a 25 B disk: KV does not fit, so the 20 B snapshot
    (which would) stays too: nothing is promoted without its KV on the tier (0)."""
    c, _ = cache(cpu=1000, disk=1000)
    request(c, "A", [1, 2], 0.0, [20])
    handle = c.begin("A", [1, 2], 1.0)
    assert c.promote(handle, DISK, 1.0) == 40
    c.release(handle)
    request(c, "B", [1, 2, 3], 2.0, [30])
    handle = c.begin("B", [1, 2, 3], 3.0)
    assert c.promote(handle, DISK, 3.0) == 30
    c.release(handle)
    cfg = CacheConfig(chunk_tokens=10, kv_chunk_bytes=30, snapshot_bytes=20,
                      tiers=(TierSpec("cpu", 1000), TierSpec("disk", 25)), tau=0.0)
    small = HiStateCache(cfg)
    request(small, "A", [1], 0.0, [10])
    handle = small.begin("A", [1], 1.0)
    assert small.promote(handle, DISK, 1.0) == 0
    small.release(handle)
    small.check()


@pytest.mark.parametrize(("lost", "pruned"), [(3, {3}), (2, {2, 3})])
def test_release_prunes_exactly_the_chunks_lost_under_the_pin(lost: int, pruned: set[int]) -> None:
    """A stores KV chunks 1-3 (CPU). B's request pins all three; meanwhile chunk
    ``lost``'s KV vanishes, and with it every chunk below (KV is prefix-closed): 3 alone,
    or 2 and 3. The pinned nodes stay in the index until B releases them; the release
    removes exactly the lost ones and keeps the chunks above with their KV."""
    c, _ = cache(cpu=1000, disk=1000)
    request(c, "A", [1, 2, 3], 0.0, [])
    handle = c.begin("B", [1, 2, 3], 1.0)
    c.lose(lost, KV, CPU)
    assert all(k in c for k in (1, 2, 3))  # kept for the pin
    c.release(handle)
    assert {k for k in (1, 2, 3) if k not in c} == pruned
    assert all(c.tiers_of(k, KV) == 1 << CPU for k in {1, 2, 3} - pruned)
    c.check()
