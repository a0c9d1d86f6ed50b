"""Patches of LMCache 0.5.6: the upstream bugs and gaps HiState works around, one function each.

Each function installs its patch through :func:`patching.patch` (version guard, lock,
idempotent) and is called from one entry point, never at import time:

* :func:`route_l1_eviction_policy` -- gap: LMCache 0.5.6 has no registry for L1 eviction
  policies (``eviction_policy/factory.py: CreateEvictionPolicy`` is an if/elif over four
  names, also hard-coded in the CLI's ``choices``). Entered by the launcher around
  ``lmcache server``'s run, with the factory ``plugins.install`` returns bound to its
  runtime.
* :func:`install_strided_fallback_kernel` -- bug: the pure-torch fallback copy kernel
  rejects vLLM's padded, non-tight per-block strides. Called by the CPU server module's
  factory (``cpu_server_module.build_server_modules``) in the server process.
* :func:`route_cpu_shm_wrapping` -- bug: LMCache's CPU KV wrapper rejects non-contiguous
  tensors and re-points only the tensors it is given. Called by
  ``cpu_support.prepare_kv_caches_for_lmcache`` from ``HiStateConnector.register_kv_caches``
  in the vLLM worker.
* :func:`install_shm_release` -- bug: the server never unmaps an engine's shared-memory KV
  tensors (one mapping and one fd per tensor per engine registration, for the server's
  life). Called by the launcher (``launcher.run``) for every policy.
* :func:`install_request_loop_guard` -- bugs: one malformed ZMQ frame ends the request
  thread, decode errors are logged with full tracebacks, and a closed event notifier still
  writes to fd -1 at shutdown (NOTEs 3-5). Called by the launcher (``launcher.run``).
"""

from __future__ import annotations

import contextvars
import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .patching import patch

__all__ = [
    "MalformedRequest",
    "install_request_loop_guard",
    "install_shm_release",
    "install_strided_fallback_kernel",
    "route_cpu_shm_wrapping",
    "route_l1_eviction_policy",
]

# ------------------------------------------------------------------- L1 eviction policy

# Context variables, not state: each holds a value only within the context that set it.
_BUILDING_L1 = contextvars.ContextVar("histate_building_l1_eviction", default=False)
_L1_POLICY: contextvars.ContextVar[Callable[[Any], Any] | None] = contextvars.ContextVar(
    "histate_l1_eviction_policy", default=None)


@contextmanager
def route_l1_eviction_policy(make_policy: Callable[[Any], Any]) -> Iterator[None]:
    """While the block runs, let ``make_policy(eviction_config)`` choose LMCache's L1
    eviction policy.

    ``make_policy`` returns the policy object, or ``None`` for LMCache's own choice. Only the
    L1 controller is routed: L2 adapters configured with LMCache eviction keep LMCache's
    policies. The patches are installed once; the hook is bound for the block only, in the
    calling context (NOTE 2), so no process-wide state holds it and nothing is left bound
    once the block ends.

    NOTE 1 (how the L1 call is told apart, without stack inspection): two patches.
    ``L1EvictionController.__init__`` is wrapped to set a context variable while it runs;
    ``eviction_controller.CreateEvictionPolicy`` (the name that module bound at import) is
    wrapped to consult the hook only while that variable is set. Both calls run in the same
    thread, synchronously, so the variable marks exactly the L1 controller's construction.
    The launcher passes ``--eviction-policy LRU`` to satisfy the CLI's ``choices``.

    NOTE 2 (the hook is a context variable's value). The launcher enters this block around
    ``lmcache server``'s run on its main thread. LMCache builds its storage manager (and the
    L1 controller) in the HTTP app's start-up, on uvicorn's event loop, which
    ``asyncio.run`` starts with a copy of the calling thread's context; the start-up task
    copies it again (lmcache 0.5.6 ``v1/multiprocess/http_server.py``: ``lifespan`` ->
    ``run_cache_server``). So the L1 controller sees the hook, and a controller built
    outside the block (another server in a test process, a thread started elsewhere) does
    not.
    """
    from lmcache.v1.distributed.storage_controllers import eviction_controller as module

    def make_init(original: Any) -> Any:
        @functools.wraps(original)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            token = _BUILDING_L1.set(True)
            try:
                original(self, *args, **kwargs)
            finally:
                _BUILDING_L1.reset(token)

        return __init__

    def make_factory(original: Any) -> Any:
        @functools.wraps(original)
        def CreateEvictionPolicy(eviction_config: Any) -> Any:
            hook = _L1_POLICY.get()
            if _BUILDING_L1.get() and hook is not None:
                policy = hook(eviction_config)
                if policy is not None:
                    return policy
            return original(eviction_config)

        return CreateEvictionPolicy

    patch(module.L1EvictionController, "__init__", make_init, package="lmcache",
          mark="_histate_l1_marker")
    patch(module, "CreateEvictionPolicy", make_factory, package="lmcache",
          mark="_histate_l1_policy")
    token = _L1_POLICY.set(make_policy)
    try:
        yield
    finally:
        _L1_POLICY.reset(token)


