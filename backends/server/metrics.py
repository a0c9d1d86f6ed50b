"""HiState counters and gauges as OpenTelemetry instruments (served on ``GET /metrics``).

``lmcache server`` exports every OTel instrument of the process through its Prometheus
reader on the HTTP port. Counters are observable (read from the runtime at scrape time)
and appear with a ``_total`` suffix, e.g.::

    histate_snapshots_stored_total{tier="disk"}   snapshots placed on a tier
    histate_snapshots_evicted_total{tier="cpu"}   copies that left a tier by policy
                                                  (H-queue eviction, demotion, a final
                                                  snapshot's CPU copy released on retire)
    histate_snapshots_dropped_total{reason=...}   never kept / lost: not_placed (no room),
                                                  not_persisted (disk write failed or disk
                                                  full), lost_cpu / lost_disk (cleared,
                                                  corrupted or missing file)
    histate_kv_chunks_{stored,evicted}_total{tier}, histate_kv_chunks_demoted_total
    histate_hits_total{kind="end"|"internal"}     lookups resuming at a session's end /
                                                  inside a context
    histate_lookup_hit_tokens_estimate_total      tokens of those hits: an estimate, not
                                                  loads (vLLM may hold some already or
                                                  take fewer; NOTE 1)
    histate_loaded_tokens_total                   tokens written into vLLM's blocks by a
                                                  request's first RETRIEVE: what vLLM's
                                                  external_prefix_cache_hits counts
    histate_loaded_tokens_resumed_total           tokens RETRIEVE wrote again for requests
                                                  resumed after a preemption (vLLM does
                                                  not export these)
    histate_snapshot_interval_tokens              interval chosen for the latest segment
    histate_pressure_factor                       T_KV / T_state
    histate_step_tokens                           the engine's step grid the plans use
    histate_step_price_tokens                     its measured price of one step end
    histate_tier_used_bytes{tier}, histate_tier_capacity_bytes{tier}
    histate_shared_index_connected                with a shared_index section: 1 / 0
                                                  (degraded: serving the local view)
    histate_shared_index_calls{what}              calls, failures, skipped, outages, ...
    histate_shared_index_reregistered             objects registered again after an outage
    histate_shared_index_disk_bytes{what}         the deployment's used / budget / evicting
    histate_l2_objects_loaded{tier}               objects loaded from the node's own disk
                                                  tier ("disk") and from the shared tier
                                                  ("shared"): local and fleet hits apart
    histate_shared_tier_connected                 with a shared_tier section: 1 / 0
                                                  (degraded: the node's own tiers only)
    histate_shared_tier_calls{what}               calls, failures, skipped, outages, ...
    histate_shared_tier_bytes{what}               the deployment's used / budget / evicting

Every instrument has HELP text (``SERIES_HELP`` for the counters, the gauges' own).

NOTE 1 (counts and estimates): only ``histate_loaded_tokens_total`` counts what vLLM took:
the tokens a request's first RETRIEVE wrote into its blocks, equal to vLLM's
``vllm:external_prefix_cache_hits_total``. A lookup's hit is what the server found stored;
vLLM asks for it before it knows what its own prefix cache holds or whether it will load
at all (measured against a real agentic client with a 32 MiB KV pool: 442,368 tokens found,
0 loaded, 0 external hits). That series is named ``..._estimate`` so that no dashboard
reads it as recompute avoided.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .runtime.runtime import HiStateRuntime

logger = logging.getLogger("lmcache_histate.metrics")


def _series(runtime: HiStateRuntime) -> dict[str, Callable[[], list[tuple[float, dict]]]]:
    """Each counter's reader. Every series is a list of (runtime counter, labels): the
    counters are read by their declared keys (``runtime.stats``), and each key is read once
    here, so a key that is not declared fails at registration, not as a series of 0."""
    stats = runtime.stats

    def reader(pairs: list[tuple[str, dict]]) -> Callable:
        undeclared = [key for key, _labels in pairs if key not in stats]
        if undeclared:
            raise KeyError(f"/metrics reads undeclared runtime counters {undeclared}")
        return lambda: [(float(stats[key]), labels) for key, labels in pairs]

    def counter(prefix: str, label: str, values: tuple[str, ...]) -> Callable:
        return reader([(f"{prefix}.{v}", {label: v}) for v in values])

    def single(name: str) -> Callable:
        return reader([(name, {})])

    def dropped(part: str) -> Callable:
        return reader([(f"{part}_not_placed", {"reason": "not_placed"}),
                       (f"{part}_not_persisted", {"reason": "not_persisted"}),
                       (f"{part}_lost.cpu", {"reason": "lost_cpu"}),
                       (f"{part}_lost.disk", {"reason": "lost_disk"})])

    tiers = ("cpu", "disk")
    return {
        "histate_snapshots_stored": counter("snapshot_stored", "tier", tiers),
        "histate_snapshots_evicted": counter("snapshot_evicted", "tier", tiers),
        "histate_snapshots_dropped": dropped("snapshot"),
        "histate_kv_chunks_stored": counter("kv_stored", "tier", tiers),
        "histate_kv_chunks_evicted": counter("kv_evicted", "tier", tiers),
        "histate_kv_chunks_dropped": dropped("kv"),
        "histate_kv_chunks_demoted": single("kv_demoted"),
        "histate_hits": counter("hits", "kind", ("end", "internal")),
        "histate_lookup_hit_tokens_estimate": single("hit_tokens"),
        "histate_loaded_tokens": single("loaded_tokens"),
        "histate_loaded_tokens_resumed": single("loaded_tokens_resumed"),
        "histate_lookups": single("lookups"),
        "histate_objects_rejected": counter(
            "objects_rejected", "reason", ("gap", "unknown_chain")
        ),
    }


SERIES_HELP = {
    "histate_snapshots_stored": "Snapshots placed on a tier",
    "histate_snapshots_evicted": "Snapshot copies that left a tier by policy (eviction, "
                                 "demotion, a final snapshot's CPU copy released on retire)",
    "histate_snapshots_dropped": "Snapshots never kept or lost, by reason (not_placed, "
                                 "not_persisted, lost_cpu, lost_disk)",
    "histate_kv_chunks_stored": "KV chunks placed on a tier",
    "histate_kv_chunks_evicted": "KV chunk copies that left a tier by policy",
    "histate_kv_chunks_dropped": "KV chunks never kept or lost, by reason",
    "histate_kv_chunks_demoted": "KV chunks demoted from the CPU tier to disk",
    "histate_hits": "Lookups that found a prefix: resuming at a session's end or inside it",
    "histate_lookup_hit_tokens_estimate": (
        "ESTIMATE, not loads: prompt tokens the server's lookups found stored; vLLM may "
        "already hold them or load fewer (histate_loaded_tokens_total counts what it took)"
    ),
    "histate_loaded_tokens": (
        "Tokens a request's first RETRIEVE wrote into vLLM's blocks; equals vLLM's "
        "vllm:external_prefix_cache_hits_total"
    ),
    "histate_loaded_tokens_resumed": (
        "Tokens RETRIEVE wrote for requests resumed after a preemption (vLLM does not "
        "export these)"
    ),
    "histate_lookups": "Lookups the server answered",
    "histate_objects_rejected": "Stored objects refused, by reason (gap, unknown_chain)",
}
"""HELP text of each counter of ``_series`` (NOTE 1 for the two token counters)."""


def _connected(part: dict) -> list[tuple[float, dict]]:
    """1 / 0: a Redis-backed part's connection (shared index, shared tier) is up."""
    return [(float(part["mode"] == "connected"), {})]


