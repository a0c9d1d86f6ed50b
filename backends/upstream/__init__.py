"""Upstream compatibility: every change HiState makes to LMCache's or vLLM's code, in one place.

* ``patching``: :func:`patch`, the one patch helper (version guard against
  :data:`CHECKED_VERSIONS`, a lock, idempotent);
* ``lmcache_patches``: L1 eviction-policy routing (launcher), the strided fallback copy
  kernel (CPU server module), the CPU shared-memory KV wrapper (connector, worker side), the
  release of an engine's shared-memory mappings on session close (launcher), the request
  thread kept alive through malformed frames and stopped without tracebacks (launcher);
* ``vllm_patches``: the in-process CPU engine start-up fix (engine child).

Where an upstream symbol moved or is new between the checked versions, the code calls one
version-guarded lookup instead of importing it: ``vllm_symbols`` (vLLM), ``lmcache_symbols``
(LMCache). ``versions``: the versions checked and how (the support matrix, docs/support.md;
``make compat`` checks every upstream symbol the backends use against them).

Nothing here runs at import time; each patch is installed by an explicit call from the entry
point named in its module. The bugs, with symptoms and versions: docs/vllm-cpu.md §2 and
docs/design.md §5.
"""

from .lmcache_patches import (
    MalformedRequest,
    install_request_loop_guard,
    install_shm_release,
    install_strided_fallback_kernel,
    route_cpu_shm_wrapping,
    route_l1_eviction_policy,
)
from .patching import CHECKED_VERSIONS, UpstreamVersionError, patch
from .vllm_patches import install_vllm_cpu_inprocess_fix

__all__ = [
    "CHECKED_VERSIONS",
    "MalformedRequest",
    "UpstreamVersionError",
    "install_request_loop_guard",
    "install_shm_release",
    "install_strided_fallback_kernel",
    "install_vllm_cpu_inprocess_fix",
    "patch",
    "route_cpu_shm_wrapping",
    "route_l1_eviction_policy",
]
