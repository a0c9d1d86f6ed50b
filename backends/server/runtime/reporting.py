"""What the runtime reports in ``/status`` (and, through it, ``/metrics``).

Reads the parts it is given; owns nothing. Called within the runtime's step.
"""

from __future__ import annotations

from typing import Any

from lmcache_histate.config import HiStateConfig
from lmcache_histate.core.tiers import ServerTier

from .objects import ModelCore, ObjectMap
from .stats import Stats
from .tier_actions import TierActions

__all__ = ["StatusReport"]


class StatusReport:
    """Builds the runtime's ``/status`` document."""

    def __init__(
        self,
        cfg: HiStateConfig,
        model: ModelCore,
        objects: ObjectMap,
        actions: TierActions,
        stats: Stats,
    ) -> None:
        self.cfg = cfg
        self.model = model
        self.objects = objects
        self.actions = actions
        self.stats = stats

    def status(self, requests: int, segment_tokens: int) -> dict[str, Any]:
        """The document, with the runtime's ``requests`` in flight and the length of the
        last stored segment (``segment_tokens``, 0 before the first)."""
        model, core = self.model, self.model.core
        out: dict[str, Any] = {
            "policy": self.cfg.policy,
            "model": None if model.model is None else list(model.model),
            "chunk_tokens": model.chunk,
            # What the server was configured for; the connector compares it with what
            # vLLM allocated at start (a mismatch is a SettingsError, not a silent 2x).
            "geometry": model.configured_geometry,
            "counters": self.stats.counted(),
            "pending_l1_retries": len(self.actions.retry_l1),
            "queued_l1_events": len(self.actions.events),
            "janitor_ticks": self.stats["janitor_ticks"],
            "requests": requests,
        }
        disk = self.actions.disk
        if disk is not None:
            out["disk"] = disk.report_status()
        if core is None:
            return out
        stats = core.stats()
        segment = segment_tokens or model.chunk
        out.update(
            {
                "kv_chunk_bytes": model.kv_chunk_bytes,
                "snapshot_bytes": model.snapshot_bytes,
                "nodes": stats.nodes,
                "sessions": stats.sessions,
                "objects": len(self.objects),
                "tiers": {
                    tier.name.lower(): {"used_bytes": stats.used_bytes[tier],
                                        "capacity_bytes": stats.capacity_bytes[tier]}
                    for tier in ServerTier
                },
                "pressure_factor": stats.pressure_factor,
                "interval_tokens": core.interval_for(segment),
                "interval_segment_tokens": segment,
                "end_probability": stats.end_probability,
                # What the plans price step ends with: the engine's step grid and its
                # measured step price, as the latest plan request reported them.
                "step_tokens": stats.step_tokens,
                "step_price": stats.step_price,
                # The eviction score's scale (core/rank.py NOTE 4): tau in use, calibrated or
                # configured, and the session re-access gap it is calibrated from.
                "eviction_tau_s": stats.tau_s,
                "eviction_tau_calibrated": stats.tau_calibrated,
                "eviction_reaccess_gap_s": stats.reaccess_gap_s,
                "eviction_reaccess_samples": stats.reaccess_samples,
                **({} if stats.hit_position_samples is None else {
                    "eviction_hit_position_samples": stats.hit_position_samples,
                    "eviction_hit_position_spread": stats.hit_position_spread}),
                "kv_residence_s": stats.kv_residence_s,
                "snapshot_residence_s": stats.snapshot_residence_s,
                # exposed_ends (core/eviction.py NOTE 7): how long units leaving each tier
                # had sat unread, what a snapshot's end-hit weight is measured from.
                **({} if stats.dwell_s is None else {"eviction_dwell_s": {
                    tier.name.lower(): stats.dwell_s[tier] for tier in ServerTier}}),
            }
        )
        return out
