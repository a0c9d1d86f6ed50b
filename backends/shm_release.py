"""Workaround: release an engine's shared-memory mappings when its session closes.

Upstream bug (lmcache 0.5.6, ``lmcache/v1/platform/devices/cpu/shm.py``,
``CpuShmTensorWrapper.to_tensor``): the server maps each KV tensor an engine registers
from POSIX shared memory and means to ``munmap`` it when the tensor's storage is
garbage-collected (``weakref.finalize`` on the storage). But the same function pins the
base buffer in the module-level ``_CPU_SHM_KEEP_ALIVE`` dict, and that buffer shares the
very storage the finalizer waits for, so the storage is never collected: every engine
register keeps one mapping and one file descriptor (the ``mmap``'s duplicate) per KV
tensor for the life of the server, after the engine unregisters or dies. The CPU cache
context's ``close()`` (called on unregister and when a dead engine is reaped) is a no-op,
and ``CpuShmTensorWrapper`` does not override ``DeviceIPCWrapper.close()``, the hook
meant for exactly this. A stock ``lmcache server`` leaks the same way (measured:
docs/reliability.md).

The fix here is local and scoped to session close: ``CPUCacheContext`` remembers the
wrappers it was built from, each wrapper remembers the storages its ``to_tensor`` pinned,
and ``CPUCacheContext.close()`` drops those pins. When LMCache then drops the context
(``_release_entries``), the storages die and upstream's own finalizer unmaps them. While a
session is open nothing changes. Idempotent; harmless where the CPU path is unused.
"""

from __future__ import annotations

import functools
from typing import Any

from .cpu_server_module import _patch_once

__all__ = ["install_shm_release"]

_MARK = "_histate_shm_release"
_PINS = "_histate_pinned_storages"
_WRAPPERS = "_histate_kv_wrappers"


def install_shm_release() -> None:
    """Patch ``CpuShmTensorWrapper.to_tensor`` and ``CPUCacheContext.__init__/close``."""
    from lmcache.v1.platform.devices.cpu import cache_context, shm

    def make_to_tensor(original: Any) -> Any:
        @functools.wraps(original)
        def to_tensor(self: Any) -> Any:
            out = original(self)
            if self.nbytes:
                pins = self.__dict__.setdefault(_PINS, [])
                pins.append(id(out.untyped_storage()))
            return out

        return to_tensor

    def make_init(original: Any) -> Any:
        @functools.wraps(original)
        def __init__(self: Any, kv_caches: Any, *args: Any, **kwargs: Any) -> None:
            original(self, kv_caches, *args, **kwargs)
            setattr(self, _WRAPPERS, list(kv_caches))

        return __init__

    def make_close(original: Any) -> Any:
        @functools.wraps(original)
        def close(self: Any) -> None:
            original(self)
            wrappers, self.__dict__[_WRAPPERS] = self.__dict__.get(_WRAPPERS, []), []
            for wrapper in wrappers:
                for storage_id in wrapper.__dict__.pop(_PINS, []):
                    shm._CPU_SHM_KEEP_ALIVE.pop(storage_id, None)

        return close

    _patch_once(shm.CpuShmTensorWrapper, "to_tensor", _MARK, make_to_tensor)
    _patch_once(cache_context.CPUCacheContext, "__init__", _MARK, make_init)
    _patch_once(cache_context.CPUCacheContext, "close", _MARK, make_close)
