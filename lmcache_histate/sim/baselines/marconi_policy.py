"""The ``marconi`` row: ``MarconiCache`` behind the ``Policy`` interface, with α tuned once.

Marconi's score ``recency + α · flop_efficiency`` needs α, and the right α depends on the
workload, so Marconi tunes it by replaying recent requests (``config_tuner.py``; the
repository was not reachable from here: the rule below is the one docs/design.md §6
describes):

* Until the cache first has to evict, α does not matter; it starts at 0 (pure recency).
* At the first eviction the *window* is sized: ``window_factor`` (default 5) × the
  number of requests served so far (those that filled the cache), clamped to
  ``[min_window, max_window]``.
* Once that many requests have been served since the first eviction, α is tuned ONCE:
  every α of ``alpha_grid`` (0 to 2 in steps of 0.1) is evaluated by replaying the
  window's requests through a fresh ``MarconiCache`` of the same capacity (cold start,
  requests in order, each request's begin/complete at its recorded times), scored by
  the prefill FLOPs its hits saved (``FlopModel.flops`` of each hit's length), and the
  best α is kept (ties: the smaller). The live cache keeps its contents; only α changes.

Cost: one tuning replays ``len(alpha_grid)`` × ``window`` requests (21 × ≤ 2,000).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from ..capture import Capture
from ..policy import Lookup
from ..trace_model import Request
from .marconi import DEFAULT_FLOPS, FlopModel, MarconiCache, MarconiHandle

__all__ = ["ALPHA_GRID", "MarconiPolicy"]

# Both scores are normalised to [0, 1]: α = 1 weighs them equally. Marconi's grid: 0 to
# 2 in steps of 0.1.
ALPHA_GRID: tuple[float, ...] = tuple(round(0.1 * i, 1) for i in range(21))


class MarconiPolicy:
    def __init__(
        self,
        *,
        chunk_tokens: int,
        kv_bytes_per_token: int,
        snapshot_bytes: int,
        gpu_bytes: int,
        flops: FlopModel = DEFAULT_FLOPS,
        alpha: float = 0.0,
        alpha_grid: Sequence[float] = ALPHA_GRID,
        window_factor: int = 5,
        min_window: int = 100,
        max_window: int = 2000,
        tune: bool = True,
        name: str = "marconi",
    ) -> None:
        if not alpha_grid or any(a < 0 for a in alpha_grid):
            raise ValueError("alpha_grid must be a non-empty list of α ≥ 0")
        if not 0 < min_window <= max_window or window_factor <= 0:
            raise ValueError("need 0 < min_window ≤ max_window and window_factor > 0")
        self.name = name
        self.chunk_tokens = chunk_tokens
        self._params = (chunk_tokens, chunk_tokens * kv_bytes_per_token, snapshot_bytes, gpu_bytes)
        self.cache = MarconiCache(*self._params, alpha=alpha, flops=flops)
        self.alpha_grid = tuple(alpha_grid)
        self.window_factor = window_factor
        self.min_window, self.max_window = min_window, max_window
        self.tune = tune
        self.served = 0
        self.window: int | None = None  # sized at the first eviction
        self.until_tune = 0
        self.tunings = 0
        self.alpha_scores: dict[float, float] = {}  # α → FLOPs saved in the tuning replay
        self._recent: deque[tuple[tuple[int, ...], float, float]] = deque(maxlen=max_window)

    # ------------------------------------------------------------------ Policy
    def begin(self, request: Request, now: float) -> Lookup:
        keys = request.chunk_hashes[: request.input_tokens // self.chunk_tokens]
        handle = self.cache.begin(keys, now)
        hit = handle.match.hit_chunks
        loads: dict[str, int] = {}
        if hit:
            loads["gpu"] = hit * self.cache.kv_chunk_bytes + self.cache.state_bytes
        return Lookup(hit * self.chunk_tokens, loads, handle)

    def complete(self, request: Request, lookup: Lookup, now: float) -> dict[str, int]:
        handle: MarconiHandle = lookup.handle
        written = self.cache.complete(handle, now)
        self.served += 1
        if self.tune and not self.tunings:
            self._recent.append((handle.keys, handle.start, now))
            self._maybe_tune()
        return {"gpu": written} if written else {}

    def capture(self, request: Request, lookup: Lookup) -> Capture:
        """A branch point is checkpointed by ending a prefill step there (vLLM's
        junction split): one extra step. GPU only: nothing is copied to host."""
        return Capture(splits=int(lookup.handle.branch is not None))

    def capacity_bytes(self) -> int:
        return self.cache.capacity

    def stats(self) -> dict[str, float]:
        cache = self.cache
        return {
            "alpha": cache.alpha,
            "alpha_tunings": float(self.tunings),
            "window": float(self.window or 0),
            "used_gpu": float(cache.used),
            "evictions": float(cache.evictions),
            "nodes": float(len(cache.index)),
            "candidates": float(len(cache.candidates)),
        }

    # ------------------------------------------------------------------ tuning
    def _maybe_tune(self) -> None:
        if self.tunings:
            return
        if self.window is None:
            if not self.cache.evictions:
                return
            size = self.window_factor * self.served
            self.window = max(self.min_window, min(self.max_window, size))
            self.until_tune = self.window
        self.until_tune -= 1
        if self.until_tune > 0 or len(self._recent) < self.window:
            return
        self.tunings += 1
        replay = list(self._recent)[-self.window :]
        best_alpha, best_saved = None, -1.0
        for alpha in sorted(self.alpha_grid):
            saved = self.alpha_scores[alpha] = self.replay(alpha, replay)
            if saved > best_saved:  # ties keep the smaller α
                best_alpha, best_saved = alpha, saved
        assert best_alpha is not None
        self.cache.alpha = best_alpha
        self._recent.clear()

    def replay(
        self, alpha: float, requests: Sequence[tuple[tuple[int, ...], float, float]]
    ) -> float:
        """Prefill FLOPs saved by the hits of ``requests`` replayed through a cold cache
        with ``alpha``."""
        shadow = MarconiCache(*self._params, alpha=alpha, flops=self.cache.flops)
        flops = self.cache.flops
        saved = 0.0
        for keys, start, end in requests:
            handle = shadow.begin(keys, start)
            saved += flops.flops(handle.match.hit_chunks * self.chunk_tokens)
            shadow.complete(handle, end)
        return saved
