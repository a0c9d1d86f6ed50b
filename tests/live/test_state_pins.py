"""How long the connector holds vLLM's boundary-state blocks, and the stall watchdog (pure).

The connector pins a state block when vLLM offers it and must give it back as soon as the
STORE carrying it has its data (connector NOTE 1-2): a pin that lives as long as its request
starves vLLM's pool. Expected values by hand: chunk 384, boundaries 384, 768, 1152.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from lmcache_histate.backends.vllm.saves import RequestSaves
from lmcache_histate.backends.vllm.stall_watchdog import RepeatFilter, StallWatchdog


def saves_with_pins() -> RequestSaves:
    saves = RequestSaves("r")
    for block, boundary in ((11, 384), (12, 768), (13, 1152)):
        saves.offer(1, block, boundary)
        saves.pin(block, boundary)
    return saves


def test_a_pin_waits_for_its_store_then_leaves_at_the_first_report_without_it_in_flight() -> None:
    saves = saves_with_pins()
    # Step 5 plans the store of [0, 768): 384 and 768 kept.
    assert saves.planned([384, 768], 768, step=5) == []
    # A report of step 4 (before the store was planned) releases nothing.
    assert saves.stores_done(4) == []
    # The report of step 5 says the request has no store in flight: both stored pins leave;
    # 1152's store is not planned yet, so its pin stays.
    assert saves.stores_done(5) == [11, 12]
    assert saves.pinned == [13]


def test_a_boundary_passed_without_being_kept_is_released_when_the_store_is_planned() -> None:
    saves = saves_with_pins()
    # The plan keeps 768 only; the store of [0, 1152) passes 384 and 1152 without them.
    assert saves.planned([768], 1152, step=2) == [11, 13]
    assert saves.pinned == [12]
    assert saves.stores_done(2) == [12]
    assert saves.pinned == []


def test_a_preemption_releases_unplanned_pins_and_forgets_offered_blocks() -> None:
    saves = saves_with_pins()
    assert saves.planned([384], 384, step=3) == []
    # Preempted: 768 and 1152 were never planned -> released now; 384 waits for its store.
    assert saves.preempted() == [12, 13]
    assert saves.offered == {}
    assert saves.pinned == [11]
    assert saves.release_all() == [11]
    assert saves.pinned == []


def test_the_watchdog_logs_once_and_bypasses_only_a_request_waiting_for_a_load(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watchdog = StallWatchdog(3)
    request = SimpleNamespace(request_id="r", status="WAITING", num_computed_tokens=0,
                              num_prompt_tokens=9000)
    waiting = SimpleNamespace(state=SimpleNamespace(name="WAITING_FOR_LOAD"),
                              num_lmcache_hit_tokens=768, num_vllm_hit_tokens=0)
    ready = SimpleNamespace(state=SimpleNamespace(name="READY"),
                            num_lmcache_hit_tokens=768, num_vllm_hit_tokens=768)
    with caplog.at_level("WARNING"):
        assert [watchdog.stalled(request, ready) for _ in range(5)] == [False] * 5
        assert len(caplog.records) == 1  # polls 3, 4, 5: one line
        watchdog.progressed("r")
        assert [watchdog.stalled(request, waiting) for _ in range(4)] == [False, False, True,
                                                                            True]
        assert len(caplog.records) == 2
    assert "falling back to recompute" in caplog.records[-1].getMessage()


def test_the_resume_load_line_passes_three_times_per_request() -> None:
    import logging

    only = RepeatFilter("<resume-load>", limit=3)

    def record(msg: str, *args: object) -> logging.LogRecord:
        return logging.LogRecord("lmcache", logging.INFO, __file__, 1, msg, args, None)

    first = [only.filter(record("<resume-load> req=%s load=%d", "a", 0)) for _ in range(5)]
    assert first == [True, True, True, False, False]
    assert only.filter(record("<resume-load> req=%s load=%d", "b", 0))  # another request
    assert all(only.filter(record("other line %s", "a")) for _ in range(5))


# ------------------------------------------------------------------ which stores are done


def future(done: bool = False):
    from lmcache.v1.multiprocess.futures import MessagingFuture

    f = MessagingFuture()
    if done:
        f.set_result(None)
    return f


def test_a_store_in_flight_holds_only_the_pins_of_its_own_step_and_later() -> None:
    """A request in prefill always has the store just submitted in flight; the stores of
    earlier steps that completed release their pins anyway (saves NOTE 1)."""
    from lmcache_histate.backends.vllm.saves import StoreSteps

    steps = StoreSteps()
    s5, s6, s7 = future(), future(), future()
    steps.submitted(5, {"r": s5})
    steps.submitted(6, {"r": s6})
    steps.submitted(6, {"r": s6})  # the same future seen again is recorded once
    s5.set_result(None)
    steps.submitted(7, {"r": s7})
    report = steps.report(7, {"r": s7})
    # 5 done; 6 and 7 in flight: the oldest in flight is 6, so stores up to 5 are done.
    assert report.pending == {"r": 6} and report.done_through("r") == 5
    s6.set_result(None)
    assert steps.report(7, {"r": s7}).done_through("r") == 6
    # LMCache dropped the entry (latest store done): every store is done, record gone.
    s7.set_result(None)
    report = steps.report(8, {})
    assert report.pending == {} and report.done_through("r") == 8
    assert steps.report(9, {"r": future()}).done_through("r") == -1  # unseen: holds all


def test_the_report_and_the_pins_together() -> None:
    """Pins planned at steps 5 and 6; the step-6 store in flight releases step 5's pins."""
    from lmcache_histate.backends.vllm.saves import StoreReport

    saves = saves_with_pins()
    saves.planned([384], 384, step=5)
    saves.planned([768], 768, step=6)
    report = StoreReport(6, {"r": 6})
    assert saves.stores_done(report.done_through("r")) == [11]
    assert saves.pinned == [12, 13]


def test_tensor_parallel_reports_take_the_oldest_step_in_flight() -> None:
    from lmcache_histate.backends.vllm.saves import StoreReport

    merged = StoreReport(7, {"a": 5}).aggregate(StoreReport(7, {"a": 3, "b": 6}))
    assert merged == StoreReport(7, {"a": 3, "b": 6})
