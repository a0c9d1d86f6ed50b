"""The fleet on tiny hand-built traces: routers, the shared tier, its budget, verdicts."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from test_server import CHUNK, COST  # the unit cost model of the server's tests

from lmcache_histate.sim.config import SimSetup
from lmcache_histate.sim.fleet import (
    HISTATE_LOCAL,
    HISTATE_SHARED,
    LMCACHE_SHARED,
    SGLANG_SHARED,
    VLLM_LOCAL,
    FleetSetup,
    LeastLoaded,
    RandomRouter,
    Router,
    SessionAffinity,
    fleet_rows,
    fleet_trace,
    load_fleet,
    simulate_fleet,
)
from lmcache_histate.sim.fleet_report import FleetCell, claim, session_halves
from lmcache_histate.sim.shared_tier import NetworkModel
from lmcache_histate.sim.trace_model import Request, Session, Trace

NET = NetworkModel(bytes_per_s=1e9, object_latency_s=0.01)


def setup(**kw: object) -> SimSetup:
    return SimSetup.paper(cost=COST, chunk_tokens=CHUNK, max_think_s=1e6, **kw)


def req(sid: str, i: int, tokens: int, *, at: float = 0.0, think: float = 0.0,
        base: int = 0) -> Request:
    return Request(sid, i, at, think, tokens, 4, tuple(range(base, base + tokens // CHUNK)))


def trace(*sessions: Session) -> Trace:
    return Trace("t", CHUNK, sessions)


class ByTurn(Router):
    """Turn ``i`` of every session on node ``i mod N``: a next turn always moves."""

    name = "by-turn"

    def route(self, request, queued):  # type: ignore[no-untyped-def]
        return request.index % self.nodes


def two_turns() -> Trace:
    # Turn 1 extends turn 0's 8 chunks by 4; it arrives 100 s after turn 0 is done.
    return trace(Session("a", None, (req("a", 0, 32), req("a", 1, 48, think=100.0))))


def run(row: str, t: Trace, router: Router, shared_bytes: int = 1 << 40, **kw: object):
    s = setup(**kw)
    fleet = FleetSetup(nodes=router.nodes, shared_bytes=shared_bytes, network=NET)
    return simulate_fleet(t, fleet_rows(s, fleet)[row](), router, s)


def by_key(fr):  # type: ignore[no-untyped-def]
    return {r.key: r for r in fr.run.results}


@pytest.mark.parametrize("local_row", [HISTATE_LOCAL, VLLM_LOCAL])
def test_next_turn_on_another_node_misses_without_a_shared_tier(local_row: str) -> None:
    local = by_key(run(local_row, two_turns(), ByTurn(2)))
    assert local[("a", 1)].hit_tokens == 0  # node 1 never saw the session


# Turn 0 (32 tokens, 8 chunks) leaves its final state after chunk 8 (HiState: the last
# hashed chunk; SGLang: the end) or after chunk (32 - 1) // 4 = 7 (vLLM's replay boundary,
# the LMCache row's engine). Node 1 resumes there, reading that many KV chunks and one
# state over the network: chunks + 1 objects.
@pytest.mark.parametrize(("row", "chunks"),
                         [(HISTATE_SHARED, 8), (SGLANG_SHARED, 8), (LMCACHE_SHARED, 7)])
def test_next_turn_on_another_node_hits_only_through_the_shared_tier(
    row: str, chunks: int
) -> None:
    s = setup()
    fr = run(row, two_turns(), ByTurn(2))
    assert fr.node_of == {("a", 0): 0, ("a", 1): 1}
    r = by_key(fr)[("a", 1)]
    assert r.hit_tokens == chunks * CHUNK
    nbytes = chunks * s.kv_chunk_bytes + s.snapshot_bytes
    assert r.load_bytes == {"shared": nbytes}
    assert r.load_s == pytest.approx(nbytes / 1e9 + (chunks + 1) * 0.01)
    assert fr.shared_hits == 1


def test_same_node_next_turn_hits_locally_without_the_network() -> None:
    fr = run(HISTATE_SHARED, two_turns(), SessionAffinity(2))
    r = by_key(fr)[("a", 1)]
    assert r.hit_tokens == 32
    assert "shared" not in r.load_bytes and fr.shared_hits == 0


def test_shared_lru_budget_holds_one_session_and_evicts_the_older() -> None:
    s = setup()
    budget = 8 * s.kv_chunk_bytes + s.snapshot_bytes  # one 8-chunk prompt and its state
    # a0 (node 0) fills the shared tier; b0 (node 1, other hashes) displaces it; a1 lands
    # on node 1, which never saw a: a miss everywhere.
    t = trace(
        Session("a", None, (req("a", 0, 32), req("a", 1, 48, think=1000.0))),
        Session("b", None, (req("b", 0, 32, at=100.0, base=1000),)),
    )

    class Plan(Router):
        def route(self, request, queued):  # type: ignore[no-untyped-def]
            return 0 if (request.session_id, request.index) == ("a", 0) else 1

    fr = run(LMCACHE_SHARED, t, Plan(2), shared_bytes=budget)
    res = by_key(fr)
    assert res[("a", 1)].hit_tokens == 0
    assert fr.shared_used_bytes <= budget
    # With room for both, a1 resumes from the shared tier.
    fr = run(LMCACHE_SHARED, t, Plan(2), shared_bytes=2 * budget)
    assert by_key(fr)[("a", 1)].hit_tokens > 0


def test_histate_shared_tier_stays_within_its_budget() -> None:
    s = setup()
    budget = 20 * s.kv_chunk_bytes + 2 * s.snapshot_bytes
    sessions = [Session(f"s{k}", None, (req(f"s{k}", 0, 32, at=10.0 * k, base=100 * k),
                                         req(f"s{k}", 1, 48, think=5.0, base=100 * k)))
                for k in range(6)]
    fr = run(HISTATE_SHARED, trace(*sessions), ByTurn(2), shared_bytes=budget)
    assert 0 < fr.shared_used_bytes <= budget


def test_histate_shares_final_states_and_kv_not_interval_snapshots() -> None:
    # Turn 0 (400 tokens = 100 chunks) on node 0, turn 1 (480 = 120 chunks) on node 1.
    # Each node keeps its own interval snapshots; the shared tier gets every KV chunk (120)
    # and each turn's final state only: after chunk 100 (depth 99: resumed by node 1, then
    # historical) and after chunk 120 (depth 119).
    s = setup()
    fleet = FleetSetup(nodes=2, shared_bytes=1 << 40, network=NET)
    t = trace(Session("a", None, (req("a", 0, 400), req("a", 1, 480, think=100.0))))
    row = fleet_rows(s, fleet)[HISTATE_SHARED]()
    fr = simulate_fleet(t, row, ByTurn(2), s)
    assert by_key(fr)[("a", 1)].hit_tokens == 400
    shared = row.shared.policy.cache.nodes()
    assert sum(1 for n in shared if n.kv_tiers) == 120
    assert sorted(n.depth for n in shared if n.snap_tiers) == [99, 119]
    node0 = row.nodes[0].local.cache.nodes()
    assert sum(1 for n in node0 if n.snap_tiers) > 2  # its own plan has interval snapshots


def test_least_loaded_picks_the_node_with_least_queued_work() -> None:
    assert LeastLoaded(3).route(req("x", 0, 4), lambda: [3.0, 1.0, 1.0]) == 1
    # s0 (40 tokens: 0.125 + 20 + 8 = 28.1 s of prefill) lands on node 0 (tie → lowest);
    # s1 at t = 1 on the idle node 1 (4.4 s); at t = 2 node 0 has ~26 s queued and node 1
    # ~3.4 s: s2 goes to node 1.
    t = trace(*(Session(f"s{k}", None, (req(f"s{k}", 0, n, at=float(k), base=100 * k),))
                for k, n in enumerate((40, 8, 8))))
    fr = run(HISTATE_LOCAL, t, LeastLoaded(2))
    assert fr.node_of == {("s0", 0): 0, ("s1", 0): 1, ("s2", 0): 1}


def test_session_affinity_and_random_are_stable_hashes() -> None:
    def h(text: str) -> int:
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")

    t = trace(*(Session(f"s{k}", None, tuple(req(f"s{k}", i, 8 + 4 * i, base=100 * k)
                                             for i in range(3))) for k in range(4)))
    fr = run(HISTATE_LOCAL, t, SessionAffinity(3))
    assert fr.node_of == {(f"s{k}", i): h(f"s{k}") % 3 for k in range(4) for i in range(3)}
    fr = run(HISTATE_LOCAL, t, RandomRouter(3, seed=7))
    assert fr.node_of == {(f"s{k}", i): h(f"7:s{k}:{i}") % 3 for k in range(4) for i in range(3)}


def test_fleet_trace_copies_are_independent_and_interleaved() -> None:
    t = trace(Session("a", None, (req("a", 0, 8, at=0.0),)),
              Session("b", "a", (req("b", 0, 12, at=20.0, base=5),)))
    f = fleet_trace(t, 2, session_gap_s=10.0)
    got = {s.id: (s.parent, s.requests[0].arrival, s.requests[0].chunk_hashes) for s in f.sessions}
    # Hashes 0..7 in use: copy 1 moves them up by 8; copy 1 starts 10 / 2 = 5 s later.
    assert got == {
        "a@0": (None, 0.0, (0, 1)), "b@0": ("a@0", 20.0, (5, 6, 7)),
        "a@1": (None, 5.0, (8, 9)), "b@1": ("a@1", 25.0, (13, 14, 15)),
    }


def test_halves_split_by_crc32_parity_with_subagents_and_copies() -> None:
    # zlib.crc32 of the ids, worked out by hand: trace_0002 1,170,861,099 (odd, B),
    # trace_0004 2,896,840,990 (even, A), trace_0006 1,118,054,450 (even, A).
    t = fleet_trace(trace(
        Session("trace_0002", None, (req("trace_0002", 0, 8),)),
        Session("trace_0004", None, (req("trace_0004", 0, 8),)),
        Session("trace_0006", None, (req("trace_0006", 0, 8),)),
        Session("sub", "trace_0002", (req("sub", 0, 8),)),
    ), 2, 10.0)
    halves = session_halves(t)
    assert {k for k, v in halves.items() if v == "A"} == {
        "trace_0004@0", "trace_0004@1", "trace_0006@0", "trace_0006@1"}
    assert {k for k, v in halves.items() if v == "B"} == {
        "trace_0002@0", "trace_0002@1", "sub@0", "sub@1"}


def cell(row: str, values: dict[str, list[float]]) -> FleetCell:
    c = FleetCell("least-loaded", row, 1.0, 0.0, 1)
    c.values = {(part, "ttft_p99"): v for part, v in values.items()}
    return c


def test_a_claim_needs_the_spread_and_both_halves() -> None:
    base = cell(HISTATE_SHARED, {"all": [1, 2], "A": [1, 2], "B": [1, 2]})
    ahead = cell("x", {"all": [3, 4], "A": [3, 4], "B": [2.5, 3]})
    assert claim(ahead, base, "ttft_p99") == "+"
    one_half = cell("x", {"all": [3, 4], "A": [3, 4], "B": [1.5, 3]})  # B overlaps
    assert claim(one_half, base, "ttft_p99") == "tie"
    behind = cell("x", {"all": [0.1, 0.5], "A": [0.1, 0.5], "B": [0.2, 0.9]})
    assert claim(behind, base, "ttft_p99") == "−"
    single = cell(HISTATE_SHARED, {"all": [1], "A": [1], "B": [1]})
    assert claim(cell("x", {"all": [9], "A": [9], "B": [9]}), single, "ttft_p99") == "tie"


def test_fleet_config_errors_name_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "f.yaml"
    bad.write_text("node_config: x.yaml\nnodez: 4\n")
    with pytest.raises(ValueError, match=r"unknown key.*nodez"):
        load_fleet(bad)
    repo = Path(__file__).resolve().parents[2] / "configs"
    bad.write_text(f"node_config: {repo}/sim-paper-load.yaml\n"
                   "shared: {object_latency_ms: -1}\n")
    with pytest.raises(ValueError, match=r"shared\.object_latency_ms"):
        load_fleet(bad)
    setup_, fleet = load_fleet(repo / "sim-fleet.yaml")
    assert (fleet.nodes, fleet.copies, fleet.shared_bytes) == (4, 4, 192 << 30)
    assert fleet.network.bytes_per_s == pytest.approx(12.5e9)
    assert setup_.max_sessions == 24
