"""Hugging Face ``config.json`` → ``ModelGeometry``: the sizes the engine would allocate.

The simulator and the live backend must use the same figures vLLM allocates (docs/design.md
§1, §5.2), so the geometry is derived from the checkpoint's own config:

1. Read the config (a dict, a ``config.json`` path or its directory) and flatten a
   multimodal wrapper (Qwen3.5 keeps the LM under ``text_config``).
2. Recognise the recurrent family from ``model_type`` / ``architectures`` (or, for a
   renamed fork, from family-specific keys): GatedDeltaNet (Qwen3-Next, Qwen3.5) or
   Mamba2 (Nemotron-H, Granite 4 hybrid); anything else is refused naming the supported
   model types.
3. Count layers first (``layer_types``, ``full_attention_interval``,
   ``hybrid_override_pattern``, ``layers_block_type``), so that a non-hybrid config is
   told so rather than about missing state keys.
4. Shape one recurrent layer's conv and SSM state as the engine does, with the engine's
   default dtypes (KV and conv state = model dtype; SSM state = fp32 for GatedDeltaNet,
   model dtype for Mamba2, unless the checkpoint pins ``mamba_ssm_cache_dtype`` or the
   caller overrides it); ``ModelGeometry`` validates the rest.

Every failure is a ``GeometryError`` naming the key and the architecture. Pure: no
torch/vllm/lmcache imports, no network; the only I/O is reading the given config file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .model_geometry import GeometryError, ModelGeometry, StateTensor, norm_dtype

__all__ = ["SUPPORTED_MODEL_TYPES", "from_hf_config"]


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
    return norm_dtype(override if override is not None else fallback, what)


def _model_dtype(cfg: _Cfg) -> Any:
    dtype = cfg.get("torch_dtype", "dtype", default="bfloat16")
    return "bfloat16" if str(dtype) == "auto" else dtype


def _declared_layers(cfg: _Cfg, n: int, source: str) -> int:
    """``n`` layers listed by ``source``; an explicit ``num_hidden_layers`` must agree."""
    declared = cfg.get("num_hidden_layers")
    if declared is not None and declared != n:
        raise cfg.error(f"{source} has {n} entries but 'num_hidden_layers' is {declared}")
    return n


def _gdn_layers(cfg: _Cfg) -> tuple[int, int, int]:
    """(num_layers, attention, recurrent) from layer_types or full_attention_interval."""
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        unknown = sorted({t for t in layer_types} - {"linear_attention", "full_attention"})
        if unknown:
            raise cfg.error(f"unknown 'layer_types' entries {unknown}")
        n = _declared_layers(cfg, len(layer_types), "'layer_types'")
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
    n = _declared_layers(cfg, len(kinds), "layer pattern")
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
            StateTensor("conv_state", conv_shape, norm_dtype(model_dtype, "conv state")),
            StateTensor("ssm_state", ssm_shape, _dtype_or(ssm_dtype, "SSM state", ssm_default)),
        ),
    )
