"""The ``marconi`` row: ``MarconiCache`` behind the ``Policy`` interface, with online α.

Marconi's score ``recency + α · flop_efficiency`` needs α, and the right α depends on the
workload, so Marconi tunes it online by replaying recent requests. What we implement
(our reading of Marconi's bootstrapping, DESIGN.md §3 "α tuned online"):

* Until the cache first has to evict, α does not matter; it starts at 0 (pure recency).
* At the first eviction the *window* is sized: ``window_factor`` (default 5) × the
  number of requests served so far (those that filled the cache), clamped to
  ``[min_window, max_window]``.
* Once that many requests have been served since the first eviction, and again every
  ``max(window, min_retune)`` requests (default 1,000) after each tuning (Marconi tunes
  once after the bootstrap; we keep re-tuning on the latest window, which can only help
  it on drifting traces), every α of ``alpha_grid`` is evaluated by replaying the last
  ``window`` requests
  through a fresh ``MarconiCache`` of the same capacity (cold start, requests in
  order, each request's begin/complete at its recorded times), scored by the token
  hit rate, and the best α is kept (ties: keep the current α, else the smaller).
  The live cache keeps its contents; only α changes.

Cost: each tuning replays ``len(alpha_grid)`` × ``window`` requests once per
``max(window, min_retune)`` requests: at most ``len(alpha_grid)`` times the policy's
own cost, and far less when the window is short (on the full Weka folder at paper
capacities the cache fills within ~30 requests, so the window is ~150 requests and the
tuner costs about as much as the policy).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from ..policy import Lookup
from ..traces import Request
from .marconi import DEFAULT_FLOPS, FlopModel, MarconiCache, MarconiHandle

__all__ = ["ALPHA_GRID", "MarconiPolicy"]

# Both scores are normalised to [0, 1]: α = 1 weighs them equally; the grid spans pure
# recency (0) to efficiency-dominated (4).
ALPHA_GRID: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)


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
        min_retune: int = 1000,
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
        self.min_retune = min_retune
        self.tune = tune
        self.served = 0
        self.window: int | None = None  # sized at the first eviction
        self.until_tune = 0
        self.tunings = 0
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
        if self.tune:
            self._recent.append((handle.keys, handle.start, now))
            self._maybe_tune()
        return {"gpu": written} if written else {}

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
        if self.window is None:
            if not self.cache.evictions:
                return
            size = self.window_factor * self.served
            self.window = max(self.min_window, min(self.max_window, size))
            self.until_tune = self.window
        self.until_tune -= 1
        if self.until_tune > 0 or len(self._recent) < self.window:
            return
        self.until_tune = max(self.window, self.min_retune)
        self.tunings += 1
        replay = list(self._recent)[-self.window :]
        best_alpha, best_hits = self.cache.alpha, self.replay(self.cache.alpha, replay)
        for alpha in self.alpha_grid:
            if alpha == best_alpha:
                continue
            hits = self.replay(alpha, replay)
            if hits > best_hits:  # ties keep the current α, else the first (smaller)
                best_alpha, best_hits = alpha, hits
        self.cache.alpha = best_alpha

    def replay(self, alpha: float, requests: Sequence[tuple[tuple[int, ...], float, float]]) -> int:
        """Hit chunks of ``requests`` replayed through a cold cache with ``alpha``."""
        shadow = MarconiCache(*self._params, alpha=alpha, flops=self.cache.flops)
        hits = 0
        for keys, start, end in requests:
            handle = shadow.begin(keys, start)
            hits += handle.match.hit_chunks
            shadow.complete(handle, end)
        return hits
