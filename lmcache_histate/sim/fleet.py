"""A fleet of N serving nodes behind a router, with or without a tier they share.

The single-node model (``sim.server``) replays a trace on one GPU; a fleet replays it on
N, each node with its own engine, its own tiers and its own prefill queue, and a router
that picks a node for EVERY request (an agent's next turn may land elsewhere):

* **Nodes.** Node ``i`` is the single-node server model (``server`` module docstring:
  processor-shared prefill compute, loads before compute, closed-loop sessions) with its
  own ``Policy`` (``FleetRow.nodes[i]``). The fleet admits at most ``N ·
  setup.max_sessions`` sessions at once (each node's share of the single-node limit),
  FIFO as on one node.
* **Routers** (``ROUTERS``), each deterministic:

  - ``session-affinity``: every request of a session goes to ``h(session id) mod N``
    (``h`` = the first 8 bytes of BLAKE2b, big-endian): consistent hashing by a session
    header, as vLLM production-stack's session router does (a subagent has its own
    session id, hence its own node);
  - ``least-loaded``: the node with the least queued work when the request arrives: the
    remaining prefill compute (seconds) of its requests in flight, those still loading
    included; ties go to the lowest node index;
  - ``random``: node ``h(f"{seed}:{session}:{index}") mod N``: uniform, and the same
    draw for every row of a repeat (rows differ by their caches, not by their luck).

* **Rows** (``fleet_rows``): every node runs the single-node row's engine with the
  single-node memory (``configs/sim-paper-load.yaml``'s per node); the shared rows add
  ONE shared tier of ``FleetSetup.shared_bytes`` for the whole fleet, through
  ``shared_tier.SharedTierNode`` (its reads priced by ``shared_tier.NetworkModel``):

  =========================  =========================================================
  ``histate``                HiState on each node, local tiers only
  ``histate+shared``         the same + a shared tier run by HiState's core
                             (``shared_tier.HiStateShared``: the same knobs)
  ``vllm-cpu-disk-offload``  vLLM align mode + CPU and disk offload, local only
  ``sglang-hicache+l3``      SGLang HiCache (GPU + host per node) + a shared L3: every
                             node backs up what reaches its host pool to the L3
                             (write-through) and prefetches from it on a miss. For the
                             hybrid model the backup carries the node's Mamba host state
                             keyed by its last page hash, and a prefetch loads the KV
                             pages and one state (the hybrid HiRadix cache's
                             ``write_backup_storage`` → ``mamba_archive_transfers``,
                             ``prefetch_from_storage`` → ``mamba_prefetch_alloc``;
                             read through the code search in an annotated copy of
                             SGLang's source, its upstream path not confirmed here).
                             Mooncake Store evicts, at a high watermark (95 %), a share
                             of its objects (5 %) by approximate LRU (Mooncake Store
                             docs, "Eviction Policy"; ``DEFAULT_EVICTION_RATIO`` 0.05,
                             ``DEFAULT_EVICTION_HIGH_WATERMARK_RATIO`` 0.95): one LRU
                             pool here (``shared_tier.LRUShared``), the watermark's
                             unused 5 % not charged (in its favour), and the prefetch
                             assumed complete (``wait_complete``, in its favour). No
                             local disk: HiCache's third level IS the L3.
  ``lmcache-lru+l2``         stock LMCache: vLLM align mode with LMCache's CPU + disk
                             (the ``vllm-cpu-disk-offload`` engine) + a shared remote
                             L2 (LRU; the default store policy writes every key to every
                             adapter)
  ``unlimited``              the reference: ONE never-evicting cache every node reads
                             for free (a state at every chunk); used for the
                             reuse-sensitive set, not a competitor
  =========================  =========================================================

Events live in one ``heapq`` keyed by (time, sequence number), as in ``server``: a
replay is deterministic.
"""

from __future__ import annotations

import hashlib
import heapq
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from .baselines.unlimited import UnlimitedPolicy
from .capture import capture_of
from .config import SimSetup, load_setup, parse_bytes
from .policy import HiStatePolicy, Lookup, Policy
from .runner import policy_factories
from .server import RequestResult, RunResult, _eligible_order, _SharedGPU
from .shared_tier import (
    DEFAULT_NETWORK_BYTES_PER_S,
    DEFAULT_OBJECT_LATENCY_S,
    SHARED,
    HiStateShared,
    LRUShared,
    NetworkModel,
    SharedStore,
    SharedTierNode,
)
from .trace_model import Request, Session, Trace

