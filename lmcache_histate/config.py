"""The HiState server configuration: one YAML file, validated before anything starts.

The schema of the server process kind (``histate-server`` / ``histate serve``), every key
validated here and nowhere else: the top-level keys (``HiStateConfig``), the
``shared_index`` section (``SharedIndexConfig``), who may reach the server (NOTE 4) and
the disk tier's keys, which the LMCache process re-validates with the same checks when
it builds the disk adapter (``parse_disk_tier``, NOTE 5). Defaults of the core's knobs
are ``CacheConfig``'s (``core/cache.py``), read, not restated. What needs the
machine or LMCache itself is checked at start, after this: the filesystem, ports and
hosts (``backends/server/preflight.py``) and which ``lmcache server`` flags
``extra_server_args`` may give (``backends/server/access_flags.py``, LMCache's parser).

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

NOTE 3 (``shared_index``, no password in the URL): absent (the default), one server owns
its disk folder. Present, the server registers its disk-tier objects in Redis so that the
other servers of the same ``deployment`` (and model) find them, and evicts from one
deployment-wide budget (``backends/server/shared_index``, ``docs/shared-index.md``)::

    shared_index:
      url: rediss://histate@redis.internal:6380/0   # redis://, rediss:// (TLS) or unix://
      password_file: /etc/histate/redis-password    # chmod 600; the AUTH password
      tls_ca_file: /etc/histate/redis-ca.pem        # rediss:// only; default: system CAs
      deployment: prod-a                            # namespace, with the model
      instance: gpu0                                # this server's name in the deployment
      connect_timeout_s: 1.0
      op_timeout_s: 0.25
      lease_ttl_s: 30          # a load lease: no other server deletes the file meanwhile
      claim_ttl_s: 60          # an eviction claim: its file deleted within this, or reclaimed
      write_ttl_s: 120         # a reservation: the file written and committed within this
      retry_s: 2.0             # while Redis is unreachable, how often it is probed

The URL may name the ACL user; the password must come from ``password_file``. A URL is
printed (``--print-config``, start-up logs) and shows up in process listings of tools
that take it as an argument; a file with mode 600 does not. A URL holding a password is
refused at load, naming the key, without echoing it.

NOTE 4 (protected mode, as Redis does it): LMCache's ZMQ and HTTP APIs have no
authentication, so binding beyond loopback is refused unless ``allow_remote: true`` says
so and ``auth_token_file`` holds a shared secret (docs/deployment.md, Security). The
secret is enforced by ``backends/server/access.py`` (HTTP) and the HiState server module
(RPCs); reading it and telling loopback hosts apart is ``exposure``.

NOTE 5 (the disk tier's ``adapter_params``): LMCache builds the disk adapter from the JSON
of ``--l2-adapter`` in its own process and calls ``HiStateDiskAdapterConfig.from_dict``
on it (``backends/server/disk/config.py``). Its ``adapter_params`` are the server keys of
``DISK_TIER_KEYS`` under the same names, plus ``index_model`` (the shared index's model
namespace), and ``parse_disk_tier`` validates them with the checks ``parse_config`` uses:
one rule per key, one message for a bad value wherever it is given.

NOTE 6 (every number has an upper bound, each with its reason): a value beyond it is a
typo or a unit mistake that would start a server which misbehaves later (``chunk_size:
1000000000000`` started, and no chunk could ever complete). Token counts are bounded by
``max_model_tokens`` (the longest prompt the engine accepts): ``chunk_size`` and every
entry of ``supported_intervals``, since a chunk or an interval longer than any prompt is
never reached. ``max_model_tokens``, ``max_interval_chunks``, the times and ``tau`` have
fixed bounds in ``UPPER_BOUNDS``, the reason written beside each; the
fractions and ``initial_pressure_factor`` their ranges; ``port`` 65535;
``disk_io_workers`` 64 (NOTE 2). ``cpu_gib`` and ``disk_gib`` are bounded at start by
what the machine has (``backends/server/preflight.py``: the memory this process may use,
the filesystem of ``disk_path``), since only the machine knows.

NOTE 7 (``host`` is IPv4): LMCache 0.5.6 binds its ZMQ socket as ``tcp://{host}:{port}``
without ZMQ's IPV6 option (``transport/zmq_impl/server.py``), which cannot bind an IPv6
address (``::1`` ended LMCache's start-up after 26 s with ``ZMQError: No such device``).
``host`` must be an IPv4 address or a name with one (``preflight`` resolves it as ZMQ
will); ``http_host`` (uvicorn) takes IPv6 too.

NOTE 8 (``shared_tier``: a tier on a Redis/Valkey Cluster, docs/multi-node.md): absent (the
default), every tier is the node's own. Present, the server adds a third tier beside the
CPU and disk tiers: objects stored as values in a Redis Cluster that every node of the
``deployment`` reads, under one budget for the whole deployment kept in the cluster
(``backends/server/shared_tier``)::

    shared_tier:
      nodes: [10.0.0.5:6379, 10.0.0.6:6379]   # startup nodes, host:port (at least one)
      deployment: prod-a       # namespace, with the model; the same on every node
      instance: node-a         # this server's name (default: host name and port)
      budget_gib: 64           # the deployment's shared-tier budget (same on every node)
      key_prefix: histate-obj  # object values are <key_prefix>:<deployment>:<id>
      username: histate        # ACL user (optional); the password from password_file
      password_file: /etc/histate/redis-password
      tls: false               # rediss; tls_ca_file: CA bundle (default: system CAs)
      connect_timeout_s: 0.5
      op_timeout_s: 2.0        # one call (a 50 MB value at 200 MB/s: 0.25 s)
      lease_ttl_s: 30
      claim_ttl_s: 60
      write_ttl_s: 120
      retry_s: 2.0             # while the cluster is down, how often it is probed

NOTE 9 (one mapping into the core's configuration): the server's keys that set the core's
eviction and interval rule (``CoreKnobs``) reach ``CacheConfig`` through
``cache_config`` only; the simulator builds its HiState rows through it too
(``sim/variants.py``: ``histate_policy``), with its own tiers and the knobs its set-up
gives, so what the benchmarks measure is the rule the server runs. A new rule key is a
field of ``CoreKnobs`` and of ``HiStateConfig`` under the same name.
"""

