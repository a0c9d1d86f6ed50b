"""Mixed hits: vLLM's own prefix cache holds a prefix, HiState a deeper snapshot.

In deployment a request often finds a shorter prefix in vLLM's own prefix cache and a deeper
one on the HiState server. vLLM then keeps its local blocks for ``[0, L)`` and asks the
connector for the tokens beyond ``L`` (``vllm/v1/core/sched/scheduler.py`` 970-1027):
LMCache loads the attention KV of ``[L, H)`` and the recurrent state at ``H``, so the request
joins a local prefix with an external recurrent tail (the combination LMCache #4247 reports
silent corruption for on another vLLM). The other live tests reset vLLM's prefix cache before
the request that hits; here nothing is reset between the request that fills vLLM's cache
and the one that joins the two.

Real parts only: ``histate-server`` (disk tier, the test zero-restore hook), one vLLM CPU
engine with ``HiStateConnector`` for every case (module-scoped), and the session's engine
without a connector computing each request from scratch (the reference, ``plain_engine``
in tests/live/conftest.py).

Setup (hand-derived, ``LAYOUTS`` in test_vllm_cpu_roundtrip): prompt X of 10 chunks + 50
tokens is stored with the server's plan at pressure factor 1, ``[kC, 10C]`` (``k`` = 7 at
C = 384, AVX-512; 6 at C = 256, AVX2). The engine matches prefixes every ``UNIT`` = 128
tokens (``prefix_match_unit``: vLLM's sub-block hits), so its own cache can hold a prefix
that ends inside a block. Each case then

1. resets vLLM's prefix cache (the only reset: before the local prefix is made),
2. runs a prefix of X, which leaves vLLM's own cache holding a prefix of length ``L``,
3. runs ``X[:D] + tail`` (``D`` = 8.5 chunks, the divergence) with no reset in between: vLLM
   hits ``L`` locally, HiState ``kC`` (its last snapshot at or below ``D``),

and the answer (greedy tokens, top-5 logprobs of 4 steps) must equal the reference's exactly:

* (a) ``L = 3C``, on vLLM's block grid: 3C local + ``(k - 3)C`` loaded;
* (b) ``L = 4C + UNIT``, inside a block: vLLM drops its sub-block tail (scheduler.py
  1007-1018) and loads ``[4C, kC)``;
* (c) after a preemption: two new prompts on a pool of ``POOL_BLOCKS`` blocks, one
  preempted by the other's growth and resumed from what vLLM's cache and the server hold
  of it;
* (d) ``L = 9C + UNIT`` longer than HiState's ``9C``: nothing is loaded, vLLM's own hit
  serves;
* (e) an LMCache chunk of two blocks (its own stock server and engine): vLLM's ``3C`` is
  off the chunk grid, the load covers ``[2C, 8C)`` and skips the local ``[2C, 3C)``;
* negative control: (a) again with the server zeroing the restored recurrent state; the
  logprobs must differ from the reference.

The connector counts each admission that joins vLLM's prefix with a load (``mixed_hits``;
``mixed_hits_resumed`` for a preempted request's), in the counters
``EngineProcess.stats()["histate"]`` returns (connector NOTE 8); the tests assert it. Every
combination here is exact, so the connector refuses none (docs/vllm-cpu.md, "Mixed hits").
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_vllm_cpu_roundtrip import (
    LAUNCHER,
    MAX_TOKENS,
    TOP_LOGPROBS,
    ZERO_HOOK_MODULE,
    connector_config,
    histate_config,
    layout_of,
    needs_live,
    server_module_arg,
    settle,
)

UNIT = 128
"""vLLM's ``prefix_match_unit``: divides both CPU block sizes (384, 256), smaller than both."""
POOL_BLOCKS = 28
"""KV pool in blocks: one request of 10 chunks fits, two do not (case c)."""
TAIL = 300
ASK = {"histate_saves": True, "cached_token_stats": True}


