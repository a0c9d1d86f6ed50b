"""Requests and sessions: what the server's LOOKUP, STORE and END_SESSION tell the core.

Sessions: LMCache has no session ids. A request continues the session whose end lies on
its chain (``HiStateCache.session_for``); otherwise it starts a new one (an explicit id
can be passed as ``request_configs["histate.session_id"]``). A lookup that matches
cached KV but passes no session end is an access inside a context (an internal hit
position) and is counted as such by the hit model. Idle sessions expire.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmcache_histate.core.cache import RequestHandle

from .chains import StoreRecord

SESSION_HINT = "histate.session_id"


@dataclass(slots=True)
class RequestState:
    sid: str | None
    handle: RequestHandle | None
    seen: float


class SessionsMixin:
    """Request/session tracking of ``HiStateRuntime``."""

    def note_store(self, key: Any) -> None:
        """STORE received (before its objects are committed): record the chain."""
        if self.ctx is None:
            return
        end = min(key.end, len(key.token_ids))
        end -= end % self.chunk
        if end <= 0:
            return
        # LMCache resolves the STORE's keys through the request's session right after this
        # (engine_context.resolve_obj_keys); hashing through it computes each hash once.
        session = self.ctx.session_manager.get_or_create(key.request_id)
        session.set_tokens(list(key.token_ids))
        hashes = [self.ctx.token_hasher.hash_to_bytes(h) for h in session.get_hashes(0, end)]
        configs = key.request_configs or {}
        hint = configs.get(SESSION_HINT) if isinstance(configs, dict) else None
        with self.lock:
            record = StoreRecord(key.request_id, (), key.start // self.chunk,
                                 str(hint) if hint else None)
            record.chain = tuple(self._link_chain(hashes, key.cache_salt, record, record.start))

    def on_lookup(self, key: Any) -> None:
        """LOOKUP received: refresh-all on the hit prefix, pin it, count the hit."""
        if self.ctx is None:
            return
        end = min(key.end, len(key.token_ids))
        end -= end % self.chunk
        hashes = self._hashes(key.token_ids, end) if end > 0 else []
        now = self.clock()
        with self.lock:
            self._drain_locked()
            chain = self._link_chain(hashes, key.cache_salt, None)
            core = self._ensure_core(key.model_name, key.world_size)
            if core is None or not chain:
                return
            old = self.requests.pop(key.request_id, None)
            if old is not None and old.handle is not None:
                core.release(old.handle)
            configs = key.request_configs or {}
            hint = configs.get(SESSION_HINT) if isinstance(configs, dict) else None
            sid = str(hint) if hint else core.session_for(chain)
            continues = sid is not None and sid in core.index.sessions
            if sid is None:
                sid = self._new_sid()
            handle = core.begin(sid, chain, now)
            match = handle.match
            if not continues and match.kv_chunks > 0:
                # Matched cached context without passing any session's end: an access
                # at an internal position (a rewrite, a shared prefix).
                core.hit_model.observe(False)
            self.stats["lookups"] += 1
            if match.hit_chunks:
                node = match.hit_node
                kind = "end" if node is not None and node.ends else "internal"
                self.stats[f"hits.{kind}"] += 1
                self.stats["hit_tokens"] += match.hit_chunks * self.chunk
            self.requests[key.request_id] = RequestState(sid, handle, now)
            self.session_seen[sid] = now
            actions = self._take_actions()
        self._run(actions)

    def on_end_session(self, request_id: str) -> None:
        with self.lock:
            state = self.requests.pop(request_id, None)
            if state is not None and state.handle is not None and self.core is not None:
                self.core.release(state.handle)
            actions = self._take_actions()
        self._run(actions)

    def _new_sid(self) -> str:
        return f"s{next(self._sids)}"

    def _session_for_store(self, record: StoreRecord, chain: Sequence[int]) -> str:
        core = self.core
        assert core is not None
        if record.session_hint:
            return record.session_hint
        state = self.requests.get(record.request_id)
        if state is not None and state.sid is not None:
            return state.sid
        # Later stores of the same request continue through this one's end.
        return core.session_for(chain) or self._new_sid()
