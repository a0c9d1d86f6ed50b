"""Geometry: exact byte numbers the policy prices with (docs/design.md §1) and config parsing."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from lmcache_histate.core.hf_config import from_hf_config
from lmcache_histate.core.model_geometry import GeometryError, ModelGeometry, StateTensor
from lmcache_histate.core.model_presets import PRESET_CONFIGS, load_geometry, preset, preset_names


def _tiny_next(**overrides: Any) -> dict[str, Any]:
    """The CPU test model's config (docs/design.md §5.3), exactly as the live tests generate it."""
    from lmcache_histate.backends.demo.tiny_model import tiny_config

    return tiny_config(**overrides)


def _granite(**overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "model_type": "granitemoehybrid",
        "hidden_size": 512,
        "num_hidden_layers": 6,
        "layer_types": ["mamba", "mamba", "attention", "mamba", "mamba", "attention"],
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "mamba_n_heads": 16,
        "mamba_d_head": 64,
        "mamba_d_state": 128,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "torch_dtype": "bfloat16",
    }
    cfg.update(overrides)
    return cfg


# ---------------------------------------------------------------- exact numbers


def test_qwen35_9b_exact_numbers() -> None:
    g = preset("qwen3.5-9b")
    assert (g.num_layers, g.attention_layers, g.recurrent_layers) == (32, 8, 24)
    assert g.recurrent_kind == "gated_deltanet"
    assert (g.num_kv_heads, g.head_dim, g.kv_dtype) == (4, 256, "bfloat16")
    conv, ssm = g.state_tensors
    assert (conv.shape, conv.dtype) == ((3, 8192), "bfloat16")
    assert (ssm.shape, ssm.dtype) == ((32, 128, 128), "float32")
    assert conv.nbytes + ssm.nbytes == 2_146_304
    assert g.kv_bytes_per_token == 32_768
    assert g.snapshot_bytes == 51_511_296 == 24 * 2_146_304
    assert round(g.snapshot_tokens) == 1572
    assert g.kv_bytes(1024) == 1024 * 32_768
    assert g.kv_bytes(0) == 0
    with pytest.raises(ValueError):
        g.kv_bytes(-1)


def test_qwen35_9b_bf16_ssm_override() -> None:
    # The override goes through the same parser (and transcribed config) as the preset.
    base = preset("qwen3.5-9b")
    g = from_hf_config(PRESET_CONFIGS["qwen3.5-9b"], ssm_dtype="bfloat16")
    assert g.snapshot_bytes == 26_345_472
    assert g.kv_bytes_per_token == base.kv_bytes_per_token
    assert g.state_tensors[1].dtype == "bfloat16"
    g8 = from_hf_config(PRESET_CONFIGS["qwen3.5-9b"], kv_dtype="fp8")
    assert g8.kv_bytes_per_token == 16_384


def test_qwen35_4b_and_qwen3_next() -> None:
    g4 = preset("qwen3.5-4b")
    assert (g4.num_layers, g4.attention_layers, g4.recurrent_layers) == (32, 8, 24)
    assert g4.recurrent_kind == "gated_deltanet"
    nxt = preset("qwen3-next-80b-a3b")
    assert (nxt.num_layers, nxt.attention_layers, nxt.recurrent_layers) == (48, 12, 36)
    assert (nxt.num_kv_heads, nxt.head_dim) == (2, 256)
    assert nxt.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2 == 24_576
    assert nxt.snapshot_bytes == 36 * 2_146_304


def test_nemotron_h_8b() -> None:
    g = preset("nemotron-h-8b")
    assert g.recurrent_kind == "mamba2"
    assert (g.num_layers, g.attention_layers, g.recurrent_layers) == (52, 4, 24)
    conv, ssm = g.state_tensors
    assert conv.shape == (3, 128 * 64 + 2 * 8 * 128) == (3, 10240)
    assert ssm.shape == (128, 64, 128)
    assert g.kv_bytes_per_token == 4 * 2 * 8 * 128 * 2 == 16_384
    assert g.snapshot_bytes == 24 * (3 * 10240 * 2 + 128 * 64 * 128 * 2)


