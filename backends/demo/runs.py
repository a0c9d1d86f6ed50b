"""The demo's replays: the workload against every server variant (HiState, ablation, LRU).

Each variant gets a fresh ``histate-server`` with its policy and a fresh vLLM CPU engine with
``HiStateConnector`` (``engine_proc``); all run at once and take each request in turn,
interleaved (``run_interleaved`` NOTE 1), with vLLM's own prefix cache reset after each
(every reuse goes through LMCache's tiers). Per request the cached tokens and the time to
first token are collected, then each server's status and its disk tier's files.
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

__all__ = ["VARIANTS", "RunResult", "Variant", "VariantRun", "run_interleaved", "server_config"]


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


class VariantRun:
    """One variant's ``histate-server`` and vLLM engine, started on ``__enter__``; ``serve``
    replays one request (vLLM's prefix cache reset after it), ``finish`` closes the engine
    and collects the server's status and the disk tier's files into ``result``.

    Start-up time and the variant's own request times make up ``result.seconds`` (the runs
    are interleaved, NOTE 1 of ``run_interleaved``, so wall time is shared)."""

    def __init__(self, variant: Variant, *, model: Path, workdir: Path, cpu_gib: float,
                 disk_gib: float, layout: EngineFacts, max_model_len: int) -> None:
        from lmcache_histate.backends.server.launcher import kv_transfer_config

        from lmcache_histate.config import load_config

        self.variant, self.layout, self.model = variant, layout, model
        self.workdir, self.max_model_len = workdir, max_model_len
        self.config = server_config(variant.key, variant.policy, model, workdir, cpu_gib,
                                    disk_gib, layout)
        self.transfer = kv_transfer_config(load_config(self.config))
        self.transfer["kv_connector_extra_config"]["histate.interval_saves"] = (
            variant.interval_saves)
        self.result = RunResult(variant)
        self.server: ServerProcess | None = None
        self.engine: Any = None

    def __enter__(self) -> VariantRun:
        from .engine_proc import EngineProcess, engine_kwargs

        started = time.monotonic()
        self.server = ServerProcess(self.config, self.workdir, self.variant.key)
        try:
            self.server.wait_ready()
            kwargs = engine_kwargs(self.model, chunk_tokens=self.layout.block_size,
                                   kv_transfer_config=self.transfer,
                                   max_model_len=self.max_model_len,
                                   kv_cache_memory_bytes=64 << 20)
            self.engine = EngineProcess(kwargs, workdir=self.workdir,
                                        name=f"{self.variant.key}-engine",
                                        block_size=self.layout.block_size)
        except BaseException:
            self.server.stop()
            raise
        self.result.seconds = time.monotonic() - started
        return self

    def serve(self, request: DemoRequest) -> None:
        ask = {"histate_saves": True, "cached_token_stats": True}
        started = time.monotonic()
        out = self.engine.generate(list(request.prompt), kv_transfer_params=ask, reset=True)
        self.result.seconds += time.monotonic() - started
        params = out.get("kv_transfer_params") or {}
        saves = params.get("histate_saves") or {}
        self.result.rows.append({
            "session": request.session,
            "turn": request.turn,
            "prompt_tokens": len(request.prompt),
            "cached_tokens": out["num_cached_tokens"],
            "ttft_s": out["seconds"],
            "states_saved": len(saves.get("kept", [])) if self.variant.interval_saves
            else None,
        })

    def finish(self) -> RunResult:
        assert self.server is not None
        self.engine.close()
        self.engine = None
        status = self.server.settle()
        self.result.server = status.get("histate") or {}
        disk = Path(yaml.safe_load(self.config.read_text())["disk_path"])
        files = [p for p in disk.rglob("*.hsf") if p.is_file()]  # objects, not the marker
        self.result.disk_files = len(files)
        self.result.disk_bytes = sum(p.stat().st_size for p in files)
        return self.result

    def __exit__(self, *exc: object) -> None:
        if self.engine is not None:
            self.engine.__exit__(*exc)
        if self.server is not None:
            self.server.stop()


def run_interleaved(
    variants: Sequence[Variant],
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
) -> list[RunResult]:
    """Every variant's server and engine at once, each request served by all of them back
    to back before the next request starts.

    NOTE 1 (interleaving): run one after another, the variants met different minutes of a
    shared machine, and a loaded 2-core host moved a whole run's TTFTs by 1.75x while its
    hits were equal. Here request ``i`` goes to the variants in order for even ``i`` and in
    reverse for odd ``i`` (ABBA for two variants), so drift and the cost of going first or
    last land on every variant alike. Requests of one variant still start at least ``gap``
    seconds apart (LMCache's L1 eviction loop runs once a second)."""
    import contextlib

    tasks = {}
    with contextlib.ExitStack() as stack:
        runs = []
        for variant in variants:
            tasks[variant.key] = progress.add_task(f"{variant.title}: starting",
                                                   total=len(workload))
            runs.append(stack.enter_context(VariantRun(
                variant, model=model, workdir=workdir, cpu_gib=cpu_gib, disk_gib=disk_gib,
                layout=layout, max_model_len=max_model_len)))
            progress.update(tasks[variant.key], description=f"{variant.title}: ready")
        last = 0.0
        for i, request in enumerate(workload):
            time.sleep(max(0.0, last + gap - time.monotonic()))
            last = time.monotonic()
            for run in runs if i % 2 == 0 else runs[::-1]:
                run.serve(request)
                progress.update(tasks[run.variant.key], advance=1,
                                description=f"{run.variant.title}: replaying")
        results = [run.finish() for run in runs]
        for variant in variants:
            progress.update(tasks[variant.key], description=f"{variant.title}: done")
    return results

