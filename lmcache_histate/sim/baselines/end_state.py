"""A ``Policy`` over a ``TieredLRU`` whose engine decides which recurrent states to keep.

The vLLM and SGLang rows share the engine (``TieredLRU``: where objects live, who leaves
first) and this adapter; they differ in WHICH states a request leaves behind, the one
thing each engine's own source decides (``vllm.py``, ``sglang.py``). A row chooses the
states when the request is scheduled (``begin``), as the engines do: vLLM's scheduler
splits the prefill at its junction, SGLang tracks one state per prefill chunk. The base
class keeps one state per request, after the prompt's last hashed chunk.

Both engines also hash the decoded tokens' blocks, but a trace only gives hashes for
prompt chunks, so only those are modelled, exactly as for the HiState rows: the next
turn's prompt contains the previous output, and its hit can reach the previous prompt's
last full chunk at most.
"""

from __future__ import annotations

from ...core.index import Node
from ..capture import Capture
from ..policy import Lookup
from ..trace_model import Request
from .tiered_lru import KV, STATE, TieredLRU, UseHandle

__all__ = ["EndStatePolicy", "StatePlan"]


class StatePlan:
    """The states one request will save: chunk counts (a state after chunk ``c``), and
    which of them are captured mid-prefill (all but the final one)."""

    __slots__ = ("chunks", "final", "splits")

    def __init__(self, final: int, mid: list[int] | None = None, splits: int = 0) -> None:
        self.final = final
        self.chunks = sorted({c for c in (*(mid or ()), final) if c > 0})
        self.splits = splits

    @property
    def mid(self) -> list[int]:
        return [c for c in self.chunks if c != self.final]


class EndStatePolicy:
    """Hit = deepest state within the KV match; save the states ``plan`` chooses
    (by default: the prompt's last hashed chunk only)."""

    def __init__(self, name: str, engine: TieredLRU) -> None:
        self.name = name
        self.engine = engine
        self.chunk_tokens = engine.index.chunk_tokens
        # Mid-prefill states reach host memory (the connector / HiCache backs them up)
        # only where the row has a tier below the GPU.
        self.has_host_tier = any(
            p.capacity > 0 for p in engine.pools if p.tier != engine.tier_names[0]
        )

    def plan(self, request: Request, handle: UseHandle) -> StatePlan:
        """The states this request saves (chunk counts). Default: the prompt's end."""
        return StatePlan(len(handle.keys))

    def begin(self, request: Request, now: float) -> Lookup:
        keys = request.chunk_hashes[: request.input_tokens // self.chunk_tokens]
        handle, loads = self.engine.acquire(keys)
        handle.plan = self.plan(request, handle)
        return Lookup(handle.match.hit_chunks * self.chunk_tokens, loads, handle)

    def capture(self, request: Request, lookup: Lookup) -> Capture:
        """What capturing this request's states costs beyond a plain prefill (see
        ``config.Capture``): forced step ends, and mid-prefill states copied to host."""
        plan: StatePlan = lookup.handle.plan
        return Capture(
            splits=plan.splits, host_states=len(plan.mid) if self.has_host_tier else 0
        )

    def complete(self, request: Request, lookup: Lookup, now: float) -> dict[str, int]:
        handle: UseHandle = lookup.handle
        return self.engine.admit(handle, handle.plan.chunks, now)

    def capacity_bytes(self) -> int:
        return sum(p.capacity for p in self.engine.pools)

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
        """(KV tier, state tier) names of ``node``, for inspection."""
        e = self.engine
        kv = e.tier_names[e.tier(node, KV)] if node.kv_tiers else None
        st = e.tier_names[e.tier(node, STATE)] if node.snap_tiers else None
        return kv, st
