"""The ``vllm-retention`` row: vLLM align mode with a positive retention interval.

States are kept where a prefill step ends on a multiple of the interval (steps of the
engine's budget from the resume point, restarting at a junction stop), besides the
replay boundary and the junction every align-mode row keeps (``baselines/vllm.py``).
"""

from __future__ import annotations

from lmcache_histate.sim.baselines import BASELINES, baseline_policies
from lmcache_histate.sim.baselines.vllm import (
    VLLMRetentionPolicy,
    retention_chunks,
    vllm_align_policy,
)
from lmcache_histate.sim.trace_model import Request

C = 100
GEO = {"chunk_tokens": C, "kv_bytes_per_token": 1, "snapshot_bytes": 50}
BIG = 10**9


def chunks(p: int, n: int) -> list[int]:
    return [p * 1000 + i for i in range(n)]


def serve(policy: object, keys: list[int], tokens: int, t: float) -> int:
    r = Request("s", 0, 0.0, 0.0, tokens, 1, tuple(keys))
    lookup = policy.begin(r, t)  # type: ignore[attr-defined]
    policy.complete(r, lookup, t + 0.5)  # type: ignore[attr-defined]
    return lookup.hit_tokens


def test_interval_is_the_smallest_block_multiple_at_or_above_4096() -> None:
    # 4,096 / 528 = 7.76 blocks -> 8 (4,224 tokens); vLLM refuses 4,096 itself there.
    assert retention_chunks(528) == 8
    # A block that divides 4,096 keeps it: 4,096 / 256 = 16 blocks.
    assert retention_chunks(256) == 16


def test_periodic_states_fall_where_steps_end_on_the_interval() -> None:
    p = vllm_align_policy("r", **GEO, tiers=[("gpu", BIG)], retention=(4, 3))
    assert isinstance(p, VLLMRetentionPolicy)
    # Steps of 3 from 0: ends 3, 6, 9, 12, 15, 18 below 20; multiples of 4: 12.
    assert p.periodic(0, 20, None) == [12]
    # From 1: ends 4, 7, 10, 13, 16, 19 -> 4 and 16.
    assert p.periodic(1, 20, None) == [4, 16]
    # A junction at 5 ends the step from 1 there: ends 4, 5, 8, 11, 14, 17 -> 4 and 8.
    assert p.periodic(1, 20, 5) == [4, 8]


def test_a_rewrite_resumes_from_a_periodic_state_only_with_retention() -> None:
    """R1 a0..a19, 2,050 tokens: replay boundary 2,049 // 100 = 20; the retention row
    also keeps @12 (steps 3, 6, 9, 12, ...; every 4). R2 rewrites after chunk 14
    (2,000 tokens): KV match 14; the align row has only @20 beyond it (hit 0); the
    retention row resumes @12 (hit 1,200)."""
    a = chunks(1, 20)
    rewrite = a[:14] + chunks(2, 20)[14:]
    align = vllm_align_policy("v", **GEO, tiers=[("gpu", BIG)])
    kept = vllm_align_policy("r", **GEO, tiers=[("gpu", BIG)], retention=(4, 3))
    assert [serve(align, a, 2050, 1.0), serve(align, rewrite, 2000, 2.0)] == [0, 0]
    assert [serve(kept, a, 2050, 1.0), serve(kept, rewrite, 2000, 2.0)] == [0, 1200]
    # R1 planned @12; R2 (from 12) ends steps at 14 (the junction) and 17: none more.
    assert kept.stats()["periodic_states"] == 1.0


def test_the_row_is_registered_with_the_engines_step_grid() -> None:
    rows = baseline_policies(**GEO, gpu_bytes=BIG, cpu_bytes=BIG, disk_bytes=BIG,
                             step_grid=(7 * C, 0.0))
    assert "vllm-retention" in BASELINES
    p = rows["vllm-retention"]()
    assert isinstance(p, VLLMRetentionPolicy)
    # 4,096 tokens on 100-token blocks: 41 blocks; steps of 700 tokens: 7 blocks.
    assert (p.every, p.step_chunks) == (41, 7)
    assert p.capacity_bytes() == 3 * BIG
