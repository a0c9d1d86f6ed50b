"""The main job: HiState end to end on this machine, against stock LMCache, on an agentic trace.

    .venv/bin/python -m lmcache_histate.backends.demo      (= make demo)

What it does, with nothing downloaded:

1. generates the tiny random-weight ``Qwen3NextForCausalLM`` (``tiny_model.ensure_tiny_model``:
   3 GatedDeltaNet layers + 1 full-attention layer, byte-level tokenizer trained locally);
2. builds a replay from the bundled Weka Claude Code sample (``sim.traces.sample_trace_dir``):
   a few sessions, their first requests, in arrival order (see *Workload* below);
3. runs it twice, each time against a fresh server started with ``histate-server`` (the
   project's launcher around ``lmcache server``) and a fresh vLLM CPU engine (offline
   ``vllm.LLM`` in a child process, ``engine_proc``) with ``HiStateConnector``:

   * **HiState**: ``policy: histate`` (HiState placement, unified eviction, disk tier) and the
     connector's interval-driven saves (recurrent state only at the boundaries the server's
     interval controller chooses, plus each request's final boundary);
   * **LMCache (LRU)**: the same launcher with ``policy: lru`` (``configs/lru-baseline.yaml``:
     LMCache's own LRU on the same CPU and disk tiers, every object written through to disk)
     and stock LMCache saves (``histate.interval_saves: false``: a recurrent state at every
     chunk, what LMCache MP stores by default);

   both with the same tier sizes, by default smaller than what the LRU run would store (the
   regime HiState is for: a cache smaller than the agents' working set);
4. prints, per request, the cached tokens and the measured time to first token (TTFT) of both
   runs, then a summary.

Workload. Weka traces list one hash id per 64-token source block (equal ids = equal prefix).
Each source block becomes ``--block-tokens`` synthetic tokens (default 8, i.e. 1/8 of the
real length) drawn from a generator seeded by (session file, block hash id), so two prompts
share exactly as many leading blocks as in the trace (prefix sharing, rewrites, subagents'
own scopes) while a 20K-token Claude Code context becomes ~2.5K tokens. The partial last
block and a prompt's tail beyond its hashed blocks are scaled the same way and drawn from the
request's own seed (never shared). Requests longer than the engine's context are left out
(with their session's later requests). Each request generates one token
(``max_tokens=1``), so its wall time is its TTFT.

NOTE 1 (pressure relative to the machine): vLLM's block size and state dtypes depend on the
CPU (384 tokens and a float32 GDN state with AVX-512-BF16, 256 and bfloat16 with AVX2; see
``engine_facts``), so the same workload takes a different number of bytes on each machine.
The demo asks vLLM for the layout first and sizes the CPU and the disk tier each to
``--cache-fraction`` of what a state-per-chunk cache of this workload needs *at that layout*:
HiState and stock LMCache face the same relative pressure everywhere. TTFTs are wall times of
the tiny model on this CPU and vary by 30x between machines; compare the rows, not the
absolute numbers.

Between requests vLLM's own prefix cache is reset: the engine's KV pool stands for a GPU that
cannot hold sessions between turns (the paper's setting: 24 concurrent sessions), so every
reuse goes through LMCache and its tiers, which is what is compared.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .demo_workload import SOURCE_BLOCK, DemoRequest, build_workload, unique_chunks
from .engine_facts import EngineFacts

__all__ = ["SOURCE_BLOCK", "DemoRequest", "build_workload", "main"]

ENGINE_DTYPE = "bfloat16"
"""The tiny model's dtype in the demo's engines (and in the layout probe)."""

# ================================================================================ server


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """``histate-server --config FILE`` in its own process group, output to a log file."""

    def __init__(self, config: Path, workdir: Path, name: str) -> None:
        cfg = yaml.safe_load(config.read_text())
        self.http = f"http://127.0.0.1:{cfg['http_port']}"
        self.log_path = workdir / f"{name}-server.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lmcache_histate.backends.launcher", "--config",
                 str(config)],
                cwd=workdir, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"},
                start_new_session=True,
            )

    def get(self, path: str, timeout: float = 10.0) -> Any:
        with urllib.request.urlopen(self.http + path, timeout=timeout) as response:
            return json.loads(response.read())

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"histate-server exited with {self.proc.returncode}\n"
                                   f"{self.log_tail()}")
            with contextlib.suppress(OSError, ValueError):
                if self.get("/healthcheck", 2.0).get("status") == "healthy":
                    return
            time.sleep(0.2)
        raise RuntimeError(f"histate-server not ready after {timeout}s\n{self.log_tail()}")

    def settle(self, timeout: float = 30.0) -> dict[str, Any]:
        """Wait until no store or disk write is pending; the full ``/status``."""
        deadline = time.monotonic() + timeout
        quiet = 0
        status: dict[str, Any] = {}
        while time.monotonic() < deadline and quiet < 2:
            status = self.get("/status")
            controllers = status.get("storage_manager", {}).get("store_controllers", {})
            busy = any(c.get("pending_keys_count") or c.get("in_flight_task_count")
                       for c in controllers.values())
            hs = status.get("histate") or {}
            busy = busy or bool((hs.get("disk") or {}).get("writes_in_flight"))
            quiet = 0 if busy else quiet + 1
            time.sleep(0.1)
        return status

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


# =================================================================================== runs


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


def server_config(variant: Variant, model: Path, workdir: Path, cpu_gib: float,
                  disk_gib: float, layout: EngineFacts) -> Path:
    cfg: dict[str, Any] = {
        "policy": variant.policy,
        "model": str(model / "config.json"),
        # What `chunk_size: auto` resolves to, probed once for all runs (engine_facts).
        "chunk_size": layout.block_size,
        "dtype": layout.kv_dtype,
        "mamba_ssm_cache_dtype": layout.state_dtypes[-1],
        "cpu_gib": cpu_gib,
        "disk_path": str(workdir / f"{variant.key}-disk"),
        "disk_gib": disk_gib,
        "disk_fsync": False,
        "host": "127.0.0.1",
        "port": free_port(),
        "http_host": "127.0.0.1",
        "http_port": free_port(),
        "platform": "cpu",
        "kv_connector": "HiStateConnector",
        "kv_connector_module_path": "lmcache_histate.backends.connector",
    }
    path = workdir / f"{variant.key}.yaml"
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
    from lmcache_histate.backends.engine_proc import EngineProcess, engine_kwargs
    from lmcache_histate.backends.launcher import kv_transfer_config

    from lmcache_histate.config import load_config

    config = server_config(variant, model, workdir, cpu_gib, disk_gib, layout)
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
                               kv_cache_memory_bytes=64 << 20, dtype=ENGINE_DTYPE)
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


# ================================================================================ report


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(result: RunResult) -> dict[str, Any]:
    rows = result.rows
    ttft = [r["ttft_s"] * 1000 for r in rows]
    prompt = sum(r["prompt_tokens"] for r in rows)
    cached = sum(r["cached_tokens"] for r in rows)
    return {
        "requests": len(rows),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "computed_tokens": prompt - cached,
        "ttft_mean_ms": statistics.fmean(ttft) if ttft else 0.0,
        "ttft_p50_ms": _pct(ttft, 0.5) if ttft else 0.0,
        "ttft_p90_ms": _pct(ttft, 0.9) if ttft else 0.0,
        "ttft_max_ms": max(ttft) if ttft else 0.0,
        "disk_files": result.disk_files,
        "disk_mb": result.disk_bytes / 1e6,
        "wall_s": result.seconds,
    }


def _short(session: str) -> str:
    return session.removeprefix("trace_")


def report(console: Any, workload: Sequence[DemoRequest], results: Sequence[RunResult],
           settings: dict[str, Any]) -> dict[str, Any]:
    from rich.table import Table

    by_key = {r.variant.key: r for r in results}
    hs = by_key["histate"]
    order = [r.variant for r in results]
    names = " / ".join(
        {"histate": "HS", "histate-every": "HS-all", "lru": "LRU"}[v.key] for v in order
    )
    table = Table(title="Per request, in replay order "
                        "(HS = HiState, HS-all = HiState with a state at every chunk, "
                        "LRU = stock LMCache)")
    table.add_column("#", justify="right")
    table.add_column("session")
    table.add_column("turn", justify="right")
    table.add_column("prompt", justify="right")
    table.add_column(f"cached tokens {names}", justify="right")
    table.add_column(f"TTFT ms {names}", justify="right")
    table.add_column("HS states", justify="right")
    for i, rows in enumerate(zip(*(r.rows for r in results), strict=True)):
        first = rows[0]
        table.add_row(
            str(i + 1), _short(first["session"]), str(first["turn"] + 1),
            str(first["prompt_tokens"]),
            " / ".join(str(r["cached_tokens"]) for r in rows),
            " / ".join(f"{r['ttft_s'] * 1000:.0f}" for r in rows),
            str(hs.rows[i]["states_saved"]),
        )
    console.print(table)

    sums = {r.variant.key: summarize(r) for r in results}
    summary = Table(title="Summary")
    summary.add_column("")
    for r in results:
        summary.add_column(r.variant.title, justify="right")
    lines = [
        ("requests", "requests", "{:d}"),
        ("prompt tokens", "prompt_tokens", "{:,d}"),
        ("cached tokens (hit rate)", None, None),
        ("tokens computed", "computed_tokens", "{:,d}"),
        ("TTFT mean (ms)", "ttft_mean_ms", "{:.0f}"),
        ("TTFT p50 (ms)", "ttft_p50_ms", "{:.0f}"),
        ("TTFT p90 (ms)", "ttft_p90_ms", "{:.0f}"),
        ("TTFT max (ms)", "ttft_max_ms", "{:.0f}"),
        ("disk tier at the end (files / MB)", None, None),
        ("run time incl. start-up (s)", "wall_s", "{:.1f}"),
    ]
    for label, key, fmt in lines:
        cells = []
        for r in results:
            s = sums[r.variant.key]
            if label.startswith("cached"):
                cells.append(f"{s['cached_tokens']:,d} ({100 * s['hit_rate']:.1f} %)")
            elif label.startswith("disk"):
                cells.append(f"{s['disk_files']} / {s['disk_mb']:.1f}")
            else:
                cells.append(fmt.format(s[key]))  # type: ignore[union-attr]
        summary.add_row(label, *cells)
    console.print(summary)
    h, b = sums["histate"], sums["lru"]
    if h["ttft_mean_ms"] > 0 and h["ttft_p90_ms"] > 0:
        console.print(
            f"HiState vs stock LMCache (LRU): hit rate {100 * h['hit_rate']:.1f} % vs "
            f"{100 * b['hit_rate']:.1f} %; TTFT mean {h['ttft_mean_ms']:.0f} vs "
            f"{b['ttft_mean_ms']:.0f} ms (LRU / HiState = "
            f"{b['ttft_mean_ms'] / h['ttft_mean_ms']:.2f}), p90 {h['ttft_p90_ms']:.0f} vs "
            f"{b['ttft_p90_ms']:.0f} ms ({b['ttft_p90_ms'] / h['ttft_p90_ms']:.2f})."
        )
    counters = hs.server.get("counters", {})
    console.print(
        f"HiState server: pressure factor {hs.server.get('pressure_factor', 1.0):.2f}; "
        f"{sum(r['states_saved'] or 0 for r in hs.rows)} recurrent states saved by the "
        f"connector (LRU run: one per chunk stored), "
        f"{counters.get('kv_demoted', 0)} KV chunks demoted to disk. Settings: "
        + ", ".join(f"{k}={v}" for k, v in settings.items())
    )
    return {"settings": settings, "summary": sums,
            "requests": {r.variant.key: r.rows for r in results}}


# ================================================================================== main


@contextlib.contextmanager
def _workdir(path: str | None) -> Iterator[Path]:
    if path:
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        yield p
        return
    tmp = Path(tempfile.mkdtemp(prefix="histate-demo-"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lmcache_histate.backends.demo",
        description="Replay the bundled agentic trace through vLLM (CPU) + HiState and "
                    "through the same stack with stock LMCache (LRU); compare.",
    )
    p.add_argument("--sessions", type=int, default=5, help="Weka sample sessions (max 6)")
    p.add_argument("--requests", type=int, default=8, help="first requests per session")
    p.add_argument("--block-tokens", type=int, default=8,
                   help="synthetic tokens per 64-token trace block (scale 1/8 by default)")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--cache-fraction", type=float, default=0.5,
                   help="CPU tier and disk tier each sized to this fraction of what the LRU "
                        "run stores (every chunk's KV and state)")
    p.add_argument("--gap", type=float, default=1.0,
                   help="seconds between request starts (the trace's think times, compressed; "
                        "LMCache's L1 eviction loop runs once a second)")
    p.add_argument("--variants", default=",".join(v.key for v in VARIANTS),
                   help="runs to make, comma-separated, from: "
                        + ", ".join(f"{v.key} ({v.title})" for v in VARIANTS)
                        + "; histate and lru are required")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", help="keep configs, logs and disk tiers here (default: temp)")
    p.add_argument("--json", help="also write the results as JSON to this file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    chosen = [k.strip() for k in args.variants.split(",") if k.strip()]
    known = {v.key: v for v in VARIANTS}
    if not {"histate", "lru"} <= set(chosen) or not set(chosen) <= set(known):
        parser.error(f"--variants: need histate and lru, from {', '.join(known)}; got {chosen}")
    variants = [v for v in VARIANTS if v.key in chosen]
    from lmcache_histate.backends.tiny_model import ensure_tiny_model
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    # Wide enough for the tables when the output is not a terminal (logs, README).
    console = Console(width=max(112, shutil.get_terminal_size((112, 24)).columns))
    started = time.monotonic()
    console.print("[bold]HiState demo[/bold]: tiny hybrid model (vLLM CPU) + histate-server, "
                  "bundled Weka Claude Code sample")
    model = ensure_tiny_model()
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    workload = build_workload(sessions=args.sessions, requests=args.requests,
                              block_tokens=args.block_tokens,
                              max_prompt_tokens=args.max_model_len - 8, vocab=vocab,
                              seed=args.seed)
    if not workload:
        console.print("no request fits --max-model-len", style="red")
        return 2
    from lmcache_histate.backends.engine_facts import probe

    with console.status("asking vLLM for the tiny model's layout on this CPU"):
        layout = probe(model, dtype=ENGINE_DTYPE)
    chunk = layout.block_size
    chunks = unique_chunks(workload, chunk)
    # The pressure is relative (NOTE 1): a state-per-chunk cache of this workload needs
    # `footprint` bytes at this machine's chunk and state dtypes; each tier gets a fraction.
    geometry = layout.geometry()
    per_chunk = chunk * geometry.kv_bytes_per_token + geometry.snapshot_bytes
    footprint = chunks * per_chunk
    gib = max(args.cache_fraction * footprint / 2**30, 0.004)
    settings = {
        "sessions": len({r.session for r in workload}),
        "requests": len(workload),
        "block_tokens": args.block_tokens,
        "unique_chunks": chunks,
        "cpu_isa": layout.isa,
        "kernel_library": layout.kernel_library,
        "chunk": chunk,
        "state_dtypes": "/".join(layout.state_dtypes),
        "footprint_mb": round(footprint / 1e6, 1),
        "cache_fraction": args.cache_fraction,
        "cpu_gib": round(gib, 4),
        "disk_gib": round(gib, 4),
        "gap_s": args.gap,
    }
    console.print(
        f"model {model}\nengine layout here: {layout.describe()}\n"
        f"workload: {settings['requests']} requests of {settings['sessions']} "
        f"sessions, {sum(len(r.prompt) for r in workload):,d} prompt tokens, {chunks} distinct "
        f"chunks of {chunk} tokens ({footprint / 1e6:.1f} MB with a state per chunk); tiers: "
        f"CPU {gib * 2**30 / 1e6:.1f} MB + disk {gib * 2**30 / 1e6:.1f} MB "
        f"({args.cache_fraction:g} x that footprint each)"
    )
    results: list[RunResult] = []
    with _workdir(args.workdir) as work, Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=console,
    ) as progress:
        for variant in variants:
            results.append(run_variant(
                variant, workload, model=model, workdir=work, cpu_gib=gib, disk_gib=gib,
                layout=layout, max_model_len=args.max_model_len, gap=args.gap, progress=progress,
            ))
    data = report(console, workload, results, settings)
    console.print(f"total {time.monotonic() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