__all__ = [
    "HISTATE_LOCAL",
    "HISTATE_SHARED",
    "LMCACHE_SHARED",
    "LOCAL_ROWS",
    "REFERENCE",
    "ROUTERS",
    "ROWS",
    "SGLANG_SHARED",
    "VLLM_LOCAL",
    "FleetRow",
    "FleetRun",
    "FleetSetup",
    "LeastLoaded",
    "RandomRouter",
    "Router",
    "SessionAffinity",
    "fleet_rows",
    "fleet_trace",
    "load_fleet",
    "make_router",
    "simulate_fleet",
    "stable_hash",
]

ROUTERS = ("session-affinity", "least-loaded", "random")
HISTATE_LOCAL = "histate"
HISTATE_SHARED = "histate+shared"
VLLM_LOCAL = "vllm-cpu-disk-offload"
SGLANG_SHARED = "sglang-hicache+l3"
LMCACHE_SHARED = "lmcache-lru+l2"
REFERENCE = "unlimited"
ROWS = (HISTATE_LOCAL, HISTATE_SHARED, VLLM_LOCAL, SGLANG_SHARED, LMCACHE_SHARED, REFERENCE)
LOCAL_ROWS = (HISTATE_LOCAL, VLLM_LOCAL)
# A Valkey Cluster of 3 masters with 64 GiB each (the issue's ≥ 3 masters).
DEFAULT_SHARED_BYTES = 3 * 64 << 30

_ELIGIBLE, _ARRIVE, _LOADED, _DONE, _SESSION_END = range(5)


def stable_hash(text: str) -> int:
    """First 8 bytes of BLAKE2b of ``text``, big-endian: the same on every run."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


# ------------------------------------------------------------------ routers
class Router:
    """Picks a node for a request; ``queued()`` gives each node's queued work (s)."""

    name = ""

    def __init__(self, nodes: int) -> None:
        if nodes < 1:
            raise ValueError(f"a fleet needs ≥ 1 node, got {nodes}")
        self.nodes = nodes

    def route(self, request: Request, queued: Callable[[], Sequence[float]]) -> int:
        raise NotImplementedError


class SessionAffinity(Router):
    name = "session-affinity"

    def route(self, request: Request, queued: Callable[[], Sequence[float]]) -> int:
        return stable_hash(request.session_id) % self.nodes


class LeastLoaded(Router):
    name = "least-loaded"

    def route(self, request: Request, queued: Callable[[], Sequence[float]]) -> int:
        work = queued()
        return min(range(self.nodes), key=lambda i: (work[i], i))


class RandomRouter(Router):
    name = "random"

    def __init__(self, nodes: int, seed: int = 0) -> None:
        super().__init__(nodes)
        self.seed = seed

    def route(self, request: Request, queued: Callable[[], Sequence[float]]) -> int:
        return stable_hash(f"{self.seed}:{request.session_id}:{request.index}") % self.nodes


def make_router(name: str, nodes: int, seed: int = 0) -> Router:
    if name == "session-affinity":
        return SessionAffinity(nodes)
    if name == "least-loaded":
        return LeastLoaded(nodes)
    if name == "random":
        return RandomRouter(nodes, seed)
    raise ValueError(f"unknown router {name!r}; routers are {', '.join(ROUTERS)}")


# ------------------------------------------------------------------ set-up
@dataclass(frozen=True, slots=True)
class FleetSetup:
    """The fleet around one node's ``SimSetup``: ``nodes`` nodes, the trace replayed as
    ``copies`` independent copies (``fleet_trace``), one shared tier of
    ``shared_bytes`` priced by ``network``."""

    nodes: int = 4
    copies: int = 4
    shared_bytes: int = DEFAULT_SHARED_BYTES
    network: NetworkModel = field(default_factory=NetworkModel)
    routers: tuple[str, ...] = ROUTERS

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"fleet.nodes must be ≥ 1, got {self.nodes}")
        if self.copies < 1:
            raise ValueError(f"fleet.copies must be ≥ 1, got {self.copies}")
        if self.shared_bytes < 0:
            raise ValueError(f"fleet.shared.budget must be ≥ 0, got {self.shared_bytes}")
        for r in self.routers:
            if r not in ROUTERS:
                raise ValueError(f"fleet.routers: unknown router {r!r}; known: "
                                 f"{', '.join(ROUTERS)}")


_FLEET_KEYS = {"node_config", "nodes", "copies", "routers", "shared"}
_SHARED_KEYS = {"budget", "network_gbit_s", "object_latency_ms"}


