"""Discrete-event replay of one GPU serving agent sessions through a caching ``Policy``.

The model, and why each part is there:

* **Sessions and slots.** At most ``K = setup.max_sessions`` sessions are replayed at
  once (the paper runs ≤ 24). A session holds its slot from its first request's arrival
  until its last request's output has been decoded: an agent keeps its context live
  between calls, so that is how long it competes for the cache. Sessions that become
  eligible while all slots are taken wait in FIFO order (eligibility time, then trace
  order). A session is eligible at its trace start; a subagent (``Session.parent``) at
  its parent's admission plus its trace offset from the parent's start, so subagents
  stay aligned with the conversation that spawned them. Waiting for a slot is reported
  separately (``RunResult.slot_wait``) and is not part of any TTFT: the request has not
  been issued yet.
* **Closed loop.** A session's requests are issued in order. Request ``i+1`` arrives
  ``think_time`` after request ``i`` completed, where completion = end of its prefill +
  its decode (``output_tokens × decode_s_per_token``). Think times above
  ``setup.max_think_s`` are capped (the Weka trace has multi-hour pauses that would
  only stretch the replay; the number of capped gaps is reported).
* **The GPU** (``setup.gpu_scheduling``). ``shared`` (default): vLLM V1 schedules with
  chunked prefill, every step giving each running prefill a slice of the token budget,
  so concurrent prefills progress together — modelled as processor sharing: the
  compute of all prefills in flight shares the GPU equally, a short prompt is not stuck
  behind a long cold one. ``fifo``: prefills one at a time in arrival order (exclusive
  head-of-line service, the pessimistic discipline). Either way the GPU is
  work-conserving. Loads (PCIe/SSD transfers) run before a request's compute and do not
  take GPU compute from others. Decodes are assumed to overlap with prefills (they are
  memory-bound, prefills compute-bound) and only delay the session's next request.
* **Service time** of a request = ``request_overhead_s`` + the time to load what hit
  (bytes per tier over that tier's bandwidth; GPU-resident data is free) + recompute of
  the uncached suffix (linear + attention-quadratic prefill cost) + the cost of
  capturing its states (``config.Capture``: extra prefill steps, GPU time shared like
  the recompute; device → host copies of mid-prefill states, charged with the loads).
  The policy's ``begin`` runs when service starts (the cache is consulted when the
  engine schedules the request), ``complete`` when the prefill ends (what it computed
  is stored). What a row captures: ``capture.capture_of``.
* **TTFT** = queueing wait for the GPU (``fifo``) or slow-down from sharing it
  (``shared``) + service time.
* **Memory** of a row (``RunResult.capacity_bytes``, ``capture.capacity_of``): the bytes
  of all its tiers / pools (∞ for the unlimited reference).

Events live in one ``heapq`` keyed by (time, sequence number): O(log n) per event, no
scan over sessions, and ties resolve in insertion order, so a replay is deterministic.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .capture import capacity_of, capture_of
from .config import SimSetup
from .policy import Lookup, Policy
from .trace_model import Request, Session, Trace

__all__ = ["RequestResult", "RunResult", "simulate"]

_ELIGIBLE, _ARRIVE, _DONE, _SESSION_END, _LOADED, _SHARED_DONE = range(6)


@dataclass(slots=True)
class RequestResult:
    """One request's outcome. Times in seconds of simulated time."""

    session_id: str
    index: int
    input_tokens: int
    output_tokens: int
    hit_tokens: int
    arrival: float
    start: float
    queue_s: float
    overhead_s: float
    load_s: float
    recompute_s: float
    load_bytes: dict[str, int]
    written_bytes: dict[str, int]
    rewrite: bool = False
    capture_s: float = 0.0

    @property
    def ttft(self) -> float:
        return self.queue_s + self.overhead_s + self.load_s + self.recompute_s + self.capture_s

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def key(self) -> tuple[str, int]:
        return (self.session_id, self.index)


@dataclass(slots=True)
class RunResult:
    """A policy's replay of a trace: per-request results (in completion order) and totals."""

    policy: str
    trace: str
    results: list[RequestResult]
    stats: dict[str, float]
    makespan: float
    wall_s: float
    capped_gaps: int
    slot_wait: dict[str, float] = field(default_factory=dict)
    capacity_bytes: float = 0.0

    @property
    def request_rate(self) -> float:
        """Requests per simulated second over the whole replay."""
        return len(self.results) / self.makespan if self.makespan > 0 else 0.0