# ------------------------------------------------------------- strided fallback kernel


def _strided_per_layer_tensors(
    ptrs: torch.Tensor,
    format_spec: Any,
    shape_desc: Any,
    device: Any,
    dtype: torch.dtype,
) -> list[torch.Tensor] | None:
    """Per-layer paged views with a non-tight block stride, or ``None`` if not that case."""
    from lmcache.v1.platform.torch_ops._tensor_from_ptr import _tensor_from_ptr

    nb, bs = int(shape_desc.nb), int(shape_desc.bs)
    nh, hs = int(shape_desc.nh), int(shape_desc.hs)
    per_shape = tuple(int(d) for d in format_spec.paged_layer_shape(nb, bs, nh, hs))
    block_stride = int(getattr(shape_desc, "block_stride_elems", 0) or 0)
    inner = math.prod(per_shape[1:])
    if not block_stride or block_stride == inner or per_shape[0] != nb:
        return None
    if block_stride < inner:
        raise ValueError(
            f"block_stride_elems {block_stride} is smaller than one block ({inner} elements)"
        )
    inner_strides: list[int] = []
    step = 1
    for dim in reversed(per_shape[1:]):
        inner_strides.insert(0, step)
        step *= dim
    span = (nb - 1) * block_stride + inner
    views = []
    for p in ptrs:
        flat = _tensor_from_ptr(int(p.item()), (span,), dtype, device)
        views.append(flat.as_strided(per_shape, (block_stride, *inner_strides)))
    return views


def install_strided_fallback_kernel() -> None:
    """Patch ``mp_mem_kernels._normalize_paged_layers`` to honour ``block_stride_elems``.

    Upstream bug (lmcache 0.5.6, ``lmcache/v1/platform/torch_ops/mp_mem_kernels.py:
    _normalize_paged_layers``): without an accelerator the server copies blocks between vLLM's
    paged KV pool (shared memory, see ``cpu_support``) and LMCache objects with the pure-torch
    fallback ``multi_layer_block_kv_transfer``. It rebuilds each layer's paged tensor from a
    raw pointer as a *tight* tensor and raises ``NotImplementedError("Non-tight per-block
    strides (vLLM blocks-first pools) are not supported ...")`` when
    ``PageBufferShapeDesc.block_stride_elems`` says blocks are further apart. vLLM 0.32's
    hybrid models are exactly that case: a GDN state row (e.g. 141,312 B as LMCache views it)
    sits in a padded page (196,608 B). The replacement builds the same view with
    ``as_strided`` (block axis strided by ``block_stride_elems``, the rest tight), which the
    per-layer copy loops (``index_select`` / ``index_copy_``) handle unchanged. Scoped: only
    the per-layer, pointer-tensor, non-tight-stride case (where the original raises) is
    handled here; every other call goes to the original.
    """
    from lmcache.v1.platform.torch_ops import mp_mem_kernels as kernels

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def _normalize_paged_layers(
            paged_buffer_ptrs_tensor: Any,
            format_spec: Any,
            shape_desc: Any = None,
            device: Any = None,
            dtype: torch.dtype | None = None,
        ) -> Any:
            per_layer = not (
                format_spec.is_cross_layer
                or format_spec.is_kv_list
                or format_spec.is_kv_second_tuple
            )
            if (
                per_layer
                and kernels._is_ptr_tensor(paged_buffer_ptrs_tensor)
                and shape_desc is not None
                and device is not None
                and dtype is not None
            ):
                views = _strided_per_layer_tensors(
                    paged_buffer_ptrs_tensor, format_spec, shape_desc, device, dtype
                )
                if views is not None:
                    return views
            return original(
                paged_buffer_ptrs_tensor,
                format_spec,
                shape_desc=shape_desc,
                device=device,
                dtype=dtype,
            )

        return _normalize_paged_layers

    patch(kernels, "_normalize_paged_layers", make, package="lmcache",
          mark="_histate_strided_kernel")


