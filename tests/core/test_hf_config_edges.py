"""Config parsing at its edges: the preset builders, every key spelling, bound and message.

Each message is matched whole (anchored), so a changed word fails; the config helpers are
``test_geometry``'s.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_geometry import _granite, _tiny_next

from lmcache_histate.core.geometry import GeometryError, from_hf_config, load_geometry, preset


def test_preset_builders_write_the_published_qwen35_config() -> None:
    """The builders behind the Qwen3.5 presets, called directly (the preset table is built
    at import time, before a mutation tester can switch a mutant on). Expected: the
    published config.json fields, written out; every 4th of 32 layers is full attention."""
    from lmcache_histate.core.model_presets import _every_kth, _qwen35

    lin, full = "linear_attention", "full_attention"
    assert _every_kth(8, 4) == [lin, lin, lin, full, lin, lin, lin, full]
    assert _every_kth(3, 2) == [lin, full, lin]
    text = {
        "model_type": "qwen3_5_text", "hidden_size": 2560, "num_hidden_layers": 32,
        "layer_types": [lin, lin, lin, full] * 8, "full_attention_interval": 4,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
        "dtype": "bfloat16", "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    }
    assert _qwen35(hidden=2560) == {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": text,
    }


def test_mamba2_head_dim_key_and_whole_messages() -> None:
    """Nemotron's ``mamba_head_dim`` = 32 is read, not derived (2·512/16 would be 64): SSM
    (16, 32, 128), conv (3, 16·32 + 2·1·128 = 768). Messages match whole."""
    cfg = _granite()
    del cfg["mamba_d_head"]
    cfg["mamba_head_dim"] = 32
    assert [t.shape for t in from_hf_config(cfg).state_tensors] == [(3, 768), (16, 32, 128)]
    with pytest.raises(GeometryError, match=(
        r"^granitemoehybrid config: 'conv_kernel' must be >= 2 "
        r"\(the state keeps kernel-1 columns\)$"
    )):
        from_hf_config(_granite(mamba_d_conv=1))
    with pytest.raises(GeometryError, match=(
        r"^granitemoehybrid config: mamba_expand \* hidden_size not divisible by mamba heads$"
    )):
        from_hf_config(_granite(mamba_d_head="auto", mamba_n_heads=48))


def test_mamba_layer_messages_match_whole() -> None:
    no_layout = _granite()
    del no_layout["layer_types"]
    with pytest.raises(GeometryError, match=(
        r"^granitemoehybrid config: missing 'hybrid_override_pattern', 'layer_types' "
        r"or 'layers_block_type'$"
    )):
        from_hf_config(no_layout)
    # "M-*M-EM*" lists 8 layers; 9 declared.
    cfg = _granite()
    del cfg["layer_types"]
    cfg.update(model_type="nemotron_h", hybrid_override_pattern="M-*M-EM*", num_hidden_layers=9)
    with pytest.raises(GeometryError, match=(
        r"^nemotron_h config: layer pattern has 8 entries but 'num_hidden_layers' is 9$"
    )):
        from_hf_config(cfg)


def test_load_geometry_passes_the_dtypes_on_and_lists_presets_whole(tmp_path: Path) -> None:
    """Overrides reach the parser from a preset name and from a config path. The tiny
    model: 1 full-attention layer · (K, V) · 2 KV heads · 64 dims · 1 B (fp8) = 256 B per
    token; Qwen3.5-9B with fp8 KV 16,384 B/token and a bf16 state 26,345,472 B
    (``test_qwen35_9b_bf16_ssm_override``)."""
    g = load_geometry("qwen3.5-9b", kv_dtype="fp8", ssm_dtype="bfloat16")
    assert (g.kv_bytes_per_token, g.snapshot_bytes) == (16_384, 26_345_472)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_tiny_next()))
    tiny = load_geometry(str(path), kv_dtype="fp8", ssm_dtype="bfloat16")
    assert tiny.kv_bytes_per_token == 256
    assert {t.dtype for t in tiny.state_tensors} == {"bfloat16"}
    names = "qwen3.5-9b, qwen3.5-4b, qwen3-next-80b-a3b, nemotron-h-8b, tiny-qwen3-next"
    with pytest.raises(GeometryError, match=f"^unknown model preset 'llama'; available: {names}$"):
        preset("llama")
    with pytest.raises(GeometryError, match=(
        f"^'no/such' is neither a model preset nor an existing config path; presets: {names}$"
    )):
        load_geometry("no/such")


def test_gdn_layer_counts_kernel_bound_and_whole_messages() -> None:
    """The tiny model (4 layers listed) by its other spellings. Every 4th of 7 layers by
    ``full_attention_interval``: layer 4 only → (7, 1, 6). Kernel 2 keeps one conv column:
    (1, 2·4·64 + 8·64 = 1,024)."""
    cfg = _tiny_next()
    del cfg["layer_types"]
    cfg.update(full_attention_interval=4, num_hidden_layers=7)
    g = from_hf_config(cfg)
    assert (g.num_layers, g.attention_layers, g.recurrent_layers) == (7, 1, 6)
    two = from_hf_config(_tiny_next(linear_conv_kernel_dim=2))
    assert two.state_tensors[0].shape == (1, 1024)
    for overrides, message in (
        ({"num_hidden_layers": 5}, "'layer_types' has 4 entries but 'num_hidden_layers' is 5"),
        ({"linear_conv_kernel_dim": 1},
         r"'linear_conv_kernel_dim' must be >= 2 \(the state keeps kernel-1 columns\)"),
    ):
        with pytest.raises(GeometryError, match=f"^qwen3_next config: {message}$"):
            from_hf_config(_tiny_next(**overrides))
    del cfg["full_attention_interval"]
    with pytest.raises(GeometryError, match=(
        r"^qwen3_next config: missing 'layer_types' or 'full_attention_interval'$"
    )):
        from_hf_config(cfg)
