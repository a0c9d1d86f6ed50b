"""The shared index: several HiState servers over one disk tier, coordinated through Redis.

One concept per module (``docs/shared-index.md`` has the design and the key layout):

* ``layout``: key names of a (deployment, model) namespace, entry fields, ``ObjectRecord``;
* ``scripts``: the Lua scripts (reserve, commit, lookup + lease, claim, drop, forget,
  rescore, EMA steps, sessions): every state change of an entry is one atomic script;
* ``connection``: the redis-py client with bounded waits, degraded mode and counters;
* ``index``: ``SharedIndex``, the API a server calls, one round trip per call;
* ``budget``: the write path under one deployment budget, evicting by ``H``;
* ``registration``: the server's own objects, re-registered when Redis returns;
* ``reconcile``: orphan files, stale entries, dead writers' and claimants' leftovers;
* ``deployment``: the runtime's side: its core's score inputs, residence samples and
  session starts published, the deployment's EMAs read back (janitor tick).

``open_index`` builds the pieces from a validated ``SharedIndexConfig``.
"""

from __future__ import annotations

from lmcache_histate.config import SharedIndexConfig

from .connection import IndexConnection
from .index import SharedIndex
from .layout import KeySpace

__all__ = ["open_index"]


def open_index(
    cfg: SharedIndexConfig, model: str, *, tau: float | None = None, ema_alpha: float = 0.05
) -> SharedIndex:
    """A ``SharedIndex`` on ``cfg``'s Redis for ``model`` (nothing is contacted yet)."""
    return SharedIndex(
        IndexConnection(cfg), KeySpace(cfg.deployment, model), tau=tau, ema_alpha=ema_alpha
    )