from __future__ import annotations

import math
import re
import socket
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .core.cache import HIT_POSITION_MODES, CacheConfig, config_default
from .core.interval import supported_intervals as every_interval
from .core.model_geometry import GeometryError, ModelGeometry
from .core.model_presets import load_geometry
from .core.tiers import PlacementRules, TierSpec
from .exposure import is_loopback, read_secret
from .yamlfile import read_yaml

__all__ = [
    "DISK_TIER_KEYS",
    "PLATFORMS",
    "POLICIES",
    "SCHEMES",
    "ConfigError",
    "CoreKnobs",
    "HiStateConfig",
    "SharedIndexConfig",
    "SharedTierConfig",
    "cache_config",
    "load_config",
    "parse_config",
    "parse_disk_tier",
    "redacted_url",
]

POLICIES = ("histate", "lru")
"""``histate``: HiState placement + unified H eviction; ``lru``: stock LMCache LRU (baseline)."""
PLATFORMS = ("auto", "cpu", "cuda")
MAX_DISK_IO_WORKERS = 64
"""NOTE 2: the most disk I/O threads a server may ask for."""
DISK_IO = ("thread",)
"""Disk I/O engines (benchmarks/README.md "disk_io": a thread pool beat aiofiles)."""
SCHEMES = ("redis", "rediss", "unix")
"""URL schemes of ``shared_index.url`` (NOTE 3)."""
MIN_SECRET = 16
"""Shortest accepted shared secret in ``auth_token_file``, in characters (NOTE 4)."""
SHARED_INDEX = "shared_index"
SHARED_TIER = "shared_tier"
DAY = 86_400.0
UPPER_BOUNDS: Mapping[str, tuple[float, str]] = {
    "max_model_tokens": (
        1 << 24, "16 times the default; above the longest context any engine serves, and "
        "histate.plan's work and the hooks' chain work grow with it"),
    "max_interval_chunks": (
        1 << 16, "the plan weighs one interval per multiple of chunk_size up to it: 65,536 "
        "chunks pass 10^6 tokens even at 16-token chunks"),
    "session_ttl_s": (
        30 * DAY, "30 days: an idle session's chain stays in the core until then; a larger "
        "value is taken for a unit mistake"),
    "request_ttl_s": (DAY, "a day: a request not ended by then is a leak, not a request"),
    "tau": (
        1e9, "10^9 s: beyond it recency no longer changes any eviction score; a larger "
        "value is taken for a unit mistake"),
    **{f"{section}.{key}": bound for section in (SHARED_INDEX, SHARED_TIER) for key, bound in {
        "connect_timeout_s": (
            60.0, "a Redis call blocks the request it serves; the server degrades instead"),
        "op_timeout_s": (
            60.0, "a Redis call blocks the request it serves; the server degrades instead"),
        "lease_ttl_s": (DAY, "a dead server's leases block eviction this long"),
        "claim_ttl_s": (DAY, "a dead server's claims block eviction this long"),
        "write_ttl_s": (DAY, "a dead server's reservations hold budget this long"),
        "retry_s": (3600.0, "an hour between probes of an unreachable Redis"),
    }.items()},
}
"""NOTE 6: the fixed upper bound of each key, with the reason the message gives."""
SHOWN = 80
"""Characters of a bad value quoted in a message (a YAML value may be megabytes)."""
_NAME = re.compile(r"[A-Za-z0-9._/-]{1,128}")


