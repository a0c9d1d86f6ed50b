"""vLLM's native prefix caching for hybrid models: align mode, LRU over blocks, offload.

Modelled after DESIGN.md §3/§4 (vLLM ≥ 0.32, ``MambaCacheMode.align``):

* **Where states exist.** Recurrent states exist only at block-aligned step ends, and
  with ``prefix_cache_retention_interval = 0`` (the default) only the replay boundary
  just below the prompt end is kept: ONE state per request, after the prompt's last full
  chunk (chunk = vLLM block, 528 tokens for Qwen3.5-9B). States of earlier turns stay
  cached as blocks of their own until LRU reaches them, so a session accumulates one
  state per turn, and a rewrite that diverges mid-context can only resume from a turn
  end below the divergence (or recompute everything).
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
  ``disk`` pool too: LRU each, cascading gpu → cpu → disk, a hit from CPU/disk read
  back to the GPU (its bytes reported per tier, so the cost model charges PCIe / SSD).
  The tiering model is ``TieredLRU``'s (exclusive, like the HiState rows); the real
  OffloadingConnector writes through, see ``tiered_lru`` for why and which way that
  biases the comparison.

Not modelled: the per-request reserved blocks of running requests (the server model
runs one prefill at a time), block-hash collisions, the forced recompute of the last
prompt token when a whole prompt hits (every row shares this simplification).
"""

from __future__ import annotations

from collections.abc import Sequence

from .end_state import EndStatePolicy
from .tiered_lru import PoolSpec, TieredLRU

__all__ = ["vllm_align_policy"]


def vllm_align_policy(
    name: str,
    *,
    chunk_tokens: int,
    kv_bytes_per_token: int,
    snapshot_bytes: int,
    tiers: Sequence[tuple[str, int]],
) -> EndStatePolicy:
    """vLLM align mode over ``tiers`` = [(name, capacity bytes), ...], fastest first."""
    if not tiers:
        raise ValueError("vLLM needs at least the gpu tier")
    engine = TieredLRU(
        chunk_tokens,
        chunk_tokens * kv_bytes_per_token,
        snapshot_bytes,
        [PoolSpec(tier, capacity) for tier, capacity in tiers],
    )
    return EndStatePolicy(name, engine)