def _calls(part: dict) -> list[tuple[float, dict]]:
    return [(float(v), {"what": k}) for k, v in part["connection"].items()]


def _usage(part: dict) -> list[tuple[float, dict]]:
    return [(float(part[f"{k}_bytes"]), {"what": k})
            for k in ("used", "budget", "evicting") if f"{k}_bytes" in part]


def _gauges(runtime: HiStateRuntime) -> dict[str, tuple[str, Callable]]:
    def status_value(key: str) -> Callable:
        def read() -> list[tuple[float, dict]]:
            value = runtime.status().get(key)
            return [] if value is None else [(float(value), {})]

        return read

    def tier(field: str) -> Callable:
        def read() -> list[tuple[float, dict]]:
            tiers = runtime.status().get("tiers") or {}
            return [(float(t[field]), {"tier": name}) for name, t in tiers.items()]

        return read

    def shared(read_part: Callable[[dict], list[tuple[float, dict]]]) -> Callable:
        """A series of the disk tier's shared-index status (none without the section)."""
        def read() -> list[tuple[float, dict]]:
            part = (runtime.status().get("disk") or {}).get("shared_index")
            return [] if part is None else read_part(part)

        return read

    def shared_tier(read_part: Callable[[dict], list[tuple[float, dict]]]) -> Callable:
        """A series of the shared tier's status (none without the section)."""
        def read() -> list[tuple[float, dict]]:
            part = runtime.status().get("shared_tier")
            return [] if part is None else read_part(part)

        return read

    def loaded() -> list[tuple[float, dict]]:
        status = runtime.status()
        return [(float(((status.get(name) or {}).get("stats") or {}).get("objects_loaded", 0)),
                 {"tier": tier}) for name, tier in (("disk", "disk"), ("shared_tier", "shared"))
                if status.get(name) is not None]

    return {
        "histate_l2_objects_loaded": (
            "Objects loaded from the node's own disk tier and from the shared tier", loaded,
        ),
        "histate_shared_tier_connected": (
            "1 while the shared tier's cluster answers, 0 while degraded (own tiers only)",
            shared_tier(_connected),
        ),
        "histate_shared_tier_calls": (
            "Shared tier connection counters (calls, failures, skipped while degraded, "
            "outages, recoveries, probes)",
            shared_tier(_calls),
        ),
        "histate_shared_tier_bytes": (
            "The deployment's shared tier: used, budget and being-evicted bytes",
            shared_tier(_usage),
        ),
        "histate_shared_index_connected": (
            "1 while the shared index's Redis answers, 0 while degraded (local view)",
            shared(_connected),
        ),
        "histate_shared_index_calls": (
            "Shared index connection counters (calls, failures, skipped while degraded, "
            "outages, recoveries, probes)",
            shared(_calls),
        ),
        "histate_shared_index_reregistered": (
            "Objects this server registered again after Redis returned",
            shared(lambda p: [(float(p["registrar"].get("reregistered", 0)), {})]),
        ),
        "histate_shared_index_disk_bytes": (
            "The deployment's shared disk tier: used, budget and being-evicted bytes",
            shared(_usage),
        ),
        "histate_snapshot_interval_tokens": (
            "Snapshot interval (tokens) chosen for the latest segment", status_value(
                "interval_tokens"
            )
        ),
        "histate_pressure_factor": (
            "Interval controller pressure factor T_KV / T_state", status_value("pressure_factor")
        ),
        "histate_step_tokens": (
            "The engine's step grid the plans use (tokens; absent until reported)",
            status_value("step_tokens"),
        ),
        "histate_step_price_tokens": (
            "Price of one extra prefill step end the plans use (tokens of prefill time)",
            status_value("step_price"),
        ),
        "histate_end_probability": (
            "Estimated probability that an access continues a session from its end",
            status_value("end_probability"),
        ),
        "histate_sessions": ("Live sessions tracked by the policy core", status_value("sessions")),
        "histate_eviction_tau_seconds": (
            "Eviction score scale tau in use (seconds of recency per e-fold of loss per byte)",
            status_value("eviction_tau_s"),
        ),
        "histate_eviction_reaccess_gap_seconds": (
            "EMA of the gap between a session's consecutive requests (calibrates tau)",
            status_value("eviction_reaccess_gap_s"),
        ),
        "histate_tier_used_bytes": ("Bytes the policy core holds per tier", tier("used_bytes")),
        "histate_tier_capacity_bytes": (
            "Bytes the policy core may hold per tier", tier("capacity_bytes")
        ),
    }


