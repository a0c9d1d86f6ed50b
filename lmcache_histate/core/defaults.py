"""What every part of HiState shares: default knobs, tier ids, and ``N_s``. One source.

The server configuration (``lmcache_histate/config.py``), the simulator's configuration
(``sim/config.py``), the core's constructors and the backends import these names; no other
module writes the numbers. Invariants: ``0 < EMA_ALPHA <= 1``, ``0 <= END_PROBABILITY_PRIOR
<= 1``, ``MAX_INTERVAL_CHUNKS >= 1``; tier ids are indices into a cache's ``tiers`` (fastest
first), so ``1 << tier`` is the tier's bit in a node's ``kv_tiers`` / ``snap_tiers`` mask.

NOTE 1: the simulator and the live server use different tier layouts (the simulated
server models vLLM's GPU pool as tier 0; the live server's core starts at LMCache's L1), so
there are two sets of ids, each named once here: ``ServerTier`` and ``SimTier``.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = [
    "EMA_ALPHA",
    "END_PROBABILITY_PRIOR",
    "HIT_POSITION_MODES",
    "MAX_INTERVAL_CHUNKS",
    "PAPER_TAU_S",
    "ServerTier",
    "SimTier",
    "snapshot_tokens",
]

# Weight of the newest sample in every EMA of the core (residence times, p_end, re-access gap).
EMA_ALPHA = 0.05
# p_end before any access was seen: a session resumes at its end with this probability.
END_PROBABILITY_PRIOR = 0.9
# The largest snapshot interval offered to the interval controller, in chunks.
MAX_INTERVAL_CHUNKS = 64
# The paper's fixed recency scale of the eviction score, seconds (the simulator's default;
# the live server calibrates tau online by default, ``core/score.py``).
PAPER_TAU_S = 600.0
# Where internal hits land inside a segment: learned online (``hit_positions``), or the
# paper's uniform model (the ablation).
HIT_POSITION_MODES = ("measured", "uniform")


class ServerTier(IntEnum):
    """The live server's tiers: LMCache's L1 (host memory), then the HiState disk tier."""

    CPU = 0
    DISK = 1


class SimTier(IntEnum):
    """The simulated server's exclusive hierarchy (``sim/variants.py``): GPU pool first."""

    GPU = 0
    CPU = 1
    DISK = 2


def snapshot_tokens(snapshot_bytes: float, kv_bytes_per_token: float) -> float:
    """``N_s`` of the paper: one snapshot's size in KV-token units (docs/design.md §2.2)."""
    if kv_bytes_per_token <= 0:
        raise ValueError(f"kv_bytes_per_token must be positive, got {kv_bytes_per_token}")
    return snapshot_bytes / kv_bytes_per_token