# ----------------------------------------------------------------- CPU shm KV wrapping


def route_cpu_shm_wrapping(describe: Callable[[torch.Tensor], Any | None]) -> None:
    """Route LMCache's CPU KV wrapper factory through ``describe`` first.

    Patches ``lmcache.v1.platform.devices.cpu.shm.migrate_to_shm_and_wrap`` (the module
    global ``CpuShmTensorWrapper.wrap`` calls). Upstream bug (lmcache 0.5.6): it rejects
    non-contiguous tensors ("migrate_to_shm_and_wrap requires a contiguous tensor") and, for
    contiguous ones, copies the storage to a new segment and re-points only the tensors it is
    given, so vLLM's other views of the same pool would keep computing in the old memory.
    ``describe(tensor)`` returns the wire descriptor for tensors whose storage HiState moved
    into shared memory in place (``cpu_support.describe_view``), ``None`` for others, which
    take the original code. The first ``describe`` installed stays (idempotent).
    """
    from lmcache.v1.platform.devices.cpu import shm

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def migrate_to_shm_and_wrap(tensor: torch.Tensor) -> Any:
            described = describe(tensor)
            return described if described is not None else original(tensor)

        return migrate_to_shm_and_wrap

    patch(shm, "migrate_to_shm_and_wrap", make, package="lmcache", mark="_histate_strided_shm")


# ------------------------------------------------------- shm release on session close

_PINS = "_histate_pinned_storages"
_WRAPPERS = "_histate_kv_wrappers"


def install_shm_release() -> None:
    """Release an engine's shared-memory mappings when its session closes.

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

    The fix is local and scoped to session close (three patches): ``CPUCacheContext``
    remembers the wrappers it was built from, each wrapper remembers the storages its
    ``to_tensor`` pinned, and ``CPUCacheContext.close()`` drops those pins. When LMCache then
    drops the context (``_release_entries``), the storages die and upstream's own finalizer
    unmaps them. While a session is open nothing changes; harmless where the CPU path is
    unused.
    """
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

    patch(shm.CpuShmTensorWrapper, "to_tensor", make_to_tensor, package="lmcache",
          mark="_histate_shm_release_pins")
    patch(cache_context.CPUCacheContext, "__init__", make_init, package="lmcache",
          mark="_histate_shm_release_wrappers")
    patch(cache_context.CPUCacheContext, "close", make_close, package="lmcache",
          mark="_histate_shm_release_close")


# ----------------------------------------------------------------- ZMQ request loop guard


class MalformedRequest(ValueError):
    """A request frame the server cannot decode (a client's fault, not the server's)."""