@dataclass
class Mixed:
    """The module's stack and prompt X. Invariant between tests: X's snapshots ``[kC, 10C]``
    are on the server; what vLLM's own cache holds is whatever the last test left (each
    test makes its local prefix itself, :meth:`local_prefix`)."""

    server: Any
    engine: Any
    reference: Any
    chunk: int
    k: int
    x: list[int]
    vocab: int
    zero_flag: Path
    rng: random.Random

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(4, self.vocab) for _ in range(n)]

    def diverging(self, prefix: int) -> list[int]:
        """``X[:prefix]`` then a tail whose first token differs from X's there."""
        tail = self.tokens(TAIL)
        if tail[0] == self.x[prefix]:
            tail[0] = 4 + (tail[0] - 3) % (self.vocab - 4)
        return self.x[:prefix] + tail

    def recompute(self, prompt: list[int]) -> dict[str, Any]:
        return self.reference.generate(prompt, max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS,
                                       reset=True)

    def counters(self) -> dict[str, int]:
        return dict(self.engine.stats()["histate"])

    def local_prefix(self, length: int) -> dict[str, Any]:
        """Reset vLLM's own cache, then run ``X[:length]`` so that it holds X's prefix."""
        self.engine.reset()
        out = self.engine.generate(self.x[:length], kv_transfer_params=ASK)
        settle(self.server)
        return out

    def mixed(self, prompt: list[int]) -> dict[str, Any]:
        """``prompt`` right after :meth:`local_prefix`: no reset of vLLM's cache before it."""
        out = self.engine.generate(prompt, max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS,
                                   kv_transfer_params=ASK)
        settle(self.server)
        return out


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path,
          tiny_layout: Any, plain_engine: Any) -> Iterator[Mixed]:
    from lmcache_histate.backends.demo.engine_proc import EngineProcess, engine_kwargs
    from support.lmcache_mp import lmcache_server, support_pythonpath

    work = tmp_path_factory.mktemp("mixed")
    chunk = tiny_layout.block_size
    assert chunk % UNIT == 0 and chunk > UNIT
    row = layout_of(tiny_layout)
    vocab = int(json.loads((tiny_model / "config.json").read_text())["vocab_size"])
    zero_flag = work / "zero-restored-recurrent"
    cfg = histate_config(work / "histate.yaml", tiny_model, work / "disk")
    command = [sys.executable, "-m", LAUNCHER, "--config", str(cfg)]
    rng = random.Random(23)
    with (
        lmcache_server(server_module_arg(ZERO_HOOK_MODULE, {"flag": str(zero_flag)}),
                       workdir=work / "server", chunk_size=None, l1_size_gb=0.1,
                       command=command, startup_timeout=180,
                       env=support_pythonpath()) as server,
        EngineProcess(
            engine_kwargs(tiny_model, chunk_tokens=chunk,
                          kv_transfer_config=connector_config(server.endpoints.zmq_port),
                          # Page = C tokens x 512 B of attention KV (every group's page
                          # is padded to it): POOL_BLOCKS blocks.
                          kv_cache_memory_bytes=POOL_BLOCKS * 512 * chunk,
                          prefix_match_unit=UNIT,
                          # Admit on the first step, not the whole prompt, so that
                          # requests grow into each other and one is preempted (c).
                          scheduler_reserve_full_isl=False),
            workdir=work, name="engine", block_size=chunk,
        ) as engine,
    ):
        assert engine.info["num_blocks"] == POOL_BLOCKS
        state = Mixed(server, engine, plain_engine, chunk, row["first_interval_chunks"],
                      [rng.randrange(4, vocab) for _ in range(10 * chunk + 50)], vocab,
                      zero_flag, rng)
        stored = engine.generate(state.x, kv_transfer_params=ASK, reset=True)
        settle(server)
        saves = stored["kv_transfer_params"]["histate_saves"]
        assert saves["kept"] == [state.k * chunk, 10 * chunk]  # X's snapshots on the server
        yield state


def assert_exact(out: dict[str, Any], ref: dict[str, Any]) -> None:
    assert out["token_ids"] == ref["token_ids"]
    assert out["logprobs"] == ref["logprobs"]  # exact floats, all top-5 of every step


