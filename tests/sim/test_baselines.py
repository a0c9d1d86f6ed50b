"""Baseline rows: hand-derived hit sequences, pool splits, LRU cascade properties.

Conventions of the hand-built traces: chunk = 100 tokens, KV = 1 byte per token (a chunk
is 100 B), a state is 50 B. ``chunks(p, n)`` is the chain of the first ``n`` chunks of
prefix family ``p``; ``fork(base, at, q)`` shares ``base``'s first ``at`` chunks then
continues with family ``q``. Requests are driven one at a time (begin, then complete),
as the server model does.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_histate.sim.baselines import BASELINES, baseline_policies
from lmcache_histate.sim.baselines.end_state import EndStatePolicy
from lmcache_histate.sim.baselines.marconi import FlopModel
from lmcache_histate.sim.baselines.marconi_policy import MarconiPolicy
from lmcache_histate.sim.baselines.sglang import sglang_hicache_policy
from lmcache_histate.sim.baselines.tiered_lru import KV, STATE, TieredLRU
from lmcache_histate.sim.baselines.unlimited import UnlimitedPolicy
from lmcache_histate.sim.baselines.vllm import vllm_align_policy
from lmcache_histate.sim.capture import Capture
from lmcache_histate.sim.policy import HiStatePolicy, Policy
from lmcache_histate.sim.trace_model import Request
from lmcache_histate.sim.traces import load_trace

C = 100  # chunk tokens
KVT = 1  # KV bytes per token
SNAP = 50  # state bytes
GEO = {"chunk_tokens": C, "kv_bytes_per_token": KVT, "snapshot_bytes": SNAP}
BIG = 10**9


def chunks(p: int, n: int) -> list[int]:
    return [p * 1000 + i for i in range(n)]


def fork(base: list[int], at: int, q: int, n: int) -> list[int]:
    return base[:at] + [q * 1000 + i for i in range(at, n)]


def variant(fam: int, var: int, n: int) -> list[int]:
    """Chained keys: variant ``var`` of family ``fam`` leaves variant 0 at chunk 3·var."""
    return [fam * 10**6 + (var if i >= 3 * var else 0) * 1000 + i for i in range(n)]


def req(keys: list[int], tokens: int, sid: str = "s") -> Request:
    return Request(sid, 0, 0.0, 0.0, tokens, 1, tuple(keys))


def drive(policy: Policy, steps: list[tuple[list[int], int]], t0: float = 1.0) -> list[int]:
    """Serve ``(keys, input tokens)`` requests one at a time; returns their hit tokens."""
    hits = []
    for i, (keys, tokens) in enumerate(steps):
        r = req(keys, tokens)
        lookup = policy.begin(r, t0 + i)
        hits.append(lookup.hit_tokens)
        policy.complete(r, lookup, t0 + i + 0.5)
        check = getattr(policy, "engine", None) or getattr(policy, "cache", None)
        if check is not None:
            check.check()
    return hits


# ------------------------------------------------------------------ unlimited
def test_unlimited_hits_every_seen_chunk() -> None:
    a = chunks(1, 9)
    steps = [
        (a[:5], 530),  # nothing seen: 0
        (a[:9], 930),  # a0..a4 seen: 500 (no need for a state there: one at every chunk end)
        (fork(a, 7, 2, 9), 900),  # rewrite after chunk 7: a0..a6 seen: 700
        (fork(a, 3, 3, 6), 600),  # rewrite after chunk 3: 300
        (a[:9], 900),  # everything seen: all 9 full chunks
    ]
    p = UnlimitedPolicy(**GEO)
    assert drive(p, steps) == [0, 500, 700, 300, 900]
    lookup = p.begin(req(a[:9], 950), 99.0)
    assert lookup.load_bytes == {"gpu": 9 * C * KVT + SNAP}


# ------------------------------------------------------------------ Marconi
def test_marconi_hits_by_hand() -> None:
    """Sequence ends + branch points (speculative insertion), no eviction.

    S = s0 s1 s2 is a system prompt shared by sessions A, B, C (chunk = 100 tokens).
    States are written as @k = after k chunks.

    A1  S a3 a4, 530 tok (5 full chunks). Empty tree: hit 0. Path is new from the root:
        no branch. Sequence end @5.                                      -> states @5
    A2  S a3..a6, 720 tok (7). KV match 5, state @5: hit 500. The match ends at A1's
        leaf (extension, not a split): no branch. End @7.                -> @5 @7
    A3  S a3..a8, 900 tok (9). KV match 7, deepest state @7: hit 700. End @9.
    B1  S b3 b4, 500 tok (5). KV match 3 (S); no state within: hit 0. The match ends
        inside A's edge (s2 has a child a3 and no state): branch point @3 checkpointed,
        plus the end @5 of B. (2 states: the most Marconi saves per request.)
    B2  S b3 b4 b5, 640 tok (6). KV match 5, state @5 (B's end): hit 500. End @6.
    C1  S c3, 420 tok (4). KV match 3, state @3 (B1's branch point): hit 300. s2 is a
        branch point that already has its state: nothing new there. End @4.
    A4  S a3 a4 a5 x6 x7, 800 tok (8): a rewrite of A after chunk 6. KV match 6; states
        on it @3 and @5 (A1's end); a5 (@6) has none (A2 ended @7): hit 500. The match
        ends inside A's edge (a5 has child a6, no state): branch point @6. End @8.
    A5  S a3 a4 a5 y6, 700 tok (7): another rewrite after chunk 6. KV match 6, state @6
        (A4's branch point): hit 600.
    """
    s = chunks(1, 3)
    a = s + [2000 + i for i in range(3, 9)]
    b = s + [3000 + i for i in range(3, 6)]
    c = [*s, 4003]
    x = [*a[:6], 5006, 5007]
    y = [*a[:6], 6006]
    steps = [
        (a[:5], 530),
        (a[:7], 720),
        (a[:9], 900),
        (b[:5], 500),
        (b[:6], 640),
        (c, 420),
        (x, 800),
        (y, 700),
    ]
    p = MarconiPolicy(**GEO, gpu_bytes=BIG, tune=False)
    assert drive(p, steps) == [0, 500, 700, 0, 500, 300, 500, 600]
    assert p.cache.evictions == 0
    # States exist exactly at sequence ends and branch points.
    with_state = sorted((n.depth + 1, n.key) for n in p.cache.index.nodes.values() if n.snap_tiers)
    assert with_state == sorted(
        [
            (5, a[4]),
            (7, a[6]),
            (9, a[8]),
            (3, s[2]),
            (5, b[4]),
            (6, b[5]),
            (4, c[3]),
            (6, a[5]),
            (8, x[7]),
            (7, y[6]),
        ]
    )


def test_marconi_written_bytes_at_most_two_states() -> None:
    s = chunks(1, 3)
    p = MarconiPolicy(**GEO, gpu_bytes=BIG, tune=False)
    r1 = req([*s, 2003, 2004], 500)
    p.complete(r1, p.begin(r1, 1.0), 1.5)
    r2 = req([*s, 3003, 3004], 500)  # branch @3 + end @5 + 2 new chunks
    assert p.complete(r2, p.begin(r2, 2.0), 2.5) == {"gpu": 2 * C * KVT + 2 * SNAP}
    lookup = p.begin(req([*s, 3003, 3004], 500), 3.0)
    assert lookup.load_bytes == {"gpu": 5 * C * KVT + SNAP}


@pytest.mark.parametrize(("alpha", "victim"), [(0.0, "X"), (0.5, "X"), (4.0, "Y")])
def test_marconi_flop_aware_victim(alpha: float, victim: str) -> None:
    """Recency + α·FLOP efficiency, min-max normalised over the candidates.

    FLOPs linear in tokens (pair = 0). X: 10 chunks + state stored at t=1.5, efficiency
    1000/(1000+50) ≈ 0.95; Y: 1 chunk + state stored at t=2.5, 100/(100+50) ≈ 0.67. Z
    (1 chunk + state = 150 B) does not fit in 1200 B; it evicts at t=3.5: recency
    1/(3.5−1.5) = 0.5 for X, 1/(3.5−2.5) = 1 for Y. Normalised: X (recency 0,
    efficiency 1), Y (1, 0). Scores X = α, Y = 1: α < 1 evicts the older X, α > 1 the
    less efficient Y.
    """
    p = MarconiPolicy(
        **GEO, gpu_bytes=1200, flops=FlopModel(linear=1.0, pair=0.0), alpha=alpha, tune=False
    )
    x, y, z = chunks(1, 10), chunks(2, 1), chunks(3, 1)
    drive(p, [(x, 1000), (y, 100), (z, 100)])
    assert p.cache.evictions == 1
    gone = "X" if x[9] not in p.cache.index else "Y"
    assert gone == victim
    assert (y[0] in p.cache.index) == (victim == "X")


def test_marconi_single_child_state_is_a_candidate() -> None:
    """A state with one child below it is evicted alone: its KV stays for the child.

    A1 saves @2 (t=1), A2 extends to @4 (starts t=2: hits @2, refreshing it to t=2;
    completes t=2.5, saving @4). The 600 B pool holds 400 KV + 100 state. B (t=3): its
    KV chunk fits (600 B used), its state needs 50 B more. Candidates: @2 (single
    child, t=2) and @4 (leaf, t=2.5; B's own leaf is locked). Pure recency (α = 0)
    evicts @2's state only (50 B).
    """
    p = MarconiPolicy(**GEO, gpu_bytes=600, alpha=0.0, tune=False)
    a = chunks(1, 4)
    drive(p, [(a[:2], 200), (a, 400), (chunks(2, 1), 100)])
    node2 = p.cache.index.get(a[1])
    assert node2 is not None and node2.has_kv and not node2.has_snapshot
    assert p.cache.index.get(a[3]).has_snapshot  # type: ignore[union-attr]
    assert p.begin(req(a, 400), 9.0).hit_tokens == 400


def test_marconi_score_order_on_a_four_node_tree() -> None:
    """Marconi's eviction order, by hand (FLOPs = tokens: linear 1, pair 0).

    Requests (begin at t, complete at t + 0.5): A = s0 s1 a2 a3 (t=1), B = s0 s1 b2
    (t=2: KV match 2 ends inside A's edge, so the branch point P = s1 gets a state with
    B's end), C = s0 s1 c2..c5 (t=3: hits P, refreshing it). The tree: P (@2, three
    children: no candidate) and three leaves with a state each, all above P:

    ====  ======  ===========================  ================  ==============
    node  stored  span over P (FLOPs saved)    prefix memory     efficiency
    ====  ======  ===========================  ================  ==============
    A     1.5     400 − 200 = 200              50 + 400 = 450    0.4444
    B     2.5     300 − 200 = 100              50 + 300 = 350    0.2857
    C     3.5     600 − 200 = 400              50 + 600 = 650    0.6154
    ====  ======  ===========================  ================  ==============

    At now = 4: recency 1/(now − t) = 0.4, 0.667, 2 → min-max 0, 1/6, 1; efficiency
    min-max: A (0.4444 − 0.2857) / (0.6154 − 0.2857) = 0.4815, B 0, C 1. Scores
    (lowest evicted first): α = 0: A 0, B 0.167, C 1 → A B C; α = 0.5: A 0.241, B 0.167,
    C 1.5 → B A C; α = 2: A 0.963, B 0.167, C 3 → B A C. (With the recency of the last
    access time itself and FLOPs of the whole prefix per edge byte — A 400/250 = 1.6,
    B 2, C 1.33 — α = 0.5 would give A C B.)
    """
    s = chunks(1, 2)
    a, b, c = [*s, 2002, 2003], [*s, 3002], [*s, 4002, 4003, 4004, 4005]
    for alpha, order in ((0.0, "ABC"), (0.5, "BAC"), (2.0, "BAC")):
        p = MarconiPolicy(
            **GEO, gpu_bytes=BIG, flops=FlopModel(linear=1.0, pair=0.0), alpha=alpha,
            tune=False,
        )
        assert drive(p, [(a, 400), (b, 300), (c, 600)]) == [0, 0, 200]
        cache = p.cache
        leaf = {cache.index.get(a[-1]): "A", cache.index.get(b[-1]): "B",
                cache.index.get(c[-1]): "C"}
        assert cache.index.get(s[1]).has_snapshot  # type: ignore[union-attr]
        assert [round(cache.efficiency(n), 4) for n in leaf] == [0.4444, 0.2857, 0.6154]
        assert "".join(leaf[n] for n in cache.victim_order(4.0)) == order, alpha


def test_marconi_alpha_tuned_once_on_its_grid_by_flops_saved() -> None:
    rng = random.Random(7)
    p = MarconiPolicy(**GEO, gpu_bytes=2000, min_window=10, max_window=30, window_factor=2)
    assert p.alpha_grid == tuple(round(0.1 * i, 1) for i in range(21))
    steps = []
    for _ in range(150):
        fam, var, n = rng.randrange(6), rng.randrange(4), rng.randrange(1, 12)
        steps.append((variant(fam, var, n), n * C))
    drive(p, steps)
    assert p.tunings == 1
    assert p.cache.alpha in p.alpha_grid
    assert p.window is not None and 10 <= p.window <= 30
    # The α kept saves the most FLOPs in the replay (ties: the smaller).
    scores = p.alpha_scores
    assert sorted(scores) == sorted(p.alpha_grid)
    best = max(scores.values())
    assert p.cache.alpha == min(a for a, v in scores.items() if v == best)


# ------------------------------------------------------------------ vLLM
def test_vllm_align_keeps_replay_boundary_and_junction_states() -> None:
    """States at the replay boundary ((P − 1) // N) and at the shared-prefix junction.

    R1 a0..a4, 550 tok: hit 0, state @5. R2 a0..a7, 830 tok: hit 500 (@5), state @8.
    R3 rewrite after chunk 7 (a0..a6 + r7 r8), 900 tok: KV match 7, states @5 and @8:
    only @5 lies within, hit 500 (Marconi / unlimited get 700 there); it saves the
    junction @7 and its replay boundary @8 (899 // 100: a block-aligned prompt keeps the
    block before its end). R4 rewrite after chunk 4: KV match 4, no state within: hit 0.
    """
    a = chunks(1, 9)
    steps = [(a[:5], 550), (a[:8], 830), (fork(a, 7, 2, 9), 900), (fork(a, 4, 3, 6), 600)]
    p = vllm_align_policy("v", **GEO, tiers=[("gpu", BIG)])
    assert drive(p, steps) == [0, 500, 500, 0]
    assert drive(UnlimitedPolicy(**GEO), steps) == [0, 500, 700, 400]


def test_vllm_gpu_lru_over_blocks_keeps_dead_tails() -> None:
    """GPU 700 B. A (350 tokens: 3 chunks + state @3 = 350 B, t=1), B (350 B, t=2) fill
    it. C needs 100 + 50: the least recent block is A's leaf a2 (t=1; on a tie the KV
    leaf goes first and takes its state): 150 B freed. A's a0 a1 stay (vLLM has no early
    free of blocks without a state) but cannot be hit: A again gets 0."""
    p = vllm_align_policy("v", **GEO, tiers=[("gpu", 700)])
    a, b, c = chunks(1, 3), chunks(2, 3), chunks(3, 1)
    drive(p, [(a, 350), (b, 350), (c, 150)])
    assert a[2] not in p.engine.index
    assert p.resident(p.engine.index.get(a[1])) == ("gpu", None)  # type: ignore[arg-type]
    assert p.begin(req(a, 350), 9.0).hit_tokens == 0


def test_vllm_cpu_offload_cascade_and_loads() -> None:
    """Same as above with a 1000 B CPU tier: C's KV chunk needs 100 B: the LRU block a2
    (KV) is demoted to CPU; C's state needs 50 B: a1 (KV, t=1) ties with a2's state
    (t=1) and KV goes first: a1 demoted too. A again: KV match 3 (a0 GPU, a1 a2 CPU),
    state @3 on the GPU: hit 300, reading 100 + 50 B from GPU and 200 B from CPU."""
    p = vllm_align_policy("v", **GEO, tiers=[("gpu", 700), ("cpu", 1000)])
    a, b, c = chunks(1, 3), chunks(2, 3), chunks(3, 1)
    drive(p, [(a, 350), (b, 350), (c, 150)])
    idx = p.engine.index
    assert [p.resident(idx.get(k))[0] for k in a] == ["gpu", "cpu", "cpu"]  # type: ignore[arg-type]
    assert p.resident(idx.get(a[2])) == ("cpu", "gpu")  # type: ignore[arg-type]
    lookup = p.begin(req(a, 350), 9.0)
    assert lookup.hit_tokens == 300
    assert lookup.load_bytes == {"gpu": 100 + 50, "cpu": 200}
    # The hit brings A back to the GPU (B's older blocks make room and go to CPU).
    written = p.complete(req(a, 350), lookup, 9.5)
    assert written["gpu"] == 200
    assert [p.resident(idx.get(k))[0] for k in a] == ["gpu"] * 3  # type: ignore[arg-type]
    p.engine.check()


def test_vllm_junction_state_lets_a_second_rewrite_resume() -> None:
    """vLLM's shared-prefix junction (``get_computed_blocks``' ``shared_prefix_boundary``).

    R1 a0..a7, 830 tok: hit 0; replay boundary @8.
    R2 rewrite after chunk 5: a0..a4 x5 x6, 750 tok: KV match 5 (a0..a4), no state
       within (only @8): hit 0. The GPU KV match (5) goes beyond the hit (0): the
       scheduler ends a step at the junction and its state @5 is kept, with the replay
       boundary @7 (749 // 100). One extra step; the offload rows copy @5 to host.
    R3 another rewrite after chunk 5: a0..a4 y5..y7, 850 tok: KV match 5, state @5
       (R2's junction): hit 500. KV match = hit: no junction.
    R4 a0..a7 again, 830 tok: KV match 8, states @5 and @8 within: hit 800.
    Without the junction rule R3 would recompute everything.
    """
    a = chunks(1, 8)
    r2, r3 = fork(a, 5, 2, 7), fork(a, 5, 3, 8)
    steps = [(a, 830), (r2, 750), (r3, 850), (a, 830)]
    for tiers, host in (([("gpu", BIG)], 0), ([("gpu", BIG), ("cpu", BIG)], 1)):
        p = vllm_align_policy("v", **GEO, tiers=tiers)
        assert drive(p, steps) == [0, 0, 500, 800]
        with_state = sorted(n.depth + 1 for n in p.engine.index.nodes.values() if n.snap_tiers)
        assert with_state == [5, 7, 8, 8]  # @7 on R2's branch, @8 on R1's and R3's
        r = req(fork(a, 5, 4, 7), 750)  # a third rewrite at 5: resumes, no junction
        lookup = p.begin(r, 99.0)
        assert lookup.hit_tokens == 500
        assert p.capture(r, lookup) == Capture()
        p.complete(r, lookup, 99.5)
        r = req(fork(a, 6, 5, 7), 750)  # diverges at 6: junction @6 beyond the hit @5
        lookup = p.begin(r, 100.0)
        assert p.capture(r, lookup) == Capture(splits=1, host_states=host)
        p.complete(r, lookup, 100.5)
        assert p.engine.index.get(a[5]).has_snapshot  # type: ignore[union-attr]


# ------------------------------------------------------------------ SGLang
def test_sglang_states_at_prefill_chunks_and_branch_point() -> None:
    """The ``extra_buffer`` rule: one state per prefill chunk (here 300 tokens = 3 chunks),
    the branching point instead when it lies inside the chunk, and the end.

    R1 a0..a9, 1000 tok: hit 0. Prefill chunks [0,300) [300,600) [600,900) [900,1000):
       states @3 @6 @9, end @10.
    R2 rewrite after chunk 5: a0..a4 x5..x11, 1200 tok: KV match 5, deepest state
       within @3: hit 300. Branching point @5 (the KV hit, beyond the state). Chunks
       from 300: [300,600) holds the branch (500): @5 instead of @6; [600,900): @9 (x8);
       [900,1200): the end @12.
    R3 a0..a4 y5 y6, 700 tok: KV match 5, state @5: hit 500.
    R4 a0..a4 x5..x9 z10, 1100 tok: KV match 10, states @3 @5 @9 within: hit 900.
    vLLM on the same requests keeps R2's junction @5 and replay boundary @11 only: R4
    resumes at @5 (hit 500).
    """
    a = chunks(1, 10)
    x = fork(a, 5, 2, 12)
    steps = [(a, 1000), (x, 1200), (fork(a, 5, 3, 7), 700), ([*x[:10], 4010], 1100)]
    p = sglang_hicache_policy(
        "s", **GEO, gpu_bytes=BIG, cpu_bytes=BIG, chunked_prefill_tokens=3 * C
    )
    r1 = req(a, 1000)
    lookup = p.begin(r1, 1.0)
    assert lookup.handle.plan.chunks == [3, 6, 9, 10]
    assert p.capture(r1, lookup) == Capture(host_states=3)  # write-through backups
    p.complete(r1, lookup, 1.5)
    r2 = req(x, 1200)
    lookup = p.begin(r2, 2.0)
    assert lookup.hit_tokens == 300
    assert lookup.handle.plan.chunks == [5, 9, 12]
    p.complete(r2, lookup, 2.5)
    assert drive(p, steps[2:], t0=3.0) == [500, 900]
    v = vllm_align_policy("v", **GEO, tiers=[("gpu", BIG)])
    assert drive(v, steps) == [0, 0, 500, 500]
def test_sglang_small_state_pool_evicts_states_while_kv_stays() -> None:
    """GPU 1600 B split 1/16 for states: a Mamba pool of 100 B (2 states) and a KV pool of
    1500 B (15 chunks); no host memory (cpu 0). Times t = 1..6.

    Prompts end 50 tokens into a chunk (so vLLM's replay boundary is the last full one).

    1 A1  a0..a3, 450 tok: hit 0; KV 4 chunks; states {@4 a3: t1}.
    2 B1  b0, 150 tok: hit 0; KV 5; states {a3: t1, b0: t2}.
    3 A2  a0..a5, 650 tok: hit 400 (a3, in use). New state a5: the pool is full, the
          LRU state not in use is b0 (t2): dropped (no host room); b0 is then a KV leaf
          without state, deleted as a tombstone leaf. States {a3: t3, a5: t3}; KV 6.
    4 A3  a0..a5 again: hit 600 (a5 refreshed to t4; a3 not touched: t3).
    5 B2  b0 b1, 250 tok: b0 is gone: hit 0. KV 8 (the KV pool has room). New state
          b1: the LRU state is a3 (t3) → dropped; a3 has a child (a4): its KV stays.
    6 A4  rewrite a0..a3 z4, 550 tok: KV match 4 (a0..a3 kept) but no state within:
          hit falls back to 0.
    vLLM with the same 1600 B as one pool never fills (8 chunks + 4 states): b0's state
    survives (B2 hits 100) and so does a3's (A4 hits 400).
    """
    a = chunks(1, 6)
    b = chunks(2, 2)
    steps = [
        (a[:4], 450),
        (b[:1], 150),
        (a, 650),
        (a, 650),
        (b, 250),
        (fork(a, 4, 3, 5), 550),
    ]
    p = sglang_hicache_policy("s", **GEO, gpu_bytes=1600, cpu_bytes=0, gpu_state_fraction=1 / 16)
    assert [pool.capacity for pool in p.engine.pools] == [1500, 100, 0, 0]
    assert drive(p, steps) == [0, 0, 400, 600, 0, 0]
    assert all(p.engine.index.get(k).has_kv for k in a[:4])  # type: ignore[union-attr]
    v = vllm_align_policy("v", **GEO, tiers=[("gpu", 1600)])
    assert drive(v, steps) == [0, 0, 400, 600, 100, 400]


def test_sglang_host_pools_split_like_the_device() -> None:
    """--mamba-full-memory-ratio 0.9 (state : KV) on the GPU; --hicache-size split in
    proportion to the device pools on the host (1000 · 1/1.9 = 526 B of KV); an L3 pool
    of ``disk_bytes`` holds both kinds."""
    p = sglang_hicache_policy("s", **GEO, gpu_bytes=1900, cpu_bytes=1000)
    kv_gpu, st_gpu, kv_cpu, st_cpu = (pool.capacity for pool in p.engine.pools)
    assert (kv_gpu, st_gpu) == (1000, 900)
    assert (kv_cpu, st_cpu) == (526, 474)
    assert [pool.kinds for pool in p.engine.pools] == [(KV,), (STATE,), (KV,), (STATE,)]
    half = sglang_hicache_policy("s", **GEO, gpu_bytes=1900, cpu_bytes=1000, host_kv_fraction=0.5)
    assert [pool.capacity for pool in half.engine.pools][2:] == [500, 500]
    l3 = sglang_hicache_policy("s", **GEO, gpu_bytes=1900, cpu_bytes=1000, disk_bytes=3000)
    assert (l3.engine.pools[-1].tier, l3.engine.pools[-1].capacity) == ("disk", 3000)
    assert l3.engine.pools[-1].kinds == (KV, STATE)
    assert l3.capacity_bytes() == 1900 + 1000 + 3000


# ------------------------------------------------------------------ tiered LRU properties
def _queued_priorities(engine: TieredLRU, tier: int, pool: int) -> list[float]:
    out = []
    for kind in (KV, STATE):
        if engine._pool[tier][kind] == pool:
            heap = engine.heaps[tier][kind]
            out += [heap.priority(n) for n in heap]
    return out


def _engines(gpu: int, cpu: int, disk: int) -> list[EndStatePolicy]:
    return [
        vllm_align_policy("g", **GEO, tiers=[("gpu", gpu)]),
        vllm_align_policy("gc", **GEO, tiers=[("gpu", gpu), ("cpu", cpu)]),
        vllm_align_policy("gcd", **GEO, tiers=[("gpu", gpu), ("cpu", cpu), ("disk", disk)]),
        sglang_hicache_policy(
            "s", **GEO, gpu_bytes=gpu + 400, cpu_bytes=cpu, gpu_state_fraction=400 / (gpu + 400)
        ),
    ]


request_st = st.tuples(
    st.integers(0, 3),  # family
    st.integers(0, 3),  # variant: diverges from variant 0 at chunk 3·v
    st.integers(1, 12),  # full chunks
    st.integers(0, C - 1),  # partial tail
)


# Pool capacities of the property tests: the GPU always fits a whole prompt.
capacities_st = {
    "gpu": st.integers(1300, 2500),
    "cpu": st.integers(0, 1500),
    "disk": st.integers(0, 2000),
}


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=60)
@given(**capacities_st, requests=st.lists(request_st, min_size=1, max_size=40))
def test_tiered_lru_capacity_and_cascade_order(
    gpu: int, cpu: int, disk: int, requests: list[tuple[int, int, int, int]]
) -> None:
    """After every request: exact byte accounting within every pool's capacity, each
    object on one tier, the tree tier-monotone (``check``); and the cascade keeps ONE
    recency order: every queued object of a pool on tier t is at least as recent as
    every one of the same pool kind on tier t + 1 (gpu → cpu → disk). The GPU always
    fits a whole prompt (12 chunks + state), so promotions never fail."""
    for policy in _engines(gpu, cpu, disk):
        engine = policy.engine
        for i, (fam, var, n, tail) in enumerate(requests):
            keys = variant(fam, var, n)
            r = req(keys, n * C + tail)
            lookup = policy.begin(r, float(i))
            assert set(lookup.load_bytes) <= {"gpu", "cpu", "disk"}
            assert lookup.hit_tokens <= r.input_tokens
            written = policy.complete(r, lookup, i + 0.5)
            assert all(v > 0 for v in written.values())
            engine.check()
            for t in range(len(engine.tier_names) - 1):
                for kind in (KV, STATE):
                    upper = _queued_priorities(engine, t, engine._pool[t][kind])
                    lower = _queued_priorities(engine, t + 1, engine._pool[t + 1][kind])
                    if upper and lower:
                        assert min(upper) >= max(lower), (policy.name, t, kind)


def test_a_chunk_stored_by_another_request_meanwhile_is_held_not_evicted() -> None:
    """vLLM GPU only, 400 B. A (a0..a4, 500 tokens) starts with nothing cached; B (a0..a2,
    300 tokens) starts and finishes while A runs: a0 a1 a2 (300 B) + B's replay state
    after chunk (300 − 1) // 100 = 2, on a1 (50 B) = 350 B. A finishes: a0..a2 are A's own
    chunks (it computed them: held, out of the LRU). Storing a3 needs 100 B, 50 are free:
    the only queued object is B's state on a1 (t=3) — dropped, 100 B free, a3 stored
    (400 B used). a4 needs 100 B and nothing is queued: A's prompt stops after 4 chunks,
    and its state after chunk (500 − 1) // 100 = 4 (50 B) finds no room either.
    Before the fix the LRU still queued B's a0..a2 while A held them, picked a2 (the KV
    leaf first on B's tied time) and stopped on "dropping held KV"."""
    p = vllm_align_policy("v", **GEO, tiers=[("gpu", 400)])
    a = chunks(1, 5)
    ra, rb = req(a, 500, "A"), req(a[:3], 300, "B")
    la = p.begin(ra, 1.0)
    lb = p.begin(rb, 2.0)
    p.complete(rb, lb, 3.0)
    p.engine.check()
    assert p.engine.used == [300 + 50]
    p.complete(ra, la, 4.0)
    p.engine.check()
    idx = p.engine.index
    assert [k in idx for k in a] == [True, True, True, True, False]
    assert p.engine.used == [4 * 100]
    assert not any(idx.get(k).snap_tiers for k in a[:4])  # type: ignore[union-attr]
    assert p.engine.evictions == {"drop_state": 1}


def test_saving_a_state_whose_slower_copy_making_room_drops_stores_it_anew() -> None:
    """vLLM GPU 350 B + CPU 100 B. R1 (a0 a1, 250 tokens) saves a state after chunk
    (250 − 1) // 100 = 2 (on a1); R2 (a0, 150 tokens) finds no state within its KV match
    and saves one after chunk 1 (on a0, t=2.5); R3 (a0 a1, 250 tokens) resumes from a1's
    state and refreshes the KV and a1's state only: a0's state keeps t=2.5, the oldest
    object (GPU 300 B). F (b0, 100 tokens: no state) needs 100 B, 50 are free: a0's
    state goes to the CPU. R (a0 a1, 200 tokens) resumes from a1 (200 hit tokens) and
    saves a state after chunk (200 − 1) // 100 = 1, on a0, whose copy is on the CPU:
    moving it up needs 50 B on the full GPU, so b0 (t=4.5, the only queued GPU object)
    goes to the CPU, whose room for it takes a0's own CPU copy (t=2.5 ≤ 4.5, last tier:
    dropped). R's state is then stored anew on the GPU (100 B free): GPU a0 a1 + two
    states = 300 B, CPU b0 = 100 B; evictions: two demotions, one dropped state. Before
    the fix the dropped copy was re-queued on a tier it no longer had (``check``: a
    queued object must sit on its heap's tier), and once its node was pruned the heap
    held a node the index no longer had."""
    p = vllm_align_policy("v", **GEO, tiers=[("gpu", 350), ("cpu", 100)])
    a, b = chunks(1, 2), chunks(2, 1)
    hits = drive(p, [(a, 250), (a[:1], 150), (a, 250), (b, 100), (a, 200)])
    assert hits == [0, 0, 200, 0, 200]
    idx = p.engine.index
    assert p.resident(idx.get(a[0])) == ("gpu", "gpu")  # type: ignore[arg-type]
    assert p.resident(idx.get(a[1])) == ("gpu", "gpu")  # type: ignore[arg-type]
    assert p.resident(idx.get(b[0])) == ("cpu", None)  # type: ignore[arg-type]
    assert p.engine.used == [300, 100]
    assert p.engine.evictions == {"demote_gpu": 2, "drop_state": 1}


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=40)
@given(
    **capacities_st,
    requests=st.lists(request_st, min_size=2, max_size=30),
    order=st.randoms(use_true_random=False),
)
def test_tiered_lru_with_requests_in_flight_together(
    gpu: int, cpu: int, disk: int, requests: list[tuple[int, int, int, int]],
    order: random.Random,
) -> None:
    """Requests overlap (up to three in flight, finishing in any order), as they do in
    the server model: after every begin and every complete the accounting, the queues
    (a held chunk is never queued) and tier monotonicity hold (``check``), and no held
    object is ever dropped (the engine asserts it)."""
    for policy in _engines(gpu, cpu, disk):
        engine = policy.engine
        flying: list[tuple[Request, object]] = []
        for i, (fam, var, n, tail) in enumerate(requests):
            r = req(variant(fam, var, n), n * C + tail, f"s{i}")
            flying.append((r, policy.begin(r, float(i))))
            engine.check()
            while len(flying) >= 3 or (flying and i == len(requests) - 1):
                r_done, lookup = flying.pop(order.randrange(len(flying)))
                policy.complete(r_done, lookup, i + 0.5)  # type: ignore[arg-type]
                engine.check()


# ------------------------------------------------------------------ all rows
def test_baseline_rows_and_factories() -> None:
    rows = baseline_policies(**GEO, gpu_bytes=5000, cpu_bytes=5000, disk_bytes=5000)
    assert tuple(rows) == BASELINES
    for name, make in rows.items():
        first, second = make(), make()
        assert first.name == name and first is not second
    lru, lra = rows["lru"](), rows["lru-refresh-all"]()
    assert isinstance(lru, HiStatePolicy) and isinstance(lra, HiStatePolicy)
    assert lru.cache.config.tau == 0 and not lru.cache.config.refresh_all
    assert lra.cache.config.tau == 0 and lra.cache.config.refresh_all
    assert lru.tier_names == ["gpu", "cpu", "disk"]
    # Without a grid the core plans per chunk; given one, both rows plan on it (NOTE 2).
    assert lru.cache.config.step_tokens is None
    grid = baseline_policies(**GEO, gpu_bytes=5000, cpu_bytes=5000, disk_bytes=5000,
                             step_grid=(3 * C, 7.5))
    for name in ("lru", "lru-refresh-all"):
        config = grid[name]().cache.config  # type: ignore[attr-defined]
        assert (config.step_tokens, config.step_price) == (300, 7.5)


def test_memory_per_row_and_the_same_total_memory_view() -> None:
    """GPU 5,000 B, CPU 6,000 B, disk 7,000 B: GPU-only rows 5,000; GPU + CPU rows 11,000;
    three-tier rows 18,000; the unlimited reference ∞. ``same_memory`` grows each row's
    slowest tier to 18,000 in all: the GPU of Marconi and vLLM GPU-only to 18,000, the
    CPU of vLLM CPU offload and SGLang HiCache to 13,000."""
    from lmcache_histate.sim.capture import capacity_of

    caps = {"gpu_bytes": 5000, "cpu_bytes": 6000, "disk_bytes": 7000}
    mem = {n: capacity_of(f()) for n, f in baseline_policies(**GEO, **caps).items()}
    assert mem == {
        "unlimited": float("inf"), "marconi": 5000, "vllm-align-gpu": 5000,
        "vllm-cpu-offload": 11000, "vllm-cpu-disk-offload": 18000, "vllm-retention": 18000,
        "sglang-hicache": 11000, "sglang-hicache-l3": 18000, "lru": 18000,
        "lru-refresh-all": 18000, "file-lru": 18000,
    }
    same = baseline_policies(**GEO, **caps, same_memory=True)
    assert {n: capacity_of(f()) for n, f in same.items() if n != "unlimited"} == dict.fromkeys(
        [n for n in BASELINES if n != "unlimited"], 18000
    )
    assert same["marconi"]().cache.capacity == 18000  # type: ignore[attr-defined]
    cpu = same["vllm-cpu-offload"]().engine.pools  # type: ignore[attr-defined]
    assert [(p.tier, p.capacity) for p in cpu] == [("gpu", 5000), ("cpu", 13000)]
    sg = same["sglang-hicache"]().engine.pools  # type: ignore[attr-defined]
    assert sum(p.capacity for p in sg if p.tier == "cpu") == 13000


@pytest.mark.parametrize("refresh_all", [False, True])
def test_lru_rows_share_the_histate_rows_object_model(refresh_all: bool) -> None:
    """Same tiers, placement, promotion and interval control as ``sim/variants.py``'s
    ``histate`` row: only ``tau`` (and refresh-all) differ."""
    from lmcache_histate.sim.config import GIB, SimSetup
    from lmcache_histate.sim.variants import histate_policy

    setup = SimSetup.paper(gpu_bytes=2 * GIB, cpu_bytes=3 * GIB, disk_bytes=5 * GIB)
    ref = histate_policy(setup, "ref", tau=0.0, refresh_all=refresh_all)
    name = "lru-refresh-all" if refresh_all else "lru"
    ours = baseline_policies(
        setup.chunk_tokens,
        setup.kv_bytes_per_token,
        setup.snapshot_bytes,
        setup.gpu_bytes,
        setup.cpu_bytes,
        setup.disk_bytes,
        step_grid=(7920, 25.0),  # the shipped cost model's (CostModel.step_grid)
    )[name]()
    assert isinstance(ours, HiStatePolicy)
    assert ours.cache.config == ref.cache.config
    assert ours.promote_tier == ref.promote_tier


def test_the_ablation_rows_take_the_set_ups_interval_control() -> None:
    """With ``histate.max_interval_chunks`` 8 and ``ema_alpha`` 0.2 (not the defaults 64 and
    0.05), ``lru`` and ``lru-refresh-all`` are the ``histate`` core with ``tau = 0``, and
    ``file-lru`` plans with the same intervals and EMA weight (baselines NOTE 1)."""
    from lmcache_histate.sim.config import GIB, SimSetup
    from lmcache_histate.sim.runner import policy_factories
    from lmcache_histate.sim.variants import histate_policy

    setup = SimSetup.paper(gpu_bytes=2 * GIB, cpu_bytes=3 * GIB, disk_bytes=5 * GIB).with_(
        max_interval_chunks=8, ema_alpha=0.2
    )
    rows = policy_factories(setup)
    eight = (528, 1056, 1584, 2112, 2640, 3168, 3696, 4224)  # 1..8 chunks of 528 tokens
    for name, refresh_all in (("lru", False), ("lru-refresh-all", True)):
        ours = rows[name]()
        assert isinstance(ours, HiStatePolicy)
        assert ours.cache.config.supported_intervals == eight, name
        assert ours.cache.config.ema_alpha == 0.2, name
        assert ours.cache.config == histate_policy(
            setup, "ref", tau=0.0, refresh_all=refresh_all
        ).cache.config, name
    file_lru = rows["file-lru"]()
    assert file_lru.interval.supported == eight
    assert file_lru.interval.residence.alpha == 0.2


def test_every_row_at_most_unlimited_on_the_weka_sample() -> None:
    """Driven one request at a time over the embedded Weka sample at a tight capacity:
    no row hits more than the unlimited reference on any request, tier names are the
    cost model's, and hits fit in the prompt."""
    trace = load_trace("weka-sample", 528)
    requests = trace.requests()[:400]
    kv_tok, snap = 32_768, 51_511_296
    rows = baseline_policies(528, kv_tok, snap, 2 << 30, 2 << 30, 4 << 30)
    hits: dict[str, list[int]] = {}
    for name, make in rows.items():
        policy = make()
        out = hits[name] = []
        for i, r in enumerate(requests):
            lookup = policy.begin(r, float(i))
            assert set(lookup.load_bytes) <= {"gpu", "cpu", "disk"}, name
            out.append(lookup.hit_tokens)
            written = policy.complete(r, lookup, i + 0.5)
            assert set(written) <= {"gpu", "cpu", "disk"}, name
        check = getattr(policy, "engine", None) or getattr(policy, "cache", None)
        if check is not None:
            check.check()
    ref = hits["unlimited"]
    for name, out in hits.items():
        assert all(h <= u for h, u in zip(out, ref, strict=True)), name
    assert sum(ref) > 0
