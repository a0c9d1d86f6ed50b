"""HiState's step scheduler live: prefill steps end only where a snapshot is planned.

Real parts only: ``histate-server`` (pressure factor 1 from the start, the test zero-restore
hook), vLLM's CPU offline engine with ``HiStateScheduler`` at a step budget of 8 blocks (vLLM's
``LLM`` default on CPU is 4,096 tokens, about 10.7 blocks at N = 384) and the tiny
random-weight hybrid model, plus a no-connector engine computing every prompt from scratch.

Scenario, expected values by hand per engine layout (``LAYOUTS`` in test_vllm_cpu_roundtrip:
C = N = 384 with N_s = 828 on AVX-512-BF16, C = 256 with N_s = 432 on AVX2):

1. prompt A, L = 20C + 50 tokens. The server's plan for the segment [0, 20C) at F = 1
   (cost(I) = I/2 + N_s x 20C / I):
   C = 384: cost(8C) = 1536 + 2070.0 = 3606.0, cost(9C) = 1728 + 1840.0 = 3568.0,
            cost(10C) = 1920 + 1656.0 = 3576.0 -> every 9 chunks: [9C, 18C, 20C];
   C = 256: cost(7C) = 896 + 1234.3 = 2130.3, cost(8C) = 1024 + 1080.0 = 2104.0,
            cost(9C) = 1152 + 960.0 = 2112.0 -> every 8 chunks: [8C, 16C, 20C].
   With budget B = 8C each step ends at the first of: the budget, a planned boundary, vLLM's
   last cacheable block boundary (L - 1) // C x C = 20C. C = 384: 8C (budget), 9C (plan),
   17C (budget), 18C (plan), 20C, L -> 6 steps; C = 256: 8C, 16C, 20C, L -> 4 steps (the
   plan lies on the budget's grid). Both <= ceil(L / B) + k = 3 + 3, k = the 3 planned
   boundaries inside the prompt; one-block steps would take 21;
2. for each planned boundary b, a prompt sharing A's first b + C/2 tokens (b + 25 for the
   final 20C) then diverging
   hits exactly b (L1 cleared: from the disk tier), prefills the rest in one step, and its
   tokens and top-5 logprobs equal the no-connector engine's -- exactly;
3. negative control: with the hook zeroing restored recurrent state, a prompt hitting the
   first boundary gives other logprobs than recompute;
4. a fresh prompt (nothing to hit) gets the plan the connector sent with its lookup
   (``plans_prefetched`` + 1); the prompts that hit at a boundary ask for their own start
   when their lookup returns: one with whole chunks past its hit (D) gets that plan
   prefetched, and no plan is fetched on the scheduling loop (``plans_blocking`` unchanged);
5. the scheduler measured the engine's step price from its busy steps
   (``step_price``) and the plan requests after that carried it: the server
   reports the budget as its step grid and a price above 0 (its own default).
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path
from typing import Any

import pytest
from test_vllm_cpu_roundtrip import (
    LAUNCHER,
    ZERO_HOOK_MODULE,
    connector_config,
    disk_objects,
    first_interval_chunks,
    histate_config,
    layout_of,
    needs_live,
    server_module_arg,
    settle,
)

MAX_MODEL_LEN = 8192
BUDGET_BLOCKS = 8
TOP_LOGPROBS = 5
MAX_TOKENS = 4
TAIL = 100
PLAN_CHUNKS = {384: [9, 18, 20], 256: [8, 16, 20]}
"""The server's plan for A, in chunks (module docstring, step 1)."""
STEP_END_CHUNKS = {384: [8, 9, 17, 18, 20], 256: [8, 16, 20]}
"""A's step ends below its prompt end, in chunks (module docstring, step 1)."""


def expected_chunks(row: dict[str, Any]) -> tuple[list[int], list[int]]:
    """(plan, step ends below the prompt end) of A in chunks: the hand-derived rows above,
    or for another layout (a GPU's) the same rules: the interval k minimising
    kC/2 + N_s * 20C / (kC), and steps ending at the budget (8 chunks), a planned boundary
    or the last full block (20C), whichever comes first."""
    if row["block"] in PLAN_CHUNKS:
        return PLAN_CHUNKS[row["block"]], STEP_END_CHUNKS[row["block"]]
    c, n_s = row["block"], row["snapshot_bytes"] / 512
    k = first_interval_chunks(c, n_s, segment_chunks=20)
    plan = [*range(k, 20, k), 20]
    ends, at = [], 0
    while at < 20:
        at = min(at + BUDGET_BLOCKS, next(b for b in plan if b > at))
        ends.append(at)
    return plan, ends


