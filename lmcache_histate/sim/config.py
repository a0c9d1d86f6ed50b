"""Simulation set-up: model geometry, tier capacities, HiState knobs and the cost model.

One frozen ``SimSetup`` is what every policy (HiState variants and baselines) is built
from, so a comparison is always between policies that see the same model, the same
capacities and the same clock. It is read from a YAML file (``configs/sim-paper.yaml``)
whose defaults reproduce the paper's configuration: Qwen3.5-9B on one H100, vLLM block
(= chunk) size 528 tokens (the size vLLM forces for this model, docs/design.md §5.2), GPU pool
45 GiB, CPU 96 GiB, disk 150 GiB, at most 24 concurrent sessions.

Tiers are named ``gpu``, ``cpu`` and ``disk`` everywhere (``Lookup.load_bytes`` keys,
traffic counters, the cost model's bandwidths): a policy that reports a read from any
other tier name is a bug and the cost model says so.

Errors in a config file raise ``ConfigError`` naming the offending key, so the CLI can
print one line instead of a traceback.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

from ..core.cache import config_default
from ..core.model_geometry import GeometryError, ModelGeometry
from ..core.model_presets import load_geometry
from ..yamlfile import read_yaml
from .capture import ENGINE_STEP_TOKENS, STEP_OVERHEAD_S, Capture, capture_time

__all__ = [
    "DEFAULT_COST_MODEL",
    "GIB",
    "TIERS",
    "ConfigError",
    "CostModel",
    "SimSetup",
    "load_cost_model",
    "load_setup",
    "parse_bytes",
]

GIB = 1 << 30
TIERS = ("gpu", "cpu", "disk")
DEFAULT_COST_MODEL = "cost_model_qwen35_9b_h100.yaml"


class ConfigError(ValueError):
    """A simulation config or cost-model file is invalid; the message names the key."""


# ---------------------------------------------------------------- cost model
_COST_KEYS = (
    "pcie_bytes_per_s",
    "ssd_bytes_per_s",
    "prefill_s_per_token",
    "attention_s_per_token_pair",
    "decode_s_per_token",
    "request_overhead_s",
)
# Optional keys: the capture cost's constants (``capture``), defaults there.
_OPTIONAL_COST_KEYS = ("step_overhead_s", "engine_step_tokens")


@dataclass(frozen=True, slots=True)
class CostModel:
    """Times of the operations on a request's path (see the YAML file for the sources).

    ``prefill_time(h, n)``: recomputing tokens ``[h, n)`` of an ``n``-token prompt costs a
    linear term per token plus causal attention over every (query, key) pair,
    ``(n² − h²) / 2`` pairs. ``load_time``: bytes per tier over that tier's bandwidth,
    tiers read one after the other (LMCache retrieves chunk by chunk); GPU-resident
    data is already in place and costs nothing.
    """

    name: str
    pcie_bytes_per_s: float
    ssd_bytes_per_s: float
    prefill_s_per_token: float
    attention_s_per_token_pair: float
    decode_s_per_token: float
    request_overhead_s: float
    step_overhead_s: float = STEP_OVERHEAD_S
    engine_step_tokens: int = ENGINE_STEP_TOKENS

    def __post_init__(self) -> None:
        if not isinstance(self.engine_step_tokens, int) or self.engine_step_tokens <= 0:
            raise ConfigError(
                f"cost model {self.name!r}: engine_step_tokens must be a positive integer, "
                f"got {self.engine_step_tokens!r}"
            )
        for key in (*_COST_KEYS, "step_overhead_s"):
            value = getattr(self, key)
            bandwidth = key.endswith("bytes_per_s")
            if not isinstance(value, int | float) or isinstance(value, bool) or not (
                value > 0 if bandwidth else value >= 0
            ) or not math.isfinite(value):
                kind = "a positive number" if bandwidth else "a non-negative number"
                raise ConfigError(f"cost model {self.name!r}: {key} must be {kind}, got {value!r}")

    @property
    def bandwidths(self) -> dict[str, float]:
        return {"gpu": math.inf, "cpu": self.pcie_bytes_per_s, "disk": self.ssd_bytes_per_s}

    def load_time(self, load_bytes: Mapping[str, int]) -> float:
        total = 0.0
        for tier, nbytes in load_bytes.items():
            if tier == "gpu":
                continue
            if tier == "cpu":
                total += nbytes / self.pcie_bytes_per_s
            elif tier == "disk":
                total += nbytes / self.ssd_bytes_per_s
            else:
                raise ValueError(f"unknown tier {tier!r} in load_bytes; tiers are {TIERS}")
        return total

    def prefill_time(self, hit_tokens: int, input_tokens: int) -> float:
        h, n = hit_tokens, input_tokens
        if n <= h:
            return 0.0
        return self.prefill_s_per_token * (n - h) + self.attention_s_per_token_pair * (
            n * n - h * h
        ) / 2.0

    def decode_time(self, output_tokens: int) -> float:
        return self.decode_s_per_token * output_tokens

    def step_grid(self, chunk_tokens: int) -> tuple[int, float]:
        """``(B, σ)`` for ``CacheConfig.step_tokens`` / ``step_price``: the engine's step
        grid, ``engine_step_tokens`` rounded down to whole chunks and at least one (vLLM's
        align mode ends a step on a block boundary), and the price of one extra step end
        in tokens of prefill time, ``step_overhead_s / prefill_s_per_token``
        (``core/interval.py``, "the price of a step end": 8,192 → 15 × 528 = 7,920 and
        2 ms / 80 µs = 25 tokens); σ is 0 when prefill is free (nothing to weigh it by)."""
        step = max(1, self.engine_step_tokens // chunk_tokens) * chunk_tokens
        if self.prefill_s_per_token <= 0:
            return step, 0.0
        return step, self.step_overhead_s / self.prefill_s_per_token

    def capture_time(
        self, capture: Capture, recomputed_tokens: int, snapshot_bytes: int
    ) -> tuple[float, float]:
        """``(compute, copy)`` seconds of a request's state capture (``capture.Capture``)."""
        return capture_time(
            capture, recomputed_tokens, snapshot_bytes, step_overhead_s=self.step_overhead_s,
            engine_step_tokens=self.engine_step_tokens, copy_bytes_per_s=self.pcie_bytes_per_s,
        )