class ConfigError(ValueError):
    """The configuration is invalid; the message names every offending key."""


def redacted_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (safe to log)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


@dataclass(frozen=True)
class SharedIndexConfig:
    """A validated ``shared_index`` section (NOTE 3)."""

    url: str
    deployment: str
    instance: str
    password_file: str | None = None
    tls_ca_file: str | None = None
    connect_timeout_s: float = 1.0
    op_timeout_s: float = 0.25
    lease_ttl_s: float = 30.0
    claim_ttl_s: float = 60.0
    write_ttl_s: float = 120.0
    retry_s: float = 2.0

    @property
    def tls(self) -> bool:
        return self.url.startswith("rediss://")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __repr__(self) -> str:
        return f"SharedIndexConfig(url={redacted_url(self.url)!r}, deployment={self.deployment!r})"


SHARED_INDEX_ALLOWED = tuple(f.name for f in fields(SharedIndexConfig))


@dataclass(frozen=True)
class SharedTierConfig:
    """A validated ``shared_tier`` section (NOTE 8)."""

    nodes: tuple[str, ...]
    deployment: str
    instance: str
    budget_gib: float
    key_prefix: str = "histate-obj"
    username: str | None = None
    password_file: str | None = None
    tls: bool = False
    tls_ca_file: str | None = None
    connect_timeout_s: float = 0.5
    op_timeout_s: float = 2.0
    lease_ttl_s: float = 30.0
    claim_ttl_s: float = 60.0
    write_ttl_s: float = 120.0
    retry_s: float = 2.0

    @property
    def budget_bytes(self) -> int:
        return int(self.budget_gib * 2**30)

    def index_config(self) -> SharedIndexConfig:
        """The shared index's settings for the tier's entries (its URL names the first
        startup node, for log lines; the client is a cluster client)."""
        user = f"{self.username}@" if self.username else ""
        scheme = "rediss" if self.tls else "redis"
        return SharedIndexConfig(
            url=f"{scheme}://{user}{self.nodes[0]}/0", deployment=self.deployment,
            instance=self.instance, password_file=self.password_file,
            tls_ca_file=self.tls_ca_file, connect_timeout_s=self.connect_timeout_s,
            op_timeout_s=self.op_timeout_s, lease_ttl_s=self.lease_ttl_s,
            claim_ttl_s=self.claim_ttl_s, write_ttl_s=self.write_ttl_s, retry_s=self.retry_s,
        )

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["nodes"] = list(self.nodes)
        return out


SHARED_TIER_ALLOWED = tuple(f.name for f in fields(SharedTierConfig))
_NODE = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253}):(\d{1,5})")
_SHARED_INDEX_TIMES = ("connect_timeout_s", "op_timeout_s", "lease_ttl_s", "claim_ttl_s",
                       "write_ttl_s", "retry_s")


@dataclass(frozen=True)
class CoreKnobs:
    """The server keys that set the core's eviction and interval rule: ``CacheConfig``
    knobs of the same names, defaults ``CacheConfig``'s (NOTE 9).

    ``supported_intervals``: the intervals the YAML lists, in tokens (None: every multiple
    of the chunk up to ``max_interval_chunks`` chunks).
    """

    tau: float | None = config_default("tau")
    refresh_all: bool = config_default("refresh_all")
    exposed_ends: bool = config_default("exposed_ends")
    hit_positions: str = config_default("hit_positions")
    end_probability_prior: float = config_default("end_probability_prior")
    ema_alpha: float = config_default("ema_alpha")
    initial_pressure_factor: float = config_default("initial_pressure_factor")
    max_interval_chunks: int = config_default("max_interval_chunks")
    supported_intervals: tuple[int, ...] | None = None