def _malformed(what: str) -> Callable[[Any], Any]:
    """A ``patch`` builder: ``original``'s decode errors raised as :class:`MalformedRequest`."""

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def decode(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            except MalformedRequest:
                raise
            except (TypeError, ValueError) as exc:
                raise MalformedRequest(f"{what}: {type(exc).__name__}: {exc}"[:300]) from None

        return decode

    return make


def install_request_loop_guard(
    report: Callable[[str], None], on_death: Callable[[BaseException], None]
) -> None:
    """Keep LMCache's ZMQ request thread alive through malformed frames, and let it stop
    without tracebacks. Idempotent; installed by the launcher (``launcher.run``).

    Three upstream functions are patched (the bugs, with a reproduction, are written up for
    upstream in docs/reliability.md, "Upstream issue: one ZMQ frame stops the request
    thread"):

    NOTE 3 (one frame ends the request thread).
    ``lmcache/v1/multiprocess/transport/zmq_impl/mq.py: MessageQueueServer._main_loop`` is the
    loop of the ``mq-server-thread``, the one thread that reads every engine request. It ends
    each received message with ``assert len(msg) >= 3, "Expected at least 3 message parts
    ..."`` outside any ``try``: a DEALER that sends one frame (any local user can) raises
    ``AssertionError`` out of the loop, the thread dies, the process lives and every later
    RPC times out. The replacement runs the original loop again after that one error (the
    offending message was already consumed by ``recv_multipart``; the loop keeps all of its
    state on ``self``: poller, streams, output queue), reporting the drop through ``report``.
    Any other exception still ends the thread, reported once through ``on_death`` (the
    launcher logs it as CRITICAL); the launcher's health check
    (``backends/server/data_plane.py``) then fails.

    NOTE 4 (decode errors are a client's fault). ``mq.py``'s module names
    ``decode_operation`` and ``unwrap_request_payloads`` (the operation id and the payloads of
    a request): their decode errors are raised as :class:`MalformedRequest` (a
    ``ValueError``, so the loop's own ``except`` clauses still catch them). Upstream logs each
    with a full traceback (``logger.exception``); the launcher's log filter
    (``backends/server/quiet_log.py``) turns a record whose exception is a
    :class:`MalformedRequest` into one rate-limited line. Nothing else changes: a request with
    garbage payloads gets no answer, as before.

    NOTE 5 (a closed notifier is closed). ``lmcache/v1/platform/event_notifier.py:
    EventfdNotifier.notify``: the class invariant says every method treats a closed notifier
    (``_efd == -1``) as closed, but ``notify`` writes to ``-1``. At shutdown
    ``MessageQueueServer.close`` closes the notifier while a pool thread still finishes a
    request, whose ``_notify_response`` callback then logs ``ValueError: file descriptor
    cannot be a negative integer (-1)`` with a traceback (4 on a SIGTERM under load). The
    replacement returns at once when closed: the response has nowhere to go, the loop that
    would send it has ended.

    Versions checked: lmcache 0.5.6 (``patching.CHECKED_VERSIONS``).

    Args:
        report: Called with a one-line reason for every frame dropped by the loop guard.
        on_death: Called with the exception that ends the request thread otherwise.
    """
    from lmcache.v1.multiprocess.transport.zmq_impl import mq
    from lmcache.v1.platform import event_notifier

    def make_loop(original: Any) -> Any:
        @functools.wraps(original)
        def _main_loop(self: Any) -> None:
            while True:
                try:
                    original(self)
                    return
                except AssertionError as exc:  # the message-part check (NOTE 3)
                    report(f"dropped a request with too few frames ({exc})")
                except BaseException as exc:
                    if not self.is_finished.is_set():
                        on_death(exc)
                    return

        return _main_loop

    patch(mq.MessageQueueServer, "_main_loop", make_loop, package="lmcache",
          mark="_histate_request_loop_guard")
    patch(mq, "decode_operation", _malformed("operation id"),
          package="lmcache", mark="_histate_malformed_operation")
    patch(mq, "unwrap_request_payloads", _malformed("payloads"),
          package="lmcache", mark="_histate_malformed_payloads")

    notifier = getattr(event_notifier, "EventfdNotifier", None)
    if notifier is not None and hasattr(notifier, "notify"):

        def make_notify(original: Any) -> Any:
            @functools.wraps(original)
            def notify(self: Any) -> None:
                if getattr(self, "_efd", 0) < 0:
                    return  # closed (NOTE 5)
                original(self)

            return notify

        patch(notifier, "notify", make_notify, package="lmcache",
              mark="_histate_notify_after_close")