def test_tiny_preset_matches_live_test_config() -> None:
    g = preset("tiny-qwen3-next")
    assert g == from_hf_config(_tiny_next(), name="tiny-qwen3-next")
    assert (g.num_layers, g.attention_layers, g.recurrent_layers) == (4, 1, 3)
    assert g.state_tensors[0].shape == (3, 2 * 4 * 64 + 8 * 64)
    assert g.state_tensors[1].shape == (8, 64, 64)
    assert g.snapshot_bytes == 411_648  # what vLLM allocates for the generated model
    assert g.kv_bytes_per_token == 1 * 2 * 2 * 64 * 2


# ---------------------------------------------------------------- parsing


@pytest.mark.parametrize("n,k,full", [(32, 4, 8), (48, 4, 12), (10, 4, 2), (6, 3, 2), (5, 1, 5)])
def test_full_attention_interval_matches_layer_types(n: int, k: int, full: int) -> None:
    by_interval = _tiny_next(num_hidden_layers=n, full_attention_interval=k)
    del by_interval["layer_types"]
    if full == n:  # every layer attention: not a hybrid
        with pytest.raises(GeometryError, match="no recurrent layers"):
            from_hf_config(by_interval)
        return
    g = from_hf_config(by_interval)
    assert (g.num_layers, g.attention_layers, g.recurrent_layers) == (n, full, n - full)
    types = ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(n)]
    explicit = from_hf_config(_tiny_next(num_hidden_layers=n, layer_types=types))
    assert explicit == g


def test_layer_types_take_precedence_and_must_match_count() -> None:
    g = from_hf_config(_tiny_next(full_attention_interval=2))  # layer_types wins
    assert (g.attention_layers, g.recurrent_layers) == (1, 3)
    with pytest.raises(GeometryError, match="num_hidden_layers"):
        from_hf_config(_tiny_next(num_hidden_layers=5))
    with pytest.raises(GeometryError, match="sliding_attention"):
        from_hf_config(_tiny_next(layer_types=["sliding_attention"] * 4))


def test_nested_text_config_uses_outer_dtype() -> None:
    inner = _tiny_next()
    del inner["torch_dtype"], inner["architectures"]
    inner["model_type"] = "qwen3_5_text"
    outer = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "torch_dtype": "float16",
        "vision_config": {"hidden_size": 1152},
        "text_config": inner,
    }
    g = from_hf_config(outer)
    assert g.name == "Qwen3_5ForConditionalGeneration"
    assert (g.attention_layers, g.recurrent_layers) == (1, 3)
    assert g.kv_dtype == "float16"
    assert g.state_tensors[0].dtype == "float16"
    assert g.state_tensors[1].dtype == "float32"


def test_load_from_path_file_and_dir(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_tiny_next(_name_or_path="my/tiny")))
    from_file = from_hf_config(tmp_path / "config.json")
    from_dir = from_hf_config(str(tmp_path))
    assert from_file == from_dir
    assert from_file.name == "my/tiny"
    assert load_geometry(str(tmp_path)) == from_dir
    assert from_hf_config(tmp_path, name="x").name == "x"
    with pytest.raises(GeometryError, match=r"config\.json"):
        from_hf_config(tmp_path / "missing")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(GeometryError, match="cannot read"):
        from_hf_config(tmp_path / "bad.json")


def test_mamba2_pattern_parsing() -> None:
    cfg = copy.deepcopy(_granite())
    del cfg["layer_types"]
    cfg.update(model_type="nemotron_h", hybrid_override_pattern="M-*M-EM*", num_hidden_layers=8)
    g = from_hf_config(cfg)
    assert (g.num_layers, g.attention_layers, g.recurrent_layers) == (8, 2, 3)
    with pytest.raises(GeometryError, match="'X'"):
        from_hf_config({**cfg, "hybrid_override_pattern": "MX*M-M-M"})
    with pytest.raises(GeometryError, match="num_hidden_layers"):
        from_hf_config({**cfg, "num_hidden_layers": 9})


