"""A ``Policy`` over a ``TieredLRU`` that saves one state per request, at its prompt's end.

vLLM's align mode with ``prefix_cache_retention_interval = 0`` and SGLang's
MambaRadixCache both keep exactly one recurrent state per finished request: the one at
the last full chunk (block) of its prompt (vLLM: "the replay boundary just below the
prompt end"; SGLang: the state cached when the request finishes). Both engines also
hash the decoded tokens' blocks, but a trace only gives hashes for prompt chunks, so
only those are modelled, exactly as for the HiState rows: the next turn's prompt
contains the previous output, and its hit can reach the previous prompt's last full
chunk at most. The engines differ in where objects live (``TieredLRU`` pools), which
``vllm.py`` and ``sglang.py`` configure.
"""

from __future__ import annotations

from ...core.index import Node
from ..policy import Lookup
from ..traces import Request
from .tiered_lru import KV, STATE, TieredLRU, UseHandle

__all__ = ["EndStatePolicy"]


class EndStatePolicy:
    """Hit = deepest state within the KV match; save the state at the prompt's end."""

    def __init__(self, name: str, engine: TieredLRU) -> None:
        self.name = name
        self.engine = engine
        self.chunk_tokens = engine.index.chunk_tokens

    def begin(self, request: Request, now: float) -> Lookup:
        keys = request.chunk_hashes[: request.input_tokens // self.chunk_tokens]
        handle, loads = self.engine.acquire(keys)
        return Lookup(handle.match.hit_chunks * self.chunk_tokens, loads, handle)

    def complete(self, request: Request, lookup: Lookup, now: float) -> dict[str, int]:
        handle: UseHandle = lookup.handle
        return self.engine.admit(handle, [len(handle.keys)], now)

    def stats(self) -> dict[str, float]:
        engine = self.engine
        out: dict[str, float] = {"nodes": float(len(engine.index))}
        for t, name in enumerate(engine.tier_names):
            out[f"used_{name}"] = float(
                sum(u for u, p in zip(engine.used, engine.pools, strict=True) if p.tier == name)
            )
            out[f"written_{name}"] = float(engine.written[name])
            out[f"states_{name}"] = float(len(engine.heaps[t][STATE]))
        for key, count in engine.evictions.items():
            out[key] = float(count)
        return out

    def resident(self, node: Node) -> tuple[str | None, str | None]:
        """(KV tier, state tier) names of ``node``, for tests and debugging."""
        e = self.engine
        kv = e.tier_names[e.tier(node, KV)] if node.kv_tiers else None
        st = e.tier_names[e.tier(node, STATE)] if node.snap_tiers else None
        return kv, st
