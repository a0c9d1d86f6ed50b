"""HiState rows: the real core behind ``HiStatePolicy``, knobs per variant, promotion."""

from __future__ import annotations

from lmcache_histate.sim.config import GIB, SimSetup
from lmcache_histate.sim.server import simulate
from lmcache_histate.sim.synthetic import synthetic_agent
from lmcache_histate.sim.variants import VARIANTS, histate_policy, histate_variants


def test_variant_knobs() -> None:
    s = SimSetup.paper()
    pols = {n: f() for n, f in histate_variants(s).items()}
    assert list(pols) == list(VARIANTS)
    cfg = {n: p.cache.config for n, p in pols.items()}
    # The design calibrates tau online (None); the set-up's fixed tau is its ablation.
    assert (cfg["histate"].tau, cfg["histate"].refresh_all) == (None, True)
    assert (cfg["histate-fixed-tau"].tau, cfg["histate-fixed-tau"].refresh_all) == (s.tau, True)
    # The paper's rule, kept as its own row: refresh-all with the calibrated tau, every
    # passing session's end hits priced into a snapshot's C; every other HiState row
    # prices them only where the tail below can leave (``core.eviction`` NOTE 7).
    assert (cfg["histate-paper"].tau, cfg["histate-paper"].refresh_all) == (None, True)
    assert {n for n, c in cfg.items() if not c.exposed_ends} == {"histate-paper"}
    assert (cfg["histate-refresh-hit"].tau, cfg["histate-refresh-hit"].refresh_all) == (
        None, False)
    # The learned refresh scope (``core.eviction`` NOTE 8) is its own row, on refresh-all.
    assert {n for n, c in cfg.items() if c.refresh_learned} == {"histate-refresh-learned"}
    assert cfg["histate-refresh-learned"].refresh_all
    # τ fitted to whether sessions return (``core.rank`` NOTE 7) is its own row; it reads
    # the tiers' dwell, which ``exposed_ends`` measures.
    assert {n for n, c in cfg.items() if c.return_tau} == {"histate-return-tau"}
    assert (cfg["histate-return-tau"].tau, cfg["histate-return-tau"].exposed_ends) == (None, True)
    assert cfg["histate"].fixed_interval is None
    assert "histate-lru" not in cfg  # the baselines' ``lru`` row is that ablation
    assert cfg["histate-align"].fixed_interval == 0
    assert cfg["histate-every32"].fixed_interval == 32 * 528
    # Free storage until a snapshot leaves (F = 0) is the design; F = 1 its ablation.
    assert cfg["histate"].initial_pressure_factor == 0.0
    assert cfg["histate-neutral-start"].initial_pressure_factor == 1.0
    assert pols["histate-neutral-start"].cache.stats().pressure_factor == 1.0
    assert [t.name for t in cfg["histate"].tiers] == ["gpu", "cpu", "disk"]
    assert all(p.promote_tier == 0 for p in pols.values())
    # The engine's step grid: 8,192 rounded down to 15 chunks of 528; a step end's price
    # 2 ms / 80 µs = 25 tokens of prefill. vLLM's own scheduler (the small-steps
    # ablation) ends a step at every chunk: a one-chunk grid.
    assert {n: c.step_tokens for n, c in cfg.items() if n != "histate-small-steps"} == {
        n: 7920 for n in cfg if n != "histate-small-steps"}
    assert cfg["histate-small-steps"].step_tokens == 528
    assert {c.step_price for c in cfg.values()} == {25.0}


def test_hits_are_promoted_to_the_gpu_and_the_core_stays_consistent() -> None:
    # Tiny tiers force demotions and drops all the time; rewrites make branches.
    s = SimSetup.paper(gpu_bytes=GIB // 2, cpu_bytes=GIB, disk_bytes=2 * GIB)
    trace = synthetic_agent(6, 8, 3000, 0.2, chunk_tokens=528, seed=3, think_time=1.0,
                            session_gap=2.0)
    for name in VARIANTS:
        pol = histate_policy(s, name, **dict(VARIANTS[name]))
        run = simulate(trace, pol, s)
        pol.cache.check()  # index, byte accounting, capacities, queue membership
        assert pol.promoted_bytes > 0, name
        assert sum(r.load_bytes.get("disk", 0) for r in run.results) > 0, name


def test_promotion_makes_repeat_hits_free() -> None:
    # A session whose prefix was demoted is read from a slower tier once, then from GPU.
    s = SimSetup.paper()
    pol = histate_policy(s)
    trace = synthetic_agent(1, 3, 4000, 0.0, chunk_tokens=528, seed=0)
    store = pol.cache._store  # white box: a demoted prefix set up without an eviction
    reqs = trace.sessions[0].requests
    lk = pol.begin(reqs[0], 0.0)
    pol.complete(reqs[0], lk, 1.0)
    for node in pol.cache.nodes():  # demote the whole prefix to CPU
        if node.kv_tiers == 1:
            store._relocate(node, "kv", 0, 1)
    lk = pol.begin(reqs[1], 2.0)
    assert set(lk.load_bytes) == {"cpu", "gpu"} and lk.load_bytes["gpu"] == s.snapshot_bytes
    pol.complete(reqs[1], lk, 3.0)
    lk = pol.begin(reqs[2], 4.0)
    assert set(lk.load_bytes) == {"gpu"}
    pol.complete(reqs[2], lk, 5.0)
    pol.cache.check()


def test_final_snapshot_of_a_request_whose_hashes_stop_short() -> None:
    """A 650-token prompt at 100-token chunks has 6 full chunks, but its trace hashes only 4
    (the trailing blocks are not listed). The stored chain is those 4 chunks, so the
    segment's final snapshot belongs after chunk 4; a plan that ended at 600 tokens pointed
    past the chain and saved nothing. The next request (the same 4 hashed chunks + 2 more)
    resumes at chunk 4: 400 tokens.

    Final-only plan (``fixed_interval = 0``) and the interval controller alike: the
    final snapshot sits after chunk 4, on the final tier (the GPU)."""
    from lmcache_histate.sim.trace_model import Request
    from lmcache_histate.sim.variants import three_tier_policy

    keys = tuple(range(1, 5))
    for knobs in ({"fixed_interval": 0}, {}):
        pol = three_tier_policy(
            "h", chunk_tokens=100, kv_bytes_per_token=1, snapshot_bytes=50,
            gpu_bytes=10**6, cpu_bytes=10**6, disk_bytes=10**6, **knobs,
        )
        r1 = Request("s", 0, 0.0, 0.0, 650, 1, keys)
        pol.complete(r1, pol.begin(r1, 1.0), 1.5)
        last = pol.cache.node(keys[-1])
        assert last is not None and last.snap_tiers == 1, knobs  # tier 0 = gpu
        r2 = Request("s", 1, 2.0, 0.0, 650, 1, (*keys, 5, 6))
        assert pol.begin(r2, 2.0).hit_tokens == 400, knobs
        pol.cache.check()
