"""LMCache symbols that exist only in some checked versions: one version-guarded lookup each.

* :func:`l2_memory_tags` -- ``MemoryTags`` (``lmcache/v1/distributed/api.py``), new in
  0.5.7 (read in the 0.5.7rc2 wheel): what ``L2AdapterInterface.get_memory_tags``, abstract
  from 0.5.7, returns. LMCache 0.5.6 has neither the type nor the call.

The shape every L2 adapter of ours follows (``disk.tier.HiStateDiskAdapter``): it defines
``get_memory_tags`` (returning :func:`l2_memory_tags`) and ``submit_touch`` on every LMCache
version, so the class loads where 0.5.7 made them abstract and nothing calls them on 0.5.6;
``scripts/compat.py`` checks each adapter against every abstract method of the checked
versions' ``L2AdapterInterface``.
"""

from __future__ import annotations

from typing import Any

from .patching import UpstreamVersionError, installed_version
from .versions import LMCACHE

__all__ = ["l2_memory_tags"]

FIRST_WITH_TAGS = "0.5.7"


def l2_memory_tags(*, shared: bool, version: str | None = None) -> Any:
    """``MemoryTags(STORAGE, LOCAL)`` for an adapter on this host's storage, ``REMOTE`` for
    one whose storage other hosts share (LMCache's FS adapter reports a shared folder so)."""
    version = installed_version("lmcache") if version is None else version
    if version not in LMCACHE or not version.startswith(FIRST_WITH_TAGS):
        raise UpstreamVersionError(
            f"LMCache memory tags were checked on lmcache "
            f"{', '.join(v for v in LMCACHE if v.startswith(FIRST_WITH_TAGS))}, found "
            f"{version}: LMCache before {FIRST_WITH_TAGS} has none and never asks for them"
        )
    from lmcache.v1.distributed.api import MemoryResidency, MemorySegment, MemoryTags

    residency = MemoryResidency.REMOTE if shared else MemoryResidency.LOCAL
    return MemoryTags(MemorySegment.STORAGE, residency)
