"""Baselines: every row of the report that is not HiState, each a ``sim.policy.Policy``.

=========================  ==============================================================
``unlimited``              never evicts, a state at every chunk end: the reference
                           (``unlimited``).
``marconi``                Marconi on vLLM, GPU only: sequence-end + branch-point states,
                           recency + α·FLOP-efficiency eviction, α tuned once from a
                           replay (``marconi``, ``marconi_policy``).
``vllm-align-gpu``         vLLM align mode: states at the replay boundary (the prompt's
                           last full block) and at the shared-prefix junction, LRU over
                           blocks, GPU only (``vllm``).
``vllm-cpu-offload``       the same + a CPU tier (LRU, cascading).
``vllm-cpu-disk-offload``  the same + CPU and disk tiers.
``vllm-retention``         vLLM CPU+disk with ``--prefix-cache-retention-interval``
                           4,096 as deployments set it (rounded up to 8 blocks): also a
                           state at each prefill step end on a multiple of it (``vllm``).
``sglang-hicache``         SGLang HiCache + the hybrid radix cache: separate KV / Mamba
                           pools on GPU and host (host split like the device), LRU per
                           pool, states at every chunked-prefill chunk, at the branching
                           point and at the end (``sglang``).
``sglang-hicache-l3``      the same + an L3 storage tier of ``disk_bytes`` (HiState's
                           disk capacity).
``lru``                    the paper's generic LRU: the REAL HiState core (same tiers,
                           placement, GPU promotion and interval-driven snapshots as the
                           ``histate`` row, ``sim/variants.py``) with ``tau = 0`` and no
                           refresh-all (the paper's file-level LRU ablation).
``lru-refresh-all``        the same with refresh-all.
``file-lru``               the paper's file-level LRU ablation: every KV chunk and snapshot
                           file an independent LRU object, HiState's tiers, placement and
                           interval control (``file_lru``).
=========================  ==============================================================

Memory per row (``capacity_bytes``; the paper's set-up in brackets): Marconi and vLLM
GPU-only have the GPU pool (45 GiB), vLLM CPU offload and SGLang HiCache GPU + CPU
(141 GiB), vLLM CPU+disk, SGLang HiCache + L3 and the HiState/LRU rows GPU + CPU + disk
(291 GiB). ``same_memory=True`` grows each row's slowest tier so that every row has
GPU + CPU + disk bytes in all (a GPU-only row then gets an impossibly large GPU: the
view separates what a policy does with memory from how much memory it had).

The vLLM and SGLang rows share one engine (``tiered_lru``: exclusive tiers, LRU per
pool) and one adapter (``end_state``). Every row reports ``load_bytes`` per tier name
(``gpu``/``cpu``/``disk``) for hits and the bytes written per tier name on completion.
None of them is randomised; ``seed`` is accepted so that callers can treat every row
alike.

NOTE 1 (the ablation rows share the set-up's interval control). ``lru``,
``lru-refresh-all`` and ``file-lru`` must differ from ``histate`` in eviction only, so
they take the set-up's ``histate.max_interval_chunks`` (the supported snapshot intervals)
and ``ema_alpha`` (the residence-time EMAs behind the pressure factor), as the
``histate`` row does (``variants.histate_policy``); left at the core's defaults they
would place snapshots differently from ``histate`` under any other configuration.

NOTE 2 (the ``lru`` rows plan on the step grid). ``lru`` and ``lru-refresh-all`` are
HiState's core with recency eviction, and ``capture`` charges them as it charges
``histate``: HiState's scheduler, the engine's step budget and a step end at each planned
state. They are the eviction ablation, not a model of vLLM (that is ``vllm_align_policy``,
whose states are the align-mode ones the default scheduler leaves anyway), so they plan
on the same step grid at the same step price as ``histate``: without it they would
plan a state per chunk while the cache warms up and pay step ends ``histate`` does not,
a difference in scheduling, not eviction. ``file-lru`` keeps its own capture (a state at
every chunk, one-chunk steps: the paper's baseline with vLLM's own scheduler).
"""

from __future__ import annotations

from collections.abc import Callable

from ...core.cache import config_default
from ...core.interval import supported_intervals
from ..capture import ENGINE_STEP_TOKENS
from ..policy import Policy
from ..variants import three_tier_policy
from .file_lru import file_lru_policy
from .marconi import DEFAULT_FLOPS, FlopModel
from .marconi_policy import MarconiPolicy
from .sglang import sglang_hicache_policy
from .unlimited import UnlimitedPolicy
from .vllm import retention_chunks, vllm_align_policy

__all__ = ["BASELINES", "BASELINE_LINES", "LRU_ROWS", "baseline_policies"]

BASELINES: tuple[str, ...] = (
    "unlimited",
    "marconi",
    "vllm-align-gpu",
    "vllm-cpu-offload",
    "vllm-cpu-disk-offload",
    "vllm-retention",
    "sglang-hicache",
    "sglang-hicache-l3",
    "lru",
    "lru-refresh-all",
    "file-lru",
)