CORE_KNOBS = tuple(f.name for f in fields(CoreKnobs))
"""The server keys :class:`CoreKnobs` holds."""


def cache_config(
    knobs: CoreKnobs,
    *,
    chunk_tokens: int,
    kv_chunk_bytes: int,
    snapshot_bytes: int,
    tiers: Sequence[TierSpec],
    rules: PlacementRules,
    **engine: Any,
) -> CacheConfig:
    """The core's configuration from the server schema's rule (NOTE 9): the one mapping
    into ``CacheConfig``, which the server and the simulator's HiState rows both use.

    ``chunk_tokens`` / ``kv_chunk_bytes`` / ``snapshot_bytes``: the model's sizes;
    ``tiers`` and ``rules``: the process's tiers and where each part goes; ``engine``: the
    ``CacheConfig`` fields no server key sets (the engine's step grid and price, the cost
    model's ``attention_tokens``, ``recency_tiers``; the simulator's ablation knobs). The
    supported intervals are the listed ones that are multiples of ``chunk_tokens`` (None
    if none is), or every multiple up to ``max_interval_chunks`` chunks.
    """
    listed = knobs.supported_intervals
    intervals = (
        tuple(i for i in listed if i % chunk_tokens == 0) or None
        if listed
        else every_interval(chunk_tokens, knobs.max_interval_chunks)
    )
    rule = {name: getattr(knobs, name) for name in CORE_KNOBS}
    rule["supported_intervals"] = intervals
    return CacheConfig(
        chunk_tokens=chunk_tokens,
        kv_chunk_bytes=kv_chunk_bytes,
        snapshot_bytes=snapshot_bytes,
        tiers=tuple(tiers),
        rules=rules,
        **rule,
        **engine,
    )


@dataclass(frozen=True)
class HiStateConfig:
    """A validated single-instance HiState server configuration (see configs/histate.yaml)."""

    model: str
    chunk_size: int | str  # tokens, or "auto" until the launcher resolves it (NOTE 1)
    cpu_gib: float
    disk_path: str
    disk_gib: float
    policy: str = "histate"
    # The core's knobs: their defaults are CacheConfig's (core/cache.py).
    tau: float | None = config_default("tau")  # None = "auto": calibrated online
    supported_intervals: tuple[int, ...] | None = None
    max_interval_chunks: int = config_default("max_interval_chunks")
    cpu_fill: float = 0.75
    refresh_all: bool = config_default("refresh_all")
    exposed_ends: bool = config_default("exposed_ends")
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
    # A shared tier on a Redis Cluster for the nodes of a deployment (NOTE 6).
    shared_tier: SharedTierConfig | None = None

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

    @property
    def knobs(self) -> CoreKnobs:
        """The keys that set the core's rule (:func:`cache_config` maps them)."""
        return CoreKnobs(**{name: getattr(self, name) for name in CORE_KNOBS})

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, SharedIndexConfig | SharedTierConfig):
                value = value.to_dict()
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def with_overrides(self, **changes: Any) -> HiStateConfig:
        """A copy with some values replaced (re-validated)."""
        return parse_config({**self.to_dict(), **changes})


REQUIRED = ("model", "chunk_size", "cpu_gib", "disk_path", "disk_gib")
ALLOWED = tuple(f.name for f in fields(HiStateConfig))
DISK_TIER_KEYS = (
    "disk_path", "disk_gib", "disk_io_workers", "disk_fsync", "disk_direct_io", "disk_adopt",
    "shared_index",
)
"""The server keys the disk adapter takes as its ``adapter_params`` (NOTE 5)."""
INDEX_MODEL = "index_model"
"""The one ``adapter_params`` key that is not a server key: the shared index's model
namespace, which the launcher derives from ``model`` (NOTE 5)."""
DISK_TIER_REQUIRED = ("disk_path", "disk_gib")
ENGINE_DTYPES = ("auto", "bfloat16", "float16", "float32")
"""Values of the engine-dtype keys (vLLM's ``--dtype`` / ``--mamba-ssm-cache-dtype``)."""


