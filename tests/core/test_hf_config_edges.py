"""Config parsing at its edges: the preset builders, every key spelling, bound and message.

Each message is matched whole (anchored), so a changed word fails; the config helpers are
``test_geometry``'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_geometry import _granite, _tiny_next

from lmcache_histate.core.hf_config import from_hf_config
from lmcache_histate.core.model_geometry import GeometryError, ModelGeometry, StateTensor
from lmcache_histate.core.model_presets import _every_kth, _qwen35, load_geometry, preset


def test_preset_builders_write_the_published_qwen35_config() -> None:
    """The builders behind the Qwen3.5 presets, called directly (the preset table is built
    at import time, before a mutation tester can switch a mutant on). Expected: the
    published config.json fields, written out; every 4th of 32 layers is full attention."""
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


_SUPPORTED = ("qwen3_next, qwen3_5, qwen3_5_text, qwen3_5_moe, qwen3_5_moe_text, nemotron_h, "
              "granitemoehybrid")
_KNOWN = r"\['bfloat16', 'float16', 'float32', 'float8_e4m3fn', 'float8_e5m2'\]"


def _without(cfg: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in cfg.items() if k not in keys}


@pytest.mark.parametrize(("build", "message"), [
    (lambda: {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
     rf"unsupported architecture \(model_type='llama', architectures=\['LlamaForCausalLM'\]\); "
     rf"supported model_types: {_SUPPORTED}"),
    (lambda: {"hidden_size": 8},
     rf"unsupported architecture \(model_type=None, architectures=\[\]\); "
     rf"supported model_types: {_SUPPORTED}"),
    # Known model_type, no architectures: still GDN, so the missing key is named.
    (lambda: _without(_tiny_next(), "architectures", "linear_num_value_heads"),
     r"qwen3_next config is missing 'linear_num_value_heads'"),
    (lambda: {"model_type": "nemotron_h"},
     r"nemotron_h config: missing 'hybrid_override_pattern', 'layer_types' or "
     r"'layers_block_type'"),
    # An unknown fork with a layer pattern is read as Mamba2: its heads are then missing.
    (lambda: {"model_type": "fork", "hybrid_override_pattern": "M*", "hidden_size": 64,
              "num_attention_heads": 2, "num_key_value_heads": 1},
     r"fork config is missing 'mamba_num_heads' / 'mamba_n_heads'"),
    (lambda: _granite(hidden_size=500),
     r"granitemoehybrid config: 'hidden_size' not divisible by 'num_attention_heads' "
     r"\(give 'head_dim'\)"),
    (lambda: _granite(layer_types=["attention"] * 6),
     r"granitemoehybrid config: no recurrent layers; lmcache-histate targets hybrid "
     r"attention\+recurrent models"),
])
def test_config_errors_match_whole(build: Any, message: str) -> None:
    with pytest.raises(GeometryError, match=f"^{message}$"):
        from_hf_config(build())


def test_dtype_errors_name_what_they_size() -> None:
    def bad(what: str) -> str:
        return f"^unsupported dtype 'int4' for {what}; known: {_KNOWN}$"

    for kwargs, what in (({"kv_dtype": "int4"}, "KV cache"), ({"ssm_dtype": "int4"}, "SSM state")):
        with pytest.raises(GeometryError, match=bad(what)):
            from_hf_config(_granite(), **kwargs)
    # The model dtype sizes the conv state (the KV dtype given separately).
    with pytest.raises(GeometryError, match=bad("conv state")):
        from_hf_config(_granite(torch_dtype="int4"), kv_dtype="bfloat16")


def test_renamed_forks_are_recognised_by_their_keys() -> None:
    """Unknown model_type and architectures: GDN keys → the tiny model's geometry (4 layers,
    1 attention; conv (3, 2·4·64 + 8·64 = 1,024), SSM (8, 64, 64)); Mamba2 keys → Granite's
    (6 layers, 2 attention; conv (3, 16·64 + 2·1·128 = 1,280), SSM (16, 64, 128))."""
    gdn = from_hf_config(_tiny_next(model_type="my_fork", architectures=["MyFork"]))
    assert (gdn.num_layers, gdn.attention_layers, gdn.recurrent_kind) == (4, 1, "gated_deltanet")
    assert [t.shape for t in gdn.state_tensors] == [(3, 1024), (8, 64, 64)]
    mamba = from_hf_config(_granite(model_type="fork", architectures=["Fork"]))
    assert (mamba.num_layers, mamba.attention_layers, mamba.recurrent_kind) == (6, 2, "mamba2")
    assert [t.shape for t in mamba.state_tensors] == [(3, 1280), (16, 64, 128)]
    assert [t.name for t in mamba.state_tensors] == ["conv_state", "ssm_state"]


def test_a_wrapper_lends_its_model_type_to_a_text_config_without_one() -> None:
    """Qwen3.5's wrapper without architectures, the inner model_type removed: the outer
    "qwen3_5" names the architecture in the message about a missing key."""
    cfg = _qwen35(hidden=2560)
    del cfg["architectures"]
    del cfg["text_config"]["model_type"]
    del cfg["text_config"]["linear_key_head_dim"]
    with pytest.raises(GeometryError, match=r"^qwen3_5 config is missing 'linear_key_head_dim'$"):
        from_hf_config(cfg)


def test_model_dtype_and_head_dim_spellings() -> None:
    """KV bytes per token of the tiny model: 1 attention layer · (K, V) · 2 KV heads ·
    head_dim · dtype bytes. bf16, head_dim 64: 512. ``dtype`` = float32 (no torch_dtype):
    1,024. No dtype at all, or "auto": bf16, 512. ``attention_head_dim`` 32: 256. No head
    dim: hidden 256 / 4 heads = 64 (an int): 512."""
    base = _without(_tiny_next(), "torch_dtype")
    assert from_hf_config({**base, "dtype": "float32"}).kv_bytes_per_token == 1024
    assert from_hf_config(base).kv_bytes_per_token == 512
    assert from_hf_config({**base, "torch_dtype": "auto"}).kv_bytes_per_token == 512
    alias = {**_without(base, "head_dim"), "attention_head_dim": 32}
    assert from_hf_config(alias).kv_bytes_per_token == 256
    derived = from_hf_config(_without(base, "head_dim"))
    assert derived.head_dim == 64 and type(derived.head_dim) is int
    # A checkpoint's "auto" SSM cache dtype is the model dtype (Granite: bf16).
    auto = from_hf_config(_granite(mamba_ssm_cache_dtype="auto"))
    assert auto.state_tensors[1].dtype == "bfloat16"


@pytest.mark.parametrize(("layers", "heads", "message"), [
    ((4, 0, 3), (2, 64), "has no attention layers, so no KV to price snapshots against"),
    ((4, 1, 0), (2, 64), "has no recurrent layers; lmcache-histate targets hybrid "
                         r"attention\+recurrent models \(use plain LMCache for pure attention\)"),
    ((3, 2, 2), (2, 64), r"has more attention \+ recurrent layers than num_layers"),
    ((4, 1, 3), (0, 64), "needs positive kv heads/head_dim"),
    ((4, 1, 3), (2, 0), "needs positive kv heads/head_dim"),
])
def test_model_geometry_bounds(layers: tuple[int, int, int], heads: tuple[int, int],
                               message: str) -> None:
    st = (StateTensor("s", (2, 2), "float32"),)
    with pytest.raises(GeometryError, match=f"^m {message}$"):
        ModelGeometry("m", *layers, "mamba2", *heads, "bfloat16", st)
    # The smallest valid one: 1 attention + 1 recurrent layer, 1 KV head of 1 dim.
    assert ModelGeometry("m", 2, 1, 1, "mamba2", 1, 1, "bfloat16", st).head_dim == 1
    with pytest.raises(GeometryError, match=r"^m has recurrent layers but no state_tensors$"):
        ModelGeometry("m", 2, 1, 1, "mamba2", 1, 1, "bfloat16", ())


def test_zero_counts_and_non_object_files_are_refused(tmp_path: Path) -> None:
    # The message names the key's first spelling (Nemotron's), whichever one was given.
    with pytest.raises(GeometryError, match=(
        r"^granitemoehybrid config key 'ssm_state_size' must be a positive integer, got 0$"
    )):
        from_hf_config(_granite(mamba_d_state=0))
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    with pytest.raises(GeometryError, match=f"^{path} does not hold a JSON object$"):
        from_hf_config(path)
