"""The names of tiers and parts: tier specs, home tiers, part names, the two tier layouts.

Vocabulary shared by ``placement.TieredStore`` and its callers (the facade, the simulator,
the live runtime), who import it from here: a caller that names a tier or a part needs
no store.

* Tiers are numbered fast → slow; a ``TierSpec`` is a tier's name and capacity in bytes
  (≥ 0). A tier id is an index into a cache's ``tiers``, so ``1 << tier`` is the tier's bit
  in a node's ``kv_tiers`` / ``snap_tiers`` mask. The two layouts in use are named here,
  ``ServerTier`` and ``SimTier`` (NOTE 1).
* ``PlacementRules`` names the home tier of each kind of object: the KV tier, the
  snapshot tier for intermediate snapshots, the final tier for a session's final
  snapshot and the optional tier of its write-through copy. Every home must be a tier
  index (``TieredStore`` checks at construction).
* An object is one part (``KV`` or ``SNAPSHOT``) of one index node; where it lives is a
  bitmask (bit ``t`` = tier ``t``) on the node (``index.bits`` lists its tiers).

Names only, no code a store runs: its own module because nearly every caller of the core
names a tier or a part (the simulator's variants and baselines, the live runtime, the
disk and shared tiers, the configuration) without touching the store, and ``placement``
(where these would otherwise live) holds the store.

NOTE 1: the simulator and the live server use different tier layouts (the simulated
server models vLLM's GPU pool as tier 0; the live server's core starts at LMCache's L1),
so there are two sets of ids, each named once: ``ServerTier`` and ``SimTier``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

__all__ = [
    "KV",
    "SNAPSHOT",
    "PlacementRules",
    "ServerTier",
    "SimTier",
    "TierSpec",
]

KV = "kv"
SNAPSHOT = "snapshot"


class ServerTier(IntEnum):
    """The live server's tiers: LMCache's L1 (host memory), then the HiState disk tier."""

    CPU = 0
    DISK = 1


class SimTier(IntEnum):
    """The simulated server's exclusive hierarchy (``sim/variants.py``): GPU pool first."""

    GPU = 0
    CPU = 1
    DISK = 2


@dataclass(frozen=True, slots=True)
class TierSpec:
    name: str
    capacity: int

    def __post_init__(self) -> None:
        if self.capacity < 0:
            raise ValueError(f"tier {self.name!r}: capacity must be ≥ 0, got {self.capacity}")


@dataclass(frozen=True, slots=True)
class PlacementRules:
    """Home tier (index) of each kind of object."""

    kv_tier: int = 0
    snapshot_tier: int = 1
    final_tier: int = 0
    final_copy_tier: int | None = None
