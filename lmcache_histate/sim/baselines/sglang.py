"""SGLang HiCache with MambaRadixCache: separate KV and Mamba pools on GPU and host.

Modelled after DESIGN.md §3 and SGLang's ``MambaRadixCache`` / HiCache:

* **Separate pools.** SGLang sizes the Mamba state pool and the KV token pool
  separately on the GPU (``--mamba-full-memory-ratio``, default 0.9 = Mamba memory :
  full-attention KV memory, i.e. a state fraction of 0.9 / 1.9 ≈ 47 % of ``gpu_bytes``)
  and HiCache does the same with the host memory (``cpu_bytes``), split by a ratio
  between a host KV pool and a host Mamba pool: the "half-and-half split", 50/50 by
  default (``host_kv_fraction``). Each pool has its own LRU list (SGLang keeps a
  ``full_lru_list`` and a ``mamba_lru_list``); a pool only ever evicts its own kind, so
  a state pool that is too small loses states while their KV stays (a "tombstone" node:
  hits on it fall back to an earlier state), whatever room the KV pool has.
* **States at request ends only**: one state per request, after its prompt's last full
  chunk (``cache_finished_req``); no intermediate or branch-point states.
* **Hits** need the KV prefix and a state at the hit point (the deepest node with a
  Mamba value within the KV match). A hit refreshes the whole matched KV path but only
  the state it resumes from (SGLang resets the matched nodes in the full LRU list and
  the hit node in the Mamba LRU list).
* **Tombstone leaves are deleted**: a KV leaf left without a state can never be hit,
  and SGLang deletes such leaves iteratively (``drop_dead_tails``) — unlike vLLM, whose
  blocks just age out.
* **Tiering**: GPU → host, LRU per pool, cascading (GPU evictions go to the host pool
  of the same kind, host evictions leave the cache), a host hit is loaded back to the
  GPU (its bytes reported under ``cpu``, charged PCIe). No L3 storage backend (HiCache
  can have one; the paper's baseline is GPU + host). Exclusive tiers like every row;
  HiCache's default is write-through (see ``tiered_lru``).

Not modelled: the Mamba slots reserved by running requests, SGLang's page size (we use
the vLLM chunk grid of every row), write-back timing.
"""

from __future__ import annotations

from .end_state import EndStatePolicy
from .tiered_lru import KV, STATE, PoolSpec, TieredLRU

__all__ = ["DEFAULT_GPU_STATE_FRACTION", "DEFAULT_HOST_KV_FRACTION", "sglang_hicache_policy"]

# SGLang's --mamba-full-memory-ratio default 0.9 (Mamba : full KV memory) as a fraction.
DEFAULT_GPU_STATE_FRACTION = 0.9 / 1.9
# The "half-and-half split" of the host memory between KV and Mamba pools.
DEFAULT_HOST_KV_FRACTION = 0.5


def sglang_hicache_policy(
    name: str,
    *,
    chunk_tokens: int,
    kv_bytes_per_token: int,
    snapshot_bytes: int,
    gpu_bytes: int,
    cpu_bytes: int,
    gpu_state_fraction: float = DEFAULT_GPU_STATE_FRACTION,
    host_kv_fraction: float = DEFAULT_HOST_KV_FRACTION,
) -> EndStatePolicy:
    for label, frac in (
        ("gpu_state_fraction", gpu_state_fraction),
        ("host_kv_fraction", host_kv_fraction),
    ):
        if not 0.0 <= frac <= 1.0:
            raise ValueError(f"{label} must be in [0, 1], got {frac}")
    gpu_state = int(gpu_bytes * gpu_state_fraction)
    host_kv = int(cpu_bytes * host_kv_fraction)
    pools = [
        PoolSpec("gpu", gpu_bytes - gpu_state, (KV,)),
        PoolSpec("gpu", gpu_state, (STATE,)),
        PoolSpec("cpu", host_kv, (KV,)),
        PoolSpec("cpu", cpu_bytes - host_kv, (STATE,)),
    ]
    engine = TieredLRU(
        chunk_tokens,
        chunk_tokens * kv_bytes_per_token,
        snapshot_bytes,
        pools,
        drop_dead_tails=True,
    )
    return EndStatePolicy(name, engine)