# ---------------------------------------------------------------- validators
def _show(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}... ({len(text)} characters)"


def _at_most(key: str, value: float | None, errors: list[str]) -> float | None:
    """``value`` unless above ``UPPER_BOUNDS[key]`` (NOTE 6); None passes through."""
    bound, why = UPPER_BOUNDS[key]
    if value is not None and value > bound:
        errors.append(f"{key}: must be at most {bound:g} ({why}), got {_show(value)}")
        return None
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _positive_number(key: str, value: Any, errors: list[str], unit: str = "") -> float | None:
    """``unit``: what the number counts, named in the message (e.g. ``" (seconds)"``)."""
    if not _is_number(value) or value <= 0:
        errors.append(f"{key}: must be a positive number{unit}, got {_show(value)}")
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
    _check_keys(data, ALLOWED, REQUIRED, errors)
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
    if get("cpu_gib") is not None:
        values["cpu_gib"] = _gib("cpu_gib", get("cpu_gib"), errors)
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
            values[key] = _at_most(key, _positive_number(key, get(key), errors), errors)
    if "tau" in data and get("tau") not in ("auto", None):
        tau = get("tau")
        if not _is_number(tau) or tau < 0:
            errors.append(f"tau: must be 'auto' or a number ≥ 0 (seconds), got {_show(tau)}")
        else:
            values["tau"] = _at_most("tau", float(tau), errors)
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
    for key in ("max_interval_chunks", "max_model_tokens"):
        if key in data:
            values[key] = _at_most(key, _positive_int(key, get(key), errors), errors)
    _check_token_bounds(values, errors)
    for key in ("port", "http_port"):
        if key in data:
            values[key] = _port(key, get(key), errors)
    for key in ("host", "http_host", "kv_connector"):
        if key in data:
            values[key] = _text(key, get(key), errors)
    if values.get("host") is not None and ":" in values["host"]:  # NOTE 7
        errors.append(
            f"host: {_show(values['host'])} is an IPv6 address; LMCache binds its ZMQ "
            "port over IPv4 only: use 127.0.0.1 (http_host may be IPv6)"
        )
        values["host"] = None
    for key in ("refresh_all", "exposed_ends", "allow_remote"):
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
        longest = max(values["supported_intervals"] or (0,))
        limit = values.get("max_model_tokens") or HiStateConfig.max_model_tokens
        if longest > limit:
            errors.append(
                f"supported_intervals: every entry must be at most max_model_tokens "
                f"({limit}): a longer interval is never reached; got {longest}"
            )
    _check_disk_tier(data, values, values.get("port"), base_dir, errors)
    _check_exposure(data, values, base_dir, errors)
    if get(SHARED_TIER) is not None:
        values[SHARED_TIER] = parse_shared_tier(get(SHARED_TIER), values.get("port"), base_dir,
                                                errors)
    port, http_port = values.get("port", 5555), values.get("http_port", 8080)
    if port is not None and port == http_port:
        errors.append("http_port: must differ from port (both are opened by the server)")
    _raise_if_any(errors)
    clean = {k: v for k, v in values.items() if v is not None}
    return HiStateConfig(**clean)


def _check_token_bounds(values: dict[str, Any], errors: list[str]) -> None:
    """``chunk_size`` within ``max_model_tokens`` (NOTE 6)."""
    limit = values.get("max_model_tokens") or HiStateConfig.max_model_tokens
    chunk = values.get("chunk_size")
    if isinstance(chunk, int) and chunk > limit:
        errors.append(
            f"chunk_size: must be at most max_model_tokens ({limit}): a chunk longer than "
            f"the longest prompt never completes, so nothing would be stored; got {chunk}"
        )
        values["chunk_size"] = None


