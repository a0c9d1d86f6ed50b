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

import http.client
import json
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from support.served_stack import served_stack
from test_preemption import needs_live, serve_openai

POOL_BYTES = 5 << 20
POSITIONS = 16384  # raised (--hf-overrides); vLLM fits the context to the pool ("auto")
B_SHARE, A_SHARE = 0.4, 0.7
DECODE = 800
GAP_S = 0.5


def scenario(base: str, capacity: int, chunk: int, vocab: int, seed: int) -> dict[str, float]:
    """Run B, A, C as the module docstring says; the clock of each milestone (seconds).

    Each request has its own thread and a body encoded before the scenario starts, and
    reads the stream raw: with both cores busy decoding B, the test process gets little
    CPU, and any work on a send's path (the OpenAI client builds a 5,000-token request for
    ~0.1 s of CPU) held C back until B had finished. A leaves at B's first streamed token,
    not when vLLM's ``num_requests_running`` gauge says B runs: on a busy host the gauge
    showed B only 0.5 s before B's last token."""
    rng = random.Random(seed)
    host, port = urlsplit(base).hostname, urlsplit(base).port
    lengths = {"b": int(B_SHARE * capacity), "a": int(A_SHARE * capacity), "c": chunk + 10}
    bodies = {name: json.dumps({
        "model": "tiny", "prompt": [rng.randrange(10, vocab) for _ in range(n)],
        "max_tokens": DECODE if name == "b" else 1, "temperature": 0, "stream": True,
        "ignore_eos": True}).encode() for name, n in lengths.items()}
    t: dict[str, float] = {}
    b_decodes = threading.Event()

    def run(name: str) -> None:
        connection = http.client.HTTPConnection(host, port, timeout=240)
        t[f"{name}_sent"] = time.monotonic()
        connection.request("POST", "/v1/completions", bodies[name],
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200, response.read()
        for line in response:
            if line.startswith(b"data: {") and f"{name}_first" not in t:
                t[f"{name}_first"] = time.monotonic()
                if name == "b":
                    b_decodes.set()
        t[f"{name}_done"] = time.monotonic()
        connection.close()

    with ThreadPoolExecutor(3) as pool:
        b = pool.submit(run, "b")
        if not b_decodes.wait(120):
            b.result(timeout=0)  # B's error, if it failed
            raise AssertionError("B streamed no token in 120 s")
        t["b_running"] = t["b_first"]  # B holds its blocks and decodes
        a = pool.submit(run, "a")
        time.sleep(GAP_S)
        c = pool.submit(run, "c")
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
        t = scenario(stack.base, capacity, chunk, vocab, seed=7)
    print(f"\npool {capacity} tokens, block {chunk}; since B ran: "
          + ", ".join(f"{k} {v - t['b_running']:.2f}s" for k, v in sorted(t.items(),
                                                                        key=lambda kv: kv[1])))
    assert int(B_SHARE * capacity) + int(A_SHARE * capacity) > capacity, "A fits beside B"
    assert int(A_SHARE * capacity) < fitted
    assert t["c_sent"] < t["b_done"], "B finished before C came: raise DECODE"
    assert t["c_first"] > t["b_done"], "C overtook A, which waited for B's blocks"
    assert t["a_first"] > t["b_done"]