@dataclass(slots=True)
class _Live:
    session: Session
    next_index: int = 0


class _SharedGPU:
    """Processor sharing of prefill compute: ``n`` jobs in flight each progress at 1/n.

    ``O(n)`` per event with ``n`` ≤ the prefills in flight (bounded by the session
    slots), which keeps the replay linear in the number of requests.
    """

    __slots__ = ("jobs", "last", "version")

    def __init__(self) -> None:
        self.jobs: dict[int, list] = {}  # job id -> [remaining work (s), payload]
        self.last = 0.0
        self.version = 0

    def advance(self, now: float) -> None:
        if self.jobs and now > self.last:
            share = (now - self.last) / len(self.jobs)
            for job in self.jobs.values():
                job[0] -= share
        self.last = now

    def add(self, now: float, job_id: int, work: float, payload: object) -> None:
        self.advance(now)
        self.jobs[job_id] = [work, payload]
        self.version += 1

    def next_done(self) -> tuple[float, int] | None:
        """(time, job id) of the next completion if nothing else arrives."""
        if not self.jobs:
            return None
        job_id, job = min(self.jobs.items(), key=lambda kv: (kv[1][0], kv[0]))
        return self.last + max(0.0, job[0]) * len(self.jobs), job_id

    def pop(self, now: float, job_id: int) -> object:
        self.advance(now)
        self.version += 1
        return self.jobs.pop(job_id)[1]


def _eligible_order(trace: Trace) -> tuple[list[tuple[float, Session]], dict[str, list[Session]]]:
    """Root sessions with their eligibility time, and each parent's subagent sessions."""
    ids = {s.id for s in trace.sessions}
    roots: list[tuple[float, Session]] = []
    children: dict[str, list[Session]] = {}
    for s in trace.sessions:
        if not s.requests:
            continue
        if s.parent is not None and s.parent in ids:
            children.setdefault(s.parent, []).append(s)
        else:
            roots.append((s.requests[0].arrival, s))
    return roots, children


