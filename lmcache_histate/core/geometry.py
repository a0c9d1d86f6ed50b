"""Byte geometry of hybrid (attention + recurrent) models: the public entry point.

The HiState policy prices everything in bytes and in "KV-token units": a hit reads all KV
of a prefix but only ONE recurrent-state snapshot, so the interval controller needs
N_s = snapshot bytes / KV bytes per token (docs/design.md §2.2), and eviction needs the
bytes each item frees (§2.3). The numbers come from a Hugging Face ``config.json`` so the
simulator and the live backend use the same figures the engine would allocate
(docs/design.md §1, §5.2). Three modules hold the three concepts; this one re-exports
them for callers:

* ``model_geometry``: ``ModelGeometry`` / ``StateTensor`` and the sizes derived from
  them (KV bytes per token, snapshot bytes, N_s), ``DTYPE_BYTES``, ``GeometryError``;
* ``hf_config``: ``from_hf_config``, the config parser (family detection, layer counts,
  state shapes and engine-default dtypes);
* ``model_presets``: the transcribed presets, ``preset`` / ``preset_names``, and
  ``load_geometry`` (a preset name or a config path).

Pure: no torch/vllm/lmcache imports, no network.
"""

from __future__ import annotations

from .hf_config import SUPPORTED_MODEL_TYPES, from_hf_config
from .model_geometry import DTYPE_BYTES, GeometryError, ModelGeometry, StateTensor
from .model_presets import PRESET_CONFIGS, load_geometry, preset, preset_names

__all__ = [
    "DTYPE_BYTES",
    "SUPPORTED_MODEL_TYPES",
    "GeometryError",
    "ModelGeometry",
    "StateTensor",
    "from_hf_config",
    "load_geometry",
    "preset",
    "preset_names",
]

# The old private name of the preset table (tests read it as ``geometry._PRESET_CONFIGS``).
_PRESET_CONFIGS = PRESET_CONFIGS
