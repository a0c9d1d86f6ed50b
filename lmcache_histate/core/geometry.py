"""Byte geometry of hybrid (attention + recurrent) models.

The HiState policy prices everything in bytes and in "KV-token units": a hit
reads all KV of a prefix but only ONE recurrent-state snapshot, so the interval
controller needs N_s = snapshot bytes / KV bytes per token (docs/design.md §2.2), and
eviction needs the bytes each item frees (§2.3). This module derives those
numbers from a Hugging Face ``config.json`` so the simulator and the live
backend use the same figures the engine would allocate (docs/design.md §1, §5.2).

Pure: no torch/vllm/lmcache imports, no network. Presets are hand-transcribed
config dicts that go through :func:`from_hf_config`, so the parser itself is
exercised by every preset lookup.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .defaults import snapshot_tokens

__all__ = [
    "DTYPE_BYTES",
    "GeometryError",
    "ModelGeometry",
    "StateTensor",
    "from_hf_config",
    "load_geometry",
    "preset",
    "preset_names",
]


class GeometryError(ValueError):
    """A config cannot be turned into a hybrid-model geometry (message names the key)."""


# fp8 is accepted for KV only in practice (vLLM's kv_cache_dtype), but one table keeps it simple.
DTYPE_BYTES: Mapping[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
_DTYPE_ALIASES: Mapping[str, str] = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def _norm_dtype(value: Any, what: str) -> str:
    """Normalise "torch.bfloat16"/"bf16"/... to a DTYPE_BYTES key, or raise naming `what`."""
    text = str(value).strip().lower().removeprefix("torch.")
    text = _DTYPE_ALIASES.get(text, text)
    if text not in DTYPE_BYTES:
        raise GeometryError(f"unsupported dtype {value!r} for {what}; known: {sorted(DTYPE_BYTES)}")
    return text


@dataclass(frozen=True, slots=True)
class StateTensor:
    """One per-layer recurrent state buffer (e.g. conv state or SSM state)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise GeometryError(f"state tensor {self.name!r}: unsupported dtype {self.dtype!r}")
        if not self.shape or any(int(d) <= 0 for d in self.shape):
            raise GeometryError(f"state tensor {self.name!r}: invalid shape {self.shape!r}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class ModelGeometry:
    """Per-token KV cost and per-snapshot recurrent-state cost of a hybrid model."""

    name: str
    num_layers: int
    attention_layers: int
    recurrent_layers: int
    recurrent_kind: str  # "gated_deltanet" | "mamba2"
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    state_tensors: tuple[StateTensor, ...]  # per recurrent layer

    def __post_init__(self) -> None:
        # Both kinds must be present: with no attention N_s is undefined, with no
        # recurrent layers there is nothing for HiState to snapshot.
        problems = [
            (
                self.recurrent_layers <= 0,
                "has no recurrent layers; lmcache-histate targets "
                "hybrid attention+recurrent models (use plain LMCache for pure attention)",
            ),
            (
                self.attention_layers <= 0,
                "has no attention layers, so no KV to price snapshots against",
            ),
            (
                self.attention_layers + self.recurrent_layers > self.num_layers,
                "has more attention + recurrent layers than num_layers",
            ),
            (
                self.recurrent_kind not in ("gated_deltanet", "mamba2"),
                f"has unknown recurrent_kind {self.recurrent_kind!r}",
            ),
            (self.num_kv_heads <= 0 or self.head_dim <= 0, "needs positive kv heads/head_dim"),
            (self.kv_dtype not in DTYPE_BYTES, f"has unsupported kv_dtype {self.kv_dtype!r}"),
            (not self.state_tensors, "has recurrent layers but no state_tensors"),
        ]
        for bad, message in problems:
            if bad:
                raise GeometryError(f"{self.name} {message}")

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every attention layer for one token."""
        return (
            self.attention_layers
            * 2
            * self.num_kv_heads
            * self.head_dim
            * DTYPE_BYTES[self.kv_dtype]
        )

    @property
    def snapshot_bytes(self) -> int:
        """One snapshot = the states of every recurrent layer at one position."""
        return self.recurrent_layers * sum(t.nbytes for t in self.state_tensors)

    @property
    def snapshot_tokens(self) -> float:
        """N_s of the paper: snapshot size in KV-token units."""
        return snapshot_tokens(self.snapshot_bytes, self.kv_bytes_per_token)

    def kv_bytes(self, tokens: int) -> int:
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        return tokens * self.kv_bytes_per_token


# ---------------------------------------------------------------- HF config parsing

_GDN_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
_MAMBA2_MODEL_TYPES = ("nemotron_h", "granitemoehybrid")
_GDN_ARCH_PREFIXES = ("Qwen3Next", "Qwen3_5")
_MAMBA2_ARCH_PREFIXES = ("NemotronH", "GraniteMoeHybrid")
SUPPORTED_MODEL_TYPES: tuple[str, ...] = _GDN_MODEL_TYPES + _MAMBA2_MODEL_TYPES


class _Cfg:
    """Config view whose lookups raise GeometryError naming the key and architecture."""

    def __init__(self, data: Mapping[str, Any], arch: str) -> None:
        self.data = data
        self.arch = arch

    def get(self, *keys: str, default: Any = None) -> Any:
        for key in keys:
            if self.data.get(key) is not None:
                return self.data[key]
        return default

    def need(self, *keys: str) -> Any:
        value = self.get(*keys)
        if value is None:
            names = " / ".join(repr(k) for k in keys)
            raise GeometryError(f"{self.arch} config is missing {names}")
        return value

    def need_int(self, *keys: str) -> int:
        value = self.need(*keys)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise GeometryError(
                f"{self.arch} config key {keys[0]!r} must be a positive integer, got {value!r}"
            )
        return value

    def error(self, message: str) -> GeometryError:
        return GeometryError(f"{self.arch} config: {message}")


def _read_config(source: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise GeometryError(f"no config.json at {path}")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise GeometryError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise GeometryError(f"{path} does not hold a JSON object")
    return data


def _flatten(outer: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs (Qwen3.5) keep the LM under ``text_config``: use it, but let
    top-level fields such as ``torch_dtype``/``architectures`` fill what it lacks."""
    inner = outer.get("text_config")
    if not isinstance(inner, Mapping):
        return outer
    merged = {k: v for k, v in outer.items() if k != "text_config"}
    merged.update({k: v for k, v in inner.items() if v is not None})
    # The outer model_type ("qwen3_5") is as informative as the inner one.
    merged.setdefault("model_type", outer.get("model_type"))
    return merged


def _family(cfg: dict[str, Any]) -> str:
    model_type = str(cfg.get("model_type") or "")
    archs = [str(a) for a in cfg.get("architectures") or ()]
    if model_type in _GDN_MODEL_TYPES or any(a.startswith(_GDN_ARCH_PREFIXES) for a in archs):
        return "gated_deltanet"
    if model_type in _MAMBA2_MODEL_TYPES or any(a.startswith(_MAMBA2_ARCH_PREFIXES) for a in archs):
        return "mamba2"
    # Unknown names but recognisable layer-type fields (e.g. a renamed fork).
    if "linear_num_value_heads" in cfg:
        return "gated_deltanet"
    if "hybrid_override_pattern" in cfg or any(k.startswith("mamba_") for k in cfg):
        return "mamba2"
    raise GeometryError(
        f"unsupported architecture (model_type={model_type or None!r}, architectures={archs}); "
        f"supported model_types: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )


# (conv state shape, SSM state shape, engine-default SSM dtype) of one recurrent layer.
_Recurrent = tuple[tuple[int, int], tuple[int, int, int], Any]


def _dtype_or(override: str | None, what: str, fallback: Any) -> str:
    return _norm_dtype(override if override is not None else fallback, what)


def _model_dtype(cfg: _Cfg) -> Any:
    dtype = cfg.get("torch_dtype", "dtype", default="bfloat16")
    return "bfloat16" if str(dtype) == "auto" else dtype


def _gdn_layers(cfg: _Cfg) -> tuple[int, int, int]:
    """(num_layers, attention, recurrent) from layer_types or full_attention_interval."""
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        unknown = sorted({t for t in layer_types} - {"linear_attention", "full_attention"})
        if unknown:
            raise cfg.error(f"unknown 'layer_types' entries {unknown}")
        n = len(layer_types)
        declared = cfg.get("num_hidden_layers")
        if declared is not None and declared != n:
            raise cfg.error(f"'layer_types' has {n} entries but 'num_hidden_layers' is {declared}")
        full = sum(t == "full_attention" for t in layer_types)
        return n, full, n - full
    n = cfg.need_int("num_hidden_layers")
    if cfg.get("full_attention_interval") is None:
        raise cfg.error("missing 'layer_types' or 'full_attention_interval'")
    k = cfg.need_int("full_attention_interval")
    full = sum((i + 1) % k == 0 for i in range(n))  # 1-based: every k-th layer
    return n, full, n - full


def _parse_gdn(cfg: _Cfg) -> _Recurrent:
    nk = cfg.need_int("linear_num_key_heads")
    nv = cfg.need_int("linear_num_value_heads")
    dk = cfg.need_int("linear_key_head_dim")
    dv = cfg.need_int("linear_value_head_dim")
    kernel = cfg.need_int("linear_conv_kernel_dim")
    if kernel < 2:
        raise cfg.error("'linear_conv_kernel_dim' must be >= 2 (the state keeps kernel-1 columns)")
    # Conv runs over q, k and v concatenated; vLLM keeps the recurrent state in
    # fp32 for GDN unless the deployment says otherwise.
    conv = (kernel - 1, 2 * nk * dk + nv * dv)
    return conv, (nv, dk, dv), "float32"


def _head_dim(cfg: _Cfg) -> int:
    if cfg.get("head_dim", "attention_head_dim") is not None:
        return cfg.need_int("head_dim", "attention_head_dim")
    hidden = cfg.need_int("hidden_size")
    heads = cfg.need_int("num_attention_heads")
    if hidden % heads:
        raise cfg.error("'hidden_size' not divisible by 'num_attention_heads' (give 'head_dim')")
    return hidden // heads


_PATTERN_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_BLOCK_KINDS = ("mamba", "attention", "mlp", "moe")


def _mamba_layers(cfg: _Cfg) -> tuple[int, int, int]:
    pattern = cfg.get("hybrid_override_pattern")
    if pattern is not None:
        bad = sorted(set(pattern) - set(_PATTERN_KINDS))
        if bad:
            raise cfg.error(f"unknown 'hybrid_override_pattern' symbols {bad}")
        kinds = [_PATTERN_KINDS[c] for c in pattern]
    else:
        raw = cfg.get("layer_types", "layers_block_type")
        if raw is None:
            raise cfg.error(
                "missing 'hybrid_override_pattern', 'layer_types' or 'layers_block_type'"
            )
        kinds = [str(t) for t in raw]
        bad = sorted(set(kinds) - set(_BLOCK_KINDS))
        if bad:
            raise cfg.error(f"unknown layer types {bad}")
    n = len(kinds)
    declared = cfg.get("num_hidden_layers")
    if declared is not None and declared != n:
        raise cfg.error(f"layer pattern has {n} entries but 'num_hidden_layers' is {declared}")
    return n, kinds.count("attention"), kinds.count("mamba")


def _parse_mamba2(cfg: _Cfg) -> _Recurrent:
    heads = cfg.need_int("mamba_num_heads", "mamba_n_heads")
    head_dim = cfg.get("mamba_head_dim", "mamba_d_head")
    if head_dim is None or head_dim == "auto":
        # Granite's "auto": d_head = expand * hidden / heads.
        expand = cfg.need_int("mamba_expand", "expand")
        inner = expand * cfg.need_int("hidden_size")
        if inner % heads:
            raise cfg.error("mamba_expand * hidden_size not divisible by mamba heads")
        head_dim = inner // heads
    elif isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise cfg.error(f"'mamba_head_dim' must be a positive integer, got {head_dim!r}")
    d_state = cfg.need_int("ssm_state_size", "mamba_d_state")
    groups = cfg.need_int("n_groups", "mamba_n_groups")
    d_conv = cfg.need_int("conv_kernel", "mamba_d_conv")
    if d_conv < 2:
        raise cfg.error("'conv_kernel' must be >= 2 (the state keeps kernel-1 columns)")
    # Conv runs over x, B and C; vLLM's "auto" SSM cache dtype is the model dtype here.
    conv = (d_conv - 1, heads * head_dim + 2 * groups * d_state)
    return conv, (heads, head_dim, d_state), _model_dtype(cfg)


def from_hf_config(
    config: Mapping[str, Any] | str | os.PathLike[str],
    *,
    name: str | None = None,
    kv_dtype: str | None = None,
    ssm_dtype: str | None = None,
) -> ModelGeometry:
    """Build a geometry from a HF config dict, a config.json path, or its directory.

    ``kv_dtype``/``ssm_dtype`` override the engine defaults (KV = model dtype,
    SSM = fp32 for GatedDeltaNet, model dtype for Mamba2) to match a deployment's
    ``--kv-cache-dtype`` / ``--mamba-ssm-cache-dtype``.
    """
    flat = _flatten(_read_config(config))
    family = _family(flat)
    cfg = _Cfg(flat, str(flat.get("model_type") or family))
    gdn = family == "gated_deltanet"
    # Layers first: a non-hybrid config should hear that, not about missing state keys.
    n, attn, rec = _gdn_layers(cfg) if gdn else _mamba_layers(cfg)
    if rec == 0:
        raise cfg.error(
            "no recurrent layers; lmcache-histate targets hybrid attention+recurrent models"
        )
    conv_shape, ssm_shape, ssm_default = _parse_gdn(cfg) if gdn else _parse_mamba2(cfg)
    model_dtype = _model_dtype(cfg)
    # A checkpoint may pin the SSM cache dtype (some Nemotron configs do); vLLM honours it.
    pinned = cfg.get("mamba_ssm_cache_dtype")
    ssm_default = ssm_default if pinned in (None, "auto") else pinned
    if name is None:
        name = str(flat.get("_name_or_path") or (flat.get("architectures") or [cfg.arch])[0])
    return ModelGeometry(  # validates the rest (attention present, positive sizes)
        name=name,
        num_layers=n,
        attention_layers=attn,
        recurrent_layers=rec,
        recurrent_kind=family,
        num_kv_heads=cfg.need_int("num_key_value_heads"),
        head_dim=_head_dim(cfg),
        kv_dtype=_dtype_or(kv_dtype, "KV cache", model_dtype),
        state_tensors=(
            StateTensor("conv_state", conv_shape, _norm_dtype(model_dtype, "conv state")),
            StateTensor("ssm_state", ssm_shape, _dtype_or(ssm_dtype, "SSM state", ssm_default)),
        ),
    )


# ---------------------------------------------------------------- presets


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
_PRESET_CONFIGS: dict[str, dict[str, Any]] = {
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
    return tuple(_PRESET_CONFIGS)


def preset(name: str, **dtypes: str | None) -> ModelGeometry:
    """Geometry of a named model (case-insensitive); ``dtypes`` as in :func:`from_hf_config`."""
    key = name.strip().lower()
    if key not in _PRESET_CONFIGS:
        raise GeometryError(
            f"unknown model preset {name!r}; available: {', '.join(preset_names())}"
        )
    return from_hf_config(_PRESET_CONFIGS[key], name=key, **dtypes)


def load_geometry(
    spec: str, *, kv_dtype: str | None = None, ssm_dtype: str | None = None
) -> ModelGeometry:
    """A preset name, or a path to a config.json (or a directory holding one).

    ``kv_dtype`` / ``ssm_dtype`` replace the engine defaults the HF config implies, for a
    deployment whose engine resolved other dtypes (vLLM on CPU without AVX-512-BF16 keeps a
    GatedDeltaNet state in bfloat16, not float32).
    """
    if spec.strip().lower() in _PRESET_CONFIGS:
        return preset(spec, kv_dtype=kv_dtype, ssm_dtype=ssm_dtype)
    path = Path(spec)
    if path.exists():
        return from_hf_config(path, kv_dtype=kv_dtype, ssm_dtype=ssm_dtype)
    raise GeometryError(
        f"{spec!r} is neither a model preset nor an existing config path; "
        f"presets: {', '.join(preset_names())}"
    )
