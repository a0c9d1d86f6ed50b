"""The one HiState runtime of this ``lmcache server`` process, for LMCache's plugin entry points.

LMCache builds HiState's plugins itself, each from its own entry point: the store policy
(``policies.HiStateStorePolicy``, from the store-policy registry), the L1 eviction policy
(routed by ``upstream``), the disk tier (``disk.tier.HiStateDiskAdapter``, an L2 adapter
plugin) and the server module (``server_module.build_server_modules``). None of them can be
handed the runtime, so the launcher installs it here before LMCache starts, and each entry
point asks ``current()`` when it runs (never caching it at import).

Invariants: at most one runtime is installed; a disk tier announced before a runtime is
installed is attached when one is (so install order does not matter); this module imports
neither the runtime nor the disk tier (both are only types here), so neither imports the
other through it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .disk.tier import HiStateDiskAdapter
    from .runtime.runtime import HiStateRuntime

__all__ = ["announce_disk_tier", "current", "install", "withdraw_disk_tier"]

_lock = threading.Lock()
_runtime: HiStateRuntime | None = None
_disk_tier: HiStateDiskAdapter | None = None


def install(runtime: HiStateRuntime | None) -> None:
    """Make ``runtime`` this process's runtime (None: uninstall); attaches a disk tier
    already announced."""
    global _runtime
    with _lock:
        _runtime = runtime
        disk = _disk_tier
    if runtime is not None and disk is not None:
        runtime.attach_disk_tier(disk)


def current() -> HiStateRuntime | None:
    """The installed runtime, if any (None under a stock ``lmcache server``)."""
    return _runtime


def announce_disk_tier(disk: HiStateDiskAdapter) -> None:
    """Called by the disk tier once it is built: the runtime (now or later) drives it."""
    global _disk_tier
    with _lock:
        _disk_tier = disk
        runtime = _runtime
    if runtime is not None:
        runtime.attach_disk_tier(disk)


def withdraw_disk_tier(disk: HiStateDiskAdapter) -> None:
    """Called when the disk tier closes: a runtime installed later will not get it."""
    global _disk_tier
    with _lock:
        if _disk_tier is disk:
            _disk_tier = None
