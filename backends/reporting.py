"""What the runtime reports: snapshot plans, ``/status`` and consistency checks."""

from __future__ import annotations

from typing import Any

from .object_map import CPU, DISK, TIER_NAMES


class ReportingMixin:
    """``plan``, ``status`` and ``check`` of ``HiStateRuntime``."""

    def plan(self, start_tokens: int, input_tokens: int) -> list[int]:
        """Token positions whose states HiState wants saved for a new segment."""
        with self.lock:
            if self.core is None:
                return []
            return self.core.snapshot_plan(start_tokens, input_tokens)

    def status(self) -> dict[str, Any]:
        with self.lock:
            core = self.core
            out: dict[str, Any] = {
                "policy": self.cfg.policy,
                "model": None if self.model is None else list(self.model),
                "chunk_tokens": self.chunk,
                # What the server was configured for; the connector compares it with what
                # vLLM allocated at start (a mismatch is a SettingsError, not a silent 2x).
                "geometry": self.configured_geometry,
                "counters": dict(sorted(self.stats.items())),
                "pending_l1_retries": len(self._retry_l1),
                "queued_l1_events": len(self._events),
                "janitor_ticks": self.janitor_ticks,
                "requests": len(self.requests),
            }
            if self.adapter is not None:
                out["disk"] = self.adapter.report_status()
            if core is None:
                return out
            store = core.store
            segment = self.last_segment_tokens or self.chunk
            choice = core.interval.choose(segment)
            out.update(
                {
                    "kv_chunk_bytes": self.kv_chunk_bytes,
                    "snapshot_bytes": self.snapshot_bytes,
                    "nodes": len(core.index),
                    "sessions": len(core.index.sessions),
                    "objects": len(self.part_of),
                    "tiers": {
                        TIER_NAMES[t]: {"used_bytes": store.used[t],
                                        "capacity_bytes": store.tiers[t].capacity}
                        for t in (CPU, DISK)
                    },
                    "pressure_factor": core.interval.pressure_factor,
                    "interval_tokens": choice.interval,
                    "interval_segment_tokens": segment,
                    "end_probability": core.hit_model.end_probability,
                    # The eviction score's scale (core/score.py): tau in use, calibrated or
                    # configured, and the session re-access gap it is calibrated from.
                    **{f"eviction_{k}": v for k, v in core.score_status().items()
                       if k != "end_probability"},
                    "kv_residence_s": core.residence.kv_ema,
                    "snapshot_residence_s": core.residence.snapshot_ema,
                }
            )
            return out

    def check(self) -> None:
        """Core invariants plus object bookkeeping consistency (tests)."""
        with self.lock:
            if self.core is None:
                return
            self.core.check()
            for nk, parts in self.objects.items():
                for part, keys in parts.items():
                    assert self._tiers(nk, part), (nk, part, keys)
                    for key in keys:
                        assert self.part_of.get(key) == (nk, part)
