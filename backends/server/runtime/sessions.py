"""Requests and sessions: what the server's LOOKUP, STORE and END_SESSION tell the core.

Sessions: LMCache has no session ids. A request continues the session whose end lies on
its chain (``HiStateCache.session_for``); otherwise it starts a new one (an explicit id
can be passed as ``request_configs["histate.session_id"]``). A lookup that matches
cached KV but passes no session end is an access inside a context (an internal hit
position) and is counted as such by the hit model. Idle sessions and forgotten requests
expire (``expire``, from the janitor).

State owned here: the requests in flight (their session and the core's handle, whose pins
hold what the lookup matched until the store lands), each session's last activity, the
session-id counter and the length of the last stored segment (for ``/status``). Callers
hold the runtime lock.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmcache_histate.config import HiStateConfig
from lmcache_histate.core.cache import HiStateCache, RequestHandle

from .model_core import ModelCore
from .object_map import ObjectMap, StoreRecord

__all__ = ["SESSION_HINT", "RequestState", "SessionTracker"]

SESSION_HINT = "histate.session_id"


@dataclass(slots=True)
class RequestState:
    sid: str | None
    handle: RequestHandle | None
    seen: float


def session_hint(key: Any) -> str | None:
    """The explicit session id a request carries, if any."""
    configs = key.request_configs or {}
    hint = configs.get(SESSION_HINT) if isinstance(configs, dict) else None
    return str(hint) if hint else None


class SessionTracker:
    """Requests in flight and sessions, as the core sees them."""

    def __init__(
        self, cfg: HiStateConfig, model: ModelCore, objects: ObjectMap, stats: Counter[str]
    ) -> None:
        self.cfg = cfg
        self.model = model
        self.objects = objects
        self.stats = stats
        self.requests: dict[str, RequestState] = {}
        self.session_seen: dict[str, float] = {}
        self.last_segment_tokens = 0
        self._sids = itertools.count(1)

    def record_store(self, key: Any, hashes: Sequence[bytes]) -> None:
        """STORE received (before its objects are committed): record its chain."""
        chunk = self.model.chunk
        record = StoreRecord(key.request_id, (), key.start // chunk, session_hint(key),
                             len(key.token_ids) // chunk)
        record.chain = tuple(self.objects.link_chain(hashes, key.cache_salt, record, record.start))

    def lookup(self, core: HiStateCache, key: Any, chain: Sequence[int], now: float) -> None:
        """LOOKUP received: refresh-all on the hit prefix, pin it, count the hit."""
        old = self.requests.pop(key.request_id, None)
        if old is not None and old.handle is not None:
            core.release(old.handle)
        sid = session_hint(key) or core.session_for(chain)
        continues = sid is not None and core.has_session(sid)
        if sid is None:
            sid = self._new_sid()
        handle = core.begin(sid, chain, now)
        match = handle.match
        if not continues and match.kv_chunks > 0:
            # Matched cached context without passing any session's end: an access
            # at an internal position (a rewrite, a shared prefix).
            core.note_internal_access()
        self.stats["lookups"] += 1
        if match.hit_chunks:
            node = match.hit_node
            kind = "end" if node is not None and node.ends else "internal"
            self.stats[f"hits.{kind}"] += 1
            self.stats["hit_tokens"] += match.hit_chunks * self.model.chunk
        self.requests[key.request_id] = RequestState(sid, handle, now)
        self.session_seen[sid] = now

    def end_request(self, core: HiStateCache | None, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None and state.handle is not None and core is not None:
            core.release(state.handle)

    def take_lookup_pins(self, core: HiStateCache, request_id: str) -> None:
        """The request's store landed: its lookup's pins are no longer needed."""
        state = self.requests.get(request_id)
        if state is not None and state.handle is not None:
            core.release(state.handle)
            state.handle = None

    def session_for_store(
        self, core: HiStateCache, record: StoreRecord, chain: Sequence[int]
    ) -> str:
        if record.session_hint:
            return record.session_hint
        state = self.requests.get(record.request_id)
        if state is not None and state.sid is not None:
            return state.sid
        # Later stores of the same request continue through this one's end.
        return core.session_for(chain) or self._new_sid()

    def stored(self, sid: str, segment_tokens: int, now: float) -> None:
        self.session_seen[sid] = now
        self.last_segment_tokens = max(self.model.chunk, segment_tokens)

    def expire(self, core: HiStateCache, now: float) -> None:
        """Forget requests and sessions idle past their TTLs (janitor)."""
        ttl = self.cfg.request_ttl_s
        for rid, state in list(self.requests.items()):
            if now - state.seen > ttl:
                if state.handle is not None:
                    core.release(state.handle)
                del self.requests[rid]
        idle = self.cfg.session_ttl_s
        for sid, seen in list(self.session_seen.items()):
            if now - seen > idle:
                core.drop_session(sid)
                del self.session_seen[sid]

    def _new_sid(self) -> str:
        return f"s{next(self._sids)}"