def load_fleet(path: str | Path) -> tuple[SimSetup, FleetSetup]:
    """``configs/sim-fleet.yaml``: the per-node config (``node_config``, relative to the
    file) and the fleet's keys; unknown keys and bad values name the key."""
    path = Path(path)
    doc = yaml.safe_load(path.read_text()) or {}
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a fleet config is a mapping")
    unknown = set(doc) - _FLEET_KEYS
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}; "
                         f"allowed: {', '.join(sorted(_FLEET_KEYS))}")
    if "node_config" not in doc:
        raise ValueError(f"{path}: node_config (the per-node simulator config) is required")
    setup = load_setup(path.parent / str(doc["node_config"]))
    shared = doc.get("shared") or {}
    if not isinstance(shared, dict) or set(shared) - _SHARED_KEYS:
        raise ValueError(f"{path}: shared takes {', '.join(sorted(_SHARED_KEYS))}")
    try:
        gbit = float(shared.get("network_gbit_s", DEFAULT_NETWORK_BYTES_PER_S * 8 / 1e9))
        latency_ms = float(shared.get("object_latency_ms", DEFAULT_OBJECT_LATENCY_S * 1e3))
        budget = (parse_bytes(shared["budget"], "shared.budget") if "budget" in shared
                  else DEFAULT_SHARED_BYTES)
        nodes, copies = int(doc.get("nodes", 4)), int(doc.get("copies", 4))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: fleet value: {e}") from None
    if gbit <= 0:
        raise ValueError(f"{path}: shared.network_gbit_s must be > 0, got {gbit}")
    if latency_ms < 0:
        raise ValueError(f"{path}: shared.object_latency_ms must be ≥ 0, got {latency_ms}")
    routers = doc.get("routers", list(ROUTERS))
    if not isinstance(routers, list):
        raise ValueError(f"{path}: routers is a list of {', '.join(ROUTERS)}")
    fleet = FleetSetup(
        nodes, copies, budget, NetworkModel(gbit * 1e9 / 8, latency_ms / 1e3),
        tuple(str(r) for r in routers),
    )
    return setup, fleet


def fleet_trace(trace: Trace, copies: int, session_gap_s: float) -> Trace:
    """``copies`` independent copies of ``trace``: copy ``k``'s sessions are
    ``{id}@{k}`` with their chunk hashes moved to a range of their own (no copy shares
    a prefix with another: different users, the same shape of work), and start
    ``k · session_gap_s / copies`` later, so the copies interleave and the fleet sees
    ``copies`` times the session arrival rate. Copy 0 is ``trace`` itself."""
    if copies < 1:
        raise ValueError(f"copies must be ≥ 1, got {copies}")
    if copies == 1:
        return trace
    span = 1 + max((h for s in trace.sessions for r in s.requests for h in r.chunk_hashes),
                   default=0)
    sessions: list[Session] = []
    for k in range(copies):
        shift = k * session_gap_s / copies
        for s in trace.sessions:
            sid = f"{s.id}@{k}"
            reqs = tuple(
                replace(r, session_id=sid, arrival=r.arrival + shift,
                        chunk_hashes=tuple(h + k * span for h in r.chunk_hashes))
                for r in s.requests
            )
            parent = f"{s.parent}@{k}" if s.parent is not None else None
            sessions.append(Session(sid, parent, reqs))
    return Trace(f"{trace.name}×{copies}", trace.chunk_tokens, tuple(sessions))


# ------------------------------------------------------------------ rows
@dataclass(slots=True)
class FleetRow:
    """One row of the fleet table: a policy per node and the shared tier (if any)."""

    name: str
    nodes: list[Policy]
    shared: SharedStore | None = None

    @property
    def capacity_bytes(self) -> float:
        """Every node's own tiers plus the shared tier once (∞ for the reference)."""
        seen: dict[int, float] = {}
        for p in self.nodes:
            own = getattr(p, "capacity_bytes", None)
            seen[id(p)] = float(own()) if own is not None else 0.0
        return sum(seen.values()) + (self.shared.capacity if self.shared else 0)