def parse_disk_tier(data: Any) -> dict[str, Any]:
    """Validate the disk adapter's ``adapter_params`` (NOTE 5) with ``parse_config``'s checks.

    Returns every key of ``DISK_TIER_KEYS`` and ``INDEX_MODEL``, absent ones at
    ``HiStateConfig``'s defaults (``index_model``: ``"model"``). A relative ``disk_path``
    is kept as given: there is no YAML file to resolve it against.

    Raises:
        ConfigError: listing every problem, in the words ``parse_config`` uses.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"adapter_params must be a mapping, got {type(data).__name__}")
    errors: list[str] = []
    _check_keys(data, (*DISK_TIER_KEYS, INDEX_MODEL), DISK_TIER_REQUIRED, errors)
    values: dict[str, Any] = {}
    _check_disk_tier(data, values, None, None, errors)
    model = data.get(INDEX_MODEL, "model")
    values[INDEX_MODEL] = _text(INDEX_MODEL, model, errors)
    _raise_if_any(errors)
    defaults = {f.name: f.default for f in fields(HiStateConfig)
                if f.name in DISK_TIER_KEYS and f.name not in DISK_TIER_REQUIRED}
    return {**defaults, **values}


def _check_keys(
    data: Mapping[Any, Any], allowed: Sequence[str], required: Sequence[str], errors: list[str]
) -> None:
    for key in sorted(str(k) for k in data if k not in allowed):
        errors.append(f"{key}: unknown key; allowed keys: {', '.join(allowed)}")
    for key in required:
        if key not in data or data[key] is None:
            errors.append(f"{key}: required key is missing")


def _raise_if_any(errors: list[str]) -> None:
    if len(errors) == 1:  # one problem, one line
        raise ConfigError(f"invalid HiState configuration: {errors[0]}")
    if errors:
        raise ConfigError("invalid HiState configuration:\n  " + "\n  ".join(errors))


def _resolve(path: str, base_dir: Path | None) -> Path:
    """``path`` with ``~`` expanded; relative to ``base_dir`` (the YAML's folder) if given."""
    p = Path(path).expanduser()
    return base_dir / p if base_dir is not None and not p.is_absolute() else p


def _gib(key: str, value: Any, errors: list[str]) -> float | None:
    """A size in GiB. Sizes are turned into whole bytes: one that rounds to 0 would start
    nothing."""
    gib = _positive_number(key, value, errors)
    if gib is not None and int(gib * 2**30) < 1:
        errors.append(
            f"{key}: {gib:g} GiB rounds to 0 bytes; must be at least 1 byte "
            f"({1 / 2**30:.3g} GiB)"
        )
        return None
    return gib


def _check_disk_tier(
    data: Mapping[str, Any],
    values: dict[str, Any],
    port: int | None,
    base_dir: Path | None,
    errors: list[str],
) -> None:
    """The keys of ``DISK_TIER_KEYS`` present in ``data`` into ``values`` (NOTE 5).

    ``port`` names the shared index instance when the section gives none.
    """
    get = data.get
    if get("disk_path") is not None:
        path = _text("disk_path", get("disk_path"), errors)
        if path is not None:
            p = _resolve(path, base_dir)
            if p.exists() and not p.is_dir():
                errors.append(f"disk_path: {str(p)!r} exists and is not a directory")
            values["disk_path"] = str(p)
    if get("disk_gib") is not None:
        values["disk_gib"] = _gib("disk_gib", get("disk_gib"), errors)
    if "disk_io_workers" in data:
        workers = _positive_int("disk_io_workers", get("disk_io_workers"), errors)
        if workers is not None and workers > MAX_DISK_IO_WORKERS:
            errors.append(
                f"disk_io_workers: must be at most {MAX_DISK_IO_WORKERS} (threads of one disk "
                f"tier), got {workers}"
            )
            workers = None
        values["disk_io_workers"] = workers
    for key in ("disk_fsync", "disk_direct_io", "disk_adopt"):
        if key in data:
            values[key] = _boolean(key, get(key), errors)
    if get(SHARED_INDEX) is not None:
        values[SHARED_INDEX] = _shared_index(get(SHARED_INDEX), port, base_dir, errors)


# ---------------------------------------------------------------- shared_index (NOTE 3)
def _shared_index(
    value: Any, port: int | None, base_dir: Path | None, errors: list[str]
) -> SharedIndexConfig | None:
    """Validate the section; problems go to ``errors``, each naming ``shared_index.<key>``.

    ``port`` (the server's ZMQ port) names the instance when ``instance`` is not given.
    """
    if not isinstance(value, Mapping):
        errors.append(
            f"{SHARED_INDEX}: must be a mapping with at least 'url' and 'deployment', "
            f"got {value!r}"
        )
        return None
    n0 = len(errors)
    for key in sorted(str(k) for k in value if k not in SHARED_INDEX_ALLOWED):
        errors.append(
            f"{SHARED_INDEX}.{key}: unknown key; allowed keys: {', '.join(SHARED_INDEX_ALLOWED)}"
        )
    out: dict[str, Any] = {}
    out["url"] = _redis_url(value.get("url"), errors)
    for key in ("deployment", "instance"):
        raw = value.get(key)
        if raw is None and key == "instance":
            raw = f"{socket.gethostname()}-{port or 5555}"
            raw = re.sub(r"[^A-Za-z0-9._/-]", "_", raw)[:128]
        if not isinstance(raw, str) or not _NAME.fullmatch(raw):
            errors.append(
                f"{SHARED_INDEX}.{key}: must be 1-128 characters of [A-Za-z0-9._/-], "
                f"got {raw!r}"
            )
        out[key] = raw
    tls = isinstance(out["url"], str) and out["url"].startswith("rediss://")
    _redis_access(SHARED_INDEX, value, base_dir, tls, "a rediss:// (TLS) url", out, errors)
    if len(errors) > n0:
        return None
    return SharedIndexConfig(**out)


def _redis_access(
    section: str, value: Mapping[str, Any], base_dir: Path | None, tls: bool, tls_how: str,
    out: dict[str, Any], errors: list[str],
) -> None:
    """The timeouts, ``password_file`` and ``tls_ca_file`` of a Redis section
    (``shared_index``, ``shared_tier``) into ``out``; ``tls``: whether the section asks
    for TLS (``tls_how`` says how, for the message)."""
    for key in _SHARED_INDEX_TIMES:
        if key in value:
            name = f"{section}.{key}"
            out[key] = _at_most(name, _positive_number(name, value[key], errors, " (seconds)"),
                                errors)
    if value.get("password_file") is not None:
        out["password_file"] = _secret_file(
            f"{section}.password_file", value["password_file"], base_dir, errors, min_length=1,
        )
    ca = value.get("tls_ca_file")
    if ca is not None:
        path = _resolve(str(ca), base_dir)
        if not isinstance(ca, str) or not path.is_file():
            errors.append(f"{section}.tls_ca_file: must be a readable file, got {ca!r}")
        elif not tls:
            errors.append(f"{section}.tls_ca_file: only used with {tls_how}")
        out["tls_ca_file"] = str(path)


# ---------------------------------------------------------------- shared_tier (NOTE 8)
def parse_shared_tier(
    value: Any, port: int | None, base_dir: Path | None, errors: list[str]
) -> SharedTierConfig | None:
    """Validate the section; problems go to ``errors``, each naming ``shared_tier.<key>``.
    ``port`` (the server's ZMQ port) names the instance when ``instance`` is not given."""
    if not isinstance(value, Mapping):
        errors.append(f"{SHARED_TIER}: must be a mapping with at least 'nodes', 'deployment' "
                      f"and 'budget_gib', got {value!r}")
        return None
    n0 = len(errors)
    for key in sorted(str(k) for k in value if k not in SHARED_TIER_ALLOWED):
        errors.append(
            f"{SHARED_TIER}.{key}: unknown key; allowed keys: {', '.join(SHARED_TIER_ALLOWED)}"
        )
    out: dict[str, Any] = {}
    nodes = value.get("nodes")
    if isinstance(nodes, str):
        nodes = [nodes]
    if not isinstance(nodes, list) or not nodes or not all(
            isinstance(n, str) and (m := _NODE.fullmatch(n)) and 1 <= int(m.group(2)) <= 65535
            for n in nodes):
        errors.append(f"{SHARED_TIER}.nodes: required: a list of host:port startup nodes of "
                      f"the cluster (port 1..65535), got {nodes!r}"[:300])
    else:
        out["nodes"] = tuple(nodes)
    for key in ("deployment", "instance", "key_prefix", "username"):
        raw = value.get(key)
        if raw is None and key == "instance":
            raw = re.sub(r"[^A-Za-z0-9._/-]", "_", f"{socket.gethostname()}-{port or 5555}")[:128]
        if raw is None and key in ("key_prefix", "username"):
            continue
        if not isinstance(raw, str) or not _NAME.fullmatch(raw):
            errors.append(f"{SHARED_TIER}.{key}: must be 1-128 characters of [A-Za-z0-9._/-], "
                          f"got {raw!r}")
        out[key] = raw
    out["budget_gib"] = _gib(f"{SHARED_TIER}.budget_gib", value.get("budget_gib"), errors)
    if "tls" in value:
        out["tls"] = _boolean(f"{SHARED_TIER}.tls", value["tls"], errors)
    _redis_access(SHARED_TIER, value, base_dir, bool(out.get("tls")), "tls: true", out, errors)
    if len(errors) > n0:
        return None
    return SharedTierConfig(**{k: v for k, v in out.items() if v is not None})


def _redis_url(raw: Any, errors: list[str]) -> str | None:
    key = f"{SHARED_INDEX}.url"
    if not isinstance(raw, str) or not raw.strip():
        errors.append(f"{key}: required: a redis://, rediss:// or unix:// URL, got {raw!r}")
        return None
    try:
        parts = urlsplit(raw)
        port = parts.port
        password = parts.password
    except ValueError as exc:
        errors.append(f"{key}: not a valid URL ({exc})")
        return None
    shown = redacted_url(raw)
    if parts.scheme not in SCHEMES:
        errors.append(f"{key}: the scheme must be one of {', '.join(SCHEMES)}; got {shown!r}")
        return None
    if password is not None:  # NOTE 3
        errors.append(
            f"{key}: must not hold a password ({shown!r}); put it in "
            f"{SHARED_INDEX}.password_file (chmod 600)"
        )
        return None
    if parts.scheme == "unix":
        if not parts.path:
            errors.append(f"{key}: a unix:// URL needs the socket path, got {shown!r}")
            return None
    else:
        if not parts.hostname:
            errors.append(f"{key}: names no host, got {shown!r}")
            return None
        if port is not None and not 1 <= port <= 65535:
            errors.append(f"{key}: port must be in 1..65535, got {shown!r}")
            return None
        db = parts.path.strip("/")
        if db and not db.isdigit():
            errors.append(f"{key}: the path must be a database number (e.g. /0), got {shown!r}")
            return None
    return raw


# ---------------------------------------------------------------- exposure (NOTE 4)
def _check_exposure(
    data: Mapping[str, Any], values: dict[str, Any], base_dir: Path | None, errors: list[str]
) -> None:
    """``auth_token_file`` and, unless ``allow_remote``, loopback-only hosts (NOTE 4)."""
    remote = values.get("allow_remote", False)
    token = data.get("auth_token_file")
    if token is not None:
        values["auth_token_file"] = _secret_file("auth_token_file", token, base_dir, errors)
    elif remote:
        errors.append(
            "auth_token_file: required when allow_remote is true (a file holding the shared "
            "secret for HiState's RPCs and the HTTP API)"
        )
    if remote:
        return
    for key in ("host", "http_host"):
        host = values.get(key)
        if host is not None and not is_loopback(host):
            errors.append(
                f"{key}: {host!r} is not a loopback address; LMCache's ZMQ and HTTP APIs "
                "have no authentication: set allow_remote: true and auth_token_file to "
                "bind beyond this machine (docs/deployment.md, Security)"
            )


def _secret_file(
    key: str, value: Any, base_dir: Path | None, errors: list[str], min_length: int = MIN_SECRET
) -> str | None:
    """The absolute path of a secret file named by ``key``, or None with the problem in
    ``errors``: a regular file, not readable by group or others, holding at least
    ``min_length`` characters. The secret itself never appears in a message."""
    if not isinstance(value, str) or not value.strip():
        errors.append(f"{key}: must be a non-empty string (a file path), got {value!r}")
        return None
    p = _resolve(value, base_dir)
    try:
        st = p.stat()
        secret = read_secret(p) if stat.S_ISREG(st.st_mode) else ""
    except (OSError, UnicodeDecodeError) as exc:
        errors.append(f"{key}: cannot read {str(p)!r}: {exc}")
        return None
    if not stat.S_ISREG(st.st_mode):
        errors.append(f"{key}: {str(p)!r} is not a regular file")
    elif st.st_mode & 0o077:
        errors.append(
            f"{key}: {str(p)!r} is readable by other users (mode {st.st_mode & 0o777:o}); "
            "chmod 600 it"
        )
    elif len(secret) < min_length:
        errors.append(f"{key}: the secret in {str(p)!r} must be at least {min_length} characters")
    else:
        return str(p)
    return None


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

