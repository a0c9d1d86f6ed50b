"""One budget for the deployment: reserve before writing, evict by ``H`` when it is full.

``reserve_with_eviction`` is the write path's single entry point:

1. ``reserve`` the objects (one script): each is reserved under the deployment budget,
   already present (written by another server: write nothing), or over budget;
2. for the over-budget ones, ``claim`` the deficit from the deployment's ranking (lowest
   ``H`` first, never an object under a live load lease, never one claimed by another
   server: the claim is one script, so two servers never get the same victim);
3. delete the claimed files, ``drop`` the entries whose files are gone (a file that
   could not be deleted stays claimed; its claim expires and a reconcile takes it over);
4. ``reserve`` the over-budget objects once more; those still over budget are not
   written (the caller counts them not persisted, as the single-instance tier does).

Invariant: ``used`` (bytes of stored, writing and evicting entries) never exceeds the
budget through this path, and a file is deleted only by the server holding its claim.

While Redis is unreachable a server may delete only its own files, and only once every
lease granted before the outage has expired (``local_delete_allowed``): until then
another server may still be reading them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path

from .connection import IndexConnection
from .index import Reservation, SharedIndex, Victim

__all__ = ["Deleter", "delete_victims", "local_delete_allowed", "reserve_with_eviction"]

logger = logging.getLogger("lmcache_histate.shared_index")

Deleter = Callable[[list[Victim]], list[str]]


def delete_victims(root: Path) -> Deleter:
    """A deleter unlinking each victim's file under ``root``; returns the ids now gone."""

    def delete(victims: list[Victim]) -> list[str]:
        gone: list[str] = []
        for v in victims:
            try:
                (root / v.path).unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.warning("shared index: cannot delete %s: %s", v.path, exc)
                continue
            gone.append(v.id)
        return gone

    return delete


def reserve_with_eviction(
    index: SharedIndex, items: Iterable[tuple[str, int, str]], delete: Deleter
) -> Reservation | None:
    """Reserve ``(id, size, path)`` objects, evicting by ``H`` for the ones that do not
    fit (module docstring). None when Redis is unreachable (use the local budget)."""
    items = list(items)
    first = index.reserve(items)
    if first is None or not first.full:
        return first
    if first.deficit > 0:
        victims = index.claim(first.deficit)
        if victims:
            index.drop(delete(victims))
    full = set(first.full)
    again = index.reserve([it for it in items if it[0] in full])
    if again is None:
        return Reservation(first.reserved, first.present, first.full, first.deficit)
    return Reservation(
        first.reserved + again.reserved, first.present + again.present, again.full,
        again.deficit,
    )


def local_delete_allowed(conn: IndexConnection) -> bool:
    """Whether this server may delete its own files without a claim (module docstring)."""
    if not conn.degraded:
        return False
    return conn.degraded_for() >= conn.cfg.lease_ttl_s