def fleet_rows(setup: SimSetup, fleet: FleetSetup) -> dict[str, Callable[[], FleetRow]]:
    """Row name → factory of a fresh ``FleetRow`` (module docstring), in ``ROWS`` order."""
    single = policy_factories(setup)
    n, net, budget = fleet.nodes, fleet.network, fleet.shared_bytes
    geo = {"chunk_tokens": setup.chunk_tokens, "kv_bytes_per_token": setup.kv_bytes_per_token,
           "snapshot_bytes": setup.snapshot_bytes}

    def local(name: str, engine: str) -> FleetRow:
        return FleetRow(name, [SharedTierNode(name, single[engine]()) for _ in range(n)])

    def histate_shared() -> FleetRow:
        nodes = [single[HISTATE_LOCAL]() for _ in range(n)]
        assert isinstance(nodes[0], HiStatePolicy)
        shared = HiStateShared.like(nodes[0], budget)
        return FleetRow(HISTATE_SHARED,
                        [SharedTierNode(HISTATE_SHARED, p, shared, net) for p in nodes], shared)

    def lru_shared(name: str, engine: str, store: str) -> FleetRow:
        shared = LRUShared(store, budget, **geo)
        return FleetRow(name, [SharedTierNode(name, single[engine](), shared, net)
                               for _ in range(n)], shared)

    def reference() -> FleetRow:
        one = UnlimitedPolicy(**geo)
        return FleetRow(REFERENCE, [one] * n)

    return {
        HISTATE_LOCAL: lambda: local(HISTATE_LOCAL, HISTATE_LOCAL),
        HISTATE_SHARED: histate_shared,
        VLLM_LOCAL: lambda: local(VLLM_LOCAL, VLLM_LOCAL),
        SGLANG_SHARED: lambda: lru_shared(SGLANG_SHARED, "sglang-hicache", "l3"),
        LMCACHE_SHARED: lambda: lru_shared(LMCACHE_SHARED, VLLM_LOCAL, "l2"),
        REFERENCE: reference,
    }


# ------------------------------------------------------------------ replay
@dataclass(slots=True)
class FleetRun:
    """A row's replay on the fleet: the run (as on one node), each request's node, and
    the shared tier's counters."""

    run: RunResult
    node_of: dict[tuple[str, int], int]
    router: str
    shared_hit_keys: set[tuple[str, int]] = field(default_factory=set)
    shared_read_bytes: int = 0
    shared_used_bytes: int = 0

    @property
    def shared_hits(self) -> int:
        """Requests that resumed from the shared tier."""
        return len(self.shared_hit_keys)

    @property
    def per_node(self) -> list[int]:
        counts = Counter(self.node_of.values())
        return [counts[i] for i in range(max(counts, default=-1) + 1)]


class _Events:
    """The replay's event heap: (time, sequence number, kind, payload); ties resolve in
    insertion order."""

    __slots__ = ("heap", "seq")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0

    def push(self, at: float, kind: int, obj: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (at, self.seq, kind, obj))

    def pop(self) -> tuple[float, int, Any]:
        at, _, kind, obj = heapq.heappop(self.heap)
        return at, kind, obj


