"""One replay of the demo's workload against one server variant (HiState, ablation, LRU).

A run starts a fresh ``histate-server`` with the variant's policy and a fresh vLLM CPU engine
with ``HiStateConnector`` (``engine_proc``), replays the requests in order with vLLM's own
prefix cache reset after each (every reuse goes through LMCache's tiers), and collects per
request the cached tokens and the time to first token, then the server's status and the disk
tier's files.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from lmcache_histate.backends.vllm.engine_facts import EngineFacts

from .servers import ServerProcess, free_ports
from .workload import DemoRequest

__all__ = ["VARIANTS", "RunResult", "Variant", "run_variant", "server_config"]


@dataclass(frozen=True)
class Variant:
    key: str
    title: str
    policy: str
    interval_saves: bool


VARIANTS = (
    Variant("histate", "HiState", "histate", True),
    Variant("histate-every", "HiState, state every chunk", "histate", False),
    Variant("lru", "LMCache (LRU)", "lru", False),
)
"""HiState; an ablation (HiState's server, stock saves: a state at every chunk); the baseline."""


@dataclass
class RunResult:
    variant: Variant
    rows: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    server: dict[str, Any] = field(default_factory=dict)
    disk_files: int = 0
    disk_bytes: int = 0


def disk_folder(workdir: Path, key: str) -> Path:
    """Where the server of variant ``key`` keeps its disk tier under ``workdir``."""
    return workdir / f"{key}-disk"


def server_config(key: str, policy: str, model: Path, workdir: Path, cpu_gib: float,
                  disk_gib: float, layout: EngineFacts,
                  ports: tuple[int, int] | None = None) -> Path:
    """``workdir/<key>.yaml``: a histate-server config for the tiny model on ``ports``
    (request, HTTP; by default two free loopback ports), with the layout ``chunk_size: auto``
    would resolve (probed once by the caller)."""
    port, http_port = ports if ports is not None else free_ports(2)
    cfg: dict[str, Any] = {
        "policy": policy,
        "model": str(model / "config.json"),
        **layout.server_settings(),
        "cpu_gib": cpu_gib,
        "disk_path": str(disk_folder(workdir, key)),
        "disk_gib": disk_gib,
        "disk_fsync": False,
        "host": "127.0.0.1",
        "port": port,
        "http_host": "127.0.0.1",
        "http_port": http_port,
        "platform": "cpu",
        "kv_connector": "HiStateConnector",
        "kv_connector_module_path": "lmcache_histate.backends.vllm.connector",
    }
    path = workdir / f"{key}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run_variant(
    variant: Variant,
    workload: Sequence[DemoRequest],
    *,
    model: Path,
    workdir: Path,
    cpu_gib: float,
    disk_gib: float,
    layout: EngineFacts,
    max_model_len: int,
    gap: float,
    progress: Any,
) -> RunResult:
    from lmcache_histate.backends.server.launcher import kv_transfer_config

    from lmcache_histate.config import load_config

    from .engine_proc import EngineProcess, engine_kwargs

    config = server_config(variant.key, variant.policy, model, workdir, cpu_gib, disk_gib,
                           layout)
    transfer = kv_transfer_config(load_config(config))
    transfer["kv_connector_extra_config"]["histate.interval_saves"] = variant.interval_saves
    task = progress.add_task(f"{variant.title}: starting", total=len(workload))
    result = RunResult(variant)
    started = time.monotonic()
    server = ServerProcess(config, workdir, variant.key)
    try:
        server.wait_ready()
        kwargs = engine_kwargs(model, chunk_tokens=layout.block_size,
                               kv_transfer_config=transfer, max_model_len=max_model_len,
                               kv_cache_memory_bytes=64 << 20)
        with EngineProcess(kwargs, workdir=workdir, name=f"{variant.key}-engine",
                           block_size=layout.block_size) as engine:
            progress.update(task, description=f"{variant.title}: replaying")
            ask = {"histate_saves": True, "cached_token_stats": True}
            last = 0.0
            for request in workload:
                time.sleep(max(0.0, last + gap - time.monotonic()))
                last = time.monotonic()
                out = engine.generate(list(request.prompt), kv_transfer_params=ask, reset=True)
                params = out.get("kv_transfer_params") or {}
                saves = params.get("histate_saves") or {}
                result.rows.append({
                    "session": request.session,
                    "turn": request.turn,
                    "prompt_tokens": len(request.prompt),
                    "cached_tokens": out["num_cached_tokens"],
                    "ttft_s": out["seconds"],
                    "states_saved": len(saves.get("kept", [])) if variant.interval_saves
                    else None,
                })
                progress.advance(task)
        result.seconds = time.monotonic() - started
        status = server.settle()
        result.server = status.get("histate") or {}
        disk = Path(yaml.safe_load(config.read_text())["disk_path"])
        files = [p for p in disk.rglob("*.hsf") if p.is_file()]  # objects, not the marker
        result.disk_files = len(files)
        result.disk_bytes = sum(p.stat().st_size for p in files)
    finally:
        server.stop()
    progress.update(task, description=f"{variant.title}: done")
    return result


