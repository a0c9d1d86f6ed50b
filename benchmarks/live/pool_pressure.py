"""Live benchmark on a KV pool smaller than the sessions' working set: preemptions, pool use, loads.

    .venv/bin/python benchmarks/live/pool_pressure.py [--repeats 2] [--pool-mib 32]

The regime where a connector should matter: vLLM's KV pool (``--pool-mib``) holds about two
long prompts, agent sessions send three at once, so vLLM preempts and re-admits requests and
the later turns of a session can only come back from the connector. Every stack is started by
``stacks.start_stack`` (the live benchmark's deployments, same flags and tiers): vLLM alone,
stock LMCache and HiState. Stacks run in ABBA order, ``--repeats`` times.

Workload: ``--sessions`` agent sessions of ``--turns`` turns each; turn ``k + 1`` extends turn
``k`` by 1K-3K tokens; first turns are 18K-22K tokens (seeded, the same in every stack). The tiny
model gets 32K positions (``ensure_tiny_model(max_position_embeddings=32768)``).

Per run, measured on vLLM's and the server's ``/metrics``: peak ``vllm:kv_cache_usage_perc``
(sampled every 0.25 s), ``vllm:num_preemptions_total``, ``vllm:external_prefix_cache_hits_total``
(tokens vLLM took from the connector, first scheduling of each request), vLLM's own prefix-cache
hits, and for HiState the server's ``histate_loaded_tokens_total`` (first RETRIEVE per request)
and ``..._resumed_total``; TTFT per request from the client (``client.timed``). Writes
``pool_pressure.md`` and ``pool_pressure.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import signal
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import client
import openai
import stacks
from serve_openai import metric  # the Prometheus reader of the documented deployment

KEYS = ("vllm", "lmcache", "histate")
MAX_MODEL_LEN = 32768


def workload(sessions: int, turns: int, vocab: int, seed: int) -> list[Any]:
    from lmcache_histate.backends.demo.workload import DemoRequest

    rng = random.Random(seed)
    out = []
    for s in range(sessions):
        tokens = [rng.randrange(10, vocab) for _ in range(rng.randrange(18_000, 22_000))]
        for t in range(turns):
            out.append(DemoRequest(f"s{s}", t, float(t), tuple(tokens), len(tokens)))
            tokens += [rng.randrange(10, vocab) for _ in range(rng.randrange(1_000, 3_000))]
    return out


class PeakSampler:
    """Reads ``vllm:kv_cache_usage_perc`` every ``period`` seconds; ``peak`` is the largest."""

    def __init__(self, stack: stacks.Stack, period: float = 0.25) -> None:
        self.stack, self.period, self.peak = stack, period, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                usage = metric(self.stack.metrics(), "vllm:kv_cache_usage_perc")
            except OSError:
                continue
            self.peak = max(self.peak, usage)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def one_run(stack: stacks.Stack, requests: list[Any], concurrency: int) -> dict[str, Any]:
    with PeakSampler(stack) as sampler:
        rows = asyncio.run(client.replay(stack.base_url, requests, concurrency=concurrency,
                                         think_scale=0.0, think_cap_s=0.0))
    text = stack.metrics()
    run = {
        "ttft": [r.ttft_s for r in rows],
        "first_turn_ttft": [r.ttft_s for r in rows if r.turn == 0],
        "cached_tokens": sum(r.cached_tokens for r in rows),
        "prompt_tokens": sum(r.prompt_tokens for r in rows),
        "peak_pool": sampler.peak,
        "preemptions": metric(text, "vllm:num_preemptions_total"),
        "external_hits": metric(text, "vllm:external_prefix_cache_hits_total"),
        "local_hits": metric(text, "vllm:prefix_cache_hits_total"),
    }
    if stack.key == "histate" and stack.server is not None:
        with urllib.request.urlopen(stack.server.http + "/metrics", timeout=10) as r:
            served = r.read().decode()
        run["server_loaded"] = metric(served, "histate_loaded_tokens_total")
        run["server_loaded_resumed"] = metric(served, "histate_loaded_tokens_resumed_total")
    return run


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def spread(key: str) -> tuple[float, float, float]:
        values = [r[key] for r in runs]
        return statistics.fmean(values), min(values), max(values)

    row = {"runs": len(runs)}
    for key in ("peak_pool", "preemptions", "external_hits", "local_hits", "cached_tokens"):
        row[key] = spread(key)
    for r in runs:
        r["mean_ttft"] = statistics.fmean(r["ttft"])
        r["first_turn_mean_ttft"] = statistics.fmean(r["first_turn_ttft"])
    row["mean_ttft"] = spread("mean_ttft")
    row["first_turn_mean_ttft"] = spread("first_turn_mean_ttft")
    if all("server_loaded" in r for r in runs):
        row["server_loaded"] = spread("server_loaded")
        row["server_loaded_resumed"] = spread("server_loaded_resumed")
        row["loaded_vs_external"] = [
            (r["server_loaded"] - r["external_hits"]) / r["external_hits"]
            if r["external_hits"] else None for r in runs]
    return row


def markdown(data: dict[str, Any], command: str) -> str:
    def cell(v: tuple[float, float, float], fmt: str) -> str:
        return f"{v[0]:{fmt}} ({v[1]:{fmt}}–{v[2]:{fmt}})"

    lay = data["layout"]
    lines = [
        "# Live benchmark: a KV pool smaller than the working set", "",
        f"Command: `{command}`", "",
        f"CPU {lay['isa']}, vLLM {lay['vllm_version']}, block size {lay['block_size']}. "
        f"KV pool {data['pool_mib']} MiB; CPU tier {data['cpu_gib']} GiB, disk "
        f"{data['disk_gib']} GiB (stacks with tiers). {data['requests']} requests "
        f"({data['sessions']} sessions × {data['turns']} turns, {data['prompt_tokens']:,} prompt "
        f"tokens), all sessions at once; {data['repeats']} runs per stack in ABBA order. "
        "Each cell: mean (min–max) over the runs.", "",
        "| stack | peak pool use (%) | preemptions | external hit tokens | vLLM-cache hit "
        "tokens | TTFT mean (s) | first turns mean (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key, s in data["summary"].items():
        peak = tuple(100 * v for v in s["peak_pool"])
        lines.append(
            f"| {stacks.TITLES[key]} | {cell(peak, '.1f')} | {cell(s['preemptions'], '.1f')} | "
            f"{cell(s['external_hits'], ',.0f')} | {cell(s['local_hits'], ',.0f')} | "
            f"{cell(s['mean_ttft'], '.2f')} | {cell(s['first_turn_mean_ttft'], '.2f')} |")
    hs = data["summary"].get("histate")
    if hs and "server_loaded" in hs:
        gaps = ", ".join("n/a" if g is None else f"{100 * g:+.2f} %"
                         for g in hs["loaded_vs_external"])
        lines += ["", "HiState server counters: `histate_loaded_tokens_total` "
                  f"{cell(hs['server_loaded'], ',.0f')} against vLLM's external hits "
                  f"(per run: {gaps}); `histate_loaded_tokens_resumed_total` "
                  f"{cell(hs['server_loaded_resumed'], ',.0f')} (loads of resumed requests, "
                  "which vLLM does not export)."]
    if data["errors"]:
        lines += ["", "Refused at start (verbatim):", ""]
        lines += [f"* {k}: `{v}`" for k, v in data["errors"].items()]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lmcache_histate.backends.demo.engine_proc import ENGINE_DTYPE
    from lmcache_histate.backends.demo.tiny_model import ensure_tiny_model
    from lmcache_histate.backends.vllm.engine_facts import probe

    out = Path(args.out).resolve()
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    model = ensure_tiny_model(max_position_embeddings=MAX_MODEL_LEN)
    layout = probe(model, dtype=ENGINE_DTYPE)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    requests = workload(args.sessions, args.turns, vocab, seed=34)
    budget = stacks.Budget(args.pool_mib << 20, int(args.cpu_gib * 2**30),
                           int(args.disk_gib * 2**30))
    keys = [k for k in KEYS if k in args.stacks.split(",")]
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in keys}
    errors: dict[str, str] = {}
    started = time.monotonic()
    for rep in range(args.repeats):
        for key in keys if rep % 2 == 0 else keys[::-1]:
            print(f"[run {rep + 1}/{args.repeats}] {stacks.TITLES[key]} "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
            try:
                with stacks.start_stack(key, model=model, layout=layout, budget=budget,
                                        work=work / f"rep{rep}", max_model_len=MAX_MODEL_LEN,
                                        errors=errors) as stack:
                    result = one_run(stack, requests, args.sessions)
            except stacks.StackError as exc:
                print(f"  did not start: {exc}", flush=True)
                continue
            except (OSError, openai.APIError) as exc:  # the stack died mid-run
                errors[f"{key} run {rep + 1}"] = f"{type(exc).__name__}: {exc}"
                print(f"  failed: {errors[f'{key} run {rep + 1}']}", flush=True)
                continue
            runs[key].append(result)
            print(f"  peak pool {100 * result['peak_pool']:.1f} %, preemptions "
                  f"{result['preemptions']:.0f}, external hits {result['external_hits']:.0f}, "
                  f"TTFT mean {statistics.fmean(result['ttft']):.2f} s", flush=True)
    return {"layout": layout.__dict__, "pool_mib": args.pool_mib, "cpu_gib": args.cpu_gib,
            "disk_gib": args.disk_gib, "sessions": args.sessions, "turns": args.turns,
            "requests": len(requests), "prompt_tokens": sum(len(r.prompt) for r in requests),
            "repeats": args.repeats, "errors": errors,
            "summary": {k: summarize(v) for k, v in runs.items() if v}, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--sessions", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--pool-mib", type=int, default=32)
    p.add_argument("--cpu-gib", type=float, default=0.25)
    p.add_argument("--disk-gib", type=float, default=0.5)
    p.add_argument("--stacks", default=",".join(KEYS))
    p.add_argument("--out", default="benchmarks/live/results-pool-pressure")
    args = p.parse_args(argv)
    # A stopped benchmark stops its stacks too (their context managers run on SystemExit;
    # each stack is its own process group, which a plain SIGTERM would leave running).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    data = run(args)
    out = Path(args.out)
    command = "python benchmarks/live/pool_pressure.py " + shlex.join(argv or sys.argv[1:])
    (out / "pool_pressure.json").write_text(json.dumps(data, indent=1))
    (out / "pool_pressure.md").write_text(markdown(data, command.strip()))
    print(markdown(data, command.strip()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