# One line per row for ``histate simulate --list-policies`` (the table above, shortened).
BASELINE_LINES: dict[str, str] = {
    "unlimited": "reference: never evicts, a state at every chunk",
    "marconi": "Marconi on vLLM, GPU only: end and branch-point states, recency + FLOP "
    "efficiency",
    "vllm-align-gpu": "vLLM align mode, GPU prefix cache only (LRU over blocks)",
    "vllm-cpu-offload": "vLLM align mode + CPU offload (LRU per tier)",
    "vllm-cpu-disk-offload": "vLLM align mode + CPU and disk offload (LRU per tier)",
    "vllm-retention": "vLLM CPU+disk with --prefix-cache-retention-interval 4096 "
    "(rounded to whole blocks)",
    "sglang-hicache": "SGLang HiCache: GPU + host pools, a state per prefill chunk, LRU",
    "sglang-hicache-l3": "SGLang HiCache + an L3 storage tier of the disk's size",
    "lru": "HiState's core with plain LRU (tau 0, no refresh-all)",
    "lru-refresh-all": "HiState's core with LRU and refresh-all",
    "file-lru": "every KV chunk and snapshot file its own LRU object (paper's ablation)",
}

# The rows that are HiState's own core with plain-recency eviction (tau = 0), and the knobs
# that make them so (``variants.histate_policy`` takes the same): no second implementation.
# ``exposed_ends`` as the ``histate`` row (it prices ``C``, which ``tau = 0`` never reads).
LRU_ROWS: dict[str, dict[str, float | bool]] = {
    "lru": {"tau": 0.0, "refresh_all": False, "exposed_ends": True},
    "lru-refresh-all": {"tau": 0.0, "refresh_all": True, "exposed_ends": True},
}


def baseline_policies(
    chunk_tokens: int,
    kv_bytes_per_token: int,
    snapshot_bytes: int,
    gpu_bytes: int,
    cpu_bytes: int,
    disk_bytes: int,
    seed: int = 0,
    *,
    flops: FlopModel = DEFAULT_FLOPS,
    host_kv_fraction: float | None = None,
    same_memory: bool = False,
    max_interval_chunks: int = config_default("max_interval_chunks"),
    ema_alpha: float = config_default("ema_alpha"),
    step_grid: tuple[int | None, float] = (None, 0.0),
) -> dict[str, Callable[[], Policy]]:
    """Row name → factory of a fresh policy, in report order (``BASELINES``).

    ``flops``: Marconi's FLOP model (only the linear : attention ratio matters);
    ``host_kv_fraction``: SGLang's host KV share (None: in proportion to its device
    pools); ``same_memory``: every row gets GPU + CPU + disk bytes in all (module doc);
    ``max_interval_chunks``, ``ema_alpha``: the interval control of the rows that keep
    HiState's (NOTE 1); ``step_grid``: their engine's step grid and step price
    (``CostModel.step_grid``; NOTE 2).
    """
    del seed  # no baseline is randomised
    geo = {
        "chunk_tokens": chunk_tokens,
        "kv_bytes_per_token": kv_bytes_per_token,
        "snapshot_bytes": snapshot_bytes,
    }
    caps = {"gpu_bytes": gpu_bytes, "cpu_bytes": cpu_bytes, "disk_bytes": disk_bytes}
    interval = {
        "supported_intervals": supported_intervals(chunk_tokens, max_interval_chunks),
        "max_interval_chunks": max_interval_chunks,
        "ema_alpha": ema_alpha,
        "step_tokens": step_grid[0],
        "step_price": step_grid[1],
    }
    # vLLM's steps: the engine's budget in whole blocks (``CostModel.step_grid``).
    step_chunks = (step_grid[0] or ENGINE_STEP_TOKENS) // chunk_tokens or 1
    retention = (retention_chunks(chunk_tokens), step_chunks)
    total = gpu_bytes + cpu_bytes + disk_bytes
    # The slowest tier of each row: as configured, or grown to the common total.
    gpu_only = total if same_memory else gpu_bytes
    host = total - gpu_bytes if same_memory else cpu_bytes
    gpu, cpu, disk = ("gpu", gpu_bytes), ("cpu", cpu_bytes), ("disk", disk_bytes)
    sglang = {**geo, "gpu_bytes": gpu_bytes, "host_kv_fraction": host_kv_fraction}
    return {
        "unlimited": lambda: UnlimitedPolicy(**geo),
        "marconi": lambda: MarconiPolicy(**geo, gpu_bytes=gpu_only, flops=flops),
        "vllm-align-gpu": lambda: vllm_align_policy(
            "vllm-align-gpu", **geo, tiers=[("gpu", gpu_only)]
        ),
        "vllm-cpu-offload": lambda: vllm_align_policy(
            "vllm-cpu-offload", **geo, tiers=[gpu, ("cpu", host)]
        ),
        "vllm-cpu-disk-offload": lambda: vllm_align_policy(
            "vllm-cpu-disk-offload", **geo, tiers=[gpu, cpu, disk]
        ),
        "vllm-retention": lambda: vllm_align_policy(
            "vllm-retention", **geo, tiers=[gpu, cpu, disk], retention=retention
        ),
        "sglang-hicache": lambda: sglang_hicache_policy(
            "sglang-hicache", **sglang, cpu_bytes=host
        ),
        "sglang-hicache-l3": lambda: sglang_hicache_policy(
            "sglang-hicache-l3", **sglang, cpu_bytes=cpu_bytes, disk_bytes=disk_bytes
        ),
        "lru": lambda: three_tier_policy("lru", **LRU_ROWS["lru"], **geo, **caps, **interval),
        "lru-refresh-all": lambda: three_tier_policy(
            "lru-refresh-all", **LRU_ROWS["lru-refresh-all"], **geo, **caps, **interval
        ),
        "file-lru": lambda: file_lru_policy(
            "file-lru", [gpu, cpu, disk], **geo,
            max_interval_chunks=max_interval_chunks, ema_alpha=ema_alpha,
        ),
    }