def prompts(vocab: int, chunk: int, plan: list[int], seed: int = 28) -> dict[str, list[int]]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(4, vocab) for _ in range(n)]

    a = tokens(20 * chunk + 50)
    out = {"A": a}

    def diverging(cut: int) -> list[int]:
        tail = tokens(TAIL)
        if tail[0] == a[cut]:
            tail[0] = 4 + (tail[0] - 3) % (vocab - 4)
        return a[:cut] + tail

    for b in plan:  # half a chunk past b, or half of A's tail past its final boundary
        out[f"B{b}"] = diverging(b + min(chunk, len(a) - b) // 2)
    out["Z"] = diverging(plan[0] + chunk // 2)
    out["F"] = tokens(2 * chunk + 10)  # fresh: hits nothing
    out["D"] = diverging(plan[0] + chunk // 2) + tokens(2 * chunk)  # hit + 2 chunks to plan
    return out


@needs_live
def test_steps_end_only_at_planned_boundaries_and_restores_are_exact(
    tmp_path: Path, tiny_model: Path, tiny_layout: Any
) -> None:
    from lmcache_histate.backends.demo.engine_proc import EngineProcess, engine_kwargs
    from support.lmcache_mp import lmcache_server, support_pythonpath
    from support.load_counts import reconciled_loads

    row = layout_of(tiny_layout)
    chunk = tiny_layout.block_size
    budget = BUDGET_BLOCKS * chunk
    plan_chunks, end_chunks = expected_chunks(row)
    plan = [k * chunk for k in plan_chunks]
    vocab = int(json.loads((tiny_model / "config.json").read_text())["vocab_size"])
    ps = prompts(vocab, chunk, plan)
    kwargs = {"chunk_tokens": chunk, "max_model_len": MAX_MODEL_LEN,
              "max_num_batched_tokens": budget}

    with EngineProcess(engine_kwargs(tiny_model, **kwargs), workdir=tmp_path,
                       name="reference", block_size=chunk) as ref:
        reference = {name: ref.generate(p, max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS)
                     for name, p in ps.items() if name not in ("A", "F", "D")}

    zero_flag = tmp_path / "zero-restored-recurrent"
    disk = tmp_path / "disk"
    cfg = histate_config(tmp_path / "histate.yaml", tiny_model, disk)
    ask = {"histate_saves": True, "cached_token_stats": True}
    with (
        lmcache_server(server_module_arg(ZERO_HOOK_MODULE, {"flag": str(zero_flag)}),
                       workdir=tmp_path / "server", chunk_size=None, l1_size_gb=0.1,
                       command=[sys.executable, "-m", LAUNCHER, "--config", str(cfg)],
                       startup_timeout=180, env=support_pythonpath()) as server,
        EngineProcess(engine_kwargs(tiny_model, **kwargs, kv_transfer_config=connector_config(
                          server.endpoints.zmq_port, step_price="measured")),
                      workdir=tmp_path, name="cached", block_size=chunk) as engine,
    ):
        assert engine.info["max_num_batched_tokens"] == budget
        a = engine.generate(ps["A"], kv_transfer_params=ask, reset=True)
        settle(server)
        stored = disk_objects(disk)
        before = engine.stats()["histate"]
        fresh = engine.generate(ps["F"], kv_transfer_params=ask, reset=True)
        after = engine.stats()["histate"]
        settle(server)
        server.clear_l1()
        restored = {f"B{b}": engine.generate(ps[f"B{b}"], max_tokens=MAX_TOKENS,
                                             logprobs=TOP_LOGPROBS, kv_transfer_params=ask,
                                             reset=True) for b in plan}
        hits = engine.stats()["histate"]
        d = engine.generate(ps["D"], kv_transfer_params=ask, reset=True)
        after_d = engine.stats()["histate"]
        zero_flag.touch()  # arm the negative control
        z = engine.generate(ps["Z"], max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS,
                            kv_transfer_params=ask, reset=True)
        served = server.status()["histate"]
        loaded = reconciled_loads(server, engine)

    length = len(ps["A"])
    saves = a["kv_transfer_params"]["histate_saves"]
    print(f"\nA: {length} tokens, budget {budget}, plan {saves['plan']}, step ends "
          f"{saves['step_ends']}, {a['seconds']:.2f}s")
    # 1. The plan, its snapshots on disk, and A's steps.
    assert saves["segment"] == [0, length] and saves["source"] == "server"
    assert saves["plan"] == saves["kept"] == plan and not saves["missing"]
    snapshots = sorted((depth + 1) * chunk for kind, depth in stored if kind == "snapshot")
    assert snapshots == plan
    step_ends = [k * chunk for k in end_chunks] + [length]
    assert saves["step_ends"] == step_ends
    interior = [b for b in plan if b < length]
    assert len(step_ends) <= math.ceil(length / budget) + len(interior)
    # 2. Every planned boundary restores exactly; the rest of the prompt is one step.
    for b in plan:
        out, ref_out = restored[f"B{b}"], reference[f"B{b}"]
        stats = out["kv_transfer_params"]["cached_token_stats"]
        print(f"B{b}: hit {out['num_cached_tokens']}, step ends "
              f"{out['kv_transfer_params']['histate_saves']['step_ends']}")
        assert out["num_cached_tokens"] == stats["num_lmcache_cached_tokens"] == b
        assert out["kv_transfer_params"]["histate_saves"]["step_ends"] == [len(ps[f"B{b}"])]
        assert out["token_ids"] == ref_out["token_ids"]
        assert out["logprobs"] == ref_out["logprobs"]  # exact floats, top-5 per step
    # 4. The fresh prompt's plan came with its lookup: [2C] (F = 1: 2C is its final chunk).
    assert fresh["num_cached_tokens"] == 0
    assert fresh["kv_transfer_params"]["histate_saves"]["plan"] == [2 * chunk]
    assert after.get("plans_prefetched", 0) == before.get("plans_prefetched", 0) + 1
    assert after.get("plans_server", 0) == before.get("plans_server", 0) + 1
    # ... and a prompt hitting a boundary with whole chunks after it (D) asked for its own
    # start's plan when its lookup returned and waited for it outside the scheduling loop
    # (connector NOTE 6): one more prefetched plan, none fetched on the loop. (The B prompts
    # end less than a chunk past their hit: nothing to plan.)
    segment = [plan[0], len(ps["D"])]
    assert d["num_cached_tokens"] == plan[0]
    assert d["kv_transfer_params"]["histate_saves"]["segment"] == segment
    assert d["kv_transfer_params"]["histate_saves"]["source"] == "server"
    assert after_d.get("plans_prefetched", 0) == hits.get("plans_prefetched", 0) + 1
    assert after_d.get("plans_blocking", 0) == after.get("plans_blocking", 0)
    # 5. The scheduler timed its busy steps (A's last three, the B prompts' prefills and
    # decodes: more than the fit's 8 before D) and D's plan request carried the measured
    # step price: the server plans with the engine's grid and a price it cannot have from
    # anywhere else (its own is 0).
    print(f"step price the server plans with: {served['step_price']:.1f} tokens")
    assert served["step_tokens"] == budget
    assert served["step_price"] > 0
    # 3. Negative control: the same kind of hit with the restored state zeroed differs.
    assert z["num_cached_tokens"] == plan[0]
    assert z["logprobs"] != reference["Z"]["logprobs"], "zeroed state left outputs unchanged"
    # 6. The server counted as loaded what vLLM took: each B's b, D's and Z's first boundary.
    assert loaded == sum(plan) + 2 * plan[0]


@needs_live
def test_the_scheduler_is_guarded_to_the_vllm_it_was_written_for() -> None:
    from lmcache_histate.backends.vllm.step_scheduler import check_vllm

    check_vllm()  # the installed vLLM 0.32.0
    check_vllm("0.34.0")  # checked statically (make compat): same split signature
    with pytest.raises(RuntimeError, match=r"this is vLLM 0\.35\.0"):
        check_vllm("0.35.0")

    def other_split(self: Any, request: Any, num_new_tokens: int) -> int:
        return num_new_tokens

    with pytest.raises(RuntimeError, match="--scheduler-cls"):
        check_vllm(split=other_split)


@needs_live
def test_the_scheduler_class_follows_vllms_async_choice_and_is_recognised() -> None:
    from types import SimpleNamespace

    from lmcache_histate.backends.vllm.connector_config import SCHEDULER_CLS
    from lmcache_histate.backends.vllm.step_scheduler import (
        HiStateAsyncScheduler,
        HiStateScheduler,
        is_step_scheduler,
    )
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    def config(asynchronous: bool) -> Any:
        return SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=asynchronous))

    # __new__ only (no engine): the class vLLM's constructor call would initialise.
    made = HiStateScheduler.__new__(HiStateScheduler, vllm_config=config(True))
    assert type(made) is HiStateAsyncScheduler and isinstance(made, AsyncScheduler)
    assert isinstance(made, HiStateScheduler)  # so Python still runs __init__ on it
    assert type(HiStateScheduler.__new__(HiStateScheduler, config(False))) is HiStateScheduler
    assert is_step_scheduler(SCHEDULER_CLS) and is_step_scheduler(HiStateAsyncScheduler)
    assert not is_step_scheduler(None)
    assert not is_step_scheduler("vllm.v1.core.sched.scheduler.Scheduler")
