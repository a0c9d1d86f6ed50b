"""The runtime's counters, under keys declared once: a typo fails instead of reading 0.

``/status`` reports them (``counters``) and ``/metrics`` reads them by name (``metrics``);
the runtime's parts and the server module add to them (``stats[key] += n``). The keys are
built here from their parts: for each part (``kv``, ``snapshot``) and tier (``cpu``,
``disk``) what placement did to it (``PART_TIER_EVENTS``), per part what has no tier
(``PART_EVENTS``), and the rest by name (``KEYS``).

Invariant: ``Stats`` holds exactly the declared keys, each an ``int`` >= 0 that only grows
(``check``). Reading or adding to an undeclared key raises ``KeyError`` naming it (NOTE 1).

NOTE 1 (a dict of declared keys, no Python call per count). Every key is present from the
start (at 0), so ``stats[key] += n`` and ``stats[key]`` are the dict's own C lookups: a
count on the store path costs what a ``Counter``'s did and enters no module of ours. An
undeclared key is missing, and a missing key is where the dict calls ``__missing__``,
which raises; ``+=`` reads before it writes, so a typo fails there. A bare assignment of a
new key (``stats[key] = n``; a counter is only ever added to) and ``update`` would not be
caught by the dict itself: ``update`` and ``setdefault`` refuse undeclared keys here, and
``check`` finds any other stray key. Overriding ``__setitem__`` would catch assignment
too, at the price of a Python call in every ``+=``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lmcache_histate.core.tiers import KV, SNAPSHOT, ServerTier

__all__ = ["KEYS", "Stats"]

PARTS = (KV, SNAPSHOT)
TIERS = tuple(t.name.lower() for t in ServerTier)
PART_TIER_EVENTS = ("stored", "evicted", "lost")
"""``{part}_{event}.{tier}``: placed on a tier, left it by policy, lost from it."""
PART_EVENTS = ("demoted", "not_placed", "not_persisted", "demote_missing")
"""``{part}_{event}``: CPU -> disk, refused for room, a failed disk write, a demotion
whose objects were no longer in L1."""
HOOKS = ("store", "lookup", "end_session")
"""The server module's guarded hooks: ``over_max_model_tokens.{hook}``, ``errors.{hook}``."""
NAMED = (
    "lookups", "hits.end", "hits.internal", "hit_tokens",
    "objects_rejected.gap", "objects_rejected.unknown_chain", "objects_joined",
    "commits.queued", "commits.unseen", "shared_tier.routed",
    "rerank_sweeps", "l1_policy_evictions", "disk_capacity_changes", "janitor_ticks",
    "restart_adopted", "restart_orphans_removed",
    "errors.retrieve", "loaded_tokens", "loaded_tokens_resumed",
)

KEYS: frozenset[str] = frozenset(
    [f"{p}_{e}.{t}" for p in PARTS for e in PART_TIER_EVENTS for t in TIERS]
    + [f"{p}_{e}" for p in PARTS for e in PART_EVENTS]
    + [f"{what}.{h}" for what in ("over_max_model_tokens", "errors") for h in HOOKS]
    + list(NAMED)
)
"""Every counter the runtime keeps."""


class Stats(dict[str, int]):
    """The runtime's counters: every key of ``KEYS`` at 0, no other (module doc)."""

    def __init__(self, keys: Iterable[str] = KEYS) -> None:
        super().__init__(dict.fromkeys(sorted(keys), 0))

    def __missing__(self, key: str) -> int:
        raise KeyError(f"no runtime counter {key!r} (declared in runtime/stats.py)")

    def update(self, *args: Any, **kwargs: int) -> None:
        new = dict(*args, **kwargs)
        for key in new.keys() - self.keys():
            self.__missing__(key)
        super().update(new)

    def setdefault(self, key: str, default: int = 0) -> int:
        return self[key]  # never adds a key

    def check(self) -> None:
        """Assert the invariant of the module doc."""
        stray = sorted(set(self) - KEYS)
        assert not stray, f"undeclared runtime counters {stray}"
        negative = sorted(k for k, v in self.items() if v < 0)
        assert not negative, f"runtime counters below 0: {negative}"

    def counted(self) -> dict[str, int]:
        """The counters above 0, by name (what ``/status`` reports)."""
        return {k: v for k, v in sorted(self.items()) if v}
