"""The HiState server configuration: one YAML file, validated before anything starts.

Pure (no lmcache/vllm imports) so that the schema can be unit-tested and reused by the
CLI. ``backends/server/launcher.py`` turns a validated ``HiStateConfig`` into ``lmcache server``
flags and the vLLM ``--kv-transfer-config``.

Every error names the key and what is allowed, e.g.
``cpu_gib: must be a positive number, got 'abc'``; unknown keys are rejected with the
list of allowed ones (a typo must not silently fall back to a default). All problems in
a file are reported at once.

NOTE 1 (engine-resolved layout): vLLM picks a hybrid model's block size and recurrent-state
dtypes per platform -- on CPU per instruction set (384 tokens with AVX-512-BF16, 256 with AVX2
for the tiny test model). ``chunk_size: auto`` (the default in ``configs/histate.yaml``)
makes ``histate-server`` ask vLLM for the model directory given in ``model``
(``backends/vllm/engine_facts.py``) and fill in the block size and the engine's ``dtype`` /
``mamba_ssm_cache_dtype``, so the chunk, the snapshot size and N_s are the engine's. An
explicit number is kept as given; the connector then checks it against the engine at vLLM
start and names both numbers when they disagree.

NOTE 2 (``disk_io_workers`` at most 64): each worker is a thread of one pool writing and
reading whole object files with blocking calls; an NVMe device's queue is full with far
fewer concurrent requests of this size (benchmarks/README.md "disk_io": 4 threads are the
default), and every thread costs a stack and, with ``disk_direct_io``, an aligned buffer
per file in flight. 64 leaves room for striped volumes; a larger number is a typo
(``100000`` threads would exhaust the process's thread limit at start).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .core.cache_types import HIT_POSITION_MODES, config_default
from .core.model_geometry import GeometryError, ModelGeometry
from .core.model_presets import load_geometry
from .exposure import check_exposure
from .shared_index_config import SharedIndexConfig, parse_shared_index
from .yamlfile import read_yaml

__all__ = ["PLATFORMS", "POLICIES", "ConfigError", "HiStateConfig", "load_config", "parse_config"]

POLICIES = ("histate", "lru")
"""``histate``: HiState placement + unified H eviction; ``lru``: stock LMCache LRU (baseline)."""
PLATFORMS = ("auto", "cpu", "cuda")
MAX_DISK_IO_WORKERS = 64
"""NOTE 2: the most disk I/O threads a server may ask for."""
DISK_IO = ("thread",)
"""Disk I/O engines (benchmarks/README.md "disk_io": a thread pool beat aiofiles)."""


class ConfigError(ValueError):
    """The configuration is invalid; the message names every offending key."""


@dataclass(frozen=True)
class HiStateConfig:
    """A validated single-instance HiState server configuration (see configs/histate.yaml)."""

    model: str
    chunk_size: int | str  # tokens, or "auto" until the launcher resolves it (NOTE 1)
    cpu_gib: float
    disk_path: str
    disk_gib: float
    policy: str = "histate"
    # The core's knobs: their defaults are CacheConfig's (core/cache_types.py).
    tau: float | None = config_default("tau")  # None = "auto": calibrated online
    supported_intervals: tuple[int, ...] | None = None
    max_interval_chunks: int = config_default("max_interval_chunks")
    cpu_fill: float = 0.75
    refresh_all: bool = config_default("refresh_all")
    hit_positions: str = config_default("hit_positions")  # or "measured" (learned online)
    end_probability_prior: float = config_default("end_probability_prior")
    ema_alpha: float = config_default("ema_alpha")
    initial_pressure_factor: float = config_default("initial_pressure_factor")
    host: str = "127.0.0.1"
    port: int = 5555
    http_host: str = "127.0.0.1"
    http_port: int = 8080
    platform: str = "auto"
    disk_io: str = "thread"
    disk_io_workers: int = 4
    disk_fsync: bool = True
    disk_direct_io: bool = True
    disk_adopt: bool = False
    l1_eviction_watermark: float = 0.9
    session_ttl_s: float = 3600.0
    request_ttl_s: float = 600.0
    max_model_tokens: int = 1_048_576
    allow_remote: bool = False
    auth_token_file: str | None = None
    # HiState's connector (interval-driven saves, CPU support) subclasses LMCache's.
    kv_connector: str = "HiStateConnector"
    kv_connector_module_path: str | None = "lmcache_histate.backends.vllm.connector"
    extra_server_args: tuple[str, ...] = field(default_factory=tuple)
    # The vLLM flags of the same names: the engine layout (block size, state dtypes) is
    # resolved for them, and the geometry uses them when not "auto" (NOTE 1).
    dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    # Several servers sharing one disk tier through Redis; None = one server (today).
    shared_index: SharedIndexConfig | None = None

    # ------------------------------------------------------------ derived
    @property
    def chunk_tokens(self) -> int:
        """``chunk_size`` as a number; only valid once ``auto`` is resolved."""
        if not isinstance(self.chunk_size, int):
            raise ConfigError(
                "chunk_size: 'auto' is resolved from the engine when the server starts "
                "(histate-server does it); it has no value yet"
            )
        return self.chunk_size

    @property
    def geometry(self) -> ModelGeometry:
        return load_geometry(
            self.model,
            kv_dtype=None if self.dtype == "auto" else self.dtype,
            ssm_dtype=None if self.mamba_ssm_cache_dtype == "auto" else self.mamba_ssm_cache_dtype,
        )

    @property
    def cpu_bytes(self) -> int:
        return int(self.cpu_gib * 2**30)

    @property
    def disk_bytes(self) -> int:
        return int(self.disk_gib * 2**30)

    @property
    def intervals(self) -> tuple[int, ...]:
        """Supported snapshot intervals in tokens (multiples of ``chunk_size``)."""
        if self.supported_intervals:
            return self.supported_intervals
        return tuple(self.chunk_tokens * k for k in range(1, self.max_interval_chunks + 1))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, SharedIndexConfig):
                value = value.to_dict()
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def with_overrides(self, **changes: Any) -> HiStateConfig:
        """A copy with some values replaced (re-validated)."""
        return parse_config({**self.to_dict(), **changes})


REQUIRED = ("model", "chunk_size", "cpu_gib", "disk_path", "disk_gib")
ALLOWED = tuple(f.name for f in fields(HiStateConfig))
ENGINE_DTYPES = ("auto", "bfloat16", "float16", "float32")
"""Values of the engine-dtype keys (vLLM's ``--dtype`` / ``--mamba-ssm-cache-dtype``)."""


# ---------------------------------------------------------------- validators
def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _positive_number(key: str, value: Any, errors: list[str]) -> float | None:
    if not _is_number(value) or value <= 0:
        errors.append(f"{key}: must be a positive number, got {_show(value)}")
        return None
    return float(value)


def _number_in(key: str, value: Any, lo: float, hi: float, errors: list[str]) -> float | None:
    if not _is_number(value) or not lo <= value <= hi:
        errors.append(f"{key}: must be a number in [{lo}, {hi}], got {_show(value)}")
        return None
    return float(value)


def _positive_int(key: str, value: Any, errors: list[str]) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        errors.append(f"{key}: must be a positive integer, got {_show(value)}")
        return None
    return value


def _port(key: str, value: Any, errors: list[str]) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        errors.append(f"{key}: must be a TCP port (an integer in 1..65535), got {_show(value)}")
        return None
    return value


def _choice(key: str, value: Any, allowed: Sequence[str], errors: list[str]) -> str | None:
    if value not in allowed:
        errors.append(f"{key}: must be one of {', '.join(allowed)}; got {_show(value)}")
        return None
    return str(value)


def _text(key: str, value: Any, errors: list[str]) -> str | None:
    if not isinstance(value, str) or not value.strip():
        errors.append(f"{key}: must be a non-empty string, got {_show(value)}")
        return None
    return value


def _boolean(key: str, value: Any, errors: list[str]) -> bool | None:
    if not isinstance(value, bool):
        errors.append(f"{key}: must be true or false, got {_show(value)}")
        return None
    return value


def parse_config(data: Any, base_dir: Path | None = None) -> HiStateConfig:
    """Validate a mapping (the parsed YAML) into a ``HiStateConfig``.

    Relative ``disk_path`` and model config paths are resolved against ``base_dir``
    (the YAML file's folder) when given.

    Raises:
        ConfigError: listing every problem, one per line, each naming its key.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"the configuration must be a mapping of keys to values, got {type(data).__name__}"
        )
    errors: list[str] = []
    unknown = sorted(str(k) for k in data if k not in ALLOWED)
    for key in unknown:
        errors.append(f"{key}: unknown key; allowed keys: {', '.join(ALLOWED)}")
    for key in REQUIRED:
        if key not in data or data[key] is None:
            errors.append(f"{key}: required key is missing")
    values: dict[str, Any] = {}
    get = data.get

    if get("chunk_size") is not None:
        if get("chunk_size") == "auto":
            values["chunk_size"] = "auto"
        else:
            values["chunk_size"] = _positive_int("chunk_size", get("chunk_size"), errors)
    for key in ("dtype", "mamba_ssm_cache_dtype"):
        if key in data:
            values[key] = _choice(key, get(key), ENGINE_DTYPES, errors)
    for key in ("cpu_gib", "disk_gib"):
        if get(key) is not None:
            values[key] = _positive_number(key, get(key), errors)
    if get("disk_path") is not None:
        path = _text("disk_path", get("disk_path"), errors)
        if path is not None:
            p = Path(path).expanduser()
            if not p.is_absolute() and base_dir is not None:
                p = base_dir / p
            if p.exists() and not p.is_dir():
                errors.append(f"disk_path: {str(p)!r} exists and is not a directory")
            values["disk_path"] = str(p)
    if get("model") is not None:
        model = _text("model", get("model"), errors)
        if model is not None:
            candidate = Path(model).expanduser()
            if base_dir is not None and not candidate.is_absolute():
                local = base_dir / candidate
                if local.exists():
                    model = str(local)
            try:
                load_geometry(model)
                values["model"] = model
                if values.get("chunk_size") == "auto" and not Path(model).exists():
                    errors.append(
                        f"chunk_size: 'auto' resolves vLLM's block size from the model, so "
                        f"model must be the Hugging Face model directory (or its config.json) "
                        f"vLLM serves, not the preset {model!r}; or give chunk_size in tokens"
                    )
            except GeometryError as exc:
                errors.append(f"model: {exc}")
    if "policy" in data:
        values["policy"] = _choice("policy", get("policy"), POLICIES, errors)
    if "platform" in data:
        values["platform"] = _choice("platform", get("platform"), PLATFORMS, errors)
    if "disk_io" in data:
        values["disk_io"] = _choice("disk_io", get("disk_io"), DISK_IO, errors)
    if "hit_positions" in data:
        values["hit_positions"] = _choice(
            "hit_positions", get("hit_positions"), HIT_POSITION_MODES, errors
        )
    for key in ("session_ttl_s", "request_ttl_s"):
        if key in data:
            values[key] = _positive_number(key, get(key), errors)
    if "tau" in data and get("tau") not in ("auto", None):
        tau = get("tau")
        if not _is_number(tau) or tau < 0:
            errors.append(f"tau: must be 'auto' or a number ≥ 0 (seconds), got {_show(tau)}")
        else:
            values["tau"] = float(tau)
    if "cpu_fill" in data:
        fill = get("cpu_fill")
        if not _is_number(fill) or not 0 < fill <= 1:
            errors.append(f"cpu_fill: must be a number in (0, 1], got {_show(fill)}")
        else:
            values["cpu_fill"] = float(fill)
    for key, lo, hi in (
        ("end_probability_prior", 0.0, 1.0),
        ("ema_alpha", 0.001, 1.0),
        ("initial_pressure_factor", 0.0, 1e6),
        ("l1_eviction_watermark", 0.1, 1.0),
    ):
        if key in data:
            values[key] = _number_in(key, get(key), lo, hi, errors)
    for key in ("max_interval_chunks", "disk_io_workers", "max_model_tokens"):
        if key in data:
            values[key] = _positive_int(key, get(key), errors)
    workers = values.get("disk_io_workers")
    if workers is not None and workers > MAX_DISK_IO_WORKERS:
        errors.append(
            f"disk_io_workers: must be at most {MAX_DISK_IO_WORKERS} (threads of one disk "
            f"tier), got {workers}"
        )
    for key in ("port", "http_port"):
        if key in data:
            values[key] = _port(key, get(key), errors)
    for key in ("host", "http_host", "kv_connector"):
        if key in data:
            values[key] = _text(key, get(key), errors)
    for key in ("refresh_all", "disk_fsync", "disk_direct_io", "disk_adopt", "allow_remote"):
        if key in data:
            values[key] = _boolean(key, get(key), errors)
    if get("kv_connector_module_path") is not None:
        values["kv_connector_module_path"] = _text(
            "kv_connector_module_path", get("kv_connector_module_path"), errors
        )
    if get("extra_server_args") is not None:
        extra = get("extra_server_args")
        if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
            errors.append(
                f"extra_server_args: must be a list of strings (lmcache server flags), "
                f"got {_show(extra)}"
            )
        else:
            values["extra_server_args"] = tuple(extra)
    if get("supported_intervals") is not None:
        values["supported_intervals"] = _intervals(
            get("supported_intervals"), values.get("chunk_size"), errors
        )
    if get("shared_index") is not None:
        values["shared_index"] = parse_shared_index(
            get("shared_index"), values.get("port"), base_dir, errors
        )
    _check_rounding(values, errors)
    check_exposure(data, values, base_dir, errors)
    port, http_port = values.get("port", 5555), values.get("http_port", 8080)
    if port is not None and port == http_port:
        errors.append("http_port: must differ from port (both are opened by the server)")

    if len(errors) == 1:  # one problem, one line
        raise ConfigError(f"invalid HiState configuration: {errors[0]}")
    if errors:
        raise ConfigError("invalid HiState configuration:\n  " + "\n  ".join(errors))
    clean = {k: v for k, v in values.items() if v is not None}
    return HiStateConfig(**clean)


def _check_rounding(values: dict[str, Any], errors: list[str]) -> None:
    """Sizes are turned into whole bytes: one that rounds to 0 would start nothing."""
    for key in ("cpu_gib", "disk_gib"):
        gib = values.get(key)
        if gib is not None and int(gib * 2**30) < 1:
            errors.append(
                f"{key}: {gib:g} GiB rounds to 0 bytes; must be at least 1 byte "
                f"({1 / 2**30:.3g} GiB)"
            )


def _intervals(value: Any, chunk: int | None, errors: list[str]) -> tuple[int, ...] | None:
    key = "supported_intervals"
    if not isinstance(value, list) or not value:
        errors.append(
            f"{key}: must be a non-empty list of token counts (multiples of chunk_size), "
            f"got {_show(value)}"
        )
        return None
    bad = [v for v in value if isinstance(v, bool) or not isinstance(v, int) or v <= 0]
    if bad:
        errors.append(f"{key}: every entry must be a positive integer (tokens), got {bad}")
        return None
    if isinstance(chunk, int):
        off = [v for v in value if v % chunk]
        if off:
            errors.append(
                f"{key}: every entry must be a multiple of chunk_size ({chunk}): "
                f"snapshots exist only at chunk ends; got {off}"
            )
            return None
    return tuple(sorted(set(value)))


def load_config(path: str | Path) -> HiStateConfig:
    """Read and validate a YAML configuration file.

    Raises:
        ConfigError: the file is missing, not YAML, or invalid (message names the key).
    """
    p = Path(path)
    data = read_yaml(p, ConfigError)
    if data is None:
        data = {}
    try:
        return parse_config(data, base_dir=p.resolve().parent)
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from None