def test_granite_layer_types_and_auto_head_dim() -> None:
    g = from_hf_config(_granite())
    assert g.recurrent_kind == "mamba2"
    assert (g.num_layers, g.attention_layers, g.recurrent_layers) == (6, 2, 4)
    assert g.head_dim == 512 // 8  # derived: no head_dim in Granite configs
    assert g.state_tensors[0].shape == (3, 16 * 64 + 2 * 1 * 128)
    assert g.state_tensors[1].shape == (16, 64, 128)
    auto = from_hf_config(_granite(mamba_d_head="auto"))  # expand*hidden/heads = 64
    assert auto == g
    old = _granite()
    old["layers_block_type"] = old.pop("layer_types")
    assert from_hf_config(old) == g


def test_ssm_dtype_pinned_by_checkpoint_or_override() -> None:
    assert from_hf_config(_granite()).state_tensors[1].dtype == "bfloat16"
    pinned = from_hf_config(_granite(mamba_ssm_cache_dtype="float32"))
    assert pinned.state_tensors[1].dtype == "float32"
    forced = from_hf_config(_granite(mamba_ssm_cache_dtype="float32"), ssm_dtype="bf16")
    assert forced.state_tensors[1].dtype == "bfloat16"
    with pytest.raises(GeometryError, match="int4"):
        from_hf_config(_granite(), ssm_dtype="int4")


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "key",
    [
        "linear_num_value_heads",
        "linear_num_key_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
        "num_key_value_heads",
    ],
)
def test_missing_gdn_key_is_named(key: str) -> None:
    cfg = _tiny_next()
    del cfg[key]
    with pytest.raises(GeometryError, match=f"qwen3_next config is missing '{key}'"):
        from_hf_config(cfg)


@pytest.mark.parametrize(
    "key", ["mamba_n_heads", "mamba_d_state", "mamba_n_groups", "mamba_d_conv"]
)
def test_missing_mamba_key_is_named(key: str) -> None:
    cfg = _granite()
    del cfg[key]
    with pytest.raises(GeometryError, match=key) as info:
        from_hf_config(cfg)
    assert "granitemoehybrid" in str(info.value)


def test_missing_layer_layout_and_bad_values() -> None:
    cfg = _tiny_next()
    del cfg["layer_types"]
    with pytest.raises(GeometryError, match="full_attention_interval"):
        from_hf_config(cfg)
    with pytest.raises(GeometryError, match="linear_num_value_heads"):
        from_hf_config(_tiny_next(linear_num_value_heads="8"))
    with pytest.raises(GeometryError, match="linear_conv_kernel_dim"):
        from_hf_config(_tiny_next(linear_conv_kernel_dim=1))


def test_unknown_architecture_lists_supported() -> None:
    llama = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8}
    with pytest.raises(GeometryError, match="llama") as info:
        from_hf_config(llama)
    for supported in ("qwen3_next", "qwen3_5", "nemotron_h", "granitemoehybrid"):
        assert supported in str(info.value)


def test_non_hybrid_is_rejected() -> None:
    with pytest.raises(GeometryError, match="no recurrent layers") as info:
        from_hf_config(_tiny_next(layer_types=["full_attention"] * 4))
    assert "qwen3_next" in str(info.value)
    with pytest.raises(GeometryError, match="no attention layers"):
        from_hf_config(_tiny_next(layer_types=["linear_attention"] * 4))
    with pytest.raises(GeometryError, match="no recurrent layers"):
        from_hf_config(_granite(layer_types=["attention"] * 6))


def test_dataclass_validation() -> None:
    st = (StateTensor("conv_state", (3, 8), "bfloat16"),)
    ok = ModelGeometry("m", 4, 1, 3, "mamba2", 2, 64, "bfloat16", st)
    assert ok.snapshot_bytes == 3 * 3 * 8 * 2
    with pytest.raises(GeometryError, match="num_layers"):
        ModelGeometry("m", 3, 1, 3, "mamba2", 2, 64, "bfloat16", st)
    with pytest.raises(GeometryError, match="recurrent_kind"):
        ModelGeometry("m", 4, 1, 3, "rwkv", 2, 64, "bfloat16", st)
    with pytest.raises(GeometryError, match="dtype"):
        StateTensor("s", (1,), "int8")
    with pytest.raises(GeometryError, match="shape"):
        StateTensor("s", (0, 4), "float32")


