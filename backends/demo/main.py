"""The demo's command line: build the workload, size the tiers, run the variants, report."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from .engine_proc import ENGINE_DTYPE
from .report import report
from .runs import VARIANTS, disk_folder, run_interleaved
from .workload import build_workload, unique_chunks

__all__ = ["main"]


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


def _kept_disk_tier(workdir: Path, keys: Sequence[str]) -> Path | None:
    """The first of the variants' disk folders (``runs.disk_folder``) in ``workdir`` that
    holds a file, else None. A server recovers its disk folder at start, so a run into a
    kept ``--workdir`` would compare warm caches, not the variants."""
    for key in keys:
        folder = disk_folder(workdir, key)
        if folder.is_dir() and any(p.is_file() for p in folder.rglob("*")):
            return folder
    return None


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
    if args.workdir:
        kept = _kept_disk_tier(Path(args.workdir), [v.key for v in variants])
        if kept is not None:
            parser.error(f"--workdir: {kept} holds an earlier run's disk tier, which its server "
                         "would recover, so the run would start warm; remove it or name an "
                         "empty folder")
    from lmcache_histate.backends.demo.tiny_model import ensure_tiny_model
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
    from lmcache_histate.backends.vllm.engine_facts import probe

    with console.status("asking vLLM for the tiny model's layout on this CPU"):
        layout = probe(model, dtype=ENGINE_DTYPE)
    chunk = layout.block_size
    chunks = unique_chunks(workload, chunk)
    # The pressure is relative (NOTE 1): a state-per-chunk cache of this workload needs
    # `footprint` bytes at this machine's chunk and state dtypes; each tier gets a fraction.
    footprint = chunks * layout.state_per_chunk_bytes()
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
    with _workdir(args.workdir) as work, Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=console,
    ) as progress:
        results = run_interleaved(
            variants, workload, model=model, workdir=work, cpu_gib=gib, disk_gib=gib,
            layout=layout, max_model_len=args.max_model_len, gap=args.gap, progress=progress,
        )
    data = report(console, workload, results, settings)
    console.print(f"total {time.monotonic() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))
    return 0