def simulate_fleet(
    trace: Trace,
    row: FleetRow,
    router: Router,
    setup: SimSetup,
    progress: Callable[[int], None] | None = None,
) -> FleetRun:
    """Replay ``trace`` on ``row``'s nodes behind ``router`` (module docstring)."""
    if trace.chunk_tokens != setup.chunk_tokens:
        raise ValueError(f"trace {trace.name!r} is chunked at {trace.chunk_tokens} tokens but "
                         f"the set-up uses {setup.chunk_tokens}")
    if setup.gpu_scheduling != "shared":
        raise ValueError("the fleet models gpu_scheduling: shared only")
    if router.nodes != len(row.nodes):
        raise ValueError(f"router for {router.nodes} nodes, row {row.name!r} has "
                         f"{len(row.nodes)}")
    cost, snapshot_bytes, cap = setup.cost, setup.snapshot_bytes, setup.max_think_s
    n = len(row.nodes)
    wall0 = time.perf_counter()
    events = _Events()
    push = events.push
    roots, children = _eligible_order(trace)
    for at, s in roots:
        push(at, _ELIGIBLE, s)
    gpus = [_SharedGPU() for _ in range(n)]
    loading = [0.0] * n  # compute of requests whose loads are still in flight
    eligible_at: dict[str, float] = {}
    waiting: deque[Session] = deque()
    slot_wait: dict[str, float] = {}
    live: dict[str, list[Any]] = {}  # session id -> [session, next index]
    results: list[RequestResult] = []
    node_of: dict[tuple[str, int], int] = {}
    shared_keys: set[tuple[str, int]] = set()
    slots, active, capped, jobs, now = n * setup.max_sessions, 0, 0, 0, 0.0

    def queued() -> list[float]:
        out = []
        for i, g in enumerate(gpus):
            g.advance(now)
            out.append(loading[i] + sum(max(0.0, j[0]) for j in g.jobs.values()))
        return out

    def admit(at: float) -> None:
        nonlocal active
        while active < slots and waiting:
            s = waiting.popleft()
            active += 1
            slot_wait[s.id] = at - eligible_at[s.id]
            live[s.id] = [s, 0]
            push(at, _ARRIVE, s.requests[0])
            start0 = s.requests[0].arrival
            for child in children.get(s.id, ()):
                push(at + max(0.0, child.requests[0].arrival - start0), _ELIGIBLE, child)

    def schedule(i: int) -> None:
        nxt = gpus[i].next_done()
        if nxt is not None:
            push(nxt[0], _DONE, (i, gpus[i].version, nxt[1]))

    def arrive(req: Request) -> None:
        i = router.route(req, queued)
        policy = row.nodes[i]
        lookup: Lookup = policy.begin(req, now)
        if not 0 <= lookup.hit_tokens <= req.input_tokens:
            raise ValueError(f"policy {policy.name!r}: hit_tokens={lookup.hit_tokens} outside "
                             f"[0, {req.input_tokens}] for {req.session_id}#{req.index}")
        if isinstance(policy, SharedTierNode):
            load = cost.load_time(policy.local_loads(lookup)) + policy.load_time(lookup)
        else:
            load = cost.load_time(lookup.load_bytes)
        recompute = cost.prefill_time(lookup.hit_tokens, req.input_tokens)
        capture = cost.capture_time(capture_of(policy, req, lookup),
                                    req.input_tokens - lookup.hit_tokens, snapshot_bytes)
        work = cost.request_overhead_s + recompute + capture[0]
        loading[i] += work
        payload = (i, req, lookup, now, load, recompute, capture, work)
        push(now + load + capture[1], _LOADED, payload)

    def finish(i: int, payload: tuple[Any, ...]) -> None:
        nonlocal capped, active
        req, lookup, arrived, load, recompute, capture = payload
        written = row.nodes[i].complete(req, lookup, now)
        service = cost.request_overhead_s + load + recompute + sum(capture)
        started = max(arrived, now - service)
        results.append(RequestResult(
            req.session_id, req.index, req.input_tokens, req.output_tokens, lookup.hit_tokens,
            arrived, started, started - arrived, cost.request_overhead_s, load, recompute,
            dict(lookup.load_bytes), dict(written), req.rewrite, sum(capture),
        ))
        node_of[(req.session_id, req.index)] = i
        if SHARED in lookup.load_bytes:
            shared_keys.add((req.session_id, req.index))
        if progress is not None:
            progress(len(results))
        state = live[req.session_id]
        state[1] += 1
        done_at = now + cost.decode_time(req.output_tokens)
        reqs = state[0].requests
        if state[1] < len(reqs):
            think = reqs[state[1]].think_time
            if think > cap:
                think, capped = cap, capped + 1
            push(done_at + think, _ARRIVE, reqs[state[1]])
        else:
            push(done_at, _SESSION_END, req.session_id)

    while events.heap:
        now, kind, obj = events.pop()
        if kind == _ARRIVE:
            arrive(obj)
        elif kind == _LOADED:
            i, req, lookup, arrived, load, recompute, capture, work = obj
            loading[i] -= work
            jobs += 1
            gpus[i].add(now, jobs, work, (req, lookup, arrived, load, recompute, capture))
            schedule(i)
        elif kind == _DONE:
            i, version, job_id = obj
            if version != gpus[i].version:
                continue  # superseded by a later arrival or completion on that node
            payload = gpus[i].pop(now, job_id)
            schedule(i)
            finish(i, payload)  # type: ignore[arg-type]
        elif kind == _ELIGIBLE:
            eligible_at[obj.id] = now
            waiting.append(obj)
            admit(now)
        else:  # _SESSION_END
            del live[obj]
            active -= 1
            admit(now)
    stats: Counter[str] = Counter()
    for p in {id(p): p for p in row.nodes}.values():
        stats.update(p.stats())
    run = RunResult(
        policy=row.name, trace=trace.name, results=results, stats=dict(stats), makespan=now,
        wall_s=time.perf_counter() - wall0, capped_gaps=capped, slot_wait=slot_wait,
        capacity_bytes=row.capacity_bytes,
    )
    nodes = [p for p in row.nodes if isinstance(p, SharedTierNode)]
    return FleetRun(
        run, node_of, router.name, shared_keys,
        shared_read_bytes=sum(p.shared_read_bytes for p in nodes),
        shared_used_bytes=row.shared.used_bytes() if row.shared else 0,
    )