def _read_yaml(path: Path) -> dict[str, Any]:
    data = read_yaml(path, ConfigError)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def _yaml_float(value: Any) -> Any:
    """PyYAML (YAML 1.1) reads ``5.0e9`` (no exponent sign) as a string: accept it."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _data_path(name: str) -> Path:
    return Path(str(resources.files("lmcache_histate") / "data" / name))


def load_cost_model(spec: str | Path = DEFAULT_COST_MODEL, base: Path | None = None) -> CostModel:
    """A cost model from a YAML path, or the name of one shipped in ``lmcache_histate/data``.

    Relative paths are resolved against ``base`` (the config file's folder) first. Shipped:
    ``cost_model_qwen35_9b_h100.yaml`` (estimates, the default) and, once measured on a GPU,
    ``cost_model_qwen35_9b_h100_measured.yaml`` (``scripts/gpu_costs_fit.py``); either is
    named with or without the ``cost_model_`` prefix and the ``.yaml`` suffix.
    """
    candidates = [Path(spec)]
    if base is not None and not Path(spec).is_absolute():
        candidates.insert(0, base / spec)
    name = str(spec) if str(spec).endswith((".yaml", ".yml")) else f"{spec}.yaml"
    candidates.append(_data_path(name))
    candidates.append(_data_path(f"cost_model_{name}"))
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        shipped = sorted(p.name for p in _data_path(".").glob("cost_model_*.yaml"))
        raise ConfigError(f"cost_model: no such file or shipped model {str(spec)!r}; shipped: "
                          f"{', '.join(shipped)} (a measured model is written by "
                          "scripts/gpu_costs_fit.py, benchmarks/gpu_costs.md)")
    data = _read_yaml(path)
    unknown = sorted(set(data) - {"name", *_COST_KEYS, *_OPTIONAL_COST_KEYS})
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r}")
    missing = [k for k in _COST_KEYS if k not in data]
    if missing:
        raise ConfigError(f"{path}: missing key {missing[0]!r}")
    values = {k: _yaml_float(data[k]) for k in (*_COST_KEYS, *_OPTIONAL_COST_KEYS) if k in data}
    try:
        return CostModel(name=str(data.get("name", path.stem)), **values)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e


# ---------------------------------------------------------------- set-up
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGT]i?B|B)?\s*$")
_UNITS = {
    None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
}


def parse_bytes(value: Any, key: str) -> int:
    """``123``, ``"45 GiB"``, ``"96GB"`` → bytes; anything else is a ConfigError on ``key``."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return int(value)
    m = _SIZE.match(str(value)) if isinstance(value, str) else None
    if m is None:
        raise ConfigError(f"{key}: expected a byte size like 96GiB, got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


# How concurrent prefills share the GPU (see ``server``): vLLM V1's chunked prefill
# (processor sharing) or exclusive FIFO service.
GPU_SCHEDULING = ("shared", "fifo")


@dataclass(frozen=True, slots=True)
class SimSetup:
    """Everything a policy and the server model are built from.

    Capacities are bytes per tier. HiState knobs: ``tau`` (seconds, the eviction
    queue's recency-vs-cost exchange rate, see ``core.eviction``), ``max_interval_chunks``
    (the interval controller's supported set is 1..this many chunks), ``ema_alpha``
    (residence-time and hit-position EMAs). ``max_think_s`` caps a session's idle gap
    between requests (the Weka trace has multi-hour gaps; see ``server``);
    ``target_rate_per_h`` (requests per hour over the bulk of the run), if set, replaces
    it with a cap derived from the trace (``sim.load``).
    ``session_gap_s`` staggers the starts of a trace's sessions when the trace itself
    starts them all at once (every Weka file starts at t = 0): the k-th session starts
    k·gap later. Without it the first K sessions' cold prompts all queue at t = 0 and
    that start-up burst, which no cache can shorten, is the p99 of every policy. ``seed`` is
    handed to anything random (synthetic traces, randomised baselines).
    """

    geometry: ModelGeometry
    cost: CostModel
    chunk_tokens: int = 528
    gpu_bytes: int = 45 * GIB
    cpu_bytes: int = 96 * GIB
    disk_bytes: int = 150 * GIB
    max_sessions: int = 24
    tau: float = 600.0  # the paper's fixed recency scale (the core's default calibrates it)
    max_interval_chunks: int = config_default("max_interval_chunks")
    ema_alpha: float = config_default("ema_alpha")
    max_think_s: float = 600.0
    session_gap_s: float = 60.0
    gpu_scheduling: str = "shared"
    seed: int = 0
    name: str = "custom"
    target_rate_per_h: float | None = None  # derive max_think_s from it (``sim.load``)

    def __post_init__(self) -> None:
        positive = ("chunk_tokens", "max_sessions", "max_interval_chunks")
        for key in positive:
            if not isinstance(getattr(self, key), int) or getattr(self, key) <= 0:
                raise ConfigError(f"{key} must be a positive integer, got {getattr(self, key)!r}")
        for key in ("gpu_bytes", "cpu_bytes", "disk_bytes"):
            if getattr(self, key) < 0:
                raise ConfigError(f"capacity.{key.removesuffix('_bytes')} must be ≥ 0")
        if not self.tau >= 0:
            raise ConfigError(f"histate.tau must be ≥ 0, got {self.tau!r}")
        if not 0 < self.ema_alpha <= 1:
            raise ConfigError(f"histate.ema_alpha must be in (0, 1], got {self.ema_alpha!r}")
        if self.target_rate_per_h is not None and not self.target_rate_per_h > 0:
            raise ConfigError(f"target_rate_per_h must be > 0 requests per hour, got "
                              f"{self.target_rate_per_h!r}")
        for key in ("max_think_s", "session_gap_s"):
            if not getattr(self, key) >= 0:
                raise ConfigError(f"{key} must be ≥ 0, got {getattr(self, key)!r}")
        if self.gpu_scheduling not in GPU_SCHEDULING:
            raise ConfigError(
                f"gpu_scheduling must be one of {', '.join(GPU_SCHEDULING)}, "
                f"got {self.gpu_scheduling!r}"
            )

    # Derived sizes every policy needs.
    @property
    def kv_bytes_per_token(self) -> int:
        return self.geometry.kv_bytes_per_token

    @property
    def kv_chunk_bytes(self) -> int:
        return self.chunk_tokens * self.geometry.kv_bytes_per_token

    @property
    def snapshot_bytes(self) -> int:
        return self.geometry.snapshot_bytes

    @property
    def capacities(self) -> dict[str, int]:
        return {"gpu": self.gpu_bytes, "cpu": self.cpu_bytes, "disk": self.disk_bytes}

    def with_(self, **changes: Any) -> SimSetup:
        """A copy with some fields replaced (capacity sweeps, tests)."""
        return replace(self, **changes)

    @classmethod
    def paper(cls, **changes: Any) -> SimSetup:
        """The paper's configuration with the shipped cost model (= configs/sim-paper.yaml)."""
        base = cls(
            geometry=load_geometry("qwen3.5-9b"), cost=load_cost_model(), name="paper"
        )
        return replace(base, **changes) if changes else base


_TOP_KEYS = {"name", "model", "chunk_tokens", "capacity", "max_sessions", "max_think_s",
             "target_rate_per_h", "session_gap_s", "gpu_scheduling", "seed", "histate",
             "cost_model", "capture"}
_HISTATE_KEYS = {"tau", "max_interval_chunks", "ema_alpha"}
# Old YAML names still read, with a deprecation warning naming the new one.
_RENAMED_HISTATE_KEYS = {"max_interval_multiple": "max_interval_chunks"}


def _number(section: Mapping[str, Any], key: str, where: str, kind: type = float) -> Any:
    value = _yaml_float(section[key]) if kind is float else section[key]
    ok = isinstance(value, int) if kind is int else isinstance(value, int | float)
    if isinstance(value, bool) or not ok:
        raise ConfigError(f"{where}{key}: expected {'an integer' if kind is int else 'a number'}, "
                          f"got {value!r}")
    return value


def load_setup(path: str | Path) -> SimSetup:
    """Read a simulation config (see ``configs/sim-paper.yaml``); absent keys = defaults."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config not found: {path}")
    data = _read_yaml(path)
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r}")
    kw: dict[str, Any] = {"name": str(data.get("name", path.stem))}
    try:
        kw["geometry"] = load_geometry(str(data.get("model", "qwen3.5-9b")))
    except GeometryError as e:
        raise ConfigError(f"{path}: model: {e}") from e
    kw["cost"] = load_cost_model(data.get("cost_model", DEFAULT_COST_MODEL), base=path.parent)
    capture = data.get("capture", {})
    if not isinstance(capture, dict):
        raise ConfigError(f"{path}: capture: expected a mapping")
    for key in capture:
        if key not in _OPTIONAL_COST_KEYS:
            raise ConfigError(f"{path}: capture: unknown key {key!r}")
    if capture:  # overrides of the cost model's capture constants (``capture``)
        kinds = {"step_overhead_s": float, "engine_step_tokens": int}
        values = {k: _number(capture, k, f"{path}: capture.", kinds[k]) for k in capture}
        try:
            kw["cost"] = replace(kw["cost"], **values)
        except ConfigError as e:
            raise ConfigError(f"{path}: capture: {e}") from e
    for key, kind in (("chunk_tokens", int), ("max_sessions", int), ("seed", int),
                      ("max_think_s", float), ("session_gap_s", float),
                      ("target_rate_per_h", float)):
        if key in data:
            kw[key] = _number(data, key, f"{path}: ", kind)
    if "gpu_scheduling" in data:
        kw["gpu_scheduling"] = str(data["gpu_scheduling"])
    cap = data.get("capacity", {})
    if not isinstance(cap, dict):
        raise ConfigError(f"{path}: capacity: expected a mapping of tier -> size")
    for tier, value in cap.items():
        if tier not in TIERS:
            raise ConfigError(f"{path}: capacity: unknown tier {tier!r}; tiers are {TIERS}")
        kw[f"{tier}_bytes"] = parse_bytes(value, f"{path}: capacity.{tier}")
    hs = data.get("histate", {})
    if not isinstance(hs, dict):
        raise ConfigError(f"{path}: histate: expected a mapping")
    for key, value in hs.items():
        if key in _RENAMED_HISTATE_KEYS:
            new = _RENAMED_HISTATE_KEYS[key]
            if new in hs:
                raise ConfigError(f"{path}: histate: {key!r} and {new!r} are the same knob; "
                                  f"keep {new!r}")
            warnings.warn(f"{path}: histate.{key} is deprecated; use histate.{new} (same "
                          f"meaning)", FutureWarning, stacklevel=2)
            hs = {**hs, new: value}
            key = new
        elif key not in _HISTATE_KEYS:
            raise ConfigError(f"{path}: histate: unknown key {key!r}; keys are "
                              f"{sorted(_HISTATE_KEYS)}")
        kind = int if key == "max_interval_chunks" else float
        kw[key] = _number(hs, key, f"{path}: histate.", kind) if value is not None else value
    try:
        return SimSetup(**kw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
