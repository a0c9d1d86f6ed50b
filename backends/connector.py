"""``HiStateConnector``: the vLLM KV connector of lmcache-histate.

Load it in vLLM's ``--kv-transfer-config``::

    {"kv_connector": "HiStateConnector",
     "kv_connector_module_path": "lmcache_histate.backends.connector",
     "kv_role": "kv_both",
     "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 5555}}

It subclasses LMCache's ``LMCacheMPConnector`` as vLLM resolves it
(``vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector.LMCacheMPConnector``: the
connector shipped in ``lmcache.integration.vllm`` when importable), so everything LMCache MP
mode does -- lookups, async loads, stores of every chunk, hybrid object groups -- is unchanged.

What it adds today (CPU platform only; see ``cpu_support`` and docs/vllm-cpu.md):

* the lmcache-driven transfer mode by default (``lmcache.mp.mp_transfer_mode``): LMCache's CPU
  default is the engine-driven path, which rejects more than one KV group, i.e. every hybrid
  model;
* before LMCache registers vLLM's KV caches, the whole KV storage is moved into named shared
  memory in place and LMCache's CPU wrapper describes each (strided) view of it.

On GPUs the class behaves exactly like ``LMCacheMPConnector``.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from lmcache_histate.backends import cpu_support
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector import (
    LMCacheMPConnector,
)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["HiStateConnector"]

logger = logging.getLogger(__name__)

# vLLM imports this module while it builds its config, i.e. before an in-process worker starts
# (VLLM_ENABLE_V1_MULTIPROCESSING=0) and after lmcache (hence numba/llvmlite) is loaded: install
# the CPU start-up fix now, or the worker dies in vllm/triton_utils/dispatcher.py. No-op on GPUs.
if cpu_support.is_cpu_platform():
    cpu_support.install_vllm_cpu_inprocess_fix()

TRANSFER_MODE_KEY = "lmcache.mp.mp_transfer_mode"


class HiStateConnector(LMCacheMPConnector):  # type: ignore[misc,valid-type]
    """LMCache MP connector with HiState's CPU support (and, later, its save policy)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        self._histate_cpu = cpu_support.is_cpu_platform()
        if self._histate_cpu and vllm_config.kv_transfer_config is not None:
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config
            chosen = extra.get(TRANSFER_MODE_KEY, os.environ.get("LMCACHE_MP_TRANSFER_MODE"))
            if chosen is None:
                # Covers: LMCache's CPU default transfer (engine-driven) raises "engine-driven
                # transfer does not support multiple KV transfer groups" for every hybrid model
                # (worker_transfer.py: EngineDrivenTransferContext.register). Checked on
                # lmcache 0.5.6 + vllm-cpu 0.32.0.
                extra[TRANSFER_MODE_KEY] = "lmcache_driven"
            elif chosen != "lmcache_driven":
                logger.warning(
                    "HiState: LMCache MP transfer mode %r on CPU; hybrid models need "
                    "'lmcache_driven' (engine-driven rejects more than one KV group)",
                    chosen,
                )
        super().__init__(vllm_config, role, kv_cache_config)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor | Any]) -> None:
        if self._histate_cpu:
            # Covers: LMCache's CPU wrapper (cpu/shm.py: migrate_to_shm_and_wrap) rejects vLLM's
            # padded GDN views and re-points only the views it is given (lmcache 0.5.6,
            # vllm-cpu 0.32.0). Must run before LMCache wraps the views (inside
            # super().register_kv_caches): they are then described from the shared segment,
            # strides included.
            segments = cpu_support.prepare_kv_caches_for_lmcache(kv_caches)
            logger.info(
                "HiState CPU support: KV storage shared via %s",
                ", ".join(f"{s.shm_name} ({s.storage_nbytes} B)" for s in segments),
            )
        super().register_kv_caches(kv_caches)
