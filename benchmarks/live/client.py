"""An agent-like client: sessions replayed closed-loop through the OpenAI API, TTFT per request.

Each session sends its requests in order; the next one leaves ``think`` seconds after the
previous answer arrived (the trace's gap, compressed and capped), at most ``concurrency``
sessions are active at once, and a finished session makes room for the next (the paper's
setting: a bounded number of agents). Prompts are token ids (``/v1/completions``): the
synthetic tokens keep the trace's prefix structure exactly, which a chat template would blur.
TTFT is the time to the first streamed token; hit tokens are what the server reports in
``usage.prompt_tokens_details.cached_tokens`` (``--enable-prompt-tokens-details``), never
recomputed here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmcache_histate.backends.demo.workload import DemoRequest

REPORT_PARAM = "histate_saves"
"""``HiStateConnector``'s report request (``connector.REPORT_PARAM``; a test checks they agree)."""
STEP_ENDS_PARAM = "forced_step_ends"
"""The reference scheduler's step ends (``forced_steps.STEP_ENDS_PARAM``, same check)."""


@dataclass
class Row:
    session: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


def _sessions(workload: Sequence[DemoRequest]) -> list[list[DemoRequest]]:
    by: dict[str, list[DemoRequest]] = {}
    for request in workload:
        by.setdefault(request.session, []).append(request)
    return [sorted(v, key=lambda r: r.turn) for v in by.values()]


async def timed(client: Any, prompt: Sequence[int]) -> tuple[float, int]:
    started = time.monotonic()
    ttft = None
    cached = None
    stream = await client.completions.create(
        model="tiny", prompt=list(prompt), max_tokens=1, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if ttft is None and chunk.choices:
            ttft = time.monotonic() - started
        if chunk.usage is not None:
            details = chunk.usage.prompt_tokens_details
            cached = int(details.cached_tokens or 0) if details is not None else 0
    if ttft is None or cached is None:
        raise RuntimeError("the server streamed no token or no usage")
    return ttft, cached


async def replay(base_url: str, workload: Sequence[DemoRequest], *, concurrency: int,
                 think_scale: float, think_cap_s: float, progress: Any = None) -> list[Row]:
    """Replay ``workload``; rows in the workload's order."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="none", timeout=600.0, max_retries=0)
    gate = asyncio.Semaphore(concurrency)
    rows: dict[tuple[str, int], Row] = {}

    async def run(session: list[DemoRequest]) -> None:
        async with gate:
            previous: DemoRequest | None = None
            for request in session:
                if previous is not None:
                    gap = max(0.0, request.arrival - previous.arrival) * think_scale
                    await asyncio.sleep(min(gap, think_cap_s))
                ttft, cached = await timed(client, request.prompt)
                rows[(request.session, request.turn)] = Row(
                    request.session, request.turn, len(request.prompt), cached, ttft)
                if progress is not None:
                    progress()
                previous = request

    try:
        await asyncio.gather(*(run(s) for s in _sessions(workload)))
    finally:
        await client.close()
    return [rows[(r.session, r.turn)] for r in workload]


def warm_up_prompts(prompts: Sequence[Sequence[int]], *, block: int, vocab: int,
                    lo: int) -> tuple[list[int], list[int]]:
    """Two warm-up prompts (``run_live`` NOTE 3): the first of ``2 * block + 10`` tokens, the
    second sharing exactly its two whole blocks, and neither sharing a first token (so no
    block) with any of ``prompts``. Tokens are drawn from ``[lo, vocab)``."""
    import random

    rng = random.Random("warm-up")
    firsts = {p[0] for p in prompts if p}
    head = [rng.randrange(lo, vocab) for _ in range(2 * block)]
    while head[0] in firsts:
        head[0] = lo + (head[0] - lo + 1) % (vocab - lo)
    first = head + [rng.randrange(lo, vocab) for _ in range(10)]
    second = head + [rng.randrange(lo, vocab) for _ in range(10)]
    while second[2 * block] == first[2 * block]:
        second[2 * block] = lo + (second[2 * block] - lo + 1) % (vocab - lo)
    return first, second


def warm_up(base_url: str, prompts: tuple[Sequence[int], Sequence[int]]) -> None:
    """Send each prompt, emptying vLLM's prefix cache after each: the second resumes from
    whatever cache the stack has below vLLM's (LMCache's tiers), then vLLM's pool is as empty
    as before."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none", timeout=600.0, max_retries=0)
    try:
        for prompt in prompts:
            client.completions.create(model="tiny", prompt=list(prompt), max_tokens=1,
                                      temperature=0.0)
            _reset_prefix_cache(base_url)
    finally:
        client.close()


