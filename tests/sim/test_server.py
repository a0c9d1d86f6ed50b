"""Server model on tiny hand-built traces: queueing, TTFT components, closed loop."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from lmcache_histate.sim.config import CostModel, SimSetup
from lmcache_histate.sim.policy import Lookup
from lmcache_histate.sim.server import simulate
from lmcache_histate.sim.synthetic import synthetic_agent
from lmcache_histate.sim.trace_model import Request, Session, Trace
from lmcache_histate.sim.variants import histate_policy

CHUNK = 4
COST = CostModel(
    name="unit",
    pcie_bytes_per_s=100.0,
    ssd_bytes_per_s=10.0,
    prefill_s_per_token=0.5,
    attention_s_per_token_pair=0.01,
    decode_s_per_token=0.25,
    request_overhead_s=0.125,
)


def setup(**kw: object) -> SimSetup:
    return SimSetup.paper(cost=COST, chunk_tokens=CHUNK, **kw)


def req(sid: str, i: int, tokens: int, *, at: float = 0.0, think: float = 0.0,
        out: int = 4) -> Request:
    return Request(sid, i, at, think, tokens, out, tuple(range(tokens // CHUNK)))


def trace(*sessions: Session) -> Trace:
    return Trace("t", CHUNK, sessions)


@dataclass
class FixedPolicy:
    """Hits ``hit`` tokens, reading ``load`` bytes per tier; records its calls."""

    hit: int = 0
    load: dict[str, int] | None = None
    name: str = "fixed"

    def __post_init__(self) -> None:
        self.calls: list[tuple[str, str, int, float]] = []

    def begin(self, request: Request, now: float) -> Lookup:
        self.calls.append(("begin", request.session_id, request.index, now))
        return Lookup(min(self.hit, request.input_tokens), dict(self.load or {}))

    def complete(self, request: Request, lookup: Lookup, now: float) -> dict[str, int]:
        self.calls.append(("complete", request.session_id, request.index, now))
        return {"gpu": 1}

    def stats(self) -> dict[str, float]:
        return {}


def test_ttft_components_add_up() -> None:
    pol = FixedPolicy(hit=4, load={"gpu": 1000, "cpu": 200, "disk": 30})
    run = simulate(trace(Session("a", None, (req("a", 0, 10),))), pol, setup())
    (r,) = run.results
    load = 200 / 100 + 30 / 10  # GPU-resident bytes are free
    recompute = 0.5 * 6 + 0.01 * (10 * 10 - 4 * 4) / 2
    assert r.queue_s == 0.0
    assert r.load_s == pytest.approx(load)
    assert r.recompute_s == pytest.approx(recompute)
    assert r.ttft == pytest.approx(0.125 + load + recompute)
    assert r.written_bytes == {"gpu": 1}
    # begin when service starts, complete when the prefill ends.
    assert pol.calls == [("begin", "a", 0, 0.0), ("complete", "a", 0, pytest.approx(r.ttft))]


def test_gpu_serves_prefills_fifo() -> None:
    a = Session("a", None, (req("a", 0, 8),))
    b = Session("b", None, (req("b", 0, 8),))
    run = simulate(trace(a, b), FixedPolicy(), setup(session_gap_s=0.0, gpu_scheduling="fifo"))
    ra, rb = run.results
    service = 0.125 + 0.5 * 8 + 0.01 * 64 / 2
    assert (ra.session_id, rb.session_id) == ("a", "b")
    assert ra.ttft == pytest.approx(service)
    assert rb.queue_s == pytest.approx(service)
    assert rb.ttft == pytest.approx(2 * service)


def test_shared_gpu_runs_concurrent_prefills_together() -> None:
    """Processor sharing: a short prompt is not stuck behind a long one."""
    long_ = Session("long", None, (req("long", 0, 40),))
    short = Session("short", None, (req("short", 0, 4, at=1.0),))
    pol = FixedPolicy(load={"cpu": 100})  # 1 s of PCIe before each compute
    run = simulate(trace(long_, short), pol, setup(session_gap_s=0.0))
    by = {r.session_id: r for r in run.results}
    work_long = 0.125 + 0.5 * 40 + 0.01 * 1600 / 2
    work_short = 0.125 + 0.5 * 4 + 0.01 * 16 / 2
    # long computes alone from t=1 to t=2 (the short one is loading), then both share.
    assert by["short"].ttft == pytest.approx(1.0 + 2 * work_short)
    assert by["long"].ttft == pytest.approx(1.0 + work_long + work_short)
    assert by["short"].queue_s == pytest.approx(work_short)  # the slow-down from sharing
    # Under FIFO the short one waits for the whole long prefill instead.
    fifo = simulate(trace(long_, short), FixedPolicy(load={"cpu": 100}),
                    setup(session_gap_s=0.0, gpu_scheduling="fifo"))
    assert {r.session_id: r for r in fifo.results}["short"].ttft > 1.0 + work_long


def test_sessions_beyond_k_wait_for_a_slot() -> None:
    a = Session("a", None, (req("a", 0, 8, out=4),))
    b = Session("b", None, (req("b", 0, 8),))
    run = simulate(trace(a, b), FixedPolicy(), setup(max_sessions=1))
    service = 0.125 + 0.5 * 8 + 0.01 * 64 / 2
    _, rb = run.results
    # b gets a's slot once a's last request is decoded; the wait is not TTFT.
    assert run.slot_wait == {"a": 0.0, "b": pytest.approx(service + 4 * 0.25)}
    assert rb.arrival == pytest.approx(service + 1.0)
    assert rb.queue_s == 0.0 and rb.ttft == pytest.approx(service)


def test_closed_loop_think_time_and_cap() -> None:
    s = Session("a", None, (req("a", 0, 8, out=4), req("a", 1, 8, think=5.0, out=8),
                            req("a", 2, 8, think=10_000.0)))
    run = simulate(trace(s), FixedPolicy(), setup(max_think_s=600.0))
    r0, r1, r2 = run.results
    done0 = r0.arrival + r0.ttft
    assert r1.arrival == pytest.approx(done0 + 4 * 0.25 + 5.0)
    done1 = r1.arrival + r1.ttft
    assert r2.arrival == pytest.approx(done1 + 8 * 0.25 + 600.0)
    assert run.capped_gaps == 1


def test_subagent_starts_relative_to_parent_admission() -> None:
    main = Session("m", None, (req("m", 0, 8, at=100.0),))
    sub = Session("m/x", "m", (req("m/x", 0, 8, at=130.0),))
    blocker = Session("z", None, (req("z", 0, 8, at=0.0, out=400),))
    run = simulate(trace(blocker, main, sub), FixedPolicy(), setup(max_sessions=1))
    service = 0.125 + 0.5 * 8 + 0.01 * 64 / 2
    late = service + 400 * 0.25 - 100.0  # z holds the only slot past m's start
    by = {r.session_id: r for r in run.results}
    assert run.slot_wait["m"] == pytest.approx(late)
    assert by["m"].arrival == pytest.approx(100.0 + late)
    # The subagent keeps its 30 s offset from its parent's (delayed) start.
    assert by["m/x"].arrival == pytest.approx(130.0 + late)


def test_rejects_hits_beyond_the_prompt() -> None:
    class Bad(FixedPolicy):
        def begin(self, request: Request, now: float) -> Lookup:
            return Lookup(request.input_tokens + 1)

    with pytest.raises(ValueError, match="hit_tokens"):
        simulate(trace(Session("a", None, (req("a", 0, 8),))), Bad(), setup())


def test_chunk_size_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="chunked"):
        simulate(Trace("t", 8, ()), FixedPolicy(), setup())


def test_replay_is_deterministic_for_a_seed() -> None:
    s = SimSetup.paper(chunk_tokens=528, gpu_bytes=2 << 30, cpu_bytes=4 << 30,
                       disk_bytes=8 << 30)

    def once(seed: int) -> list[tuple[object, ...]]:
        tr = synthetic_agent(6, 6, 3000, 0.2, chunk_tokens=528, seed=seed, think_time=3.0,
                             session_gap=5.0)
        run = simulate(tr, histate_policy(s), s)
        return [(r.key, r.hit_tokens, r.arrival, r.ttft, tuple(r.load_bytes.items()))
                for r in run.results]

    assert once(7) == once(7)
    assert once(7) != once(8)


def test_histate_hits_on_a_growing_session() -> None:
    s = SimSetup.paper()
    tr = synthetic_agent(1, 4, 4000, 0.0, chunk_tokens=528, seed=0)
    run = simulate(tr, histate_policy(s), s)
    hits = [r.hit_tokens for r in run.results]
    # Turn k resumes from the final snapshot of turn k-1 (its last full chunk).
    assert hits == [0] + [(4000 * k // 528) * 528 for k in range(1, 4)]


def test_capture_cost_is_on_the_request_path() -> None:
    """A row that needs one-chunk steps and copies states to host pays both (``Capture``).

    Cost model: 0.5 s per extra step, engine default 8-token steps, PCIe 100 B/s. A
    16-token prompt, nothing hit, chunk 4: ceil(16/4) − ceil(16/8) = 4 − 2 = 2 extra steps
    + 1 forced split = 3 steps = 1.5 s of GPU time; 2 mid-prefill states of S bytes
    copied at 100 B/s. The copy runs with the loads, the steps with the recompute."""
    from dataclasses import replace

    from lmcache_histate.sim.capture import Capture

    class Capturing(FixedPolicy):
        def capture(self, request: Request, lookup: Lookup) -> Capture:
            return Capture(step_tokens=CHUNK, splits=1, host_states=2)

    cost = replace(COST, step_overhead_s=0.5, engine_step_tokens=8)
    s = SimSetup.paper(cost=cost, chunk_tokens=CHUNK)
    run = simulate(trace(Session("a", None, (req("a", 0, 16),))), Capturing(), s)
    (r,) = run.results
    copy = 2 * s.snapshot_bytes / 100.0
    recompute = 0.5 * 16 + 0.01 * 256 / 2
    assert r.capture_s == pytest.approx(1.5 + copy)
    assert r.ttft == pytest.approx(0.125 + recompute + 1.5 + copy)
    fifo = simulate(trace(Session("a", None, (req("a", 0, 16),))), Capturing(),
                    s.with_(gpu_scheduling="fifo"))
    assert fifo.results[0].ttft == pytest.approx(r.ttft)


def test_histate_rows_capture_their_planned_states() -> None:
    """``histate`` ends a step at each planned state below the final one (the live step
    scheduler) and copies the mid states to host; ``histate-small-steps`` pays one-chunk
    steps instead; the ``histate-align`` ablation plans only the final state (the engine's
    own steps)."""
    from lmcache_histate.sim.capture import Capture, capture_of, planned_extra_steps
    from lmcache_histate.sim.variants import VARIANTS

    s = SimSetup.paper()
    tr = synthetic_agent(1, 1, 20_000, 0.0, chunk_tokens=528, seed=0)
    (r,) = tr.sessions[0].requests
    full = histate_policy(s)
    # 20,000 tokens = 37 full chunks (19,536 tokens). A fresh core has seen no snapshot
    # leave: factor 0 on the engine's grid, 8,192 rounded down to 15 chunks = 7,920
    # tokens, at σ = 25 and the prior q = 0.1 (core/interval.py NOTE 3): cost₀(kC) =
    # 0.05·528k + 25·(37/k)·(1 − k/15): 5C 132 + 123.333 = 255.333, 6C 158.4 + 92.5 =
    # 250.9, 7C 184.8 + 70.476 = 255.276, 15C 396 -> 6C: six mid states and the final.
    priced = Capture(step_ends=(3168, 6336, 9504, 12672, 15840, 19008), host_states=6)
    assert capture_of(full, r, full.begin(r, 0.0)) == priced
    # vLLM's own scheduler (the ablation): a grid of one chunk, a state at every chunk,
    # 36 mid-prefill states and the final, charged one-chunk steps.
    every = tuple(528 * k for k in range(1, 37))
    small = histate_policy(s, "histate-small-steps")
    assert capture_of(small, r, small.begin(r, 0.0)) == Capture(step_tokens=528,
                                                                 host_states=36)
    # Factor 1: N_s = 51,511,296 / 32,768 = 1,572 tokens, I* = sqrt(2 · 19,536 · 1,572) ≈
    # 7,837 tokens → 15 chunks (7,920): states @15 @30, final @37: two mid-prefill states.
    full = histate_policy(s)
    full.cache.follow_residence(1.0, 1, 1.0, 1)  # T_KV / T_state = 1 / 1
    cap = capture_of(full, r, full.begin(r, 0.0))
    assert cap == Capture(step_ends=(7920, 15840), host_states=2)
    # At the 8,192-token budget: pieces 7,920 / 7,920 / 4,160, one step each = ceil(20,000
    # / 8,192) = 3: no extra step. A state at every chunk: 36 pieces of 528 + 992 = 37
    # steps, 34 more.
    assert planned_extra_steps(cap.step_ends, 20_000, 8192) == 0
    # The fresh core's priced plan (factor 0): six pieces of 3,168 and 992 = 7 steps,
    # 4 more than 3 (at most one per planned state).
    assert planned_extra_steps(priced.step_ends, 20_000, 8192) == 4
    assert planned_extra_steps(every, 20_000, 8192) == 34
    align = histate_policy(s, "histate-align", **dict(VARIANTS["histate-align"]))
    assert capture_of(align, r, align.begin(r, 0.0)) == Capture()


def test_planned_step_ends_cost_at_most_one_step_each() -> None:
    from lmcache_histate.sim.capture import planned_extra_steps

    # 20 blocks of 10 at a 80-token budget: plan 90, 180 -> 80, 90, 170, 180, 200: 5 steps
    # against ceil(200 / 80) = 3.
    assert planned_extra_steps((90, 180), 200, 80) == 2
    assert planned_extra_steps((80, 160), 200, 80) == 0  # on the budget's grid
    assert planned_extra_steps((0, 200, 250), 200, 80) == 0  # outside (0, tokens)
    assert planned_extra_steps((5,), 0, 80) == 0


def test_fifo_service_counts_loads_and_the_capture_of_the_uncached_part() -> None:
    """Two 16-token requests at t = 0 under FIFO, each hitting 4 tokens after loading
    100 B from CPU (1 s at 100 B/s), capturing with one-chunk steps, 1 split, 2 states.

    Uncached 12 tokens: ceil(12/4) − ceil(12/8) = 3 − 2 = 1 extra step + 1 split = 2
    steps of 0.5 s = 1.0 s; the copies 2·S/100 s. Recompute 0.5·12 + 0.01·(256 − 16)/2 =
    6 + 1.2 = 7.2 s. Service = 0.125 + 1 + 7.2 + 1.0 + copy; b waits one service.
    """
    from dataclasses import replace

    from lmcache_histate.sim.capture import Capture

    class Capturing(FixedPolicy):
        def capture(self, request: Request, lookup: Lookup) -> Capture:
            return Capture(step_tokens=CHUNK, splits=1, host_states=2)

    cost = replace(COST, step_overhead_s=0.5, engine_step_tokens=8)
    s = SimSetup.paper(cost=cost, chunk_tokens=CHUNK, session_gap_s=0.0, gpu_scheduling="fifo")
    a = Session("a", None, (req("a", 0, 16),))
    b = Session("b", None, (req("b", 0, 16),))
    run = simulate(trace(a, b), Capturing(hit=4, load={"cpu": 100}), s)
    ra, rb = run.results
    copy = 2 * s.snapshot_bytes / 100.0
    service = 0.125 + 1.0 + 7.2 + 1.0 + copy
    assert (ra.key, rb.key) == (("a", 0), ("b", 0))
    assert (ra.input_tokens, ra.hit_tokens) == (16, 4)
    assert ra.capture_s == pytest.approx(1.0 + copy)
    assert ra.ttft == pytest.approx(service)
    assert rb.queue_s == pytest.approx(service)
    assert rb.ttft == pytest.approx(2 * service)
    assert run.makespan == pytest.approx(2 * service + 4 * 0.25)  # b's decode ends it