def hits(out: dict[str, Any]) -> tuple[int, int, int]:
    """(tokens vLLM skipped, vLLM's block-aligned hit the connector saw, LMCache's hit)."""
    stats = out["kv_transfer_params"]["cached_token_stats"]
    return (out["num_cached_tokens"], stats["num_vllm_cached_tokens"],
            stats["num_lmcache_cached_tokens"])


@pytest.mark.vllm_layout
@needs_live
def test_a_local_prefix_on_the_block_grid_joins_a_deeper_snapshot(mixed: Mixed) -> None:
    c, k = mixed.chunk, mixed.k
    before = mixed.counters()
    mixed.local_prefix(3 * c + 10)  # X's first 3 chunks: the state at 3C stays in vLLM
    prompt = mixed.diverging(8 * c + c // 2)
    out = mixed.mixed(prompt)
    after = mixed.counters()
    assert hits(out) == (k * c, 3 * c, k * c)  # 3C local, (k - 3)C loaded
    assert after.get("mixed_hits", 0) == before.get("mixed_hits", 0) + 1
    assert_exact(out, mixed.recompute(prompt))


@pytest.mark.vllm_layout
@needs_live
def test_a_local_prefix_inside_a_block_gives_way_to_a_deeper_snapshot(mixed: Mixed) -> None:
    c, k = mixed.chunk, mixed.k
    mixed.local_prefix(4 * c + UNIT + 10)  # vLLM keeps the prompt's tail state at 4C + UNIT
    # Probe: a prompt diverging just past 4C + UNIT, below HiState's kC, hits vLLM's own
    # cache at 4C + UNIT: the local prefix really ends inside a block.
    probe = mixed.diverging(4 * c + UNIT + 5)
    seen = mixed.engine.generate(probe, kv_transfer_params=ASK)
    assert seen["num_cached_tokens"] == 4 * c + UNIT
    before = mixed.counters()
    prompt = mixed.diverging(8 * c + c // 2)
    out = mixed.mixed(prompt)
    after = mixed.counters()
    # vLLM presents its block-aligned 4C to the connector; the load (k - 4)C exceeds the
    # sub-block tail UNIT, so vLLM drops the tail and loads [4C, kC).
    assert hits(out) == (k * c, 4 * c, k * c)
    assert after.get("mixed_hits", 0) == before.get("mixed_hits", 0) + 1
    assert_exact(out, mixed.recompute(prompt))


@pytest.mark.vllm_layout
@needs_live
def test_a_local_prefix_longer_than_the_snapshot_is_served_by_vllm(mixed: Mixed) -> None:
    c = mixed.chunk
    mixed.local_prefix(9 * c + UNIT + 10)  # local states at 9C and 9C + UNIT; server: 9C
    before = mixed.counters()
    prompt = mixed.diverging(9 * c + UNIT + 5)
    out = mixed.mixed(prompt)
    after = mixed.counters()
    # The server's deepest snapshot at or below the divergence is the local prefix's 9C
    # (its plan's final boundary); vLLM's own hit is UNIT deeper: nothing is loaded.
    assert hits(out) == (9 * c + UNIT, 9 * c, 9 * c)
    assert after.get("mixed_hits", 0) == before.get("mixed_hits", 0)
    assert after.get("external_hit_tokens", 0) == before.get("external_hit_tokens", 0)
    assert_exact(out, mixed.recompute(prompt))


@pytest.mark.vllm_layout
@needs_live
def test_a_preempted_request_resumes_exactly_from_both_caches(mixed: Mixed) -> None:
    """Two new prompts (10 chunks + 50, then 9 chunks) at once on a pool that holds one:
    vLLM preempts one when the other grows and resumes it from what survived of it in its
    own cache and what the server stored for it before the preemption. Which one is
    preempted, and how far it got, depends on when plans and stores came back (measured:
    the second resumed from local 6C with the server at 6C, or from local 3C with nothing
    stored; the first resumed from the server's 7C with nothing local), so the test asserts
    a preemption, a resume from one of the caches, and exact answers."""
    c = mixed.chunk
    mixed.engine.reset()
    before = mixed.counters()
    prompts = [mixed.tokens(10 * c + 50), mixed.tokens(9 * c)]
    outs = mixed.engine.generate_batch(prompts, max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS,
                                       kv_transfer_params=ASK)
    settle(mixed.server)
    after = mixed.counters()
    seen = [hits(out) for out in outs]
    print("\npreemption: hits", seen, "counters", {
        key: after[key] - before.get(key, 0) for key in after if after[key] != before.get(key)})
    assert after.get("preemptions_seen", 0) > before.get("preemptions_seen", 0)
    # Both prompts are new: neither found anything at its first admission (vLLM counts
    # skipped tokens at the first admission only), so a hit in a request's last lookup
    # (cached_token_stats keep the last one) is its resume after the preemption.
    assert [skipped for skipped, _, _ in seen] == [0, 0]
    assert any(local or server for _, local, server in seen), seen
    for prompt, out in zip(prompts, outs, strict=True):
        assert_exact(out, mixed.recompute(prompt))


@pytest.mark.vllm_layout
@needs_live
def test_a_zeroed_restored_state_changes_the_mixed_answer(mixed: Mixed) -> None:
    """Negative control: case (a) with the restored recurrent state zeroed by the server."""
    c, k = mixed.chunk, mixed.k
    mixed.local_prefix(3 * c + 10)
    prompt = mixed.diverging(8 * c + c // 2)
    mixed.zero_flag.touch()
    try:
        out = mixed.mixed(prompt)
    finally:
        mixed.zero_flag.unlink()
    assert hits(out) == (k * c, 3 * c, k * c)
    assert out["logprobs"] != mixed.recompute(prompt)["logprobs"], (
        "zeroed recurrent state left the mixed hit's outputs unchanged")


@needs_live
def test_a_local_prefix_off_a_two_block_chunk_grid_joins_a_deeper_state(
    mixed: Mixed, tmp_path: Path, tiny_model: Path
) -> None:
    """(e) An LMCache chunk of two blocks (stock ``lmcache server``, ``--chunk-size 2C``,
    a state at every chunk: ``histate.interval_saves`` false, steps of one chunk): vLLM's
    own 3C is off the chunk grid, so the load starts at 2C and skips ``[2C, 3C)``
    (``skip_first_n_tokens``), then writes the state at 8C."""
    from lmcache_histate.backends.demo.engine_proc import EngineProcess, engine_kwargs
    from support.lmcache_mp import lmcache_server
    from test_vllm_cpu_roundtrip import CPU_MODULE

    c = mixed.chunk
    transfer = connector_config(0)
    with lmcache_server(server_module_arg(CPU_MODULE), workdir=tmp_path / "server",
                        chunk_size=2 * c, l1_size_gb=0.1) as server:
        transfer["kv_connector_extra_config"].update(
            {"lmcache.mp.port": server.endpoints.zmq_port, "histate.interval_saves": False})
        with EngineProcess(engine_kwargs(tiny_model, chunk_tokens=c, kv_transfer_config=transfer,
                                         max_num_batched_tokens=2 * c),
                           workdir=tmp_path, name="engine", block_size=c) as engine:
            engine.generate(mixed.x, kv_transfer_params=ASK, reset=True)
            engine.generate(mixed.x[:3 * c + 10], kv_transfer_params=ASK)
            prompt = mixed.diverging(8 * c + c // 2)
            out = engine.generate(prompt, max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS,
                                  kv_transfer_params=ASK)
            counters = engine.stats()["histate"]
    # States at every 2C (one chunk per step); the local prefix X[:3C + 10] loaded 2C and
    # left vLLM the state at 3C; the mixed request loads [3C, 8C) of the range [2C, 8C).
    assert hits(out) == (8 * c, 3 * c, 8 * c)
    assert counters.get("mixed_hits") == 1  # the local prefix's own load joined nothing
    assert counters.get("external_hit_tokens") == 2 * c + 5 * c
    assert_exact(out, mixed.recompute(prompt))
