"""TEST ONLY ``--server-module``: zero restored recurrent state while a flag file exists.

Live tests use it as a negative control: with restored recurrent blocks overwritten by zeros,
restored outputs must differ from recompute, which proves a comparison sees the recurrent state
(greedy tokens alone would not). Load it next to the CPU server module, with ``tests/support``
on the server's ``PYTHONPATH`` (``support.lmcache_mp.support_pythonpath``)::

    --server-module '{"module_path": "zero_restore_hook", "factory_name":
                      "build_server_modules", "config": {"flag": "/some/path"}}'

While ``flag`` exists, every retrieve (H2D) of a *recurrent* object group writes zeros into the
engine blocks it just restored. It wraps ``lmcache_driven_transfer.transfer_kv_per_object_group``
(the name the lmcache-driven transfer module calls, lmcache 0.5.6) through the project's one
patch helper (``lmcache_histate.backends.upstream.patch``). ``/status`` lists it as
``TEST_zero_recurrent_on_retrieve``.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch
from lmcache_histate.backends.upstream import patch

__all__ = ["build_server_modules", "install_zero_recurrent_hook"]

logger = logging.getLogger("lmcache_histate.tests.zero_restore_hook")


def _zero_restored_blocks(
    cache_context: Any, block_ids_gpu: Any, memory_objs: Any, object_group_id: int
) -> int:
    """Zero the engine blocks a recurrent group's retrieve just wrote. Returns blocks zeroed."""
    manager = cache_context.kv_layer_groups_manager
    group = manager.object_groups[object_group_id]
    chunk = cache_context.lmcache_tokens_per_chunk
    tensors = cache_context.kv_tensors
    zeroed = 0
    for kg in group.kernel_group_indices:
        window = min(chunk, manager.get_subchunk_sw_size_tokens(kg))
        per_window = cache_context.calculate_num_blocks(window, kg)
        ids = [int(b) for b in torch.as_tensor(block_ids_gpu[kg]).tolist()]
        written = [
            b
            for i, obj in enumerate(memory_objs)
            if obj is not None
            for b in ids[i * per_window : (i + 1) * per_window]
            if b != 0
        ]
        if not written:
            continue
        index = torch.tensor(written, dtype=torch.long)
        for layer in manager.kernel_groups[kg].layer_indices:
            tensors[layer].index_fill_(0, index, 0)
        zeroed += len(written)
    return zeroed


def install_zero_recurrent_hook(flag_path: str) -> None:
    """Zero restored recurrent state while ``flag_path`` exists. Idempotent."""
    import lmcache.lmcache_native as native
    from lmcache.v1.multiprocess.modules import lmcache_driven_transfer as module

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def transfer_kv_per_object_group(
            cache_context: Any,
            block_ids_gpu: Any,
            memory_objs: Any,
            object_group_id: int,
            *args: Any,
            **kwargs: Any,
        ) -> None:
            original(cache_context, block_ids_gpu, memory_objs, object_group_id, *args, **kwargs)
            direction = kwargs.get("direction", args[2] if len(args) > 2 else None)
            if int(direction) != int(native.TransferDirection.H2D):
                return
            manager = cache_context.kv_layer_groups_manager
            if not manager.object_groups[object_group_id].recurrent:
                return
            if os.path.exists(flag_path):
                n = _zero_restored_blocks(
                    cache_context, block_ids_gpu, memory_objs, object_group_id
                )
                logger.warning("HiState TEST HOOK: zeroed %d restored recurrent blocks", n)

        return transfer_kv_per_object_group

    patch(module, "transfer_kv_per_object_group", make, package="lmcache",
          mark="_histate_zero_recurrent")


class ZeroRestoreModule:
    """Server module object: shows the hook under ``GET /status``."""

    def __init__(self, ctx: Any, flag: str) -> None:
        self._ctx = ctx
        self.flag = flag

    @property
    def context(self) -> Any:
        return self._ctx

    def report_status(self) -> dict[str, Any]:
        return {"TEST_zero_recurrent_on_retrieve": {"flag": self.flag}}

    def close(self) -> None:
        return None


def build_server_modules(build_ctx: Any) -> ZeroRestoreModule:
    """``--server-module`` factory; config ``{"flag": PATH}`` (required)."""
    flag = str(dict(getattr(build_ctx, "config", {}) or {})["flag"])
    install_zero_recurrent_hook(flag)
    return ZeroRestoreModule(build_ctx.server_context, flag)
