"""Byte geometry of a hybrid (attention + recurrent) model: what one token and one snapshot cost.

The HiState policy prices everything in bytes and in "KV-token units": a hit reads all KV
of a prefix but only ONE recurrent-state snapshot, so the interval controller needs
N_s = snapshot bytes / KV bytes per token (docs/design.md §2.2), and eviction needs the
bytes each item frees (§2.3). A ``ModelGeometry`` holds the layer counts, KV head layout,
dtypes and per-layer state tensors, and derives:

* ``kv_bytes_per_token`` = attention layers × 2 (K and V) × KV heads × head dim × dtype
  bytes;
* ``snapshot_bytes`` = recurrent layers × Σ bytes of the per-layer state tensors (one
  snapshot is every recurrent layer's state at one position);
* ``snapshot_tokens`` = N_s, the ratio of the two (the module function ``snapshot_tokens``,
  which ``CacheConfig`` and the live server use for their own byte counts).

Invariants (checked at construction, ``GeometryError`` naming the model otherwise): both
layer kinds are present (no attention: N_s is undefined; no recurrent layer: nothing to
snapshot), their sum is at most ``num_layers``, sizes are positive and every dtype is a
``DTYPE_BYTES`` key. Where the numbers come from (a HF config, a preset) is ``hf_config``
and ``model_presets``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DTYPE_BYTES",
    "GeometryError",
    "ModelGeometry",
    "StateTensor",
    "norm_dtype",
    "snapshot_tokens",
]


def snapshot_tokens(snapshot_bytes: float, kv_bytes_per_token: float) -> float:
    """``N_s`` of the paper: one snapshot's size in KV-token units (docs/design.md §2.2)."""
    if kv_bytes_per_token <= 0:
        raise ValueError(f"kv_bytes_per_token must be positive, got {kv_bytes_per_token}")
    return snapshot_bytes / kv_bytes_per_token


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


def norm_dtype(value: Any, what: str) -> str:
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