def _reset_prefix_cache(base_url: str, tries: int = 50) -> None:
    """vLLM's dev endpoint; it refuses while blocks are still held, so retry briefly."""
    import json
    import urllib.request

    url = base_url.removesuffix("/v1") + "/reset_prefix_cache"
    for _ in range(tries):
        request = urllib.request.Request(url, method="POST", data=b"")
        with urllib.request.urlopen(request, timeout=30) as response:
            if json.loads(response.read()).get("success"):
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} kept refusing the reset")


async def greedy_logprobs(base_url: str, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
                          *, max_tokens: int, top: int, reset: bool,
                          step_ends: Sequence[Sequence[int] | None] | None = None,
                          ) -> list[dict[str, Any]]:
    """The correctness guard, one request at a time: for each (seed, check) pair send the
    seed prompt (it stores its prefix), then -- with ``reset`` -- empty vLLM's own prefix
    cache (which also waits until the seed's KV transfers are done), then the check prompt,
    greedy, with top-``top`` logprobs and its cached tokens. Without a connector ``reset``
    makes the check compute from zero (the reference); with one, its hit must come from the
    connector's tiers.

    With ``reset`` the cache is emptied before each seed too: a seed resuming from vLLM's
    own prefix cache (an earlier pair's blocks) would store states computed on vLLM's
    resume path, whose first-step logprobs differ from recompute (``run_live`` NOTE 1), and
    a check restoring them through the connector would inherit that difference.

    Both prompts ask for the HiState connector's report (``REPORT_PARAM``): where a stack's
    connector gives it, each result carries ``like_step_ends``, the step ends a from-zero
    prefill of the check needs to do the arithmetic the stack did (:func:`like_steps`, over
    every prompt sent so far); other stacks ignore the request and get None. ``step_ends``
    (the reference, ``forced_steps``): per pair, the step ends the check's prefill must have,
    or None for vLLM's own."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="none", timeout=600.0, max_retries=0)
    ask = {REPORT_PARAM: True}
    history: list[tuple[Sequence[int], list[int]]] | None = []
    out = []
    try:
        for i, (seed, check) in enumerate(pairs):
            if reset:
                await asyncio.to_thread(_reset_prefix_cache, base_url)
            first = await client.completions.create(
                model="tiny", prompt=list(seed), max_tokens=1, temperature=0.0,
                extra_body={"kv_transfer_params": ask})
            history = _remember(history, seed, first)
            if reset:
                await asyncio.to_thread(_reset_prefix_cache, base_url)
            forced = step_ends[i] if step_ends is not None else None
            params = {STEP_ENDS_PARAM: list(forced)} if forced else ask
            response = await client.completions.create(
                model="tiny", prompt=list(check), max_tokens=max_tokens, temperature=0.0,
                logprobs=top, extra_body={"return_tokens_as_token_ids": True,
                                          "kv_transfer_params": params},
            )
            history = _remember(history, check, response)
            choice = response.choices[0]
            out.append({"text": choice.text, "tokens": choice.logprobs.tokens,
                        "top_logprobs": choice.logprobs.top_logprobs,
                        "cached_tokens": _cached(response),
                        "like_step_ends": history[-1][1] if history else None})
    finally:
        await client.close()
    return out


def _cached(response: Any) -> int:
    details = response.usage.prompt_tokens_details if response.usage else None
    return int(details.cached_tokens or 0) if details else 0


def _remember(history: list[tuple[Sequence[int], list[int]]] | None, prompt: Sequence[int],
              response: Any) -> list[tuple[Sequence[int], list[int]]] | None:
    """``history`` + (prompt, its like-step ends); None once a response reported no steps."""
    params = getattr(response, "kv_transfer_params", None) or {}
    report = params.get(REPORT_PARAM) if isinstance(params, dict) else None
    if history is None or not report:
        return None
    own = [int(e) for e in report["step_ends"]]
    return [*history, (prompt, like_steps(history, prompt, _cached(response), own))]


def like_steps(history: Sequence[tuple[Sequence[int], Sequence[int]]], prompt: Sequence[int],
               hit: int, own: Sequence[int]) -> list[int]:
    """The step ends of a from-zero prefill of ``prompt`` that does the arithmetic of a run
    which restored ``hit`` tokens and then ended its steps at ``own``.

    The restored prefix was computed by an earlier prompt of ``history`` (prompt, its
    like-step ends; latest last): the latest one sharing the first ``hit`` tokens with a step
    end at ``hit`` (a recurrent state exists only at a step end). Its ends below the hit, the
    hit itself, then ``own`` above it. A hit with no such source keeps only itself below."""
    below: set[int] = set()
    if hit:
        for tokens, ends in reversed(history):
            if hit in ends and list(tokens[:hit]) == list(prompt[:hit]):
                below = {int(e) for e in ends if e < hit}
                break
    return sorted(below | ({hit} if hit else set()) | {int(e) for e in own if e > hit})
