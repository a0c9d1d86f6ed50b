"""SGLang HiCache with the hybrid (Mamba) radix cache: separate KV and Mamba pools.

Checked against the sglang 0.5.23 wheel (``sglang/srt``; the hybrid model's cache is
``mem_cache/unified_radix_cache.py`` with ``mem_cache/unified_cache/components/mamba.py``):

* **Which states are kept: the ``extra_buffer`` rule.** For Qwen3.5 SGLang resolves
  ``--mamba-radix-cache-strategy auto`` to ``extra_buffer`` (the overlap scheduler is on
  by default and ``Qwen3_5ForConditionalGeneration`` is in ``_MAMBA_EXTRA_BUFFER_ARCHS``,
  ``arg_groups/overrides.py``). Every prefill forward then tracks ONE state
  (``managers/schedule_batch.py: _mamba_radix_cache_v2_req_prepare_for_extend``): at the
  last checkpoint-grid position of the chunk it prefills (grid = max(FLA chunk 64, page
  size)), or, if the request's *branching point* lies strictly inside that chunk, at the
  branching point instead. The branching point is the full-attention KV hit floored to
  the grid when it goes beyond the deepest reusable Mamba state
  (``MambaComponent.finalize_match_result_in_tree_core``). A long prompt is prefilled in
  chunks of ``--chunked-prefill-size`` tokens (8,192 on an 80 GB GPU,
  ``arg_groups/memory_hook.py``), and each unfinished chunk's state is donated to the
  tree (``prepare_for_caching_req``): a state every 8,192 tokens from where the request
  started, plus the branching point, plus the state at finish. On our chunk grid a
  state at token ``p`` is kept at the chunk end at or below ``p``; the finish state is at
  the prompt's last hashed chunk like every row's (traces hash prompts only; SGLang's is
  the latest decode-tracked state, in the output). Where the branching point falls in
  the LAST prefill chunk we keep it and the end state both (SGLang keeps the end one only
  if decode tracks a later state): a slight bias in SGLang's favour. The per-request
  chunking assumes the request has the whole prefill budget (under load a batch shares
  it and chunks get shorter, i.e. denser states).
* **Separate pools.** The GPU Mamba pool and KV pool are sized apart
  (``--mamba-full-memory-ratio``, default 0.9 = Mamba : full KV memory,
  ``mem_cache/kv_cache_configurator.py``), i.e. a state fraction of 0.9 / 1.9 ≈ 47 % of
  ``gpu_bytes``. HiCache's host pools are 2 × the device pool each
  (``--hicache-ratio`` default 2.0) or, with ``--hicache-size``, that size split in
  proportion to the device pools (``hybrid_cache/hybrid_pool_assembler.py:
  _split_hicache_size``): we give HiCache ``cpu_bytes`` (the CPU memory the other rows
  have) split that way (``host_kv_fraction`` = None), so host and device split alike.
  Each pool has its own LRU; a pool only ever evicts its own kind, so a state pool that
  is too small loses states while their KV stays (a "tombstone" node: hits on it fall
  back to an earlier state), whatever room the KV pool has.
* **Hits** need the KV prefix and a state at the hit point (the deepest node with a
  Mamba value within the KV match). A hit refreshes the whole matched KV path but only
  the state it resumes from (``MambaComponent.refresh_lru``: "touch only the used
  state").
* **Tombstone leaves are deleted**: a KV leaf left without a state can never be hit,
  and SGLang deletes such leaves (``drop_dead_tails``) — unlike vLLM, whose blocks just
  age out.
* **Tiering**: GPU → host (→ L3 storage, the ``sglang-hicache-l3`` row, one pool of
  ``disk_bytes`` for both kinds), LRU per pool, cascading; a host/L3 hit is loaded back
  to the GPU (its bytes reported under ``cpu``/``disk``). Exclusive tiers like every
  row; HiCache's default is ``write_through`` (see ``tiered_lru``).
* **Capture cost**: none for splitting (the tracked state is read from the chunked
  kernel's intermediate ``h``, no extra step); mid-prefill states are backed up to host
  by write-through, one device→host copy each (``capture``).

Not modelled: the Mamba slots reserved by running requests (two ping-pong slots each),
SGLang's page size (we use the vLLM chunk grid of every row), write-back timing.
"""

from __future__ import annotations

from ..trace_model import Request
from .end_state import EndStatePolicy, StatePlan
from .tiered_lru import KV, STATE, PoolSpec, TieredLRU, UseHandle

__all__ = [
    "DEFAULT_CHUNKED_PREFILL_TOKENS",
    "DEFAULT_GPU_STATE_FRACTION",
    "SGLangPolicy",
    "sglang_hicache_policy",
]

# SGLang's --mamba-full-memory-ratio default 0.9 (Mamba : full KV memory) as a fraction.
DEFAULT_GPU_STATE_FRACTION = 0.9 / 1.9
# --chunked-prefill-size on a GPU of 60-90 GB (H100): arg_groups/memory_hook.py.
DEFAULT_CHUNKED_PREFILL_TOKENS = 8192


class SGLangPolicy(EndStatePolicy):
    """States at every prefill chunk's end, at the branching point, and at the end."""

    def __init__(self, name: str, engine: TieredLRU, chunked_prefill_tokens: int) -> None:
        super().__init__(name, engine)
        if chunked_prefill_tokens <= 0:
            raise ValueError("chunked_prefill_tokens must be positive")
        self.chunked_prefill_tokens = chunked_prefill_tokens

    def plan(self, request: Request, handle: UseHandle) -> StatePlan:
        n, size = self.chunk_tokens, self.chunked_prefill_tokens
        end = len(handle.keys)
        hit = handle.match.hit_chunks
        branch = handle.match.kv_chunks if handle.match.kv_chunks > hit else None
        mid: list[int] = []
        start = hit * n  # the prefill starts at the hit
        prompt = request.input_tokens
        while start + size < prompt:  # every chunk but the last
            stop = start + size
            tracked = stop // n
            if branch is not None and start < branch * n < stop:
                tracked = branch
            if start < tracked * n and tracked <= end:
                mid.append(tracked)
            start = stop
        if branch is not None and start < branch * n < prompt:
            mid.append(branch)  # in the last chunk (see the module docstring)
        return StatePlan(end, mid)


def sglang_hicache_policy(
    name: str,
    *,
    chunk_tokens: int,
    kv_bytes_per_token: int,
    snapshot_bytes: int,
    gpu_bytes: int,
    cpu_bytes: int,
    disk_bytes: int = 0,
    gpu_state_fraction: float = DEFAULT_GPU_STATE_FRACTION,
    host_kv_fraction: float | None = None,
    chunked_prefill_tokens: int = DEFAULT_CHUNKED_PREFILL_TOKENS,
) -> SGLangPolicy:
    """SGLang HiCache over GPU + host (+ an L3 pool of ``disk_bytes`` if > 0).

    ``host_kv_fraction``: the host KV pool's share of ``cpu_bytes``; None = in proportion
    to the device pools (``--hicache-size``'s rule).
    """
    if host_kv_fraction is None:
        host_kv_fraction = 1.0 - gpu_state_fraction
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
    if disk_bytes > 0:
        pools.append(PoolSpec("disk", disk_bytes))
    engine = TieredLRU(
        chunk_tokens,
        chunk_tokens * kv_bytes_per_token,
        snapshot_bytes,
        pools,
        drop_dead_tails=True,
    )
    return SGLangPolicy(name, engine, chunked_prefill_tokens)