def simulate(
    trace: Trace,
    policy: Policy,
    setup: SimSetup,
    progress: Callable[[int], None] | None = None,
) -> RunResult:
    """Replay ``trace`` through ``policy`` on the server model (module docstring).

    ``progress(n)`` is called after every completed request with the count so far.
    """
    if trace.chunk_tokens != setup.chunk_tokens:
        raise ValueError(
            f"trace {trace.name!r} is chunked at {trace.chunk_tokens} tokens but the set-up "
            f"uses {setup.chunk_tokens}"
        )
    cost = setup.cost
    snapshot_bytes = setup.snapshot_bytes
    cap = setup.max_think_s
    wall0 = time.perf_counter()
    events: list[tuple[float, int, int, object]] = []
    seq = 0

    def push(at: float, kind: int, obj: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (at, seq, kind, obj))

    roots, children = _eligible_order(trace)
    for at, s in roots:
        push(at, _ELIGIBLE, s)
    eligible_at: dict[str, float] = {}
    waiting: deque[Session] = deque()
    slot_wait: dict[str, float] = {}
    active = 0
    gpu_queue: deque[tuple[Request, float]] = deque()
    gpu_busy = False
    live: dict[str, _Live] = {}
    results: list[RequestResult] = []
    capped = 0
    now = 0.0

    def admit(at: float) -> None:
        nonlocal active
        while active < setup.max_sessions and waiting:
            s = waiting.popleft()
            active += 1
            slot_wait[s.id] = at - eligible_at[s.id]
            live[s.id] = _Live(s)
            push(at, _ARRIVE, s.requests[0])
            start0 = s.requests[0].arrival
            for child in children.get(s.id, ()):
                push(at + max(0.0, child.requests[0].arrival - start0), _ELIGIBLE, child)

    def start_next(at: float) -> None:
        nonlocal gpu_busy
        req, arrived = gpu_queue.popleft()
        lookup = policy.begin(req, at)
        hit = lookup.hit_tokens
        if not 0 <= hit <= req.input_tokens:
            raise ValueError(
                f"policy {policy.name!r}: hit_tokens={hit} outside [0, {req.input_tokens}] "
                f"for {req.session_id}#{req.index}"
            )
        load = cost.load_time(lookup.load_bytes)
        recompute = cost.prefill_time(hit, req.input_tokens)
        capture = capture_cost(req, lookup)
        service = cost.request_overhead_s + load + recompute + sum(capture)
        gpu_busy = True
        push(at + service, _DONE, (req, lookup, arrived, at, load, recompute, capture))

    def capture_cost(req: Request, lookup: Lookup) -> tuple[float, float]:
        cap = capture_of(policy, req, lookup)
        return cost.capture_time(cap, req.input_tokens - lookup.hit_tokens, snapshot_bytes)

    def finish(
        at: float, req: Request, lookup: Lookup, arrived: float, started: float,
        load: float, recompute: float, capture: tuple[float, float],
    ) -> None:
        """The request's prefill ended at ``at``: store, record, issue the next request."""
        nonlocal capped
        written = policy.complete(req, lookup, at)
        results.append(
            RequestResult(
                req.session_id, req.index, req.input_tokens, req.output_tokens,
                lookup.hit_tokens, arrived, started, started - arrived,
                cost.request_overhead_s, load, recompute, dict(lookup.load_bytes),
                dict(written), req.rewrite, sum(capture),
            )
        )
        if progress is not None:
            progress(len(results))
        state = live[req.session_id]
        state.next_index += 1
        done_at = at + cost.decode_time(req.output_tokens)
        reqs = state.session.requests
        if state.next_index < len(reqs):
            nxt = reqs[state.next_index]
            think = nxt.think_time
            if think > cap:
                think, capped = cap, capped + 1
            push(done_at + think, _ARRIVE, nxt)
        else:
            push(done_at, _SESSION_END, req.session_id)

    shared = _SharedGPU() if setup.gpu_scheduling == "shared" else None
    jobs = 0

    def schedule_shared() -> None:
        assert shared is not None
        nxt = shared.next_done()
        if nxt is not None:
            push(nxt[0], _SHARED_DONE, (shared.version, nxt[1]))

    while events:
        now, _, kind, obj = heapq.heappop(events)
        if kind == _ARRIVE and shared is not None:
            assert isinstance(obj, Request)
            # Processor sharing: the engine schedules the request at once; its loads
            # land, then its compute joins the prefills in flight.
            lookup = policy.begin(obj, now)
            if not 0 <= lookup.hit_tokens <= obj.input_tokens:
                raise ValueError(
                    f"policy {policy.name!r}: hit_tokens={lookup.hit_tokens} outside "
                    f"[0, {obj.input_tokens}] for {obj.session_id}#{obj.index}"
                )
            load = cost.load_time(lookup.load_bytes)
            recompute = cost.prefill_time(lookup.hit_tokens, obj.input_tokens)
            capture = capture_cost(obj, lookup)
            # Device → host copies go with the transfers; extra steps are GPU time.
            push(now + load + capture[1], _LOADED, (obj, lookup, now, load, recompute, capture))
        elif kind == _LOADED:
            req, lookup, arrived, load, recompute, capture = obj  # type: ignore[misc]
            assert shared is not None
            jobs += 1
            shared.add(now, jobs, cost.request_overhead_s + recompute + capture[0], obj)
            schedule_shared()
        elif kind == _SHARED_DONE:
            assert shared is not None
            version, job_id = obj  # type: ignore[misc]
            if version != shared.version:
                continue  # superseded by a later arrival or completion
            req, lookup, arrived, load, recompute, capture = shared.pop(  # type: ignore[misc]
                now, job_id
            )
            schedule_shared()
            service = cost.request_overhead_s + load + recompute + sum(capture)
            finish(
                now, req, lookup, arrived, max(arrived, now - service), load, recompute,
                capture,
            )
        elif kind == _ARRIVE:
            assert isinstance(obj, Request)
            gpu_queue.append((obj, now))
            if not gpu_busy:
                start_next(now)
        elif kind == _DONE:
            req, lookup, arrived, started, load, recompute, capture = obj  # type: ignore[misc]
            gpu_busy = False
            if gpu_queue:
                start_next(now)
            finish(now, req, lookup, arrived, started, load, recompute, capture)
        elif kind == _ELIGIBLE:
            assert isinstance(obj, Session)
            eligible_at[obj.id] = now
            waiting.append(obj)
            admit(now)
        else:  # _SESSION_END
            del live[obj]  # type: ignore[arg-type]
            active -= 1
            admit(now)
    return RunResult(
        policy=policy.name,
        trace=trace.name,
        results=results,
        stats=dict(policy.stats()),
        makespan=now,
        wall_s=time.perf_counter() - wall0,
        capped_gaps=capped,
        slot_wait=slot_wait,
        capacity_bytes=capacity_of(policy),
    )
