"""The ``unlimited`` row: a cache that never evicts and has a state at every chunk end.

The reference every other row is measured against (docs/design.md §6: "never evicts,
snapshot at every position"): a request hits every leading chunk of its prompt that
any earlier request computed, all of it resident on the GPU (reads are free in the cost
model; the bytes are still reported under ``gpu``). Positions are quantised to chunks
like every row, so "every position" means every chunk end: the only recompute left is
the first unseen chunk onwards plus the partial last chunk.

Capturing a state at every chunk end needs every prefill step to end on a chunk
boundary (vLLM: ``max_num_batched_tokens`` in [N, 2N), docs/design.md §5.2), so the row pays
the small-step cost (``capture``: ``step_tokens = chunk_tokens``); its states stay on
the GPU (nothing is copied to host).

Chunk hashes are chained (a hash identifies its whole prefix), so the cache is a set of
hashes: O(1) memory per chunk ever seen, O(prompt chunks) per request.
"""

from __future__ import annotations

from ..capture import Capture
from ..policy import Lookup
from ..trace_model import Request

__all__ = ["UnlimitedPolicy"]


class UnlimitedPolicy:
    def __init__(
        self,
        *,
        chunk_tokens: int,
        kv_bytes_per_token: int,
        snapshot_bytes: int,
        name: str = "unlimited",
    ) -> None:
        self.name = name
        self.chunk_tokens = chunk_tokens
        self.kv_chunk_bytes = chunk_tokens * kv_bytes_per_token
        self.snapshot_bytes = snapshot_bytes
        self.seen: set[int] = set()
        self.stored_bytes = 0

    def _hit_chunks(self, keys: tuple[int, ...]) -> int:
        n = 0
        for key in keys:
            if key not in self.seen:
                break
            n += 1
        return n

    def begin(self, request: Request, now: float) -> Lookup:
        keys = request.chunk_hashes[: request.input_tokens // self.chunk_tokens]
        hit = self._hit_chunks(keys)
        loads = {"gpu": hit * self.kv_chunk_bytes + self.snapshot_bytes} if hit else {}
        return Lookup(hit * self.chunk_tokens, loads, keys)

    def complete(self, request: Request, lookup: Lookup, now: float) -> dict[str, int]:
        keys: tuple[int, ...] = lookup.handle
        new = [k for k in keys[self._hit_chunks(keys) :] if k not in self.seen]
        self.seen.update(new)
        written = len(new) * (self.kv_chunk_bytes + self.snapshot_bytes)
        self.stored_bytes += written
        return {"gpu": written} if written else {}

    def capture(self, request: Request, lookup: Lookup) -> Capture:
        return Capture(step_tokens=self.chunk_tokens)

    def capacity_bytes(self) -> float:
        return float("inf")

    def stats(self) -> dict[str, float]:
        return {"chunks": float(len(self.seen)), "used_gpu": float(self.stored_bytes)}