def register_metrics(runtime: HiStateRuntime) -> None:
    """Create the instruments reading ``runtime``, once (``runtime.metrics_registered``).

    OTel keeps an instrument's first registration per process, so a second runtime's
    instruments would not be read: there is one runtime per server process
    (``policies.install`` refuses a second)."""
    if runtime.metrics_registered:
        return
    try:
        from opentelemetry import metrics as otel
    except ImportError:
        logger.info("opentelemetry not installed: HiState metrics only in /status")
        return
    meter = otel.get_meter("lmcache_histate")

    def callback(read: Callable) -> Callable:
        def cb(_options: object) -> list:
            try:
                return [otel.Observation(v, attrs) for v, attrs in read()]
            except Exception:
                logger.exception("HiState metric callback failed")
                return []

        return cb

    for name, read in _series(runtime).items():
        meter.create_observable_counter(name, callbacks=[callback(read)],
                                        description=SERIES_HELP[name])
    for name, (description, read) in _gauges(runtime).items():
        meter.create_observable_gauge(name, callbacks=[callback(read)], description=description)
    runtime.metrics_registered = True


def register_disk_metrics(disk: Any) -> None:
    """The disk tier's write-behind gauges (``disk.tier`` NOTE 10), for every policy; call
    once per process (from the server module's factory):

    * ``histate_disk_write_lag_seconds``: age of the oldest accepted, unfinished write,
      i.e. how long an acknowledged object has waited in memory for the disk; new writes
      are refused (``not_persisted_backlog``) while it is over
      ``histate_disk_write_lag_bound_seconds``;
    * ``histate_disk_writes_pending``: accepted write tasks not finished.
    """
    try:
        from opentelemetry import metrics as otel
    except ImportError:
        return
    meter = otel.get_meter("lmcache_histate.disk")
    gauges: dict[str, tuple[str, Callable[[], float]]] = {
        "histate_disk_write_lag_seconds": (
            "Age of the oldest accepted, unfinished disk write (acknowledged objects wait "
            "this long in memory)", disk.backlog.lag_s),
        "histate_disk_write_lag_bound_seconds": (
            "No new disk write is accepted while the lag is over this bound",
            lambda: disk.backlog.max_lag_s),
        "histate_disk_writes_pending": (
            "Disk write tasks accepted and not finished", lambda: disk.backlog.pending),
    }
    for name, (description, read) in gauges.items():
        meter.create_observable_gauge(
            name, description=description,
            callbacks=[lambda _o, read=read: [otel.Observation(float(read()), {})]],
        )