# ---------------------------------------------------------------- presets


def test_preset_lookup_case_insensitive() -> None:
    assert preset("Qwen3.5-9B") == preset("qwen3.5-9b")
    assert load_geometry("  NEMOTRON-H-8B ") == preset("nemotron-h-8b")
    assert set(preset_names()) >= {
        "qwen3.5-9b",
        "qwen3.5-4b",
        "qwen3-next-80b-a3b",
        "nemotron-h-8b",
        "tiny-qwen3-next",
    }
    for name in preset_names():
        assert preset(name).name == name


def test_unknown_preset_lists_names() -> None:
    with pytest.raises(GeometryError) as info:
        preset("llama-3-8b")
    for name in preset_names():
        assert name in str(info.value)
    with pytest.raises(GeometryError, match=r"qwen3\.5-9b"):
        load_geometry("no/such/path")



def test_mamba2_key_aliases_bounds_and_messages() -> None:
    """Nemotron's key names give Granite's geometry; every bound and message by hand."""
    base = from_hf_config(_granite())
    nemo = _granite()
    for old, new in (("mamba_n_heads", "mamba_num_heads"), ("mamba_d_head", "mamba_head_dim"),
                     ("mamba_d_state", "ssm_state_size"), ("mamba_n_groups", "n_groups"),
                     ("mamba_d_conv", "conv_kernel"), ("mamba_expand", "expand")):
        nemo[new] = nemo.pop(old)
    assert from_hf_config(nemo) == base
    # "auto" or absent head dim: expand·hidden/heads = 2·512/16 = 64, an int.
    for head in ("auto", None):
        cfg = {k: v for k, v in nemo.items() if k != "mamba_head_dim"}
        if head is not None:
            cfg["mamba_head_dim"] = head
        derived = from_hf_config(cfg)
        assert derived == base
        assert all(type(x) is int for t in derived.state_tensors for x in t.shape)
    # The smallest kernel, 2, keeps one conv column: (1, 16·64 + 2·1·128 = 1,280).
    assert from_hf_config(_granite(mamba_d_conv=2)).state_tensors[0].shape == (1, 1280)
    with pytest.raises(GeometryError, match=r"'conv_kernel' must be >= 2 \(the state keeps"):
        from_hf_config(_granite(mamba_d_conv=1))
    # Head dim 1 is valid: SSM (16, 1, 128), conv (3, 16 + 256 = 272).
    one = from_hf_config(_granite(mamba_d_head=1))
    assert [t.shape for t in one.state_tensors] == [(3, 272), (16, 1, 128)]
    for bad in (0, -64, True, "64", 6.5):
        with pytest.raises(GeometryError, match="'mamba_head_dim' must be a positive integer"):
            from_hf_config(_granite(mamba_d_head=bad))
    # auto with expand·hidden = 1,024 not divisible by 48 heads (1,024 = 21·48 + 16).
    with pytest.raises(GeometryError, match=r"mamba_expand \* hidden_size not divisible"):
        from_hf_config(_granite(mamba_d_head="auto", mamba_n_heads=48))
    no_layout = _granite()
    del no_layout["layer_types"]
    with pytest.raises(GeometryError, match="missing 'hybrid_override_pattern', 'layer_types' "
                                            "or 'layers_block_type'"):
        from_hf_config(no_layout)
    with pytest.raises(GeometryError, match=r"unknown layer types \['conv'\]"):
        from_hf_config(_granite(layer_types=["mamba", "conv", "attention"], num_hidden_layers=3))
    with pytest.raises(ValueError, match="tokens must be >= 0, got -1"):
        base.kv_bytes(-1)
