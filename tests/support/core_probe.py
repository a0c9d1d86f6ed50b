"""White-box reads of a ``HiStateCache`` that only tests need (the facade does not offer
them: no caller of the core asks which unit would go next without evicting it)."""

from __future__ import annotations

from lmcache_histate.core.cache import HiStateCache


def next_victim(cache: HiStateCache, tier: int) -> tuple[int, float] | None:
    """The key of the unit ``cache.evict`` would push out of ``tier`` next, and its rank
    ``H`` (None: nothing can go). Like ``evict``, it re-ranks stale entries it meets."""
    found = cache._queue.victim(tier)
    return None if found is None else (found[0].key, found[1])
