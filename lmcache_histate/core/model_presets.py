"""Named model presets: hand-transcribed config dicts, and resolving a model spec.

A preset is the geometry-relevant part of a published ``config.json``, kept as a dict and
turned into a ``ModelGeometry`` by ``hf_config.from_hf_config``, so the parser itself is
exercised by every preset lookup (no second, hand-computed source of sizes). Names are
matched case-insensitively. ``load_geometry`` resolves what a config file or CLI flag
gives: a preset name first, else a path to a config.json (or a directory holding one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .hf_config import from_hf_config
from .model_geometry import GeometryError, ModelGeometry

__all__ = ["PRESET_CONFIGS", "load_geometry", "preset", "preset_names"]


def _every_kth(n: int, k: int) -> list[str]:
    return ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(n)]


# Transcribed config data reads best packed, hence no formatter here.
# fmt: off
# GDN block shared by Qwen3.5-9B/4B and Qwen3-Next-80B-A3B (same published values).
_QWEN_GDN = dict(
    linear_num_key_heads=16, linear_num_value_heads=32,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
)


def _qwen35(hidden: int) -> dict[str, Any]:
    """Qwen3.5 dense checkpoints: multimodal wrapper with the LM under text_config."""
    text = dict(
        model_type="qwen3_5_text", hidden_size=hidden, num_hidden_layers=32,
        layer_types=_every_kth(32, 4), full_attention_interval=4, num_attention_heads=16,
        num_key_value_heads=4, head_dim=256, dtype="bfloat16", **_QWEN_GDN,
    )
    return dict(
        architectures=["Qwen3_5ForConditionalGeneration"], model_type="qwen3_5", text_config=text
    )


# Geometry-relevant fields transcribed from the published config.json files.
PRESET_CONFIGS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3.5-9B.
    "qwen3.5-9b": _qwen35(hidden=4096),
    # Qwen/Qwen3.5-4B, transcribed from memory (not re-checked offline): hidden_size
    # 2560; layer layout, attention heads and the GDN block as in 9B. Only hidden_size
    # differs, and hidden_size does not enter KV or state sizes.
    "qwen3.5-4b": _qwen35(hidden=2560),
    # Qwen/Qwen3-Next-80B-A3B-Instruct (layer kinds via full_attention_interval only).
    "qwen3-next-80b-a3b": dict(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", hidden_size=2048,
        num_hidden_layers=48, full_attention_interval=4, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, torch_dtype="bfloat16", **_QWEN_GDN,
    ),
    # nvidia/Nemotron-H-8B-Base-8K: 52 layers = 24 Mamba2 + 4 attention + 24 MLP.
    "nemotron-h-8b": dict(
        architectures=["NemotronHForCausalLM"], model_type="nemotron_h", hidden_size=4096,
        num_hidden_layers=52,
        hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, mamba_num_heads=128,
        mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, expand=2,
        torch_dtype="bfloat16",
    ),
    # The CPU test model the live tests generate (docs/design.md §5.3): keep the two in sync.
    "tiny-qwen3-next": dict(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", hidden_size=256,
        num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, torch_dtype="bfloat16",
    ),
}
# fmt: on


def preset_names() -> tuple[str, ...]:
    return tuple(PRESET_CONFIGS)


def preset(name: str, **dtypes: str | None) -> ModelGeometry:
    """Geometry of a named model (case-insensitive); ``dtypes`` as in :func:`from_hf_config`."""
    key = name.strip().lower()
    if key not in PRESET_CONFIGS:
        raise GeometryError(
            f"unknown model preset {name!r}; available: {', '.join(preset_names())}"
        )
    return from_hf_config(PRESET_CONFIGS[key], name=key, **dtypes)


def load_geometry(
    spec: str, *, kv_dtype: str | None = None, ssm_dtype: str | None = None
) -> ModelGeometry:
    """A preset name, or a path to a config.json (or a directory holding one).

    ``kv_dtype`` / ``ssm_dtype`` replace the engine defaults the HF config implies, for a
    deployment whose engine resolved other dtypes (vLLM on CPU without AVX-512-BF16 keeps a
    GatedDeltaNet state in bfloat16, not float32).
    """
    if spec.strip().lower() in PRESET_CONFIGS:
        return preset(spec, kv_dtype=kv_dtype, ssm_dtype=ssm_dtype)
    path = Path(spec)
    if path.exists():
        return from_hf_config(path, kv_dtype=kv_dtype, ssm_dtype=ssm_dtype)
    raise GeometryError(
        f"{spec!r} is neither a model preset nor an existing config path; "
        f"presets: {', '.join(preset_names())}"
    )
