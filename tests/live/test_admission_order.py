"""A request waiting for KV blocks keeps its place: later requests do not overtake it.

Real parts only: ``histate-server`` and ``histate serve`` (vLLM's OpenAI server, CPU) with
the flags the server prints, the tiny hybrid model, a KV pool smaller than two of the test's
long prompts, vLLM's default admission (the whole prompt's blocks at once).

vLLM admits waiting requests first come, first served: a request whose blocks cannot be
allocated ends the step's admissions, but one whose connector answers "not yet" is skipped
and the requests behind it are tried (``vllm/v1/core/sched/scheduler.py`` 986-991). The
connector answers "not yet" while a request's plan is on its way (connector NOTE 6), so it
must not ask the server again each time the same request fails allocation (NOTE 7): the
requests behind it would overtake it every other step.

Scenario, by hand, for a pool of ``T`` tokens (read from vLLM's log: 7,587 with the
AVX-512-BF16 layout, 5 MiB, context fitted to the pool): B, a prompt of ``0.4 T`` tokens
answering ``DECODE`` tokens, holds its blocks while it decodes. A (``0.7 T``, fresh)
arrives once B runs: its blocks do not fit beside B's, so it waits until B finishes. C
(one block and 10 tokens, fresh) arrives ``GAP_S`` later; it would fit beside B, but it
is behind A. So C's first token comes after B's last one. On the connector that asked
again for A's plan at each retry (A answered "not yet" 468 times in one run), C's first
token came while B still decoded (0.2 s and 3.8 s after C was sent, two runs).
"""

from __future__ import annotations

import json
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from support.served_stack import served_stack
from test_preemption import needs_live, serve_openai

POOL_BYTES = 5 << 20
POSITIONS = 16384  # raised (--hf-overrides); vLLM fits the context to the pool ("auto")
B_SHARE, A_SHARE = 0.4, 0.7
DECODE = 800
GAP_S = 0.5


def scenario(base: str, capacity: int, chunk: int, vocab: int, so: Any,
             seed: int) -> dict[str, float]:
    """Run B, A, C as the module docstring says; the clock of each milestone (seconds).

    Each request has its own thread and a blocking client, so no request's reading can
    hold back another's sending: with one asyncio loop for all three, C once left 3.5 s
    late, together with B's answer, and the scenario did not happen."""
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused", timeout=240, max_retries=0)
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    prompts = {"b": tokens(int(B_SHARE * capacity)), "a": tokens(int(A_SHARE * capacity)),
               "c": tokens(chunk + 10)}
    t: dict[str, float] = {}

    def run(name: str, max_tokens: int) -> None:
        t[f"{name}_sent"] = time.monotonic()
        if max_tokens > 1:
            client.completions.create(model="tiny", prompt=prompts[name],
                                      max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True})
        else:
            for _ in client.completions.create(model="tiny", prompt=prompts[name],
                                               max_tokens=1, temperature=0, stream=True):
                t.setdefault(f"{name}_first", time.monotonic())
        t[f"{name}_done"] = time.monotonic()

    with ThreadPoolExecutor(3) as pool:
        b = pool.submit(run, "b", DECODE)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and so.metric(
                so.get(base + "/metrics"), "vllm:num_requests_running") < 1:
            time.sleep(0.02)  # until B holds its blocks
        t["b_running"] = time.monotonic()
        a = pool.submit(run, "a", 1)
        time.sleep(GAP_S)
        c = pool.submit(run, "c", 1)
        for request in (b, a, c):
            request.result()
    return t


@needs_live
@pytest.mark.timeout(600)
def test_a_request_waiting_for_blocks_is_not_overtaken(tiny_model: Path, tmp_path: Path) -> None:
    so = serve_openai()
    vocab = int(json.loads((tiny_model / "config.json").read_text())["vocab_size"])
    serve_args = ["--max-model-len", "auto",
                  "--hf-overrides", json.dumps({"max_position_embeddings": POSITIONS}),
                  "--max-num-seqs", "4", "--enforce-eager",
                  "--kv-cache-memory-bytes", str(POOL_BYTES)]
    with served_stack(so, tiny_model, tmp_path, policy="histate",
                      serve_args=serve_args) as stack:
        text = stack.vllm_log.read_text()
        capacity = int(re.search(r"KV cache size: ([\d,]+) tokens", text)
                       .group(1).replace(",", ""))
        chunk = int(re.search(r"kv cache group sizes \((\d+)", text).group(1))
        fitted = json.loads(so.get(stack.base + "/v1/models"))["data"][0]["max_model_len"]
        t = scenario(stack.base, capacity, chunk, vocab, so, seed=7)
    print(f"\npool {capacity} tokens, block {chunk}; since B ran: "
          + ", ".join(f"{k} {v - t['b_running']:.2f}s" for k, v in sorted(t.items(),
                                                                        key=lambda kv: kv[1])))
    assert int(B_SHARE * capacity) + int(A_SHARE * capacity) > capacity, "A fits beside B"
    assert int(A_SHARE * capacity) < fitted
    assert t["c_sent"] < t["b_done"], "B finished before C came: raise DECODE"
    assert t["c_first"] > t["b_done"], "C overtook A, which waited for B's blocks"
    assert t["a_first"] > t["b_done"]
